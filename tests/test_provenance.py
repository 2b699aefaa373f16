"""Provenance (issue 4): scholarly metadata from the identifier ladder, reference lists, citation markers
(brackets, superscripts, author-year) linked to their entries, in-library matches on deep hits, parser
revision refresh (metadata_only, rebuild, stale_docs) and citation export.

Every paper is generated here with PyMuPDF (examples/sample_papers.py, section 10) and carries known
metadata, references and markers. No model is loaded: KB_EMBED_MODEL=none and a reranker path that does
not exist, so deep searches run in fused keyword order.
"""
from __future__ import annotations

import json
import sqlite3
import unicodedata
from pathlib import Path

import pytest

from helpers import ROOT, by_name, clean_env, db_path, err_code, req, sp

NO_RERANKER = "/nonexistent/kb-rag-reranker"
MODEL_ENV = {"KB_EMBED_MODEL": "none", "HF_HUB_OFFLINE": "1", "KB_RERANK_MODEL": NO_RERANKER,
             "KB_RERANK_FALLBACK": "none"}


# ---------------------------------------------------------------------------
# fixtures

@pytest.fixture(scope="module")
def model_env():
    with pytest.MonkeyPatch.context() as mp:
        for var in ("KB_ROOT", "KB_DEVICE", "KB_RELATED_MIN_SIM", "KB_RELATED_MIN_QUERY_SIM"):
            mp.delenv(var, raising=False)
        for var, value in MODEL_ENV.items():
            mp.setenv(var, value)
        yield mp


@pytest.fixture
def local_env(monkeypatch):
    """The same environment for a test that builds its own library."""
    for var, value in MODEL_ENV.items():
        monkeypatch.setenv(var, value)


class Lib:
    def __init__(self, engine, root: Path, papers: Path, ingest: dict):
        self.engine, self.root, self.papers, self.ingest = engine, root, papers, ingest
        self.docs = {d["file"]: d for d in self.run("docs", limit=1000)["docs"]}

    def run(self, command: str, **payload) -> dict:
        return self.engine.execute(command, {"kb_root": str(self.root), **payload})

    def doc(self, name: str) -> dict:
        assert name in self.docs, f"{name} is not in the library: {sorted(self.docs)}"
        return self.docs[name]

    def deep(self, query: str, **payload) -> list[dict]:
        payload = {"depth": "deep", "mode": "keyword", "snippet": 2000, "top_k": 10, **payload}
        return self.run("search", query=query, **payload)["results"]

    def hit_in(self, query: str, name: str, **payload) -> dict:
        hits = [h for h in self.deep(query, **payload) if h["file"] == name]
        assert hits, f"no hit in {name} for {query!r}"
        return hits[0]


@pytest.fixture(scope="module")
def lib(model_env, kb_engine, tmp_path_factory):
    """One library with every provenance paper."""
    base = tmp_path_factory.mktemp("provenance")
    papers = base / "papers"
    sp.write_provenance(papers)
    root = base / "kb"
    engine = kb_engine.Engine()
    try:
        resp = engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(root)})
        yield Lib(engine, root, papers, resp)
    finally:
        engine.close()


def chunk_rows(kb_root, path) -> list[tuple[int, str]]:
    """(chunk id, text) of one document, in order, straight from kb.sqlite."""
    con = sqlite3.connect(f"file:{db_path(kb_root)}?mode=ro", uri=True)
    try:
        return con.execute("SELECT c.id, c.text FROM chunks c JOIN docs d ON d.id = c.doc_id WHERE d.path = ? "
                           "ORDER BY c.seq", (str(path),)).fetchall()
    finally:
        con.close()


def doc_text(lib: Lib, name: str) -> str:
    return "\n".join(text for _, text in chunk_rows(lib.root, lib.papers / name))


