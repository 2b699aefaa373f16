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


def nested_drawing_pdf(path: Path, depth: int, fanout: int = 10, text: str = "A page whose drawing nests",
                       blend: bool = False) -> Path:
    """A one-page PDF of a few kilobytes whose drawing costs fanout ** depth strokes: form XObject k draws form
    k - 1 ``fanout`` times (each a little shifted), and the page draws the top one under a line of real text.
    Every consumer that interprets the page (text extraction, rendering, the glyphs of a box) walks all of them, so
    at depth 6 or 7 one page costs minutes to hours of PyMuPDF while the file stays tiny: the PDF form of the
    "billion laughs" XML bomb. Written by hand, since PyMuPDF flattens what it draws.

    ``blend``: the innermost form fills the whole page at half opacity in Multiply mode instead of drawing a short
    stroke. Reading the text walks the forms as before (depth 4: 0.2 s), but drawing composites every one of the
    fanout ** depth fills over the region drawn, about 150 times the cost (depth 4: 31 s for a hit's cropped
    picture; both on a busy 2-core machine): a page that ingest reads in seconds and no deadline lets draw."""
    objects: list[bytes] = []

    def add(body: bytes) -> int:
        objects.append(body)
        return len(objects)

    def stream(dictionary: str, data: bytes) -> bytes:
        return f"<< {dictionary} /Length {len(data)} >>\nstream\n".encode() + data + b"\nendstream"

    catalog = add(b"")                 # filled in once the page tree's number is known
    pages = add(b"")
    font = add(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    leaf, resources = b"0.5 w 10 10 m 20 20 l S", ""
    if blend:
        state = add(b"<< /Type /ExtGState /ca 0.5 /BM /Multiply >>")
        leaf, resources = b"/G0 gs 0 0 612 792 re f", f" /Resources << /ExtGState << /G0 {state} 0 R >> >>"
    previous = add(stream(f"/Type /XObject /Subtype /Form /BBox [0 0 612 792]{resources}", leaf))
    for level in range(1, depth + 1):
        calls = b" ".join(f"q 1 0 0 1 {i % 3} {i % 2} cm /X{level - 1} Do Q".encode() for i in range(fanout))
        previous = add(stream(f"/Type /XObject /Subtype /Form /BBox [0 0 612 792] "
                              f"/Resources << /XObject << /X{level - 1} {previous} 0 R >> >>", calls))
    safe = text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
    content = add(stream("", f"BT /F1 12 Tf 72 720 Td ({safe}) Tj ET q /X{depth} Do Q".encode()))
    page = add(f"<< /Type /Page /Parent {pages} 0 R /MediaBox [0 0 612 792] /Contents {content} 0 R "
               f"/Resources << /Font << /F1 {font} 0 R >> /XObject << /X{depth} {previous} 0 R >> >> >>".encode())
    objects[catalog - 1] = f"<< /Type /Catalog /Pages {pages} 0 R >>".encode()
    objects[pages - 1] = f"<< /Type /Pages /Kids [{page} 0 R] /Count 1 >>".encode()
    out = bytearray(b"%PDF-1.7\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{offset:010d} 00000 n \n".encode() for offset in offsets)
    out += f"trailer\n<< /Size {len(objects) + 1} /Root {catalog} 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    path.write_bytes(bytes(out))
    return path
