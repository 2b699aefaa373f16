"""Full-text evidence: headings that end the body need evidence, tables never make headings, no body page is
lost; section weights are a bounded prior; topic words find the paper and specific words the page.

The papers are generated here with PyMuPDF (examples/sample_papers.Flow): a meta-analysis whose table has a
"Reference" column header and a cell naming an appendix, a sentence that mentions References, a real
References heading followed by numbered entries, then an appendix. Every page must keep its passages, the
appendix is searchable, and the real list still feeds citation linking.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest

from helpers import db_rows, sp

TITLE = "Soil Warming and Root Respiration: A Meta-Analysis of Field Trials"
INTRO = ("Warming experiments in temperate forests report a wide range of root respiration responses, and "
         "earlier syntheses disagreed on whether acclimation offsets the initial increase [1]. We pooled the "
         "published field trials with a random-effects model and a citedmarker check of every estimate [2].")
METHODS = ("Trials were eligible when they heated the soil in the field for at least one growing season, "
           "measured root respiration separately from heterotrophic respiration and reported a variance. "
           "Effect sizes were log response ratios with methodsmarker weights from the inverse variance.")
RESULTS = [("Across the eleven trials the pooled response ratio was 0.21, equivalent to a twenty three percent "
            "increase in root respiration per four degrees of warming, with resultsmarker heterogeneity that "
            "the site moisture explained better than the warming method."),
           ("References to the individual trials are given in the table and in the appendix, where each "
            "estimate is listed with its confidence interval and the depth at which roots were sampled.")]
DISCUSSION = ("The discussionmarker pattern suggests that acclimation is weaker in wet soils, where roots keep "
              "their carbohydrate supply, and stronger in dry sites, where warming also lowers soil moisture "
              "and so limits the substrate available to root respiration during the summer months.")
APPENDIX = ("Trial-level estimates with appendixmarker precision: the Alder trial contributed the largest weight "
            "because it ran for nine years on four plots, while the two shortest trials had the widest intervals.")
REFERENCES = [
    "[1] Varga I, Lindqvist T. Root respiration under soil warming. Global Change Biology 12 (2010) 45-67.",
    "[2] Okafor N, Brandt K. Acclimation of fine roots to heat. New Phytologist 201 (2014) 112-120.",
    "[3] Haldane P, Ruiz M. A decade of soil heating at Alder. Ecology 95 (2016) 1201-1213.",
    "[4] Moreau L. Random-effects models in ecology. Oikos 118 (2009) 301-309. refentrymarker",
    "[5] Tanaka S, Olsen R. Moisture limits respiration. Plant and Soil 410 (2017) 77-90.",
]


def make_meta_analysis(path, header_size: float, header_font: str) -> None:
    f = sp.Flow(sp.A4)
    f.paragraph(TITLE, font="tibo", size=16, after=6)
    f.line("Ines Varga, Tomas Lindqvist", size=11)
    f.heading("Abstract")
    f.paragraph("We pooled eleven soil warming trials and found a modest, moisture-dependent increase of root "
                "respiration; acclimation was strongest in dry sites and weakest in wet ones.")
    f.heading("1 Introduction")
    f.paragraph(INTRO)
    f.heading("2 Methods")
    f.paragraph(METHODS)
    offsets = [0, 150, 200, 270, 320]
    f.table_row(["Study", "Year", "Reference", "Plots", "Effect"], offsets, font=header_font, size=header_size)
    for row in (["Alder field trial", "2016", "[3]", "4", "0.24"], ["Birch warming site", "2014", "[2]", "3", "0.18"],
                ["Pine heating array", "2010", "[1]", "2", "0.31"]):
        f.table_row(row, offsets)
    f.table_row(["Oak plots", "2017", "Appendix 1, Section 4.5.5)", "2", "0.12"], offsets)
    f.space(10)
    f.new_page()
    f.heading("3 Results")
    for text in RESULTS:
        f.paragraph(text)
    f.new_page()
    f.heading("4 Discussion")
    f.paragraph(DISCUSSION)
    f.heading("References")
    for entry in REFERENCES:
        f.paragraph(entry, size=9)
    f.new_page()
    f.heading("Appendix A Trial-level estimates")
    f.paragraph(APPENDIX)
    f.save(path)


@pytest.fixture(scope="module", params=[(7.5, "tiro"), (10.5, "tibo")], ids=["small-header", "body-size-bold-header"])
def library(request, tmp_path_factory, kb_engine):
    folder = tmp_path_factory.mktemp("headings")
    paper = folder / "meta_analysis.pdf"
    make_meta_analysis(paper, *request.param)
    engine = kb_engine.Engine()
    kb = folder / ".kb"
    with pytest.MonkeyPatch.context() as mp:      # keyword search is enough here: no model is loaded
        mp.setenv("KB_EMBED_MODEL", "none")
        ingest = engine.execute("ingest", {"paths": [str(paper)], "kb_root": str(kb)})
    yield engine, kb, ingest
    engine.close()


@contextlib.contextmanager
def keyword_library(kb_engine, flow, paper):
    """``flow`` saved as ``paper`` and ingested without a model: (engine, kb root)."""
    flow.save(paper)
    engine = kb_engine.Engine()
    kb = paper.parent / ".kb"
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("KB_EMBED_MODEL", "none")
            engine.execute("ingest", {"paths": [str(paper)], "kb_root": str(kb)})
        yield engine, kb
    finally:
        engine.close()


def keyword(engine, kb, query, **payload):
    return engine.execute("search", {"query": query, "kb_root": str(kb), "mode": "keyword", **payload})["results"]


def test_every_page_keeps_passages(library):
    engine, kb, ingest = library
    entry = ingest["files"][0]
    assert entry["status"] == "added" and "note" not in entry, entry
    doc = engine.execute("docs", {"kb_root": str(kb)})["docs"][0]
    coverage = doc["page_coverage"]
    assert coverage["text_pages"] == 4
    assert coverage["without_chunks"] == [] and coverage["pages_with_chunks"] == 4, coverage
    pages = {p for (raw,) in db_rows(kb, "SELECT page_map FROM chunks") for _, p, *_ in json.loads(raw)}
    assert pages == {1, 2, 3, 4}


@pytest.mark.parametrize("token,page,section", [
    ("methodsmarker", 1, "Methods"), ("resultsmarker", 2, "Results"), ("discussionmarker", 3, "Discussion"),
    ("appendixmarker", 4, "Appendix A Trial-level estimates")])
def test_body_after_misleading_words_is_searchable_in_its_section(library, token, page, section):
    engine, kb, _ = library
    hits = keyword(engine, kb, token)
    assert hits, f"{token} was dropped from the index"
    assert hits[0]["page"] == page and hits[0]["section"] == section, hits[0]


def test_table_cells_are_content_not_headings(library):
    engine, kb, _ = library
    sections = {s for (s,) in db_rows(kb, "SELECT DISTINCT section FROM chunks")}
    assert not any("Reference" in s or s.startswith("Appendix 1") for s in sections), sections
    hits = keyword(engine, kb, "Pine heating array")
    assert hits and hits[0]["page"] == 1 and hits[0]["section"] == "Methods", hits[:1]


def test_real_reference_list_feeds_citations_and_stays_out_of_search(library):
    engine, kb, _ = library
    refs = db_rows(kb, "SELECT num, first_author, year FROM refs ORDER BY num")
    assert [r[0] for r in refs] == [1, 2, 3, 4, 5]
    assert refs[1][2] == 2014
    assert keyword(engine, kb, "refentrymarker") == []
    hit = keyword(engine, kb, "citedmarker", depth="deep")[0]
    assert hit["section"] == "Introduction"
    assert [c["ref"] for c in hit["citations"]] == [1, 2], hit["citations"]
    assert hit["citations"][1]["text"].startswith("Okafor N, Brandt K")


@pytest.mark.internals
def test_appendix_ranks_below_an_equal_body_passage(kb_engine):
    # the appendix weight is a prior below 1: it only loses a near-tie
    ranked = kb_engine.with_section_prior([(1, 10.0), (2, 10.0)], {1: kb_engine.SECTION_WEIGHTS["appendix"], 2: 1.0},
                                          gap=1.0)
    assert [cid for cid, _ in ranked] == [2, 1]


# -- Chinese ---------------------------------------------------------------------------------------------

def test_chinese_reference_heading_closes_the_body_and_feeds_citations(tmp_path, engine, monkeypatch):
    monkeypatch.setenv("KB_EMBED_MODEL", "none")
    paper = sp.make_chinese_paper(tmp_path)
    kb = tmp_path / ".kb"
    engine.execute("ingest", {"paths": [str(paper)], "kb_root": str(kb)})
    refs = db_rows(kb, "SELECT COUNT(*) FROM refs")[0][0]
    assert refs == len(sp._CHINESE_REFERENCES)
    sections = [s for (s,) in db_rows(kb, "SELECT section FROM chunks ORDER BY seq")]
    assert "参考文献" not in sections and any(s.startswith("结论") for s in sections), sections
    doc = engine.execute("docs", {"kb_root": str(kb)})["docs"][0]
    lost = [p for p in doc["page_coverage"]["without_chunks"] if p["reason"] not in ("references",)]
    assert lost == [], doc["page_coverage"]


# -- the same rules on Markdown (no typography: the content decides) -------------------------------------

@pytest.mark.internals
def test_markdown_references_heading_followed_by_prose_is_not_a_reference_list(kb_engine, tmp_path):
    note = tmp_path / "note.md"
    note.write_text("# Field notes\n\n## Methods\n\nWe sampled twelve plots.\n\n## References\n\n"
                    "The references we relied on most were the regional soil survey maps, which our team checked "
                    "against drone imagery in every plot before the sampling campaign of the second season started.\n",
                    encoding="utf-8")
    chunks = kb_engine.chunk_document(kb_engine.extract_file(str(note)))
    assert any("drone imagery" in c.text for c in chunks), [c.section for c in chunks]


@pytest.mark.internals
def test_markdown_references_heading_followed_by_entries_stays_out(kb_engine, tmp_path):
    note = tmp_path / "paper.md"
    note.write_text("# A paper\n\n## Results\n\nThe effect was large [1].\n\n## References\n\n"
                    "1. Smith J, Doe A. Effects of heat on roots. Journal of Ecology 12 (2010) 45-67.\n\n"
                    "2. Lee K. Moisture and respiration. Plant and Soil 33 (2012) 1-9.\n", encoding="utf-8")
    extracted = kb_engine.extract_file(str(note))
    chunks = kb_engine.chunk_document(extracted)
    assert not any("Journal of Ecology" in c.text for c in chunks)
    assert len(extracted.references) == 2


# -- section weights are a prior ---------------------------------------------------------------------------

@pytest.mark.internals
@pytest.mark.parametrize("long_docs", [False, True], ids=["short-documents", "long-document"])
def test_hybrid_keeps_the_chunk_both_halves_rank_first_over_an_abstract_ranked_third(kb_engine, long_docs):
    answer, other, abstract = 11, 12, 13
    weights = {answer: 1.0, other: 1.0, abstract: kb_engine.SECTION_WEIGHTS["abstract"]}
    keyword = [(answer, 14.2), (other, 13.9), (abstract, 13.5)] + [(20 + i, 12.0 - i) for i in range(8)]
    vector = [(answer, 0.81), (other, 0.80), (abstract, 0.79)] + [(40 + i, 0.7 - i / 100) for i in range(8)]
    fused = kb_engine.fuse_halves(keyword, vector, weights, {answer, other, abstract} if long_docs else set())
    assert fused[0][0] == answer
    assert [cid for cid, _ in fused].index(abstract) >= 1     # it may pass its neighbour, never the answer


@pytest.mark.internals
def test_section_prior_breaks_a_near_tie_but_never_a_clear_lead(kb_engine):
    weights = {1: 1.0, 2: 1.0, 3: kb_engine.SECTION_WEIGHTS["abstract"]}
    tail = [(10 + i, 5.0 - i / 2) for i in range(8)]
    near_tie = kb_engine.with_section_prior([(1, 9.0), (3, 8.99), (2, 8.0)] + tail, weights, 0.5)
    assert near_tie[0][0] == 3
    clear = kb_engine.with_section_prior([(1, 9.0), (2, 8.0), (3, 7.0)] + tail, weights, 0.5)
    assert clear[0][0] == 1


@pytest.mark.internals
@pytest.mark.parametrize("spread", [0.002, 0.05])
def test_vector_only_prior_scales_with_the_models_cosines(kb_engine, spread):
    # bunched cosines (a model like e5: 0.80, 0.798, ...) or spread ones: the abstract ranked third by the
    # evidence may pass its neighbour but never the chunk ranked first
    scored = [(1, 0.80), (2, 0.80 - spread), (3, 0.80 - 2 * spread)] + [(10 + i, 0.80 - (3 + i) * spread)
                                                                          for i in range(10)]
    weights = {cid: 1.0 for cid, _ in scored}
    weights[3] = kb_engine.SECTION_WEIGHTS["abstract"]
    ranked = kb_engine.with_section_prior(scored, weights, kb_engine.neighbour_gap([s for _, s in scored]))
    assert ranked[0][0] == 1
    assert [cid for cid, _ in ranked].index(3) <= 2


# -- document-aware word weights: topic words find the paper, specific words the page ----------------------

BAS_SECTIONS = {
    "Introduction": "Cubic boron arsenide is a semiconductor with an unusually high lattice thermal conductivity. "
                    "Earlier boron arsenide crystals were small and full of defects, which hid the intrinsic phonon "
                    "behaviour of the lattice.",
    "Methods": "We grew boron arsenide crystals by chemical vapour transport and measured them with time-domain "
               "thermoreflectance. Each boron arsenide sample was polished and coated with an aluminium transducer.",
    "Sample growth": "The boron arsenide growth ran for two weeks at 800 degrees with iodine as the transport agent. "
                     "Boron arsenide boules were cleaved along the cubic faces before measurement.",
    "Thermal transport": "Thermal conductivity of boron arsenide was extracted from the thermoreflectance phase. The "
                         "boron arsenide lattice carried heat mainly through acoustic phonon modes at room "
                         "temperature.",
    "Results": "Below one kelvin the boron arsenide samples were cooled in a dilution refrigerator, which reached a "
               "base temperature of 40 millikelvin during the boron arsenide runs.",
    "Phonon scattering": "Four-phonon scattering in boron arsenide limits the conductivity at high temperature. The "
                         "boron arsenide phonon lifetimes fell with temperature as the calculation predicted.",
    "Defects": "Arsenic vacancies in boron arsenide scatter phonons strongly. The best boron arsenide crystals had "
               "vacancy densities below ten to the seventeen per cubic centimetre.",
    "Comparison with silicon": "Compared with silicon, boron arsenide conducts heat about eight times better at room "
                               "temperature, which makes boron arsenide attractive for heat spreaders.",
    "Discussion": "The boron arsenide results agree with first-principles predictions once four-phonon processes are "
                  "included in the boron arsenide lattice model.",
    "Conclusion": "Large clean boron arsenide crystals confirm the high lattice thermal conductivity predicted for "
                  "boron arsenide.",
}
BAS_ABSTRACT = ("We measure the lattice thermal conductivity of cubic boron arsenide crystals from millikelvin "
                "temperature to room temperature and find phonon transport limited by four-phonon scattering in the "
                "boron arsenide lattice.")
OTHER_TOPICS = ["coral reef bleaching under marine heatwaves", "graphene growth on copper foil",
                "protein folding in the ribosome tunnel", "lithium electrolyte interphase growth",
                "arctic tern migration routes"]


@pytest.mark.internals
def test_topic_words_find_the_paper_and_specific_words_the_page(kb_engine, engine, tmp_path, monkeypatch):
    monkeypatch.setenv("KB_EMBED_MODEL", "none")
    papers = tmp_path / "papers"
    papers.mkdir()
    (papers / "boron_arsenide.md").write_text(
        "# Heat Flow in Cubic Boron Arsenide Crystals\n\n## Abstract\n\n" + BAS_ABSTRACT + "\n\n"
        + "".join(f"## {head}\n\n{text}\n\n" for head, text in BAS_SECTIONS.items()), encoding="utf-8")
    for i, topic in enumerate(OTHER_TOPICS):      # other papers, so the topic words are rare in the library
        (papers / f"other{i}.md").write_text(
            f"# A study of {topic}\n\n## Abstract\n\nWe report measurements of {topic} over three seasons, with the "
            f"base temperature logged at each site.\n\n## Results\n\nThe {topic} measurements showed a clear trend "
            "in temperature and a weak effect of site.\n", encoding="utf-8")
    kb = str(tmp_path / ".kb")
    engine.execute("ingest", {"paths": [str(papers)], "kb_root": kb})
    question = ("what millikelvin base temperature was reached in the boron arsenide lattice thermal conductivity "
                "phonon measurements")

    def ranking():
        hits = engine.execute("search", {"query": question, "kb_root": kb, "mode": "keyword",
                                         "cache": False})["results"]
        return [(h["section"], h["score"]) for h in hits[:3]]

    share = kb_engine.TOPIC_WORD_SHARE
    monkeypatch.setattr(kb_engine, "TOPIC_WORD_SHARE", 1.0)        # every word counts in full: plain BM25
    plain = ranking()
    assert plain[0][0] == "Abstract"            # the abstract names every topic word of the question
    monkeypatch.setattr(kb_engine, "TOPIC_WORD_SHARE", share)
    aware = ranking()
    assert aware[0][0] == "Results"             # the page that answers it
    assert [s for s, _ in aware[:3]] == ["Results", "Abstract", plain[2][0]]   # only the two traded places


# -- numbered lists in the second half: procedure steps are body, a bibliography without heading is not ------

STEPS = [
    "1. Open the console and connect to the partition as the security officer before any change is made.",
    "2. Run the statement that creates the row permission on the employee table, then review the stepsmarker log.",
    "3. Create the column mask for the tax number so that managers see only the last four digits of it.",
    "4. Activate row and column access control on the table and check that queries return the masked values.",
]
CLOSING = ("After activation every query, view and report sees the same rules, so no application needs to change; "
           "the closingmarker audit journal records who read the masked columns and when.")
APS_ENTRIES = [
    "[1] J. M. Grames and C. K. Sinclair, Phys. Rev. C 102, 015501 (2020).",
    "[2] E. Offermann, L. Cardman, and C. de Jager, Phys. Rev. C 44, 1096 (1991).",
    "[3] W. R. Johnson and C. O. Carroll, Phys. Rev. A 75, 032511 (2007). apsentrymarker",
    "[4] F. Salvat, J. D. Martinez, and R. Mayol, Comput. Phys. Commun. 165, 157 (2005).",
]


def sections_on_pages(title: str, topics: tuple[str, ...], text: str) -> sp.Flow:
    """A paper whose numbered sections (one paragraph of ``text`` each) fill a page each; the flow goes on."""
    f = sp.Flow(sp.A4)
    f.paragraph(title, font="tibo", size=16, after=6)
    for n, topic in enumerate(topics):
        f.heading(f"{n + 1} {topic}")
        f.paragraph(f"Section {n + 1}: {text} " * 2)
        f.new_page()
    return f


MANUAL_TEXT = ("access rules belong in the database: views and application checks can be bypassed by any tool "
               "that reads the tables directly, while rules attached to the table apply to every interface.")
LETTER_TEXT = ("the polarised beam measurements [1] were compared with the phase-shift calculations [2], using the "
               "Uehling potential for vacuum polarisation [3] and the partial-wave code of the Barcelona group [4].")


def letter(sections: tuple[str, ...] = ("Introduction", "Potentials", "Results")) -> sp.Flow:
    return sections_on_pages("Radiative Corrections to Elastic Electron Scattering", sections, LETTER_TEXT)


def make_manual_with_steps(path) -> None:
    f = sections_on_pages("Row and Column Access Control in Practice",
                          ("Why rules belong in the table", "Special registers", "Global variables"), MANUAL_TEXT)
    f.heading("4 Implementing the rules")
    for step in STEPS:
        f.paragraph(step)
    f.new_page()
    f.heading("5 After activation")
    f.paragraph(CLOSING)
    f.save(path)


def make_letter_with_aps_list(path) -> None:
    f = letter()
    for entry in APS_ENTRIES:          # the list closes the paper without a References heading
        f.paragraph(entry, size=9)
    f.save(path)


@pytest.fixture(scope="module")
def numbered_lists(tmp_path_factory, kb_engine):
    folder = tmp_path_factory.mktemp("numbered")
    make_manual_with_steps(folder / "manual.pdf")
    make_letter_with_aps_list(folder / "letter.pdf")
    engine = kb_engine.Engine()
    kb = folder / ".kb"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KB_EMBED_MODEL", "none")
        engine.execute("ingest", {"paths": [str(folder)], "kb_root": str(kb)})
    yield engine, kb
    engine.close()


def test_numbered_steps_late_in_a_document_stay_body_text(numbered_lists):
    engine, kb = numbered_lists
    doc = next(d for d in engine.execute("docs", {"kb_root": str(kb)})["docs"] if d["path"].endswith("manual.pdf"))
    assert doc["page_coverage"]["without_chunks"] == [], doc["page_coverage"]
    top = [(h["page"], h["section"]) for h in keyword(engine, kb, "stepsmarker")][:1]
    assert top == [(4, "Implementing the rules")]
    assert keyword(engine, kb, "closingmarker")[0]["page"] == 5
    refs = db_rows(kb, "SELECT COUNT(*) FROM refs r JOIN docs d ON d.id = r.doc_id WHERE d.path LIKE '%manual.pdf'")
    assert refs == [(0,)]


def test_a_bibliography_without_heading_still_feeds_citations(numbered_lists):
    engine, kb = numbered_lists
    refs = db_rows(kb, "SELECT r.num FROM refs r JOIN docs d ON d.id = r.doc_id WHERE d.path LIKE '%letter.pdf' "
                       "ORDER BY r.num")
    assert [num for num, in refs] == [1, 2, 3, 4]
    assert keyword(engine, kb, "apsentrymarker") == []          # the list is not searchable text
    hit = keyword(engine, kb, "Uehling potential vacuum polarisation", depth="deep")[0]
    assert [c["ref"] for c in hit["citations"]] == [1, 2, 3, 4], hit["citations"]
    assert hit["citations"][2]["text"].startswith("W. R. Johnson and C. O. Carroll")


CORPUS = os.environ.get("KB_CORPUS_DIR")


@pytest.mark.internals
@pytest.mark.skipif(not CORPUS, reason="set KB_CORPUS_DIR to the shared corpus folder")
@pytest.mark.parametrize("name,entries", [
    ("docling/redp5110_sampled.pdf", 0),                 # numbered procedure steps in chapter 3
    ("pdfplumber/federal-register-2020-17221.pdf", 0),   # numbered clauses of a rule
    ("unstructured/layout-parser-paper-fast.pdf", 0),    # a numbered list of contributions
    ("docling/multi_page.pdf", 0),                       # a numbered list of features
    ("refextract/2301.05883.pdf", 33),                   # an APS list without heading
    ("unstructured/failure-after-repair.pdf", 3),        # three numbered entries without heading
])
def test_real_numbered_lists_without_heading(kb_engine, name, entries):
    extracted = kb_engine.extract_pdf(str(Path(CORPUS) / name))
    assert len(extracted.references) == entries
    if not entries:
        assert not [b for b in extracted.blocks if b.role == "reference"]


def test_prose_between_the_entries_of_a_headingless_list_stays_searchable(kb_engine, tmp_path):
    """A two-column letter: the list's first entries close the left column, and the right column goes on with
    the conclusions before the rest of the list. In reading order prose sits between entries; it is body text."""
    f = letter()
    f.new_page(columns=2)
    f.heading("4 Conclusions")
    f.paragraph("The corrections grow with the momentum transfer and with the nuclear charge.")
    for entry in APS_ENTRIES[:2]:
        f.paragraph(entry, size=9)
    f.advance()                         # the right column
    f.paragraph("For lead the conclusionmarker shift of the cross section reaches several percent at backward "
                "angles, which the next generation of parity experiments will have to take into account when they "
                "extract the weak charge from the measured asymmetry.")
    for entry in APS_ENTRIES[2:]:
        f.paragraph(entry, size=9)
    with keyword_library(kb_engine, f, tmp_path / "letter.pdf") as (engine, kb):
        hits = keyword(engine, kb, "conclusionmarker")
        assert [(h["page"], h["section"]) for h in hits] == [(5, "Conclusions")]
        assert [num for num, in db_rows(kb, "SELECT num FROM refs ORDER BY num")] == [1, 2, 3, 4]
        assert keyword(engine, kb, "apsentrymarker") == []


@pytest.mark.internals
@pytest.mark.skipif(not CORPUS, reason="set KB_CORPUS_DIR to the shared corpus folder")
@pytest.mark.parametrize("name,paragraph,entries", [
    ("refextract/1508.05632v2.pdf", "The sgoldstino production cross-section, which originates", 53),
    ("grobid/1001._0908.0054.pdf", "The most promising and physically interesting feature", 16),
])
def test_conclusions_set_beside_a_headingless_list_stay_body(kb_engine, name, paragraph, entries):
    extracted = kb_engine.extract_pdf(str(Path(CORPUS) / name))
    assert [b.role for b in extracted.blocks if b.text.startswith(paragraph)] == ["body"]
    assert len(extracted.references) == entries


# -- headings are phrases of words ----------------------------------------------------------------------

@pytest.mark.internals
@pytest.mark.parametrize("text,heading", [
    ("T = 500 MeV", False), ("Ia = 2", False), ("VGS,1 = VGS,2 + VDS,9", False), ("ΨW = Ψ ◦W (14)", False),
    ("TABLEFORMER: 5:02", False), ("Screwed Up 5:02", False), ("Nf", False), ("OF", False), ("QW0", False),
    ("Likert ∼Reencountered + Specter + Global", False), ("HasAsthma(x) ⇒LowerRisk(x)", False),
    ("Θψ2 θl", False), ("Z f m", False), ("E Z 1:0 k", False),                   # symbols of display formulas
    ("ALTER TABLE BANK_SCHEMA.CUSTOMERS", False), ("CHGFCNUSG FCNID(QIBM_DB_SECADM)", False),   # code
    ("2.1 Results", True), ("A Proofs", True), ("Phase 2", True), ("The Modern Era (1990s - Present)", True),
    ("实验", True), ("Results", True),
])
def test_formulas_and_figure_values_are_not_headings(kb_engine, text, heading):
    assert bool(kb_engine.looks_like_heading(text, 12.0, True, 1, 10.5)) is heading


@pytest.mark.parametrize("title,section,before,strays,after", [
    ("Heavy Quarks in a Hot Medium", "Results",
     "The drag coefficient was computed at several temperatures of the quark-gluon plasma.",
     [("T = 500 MeV", 12)],                                          # a bold display line in the results
     "At this temperature the straymarker drag is twice the value found near the transition."),
    ("Recurrent Models of Patient Deterioration", "Model",
     "The network reads vital signs every hour and predicts deterioration over the next day.",
     [("Deep Recurrent Neural Network", 6), ("RNN params", 6)],      # bold labels inside the model's figure
     "Its hidden state has straymarker sixty units and is trained with dropout on the inputs."),
], ids=["display-formula", "small-figure-labels"])
def test_a_bold_line_that_is_no_heading_does_not_rename_the_section(kb_engine, tmp_path, title, section, before,
                                                                     strays, after):
    f = sp.Flow(sp.A4)
    f.paragraph(title, font="tibo", size=16, after=6)
    f.heading("1 Introduction")
    f.paragraph("The problem is introduced here, with the earlier work it builds on and what is new in it.")
    f.heading(f"2 {section}")
    f.paragraph(before)
    for text, size in strays:
        f.paragraph(text, font="tibo", size=size)
    f.paragraph(after)
    with keyword_library(kb_engine, f, tmp_path / "paper.pdf") as (engine, kb):
        assert [h["section"] for h in keyword(engine, kb, "straymarker")] == [section]


def test_a_notes_file_ending_in_numbered_steps_keeps_them(engine, tmp_path, monkeypatch):
    """Notes often end with a numbered procedure; it is text to search, not a bibliography."""
    monkeypatch.setenv("KB_EMBED_MODEL", "none")
    notes = tmp_path / "cryostat_notes.md"
    notes.write_text(
        "# Lab notes: running the cryostat\n\n## Background\n\nThe dilution refrigerator needs a careful cool-down; "
        "these notes collect what worked for our group over two years of runs.\n\n## Procedure\n\n"
        "1. Pump the inner vacuum can for at least twelve hours before any helium transfer.\n"
        "2. Pre-cool with liquid nitrogen until the still plate reads below eighty kelvin.\n"
        "3. Transfer helium slowly and watch the stepsmarker pressure gauge on the mixture line.\n"
        "4. Start circulation once the mixing chamber falls below four kelvin.\n", encoding="utf-8")
    kb = tmp_path / ".kb"
    engine.execute("ingest", {"paths": [str(notes)], "kb_root": str(kb)})
    assert [h["section"] for h in keyword(engine, kb, "stepsmarker")] == ["Procedure"]
    assert db_rows(kb, "SELECT COUNT(*) FROM refs") == [(0,)]


@pytest.mark.internals
@pytest.mark.parametrize("text,size,heading", [
    ("RNN params", 5.2, False), ("ATLAS 0.11) GeV", 7.2, False), ("CPP Conference", 7.5, False),
    ("Protocol Operation", 7.4 * 1.1, True),        # small capitals: about 0.8 of the body size
    ("Simulation Results", 10.5, True), ("References", 7.0, True),   # known names have their own test
])
def test_bold_labels_in_small_print_are_not_headings(kb_engine, text, size, heading):
    assert bool(kb_engine.looks_like_heading(text, size, True, 1, 10.5)) is heading


# -- running heads set low on the page (theses, reports) ------------------------------------------------

THESIS_CHAPTERS = [
    ("Introduction", [("1.1 Related Systems", "relatedmarker"), ("1.2 Open Problems", "openmarker")]),
    ("Design", [("2.1 The Allocator", "allocatormarker"), ("2.2 Page Tables", "pagetablemarker")]),
]


def make_thesis_with_low_running_heads(path: Path) -> None:
    """Two unnumbered front pages, then chapters whose pages carry "N ... Chapter" (even) and "Section ... N" (odd)
    running heads about 10% down the page, below the usual margin band; printed number = physical page - 2."""
    import pymupdf
    f = sp.Flow(sp.A4, margins=(72, 72, 120, 72), page_numbers=False)
    f.paragraph("Range Addresses for Capability Hardware", font="tibo", size=20, after=10)
    f.line("A progression report", size=12)
    f.new_page()
    f.heading("Contents")
    f.line("1 Introduction 1", size=11)
    f.line("2 Design 5", size=11)
    in_force, chapter_openings = {}, set()       # physical page (0-based) -> (chapter, section) at its end
    for number, (chapter, sections) in enumerate(THESIS_CHAPTERS, start=1):
        f.new_page()
        chapter_openings.add(f.page)
        f.paragraph(f"Chapter {number}", font="tibo", size=24, after=4)
        f.paragraph(chapter, font="tibo", size=24, after=12)
        for section, marker in sections:
            f.paragraph(section, font="tibo", size=15, after=6)
            for n in range(30):
                f.paragraph(f"Paragraph {n} of this section discusses {marker if n == 20 else 'the design'} "
                            "of translation buffers, the reach of huge pages and the cost of a page walk on "
                            "each miss, with measurements taken on the prototype board over several runs.")
                in_force[f.page] = (chapter, section)
    flow_path = path.with_suffix(".flow.pdf")
    f.save(flow_path)
    doc = pymupdf.open(flow_path)
    for pno, page in enumerate(doc):
        if pno < 2 or pno in chapter_openings:       # no running head on a chapter's first page
            continue
        chapter, section = in_force[pno]
        printed = str(pno + 1 - 2)
        left, right = (printed, chapter) if (pno + 1 - 2) % 2 == 0 else (section, printed)
        page.insert_text((72, 86), left, fontname="tiro", fontsize=12)
        page.insert_text((523 - pymupdf.get_text_length(right, "tiro", 12), 86), right, fontname="tiro", fontsize=12)
    doc.save(path)


@pytest.mark.internals
def test_low_running_heads_are_dropped_and_numbered_headings_kept(kb_engine, tmp_path):
    paper = tmp_path / "thesis.pdf"
    make_thesis_with_low_running_heads(paper)
    pages = kb_engine.page_texts(str(paper))
    assert sum(text.count("Open Problems") for text in pages) == 1, "a running head stayed in the page text"
    assert len(pages) >= 8 and not any(text.lstrip()[:2] in ("4\n", "6\n", "4 ", "6 ") for text in pages)
    extracted = kb_engine.extract_pdf(str(paper))
    headings = [b.text for b in extracted.blocks if b.role == "heading"]
    for _, sections in THESIS_CHAPTERS:
        for section, _ in sections:
            assert section in headings
    engine = kb_engine.Engine()
    kb = tmp_path / ".kb"
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("KB_EMBED_MODEL", "none")
            engine.execute("ingest", {"paths": [str(paper)], "kb_root": str(kb)})
        for _, sections in THESIS_CHAPTERS:
            for section, marker in sections:
                found = keyword(engine, kb, marker)
                assert found and found[0]["section"].endswith(section.split(" ", 1)[1]), (marker, found[:1])
    finally:
        engine.close()


@pytest.mark.internals
def test_lettered_parts_after_the_references_are_appendices_with_their_own_names(kb_engine, tmp_path):
    """Prose left under the References heading hands back to the last body section; the lettered parts that
    follow are still appendices, named after themselves, not subsections of the Conclusion."""
    f = sp.Flow(sp.A4)
    f.paragraph("Bounds for Sparse Recovery", font="tibo", size=16, after=6)
    f.heading("1 Introduction")
    f.paragraph("Sparse recovery asks for the fewest measurements that identify a signal with few non-zero entries.")
    f.heading("2 Conclusion")
    f.paragraph("The bounds close the gap left open by earlier work for every sparsity level considered here.")
    f.heading("References")
    for entry in REFERENCES:
        f.paragraph(entry, size=9)
    f.paragraph("The code that reproduces every figure of this paper is available from the authors on request, "
                "together with the random seeds and the raw measurement matrices used in the experiments.")
    f.heading("A Proofs of the bounds")
    f.paragraph("The upper bound follows from a union bound over all supports, as the proofmarker argument shows.")
    f.heading("A.1 The lower bound", size=10.5)
    f.paragraph("The lowermarker bound uses a packing of sparse vectors and Fano's inequality on that packing.")
    f.heading("B Extra results")
    f.paragraph("Further extramarker experiments with structured matrices confirm the same scaling in practice.")
    with keyword_library(kb_engine, f, tmp_path / "bounds.pdf") as (engine, kb):
        sections = {marker: keyword(engine, kb, marker)[0]["section"]
                    for marker in ("proofmarker", "lowermarker", "extramarker")}
        weights = db_rows(kb, "SELECT DISTINCT weight FROM chunks WHERE text LIKE '%lowermarker%' "
                              "OR text LIKE '%extramarker%'")
    assert sections == {"proofmarker": "Proofs of the bounds", "lowermarker": "Proofs of the bounds > The lower bound",
                        "extramarker": "Extra results"}
    assert weights == [(kb_engine.SECTION_WEIGHTS["appendix"],)]      # appendix parts, not the Conclusion