def by_ref(hit: dict) -> dict[int, dict]:
    cites = hit.get("citations")
    assert isinstance(cites, list), f"deep hit without a citations list: {sorted(hit)}"
    for c in cites:
        assert {"marker", "ref", "doi", "in_library"} <= set(c), c
    return {c["ref"]: c for c in cites}


def library_id(citation: dict):
    match = citation["in_library"]
    if match is None:
        return None
    assert {"doc_id", "title", "doi"} <= set(match), match
    return match["doc_id"]


def nfc(text: str) -> str:
    return unicodedata.normalize("NFKC", text)


# ---------------------------------------------------------------------------
# the library

def test_every_provenance_paper_is_indexed(lib):
    files = by_name(lib.ingest)
    assert len(files) == 13, sorted(files)
    bad = {name: (f["status"], f.get("error")) for name, f in files.items() if f["status"] != "added"}
    assert not bad, bad


# ---------------------------------------------------------------------------
# metadata: the identifier ladder

def test_citing_paper_metadata_from_page_one(lib):
    a = lib.doc("citing_paper_a.pdf")
    assert a["title"] == sp.CITING_TITLE
    assert a["authors"] == sp.CITING_AUTHORS
    assert a["year"] == sp.CITING_YEAR
    assert a["doi"] == sp.CITING_DOI
    b = lib.doc("cited_paper_b.pdf")
    assert (b["title"], b["authors"], b["year"], b["doi"]) == (sp.CITED_TITLE, sp.CITED_AUTHORS, sp.CITED_YEAR,
                                                               sp.CITED_DOI)


def test_arxiv_only_paper_gets_arxiv_doi_and_year(lib):
    d = lib.doc("tokenizer_drift.pdf")
    assert d["doi"] is not None and d["doi"].lower() == sp.ARXIV_DOI      # DOIs are case-insensitive
    assert d["doi"].lower() == "10.48550/arxiv.2301.01234"
    assert d["year"] == sp.ARXIV_YEAR, "the arXiv year, not the file's creation date (2024)"
    assert d["title"] == sp.ARXIV_TITLE, "the arXiv stamp is not the title"
    assert d["authors"] == sp.ARXIV_AUTHORS


@pytest.mark.parametrize("name", ["junk_metadata.pdf", "junk_metadata_plain.pdf"])
def test_junk_pdf_metadata_title_is_never_used(lib, name):
    title = lib.doc(name)["title"]
    assert title != sp.JUNK_META_TITLE
    assert "microsoft word" not in title.lower() and "draft3" not in title.lower(), title
    if name == "junk_metadata.pdf":
        assert title == sp.JUNK_PAGE_TITLE


@pytest.mark.internals
def test_section_heading_is_not_taken_as_title(lib, kb_engine):
    """Page 1 without a typographic title (and junk PDF metadata): the first section heading
    ('Abstract') is not the document's title either."""
    title = lib.doc("junk_metadata_plain.pdf")["title"]
    assert kb_engine.canonical_section(title) is None, title


def test_journal_banner_in_top_margin_is_not_the_title(lib):
    d = lib.doc("journal_banner.pdf")
    assert d["title"] == sp.BANNER_PAPER_TITLE
    assert d["authors"] == sp.BANNER_AUTHORS
    assert d["year"] == sp.BANNER_YEAR
    assert d["journal"] == sp.BANNER_TEXT


def test_chinese_paper_title_and_authors(lib):
    d = lib.doc("citation_tracing_zh.pdf")
    assert d["title"] == sp.ZH_TITLE
    assert d["authors"] == sp.ZH_AUTHORS
    assert d["year"] == sp.ZH_YEAR
    assert d["lang"] == "zh"


def test_chinese_paper_markers_link(lib):
    hit = lib.hit_in("孤立的文件", "citation_tracing_zh.pdf")
    refs = by_ref(hit)
    assert 1 in refs and refs[1]["marker"] == "[1]", hit["citations"]
    assert refs[1]["in_library"] is None


