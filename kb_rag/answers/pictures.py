"""Page pictures: highlighted page pictures for hits and ``show``, figure regions, the page process that draws them.

May import: answers.evidence, config, reading.citations, records, storage.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from ..answers.evidence import (
    DRAW_CPU_MARGIN_S,
    DRAW_SECONDS,
    FILE_CHANGED,
    BoxPlacer,
    IndexedPdf,
    PageCache,
    PageTooSlow,
    PageWorkFailed,
    _file_stamp,
    _overlaps,
    _read_frame,
    _send_frame,
    layer_cached_ocr,
    page_text_lines,
)
from ..config import KBError, _short_error
from ..reading.citations import _FIGURE_MENTION
from ..records import HitRecord
from ..storage import Library

# ``show`` renders a passage on its page. Only pixels inside the boxes change: the marker is multiplied in (white
# paper turns marker-yellow, ink stays dark), on whole pixels that lie inside a rectangle, so that a highlight can
# never bleed onto the line above or below. A picture is cropped by default to the passage's column with some lines
# of context; its ``clip`` gives the page region drawn, in the same PDF points as the boxes.

SHOW_WIDTH_PX = 900  # by default a picture is at most this wide: a chat card's width
SHOW_DPI_RANGE = (36, 400)  # what a request may ask for
SHOW_DEFAULT_DPI_MAX = 200  # the default never renders finer than this (a narrow column would be huge)
SHOW_MAX_PIXELS = 40_000_000  # no picture is larger: a finer asked dpi is refused, the default drawn coarser
SHOW_MAX_PAGES = 10  # pages one show request may draw (a passage touches two or three)
SHOW_CONTEXT_PT = 30.0  # context kept above and below the passage in a cropped picture
SHOW_MARGIN_PT = 6.0  # and beside its column
SHOW_MARKER = (255, 214, 10)  # the marker's colour, multiplied over the page
SHOW_CACHE_DIR = "show-cache"  # under the library folder
SHOW_CACHE_BYTES = 64 << 20  # the cache folder is trimmed (oldest pictures first) to this size


def on_display(page, rect) -> tuple[float, float, float, float]:
    """A rectangle in PyMuPDF's text coordinates (the unrotated page, as boxes, blocks and drawings are given) in
    the coordinates of the page as displayed (``page.rect``, where rendering clips), which differ on a rotated
    page."""
    import pymupdf

    r = pymupdf.Rect(rect) * page.rotation_matrix
    r.normalize()
    return r.x0, r.y0, r.x1, r.y1


def passage_clip(page, rects: list[list[float]], crop: bool) -> tuple[float, float, float, float]:
    """The page region a picture shows (display coordinates): the whole page, or the passage's rectangles widened to
    the text blocks that hold them (their column), with ``SHOW_CONTEXT_PT`` above and below, grown so that no word
    of the column is cut at an edge."""
    area = page.rect
    if not crop or not rects:
        return area.x0, area.y0, area.x1, area.y1
    shown = [on_display(page, r) for r in rects]
    blocks = [on_display(page, b[:4]) for b in page.get_text("blocks")]
    x0, y0 = min(r[0] for r in shown), min(r[1] for r in shown)
    x1, y1 = max(r[2] for r in shown), max(r[3] for r in shown)
    for r in shown:
        middle = ((r[0] + r[2]) / 2, (r[1] + r[3]) / 2)
        for b in blocks:
            if b[0] <= middle[0] <= b[2] and b[1] <= middle[1] <= b[3]:
                x0, x1 = min(x0, b[0]), max(x1, b[2])
    y0, y1 = y0 - SHOW_CONTEXT_PT, y1 + SHOW_CONTEXT_PT
    # the context lines of the column whole: no word cut at the edges
    words = [on_display(page, w[:4]) for w in page.get_text("words")]
    column = [w for w in words if w[0] < x1 and x0 < w[2]]
    y0 = min([y0, *(w[1] for w in column if w[1] < y0 < w[3])])  # from the edges as they were: no cascade
    y1 = max([y1, *(w[3] for w in column if w[1] < y1 < w[3])])
    for w in words:
        if w[0] < x1 and x0 < w[2] and y0 <= w[1] and w[3] <= y1:
            x0, x1 = min(x0, w[0]), max(x1, w[2])
    return (
        max(area.x0, x0 - SHOW_MARGIN_PT),
        max(area.y0, y0 - 2),
        min(area.x1, x1 + SHOW_MARGIN_PT),
        min(area.y1, y1 + 2),
    )


def picture_dpi(
    clip: tuple[float, float, float, float], asked: int | None, width_px: int = SHOW_WIDTH_PX
) -> tuple[int, str | None]:
    """The resolution a picture of ``clip`` is drawn at, and a note when it had to go below the lowest one a
    request may ask for. The size limits come first: by default the picture is at most ``width_px`` wide and
    ``SHOW_MAX_PIXELS`` large (and no finer than ``SHOW_DEFAULT_DPI_MAX``), whatever resolution that takes, down
    to 1 dpi for a poster-sized page; an asked resolution is kept, or refused with one that can be asked for."""
    width_in, height_in = max(clip[2] - clip[0], 1.0) / 72, max(clip[3] - clip[1], 1.0) / 72
    size = (
        f"{width_in:,.0f} x {height_in:,.0f}" if min(width_in, height_in) >= 10 else f"{width_in:.1f} x {height_in:.1f}"
    )
    finest = int(math.sqrt(SHOW_MAX_PIXELS / (width_in * height_in)))  # the pixel budget's resolution
    # the picture's edges are rounded outwards to whole pixels, up to one more: hence width_px - 1
    fitting = min(SHOW_DEFAULT_DPI_MAX, int((width_px - 1) / width_in), finest)
    if asked is not None:
        if asked <= finest:
            return asked, None
        if finest >= SHOW_DPI_RANGE[0]:
            ask = f"ask for at most {finest} dpi"
        else:
            ask = (
                f"leave `dpi` out to have it drawn at {fitting} dpi, to fit"
                if fitting >= 1
                else "it is too large to draw at any resolution"
            )
        raise KBError(
            "bad_request",
            f"a picture of this {size}-inch region at {asked} dpi would be "
            f"{int(width_in * asked):,} x {int(height_in * asked):,} pixels, more than "
            f"{SHOW_MAX_PIXELS:,}; {ask}",
        )
    if fitting < 1:
        raise KBError(
            "bad_request", f"the {size}-inch region is too large to draw within {width_px} pixels even at 1 dpi"
        )
    if fitting < SHOW_DPI_RANGE[0]:
        limit = f"{width_px} pixels" if fitting < finest else f"{SHOW_MAX_PIXELS:,} pixels in all"
        return fitting, f"the region is {size} inches: drawn at {fitting} dpi to fit {limit}"
    return fitting, None


def render_passage(page, rects: list[list[float]], clip: tuple[float, float, float, float], dpi: int) -> dict:
    """The clip (display coordinates) of ``page`` as PNG with the marker over ``rects`` (text coordinates):
    ``{"png", "width", "height", "dpi", "clip", "marks"}``; ``clip`` as drawn (the pixel grid's edges in PDF
    points), ``marks`` the marked pixel rectangles ``[left, top, right, bottom)`` of the picture."""
    import numpy as np
    import pymupdf

    zoom = dpi / 72.0
    pix = page.get_pixmap(
        matrix=pymupdf.Matrix(zoom, zoom), clip=pymupdf.Rect(clip), alpha=False, colorspace=pymupdf.csRGB
    )
    rows = np.frombuffer(pix.samples, dtype=np.uint8).reshape(pix.height, pix.stride)
    pixels = rows[:, : pix.width * 3].reshape(pix.height, pix.width, 3).copy()
    marker = np.array(SHOW_MARKER, dtype=np.uint16)
    marks = []
    for x0, y0, x1, y1 in (on_display(page, r) for r in rects):
        # whole pixels inside the rectangle only: [ceil(x0), floor(x1)) on the pixmap's own grid
        left, top = max(0, math.ceil(x0 * zoom) - pix.x), max(0, math.ceil(y0 * zoom) - pix.y)
        right, bottom = min(pix.width, math.floor(x1 * zoom) - pix.x), min(pix.height, math.floor(y1 * zoom) - pix.y)
        if right > left and bottom > top:
            patch = pixels[top:bottom, left:right].astype(np.uint16)
            pixels[top:bottom, left:right] = (patch * marker // 255).astype(np.uint8)
            marks.append([left, top, right, bottom])
    out = pymupdf.Pixmap(pymupdf.csRGB, pix.width, pix.height, pixels.tobytes(), False)
    return {
        "png": out.tobytes("png"),
        "width": pix.width,
        "height": pix.height,
        "dpi": dpi,
        # the pixel grid's edges, a hair inside so that rendering this clip again gives this very grid
        "clip": [
            round((pix.x + 0.002) / zoom, 4),
            round((pix.y + 0.002) / zoom, 4),
            round((pix.x + pix.width - 0.002) / zoom, 4),
            round((pix.y + pix.height - 0.002) / zoom, 4),
        ],
        "marks": marks,
    }


def trim_picture_cache(folder: Path) -> None:
    """Delete the oldest pictures of the library's cache folder until it holds at most ``SHOW_CACHE_BYTES``."""
    keep = SHOW_CACHE_BYTES
    try:
        files = sorted(
            (entry.stat().st_mtime_ns, entry.stat().st_size, entry.path)
            for entry in os.scandir(folder)
            if entry.is_file(follow_symlinks=False) and entry.name.endswith(".png")
        )
    except OSError:
        return
    total = sum(size for _, size, _ in files)
    for _, size, path in files:
        if total <= keep:
            break
        try:
            os.unlink(path)
            total -= size
        except OSError:
            pass


