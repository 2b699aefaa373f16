"""Retrieval: filters, FTS5 keyword candidates, the topic-word order inside long documents (both halves), snippets.

May import: config, models.runtime, reading.blocks, storage, text.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..config import FILTER_YEARS, FTS_COLUMN_WEIGHTS, MAX_FILTER_CHARS, MAX_FILTER_VALUES, SECTION_WEIGHTS, KBError
from ..models.runtime import Embedder
from ..reading.blocks import canonical_section
from ..storage import Library
from ..text import analyze, is_cjk

if TYPE_CHECKING:  # annotations only: these modules import this one
    from ..answers.search import LibraryState


FILTER_KEYS = ("authors", "title", "journal", "kind", "year", "section", "doi", "path", "collection", "tag", "library")


def _shown(value, limit: int = 40) -> str:
    """A request value as an error message quotes it: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _filter_year(value) -> int | None:
    """One year bound of ``filters.year``: an integer (or a string of ASCII digits) within FILTER_YEARS."""
    if value is None or value == "":
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        year = value
    elif (isinstance(value, float) and math.isfinite(value) and value.is_integer()) or (
        isinstance(value, str) and re.fullmatch(r"\s*[0-9]{1,4}\s*", value)
    ):
        year = int(value)
    else:
        year = None
    if year is None or not FILTER_YEARS[0] <= year <= FILTER_YEARS[1]:
        raise KBError(
            "bad_request",
            f"filters.year: {_shown(value)} is not a year (a whole number from {FILTER_YEARS[0]} to {FILTER_YEARS[1]})",
        )
    return year


def _year_bounds(value) -> tuple[int | None, int | None]:
    """(from, to) of ``filters.year``: 2019, "2019", "2015-2020", "2015-", "-2020", [from, to] or
    {"from": .., "to": ..}; anything else, or a range that ends before it starts, is a bad_request."""
    if isinstance(value, dict):
        unknown = sorted(str(k) for k in value if k not in ("from", "to"))
        if unknown:
            raise KBError(
                "bad_request",
                f'filters.year: unknown key(s) {", ".join(unknown)[:80]}; a range is {{"from": year, "to": year}}',
            )
        lo, hi = _filter_year(value.get("from")), _filter_year(value.get("to"))
    elif isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise KBError("bad_request", "filters.year as a range must be [from, to]")
        lo, hi = _filter_year(value[0]), _filter_year(value[1])
    elif isinstance(value, str) and "-" in value:
        match = re.fullmatch(r"\s*([0-9]{1,4})?\s*-\s*([0-9]{1,4})?\s*", value)
        if not match or not any(match.groups()):
            raise KBError(
                "bad_request",
                f'filters.year: {_shown(value)} is not a year or a range such as "2015-2020", "2015-" or "-2020"',
            )
        lo, hi = _filter_year(match.group(1)), _filter_year(match.group(2))
    else:
        lo = hi = _filter_year(value)
    if lo is not None and hi is not None and lo > hi:
        raise KBError("bad_request", f"filters.year: the range {lo}-{hi} ends before it starts")
    return lo, hi


def _filter_values(filters: dict, key: str) -> list:
    """The values of one filter (a list, or one value), checked against the filter limits."""
    value = filters[key]
    values = value if isinstance(value, list) else [value]
    if len(values) > MAX_FILTER_VALUES:
        raise KBError(
            "bad_request", f"filters.{key}: {len(values)} values, more than the {MAX_FILTER_VALUES} one filter may list"
        )
    for v in values:
        if isinstance(v, str) and len(v) > MAX_FILTER_CHARS:
            raise KBError("bad_request", f"filters.{key}: a value longer than {MAX_FILTER_CHARS} characters")
        if isinstance(v, str) and "\x00" in v:
            raise KBError("bad_request", f"filters.{key}: a value holds a NUL character, which no stored text has")
    return values


