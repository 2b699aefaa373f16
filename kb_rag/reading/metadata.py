"""Metadata: title, authors, venue and language from a paper's first pages (its DOI and year: reading.identifiers;
the kind of work, volume, issue and pages: reading.printed).

May import: config, reading.blocks, reading.identifiers, reading.names, reading.pdf, reading.printed,
reading.structure, text.
"""

from __future__ import annotations

import html
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..config import BIB_FIELDS
from ..reading.blocks import Block, Extracted, HeaderLine, canonical_section, run_in_abstract
from ..reading.identifiers import _CN_JOURNAL, _doi_from_text, arxiv_doi, find_doi, guess_year
from ..reading.names import (
    _AFFILIATION_WORDS,
    _NAME_SEPARATOR,
    _NAME_SUFFIX,
    _ORGANISATION_WORDS,
    _clean_name,
    is_person_name,
    name_case,
)
from ..reading.pdf import NAME_BREAK
from ..reading.printed import CITATION_BLOCK, DEFAULT_WORK_TYPE, DEGREE_BANNER, WORK_TYPES, PrintedPages, read_printed
from ..reading.structure import _BANNER, _SUPERSCRIPT_GROUP, is_running_prose, join_lines
from ..text import _CJK_RUN_OR_WORD, cjk_ratio, clean_field, is_cjk, text_language

METADATA_FIELDS = ("title", "authors", "year", "journal", "doi", *BIB_FIELDS)
METADATA_SOURCES = ("extracted", "crossref", "zotero")  # where a stored field came from (docs.metadata_source)
BIB_TEXT_LIMIT = 300  # characters kept of a volume, issue, page range, publisher, report number or arXiv id


@dataclass
class DocMeta:
    title: str
    authors: list[str]
    year: int | None
    journal: str | None
    doi: str | None
    lang: str
    work_type: str = DEFAULT_WORK_TYPE
    volume: str | None = None
    issue: str | None = None
    page_range: str | None = None
    publisher: str | None = None
    report_number: str | None = None
    arxiv_id: str | None = None
    authors_more: bool = False  # the byline is not the whole list ("et al.", a collaboration listed elsewhere)

    def __post_init__(self):
        # whatever the source (layout, file metadata, Zotero, Crossref), no control residue is stored
        self.title = clean_field(self.title)
        self.authors = [name for name in (clean_field(a) for a in self.authors or []) if name]
        if self.authors and self.authors[-1].lower().rstrip(".") in ("et al", "others", "等", "等人"):
            self.authors = [a for a in self.authors[:-1] if a.lower().rstrip(".") != "et al"]
            self.authors_more = True
        self.journal = clean_field(self.journal) or None
        self.doi = clean_field(self.doi).replace(" ", "").lower() or None if self.doi else None
        if self.work_type not in WORK_TYPES:
            self.work_type = DEFAULT_WORK_TYPE
        for name in ("volume", "issue", "page_range", "publisher", "report_number", "arxiv_id"):
            value = clean_field(str(getattr(self, name) or ""))[:BIB_TEXT_LIMIT]
            setattr(self, name, value or None)
        if self.page_range:  # one kind of dash, as a reference list prints it
            self.page_range = re.sub(r"\s*[\u2010-\u2015\u2212-]+\s*", "-", self.page_range)
        self.authors_more = bool(self.authors_more)

    def bib_columns(self) -> dict:
        """The bibliographic fields as ``docs`` stores them."""
        return {name: int(self.authors_more) if name == "authors_more" else getattr(self, name) for name in BIB_FIELDS}

    @classmethod
    def from_row(cls, row, lang: str | None = None) -> DocMeta:
        """The metadata a ``docs`` row holds."""
        keys = row.keys()
        return cls(
            title=row["title"],
            authors=json.loads(row["authors"] or "[]"),
            year=row["year"],
            journal=row["journal"],
            doi=row["doi"],
            lang=lang if lang is not None else row["lang"] or "",
            **{name: row[name] for name in BIB_FIELDS if name in keys and row[name] is not None},
        )


_JUNK_TITLE = re.compile(
    r"^(?:microsoft word|untitled|title|document\d*|slide \d+|proceedings template|"
    r"paper template)\b|\.(?:pdf|docx?|tex|dvi|ps|txt)$",
    re.IGNORECASE,
)


def _plausible_title(text: str | None) -> bool:
    if not text:
        return False
    text = text.strip()
    if _JUNK_TITLE.search(text) or len(text) > 300:
        return False
    return len(text.split()) >= 3 or sum(1 for ch in text if is_cjk(ch)) >= 4


