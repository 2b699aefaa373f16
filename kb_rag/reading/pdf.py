"""PDF reader: PyMuPDF structured text: lines, columns, tables, figures (running heads: reading.furniture).

May import: config, reading.blocks, reading.classify, reading.furniture, reading.ocr, reading.structure, storage,
text.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..config import PDF_MIN_TEXT_CHARS, STATUS_ERROR, STATUS_SKIPPED, FileRejected, _short_error, document_limit
from ..reading.blocks import Block, Extracted, HeaderLine, canonical_section, numbering_depth
from ..reading.classify import apply_outline, classify_blocks, join_wrapped_headings
from ..reading.furniture import PAGE_NUMBER_BAND, _drop_running_heads, margin_numbers, printed_page_span
from ..reading.ocr import (
    OCR_DPI,
    OCR_EXTRA_NOTE,
    OCR_MIN_DPI,
    OcrCache,
    OcrTimeout,
    ReadOptions,
    _ocr_budget,
    _ocr_page,
    _unreadable_share,
    column_side,
    ocr_available,
    ocr_mode,
    ocr_page_dpi,
    ocr_reason,
)
from ..reading.structure import (
    _BANNER,
    SUP_CLOSE,
    SUP_OPEN,
    PageTextBuilder,
    _run_in_name,
    _side_by_side,
    join_lines,
    reference_entries,
    resolve_superscripts,
)
from ..storage import path_key, sha256_of_file
from ..text import _CJK_CHAR, compose_spacing_accents, normalize_text, strip_controls


@dataclass
class _PdfLine:
    text: str
    size: float
    bold: bool
    bbox: tuple
    # The line as the front-matter reader wants it: every raised span (affiliation letters, symbols, digits) and
    # every wide gap between spans replaced by NAME_BREAK, so "Roisin^a, Delhaye^a" keeps its names apart.
    header: str = ""
    italic: bool = False
    gapped: bool = False  # spans set far apart on the line (table columns), past a leading section number
    lead: str = ""  # the line's opening words when they alone are bold or italic ("Participants.")
    coloured: bool = False  # set in a colour, not black or grey (headings of many templates are)


NAME_BREAK = "\u2016"
# Chinese type sets its emphasis in a Hei (黑体, sans) face, not a bold weight of the body's Song face
_BOLD_FONT = re.compile(r"bold|black|heavy|semibold|demi|cmbx|\.b$|-bd|medi|simhei|heiti|fzhei|fzht", re.IGNORECASE)
_ITALIC_FONT = re.compile(r"italic|oblique|cmti|cmsl|-it$|\.i$|-ital", re.IGNORECASE)


def _span_is_bold(span: dict) -> bool:
    return bool(span.get("flags", 0) & 16) or bool(_BOLD_FONT.search(span.get("font", "")))


def _span_is_italic(span: dict) -> bool:
    return bool(span.get("flags", 0) & 2) or bool(_ITALIC_FONT.search(span.get("font", "")))


def _line_direction(line: dict) -> tuple[int, int]:
    dx, dy = line.get("dir", (1.0, 0.0))
    return round(dx), round(dy)


_SUPERSCRIPT_TEXT = re.compile(r"[\d\s,\u2013\u2014-]+")


def _is_raised(span: dict, line_size: float, baseline: float) -> bool:
    if span.get("flags", 0) & 1:
        return True
    origin = span.get("origin")
    return (
        line_size > 0
        and span.get("size", line_size) <= 0.85 * line_size
        and origin is not None
        and origin[1] < baseline - 0.15 * line_size
    )


def _pdf_line(line: dict) -> _PdfLine | None:
    spans = [s for s in line.get("spans", []) if s.get("text")]
    if not "".join(s["text"] for s in spans).strip():
        return None
    weights: dict[float, int] = {}
    bold_chars = italic_chars = total_chars = coloured_chars = cjk_chars = bold_cjk = 0
    for span in spans:
        n = len(span["text"].strip())
        if not n:
            continue
        coloured_chars += n if _is_coloured(span.get("color", 0)) else 0
        weights[round(span.get("size", 0.0), 1)] = weights.get(round(span.get("size", 0.0), 1), 0) + n
        total_chars += n
        bold, cjk = _span_is_bold(span), len(_CJK_CHAR.findall(span["text"]))
        bold_chars, cjk_chars, bold_cjk = bold_chars + (n if bold else 0), cjk_chars + cjk, bold_cjk + bold * cjk
        italic_chars += n if _span_is_italic(span) else 0
    # a Chinese heading sets its numbers and Latin words in a Western face, often a regular one: its CJK decide
    bold = bold_cjk >= 0.9 * cjk_chars if cjk_chars else total_chars > 0 and bold_chars >= 0.9 * total_chars
    size = max(weights, key=weights.__getitem__) if weights else 0.0
    main = next((s for s in spans if round(s.get("size", 0.0), 1) == size and s.get("origin")), None)
    baseline = main["origin"][1] if main else line["bbox"][3]
    parts, header_parts, previous_end, gapped = [], [], None, False
    for span in spans:
        raw = span["text"]
        raised = bool(raw.strip()) and _is_raised(span, size, baseline)
        if raised and _SUPERSCRIPT_TEXT.fullmatch(raw):
            core = raw.strip()
            lead, trail = raw[: len(raw) - len(raw.lstrip())], raw[len(raw.rstrip()) :]
            parts.append(lead + SUP_OPEN + core + SUP_CLOSE + trail)
        else:
            parts.append(raw)
        bbox = span.get("bbox")
        wide_gap = previous_end is not None and bbox is not None and size > 0 and bbox[0] - previous_end > 1.5 * size
        header_parts.append(NAME_BREAK if raised else (NAME_BREAK + raw if wide_gap else raw))
        gapped = gapped or (wide_gap and not raised and not _DETACHED_SECTION_NUMBER.match("".join(parts[:-1])))
        if bbox is not None:
            previous_end = bbox[2]
    text = normalize_text(compose_spacing_accents("".join(parts)))
    text = text.replace(SUP_CLOSE + SUP_OPEN, "")  # "1" "," "2" typeset as separate spans
    lead = _emphasised_lead(spans)
    header = normalize_text(compose_spacing_accents("".join(header_parts)))
    return _PdfLine(
        text,
        size,
        bold,
        tuple(line["bbox"]),
        header,
        total_chars > 0 and italic_chars >= 0.6 * total_chars,
        gapped,
        lead,
        total_chars > 0 and coloured_chars >= 0.6 * total_chars,
    )


def _is_coloured(color) -> bool:
    """A text colour that is neither black, grey nor white: the red, blue or brown of a template's headings."""
    if not isinstance(color, int):
        return False
    r, g, b = (color >> 16) & 255, (color >> 8) & 255, color & 255
    return max(r, g, b) - min(r, g, b) >= 60


