"""zotero as a background job (the ingest job machinery), and the human CLI's progress bar.

Through the JSON protocols a zotero import whose attachments need work in more than KB_ASYNC_THRESHOLD cases
becomes a detached job; these tests lower the threshold to 2. The Zotero databases are generated (see
zotero_fixture.py): the designed library, and a bulk library of many small Markdown attachments for the tests
that need a job to run long enough to be watched, refused around and cancelled. Everything needs the shared
Zotero schema fixtures and is skipped without them.
"""
from __future__ import annotations

import io
import json
import os
import pty
import select
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import zotero_fixture as zf
from helpers import ENGINE, ROOT, clean_env

FIXTURES = zf.fixtures_root()      # None: the project's Zotero tables stand in for Zotero's schema files
pytestmark = [
    pytest.mark.skipif(sys.platform == "win32", reason="process groups and pseudo-terminals are POSIX here"),
]
FINAL = ("done", "failed", "cancelled")


# ---------------------------------------------------------------------------
# inputs

def _key(prefix: str, number: int) -> str:
    """A valid Zotero key: the prefix, then ``number`` written in Zotero's key alphabet."""
    digits = ""
    for _ in range(8 - len(prefix)):
        number, rest = divmod(number, len(zf.KEY_ALPHABET))
        digits = zf.KEY_ALPHABET[rest] + digits
    key = prefix + digits
    assert zf.is_key(key), key
    return key


def build_bulk_library(base: Path, count: int) -> Path:
    """A Zotero 7 data directory with ``count`` articles, each with one imported Markdown attachment (its own
    text, so no two are duplicates) and the tag ``bulk``; returns the path of zotero.sqlite."""
    data_dir = base / "Zotero"
    (data_dir / "storage").mkdir(parents=True)
    db = data_dir / "zotero.sqlite"
    zf.create_database(db, zf.shared_schema())
    con = sqlite3.connect(str(db))
    try:
        with con:
            writer = zf.ZoteroWriter(con)
            for i in range(count):
                parent = writer.article(_key("PAR", i), title=f"Bulk Zotero paper {i}", date="2021-03-01 2021",
                                        journal="Journal of Bulk Imports", authors=[("Ann", f"Writer{i}")])
                writer.tag(parent, "bulk")
                attachment = _key("ATT", i)
                folder = data_dir / "storage" / attachment
                folder.mkdir()
                (folder / f"bulk{i:03d}.md").write_text(
                    f"# Bulk paper {i}\n\n## Abstract\n\n"
                    + "Copper foils anneal in hydrogen before graphene growth starts. " * 10
                    + f"zotjobtoken{i}\n", encoding="utf-8")
                writer.attachment(parent, attachment, path=f"storage:bulk{i:03d}.md",
                                  link_mode=zf.LINK_IMPORTED_FILE, content_type="text/markdown",
                                  title=f"bulk{i:03d}.md")
            writer.bump_library_version()
    finally:
        con.close()
    return db


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> zf.ZoteroLibrary:
    return zf.build_library(tmp_path_factory.mktemp("zotero-jobs-pristine"), FIXTURES)


@pytest.fixture
def zcopy(pristine, tmp_path) -> zf.ZoteroLibrary:
    return zf.copy_library(pristine, tmp_path / "zcopy")


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """This process and the engines it starts: no model, no network, no Zotero installation to find."""
    h = tmp_path / "home"
    h.mkdir()
    for name, value in (("KB_EMBED_MODEL", "none"), ("HF_HUB_OFFLINE", "1"), ("HOME", str(h)),
                        ("USERPROFILE", str(h)), ("KB_ASYNC_THRESHOLD", "2")):
        monkeypatch.setenv(name, value)
    for name in ("KB_ZOTERO_DB", "APPDATA", "KB_ROOT"):
        monkeypatch.delenv(name, raising=False)
    return h


def _env(home: Path, threshold: int = 2) -> dict:
    return clean_env(KB_EMBED_MODEL="none", HF_HUB_OFFLINE="1", HOME=home, USERPROFILE=home,
                     KB_ASYNC_THRESHOLD=threshold)


