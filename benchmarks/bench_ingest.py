#!/usr/bin/env python3
"""Ingest speed of kb_engine: a full first ingest of a folder, then an unchanged re-ingest.

The folder (default: $KB_CORPUS_DIR, else ../shared/corpus beside the repository) is ingested into a
fresh temporary kb_root; then the same folder is ingested again with a new Engine instance (as a new
CLI process would), which should only compare (path, size, mtime) and skip. The goal is a re-ingest
that costs under 5% of the first one.

    python benchmarks/bench_ingest.py [DIR] [--keep] [--out bench.json] [--record NAME | --no-record]

A run over the shared corpus records its figures as ``benchmarks/results/ingest_corpus.json`` (``--record NAME``
records another folder's run under NAME), which the README and docs/PERFORMANCE.md tables quote.

Exit status: 0 when both runs completed, 1 when the engine raised an error, 2 when the folder is missing.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, default_corpus, engine, model_name, record  # noqa: E402

SUPPORTED = {".pdf", ".docx", ".txt", ".md", ".markdown"}
GOAL_PCT = 5.0


def count_supported(folder: Path) -> int:
    return sum(1 for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in SUPPORTED)


def status_counts(files: list[dict]) -> dict[str, int]:
    """Counts per 'status' or 'status/reason'."""
    c = Counter()
    for f in files:
        key = f.get("status", "?")
        if f.get("reason"):
            key += "/" + str(f["reason"])
        c[key] += 1
    return dict(sorted(c.items()))


def timed_ingest(kb_engine, folder: Path, kb_root: Path, via: str = "cli") -> tuple[dict, float]:
    """One ingest, timed: ``cli`` runs a fresh ``kb_engine.py ingest`` process as a user or host would
    (interpreter start, imports and model load included; files read ahead in worker processes), ``api`` calls a
    new Engine in this process (files read in-process)."""
    if via == "cli":
        import subprocess
        payload = json.dumps({"paths": [str(folder)], "kb_root": str(kb_root), "background": False})
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, str(REPO_ROOT / "kb_engine.py"), "ingest"], input=payload.encode(),
                              capture_output=True, timeout=7200)
        elapsed = time.perf_counter() - t0
        reply = json.loads(proc.stdout or b"{}")
        if not reply.get("ok"):
            raise RuntimeError(f"engine error: {reply.get('error') or proc.stderr.decode(errors='replace')[-500:]}")
        return reply, elapsed
    eng = kb_engine.Engine()
    try:
        t0 = time.perf_counter()
        resp = eng.execute("ingest", {"paths": [str(folder)], "kb_root": str(kb_root)})
        return resp, time.perf_counter() - t0
    finally:
        close = getattr(eng, "close", None)
        if close:
            close()


def embedding_floor(kb_engine, kb_root: Path) -> tuple[int, float, float] | None:
    """Seconds the configured embedding model alone needs for all chunk texts of the library (length-sorted
    batches, as ingest uses): the physical floor of a first ingest with vectors. None without a model."""
    import sqlite3
    models = kb_engine.Models()
    loading = time.perf_counter()
    try:
        embedder = models.embedder(may_download=False)
    except kb_engine.ModelUnavailable:
        return None
    load_seconds = time.perf_counter() - loading
    conn = sqlite3.connect(str(kb_root / "kb.sqlite"))
    texts = [row[0] for row in conn.execute("SELECT text FROM chunks ORDER BY length(text)")]
    conn.close()
    started = time.perf_counter()
    for begin in range(0, len(texts), 256):
        embedder.encode_passages(texts[begin:begin + 256])
    return len(texts), time.perf_counter() - started, load_seconds


def main(argv=None) -> int:
    default_dir = default_corpus()
    ap = argparse.ArgumentParser(description="First ingest vs unchanged re-ingest of a folder.")
    ap.add_argument("folder", nargs="?", default=default_dir, help=f"folder to ingest (default {default_dir})")
    ap.add_argument("--keep", action="store_true", help="keep the temporary kb_root and print where it is")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--via", choices=("cli", "api"), default="cli",
                    help="cli: each ingest is a fresh kb_engine.py process (default); api: in this process")
    ap.add_argument("--record", default=None, metavar="NAME",
                    help="record the figures as benchmarks/results/NAME.json (default: ingest_corpus for the "
                         "shared corpus, nothing for another folder)")
    ap.add_argument("--no-record", action="store_true", help="record nothing")
    args = ap.parse_args(argv)

    folder = Path(args.folder)
    if not folder.is_dir():
        print(f"error: folder not found: {folder} (set KB_CORPUS_DIR or pass a folder)", file=sys.stderr)
        return 2

    kb_engine = engine()

    tmp = Path(tempfile.mkdtemp(prefix="kb-bench-ingest-"))
    kb_root = tmp / ".kb"
    report = {"engine": getattr(kb_engine, "__version__", None), "folder": str(folder),
              "supported_files_on_disk": count_supported(folder), "kb_root": str(kb_root)}
    rc = 0
    try:
        try:
            first, t_first = timed_ingest(kb_engine, folder, kb_root, args.via)
            second, t_second = timed_ingest(kb_engine, folder, kb_root, args.via)
        except Exception as exc:  # KBError or a crash inside the engine
            code = getattr(exc, "code", None)
            print(f"error: engine failed on ingest of {folder}: {type(exc).__name__}"
                  f"{f'[{code}]' if code else ''}: {exc}", file=sys.stderr)
            report["error"] = str(exc)
            rc = 1
        else:
            ratio = 100.0 * t_second / t_first if t_first > 0 else float("nan")
            files = first.get("files", [])
            slowest = sorted(files, key=lambda f: f.get("ms") or 0, reverse=True)[:5]
            second_not_skipped = [f for f in second.get("files", []) if f.get("status") != "skipped"]
            report.update({
                "files": first.get("totals", {}).get("files", len(files)),
                "first": {"seconds": round(t_first, 3), "totals": first.get("totals", {}),
                          "by_status": status_counts(files)},
                "reingest": {"seconds": round(t_second, 3), "totals": second.get("totals", {}),
                             "by_status": status_counts(second.get("files", []))},
                "reingest_pct": round(ratio, 2),
                "goal_pct": GOAL_PCT,
                "goal_met": ratio < GOAL_PCT,
                "slowest": [{"path": f.get("path"), "ms": f.get("ms"), "status": f.get("status"),
                             "chunks": f.get("chunks")} for f in slowest],
                "reingest_not_skipped": [{"path": f.get("path"), "status": f.get("status"),
                                          "reason": f.get("reason")} for f in second_not_skipped],
            })
            print(f"engine {report['engine']}; folder {folder}; each ingest via {args.via}")
            print(f"files:        {report['files']} reported ({report['supported_files_on_disk']} supported on disk)")
            print(f"totals first: {json.dumps(first.get('totals', {}), sort_keys=True)}")
            print(f"totals again: {json.dumps(second.get('totals', {}), sort_keys=True)}")
            chunks = first.get("totals", {}).get("chunks_written", 0)
            print(f"first ingest: {t_first:8.2f} s  ({report['files'] / t_first:.1f} files/s, "
                  f"{chunks / t_first:.1f} chunks/s)")
            if first.get("totals", {}).get("vectors_written"):
                floor = embedding_floor(kb_engine, kb_root)
                if floor:
                    n, seconds, load = floor
                    report["embedding_only"] = {"chunks": n, "seconds": round(seconds, 3),
                                                "model_load_s": round(load, 3),
                                                "ingest_over_embedding": round(t_first / seconds, 3),
                                                "ingest_over_embedding_and_load": round(t_first / (seconds + load), 3)}
                    print(f"embedding alone: {seconds:8.2f} s for {n} chunks (+ {load:.1f} s model load); first "
                          f"ingest = {t_first / seconds:.2f} x the embedding time, {t_first / (seconds + load):.2f} x "
                          f"embedding + load (goal <= 1.3)")
            print(f"re-ingest:    {t_second:8.2f} s")
            print(f"ratio:        {ratio:8.2f} %  (goal < {GOAL_PCT:.0f}%: {'met' if ratio < GOAL_PCT else 'NOT met'})")
            print("per status (first ingest):")
            for k, v in report["first"]["by_status"].items():
                print(f"  {k:<28} {v:5d}")
            if second_not_skipped:
                print(f"re-ingest statuses other than skipped: {len(second_not_skipped)} file(s) "
                      f"{json.dumps(report['reingest']['by_status'], sort_keys=True)}:")
                for f in second_not_skipped[:10]:
                    print(f"  {f.get('status')}/{f.get('reason')}: {f.get('path')}")
            print("slowest 5 files (first ingest):")
            for f in slowest:
                print(f"  {f.get('ms') or 0:8.0f} ms  {f.get('status'):<9} {f.get('chunks') or 0:5} chunks  "
                      f"{f.get('path')}")
    finally:
        if args.keep:
            print(f"kept kb_root: {kb_root}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            report["kb_root"] = None
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    name = args.record or ("ingest_corpus" if folder.resolve() == Path(default_dir).resolve() else None)
    if rc == 0 and name and not args.no_record:
        vectors = report["first"]["totals"].get("vectors_written")
        figures = recorded_figures(report, args.via)
        print(f"recorded {record(name, figures, model=model_name() if vectors else None, argv=sys.argv)}")
    return rc


def recorded_figures(report: dict, via: str) -> dict:
    """What the record keeps: the folder's files by outcome, both ingests' times, and the embedding floor."""
    by_status = Counter()
    for key, count in report["first"]["by_status"].items():
        by_status[key.split("/")[0]] += count
    totals = report["first"]["totals"]
    return {"via": via, "files": report["files"], "supported_files_on_disk": report["supported_files_on_disk"],
            "outcomes": dict(sorted(by_status.items())), "by_status": report["first"]["by_status"],
            "chunks": totals.get("chunks_written", 0), "vectors": totals.get("vectors_written", 0),
            "first_seconds": report["first"]["seconds"], "reingest_seconds": report["reingest"]["seconds"],
            "reingest_pct": report["reingest_pct"], "embedding_only": report.get("embedding_only")}


if __name__ == "__main__":
    sys.exit(main())