def _emphasised_lead(spans: list[dict]) -> str:
    """The opening spans of a line when they are bold (or italic) and the rest of the line is not: a run-in
    heading's candidate ("Participants." before the paragraph it names)."""
    if not spans:
        return ""
    kinds = [(_span_is_bold(s), _span_is_italic(s)) for s in spans[:2]]
    start = 0  # a section number in the upright face may come first ("6.1.1 *Global citations.*")
    if len(spans) > 1 and not any(kinds[0]) and _DETACHED_SECTION_NUMBER.match(spans[0]["text"]):
        start = 1
    if len(spans) <= start or not any(kinds[start]):
        return ""  # most lines: the first word is in the text face, nothing more to look at
    kinds += [(_span_is_bold(s), _span_is_italic(s)) for s in spans[2:]]
    first = 0 if kinds[start][0] else 1  # the emphasis the line opens with: bold, else italic
    n = start
    while n < len(spans) and (kinds[n][first] or not spans[n]["text"].strip()):
        n += 1
    lead = normalize_text("".join(s["text"] for s in spans[:n])).strip()
    rest = "".join(s["text"] for s in spans[n:]).strip()
    if rest[:1] in (".", ":", "：") and not lead.endswith((".", ":", "：")):
        lead, rest = lead + rest[0], rest[1:].strip()  # "Embedding Layer" bold, its full stop upright
    return lead if rest and 2 <= len(lead) <= 80 else ""


def _opens_run_in(line: _PdfLine) -> bool:
    """A line that starts a paragraph with a run-in heading ("1) Route Request: A zone head ..."), or with the
    section number such a heading carries on a line of its own ("6.1.1")."""
    return bool(line.lead and _run_in_name(line.lead, None)) or bool(
        _DETACHED_SECTION_NUMBER.match(line.text) and numbering_depth(line.text) >= 2
    )


def _block_lead(lines: list[_PdfLine]) -> str:
    """The bold or italic opening words of a block's first row, which PyMuPDF may have cut into several lines (a
    section number, the emphasised words, the rest of the row)."""
    if lines[0].lead:
        return lines[0].lead
    parts, emphasised = [], False
    for line in lines[:4]:
        if line is not lines[0] and not _side_by_side(lines[0].bbox, line.bbox):
            break
        if _DETACHED_SECTION_NUMBER.match(line.text):
            parts.append(line.text.strip())
        elif line.lead:
            return " ".join(parts + [line.lead])
        elif line.bold or line.italic:
            parts.append(line.text.strip())
            emphasised = True
        else:
            return " ".join(parts) if emphasised else ""  # the row goes on in the text face: a lead-in
    return " ".join(parts) if emphasised and len(lines) > len(parts) else ""


