"""Scanned pages become searchable (issue 33, first part): a generated two-column English paper and a Chinese page,
rendered to image-only PDFs, come back through OCR with their text in reading order (similarity to the original
text layer), their sections and page numbers; a page whose text layer is garbage is OCR'd; ``ocr: "off"`` skips
as before; a repeated ingest reads the OCR cache (no OCR call, asserted); without the OCR extra the skip names it.
With the real RapidOCR models of the rapidocr-onnxruntime wheel."""
from __future__ import annotations

import difflib
import io
import json
import os
import random
import re
import shutil
import sqlite3
import sys
import time
from pathlib import Path

import pytest

from helpers import ROOT, ingest_peak_memory, isolate_model_env, use_minilm

sys.path.insert(0, str(ROOT / "examples"))
import sample_papers  # noqa: E402

# About the engine's own functions: reaches names outside kb_engine.__all__ (tests/static/test_public_surface.py).
# slow: OCR of five generated scan pages (about a minute)
pytestmark = [pytest.mark.internals, pytest.mark.slow]

SCAN_DPI = 200          # the resolution of the generated scans (a library scanner's usual setting)


def image_only(source, target, dpi: int = SCAN_DPI):
    """A copy of a PDF whose pages are only pictures of the original pages: no text layer at all."""
    import pymupdf
    with pymupdf.open(source) as original, pymupdf.open() as copy:
        for page in original:
            picture = page.get_pixmap(dpi=dpi, colorspace=pymupdf.csGRAY)
            scanned = copy.new_page(width=page.rect.width, height=page.rect.height)
            scanned.insert_image(scanned.rect, pixmap=picture)
        copy.save(target)
    return target


def garbled_copy(source, target):
    """A scan with a text layer that reads as private-use characters (a font whose map points nowhere)."""
    import pymupdf
    image_only(source, target)
    with pymupdf.open(target) as doc:
        for page in doc:
            page.insert_text((72, 120), "".join(chr(0xE000 + i % 400) for i in range(600)), fontsize=6,
                             render_mode=3)
        doc.saveIncr()
    return target


def compact(text: str) -> str:
    return re.sub(r"\s+", "", text)


def similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


@pytest.fixture(scope="module")
def scans(tmp_path_factory):
    pytest.importorskip("rapidocr_onnxruntime")
    folder = tmp_path_factory.mktemp("ocr_sources")
    two_column = sample_papers.make_twocolumn_paper(folder)
    chinese = sample_papers.make_chinese_paper(folder)
    scans = tmp_path_factory.mktemp("ocr_scans")
    return {"two_column": (two_column, image_only(two_column, scans / "scanned_two_column.pdf")),
            "chinese": (chinese, image_only(chinese, scans / "scanned_chinese.pdf"))}


@pytest.fixture(scope="module")
def ocr_cache(kb_engine, scans, tmp_path_factory):
    """The scans read once through page_texts (the OCR'd text, and its cache file for the ingest tests)."""
    cache = tmp_path_factory.mktemp("ocr_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KB_CACHE_DIR", str(cache))
        mp.setenv("KB_OCR", "auto")
        texts = {name: (kb_engine.page_texts(str(original)), kb_engine.page_texts(str(scan)))
                 for name, (original, scan) in scans.items()}
    return cache / kb_engine.OCR_CACHE_FILENAME, texts


def test_scanned_pages_read_back_in_reading_order(ocr_cache):
    _, texts = ocr_cache
    original, scanned = texts["two_column"]
    assert len(scanned) == len(original) == 2
    for page, (a, b) in enumerate(zip(original, scanned), start=1):
        assert similarity(a, b) >= 0.88, (page, similarity(a, b), b[:600])
    left = compact(scanned[0])
    # the left column's paragraph reads on into its own next line, not into the right column's line beside it
    assert "differsfromfoldinginatesttubeinoneimportantrespect" in left, scanned[0][:1500]
    assert left.index("I.INTRODUCTION") < left.index("Multidomainproteins") < left.index("II.RELATEDWORK")
    original, scanned = texts["chinese"]
    assert similarity(compact(original[0]), compact(scanned[0])) >= 0.9, scanned[0][:600]
    assert "钙钛矿太阳能电池在湿热环境下的稳定性研究" in scanned[0]


