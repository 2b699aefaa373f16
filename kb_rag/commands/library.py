"""Library commands: docs, stats, dedup, clear, delete and reembed, with their request fields.

May import: answers.search, config, ingest.files, models.registry, models.runtime, reading.chunking,
reading.printed, records, storage.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..answers.search import embeddings_disabled
from ..config import (
    EMPTY_LIBRARY_NOTE,
    KB_ROOT_FIELD,
    PARSER_REVISION,
    SWITCH,
    Field,
    Flag,
    KBError,
    _opt_bool,
    _opt_int,
    _opt_str,
    check_rules,
)
from ..ingest.files import embed_missing_chunks
from ..models.registry import Models
from ..models.runtime import PASSAGE_FORMAT, ModelUnavailable, local_model_path, model_id, model_prompts
from ..reading.chunking import page_coverage_note
from ..reading.printed import DEFAULT_WORK_TYPE
from ..records import DocRecord, DocsResponse
from ..storage import Library, fs_path


def _doc_record(row: sqlite3.Row) -> DocRecord:
    return {
        "doc_id": row["id"],
        "path": row["path"],
        "file": Path(row["path"]).name,
        "kind": row["kind"],
        "status": row["status"],
        "reason": row["reason"],
        "error": row["error"],
        "title": row["title"],
        "authors": json.loads(row["authors"] or "[]"),
        "year": row["year"],
        "journal": row["journal"],
        "doi": row["doi"],
        "work_type": row["work_type"] or DEFAULT_WORK_TYPE,
        "volume": row["volume"],
        "issue": row["issue"],
        "page_range": row["page_range"],
        "publisher": row["publisher"],
        "report_number": row["report_number"],
        "arxiv_id": row["arxiv_id"],
        "authors_more": bool(row["authors_more"]),
        "chunks": row["chunk_count"],
        "pages": row["pages"],
        "lang": row["lang"],
        "size": row["size"],
        "sha256": row["sha256"],
        "duplicate_of": row["duplicate_of"],
        "indexed_at": row["indexed_at"],
        "exists": os.path.exists(fs_path(row)),
        "page_coverage": json.loads(row["page_coverage"]) if row["page_coverage"] else None,
        "metadata_source": json.loads(row["metadata_source"]) if row["metadata_source"] else None,
        "zotero_library": row["zotero_library"],
    }


DOCS_FIELDS = (
    Field("limit", "integer", "`100`", "how many documents to return, 1 to 100000"),
    Field("offset", "integer", "`0`", "how many to skip first"),
    Field(
        "status",
        "string",
        "none",
        "only documents with this stored status (`indexed`, `skipped`, `error`, `duplicate`)",
    ),
    KB_ROOT_FIELD,
)


def cmd_docs(lib: Library | None, payload: dict) -> DocsResponse:
    limit = _opt_int(payload, "limit", 100, 1, 100_000)
    offset = _opt_int(payload, "offset", 0, 0, 10**9)
    status = _opt_str(payload, "status")
    if lib is None:
        return {"docs": [], "total": 0, "limit": limit, "offset": offset}
    total, rows = lib.docs_page(status, limit, offset)
    return {"docs": [_doc_record(r) for r in rows], "total": total, "limit": limit, "offset": offset}


def cmd_stats(lib: Library | None, kb_root: Path, models: Models) -> dict:
    configured = {
        "embedder": models.embed_name,
        "reranker": models.rerank_name,
        "rerank_fallback": models.rerank_fallback_name,
    }
    if lib is None:
        return {
            "kb_root": str(kb_root),
            "exists": False,
            "docs": 0,
            "chunks": 0,
            "vectors": 0,
            "vectors_missing": 0,
            "by_status": {},
            "schema_version": None,
            "models": configured,
            "device": models.device_report(),
            "note": EMPTY_LIBRARY_NOTE,
        }
    counts = lib.library_counts(PARSER_REVISION)
    by_status, langs = counts["by_status"], counts["langs"]
    size = sum(p.stat().st_size for p in (lib.db_path, Path(f"{lib.db_path}-wal")) if p.exists())
    embed_model, embed_dim = lib.vector_model()
    refusal = lib.vector_refusal()
    return {
        "kb_root": str(lib.root),
        "db_path": str(lib.db_path),
        "exists": True,
        "docs": sum(by_status.values()),
        "indexed_docs": by_status.get("indexed", 0),
        "by_status": by_status,
        "by_kind": counts["kinds"],
        "languages": langs,
        "dominant_language": max(langs, key=langs.__getitem__) if langs else None,
        "chunks": counts["chunks"],
        "vectors": counts["vectors"],
        "vectors_missing": lib.count_missing_vectors(),
        **({"vectors_refused": refusal} if refusal else {}),
        "embedding_model": embed_model,
        "embedding_dim": embed_dim,
        "models": configured,
        **vector_space_report(lib, models),
        "device": models.device_report(),
        "schema_version": lib.schema_version(),
        "parser_revision": PARSER_REVISION,
        "stale_docs": counts["stale"],
        "keyword_index": "fts5" if lib.has_fts5 else "python-bm25",
        "db_bytes": size,
        "page_coverage": library_page_coverage(lib),
    }


STATS_LISTED_DOCS = 20


def vector_space_report(lib: Library, models: Models) -> dict:
    """How the stored vectors were made from passages, the prompts in use, and what a ``reembed`` would change.
    Reads the model folder's settings only: nothing is loaded."""
    current, recorded_prompt = lib.passage_format(), lib.passage_prompt()
    name = models.embed_name
    configured = model_prompts(name, None if embeddings_disabled(models) else local_model_path(name))
    report = {
        "embedding_passage_format": current,
        "embedding_passage_prompt": recorded_prompt,
        "embedding_prompts": {"query": configured.query, "passage": configured.passage, "source": configured.source},
    }
    advice = []
    if current is not None and current != PASSAGE_FORMAT:
        advice.append(
            f"the vectors were made from passages in format {current}; reembed re-encodes them as "
            f"{PASSAGE_FORMAT} (title and section with each passage), which finds the right page more often"
        )
    if (
        recorded_prompt is not None
        and recorded_prompt != configured.passage
        and lib.vector_model()[0] == model_id(name)
    ):
        advice.append(
            f"the vectors were made with the passage prompt {recorded_prompt!r} but the model now asks for "
            f"{configured.passage!r}; new passages keep the library's prompt until reembed re-encodes "
            "them all with the new one"
        )
    if advice:
        report["reembed_advised"] = "; ".join(advice)
    return report


