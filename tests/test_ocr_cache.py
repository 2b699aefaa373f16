"""The OCR cache is only ever a shortcut, and a large scan is read, not called damaged (issue 50, points 4 and 10).

A cached row that cannot be used (not JSON, the wrong shape or types, numbers that are not finite, nested past the
JSON parser's depth, a blob) is a miss: under ``ingest {rebuild}`` and ``force`` only that page is OCR'd again,
its row is replaced, the document keeps its passages and ``show`` draws it. A cache file that is not a database
is no cache (said in the entry, left as it is); a symbolic link at the cache's path is never followed. An engine
error while a page is read fails the file, which keeps what was indexed, where it used to pass for a damaged
page. An image-only page of 76 inches, which MuPDF cannot draw at 250 dpi, is OCR'd at the dpi that fits
KB_OCR_MAX_MEGAPIXELS (the entry says so) in bounded memory; past OCR_MIN_DPI it is ``too_large``, never
``corrupt``.

The cache tests OCR through a stand-in that answers with lines the real OCR read once for this module (the
module's fixture): each asserts which pages were OCR'd again. One test goes the way a user does, the command line
with the real OCR."""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys

import pytest

from helpers import ENGINE, clean_env, ingest_peak_memory, run_cli

# About the engine's own functions (the OCR stand-in, the cache rows): reaches names outside kb_engine.__all__.
# OCR of generated scan pages, a few seconds each.
pytestmark = [pytest.mark.internals, pytest.mark.slow]

PAGES = {1: ("Glacier Survey Notes", "moraine crevasse meltwater terminus retreat measured along the eastern "
                                     "tongue of the glacier during the first field season"),
         2: ("Second Field Season", "ablation stakes firn density and supraglacial streams recorded on the "
                                    "western plateau after the summer melt")}


def small_scan(target):
    """An image-only PDF of two A6 pages (a heading and a paragraph each, scanned at 200 dpi in grey)."""
    import pymupdf
    with pymupdf.open() as source, pymupdf.open() as scan:
        for heading, text in PAGES.values():
            page = source.new_page(width=298, height=420)
            page.insert_text((24, 48), heading, fontsize=14)
            page.insert_textbox(pymupdf.Rect(24, 64, 274, 380), f"{text}. " * 3, fontsize=10)
            picture = page.get_pixmap(dpi=200, colorspace=pymupdf.csGRAY)
            scan.new_page(width=298, height=420).insert_image(scan[-1].rect, pixmap=picture)
        scan.save(target, deflate=True)
    return target


def rows(cache_file) -> dict[int, str]:
    with sqlite3.connect(cache_file) as conn:
        return dict(conn.execute("SELECT page, lines FROM ocr_pages"))


def set_row(cache_file, page: int, value) -> None:
    with sqlite3.connect(cache_file) as conn:
        assert conn.execute("UPDATE ocr_pages SET lines = ? WHERE page = ?", (value, page)).rowcount == 1


@pytest.fixture(scope="module")
def scan_and_cache(kb_engine, tmp_path_factory):
    """The two-page scan, OCR'd once for real through page_texts: its cache file and the good lines of each page."""
    pytest.importorskip("rapidocr_onnxruntime")
    folder = tmp_path_factory.mktemp("ocr_cache_scan")
    scan = small_scan(folder / "glacier_scan.pdf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KB_CACHE_DIR", str(folder / "cache"))
        mp.setenv("KB_OCR", "auto")
        texts = kb_engine.page_texts(str(scan))
    for number, text in enumerate(texts, start=1):
        assert PAGES[number][0].split()[0] in text, text        # the real OCR read each page
    cache_file = folder / "cache" / kb_engine.OCR_CACHE_FILENAME
    good = {page: json.loads(lines) for page, lines in rows(cache_file).items()}
    assert sorted(good) == [1, 2]
    return scan, cache_file, good


