"""Evidence: snippet boxes: a passage's glyph rectangles on its page.

May import: config, reading.ocr, reading.pdf, retrieval.fusion, storage.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..config import KBError
from ..reading.ocr import OCR_CACHE_FILENAME, OcrCache, layer_ocr_lines, ocr_page_dpi, ocr_reason
from ..reading.pdf import _pdf_page_blocks
from ..retrieval.fusion import _ocr_pages
from ..storage import Library, sha256_of_file

# Where a hit's passage lies on its PDF page, and a picture of it there.
#
# Snippet boxes (``boxes: true`` on search and rag): the passage is found again among the page's own glyphs
# (PyMuPDF's structured text, with the reader's flags) by letters and digits alone. The page text joins hyphenated
# line ends, prints superscript citations as [n], unfolds ligatures and leaves out running heads; none of that
# changes the passage's letters and digits. It is placed piece by piece (the longest stretch found at once, then
# the rest): a piece continues the one before when it comes next in glyph order, past a few skipped characters (a
# dropped footnote mark, a subscript) or, for a longer piece, past a figure's labels; a piece elsewhere (a column
# stored out of order) counts only when it makes the one placement the whole passage has. Each line's rectangle is
# then cleared of every other glyph it touches, and a last check counts what the rectangles touch, so that the
# text inside them is the passage's, each glyph once, and nothing else. Anything less certain leaves the hit
# without boxes and a note: a box is never drawn on the wrong lines. Boxes are computed after the query cache,
# from the file as it is now.
#
# Pictures (``show``): the page, or the passage with some context, rendered as PNG with a translucent marker
# multiplied over the boxes and no other pixel changed.

BOX_MIN_PIECE = 4  # letters and digits a piece of a passage needs to be placed on its own
BOX_MIN_JUMP = 8  # ... and a piece that does not continue the one before
BOX_NEAR = 16  # key characters a piece may skip past the one before and still continue it
BOX_FAR = 240  # ... and how far on the next occurrence of a longer piece may still follow it
BOX_MAX_STARTS = 20  # occurrences of a passage's first piece tried before it counts as ambiguous
BOX_MIN_BAND = 0.3  # share of its ink band a line's rectangle keeps when cleared of other lines' glyphs
INK_ABOVE, INK_BELOW = 0.72, 0.05  # the ink band: these shares of the font size above and below the baseline
PAGE_CACHE_PAGES = 48  # pages of glyphs a resident engine keeps (about 1 MB each)


# TeX sets an accented i or j as a dotless letter with a separate accent glyph; the page text has the composed one
_DOTLESS = {"\u0131": "i", "\u0237": "j"}


def _glyph_key(c: str) -> str:
    """A character's letters and digits: case-folded, ligatures unfolded, accents (combining or spacing) dropped."""
    if c.isascii():
        return c.lower() if c.isalnum() else ""
    return "".join(
        _DOTLESS.get(k, k)
        for k in unicodedata.normalize("NFKD", c).casefold()
        if k.isalnum() and not "\u02b0" <= k <= "\u02ff"
    )


def box_key(text: str) -> str:
    """``text``'s letters and digits, as ``_glyph_key`` keeps them."""
    return "".join(_glyph_key(c) for c in text)


def _overlaps(a, b) -> bool:
    """Whether two rectangles share area (PyMuPDF's own test for a glyph inside a text box)."""
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _across(rect, vertical: bool):
    """A rectangle with its axes swapped for a vertical line, so that "across the line" is always y."""
    return (rect[1], rect[0], rect[3], rect[2]) if vertical else tuple(rect)