def _clean_title(text: str) -> str:
    text = re.sub("[\u2010\u2011]", "-", text)
    return re.sub(r"\s+", " ", text).strip(" .:;-*†‡§¶∗⋆")[:300]


def _printed(value: str, text: str) -> bool:
    """Most of a file-metadata value (its words, or the character pairs of its CJK runs) is printed in ``text``:
    a PDF's Title and Author are often a template's or a machine's ("番茄花园", "Administrator")."""

    def pieces(t: str) -> set[str]:
        found: set[str] = set()
        for run in _CJK_RUN_OR_WORD.findall(t.casefold()):
            if is_cjk(run[0]):
                found.update(run[i : i + 2] for i in range(max(1, len(run) - 1)))
            else:
                found.add(run)
        return found

    wanted = pieces(value)
    return bool(wanted) and len(wanted & pieces(text)) >= 0.6 * len(wanted)


def _split_authors(raw: str) -> list[str]:
    raw = (raw or "").strip()
    if not raw or not any(ch.isalpha() for ch in raw) or len(raw) > 500:
        return []
    parts = re.split(r"\s*;\s*|\s+and\s+|\s*&\s*|\s*，\s*|\s*、\s*", raw)
    if len(parts) == 1 and raw.count(",") >= 1:
        pieces = [p.strip() for p in raw.split(",")]
        # "Smith, John" is one person; "John Smith, Jane Doe" is two
        if not (len(pieces) == 2 and len(pieces[0].split()) == 1 and len(pieces[1].split()) <= 2):
            parts = pieces
    names = [p.strip() for p in parts if p.strip() and any(ch.isalpha() for ch in p)][:50]
    # login names and tool names ("jsmith", "Administrator") are not authors
    return names if any(" " in n or "," in n or cjk_ratio(n) > 0.5 for n in names) else []


_JOURNAL_LINE = re.compile(
    r"((?:journal of|proceedings of|transactions on|ieee transactions on|acm transactions on|"
    r"physical review|annals of|international journal of)[^\n,;()\d]{3,80})",
    re.IGNORECASE,
)


def _front_blocks(extracted: Extracted) -> list[Block]:
    """Page 1 (or the first blocks of a format without pages), up to the first section heading."""
    blocks = [b for b in extracted.blocks if b.page in (1, None)][:40]
    for i, block in enumerate(blocks):
        if block.role == "heading" and i > 0:
            return blocks[:i]
    return blocks


def _title_from_blocks(blocks: list[Block]) -> str | None:
    title = " ".join(b.text for b in blocks if b.role == "title")
    return title if _plausible_title(title) and not _BANNER.search(title) else None


def _authors_from_blocks(blocks: list[Block], title: str = "") -> list[str]:
    """Names in the paragraphs under a title (DOCX, Markdown, and PDFs whose layout gave none): one paragraph per
    author or one byline, through an "Authors" heading or a note or two before it, up to the first paragraph
    after them that is not a byline."""
    names: list[str] = []
    after_title, misses = False, 0
    for block in blocks:
        if block.role == "title" or (not after_title and title and _clean_title(block.text) == title):
            after_title = True
            continue
        if not after_title or block.role in ("caption", "reference"):
            continue
        found = names_in_text(block.text) if len(block.text) <= 600 and not canonical_section(block.text) else None
        if found:
            names.extend(n for n in found if n not in names)
            continue
        misses += 1
        if names or misses > 3:
            break
    return names[:1000]


# A conference paper names its proceedings in a line of its own, often the footer of page 1: "Proceedings of the
# 58th Annual Meeting of the ..., pages 4969-4983", "2010 International Conference on ...", "Findings of ...".
# The words before "Conference on" are capitalised or numbers ("2010 International", "1st"): a sentence that
# mentions a conference ("presented at the Conference on ...") is not the venue line.
_VENUE_LINE = re.compile(
    r"^\s*(?:[Ii]n:?\s+)?((?:[Pp]roceedings of|PROCEEDINGS OF|[Ff]indings of the Association|"
    r"(?:(?:\d{1,4}(?:st|nd|rd|th)?|[A-Z][\w/&'-]*)\s+){0,6}?"
    r"(?:Conference|Workshop|Symposium|CONFERENCE|WORKSHOP|SYMPOSIUM)\s+(?:on|of|ON|OF)\s)"
    r"[^\n]{4,200})"
)
_VENUE_TAIL = re.compile(
    r",\s*(?:pages|pp\.?|vol\.?|volume|no\.)\s.*$|(?<=\)),\s.*$|\s+(?:pages|pp\.)\s*\d.*$", re.IGNORECASE
)


