"""serve mode: JSON lines in, exactly one reply per non-empty line out."""
from __future__ import annotations

import json
import subprocess
import sys
import time

from helpers import ENGINE, PARSE_ERROR_CODES, ROOT, clean_env, replies_only, req, serve, sp


def test_serve_session(tmp_path, sample_dir, kb_engine):
    kb = tmp_path / "kb"
    lines = [
        req(1, "ingest", {"paths": [str(sample_dir)], "kb_root": str(kb)}),
        req("two", "search", {"query": "graphene nucleation on copper", "kb_root": str(kb), "top_k": 3}),
        b"",  # empty line: no reply
        req(3, "stats", {"kb_root": str(kb)}),
        req(4, "docs", {"kb_root": str(kb), "limit": 2}),
        req(5, "frobnicate", {}),
        b'{"id": 6, "command": "search", "payload": ',                      # invalid JSON
        b'{"id": 7, "command": "search", "payload": {"query": "\xff\xfe"}}',  # invalid UTF-8
        req(8, "search", {"query": "graphene", "top_k": "x", "kb_root": str(kb)}),
        json.dumps({"id": 9, "command": "search", "payload": ["graphene"]}).encode(),
        json.dumps({"id": 10, "command": 12, "payload": {}}).encode(),
        b"[1, 2, 3]",
        req(11, "clear", {"kb_root": str(kb)}),
        req("", "search", {"query": "molten globule", "kb_root": str(kb)}),
        req(13, "stats"),  # no payload: defaults apply (KB_ROOT from the environment)
        req(14, "dedup", {"kb_root": str(kb)}),
    ]
    rc, out, err = serve(lines, env=clean_env(KB_ROOT=kb))
    assert rc == 0, err[-3000:]
    replies = replies_only(out)
    expected_ids = [1, "two", 3, 4, 5, None, None, 8, 9, 10, None, 11, "", 13, 14]
    got_ids = [r.get("id") for r in replies]
    assert len(got_ids) == len(expected_ids), got_ids
    if got_ids[6] == 7:  # an undecodable line may still be answered with its id, but as an error
        got_ids[6] = None
    assert got_ids == expected_ids, got_ids
    r = {i: rep for i, rep in enumerate(replies)}
    for rep in replies:
        assert isinstance(rep["ok"], bool)
        if rep["ok"]:
            assert "response" in rep and rep["response"]["engine"] == kb_engine.__version__
            assert isinstance(rep["response"]["ms"], int)
        else:
            assert isinstance(rep["error"], str) and rep["error"].strip() and isinstance(rep["code"], str)
    ok = [rep["ok"] for rep in replies]
    assert ok == [True, True, True, True, False, False, False, False, False, False, False, False, True, True, True]
    assert r[0]["response"]["totals"]["files"] == 13
    assert r[1]["response"]["results"][0]["file"] == "graphene_cvd_copper.pdf"
    assert len(r[1]["response"]["results"]) <= 3
    assert sum(r[2]["response"]["by_status"].values()) == 13
    assert len(r[3]["response"]["docs"]) == 2
    assert r[4]["code"] == "unknown_command"
    for i in (5, 6):  # unparseable lines
        assert r[i]["code"] in PARSE_ERROR_CODES, (i, r[i])
    for i in (7, 8, 10):  # parsed, but wrong types
        assert r[i]["code"] == "bad_request", (i, r[i])
    assert r[9]["code"] in ("bad_request", "unknown_command"), r[9]
    assert r[11]["code"] == "confirm_required"
    assert sum(r[13]["response"]["by_status"].values()) == 13


def test_serve_echoes_any_id(tmp_path):
    """The contract's request id is "any" JSON value: it comes back unchanged."""
    ids = [{"nested": [1, {"a": None}]}, [1, "x"], True, False, 0, -7, 2.5, "", "é中", 2 ** 70]
    lines = [req(i, "stats", {"kb_root": str(tmp_path / "kb")}) for i in ids]
    lines += [req(i, "frobnicate", {}) for i in ids]
    rc, out, _ = serve(lines)
    assert rc == 0
    got = [r.get("id") for r in replies_only(out)]
    assert got == ids + ids, got


def test_ingest_progress_before_reply(tmp_path):
    kb = tmp_path / "kb"
    lib = tmp_path / "lib"
    paths = [sp.make_onecolumn_paper(lib), sp.make_hyphenated_paper(lib), sp.make_markdown(lib),
             sp.make_empty_pdf(lib)]
    rc, out, err = serve([req("ing", "ingest", {"paths": [str(lib)], "kb_root": str(kb)}),
                          req("s", "search", {"query": "desolvation", "kb_root": str(kb)})])
    assert rc == 0, err[-2000:]
    progress = [ln for ln in out if ln.get("event") == "progress"]
    replies = replies_only(out)
    assert [r["id"] for r in replies] == ["ing", "s"]
    reply_at = out.index(replies[0])
    assert progress, "no progress events"
    assert all(out.index(p) < reply_at for p in progress), "progress after the reply"
    assert all(p["id"] == "ing" for p in progress)
    assert all(p["total"] == len(paths) for p in progress)
    done = [p["done"] for p in progress]
    assert done == sorted(done) and max(done) <= len(paths) and min(done) >= 0
    assert {p["path"] for p in progress if p.get("path")} <= {str(p) for p in paths}
    assert replies[1]["response"]["results"][0]["file"] == "battery_electrolytes.pdf"


def test_serve_interactive_replies_before_eof(tmp_path):
    """Each reply is flushed when its request is done (a host waits for it)."""
    kb = tmp_path / "kb"
    paper = sp.make_ligature_paper(tmp_path)
    proc = subprocess.Popen([sys.executable, str(ENGINE), "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, cwd=str(ROOT), env=clean_env())
    try:
        def ask(line):
            proc.stdin.write(line + b"\n")
            proc.stdin.flush()
            while True:
                raw = proc.stdout.readline()
                assert raw, "serve closed stdout"
                msg = json.loads(raw)
                if msg.get("event") != "progress":
                    return msg
        t0 = time.time()
        a = ask(req(1, "ingest", {"paths": [str(paper)], "kb_root": str(kb)}))
        assert a["id"] == 1 and a["ok"], a
        b = ask(req(2, "search", {"query": "quantum efficiency", "kb_root": str(kb)}))
        assert b["id"] == 2 and b["response"]["results"], b
        c = ask(b"garbage")
        assert c["id"] is None and c["ok"] is False
        d = ask(req(3, "stats", {"kb_root": str(kb)}))
        assert d["id"] == 3 and d["ok"]
        assert time.time() - t0 < 60
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_eof_without_requests_exits_0():
    proc = subprocess.run([sys.executable, str(ENGINE), "serve"], input=b"", capture_output=True, timeout=60,
                          cwd=str(ROOT), env=clean_env())
    assert proc.returncode == 0
    assert proc.stdout.strip() == b""