PICTURE_WIDTH_PX = 640  # a picture attached to a hit (a card's thumbnail, a model's image) is this wide at most


def picture_record(picture: dict, page: int) -> dict:
    """What an answer says of a rendered picture (the PNG itself goes in as ``data`` or ``path``)."""
    return {
        "page": page,
        "width": picture["width"],
        "height": picture["height"],
        "dpi": picture["dpi"],
        "clip": picture["clip"],
        "marks": picture["marks"],
        "media_type": "image/png",
        **({"note": picture["note"]} if picture.get("note") else {}),
    }


def draw_picture(
    cache: PageCache,
    pdf: IndexedPdf,
    page: int,
    rects: list,
    crop: bool,
    clip: list | None = None,
    dpi: int | None = None,
    width_px: int = SHOW_WIDTH_PX,
) -> dict:
    """A page's picture (``render_passage``'s keys, and ``note``), drawn in the page process under the deadline:
    the passage's crop (or ``clip``, or the whole page) at ``dpi`` or fitted to ``width_px``. PageWorkFailed
    (PageTooSlow) or KBError (a size that cannot be met) when it cannot be drawn."""
    result, png = cache.work(pdf, "picture", page, rects=rects, crop=crop, clip=clip, dpi=dpi, width=width_px)
    return {**result, "png": png}


