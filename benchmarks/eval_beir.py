#!/usr/bin/env python3
"""Keyword (and later vector/hybrid) retrieval quality of kb_engine on BEIR-style sets.

Datasets (read-only, shipped beside the project in ../shared/eval):
  * SciFact: 5,183 English abstracts, 809 training claims judged by humans (qrels/train.tsv).
  * CSL (Chinese): 2,000 abstracts, title queries and keyword queries, each judged to its own
    abstract (qrels/dev.tsv). The corpus carries no titles, so the title query cannot match trivially.

Every corpus record becomes one Markdown file ``<_id>.md`` in a cached work folder; the folder is
ingested through the real engine (``Engine().execute("ingest", ...)``) into a cached kb_root, and each
judged query is sent through ``execute("search", ...)``. Hits are mapped back to corpus ids through the
file name stem, collapsed to the first hit per document and cut to 100 documents.

Metrics: nDCG@10 (graded gains, log2 discount), Recall@10, Recall@100, MRR@10, plus the ingest time
and the client-side query latency p50/p95. Run from the repository root:

    python benchmarks/eval_beir.py [--datasets scifact,csl] [--modes keyword] [--limit-queries N]
                                   [--work /tmp/kb-eval] [--out results.json]

A complete run (every judged query, no engine error) records each dataset's figures as
``benchmarks/results/beir_<dataset>.json``, which the README and docs/PERFORMANCE.md tables quote.

Exit status: 0 when everything ran, 1 when the engine answered an error (ingest or search),
2 on bad input (missing dataset files, bad options).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, engine, model_name, record, use_offline_model  # noqa: E402

DOCS_CUTOFF = 100          # documents kept per query after collapsing chunks
CHUNK_FACTOR = 3           # ask the engine for this many chunks per wanted document
KNOWN_MODES = ("keyword", "vector", "hybrid")


# --------------------------------------------------------------------------------------------
# Metrics: pure functions. ``ranked`` is a list of distinct document ids, best first;
# ``judged`` maps document id -> graded relevance (grades <= 0 count as not relevant).
# --------------------------------------------------------------------------------------------

def dcg(gains) -> float:
    """Discounted cumulative gain of gains listed in rank order (rank 1 first), log2(rank + 1) discount."""
    return float(sum(g / math.log2(i + 2) for i, g in enumerate(gains)))


def ndcg_at_k(ranked, judged, k: int = 10) -> float:
    """nDCG@k with linear graded gains; the ideal ranking is built from the judgments themselves."""
    ideal = sorted((g for g in judged.values() if g > 0), reverse=True)[:k]
    best = dcg(ideal)
    if best <= 0:
        return 0.0
    got = [max(judged.get(d, 0), 0) for d in ranked[:k]]
    return dcg(got) / best


def recall_at_k(ranked, judged, k: int) -> float:
    """Share of the relevant documents that appear in the first k results."""
    relevant = {d for d, g in judged.items() if g > 0}
    if not relevant:
        return 0.0
    return len(relevant.intersection(ranked[:k])) / len(relevant)


def mrr_at_k(ranked, judged, k: int = 10) -> float:
    """Reciprocal rank of the first relevant document within the first k results, else 0."""
    for i, d in enumerate(ranked[:k]):
        if judged.get(d, 0) > 0:
            return 1.0 / (i + 1)
    return 0.0


def first_hit_per_doc(doc_ids, limit: int = DOCS_CUTOFF) -> list:
    """Collapse a chunk-level hit list to distinct documents, keeping first-seen order; None entries are dropped."""
    seen, out = set(), []
    for d in doc_ids:
        if d is None or d in seen:
            continue
        seen.add(d)
        out.append(d)
        if len(out) >= limit:
            break
    return out


def percentile(values, q: float) -> float:
    """q-th percentile (0..100) with linear interpolation; 0.0 for an empty list."""
    if not values:
        return 0.0
    return float(np.percentile(np.asarray(values, dtype=float), q))


def mean(values) -> float:
    return float(sum(values) / len(values)) if values else 0.0


# --------------------------------------------------------------------------------------------
# Dataset files
# --------------------------------------------------------------------------------------------

def read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def read_qrels(path: Path) -> dict[str, dict[str, int]]:
    """query-id <TAB> corpus-id <TAB> score, with an optional header line (skipped when its score is not a number)."""
    qrels: dict[str, dict[str, int]] = {}
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh):
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 3 or not parts[0].strip():
                continue
            try:
                score = int(float(parts[2]))
            except ValueError:
                if n == 0:
                    continue        # header
                raise SystemExit(f"error: {path}:{n + 1}: score is not a number: {parts[2]!r}") from None
            qrels.setdefault(parts[0].strip(), {})[parts[1].strip()] = score
    return qrels


def judged_queries(queries_file: Path, qrels: dict, limit: int | None) -> list[tuple[str, str]]:
    """(query id, text) for the queries that have at least one relevant judgment, in file order."""
    out = []
    for row in read_jsonl(queries_file):
        qid = str(row["_id"])
        if any(g > 0 for g in qrels.get(qid, {}).values()):
            out.append((qid, row["text"]))
    return out[:limit] if limit else out


_SAFE_STEM = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def stem_for(doc_id: str) -> str:
    """File name stem for a corpus id; ids that are not plain file names are made safe and kept unique."""
    if _SAFE_STEM.match(doc_id):
        return doc_id
    return "x_" + doc_id.encode("utf-8").hex()


def document_markdown(title: str, text: str) -> str:
    title = " ".join((title or "").split())
    body = (text or "").strip()
    head = f"# {title}\n\n" if title else ""     # CSL has no titles: leave the heading out rather than write "# "
    return f"{head}## Abstract\n\n{body}\n"


def write_corpus(corpus_file: Path, docs_dir: Path) -> dict[str, str]:
    """Write each record as <stem>.md (only when missing or different, so unchanged files keep their mtime
    and a re-run ingests incrementally). Returns stem -> corpus id."""
    docs_dir.mkdir(parents=True, exist_ok=True)
    stems: dict[str, str] = {}
    written = 0
    for row in read_jsonl(corpus_file):
        doc_id = str(row["_id"])
        stem = stem_for(doc_id)
        stems[stem] = doc_id
        target = docs_dir / f"{stem}.md"
        content = document_markdown(row.get("title", ""), row.get("text", ""))
        try:
            if target.read_text(encoding="utf-8") == content:
                continue
        except FileNotFoundError:
            pass
        target.write_text(content, encoding="utf-8")
        written += 1
    for extra in docs_dir.glob("*.md"):        # files left from another corpus version would pollute results
        if extra.stem not in stems:
            extra.unlink()
    print(f"  corpus: {len(stems)} records, {written} file(s) written to {docs_dir}", flush=True)
    return stems


# --------------------------------------------------------------------------------------------
# Engine runs
# --------------------------------------------------------------------------------------------

class EngineFailure(Exception):
    pass


def describe_error(exc: Exception) -> str:
    code = getattr(exc, "code", None)
    return f"{type(exc).__name__}[{code}]: {exc}" if code else f"{type(exc).__name__}: {exc}"


def ingest(eng, docs_dir: Path, kb_root: Path) -> dict:
    kb_root.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        resp = eng.execute("ingest", {"paths": [str(docs_dir)], "kb_root": str(kb_root)})
    except Exception as exc:  # KBError or an unexpected crash: both are engine errors here
        raise EngineFailure(f"ingest of {docs_dir} failed: {describe_error(exc)}") from exc
    seconds = time.perf_counter() - t0
    totals = resp.get("totals", {})
    errors = [f for f in resp.get("files", []) if f.get("status") == "error"]
    print(f"  ingest: {seconds:.1f} s  totals={json.dumps(totals, sort_keys=True)}", flush=True)
    for f in errors[:5]:
        print(f"    error file: {f.get('path')}: {f.get('reason')} {f.get('error') or ''}".rstrip())
    return {"seconds": round(seconds, 3), "totals": totals, "error_files": len(errors)}


def run_queries(eng, kb_root: Path, queries, qrels, stems, mode: str) -> dict:
    """Run every query in one mode. Returns the metrics, or {"skipped": reason} when the first query fails
    (the engine does not offer that mode); later failures are recorded and scored as empty rankings."""
    per_q = {"ndcg@10": [], "recall@10": [], "recall@100": [], "mrr@10": []}
    latencies, failures, notes = [], [], 0
    unmapped = set()
    for i, (qid, text) in enumerate(queries):
        payload = {"query": text, "top_k": DOCS_CUTOFF * CHUNK_FACTOR, "mode": mode, "snippet": 0,
                   "kb_root": str(kb_root)}
        t0 = time.perf_counter()
        try:
            resp = eng.execute("search", payload)
        except Exception as exc:
            if i == 0:
                return {"skipped": describe_error(exc)}
            failures.append({"query_id": qid, "query": text, "error": describe_error(exc)})
            resp = {"results": []}
        else:
            latencies.append((time.perf_counter() - t0) * 1000.0)
        if resp.get("note"):
            notes += 1
        hits = resp.get("results", [])
        ids = []
        for h in hits:
            stem = Path(str(h.get("path") or h.get("file") or "")).stem
            doc = stems.get(stem)
            if doc is None:
                unmapped.add(stem)
            ids.append(doc)
        ranked = first_hit_per_doc(ids, DOCS_CUTOFF)
        judged = qrels[qid]
        per_q["ndcg@10"].append(ndcg_at_k(ranked, judged, 10))
        per_q["recall@10"].append(recall_at_k(ranked, judged, 10))
        per_q["recall@100"].append(recall_at_k(ranked, judged, 100))
        per_q["mrr@10"].append(mrr_at_k(ranked, judged, 10))
        if (i + 1) % 200 == 0:
            print(f"    {mode}: {i + 1}/{len(queries)} queries", flush=True)
    out = {k: round(mean(v), 4) for k, v in per_q.items()}
    out.update({
        "queries": len(queries),
        "latency_ms_p50": round(percentile(latencies, 50), 2),
        "latency_ms_p95": round(percentile(latencies, 95), 2),
        "failed_queries": len(failures),
        "queries_with_note": notes,
    })
    if failures:
        out["failures"] = failures[:20]
    if unmapped:
        out["unmapped_hit_files"] = sorted(unmapped)[:20]
    return out


def dataset_plan(name: str, args) -> dict:
    """Files and query sets of one dataset."""
    if name == "scifact":
        root = Path(args.scifact)
        return {"root": root, "corpus": root / "corpus.jsonl", "qrels": root / "qrels" / "train.tsv",
                "query_sets": [("scifact", root / "queries.jsonl")]}
    if name == "csl":
        root = Path(args.csl)
        return {"root": root, "corpus": root / "corpus.jsonl", "qrels": root / "qrels" / "dev.tsv",
                "query_sets": [("csl-title", root / "queries_title.jsonl"),
                               ("csl-keywords", root / "queries_keywords.jsonl")]}
    raise SystemExit(f"error: unknown dataset {name!r} (choose from scifact, csl)")


def print_table(rows: list[dict]) -> None:
    cols = [("set", "query set", "<14"), ("mode", "mode", "<8"), ("queries", "queries", ">7"),
            ("ndcg@10", "nDCG@10", ">8"), ("recall@10", "R@10", ">7"), ("recall@100", "R@100", ">7"),
            ("mrr@10", "MRR@10", ">7"), ("latency_ms_p50", "p50 ms", ">8"), ("latency_ms_p95", "p95 ms", ">8")]
    header = "  ".join(f"{title:{fmt}}" for _, title, fmt in cols)
    print(header)
    print("-" * len(header))
    for r in rows:
        cells = []
        for key, _, fmt in cols:
            v = r.get(key, "")
            if isinstance(v, float) and key.startswith(("ndcg", "recall", "mrr")):
                v = f"{v:.4f}"
            elif isinstance(v, float):
                v = f"{v:.1f}"
            cells.append(f"{str(v):{fmt}}")
        print("  ".join(cells))


def main(argv=None) -> int:  # noqa: C901
    default_eval = REPO_ROOT.parent / "shared" / "eval"
    ap = argparse.ArgumentParser(description="Retrieval quality of kb_engine on SciFact and CSL.")
    ap.add_argument("--scifact", default=str(default_eval / "scifact"), help="SciFact folder")
    ap.add_argument("--csl", default=str(default_eval / "csl_zh"), help="CSL (Chinese) folder")
    ap.add_argument("--datasets", default="scifact,csl", help="comma list of scifact, csl")
    ap.add_argument("--modes", default="keyword", help="comma list of keyword, vector, hybrid")
    ap.add_argument("--limit-queries", type=int, default=None, metavar="N", help="first N judged queries per set")
    ap.add_argument("--work", default="/tmp/kb-eval", help="cache for the Markdown files and the kb_root")
    ap.add_argument("--rebuild", action="store_true", help="delete the cached kb_root first (full ingest)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--no-record", action="store_true",
                    help="record nothing in benchmarks/results/ (a run with --limit-queries never records)")
    args = ap.parse_args(argv)

    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in KNOWN_MODES:
            print(f"note: mode {m!r} is not one of {', '.join(KNOWN_MODES)}; passing it to the engine anyway")
    plans = {name: dataset_plan(name, args) for name in datasets}
    for name, plan in plans.items():
        missing = [str(p) for p in [plan["corpus"], plan["qrels"]] + [f for _, f in plan["query_sets"]]
                   if not p.is_file()]
        if missing:
            print(f"error: dataset {name}: missing file(s): {', '.join(missing)}", file=sys.stderr)
            return 2

    if set(modes) - {"keyword"}:
        use_offline_model()
    kb_engine = engine()  # imported here so the metric functions can be imported without the engine

    work = Path(args.work)
    report = {"engine": getattr(kb_engine, "__version__", None), "work": str(work),
              "docs_cutoff": DOCS_CUTOFF, "search_top_k": DOCS_CUTOFF * CHUNK_FACTOR,
              "modes": modes, "limit_queries": args.limit_queries, "datasets": {}}
    rows: list[dict] = []
    engine_failed = False
    eng = kb_engine.Engine()
    try:
        for name, plan in plans.items():
            print(f"== {name}", flush=True)
            docs_dir = work / name / "docs"
            kb_root = work / name / ".kb"
            if args.rebuild and kb_root.exists():
                shutil.rmtree(kb_root)
            fresh = not kb_root.exists()
            stems = write_corpus(plan["corpus"], docs_dir)
            qrels = read_qrels(plan["qrels"])
            entry = {"corpus_docs": len(stems), "ingest": {**ingest(eng, docs_dir, kb_root), "fresh": fresh},
                     "results": []}
            library = eng.execute("stats", {"kb_root": str(kb_root)})
            entry["library"] = {"chunks": library["chunks"], "vectors": library["vectors"]}
            if entry["ingest"]["error_files"]:
                engine_failed = True
            report["datasets"][name] = entry
            for set_name, qfile in plan["query_sets"]:
                queries = judged_queries(qfile, qrels, args.limit_queries)
                for mode in modes:
                    res = run_queries(eng, kb_root, queries, qrels, stems, mode)
                    res = {"set": set_name, "mode": mode, **res}
                    entry["results"].append(res)
                    if "skipped" in res:
                        print(f"  note: mode {mode!r} skipped for {set_name}: the engine answered {res['skipped']}")
                        if mode == "keyword":
                            engine_failed = True
                        continue
                    rows.append(res)
                    if res["failed_queries"]:
                        engine_failed = True
                        for f in res.get("failures", [])[:3]:
                            print(f"  engine error on query {f['query_id']} ({f['query']!r}): {f['error']}")
                    if res.get("unmapped_hit_files"):
                        print(f"  note: hits outside the corpus: {res['unmapped_hit_files'][:5]}")
                    print(f"  {set_name}/{mode}: nDCG@10={res['ndcg@10']:.4f} R@100={res['recall@100']:.4f} "
                          f"MRR@10={res['mrr@10']:.4f} ({res['queries']} queries)", flush=True)
    except EngineFailure as exc:
        print(f"error: {exc}", file=sys.stderr)
        report["error"] = str(exc)
        engine_failed = True
    finally:
        close = getattr(eng, "close", None)
        if close:
            close()

    print()
    print(f"engine {report['engine']}; search top_k={DOCS_CUTOFF * CHUNK_FACTOR} chunks -> "
          f"first {DOCS_CUTOFF} distinct documents")
    print_table(rows)
    print()
    for name, entry in report["datasets"].items():
        ing = entry["ingest"]
        print(f"ingest {name}: {entry['corpus_docs']} docs in {ing['seconds']:.1f} s "
              f"(totals {json.dumps(ing['totals'], sort_keys=True)})")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    if not (args.no_record or engine_failed or args.limit_queries):
        model = model_name() if set(modes) - {"keyword"} else None
        for name, entry in report["datasets"].items():
            print(f"recorded {record(f'beir_{name}', recorded_figures(entry), model=model, argv=sys.argv)}")
    return 1 if engine_failed else 0


def recorded_figures(entry: dict) -> dict:
    """What a dataset's record keeps: the library, its ingest, and each query set's metrics per mode."""
    ingest_run = entry["ingest"]
    sets: dict[str, dict] = {}
    for res in entry["results"]:
        if "skipped" in res:
            continue
        mode_figures = {key: res[key] for key in ("ndcg@10", "recall@10", "recall@100", "mrr@10", "latency_ms_p50",
                                                  "latency_ms_p95", "queries_with_note")}
        sets.setdefault(res["set"], {"queries": res["queries"], "modes": {}})["modes"][res["mode"]] = mode_figures
    return {"documents": entry["corpus_docs"], **entry["library"],
            "ingest_seconds": ingest_run["seconds"] if ingest_run["fresh"] else None, "sets": sets}


if __name__ == "__main__":
    sys.exit(main())
