"""Sync: the watch and sync commands; Zotero sources brought in step.

May import: commands.core, commands.zotero, config, ingest.files, live, models.registry, reading.ocr, storage,
zotero.importer, zotero.snapshot.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..commands.core import cmd_ingest, written_library
from ..commands.zotero import cmd_zotero
from ..config import (
    KB_ROOT_FIELD,
    STATUS_ADDED,
    STATUS_DUPLICATE,
    STATUS_ERROR,
    STATUS_MOVED,
    STATUS_UPDATED,
    SWITCH,
    Field,
    Flag,
    KBError,
    _opt_bool,
    _opt_str,
    now_iso,
    path_state,
)
from ..ingest.files import _inside, collect_files
from ..live import (
    WATCH_EVENTS_NOTE,
    WATCH_SETTINGS,
    SourceWatch,
    Watcher,
    change_sources,
    out_of_reach,
    read_sources,
    scan_folder,
    scan_zotero,
    source_views,
    stored_under,
    update_sources,
    watch_setting,
    watched_source,
    write_sources,
    zotero_signature,
)
from ..models.registry import Models
from ..reading.ocr import OCR_MODES, ocr_mode
from ..storage import Library, fs_path, path_key
from ..zotero.importer import _zotero_needs_work, zotero_file_needs_work
from ..zotero.snapshot import (
    ZoteroCatalog,
    ZoteroSnapshot,
    _resolve_attachment,
    locate_zotero_db,
    read_zotero_catalog,
    zotero_attachments,
    zotero_base_directory,
    zotero_mark,
    zotero_touched,
)

WATCH_FIELDS = (
    Field(
        "add",
        "array of strings, or one string",
        "none",
        "folders to watch (`~` expanded, relative paths made absolute); each must exist. A folder inside a "
        "watched one is already watched; a folder around watched ones takes their place",
        cli=(Flag(("--add",), "watch these folders", {"nargs": "+", "metavar": "FOLDER"}),),
    ),
    Field(
        "remove",
        "array of strings, or one string",
        "none",
        "watched folders to stop watching; their documents stay in the library (`delete` removes them)",
        cli=(Flag(("--remove",), "stop watching these folders", {"nargs": "+", "metavar": "FOLDER"}),),
    ),
    Field(
        "ocr",
        "string",
        "`KB_OCR` when the sync runs",
        "with `add`: OCR of the sources' PDFs, as `ingest` takes it (`auto`, `off`, `force`); kept with each source "
        "added and used by every sync of it",
        cli=(Flag(("--ocr",), "with --add: OCR of their PDFs: auto, off, force", {"choices": OCR_MODES}),),
    ),
    Field(
        "base_dir",
        "string",
        "found",
        "with `add` of a Zotero data folder: Zotero's linked attachment base directory, as `zotero` takes it; kept "
        "with the source",
        cli=(Flag(("--base-dir",), "with --add of a Zotero data folder: its linked attachment base directory"),),
    ),
    Field(
        "confirm",
        "boolean",
        "`false`",
        f"with `add`: `true` watches a folder holding more than `KB_WATCH_MAX_FILES` "
        f"({WATCH_SETTINGS['KB_WATCH_MAX_FILES']:,.0f}) supported files; without it such a request fails with code "
        "`confirm_required` and nothing is added",
        cli=(Flag(("--yes",), "with --add: watch a folder of more than KB_WATCH_MAX_FILES files", SWITCH),),
    ),
    KB_ROOT_FIELD,
)


def _path_list(payload: dict, key: str) -> list[str]:
    value = payload.get(key) or []
    return [value] if isinstance(value, str) else list(value)


def cmd_watch(lib: Library | None, root: Path, payload: dict, watcher: Watcher | None) -> dict:
    """Add, remove or list the library's watched folders."""
    add, remove = _path_list(payload, "add"), _path_list(payload, "remove")
    options = {"ocr": _opt_str(payload, "ocr"), "base_dir": _opt_str(payload, "base_dir")}
    if options["ocr"] is not None:
        ocr_mode(options["ocr"])  # a bad value is refused before anything is stored
    if options["base_dir"]:
        options["base_dir"] = os.path.abspath(os.path.expanduser(options["base_dir"]))
    added: list[str] = []
    removed: list[str] = []
    if add and not _opt_bool(payload, "confirm"):  # counted before the transaction: a walk can take a while
        confirm_folder_sizes(read_sources(lib) if lib is not None else [], add, root)
    if add or remove:
        target = written_library(lib)
        with target.transaction():
            sources, added, removed = change_sources(read_sources(target), add, remove, root, options)
            write_sources(target, sources)
    if watcher is not None:
        watcher.track(root)
        if added or removed:
            watcher.listed.pop(root, None)
            watcher.tick()  # the new folders are listed in their state, and their first sync starts
    live = watcher.views(root) if watcher is not None else None
    response: dict[str, Any] = {
        "sources": source_views(lib, root, live),
        "added": added,
        "removed": removed,
        "file_events": watcher.events is not None and watcher.events.available if watcher is not None else None,
        "kb_root": str(root),
    }
    if watcher is None and any(s["state"] == "not_watched" for s in response["sources"]):
        response["note"] = (
            "watched folders are kept in step while a resident engine runs (serve: the DSH plugin "
            "or the MCP server; or `kb-engine watch` in a terminal); `sync` brings them in step once"
        )
    elif watcher is not None and watcher.events is not None and not watcher.events.available:
        response["note"] = WATCH_EVENTS_NOTE
    return response


