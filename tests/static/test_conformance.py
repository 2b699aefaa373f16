"""The MCP server's twins of the DSH plugin's code meet the shared conformance cases (issue 30).

tests/fixtures/host-conformance.json (made by tests/conformance_cases.py) holds tool arguments with the check
message or engine payload each must give, and scripted-engine sessions (tests/conformance_engine.py) with what a
serve client must make of each answer. plugin/test/conformance.test.js runs the same file against
plugin/src/contract.js and plugin/src/daemon.js; this file runs it against mcp-server/contract.py and
mcp-server/engine_client.py, so the two hosts build the same payloads and treat the engine's lines alike.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import sys

import pytest

from helpers import ROOT

CASES = json.loads((ROOT / "tests" / "fixtures" / "host-conformance.json").read_text(encoding="utf-8"))
TOOLS = {tool["name"]: tool for tool in json.loads((ROOT / "host-contract.json").read_text(encoding="utf-8"))["tools"]}
FAKE_ENGINE = ROOT / "tests" / "conformance_engine.py"


def _load(name: str):
    sys.path.insert(0, str(ROOT / "mcp-server"))
    spec = importlib.util.spec_from_file_location(f"conformance_{name}", ROOT / "mcp-server" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


contract = _load("contract")
engine_client = _load("engine_client")


def outcome(case: dict) -> dict:
    tool = TOOLS[case["tool"]]
    check = contract.failed_check(tool, case["args"])
    if check is not None:
        return {"tool": case["tool"], "args": case["args"], "failed": check["message"]}
    return {"tool": case["tool"], "args": case["args"],
            "payload": contract.build_payload(tool, case["args"], CASES["base"], CASES["home"])}


def test_the_cases_cover_every_engine_tool_and_the_client_behaviours():
    assert {c["tool"] for c in CASES["payload"]} == {name for name, t in TOOLS.items() if t["command"]}
    assert len(CASES["payload"]) > 300
    assert {"null_id", "oversized", "crash", "slow"} <= {s["command"] for c in CASES["client"] for s in c["steps"]}


def test_payloads_and_check_messages():
    wrong = [(case, got) for case in CASES["payload"] if (got := outcome(case)) != case]
    assert not wrong, f"{len(wrong)} cases differ, first: {wrong[0]}"


async def _step(client, step: dict) -> dict:
    progress: list = []

    async def on_progress(event):
        progress.append(event["done"])
    try:
        response = await client.request(step["command"], step.get("payload", {}), on_progress=on_progress)
    except engine_client.EngineError as exc:
        return {"error": exc.code, "message": str(exc)}
    except engine_client.EngineCrashed as exc:
        return {"crashed": str(exc)}
    return {"response": response, "progress": progress}


def _meets(step: dict, got: dict) -> None:
    if "response" in step:
        assert got.get("response") == step["response"], got
    if "response_has" in step:
        assert {k: got.get("response", {}).get(k) for k in step["response_has"]} == step["response_has"], got
    if "progress" in step:
        assert got["progress"] == step["progress"], got
    if "error" in step:
        assert got.get("error") == step["error"], got
    if "crashed" in step:
        assert "crashed" in got and all(words in got["crashed"] for words in step["crashed"]), got


@pytest.mark.parametrize("case", CASES["client"], ids=[c["name"] for c in CASES["client"]])
def test_the_serve_client(case, tmp_path):
    async def session():
        client = engine_client.EngineClient(kb_root=tmp_path / "kb", python=sys.executable, engine=FAKE_ENGINE,
                                            line_limit=case.get("line_limit", engine_client.LINE_LIMIT))
        try:
            if case.get("concurrent"):
                results = await asyncio.gather(*(_step(client, step) for step in case["steps"]))
            else:
                results = [await _step(client, step) for step in case["steps"]]
            return results, client.starts
        finally:
            await client.close()

    results, starts = asyncio.run(asyncio.wait_for(session(), 60))
    for step, got in zip(case["steps"], results):
        _meets(step, got)
    assert starts == case["starts"]


@pytest.mark.internals
def test_the_engine_keeps_the_request_rules_its_host_tools_check(kb_engine):
    """A rule the engine declares on a command (`rules`) is one record: its host tool checks it with the same words,
    and the engine refuses a request that breaks it just as the hosts refuse the arguments (issue 51: the
    metadata_only/rebuild exclusion was worded twice)."""
    ruled = {c.name: c.rules for c in kb_engine.COMMAND_TABLE if c.rules}
    assert ruled, "no command declares request rules"
    checked = 0
    for case in CASES["payload"]:
        rules = ruled.get(TOOLS[case["tool"]]["command"])
        if not rules:
            continue
        assert all(rule in TOOLS[case["tool"]]["checks"] for rule in rules), case["tool"]
        request = case.get("payload", case["args"])
        broken = case.get("failed") in {rule["message"] for rule in rules}
        try:
            kb_engine.check_rules(rules, request)
        except kb_engine.KBError as exc:
            assert broken and exc.message == case["failed"], (case, exc.message)
        else:
            assert not broken, case
        checked += 1
    assert checked > 10
