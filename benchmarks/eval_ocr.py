#!/usr/bin/env python3
"""OCR quality on scanned copies of real papers: how close the engine's text of an image-only page comes to the
text layer it was made from, how long a page takes, and whether the full-text questions still find their page.

For each paper (the ``--papers`` English papers of the full-text question set with the most questions answered
on their first ``--max-pages`` pages, cut to those pages, and ``--chinese`` Chinese papers of the corpus) the
script writes the cut original and two image-only copies, each page only a picture of the original page:
``clean`` (rendered at 200 dpi, grey) and ``degraded`` (150 dpi, turned by 0.7 degrees, saved as JPEG at
quality 50, as a worn office scan). Then:

- character similarity of ``kb_engine.page_texts`` of each copy to that of the original, per page, on the text
  with its white space taken out (neither line breaks nor spaces the recognizer dropped count), the share of
  characters in common regardless of order (recognition apart from reading order), and seconds per OCR'd page
  (a fresh cache: every page is OCR'd);
- page-hit@1 and @5 of the questions (on the English and the Chinese papers) whose gold pages lie in the cut,
  over a library of the originals and one of each kind of copy (keyword search by default, ``--mode hybrid``
  with the engine's embedding model), and the copies' share of the originals' hits (issue 33 asks for 0.9).

    python benchmarks/eval_ocr.py [--corpus DIR] [--papers 3] [--max-pages 4] [--chinese REL,...]
                                  [--variants clean,degraded] [--mode keyword] [--work DIR] [--out FILE]
                                  [--record | --no-record] [--record-as NAME]

Needs the OCR extra (``pip install 'kb-rag[ocr]'``). ``--record`` writes ``benchmarks/results/ocr.json`` (``--record-as
ocr_heldout`` for the held-out run: ``--questions benchmarks/fulltext_heldout.jsonl``; ``--record-as
ocr_zh_journals`` for the Chinese journal articles: ``--papers 0 --max-pages 10 --questions
benchmarks/fulltext_heldout_zh.jsonl --chinese zh-journals/...`` over a corpus folder that holds them, see
docs/PERFORMANCE.md for where they come from).
Exit status: 0 when everything ran, 1 when the engine failed, 2 on bad input (no corpus, no OCR extra).
"""
from __future__ import annotations

import argparse
import difflib
import io
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, default_corpus, engine, model_name, record, use_offline_model  # noqa: E402

QUESTIONS = REPO_ROOT / "benchmarks" / "fulltext_questions.jsonl"
CHINESE = ("elegantpaper/elegantpaper-cn.pdf", "unstructured/simplified_chinese.pdf")
VARIANTS = {"clean": {"dpi": 200, "skew": 0.0, "jpeg": None},
            "degraded": {"dpi": 150, "skew": 0.7, "jpeg": 50}}


def cut_pdf(source: Path, target: Path, pages: int) -> int:
    """The first ``pages`` pages of a PDF, text layer kept; how many pages it has."""
    import pymupdf
    with pymupdf.open(source) as doc:
        doc.select(list(range(min(pages, doc.page_count))))
        doc.save(target, garbage=3, deflate=True)
        return doc.page_count


def scanned_copy(source: Path, target: Path, dpi: int, skew: float, jpeg: int | None) -> None:
    """An image-only copy: each page a picture of the original page, and nothing else."""
    import pymupdf
    from PIL import Image
    with pymupdf.open(source) as original, pymupdf.open() as copy:
        for page in original:
            pix = page.get_pixmap(dpi=dpi, colorspace=pymupdf.csGRAY)
            image = Image.frombytes("L", (pix.width, pix.height), pix.samples)
            if skew:
                image = image.rotate(skew, resample=Image.BICUBIC, fillcolor=255)
            buffer = io.BytesIO()
            image.save(buffer, format="JPEG" if jpeg else "PNG", **({"quality": jpeg} if jpeg else {}))
            scanned = copy.new_page(width=page.rect.width, height=page.rect.height)
            scanned.insert_image(scanned.rect, stream=buffer.getvalue())
        copy.save(target, deflate=True)


