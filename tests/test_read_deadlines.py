"""Every read of a file runs under a deadline (issue 50, points 3 and 11): a file whose page never finishes (the
PDF "billion laughs": drawings nested into billions of strokes, tests/hostile_files.nested_drawing_pdf) is stopped
past KB_READ_SECONDS with a ``timed_out`` entry while the rest of the batch is stored; a cancelled job stops at
once even while its reader is stuck; and a file is committed as soon as it is read, so a short paper ahead of a
long file is stored (and survives a kill) while the long one is still being read.

The nested PDFs here are deep enough that no machine reads them within the test's bounds: the deadline (or the
cancel) is the only way any of these batches can end, so the tests check the mechanism, not a machine's speed.
"""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import crashing_reader
from helpers import ENGINE, ROOT, clean_env, sp
from hostile_files import nested_drawing_pdf

# slow (out of the quick subset): reader and page processes stopped at their deadlines.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform == "win32", reason="reads /proc to find the reader processes"),
]

NEVER_FINISHES = 9          # 10**9 strokes on the page: hours of PyMuPDF on any machine


_MARKS: list[str] = []


def marked_env(**extra) -> tuple[dict, str]:
    """The environment of an engine whose processes (its reader processes included) can be found by a marker;
    whatever still runs with it when the test ends is killed (a failed test must not leave a reader at work)."""
    mark = uuid.uuid4().hex
    _MARKS.append(mark)
    return clean_env(KB_EMBED_MODEL="none", KB_TEST_PROCESS_MARK=mark, **extra), mark


