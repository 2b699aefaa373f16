"""Section labels a citation can trust (issue 28): headings from the document's own typography, run-in headings,
the PDF's outline, numbering ladders, and what is never a heading (table headers, publisher boxes, running heads
with an author's name, text over a figure). Every PDF here is generated with PyMuPDF; each test reads the labels
the engine gives the passages (``chunk_document``) or the blocks' roles.

The benchmark of real papers, labelled by hand, is ``benchmarks/section_headings.jsonl`` (``eval_sections.py``).
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pymupdf
import pytest

from helpers import ROOT, sp

sys.path.insert(0, str(ROOT / "benchmarks"))
import eval_sections  # noqa: E402  (the benchmark's own loader and matcher)

# About the engine's own functions: reaches names outside kb_engine.__all__ (tests/static/test_public_surface.py).
pytestmark = pytest.mark.internals

BODY = ("The samples were prepared from the same batch and measured on three separate days, with the "
        "instrument calibrated each morning against the reference standard before any reading was taken.")


class Page:
    """A page written top to bottom: lines in a font, size and colour, paragraphs wrapped to the width."""

    def __init__(self, doc: pymupdf.Document, left: float = 72, width: float = 451):
        self.page = doc.new_page(width=595, height=842)
        self.writers: dict[tuple, pymupdf.TextWriter] = {}
        self.left, self.width, self.y = left, width, 80.0

    def _writer(self, color) -> pymupdf.TextWriter:
        key = tuple(color)
        if key not in self.writers:
            self.writers[key] = pymupdf.TextWriter(self.page.rect, color=color)
        return self.writers[key]

    def text(self, x: float, text: str, font: str = "tiro", size: float = 10.5, color=(0, 0, 0)):
        self._writer(color).append((x, self.y + size), text, font=sp._font(font), fontsize=size)

    def line(self, text: str, font: str = "tiro", size: float = 10.5, color=(0, 0, 0), before: float = 0.0,
             after: float = 4.0, x: float | None = None):
        self.y += before
        self.text(self.left if x is None else x, text, font, size, color)
        self.y += size * 1.3 + after

    def paragraph(self, text: str, font: str = "tiro", size: float = 10.5, lead: tuple | None = None,
                  after: float = 6.0):
        """Wrapped lines; ``lead`` = (text, font) sets the paragraph's first words in another face."""
        words, x = text.split(), self.left
        if lead:
            lead_text, lead_font = lead
            self.text(x, lead_text, lead_font, size)
            x += sp._width(lead_font, lead_text + " ", size)
        line = ""
        while words:
            candidate = (line + " " + words[0]).strip()
            if sp._width(font, candidate, size) > self.left + self.width - x:
                self.text(x, line, font, size)
                self.y += size * 1.3
                x, line = self.left, ""
                continue
            line = candidate
            words.pop(0)
        if line:
            self.text(x, line, font, size)
            self.y += size * 1.3
        self.y += after

    def finish(self):
        for writer in self.writers.values():
            writer.write_text(self.page)


def labels_of(kb_engine, path: Path) -> list[str]:
    """The section labels of the document's passages, in reading order, each once."""
    chunks = kb_engine.chunk_document(kb_engine.extract_file(str(path)))
    return list(dict.fromkeys(c.section for c in chunks))


def build(path: Path, pages) -> Path:
    """``pages``: callables that each fill one Page."""
    doc = pymupdf.open()
    for fill in pages:
        page = Page(doc)
        fill(page)
        page.finish()
    doc.save(str(path))
    return path


def title_block(p: Page, title: str = "Moisture Uptake in Pressed Cellulose Boards"):
    p.line(title, "tibo", 17, after=10)
    p.line("Anna Berg and Carl Dahl", "tiro", 11, after=14)


def section(p: Page, heading: str, font: str = "tibo", size: float = 12.0, text: str = BODY, before: float = 6.0):
    """A heading and a paragraph under it."""
    p.line(heading, font, size, before=before)
    p.paragraph(text)


# -- a level of bold subsections at body size (BMC articles) ----------------------------------------------

