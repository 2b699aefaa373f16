"""Records: the typed records the engine answers with (a search hit, a cited work, a caption, the search and ingest
responses, an ingest file entry, a document, a background job), declared once for the code that makes them, the
renderer, the CLI printers and the docs' field tables (tests/static/test_records.py holds each table to its record).

May import: no module of the package.
"""

from __future__ import annotations

from typing import TypedDict


class CaptionRecord(TypedDict):
    """A caption a passage mentions, as a deep hit carries it (docs/OUTPUT-FORMAT.md)."""

    label: str  # "figure 2", "table 1"
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

    ocr: bool  # the passage's text was read from a picture of its page
    zotero_key: str
    zotero_link: str
    citations: list[CitationRecord]  # deep only
    citations_more: int
    captions: list[CaptionRecord]
    boxes: list[dict]  # with boxes: true
    boxes_note: str
    picture: dict  # with pictures: N
    picture_note: str


class Answered(TypedDict, total=False):
    """What the protocol adds to a successful answer of any command (docs/PROTOCOL.md, Common rules); the responses
    below include it, and their field tables leave it to Common rules."""

    engine: str
    ms: int
    kb_root: str  # a read of no library names the folder it opened, and the rule that chose it
    kb_root_from: str
    markdown: str  # with render
    view: dict  # search and rag with render: the sources as data for a host's card


class _Retrieved(TypedDict):
    query: str
    mode: str
    depth: str
    cached: bool


class _RetrievalNotes(TypedDict, total=False):
    """What a search or rag answer carries when it applies (docs/PROTOCOL.md, search: Response)."""

    queries: list[str]  # the caller's renderings of the question that were kept (blanks and repeats dropped)
    score_kind: str
    reranker: str
    notes: list[str]
    note: str
    vectors: dict
    lang_note: str
    notices: list[dict]


class _SearchFields(_Retrieved):
    results: list[HitRecord]
    count: int


class SearchResponse(_SearchFields, _RetrievalNotes, Answered, total=False):
    """The answer of ``search`` (docs/PROTOCOL.md, search: Response)."""


class _RagFields(_Retrieved):
    evidence: list[HitRecord]
    guidance: str
    related: list[dict]


class RagResponse(_RagFields, _RetrievalNotes, Answered, total=False):
    """The answer of ``rag``: the search answer with ``results`` named ``evidence`` and no ``count``, plus answering
    guidance and related work (docs/PROTOCOL.md, rag)."""


class _FileEntryFields(TypedDict):
    path: str
    status: str
    chunks: int
    title: str | None
    ms: int


class FileEntry(_FileEntryFields, total=False):
    """What ingest says about one file (docs/PROTOCOL.md, ingest: File entry); fetch and sync answer with them too."""

    reason: str
    error: str
    previous: dict  # {"status", "reason"} stored for a file that was not indexed last time
    moved_from: str
    note: str
    ocr_pages: int
    removed: bool  # a link out of the folder whose earlier copy was taken out of the library


class _TotalsFields(TypedDict):
    added: int
    updated: int
    skipped: int
    duplicate: int
    moved: int
    error: int
    files: int
    chunks: int
    chunks_written: int


class IngestTotals(_TotalsFields, total=False):
    """An ingest's counts: one per file status, then files, chunks and what was written (a metadata refresh writes
    no vectors and has no vector counts)."""

    vectors_written: int
    vectors_missing: int


class _IngestFields(TypedDict):
    files: list[FileEntry]
    totals: IngestTotals


class IngestResponse(_IngestFields, Answered, total=False):
    """The answer of an ingest that ran in the foreground (docs/PROTOCOL.md, ingest: Response)."""

    note: str
    vectors_pending: int
    metadata_only: bool
    metadata_verification: dict


class FetchAnswer(IngestResponse, total=False):
    """The answer of ``fetch``: the saved file's ingest, plus where it came from (docs/PROTOCOL.md, fetch)."""

    fetched: dict


class DocRecord(TypedDict):
    """One document as ``docs`` lists it (docs/PROTOCOL.md, docs: Each document)."""

    doc_id: int
    path: str
    file: str
    kind: str
    status: str
    reason: str | None
    error: str | None
    title: str | None
    authors: list[str]
    year: int | None
    journal: str | None
    doi: str | None
    work_type: str
    volume: str | None
    issue: str | None
    page_range: str | None
    publisher: str | None
    report_number: str | None
    arxiv_id: str | None
    authors_more: bool
    chunks: int
    pages: int | None
    lang: str | None
    size: int
    sha256: str
    duplicate_of: int | None
    indexed_at: str
    exists: bool
    page_coverage: dict | None
    metadata_source: dict | None
    zotero_library: str | None


class _DocsFields(TypedDict):
    docs: list[DocRecord]
    total: int
    limit: int
    offset: int


class DocsResponse(_DocsFields, Answered, total=False):
    """The answer of ``docs``: one page of documents in ``doc_id`` order."""


class JobRecord(TypedDict):
    """A background job as ``status`` shows it (docs/PROTOCOL.md, status: A job)."""

    job_id: str
    command: str
    state: str
    done: int
    total: int
    pending: int | None
    current: str | None
    phase: str | None
    phase_done: int
    phase_total: int
    ocr: dict | None
    errors: list[str]
    result: dict | None
    reason: str | None
    created: float
    updated: float
    finished: float | None
    text_done: float | None
    searchable: bool