@pytest.fixture
def library(kb_engine, scan_and_cache, tmp_path, monkeypatch):
    """A library holding the scan, indexed from the cache, and an OCR stand-in that records the pages it reads and
    answers with the real OCR's lines."""
    scan, cache_file, good = scan_and_cache
    papers, kb = tmp_path / "papers", tmp_path / "kb"
    papers.mkdir()
    kb.mkdir()
    shutil.copy(scan, papers / scan.name)
    shutil.copy(cache_file, kb / kb_engine.OCR_CACHE_FILENAME)
    monkeypatch.setenv("KB_OCR", "auto")
    monkeypatch.setenv("KB_INGEST_WORKERS", "0")
    calls: list[int] = []

    def ocr_stand_in(page, *args):
        calls.append(page.number + 1)
        return good[page.number + 1]

    monkeypatch.setattr(kb_engine, "ocr_page_lines", ocr_stand_in)
    engine = kb_engine.Engine()
    first = engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(kb), "background": False})["files"][0]
    assert first["status"] == "added" and first["ocr_pages"] == 2 and calls == [], (first, calls)
    yield {"engine": engine, "kb": kb, "papers": papers, "cache": kb / kb_engine.OCR_CACHE_FILENAME,
           "calls": calls, "good": good, "chunks": first["chunks"]}
    engine.close()


def assert_still_indexed(lib: dict, boxed: bool = True) -> None:
    """The document is indexed with all its passages; a passage of page 2 is found and ``show`` draws it, boxed
    and highlighted from the cache's lines (``boxed``; without a cache the page keeps the file's own layer)."""
    engine, kb = lib["engine"], str(lib["kb"])
    doc = engine.execute("docs", {"kb_root": kb})["docs"][0]
    assert doc["status"] == "indexed" and doc["chunks"] == lib["chunks"], doc
    hit = engine.execute("search", {"query": "ablation stakes firn density", "kb_root": kb, "mode": "keyword",
                                    "boxes": True})["results"][0]
    assert hit["page"] == 2 and hit["ocr"] is True and bool(hit.get("boxes")) is boxed, hit
    shown = engine.execute("show", {**{k: hit[k] for k in ("doc_id", "page", "char_start", "page_end", "char_end")},
                                    "kb_root": kb, "inline": True})
    assert shown["highlighted"] is boxed and shown["images"][0]["page"] == 2, {k: shown[k] for k in shown
                                                                               if k != "images"}


BAD_ROWS = {
    "not JSON": '[["Second Field Season", [24.0, 30.1',
    "the wrong shape": '{"lines": [["Second Field Season", [24, 30, 140, 48], 0.98]]}',
    "the wrong types": '[["Second Field Season", ["24", 30, 140, 48], 0.98]]',
    "a number that is not finite": '[["Second Field Season", [24, 30, NaN, 48], 0.98]]',
    "nesting past the parser's depth": "[" * 200_000 + "]" * 200_000,
    "a blob": b"\xff\xfe\x00[",
}


@pytest.mark.parametrize("kind", list(BAD_ROWS))
def test_a_bad_cache_row_is_a_miss_under_rebuild_and_force(kind, library):
    """Before: ``corrupt: no page of the PDF could be read``, the passages dropped, ``show`` refused. Now only the
    bad page is OCR'd again, its row is replaced by the good lines, and the document stays whole."""
    engine, kb, cache, calls = library["engine"], str(library["kb"]), library["cache"], library["calls"]
    for request in ({"rebuild": True}, {"paths": [str(library["papers"])], "force": True}):
        set_row(cache, 2, BAD_ROWS[kind])
        calls.clear()
        entry = engine.execute("ingest", {**request, "kb_root": kb, "background": False})["files"][0]
        assert entry["status"] == "updated" and entry["ocr_pages"] == 2, (request, entry)
        assert entry["chunks"] == library["chunks"] and "note" not in entry, entry
        assert calls == [2], calls                            # page 1 still came from the cache
        assert json.loads(rows(cache)[2]) == library["good"][2]
        assert_still_indexed(library)


def test_show_draws_a_page_whose_cache_row_is_bad(library):
    """``show`` and snippet boxes read the cache too: a bad row leaves the page with the file's own layer (a scan's
    page is drawn, without the OCR lines to box), where it answered 'the file cannot be opened'."""
    engine, kb = library["engine"], str(library["kb"])
    set_row(library["cache"], 2, BAD_ROWS["not JSON"])
    shown = engine.execute("show", {"doc_id": 1, "page": 2, "kb_root": kb, "inline": True})
    assert shown["images"][0]["page"] == 2 and shown["images"][0]["data"], {k: shown[k] for k in shown
                                                                            if k != "images"}


