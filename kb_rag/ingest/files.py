"""Ingest: file walk, triage, one transaction per file, metadata refresh.

May import: answers.search, config, models.importer, models.registry, models.runtime, reading.chunking,
reading.citations, reading.metadata, reading.ocr, reading.readers, records, storage.
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import stat as stat_module
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..answers.search import embeddings_disabled
from ..config import (
    ABSENT_ERRNOS,
    PARSER_REVISION,
    STATUS_ADDED,
    STATUS_DUPLICATE,
    STATUS_ERROR,
    STATUS_MOVED,
    STATUS_SKIPPED,
    STATUS_UPDATED,
    SUPPORTED_SUFFIXES,
    FileRejected,
    KBError,
    _short_error,
    document_limit,
    now_iso,
    path_state,
)
from ..models.importer import offline_model_remedy
from ..models.registry import Models
from ..models.runtime import (
    PASSAGE_FORMAT,
    Embedder,
    ModelUnavailable,
    UnusableEmbeddings,
    embedding_inputs,
    library_passage_prompt,
)
from ..reading.chunking import chunk_document, page_coverage, page_coverage_note
from ..reading.citations import document_references, link_chunk_citations
from ..reading.metadata import METADATA_FIELDS, DocMeta, extract_metadata
from ..reading.ocr import ReadOptions
from ..reading.readers import extract_file
from ..records import FileEntry, IngestTotals
from ..storage import Library, fs_path, path_key, sha256_of_file, surname_key, title_key


@dataclass
class WalkFindings:
    """What a walk passed over but must report: places it could not look into, (path, message): folders it could
    not list, and folders (or files) whose entries it could not look at (a folder readable but not searchable); and
    links whose target lies outside the folder that was named, (link, target). A caller never takes what lies
    under an unreadable place for deleted."""

    unreadable: list = field(default_factory=list)
    links_out: list = field(default_factory=list)


def _inside(path: str, folder: str) -> bool:
    """A path at or under a folder, both absolute and spelled alike (a bare prefix test takes /a/bc for /a/b)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _within_any(path: str, places: set[str]) -> bool:
    """A path at or under any of these places, spelled alike (one set look-up per level of the path)."""
    while path not in places:
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent
    return True


def collect_files(paths: list[str], kb_root: Path, findings: WalkFindings | None = None) -> Iterator[tuple[str, bool]]:  # noqa: C901
    """(absolute path, named explicitly) for every file to consider, in a stable order. A folder is walked for
    the supported files inside it, and only those: a symbolic link is judged by where it really leads, and one
    that leads out of the named folder (a file or a folder) is not followed; links to folders never are, since
    the walk reaches what lies inside the named folder anyway. The library folder is never walked, whatever
    path or link leads to it (real paths are compared). Folders that cannot be listed, entries that cannot be
    looked at and links out are added to ``findings`` instead of vanishing from the walk. A file named
    explicitly is read wherever it is."""
    seen: set[str] = set()
    findings = findings if findings is not None else WalkFindings()
    library = os.path.realpath(kb_root)

    def cannot_list(exc: OSError) -> None:
        findings.unreadable.append((exc.filename or "", f"the folder cannot be read ({_short_error(exc)})"))

    def passed_over(full: str, root: str) -> bool:
        """A link that leads out of the named folder (a finding) or into the library (left out in silence)."""
        if not os.path.islink(full):
            return False
        target = os.path.realpath(full)
        if _inside(target, library):
            return True
        if _inside(target, root):
            return False
        findings.links_out.append((full, target))
        return True

    for raw in paths:
        path = os.path.abspath(os.path.expanduser(raw))
        if os.path.isdir(path):
            root = os.path.realpath(path)
            for folder, dirs, files in os.walk(path, onerror=cannot_list):
                # the walk follows no link below the named folder, so a folder's real path is the root's plus the rest
                real = os.path.normpath(os.path.join(root, os.path.relpath(folder, path)))
                visible = sorted(d for d in dirs if not d.startswith(".") and os.path.join(real, d) != library)
                dirs[:] = [d for d in visible if not os.path.islink(os.path.join(folder, d))]
                for name in visible:
                    if name not in dirs:
                        passed_over(os.path.join(folder, name), root)
                for name in sorted(files):
                    full = os.path.join(folder, name)
                    if (
                        Path(name).suffix.lower() not in SUPPORTED_SUFFIXES
                        or name.startswith(("~$", "."))
                        or full in seen
                        or passed_over(full, root)
                    ):
                        continue
                    state = _entry_state(full, folder, findings)
                    if state == "file":
                        seen.add(full)
                        yield full, False
                    elif state == "unsearchable":
                        dirs[:] = []  # nothing below a folder that cannot be searched can be looked at
                        break
        elif path not in seen:
            seen.add(path)
            yield path, True