@pytest.mark.parametrize("name, year", [("author_year.pdf", 2019), ("aps_headingless.pdf", 2010),
                                        ("many_citations.pdf", 2022)])
def test_reference_list_does_not_feed_year_or_journal(lib, name, year):
    """A one-page paper whose reference list sits at the bottom of page 1 and that prints no year or
    journal of its own: the years and journals of the cited works are not the paper's (the file's
    creation date is the only year it has)."""
    d = lib.doc(name)
    assert (d["year"], d["journal"]) == (year, None), d


# ---------------------------------------------------------------------------
# citations on deep hits, in-library matches

def test_deep_hit_links_bracket_markers_and_marks_cited_paper_in_library(lib):
    a, b = lib.doc("citing_paper_a.pdf"), lib.doc("cited_paper_b.pdf")
    hit = lib.hit_in(sp.CITING_TOKEN_23, "citing_paper_a.pdf")
    assert hit["doc_id"] == a["doc_id"] and hit["doi"] == sp.CITING_DOI
    assert "[2,3]" in hit["snippet"]
    refs = by_ref(hit)
    assert {2, 3} <= set(refs), hit["citations"]
    assert refs[2]["marker"] == "[2,3]" and refs[3]["marker"] == "[2,3]"
    assert refs[2]["doi"] == sp.CITED_DOI
    assert library_id(refs[2]) == b["doc_id"]
    assert refs[2]["in_library"]["doi"] == sp.CITED_DOI
    assert refs[2]["in_library"]["title"] == sp.CITED_TITLE
    assert refs[3]["doi"] == "10.5555/notinlibrary.2017.301"
    assert refs[3]["in_library"] is None
    assert hit["citations_more"] == 0
    # a hit never matches its own document
    assert all(library_id(c) != a["doc_id"] for c in hit["citations"])


def test_single_marker_links_its_entry(lib):
    hit = lib.hit_in(sp.CITING_TOKEN_1, "citing_paper_a.pdf")
    refs = by_ref(hit)
    assert refs[1]["marker"] == "[1]"
    assert refs[1]["in_library"] is None


def test_range_marker_expands_and_matches_by_title(lib):
    """[4–6]: 4 is the arXiv paper (cited by title, no DOI), 5 is not in the library."""
    hit = lib.hit_in(sp.CITING_TOKEN_456, "citing_paper_a.pdf")
    refs = by_ref(hit)
    assert {4, 5, 6} <= set(refs), hit["citations"]
    assert {nfc(refs[n]["marker"]) for n in (4, 5, 6)} == {"[4\u20136]"}
    assert library_id(refs[4]) == lib.doc("tokenizer_drift.pdf")["doc_id"]
    assert refs[5]["in_library"] is None


def test_in_library_by_first_author_and_year(lib):
    """[6] 'I. Solberg and P. Dubois, Metrologia Notes 59, 12 (2022).' (no title, no DOI) is the
    journal-banner paper by Ingrid Solberg (2022): matched by first author + year."""
    hit = lib.hit_in(sp.CITING_TOKEN_456, "citing_paper_a.pdf")
    refs = by_ref(hit)
    assert 6 in refs, hit["citations"]
    assert library_id(refs[6]) == lib.doc("journal_banner.pdf")["doc_id"], refs[6]


def test_citations_are_capped_with_a_count_of_the_rest(lib):
    hit = lib.hit_in(sp.MANY_TOKEN, "many_citations.pdf")
    cites = hit["citations"]
    assert len(cites) == 8, cites
    assert [c["ref"] for c in cites] == list(range(1, 9))
    assert hit["citations_more"] == sp.MANY_REFERENCE_COUNT - 8


def test_quick_search_has_no_citations(lib):
    hits = lib.run("search", query=sp.CITING_TOKEN_23, depth="quick", mode="keyword")["results"]
    assert hits and hits[0]["file"] == "citing_paper_a.pdf"
    for hit in hits:
        assert "citations" not in hit and "citations_more" not in hit, sorted(hit)


