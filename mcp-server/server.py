"""kb-rag MCP server: the local literature knowledge base for Claude Desktop, Cursor, Cherry Studio and any MCP client.

Nine tools with the same contract as the DSH plugin (kb_ingest, kb_zotero, kb_search, kb_rag, kb_dedup, kb_clear,
kb_stats, kb_fetch, kb_status), served over stdio (default) or streamable HTTP on the loopback interface
(`--http [--port N]`). Every call goes to one resident `kb_engine.py serve` process (see engine_client.py) working
on the library at KB_ROOT (default ~/.kb-rag).

Over HTTP every request needs `Authorization: Bearer <token>`: the token comes from KB_MCP_TOKEN or `--token`, or
is generated at start and printed on standard error. stdio needs no token.

Each tool returns readable Markdown as its text content and the engine's answer as structured content; bad
arguments and engine errors come back as tool errors (`isError: true`) and the server keeps running.

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
import math
import os
import re
import secrets
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

def _require_mcp() -> None:
    try:
        from importlib.metadata import PackageNotFoundError, version
        major = int(version("mcp").split(".")[0])
    except (ImportError, PackageNotFoundError, ValueError):
        major = 0
    if major < 2:
        sys.exit("kb-rag MCP server: needs the MCP Python SDK 2.x (pip install 'mcp>=2.3,<3', or pip install -e '.[mcp]' "
                 "from the kb-rag repository)")


_require_mcp()

import jsonschema  # noqa: E402  (a dependency of the mcp SDK)
import mcp.types as types  # noqa: E402
from mcp.server.lowlevel import Server  # noqa: E402
from mcp.server.stdio import stdio_server  # noqa: E402

from contract import build_payload, failed_check, guidance_text, load_contract  # noqa: E402
from engine_client import EngineClient, EngineCrashed, EngineError, find_engine, reword_library_choice  # noqa: E402

log = logging.getLogger("kb-rag-mcp")

SERVER_NAME = "kb-rag"

CONTRACT = load_contract(find_engine)
# The tools this server offers: every tool of the contract that runs an engine command (kb_scope keeps per-session
# state that only the DSH host has).
SERVED = [tool for tool in CONTRACT["tools"] if tool["command"] is not None]
SERVED_BY_NAME = {tool["name"]: tool for tool in SERVED}
INSTRUCTIONS = guidance_text(CONTRACT, SERVED_BY_NAME)
RENDER_BUDGET = CONTRACT["rendering"]["budget"]
FIT_STEPS = [tuple(step) for step in CONTRACT["rendering"]["fit_steps"]]


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


# -- rendering: short Markdown for the model, the same text as plugin/src/render.js (both are held to the cases of
#    tests/fixtures/markdown-cases.json; docs/OUTPUT-FORMAT.md) ---------------------------------------------------

def _md(text: Any) -> str:
    return re.sub(r"[\\`*_\[\]<]", lambda m: "\\" + m.group(0), re.sub(r"\s+", " ", str(text if text is not None else "")).strip())


def _cut(text: Any, limit: int | None) -> str:
    s = re.sub(r"\s+", " ", str(text if text is not None else "")).strip()
    if limit is None or len(s) <= limit:
        return s
    head = s[:limit]
    space = head.rfind(" ")
    return (head[:space] if space > limit * 0.6 else head).rstrip(" …") + "…"


def _base(path: Any) -> str | None:
    return re.split(r"[\\/]", str(path))[-1] or None if path else None


def _doi_url(doi: Any) -> str | None:
    if not doi:
        return None
    bare = re.sub(r"^https?://(dx\.)?doi\.org/", "", str(doi).strip(), flags=re.I)
    return "https://doi.org/" + bare.replace(" ", "%20").replace("(", "%28").replace(")", "%29") if bare else None


def _authors(authors: Any) -> str:
    if not isinstance(authors, list) or not authors:
        return ""
    return ", ".join(str(a) for a in authors[:3]) + (" et al." if len(authors) > 3 else "")


def _pages(hit: dict) -> str:
    page, end, label = hit.get("page"), hit.get("page_end"), hit.get("page_label")
    if page is None:
        return ""
    text = f"pp.{page}–{end}" if end is not None and end != page else f"p.{page}"
    if label not in (None, "") and str(label) != str(page):
        text += f" ({label})"
    return text


def _lines(*items: Any) -> str:
    out: list[str] = []
    for item in items:
        if isinstance(item, list):
            out.extend(x for x in item if x is not None)
        elif item is not None:
            out.append(item)
    return "\n".join(out)


def _totals(totals: Any) -> str:
    if not isinstance(totals, dict):
        return "nothing to do"
    return ", ".join(f"{k} {v}" for k, v in totals.items() if isinstance(v, (int, float)) and v) or "nothing to do"


def _limit(items: list, n: int, render, rest: str) -> list[str]:
    out = [render(x) for x in items[:n]]
    if len(items) > n:
        out.append(f"- … and {len(items) - n} more {rest}")
    return out


def _file_tag(path: Any) -> str:
    name = _base(path)
    return f" `{name.replace('`', chr(39))}`" if name else ""


def _citation_lines(hit: dict, cite_limit: int) -> list[str]:
    cites = hit.get("citations") if isinstance(hit.get("citations"), list) else None
    if cites is None:
        return []
    shown = cites[:cite_limit]
    more = int(hit.get("citations_more") or 0) + (len(cites) - len(shown))
    if not shown and not more:
        return []
    lines = ["   Cited in this passage:"]
    marker = lambda c: _md(c.get("marker") or (f"[{c['ref']}]" if c.get("ref") is not None else ""))  # noqa: E731
    for c in (c for c in shown if c.get("in_library")):       # works in the library first: the model can open them
        lib = c["in_library"]
        name = _md(c.get("title") or lib.get("title") or c.get("text") or "")
        url = _doi_url(c.get("doi")) or _doi_url(lib.get("doi"))
        where = _file_tag(lib.get("path"))
        lines.append(f"   - {marker(c)} {f'[{name}]({url})' if url else name} ✓ in library "
                     f"(doc {lib.get('doc_id')}{',' + where if where else ''})")
    for c in (c for c in shown if not c.get("in_library")):
        name = _md(_cut(c.get("title") or c.get("text") or "", 140))
        url = _doi_url(c.get("doi"))
        lines.append(f"   - {marker(c)} {f'[{name}]({url})' if url else name}")
    if more > 0:
        lines.append(f"   - and {more} more cited work{'' if more == 1 else 's'}")
    return lines


def _source_lines(rank: int, hit: dict, snippet_limit: int | None, cite_limit: int) -> list[str]:
    title = _md(hit.get("title") or hit.get("file") or _base(hit.get("path")) or "Untitled")
    url = _doi_url(hit.get("doi"))
    head = f"[{title}]({url})" if url else f"**{title}**" + _file_tag(hit.get("file") or hit.get("path"))
    byline = " · ".join(_md(x) for x in [_authors(hit.get("authors")), hit.get("year"), hit.get("journal"),
                                          hit.get("section"), _pages(hit)] if x not in (None, ""))
    lines = [f"{rank}. {head}" + ("\\" if byline else "")]      # a hard line break before the byline
    if byline:
        lines.append(f"   {byline}")
    if hit.get("snippet"):
        lines.append(f"   > {_md(_cut(hit['snippet'], snippet_limit))}")
    lines += _citation_lines(hit, cite_limit)
    if hit.get("zotero_link"):
        lines.append(f"   [open in Zotero]({hit['zotero_link']})")
    return lines


def _render_sources(tool: str, value: dict, snippet_limit: int | None, cite_limit: int, count: int) -> str:
    hits = (value.get("evidence") if tool == "kb_rag" else value.get("results")) or []
    what = "evidence passage" if tool == "kb_rag" else "passage"
    n = len(hits)
    parts = [value.get("mode"), value.get("depth"),
             f"scores: {value['score_kind']}" if value.get("score_kind") else None,
             f"reranked by {value['reranker']}" if value.get("reranker") else None,
             "cached" if value.get("cached") is True else None]
    parts = [_md(p) for p in parts if p]
    count_text = f"no {what} found" if n == 0 else f"{n} {what}{'' if n == 1 else 's'}"
    out = [f"**Knowledge base: {count_text}** for \"{_md(value.get('query', ''))}\"" + (f" ({' · '.join(parts)})" if parts else "")]
    notes = value.get("notes") if isinstance(value.get("notes"), list) else ([value["note"]] if value.get("note") else [])
    out += [f"_Note: {_md(note)}_" for note in notes]
    if value.get("lang_note"):
        out.append(f"_Language: {_md(value['lang_note'])}_")
    if not hits:
        out += ["", "Try adding to queries one English sentence stating the answer as a paper would, move years or authors into filters, or check kb_stats that the library holds documents."]
    else:
        out.append("")
        if tool == "kb_rag":
            out.append("**Evidence**")
        for i, hit in enumerate(hits[:count], 1):
            out += _source_lines(i, hit, snippet_limit, cite_limit) + [""]
        if n > count:
            out += [f"_{n - count} more result{'' if n - count == 1 else 's'} left out to keep this short; lower top_k or narrow the query._", ""]
    related = value.get("related") if isinstance(value.get("related"), list) else []
    if related:
        out.append("**Related work in the library** (pointers, not evidence)")
        for r in related:
            title = _md(r.get("title") or _base(r.get("path")) or "Untitled")
            url = _doi_url(r.get("doi"))
            sim = r.get("similarity")
            bits = [_md(x) for x in [_authors(r.get("authors")), r.get("year"), r.get("reason"),
                                     f"{sim:.2f}" if isinstance(sim, (int, float)) and math.isfinite(sim) else None] if x not in (None, "")]
            head = f"[{title}]({url})" if url else f"**{title}**" + _file_tag(r.get("path"))
            out.append(f"- {head}{' · ' + ' · '.join(bits) if bits else ''}")
        out.append("")
    if value.get("guidance"):
        out += ["**How to answer**", _md(value["guidance"])]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()


def render_sources(tool: str, value: dict) -> str:
    """kb_search / kb_rag Markdown, shortened (snippets, citations, then trailing hits) to stay near 8 KB."""
    hits = (value.get("evidence") if tool == "kb_rag" else value.get("results")) or []
    for snippet_limit, cite_limit in FIT_STEPS:
        text = _render_sources(tool, value, snippet_limit, cite_limit, len(hits))
        if len(text) <= RENDER_BUDGET:
            return text
    count = len(hits)
    while count > 1:
        count -= 1
        text = _render_sources(tool, value, *FIT_STEPS[-1], count)
        if len(text) <= RENDER_BUDGET:
            break
    return text


def _job_started(value: dict, what: str) -> str:
    return _lines(
        f"**{what} started as background job `{value['job_id']}`** ({value.get('pending', '?')} item(s) need work).",
        f"_{_md(value['note'])}_" if value.get("note") else None,
        f'Call kb_status with {{"job_id": "{value["job_id"]}"}} to follow it; repeat until its state is done, failed or '
        "cancelled. Do not start another ingest or Zotero import of this library meanwhile.",
    )


def _verification_line(check) -> str | None:
    if not isinstance(check, dict):
        return None
    counts = ", ".join(f"{check[k]} {k.replace('_', ' ')}" for k in ("verified", "no_match", "not_found", "skipped", "failed")
                       if check.get(k))
    return (f"Metadata checked at Crossref ({check.get('checked', 0)} document(s){': ' + counts if counts else ''})."
            + (f" _{_md(check['note'])}_" if check.get("note") else ""))


def render_ingest(value: dict) -> str:
    if value.get("job_id"):
        return _job_started(value, "Ingest")
    files = value.get("files") if isinstance(value.get("files"), list) else []
    problems = [f for f in files if f.get("status") == "error" or (f.get("status") == "skipped" and (f.get("reason") != "unchanged" or f.get("error")))]
    return _lines(
        f"**{'Metadata refreshed' if value.get('metadata_only') else 'Ingest finished'}** ({len(files)} file(s)): {_totals(value.get('totals'))}.",
        f"_Note: {_md(value['note'])}_" if value.get("note") else None,
        _verification_line(value.get("metadata_verification")),
        "Files not indexed:" if problems else None,
        _limit(problems, 15, lambda f: f"- `{_base(f.get('path'))}`: {f.get('status')}" + (f" ({f['reason']})" if f.get("reason") else "")
               + (f" — {_md(_cut(f['error'], 160))}" if f.get("error") else ""), "files"),
        f"Library: `{value['kb_root']}`" if value.get("kb_root") else None,
    )


_FETCH_SOURCES = {"arxiv": "arXiv", "publisher": "the publisher", "unpaywall": "an open-access copy (Unpaywall)",
                  "direct": "the URL"}


def _fetch_outcome(entry: dict) -> str | None:
    """What the fetched file's ingest means for the next step."""
    status = entry.get("status")
    if not status:
        return None
    if status == "duplicate":
        return "The library already held a copy of it: kb_search and kb_rag find that one."
    indexed = status in ("added", "updated", "moved") or (
        status == "skipped" and entry.get("reason") == "unchanged" and not entry.get("previous"))
    return ("It is in the library now: kb_search and kb_rag can find it." if indexed
            else "The PDF was saved but not indexed; see why above.")


