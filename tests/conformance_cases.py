"""Builds tests/fixtures/host-conformance.json: the cases both hosts' twins are held to (issue 30).

The DSH plugin (JavaScript) and the MCP server (Python) each have their own contract interpreter
(plugin/src/contract.js, mcp-server/contract.py) and serve client (plugin/src/daemon.js,
mcp-server/engine_client.py). plugin/test/conformance.test.js and tests/static/test_conformance.py run both on the cases
of one file:

- ``payload``: tool arguments and what must come of them, the message of the first failed check or the engine
  payload, built with the workspace ``/work/space`` and the home folder ``/home/researcher``. Written cases state
  their expectation here; generated cases (every argument of every tool in turn, then seeded random combinations
  of schema-valid values, with odd whitespace, ``~``, ``..`` and blanks) take theirs from the MCP server's
  interpreter when this script runs, so the file is the reference both must then meet.
- ``client``: requests to the scripted engine tests/conformance_engine.py and what each client must make of its
  answers (null ids, stray lines, a reply too long to read, a crash, a slow reply, progress).

Run ``python tests/conformance_cases.py`` after changing the contract, then review the diff.
"""
from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CASES = HERE / "fixtures" / "host-conformance.json"
BASE, HOME = "/work/space", "/home/researcher"
FUZZ_PER_TOOL = 30

# Whitespace the two languages disagree on unless told (JavaScript's trim takes U+FEFF and leaves U+001C and
# U+0085; Python's str.strip does the opposite), and text that must pass through untouched.
SPACES = [" ", "\t", "\n", "\u00a0", "\u3000", "\u2028", "\ufeff", "\u200a"]
KEPT = ["\u001c", "\u0085", "\u200b"]
STRINGS = ["graphene", "  graphene  ", "石墨烯 成核", "", "   ", "\ufeff", "\u001c", "x\u0085", "\u200b",
           "a*b_[c]", "naïve café", "0", "null"]
PATHS = ["papers", "papers/", "./papers//a.pdf", "../up/x.pdf", "/abs/x/../y.pdf", "~", "~/papers", "~/", "~user/x",
         "a~/b", " ~/padded ", "//double/slash", ".", "C:/not/windows/here", "dir with space/f.pdf", "论文/文件.pdf"]
NUMBERS = [0, 1, -1, 4, 50, 51, 1000, 2.5]