def test_reference_entries_are_not_searchable(lib):
    assert lib.run("search", query=sp.CITING_REF_TOKEN, mode="keyword")["results"] == []
    assert sp.CITING_REF_TOKEN not in doc_text(lib, "citing_paper_a.pdf").lower()


# ---------------------------------------------------------------------------
# superscript citations

def test_superscript_citations_become_bracket_markers(lib):
    text = nfc(doc_text(lib, "superscript_citations.pdf"))
    assert "graphene[1,2]" in text, text[:600]
    assert "bilayers[3]" in text
    assert "boundaries[4\u20136]" in text or "boundaries[4-6]" in text


def test_superscript_markers_link_to_their_entries(lib):
    hit = lib.hit_in(sp.SUPER_TOKEN, "superscript_citations.pdf")
    refs = by_ref(hit)
    assert {1, 2, 3} <= set(refs), hit["citations"]
    assert refs[1]["marker"] == "[1,2]" and refs[2]["marker"] == "[1,2]"
    assert refs[3]["marker"] == "[3]"
    assert "graphene[1,2]" in hit["snippet"]


def test_exponents_and_units_stay_plain(lib):
    text = nfc(doc_text(lib, "superscript_citations.pdf"))
    assert "from 105 to 103 per cm2" in text, text
    assert "10[5]" not in text and "10[3]" not in text and "cm[2]" not in text


def test_affiliation_marks_stay_plain(lib, kb_engine):
    page = nfc(kb_engine.page_texts(str(lib.papers / "superscript_citations.pdf"))[0])
    assert "Alice M. Chen1, Rahul Verma2" in page, page[:300]
    assert "1Department of Physics" in page
    assert "Chen[1]" not in page and "[1]Department" not in page
    assert lib.doc("superscript_citations.pdf")["authors"] == sp.SUPER_AUTHORS


def test_without_numbered_reference_list_superscripts_stay_plain(lib):
    text = nfc(doc_text(lib, "superscript_no_references.pdf"))
    assert "graphene1,2" in text, text[:600]
    assert "[1,2]" not in text and "[3]" not in text
    hit = lib.hit_in(sp.SUPER_TOKEN, "superscript_no_references.pdf")
    assert hit["citations"] == [] and hit["citations_more"] == 0


# ---------------------------------------------------------------------------
# APS-style list without a heading

def test_headingless_numbered_list_is_found_and_not_indexed(lib):
    assert lib.run("search", query=sp.APS_REF_TOKEN, mode="keyword")["results"] == []
    text = doc_text(lib, "aps_headingless.pdf")
    assert sp.APS_REF_TOKEN not in text.lower()
    assert "Phys. Rev. B 61, 3456" not in text


def test_headingless_list_markers_link(lib):
    hit = lib.hit_in(sp.APS_BODY_TOKEN, "aps_headingless.pdf")
    refs = by_ref(hit)
    assert {1, 2, 3} <= set(refs), hit["citations"]
    assert refs[1]["marker"] == "[1]" and refs[2]["marker"] == "[2,3]" and refs[3]["marker"] == "[2,3]"
    assert "Mahler" in refs[1]["text"] and "Lund" in refs[3]["text"]


# ---------------------------------------------------------------------------
# author-year citations

def test_author_year_citation_resolves_when_unambiguous(lib):
    hit = lib.hit_in(sp.AUTHOR_YEAR_TOKEN, "author_year.pdf")
    refs = by_ref(hit)
    assert sp.AUTHOR_YEAR_SMITH in refs, hit["citations"]
    assert refs[sp.AUTHOR_YEAR_SMITH]["marker"] == "Smith et al., 2010"
    assert "Reading habits of library users" in refs[sp.AUTHOR_YEAR_SMITH]["text"]
    # (Brown et al., 2015) matches two entries: not linked
    assert not any("Brown" in c["marker"] for c in hit["citations"]), hit["citations"]
    assert set(refs) == {sp.AUTHOR_YEAR_SMITH}


