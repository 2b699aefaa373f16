"""A scripted stand-in for `kb_engine.py serve`, for the host clients' conformance cases.

Both serve clients (plugin/src/daemon.js and mcp-server/engine_client.py) start it exactly as they start the
engine (`python conformance_engine.py serve`) and run the cases of tests/fixtures/host-conformance.json against
it; each request's command picks what this process does, so that the behaviour a real engine shows only when it
breaks (a reply it could not tie to a request, a line too long to read, a crash, a slow answer) can be asked for.
Only the standard library; nothing is written anywhere.
"""
from __future__ import annotations

import json
import os
import select
import sys
import time

_buffer = bytearray()


def _read_line() -> bytes | None:
    """One request line, read straight from the descriptor (no hidden buffering: see `_more_waiting`)."""
    while b"\n" not in _buffer:
        chunk = os.read(0, 65536)
        if not chunk:
            return None
        _buffer.extend(chunk)
    end = _buffer.index(b"\n") + 1
    line = bytes(_buffer[:end])
    del _buffer[:end]
    return line


def _more_waiting() -> bool:
    """Whether another request has arrived already (a serial client sends none before its answer)."""
    return bool(_buffer) or bool(select.select([0], [], [], 0)[0])


def _write(obj, raw: bytes | None = None) -> None:
    sys.stdout.buffer.write((raw if raw is not None else json.dumps(obj).encode()) + b"\n")
    sys.stdout.buffer.flush()


def _ok(rid, response) -> None:
    _write({"id": rid, "ok": True, "response": response})


def _echo(rid, payload) -> None:
    _ok(rid, {"echo": payload})


def _progress(rid, payload) -> None:
    for done in (1, 2):
        _write({"id": rid, "event": "progress", "phase": "files", "done": done, "total": 2})
    _ok(rid, {"done": True})


def _null_id(rid, payload) -> None:
    # what the engine answers to a line it could not parse: it cannot know the id
    _write({"id": None, "ok": False, "error": "request line is not valid JSON", "code": "invalid_json"})


def _strays(rid, payload) -> None:
    _write(None, b"not json at all")
    _write([1, 2, 3])
    _write({"id": True, "ok": True, "response": {"wrong": "id true is not id 1"}})
    _write({"id": rid + 1000, "ok": True, "response": {"wrong": "another id"}})
    _write({"id": rid, "event": None, "ok": True, "response": {"right": True}})


def _no_ok(rid, payload) -> None:
    _write({"id": rid, "response": {"looks": "like a reply"}})


def _oversized(rid, payload) -> None:
    size = int(payload.get("bytes", 2 << 20))
    head = json.dumps({"id": rid, "ok": True, "response": {"text": ""}})[:-3].encode()
    _write(None, head + b"x" * size + b'"}}')


def _crash(rid, payload) -> None:
    sys.stderr.write("boom: simulated failure\n")
    sys.stderr.flush()
    os._exit(3)


def _slow(rid, payload) -> None:
    time.sleep(float(payload.get("seconds", 1.0)))
    _ok(rid, {"next_arrived_early": _more_waiting(), "pid": os.getpid()})


def _pid(rid, payload) -> None:
    _ok(rid, {"pid": os.getpid()})


BEHAVIOURS = {"echo": _echo, "progress": _progress, "null_id": _null_id, "strays": _strays, "no_ok": _no_ok,
              "oversized": _oversized, "crash": _crash, "slow": _slow, "pid": _pid}


def main() -> int:
    while True:
        line = _read_line()
        if line is None:
            return 0
        request = json.loads(line)
        BEHAVIOURS[request["command"]](request["id"], request.get("payload") or {})


if __name__ == "__main__":
    sys.exit(main())