def confirm_folder_sizes(sources: list[dict], add: list[str], kb_root: Path) -> None:
    """Refuse (confirm_required) to start watching a folder of more than KB_WATCH_MAX_FILES supported files, counted
    with ingest's walk, which stops once it is past the limit; a folder watched already is not counted again."""
    limit = int(watch_setting("KB_WATCH_MAX_FILES"))
    for raw in add:
        source = watched_source(raw, kb_root)  # a path that cannot be watched is refused first, as it is
        if source["kind"] != "folder" or any(
            _inside(source["path"], s["path"]) for s in sources if s.get("kind", "folder") == "folder"
        ):
            continue
        for count, _ in enumerate(collect_files([source["path"]], kb_root), start=1):
            if count > limit:
                raise KBError(
                    "confirm_required",
                    f"{source['path']} holds more than {limit} supported files (KB_WATCH_MAX_FILES): "
                    "watching it indexes all of them and keeps scanning them; repeat the request with "
                    "`confirm: true` (kb-engine watch --add FOLDER --yes) if that is meant, or watch the "
                    "folder that holds the papers",
                )


SYNC_FIELDS = (
    Field(
        "ingest",
        "array of strings",
        "none",
        "files to ingest (the watcher's job names them); without `ingest` and `remove`, every watched folder is "
        "scanned and brought in step at once",
    ),
    Field(
        "remove",
        "array of strings",
        "none",
        "stored paths whose documents are removed, each only when its file is still known to be gone (not merely "
        "out of reach) and its watched folder is within reach",
    ),
    Field(
        "zotero",
        "array of strings",
        "none",
        "watched Zotero data folders to import from (changed attachments only) and to remove the documents of "
        "attachments trashed or deleted in Zotero since the last sync",
    ),
    KB_ROOT_FIELD,
)


SYNC_COUNTS = (STATUS_ADDED, STATUS_UPDATED, STATUS_MOVED, STATUS_DUPLICATE, STATUS_ERROR, "removed")  # a sync's counts


def sync_pending(lib: Library, payload: dict) -> tuple[int, int]:
    """(changes a sync request brings, the same): a job when there are many."""
    ingest, remove, zotero, _ = _sync_request(lib, payload)
    return len(ingest) + len(remove) + len(zotero), len(ingest) + len(remove) + len(zotero)