def test_a_cache_file_that_is_not_a_database_is_no_cache(library):
    """Every page is OCR'd, the entry says the cache could not be used, and the file is left as it was."""
    engine, kb, cache, calls = library["engine"], str(library["kb"]), library["cache"], library["calls"]
    for suffix in ("-wal", "-shm"):
        (cache.parent / (cache.name + suffix)).unlink(missing_ok=True)
    garbage = b"this is not an SQLite database, only its name is\n" * 200
    cache.write_bytes(garbage)
    entry = engine.execute("ingest", {"rebuild": True, "kb_root": kb, "background": False})["files"][0]
    assert entry["status"] == "updated" and entry["ocr_pages"] == 2 and entry["chunks"] == library["chunks"], entry
    assert calls == [1, 2]
    assert f"the OCR cache {cache} could not be used" in entry["note"], entry
    assert cache.read_bytes() == garbage
    assert_still_indexed(library, boxed=False)


@pytest.mark.parametrize("target_exists", [False, True])
def test_a_symbolic_link_at_the_cache_path_is_never_followed(kb_engine, library, tmp_path, monkeypatch,
                                                             target_exists):
    """A dangling link made SQLite create its target wherever it pointed; a link to a file had it written. Now
    the pages are OCR'd without the cache, the entry says why, the target is neither created nor changed."""
    engine, kb, cache, calls = library["engine"], str(library["kb"]), library["cache"], library["calls"]
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "planted.sqlite"
    if target_exists:
        target.write_bytes(b"")
    for suffix in ("", "-wal", "-shm"):
        (cache.parent / (cache.name + suffix)).unlink(missing_ok=True)
    cache.symlink_to(target)
    entry = engine.execute("ingest", {"rebuild": True, "kb_root": kb, "background": False})["files"][0]
    assert target.exists() is target_exists and (not target_exists or target.read_bytes() == b"")
    assert sorted(os.listdir(outside)) == (["planted.sqlite"] if target_exists else [])
    assert entry["status"] == "updated" and entry["ocr_pages"] == 2 and calls == [1, 2], entry
    assert "symbolic link, which is never followed" in entry["note"], entry
    assert cache.is_symlink()
    assert_still_indexed(library, boxed=False)
    # page_texts' own cache, under KB_CACHE_DIR, is refused the same way
    folder = tmp_path / "user_cache"
    folder.mkdir()
    (folder / kb_engine.OCR_CACHE_FILENAME).symlink_to(outside / "user_planted.sqlite")
    monkeypatch.setenv("KB_CACHE_DIR", str(folder))
    assert "ablation" in kb_engine.page_texts(str(library["papers"] / "glacier_scan.pdf"))[1]
    assert not (outside / "user_planted.sqlite").exists()


def test_an_engine_error_on_a_page_fails_the_file_and_keeps_the_index(kb_engine, library, monkeypatch):
    """An exception that is not MuPDF's (here a TypeError in the reader) is the engine's fault, not the file's: the
    entry is ``extract_failed`` naming it, and the indexed document keeps its passages. It used to pass for a
    page that could not be read: the page's passages were dropped without a word. MuPDF's own errors still make a
    damaged page, and a file with only damaged pages ``corrupt``."""
    import pymupdf
    engine, kb = library["engine"], str(library["kb"])
    real = kb_engine._pdf_page_blocks
    broken: dict[int, BaseException] = {}

    def reader(page):
        if page.number + 1 in broken:
            raise broken[page.number + 1]
        return real(page)

    monkeypatch.setattr(kb_engine, "_pdf_page_blocks", reader)
    request = {"paths": [str(library["papers"])], "kb_root": kb, "background": False, "force": True}
    broken[2] = TypeError("an engine bug on page 2")
    entry = engine.execute("ingest", request)["files"][0]
    assert entry["status"] == "error" and entry["reason"] == "extract_failed", entry
    assert "TypeError: an engine bug on page 2" in entry["error"]
    broken.clear()                      # the boxes of assert_still_indexed read the page too
    assert_still_indexed(library)
    broken[2] = pymupdf.mupdf.FzErrorFormat("syntax error in content stream")
    entry = engine.execute("ingest", request)["files"][0]
    assert entry["status"] == "updated" and entry["ocr_pages"] == 1, entry        # page 1 alone
    broken[1] = broken[2]
    entry = engine.execute("ingest", request)["files"][0]
    assert entry["status"] == "error" and entry["reason"] == "corrupt", entry
    assert entry["error"].startswith("no page of the PDF could be read (damaged file: ")
    assert "syntax error in content stream" in entry["error"], entry          # MuPDF's own words