def written_cases() -> list[dict]:
    """Cases whose expectation is stated here (the generator checks the reference agrees)."""
    refuse = lambda tool, args, message: {"tool": tool, "args": args, "failed": message}  # noqa: E731
    build = lambda tool, args, payload: {"tool": tool, "args": args, "payload": payload}  # noqa: E731
    needs_paths = "paths is required: give at least one file or folder to ingest"
    clear = ("nothing was cleared: clear deletes every document of the library and needs `confirm: true`, given only "
             "once the user has asked to empty the library")
    return [
        refuse("kb_search", {"query": "   "}, "query must be a non-empty string of search terms"),
        refuse("kb_search", {}, "query must be a non-empty string of search terms"),
        refuse("kb_search", {"query": "\ufeff\u00a0"}, "query must be a non-empty string of search terms"),
        refuse("kb_search", {"query": "x", "top_k": 0}, "top_k must be between 1 and 50"),
        refuse("kb_rag", {"query": "x", "top_k": 51}, "top_k must be between 1 and 50"),
        build("kb_rag", {"query": "x", "top_k": 50}, {"query": "x", "top_k": 50}),
        build("kb_search", {"query": "x", "top_k": "ten"}, {"query": "x", "top_k": "ten"}),   # the schema's to refuse
        refuse("kb_rag", {"query": "x", "queries": ["a", "b", "c", "d", "e"]}, "queries takes at most 4 renderings"),
        refuse("kb_ingest", {}, needs_paths),
        refuse("kb_ingest", {"paths": ["  ", "", "\ufeff"]}, needs_paths),
        build("kb_ingest", {"rebuild": True}, {"rebuild": True}),
        refuse("kb_ingest", {"metadata_only": True, "rebuild": True},
               "metadata_only and rebuild cannot be combined: choose one"),
        build("kb_ingest", {"metadata_only": True, "rebuild": False}, {"metadata_only": True, "rebuild": False}),
        refuse("kb_zotero", {"limit": -1}, "limit must be 0 (all) or a positive number"),
        build("kb_zotero", {"limit": 0, "zotero_db": "~/Zotero"}, {"zotero_db": "/home/researcher/Zotero", "limit": 0}),
        refuse("kb_clear", {}, clear),
        refuse("kb_clear", {"confirm": "true"}, clear),
        build("kb_clear", {"confirm": True}, {"confirm": True}),
        refuse("kb_show", {"doc_id": 3},
               "show needs the hit's page (with its char_start and char_end), or a figure label"),
        refuse("kb_show", {"doc_id": 3, "page": 2, "char_start": 5},
               "give char_end with char_start, both as the hit carries them"),
        refuse("kb_show", {"doc_id": 3, "page": 2, "char_end": 5},
               "give char_start with char_end, both as the hit carries them"),
        build("kb_show", {"doc_id": 3, "page": 2, "char_start": 0, "char_end": 40, "page_end": 2},
              {"doc_id": 3, "page": 2, "char_start": 0, "char_end": 40, "page_end": 2}),
        build("kb_show", {"doc_id": 3, "figure": " Figure 2 "}, {"doc_id": 3, "figure": "Figure 2"}),
        refuse("kb_search", {"query": "x", "pictures": 4}, "pictures must be between 0 and 3"),
        build("kb_rag", {"query": "x", "pictures": 1}, {"query": "x", "pictures": 1}),
        refuse("kb_fetch", {"identifier": " "}, "identifier must be a DOI, an arXiv id or an http(s) URL"),
        build("kb_fetch", {"identifier": " 10.1234/abc ", "dest": "in/here"},
              {"identifier": "10.1234/abc", "dest": "/work/space/in/here"}),
        refuse("kb_status", {"cancel": True}, "cancel needs the job_id of the job to stop"),
        refuse("kb_status", {"cancel": True, "job_id": "  "}, "cancel needs the job_id of the job to stop"),
        build("kb_status", {"job_id": "  "}, {}),
        build("kb_watch", {}, {}),
        build("kb_watch", {"add": ["papers", " ~/Downloads/papers "], "remove": ["/old"]},
              {"add": ["/work/space/papers", "/home/researcher/Downloads/papers"], "remove": ["/old"]}),
        build("kb_search", {"query": "  graphene  ", "queries": [" 石墨烯 ", "  "], "top_k": 5,
                            "filters": {"kind": ["pdf"], "year": None, "authors": "chen"}},
              {"query": "graphene", "queries": ["石墨烯"], "top_k": 5,
               "filters": {"kind": ["pdf"], "authors": "chen"}}),
        build("kb_search", {"query": "x", "queries": [" "], "filters": {}}, {"query": "x"}),
        build("kb_search", {"query": "x\u0085", "kb_root": "/etc", "render": "html"}, {"query": "x\u0085"}),
        build("kb_ingest", {"paths": ["papers", "/abs/a.pdf", " "], "force": False},
              {"paths": ["/work/space/papers", "/abs/a.pdf"], "force": False}),
        build("kb_ingest", {"paths": ["~/papers", "~", "~user/x", "a/../../b", "//srv//x/"]},
              {"paths": ["/home/researcher/papers", "/home/researcher", "/work/space/~user/x", "/work/b", "/srv/x"]}),
    ]


def _value(schema: dict, name: str, rng: random.Random, path: bool):
    """A value the schema accepts (hosts check types before their contract checks run)."""
    if "oneOf" in schema:
        return _value(rng.choice(schema["oneOf"]), name, rng, path)
    kind = schema.get("type")
    if "enum" in schema:
        return rng.choice(schema["enum"] + [" " + schema["enum"][0] + " "]) if kind == "string" else schema["enum"][0]
    if kind == "boolean":
        return rng.choice([True, False])
    if kind == "integer":
        return rng.choice([n for n in NUMBERS if isinstance(n, int)])
    if kind == "string":
        return _text(rng, path)
    if kind == "array":
        return [_value(schema["items"], name, rng, path) for _ in range(rng.choice([0, 1, 2, 5]))]
    if kind == "object":
        props = schema.get("properties", {})
        chosen = rng.sample(sorted(props), rng.randint(0, min(3, len(props))))
        return {key: (None if rng.random() < 0.2 else _value(props[key], key, rng, False)) for key in chosen}
    return None


def _text(rng: random.Random, path: bool) -> str:
    text = rng.choice(PATHS if path else STRINGS)
    if rng.random() < 0.4:
        text = rng.choice(SPACES) + text + rng.choice(SPACES + KEPT)
    return text


