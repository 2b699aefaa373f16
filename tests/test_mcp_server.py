"""The MCP server (mcp-server/server.py) driven by the official MCP client over stdio.

Each test starts `python mcp-server/server.py` through `mcp.client.stdio.stdio_client`, talks to it with
`ClientSession`, and checks the nine tools: listing and annotations, ingest with progress, search, rag, stats,
background jobs, tool errors for bad arguments (the server keeps serving), and recovery from an engine crash.
The streamable HTTP tests start `server.py --http` and check its bearer token: generated and printed when none is
given, taken from KB_MCP_TOKEN or --token otherwise, and required on every request (401 without it).
Skipped when the `mcp` package is not installed (`pip install -e '.[mcp]'`).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import version
from pathlib import Path

import pytest

mcp = pytest.importorskip("mcp")
anyio = pytest.importorskip("anyio")
if int(version("mcp").split(".")[0]) < 2:
    pytest.skip("the MCP server needs the MCP Python SDK 2.x", allow_module_level=True)
from mcp import ClientSession, StdioServerParameters  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402

from helpers import PLUGIN, ROOT, ensure_plugin_modules, sp  # noqa: E402

pytestmark = [pytest.mark.slow]

SERVER = ROOT / "mcp-server" / "server.py"
TOOL_NAMES = {"kb_ingest", "kb_zotero", "kb_search", "kb_rag", "kb_show", "kb_dedup", "kb_clear", "kb_stats",
              "kb_fetch", "kb_status", "kb_watch"}
CALL_TIMEOUT = 60


def server_env(kb_root: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_")}
    env.update({"KB_ROOT": str(kb_root), "KB_EMBED_MODEL": "none", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "KB_INGEST_WORKERS": "0"})
    env.update(extra)
    return env


def run_session(kb_root: Path, body, **env):
    """Start the server over stdio, initialise a ClientSession and run `await body(session)`."""
    params = StdioServerParameters(command=sys.executable, args=[str(SERVER)], env=server_env(kb_root, **env),
                                   cwd=str(ROOT))

    async def main():
        with anyio.fail_after(CALL_TIMEOUT * 2):
            async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                return await body(session)

    return anyio.run(main)


def text_of(result) -> str:
    return "\n".join(c.text for c in result.content if getattr(c, "type", None) == "text")


async def call(session, name, args=None, **kw):
    return await session.call_tool(name, args or {}, read_timeout_seconds=CALL_TIMEOUT, **kw)


def engine_pids(kb_root: Path) -> list[int]:
    """Engine processes (`kb_engine.py serve`) working on kb_root, found through /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            if not any(b"kb_engine.py" in part for part in cmd) or b"serve" not in cmd:
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"KB_ROOT={kb_root}".encode() in env:
            pids.append(int(entry.name))
    return pids


@pytest.fixture
def quick_papers(tmp_path) -> Path:
    out = tmp_path / "papers"
    out.mkdir()
    sp.write_quickstart(out)
    return out


# (read-only, destructive, idempotent, open world) of each tool
TOOL_HINTS = {
    "kb_search": (True, False, True, False),
    "kb_rag": (True, False, True, False),
    "kb_show": (True, False, True, False),
    "kb_stats": (True, False, True, False),
    "kb_status": (True, False, True, False),
    "kb_watch": (False, False, True, False),
    "kb_ingest": (False, False, True, False),
    "kb_zotero": (False, False, True, False),
    "kb_fetch": (False, False, False, True),
    "kb_dedup": (False, True, True, False),
    "kb_clear": (False, True, True, False),
}


def test_lists_ten_tools_with_schemas_and_annotations(tmp_path):
    async def body(session):
        return (await session.list_tools()).tools

    tools = {t.name: t for t in run_session(tmp_path / "kb", body)}
    assert set(tools) == TOOL_NAMES
    for tool in tools.values():
        assert tool.description and tool.input_schema["type"] == "object"
        assert tool.annotations is not None and tool.annotations.title
    assert tools["kb_search"].input_schema["required"] == ["query"]
    assert set(tools["kb_search"].input_schema["properties"]) == {"query", "queries", "top_k", "mode", "depth",
                                                                   "filters", "pictures"}
    assert tools["kb_show"].input_schema["required"] == ["doc_id"]
    assert tools["kb_clear"].input_schema["required"] == ["confirm"]
    assert tools["kb_fetch"].input_schema["required"] == ["identifier"]
    assert set(tools["kb_fetch"].input_schema["properties"]) == {"identifier", "dest"}
    hints = {name: (t.annotations.read_only_hint, t.annotations.destructive_hint, t.annotations.idempotent_hint,
                    t.annotations.open_world_hint) for name, t in tools.items()}
    assert hints == TOOL_HINTS