def test_the_cli_rebuild_reads_a_bad_row_again_with_the_real_ocr(kb_engine, scan_and_cache, tmp_path):
    """The user's way, with the real OCR: ``kb-engine ingest`` the scan, its rows go bad, ``ingest --rebuild``
    OCRs the pages again and the library answers from them; ``show`` draws them. (It answered ``corrupt: no page
    of the PDF could be read`` and dropped the passages.)"""
    scan, cache_file, good = scan_and_cache
    papers, kb = tmp_path / "papers", tmp_path / "kb"
    papers.mkdir()
    kb.mkdir()
    shutil.copy(scan, papers / scan.name)
    cache = kb / kb_engine.OCR_CACHE_FILENAME
    shutil.copy(cache_file, cache)
    env = clean_env(KB_OCR="auto", KB_INGEST_WORKERS="0")
    added = run_cli("ingest", {"paths": [str(papers)], "kb_root": str(kb)}, env=env)
    assert added.rc == 0 and added.json["files"][0]["status"] == "added", added
    set_row(cache, 1, '{"not": "lines"')
    set_row(cache, 2, '[["Second Field Season", [24, "30", 140, 48], 0.98]]')
    rebuilt = run_cli("ingest", None, "--rebuild", "--kb-root", str(kb), "--json", env=env)
    assert rebuilt.rc == 0, rebuilt
    entry = json.loads(rebuilt.stdout)["files"][0]
    assert entry["status"] == "updated" and entry["ocr_pages"] == 2, entry
    assert entry["chunks"] == added.json["files"][0]["chunks"]
    for page, (heading, _) in PAGES.items():                # OCR'd again, for real
        lines = json.loads(rows(cache)[page])
        assert kb_engine._ocr_lines_valid(lines) and any(heading.split()[0] in text for text, _, _ in lines), lines
    found = run_cli("search", {"query": "moraine crevasse meltwater", "kb_root": str(kb), "mode": "keyword"}, env=env)
    assert found.rc == 0 and found.json["results"][0]["page"] == 1, found
    shown = run_cli("show", {"doc_id": 1, "page": 1, "kb_root": str(kb)}, env=env)
    assert shown.rc == 0 and shown.json["images"][0]["page"] == 1, shown


def large_scan(target, side: float, pages: int = 1):
    """An image-only PDF of square pages ``side`` points wide, each one cheap picture: a page of large print in
    grey at 100 dpi, stretched over the whole page (the text is over 80 points tall there)."""
    import pymupdf
    with pymupdf.open() as source, pymupdf.open() as scan:
        page = source.new_page(width=612, height=612)
        page.insert_textbox(pymupdf.Rect(40, 40, 572, 572), "Large format survey sheet. Sediment transport along "
                            "the northern channel of the river delta. " * 4, fontsize=16)
        picture = page.get_pixmap(dpi=100, colorspace=pymupdf.csGRAY)
        for _ in range(pages):
            scan.new_page(width=side, height=side).insert_image(scan[-1].rect, pixmap=picture)
        scan.save(target, deflate=True)
    return target


def test_a_76_inch_scan_is_ocrd_at_a_lower_dpi_in_bounded_memory(tmp_path):
    """A 5,500-point page (76 inches) failed MuPDF's 'Overly large image' at 250 dpi and was reported ``corrupt``
    (damaged file). Now it is OCR'd at the dpi that keeps its picture within KB_OCR_MAX_MEGAPIXELS, the entry
    says which, and the ingest (a command-line process, the page read in it) peaks under 1.5 GB: a 5,000-point
    page OCR'd at 250 dpi peaked at about 2 GB."""
    pytest.importorskip("rapidocr_onnxruntime")
    scan = large_scan(tmp_path / "survey_sheet.pdf", 5500)
    env = clean_env(KB_OCR="auto", KB_INGEST_WORKERS="0")
    payload = json.dumps({"paths": [str(scan)], "kb_root": str(tmp_path / "kb")})
    peak_mb, reply = ingest_peak_memory(payload, env)
    entry = reply["files"][0]
    dpi = int((40e6 / (5500 / 72) ** 2) ** 0.5)           # the default KB_OCR_MAX_MEGAPIXELS, 40
    assert entry["status"] == "added" and entry["ocr_pages"] == 1, entry
    assert f"page 1 at {dpi} dpi" in entry["note"] and "KB_OCR_MAX_MEGAPIXELS (40 million pixels)" in entry["note"]
    found = run_cli("search", {"query": "sediment transport northern channel", "kb_root": str(tmp_path / "kb"),
                               "mode": "keyword"}, env=env)
    assert found.rc == 0 and found.json["results"][0]["page"] == 1, found
    print(f"peak resident memory of the ingest: {peak_mb:.0f} MB")
    assert peak_mb < 1536, f"peak {peak_mb:.0f} MB"