class PageGlyphs:
    """One PDF page's glyphs as a key string (``_glyph_key`` of each glyph), and for each key character its glyph:
    the glyph's box, baseline origin, font size and line. A line's rectangle spans its glyphs' advances along the
    line and, across it, the ink band from just under the baseline to about cap height (PyMuPDF's glyph boxes
    span the font's whole ascent and descent and so reach into the lines above and below)."""

    def __init__(self, lines: list):
        """``lines``: the page's text lines, as ``page_text_lines`` reads them."""
        keys: list[str] = []
        self.glyphs: list[tuple] = []  # (bbox, origin, size, line index, has a key)
        self.lines: list[tuple] = []  # (bbox, direction, first glyph, end glyph)
        self.owner: list[int] = []  # key position -> glyph index
        for bbox, direction, chars in lines:
            first, line_index = len(self.glyphs), len(self.lines)
            for c, box, origin, size in chars:
                key = _glyph_key(c)
                if key:
                    keys.append(key)
                    self.owner.extend([len(self.glyphs)] * len(key))
                self.glyphs.append((box, origin, size, line_index, bool(key)))
            self.lines.append((bbox, tuple(direction), first, len(self.glyphs)))
        self.key = "".join(keys)

    def occurrences(self, piece: str, limit: int = BOX_MAX_STARTS + 1) -> list[int]:
        found: list[int] = []
        at = self.key.find(piece)
        while at >= 0 and len(found) < limit:
            found.append(at)
            at = self.key.find(piece, at + 1)
        return found

    def longest_prefix(self, key: str) -> int:
        """Length of the longest prefix of ``key`` found somewhere on the page (0: none)."""
        lo, hi = 0, len(key)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if key[:mid] in self.key:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _vertical(self, line_index: int) -> bool:
        dx, dy = self.lines[line_index][1]
        return abs(dy) > abs(dx)

    def ink_rect(self, glyph_index: int) -> tuple[float, float, float, float]:
        """A glyph's box along its line, cut across the line to the ink band."""
        (x0, y0, x1, y1), origin, size, line_index, _ = self.glyphs[glyph_index]
        ox, oy = origin or (x0, y1)
        dx, dy = self.lines[line_index][1]
        up_x, up_y = dy, -dx  # towards the top of the glyphs (top-left origin: upright text has up = (0, -1))
        ends = (
            (ox + up_x * INK_ABOVE * size, oy + up_y * INK_ABOVE * size),
            (ox - up_x * INK_BELOW * size, oy - up_y * INK_BELOW * size),
        )
        if not self._vertical(line_index):  # a horizontal line: the band is vertical
            return x0, min(e[1] for e in ends), x1, max(e[1] for e in ends)
        return min(e[0] for e in ends), y0, max(e[0] for e in ends), y1

    def _baseline(self, glyph_index: int) -> float:
        """Where a glyph sits across its line (its origin's y, or x on a vertical line)."""
        bbox, origin, _, line_index, _ = self.glyphs[glyph_index]
        ox, oy = origin or (bbox[0], bbox[3])
        return ox if self._vertical(line_index) else oy

    def fragments(self, spans: list[tuple[int, int]]) -> list[tuple[int, list[int]]]:
        """(line, glyphs) for each run of the spans' key characters that stays on one line and one baseline
        without a skip: a raised or lowered run (a superscript, an index) is a fragment of its own, with its own
        ink band."""
        frags: list[tuple[int, list[int]]] = []
        last = -2
        for lo, hi in spans:
            for pos in range(lo, hi):
                glyph = self.owner[pos]
                line_index, size = self.glyphs[glyph][3], self.glyphs[glyph][2]
                previous = frags[-1][1][-1] if frags else None
                if previous == glyph and pos == last + 1:
                    pass  # one glyph, several key characters (a ligature)
                elif (
                    previous is not None
                    and frags[-1][0] == line_index
                    and pos == last + 1
                    and abs(self._baseline(glyph) - self._baseline(previous)) <= 0.2 * max(size, 1.0)
                ):
                    frags[-1][1].append(glyph)
                else:
                    frags.append((line_index, [glyph]))
                last = pos
        return frags

    def _cleared(self, line_index: int, own: list[int]) -> list[tuple] | None:
        """The rectangle of one fragment, cut clear of every other glyph with a key whose box it touches: a
        glyph of another line (above or below) takes the edge of the band back to its box, one on this line
        splits the rectangle around it. None when too little of the band is left or a glyph of the fragment
        is no longer touched."""
        vertical = self._vertical(line_index)
        inks = [_across(self.ink_rect(g), vertical) for g in own]
        whole = (min(r[0] for r in inks), min(r[1] for r in inks), max(r[2] for r in inks), max(r[3] for r in inks))
        height = whole[3] - whole[1]
        parts = [whole]
        mine = set(own)
        for bbox, _, first, end in self.lines:
            if not _overlaps(_across((bbox[0] - 1, bbox[1] - 1, bbox[2] + 1, bbox[3] + 1), vertical), whole):
                continue
            for g in range(first, end):
                if g in mine or not self.glyphs[g][4]:
                    continue
                other = _across(self.glyphs[g][0], vertical)
                parts = [cut for part in parts for cut in _clear_of(part, other)]
        boxes = [_across(self.glyphs[g][0], vertical) for g in own if self.glyphs[g][4]]
        parts = [p for p in parts if any(_overlaps(p, b) for b in boxes)]
        if any(p[3] - p[1] < BOX_MIN_BAND * height for p in parts) or not all(
            any(_overlaps(p, b) for p in parts) for b in boxes
        ):
            return None
        return [_across(p, vertical) for p in parts]

    def rects(self, spans: list[tuple[int, int]]) -> list[list[float]] | None:
        """One rectangle per line fragment of the key spans (more where another glyph splits a line), each
        rounded inwards; None when some line cannot be boxed apart from its neighbours."""
        out: list[list[float]] = []
        owned: set[int] = set()
        for line_index, own in self.fragments(spans):
            parts = self._cleared(line_index, own)
            if parts is None:
                return None
            owned.update(own)
            out.extend(
                [
                    math.ceil(x0 * 100 + 1) / 100,
                    math.ceil(y0 * 100) / 100,
                    math.floor(x1 * 100 - 1) / 100,
                    math.floor(y1 * 100) / 100,
                ]
                for x0, y0, x1, y1 in parts
            )
        return out if self._exactly(out, owned) else None

    def _exactly(self, rects: list[list[float]], owned: set[int]) -> bool:
        """Whether the rectangles touch each glyph of the passage once and no other glyph with a key, as PyMuPDF
        decides what a text box holds (a glyph box sharing any area). The check behind "placed or absent"."""
        if any(r[2] <= r[0] or r[3] <= r[1] for r in rects):
            return False
        for bbox, _, first, end in self.lines:
            near = [r for r in rects if _overlaps(r, (bbox[0] - 1, bbox[1] - 1, bbox[2] + 1, bbox[3] + 1))]
            for g in range(first, end) if near else ():
                if self.glyphs[g][4]:
                    touched = sum(_overlaps(r, self.glyphs[g][0]) for r in near)
                    if touched != (g in owned):
                        return False
        return all(any(_overlaps(r, self.glyphs[g][0]) for r in rects) for g in owned if self.glyphs[g][4])