def library_page_coverage(lib: Library) -> dict:
    """Text pages of the library's PDFs with and without a passage, by reason, and the documents that lost
    pages (``docs`` lists every document's pages)."""
    reasons: dict[str, int] = {}
    totals: dict[str, Any] = {
        "text_pages": 0,
        "pages_with_chunks": 0,
        "without_chunks": reasons,
        "ocr_pages": 0,
        "ocr_docs": 0,
    }
    lost_docs = []
    for doc_id, path, raw in lib.indexed_page_coverage():
        coverage = json.loads(raw)
        totals["text_pages"] += coverage["text_pages"]
        totals["pages_with_chunks"] += coverage["pages_with_chunks"]
        for entry in coverage["without_chunks"]:
            reasons[entry["reason"]] = reasons.get(entry["reason"], 0) + 1
        if coverage.get("ocr_pages"):
            totals["ocr_pages"] += len(coverage["ocr_pages"])
            totals["ocr_docs"] += 1
        note = page_coverage_note(coverage)
        if note:
            lost_docs.append({"doc_id": doc_id, "path": path, "note": note})
    totals["docs_with_notes"] = len(lost_docs)
    totals["docs_listed"] = lost_docs[:STATS_LISTED_DOCS]
    return totals


def _normalised_title(title: str | None) -> str:
    return re.sub(r"[\W_]+", "", (title or "").lower())


DEDUP_FIELDS = (
    Field(
        "apply",
        "boolean",
        "`false`",
        "when true, keep one document per group and turn the others into `duplicate` records; when false, only report",
        cli=(Flag(("--apply",), "set the extra copies aside (default: list)", SWITCH),),
    ),
    KB_ROOT_FIELD,
)


def cmd_dedup(lib: Library | None, payload: dict) -> dict:
    """Find copies of one work: identical files, one DOI, or one title and year; ``apply`` removes extras."""
    apply = _opt_bool(payload, "apply")
    if lib is None:
        return {"groups": [], "removed": 0, "applied": apply, "recorded_duplicates": 0}
    indexed = lib.indexed_docs()
    recorded = lib.count_recorded_duplicates()
    groups: dict[tuple, list] = {}
    for key_name, key_of in (
        ("same_doi", lambda r: r["doi"]),
        (
            "same_title",
            lambda r: (_normalised_title(r["title"]), r["year"]) if len(_normalised_title(r["title"])) >= 20 else None,
        ),
    ):
        buckets: dict = {}
        for row in indexed:
            key = key_of(row)
            if key:
                buckets.setdefault(key, []).append(row)
        for key, members in buckets.items():
            if len(members) > 1 and not any(
                set(m["id"] for m in members) <= set(m["id"] for m in g) for g in groups.values()
            ):
                groups[(key_name, str(key))] = members
    removed = 0
    report = []
    for (reason, _), members in groups.items():
        keep = max((m for m in members if m["status"] == "indexed"), key=lambda m: (m["chunk_count"], -m["id"]))
        report.append(
            {
                "reason": reason,
                "keep": keep["id"],
                "docs": [
                    {
                        "doc_id": m["id"],
                        "path": m["path"],
                        "title": m["title"],
                        "status": m["status"],
                        "chunks": m["chunk_count"],
                    }
                    for m in members
                ],
            }
        )
        if apply:
            with lib.transaction():
                for member in members:
                    if member["id"] != keep["id"] and member["status"] == "indexed":
                        lib.delete_chunks(member["id"])
                        lib.mark_duplicate(
                            member["id"], reason, f"removed by dedup: same work as {keep['path']}", keep["id"]
                        )
                        removed += 1
                lib.invalidate_cache()
    # Identical files never get indexed twice; they are only counted here.
    return {"groups": report, "removed": removed, "applied": apply, "recorded_duplicates": recorded}


