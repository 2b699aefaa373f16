"""The in-memory vector index: exact float32 below the size threshold, float16 storage above it.

These tests are about the index's mechanics (ids, filters, updates, which storage is chosen), so they use
random unit vectors; retrieval quality with a real model is tested in test_hybrid.py.
"""
from __future__ import annotations

import numpy as np
import pytest

import kb_engine as kb

# About the engine's own functions: reaches names outside kb_engine.__all__ (tests/static/test_public_surface.py).
pytestmark = pytest.mark.internals

DIM = 32


def _unit_rows(count: int, seed: int) -> np.ndarray:
    rows = np.random.default_rng(seed).standard_normal((count, DIM)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def _filled(compact: bool, matrix: np.ndarray, first_id: int = 1000) -> kb.VectorIndex:
    index = kb.VectorIndex(DIM, "test-model", compact=compact)
    index.index.add_with_ids(matrix, np.arange(first_id, first_id + len(matrix), dtype=np.int64))
    return index


def test_compact_index_returns_the_exact_neighbours():
    matrix = _unit_rows(5000, seed=1)
    exact, compact = _filled(False, matrix), _filled(True, matrix)
    probes = matrix[[3, 70, 999, 4321]] + _unit_rows(4, seed=2) * 0.05
    for probe in probes / np.linalg.norm(probes, axis=1, keepdims=True):
        want = exact.search(probe, 10, None)
        got = compact.search(probe, 10, None)
        assert [cid for cid, _ in got] == [cid for cid, _ in want]
        assert all(abs(a[1] - b[1]) < 2e-3 for a, b in zip(got, want))
        assert all(np.isfinite(score) for _, score in got)


def test_compact_index_filters_before_top_k_and_follows_updates():
    matrix = _unit_rows(2000, seed=3)
    index = _filled(True, matrix)
    allowed = [1000 + i for i in range(0, 2000, 97)]
    hits = index.search(matrix[500], 5, allowed)
    assert len(hits) == 5 and {cid for cid, _ in hits} <= set(allowed)
    best = index.search(matrix[500], 1, None)[0][0]
    assert best == 1500
    index.remove([1500])
    assert index.search(matrix[500], 1, None)[0][0] != 1500
    assert len(index) == 1999
    assert index.search(matrix[500], 3, []) == []


@pytest.mark.parametrize("threshold, compact", [("1", True), ("1000000", False)])
def test_load_chooses_the_storage_by_library_size(tmp_path, monkeypatch, threshold, compact):
    monkeypatch.setenv("KB_COMPACT_INDEX_MIN", threshold)
    monkeypatch.setenv("KB_EMBED_MODEL", "none")       # the test writes its own vectors
    papers = tmp_path / "papers"
    papers.mkdir()
    for i in range(3):
        (papers / f"note{i}.md").write_text(f"# Note {i}\n\nGraphene growth on copper foil, sample {i}. " * 5)
    engine = kb.Engine()
    try:
        engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(tmp_path / "kb")})
        lib = engine.library(tmp_path / "kb", writable=True)
        ids = [row[0] for row in lib.conn.execute("SELECT id FROM chunks ORDER BY id")]
        matrix = _unit_rows(len(ids), seed=4)
        with lib.transaction():
            lib.set_meta("embed_model", "test-model")
            lib.set_meta("embed_dim", str(DIM))
            lib.store_vectors(ids, matrix)
        index = kb.VectorIndex.load(lib, DIM, "test-model")
        assert index.compact is compact and len(index) == len(ids)
        assert index.search(matrix[0], 1, None)[0][0] == ids[0]
    finally:
        engine.close()

