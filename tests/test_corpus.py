"""The whole shared corpus of real-world documents (only with KB_CORPUS_DIR set).

    KB_CORPUS_DIR=../shared/corpus python -m pytest tests/test_corpus.py -q

Expectations are derived from the files themselves with PyMuPDF/python-docx
where the corpus README leaves room (e.g. whether a "scanned" file carries an
OCR text layer), and taken from the README for encrypted and broken files.
"""
from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pymupdf
import pytest

from helpers import assert_readable_error, assert_totals, check_hit_provenance, run_cli

CORPUS = os.environ.get("KB_CORPUS_DIR")
pytestmark = [pytest.mark.skipif(not CORPUS, reason="set KB_CORPUS_DIR to the shared corpus folder"),
              pytest.mark.slow, pytest.mark.corpus]

SUPPORTED = {".pdf", ".docx", ".txt", ".md", ".markdown"}
NO_TEXT = ["ocrmypdf/c02-22.pdf", "ocrmypdf/linn.pdf", "ocrmypdf/skew.pdf", "ocrmypdf/cardinal.pdf",
           "ocrmypdf/francais.pdf", "ocrmypdf/blank.pdf", "mineru/scanned.pdf", "docling/ocr_test.pdf"]
ENCRYPTED = ["pdfminer/aes-128.pdf", "pdfminer/aes-256.pdf", "pdfminer/rc4-40.pdf", "pdfminer/aes-256-r6.pdf",
             "pdfplumber/password-example.pdf", "unstructured/password.pdf", "docling/2206.01062_pg3.pdf"]
BROKEN = ["pdfplumber/empty.pdf", "ocrmypdf/invalid.pdf", "derived/truncated-50pct-2301.05883.pdf"]
MIN_TEXT = 100  # below this many characters a file may be called too short instead of indexed


def _pdf_facts(path: Path) -> dict:
    try:
        with pymupdf.open(path) as doc:
            if doc.needs_pass:
                return {"opens": True, "encrypted": True}
            text = "".join(p.get_text() for p in doc)
            return {"opens": doc.page_count > 0, "encrypted": False, "pages": doc.page_count,
                    "chars": len("".join(text.split())), "repaired": doc.is_repaired}
    except Exception:
        return {"opens": False, "encrypted": False}


def _docx_chars(path: Path) -> int | None:
    try:
        import docx
        d = docx.Document(str(path))
    except Exception:
        return None
    text = "".join(p.text for p in d.paragraphs)
    text += "".join(c.text for t in d.tables for row in t.rows for c in row.cells)
    return len("".join(text.split()))


@pytest.fixture(scope="module")
def corpus_run(tmp_path_factory):
    corpus = Path(CORPUS).resolve()
    kb = tmp_path_factory.mktemp("corpus") / "kb"
    first = run_cli("ingest", {"paths": [str(corpus)], "kb_root": str(kb), "background": False}, timeout=1800)
    second = run_cli("ingest", {"paths": [str(corpus)], "kb_root": str(kb), "background": False}, timeout=600)
    return corpus, kb, first, second


def _rel(corpus: Path, p: str) -> str:
    return Path(os.path.realpath(p)).relative_to(corpus).as_posix()


def test_corpus_ingest_no_crash(corpus_run):
    corpus, kb, first, _ = corpus_run
    assert first.rc == 0, first
    j = first.json
    assert j["ok"] is True
    assert_totals(j)
    expected = sorted(p.relative_to(corpus).as_posix() for p in corpus.rglob("*")
                      if p.is_file() and p.suffix.lower() in SUPPORTED)
    got = sorted(_rel(corpus, f["path"]) for f in j["files"])
    assert got == expected
    for f in j["files"]:
        if f["status"] == "error":
            assert_readable_error(f)
            assert f["reason"] != "internal", f


