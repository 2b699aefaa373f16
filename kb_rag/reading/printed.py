"""Printed record: what kind of work a paper is and where it appeared (venue, volume, issue, pages, publisher,
report number, arXiv id), read from the lines the paper prints about itself: journal lines in its headers and
footers, citation blocks, cost codes, proceedings footers, thesis title pages, report numbers.

Every value comes from a printed line; a field the pages do not print stays empty. The rules are stated as the
shapes such lines take (a name followed by volume, issue, pages and year in one of a few orders; a labelled
"Vol."/"No."/"pp."; Chinese 卷/期/页; a cost code ISSN/yy/vol(issue)/page), never as a list of journals.

May import: reading.citation_lines, reading.identifiers.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ..reading.citation_lines import (
    _CONFERENCE_STAMP,
    _MONTH,
    _REPORT_NUMBER_SHAPE,
    _YEAR,
    CitationNumbers,
    conference_stamp,
    normalise_line,
    read_cost_code,
    read_numbers,
)
from ..reading.identifiers import without_disclaimers


@dataclass(frozen=True)
class WorkType:
    """A kind of work: its BibTeX entry type (and the BibTeX ``type`` field where the entry type alone does not
    say it), its CSL type (and CSL ``genre``), and the words shown to people."""

    bibtex: str
    csl: str
    label: str
    bibtex_type: str = ""
    genre: str = ""


# The kinds of work, each once: the reader picks one, the BibTeX and CSL writers map it from here.
WORK_TYPES: dict[str, WorkType] = {
    "journal-article": WorkType("article", "article-journal", "journal article"),
    "conference-paper": WorkType("inproceedings", "paper-conference", "conference paper"),
    "phd-thesis": WorkType("phdthesis", "thesis", "doctoral thesis", genre="PhD thesis"),
    "masters-thesis": WorkType("mastersthesis", "thesis", "master's thesis", genre="Master's thesis"),
    "bachelor-thesis": WorkType(
        "mastersthesis", "thesis", "bachelor's thesis", bibtex_type="Bachelor's thesis", genre="Bachelor's thesis"
    ),
    "report": WorkType("techreport", "report", "report"),
    "preprint": WorkType("misc", "article", "preprint", genre="Preprint"),
    "book": WorkType("book", "book", "book"),
    "chapter": WorkType("incollection", "chapter", "book chapter"),
    "document": WorkType("misc", "document", "document"),
}
DEFAULT_WORK_TYPE = "document"


@dataclass
class Printed:
    """What the pages print about the work itself (empty where they print nothing)."""

    work_type: str = DEFAULT_WORK_TYPE
    venue: str | None = None
    volume: str | None = None
    issue: str | None = None
    page_range: str | None = None
    publisher: str | None = None
    report_number: str | None = None
    arxiv_id: str | None = None
    year: int | None = None
    cover_title: str | None = None  # a title page's labelled fields ("论文题目：...", "Title: ...")
    banner_title: str | None = None  # the line after a title page's banner ("本科毕业设计（论文）", "Working Paper")
    cover_authors: list[str] = field(default_factory=list)
    cover_year: int | None = None
    evidence: list[str] = field(default_factory=list)  # why: the lines each value came from


# -- normalising a printed line -----------------------------------------------------------------------------


# -- the numbers of a citation line -------------------------------------------------------------------------
# A journal line is a name followed by its numbers: "International Psychogeriatrics (2014), 26:1, 147-154",
# "Nature | Vol 574 | 24 October 2019 | 505", "PRL 116, 061102 (2016)", "Phys. Lett. B 456 (1999) 123-130",
# "BMC Health Services Research 2013, 13:21", "IEEE TRANSACTIONS ON X, VOL. 26, NO. 1, JANUARY 2004",
# "Machine Learning, 20, 273-297 (1995)", "2014;26(1):147-54", "第9卷第4期". The numbers are read as tokens,
# then given their roles by their labels, brackets and order.


# -- the venue's name -----------------------------------------------------------------------------------------


# knows how the paper's own text writes each word


# -- the kind of work ---------------------------------------------------------------------------------------

_THESIS_DEGREES = (
    (
        "phd-thesis",
        re.compile(
            r"doctor(?:al)? (?:of|thesis|dissertation)|doctorate|\bph\.?\s?d\b|dr\.\s?rer\.|"
            r"博士学位论文|博士论文|博士研究生|"
            r"\b(?:tese|tesis|thèse) de doctora|doutorado|doctorado|doktorarbeit|докторская|кандидатская",
            re.IGNORECASE,
        ),
    ),
    (
        "masters-thesis",
        re.compile(
            r"master(?:'s|’s|s)? (?:of|thesis|degree|dissertation)|\bm\.?\s?sc\b|硕士学位论文|硕士论文|硕士研究生|"
            r"mestrado|maestría|mémoire de master|masterarbeit|магистерская",
            re.IGNORECASE,
        ),
    ),
    (
        "bachelor-thesis",
        re.compile(
            r"bachelor(?:'s|’s|s)? (?:of|thesis|degree)|\bb\.?\s?sc\b|undergraduate thesis|"
            r"学士学位论文|本科毕业论文|毕业设计|本科生毕业",
            re.IGNORECASE,
        ),
    ),
)
_THESIS_WORDS = re.compile(
    r"\b(?:thesis|dissertation)\b.{0,120}\b(?:submitted|presented|requirements?|fulfil+ment|degree)\b"
    r"|\b(?:submitted|presented)\b.{0,160}\b(?:requirements?|fulfil+ment)\b.{0,80}\bdegree\b"
    r"|\bin (?:partial )?fulfil+ment of the requirements\b|学位论文|毕业论文|学位申请|论文作者|"
    r"\bdisserta[çc][ãa]o\b|\btese\b|\btesis\b|\bthèse\b|\bmémoire\b|\bmasterarbeit\b|диссертация|毕业设计",
    re.IGNORECASE | re.DOTALL,
)
_UNIVERSITY = re.compile(
    r"((?:The )?(?:[A-Z][\w.'&-]*[ \t]+){0,3}"
    r"(?:University|Universit[äéà]t?|Universidade|Universidad|Università|Institute of Technology|"
    r"Polytechnic|[EÉ]cole [\w ]{3,30})(?:[ \t]+(?:of|at|in|de|di)[ \t]+(?:[A-Z][\w.'&-]*[ \t]*){1,3})?)"
    r"|([\u4e00-\u9fff]{2,12}(?:大学|学院|研究院|研究所))"
)
_REPORT_WORDS = re.compile(
    r"\btechnical report\b|\btech\.? rep(?:ort)?\.?\b|\bworking paper\b|\bresearch report\b|\bwhite ?paper\b|"
    r"\breport (?:no\.?|number|#)|\binternal report\b|\bdiscussion paper\b|研究报告|技术报告",
    re.IGNORECASE,
)
# A report number: letters (an institution's series) and digits in hyphenated or slashed groups, e.g.
# "CEBAF-TH-94-08", "MSR-TR-2019-12", "UCB/EECS-2010-23", "SLAC-PUB-1234"; labelled ones are taken as printed.
_REPORT_NUMBER_LABELLED = re.compile(
    r"\b(?:report|tech(?:nical)?\.? rep(?:ort)?\.?|working paper|paper|preprint|memo)\s*"
    r"(?:no\.?|number|#|nr\.?)\s*[:.]?\s*"
    r"([A-Z0-9][A-Z0-9./_-]{1,30}\d[A-Z0-9./_-]*)",
    re.IGNORECASE,
)
_CONFERENCE_EVIDENCE = re.compile(
    r"\bproceedings of\b|\bin proceedings\b|\bconference (?:on|of)\b|\bworkshop (?:on|of)\b|\bsymposium (?:on|of)\b|"
    r"\bpublished as a conference paper\b|\bcamera[- ]ready\b|\bfindings of the association\b|"
    r"\b(?:lncs|lnai|lnbi|ccis)\s*\d|\blecture notes in\b|\b(?:19|20)\d\d ieee/?\w* (?:international )?conference\b|"
    r"\b\d{1,3}(?:st|nd|rd|th)\b[^\n|]{0,100}\b(?:conference|workshop|symposium|congress)\b|"
    r"会议论文|学术会议|国际会议",
    re.IGNORECASE,
)
# "Submitted to" names where a paper went only when a name follows ("Submitted to: Physical Review Letters");
# "the jobs submitted to a cluster" is prose.
_SUBMITTED = r"\b[Ss]ubmitted to:?\s+(?:the\s+)?[A-Z]"
_PREPRINT_EVIDENCE = re.compile(
    r"(?i:\bpreprint\b|\bunder review\b|\bwork in progress\b|\bnot peer[- ]reviewed\b)|"
    r"\bDRAFT\b|\b[Dd]raft (?:version|manuscript)\b|" + _SUBMITTED
)
_UNDER_REVIEW = re.compile(r"(?i:\bunder review\b|\bpreprint submitted\b|\bnot peer[- ]reviewed\b)|" + _SUBMITTED)
_JOURNAL_EVIDENCE = re.compile(
    r"\bjournal\b|\btransactions\b|\bletters\b|\breview\b|\bannals\b|\bacta\b|\bbulletin\b|\bquarterly\b|"
    r"学报|杂志|期刊",
    re.IGNORECASE,
)
_CHAPTER_EVIDENCE = re.compile(
    r"^\s*(?:chapter|kapitel)\s+\d+\b|\bin:?\s.{0,80}\(eds?\.?\)", re.IGNORECASE | re.MULTILINE
)
# an ISBN, labelled or in a proceedings' cost line ("978-1-4673-5208-6/13/$31.00")
_ISBN = re.compile(r"\bISBN(?:-1[03])?:?\s*[\d-]{10,17}|\b97[89]-\d{1,5}-\d{1,7}-\d{1,7}-[\dX]\b", re.IGNORECASE)
_ARXIV_STAMP = re.compile(r"\barxiv:\s*(\d{4}\.\d{4,5}|[a-z-]+(?:\.[A-Z]{2})?/\d{7})(?:v\d+)?", re.IGNORECASE)
_OLD_ARXIV = re.compile(r"(?<![\w/.])([a-z-]{4,12}(?:\.[A-Z]{2})?/\d{7})(?:v\d+)?\b")


def arxiv_id(texts: list[str]) -> str | None:
    """The arXiv identifier the pages print (its stamp in the margin, a header, "arXiv:..." in the text)."""
    for text in texts:
        match = _ARXIV_STAMP.search(text or "")
        if match:
            return match.group(1)
    for text in texts[:1]:
        match = _OLD_ARXIV.search(text or "")
        if match and re.match(r"(?:hep|astro|cond|gr|math|nucl|physics|quant|cs|nlin|q-bio|stat)", match.group(1)):
            return match.group(1)
    return None


# -- a title page's form --------------------------------------------------------------------------------------
# Theses and reports print a form on their title page: a label, then its value on the same line after a colon or
# on the next line ("申请人姓名：冯冠军", "学生姓名\n李金刚", "Author: ..."). The labels are the form's own words.
_FORM_LABELS = (
    ("title", r"(?:中文)?论文(?:题目|名称)|(?:设计|课题)(?:题目|名称)|题\s*目|title of (?:the )?thesis"),
    (
        "author",
        r"(?:申请人|作者|学生|研究生|学位申请人)(?:\s*姓\s*名)?|姓\s*名|(?:author|candidate|student)(?:'s name)?|"
        r"submitted by|presented by",
    ),
    ("date", r"(?:论文)?(?:提交|答辩|完成)日期|日\s*期|date of submission"),
)
_FORM_LINE = re.compile(
    r"^\s*(?:"
    + "|".join(f"(?P<{name}>{pattern})" for name, pattern in _FORM_LABELS)
    + r")\s*(?:(?:[:：]|\s{2,})\s*(?P<value>.*))?$",
    re.IGNORECASE,
)
_CN_DIGITS = {
    "〇": "0",
    "零": "0",
    "○": "0",
    "一": "1",
    "二": "2",
    "三": "3",
    "四": "4",
    "五": "5",
    "六": "6",
    "七": "7",
    "八": "8",
    "九": "9",
}


# A line that names only the kind of thesis: a title page's banner, never the title.
DEGREE_BANNER = re.compile(
    r"^\s*(?:(?:博士|硕士|学士)学位论文|(?:本科)?毕业(?:设计|论文)\s*[（(]?\s*(?:论文|设计)?\s*[)）]?|"
    r"(?:doctoral|phd|ph\.d\.|master'?s?|bachelor'?s?|undergraduate|diploma)\s+(?:thesis|dissertation)|"
    r"(?:thesis|dissertation)|(?:technical |research )?report|working paper|white paper|technical note)\s*$",
    re.IGNORECASE,
)


def title_after_banner(lines: list[str]) -> str | None:
    """A title page's title where its largest line is a banner ("本科毕业设计（论文）", "Working Paper"): the next
    line that is neither a form's field nor a banner, with a line that continues it ("——用户端APP")."""
    for index, line in enumerate(lines):
        if not DEGREE_BANNER.match(line):
            continue
        rest = [ln.strip() for ln in lines[index + 1 : index + 12] if ln.strip()]
        for at, candidate in enumerate(rest):
            if DEGREE_BANNER.match(candidate) or _FORM_LINE.match(candidate) or len(candidate) < 4:
                continue
            if re.search(r"\b(?:university|school|department)\b|大学|学院", candidate, re.IGNORECASE):
                break
            follow = rest[at + 1] if at + 1 < len(rest) else ""
            if re.match(r"^(?:——|--|—|:)", follow):
                candidate = f"{candidate}{follow}"
            elif follow and re.search(r"[^\W\d_]-$", candidate):
                candidate = f"{candidate}{follow}"  # "Multi-" / "Armed Bandit Experiments"
            return candidate
        return None
    return None