def _venue_from_page(page_one: list[Block]) -> str | None:
    """The proceedings a conference paper's page 1 names in a line of its own (header or footer)."""
    for block in page_one:
        match = _VENUE_LINE.match(block.text) if len(block.text) < 300 else None
        if match:
            venue = _VENUE_TAIL.sub("", re.sub(r"\s+", " ", match.group(1))).strip(" .,;:")
            if len(venue.split()) >= 3 and len(venue) <= 200:
                return venue
    return None


# Journals whose names begin "Proceedings of ..." (an article there is not a conference paper).
_JOURNAL_PROCEEDINGS = re.compile(
    r"^proceedings of the (?:national academy|royal society|ieee\b|vldb|acm on|"
    r"american mathematical|london mathematical|edinburgh|cambridge philosophical|"
    r"japan academy|indian academy|estonian academy|physical society)",
    re.IGNORECASE,
)
_CONFERENCE_VENUE = re.compile(r"\b(?:proceedings|conference|workshop|symposium|findings of the)\b", re.IGNORECASE)


def venue_is_proceedings(venue: str | None) -> bool:
    """The venue is a conference's proceedings (BibTeX @inproceedings), not a journal."""
    return bool(
        venue
        and _CONFERENCE_VENUE.search(venue)
        and not _JOURNAL_PROCEEDINGS.match(venue)
        and not re.search(r"\b(?:journal|transactions|letters)\b|conference series", venue, re.IGNORECASE)
    )


# Above this share of numbers among its words, page 1 is a table (a supplement's results), not a paper's front
# page: the corpus's front pages stay under 0.15, its table-only pages reach 0.18 and more.
TABLE_NUMBER_SHARE = 0.15


def number_share(text: str) -> float:
    words = text.split()
    return sum(1 for w in words if re.fullmatch(r"[\d.,%±()+\-–]+", w) and any(c.isdigit() for c in w)) / max(
        1, len(words)
    )


def _journal_from_text(front: str, blocks: list[Block]) -> str | None:
    head = "\n".join(b.text for b in blocks[:8])
    match = _JOURNAL_LINE.search(head) or _JOURNAL_LINE.search(front[:1500])
    name = re.sub(r"\s+", " ", match.group(1)).strip(" .:")[:120] if match else ""
    if name and not re.search(r"\b(?:of|the|on|in|for|and)$", name, re.IGNORECASE):  # not cut at a number
        return name
    match = _CN_JOURNAL.search(front[:800])
    if match:
        return (match.group(1) or match.group(2)).strip()
    return None


# -- the front matter of a PDF, read from its layout ----------------------------
# Page 1 (page 2 behind a cover page) is read line by line with its typography: the title is the largest text
# of the header that is not a banner, a label or a journal line; the byline is the run of name lines under it,
# with raised affiliation marks and wide gaps keeping the names apart.

_COVER_PAGE = re.compile(
    r"see discussions, stats,? and author profiles|all content following this page was uploaded|"
    r"your use of the jstor archive|jstor is a not-for-profit|brought to you by core|"
    r"is brought to you for free and open access by",
    re.IGNORECASE,
)
_HEADER_LABELS = (
    "research article",
    "original research article",
    "original article",
    "review article",
    "open access",
    "original research",
    "research paper",
    "full paper",
    "short communication",
    "brief report",
    "brief communication",
    "rapid communication",
    "case report",
    "technical note",
    "mini review",
    "article",
    "review",
    "letter",
    "letters",
    "perspective",
    "commentary",
    "editorial",
    "communication",
    "research",
    "report",
    "notes",
    "selected for a viewpoint in physics",
    "editors' suggestion",
    "editor's suggestion",
    "featured in physics",
    "accepted manuscript",
    "author manuscript",
    "check for updates",
    "peer reviewed",
    "open",
)
_LABEL_LINE = re.compile(r"^(?:(?:" + "|".join(map(re.escape, _HEADER_LABELS)) + r")\b[\s|•·,:;/-]*)+$", re.IGNORECASE)
# a multi-word label printed on the title's own line ("Research Article Patient Experiences of ...")
_GLUED_LABEL = re.compile(
    r"^(?i:research article|original (?:research )?article|review article|open access|"
    r"original research|research paper|short communication|brief report|case report|"
    r"technical note)\s*[:|•·—–-]?\s+(?=[A-Z0-9\u4e00-\u9fff])"
)
_HEADER_NOISE = re.compile(
    r"\b(?:doi\b|https?://|www\.|e-?mail|@|issn|isbn|vol\.|volume \d|©|copyright|"
    r"arxiv:|preprint|submitted to|accepted for|received\b|published\b|available online|"
    r"typeset using|draft version|licen[cs]e)",
    re.IGNORECASE,
)
_FRONT_MATTER_END = re.compile(
    r"^\s*(?:abstract|summary|a\s?b\s?s\s?t\s?r\s?a\s?c\s?t|key\s?words|index terms|"
    r"article info|article history|received\b|accepted\b|published\b|citation:|"
    r"cite this|correspondence|introduction|摘\s*要|关键词|引\s*言)",
    re.IGNORECASE,
)