def offered_by_mcp(kb_root: Path) -> tuple[dict, str]:
    """What the MCP server offers a model, through the official client: {tool name: (description, input
    schema)} and the instructions (its guidance)."""
    params = StdioServerParameters(command=sys.executable, args=[str(SERVER)], env=server_env(kb_root), cwd=str(ROOT))

    async def main():
        with anyio.fail_after(CALL_TIMEOUT * 2):
            async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
                initialized = await session.initialize()
                return (await session.list_tools()).tools, initialized.instructions

    tools, instructions = anyio.run(main)
    return {t.name: (t.description, t.input_schema) for t in tools}, instructions


def assert_same_offer(dsh_tools: dict, dsh_guidance: str, kb_root: Path) -> None:
    """DSH's tools ({name: (description, parameters)}) and guidance against the MCP server's: the nine shared
    tools identical field by field, the guidance the same text but for the DSH host's one line about kb_scope."""
    mcp_tools, instructions = offered_by_mcp(kb_root)
    assert set(mcp_tools) == TOOL_NAMES and set(dsh_tools) == TOOL_NAMES | {"kb_scope"}
    for name in sorted(TOOL_NAMES):
        assert mcp_tools[name][0] == dsh_tools[name][0], f"{name}: descriptions differ"
        assert mcp_tools[name][1] == dsh_tools[name][1], f"{name}: schemas differ"
    scope_lines = [line for line in dsh_guidance.splitlines() if "kb_scope" in line]
    assert len(scope_lines) == 1
    assert instructions == "\n".join(line for line in dsh_guidance.splitlines() if line not in scope_lines)


def test_dsh_and_mcp_offer_the_same_tools_and_guidance(tmp_path):
    """The DSH plugin in the real tool registry against the MCP server through the official client (issue 19);
    tests/test_dsh_e2e.py repeats this with the packed bundle in a real DSH process."""
    ensure_plugin_modules()
    report = subprocess.run(["node", "testlib/host-report.mjs"], cwd=PLUGIN, capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, KB_TEST_PYTHON=sys.executable))
    assert report.returncode == 0, report.stderr[-2000:]
    dsh = json.loads(report.stdout)
    [guidance] = dsh["guidance"]
    assert_same_offer({s["name"]: (s["description"], s["parameters"]) for s in dsh["schemas"]}, guidance,
                      tmp_path / "kb")


SESSION_LINES = ("_Scope: ", "_Library: ")      # the DSH host's own lines: its session's scope and notices


def test_dsh_and_mcp_show_the_same_markdown(tmp_path, quick_papers):
    """The same calls on the same library through the DSH plugin (the real tool registry, the real engine) and the
    MCP server (the official client): the text the model reads is identical but for the DSH host's session lines
    (issue 30: the engine renders it once for both)."""
    ensure_plugin_modules()
    workspace = tmp_path / "ws"
    workspace.mkdir()
    calls = [("kb_ingest", {"paths": [str(quick_papers)]}),
             ("kb_search", {"query": "graphene nucleation copper", "top_k": 3}),
             ("kb_search", {"query": "石墨烯在铜上的成核", "mode": "keyword",
                            "queries": ["graphene nucleation copper"]}),
             ("kb_search", {"query": "zzyzx quasiperiodic frobnication"}),
             ("kb_rag", {"query": "graphene domains nucleate on copper"}),
             ("kb_stats", {}), ("kb_dedup", {}), ("kb_status", {})]
    report = subprocess.run(["node", "testlib/host-report.mjs", "--calls"], cwd=PLUGIN, capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, KB_TEST_PYTHON=sys.executable),
                            input=json.dumps({"cwd": str(workspace),
                                              "calls": [{"tool": t, "args": a} for t, a in calls]}))
    assert report.returncode == 0, report.stderr[-2000:]
    dsh = json.loads(report.stdout)
    assert not any(r["isError"] for r in dsh), dsh

    async def body(session):        # the library the DSH calls built: its ingest is not repeated
        return [text_of(await call(session, tool, args)) for tool, args in calls[1:]]

    mcp = run_session(workspace / ".kb", body, KB_RERANK_FALLBACK="none")
    assert any(line.startswith("_Scope: ") for line in dsh[1]["text"].splitlines()), "the DSH host adds its line"
    assert "\n1. " in mcp[0] and "**Evidence**" in mcp[3] and "documents: 5 indexed" in mcp[4], mcp
    for (tool, args), shown, served in zip(calls[1:], dsh[1:], mcp):
        own = "\n".join(line for line in shown["text"].splitlines() if not line.startswith(SESSION_LINES))
        assert own == served, f"{tool} {args}: the hosts' Markdown differs"