def test_author_year_citation_not_resolved_when_two_entries_match(lib):
    hit = lib.hit_in(sp.AUTHOR_YEAR_TOKEN, "author_year_ambiguous.pdf")
    assert hit["citations"] == [], hit["citations"]


# ---------------------------------------------------------------------------
# reference entry fields

@pytest.mark.internals
@pytest.mark.parametrize("raw, fields", [
    ("B. Okafor and L. Santos, \u201cReference Parsing for Scholarly Sample Libraries,\u201d J. Test. Libr. 5, 10 "
     "(2023), https://doi.org/10.5555/kbrag.2023.042.",
     {"doi": "10.5555/kbrag.2023.042", "title": "Reference Parsing for Scholarly Sample Libraries",
      "first_author": "okafor", "year": 2023}),
    ("A. Mahler and B. Roth, Phys. Rev. B 61, 3456 (2000).",
     {"doi": None, "title": None, "first_author": "mahler", "year": 2000}),
    ("Smith, J. A., Jones, B., & Lee, C. (2010). Reading habits of library users. "
     "Library Science Review, 7, 10\u201325.",
     {"doi": None, "title": "Reading habits of library users", "first_author": "smith", "year": 2010}),
    ("Lindgren, P. & Okoro, T. Scaling of graphene production. Carbon Rev. 3, 1\u201322 (2015).",
     {"doi": None, "title": "Scaling of graphene production", "first_author": "lindgren", "year": 2015}),
    ("Smith JA, Jones B. Reading habits of library users. Libr Sci Rev. 2010;7:10-25. doi:10.1000/xyz.123",
     {"doi": "10.1000/xyz.123", "title": "Reading habits of library users", "first_author": "smith", "year": 2010}),
    ("张伟，刘洋．个人文献库的组织与管理[J]．图书情报工作，2019，63（3）：20-28．",
     {"doi": None, "title": "个人文献库的组织与管理", "year": 2019}),
], ids=["ieee", "aps", "apa", "nature", "vancouver", "gbt7714"])
def test_parse_reference_fields(kb_engine, raw, fields):
    ref = kb_engine.parse_reference(7, raw)
    assert ref.num == 7
    got = {key: getattr(ref, key) for key in fields}
    assert got == fields, raw


# ---------------------------------------------------------------------------
# parser revision: metadata_only, rebuild, stale_docs

def test_metadata_only_refreshes_title_without_rechunking_then_rebuild_reparses(local_env, kb_engine, tmp_path):
    papers, root = tmp_path / "papers", tmp_path / "kb"
    path = sp.make_retitled_paper(papers)
    engine = kb_engine.Engine()
    try:
        run = lambda cmd, **p: engine.execute(cmd, {"kb_root": str(root), **p})  # noqa: E731
        assert run("ingest", paths=[str(papers)])["files"][0]["status"] == "added"
        doc = run("docs")["docs"][0]
        assert doc["title"] == sp.RETITLE_OLD
        before = chunk_rows(root, path)
        assert before and any(sp.RETITLE_OLD_TOKEN in text for _, text in before)

        sp.make_retitled_paper(papers, corrected=True)          # same path, corrected title and one new word
        resp = run("ingest", metadata_only=True)
        assert [Path(f["path"]).name for f in resp["files"]] == [path.name]
        assert resp["files"][0]["status"] != "error", resp["files"][0]
        assert resp["totals"].get("chunks_written", 0) == 0
        doc = run("docs")["docs"][0]
        assert doc["title"] == sp.RETITLE_NEW
        assert chunk_rows(root, path) == before, "metadata_only must not re-chunk"
        assert run("search", query=sp.RETITLE_NEW_TOKEN, mode="keyword")["results"] == []
        assert len(run("search", query=sp.RETITLE_OLD_TOKEN, mode="keyword")["results"]) == 1

        resp = run("ingest", rebuild=True)
        assert [(Path(f["path"]).name, f["status"]) for f in resp["files"]] == [(path.name, "updated")]
        after = chunk_rows(root, path)
        assert any(sp.RETITLE_NEW_TOKEN in text for _, text in after)
        assert not any(sp.RETITLE_OLD_TOKEN in text for _, text in after)
        hits = run("search", query=sp.RETITLE_NEW_TOKEN, mode="keyword")["results"]
        assert len(hits) == 1 and hits[0]["title"] == sp.RETITLE_NEW
        assert run("docs")["docs"][0]["title"] == sp.RETITLE_NEW
    finally:
        engine.close()