def test_ingest_indexes_scans_with_sections_pages_and_a_cache(kb_engine, scans, ocr_cache, tmp_path,
                                                              monkeypatch):
    cache_file, _ = ocr_cache
    papers = tmp_path / "papers"
    papers.mkdir()
    for _, scan in scans.values():
        shutil.copy(scan, papers / scan.name)          # a moved file: the cache is keyed by content
    garbled_copy(scans["two_column"][0], papers / "garbled_layer.pdf")
    kb = tmp_path / "kb"
    kb.mkdir()
    shutil.copy(cache_file, kb / kb_engine.OCR_CACHE_FILENAME)
    monkeypatch.setenv("KB_OCR", "auto")
    calls = []
    real = kb_engine.ocr_page_lines
    monkeypatch.setattr(kb_engine, "ocr_page_lines",
                        lambda page, *args: calls.append(page.number) or real(page, *args))
    engine = kb_engine.Engine()
    try:
        reply = engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(kb), "background": False})
        files = {f["file"] if "file" in f else f["path"].rsplit("/", 1)[-1]: f for f in reply["files"]}
        assert files["scanned_two_column.pdf"]["status"] == "added", files
        assert files["scanned_two_column.pdf"]["ocr_pages"] == 2
        assert files["scanned_chinese.pdf"]["status"] == "added" and files["scanned_chinese.pdf"]["ocr_pages"] == 1
        assert files["garbled_layer.pdf"]["status"] == "added" and files["garbled_layer.pdf"]["ocr_pages"] == 2
        assert len(calls) == 2             # only the garbled copy's two pages were not in the cache
        found = engine.execute("search", {"query": "ribosome exit tunnel cotranslational folding two-domain",
                                          "kb_root": str(kb), "mode": "keyword", "top_k": 5})
        top = found["results"][0]
        assert top["file"] in ("scanned_two_column.pdf", "garbled_layer.pdf") and top["page"] == 1, top
        assert top["ocr"] is True                # the hit says its text was read from a picture of the page
        related = engine.execute("search", {"query": "coarse-grained structure-based models static ribosome",
                                            "kb_root": str(kb), "mode": "keyword", "top_k": 3})
        assert "related" in related["results"][0]["section"].lower(), related["results"][0]
        zh = engine.execute("search", {"query": "氧化铝阻挡层 边缘密封", "kb_root": str(kb), "mode": "keyword",
                                       "boxes": True})
        assert zh["results"][0]["file"] == "scanned_chinese.pdf"
        # the snippet is boxed on the scanned page, from the cached OCR lines: inside the page, where text is
        boxes = zh["results"][0].get("boxes")
        assert boxes, zh["results"][0].get("boxes_note")
        assert boxes[0]["page"] == zh["results"][0]["page"] and boxes[0]["rects"]
        for x0, y0, x1, y1 in boxes[0]["rects"]:
            assert 30 < x0 < x1 < 570 and 40 < y0 < y1 < 800
        english = engine.execute("search", {"query": "ribosome exit tunnel cotranslational folding two-domain",
                                            "kb_root": str(kb), "mode": "keyword", "boxes": True})
        assert all(r.get("boxes") for r in english["results"][:3]), [r.get("boxes_note") for r in english["results"]]
        docs = {d["file"]: d for d in engine.execute("docs", {"kb_root": str(kb)})["docs"]}
        assert docs["scanned_two_column.pdf"]["page_coverage"]["ocr_pages"] == [1, 2]
        assert "Cotranslational Folding" in docs["scanned_two_column.pdf"]["title"]
        stats = engine.execute("stats", {"kb_root": str(kb)})
        assert stats["page_coverage"]["ocr_pages"] == 5 and stats["page_coverage"]["ocr_docs"] == 3

        again = engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(kb), "background": False,
                                          "force": True})
        assert {f["status"] for f in again["files"]} == {"updated"}
        assert len(calls) == 2             # re-read from the cache: no OCR at all
    finally:
        engine.close()