def _clear_of(part: tuple, other: tuple) -> list[tuple]:
    """``part`` (axes as ``_across`` gives them) cut clear of the box ``other``."""
    if not _overlaps(part, other):
        return [part]
    middle = (other[1] + other[3]) / 2
    if middle <= part[1]:  # mostly above the band: give up the band's top
        return [(part[0], other[3], part[2], part[3])] if other[3] < part[3] else []
    if middle >= part[3]:  # mostly below it
        return [(part[0], part[1], part[2], other[1])] if other[1] > part[1] else []
    return [
        p for p in ((part[0], part[1], other[0], part[3]), (other[2], part[1], part[2], part[3])) if p[2] > p[0]
    ]  # on the line itself: split around it


BOX_SEARCH_STEPS = 400  # placements tried for one passage before it counts as ambiguous


def _placements(
    glyphs: PageGlyphs, key: str, after: int | None, used: list[tuple[int, int]], lead: bool, steps: list[int]
) -> list:
    """Ways to spell ``key`` on the page piece by piece (each piece the longest stretch found at once), after a
    piece ending at ``after``; at most two are returned (two mean ambiguous). A piece continues the one before
    when its occurrence follows within ``BOX_NEAR`` skipped characters (``BOX_FAR`` for a piece of
    ``BOX_MIN_JUMP``); the first such occurrence that lets the rest be placed is taken, reading order being the
    best evidence. Only when none does may a piece lie elsewhere (another column), and then the placement
    counts only if it is the single one; a short piece there must be continued by the next (``lead``)."""
    steps[0] -= 1
    if steps[0] < 0:
        return [None, None]
    size = glyphs.longest_prefix(key)
    if size < min(BOX_MIN_PIECE, len(key)):
        return []
    found = glyphs.occurrences(key[:size])
    rest_key = key[size:]
    reach = BOX_NEAR if lead or size < BOX_MIN_JUMP else BOX_FAR

    def free(at):
        return not any(lo < at + size and at < hi for lo, hi in used)

    def go_on(at, must_lead):
        if not rest_key:
            return [] if must_lead else [[(at, at + size)]]
        return [
            None if r is None else [(at, at + size), *r]
            for r in _placements(glyphs, rest_key, at + size, [*used, (at, at + size)], must_lead, steps)
        ]

    following = [at for at in found if after is not None and after <= at <= after + reach and free(at)]
    for at in following:
        ways = go_on(at, False)
        if ways:
            return ways
    if lead:
        return []
    if len(found) > BOX_MAX_STARTS:
        return [None, None]
    out: list = []
    for at in found:
        if at in following or not free(at):
            continue
        # a short piece elsewhere must be continued by the next; a whole short passage may stand alone
        out += go_on(at, size < BOX_MIN_JUMP and (after is not None or bool(rest_key)))
        if len(out) > 1:
            break
    return out[:2]