def test_metadata_only_and_rebuild_exclude_each_other(local_env, kb_engine, tmp_path):
    engine = kb_engine.Engine()
    try:
        with pytest.raises(kb_engine.KBError) as exc:
            engine.execute("ingest", {"kb_root": str(tmp_path / "kb"), "metadata_only": True, "rebuild": True})
        assert err_code(exc.value) == "bad_request"
    finally:
        engine.close()


@pytest.mark.internals
def test_stale_docs_counted_and_not_reparsed_by_a_normal_ingest(local_env, kb_engine, tmp_path):
    papers, root = tmp_path / "papers", tmp_path / "kb"
    sp.make_cited_paper(papers)
    sp.make_arxiv_only_paper(papers)
    engine = kb_engine.Engine()
    try:
        run = lambda cmd, **p: engine.execute(cmd, {"kb_root": str(root), **p})  # noqa: E731
        assert {f["status"] for f in run("ingest", paths=[str(papers)])["files"]} == {"added"}
        stats = run("stats")
        assert stats["stale_docs"] == 0 and stats["parser_revision"] == kb_engine.PARSER_REVISION
        old_doc = next(d for d in run("docs")["docs"] if d["file"] == "cited_paper_b.pdf")
        chunks_before = chunk_rows(root, papers / "cited_paper_b.pdf")

        con = sqlite3.connect(str(db_path(root)))
        try:
            with con:
                con.execute("UPDATE docs SET indexed_with = ? WHERE id = ?",
                            (kb_engine.PARSER_REVISION - 1, old_doc["doc_id"]))
        finally:
            con.close()
        assert run("stats")["stale_docs"] == 1

        resp = run("ingest", paths=[str(papers)])
        assert {(Path(f["path"]).name, f["status"]) for f in resp["files"]} == {
            ("cited_paper_b.pdf", "skipped"), ("tokenizer_drift.pdf", "skipped")}
        assert all(f.get("reason") == "unchanged" for f in resp["files"]), resp["files"]
        assert chunk_rows(root, papers / "cited_paper_b.pdf") == chunks_before
        assert run("stats")["stale_docs"] == 1

        resp = run("ingest", rebuild=True)
        assert {(Path(f["path"]).name, f["status"]) for f in resp["files"]} == {
            ("cited_paper_b.pdf", "updated"), ("tokenizer_drift.pdf", "updated")}
        assert run("stats")["stale_docs"] == 0
        rebuilt = next(d for d in run("docs")["docs"] if d["file"] == "cited_paper_b.pdf")
        assert rebuilt["doc_id"] == old_doc["doc_id"] and rebuilt["doi"] == sp.CITED_DOI
    finally:
        engine.close()


# ---------------------------------------------------------------------------
# cite

