"""A live library: watched folders kept in step by a real resident engine (`kb_engine.py serve`) on real files.

Each test starts a daemon with short settle, grace and scan times (the defaults are seconds to a minute) and
changes files under it the way people and programs do: copy, edit, move, delete, write slowly, rename the whole
folder away and back, drop a thousand files, kill everything mid-sync."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import zotero_fixture as zf
from helpers import ENGINE, ROOT, clean_env, db_rows, kill_jobs_left, sp, use_minilm

sys.path.insert(0, str(ROOT / "benchmarks"))
from common import ServeProcess  # noqa: E402   (a serve daemon driven over JSON lines, shared with bench_watch)

FAST = {"KB_WATCH_SETTLE_S": "1", "KB_WATCH_GRACE_S": "3", "KB_WATCH_SCAN_S": "0.5", "KB_ASYNC_THRESHOLD": "1000"}


@pytest.fixture
def daemon_factory(tmp_path):
    started = []

    def start(**env) -> ServeProcess:
        daemon = ServeProcess(tmp_path / "kb", clean_env(**{**FAST, **env}))
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.close()
    kill_jobs_left(tmp_path / "kb")


def wait_for(check, timeout: float, every: float = 0.25):
    """check()'s first truthy value within timeout seconds, else fail with the last one."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"not reached within {timeout} s: {value!r}")
        time.sleep(every)


def docs(kb_root: Path) -> dict[str, tuple]:
    """path -> (id, status, chunk_count) of every document."""
    return {r[0]: tuple(r[1:]) for r in db_rows(kb_root, "SELECT path, id, status, chunk_count FROM docs")}


def found(daemon: ServeProcess, query: str, name: str) -> bool:
    reply = daemon.ok("search", {"query": query, "mode": "keyword", "top_k": 10})
    return any(Path(hit["path"]).name == name for hit in reply["results"])


def idle(kb_root: Path) -> bool:
    """No job is queued or running for the library."""
    folder = kb_root / ".kb-jobs"
    states = [json.loads(p.read_text())["state"] for p in folder.glob("*.json") if p.name != "watcher.json"] \
        if folder.is_dir() else []
    return not any(s in ("queued", "running") for s in states)


def sync_jobs(kb_root: Path) -> list[dict]:
    folder = kb_root / ".kb-jobs"
    jobs = [json.loads(p.read_text()) for p in folder.glob("*.json") if p.name != "watcher.json"]
    return sorted((j for j in jobs if j["command"] == "sync"), key=lambda j: j["created"])


def source_state(daemon: ServeProcess) -> dict:
    return daemon.ok("watch")["sources"][0]


# with file events (watchdog), and with scans alone (no watchdog, or KB_WATCH_EVENTS=0)
BOTH_WAYS = pytest.mark.parametrize("events", ["1", "0"], ids=["events", "scans"])


@pytest.mark.slow
@BOTH_WAYS
def test_added_edited_moved_deleted(daemon_factory, tmp_path, events):
    folder = tmp_path / "inbox"
    folder.mkdir()
    daemon = daemon_factory(KB_WATCH_EVENTS=events)
    added = daemon.ok("watch", {"add": [str(folder)]})
    assert added["added"] == [str(folder)] and added["sources"][0]["state"] == "watching"
    # with events, the next full scan is a minute away (KB_WATCH_RESCAN_S): only an event can be this quick
    assert added["file_events"] is (events == "1" and importlib.util.find_spec("watchdog") is not None)

    landed = time.monotonic()
    sp.make_onecolumn_paper(folder)
    wait_for(lambda: found(daemon, "graphene copper", "graphene_cvd_copper.pdf"), 10)
    assert time.monotonic() - landed < 10

    # edited in place: the new text is found, the old one not
    before = docs(daemon.kb_root)[str(folder / "graphene_cvd_copper.pdf")]
    sp.make_hyphenated_paper(folder, name="graphene_cvd_copper.pdf")
    wait_for(lambda: found(daemon, "electrolyte", "graphene_cvd_copper.pdf"), 15)
    after = docs(daemon.kb_root)[str(folder / "graphene_cvd_copper.pdf")]
    assert after[0] == before[0] and after[1] == "indexed"
    assert not found(daemon, "oxygen exposure hydrogen anneal nucleation density", "graphene_cvd_copper.pdf")

    # deleted: gone once the grace period is over, not before
    os.remove(folder / "graphene_cvd_copper.pdf")
    time.sleep(1.5)
    assert str(folder / "graphene_cvd_copper.pdf") in docs(daemon.kb_root)
    wait_for(lambda: str(folder / "graphene_cvd_copper.pdf") not in docs(daemon.kb_root), 15)
    state = source_state(daemon)
    assert state["last_changes"]["removed"] == 1 and state["last_sync"]


