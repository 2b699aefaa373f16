"""Citations: reference fields, citation markers, in-library matches.

May import: reading.blocks, reading.chunking, reading.identifiers, reading.structure, records, storage.
"""

from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass

from ..reading.blocks import Extracted
from ..reading.chunking import Chunk
from ..reading.identifiers import arxiv_doi, find_doi
from ..reading.structure import _numbers_of
from ..records import CaptionRecord, CitationRecord
from ..storage import Library, surname_key, title_key

# Reference entries become fields (DOI, title, first author, year); markers in
# chunk text ("[2-4]", "[1,2]" from superscripts, "(Smith et al., 2010)") are
# linked to them at ingest; at query time each cited work is looked up in the
# library by DOI, normalised title, or first author + year.

CITATIONS_PER_HIT = 8
_BRACKET_MARKER = re.compile(r"\[(\d{1,3}(?:\s*[,\u2013\u2014-]\s*\d{1,3})*)\]")
_AUTHOR = r"[A-Z\u00c0-\u024f][A-Za-z\u00c0-\u024f'\u2019-]+(?: [A-Z][A-Za-z'-]+)?"
_AUTHOR_YEAR = re.compile(
    rf"^(?:see |e\.g\.,? |cf\. )?({_AUTHOR})(?: et al\.?| (?:and|&) {_AUTHOR})?,? "
    r"((?:19|20)\d{2})[a-z]?$"
)
_NARRATIVE = re.compile(rf"({_AUTHOR})(?: et al\.?| (?:and|&) {_AUTHOR})? \(((?:19|20)\d{{2}})[a-z]?\)")
_PARENTHESES = re.compile(r"\(([^()]{6,300})\)")


@dataclass
class Reference:
    num: int
    raw: str
    doi: str | None
    title: str | None
    first_author: str | None
    year: int | None


_NAME = r"(?:[A-Z][\w'\u2019-]+(?:\s+(?:van|von|de|der|den|da|di|la|le)\s+[A-Z][\w'\u2019-]+)?)"
_AUTHOR_ITEM = (
    rf"(?:{_NAME},?\s+(?:[A-Z]\.\s?-?\s?)+|(?:[A-Z]\.\s?-?\s?)+{_NAME}|{_NAME}\s+[A-Z]{{1,3}}\b"
    rf"|{_NAME},\s+[A-Z][a-z]+(?:\s+[A-Z]\.)?)"
)
_AUTHOR_LIST = re.compile(rf"^\s*(?:{_AUTHOR_ITEM}\s*(?:,|;|&|\band\b)?\s*)+(?:et\s+al\.?,?\s*)?")
_VENUE_START = re.compile(r"^(?:in[:\s]|proc|vol\b|pp\b|doi|https?:|arxiv|preprint|journal|phys\.|rev\.|j\.\s)", re.I)


def parse_reference(num: int, raw: str) -> Reference:
    """Fields of one reference entry, read leniently (numbered, Vancouver, APA, ACS, Nature, GB/T 7714 styles)."""
    text = re.sub(r"(?<=[a-z])-\s+(?=[a-z])", "", re.sub(r"\s+", " ", raw)).strip()
    year_match = re.search(r"(?<!\d)((?:19|20)\d{2})[a-z]?(?!\d)", text)
    first_segment = re.split(r"\s*(?:[,;，]|\band\b|&|\bet al)\s*", text, maxsplit=1)[0]
    return Reference(
        num=num,
        raw=text[:1000],
        doi=find_doi(text) or arxiv_doi(text),
        title=_reference_title(text),
        first_author=surname_key(first_segment) if len(first_segment) < 60 else None,
        year=int(year_match.group(1)) if year_match else None,
    )


def _reference_title(text: str) -> str | None:
    quoted = re.search(r"[\"\u201c]([^\"\u201d]{10,300})[\"\u201d]", text)
    if quoted:
        return quoted.group(1).strip(" ,.")
    chinese = re.search(r"[.．。]\s*([^.．。\[]{4,120})\[[JMCDRPSNZ]\]", text)  # GB/T 7714: 题名[J]
    if chinese:
        return chinese.group(1).strip()
    dated = re.search(r"[.,]\s*\(?(?:19|20)\d{2}[a-z]?\)?\.\s+(?=\S)", text[:400])  # "Authors. 2020. Title."
    authors = _AUTHOR_LIST.match(text)
    if dated:
        rest = text[dated.end() :]
    else:
        rest = text[authors.end() :] if authors and authors.end() > 3 else text
    rest = re.sub(r"^[\s.,:;]*(?:\(?(?:19|20)\d{2}[a-z]?\)?[.,:;]?\s*)?", "", rest)
    match = re.match(r"(.{8,300}?[^A-Z\s])(?:[.?!]\s|[.?!]?$)", rest)
    title = (match.group(1) if match else "").strip(" ,.")
    digits = sum(ch.isdigit() for ch in title)
    if (
        len(title.split()) < 3
        or _VENUE_START.match(title)
        or digits > len(title) * 0.15
        or re.search(r"\b[A-Z][a-z]{0,4}\.\s", title + " ")
    ):
        return None
    return title