def filter_sql(filters: dict | None) -> tuple[str, list]:  # noqa: C901
    """SQL conditions over ``docs d`` and ``chunks c`` for the search filters."""
    if not filters:
        return "", []
    if not isinstance(filters, dict):
        raise KBError("bad_request", "filters must be an object")
    unknown = sorted(set(filters) - set(FILTER_KEYS))
    if unknown:
        raise KBError("bad_request", f"unknown filter(s): {', '.join(unknown)[:200]}; known: {', '.join(FILTER_KEYS)}")
    checked = {key: _filter_values(filters, key) for key in filters if key != "year"}
    clauses: list[str] = []
    params: list[object] = []

    def strings(key: str) -> list[str]:
        if filters.get(key) in (None, "", []):
            return []
        values = checked[key]
        if not all(isinstance(v, str) for v in values):
            raise KBError("bad_request", f"filters.{key} must be a string or a list of strings")
        return [v.strip() for v in values]

    for key, column in (
        ("authors", "d.authors"),
        ("title", "d.title"),
        ("journal", "d.journal"),
        ("doi", "d.doi"),
        ("path", "d.path"),
    ):
        if values := strings(key):
            clauses.append("(" + " OR ".join(f"{column} LIKE ? ESCAPE '\\'" for _ in values) + ")")
            params.extend(f"%{_escape_like(v)}%" for v in values)
    # a section matches by its text, and by its kind when the value names one ("methods" finds "Methodology")
    if values := strings("section"):
        matches = []
        for value in values:
            matches.append("c.section LIKE ? ESCAPE '\\'")
            params.append(f"%{_escape_like(value)}%")
            if kind := canonical_section(value):
                matches.append("kb_section_has_kind(c.section, ?)")
                params.append(kind)
        clauses.append("(" + " OR ".join(matches) + ")")
    # Zotero collections and tags match whole names, ignoring case; a collection also covers its sub-collections
    for key, column, nested in (("collection", "d.collections", 1), ("tag", "d.tags", 0)):
        if values := strings(key):
            clauses.append("(" + " OR ".join(f"kb_names_match({column}, ?, {nested})" for _ in values) + ")")
            params.extend(values)
    if libraries := strings("library"):  # a Zotero library, by its whole name, any case
        clauses.append(f"d.zotero_library COLLATE NOCASE IN ({', '.join('?' for _ in libraries)})")
        params.extend(libraries)
    if kinds := strings("kind"):
        clauses.append(f"d.kind IN ({', '.join('?' for _ in kinds)})")
        params.extend(k.lower().lstrip(".") for k in kinds)
    if filters.get("year") not in (None, "", []):
        lo, hi = _year_bounds(filters["year"])
        if lo is not None:
            clauses.append("d.year >= ?")
            params.append(lo)
        if hi is not None:
            clauses.append("d.year <= ?")
            params.append(hi)
    return "".join(f" AND {c}" for c in clauses), params


@functools.lru_cache(maxsize=65_536)
def section_kinds(label: str) -> frozenset:
    """The kinds (canonical section names: methods, results, ...) of the parts of a section label."""
    return frozenset(kind for kind in (canonical_section(part) for part in label.split(" > ")) if kind)


def section_has_kind(label: str | None, kind: str) -> int:
    """SQL function kb_section_has_kind: is one part of the label a section of this kind ("Methodology >
    Data" is a methods section, and so is anything under it)?"""
    return int(bool(label) and kind in section_kinds(label))


def with_filter_functions(lib: Library) -> Library:
    """The library, its connection able to evaluate filter_sql's conditions."""
    lib.conn.create_function("kb_section_has_kind", 2, section_has_kind, deterministic=True)
    return lib


def _escape_like(value: str) -> str:
    return value.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


# A CJK run is indexed as its characters and its character pairs (analyze), so a Chinese phrase of n characters
# puts about 2n terms into a query where the same phrase in English puts n/2 words. In a question that mixes
# scripts, "S2ORC语料库包含多少篇论文", the nineteen terms of the Chinese part then outweigh the one Latin word that
# names what is asked about, and a Chinese guide's passages on 论文 rank above the paper on S2ORC. So each CJK term
# counts CJK_TERM_WEIGHT of a word in the keyword score (about one word per four terms). The scaling is uniform
# within a script, so a question written in one script ranks exactly as before. The crosslang questions (77
# Chinese questions about English papers, most naming a dataset, tool or model in Latin letters): see
# docs/PERFORMANCE.md, "Questions across languages".
CJK_TERM_WEIGHT = 0.25