def _work_note(exc: Exception, page: int) -> str:
    """A hit's note for page work that failed: the deadline's note and a refusal say it all; a failure is named."""
    if isinstance(exc, (PageTooSlow, KBError)):
        return str(exc)
    return f"page {page} cannot be drawn ({exc})"


def hit_picture(placer: BoxPlacer, doc_id: int, placed: dict) -> dict:
    """``{"picture": ...}``: a placed passage highlighted on its first page, cropped, as inline PNG; else
    ``{"picture_note": why}``."""
    import base64

    if "boxes" not in placed:
        return {"picture_note": placed.get("boxes_note") or "the passage is not placed on its page"}
    pdf = placer.document(doc_id)
    if isinstance(pdf, str):
        return {"picture_note": pdf}
    first = placed["boxes"][0]
    try:
        picture = draw_picture(placer.cache, pdf, first["page"], first["rects"], crop=True, width_px=PICTURE_WIDTH_PX)
    except (PageWorkFailed, KBError) as exc:
        return {"picture_note": _work_note(exc, first["page"])}
    return {
        "picture": {**picture_record(picture, first["page"]), "data": base64.b64encode(picture["png"]).decode("ascii")}
    }


def with_evidence(
    lib: Library, hits: list[HitRecord], cache: PageCache | None = None, boxes: bool = True, pictures: int = 0
) -> list[HitRecord]:
    """Copies of ``hits`` with the snippet boxes of each PDF hit (or the note why it has none) when ``boxes``, and
    with ``pictures``: the first that many PDF hits carry ``picture``, their passage highlighted on its first page
    as inline PNG (see ``hit_picture``), or ``picture_note``."""
    chunk_ids = [h["chunk_id"] for h in hits if h.get("kind") == "pdf"]
    rows = lib.chunk_page_maps(chunk_ids)
    placer = BoxPlacer(lib, cache)
    out: list[HitRecord] = []
    drawn = 0
    for hit in hits:
        row = rows.get(hit["chunk_id"]) if hit.get("kind") == "pdf" else None
        if row is None or (not boxes and drawn >= pictures):
            out.append(hit.copy())
            continue
        placed = placer.place(hit["doc_id"], hit, row["text"], json.loads(row["page_map"]))
        extra = dict(placed) if boxes else {}
        if drawn < pictures:
            drawn += 1
            extra.update(hit_picture(placer, hit["doc_id"], placed))
        out.append(cast(HitRecord, {**hit, **extra}))  # extra: boxes or boxes_note, picture or picture_note
    return out


