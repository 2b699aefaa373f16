"""The engine's sections are layers: each one calls only the sections above it.

kb_engine.py is one self-contained file, copied as it is into a plugin or a
server and read as one library, so its numbered sections (the ``# N. Title``
banners, listed in the module docstring) are what shows its architecture.
The rule that keeps them meaningful: code in section A may use a module-level
name (function, class, constant) defined in section A or in an earlier one,
never one defined in a later section. A later definition used from an earlier
section means the layering has been broken, or that a helper sits too low.

The check parses the file with ``ast`` (no import, so it is fast and needs
none of the engine's dependencies), maps every top-level statement to its
section by line number, and walks every top-level definition whole: nested
functions, lambdas, comprehensions, methods, class bodies, decorators and
default values. A name counts as a reference to a module-level name only when
no enclosing function scope binds it (arguments, assignments, imports, loop
and ``with`` targets, nested definitions). Annotations are not references: the
file has ``from __future__ import annotations``, so they are never evaluated.

It also checks that the docstring's contents list names exactly the banners'
sections, in order.
"""
from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "kb_engine.py"

RULE = re.compile(r"^# =+\s*$")
TITLE = re.compile(r"^# (\d+)\. (\S.*?)\s*$")
CONTENTS_ENTRY = re.compile(r"^\s*(\d+)\.\s+(\S.*?)\s+\.{2,}")


def _sections(lines: list[str]) -> list[tuple[int, str, int]]:
    """(number, title, 1-based line of the title) for every banner: a title line between two rules."""
    found = []
    for i in range(1, len(lines) - 1):
        match = TITLE.match(lines[i])
        if match and RULE.match(lines[i - 1]) and RULE.match(lines[i + 1]):
            found.append((int(match.group(1)), match.group(2), i + 1))
    return found


def _section_of(line: int, sections: list[tuple[int, str, int]]) -> int:
    """The number of the section a line lies in; 0 before the first banner (imports, version)."""
    number = 0
    for section_number, _title, start in sections:
        if start <= line:
            number = section_number
    return number


# ---------------------------------------------------------------------------
# Module-level names
# ---------------------------------------------------------------------------

def _target_names(target: ast.AST) -> list[str]:
    return [node.id for node in ast.walk(target) if isinstance(node, ast.Name)]