def _isolated_rows(lines: list[_PdfLine]) -> set[int]:
    """Indices of the lines that begin or end a short row standing between two blank gaps of about a line (or the
    block's start): a heading set in the text's own face and glued to its paragraph ("I. INTRODUCTION"). A
    paragraph's lines follow each other without such gaps."""
    rows: list[list[int]] = []
    for i, line in enumerate(lines):
        if rows and _side_by_side(lines[rows[-1][0]].bbox, line.bbox):
            rows[-1].append(i)
        else:
            rows.append([i])
    if len(rows) < 2:
        return set()
    boxes = [
        (
            min(lines[i].bbox[0] for i in row),
            min(lines[i].bbox[1] for i in row),
            max(lines[i].bbox[2] for i in row),
            max(lines[i].bbox[3] for i in row),
        )
        for row in rows
    ]
    widest = max(b[2] - b[0] for b in boxes)
    cuts: set[int] = set()
    for n, box in enumerate(boxes):
        height = max(box[3] - box[1], 1.0)
        before = n == 0 or box[1] - boxes[n - 1][3] >= 0.8 * height
        after = n + 1 < len(boxes) and boxes[n + 1][1] - box[3] >= 0.8 * height
        text = " ".join(lines[i].text for i in rows[n])
        if before and after and box[2] - box[0] <= 0.7 * widest and len(text) <= 100 and n + 1 < len(rows):
            cuts.update((rows[n][0], rows[n + 1][0]))
    return cuts


def _split_line_groups(lines: list[_PdfLine]) -> list[list[_PdfLine]]:
    """Split one PyMuPDF block where the typography changes, or around a short row set apart by blank gaps (a
    heading glued to its paragraph)."""
    groups: list[list[_PdfLine]] = []
    cuts = _isolated_rows(lines)
    for i, line in enumerate(lines):
        if groups:
            prev = groups[-1][-1]
            height = max(prev.bbox[3] - prev.bbox[1], 1.0)
            gap = line.bbox[1] - prev.bbox[3]
            style_change = (
                abs(line.size - prev.size) > 0.9
                or line.bold != prev.bold
                or (line.italic != prev.italic and len(groups[-1]) == 1 and len(prev.text) <= 80)
                or (prev.text.rstrip()[-1:] in ".:!?)" and _opens_run_in(line))
            )
            if not style_change and gap < 2.0 * height and i not in cuts:
                groups[-1].append(line)
                continue
        groups.append([line])
    return groups


@dataclass
class _PdfBlock:
    lines: list[_PdfLine]
    bbox: tuple

    @property
    def text(self) -> str:
        return join_lines(line.text for line in self.lines)


def _pdf_page_blocks(page) -> tuple[list[_PdfBlock], str]:
    """Blocks in reading order, and the text set in other directions (margin stamps: arXiv id, DOI)."""
    import pymupdf

    flags = pymupdf.TEXTFLAGS_DICT & ~pymupdf.TEXT_PRESERVE_IMAGES  # PyMuPDF's own defaults, no images
    data = page.get_text("dict", flags=flags)
    text_blocks = [raw for raw in data.get("blocks", []) if raw.get("type") == 0]
    # Keep the page's main writing direction: drops rotated margin stamps (arXiv ids),
    # keeps pages that are rotated or set vertically as a whole.
    weights: dict[tuple[int, int], int] = {}
    for raw in text_blocks:
        for line in raw.get("lines", []):
            chars = sum(len(s.get("text", "").strip()) for s in line.get("spans", []))
            weights[_line_direction(line)] = weights.get(_line_direction(line), 0) + chars
    main_direction = max(weights, key=weights.__getitem__) if weights else (1, 0)
    blocks: list[_PdfBlock] = []
    margin = " ".join(
        normalize_text("".join(s.get("text", "") for s in line.get("spans", [])))
        for raw in text_blocks
        for line in raw.get("lines", [])
        if _line_direction(line) != main_direction
    )
    for raw in text_blocks:
        lines = [
            ln
            for ln in (_pdf_line(line) for line in raw.get("lines", []) if _line_direction(line) == main_direction)
            if ln
        ]
        for group in _split_line_groups(lines):
            bbox = (
                min(l.bbox[0] for l in group),
                min(l.bbox[1] for l in group),
                max(l.bbox[2] for l in group),
                max(l.bbox[3] for l in group),
            )
            blocks.append(_PdfBlock(group, bbox))
    return _reading_order(blocks, page.rect.width), margin