def _entry_state(full: str, folder: str, findings: WalkFindings) -> str:
    """``file`` for a regular file (reading a named pipe or a device would block or never end), ``other`` for
    anything else or nothing (gone since the listing, a dangling link); an entry that cannot be looked at is a
    finding: ``unsearchable`` when its folder denies the look (the folder is the finding), else ``unknown`` (the
    entry is: an I/O error, or a link whose target lies where it may not look)."""
    try:
        return "file" if stat_module.S_ISREG(os.stat(full).st_mode) else "other"
    except ValueError:
        return "other"
    except OSError as exc:
        if exc.errno in ABSENT_ERRNOS:
            return "other"
        if exc.errno in (errno.EACCES, errno.EPERM) and path_state(full, follow=False)[0] == "unknown":
            why = exc.strerror or _short_error(exc)
            findings.unreadable.append((folder, f"the folder's entries cannot be looked at ({why})"))
            return "unsearchable"
        findings.unreadable.append((full, f"the file cannot be looked at ({_short_error(exc)})"))
        return "unknown"


def walk_entries(lib: Library, findings: WalkFindings) -> list[FileEntry]:
    """The entries of what a walk reports. A link out that the library holds from before this rule (or from
    when the link led elsewhere) is taken out of it, in one transaction."""
    started = time.perf_counter()
    entries = [
        _file_entry(place, STATUS_ERROR, started, reason="unreadable", error=why) for place, why in findings.unreadable
    ]
    for link, target in findings.links_out:
        entry = _file_entry(
            link,
            STATUS_SKIPPED,
            started,
            reason="link_outside",
            error=f"a symbolic link to {target}, outside the folder being ingested: not followed",
        )
        row = lib.doc_by_path(link)
        if row is not None:
            with lib.transaction():
                lib.delete_doc(row["id"])
                lib.invalidate_cache()
            entry["removed"] = True
            entry["error"] += "; the copy indexed earlier was removed from the library"
        entries.append(entry)
    return entries


def _file_entry(
    path: str,
    status: str,
    started: float,
    chunks: int = 0,
    title: str | None = None,
    reason: str | None = None,
    error: str | None = None,
) -> FileEntry:
    entry: FileEntry = {
        "path": path_key(path),
        "status": status,
        "chunks": chunks,
        "title": title,
        "ms": int((time.perf_counter() - started) * 1000),
    }
    if reason:
        entry["reason"] = reason
    if error:
        entry["error"] = error
    return entry


def _stored_outcome(row: sqlite3.Row, started: float) -> FileEntry:
    """The entry for a file whose stored state is still current (nothing was read)."""
    if row["status"] == "indexed":
        return _file_entry(row["path"], STATUS_SKIPPED, started, row["chunk_count"], row["title"], "unchanged")
    if row["status"] == "duplicate":
        return _file_entry(row["path"], STATUS_DUPLICATE, started, 0, row["title"], row["reason"], row["error"])
    # Unchanged and still not indexable: skipped, but say why it is not in the library.
    entry = _file_entry(
        row["path"], STATUS_SKIPPED, started, 0, row["title"], "unchanged", f"not indexed: {row['error']}"
    )
    entry["previous"] = {
        "status": STATUS_ERROR if row["status"] == "error" else STATUS_SKIPPED,
        "reason": row["reason"],
    }
    return entry