def test_ocr_off_skips_as_before(kb_engine, scans, tmp_path, monkeypatch):
    monkeypatch.setenv("KB_OCR", "auto")
    engine = kb_engine.Engine()
    try:
        reply = engine.execute("ingest", {"paths": [str(scans["chinese"][1])], "kb_root": str(tmp_path / "kb"),
                                          "ocr": "off", "background": False})
        entry = reply["files"][0]
        assert entry["status"] == "skipped" and entry["reason"] == "no_text_layer"
        assert 'ocr: "off"' in entry["error"] and "ocr_pages" not in entry
        with pytest.raises(kb_engine.KBError, match="ocr must be one of auto, off, force"):
            engine.execute("ingest", {"paths": [str(scans["chinese"][1])], "kb_root": str(tmp_path / "kb"),
                                      "ocr": "sometimes"})
    finally:
        engine.close()


def corpus_first_page_reason(kb_engine, name: str) -> str | None:
    """ocr_reason of the first page of a corpus PDF under `auto`, or "absent" without KB_CORPUS_DIR or the file."""
    import pymupdf
    corpus = os.environ.get("KB_CORPUS_DIR")
    real = Path(corpus or "") / name
    if not (corpus and real.is_file()):
        return "absent"
    with pymupdf.open(real) as doc:
        blocks, _ = kb_engine._pdf_page_blocks(doc[0])
        return kb_engine.ocr_reason(doc[0], blocks, "auto")


def test_a_layer_of_ascii_symbols_is_garbled_and_formulas_are_not(kb_engine, scans, tmp_path):
    """A font map that sends letters to ASCII symbols ("2<0= >./?2/") makes a layer of nonsense with no
    replacement or private-use characters: the page is OCR'd ('garbled'), as is the corpus's Chinese journal page
    with such a map. A page dense with formulas keeps its layer."""
    import pymupdf
    original, scan = scans["two_column"]
    with pymupdf.open(original) as doc:
        text = doc[0].get_text()
    # a substitution like the broken map of a real Chinese journal page: letters to digits and symbols
    broken = text.translate(str.maketrans("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
                                          '0123456789!"#$%&*+/;<=>?@^|~.,:0123456789!"#$%&*+/;<'))
    # a physics page: formulas in their sentences, 0.16 of its characters symbols (the corpus's densest: 0.11)
    formulas = " ".join(f"For mode {i} the energy obeys E^2 = p^2c^2 + m^2c^4 and the ratio k/q <= {i} + x; "
                        "the coupling then scales as g ~ 1/r." for i in range(30))
    pages = {}
    with pymupdf.open(scan) as source, pymupdf.open() as doc:
        for name, layer in (("broken", broken), ("formulas", formulas)):
            page = doc.new_page(width=source[0].rect.width, height=source[0].rect.height)
            page.show_pdf_page(page.rect, source, 0)                 # the scanned picture beneath
            page.insert_textbox(page.rect + (40, 40, -40, -40), layer, fontsize=7)
            pages[name] = page.number
        doc.save(tmp_path / "layers.pdf")
    with pymupdf.open(tmp_path / "layers.pdf") as doc:
        for name, expected in (("broken", "garbled"), ("formulas", None)):
            page = doc[pages[name]]
            blocks, _ = kb_engine._pdf_page_blocks(page)
            assert kb_engine.ocr_reason(page, blocks, "auto") == expected, (name, "".join(b.text for b in blocks)[:200])
    assert corpus_first_page_reason(kb_engine, "mineru/zh_biomed_page_garbled_cmap.pdf") in ("garbled", "absent")