def term_weight(term: str) -> float:
    """A query term's weight in the keyword score: one for a word, CJK_TERM_WEIGHT for a CJK character or pair."""
    return CJK_TERM_WEIGHT if term and is_cjk(term[0]) else 1.0


def script_groups(terms: list[str]) -> list[list[str]]:
    """The query terms as one group per script (CJK, other), the groups in first-seen order; a question in one
    script is one group."""
    groups: dict[bool, list[str]] = {}
    for term in terms:
        groups.setdefault(term_weight(term) != 1.0, []).append(term)
    return list(groups.values())


def keyword_candidates(lib: Library, terms: list[str], filters: dict | None, limit: int) -> list[tuple[int, float]]:
    """(chunk id, BM25) best first: FTS5 BM25 (k1 1.2, b 0.75) by the evidence alone, each term weighted by
    term_weight; section priors are added later, once, whichever pools are fused."""
    groups = script_groups(terms)
    if len(groups) > 1:
        return _mixed_script_candidates(lib, groups, filters, limit)
    where, params = filter_sql(filters)
    with_filter_functions(lib)
    if lib.has_fts5:
        match = " OR ".join(f'"{t}"' for t in terms)
        if not where:
            split = _fts_split_top(lib, terms, limit)
            return split if split is not None else _fts_top(lib, match, limit)
        return _fts_join(lib, match, limit, where, params)
    return _python_bm25(lib, terms, where, params, limit)


def _mixed_script_candidates(
    lib: Library, groups: list[list[str]], filters: dict | None, limit: int
) -> list[tuple[int, float]]:
    """The weighted BM25 of a question in two scripts. BM25 is a sum over terms, so it is each group's BM25
    times its weight, summed; the candidates are the best of each group, each then scored exactly in the other
    (a passage outside both lists would need to be near the top of neither)."""
    pooled = list(dict.fromkeys(cid for group in groups for cid, _ in keyword_candidates(lib, group, filters, limit)))
    if not pooled:
        return []
    scores = dict.fromkeys(pooled, 0.0)
    terms = [t for group in groups for t in group]
    idfs = query_idfs(lib, terms)
    total, counts = lib.term_counts(terms)
    for group in groups:
        if term_weight(group[0]) == 1.0:
            for chunk_id, score in _scores_among(lib, group, pooled):
                scores[chunk_id] += score
            continue
        for term in group:  # BM25 is linear in each term's idf: FTS5's, rescaled to the script's own
            factor = term_weight(term) * idfs[term] / _idf(total, counts.get(term, 0))
            for chunk_id, score in _scores_among(lib, [term], pooled):
                scores[chunk_id] += factor * score
    return sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:limit]


def _idf(population: int, holding: int) -> float:
    """BM25's idf as FTS5 computes it (a term in over half the passages counts almost nothing). The two counts may
    be read a moment apart while a sync writes (more passages holding the term than the total read before them):
    a term can be in no more passages than there are, and the logarithm's argument stays positive."""
    holding = min(holding, population)
    return max(math.log((population - holding + 0.5) / (holding + 0.5)), 1e-6)


CJK_LANGS = ("zh", "ja", "ko")


def query_idfs(lib: Library, terms: list[str]) -> dict[str, float]:
    """Each query term's idf in the keyword score: among all passages, as FTS5 has it, except in a question that
    mixes scripts. There a CJK term's rarity is judged among the passages of CJK-language documents, the only
    ones that can hold it: in a library that is mostly English every Chinese word is rare, and 包含 and 多少
    ("contains", "how many") would outweigh the one Latin name a question is about."""
    total, counts = lib.term_counts(terms)
    if len(script_groups(terms)) == 1:
        return {t: _idf(total, counts.get(t, 0)) for t in terms}
    population = lib.indexed_chunks_in_languages(CJK_LANGS)
    population = max([population, *(counts.get(t, 0) for t in terms if term_weight(t) != 1.0)])
    return {t: _idf(total if term_weight(t) == 1.0 else population, counts.get(t, 0)) for t in terms}


