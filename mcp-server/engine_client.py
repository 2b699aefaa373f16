"""A resident `kb_engine.py serve` process driven over its JSON-lines protocol.

`EngineClient` starts the engine with a fixed argv (no shell), sends one request line at a time through a serial
queue, matches replies by id, hands progress lines (`event: "progress"`) to the caller's callback and never takes
them for a reply. When the process dies, the request in flight fails with `EngineCrashed` (a readable message
with the exit status and the tail of its stderr) and the next request starts a fresh process. A request whose
caller is cancelled stops the process too: the serial channel then holds work nobody waits for.

Only the standard library is used, so this module can be tested without the `mcp` package.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
import re
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

STDERR_TAIL = 4000
# The longest reply line read. The engine never writes one over 48 MiB (it answers reply_too_large instead), so a
# longer line comes from an engine of another version or a broken one: its request fails, the channel goes on.
LINE_LIMIT = 64 * 1024 * 1024
READ_CHUNK = 1 << 16
KILL_WAIT_S = 3.0
_REPLY_ID = re.compile(rb'^\s*\{\s*"id"\s*:\s*(-?\d+)\s*[,}]')

ProgressFn = Callable[[dict], Awaitable[None]]


class EngineError(Exception):
    """The engine answered `ok: false`."""

    def __init__(self, message: str, code: str | None, command: str):
        super().__init__(message)
        self.code = code or "internal"
        self.command = command


class EngineCrashed(Exception):
    """The engine process could not be started, or ended while a request was in flight."""


class OversizedLine:
    """A line longer than the limit: its first bytes (where a reply names its id); the rest was dropped."""

    def __init__(self, head: bytes):
        self.head = head

    def request_id(self) -> int | None:
        match = _REPLY_ID.match(self.head)
        return int(match.group(1)) if match else None


async def read_lines(stream: asyncio.StreamReader, limit: int = LINE_LIMIT):
    """Each line of the stream (bytes, newline included), or an OversizedLine for one longer than ``limit``, whose
    bytes are skipped up to its newline without being kept: memory stays bounded by the limit."""
    line = bytearray()
    skipping = False
    while True:
        chunk = await stream.read(READ_CHUNK)
        if not chunk:
            if line and not skipping:
                yield bytes(line)
            return
        start = 0
        while start < len(chunk):
            end = chunk.find(b"\n", start)
            stop = len(chunk) if end < 0 else end + 1
            if not skipping:
                line += chunk[start:stop]
                if len(line) > limit:
                    yield OversizedLine(bytes(line[:256]))
                    line.clear()
                    skipping = end < 0
                elif end >= 0:
                    yield bytes(line)
                    line.clear()
            elif end >= 0:
                skipping = False
            start = stop


def find_engine() -> Path:
    """kb_engine.py: $KB_ENGINE, else the repository copy next to mcp-server/, else the installed module."""
    explicit = os.environ.get("KB_ENGINE")
    if explicit:
        return Path(explicit).expanduser().resolve()
    here = Path(__file__).resolve().parent.parent / "kb_engine.py"
    if here.is_file():
        return here
    try:
        import importlib.util

        spec = importlib.util.find_spec("kb_engine")
        if spec and spec.origin:
            return Path(spec.origin).resolve()
    except (ImportError, ValueError):
        pass
    raise EngineCrashed("kb_engine.py not found: install kb-rag (pip install -e '.[mcp]') or set KB_ENGINE to its path")


def library_choice(named: Path | str | None = None) -> tuple[Path, str]:
    """The library this server opens and why, by the engine's own rule (kb_engine.library_choice: --kb-root, else
    $KB_ROOT, else the nearest .kb folder at or above the current folder, else ~/.kb-rag), read from the engine
    shipped beside this server, so that the CLI and this server never disagree about which library a folder
    means."""
    root, chosen = _engine_module().library_choice(str(named) if named else None)
    return root.resolve(), chosen.replace("`kb_root`", "--kb-root")


@functools.lru_cache(maxsize=1)
def _engine_module():
    """The engine shipped with this server (the repository copy next to mcp-server/, else the installed module),
    loaded as a module of its own name: its top level imports only the standard library, so this costs a fraction
    of a second and no model. Not $KB_ENGINE, which may be any program that speaks the protocol (a wrapper that
    starts serving when run)."""
    import importlib.util

    name = "_kb_engine_of_mcp_server"
    here = Path(__file__).resolve().parent.parent / "kb_engine.py"
    if not here.is_file():
        import kb_engine
        return kb_engine
    spec = importlib.util.spec_from_file_location(name, here)
    if spec is None or spec.loader is None:
        raise EngineCrashed("kb_engine.py could not be loaded to find the library")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module                  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


class EngineClient:
    def __init__(self, *, kb_root: Path | str | None = None, python: str | None = None,
                 engine: Path | str | None = None, env: dict[str, str] | None = None, line_limit: int = LINE_LIMIT):
        self.kb_root, chosen = library_choice(kb_root)
        # how this server's user chose the library and opens another: sent with each request (`kb_root_from`), so
        # that an answer read from no library says it in these words
        self.kb_root_from = f"{chosen}; start the server with --kb-root PATH or KB_ROOT=PATH to open another"
        self.python = python or os.environ.get("KB_PYTHON") or sys.executable
        self.engine = Path(engine) if engine else None
        self.base_env = dict(os.environ if env is None else env)
        self.line_limit = line_limit                # the longest reply line read (bytes)
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task | None = None
        self._stderr_task: asyncio.Task | None = None
        self._stderr_tail = ""
        self._pending: dict[int, tuple[asyncio.Future, ProgressFn | None, str]] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._doomed = False  # the process was signalled by a cancelled request and is being replaced
        self.starts = 0
        self.closed = False

    # -- process lifecycle ---------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc and self._proc.returncode is None else None

    def _argv(self) -> list[str]:
        engine = self.engine or find_engine()
        return [self.python, str(engine), "serve"]  # fixed argv: nothing from a request reaches it

    async def _start(self) -> None:
        env = dict(self.base_env)
        env["KB_ROOT"] = str(self.kb_root)
        env.setdefault("PYTHONUNBUFFERED", "1")
        argv = self._argv()
        cwd = self.kb_root  # the library folder, or its nearest existing parent: nothing is created here
        while not cwd.is_dir() and cwd.parent != cwd:
            cwd = cwd.parent
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, cwd=str(cwd),
                start_new_session=(os.name == "posix"),
            )
        except OSError as exc:
            self._proc = None
            raise EngineCrashed(f"could not start the kb engine ({argv[0]} {argv[1]} serve): {exc}") from exc
        self.starts += 1
        self._doomed = False
        self._stderr_tail = ""
        proc = self._proc
        self._reader = asyncio.create_task(self._read_stdout(proc))
        self._stderr_task = asyncio.create_task(self._read_stderr(proc))

    async def _ensure_started(self) -> None:
        if self.closed:
            raise EngineCrashed("the kb engine client was shut down")
        if self._proc is not None and (self._proc.returncode is not None or self._doomed):
            await self._kill()  # reaps a process that died or was stopped by a cancelled request
        if self._proc is None:
            await self._start()

    async def _read_stderr(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        while True:
            chunk = await proc.stderr.read(4096)
            if not chunk:
                return
            self._stderr_tail = (self._stderr_tail + chunk.decode("utf-8", "replace"))[-STDERR_TAIL:]

    async def _read_stdout(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        try:
            async for line in read_lines(proc.stdout, self.line_limit):
                if isinstance(line, OversizedLine):
                    self._fail_oversized(line)
                    continue
                try:
                    msg = json.loads(line)
                except (ValueError, RecursionError):
                    continue
                if not isinstance(msg, dict):
                    continue
                entry = self._entry_for(msg.get("id"))
                if entry is None:
                    continue  # a reply nobody waits for (its caller was cancelled)
                future, on_progress, _ = entry
                if msg.get("event") is not None:
                    if on_progress is not None:
                        try:
                            await on_progress(msg)
                        except Exception:  # a progress relay must never break the channel
                            pass
                    continue
                if not future.done():
                    future.set_result(msg)
        finally:
            code = await proc.wait()
            if self._stderr_task is not None:
                try:
                    await asyncio.wait_for(asyncio.shield(self._stderr_task), 1.0)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    pass
            reason = self._describe_exit(code)
            for future, _, _ in list(self._pending.values()):
                if not future.done():
                    future.set_exception(EngineCrashed(reason))

    def _entry_for(self, rid):
        """The pending request a line answers: the one with its id, or, for a reply whose id the engine could not
        read (null), the one request in flight (requests are serial). ``true`` is no id."""
        if type(rid) is int:
            return self._pending.get(rid)
        if rid is None and len(self._pending) == 1:
            return next(iter(self._pending.values()))
        return None

    def _fail_oversized(self, line: OversizedLine) -> None:
        """A line too long to read fails the request it answers (all of them when its id cannot be read: the
        channel is serial, so that is the one in flight) with a clear error, instead of leaving it waiting."""
        rid = line.request_id()
        targets = [self._pending[rid]] if rid in self._pending else list(self._pending.values())
        for future, _, command in targets:
            if not future.done():
                future.set_exception(EngineError(
                    f"the engine's reply is longer than the {round(self.line_limit / (1 << 20))} MiB this client "
                    "reads, so it was "
                    "dropped; ask for less at a time (a smaller top_k or snippet)", "reply_too_large", command))

    def _describe_exit(self, code: int | None) -> str:
        if code is not None and code < 0:
            how = f"was killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        tail = self._stderr_tail.strip().splitlines()[-5:]
        detail = (": " + " | ".join(tail)) if tail else ""
        return f"the kb engine process {how} while handling the request{detail}; it restarts on the next call"

    async def _reap(self) -> None:
        if self._reader is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._reader), KILL_WAIT_S)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._reader.cancel()
        self._proc = None
        self._reader = None

    def _signal_kill(self) -> None:
        """SIGKILL the engine and its reader workers (its process group), without waiting."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        try:
            if os.name == "posix":
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
        except (ProcessLookupError, PermissionError):
            try:
                proc.kill()
            except ProcessLookupError:
                pass

    async def _kill(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None:
            self._signal_kill()
            try:
                await asyncio.wait_for(proc.wait(), KILL_WAIT_S)
            except asyncio.TimeoutError:
                pass
        await self._reap()

    async def close_if_idle(self) -> bool:
        """Stop the engine unless a request is in flight or waiting (then False): for one started for nothing."""
        if self._lock.locked():
            return False
        async with self._lock:          # taken at once (nothing awaited since the check): no request interleaves
            await self.close()
        return True

    async def close(self) -> None:
        """Stop the engine: end of input first (it exits 0), then a kill if it lingers. A later request starts it
        again."""
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None and proc.stdin is not None:
            try:
                proc.stdin.close()
                await asyncio.wait_for(proc.wait(), KILL_WAIT_S)
            except (asyncio.TimeoutError, OSError, RuntimeError):
                pass
        await self._kill()

    # -- requests ------------------------------------------------------------------------------------------

    async def request(self, command: str, payload: dict | None = None, *,
                      on_progress: ProgressFn | None = None) -> dict:
        """Run one engine command and return its `response`; raise EngineError or EngineCrashed."""
        async with self._lock:
            for attempt in (1, 2):
                await self._ensure_started()
                proc = self._proc
                assert proc is not None and proc.stdin is not None
                rid = next(self._ids)
                future: asyncio.Future = asyncio.get_running_loop().create_future()
                self._pending[rid] = (future, on_progress, command)
                line = json.dumps({"id": rid, "command": command, "payload": payload or {}}) + "\n"
                try:
                    try:
                        proc.stdin.write(line.encode("utf-8"))
                        await proc.stdin.drain()
                    except (BrokenPipeError, ConnectionResetError, RuntimeError):
                        # The process was already gone when the line was written: it never saw the request, so
                        # it is sent once more to a fresh process.
                        if attempt == 1:
                            await self._kill()
                            continue
                        raise EngineCrashed(
                            "the kb engine process could not be reached; it restarts on the next call") from None
                    try:
                        reply = await future
                    except asyncio.CancelledError:
                        # The caller gave up (an MCP cancellation or timeout): the serial channel now holds a
                        # request nobody waits for, so the process is stopped now, synchronously (a cancelled
                        # task may not await), and replaced by the next request.
                        self._doomed = True
                        self._signal_kill()
                        raise
                    except EngineCrashed:
                        await self._reap()
                        raise
                finally:
                    self._pending.pop(rid, None)
                if reply.get("ok") is True:
                    response = reply.get("response")
                    return response if isinstance(response, dict) else {}
                raise EngineError(str(reply.get("error") or "the engine reported an error"), reply.get("code"), command)
        raise EngineCrashed("unreachable")  # pragma: no cover
