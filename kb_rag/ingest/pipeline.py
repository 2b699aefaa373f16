"""Ingest pipeline: reader processes, the encoding thread, settled reads, the batch loop.

May import: answers.search, config, ingest.files, jobs, models.registry, models.runtime, reading.metadata,
reading.ocr, reading.readers, records, storage.
"""

from __future__ import annotations

import functools
import os
import sqlite3
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from ..answers.search import LibraryState, embeddings_disabled
from ..config import STATUS_ADDED, STATUS_ERROR, STATUS_UPDATED, FileRejected, _short_error, document_limit
from ..ingest.files import (
    PendingFile,
    PreparedFile,
    _docs_under,
    _file_entry,
    embed_missing_chunks,
    ingest_totals,
    prepare_file,
    storable_vectors,
    store_prepared,
    triage_file,
    vectors_not_computed,
)
from ..jobs import stop_if_cancelled
from ..models.registry import Models
from ..models.runtime import PASSAGE_FORMAT, Embedder, ModelUnavailable, UnusableEmbeddings, embedding_inputs
from ..reading.metadata import METADATA_FIELDS, extract_metadata
from ..reading.ocr import OCR_CACHE_FILENAME, ReadOptions, ocr_mode
from ..reading.readers import extract_file
from ..records import FileEntry, IngestResponse
from ..storage import DiskFull, Library, fs_path, is_disk_full

VECTOR_BATCH = 128  # chunks per encoding call: large enough for throughput, small enough to stream


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
        except Exception as exc:  # a parser bug must not end the process the next files need
            result = PreparedFile(failure=f"could not extract text: {type(exc).__name__}: {_short_error(exc)}")
        try:
            conn.send(("done", result))
        except (TypeError, ValueError, AttributeError) as exc:  # a result that cannot be pickled
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
            libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the line above: end now
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
        self.deaths = 0  # reader processes that died under this file

    def done(self) -> bool:
        return self.result is not None


class _ReaderProcess:
    """One reader process, the file it holds and the step it last said it began."""

    def __init__(self, context):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_reader_main, args=(child, os.getpid()), name="kb-reader", daemon=True)
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


