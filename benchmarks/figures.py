"""The figure tables of README.md and docs/PERFORMANCE.md, printed from the recorded results.

Each table stands in its document between ``<!-- figures: NAME -->`` and ``<!-- /figures -->``; ``TABLES`` maps
NAME to the function that prints it from ``benchmarks/results/*.json`` (written by the benchmarks through
common.record). tests/static/test_figures.py fails when a document's table differs from what the results say;
``KB_UPDATE_DOCS=1`` rewrites it. ``python benchmarks/figures.py`` rewrites them too. Standard library only.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, RESULTS_DIR, recorded  # noqa: E402

BLOCK = re.compile(r"(<!-- figures: ([\w-]+) -->\n)(.*?)(<!-- /figures -->)", re.S)
DOCUMENTS = (REPO_ROOT / "README.md", REPO_ROOT / "docs" / "PERFORMANCE.md")
MODES = ("keyword", "vector", "hybrid")


def _need(name: str, results_dir: Path) -> dict:
    result = recorded(name, results_dir)
    if result is None:
        raise LookupError(f"benchmarks/results/{name}.json is missing: run the benchmark that records it")
    return result


def _source(result: dict) -> str:
    model = f", {result['model']}" if result.get("model") else ""
    return (f"{result['date']}, engine {result['engine']} (parser revision {result['parser_revision']}"
            f"{', ' + result['commit'] if result.get('commit') else ''}){model}")


def _pages_cell(figures: dict) -> str:
    modes = figures["modes"]
    hybrid = modes["hybrid"]["all"]
    others = ", ".join(f"{mode} {modes[mode]['all']['mrr@10']:.3f} / {modes[mode]['all']['hit@5']:.3f}"
                       for mode in MODES[:2] if mode in modes)
    return f"hybrid MRR@10 **{hybrid['mrr@10']:.3f}**, page-hit@5 **{hybrid['hit@5']:.3f}** ({others})"


def _sections_cell(figures: dict) -> str:
    return (f"heading recall **{figures['recall']:.3f}**, label precision **{figures['precision']:.3f}**, level "
            f"accuracy **{figures['level_accuracy']:.3f}** ({figures['headings']} printed headings)")


def _metadata_cell(figures: dict) -> str:
    fields = figures["fields"]
    shown = ", ".join(f"{label} {fields[key]['correct']}/{fields[key]['total']}"
                      for key, label in (("doi", "DOI"), ("title", "title"), ("year", "year"),
                                         ("authors", "complete author list")))
    false = figures["false_dois"]
    return f"{shown}; false DOIs {false['spurious'] + false['wrong']}"


def readme_quality(results_dir: Path = RESULTS_DIR) -> str:
    """README's table of quality on full papers."""
    main = _need("fulltext_questions", results_dir)
    held = _need("fulltext_heldout", results_dir)
    sections = _need("section_headings", results_dir)
    metadata = _need("metadata", results_dir)
    m, h = main["figures"], held["figures"]
    rows = [
        ("what", "result"), ("---", "---"),
        (f"full-text questions ({m['questions']} questions on {m['papers']} papers; a hit is the right paper and "
         "the answer's page)", _pages_cell(m)),
        (f"held-out full-text questions, written after tuning ({h['questions']} on {h['papers']} other documents, "
         f"{h['library_documents']} documents in the library)", _pages_cell(h)),
        (f"section labels ({sections['figures']['documents']} papers, the headings they print)",
         _sections_cell(sections["figures"])),
        (f"metadata ({metadata['figures']['documents']} documents read by a person)",
         _metadata_cell(metadata["figures"])),
    ]
    table = "\n".join(f"| {a} | {b} |" for a, b in rows)
    dates = sorted({r["date"] for r in (main, held, sections, metadata)})
    return (f"{table}\n\nRecorded in `benchmarks/results/` ({', '.join(dates)}; all-MiniLM-L6-v2 for the vector "
            "half, no reranker); `python benchmarks/figures.py` prints this table from them.\n")