def _scores_among(lib: Library, terms: list[str], chunk_ids: list[int]) -> list[tuple[int, float]]:
    """BM25 of the given chunks for these terms (chunks without any of them are absent)."""
    among = " AND c.id IN (SELECT value FROM json_each(?))"
    if not lib.has_fts5:
        return _python_bm25(lib, terms, among, [json.dumps(chunk_ids)], len(chunk_ids))
    return lib.fts_scores_among(" OR ".join(f'"{t}"' for t in terms), chunk_ids)


MAX_SECTION_WEIGHT = max(1.0, *SECTION_WEIGHTS.values())


def _fts_top(lib: Library, match: str, limit: int) -> list[tuple[int, float]]:
    """The keyword ranking read from the FTS index alone, without touching the chunk rows."""
    return lib.fts_top(match, limit)


COMMON_TERM_SHARE = 0.1  # a query word found in more chunks than this is "common" (see _fts_split_top)
BM25_K1 = 1.2


def _fts_split_top(lib: Library, terms: list[str], limit: int) -> list[tuple[int, float]] | None:
    """The exact keyword ranking without scoring every chunk that holds a common query word; None to decline.

    FTS5 spends most of a query on BM25 for each matching row, and a word found in a large share of the chunks
    makes that nearly every row. So the matches are split by what they contain: rows with a rarer query word and
    no common one, and rows with both. Each set is ranked exactly (every query word is in each expression once,
    so the sums are the full BM25). What is left out holds common words only; BM25 caps each word's share at
    idf x (k1 + 1), so when the answer's weakest score beats that cap, no such row could enter it. Otherwise the
    caller ranks every match.
    """
    total, counts = lib.term_counts(terms)
    common = [t for t in terms if counts.get(t, 0) > total * COMMON_TERM_SHARE]
    rare = [t for t in terms if counts.get(t, 0) and t not in common]
    if not common or not rare:
        return None
    idf = sum(max(math.log((total - counts[t] + 0.5) / (counts[t] + 0.5)), 1e-6) for t in common)
    cap = (BM25_K1 + 1) * idf
    rare_expr = "(" + " OR ".join(f'"{t}"' for t in rare) + ")"
    common_expr = "(" + " OR ".join(f'"{t}"' for t in common) + ")"
    rows = []
    for expression in (f"{rare_expr} NOT {common_expr}", f"{common_expr} AND {rare_expr}"):
        rows.extend(_fts_top(lib, expression, limit))
    rows.sort(key=lambda item: (-item[1], item[0]))
    top = rows[:limit]
    if len(top) < limit or top[-1][1] <= cap:
        return None
    return top


def _fts_join(lib: Library, match: str, limit: int, where: str, params: list) -> list[tuple[int, float]]:
    """Every match joined with its chunk and document (for filters), ranked in SQL."""
    return lib.fts_filtered_top(match, where, params, limit)


def _python_bm25(lib: Library, terms: list[str], where: str, params: list, limit: int) -> list[tuple[int, float]]:
    """BM25 over the stored term strings, for a sqlite3 without FTS5 (slow on big libraries)."""
    stats = lib.term_strings()
    n_docs = len(stats) or 1
    avg_len = [sum(len(r[i].split()) for r in stats) / n_docs or 1.0 for i in (0, 1)]
    doc_freq = {t: 0 for t in terms}
    for body, heading in stats:
        present = set(body.split()) | set(heading.split())
        for t in terms:
            doc_freq[t] += t in present
    rows = lib.filtered_term_strings(where, params)
    scored = []
    for chunk_id, body, heading in rows:
        score = 0.0
        for text, avg, col_weight in zip((body, heading), avg_len, FTS_COLUMN_WEIGHTS):
            tokens = text.split()
            for t in terms:
                tf = tokens.count(t)
                if tf:
                    idf = math.log(1 + (n_docs - doc_freq[t] + 0.5) / (doc_freq[t] + 0.5))
                    score += col_weight * idf * tf * 2.2 / (tf + 1.2 * (0.25 + 0.75 * len(tokens) / avg))
        if score > 0:
            scored.append((chunk_id, score))
    scored.sort(key=lambda item: (-item[1], item[0]))
    return scored[:limit]


