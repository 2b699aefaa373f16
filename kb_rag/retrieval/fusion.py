"""Fusion: search hits, the vector index, section priors, hybrid fusion, language notes.

May import: reading.citations, records, retrieval.candidates, storage, text.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..reading.citations import hit_captions, hit_citations
from ..records import HitRecord
from ..retrieval.candidates import (
    CJK_LANGS,
    MAX_SECTION_WEIGHT,
    contiguous_runs,
    document_directions,
    filter_sql,
    make_snippet,
    page_offsets_of_span,
    pages_of_span,
    stored_vectors,
    term_idf,
    with_filter_functions,
)
from ..storage import Library
from ..text import LANGUAGE_NAMES, text_language


@dataclass
class SearchHit:
    chunk_id: int
    score: float


def zotero_link(item_key: str, page: int | None, group: int | None = None) -> str:
    """Deep link that opens the attachment in Zotero's reader, at the page when known; a group library's item is
    named through its group."""
    library = f"groups/{group}" if group else "library"
    return f"zotero://open-pdf/{library}/items/{item_key}" + (f"?page={page}" if page else "")


def _ocr_pages(coverage: str | None) -> set[int]:
    if not coverage or '"ocr_pages"' not in coverage:
        return set()
    try:
        return set(json.loads(coverage).get("ocr_pages") or ())
    except (ValueError, AttributeError, TypeError):
        return set()


def hit_records(
    lib: Library, hits: list[SearchHit], terms: list[str], snippet_size: int, with_citations: bool = False
) -> list[HitRecord]:
    if not hits:
        return []
    idf = term_idf(lib, terms)
    ids = [h.chunk_id for h in hits]
    rows = lib.hit_rows(ids)
    records: list[HitRecord] = []
    for hit in hits:
        row = rows.get(hit.chunk_id)
        if row is None:
            continue
        page_map = json.loads(row["page_map"])
        snippet, start, end = make_snippet(row["text"], idf, snippet_size, contiguous_runs(page_map, len(row["text"])))
        page, page_end = pages_of_span(page_map, start, end)
        if page is None:
            page, page_end = row["page"], row["page_end"]
        char_start, char_end = page_offsets_of_span(page_map, start, end)
        labels = json.loads(row["page_labels"]) if row["page_labels"] else []
        label = (labels[page - 1] or None) if page and page <= len(labels) else None
        if row["block"] == "annotation":
            label = row["page_label"]  # Zotero's own label of the annotated page
        records.append(
            HitRecord(
                chunk_id=row["id"],
                doc_id=row["doc_id"],
                path=row["path"],
                file=Path(row["path"]).name,
                title=row["title"],
                authors=json.loads(row["authors"] or "[]"),
                year=row["year"],
                journal=row["journal"],
                doi=row["doi"],
                kind=row["kind"],
                section=row["section"],
                page=page,
                page_end=page_end,
                page_label=label,
                char_start=char_start,
                char_end=char_end,
                score=hit.score if math.isfinite(hit.score) else 0.0,
                snippet=snippet,
            )
        )
        ocr_pages = _ocr_pages(row["page_coverage"])
        if ocr_pages and page is not None and any(p in ocr_pages for p in range(page, (page_end or page) + 1)):
            records[-1]["ocr"] = True  # the passage's text was read from a picture of its page
        if row["zotero_key"]:
            records[-1]["zotero_key"] = row["zotero_key"]
            records[-1]["zotero_link"] = zotero_link(
                row["zotero_attachment_key"] or row["zotero_key"], page, row["zotero_group"]
            )
        if with_citations:
            records[-1]["citations"], records[-1]["citations_more"] = hit_citations(lib, row["id"], row["doc_id"])
            records[-1]["captions"] = hit_captions(lib, row["text"], row["doc_id"], row["id"])
    return records


# -- vectors ----------------------------------------------------------------------

RERANK_POOL = 20


COMPACT_INDEX_MIN = 250_000  # vectors from which the index stores them as float16 (see below)


def compact_index_min() -> int:
    value = os.environ.get("KB_COMPACT_INDEX_MIN", "").strip()
    return int(value) if value.isdigit() else COMPACT_INDEX_MIN


class VectorIndex:
    """Brute-force inner-product FAISS index over a library's vectors, keyed by chunk id.

    Every vector is compared with the query, so the answer is exact. A single query is bound by memory bandwidth,
    and from COMPACT_INDEX_MIN vectors on the index keeps them as float16: half the memory and about half the
    time (1M x 384: ~90 ms instead of ~175 ms on two cores), the same top 50 (benchmarks/bench_scale.py), with
    scores rounded to about 1e-3.
    """

    def __init__(self, dim: int, model: str, compact: bool = False):
        import faiss

        self.dim = dim
        self.model = model
        self.compact = compact
        inner: Any
        if compact:
            inner = faiss.IndexScalarQuantizer(dim, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
        else:
            inner = faiss.IndexFlatIP(dim)
        self.index = faiss.IndexIDMap2(inner)
        self.generation = -1

    @classmethod
    def load(cls, lib: Library, dim: int, model: str) -> VectorIndex:
        import numpy as np

        chunks = lib.count_chunks()
        index = cls(dim, model, compact=chunks >= compact_index_min())
        index.generation = lib.generation()
        cursor = lib.all_vectors()
        while True:
            rows = cursor.fetchmany(20_000)
            if not rows:
                break
            ids = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
            matrix = np.frombuffer(b"".join(r[1] for r in rows), dtype=np.float32).reshape(len(rows), dim)
            index.index.add_with_ids(matrix, ids)
        return index

    def __len__(self) -> int:
        return self.index.ntotal

    def add(self, lib: Library, chunk_ids: list[int]) -> None:
        import numpy as np

        vectors = stored_vectors(lib, chunk_ids)
        if vectors:
            ids = list(vectors)
            self.remove(ids)
            self.index.add_with_ids(np.stack([vectors[i] for i in ids]), np.array(ids, dtype=np.int64))

    def remove(self, chunk_ids: list[int]) -> None:
        import numpy as np

        if chunk_ids:
            self.index.remove_ids(np.array(chunk_ids, dtype=np.int64))

    def search(self, query_vec, k: int, allowed_ids: list[int] | None) -> list[tuple[int, float]]:
        """(chunk id, cosine) best first; ``allowed_ids`` restricts the search before top-k."""
        import faiss
        import numpy as np

        if self.index.ntotal == 0 or k <= 0:
            return []
        params = None
        if allowed_ids is not None:
            if not allowed_ids:
                return []
            selector = faiss.IDSelectorBatch(np.array(allowed_ids, dtype=np.int64))
            params = faiss.SearchParameters(sel=selector)  # type: ignore[call-arg]  # a SWIG keyword its stubs lack
        k = min(k, self.index.ntotal)
        scores, ids = self.index.search(np.asarray(query_vec, dtype=np.float32).reshape(1, -1), k, params=params)
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0 and math.isfinite(float(s))]


def filtered_chunk_ids(lib: Library, filters: dict | None) -> list[int] | None:
    """Chunk ids passing the filters (None when there are no filters)."""
    where, params = filter_sql(filters)
    if not where:
        return None
    return with_filter_functions(lib).chunk_ids_where(where, params)


def chunk_weights(lib: Library, ids: Iterable[int]) -> dict[int, float]:
    return lib.chunk_weights(list(ids))


# Section weights are a prior, not a verdict. A weight moves a chunk's score by at most SECTION_PRIOR_STRENGTH
# times the gap that separates neighbouring ranks at the top of the same ranking (log-scaled, so the strongest
# weight gives the full amount and weight 1 nothing). It breaks near-ties and lifts a section by a rank or so,
# but it cannot carry a chunk over one that the evidence ranks clearly higher, whatever the scale of the scores:
# fused ranks, BM25, or the bunched cosines of some embedding models. Measured in docs/DESIGN.md.
SECTION_PRIOR_STRENGTH = 1.0
PRIOR_GAP_DEPTH = 10  # ranks over which a score list's own neighbour gap is measured


def section_prior(weight: float) -> float:
    """A section weight as a prior: 1 for the strongest weight, 0 for weight 1, negative below 1."""
    if weight <= 0 or MAX_SECTION_WEIGHT <= 1.0:
        return 0.0
    return math.log(weight) / math.log(MAX_SECTION_WEIGHT)


def neighbour_gap(scores: list[float]) -> float:
    """Mean score difference between neighbouring ranks at the top of a ranking (scores best first)."""
    top = scores[:PRIOR_GAP_DEPTH]
    return (top[0] - top[-1]) / (len(top) - 1) if len(top) > 1 else 0.0


def with_section_prior(
    scored: list[tuple[int, float]], weights: dict[int, float], gap: float
) -> list[tuple[int, float]]:
    """Scores plus each chunk's bounded section prior (``gap``: the ranking's neighbour gap), best first."""
    lift = SECTION_PRIOR_STRENGTH * gap
    out = [(cid, score + lift * section_prior(weights.get(cid, 1.0))) for cid, score in scored]
    out.sort(key=lambda item: (-item[1], -weights.get(item[0], 1.0), item[0]))
    return out


# Hybrid fusion: each half's scores are min-max normalised over its own pool and mixed. Between short documents
# (abstracts, notes) both halves count alike; inside a long document the passages share its topic, and a
# bi-encoder's similarity is mostly that topic, so the exact words of the keyword half tell its pages apart
# better. Measured (docs/PERFORMANCE.md): SciFact (abstracts) best near 0.5, the full-text questions near 0.8;
# reciprocal-rank fusion was below both there.
KEYWORD_SHARE_SHORT_DOCS = 0.5
KEYWORD_SHARE_LONG_DOCS = 0.8
# Below this share of its BM25 ceiling (see bm25_ceiling), a query's best keyword match is weak evidence and the
# keyword half's say in fusion shrinks with the square of the shortfall. A Chinese question over English papers
# reaches 2-7% (stray matches on a model name or a number), English questions over English papers 18-53%,
# SciFact claims 8-80% (2% under it), CSL title queries 10-90% (under 1%).
KEYWORD_TRUST_SHARE = 0.15


def keyword_trust(strength: float) -> float:
    """The factor on the keyword share in fusion for a query whose best keyword match reaches ``strength`` of
    its ceiling: 1 from KEYWORD_TRUST_SHARE up."""
    return min(1.0, max(strength, 0.0) / KEYWORD_TRUST_SHARE) ** 2


# Candidates per half, at least. Min-max scaling is read against the pool's tail, so a deep pool keeps a flat
# score list (cosines) from being stretched over a short range: 200 beat 50 on both SciFact (0.7391 vs 0.7344
# nDCG@10) and the full-text questions (0.795 vs 0.782 MRR@10), at a few milliseconds.
FUSION_POOL = 200


def min_max(scored: list[tuple[int, float]]) -> dict[int, float]:
    """Scores mapped onto [0, 1] over the list (all 1 when they are equal)."""
    if not scored:
        return {}
    low, high = min(s for _, s in scored), max(s for _, s in scored)
    return {cid: (s - low) / (high - low) if high > low else 1.0 for cid, s in scored}


def fuse_halves(
    keyword: list[tuple[int, float]],
    vector: list[tuple[int, float]],
    weights: dict[int, float],
    in_long_docs: set[int],
    keyword_trust: float = 1.0,
) -> list[tuple[int, float]]:
    """The keyword and vector pools combined (a chunk missing from a pool scores 0 there), with the section
    prior, best first."""
    kw, vec = min_max(keyword), min_max(vector)
    fused = []
    for cid in kw.keys() | vec.keys():
        share = keyword_trust * (KEYWORD_SHARE_LONG_DOCS if cid in in_long_docs else KEYWORD_SHARE_SHORT_DOCS)
        fused.append((cid, share * kw.get(cid, 0.0) + (1 - share) * vec.get(cid, 0.0)))
    fused.sort(key=lambda item: (-item[1], item[0]))
    lifted = with_section_prior(fused, weights, neighbour_gap([score for _, score in fused]))
    return keep_dominance(lifted, [cid for cid, _ in fused], kw, vec)


DOMINANCE_DEPTH = 100  # fused candidates checked pairwise (a prior cannot lift a chunk from further down)


def keep_dominance(
    lifted: list[tuple[int, float]], by_evidence: list[int], kw: dict[int, float], vec: dict[int, float]
) -> list[tuple[int, float]]:
    """The prior-lifted ranking, except that no chunk passes one that BOTH halves rank above it: a chunk the
    evidence ranks higher on every count stays higher, whatever the section weights say."""
    score = dict(lifted)
    for position, cid in enumerate(by_evidence[:DOMINANCE_DEPTH]):
        for better in by_evidence[:position]:
            if kw.get(better, -1.0) > kw.get(cid, -1.0) and vec.get(better, -1.0) > vec.get(cid, -1.0):
                score[cid] = min(score[cid], score[better] - 1e-9)
    return sorted(score.items(), key=lambda item: (-item[1], item[0]))


def chunk_texts(lib: Library, ids: list[int]) -> dict[int, str]:
    if not ids:
        return {}
    return lib.chunk_texts(ids)


def doc_centroids(lib: Library, dim: int):
    """(doc ids, unit centroid matrix) of every document with vectors."""
    import numpy as np

    directions = document_directions(lib, lib.doc_ids())
    ids = sorted(directions)
    if not ids:
        return [], np.zeros((0, dim), dtype=np.float32)
    return ids, np.stack([directions[i] for i in ids]).astype(np.float32)


def _script(lang: str) -> str:
    return "cjk" if lang in CJK_LANGS else "latin"


def language_note(
    renderings: list[str], library_langs: dict[str, int], vectors_used: bool = True, keyword_strength: float = 1.0
) -> str | None:
    """A note when keyword matching cannot reach documents because the question is in another language: most of
    the library is in a language no rendering is in, or the keyword half matched nothing well and some documents
    are written in a script no rendering uses (an English question about a Chinese paper in an English library).
    The caller (a language model) can add a rendering in ``queries``."""
    total = sum(library_langs.values())
    if not total:
        return None
    asked = [text_language(text) for text in renderings]
    question = LANGUAGE_NAMES.get(asked[0], asked[0])
    bridge = (
        "only vector similarity can bridge them"
        if vectors_used
        else "no vector similarity was used for this search (keyword mode, or no vectors yet)"
    )
    dominant = max(library_langs, key=library_langs.__getitem__)
    share = library_langs[dominant] / total
    if dominant not in asked and dominant in LANGUAGE_NAMES and share >= 0.8:
        library = LANGUAGE_NAMES[dominant]
        return (
            f"the query is {question} but {share:.0%} of the library is {library}: keyword matching cannot "
            f"bridge the languages and {bridge}; add {_article(library)} {library} rendering of the question "
            "with `queries` (searched alongside the query) to find its passages"
        )
    if keyword_strength >= KEYWORD_TRUST_SHARE:
        return None
    scripts = {_script(lang) for lang in asked}
    unreached = {
        lang: n
        for lang, n in library_langs.items()
        if lang in LANGUAGE_NAMES and lang not in asked and _script(lang) not in scripts
    }
    if not unreached:
        return None
    lang = max(unreached, key=unreached.__getitem__)
    count, library = unreached[lang], LANGUAGE_NAMES[lang]
    return (
        f"no passage matched the {question} query well, and {count} document{'s' if count != 1 else ''} of "
        f"the library {'are' if count != 1 else 'is'} {library}, which keyword matching cannot reach from "
        f"{_article(question)} {question} query ({bridge}); to search {'them' if count != 1 else 'it'} too, "
        f"add {_article(library)} {library} rendering of the question with `queries`"
    )


def _article(word: str) -> str:
    return "an" if word[:1] in "AEIOU" else "a"
