"""Builds tests/fixtures/markdown-cases.json: real engine answers (every host-facing command, on the project's own
sample papers and generated Zotero library) and the Markdown a model must read for each.

Both hosts render engine answers to Markdown in their own language (plugin/src/render.js for DSH,
mcp-server/server.py for MCP); both are held to these cases (tests/test_rendering.py and
plugin/test/golden.test.js), so the two renderings cannot drift apart. The values change only when this script
runs again (`python tests/markdown_cases.py`, needs the shared Zotero schema for the Zotero case); the expected
Markdown is refreshed from the MCP server's renderer with KB_UPDATE_DOCS=1.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CASES = HERE / "fixtures" / "markdown-cases.json"
SHOWN_ROOT = "/home/researcher/papers-kb"      # temporary folders are shown as this, so the cases are stable
SHOWN_SERVER = "http://127.0.0.1:8000"         # and the local stand-in for arXiv as this


def _engine_answers(work: Path) -> list[tuple[str, str, dict]]:
    sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(HERE)]
    import kb_engine
    import sample_papers as sp

    papers, provenance, kb = work / "papers", work / "provenance", work / "kb"
    papers.mkdir()
    provenance.mkdir()
    sp.write_all(papers)
    sp.write_provenance(provenance)
    shutil.copy(papers / "graphene_cvd_copper.pdf", papers / "graphene_cvd_copper (copy).pdf")
    engine = kb_engine.Engine()
    run = lambda command, **payload: engine.execute(command, {"kb_root": str(kb), **payload})  # noqa: E731
    cases = [("empty library stats", "kb_stats", run("stats")),
             ("ingest with unreadable files", "kb_ingest", run("ingest", paths=[str(papers)])),
             ("ingest of a second folder", "kb_ingest", run("ingest", paths=[str(provenance)]))]
    cases += [
        ("search", "kb_search", run("search", query="graphene nucleation on copper foils")),
        ("search with filters and a rendering", "kb_search",
         run("search", query="石墨烯成核", queries=["graphene nucleation copper"], mode="keyword",
             filters={"kind": ["pdf", "docx"], "year": "2015-2024"})),
        ("search that finds nothing", "kb_search", run("search", query="zzyzx quasiperiodic tungsten frobnication")),
        ("search over the budget", "kb_search", run("search", query="results methods temperature samples measured", top_k=50, snippet=1500)),
        ("rag with citations in the library", "kb_rag", run("rag", query=sp.CITING_TOKEN_23)),
        ("rag, several citations", "kb_rag", run("rag", query="citations superscript references", top_k=5)),
        ("rag, more citations than shown", "kb_rag",
         run("rag", query=f"{sp.MANY_TOKEN} reference managers formats", top_k=12)),
        ("stats", "kb_stats", run("stats")),
        ("dedup", "kb_dedup", run("dedup")),
        ("dedup applied", "kb_dedup", run("dedup", apply=True)),
        ("status without jobs", "kb_status", run("status")),
    ]
    cases.append(("fetch", "kb_fetch", _fetch(run, sp, work)))
    background = kb_engine.Engine(allow_background=True)
    os.environ["KB_ASYNC_THRESHOLD"] = "0"
    more = work / "more"
    more.mkdir()
    sp.make_filler_paper(more, 3)
    started = background.execute("ingest", {"kb_root": str(kb), "paths": [str(more)]})
    cases.append(("ingest started as a job", "kb_ingest", started))
    finished = kb_engine.follow_job(background, {"kb_root": str(kb), "job_id": started["job_id"]}, None)
    cases.append(("status of a finished job", "kb_status", finished))
    cases.append(("status, job list", "kb_status", run("status")))
    cases += _zotero(kb_engine, work)
    cases.append(("clear", "kb_clear", run("clear", confirm=True)))
    return cases


def _fetch(run, sp, work: Path) -> dict:
    """A real fetch from a local server playing arXiv (its address made stable afterwards)."""
    pdf = sp.make_filler_paper(work, 47).read_bytes()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            ok = self.path.startswith("/arxiv/pdf/2301.05883")
            self.send_response(200 if ok else 404)
            self.send_header("Content-Type", "application/pdf" if ok else "text/plain")
            self.end_headers()
            self.wfile.write(pdf if ok else b"not here")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    os.environ.update(KB_ARXIV_URL=base + "/arxiv", KB_DOI_RESOLVER=base + "/doi", KB_UNPAYWALL_URL=base + "/u",
                      no_proxy="127.0.0.1,localhost")
    try:
        answer = run("fetch", identifier="arXiv:2301.05883")
        return json.loads(json.dumps(answer).replace(base, SHOWN_SERVER))
    finally:
        server.shutdown()


def _zotero(kb_engine, work: Path) -> list[tuple[str, str, dict]]:
    import zotero_fixture as zf
    fixtures = zf.fixtures_root()
    if fixtures is None:
        sys.exit("the Zotero case needs the shared Zotero schema (set KB_ZOTERO_FIXTURES)")
    library = zf.build_library(work / "zotero", fixtures)
    engine = kb_engine.Engine()
    payload = {"kb_root": str(work / "zkb"), "zotero_db": str(library.db)}
    return [("zotero dry run", "kb_zotero", engine.execute("zotero", {**payload, "dry_run": True})),
            ("zotero import", "kb_zotero", engine.execute("zotero", payload))]


def _stable(value, work: Path):
    """Temporary paths shown as SHOWN_ROOT."""
    return json.loads(json.dumps(value, ensure_ascii=False).replace(str(work), SHOWN_ROOT))


def main() -> int:
    os.environ.update(KB_EMBED_MODEL="none", HF_HUB_OFFLINE="1", KB_INGEST_WORKERS="0")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp).resolve()
        cases = [{"name": name, "tool": tool, "value": _stable(value, work), "markdown": None}
                 for name, tool, value in _engine_answers(work)]
    CASES.parent.mkdir(exist_ok=True)
    CASES.write_text(json.dumps(cases, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"{len(cases)} cases written to {CASES}; fill in the Markdown with KB_UPDATE_DOCS=1 "
          "python -m pytest tests/test_rendering.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
