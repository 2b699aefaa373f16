#!/usr/bin/env python3
"""Snippet boxes and `show` on real papers: how many PDF hits are placed, whether every placed box holds its
snippet's text, whether every `show` highlight stays inside its boxes, and what it costs.

The questions are our own (benchmarks/fulltext_questions.jsonl and fulltext_heldout.jsonl). Each is sent through
`search` (keyword mode, top 10, no cache) with `boxes: true`. For every PDF hit:

- placed: it carries `boxes` (else `boxes_note`, counted by reason);
- text: the text PyMuPDF reads inside the rectangles (`page.get_textbox` with the reader's text flags) equals the
  snippet's letters and digits (case-folded, accents and spacing accents dropped, TeX's dotless i read as i);
- highlight (the first placed hit of each question): `show` draws it, and every pixel that differs from a plain
  render of the same clip lies inside a box.

The papers are split by the corpus folders the box placement was developed on (``--set dev``: papermage,
refextract, grobid, deep-rules, elegantpaper) and the others (``--set heldout``, the default).

Cost, on this machine: search with boxes minus the same search without (10 hits), and one `show` (cropped,
default resolution, written to the cache), p50 and p90 in ms, each over the questions, with the engine resident.

    python benchmarks/eval_boxes.py [--corpus DIR] [--set heldout|dev|all] [--work /tmp/kb-boxes] [--record]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import unicodedata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_corpus, engine, record  # noqa: E402

HERE = Path(__file__).resolve().parent
QUESTION_FILES = (HERE / "fulltext_questions.jsonl", HERE / "fulltext_heldout.jsonl")
DEV_FOLDERS = {"papermage", "refextract", "grobid", "deep-rules", "elegantpaper"}


def letters(text: str) -> str:
    return "".join(c for c in unicodedata.normalize("NFKD", text).casefold().replace("\u0131", "i")
                   if c.isalnum() and not "\u02b0" <= c <= "\u02ff")


def questions(which: str) -> list[dict]:
    rows = [json.loads(line) for f in QUESTION_FILES for line in f.read_text(encoding="utf-8").splitlines()
            if line.strip()]
    if which == "all":
        return rows
    dev = which == "dev"
    return [q for q in rows if (q["doc"].split("/")[0] in DEV_FOLDERS) == dev]


def text_in_boxes(pymupdf, hit: dict) -> str:
    flags = pymupdf.TEXTFLAGS_DICT & ~pymupdf.TEXT_PRESERVE_IMAGES
    with pymupdf.open(hit["path"]) as doc:
        out = []
        for box in hit["boxes"]:
            page = doc[box["page"] - 1]
            textpage = page.get_textpage(flags=flags)
            out += [page.get_textbox(pymupdf.Rect(r), textpage=textpage) for r in box["rects"]]
    return "".join(out)


def highlight_outside(pymupdf, np, hit: dict, shown: dict) -> int:
    """Pixels of the pictures that changed outside every box (0 when the highlight is where it should be)."""
    outside = 0
    with pymupdf.open(hit["path"]) as doc:
        for image in shown["images"]:
            page = doc[image["page"] - 1]
            zoom = image["dpi"] / 72
            plain = page.get_pixmap(matrix=pymupdf.Matrix(zoom, zoom), clip=pymupdf.Rect(image["clip"]), alpha=False)
            drawn = pymupdf.Pixmap(image["path"])
            a = np.frombuffer(plain.samples, np.uint8).reshape(plain.height, plain.width, plain.n)[:, :, :3]
            b = np.frombuffer(drawn.samples, np.uint8).reshape(drawn.height, drawn.width, drawn.n)[:, :, :3]
            changed = np.any(a != b, axis=2)
            inside = np.zeros(changed.shape, dtype=bool)
            x0, y0 = image["clip"][0], image["clip"][1]
            for box in shown["boxes"]:
                if box["page"] != image["page"]:
                    continue
                for r in box["rects"]:
                    shown_rect = (pymupdf.Rect(r) * page.rotation_matrix).normalize()
                    # whole pixels inside the rectangle (the clip is the pixel grid a hair inside: 0.01 pt)
                    left = max(0, int(np.ceil((shown_rect.x0 - x0 - 0.01) * zoom)))
                    top = max(0, int(np.ceil((shown_rect.y0 - y0 - 0.01) * zoom)))
                    right = int(np.floor((shown_rect.x1 - x0 + 0.01) * zoom))
                    bottom = int(np.floor((shown_rect.y1 - y0 + 0.01) * zoom))
                    inside[top:bottom, left:right] = True
            outside += int((changed & ~inside).sum())
    return outside


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else 0.0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", default=default_corpus())
    parser.add_argument("--set", dest="which", choices=("heldout", "dev", "all"), default="heldout")
    parser.add_argument("--work", default="/tmp/kb-boxes")
    parser.add_argument("--record", action="store_true", help="write benchmarks/results/boxes_<set>.json")
    args = parser.parse_args(argv)
    import numpy as np
    import pymupdf
    os.environ.setdefault("KB_EMBED_MODEL", "none")      # keyword search: the boxes do not depend on the ranking
    kb = engine()
    rows = questions(args.which)
    docs = sorted({q["doc"] for q in rows})
    missing = [d for d in docs if not (Path(args.corpus) / d).is_file()]
    if missing:
        print(f"corpus files missing under {args.corpus}: {missing[:3]}", file=sys.stderr)
        return 2
    root = str(Path(args.work) / args.which)
    e = kb.Engine()
    e.execute("ingest", {"paths": [str(Path(args.corpus) / d) for d in docs], "kb_root": root})
    total = placed = wrong_text = shows = wrong_pixels = 0
    notes: dict[str, int] = {}
    box_ms: list[float] = []
    show_ms: list[float] = []
    for q in rows:
        request = {"query": q["question"], "kb_root": root, "mode": "keyword", "top_k": 10, "cache": False}
        started = time.perf_counter()
        e.execute("search", request)
        bare = time.perf_counter() - started
        started = time.perf_counter()
        hits = e.execute("search", {**request, "boxes": True})["results"]
        box_ms.append((time.perf_counter() - started - bare) * 1000)
        first = None
        for hit in hits:
            if hit["kind"] != "pdf":
                continue
            total += 1
            if "boxes" not in hit:
                reason = re.sub(r" \(p\. \d+\)$", "", hit["boxes_note"])
                notes[reason] = notes.get(reason, 0) + 1
                continue
            placed += 1
            first = first or hit
            if letters(text_in_boxes(pymupdf, hit)) != letters(hit["snippet"].replace("…", "")):
                wrong_text += 1
                print(f"box text differs: {hit['file']} p.{hit['page']}", file=sys.stderr)
        if first is not None:
            span = {k: first[k] for k in ("doc_id", "page", "char_start", "page_end", "char_end")}
            started = time.perf_counter()
            shown = e.execute("show", {**span, "kb_root": root})
            show_ms.append((time.perf_counter() - started) * 1000)
            shows += 1
            if highlight_outside(pymupdf, np, first, shown):
                wrong_pixels += 1
                print(f"highlight outside its boxes: {first['file']} p.{first['page']}", file=sys.stderr)
    e.close()
    figures = {"set": args.which, "questions": len(rows), "papers": len(docs), "pdf_hits": total, "placed": placed,
               "placed_share": round(placed / total, 4) if total else None, "box_text_differs": wrong_text,
               "shows": shows, "highlight_outside_boxes": wrong_pixels, "unplaced": notes,
               "boxes_10_hits_ms_p50": round(percentile(box_ms, 0.5), 1),
               "boxes_10_hits_ms_p90": round(percentile(box_ms, 0.9), 1),
               "show_ms_p50": round(percentile(show_ms, 0.5), 1), "show_ms_p90": round(percentile(show_ms, 0.9), 1)}
    print(f"{args.which}: {len(rows)} questions on {len(docs)} papers; PDF hits {total}, placed {placed} "
          f"({figures['placed_share']:.1%}); box text differs {wrong_text}; shows {shows}, highlight outside its "
          f"boxes {wrong_pixels}")
    print(f"unplaced: {notes}")
    print(f"cost: boxes for 10 hits p50 {figures['boxes_10_hits_ms_p50']} ms (p90 {figures['boxes_10_hits_ms_p90']}); "
          f"one show p50 {figures['show_ms_p50']} ms (p90 {figures['show_ms_p90']})")
    if args.record:
        print(record(f"boxes_{args.which}", figures, model=None, argv=sys.argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