def test_ingest_search_rag_stats(tmp_path, quick_papers):
    kb_root = tmp_path / "kb"
    progress: list[tuple] = []

    async def on_progress(p, total, message):
        progress.append((p, total, message))

    async def body(session):
        out = {"ingest": await call(session, "kb_ingest", {"paths": [str(quick_papers)]},
                                   progress_callback=on_progress)}
        out["search"] = await call(session, "kb_search", {"query": "graphene nucleation copper", "top_k": 3})
        out["filtered"] = await call(session, "kb_search", {"query": "graphene", "filters": {"kind": "docx"}})
        out["rendered"] = await call(session, "kb_search", {"query": "石墨烯在铜上的成核", "top_k": 3,
                                                            "mode": "keyword",
                                                            "queries": ["graphene nucleation copper"]})
        out["rag"] = await call(session, "kb_rag", {"query": "graphene domains nucleate on copper"})
        out["stats"] = await call(session, "kb_stats")
        out["dedup"] = await call(session, "kb_dedup")
        out["status"] = await call(session, "kb_status")
        return out

    r = run_session(kb_root, body)
    for name, result in r.items():
        assert not result.is_error, (name, text_of(result))

    ingest = r["ingest"].structured_content
    assert ingest["totals"]["added"] == 5 and ingest["totals"]["error"] == 0
    assert "Ingest finished" in text_of(r["ingest"])
    assert progress, "ingest progress was not relayed as MCP progress notifications"
    values = [p for p, _, _ in progress]
    assert values == sorted(values) and len(set(values)) == len(values)
    assert any("files" in (m or "") for _, _, m in progress)

    search = r["search"].structured_content
    assert 1 <= search["count"] <= 3
    top = search["results"][0]
    assert "graphene" in top["title"].lower()
    text = text_of(r["search"])
    assert text.startswith("**Knowledge base:") and "graphene" in text.lower()
    assert all(hit["kind"] == "docx" for hit in r["filtered"].structured_content["results"])
    rendered = r["rendered"].structured_content      # the English rendering finds what the Chinese words cannot
    assert rendered["queries"] == ["graphene nucleation copper"]
    assert "graphene" in rendered["results"][0]["title"].lower()

    rag = r["rag"].structured_content
    assert rag["evidence"] and len(rag["evidence"]) <= 3
    assert "**Evidence**" in text_of(r["rag"])

    stats = r["stats"].structured_content
    assert stats["indexed_docs"] == 5 and stats["chunks"] > 0
    assert Path(stats["kb_root"]) == kb_root.resolve()
    assert "**Knowledge base**" in text_of(r["stats"])
    assert "groups" in r["dedup"].structured_content
    assert "jobs" in r["status"].structured_content


