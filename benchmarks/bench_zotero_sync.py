#!/usr/bin/env python3
"""What a sync of a watched Zotero library costs once it has been imported, and what a full pass costs.

A Zotero 7 database is created from Zotero's schema files (the shared fixtures: ``KB_ZOTERO_FIXTURES``, else
../shared/zotero) with ``--items`` journal articles (two authors, a tag, a third of them in a collection), each
with a small text attachment in storage/, saved over the days of a year as a real library grows. The library
is watched and synced once (everything is imported), then timed, in process:

- a sync when nothing changed (only the snapshot, the cheap whole-table reads and a stat of every attachment);
- a sync after Zotero saved one edited item (its title) and a sync after a collection was renamed (a third of
  the attachments change their collection path with no item saved);
- a full pass (``KB_ZOTERO_FULL_S=0``: every attachment's metadata read and compared), what every sync cost
  before syncs were incremental.

    python benchmarks/bench_zotero_sync.py [--items 5000] [--repeat 3] [--no-record]

Records ``benchmarks/results/zotero_sync.json`` (docs/PERFORMANCE.md quotes it). No embedding model: the
timings are the sync's own.
"""
from __future__ import annotations

import argparse
import os
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, engine, record  # noqa: E402

sys.path.insert(0, str(REPO_ROOT / "tests"))
import zotero_fixture as zf  # noqa: E402

RATIOS = ("unchanged", "one_item_saved")     # the syncs a full pass would have done the same work for
WORDS = ("graphene copper anneal oxygen protein folding battery cathode lithium coral reef ptarmigan moult "
         "electrolyte catalyst titanate nucleation").split()


def key(prefix: str, index: int) -> str:
    digits = "".join(zf.KEY_ALPHABET[(index // 33 ** n) % 33] for n in range(4))
    return f"{prefix}{digits}XYZ"[:8]


def build(data_dir: Path, items: int, fixtures: Path) -> None:
    data_dir.mkdir(parents=True)
    zf.create_database(data_dir / "zotero.sqlite", fixtures / "schema")
    rnd = random.Random(7)
    con = sqlite3.connect(str(data_dir / "zotero.sqlite"))
    try:
        with con:
            writer = zf.ZoteroWriter(con)
            collection = writer.collection("Materials", "MT4QX8PZ")
            for i in range(items):
                stamp = zf._stamp(i * 365 // items, i % 60)
                parent = writer.article(key("P", i), title=f"Study {i} of {rnd.choice(WORDS)} {rnd.choice(WORDS)}",
                                        date="2020-01-01 2020", journal="Journal of Examples",
                                        authors=[("Ann", f"Author{i % 50}"), ("Bo", "Second")], added=stamp)
                folder = data_dir / "storage" / key("A", i)
                folder.mkdir(parents=True)
                (folder / f"study-{i}.txt").write_text(
                    f"Study {i}. " + " ".join(rnd.choice(WORDS) for _ in range(150)) + f" marker{i}.\n",
                    encoding="utf-8")
                writer.attachment(parent, key("A", i), path=f"storage:study-{i}.txt", link_mode=zf.LINK_IMPORTED_FILE,
                                  content_type="text/plain", added=stamp)
                writer.tag(parent, f"topic-{i % 20}")
                if i % 3 == 0:
                    writer.add_to_collection(collection, parent)
    finally:
        con.close()


def edit(db: Path, sql: str, params: tuple) -> None:
    con = sqlite3.connect(str(db))
    try:
        with con:
            con.execute(sql, params)
    finally:
        con.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3, help="timed syncs of each kind (the median is quoted)")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    fixtures = zf.fixtures_root()
    if fixtures is None:
        print("the shared Zotero fixtures are needed (set KB_ZOTERO_FIXTURES or provide ../shared/zotero)")
        return 2
    for name in [k for k in os.environ if k.startswith("KB_")]:
        del os.environ[name]
    os.environ.update(KB_EMBED_MODEL="none", HF_HUB_OFFLINE="1", KB_OCR="off", KB_INGEST_WORKERS="0")
    kb_engine = engine()
    figures: dict = {"items": args.items, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="kb-bench-zotero-") as tmp:
        data_dir, kb_root = Path(tmp) / "Zotero", Path(tmp) / "kb"
        build(data_dir, args.items, fixtures)
        db = data_dir / "zotero.sqlite"
        figures["database_mb"] = round(db.stat().st_size / 2**20, 1)
        eng = kb_engine.Engine()

        def sync() -> tuple[float, int]:
            started = time.perf_counter()
            reply = eng.execute("sync", {"kb_root": str(kb_root)})
            return time.perf_counter() - started, len(reply["files"])

        try:
            eng.execute("watch", {"kb_root": str(kb_root), "add": [str(data_dir)]})
            seconds, imported = sync()
            assert imported == args.items, imported       # everything: the first sync is a full pass
            figures["first_sync_s"] = round(seconds, 2)
            runs: dict[str, list] = {"unchanged": [], "one_item_saved": [], "collection_renamed": [], "full_pass": []}
            for n in range(args.repeat):
                runs["unchanged"].append(sync())
                edit(db, "UPDATE itemDataValues SET value = ? WHERE valueID = (SELECT d.valueID FROM itemData d JOIN "
                     "items i ON i.itemID = d.itemID JOIN fields f ON f.fieldID = d.fieldID WHERE i.key = ? AND "
                     "f.fieldName = 'title')", (f"Edited title {n}", key("P", 11 + n)))
                edit(db, "UPDATE items SET clientDateModified = ?, dateModified = ? WHERE key = ?",
                     (zf._stamp(400 + n), zf._stamp(400 + n), key("P", 11 + n)))
                runs["one_item_saved"].append(sync())
                edit(db, "UPDATE collections SET collectionName = ?, clientDateModified = ? WHERE key = 'MT4QX8PZ'",
                     (f"Materials {n}", zf._stamp(400 + n, 30)))
                runs["collection_renamed"].append(sync())
                os.environ["KB_ZOTERO_FULL_S"] = "0"
                runs["full_pass"].append(sync())
                del os.environ["KB_ZOTERO_FULL_S"]
                sync()          # the next round starts from an incremental state
        finally:
            eng.close()
    for name, timings in runs.items():
        figures[name] = {"seconds": round(statistics.median(s for s, _ in timings), 3),
                         "entries": max(n for _, n in timings), "each_s": [round(s, 3) for s, _ in timings]}
    full = figures["full_pass"]["seconds"]
    print(f"{args.items:,} attachments ({figures['database_mb']} MB database) on {figures['cpus']} cores; first sync "
          f"{figures['first_sync_s']} s")
    for name in runs:
        shown = figures[name]
        ratio = f" (a full pass takes {full / shown['seconds']:.1f}x as long)" if name in RATIOS else ""
        print(f"  {name:<19} {shown['seconds']:.3f} s{ratio}, {shown['entries']:,} attachment(s) in its entries; "
              f"each {shown['each_s']}")
    if not args.no_record:
        print(f"recorded {record('zotero_sync', figures, model=None, argv=sys.argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
