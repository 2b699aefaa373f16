"""Tests reach the engine through its public surface (issue 30): `kb_engine.__all__` (Engine, KBError, page_texts,
main). A test about one of the engine's own functions may reach further, and says so with the `internals` mark
(on the test, or on its whole file with `pytestmark`), so that a newcomer renaming an internal knows which tests
are about it and that no other test depends on it. This walk finds every `kb_engine.<name>` (also under the
aliases `E` and `kb`) in the test files and fails on one outside `__all__` that no mark covers."""
from __future__ import annotations

import ast

from helpers import ENGINE, ROOT

ALIASES = {"kb_engine", "E", "kb"}
DUNDERS = {"__version__", "__file__", "__all__", "__name__"}


def public_surface() -> set[str]:
    tree = ast.parse(ENGINE.read_text(encoding="utf-8"))
    return set(next(ast.literal_eval(stmt.value) for stmt in tree.body if isinstance(stmt, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in stmt.targets)))


def _marks_internals(expr: ast.AST) -> bool:
    """`pytest.mark.internals`, alone, called, or in a list."""
    return any(isinstance(node, ast.Attribute) and node.attr == "internals" for node in ast.walk(expr))


def _module_marked(tree: ast.Module) -> bool:
    return any(isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                    for t in stmt.targets) and _marks_internals(stmt.value)
               for stmt in tree.body)


def _reaches(node: ast.AST, public: set[str]) -> list[tuple[str, int]]:
    return [(n.attr, n.lineno) for n in ast.walk(node)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ALIASES
            and n.attr not in public and n.attr not in DUNDERS]


def unmarked_reaches(tree: ast.Module, public: set[str]) -> list[tuple[str, int]]:
    """Names outside the public surface reached where no `internals` mark covers them."""
    if _module_marked(tree):
        return []
    found = []
    for stmt in tree.body:
        marked = isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
            any(_marks_internals(d) for d in stmt.decorator_list)
        if not marked:
            found += _reaches(stmt, public)
    return found


def test_tests_reach_internals_only_where_marked():
    public = public_surface()
    assert public == {"Engine", "KBError", "page_texts", "main"}
    problems = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for name, line in unmarked_reaches(ast.parse(path.read_text(encoding="utf-8")), public):
            problems.append(f"{path.relative_to(ROOT)}:{line}: kb_engine.{name}")
    assert not problems, ("tests reach engine internals without the `internals` mark (mark the test, or the file "
                          "with pytestmark):\n  " + "\n  ".join(problems[:60]))


def test_the_walk_sees_what_it_must():
    tree = ast.parse("import pytest\n"
                     "def test_a(kb_engine):\n    kb_engine.Engine(); kb_engine.hidden()\n"
                     "@pytest.mark.internals\ndef test_b(kb_engine):\n    kb_engine.other()\n"
                     "def helper(E):\n    return E.__version__, E.third\n")
    assert unmarked_reaches(tree, {"Engine"}) == [("hidden", 3), ("third", 8)]
    marked = ast.parse("import pytest\npytestmark = [pytest.mark.internals]\ndef test_c(kb):\n    kb.x\n")
    assert unmarked_reaches(marked, {"Engine"}) == []
