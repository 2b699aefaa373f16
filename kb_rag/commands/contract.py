"""Host contract: what the DSH plugin and the MCP server offer a model (each kb_* tool's schema, checks and hints,
the guidance text), made from the commands' own fields and rules.

May import: answers.search, commands.core, commands.library, commands.show, config, reading.ocr, rendering.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..answers.search import MAX_RENDERINGS, RAG_TOP_K, SEARCH_DEPTHS, SEARCH_MODES
from ..commands.core import INGEST_RULES, STATUS_RULES
from ..commands.library import CLEAR_RULES
from ..commands.show import SHOW_RULES
from ..config import DEFAULT_TOP_K, MAX_FILTER_VALUES, SUPPORTED_SUFFIXES, __version__
from ..reading.ocr import OCR_MODES
from ..rendering import HOST_RENDER_BUDGET, MIN_RENDER_BUDGET

HOST_CONTRACT_VERSION = 1


HOST_TOP_K = 50  # the most passages a tool returns at once (the engine itself accepts MAX_TOP_K)


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
    return {
        "oneOf": [{"type": "string", **item}, {"type": "array", "items": {"type": "string", **item}}],
        "description": description,
    }


def _filters_schema() -> dict:
    kinds = list(dict.fromkeys(SUPPORTED_SUFFIXES.values()))
    properties = {
        "authors": _string_or_strings('Author name or part of it, e.g. "chen"'),
        "title": _string_or_strings("Part of the document title"),
        "journal": _string_or_strings("Part of the journal name (often unknown outside Zotero imports)"),
        "year": {
            "oneOf": [{"type": "integer"}, {"type": "string"}],
            "description": 'A year (2019) or an inclusive range "2015-2020" (open: "2015-", "-2020")',
        },
        "section": _string_or_strings(
            'Part of the section label, or a kind of section: "methods" also finds '
            "Method, Methodology, Experimental (results, discussion, conclusion, "
            "introduction, abstract likewise)"
        ),
        "doi": _string_or_strings("Part of the DOI"),
        "kind": _string_or_strings("File kind", enum=kinds),
        "path": _string_or_strings("Part of the file path"),
        "collection": _string_or_strings(
            'A Zotero collection, by its whole name or path ("Graphene", '
            '"Materials/Graphene"); a collection covers its sub-collections'
        ),
        "tag": _string_or_strings("A whole Zotero tag (any case)"),
        "library": _string_or_strings(
            "A Zotero library by its whole name: \"My Library\" (the user's own) or a group library's name"
        ),
    }
    return {
        "type": "object",
        "additionalProperties": False,
        "description": "Metadata filters, combined with AND; a list matches any of its values (at most "
        f"{MAX_FILTER_VALUES}). Text filters match case-insensitive substrings; collection and "
        "tag match whole names.",
        "properties": properties,
    }


def _retrieval_parameters(default_top_k: int, default_depth: str) -> dict:
    return {
        "query": _string("The question as the user asked it, in the user's language"),
        "queries": _strings(
            f"1-{MAX_RENDERINGS} renderings of the same question, searched alongside query: one "
            "sentence stating the answer as the paper would (declarative, in its terms, the unknown "
            "value left out), in the language most of the library is written in (usually English); "
            "a sentence helps more than a keyword list"
        ),
        "top_k": _integer(f"Number of passages, 1-{HOST_TOP_K} (default {default_top_k})"),
        "mode": _string("Ranking: hybrid (default) fuses keyword and vector search", enum=list(SEARCH_MODES)),
        "depth": _string(
            f"quick skips reranking and citation linking; deep reranks and resolves citations "
            f"(default {default_depth})",
            enum=list(SEARCH_DEPTHS),
        ),
        "filters": _filters_schema(),
        "pictures": _integer(
            f"Also attach the first N PDF passages (0-{HOST_PICTURES}) highlighted on their page as "
            "images, for a model that reads images or a user who wants to see them (default 0)"
        ),
    }


HOST_PICTURES = 3  # pictures a host tool may ask for (each is an image of up to 640 pixels wide)


RETRIEVAL_CHECKS = (
    {"rule": "not_blank", "field": "query", "message": "query must be a non-empty string of search terms"},
    {
        "rule": "range",
        "field": "top_k",
        "min": 1,
        "max": HOST_TOP_K,
        "message": f"top_k must be between 1 and {HOST_TOP_K}",
    },
    {
        "rule": "max_items",
        "field": "queries",
        "max": MAX_RENDERINGS,
        "message": f"queries takes at most {MAX_RENDERINGS} renderings",
    },
    {
        "rule": "range",
        "field": "pictures",
        "min": 0,
        "max": HOST_PICTURES,
        "message": f"pictures must be between 0 and {HOST_PICTURES}",
    },
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
    path_fields: tuple[str, ...] = ()  # relative paths in these are taken from the host's workspace
    read_only: bool = False
    destructive: bool = False
    idempotent: bool = False
    open_world: bool = False
    timeout_minutes: int | None = None  # how long a host lets the call run (None: the host's default)
    fixed: tuple[tuple[str, Any], ...] = ()  # request fields a host always adds (kb_show: inline pictures)

    def as_json(self) -> dict:
        schema: dict[str, Any] = {"type": "object", "properties": self.parameters}
        if self.required:
            schema["required"] = list(self.required)
        tool: dict[str, Any] = {
            "name": self.name,
            "command": self.command,
            "title": self.title,
            "description": self.description,
            "input_schema": schema,
            "checks": list(self.checks),
            "path_fields": list(self.path_fields),
            "annotations": {
                "title": self.title,
                "readOnlyHint": self.read_only,
                "destructiveHint": self.destructive,
                "idempotentHint": self.idempotent,
                "openWorldHint": self.open_world,
            },
        }
        if self.timeout_minutes is not None:
            tool["timeout_minutes"] = self.timeout_minutes
        if self.fixed:
            tool["fixed"] = dict(self.fixed)
        return tool


HOST_TOOLS = (
    HostTool(
        "kb_ingest",
        "ingest",
        "Add papers to the library",
        "Add papers (PDF, DOCX, TXT, Markdown files or folders) to the local knowledge base, or refresh documents "
        "already in it. Large batches run as a background job: follow it with kb_status.",
        {
            "paths": _strings(
                "Files or folders; relative paths are taken from the workspace. Required unless "
                "metadata_only or rebuild is set"
            ),
            "force": _flag("Re-read files even when unchanged"),
            "ocr": _string(
                "OCR for PDF pages without a usable text layer (scans): auto (default, when the OCR extra "
                "is installed), off, or force (every page)",
                enum=list(OCR_MODES),
            ),
            "metadata_only": _flag("Only refresh title, authors, year, journal and DOI of documents already indexed"),
            "rebuild": _flag("Re-parse documents already indexed (after an engine upgrade)"),
            "verify_metadata": _flag(
                "Also check the title, authors, year and DOI of each document at Crossref "
                "(sends only its DOI, or its title when it has none). Off by default: use it "
                "only when the user asks for it"
            ),
        },
        checks=INGEST_RULES,
        path_fields=("paths",),
        idempotent=True,
        timeout_minutes=30,
    ),
    HostTool(
        "kb_zotero",
        "zotero",
        "Import the Zotero library",
        "Import the user's Zotero library (attachments with metadata, annotations, collections and tags) into the "
        "knowledge base. Large imports run as a background job: follow it with kb_status.",
        {
            "zotero_db": _string("Path of zotero.sqlite or its folder (default: found in the usual places)"),
            "base_dir": _string("Zotero's linked attachment base directory, when linked files use one"),
            "dry_run": _flag("Only list what would be imported"),
            "force": _flag("Re-parse every attachment even when unchanged"),
            "ocr": _string(
                "OCR for PDF pages without a usable text layer (scans): auto (default, when the OCR extra "
                "is installed), off, or force (every page)",
                enum=list(OCR_MODES),
            ),
            "limit": _integer("Import only the first N attachments (0 = all)"),
        },
        checks=(
            {"rule": "range", "field": "limit", "min": 0, "message": "limit must be 0 (all) or a positive number"},
        ),
        path_fields=("zotero_db", "base_dir"),
        idempotent=True,
        timeout_minutes=30,
    ),
    HostTool(
        "kb_search",
        "search",
        "Search the paper library",
        "Search the local paper library for passages (fast hybrid keyword and vector search). Returns verbatim "
        "snippets with title, authors, year, section, page and DOI.",
        _retrieval_parameters(DEFAULT_TOP_K, "quick"),
        required=("query",),
        checks=RETRIEVAL_CHECKS,
        read_only=True,
        idempotent=True,
        timeout_minutes=10,
    ),
    HostTool(
        "kb_rag",
        "rag",
        "Gather evidence from the library",
        "Gather evidence from the local paper library to answer a question: reranked passages with the works they "
        "cite, related papers and answering guidance. Slower than kb_search; use it for in-depth answers.",
        _retrieval_parameters(RAG_TOP_K, "deep"),
        required=("query",),
        checks=RETRIEVAL_CHECKS,
        read_only=True,
        idempotent=True,
        timeout_minutes=10,
    ),
    HostTool(
        "kb_show",
        "show",
        "Show a passage on its page",
        "Show a kb_search or kb_rag passage on its PDF page, highlighted, as an image. Pass the hit's doc_id, page, "
        "char_start, char_end and page_end as the hit gave them, or a figure label from its captions.",
        {
            "doc_id": _integer("The hit's doc_id"),
            "page": _integer("The hit's page"),
            "char_start": _integer("The hit's char_start"),
            "char_end": _integer("The hit's char_end"),
            "page_end": _integer("The hit's page_end"),
            "figure": _string(
                'A figure or table label from the hit\'s captions ("Figure 3"), to show that figure '
                "instead of the passage"
            ),
            "crop": _flag("false shows the whole page; by default the passage's column with some context"),
        },
        required=("doc_id",),
        checks=SHOW_RULES,
        read_only=True,
        idempotent=True,
        fixed=(("inline", True),),
    ),
    HostTool(
        "kb_scope",
        None,
        "Session answering scope",
        "Show or change where answers come from in this session: kb (the library), both (library and web) or web, "
        "and whether strict library-only answering is on.",
        {
            "scope": _string("kb, both or web; leave out to keep the current one", enum=list(SESSION_SCOPES)),
            "strict": _flag("Answer only from the library, saying so when it has nothing"),
        },
        idempotent=True,
    ),
    HostTool(
        "kb_dedup",
        "dedup",
        "Find duplicate documents",
        "Find documents in the library that are copies of one work (same DOI, or same title and year). With "
        "apply: true keep one per group; only when the user agrees.",
        {"apply": _flag("Keep one document per group and mark the others as duplicates")},
        destructive=True,
        idempotent=True,
    ),
    HostTool(
        "kb_clear",
        "clear",
        "Empty the library index",
        "Remove every document from the knowledge base index (the files themselves are kept). Only when the user "
        "explicitly asks for it.",
        {"confirm": _flag("Must be true: the user asked to clear the library")},
        required=("confirm",),
        checks=CLEAR_RULES,
        destructive=True,
        idempotent=True,
    ),
    HostTool(
        "kb_stats",
        "stats",
        "Library statistics",
        "Summarise the knowledge base: documents, passages, vectors, languages, models, and documents that need a "
        "refresh.",
        {},
        read_only=True,
        idempotent=True,
    ),
    HostTool(
        "kb_fetch",
        "fetch",
        "Fetch a paper",
        "Download a paper by DOI, arXiv id or URL (publisher PDF first, open-access copy as fallback), save it in "
        "the library's papers folder and index it.",
        {
            "identifier": _string("DOI (10.1234/abc), arXiv id (2301.05883) or http(s) URL of the paper"),
            "dest": _string(
                "Folder to save the PDF in; relative paths are taken from the workspace (default: the "
                "library's papers folder)"
            ),
        },
        required=("identifier",),
        checks=(
            {
                "rule": "not_blank",
                "field": "identifier",
                "message": "identifier must be a DOI, an arXiv id or an http(s) URL",
            },
        ),
        path_fields=("dest",),
        open_world=True,
        timeout_minutes=5,
    ),
    HostTool(
        "kb_watch",
        "watch",
        "Watch folders for new papers",
        "Keep folders of papers in step with the library: while the engine runs, papers added, changed, moved or "
        "deleted there are indexed or removed by themselves. Add or remove folders, or list them with their state "
        "and last sync.",
        {
            "add": _strings("Folders to watch; relative paths are taken from the workspace"),
            "remove": _strings("Watched folders to stop watching (their papers stay in the library)"),
            "confirm": _flag(
                "true only after the user confirmed watching a folder this large, when a call without it "
                "failed with confirm_required"
            ),
        },
        path_fields=("add", "remove"),
        idempotent=True,
    ),
    HostTool(
        "kb_status",
        "status",
        "Background job status",
        "Check the background jobs started by kb_ingest or kb_zotero: state, progress, result and errors. Give "
        "job_id for one job; cancel: true stops it.",
        {
            "job_id": _string("The job_id returned by kb_ingest or kb_zotero; leave out to list recent jobs"),
            "cancel": _flag("Ask the job to stop after the file in flight (needs job_id)"),
        },
        checks=STATUS_RULES,
        read_only=True,
        idempotent=True,
    ),
)


# One system-prompt section for every host. A line that names `needs` is shown only by a host offering that tool.
HOST_GUIDANCE_HEADING = "## Local paper library (kb_* tools)"


HOST_GUIDANCE = (
    {
        "text": "kb_search is the quick lookup; kb_rag gathers reranked evidence for a full answer. Both return "
        "verbatim passages with title, authors, year, section, page and DOI."
    },
    {
        "text": "Pass the question as query and, in queries, one sentence stating the answer the way the paper "
        'would ("The four mass measurements are compatible with a common mass, with a p-value of"), in '
        "its terms: it finds the right page more often than the question alone, a keyword list does not. "
        "Keyword matching cannot cross languages and most libraries are in English: when the user asks in "
        "another language, write that sentence in English; answer in the language the user asked in. Put "
        "years, authors, sections and Zotero collections in filters, not in the query."
    },
    {
        "text": "Cite each statement taken from the library as (first author, year, section, p. N) with its DOI link "
        "when there is one. Never cite a passage you were not given."
    },
    {
        "text": "Follow the session scope printed with the results: kb answers from the library, both allows web "
        "sources marked as such, web prefers the web. In strict mode say plainly when the library does not "
        "answer. Change it with kb_scope only when the user asks.",
        "needs": "kb_scope",
    },
    {
        "text": "kb_fetch downloads a paper by DOI, arXiv id or URL into the library and indexes it; use it when the "
        "user wants a paper added that is not in the library."
    },
    {
        "text": "kb_ingest and kb_zotero may return a job_id: follow it with kb_status until it is done before "
        "relying on the new documents."
    },
    {"text": "kb_clear and kb_dedup with apply change the library: use them only when the user asks."},
)


def host_contract() -> dict:
    """The host contract as JSON data (see above); ``contract`` answers it and host-contract.json holds it."""
    return {
        "contract": HOST_CONTRACT_VERSION,
        "engine_version": __version__,
        "tools": [tool.as_json() for tool in HOST_TOOLS],
        "guidance": {"heading": HOST_GUIDANCE_HEADING, "lines": [dict(line) for line in HOST_GUIDANCE]},
        "rendering": {"budget": HOST_RENDER_BUDGET, "min_budget": MIN_RENDER_BUDGET},
    }


def host_contract_text() -> str:
    """host-contract.json's exact text."""
    return json.dumps(host_contract(), indent=2, ensure_ascii=False, allow_nan=False) + "\n"