def place_passage(glyphs: PageGlyphs, key: str) -> list[tuple[int, int]] | str:
    """Where the passage ``key`` lies on the page (spans of the page's key), or why it cannot be placed."""
    if not key:
        return "the snippet has no letters or digits to place"
    if glyphs.longest_prefix(key) < min(BOX_MIN_PIECE, len(key)):
        return "the snippet's text is not among the page's glyphs"
    ways = _placements(glyphs, key, None, [], False, [BOX_SEARCH_STEPS])
    if len(ways) > 1:
        return "the snippet's text occurs more than once on the page"
    if not ways:
        return "the snippet's text is not in one reading order among the page's glyphs"
    return ways[0]


def _chunk_offset(page_map: list, page: int, page_offset: int, at_end: bool) -> int | None:
    """The chunk offset of a page-text offset (the inverse of ``page_offsets_of_span``)."""
    for offset, entry_page, entry_offset, length, *_ in page_map:
        if entry_page != page or entry_offset is None:
            continue
        inside = (
            entry_offset < page_offset <= entry_offset + length
            if at_end
            else entry_offset <= page_offset < entry_offset + length
        )
        if inside:
            return offset + page_offset - entry_offset
    return None


def snippet_pieces(text: str, page_map: list, span: Mapping[str, Any]) -> list[tuple[int, str]] | None:
    """A passage (``page``, ``char_start``, ``page_end``, ``char_end`` as a hit carries them) as (page, text)
    pieces of the chunk text, one per page it touches; None when the chunk does not hold it."""
    if span.get("char_start") is None or span.get("char_end") is None or not span.get("page"):
        return None
    start = _chunk_offset(page_map, span["page"], span["char_start"], at_end=False)
    end = _chunk_offset(page_map, span.get("page_end") or span["page"], span["char_end"], at_end=True)
    if start is None or end is None or end <= start:
        return None
    pieces: dict[int, list[str]] = {}
    for offset, page, _, length, *_ in page_map:
        lo, hi = max(start, offset), min(end, offset + length)
        if page is not None and hi > lo:
            pieces.setdefault(page, []).append(text[lo:hi])
    return [(page, " ".join(parts)) for page, parts in sorted(pieces.items())]


