"""Blocks: what every reader makes: blocks, section names, heading numbering.

May import: text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..text import _CJK_RANGES, cjk_ratio, is_cjk

# Every reader turns a file into ``Block``s (paragraph-sized pieces of text in
# reading order, each with a role) plus the text of each page.  A block's text
# is an exact slice of its page's text, which is what makes offsets checkable.


@dataclass
class Block:
    text: str
    page: int | None  # 1-based physical page; None where a format has no pages
    offset: int = 0  # start of ``text`` within its page text
    role: str = "body"  # body | heading | caption | title | noise
    level: int = 0  # heading depth (1 = top level)
    size: float = 0.0  # dominant font size (PDF only)
    bold: bool = False
    n_lines: int = 1
    italic: bool = False  # every line set in italics (PDF only)
    gapped: bool = False  # a line with spans set far apart, or lines side by side: table columns (PDF only)
    lead: str = ""  # the first line's bold or italic opening words (PDF only)
    bbox: tuple | None = None  # where it is on its page, and where its first line is (PDF only)
    first_line: tuple | None = None
    in_figure: bool = False  # drawn over a picture: a figure's labels, never a heading (PDF only)
    coloured: bool = False  # its first line is set in a colour (PDF only)
    run_in: str = ""  # the run-in heading this paragraph opens with
    evidence: str = ""  # why a heading is one: numbered, known (a section name), outline, style, run_in
    index: int = -1  # position in the document's block list (reading order)
    in_table: bool = False  # a cell or column header of a table (PDF only): never a heading
    closed_by: str = ""  # the closing section (references, acknowledgements) that kept it out of the index


@dataclass(frozen=True)
class HeaderLine:
    """One typeset line of a PDF's first pages, with what the front-matter reader needs to know about it."""

    page: int
    text: str  # the line as it reads
    header: str  # the same line with raised spans and wide gaps turned into NAME_BREAK
    size: float
    bold: bool
    bbox: tuple
    block: int  # lines of one layout block share this number
    page_height: float


@dataclass
class Extracted:
    kind: str
    blocks: list[Block]
    page_texts: list[str]
    page_labels: list[str] = field(default_factory=list)
    raw_meta: dict = field(default_factory=dict)
    body_size: float = 0.0
    references: list = field(default_factory=list)  # (number, raw text) of each reference-list entry
    numbered_references: bool = False
    header: list = field(default_factory=list)  # HeaderLine of the first two PDF pages, for the metadata reader
    ocr_pages: list = field(default_factory=list)  # numbers of the pages whose text came from OCR
    ocr_capped: int = 0  # pages without a text layer past KB_OCR_MAX_PAGES
    ocr_timed_out: int = 0  # pages whose OCR ran past KB_OCR_PAGE_SECONDS
    notes: list = field(default_factory=list)  # the reader's word on how it read the file, for the entry

    @property
    def pages(self) -> int | None:
        return len(self.page_texts) if self.kind == "pdf" else None


# -- structure recognition (shared by all readers) ---------------------------

SECTION_ALIASES = {
    "abstract": ("abstract", "summary", "摘要", "内容摘要", "内容提要", "提要"),
    "introduction": ("introduction", "background", "引言", "前言", "绪论", "导言", "研究背景"),
    "methods": (
        "methods",
        "method",
        "materials and methods",
        "material and methods",
        "methods and materials",
        "patients and methods",
        "subjects and methods",
        "participants and methods",
        "methodology",
        "experimental",
        "experimental section",
        "experimental procedures",
        "experimental methods",
        "experiments",
        "experimental setup",
        "online methods",
        "方法",
        "研究方法",
        "实验方法",
        "材料与方法",
        "材料和方法",
        "实验",
        "实验部分",
    ),
    "results": (
        "results",
        "result",
        "results and discussion",
        "findings",
        "evaluation",
        "结果",
        "实验结果",
        "结果与讨论",
        "结果与分析",
    ),
    "discussion": ("discussion", "discussions", "analysis", "讨论", "分析"),
    "conclusion": (
        "conclusion",
        "conclusions",
        "concluding remarks",
        "summary and conclusions",
        "conclusions and future work",
        "conclusion and future work",
        "outlook",
        "结论",
        "总结",
        "结论与展望",
        "总结与展望",
        "结语",
    ),
    "related work": ("related work", "related works", "prior work", "literature review", "相关工作", "文献综述"),
    "references": (
        "references",
        "reference",
        "bibliography",
        "literature cited",
        "works cited",
        "references and notes",
        "notes and references",
        "cited literature",
        "参考文献",
        "参考资料",
        "引用文献",
    ),
    "acknowledgements": (
        "acknowledgements",
        "acknowledgments",
        "acknowledgement",
        "acknowledgment",
        "funding",
        "致谢",
        "谢辞",
        "鸣谢",
    ),
    "appendix": (
        "appendix",
        "appendices",
        "supplementary material",
        "supplementary materials",
        "supplementary information",
        "supporting information",
        "附录",
    ),
}
# Sections that close the body: kept out of the search index (a reference list feeds citation linking instead).
# Appendices are indexed: researchers ask about what papers put there.
NOT_INDEXED_SECTIONS = frozenset({"references", "acknowledgements"})
_ALIAS_TO_CANONICAL = {alias: canon for canon, aliases in SECTION_ALIASES.items() for alias in aliases}