def test_a_layer_read_byte_by_byte_is_garbled_and_accented_languages_are_not(kb_engine, tmp_path):
    """A font whose two-byte codes come out as single bytes leaves control characters among Latin-1 letters and
    signs (the corpus's Chinese mathematics page, mineru/garbled_formula.pdf, reads "Ø”\x17 ... dž\x06Ø\x1fª"): the
    page is OCR'd ('garbled'). Czech and Vietnamese prose, as rich in accented letters but free of control
    characters, keeps its layer, as does the same mojibake with its control characters gone."""
    import pymupdf
    chinese = ("本文研究了石墨烯在铜箔上的化学气相沉积生长过程以及"
               "氧气预处理对成核密度的影响结果表明退火时间越长晶畴越大") * 6
    mojibake = chinese.encode("utf-16-be").decode("latin-1")           # each character read as its two bytes
    with pymupdf.open() as doc:
        page = doc.new_page()
        page.insert_textbox(page.rect + (40, 40, -40, -40), mojibake, fontsize=7)
        blocks, _ = kb_engine._pdf_page_blocks(page)
        text = "".join(b.text for b in blocks)
        assert kb_engine._byte_map_share(text) >= kb_engine.OCR_BYTE_MAP_SHARE, text[:120]
        assert kb_engine.ocr_reason(page, blocks, "auto") == "garbled"
    czech = ("Příliš žluťoučký kůň úpěl ďábelské ódy; výsledky měření ukázaly, že teplota žíhání ovlivňuje "
             "hustotu nukleace grafenu na měděné fólii. ") * 8
    vietnamese = ("Kết quả nghiên cứu cho thấy mật độ mầm graphene trên lá đồng giảm khi xử lý oxy trước, và thời "
                  "gian ủ càng dài thì các miền tinh thể càng lớn. ") * 8
    scrubbed = "".join(ch for ch in mojibake if not (ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0))
    for name, layer in (("Czech", czech), ("Vietnamese", vietnamese), ("mojibake without controls", scrubbed)):
        assert kb_engine._byte_map_share(layer) == 0.0, name
    assert sum(0xA0 <= ord(ch) <= 0x24F for ch in vietnamese) / len(vietnamese.replace(" ", "")) > 0.1
    assert corpus_first_page_reason(kb_engine, "mineru/garbled_formula.pdf") in ("garbled", "absent")


def test_a_page_is_read_as_drawn_before_its_layer_goes(kb_engine, scans, monkeypatch, tmp_path):
    """Under force (and for a broken layer, whose glyphs still draw the text) the page is OCR'd as it is drawn,
    and only then is its text layer replaced: removed first, the text would be gone from the picture too."""
    monkeypatch.setenv("KB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KB_OCR", "auto")
    original = scans["two_column"][0]                   # a born-digital PDF: text drawn by its fonts
    layer = kb_engine.page_texts(str(original))
    monkeypatch.setenv("KB_OCR", "force")
    forced = kb_engine.page_texts(str(original))
    assert len(forced) == 2
    for page, (a, b) in enumerate(zip(layer, forced), start=1):
        assert similarity(compact(a), compact(b)) >= 0.9, (page, b[:400])
    corpus = os.environ.get("KB_CORPUS_DIR")
    real = Path(corpus or "") / "mineru" / "zh_biomed_page_garbled_cmap.pdf"
    if corpus and real.is_file():                     # the Chinese captions its broken map garbles
        monkeypatch.setenv("KB_OCR", "auto")
        assert "琼脂糖电泳图" in compact(kb_engine.page_texts(str(real))[0])


def test_without_the_ocr_extra_the_skip_names_it(kb_engine, tmp_path, monkeypatch):
    """No rapidocr-onnxruntime: a scan is skipped as before, and the entry says which extra reads it."""
    monkeypatch.setenv("KB_OCR", "auto")
    monkeypatch.setattr(kb_engine, "ocr_available", lambda: False)
    scan = sample_papers.make_scanned_pdf(tmp_path)
    engine = kb_engine.Engine()
    try:
        entry = engine.execute("ingest", {"paths": [str(scan)], "kb_root": str(tmp_path / "kb"),
                                          "background": False})["files"][0]
    finally:
        engine.close()
    assert entry["status"] == "skipped" and entry["reason"] == "no_text_layer"
    assert "pip install 'kb-rag[ocr]'" in entry["error"], entry