def characters_in_common(a: str, b: str) -> float:
    """The same comparison with the order of the characters left out (a multiset of characters on each side):
    what separates recognition from reading order. A table read row by row against a layer that holds it
    column by column scores low on ``similarity`` and high here."""
    from collections import Counter
    a, b = Counter(re.sub(r"\s+", "", a)), Counter(re.sub(r"\s+", "", b))
    total = sum(a.values()) + sum(b.values())
    return 2 * sum((a & b).values()) / total if total else 1.0


def similarity(a: str, b: str) -> float:
    a, b = re.sub(r"\s+", "", a), re.sub(r"\s+", "", b)
    if not a and not b:
        return 1.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def page_hit_rank(hits: list[dict], name: str, gold: list[int]) -> int | None:
    for rank, hit in enumerate(hits, start=1):
        first, last = hit.get("page"), hit.get("page_end") or hit.get("page")
        if hit.get("file") == name and first is not None and any(first <= p <= last for p in gold):
            return rank
    return None


def hits_at(ranks: list[int | None], k: int) -> float:
    return round(sum(r is not None and r <= k for r in ranks) / max(len(ranks), 1), 4)


def main(argv=None) -> int:  # noqa: C901
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default=default_corpus())
    ap.add_argument("--questions", default=str(QUESTIONS))
    ap.add_argument("--papers", type=int, default=3, help="English papers of the question set (default 3)")
    ap.add_argument("--max-pages", type=int, default=4, help="pages of each paper (default 4)")
    ap.add_argument("--chinese", default=",".join(CHINESE), help="Chinese corpus papers (comma list)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--mode", default="keyword", choices=("keyword", "hybrid"))
    ap.add_argument("--work", default=None, help="folder for the copies and libraries (default: a temporary one)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--record", dest="record", action="store_true", default=False)
    ap.add_argument("--record-as", default="ocr", help="results/<name>.json that --record writes (default ocr)")
    ap.add_argument("--no-record", dest="record", action="store_false")
    args = ap.parse_args(argv)
    corpus = Path(args.corpus)
    kb = engine()
    if not corpus.is_dir():
        print(f"no corpus at {corpus} (set KB_CORPUS_DIR or --corpus)", file=sys.stderr)
        return 2
    if not kb.ocr_available():
        print("the OCR extra is not installed: pip install 'kb-rag[ocr]'", file=sys.stderr)
        return 2
    variants = [v for v in args.variants.split(",") if v]
    if set(variants) - set(VARIANTS):
        print(f"variants are {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    if args.mode == "hybrid":
        use_offline_model()
    else:
        os.environ["KB_EMBED_MODEL"] = "none"
    questions = [json.loads(line) for line in Path(args.questions).read_text(encoding="utf-8").splitlines()
                 if line.strip()]
    # the papers with the most questions answered within the cut (ties: the question set's order)
    within = [q["doc"] for q in questions if max(q["pages"]) <= args.max_pages and (corpus / q["doc"]).is_file()]
    order = list(dict.fromkeys(within))
    english = sorted(order, key=lambda doc: (-within.count(doc), order.index(doc)))[:args.papers]
    chinese = [c for c in args.chinese.split(",") if c and (corpus / c).is_file()]
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="kb-eval-ocr-"))
    os.environ["KB_OCR"] = "auto"
    report: dict = {"papers": {}, "variants": {v: dict(VARIANTS[v]) for v in variants}, "mode": args.mode,
                    "max_pages": args.max_pages, "ocr_engine": kb.ocr_engine_version()}
    try:
        folders = {name: work / name for name in ["original", *variants]}
        for folder in folders.values():
            folder.mkdir(parents=True, exist_ok=True)
        for rel in english + chinese:
            name = rel.replace("/", "__")
            pages = cut_pdf(corpus / rel, folders["original"] / name, args.max_pages)
            report["papers"][name] = {"source": rel, "language": "zh" if rel in chinese else "en", "pages": pages}
            for variant in variants:
                scanned_copy(folders["original"] / name, folders[variant] / name, **VARIANTS[variant])
        # 1. page text against the text layer, and seconds per page (every page OCR'd once, into one cache)
        cache = work / "cache"
        os.environ["KB_CACHE_DIR"] = str(cache)
        rows = []
        for name, paper in report["papers"].items():
            original = kb.page_texts(str(folders["original"] / name))
            for variant in variants:
                started = time.perf_counter()
                scanned = kb.page_texts(str(folders[variant] / name))
                seconds = time.perf_counter() - started
                sims = [round(similarity(a, b), 4) for a, b in zip(original, scanned)]
                common = [round(characters_in_common(a, b), 4) for a, b in zip(original, scanned)]
                paper[variant] = {"similarity": sims, "characters_in_common": common,
                                  "seconds_per_page": round(seconds / max(len(scanned), 1), 1)}
                rows.append((paper["language"], variant, sims, seconds / max(len(scanned), 1), common))
                print(f"{name:48} {variant:9} similarity {statistics.mean(sims):.3f} "
                      f"(pages {', '.join(f'{s:.2f}' for s in sims)}), {seconds / max(len(scanned), 1):.1f} s/page")
        summary: dict = {}
        for language in ("en", "zh"):
            for variant in variants:
                picked = [r for r in rows if r[0] == language and r[1] == variant]
                if picked:
                    sims = [s for r in picked for s in r[2]]
                    summary[f"{language}/{variant}"] = {
                        "pages": len(sims), "mean_similarity": round(statistics.mean(sims), 4),
                        "mean_characters_in_common": round(statistics.mean(c for r in picked for c in r[4]), 4),
                        "lowest_page": round(min(sims), 4),
                        "seconds_per_page": round(statistics.mean(r[3] for r in picked), 1)}
        # 2. the questions on those pages, over each library (the copies read their pages from the cache above)
        asked = [q for q in questions if q["doc"] in english + chinese and max(q["pages"]) <= args.max_pages]
        eng = kb.Engine()
        ranks: dict[str, list] = {}
        try:
            for kind, folder in folders.items():
                root = work / f"kb-{kind}"
                root.mkdir(exist_ok=True)
                if (cache / kb.OCR_CACHE_FILENAME).exists():
                    shutil.copy(cache / kb.OCR_CACHE_FILENAME, root / kb.OCR_CACHE_FILENAME)
                eng.execute("ingest", {"paths": [str(folder)], "kb_root": str(root), "background": False})
                ranks[kind] = []
                for q in asked:
                    reply = eng.execute("search", {"query": q["question"], "kb_root": str(root), "mode": args.mode,
                                                   "top_k": 10, "cache": False, "snippet": 0})
                    ranks[kind].append(page_hit_rank(reply.get("results", []), q["doc"].replace("/", "__"),
                                                     q["pages"]))
        finally:
            eng.close()
        hits = {kind: {"hit@1": hits_at(r, 1), "hit@5": hits_at(r, 5)} for kind, r in ranks.items()}
        for variant in variants:
            base = hits["original"]["hit@5"]
            hits[variant]["hit@5_share_of_original"] = round(hits[variant]["hit@5"] / base, 3) if base else None
        report.update(summary=summary, questions=len(asked), page_hits=hits)
    except Exception as exc:     # the engine failed: say so and stop
        print(f"engine failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print("| pages | copy | pages | mean similarity | lowest page | characters in common | s/page |")
    print("|---|---|---|---|---|---|---|")
    for key, s in report["summary"].items():
        language, variant = key.split("/")
        print(f"| {'English' if language == 'en' else 'Chinese'} | {variant} | {s['pages']} | "
              f"{s['mean_similarity']:.3f} | {s['lowest_page']:.3f} | {s['mean_characters_in_common']:.3f} | "
              f"{s['seconds_per_page']} |")
    print()
    print(f"{report['questions']} questions on the cut pages ({args.mode}):")
    for kind, h in report["page_hits"].items():
        share = f", {h['hit@5_share_of_original']:.2f} of the originals' hit@5" if "hit@5_share_of_original" in h \
            and h["hit@5_share_of_original"] is not None else ""
        print(f"  {kind:9} page-hit@1 {h['hit@1']:.3f}  page-hit@5 {h['hit@5']:.3f}{share}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, ensure_ascii=False), encoding="utf-8")
    if args.record:
        print("recorded", record(args.record_as, report, model=model_name() if args.mode == "hybrid" else None,
                                 argv=sys.argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