def test_bold_subsections_at_body_size_are_a_level_of_their_own(kb_engine, tmp_path):
    def page_one(p):
        title_block(p)
        section(p, "Background", size=12.5)
        p.line("Methods", "tibo", 12.5, before=6)
        for name in ("Setting", "Participants", "Interviews", "Ethical considerations"):
            section(p, name, size=10.5, text=f"{name} token paragraph. " + BODY, before=3)
        section(p, "Results", size=12.5)
    labels = labels_of(kb_engine, build(tmp_path / "bmc.pdf", [page_one]))
    for name in ("Setting", "Participants", "Interviews", "Ethical considerations"):
        assert f"Methods > {name}" in labels, labels
    assert "Results" in labels and "Background" in labels


# -- all-caps headings -------------------------------------------------------------------------------------

def test_all_caps_headings_in_the_text_face_are_found_by_their_shared_style(kb_engine, tmp_path):
    def page_one(p):
        title_block(p)
        for name in ("INTRODUCTION", "SAMPLE GROWTH", "OPTICAL SET-UP", "FINDINGS"):
            section(p, name, "tiro", 10.5, before=8)
    labels = labels_of(kb_engine, build(tmp_path / "caps.pdf", [page_one]))
    assert {"Introduction", "Sample Growth", "Optical Set-up", "Findings"} <= set(labels), labels


# -- a table's bold header row ---------------------------------------------------------------------------

def test_a_tables_bold_header_row_is_content_not_a_heading(kb_engine, tmp_path):
    def page_one(p):
        title_block(p)
        section(p, "1 Introduction")
        section(p, "2 Results")
        for cells, font in ([("Method", 0), ("Recall", 150), ("Precision", 260)], "tibo"), \
                           ([("Baseline", 0), ("0.61", 150), ("0.58", 260)], "tiro"), \
                           ([("Ours", 0), ("0.74", 150), ("0.71", 260)], "tiro"), \
                           ([("Oracle", 0), ("0.93", 150), ("0.90", 260)], "tiro"):
            for text, dx in cells:
                p.text(p.left + dx, text, font, 10.5)
            p.y += 16
        p.y += 8
        p.line("Name Value", "tibo", 10.5)
        p.line("alpha 1.5", "tiro", 10.5)
        p.line("beta 0.1", "tiro", 10.5)
        p.paragraph("After the table. " + BODY)
        section(p, "3 Discussion")
    labels = labels_of(kb_engine, build(tmp_path / "table.pdf", [page_one]))
    assert labels[-3:] == ["Introduction", "Results", "Discussion"] or set(labels) <= {
        "", "Front matter", "Introduction", "Results", "Discussion"}, labels


# -- a publisher's box, a banner -----------------------------------------------------------------------------

def test_a_publishers_box_and_an_open_access_banner_are_not_headings(kb_engine, tmp_path):
    def page_one(p):
        p.line("Open Access", "tibo", 10.5)
        title_block(p)
        section(p, "Background")
        for name in ("Design", "Sampling"):
            section(p, name, size=10.5, before=3)
        section(p, "Submit your next manuscript to BioMed Central and take full advantage of:", size=10.5, before=8,
                text="Convenient online submission and thorough peer review by experts in your field.")
        section(p, "Conclusions")
    labels = labels_of(kb_engine, build(tmp_path / "box.pdf", [page_one]))
    assert not [label for label in labels if "Submit" in label or "Open Access" in label], labels
    assert "Background > Sampling" in labels and "Conclusions" in labels


# -- a running head that carries an author's name -----------------------------------------------------------

def test_a_running_head_with_an_authors_name_is_not_a_heading(kb_engine, tmp_path):
    def body_page(headings):
        def fill(p):
            p.y = 36
            p.line("P. Abbott et al.", "tibo", 9, x=72)
            p.y = 80
            for heading in headings:
                section(p, heading, text=BODY + " " + BODY)
                p.paragraph(BODY)
        return fill

    def first(p):
        title_block(p)
        section(p, "1 Introduction")

    path = build(tmp_path / "heads.pdf", [first, body_page(["2 Methods"]), body_page(["3 Results"]),
                                          body_page(["4 Discussion"])])
    labels = labels_of(kb_engine, path)
    assert not [label for label in labels if "Abbott" in label], labels
    assert [l for l in labels if l not in ("", "Front matter")] == ["Introduction", "Methods", "Results", "Discussion"]


