"""Test-only engine: the repository's kb_engine, except that ingesting a file named ``hang.txt`` never returns.

The lifecycle tests need a request that stays in flight for as long as they like (to abort it, or to kill the
engine under it). Everything else, the serve loop included, is the real engine. The file is named kb_engine.py
so that the tests recognise its process as an engine.
"""
import os
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path[0] = REPO          # import the real engine, not this file

import kb_engine  # noqa: E402

_real_triage = kb_engine.triage_file


def _triage_or_hang(lib, path, explicit, force):
    if os.path.basename(path) == "hang.txt":
        while True:
            time.sleep(3600)
    return _real_triage(lib, path, explicit, force)


kb_engine.triage_file = _triage_or_hang

if __name__ == "__main__":
    sys.exit(kb_engine.main())