def _reading_order(blocks: list[_PdfBlock], width: float) -> list[_PdfBlock]:
    """Order blocks for reading: full-width bands, and left column before right in two-column layouts."""
    return _numbers_before_titles(_column_order(blocks, lambda b: column_side(b.bbox[0], b.bbox[2], width)))


def _numbers_before_titles(ordered: list[_PdfBlock]) -> list[_PdfBlock]:
    """A section number set apart from its heading's text on the same row ("I." then "INTRODUCTION", "3.1." read
    after "The 12C nucleus" because its top sits a little lower) is joined to it, number first."""
    out: list[_PdfBlock] = []
    i = 0
    while i < len(ordered):
        block = ordered[i]
        following = ordered[i + 1] if i + 1 < len(ordered) else None
        if following is not None and _side_by_side(block.bbox, following.bbox):
            number, text = (following, block) if following.bbox[2] <= block.bbox[0] else (block, following)
            if (
                _DETACHED_SECTION_NUMBER.match(number.text)
                and not _DETACHED_SECTION_NUMBER.match(text.text)
                and number.bbox[2] <= text.bbox[0]
                and text.bbox[0] - number.bbox[2] < 6 * number.lines[0].size
                and len(text.lines) <= 3
            ):
                out.append(
                    _PdfBlock(
                        number.lines + text.lines,
                        (
                            min(number.bbox[0], text.bbox[0]),
                            min(number.bbox[1], text.bbox[1]),
                            max(number.bbox[2], text.bbox[2]),
                            max(number.bbox[3], text.bbox[3]),
                        ),
                    )
                )
                i += 2
                continue
        out.append(block)
        i += 1
    return out


def _column_order(blocks: list[_PdfBlock], column: Callable[[_PdfBlock], str]) -> list[_PdfBlock]:
    columns = [column(b) for b in blocks]
    # room taken in Latin letters: a CJK character is set twice as wide (200 fill as much as 400 letters do)
    left_chars = sum(len(b.text) + len(_CJK_CHAR.findall(b.text)) for b, c in zip(blocks, columns) if c == "left")
    right_chars = sum(len(b.text) + len(_CJK_CHAR.findall(b.text)) for b, c in zip(blocks, columns) if c == "right")
    if min(left_chars, right_chars) < 200:
        return sorted(blocks, key=lambda b: (round(b.bbox[1], 0), b.bbox[0]))
    full = sorted((b for b, c in zip(blocks, columns) if c == "full"), key=lambda b: b.bbox[1])
    ordered: list[_PdfBlock] = []
    for region in range(len(full) + 1):
        top = full[region - 1].bbox[1] if region else -math.inf
        bottom = full[region].bbox[1] if region < len(full) else math.inf
        for side in ("left", "right"):
            ordered.extend(
                sorted(
                    (b for b, c in zip(blocks, columns) if c == side and top <= b.bbox[1] < bottom),
                    key=lambda b: b.bbox[1],
                )
            )
        if region < len(full):
            ordered.append(full[region])
    return ordered


TABLE_CELL_MAX_CHARS = 80


def _short_cell(block: _PdfBlock) -> bool:
    return len(block.lines) <= 2 and len(block.text) <= TABLE_CELL_MAX_CHARS


