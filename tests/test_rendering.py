"""The MCP server renders engine answers to the same Markdown as the DSH plugin (issue 19).

tests/fixtures/markdown-cases.json holds real engine answers for every host-facing command (made by
tests/markdown_cases.py) and the Markdown the model must read for each; plugin/test/golden.test.js holds the
plugin's renderer to the same text, so neither host can drift from the other.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from importlib.metadata import version

import pytest

from helpers import ROOT

mcp = pytest.importorskip("mcp")
if int(version("mcp").split(".")[0]) < 2:
    pytest.skip("the MCP server needs the MCP Python SDK 2.x", allow_module_level=True)

CASES = json.loads((ROOT / "tests" / "fixtures" / "markdown-cases.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def server():
    spec = importlib.util.spec_from_file_location("kb_mcp_server", ROOT / "mcp-server" / "server.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("kb_mcp_server", module)
    spec.loader.exec_module(module)
    return module


def test_the_cases_cover_every_served_tool(server):
    assert {case["tool"] for case in CASES} == set(server.SERVED_BY_NAME) == set(server.RENDERERS)
    assert all(case["markdown"] for case in CASES)


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_the_markdown_of_each_answer(server, case):
    assert server.RENDERERS[case["tool"]](case["value"]) == case["markdown"]
