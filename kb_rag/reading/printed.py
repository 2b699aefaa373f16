"""Printed record: what kind of work a paper is and where it appeared (venue, volume, issue, pages, publisher,
report number, arXiv id), read from the lines the paper prints about itself: journal lines in its headers and
footers, citation blocks, cost codes, proceedings footers, thesis title pages, report numbers.

Every value comes from a printed line; a field the pages do not print stays empty. The rules are stated as the
shapes such lines take (a name followed by volume, issue, pages and year in one of a few orders; a labelled
"Vol."/"No."/"pp."; Chinese 卷/期/页; a cost code ISSN/yy/vol(issue)/page), never as a list of journals.

May import: reading.identifiers, text.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field

from ..reading.identifiers import without_disclaimers
from ..text import is_cjk


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

_DASHES = re.compile("[\u2010\u2011\u2012\u2013\u2014\u2015\u2212\ufe58\ufe63\uff0d]")
_MONTHS = (
    "january february march april may june july august september october november december "
    "jan feb mar apr jun jul aug sep sept oct nov dec spring summer autumn fall winter"
).split()
_MONTH = r"(?:" + "|".join(sorted(_MONTHS, key=len, reverse=True)) + r")\.?"


def _unspace(piece: str) -> str:
    """A letter-spaced run ("N A T U R E", "V O L 5 2 9") as it reads ("NATURE", "VOL 529")."""
    tokens = piece.split(" ")
    if len(tokens) < 4 or sum(len(t) == 1 for t in tokens) < 0.8 * len(tokens):
        return piece
    joined = "".join(tokens)
    return re.sub(r"(?<=[A-Za-z])(?=\d)|(?<=\d)(?=[A-Za-z])", " ", joined)


def normalise_line(text: str) -> str:
    """NFKC (full-width digits and brackets), one kind of dash, one space, letter-spacing undone."""
    text = unicodedata.normalize("NFKC", text or "")
    text = _DASHES.sub("-", text).replace("\u00a0", " ")
    text = re.sub(r"[ \t]{3,}", " | ", text.strip())  # a wide gap sets fields of a header line apart
    text = re.sub(r"\s+", " ", text).strip()
    return " | ".join(_unspace(piece) for piece in re.split(r"\s+[|•·]\s+", text)) if " " in text else text


# -- the numbers of a citation line -------------------------------------------------------------------------
# A journal line is a name followed by its numbers: "International Psychogeriatrics (2014), 26:1, 147-154",
# "Nature | Vol 574 | 24 October 2019 | 505", "PRL 116, 061102 (2016)", "Phys. Lett. B 456 (1999) 123-130",
# "BMC Health Services Research 2013, 13:21", "IEEE TRANSACTIONS ON X, VOL. 26, NO. 1, JANUARY 2004",
# "Machine Learning, 20, 273-297 (1995)", "2014;26(1):147-54", "第9卷第4期". The numbers are read as tokens,
# then given their roles by their labels, brackets and order.

_YEAR = r"(?:1[89]\d\d|20\d\d)"
_PAGE = r"[A-Za-z]{0,2}\d{1,7}(?:\.\d{1,4})?"  # "39.1-39.26": a proceedings' article.page
_TOKEN = re.compile(
    r"(?P<vol_label>\b(?:vol(?:ume)?s?\.?|v\.)\s*(?P<vol_l>\d{1,5}[A-Za-z]?)\b)"
    r"|(?P<iss_label>\b(?:no\.|nos\.|num\.|number|issue|iss\.|nr\.|heft|n[°º])\s*(?P<iss_l>\d{1,4}(?:\s*[-/&]\s*\d{1,4})?|[A-Z]\d{0,2})\b)"
    r"|(?P<pp_label>(?:\bpp?\.|\bpages?\b:?|\bpage\b:?|\bart(?:icle)?\.?\s*(?:no\.?|number)?|\barticle\s+id\b|\be-?locator\b)\s*"
    r"(?P<pp_l>" + _PAGE + r"(?:\s*-\s*" + _PAGE + r")?)\b)"
    r"|(?P<cn_vol>第\s*(?P<cn_vol_n>\d{1,4})\s*卷)"
    r"|(?P<cn_iss>第\s*(?P<cn_iss_n>\d{1,4})\s*期)"
    r"|(?P<cn_year>(?P<cn_year_n>" + _YEAR + r")\s*年)"
    r"|(?P<vol_year>\b(?P<vy_vol>\d{1,4})\s*\(\s*(?P<vy_year>" + _YEAR + r")\s*\))"
    r"|(?P<vol_iss>\b(?P<vi_vol>\d{1,4}[A-Za-z]?)\s*\(\s*(?P<vi_iss>\d{1,4}(?:\s*[-/]\s*\d{1,4})?|[A-Z]\d{0,2}|Suppl\.? ?\d*)\s*\))"
    r"|(?P<colon>\b(?P<c_left>\d{1,4}):\s*(?P<c_right>" + _PAGE + r"(?:\s*-\s*" + _PAGE + r")?)\b)"
    r"|(?P<date>\b(?:\d{1,2}(?:\s*-\s*\d{1,2})?\s+)?"
    + _MONTH
    + r"(?:\s+\d{1,2}(?:\s*-\s*\d{1,2})?)?,?(?=\s*(?:"
    + _YEAR
    + r")?\b))"
    r"|(?P<year_p>\(\s*(?P<yp>" + _YEAR + r")\s*\))"
    r"|(?P<range>\b(?P<r_a>" + _PAGE + r")\s*-\s*(?P<r_b>" + _PAGE + r")\b)"
    r"|(?P<year>(?<![-/])\b" + _YEAR + r"\b)"  # "JCRAI-2021", "IPAC2018": part of a name
    r"|(?P<num>(?<!['’‘/-])\b(?P<n>" + _PAGE + r")\b)",  # "CHI ’23": the year belongs to the name
    re.IGNORECASE,
)

# words that start lines that are not citation lines, though they hold numbers
# a line about funding or history, or one citing another work (a footnote: its marker, then authors' initials)
_OTHER_LINE = re.compile(
    r"\b(?:grant|grants|funded|funding|supported by|acknowledg\w*|award|fellowship|first published|reprinted)\b|"
    r"^\s*(?:\[\d{1,3}\]|\d{1,3}\s*(?=[A-Z]\.))|(?:\b[A-Z]\.\s?){1,3}[A-Z][a-z]+(?:,| and\b| &)",
    re.IGNORECASE,
)
_NOT_A_CITATION = re.compile(
    r"^(?:received|accepted|revised|published|available online|submitted|copyright|©|\(c\)|doi|https?:|www\.|"
    r"e-?mail|tel|fax|correspond|keywords?|abstract|issn|isbn|figure|fig\.|table|arxiv|"
    r"收稿|修回|基金|作者简介|通信作者|通讯作者|中图分类号|文献标志码|文献标识码|关键词|摘要)",
    re.IGNORECASE,
)


@dataclass
class CitationNumbers:
    venue: str | None = None
    volume: str | None = None
    issue: str | None = None
    pages: str | None = None
    year: int | None = None
    labelled: bool = False  # a "Vol."/"No."/"pp."/卷/期 label said what a number is
    compound: bool = False  # numbers in a journal's own notation: "26(1)", "456 (1999)", "26:1", "147-154"

    def score(self) -> int:
        return (
            (2 if self.venue else 0)
            + (2 if self.volume else 0)
            + (1 if self.issue else 0)
            + (2 if self.pages else 0)
            + (1 if self.year else 0)
        )


def _page_value(a: str, b: str | None = None) -> str | None:
    """A page range as "first-last" (an abbreviated last page written out: 147-54 -> 147-154), or one page or
    article number as printed."""
    if b is None:
        return a
    if a.isdigit() and b.isdigit():
        if len(b) < len(a):
            b = a[: len(a) - len(b)] + b
        if int(b) < int(a) or int(b) - int(a) > 3000:
            return None  # not a range of pages (a date, a grant number)
    return f"{a}-{b}"


def _plausible_volume(text: str) -> bool:
    digits = re.match(r"\d+", text)
    return bool(digits) and 0 < int(digits.group(0)) < 2000 or not digits


# identifiers whose digits are no volume or page: DOIs, links, ISBN/ISSN, e-mail addresses, prices
_NOT_NUMBERS = re.compile(
    r"(?:doi:?\s*|https?://\S*|digital object identifier:?\s*)?\b10\.\d{4,9}/\S+|https?://\S+|www\.\S+|"
    r"\b\d{4}-\d{4}-\d{4}-\d{3}[\dX]\b|\bISBN(?:-1[03])?:?\s*[\dX-]{10,17}|\b97[89]-[\d-]{11,15}\b|\b(?:e-?)?ISSN:?\s*\d{4}-\d{3}[\dX]|\S+@\S+|[$€£]\s*\d+(?:\.\d\d)?",
    re.IGNORECASE,
)


@dataclass
class _Reading:
    """The state of one line's reading: what each token said, where the pages and the name's end are."""

    text: str
    found: CitationNumbers = field(default_factory=CitationNumbers)
    first: int | None = None  # where the first number with a role starts: the name ends there
    pages_at: int = 1 << 30
    loose: list[tuple[int, str]] = field(default_factory=list)  # bare numbers, given a role after the others


def _set(found: CitationNumbers, name: str, value) -> None:
    if getattr(found, name) is None and value:
        setattr(found, name, value)


def _on_labelled(r: _Reading, m: re.Match) -> bool:
    f = r.found
    f.labelled = True
    if m.group("vol_label") or m.group("cn_vol"):
        _set(f, "volume", m.group("vol_l") or m.group("cn_vol_n"))
    elif m.group("iss_label") or m.group("cn_iss"):
        _set(f, "issue", re.sub(r"\s+", "", m.group("iss_l") or m.group("cn_iss_n")))
    elif f.pages is None:
        a, _, b = re.sub(r"\s+", "", m.group("pp_l")).partition("-")
        f.pages, r.pages_at = _page_value(a, b or None), m.start()
    return True


def _on_year(r: _Reading, m: re.Match) -> bool:
    _set(r.found, "year", int(m.group("cn_year_n") or m.group("yp") or m.group("year")))
    return True


def _on_vol_year(r: _Reading, m: re.Match) -> bool:
    r.found.compound = True
    _set(r.found, "volume", m.group("vy_vol"))
    _set(r.found, "year", int(m.group("vy_year")))
    return True


def _on_vol_issue(r: _Reading, m: re.Match) -> bool:
    f = r.found
    f.compound = True
    if re.fullmatch(_YEAR, m.group("vi_vol")):  # "2014(26)": a year, then the volume
        _set(f, "year", int(m.group("vi_vol")))
        _set(f, "volume", m.group("vi_iss"))
    else:
        _set(f, "volume", m.group("vi_vol"))
        _set(f, "issue", re.sub(r"\s+", "", m.group("vi_iss")))
    return True


def _on_colon(r: _Reading, m: re.Match) -> bool:
    f = r.found
    left, right = m.group("c_left"), re.sub(r"\s+", "", m.group("c_right"))
    if re.fullmatch(_YEAR, left):
        return False  # "2019: 12" is not a volume
    f.compound = True
    rest = r.text[m.end() :]
    if f.volume and not f.issue and "-" not in right and re.match(r"\s*[,;]?\s*\d", rest):
        f.issue = right  # "Vol. 26:1, 147-154"
    elif not f.volume and "-" not in right and re.match(r"\s*[,;]\s*(?:pp?\.\s*)?\d+\s*-\s*\d", rest):
        f.volume, f.issue = left, right  # "26:1, 147-154"
    else:  # "13:21", "26:147-154": the volume, then its article or pages
        _set(f, "volume", left)
        a, _, b = right.partition("-")
        _set(f, "pages", _page_value(a, b or None))
    return True


def _on_date(r: _Reading, m: re.Match) -> bool:
    return bool(re.search(r"[A-Za-z]{3}", m.group("date")))


def _on_range(r: _Reading, m: re.Match) -> bool:
    value = _page_value(m.group("r_a"), m.group("r_b"))
    if not value:
        return False
    r.found.compound = True
    if r.found.pages is None:
        r.found.pages, r.pages_at = value, m.start()
    return True


def _on_number(r: _Reading, m: re.Match) -> bool:
    r.loose.append((m.start(), m.group("n")))
    return True


# What each kind of token says, by the name of its group in _TOKEN (a token's role may also be "none").
_TOKEN_ROLES = {
    "vol_label": _on_labelled,
    "iss_label": _on_labelled,
    "pp_label": _on_labelled,
    "cn_vol": _on_labelled,
    "cn_iss": _on_labelled,
    "cn_year": _on_year,
    "vol_year": _on_vol_year,
    "vol_iss": _on_vol_issue,
    "colon": _on_colon,
    "date": _on_date,
    "year_p": _on_year,
    "range": _on_range,
    "year": _on_year,
    "num": _on_number,
}


def _without_folio(text: str) -> tuple[str, str | None]:
    """The line without the page's own number that leads or ends a running head ("484 | NATURE | VOL 529 | ...",
    "148 Proceedings of the IEEE | Vol. 104"), and that number."""
    separated = bool(re.search(r"[|•·]|\bvol\b", text, re.IGNORECASE))
    folio = (
        re.match(r"^\s*(\d{1,5})\s*[|•·]\s*(?=\D)", text)
        or re.search(r"(?<=\D)[|•·]\s*(\d{1,5})\s*$", text)
        or (separated and re.match(r"^\s*(\d{1,5})\s+(?=[A-Z])", text))
        or (separated and re.search(r"(?<=[A-Za-z])\s+(\d{1,5})\s*$", text))
    )
    if not folio or re.search(r"(?i:" + _MONTH + r")\s+" + _YEAR + r"\s*$", text[: folio.end()]):
        return text, None  # "..., JANUARY 2004": a date, not a page
    return text[: folio.start()] + " " + text[folio.end() :], folio.group(1)


def read_numbers(line: str) -> CitationNumbers | None:
    """The volume, issue, pages and year of a printed journal or proceedings line, with the name before them;
    None when the line has none of these in a known shape."""
    text = normalise_line(line)
    if not text or len(text) > 320 or _NOT_A_CITATION.match(text) or _OTHER_LINE.search(text):
        return None
    text = _REPORT_NUMBER_SHAPE.sub(" ", _NOT_NUMBERS.sub(" ", text))
    text, folio = _without_folio(text)
    r = _Reading(text)
    for match in _TOKEN.finditer(text):
        if match.lastgroup and _TOKEN_ROLES[match.lastgroup](r, match) and r.first is None:
            r.first = match.start()
    found = r.found
    for at, number in r.loose:  # "Machine Learning, 20, 273-297 (1995)", "PRL 116, 061102 (2016)"
        if not found.volume and at < r.pages_at and _plausible_volume(number):
            found.volume = number
        elif found.volume and not found.pages and number != found.volume:
            found.pages = number
    if folio and not found.pages and (found.volume or found.labelled):
        found.pages = folio  # its first page, until the page span says how far it runs
    if r.first is None or not (found.volume or found.pages or found.issue):
        return None
    found.venue = venue_name(text[: r.first])
    if found.venue is None and found.labelled:
        found.venue = _named_segment(unicodedata.normalize("NFKC", line))
    # Bare numbers say what they are only beside a year and a name ("Machine Learning, 20, 273-297 (1995)");
    # "Algorithm 1", "ReLU 256" or a line of a table are not citation lines.
    counted = sum(bool(v) for v in (found.volume, found.issue, found.pages, found.year))
    if found.labelled:
        return found if found.venue or counted >= 2 else None
    return found if found.venue and (found.compound or found.year) else None


def _named_segment(text: str) -> str | None:
    """A journal's name set apart from the numbers on its line, after them ("第12卷第3期   环境工程科学学报   2008年6月")."""
    runs = [run for run in re.findall(r"[\u4e00-\u9fff]{4,20}", text)]
    if runs and re.search(r"第\s*\d+\s*[卷期]", text):  # a Chinese journal's name beside its 卷/期: the longest run
        return venue_name(max(runs, key=len))
    for segment in re.split(r"\s{2,}|\s+[|•·]\s+", text):
        if segment.strip() and not re.search(r"\d", segment):
            name = venue_name(segment)
            if name:
                return name
    return None


