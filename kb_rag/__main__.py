"""`python -m kb_rag`: the engine run from the package, the same as `python kb_engine.py`."""

import sys

from .cli import main

sys.exit(main())
