"""The records the engine answers with are declared once, as typed records in the engine (``HitRecord``,
``CitationRecord``), and the docs' field tables are held to them: a field the engine adds to a hit without a row in
docs/PROTOCOL.md's "Result item" table and docs/OUTPUT-FORMAT.md's hit record fails here, and so does a row for a
field the engine no longer sends. (Before the records, PROTOCOL lacked `picture` and OUTPUT-FORMAT lacked `ocr`.)
"""
from __future__ import annotations

import re

import pytest

from helpers import ROOT

# About the engine's own records: names outside kb_engine.__all__ (tests/static/test_public_surface.py).
pytestmark = pytest.mark.internals

PROTOCOL = ROOT / "docs" / "PROTOCOL.md"
OUTPUT_FORMAT = ROOT / "docs" / "OUTPUT-FORMAT.md"


def table_after(path, heading: str) -> set[str]:
    """The field names in the first column of the first table after a line that starts with ``heading``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
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