_CN_NUM = "一二三四五六七八九十百零〇"
_NUMBERING = re.compile(
    rf"^\s*(?:(?P<arabic>\d{{1,2}}(?:\.\d{{1,2}}){{0,3}})[.)]?(?=\s|[^\d.\w]|[A-Za-z{_CJK_RANGES}])"
    rf"|(?P<roman>[IVXLC]{{1,6}})\.(?=\s)"
    rf"|(?P<letter>[A-H])(?:\.\d{{1,2}})*\.?(?=\s)"
    rf"|(?P<cnchap>第[{_CN_NUM}\d]+[章节部分篇])"
    rf"|(?P<cn>[{_CN_NUM}]+)[、.．]"
    rf"|[（(](?P<cnsub>[{_CN_NUM}\d]+)[）)])\s*"
)
_CAPTION = re.compile(
    r"^\s*(?:fig(?:ure)?s?\.?|table|tab\.|scheme|chart|plate|图|表)\s*"
    r"(?:[A-Z]\.\d+|[A-Z]?\d+|[IVX]+|S\d+)(?:[.:：\-—–]|\s|$)",
    re.IGNORECASE,
)
_RUN_IN_HEADING = re.compile(
    r"^\s*(?:(?i:abstract|summary|keywords?|key words|index terms)|摘\s*要|关键词)\s*[:：.—–\-]+\s*"
    r"|^\s*(?:Abstract|ABSTRACT|摘\s*要)\s+(?=[A-Z\"“(\u4e00-\u9fff])"
)


def run_in_abstract(text: str) -> int | None:
    """End offset of a run-in abstract label ("Abstract—", "Summary:"), else None."""
    match = _RUN_IN_HEADING.match(text)
    if match and canonical_section(re.sub(r"[\s:：.—–\-]+$", "", match.group(0))) == "abstract":
        return match.end()
    return None


_BARE_NUMBER = re.compile(r"^\s*\d{1,2}(?:\.\d{1,2}){0,3}\.?\s*$")
_TERMINAL_PUNCT = tuple('.!?。！？;；:：)]"”’')


_APPENDIX_TITLE = re.compile(
    r"^(?:appendix|appendices|supplementary (?:material|information|note|methods|text)s?|"
    r"supporting information|附录)"
    r"(?:\s+(?:[a-h]|\d{1,2}|[ivx]{1,4})\b)?(?:\s*[:.\-—–]\s*|\s+|$)"
)


def canonical_section(name: str) -> str | None:
    """Canonical key of a known section name (any case, numbering removed), else None.

    An appendix may carry a label and a title ("Appendix B: Proofs", "Supplementary Note 2 Data")."""
    cleaned = re.sub(r"[\s:：.]+$", "", strip_numbering(name)).strip().lower()
    cleaned = re.sub(r"\s+", " ", cleaned.replace("&", "and"))
    cleaned = cleaned.replace(" ", "") if cjk_ratio(cleaned) > 0.5 else cleaned
    known = _ALIAS_TO_CANONICAL.get(cleaned)
    if (
        known is None
        and _APPENDIX_TITLE.match(cleaned)
        and len(cleaned.split()) <= 10
        and not name.rstrip().endswith((".", ",", ")"))
    ):
        return "appendix"
    return known