READ_STEP_WORDS = {
    "start": "opening the file",
    "page": "page {number} of {total}",
    "ocr": "the OCR of page {number} of {total}",
    "describe": "describing the document",
}


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

    PROGRESS_POLL_S = 0.25  # how often a wait takes in what the reader processes report
    FILES_PER_PROCESS = 200  # a reader process is replaced after this many files (MuPDF keeps caches)
    START_FAILURES = 3  # reader processes dying before they are ready, in a row, before the files fail
    START_SECONDS = 120  # a process not ready by then (importing the engine takes a second or two) is dead

    def __init__(
        self,
        workers: int,
        read: Callable[..., PreparedFile] | None = None,
        options: ReadOptions | None = None,
        progress: Callable[[dict], None] | None = None,
    ):
        from collections import deque

        self.workers = workers
        self.read = read or prepare_file  # module-level, so a spawned process can import it
        options = options or ReadOptions()
        if workers > 1 and not options.ocr_threads:
            options = replace(options, ocr_threads=max(1, (os.cpu_count() or 1) // workers))
        self.options = options
        self.progress = progress
        self.queue: deque[ReadHandle] = deque()
        self.processes: list[_ReaderProcess] = []
        self.started = 0  # reader processes started, over the reader's life
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
            answered = [p.conn for p in waiting]  # a closed pipe: _take finds which
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
            process.process.join(1)  # for its exit code
            self.start_failures += 1
            if self.start_failures >= self.START_FAILURES:
                self._fail_queue(
                    f"reader processes die as they start (exit code {process.process.exitcode}); "
                    "KB_INGEST_WORKERS=0 reads files in the engine process"
                )
        if handle is None:
            return
        handle.deaths += 1
        if handle.deaths >= 2:
            handle.result = PreparedFile(
                failure="the file crashed the document reader (its process died, twice); the file is probably damaged"
            )
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
            if not process.ready and now - process.since > max(limit, self.START_SECONDS):  # never came up
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
            handle.result = PreparedFile(
                rejected=(
                    STATUS_ERROR,
                    "timed_out",
                    f"reading stopped: {what} took longer than KB_READ_SECONDS ({limit} s"
                    + (", plus KB_OCR_PAGE_SECONDS for OCR" if kind == "ocr" else "")
                    + "); a page that costs this "
                    "much is usually built to exhaust readers (drawings nested many levels deep); the library keeps "
                    "this entry until the file changes, and ingest with force tries again",
                )
            )

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


def refresh_metadata(
    lib: Library, paths: list[str] | None, progress: Callable[[dict], None] | None, workers: int = 0
) -> IngestResponse:
    """Re-read title, authors, year, journal and DOI of indexed documents (first pages only), in reader processes
    when there are any (each read under KB_READ_SECONDS); chunks, vectors and references stay as they are."""
    rows = [r for r in _docs_under(lib, paths, statuses=("indexed",)) if not r["zotero_key"]]  # Zotero's own win
    entries: list[FileEntry] = []
    reader = FileReader(workers, read=read_first_pages, options=ReadOptions(ocr="off"))
    try:
        handed: list[tuple[sqlite3.Row, PendingFile | None, ReadHandle | None]] = []
        for row in rows:
            try:
                file = PendingFile(
                    fs_path(row), os.stat(fs_path(row)), row["sha256"] or "", row["kind"], time.perf_counter()
                )
            except OSError:
                handed.append((row, None, None))
                continue
            handed.append((row, file, reader.submit(file)))
        for done, (row, pending, handle) in enumerate(handed, start=1):
            started = pending.started if pending is not None else time.perf_counter()
            if progress:
                progress({"phase": "metadata", "done": done, "total": len(rows), "path": row["path"]})
            if pending is None:
                entries.append(
                    _file_entry(
                        row["path"], STATUS_ERROR, started, 0, row["title"], "not_found", "no such file or folder"
                    )
                )
                continue
            read = reader.result(pending, handle)
            if read.meta is None:
                status, reason, message = read.rejected or (STATUS_ERROR, "extract_failed", read.failure or "")
                entries.append(_file_entry(row["path"], STATUS_ERROR, started, 0, row["title"], reason, message))
                continue
            meta = read.meta
            with lib.transaction():
                lib.set_doc_metadata(
                    row["id"],
                    meta.title,
                    meta.authors,
                    meta.year,
                    meta.journal,
                    meta.doi,
                    dict.fromkeys(METADATA_FIELDS, "extracted"),
                    meta.bib_columns(),
                )
                lib.reindex_headings(row["id"], meta.title)
            entries.append(
                _file_entry(row["path"], STATUS_UPDATED, started, row["chunk_count"], meta.title, "metadata")
            )
    finally:
        reader.close()
    return IngestResponse(
        files=entries, totals=ingest_totals(entries, written=False), kb_root=str(lib.root), metadata_only=True
    )


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
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.thread: Any = None  # the encoding thread, once started
        self.unavailable: ModelUnavailable | None = None
        self.refusal: UnusableEmbeddings | None = None  # vectors the model got wrong (see unusable_rows)
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
        except Exception as exc:  # the main thread's final pass reports it
            self.unavailable = ModelUnavailable(f"{type(exc).__name__}: {_short_error(exc)}")
            return
        if self.recorded is not None and self.recorded != embedder.model_id:
            return  # the final pass explains the mismatch
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
                buffer.sort(key=lambda item: len(item[1]))  # similar lengths pad little
                batch, buffer = buffer[:VECTOR_BATCH], buffer[VECTOR_BATCH:]
                try:
                    ids, matrix, refused = storable_vectors(embedder, batch, prompt)
                except Exception:
                    return  # left missing: the final pass (or the next ingest) encodes them
                if refused is not None:
                    self.refusal = refused
                    if not ids:  # a whole batch refused: the model is broken, and the answer says so
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
        lib.store_model_vectors(
            embedder.model_id, embedder.dim, [ids[i] for i in keep], matrix[keep], self.passage_format, prompt
        )
        self.written += len(keep)

    def finish(self, lib: Library, progress=None) -> None:
        if self.thread is None:
            return
        self.inbox.put(None)
        self.store_ready(lib, wait=True, progress=progress)
        self.thread.join()
        if self.refusal is not None and self.model_id is not None:  # the thread never touches the database
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
        self.note: str | None = None  # why vectors were left out (refused, or no model)
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
            elif not self.feeder._stop:  # whatever the feeder could not encode
                self.note = embed_missing_chunks(lib, self.models, None).get("note")
        except Exception as exc:  # left missing: the next ingest or reembed encodes them
            self.error = f"{type(exc).__name__}: {_short_error(exc)}"
        finally:
            self.state.vectors_coming = False
            lib.close()

    def running(self) -> bool:
        return self.thread.is_alive()

    def view(self) -> dict:
        return {
            "kb_root": str(self.root),
            "running": self.running(),
            "done": self.feeder.written,
            "total": max(self.feeder.fed, self.feeder.written),
            "error": self.error,
            **({"note": self.note} if self.note else {}),
        }

    def wait(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def stop(self, timeout: float) -> None:
        self.feeder.stop()
        self.thread.join(timeout)


READ_ATTEMPTS = 3  # reads of a file that keeps changing under the reader before it is reported


def _identity(st: os.stat_result) -> tuple:
    # ctime too: rewriting a file moves it even when the writer puts the old modification time back
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _unchanged_since(pending: PendingFile) -> bool:
    try:
        return _identity(os.stat(pending.path)) == _identity(pending.stat)
    except OSError:
        return False


def read_settled(
    lib: Library, reader: FileReader, pending: PendingFile, prepared: PreparedFile, force: bool
) -> FileEntry | tuple[PendingFile, PreparedFile]:
    """What was read, once the file is known not to have changed since it was checked: a file rewritten while it
    was read (or between its checksum and its reading) is checked and read again, up to READ_ATTEMPTS times, so
    that the text stored always belongs to the checksum and size stored. A file that never holds still gets an
    error entry and nothing is stored; the library keeps what it had."""
    for _ in range(READ_ATTEMPTS - 1):
        if _unchanged_since(pending):
            return pending, prepared
        again = triage_file(lib, pending.path, False, force)
        if not isinstance(again, PendingFile):
            return again  # gone, or back to what the library holds
        pending, prepared = again, reader.read_now(again)
    if _unchanged_since(pending):
        return pending, prepared
    return _file_entry(
        pending.path,
        STATUS_ERROR,
        pending.started,
        reason="changed_while_read",
        error=f"the file changed while it was read ({READ_ATTEMPTS} tries); nothing was stored and the "
        "library keeps what it had: ingest it again once it is written",
    )


def ocr_pages_only(progress: Callable[[dict], None] | None) -> Callable[[dict], None] | None:
    """``progress`` for the OCR page events alone (for the Zotero import, which counts its attachments itself)."""
    return (lambda event: progress(event) if event.get("phase") == "ocr" else None) if progress else None


def ingest_files(  # noqa: C901
    lib: Library,
    files: list[tuple[str, bool]],
    force: bool,
    progress,
    feeder: VectorFeeder | None,
    workers: int = 0,
    on_entry: Callable[[int, FileEntry], FileEntry] | None = None,
    ocr: str | None = None,
) -> list[FileEntry]:
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
    window: list[tuple[int, Any]] = []  # (index, a finished entry or [pending, handle]), in input order
    entries: list[FileEntry | None] = [None] * len(files)
    stored = 0
    in_flight: list[str] = []  # the file being stored when something fails

    def commit(index: int, item: Any) -> None:
        nonlocal stored
        entry: FileEntry
        if isinstance(item, dict):
            entry = cast(FileEntry, item)
        else:
            pending, handle = item
            in_flight[:] = [pending.path]
            settled = read_settled(lib, reader, pending, reader.result(pending, handle), force)
            if isinstance(settled, tuple):
                pending = settled[0]
                entry = store_prepared(lib, *settled)
            else:
                entry = settled
            if feeder is not None and entry["status"] in (STATUS_ADDED, STATUS_UPDATED):
                feeder.feed(embedding_inputs(lib.chunk_passages(path=pending.path), feeder.passage_format))
        if on_entry is not None:
            entry = on_entry(index, entry)
        entries[index] = entry
        stored += 1
        if feeder is not None:
            feeder.store_ready(lib)
        if progress:
            progress(
                {
                    "phase": "files",
                    "done": stored,
                    "total": len(files),
                    "path": entry["path"],
                    "status": entry["status"],
                }
            )

    def ready(position: int) -> bool:
        item = window[position][1]
        if isinstance(item, dict) or item[1] is None:
            return True  # finished at the checks, or read in-process (in order) as it is committed
        pending, handle = item
        return handle.done() and not any(
            isinstance(other, list) and other[0].sha == pending.sha for _, other in window[:position]
        )

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
            stopped = [
                _file_entry(
                    p, STATUS_ERROR, time.perf_counter(), reason="disk_full", error="not stored: the disk is full"
                )
                for p in in_flight
            ]
            raise DiskFull(lib.root, {"files": done + stopped}) from None
        raise
    finally:
        reader.close()
    return [e for e in entries if e is not None]