def ingest_totals(entries: list[FileEntry], written: bool = True) -> IngestTotals:
    """An ingest's counts from its file entries, one per status in INGEST_STATUSES's order. ``written``: whether
    the added and updated files' chunks were written now (a metadata refresh rewrites none)."""

    def count(status: str) -> int:
        return sum(e["status"] == status for e in entries)

    return IngestTotals(
        added=count(STATUS_ADDED),
        updated=count(STATUS_UPDATED),
        skipped=count(STATUS_SKIPPED),
        duplicate=count(STATUS_DUPLICATE),
        moved=count(STATUS_MOVED),
        error=count(STATUS_ERROR),
        files=len(entries),
        chunks=sum(e["chunks"] for e in entries),
        chunks_written=sum(e["chunks"] for e in entries if written and e["status"] in (STATUS_ADDED, STATUS_UPDATED)),
    )


@dataclass
class PendingFile:
    """A file whose content must be (re-)read: everything the cheap checks learned about it."""

    path: str
    stat: os.stat_result
    sha: str
    kind: str
    started: float


@dataclass
class PreparedFile:
    """What reading one file produced; plain data, so a worker process can hand it back."""

    meta: DocMeta | None = None
    chunks: list = field(default_factory=list)
    references: list = field(default_factory=list)
    links: list = field(default_factory=list)  # per chunk, the (marker, reference number) pairs it cites
    pages: int | None = None
    page_labels: list = field(default_factory=list)
    coverage: dict | None = None
    ocr_pages: list = field(default_factory=list)  # pages whose text came from OCR
    ocr_capped: int = 0  # pages without a text layer left out (KB_OCR_MAX_PAGES)
    ocr_timed_out: int = 0  # pages left out whose OCR ran past KB_OCR_PAGE_SECONDS
    notes: list = field(default_factory=list)  # the reader's word on how it read the file (Extracted.notes)
    rejected: tuple[str, str, str] | None = None  # (status, reason, message): stored as skipped/error
    failure: str | None = None  # a parser bug: reported, nothing stored, a retry re-reads


def prepare_file(path: str, options: ReadOptions | None = None) -> PreparedFile:
    """Extract, describe, chunk and link one file: the CPU-heavy part of ingest, free of the library's database
    (OCR'd pages go through their own cache file)."""
    try:
        extracted = extract_file(path, options=options)
        if options is not None and options.on_step is not None:
            options.on_step("describe", 0, 0)
        meta = extract_metadata(extracted, path)
        chunks = chunk_document(extracted)
        if len(chunks) > document_limit("KB_MAX_CHUNKS"):
            raise FileRejected(
                STATUS_ERROR,
                "too_large",
                f"the document makes {len(chunks)} passages, more than "
                f"{document_limit('KB_MAX_CHUNKS')} (KB_MAX_CHUNKS)",
            )
        references = document_references(extracted)
        links = link_chunk_citations(chunks, references, extracted.numbered_references)
        if not chunks:
            raise FileRejected(STATUS_SKIPPED, "no_text", "no indexable text (only front matter or references?)")
    except FileRejected as rejected:
        return PreparedFile(rejected=(rejected.status, rejected.reason, rejected.message))
    except MemoryError:
        raise
    except Exception as exc:  # a parser bug must not stop the batch
        return PreparedFile(failure=f"could not extract text: {type(exc).__name__}: {_short_error(exc)}")
    return PreparedFile(
        meta=meta,
        chunks=chunks,
        references=references,
        links=links,
        pages=extracted.pages,
        page_labels=extracted.page_labels,
        coverage=page_coverage(extracted, chunks),
        ocr_pages=extracted.ocr_pages,
        ocr_capped=extracted.ocr_capped,
        ocr_timed_out=extracted.ocr_timed_out,
        notes=extracted.notes,
    )


