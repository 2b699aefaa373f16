"""The engine renders what a model reads (issue 30): one Markdown, one card view, for every host.

tests/fixtures/markdown-cases.json holds real engine answers for every host-facing command (made by
tests/markdown_cases.py), hostile ones made from a real search answer, and what the engine renders for each;
KB_UPDATE_DOCS=1 refreshes the expected text after a deliberate change. The other tests state the rules the cases
follow (escaping, DOI links, the budget), so that a refreshed case cannot quietly break one.
"""
from __future__ import annotations

import json
import os
import re

import pytest

from helpers import ROOT, run_cli

# About the engine's own functions: reaches names outside kb_engine.__all__ (tests/static/test_public_surface.py).
pytestmark = pytest.mark.internals

CASES_FILE = ROOT / "tests" / "fixtures" / "markdown-cases.json"
CASES = json.loads(CASES_FILE.read_text(encoding="utf-8"))
COMMAND = {"kb_search": "search", "kb_rag": "rag", "kb_ingest": "ingest", "kb_zotero": "zotero", "kb_stats": "stats",
           "kb_status": "status", "kb_dedup": "dedup", "kb_clear": "clear", "kb_fetch": "fetch", "kb_show": "show",
           "kb_watch": "watch"}
LINK_TARGET = re.compile(r"(?<!\\)\]\(([^)\s]*)\)")      # a link: its closing bracket unescaped


def _render(kb_engine, case: dict) -> dict:
    return kb_engine.rendered(COMMAND[case["tool"]], case["value"], kb_engine.HOST_RENDER_BUDGET)


def _by_name(name: str) -> dict:
    return next(case for case in CASES if case["name"] == name)


def test_the_cases_cover_every_rendered_command(kb_engine):
    assert {COMMAND[case["tool"]] for case in CASES} == set(kb_engine.RENDERERS)
    served = {tool["command"] for tool in kb_engine.host_contract()["tools"] if tool["command"]}
    assert served == set(kb_engine.RENDERERS), "every tool a host offers is rendered by the engine"


