"""Runs the DSH plugin's own test suite (plugin/test, `node --test`) and its lint (ESLint, `npm run lint`) as part
of the one test command.

The plugin is JavaScript; its tests drive the real DSH tool registry against this repository's engine, with the
Python that runs pytest. Skipped when Node.js and npm are not installed. The lint runs here, where the plugin's
Node modules are installed, rather than in CI's developer gate before them.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import PLUGIN, ensure_plugin_modules

pytestmark = [pytest.mark.slow, pytest.mark.node]


def test_plugin_node_suite():
    npm = ensure_plugin_modules()
    env = dict(os.environ, KB_TEST_PYTHON=sys.executable)
    run = subprocess.run([npm, "test"], cwd=PLUGIN, capture_output=True, text=True, timeout=900, env=env)
    summary = [line for line in run.stdout.splitlines() if line.startswith(("# pass", "# fail", "not ok"))]
    assert run.returncode == 0, "\n".join(summary) + "\n" + run.stdout[-4000:] + run.stderr[-2000:]
    assert any(line.startswith("# pass") and int(line.split()[-1]) > 0 for line in summary), run.stdout[-2000:]


def test_plugin_lint():
    npm = ensure_plugin_modules()
    run = subprocess.run([npm, "run", "lint"], cwd=PLUGIN, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
