#!/usr/bin/env python3
"""How fast and in how much memory kb-rag refuses DOCX files that expand to hundreds of megabytes.

Each case is a small DOCX whose word/document.xml expands far past KB_DOCX_MAX_XML_MB (many short paragraphs,
or one enormous text run), put in a folder beside a normal paper. The folder is ingested by the real command line
in a child process, with no embedding model; printed per case: the file's size, what it expands to, the engine's
verdict for it, whether the paper beside it was indexed, the seconds the whole ingest took, and the peak resident
memory of the engine process.

    python benchmarks/bench_docx_bomb.py [--sizes 50,200,500] [--run-mb 100] [--out figures.json]

A run records its rows as ``benchmarks/results/docx_bomb.json`` (``--no-record`` not), which docs/PERFORMANCE.md
quotes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, record, run_with_peak  # noqa: E402

for folder in (REPO_ROOT / "tests", REPO_ROOT / "examples", REPO_ROOT):
    sys.path.insert(0, str(folder))

import hostile_files  # noqa: E402
import sample_papers  # noqa: E402

ENGINE = REPO_ROOT / "kb_engine.py"


def measure(folder: Path, kb_root: Path) -> dict:
    """Ingest ``folder`` in a child of a fresh process, so the peak memory is the engine's alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_")}
    env.update(KB_EMBED_MODEL="none", PYTHONIOENCODING="utf-8")
    result = run_with_peak([sys.executable, str(ENGINE), "ingest", str(folder), "--kb-root", str(kb_root), "--json"],
                           env=env, timeout=600)
    return {"reply": json.loads(result["stdout"]), "seconds": result["seconds"], "peak_mb": result["peak_kb"] / 1024}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="50,200,500", help="expansions in MB of the many-paragraph DOCX cases")
    ap.add_argument("--run-mb", type=int, default=100, help="size in MB of the one-text-run case (0: skip)")
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument("--no-record", action="store_true", help="record nothing in benchmarks/results/")
    args = ap.parse_args(argv)
    cases = [("paragraphs", int(s)) for s in args.sizes.split(",") if s.strip()]
    if args.run_mb:
        cases.append(("one run", args.run_mb))
    rows = []
    with tempfile.TemporaryDirectory(prefix="kb-docx-bomb-") as work:
        for n, (shape, mb) in enumerate(cases):
            folder = Path(work) / f"case{n}"
            folder.mkdir()
            bomb = folder / f"bomb_{mb}mb.docx"
            started = time.monotonic()
            if shape == "paragraphs":
                hostile_files.docx_many_paragraphs(bomb, mb)
            else:
                hostile_files.docx_one_long_run(bomb, mb)
            built_s = time.monotonic() - started
            paper = sample_papers.make_hyphenated_paper(folder)
            figures = measure(folder, Path(work) / f"kb{n}")
            entries = {Path(e["path"]).name: e for e in figures["reply"]["files"]}
            rows.append({"case": f"{shape}, {mb} MB", "file_kb": round(bomb.stat().st_size / 1024),
                         "expands_mb": mb,
                         "verdict": f"{entries[bomb.name]['status']}/{entries[bomb.name].get('reason')}",
                         "paper_beside": entries[paper.name]["status"], "seconds": round(figures["seconds"], 2),
                         "peak_mb": round(figures["peak_mb"]), "build_s": round(built_s, 1)})
    print(f"{'case':<20} {'file':>8} {'expands':>8}  {'verdict':<16} {'paper beside':<13} "
          f"{'seconds':>8} {'peak MB':>8}")
    for r in rows:
        print(f"{r['case']:<20} {r['file_kb']:>6}KB {r['expands_mb']:>6}MB  {r['verdict']:<16} {r['paper_beside']:<13} "
              f"{r['seconds']:>8.2f} {r['peak_mb']:>8}")
    print(f"limits: KB_DOCX_MAX_XML_MB={os.environ.get('KB_DOCX_MAX_XML_MB', 64)} "
          f"KB_DOCX_MAX_RATIO={os.environ.get('KB_DOCX_MAX_RATIO', 100)} (defaults unless set)")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    if not args.no_record:
        print(f"recorded {record('docx_bomb', {'cases': rows}, model=None, argv=sys.argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