def triage_file(lib: Library, path: str, explicit: bool, force: bool) -> FileEntry | PendingFile:
    """The cheap checks (stat, hash, same content elsewhere): a finished entry, or the file's pending work."""
    started = time.perf_counter()
    kind = SUPPORTED_SUFFIXES.get(Path(path).suffix.lower())
    try:
        stat = os.stat(path)
    except ValueError:  # a NUL byte: no file can have this name
        return _file_entry(
            path,
            STATUS_ERROR,
            started,
            reason="bad_path",
            error="the path contains a NUL byte, which no file name can hold",
        )
    except FileNotFoundError:
        return _file_entry(path, STATUS_ERROR, started, reason="not_found", error="no such file or folder")
    except OSError as exc:
        return _file_entry(path, STATUS_ERROR, started, reason="unreadable", error=_short_error(exc))
    if not stat_module.S_ISREG(stat.st_mode):
        return _file_entry(
            path,
            STATUS_ERROR,
            started,
            reason="not_a_file",
            error="not a regular file (a named pipe, device or socket cannot be read as a document)",
        )
    if kind is None:
        return _file_entry(
            path,
            STATUS_ERROR,
            started,
            reason="unsupported",
            error=f"unsupported file type; supported: {', '.join(sorted(SUPPORTED_SUFFIXES))}",
        )
    row = lib.doc_by_path(path)
    # An older parser revision does not make a file "changed": stats reports it as stale and
    # ingest {rebuild: true} (or force) re-parses it, so an everyday ingest stays fast.
    kept = row if row is not None and not force else None  # the stored document, when it may still hold
    if kept is not None and kept["status"] == "duplicate" and _original_row(lib, kept) is None:
        kept = None  # an orphaned duplicate record: read afresh
    if kept is not None and kept["size"] == stat.st_size and kept["mtime_ns"] == stat.st_mtime_ns:
        if kept["status"] == "duplicate" and _original_is_gone(lib, kept):
            return _take_over_original(lib, path, stat, kept, kind, started)
        return _stored_outcome(kept, started)
    try:
        sha = sha256_of_file(path)
    except OSError as exc:
        return _file_entry(path, STATUS_ERROR, started, reason="unreadable", error=_short_error(exc))
    if kept is not None and kept["sha256"] == sha:
        with lib.transaction():
            lib.set_doc_stat(kept["id"], stat.st_size, stat.st_mtime_ns)
        if kept["status"] == "duplicate" and _original_is_gone(lib, kept):
            return _take_over_original(lib, path, stat, kept, kind, started)
        return _stored_outcome(kept, started)
    twin = _indexed_twin(lib, path, sha)
    if twin is not None:
        return _ingest_twin(lib, path, stat, sha, kind, row, twin, started)
    return PendingFile(path, stat, sha, kind, started)


def _indexed_twin(lib: Library, path: str, sha: str) -> sqlite3.Row | None:
    return next((d for d in lib.docs_by_sha(sha) if d["path"] != path_key(path) and d["status"] == "indexed"), None)


def store_prepared(lib: Library, pending: PendingFile, prepared: PreparedFile) -> FileEntry:
    """Commit a read file in one transaction (or record it as a twin of a file stored since it was checked)."""
    row = lib.doc_by_path(pending.path)
    twin = _indexed_twin(lib, pending.path, pending.sha)
    if twin is not None:  # an identical file earlier in the same batch was stored meanwhile
        return _ingest_twin(lib, pending.path, pending.stat, pending.sha, pending.kind, row, twin, pending.started)
    return _ingest_content(lib, pending, row, prepared)


def _original_row(lib: Library, row: sqlite3.Row) -> sqlite3.Row | None:
    """The indexed document a recorded duplicate stands for (None once it was deleted)."""
    if row["duplicate_of"] is None:
        return None
    return lib.original_file(row["duplicate_of"])


