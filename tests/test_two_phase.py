"""Searchable first, vectors after (issue 32, point 2, as far as it goes): while a first ingest is still encoding,
another process already finds its committed papers by keyword, and a hybrid search says how far the vectors are;
killed while encoding, the library is consistent and the next ingest adds exactly the missing vectors. With real
all-MiniLM-L6-v2 on generated multi-page papers."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT, assert_db_ok, clean_env, use_minilm

sys.path.insert(0, str(ROOT / "examples"))
import sample_papers  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.model]

PAPERS = 40


def _call(command: str, payload: dict, env: dict) -> dict:
    done = subprocess.run([sys.executable, str(ROOT / "kb_engine.py"), command], input=json.dumps(payload),
                          capture_output=True, text=True, env=env, timeout=300)
    return json.loads(done.stdout)


def _counts(kb) -> tuple[int, int]:
    import sqlite3
    if not (kb / "kb.sqlite").exists():
        return 0, 0
    conn = sqlite3.connect(f"file:{kb / 'kb.sqlite'}?mode=ro", uri=True)
    try:
        chunks = conn.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]
        vectors = conn.execute("SELECT COUNT(*) FROM vecs").fetchone()[0]
    except sqlite3.OperationalError:         # the schema is not written yet
        return 0, 0
    finally:
        conn.close()
    return chunks, vectors


def test_keyword_answers_before_vectors_and_a_kill_converges(tmp_path, monkeypatch):
    folder = use_minilm(monkeypatch)
    papers = tmp_path / "papers"
    for i in range(PAPERS):
        sample_papers.make_filler_paper(papers, i, pages=4)
    kb = tmp_path / "kb"
    env = clean_env(KB_EMBED_MODEL=str(folder), HF_HUB_OFFLINE="1", KB_RERANK_FALLBACK="none",
                    KB_CACHE_DIR=str(tmp_path / "cache"), KB_EMBED_THREADS="1", KB_INGEST_WORKERS="1")
    ingest = subprocess.Popen([sys.executable, str(ROOT / "kb_engine.py"), "ingest"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    ingest.stdin.write(json.dumps({"paths": [str(papers)], "kb_root": str(kb), "background": False}).encode())
    ingest.stdin.close()
    title = None
    try:
        deadline = time.monotonic() + 240
        seen_early = None
        while time.monotonic() < deadline and ingest.poll() is None:
            chunks, vectors = _counts(kb)
            if chunks and vectors < chunks:
                if title is None:
                    import sqlite3
                    conn = sqlite3.connect(f"file:{kb / 'kb.sqlite'}?mode=ro", uri=True)
                    title = conn.execute("SELECT title FROM docs WHERE status = 'indexed' ORDER BY id").fetchone()[0]
                    conn.close()
                found = _call("search", {"query": title, "kb_root": str(kb), "mode": "hybrid", "top_k": 3}, env)
                if found.get("results") and _counts(kb)[1] < _counts(kb)[0]:
                    seen_early = found
                    break
            time.sleep(0.3)
        assert seen_early is not None, "no search ran while vectors were still missing"
        assert seen_early["results"][0]["title"] == title
        vectors = seen_early.get("vectors")
        if vectors is not None:              # the vector half ran on what exists, and says how far it is
            assert vectors["missing"] > 0 and "vectors cover" in seen_early["note"]
        else:                                # no vector yet at all: keyword only, with the reason
            assert "vector search unavailable" in seen_early["note"]
    finally:
        if ingest.poll() is None:
            os.killpg(ingest.pid, signal.SIGKILL)
        ingest.wait(timeout=60)
    assert_db_ok(kb)
    chunks, vectors = _counts(kb)
    assert chunks > 0
    again = _call("ingest", {"paths": [str(papers)], "kb_root": str(kb), "background": False}, env)
    assert again["ok"], again
    chunks, vectors = _counts(kb)
    assert vectors == chunks and again["totals"]["vectors_missing"] == 0, again["totals"]
    stats = _call("stats", {"kb_root": str(kb)}, env)
    assert stats["vectors"] == stats["chunks"] == chunks and stats["docs"] == PAPERS
    found = _call("search", {"query": title, "kb_root": str(kb), "mode": "hybrid"}, env)
    assert found["vectors"]["missing"] == 0 and "note" not in found


def _filler_library(tmp_path, monkeypatch) -> tuple:
    """PAPERS generated multi-page papers and the environment of a resident engine with MiniLM on one thread."""
    folder = use_minilm(monkeypatch)
    papers = tmp_path / "papers"
    for i in range(PAPERS):
        sample_papers.make_filler_paper(papers, i, pages=4)
    return papers, clean_env(KB_EMBED_MODEL=str(folder), HF_HUB_OFFLINE="1", KB_RERANK_FALLBACK="none",
                             KB_CACHE_DIR=str(tmp_path / "cache"), KB_EMBED_THREADS="1")


class Serve:
    """A resident engine (``kb_engine.py serve``) driven line by line."""

    def __init__(self, env: dict):
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "kb_engine.py"), "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self.count = 0

    def call(self, command: str, payload: dict) -> dict:
        self.count += 1
        self.proc.stdin.write(json.dumps({"id": self.count, "command": command, "payload": payload}) + "\n")
        self.proc.stdin.flush()
        while True:
            reply = json.loads(self.proc.stdout.readline())
            if reply.get("event") is None:
                assert reply["id"] == self.count and reply["ok"], reply
                return reply["response"]

    def close(self) -> float:
        started = time.monotonic()
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        return time.monotonic() - started


def test_serve_answers_an_ingest_before_its_vectors_and_finishes_them(tmp_path, monkeypatch):
    papers, env = _filler_library(tmp_path, monkeypatch)
    kb = tmp_path / "kb"
    serve = Serve(env)
    try:
        answer = serve.call("ingest", {"paths": [str(papers)], "kb_root": str(kb), "background": False})
        totals = answer["totals"]
        assert totals["added"] == PAPERS and answer["vectors_pending"] == totals["vectors_missing"] > 0, totals
        assert "being added in the background" in answer["note"]
        title = serve.call("docs", {"kb_root": str(kb), "limit": 1})["docs"][0]["title"]
        early = serve.call("search", {"query": title, "kb_root": str(kb), "mode": "hybrid", "top_k": 3})
        assert early["results"][0]["title"] == title          # found by keyword while vectors are missing
        assert ("first vectors are being added in the background" in early["note"]
                or "vectors cover" in early["note"]), early["note"]
        seen = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            progress = serve.call("status", {"kb_root": str(kb)})["vectors"]
            seen.append(progress["done"])
            if not progress["running"]:
                break
            time.sleep(1)
        assert progress["error"] is None and not progress["running"]
        assert seen == sorted(seen) and seen[0] < totals["chunks"], seen
        stats = serve.call("stats", {"kb_root": str(kb)})
        assert stats["vectors"] == stats["chunks"] == totals["chunks"], stats
        final = serve.call("search", {"query": title, "kb_root": str(kb), "mode": "hybrid"})
        assert final["vectors"]["missing"] == 0 and "note" not in final
    finally:
        serve.close()


def test_a_daemon_that_exits_mid_vectors_leaves_them_to_the_next_ingest(tmp_path, monkeypatch):
    papers, env = _filler_library(tmp_path, monkeypatch)
    kb = tmp_path / "kb"
    serve = Serve(env)
    answer = serve.call("ingest", {"paths": [str(papers)], "kb_root": str(kb), "background": False})
    assert answer["vectors_pending"] > 0
    assert serve.close() < 60                   # the host closes the pipe: the daemon does not linger
    assert_db_ok(kb)
    chunks, vectors = _counts(kb)
    assert vectors < chunks
    again = _call("ingest", {"paths": [str(papers)], "kb_root": str(kb), "background": False}, env)
    assert again["totals"]["skipped"] == PAPERS and again["totals"]["vectors_written"] == chunks - vectors
    assert _counts(kb) == (chunks, chunks)


@pytest.mark.internals
def test_a_background_job_says_its_text_is_searchable_while_it_adds_vectors(tmp_path, monkeypatch):
    papers, env = _filler_library(tmp_path, monkeypatch)
    env["KB_ASYNC_THRESHOLD"] = "5"
    kb = tmp_path / "kb"
    started = _call("ingest", {"paths": [str(papers)], "kb_root": str(kb)}, env)
    job_id = started["job_id"]
    seen_searchable = None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        job = _call("status", {"kb_root": str(kb), "job_id": job_id}, env)["job"]
        if job["state"] == "running" and job["searchable"] and seen_searchable is None:
            seen_searchable = job
            title = _call("docs", {"kb_root": str(kb), "limit": 1}, env)["docs"][0]["title"]
            found = _call("search", {"query": title, "kb_root": str(kb), "mode": "keyword", "top_k": 3}, env)
            assert found["results"][0]["title"] == title
        if job["state"] not in ("queued", "running"):
            break
        time.sleep(0.5)
    assert job["state"] == "done", job
    assert seen_searchable is not None, "the job never reported its text indexed before its vectors were done"
    assert seen_searchable["phase"] == "embed" and seen_searchable["done"] == PAPERS
    assert seen_searchable["phase_done"] < seen_searchable["phase_total"]
    import kb_engine
    line = kb_engine.render_status({"job": seen_searchable})
    assert "the text is indexed and searchable; adding vectors" in line, line
    assert job["result"]["totals"]["vectors_missing"] == 0
    assert _counts(kb)[0] == _counts(kb)[1] > 0