# -- text drawn over a figure ---------------------------------------------------------------------------------

def test_text_over_a_figure_is_not_a_heading(kb_engine, tmp_path):
    picture = pymupdf.Pixmap(pymupdf.csRGB, pymupdf.IRect(0, 0, 60, 40), False)
    picture.clear_with(200)

    def page_one(p):
        title_block(p)
        section(p, "1 Introduction")
        top = p.y
        p.page.insert_image(pymupdf.Rect(p.left, top, p.left + 300, top + 180), pixmap=picture)
        for name, dy in (("Re prj", 30), ("Encoder Stage", 80), ("Decoder Stage", 130)):
            p.y = top + dy
            p.line(name, "tibo", 10.5, x=p.left + 40)
        p.y = top + 190
        p.paragraph("Figure 1: The pipeline and its two stages, drawn as boxes over the sample photograph.")
        section(p, "2 Methods")
        for name in ("Growth", "Imaging"):
            section(p, name, size=10.5, before=3)
    labels = labels_of(kb_engine, build(tmp_path / "figure.pdf", [page_one]))
    assert not [label for label in labels if "Re prj" in label or "Stage" in label], labels
    assert "Methods > Growth" in labels


# -- run-in headings -------------------------------------------------------------------------------------------

def test_run_in_headings_name_the_passages_under_them(kb_engine, tmp_path):
    def page_one(p):
        title_block(p)
        section(p, "1 Introduction")
        p.line("2 Methods", "tibo", 12, before=6)
        p.line("2.1 Study design", "tibo", 11, before=3)
        for lead in ("Participants.", "Procedure.", "Analysis."):
            p.paragraph(f"{lead[:-1].lower()}token " + BODY, lead=(lead, "tibo"))
        section(p, "3 Results")
    path = build(tmp_path / "runin.pdf", [page_one])
    chunks = kb_engine.chunk_document(kb_engine.extract_file(str(path)))
    by_token = {token: next(c.section for c in chunks if token in c.text)
                for token in ("participantstoken", "proceduretoken", "analysistoken")}
    assert by_token == {"participantstoken": "Methods > Study design > Participants",
                        "proceduretoken": "Methods > Study design > Procedure",
                        "analysistoken": "Methods > Study design > Analysis"}
    # the lead-in stays in the passage's text: nothing of the page is lost
    assert any(c.text.startswith("Participants. participantstoken") for c in chunks)


def test_a_single_bold_lead_in_is_emphasis_not_a_run_in_heading(kb_engine, tmp_path):
    def page_one(p):
        title_block(p)
        p.line("1 Introduction", "tibo", 12, before=6)
        p.paragraph("emphasistoken " + BODY, lead=("Note.", "tibo"))
        p.paragraph(BODY)
        p.line("2 Methods", "tibo", 12, before=6)
        p.paragraph("onceonlytoken " + BODY, lead=("Important.", "tibo"))
    labels = labels_of(kb_engine, build(tmp_path / "once.pdf", [page_one]))
    assert not [label for label in labels if ">" in label], labels


# -- the PDF's outline ---------------------------------------------------------------------------------------

def _plain_headed(tmp_path: Path, name: str) -> Path:
    """Headings set exactly like the text: only an outline can tell them."""
    def page_one(p):
        title_block(p)
        for heading in ("Overview of the survey", "Where the boards were kept", "How moisture was read"):
            section(p, heading, "tiro", 10.5)
    return build(tmp_path / name, [page_one])