def strip_numbering(text: str) -> str:
    match = _NUMBERING.match(text)
    return text[match.end() :].strip() if match and match.end() < len(text) else text.strip()


def numbering_depth(text: str) -> int:
    """Heading depth implied by a numbering prefix (0 when there is none)."""
    match = _NUMBERING.match(text)
    if not match:
        return 0
    if match.group("arabic"):
        return match.group("arabic").count(".") + 1
    if match.group("roman") in ("C", "L"):
        return 2
    if match.group("roman") or match.group("cn"):
        return 1
    if match.group("cnchap"):
        return 2 if match.group("cnchap").endswith("节") else 1
    return 2  # letters (A. ...) and (一) style sub-headings


def in_capitals(text: str, least: int = 3) -> bool:
    """Set in capitals: at least ``least`` upper-case letters, no lower-case one, and nearly all of its letters (a
    Chinese line that names "CPU" is not: its characters have no case, and ``str.isupper`` looks at cased ones)."""
    letters = [ch for ch in text if ch.isalpha()]
    upper = sum(ch.isupper() for ch in letters)
    return upper >= max(least, 0.8 * len(letters)) and not any(ch.islower() for ch in letters)


def section_display_name(heading: str) -> str:
    """Heading text as a section label: numbering removed, ALL CAPS made readable."""
    name = strip_numbering(heading).rstrip(" :：.")
    if in_capitals(name, 1) and len(name) > 3:
        name = " ".join(
            word.capitalize() if len(word) > 3 or i == 0 else word.lower() for i, word in enumerate(name.split())
        )
    return re.sub(r"\s+", " ", name)[:120]


# A heading is set at least near the size of the body text. Bold labels in much smaller type are figure and table
# content ("ATLAS 0.11) GeV", "RNN params", "CPP Conference" over a table); small capitals, the smallest real
# headings of the corpus, come to about 0.79 of the body size. Known section names are exempt: a closing heading
# has its own typesetting test (_closing_heading_typeset).
SMALL_PRINT_SHARE = 0.75

# Headings are phrases of words. A relation or logic sign marks a formula ("Ia = 2", "T = 500 MeV",
# "HasAsthma(x) ⇒ LowerRisk(x)"), a clock-like value ("5:02") a cell read out of a figure, and an identifier joined
# by underscores ("BANK_SCHEMA.CUSTOMERS") a line of code; all were taken for headings and named the sections
# after them. So was a block without one word of three letters ("Θψ2 θl", "Z f m": symbols of a display formula).
_NOT_A_HEADING = re.compile(
    r"[=<>±≈≤≥⩽⩾∈∉→←↔∝∼≃≅⇒⇔∀∃⊂⊆∧∨¬·∑∏∫√∂∇]|\d:\d{2}\b|[^\W_]_[^\W_]|\w\[\w+,\s*\w+\]"
    r"|\S@\S+\.\w|https?://|www\."
)
_A_WORD = re.compile(r"[^\W\d_]{3,}")


def numbering_scheme(text: str) -> str | None:
    """Which numbering a heading uses: arabic ("2.1"), arabic) ("1)"), roman, letter, cn ("二、"), cnsub ("（二）"),
    cnchap ("第二章")."""
    match = _NUMBERING.match(text)
    if not match:
        return None
    for scheme in ("arabic", "roman", "letter", "cnchap", "cn", "cnsub"):
        if match.group(scheme):
            if scheme == "roman" and match.group("roman") in ("C", "L"):
                return "letter"  # "C. Node Mobility" follows "B.", it is not section 100
            if scheme == "arabic" and text[match.end("arabic") : match.end("arabic") + 1] == ")":
                return "arabic)"
            return scheme
    return None


# A full stop between CJK characters ends a sentence (journals that set "." for "。"): a heading has none
_CJK_SENTENCE_STOP = re.compile(f"[{_CJK_RANGES}]\\s*[.．]\\s*[{_CJK_RANGES}]")