def _table_cells(blocks: list[_PdfBlock], width: float) -> set[int]:
    """Indices of the blocks that are cells of a table: short blocks set side by side in rows that repeat.

    A short block is a cell when it shares its text row with another short block AND a neighbouring row (a few
    line heights above or below) also holds side-by-side short blocks that line up with its row in two columns
    (left, right or centre aligned): a table's columns line up from row to row. Blocks in opposite halves of the
    page are never row mates (two-column text). A heading beside an equation in the other column, or
    a section number set apart from its heading text, has no such row. A block whose own lines stand side by
    side on two rows (or three on one) is a row set as one block."""
    short = [i for i, b in enumerate(blocks) if _short_cell(b)]
    by_top = sorted(short, key=lambda i: blocks[i].bbox[1])
    mates: dict[int, list[int]] = {i: [] for i in short}
    mid = width / 2

    def side(box: tuple) -> int:  # -1 left half, 1 right half, 0 across the middle
        return 0 if box[0] < mid < box[2] else (-1 if box[2] <= mid else 1)

    for n, i in enumerate(by_top):
        for j in by_top[n + 1 :]:
            if blocks[j].bbox[1] > blocks[i].bbox[3]:
                break  # sorted by top: nothing further down shares i's row
            if side(blocks[i].bbox) * side(blocks[j].bbox) < 0:
                continue  # one in each column of a two-column page: not one row
            if _side_by_side(blocks[i].bbox, blocks[j].bbox) and not (
                _detached_number(blocks[i], blocks[j]) or _detached_number(blocks[j], blocks[i])
            ):
                mates[i].append(j)
                mates[j].append(i)
    in_rows = [i for i in by_top if mates[i]]
    tolerance = 0.02 * width

    def aligned(a: tuple, b: tuple) -> bool:
        return (
            abs(a[0] - b[0]) < tolerance
            or abs(a[2] - b[2]) < tolerance
            or abs((a[0] + a[2]) - (b[0] + b[2])) < 2 * tolerance
        )

    def rows_line_up(i: int, k: int) -> bool:
        """Row of k lines up with row of i in two columns: i with k, and a row mate of i with one of k."""
        return aligned(blocks[i].bbox, blocks[k].bbox) and any(
            aligned(blocks[a].bbox, blocks[b].bbox) for a in mates[i] for b in mates[k] if a != k and b != i
        )

    cells = set()
    for i in in_rows:
        box = blocks[i].bbox
        reach = 3 * max(box[3] - box[1], 1.0)
        for k in in_rows:
            other = blocks[k].bbox
            if k != i and k not in mates[i] and 0 < abs(other[1] - box[1]) <= reach and rows_line_up(i, k):
                cells.add(i)
                break
    for i, block in enumerate(blocks):
        rows = {n for n, a in enumerate(block.lines) for b in block.lines[n + 1 :] if _side_by_side(a.bbox, b.bbox)}
        # one row of two (a number beside its heading, an equation and its label) is not a table's row, nor a
        # known section name set letter-spaced ("0", "引", "言" side by side)
        if len(rows) >= 2 and canonical_section(block.text) is None:
            cells.add(i)
    return cells


_DETACHED_SECTION_NUMBER = re.compile(r"^\s*(?:\d{1,2}(?:\.\d{1,2}){0,3}|[IVXLC]{1,6}|[A-H])\.?\s*$")


def _figure_areas(page) -> list[tuple]:
    """Where the page shows pictures (larger than a logo, smaller than the whole page): text drawn over one is a
    figure's. Vector drawings are not looked at: finding their clusters costs ten times reading the text."""
    area = max(page.rect.width * page.rect.height, 1.0)
    try:
        if not page.get_images():  # cheap: the page's resources, no second reading of its content
            return []
        boxes = [tuple(info["bbox"]) for info in page.get_image_info()]
    except Exception:
        return []
    return [b for b in boxes if 0.02 * area <= (b[2] - b[0]) * (b[3] - b[1]) <= 0.8 * area]


def _inside_any(box: tuple, areas: list[tuple]) -> bool:
    width, height = max(box[2] - box[0], 0.1), max(box[3] - box[1], 0.1)
    for a in areas:
        overlap = max(0.0, min(box[2], a[2]) - max(box[0], a[0])) * max(0.0, min(box[3], a[3]) - max(box[1], a[1]))
        if overlap >= 0.7 * width * height:
            return True
    return False


def _columns_in(block: _PdfBlock) -> bool:
    """Text set in columns inside one block: spans far apart on a line, or two lines side by side on one row (a
    table's header row). A section number set apart from its heading's text does not count."""
    if any(line.gapped for line in block.lines):
        return True
    return any(
        _side_by_side(a.bbox, b.bbox)
        and not _DETACHED_SECTION_NUMBER.match(a.text)
        and min(abs(b.bbox[0] - a.bbox[2]), abs(a.bbox[0] - b.bbox[2])) > 1.5 * max(a.size, 1.0)
        for n, a in enumerate(block.lines)
        for b in block.lines[n + 1 : n + 3]
    )


def _detached_number(number: _PdfBlock, text: _PdfBlock) -> bool:
    """``number`` is a bare section number set just left of ``text`` on the same row."""
    gap = text.bbox[0] - number.bbox[2]
    size = max((line.size for line in text.lines), default=10.0)
    return _DETACHED_SECTION_NUMBER.match(number.text) is not None and 0 <= gap < 3 * size