_DATE_LINE = re.compile(
    r"^\s*(?:[〇零○一二三四五六七八九十\d]{4}\s*年(?:\s*[〇零○一二三四五六七八九十\d]{1,3}\s*月)?(?:\s*\d{1,2}\s*日)?|"
    r"(?:" + _MONTH + r"\s+)?" + _YEAR + r")\s*$",
    re.IGNORECASE,
)


def _dated_line(title_page: str) -> int | None:
    """The year of a title page's date set on a line of its own ("二〇二〇年五月", "May 2017", "2017")."""
    for line in title_page.splitlines()[:60]:
        if _DATE_LINE.match(line):
            return form_year(line)
    return None


def form_year(text: str) -> int | None:
    """The year of a printed date: "2014 年 1 月", "May 2018", "二零一八年六月"."""
    text = "".join(_CN_DIGITS.get(ch, ch) for ch in text)
    match = re.search(r"(?<!\d)(" + _YEAR + r")(?!\d)", text)
    return int(match.group(1)) if match else None


def read_form(lines: list[str]) -> dict[str, str]:
    """The labelled fields of a title page's form (title, author, date): the first value of each label."""
    found: dict[str, str] = {}
    for index, line in enumerate(lines):
        match = _FORM_LINE.match(line)
        if not match:
            continue
        name = next(n for n, _ in _FORM_LABELS if match.group(n))
        value = (match.group("value") or "").strip()
        if not value:  # the value on the next line that is not itself a label
            following = next((ln.strip() for ln in lines[index + 1 : index + 3] if ln.strip()), "")
            value = "" if _FORM_LINE.match(following) else following
        value = re.sub(r"\s{2,}.*$", "", value).strip()  # a second field further along the line
        if value and name not in found:
            found[name] = value
    return found


