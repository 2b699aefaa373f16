"""Section kinds in filters (issue 28, point 3): ``filters.section`` / ``--section`` match a section by its text
and, when the value names a kind of section (methods, results, ...), by its kind, so that ``methods`` finds a
paper's ``Method``, ``Methodology``, ``Experimental`` or ``方法`` section and everything under it. The kinds are
the ones the section weights use (``canonical_section``)."""
from __future__ import annotations

from pathlib import Path

import pytest

METHODS_HEADINGS = ["Methodology", "Method", "Materials and Methods", "Patients and methods", "Experimental"]


def _paper(folder: Path, name: str, methods: str) -> None:
    (folder / name).write_text(
        f"# A study of lattice strain, with a {methods} section\n\nAnna Berg\n\n"
        "## Introduction\n\nWe introduce the problem of lattice strain in graphene sheets grown on copper.\n\n"
        f"## {methods}\n\nWe measured lattice strain with Raman maps of the graphene sheets.\n\n"
        "### Sample preparation\n\nThe graphene sheets were transferred onto silicon wafers before mapping "
        "lattice strain.\n\n"
        "## Results\n\nThe lattice strain of graphene sheets was below one percent everywhere.\n", encoding="utf-8")


@pytest.fixture(scope="module")
def library(kb_engine, tmp_path_factory):
    folder = tmp_path_factory.mktemp("kinds")
    papers = folder / "papers"
    papers.mkdir()
    for i, heading in enumerate(METHODS_HEADINGS):
        _paper(papers, f"paper{i}.md", heading)
    (papers / "zh.md").write_text("# 石墨烯应变研究\n\n## 引言\n\n石墨烯薄膜的晶格应变问题。\n\n"
                                  "## 方法\n\n我们用拉曼光谱"
                                  "测量石墨烯薄膜的晶格应变。\n\n## 结果\n\n石墨烯薄膜的晶格应变小于百分之一。\n",
                                  encoding="utf-8")
    engine = kb_engine.Engine()
    try:
        engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(folder / "kb")})
    finally:
        engine.close()
    return folder / "kb"


def sections(engine, kb: Path, value) -> set[str]:
    reply = engine.execute("search", {"query": "graphene lattice strain 石墨烯 晶格应变", "kb_root": str(kb),
                                      "mode": "keyword", "top_k": 100, "filters": {"section": value}})
    return {hit["section"] for hit in reply["results"]}


@pytest.mark.parametrize("value", ["methods", "Method", "METHODOLOGY", "方法", "experimental"])
def test_a_methods_kind_finds_every_way_of_naming_it(engine, library, value):
    found = sections(engine, library, value)
    tops = {label.split(" > ")[0] for label in found}
    assert tops == {*METHODS_HEADINGS, "方法"}, found
    assert {f"{h} > Sample preparation" for h in METHODS_HEADINGS} <= found      # subsections come along


def test_other_kinds_and_plain_text(engine, library):
    assert sections(engine, library, "results") == {"Results", "结果"}
    assert sections(engine, library, "结果") == {"Results", "结果"}
    assert sections(engine, library, "introduction") == {"Introduction", "引言"}
    # a value that names no kind matches by text only
    assert sections(engine, library, "Sample preparation") == {f"{h} > Sample preparation" for h in METHODS_HEADINGS}
    assert sections(engine, library, "Patients") == {"Patients and methods",
                                                     "Patients and methods > Sample preparation"}
    # a list matches any of its values, kinds and texts mixed
    assert sections(engine, library, ["results", "Sample preparation"]) == \
        {"Results", "结果", *{f"{h} > Sample preparation" for h in METHODS_HEADINGS}}


@pytest.mark.internals
def test_the_kind_filter_applies_to_the_vector_side_too(kb_engine, library, engine):
    """filtered_chunk_ids (the vector side's candidate set) uses the same conditions."""
    lib = kb_engine.Library.open(library, writable=False)
    try:
        ids = kb_engine.filtered_chunk_ids(lib, {"section": "methods"})
        labels = {row[0] for row in lib.conn.execute(
            f"SELECT section FROM chunks WHERE id IN ({', '.join('?' * len(ids))})", ids)}
    finally:
        lib.close()
    assert {label.split(" > ")[0] for label in labels} == {*METHODS_HEADINGS, "方法"}


@pytest.mark.internals
def test_section_kinds_of_a_label(kb_engine):
    assert kb_engine.section_kinds("Methodology > Data") == {"methods"}
    assert kb_engine.section_kinds("3 Results and Discussion > 3.1 Strain") == {"results"}
    assert kb_engine.section_kinds("Proposed Method") == frozenset()
    assert kb_engine.section_has_kind(None, "methods") == 0
