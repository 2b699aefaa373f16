"""The host contract for the MCP server: the kb_* tools' names, descriptions, JSON Schemas, argument checks and
annotations, the guidance text and the rendering budget, exactly as the DSH plugin reads them.

The contract is the engine's table (`kb_engine.py contract --json`), saved as host-contract.json beside
kb_engine.py. This module finds and interprets it; it defines no tool itself. The check rules mirror
plugin/src/contract.js: both interpret the same data, and both meet the cases of tests/fixtures/host-conformance.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SUPPORTED_CONTRACT = 1
CONTRACT_FILE = "host-contract.json"


def load_contract(engine_path) -> dict:
    """host-contract.json of this checkout (beside kb_engine.py, one folder up), else the one beside the engine
    in use; without either (an installed module), the engine prints its table. ``engine_path`` is called only
    when needed."""
    shipped = Path(__file__).resolve().parent.parent / CONTRACT_FILE
    beside = shipped if shipped.is_file() else engine_path().parent / CONTRACT_FILE
    if beside.is_file():
        contract = json.loads(beside.read_text(encoding="utf-8"))
    else:
        engine = engine_path()
        done = subprocess.run([sys.executable, str(engine), "contract", "--json"], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{engine} could not print its host contract: {(done.stderr or done.stdout)[-400:]}")
        contract = json.loads(done.stdout)
    if contract.get("contract") != SUPPORTED_CONTRACT:
        raise RuntimeError(f"host contract version {contract.get('contract')}; this server reads {SUPPORTED_CONTRACT}")
    return contract


# The whitespace JavaScript's String.prototype.trim removes (and no other): both hosts strip exactly these, so
# that they agree on what a blank argument is (Python's str.strip would also take U+001C-U+001F and U+0085, and
# leave U+FEFF).
SPACE = ("\t\n\v\f\r \u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
         "\u2028\u2029\u202f\u205f\u3000\ufeff")


def trim(text: str) -> str:
    return text.strip(SPACE)


def given(value: Any) -> bool:
    """Whether an argument was really given: not absent, false, blank, or a list of nothing but blanks."""
    if value is None or value is False:
        return False
    if isinstance(value, str):
        return bool(trim(value))
    if isinstance(value, list):
        return any(given(item) for item in value)
    return True


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _in_range(args: dict, check: dict) -> bool:
    value = args.get(check["field"])
    return not _is_number(value) or ((check.get("min") is None or value >= check["min"])
                                     and (check.get("max") is None or value <= check["max"]))


# Each check rule: true when the arguments pass.
RULES = {
    "not_blank": lambda args, check: isinstance(args.get(check["field"]), str) and bool(trim(args[check["field"]])),
    "range": _in_range,
    "max_items": lambda args, check: not isinstance(args.get(check["field"]), list)
    or len(args[check["field"]]) <= check["max"],
    "exclusive": lambda args, check: not all(given(args.get(f)) for f in check["fields"]),
    "any_of": lambda args, check: any(given(args.get(f)) for f in check["fields"]),
    "needs": lambda args, check: not given(args.get(check["field"])) or given(args.get(check["needs"])),
    "is_true": lambda args, check: args.get(check["field"]) is True,
}


def failed_check(tool: dict, args: dict) -> dict | None:
    """The first check the arguments fail (its message and code are what the model reads), or None."""
    for check in tool["checks"]:
        rule = RULES.get(check["rule"])
        if rule is None:
            raise RuntimeError(f"host contract: unknown check rule {check['rule']!r} in {tool['name']}")
        if not rule(args, check):
            return check
    return None


def _clean(value: Any) -> Any:
    if isinstance(value, str):
        return trim(value) or None
    if isinstance(value, list):
        items = [trim(item) if isinstance(item, str) else item for item in value]
        return [item for item in items if given(item)] or None
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if v is not None} or None
    return value


def resolved_path(base: str, path: str, home: str) -> str:
    """``path`` as the engine gets it: a leading ``~`` (alone or before a separator) is the home folder, a relative
    path is taken from ``base``, and ``.``, ``..`` and repeated separators are folded, without looking at the disk
    (symbolic links stay as named)."""
    separators = ("/", os.sep)
    if path == "~" or (path.startswith("~") and path[1:2] in separators):
        path = home + path[1:]
    folded = os.path.normpath(os.path.join(base, path))
    return "/" + folded.lstrip("/") if folded.startswith("//") else folded     # POSIX keeps a leading //


def build_payload(tool: dict, args: dict, base: Path | str, home: str | None = None) -> dict:
    """The engine payload: declared arguments only, strings trimmed, blanks left out, relative paths taken from
    `base` (the server's working directory: its workspace) and `~` from `home` (the user's home folder)."""
    home = home if home is not None else str(Path.home())
    payload = {}
    for name in tool["input_schema"]["properties"]:
        value = _clean(args.get(name))
        if value is None:
            continue
        if name in tool["path_fields"]:
            value = ([resolved_path(str(base), p, home) for p in value] if isinstance(value, list)
                     else resolved_path(str(base), value, home))
        payload[name] = value
    return payload


def guidance_text(contract: dict, tool_names) -> str:
    """The guidance for a host offering `tool_names`: lines that need a tool the host lacks are left out."""
    offered = set(tool_names)
    lines = [line["text"] for line in contract["guidance"]["lines"]
             if not line.get("needs") or line["needs"] in offered]
    return "\n".join([contract["guidance"]["heading"], *(f"- {text}" for text in lines)])
