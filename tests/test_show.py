"""`show` (issue 31, point 2): a hit's passage drawn highlighted on its page as PNG.

The check behind "nothing else changed": the picture is compared, pixel by pixel, with a plain render of the same
clip at the same resolution. Every changed pixel must lie inside one of the passage's boxes, and the marker must
cover the boxes (most of their pixels change, and there is ink under them: the boxes sit on the text). Papers are
generated (examples/sample_papers.py), with a rotated copy and a copy whose cropbox is offset."""
from __future__ import annotations

import base64
import os
import time
from pathlib import Path

import pytest

pymupdf = pytest.importorskip("pymupdf")
np = pytest.importorskip("numpy")

from helpers import ENGINE, clean_env, rotated_and_cropped_copies, sp  # noqa: E402

SPAN_KEYS = ("doc_id", "page", "char_start", "page_end", "char_end")


@pytest.fixture(scope="module")
def library(tmp_path_factory, kb_engine):
    folder = tmp_path_factory.mktemp("show")
    papers = {name: getattr(sp, name)(folder) for name in
              ("make_twocolumn_paper", "make_onecolumn_paper", "make_ligature_paper", "make_hyphenated_paper")}
    rotated, cropped = rotated_and_cropped_copies(papers, folder)
    engine = kb_engine.Engine()
    kb_root = folder / ".kb"
    engine.execute("ingest", {"paths": [str(folder)], "kb_root": str(kb_root)})

    def search(query: str, file: str | None = None) -> list[dict]:
        hits = engine.execute("search", {"query": query, "kb_root": str(kb_root), "mode": "keyword", "boxes": True,
                                         "top_k": 10})["results"]
        return [h for h in hits if h["kind"] == "pdf" and (file is None or h["file"] == file)]

    def show(hit: dict, **extra) -> dict:
        return engine.execute("show", {**{k: hit[k] for k in SPAN_KEYS}, "kb_root": str(kb_root), **extra})

    yield {"folder": folder, "engine": engine, "kb_root": kb_root, "search": search, "show": show,
           "papers": papers, "rotated": rotated, "cropped": cropped}
    engine.close()


def pixels(png: bytes) -> np.ndarray:
    pix = pymupdf.Pixmap(png)
    return np.frombuffer(pix.samples, dtype=np.uint8).reshape(pix.height, pix.width, pix.n)[:, :, :3]


def plain_render(path: str, image: dict) -> np.ndarray:
    with pymupdf.open(path) as doc:
        zoom = image["dpi"] / 72
        pix = doc[image["page"] - 1].get_pixmap(matrix=pymupdf.Matrix(zoom, zoom), clip=pymupdf.Rect(image["clip"]),
                                                alpha=False)
        return np.frombuffer(pix.samples, dtype=np.uint8).reshape(pix.height, pix.width, pix.n)[:, :, :3]


def image_bytes(image: dict) -> bytes:
    if "data" in image:
        return base64.b64decode(image["data"])
    with open(image["path"], "rb") as fh:
        return fh.read()


def displayed(path: str, boxes: list[dict]) -> dict:
    """The boxes (PyMuPDF's text coordinates) where the page is displayed and rendered (``page.rect``)."""
    out = {}
    with pymupdf.open(path) as doc:
        for box in boxes:
            page = doc[box["page"] - 1]
            out[box["page"]] = [list((pymupdf.Rect(r) * page.rotation_matrix).normalize()) for r in box["rects"]]
    return out


def check_highlight(path: str, shown: dict) -> None:
    """Changed pixels lie inside the boxes; the boxes are marked and sit on ink."""
    assert shown["highlighted"] is True, shown
    rects_by_page = displayed(path, shown["boxes"])
    assert [i["page"] for i in shown["images"]] == sorted(rects_by_page)
    for image in shown["images"]:
        picture, plain = pixels(image_bytes(image)), plain_render(path, image)
        assert picture.shape == plain.shape == (image["height"], image["width"], 3)
        zoom = image["dpi"] / 72
        x0, y0 = image["clip"][0], image["clip"][1]
        inside = np.zeros(picture.shape[:2], dtype=bool)
        for rx0, ry0, rx1, ry1 in rects_by_page[image["page"]]:
            # pixel (i, j) covers [x0 + i/zoom, x0 + (i+1)/zoom): inside a rect when its whole area is (the clip
            # is the pixel grid a hair inside, hence the 0.01 pt)
            cols = [i for i in range(image["width"])
                    if rx0 - 0.01 <= x0 + i / zoom and x0 + (i + 1) / zoom <= rx1 + 0.01]
            rows = [j for j in range(image["height"])
                    if ry0 - 0.01 <= y0 + j / zoom and y0 + (j + 1) / zoom <= ry1 + 0.01]
            assert cols and rows, (image, rx0, ry0, rx1, ry1)
            block = (slice(rows[0], rows[-1] + 1), slice(cols[0], cols[-1] + 1))
            inside[block] = True
            changed = np.any(picture[block] != plain[block], axis=2)
            assert changed.mean() > 0.5, "the marker does not cover its box"
            assert (plain[block].min(axis=2) < 110).any(), "a box with no ink under it is not on the text"
        changed_anywhere = np.any(picture != plain, axis=2)
        assert changed_anywhere.any()
        assert not (changed_anywhere & ~inside).any(), "pixels changed outside the boxes"


