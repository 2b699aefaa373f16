"""A real, messy library: one bad file never sinks a batch, every limit holds, every failure says why.

One test per defect of the hostile-input run: undecodable file names, a NUL byte in a path, DOCX files that
expand to hundreds of megabytes, a server that drips its body, a disk that fills up mid-ingest, deeply nested
and oversized payloads, loose types, unreadable folders, Zotero collection and tag filters, and the command
line's exit codes, help and offline model downloads. Every file is generated here.
"""
from __future__ import annotations

import http.server
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import hostile_files
from helpers import ENGINE, clean_env, run_cli, serve, sp

GBK_NAME = "物理论文_钙钛矿.pdf".encode("gbk")


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("KB_EMBED_MODEL", "none")


def ingest(engine, kb, paths, **payload):
    return engine.execute("ingest", {"paths": [str(p) for p in paths], "kb_root": str(kb), **payload})


def by_name(reply):
    return {Path(f["path"]).name: f for f in reply["files"]}


# 1. file names that are not valid UTF-8 --------------------------------------------------------------------

def test_a_gbk_named_file_is_indexed_shown_readably_and_managed_like_any_other(engine, tmp_path, offline):
    folder = tmp_path / "unzipped"
    good = sp.make_hyphenated_paper(folder)
    gbk_source = sp.make_ligature_paper(tmp_path / "src")
    gbk_path = os.fsencode(folder) + b"/" + GBK_NAME
    shutil.copyfile(gbk_source, gbk_path)
    kb = tmp_path / "kb"

    first = by_name(ingest(engine, kb, [folder]))
    readable = "物理论文_钙钛矿.pdf"
    assert first[readable]["status"] == "added" and first[good.name]["status"] == "added"
    again = by_name(ingest(engine, kb, [folder]))
    assert again[readable]["status"] == "skipped" and again[readable]["reason"] == "unchanged"

    docs = {Path(d["path"]).name: d for d in engine.execute("docs", {"kb_root": str(kb)})["docs"]}
    assert docs[readable]["exists"] is True and docs[readable]["chunks"] > 0
    hits = engine.execute("search", {"query": "strontium titanate photocatalyst", "kb_root": str(kb),
                                     "mode": "keyword"})["results"]
    assert hits and hits[0]["file"] == readable
    json.dumps(hits, ensure_ascii=False).encode("utf-8")          # every field can be sent as UTF-8 JSON
    refreshed = engine.execute("ingest", {"metadata_only": True, "kb_root": str(kb)})
    assert refreshed["totals"]["error"] == 0 and refreshed["totals"]["updated"] == 2
    removed = engine.execute("delete", {"paths": [docs[readable]["path"]], "kb_root": str(kb)})
    assert [Path(d["path"]).name for d in removed["deleted"]] == [readable]


# 2. a NUL byte in one requested path -----------------------------------------------------------------------

def test_a_nul_byte_in_one_path_is_one_error_entry(engine, tmp_path, offline):
    good = sp.make_hyphenated_paper(tmp_path / "in")
    reply = ingest(engine, tmp_path / "kb", [str(tmp_path / "in" / "bad\x00name.pdf"), good])
    entries = reply["files"]
    assert [e["status"] for e in entries] == ["error", "added"]
    assert entries[0]["reason"] == "bad_path" and "NUL" in entries[0]["error"]


# 3. documents that expand past the limits ------------------------------------------------------------------