def _bullet(label: str, value: Any) -> str | None:
    return None if value in (None, "") else f"- {label}: {value}"


def render_fetch(value: dict) -> str:
    got = value.get("fetched") if isinstance(value.get("fetched"), dict) else {}
    files = value.get("files") if isinstance(value.get("files"), list) else []
    entry = next((f for f in files if f.get("path") == got.get("path")), files[0] if files else None)
    size = f" ({max(1, round(got['bytes'] / 1024))} KiB)" if isinstance(got.get("bytes"), (int, float)) else ""
    source = _FETCH_SOURCES.get(got.get("source"), got.get("source") or "the web")
    url = re.sub(r"[<>\s]", lambda m: f"%{ord(m.group(0)):02X}", str(got["url"])) if got.get("url") else None
    indexed = None
    if entry:
        indexed = (f"**{_md(_cut(entry['title'], 160))}**, " if entry.get("title") else "") + str(entry.get("status")) \
            + (f" ({entry['reason']})" if entry.get("reason") else "") \
            + (f" — {_md(_cut(entry['error'], 160))}" if entry.get("error") else "")
    doi_url = _doi_url(got.get("doi"))
    return _lines(
        f"**Fetched `{str(got.get('identifier') or '?').replace('`', chr(39))}`** from {source}{size}.",
        _bullet("Source URL", f"<{url}>" if url else None),
        _bullet("Saved as", f"`{got['path']}`" if got.get("path") else None),
        _bullet("Indexed", indexed),
        _bullet("DOI", (f"[{_md(got['doi'])}]({doi_url})" if doi_url else _md(got["doi"])) if got.get("doi") else None),
        f"_Note: {_md(value['note'])}_" if value.get("note") else None,
        _fetch_outcome(entry) if entry else None,
        f"Library: `{value['kb_root']}`" if value.get("kb_root") else None,
    )