# -- the venue's name -----------------------------------------------------------------------------------------

_VENUE_WORD = re.compile(r"[^\W\d_][\w.&'-]*")
_VENUE_STOP = re.compile(
    r"\b(?:et al\.?|downloaded|received|accepted|copyright|licen[cs]e|rights reserved|available online|"
    r"corresponding|university|department|e-?mail|http|www)\b",
    re.IGNORECASE,
)
_LEAD_AUTHORS = re.compile(r"^.*?\bet al\.?\s*[:.,]?\s*", re.IGNORECASE)


def _initials(words: list[str]) -> str:
    return "".join(w[0] for w in words if w[:1].isupper() and w.lower() not in ("of", "on", "and", "the", "in"))


def venue_name(text: str) -> str | None:
    """The name that leads a journal line, cleaned: separators and a leading "Smith et al." dropped, a trailing
    acronym of the name itself dropped ("PHYSICAL REVIEW LETTERS PRL"), capitals put in title case; None when the
    text does not read as a name."""
    text = normalise_line(text)
    text = _LEAD_AUTHORS.sub("", text)  # "Smith et al. BMC Health Services Research"
    text = re.sub(
        r"^(?:in|from|(?:published|appear(?:ing|ed|s)?|to appear|presented|accepted)\s+(?:in|at))\s*:?\s+",
        "",
        text,
        flags=re.IGNORECASE,
    )
    text = re.sub(r"[\s|•·,;:/(\[]+$", "", text).strip(" |•·,;:-")
    segments = [seg for seg in re.split(r"\s+[|•·/]\s+|\s{3,}", text) if seg.strip()]
    if len(segments) > 1:  # "JCRAI-2021 / Journal of Physics: ...", "T. Fawcett / Pattern Recognition Letters"
        text = segments[-1].strip()
    if not text or _VENUE_STOP.search(text) or len(text) > 200 or re.search(r",\s*\S", text):
        return None  # a journal's name holds no comma; an address or a list of authors does
    cjk = sum(1 for ch in text if is_cjk(ch))
    if cjk:
        text = re.sub(r"\s+", "", text) if cjk >= 0.8 * len(text.replace(" ", "")) else text
        if re.search(r"[，。：:；;、！？,]", text):
            return None  # a sentence, not a journal's name
        return text if 2 <= cjk <= 20 else None
    words = _VENUE_WORD.findall(text)
    if not words or not (text[:1].isupper() or text[:1].isdigit()):
        return None
    lower = [
        w
        for w in words
        if w[:1].islower()
        and w.lower()
        not in (
            "of",
            "on",
            "and",
            "the",
            "in",
            "for",
            "de",
            "la",
            "und",
            "für",
            "et",
            "des",
            "du",
            "at",
            "to",
            "e",
            "y",
        )
    ]
    if len(lower) > 1 or len(words) > 16:
        return None  # a sentence, not a name
    if len(words) >= 3 and words[-1].isupper() and len(words[-1]) >= 2 and words[-1] == _initials(words[:-1]).upper():
        text = text[: text.rfind(words[-1])].strip(" ,;:-")
    return text if len(text) >= 2 else None  # capitals are put in title case by the metadata reader, which
    # knows how the paper's own text writes each word


