"""Measured figures are quoted from recorded results (issue 30): the tables of README.md and docs/PERFORMANCE.md
between `<!-- figures: NAME -->` and `<!-- /figures -->` are printed by benchmarks/figures.py from
benchmarks/results/*.json, which the benchmarks write. KB_UPDATE_DOCS=1 rewrites the tables."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

from helpers import ROOT

spec = importlib.util.spec_from_file_location("kb_figures", ROOT / "benchmarks" / "figures.py")
figures = importlib.util.module_from_spec(spec)
sys.modules["kb_figures"] = figures
spec.loader.exec_module(figures)

RESULT_KEYS = {"benchmark", "date", "engine", "parser_revision", "commit", "model", "command", "figures"}


def test_every_recorded_result_says_how_it_was_made():
    results = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    assert results, "no recorded results"
    for path in results:
        result = json.loads(path.read_text(encoding="utf-8"))
        assert set(result) == RESULT_KEYS, (path.name, sorted(set(result) ^ RESULT_KEYS))
        assert result["benchmark"] == path.stem and result["command"].startswith("python benchmarks/")


def test_the_docs_quote_the_recorded_figures():
    named = set()
    for path in figures.DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        named |= {m.group(2) for m in figures.BLOCK.finditer(text)}
        wanted = figures.rendered(text)
        if os.environ.get("KB_UPDATE_DOCS") == "1" and wanted != text:
            path.write_text(wanted, encoding="utf-8")
            text = wanted
        assert text == wanted, f"{path.name}'s figure tables differ from benchmarks/results: run with KB_UPDATE_DOCS=1"
    assert named == set(figures.TABLES), "every table the module prints stands in a document, once"