@pytest.mark.slow
def test_moved_file_keeps_its_chunks_and_vectors(daemon_factory, tmp_path, monkeypatch):
    model = use_minilm(monkeypatch)
    folder = tmp_path / "inbox"
    (folder / "sub").mkdir(parents=True)
    paper = sp.make_twocolumn_paper(folder)
    daemon = daemon_factory(KB_EMBED_MODEL=str(model))
    daemon.ok("watch", {"add": [str(folder)]})
    wait_for(lambda: db_rows(daemon.kb_root, "SELECT COUNT(*) FROM vecs")[0][0] > 0 and idle(daemon.kb_root), 60)
    chunks = db_rows(daemon.kb_root, "SELECT c.id, v.vec FROM chunks c JOIN vecs v ON v.chunk_id = c.id ORDER BY c.id")
    doc_id = docs(daemon.kb_root)[str(paper)][0]

    moved = folder / "sub" / "renamed.pdf"
    os.rename(paper, moved)
    wait_for(lambda: str(moved) in docs(daemon.kb_root) and idle(daemon.kb_root), 20)
    assert docs(daemon.kb_root)[str(moved)][0] == doc_id and str(paper) not in docs(daemon.kb_root)
    assert db_rows(daemon.kb_root, "SELECT c.id, v.vec FROM chunks c JOIN vecs v ON v.chunk_id = c.id "
                                   "ORDER BY c.id") == chunks        # same rows, same vectors: nothing re-embedded
    job = sync_jobs(daemon.kb_root)[-1]
    assert job["state"] == "done" and job["result"]["totals"]["moved"] == 1
    assert job["result"]["totals"]["removed"] == 0