@pytest.mark.parametrize("query, file", [
    ("catalyst photocatalyst electrolysis", "photocatalysis_ligatures.pdf"),
    ("electrolyte viscosity", "battery_electrolytes.pdf"),
    ("protein folding", "protein_folding_2col.pdf"),
    ("electrolyte viscosity", "rotated.pdf"),
    ("photocatalyst", "cropped.pdf"),
])
def test_the_highlight_changes_only_pixels_inside_the_boxes(library, query, file):
    hits = [h for h in library["search"](query, file) if "boxes" in h]
    assert hits, f"no placed hit in {file}"
    for hit in hits[:3]:
        shown = library["show"](hit, inline=True)
        assert shown["boxes"] == hit["boxes"]
        check_highlight(hit["path"], shown)


def test_a_passage_across_a_page_break_gives_one_picture_per_page(library):
    hits = [h for h in library["search"]("passivates active surface sites carbon adatoms diffuse")
            if "boxes" in h and h["page_end"] and h["page_end"] > h["page"]]
    assert hits, "the generated paper breaks a paragraph across pages 1-2"
    shown = library["show"](hits[0], inline=True)
    assert [i["page"] for i in shown["images"]] == [hits[0]["page"], hits[0]["page_end"]]
    check_highlight(hits[0]["path"], shown)


def test_crop_shows_the_column_and_full_page_the_page(library):
    def one_column(hit):
        rects = [r for box in hit.get("boxes", []) for r in box["rects"]]
        return rects and (max(r[2] for r in rects) < 310 or min(r[0] for r in rects) > 300)
    hit = next(h for h in library["search"]("protein folding", "protein_folding_2col.pdf") if one_column(h))
    cropped = library["show"](hit, inline=True)["images"][0]
    whole = library["show"](hit, inline=True, crop=False)["images"][0]
    with pymupdf.open(hit["path"]) as doc:
        page = doc[hit["page"] - 1].rect
    rects = hit["boxes"][0]["rects"]
    cx0, cy0, cx1, cy1 = cropped["clip"]
    assert all(cx0 <= r[0] and cy0 <= r[1] and r[2] <= cx1 and r[3] <= cy1 for r in rects)
    assert cx1 - cx0 < 0.6 * page.width, "a two-column page's crop is one column wide"
    assert abs(whole["clip"][2] - whole["clip"][0] - page.width) < 1.5
    assert abs(whole["clip"][3] - whole["clip"][1] - page.height) < 1.5
    assert max(cropped["width"], whole["width"]) <= 900, "the default picture fits a chat card"
    fine = library["show"](hit, inline=True, dpi=300)["images"][0]
    assert fine["dpi"] == 300 and fine["width"] > cropped["width"]


