"""Exports with the fields a reference manager needs (issue 29, point 6), each read off a generated paper whose
page shows the trap: proceedings named in page 1's footer, an affiliation row beside a byline, a SICI DOI with
"<" and ">", a title in capitals, file metadata naming a template, a table-only page, a Portuguese thesis.

All people, venues and DOIs are invented."""
from __future__ import annotations

import json
from pathlib import Path

import pymupdf
import pytest

from helpers import clean_env, run_cli

SICI = "10.1002/(SICI)1097-4636(199706)35:4<517::AID-JBM12>3.0.CO;2-B"
VENUE = "Proceedings of the 61st Annual Meeting of the Association for Computational Linguistics"

FILLER = ("Bibliography entries are parsed from each paper and matched to the papers of the corpus by the "
          "similarity of their titles, and a link is kept only when the best match is clearly ahead of the next.")


def _lines(page, x: float, y: float, lines: list[str], size: float = 10, font: str = "tiro",
           leading: float = 1.4) -> float:
    for line in lines:
        page.insert_text((x, y), line, fontsize=size, fontname=font)
        y += size * leading
    return y


def _new_pdf():
    """(document, its first A4 page)."""
    doc = pymupdf.open()
    return doc, doc.new_page(width=595, height=842)


def _saved(doc, folder: Path, name: str) -> Path:
    doc.save(folder / name)
    return folder / name


def _body_page(doc, words: str, heading: str = "2 Method") -> None:
    page = doc.new_page(width=595, height=842)
    y = _lines(page, 72, 90, [heading], size=12, font="tibo")
    _lines(page, 72, y + 6, [words[i:i + 95] for i in range(0, len(words), 95)])


def make_acl_paper(folder: Path) -> Path:
    """A conference paper: the proceedings only in page 1's footer, two authors side by side with their
    institutions in the row under them (same type size), and a SICI DOI printed in the header."""
    doc, page = _new_pdf()
    page.insert_text((72, 60), f"doi:{SICI}", fontsize=8, fontname="tiro")
    page.insert_text((110, 110), "Linking Citations across a Corpus of Open Papers", fontsize=17, fontname="tibo")
    for x, name, place in ((170, "Mei Lin", "Fudan University"), (350, "Oskar Brandt", "PA Technology")):
        page.insert_text((x, 145), name, fontsize=11, fontname="tiro")
        page.insert_text((x - 10, 162), place, fontsize=11, fontname="tiro")
    y = _lines(page, 72, 200, ["Abstract"], size=11, font="tibo")
    y = _lines(page, 72, y + 4, [FILLER[:95], FILLER[95:]])
    y = _lines(page, 72, y + 14, ["1 Introduction"], size=12, font="tibo")
    _lines(page, 72, y + 4, [(FILLER * 6)[i:i + 95] for i in range(0, 570, 95)])
    page.insert_text((72, 800), f"{VENUE}, pages 4969-4983", fontsize=8, fontname="tiro")
    page.insert_text((72, 811), "July 9-14, 2023. ©2023 Association for Computational Linguistics", fontsize=8,
                     fontname="tiro")
    _body_page(doc, FILLER * 8)
    return _saved(doc, folder, "acl-paper.pdf")


def make_capitals_paper(folder: Path) -> Path:
    """A title set in capitals whose words the text writes in lower case, except its acronym; the file's
    metadata names the template's author."""
    doc, page = _new_pdf()
    page.insert_text((80, 110), "TUNER TESTS OF A DRESSED CAVITY FOR THE LCLS-II LINAC", fontsize=15,
                     fontname="tibo")
    page.insert_text((200, 140), "Yara Pinsky, Sven Adler", fontsize=11, fontname="tiro")
    page.insert_text((200, 156), "Fermilab, Batavia, USA", fontsize=9, fontname="tiro")
    text = ("The tuner of a dressed cavity was tested in the horizontal test stand before its installation in the "
            "LCLS-II linac. The tests measured the tuner range and the cavity frequency drift. ") * 4
    y = _lines(page, 72, 200, ["Abstract"], size=11, font="tibo")
    _lines(page, 72, y + 4, [text[i:i + 95] for i in range(0, len(text), 95)])
    _body_page(doc, text * 2)
    doc.set_metadata({"title": "Proceedings template", "author": "Template Author"})
    return _saved(doc, folder, "capitals.pdf")


def make_chinese_guide(folder: Path) -> Path:
    """A Chinese guide whose title is set at body size and whose file metadata (title and author) is the name of
    the template it was made from."""
    doc, page = _new_pdf()
    lines = ["西南交通大学本科毕业设计撰写规范",
             "毕业设计是实现学生培养目标的重要教学环节，其质量是衡量教育教学水平的重要依据。",
             "毕业设计撰写是本科生培养过程的基本训练之一，必须按照确定的规范认真执行。",
             "题目应恰当、准确地反映本课题的研究内容，主标题应不超过二十五字。"]
    _lines(page, 72, 90, lines * 3, size=11, font="china-s", leading=1.8)
    doc.set_metadata({"title": "番茄花园", "author": "番茄花园"})
    return _saved(doc, folder, "guide-zh.pdf")


def make_table_page(folder: Path) -> Path:
    """A page that is only a results table (a supplement cut out of a paper)."""
    doc, page = _new_pdf()
    rows = [["Field", "Task", "Dataset", "SOTA", "BERT-Base", "", ""],
            ["", "", "", "", "Frozen", "Finetune", "Frozen", "Finetune"],
            ["Bio", "NER", "BC5CDR", "88.85", "85.08", "86.72", "88.73", "90.01"],
            ["", "PICO", "EBM-NLP", "72.30", "71.53", "71.18", "72.34", "72.28"],
            ["CS", "NER", "SciERC", "64.20", "63.58", "65.24", "63.64", "67.57"]]
    for r, row in enumerate(rows):
        for c, cell in enumerate(row):
            if cell:
                page.insert_text((60 + 62 * c, 100 + 16 * r), cell, fontsize=9, fontname="tiro")
    return _saved(doc, folder, "table-only.pdf")


