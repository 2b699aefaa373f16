"""Snippet boxes (issue 31, point 1): with `boxes: true` every PDF hit carries the rectangles of its snippet's
glyphs, and the text PyMuPDF reads inside those rectangles is the snippet's (letters and digits); a snippet that
cannot be placed has no boxes and a `boxes_note`, never boxes on other lines.

The papers are generated (examples/sample_papers.py): two columns stored right column first, a hyphenated line
end, ligatures, superscript citation markers, Chinese text, a page break inside a paragraph; and copies of one
paper with a rotated page and with a cropbox offset."""
from __future__ import annotations

import json
import os
import re
import shutil
import unicodedata

import pytest

pymupdf = pytest.importorskip("pymupdf")

from helpers import rotated_and_cropped_copies, sp  # noqa: E402

MAKERS = ("make_twocolumn_paper", "make_hyphenated_paper", "make_ligature_paper", "make_chinese_paper",
          "make_superscript_paper", "make_onecolumn_paper", "make_citing_paper", "make_markdown")


def letters(text: str) -> str:
    """Letters and digits only, case-folded, with ligatures and accents unfolded: what both sides must share."""
    return "".join(c for c in unicodedata.normalize("NFKD", text).casefold() if c.isalnum())


def text_in_boxes(hit: dict) -> str:
    with pymupdf.open(hit["path"]) as doc:
        return "".join(doc[box["page"] - 1].get_textbox(pymupdf.Rect(rect))
                       for box in hit["boxes"] for rect in box["rects"])


@pytest.fixture(scope="module")
def library(tmp_path_factory, kb_engine):
    folder = tmp_path_factory.mktemp("boxes")
    papers = {name: getattr(sp, name)(folder) for name in MAKERS}
    rotated, cropped = rotated_and_cropped_copies(papers, folder)
    engine = kb_engine.Engine()
    kb_root = folder / ".kb"
    engine.execute("ingest", {"paths": [str(folder)], "kb_root": str(kb_root)})

    def search(query: str, **extra) -> list[dict]:
        payload = {"query": query, "kb_root": str(kb_root), "mode": "keyword", "boxes": True, "top_k": 10, **extra}
        return engine.execute("search", payload)["results"]

    yield {"folder": folder, "papers": papers, "search": search, "engine": engine, "kb_root": kb_root,
           "rotated": rotated, "cropped": cropped}
    engine.close()


def placed_hits(hits: list[dict]) -> list[dict]:
    pdf = [h for h in hits if h["kind"] == "pdf"]
    for hit in pdf:
        assert ("boxes" in hit) != ("boxes_note" in hit), hit
        if "boxes" in hit:
            assert letters(text_in_boxes(hit)) == letters(hit["snippet"].replace("…", "")), (hit["file"], hit)
            assert [b["page"] for b in hit["boxes"]] == list(range(hit["page"], (hit["page_end"] or hit["page"]) + 1))
    return [h for h in pdf if "boxes" in h]


QUERIES = ("ribosome nascent chain", "molten globule", "electrolyte viscosity", "fluorinated ether", "photocatalyst",
           "titanium dioxide", "钙钛矿 稳定性", "graphene copper", "chemical vapour deposition", "citation",
           "superscript references", "solvation structure", "sputtered", "grain boundaries", "hydrogen evolution")


@pytest.mark.slow      # every box of every hit of a two-column paper, at three snippet lengths
@pytest.mark.parametrize("snippet", [120, 300, 0])
def test_every_placed_box_holds_its_snippet(library, snippet):
    total = placed = 0
    for query in QUERIES:
        hits = [h for h in library["search"](query, snippet=snippet) if h["kind"] == "pdf"]
        total += len(hits)
        placed += len(placed_hits(hits))
    assert total >= 40
    assert placed / total >= 0.95, (placed, total)


def test_a_snippet_across_the_column_break_has_boxes_in_both_columns(library):
    path = library["papers"]["make_twocolumn_paper"]
    left, right = sp.two_column_break(path)
    query = " ".join(re.findall(r"[A-Za-z]{5,}", left)[-2:] + re.findall(r"[A-Za-z]{5,}", right)[:2])
    hits = [h for h in placed_hits(library["search"](query, snippet=0)) if h["file"] == path.name]
    with pymupdf.open(path) as doc:
        middle = doc[0].rect.width / 2
    crossing = [h for h in hits if letters(left) in letters(h["snippet"]) and letters(right) in letters(h["snippet"])]
    assert crossing, [h["snippet"][:80] for h in hits]
    rects = [r for box in crossing[0]["boxes"] for r in box["rects"]]
    assert any(r[2] < middle for r in rects) and any(r[0] > middle for r in rects)


def test_a_snippet_across_a_page_break_has_boxes_on_both_pages(library):
    path = library["papers"]["make_onecolumn_paper"]
    last, first = sp.page_break_lines(path)
    query = " ".join(re.findall(r"[A-Za-z]{5,}", last)[-2:] + re.findall(r"[A-Za-z]{5,}", first)[:2])
    hits = [h for h in placed_hits(library["search"](query, snippet=0)) if h["file"] == path.name]
    crossing = [h for h in hits if h["page_end"] and h["page_end"] > h["page"]]
    assert crossing, [(h["page"], h["page_end"]) for h in hits]
    assert [b["page"] for b in crossing[0]["boxes"]] == [crossing[0]["page"], crossing[0]["page"] + 1]
    assert all(b["rects"] for b in crossing[0]["boxes"])