def test_corpus_statuses(corpus_run):  # noqa: C901
    corpus, _, first, _ = corpus_run
    files = {_rel(corpus, f["path"]): f for f in first.json["files"]}
    problems = []

    def expect(rel, ok, why):
        if not ok:
            f = files[rel]
            problems.append(f"{rel}: {why}; got status={f['status']} reason={f.get('reason')} chunks={f.get('chunks')}")

    for rel in ENCRYPTED:
        expect(rel, files[rel]["status"] == "error" and files[rel].get("reason") == "encrypted", "error/encrypted")
    for rel in BROKEN:
        f = files[rel]
        expect(rel, f["status"] == "error" and bool(f.get("reason")) and bool((f.get("error") or "").strip()),
               "error with a readable reason")
    expect("pdfplumber/empty.pdf", files["pdfplumber/empty.pdf"].get("reason") == "empty", "reason empty")

    for rel, f in files.items():
        path = corpus / rel
        if rel in ENCRYPTED or rel in BROKEN:
            continue
        suffix = path.suffix.lower()
        if suffix == ".pdf":
            facts = _pdf_facts(path)
            if facts["encrypted"]:
                expect(rel, f["status"] == "error" and f.get("reason") == "encrypted", "error/encrypted")
            elif not facts["opens"]:
                expect(rel, f["status"] == "error" and bool(f.get("reason")), "error (PyMuPDF cannot open it)")
            elif facts["chars"] == 0:
                expect(rel, f["status"] == "skipped" and f.get("reason") == "no_text_layer",
                       "skipped/no_text_layer (no text layer)")
            elif rel.startswith("derived/"):
                expect(rel, (f["status"] == "added" and f["chunks"] > 0) or
                       (f["status"] == "error" and bool(f.get("reason"))), "added, or error with a reason")
            elif facts["chars"] >= MIN_TEXT:
                expect(rel, f["status"] == "added" and f["chunks"] > 0, "added with chunks (has a text layer)")
            else:
                expect(rel, (f["status"] == "added" and f["chunks"] > 0) or
                       (f["status"] == "skipped" and bool(f.get("reason"))), "added, or skipped with a reason")
        elif suffix == ".docx":
            chars = _docx_chars(path)
            if chars is None:
                expect(rel, (f["status"] == "added" and f["chunks"] > 0) or
                       (f["status"] == "error" and bool(f.get("reason"))), "added, or error with a reason")
            elif chars >= MIN_TEXT:
                expect(rel, f["status"] == "added" and f["chunks"] > 0, "added with chunks")
            else:
                expect(rel, f["status"] in ("added", "skipped"), "added or skipped")
        else:
            size = path.stat().st_size
            if size == 0:
                expect(rel, f["status"] in ("error", "skipped") and f.get("reason") == "empty", "empty")
            elif size >= MIN_TEXT:
                expect(rel, f["status"] == "added" and f["chunks"] > 0, "added with chunks")
    for rel in NO_TEXT:
        facts = _pdf_facts(corpus / rel)
        if facts.get("chars"):
            expect(rel, files[rel]["status"] == "added", "added (it has an OCR text layer)")
        else:
            expect(rel, files[rel]["status"] == "skipped" and files[rel].get("reason") == "no_text_layer",
                   "skipped/no_text_layer")
    assert not problems, "\n".join(problems)


def test_corpus_reingest_all_skipped(corpus_run):
    corpus, _, first, second = corpus_run
    assert second.rc == 0, second
    j = second.json
    assert_totals(j)
    not_skipped = [(_rel(corpus, f["path"]), f["status"], f.get("reason")) for f in j["files"]
                   if f["status"] != "skipped"]
    assert not not_skipped, not_skipped
    assert j["totals"]["skipped"] == first.json["totals"]["files"]


def test_corpus_docx_is_zip_sanity():
    # guards the docx expectations above: the corpus DOCX files are zip archives
    for p in Path(CORPUS).rglob("*.docx"):
        assert zipfile.is_zipfile(p), p


@pytest.mark.parametrize("query", ["table structure recognition", "graphene", "citation parsing references",
                                   "neural network training", "钙钛矿", "学位论文"])
def test_corpus_snippets_stand_on_their_pages(corpus_run, kb_engine, query):
    _, kb, _, _ = corpus_run
    r = run_cli("search", {"query": query, "kb_root": str(kb), "top_k": 10})
    assert r.rc == 0, r
    for hit in r.json["results"]:
        check_hit_provenance(hit, kb_engine)
        # a reference list is never searchable; a part of the text about references ("（五）参考文献" in a thesis
        # format guide, under its chapter) is, and its label names its chapter first
        top = (hit.get("section") or "").split(" > ")[0].casefold()
        assert "reference" not in top and "bibliograph" not in top and "参考文献" not in top, hit