def _original_is_gone(lib: Library, row: sqlite3.Row) -> bool:
    original = _original_row(lib, row)
    return original is not None and _gone_original(original, row)


def _gone_original(original: sqlite3.Row, row: sqlite3.Row) -> bool:
    """Whether a recorded duplicate's original is still the indexed copy of its content and its file is gone (not
    merely out of reach: a locked folder)."""
    return (
        original["status"] == "indexed"
        and original["sha256"] == row["sha256"]
        and path_state(fs_path(original))[0] == "gone"
    )


def _take_over_original(
    lib: Library, path: str, stat, row: sqlite3.Row, kind: str, started: float
) -> FileEntry | PendingFile:
    """A recorded duplicate whose original file was deleted inherits the original's chunks. Checked again inside
    the transaction: since the first check another engine may have removed the original, or its file come back."""
    with lib.transaction():
        original = lib.doc_by_id(row["duplicate_of"])
        if original is not None and _gone_original(original, row):
            lib.delete_doc_record(row["id"])
            return _move_document(lib, original, path, stat, started)
        if original is None:
            lib.delete_doc_record(row["id"])  # an orphaned record: nothing is left to inherit
    if original is None:
        return PendingFile(path, stat, row["sha256"], kind, started)  # read afresh
    return _stored_outcome(row, started)  # the original is back: this file stays its duplicate


def _move_document(lib: Library, doc: sqlite3.Row, path: str, stat, started: float) -> FileEntry:
    """Point an indexed document at its new path (inside the caller's transaction); its chunks stay."""
    lib.move_doc(doc["id"], path, stat.st_size, stat.st_mtime_ns)
    lib.invalidate_cache()
    entry = _file_entry(path, STATUS_MOVED, started, doc["chunk_count"], doc["title"], reason="moved")
    entry["moved_from"] = doc["path"]
    return entry


def _ingest_twin(lib: Library, path: str, stat, sha: str, kind: str, row, twin, started: float) -> FileEntry:
    """Same content as an indexed document: a move when the old path is gone, else a duplicate."""
    with lib.transaction():
        if row is None and path_state(fs_path(twin))[0] == "gone":  # out of reach is not moved away
            return _move_document(lib, twin, path, stat, started)
        if row is not None:
            lib.delete_chunks(row["id"])
            lib.invalidate_cache()
        lib.upsert_doc(
            path,
            {
                "kind": kind,
                "status": "duplicate",
                "reason": "same_content",
                "error": f"same content as {twin['path']}",
                "title": twin["title"],
                "sha256": sha,
                "size": stat.st_size,
                "mtime_ns": stat.st_mtime_ns,
                "chunk_count": 0,
                "duplicate_of": twin["id"],
                "indexed_with": PARSER_REVISION,
                "indexed_at": now_iso(),
            },
        )
    return _file_entry(
        path, STATUS_DUPLICATE, started, 0, twin["title"], "same_content", f"same content as {twin['path']}"
    )