def _call(command: str, payload: dict, env: dict) -> dict:
    """One-shot JSON call: the protocol that may start jobs."""
    proc = subprocess.run([sys.executable, str(ENGINE), command], input=json.dumps(payload).encode(),
                          capture_output=True, cwd=str(ROOT), env=env, timeout=120)
    assert proc.stdout, proc.stderr.decode(errors="replace")[-2000:]
    return json.loads(proc.stdout)


@pytest.fixture
def api(kb_engine, home):
    """An in-process engine that may start jobs like the JSON protocols do (fast to call: for polling)."""
    engine = kb_engine.Engine(allow_background=True)
    yield engine
    engine.close()


def _wait(api, kb: Path, job_id: str, until=FINAL, timeout: float = 120.0, poll_s: float = 0.02):
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = api.execute("status", {"kb_root": str(kb), "job_id": job_id})["job"]
        seen.append(job)
        if job["state"] in until:
            return job, seen
        time.sleep(poll_s)
    raise AssertionError(f"job {job_id} still {seen[-1]['state']} after {timeout}s: {seen[-1]}")


def _library_rows(kb: Path) -> list[tuple]:
    con = sqlite3.connect(str(kb / "kb.sqlite"))
    try:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        return con.execute("SELECT path, status, zotero_key, zotero_version, chunk_count FROM docs").fetchall()
    finally:
        con.close()


# ---------------------------------------------------------------------------
# the job itself

@pytest.mark.slow
def test_zotero_job_lifecycle(zcopy, home, tmp_path, api):
    env, kb = _env(home), tmp_path / "kb"
    payload = {"zotero_db": str(zcopy.db), "kb_root": str(kb)}
    # a dry run only reads: never a job, whatever the threshold
    dry = _call("zotero", {**payload, "dry_run": True}, env)
    assert dry["ok"] and dry["dry_run"] and "job_id" not in dry, dry
    started = _call("zotero", payload, env)
    importable = [e for e in zcopy.listed.values() if e.expect == "added"]
    assert started["ok"] and started["state"] == "queued", started
    assert started["pending"] == len(importable) and started["items"] == len(zcopy.listed), started
    assert "Zotero attachments" in started["note"], started
    job, seen = _wait(api, kb, started["job_id"])
    assert job["state"] == "done", job
    assert job["command"] == "zotero" and job["pending"] == len(importable)
    assert job["done"] == job["total"] == len(zcopy.listed), job
    done_values = [j["done"] for j in seen]
    assert done_values == sorted(done_values), done_values
    totals = job["result"]["totals"]
    assert totals["added"] == len(importable) and totals["missing"] == 2, totals
    assert job["result"]["zotero_db"] == str(zcopy.db)
    # Zotero's data was laid over the files: an annotation comment is searchable, with the collection filter
    ann = zcopy.annotations[0]
    hits = api.execute("search", {"query": ann.token, "kb_root": str(kb), "mode": "keyword",
                                  "filters": {"collection": "Graphene"}})["results"]
    assert hits and hits[0]["zotero_key"] == zcopy.entries["A"].item_key, hits
    # the same request again has nothing to do: answered at once, in the foreground
    again = _call("zotero", payload, env)
    assert "job_id" not in again and again["totals"]["skipped"] == len(importable), again


@pytest.mark.slow
def test_threshold_and_background_false_keep_zotero_in_the_foreground(zcopy, home, tmp_path):
    payload = {"zotero_db": str(zcopy.db), "kb_root": str(tmp_path / "kb")}
    importable = sum(e.expect == "added" for e in zcopy.listed.values())
    # exactly at the threshold: not more than it, so foreground
    at_threshold = _call("zotero", payload, _env(home, threshold=importable))
    assert "job_id" not in at_threshold and at_threshold["totals"]["added"] == importable, at_threshold
    forced = _call("zotero", {**payload, "force": True, "background": False}, _env(home, threshold=1))
    assert "job_id" not in forced and forced["totals"]["updated"] == importable, forced
    bad = _call("zotero", {**payload, "force": True, "background": "no"}, _env(home, threshold=1))
    assert bad["ok"] is False and bad["code"] == "bad_request", bad
    assert not (tmp_path / "kb" / ".kb-jobs").exists() or not list((tmp_path / "kb" / ".kb-jobs").glob("*.json"))


