#!/usr/bin/env python3
"""Serve-mode search latency of kb_engine at library sizes of about 20k and 200k chunks.

The library is synthetic: Markdown papers made of sentences drawn from a fixed scientific
vocabulary, ingested through the real engine (keyword index, chunking).  Vectors are random
unit vectors written straight into the ``vecs`` table and labelled so in the output: encoding
200k chunks with a real model takes hours on a laptop CPU, and latency does not depend on what
the vectors mean.  With ``--real-vectors`` the engine encodes every chunk itself with the
configured model (use it for the small size only).  Queries are encoded by the real model
(``KB_EMBED_MODEL``), so the vector and hybrid timings include query encoding.

For each size it starts ``kb_engine.py serve`` once and prints, per mode:
the first query (model and index load included), then p50/p95 of warm queries, each query
text different so the query cache never answers.

    KB_EMBED_MODEL=/path/to/model python benchmarks/bench_search.py [--sizes 20000,200000]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
ENGINE = REPO_ROOT / "kb_engine.py"
CHUNKS_PER_FILE = 100
VOCABULARY = (
    "graphene copper nucleation domain growth film substrate anneal hydrogen oxygen raman spectroscopy "
    "protein folding ribosome tunnel chaperone domain misfolding kinetics lithium electrolyte interphase "
    "anode cathode cycling capacity impedance perovskite solar cell stability encapsulation moisture "
    "catalyst photocatalysis quantum efficiency band gap exciton lattice phonon transport mobility "
    "electron scattering cross section neural network training corpus embedding retrieval ranking "
    "model dataset benchmark evaluation precision recall temperature pressure thermal conductivity "
    "coral reef bleaching heatwave ocean acidification salinity rice yield drought tolerance gene "
    "expression sequencing mutation enzyme inhibitor binding affinity crystal structure diffraction"
).split()
FILLER = "the of and in to a with for on by was were is that as from this we at which".split()


class Vocabulary:
    """Content words for the synthetic text.

    ``zipf`` (default): the scientific words above plus 20,000 made-up words, drawn with Zipf frequencies, so a
    query term occurs in a realistic share of chunks. ``small``: only the ~150 scientific words, uniformly, so
    nearly every chunk matches every query: the worst case for keyword search.
    """

    def __init__(self, kind: str, seed: int = 5):
        rng = random.Random(seed)
        self.kind = kind
        syllables = [a + b for a in "bcdfghklmnprstvz" for b in "aeiou"]
        made_up = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))) for _ in range(24_000)})
        words = VOCABULARY + made_up[:20_000]
        rng.shuffle(words)
        self.words = VOCABULARY if kind == "small" else words
        weights = np.array([1.0 / (rank + 10) for rank in range(len(self.words))])
        self.cumulative = np.cumsum(weights / weights.sum())

    def draw(self, rng: random.Random) -> str:
        if self.kind == "small":
            return rng.choice(self.words)
        return self.words[min(int(np.searchsorted(self.cumulative, rng.random())), len(self.words) - 1)]


def sentence(rng: random.Random, vocabulary: Vocabulary) -> str:
    words = [vocabulary.draw(rng) if rng.random() < 0.6 else rng.choice(FILLER) for _ in range(rng.randint(12, 24))]
    return " ".join(words).capitalize() + "."


def paragraph(rng: random.Random, vocabulary: Vocabulary) -> str:
    return " ".join(sentence(rng, vocabulary) for _ in range(rng.randint(4, 6)))


def write_corpus(folder: Path, n_chunks: int, vocabulary: Vocabulary, seed: int = 7) -> int:
    """Markdown papers whose paragraphs become roughly one chunk each (files already there are kept)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    files = max(1, n_chunks // CHUNKS_PER_FILE)
    for i in range(files):
        path = folder / f"paper{i:05d}.md"
        if path.exists():
            continue
        sections = ["Introduction", "Methods", "Results", "Discussion"]
        parts = [f"# Synthetic paper {i} on {vocabulary.draw(rng)} {vocabulary.draw(rng)}\n"]
        for name in sections:
            parts.append(f"## {name}\n")
            parts.extend(paragraph(rng, vocabulary) + "\n" for _ in range(CHUNKS_PER_FILE // len(sections)))
        path.write_text("\n".join(parts), encoding="utf-8")
    return files


def engine_call(command: str, payload: dict, env: dict) -> dict:
    proc = subprocess.run([sys.executable, str(ENGINE), command], input=json.dumps(payload).encode(),
                          capture_output=True, env=env, timeout=7200)
    reply = json.loads(proc.stdout)
    if not reply.get("ok"):
        raise SystemExit(f"engine error on {command}: {reply.get('error')}")
    return reply


def fill_random_vectors(kb_root: Path, model_id: str, dim: int, seed: int = 11) -> int:
    """Random unit vectors for every chunk without one (latency only: they carry no meaning)."""
    conn = sqlite3.connect(str(kb_root / "kb.sqlite"))
    rng = np.random.default_rng(seed)
    ids = [r[0] for r in conn.execute("SELECT c.id FROM chunks c LEFT JOIN vecs v ON v.chunk_id = c.id "
                                      "WHERE v.chunk_id IS NULL")]
    for start in range(0, len(ids), 20_000):
        batch = ids[start:start + 20_000]
        matrix = rng.standard_normal((len(batch), dim)).astype(np.float32)
        matrix /= np.linalg.norm(matrix, axis=1, keepdims=True)
        with conn:
            conn.executemany("INSERT INTO vecs(chunk_id, vec) VALUES (?, ?)",
                             ((cid, vec.tobytes()) for cid, vec in zip(batch, matrix)))
    with conn:
        conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('embed_model', ?)", (model_id,))
        conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('embed_dim', ?)", (str(dim),))
        conn.execute("INSERT INTO meta(key, value) VALUES ('generation', '1') ON CONFLICT(key) DO UPDATE "
                     "SET value = CAST(CAST(value AS INTEGER) + 1 AS TEXT)")
    conn.close()
    return len(ids)


class Daemon:
    def __init__(self, env: dict):
        self.proc = subprocess.Popen([sys.executable, str(ENGINE), "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        self.next_id = 0

    def call(self, command: str, payload: dict) -> tuple[dict, float]:
        self.next_id += 1
        started = time.perf_counter()
        line = json.dumps({"id": self.next_id, "command": command, "payload": payload}) + "\n"
        self.proc.stdin.write(line.encode())
        self.proc.stdin.flush()
        while True:
            reply = json.loads(self.proc.stdout.readline())
            if reply.get("event") is None:
                break
        elapsed = (time.perf_counter() - started) * 1000
        if not reply.get("ok"):
            raise SystemExit(f"engine error: {reply.get('error')}")
        return reply["response"], elapsed

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def configured_model() -> str | None:
    """KB_EMBED_MODEL, which encodes the benchmark's queries; None (with a message) when it is not set."""
    model = os.environ.get("KB_EMBED_MODEL")
    if not model:
        print("set KB_EMBED_MODEL to a local sentence-transformers model folder", file=sys.stderr)
    return model


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q)) if values else float("nan")


def bench_size(n_chunks: int, args, model: str) -> dict:
    work = Path(args.work) / f"{args.vocabulary}-n{n_chunks}"
    corpus, kb_root = work / "papers", work / "kb"
    vocabulary = Vocabulary(args.vocabulary)
    files = write_corpus(corpus, n_chunks, vocabulary)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["KB_EMBED_MODEL"] = model if args.real_vectors else "none"
    started = time.perf_counter()
    ingest = engine_call("ingest", {"paths": [str(corpus)], "kb_root": str(kb_root), "background": False}, env)
    ingest_s = time.perf_counter() - started
    stats = engine_call("stats", {"kb_root": str(kb_root)}, dict(env, KB_EMBED_MODEL=model))
    vectors_kind = "real model vectors"
    if not args.real_vectors:
        fill_random_vectors(kb_root, os.path.abspath(model) if os.path.isdir(model) else model, args.dim)
        vectors_kind = f"RANDOM unit vectors (dim {args.dim}, latency only)"
    env["KB_EMBED_MODEL"] = model
    daemon = Daemon(env)
    rng = random.Random(3)
    result = {"vocabulary": args.vocabulary, "chunks": stats["chunks"], "files": files, "ingest_s": round(ingest_s, 1),
              "new_files": ingest["totals"]["added"], "vectors": vectors_kind, "modes": {}}
    try:
        for mode in args.modes.split(","):
            first_query = " ".join(vocabulary.draw(rng) for _ in range(3))
            _, first_ms = daemon.call("search", {"query": first_query, "mode": mode, "kb_root": str(kb_root),
                                                  "top_k": 10})
            warm = []
            for i in range(args.queries):
                query = " ".join(vocabulary.draw(rng) for _ in range(rng.randint(2, 6))) + f" q{i}"
                response, ms = daemon.call("search", {"query": query, "mode": mode, "kb_root": str(kb_root),
                                                      "top_k": 10, "cache": False})
                warm.append(ms)
            result["modes"][mode] = {"first_ms": round(first_ms, 1), "p50_ms": round(percentile(warm, 50), 1),
                                     "p95_ms": round(percentile(warm, 95), 1),
                                     "score_kind": response.get("score_kind"), "note": response.get("note")}
    finally:
        daemon.close()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="20000,200000", help="comma list of approximate chunk counts")
    parser.add_argument("--modes", default="keyword,vector,hybrid")
    parser.add_argument("--queries", type=int, default=40, help="warm queries per mode")
    parser.add_argument("--work", default="/tmp/kb-bench-search")
    parser.add_argument("--real-vectors", action="store_true", help="encode every chunk with the real model")
    parser.add_argument("--dim", type=int, default=384, help="dimension of the random vectors")
    parser.add_argument("--vocabulary", choices=("zipf", "small"), default="zipf",
                        help="zipf: realistic term frequencies; small: every query matches nearly every chunk")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    model = configured_model()
    if not model:
        return 2
    results = []
    for size in (int(s) for s in args.sizes.split(",")):
        print(f"== ~{size} chunks", flush=True)
        figures = bench_size(size, args, model)
        results.append(figures)
        print(f"  {figures['chunks']} chunks in {figures['files']} files ({args.vocabulary} vocabulary); "
              f"ingest {figures['ingest_s']} s "
              f"({figures['new_files']} new files); vectors: {figures['vectors']}")
        print(f"  {'mode':<8} {'first ms':>9} {'p50 ms':>8} {'p95 ms':>8}  score")
        for mode, row in figures["modes"].items():
            print(f"  {mode:<8} {row['first_ms']:>9} {row['p50_ms']:>8} {row['p95_ms']:>8}  {row['score_kind']}"
                  + (f"  note: {row['note']}" if row["note"] else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