def test_a_page_too_large_for_the_minimum_dpi_is_too_large_never_corrupt(kb_engine, tmp_path, monkeypatch):
    """Past OCR_MIN_DPI within the pixel budget a page is not OCR'd: a scan of only such pages is ``too_large``
    with the reason, and one with a readable page keeps it, the entry naming the page left out. (The budget is
    lowered so that a 3,000-point page is past it: no PDF page may be larger than 14,400 points, which the
    default budget reads at 31 dpi.)"""
    import pymupdf
    monkeypatch.setenv("KB_OCR", "auto")
    monkeypatch.setenv("KB_OCR_MAX_MEGAPIXELS", "1")
    monkeypatch.setenv("KB_INGEST_WORKERS", "0")
    monkeypatch.setenv("KB_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(kb_engine, "ocr_page_lines", lambda page, *args: calls.append(page.number) or [])
    only_large = large_scan(tmp_path / "only_large.pdf", 3000)
    with pytest.raises(kb_engine.FileRejected) as refused:
        kb_engine.page_texts(str(only_large))
    assert refused.value.reason == "too_large" and calls == [], refused.value.message
    assert ("page 1 is too large to OCR (under 30 dpi within KB_OCR_MAX_MEGAPIXELS (1 million pixels))"
            in refused.value.message)
    mixed = tmp_path / "papers" / "mixed.pdf"
    mixed.parent.mkdir()
    with pymupdf.open(only_large) as large, pymupdf.open() as doc:
        page = doc.new_page()
        page.insert_textbox(pymupdf.Rect(72, 72, 520, 700), "Survey methods for the delta channel. " * 30,
                            fontsize=11)
        doc.insert_pdf(large)
        doc.save(mixed)
    engine = kb_engine.Engine()
    try:
        reply = engine.execute("ingest", {"paths": [str(tmp_path / "papers"), str(only_large)],
                                          "kb_root": str(tmp_path / "kb"), "background": False})
    finally:
        engine.close()
    files = {entry["path"].rsplit("/", 1)[-1]: entry for entry in reply["files"]}
    assert files["only_large.pdf"]["status"] == "error" and files["only_large.pdf"]["reason"] == "too_large"
    assert files["mixed.pdf"]["status"] == "added", files
    assert "page 2 is too large to OCR" in files["mixed.pdf"]["note"] and calls == [], files


def test_the_library_file_is_never_created_through_a_link(tmp_path):
    """The OCR cache's twin in Storage: a dangling link at kb.sqlite made SQLite create the library wherever it
    pointed. Now the request is refused and the target is never created."""
    kb, outside = tmp_path / "kb", tmp_path / "elsewhere"
    kb.mkdir()
    outside.mkdir()
    (kb / "kb.sqlite").symlink_to(outside / "planted.sqlite")
    (tmp_path / "paper.md").write_text("# Lichens\n\nLichens on granite grow slowly.\n", encoding="utf-8")
    done = subprocess.run([sys.executable, str(ENGINE), "ingest"], capture_output=True, env=clean_env(
        KB_EMBED_MODEL="none"), input=json.dumps({"paths": [str(tmp_path / "paper.md")], "kb_root": str(kb)}).encode(),
        timeout=120)
    reply = json.loads(done.stdout)
    assert reply["ok"] is False and reply["code"] == "bad_request" and "symbolic link" in reply["error"], reply
    assert not (outside / "planted.sqlite").exists() and list(outside.iterdir()) == []