@pytest.mark.slow
def test_zotero_job_progress_is_monotonic_and_reports_phases(home, tmp_path, api):
    count = 150
    db, kb = build_bulk_library(tmp_path / "bulk", count), tmp_path / "kb"
    started = api.execute("zotero", {"zotero_db": str(db), "kb_root": str(kb)})
    assert started["pending"] == count and started["items"] == count, started
    job, seen = _wait(api, kb, started["job_id"])
    assert job["state"] == "done", job
    done_values = [j["done"] for j in seen]
    assert done_values == sorted(done_values), done_values
    for view in seen:
        assert 0 <= view["done"] <= view["total"] == count, view
        assert view["phase"] in (None, "zotero", "embed"), view
        if view["state"] == "running" and view["phase"] == "zotero" and 0 < view["done"] < count:
            assert view["current"] and Path(view["current"]).name.startswith("bulk"), view
    assert job["done"] == count and job["result"]["totals"]["added"] == count
    assert len(set(done_values)) >= 2, "the job was never seen between queued and done"
    tagged = api.execute("search", {"query": "zotjobtoken77", "kb_root": str(kb), "mode": "keyword",
                                    "filters": {"tag": "bulk"}})["results"]
    assert [h["file"] for h in tagged] == ["bulk077.md"], tagged


@pytest.mark.slow
def test_cancel_leaves_a_consistent_library_and_a_rerun_resumes(home, tmp_path, api):
    count = 1000                              # a few seconds of work: room to cancel it mid-way
    db, kb = build_bulk_library(tmp_path / "bulk", count), tmp_path / "kb"
    payload = {"zotero_db": str(db), "kb_root": str(kb)}
    started = api.execute("zotero", payload)
    deadline = time.monotonic() + 60          # let it import some attachments first
    while time.monotonic() < deadline:
        job = api.execute("status", {"kb_root": str(kb), "job_id": started["job_id"]})["job"]
        if job["done"] >= 3 or job["state"] in FINAL:
            break
        time.sleep(0.01)
    cancel = api.execute("status", {"kb_root": str(kb), "job_id": started["job_id"], "cancel": True})
    assert cancel["cancel_requested"] is True
    job, _ = _wait(api, kb, started["job_id"])
    assert job["state"] == "cancelled", job
    assert 3 <= job["done"] < count, job
    rows = _library_rows(kb)
    # every attachment the job took on is complete (file indexed and Zotero's data laid over it); no other
    assert len(rows) == job["done"], (len(rows), job)
    assert all(status == "indexed" and key and version and chunks > 0 for _, status, key, version, chunks in rows)
    # one writer: the cancelled job no longer blocks, and a re-run picks up where it stopped
    rest = api.execute("zotero", {**payload, "background": False})
    assert "job_id" not in rest, rest
    assert rest["totals"]["skipped"] == len(rows) and rest["totals"]["added"] == count - len(rows), rest["totals"]
    assert len(_library_rows(kb)) == count


@pytest.mark.slow
def test_second_writer_is_refused_while_a_zotero_job_runs(kb_engine, home, tmp_path, api):
    db, kb = build_bulk_library(tmp_path / "bulk", 300), tmp_path / "kb"
    started = api.execute("zotero", {"zotero_db": str(db), "kb_root": str(kb)})
    job_id = started["job_id"]
    papers = tmp_path / "papers"
    papers.mkdir()
    (papers / "one.md").write_text("# One\n\nGraphene on copper, a single small paper.\n", encoding="utf-8")
    foreground = kb_engine.Engine()            # the Python API too: the two would interleave
    try:
        for engine, command, payload in ((api, "zotero", {"zotero_db": str(db)}),
                                         (api, "ingest", {"paths": [str(papers)]}),
                                         (foreground, "ingest", {"paths": [str(papers)], "background": False}),
                                         (foreground, "zotero", {"zotero_db": str(db), "force": True})):
            with pytest.raises(kb_engine.KBError) as refused:
                engine.execute(command, {**payload, "kb_root": str(kb)})
            assert refused.value.code == "job_running" and job_id in refused.value.message, (command, refused.value)
        # reading is never refused
        dry = foreground.execute("zotero", {"zotero_db": str(db), "kb_root": str(kb), "dry_run": True})
        assert dry["totals"]["candidate"] == 300
        assert [j["job_id"] for j in foreground.execute("status", {"kb_root": str(kb)})["jobs"]] == [job_id]
    finally:
        foreground.close()
    # the refusal reaches one-shot callers as a reply naming the job
    refused = _call("ingest", {"paths": [str(papers)], "kb_root": str(kb)}, _env(home))
    state = api.execute("status", {"kb_root": str(kb), "job_id": job_id})["job"]["state"]
    if state in ("queued", "running"):
        assert refused["ok"] is False and refused["code"] == "job_running" and job_id in refused["error"], refused
    api.execute("status", {"kb_root": str(kb), "job_id": job_id, "cancel": True})
    _wait(api, kb, job_id)
    after = api.execute("ingest", {"paths": [str(papers)], "kb_root": str(kb)})
    assert after["totals"]["added"] == 1, after