def _pages_table(result: dict) -> str:
    figures = result["figures"]
    rows = ["| mode | page-hit@1 | @5 | @10 | MRR@10 | not in the abstract: @1 / @5 / MRR@10 | ms per question |",
            "|---|---|---|---|---|---|---|"]
    for mode, res in figures["modes"].items():
        a, b = res["all"], res["body_only"]
        strong = (lambda v: f"**{v:.3f}**") if mode == "hybrid" else (lambda v: f"{v:.3f}")
        rows.append(f"| {mode} | {strong(a['hit@1'])} | {strong(a['hit@5'])} | {a['hit@10']:.3f} | "
                    f"{strong(a['mrr@10'])} | {b['hit@1']:.3f} / {b['hit@5']:.3f} / {b['mrr@10']:.3f} | "
                    f"{res.get('ms_per_query', 0):.0f} |")
    cov = figures["coverage"]
    return ("\n".join(rows) + f"\n\n{figures['questions']} questions on {figures['papers']} documents, "
            f"{figures['library_documents']} documents in the library; body pages with a passage: "
            f"{cov['body_pages_with_chunks']} of {cov['body_pages']}. Recorded {_source(result)}.\n")


def performance_fulltext(results_dir: Path = RESULTS_DIR) -> str:
    return _pages_table(_need("fulltext_questions", results_dir))


def performance_heldout(results_dir: Path = RESULTS_DIR) -> str:
    return _pages_table(_need("fulltext_heldout", results_dir))


def performance_sections(results_dir: Path = RESULTS_DIR) -> str:
    rows = ["| set | papers | headings | heading recall (with the next page) | label precision | level accuracy |",
            "|---|---|---|---|---|---|"]
    dates = []
    for name, label in (("section_headings", "main"), ("section_headings_heldout", "held-out")):
        result = recorded(name, results_dir)
        if result is None:
            continue
        f = result["figures"]
        dates.append(_source(result))
        rows.append(f"| {label} | {f['documents']} | {f['headings']} | **{f['recall']:.3f}** "
                    f"({f['recall_next']:.3f}) | **{f['precision']:.3f}** ({f['real_labels']}/{f['labels']}) | "
                    f"**{f['level_accuracy']:.3f}** ({f['level_ok']}/{f['found']}) |")
    return "\n".join(rows) + f"\n\nRecorded {'; '.join(dict.fromkeys(dates))}.\n"


def performance_metadata(results_dir: Path = RESULTS_DIR) -> str:
    result = _need("metadata", results_dir)
    fields = result["figures"]["fields"]
    rows = ["| field | correct | of | % |", "|---|---|---|---|"]
    for key, label in (("doi", "DOI"), ("title", "title"), ("title_lenient", "title, lenient"), ("year", "year"),
                       ("first_author", "first author"), ("authors", "complete author list")):
        f = fields[key]
        rows.append(f"| {label} | {f['correct']} | {f['total']} | {f['pct']} |")
    false = result["figures"]["false_dois"]
    return ("\n".join(rows) + f"\n\nFalse DOIs: {false['spurious']} where the document has none, {false['wrong']} "
            f"wrong. Recorded {_source(result)}.\n")


TABLES: dict[str, Callable[[Path], str]] = {
    "readme-quality": readme_quality,
    "performance-fulltext": performance_fulltext,
    "performance-heldout": performance_heldout,
    "performance-sections": performance_sections,
    "performance-metadata": performance_metadata,
}


def rendered(text: str, results_dir: Path = RESULTS_DIR) -> str:
    """``text`` with every figures block printed afresh from the results."""
    def table(match: re.Match) -> str:
        return match.group(1) + TABLES[match.group(2)](results_dir) + match.group(4)
    return BLOCK.sub(table, text)


def main() -> int:
    for path in DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        wanted = rendered(text)
        if wanted != text:
            path.write_text(wanted, encoding="utf-8")
            print(f"rewrote the figures of {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
