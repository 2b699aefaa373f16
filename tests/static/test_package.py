"""The engine is developed as the package kb_rag/ and shipped as one file built from it (scripts/build_engine.py).

The tree is the map of the engine, so these checks keep it one: every module opens with a docstring that says what
it holds and which modules it may import, imports no other, and stays under MODULE_LINE_BUDGET lines; the public
surface is declared once; and CONTRIBUTING's module map is generated from the docstrings. What the one file needs
of the package (one definition per name, names imported rather than modules, every name a module uses defined or
imported there, the same meaning for an external name everywhere, no cycle) is checked by the build itself; the
tests below hold the build to those refusals on small packages of their own, and build one into a file that runs.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import build_engine_module
from helpers import ENGINE, ROOT

build = build_engine_module()
PACKAGE = ROOT / "kb_rag"
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
MODULE_LINE_BUDGET = 900       # a module that grows past it holds two things: split it
MAY_IMPORT = re.compile(r"May import: (.+?)\.\s*(?:\n\n|\Z)", re.S)
NONE = "no module of the package"
MAP_BLOCK = re.compile(r"(<!-- module map -->\n).*?(<!-- /module map -->)", re.S)
PUBLIC = re.compile(r"Public surface: (.+?)\.\s*\Z", re.S)


def _modules():
    return build.load(PACKAGE)


def declared_imports(module) -> list[str] | None:
    """The modules a module's docstring says it may import (dotted, under kb_rag), or None when it does not say."""
    found = MAY_IMPORT.search(module.docstring)
    if found is None:
        return None
    text = " ".join(found.group(1).split())
    return [] if text == NONE else [name.strip() for name in text.split(",")]


def test_the_package_keeps_the_rules_of_the_one_file_and_the_file_is_its_build():
    modules = _modules()
    build.check(modules)
    assert build.build(PACKAGE) == ENGINE.read_text(encoding="utf-8"), (
        "kb_engine.py is not what kb_rag/ builds: run python scripts/build_engine.py")


def test_every_module_says_what_it_holds_and_imports_only_what_it_may():
    problems = []
    modules = _modules()
    for module in modules.values():
        if not module.docstring.strip():
            problems.append(f"{module.shown}: no docstring saying what it holds")
            continue
        if module.is_package:
            continue                       # a folder's __init__ says what the folder holds; it imports nothing
        declared = declared_imports(module)
        if declared is None:
            problems.append(f"{module.shown}: its docstring does not say what it may import ('May import: ...')")
            continue
        imported = {target for target, _names, _line in module.package_imports}
        unknown = sorted(set(declared) - set(modules))
        if unknown:
            problems.append(f"{module.shown}: may import modules that do not exist: {unknown}")
        beyond = sorted(imported - set(declared))
        if beyond:
            problems.append(f"{module.shown}: imports {beyond}, which its docstring does not allow")
    assert not problems, "\n".join(problems)


def test_no_module_is_over_its_line_budget():
    over = [f"{m.shown}: {m.source.count(chr(10))} lines" for m in _modules().values()
            if m.source.count("\n") > MODULE_LINE_BUDGET]
    assert not over, f"modules over {MODULE_LINE_BUDGET} lines (split them): {over}"


def _all_of(tree: ast.Module) -> list[str]:
    return next(ast.literal_eval(stmt.value) for stmt in tree.body if isinstance(stmt, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in stmt.targets))


def test_all_is_the_documented_public_surface_in_the_package_and_the_file():
    package = _modules()[""]
    surface = " ".join(PUBLIC.search(package.docstring).group(1).split())
    documented = re.findall(r"(?:^|, )``(\w+)", surface)      # each item's name: ``Engine`` (``execute(...)``), ...
    assert _all_of(package.tree) == documented
    assert _all_of(ast.parse(ENGINE.read_text(encoding="utf-8"))) == documented
    owner = build.definitions(_modules())
    imported = {name for _target, names, _line in package.package_imports for name in names}
    assert set(documented) <= imported and set(documented) <= set(owner)