def _letter_spaced(text: str) -> bool:
    """A journal banner set with spaces between letters ("P H Y S I C A L  R E V I E W")."""
    tokens = text.split()
    return len(tokens) >= 5 and sum(len(t) == 1 for t in tokens) >= 0.7 * len(tokens)


def _banner_line(text: str) -> bool:
    text = text.strip()
    return (
        not text
        or _LABEL_LINE.match(text) is not None
        or _letter_spaced(text)
        or _BANNER.search(text) is not None
        or _HEADER_NOISE.search(text) is not None
        or _COVER_PAGE.search(text) is not None
    )


def _title_banner(text: str) -> bool:
    return (
        _LABEL_LINE.match(text) is not None
        or _letter_spaced(text)
        or _BANNER.search(text) is not None
        or _COVER_PAGE.search(text) is not None
    )


def _header_text(line: HeaderLine) -> str:
    return re.sub(r"\s+", " ", line.header.replace(NAME_BREAK, " ")).strip()


def _title_runs(lines: list[HeaderLine]) -> list[list[HeaderLine]]:
    """Consecutive lines of one size set close together: the pieces a title can be made of."""
    runs: list[list[HeaderLine]] = []
    for line in lines:
        if runs:
            last = runs[-1][-1]
            gap = line.bbox[1] - last.bbox[3]
            if (
                abs(line.size - last.size) <= 0.6
                and (line.bold == last.bold or gap <= 0.6 * line.size)
                and -line.size <= gap <= 1.5 * line.size
                and not _banner_line(_header_text(line))
            ):
                runs[-1].append(line)
                continue
        runs.append([line])
    return runs


def _run_text(run: list[HeaderLine]) -> str:
    while len(run) > 1 and _title_banner(_header_text(run[0])):
        run = run[1:]
    text = join_lines(_SUPERSCRIPT_GROUP.sub(" ", line.text) for line in run)  # footnote numbers dropped
    text = re.sub(r"(?<=[^\W\d_])- (?=[^\W\d_])", "-", text)  # "Multi-" / "Armed": a compound broken at its hyphen
    return _GLUED_LABEL.sub("", text).rstrip()


def _run_title(run: list[HeaderLine]) -> str:
    return _clean_title(_run_text(run))


_COLLABORATION = re.compile(r"\bcollaborations?\b", re.IGNORECASE)
_BYLINE_LEAD = re.compile(r"^\s*(?:authors?|by|written by|作者)\s*[:：]?\s+", re.IGNORECASE)
_BYLINE_DATE = re.compile(
    r"\s+on\s+(?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.?\s+\d.*$", re.IGNORECASE
)


@dataclass
class _BylinePieces:
    pieces: list[str]
    open_end: bool  # the text stops inside a name (no separator after its last piece)
    hyphen: bool  # ... and inside a word broken with a hyphen ("Paulo Ro-")
    affiliated: bool  # the text also names an institution ("TAL AUGUST, University of Washington")


def _byline_pieces(text: str) -> _BylinePieces | None:
    """The text cut into name-sized pieces, or None where it cannot be a byline (a banner, the abstract)."""
    plain = re.sub(r"\s+", " ", text.replace(NAME_BREAK, " ")).strip()
    if not plain or len(plain) > 600 or _banner_line(plain) or _FRONT_MATTER_END.match(plain):
        return None
    if _COLLABORATION.search(plain):
        entry = _clean_name(re.sub(r"\s*\((?![^)]*collaboration).*$", "", plain, flags=re.IGNORECASE))
        return _BylinePieces([entry], False, False, False) if entry and not _AFFILIATION_WORDS.search(entry) else None
    text = _BYLINE_DATE.sub("", _BYLINE_LEAD.sub("", text))
    text = re.sub(r"\S+@\S+|\([^)]*\)|\[[^\]]*\]|\b\d{4}-\d{4}-\d{4}-\d{3}[\dX]\b", NAME_BREAK, text)  # ORCID too
    stripped = text.rstrip()
    hyphen = bool(re.search(r"[^\W\d_]-$", stripped))
    open_end = hyphen or not (stripped[-1:] in (NAME_BREAK, ",", ";", "&") or re.search(r"\band$", stripped))
    pieces = [p for p in (_clean_name(p) for p in _NAME_SEPARATOR.split(text)) if p and p.lower() != "by"]
    return _BylinePieces(
        pieces, open_end, hyphen, bool(_AFFILIATION_WORDS.search(plain) or _ORGANISATION_WORDS.search(plain))
    )


