"""Docs made from the engine's tables, and the tables held to the code (issue 19).

docs/PROTOCOL.md's request tables are printed from each command's `fields` in the command table (between
`<!-- request: NAME -->` and `<!-- /request -->`); ``KB_UPDATE_DOCS=1`` rewrites them. An ast walk over
kb_engine.py checks the other direction: every payload key a command's handler reads (directly or through the
functions it calls) is one its command declares, so a new field cannot stay undocumented.
"""
from __future__ import annotations

import ast
import os
import re

import pytest

from helpers import ENGINE, ROOT

# About the engine's own functions: reaches names outside kb_engine.__all__ (tests/static/test_public_surface.py).
pytestmark = pytest.mark.internals

PROTOCOL = ROOT / "docs" / "PROTOCOL.md"
REQUEST_BLOCK = re.compile(r"(<!-- request: (\w+) -->\n)(.*?)(<!-- /request -->)", re.S)
HOST_BLOCK = re.compile(r"(<!-- host fields -->\n).*?(<!-- /host fields -->)", re.S)
# Read by the dispatcher for every command rather than by a handler: the library folder, and the job id a job
# runner adds to its own request (internal, never documented).
DISPATCHER_KEYS = {"kb_root", "_job_id"}


def request_table(fields) -> str:
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for field in fields:
        names = ", ".join(f"`{name}`" for name in field.names)
        rows.append(f"| {names} | {field.type} | {field.default} | {field.meaning} |".replace("|  |", "| |"))
    return "\n".join(rows) + "\n"


def test_protocol_request_tables_are_the_command_table(kb_engine):
    text = PROTOCOL.read_text(encoding="utf-8")
    documented = {m.group(2) for m in REQUEST_BLOCK.finditer(text)}
    common = {f.name for f in kb_engine.HOST_FIELDS} | {"kb_root"}      # described once, under Common rules
    own = lambda command: [f for f in command.request_fields if f not in kb_engine.HOST_FIELDS]  # noqa: E731
    with_fields = {c.name for c in kb_engine.COMMAND_TABLE if {f.name for f in c.request_fields} - common}
    assert documented == with_fields, "every command with fields of its own has a request table, and only those"

    def generated(match):
        return match.group(1) + request_table(own(kb_engine.COMMANDS_BY_NAME[match.group(2)])) + match.group(4)

    wanted = REQUEST_BLOCK.sub(generated, text)
    rendered = ", ".join(f"`{name}`" for name in kb_engine.RENDERERS)
    wanted = HOST_BLOCK.sub(lambda m: m.group(1) + f"Commands that take them: {rendered}.\n\n"
                            + request_table(kb_engine.HOST_FIELDS) + m.group(2), wanted)
    assert HOST_BLOCK.search(wanted), "PROTOCOL.md has the host fields' table"
    if os.environ.get("KB_UPDATE_DOCS") == "1" and wanted != text:
        PROTOCOL.write_text(wanted, encoding="utf-8")
        text = wanted
    assert text == wanted, "PROTOCOL.md's request tables differ from the command table: run with KB_UPDATE_DOCS=1"


def test_every_command_has_its_section_and_contents_link(kb_engine):
    text = PROTOCOL.read_text(encoding="utf-8")
    contents = text.split("\n## ", 1)[0]
    for command in kb_engine.COMMAND_TABLE:
        assert f"\n## {command.name}\n" in text, command.name
        assert f"[{command.name}](#{command.name})" in contents, command.name


# -- the handlers read only declared fields --------------------------------------------------------------------

def _functions(tree: ast.Module) -> dict[str, ast.AST]:
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            found.update({f"{node.name}.{item.name}": item for item in node.body if isinstance(item, ast.FunctionDef)})
    return found


def _string(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _is_payload(node) -> bool:
    return isinstance(node, ast.Name) and node.id == "payload"


def payload_reads(node: ast.AST) -> set[str]:
    """Keys read from a variable named `payload`: payload.get("k"), payload["k"], "k" in payload, and helper
    calls that take the payload and then the key (the _opt_* readers)."""
    keys = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Attribute) and f.attr in ("get", "pop") and _is_payload(f.value) and n.args:
                keys.add(_string(n.args[0]))
            if len(n.args) > 1 and _is_payload(n.args[0]):
                keys.add(_string(n.args[1]))
        elif isinstance(n, ast.Subscript) and _is_payload(n.value):
            keys.add(_string(n.slice))
        elif isinstance(n, ast.Compare) and any(_is_payload(c) for c in n.comparators):
            keys.add(_string(n.left))
    return keys - {None}


def _passes_payload(call: ast.Call) -> bool:
    return any(_is_payload(a) or (isinstance(a, ast.Attribute) and a.attr == "payload")
               for a in [*call.args, *(k.value for k in call.keywords)])