def render_zotero(value: dict) -> str:
    if value.get("job_id"):
        return _job_started(value, "Zotero import")
    items = value.get("items") if isinstance(value.get("items"), list) else []
    missing = [i for i in items if i.get("status") in ("missing", "error")]
    return _lines(
        f"**Zotero {'dry run' if value.get('dry_run') else 'import'}** ({len(items)} attachment(s)): {_totals(value.get('totals'))}.",
        f"_Note: {_md(value['note'])}_" if value.get("note") else None,
        "Attachments not imported:" if missing else None,
        _limit(missing, 15, lambda i: f"- {_md(_cut(i.get('title') or i.get('attachment_key') or '?', 80))}: {i.get('status')}"
               + (f" ({i['reason']})" if i.get("reason") else ""), "attachments"),
        f"Zotero database: `{value['zotero_db']}`" if value.get("zotero_db") else None,
    )


def _job_line(job: dict) -> str:
    progress = f" {job.get('done') or 0}/{job['total']}" if isinstance(job.get("total"), int) else ""
    phase = ""
    if job.get("phase") and job.get("state") == "running":
        phase = f" ({job['phase']}" + (f" {job.get('phase_done') or 0}/{job['phase_total']}" if isinstance(job.get("phase_total"), int) else "") + ")"
    reason = f" — {_md(job['reason'])}" if job.get("reason") else ""
    return f"`{job.get('job_id')}` {job.get('command') or ''}: **{job.get('state')}**{progress}{phase}{reason}"