def _judge_names(pieces: list[str], affiliated: bool) -> list[str] | None:
    """The names among a byline's pieces, or None when too few of them are names for a byline."""
    names: list[str] = []
    for piece in pieces:
        if _NAME_SUFFIX.match(piece) and names:
            suffix = piece.rstrip(".")
            names[-1] = f"{names[-1]}, {suffix}{'.' if suffix.lower() in ('jr', 'sr') else ''}"
        elif piece.lower().rstrip(".") == "et al":
            names.append("et al.")
        elif cjk_ratio(piece) > 0.5 and " " in piece and all(2 <= len(p) <= 4 for p in piece.split()):
            names.extend(piece.split())
        else:
            names.append(piece)
    if affiliated:  # "NAME, Institution, Country": the names that lead the line, then the affiliation
        leading = []
        for name in names:
            if not (name == "et al." or is_person_name(name)):
                break
            leading.append(name)
        return [name_case(n) for n in leading] or None
    good = [
        n if n == "et al." or _COLLABORATION.search(n) else name_case(n)
        for n in names
        if n == "et al." or _COLLABORATION.search(n) or is_person_name(n)
    ]
    if not good or len(good) < 0.6 * len(names):
        return None
    return good


def names_in_text(text: str) -> list[str] | None:
    """The names a byline prints, or None when the text is not a byline. NAME_BREAK separates names too."""
    parsed = _byline_pieces(text)
    return _judge_names(parsed.pieces, parsed.affiliated) if parsed else None


def _cover_page(lines: list[HeaderLine]) -> bool:
    """Page 1 is a repository's cover page, or blank, and the paper starts on page 2."""
    first = [line for line in lines if line.page == 1]
    return any(line.page == 2 for line in lines) and (
        any(_COVER_PAGE.search(line.text) for line in first) or sum(len(line.text.strip()) for line in first) < 20
    )


def read_pdf_header(lines: list[HeaderLine], body_size: float) -> tuple[str | None, list[str]]:
    """(title, authors) of a PDF read from the layout of its first page, or of page 2 behind a cover page."""
    page = 2 if _cover_page(lines) else 1
    following = [line for line in lines if line.page == page + 1]
    lines = [line for line in lines if line.page == page]
    if not lines:
        return None, []
    height = lines[0].page_height or max(line.bbox[3] for line in lines)
    runs = [
        run
        for run in _title_runs(lines)
        if run[0].bbox[1] < 0.7 * height
        and len(run) <= 6
        and (run[0].size >= max(body_size * 1.08, 1.0) or (run[0].bold and run[0].size >= body_size))
    ]
    for run in sorted(runs, key=lambda r: (-round(r[0].size * 2), not r[0].bold)):  # bold wins a tie in size
        found = _title_and_byline(run, lines, following)
        if found and (found[1] or run[0].size >= body_size * 1.08):  # bold body text needs names under it
            return found
    # a title set at body size (all capitals, say): the lines right above the first byline
    for index, line in enumerate(lines):
        if line.bbox[1] > 0.5 * height:
            break
        if index == 0 or not names_in_text(line.header):
            continue
        run = []
        for above in reversed(lines[max(0, index - 4) : index]):
            if _title_banner(_header_text(above)) or (
                run and (abs(above.size - run[0].size) > 0.6 or above.bold != run[0].bold)
            ):
                break
            run.insert(0, above)
        found = _title_and_byline(run, lines, following) if run else None
        if found and found[1] and len(found[0].split()) >= 3:
            return found
    return None, []


def _reads_as_words(text: str) -> bool:
    """Most of it is words (not a formula or the glyph salad of a broken text layer)."""
    if cjk_ratio(text) > 0.5:
        return True
    tokens = text.split()
    words = [
        t
        for t in tokens
        if re.fullmatch(r"[(\"'“‘]?[^\W\d_][^\W_]*(?:[-'’][^\W_]+)*[)\"'”’:;,.?!]*", t)
        and sum(ch.isalpha() for ch in t) >= 2
        or t.lower() in ("a", "i")
    ]
    return bool(tokens) and len(words) >= 0.6 * len(tokens)


