"""The exceptions to the lint rules are few and written down: each function over ruff's complexity limit carries
`# noqa: C901`, and CONTRIBUTING lists exactly those (``KB_UPDATE_DOCS=1`` rewrites the list), so the list can only
shrink by a change that splits a function, and a new exception shows in review as a change to CONTRIBUTING."""
from __future__ import annotations

import os
import re
import subprocess

from helpers import ROOT

CONTRIBUTING = ROOT / "CONTRIBUTING.md"
BLOCK = re.compile(r"(<!-- complexity exceptions -->\n).*?(<!-- /complexity exceptions -->)", re.S)
NOQA = re.compile(r"^\s*(?:async\s+)?def\s+(\w+).*#\s*noqa:\s*C901", re.M)
TODAY_AT_MOST = 13          # the count when the limit came in (issue 51): it may only go down


def exceptions() -> list[str]:
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True,
                           timeout=60).stdout.split()
    found = []
    for name in sorted(files):
        path = ROOT / name
        if name == "kb_engine.py" or not path.is_file():
            continue          # built from kb_rag/, where its functions are counted
        text = path.read_text(encoding="utf-8")
        found += [f"`{name}`: `{m.group(1)}`" for m in NOQA.finditer(text)]
    return found


def test_contributing_lists_every_complexity_exception():
    listed = exceptions()
    assert 0 < len(listed) <= TODAY_AT_MOST, f"{len(listed)} functions over the complexity limit: split, not noqa"
    text = CONTRIBUTING.read_text(encoding="utf-8")
    assert BLOCK.search(text), "CONTRIBUTING.md has a <!-- complexity exceptions --> block"
    wanted = BLOCK.sub(lambda m: m.group(1) + "".join(f"- {item}\n" for item in listed) + m.group(2), text)
    if os.environ.get("KB_UPDATE_DOCS") == "1" and wanted != text:
        CONTRIBUTING.write_text(wanted, encoding="utf-8")
        text = wanted
    assert text == wanted, "CONTRIBUTING.md's complexity exceptions differ from the code: run with KB_UPDATE_DOCS=1"
