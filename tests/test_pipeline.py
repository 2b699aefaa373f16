"""The ingest pipeline: cheap checks in order, reading in spawned worker processes, one commit per file,
vectors encoded on a thread (kb_rag/ingest/files.py and kb_rag/ingest/pipeline.py: triage_file,
prepare_file, store_prepared, FileReader, VectorFeeder, ingest_files, cmd_ingest).

Covered here: reading in workers stores exactly what reading in-process stores (every column of docs, chunks,
references, citation links and the keyword index), in input order; a single changed file is read without
starting a worker; byte-identical new files in one ingest; a file that kills its worker process; vectors
written by the feeder thread with the real MiniLM model (and a missing model looked for once); a killed
ingest leaves no worker processes behind.

Worker-side read functions live in tests/crashing_reader.py: a spawned worker imports them by name.
"""
from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import crashing_reader  # noqa: E402  (worker-side read functions)
import kb_engine  # noqa: E402  (helpers put the repository root on sys.path)
from helpers import (
    ROOT,
    assert_db_ok,
    assert_totals,
    clean_env,
    db_path,
    embedder_inputs,
    isolate_model_env,
    sp,
    use_minilm,
)

# About the engine's own functions: reaches names outside kb_engine.__all__ (tests/static/test_public_surface.py).
pytestmark = pytest.mark.internals

RealFileReader = kb_engine.FileReader


def _makers():
    makers = [sp.make_onecolumn_paper, sp.make_twocolumn_paper, sp.make_hyphenated_paper, sp.make_ligature_paper,
              sp.make_chinese_paper, sp.make_gb18030_txt, sp.make_markdown, sp.make_page_labels_paper,
              sp.make_citing_paper, sp.make_superscript_paper, sp.make_corrupt_pdf, sp.make_empty_pdf,
              sp.make_scanned_pdf]
    import importlib.util
    if importlib.util.find_spec("docx") is not None:      # python-docx writes the DOCX sample
        makers.append(sp.make_docx)
    return makers


@pytest.fixture(scope="module")
def paper_set(tmp_path_factory) -> Path:
    """Small realistic papers of every kind, plus files that are rejected (corrupt, empty, no text layer)."""
    folder = tmp_path_factory.mktemp("pipeline_papers")
    for make in _makers():
        make(folder)
    return folder


class RecordingReader(RealFileReader):
    """The engine's FileReader, recording what went to a worker process."""
    instances: list[RecordingReader] = []
    read_with = None          # a module-level read function for the workers, else the engine's own

    def __init__(self, workers, read=None, options=None, progress=None):
        super().__init__(workers, read or type(self).read_with, options, progress)
        self.submitted: list[tuple[str, bool]] = []      # (path, handed to a worker)
        RecordingReader.instances.append(self)

    def submit(self, pending, first=False):
        handle = super().submit(pending, first)
        self.submitted.append((pending.path, handle is not None))
        return handle


@pytest.fixture
def recording(monkeypatch):
    RecordingReader.instances = []
    RecordingReader.read_with = None
    monkeypatch.setattr(kb_engine, "FileReader", RecordingReader)
    return RecordingReader


def _ingest(monkeypatch, kb_root, paths, workers, progress=None, **payload) -> dict:
    monkeypatch.setenv("KB_INGEST_WORKERS", str(workers))
    engine = kb_engine.Engine()
    try:
        return engine.execute("ingest", {"paths": [str(p) for p in paths], "kb_root": str(kb_root), **payload},
                              progress=progress)
    finally:
        engine.close()


@pytest.fixture
def no_vectors(monkeypatch):
    """No embedding model: these tests are about files and chunks."""
    isolate_model_env(monkeypatch)
    monkeypatch.setenv("KB_EMBED_MODEL", "none")


def _entries(resp) -> list[dict]:
    return [{k: v for k, v in f.items() if k != "ms"} for f in resp["files"]]