def test_an_outline_that_agrees_with_the_pages_gives_the_headings_and_levels(kb_engine, tmp_path):
    path = _plain_headed(tmp_path, "outline.pdf")
    doc = pymupdf.open(str(path))
    doc.set_toc([[1, "Overview of the survey", 1], [2, "Where the boards were kept", 1],
                 [2, "How moisture was read", 1]])
    doc.saveIncr()
    doc.close()
    labels = labels_of(kb_engine, path)
    assert "Overview of the survey > Where the boards were kept" in labels
    assert "Overview of the survey > How moisture was read" in labels


def test_an_outline_that_does_not_agree_is_left_alone(kb_engine, tmp_path):
    path = _plain_headed(tmp_path, "stale-outline.pdf")
    doc = pymupdf.open(str(path))
    doc.set_toc([[1, "Introduction to an earlier draft", 1], [1, "Methods of the earlier draft", 1],
                 [1, "Where the boards were kept", 1]])      # one of three found: not this document's outline
    doc.saveIncr()
    doc.close()
    labels = labels_of(kb_engine, path)
    assert not [label for label in labels if "Where the boards" in label or "draft" in label], labels


# -- numbering ladders, deep labels ------------------------------------------------------------------------------

def test_numbered_levels_make_full_paths(kb_engine, tmp_path):
    def page_one(p):
        title_block(p)
        for heading, size in (("1 Introduction", 12), ("2 Model", 12), ("2.1 Transport", 11),
                              ("2.1.1 Boundary conditions", 10.5), ("2.1.2 Initial state", 10.5),
                              ("2.2 Sorption", 11), ("3 Results", 12)):
            p.line(heading, "tibo", size, before=5)
            p.paragraph(BODY)
    labels = labels_of(kb_engine, build(tmp_path / "deep.pdf", [page_one]))
    assert "Model > Transport > Boundary conditions" in labels and "Model > Transport > Initial state" in labels
    assert "Model > Sorption" in labels and "Results" in labels


def test_a_chinese_numbering_ladder_gives_three_levels(kb_engine, tmp_path):
    def page_one(p):
        p.line("毕业设计撰写规范", "china-s", 16, after=12)
        for heading, size in (("一、内容要求", 14), ("（一）题目", 12), ("（二）摘要与关键词", 12), ("1. 摘要", 12),
                              ("2. 关键词", 12), ("二、书写规定", 14), ("（一）字数", 12)):
            p.line(heading, "china-s", size, before=4)
            p.paragraph("论文的这一部分应当按照学校的统一规定书写，内容完整，格式规范，不得随意更改。", font="china-s")
    labels = labels_of(kb_engine, build(tmp_path / "zh.pdf", [page_one]))
    assert "内容要求 > 摘要与关键词 > 摘要" in labels and "内容要求 > 摘要与关键词 > 关键词" in labels, labels
    assert "书写规定 > 字数" in labels


# -- a Chinese journal article ---------------------------------------------------------------------------------

JOURNAL_TEXT = ("本研究在三个试验站连续观测了五年的土壤水分与作物产量，数据由自动气象站和人工取样两部分组成。"
                "观测期间共布设二十四个样点，每个样点在播种前、拔节期和收获后各取样一次，样品带回实验室烘干称重。"
                "为了比较不同灌溉制度的效果，我们把样点分成对照组和处理组，处理组按照土壤墒情决定灌水时间和灌水量。"
                "结果表明处理组的水分利用效率明显高于对照组，而产量差异并不显著，说明节水灌溉在当地具有推广价值。"
                "我们还用CPU和GPU两种硬件训练了同一个预测模型，GPU 版本的训练时间约为CPU 版本的五分之一左右。"
                "模型输入包括降水量、气温、日照时数和前期土壤含水量，输出为未来十天的根层土壤水分预报值。")


