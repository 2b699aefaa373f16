"""Read functions for the ingest pipeline tests, importable by a spawned worker process.

A spawned worker unpickles the read function by module and name, so these live in a module of their own
(not in a test file, whose import would drag pytest fixtures in). The worker finds this folder because
multiprocessing hands the parent's sys.path to the child (pytest puts tests/ on it).

    read(path)  kb_engine.prepare_file(path), except that a file whose name contains "crash" kills the
                worker process outright (os._exit(3), as a segfaulting parser would) and one whose name
                contains "slow" is read half a second late, and one whose name contains "hang" is never read
                (the process sleeps on: a stand-in for a page that never finishes, sending no heartbeat).
    pid(path)   the process id of the worker (a plain int, for checking where reading happens).
"""
from __future__ import annotations

import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import kb_engine  # noqa: E402

CRASH_EXIT_CODE = 3


def read(path: str, options=None):
    name = os.path.basename(path)
    if "crash" in name:
        os._exit(CRASH_EXIT_CODE)
    if "slow" in name:
        time.sleep(0.5)
    if "hang" in name:
        while True:
            time.sleep(60)
    return kb_engine.prepare_file(path, options)


def pid(_path: str, _options=None) -> int:
    return os.getpid()