def looks_like_heading(text: str, size: float, bold: bool, n_lines: int, body_size: float) -> int:
    """Heading level (>= 1) when a short block reads as a heading, else 0."""
    stripped = text.strip()
    if not stripped or len(stripped) > 150 or n_lines > 3:
        return 0
    if canonical_section(stripped):
        return max(1, numbering_depth(stripped))  # "4.2 Results" is a subsection
    words = stripped.split()
    letters = [ch for ch in stripped if ch.isalpha()]
    if len(letters) < 2 or stripped[-1] in ",;" or _CAPTION.match(stripped):
        return 0
    if _NOT_A_HEADING.search(stripped) or (
        len(letters) < 3 and not numbering_depth(stripped) and not is_cjk(letters[0])
    ):
        return 0  # a formula, an axis or panel label, a data value read out of a figure
    if size and body_size and size < SMALL_PRINT_SHARE * body_size:
        return 0  # set well below the body text: a label inside a figure or a table, a legend
    title_text = strip_numbering(stripped).lstrip("[(\"'“‘")
    identifier = numbering_depth(stripped) and re.match(r"[a-z]+[A-Z_(\d]\w*", title_text)  # "3.1. readData"
    greek = numbering_depth(stripped) and title_text[:1] and "\u0370" <= title_text[0] <= "\u03ff"  # "3.3. β-..."
    if not title_text or not (title_text[0].isupper() or is_cjk(title_text[0]) or identifier or greek):
        return 0
    if not _A_WORD.search(title_text) and not any(is_cjk(ch) for ch in title_text):
        return 0
    if "。" in stripped or (
        cjk_ratio(stripped) > 0.3
        and (len(stripped) > 40 or re.search(r"[,;:!?]", stripped) or _CJK_SENTENCE_STOP.search(title_text))
    ):
        return 0
    if "," in stripped and len(words) > 8:
        return 0
    if numbering_depth(stripped) and re.search(r"(?:\s|\.{2,}|…)\s*(?:\d{1,4}|[ivxlc]{1,6})$", stripped):
        return 0  # a table-of-contents line ("2. Methods ..... 4")
    ends_like_sentence = stripped.endswith(".") and len(words) > 8
    larger = body_size > 0 and size >= body_size * 1.15
    caps = in_capitals(stripped, 4)
    depth = numbering_depth(stripped)
    emphasised = bold or larger or caps
    if depth and not ends_like_sentence and len(stripped) <= 100:
        if emphasised or (len(words) <= 8 and not stripped.endswith(".")):
            return depth
        return 0
    if emphasised and not ends_like_sentence and len(words) <= 14 and not stripped.endswith("."):
        if body_size and size >= body_size * 1.3:
            return 1
        return 1 if caps else 2
    return 0


_CHAPTER_LABEL = re.compile(r"^\s*(?:chapter|part)\s+(\d{1,2})(?:\s+\S.*)?$", re.IGNORECASE | re.DOTALL)


class HeadingNumbering:
    """Accepts a numbered heading only where it continues the document's numbering.

    Figure labels ("56 MeV"), equations and list items look like numbered
    headings; real section numbers advance one step at a time.
    """

    def __init__(self):
        self.path: list[int] = []

    @staticmethod
    def parts(text: str) -> list[int] | None:
        match = _NUMBERING.match(text)
        if not match or not match.group("arabic"):
            return None
        return [int(n) for n in match.group("arabic").split(".")]

    def open_chapter(self, number: int) -> None:
        """A "Chapter 3" heading: the numbered headings that follow continue from 3."""
        self.path = [number]

    def restart(self) -> None:
        """A heading of another numbering (roman, letters, Chinese) came: arabic numbers may begin again."""
        self.path = []

    def follow(self, parts: list[int]) -> None:
        """A heading certain on other grounds (a known name: "2. Related Work") sets where the numbering is."""
        if not self.accept(parts):
            self.path = parts

    def accept(self, parts: list[int]) -> bool:
        if not self.path:
            ok = parts[0] <= 2 and all(n <= 2 for n in parts[1:])
        elif len(parts) == 1:
            ok = parts[0] in (self.path[0] + 1, self.path[0] + 2)
        else:
            depth = len(parts) - 1
            parent_ok = parts[:depth] == self.path[:depth]
            previous = self.path[depth] if len(self.path) > depth else 0
            ok = parent_ok and parts[-1] in (previous + 1, previous + 2)
        if ok:
            self.path = parts
        return ok
