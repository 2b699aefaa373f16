"""Zotero import: the zotero command: attachments through the ingest pipeline, Zotero's data laid over.

May import: config, storage, reading.ocr, reading.metadata, models.registry, zotero.snapshot, ingest.files,
ingest.pipeline, commands.core.
"""
from __future__ import annotations

import json
import os
import sqlite3
import stat as stat_module
from collections import Counter
from pathlib import Path
from typing import Callable

from ..commands.core import written_library
from ..config import (
    INGEST_STATUSES,
    KB_ROOT_FIELD,
    STATUS_ADDED,
    STATUS_MOVED,
    STATUS_SKIPPED,
    STATUS_UPDATED,
    SWITCH,
    Field,
    Flag,
    _opt_bool,
    _opt_int,
    _opt_str,
)
from ..ingest.files import _original_is_gone, _original_row, embed_missing_chunks, vectors_not_computed
from ..ingest.pipeline import VectorFeeder, ingest_files, ingest_workers, ocr_pages_only
from ..models.registry import Models
from ..reading.metadata import METADATA_FIELDS, DocMeta
from ..reading.ocr import OCR_FIELD
from ..storage import Library, path_key, surname_key, title_key
from ..zotero.snapshot import (
    ZoteroAttachment,
    ZoteroSnapshot,
    annotation_chunks,
    locate_zotero_db,
    read_zotero_catalog,
    zotero_attachments,
    zotero_base_directory,
)

# The zotero command: a Zotero library's attachments read through the ingest pipeline, with Zotero's metadata,
# annotations, collections, tags and library laid over each document (the reading itself is section 19).

ZOTERO_FIELDS = (
    Field("zotero_db", "string", "found",
          "path of `zotero.sqlite` or of the folder that holds it; without it, `KB_ZOTERO_DB`, then `~/Zotero`, "
          "`~/Documents/Zotero` and the old Windows profile folders are tried",
          cli=(Flag(("--db",), "path to zotero.sqlite (default: found in the usual places)"),)),
    Field("base_dir", "string", "found",
          "Zotero's \"Linked Attachment Base Directory\", for `attachments:` paths; without it, "
          "`KB_ZOTERO_BASE_DIR`, then `extensions.zotero.baseAttachmentPath` in a Zotero `prefs.js`"),
    KB_ROOT_FIELD,
    Field("dry_run", "boolean", "`false`",
          "list the attachments that would be imported (`candidate`) or are `missing`, without comparing with the "
          "library (unchanged ones are `candidate` too); nothing is written and no library is created",
          cli=(Flag(("--dry-run",), "list what would be imported", SWITCH),)),
    Field("force", "boolean", "`false`",
          "re-parse every file and re-apply Zotero's data, even when nothing changed",
          cli=(Flag(("--force",), "re-import attachments even when unchanged", SWITCH),)),
    OCR_FIELD,
    Field("limit", "integer", "`0`",
          "only the first N attachments, in Zotero item-id order (`0`: all), 0 to 10,000,000",
          cli=(Flag(("--limit",), "import at most N attachments (0: all)", {"type": int, "default": 0}),)),
)


