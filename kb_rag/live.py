"""Live library: watched folders and Zotero libraries: scans, file events, settling, grace, offline roots, the
watcher.

May import: config, ingest.files, jobs, storage.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import ABSENT_ERRNOS, KBError, _short_error, now_iso, path_state
from .ingest.files import WalkFindings, _inside, _within_any, collect_files
from .jobs import JOBS_DIRNAME, JobStore, pid_alive, spawn_job
from .storage import Library, _write_atomically, path_key

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
    "KB_WATCH_SETTLE_S": 2.0,  # a file's size and mtime stand still this long before it is synced
    "KB_WATCH_GRACE_S": 30.0,  # a vanished file's document waits this long before it is removed
    "KB_WATCH_SCAN_S": 2.0,  # the shortest time between two scans of a folder without file events
    "KB_WATCH_RESCAN_S": 60.0,  # with file events: a full scan this often anyway (events can be lost)
    "KB_ZOTERO_FULL_S": 21600.0,  # a Zotero source's sync reads every attachment this often, only changes between
    "KB_WATCH_MAX_FILES": 5000.0,  # watching a folder of more files than this needs `confirm: true`
}
# Folders never watched, whatever the request confirms: the root of a file system, the home folder itself and the
# system's own trees (a watch there takes in the system's documentation, or every file a user has, and scans it
# every few seconds). Compared by real path; another platform's entries are not absolute here and are passed over.
SYSTEM_TREES = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib64",
    "/proc",
    "/run",
    "/sbin",
    "/sys",
    "/usr",
    "/System",
    "/Library",
    "/private/etc",
    "C:\\Windows",
    "C:\\Program Files",
    "C:\\Program Files (x86)",
    "C:\\ProgramData",
)
WATCH_SCAN_SHARE = 0.02  # scanning takes at most this share of a core: a large folder is scanned less often
WATCH_DEBOUNCE_S = 0.5  # after a file event, the scan waits this long for the rest of the burst
WATCHER_FILE = "watcher.json"  # in the jobs folder: the process keeping the sources in step, and their states
WATCHER_BEAT_S = 10.0  # how often that file is rewritten while nothing changes
WATCH_LIST_S = 5.0  # how often an idle watcher reads the source list (another process may change it)
WATCH_EVENTS_NOTE = (
    "file events are off (they need the optional watchdog module: pip install 'kb-rag[watch]'; "
    "KB_WATCH_EVENTS=0 turns them off); folders are scanned every few seconds instead"
)


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
    return (
        [s for s in sources if isinstance(s, dict) and isinstance(s.get("path"), str)]
        if isinstance(sources, list)
        else []
    )


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
    tree = next(
        (t for t in SYSTEM_TREES if os.path.isabs(t) and _inside(real, os.path.normcase(os.path.realpath(t)))), None
    )
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
    if _inside(os.path.realpath(path), os.path.realpath(kb_root)):  # by whatever path or link it is reached
        raise KBError("bad_request", f"{path} is inside the library folder {kb_root}")
    base = {"path": path, "added": now_iso(), "last_sync": None, "last_changes": None}
    if os.path.isfile(os.path.join(path, "zotero.sqlite")):  # only its database is read
        return {**base, "kind": "zotero", "db": os.path.join(path, "zotero.sqlite")}
    system = system_folder(path)
    if system is not None:
        raise KBError(
            "bad_request",
            f"{path} is {system}, which is never watched: watch the folder that holds your papers instead",
        )
    return {**base, "kind": "folder", "mount": os.path.ismount(path)}


def change_sources(
    sources: list[dict], add: list[str], remove: list[str], kb_root: Path, options: dict | None = None
) -> tuple[list, list, list]:
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
            source["kind"] == "folder" and any(_inside(path, s["path"]) for s in folders)
        ):
            continue  # already watched, as itself or as part of a watched folder
        if source["kind"] == "folder":
            sources = [s for s in sources if s.get("kind", "folder") != "folder" or not _inside(s["path"], path)]
        kept = {k: v for k, v in (options or {}).items() if v and (k != "base_dir" or source["kind"] == "zotero")}
        sources.append({**source, "options": kept} if kept else source)
        added.append(path)
    return sources, added, removed


# -- comparing a folder with the library -------------------------------------------------------------------------

OUT_OF_REACH = ("offline", "unreadable")  # the states of a source nothing of which can be known now
UNREADABLE_KEPT = "nothing of it is removed, and it is synced again once it can be read"
UNREADABLE_SHOWN = 20  # places a source's view lists that could not be read (its reason counts them all)


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
        os.stat(os.path.join(root, os.curdir))  # a folder that can be listed but not searched
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
            if exc.errno not in ABSENT_ERRNOS:  # out of reach since the walk listed it; gone: the next scan sees
                findings.unreadable.append((path, f"the file cannot be looked at ({_short_error(exc)})"))
            continue
        files[path] = (st.st_size, st.st_mtime_ns)
    locked = next((why for place, why in findings.unreadable if place == root), None)
    if locked is not None:  # it was locked while it was walked
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
    rows = lib.stored_files_under(prefix)
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
    unreadable: list = field(default_factory=list)  # the last scan's places below the folder it could not read

    def presence_changed(self) -> bool:
        """Whether the source vanished, or came back, since the last look: a stat or two, asked every round, so
        that a renamed or unmounted root is reported offline at once (it raises no dependable file event)."""
        if self.zotero:
            there = os.path.isfile(os.path.join(self.path, "zotero.sqlite"))
        else:
            there = os.path.isdir(self.path) and (not self.mount or os.path.ismount(self.path))
        return there == (self.state == "offline")

    def compare(
        self, scan: FolderScan, stored: dict, now: float, settle: float, grace: float
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
            if self.sent.get(path) == signature:  # the last job could not store it: wait for a change
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
            if stored_path in keyed or _within_any(stored_path, blocked):  # unread is not deleted
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

    def compare_zotero(
        self, scan: FolderScan, synced: list | None, now: float, settle: float
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
        return {
            "state": self.state,
            "reason": self.reason,
            "files": self.files,
            "pending": self.pending,
            "scan_ms": round(self.scan_seconds * 1000, 1),
            "offline_since": _iso(self.offline_since) if self.offline_since else None,
            "unreadable": [
                {"path": path_key(place), "reason": why} for place, why in self.unreadable[:UNREADABLE_SHOWN]
            ],
        }


def unreadable_reason(places: list) -> str | None:
    """Why a source that is watched has places it could not read, when it has: the first, and how many."""
    if not places:
        return None
    more = f"; {len(places) - 1} more place(s) cannot be read" if len(places) > 1 else ""
    return (
        f"{path_key(places[0][0])}: {places[0][1]}{more}; the library keeps what it holds from there, and syncs "
        "it again once it can be read"
    )


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
            except Exception:  # e.g. the inotify watch limit: scans still cover the folder
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
        self.jobs: dict[Path, tuple[str, list[tuple[SourceWatch, str]]]] = {}  # the sync job in flight, its files
        self.ticking = threading.Lock()
        self.wake = threading.Event()
        self.poked: dict[str, float] = {}
        # file events start with the first watched source: a daemon whose libraries watch nothing runs no observer
        self.want_events = events and os.environ.get("KB_WATCH_EVENTS", "1") != "0"
        self.events: FileEvents | None = None
        self.thread: Any = None
        self.stopping = False
        self.beats: dict[Path, tuple[float, str]] = {}
        self.listed: dict[Path, float] = {}  # when each library's source list was last read

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
                except (sqlite3.DatabaseError, OSError, KBError) as exc:  # busy, gone or broken: next round
                    for watch in self.libraries[root].values():
                        watch.state, watch.reason = "error", f"{type(exc).__name__}: {_short_error(exc)}"
                    job = None
                if job is not None:
                    started.append(job)
                self._beat(root)
            online = {
                path
                for folders in self.libraries.values()
                for path, watch in folders.items()
                if watch.state not in OUT_OF_REACH
            }
            if online and self.events is None and self.want_events:
                self.events = FileEvents(self._poke)
            if self.events is not None:
                self.events.follow(online)
        return started

    def _tick_library(self, root: Path) -> dict | None:
        folders = self.libraries[root]
        now = time.monotonic()
        if (
            root not in self.jobs
            and not any(w.state == "syncing" or self._due(w, peek=True) for w in folders.values())
            and now - self.listed.get(root, -math.inf) < WATCH_LIST_S
        ):
            return None  # nothing due and no job to follow: an idle round reads no file at all
        if self._job_running(root, folders):
            return None  # its files are in flight; look again once it is done
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
                watch = folders.setdefault(
                    source["path"],
                    SourceWatch(source["path"], bool(source.get("mount")), source.get("kind") == "zotero"),
                )
                if not self._due(watch):
                    continue
                started = time.perf_counter()
                if source.get("kind") == "zotero":
                    ready, wake = watch.compare_zotero(
                        scan_zotero(watch.path), source.get("zotero_signature"), time.monotonic(), settle
                    )
                    zotero += [watch.path] if ready else []
                else:
                    found, gone, wake = watch.compare(
                        scan_folder(watch.path, root, watch.mount),
                        stored_under(lib, watch.path),
                        time.monotonic(),
                        settle,
                        watch_setting("KB_WATCH_GRACE_S"),
                    )
                    ingest += found
                    remove += gone
                watch.scan_seconds = time.perf_counter() - started  # the whole look, comparison included
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
        followed = (
            self.events is not None
            and watch.path in self.events.watches
            and watch.state not in OUT_OF_REACH
            and not watch.unreadable
        )
        every = (
            watch_setting("KB_WATCH_RESCAN_S")
            if followed
            else max(watch_setting("KB_WATCH_SCAN_S"), watch.scan_seconds / WATCH_SCAN_SHARE)
        )
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
                if watch.state == "syncing":  # whoever's job it was, it is over: look at once
                    watch.state, watch.next_scan = "watching", 0.0
        if active is not None and active["command"] == "sync":
            for watch in folders.values():
                if watch.state == "watching":
                    watch.state = "syncing"
        return active is not None

    def _start_sync(self, root: Path, ingest: list[str], remove: list[str], zotero: list[str]) -> dict | None:
        store = JobStore(root)
        job = store.create(
            "sync",
            {"kb_root": str(root), "ingest": sorted(ingest), "remove": sorted(remove), "zotero": sorted(zotero)},
            len(ingest) + len(remove) + len(zotero),
        )
        first = store.active()
        if first is not None and first["job_id"] != job["job_id"]:  # another writer won: look again after it
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
        record = {
            "pid": os.getpid(),
            "beat": time.time(),
            "events": bool(self.events and self.events.available),
            "sources": views,
        }
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
            except Exception:  # a round that failed is tried again; the daemon must outlive it
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
        view = {
            "path": source["path"],
            "kind": source.get("kind", "folder"),
            "added": source.get("added"),
            "options": source.get("options") or {},
            "last_sync": source.get("last_sync"),
            "last_changes": source.get("last_changes"),
        }
        if state is None:
            view.update(state="not_watched", reason="no resident engine is running")
        else:
            view.update(state)
        if view["state"] == "syncing" and active is not None and active["command"] == "sync":
            view["sync"] = {k: active.get(k) for k in ("job_id", "done", "total", "phase")}  # its progress
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
        views = source_views(
            lib, root, watcher.views(root) if watcher is not None and root in watcher.libraries else None
        )
    finally:
        lib.close()
    return {**response, "sources": views} if views else response
