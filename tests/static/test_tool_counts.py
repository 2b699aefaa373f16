"""How many tools the hosts offer, and which, as the docs say it: made from the host contract and checked.

The DSH plugin registers every tool of host-contract.json; the MCP server every one that runs an engine command
(`kb_scope` is a DSH session's own setting). Each count in the user-facing docs stands between
`<!-- tools: dsh -->` (or `mcp`) and `<!-- /tools -->`, each list between `<!-- tool list: dsh -->` (or `mcp`) and
`<!-- /tool list -->`, and ``KB_UPDATE_DOCS=1`` writes them; a count written
without the markers, or a `kb_*` name that is not a tool, fails here. (The docs once said nine, ten, eleven and
twelve tools at the same time.)
"""
from __future__ import annotations

import json
import os
import re

from helpers import ROOT

DOCS = ["README.md", "QUICKSTART.md", "mcp-server/README.md", "plugin/README.md", "npm-package/README.md"]
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
         "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]
COUNT = re.compile(r"<!-- tools: (dsh|mcp) -->(\w+)<!-- /tools -->")
LIST = re.compile(r"<!-- tool list: (dsh|mcp) -->(.*?)<!-- /tool list -->", re.S)
UNMARKED = re.compile(r"(?<!-->)\b(" + "|".join(WORDS[2:]) + r"|\d+)\s+(?:`?kb_\*`?\s+)?tools\b", re.I)
NOT_TOOLS = {"kb_engine", "kb_root"}          # the engine's file and a request field, named like the tools


def offered() -> dict[str, list[str]]:
    """Each host's tools, in the contract's order."""
    tools = json.loads((ROOT / "host-contract.json").read_text(encoding="utf-8"))["tools"]
    return {"dsh": [tool["name"] for tool in tools], "mcp": [tool["name"] for tool in tools if tool["command"]]}


def counts() -> dict[str, int]:
    return {host: len(names) for host, names in offered().items()}


def tool_names() -> set[str]:
    return {tool["name"] for tool in json.loads((ROOT / "host-contract.json").read_text(encoding="utf-8"))["tools"]}


def test_every_count_of_tools_in_the_docs_is_the_contracts():
    wanted_counts = counts()
    stale = []
    for name in DOCS:
        path = ROOT / name
        text = path.read_text(encoding="utf-8")
        wanted = COUNT.sub(lambda m: f"<!-- tools: {m.group(1)} -->{WORDS[wanted_counts[m.group(1)]]}<!-- /tools -->",
                           text)
        wanted = LIST.sub(lambda m: f"<!-- tool list: {m.group(1)} -->"
                          + ", ".join(f"`{tool}`" for tool in offered()[m.group(1)]) + "<!-- /tool list -->", wanted)
        if os.environ.get("KB_UPDATE_DOCS") == "1" and wanted != text:
            path.write_text(wanted, encoding="utf-8")
            text = wanted
        if text != wanted:
            stale.append(name)
        bare = [m.group(0) for m in UNMARKED.finditer(COUNT.sub("", text))]
        assert not bare, f"{name}: counts of tools without the markers (write them between <!-- tools: dsh|mcp -->" \
                         f" and <!-- /tools -->): {bare}"
    assert not stale, f"counts or lists of tools differ from host-contract.json in {stale}: run with KB_UPDATE_DOCS=1"


def test_every_kb_name_the_docs_give_is_a_tool():
    tools = tool_names()
    wrong = {}
    for name in DOCS:
        named = set(re.findall(r"\bkb_[a-z]+\b", (ROOT / name).read_text(encoding="utf-8"))) - NOT_TOOLS
        if named - tools:
            wrong[name] = sorted(named - tools)
    assert not wrong, f"kb_* names that are no tool of host-contract.json: {wrong}"


def test_the_counts_come_from_the_contract():
    assert counts()["dsh"] == len(tool_names()) and 0 < counts()["mcp"] < counts()["dsh"]
    assert COUNT.fullmatch("<!-- tools: dsh -->twelve<!-- /tools -->")
    assert UNMARKED.search("the ten `kb_*` tools") and UNMARKED.search("eleven tools over MCP")
    assert not UNMARKED.search(COUNT.sub("", "the <!-- tools: mcp -->eleven<!-- /tools --> tools"))