def test_pictures_are_files_in_the_cache_or_in_dest(library, tmp_path):
    hit = next(h for h in library["search"]("photocatalyst", "photocatalysis_ligatures.pdf") if "boxes" in h)
    cached = library["show"](hit)["images"][0]
    assert "data" not in cached and os.path.dirname(cached["path"]) == str(library["kb_root"] / "show-cache")
    assert Path(cached["path"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    elsewhere = library["show"](hit, dest=str(tmp_path / "pictures"))["images"][0]
    assert os.path.dirname(elsewhere["path"]) == str(tmp_path / "pictures")
    assert image_bytes(elsewhere) == image_bytes(cached)


def test_the_cache_folder_is_trimmed_oldest_first(library, kb_engine, monkeypatch):
    hits = [h for h in library["search"]("electrolyte") if "boxes" in h][:3]
    assert len(hits) >= 2
    paths = []
    for hit in hits:
        paths.append(library["show"](hit, crop=False)["images"][0]["path"])
        time.sleep(0.02)
    monkeypatch.setattr(kb_engine, "SHOW_CACHE_BYTES", os.path.getsize(paths[-1]) + 10)
    newest = library["show"](hits[-1], crop=False)["images"][0]["path"]
    left = os.listdir(library["kb_root"] / "show-cache")
    assert os.path.basename(newest) in left and os.path.basename(paths[0]) not in left


def test_a_page_without_offsets_is_drawn_without_a_highlight(library):
    hit = library["search"]("protein folding")[0]
    shown = library["engine"].execute("show", {"doc_id": hit["doc_id"], "page": hit["page"],
                                               "kb_root": str(library["kb_root"]), "inline": True})
    assert shown["highlighted"] is False and "offsets" in shown["note"] and "boxes" not in shown
    image = shown["images"][0]
    assert np.array_equal(pixels(image_bytes(image)), plain_render(hit["path"], image))


def test_a_figure_is_cropped_from_its_caption_and_drawing(library):
    path = str(library["papers"]["make_onecolumn_paper"])
    doc_id = next(h["doc_id"] for h in library["search"]("graphene copper") if h["path"] == path)
    shown = library["engine"].execute("show", {"doc_id": doc_id, "figure": "Figure 1",
                                               "kb_root": str(library["kb_root"]), "inline": True})
    assert shown["figure"] == "Figure 1" and "note" not in shown, shown
    image = shown["images"][0]
    with pymupdf.open(path) as doc:
        page = doc[image["page"] - 1]
        caption = page.search_for("Schematic of the hot-wall CVD reactor")[0]
        frame = max((d["rect"] for d in page.get_drawings()), key=lambda r: r.width * r.height)
        height = page.rect.height
    x0, y0, x1, y1 = image["clip"]
    for r in (caption, frame):
        assert x0 <= r.x0 + 0.5 and y0 <= r.y0 + 0.5 and r.x1 - 0.5 <= x1 and r.y1 - 0.5 <= y1, (r, image["clip"])
    assert (y1 - y0) < 0.6 * height, "the figure, not the page"
    with pytest.raises(Exception) as refused:
        library["engine"].execute("show", {"doc_id": doc_id, "figure": "Figure 9", "kb_root": str(library["kb_root"])})
    assert getattr(refused.value, "code", None) == "not_found"


def test_a_changed_or_missing_file_is_refused_never_drawn(library, kb_engine, tmp_path):
    engine = kb_engine.Engine()
    folder = tmp_path / "papers"
    folder.mkdir()
    paper = sp.make_ligature_paper(folder)
    kb_root = str(tmp_path / ".kb")
    engine.execute("ingest", {"paths": [str(folder)], "kb_root": kb_root})
    hit = engine.execute("search", {"query": "photocatalyst", "kb_root": kb_root, "mode": "keyword"})["results"][0]
    span = {k: hit[k] for k in SPAN_KEYS}
    os.utime(paper, (time.time() + 5, time.time() + 5))        # touched, same bytes: still the indexed file
    assert engine.execute("show", {**span, "kb_root": kb_root, "inline": True})["highlighted"] is True
    with open(paper, "ab") as fh:
        fh.write(b"\n% appended\n")
    with pytest.raises(kb_engine.KBError) as stale:
        engine.execute("show", {**span, "kb_root": kb_root})
    assert stale.value.code == "stale"
    os.unlink(paper)
    with pytest.raises(kb_engine.KBError) as gone:
        engine.execute("show", {**span, "kb_root": kb_root})
    assert gone.value.code == "not_found"
    engine.close()


@pytest.mark.parametrize("payload, words", [
    ({}, "doc_id"),
    ({"doc_id": 1}, "page"),
    ({"doc_id": 1, "page": 1, "char_start": 4}, "both"),
    ({"doc_id": 1, "page": 1, "dpi": 5000}, "dpi"),
    ({"doc_id": 1, "page": 2, "page_end": 1}, "page_end"),
    ({"doc_id": 424242, "page": 1}, "no document"),
    ({"doc_id": 10**30, "page": 1}, "doc_id"),
    ({"doc_id": 1, "page": 1, "char_start": 50, "char_end": 10}, "char_end"),
])
def test_bad_show_requests_get_a_clear_error(library, kb_engine, payload, words):
    with pytest.raises(kb_engine.KBError) as refused:
        library["engine"].execute("show", {**payload, "kb_root": str(library["kb_root"])})
    assert words in refused.value.message


@pytest.mark.slow      # the command line in its own process, drawing a page
def test_cli_show_writes_the_png_and_prints_its_path(library, tmp_path):
    import subprocess
    import sys
    hit = next(h for h in library["search"]("photocatalyst", "photocatalysis_ligatures.pdf") if "boxes" in h)
    argv = [sys.executable, str(ENGINE), "--kb-root", str(library["kb_root"]), "show",
            str(hit["doc_id"]), "--page", str(hit["page"]), "--char-start", str(hit["char_start"]),
            "--char-end", str(hit["char_end"]), "--page-end", str(hit["page_end"]), "--dest", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=clean_env())
    assert done.returncode == 0, done.stderr
    printed = done.stdout.split()[-1]
    assert printed.startswith(str(tmp_path)) and printed.endswith(".png") and os.path.getsize(printed) > 1000
    rag = subprocess.run([sys.executable, str(ENGINE), "--kb-root", str(library["kb_root"]), "rag",
                          "photocatalyst quantum efficiency", "--mode", "keyword", "--show"],
                         capture_output=True, text=True, timeout=120, env=clean_env())
    assert rag.returncode == 0, rag.stderr
    pictures = [line.split("picture: ")[1].split(" · ")[0] for line in rag.stdout.splitlines() if "picture: /" in line]
    assert pictures and all(os.path.isfile(p) for p in pictures)
    search = subprocess.run([sys.executable, str(ENGINE), "--kb-root", str(library["kb_root"]), "search",
                             "photocatalyst quantum efficiency", "--mode", "keyword", "-k", "3", "--show"],
                            capture_output=True, text=True, timeout=120, env=clean_env())
    assert search.returncode == 0, search.stderr
    drawn = [line for line in search.stdout.splitlines() if line.strip().startswith("picture: ")]
    assert drawn and all(os.path.isfile(line.split("picture: ")[1].split(" · ")[0]) for line in drawn
                         if "picture: /" in line)


def test_a_table_is_cropped_from_its_caption_down_to_its_last_rule(kb_engine, tmp_path):
    """A booktabs-style table: caption above, three rules, rows of short cells; the paragraph below stays out."""
    folder = tmp_path / "papers"
    folder.mkdir()
    doc = pymupdf.open()
    page = doc.new_page(width=595, height=842)
    page.insert_text((72, 72), "Sorption isotherms of zeolite membranes", fontsize=16)
    body = ("The membranes were calcined before every measurement so that the pores were free of template. "
            "Uptake was measured gravimetrically at five pressures for each gas, and each point was repeated.")
    page.insert_textbox(pymupdf.Rect(72, 100, 523, 160), body, fontsize=10)
    page.insert_text((72, 190), "Table 1. Uptake of three gases on the calcined membranes at 298 K.", fontsize=10)
    shape = page.new_shape()
    for y in (200, 222, 300):
        shape.draw_line((72, y), (523, y))
    shape.finish(color=(0, 0, 0), width=0.8)
    shape.commit()
    for x, head in ((80, "Gas"), (220, "Uptake (mmol/g)"), (400, "Selectivity")):
        page.insert_text((x, 215), head, fontsize=9)
    for i, (gas, uptake, sel) in enumerate((("CO2", "2.41", "18.2"), ("CH4", "0.37", "2.8"), ("N2", "0.13", "1.0"))):
        for x, cell in ((80, gas), (220, uptake), (400, sel)):
            page.insert_text((x, 240 + 20 * i), cell, fontsize=9)
    below = ("Carbon dioxide is taken up far more strongly than methane or nitrogen, which is what makes these "
             "membranes selective; the following section discusses the permeation measurements in detail.")
    page.insert_textbox(pymupdf.Rect(72, 330, 523, 400), below, fontsize=10)
    path = folder / "zeolite_table.pdf"
    doc.save(path)
    engine = kb_engine.Engine()
    kb_root = str(tmp_path / ".kb")
    engine.execute("ingest", {"paths": [str(folder)], "kb_root": kb_root})
    doc_id = engine.execute("docs", {"kb_root": kb_root})["docs"][0]["doc_id"]
    shown = engine.execute("show", {"doc_id": doc_id, "figure": "Table 1", "page": 1, "kb_root": kb_root,
                                    "inline": True})
    assert "note" not in shown, shown
    x0, y0, x1, y1 = shown["images"][0]["clip"]
    assert y0 <= 181 and y1 >= 300, "from the caption to the bottom rule, every row inside"
    assert y1 < 320, "the paragraph under the table stays out"
    assert x0 <= 72 and x1 >= 523
    engine.close()