def page_text_lines(page) -> list:
    """A page's text lines as plain lists, ``[bbox, direction, [[character, bbox, origin, font size], ...]]``, from
    PyMuPDF's structured text with the reader's flags: what ``PageGlyphs`` is made of, and what the page process
    sends back (floats survive JSON exactly, so the boxes are the ones an in-process reading would give)."""
    import pymupdf

    flags = pymupdf.TEXTFLAGS_DICT & ~pymupdf.TEXT_PRESERVE_IMAGES  # as the reader extracts the page
    lines = []
    for block in page.get_text("rawdict", flags=flags).get("blocks", []):
        for line in block.get("lines", []) if block.get("type") == 0 else []:
            chars = [
                [glyph.get("c", ""), list(glyph["bbox"]), glyph.get("origin"), span.get("size") or 0.0]
                for span in line.get("spans", [])
                for glyph in span.get("chars", [])
            ]
            lines.append([list(line["bbox"]), list(line.get("dir") or (1.0, 0.0)), chars])
    return lines


FILE_CHANGED = "the file changed since it was indexed; ingest it again"


def _file_stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    """What changes whenever a file's bytes may have: its size, mtime, ctime and inode. ``cp -p``, ``rsync -t``, tar
    and touch can set an mtime back, but nothing short of the system clock sets a ctime."""
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def verified_stamp(row, known: dict | None = None) -> tuple | str:
    """``(path, size, mtime_ns, ctime_ns, inode)`` of the file at the document's path when it is the one indexed,
    else why not. Another size settles it at once; otherwise the file's sha256 is compared with the indexed one,
    whatever its mtime says (a file replaced by another of the same size with the old mtime restored is not the
    indexed one), and ``known`` remembers the verdict for that stamp, so that an untouched file is hashed once."""
    try:
        st = os.stat(row["path"])
    except (OSError, TypeError):
        return "the file is no longer at its indexed path"
    if st.st_size != row["size"]:
        return FILE_CHANGED
    stamp = (row["path"], *_file_stamp(st))
    memo = (*stamp, row["sha256"])
    if known is not None and memo in known:
        return known[memo]
    verdict: tuple | str = stamp
    if not row["sha256"]:  # no hash recorded: the size and mtime are all there is to go by
        verdict = stamp if st.st_mtime_ns == row["mtime_ns"] else FILE_CHANGED
    else:
        try:
            same = sha256_of_file(row["path"]) == row["sha256"]
            again = os.stat(row["path"])
        except OSError:
            return "the file cannot be read"
        if _file_stamp(again) != stamp[1:]:
            return FILE_CHANGED  # written to while it was hashed: not settled, so not remembered
        verdict = stamp if same else FILE_CHANGED
    if known is not None:
        known[memo] = verdict
    return verdict


def indexed_file_state(row, known: dict | None = None) -> str | None:
    """None when the file at the document's path is the one indexed, else why not (see ``verified_stamp``)."""
    verdict = verified_stamp(row, known)
    return verdict if isinstance(verdict, str) else None


# -- the page process ---------------------------------------------------------------------------------------
# Every reading of a page at answer time (its glyphs for snippet boxes, its picture, a figure's region) runs in a
# separate process under a deadline. Why a process: PyMuPDF keeps the interpreter lock while MuPDF interprets a
# page (measured: a thread that ticks every 10 ms ran twice during a 1.9 s get_pixmap, and a thread meant to
# raise an fz_cookie's ``abort`` 1 s into a 16 s fz_run_page ran only once the run had ended), so nothing in the
# engine's process can act until MuPDF is done: MuPDF's own way to stop, that ``abort`` flag, works when raised
# before a run but cannot be raised during one. A page of nested forms (each drawing the one below ten times: the
# PDF "billion laughs") costs minutes to hours; the page process is killed at the deadline instead and the page
# remembered. It is started once and kept: its start (an interpreter and PyMuPDF) takes a second or two, once,
# overlapped with the request's other work (``warm``); a dense page's glyphs cost some tens of milliseconds more
# than in-process (JSON), and a resident engine keeps them (searches of the sample papers with 3 pictures, in
# serve: the same time each as drawing in-process, the first one a second or so later).

DRAW_SECONDS = 10.0  # KB_DRAW_SECONDS: the longest one page's reading or drawing may take at answer time
DRAW_START_SECONDS = 120.0  # the page process's own start (imports), never counted against a page
DRAW_CPU_MARGIN_S = 30  # CPU seconds past its deadline after which a page process left alone ends itself
SLOW_PAGES_KEPT = 1024  # pages remembered as past the deadline (a few hundred bytes each)


