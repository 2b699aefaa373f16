"""The host contract (issue 19): the engine's table of the tools the DSH plugin and the MCP server offer.

host-contract.json is that table printed, and both hosts load it; these tests keep the file equal to the engine
(``KB_UPDATE_DOCS=1`` rewrites it), hold the table to the engine's own limits and command names, keep every schema
inside the subset both hosts enforce. The check rules and payloads of both hosts (plugin/src/contract.js and
mcp-server/contract.py) meet the shared cases of tests/fixtures/host-conformance.json (tests/static/test_conformance.py
and plugin/test/conformance.test.js); tests/test_mcp_server.py compares the two live hosts.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ENGINE, ROOT, assert_generated, run_cli

# About the engine's own functions: reaches names outside kb_engine.__all__ (tests/static/test_public_surface.py).
pytestmark = pytest.mark.internals

CONTRACT_FILE = ROOT / "host-contract.json"
# What both hosts enforce of JSON Schema (DSH's registry refuses anything else): constraints, then annotations.
SCHEMA_KEYWORDS = {"type", "oneOf", "properties", "required", "additionalProperties", "items", "enum", "const",
                   "description", "title", "default", "examples"}


def mcp_contract(source: Path = ROOT / "mcp-server" / "contract.py"):
    spec = importlib.util.spec_from_file_location("mcp_contract", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def walk(schema: dict, at: str):
    yield at, schema
    for name, child in (schema.get("properties") or {}).items():
        yield from walk(child, f"{at}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{at}[]")
    for i, branch in enumerate(schema.get("oneOf") or []):
        yield from walk(branch, f"{at}|{i}")


def test_the_shipped_file_is_the_engines_table(kb_engine):
    assert_generated(CONTRACT_FILE, kb_engine.host_contract_text(), "kb_engine.host_contract_text()")


def test_the_contract_follows_the_engine(kb_engine):
    contract = kb_engine.host_contract()
    tools = {tool["name"]: tool for tool in contract["tools"]}
    assert len(tools) == len(contract["tools"]) == 12
    for tool in tools.values():
        assert tool["command"] is None or tool["command"] in kb_engine.COMMANDS_BY_NAME, tool["name"]
        assert set(tool["path_fields"]) <= set(tool["input_schema"]["properties"]), tool["name"]
        for check in tool["checks"]:
            named = [check[k] for k in ("field", "needs") if k in check] + check.get("fields", [])
            assert set(named) <= set(tool["input_schema"]["properties"]), (tool["name"], check)
    assert [name for name, tool in tools.items() if tool["command"] is None] == ["kb_scope"]
    search = tools["kb_search"]["input_schema"]["properties"]
    assert set(search["filters"]["properties"]) == set(kb_engine.FILTER_KEYS)
    assert search["mode"]["enum"] == list(kb_engine.SEARCH_MODES)
    assert search["depth"]["enum"] == list(kb_engine.SEARCH_DEPTHS)
    kinds = search["filters"]["properties"]["kind"]["oneOf"][0]["enum"]
    assert set(kinds) == set(kb_engine.SUPPORTED_SUFFIXES.values())
    limits = {(c["rule"], c["field"]): c for c in tools["kb_search"]["checks"] if "field" in c}
    assert limits[("max_items", "queries")]["max"] == kb_engine.MAX_RENDERINGS
    assert limits[("range", "top_k")]["max"] <= kb_engine.MAX_TOP_K
    assert f"default {kb_engine.DEFAULT_TOP_K})" in search["top_k"]["description"]
    assert f"default {kb_engine.RAG_TOP_K})" in tools["kb_rag"]["input_schema"]["properties"]["top_k"]["description"]
    assert tools["kb_clear"]["checks"][0]["code"] == "confirm_required"
    needs = [line["needs"] for line in contract["guidance"]["lines"] if "needs" in line]
    assert needs == ["kb_scope"]


# A field's type, as PROTOCOL.md prints it, by its first word -> the JSON Schema type a tool may offer it as.
SCHEMA_TYPE_OF_FIELD = {"boolean": "boolean", "integer": "integer", "number": "number", "string": "string",
                        "object": "object", "list": "array", "array": "array"}


def test_every_tool_parameter_is_a_declared_field_of_its_command(kb_engine):
    """A tool's schema is written apart from its command's fields (it says what a model should send, not all a
    command takes), so it could offer a parameter the command does not know or of another type: never."""
    checked = 0
    for tool in kb_engine.host_contract()["tools"]:
        if tool["command"] is None:
            continue
        fields = {name: field for field in kb_engine.COMMANDS_BY_NAME[tool["command"]].request_fields
                  for name in field.names}
        offered = dict(tool["input_schema"]["properties"])
        assert set(offered) | set(tool.get("fixed", {})) <= set(fields), (
            tool["name"], sorted(set(offered) | set(tool.get("fixed", {})) - set(fields)))
        for name, schema in offered.items():
            types = {schema["type"]} if "type" in schema else {alt.get("type") for alt in schema.get("oneOf", [])}
            wanted = SCHEMA_TYPE_OF_FIELD[fields[name].type.split()[0]]
            assert types == {wanted}, (tool["name"], name, fields[name].type, types)
            checked += 1
    assert checked > 40


def test_every_schema_stays_inside_what_both_hosts_enforce(kb_engine):
    for tool in kb_engine.host_contract()["tools"]:
        assert set(tool["input_schema"]) <= {"type", "properties", "required"}, tool["name"]
        for at, node in walk(tool["input_schema"], tool["name"]):
            assert set(node) <= SCHEMA_KEYWORDS, (at, sorted(set(node) - SCHEMA_KEYWORDS))
            if node.get("type") == "object" and node is not tool["input_schema"]:
                assert isinstance(node.get("additionalProperties"), bool), at
            for text in (node.get("description"), node.get("title")):
                assert text is None or text.isascii(), at


def test_the_contract_through_the_protocol_and_the_cli(kb_engine, tmp_path):
    reply = run_cli("contract", {"kb_root": str(tmp_path / "kb")}).json
    assert reply["ok"] is True
    assert {k: v for k, v in reply.items() if k not in ("ok", "engine", "ms")} == kb_engine.host_contract()
    assert not (tmp_path / "kb").exists()                    # asking for the contract creates no library
    printed = subprocess.run([sys.executable, str(ENGINE), "contract", "--json"], capture_output=True, text=True,
                             timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert json.loads(printed.stdout)["tools"] == kb_engine.host_contract()["tools"]


def test_the_mcp_server_finds_the_contract_or_asks_the_engine(kb_engine, tmp_path):
    module = mcp_contract()
    assert module.load_contract(lambda: ENGINE) == json.loads(CONTRACT_FILE.read_text(encoding="utf-8"))
    # A server copied away from the repository, with an engine that has no host-contract.json beside it
    (tmp_path / "server").mkdir()
    (tmp_path / "engine").mkdir()
    elsewhere = mcp_contract(Path(shutil.copy(ROOT / "mcp-server" / "contract.py", tmp_path / "server")))
    engine = Path(shutil.copy(ENGINE, tmp_path / "engine"))
    assert elsewhere.load_contract(lambda: engine) == kb_engine.host_contract()
    (tmp_path / "engine" / "host-contract.json").write_text(json.dumps({"contract": 99}), encoding="utf-8")
    with pytest.raises(RuntimeError, match="host contract version 99"):
        elsewhere.load_contract(lambda: engine)