# A paper's topic words ("graphene", "GW191219") stand in most of its passages: they find the paper but do not
# tell its pages apart, and the abstract, which names them all, outranks the page a question is really about.
# So inside each long document among the keyword candidates, the passages are re-ordered by BM25 with each query
# word's share scaled by how specific the word is to a few of the document's passages:
#     TOPIC_WORD_SHARE + (1 - TOPIC_WORD_SHARE) * log((n + 1) / (n_word + 0.5)) / log(n + 1)
# (n: the document's passages, n_word: those that hold the word). The document keeps the scores its passages
# earned (the re-ordered passages take over its slots), so how documents interleave in the ranking is unchanged.
# The share of a word found in every passage: hybrid MRR@10 on the full-text questions sits on a plateau of
# 0.807-0.818 from 0.1 to 0.45 (0.797 at 0.5, 0.787 at 0.6; docs/DESIGN.md); 0.3 is its middle.
TOPIC_WORD_SHARE = 0.3
SPECIFIC_MIN_CHUNKS = 8  # shorter documents (an abstract, a note) have no pages to tell apart
SPECIFIC_POOL = 100  # keyword candidates that may be re-ordered


def long_documents_of(lib: Library, chunk_ids: list[int]) -> tuple[dict[int, int], set[int]]:
    """(chunk id -> document id, the documents with at least SPECIFIC_MIN_CHUNKS passages) for the given chunks."""
    doc_of = lib.docs_of_chunks(list(dict.fromkeys(chunk_ids)))
    docs = sorted(set(doc_of.values()))
    long_docs = {d for d, n in lib.doc_chunk_counts(docs) if n >= SPECIFIC_MIN_CHUNKS} if docs else set()
    return doc_of, long_docs


def chunks_in_long_documents(lib: Library, chunk_ids: list[int]) -> set[int]:
    doc_of, long_docs = long_documents_of(lib, chunk_ids)
    return {cid for cid, doc in doc_of.items() if doc in long_docs}