def test_the_rendering_of_each_answer(kb_engine):
    rendered = [dict(case, **_render(kb_engine, case)) for case in CASES]
    if os.environ.get("KB_UPDATE_DOCS") == "1":
        CASES_FILE.write_text(json.dumps(rendered, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    for case, now in zip(CASES, rendered):
        assert now["markdown"] == case["markdown"], f"{case['name']}: the Markdown changed (KB_UPDATE_DOCS=1)"
        assert now.get("view") == case.get("view"), f"{case['name']}: the view changed (KB_UPDATE_DOCS=1)"


def test_a_render_request_gets_markdown_and_view_beside_the_data(kb_engine, tmp_path):
    from sample_papers import write_all
    write_all(tmp_path / "papers")
    engine = kb_engine.Engine()
    kb = str(tmp_path / "kb")
    engine.execute("ingest", {"kb_root": kb, "paths": [str(tmp_path / "papers")]})
    plain = engine.execute("search", {"kb_root": kb, "query": "graphene nucleation copper"})
    assert "markdown" not in plain and "view" not in plain, "rendering costs nothing unless asked for"
    asked = engine.execute("search", {"kb_root": kb, "query": "graphene nucleation copper", "render": "markdown"})
    assert asked["results"] == plain["results"]
    assert asked["markdown"].startswith('**Knowledge base: ') and asked["view"]["kind"] == "kb-sources"
    assert [s["chunk_id"] for s in asked["view"]["sources"]] == [h["chunk_id"] for h in plain["results"]]
    small = engine.execute("search", {"kb_root": kb, "query": "graphene", "top_k": 30, "render": "markdown",
                                      "render_budget": 1500})
    assert len(small["markdown"]) <= 1500 and small["view"]["omitted"] > 0
    stats = engine.execute("stats", {"kb_root": kb, "render": "markdown"})
    assert stats["markdown"].startswith("**Knowledge base**") and "view" not in stats
    for bad, message in (({"render": "html"}, 'render must be "markdown"'),
                         ({"render": "markdown", "render_budget": 10}, "render_budget must be between"),
                         ({"render_budget": "big"}, "render_budget must be an integer")):
        with pytest.raises(kb_engine.KBError, match=message):
            engine.execute("search", {"kb_root": kb, "query": "graphene", **bad})


def test_a_host_words_the_library_choice(kb_engine, tmp_path):
    engine = kb_engine.Engine()
    said = "the host's setting; change it to open another"
    answer = engine.execute("stats", {"kb_root": str(tmp_path / "none"), "kb_root_from": said, "render": "markdown"})
    assert answer["kb_root_from"] == said and f"Chosen as {said}." in answer["markdown"]
    search = engine.execute("search", {"kb_root": str(tmp_path / "none"), "kb_root_from": said, "query": "x"})
    assert f"({said})" in search["note"]


def test_hostile_fields_are_shown_as_text(kb_engine):
    case = _by_name("hostile DOIs, titles and snippets")
    markdown = _render(kb_engine, case)["markdown"]
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f\u202a-\u202e\u2066-\u2069]", markdown), "controls and bidi overrides"
    for target in LINK_TARGET.findall(markdown):
        assert target.startswith("https://doi.org/10.") and target.isascii(), target
        assert not set(target) & set("<>[]() #?\"`"), target
    assert "https://doi.org/10.1002/%28SICI%291097-4571%28199806%2949:8%3C693::AID-ASI4%3E3.0.CO;2-0" in markdown
    assert "https://doi.org/10.1000/%C3%BCber-stra%C3%9Fe/%E7%9F%B3%E5%A2%A8%E7%83%AF" in markdown
    assert "https://doi.org/10.1000/a%23b%3Fc%20d%2520e" in markdown
    assert r"\*\*Bold\*\* claims, \_italic\_ \[a link\](https://evil.example) \<script>" in markdown
    assert "石墨烯在铜箔上的成核" in markdown and "\u0646\u0645\u0648\u0630\u062c" in markdown, "scripts are kept"
    assert "**x** `we'ird 4.pdf`" in markdown, "without a DOI the file name follows, as a code span"
    # a control or bidirectional character is shown as its escape (whose backslash Markdown escapes in turn); a
    # line break is a space
    assert r"> a bell\\x07, an escape \\x1b\[31mred\\x1b\[0m, a NUL\\x00 and a line break > not" in markdown
    assert r"[Invoice \\u202etxt.exe\\u202c and \\u2067isolated\\u2069: " in markdown
    assert r'for "\*what\* \`is\` \[this\] \<b>?"' in markdown


def test_a_hostile_length_still_fits_the_budget(kb_engine):
    case = _by_name("hostile: a 20,000-character title and snippet")
    out = _render(kb_engine, case)
    assert len(out["markdown"]) <= kb_engine.HOST_RENDER_BUDGET
    assert all(len(source["title"]) <= kb_engine.RENDER_TITLE_CHARS for source in out["view"]["sources"])
    assert out["view"]["sources"] and out["view"]["omitted"] + len(out["view"]["sources"]) == 12


@pytest.mark.parametrize("doi, link", [
    ("10.1000/abc(2021)01", "https://doi.org/10.1000/abc%282021%2901"),
    ("https://doi.org/10.1/x y", "https://doi.org/10.1/x%20y"),
    ("https://dx.doi.org/10.1/x", "https://doi.org/10.1/x"),
    ("10.1234/5;6:7@8", "https://doi.org/10.1234/5;6:7@8"),
    (None, None), ("", None)])
def test_doi_links(kb_engine, doi, link):
    assert kb_engine.doi_link(doi) == link


def test_page_spans_and_escaping(kb_engine):
    assert kb_engine.page_span(4, 4, None) == "p.4"
    assert kb_engine.page_span(4, 5, "1187") == "pp.4–5 (1187)"
    assert kb_engine.page_span(4, 4, "4") == "p.4"
    assert kb_engine.page_span(None, None, None) == ""
    assert kb_engine.md_text("a [1] *b* _c_ `d` <e>\n  f") == "a \\[1\\] \\*b\\* \\_c\\_ \\`d\\` \\<e> f"


def test_fetch_summary_names_source_file_title_doi_and_next_step(kb_engine):
    text = kb_engine.render_fetch({
        "files": [{"path": "/w/.kb/papers/10.1234_abc.pdf", "status": "added", "title": "A *bold* title"}],
        "totals": {"added": 1}, "kb_root": "/w/.kb",
        "fetched": {"identifier": "10.1234/abc", "kind": "doi", "source": "unpaywall", "url": "https://oa.example/x.pdf",
                    "path": "/w/.kb/papers/10.1234_abc.pdf", "bytes": 2048, "doi": "10.1234/abc"}})
    assert text == "\n".join([
        "**Fetched `10.1234/abc`** from an open-access copy (Unpaywall) (2 KiB).",
        "- Source URL: <https://oa.example/x.pdf>",
        "- Saved as: `/w/.kb/papers/10.1234_abc.pdf`",
        "- Indexed: **A \\*bold\\* title**, added",
        "- DOI: [10.1234/abc](https://doi.org/10.1234/abc)",
        "It is in the library now: kb_search and kb_rag can find it.",
        "Library: `/w/.kb`"])
    assert kb_engine.render_fetch({}) == "**Fetched `?`** from the web."


def test_job_summaries_point_the_model_at_kb_status(kb_engine):
    started = kb_engine.render_ingest({"job_id": "0d26dab84817", "state": "queued", "pending": 40, "files": 52,
                                       "note": "40 files need work"})
    assert "background job `0d26dab84817`" in started and 'kb_status with {"job_id": "0d26dab84817"}' in started
    running = kb_engine.render_status({"job": {"job_id": "j1", "command": "ingest", "state": "running", "done": 3,
                                               "total": 40, "phase": "files", "phase_done": 3, "phase_total": 40,
                                               "errors": []}})
    assert "`j1` ingest: **running** 3/40 (files 3/40)" in running and "call kb_status again later" in running
    finished = kb_engine.render_ingest({"files": [{"path": "/p/scan.pdf", "status": "skipped",
                                                   "reason": "no_text_layer", "error": "no text layer"}],
                                        "totals": {"skipped": 1, "files": 1}})
    assert "`scan.pdf`: skipped (no_text_layer)" in finished


def test_renderers_tolerate_odd_values(kb_engine):
    for command in kb_engine.RENDERERS:
        for odd in ({}, {"results": [None, 3, {"title": None, "score": float("nan")}]}, {"files": "x", "job": []}):
            out = kb_engine.rendered(command, odd, kb_engine.HOST_RENDER_BUDGET)
            assert isinstance(out["markdown"], str) and out["markdown"]
            json.dumps(out, allow_nan=False)


def test_the_cli_answers_render_requests_too(tmp_path):
    r = run_cli("stats", {"kb_root": str(tmp_path / "kb"), "render": "markdown"})
    assert r.rc == 0, r.stderr
    assert r.json["markdown"].startswith("**The knowledge base is empty**")