def test_docx_expanding_to_hundreds_of_megabytes_is_refused_fast_with_bounded_memory(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    hostile_files.docx_many_paragraphs(folder / "bomb_200mb.docx", 200)
    hostile_files.docx_one_long_run(folder / "one_run_100mb.docx", 100)
    good = sp.make_hyphenated_paper(folder)
    probe = ("import resource, subprocess, sys, time\n"
             "t = time.monotonic()\n"
             "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
             "print(p.stdout)\n"
             "print('SECONDS', time.monotonic() - t)\n"
             "print('PEAK_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
    out = subprocess.run([sys.executable, "-c", probe, sys.executable, str(ENGINE), "ingest", str(folder),
                          "--kb-root", str(tmp_path / "kb"), "--json"],
                         capture_output=True, text=True, timeout=300, env=clean_env(KB_EMBED_MODEL="none")).stdout
    reply = json.loads(out[:out.index("SECONDS")])
    seconds = float(out.split("SECONDS")[1].split()[0])
    peak_mb = int(out.split("PEAK_KB")[1].split()[0]) / 1024
    entries = by_name(reply)
    assert entries[good.name]["status"] == "added"
    for name in ("bomb_200mb.docx", "one_run_100mb.docx"):
        assert entries[name]["status"] == "error" and entries[name]["reason"] == "too_large", entries[name]
    assert "KB_DOCX_MAX" in entries["bomb_200mb.docx"]["error"]
    assert seconds < 60 and peak_mb < 1024, (seconds, peak_mb)


def test_text_and_passage_limits_have_overrides(engine, tmp_path, offline, monkeypatch):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "huge.txt").write_text("Recharge estimates from chloride mass balance. " * 50_000, encoding="utf-8")
    paper = sp.make_hyphenated_paper(folder)
    monkeypatch.setenv("KB_TEXT_MAX_MB", "1")
    monkeypatch.setenv("KB_MAX_CHUNKS", "3")
    entries = by_name(ingest(engine, tmp_path / "kb", [folder]))
    assert entries["huge.txt"]["reason"] == "too_large" and "KB_TEXT_MAX_MB" in entries["huge.txt"]["error"]
    assert entries[paper.name]["reason"] == "too_large" and "KB_MAX_CHUNKS" in entries[paper.name]["error"]


# 4. a server that drips its body ---------------------------------------------------------------------------

def test_the_fetch_deadline_bounds_a_slow_drip_download(engine, tmp_path, monkeypatch):
    class Drip(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "application/pdf")
            self.send_header("Content-Length", "100000")
            self.end_headers()
            try:
                self.wfile.write(b"%PDF-1.4\n")
                for _ in range(100):
                    time.sleep(0.2)
                    self.wfile.write(b"x")
                    self.wfile.flush()
            except OSError:
                pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Drip)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("KB_FETCH_TIMEOUT", "1")
    monkeypatch.setenv("KB_FETCH_DEADLINE", "2")
    started = time.monotonic()
    try:
        with pytest.raises(Exception) as err:
            engine.execute("fetch", {"identifier": f"http://127.0.0.1:{server.server_port}/paper.pdf",
                                     "kb_root": str(tmp_path / "kb"), "dest": str(tmp_path / "dl")})
    finally:
        server.shutdown()
    assert time.monotonic() - started < 4.0        # within twice the deadline
    assert err.value.code == "fetch_failed" and "KB_FETCH_DEADLINE" in err.value.message


# 5. the disk fills up mid-ingest ---------------------------------------------------------------------------

@pytest.mark.internals
def test_a_full_disk_names_itself_keeps_what_was_stored_and_resumes(engine, kb_engine, tmp_path, offline):
    folder = tmp_path / "in"
    for i in range(5):
        sp.make_filler_paper(folder, i, pages=3)
    files = sorted(folder.iterdir())
    kb = tmp_path / "kb"
    ingest(engine, kb, files[:2])
    lib = engine.library(kb.absolute(), writable=True)
    pages = lib.conn.execute("PRAGMA page_count").fetchone()[0]
    lib.conn.execute(f"PRAGMA max_page_count = {pages + 12}")    # SQLite answers SQLITE_FULL past this size
    with pytest.raises(kb_engine.KBError) as err:
        ingest(engine, kb, [folder])
    reply = kb_engine.error_reply(err.value)
    assert reply["code"] == "disk_full" and str(kb) in reply["error"] and "free" in reply["error"]
    statuses = [f["status"] for f in reply["files"]]
    assert statuses[:2] == ["skipped", "skipped"] and "added" in statuses and statuses[-1] == "error"
    assert reply["files"][-1]["reason"] == "disk_full"
    stored = {d["file"] for d in engine.execute("docs", {"kb_root": str(kb)})["docs"]}
    assert stored == {Path(f["path"]).name for f in reply["files"] if f["status"] in ("added", "skipped")}
    lib.conn.execute("PRAGMA max_page_count = 1073741823")
    resumed = ingest(engine, kb, [folder])
    assert resumed["totals"]["error"] == 0 and resumed["totals"]["added"] == 5 - len(stored)
    with sqlite3.connect(kb / "kb.sqlite") as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


# 6. wrong codes and loose types ----------------------------------------------------------------------------

def _nested(depth):
    value = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("command, payload", [
    ("ingest", {"paths": _nested(900)}),
    ("search", {"query": "x", "filters": {"title": _nested(900)}}),
    ("search", {"query": "x", "filters": {"title": "a" * 100_000}}),
    ("search", {"query": "x", "filters": 0}),
    ("search", {"query": "x", "filters": ""}),
    ("search", {"query": "x", "filters": []}),
    ("search", {"query": "x", "mode": ""}),
    ("search", {"query": "x", "depth": ""}),
    ("rag", {"query": "x", "depth": ""}),
    ("search", {"query": "word " * 5_000}),
])
def test_malformed_payloads_are_bad_requests(engine, tmp_path, offline, kb_engine, command, payload):
    with pytest.raises(kb_engine.KBError) as err:
        engine.execute(command, {**payload, "kb_root": str(tmp_path / "kb")})
    assert err.value.code == "bad_request"