def make_portuguese_thesis(folder: Path) -> Path:
    doc, page = _new_pdf()
    page.insert_text((150, 120), "Dupla difração no detector central", fontsize=18, fontname="tibo")
    page.insert_text((220, 150), "Sara Maria da Costa", fontsize=12, fontname="tiro")
    text = ("Neste trabalho estudamos a dupla difração em colisões de prótons. Os eventos são selecionados pelo "
            "detector central e também comparados com a simulação, para que a análise seja feita com uma amostra "
            "limpa. A seção de choque foi medida entre os dois intervalos de energia e não depende da escolha. ")
    y = _lines(page, 72, 200, ["Resumo"], size=12, font="tibo")
    _lines(page, 72, y + 4, [(text * 2)[i:i + 95] for i in range(0, 2 * len(text), 95)])
    _body_page(doc, text * 4, heading="1 Introdução")
    return _saved(doc, folder, "tese.pdf")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("exports")
    papers = folder / "papers"
    papers.mkdir()
    for make in (make_acl_paper, make_capitals_paper, make_chinese_guide, make_table_page, make_portuguese_thesis):
        make(papers)
    kb = folder / "kb"
    env = clean_env(KB_EMBED_MODEL="none")
    r = run_cli("ingest", {"paths": [str(papers)], "kb_root": str(kb)}, env=env)
    assert r.rc == 0 and r.json["totals"]["added"] == 5, r
    docs = {Path(d["path"]).name: d for d in run_cli("docs", {"kb_root": str(kb)}, env=env).json["docs"]}

    def cite(name: str, fmt: str) -> str:
        r = run_cli("cite", {"doc_ids": [docs[name]["doc_id"]], "format": fmt, "kb_root": str(kb)}, env=env)
        assert r.rc == 0, r
        return r.json["text"]
    return docs, cite


def test_a_paper_in_proceedings_is_inproceedings_with_its_booktitle(exported):
    docs, cite = exported
    assert docs["acl-paper.pdf"]["journal"] == VENUE
    bibtex = cite("acl-paper.pdf", "bibtex")
    assert bibtex.startswith("@inproceedings{") and f"booktitle = {{{VENUE}}}" in bibtex, bibtex
    assert "journal =" not in bibtex
    assert json.loads(cite("acl-paper.pdf", "csl-json"))[0]["type"] == "paper-conference"


def test_an_institution_beside_the_byline_is_not_an_author(exported):
    docs, cite = exported
    assert docs["acl-paper.pdf"]["authors"] == ["Mei Lin", "Oskar Brandt"]
    assert "author = {Lin, Mei and Brandt, Oskar}" in cite("acl-paper.pdf", "bibtex")


def test_a_sici_doi_keeps_its_angle_brackets(exported):
    docs, cite = exported
    assert docs["acl-paper.pdf"]["doi"] == SICI.lower()
    assert f"doi = {{{SICI.lower()}}}" in cite("acl-paper.pdf", "bibtex")


def test_a_title_in_capitals_is_exported_in_title_case_with_its_acronym(exported):
    docs, cite = exported
    title = "Tuner Tests of a Dressed Cavity for the LCLS-II Linac"
    assert docs["capitals.pdf"]["title"] == title
    assert f"title = {{{title}}}" in cite("capitals.pdf", "bibtex")
    assert docs["capitals.pdf"]["authors"] == ["Yara Pinsky", "Sven Adler"]


def test_file_metadata_naming_a_template_is_neither_title_nor_author(exported):
    docs, _ = exported
    guide = docs["guide-zh.pdf"]
    assert guide["title"] == "西南交通大学本科毕业设计撰写规范" and guide["authors"] == [], guide
    assert guide["lang"] == "zh"


def test_a_table_only_page_has_no_authors(exported):
    docs, cite = exported
    assert docs["table-only.pdf"]["authors"] == []
    assert "author =" not in cite("table-only.pdf", "bibtex")


def test_a_portuguese_thesis_is_tagged_portuguese(exported):
    docs, cite = exported
    assert docs["tese.pdf"]["lang"] == "pt"
    assert json.loads(cite("tese.pdf", "csl-json"))[0]["language"] == "pt"
    assert docs["acl-paper.pdf"]["lang"] == "en"


@pytest.mark.internals
def test_journals_named_proceedings_stay_articles(kb_engine):
    proceedings = kb_engine.venue_is_proceedings
    assert proceedings(VENUE) and proceedings("2010 International Conference on Data Storage and Data Engineering")
    assert proceedings("Findings of the Association for Computational Linguistics: EMNLP 2020")
    for journal in ("Proceedings of the National Academy of Sciences", "Proceedings of the IEEE",
                    "Journal of Physics: Conference Series", "IEEE Transactions on Automation Science", None):
        assert not proceedings(journal), journal


@pytest.mark.internals
def test_dois_with_brackets_and_semicolons_are_read_whole_and_html_is_not(kb_engine):
    assert kb_engine.find_doi(f"see doi:{SICI}.") == SICI.lower()
    assert kb_engine.find_doi('<a href="x">10.1000/abc.123</a>') == "10.1000/abc.123"
    assert kb_engine.find_doi("(10.1016/0021-9991(86)90196-1)") == "10.1016/0021-9991(86)90196-1"