def _bound_at_top(stmt: ast.stmt) -> list[str]:
    """Names a top-level statement binds in the module namespace (looking into if/try/with blocks)."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [stmt.name]
    if isinstance(stmt, ast.Assign):
        return [name for target in stmt.targets for name in _target_names(target)]
    if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        return _target_names(stmt.target)
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return [(alias.asname or alias.name).split(".")[0] for alias in stmt.names if alias.name != "*"]
    if isinstance(stmt, (ast.For, ast.AsyncFor)):
        names = _target_names(stmt.target)
    elif isinstance(stmt, (ast.With, ast.AsyncWith)):
        names = [name for item in stmt.items if item.optional_vars is not None
                 for name in _target_names(item.optional_vars)]
    else:
        names = []
    for block in ("body", "orelse", "finalbody"):
        for inner in getattr(stmt, block, []) or []:
            names.extend(_bound_at_top(inner))
    for handler in getattr(stmt, "handlers", []) or []:
        for inner in handler.body:
            names.extend(_bound_at_top(inner))
    return names


# ---------------------------------------------------------------------------
# Scopes
# ---------------------------------------------------------------------------

@dataclass
class Scope:
    kind: str                     # "function" (also lambda, comprehension) or "class"
    local: set[str] = field(default_factory=set)


def _arg_names(args: ast.arguments) -> set[str]:
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    every += [arg for arg in (args.vararg, args.kwarg) if arg is not None]
    return {arg.arg for arg in every}


class _Binder(ast.NodeVisitor):
    """The names one scope binds: walks its body, not the bodies of the scopes nested in it."""

    def __init__(self) -> None:
        self.bound: set[str] = set()
        self.declared: set[str] = set()     # global / nonlocal: not local here

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            self.bound.add(node.id)

    def _nested(self, node) -> None:        # def / class: binds its name; decorators, defaults run here
        self.bound.add(node.name)
        for decorator in node.decorator_list:
            self.visit(decorator)
        if isinstance(node, ast.ClassDef):
            for expr in [*node.bases, *node.keywords]:
                self.visit(expr)
        else:
            for default in [*node.args.defaults, *node.args.kw_defaults]:
                if default is not None:
                    self.visit(default)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _nested

    def visit_Lambda(self, node: ast.Lambda) -> None:
        for default in [*node.args.defaults, *node.args.kw_defaults]:
            if default is not None:
                self.visit(default)

    def _comprehension(self, node) -> None:  # own scope, except the first iterable and := targets
        self.visit(node.generators[0].iter)
        for walrus in ast.walk(node):
            if isinstance(walrus, ast.NamedExpr):
                self.bound.add(walrus.target.id)

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension

    def visit_Import(self, node) -> None:
        for alias in node.names:
            self.bound.add((alias.asname or alias.name).split(".")[0])

    visit_ImportFrom = visit_Import

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self.bound.add(node.name)
        self.generic_visit(node)

    def visit_Global(self, node) -> None:
        self.declared.update(node.names)

    visit_Nonlocal = visit_Global

    def visit_MatchAs(self, node) -> None:
        if node.name:
            self.bound.add(node.name)
        self.generic_visit(node)

    def visit_MatchStar(self, node) -> None:
        if node.name:
            self.bound.add(node.name)

    def visit_MatchMapping(self, node) -> None:
        if node.rest:
            self.bound.add(node.rest)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:   # the annotation is not evaluated
        self.visit(node.target)
        if node.value is not None:
            self.visit(node.value)

    def visit_arg(self, node) -> None:                         # annotations of nested scopes
        pass


def _bindings(body: list[ast.AST]) -> tuple[set[str], set[str]]:
    binder = _Binder()
    for node in body:
        binder.visit(node)
    return binder.bound, binder.declared


class _References(ast.NodeVisitor):
    """Every load of a name that resolves to the module namespace: (name, line)."""

    def __init__(self, module_names: set[str]) -> None:
        self.module_names = module_names
        self.scopes: list[Scope] = []
        self.found: list[tuple[str, int]] = []

    def _resolves_to_module(self, name: str) -> bool:
        for depth, scope in enumerate(reversed(self.scopes)):
            if scope.kind == "class" and depth > 0:
                continue                     # a class body's names are not visible in its methods
            if name in scope.local:
                return False
        return name in self.module_names

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load) and self._resolves_to_module(node.id):
            self.found.append((node.id, node.lineno))

    def _enter(self, kind: str, local: set[str], body: list[ast.AST]) -> None:
        self.scopes.append(Scope(kind, local))
        for node in body:
            self.visit(node)
        self.scopes.pop()

    def _function(self, node) -> None:
        for decorator in node.decorator_list:
            self.visit(decorator)
        for default in [*node.args.defaults, *node.args.kw_defaults]:
            if default is not None:
                self.visit(default)
        bound, declared = _bindings(node.body)
        self._enter("function", (bound | _arg_names(node.args)) - declared, node.body)

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Lambda(self, node: ast.Lambda) -> None:
        for default in [*node.args.defaults, *node.args.kw_defaults]:
            if default is not None:
                self.visit(default)
        bound, _ = _bindings([node.body])
        self._enter("function", bound | _arg_names(node.args), [node.body])

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for expr in [*node.decorator_list, *node.bases, *node.keywords]:
            self.visit(expr)
        bound, declared = _bindings(node.body)
        self._enter("class", bound - declared, node.body)

    def _comprehension(self, node) -> None:
        self.visit(node.generators[0].iter)  # evaluated in the enclosing scope
        local = {name for generator in node.generators for name in _target_names(generator.target)}
        self.scopes.append(Scope("function", local))
        for index, generator in enumerate(node.generators):
            if index:
                self.visit(generator.iter)
            for condition in generator.ifs:
                self.visit(condition)
        for part in ("elt", "key", "value"):
            if getattr(node, part, None) is not None:
                self.visit(getattr(node, part))
        self.scopes.pop()

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.visit(node.target)
        if node.value is not None:
            self.visit(node.value)

    def visit_arg(self, node) -> None:       # argument annotations
        pass


# ---------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------

def _engine():
    source = ENGINE.read_text(encoding="utf-8")
    return source, source.splitlines(), ast.parse(source, filename=str(ENGINE))


def test_banners_are_numbered_in_order_and_match_the_contents_list():
    _source, lines, tree = _engine()
    sections = _sections(lines)
    assert sections, "no '# N. Title' banners found in kb_engine.py"
    assert [number for number, _, _ in sections] == list(range(1, len(sections) + 1)), \
        f"banners are not numbered 1..N in order: {[(n, t) for n, t, _ in sections]}"
    docstring = ast.get_docstring(tree) or ""
    listed = [(int(m.group(1)), m.group(2)) for m in map(CONTENTS_ENTRY.match, docstring.splitlines()) if m]
    assert listed == [(number, title) for number, title, _ in sections], (
        "the module docstring's contents list does not match the section banners:\n"
        f"  contents: {listed}\n  banners:  {[(n, t) for n, t, _ in sections]}")


def test_no_section_uses_a_name_defined_in_a_later_section():
    _source, lines, tree = _engine()
    sections = _sections(lines)
    defined_in: dict[str, int] = {}          # the earliest section that binds each module-level name
    for stmt in tree.body:
        for name in _bound_at_top(stmt):
            defined_in.setdefault(name, _section_of(stmt.lineno, sections))
    violations = []
    for stmt in tree.body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue                          # the docstring
        first_line = min([stmt.lineno, *(d.lineno for d in getattr(stmt, "decorator_list", []))])
        here = _section_of(first_line, sections)
        owner = getattr(stmt, "name", None) or ", ".join(_bound_at_top(stmt)) or f"statement at line {stmt.lineno}"
        walker = _References(set(defined_in))
        walker.visit(stmt)
        for name, line in walker.found:
            if defined_in[name] > here:
                violations.append(f"{name} (section {defined_in[name]}) used by {owner} (section {here}) "
                                  f"at line {line}")
    assert not violations, ("layering broken: code uses names defined in a later section of kb_engine.py\n  "
                            + "\n  ".join(violations))


def test_the_checker_sees_references_it_must_and_only_those():
    """The resolver on a small module: shadowing, class scopes, defaults, annotations, comprehensions."""
    source = '''
def early(x=LATER_DEFAULT) -> LaterType:
    local_only = 1
    def inner(later_fn=None):
        return later_fn, local_only, later_used
    y: LaterAnn = [later_comp for later_comp in range(3)]
    return lambda later_arg: later_arg + lambda_ref
class Early:
    attr = class_ref
    def method(self):
        return attr
'''
    tree = ast.parse(source)
    names = {"LATER_DEFAULT", "LaterType", "later_fn", "later_used", "LaterAnn", "later_comp", "later_arg",
             "lambda_ref", "class_ref", "attr", "local_only", "range"}
    walker = _References(names)
    for stmt in tree.body:
        walker.visit(stmt)
    assert sorted(name for name, _ in walker.found) == sorted(
        ["LATER_DEFAULT", "later_used", "range", "lambda_ref", "class_ref", "attr"])


# ---------------------------------------------------------------------------
# Sections cut to what they hold, one public surface, and the index of names
# ---------------------------------------------------------------------------

SECTION_LINE_BUDGET = 950       # about 900 lines: a section that grows past it holds two things; split it
INDEX = ENGINE.parent / "docs" / "ENGINE-INDEX.md"
PUBLIC = re.compile(r"Public surface: (.+?)\.\s*\Z", re.S)


def _spans(lines: list[str]) -> list[tuple[int, str, int, int]]:
    """(number, title, first line, lines) of every section."""
    sections = _sections(lines)
    ends = [start for _, _, start in sections[1:]] + [len(lines) + 1]
    return [(number, title, start, end - start) for (number, title, start), end in zip(sections, ends)]


def test_every_section_stays_inside_its_line_budget():
    _source, lines, _tree = _engine()
    over = [f"{number}. {title}: {size} lines" for number, title, _, size in _spans(lines)
            if size > SECTION_LINE_BUDGET]
    assert not over, f"sections over {SECTION_LINE_BUDGET} lines (split them): {over}"


def test_no_module_level_name_is_defined_twice():
    """A second definition silently replaces the first for every caller, the first section's included."""
    _source, _lines, tree = _engine()
    seen: dict[str, int] = {}
    twice = []
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if stmt.name in seen:
                twice.append(f"{stmt.name} (lines {seen[stmt.name]} and {stmt.lineno})")
            seen.setdefault(stmt.name, stmt.lineno)
    assert not twice, twice