def cmd_zotero(lib: Library | None, payload: dict, progress: Callable[[dict], None] | None, models: Models,
               own_process: bool = False, read: tuple | None = None) -> dict:
    """Import the file attachments of a Zotero library (read from a snapshot), with Zotero's metadata,
    annotations, collections and tags; unchanged items are skipped on the next run. Files are read ahead and
    encoded on the ingest pipeline; each item's Zotero data is committed right after its file. ``read``: what
    read_zotero_request gave the caller already (a sync reads it first)."""
    dry_run, force = _opt_bool(payload, "dry_run"), _opt_bool(payload, "force")
    db, attachments, n_collections = read or read_zotero_request(payload)
    entries: list[dict] = [{} for _ in attachments]     # each filled in when its attachment is dealt with
    done = 0

    def report(index: int) -> None:
        nonlocal done
        done += 1
        if progress:
            progress({"phase": "zotero", "done": done, "total": len(attachments),
                      "path": attachments[index].path or "", "status": entries[index]["status"]})

    with_files = []
    for index, attachment in enumerate(attachments):
        entry = _zotero_candidate(attachment)
        if dry_run or entry["status"] == "missing":
            entries[index] = entry
            report(index)
        else:
            with_files.append(index)
    feeder = None
    if not dry_run and with_files:
        target = written_library(lib)
        feeder = VectorFeeder(target, models)

        def lay_over(position: int, result: dict) -> dict:
            index = with_files[position]
            entries[index] = zotero_overlay(target, attachments[index], result, force)
            report(index)
            return result

        ingest_files(target, [(attachments[i].file, True) for i in with_files], force, ocr_pages_only(progress), feeder,
                     ingest_workers(own_process), on_entry=lay_over, ocr=_opt_str(payload, "ocr"))
        feeder.finish(target, progress)
    statuses = ("candidate",) if dry_run else INGEST_STATUSES + ("missing",)
    totals = {status: sum(e["status"] == status for e in entries) for status in statuses}
    totals["missing"] = sum(e["status"] == "missing" for e in entries)
    totals.update(items=len(entries), annotations=sum(e.get("annotations", 0) for e in entries))
    response = {"items": entries, "totals": totals, "collections": n_collections, "dry_run": dry_run,
                "libraries": dict(Counter(a.library for a in attachments)),
                "zotero_db": str(db), "kb_root": str(lib.root) if lib is not None else None}
    if not dry_run and lib is not None:
        if feeder is not None and feeder.unavailable is not None:
            vectors = vectors_not_computed(lib.count_missing_vectors(), feeder.unavailable)
        else:
            vectors = embed_missing_chunks(lib, models, progress)
        written = feeder.written if feeder is not None else 0
        totals["vectors_written"] = written + vectors["vectors_written"]
        totals["vectors_missing"] = vectors["vectors_missing"]
        if vectors.get("note"):
            response["note"] = vectors["note"]
    return response


def _zotero_entry(attachment: ZoteroAttachment, status: str, **extra) -> dict:
    entry = {"item_key": attachment.item_key, "attachment_key": attachment.attachment_key,
             "library": attachment.library, "title": attachment.meta.get("title"), "path": attachment.path,
             "status": status, "chunks": 0, "annotations": 0}
    entry.update({k: v for k, v in extra.items() if v is not None})
    return entry


def _zotero_candidate(attachment: ZoteroAttachment) -> dict:
    if attachment.path is None:
        return _zotero_entry(attachment, "missing", reason=attachment.problem)
    if not os.path.isfile(attachment.path):
        return _zotero_entry(attachment, "missing", reason="file_missing")
    return _zotero_entry(attachment, "candidate", annotations=len(attachment.annotations))


def zotero_overlay(lib: Library, attachment: ZoteroAttachment, result: dict, force: bool) -> dict:
    """Lay Zotero's metadata and annotations over the attachment's file, just ingested (``result``)."""
    entry = _zotero_entry(attachment, result["status"], reason=result.get("reason"), error=result.get("error"))
    entry["chunks"] = result["chunks"]
    row = _zotero_target_row(lib, lib.doc_by_path(attachment.file), attachment)
    if row is None or row["status"] != "indexed":
        return entry
    fresh = result["status"] in (STATUS_ADDED, STATUS_UPDATED, STATUS_MOVED)
    if not (force or fresh or not _zotero_data_current(row, attachment)):
        entry["reason"] = "unchanged"
        entry["annotations"] = len(attachment.annotations)
        return entry
    meta = {k: v for k, v in attachment.meta.items() if v}
    with lib.transaction():
        zotero = DocMeta(title=meta.get("title", row["title"]),
                         authors=meta.get("authors") or json.loads(row["authors"] or "[]"),
                         year=meta.get("year", row["year"]), journal=meta.get("journal", row["journal"]),
                         doi=meta.get("doi") or row["doi"] or None, lang=row["lang"] or "")
        sources = {key: "zotero" if meta.get(key) else json.loads(row["metadata_source"] or "{}").get(key, "extracted")
                   for key in METADATA_FIELDS}
        fields = {"title": zotero.title, "year": zotero.year, "journal": zotero.journal, "doi": zotero.doi,
                  "metadata_source": json.dumps(sources),
                  "zotero_key": attachment.item_key, "zotero_attachment_key": attachment.attachment_key,
                  "zotero_version": attachment.version,
                  "collections": json.dumps(attachment.collections, ensure_ascii=False),
                  "zotero_library": attachment.library, "zotero_group": attachment.group,
                  "tags": json.dumps(attachment.tags, ensure_ascii=False)}
        authors = zotero.authors
        fields.update(authors=json.dumps(authors, ensure_ascii=False), title_key=title_key(zotero.title),
                      first_author_key=surname_key(authors[0]) if authors else None)
        lib.upsert_doc(row["path"], fields)
        lib.reindex_headings(row["id"], zotero.title)
        lib.replace_block_chunks(row["id"], "annotation", annotation_chunks(attachment.annotations), zotero.title)
        lib.invalidate_cache()
    entry.update(title=zotero.title, annotations=len(attachment.annotations),
                 chunks=lib.conn.execute("SELECT chunk_count FROM docs WHERE id = ?", (row["id"],)).fetchone()[0])
    if result["status"] == STATUS_SKIPPED:
        entry.update(status=STATUS_UPDATED, reason="zotero_metadata")
    return entry


