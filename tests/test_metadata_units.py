"""The small rules under the metadata reader, each on the real strings that made it necessary: accents a TeX font
draws apart, bylines with addresses and suffixes, DOIs cut at a line end, citation lines versus footnotes and
reprint notices, Chinese family names, BibTeX names."""
from __future__ import annotations

import pytest

# About the engine's own functions: reaches names outside kb_engine.__all__ (tests/static/test_public_surface.py).
pytestmark = pytest.mark.internals


@pytest.mark.parametrize("raw, expected", [
    ("Fern\u00b4andez", "Fernández"), ("Gonc\u00b8alo", "Gonçalo"), ("Funda\u00b8c\u02dcao", "Fundação"),
    ("M\u00a8uller", "Müller"), ("Tomaˇsev", "Tomašev"), ("Do\u02d8gan", "Doğan"), ("\u02daAkesson", "Åkesson"),
    ("J\u02dbedrzej", "Jędrzej"), ("Meg\u00b4\u0131as", "Megías"), ("Gen`eve", "Genève"),
    ("(\u00afx, y)", "(\u00afx, y)"),         # x-bar has no precomposed letter: the accent stays as drawn
])
def test_spacing_accents_go_onto_their_letters(kb_engine, raw, expected):
    assert kb_engine.compose_spacing_accents(raw) == expected


@pytest.mark.parametrize("line, names", [
    ("Pierre-François Dutot\u2016, Lionel Eyraud\u2016", ["Pierre-François Dutot", "Lionel Eyraud"]),
    ("DARRICK E. CHANG, MARIA LOPEZ-GARCIA AND JOHN MCALLISTER",
     ["Darrick E. Chang", "Maria Lopez-Garcia", "John McAllister"]),
    ("LIU Bingqian", ["Liu Bingqian"]),
    ("Alabsi S1, *Alhadainy HA 2, Darrag AM 2", ["Alabsi S", "Alhadainy HA", "Darrag AM"]),
    ("TAL AUGUST, University of Washington, USA", ["Tal August"]),
    ("Timothy J. Triche, Jr. 0000-0001-5665-946X · ttriche Center for Epigenetics, Van Andel Research Institute",
     ["Timothy J. Triche, Jr."]),
    ("The ATLAS and CMS Collaborations\u2016", ["The ATLAS and CMS Collaborations"]),
    ("张三1, 李四2", ["张三", "李四"]),
])
def test_bylines_give_their_names(kb_engine, line, names):
    assert kb_engine.names_in_text(line) == names


@pytest.mark.parametrize("line", [
    "Zouping County, Binzhou City, Shandong Province, China",
    "38330 Montbonnot Saint-Martin, France",
    "Department of Physics, Hanyang University, Ansan",
    "Dissertação de Mestrado",
    "Orientador: Alberto Franco de Sá Santoro",
    "投资要点 市场表现",
    "The crystal structure of the oxyhalide was determined from single-crystal data at 293 K.",
])
def test_addresses_affiliations_and_prose_are_not_bylines(kb_engine, line):
    assert kb_engine.names_in_text(line) is None


def test_a_doi_cut_at_a_line_end_is_joined_but_running_text_is_not(kb_engine):
    assert kb_engine.join_broken_dois("doi: 10.1371/journal.\npone.0197919 Editor") == \
        "doi: 10.1371/journal.pone.0197919 Editor"
    kept = "see 10.1000/abc123. The next sentence"
    assert kb_engine.join_broken_dois(kept) == kept
    assert kb_engine.join_broken_dois("https://doi.org/10.1063/1.\n2409490") == "https://doi.org/10.1063/1.2409490"


def test_an_arxiv_id_cut_after_its_dot_is_joined(kb_engine):
    assert kb_engine.arxiv_doi("Preprint arXiv:2301.\n05883v2 [nucl-th]") == "10.48550/arxiv.2301.05883"
    assert kb_engine.arxiv_doi("see arXiv:2301. The id is incomplete") is None


def test_the_papers_citation_line_beats_a_reprint_notice_and_a_footnote(kb_engine):
    head = "Annalen für Kristallchemie 49b, 272–276 (1994)\nReceived November 3, 1993"
    banner = "This article was downloaded on 12 March 2008 from the Kristall Digital Archive. © 2008 reprint service"
    assert kb_engine.guess_year(head + "\n" + banner, {}, "x.pdf", None, banner, head) == 1994
    footnote_only = "2 Act for Fiscal Year 2021, Pub. L. No. 116-283, 134 Stat. 3388, 4144 (2021).\nJune 2023"
    # a footnote citing a statute is not the document's own citation line: the dated banner decides
    assert kb_engine.guess_year("", {}, "x.pdf", None, footnote_only, "June 2023") == 2023


def test_fields_lose_control_characters_and_private_use_glyphs(kb_engine):
    meta = kb_engine.DocMeta(title="Speckle\x04 reduction\ue001", authors=["Patrick C. Chaumet\x01", "\x02"],
                             year=2006, journal="Appl.\x7f Opt.", doi="10.1063/1.2409490\x04", lang="en")
    assert meta.title == "Speckle reduction" and meta.authors == ["Patrick C. Chaumet"]
    assert meta.journal == "Appl. Opt." and meta.doi == "10.1063/1.2409490"


@pytest.mark.parametrize("name, bibtex, csl", [
    ("Timothy J. Triche, Jr.", "Triche, Jr., Timothy J.", {"family": "Triche", "given": "Timothy J.", "suffix": "Jr."}),
    ("Alhadainy HA", "Alhadainy, HA", {"family": "Alhadainy", "given": "HA"}),
    ("The ATLAS and CMS Collaborations", "{The ATLAS and CMS Collaborations}",
     {"literal": "The ATLAS and CMS Collaborations"}),
    ("Ana_Maria {Lopez}", "Lopez, Ana\\_Maria", {"family": "{Lopez}", "given": "Ana_Maria"}),
])
def test_names_are_written_the_way_bibtex_and_csl_read_them(kb_engine, name, bibtex, csl):
    assert kb_engine._bibtex_author(name) == bibtex
    assert kb_engine._split_name(name) == csl