def _squeeze_cjk(text: str) -> str:
    """Letter-spaced CJK ("西 南 交 通 大 学", "曹 云") written as it reads."""
    return re.sub(r"(?<=[\u4e00-\u9fff])\s+(?=[\u4e00-\u9fff])", "", text)


def thesis_degree(opening: str) -> str | None:
    """The thesis kind the opening pages declare (a title page naming the degree), else None."""
    if not _THESIS_WORDS.search(opening):
        return None
    for name, pattern in _THESIS_DEGREES:
        if pattern.search(opening):
            return name
    return "phd-thesis" if re.search(r"\bdissertation\b", opening, re.IGNORECASE) else "masters-thesis"


_ACADEMIC_UNIT = re.compile(
    r"^(?:.*\b(?:school|faculty|department|dept\.?|institute|college|division|centre|center|program(?:me)?|"
    r"science|sciences|engineering|business|studies|laboratory|lab)\b\s+)",
    re.IGNORECASE,
)


def university(opening: str) -> str | None:
    """The university a title page names: a line's "X University", "University of X" (the unit before it, a
    school or department, left out), or a Chinese 大学 (学院 where no 大学 is named)."""
    lines = opening.splitlines()
    for line in lines:
        match = re.search(r"[\u4e00-\u9fff]{2,10}大学", line)
        if match and not re.search(r"(?:所在|培养)大学", match.group(0)):
            return match.group(0)
    for line in lines:
        match = _UNIVERSITY.search(line)
        if match and match.group(1):
            name = re.sub(r"\s+", " ", match.group(1)).strip(" ,.")
            name = (
                _ACADEMIC_UNIT.sub("", name) if not name.lower().startswith(("university", "the university")) else name
            )
            return name
    for line in lines:
        match = re.fullmatch(r"\s*([\u4e00-\u9fff]{2,14}学院)\s*", line)
        if match:
            return match.group(1)
    return None