def _named_cjk_fonts(doc) -> None:
    """Name the two CJK faces as a journal's PDF does: the body's Song face SimSun, the headings' Hei face SimHei
    (PyMuPDF's own CJK font calls itself Heiti, and the embedded one Droid Sans Fallback)."""
    import re
    for page in doc:
        for xref, _, _, _, resource, _ in page.get_fonts():
            name = "SimHei" if resource == "hei" else "SimSun" if resource == "china-s" else None
            if not name:
                continue
            doc.xref_set_key(xref, "BaseFont", "/" + name)
            for child in re.findall(r"(\d+) 0 R", doc.xref_get_key(xref, "DescendantFonts")[1]):
                doc.xref_set_key(int(child), "BaseFont", "/" + name)
                descriptor = re.match(r"(\d+) 0 R", doc.xref_get_key(int(child), "FontDescriptor")[1])
                if descriptor:
                    doc.xref_set_key(int(descriptor.group(1)), "FontName", "/" + name)


def chinese_journal(path: Path) -> Path:
    """Six pages of a two-column Chinese journal article as CNKI-era typesetting writes it: every line its own
    text object, headings in a Hei face with their numbers in a Western one, running text naming CPU and GPU,
    numbered list items, a running head read on some pages with its page number ("通信学报 ·28·"), and a page
    number "第3页" in the footer."""
    doc = pymupdf.open()
    hei = pymupdf.Font("cjk").buffer
    plan = {1: [("1", "相关工作", 11.5), ("1.1", "观测方法", 9.7)], 2: [("1.2", "数据处理", 9.7)],
            3: [("2", "试验设计", 11.5), ("2.1", "样点布设", 9.7)], 4: [("2.2", "灌溉制度", 9.7)],
            5: [("3", "结果分析", 11.5)], 6: [("4", "结论", 11.5)]}
    for number in range(1, 7):
        page = doc.new_page(width=595, height=842)
        page.insert_font(fontname="hei", fontbuffer=hei)
        if number % 2 == 0 and number < 6:
            page.insert_text((240, 50), f"通信学报 ·{26 + number}·", fontname="china-s", fontsize=9)
        elif number % 2 == 0:
            page.insert_text((240, 50), "通信学报", fontname="china-s", fontsize=9)
            page.insert_text((520, 50), f"·{26 + number}·", fontname="tiro", fontsize=9)
        page.insert_text((280, 800), f"第{number}页", fontname="china-s", fontsize=9)
        text = (JOURNAL_TEXT * 3)[number * 37:]
        lines = [text[i:i + 22] for i in range(0, 22 * 80, 22)]
        headings = list(plan[number])
        for column, x in enumerate((57, 308)):
            y = 90.0
            for row in range(36):
                if headings and row == 4 + column * 14:
                    mark, title, size = headings.pop(0)
                    page.insert_text((x, y + size), mark, fontname="tiro", fontsize=size)
                    page.insert_text((x + 6 * len(mark) + 8, y + size), title, fontname="hei", fontsize=size)
                    y += size * 1.8
                    continue
                line = lines.pop(0)
                if row == 10 and column == 0:
                    line = "1）为解决目前观测资料分散、口径不一的问题、"
                page.insert_text((x + (20 if row in (0, 10) else 0), y + 9.7), line, fontname="china-s", fontsize=9.7)
                y += 9.7 * 1.65
    _named_cjk_fonts(doc)
    doc.save(str(path))
    return path


def test_a_chinese_journal_article_gets_its_sections_and_no_running_text(kb_engine, tmp_path):
    # Each line its own block: a full line that runs on into the next is a paragraph's, whatever its words (a
    # line naming "CPU" read as set in capitals, and a Hei face is the bold of Chinese type)
    path = chinese_journal(tmp_path / "journal.pdf")
    labels = [label for label in labels_of(kb_engine, path) if label not in ("", "Front matter", "Abstract")]
    assert labels == ["相关工作", "相关工作 > 观测方法", "相关工作 > 数据处理", "试验设计", "试验设计 > 样点布设",
                      "试验设计 > 灌溉制度", "结果分析", "结论"], labels
    pages = kb_engine.page_texts(str(path))
    assert not any("通信学报" in text or re.search(r"第\d页", text) for text in pages), pages[1][:200]
    assert "CPU" in "".join(pages)