@pytest.fixture(autouse=True)
def _kill_what_the_test_started():
    yield
    while _MARKS:
        for pid in marked_processes(_MARKS.pop()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def marked_processes(mark: str) -> list[int]:
    """Processes still running with this marker in their environment (zombies left out)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = handle.read()
            with open(f"/proc/{entry}/stat", "rb") as handle:
                state = handle.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if f"KB_TEST_PROCESS_MARK={mark}".encode() in environ.split(b"\0") and state != b"Z":
            found.append(int(entry))
    return found


def wait_for(what, check, timeout: float = 120.0, every: float = 0.05):
    """Poll ``check`` until it gives something true; the test's own bound, far above what the event needs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"{what}: not seen within {timeout} s")


def one_shot(command: str, payload: dict, env: dict, timeout: float = 300) -> dict:
    done = subprocess.run([sys.executable, str(ENGINE), command], input=json.dumps(payload).encode(),
                          capture_output=True, cwd=str(ROOT), env=env, timeout=timeout)
    assert done.stdout, done.stderr.decode(errors="replace")[-2000:]
    return json.loads(done.stdout)


def indexed(kb: Path) -> set[str]:
    try:
        con = sqlite3.connect(f"file:{kb / 'kb.sqlite'}?mode=ro", uri=True, timeout=30)
    except sqlite3.OperationalError:
        return set()
    try:
        return {Path(row[0]).name for row in con.execute("SELECT path FROM docs WHERE status = 'indexed'")}
    except sqlite3.OperationalError:        # no tables yet
        return set()
    finally:
        con.close()


@pytest.fixture
def papers(tmp_path) -> Path:
    folder = tmp_path / "papers"
    sp.make_onecolumn_paper(folder, "a_graphene.pdf")
    nested_drawing_pdf(folder / "b_nested.pdf", NEVER_FINISHES)
    sp.make_hyphenated_paper(folder, "c_battery.pdf")
    return folder


def test_a_page_that_never_finishes_is_stopped_and_the_batch_goes_on(papers, tmp_path):
    kb = tmp_path / "kb"
    env, mark = marked_env(KB_READ_SECONDS="10")
    reply = one_shot("ingest", {"paths": [str(papers)], "kb_root": str(kb)}, env)
    entries = {Path(f["path"]).name: f for f in reply["files"]}
    nested = entries["b_nested.pdf"]
    assert nested["status"] == "error" and nested["reason"] == "timed_out", nested
    assert "page 1 of 1" in nested["error"] and "KB_READ_SECONDS (10 s)" in nested["error"]
    assert entries["a_graphene.pdf"]["status"] == entries["c_battery.pdf"]["status"] == "added"
    assert indexed(kb) == {"a_graphene.pdf", "c_battery.pdf"}
    wait_for("the reader processes gone", lambda: not marked_processes(mark), 30)

    # the entry stays until the file changes: the next ingest does not spend the deadline on it again
    again = one_shot("ingest", {"paths": [str(papers)], "kb_root": str(kb)}, env)
    nested = {Path(f["path"]).name: f for f in again["files"]}["b_nested.pdf"]
    assert nested["status"] == "skipped" and nested["reason"] == "unchanged", nested
    assert nested["previous"] == {"status": "error", "reason": "timed_out"}
    hits = one_shot("search", {"query": "graphene nucleation copper", "kb_root": str(kb), "mode": "keyword"}, env)
    assert hits["results"] and Path(hits["results"][0]["path"]).name == "a_graphene.pdf"


def test_a_single_file_is_read_under_the_deadline_too(tmp_path):
    """One file alone was read in the engine's own process, where nothing can stop it."""
    nested = nested_drawing_pdf(tmp_path / "nested.pdf", NEVER_FINISHES)
    env, mark = marked_env(KB_READ_SECONDS="5")
    reply = one_shot("ingest", {"paths": [str(nested)], "kb_root": str(tmp_path / "kb")}, env)
    (entry,) = reply["files"]
    assert entry["status"] == "error" and entry["reason"] == "timed_out", entry
    wait_for("the reader process gone", lambda: not marked_processes(mark), 30)


def test_cancel_stops_a_job_whose_reader_is_stuck(papers, tmp_path):
    """The job cannot end by itself (its read deadline is an hour away): only the cancel can end it."""
    kb = tmp_path / "kb"
    env, mark = marked_env(KB_READ_SECONDS="3600", KB_ASYNC_THRESHOLD="0")
    started = one_shot("ingest", {"paths": [str(papers)], "kb_root": str(kb)}, env)
    job_id = started["job_id"]
    # the paper ahead of the nested file is stored while the nested one is read
    wait_for("the first paper stored", lambda: "a_graphene.pdf" in indexed(kb))
    refused = one_shot("ingest", {"paths": [str(tmp_path / "elsewhere.md")], "kb_root": str(kb)}, env)
    assert refused["ok"] is False and refused["code"] == "job_running"
    asked = one_shot("status", {"kb_root": str(kb), "job_id": job_id, "cancel": True}, env)
    assert asked["cancel_requested"] is True
    job = wait_for("the job cancelled", lambda: (lambda j: j if j["state"] != "running" else None)(
        one_shot("status", {"kb_root": str(kb), "job_id": job_id}, env)["job"]), timeout=60, every=0.5)
    assert job["state"] == "cancelled", job
    wait_for("the job's processes gone", lambda: not marked_processes(mark), 30)
    assert "a_graphene.pdf" in indexed(kb) and "b_nested.pdf" not in indexed(kb)
    # the library is free again
    (tmp_path / "later.md").write_text("# Later\n\nBasalt weathering on volcanic islands.\n", encoding="utf-8")
    later = one_shot("ingest", {"paths": [str(tmp_path / "later.md")], "kb_root": str(kb),
                                "background": False}, env)
    assert later["files"][0]["status"] == "added", later


def test_a_paper_ahead_of_a_long_file_survives_a_kill(papers, tmp_path):
    """ingest [paper, long file]: the paper is stored while the long file is read, so killing the engine then
    loses nothing but the file in flight (README). The second file used to be handed to the reader first."""
    kb = tmp_path / "kb"
    env, mark = marked_env(KB_READ_SECONDS="3600")
    payload = json.dumps({"paths": [str(papers / "a_graphene.pdf"), str(papers / "b_nested.pdf")],
                          "kb_root": str(kb)}).encode()
    engine = subprocess.Popen([sys.executable, str(ENGINE), "ingest"], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=str(ROOT), env=env)
    try:
        engine.stdin.write(payload)
        engine.stdin.close()
        wait_for("the paper stored", lambda: "a_graphene.pdf" in indexed(kb))
    finally:
        engine.send_signal(signal.SIGKILL)
        engine.wait(30)
    wait_for("the reader process gone after its engine", lambda: not marked_processes(mark), 30)
    assert indexed(kb) == {"a_graphene.pdf"}
    con = sqlite3.connect(str(kb / "kb.sqlite"))
    try:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        con.close()


@pytest.mark.internals
def test_the_reader_stops_a_file_that_sends_no_heartbeat(kb_engine, tmp_path, monkeypatch):
    """A stand-in read that never returns and never says it began a page: stopped past KB_READ_SECONDS, while the
    files around it are read, each in the order handed over."""
    monkeypatch.setenv("KB_READ_SECONDS", "1")
    folder = tmp_path / "papers"
    folder.mkdir()
    names = ["a.md", "b_hang.md", "c.md", "d_crash.md", "e.md"]
    for name in names:
        (folder / name).write_text(f"# {name}\n\nText about {name} and lichens on granite.\n", encoding="utf-8")
    reader = kb_engine.FileReader(2, read=crashing_reader.read)
    try:
        handles = [reader.submit(kb_engine.PendingFile(str(folder / n), os.stat(folder / n), "", "md",
                                                       time.perf_counter())) for n in names]
        results = {n: reader.result(h.pending, h) for n, h in zip(names, handles)}
    finally:
        reader.close()
    assert results["b_hang.md"].rejected[:2] == ("error", "timed_out")
    assert "opening the file took longer than KB_READ_SECONDS (1 s)" in results["b_hang.md"].rejected[2]
    assert "crashed the document reader" in results["d_crash.md"].failure
    for name in ("a.md", "c.md", "e.md"):
        assert results[name].failure is None and results[name].chunks, (name, results[name])
    assert not reader.processes


def test_a_metadata_refresh_reads_under_the_deadline(tmp_path):
    """``metadata_only`` reads the first pages of each indexed file again: a file that turned into one whose
    page never finishes is stopped like any read, and the other documents are refreshed."""
    kb, papers = tmp_path / "kb", tmp_path / "papers"
    sp.make_onecolumn_paper(papers, "a_graphene.pdf")
    sp.make_hyphenated_paper(papers, "c_battery.pdf")
    env, _ = marked_env(KB_READ_SECONDS="5")
    assert one_shot("ingest", {"paths": [str(papers)], "kb_root": str(kb)}, env)["totals"]["added"] == 2
    nested_drawing_pdf(papers / "a_graphene.pdf", NEVER_FINISHES)      # same path, new content, not re-ingested
    refreshed = one_shot("ingest", {"metadata_only": True, "kb_root": str(kb)}, env)
    entries = {Path(f["path"]).name: f for f in refreshed["files"]}
    assert entries["a_graphene.pdf"]["status"] == "error" and entries["a_graphene.pdf"]["reason"] == "timed_out"
    assert entries["c_battery.pdf"]["status"] == "updated" and entries["c_battery.pdf"]["reason"] == "metadata"