def test_a_document_past_the_page_cap_keeps_its_ocrd_pages(kb_engine, scans, ocr_cache, tmp_path, monkeypatch):
    cache_file, _ = ocr_cache
    kb = tmp_path / "kb"
    kb.mkdir()
    shutil.copy(cache_file, kb / kb_engine.OCR_CACHE_FILENAME)
    monkeypatch.setenv("KB_OCR", "auto")
    monkeypatch.setenv("KB_OCR_MAX_PAGES", "1")
    engine = kb_engine.Engine()
    try:
        entry = engine.execute("ingest", {"paths": [str(scans["two_column"][1])], "kb_root": str(kb),
                                          "background": False})["files"][0]
        assert entry["status"] == "added" and entry["ocr_pages"] == 1, entry
        assert "1 more pages without a text layer were not OCR'd: past KB_OCR_MAX_PAGES (1)" in entry["note"]
        found = engine.execute("search", {"query": "ribosome exit tunnel two-domain protein", "kb_root": str(kb),
                                          "mode": "keyword"})
        assert {r["page"] for r in found["results"]} == {1}
    finally:
        engine.close()


def test_a_page_past_the_time_cap_is_left_out_uncached(kb_engine, scans, ocr_cache, tmp_path, monkeypatch):
    """Page 1 comes from the cache; page 2's recognition starts past its deadline: page 2 is left out
    and not cached, page 1 stays searchable, the entry says so; a later ingest with force and the default cap
    reads page 2. The deadline is met by a stand-in, not by a real page that a busy machine might read slowly
    (or fast): its first recognition is handed a deadline already past, as when rendering and detection ran long."""
    cache_file, _ = ocr_cache
    kb = tmp_path / "kb"
    kb.mkdir()
    cached = kb / kb_engine.OCR_CACHE_FILENAME
    shutil.copy(cache_file, cached)
    sha256 = kb_engine.sha256_of_file(str(scans["two_column"][1]))

    def cached_pages():
        with sqlite3.connect(cached) as conn:
            return sorted(row[0] for row in conn.execute("SELECT page FROM ocr_pages WHERE sha256 = ?", (sha256,)))

    first, second = cached_pages()
    with sqlite3.connect(cached) as conn:
        conn.execute("DELETE FROM ocr_pages WHERE sha256 = ? AND page = ?", (sha256, second))
    monkeypatch.setenv("KB_OCR", "auto")
    monkeypatch.setenv("KB_OCR_PAGE_SECONDS", "300")    # far above any page: only the stand-in runs past it
    real = kb_engine._recognise
    calls = []

    def slow_at_first(reader, crops, deadline):
        calls.append(deadline)
        if len(calls) == 1:                     # past the deadline before the first batch of lines
            deadline = time.monotonic() - 1.0
        return real(reader, crops, deadline)

    monkeypatch.setattr(kb_engine, "_recognise", slow_at_first)
    engine = kb_engine.Engine()
    try:
        args = {"paths": [str(scans["two_column"][1])], "kb_root": str(kb), "background": False}
        entry = engine.execute("ingest", args)["files"][0]
        assert entry["status"] == "added" and entry["ocr_pages"] == 1, entry
        assert "1 pages without a text layer were left out: their OCR ran past KB_OCR_PAGE_SECONDS (300)" \
            in entry["note"], entry
        assert (len(calls), cached_pages()) == (1, [first])
        query = {"query": "refolding trajectories trapped C-terminal strand paired second domain", "kb_root": str(kb),
                 "mode": "keyword"}
        assert {r["page"] for r in engine.execute("search", query)["results"]} == {1}
        monkeypatch.delenv("KB_OCR_PAGE_SECONDS")
        again = engine.execute("ingest", {**args, "force": True})["files"][0]
        assert again["ocr_pages"] == 2 and "KB_OCR_PAGE_SECONDS" not in again.get("note", ""), again
        assert (len(calls), cached_pages()) == (2, [first, second])
        assert engine.execute("search", query)["results"][0]["page"] == 2
    finally:
        engine.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_ocr_pages_are_reported_as_progress(kb_engine, scans, ocr_cache, tmp_path, monkeypatch, workers):
    """Each page a reader goes through with OCR is a progress event, read in-process or in a reader process (whose
    events come back on a queue), before the file's own event; the CLI's bar and the job summary show it."""
    cache_file, _ = ocr_cache
    kb = tmp_path / "kb"
    kb.mkdir()
    shutil.copy(cache_file, kb / kb_engine.OCR_CACHE_FILENAME)      # pages from the cache are reported too
    monkeypatch.setenv("KB_OCR", "auto")
    monkeypatch.setenv("KB_INGEST_WORKERS", str(workers))
    events = []
    engine = kb_engine.Engine(own_process=True)
    try:
        paths = [str(scan) for _, scan in scans.values()]
        engine.execute("ingest", {"paths": paths, "kb_root": str(kb), "background": False}, progress=events.append)
    finally:
        engine.close()
    pages = [(e["path"].rsplit("/", 1)[-1], e["done"], e["total"]) for e in events if e["phase"] == "ocr"]
    assert sorted(pages) == [("scanned_chinese.pdf", 1, 1), ("scanned_two_column.pdf", 1, 2),
                             ("scanned_two_column.pdf", 2, 2)], events
    order = [(e["phase"], e["path"].rsplit("/", 1)[-1]) for e in events if e["phase"] in ("ocr", "files")]
    for name in ("scanned_chinese.pdf", "scanned_two_column.pdf"):
        assert max(i for i, item in enumerate(order) if item == ("ocr", name)) < order.index(("files", name))
    state: dict = {}
    shown = []
    for event in events:
        kb_engine.fold_progress(state, event)
        shown.append(dict(state))
    during = next(s for s in shown if s.get("ocr") and s["ocr"]["done"] == 1 and s["ocr"]["total"] == 2)
    assert during["ocr"]["path"].endswith("scanned_two_column.pdf")
    assert shown[-1].get("ocr") is None and shown[-1]["done"] == 2        # cleared once its file is counted
    bar = kb_engine.ProgressBar(io.StringIO(), piped=True)
    bar.draw(during)
    assert "OCR page 1/2 of scanned_two_column.pdf" in bar.pending, bar.pending
    job = {"job_id": "0123456789ab", "command": "ingest", "state": "running", **during}
    assert "OCR page 1/2 of scanned_two_column.pdf" in kb_engine.render_status({"job": job})