# Checked by the engine before it opens the library and again by the handler (it deletes everything), and by
# both hosts before they call it (kb_clear's checks).
CLEAR_RULES = (
    {
        "rule": "is_true",
        "field": "confirm",
        "code": "confirm_required",
        "message": "nothing was cleared: clear deletes every document of the library and needs `confirm: "
        "true`, given only once the user has asked to empty the library",
    },
)


CLEAR_FIELDS = (
    Field(
        "confirm",
        "boolean",
        "`false`",
        "must be `true`; otherwise the command fails with code `confirm_required` and nothing is deleted",
        cli=(Flag(("--yes",), "confirm deleting everything (required)", SWITCH),),
    ),
    KB_ROOT_FIELD,
)


def cmd_clear(lib: Library, payload: dict) -> dict:
    check_rules(CLEAR_RULES, payload)
    return {"cleared": lib.clear(), "kb_root": str(lib.root)}


DELETE_FIELDS = (
    Field(
        "paths",
        "array of strings, or one string",
        "`[]`",
        "documents by path; `~` is expanded and relative paths are made absolute. A path matches the document "
        "recorded at exactly that path and, taken as a folder, every document under it",
        cli=(Flag(("paths",), "files, or folders (everything under them)", {"nargs": "+", "metavar": "PATH"}),),
    ),
    Field("doc_ids", "array of integers", "`[]`", "documents by `doc_id`"),
    KB_ROOT_FIELD,
)


DELETE_RULES = ({"rule": "any_of", "fields": ["paths", "doc_ids"], "message": "give paths or doc_ids to delete"},)


def cmd_delete(lib: Library, payload: dict) -> dict:
    """Remove documents by path (a folder removes everything under it) or by doc_id."""
    paths = payload.get("paths", [])
    doc_ids = payload.get("doc_ids", [])
    if isinstance(paths, str):
        paths = [paths]
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        raise KBError("bad_request", "paths must be a list of file or folder paths")
    if not isinstance(doc_ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in doc_ids):
        raise KBError("bad_request", "doc_ids must be a list of integers")
    check_rules(DELETE_RULES, payload)
    targets: dict[int, str] = {}
    not_found = []
    for raw in paths:
        path = os.path.abspath(os.path.expanduser(raw))
        rows = lib.docs_at_or_under(path)
        if not rows:
            not_found.append(raw)
        targets.update((r[0], r[1]) for r in rows)
    for doc_id in doc_ids:
        row = lib.doc_path_by_id(doc_id)
        if row is None:
            not_found.append(doc_id)
        else:
            targets[row[0]] = row[1]
    chunks = 0
    with lib.transaction():
        for doc_id in targets:
            chunks += lib.count_chunks_of_doc(doc_id)
            lib.delete_doc(doc_id)  # recorded copies of it (duplicate_of -> NULL) get indexed by the next ingest
        lib.invalidate_cache()
    return {
        "deleted": [{"doc_id": i, "path": p} for i, p in targets.items()],
        "chunks_deleted": chunks,
        "not_found": not_found,
    }


def cmd_reembed(lib: Library, payload: dict, models: Models, progress: Callable[[dict], None] | None) -> dict:
    """Re-encode the whole library with the configured embedding model."""
    if embeddings_disabled(models):
        raise KBError("model_unavailable", "KB_EMBED_MODEL=none: there is no embedding model to re-encode with")
    try:
        embedder = models.embedder(may_download=True)
    except ModelUnavailable as exc:
        raise KBError("model_unavailable", str(exc)) from None
    previous, _ = lib.vector_model()
    with lib.transaction():
        lib.forget_vectors()
    result = embed_missing_chunks(lib, models, progress)
    return {
        "previous_model": previous,
        "model": embedder.model_id,
        "dim": embedder.dim,
        "vectors": result["vectors_written"],
        "vectors_missing": result["vectors_missing"],
    }
