"""Builds tests/fixtures/markdown-cases.json: real engine answers (every host-facing command, on the project's own
sample papers and generated Zotero library), hostile answers made from a real one, and what the engine renders for
each (`markdown`, and `view` for search and rag).

The engine renders every answer a host shows a model (kb_rag/rendering.py); tests/test_rendering.py
holds it to these cases. The answers change only when this script runs again (`python tests/markdown_cases.py`,
needs the shared Zotero schema for the Zotero case; `--hostile` rebuilds only the hostile cases from the stored
search answer); the expected rendering is refreshed with KB_UPDATE_DOCS=1 python -m pytest tests/test_rendering.py.
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
        ("search over the budget", "kb_search",
         run("search", query="results methods temperature samples measured", top_k=50, snippet=1500)),
        ("rag with citations in the library", "kb_rag", run("rag", query=sp.CITING_TOKEN_23)),
        ("rag, several citations", "kb_rag", run("rag", query="citations superscript references", top_k=5)),
        ("rag, more citations than shown", "kb_rag",
         run("rag", query=f"{sp.MANY_TOKEN} reference managers formats", top_k=12)),
        *_show(run),
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
    watched = work / "inbox"
    watched.mkdir()
    added = run("watch", add=[str(watched)])
    added["sources"][0]["added"] = "2026-12-06T09:00:00Z"
    cases.append(("watch, a folder added", "kb_watch", added))
    cases.append(("sync, then the watched folders", "kb_watch", _synced(run, watched)))
    cases += _zotero(kb_engine, work)
    cases.append(("clear", "kb_clear", run("clear", confirm=True)))
    return cases


def _synced(run, watched) -> dict:
    """The watch list after one sync brought a new paper in: the last sync and what it changed."""
    (watched / "plover_survey.md").write_text("# Plover survey 2025\n\nChick survival on the gravel bars rose to "
                                              "41 percent after the spring floods.\n", encoding="utf-8")
    run("sync")
    answer = run("watch")
    for source in answer["sources"]:      # the clock's part, fixed so that the rendering is the same every run
        source.update(added="2026-12-06T09:00:00Z", last_sync="2026-12-06T09:30:00Z")
    return answer


def _show(run) -> list[tuple[str, str, dict]]:
    """show's answers: a placed passage, a page drawn without offsets, a figure."""
    hit = next(h for h in run("search", query="graphene nucleation on copper foils", mode="keyword",
                              boxes=True)["results"] if "boxes" in h and h["file"].startswith("graphene_cvd_copper"))
    span = {k: hit[k] for k in ("doc_id", "page", "char_start", "page_end", "char_end")}
    return [("show a passage", "kb_show", run("show", **span)),
            ("show a page without offsets", "kb_show", run("show", doc_id=hit["doc_id"], page=hit["page"])),
            ("show a figure", "kb_show", run("show", doc_id=hit["doc_id"], figure="Figure 1"))]


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


# What a hostile file or library can put into an answer's shown fields.
SICI_DOI = "10.1002/(SICI)1097-4571(199806)49:8<693::AID-ASI4>3.0.CO;2-0"
ODD_DOIS = (SICI_DOI, "10.1000/über-straße/石墨烯", "10.1000/a#b?c d%20e", "10.1000/x](javascript:alert(1))")
MARKUP_TITLE = ("**Bold** claims, _italic_ [a link](https://evil.example) <script>alert(1)</script> `code` "
                "# not a heading")
RTL_TITLE = ("Invoice \u202etxt.exe\u202c and \u2067isolated\u2069: "
             "\u0646\u0645\u0648\u0630\u062c \u05de\u05d5\u05d3\u05dc")
CJK_TITLE = "石墨烯在铜箔上的成核：氧预处理降低成核密度"
CONTROL_SNIPPET = "a bell\x07, an escape \x1b[31mred\x1b[0m, a NUL\x00 and a line\nbreak > not a quote"


def _hostile_hits(hits: list[dict]) -> list[dict]:
    """The real hits with their shown fields replaced by what hostile files hold."""
    titles = (MARKUP_TITLE, RTL_TITLE, CJK_TITLE, "x" * 20, "x")
    out = []
    for i, hit in enumerate(hits[:5]):
        out.append(dict(hit, doi=(*ODD_DOIS, None)[i], title=titles[i], file=f"we`ird {i}.pdf",
                        journal="J. *Stars* & [Brackets]", section="Results > <b>Growth</b>",
                        snippet=(CONTROL_SNIPPET, "「石墨烯」在铜上成核 [12]，密度降低两个数量级。", hit["snippet"],
                                 "a " + "\u202e" + "reversed" + "\u202c" + " word", hit["snippet"])[i]))
    return out


def hostile_cases(search: dict) -> list[dict]:
    """Answers no real library may give but a hostile one can: odd DOIs, Markdown in titles, bidi controls, CJK,
    control characters, a 20,000-character title and snippet."""
    odd = dict(search, results=_hostile_hits(search["results"]), query="*what* `is` [this] <b>?")
    long_hit = dict(search["results"][0], title="Very long title " * 1250, snippet="word " * 4000,
                    authors=[f"Author {n}" for n in range(60)])
    long = dict(search, results=[dict(long_hit, chunk_id=n) for n in range(12)])
    return [{"name": "hostile DOIs, titles and snippets", "tool": "kb_search", "value": odd},
            {"name": "hostile: a 20,000-character title and snippet", "tool": "kb_search", "value": long}]


def _write(cases: list[dict]) -> None:
    CASES.parent.mkdir(exist_ok=True)
    CASES.write_text(json.dumps(cases, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"{len(cases)} cases written to {CASES}; fill in the rendering with KB_UPDATE_DOCS=1 "
          "python -m pytest tests/test_rendering.py")


def main(argv: list[str]) -> int:
    if argv == ["--hostile"]:
        stored = [c for c in json.loads(CASES.read_text(encoding="utf-8")) if not c["name"].startswith("hostile")]
        search = next(c["value"] for c in stored if c["name"] == "search")
        _write(stored + [dict(c, markdown=None) for c in hostile_cases(search)])
        return 0
    os.environ.update(KB_EMBED_MODEL="none", HF_HUB_OFFLINE="1", KB_INGEST_WORKERS="0")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp).resolve()
        cases = [{"name": name, "tool": tool, "value": _stable(value, work), "markdown": None}
                 for name, tool, value in _engine_answers(work)]
    search = next(c["value"] for c in cases if c["name"] == "search")
    _write(cases + [dict(c, markdown=None) for c in hostile_cases(search)])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
