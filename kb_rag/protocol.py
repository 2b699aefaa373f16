"""Protocol: one-shot JSON and ``serve`` JSON lines: parsing, bounded replies, the serve loop.

May import: commands.table, config, storage.
"""

from __future__ import annotations

import json
import sqlite3
import sys

from .commands.table import Engine
from .config import MAX_PROTOCOL_LINE_BYTES, MAX_REPLY_BYTES, KBError, __version__, _short_error, too_deep
from .storage import is_disk_full


def to_json_line(obj: dict) -> str:
    """One line of strict JSON (no NaN or Infinity, ASCII only)."""
    try:
        return json.dumps(obj, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    except (ValueError, TypeError) as exc:
        fallback = {"ok": False, "error": f"the reply could not be encoded as JSON: {exc}", "code": "internal"}
        if "id" in obj:
            fallback["id"] = obj["id"] if isinstance(obj["id"], (str, int, type(None))) else None
        return json.dumps(fallback, ensure_ascii=True)


def bounded_reply_line(reply: dict, command: str | None) -> tuple[str, bool]:
    """(line, whether the reply fits): the reply as one line, or, when that would pass MAX_REPLY_BYTES, a
    reply_too_large error in its place that keeps the reply's id (and says that a writing command's work is done
    and kept)."""
    line = to_json_line(reply)
    if len(line) <= MAX_REPLY_BYTES:
        return line, True
    done = " The command itself ran to its end: what it wrote is kept." if command in Engine.WRITE_COMMANDS else ""
    error = {
        "ok": False,
        "code": "reply_too_large",
        "error": f"the reply would be {len(line) / 2**20:.0f} MiB, more than the {MAX_REPLY_BYTES >> 20} MiB a "
        "reply may hold; ask for less at a time (a smaller top_k or snippet, a docs limit, fewer "
        f"paths).{done}",
    }
    if "id" in reply:
        error = {"id": reply["id"], **error}
    return to_json_line(error), False


def error_reply(exc: BaseException) -> dict:
    if isinstance(exc, KBError):
        return {"ok": False, "error": exc.message, "code": exc.code, **getattr(exc, "details", {})}
    if is_disk_full(exc):
        return {"ok": False, "error": f"the disk is full: {_short_error(exc)}", "code": "disk_full"}
    if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
        return {"ok": False, "error": f"the library is busy (locked by another process): {exc}", "code": "busy"}
    return {"ok": False, "error": f"{type(exc).__name__}: {_short_error(exc)}", "code": "internal"}


def _read_protocol_line(stream) -> tuple[bytes | None, bool]:
    """Next line (without newline) and whether it exceeded the size limit; (None, False) at EOF."""
    line = stream.readline(MAX_PROTOCOL_LINE_BYTES + 1)
    if not line:
        return None, False
    if len(line) > MAX_PROTOCOL_LINE_BYTES and not line.endswith(b"\n"):
        while True:  # drain the rest of the oversized line
            rest = stream.readline(1 << 20)
            if not rest or rest.endswith(b"\n"):
                break
        return b"", True
    return line.rstrip(b"\r\n"), False


def parse_json_object(raw: bytes, what: str, shape: str) -> dict:
    """The JSON object in ``raw``, one parser for both transports: ``what`` names the input in errors (the request
    line, stdin) and ``shape`` what it must be. Bytes that are not UTF-8, text that is not JSON and JSON that is not
    an object each get their own error code; JSON nested too deep for the parser is the payload depth's
    bad_request."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise KBError("invalid_utf8", f"{what} is not valid UTF-8") from None
    try:
        value = json.loads(text)
    except RecursionError:  # the parser's own depth limit: far past MAX_PAYLOAD_DEPTH, so the same refusal
        raise too_deep(what) from None
    except ValueError:
        raise KBError("invalid_json", f"{what} is not valid JSON") from None
    if not isinstance(value, dict):
        raise KBError("bad_request", f"{shape} must be a JSON object")
    return value


def parse_request(raw: bytes) -> tuple[object, str, dict]:
    """(id, command, payload) of one protocol line; raises KBError with the id it could read."""
    message = parse_json_object(raw, "the request line", "a request {id, command, payload}")
    request_id = message.get("id")  # echoed as received (ensure_ascii escapes any surrogate)
    command, payload = message.get("command"), message.get("payload", {})
    if not isinstance(command, str) or not command:
        raise RequestError("bad_request", "command must be a non-empty string", request_id)
    if payload is None:
        payload = {}
    if not isinstance(payload, dict):
        raise RequestError("bad_request", "payload must be a JSON object", request_id)
    return request_id, command, payload


class RequestError(KBError):
    """A protocol line refused before its command runs, knowing the request's id (the reply echoes it)."""

    def __init__(self, code: str, message: str, request_id: object):
        super().__init__(code, message)
        self.request_id = request_id


def serve(engine: Engine, stdin=None, stdout=None) -> int:
    """JSON lines: exactly one reply for every non-empty request line; returns at EOF."""
    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout
    original, sys.stdout = sys.stdout, sys.stderr  # stray prints from libraries must not corrupt the stream
    try:
        return _serve_loop(engine, stdin, stdout)
    finally:
        sys.stdout = original


def _serve_loop(engine: Engine, stdin, stdout) -> int:
    def write(obj: dict) -> None:
        stdout.write(to_json_line(obj) + "\n")
        stdout.flush()

    while True:
        raw, oversized = _read_protocol_line(stdin)
        if raw is None:
            return 0
        if oversized:
            write(
                {
                    "id": None,
                    "ok": False,
                    "code": "too_large",
                    "error": f"request line longer than {MAX_PROTOCOL_LINE_BYTES} bytes",
                }
            )
            continue
        if not raw.strip():
            continue
        request_id = command = None
        try:
            request_id, command, payload = parse_request(raw)

            def progress(event: dict, rid=request_id) -> None:
                write({"id": rid, "event": "progress", **event})

            response = engine.execute(command, payload, progress=progress)
            stdout.write(bounded_reply_line({"id": request_id, "ok": True, "response": response}, command)[0] + "\n")
            stdout.flush()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # the daemon must outlive any request
            reply = error_reply(exc)
            write({"id": getattr(exc, "request_id", request_id), **reply})


def run_one_shot(command: str, engine: Engine) -> int:
    raw = sys.stdin.buffer.read()
    reply_stream, sys.stdout = sys.stdout, sys.stderr  # only the reply goes to stdout
    try:
        reply = _one_shot_reply(command, engine, raw)
    finally:
        sys.stdout = reply_stream
    line, fits = bounded_reply_line(reply, command)
    reply_stream.write(line + "\n")
    reply_stream.flush()
    return 0 if reply["ok"] and fits else 1


def _one_shot_reply(command: str, engine: Engine, raw: bytes) -> dict:
    try:
        payload = parse_json_object(raw, "stdin", "the payload on stdin") if raw.strip() else {}
        reply = {"ok": True, **engine.execute(command, payload)}
    except Exception as exc:
        reply = error_reply(exc)
    reply.setdefault("engine", __version__)
    return reply