# -- cost codes and Chinese article numbers -------------------------------------------------------------------
# A cost code prints the journal's ISSN, the year, the volume and issue and the article's first page or number:
# "0031-9007/16/116(6)/061102(16)". A Chinese article number prints ISSN (year) issue - first page - page count:
# "文章编号: 1001-9081(2019)04-0123-06".
_COST_CODE = re.compile(
    r"\b\d{4}-\d{3}[\dX]/(\d{2})/(\d{1,4})\((\d{1,3}(?:-\d{1,3})?)\)/([A-Za-z]?\d{1,7})(?:\((\d{1,4})\))?"
)
_CN_ARTICLE_NUMBER = re.compile(
    r"\d{4}-\d{3}[\dX]\s*\(\s*(" + _YEAR + r")\s*\)\s*(\d{1,2})\s*-\s*(\d{1,5})\s*-\s*(\d{1,3})"
)


def read_cost_code(text: str) -> CitationNumbers | None:
    text = normalise_line(text)
    match = _COST_CODE.search(text)
    if match:
        first = match.group(4)
        count = match.group(5)
        pages = first
        if count and first.isdigit() and len(first) <= 5 and not first.startswith("0"):
            pages = f"{first}-{int(first) + int(count) - 1}"
        return CitationNumbers(volume=match.group(2), issue=match.group(3), pages=pages, labelled=True)
    match = _CN_ARTICLE_NUMBER.search(text)
    if match:
        first, count = int(match.group(3)), int(match.group(4))
        return CitationNumbers(
            issue=str(int(match.group(2))),
            pages=f"{first}-{first + count - 1}" if count > 0 else str(first),
            year=int(match.group(1)),
            labelled=True,
        )
    return None