def render_status(value: dict) -> str:
    job = value.get("job")
    if isinstance(job, dict):
        result = job.get("result") if isinstance(job.get("result"), dict) else {}
        errors = job.get("errors") if isinstance(job.get("errors"), list) else []
        return _lines(
            f"Job {_job_line(job)}",
            "Cancellation requested: the job stops after the item in flight." if value.get("cancel_requested") else None,
            f"Result: {_totals(result['totals'])}." if result.get("totals") else None,
            f"_Note: {_md(result['note'])}_" if result.get("note") else None,
            "Items that failed:" if errors else None,
            _limit(errors, 10, lambda e: f"- {_md(_cut(e, 200))}", "items"),
            "Still working: call kb_status again later with the same job_id." if job.get("state") in ("queued", "running") else None,
        )
    jobs = value.get("jobs") if isinstance(value.get("jobs"), list) else []
    if not jobs:
        return "No background jobs for this library in the last hour."
    return _lines("Background jobs:", _limit(jobs, 20, lambda j: f"- {_job_line(j)}", "jobs"))


def render_stats(value: dict) -> str:
    if value.get("exists") is False:
        return _lines("**The knowledge base is empty**: no library exists yet.",
                      f"Library folder: `{value['kb_root']}`" if value.get("kb_root") else None,
                      f"Chosen as {_md(value['kb_root_from'])}." if value.get("kb_root_from") else None,
                      "Add papers with kb_ingest (files or folders) or kb_zotero.")

    def obj(o: Any) -> str | None:
        return ", ".join(f"{k} {v}" for k, v in o.items()) if isinstance(o, dict) and o else None

    by_status = obj(value.get("by_status"))
    return _lines(
        "**Knowledge base**",
        _bullet("documents", f"{value.get('indexed_docs') or 0} indexed of {value.get('docs') or 0} recorded" + (f" ({by_status})" if by_status else "")),
        _bullet("kinds", obj(value.get("by_kind"))),
        _bullet("languages", obj(value.get("languages"))),
        _bullet("passages", value.get("chunks")),
        _bullet("vectors", f"{value.get('vectors') or 0}, missing {value.get('vectors_missing') or 0}"
               + (f" ({value['embedding_model']})" if value.get("embedding_model") else "")),
        _bullet("models", obj(value.get("models"))),
        _bullet("stale documents", value.get("stale_docs")),
        _bullet("library", f"`{value['kb_root']}`" if value.get("kb_root") else None),
        f"{value['stale_docs']} document(s) were indexed by an older parser: kb_ingest with metadata_only: true refreshes "
        "their metadata, rebuild: true re-parses them." if isinstance(value.get("stale_docs"), int) and value["stale_docs"] > 0 else None,
    )