def _sync_request(lib: Library, payload: dict) -> tuple[list[str], list[str], list[str], list[dict]]:
    """(files to ingest, stored paths to remove, Zotero sources to import, places that could not be read): as the
    request names them, or, when it names none, everything that differs now."""
    if all(payload.get(key) is None for key in ("ingest", "remove", "zotero")):
        return _sync_plan(lib)
    return _path_list(payload, "ingest"), _path_list(payload, "remove"), _path_list(payload, "zotero"), []


def _sync_plan(lib: Library) -> tuple[list[str], list[str], list[str], list[dict]]:
    """Everything that differs between the watched folders and the library, now (no settling, no grace: the
    user asked for it), and every Zotero source (its import skips unchanged attachments); offline and unreadable
    sources are left alone, and so is what the library holds under a place that could not be read (listed as
    {path, reason}, the unreadable sources with them)."""
    ingest, remove, zotero, unreadable = [], [], [], []
    for source in read_sources(lib):
        if source.get("kind") == "zotero":
            zotero += [source["path"]] if scan_zotero(source["path"]).offline is None else []
            continue
        watch = SourceWatch(source["path"], bool(source.get("mount")))
        scan = scan_folder(watch.path, lib.root, watch.mount)
        found, gone, _ = watch.compare(scan, stored_under(lib, watch.path), time.monotonic(), 0.0, 0.0)
        ingest += found
        remove += gone
        if scan.state == "unreadable" and scan.offline is not None:
            unreadable.append({"path": watch.path, "reason": scan.offline})
        unreadable += [{"path": path_key(place), "reason": why} for place, why in scan.unreadable]
    return ingest, remove, zotero, unreadable


def _online_folders(sources: list[dict]) -> list[str]:
    """The watched folders within reach (the watcher's offline and unreadable rules, asked now, without a walk)."""
    return [
        s["path"]
        for s in sources
        if s.get("kind", "folder") == "folder" and out_of_reach(s["path"], bool(s.get("mount"))) is None
    ]


def _removable(lib: Library, stored_path: str, online: list[str]) -> tuple[sqlite3.Row | None, str | None]:
    """(the document of a stored path whose file is still known to be gone, in a watched folder within reach;
    why the file's state cannot be known, when it cannot: a folder above it cannot be searched, an I/O error)."""
    row = lib.doc_by_path(stored_path)
    if row is None or not any(_inside(stored_path, p) for p in online):
        return None, None
    state, why = path_state(fs_path(row), follow=False)
    if state == "unknown":
        return None, f"the file cannot be looked at ({why}): its document is kept"
    return (row, None) if state == "gone" else (None, None)