def test_ocr_lines_of_a_table_row_go_left_to_right(kb_engine):
    """Cells of one row whose tops differ by a fraction of a point read left to right, rows top to bottom; two
    columns' lines on shared baselines still read column by column."""
    def line(text, x0, y0, x1, y1):
        return [text, [x0, y0, x1, y1], 0.9]
    table = [line("2022E", 330, 100.4, 360, 110), line("2020", 250, 100.6, 275, 110.2),
             line("2021", 290, 100.2, 315, 110), line("746", 250, 114.3, 270, 124),
             line("1,567", 290, 114.1, 315, 124), line("3,684", 330, 114.2, 360, 124)]
    assert [t for t, _, _ in kb_engine.ocr_rows(table)] == ["2020", "2021", "2022E", "746", "1,567", "3,684"]
    columns = [line("right one", 320, 100, 560, 110), line("left one", 40, 100.3, 280, 110),
               line("left two", 40, 114, 280, 124), line("right two", 320, 113.8, 560, 124)]
    assert [t for t, _, _ in kb_engine.ocr_line_order(columns, 600)] == ["left one", "left two", "right one",
                                                                         "right two"]


def test_ocr_lines_keep_their_heading_numbers_and_the_body_size(kb_engine):
    """The recognizer glues a heading's number to its CJK text ("2.2.1计算基础性能得分"): the layer sets it apart,
    so the heading reads as numbered, but not a number before a measure word ("3个节点"). A line of running text
    whose box a raised citation mark made taller is written at the body size: at its box's height it read as
    set larger, and as a heading; a heading set larger stays larger."""
    import pymupdf
    assert kb_engine.ocr_line_text("2.2.1计算基础性能得分") == "2.2.1 计算基础性能得分"
    assert kb_engine.ocr_line_text("3实验评估") == "3 实验评估"
    assert kb_engine.ocr_line_text("3个节点的结果相近") == "3个节点的结果相近"
    assert kb_engine.ocr_line_text("2023年的观测资料表明土壤水分逐年下降") == "2023年的观测资料表明土壤水分逐年下降"
    assert kb_engine.ocr_line_text("2.Methods") == "2. Methods"

    def line(text, y, height, x1=287):
        return [text, [57, y, x1, y + height], 0.95]
    body = "观测期间共布设二十四个样点每个样点取样三次"            # 21 characters across 230 points: 11 a character
    lines = [line(body, 100 + 16 * n, 10.5) for n in range(8)]
    lines.append(line("处理组的水分利用效率明显高于对照组[8-11]。", 240, 16.5))     # raised marks: a tall box
    lines.append(line("3 实验评估", 262, 14.5, x1=140))
    page = pymupdf.open().new_page(width=595, height=842)
    kb_engine.layer_ocr_lines(page, lines)
    blocks, _ = kb_engine._pdf_page_blocks(page)
    size = {line.text: line.size for block in blocks for line in block.lines}
    # the size a layer line reports follows how far its text was stretched to its box, within a few per cent
    assert abs(size["处理组的水分利用效率明显高于对照组[8-11]。"] - size[body]) < 0.05 * size[body], size
    assert size["3 实验评估"] > 1.2 * size[body]