def draw_seconds() -> float:
    """KB_DRAW_SECONDS, a positive number of seconds (fractions allowed), else ``DRAW_SECONDS``."""
    try:
        value = float(os.environ.get("KB_DRAW_SECONDS", "") or DRAW_SECONDS)
    except ValueError:
        return DRAW_SECONDS
    return value if math.isfinite(value) and value > 0 else DRAW_SECONDS


class PageWorkFailed(Exception):
    """A page could not be read or drawn in the page process; the message says why."""


class PageTooSlow(PageWorkFailed):
    """A page's reading or drawing ran past its deadline and was stopped."""


def _send_frame(stream, data: bytes) -> None:
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def _read_frame(stream) -> bytes | None:
    """One length-prefixed frame, or None at the end of the stream (or a cut one)."""
    head = stream.read(4)
    if len(head) < 4:
        return None
    size = struct.unpack(">I", head)[0]
    data = stream.read(size)
    return data if len(data) == size else None


def _pass_replies(stream, replies) -> None:
    """The page process's replies (a JSON frame and a data frame each) onto ``replies``; None once it has ended."""
    try:
        while True:
            header = _read_frame(stream)
            data = _read_frame(stream) if header is not None else None
            if data is None:
                break
            replies.put((header, data))
    except (OSError, ValueError):
        pass
    replies.put(None)


class PageProcess:
    """The engine's page process (``kb_engine.py pages``, see ``serve_pages``): one request at a time, each
    answered within its deadline or the process is killed, and started again for the next request."""

    def __init__(self):
        import threading

        self.lock = threading.Lock()
        self.process: Any = None
        self.replies: Any = None
        self.ready = False
        self.registered = False

    def _spawn(self) -> None:
        import atexit
        import queue
        import subprocess
        import threading

        if not self.registered:
            atexit.register(self.stop)
            self.registered = True
        process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "pages"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        self.process, self.replies, self.ready = process, queue.Queue(), False
        threading.Thread(
            target=_pass_replies, args=(process.stdout, self.replies), name="kb-pages", daemon=True
        ).start()

    def _running(self) -> None:
        """A live process that has said it is ready, started now if need be."""
        import queue

        if self.process is None or self.process.poll() is not None:
            self.stop()
            self._spawn()
        if not self.ready:
            try:
                self.ready = self.replies.get(timeout=DRAW_START_SECONDS) is not None
            except queue.Empty:
                pass
            if not self.ready:
                self.stop()
                raise PageWorkFailed("the page process could not start (is PyMuPDF installed?)")

    def warm(self) -> None:
        """Start the process now, without waiting for it, when a request will need it: its start (the import of
        PyMuPDF) then overlaps the request's other work (retrieval, loading a model, hashing the file)."""
        with self.lock:
            if self.process is None or self.process.poll() is not None:
                self.stop()
                self._spawn()

    def stop(self) -> None:
        process, self.process, self.ready = self.process, None, False
        if process is not None:
            process.kill()
            process.wait()
            for stream in (process.stdin, process.stdout):
                try:
                    stream.close()
                except OSError:
                    pass

    def ask(self, request: dict, seconds: float) -> tuple[dict, bytes]:
        """(the result, its data) of one request; PageTooSlow past ``seconds``, PageWorkFailed when the page
        cannot be read, KBError with the process's code for a request it refuses."""
        import queue

        with self.lock:
            self._running()
            try:
                _send_frame(self.process.stdin, json.dumps({**request, "seconds": seconds}).encode())
                reply = self.replies.get(timeout=seconds)
            except queue.Empty:
                self.stop()
                raise PageTooSlow(f"{seconds:g} s") from None
            except OSError:
                reply = None
            if reply is None:
                self.stop()
                raise PageWorkFailed("the page process ended while working on the page (MuPDF crashed on it?)")
        answer = json.loads(reply[0])
        if answer.get("ok"):
            return answer["result"], reply[1]
        if answer.get("code"):
            raise KBError(answer["code"], answer["error"])
        raise PageWorkFailed(answer["error"])