# ---------------------------------------------------------------------------
# one source of progress: the fold, the bar, the CLI

@pytest.mark.internals
def test_fold_progress_counts_items_monotonically(kb_engine):
    state = {"done": 0, "total": 4, "errors": []}
    events = [{"phase": "zotero", "done": 1, "total": 4, "path": "/z/a.pdf", "status": "added"},
              {"phase": "zotero", "done": 3, "total": 4, "path": "/z/c.pdf", "status": "error"},
              {"phase": "zotero", "done": 2, "total": 4, "path": "/z/b.pdf", "status": "added"},   # late, out of order
              {"phase": "zotero", "done": 4, "total": 4, "path": "", "status": "missing"},
              {"phase": "embed", "done": 256, "total": 300},
              {"phase": "embed", "done": 300, "total": 300}]
    seen = [dict(kb_engine.fold_progress(state, e)) for e in events]
    assert [s["done"] for s in seen] == [1, 3, 3, 4, 4, 4]
    assert state["errors"] == ["/z/c.pdf"]
    assert seen[3]["current"] is None and seen[4]["current"] is None
    assert (seen[4]["phase"], seen[4]["phase_done"], seen[4]["phase_total"]) == ("embed", 256, 300)
    assert state["total"] == 4 and state["phase_done"] == 300


@pytest.mark.internals
def test_progress_bar_draws_the_folded_state(kb_engine):
    stream = io.StringIO()
    bar = kb_engine.ProgressBar(stream, width=10, min_interval_s=0)
    bar({"phase": "files", "done": 1, "total": 4, "path": "/p/paper1.pdf", "status": "added"})
    bar({"phase": "embed", "done": 256, "total": 300})             # an ingest encodes while it reads on
    bar({"phase": "files", "done": 2, "total": 4, "path": "/p/paper2.pdf", "status": "added"})
    bar({"phase": "files", "done": 4, "total": 4, "path": "/p/paper4.pdf", "status": "added"})
    bar({"phase": "embed", "done": 300, "total": 300})
    assert "\n" not in stream.getvalue()                            # one line, redrawn in place
    bar.close()
    draws = stream.getvalue().split("\r")[1:]
    assert [d.rstrip() for d in draws] == [
        "files       [##........] 1/4  paper1.pdf",
        "files       [##........] 1/4  encoding 256/300  paper1.pdf",
        "files       [#####.....] 2/4  encoding 256/300  paper2.pdf",
        "files       [##########] 4/4  encoding 256/300  paper4.pdf",
        "files       [##########] 4/4  encoding 300/300  paper4.pdf",
    ], draws
    assert draws[-1].endswith("\n") and stream.getvalue().count("\n") == 1
    # reembed: encoding only; a shorter line blanks what is left of a longer one
    stream = io.StringIO()
    bar = kb_engine.ProgressBar(stream, width=10, min_interval_s=0)
    bar.line = "x" * 60
    bar({"phase": "embed", "done": 100, "total": 200})
    drawn = "encoding    [#####.....] 100/200"
    assert stream.getvalue() == "\r" + drawn + " " * (60 - len(drawn)), repr(stream.getvalue())