def test_all_is_the_documented_public_surface():
    _source, _lines, tree = _engine()
    surface = " ".join(PUBLIC.search(ast.get_docstring(tree) or "").group(1).split())
    documented = re.findall(r"(?:^|, )``(\w+)", surface)      # each item's name: ``Engine`` (``execute(...)``), ...
    declared = next(ast.literal_eval(stmt.value) for stmt in tree.body if isinstance(stmt, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in stmt.targets))
    assert declared == documented, (declared, documented)
    defined = {name for stmt in tree.body for name in _bound_at_top(stmt)}
    assert set(declared) <= defined


def engine_index(lines: list[str], tree: ast.Module) -> str:
    """docs/ENGINE-INDEX.md: each section of kb_engine.py with its size and the public names it defines."""
    spans = _spans(lines)
    names: dict[int, list[str]] = {number: [] for number, *_ in spans}
    for stmt in tree.body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            continue
        section = _section_of(stmt.lineno, [(n, t, start) for n, t, start, _ in spans])
        for name in _bound_at_top(stmt):
            if not name.startswith("_") and section in names and name not in names[section]:
                names[section].append(name)
    out = ["# kb_engine.py, section by section",
           "",
           "Generated from the engine by tests/static/test_layering.py (`KB_UPDATE_DOCS=1` rewrites it): every",
           "numbered section and the module-level names it defines that do not start with `_`. A section uses",
           "only names of the sections above it, and stays under about 900 lines. The public surface is `__all__`:",
           "`Engine`, `KBError`, `page_texts`, `main`; everything else may change between releases.",
           ""]
    for number, title, _start, _size in spans:
        listed = ", ".join(f"`{name}`" for name in names[number]) or "(none)"
        out += [f"## {number}. {title}", "", listed, ""]
    return "\n".join(out).rstrip() + "\n"


def test_the_index_of_sections_and_names_is_generated():
    _source, lines, tree = _engine()
    wanted = engine_index(lines, tree)
    current = INDEX.read_text(encoding="utf-8") if INDEX.exists() else None
    if os.environ.get("KB_UPDATE_DOCS") == "1" and current != wanted:
        INDEX.write_text(wanted, encoding="utf-8")
        current = wanted
    assert current == wanted, "docs/ENGINE-INDEX.md differs from the engine: run the tests with KB_UPDATE_DOCS=1"