def test_the_engines_notices_reach_an_mcp_client_once(tmp_path, quick_papers):
    """The engine words the stale-documents notice; the server asks for it on its first search only (the MCP
    users never saw the notices the DSH plugin showed)."""
    kb_root = tmp_path / "kb"

    async def body(session):
        await call(session, "kb_ingest", {"paths": [str(quick_papers)]})
        with sqlite3.connect(kb_root / "kb.sqlite") as con:     # as an older parser would have left them
            con.execute("UPDATE docs SET indexed_with = indexed_with - 1")
        con.close()
        first = await call(session, "kb_search", {"query": "graphene nucleation copper"})
        second = await call(session, "kb_rag", {"query": "graphene nucleation copper"})
        return first, second

    first, second = run_session(kb_root, body)
    lines = text_of(first).split("\n")
    assert lines[1].startswith("_Library: 5 document(s) were indexed by an older parser"), lines[:3]
    assert [n["kind"] for n in first.structured_content["notices"]] == ["stale_documents"]
    assert "older parser" not in text_of(second) and second.structured_content["notices"] == []


def test_bad_arguments_are_tool_errors_and_the_server_keeps_serving(tmp_path, quick_papers):
    async def body(session):
        out = {
            "empty_query": await call(session, "kb_search", {"query": "   "}),
            "bad_type": await call(session, "kb_search", {"query": "graphene", "top_k": "ten"}),
            "too_many": await call(session, "kb_rag", {"query": "graphene", "top_k": 500}),
            "bad_filter": await call(session, "kb_search", {"query": "graphene", "filters": {"colour": "red"}}),
            "bad_queries": await call(session, "kb_search", {"query": "graphene", "queries": ["a"] * 5}),
            "no_paths": await call(session, "kb_ingest", {}),
            "no_confirm": await call(session, "kb_clear", {"confirm": False}),
            "confirm_missing": await call(session, "kb_clear", {}),
            "fetch": await call(session, "kb_fetch", {"identifier": "   "}),
            "unknown_tool": await call(session, "kb_nope", {}),
            "missing_job": await call(session, "kb_status", {"job_id": "0123456789ab"}),
            "cancel_no_id": await call(session, "kb_status", {"cancel": True}),
        }
        out["ingest"] = await call(session, "kb_ingest", {"paths": [str(quick_papers)]})
        out["stats"] = await call(session, "kb_stats")
        out["clear"] = await call(session, "kb_clear", {"confirm": True})
        out["after_clear"] = await call(session, "kb_stats")
        return out

    r = run_session(tmp_path / "kb", body)
    for name in ("empty_query", "bad_type", "too_many", "bad_filter", "bad_queries", "no_paths", "no_confirm",
                 "confirm_missing", "fetch", "unknown_tool", "missing_job", "cancel_no_id"):
        assert r[name].is_error, (name, text_of(r[name]))
        assert text_of(r[name]), name
    assert "top_k" in text_of(r["bad_type"])
    assert "queries" in text_of(r["bad_queries"])
    assert "identifier" in text_of(r["fetch"])
    assert r["fetch"].structured_content["code"] == "bad_arguments"
    assert r["no_confirm"].structured_content["code"] == "confirm_required"
    assert r["confirm_missing"].structured_content["code"] == "confirm_required"
    assert "nothing was cleared" in text_of(r["confirm_missing"])
    assert r["missing_job"].structured_content["code"] == "not_found"
    assert not r["ingest"].is_error and not r["stats"].is_error
    assert r["stats"].structured_content["indexed_docs"] == 5
    assert not r["clear"].is_error and "Library cleared" in text_of(r["clear"])
    assert r["after_clear"].structured_content.get("indexed_docs", 0) == 0