# A title does not end on an article, a preposition or a word broken at its hyphen: the next line goes on with it.
_CONTINUES = re.compile(
    r"(?:\b(?:the|a|an|of|for|and|or|in|on|at|to|with|by|from|via|into|towards?|between|under|over|using)|"
    r"[^\W\d_]-)$",
    re.IGNORECASE,
)
# The wording of notices (disclaimers, licences, repository stamps), which can be set large on a cover or scan.
_NOT_A_TITLE = re.compile(
    r"\b(?:constitute or imply|do(?:es)? not necessarily (?:state|reflect|represent)|reference herein|"
    r"endorse(?:d|ment)? (?:by|of) the|licen[cs]ed under|all rights reserved|creative commons|"
    r"this (?:article|paper|work|document) (?:is|was|has been) (?:protected|made available|downloaded|"
    r"published under)|downloaded (?:from|by)|for personal use only)\b",
    re.IGNORECASE,
)


def _title_and_byline(
    run: list[HeaderLine], lines: list[HeaderLine], following: list[HeaderLine] | None = None
) -> tuple[str, list[str]] | None:
    title = _run_title(run)
    after = lines.index(run[-1]) + 1 if run[-1] in lines else len(lines)
    while title and _CONTINUES.search(_run_text(run)) and after < len(lines) and len(run) < 8:
        run = [*run, lines[after]]  # "... for the" / "Multi-": the title goes on on the next line
        after += 1
        title = _run_title(run)
    if (
        not title
        or _NOT_A_TITLE.search(title)
        or DEGREE_BANNER.match(title)
        or len(title) < 2
        or len(title) > 300
        or _title_banner(title)
        or canonical_section(title)
        or not _reads_as_words(title)
        or not any(ch.isalpha() for ch in title)
        or _JUNK_TITLE.search(title)
        or len(names_in_text(title) or []) >= 2
    ):
        return None
    authors = _byline(_byline_zone(run, lines, following))
    if len(title.split()) <= 2 and cjk_ratio(title) < 0.5 and not authors:
        return None  # a journal logo or a label, unless names follow as they follow a title
    return title, authors


def _ends_front_matter(line: HeaderLine) -> bool:
    plain = _header_text(line)
    return bool(
        _FRONT_MATTER_END.match(plain)
        or run_in_abstract(plain) is not None
        or canonical_section(plain)
        or (len(plain) > 150 and is_running_prose(plain))
    )


def _byline_zone(
    title: list[HeaderLine], lines: list[HeaderLine], following: list[HeaderLine] | None = None
) -> list[list[HeaderLine]]:
    """The lines between the title and the abstract (or first heading, or first paragraph), row by row from the
    top and left to right in a row: the order in which author grids and side-by-side author blocks are read. A
    list of authors that fills the page goes on at the top of the next one (``following``)."""
    bottom = max(line.bbox[3] for line in title)
    below = sorted(
        (line for line in lines if line.bbox[1] >= bottom - 2 and line not in title),
        key=lambda line: (line.bbox[1], line.bbox[0]),
    )
    pages = [below, sorted(following or [], key=lambda line: (line.bbox[1], line.bbox[0]))]
    rows: list[list[HeaderLine]] = []
    for index, page_lines in enumerate(pages):
        zone: list[HeaderLine] = []
        ended = False
        for line in page_lines:
            if _ends_front_matter(line):
                ended = True
                break
            zone.append(line)
        page_rows: list[list[HeaderLine]] = []
        for line in zone:
            if page_rows and line.bbox[1] - page_rows[-1][-1].bbox[1] <= 0.5 * max(line.size, 1.0):
                page_rows[-1].append(line)
            else:
                page_rows.append([line])
        rows.extend(sorted(row, key=lambda line: line.bbox[0]) for row in page_rows)
        height = page_lines[0].page_height if page_lines else 0
        # the zone stops on this page unless it ran into the foot of the page with names in its last rows
        if ended or index or not zone or not height or zone[-1].bbox[3] < BYLINE_PAGE_FOOT * height:
            break
    return rows


BYLINE_PAGE_FOOT = 0.85  # a byline zone reaching below this share of the page height may go on overleaf