# -- the kind of work ---------------------------------------------------------------------------------------

_THESIS_DEGREES = (
    (
        "phd-thesis",
        re.compile(
            r"doctor(?:al)? (?:of|thesis|dissertation)|doctorate|\bph\.?\s?d\b|dr\.\s?rer\.|博士学位论文|博士论文|博士研究生|"
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
            r"bachelor(?:'s|’s|s)? (?:of|thesis|degree)|\bb\.?\s?sc\b|undergraduate thesis|学士学位论文|本科毕业论文|毕业设计|本科生毕业",
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
    r"((?:The )?(?:[A-Z][\w.'&-]*[ \t]+){0,3}(?:University|Universit[äéà]t?|Universidade|Universidad|Università|Institute of Technology|"
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
    r"\b(?:report|tech(?:nical)?\.? rep(?:ort)?\.?|working paper|paper|preprint|memo)\s*(?:no\.?|number|#|nr\.?)\s*[:.]?\s*"
    r"([A-Z0-9][A-Z0-9./_-]{1,30}\d[A-Z0-9./_-]*)",
    re.IGNORECASE,
)
# Two groups of capitals and one of digits ("CMU-CS-96-177", "CEBAF-TH-94-08", "DFPD-2015/TH/20"), or one group of
# capitals and two of digits ("GAO-23-106826", "CERN-PH-EP/2015-075"): "COVID-19" or "GPT-4" are names, not numbers.
_REPORT_NUMBER_SHAPE = re.compile(
    r"(?<![\w./-])((?:[A-Z]{2,10}(?:[-/][A-Z]{1,6}){1,3}[-/]\d{2,6}|[A-Z]{2,10}[-/]\d{2,6}[-/](?:\d{1,6}|[A-Z]{1,6}))"
    r"(?:[-/](?:\d{1,6}|[A-Z]{1,6})){0,3})(?![\w/-])"
)
_CONFERENCE_EVIDENCE = re.compile(
    r"\bproceedings of\b|\bin proceedings\b|\bconference (?:on|of)\b|\bworkshop (?:on|of)\b|\bsymposium (?:on|of)\b|"
    r"\bpublished as a conference paper\b|\bcamera[- ]ready\b|\bfindings of the association\b|"
    r"\b(?:lncs|lnai|lnbi|ccis)\s*\d|\blecture notes in\b|\b(?:19|20)\d\d ieee/?\w* (?:international )?conference\b|"
    r"会议论文|学术会议|国际会议",
    re.IGNORECASE,
)
_PREPRINT_EVIDENCE = re.compile(
    r"\bpreprint\b|\bunder review\b|\bsubmitted to\b|\bwork in progress\b|\bdraft\b|\bnot peer[- ]reviewed\b",
    re.IGNORECASE,
)
_UNDER_REVIEW = re.compile(r"\bunder review\b|\bsubmitted to\b|\bpreprint submitted\b|\bnot peer[- ]reviewed\b", re.I)
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


# A conference's own stamp: its acronym and year, then the dates and the place ("KDD ’18, August 19-23, 2018,
# London, United Kingdom", "SPAA'04, June 27-30, 2004, Barcelona").
_CONFERENCE_STAMP = re.compile(
    r"^\s*([A-Z][A-Za-z&/-]{1,15}(?:[ -][A-Z][A-Za-z&-]{1,15})?\s?['’‘]\d{2})\s*,\s*"
    r"(?:\d{1,2}\s*-?\s*)?(?i:" + _MONTH + r")\s+\d{1,2}"
)


def conference_stamp(lines: list[str]) -> str | None:
    for line in lines:
        match = _CONFERENCE_STAMP.match(normalise_line(line))
        if match:
            return match.group(1)
    return None


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
    r"^\s*(?:citation|cite this(?: article| paper)?(?: as)?|to cite this (?:article|paper)|how to cite(?: this article)?|"
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


def read_printed(pages: PrintedPages) -> Printed:
    """The printed record of a work: its journal or proceedings line(s), the kind of work its pages declare."""
    opening = without_disclaimers(pages.opening)
    front = [normalise_line(line) for line in pages.front if line.strip()]
    margins = [normalise_line(line) for line in pages.margins if line.strip()]
    printed = Printed()
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
    elif pages.venue_hint:
        printed.venue = pages.venue_hint
    stamp = conference_stamp(margins + front[:60])
    if stamp and not printed.venue:
        printed.venue = stamp
    span = pages.page_span
    if span and span[0] >= 1 and span[1] > span[0]:
        first_printed = printed.page_range.split("-")[0] if printed.page_range else None
        if printed.page_range is None and span[0] > 1 and printed.venue:
            printed.page_range = f"{span[0]}-{span[1]}"
        elif first_printed and first_printed == str(span[0]) and "-" not in printed.page_range:
            printed.page_range = f"{span[0]}-{span[1]}"  # "Nature | Vol 574 | ... | 505" and pages to 510
    printed.arxiv_id = arxiv_id(margins + front[:12] + [opening[:3000]])
    printed.work_type = _work_type(printed, pages, opening)
    if printed.work_type.endswith("-thesis") or printed.work_type == "report":
        form = read_form([_squeeze_cjk(normalise_line(line)) for line in opening.splitlines()[:80]])
        printed.cover_title = form.get("title")
        printed.banner_title = title_after_banner(
            [_squeeze_cjk(normalise_line(line)) for line in (pages.title_page or opening).splitlines()[:60]]
        )
        author = form.get("author")
        if author and len(author) <= 60:
            printed.cover_authors = [_squeeze_cjk(author)]
        printed.cover_year = form_year(form.get("date", "")) or _dated_line(pages.title_page or opening[:3000])
    if printed.work_type.endswith("-thesis"):
        printed.publisher = university(_squeeze_cjk(opening[:4000]))
        printed.venue = printed.volume = printed.issue = printed.page_range = None
    elif printed.work_type == "report":
        printed.report_number = report_number(opening[:3000])
        printed.publisher = university(_squeeze_cjk(opening[:3000]))
    if not printed.report_number and printed.work_type in ("preprint", "report"):
        printed.report_number = report_number(" \n ".join(margins + front[:12]))  # a preprint's lab number
    elif printed.work_type in ("preprint", "document"):
        printed.volume = printed.issue = printed.page_range = None
        printed.venue = None
    return printed


def _work_type(printed: Printed, pages: PrintedPages, opening: str) -> str:
    head = _squeeze_cjk(opening[:4000])
    degree = thesis_degree(_squeeze_cjk(pages.title_page or head))
    if degree and not (printed.volume and printed.venue):
        return degree
    near = " ".join(pages.margins + pages.front[:60])
    if _UNDER_REVIEW.search(near) and not (printed.volume or printed.page_range):
        return "preprint"  # "Under review as a conference paper at ...", "Submitted to ..."
    if printed.venue and printed.issue:
        return "journal-article"  # proceedings have no issues ("Proceedings of the IEEE, Vol. 104, No. 1")
    conference = (
        bool(_CONFERENCE_EVIDENCE.search(near))
        or bool(printed.venue and re.search(r"\b(?:proceedings|conference|workshop|symposium)\b", printed.venue, re.I))
        or bool(printed.venue and _CONFERENCE_STAMP.match(printed.venue + ", May 1"))
    )
    if printed.venue and conference and not re.search(r"\b(?:journal|transactions)\b", printed.venue, re.I):
        return "conference-paper"
    if printed.venue and (printed.volume or printed.issue):
        return "journal-article"
    if _UNDER_REVIEW.search(near):
        return "preprint"  # "Under review as a conference paper at ...", "Submitted to ..."
    if _REPORT_WORDS.search(head[:2500]):
        return "report"
    if conference:
        return "conference-paper"
    if _CHAPTER_EVIDENCE.search(head[:2000]):
        return "chapter"
    if printed.venue and (printed.page_range or _JOURNAL_EVIDENCE.search(printed.venue)):
        return "journal-article"
    if printed.arxiv_id or _PREPRINT_EVIDENCE.search(" ".join(pages.margins + pages.front[:30])):
        return "preprint"
    if _ISBN.search(head):  # journals print an ISSN; an ISBN is a book's, or a proceedings volume's
        if (pages.pages or 0) >= BOOK_PAGES:
            return "book"
        if pages.paper_like:
            return "conference-paper"
    if pages.doi and not pages.doi.startswith("10.48550/"):
        return "journal-article"
    if pages.paper_like:
        return "preprint"  # a paper whose pages name no venue
    return DEFAULT_WORK_TYPE


BOOK_PAGES = 60  # an ISBN on a document this long is a book's (shorter: a paper in a proceedings volume)
