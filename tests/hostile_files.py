"""Hostile documents made on the spot, for the hardening tests and benchmarks/bench_docx_bomb.py.

A DOCX is a zip of XML parts; deflate shrinks a long run of the same XML about a thousand times, so a file of
a few hundred kilobytes can expand to hundreds of megabytes. The builders write the XML through a streaming
zip writer, so building a 200 MB expansion needs a few megabytes of memory.
"""
from __future__ import annotations

import zipfile
from pathlib import Path

_CONTENT_TYPES = (
    '<?xml version="1.0" encoding="UTF-8" standalone="yes"?>'
    '<Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types">'
    '<Default Extension="rels" ContentType="application/vnd.openxmlformats-package.relationships+xml"/>'
    '<Default Extension="xml" ContentType="application/xml"/>'
    '<Override PartName="/word/document.xml" '
    'ContentType="application/vnd.openxmlformats-officedocument.wordprocessingml.document.main+xml"/>'
    '</Types>')
_RELS = (
    '<?xml version="1.0" encoding="UTF-8" standalone="yes"?>'
    '<Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships">'
    '<Relationship Id="rId1" Type="http://schemas.openxmlformats.org/officeDocument/2006/relationships/'
    'officeDocument" Target="word/document.xml"/></Relationships>')
_W = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"


def _docx(path: Path, write_body) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        archive.writestr("[Content_Types].xml", _CONTENT_TYPES)
        archive.writestr("_rels/.rels", _RELS)
        with archive.open("word/document.xml", "w", force_zip64=True) as part:
            part.write(f'<?xml version="1.0" encoding="UTF-8" standalone="yes"?><w:document xmlns:w="{_W}">'
                       "<w:body>".encode())
            write_body(part)
            part.write(b"</w:body></w:document>")
    return path


def docx_many_paragraphs(path: Path, expanded_mb: int) -> Path:
    """A DOCX of many short paragraphs whose document.xml expands to about ``expanded_mb`` MB."""
    paragraph = (b"<w:p><w:r><w:t>Seasonal recharge of the karst aquifer was estimated from chloride "
                 b"concentrations in bulk deposition and spring water.</w:t></w:r></w:p>")
    block = paragraph * (1024 * 1024 // len(paragraph) + 1)

    def body(part):
        for _ in range(expanded_mb):
            part.write(block)
    return _docx(Path(path), body)


def docx_one_long_run(path: Path, run_mb: int) -> Path:
    """A DOCX holding one paragraph with a single text run of ``run_mb`` MB."""
    sentence = b"The same sentence about drought and recharge repeats without any paragraph break. "
    block = sentence * (1024 * 1024 // len(sentence) + 1)

    def body(part):
        part.write(b"<w:p><w:r><w:t>")
        for _ in range(run_mb):
            part.write(block)
        part.write(b"</w:t></w:r></w:p>")
    return _docx(Path(path), body)