def report_number(opening: str) -> str | None:
    labelled = _REPORT_NUMBER_LABELLED.search(opening)
    if labelled:
        return labelled.group(1).rstrip(".,;")
    for match in _REPORT_NUMBER_SHAPE.finditer(opening):
        value = match.group(1)
        if re.match(r"(?:ISSN|ISBN|DOI|HTTP|WWW|CC|BY|NC|ND)\b", value, re.IGNORECASE):
            continue
        return value
    return None


@dataclass
class PrintedPages:
    """The lines a paper prints that say what it is, gathered by the reader."""

    front: list[str]  # page 1's lines (page 2's too behind a cover), in reading order
    margins: list[str]  # the header and footer lines of the pages, before running heads are dropped
    opening: str  # the first pages' text, for title pages and report covers
    title: str = ""
    venue_hint: str | None = None  # the venue the metadata reader found (a proceedings line, a Chinese journal)
    doi: str | None = None
    citation: list[str] = field(default_factory=list)  # a "Citation: ..." / "To cite this article: ..." block
    page_span: tuple[int, int] | None = None  # first and last printed page numbers, where pages carry them
    pages: int | None = None
    paper_like: bool = False  # a byline and an abstract or a reference list: a paper, wherever it appeared
    title_page: str = ""  # the first page's text (the second's too behind a cover): where a thesis says so