def cmd_sync(
    lib: Library, payload: dict, progress: Callable[[dict], None] | None, models: Models, own_process: bool = False
) -> dict:
    """Bring the watched sources in step: ingest new and changed files (a moved file is re-pathed by its
    content), import what changed in Zotero, then remove the documents of files that are gone and of Zotero
    attachments trashed since the last sync. One transaction per file, as ingest."""
    sources = read_sources(lib)
    ingest, remove, zotero, unreadable = _sync_request(lib, payload)
    folders = [s["path"] for s in sources if s.get("kind", "folder") == "folder"]
    ingest = [
        p for p in ingest if any(_inside(os.path.abspath(p), f) for f in folders) and os.path.isfile(p)
    ]  # only inside watched folders; one gone since is the next scan's
    total = len(ingest) + len(remove)

    offset = 0

    def shifted(event: dict) -> None:  # the ingests' file events, counted out of the whole job
        if progress is not None:
            progress(
                {**event, "done": offset + int(event.get("done") or 0), "total": total}
                if event.get("phase") == "files"
                else event
            )

    entries: list[Mapping[str, Any]] = []  # ingest's file entries, the Zotero import's items
    notes, errors = [], []
    by_ocr: dict[str | None, list[str]] = {}  # each file read with its folder's OCR setting
    for path in ingest:
        owner = next((s for s in sources if s.get("kind", "folder") == "folder" and _inside(path, s["path"])), {})
        by_ocr.setdefault((owner.get("options") or {}).get("ocr"), []).append(path)
    for ocr, paths in by_ocr.items():
        response = cmd_ingest(lib, {"paths": paths, "ocr": ocr}, shifted, models, own_process)
        entries += response["files"]
        notes += [response["note"]] if response.get("note") else []
        offset += len(paths)
    removed = []
    online = _online_folders(sources) if remove else []
    for done, stored_path in enumerate(remove, start=len(ingest) + 1):
        row, unknown = _removable(lib, stored_path, online)
        if unknown is not None:
            unreadable.append({"path": stored_path, "reason": unknown})
        if row is not None:
            with lib.transaction():
                lib.delete_doc(row["id"])
                lib.invalidate_cache()
            removed.append(stored_path)
        if progress is not None:
            progress({"phase": "files", "done": done, "total": total, "path": stored_path, "status": "removed"})
    for source in (s for s in sources if s["path"] in zotero and s.get("kind") == "zotero"):
        try:
            items, trashed = sync_zotero_source(lib, source, progress, models, own_process)
        except KBError as exc:  # an unreadable database: said, and tried again when it changes
            errors.append(f"{source['path']}: {exc.message}")
            continue
        entries += items
        removed += trashed
    counted = [e for e in entries if e["status"] != "missing"]
    changes = {status: sum(e["status"] == status for e in counted) for status in SYNC_COUNTS[:-1]}
    changes["removed"] = len(removed)
    update_sources(
        lib,
        {s["path"] for s in sources if s["path"] in zotero or s.get("kind") != "zotero"},
        last_sync=now_iso(),
        last_changes=changes,
    )
    totals = {**changes, "files": total, "vectors_missing": lib.count_missing_vectors()}
    result: dict[str, Any] = {"files": entries, "removed": removed, "totals": totals, "kb_root": str(lib.root)}
    if errors:
        result["errors"] = errors
    if unreadable:
        result["unreadable"] = unreadable
    if notes:
        result["note"] = notes[0]
    return result


def sync_zotero_source(
    lib: Library, source: dict, progress: Callable[[dict], None] | None, models: Models, own_process: bool
) -> tuple[list[dict], list[str]]:
    """Bring a watched Zotero library's changes in: remove the documents of attachments that left it (trashed or
    deleted) since the last sync, then import the attachments that changed (all of them on a full pass, see
    zotero_sync_rows). (The import's entries, the paths removed.) The database's signature is taken before its
    snapshot, so a change made while this runs brings another sync; the mark and the known attachments are
    stored only once the import is done, so a sync cut short is done again. Removals are made only from a
    catalog read whole from a snapshot shown to be one state of the database: a snapshot that cannot be had
    (zotero_busy: Zotero kept writing; zotero_unreadable) raises before anything is removed, and the next sync
    reads the database again."""
    signature = zotero_signature(scan_zotero(source["path"]))
    options = source.get("options") or {}
    request = {"zotero_db": source["db"], **options}
    db = locate_zotero_db(source["db"])
    base_dir = zotero_base_directory(db.parent, _opt_str(request, "base_dir"))
    meta_key = f"zotero_keys:{source['path']}"
    known = _known_attachments(lib, meta_key)
    mark = source.get("zotero_mark") if isinstance(source.get("zotero_mark"), dict) else None
    full = mark is None or not _mark_recent(mark)
    snapshot = ZoteroSnapshot(db)
    with snapshot as conn:
        catalog = read_zotero_catalog(conn)
        files = {row["key"]: _catalog_file(row, db.parent, base_dir) for row in catalog.rows}
        now = {row["key"]: (path_key(files[row["key"]] or "") or None, catalog.digest(row)) for row in catalog.rows}
        removed = _remove_departed(lib, known, now)
        touched = None if full or mark is None else zotero_touched(conn, mark, snapshot.taken)
        full = full or touched is None
        rows = zotero_sync_rows(lib, catalog, known, now, files, touched)
        attachments = zotero_attachments(conn, catalog, db.parent, base_dir, rows)
        new_mark = zotero_mark(conn, snapshot.taken)
    if not full:  # an attachment saved just before the mark is read again: it is imported only if it changed
        attachments = [a for a in attachments if a.attachment_key not in known or _zotero_needs_work(lib, a, False)]
    # imported after the removals, so that a recorded copy of a removed document's file is indexed in its place
    response = cmd_zotero(lib, request, progress, models, own_process, (db, attachments, catalog.n_collections))
    with lib.transaction():
        lib.set_meta(meta_key, json.dumps({key: list(now[key]) for key in sorted(now)}, ensure_ascii=False))
    if new_mark is not None:
        new_mark["full_pass"] = time.time() if full or mark is None else mark["full_pass"]
    update_sources(lib, {source["path"]}, zotero_signature=signature, zotero_mark=new_mark)
    return [{**e, "path": e.get("path") or e["attachment_key"]} for e in response["items"]], removed