# 7. folders that cannot be read ----------------------------------------------------------------------------

@pytest.fixture
def locked_folder(tmp_path, monkeypatch):
    """A folder the walk cannot list: by its permissions, or (as root, who reads everything) by os.scandir."""
    top = tmp_path / "library"
    sp.make_hyphenated_paper(top)
    locked = top / "locked"
    sp.make_ligature_paper(locked)
    if os.geteuid() == 0:
        real = os.scandir

        def scandir(path="."):
            if os.fspath(path) == str(locked):
                raise PermissionError(13, "Permission denied", str(locked))
            return real(path)
        monkeypatch.setattr(os, "scandir", scandir)
        yield top, locked
    else:
        locked.chmod(0)
        yield top, locked
        locked.chmod(0o755)


def test_an_unreadable_subfolder_is_an_entry_not_a_silence(engine, tmp_path, offline, locked_folder):
    top, locked = locked_folder
    entries = ingest(engine, tmp_path / "kb", [top])["files"]
    unreadable = [e for e in entries if e.get("reason") == "unreadable"]
    assert [e["path"] for e in unreadable] == [str(locked)] and "cannot be read" in unreadable[0]["error"]
    assert any(e["status"] == "added" for e in entries)
    named = ingest(engine, tmp_path / "kb2", [locked])["files"]
    assert [(e["path"], e["status"], e["reason"]) for e in named] == [(str(locked), "error", "unreadable")]


# 8. Zotero collections and tags match whole names ----------------------------------------------------------

def test_collection_and_tag_filters_match_whole_names(engine, tmp_path, offline):
    folder = tmp_path / "in"
    physics, graphene = sp.make_hyphenated_paper(folder), sp.make_ligature_paper(folder)
    kb = tmp_path / "kb"
    ingest(engine, kb, [folder])
    with sqlite3.connect(kb / "kb.sqlite") as conn:
        conn.execute("UPDATE docs SET collections = ?, tags = ? WHERE path = ?",
                     (json.dumps(["Physics"]), json.dumps(["Deep learning"]), str(physics)))
        conn.execute("UPDATE docs SET collections = ?, tags = ? WHERE path = ?",
                     (json.dumps(["Materials/Graphene"]), json.dumps(["ML"]), str(graphene)))

    def files(**filters):
        hits = engine.execute("search", {"query": "efficiency results", "kb_root": str(kb), "mode": "keyword",
                                         "top_k": 50,
                                         "cache": False, "filters": filters})["results"]
        return sorted({h["file"] for h in hits})

    assert files(collection="CS") == []                                  # not physi-CS
    assert files(collection="physics") == [physics.name]
    assert files(collection="Materials") == files(collection="graphene") == [graphene.name]
    assert files(collection="Materials/Graphene/CVD") == []
    assert files(tag="learning") == [] and files(tag="deep LEARNING") == [physics.name]
    assert files(tag="M") == [] and files(tag=["ml", "nothing"]) == [graphene.name]


# 9. the command line ---------------------------------------------------------------------------------------

def test_cli_ingest_exits_1_when_every_file_failed(tmp_path):
    bad = tmp_path / "broken.pdf"
    bad.write_bytes(b"%PDF-1.4 not really")
    result = run_cli("ingest", None, str(bad), "--kb-root", str(tmp_path / "kb"),
                     env=clean_env(KB_EMBED_MODEL="none"))
    assert result.rc == 1 and "every file failed" in result.stderr


def test_cli_cite_names_missing_ids_and_exits_1(tmp_path):
    paper = sp.make_hyphenated_paper(tmp_path / "in")
    env = clean_env(KB_EMBED_MODEL="none")
    assert run_cli("ingest", None, str(paper), "--kb-root", str(tmp_path / "kb"), env=env).rc == 0
    result = run_cli("cite", None, "--doc-ids", "999", "--kb-root", str(tmp_path / "kb"), env=env)
    assert result.rc == 1 and "999" in result.stderr and result.stdout.strip() == ""
    found = run_cli("cite", None, "--doc-ids", "1", "--kb-root", str(tmp_path / "kb"), env=env)
    assert found.rc == 0 and found.stdout.startswith("@")