@pytest.mark.internals
def test_progress_bar_draws_a_job_file_state(kb_engine):
    quiet = io.StringIO()
    follower = kb_engine.ProgressBar(quiet, width=10, min_interval_s=0)
    job = {"job_id": "0123456789ab", "state": "running", "phase": "zotero", "phase_done": 2, "phase_total": 4,
           "current": "/z/x.md", "done": 2, "total": 4}
    follower.draw(job)
    follower.draw(job)                                               # unchanged: nothing more is written
    assert quiet.getvalue() == "\rattachments [#####.....] 2/4  x.md"
    follower.draw({**job, "state": "done", "done": 4, "phase_done": 4, "current": None})
    follower.close()
    bar = "\rattachments [##########] 4/4" + " " * len("  x.md") + "\n"
    assert quiet.getvalue().endswith(bar), repr(quiet.getvalue())


@pytest.mark.internals
def test_progress_bar_throttles_redraws_but_close_draws_the_end(kb_engine):
    stream = io.StringIO()
    bar = kb_engine.ProgressBar(stream, width=10, min_interval_s=3600)
    for done in range(1, 101):
        bar({"phase": "files", "done": done, "total": 100, "path": f"/p/{done}.md", "status": "added"})
    assert stream.getvalue().count("\r") == 1 and " 1/100 " in stream.getvalue()
    bar.close()
    out = stream.getvalue()
    assert out.count("\r") == 2 and "100/100  100.md" in out and out.endswith("\n"), out
    silent = io.StringIO()
    kb_engine.ProgressBar(silent).close()                            # nothing drawn: nothing to end
    assert silent.getvalue() == ""


def _run_with_terminal_stderr(argv: list[str], env: dict, timeout: float = 120) -> tuple[int, str, str]:
    """Run with standard error on a pseudo-terminal; (exit status, stdout, what the terminal received)."""
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave,
                                cwd=str(ROOT), env=env)
    finally:
        os.close(slave)
    received, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:                  # EIO: the child closed the terminal
                break
            if not data:
                break
            received += data
        stdout = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, stdout.decode("utf-8", "replace"), received.decode("utf-8", "replace")


@pytest.mark.slow
def test_human_cli_draws_a_progress_bar_only_on_a_terminal(zcopy, home, tmp_path):
    env = _env(home, threshold=1)            # the human CLI stays in the foreground whatever the threshold
    argv = [sys.executable, str(ENGINE), "zotero", "--db", str(zcopy.db), "--kb-root", str(tmp_path / "kb")]
    rc, stdout, terminal = _run_with_terminal_stderr(argv, env)
    listed = len(zcopy.listed)
    assert rc == 0, (stdout, terminal)
    assert "\rattachments" in terminal and f"] {listed}/{listed}" in terminal, repr(terminal)
    assert "\r" not in stdout and "added" in stdout, stdout
    assert not (tmp_path / "kb" / ".kb-jobs").exists()
    piped = subprocess.run([*argv, "--force"], capture_output=True, cwd=str(ROOT), env=env, timeout=120)
    assert piped.returncode == 0 and b"\r" not in piped.stderr and b"[#" not in piped.stderr, piped.stderr


@pytest.mark.slow
def test_human_status_follows_a_background_job(home, tmp_path):
    env = _env(home)
    db, kb = build_bulk_library(tmp_path / "bulk", 60), tmp_path / "kb"
    started = _call("zotero", {"zotero_db": str(db), "kb_root": str(kb)}, env)
    assert started["ok"] and started["job_id"], started
    rc, stdout, terminal = _run_with_terminal_stderr(
        [sys.executable, str(ENGINE), "status", started["job_id"], "--follow", "--kb-root", str(kb)], env)
    assert rc == 0, (stdout, terminal)
    assert started["job_id"] in stdout and " done " in stdout and "60/60" in stdout and "60 added" in stdout, stdout
    # the bar draws the job file's state: live while it runs, at least its last count once it has ended
    assert "\rattachments" in terminal and "] 60/60" in terminal, repr(terminal)
    listed = subprocess.run([sys.executable, str(ENGINE), "status", "--kb-root", str(kb)], capture_output=True,
                            cwd=str(ROOT), env=env, timeout=60)
    assert listed.returncode == 0 and started["job_id"] in listed.stdout.decode(), listed