@pytest.fixture
def paper_server(tmp_path):
    """A local HTTP server playing arXiv: /pdf/2301.05883 is a small real PDF, anything else a 404."""
    served = tmp_path / "served"
    served.mkdir()
    pdf = sp.make_filler_paper(served, 47).read_bytes()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            if self.path == "/pdf/2301.05883":
                status, ctype, body = 200, "application/pdf", pdf
            else:
                status, ctype, body = 404, "text/html", b"<html><head><title>404 Not Found</title></head></html>"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}", pdf
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_fetch_downloads_saves_and_indexes_a_paper(tmp_path, paper_server):
    base, pdf = paper_server
    kb_root = (tmp_path / "kb").resolve()

    async def body(session):
        out = {"fetch": await call(session, "kb_fetch", {"identifier": "arXiv:2301.05883"})}
        out["search"] = await call(session, "kb_search", {"query": "specimen047", "mode": "keyword", "top_k": 3})
        out["missing"] = await call(session, "kb_fetch", {"identifier": "arXiv:2402.00001"})
        out["stats"] = await call(session, "kb_stats")
        return out

    r = run_session(kb_root, body, KB_ARXIV_URL=base, KB_DOI_RESOLVER=base + "/doi",
                    KB_UNPAYWALL_URL=base + "/unpaywall", no_proxy="127.0.0.1,localhost",
                    NO_PROXY="127.0.0.1,localhost")
    fetch = r["fetch"]
    assert not fetch.is_error, text_of(fetch)
    got = fetch.structured_content["fetched"]
    saved = kb_root / "papers" / "arXiv_2301.05883.pdf"
    assert got["kind"] == "arxiv" and got["source"] == "arxiv"
    assert got["url"] == base + "/pdf/2301.05883"
    assert Path(got["path"]) == saved and saved.read_bytes() == pdf and got["bytes"] == len(pdf)
    assert got["doi"] == "10.48550/arxiv.2301.05883"
    assert fetch.structured_content["totals"]["added"] == 1
    text = text_of(fetch)
    assert "Fetched `arXiv:2301.05883`" in text and "from arXiv" in text
    assert str(saved) in text and "added" in text and "10.48550/arxiv.2301.05883" in text

    assert not r["search"].is_error, text_of(r["search"])
    hits = r["search"].structured_content["results"]
    assert hits and Path(hits[0]["path"]) == saved

    missing = r["missing"]
    assert missing.is_error
    assert missing.structured_content["code"] == "fetch_failed"
    assert "404" in text_of(missing)
    assert not r["stats"].is_error and r["stats"].structured_content["indexed_docs"] == 1


def test_background_ingest_is_followed_with_kb_status(tmp_path, quick_papers):
    async def body(session):
        started = await call(session, "kb_ingest", {"paths": [str(quick_papers)]})
        job_id = started.structured_content.get("job_id")
        states = []
        for _ in range(200):
            status = await call(session, "kb_status", {"job_id": job_id})
            states.append(status)
            if status.structured_content["job"]["state"] not in ("queued", "running"):
                break
            await anyio.sleep(0.2)
        return started, states

    started, states = run_session(tmp_path / "kb", body, KB_ASYNC_THRESHOLD="2")
    assert not started.is_error, text_of(started)
    assert started.structured_content["job_id"]
    assert "kb_status" in text_of(started)
    final = states[-1]
    assert not final.is_error
    assert final.structured_content["job"]["state"] == "done", text_of(final)
    assert final.structured_content["job"]["result"]["totals"]["added"] == 5


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the engine process through /proc")
def test_engine_killed_between_calls_restarts(tmp_path, quick_papers):
    kb_root = (tmp_path / "kb").resolve()

    async def body(session):
        first = await call(session, "kb_ingest", {"paths": [str(quick_papers)]})
        pids = engine_pids(kb_root)
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pids[0]}").exists() and time.monotonic() < deadline:
            await anyio.sleep(0.05)
        after = await call(session, "kb_search", {"query": "graphene nucleation copper", "top_k": 2})
        new_pids = engine_pids(kb_root)
        return first, pids, after, new_pids

    first, pids, after, new_pids = run_session(kb_root, body)
    assert not first.is_error
    assert not after.is_error, text_of(after)
    assert after.structured_content["count"] >= 1
    assert new_pids and new_pids[0] != pids[0]