FIGURE_GAP_PT = 14.0  # graphics (or short text between them) this close make one figure or table
FIGURE_BODY_LINES = 3  # a text block this many lines tall and nearly the column's width is body text


def _union(a, b) -> tuple[float, float, float, float]:
    return min(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), max(a[3], b[3])


def figure_region(page, caption: tuple[float, float, float, float], label: str) -> tuple | None:  # noqa: C901
    """The region (display coordinates) of the figure or table a caption (text coordinates) belongs to. The
    caption is taken whole (its text block); from it the region grows on the side such a caption usually sits
    (figures above their caption, tables below; the other side when that one has nothing) over the page's images
    and vector drawings in the caption's column, and over short text between them (axis labels, table rows),
    never over body paragraphs or another caption. It ends at the last graphic reached. None when no graphics
    touch the caption."""
    area = page.rect
    caption = on_display(page, caption)
    blocks = [(on_display(page, b[:4]), b[4]) for b in page.get_text("blocks") if b[6] == 0]
    for rect, _ in blocks:  # the caption's whole block (a caption chunk may be a part)
        if _overlaps(rect, caption):
            caption = _union(caption, rect)
    graphics = [on_display(page, info["bbox"]) for info in page.get_image_info()]
    for drawing in page.get_drawings():
        r = drawing.get("rect")
        if r is not None and (r.width > 2 or r.height > 2) and r.width * r.height < 0.9 * area.width * area.height:
            graphics.append(on_display(page, r))
    in_column = lambda r: r[0] < caption[2] and caption[0] < r[2]  # noqa: E731
    width = caption[2] - caption[0]
    texts = []
    for rect, text in blocks:
        lines = max(1, text.count("\n"))
        # a paragraph: several long lines across the column (a table's block has many short ones)
        body = lines >= FIGURE_BODY_LINES and rect[2] - rect[0] >= 0.8 * width and len(text) / lines >= 40
        if in_column(rect) and not body and not _FIGURE_MENTION.match(text.lstrip()) and not _overlaps(rect, caption):
            texts.append(rect)
    graphics = [g for g in graphics if in_column(g)]
    above_first = not label.lower().startswith("table")
    for above in (above_first, not above_first):
        beyond = (lambda r: r[3] <= caption[1] + 2) if above else (lambda r: r[1] >= caption[3] - 2)
        elements = [(g, True) for g in graphics if beyond(g)] + [(t, False) for t in texts if beyond(t)]
        reach, found = tuple(caption), None
        grew = True
        while grew:
            grew = False
            for rect, graphic in elements:
                if max(reach[1] - rect[3], rect[1] - reach[3], 0.0) > FIGURE_GAP_PT:
                    continue
                if graphic:  # reached, whether or not it widens the reach (a rule under a table row)
                    found = rect if found is None else _union(found, rect)
                if _union(reach, rect) != reach:
                    reach, grew = _union(reach, rect), True
        if found is not None:
            # from the caption to the farthest graphic reached, with the text inside that span
            span = _union(caption, found)
            region = span
            for rect, _ in elements:
                if span[1] - 1 <= rect[1] and rect[3] <= span[3] + 1:
                    region = _union(region, rect)
            return (
                max(area.x0, region[0] - SHOW_MARGIN_PT),
                max(area.y0, region[1] - SHOW_MARGIN_PT),
                min(area.x1, region[2] + SHOW_MARGIN_PT),
                min(area.y1, region[3] + SHOW_MARGIN_PT),
            )
    return None


# -- the page process's side ----------------------------------------------------------------------------------
# ``kb_engine.py pages`` (see PageProcess): each request names a document (its path, verified stamp and OCR'd
# pages), a page and the work; the answer is a JSON frame and a data frame (a picture's PNG, else empty).