def citation_markers(text: str, references: list[Reference], numbered: bool) -> list[tuple[str, list[int]]]:
    """(marker as written, reference numbers it resolves to) for every citation in ``text``."""
    found: list[tuple[str, list[int]]] = []
    if numbered:
        limit = len(references)
        for match in _BRACKET_MARKER.finditer(text):
            numbers = [n for n in _numbers_of(match.group(1)) if 1 <= n <= limit]
            if numbers:
                found.append((match.group(0), numbers))
        return found
    by_author_year: dict[tuple[str, int], list[int]] = {}
    for ref in references:
        if ref.first_author and ref.year:
            by_author_year.setdefault((ref.first_author, ref.year), []).append(ref.num)

    def resolve(author: str, year: str) -> list[int]:
        candidates = by_author_year.get((surname_key(author) or "", int(year)), [])
        return candidates if len(candidates) == 1 else []  # only where it resolves unambiguously

    for group in _PARENTHESES.finditer(text):
        for part in group.group(1).split(";"):
            cited = _AUTHOR_YEAR.match(part.strip())
            if cited and (numbers := resolve(cited.group(1), cited.group(2))):
                found.append((part.strip(), numbers))
    for match in _NARRATIVE.finditer(text):
        if numbers := resolve(match.group(1), match.group(2)):
            found.append((match.group(0), numbers))
    return found


def document_references(extracted: Extracted) -> list[Reference]:
    return [parse_reference(num, raw) for num, raw in extracted.references]


def link_chunk_citations(
    chunks: list[Chunk], references: list[Reference], numbered: bool
) -> list[list[tuple[str, int]]]:
    """For each chunk, (marker, index into ``references``) of every reference it cites, first mention first."""
    index_of = {ref.num: i for i, ref in enumerate(references)}
    linked = []
    for chunk in chunks:
        seen: dict[int, str] = {}
        for marker, numbers in citation_markers(chunk.text, references, numbered):
            for number in numbers:
                if number in index_of:
                    seen.setdefault(index_of[number], marker)
        linked.append([(marker, i) for i, marker in seen.items()])
    return linked


def _title_words_in(title: str | None, text: str) -> bool:
    """Most of a title's content words occur in the reference text (guards author + year matches)."""
    words = {w for w in re.findall(r"[^\W\d_]{4,}", (title or "").casefold())}
    if not words:
        return False
    haystack = text.casefold()
    return sum(w in haystack for w in words) >= 0.6 * len(words)


def in_library(
    lib: Library,
    doi: str | None,
    title: str | None,
    first_author: str | None,
    year: int | None,
    exclude_doc: int,
    raw: str = "",
) -> dict | None:
    """The library document a cited work is, by DOI, then normalised title, then first author + year."""
    rows = []
    if doi:
        rows = lib.indexed_docs_by_doi(doi.lower(), exclude_doc)
    key = title_key(title)
    if not rows and key:
        rows = lib.indexed_docs_by_title_key(key, exclude_doc)
    if not rows and first_author and year:
        rows = lib.indexed_docs_by_author_year(first_author, year, exclude_doc)
        # a reference that prints a title must agree with the document's title (APS-style ones print none)
        rows = [r for r in rows if not title or _title_words_in(r["title"], raw)]
        rows = rows if len(rows) == 1 else []
    if not rows:
        return None
    row = rows[0]
    return {"doc_id": row["id"], "title": row["title"], "doi": row["doi"], "path": row["path"]}


_FIGURE_MENTION = re.compile(
    r"\b(fig(?:ure)?s?\.?|tables?|tab\.|schemes?|图|表)\s*([A-Z]?\d{1,3}|S\d{1,3})\b", re.IGNORECASE
)


def figure_label(kind: str, number: str) -> str:
    """Canonical label: "Fig. 2", "Figure 2" and "FIG. 2" are all "figure 2"; a table is never a figure."""
    kind = kind.lower()
    if kind.startswith(("tab", "表")):
        word = "table"
    elif kind.startswith(("scheme",)):
        word = "scheme"
    else:
        word = "figure"
    return f"{word} {number.upper()}"


def hit_captions(lib: Library, text: str, doc_id: int, chunk_id: int) -> list[CaptionRecord]:
    """Caption chunks of the same document for the figures and tables a passage mentions, by exact label."""
    wanted = list(dict.fromkeys(figure_label(m.group(1), m.group(2)) for m in _FIGURE_MENTION.finditer(text)))
    if not wanted:
        return []
    captions: dict[str, sqlite3.Row] = {}
    for row in lib.other_captions(doc_id, chunk_id):
        head = _FIGURE_MENTION.match(row["text"].lstrip())
        if head:
            captions.setdefault(figure_label(head.group(1), head.group(2)), row)
    return [
        CaptionRecord(
            label=label,
            chunk_id=captions[label]["id"],
            page=captions[label]["page"],
            text=captions[label]["text"][:400],
        )
        for label in wanted
        if label in captions
    ]


def hit_citations(lib: Library, chunk_id: int, doc_id: int) -> tuple[list[CitationRecord], int]:
    """The works a passage cites, with their library match; at most CITATIONS_PER_HIT, plus how many more."""
    rows = lib.chunk_citations(chunk_id)
    citations = []
    for row in rows[:CITATIONS_PER_HIT]:
        citations.append(
            CitationRecord(
                marker=row["marker"],
                ref=row["num"],
                text=row["raw"][:300],
                doi=row["doi"],
                title=row["title"],
                in_library=in_library(
                    lib, row["doi"], row["title"], row["first_author"], row["year"], doc_id, row["raw"]
                ),
            )
        )
    return citations, max(0, len(rows) - CITATIONS_PER_HIT)
