"""Background jobs: a bulk ingest through the JSON protocols becomes a detached process with a state file."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ENGINE, ROOT, clean_env

# slow (out of the quick subset): detached job processes, killed and cancelled.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform == "win32", reason="signals and process groups are POSIX here"),
]


def _papers(folder: Path, count: int, prefix: str = "p") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"{prefix}{i:03d}.md").write_text(
            f"# {prefix.upper()} paper {i}\n\n## Abstract\n\n"
            + "Graphene domains nucleate on copper foils during chemical vapour deposition. " * 12
            + f"jobtoken{prefix}{i}\n", encoding="utf-8")
    return folder


def _env(threshold: int) -> dict:
    env = clean_env()
    env.update(KB_EMBED_MODEL="none", HF_HUB_OFFLINE="1", KB_ASYNC_THRESHOLD=str(threshold))
    return env


def _call(command: str, payload: dict, env: dict) -> dict:
    proc = subprocess.run([sys.executable, str(ENGINE), command], input=json.dumps(payload).encode(),
                          capture_output=True, cwd=str(ROOT), env=env, timeout=120)
    return json.loads(proc.stdout)


def _wait(kb: Path, job_id: str, env: dict, until=("done", "failed", "cancelled"), timeout: float = 90.0):
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = _call("status", {"kb_root": str(kb), "job_id": job_id}, env)["job"]
        seen.append(job)
        if job["state"] in until:
            return job, seen
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still {seen[-1]['state']} after {timeout}s")


def _job_file(kb: Path, job_id: str) -> dict:
    return json.loads((kb / ".kb-jobs" / f"{job_id}.json").read_text())


def test_bulk_ingest_runs_as_a_job_with_monotonic_progress(tmp_path):
    env = _env(threshold=5)
    papers, kb = _papers(tmp_path / "papers", 60), tmp_path / "kb"
    started = _call("ingest", {"paths": [str(papers)], "kb_root": str(kb)}, env)
    assert started["ok"] and started["state"] == "queued" and started["pending"] == 60, started
    assert "files" not in started or isinstance(started["files"], int)
    job, seen = _wait(kb, started["job_id"], env)
    assert job["state"] == "done", job
    done_values = [j["done"] for j in seen]
    assert done_values == sorted(done_values), done_values
    assert job["done"] == job["total"] == 60
    assert job["result"]["totals"]["added"] == 60
    hits = _call("search", {"query": "jobtokenp42", "kb_root": str(kb), "mode": "keyword"}, env)
    assert [h["file"] for h in hits["results"]] == ["p042.md"]
    listed = _call("status", {"kb_root": str(kb)}, env)["jobs"]
    assert [j["job_id"] for j in listed] == [started["job_id"]]
    # the same request again has nothing to do: answered in the foreground
    again = _call("ingest", {"paths": [str(papers)], "kb_root": str(kb)}, env)
    assert again["totals"]["skipped"] == 60 and "job_id" not in again


def test_small_ingests_and_the_python_api_stay_in_the_foreground(tmp_path, kb_engine, monkeypatch):
    env = _env(threshold=25)
    papers, kb = _papers(tmp_path / "papers", 10), tmp_path / "kb"
    reply = _call("ingest", {"paths": [str(papers)], "kb_root": str(kb)}, env)
    assert reply["totals"]["added"] == 10 and "job_id" not in reply
    monkeypatch.setenv("KB_ASYNC_THRESHOLD", "1")
    monkeypatch.setenv("KB_EMBED_MODEL", "none")
    more = _papers(tmp_path / "more", 5, prefix="m")
    engine = kb_engine.Engine()
    try:
        assert engine.execute("ingest", {"paths": [str(more)], "kb_root": str(kb)})["totals"]["added"] == 5
    finally:
        engine.close()
    forced = _call("ingest", {"paths": [str(papers)], "kb_root": str(kb), "force": True, "background": False},
                   _env(threshold=1))
    assert forced["totals"]["updated"] == 10 and "job_id" not in forced


def test_cancel_stops_cleanly_and_a_later_ingest_finishes(tmp_path):
    env = _env(threshold=5)
    papers, kb = _papers(tmp_path / "papers", 300), tmp_path / "kb"
    started = _call("ingest", {"paths": [str(papers)], "kb_root": str(kb)}, env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:     # cancel mid-run, not while the job is still queued
        try:
            running = _job_file(kb, started["job_id"])
        except ValueError:                 # caught between truncate and write: read again
            continue
        if running["state"] != "queued" and running.get("done", 0) >= 3:
            break
        time.sleep(0.01)
    cancel = _call("status", {"kb_root": str(kb), "job_id": started["job_id"], "cancel": True}, env)
    job, _ = _wait(kb, started["job_id"], env)
    if job["state"] == "done":
        pytest.skip("the job finished before the cancel arrived")
    assert cancel["cancel_requested"] is True
    # (the cancel may land after the last file, while the job is still finishing: then every file is in)
    assert job["state"] == "cancelled" and 3 <= job["done"] <= 300, job
    con = sqlite3.connect(str(kb / "kb.sqlite"))
    try:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        indexed = con.execute("SELECT COUNT(*) FROM docs").fetchone()[0]
    finally:
        con.close()
    assert job["done"] <= indexed <= 300     # what the job counted is committed; nothing half-written
    rest = _call("ingest", {"paths": [str(papers)], "kb_root": str(kb), "background": False}, env)
    assert rest["totals"]["added"] == 300 - indexed and rest["totals"]["skipped"] == indexed


def test_a_killed_job_is_reported_failed_and_a_second_writer_is_refused(tmp_path):
    env = _env(threshold=5)
    papers, kb = _papers(tmp_path / "papers", 400), tmp_path / "kb"
    started = _call("ingest", {"paths": [str(papers)], "kb_root": str(kb)}, env)
    other = _papers(tmp_path / "other", 20, prefix="o")
    refused = _call("ingest", {"paths": [str(other)], "kb_root": str(kb)}, env)
    assert refused["ok"] is False and refused["code"] == "job_running" and started["job_id"] in refused["error"]
    _wait(kb, started["job_id"], env, until=("running", "done"))
    pid = _job_file(kb, started["job_id"])["pid"]
    os.kill(pid, signal.SIGKILL)
    job, _ = _wait(kb, started["job_id"], env, until=("failed", "done"))
    if job["state"] == "done":
        pytest.skip("the job finished before it could be killed")
    assert "ended unexpectedly" in job["reason"]
    con = sqlite3.connect(str(kb / "kb.sqlite"))
    try:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        con.close()
    # with the dead job out of the way a new job may start
    second = _call("ingest", {"paths": [str(papers)], "kb_root": str(kb)}, env)
    job, _ = _wait(kb, second["job_id"], env)
    assert job["state"] == "done"


def test_job_outlives_the_daemon_that_started_it(tmp_path):
    env = _env(threshold=5)
    papers, kb = _papers(tmp_path / "papers", 120), tmp_path / "kb"
    request = json.dumps({"id": 1, "command": "ingest", "payload": {"paths": [str(papers)], "kb_root": str(kb)}})
    daemon = subprocess.run([sys.executable, str(ENGINE), "serve"], input=(request + "\n").encode(),
                            capture_output=True, cwd=str(ROOT), env=env, timeout=120)
    assert daemon.returncode == 0
    reply = json.loads(daemon.stdout.decode().splitlines()[-1])
    assert reply["ok"] and reply["response"]["state"] == "queued"
    job, _ = _wait(kb, reply["response"]["job_id"], env)
    assert job["state"] == "done" and job["result"]["totals"]["added"] == 120


def test_status_errors(tmp_path):
    env = _env(threshold=5)
    assert _call("status", {"kb_root": str(tmp_path / "kb")}, env)["jobs"] == []
    missing = _call("status", {"kb_root": str(tmp_path / "kb"), "job_id": "0123456789ab"}, env)
    assert missing["ok"] is False and missing["code"] == "not_found"
    bad = _call("status", {"kb_root": str(tmp_path / "kb"), "job_id": "../../etc"}, env)
    assert bad["ok"] is False and bad["code"] == "bad_request"