def render_dedup(value: dict) -> str:
    groups = value.get("groups") if isinstance(value.get("groups"), list) else []
    if not groups:
        return "No duplicate documents found."

    def group(g: dict) -> str:
        docs = ", ".join(f"{'keep ' if d.get('doc_id') == g.get('keep') else ''}#{d.get('doc_id')} `{_base(d.get('path'))}`" for d in g.get("docs") or [])
        return f"- {g.get('reason')}: {docs}"

    return _lines(
        f"**{len(groups)} group(s) of copies of one work**"
        + (f": {value.get('removed')} document(s) turned into duplicate records." if value.get("applied") else " (nothing changed)."),
        _limit(groups, 15, group, "groups"),
        None if value.get("applied") else "To keep one document per group, call kb_dedup with apply: true (only if the user agrees).",
    )


def render_clear(value: dict) -> str:
    c = value.get("cleared") if isinstance(value.get("cleared"), dict) else {}
    return (f"**Library cleared**: {c.get('docs', 0)} document(s) and {c.get('chunks', 0)} passage(s) removed from "
            f"`{value.get('kb_root', '?')}`. The files themselves were not touched.")


# -- tool handlers ---------------------------------------------------------------------------------------------

RENDERERS = {
    "kb_ingest": render_ingest,
    "kb_zotero": render_zotero,
    "kb_search": lambda value: render_sources("kb_search", value),
    "kb_rag": lambda value: render_sources("kb_rag", value),
    "kb_dedup": render_dedup,
    "kb_clear": render_clear,
    "kb_stats": render_stats,
    "kb_fetch": render_fetch,
    "kb_status": render_status,
}


