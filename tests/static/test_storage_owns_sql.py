"""Storage owns every statement on the library's tables (issue 51): the commands, ingest, retrieval and answers call
``Library``'s methods (kb_rag/storage.py and kb_rag/storage_queries.py) and never execute SQL on the library's
connection themselves, so a change of the schema is a change of the storage modules alone.

An AST walk over kb_rag/ finds every ``.execute`` / ``.executemany`` / ``.executescript`` / ``.cursor`` call and
every ``sqlite3.connect`` outside the storage modules. It fails on one that
  - names a library table (one that storage.py creates) in its SQL: a string, an f-string, a concatenation of
    them, or a name assigned one of those in the module;
  - is made on a ``<something>.conn`` (the library's connection, whatever the SQL: PRAGMA and VACUUM too), or hands
    that connection to a name of its own (``conn = lib.conn``).
Three modules use SQLite databases of their own and are listed below with the reason; there only a statement
naming a library table that their database does not also have fails. A module that opens a database
(``sqlite3.connect``) must be one of them.
"""
from __future__ import annotations

import ast
import re

from helpers import ROOT

PACKAGE = ROOT / "kb_rag"
STORAGE_MODULES = ("kb_rag/storage.py", "kb_rag/storage_queries.py")
# module -> (why it runs SQL, the library table names its own database also has)
OTHER_DATABASES = {
    "kb_rag/zotero/snapshot.py": ("Zotero's zotero.sqlite, read from a snapshot copy; never the library", ()),
    "kb_rag/reading/ocr.py": ("the OCR cache, ocr-cache.sqlite beside kb.sqlite (its table ocr_pages)", ()),
    "kb_rag/models/native.py": ("the native tokenizer's piece table, a SQLite file of its own beside the model "
                                "(its tables pieces and meta)", ("meta",)),
}
STATEMENT_CALLS = {"execute", "executemany", "executescript", "cursor"}
SQL_START = re.compile(r"^\s*(?:SELECT|INSERT|UPDATE|DELETE|REPLACE|WITH|CREATE|DROP|ALTER|PRAGMA|VACUUM)\b", re.I)
CREATED = re.compile(r"CREATE\s+(?:VIRTUAL\s+)?TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?(\w+)", re.I)


def library_tables() -> set[str]:
    """The tables storage.py creates (schema and migrations)."""
    return set(CREATED.findall((PACKAGE / "storage.py").read_text(encoding="utf-8")))


def _assigned(tree: ast.AST) -> dict[str, list[ast.expr]]:
    """name -> every value the module assigns to it (to resolve ``conn.execute(sql)``)."""
    values: dict[str, list[ast.expr]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values.setdefault(target.id, []).append(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            values.setdefault(node.target.id, []).append(node.value)
    return values


def sql_texts(node: ast.expr | None, assigned: dict[str, list[ast.expr]], depth: int = 0) -> list[str]:
    """The SQL an argument may hold, as far as the source tells (a formatted value reads as ``{}``)."""
    if node is None or depth > 5:
        return []
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return ["".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        lefts = sql_texts(node.left, assigned, depth + 1) or ["{}"]
        rights = sql_texts(node.right, assigned, depth + 1) or ["{}"]
        return [left + right for left in lefts for right in rights]
    if isinstance(node, ast.Name):
        return [text for value in assigned.get(node.id, []) for text in sql_texts(value, assigned, depth + 1)]
    return []


def _on_connection(node: ast.expr) -> bool:
    """``<something>.conn``: a connection reached through an object (the library's, outside storage)."""
    return isinstance(node, ast.Attribute) and node.attr == "conn"


def offences(source: str, tables: set[str], own_tables: tuple[str, ...] = (),
             other_database: bool = False) -> list[tuple[int, str]]:
    """(line, what) of every statement on the library's tables in a module's source (see the module docstring)."""
    tree = ast.parse(source)
    assigned = _assigned(tree)
    named = re.compile(r"\b(" + "|".join(sorted(set(tables) - set(own_tables))) + r")\b")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STATEMENT_CALLS:
            receiver = ast.unparse(node.func.value)
            if not other_database and _on_connection(node.func.value):
                found.append((node.lineno, f"{receiver}.{node.func.attr}(...) on a connection reached through an "
                                           "object"))
                continue
            for text in sql_texts(node.args[0] if node.args else None, assigned):
                hit = named.search(text) if SQL_START.match(text) else None
                if hit:
                    found.append((node.lineno, f"{receiver}.{node.func.attr}(...) names the library table "
                                               f"`{hit.group(1)}`"))
                    break
        elif isinstance(node, ast.Assign) and not other_database and _on_connection(node.value):
            found.append((node.lineno, f"{ast.unparse(node.value)} handed to {ast.unparse(node.targets[0])}"))
    return sorted(found)


def _opens_a_database(source: str) -> bool:
    return any(isinstance(node, ast.Call) and ast.unparse(node.func) == "sqlite3.connect"
               for node in ast.walk(ast.parse(source)))


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")


def test_only_storage_runs_statements_on_the_library_tables():
    tables = library_tables()
    problems = []
    for shown, source in _modules():
        if shown in STORAGE_MODULES:
            continue
        reason, own = OTHER_DATABASES.get(shown, (None, ()))
        problems += [f"{shown}:{line}: {what}"
                     for line, what in offences(source, tables, own, other_database=reason is not None)]
    assert not problems, ("statements on the library's tables outside storage (add a method to Library in "
                          "kb_rag/storage_queries.py and call it):\n  " + "\n  ".join(problems))


def test_the_modules_with_databases_of_their_own_are_the_listed_ones():
    opening = {shown for shown, source in _modules() if _opens_a_database(source)}
    assert opening - set(STORAGE_MODULES) == set(OTHER_DATABASES), (
        "a module that opens a SQLite database of its own is listed in OTHER_DATABASES with its reason, and a "
        "listed one still opens one")
    assert all((ROOT / name).is_file() for name in STORAGE_MODULES)


def test_the_library_tables_are_read_from_the_schema():
    assert {"meta", "docs", "chunks", "vecs", "cache", "chunks_fts", "chunks_vocab", "chunk_terms", "refs",
            "chunk_cites", "metadata_lookups"} <= library_tables()


def test_the_walk_sees_what_it_must():
    tables = {"docs", "chunks", "vecs", "meta"}
    source = '''
def f(lib, conn, engine, marks, ids):
    lib.conn.execute("SELECT * FROM docs WHERE id = ?", (1,))
    conn.execute(f"DELETE FROM chunks WHERE id IN ({marks})", ids)
    sql = ("SELECT chunk_id, vec "
           "FROM vecs")
    conn.execute(sql)
    conn.executemany("INSERT INTO docs(path) " + "VALUES (?)", [])
    self.lib.conn.execute("PRAGMA user_version")
    other = lib.conn
    engine.execute("docs", {})
    conn.execute("SELECT lines FROM ocr_pages WHERE page = ?", (1,))
    conn.execute("SELECT key, value FROM meta")
'''
    assert [line for line, _ in offences(source, tables)] == [3, 4, 7, 8, 9, 10, 13]
    # a module with a database of its own: its own tables pass, a library table does not, `.conn` is its own
    assert [line for line, _ in offences(source, tables, ("meta",), other_database=True)] == [3, 4, 7, 8]
    assert _opens_a_database("import sqlite3\nc = sqlite3.connect(':memory:')\n")