def callees(node: ast.AST, name: str | None) -> set[str]:
    """The functions this one hands its payload to: module functions called by name, methods of its own class
    called on self, and the Engine method the command table calls. A call given a payload of the caller's own
    making (cite's search, fetch's ingest) reads that payload, not the request, and is not followed."""
    owner = name.split(".")[0] if name and "." in name else None
    out = set()
    for n in ast.walk(node):
        if not isinstance(n, ast.Call) or not _passes_payload(n):
            continue
        if isinstance(n.func, ast.Name):
            out.add(n.func.id)
        elif isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) and n.func.value.id == "self":
            out.add(f"{owner}.{n.func.attr}")
        elif isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Attribute) \
                and n.func.value.attr == "engine":
            out.add(f"Engine.{n.func.attr}")
    return out


def reads_of(entry: ast.AST, functions: dict) -> set[str]:
    keys, seen, todo = set(), set(), [(entry, None)]
    while todo:
        node, name = todo.pop()
        keys |= payload_reads(node)
        for callee in callees(node, name):
            if callee in functions and callee not in seen:
                seen.add(callee)
                todo.append((functions[callee], callee))
    return keys


def handler_entries(tree: ast.Module) -> dict[str, ast.AST]:
    """Each command's handler, as the command table calls it (its `run` lambda, whose callees are followed)."""
    entries = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "COMMAND_TABLE"
                                               for t in node.targets):
            for call in node.value.elts:
                name = _string(call.args[0])
                entries[name] = call.args[2]
    return entries


def test_handlers_read_only_the_fields_their_command_declares(kb_engine):
    tree = ast.parse(ENGINE.read_text(encoding="utf-8"))
    functions = _functions(tree)
    entries = handler_entries(tree)
    assert set(entries) == set(kb_engine.COMMANDS_BY_NAME)
    undeclared = {}
    for command in kb_engine.COMMAND_TABLE:
        read = reads_of(entries[command.name], functions)
        declared = {name for f in command.request_fields for name in f.accepted} | DISPATCHER_KEYS
        if read - declared:
            undeclared[command.name] = sorted(read - declared)
    assert not undeclared, f"payload keys read but not declared in the command's fields: {undeclared}"


def test_the_walk_finds_what_a_handler_reads():
    """The check above must be able to fail: on a small module it finds direct, helper and nested reads."""
    tree = ast.parse('''
def helper(payload):
    return payload.get("deep"), "flag" in payload

def cmd_x(lib, payload):
    return payload["a"], _opt_int(payload, "b", 1, 0, 9), helper(payload), cmd_y(lib, {"c": 1}), other(lib)

def other(payload):
    return payload.get("not_the_request")

def cmd_y(lib, payload):
    return payload.get("not_followed")
''')
    functions = _functions(tree)
    entry = ast.parse("lambda c: cmd_x(c.lib, c.payload)").body[0].value
    assert reads_of(entry, functions) == {"a", "b", "deep", "flag"}


@pytest.mark.parametrize("name", ["search", "rag"])
def test_search_and_rag_defaults_follow_the_engine(kb_engine, name):
    fields = {f.name: f for f in kb_engine.COMMANDS_BY_NAME[name].fields}
    rag = name == "rag"
    assert fields["top_k"].default == f"`{kb_engine.RAG_TOP_K if rag else kb_engine.DEFAULT_TOP_K}`"
    assert fields["depth"].default == ('`"deep"`' if rag else '`"quick"`')


# -- the README's environment variables --------------------------------------------------------------------------

README = ROOT / "README.md"
ENVIRONMENT_BLOCK = re.compile(r"(<!-- environment -->\n)(.*?)(<!-- /environment -->)", re.S)
# Read outside the engine's table on purpose: the test suite's own switches and the MCP server's token.
NOT_THE_ENGINES = {"KB_CORPUS_DIR", "KB_MCP_TOKEN"}


def environment_table(variables) -> str:
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    rows += [f"| {', '.join(f'`{n}`' for n in v.names)} | {v.default} | {v.meaning} |" for v in variables]
    return "\n".join(rows) + "\n"


def test_readme_environment_table_is_the_engines_list(kb_engine):
    text = README.read_text(encoding="utf-8")
    assert len(ENVIRONMENT_BLOCK.findall(text)) == 1
    wanted = ENVIRONMENT_BLOCK.sub(lambda m: m.group(1) + environment_table(kb_engine.ENVIRONMENT_VARIABLES)
                                   + m.group(3), text)
    if os.environ.get("KB_UPDATE_DOCS") == "1" and wanted != text:
        README.write_text(wanted, encoding="utf-8")
        text = wanted
    assert text == wanted, "README's environment table differs from ENVIRONMENT_VARIABLES: run with KB_UPDATE_DOCS=1"


def test_every_variable_the_engine_reads_is_listed(kb_engine):
    listed = {name for v in kb_engine.ENVIRONMENT_VARIABLES for name in v.names}
    read = set(re.findall(r'"(KB_[A-Z0-9_]+)"', ENGINE.read_text(encoding="utf-8")))
    assert read - listed == set(), "KB_* variables the engine reads but ENVIRONMENT_VARIABLES does not list"
    assert {n for n in listed if n.startswith("KB_")} - read == set(), "listed but never read by the engine"
    assert not (listed & NOT_THE_ENGINES)