def zotero_sync_rows(
    lib: Library,
    catalog: ZoteroCatalog,
    known: dict[str, list],
    now: dict[str, tuple],
    files: dict[str, str | None],
    touched: set[int] | None,
) -> list[sqlite3.Row]:
    """The attachments a sync imports: every one on a full pass (``touched`` None); otherwise those new since the
    last sync, saved since it (themselves, their parents or their annotations: ``touched``), whose digest or file
    path moved, or whose file the library does not hold as it is now (edited outside Zotero, or a recorded copy
    whose original was just removed)."""
    if touched is None:
        return catalog.rows
    # one read of the library's files instead of a query per attachment (a Zotero library has thousands)
    held = {r["path"]: r for r in lib.held_files()}
    return [
        row
        for row in catalog.rows
        if list(now[row["key"]]) != known.get(row["key"])
        or row["itemID"] in touched
        or catalog.owner(row) in touched
        or ((file := files[row["key"]]) is not None and zotero_file_needs_work(lib, file, held=held)[0])
    ]


def _catalog_file(row: sqlite3.Row, data_dir: Path, base_dir: Path | None) -> str | None:
    """An attachment's file as an absolute path (None when it cannot be resolved), without a query."""
    path, _ = _resolve_attachment(row["path"], row["linkMode"], row["key"], data_dir, base_dir)
    return os.path.abspath(path) if path is not None else None


def _known_attachments(lib: Library, meta_key: str) -> dict[str, list]:
    """The attachments a source's last sync saw: key -> [file, digest] (a file alone before digests were kept)."""
    try:
        known = json.loads(lib.get_meta(meta_key) or "{}")
    except ValueError:
        return {}
    if not isinstance(known, dict):
        return {}
    return {
        key: value if isinstance(value, list) and len(value) == 2 else [value, None] for key, value in known.items()
    }


def _mark_recent(mark: dict) -> bool:
    """Whether a source's last full pass is recent enough for a sync to read only what changed since its mark."""
    last = mark.get("full_pass")
    return isinstance(last, (int, float)) and 0 <= time.time() - last < watch_setting("KB_ZOTERO_FULL_S")


def _remove_departed(lib: Library, known: dict[str, list], now: dict[str, tuple]) -> list[str]:
    """Delete the documents of attachments the last sync saw and the library no longer has; the paths removed."""
    files_now = {file for file, _ in now.values() if file is not None}
    removed = []
    for key in sorted(set(known) - set(now)):
        # its document: the one carrying its key, or the copy recorded at its file (a duplicate has no key)
        rows = lib.docs_of_attachment(key, known[key][0] or "")
        for row in rows:
            if row["path"] in files_now:
                continue  # the same file is still another live attachment's
            with lib.transaction():
                lib.delete_doc(row["id"])
                lib.invalidate_cache()
            removed.append(row["path"])
    return removed