def test_cite_bibtex(lib):
    a, b = lib.doc("citing_paper_a.pdf"), lib.doc("cited_paper_b.pdf")
    resp = lib.run("cite", doc_ids=[a["doc_id"], b["doc_id"]], format="bibtex")
    assert resp["format"] == "bibtex" and resp["count"] == 2 and resp["not_found"] == []
    assert [e["doc_id"] for e in resp["entries"]] == [a["doc_id"], b["doc_id"]]
    text = resp["text"]
    assert text.count("@") == 2
    entry_a = text.split("\n\n")[0]
    assert entry_a.startswith("@")
    assert f"doi = {{{sp.CITING_DOI}}}" in entry_a
    assert "year = {2024}" in entry_a
    assert "author = {Chen, Alice M. and Verma, Rahul}" in entry_a       # "Family, Given": never ambiguous
    assert f"title = {{{sp.CITING_TITLE}}}" in entry_a
    assert f"doi = {{{sp.CITED_DOI}}}" in text and "author = {Okafor, Bola and Santos, Lucia}" in text
    keys = [e["key"] for e in resp["entries"]]
    assert len(set(keys)) == 2 and all(f"{{{k}," in text for k in keys)


def test_cite_csl_json(lib):
    a = lib.doc("citing_paper_a.pdf")
    resp = lib.run("cite", doc_ids=[a["doc_id"]], format="csl-json")
    items = json.loads(resp["text"])
    assert isinstance(items, list) and len(items) == 1 and resp["count"] == 1
    item = items[0]
    assert item["title"] == sp.CITING_TITLE
    assert item["DOI"] == sp.CITING_DOI
    assert item["author"] == [{"family": "Chen", "given": "Alice M."}, {"family": "Verma", "given": "Rahul"}]
    assert item["issued"] == {"date-parts": [[2024]]}
    assert resp["entries"] == items


def test_cite_unknown_doc_id_is_not_found(lib):
    a = lib.doc("citing_paper_a.pdf")
    resp = lib.run("cite", doc_ids=[a["doc_id"], 987654], format="bibtex")
    assert resp["count"] == 1 and resp["not_found"] == [987654]
    assert sp.CITING_DOI in resp["text"]


@pytest.mark.parametrize("ids", [{}, {"doc_ids": []}])
def test_cite_by_query(lib, ids):
    """A query cites what it finds; an empty doc_ids beside it names no document, so the query decides."""
    resp = lib.run("cite", query=sp.CITING_TOKEN_23, format="bibtex", **ids)
    a = lib.doc("citing_paper_a.pdf")
    assert a["doc_id"] in [e["doc_id"] for e in resp["entries"]], resp
    assert f"doi = {{{sp.CITING_DOI}}}" in resp["text"]


@pytest.mark.parametrize("payload", [{"doc_ids": [1], "format": "ris"}, {"doc_ids": [1], "format": "BibLaTeX"}])
def test_cite_bad_format_is_bad_request(lib, kb_engine, payload):
    with pytest.raises(kb_engine.KBError) as exc:
        lib.run("cite", **payload)
    assert err_code(exc.value) == "bad_request"


# ---------------------------------------------------------------------------
# serve mode

def _strict_json(line: str) -> dict:
    def reject(constant):
        raise ValueError(f"not strict JSON: {constant}")
    return json.loads(line, parse_constant=reject)


def test_serve_deep_search_line_is_strict_json(lib):
    import subprocess
    import sys
    env = clean_env(**MODEL_ENV)
    request = req("deep-1", "search", {"query": sp.CITING_TOKEN_23, "depth": "deep", "mode": "keyword",
                                       "kb_root": str(lib.root)})
    proc = subprocess.run([sys.executable, str(ROOT / "kb_engine.py"), "serve"], input=request + b"\n",
                          capture_output=True, cwd=str(ROOT), env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.decode("utf-8", "strict").splitlines() if ln.strip()]
    replies = [_strict_json(ln) for ln in lines]
    reply = next(r for r in replies if r.get("id") == "deep-1" and r.get("event") != "progress")
    assert reply["ok"] is True, reply
    assert len(lines) == len(replies) == 1, lines
    hit = next(h for h in reply["response"]["results"] if h["file"] == "citing_paper_a.pdf")
    refs = by_ref(hit)
    assert library_id(refs[2]) == lib.doc("cited_paper_b.pdf")["doc_id"]
