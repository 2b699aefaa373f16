"""The records the engine answers with are declared once, as typed records in the engine (``HitRecord``,
``CitationRecord``, ``SearchResponse``, ``FileEntry``, ``DocRecord``, ``JobRecord``, ...), and the docs' field tables
are held to them: a field the engine adds to a hit without a row in docs/PROTOCOL.md's "Result item" table and
docs/OUTPUT-FORMAT.md's hit record fails here, and so does a row for a field the engine no longer sends. (Before the
records, PROTOCOL lacked `picture` and OUTPUT-FORMAT lacked `ocr` for a hit, and the file entry table lacked
`ocr_pages` and `removed`, the search response table `queries`.) Real answers are held to the records too.
"""
from __future__ import annotations

import re

import pytest

from helpers import ROOT

# About the engine's own records: names outside kb_engine.__all__ (tests/static/test_public_surface.py).
pytestmark = pytest.mark.internals

PROTOCOL = ROOT / "docs" / "PROTOCOL.md"
OUTPUT_FORMAT = ROOT / "docs" / "OUTPUT-FORMAT.md"


def table_after(path, *markers: str) -> set[str]:
    """The field names in the first column of the first table after a line that starts with the last of
    ``markers``, each marker looked for after the one before it (a heading, then a line in its section)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = 0
    for marker in markers:
        start = next(i for i in range(start, len(lines)) if lines[i].startswith(marker))
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("| field |"))
    names: set[str] = set()
    for line in lines[first + 2:]:
        if not line.startswith("|"):
            break
        names.update(re.findall(r"`(\w+)`", line.split("|")[1]))
    return names


def keys(record) -> set[str]:
    return set(record.__required_keys__) | set(record.__optional_keys__)


@pytest.mark.parametrize("path, heading", [(PROTOCOL, "Result item:"), (OUTPUT_FORMAT, "## The hit record")])
def test_the_hit_tables_are_the_hit_record(kb_engine, path, heading):
    documented = table_after(path, heading)
    declared = keys(kb_engine.HitRecord)
    assert documented == declared, (f"{path.name}: documented, not sent: {sorted(documented - declared)}; "
                                    f"sent, not documented: {sorted(declared - documented)}")


def test_the_citation_table_is_the_citation_record(kb_engine):
    assert table_after(OUTPUT_FORMAT, "### Citations") == keys(kb_engine.CitationRecord)


def test_a_real_hit_has_the_fields_the_record_says(kb_engine, tmp_path):
    """The record is what hit_records makes, not a wish: a deep search of a real paper gives every required key
    and no key the record lacks."""
    import sample_papers as sp

    paper = sp.make_citing_paper(tmp_path)
    engine = kb_engine.Engine()
    try:
        engine.execute("ingest", {"paths": [str(paper)], "kb_root": str(tmp_path / "kb")})
        answer = engine.execute("search", {"query": f"citation graphs {sp.CITING_TOKEN_23} parsed reference lists",
                                           "kb_root": str(tmp_path / "kb"), "depth": "deep", "boxes": True})
    finally:
        engine.close()
    hit = answer["results"][0]
    assert set(kb_engine.HitRecord.__required_keys__) <= set(hit) <= keys(kb_engine.HitRecord)
    assert hit["citations"] and set(hit["citations"][0]) == keys(kb_engine.CitationRecord)


# Each record with its table in docs/PROTOCOL.md; the fields every answer gets (records.Answered) are documented
# once, under Common rules, and left out of each response's table.
RESPONSE_TABLES = [     # (record, whole answer: includes Answered, where its table is)
    ("SearchResponse", True, ("## search", "Response:")),
    ("RagResponse", True, ("## rag", "Response:")),
    ("FileEntry", False, ("## ingest", "File entry:")),
    ("DocRecord", False, ("## docs", "`total` counts every document")),
    ("JobRecord", False, ("## status", "Response with `job_id`")),
]


@pytest.mark.parametrize("record, answer, markers", RESPONSE_TABLES, ids=[r for r, _, _ in RESPONSE_TABLES])
def test_the_response_tables_are_the_records(kb_engine, record, answer, markers):
    documented = table_after(PROTOCOL, *markers)
    declared = keys(getattr(kb_engine, record)) - (keys(kb_engine.Answered) if answer else set())
    assert documented == declared, (f"{record}: documented, not sent: {sorted(documented - declared)}; "
                                    f"sent, not documented: {sorted(declared - documented)}")


def held_to(answer: dict, record) -> None:
    """Every key the record requires is there, and no key it lacks."""
    assert set(record.__required_keys__) <= set(answer), sorted(set(record.__required_keys__) - set(answer))
    assert set(answer) <= keys(record), sorted(set(answer) - keys(record))


def test_real_answers_are_their_records(kb_engine, tmp_path):
    """An ingest of real papers (one read by OCR-free text, one duplicate, one link out of the folder), a search
    with renderings, the documents list and a job are what their records say, key for key."""
    import sample_papers as sp

    papers = tmp_path / "papers"
    paper = sp.make_citing_paper(papers)
    (papers / "copy.pdf").write_bytes(paper.read_bytes())
    (papers / "elsewhere.md").symlink_to(sp.make_markdown(tmp_path / "outside"))
    root = str(tmp_path / "kb")
    engine = kb_engine.Engine()
    try:
        ingested = engine.execute("ingest", {"paths": [str(papers)], "kb_root": root})
        found = engine.execute("search", {"query": "citation graphs parsed reference lists", "kb_root": root,
                                          "queries": ["reference lists are parsed into citation graphs"]})
        asked = engine.execute("rag", {"query": "citation graphs parsed reference lists", "kb_root": root})
        listed = engine.execute("docs", {"kb_root": root})
    finally:
        engine.close()
    held_to(ingested, kb_engine.IngestResponse)
    assert set(ingested["totals"]) == keys(kb_engine.IngestTotals)
    assert sorted(e["status"] for e in ingested["files"]) == ["added", "duplicate", "skipped"], ingested["files"]
    for entry in ingested["files"]:
        held_to(entry, kb_engine.FileEntry)
    held_to(found, kb_engine.SearchResponse)
    assert found["results"] and found["queries"], found
    held_to(asked, kb_engine.RagResponse)
    assert asked["evidence"] and asked["guidance"], asked
    held_to(listed, kb_engine.DocsResponse)
    assert len(listed["docs"]) == 2
    for doc in listed["docs"]:
        assert set(doc) == keys(kb_engine.DocRecord)
    store = kb_engine.JobStore(tmp_path / "kb")
    job = kb_engine.job_view(store.create("ingest", {"paths": [str(papers)]}, 3, 3))
    assert list(job) == list(kb_engine.JobRecord.__annotations__)