def _best_numbers(lines: list[str]) -> tuple[CitationNumbers | None, list[str]]:
    best, used = None, []
    for line in lines:
        for piece in re.split(r"\s{3,}|\t", line):
            found = read_cost_code(piece) or read_numbers(piece)
            if found is None:
                continue
            if not found.venue and not found.labelled and found.score() < 4:
                continue  # numbers without a name or a label say little
            if best is None or found.score() > best.score():
                best, used = found, [piece]
    return best, used


def _merge(into: CitationNumbers, other: CitationNumbers) -> None:
    for name in ("venue", "volume", "issue", "pages", "year"):
        if getattr(into, name) is None and getattr(other, name) is not None:
            setattr(into, name, getattr(other, name))


# A block that cites the paper itself: what follows its title is the venue and its numbers.
CITATION_BLOCK = re.compile(
    r"^\s*(?:citation|cite this(?: article| paper)?(?: as)?|to cite this (?:article|paper)|"
    r"how to cite(?: this article)?|"
    r"please cite (?:this article|as)|reference format|acm reference format|引用(?:格式|本文)|本文引用格式)\s*[:：]",
    re.IGNORECASE,
)


def _after_title(text: str, title: str) -> str:
    """The part of a citation block after the paper's title (the whole block when the title is not in it)."""
    fold = lambda t: re.sub(r"[^\w]+", " ", t.casefold())  # noqa: E731
    words = fold(title).split()
    if len(words) < 2:
        return text
    tail = " ".join(words[-3:])
    folded = fold(text)
    at = folded.find(tail)
    if at < 0:
        return text
    # map the folded position back: count words
    before = len(folded[: at + len(tail)].split())
    pieces = re.findall(r"[\w]+|[^\w]+", text)
    seen = 0
    for index, piece in enumerate(pieces):
        if re.match(r"\w", piece):
            seen += 1
            if seen == before:
                return "".join(pieces[index + 1 :]).lstrip(" .?!:")
    return text


