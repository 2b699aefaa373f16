"""Citation lines: the venue, volume, issue, pages and year of the lines a paper prints about where it appeared
(journal lines, running heads, cost codes, Chinese 卷/期, conference stamps), read by the shapes those lines take.

May import: text.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field

from ..text import is_cjk

_DASHES = re.compile("[\u2010\u2011\u2012\u2013\u2014\u2015\u2212\ufe58\ufe63\uff0d]")


_MONTHS = (
    "january february march april may june july august september october november december "
    "jan feb mar apr jun jul aug sep sept oct nov dec spring summer autumn fall winter"
).split()


_MONTH = r"(?:" + "|".join(sorted(_MONTHS, key=len, reverse=True)) + r")\.?"


def _unspace(piece: str) -> str:
    """A letter-spaced run ("N A T U R E", "F I E L D  N O T E S", "V O L 5 2 9") as it reads ("NATURE",
    "FIELD NOTES", "VOL 529"): a wider gap between its letters is the gap between its words."""
    tokens = piece.split()
    singles = sum(len(t) == 1 for t in tokens)
    if not (len(tokens) >= 4 and singles >= 0.8 * len(tokens) or len(tokens) == 3 and singles == 3):
        return piece
    joined = " ".join("".join(word.split()) for word in re.split(r"\s{2,}", piece.strip()))
    return re.sub(r"(?<=[A-Za-z])(?=\d)|(?<=\d)(?=[A-Za-z])", " ", joined)


def normalise_line(text: str) -> str:
    """NFKC (full-width digits and brackets), one kind of dash, one space, letter-spacing undone."""
    text = unicodedata.normalize("NFKC", text or "")
    text = _DASHES.sub("-", text).replace("\u00a0", " ").strip()
    text = re.sub(r"[ \t]{3,}", " | ", text)  # a wide gap sets fields of a header line apart
    pieces = [_unspace(piece) for piece in re.split(r"\s+[|•·]\s+", text)]
    return re.sub(r"\s+", " ", " | ".join(pieces)).strip()


_YEAR = r"(?:1[89]\d\d|20\d\d)"


_PAGE = r"[A-Za-z]{0,2}\d{1,7}(?:\.\d{1,4})?"  # "39.1-39.26": a proceedings' article.page


_TOKEN = re.compile(
    r"(?P<vol_label>\b(?:vol(?:ume)?s?\.?|v\.)\s*(?P<vol_l>\d{1,5}[A-Za-z]?)\b)"
    r"|(?P<iss_label>\b(?:no\.|nos\.|num\.|number|issue|iss\.|nr\.|heft|n[°º])\s*(?P<iss_l>\d{1,4}(?:\s*[-/&]\s*\d{1,4})?|[A-Z]\d{0,2})\b)"
    r"|(?P<pp_label>(?:(?<![A-Za-z]\.)\bpp?\.|\bpages?\b:?|\bpage\b:?|\bart(?:icle)?\.?\s*(?:no\.?|number)?|\barticle\s+id\b|\be-?locator\b)\s*"
    r"(?P<pp_l>" + _PAGE + r"(?:\s*-\s*" + _PAGE + r")?)\b)"
    r"|(?P<cn_vol>第\s*(?P<cn_vol_n>\d{1,4})\s*卷)"
    r"|(?P<cn_iss>第\s*(?P<cn_iss_n>\d{1,4})\s*期)"
    r"|(?P<cn_year>(?P<cn_year_n>" + _YEAR + r")\s*年)"
    r"|(?P<vol_year>\b(?P<vy_vol>\d{1,4})\s*\(\s*(?P<vy_year>" + _YEAR + r")\s*\))"
    r"|(?P<vol_iss>\b(?P<vi_vol>\d{1,4}[A-Za-z]?)\s*\(\s*"
    r"(?P<vi_iss>\d{1,4}(?:\s*[-/]\s*\d{1,4})?|[A-Z]\d{0,2}|Suppl\.? ?\d*)\s*\))"
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
    r"(?i:\b(?:grant|grants|funded|funding|supported by|acknowledg\w*|award|fellowship|first published|reprinted)\b)|"
    r"^\s*(?:\[\d{1,3}\]|\d{1,3}\s*(?=[A-Z]\.))",
)
# Authors' initials and names before a venue: a footnote citing another work ("A. Smith, B. Lee, Phys. Rev. B 65,
# ..."), unless a separator sets them apart as a running head does ("M.A. Bender, M. Farach / Theoretical ...").
_CITED_AUTHORS = re.compile(r"(?:\b[A-Z]\.\s?){1,3}[A-Z][a-z]+(?:,| and\b| &)")
_HEAD_SEPARATOR = re.compile(r"\s[/|•·]\s")


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
    return "." not in text and (digits is None or 0 < int(digits.group(0)) < 2000)


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
    if re.fullmatch(_YEAR, left) or re.fullmatch(r"[0-5]\d", right) and right.startswith("0"):
        return False  # "2019: 12" is not a volume, "5:02" is a time
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
    if _CITED_AUTHORS.search(text) and not _HEAD_SEPARATOR.search(text):
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
    """A journal's name set apart from the numbers on its line, after them
    ("第12卷第3期   环境工程科学学报   2008年6月")."""
    runs = [run for run in re.findall(r"[\u4e00-\u9fff]{4,20}", text)]
    if runs and re.search(r"第\s*\d+\s*[卷期]", text):  # a Chinese journal's name beside its 卷/期: the longest run
        return venue_name(max(runs, key=len))
    for segment in re.split(r"\s{2,}|\s+[|•·]\s+", text):
        if segment.strip() and not re.search(r"\d", segment):
            name = venue_name(segment)
            if name:
                return name
    return None


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
        if re.search(r"[，。：:；;、！？,《》「」“”()（）]", text):
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


# Two groups of capitals and one of digits ("CMU-CS-96-177", "CEBAF-TH-94-08", "DFPD-2015/TH/20"), or one group of
# capitals and two of digits ("GAO-23-106826", "CERN-PH-EP/2015-075"): "COVID-19" or "GPT-4" are names, not numbers.
_REPORT_NUMBER_SHAPE = re.compile(
    r"(?<![\w./-])((?:[A-Z]{2,10}(?:[-/][A-Z]{1,6}){1,3}[-/]\d{2,6}|[A-Z]{2,10}[-/]\d{2,6}[-/](?:\d{1,6}|[A-Z]{1,6}))"
    r"(?:[-/](?:\d{1,6}|[A-Z]{1,6})){0,3})(?![\w/-])"
)


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
