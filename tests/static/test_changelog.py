"""CHANGELOG.md keeps the shape of Keep a Changelog (issue 51): in each release, one heading of each kind, in the
order Added, Changed, Deprecated, Removed, Fixed, Security, with Known limitations last. Entries were once added
under a fresh heading each time, so one release had Fixed, Added and Changed twice, and a reader looking for what
was fixed had to look in two places.

The changelog says what changed, not how much: measured figures belong to benchmarks/results and the docs that
quote them (tests/static/test_figures.py). A few patterns that only a measurement makes are refused here: a number
on both sides of an arrow (``0.85 -> 0.95``), a speed factor (``2.3x``), a time in milliseconds, and a retrieval
score followed by its value (``MRR@10 0.66``). Limits and defaults (``KB_READ_SECONDS`` (60 s)) stay allowed, so the
check cannot catch every figure; it catches the common ones without false alarms on the current text.
"""
from __future__ import annotations

import re

from helpers import ROOT

CHANGELOG = ROOT / "CHANGELOG.md"
KINDS = ["Added", "Changed", "Deprecated", "Removed", "Fixed", "Security", "Known limitations"]
RELEASE = re.compile(r"^## (\[[^\]]+\].*)$", re.M)
HEADING = re.compile(r"^### (.+?)\s*$", re.M)
FIGURES = {
    "a before/after figure": re.compile(r"\d\s*(?:->|→)\s*\d"),
    "a speed factor": re.compile(r"\b\d+(?:\.\d+)?(?:[-–]\d+(?:\.\d+)?)?x\b"),
    "a time in milliseconds": re.compile(r"\b\d+(?:\.\d+)?(?:[-–]\d+(?:\.\d+)?)?\s?ms\b"),
    "a retrieval score": re.compile(r"\b(?:MRR|nDCG|[Rr]ecall|[Pp]recision|accuracy)(?:@\d+)?:?\s+\d*\.\d"),
}


def releases(text: str) -> dict[str, list[str]]:
    """Each release's title and the kinds of its ### headings, in the order they stand."""
    found = {}
    starts = list(RELEASE.finditer(text))
    for here, after in zip(starts, starts[1:] + [None]):
        body = text[here.end():after.start() if after else len(text)]
        found[here.group(1)] = HEADING.findall(body)
    return found


def problems(text: str) -> list[str]:
    """What breaks the one-heading-per-kind rule, release by release."""
    found = []
    for release, kinds in releases(text).items():
        unknown = [kind for kind in kinds if kind not in KINDS]
        twice = sorted({kind for kind in kinds if kinds.count(kind) > 1})
        known = [kind for kind in kinds if kind in KINDS]
        if unknown:
            found.append(f"{release}: headings that are not a Keep a Changelog kind: {unknown}")
        if twice:
            found.append(f"{release}: headings that stand more than once: {twice}")
        if known != sorted(known, key=KINDS.index):
            found.append(f"{release}: headings out of order: {known}, wanted the order of {KINDS}")
    return found


def test_each_release_has_one_heading_of_each_kind_in_order():
    text = CHANGELOG.read_text(encoding="utf-8")
    assert "## [Unreleased]" in text and len(releases(text)) >= 2, "CHANGELOG.md has its releases"
    assert problems(text) == []


def test_the_check_finds_what_it_is_for():
    text = "## [Unreleased]\n### Fixed\n- a\n### Added\n- b\n### Fixed\n- c\n### Notes\n- d\n## [0.1.0]\n### Added\n"
    found = problems(text)
    assert len(found) == 3 and "['Notes']" in found[0] and "['Fixed']" in found[1] and "out of order" in found[2]
    assert problems("## [0.1.0]\n### Added\n### Changed\n### Fixed\n### Known limitations\n") == []


def test_no_measured_figures():
    text = CHANGELOG.read_text(encoding="utf-8")
    found = [f"{what}: {m.group(0)!r} in {line.strip()[:100]!r}"
             for line in text.splitlines() for what, pattern in FIGURES.items() for m in pattern.finditer(line)]
    assert found == [], "name the benchmark instead of quoting its figure:\n  " + "\n  ".join(found)


def test_the_figure_patterns_catch_figures():
    figures = ["MRR@10 0.664 -> 0.698", "0.85 → 0.95", "about 3x faster", "2.2-2.8x faster", "about 26 ms",
               "2-4 ms more", "heading recall 0.650", "nDCG@10 0.6939", "label precision 0.231"]
    for figure in figures:
        assert any(pattern.search(figure) for pattern in FIGURES.values()), figure
    allowed = ["`KB_READ_SECONDS` (60 s)", "`KB_DOCX_MAX_RATIO` (100×)", "a 64×64 matmul", "MRR@10 per mode",
               "engine self-test → Node", "`KB_OCR_MAX_MEGAPIXELS` (40)", "pages with 2% controls"]
    for text in allowed:
        assert not any(pattern.search(text) for pattern in FIGURES.values()), text