def generated_cases(tools: list[dict], rng: random.Random) -> list[dict]:
    """Every argument of every tool alone (beside the required ones), then seeded random combinations."""
    cases = []
    for tool in tools:
        props = tool["input_schema"]["properties"]
        required = {name: "graphene" for name in tool["input_schema"].get("required", []) if name not in ("confirm",)}
        if "confirm" in tool["input_schema"].get("required", []):
            required["confirm"] = True
        for name, schema in props.items():
            for _ in range(3):
                cases.append({"tool": tool["name"],
                              "args": {**required, name: _value(schema, name, rng, name in tool["path_fields"])}})
        for _ in range(FUZZ_PER_TOOL):
            chosen = rng.sample(sorted(props), rng.randint(0, len(props)))
            args = {name: _value(props[name], name, rng, name in tool["path_fields"]) for name in chosen}
            if rng.random() < 0.3:
                args[rng.choice(["kb_root", "render", "extra", "__proto__"])] = rng.choice(["/etc", "x", 1])
            cases.append({"tool": tool["name"], "args": args})
    return cases


# What each client must make of the scripted engine's answers. `concurrent`: the steps are sent together, not one
# after the other; `starts`: how many engine processes the case took; `line_limit`: the client's reply line limit.
CLIENT_CASES = [
    {"name": "a reply is matched by its id", "starts": 1,
     "steps": [{"command": "echo", "payload": {"a": [1, "é"]}, "response": {"echo": {"a": [1, "é"]}}}]},
    {"name": "progress lines go to the callback and are never taken for the reply", "starts": 1,
     "steps": [{"command": "progress", "response": {"done": True}, "progress": [1, 2]}]},
    {"name": "a reply with a null id answers the one request in flight", "starts": 1,
     "steps": [{"command": "null_id", "error": "invalid_json"},
               {"command": "echo", "payload": {}, "response": {"echo": {}}}]},
    {"name": "lines for no request are passed over: not JSON, not an object, id true, another id", "starts": 1,
     "steps": [{"command": "strays", "response": {"right": True}}]},
    {"name": "a reply that says neither ok nor not ok is an error", "starts": 1,
     "steps": [{"command": "no_ok", "error": "internal"},
               {"command": "echo", "payload": {"after": 1}, "response": {"echo": {"after": 1}}}]},
    {"name": "a reply line too long to read fails its request; the channel goes on", "starts": 1,
     "line_limit": 1 << 20,
     "steps": [{"command": "oversized", "payload": {"bytes": 3 << 20}, "error": "reply_too_large"},
               {"command": "echo", "payload": {"b": 2}, "response": {"echo": {"b": 2}}}]},
    {"name": "a crash fails the request in flight with the exit status and the engine's last words; the next "
             "request starts a fresh engine", "starts": 2,
     "steps": [{"command": "crash", "crashed": ["exited with status 3", "boom: simulated failure"]},
               {"command": "echo", "payload": {}, "response": {"echo": {}}}]},
    {"name": "a slow reply is waited for, and requests stay serial", "starts": 1, "concurrent": True,
     "steps": [{"command": "slow", "payload": {"seconds": 1.0}, "response_has": {"next_arrived_early": False}},
               {"command": "echo", "payload": {"c": 3}, "response": {"echo": {"c": 3}}}]},
]


def _reference():
    spec = importlib.util.spec_from_file_location("kb_mcp_contract_reference", ROOT / "mcp-server" / "contract.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expected(module, tools: dict, case: dict) -> dict:
    """The case with the reference's outcome: ``failed`` (the first failed check's message) or ``payload``."""
    tool = tools[case["tool"]]
    check = module.failed_check(tool, case["args"])
    if check is not None:
        return {"tool": case["tool"], "args": case["args"], "failed": check["message"]}
    return {"tool": case["tool"], "args": case["args"], "payload": module.build_payload(tool, case["args"], BASE, HOME)}


def main() -> int:
    module = _reference()
    contract = json.loads((ROOT / "host-contract.json").read_text(encoding="utf-8"))
    engine_tools = [tool for tool in contract["tools"] if tool["command"] is not None]
    tools = {tool["name"]: tool for tool in engine_tools}
    written = written_cases()
    for case in written:
        got = expected(module, tools, case)
        if got != case:
            sys.exit(f"the reference disagrees with a written case:\n  {case}\n  {got}")
    generated = [expected(module, tools, case) for case in generated_cases(engine_tools, random.Random(30))]
    data = {"base": BASE, "home": HOME, "payload": written + generated, "client": CLIENT_CASES}
    CASES.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"{len(data['payload'])} payload cases ({len(written)} written) and {len(CLIENT_CASES)} client cases "
          f"written to {CASES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
