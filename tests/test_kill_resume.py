"""Crash safety: SIGKILL a one-shot ingest at random moments, re-run it to
completion, and compare the library with a clean run.

Seed: env KB_KILL_SEED (default: fixed); number of kills: env KB_KILLS (default 4, at least 2).
"""
from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from helpers import ENGINE, ROOT, assert_db_ok, chunk_texts_by_path, clean_env, run_cli, sp

pytestmark = [pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX"), pytest.mark.slow]

SEED = int(os.environ.get("KB_KILL_SEED", "4242"))
KILLS = int(os.environ.get("KB_KILLS", "4"))
N_FILES = 12


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    lib = tmp_path_factory.mktemp("killlib")
    for i in range(N_FILES - 2):
        sp.make_filler_paper(lib, i, pages=4)
    sp.make_onecolumn_paper(lib)
    sp.make_chinese_paper(lib)
    return lib


def _docs(kb):
    r = run_cli("docs", {"kb_root": str(kb), "limit": 1000})
    assert r.rc == 0, r
    return {d["path"]: (d["status"], d.get("reason"), d["chunks"], d["title"]) for d in r.json["docs"]}


def _committed(kb) -> int:
    """Documents committed so far (read straight from kb.sqlite while ingest runs)."""
    try:
        con = sqlite3.connect(f"file:{kb / 'kb.sqlite'}?mode=ro", uri=True, timeout=0.2)
        try:
            return con.execute("SELECT count(*) FROM docs").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return 0


def _start_ingest(lib, kb):
    proc = subprocess.Popen([sys.executable, str(ENGINE), "ingest"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(ROOT), env=clean_env())
    proc.stdin.write(json.dumps({"paths": [str(lib)], "kb_root": str(kb)}).encode())
    proc.stdin.close()
    return proc


def test_kill_and_resume(library, tmp_path):
    clean_kb, crash_kb = tmp_path / "clean", tmp_path / "crash"
    t0 = time.monotonic()
    r = run_cli("ingest", {"paths": [str(library)], "kb_root": str(clean_kb)})
    clean_seconds = time.monotonic() - t0
    assert r.rc == 0, r
    assert r.json["totals"]["added"] == N_FILES, r.json["totals"]

    rng = random.Random(SEED)
    # first kill at a random moment of the start-up; the others once a random
    # number of files is committed, plus a random extra delay (mid-file)
    targets = [0] + sorted(rng.sample(range(1, N_FILES - 1), KILLS - 1))
    killed_mid_run = 0
    partial_states = []
    for target in targets:
        proc = _start_ingest(library, crash_kb)
        deadline = time.monotonic() + 120
        if target == 0:
            time.sleep(rng.uniform(0.05, 1.0))
        else:
            while proc.poll() is None and _committed(crash_kb) < target and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.08))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            killed_mid_run += 1
        proc.wait(timeout=60)
        proc.stdout.close()
        proc.stderr.close()
        if (crash_kb / "kb.sqlite").exists():
            assert_db_ok(crash_kb)  # consistent even right after the kill
            partial_states.append(len(chunk_texts_by_path(crash_kb)))

    r = run_cli("ingest", {"paths": [str(library)], "kb_root": str(crash_kb)}, timeout=300)
    assert r.rc == 0, r
    j = r.json
    assert j["totals"]["error"] == 0, j["files"]
    assert all(f["status"] in ("added", "skipped", "updated") for f in j["files"]), j["files"]
    assert killed_mid_run >= KILLS - 1, f"kills did not land inside runs (clean run took {clean_seconds:.2f}s)"
    # kills left half-done libraries behind, so the last run really resumed
    assert any(0 < n < N_FILES for n in partial_states), (partial_states, clean_seconds)

    assert_db_ok(crash_kb)
    assert _docs(crash_kb) == _docs(clean_kb)
    assert chunk_texts_by_path(crash_kb) == chunk_texts_by_path(clean_kb)

    # and a further run has nothing left to do
    r = run_cli("ingest", {"paths": [str(library)], "kb_root": str(crash_kb)})
    assert r.json["totals"]["skipped"] == N_FILES, r.json["totals"]