def test_superscript_markers_shown_as_brackets_map_to_their_glyphs(library):
    name = library["papers"]["make_superscript_paper"].name
    hits = [h for query in ("twisted bilayers", "grain boundaries limit")
            for h in placed_hits(library["search"](query, snippet=0)) if h["file"] == name]
    marked = [h for h in hits if re.search(r"\[\d+(?:[,–-]\d+)*\]", h["snippet"])]
    assert marked, [h["snippet"][:80] for h in hits]
    # the marker digits are inside the boxes: "bilayers[3]" reads "bilayers3" there
    assert "bilayers3" in letters(text_in_boxes(marked[0]))


def test_ligatures_hyphenation_and_chinese_are_placed(library):
    for maker, query in (("make_ligature_paper", "photocatalyst"), ("make_hyphenated_paper", "electrolyte"),
                         ("make_chinese_paper", "钙钛矿 稳定性")):
        name = library["papers"][maker].name
        hits = [h for h in library["search"](query, snippet=0) if h["file"] == name]
        assert hits and placed_hits(hits) == hits, (maker, [h.get("boxes_note") for h in hits])


@pytest.mark.parametrize("which", ["rotated", "cropped"])
def test_rotated_and_cropped_pages_are_placed_in_page_coordinates(library, which):
    name = library[which].name
    query = "electrolyte viscosity" if which == "rotated" else "photocatalyst"
    hits = [h for h in library["search"](query, snippet=0) if h["file"] == name]
    assert hits and placed_hits(hits) == hits, [h.get("boxes_note") for h in hits]
    with pymupdf.open(library[which]) as doc:
        for hit in hits:
            page = doc[hit["page"] - 1].rect
            for box in hit["boxes"]:
                for x0, y0, x1, y1 in box["rects"]:
                    assert page.x0 <= x0 < x1 <= page.x1 and page.y0 <= y0 < y1 <= page.y1


def test_boxes_are_absent_unless_asked_and_for_other_kinds(library):
    plain = library["engine"].execute("search", {"query": "sparse attention", "kb_root": str(library["kb_root"]),
                                                 "mode": "keyword"})["results"]
    assert plain and not any("boxes" in h or "boxes_note" in h for h in plain)
    boxed = library["search"]("sparse attention")
    markdown = [h for h in boxed if h["kind"] == "md"]
    assert markdown and not any("boxes" in h or "boxes_note" in h for h in markdown)
    # the cached bare answer stays bare after a boxed one
    again = library["engine"].execute("search", {"query": "sparse attention", "kb_root": str(library["kb_root"]),
                                                 "mode": "keyword"})
    assert again["cached"] and not any("boxes" in h for h in again["results"])


def test_a_changed_or_missing_file_gets_a_note_not_boxes(library, kb_engine, tmp_path):
    source = library["papers"]["make_hyphenated_paper"]
    folder = tmp_path / "papers"
    folder.mkdir()
    copy = folder / source.name
    shutil.copy(source, copy)
    engine = kb_engine.Engine()
    kb_root = tmp_path / ".kb"
    try:
        engine.execute("ingest", {"paths": [str(folder)], "kb_root": str(kb_root)})
        payload = {"query": "electrolyte", "kb_root": str(kb_root), "mode": "keyword", "boxes": True, "cache": False}
        assert all("boxes" in h for h in engine.execute("search", payload)["results"])
        with pymupdf.open(source) as doc:           # same file name, other glyphs: a line added on top
            doc[0].insert_text((60, 30), "Revised version with corrected electrolyte figures", fontsize=9)
            doc.save(copy)
        os.utime(copy, ns=(1, 1))
        hits = engine.execute("search", payload)["results"]
        assert hits and all("boxes" not in h and "changed since it was indexed" in h["boxes_note"] for h in hits)
        copy.unlink()
        hits = engine.execute("search", payload)["results"]
        assert hits and all("boxes" not in h and "no longer at its indexed path" in h["boxes_note"] for h in hits)
    finally:
        engine.close()


def test_boxes_must_be_a_boolean(library, kb_engine):
    with pytest.raises(kb_engine.KBError) as raised:
        library["engine"].execute("search", {"query": "graphene", "kb_root": str(library["kb_root"]), "boxes": "yes"})
    assert raised.value.code == "bad_request"


def test_the_command_line_asks_for_boxes_with_a_switch(library):
    from helpers import run_cli
    plain = run_cli("search", None, "electrolyte viscosity", "--mode", "keyword", "--kb-root", str(library["kb_root"]),
                    "--json")
    boxed = run_cli("search", None, "electrolyte viscosity", "--mode", "keyword", "--boxes", "--kb-root",
                    str(library["kb_root"]), "--json")
    assert plain.rc == 0 and boxed.rc == 0, (plain.stderr, boxed.stderr)
    assert not any("boxes" in h for h in json.loads(plain.stdout)["results"])
    assert placed_hits(json.loads(boxed.stdout)["results"])