def _where_it_appeared(printed: Printed, pages: PrintedPages, front: list[str], margins: list[str]) -> None:
    """The venue and its numbers: the best journal line, filled by a cost code, else the venue the metadata reader
    found, else a conference's stamp."""
    cited = [_after_title(normalise_line(CITATION_BLOCK.sub("", block)), pages.title) for block in pages.citation]
    cited = [re.split(r"(?<=[.;])\s+(?=doi|https?:|©|copyright|received|editor)", c, flags=re.I)[0] for c in cited]
    numbers, used = _best_numbers(cited + margins + front[:40])
    for line in margins + front[:40]:  # a cost code or a second journal line fills what the first lacks
        extra = read_cost_code(line)
        if extra and numbers is not None:
            _merge(numbers, extra)
    if numbers is not None:
        printed.venue = numbers.venue or pages.venue_hint
        printed.volume, printed.issue, printed.year = numbers.volume, numbers.issue, numbers.year
        printed.page_range = numbers.pages
        printed.evidence.extend(used)
    else:
        printed.venue = pages.venue_hint
    if not printed.venue:
        printed.venue = conference_stamp(margins + front[:60])


def _page_range_from_span(printed: Printed, span: tuple[int, int] | None, kind_known: bool) -> None:
    """A range from the printed page numbers: where only the first page is printed ("Venue | Vol 574 | ... | 505"),
    where a venue is named but no range (before the kind of work is known), or, once it is, for any work that lies
    in a journal, proceedings or book."""
    if not span or span[0] < 1 or span[1] <= span[0]:
        return
    printed_range = printed.page_range or ""
    if (
        printed_range
        and "-" not in printed_range
        and printed_range == str(span[0])
        or not printed_range
        and span[0] > 1
        and (printed.work_type in SPAN_KINDS if kind_known else printed.venue)
    ):
        printed.page_range = f"{span[0]}-{span[1]}"


def _title_page_fields(printed: Printed, pages: PrintedPages, opening: str) -> None:
    """A thesis's or report's title page: its form's title, author and date, the line under its banner."""
    form = read_form([_squeeze_cjk(normalise_line(line)) for line in opening.splitlines()[:80]])
    printed.cover_title = form.get("title")
    printed.banner_title = title_after_banner(
        [_squeeze_cjk(normalise_line(line)) for line in (pages.title_page or opening).splitlines()[:60]]
    )
    author = form.get("author")
    if author and len(author) <= 60:
        printed.cover_authors = [_squeeze_cjk(author)]
    printed.cover_year = form_year(form.get("date", "")) or _dated_line(pages.title_page or opening[:3000])


def read_printed(pages: PrintedPages) -> Printed:
    """The printed record of a work: its journal or proceedings line(s), the kind of work its pages declare."""
    opening = without_disclaimers(pages.opening)
    front = [normalise_line(line) for line in pages.front if line.strip()]
    margins = [normalise_line(line) for line in pages.margins if line.strip()]
    printed = Printed()
    _where_it_appeared(printed, pages, front, margins)
    _page_range_from_span(printed, pages.page_span, kind_known=False)
    printed.arxiv_id = arxiv_id(margins + front[:12] + [opening[:3000]])
    printed.work_type = kind = _work_type(printed, pages, opening)
    _page_range_from_span(printed, pages.page_span, kind_known=True)
    if kind.endswith("-thesis") or kind == "report":
        _title_page_fields(printed, pages, opening)
        printed.publisher = university(_squeeze_cjk(opening[: 4000 if kind != "report" else 3000]))
    if kind == "report":
        printed.report_number = report_number(opening[:3000])
    if not printed.report_number and kind in ("preprint", "report"):
        printed.report_number = report_number(" \n ".join(margins + front[:12]))  # a preprint's lab number
    if kind not in SPAN_KINDS:  # nothing invented: a thesis, report, preprint or document lies in no venue
        printed.venue = printed.volume = printed.issue = printed.page_range = None
    return printed