def test_the_package_runs_as_a_package():
    """The same code imported as modules (what mypy reads, and `python -m kb_rag`): every import resolves and the
    imports run without a cycle."""
    result = subprocess.run([sys.executable, "-c", "import kb_rag, sys; print(sorted(kb_rag.__all__)); "
                             "print(sum(name.startswith('kb_rag') for name in sys.modules))"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    listed, count = result.stdout.split("\n")[:2]
    assert listed == str(sorted(["Engine", "KBError", "page_texts", "main"]))
    assert int(count) == len(_modules())
    version = subprocess.run([sys.executable, "-m", "kb_rag", "--version"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.strip() == build_version(), version.stderr


def build_version() -> str:
    tree = ast.parse(ENGINE.read_text(encoding="utf-8"))
    return next(ast.literal_eval(stmt.value) for stmt in tree.body if isinstance(stmt, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__version__" for t in stmt.targets))


# ---------------------------------------------------------------------------
# The build, on small packages of the tests' own
# ---------------------------------------------------------------------------

FUTURE = "from __future__ import annotations\n"
GOOD = {
    "__init__.py": '"""A small engine.\n\nPublic surface: ``twice``."""\n' + FUTURE
    + "from .tools.later import twice\n\n__all__ = [\"twice\"]\n",
    "base.py": '"""Constants.\n\nMay import: no module of the package."""\n' + FUTURE
    + "import os\nfrom pathlib import Path\n\nFACTOR = 2\nHERE = Path(os.sep)\n",
    "tools/__init__.py": '"""Tools."""\n',
    "tools/later.py": None,
}
LATER = ('"""Doubling.\n\nMay import: base."""\n' + FUTURE
         + "import os\n\nfrom ..base import FACTOR, HERE\n\n\ndef twice(x: int) -> int:\n"
         + "    return FACTOR * x if HERE == HERE else os.sep\n")


def _package(root: Path, files: dict[str, str | None]) -> Path:
    package = root / "small"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(LATER if text is None else text, encoding="utf-8")
    return package


def test_a_small_package_builds_into_one_file_that_runs(tmp_path):
    files = dict(GOOD)
    package = _package(tmp_path, files)
    text = build.build(package)
    namespace: dict = {}
    exec(compile(text, "small.py", "exec"), namespace)
    assert namespace["twice"](21) == 42 and namespace["__all__"] == ["twice"]
    assert text.index("# small/base.py") < text.index("# small/tools/later.py")       # imported before use
    assert text.count("import os\n") == 1 and "from ..base" not in text and "from .tools" not in text
    assert build.untouched(text) and not build.untouched(text.replace("FACTOR * x", "FACTOR * x + 1"))
    target = tmp_path / "small_engine.py"
    assert build.refresh(package, target).startswith("small_engine.py rebuilt")
    assert build.refresh(package, target) is None                                 # current: nothing to do
    (package / "base.py").write_text(files["base.py"].replace("FACTOR = 2", "FACTOR = 3"), encoding="utf-8")
    assert build.refresh(package, target) and "FACTOR = 3" in target.read_text(encoding="utf-8")
    target.write_text(target.read_text(encoding="utf-8").replace("FACTOR = 3", "FACTOR = 4"), encoding="utf-8")
    (package / "base.py").write_text(files["base.py"], encoding="utf-8")
    with pytest.raises(build.BuildError, match="edited by hand"):
        build.refresh(package, target)                 # the hand edit is kept, not overwritten
    assert "FACTOR = 4" in target.read_text(encoding="utf-8")


REFUSED = {
    "a name defined twice": ({"tools/later.py": LATER + "\nFACTOR = 3\n"}, "defined by one module only"),
    "a module imported": ({"tools/later.py": LATER.replace("from ..base import FACTOR, HERE",
                                                           "from .. import base\nfrom ..base import FACTOR, HERE")},
                          "imports the module `base`"),
    "the package by its name": ({"tools/later.py": LATER.replace("from ..base import", "from small.base import")},
                                "relative import"),
    "a name under another name": ({"tools/later.py": LATER.replace("FACTOR, HERE", "FACTOR as F, HERE")},
                                  "under another name"),
    "a name the module lacks": ({"tools/later.py": LATER.replace("FACTOR, HERE", "FACTOR, HERE, THERE")},
                                "`THERE` is not a top-level name"),
    "an external name meaning two things": (
        {"tools/later.py": LATER.replace("import os\n", "import posixpath as os\n")}, "`os` means"),
    "an external name the package defines": (
        {"tools/later.py": LATER.replace("import os\n", "import os\nfrom math import tau as FACTOR\n")},
        "imported here and defined by"),
    "a name used but not imported": ({"tools/later.py": LATER.replace("FACTOR, HERE", "FACTOR")},
                                     "`HERE` is used in twice but neither defined nor imported here"),
    "a cycle": ({"base.py": GOOD["base.py"] + "from .tools.later import twice\n"}, "cycle"),
    "annotations that would mean two things": ({"base.py": GOOD["base.py"].replace(FUTURE, "")},
                                               "from __future__ import annotations"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_the_build_refuses_what_one_file_cannot_hold(tmp_path, case):
    change, message = REFUSED[case]
    package = _package(tmp_path, {**GOOD, **change})
    with pytest.raises(build.BuildError, match=re.escape(message)):
        build.build(package)


def test_the_good_package_of_these_cases_builds(tmp_path):
    """The refusals above are each one change away from a package that builds: the cases test what they name."""
    assert "def twice" in build.build(_package(tmp_path, GOOD))


# ---------------------------------------------------------------------------
# CONTRIBUTING's module map
# ---------------------------------------------------------------------------

def module_map(modules) -> str:
    """The table in CONTRIBUTING: each module, what it holds (its docstring's first sentence), what it may import."""
    rows = ["| module | what it holds | may import |", "|---|---|---|"]
    for module in build.order(modules):
        if module.is_package:
            continue
        holds = " ".join(module.docstring.strip().split("\n\n")[0].split())
        allowed = declared_imports(module) or []
        rows.append(f"| `{module.shown.removeprefix('kb_rag/')}` | {holds} | "
                    f"{', '.join(allowed) if allowed else '(none)'} |")
    return "\n".join(rows) + "\n"


def test_contributing_shows_the_module_map_the_package_has():
    text = CONTRIBUTING.read_text(encoding="utf-8")
    assert MAP_BLOCK.search(text), "CONTRIBUTING.md has a <!-- module map --> block"
    wanted = MAP_BLOCK.sub(lambda m: m.group(1) + module_map(_modules()) + m.group(2), text)
    if os.environ.get("KB_UPDATE_DOCS") == "1" and wanted != text:
        CONTRIBUTING.write_text(wanted, encoding="utf-8")
        text = wanted
    assert text == wanted, "CONTRIBUTING.md's module map differs from the package: run with KB_UPDATE_DOCS=1"


def test_the_checker_reads_what_a_docstring_allows():
    module = build.Module("x", Path("x.py"), "", ast.parse(""), False,
                          docstring=textwrap.dedent("""\
                              Something: what it holds.

                              May import: config, text,
                              storage.
                              """))
    assert declared_imports(module) == ["config", "text", "storage"]
    module.docstring = f"Holds.\n\nMay import: {NONE}.\n"
    assert declared_imports(module) == []
    module.docstring = "Holds only."
    assert declared_imports(module) is None