PAGE_PROCESS = PageProcess()  # one per engine process, shared by its libraries


@dataclass(frozen=True)
class IndexedPdf:
    """An indexed PDF as the page process reads it: its path and the stamp it was verified under (the key of its
    pages in the cache; the page process checks the file still has it), its page count, and the pages whose OCR'd
    text ingest laid on, to be laid on again from the cache."""

    path: str
    stamp: tuple
    pages: int
    ocr_pages: tuple[int, ...] = ()
    sha256: str | None = None
    ocr_cache: str = ""

    def wire(self) -> dict:
        return {
            "path": self.path,
            "stamp": list(self.stamp),
            "ocr_pages": list(self.ocr_pages),
            "sha256": self.sha256,
            "ocr_cache": self.ocr_cache,
        }


# What each kind of page work is called in a note (and a page of 0 is the file as a whole).
PAGE_WORK = {
    "open": "opening the file",
    "glyphs": "reading the text of page {page}",
    "picture": "drawing page {page}",
    "figure": "finding the figure regions of page {page}",
}


class PageCache:
    """Glyphs of recently used pages, files found unchanged by hash, and pages whose reading or drawing ran past
    the deadline, kept by a resident engine between requests (keyed by path, size, mtime, ctime and inode, so a
    changed file is read again)."""

    def __init__(self, size: int = PAGE_CACHE_PAGES):
        from collections import OrderedDict

        self.size = size
        self.pages: OrderedDict[tuple, PageGlyphs | str] = OrderedDict()
        self.files: dict[tuple, tuple | str] = {}
        self.slow: OrderedDict[tuple, float] = OrderedDict()  # (stamp, page, work) -> the deadline it overran

    def work(self, pdf: IndexedPdf, kind: str, page: int = 0, **args) -> tuple[dict, bytes]:
        """One piece of page work in the page process, under the deadline. A page that overran it once is not
        tried again for the same work until the file changes: PageTooSlow at once."""
        key = (pdf.stamp, page, kind)
        what = PAGE_WORK[kind].format(page=page)
        if key in self.slow:
            raise PageTooSlow(
                f"{what} took longer than {self.slow[key]:g} s (KB_DRAW_SECONDS) before; it is not "
                f"tried again until the file changes"
            )
        seconds = draw_seconds()
        try:
            return PAGE_PROCESS.ask({"work": kind, "doc": pdf.wire(), "page": page, **args}, seconds)
        except PageTooSlow:
            self.slow[key] = seconds
            while len(self.slow) > SLOW_PAGES_KEPT:
                self.slow.popitem(last=False)
            raise PageTooSlow(f"{what} took longer than {seconds:g} s (KB_DRAW_SECONDS) and was stopped") from None

    def glyphs(self, pdf: IndexedPdf, page: int) -> PageGlyphs | str:
        """The page's glyphs, or why they cannot be had."""
        if not 0 < page <= pdf.pages:
            return f"page {page} is not in the file"
        key = (*pdf.stamp, page)
        if key in self.pages:
            self.pages.move_to_end(key)
            return self.pages[key]
        try:
            found: PageGlyphs | str = PageGlyphs(self.work(pdf, "glyphs", page)[0]["lines"])
        except PageTooSlow as exc:
            return str(exc)  # remembered as slow, not as the page's glyphs
        except PageWorkFailed as exc:
            found = f"page {page} cannot be read ({exc})"
        except KBError as exc:  # the file is no longer the one verified
            found = exc.message
        self.pages[key] = found
        while len(self.pages) > self.size:
            self.pages.popitem(last=False)
        return found