def _rows(con, sql, params=()) -> list[dict]:
    cur = con.execute(sql, params)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def library_dump(kb_root) -> dict:
    """Everything ingest stored, keyed by document path (row ids left out: they depend on commit order)."""
    con = sqlite3.connect(f"file:{db_path(kb_root)}?mode=ro", uri=True)
    try:
        docs = _rows(con, "SELECT * FROM docs")
        path_of = {d["id"]: d["path"] for d in docs}
        out = {"docs": {}, "chunks": {}, "refs": {}, "cites": {}, "fts": {}}
        for d in docs:
            row = {k: v for k, v in d.items() if k not in ("id", "indexed_at")}
            row["duplicate_of"] = path_of.get(d["duplicate_of"]) if d["duplicate_of"] is not None else None
            out["docs"][d["path"]] = row
        for c in _rows(con, "SELECT * FROM chunks ORDER BY doc_id, seq"):
            out["chunks"].setdefault(path_of[c["doc_id"]], []).append(
                {k: v for k, v in c.items() if k not in ("id", "doc_id")})
        for r in _rows(con, "SELECT * FROM refs ORDER BY doc_id, num, id"):
            out["refs"].setdefault(path_of[r["doc_id"]], []).append(
                {k: v for k, v in r.items() if k not in ("id", "doc_id")})
        for path, seq, num, marker in con.execute(
                "SELECT d.path, c.seq, r.num, cc.marker FROM chunk_cites cc JOIN chunks c ON c.id = cc.chunk_id "
                "JOIN refs r ON r.id = cc.ref_id JOIN docs d ON d.id = c.doc_id ORDER BY d.path, c.seq, r.num"):
            out["cites"].setdefault(path, []).append((seq, num, marker))
        if con.execute("SELECT 1 FROM sqlite_master WHERE name = 'chunks_fts'").fetchone():
            for path, seq, body, heading in con.execute(
                    "SELECT d.path, c.seq, f.body, f.heading FROM chunks_fts f JOIN chunks c ON c.id = f.rowid "
                    "JOIN docs d ON d.id = c.doc_id ORDER BY d.path, c.seq"):
                out["fts"].setdefault(path, []).append((seq, body, heading))
        return out
    finally:
        con.close()


