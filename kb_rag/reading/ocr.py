"""OCR: pages without a usable text layer: detection, RapidOCR, the invisible text layer, cache.

May import: config, text.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sqlite3
import stat as stat_module
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Field, Flag, KBError, _short_error, document_limit
from ..text import _CJK_CHAR, _CJK_RANGES, normalize_text

# A scanned page (or one whose fonts map to garbage) is rendered, read by RapidOCR (PP-OCRv4 ONNX models shipped
# inside the rapidocr-onnxruntime wheel: nothing is downloaded at run time), and its lines are written back onto
# the in-memory page as invisible text at their boxes. From there the page is an ordinary text PDF: reading
# order, columns, running heads, headings, chunking, citations and glyph boxes all come from the same code.

OCR_MODES = ("auto", "off", "force")
OCR_DPI = 250  # render resolution for recognition
# A page whose picture at OCR_DPI would be over KB_OCR_MAX_MEGAPIXELS is read at the highest whole dpi within it:
# the picture, its copy and the line crops cut from it grow with its pixels (a 5,000-point page at 250 dpi is 301
# million pixels, 2 GB resident), and MuPDF refuses a picture over 1 GiB (a square page of 76 inches at 250 dpi).
# Below OCR_MIN_DPI the page is too large to read: the largest page a PDF may have (200 inches a side) fits the
# default budget at 31 dpi, where letters 2 cm tall are still 24 pixels, so only a page past that limit gets here.
OCR_MIN_DPI = 30
OCR_DETECT_SIDE = 2400  # pixels: the long side of the page picture the line detector sees
OCR_DETECT_PIXELS = 2400 * 1860  # ... and its area at most (US Letter, the widest usual page, at that side): the
# detector's working memory grows with it, about 0.9 GB at this size
OCR_RECOGNISE_STEP = 24  # lines recognised between two looks at the page's clock
OCR_MIN_CONFIDENCE = 0.5  # recognised lines below this confidence are dropped
OCR_LINES_REVISION = 2  # bumped when the lines kept from the recognizer change: cached pages are OCR'd again
OCR_PAGE_MIN_CHARS = 40  # a page with fewer letters and digits than this, and an image on it, is OCR'd
OCR_GARBLED_SHARE = 0.3  # ... as is one where this share of the visible characters cannot be read
OCR_SYMBOL_SHARE = 0.2  # ... or where this share are ASCII symbols: a font map that points letters at them
OCR_BYTE_MAP_SHARE = 0.25  # ... or this share what a font read byte by byte leaves (_byte_map_share)
OCR_BYTE_MAP_CONTROLS = 0.02  # ... with at least this share of control characters among them
OCR_EXTRA_NOTE = "install the OCR extra to index it: pip install 'kb-rag[ocr]'"
OCR_CACHE_FILENAME = "ocr-cache.sqlite"  # beside kb.sqlite in a library; in the cache folder for page_texts


@dataclass(frozen=True)
class ReadOptions:
    """How files are read, sent to reader processes: the OCR mode (None: KB_OCR's, else auto), the cache of OCR'd
    pages (a SQLite file), the threads of the OCR models (0: onnxruntime's choice, every core) and where each
    OCR'd page is reported (``on_page(done, total)``: pages of the document gone through, its page count). The
    reader also says when it starts each step (``on_step(kind, number, total)``: a ``page`` read, a page's
    ``ocr``, the ``describe`` step after the pages), the heartbeat its reader process is timed by. Both are set in
    the process that reads, never pickled."""

    ocr: str | None = None
    ocr_cache: str | None = None
    ocr_threads: int = 0
    on_page: Callable[[int, int], None] | None = field(default=None, compare=False)
    on_step: Callable[[str, int, int], None] | None = field(default=None, compare=False)


def ocr_mode(value: str | None = None) -> str:
    """``auto`` (pages without a usable text layer), ``off`` or ``force`` (every page): the request's, else
    KB_OCR's, else auto."""
    mode = (value or os.environ.get("KB_OCR") or "auto").strip().lower()
    if mode not in OCR_MODES:
        raise KBError("bad_request", f"ocr must be one of {', '.join(OCR_MODES)}, not {mode!r}")
    return mode


def ocr_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("rapidocr_onnxruntime") is not None
    except (ImportError, ValueError):
        return False


@functools.lru_cache(maxsize=2)
def _ocr_reader(threads: int = 0) -> Any:
    """The process's OCR models, loaded once (a fraction of a second). The engine runs their stages itself
    (detection on a smaller picture, recognition of lines cut from the full-size one, a clock between steps);
    RapidOCR's own call would shrink the whole page to 2,000 pixels, at which its recognizer drops many spaces
    between English words (page similarity 0.86 against 0.96 at full size)."""
    from rapidocr_onnxruntime import RapidOCR

    return RapidOCR(**({"intra_op_num_threads": threads} if threads > 0 else {}))


@functools.lru_cache(maxsize=8)
def ocr_engine_version(dpi: int = OCR_DPI) -> str:
    """What the cached OCR text depends on: the OCR package's version and the render settings (the page's dpi:
    a large page read within KB_OCR_MAX_MEGAPIXELS is read again when the limit changes)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("rapidocr-onnxruntime")
    except PackageNotFoundError:
        release = "unknown"
    return (
        f"rapidocr-onnxruntime {release}; dpi {dpi}; detect {OCR_DETECT_SIDE} / {OCR_DETECT_PIXELS}; "
        f"min confidence {OCR_MIN_CONFIDENCE}; lines {OCR_LINES_REVISION}"
    )


def _ocr_budget() -> str:
    return f"KB_OCR_MAX_MEGAPIXELS ({document_limit('KB_OCR_MAX_MEGAPIXELS')} million pixels)"


def ocr_page_dpi(page) -> int | None:
    """The resolution a page is OCR'd at: OCR_DPI, or for a page whose picture at OCR_DPI would be over
    KB_OCR_MAX_MEGAPIXELS, the highest whole dpi within it; None below OCR_MIN_DPI (too large to read)."""
    square_inches = abs(page.rect) / 72**2
    if square_inches <= 0:
        return OCR_DPI
    fits = math.sqrt(document_limit("KB_OCR_MAX_MEGAPIXELS") * 1e6 / square_inches)
    dpi = min(OCR_DPI, int(fits))
    return dpi if dpi >= OCR_MIN_DPI else None


def _ocr_lines_valid(lines: Any) -> bool:
    """Whether a cached value is what ocr_page_lines returns: ``[text, [x0, y0, x1, y1], confidence]`` lines
    with finite numbers (a row written by another program, or damaged, is not)."""

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    return isinstance(lines, list) and all(
        isinstance(line, list)
        and len(line) == 3
        and isinstance(line[0], str)
        and isinstance(line[1], list)
        and len(line[1]) == 4
        and all(number(v) for v in line[1])
        and number(line[2])
        for line in lines
    )


def _create_unlinked(path: str) -> None:
    """Make sure ``path`` is a regular file, creating it empty if it is absent, without following a symbolic link
    there: O_EXCL fails on any link (a dangling one included) and O_NOFOLLOW on a link to a file. OSError when
    the path is a link or anything but a regular file."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644))
        return
    except FileExistsError:
        pass
    mode = os.lstat(path).st_mode
    if stat_module.S_ISLNK(mode):
        raise OSError("it is a symbolic link, which is never followed")
    if not stat_module.S_ISREG(mode):
        raise OSError("it is not a regular file")


class OcrCache:
    """OCR'd lines by file checksum, engine version and page, in a SQLite file of their own (reader processes
    write it while the library has one writer): a re-ingest, a rebuild or a moved file never OCRs again.

    The cache only ever saves work: a row that cannot be used (not JSON, not lines, wrong types) is a miss, so
    the page is OCR'd again and its row replaced; a cache file that cannot be opened or read is no cache, and
    ``problem`` says why. Its path is never followed as a symbolic link: SQLite would create a dangling link's
    target wherever it points (SQLite itself refuses links at its -wal, -shm and -journal files)."""

    def __init__(self, path: str):
        self.path = path
        self.conn: sqlite3.Connection | None = None
        self.problem: str | None = None  # why the cache could not be used, the first time it could not

    def _connect(self) -> sqlite3.Connection | None:
        """The open cache, or None once it could not be opened (not tried again for each page)."""
        if self.conn is None and self.problem is None:
            conn = None
            try:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
                _create_unlinked(self.path)
                conn = sqlite3.connect(self.path, timeout=30)
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute(
                    "CREATE TABLE IF NOT EXISTS ocr_pages (sha256 TEXT, engine TEXT, page INTEGER, "
                    "lines TEXT NOT NULL, PRIMARY KEY (sha256, engine, page)) WITHOUT ROWID"
                )
                self.conn = conn
            except (sqlite3.Error, OSError) as exc:
                if conn is not None:
                    conn.close()
                self._failed(exc)
        return self.conn

    def _failed(self, exc: Exception) -> None:
        if self.problem is None:
            self.problem = f"the OCR cache {self.path} could not be used ({_short_error(exc)})"

    def get(self, sha256: str, page: int, dpi: int = OCR_DPI) -> list | None:
        conn = self._connect()
        if conn is None:
            return None
        try:
            row = conn.execute(
                "SELECT lines FROM ocr_pages WHERE sha256 = ? AND engine = ? AND page = ?",
                (sha256, ocr_engine_version(dpi), page),
            ).fetchone()
        except sqlite3.Error as exc:  # a damaged page of the cache file
            self._failed(exc)
            return None
        if row is None:
            return None
        try:
            lines = json.loads(row[0])
        except (ValueError, TypeError, RecursionError):  # not JSON, not text, nested past the parser's depth
            return None
        return lines if _ocr_lines_valid(lines) else None

    def put(self, sha256: str, page: int, lines: list, dpi: int = OCR_DPI) -> None:
        conn = self._connect()
        if conn is None:
            return
        try:
            with conn:
                conn.execute(
                    "INSERT OR REPLACE INTO ocr_pages VALUES (?, ?, ?, ?)",
                    (sha256, ocr_engine_version(dpi), page, json.dumps(lines, ensure_ascii=False)),
                )
        except sqlite3.Error as exc:
            self._failed(exc)  # a cache that cannot be written costs a second OCR, nothing else

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _unreadable_share(text: str) -> float:
    """The share of the visible characters that are replacement, private-use, control or unassigned ones."""
    visible = [ch for ch in text if not ch.isspace()]
    if not visible:
        return 0.0
    bad = sum(1 for ch in visible if ch == "\ufffd" or unicodedata.category(ch) in ("Co", "Cc", "Cn"))
    return bad / len(visible)


_ASCII_SYMBOLS = frozenset('!"#$&*+/;<=>?@^|~')


def _symbol_share(text: str) -> float:
    """The share of the visible characters that are ASCII symbols, on a page with 200 or more of them. A font
    whose map sends glyphs to the ASCII range reads as "2<0= >./?2/ 0:;451" (a Chinese journal page of the
    corpus: 0.27); of the corpus's 980 other PDF pages the highest is 0.16, another broken map, then 0.11, a page
    of formulas."""
    visible = [ch for ch in text if not ch.isspace()]
    if len(visible) < 200:
        return 0.0
    return sum(ch in _ASCII_SYMBOLS for ch in visible) / len(visible)


def _byte_map_share(text: str) -> float:
    """The share of the visible characters that a font whose two-byte codes are read as single bytes leaves:
    control characters, Latin-1 and Latin Extended letters and signs, ASCII symbols ("Ø”\x17 ... dž\x06Ø\x1fª"); 0
    on a page with fewer than 200, or with controls under OCR_BYTE_MAP_CONTROLS of them (a page in Czech or
    Vietnamese has as many accented letters, never control characters). The corpus's Chinese mathematics page read
    this way scores 0.34 with 4.5% controls; of its other 893 PDF pages none has 2% controls (the most: 1.4%, 1.1%),
    and the highest score without that condition would be 0.16, a page of dingbats."""
    visible = [ch for ch in text if not ch.isspace()]
    if len(visible) < 200:
        return 0.0
    controls = sum(unicodedata.category(ch) == "Cc" for ch in visible)
    if controls < OCR_BYTE_MAP_CONTROLS * len(visible):
        return 0.0
    latin = sum(0xA0 <= ord(ch) <= 0x24F for ch in visible)
    return (controls + latin + sum(ch in _ASCII_SYMBOLS for ch in visible)) / len(visible)


def _page_has_picture(page, share: float = 0.25) -> bool:
    """Whether an image covers at least ``share`` of the page (a scan, a photographed page)."""
    area = abs(page.rect) or 1.0
    try:
        infos = page.get_image_info()
    except Exception:
        return False
    import pymupdf

    return any(abs(page.rect & pymupdf.Rect(info["bbox"])) >= share * area for info in infos if info.get("bbox"))


def ocr_reason(page, blocks: list, mode: str) -> str | None:
    """Why this page is OCR'd ('forced', 'no_text', 'garbled'), or None: it keeps its text layer."""
    if mode == "off":
        return None
    if mode == "force":
        return "forced"
    text = "".join(b.text for b in blocks)
    if (
        _unreadable_share(text) >= OCR_GARBLED_SHARE
        or _symbol_share(text) >= OCR_SYMBOL_SHARE
        or _byte_map_share(text) >= OCR_BYTE_MAP_SHARE
    ):
        return "garbled"
    if sum(ch.isalnum() for ch in text) < OCR_PAGE_MIN_CHARS and _page_has_picture(page):
        return "no_text"
    return None


# The recognizer drops the space after a heading's number ("I.INTRODUCTION", "2.Methods", "2.2.1计算基础性能得分"):
# put it back, so that the heading reads as numbered. Before CJK text a number is a heading's only when dotted or
# when the line is short ("3实验评估"), and never before a measure word or unit: "3个节点" stays as it is.
_OCR_GLUED_NUMBER = re.compile(r"^((?:[IVX]{1,5}|\d{1,2}(?:\.\d{1,2}){0,3})\.)(?=[A-Z][A-Za-z])")
_OCR_GLUED_CJK_NUMBER = re.compile(f"^(\\d{{1,2}}(?:\\.\\d{{1,2}}){{0,3}})(?=[{_CJK_RANGES}])")
OCR_SHORT_LINE = 16
_MEASURE_WORDS = frozenset("个种次年月日号位项类步层维倍名台条组份篇元万亿千百十秒分时天周")


def ocr_line_text(text: str) -> str:
    """A recognised line as the layer writes it: a heading's number set apart from its text."""
    text = _OCR_GLUED_NUMBER.sub(r"\1 ", text)
    glued = _OCR_GLUED_CJK_NUMBER.match(text)
    if glued and ("." in glued.group(1) or len(text) <= OCR_SHORT_LINE) and text[glued.end()] not in _MEASURE_WORDS:
        text = f"{glued.group(1)} {text[glued.end() :]}"
    return text


class OcrTimeout(Exception):
    """A page's OCR ran past KB_OCR_PAGE_SECONDS: the page is left out (and not cached, so a later run with a
    longer cap reads it)."""


def _ocr_image(page, dpi: int = OCR_DPI):
    """The page rendered for recognition: RGB at ``dpi``, as a (height, width, 3) array."""
    import numpy as np
    import pymupdf

    zoom = dpi / 72.0
    pix = page.get_pixmap(matrix=pymupdf.Matrix(zoom, zoom), colorspace=pymupdf.csRGB, alpha=False)
    return np.frombuffer(pix.samples, dtype=np.uint8).reshape(pix.height, pix.width, pix.n)[:, :, :3]


def _detect_lines(reader, image):
    """The text lines' quadrilaterals in full-size pixels. The detector sees the page shrunk to OCR_DETECT_SIDE
    on its long side (and OCR_DETECT_PIXELS in all, for square and wide pages): it finds the same lines there
    at half the cost, and the recognizer still reads each line cut from the full-size picture."""
    import cv2
    import numpy as np

    height, width = image.shape[:2]
    scale = min(1.0, OCR_DETECT_SIDE / max(height, width), math.sqrt(OCR_DETECT_PIXELS / (height * width)))
    small = (
        image
        if scale >= 1.0
        else cv2.resize(image, (round(width * scale), round(height * scale)), interpolation=cv2.INTER_AREA)
    )
    boxes, _ = reader.text_det(small)
    if boxes is None or len(boxes) == 0:
        return []
    boxes = np.asarray(boxes, dtype=np.float32) / scale
    boxes[..., 0] = np.clip(boxes[..., 0], 0, width - 1)
    boxes[..., 1] = np.clip(boxes[..., 1], 0, height - 1)
    return reader.sorted_boxes(boxes)


def _recognise(reader, crops: list, deadline: float | None) -> list:
    """(text, confidence) of each crop, in the crops' order. Crops of like width go together (a batch is
    padded to its widest), a few batches at a time, the clock looked at in between."""
    order = sorted(range(len(crops)), key=lambda i: crops[i].shape[1] / max(crops[i].shape[0], 1))
    found: list = [("", 0.0)] * len(crops)
    for start in range(0, len(order), OCR_RECOGNISE_STEP):
        if deadline is not None and time.monotonic() > deadline:
            raise OcrTimeout
        part = order[start : start + OCR_RECOGNISE_STEP]
        results, _ = reader.text_rec([crops[i] for i in part])
        for i, result in zip(part, results):
            found[i] = (result[0], result[1])
    return found


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, where the C library is glibc (else None)."""
    import ctypes

    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def _give_back_freed_memory() -> None:
    """Return the heap a page's OCR freed to the system. Recognition allocates on onnxruntime's threads, each
    with its own glibc heap, and batches of new widths leave those heaps fragmented: without this a 100-page
    scan grew a reader by 14 MB a page (2.1 GB at the end); with it the process stays near 0.5 GB."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def ocr_page_lines(page, deadline: float | None = None, threads: int = 0, dpi: int = OCR_DPI) -> list[list]:
    """The page's recognised lines, ``[text, [x0, y0, x1, y1], confidence]`` in page coordinates, in the order
    the detector found them (reading order is decided later, from the boxes), read from its picture at ``dpi``.
    Past ``deadline`` (a time.monotonic() value) it raises OcrTimeout."""
    import pymupdf

    reader = _ocr_reader(threads)
    image = _ocr_image(page, dpi)
    boxes = _detect_lines(reader, image)
    if deadline is not None and time.monotonic() > deadline:
        raise OcrTimeout
    # no direction classifier: it turned upright lines of text pages over (7 of 120 lines of one page), and a page
    # set upside down as a whole is put right by its /Rotate before it is rendered
    try:
        found = _recognise(reader, reader.get_crop_img_list(image, boxes), deadline)
    finally:
        _give_back_freed_memory()
    zoom = dpi / 72.0
    back = ~(page.rotation_matrix * pymupdf.Matrix(zoom, zoom)) if page.rotation else None
    lines = []
    for box, (text, confidence) in zip(boxes, found):
        text = normalize_text(str(text)).strip()
        if not text or float(confidence) < OCR_MIN_CONFIDENCE:
            continue
        points = [
            pymupdf.Point(float(x), float(y)) * back
            if back is not None
            else pymupdf.Point(float(x) / zoom, float(y) / zoom)
            for x, y in box
        ]
        xs, ys = [p.x for p in points], [p.y for p in points]
        lines.append(
            [
                text,
                [round(min(xs), 2), round(min(ys), 2), round(max(xs), 2), round(max(ys), 2)],
                round(float(confidence), 4),
            ]
        )
    return lines


def column_side(x0: float, x1: float, width: float) -> str:
    """Where a box sits on a page of this width: "full" (across the middle), "left" or "right" column."""
    mid, tolerance = width / 2, width * 0.04
    if x0 < mid - tolerance and x1 > mid + tolerance:
        return "full"
    return "left" if (x0 + x1) / 2 < mid else "right"


def ocr_rows(lines: list[list]) -> list[list]:
    """The lines top to bottom, those side by side left to right: a line whose middle lies within the height of
    the row's first line belongs to that row (the cells of a table row, a line the detector cut in pieces). By
    their tops alone, cells a fraction of a point apart would be read in a random order."""
    rows: list[tuple[float, float, list[list]]] = []
    for line in sorted(lines, key=lambda line: (line[1][1] + line[1][3]) / 2):
        middle = (line[1][1] + line[1][3]) / 2
        if rows and rows[-1][0] <= middle <= rows[-1][1]:
            rows[-1][2].append(line)
        else:
            rows.append((line[1][1], line[1][3], [line]))
    return [line for _, _, row in rows for line in sorted(row, key=lambda line: line[1][0])]


def ocr_line_order(lines: list[list], width: float) -> list[list]:
    """The lines in writing order for the layer: top to bottom within each column, the left column of a band
    before the right one, full-width lines (titles, headings across both columns) where they fall. Lines written
    in the recognizer's row order would sit side by side on one baseline and be read as one line across both
    columns; in this order each stays a line of its own column."""
    ordered: list[list] = []
    band: dict[str, list[list]] = {"left": [], "right": []}

    def flush() -> None:
        for side in ("left", "right"):
            ordered.extend(ocr_rows(band[side]))
            band[side] = []

    for line in sorted(lines, key=lambda line: line[1][1]):
        side = column_side(line[1][0], line[1][2], width)
        if side == "full":
            flush()
            ordered.append(line)
        else:
            band[side].append(line)
    flush()
    return ordered


def _ocr_line_height(text: str, box) -> float:
    """The height of a recognised line's type: its box's height, except for a line with CJK characters (six or
    more), whose box grows with raised citation marks and brackets ("[8-11]", "(SINet,") while its characters
    stay square. There the type is no taller than the box's width shared among its characters (a CJK character one
    em, any other half of one). Taken at the box's height, such a line of running text read as set larger, and as a
    heading."""
    height = box[3] - box[1]
    cjk = len(_CJK_CHAR.findall(text))
    if cjk < 6:
        return height
    return min(height, (box[2] - box[0]) / (cjk + 0.5 * (len(text) - cjk)))


def layer_ocr_lines(page, lines: list[list]) -> None:
    """Write the lines onto the in-memory page as invisible text filling their boxes. Heights within a fifth of
    the page's median line height take the median, so that the text's size reads as one body size and only
    clearly larger lines (titles, headings) stand out. The font size is 0.8 of the box height: larger, and the
    gaps between lines shrink until a heading's line joins the paragraph below it."""
    import pymupdf

    if not lines:
        return
    font = pymupdf.Font("cjk")  # Droid Sans Fallback: Latin, Greek, Cyrillic and CJK in one font
    page.insert_font(fontname="kbocr", fontbuffer=font.buffer)
    heights = sorted(_ocr_line_height(text, box) for text, box, _ in lines)
    median = heights[len(heights) // 2]
    for text, (x0, y0, x1, y1), _ in ocr_line_order(lines, page.rect.width):
        text = ocr_line_text(text)
        height = _ocr_line_height(text, (x0, y0, x1, y1))
        if median and 0.8 <= height / median <= 1.25:
            height = median
        size = max(height * 0.8, 1.0)
        width = font.text_length(text, size)
        if width <= 0 or x1 <= x0:
            continue
        origin = pymupdf.Point(x0, y0 + (y1 - y0) * 0.8)
        page.insert_text(
            origin,
            text,
            fontsize=size,
            fontname="kbocr",
            render_mode=3,
            morph=(origin, pymupdf.Matrix((x1 - x0) / width, 1)),
        )


def _ocr_page(
    page,
    number: int,
    sha256: str | None,
    cache: OcrCache | None,
    deadline: float | None = None,
    threads: int = 0,
    clear: bool = False,
    dpi: int = OCR_DPI,
) -> list[list]:
    """The page's OCR lines (cached, else read from the page as drawn at ``dpi``), laid onto it as its text
    layer. ``clear`` removes the layer it has first (a broken one; every one under force), once the page was
    read: a broken map's glyphs still draw the text, and removed first, they would take it out of the picture."""
    lines = cache.get(sha256, number, dpi) if cache is not None and sha256 else None
    if lines is None:
        lines = ocr_page_lines(page, deadline, threads, dpi)
        if cache is not None and sha256:
            cache.put(sha256, number, lines, dpi)
    if clear:
        page.add_redact_annot(page.rect)
        page.apply_redactions(images=0, graphics=0)
    layer_ocr_lines(page, lines)
    return lines


OCR_FIELD = Field(
    "ocr",
    "string",
    '`"auto"` (or `KB_OCR`)',
    "`auto`: OCR the pages of a PDF that have no usable text layer (no text, or text that cannot be "
    "read) when the OCR extra is installed (`pip install 'kb-rag[ocr]'`); `off`: skip such PDFs as "
    "before; `force`: OCR every page. OCR'd text is cached beside the library by the file's checksum "
    "(`ocr-cache.sqlite`, never reached through a symbolic link; a cached page that cannot be used is "
    "OCR'd again)",
    cli=(
        Flag(
            ("--ocr",),
            "OCR pages without a usable text layer: auto (default), off, force",
            {"choices": OCR_MODES, "default": None},
        ),
    ),
)
