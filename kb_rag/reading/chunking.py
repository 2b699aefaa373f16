"""Chunking: sections, weights, captions, size-capped chunks.

May import: config, reading.blocks, reading.structure, text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..config import ABSTRACT_MAX_CHARS, ABSTRACT_MIN_CHARS, CHUNK_MAX_CHARS, SECTION_WEIGHTS
from ..reading.blocks import (
    _TERMINAL_PUNCT,
    NOT_INDEXED_SECTIONS,
    Block,
    Extracted,
    canonical_section,
    numbering_depth,
    numbering_scheme,
    run_in_abstract,
    section_display_name,
)
from ..reading.structure import _ACKNOWLEDGING
from ..text import is_cjk


@dataclass
class Piece:
    """A run of chunk text that is an exact slice of one page text."""

    text: str
    page: int | None
    offset: int
    joiner: str = ""  # text placed before this piece inside its chunk
    block_index: int = -1  # source block; consecutive blocks are contiguous in the page text


@dataclass
class Chunk:
    text: str
    section: str
    block: str
    weight: float
    page: int | None
    page_end: int | None
    page_label: str | None
    char_start: int | None  # offsets into the page text; None for text that is on no page (annotations)
    char_end: int | None
    page_map: list


@dataclass
class _Para:
    pieces: list[Piece]
    section: str
    canonical: str | None
    kind: str  # text | caption | abstract

    @property
    def text(self) -> str:
        return "".join(p.joiner + p.text for p in self.pieces)

    def open_ended(self) -> bool:
        return not self.text.rstrip().endswith(_TERMINAL_PUNCT)


def _piece_of(block: Block, start: int = 0) -> Piece:
    return Piece(block.text[start:], block.page, block.offset + start, "", block.index)


def _continues(para: _Para, block: Block) -> bool:
    """True when ``block`` carries on the paragraph cut by a column or page break just before it."""
    last = para.pieces[-1]
    return (
        block.index == last.block_index + 1
        and block.text[:1].islower()
        and para.open_ended()
        and len(para.text) >= 60
        and re.search(r"[^\W\d_][-,]?$", last.text) is not None
    )


def _continue_para(para: _Para, block: Block) -> None:
    """Append a block that continues a paragraph across a column or page break."""
    last = para.pieces[-1]
    if re.search(r"[^\W\d_]-$", last.text) and block.text[:1].islower():
        last.text = last.text[:-1]
        para.pieces.append(_piece_of(block))
    else:
        joiner = "" if is_cjk(last.text[-1:] or " ") and is_cjk(block.text[:1] or " ") else " "
        para.pieces.append(Piece(block.text, block.page, block.offset, joiner, block.index))


_LETTERED_PART = re.compile(r"^\s*[A-H]((?:\.\d{1,2})*)\.?\s")


MAX_LABEL_PARTS = 4  # a label names the section and at most three levels under it ("A > B > C > D")


class SectionTracker:
    """Follows headings to know the current section label and whether it is indexed.

    The label is the path of headings down to the current one: the top section, then its subsections by level
    ("Methods > Participants > Recruitment"), and a run-in heading, when the text is under one, as the last part.
    """

    def __init__(self):
        self.top: str = ""
        self.top_canonical: str | None = None
        self.subs: list[tuple[int, str]] = []  # (level, name) under the top section, shallowest first
        self.run_ins: list[str] = []  # the run-in heading ("Participants.") the text is under, and an
        # enumerated one inside it ("(a) Aggregation.")
        self.seen_heading = False
        self.body_started = False  # a section other than the abstract has begun
        self.before_closing: tuple = ("", None, [])  # the section a References/Acknowledgements heading closed
        self.after_references = False  # a References heading has been passed: lettered parts are appendices
        self.top_lettered = False  # the current top section is a lettered appendix part ("B Proofs")

    @property
    def label(self) -> str:
        if not self.top:
            return "Front matter" if self.seen_heading and not self.body_started else ""
        parts = [self.top, *(name for _, name in self.subs), *self.run_ins]
        if len(parts) > MAX_LABEL_PARTS:  # keep the top and the deepest ones
            parts = [parts[0], *parts[len(parts) - MAX_LABEL_PARTS + 1 :]]
        return " > ".join(parts)

    @property
    def indexed(self) -> bool:
        return self.top_canonical not in NOT_INDEXED_SECTIONS

    def _open_top(self, name: str, canonical: str | None) -> None:
        self.top, self.top_canonical, self.subs, self.run_ins = name, canonical, [], []

    def _open_sub(self, name: str, level: int) -> None:
        """A subsection at ``level`` (2 and deeper): it closes the subsections at its level and below."""
        level = max(2, level)
        self.subs = [(lv, n) for lv, n in self.subs if lv < level] + [(level, name)]
        self.run_ins = []

    def enter_run_in(self, name: str) -> None:
        """A run-in heading: the text that follows is under it until the next heading or run-in heading. One that
        carries a section number ("6.1.2 Triaging papers.") is the subsection its number says; an enumerated one
        ("(a) Aggregation.") sits inside the run-in before it."""
        if not self.top or not self.indexed or self.top_canonical == "abstract":
            return
        if numbering_depth(name) >= 2 and numbering_scheme(name) == "arabic":
            self._open_sub(section_display_name(name), numbering_depth(name))
            return
        display = section_display_name(name)
        if re.match(r"^\(?[a-z]\)\s", name) and self.run_ins:
            self.run_ins = [self.run_ins[0], display]
        else:
            self.run_ins = [display]

    def enter(self, heading: str, level: int, closing: bool = True) -> None:
        """A heading; ``closing=False`` for one named like References or Acknowledgements that turned out to head
        a part of the text (followed by prose, and by the document's next numbered section)."""
        self.seen_heading = True
        canonical = canonical_section(heading)
        if not closing and canonical in NOT_INDEXED_SECTIONS:
            canonical = None
        name = section_display_name(heading)
        if canonical == "abstract" and self.body_started:
            canonical = "conclusion"  # a "Summary" after the body sums the paper up at its end
        self.body_started = self.body_started or canonical != "abstract"
        lettered = _LETTERED_PART.match(heading) if numbering_depth(heading) else None
        top_before = self.top
        if self._enter(heading, level, canonical, name, lettered):
            self.top_lettered = True
        elif self.top != top_before:
            self.top_lettered = False

    def _enter(self, heading: str, level: int, canonical: str | None, name: str, lettered) -> bool:
        """Move to the heading's section; True when it opened a lettered appendix part."""
        if canonical in NOT_INDEXED_SECTIONS and _numbered_subsection(heading, level) and self.top:
            canonical = None  # "（五）参考文献", "7.2 References": a part of the text about them
        if canonical and (
            level <= 1 or canonical in NOT_INDEXED_SECTIONS or not self.top or self.top_canonical == "abstract"
        ):
            if canonical in NOT_INDEXED_SECTIONS and self.indexed:
                self.before_closing = (self.top, self.top_canonical, list(self.subs))
            self.after_references = self.after_references or canonical == "references"
            self._open_top(name, canonical)
        elif lettered and (self.after_references or not self.indexed):
            # After the reference list a lettered part ("A Proofs") opens an appendix, and "A.2 ..." is a part of
            # it, also when stray body text under References has already handed back to the last body section.
            # Under an "Appendix" heading of its own, the lettered parts are its subsections.
            if self.top_canonical == "appendix" and (lettered.group(1) or not self.top_lettered):
                self._open_sub(name, max(level, 2))
            else:
                self._open_top(name, "appendix")
                return True
        elif not self.indexed:
            # After the reference list: a numbered chapter opens the body; an unnumbered sub-heading ("Primary
            # sources") stays inside the list. After acknowledgements, a top-level heading opens a section of
            # its own (an "Ethical Considerations" or "Author Contributions" set after them).
            if (
                numbering_depth(heading) == 1
                and re.match(r"^\s*(?:\d|第|chapter\b)", heading, re.I)
                or self.top_canonical == "acknowledgements"
                and level <= 1
            ):
                self._open_top(name, None)
            else:
                self._open_sub(name, 2)
        elif self.top_canonical == "appendix" and level > 1:
            self._open_sub(name, level)
        elif level <= 1 or not self.top or self.top_canonical == "abstract":  # an abstract has no subsections
            self._open_top(name, canonical)
        else:
            self._open_sub(name, level)  # a known name set as a subsection ("3.2 Results") stays one
        return False

    def enter_abstract(self, name: str = "Abstract") -> None:
        self.seen_heading = True
        self._open_top(name, "abstract")

    def leave_abstract(self) -> None:
        """An abstract that runs on past its length or page: the body began without a heading."""
        self._open_top("", None)
        self.body_started = True

    def resume_body(self) -> None:
        """Back to the section before a References/Acknowledgements heading that body text turned out to follow."""
        top, canonical, subs = self.before_closing
        self._open_top(top, canonical)
        self.subs = list(subs)
        self.top_lettered = False


def _numbered_subsection(heading: str, level: int) -> bool:
    return level >= 2 and numbering_depth(heading) > 0


def _promoted_abstract(blocks: list[Block]) -> Block | None:
    """Without an explicit abstract, the first long front-matter paragraph stands in for it."""
    if any(b.role == "heading" and canonical_section(b.text) == "abstract" for b in blocks):
        return None
    if any(b.role == "body" and run_in_abstract(b.text) is not None for b in blocks):
        return None
    first_heading = next((i for i, b in enumerate(blocks) if b.role == "heading"), None)
    if first_heading is None:
        return None
    for block in blocks[: min(first_heading, 15)]:
        if (
            block.role == "body"
            and ABSTRACT_MIN_CHARS <= len(block.text) <= ABSTRACT_MAX_CHARS
            and (block.page is None or block.page <= 2)
        ):
            return block
    return None


def _resumes_body(closing: str | None, block: Block) -> bool:
    """Body text after a closing section: under References, a block the list did not take (running prose);
    under Acknowledgements, a paragraph that acknowledges nothing."""
    if closing == "references":
        return block.role == "body"
    return closing == "acknowledgements" and len(block.text) >= 200 and not _ACKNOWLEDGING.search(block.text)


def paragraphs(blocks: list[Block]) -> list[_Para]:
    """Walk blocks in reading order into section-labelled paragraphs (excluded sections dropped)."""
    tracker = SectionTracker()
    promoted = _promoted_abstract(blocks)
    paras: list[_Para] = []
    open_para: _Para | None = None
    abstract_start, abstract_chars = None, 0  # where the abstract began, and how long it has run
    for index, block in enumerate(blocks):
        block.index = index
        if block.role in ("title", "noise", "reference"):
            continue
        if block.role == "heading" and block.evidence == "run_in":
            tracker.enter_run_in(block.run_in)
            open_para = None
            continue
        if block.role == "heading":
            tracker.enter(block.text, block.level, closing=block.evidence != "named")
            open_para = None
            continue
        if block.run_in:
            tracker.enter_run_in(block.run_in)
            open_para = None
        if block.role == "caption":  # figures and tables are content wherever they float
            paras.append(_Para([_piece_of(block)], tracker.label, tracker.top_canonical, "caption"))
            continue
        if not tracker.indexed and _resumes_body(tracker.top_canonical, block):
            tracker.resume_body()
            open_para = None
        start = 0
        run_in = run_in_abstract(block.text) if tracker.top_canonical in (None, "abstract") else None
        if run_in is not None and not tracker.body_started:
            tracker.enter_abstract()
            start, open_para = run_in, None
        elif block is promoted:
            tracker.enter_abstract()
            open_para = None
        if not tracker.indexed:
            block.closed_by = tracker.top_canonical or ""
            continue
        if start >= len(block.text):
            continue
        if tracker.top_canonical == "abstract":
            abstract_start, abstract_chars = abstract_start or block.page or 1, abstract_chars + len(block.text)
            if abstract_chars > ABSTRACT_MAX_CHARS + len(block.text) or (block.page or 1) > abstract_start + 1:
                tracker.leave_abstract()
                open_para = None
        else:
            abstract_start, abstract_chars = None, 0
        if open_para is not None and start == 0 and open_para.section == tracker.label and _continues(open_para, block):
            _continue_para(open_para, block)
            continue
        kind = "abstract" if tracker.top_canonical == "abstract" else "text"
        open_para = _Para([_piece_of(block, start)], tracker.label, tracker.top_canonical, kind)
        paras.append(open_para)
    return paras


_ABBREVIATIONS = frozenset(
    "fig figs eq eqs ref refs al e.g i.e vs no nos dr prof approx ca cf sec tab vol pp ch".split()
)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"“(\[]?[A-Z0-9])|(?<=[。！？；])")


