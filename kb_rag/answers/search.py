"""Search: search and rag requests: query cache, both halves, fusion, rerank, snippets, related.

May import: answers.evidence, answers.pictures, config, models.importer, models.registry, models.runtime, records,
retrieval.candidates, retrieval.fusion, storage, text.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from ..answers.evidence import PAGE_PROCESS, PageCache
from ..answers.pictures import with_evidence
from ..config import (
    DEFAULT_SNIPPET_CHARS,
    DEFAULT_TOP_K,
    EMPTY_LIBRARY_NOTE,
    MAX_QUERY_CHARS,
    MAX_TOP_K,
    KBError,
    _opt_bool,
    _opt_int,
    _opt_str,
)
from ..models.importer import offline_model_remedy
from ..models.registry import Models
from ..models.runtime import MAX_UNKNOWN_TOKEN_SHARE, BiEncoderReranker, Embedder, ModelUnavailable, local_model_path
from ..records import SearchResponse
from ..retrieval.candidates import (
    BM25_K1,
    chunks_in_long_documents,
    document_aware_order,
    document_aware_vector_order,
    document_directions,
    filter_sql,
    keyword_candidates,
    query_idfs,
    term_weight,
)
from ..retrieval.fusion import (
    FUSION_POOL,
    RERANK_POOL,
    SearchHit,
    VectorIndex,
    _script,
    chunk_texts,
    chunk_weights,
    doc_centroids,
    filtered_chunk_ids,
    fuse_halves,
    hit_records,
    keyword_trust,
    language_note,
    neighbour_gap,
    with_section_prior,
)
from ..storage import Library
from ..text import normalize_text, query_terms, text_language

# -- search and rag: the request, the query cache, both halves, fusion, rerank, related work -----------

SEARCH_MODES = ("hybrid", "keyword", "vector")  # the default first
SEARCH_DEPTHS = ("quick", "deep")
RAG_TOP_K, RAG_SNIPPET_CHARS = 3, 600
QUERY_CACHE_SIZE = 256
RELATED_MAX = 5


class LibraryState:
    """What the engine keeps in memory for one library between commands."""

    def __init__(self):
        from collections import OrderedDict

        self.index: VectorIndex | None = None
        # (generation, passages, passages without a vector, why the model's vectors were refused or None)
        self.coverage: tuple[int, int, int, str | None] | None = None
        self.vectors_coming = False  # a resident engine is adding vectors after an ingest's answer
        self.query_cache: OrderedDict[str, tuple[int, str]] = OrderedDict()  # answers kept as JSON text
        self.centroids: tuple | None = None  # (generation, model, doc ids, matrix)
        self.directions: tuple[int, str, dict] | None = None  # (generation, model, doc id -> unit mean vector)
        self.pages = PageCache()  # glyphs of pages that snippet boxes and pictures read

    def reset(self) -> None:
        self.index = None
        self.query_cache.clear()
        self.centroids = None
        self.directions = None
        self.pages = PageCache()

    def document_directions(self, lib: Library, doc_ids: list[int], embedder: Embedder) -> dict:
        """doc id -> its own direction in vector space (see document_directions), each computed once until the
        library changes."""
        generation = lib.generation()
        if self.directions is None or self.directions[:2] != (generation, embedder.model_id):
            self.directions = (generation, embedder.model_id, {})
        known = self.directions[2]
        missing = [doc_id for doc_id in doc_ids if doc_id not in known]
        if missing:
            found = document_directions(lib, missing)
            known.update({doc_id: found.get(doc_id) for doc_id in missing})
        return {doc_id: known[doc_id] for doc_id in doc_ids if known[doc_id] is not None}

    def cached(self, key: str, generation: int) -> SearchResponse | None:
        entry = self.query_cache.get(key)
        if entry is None or entry[0] != generation:
            return None
        self.query_cache.move_to_end(key)
        return json.loads(entry[1])

    def remember(self, key: str, generation: int, response: SearchResponse) -> None:
        self.query_cache[key] = (generation, json.dumps(response))
        self.query_cache.move_to_end(key)
        while len(self.query_cache) > QUERY_CACHE_SIZE:
            self.query_cache.popitem(last=False)


def embeddings_disabled(models: Models) -> bool:
    return models.embed_name.lower() in ("none", "off", "0")


def library_embedder(lib: Library, models: Models, coming: bool = False) -> Embedder:
    """The embedder whose vectors this library holds; raises ModelUnavailable otherwise (``coming``: this process
    is adding the library's first vectors right now)."""
    if embeddings_disabled(models):
        raise ModelUnavailable("embeddings are switched off (KB_EMBED_MODEL=none)")
    recorded, _ = lib.vector_model()
    if recorded is None and coming:
        raise ModelUnavailable("the library's first vectors are being added in the background")
    refusal = lib.vector_refusal() if recorded is None else None
    if refusal is not None:
        raise ModelUnavailable(f"the library has no vectors: they were refused ({refusal.get('reason')})")
    if recorded is None:
        raise ModelUnavailable(
            "the library has no vectors yet (`kb-engine reembed` adds them"
            + ("" if local_model_path(models.embed_name) else f"; {offline_model_remedy()}")
            + ")"
        )
    embedder = models.embedder(may_download=False)
    if embedder.model_id != recorded:
        raise ModelUnavailable(
            f"the library's vectors were made with {recorded} but the configured model is "
            f"{embedder.model_id}; run reembed to switch"
        )
    return embedder


def vector_index(lib: Library, state: LibraryState, embedder: Embedder) -> VectorIndex:
    """The in-memory index, loaded once and reloaded only when another process changed the library."""
    index = state.index
    if index is None or index.model != embedder.model_id or index.generation != lib.generation():
        state.index = index = VectorIndex.load(lib, embedder.dim, embedder.model_id)
    return index


def _search_request(payload: dict, rag: bool) -> dict:
    query = payload.get("query")
    if not isinstance(query, str) or not query.strip():
        raise KBError("bad_request", "query must be a non-empty string")
    if len(query) > MAX_QUERY_CHARS:
        raise KBError("bad_request", f"query has {len(query)} characters; at most {MAX_QUERY_CHARS} are accepted")
    mode = _opt_str(payload, "mode", "hybrid")
    if mode is None:
        mode = "hybrid"
    if mode not in SEARCH_MODES:
        raise KBError("bad_request", f"unknown mode {mode!r}; use one of {', '.join(SEARCH_MODES)}")
    depth = _opt_str(payload, "depth", "deep" if rag else "quick")
    if depth is None:
        depth = "deep" if rag else "quick"
    if depth not in SEARCH_DEPTHS:
        raise KBError("bad_request", f"unknown depth {depth!r}; use quick or deep")
    filters = payload.get("filters")
    if filters is not None and not isinstance(filters, dict):
        raise KBError("bad_request", "filters must be an object (or null)")
    filter_sql(filters)
    return {
        "query": query,
        "queries": _further_renderings(payload, query),
        "mode": mode,
        "depth": depth,
        "filters": filters or None,
        "top_k": _opt_int(payload, "top_k", RAG_TOP_K if rag else DEFAULT_TOP_K, 1, MAX_TOP_K),
        "snippet": _opt_int(payload, "snippet", RAG_SNIPPET_CHARS if rag else DEFAULT_SNIPPET_CHARS, 0, 100_000),
        "cache": _opt_bool(payload, "cache", True),
        "boxes": _opt_bool(payload, "boxes", False),
        "pictures": _opt_int(payload, "pictures", 0, 0, MAX_PICTURES),
    }


MAX_RENDERINGS = 4  # further renderings of one question a search accepts in ``queries``
MAX_PICTURES = 10  # hits a search may draw (``pictures``)


def _normalised_query(text: str) -> str:
    return " ".join(normalize_text(text).lower().split())


def _further_renderings(payload: dict, query: str) -> list[str]:
    """``queries``: up to four more renderings of the question (e.g. in the library's main language); blanks
    and repeats of ``query`` are dropped."""
    value = payload.get("queries")
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise KBError("bad_request", "queries must be a list of strings (other renderings of the query)")
    if len(value) > MAX_RENDERINGS:
        raise KBError("bad_request", f"queries holds {len(value)} renderings; at most {MAX_RENDERINGS} are accepted")
    for text in value:
        if len(text) > MAX_QUERY_CHARS:
            raise KBError(
                "bad_request",
                f"a rendering in queries has {len(text)} characters; at most {MAX_QUERY_CHARS} are accepted",
            )
    seen = {_normalised_query(query)}
    kept = []
    for text in value:
        key = _normalised_query(text)
        if key and key not in seen:
            seen.add(key)
            kept.append(text.strip())
    return kept


def _cache_key(request: dict, models: Models, rag: bool) -> str:
    normalised = [_normalised_query(q) for q in (request["query"], *request["queries"])]
    parts = [
        normalised,
        request["filters"],
        request["top_k"],
        request["snippet"],
        request["mode"],
        request["depth"],
        models.rerank_name,
        models.rerank_fallback_name,
        models.embed_name,
        rag,
    ]
    return hashlib.sha1(json.dumps(parts, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


PARALLEL_HALVES_MIN = 500_000  # vectors from which a hybrid query runs its two halves side by side


class VectorHalf:
    """The vector half of a query, run on a thread while the keyword half runs on the caller's.

    Query encoding (torch) and a FAISS scan release the interpreter lock, and a one-query FAISS scan and an SQLite
    query each use one core, so on a large library the two halves take about the time of the slower one. The
    thread touches neither the database nor the engine's state. Each rendering of the question is encoded and
    searched; the result holds one (query vector, candidates) pair per rendering.
    """

    def __init__(
        self, embedder: Embedder, index: VectorIndex, queries: list[str], pool: int, allowed: list[int] | None
    ):
        import threading

        self._outcome: list[tuple] | None = None
        self._error: BaseException | None = None
        self._thread = None
        if len(index) < PARALLEL_HALVES_MIN:  # small: both halves are quick, and sharing the cores costs more
            self._run(embedder, index, queries, pool, allowed)
            return
        self._thread = threading.Thread(
            target=self._run, args=(embedder, index, queries, pool, allowed), name="kb-vector-half", daemon=True
        )
        self._thread.start()

    def _run(self, embedder: Embedder, index: VectorIndex, queries: list[str], pool: int, allowed) -> None:
        try:
            vectors = embedder.encode_queries(queries)
            self._outcome = [(vector, index.search(vector, pool, allowed)) for vector in vectors]
        except BaseException as exc:  # handed to the caller's thread by result()
            self._error = exc

    def result(self) -> list[tuple[object, list[tuple[int, float]]]]:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._outcome or []


def merge_renderings(
    ranked_lists: list[tuple[list[tuple[int, float]], float]], agree: bool = False, weigh: bool = False
) -> list[tuple[int, float]]:
    """One candidate list from the (ranking, scale) pairs several renderings of a question produced, each score
    divided by its ranking's scale. Renderings that ``agree`` (one script: rephrasings that reach the same
    passages) add up, so a passage several of them find outranks one only a single rendering finds; with
    ``weigh`` each list counts by the keyword trust of its best share (a rendering whose words barely match
    counts little). Renderings in different scripts reach different documents, and a chunk keeps its best value.
    A rendering that found nothing (a Chinese question over English papers, in the keyword half) is simply
    absent: it cannot pull the others down."""
    ranked_lists = [(ranked, scale) for ranked, scale in ranked_lists if ranked]
    if len(ranked_lists) == 1:
        return ranked_lists[0][0]
    merged: dict[int, float] = {}
    for ranked, scale in ranked_lists:
        factor = keyword_trust(ranked[0][1] / scale) if weigh else 1.0
        for chunk_id, score in ranked:
            value = score / scale
            if agree:
                merged[chunk_id] = merged.get(chunk_id, 0.0) + factor * value
            elif value > merged.get(chunk_id, -math.inf):
                merged[chunk_id] = value
    return sorted(merged.items(), key=lambda item: (-item[1], item[0]))


def bm25_ceiling(lib: Library, terms: list[str]) -> float:
    """The BM25 score a passage matching every term of a query would approach (each term adds at most
    idf x (k1 + 1)). Scores from queries of different lengths and languages compare as shares of their ceilings:
    a Chinese question whose only match in an English library is one model name reaches a few percent of its
    ceiling, its English rendering a large part of its own."""
    idfs = query_idfs(lib, terms)
    return max((BM25_K1 + 1) * sum(term_weight(t) * idf for t, idf in idfs.items()), 1e-9)


def readable_renderings(embedder: Embedder, renderings: list[str]) -> tuple[list[str], str | None]:
    """The renderings the embedder can read, and why the first unreadable one was left out."""
    readable, reason = [], None
    for text in renderings:
        unknown = embedder.unknown_token_share(text)
        if unknown > MAX_UNKNOWN_TOKEN_SHARE:
            reason = reason or (
                f"the embedding model does not know {unknown:.0%} of the query's tokens "
                "(its vocabulary lacks the script), so its vector would be noise"
            )
        else:
            readable.append(text)
    return readable, reason


def mean_unit_vector(vectors: list):
    import numpy as np

    if not vectors:
        return None
    mean = np.mean(np.stack(vectors), axis=0)
    return mean / (np.linalg.norm(mean) or 1.0)


def keyword_half(
    lib: Library, renderings: list[str], filters: dict | None, pool: int, agree: bool
) -> tuple[list[tuple[int, float]], float]:
    """The keyword candidates of every rendering, merged, by evidence alone (section priors are added once, after
    fusion), and the best match as a share of its ceiling."""
    ranked = [
        (document_aware_order(lib, terms, keyword_candidates(lib, terms, filters, pool)), bm25_ceiling(lib, terms))
        for terms in map(query_terms, renderings)
        if terms
    ]
    return (
        merge_renderings(ranked, agree, weigh=True),
        max((found[0][1] / ceiling for found, ceiling in ranked if found), default=0.0),
    )


def retrieve(
    lib: Library, request: dict, models: Models, state: LibraryState
) -> tuple[list[SearchHit], str, list, object, float]:
    """Candidates through the pipeline: (hits best first, score kind, notes, query vector or None, the keyword
    half's best match as a share of its ceiling: 1.0 where the keyword half did not run). Every rendering
    of the question (``query`` and ``queries``) is searched in both halves; each half keeps a chunk's best
    score over the renderings before the halves are fused."""
    mode, top_k, filters = request["mode"], request["top_k"], request["filters"]
    renderings = [request["query"], *request["queries"]]
    agree = len({_script(text_language(text)) for text in renderings}) == 1  # see merge_renderings
    pool = max(FUSION_POOL, top_k * 5)
    notes: list[str] = []
    keyword: list[tuple[int, float]] = []
    vector: list[tuple[int, float]] = []
    query_vec = None
    vector_half = None
    if mode in ("vector", "hybrid"):
        try:
            embedder = library_embedder(lib, models, state.vectors_coming)
            readable, reason = readable_renderings(embedder, renderings)
            if not readable:
                raise ModelUnavailable(reason)
            index = vector_index(lib, state, embedder)
            vector_half = VectorHalf(embedder, index, readable, pool, filtered_chunk_ids(lib, filters))
        except ModelUnavailable as exc:
            notes.append(f"vector search unavailable: {exc}; using keyword search")
            if mode == "vector":
                mode = "keyword"
            if not embeddings_disabled(models):
                models.start_background_download(models.embed_name)
    keyword_strength = 1.0
    if mode in ("keyword", "hybrid"):
        # (while the vector half runs on its thread)
        keyword, keyword_strength = keyword_half(lib, renderings, filters, pool, agree)
    if vector_half is not None:
        try:
            searched = vector_half.result()
            vector = merge_renderings(
                [(document_aware_vector_order(lib, state, embedder, vec, found), 1.0) for vec, found in searched], agree
            )  # cosines compare as they are
            query_vec = mean_unit_vector([vec for vec, _ in searched])
        except ModelUnavailable as exc:  # query vectors the model got wrong too (UnusableEmbeddings)
            notes.append(f"vector search unavailable: {exc}; using keyword search")
            if mode == "vector":
                mode = "keyword"
                keyword, keyword_strength = keyword_half(lib, renderings, filters, pool, agree)
    weights = chunk_weights(lib, {cid for cid, _ in keyword} | {cid for cid, _ in vector})
    if keyword and vector:
        candidates = [cid for cid, _ in keyword] + [cid for cid, _ in vector]
        fused = fuse_halves(
            keyword, vector, weights, chunks_in_long_documents(lib, candidates), keyword_trust(keyword_strength)
        )
        kind = "fused"
    else:
        single = vector or keyword
        fused = with_section_prior(single, weights, neighbour_gap([score for _, score in single]))
        kind = "cosine" if vector or mode == "vector" else "bm25"
    hits = [SearchHit(cid, score) for cid, score in fused]
    if request["depth"] == "deep" and hits:
        hits, kind = rerank(lib, renderings, hits[: max(RERANK_POOL, top_k)], models, notes, kind)
    return hits[:top_k], kind, notes, query_vec, keyword_strength


def rerank(lib: Library, renderings: list[str], pool: list[SearchHit], models: Models, notes: list, kind: str):
    """Re-score the pool against each rendering of the question; a passage keeps its best score."""
    try:
        reranker = models.reranker(may_download=False)
    except ModelUnavailable:
        notes.append(
            f"not reranked: {models.rerank_name or 'the reranker'} is not available here (`models` says why); "
            "results in fused order"
        )
        models.start_background_download(models.rerank_name)
        return pool, kind
    texts = chunk_texts(lib, [h.chunk_id for h in pool])
    passages = [texts.get(h.chunk_id, "") for h in pool]
    try:
        scores = [max(per_passage) for per_passage in zip(*(reranker.score(q, passages) for q in renderings))]
    except ModelUnavailable as exc:  # a bi-encoder whose vectors were refused
        notes.append(f"not reranked: {exc}; results in fused order")
        return pool, kind
    reranked = sorted((SearchHit(h.chunk_id, s) for h, s in zip(pool, scores)), key=lambda h: (-h.score, h.chunk_id))
    if isinstance(reranker, BiEncoderReranker):
        notes.append(f"cross-encoder unavailable; reranked with the bi-encoder {reranker.name}")
        return reranked, "bi-encoder"
    return reranked, "rerank"


def vector_coverage(lib: Library, state: LibraryState, models: Models) -> dict:
    """Which model's vectors a search used and how many passages have one (counted once per library change)."""
    generation = lib.generation()
    if state.coverage is None or state.coverage[0] != generation:
        total = lib.count_chunks()
        state.coverage = (generation, total, lib.count_missing_vectors(), (lib.vector_refusal() or {}).get("reason"))
    _, total, missing, refused = state.coverage
    embedder = models.loaded()["embedder"] or models.embed_name
    return {
        "model": Path(embedder).name if os.path.isabs(embedder) else embedder,
        "backend": models.devices.report.get("embed_backend"),
        "done": total - missing,
        "total": total,
        "missing": missing,
        **({"refused": refused} if refused and missing else {}),
    }


def _reranker_of(models: Models, score_kind: str, depth: str) -> str | None:
    """The model whose scores a deep answer carries: the cross-encoder, or the bi-encoder it fell back to."""
    if depth != "deep":
        return None
    return {"rerank": models.rerank_name, "bi-encoder": models.rerank_fallback_name}.get(score_kind)


def run_search(
    lib: Library | None, payload: dict, models: Models, state: LibraryState, rag: bool = False
) -> tuple[SearchResponse, object]:
    request = _search_request(payload, rag)
    if (request["boxes"] or request["pictures"]) and lib is not None:
        PAGE_PROCESS.warm()
    response = SearchResponse(
        query=request["query"], mode=request["mode"], depth=request["depth"], results=[], count=0, cached=False
    )
    if request["queries"]:
        response["queries"] = request["queries"]
    renderings = [request["query"], *request["queries"]]
    terms = list(dict.fromkeys(term for text in renderings for term in query_terms(text)))
    if not terms:
        response["note"] = "the query has no searchable terms (only stopwords or punctuation); add content words"
        response["notes"] = [response["note"]]
        return response, None
    if lib is None:
        response["note"] = EMPTY_LIBRARY_NOTE
        response["notes"] = [response["note"]]
        return response, None
    generation = lib.generation()
    key = _cache_key(request, models, rag)
    if request["cache"]:
        cached = state.cached(key, generation)
        if cached is not None:
            cached["cached"] = True
            return _with_evidence_if_asked(lib, state, request, cached), None
    hits, kind, notes, query_vec, keyword_strength = retrieve(lib, request, models, state)
    if query_vec is not None:
        response["vectors"] = vector_coverage(lib, state, models)
        if response["vectors"].get("refused"):
            notes.append(
                f"vectors cover {response['vectors']['done']} of {response['vectors']['total']} passages: "
                f"the others' were refused ({response['vectors']['refused']}); keyword search finds them"
            )
        elif response["vectors"]["missing"]:
            notes.append(
                f"vectors cover {response['vectors']['done']} of {response['vectors']['total']} passages so "
                "far (the rest are found by keyword until ingest or reembed adds theirs)"
            )
    degraded = bool(notes)
    response["results"] = hit_records(lib, hits, terms, request["snippet"], with_citations=request["depth"] == "deep")
    response["count"] = len(response["results"])
    response["score_kind"] = kind
    reranker = _reranker_of(models, kind, request["depth"])
    if reranker:
        response["reranker"] = reranker
    if not response["results"]:
        notes.append("no passage matches the query" + (" with these filters" if request["filters"] else ""))
    langs = lib.indexed_languages()
    lang_note = language_note(renderings, langs, vectors_used=query_vec is not None, keyword_strength=keyword_strength)
    if lang_note:
        response["lang_note"] = lang_note
    if notes:
        response["notes"] = notes
        response["note"] = "; ".join(notes)
    if request["cache"] and not degraded:
        state.remember(key, generation, response)  # a degraded answer may improve once a model arrives
    return _with_evidence_if_asked(lib, state, request, response), query_vec


def _with_evidence_if_asked(
    lib: Library, state: LibraryState, request: dict, response: SearchResponse
) -> SearchResponse:
    """The response with snippet boxes and pictures when the request asks for them (a copy: the cached answer
    stays bare)."""
    if not (request["boxes"] or request["pictures"]) or not response["results"]:
        return response
    shown = response.copy()
    shown["results"] = with_evidence(
        lib, response["results"], state.pages, boxes=request["boxes"], pictures=request["pictures"]
    )
    return shown


def related_work(lib: Library, models: Models, state: LibraryState, query_vec, evidence: list[dict]) -> list[dict]:
    """Other library papers close to the evidence: by topic (document centroids) or shared authors."""
    import numpy as np

    if query_vec is None or not evidence:
        return []
    embedder = library_embedder(lib, models)
    generation = lib.generation()
    if state.centroids is None or state.centroids[:2] != (generation, embedder.model_id):
        ids, matrix = doc_centroids(lib, embedder.dim)
        state.centroids = (generation, embedder.model_id, ids, matrix)
    _, _, ids, matrix = state.centroids
    if not ids:
        return []
    position = {doc_id: i for i, doc_id in enumerate(ids)}
    evidence_docs = [e["doc_id"] for e in evidence if e["doc_id"] in position]
    if not evidence_docs:
        return []
    anchor = matrix[[position[d] for d in dict.fromkeys(evidence_docs)]].mean(axis=0)
    anchor /= np.linalg.norm(anchor) or 1.0
    to_evidence, to_query = matrix @ anchor, matrix @ np.asarray(query_vec, dtype=np.float32)
    # closeness to the evidence on the papers' scale, measured per model (PAPER_SCALES); to the query, on the
    # probes' scale (UNRELATED_PROBES), since a question is a sentence
    similarity, relative = embedder.paper_similarity, embedder.relative_similarity
    min_topic, min_query = related_thresholds()
    evidence_authors = {_surname(a) for e in evidence for a in e["authors"]} - {""}
    candidates = []
    for doc_id, i in position.items():
        if doc_id in evidence_docs or relative(float(to_query[i])) < min_query:
            continue
        candidates.append((similarity(float(to_evidence[i])), doc_id))
    candidates.sort(reverse=True)
    rows = lib.doc_summaries([c[1] for c in candidates])
    related = []
    for topic, doc_id in candidates:
        row = rows[doc_id]
        authors = json.loads(row["authors"] or "[]")
        shared = evidence_authors & {_surname(a) for a in authors}
        if topic < min_topic and not (shared and topic >= min_topic - 0.1):
            continue
        related.append(
            {
                "doc_id": doc_id,
                "title": row["title"],
                "authors": authors,
                "year": row["year"],
                "doi": row["doi"],
                "path": row["path"],
                "similarity": round(topic, 2),
                "reason": "same author, related topic" if shared else "related topic",
            }
        )
        if len(related) >= RELATED_MAX:
            break
    return related


def related_thresholds() -> tuple[float, float]:
    def env_float(name, default):
        try:
            return float(os.environ.get(name, default))
        except ValueError:
            return default

    return env_float("KB_RELATED_MIN_SIM", 0.5), env_float("KB_RELATED_MIN_QUERY_SIM", 0.35)


def _surname(name: str) -> str:
    name = name.strip()
    if "," in name:
        return name.split(",")[0].strip().lower()
    return name.split()[-1].lower() if name.split() else ""
