"""Records: the typed records the engine answers with (a search hit, a cited work, a caption), declared once for the
code that makes them, the renderer, the CLI and the docs' field tables.

May import: no module of the package.
"""
from __future__ import annotations

from typing import TypedDict


class CaptionRecord(TypedDict):
    """A caption a passage mentions, as a deep hit carries it (docs/OUTPUT-FORMAT.md)."""
    label: str                  # "figure 2", "table 1"
    chunk_id: int
    page: int | None
    text: str


class CitationRecord(TypedDict):
    """A work a passage cites, as a deep hit carries it: the field table of docs/OUTPUT-FORMAT.md's Citations is
    held to these keys."""
    marker: str
    ref: int
    text: str
    doi: str | None
    title: str | None
    in_library: dict | None


class _HitFields(TypedDict):
    chunk_id: int
    doc_id: int
    path: str
    file: str
    title: str
    authors: list[str]
    year: int | None
    journal: str | None
    doi: str | None
    kind: str
    section: str
    page: int | None
    page_end: int | None
    page_label: str | None
    char_start: int | None
    char_end: int | None
    score: float
    snippet: str


class HitRecord(_HitFields, total=False):
    """One search hit as every answer carries it: the fields above always, these when they apply. The hit table
    of docs/OUTPUT-FORMAT.md is held to these keys, and the renderer and the CLI printers read hits as this type."""
    ocr: bool                           # the passage's text was read from a picture of its page
    zotero_key: str
    zotero_link: str
    citations: list[CitationRecord]     # deep only
    citations_more: int
    captions: list[CaptionRecord]
    boxes: list[dict]                   # with boxes: true
    boxes_note: str
    picture: dict                       # with pictures: N
    picture_note: str
