#!/usr/bin/env python3
"""Section labels a citation can trust: does every heading of a paper name the passages under it, and is every
label the library gives a real heading?

``benchmarks/section_headings.jsonl`` holds, per document of the shared corpus, its headings as a reader sees
them on the rendered pages, labelled by hand (never from a parser's output): the physical page, the text as
printed (numbering included), the level (1 for sections and thesis chapters, 2 for their subsections, ...),
whether it is a run-in lead-in, and whether its section is meant to be searchable (``indexed``: false for
reference lists, acknowledgements and the like, which the engine keeps out of the index on purpose).

Every document is ingested into one library through the real engine (no embedding model: labels do not depend
on one). Then, reading the library's passages (page range and section label, ``Top > Sub``):

- **heading recall**: an indexed heading counts as found when a passage on its page carries it as a part of its
  label; ``recall+next`` also accepts a passage on the next page (a heading at the foot of a page);
- **label precision**: each distinct part of the labels of a document is a real heading when it is one of the
  document's labelled headings (any of them, indexed or not). ``Front matter`` and ``Abstract`` are left out
  when the document prints no such heading: they are the engine's names for text before the first heading and
  for an abstract without one, not a claim about the page;
- **level accuracy**: for found headings, the part's position in the label (1 for the top section, 2 for a
  subsection, ...) equals the labelled level.

Texts are compared after NFKC, case folding, removing the numbering (``3.1``, ``II.``, ``A.``, ``第3章``,
``一、``) and everything but letters, digits and CJK; a label cut at 120 characters matches its heading's start.

    python benchmarks/eval_sections.py [--corpus DIR] [--headings FILE] [--work /tmp/kb-sections]
                                       [--misses] [--out results.json] [--scanned [--ocr-cache FILE]]

``--scanned`` labels image-only copies of the documents instead (each page a 200 dpi grey picture, as
``eval_ocr.py`` makes its clean copies): the sections the engine finds on OCR'd pages (needs the OCR extra).

The library is built afresh on every run (about 8 s for the main set): labels kept from an earlier build of the
engine would be scored as this one's.

Exit status: 0 when everything ran, 1 when the engine failed, 2 on bad input (no corpus, unreadable file).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sqlite3
import sys
import time
import unicodedata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_corpus, record  # noqa: E402
from common import engine as repo_engine  # noqa: E402

DEFAULT_HEADINGS = Path(__file__).resolve().parent / "section_headings.jsonl"
HEADING_KEYS = ("page", "text", "level", "run_in", "indexed")
LABEL_LIMIT = 120          # the engine cuts a label part at this many characters
SYNTHETIC_LABELS = {"front matter", "abstract"}
CJK = "\u3400-\u9fff\uf900-\ufaff"

_NUMBERING = re.compile(
    r"^\s*(?:(?:chapter|section|appendix|part)\s+)?"
    r"(?:\d{1,2}(?:\.\d{1,2}){0,4}\.?(?!\d)|[A-Z](?:\.\d{1,2}){1,3}\.?(?=\s)"
    r"|[IVXLC]{1,6}(?:\.[IVXLC]{1,6}){0,3}\.?(?=\s)|[A-Z]\.?(?=\s)|\([a-z0-9]{1,3}\)"
    r"|第\s*[一二三四五六七八九十百零〇\d]+\s*[章节部分篇]|[一二三四五六七八九十]+[、.．]"
    r"|[（(][一二三四五六七八九十\d]+[）)])\s*",
    re.IGNORECASE)


def normalise(text: str) -> str:
    """A heading or label part reduced to what both must share: no numbering, case or punctuation."""
    text = unicodedata.normalize("NFKC", text or "").strip()
    text = _NUMBERING.sub("", text, count=1) or text
    words = " ".join(re.findall(r"[^\W_]+", text.casefold()))
    return re.sub(rf"(?<=[{CJK}]) (?=[{CJK}])", "", words)     # "摘 要" set letter-spaced is "摘要"


def _without_letter(text: str) -> str:
    """A leading single letter dropped: "A Proofs" (an appendix's letter) and "A new method" (an article) read
    alike, so both sides are compared with and without it."""
    return re.sub(r"^[^\W\d_] ", "", text)


def same_heading(label_part: str, heading: str) -> bool:
    a, b = normalise(label_part), normalise(heading)
    if not a or not b:
        return False
    if a == b or _without_letter(a) == _without_letter(b):
        return True
    cut = normalise(label_part[:LABEL_LIMIT])
    return len(label_part) >= LABEL_LIMIT - 5 and len(cut) >= 30 and b.startswith(cut)


# -- the hand labels -------------------------------------------------------------------------------------

def load_headings(path: Path) -> list[dict]:
    """The hand labels, checked: every document names its headings with page, text, level, run-in and indexed."""
    with path.open(encoding="utf-8") as fh:
        docs = [(n, json.loads(line)) for n, line in enumerate(fh, start=1) if line.strip()]
    for n, row in docs:
        if not isinstance(row.get("doc"), str) or not isinstance(row.get("headings"), list):
            raise ValueError(f"{path}:{n}: needs doc and headings")
        for h in row["headings"]:
            missing = [k for k in HEADING_KEYS if k not in h]
            if missing:
                raise ValueError(f"{path}:{n}: a heading of {row['doc']} lacks {missing}")
            if not (isinstance(h["page"], int) and 1 <= h["page"] <= row.get("pages", 10**6)):
                raise ValueError(f"{path}:{n}: {row['doc']}: page {h['page']!r} out of range")
            if h["level"] not in (1, 2, 3, 4, 5):
                raise ValueError(f"{path}:{n}: {row['doc']}: level {h['level']!r}")
    return [row for _, row in docs]


# -- the library -----------------------------------------------------------------------------------------

def build_library(docs: list[dict], corpus: Path, work: Path, ocr_cache: Path | None = None,
                  scanned: bool = False) -> tuple[Path, Path]:
    """The library of the documents, and the folder they were read from (their scanned copies' with ``scanned``)."""
    kb_engine = repo_engine()
    kb = work / "kb"
    if work.exists():
        shutil.rmtree(work)
    kb.mkdir(parents=True)
    if ocr_cache is not None:       # scanned copies read their pages' lines from it instead of being OCR'd again
        shutil.copy(ocr_cache, kb / kb_engine.OCR_CACHE_FILENAME)
    if scanned:         # image-only copies, as eval_ocr.py makes its clean ones, under the documents' own names
        from eval_ocr import VARIANTS, scanned_copy
        for d in docs:
            (work / "scans" / d["doc"]).parent.mkdir(parents=True, exist_ok=True)
            scanned_copy(corpus / d["doc"], work / "scans" / d["doc"], **VARIANTS["clean"])
        corpus = work / "scans"
    os.environ["KB_EMBED_MODEL"] = "none"        # labels do not depend on a model; keyword-only is enough
    engine = kb_engine.Engine(own_process=True)
    try:
        paths = [str(corpus / d["doc"]) for d in docs]
        started = time.perf_counter()
        reply = engine.execute("ingest", {"paths": paths, "kb_root": str(kb), "rebuild": False})
        failed = [e for e in reply["files"] if e["status"] == "error"]
        if failed:
            raise SystemExit(f"the engine could not index: {[(e['path'], e.get('reason')) for e in failed]}")
        print(f"library: {len(paths)} documents in {time.perf_counter() - started:.1f} s ({kb})", file=sys.stderr)
    finally:
        engine.close()
    return kb, corpus


def passages_by_doc(kb: Path, corpus: Path, docs: list[dict]) -> dict[str, list[tuple[int, int, list[str]]]]:
    """doc -> [(first page, last page, label parts)] for every passage of the document."""
    con = sqlite3.connect(f"file:{kb / 'kb.sqlite'}?mode=ro", uri=True)
    try:
        out = {}
        for d in docs:
            path = os.path.abspath(corpus / d["doc"])
            rows = con.execute("SELECT c.page, c.page_end, c.section FROM chunks c JOIN docs ON docs.id = c.doc_id "
                               "WHERE docs.path = ?", (path,)).fetchall()
            out[d["doc"]] = [(p or 0, e or p or 0, [s.strip() for s in (sec or "").split(" > ") if s.strip()])
                             for p, e, sec in rows]
        return out
    finally:
        con.close()


# -- scoring ---------------------------------------------------------------------------------------------

def score_document(doc: dict, passages: list[tuple[int, int, list[str]]]) -> dict:
    headings = doc["headings"]
    body = [h for h in headings if h["indexed"]]
    found = found_next = level_ok = 0
    misses, wrong_levels = [], []
    for h in body:
        def positions(pages, h=h):
            return [i + 1 for first, last, parts in passages if any(first <= p <= last for p in pages)
                    for i, part in enumerate(parts) if same_heading(part, h["text"])]
        on_page = positions([h["page"]])
        if on_page:
            found += 1
            if h["level"] in on_page:
                level_ok += 1
            else:
                wrong_levels.append({"page": h["page"], "text": h["text"], "level": h["level"],
                                     "at": sorted(set(on_page))})
        if on_page or positions([h["page"] + 1]):
            found_next += 1
        else:
            misses.append({"page": h["page"], "text": h["text"], "level": h["level"], "run_in": h["run_in"]})
    printed = {normalise(h["text"]) for h in headings}
    # the names the engine gives text before the first heading and an abstract that prints no heading are its own
    # words, not a claim that the page prints them: they are left out unless the page does print them
    labels = sorted({part for _, _, parts in passages for part in parts
                     if normalise(part) not in SYNTHETIC_LABELS or normalise(part) in printed})
    false_labels = [label for label in labels if not any(same_heading(label, h["text"]) for h in headings)]
    return {"doc": doc["doc"], "headings": len(body), "found": found, "found_next": found_next,
            "level_ok": level_ok, "labels": len(labels), "real_labels": len(labels) - len(false_labels),
            "misses": misses, "false_labels": false_labels, "wrong_levels": wrong_levels}


def ratio(a: int, b: int) -> float:
    return a / b if b else 1.0


def totals(rows: list[dict]) -> dict:
    s = {k: sum(r[k] for r in rows) for k in ("headings", "found", "found_next", "level_ok", "labels", "real_labels")}
    return {**s, "recall": ratio(s["found"], s["headings"]), "recall_next": ratio(s["found_next"], s["headings"]),
            "precision": ratio(s["real_labels"], s["labels"]), "level_accuracy": ratio(s["level_ok"], s["found"])}


def print_report(rows: list[dict], misses: bool) -> None:
    print(f"{'document':58s} {'heads':>5s} {'found':>5s} {'+next':>5s} {'level':>5s} {'labels':>6s} {'real':>5s}")
    for r in rows:
        print(f"{r['doc'][:58]:58s} {r['headings']:5d} {r['found']:5d} {r['found_next']:5d} {r['level_ok']:5d} "
              f"{r['labels']:6d} {r['real_labels']:5d}")
    t = totals(rows)
    print(f"\n{len(rows)} documents, {t['headings']} indexed headings, {t['labels']} distinct labels")
    print(f"heading recall      {t['recall']:.3f}  ({t['found']}/{t['headings']}; with the next page "
          f"{t['recall_next']:.3f})")
    print(f"label precision     {t['precision']:.3f}  ({t['real_labels']}/{t['labels']})")
    print(f"level accuracy      {t['level_accuracy']:.3f}  ({t['level_ok']}/{t['found']} found headings)")
    if misses:
        for r in rows:
            for m in r["misses"]:
                print(f"MISS   {r['doc']} p{m['page']} L{m['level']}{' run-in' if m['run_in'] else ''}: {m['text']}")
            for label in r["false_labels"]:
                print(f"FALSE  {r['doc']}: {label}")
            for w in r["wrong_levels"]:
                print(f"LEVEL  {r['doc']} p{w['page']} L{w['level']} at {w['at']}: {w['text']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default=default_corpus())
    parser.add_argument("--headings", default=str(DEFAULT_HEADINGS))
    parser.add_argument("--work", default="/tmp/kb-sections", help="scratch folder, emptied first")
    parser.add_argument("--misses", action="store_true", help="list missed headings, false labels, wrong levels")
    parser.add_argument("--scanned", action="store_true",
                        help="label image-only copies of the documents (200 dpi, grey: read by OCR) instead")
    parser.add_argument("--ocr-cache", type=Path, default=None, metavar="FILE",
                        help="an OCR cache to start the library with (WORK/kb/ocr-cache.sqlite of an earlier "
                             "--scanned run, copied out of WORK): its pages are not OCR'd again")
    parser.add_argument("--out", help="write the figures and per-document details as JSON")
    parser.add_argument("--record", default=None, metavar="NAME",
                        help="record the totals as benchmarks/results/NAME.json (default: the headings file's name)")
    parser.add_argument("--no-record", action="store_true", help="record nothing")
    args = parser.parse_args(argv)
    corpus = Path(args.corpus)
    try:
        docs = load_headings(Path(args.headings))
    except (OSError, ValueError) as exc:
        print(f"cannot read the headings: {exc}", file=sys.stderr)
        return 2
    absent = [d["doc"] for d in docs if not (corpus / d["doc"]).is_file()]
    if absent:
        print(f"not in the corpus at {corpus}: {absent}", file=sys.stderr)
        return 2
    kb, corpus = build_library(docs, corpus, Path(args.work), args.ocr_cache, args.scanned)
    passages = passages_by_doc(kb, corpus, docs)
    rows = [score_document(d, passages[d["doc"]]) for d in docs]
    print_report(rows, args.misses)
    if args.out:
        Path(args.out).write_text(json.dumps({"totals": totals(rows), "documents": rows}, ensure_ascii=False, indent=1))
    if not args.no_record:
        figures = {"documents": len(rows), **totals(rows)}
        path = record(args.record or Path(args.headings).stem, figures, model=None, argv=sys.argv)
        print(f"recorded {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