def test_a_heading_glued_to_its_paragraph_in_the_text_face_is_split_off(kb_engine, tmp_path):
    """IEEE proceedings set "I. INTRODUCTION" centred, in the text's own face, and PyMuPDF reads it as the
    first line of the paragraph below."""
    def page_one(p):
        title_block(p)
        for heading in ("I. INTRODUCTION", "II. RELATED WORK", "III. THE MODEL"):
            p.y += 10
            p.text(p.left + 150, heading, "tiro", 10)
            p.y += 10 * 1.3 + 10
            p.paragraph(BODY + " " + BODY, size=10, after=2)
    labels = labels_of(kb_engine, build(tmp_path / "ieee.pdf", [page_one]))
    assert {"Introduction", "Related Work", "The Model"} <= set(labels), labels


# -- the section benchmark itself -----------------------------------------------------------------------------

SECTION_SETS = {"main": ROOT / "benchmarks" / "section_headings.jsonl",
                "second": ROOT / "benchmarks" / "section_headings_heldout.jsonl"}
# Chinese journal articles from a public repository, not the shared corpus (docs/PERFORMANCE.md says where)
ZH_JOURNALS = ROOT / "benchmarks" / "section_headings_zh_journals.jsonl"


@pytest.mark.parametrize("name", sorted(SECTION_SETS) + ["zh_journals"])
def test_the_section_benchmark_is_well_formed(name):
    docs = eval_sections.load_headings(SECTION_SETS.get(name, ZH_JOURNALS))
    assert len({d["doc"] for d in docs}) == len(docs), "a document labelled twice"
    for doc in docs:
        pages = [h["page"] for h in doc["headings"]]
        assert pages == sorted(pages), f"{doc['doc']}: headings out of reading order"
        assert all(h["text"].strip() and isinstance(h["run_in"], bool) for h in doc["headings"]), doc["doc"]


def test_the_main_section_benchmark_covers_what_the_issue_asks_for():
    docs = eval_sections.load_headings(SECTION_SETS["main"])
    headings = [h for d in docs for h in d["headings"]]
    assert len(docs) >= 20 and len(headings) >= 400
    assert any("thesis" in d["doc"] for d in docs)
    assert sum(any(eval_sections.re.search("[\u4e00-\u9fff]", h["text"]) for h in d["headings"]) for d in docs) >= 2
    assert sum(h["run_in"] for h in headings) >= 30 and {h["level"] for h in headings} >= {1, 2, 3}
    assert not {d["doc"] for d in docs} & {d["doc"] for d in eval_sections.load_headings(SECTION_SETS["second"])}


def test_label_matching_ignores_numbering_case_and_letter_spacing():
    same = eval_sections.same_heading
    assert same("Related Work", "II. RELATED WORK") and same("Time explicit format", "C.1. Time explicit format")
    assert same("摘要", "摘 要") and same("绪论", "第1 章  绪论") and same("Route Request", "1) Route Request")
    assert same("1970 Cambridge CAP compute", "1.2.1 1970 Cambridge CAP compute")
    assert not same("Results", "Related Work") and not same("Methods", "Methods and Data")


CORPUS = os.environ.get("KB_CORPUS_DIR")


@pytest.mark.skipif(not CORPUS or not Path(CORPUS).is_dir(), reason="KB_CORPUS_DIR not set")
@pytest.mark.parametrize("name", sorted(SECTION_SETS))
def test_every_labelled_heading_is_printed_on_its_page(kb_engine, name):
    """The labels were read off the pages: each heading's text is on the page it names (in PyMuPDF's own text of
    the page, accents drawn apart put back on their letters, letters and digits compared), so a label cannot
    drift from the document it describes."""
    for doc in eval_sections.load_headings(SECTION_SETS[name]):
        pdf = pymupdf.open(str(Path(CORPUS) / doc["doc"]))
        try:
            texts = {}
            for heading in doc["headings"]:
                page = texts.setdefault(heading["page"], "".join(eval_sections.normalise(
                    kb_engine.compose_spacing_accents(pdf[heading["page"] - 1].get_text())).split()))
                wanted = "".join(eval_sections.normalise(heading["text"]).split())
                assert wanted in page or wanted.replace("ê", "fi") in page, (doc["doc"], heading)
        finally:
            pdf.close()
