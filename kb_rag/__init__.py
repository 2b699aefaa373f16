"""kb-rag engine: a local literature knowledge base in one SQLite file.

Indexes papers (PDF, DOCX, TXT, Markdown, scans) and Zotero libraries into ``<kb_root>/kb.sqlite`` and answers
queries with verbatim passages that keep their provenance (section, physical PDF page, printed page label,
character offsets into the page text, the works a passage cites).

Developed as this package and shipped as one generated file, ``kb_engine.py`` (``scripts/build_engine.py``): the
installers copy that file, the DSH plugin and the MCP server spawn it. CONTRIBUTING.md has the map of the modules
and which may import which.

Public surface: ``Engine`` (``execute(command, payload)``), ``KBError``,
``page_texts(path)``, ``main(argv)``.
"""

from __future__ import annotations

from .cli import main
from .commands.table import Engine
from .config import KBError
from .reading.readers import page_texts

__all__ = ["Engine", "KBError", "page_texts", "main"]
