"""Show: the show command, a page or a passage of an indexed PDF drawn with its request fields.

May import: answers.evidence, answers.pictures, answers.search, config, reading.citations, storage.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import stat as stat_module
from pathlib import Path
from typing import Any

from ..answers.evidence import (
    PAGE_PROCESS,
    BoxPlacer,
    IndexedPdf,
    PageTooSlow,
    PageWorkFailed,
    box_key,
    indexed_file_state,
    place_passage,
    snippet_pieces,
)
from ..answers.pictures import (
    SHOW_CACHE_BYTES,
    SHOW_CACHE_DIR,
    SHOW_DEFAULT_DPI_MAX,
    SHOW_DPI_RANGE,
    SHOW_MAX_PAGES,
    SHOW_WIDTH_PX,
    draw_picture,
    picture_record,
    trim_picture_cache,
)
from ..answers.search import LibraryState
from ..config import (
    KB_ROOT_FIELD,
    SWITCH,
    Field,
    Flag,
    KBError,
    _is_integer,
    _opt_bool,
    _opt_int,
    _opt_str,
    _short_error,
    check_rules,
)
from ..reading.citations import _FIGURE_MENTION, figure_label
from ..storage import Library, _write_atomically

SHOW_FIELDS = (
    Field(
        "doc_id",
        "integer",
        "none",
        "the document, as a hit names it (required)",
        cli=(Flag(("doc_id",), "the document (a hit's doc_id, or see `docs`)", {"type": int}),),
    ),
    Field(
        "page",
        "integer",
        "none",
        "the passage's first page (1-based), as the hit carries it; without offsets the whole page is drawn",
        cli=(Flag(("--page",), "the page (a hit's page)", {"type": int}),),
    ),
    Field(
        "char_start",
        "integer",
        "none",
        "the passage's start in the page text of `page`, exactly as the hit carries it; with `char_end`",
        cli=(Flag(("--char-start",), "the hit's char_start", {"type": int}),),
    ),
    Field(
        "char_end",
        "integer",
        "none",
        "the passage's end (exclusive) in the page text of `page_end`, exactly as the hit carries it",
        cli=(Flag(("--char-end",), "the hit's char_end", {"type": int}),),
    ),
    Field(
        "page_end",
        "integer",
        "`page`",
        f"the passage's last page, as the hit carries it; at most {SHOW_MAX_PAGES} pages are drawn at a time (a "
        f"longer range is a `bad_request`)",
        cli=(Flag(("--page-end",), "the hit's page_end", {"type": int}),),
    ),
    Field(
        "figure",
        "string",
        "none",
        'a label from a hit\'s `captions` (`"Figure 3"`, `"Table 2"`): the picture is that figure\'s or table\'s '
        "region (the page's images and drawings next to its caption, with the text between them) instead of a "
        "passage; with `page`, a caption on that page is taken first (a label can recur in another chapter)",
        cli=(Flag(("--figure",), "draw this figure or table (a label from the hit's captions)"),),
    ),
    Field(
        "crop",
        "boolean",
        "`true`",
        "`true`: the passage's column with a few lines of context; `false`: the whole page",
        cli=(
            Flag(
                ("--full-page",),
                "draw the whole page, not the passage's surroundings",
                {"action": "store_false", "default": None},
                into="crop",
            ),
        ),
    ),
    Field(
        "dpi",
        "integer",
        "fits 900 pixels",
        f"resolution, {SHOW_DPI_RANGE[0]} to {SHOW_DPI_RANGE[1]}; by default the picture is at most "
        f"{SHOW_WIDTH_PX} pixels wide (at most {SHOW_DEFAULT_DPI_MAX} dpi, and below {SHOW_DPI_RANGE[0]} for a "
        f"region over {SHOW_WIDTH_PX // SHOW_DPI_RANGE[0]} inches wide, with a `note`)",
        cli=(Flag(("--dpi",), "resolution (default: 900 pixels wide)", {"type": int}),),
    ),
    Field(
        "dest",
        "string",
        f"`<kb_root>/{SHOW_CACHE_DIR}`",
        "the folder the PNG files are written to (created if missing). The default folder is the library's "
        f"picture cache, trimmed to {SHOW_CACHE_BYTES >> 20} MB, oldest first; a folder you name is never trimmed",
        cli=(Flag(("--dest",), "folder for the PNG files (default: the library's picture cache)"),),
    ),
    Field(
        "inline",
        "boolean",
        "`false`",
        "`true`: each image carries its PNG as base64 `data` and no file is written",
        cli=(Flag(("--inline",), "answer with the PNG as base64 (with --json)", SWITCH),),
    ),
    KB_ROOT_FIELD,
)


# Checked by the engine before it opens the library, and by both hosts before they call it (kb_show's checks).
SHOW_RULES = (
    {"rule": "any_of", "fields": ["doc_id"], "message": "show needs `doc_id`: the document of the hit to draw"},
    {
        "rule": "any_of",
        "fields": ["page", "figure"],
        "message": "show needs the hit's page (with its char_start and char_end), or a figure label",
    },
    {
        "rule": "needs",
        "field": "char_start",
        "needs": "char_end",
        "message": "give char_end with char_start, both as the hit carries them",
    },
    {
        "rule": "needs",
        "field": "char_end",
        "needs": "char_start",
        "message": "give char_start with char_end, both as the hit carries them",
    },
)


def _show_request(payload: dict) -> dict:
    if not _is_integer(payload.get("doc_id")):
        raise KBError("bad_request", "show needs `doc_id`: the document of the hit to draw")
    check_rules(SHOW_RULES, payload)
    request: dict[str, Any] = {
        "doc_id": _opt_int(payload, "doc_id", 0, 1, 2**63 - 1),
        "figure": _opt_str(payload, "figure"),
        "crop": _opt_bool(payload, "crop", True),
        "inline": _opt_bool(payload, "inline"),
        "dest": _opt_str(payload, "dest"),
        "dpi": None if payload.get("dpi") is None else _opt_int(payload, "dpi", 0, *SHOW_DPI_RANGE),
    }
    has_start = payload.get("char_start") is not None
    for key in ("page", "page_end", "char_start", "char_end"):
        if payload.get(key) is not None:
            request[key] = _opt_int(payload, key, 0, 0 if key.startswith("char") else 1, 10**9)
    request.setdefault("page_end", request.get("page"))
    if request.get("page") and request["page_end"] < request["page"]:
        raise KBError("bad_request", "`page_end` comes before `page`")
    if request.get("page") and request["page_end"] - request["page"] >= SHOW_MAX_PAGES:
        raise KBError(
            "bad_request",
            f"show draws at most {SHOW_MAX_PAGES} pages at a time: ask for pages "
            f"{request['page']} to {request['page'] + SHOW_MAX_PAGES - 1}, then the next ones",
        )
    if has_start and request["page_end"] == request.get("page") and request["char_end"] <= request["char_start"]:
        raise KBError("bad_request", "`char_end` must come after `char_start` on one page")
    return request


def _show_document(lib: Library, doc_id: int, known: dict) -> sqlite3.Row:
    row = lib.doc_to_show(doc_id)
    if row is None:
        raise KBError("not_found", f"no document has doc_id {doc_id} (see `docs`)")
    if row["kind"] != "pdf":
        raise KBError("bad_request", f"document {doc_id} is a {row['kind']} file; show draws PDF pages")
    why = indexed_file_state(row, known)
    if why:
        code = "not_found" if "no longer" in why else "stale"
        raise KBError(
            code,
            f"document {doc_id} ({os.path.basename(row['path'])}): {why}; nothing is drawn from a file "
            f"that is not the one indexed",
        )
    return row


def _passage_boxes(lib: Library, placer: BoxPlacer, request: dict) -> dict:
    """The boxes of the requested passage (the chunk that holds it, placed as a hit's snippet), or a note."""
    for row in lib.doc_passages(request["doc_id"]):
        page_map = json.loads(row["page_map"])
        pieces = snippet_pieces(row["text"], page_map, request)
        if pieces:
            return {
                **placer.place(request["doc_id"], request, row["text"], page_map),
                "snippet": " ".join(" ".join(piece.split()) for _, piece in pieces),
            }
    return {
        "boxes_note": "no passage of the document has these page offsets (they are the hit's, as search gave "
        "them, after the last ingest?)"
    }


def _figure_boxes(
    lib: Library, placer: BoxPlacer, pdf: IndexedPdf, request: dict
) -> tuple[int, list | None, str | None]:
    """(page, region, note) of a figure or table by its caption's label."""
    wanted = request["figure"].strip()
    head = _FIGURE_MENTION.match(wanted)
    label = figure_label(head.group(1), head.group(2)) if head else None
    rows = lib.doc_captions(request["doc_id"])
    # a label may come back in another chapter: the caption on the asked page first (a hit's captions carry it)
    for row in sorted(rows, key=lambda r: r["page"] != request.get("page")):
        found = _FIGURE_MENTION.match(row["text"].lstrip())
        if label and found and figure_label(found.group(1), found.group(2)) == label and row["page"]:
            glyphs = placer.cache.glyphs(pdf, row["page"])
            if isinstance(glyphs, str):
                return row["page"], None, f"the caption of {label} cannot be found on p. {row['page']}: {glyphs}"
            placed = place_passage(glyphs, box_key(row["text"]))
            rects = glyphs.rects(placed) if not isinstance(placed, str) else None
            if not rects:
                return row["page"], None, f"the caption of {label} cannot be found on p. {row['page']}"
            caption = [
                min(r[0] for r in rects),
                min(r[1] for r in rects),
                max(r[2] for r in rects),
                max(r[3] for r in rects),
            ]
            region = placer.cache.work(pdf, "figure", row["page"], caption=caption, label=label)[0]["region"]
            return row["page"], region, None if region else f"no image or drawing lies next to the caption of {label}"
    raise KBError(
        "not_found",
        f"document {request['doc_id']} has no caption labelled {wanted!r} (the labels are in a hit's `captions`)",
    )


def _picture_file(folder: Path, row: sqlite3.Row, page: int, picture: dict) -> str:
    digest = hashlib.sha256(
        json.dumps(
            [row["sha256"], page, picture["clip"], picture["dpi"], hashlib.sha256(picture["png"]).hexdigest()]
        ).encode()
    ).hexdigest()[:16]
    path = folder / f"doc{row['id']}-p{page}-{digest}.png"
    try:
        drawn = stat_module.S_ISREG(os.lstat(path).st_mode)  # a link put at the name is replaced, not read
    except OSError:
        drawn = False
    if not drawn:
        _write_atomically(path, picture["png"])
    return str(path)


def _show_regions(
    lib: Library, placer: BoxPlacer, pdf: IndexedPdf, request: dict, answer: dict
) -> list[tuple[int, list, list | None]]:
    """(page, rects, clip) of each picture to draw; ``answer`` gains the snippet, boxes and notes."""
    if request["figure"] is not None:
        page, region, note = _figure_boxes(lib, placer, pdf, request)
        answer.update({"figure": request["figure"], "highlighted": False, **({"note": note} if note else {})})
        return [(page, [], region)]
    if request["page"] > pdf.pages:
        raise KBError("bad_request", f"page {request['page']} is not in the file ({pdf.pages} pages)")
    placed: dict[str, Any] = (
        _passage_boxes(lib, placer, request)
        if request.get("char_start") is not None
        else {"boxes_note": "no passage offsets were given: the page is drawn without a highlight"}
    )
    if placed.get("snippet"):
        answer["snippet"] = placed["snippet"]
    if "boxes" in placed:
        answer.update({"highlighted": True, "boxes": placed["boxes"]})
        return [(b["page"], b["rects"], None) for b in placed["boxes"]]
    answer.update({"highlighted": False, "note": placed["boxes_note"]})
    return [(page, [], None) for page in range(request["page"], min(request["page_end"], pdf.pages) + 1)]


def cmd_show(lib: Library | None, payload: dict, state: LibraryState) -> dict:
    """Draw a hit's passage highlighted on its page(s), or a figure/table region, as PNG."""
    import base64

    request = _show_request(payload)
    if lib is None:
        raise KBError("not_found", f"no document has doc_id {request['doc_id']}: the library is empty")
    PAGE_PROCESS.warm()
    placer = BoxPlacer(lib, state.pages)
    row = _show_document(lib, request["doc_id"], placer.cache.files)
    answer: dict = {
        "doc_id": row["id"],
        "title": row["title"],
        "file": os.path.basename(row["path"]),
        "path": row["path"],
    }
    pdf = placer.require(row["id"])
    folder = (
        None
        if request["inline"]
        else Path(request["dest"]).expanduser()
        if request["dest"]
        else lib.root / SHOW_CACHE_DIR
    )
    images = []
    try:
        regions = _show_regions(lib, placer, pdf, request, answer)
        if folder is not None:
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise KBError(
                    "bad_request", f"cannot create the picture folder {folder}: {_short_error(exc)}"
                ) from None
        for page, rects, clip in regions:
            picture = draw_picture(
                placer.cache, pdf, page, rects, request["crop"] and bool(rects), clip, request["dpi"]
            )
            image = picture_record(picture, page)
            if folder is None:
                image["data"] = base64.b64encode(picture["png"]).decode("ascii")
            else:
                try:
                    image["path"] = _picture_file(folder, row, page, picture)
                except OSError as exc:
                    raise KBError("bad_request", f"cannot write into {folder}: {_short_error(exc)}") from None
            images.append(image)
    except PageTooSlow as exc:
        raise KBError("too_slow", f"document {row['id']}: {exc}; nothing is drawn") from None
    except PageWorkFailed as exc:
        raise KBError("internal", f"document {row['id']}: a page cannot be drawn ({exc})") from None
    if folder is not None and not request["dest"]:
        trim_picture_cache(folder)
    answer["images"] = images
    return answer