@pytest.mark.slow
def test_slow_write_is_ingested_once_complete(daemon_factory, tmp_path, sample_dir):
    folder = tmp_path / "inbox"
    folder.mkdir()
    daemon = daemon_factory()
    daemon.ok("watch", {"add": [str(folder)]})
    data = (sample_dir / "graphene_cvd_copper.pdf").read_bytes()
    target = folder / "download.pdf"
    with open(target, "wb") as out:         # a download: pieces 0.4 s apart, for longer than the settle time
        for start in range(0, len(data), len(data) // 8 + 1):
            out.write(data[start:start + len(data) // 8 + 1])
            out.flush()
            time.sleep(0.4)
    wait_for(lambda: found(daemon, "graphene copper", "download.pdf"), 15)
    wait_for(lambda: idle(daemon.kb_root), 15)
    time.sleep(2)
    jobs = sync_jobs(daemon.kb_root)
    assert [j["result"]["totals"]["added"] for j in jobs] == [1]      # once, whole: never a half-written file
    assert docs(daemon.kb_root)[str(target)][1] == "indexed"


@pytest.mark.slow
@BOTH_WAYS
def test_renamed_root_deletes_nothing_and_resumes(daemon_factory, tmp_path, sample_dir, events):
    folder = tmp_path / "drive"
    folder.mkdir()
    for name in ("graphene_cvd_copper.pdf", "battery_electrolytes.pdf"):
        shutil.copy2(sample_dir / name, folder / name)
    daemon = daemon_factory(KB_WATCH_EVENTS=events)
    daemon.ok("watch", {"add": [str(folder)]})
    wait_for(lambda: len(docs(daemon.kb_root)) == 2 and idle(daemon.kb_root), 20)

    away = tmp_path / "drive-unmounted"
    os.rename(folder, away)
    state = wait_for(lambda: (s := source_state(daemon))["state"] == "offline" and s, 10)
    assert "gone" in state["reason"]
    time.sleep(5)           # past the grace period: still nothing removed
    assert len(docs(daemon.kb_root)) == 2
    status = daemon.ok("status")
    assert status["sources"][0]["state"] == "offline"

    os.rename(away, folder)
    wait_for(lambda: source_state(daemon)["state"] == "watching", 10)
    sp.make_markdown(folder)
    wait_for(lambda: found(daemon, "sparse attention", "sparse_attention.md"), 15)
    assert len(docs(daemon.kb_root)) == 3


def test_watched_folders_persist_and_are_validated(daemon_factory, tmp_path, kb_engine):
    folder = tmp_path / "papers"
    (folder / "inner").mkdir(parents=True)
    daemon = daemon_factory()
    bad = daemon.call("watch", {"add": [str(tmp_path / "nowhere")]})
    assert not bad["ok"] and bad["code"] == "bad_request" and "does not exist" in bad["error"]
    daemon.ok("watch", {"add": [str(folder / "inner")]})
    odd = daemon.call("watch", {"add": [str(folder)], "ocr": "sideways"})
    assert not odd["ok"] and odd["code"] == "bad_request" and "sideways" in odd["error"]
    around = daemon.ok("watch", {"add": [str(folder)], "ocr": "off"})     # takes the inner folder's place
    assert [s["path"] for s in around["sources"]] == [str(folder)]
    assert around["sources"][0]["options"] == {"ocr": "off"}
    assert daemon.ok("watch", {"add": [str(folder / "inner")]})["added"] == []
    daemon.close()

    # another process (a one-shot call) sees the same list; no resident engine keeps it in step now
    listed = kb_engine.Engine().execute("watch", {"kb_root": str(tmp_path / "kb")})
    assert [s["path"] for s in listed["sources"]] == [str(folder)]
    assert listed["sources"][0]["state"] == "not_watched" and "resident engine" in listed["note"]
    removed = kb_engine.Engine().execute("watch", {"kb_root": str(tmp_path / "kb"), "remove": [str(folder)]})
    assert removed["removed"] == [str(folder)] and removed["sources"] == []
    with pytest.raises(kb_engine.KBError) as missing:
        kb_engine.Engine().execute("watch", {"kb_root": str(tmp_path / "kb"), "remove": [str(folder)]})
    assert missing.value.code == "not_found"


@pytest.mark.slow
def test_a_thousand_files_make_one_job_and_searches_answer(daemon_factory, tmp_path):
    folder = tmp_path / "dump"
    folder.mkdir()
    daemon = daemon_factory()
    daemon.ok("watch", {"add": [str(folder)]})
    staging = tmp_path / "staging"
    staging.mkdir()
    for i in range(1000):
        (staging / f"note_{i:04d}.md").write_text(f"# Field note {i}\n\nThe plover colony {i} nested on gravel "
                                                  f"bars in spring; chick survival was {i % 97} percent.\n")
    # dropped at once: one rename of the folder that holds them, so that no scan can see part of the batch however
    # slowly a busy machine moves files one by one (a thousand renames took longer than the settling time)
    os.rename(staging, folder / "notes")
    wait_for(lambda: sync_jobs(daemon.kb_root), 15)
    syncing = wait_for(lambda: (s := source_state(daemon)).get("sync") and s, 15, every=0.05)
    assert syncing["state"] == "syncing" and syncing["sync"]["total"] == 1000
    assert syncing["sync"]["job_id"] == sync_jobs(daemon.kb_root)[0]["job_id"]
    answered = []
    while not idle(daemon.kb_root) or not answered:
        started = time.monotonic()
        reply = daemon.call("search", {"query": "plover colony gravel", "mode": "keyword"})
        assert reply["ok"], reply
        answered.append(time.monotonic() - started)
        time.sleep(0.2)
    wait_for(lambda: len(docs(daemon.kb_root)) == 1000, 30)
    jobs = sync_jobs(daemon.kb_root)
    assert len(jobs) == 1 and jobs[0]["total"] == 1000 and jobs[0]["result"]["totals"]["added"] == 1000
    assert max(answered) < 5, answered


@pytest.mark.slow
def test_kill_mid_sync_then_restart_converges(daemon_factory, tmp_path):
    """A batch large enough to be caught part-way (notes are indexed at hundreds a second without a model)."""
    N = 2000
    folder = tmp_path / "dump"
    folder.mkdir()
    daemon = daemon_factory()
    daemon.ok("watch", {"add": [str(folder)]})
    for i in range(N):
        (folder / f"memo_{i:04d}.md").write_text(f"# Memo {i}\n\nSediment core {i} was taken at station "
                                                 f"{i % 13} and dated by lead-210.\n")
    # a job part-way through its batch (an earlier, smaller batch may already have finished: not that one)
    wait_for(lambda: any(j["state"] == "running" and 20 < j["done"] < j["total"] - 20
                         for j in sync_jobs(daemon.kb_root)), 60, every=0.02)
    daemon.kill()
    for job in sync_jobs(daemon.kb_root):       # the jobs too: the library holds part of the batch
        if job["state"] in ("queued", "running") and job.get("pid"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(job["pid"], signal.SIGKILL)
    partial = len(docs(daemon.kb_root))
    assert 0 < partial < N

    daemon = daemon_factory()
    daemon.ok("watch")
    wait_for(lambda: len(docs(daemon.kb_root)) == N and idle(daemon.kb_root), 90)
    rows = db_rows(daemon.kb_root, "SELECT path, status, chunk_count FROM docs")
    assert len({r[0] for r in rows}) == N and all(r[1] == "indexed" and r[2] > 0 for r in rows)
    assert db_rows(daemon.kb_root, "SELECT COUNT(*) FROM chunks")[0][0] == sum(r[2] for r in rows)


@pytest.mark.internals
def test_unmounted_mount_point_is_offline(kb_engine, tmp_path):
    """A folder added while a drive was mounted on it: the empty folder left when the drive is gone is offline,
    so its papers are not taken for deleted (a mount cannot be made in a test: the record says it was one)."""
    folder = tmp_path / "mnt"
    folder.mkdir()
    scan = kb_engine.scan_folder(str(folder), tmp_path / "kb", mount=True)
    assert scan.files == {} and "mount point" in scan.offline
    watch = kb_engine.SourceWatch(str(folder), mount=True)
    ingest, remove, _ = watch.compare(scan, {str(folder / "a.pdf"): (10, 1)}, time.monotonic() + 999, 0.0, 0.0)
    assert (ingest, remove, watch.state) == ([], [], "offline")
    assert kb_engine.scan_folder(str(folder), tmp_path / "kb").offline is None     # a plain folder is online


ZOTERO_FIXTURES = zf.fixtures_root()      # None: generated libraries use the project's stand-in Zotero tables
needs_zotero = pytest.mark.skipif(ZOTERO_FIXTURES is None, reason="the real Zotero database comes with the shared "
                                                                  "fixtures (set KB_ZOTERO_FIXTURES)")


@pytest.mark.slow
@needs_zotero
def test_zotero_item_added_and_trashed_while_watched(daemon_factory, tmp_path):
    """A copy of a real Zotero 6 database (papis-zotero's): an item added to it and one trashed while the daemon
    runs are picked up, and Zotero's files are only read."""
    data_dir = tmp_path / "Zotero"
    shutil.copytree(ZOTERO_FIXTURES / "papis-zotero" / "tests" / "resources" / "sql", data_dir)
    daemon = daemon_factory()
    added = daemon.ok("watch", {"add": [str(data_dir)]})
    assert added["sources"][0]["kind"] == "zotero"
    wait_for(lambda: idle(daemon.kb_root) and sync_jobs(daemon.kb_root) and len(docs(daemon.kb_root)) == 4, 60)
    indexed = db_rows(daemon.kb_root, "SELECT zotero_key, zotero_attachment_key, path FROM docs "
                                      "WHERE status = 'indexed' AND zotero_key IS NOT NULL")
    assert len(indexed) == 1            # the four stub PDFs are one file: one indexed, three recorded copies

    con = sqlite3.connect(str(data_dir / "zotero.sqlite"))
    with con:                           # what Zotero writes when a paper is saved from the browser
        writer = zf.ZoteroWriter(con)
        parent = writer.article("WTCH7Q2K", title="Oxygen Pre-Treatment Suppresses Graphene Nucleation",
                                date="2020-03-15 2020", journal="Journal of Carbon Materials")
        folder = data_dir / "storage" / "WTCHA7TT"
        folder.mkdir()
        paper = sp.make_onecolumn_paper(folder)
        writer.attachment(parent, "WTCHA7TT", path=f"storage:{paper.name}", link_mode=zf.LINK_IMPORTED_FILE,
                          content_type="application/pdf")
        trashed_item = con.execute("SELECT itemID FROM items WHERE key = ?", (indexed[0][0],)).fetchone()[0]
        writer.trash(trashed_item)
        # and one whose file the library holds as a recorded copy (a duplicate row carries no Zotero key)
        copy_key = next(k for (k,) in con.execute("SELECT i.key FROM itemAttachments a JOIN items i ON i.itemID = "
                                                  "a.itemID WHERE a.path LIKE 'storage:%'") if k != indexed[0][1])
        writer.trash(con.execute("SELECT a.parentItemID FROM itemAttachments a JOIN items i ON i.itemID = a.itemID "
                                 "WHERE i.key = ?", (copy_key,)).fetchone()[0])
    con.close()
    before = {p: p.stat().st_mtime_ns for p in data_dir.rglob("*") if p.is_file()}

    wait_for(lambda: found(daemon, "oxygen exposure hydrogen anneal nucleation density", paper.name), 30)
    wait_for(lambda: idle(daemon.kb_root) and not db_rows(
        daemon.kb_root, "SELECT 1 FROM docs WHERE zotero_attachment_key = ?", (indexed[0][1],)), 30)
    row = db_rows(daemon.kb_root, "SELECT title, zotero_key FROM docs WHERE zotero_attachment_key = 'WTCHA7TT'")[0]
    assert row == ("Oxygen Pre-Treatment Suppresses Graphene Nucleation", "WTCH7Q2K")     # Zotero's metadata
    # a recorded copy of the trashed attachment's file took its place: the stub text stays searchable
    assert db_rows(daemon.kb_root, "SELECT COUNT(*) FROM docs WHERE status = 'indexed' AND zotero_key IS NOT NULL "
                                   "AND zotero_key != 'WTCH7Q2K'")[0][0] == 1
    stored = {Path(p).parent.name for p in docs(daemon.kb_root)}
    assert copy_key not in stored and indexed[0][1] not in stored and len(stored) == 3, stored
    state = wait_for(lambda: (s := source_state(daemon))["state"] == "watching" and s, 10)
    assert state["last_changes"]["removed"] == 2
    after = {p: p.stat().st_mtime_ns for p in data_dir.rglob("*") if p.is_file()}
    assert after == before              # Zotero's files are read, never written (nor added to)


@pytest.mark.slow
def test_kb_engine_watch_in_the_foreground(tmp_path, sample_dir):
    """`kb-engine watch` (the human command line): a line when it starts, a line per sync, Ctrl-C ends it cleanly;
    `--add` and `--list` change and show the list."""
    folder = tmp_path / "inbox"
    folder.mkdir()
    kb = tmp_path / "kb"
    env = clean_env(**FAST)
    added = subprocess.run([sys.executable, str(ENGINE), "watch", "--kb-root", str(kb), "--add", str(folder)],
                           capture_output=True, text=True, env=env, timeout=60)
    assert added.returncode == 0 and str(folder) in added.stdout, added
    listed = subprocess.run([sys.executable, str(ENGINE), "watch", "--kb-root", str(kb), "--list", "--json"],
                            capture_output=True, text=True, env=env, timeout=60)
    assert json.loads(listed.stdout)["sources"][0]["state"] == "not_watched"
    # Started as a terminal starts a foreground command: with Ctrl-C's signal at its default. A test run launched
    # in the background of a non-interactive shell ignores SIGINT, its children inherit that, and a child that
    # ignores SIGINT never sees the Ctrl-C this test sends (what made it hang in the loaded runs of issue 50).
    proc = subprocess.Popen([sys.executable, str(ENGINE), "watch", "--kb-root", str(kb)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = proc.stdout.readline()
        assert first.startswith(f"watching 1 folder(s) of {kb}") and "Ctrl-C stops" in first, first
        shutil.copy2(sample_dir / "graphene_cvd_copper.pdf", folder / "graphene_cvd_copper.pdf")
        line = proc.stdout.readline()
        assert "sync done: 1 added" in line, line
        assert found_in(kb, "oxygen exposure hydrogen anneal nucleation density", "graphene_cvd_copper.pdf")
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0      # the exit is the event; the bound only keeps a hang from the suite


def found_in(kb_root: Path, query: str, name: str) -> bool:
    done = subprocess.run([sys.executable, str(ENGINE), "search", "--kb-root", str(kb_root), query, "--mode",
                           "keyword", "--json"], capture_output=True, text=True, env=clean_env(), timeout=120)
    return any(Path(hit["path"]).name == name for hit in json.loads(done.stdout)["results"])


@pytest.mark.slow
def test_zotero_source_keeps_the_options_of_zotero(kb_engine, tmp_path, monkeypatch):
    """A Zotero source added with `base_dir` keeps it: every sync resolves `attachments:` paths against it, as
    `zotero {base_dir}` does (without it the attachment is missing)."""
    monkeypatch.setenv("KB_EMBED_MODEL", "none")
    lib = zf.build_library(tmp_path / "z", ZOTERO_FIXTURES)
    kb = str(tmp_path / "kb")
    engine = kb_engine.Engine()
    try:
        added = engine.execute("watch", {"kb_root": kb, "add": [str(lib.data_dir)], "base_dir": str(lib.base_dir)})
        assert added["sources"][0]["kind"] == "zotero"
        assert added["sources"][0]["options"] == {"base_dir": str(lib.base_dir)}
        synced = engine.execute("sync", {"kb_root": kb})
        g = lib.entries["G"]
        entry = next(e for e in synced["files"] if e.get("attachment_key") == g.attachment_key)
        assert entry["status"] == "added" and Path(entry["path"]) == g.path, entry
    finally:
        engine.close()


class ZoteroSyncs:
    """A Zotero library built from the fixtures, a library beside it and an engine: what the sync tests ask."""

    def __init__(self, kb_engine, tmp_path: Path):
        self.zotero = zf.build_library(tmp_path / "z", ZOTERO_FIXTURES)
        self.kb = tmp_path / "kb"
        self.engine = kb_engine.Engine()

    def sync(self) -> dict[str, dict]:
        """One sync's entries by attachment key."""
        return {e["attachment_key"]: e for e in self.engine.execute("sync", {"kb_root": str(self.kb)})["files"]}

    def title(self, entry) -> str:
        """The title the library holds for a Zotero attachment."""
        return db_rows(self.kb, "SELECT title FROM docs WHERE zotero_attachment_key = ?",
                       (entry.attachment_key,))[0][0]


@pytest.fixture
def zotero_syncs(kb_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("KB_EMBED_MODEL", "none")
    syncs = ZoteroSyncs(kb_engine, tmp_path)
    yield syncs
    syncs.engine.close()


@pytest.mark.slow
def test_zotero_sync_reads_only_what_changed(zotero_syncs, tmp_path, monkeypatch):
    """After the first sync of a watched Zotero library, a sync reads only the attachments Zotero saved since
    (themselves, their parents or their annotations: clientDateModified), those whose collections, tags,
    annotations or stored path changed without an item being saved, and those whose file changed on disk; the
    rest is not read at all. Every KB_ZOTERO_FULL_S a full pass reads everything."""
    lib, kb, engine, sync, title = (zotero_syncs.zotero, zotero_syncs.kb, zotero_syncs.engine, zotero_syncs.sync,
                                    zotero_syncs.title)
    a, b, c, h = (lib.entries[name] for name in "ABCH")

    con = sqlite3.connect(str(lib.db))
    try:
        engine.execute("watch", {"kb_root": str(kb), "add": [str(lib.data_dir)], "base_dir": str(lib.base_dir)})
        assert set(sync()) == {e.attachment_key for e in lib.listed.values()}      # the first sync reads all
        assert sync() == {}                                                          # nothing changed: none
        ids = dict(con.execute("SELECT key, itemID FROM items"))
        with con:
            writer = zf.ZoteroWriter(con)
            # Zotero saves an edit of C's title: the item's clientDateModified moves
            writer.set_field(ids[c.item_key], "title", "Corrected Electrolyte Title")
            con.execute("UPDATE items SET clientDateModified = '2024-11-05 10:00:00' WHERE itemID = ?",
                        (ids[c.item_key],))
            # B's title changed with no save stamped (no Zotero edit does this): only a full pass reads it
            writer.set_field(ids[b.item_key], "title", "Unstamped Title Change")
        changed = sync()
        assert set(changed) == {c.attachment_key} and changed[c.attachment_key]["status"] == "updated", changed
        assert title(c) == "Corrected Electrolyte Title" and title(b) != "Unstamped Title Change"

        with con:           # a renamed collection and an erased annotation save no item of A
            con.execute("UPDATE collections SET collectionName = 'Carbon', clientDateModified = "
                        "'2024-11-05 11:00:00' WHERE key = ?", (lib.collections["Graphene"],))
            erased = ids[lib.annotations[1].key]
            con.execute("DELETE FROM itemAnnotations WHERE itemID = ?", (erased,))
            con.execute("DELETE FROM items WHERE itemID = ?", (erased,))
        changed = sync()
        assert set(changed) == {a.attachment_key} and changed[a.attachment_key]["annotations"] == 1, changed
        assert db_rows(kb, "SELECT collections FROM docs WHERE zotero_attachment_key = ?",
                       (a.attachment_key,))[0][0] == '["Materials/Carbon"]'

        stat = h.path.stat()   # a file changed outside Zotero (its database untouched)
        os.utime(h.path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))
        assert set(sync()) == {h.attachment_key}

        with con:           # a new paper saved from the browser: it alone is read
            parent = writer.article("NW5K8QPZ", title="Heat Stress in Reef Corals", date="2021-01-01 2021",
                                    added="2024-11-06 09:00:00")
            folder = lib.data_dir / "storage" / "NW5KA2TT"
            folder.mkdir()
            paper = sp.make_filler_paper(folder, 61, pages=1, name="Heat stress in reef corals.pdf")
            writer.attachment(parent, "NW5KA2TT", path=f"storage:{paper.name}", link_mode=zf.LINK_IMPORTED_FILE,
                              content_type="application/pdf", added="2024-11-06 09:00:00")
        changed = sync()
        assert set(changed) == {"NW5KA2TT"} and changed["NW5KA2TT"]["status"] == "added", changed

        monkeypatch.setenv("KB_ZOTERO_FULL_S", "0")     # the full pass
        full = sync()
        assert set(full) == {e.attachment_key for e in lib.listed.values()} | {"NW5KA2TT"}
        assert full[b.attachment_key]["status"] == "updated" and title(b) == "Unstamped Title Change"
    finally:
        con.close()
        engine.close()


def _utc(seconds: float) -> str:
    """A moment as Zotero stamps clientDateModified (UTC, to the second)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds))


@pytest.mark.slow
def test_zotero_sync_after_a_clock_that_ran_fast(zotero_syncs):
    """An item saved while the clock ran a year fast keeps its stamp after the clock is corrected: the saves that
    follow, correctly stamped, still reach the library at their next sync (the mark is never past the present);
    and a mark stored in the future (by a sync that ran on the fast clock) is not trusted: a full pass."""
    lib, kb, engine, sync, title = (zotero_syncs.zotero, zotero_syncs.kb, zotero_syncs.engine, zotero_syncs.sync,
                                    zotero_syncs.title)
    b, c, h = (lib.entries[name] for name in "BCH")

    def save_title(entry, new_title: str, stamp: str) -> None:
        with con:
            item = con.execute("SELECT itemID FROM items WHERE key = ?", (entry.item_key,)).fetchone()[0]
            zf.ZoteroWriter(con).set_field(item, "title", new_title)
            con.execute("UPDATE items SET clientDateModified = ? WHERE itemID = ?", (stamp, item))

    con = sqlite3.connect(str(lib.db))
    try:
        engine.execute("watch", {"kb_root": str(kb), "add": [str(lib.data_dir)], "base_dir": str(lib.base_dir)})
        assert set(sync()) == {e.attachment_key for e in lib.listed.values()}
        save_title(c, "Saved While the Clock Ran Fast", _utc(time.time() + 365 * 86400))
        assert set(sync()) == {c.attachment_key} and title(c) == "Saved While the Clock Ran Fast"
        # the clock is right again: a save stamped now is read at once, not a year from now
        save_title(b, "Saved After the Clock Was Corrected", _utc(time.time()))
        changed = sync()
        assert b.attachment_key in changed and title(b) == "Saved After the Clock Was Corrected", changed

        # a mark stored by a sync that ran on the fast clock: in the future, so no mark at all
        stored = json.loads(db_rows(kb, "SELECT value FROM meta WHERE key = 'watch_sources'")[0][0])
        stored[0]["zotero_mark"]["modified"] = _utc(time.time() + 365 * 86400)
        with contextlib.closing(sqlite3.connect(str(kb / "kb.sqlite"))) as kb_con, kb_con:
            kb_con.execute("UPDATE meta SET value = ? WHERE key = 'watch_sources'", (json.dumps(stored),))
        save_title(h, "Saved Under a Mark From the Future", _utc(time.time()))
        changed = sync()
        assert set(changed) == {e.attachment_key for e in lib.listed.values()}     # the full pass
        assert title(h) == "Saved Under a Mark From the Future"
    finally:
        con.close()
        engine.close()


@pytest.mark.slow
def test_zotero_sync_after_a_backup_is_restored(zotero_syncs, tmp_path):
    """Zotero's database replaced by an older backup (earlier stamps, lower versions) is read in full at the next
    sync: the library takes the backup's data, instead of keeping what the backup undid until the next full pass."""
    lib, kb, engine, sync = zotero_syncs.zotero, zotero_syncs.kb, zotero_syncs.engine, zotero_syncs.sync
    c = lib.entries["C"]

    def title() -> str:
        return zotero_syncs.title(c)

    try:
        engine.execute("watch", {"kb_root": str(kb), "add": [str(lib.data_dir)], "base_dir": str(lib.base_dir)})
        sync()
        backup = tmp_path / "zotero.sqlite.bak"
        shutil.copyfile(lib.db, backup)
        with contextlib.closing(sqlite3.connect(str(lib.db))) as con, con:     # edited, then synced by Zotero
            item = con.execute("SELECT itemID FROM items WHERE key = ?", (c.item_key,)).fetchone()[0]
            zf.ZoteroWriter(con).set_field(item, "title", "Revised After the Backup")
            con.execute("UPDATE items SET clientDateModified = ?, version = 40 WHERE itemID = ?",
                        (_utc(time.time()), item))
        assert set(sync()) == {c.attachment_key} and title() == "Revised After the Backup"

        shutil.copyfile(backup, lib.db)         # the user restores the backup
        changed = sync()
        assert set(changed) == {e.attachment_key for e in lib.listed.values()}     # the full pass
        assert changed[c.attachment_key]["status"] == "updated" and title() == c.title
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.internals
def test_zotero_mark_is_never_ahead(kb_engine, tmp_path):
    """zotero_mark caps the latest stamp at the snapshot's time; zotero_touched refuses (None: read everything) a
    mark in the future, a mark whose latest stamp is later than the database's, and one whose highest version
    of a library is above the database's."""
    lib = zf.build_library(tmp_path / "z", ZOTERO_FIXTURES)
    now = time.time()
    with contextlib.closing(sqlite3.connect(str(lib.db))) as con, con:
        con.execute("UPDATE items SET clientDateModified = ? WHERE key = ?",
                    (_utc(now + 365 * 86400), lib.entries["C"].item_key))
    snapshot = kb_engine.ZoteroSnapshot(lib.db)
    with snapshot as conn:
        latest, highest = conn.execute("SELECT MAX(clientDateModified), MAX(version) FROM items").fetchone()
        mark = kb_engine.zotero_mark(conn, now)
        assert mark == {"modified": _utc(now), "versions": {"1": highest}}, (mark, latest)
        assert isinstance(kb_engine.zotero_touched(conn, mark, now), set)
        assert kb_engine.zotero_touched(conn, {**mark, "modified": _utc(now + 86400)}, now) is None   # future
        assert kb_engine.zotero_touched(conn, {**mark, "versions": {"1": highest + 1}}, now) is None  # ahead
    with contextlib.closing(sqlite3.connect(str(lib.db))) as con, con:    # the future stamp corrected: earlier
        con.execute("UPDATE items SET clientDateModified = ? WHERE key = ?", (_utc(now - 86400),
                                                                              lib.entries["C"].item_key))
    with kb_engine.ZoteroSnapshot(lib.db) as conn:
        assert kb_engine.zotero_touched(conn, mark, now) is None