def _ingest_content(lib: Library, pending: PendingFile, row, prepared: PreparedFile) -> FileEntry:
    path, stat, started = pending.path, pending.stat, pending.started
    base = {
        "kind": pending.kind,
        "sha256": pending.sha,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "indexed_with": PARSER_REVISION,
        "indexed_at": now_iso(),
        "duplicate_of": None,
    }
    if prepared.failure is not None:  # nothing is stored, so a retry re-reads the file
        return _file_entry(path, STATUS_ERROR, started, reason="extract_failed", error=prepared.failure)
    if prepared.rejected is not None:
        status, reason, message = prepared.rejected
        with lib.transaction():
            if row is not None:
                lib.delete_chunks(row["id"])
                lib.invalidate_cache()
            lib.upsert_doc(
                path,
                {
                    **base,
                    "status": "error" if status == STATUS_ERROR else "skipped",
                    "reason": reason,
                    "error": message,
                    "title": Path(path).stem,
                    "chunk_count": 0,
                    "pages": None,
                },
            )
        return _file_entry(path, status, started, 0, Path(path).stem, reason, message)
    meta, chunks = prepared.meta, prepared.chunks
    if meta is None:  # prepare_file sets meta whenever it neither failed nor rejected the file
        return _file_entry(
            path, STATUS_ERROR, started, reason="extract_failed", error="the reader returned no metadata"
        )
    if row is not None and row["zotero_key"]:
        meta = DocMeta.from_row(row, lang=meta.lang)
        base["zotero_version"] = None  # annotations are re-read from Zotero on its next import
    with lib.transaction():
        doc_id = lib.upsert_doc(
            path,
            {
                **base,
                "status": "indexed",
                "reason": None,
                "error": None,
                "title": meta.title,
                "authors": json.dumps(meta.authors, ensure_ascii=False),
                "title_key": title_key(meta.title),
                "first_author_key": surname_key(meta.authors[0]) if meta.authors else None,
                "year": meta.year,
                "journal": meta.journal,
                "doi": meta.doi,
                **meta.bib_columns(),
                "lang": meta.lang,
                "pages": prepared.pages,
                "chunk_count": len(chunks),
                "page_labels": json.dumps(prepared.page_labels) if any(prepared.page_labels) else None,
                "page_coverage": json.dumps(prepared.coverage) if prepared.coverage else None,
                "metadata_source": row["metadata_source"]
                if row is not None and row["zotero_key"]
                else json.dumps(dict.fromkeys(METADATA_FIELDS, "extracted")),
            },
        )
        lib.delete_chunks(doc_id)
        chunk_ids = lib.insert_chunks(doc_id, chunks, meta.title)
        lib.replace_references(doc_id, prepared.references, chunk_ids, prepared.links)
        lib.invalidate_cache()
    status = STATUS_UPDATED if row is not None else STATUS_ADDED
    entry = _file_entry(path, status, started, len(chunks), meta.title)
    if prepared.ocr_pages:
        entry["ocr_pages"] = len(prepared.ocr_pages)
    notes = [page_coverage_note(prepared.coverage)]
    if prepared.ocr_timed_out:
        notes.append(
            f"{prepared.ocr_timed_out} pages without a text layer were left out: their OCR ran past "
            f"KB_OCR_PAGE_SECONDS ({document_limit('KB_OCR_PAGE_SECONDS')}); ingest with force and a "
            "longer limit reads them"
        )
    if prepared.ocr_capped:
        notes.append(
            f"{prepared.ocr_capped} more pages without a text layer were not OCR'd: past "
            f"KB_OCR_MAX_PAGES ({document_limit('KB_OCR_MAX_PAGES')}); the OCR'd pages are searchable"
        )
    notes.extend(prepared.notes)
    if any(notes):
        entry["note"] = "; ".join(n for n in notes if n)
    return entry


def vectors_not_computed(missing: int, reason: ModelUnavailable) -> dict:
    if isinstance(reason, UnusableEmbeddings):
        return {"vectors_written": 0, "vectors_missing": missing, "note": refused_vectors_note(str(reason), missing)}
    return {
        "vectors_written": 0,
        "vectors_missing": missing,
        "note": f"vectors not computed: {reason}. Keyword search works; {offline_model_remedy()}",
    }


def refused_vectors_note(reason: str, missing: int) -> str:
    return (
        f"vectors refused: {reason}. Nothing was stored for them; {missing} passages are without a vector, and "
        "keyword search finds them. Ingest or reembed encodes them once the model is repaired or replaced"
    )


def storable_vectors(
    embedder: Embedder, batch: list[tuple[int, str]], prompt: str
) -> tuple[list[int], Any, UnusableEmbeddings | None]:
    """The chunk ids and vectors of a (chunk id, text) batch that may be stored, and the refusal of the others."""
    ids = [chunk_id for chunk_id, _ in batch]
    try:
        return ids, embedder.encode_passages([text for _, text in batch], prompt), None
    except UnusableEmbeddings as refused:
        keep = [i for i, usable in enumerate(refused.usable) if usable]
        return [ids[i] for i in keep], refused.vectors[keep], refused


