"""kb-rag MCP server: the local literature knowledge base for Claude Desktop, Cursor, Cherry Studio and any MCP client.

Eleven tools with the same contract as the DSH plugin (kb_ingest, kb_zotero, kb_search, kb_rag, kb_show, kb_dedup,
kb_clear, kb_stats, kb_fetch, kb_status, kb_watch), served over stdio (default) or streamable HTTP on the loopback
interface (`--http [--port N]`). Every call goes to one resident `kb_engine.py serve` process (see
engine_client.py) working on the library at KB_ROOT (default ~/.kb-rag).

Over HTTP every request needs `Authorization: Bearer <token>`: the token comes from KB_MCP_TOKEN or `--token`, or
is generated at start and printed on standard error. stdio needs no token.

Each tool returns the engine's Markdown (kb_engine.py renders it, the same text the DSH plugin shows) as its text
content and the engine's answer as structured content; bad arguments and engine errors come back as tool errors
(`isError: true`) and the server keeps running. A search or rag answer carries the engine's notices about the
library as the plugin's do: documents indexed by an older parser (on the server's first search) and what the watched
folders changed since its last search.

    python mcp-server/server.py                      # stdio
    python mcp-server/server.py --http --port 8765   # http://127.0.0.1:8765/mcp, token printed on stderr
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import sys
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

def _require_mcp() -> None:
    try:
        from importlib.metadata import PackageNotFoundError, version
        major = int(version("mcp").split(".")[0])
    except (ImportError, PackageNotFoundError, ValueError):
        major = 0
    if major < 2:
        sys.exit("kb-rag MCP server: needs the MCP Python SDK 2.x (pip install 'mcp>=2.3,<3', or "
                 "pip install -e '.[mcp]' "
                 "from the kb-rag repository)")


_require_mcp()

import jsonschema  # noqa: E402  (a dependency of the mcp SDK)
import mcp.types as types  # noqa: E402
from mcp.server.lowlevel import Server  # noqa: E402
from mcp.server.stdio import stdio_server  # noqa: E402

from contract import build_payload, failed_check, guidance_text, load_contract  # noqa: E402
from engine_client import EngineClient, EngineCrashed, EngineError, find_engine  # noqa: E402

log = logging.getLogger("kb-rag-mcp")

SERVER_NAME = "kb-rag"

CONTRACT = load_contract(find_engine)
# The tools this server offers: every tool of the contract that runs an engine command (kb_scope keeps per-session
# state that only the DSH host has).
SERVED = [tool for tool in CONTRACT["tools"] if tool["command"] is not None]
SERVED_BY_NAME = {tool["name"]: tool for tool in SERVED}
INSTRUCTIONS = guidance_text(CONTRACT, SERVED_BY_NAME)


def _tool(tool: dict) -> types.Tool:
    hints = tool["annotations"]
    return types.Tool(name=tool["name"], description=tool["description"], input_schema=tool["input_schema"],
                      annotations=types.ToolAnnotations(
                          title=hints["title"], read_only_hint=hints["readOnlyHint"],
                          destructive_hint=hints["destructiveHint"], idempotent_hint=hints["idempotentHint"],
                          open_world_hint=hints["openWorldHint"]))


TOOLS: list[types.Tool] = [_tool(tool) for tool in SERVED]


class ToolFailure(Exception):
    """A tool error the model should read: bad arguments, an engine error, a crashed engine."""

    def __init__(self, message: str, code: str = "bad_arguments"):
        super().__init__(message)
        self.code = code


def strict_schema(tool: dict) -> dict:
    """The advertised schema, closed at the root: an argument no tool declares is refused, not ignored."""
    return {**tool["input_schema"], "additionalProperties": False}


RETRIEVAL_TOOLS = ("kb_search", "kb_rag")


class KBServer:
    """The tool logic, independent of the transport."""

    def __init__(self, engine: EngineClient):
        self.engine = engine
        # What the engine is asked to say about the library beside a search: the DSH plugin asks per session; this
        # server (one client over stdio) asks per process: the stale-documents notice on its first search, and what
        # the watched folders changed since its last one.
        self.stale_asked = False
        self.last_search: float | None = None

    def notice_fields(self) -> dict:
        """The request fields that ask for this search's notices (and note the search)."""
        asked: dict = {}
        if not self.stale_asked:
            self.stale_asked = True
            asked["stale_notice"] = True
        if self.last_search is not None:
            asked["notices_since"] = self.last_search
        self.last_search = time.time()
        return asked

    async def call(self, name: str, args: dict, progress) -> tuple[str, dict, list[dict]]:
        tool = SERVED_BY_NAME.get(name)
        if tool is None:
            raise ToolFailure(f"unknown tool {name!r}; the kb-rag tools are: {', '.join(SERVED_BY_NAME)}",
                              "unknown_tool")
        check = failed_check(tool, args)      # first, so that a refusal reads the same as in the DSH plugin
        if check is not None:
            raise ToolFailure(check["message"], check.get("code", "bad_arguments"))
        try:
            jsonschema.validate(args, strict_schema(tool))
        except jsonschema.ValidationError as exc:
            where = ".".join(str(p) for p in exc.absolute_path)
            raise ToolFailure(f"invalid arguments for {name}: {(where + ': ') if where else ''}{exc.message}") from None
        payload = {**build_payload(tool, args, Path.cwd()), **tool.get("fixed", {})}
        # the engine renders the answer (the same Markdown every host shows) and words the library choice as
        # this server's user made it
        payload.update(render="markdown", kb_root_from=self.engine.kb_root_from)
        if name in RETRIEVAL_TOOLS:
            payload.update(self.notice_fields())
        value = await self._engine(tool["command"], payload, progress)
        value.pop("view", None)             # a card's data: an MCP client reads the Markdown and the answer
        return value.pop("markdown"), value, take_pictures(value)

    async def _engine(self, command: str, payload: dict, progress=None) -> dict:
        try:
            return await self.engine.request(command, payload, on_progress=progress)
        except EngineError as exc:
            raise ToolFailure(f"the kb engine refused {command}: {exc}", exc.code) from None
        except EngineCrashed as exc:
            raise ToolFailure(str(exc), "engine_crashed") from None