def _byline(rows: list[list[HeaderLine]]) -> list[str]:
    """The names printed in the byline zone. Once a row with names is found, only lines in the type sizes of its
    names can add more (affiliations and addresses are set apart); a name broken over two lines is joined."""
    names: list[str] = []
    sizes: list[float] = []
    pending: tuple[HeaderLine, _BylinePieces] | None = None  # the line before, when it stopped inside a name
    misses = 0
    for row in rows:
        first_row = not sizes
        for line in row:
            if not first_row and all(abs(line.size - size) > 0.3 for size in sizes):
                pending = None
                continue
            parsed = _byline_pieces(line.header)
            pieces = list(parsed.pieces) if parsed else []
            if pending is not None and pieces and line.bbox[1] - pending[0].bbox[3] < line.size:
                tail, before = pending[1].pieces[-1], pending[1]
                joined = tail + pieces[0] if before.hyphen else f"{tail} {pieces[0]}"
                rest_are_names = len(pieces) > 1 and parsed is not None and _judge_names(pieces[1:], parsed.affiliated)
                if is_person_name(joined) and (
                    before.hyphen or not is_person_name(tail) or (not is_person_name(pieces[0]) and rest_are_names)
                ):
                    if names and names[-1] == name_case(tail):
                        names.pop()
                    pieces[0] = joined
            found = _judge_names(pieces, parsed.affiliated) if parsed is not None and pieces else None
            pending = (line, parsed) if parsed and parsed.pieces and parsed.open_end else None
            if not found:
                misses += 1
                continue
            if first_row:
                sizes.append(line.size)
            names.extend(n for n in found if n not in names or n == "et al.")
            misses = 0
        if misses > (12 if names else 4):
            break
    return names[:1000]


# Shares of the front page's height above and below which its lines may be the journal's own (its masthead,
# its footer); lines between are the paper's title, byline and text.
FRONT_TOP, FRONT_FOOT = 0.25, 0.8


def extract_metadata(extracted: Extracted, path: str) -> DocMeta:
    """The identifier ladder: what page 1 prints first, then identifiers, then the file's own metadata."""
    raw = extracted.raw_meta
    front_page = 2 if _cover_page(extracted.header) else 1  # the paper starts behind a cover page
    first_page = [b for b in extracted.blocks if b.page in (front_page, None) and b.role != "reference"]
    front = "\n\n".join(b.text for b in first_page)[:8000]
    cover = "\n\n".join(b.text for b in extracted.blocks if b.page == 1) if front_page == 2 else ""
    blocks = _front_blocks(extracted)
    first_text = next(
        (
            b.text
            for b in extracted.blocks
            if b.role == "body" or (b.role == "heading" and not canonical_section(b.text))
        ),
        "",
    )
    styled = next((b.text for b in extracted.blocks if b.role == "title"), "") if extracted.kind != "pdf" else ""
    header_title, header_authors = read_pdf_header(extracted.header, extracted.body_size)
    sample = " ".join(extracted.page_texts)[:200_000]
    opening_pages = " ".join(extracted.page_texts[:2])
    titled = True  # the title is one the document marks as such (not its first line taken for want of one)
    if styled.strip() and not _JUNK_TITLE.search(styled):
        title = _clean_title(styled)  # a Markdown "# Title" or a DOCX Title style says what the title is
    elif header_title:
        title = header_title
    else:
        meta_title = html.unescape(raw.get("title") or "")
        for candidate in (_title_from_blocks(blocks) or "", meta_title if _printed(meta_title, opening_pages) else ""):
            if _plausible_title(candidate) and not _BANNER.search(candidate):
                title = _clean_title(candidate)
                break
        else:  # the first line stands in: no byline follows one that starts in mid-sentence, or a table's head
            title = _clean_title(first_text) if first_text and len(first_text) <= 200 else Path(path).stem
            titled = (
                bool(first_text)
                and not first_text.lstrip()[:1].islower()
                and number_share(" ".join(b.text for b in first_page)) < TABLE_NUMBER_SHARE
            )
    margin = raw.get("margin_text", "")
    doi = (
        _doi_from_text(front)
        or find_doi(margin)
        or _doi_from_text(cover)
        or find_doi(" ".join(str(raw.get(k) or "") for k in ("subject", "keywords")))
        or arxiv_doi(front)
        or arxiv_doi(margin)
    )
    opening = [b for b in extracted.blocks if b.page in (front_page, None)][:60]
    meta_authors = [name for name in _split_authors(raw.get("author", "")) if _printed(name, opening_pages)]
    authors = header_authors or (_authors_from_blocks(opening, title) if titled else []) or meta_authors
    page_one = [b for b in first_page if b.page == front_page]
    banner = "\n".join(b.text for b in page_one[:6] + page_one[-4:] if b.role != "title" and len(b.text) < 400)
    head = "\n".join(
        b.text
        for b in page_one[:12]  # footnotes citing other works do not count
        if b.role != "title" and len(b.text) < 400 and not re.match(r"\d{1,2}\s", b.text)
    )
    title = readable_title(title, sample) if title else Path(path).stem
    # the lines at the top and foot of the front page, where journals print their line (the rest is the paper)
    front_lines = [
        line.text
        for line in extracted.header
        if line.page in (1, front_page)
        and line.page_height
        and (line.bbox[1] < FRONT_TOP * line.page_height or line.bbox[3] > FRONT_FOOT * line.page_height)
    ]
    citation = [b.text for b in extracted.blocks if b.page in (1, 2, front_page, None) and CITATION_BLOCK.match(b.text)]
    printed = read_printed(
        PrintedPages(
            front=front_lines[:80],
            citation=citation[:3],
            margins=list(raw.get("margin_lines") or []) + [raw.get("margin_text", "")],
            opening="\n".join(extracted.page_texts[:3])[:12000] or front,
            title=title,
            venue_hint=_journal_from_text(front, blocks) or _venue_from_page(page_one),
            doi=doi,
            page_span=raw.get("page_span"),
            pages=extracted.pages,
            title_page="\n".join(
                extracted.page_texts[front_page - 1 : front_page] if front_page == 1 else extracted.page_texts[:2]
            )[:6000],
            paper_like=bool(authors)
            and (bool(extracted.references) or any(canonical_section(b.text) == "abstract" for b in extracted.blocks)),
        )
    )
    more = any(_COLLABORATION.search(name) for name in authors)
    year = guess_year(front, raw, path, doi, banner + "\n" + raw.get("margin_text", ""), head)
    if printed.cover_title:
        title = printed.cover_title  # a thesis's form names its title ("论文题目：...")
    elif printed.banner_title and (DEGREE_BANNER.match(title) or not titled):
        title = printed.banner_title  # the line under a title page's banner
    if printed.cover_authors and (not authors or printed.work_type.endswith("-thesis")):
        authors = printed.cover_authors  # a thesis's form names its author (the byline reader may take a supervisor)
    if printed.cover_year:
        year = printed.cover_year
    elif printed.year and printed.venue and (printed.volume or printed.page_range):
        year = printed.year  # the journal line's own year (an issue dated after the article went online)
    return DocMeta(
        title=title,
        authors=authors,
        year=year,
        journal=readable_title(printed.venue, sample) if printed.venue else None,
        doi=doi,
        lang=text_language(sample, least_words=20),
        **{name: getattr(printed, name) for name in BIB_FIELDS if name != "authors_more"},
        authors_more=more,
    )