def _count(kb_root, sql) -> int:
    con = sqlite3.connect(f"file:{db_path(kb_root)}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchone()[0]
    finally:
        con.close()


def _write_md(folder: Path, name: str, topic: str, paragraphs: int = 3) -> Path:
    body = "\n\n".join(f"Paragraph {i} on {topic}: measurements of {topic} were repeated at site {i} and agreed "
                       f"with the model of {topic} within the stated uncertainty of the survey."
                       for i in range(paragraphs))
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# A Study of {topic.title()}\n\n## Results\n\n{body}\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------------------
# process helpers (psutil when installed, else /proc)

def _process_table() -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, command line)} of every process we can see."""
    try:
        import psutil
    except ImportError:
        psutil = None
    table = {}
    if psutil is not None:
        for proc in psutil.process_iter(["pid", "ppid", "cmdline", "status"]):
            info = proc.info
            if info.get("status") == psutil.STATUS_ZOMBIE:
                continue
            table[info["pid"]] = (info["ppid"], " ".join(info.get("cmdline") or []))
        return table
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read().decode("utf-8", "replace")
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] == "Z":
            continue
        table[int(entry)] = (int(fields[1]), cmdline)
    return table


def descendants(pid: int) -> dict[int, str]:
    table = _process_table()
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, cmdline) in table.items():
            if ppid == parent and child not in found:
                found[child] = cmdline
                frontier.append(child)
    return found


def spawned_workers(pid: int) -> dict[int, str]:
    return {p: c for p, c in descendants(pid).items() if "multiprocessing.spawn" in c or "spawn_main" in c}


def alive(pids, expected_cmdlines: dict[int, str]) -> list[int]:
    """Those of pids still running the same command (a reused pid does not count)."""
    table = _process_table()
    return [p for p in pids if p in table and table[p][1] == expected_cmdlines[p]]


def _wait_gone(pids, cmdlines, seconds) -> list[int]:
    deadline = time.monotonic() + seconds
    left = alive(pids, cmdlines)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = alive(pids, cmdlines)
    return left


# ---------------------------------------------------------------------------
# reading in workers stores what reading in-process stores

@pytest.mark.slow      # every sample paper read twice, once in reader processes
def test_workers_store_exactly_what_in_process_reading_stores(paper_set, tmp_path, monkeypatch, no_vectors,
                                                               recording):
    serial = _ingest(monkeypatch, tmp_path / "serial", [paper_set], workers=0)
    (serial_reader,) = recording.instances
    recording.instances.clear()
    events = []
    parallel = _ingest(monkeypatch, tmp_path / "parallel", [paper_set], workers=2, progress=events.append)
    (parallel_reader,) = recording.instances

    files = sorted(str(p) for p in paper_set.iterdir())
    assert [f["path"] for f in serial["files"]] == files          # input order, whatever finished first
    assert [f["path"] for f in parallel["files"]] == files
    # each file is reported as it is stored, in the order the reads finish: every file once, counted up by one
    reported = [e for e in events if e.get("phase") == "files"]
    assert sorted(e["path"] for e in reported) == files
    assert [e["done"] for e in reported] == list(range(1, len(files) + 1))
    assert_totals(serial)
    assert_totals(parallel)
    statuses = {f["status"] for f in parallel["files"]}
    assert statuses == {"added", "error", "skipped"}, parallel["files"]     # rejections crossed the process line
    assert _entries(serial) == _entries(parallel)
    assert serial["totals"] == parallel["totals"]

    # in-process: no reader process at all; with workers: every file needing work was read in one of two
    assert serial_reader.workers == 0 and serial_reader.started == 0
    assert not any(in_worker for _, in_worker in serial_reader.submitted)
    assert parallel_reader.workers == 2 and parallel_reader.started == 2
    assert sorted(path for path, in_worker in parallel_reader.submitted if in_worker) == files

    a, b = library_dump(tmp_path / "serial"), library_dump(tmp_path / "parallel")
    assert set(a["docs"]) == set(files)
    assert a["chunks"] and a["refs"] and a["cites"], "the paper set should exercise chunks, references and links"
    for table in ("docs", "chunks", "refs", "cites", "fts"):
        assert a[table] == b[table], f"{table} differ between in-process and worker reading"
    assert_db_ok(tmp_path / "serial")
    assert_db_ok(tmp_path / "parallel")


def test_every_file_is_read_in_a_reader_process_in_input_order(tmp_path, monkeypatch, no_vectors, recording):
    """With reader processes, every file goes to one, the first first (the second used to be handed over before
    the first, so a short paper waited behind a long scan), and one changed file too: only there does its read
    run under KB_READ_SECONDS."""
    papers = tmp_path / "papers"
    paths = [_write_md(papers, f"{name}.md", topic) for name, topic in
             (("a", "alpine lakes"), ("b", "basalt weathering"), ("c", "cave fauna"))]
    first = _ingest(monkeypatch, tmp_path / "kb", [papers], workers=2)
    assert [f["status"] for f in first["files"]] == ["added"] * 3
    reader = recording.instances[-1]
    assert reader.submitted == [(str(p), True) for p in paths]

    paths[1].write_text(paths[1].read_text(encoding="utf-8") + "\nA late note on basalt.\n", encoding="utf-8")
    second = _ingest(monkeypatch, tmp_path / "kb", [papers], workers=2)
    assert [f["status"] for f in second["files"]] == ["skipped", "updated", "skipped"]
    reader = recording.instances[-1]
    assert reader.submitted == [(str(paths[1]), True)] and reader.started == 1
    chunks = library_dump(tmp_path / "kb")["chunks"][str(paths[1])]
    assert any("late note on basalt" in c["text"] for c in chunks)


# ---------------------------------------------------------------------------
# identical files in one ingest

@pytest.mark.parametrize("workers", [0, 2])
def test_identical_new_files_in_one_ingest(tmp_path, monkeypatch, no_vectors, recording, workers):
    papers = tmp_path / "papers"
    original = sp.make_hyphenated_paper(papers, "a_battery.pdf")
    shutil.copyfile(original, papers / "b_battery_copy.pdf")
    _write_md(papers, "c_other.md", "coastal erosion")
    resp = _ingest(monkeypatch, tmp_path / "kb", [papers], workers=workers)
    assert_totals(resp)
    a, b, c = resp["files"]
    assert (a["status"], b["status"], c["status"]) == ("added", "duplicate", "added"), resp["files"]
    assert b["reason"] == "same_content" and str(original) in b["error"]
    assert b["chunks"] == 0 and b["title"] == a["title"]
    if workers:     # both copies were read (in workers) before either was stored: store_prepared caught it
        assert {p for p, in_worker in recording.instances[-1].submitted if in_worker} == \
            {str(original), str(papers / "b_battery_copy.pdf"), str(papers / "c_other.md")}
    dump = library_dump(tmp_path / "kb")
    assert dump["docs"][str(papers / "b_battery_copy.pdf")]["status"] == "duplicate"
    assert dump["docs"][str(papers / "b_battery_copy.pdf")]["duplicate_of"] == str(original)
    assert set(dump["chunks"]) == {str(original), str(papers / "c_other.md")}
    assert len(dump["chunks"][str(original)]) == a["chunks"] > 0
    assert_db_ok(tmp_path / "kb")


def test_a_duplicate_whose_original_vanishes_mid_take_over_is_read_afresh(tmp_path, monkeypatch, no_vectors):
    """A recorded duplicate takes over its deleted original's passages; when another engine removes that original
    between the check and the take-over, the copy is read afresh (it used to fail on the missing row)."""
    papers = tmp_path / "papers"
    original = sp.make_hyphenated_paper(papers, "a_battery.pdf")
    copy = papers / "b_battery_copy.pdf"
    shutil.copyfile(original, copy)
    first = _ingest(monkeypatch, tmp_path / "kb", [papers], workers=0)
    assert [f["status"] for f in first["files"]] == ["added", "duplicate"]
    original.unlink()
    real_check = kb_engine._original_is_gone

    def gone_and_then_removed(lib, row):
        gone = real_check(lib, row)
        with lib.transaction():         # what another engine's removal of the original does meanwhile
            lib.delete_doc(row["duplicate_of"])
        return gone

    monkeypatch.setattr(kb_engine, "_original_is_gone", gone_and_then_removed)
    second = _ingest(monkeypatch, tmp_path / "kb", [copy], workers=0)
    (entry,) = second["files"]
    assert entry["status"] == "added" and entry["chunks"] == first["files"][0]["chunks"] > 0, entry
    dump = library_dump(tmp_path / "kb")
    assert set(dump["docs"]) == {str(copy)} and dump["docs"][str(copy)]["status"] == "indexed"
    assert len(dump["chunks"][str(copy)]) == entry["chunks"]
    assert_db_ok(tmp_path / "kb")


def test_a_duplicate_whose_original_comes_back_mid_take_over_stays_a_duplicate(tmp_path, monkeypatch, no_vectors):
    """The take-over checks again inside its transaction: an original whose file is back keeps its passages."""
    papers = tmp_path / "papers"
    original = sp.make_hyphenated_paper(papers, "a_battery.pdf")
    content = original.read_bytes()
    copy = papers / "b_battery_copy.pdf"
    copy.write_bytes(content)
    first = _ingest(monkeypatch, tmp_path / "kb", [papers], workers=0)
    original.unlink()
    real_check = kb_engine._original_is_gone

    def gone_and_then_back(lib, row):
        gone = real_check(lib, row)
        original.write_bytes(content)  # restored (a sync client, an undo) right after the check
        return gone

    monkeypatch.setattr(kb_engine, "_original_is_gone", gone_and_then_back)
    (entry,) = _ingest(monkeypatch, tmp_path / "kb", [copy], workers=0)["files"]
    assert entry["status"] == "duplicate" and entry["chunks"] == 0, entry
    dump = library_dump(tmp_path / "kb")
    assert dump["docs"][str(original)]["status"] == "indexed" and dump["docs"][str(copy)]["status"] == "duplicate"
    assert len(dump["chunks"][str(original)]) == first["files"][0]["chunks"] > 0 and str(copy) not in dump["chunks"]
    assert_db_ok(tmp_path / "kb")


# ---------------------------------------------------------------------------
# a file that kills its worker

def _pending(path: Path):
    return kb_engine.PendingFile(str(path), os.stat(path), "", kb_engine.SUPPORTED_SUFFIXES[path.suffix],
                                 time.perf_counter())


def test_spawned_worker_imports_test_helpers(tmp_path):
    """The worker is another process and finds tests/crashing_reader.py (the parent's sys.path travels)."""
    path = _write_md(tmp_path, "x.md", "lichens")
    reader = RealFileReader(1, read=crashing_reader.pid)
    try:
        pending = _pending(path)
        worker_pid = reader.result(pending, reader.submit(pending))
    finally:
        reader.close()
    assert isinstance(worker_pid, int) and worker_pid != os.getpid()


def test_file_reader_isolates_a_crashing_file(tmp_path):
    folder = tmp_path / "papers"
    paths = [_write_md(folder, "a.md", "alpine lakes"), _write_md(folder, "b.md", "basalt weathering"),
             _write_md(folder, "c_crash.md", "cave fauna"), _write_md(folder, "d.md", "dune migration"),
             _write_md(folder, "e.md", "estuary sediment")]
    pendings = [_pending(p) for p in paths]
    before = set(spawned_workers(os.getpid()))
    reader = RealFileReader(1, read=crashing_reader.read)
    try:
        handles = [reader.submit(p) for p in pendings]
        assert all(h is not None for h in handles)
        results = [reader.result(p, h) for p, h in zip(pendings, handles)]
    finally:
        reader.close()
    for path, result in zip(paths, results):
        if "crash" in path.name:
            assert result.failure and "crashed the document reader" in result.failure, result
            assert result.chunks == [] and result.meta is None
            continue
        expected = kb_engine.prepare_file(str(path))
        assert result.failure is None and result.rejected is None, (path.name, result)
        assert result.meta == expected.meta
        assert [c.text for c in result.chunks] == [c.text for c in expected.chunks]
        assert result.chunks == expected.chunks
    # every pool the reader made (the broken one, the ones that re-read files alone) is gone again
    spawned = spawned_workers(os.getpid())
    new = {p: c for p, c in spawned.items() if p not in before}
    assert not _wait_gone(new, new, 15), "worker processes left running after close()"


@pytest.mark.slow      # reader processes, one of them crashed
def test_ingest_reports_a_crashing_file_and_goes_on(tmp_path, monkeypatch, no_vectors, recording):
    papers = tmp_path / "papers"
    paths = [_write_md(papers, "a.md", "alpine lakes"), _write_md(papers, "b.md", "basalt weathering"),
             _write_md(papers, "c_crash.md", "cave fauna"), _write_md(papers, "d.md", "dune migration"),
             _write_md(papers, "e_slow.md", "estuary sediment"), _write_md(papers, "f.md", "fjord circulation")]
    recording.read_with = crashing_reader.read
    before = set(spawned_workers(os.getpid()))
    resp = _ingest(monkeypatch, tmp_path / "kb", [papers], workers=2)
    assert_totals(resp)
    assert [f["path"] for f in resp["files"]] == [str(p) for p in paths]
    by_file = {Path(f["path"]).name: f for f in resp["files"]}
    crashed = by_file.pop("c_crash.md")
    assert crashed["status"] == "error" and crashed["reason"] == "extract_failed", crashed
    assert "crashed the document reader" in crashed["error"]
    for name, entry in by_file.items():
        expected = kb_engine.prepare_file(str(papers / name))
        assert entry["status"] == "added", entry
        assert entry["chunks"] == len(expected.chunks) and entry["title"] == expected.meta.title
    assert all(in_worker for _, in_worker in recording.instances[-1].submitted)
    dump = library_dump(tmp_path / "kb")
    assert str(papers / "c_crash.md") not in dump["docs"], "a crash stores nothing, so the next ingest retries"
    for name in by_file:
        assert [c["text"] for c in dump["chunks"][str(papers / name)]] == \
            [c.text for c in kb_engine.prepare_file(str(papers / name)).chunks]
    assert_db_ok(tmp_path / "kb")
    spawned = spawned_workers(os.getpid())
    new = {p: c for p, c in spawned.items() if p not in before}
    assert not _wait_gone(new, new, 15), "worker processes left running after the ingest"

    # the next ingest, with a reader that does not crash, picks the file up
    recording.read_with = None
    again = _ingest(monkeypatch, tmp_path / "kb", [papers], workers=2)
    assert {Path(f["path"]).name: f["status"] for f in again["files"]} == {
        "a.md": "skipped", "b.md": "skipped", "c_crash.md": "added", "d.md": "skipped", "e_slow.md": "skipped",
        "f.md": "skipped"}


def test_reader_survives_a_worker_dying_between_files(tmp_path):
    folder = tmp_path / "papers"
    first, second = _pending(_write_md(folder, "a.md", "alpine lakes")), _pending(_write_md(folder, "b.md", "bogs"))
    reader = RealFileReader(1)
    try:
        assert reader.result(first, reader.submit(first)).chunks
        (process,) = reader.processes
        assert process.process.pid in spawned_workers(os.getpid())
        os.kill(process.process.pid, signal.SIGKILL)
        process.process.join(10)            # dead (its pipe closed) before the next file is handed over
        result = reader.result(second, reader.submit(second))
        assert result.failure is None and result.chunks
        assert reader.started == 2          # the dead process was replaced, and the file read once
    finally:
        reader.close()


# ---------------------------------------------------------------------------
# vectors from the feeder thread, with the real MiniLM model

@pytest.fixture(scope="module")
def st_minilm():
    """An independent SentenceTransformer on the MiniLM folder, to check what the engine stored."""
    with pytest.MonkeyPatch.context() as mp:
        folder = use_minilm(mp)
        from sentence_transformers import SentenceTransformer
        return SentenceTransformer(str(folder), device="cpu", local_files_only=True)


def _vectors(kb_root) -> dict[int, bytes]:
    con = sqlite3.connect(f"file:{db_path(kb_root)}?mode=ro", uri=True)
    try:
        return dict(con.execute("SELECT chunk_id, vec FROM vecs"))
    finally:
        con.close()


def _meta(kb_root) -> dict:
    con = sqlite3.connect(f"file:{db_path(kb_root)}?mode=ro", uri=True)
    try:
        return dict(con.execute("SELECT key, value FROM meta"))
    finally:
        con.close()


@pytest.mark.slow      # a real model encodes every passage
def test_feeder_writes_a_vector_for_every_chunk(tmp_path, monkeypatch, st_minilm):
    import numpy as np
    isolate_model_env(monkeypatch)
    folder = use_minilm(monkeypatch)
    papers = tmp_path / "papers"
    sp.make_markdown(papers)
    sp.make_hyphenated_paper(papers)
    sp.make_ligature_paper(papers)
    sp.make_gb18030_txt(papers)
    final_pass = []
    real_embed_missing = kb_engine.embed_missing_chunks

    def spy(*args, **kwargs):
        out = real_embed_missing(*args, **kwargs)
        final_pass.append(out["vectors_written"])
        return out

    monkeypatch.setattr(kb_engine, "embed_missing_chunks", spy)
    events = []
    kb = tmp_path / "kb"
    resp = _ingest(monkeypatch, kb, [papers], workers=1, progress=events.append)
    assert_totals(resp)
    totals = resp["totals"]
    chunks = _count(kb, "SELECT count(*) FROM chunks")
    assert totals["added"] == 4 and totals["chunks"] == chunks > 0
    assert totals["vectors_written"] == chunks and totals["vectors_missing"] == 0, totals
    assert "note" not in resp, resp.get("note")
    assert final_pass == [0], "the feeder thread should have encoded every chunk before the final pass"
    assert any(e.get("phase") == "embed" for e in events)
    meta = _meta(kb)
    assert meta["embed_model"] == str(folder.absolute()) and meta["embed_dim"] == "384"

    vectors = _vectors(kb)
    texts = embedder_inputs(kb)
    assert set(vectors) == set(texts)
    ids = sorted(texts)
    stored = np.stack([np.frombuffer(vectors[i], dtype=np.float32) for i in ids])
    expected = st_minilm.encode([texts[i] for i in ids], normalize_embeddings=True, convert_to_numpy=True,
                                show_progress_bar=False)
    cosines = (stored * expected).sum(axis=1) / (np.linalg.norm(stored, axis=1) * np.linalg.norm(expected, axis=1))
    # the stated int8 bound of the default CPU backend (float32 is held to 0.9999 in tests/test_onnx_backend.py)
    assert cosines.min() > 0.97 and cosines.mean() > 0.985, sorted(zip(cosines, ids))[:3]

    # a second ingest encodes only the new file's chunks, and leaves the others' vectors alone
    new = sp.make_cited_paper(papers)
    final_pass.clear()
    resp2 = _ingest(monkeypatch, kb, [papers], workers=1)
    assert_totals(resp2)
    added = [f for f in resp2["files"] if f["status"] == "added"]
    assert [f["path"] for f in added] == [str(new)]
    assert resp2["totals"]["skipped"] == 4
    assert resp2["totals"]["vectors_written"] == added[0]["chunks"] > 0
    assert resp2["totals"]["vectors_missing"] == 0 and final_pass == [0]
    after = _vectors(kb)
    assert {i: after[i] for i in vectors} == vectors
    assert len(after) == _count(kb, "SELECT count(*) FROM chunks") == chunks + added[0]["chunks"]


def test_missing_model_is_looked_for_once(tmp_path, monkeypatch):
    isolate_model_env(monkeypatch)
    missing = str(tmp_path / "no-such-embedding-model")
    monkeypatch.setenv("KB_EMBED_MODEL", missing)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    embedder_calls, lookups = [], []
    real_embedder, real_lookup = kb_engine.Models.embedder, kb_engine.local_model_path

    def counting_embedder(self, *args, **kwargs):
        embedder_calls.append(kwargs.get("may_download", args[0] if args else False))
        return real_embedder(self, *args, **kwargs)

    def counting_lookup(name):
        if name == missing:
            lookups.append(name)
        return real_lookup(name)

    monkeypatch.setattr(kb_engine.Models, "embedder", counting_embedder)
    monkeypatch.setattr(kb_engine, "local_model_path", counting_lookup)
    papers = tmp_path / "papers"
    _write_md(papers, "a.md", "alpine lakes")
    _write_md(papers, "b.md", "basalt weathering")
    sp.make_markdown(papers)
    kb = tmp_path / "kb"
    resp = _ingest(monkeypatch, kb, [papers], workers=1)
    assert_totals(resp)
    totals = resp["totals"]
    chunks = _count(kb, "SELECT count(*) FROM chunks")
    assert totals["added"] == 3 and totals["chunks"] == chunks > 0
    assert totals["vectors_written"] == 0 and totals["vectors_missing"] == chunks, totals
    note = resp.get("note") or ""
    assert "vectors not computed" in note and missing in note and "HF_HUB_OFFLINE" in note, note
    assert len(embedder_calls) == 1, f"the embedder was looked for {len(embedder_calls)} times"
    assert len(lookups) == 1, f"the model folder was looked up {len(lookups)} times"
    assert _count(kb, "SELECT count(*) FROM vecs") == 0
    assert "embed_model" not in _meta(kb)
    # keyword search works meanwhile
    engine = kb_engine.Engine()
    try:
        hits = engine.execute("search", {"query": "basalt weathering", "kb_root": str(kb), "mode": "keyword"})
    finally:
        engine.close()
    assert hits["results"] and Path(hits["results"][0]["path"]).name == "b.md"


def test_ingest_without_new_chunks_looks_for_no_model(tmp_path, monkeypatch):
    """DESIGN.md: "an ingest after which no chunk lacks a vector" loads no model."""
    isolate_model_env(monkeypatch)
    monkeypatch.setenv("KB_EMBED_MODEL", str(tmp_path / "no-such-embedding-model"))
    calls = []
    real_embedder = kb_engine.Models.embedder

    def counting_embedder(self, *args, **kwargs):
        calls.append(1)
        return real_embedder(self, *args, **kwargs)

    monkeypatch.setattr(kb_engine.Models, "embedder", counting_embedder)
    papers = tmp_path / "papers"
    papers.mkdir()
    sp.make_empty_pdf(papers)
    sp.make_corrupt_pdf(papers)
    sp.make_scanned_pdf(papers)
    resp = _ingest(monkeypatch, tmp_path / "kb", [papers], workers=1)
    assert_totals(resp)
    assert resp["totals"]["chunks"] == 0 and resp["totals"]["vectors_missing"] == 0, resp["totals"]
    assert "note" not in resp, resp["note"]
    assert calls == [], "the embedder was looked for although no chunk needed a vector"


# ---------------------------------------------------------------------------
# a killed ingest

@pytest.mark.slow      # an engine process killed mid-ingest, its readers waited for
@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
def test_killed_ingest_leaves_no_workers(tmp_path):
    papers = tmp_path / "papers"
    for i in range(30):
        sp.make_filler_paper(papers, i, pages=3)
    code = ("import sys, kb_engine\n"
            "kb_engine.Engine().execute('ingest', {'paths': [sys.argv[1]], 'kb_root': sys.argv[2]})\n")
    env = clean_env(KB_INGEST_WORKERS="2", KB_EMBED_MODEL="none")
    proc = subprocess.Popen([sys.executable, "-c", code, str(papers), str(tmp_path / "kb")], cwd=str(ROOT), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    family: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            if len(spawned_workers(proc.pid)) >= 2:
                break
            time.sleep(0.02)
        family = descendants(proc.pid)
        if proc.poll() is not None or len(spawned_workers(proc.pid)) < 2:
            pytest.skip("the ingest ended before its workers were seen (a faster machine needs more files)")
        time.sleep(0.3)                       # let the workers take up files
        family.update(descendants(proc.pid))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        left = _wait_gone(family, family, 10)
        assert not left, {p: family[p][:120] for p in left}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stderr.close()
        for pid in alive(family, family):      # only the processes this test started
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def test_named_pipes_are_refused_or_skipped_never_read(tmp_path, monkeypatch):
    """Reading a FIFO blocks until a writer appears: the engine must not open one."""
    import kb_engine
    folder = tmp_path / "papers"
    folder.mkdir()
    (folder / "real.txt").write_text("Coral reefs bleach during marine heatwaves.\n\n" * 20, encoding="utf-8")
    pipe = folder / "pipe.txt"
    os.mkfifo(pipe)
    monkeypatch.setenv("KB_EMBED_MODEL", "none")
    engine = kb_engine.Engine()
    try:
        walked = engine.execute("ingest", {"paths": [str(folder)], "kb_root": str(tmp_path / "kb")})
        assert [Path(f["path"]).name for f in walked["files"]] == ["real.txt"]
        named = engine.execute("ingest", {"paths": [str(pipe)], "kb_root": str(tmp_path / "kb")})
        entry = named["files"][0]
        assert entry["status"] == "error" and entry["reason"] == "not_a_file", entry
    finally:
        engine.close()