PAGE_PROCESS_DOCS = 4  # documents the page process keeps open


def _page_picture(page, request: dict) -> tuple[dict, bytes]:
    rects = request["rects"]
    clip = tuple(request["clip"]) if request.get("clip") else passage_clip(page, rects, request["crop"] and bool(rects))
    dpi, note = picture_dpi(clip, request.get("dpi"), request["width"])
    picture = render_passage(page, rects, clip, dpi)
    png = picture.pop("png")
    return {**picture, **({"note": note} if note else {})}, png


def _page_figure(page, request: dict) -> tuple[dict, bytes]:
    return {"region": figure_region(page, tuple(request["caption"]), request["label"])}, b""


# The work the page process does on one page (the keys of PAGE_WORK, but ``open``, which needs no page).
PAGE_WORKERS: dict[str, Callable[[Any, dict], tuple[dict, bytes]]] = {
    "glyphs": lambda page, request: ({"lines": page_text_lines(page)}, b""),
    "picture": _page_picture,
    "figure": _page_figure,
}


def _opened_pdf(documents: dict, wire: dict) -> dict:
    """The open document of a request, opened now if need be: ``{"doc", "laid"}`` (the pages whose OCR'd text is
    laid on). The file must still have the stamp it was verified under, before and after it is opened."""
    import pymupdf

    key = tuple(wire["stamp"])

    def check() -> None:
        try:
            if _file_stamp(os.stat(wire["path"])) != key[1:]:
                raise KBError("stale", FILE_CHANGED)
        except OSError:
            raise KBError("not_found", "the file is no longer at its indexed path") from None

    check()
    if key in documents:
        documents[key] = documents.pop(key)  # the most recently used last
        return documents[key]
    doc = pymupdf.open(wire["path"], filetype="pdf")
    check()
    documents[key] = {"doc": doc, "laid": set()}
    while len(documents) > PAGE_PROCESS_DOCS:
        documents.pop(next(iter(documents)))["doc"].close()
    return documents[key]


def _page_request(documents: dict, request: dict) -> tuple[dict, bytes]:
    opened, wire, number = _opened_pdf(documents, request["doc"]), request["doc"], request["page"]
    doc = opened["doc"]
    if request["work"] == "open":
        return {"pages": doc.page_count}, b""
    if not 1 <= number <= doc.page_count:
        raise KBError("bad_request", f"page {number} is not in the file ({doc.page_count} pages)")
    if number in wire["ocr_pages"] and wire["sha256"] and number not in opened["laid"]:
        layer_cached_ocr(doc, [number], wire["sha256"], wire["ocr_cache"])
        opened["laid"].add(number)
    return PAGE_WORKERS[request["work"]](doc[number - 1], request)


def _limit_cpu(seconds: float) -> None:
    """Let the page process end itself (SIGXCPU) once its CPU time passes this request's deadline by a margin. The
    engine kills it at the deadline, so this acts only on a process whose engine died meanwhile, which would
    otherwise draw on for hours. Core dumps are off, so that ending this way leaves no file behind."""
    try:
        import resource
    except ImportError:  # Windows: a process left alone stops when its page is done
        return
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    soft = int(time.process_time() + seconds) + DRAW_CPU_MARGIN_S
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))


def serve_pages() -> int:
    """``kb_engine.py pages``: answer the engine's page requests on stdin, one at a time, until stdin ends."""
    import pymupdf  # noqa: F401 -- imported before "ready", so that its import never counts against a page

    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything else written to stdout (a library's message) goes to stderr, not a reply
    documents: dict = {}
    _send_frame(replies, json.dumps({"ok": True, "result": {"ready": True}}).encode())
    _send_frame(replies, b"")
    while (frame := _read_frame(sys.stdin.buffer)) is not None:
        request = json.loads(frame)
        _limit_cpu(float(request.get("seconds") or DRAW_SECONDS))
        data = b""
        try:
            result, data = _page_request(documents, request)
            reply = {"ok": True, "result": result}
        except KBError as exc:
            reply = {"ok": False, "code": exc.code, "error": exc.message}
        except Exception as exc:  # PyMuPDF raises its own types for damaged pages
            reply = {"ok": False, "error": f"{type(exc).__name__}: {_short_error(exc)}"}
        _send_frame(replies, json.dumps(reply).encode())
        _send_frame(replies, data)
    return 0
