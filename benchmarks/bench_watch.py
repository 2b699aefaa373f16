#!/usr/bin/env python3
"""What watching a folder costs and how soon a new paper is found: a real resident engine on real files.

A folder of ``--files`` small Markdown notes (20,000 by default, 100 to a sub-folder, as a library of notes and
papers grows) is ingested once, then watched by `kb_engine.py serve`. Measured, with file events (watchdog,
when installed) and with scans alone (KB_WATCH_EVENTS=0):

- idle cost: the daemon's CPU seconds per minute over ``--idle`` seconds in which nothing changes, and how long
  one scan of the folder takes (a stat of every file);
- landing to searchable: a generated PDF paper copied into the folder, then a keyword search every 0.1 s until
  it finds the paper; ``--papers`` times, each a different paper. The settle time is the default (2 s): a file is
  synced once its size and modification time have stood still that long, so it is part of every delay.

    python benchmarks/bench_watch.py [--files 20000] [--idle 60] [--papers 5] [--no-record]

Records ``benchmarks/results/watch.json`` (docs/PERFORMANCE.md quotes it). Keyword search only (no embedding
model): the delay is the text's; vectors follow.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, ServeProcess, engine, record  # noqa: E402

sys.path.insert(0, str(REPO_ROOT / "examples"))
import sample_papers  # noqa: E402

ENGINE = REPO_ROOT / "kb_engine.py"
PAPERS = (sample_papers.make_onecolumn_paper, sample_papers.make_twocolumn_paper, sample_papers.make_hyphenated_paper,
          sample_papers.make_ligature_paper, sample_papers.make_page_labels_paper, sample_papers.make_citing_paper,
          sample_papers.make_cited_paper, sample_papers.make_banner_paper)
QUERIES = {"graphene_cvd_copper.pdf": "oxygen exposure hydrogen anneal nucleation",
           "protein_folding_2col.pdf": "vectorial synthesis interdomain misfolding",
           "battery_electrolytes.pdf": "electrolyte", "photocatalysis_ligatures.pdf": "strontium titanate",
           "ptarmigan_page_labels.pdf": "ptarmigan", "citing_paper_a.pdf": "citation",
           "cited_paper_b.pdf": "cited", "journal_banner.pdf": "journal"}


def notes(folder: Path, count: int) -> None:
    for i in range(count):
        sub = folder / f"notes-{i // 100:03d}"
        sub.mkdir(exist_ok=True)
        (sub / f"note_{i:05d}.md").write_text(f"# Field note {i}\n\nColony {i} of the survey nested on gravel "
                                             f"bars; {i % 97} chicks fledged.\n", encoding="utf-8")


def jobs_idle(kb_root: Path) -> bool:
    folder = kb_root / ".kb-jobs"
    for path in folder.glob("*.json") if folder.is_dir() else ():
        if path.name != "watcher.json" and json.loads(path.read_text())["state"] in ("queued", "running"):
            return False
    return True


def measure(mode: str, folder: Path, kb_root: Path, idle_s: float, papers: int, env: dict) -> dict:
    daemon = ServeProcess(kb_root, {**env, "KB_WATCH_EVENTS": "1" if mode == "events" else "0"})
    try:
        daemon.ok("watch")
        time.sleep(5)                       # the first scan and, with events, the watches are set up
        listed = daemon.ok("watch")         # (file_events is true once the observer runs, after the first round)
        source = listed["sources"][0]
        assert source["pending"] == 0, source
        before, started = daemon.cpu_seconds(), time.monotonic()
        time.sleep(idle_s)
        cpu = daemon.cpu_seconds() - before
        minutes = (time.monotonic() - started) / 60
        source = daemon.ok("watch")["sources"][0]
        delays = []
        with tempfile.TemporaryDirectory() as staging:
            for maker in PAPERS[:papers]:
                paper = maker(Path(staging))
                target = folder / f"{mode}-{paper.name}"
                landed = time.monotonic()
                shutil.copy(paper, target)
                query = QUERIES[paper.name]
                while not any(Path(hit["path"]).name == target.name for hit in
                              daemon.ok("search", {"query": query, "mode": "keyword", "top_k": 20})["results"]):
                    if time.monotonic() - landed > 120:
                        raise RuntimeError(f"{target.name} not found within 120 s")
                    time.sleep(0.1)
                delays.append(round(time.monotonic() - landed, 2))
                while not jobs_idle(kb_root):
                    time.sleep(0.2)
        return {"events": listed["file_events"], "scan_ms": source["scan_ms"], "files": source["files"],
                "idle_cpu_s_per_min": round(cpu / minutes, 3), "idle_seconds": round(minutes * 60, 1),
                "delays_s": delays, "delay_median_s": statistics.median(delays), "delay_max_s": max(delays)}
    finally:
        daemon.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=20_000)
    parser.add_argument("--idle", type=float, default=60.0, help="seconds of idle watching measured")
    parser.add_argument("--papers", type=int, default=5, choices=range(1, len(PAPERS) + 1))
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_")}
    env.update(KB_EMBED_MODEL="none", HF_HUB_OFFLINE="1", KB_OCR="off", KB_ASYNC_THRESHOLD="100000")
    figures: dict = {"files": args.files, "cpus": os.cpu_count(), "settle_s": 2.0,
                     "watchdog": importlib.util.find_spec("watchdog") is not None}
    with tempfile.TemporaryDirectory(prefix="kb-bench-watch-") as tmp:
        folder, kb_root = Path(tmp) / "library", Path(tmp) / "kb"
        folder.mkdir()
        notes(folder, args.files)
        started = time.monotonic()
        first = subprocess.run([sys.executable, str(ENGINE), "ingest"], env=env, capture_output=True,
                               input=json.dumps({"paths": [str(folder)], "kb_root": str(kb_root)}).encode())
        assert json.loads(first.stdout)["totals"]["added"] == args.files, first.stdout[-500:]
        figures["first_ingest_s"] = round(time.monotonic() - started, 1)
        kb = engine().Engine()
        # more files than KB_WATCH_MAX_FILES: the benchmark means it
        kb.execute("watch", {"kb_root": str(kb_root), "add": [str(folder)], "confirm": True})
        kb.close()
        modes = ("events", "scans") if figures["watchdog"] else ("scans",)
        for mode in modes:
            figures[mode] = measure(mode, folder, kb_root, args.idle, args.papers, env)
            for copied in folder.glob(f"{mode}-*.pdf"):     # the next mode lands the same papers afresh
                copied.unlink()
            kb = engine().Engine()
            kb.execute("sync", {"kb_root": str(kb_root)})
            kb.close()
            shown = figures[mode]
            print(f"{mode:<6} {args.files:,} files: one scan {shown['scan_ms']:,.0f} ms; idle "
                  f"{shown['idle_cpu_s_per_min']} CPU s per minute; landing to searchable median "
                  f"{shown['delay_median_s']} s, max {shown['delay_max_s']} s ({shown['delays_s']})", flush=True)
    if not args.no_record:
        print(f"recorded {record('watch', figures, model=None, argv=sys.argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
