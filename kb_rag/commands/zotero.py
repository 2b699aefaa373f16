"""Zotero command: the zotero command's request fields and handler, a Zotero library's attachments read through the
ingest pipeline.

May import: commands.core, config, ingest.files, ingest.pipeline, models.registry, reading.ocr, records, storage,
zotero.importer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from ..commands.core import written_library
from ..config import INGEST_STATUSES, KB_ROOT_FIELD, SWITCH, Field, Flag, _opt_bool, _opt_str
from ..ingest.files import embed_missing_chunks, vectors_not_computed
from ..ingest.pipeline import VectorFeeder, ingest_files, ingest_workers, ocr_pages_only
from ..models.registry import Models
from ..reading.ocr import OCR_FIELD
from ..records import FileEntry
from ..storage import Library
from ..zotero.importer import _zotero_candidate, read_zotero_request, zotero_overlay

ZOTERO_FIELDS = (
    Field(
        "zotero_db",
        "string",
        "found",
        "path of `zotero.sqlite` or of the folder that holds it; without it, `KB_ZOTERO_DB`, then `~/Zotero`, "
        "`~/Documents/Zotero` and the old Windows profile folders are tried",
        cli=(Flag(("--db",), "path to zotero.sqlite (default: found in the usual places)"),),
    ),
    Field(
        "base_dir",
        "string",
        "found",
        'Zotero\'s "Linked Attachment Base Directory", for `attachments:` paths; without it, '
        "`KB_ZOTERO_BASE_DIR`, then `extensions.zotero.baseAttachmentPath` in a Zotero `prefs.js`",
    ),
    KB_ROOT_FIELD,
    Field(
        "dry_run",
        "boolean",
        "`false`",
        "list the attachments that would be imported (`candidate`) or are `missing`, without comparing with the "
        "library (unchanged ones are `candidate` too); nothing is written and no library is created",
        cli=(Flag(("--dry-run",), "list what would be imported", SWITCH),),
    ),
    Field(
        "force",
        "boolean",
        "`false`",
        "re-parse every file and re-apply Zotero's data, even when nothing changed",
        cli=(Flag(("--force",), "re-import attachments even when unchanged", SWITCH),),
    ),
    OCR_FIELD,
    Field(
        "limit",
        "integer",
        "`0`",
        "only the first N attachments, in Zotero item-id order (`0`: all), 0 to 10,000,000",
        cli=(Flag(("--limit",), "import at most N attachments (0: all)", {"type": int, "default": 0}),),
    ),
)


def cmd_zotero(
    lib: Library | None,
    payload: dict,
    progress: Callable[[dict], None] | None,
    models: Models,
    own_process: bool = False,
    read: tuple | None = None,
) -> dict:
    """Import the file attachments of a Zotero library (read from a snapshot), with Zotero's metadata,
    annotations, collections and tags; unchanged items are skipped on the next run. Files are read ahead and
    encoded on the ingest pipeline; each item's Zotero data is committed right after its file. ``read``: what
    read_zotero_request gave the caller already (a sync reads it first)."""
    dry_run, force = _opt_bool(payload, "dry_run"), _opt_bool(payload, "force")
    db, attachments, n_collections = read or read_zotero_request(payload)
    entries: list[dict] = [{} for _ in attachments]  # each filled in when its attachment is dealt with
    done = 0

    def report(index: int) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(
                {
                    "phase": "zotero",
                    "done": done,
                    "total": len(attachments),
                    "path": attachments[index].path or "",
                    "status": entries[index]["status"],
                }
            )

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

        def lay_over(position: int, result: FileEntry) -> FileEntry:
            index = with_files[position]
            entries[index] = zotero_overlay(target, attachments[index], result, force)
            report(index)
            return result

        ingest_files(
            target,
            [(attachments[i].file, True) for i in with_files],
            force,
            ocr_pages_only(progress),
            feeder,
            ingest_workers(own_process),
            on_entry=lay_over,
            ocr=_opt_str(payload, "ocr"),
        )
        feeder.finish(target, progress)
    statuses = ("candidate",) if dry_run else INGEST_STATUSES + ("missing",)
    totals = {status: sum(e["status"] == status for e in entries) for status in statuses}
    totals["missing"] = sum(e["status"] == "missing" for e in entries)
    totals.update(items=len(entries), annotations=sum(e.get("annotations", 0) for e in entries))
    response = {
        "items": entries,
        "totals": totals,
        "collections": n_collections,
        "dry_run": dry_run,
        "libraries": dict(Counter(a.library for a in attachments)),
        "zotero_db": str(db),
        "kb_root": str(lib.root) if lib is not None else None,
    }
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