@dataclass
class _Evidence:
    """What the pages say about the kind of work, gathered once for the rules below."""

    printed: Printed
    pages: PrintedPages
    head: str  # the opening pages' text
    near: str  # the headers, footers and front lines: where a paper says where it appeared

    @property
    def conference(self) -> bool:
        venue = self.printed.venue or ""
        return bool(
            _CONFERENCE_EVIDENCE.search(self.near)
            or re.search(r"\b(?:proceedings|conference|workshop|symposium)\b", venue, re.I)
            or (venue and _CONFERENCE_STAMP.match(venue + ", May 1"))
        )

    @property
    def numbered(self) -> bool:
        return bool(self.printed.volume or self.printed.page_range)


def _journal_venue(e: _Evidence) -> bool:
    return not re.search(r"\b(?:journal|transactions)\b", e.printed.venue or "", re.I)


def _isbn_kind(e: _Evidence) -> str | None:
    """Journals print an ISSN; an ISBN is a book's, or a proceedings volume's."""
    if not (_ISBN.search(e.head) or _ISBN.search(e.near)):
        return None
    if (e.pages.pages or 0) >= BOOK_PAGES:
        return "book"
    return "conference-paper" if e.pages.paper_like else None


# The kinds of work in the order their evidence is weighed: the first rule that answers decides.
_KIND_RULES: tuple[tuple[str, Callable[[_Evidence], bool]], ...] = (
    ("preprint", lambda e: bool(_UNDER_REVIEW.search(e.near)) and not e.numbered),  # "Under review at ..."
    ("journal-article", lambda e: bool(e.printed.venue and e.printed.issue)),  # proceedings have no issues
    ("conference-paper", lambda e: bool(e.printed.venue) and e.conference and _journal_venue(e)),
    ("journal-article", lambda e: bool(e.printed.venue and e.printed.volume)),
    ("preprint", lambda e: bool(_UNDER_REVIEW.search(e.near))),
    ("report", lambda e: bool(_REPORT_WORDS.search(e.head[:2500]))),
    ("conference-paper", lambda e: e.conference),
    ("chapter", lambda e: bool(_CHAPTER_EVIDENCE.search(e.head[:2000]))),
    (
        "journal-article",
        lambda e: bool(e.printed.venue and (e.printed.page_range or _JOURNAL_EVIDENCE.search(e.printed.venue))),
    ),
    (
        "preprint",
        lambda e: bool(e.printed.arxiv_id or _PREPRINT_EVIDENCE.search(" ".join(e.pages.margins + e.pages.front[:30]))),
    ),
    ("isbn", lambda e: _isbn_kind(e) is not None),
    ("journal-article", lambda e: bool(e.pages.doi and not e.pages.doi.startswith("10.48550/"))),
    ("preprint", lambda e: e.pages.paper_like),  # a paper whose pages name no venue
)


def _work_type(printed: Printed, pages: PrintedPages, opening: str) -> str:
    head = _squeeze_cjk(opening[:4000])
    degree = thesis_degree(_squeeze_cjk(pages.title_page or head))
    if degree and not (printed.volume and printed.venue):
        return degree
    evidence = _Evidence(printed, pages, head, " ".join(pages.margins + pages.front[:60]))
    if _UNDER_REVIEW.search(pages.title_page[:3000]) and not evidence.numbered:
        return "preprint"  # "Submitted to: Physical Review Letters" on the title page
    for kind, holds in _KIND_RULES:
        if holds(evidence):
            return _isbn_kind(evidence) or DEFAULT_WORK_TYPE if kind == "isbn" else kind
    return DEFAULT_WORK_TYPE


SPAN_KINDS = ("journal-article", "conference-paper", "chapter")  # works whose printed page numbers are a range
BOOK_PAGES = 60  # an ISBN on a document this long is a book's (shorter: a paper in a proceedings volume)
