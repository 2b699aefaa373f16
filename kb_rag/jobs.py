"""Jobs: background ingest: detached process, state files, cancellation.

May import: config, records, storage.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

from .config import STATUS_ERROR, KBError
from .records import JobRecord
from .storage import _write_atomically

# A bulk ingest runs as a detached process so that no host-side timeout can cut
# it short. Its state lives in one JSON file per job under <kb_root>/.kb-jobs/,
# replaced atomically on every update, so any process can read it at any time.

JOBS_DIRNAME = ".kb-jobs"
JOB_ACTIVE_STATES = ("queued", "running")
JOB_STATES = (*JOB_ACTIVE_STATES, "done", "failed", "cancelled")
# What every reader of a job file indexes directly; a file without them is not taken for a job.
JOB_KEYS = frozenset({"job_id", "command", "state", "created", "updated", "finished"})
JOB_KEEP_SECONDS = 3600.0
JOB_WRITE_INTERVAL_S = 0.25


class JobCancelled(Exception):
    """Raised inside a job when its cancellation was requested."""


# The check a job's process installs (run_job): a wait that can last, such as the wait for a reader process on a
# file that never finishes, asks it on every poll, so that a cancel stops the job within a second or so even when
# no progress event comes. Elsewhere (serve, the CLI, the Python API) nothing is installed and nothing is asked.
_CANCEL_CHECK: list[Callable[[], bool]] = []


def stop_if_cancelled() -> None:
    """Raise JobCancelled when this process runs a job whose cancellation was requested."""
    if _CANCEL_CHECK and _CANCEL_CHECK[0]():
        raise JobCancelled()


def async_threshold() -> int:
    try:
        return max(0, int(os.environ.get("KB_ASYNC_THRESHOLD", "25")))
    except ValueError:
        return 25


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    if sys.platform == "win32":
        import ctypes

        handle = ctypes.windll.kernel32.OpenProcess(0x1000, False, pid)  # PROCESS_QUERY_LIMITED_INFORMATION
        if not handle:
            return False
        ctypes.windll.kernel32.CloseHandle(handle)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a finished child of this very process is a zombie until reaped
        finished, _ = os.waitpid(pid, os.WNOHANG)
        return finished == 0
    except ChildProcessError:
        return True


class JobStore:
    """The job files of one library."""

    def __init__(self, kb_root: Path):
        self.folder = kb_root / JOBS_DIRNAME

    def path_of(self, job_id: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{12}", job_id or ""):
            raise KBError("bad_request", "job_id must be the id a job was started with")
        return self.folder / f"{job_id}.json"

    def create(self, command: str, payload: dict, total: int, pending: int | None = None) -> dict:
        """A queued job that will run ``command`` with ``payload``: the runner needs nothing else."""
        self.folder.mkdir(parents=True, exist_ok=True)
        job_id = hashlib.sha1(f"{time.time_ns()}-{os.getpid()}-{command}".encode()).hexdigest()[:12]
        job = {
            "job_id": job_id,
            "command": command,
            "payload": payload,
            "state": "queued",
            "done": 0,
            "total": total,
            "pending": total if pending is None else pending,
            "current": None,
            "phase": None,
            "phase_done": 0,
            "phase_total": 0,
            "errors": [],
            "result": None,
            "pid": None,
            "created": time.time(),
            "updated": time.time(),
            "finished": None,
            "reason": None,
        }
        self.write(job)
        return job

    def read(self, job_id: str) -> dict | None:
        """The job file's record, or None when it cannot be read or is not a job's (a file cut short or replaced
        by something else is passed over, never a reason for a command to fail)."""
        try:
            job = json.loads(self.path_of(job_id).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(job, dict) or not job.keys() >= JOB_KEYS or job["state"] not in JOB_STATES:
            return None
        return job

    def write(self, job: dict) -> None:
        job["updated"] = time.time()
        _write_atomically(
            self.path_of(job["job_id"]), json.dumps(job, ensure_ascii=False, allow_nan=False).encode("utf-8")
        )

    def checked(self, job: dict) -> dict:
        """The job, marked failed when its process died without saying so."""
        if job["state"] in JOB_ACTIVE_STATES and job.get("pid") and not pid_alive(job["pid"]):
            job.update(state="failed", reason="the job process ended unexpectedly", finished=time.time())
            self._write_if_possible(job)
        elif job["state"] == "queued" and not job.get("pid") and time.time() - job["created"] > 60:
            job.update(state="failed", reason="the job process never started", finished=time.time())
            self._write_if_possible(job)
        return job

    def _write_if_possible(self, job: dict) -> None:
        """Record what a reader found out (a dead job); on a library it cannot write to, the answer says it anyway."""
        try:
            self.write(job)
        except OSError:
            pass

    def all(self) -> list[dict]:
        if not self.folder.is_dir():
            return []
        jobs = []
        for path in sorted(self.folder.glob("*.json")):
            if not re.fullmatch(r"[0-9a-f]{12}", path.stem):
                continue  # the watcher's file (watcher.json) lives here too
            job = self.read(path.stem)
            if job is None:
                continue
            job = self.checked(job)
            ended = job["finished"] or job["updated"]
            if job["state"] not in JOB_ACTIVE_STATES and time.time() - ended > JOB_KEEP_SECONDS:
                for stale in (path, path.with_suffix(".cancel"), path.with_suffix(".log")):
                    try:
                        stale.unlink(missing_ok=True)
                    except OSError:
                        pass  # a library on read-only media keeps its old job files; they are still not listed
                continue
            jobs.append(job)
        return sorted(jobs, key=lambda j: j["created"])

    def active(self) -> dict | None:
        return next((j for j in self.all() if j["state"] in JOB_ACTIVE_STATES), None)

    def request_cancel(self, job_id: str) -> None:
        self.path_of(job_id).with_suffix(".cancel").touch()

    def cancel_requested(self, job_id: str) -> bool:
        return self.path_of(job_id).with_suffix(".cancel").exists()


def spawn_job(kb_root: Path, job_id: str) -> int:
    """Start ``kb_engine.py job KB_ROOT JOB_ID`` detached from this process (it outlives a daemon restart)."""
    import subprocess

    log = open(kb_root / JOBS_DIRNAME / f"{job_id}.log", "ab")  # noqa: SIM115 (handed to the child, closed below)
    options: dict = (
        {"start_new_session": True} if os.name != "nt" else {"creationflags": 0x00000008 | 0x00000200}
    )  # DETACHED_PROCESS | CREATE_NEW_PROCESS_GROUP
    try:
        process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "job", str(kb_root), job_id],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            close_fds=True,
            **options,
        )
    finally:
        log.close()
    return process.pid


def job_view(job: dict) -> JobRecord:
    """The job as the status command shows it (the job file holds more: the payload, the process id)."""
    view = {key: job.get(key) for key in JobRecord.__annotations__}  # the record's fields, in its order
    for count in ("done", "total", "phase_done", "phase_total"):  # a job file of an older engine may lack some
        view[count] = view[count] or 0
    view["errors"] = (job.get("errors") or [])[:50]
    view["searchable"] = bool(job.get("text_done")) or job.get("state") == "done"
    return cast(JobRecord, view)


# Phases whose events count the items a command goes through (files, Zotero attachments, documents); the
# embed phase counts chunks and the verify_metadata phase the lookups, and both leave the item count alone.
ITEM_PHASES = ("files", "zotero", "metadata")


def fold_progress(state: dict, event: dict) -> dict:
    """Fold one progress event of ingest / zotero / reembed into ``state``: the running summary that a job file
    holds and the human CLI's bar draws. Serve passes the same events on as they are, so all three show one
    source. ``done`` / ``total`` count items and ``done`` never decreases; ``phase_done`` / ``phase_total`` are
    the current phase's own count (chunks while encoding). An ``ocr`` event (a page of a file being read) is
    not a phase: it sets ``ocr``, ``{"path", "done", "total"}`` in pages, until that file is counted."""
    phase = event.get("phase")
    if phase == "ocr":
        state["ocr"] = {
            "path": event.get("path"),
            "done": int(event.get("done") or 0),
            "total": int(event.get("total") or 0),
        }
        return state
    if phase != state.get("phase"):
        state["phase_done"] = 0
        if phase == "embed" and state.get("phase") in ITEM_PHASES:
            # every item is stored: the text is searchable while the vectors still come
            state["text_done"] = time.time()
    state["phase"] = phase
    state["phase_done"] = max(state.get("phase_done") or 0, int(event.get("done") or 0))
    state["phase_total"] = int(event.get("total") or 0)
    if phase in ITEM_PHASES:
        state["total"] = state["phase_total"]
        state["done"] = max(state.get("done") or 0, state["phase_done"])
        state["current"] = event.get("path") or None
        if (state.get("ocr") or {}).get("path") == state["current"]:
            state["ocr"] = None
        if event.get("status") == STATUS_ERROR:
            state.setdefault("errors", []).append(event.get("path") or "")
    else:
        state["current"] = None
    return state