def test_page_texts_follows_kb_ocr(kb_engine, scans, ocr_cache, monkeypatch):
    """page_texts is the engine's text of a page under the ingest rule: with KB_OCR=off a scan has none, and it
    is refused as ingest refuses it."""
    _, texts = ocr_cache
    monkeypatch.setenv("KB_OCR", "off")
    with pytest.raises(kb_engine.FileRejected, match='OCR is off'):
        kb_engine.page_texts(str(scans["chinese"][1]))
    assert texts["chinese"][1][0].strip()          # the same page under auto (the module's fixture)


def long_scan(target, pages: int = 100):
    """An image-only PDF of ``pages`` small pages (A7, a heading and a paragraph each, scanned at 200 dpi): the
    page count of a thesis at a fifth of an A4 page's OCR time."""
    import pymupdf
    words = ("protein folding ribosome tunnel domain chain residue simulation contact native misfolding translation "
             "codon surface chaperone barrier intermediate radius gyration sheet strand").split()
    rng = random.Random(7)
    with pymupdf.open() as source, pymupdf.open() as scan:
        for number in range(1, pages + 1):
            page = source.new_page(width=210, height=298)
            page.insert_text((24, 40), f"{number}. Run {number} of the series", fontsize=10)
            page.insert_textbox(pymupdf.Rect(24, 52, 186, 270), " ".join(rng.choice(words) for _ in range(30)),
                                fontsize=8)
            picture = page.get_pixmap(dpi=SCAN_DPI, colorspace=pymupdf.csGRAY)
            scan.new_page(width=210, height=298).insert_image(scan[-1].rect, pixmap=picture)
        scan.save(target, deflate=True)
    return target


def test_a_100_page_scan_ingests_in_bounded_memory(tmp_path, monkeypatch):
    """The whole ingest of a 100-page image-only PDF, with the real embedding model, in one process (the CLI; a
    single file is read in-process): its peak resident memory stays under 1.5 GB, every page is OCR'd and
    searchable. The peak on A4 pages is benchmarks/ocr_memory.py's figure."""
    pytest.importorskip("rapidocr_onnxruntime")
    isolate_model_env(monkeypatch)
    use_minilm(monkeypatch)
    scan = long_scan(tmp_path / "thesis_scan.pdf")
    env = {**os.environ, "KB_OCR": "auto", "KB_INGEST_WORKERS": "0"}
    payload = json.dumps({"paths": [str(scan)], "kb_root": str(tmp_path / "kb")})
    peak_mb, reply = ingest_peak_memory(payload, env)
    entry = reply["files"][0]
    assert entry["status"] == "added" and entry["ocr_pages"] == 100, entry
    assert entry["chunks"] >= 50
    print(f"peak resident memory of the ingest: {peak_mb:.0f} MB")
    assert peak_mb < 1536, f"peak {peak_mb:.0f} MB"
