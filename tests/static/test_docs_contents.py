"""DESIGN.md carries a contents list made from its own headings (issue 19): the test fails when a heading is
added, renamed or removed without the list following. ``KB_UPDATE_DOCS=1`` rewrites the list."""
from __future__ import annotations

import os
import re

from helpers import ROOT

DESIGN = ROOT / "docs" / "DESIGN.md"
START, END = "<!-- contents -->", "<!-- /contents -->"


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def contents(text: str) -> str:
    lines, in_code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else re.match(r"(##+) (.+)", line)
        if match and len(match.group(1)) <= 3:
            indent = "  " * (len(match.group(1)) - 2)
            lines.append(f"{indent}- [{match.group(2)}](#{anchor(match.group(2))})")
    return "\n".join(lines)


def test_design_contents_list_matches_its_headings():
    text = DESIGN.read_text(encoding="utf-8")
    assert START in text and END in text, "DESIGN.md lost its contents markers"
    head, rest = text.split(START, 1)
    current, tail = rest.split(END, 1)
    wanted = "\n" + contents(tail) + "\n"
    if os.environ.get("KB_UPDATE_DOCS") == "1" and current != wanted:
        DESIGN.write_text(head + START + wanted + END + tail, encoding="utf-8")
        current = wanted
    assert current == wanted, "DESIGN.md's contents list is stale: run the tests with KB_UPDATE_DOCS=1"