def layer_cached_ocr(doc, ocr_pages: Iterable[int], sha256: str, cache_file: str) -> None:
    """Put the OCR'd text of an indexed document back on its pages, from the cache, as ingest laid it (a garbled
    or forced page's own layer redacted first): the glyph boxes of snippets and ``show`` then find the passages
    on scanned pages too. A page missing from the cache (or whose row cannot be used) keeps what the file has."""
    if not os.path.exists(cache_file):
        return
    cache = OcrCache(cache_file)
    try:
        for number in ocr_pages:
            if not 1 <= number <= doc.page_count:
                continue
            page = doc[number - 1]
            dpi = ocr_page_dpi(page)
            lines = cache.get(sha256, number, dpi) if dpi is not None else None
            if not lines:
                continue
            blocks, _ = _pdf_page_blocks(page)
            if ocr_reason(page, blocks, "auto") in (None, "garbled"):  # forced, or a broken layer
                page.add_redact_annot(page.rect)
                page.apply_redactions(images=0, graphics=0)
            layer_ocr_lines(page, lines)
    finally:
        cache.close()


class BoxPlacer:
    """Places the passages of one request, verifying and opening each file once; pages come from ``cache`` (a
    fresh one when the caller keeps none)."""

    def __init__(self, lib: Library, cache: PageCache | None = None):
        self.lib = lib
        self.cache = cache or PageCache()
        self.documents: dict[int, IndexedPdf | str] = {}  # the verified file, or why it cannot be used
        self.codes: dict[int, str] = {}  # the error code of that why, for ``show``

    def document(self, doc_id: int) -> IndexedPdf | str:
        """The document's file, verified as the one indexed and opened in the page process, or the reason it
        cannot be used."""
        if doc_id not in self.documents:
            try:
                self.documents[doc_id] = self._open(doc_id)
            except KBError as exc:
                self.documents[doc_id], self.codes[doc_id] = exc.message, exc.code
        return self.documents[doc_id]

    def require(self, doc_id: int) -> IndexedPdf:
        """``document``, or the KBError that says why not."""
        opened = self.document(doc_id)
        if isinstance(opened, str):
            raise KBError(self.codes.get(doc_id, "stale"), f"document {doc_id}: {opened}")
        return opened

    def _open(self, doc_id: int) -> IndexedPdf:
        row = self.lib.doc_file_stamp(doc_id)
        if row is None:
            raise KBError("not_found", "no document has this doc_id")
        stamp = verified_stamp(row, self.cache.files)
        if isinstance(stamp, str):
            raise KBError("not_found" if "no longer" in stamp else "stale", stamp)
        pdf = IndexedPdf(
            row["path"],
            stamp,
            0,
            tuple(sorted(_ocr_pages(row["page_coverage"]))),
            row["sha256"],
            str(self.lib.root / OCR_CACHE_FILENAME),
        )
        try:
            opened = self.cache.work(pdf, "open")[0]
        except PageTooSlow as exc:
            raise KBError("too_slow", str(exc)) from None
        except PageWorkFailed as exc:  # PyMuPDF raises its own types for damaged files
            raise KBError("stale", f"the file cannot be opened ({exc})") from None
        return replace(pdf, pages=opened["pages"])

    def place(self, doc_id: int, span: Mapping[str, Any], text: str, page_map: list) -> dict:
        """``{"boxes": [...]}`` for a placed passage, else ``{"boxes_note": why}``."""
        pieces = snippet_pieces(text, page_map, span)
        if not pieces:
            return {"boxes_note": "the snippet has no page offsets to place"}
        pdf = self.document(doc_id)
        if isinstance(pdf, str):
            return {"boxes_note": pdf}
        boxes = []
        if len(pieces) > 1:  # a page holding only punctuation of the passage has nothing to box
            pieces = [(page, piece) for page, piece in pieces if box_key(piece)] or pieces
        for page, piece in pieces:
            glyphs = self.cache.glyphs(pdf, page)
            if isinstance(glyphs, str):
                return {"boxes_note": glyphs}
            placed = place_passage(glyphs, box_key(piece))
            if isinstance(placed, str):
                return {"boxes_note": f"{placed} (p. {page})"}
            rects = glyphs.rects(placed)
            if rects is None:
                return {
                    "boxes_note": f"the snippet's lines cannot be boxed apart from the text around them (p. {page})"
                }
            boxes.append({"page": page, "rects": rects})
        return {"boxes": boxes}