def embed_missing_chunks(
    lib: Library, models: Models, progress: Callable[[dict], None] | None, may_download: bool = True
) -> dict:
    """Encode every chunk without a vector (new chunks, or ones stored while no model was available). Vectors the
    model gets wrong are refused (see unusable_rows): the answer says so, and the library remembers why."""
    missing = lib.count_missing_vectors()
    if not missing:
        lib.record_vector_refusal("", None)
    if not missing or embeddings_disabled(models):
        return {"vectors_written": 0, "vectors_missing": missing}
    recorded, _ = lib.vector_model()
    try:
        embedder = models.embedder(may_download=may_download)
    except ModelUnavailable as exc:
        return vectors_not_computed(missing, exc)
    if recorded is not None and recorded != embedder.model_id:
        return {
            "vectors_written": 0,
            "vectors_missing": missing,
            "note": f"vectors not computed: the library's vectors were made with {recorded}, the configured "
            f"model is {embedder.model_id}; run reembed to re-encode the library with it",
        }
    written = 0
    passage_format = lib.passage_format() or PASSAGE_FORMAT
    prompt = library_passage_prompt(lib, embedder)
    pending = lib.chunk_ids_missing_vectors()  # shortest first: batches of similar length pad little
    refusal: UnusableEmbeddings | None = None
    for start in range(0, len(pending), 256):
        batch = embedding_inputs(lib.chunk_passages(pending[start : start + 256]), passage_format)
        if not batch:
            continue
        ids, matrix, refused = storable_vectors(embedder, batch, prompt)
        if ids:
            lib.store_model_vectors(embedder.model_id, embedder.dim, ids, matrix, passage_format, prompt)
        written += len(ids)
        refusal = refused or refusal
        if progress:
            progress({"phase": "embed", "done": written, "total": missing})
        if refused is not None and not ids:
            break  # not one usable vector in a whole batch: the model is broken, the rest would be too
    left = lib.count_missing_vectors()
    result = {"vectors_written": written, "vectors_missing": left, "model": embedder.model_id}
    lib.record_vector_refusal(embedder.model_id, str(refusal) if refusal is not None else None)
    if refusal is not None:
        result["note"] = refused_vectors_note(str(refusal), left)
    return result


def _docs_under(lib: Library, paths: list[str] | None, statuses: tuple[str, ...]) -> list[sqlite3.Row]:
    """Library documents with these statuses, all of them or those at/under the given paths."""
    rows = lib.docs_with_statuses(statuses)
    if not paths:
        return rows
    prefixes = [path_key(os.path.abspath(os.path.expanduser(p))) for p in paths]
    return [r for r in rows if any(_inside(r["path"], p) for p in prefixes)]


def _ingest_paths(payload: dict, required: bool) -> list[str] | None:
    paths = payload.get("paths", payload.get("path"))
    if paths is None and not required:
        return None
    if isinstance(paths, str):
        paths = [paths]
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p for p in paths):
        raise KBError("bad_request", "paths must be a non-empty list of file or folder paths")
    return paths


def ingest_pending(lib: Library, payload: dict) -> tuple[int, int]:
    """(files that need work, files considered) for an ingest request, judged by path, size and mtime only."""
    paths = _ingest_paths(payload, required=not payload.get("rebuild"))
    if payload.get("rebuild"):
        rows = _docs_under(lib, paths, ("indexed", "skipped", "error"))
        return len(rows), len(rows)
    force, pending, files = bool(payload.get("force")), 0, list(collect_files(paths or [], lib.root))
    for path, _ in files:
        row = lib.doc_by_path(path)
        try:
            stat = os.stat(path)
        except (OSError, ValueError):
            continue
        if force or row is None or row["size"] != stat.st_size or row["mtime_ns"] != stat.st_mtime_ns:
            pending += 1
    return pending, len(files)