def strict_schema(tool: dict) -> dict:
    """The advertised schema, closed at the root: an argument no tool declares is refused, not ignored."""
    return {**tool["input_schema"], "additionalProperties": False}


class KBServer:
    """The tool logic, independent of the transport."""

    def __init__(self, engine: EngineClient):
        self.engine = engine

    async def call(self, name: str, args: dict, progress) -> tuple[str, dict]:
        tool = SERVED_BY_NAME.get(name)
        if tool is None:
            raise ToolFailure(f"unknown tool {name!r}; the kb-rag tools are: {', '.join(SERVED_BY_NAME)}", "unknown_tool")
        check = failed_check(tool, args)      # first, so that a refusal reads the same as in the DSH plugin
        if check is not None:
            raise ToolFailure(check["message"], check.get("code", "bad_arguments"))
        try:
            jsonschema.validate(args, strict_schema(tool))
        except jsonschema.ValidationError as exc:
            where = ".".join(str(p) for p in exc.absolute_path)
            raise ToolFailure(f"invalid arguments for {name}: {(where + ': ') if where else ''}{exc.message}") from None
        value = await self._engine(tool["command"], build_payload(tool, args, Path.cwd()), progress)
        value = reword_library_choice(value, self.engine.kb_root_from)
        return RENDERERS[name](value), value

    async def _engine(self, command: str, payload: dict, progress=None) -> dict:
        try:
            return await self.engine.request(command, payload, on_progress=progress)
        except EngineError as exc:
            raise ToolFailure(f"the kb engine refused {command}: {exc}", exc.code) from None
        except EngineCrashed as exc:
            raise ToolFailure(str(exc), "engine_crashed") from None


class ProgressRelay:
    """Engine progress lines as MCP progress notifications: `progress` only grows, across phases."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.offset = 0.0
        self.last = 0.0
        self.phase = None
        self.phase_top = 0.0

    async def __call__(self, event: dict) -> None:
        done, total = event.get("done"), event.get("total")
        if not isinstance(done, (int, float)):
            return
        phase = event.get("phase")
        if phase != self.phase:
            self.offset = self.last
            self.phase = phase
        progress = self.offset + done
        if progress <= self.last and self.last:
            return
        self.last = progress
        grand = self.offset + total if isinstance(total, (int, float)) else None
        message = f"{phase} {done}/{total}" if total is not None else f"{phase} {done}"
        if event.get("path"):
            message += f": {_base(event['path'])}" + (f" ({event['status']})" if event.get("status") else "")
        await self.ctx.session.report_progress(progress, grand, message)


def _text_result(text: str, value: dict, is_error: bool = False) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                structured_content=value, is_error=is_error)


def build_server(engine: EngineClient) -> Server:
    kb = KBServer(engine)

    async def on_list_tools(ctx, params) -> types.ListToolsResult:
        return types.ListToolsResult(tools=TOOLS)

    async def on_call_tool(ctx, params: types.CallToolRequestParams) -> types.CallToolResult:
        args = dict(params.arguments or {})
        try:
            text, value = await kb.call(params.name, args, ProgressRelay(ctx))
        except ToolFailure as exc:
            return _text_result(f"{params.name} failed: {exc}", {"error": str(exc), "code": exc.code}, is_error=True)
        except Exception as exc:  # never let one call take the server down
            log.exception("tool %s failed", params.name)
            return _text_result(f"{params.name} failed: {type(exc).__name__}: {exc}",
                                {"error": f"{type(exc).__name__}: {exc}", "code": "internal"}, is_error=True)
        return _text_result(text, value)

    @asynccontextmanager
    async def lifespan(_server):
        try:
            yield {}
        finally:
            await engine.close()

    return Server(SERVER_NAME, version=_version(), instructions=INSTRUCTIONS, lifespan=lifespan,
                  on_list_tools=on_list_tools, on_call_tool=on_call_tool)


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
            "    " + json.dumps({"mcpServers": {"kb-rag": {"url": url, "headers": {"Authorization": f"Bearer {token}"}}}}),
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
        run_http(engine, args.port, token, generated)
    else:
        asyncio.run(run_stdio(engine))
    return 0


if __name__ == "__main__":
    sys.exit(main())