def _open_pdf(path: str):
    import pymupdf

    if os.path.getsize(path) == 0:
        raise FileRejected(STATUS_ERROR, "empty", "the file is empty (0 bytes)")
    try:
        if path_key(path) != path:  # MuPDF takes file names as UTF-8: hand it the bytes of such a file
            with open(path, "rb") as handle:
                doc = pymupdf.open(stream=handle.read(), filetype="pdf")
        else:
            doc = pymupdf.open(path, filetype="pdf")
    except Exception as exc:  # PyMuPDF raises several types for damaged files
        raise FileRejected(STATUS_ERROR, "corrupt", f"not a readable PDF ({_short_error(exc)})") from None
    if doc.needs_pass and not doc.authenticate(""):
        doc.close()
        raise FileRejected(
            STATUS_ERROR, "encrypted", "the PDF is protected by a password; save an unprotected copy to index it"
        )
    try:
        pages = doc.page_count
    except Exception:  # a damaged page tree
        pages = 0
    if pages == 0:
        doc.close()
        raise FileRejected(STATUS_ERROR, "corrupt", "the PDF has no readable pages (damaged or truncated)")
    return doc


def _page_label(page) -> str:
    try:
        return page.get_label() or ""
    except Exception:
        return ""


def _pdf_body_size(pages: list[list[_PdfBlock]]) -> float:
    weights: dict[float, int] = {}
    for blocks in pages:
        for block in blocks:
            for line in block.lines:
                weights[line.size] = weights.get(line.size, 0) + len(line.text)
    return max(weights, key=weights.__getitem__) if weights else 0.0


class _PdfOcr:
    """One PDF's OCR: which pages wanted it, which were read, and the cache they go through."""

    def __init__(self, path: str, options: ReadOptions | None, pages: int = 0):
        options = options or ReadOptions()
        self.threads, self.pages = options.ocr_threads, pages  # pages: the document's count, for progress
        self.on_page = options.on_page or (lambda done, total: None)
        self.on_step = options.on_step or (lambda kind, number, total: None)
        self.mode = ocr_mode(options.ocr)
        self.available = self.mode != "off" and ocr_available()
        self.path = path
        self.cache = OcrCache(options.ocr_cache) if options.ocr_cache and self.available else None
        self._sha256: str | None = None
        self.wanted: list[int] = []  # pages without a usable text layer
        self.read: list[int] = []  # pages whose text now comes from OCR
        self.limit = document_limit("KB_OCR_MAX_PAGES")
        self.capped = 0  # pages past the limit, left without OCR
        self.timed_out = 0  # pages whose OCR ran past KB_OCR_PAGE_SECONDS, left without it
        self.seconds = document_limit("KB_OCR_PAGE_SECONDS")
        self.low_dpi: dict[int, int] = {}  # large pages read below OCR_DPI (KB_OCR_MAX_MEGAPIXELS): their dpi
        self.too_large: list[int] = []  # pages too large to read even at OCR_MIN_DPI, left without OCR

    def page_blocks(self, page, number: int, blocks: list, margin: str) -> tuple[list, str]:
        reason = ocr_reason(page, blocks, self.mode if self.available else "auto")
        if reason is None:
            return blocks, margin
        self.wanted.append(number)
        if not self.available:
            return blocks, margin
        if len(self.read) >= self.limit:
            self.capped += 1
            return blocks, margin
        dpi = ocr_page_dpi(page)
        if dpi is None:
            self.too_large.append(number)
            return ([], margin) if reason == "garbled" else (blocks, margin)  # never the unreadable layer
        if self._sha256 is None:
            try:
                self._sha256 = sha256_of_file(self.path)
            except OSError:
                self._sha256 = ""  # read, not cached
        self.on_step("ocr", number, self.pages)
        try:
            lines = _ocr_page(
                page,
                number,
                self._sha256,
                self.cache,
                time.monotonic() + self.seconds,
                self.threads,
                clear=reason in ("garbled", "forced"),
                dpi=dpi,
            )
        except OcrTimeout:
            self.timed_out += 1
            return ([], margin) if reason == "garbled" else (blocks, margin)  # never the unreadable layer
        finally:
            self.on_page(number, self.pages)
        if dpi < OCR_DPI:
            self.low_dpi[number] = dpi
        if lines:
            self.read.append(number)
            return _pdf_page_blocks(page)
        return blocks, margin

    def notes(self) -> list[str]:
        """What the entry says of how the pages were OCR'd: large pages read at a lower dpi, pages too large to
        read, a cache that could not be used."""
        notes = []
        if self.low_dpi:
            notes.append(
                f"large pages were OCR'd below {OCR_DPI} dpi to keep their pictures within {_ocr_budget()}: "
                + _enumerated([f"page {page} at {dpi} dpi" for page, dpi in sorted(self.low_dpi.items())])
            )
        if self.too_large:
            notes.append(f"{self.too_large_pages()}; left out")
        if self.cache is not None and self.cache.problem:
            notes.append(f"{self.cache.problem}; its pages were OCR'd without it")
        return notes

    def too_large_pages(self) -> str:
        one = len(self.too_large) == 1
        return (
            f"{'page' if one else 'pages'} {_enumerated([str(page) for page in self.too_large])} "
            f"{'is' if one else 'are'} too large to OCR (under {OCR_MIN_DPI} dpi within {_ocr_budget()})"
        )

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()