def document_aware_order(lib: Library, terms: list[str], ranked: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The keyword ranking with each long document's passages re-ordered by document-specific word weights."""
    if not lib.has_fts5:
        return ranked
    unique_terms = list(dict.fromkeys(terms))

    def rescore(members_of: dict[int, list[int]]) -> dict[int, float]:
        scores: dict[int, float] = {}
        for doc_id, members in members_of.items():
            scores.update(_specific_scores(lib, doc_id, unique_terms, set(members)))
        return scores

    return reorder_within_documents(lib, ranked, rescore)


def reorder_within_documents(
    lib: Library, ranked: list[tuple[int, float]], rescore: Callable[[dict[int, list[int]]], dict[int, float]]
) -> list[tuple[int, float]]:
    """``ranked`` with the candidates of each long document among its first SPECIFIC_POOL re-ordered by
    ``rescore({doc id: its candidates})`` (chunk id -> score); each document keeps the scores its candidates
    earned (they trade slots), so how documents interleave is unchanged."""
    pool = ranked[:SPECIFIC_POOL]
    if not pool:
        return ranked
    doc_of, long_docs = long_documents_of(lib, [c for c, _ in pool])
    members_of: dict[int, list[int]] = {}
    for cid, _ in pool:
        if doc_of.get(cid) in long_docs:
            members_of.setdefault(doc_of[cid], []).append(cid)
    members_of = {
        doc_id: members for doc_id, members in sorted(members_of.items()) if len(members) > 1
    }  # one candidate has no sibling to trade places with
    rescored = rescore(members_of) if members_of else {}
    slots = dict(pool)
    for members in members_of.values():
        earned = sorted((slots[c] for c in members), reverse=True)
        order = sorted(members, key=lambda c: (-rescored.get(c, 0.0), -slots[c], c))
        slots.update(zip(order, earned))
    return sorted(slots.items(), key=lambda item: (-item[1], item[0])) + ranked[SPECIFIC_POOL:]


def _specific_scores(lib: Library, doc_id: int, terms: list[str], members: set[int]) -> dict[int, float]:
    """BM25 of ``members`` (passages of one document) with each word weighted by its specificity there."""
    ids = lib.chunk_ids_of_doc(doc_id)
    lo, hi = min(ids), max(ids)
    scores: dict[int, float] = {}
    for term in terms:
        rows = lib.fts_scores_between(f'"{term}"', lo, hi)
        holding = [(rowid, share) for rowid, share in rows if rowid in ids]
        specificity = math.log((len(ids) + 1) / (len(holding) + 0.5)) / math.log(len(ids) + 1)
        weight = (TOPIC_WORD_SHARE + (1 - TOPIC_WORD_SHARE) * specificity) * term_weight(term)
        for rowid, share in holding:
            if rowid in members:
                scores[rowid] = scores.get(rowid, 0.0) + weight * share
    return scores


# The vector half has the keyword half's trouble in its own form: a passage's embedding is mostly its paper's
# topic (the title rides with every passage, see PASSAGE_FORMATS), and the abstract, closest to that topic, wins
# questions answered on page 6. So within each long document the vector candidates are re-ordered (trading slots,
# as document_aware_order does) by the cosine less the part both vectors owe to the document's own direction m
# (the mean of its passage vectors, unit length):
#     cos(q, c) - TOPIC_DIRECTION_SHARE * cos(q, m) * cos(c, m)
# at share 1 this is the dot product of q and c with m projected out of both. On the full-text questions,
# vector-mode MRR@10 0.664 -> 0.698 (a plateau of 0.696-0.702 from 0.5 to 0.9; 0.684 at 1), hybrid 0.801 -> 0.805
# (docs/DESIGN.md, "Document-aware vector order").
TOPIC_DIRECTION_SHARE = 0.7


def document_directions(lib: Library, doc_ids: list[int]) -> dict:
    """doc id -> the unit mean of its stored passage vectors (documents without vectors are absent)."""
    import numpy as np

    sums: dict[int, Any] = {}
    for doc_id, blob in lib.doc_vectors(doc_ids):
        vector = np.frombuffer(blob, dtype=np.float32)
        sums[doc_id] = sums[doc_id] + vector if doc_id in sums else vector.copy()
    directions = {}
    for doc_id, total in sums.items():
        norm = float(np.linalg.norm(total))
        if norm > 0:
            directions[doc_id] = total / norm
    return directions


def stored_vectors(lib: Library, chunk_ids: list[int]) -> dict:
    import numpy as np

    return {chunk_id: np.frombuffer(blob, dtype=np.float32) for chunk_id, blob in lib.chunk_vectors(chunk_ids)}


def document_aware_vector_order(
    lib: Library, state: LibraryState, embedder: Embedder, query_vec, ranked: list[tuple[int, float]]
) -> list[tuple[int, float]]:
    """The vector ranking with each long document's passages re-ordered by their cosine less its topic share."""
    import numpy as np

    query = np.asarray(query_vec, dtype=np.float32)

    def rescore(members_of: dict[int, list[int]]) -> dict[int, float]:
        directions = state.document_directions(lib, list(members_of), embedder)
        vectors = stored_vectors(lib, [cid for members in members_of.values() for cid in members])
        scores = {}
        for doc_id, members in members_of.items():
            direction = directions.get(doc_id)
            if direction is None:
                continue
            topic = float(query @ direction)
            for cid in members:
                if cid in vectors:
                    scores[cid] = float(query @ vectors[cid]) - TOPIC_DIRECTION_SHARE * topic * float(
                        vectors[cid] @ direction
                    )
        return scores

    return reorder_within_documents(lib, ranked, rescore)


def term_idf(lib: Library, terms: list[str]) -> dict[str, float]:
    total, freq = lib.term_counts(terms)
    total = total or 1
    return {t: math.log(1 + (total - f + 0.5) / (f + 0.5)) for t, f in freq.items()}


def contiguous_runs(page_map: list, text_length: int) -> list[tuple[int, int]]:
    """Spans of chunk text that appear unbroken in the page text (joined paragraphs may not)."""
    starts = [entry[0] for entry in page_map if len(entry) < 5 or not entry[4]]
    if not starts or starts[0] != 0:
        starts = [0] + starts
    return [(lo, hi) for lo, hi in zip(starts, starts[1:] + [text_length]) if hi > lo]


def make_snippet(
    text: str, idf: dict[str, float], size: int, runs: list[tuple[int, int]] | None = None
) -> tuple[str, int, int]:
    """A window of about ``size`` chars around the rarest matched terms: (snippet, start, end).

    The snippet is verbatim chunk text cut at word boundaries (any character for CJK), with an
    ellipsis where it was cut, and never spans two runs that are apart on the page.
    """
    if size <= 0:
        return text, 0, len(text)
    runs = runs or [(0, len(text))]
    hits = [(start, end, idf[term]) for term, start, end in analyze(text, with_offsets=True) if term in idf]
    best_run, best, best_score = runs[0], (runs[0][0], runs[0][0]), -1.0
    for i, (anchor, anchor_end, _) in enumerate(hits):
        run = next((r for r in runs if r[0] <= anchor < r[1]), runs[0])
        seen: dict[int, float] = {}
        last_end = anchor_end
        for start, end, weight in hits[i:]:
            if end - anchor > size or end > run[1]:
                break
            seen[start] = weight
            last_end = end
        # each distinct term counts once: rare terms outweigh repeats of a common one
        score = sum(set(seen.values()))
        if score > best_score:
            best_run, best, best_score = run, (anchor, last_end), score
    run_start, run_end = best_run
    if run_end - run_start <= size:
        start, end = run_start, run_end
    else:
        slack = size - (best[1] - best[0])
        start = max(run_start, best[0] - slack // 3)
        end = min(run_end, start + size)
        start = max(run_start, min(start, end - size))
    start, end = _snap_to_words(text, start, end)
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    prefix = "…" if start > 0 else ""
    suffix = "…" if end < len(text) else ""
    return f"{prefix}{text[start:end]}{suffix}", start, end


def _snap_to_words(text: str, start: int, end: int) -> tuple[int, int]:
    def inside_word(i):
        return 0 < i < len(text) and text[i - 1].isalnum() and text[i].isalnum() and not is_cjk(text[i])

    while start > 0 and inside_word(start) and start < end:
        start += 1
    while end < len(text) and inside_word(end) and end > start:
        end -= 1
    return start, end


def page_offsets_of_span(page_map: list, start: int, end: int) -> tuple[int | None, int | None]:
    """Offsets of chunk characters ``[start, end)`` in the page texts (start page, end page)."""
    first = next((e for e in page_map if e[0] <= start < e[0] + e[3]), None)
    last = next((e for e in reversed(page_map) if e[0] < end <= e[0] + e[3]), None)
    if first is None or last is None or first[2] is None or last[2] is None:
        return None, None
    return first[2] + start - first[0], last[2] + end - last[0]


def pages_of_span(page_map: list, start: int, end: int) -> tuple[int | None, int | None]:
    """Physical pages covered by chunk characters ``[start, end)``."""
    pages = [
        page
        for offset, page, _, length, *_ in page_map
        if page is not None and offset < end and offset + length > start
    ]
    if not pages:
        fallback = [entry[1] for entry in page_map if entry[1] is not None]
        return (fallback[0], fallback[-1]) if fallback else (None, None)
    return pages[0], pages[-1]