def _zotero_target_row(lib: Library, row: sqlite3.Row | None, attachment: ZoteroAttachment) -> sqlite3.Row | None:
    """The document that receives an attachment's Zotero data: its own row, or for a recorded duplicate the
    indexed copy of the same file under another path, unless another Zotero attachment already owns that copy."""
    if row is not None and row["status"] == "duplicate" and row["duplicate_of"] is not None:
        original = lib.conn.execute("SELECT * FROM docs WHERE id = ?", (row["duplicate_of"],)).fetchone()
        if original is not None and original["zotero_attachment_key"] in (None, attachment.attachment_key):
            return original
    return row


def _zotero_data_current(row: sqlite3.Row, attachment: ZoteroAttachment) -> bool:
    return row["zotero_version"] == attachment.version and row["zotero_attachment_key"] == attachment.attachment_key


def read_zotero_request(payload: dict) -> tuple[Path, list[ZoteroAttachment], int]:
    """The Zotero database a request names, its attachments (``limit`` applied) and its number of collections."""
    db = locate_zotero_db(_opt_str(payload, "zotero_db"))
    limit = _opt_int(payload, "limit", 0, 0, 10**7)
    base_dir = zotero_base_directory(db.parent, _opt_str(payload, "base_dir"))
    with ZoteroSnapshot(db) as conn:
        catalog = read_zotero_catalog(conn)
        attachments = zotero_attachments(conn, catalog, db.parent, base_dir)
    return db, attachments[:limit] if limit else attachments, catalog.n_collections


def _zotero_needs_work(lib: Library, attachment: ZoteroAttachment, force: bool) -> bool:
    """Whether importing the attachment would write anything, judged as zotero_overlay's unchanged
    check does (size and mtime against the library, Zotero's signature and attachment key), without reading
    the file."""
    if attachment.path is None:
        return False                     # missing: reported, nothing to write
    file_work, row = zotero_file_needs_work(lib, attachment.path, force)
    if file_work or row is None:
        return file_work
    target = _zotero_target_row(lib, row, attachment)     # None: another attachment's document holds the file
    return target is not None and target["status"] == "indexed" and not _zotero_data_current(target, attachment)


def zotero_file_needs_work(lib: Library, path: str, force: bool = False,
                           held: dict[str, sqlite3.Row] | None = None) -> tuple[bool, sqlite3.Row | None]:
    """(whether ingesting an attachment's file would write anything, the library's document at its path): a
    file the library lacks or holds at another size or mtime, or a recorded copy whose original is gone. A
    missing file needs none (it is reported). ``held``: the library's documents by stored path, read once by a
    caller that asks of thousands of files (size, mtime_ns, status, duplicate_of, sha256 are enough)."""
    path = os.path.abspath(path)
    try:
        stat = os.stat(path)
    except OSError:
        return False, None
    if not stat_module.S_ISREG(stat.st_mode):
        return False, None
    row = held.get(path_key(path)) if held is not None else lib.doc_by_path(path)
    if force or row is None or row["size"] != stat.st_size or row["mtime_ns"] != stat.st_mtime_ns:
        return True, row
    if row["status"] == "duplicate" and (_original_row(lib, row) is None or _original_is_gone(lib, row)):
        return True, row                 # ingest_file re-reads it or lets it take the original's place
    return False, row


def zotero_pending(lib: Library, payload: dict) -> tuple[int, int]:
    """(attachments that need work, attachments listed) for a zotero request; reads a snapshot of Zotero's
    database (the job reads a fresh one), never an attachment file."""
    force = _opt_bool(payload, "force")
    _, attachments, _ = read_zotero_request(payload)
    return sum(_zotero_needs_work(lib, a, force) for a in attachments), len(attachments)