def _enumerated(items: list[str], most: int = 5) -> str:
    """ "a", "a and b", "a, b and c", past ``most`` "a, b, c, d, e and 7 more"."""
    if len(items) > most:
        return f"{', '.join(items[:most])} and {len(items) - most} more"
    return " and ".join(filter(None, (", ".join(items[:-1]), items[-1]))) if items else ""


def _mupdf_errors() -> tuple[type[Exception], ...]:
    """What PyMuPDF raises when MuPDF cannot read a page (a damaged content stream, font or image). Any other
    exception while a page is read is the engine's or its environment's (a bug, the OCR models): that fails the
    file, which stores nothing and keeps what was indexed, rather than pass for a damaged page."""
    import pymupdf

    return (pymupdf.mupdf.FzErrorBase, pymupdf.FileDataError)


def _regular_when_all_bold(blocks: list[Block], body_size: float) -> None:
    """A document whose running text is bold (set in a Hei face, as PyMuPDF's own CJK font is named) shows no
    emphasis by weight: its blocks count as regular, or every short line of it would read as a heading."""
    body = [b for b in blocks if body_size and abs(b.size - body_size) < 0.5 and len(b.text) >= 20]
    chars = sum(len(b.text) for b in body)
    if chars and sum(len(b.text) for b in body if b.bold) >= 0.5 * chars:
        for block in blocks:
            block.bold = False