def test_cli_help_is_usage_with_every_command_described():
    result = run_cli("--help", None)
    assert result.rc == 0 and "usage: kb-engine" in result.stdout
    assert "Contents (each layer" not in result.stdout          # not the module's internal docstring
    for command in ("ingest", "search", "rag", "cite", "stats", "docs", "dedup", "clear", "reembed", "models"):
        line = next((ln for ln in result.stdout.splitlines() if ln.strip().startswith(command + " ")), "")
        assert len(line.split()) > 1, f"{command} has no description"
    for command in ("search", "cite", "stats"):
        sub = run_cli(command, None, "--help")
        assert sub.rc == 0 and "KB_ROOT_SUB" not in sub.stdout and "KB_ROOT" in sub.stdout


@pytest.mark.slow      # waits out a download time box
def test_a_failed_model_download_is_not_retried_by_every_ingest(tmp_path):
    paper = sp.make_hyphenated_paper(tmp_path / "in")
    env = clean_env(KB_EMBED_MODEL="kb-test/no-such-model", KB_DOWNLOAD_TIMEOUT=20,
                    HF_ENDPOINT="http://127.0.0.1:9", XDG_CACHE_HOME=str(tmp_path / "cache"))
    env.pop("HF_HUB_OFFLINE", None)
    first = run_cli("ingest", None, str(paper), "--kb-root", str(tmp_path / "kb"), "--json", env=env)
    assert "could not be downloaded" in json.loads(first.stdout)["note"]
    started = time.monotonic()
    second = run_cli("ingest", None, str(paper), "--kb-root", str(tmp_path / "kb"), "--force", "--json", env=env)
    note = json.loads(second.stdout)["note"]
    assert "tried again after" in note and "KB_DOWNLOAD_RETRY_S" in note
    assert time.monotonic() - started < 15
    remembered = json.loads((tmp_path / "cache" / "kb-rag" / "failed-downloads.json").read_text())
    assert "kb-test/no-such-model" in remembered


def test_language_note_does_not_claim_vectors_that_were_not_used(engine, tmp_path, offline):
    paper = sp.make_hyphenated_paper(tmp_path / "in")
    ingest(engine, tmp_path / "kb", [paper])
    reply = engine.execute("search", {"query": "锂金属负极电解液", "kb_root": str(tmp_path / "kb"), "mode": "keyword"})
    assert "lang_note" in reply and "vector similarity" in reply["lang_note"]
    assert "lean on vector similarity" not in reply["lang_note"] and "no vector similarity" in reply["lang_note"]


@pytest.mark.slow      # fills a real tmpfs
def test_a_real_full_tmpfs_is_named_as_a_full_disk(tmp_path):
    """The same on a real file system that runs out of space, where this machine lets the test mount one."""
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    mount, umount = shutil.which("mount"), shutil.which("umount")
    if os.geteuid() != 0 or not mount or not umount or subprocess.run(
            [mount, "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount_point)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (the SQLITE_FULL test above covers the engine's side)")
    try:
        folder = tmp_path / "in"
        for i in range(30):
            sp.make_filler_paper(folder, i, pages=6)
        env = clean_env(KB_EMBED_MODEL="none", KB_ASYNC_THRESHOLD=1000)       # in the foreground
        reply = run_cli("ingest", {"paths": [str(folder)], "kb_root": str(mount_point / "kb")}, env=env).json
        assert reply["ok"] is False and reply["code"] == "disk_full" and str(mount_point / "kb") in reply["error"]
        stored = [f for f in reply["files"] if f["status"] == "added"]
        assert stored and reply["files"][-1]["reason"] == "disk_full"
        search = run_cli("search", {"query": "filler", "kb_root": str(mount_point / "kb"), "mode": "keyword"},
                         env=env).json
        assert search["ok"] is True
    finally:
        for _ in range(10):          # the engine's last file handles may close a moment after it exits
            if subprocess.run([umount, str(mount_point)], capture_output=True).returncode == 0:
                break
            time.sleep(0.3)


@pytest.mark.parametrize("raw, code", [(b"[" * 100_000 + b"]" * 100_000, "bad_request"),
                                       (b'{"query": ' * 50_000 + b"1" + b"}" * 50_000, "bad_request"),
                                       (b"\xff\xfe", "invalid_utf8"), (b"[1, 2]", "bad_request")])
def test_both_transports_read_json_with_one_parser(tmp_path, raw, code):
    """One parser for the command line and serve: a nesting too deep for it is refused as the payload depth is
    (bad_request, issue 50), bytes that are not UTF-8 and JSON that is not an object get their own codes."""
    one_shot = run_cli("stats", stdin=raw, env=clean_env(KB_ROOT=str(tmp_path / "kb")))
    assert one_shot.rc == 1 and one_shot.json["code"] == code, one_shot.stdout[:300]
    rc, replies, _ = serve([raw + b"\n"], env=clean_env(KB_ROOT=str(tmp_path / "kb")))
    assert rc == 0 and [r["code"] for r in replies] == [code]
