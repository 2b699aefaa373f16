"""Zotero import: Zotero's data laid over the documents read from its attachments, and which attachments need a
read.

May import: config, ingest.files, reading.metadata, records, storage, zotero.snapshot.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat as stat_module
from pathlib import Path

from ..config import (
    BIB_FIELDS,
    STATUS_ADDED,
    STATUS_MOVED,
    STATUS_SKIPPED,
    STATUS_UPDATED,
    _opt_bool,
    _opt_int,
    _opt_str,
)
from ..ingest.files import _original_is_gone, _original_row
from ..reading.metadata import METADATA_FIELDS, DocMeta
from ..records import FileEntry
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

# Zotero's metadata, annotations, collections, tags and library laid over each document read from an attachment
# (the command is commands/zotero.py; reading Zotero's database, zotero/snapshot.py).


def _zotero_entry(attachment: ZoteroAttachment, status: str, **extra) -> dict:
    entry = {
        "item_key": attachment.item_key,
        "attachment_key": attachment.attachment_key,
        "library": attachment.library,
        "title": attachment.meta.get("title"),
        "path": attachment.path,
        "status": status,
        "chunks": 0,
        "annotations": 0,
    }
    entry.update({k: v for k, v in extra.items() if v is not None})
    return entry


def _zotero_candidate(attachment: ZoteroAttachment) -> dict:
    if attachment.path is None:
        return _zotero_entry(attachment, "missing", reason=attachment.problem)
    if not os.path.isfile(attachment.path):
        return _zotero_entry(attachment, "missing", reason="file_missing")
    return _zotero_entry(attachment, "candidate", annotations=len(attachment.annotations))


def zotero_overlay(lib: Library, attachment: ZoteroAttachment, result: FileEntry, force: bool) -> dict:
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
        stored = DocMeta.from_row(row)
        zotero = DocMeta(
            title=meta.get("title", row["title"]),
            authors=meta.get("authors") or stored.authors,
            year=meta.get("year", row["year"]),
            journal=meta.get("journal", row["journal"]),
            doi=meta.get("doi") or row["doi"] or None,
            lang=row["lang"] or "",
            **{name: meta.get(name) or getattr(stored, name) for name in BIB_FIELDS if name != "authors_more"},
            authors_more=stored.authors_more and not meta.get("authors"),  # Zotero's list is the whole list
        )
        sources = {
            key: "zotero" if meta.get(key) else json.loads(row["metadata_source"] or "{}").get(key, "extracted")
            for key in METADATA_FIELDS
        }
        fields = {
            "title": zotero.title,
            "year": zotero.year,
            "journal": zotero.journal,
            "doi": zotero.doi,
            **zotero.bib_columns(),
            "metadata_source": json.dumps(sources),
            "zotero_key": attachment.item_key,
            "zotero_attachment_key": attachment.attachment_key,
            "zotero_version": attachment.version,
            "collections": json.dumps(attachment.collections, ensure_ascii=False),
            "zotero_library": attachment.library,
            "zotero_group": attachment.group,
            "tags": json.dumps(attachment.tags, ensure_ascii=False),
        }
        authors = zotero.authors
        fields.update(
            authors=json.dumps(authors, ensure_ascii=False),
            title_key=title_key(zotero.title),
            first_author_key=surname_key(authors[0]) if authors else None,
        )
        lib.upsert_doc(row["path"], fields)
        lib.reindex_headings(row["id"], zotero.title)
        lib.replace_block_chunks(row["id"], "annotation", annotation_chunks(attachment.annotations), zotero.title)
        lib.invalidate_cache()
    entry.update(
        title=zotero.title, annotations=len(attachment.annotations), chunks=lib.recorded_chunk_count(row["id"])
    )
    if result["status"] == STATUS_SKIPPED:
        entry.update(status=STATUS_UPDATED, reason="zotero_metadata")
    return entry


def _zotero_target_row(lib: Library, row: sqlite3.Row | None, attachment: ZoteroAttachment) -> sqlite3.Row | None:
    """The document that receives an attachment's Zotero data: its own row, or for a recorded duplicate the
    indexed copy of the same file under another path, unless another Zotero attachment already owns that copy."""
    if row is not None and row["status"] == "duplicate" and row["duplicate_of"] is not None:
        original = lib.doc_by_id(row["duplicate_of"])
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
        return False  # missing: reported, nothing to write
    file_work, row = zotero_file_needs_work(lib, attachment.path, force)
    if file_work or row is None:
        return file_work
    target = _zotero_target_row(lib, row, attachment)  # None: another attachment's document holds the file
    return target is not None and target["status"] == "indexed" and not _zotero_data_current(target, attachment)


def zotero_file_needs_work(
    lib: Library, path: str, force: bool = False, held: dict[str, sqlite3.Row] | None = None
) -> tuple[bool, sqlite3.Row | None]:
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
        return True, row  # ingest_file re-reads it or lets it take the original's place
    return False, row


def zotero_pending(lib: Library, payload: dict) -> tuple[int, int]:
    """(attachments that need work, attachments listed) for a zotero request; reads a snapshot of Zotero's
    database (the job reads a fresh one), never an attachment file."""
    force = _opt_bool(payload, "force")
    _, attachments, _ = read_zotero_request(payload)
    return sum(_zotero_needs_work(lib, a, force) for a in attachments), len(attachments)