def extract_pdf(path: str, max_pages: int | None = None, options: ReadOptions | None = None) -> Extracted:
    doc = _open_pdf(path)
    ocr = _PdfOcr(path, options, len(doc))
    try:
        raw_pages, labels, widths, failed_pages, margin_text, figures = [], [], [], [], "", []
        numbers: list[list[int]] = []  # the numbers in each page's margins, for the printed page span
        margins: list[str] = []  # the header and footer lines of the first pages, running heads included
        for number, page in enumerate(doc):
            if max_pages is not None and number >= max_pages:
                if number >= PRINTED_SPAN_PAGES:
                    break
                numbers.append(_light_margin_numbers(page))  # a metadata refresh still learns the page span
                continue
            ocr.on_step("page", number + 1, ocr.pages)
            try:
                page_blocks, margin = ocr.page_blocks(page, number + 1, *_pdf_page_blocks(page))
                raw_pages.append((page_blocks, page.rect.height))
                numbers.append(margin_numbers([(b.bbox, b.text) for b in page_blocks], page.rect.height))
                if number < MARGIN_LINE_PAGES:
                    band = page.rect.height * PAGE_NUMBER_BAND
                    margins.extend(
                        b.text for b in page_blocks if b.bbox[3] < band or b.bbox[1] > page.rect.height - band
                    )
                if number == 0:
                    margin_text = margin
            except _mupdf_errors() as exc:
                failed_pages.append(_short_error(exc))
                raw_pages.append(([], page.rect.height))
                numbers.append([])
            figures.append(_figure_areas(page))
            widths.append(page.rect.width)
            labels.append(_page_label(page))
        raw_meta = dict(doc.metadata or {})
        raw_meta["margin_text"] = margin_text
        raw_meta["margin_lines"] = [strip_controls(line) for line in margins]
        raw_meta["page_span"] = printed_page_span(numbers)
        try:
            outline = [
                (level, title, page)
                for level, title, page in doc.get_toc(simple=True)
                if isinstance(title, str) and title.strip() and 1 <= page <= len(raw_pages)
            ]
        except Exception:  # a damaged outline is no reason to lose the text
            outline = []
    finally:
        doc.close()
        ocr.close()
    text_chars = sum(ch.isalnum() for blocks, _ in raw_pages for b in blocks for ch in b.text)
    if len(failed_pages) == len(raw_pages):
        raise FileRejected(
            STATUS_ERROR, "corrupt", f"no page of the PDF could be read (damaged file: {failed_pages[0]})"
        )
    if text_chars < PDF_MIN_TEXT_CHARS or _is_mostly_unreadable(raw_pages):
        if ocr.too_large and not ocr.read:
            raise FileRejected(
                STATUS_ERROR, "too_large", f"the PDF has no usable text layer, and {ocr.too_large_pages()}"
            )
        how = (
            'OCR is off (ocr: "off"); ocr: "auto" reads such pages'
            if ocr.mode == "off"
            else OCR_EXTRA_NOTE
            if not ocr.available and not ocr.read
            else f"OCR ran past KB_OCR_PAGE_SECONDS ({ocr.seconds}) on {ocr.timed_out} of its pages"
            if ocr.timed_out
            else "OCR found no text on its pages"
        )
        raise FileRejected(STATUS_SKIPPED, "no_text_layer", f"the PDF has no usable text layer (scanned pages?); {how}")
    pages = _drop_running_heads(raw_pages)
    kept = {id(b) for b in pages[0]} if pages else set()
    running_heads = " ".join(b.text for b in (raw_pages[0][0] if raw_pages else []) if id(b) not in kept)
    raw_meta["margin_text"] = f"{raw_meta.get('margin_text', '')} {running_heads}".strip()
    body_size = _pdf_body_size(pages)
    blocks: list[Block] = []
    for number, (page_blocks, width, areas) in enumerate(zip(pages, widths, figures), start=1):
        cells = _table_cells(page_blocks, width)
        blocks.extend(
            Block(
                text=strip_controls(raw.text),
                page=number,
                size=max(line.size for line in raw.lines),
                n_lines=len(raw.lines),
                bold=all(line.bold for line in raw.lines),
                in_table=i in cells,
                italic=all(line.italic for line in raw.lines),
                gapped=_columns_in(raw),
                lead=_block_lead(raw.lines),
                bbox=raw.bbox,
                first_line=raw.lines[0].bbox,
                in_figure=_inside_any(raw.bbox, areas),
                coloured=raw.lines[0].coloured,
            )
            for i, raw in enumerate(page_blocks)
        )
    _regular_when_all_bold(blocks, body_size)
    blocks = join_wrapped_headings(blocks, body_size)
    _mark_pdf_title(blocks, body_size)
    apply_outline(blocks, outline)
    classify_blocks(blocks, body_size)
    references, numbered = reference_entries(blocks)
    resolve_superscripts(blocks, len(references) if numbered else 0)
    page_texts = []
    for number in range(1, len(pages) + 1):
        builder = PageTextBuilder(number)
        for block in (b for b in blocks if b.page == number):
            builder.add(block)
        page_texts.append(builder.text())
    raw_meta["first_page_title"] = " ".join(b.text for b in blocks if b.role == "title")
    header = [
        HeaderLine(
            number,
            strip_controls(line.text),
            strip_controls(line.header),
            line.size,
            line.bold,
            line.bbox,
            block_number,
            raw_pages[number - 1][1],
        )
        for number, page_blocks in enumerate(pages[:2], start=1)
        for block_number, raw in enumerate(page_blocks)
        for line in raw.lines
    ]
    return Extracted(
        "pdf",
        blocks,
        page_texts,
        labels,
        raw_meta,
        body_size,
        references,
        numbered,
        header,
        ocr_pages=ocr.read,
        ocr_capped=ocr.capped,
        ocr_timed_out=ocr.timed_out,
        notes=ocr.notes(),
    )


MARGIN_LINE_PAGES = 3  # pages whose header and footer lines the metadata reader sees (journal lines, cost codes)
PRINTED_SPAN_PAGES = 80  # a metadata refresh looks this far for the printed page numbers of an article


def _light_margin_numbers(page) -> list[int]:
    """The numbers in a page's margins from its plain text blocks (no layout work), for a metadata refresh."""
    try:
        blocks = [((x0, y0, x1, y1), text) for x0, y0, x1, y1, text, *_ in page.get_text("blocks")]
    except _mupdf_errors():
        return []
    return margin_numbers(blocks, page.rect.height)


def _is_mostly_unreadable(raw_pages) -> bool:
    """True when the 'text' is mostly replacement or private-use characters (broken font maps)."""
    text = "".join(b.text for blocks, _ in raw_pages for b in blocks)
    return not text.strip() or _unreadable_share(text) > 0.5


def _mark_pdf_title(blocks: list[Block], body_size: float) -> None:
    """The largest short text on page 1 is the title (with its continuation lines), not a section."""
    first_page = [b for b in blocks if b.page == 1]
    candidates = [
        b
        for b in first_page
        if 8 <= len(b.text) <= 300
        and b.n_lines <= 4
        and b.size >= body_size * 1.2
        and not canonical_section(b.text)
        and not _BANNER.search(b.text)
    ]
    if not candidates:
        return
    title = max(candidates, key=lambda b: b.size)
    start = first_page.index(title)
    for block in first_page[start : start + 3]:
        if abs(block.size - title.size) < 0.5 and len(block.text) <= 300:
            block.role = "title"
        else:
            break
