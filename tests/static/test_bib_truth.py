"""The bibliographic truth tables of benchmarks/eval_bib.py are well formed, every fetched paper has its source, and
the benchmark's comparisons judge what they say they judge."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import eval_bib  # noqa: E402

KINDS = {
    "journal-article", "conference-paper", "phd-thesis", "masters-thesis", "bachelor-thesis", "report", "preprint",
    "book", "chapter", "document",
}
TABLES = {
    "bib_truth_heldout.tsv": "bib_heldout_sources.tsv",
    "bib_truth_dev_fetched.tsv": "bib_dev_sources.tsv",
    "bib_truth_dev.tsv": None,  # the shared corpus: its own MANIFEST.tsv files say where each paper comes from
}


def _sources(name: str) -> dict[str, dict]:
    with (BENCHMARKS / name).open(encoding="utf-8", newline="") as fh:
        lines = [line for line in fh if line.strip() and not line.startswith("#")]
    return {row["path"]: row for row in csv.DictReader(lines, delimiter="\t", quoting=csv.QUOTE_NONE)}


@pytest.mark.parametrize("table", sorted(TABLES))
def test_each_truth_table_is_well_formed(table):
    rows = eval_bib.load_truth(BENCHMARKS / table)
    paths = [row["path"] for row in rows]
    assert len(paths) == len(set(paths)), f"{table}: a paper named twice"
    for row in rows:
        assert row["kind"] in KINDS, row["path"]
        assert row["authors_complete"] in ({"yes", "no"} if row["authors"] else {""}), row["path"]
        assert not row["year"] or (row["year"].isdigit() and 1900 <= int(row["year"]) <= 2030), row["path"]
        assert not row["pages"] or "–" not in row["pages"], f"{row['path']}: pages use a plain hyphen"
        if row["kind"] in ("phd-thesis", "masters-thesis", "bachelor-thesis", "preprint", "document"):
            assert not (row["volume"] or row["issue"]), f"{row['path']}: a {row['kind']} has no volume or issue"
    sources = TABLES[table]
    if sources:
        known = _sources(sources)
        assert set(paths) <= set(known), set(paths) - set(known)
        digests = [known[p]["sha256"] for p in paths]
        assert len(digests) == len(set(digests)), f"{table}: the same file twice"
        assert all(len(d) == 64 for d in digests)


def test_the_held_out_set_is_large_enough_and_apart_from_the_development_set():
    heldout = eval_bib.load_truth(BENCHMARKS / "bib_truth_heldout.tsv")
    assert len(heldout) >= 40
    dev = _sources("bib_dev_sources.tsv")
    held = _sources("bib_heldout_sources.tsv")
    assert not {r["sha256"] for r in dev.values()} & {r["sha256"] for r in held.values()}


def test_the_comparisons():
    assert eval_bib.venue_ok("Physical Review E | Phys. Rev. E", "PHYSICAL REVIEW E")
    assert eval_bib.venue_ok("1st Conference on Robot Learning | CoRL 2017",
                             "1st Conference on Robot Learning (CoRL 2017)")
    assert not eval_bib.venue_ok("Physical Review E", "Physical Review Letters")
    assert not eval_bib.venue_ok("Physical Review E", None)
    assert eval_bib.number_ok("147-154", "147–154") and eval_bib.number_ok("061102", "061102")
    assert not eval_bib.number_ok("147-154", "147") and not eval_bib.number_ok("4", "")
    row = {"authors": "Ann Lee; Bo Chen", "authors_complete": "no"}
    assert eval_bib.authors_ok(row, {"authors": ["A. Lee", "Bo Chen"], "authors_more": True})
    assert not eval_bib.authors_ok(row, {"authors": ["Ann Lee", "Bo Chen"], "authors_more": False})
    assert not eval_bib.authors_ok(row, {"authors": ["Ann Lee"], "authors_more": True})
    # a value the pages do not print is counted as invented
    truth = dict.fromkeys(eval_bib.COLUMNS, "")
    assert eval_bib.invented(truth, {"journal": "X", "volume": None, "page_range": "3"}) == ["venue", "pages"]
