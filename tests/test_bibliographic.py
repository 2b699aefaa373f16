"""The kind of work, venue, volume, issue, pages, publisher and report number a paper prints about itself
(issue 52), read from generated PDFs that print each form in a layout of their own, and written into BibTeX
entries that parse and CSL items that hold only the CSL schema's types and variables.

Every name, venue and number here is made up for these files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pymupdf
import pytest

from helpers import clean_env, run_cli

pytestmark = pytest.mark.slow  # one ingest of a dozen generated papers, shared by the module

BODY = (
    "We measured the response of the samples over three seasons and compared it with the model. The results "
    "agree within the stated uncertainty, and the remaining difference is traced to the calibration of the "
    "sensors, which drifted slowly during the second season as the discussion below explains in detail."
)


def _text(page, x, y, text, size=10.0, font="tiro", rotate=0):
    page.insert_text((x, y), text, fontsize=size, fontname=font, rotate=rotate)


def _body(page, top=300.0, lines=18, font="tiro"):
    words = (BODY + " ") * 4
    for i in range(lines):
        _text(page, 72, top + i * 14, words[i * 70 : i * 70 + 70], font=font)


def make_paper(
    path: Path,
    title: str,
    byline: str,
    *,
    header: str = "",
    footer: str = "",
    pages: int = 4,
    folios: list[str] | None = None,  # the number printed at the foot of each page ("" for none)
    running: str = "",  # a running footer on later pages, "{n}" standing for the page's number
    extra: list[tuple[float, str]] = (),  # (y, text) lines on page 1
    stamp: str = "",  # text set sideways in the left margin of page 1
    cjk: bool = False,
    abstract: bool = True,
) -> Path:
    font = "china-s" if cjk else "tiro"
    doc = pymupdf.open()
    for number in range(pages):
        page = doc.new_page(width=595, height=842)
        if number == 0:
            if header:
                _text(page, 72, 40, header, size=8.5, font=font)
            _text(page, 72, 110, title, size=17, font="china-s" if cjk else "tibo")
            _text(page, 72, 140, byline, size=11, font=font)
            if abstract:
                _text(page, 72, 180, "摘要" if cjk else "Abstract", size=11, font="china-s" if cjk else "tibo")
            for y, line in extra:
                _text(page, 72, y, line, size=8.5, font=font)
            if footer:
                _text(page, 72, 800, footer, size=8, font=font)
            if stamp:
                _text(page, 30, 600, stamp, size=14, rotate=90)
            _body(page, top=200, lines=20, font=font)
        else:
            _body(page, top=80, lines=40, font=font)
            if running:
                _text(page, 72, 815, running.replace("{n}", folios[number] if folios else str(number + 1)), size=8)
        if folios and folios[number] and not running:
            _text(page, 290, 815, folios[number], size=9)
    doc.set_metadata({})
    doc.save(str(path))
    doc.close()
    return path


def make_thesis(path: Path, lines: list[str], *, cjk: bool) -> Path:
    font = "china-s" if cjk else "tiro"
    doc = pymupdf.open()
    page = doc.new_page(width=595, height=842)
    y = 120.0
    for line in lines:
        size = 20 if line == lines[1] else 12
        _text(page, 110, y, line, size=size, font=font)
        y += 40 if size == 20 else 26
    for _ in range(3):
        _body(doc.new_page(width=595, height=842), top=80, lines=40, font=font)
    doc.save(str(path))
    doc.close()
    return path


PAPERS = {
    # the journal's line at the head of page 1, printed page numbers on the pages after it
    "colon_line.pdf": dict(
        title="Seasonal Drift in Soil Moisture Probes",
        byline="Hanne Solberg, Tomas Okafor and Mira Castellanos",
        header="Journal of Rural Field Methods (2011), 18:3, 211-219",
        folios=["", "212", "213", "214"],
    ),
    # a footer with the volume, the date and the first page; later pages carry "{n} | Venue | Vol ..."
    "footer_vol.pdf": dict(
        title="Coherent Phonons in Layered Oxide Films",
        byline="Ilse Marchetti, Rafael Quint and Dana Whitford",
        footer="Condensed Matter Express | Vol 81 | 3 March 2015 | 402",
        running="{n} | Condensed Matter Express | Vol 81 | 3 March 2015",
        folios=["402", "403", "404", "405"],
    ),
    # a letters journal: name, acronym, volume, article number, year; the cost code in the footer
    "letters.pdf": dict(
        title="Anomalous Damping of Capillary Waves on Thin Films",
        byline="Yusuf Demir and Agnes Holloway",
        header="JOURNAL OF INTERFACE LETTERS  JIL 44, 081203 (2012)  week ending 3 MAY 2012",
        footer="1234-5678/12/44(8)/081203(4)",
    ),
    # an open-access block: authors, journal, year, volume:article
    "oa_block.pdf": dict(
        title="Staffing Patterns in Rural Maternity Units",
        byline="Grace Okafor, Lena Brandt and Samuel Ito",
        header="Okafor et al. Journal of Community Midwifery 2016, 9:42",
    ),
    # a proceedings footer with its pages
    "proceedings.pdf": dict(
        title="Sense Inventories for Low-Resource Dialects",
        byline="Nadia Ferraz and Owen Lindqvist",
        footer="Proceedings of the 12th Workshop on Lexical Semantics, pages 88-97, Lisbon, Portugal, May 2011.",
        folios=["88", "89", "90", "91"],
    ),
    # a Chinese journal: volume and issue in its header, page numbers on the later pages
    "zh_journal.pdf": dict(
        title="城市河道底泥重金属的迁移特征研究",
        byline="林晓东  周敏  韩立新",
        header="第12卷第3期        环境工程科学学报        2008年6月",
        folios=["", "234", "235", "236"],
        cjk=True,
    ),
    # an arXiv preprint: the stamp in the margin, no venue
    "preprint.pdf": dict(
        title="Sparse Routing for Mixture Language Models",
        byline="Priya Raman and Jonas Feld",
        stamp="arXiv:2105.01234v2  [cs.CL]  3 May 2021",
    ),
    # a report with its number
    "report.pdf": dict(
        title="Calibration of Low-Cost Air Quality Sensors",
        byline="Martin Kowalczyk and Elena Rossi",
        header="Technical Report NMRL-TR-2019-07",
        extra=[(760, "Northmere Research Laboratory, Northmere University, 2019")],
        abstract=False,
    ),
    # a collaboration whose members are listed at the end
    "collaboration.pdf": dict(
        title="Search for Slow Neutrino Bursts in the Quiet Year",
        byline="The Deepwell Collaboration (full author list at the end of the paper)",
        header="Annals of Underground Physics 27 (2018) 301-318",
    ),
}

THESES = {
    "zh_thesis.pdf": (
        ["东海理工大学", "硕士学位论文", "论文题目：滨海湿地植被恢复的遥感监测方法", "作者姓名：韩雪松",
         "指导教师：王立平 教授", "培养单位：环境科学与工程学院", "二〇二〇年五月"],
        True,
    ),
    "en_thesis.pdf": (
        ["UNIVERSITY OF NORTHMERE", "Adaptive Meshes for Glacier Flow", "by", "Alice Thornbury",
         "A thesis submitted in partial fulfilment of the requirements for the degree of Doctor of Philosophy",
         "Department of Earth Sciences, University of Northmere", "2017"],
        False,
    ),
}


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    folder = tmp_path_factory.mktemp("printed")
    papers = folder / "papers"
    papers.mkdir()
    for name, spec in PAPERS.items():
        make_paper(papers / name, **spec)
    for name, (lines, cjk) in THESES.items():
        make_thesis(papers / name, lines, cjk=cjk)
    kb = folder / "kb"
    reply = run_cli("ingest", {"paths": [str(papers)], "kb_root": str(kb)}, env=clean_env(KB_EMBED_MODEL="none"))
    assert reply.rc == 0, reply
    docs = run_cli("docs", {"kb_root": str(kb)}).json["docs"]
    return kb, {Path(d["path"]).name: d for d in docs}


FIELDS = ("work_type", "journal", "volume", "issue", "page_range", "year")
EXPECTED = {
    "colon_line.pdf": ("journal-article", "Journal of Rural Field Methods", "18", "3", "211-219", 2011),
    "footer_vol.pdf": ("journal-article", "Condensed Matter Express", "81", None, "402-405", 2015),
    "letters.pdf": ("journal-article", "Journal of Interface Letters", "44", "8", "081203", 2012),
    "oa_block.pdf": ("journal-article", "Journal of Community Midwifery", "9", None, "42", 2016),
    "proceedings.pdf": (
        "conference-paper", "Proceedings of the 12th Workshop on Lexical Semantics", None, None, "88-97", 2011,
    ),
    "zh_journal.pdf": ("journal-article", "环境工程科学学报", "12", "3", "233-236", 2008),
    "preprint.pdf": ("preprint", None, None, None, None, 2021),
    "report.pdf": ("report", None, None, None, None, 2019),
    "collaboration.pdf": ("journal-article", "Annals of Underground Physics", "27", None, "301-318", 2018),
    "zh_thesis.pdf": ("masters-thesis", None, None, None, None, 2020),
    "en_thesis.pdf": ("phd-thesis", None, None, None, None, 2017),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_printed_form_is_read(library, name):
    _, docs = library
    doc = docs[name]
    assert doc["status"] == "indexed", doc
    got = tuple(doc[f] for f in FIELDS)
    # a venue printed in capitals is written in title case
    assert got == EXPECTED[name], dict(zip(FIELDS, got))


def test_theses_reports_and_preprints_carry_their_own_fields(library):
    _, docs = library
    zh, en = docs["zh_thesis.pdf"], docs["en_thesis.pdf"]
    assert zh["title"] == "滨海湿地植被恢复的遥感监测方法" and zh["authors"] == ["韩雪松"]  # not the supervisor
    assert zh["publisher"] == "东海理工大学"
    assert en["publisher"] == "University of Northmere" and en["title"] == "Adaptive Meshes for Glacier Flow"
    assert docs["report.pdf"]["report_number"] == "NMRL-TR-2019-07"
    assert docs["preprint.pdf"]["arxiv_id"] == "2105.01234"
    collab = docs["collaboration.pdf"]
    assert collab["authors_more"] is True and collab["authors"] == ["The Deepwell Collaboration"]
    # nothing invented: a paper that prints no venue has none
    for name in ("preprint.pdf", "report.pdf", "zh_thesis.pdf", "en_thesis.pdf"):
        assert all(docs[name][f] is None for f in ("journal", "volume", "issue", "page_range")), name


def _parse_bibtex(text: str) -> dict[str, tuple[str, dict]]:
    bibtexparser = pytest.importorskip("bibtexparser")
    if hasattr(bibtexparser, "parse_string"):  # 2.x
        parsed = bibtexparser.parse_string(text)
        assert not parsed.failed_blocks, parsed.failed_blocks
        return {e.key: (e.entry_type.lower(), {k.lower(): v for k, v in e.fields_dict.items()}) for e in parsed.entries}
    parsed = bibtexparser.loads(text)  # 1.x
    return {e["ID"]: (e["ENTRYTYPE"].lower(), e) for e in parsed.entries}


def _field(entry: dict, name: str):
    value = entry.get(name)
    return getattr(value, "value", value)


def test_bibtex_entries_are_of_their_kind_and_parse(library):
    kb, docs = library
    ids = {name: docs[name]["doc_id"] for name in EXPECTED}
    reply = run_cli("cite", {"doc_ids": list(ids.values()), "kb_root": str(kb)}).json
    entries = _parse_bibtex(reply["text"])
    by_doc = {e["doc_id"]: e["key"] for e in reply["entries"]}
    kinds = {name: entries[by_doc[doc_id]] for name, doc_id in ids.items()}
    assert kinds["colon_line.pdf"][0] == "article"
    article = kinds["colon_line.pdf"][1]
    assert (_field(article, "journal"), _field(article, "volume"), _field(article, "number")) == (
        "Journal of Rural Field Methods", "18", "3")
    assert _field(article, "pages") == "211--219"
    assert kinds["proceedings.pdf"][0] == "inproceedings"
    assert _field(kinds["proceedings.pdf"][1], "booktitle").startswith("Proceedings of the 12th Workshop")
    zh_thesis = kinds["zh_thesis.pdf"]
    assert zh_thesis[0] == "mastersthesis" and _field(zh_thesis[1], "school") == "东海理工大学"
    assert kinds["en_thesis.pdf"][0] == "phdthesis"
    assert kinds["report.pdf"][0] == "techreport" and _field(kinds["report.pdf"][1], "number") == "NMRL-TR-2019-07"
    preprint = kinds["preprint.pdf"]
    assert preprint[0] == "misc" and _field(preprint[1], "eprint") == "2105.01234"
    assert _field(preprint[1], "archiveprefix") == "arXiv"
    assert _field(kinds["collaboration.pdf"][1], "author").endswith(" and others")


def _schema_words(name: str, block: str) -> set[str]:
    """The quoted words of one definition of the CSL schema as citeproc-py ships it (csl-types.rnc,
    csl-variables.rnc): the schema itself, not a copy of it."""
    citeproc = pytest.importorskip("citeproc")
    folder = Path(citeproc.__file__).parent / "data" / "schema" / "schemas" / "styles"
    if not (folder / name).is_file():
        pytest.skip(f"citeproc-py ships no {name}")
    text = (folder / name).read_text(encoding="utf-8")
    match = re.search(rf"^\s*{re.escape(block)}\s*=(.*?)(?=^\s*(?:##|[\w.-]+\s*=|}}))", text, re.M | re.S)
    assert match, f"{block} in {name}"
    return set(re.findall(r'"([\w-]+)"', match.group(1)))


def test_csl_items_hold_the_schemas_types_and_variables(library):
    kb, docs = library
    reply = run_cli("cite", {"doc_ids": [d["doc_id"] for d in docs.values()], "format": "csl-json",
                             "kb_root": str(kb)}).json
    items = json.loads(reply["text"])
    types = _schema_words("csl-types.rnc", "item-types")
    names = _schema_words("csl-variables.rnc", "variables.names")
    dates = _schema_words("csl-variables.rnc", "variables.dates")
    standard = (
        _schema_words("csl-variables.rnc", "variables.numbers")
        | _schema_words("csl-variables.rnc", "variables.strings")
        | _schema_words("csl-variables.rnc", "variables.titles")
    )
    assert {"article-journal", "thesis", "report"} <= types and "volume" in standard
    allowed = names | dates | standard | {"id", "type", "language"}
    by_type = {}
    for item in items:
        assert item["type"] in types, item
        assert set(item) <= allowed, set(item) - allowed
        for key in set(item) & names:
            assert all(isinstance(n, dict) and ({"family"} <= set(n) or "literal" in n) for n in item[key]), item
        for key in set(item) & dates:
            assert isinstance(item[key]["date-parts"][0][0], int), item
        by_type.setdefault(item["type"], []).append(item)
    assert {"article-journal", "paper-conference", "thesis", "report", "article"} <= set(by_type)
    thesis = next(i for i in by_type["thesis"] if i.get("publisher") == "东海理工大学")
    assert thesis["genre"] == "Master's thesis"
    preprint = next(i for i in by_type["article"] if i.get("number", "").startswith("arXiv:"))
    assert preprint["publisher"] == "arXiv" and preprint["URL"] == "https://arxiv.org/abs/2105.01234"
    assert any(n == {"literal": "others"} for i in items for n in i.get("author", []))