CRASHING_ENGINE = '''
import os, runpy, sys, time
marker = os.environ["KB_TEST_CRASH_MARKER"]
if not os.path.exists(marker):
    open(marker, "w").close()
    sys.stdin.readline()  # the first request: die while handling it, or never answer
    if os.environ.get("KB_TEST_HANG"):
        open(marker + ".pid", "w").write(str(os.getpid()))
        time.sleep(600)
    sys.stderr.write("simulated engine crash\\n")
    sys.stderr.flush()
    os._exit(3)
sys.argv = [os.environ["KB_TEST_REAL_ENGINE"], "serve"]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def test_engine_crash_during_a_call_is_a_tool_error_then_recovers(tmp_path):
    fake = tmp_path / "crashing_engine.py"
    fake.write_text(CRASHING_ENGINE)

    async def body(session):
        crashed = await call(session, "kb_stats")
        again = await call(session, "kb_stats")
        return crashed, again

    crashed, again = run_session(tmp_path / "kb", body, KB_ENGINE=str(fake),
                                 KB_TEST_CRASH_MARKER=str(tmp_path / "crashed"),
                                 KB_TEST_REAL_ENGINE=str(ROOT / "kb_engine.py"))
    assert crashed.is_error
    message = text_of(crashed)
    assert "exited with status 3" in message and "simulated engine crash" in message
    assert crashed.structured_content["code"] == "engine_crashed"
    assert not again.is_error, text_of(again)
    assert "knowledge base" in text_of(again).lower()
    assert again.structured_content["kb_root"] == str((tmp_path / "kb").resolve())
    assert not (tmp_path / "kb").exists(), "a read-only call created the library folder"


INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
              "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                         "clientInfo": {"name": "t", "version": "1"}}}


@contextmanager
def http_server(tmp_path: Path, *args: str, **env):
    """Start `server.py --http` on a free loopback port; yield (port, its standard error once it listens)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    err = tmp_path / f"server-{port}.err"
    with err.open("wb") as err_file:
        proc = subprocess.Popen([sys.executable, str(SERVER), "--http", "--port", str(port), *args], cwd=str(ROOT),
                                env=server_env(tmp_path / "kb", **env), stdout=subprocess.DEVNULL, stderr=err_file)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert proc.poll() is None, err.read_text()
                assert time.monotonic() < deadline, "the HTTP server did not come up"
                time.sleep(0.1)
        yield port, err.read_text()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def post_initialize(port: int, authorization: str | None = None, host: str | None = None) -> tuple[int, dict, str]:
    """POST an MCP initialize request straight to /mcp: (status, headers, body)."""
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    if authorization is not None:
        headers["Authorization"] = authorization
    if host is not None:
        headers["Host"] = host
    request = urllib.request.Request(f"http://127.0.0.1:{port}/mcp", data=json.dumps(INITIALIZE).encode(),
                                     headers=headers, method="POST")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=CALL_TIMEOUT) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def test_streamable_http_needs_the_generated_token(tmp_path):
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    with http_server(tmp_path) as (port, stderr):
        url = f"http://127.0.0.1:{port}/mcp"
        found = re.findall(r"^\s*Authorization: Bearer (\S+)$", stderr, re.M)
        assert len(found) == 1, stderr
        token = found[0]
        assert len(token) >= 40 and url in stderr
        config = json.loads(next(line for line in stderr.splitlines() if line.strip().startswith("{")))
        assert config["mcpServers"]["kb-rag"] == {"url": url, "headers": {"Authorization": f"Bearer {token}"}}

        for authorization, error in [(None, "unauthorized"), (f"Bearer {token[:-1]}x", "invalid_token"),
                                     ("Bearer ", "invalid_token"), (f"Basic {token}", "invalid_token"),
                                     (token, "invalid_token")]:
            status, headers, body = post_initialize(port, authorization)
            assert status == 401, (authorization, status, body)
            challenge = {k.lower(): v for k, v in headers.items()}["www-authenticate"]
            assert challenge.startswith("Bearer"), challenge
            assert json.loads(body)["error"] == error

        async def main():
            with anyio.fail_after(CALL_TIMEOUT):
                async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"},  # noqa: SIM117
                                              timeout=httpx2.Timeout(CALL_TIMEOUT)) as client:
                    async with streamable_http_client(url, http_client=client) as streams:
                        async with ClientSession(streams[0], streams[1]) as session:
                            await session.initialize()
                            tools = (await session.list_tools()).tools
                            stats = await call(session, "kb_stats")
                            return tools, stats

        tools, stats = anyio.run(main)
        assert {t.name for t in tools} == TOOL_NAMES
        assert not stats.is_error, text_of(stats)
        assert post_initialize(port, f"bearer {token}")[0] == 200  # the scheme is case-insensitive
        # the token does not replace the DNS-rebinding protection
        assert post_initialize(port, f"Bearer {token}", host="attacker.example")[0] == 421


@pytest.mark.parametrize("how", ["env", "option"])
def test_streamable_http_takes_the_token_from_env_or_option(tmp_path, how):
    env_token = "env-token-0123456789abcdef"
    option_token = "option-token-0123456789abcdef"
    args = ("--token", option_token) if how == "option" else ()
    wanted, other = (option_token, env_token) if how == "option" else (env_token, "not-the-token-0123456789")
    with http_server(tmp_path, *args, KB_MCP_TOKEN=env_token) as (port, stderr):
        assert "Authorization: Bearer" in stderr and "generated" not in stderr
        assert env_token not in stderr and option_token not in stderr, "a token set by the user was printed"
        status, _, body = post_initialize(port, f"Bearer {wanted}")
        assert status == 200 and '"serverInfo"' in body, body
        assert post_initialize(port, f"Bearer {other}")[0] == 401
        assert post_initialize(port)[0] == 401


def test_unusable_tokens_are_refused(tmp_path):
    def run(*args, **env):
        return subprocess.run([sys.executable, str(SERVER), *args], cwd=str(ROOT),
                              env=server_env(tmp_path / "kb", **env),
                              capture_output=True, text=True, timeout=CALL_TIMEOUT)

    short = run("--http", "--token", "too-short")
    assert short.returncode == 2 and "at least 16 characters" in short.stderr and "too-short" not in short.stderr
    spaced = run("--http", KB_MCP_TOKEN="a token with spaces in it")
    assert spaced.returncode == 2 and "KB_MCP_TOKEN" in spaced.stderr
    stdio = run("--token", "0123456789abcdef0123")
    assert stdio.returncode == 2 and "--http" in stdio.stderr


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="checks the engine process through /proc")
def test_cancelled_call_stops_the_engine_and_the_next_call_gets_a_fresh_one(tmp_path):
    fake = tmp_path / "hanging_engine.py"
    fake.write_text(CRASHING_ENGINE)
    marker = tmp_path / "hung"

    async def body(session):
        try:
            hung = await session.call_tool("kb_stats", {}, read_timeout_seconds=1.5)
        except Exception as exc:  # the client gives up and sends notifications/cancelled
            hung = exc
        again = await call(session, "kb_stats")
        return hung, again

    hung, again = run_session(tmp_path / "kb", body, KB_ENGINE=str(fake), KB_TEST_CRASH_MARKER=str(marker),
                              KB_TEST_HANG="1", KB_TEST_REAL_ENGINE=str(ROOT / "kb_engine.py"))
    assert isinstance(hung, Exception) or hung.is_error
    assert not again.is_error, text_of(again)
    hung_pid = int(Path(str(marker) + ".pid").read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{hung_pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{hung_pid}").exists(), "the engine of the cancelled call is still running"


def test_kb_show_and_pictures_reach_the_client_as_image_content(tmp_path, quick_papers):
    """kb_show answers with a PNG as MCP image content beside one text line; kb_search with pictures attaches the
    highlighted passages as images too, and the structured answer keeps everything but the base64."""
    import base64

    async def body(session):
        await call(session, "kb_ingest", {"paths": [str(quick_papers)]})
        found = await call(session, "kb_search", {"query": "graphene nucleation copper", "top_k": 3,
                                                  "mode": "keyword", "pictures": 1})
        pdf = next(h for h in found.structured_content["results"] if h["kind"] == "pdf")
        shown = await call(session, "kb_show", {k: pdf[k] for k in ("doc_id", "page", "char_start", "char_end",
                                                                    "page_end")})
        refused = await call(session, "kb_show", {"doc_id": pdf["doc_id"], "char_start": 3})
        return found, pdf, shown, refused

    found, pdf, shown, refused = run_session(tmp_path / "kb", body)
    assert not shown.is_error, text_of(shown)
    images = [c for c in shown.content if c.type == "image"]
    assert len(images) == len(shown.structured_content["images"]) >= 1
    assert images[0].mime_type == "image/png" and base64.b64decode(images[0].data)[:8] == b"\x89PNG\r\n\x1a\n"
    line = text_of(shown)
    assert f"p. {pdf['page']}" in line and pdf["title"][:20] in line and '"' in line
    assert "data" not in shown.structured_content["images"][0] and shown.structured_content["highlighted"] is True
    search_images = [c for c in found.content if c.type == "image"]
    pictured = [h for h in found.structured_content["results"] if "picture" in h]
    assert len(search_images) == len(pictured) == 1 and "data" not in pictured[0]["picture"]
    assert refused.is_error and "char_end" in text_of(refused)


def test_ocr_pages_are_fractions_of_the_next_item_and_progress_only_grows():
    """An `ocr` event (a page of a file being read) moves MCP progress within the next file, never past it, and
    never back: the item events around it keep their own count."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("kb_mcp_server", SERVER)
    server = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(server)
    sent = []

    class Session:
        async def report_progress(self, progress, total, message):
            sent.append((progress, total, message))

    class Context:
        session = Session()

    relay = server.ProgressRelay(Context())
    events = [{"phase": "files", "done": 1, "total": 3, "path": "/p/a.pdf", "status": "added"},
              {"phase": "ocr", "done": 1, "total": 4, "path": "/p/scan.pdf"},
              {"phase": "ocr", "done": 2, "total": 4, "path": "/p/scan.pdf"},
              {"phase": "ocr", "done": 1, "total": 4, "path": "/p/scan.pdf"},      # a second reader's page: not sent
              {"phase": "files", "done": 2, "total": 3, "path": "/p/scan.pdf", "status": "added"},
              {"phase": "files", "done": 3, "total": 3, "path": "/p/c.pdf", "status": "added"}]

    async def relay_all():
        for event in events:
            await relay(event)
    anyio.run(relay_all)
    values = [progress for progress, _, _ in sent]
    assert values == sorted(values) and len(set(values)) == len(values), sent
    assert [round(v, 2) for v in values] == [1, 1.2, 1.4, 2, 3]
    assert sent[1][2] == "OCR page 1/4: scan.pdf" and sent[1][1] is None
    assert sent[3] == (2, 3, "files 2/3: scan.pdf (added)")


def _syncs_done(kb_root: Path) -> list[dict]:
    folder = kb_root / ".kb-jobs"
    jobs = [json.loads(p.read_text()) for p in folder.glob("*.json") if p.name != "watcher.json"] \
        if folder.is_dir() else []
    return [job for job in jobs if job.get("command") == "sync" and job.get("state") == "done"]


def test_watched_library_is_kept_in_step_from_the_server_start(tmp_path, sample_dir):
    """A library that watches a folder is kept in step as soon as the server starts, before any tool call; a
    library that watches nothing leaves no engine running until the first call."""
    kb, inbox = tmp_path / "kb", tmp_path / "inbox"
    inbox.mkdir()
    added = subprocess.run([sys.executable, str(ROOT / "kb_engine.py"), "watch", "--kb-root", str(kb), "--add",
                            str(inbox)], capture_output=True, text=True, env=server_env(kb), timeout=120)
    assert added.returncode == 0, added.stderr

    async def no_calls(session):
        for _ in range(50):
            if engine_pids(kb):
                break
            await anyio.sleep(0.2)
        assert engine_pids(kb), "no engine was started for the watched folder"
        (inbox / "graphene_cvd_copper.pdf").write_bytes((sample_dir / "graphene_cvd_copper.pdf").read_bytes())
        for _ in range(150):
            if any(job["result"]["totals"]["added"] == 1 for job in _syncs_done(kb)):
                return True
            await anyio.sleep(0.2)
        return False

    assert run_session(kb, no_calls, KB_WATCH_SETTLE_S="1", KB_WATCH_SCAN_S="0.5"), "not synced within 30 s"

    unwatched = subprocess.run([sys.executable, str(ROOT / "kb_engine.py"), "watch", "--kb-root", str(kb),
                                "--remove", str(inbox)], capture_output=True, text=True, env=server_env(kb),
                               timeout=120)
    assert unwatched.returncode == 0, unwatched.stderr

    async def idle(session):
        for _ in range(50):
            if not engine_pids(kb):
                return True
            await anyio.sleep(0.2)
        return False

    assert run_session(kb, idle), "an engine kept running for a library that watches nothing"