def sentence_bounds(text: str) -> list[int]:
    """Offsets where sentences start (excluding 0), skipping common abbreviations."""
    bounds = []
    for match in _SENTENCE_END.finditer(text):
        before = text[: match.start()].rstrip()
        last_word = re.search(r"([\w.]+)\.$", before)
        if last_word and last_word.group(1).lower() in _ABBREVIATIONS:
            continue
        if match.end() < len(text):
            bounds.append(match.end())
    return bounds


def _cut_points(text: str, limit: int) -> list[int]:
    """Cut offsets that split ``text`` into runs of at most ``limit`` chars, preferring sentence ends."""
    cuts, start = [], 0
    candidates = sentence_bounds(text)
    while len(text) - start > limit:
        window_end = start + limit
        fitting = [b for b in candidates if start < b <= window_end]
        if fitting and fitting[-1] - start >= limit // 3:
            cut = fitting[-1]
        else:
            space = text.rfind(" ", start + limit // 2, window_end)
            cut = space + 1 if space > start else window_end
        cuts.append(cut)
        start = cut
    return cuts


def _slice_pieces(pieces: list[Piece], start: int, end: int) -> list[Piece]:
    """The pieces covering ``[start, end)`` of the joined text, trimmed to it."""
    out: list[Piece] = []
    pos = 0
    for piece in pieces:
        pos += len(piece.joiner)
        lo, hi = max(start, pos), min(end, pos + len(piece.text))
        if lo < hi:
            joiner = piece.joiner if lo == pos and out else ""
            out.append(
                Piece(piece.text[lo - pos : hi - pos], piece.page, piece.offset + lo - pos, joiner, piece.block_index)
            )
        pos += len(piece.text)
    # Cut boundaries fall after whitespace: trim it so every piece stays an exact page slice.
    if out:
        first = out[0]
        lead = len(first.text) - len(first.text.lstrip())
        first.text, first.offset = first.text[lead:], first.offset + lead
        out[-1].text = out[-1].text.rstrip()
    return [p for p in out if p.text]


def _make_chunk(pieces: list[Piece], para: _Para, labels: list[str]) -> Chunk:
    text, page_map = "", []
    for i, piece in enumerate(pieces):
        text += piece.joiner
        follows = i > 0 and piece.block_index - pieces[i - 1].block_index in (0, 1)
        page_map.append([len(text), piece.page, piece.offset, len(piece.text), int(follows)])
        text += piece.text
    pages = [p.page for p in pieces if p.page is not None]
    first_page = pages[0] if pages else None
    label = labels[first_page - 1] if first_page and first_page <= len(labels) and labels[first_page - 1] else None
    weight = SECTION_WEIGHTS.get(para.canonical or "", 1.0)
    if para.kind == "abstract":
        weight = SECTION_WEIGHTS["abstract"]
    return Chunk(
        text=text,
        section=para.section,
        block=para.kind,
        weight=weight,
        page=first_page,
        page_end=pages[-1] if pages else None,
        page_label=label,
        char_start=pieces[0].offset,
        char_end=pieces[-1].offset + len(pieces[-1].text),
        page_map=page_map,
    )


def chunk_document(extracted: Extracted, max_chars: int = CHUNK_MAX_CHARS) -> list[Chunk]:
    """Section-aware chunks: paragraphs merged up to ``max_chars``, long ones split at sentences."""
    chunks: list[Chunk] = []
    pending: list[Piece] = []
    pending_para: _Para | None = None

    def flush():
        nonlocal pending, pending_para
        if pending and pending_para is not None:
            chunks.append(_make_chunk(pending, pending_para, extracted.page_labels))
        pending, pending_para = [], None

    for para in paragraphs(extracted.blocks):
        text = para.text
        same_group = (
            pending_para is not None
            and pending_para.section == para.section
            and pending_para.kind == para.kind
            and para.kind != "caption"
        )
        if not same_group or len(_joined(pending)) + 2 + len(text) > max_chars:
            flush()
        if len(text) > max_chars:
            bounds = [0] + _cut_points(text, max_chars) + [len(text)]
            for lo, hi in zip(bounds, bounds[1:]):
                flush()
                pending, pending_para = _slice_pieces(para.pieces, lo, hi), para
            if para.kind == "caption":
                flush()
            continue
        para_pieces = [Piece(p.text, p.page, p.offset, p.joiner, p.block_index) for p in para.pieces]
        if pending:
            para_pieces[0].joiner = "\n\n"
        pending.extend(para_pieces)
        pending_para = pending_para or para
        if para.kind == "caption":
            flush()
    flush()
    return [c for c in chunks if c.text.strip()]


def _joined(pieces: list[Piece]) -> str:
    return "".join(p.joiner + p.text for p in pieces)


TEXT_PAGE_MIN_CHARS = 100  # letters and digits that make a page a text page
PAGES_LOST_NOTE_SHARE = 0.1  # ingest notes a document when more of its text pages than this have no passage
CLOSING_PAGES_NOTE_SHARE = 0.5  # ... or when a reference list / acknowledgements hold more of them than this


def page_coverage(extracted: Extracted, chunks: list[Chunk]) -> dict | None:
    """Which text pages of a PDF have a passage in the index, and why the others have none.

    Reasons: "references" or "acknowledgements" (their text is kept out of the search index by design),
    "no body text" (only a title, page furniture or headings), "no passage" (text was lost: a parser fault)."""
    if extracted.kind != "pdf":
        return None
    chunked = {entry[1] for chunk in chunks for entry in chunk.page_map if entry[1] is not None}
    text_pages = [
        n
        for n, text in enumerate(extracted.page_texts, start=1)
        if sum(ch.isalnum() for ch in text) >= TEXT_PAGE_MIN_CHARS
    ]
    without = []
    for page in (n for n in text_pages if n not in chunked):
        held: dict[str, int] = {}
        for block in (b for b in extracted.blocks if b.page == page):
            kind = (
                "references"
                if block.role == "reference"
                else block.closed_by or ("content" if block.role in ("body", "caption") else "")
            )
            if kind:
                held[kind] = held.get(kind, 0) + len(block.text)
        if not held:
            reason = "no body text"
        elif "content" in held:
            reason = "no passage"
        else:
            reason = max(held, key=held.__getitem__)
        without.append({"page": page, "reason": reason})
    return {
        "text_pages": len(text_pages),
        "pages_with_chunks": len(text_pages) - len(without),
        "without_chunks": without,
        **({"ocr_pages": list(extracted.ocr_pages)} if extracted.ocr_pages else {}),
    }


def page_coverage_note(coverage: dict | None) -> str | None:
    """A warning for a document whose text pages did not make it into the index in the expected share."""
    if not coverage or not coverage["text_pages"]:
        return None
    total = coverage["text_pages"]
    lost = [p["page"] for p in coverage["without_chunks"] if p["reason"] == "no passage"]
    closing = [p["page"] for p in coverage["without_chunks"] if p["reason"] in NOT_INDEXED_SECTIONS]
    if lost and len(lost) > PAGES_LOST_NOTE_SHARE * total:
        return (
            f"{len(lost)} of {total} text pages produced no passage (pages {page_ranges(lost)}); "
            "their text may be missing from search"
        )
    if len(closing) > 2 and len(closing) > CLOSING_PAGES_NOTE_SHARE * total:
        return (
            f"{len(closing)} of {total} text pages were read as references or acknowledgements and are not "
            f"searchable (pages {page_ranges(closing)}); check that the headings were read correctly"
        )
    return None


def page_ranges(pages: list[int]) -> str:
    """[3, 4, 5, 9] -> "3-5, 9"."""
    runs: list[list[int]] = []
    for page in sorted(pages):
        if runs and page == runs[-1][1] + 1:
            runs[-1][1] = page
        else:
            runs.append([page, page])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)