def take_pictures(value: dict) -> list[dict]:
    """The PNGs an answer carries inline (kb_show's images, the pictures kb_search / kb_rag were asked for),
    taken out of the answer: they travel as MCP image content, and the structured answer keeps the rest."""
    found = []
    holders = [*value.get("images", []), *(hit.get("picture") for key in ("results", "evidence")
                                           for hit in value.get(key) or [])]
    for holder in holders:
        if isinstance(holder, dict) and isinstance(holder.get("data"), str):
            found.append({"data": holder.pop("data"), "mime": holder.get("media_type", "image/png")})
            holder["content_index"] = len(found)      # the image's place in the content list (after the text)
    return found


def _file_name(path) -> str:
    return re.split(r"[\\/]", str(path))[-1]


class ProgressRelay:
    """Engine progress lines as MCP progress notifications: `progress` only grows, across phases. An `ocr` event
    (a page of a file being read) is a fraction of the next item: the item count stands still meanwhile."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.offset = 0.0
        self.last = 0.0          # the item (or chunk) count reached, across phases
        self.sent = 0.0          # the largest progress sent: OCR pages add fractions beyond ``last``
        self.phase = None

    async def __call__(self, event: dict) -> None:
        done, total = event.get("done"), event.get("total")
        if not isinstance(done, (int, float)):
            return
        phase = event.get("phase")
        if phase == "ocr":
            pages = total if isinstance(total, (int, float)) and total > 0 else done + 1
            progress, grand = self.last + done / (pages + 1), None
            message = f"OCR page {done}/{pages}"
        else:
            if phase != self.phase:
                self.offset = self.last
                self.phase = phase
            progress = self.offset + done
            if progress <= self.last and self.last:
                return
            self.last = progress
            grand = self.offset + total if isinstance(total, (int, float)) else None
            message = f"{phase} {done}/{total}" if total is not None else f"{phase} {done}"
        if progress <= self.sent:
            return
        self.sent = progress
        if event.get("path"):
            message += f": {_file_name(event['path'])}" + (f" ({event['status']})" if event.get("status") else "")
        await self.ctx.session.report_progress(progress, grand, message)


def _text_result(text: str, value: dict, is_error: bool = False,
                 images: Sequence[dict] = ()) -> types.CallToolResult:
    content: list = [types.TextContent(type="text", text=text)]
    content += [types.ImageContent(type="image", data=image["data"], mime_type=image["mime"]) for image in images]
    return types.CallToolResult(content=content, structured_content=value, is_error=is_error)


def build_server(engine: EngineClient) -> Server:
    kb = KBServer(engine)

    async def on_list_tools(ctx, params) -> types.ListToolsResult:
        return types.ListToolsResult(tools=TOOLS)

    async def on_call_tool(ctx, params: types.CallToolRequestParams) -> types.CallToolResult:
        args = dict(params.arguments or {})
        try:
            text, value, images = await kb.call(params.name, args, ProgressRelay(ctx))
        except ToolFailure as exc:
            return _text_result(f"{params.name} failed: {exc}", {"error": str(exc), "code": exc.code}, is_error=True)
        except Exception as exc:  # never let one call take the server down
            log.exception("tool %s failed", params.name)
            return _text_result(f"{params.name} failed: {type(exc).__name__}: {exc}",
                                {"error": f"{type(exc).__name__}: {exc}", "code": "internal"}, is_error=True)
        return _text_result(text, value, images=images)

    @asynccontextmanager
    async def lifespan(_server):
        watching = asyncio.create_task(watch_from_start(engine))
        try:
            yield {}
        finally:
            watching.cancel()
            await engine.close()

    return Server(SERVER_NAME, version=_version(), instructions=INSTRUCTIONS, lifespan=lifespan,
                  on_list_tools=on_list_tools, on_call_tool=on_call_tool)


async def watch_from_start(engine: EngineClient) -> None:
    """Keep a library's watched folders and Zotero libraries in step from the server's start, not from its first
    tool call: when the library exists, the engine starts now and lists its sources; with none it stops again
    (the first tool call starts it)."""
    if not (Path(engine.kb_root) / "kb.sqlite").is_file():
        return
    try:
        listed = await engine.request("watch", {"kb_root": str(engine.kb_root), "kb_root_from": engine.kb_root_from})
    except (EngineError, EngineCrashed) as exc:
        log.info("the engine was not started for watched sources: %s", exc)
        return
    if listed.get("sources"):
        log.info("keeping %d watched source(s) of %s in step", len(listed["sources"]), engine.kb_root)
    else:
        await engine.close_if_idle()


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("kb-rag")
    except Exception:
        return "0.1.0"


async def run_stdio(engine: EngineClient) -> None:
    server = build_server(engine)
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


# -- HTTP: loopback only, Host/Origin checked by the SDK, bearer token checked here ------------------------------

TOKEN_ENV = "KB_MCP_TOKEN"
MIN_TOKEN_LENGTH = 16
_TOKEN_CHARS = re.compile(r"[\x21-\x7e]+")  # visible ASCII: anything an Authorization header can carry as is


def token_problem(token: str) -> str | None:
    """Why `token` cannot be used as the HTTP bearer token, or None. Never quotes the token."""
    if len(token) < MIN_TOKEN_LENGTH:
        return f"the token must have at least {MIN_TOKEN_LENGTH} characters"
    if not _TOKEN_CHARS.fullmatch(token):
        return "the token may hold only visible ASCII characters (no spaces)"
    return None


class BearerTokenGate:
    """ASGI middleware in front of the whole HTTP app: a request without `Authorization: Bearer <token>` gets 401.

    The token is compared in constant time (SHA-256 digests of both sides through hmac.compare_digest, so neither
    its value nor its length shows in the timing). Lifespan events pass through; WebSocket attempts without the
    token are closed (the app has no WebSocket route anyway)."""

    REALM = 'Bearer realm="kb-rag"'

    def __init__(self, app, token: str):
        self.app = app
        self._digest = hashlib.sha256(token.encode("ascii")).digest()

    def _check(self, headers) -> tuple[bool, bool]:
        """(authorized, an Authorization header was sent)."""
        values = [v for k, v in headers if k.lower() == b"authorization"]
        if len(values) != 1:
            return False, bool(values)
        scheme, _, credentials = values[0].strip().partition(b" ")
        same = hmac.compare_digest(hashlib.sha256(credentials.strip()).digest(), self._digest)
        return same and scheme.lower() == b"bearer", True

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        authorized, sent = self._check(scope.get("headers") or [])
        if authorized:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({
            "error": "invalid_token" if sent else "unauthorized",
            "error_description": "kb-rag MCP server: send the header 'Authorization: Bearer <token>' with the token "
                                 f"printed on the server's standard error at start (or set with {TOKEN_ENV} / --token)",
        }).encode()
        challenge = self.REALM + (', error="invalid_token"' if sent else "")
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", challenge.encode()), (b"cache-control", b"no-store")]})
        await send({"type": "http.response.body", "body": body})


def build_http_app(engine: EngineClient, token: str):
    """The streamable HTTP app (DNS-rebinding protection for loopback hosts) behind the bearer-token gate."""
    if token_problem(token):
        raise ValueError(token_problem(token))
    app = build_server(engine).streamable_http_app(host="127.0.0.1")
    app.add_middleware(BearerTokenGate, token=token)
    return app


def run_http(engine: EngineClient, port: int, token: str, generated: bool) -> None:
    import uvicorn

    app = build_http_app(engine, token)
    url = f"http://127.0.0.1:{port}/mcp"
    lines = [f"kb-rag MCP server on {url} (library {engine.kb_root})"]
    if generated:
        lines += [
            f"No {TOKEN_ENV} or --token given: generated an access token for this run (a new one at each start).",
            "Every request must carry this header:",
            f"    Authorization: Bearer {token}",
            "MCP client configuration:",
            "    " + json.dumps({"mcpServers": {"kb-rag": {"url": url,
                                                       "headers": {"Authorization": f"Bearer {token}"}}}}),
            f"To keep one token across restarts, start the server with {TOKEN_ENV} set.",
        ]
    else:
        lines.append("Every request must carry the header 'Authorization: Bearer <token>' with the token you set "
                     f"({TOKEN_ENV} or --token).")
    print("\n".join(lines), file=sys.stderr, flush=True)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kb-rag-mcp", description="kb-rag MCP server (stdio by default)")
    parser.add_argument("--kb-root", help="library folder (default: $KB_ROOT, else the nearest .kb folder at or above "
                        "the current folder, else ~/.kb-rag: the command line's rule)")
    parser.add_argument("--http", action="store_true", help="serve streamable HTTP on 127.0.0.1 instead of stdio")
    parser.add_argument("--port", type=int, default=8765, help="HTTP port (with --http; default 8765)")
    parser.add_argument("--token", help=f"bearer token HTTP clients must send (with --http; default: ${TOKEN_ENV}, "
                        "else a random one printed on standard error). Other local users can read a process's "
                        f"command line: prefer ${TOKEN_ENV}")
    args = parser.parse_args(argv)
    if args.token is not None and not args.http:
        parser.error("--token only applies with --http (stdio needs no token)")
    token, generated = None, False
    if args.http:
        token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
        if token is None:
            token, generated = secrets.token_urlsafe(32), True
        problem = token_problem(token)
        if problem:
            parser.error(f"{'--token' if args.token is not None else TOKEN_ENV}: {problem}")
    logging.basicConfig(level=os.environ.get("KB_MCP_LOG", "WARNING").upper(), stream=sys.stderr)
    engine = EngineClient(kb_root=args.kb_root)
    if args.http:
        assert token is not None          # set above whenever args.http is
        run_http(engine, args.port, token, generated)
    else:
        asyncio.run(run_stdio(engine))
    return 0


if __name__ == "__main__":
    sys.exit(main())
