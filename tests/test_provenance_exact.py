"""Exact provenance: a hit's (page, char_start) .. (page_end, char_end) is the very text of its
snippet in the engine's page texts, so an agent can quote and locate it mechanically."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from test_search import PROVENANCE_QUERIES

pytestmark = [pytest.mark.slow, pytest.mark.corpus]


def _ws(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _source_text(kb_engine, hit, cache) -> str:
    texts = cache.setdefault(hit["path"], kb_engine.page_texts(hit["path"]))
    if hit["page"] is None:
        return texts[0][hit["char_start"]:hit["char_end"]]
    if hit["page"] == hit["page_end"]:
        return texts[hit["page"] - 1][hit["char_start"]:hit["char_end"]]
    middle = [texts[p - 1] for p in range(hit["page"] + 1, hit["page_end"])]
    return " ".join([texts[hit["page"] - 1][hit["char_start"]:], *middle, texts[hit["page_end"] - 1][:hit["char_end"]]])


def assert_exact_provenance(kb_engine, hits, cache):
    for hit in hits:
        assert isinstance(hit["char_start"], int) and isinstance(hit["char_end"], int), hit
        source = _source_text(kb_engine, hit, cache)
        snippet = hit["snippet"].strip("…")
        # paragraphs cut by a column or page break are joined in a chunk (hyphen dropped), and are
        # separate blocks in the page text: the only allowed differences are whitespace and that hyphen
        unhyphenated = re.sub(r"(?<=\w)-\s+(?=\w)", "", source)
        assert _ws(snippet) in (_ws(source), _ws(unhyphenated)), (hit["file"], hit["page"], snippet, source)


@pytest.mark.parametrize("snippet", [120, 300, 2000])
def test_snippets_are_exact_page_slices(search, kb_engine, snippet):
    cache: dict = {}
    for query in PROVENANCE_QUERIES:
        assert_exact_provenance(kb_engine, search(query, top_k=20, snippet=snippet)["results"], cache)


@pytest.mark.skipif(not os.environ.get("KB_CORPUS_DIR"), reason="KB_CORPUS_DIR not set")
def test_corpus_snippets_are_exact_page_slices(kb_engine, tmp_path_factory):
    corpus = Path(os.environ["KB_CORPUS_DIR"])
    kb = tmp_path_factory.mktemp("exact") / "kb"
    engine = kb_engine.Engine()
    try:
        folders = [corpus / name for name in ("papermage", "refextract", "elegantpaper", "deep-rules", "grobid")
                   if (corpus / name).is_dir()]
        engine.execute("ingest", {"paths": [str(f) for f in folders], "kb_root": str(kb)})
        cache: dict = {}
        checked = 0
        for query in ("neural network training", "electron scattering", "semantic scholar corpus",
                      "citation reference extraction", "模板 字体", "model accuracy evaluation"):
            hits = engine.execute("search", {"query": query, "top_k": 30, "kb_root": str(kb)})["results"]
            assert_exact_provenance(kb_engine, hits, cache)
            checked += len(hits)
        assert checked > 50
    finally:
        engine.close()