# Words a title in title case leaves in lower case (unless first, or after a colon).
_MINOR_TITLE_WORDS = frozenset(
    "a an the and or nor but of in on at to for by with from as via vs versus into "
    "onto per than over under upon".split()
)


def readable_title(title: str, text: str) -> str:
    """A title printed in capitals, in title case: each word as the document's own text writes it elsewhere
    (an acronym stays in capitals: "CLEF", "LCLS-II"; "OVERVIEW" becomes "Overview"), a word the text never
    writes otherwise capitalised; a title with lower-case letters is returned as it is."""
    letters = [ch for ch in title if ch.isalpha() and not is_cjk(ch)]
    if len(letters) < 8 or sum(ch.isupper() for ch in letters) < 0.8 * len(letters) or len(title.split()) < 3:
        return title
    seen: dict[str, Counter] = {}
    for line in text.splitlines():
        words = re.findall(r"[^\W\d_]+", line)
        if sum(w.isupper() for w in words) < 0.5 * len(words):  # running text, not a heading in capitals
            for word in words:
                seen.setdefault(word.casefold(), Counter())[word] += 1

    def spell(part: str, first: bool) -> str:
        if not part.isalpha() or not part.isupper():
            return part  # "3.9", "GHz", "S2ORC": as printed
        if len(part) == 1:  # "A" opens sentences: the text cannot say it is an acronym
            return part if first or part != "A" else "a"
        forms = seen.get(part.casefold(), Counter())
        upper = forms.get(part, 0)
        other = sum(n for form, n in forms.items() if form != part)
        if upper > 0 and upper >= other:
            return part  # printed in capitals in the text too: an acronym
        if other == 0 and len(part) <= 3 and part.casefold() not in _MINOR_TITLE_WORDS:
            return part  # never written otherwise, and short: take it for an acronym
        lower = part.lower()
        return lower if lower in _MINOR_TITLE_WORDS and not first else lower.capitalize()

    out, first = [], True
    for token in re.split(r"(\s+|[-/:–—])", title):
        if not token or token.isspace() or token in "-/–—":
            out.append(token)
            continue
        if token == ":":
            out.append(token)
            first = True
            continue
        out.append(re.sub(r"[^\W\d_]+", lambda m, first=first: spell(m.group(0), first and m.start() == 0), token))
        first = False
    return "".join(out)
