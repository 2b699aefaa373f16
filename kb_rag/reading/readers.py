"""Readers: DOCX, TXT/MD, and the dispatch of any file to its reader.

May import: config, reading.blocks, reading.classify, reading.ocr, reading.pdf, reading.structure, text.
"""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path
from xml.etree import ElementTree

from ..config import (
    STATUS_ERROR,
    STATUS_SKIPPED,
    SUPPORTED_SUFFIXES,
    FileRejected,
    _short_error,
    document_limit,
    kb_cache_dir,
)
from ..reading.blocks import Block, Extracted, canonical_section
from ..reading.classify import classify_blocks
from ..reading.ocr import OCR_CACHE_FILENAME, ReadOptions
from ..reading.pdf import extract_pdf
from ..reading.structure import PageTextBuilder, join_lines, reference_entries
from ..text import normalize_text

# -- DOCX ---------------------------------------------------------------------

_W_NS = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
_HEADING_STYLE = re.compile(r"^(?:heading|标题|titre|überschrift|encabezado)\s*(\d)$", re.IGNORECASE)


def _style_level(style_name: str, outline_level: int | None) -> int | str:
    """Heading level from a paragraph style; 'title' for the document title style."""
    name = (style_name or "").strip()
    if name.lower() in ("title", "标题"):
        return "title"
    match = _HEADING_STYLE.match(name)
    if match:
        return int(match.group(1))
    if outline_level is not None and 0 <= outline_level < 9:
        return outline_level + 1
    return 0


def _docx_paragraphs_python_docx(path: str) -> tuple[list[tuple[str, int | str, bool]], dict]:
    import docx  # python-docx
    from docx.table import Table
    from docx.text.paragraph import Paragraph

    document = docx.Document(path)
    items: list[tuple[str, int | str, bool]] = []
    for child in document.element.body.iterchildren():
        if child.tag == f"{_W_NS}p":
            para = Paragraph(child, document)
            style = para.style.name if para.style is not None else ""
            bold = bool(para.runs) and all(r.bold for r in para.runs if r.text.strip())
            items.append((para.text, _style_level(style, None), bold))
        elif child.tag == f"{_W_NS}tbl":
            for row in Table(child, document).rows:
                cells: list[str] = []
                for cell in row.cells:
                    if cell.text.strip() and (not cells or cells[-1] != cell.text.strip()):
                        cells.append(cell.text.strip())
                items.append((" | ".join(cells), 0, False))
    core = document.core_properties
    meta = {"title": core.title or "", "author": core.author or "", "year": core.created.year if core.created else None}
    return items, meta


def _docx_paragraphs_xml(path: str) -> tuple[list[tuple[str, int | str, bool]], dict]:
    """Reads word/document.xml directly: for files python-docx rejects (some WPS output)."""
    with zipfile.ZipFile(path) as archive:
        names = set(archive.namelist())
        document_name = (
            "word/document.xml"
            if "word/document.xml" in names
            else next((n for n in names if n.endswith("document.xml")), None)
        )
        if document_name is None:
            raise FileRejected(STATUS_ERROR, "corrupt", "not a Word document (word/document.xml is missing)")
        body = ElementTree.fromstring(archive.read(document_name))
        styles = _docx_style_table(archive.read("word/styles.xml")) if "word/styles.xml" in names else {}
        core = archive.read("docProps/core.xml").decode("utf-8", "replace") if "docProps/core.xml" in names else ""
    items: list[tuple[str, int | str, bool]] = []
    for para in body.iter(f"{_W_NS}p"):
        texts = []
        for node in para.iter():
            if node.tag == f"{_W_NS}t" and node.text:
                texts.append(node.text)
            elif node.tag in (f"{_W_NS}tab",):
                texts.append("\t")
            elif node.tag in (f"{_W_NS}br", f"{_W_NS}cr"):
                texts.append("\n")
        style_id, outline = None, None
        props = para.find(f"{_W_NS}pPr")
        if props is not None:
            style = props.find(f"{_W_NS}pStyle")
            style_id = style.get(f"{_W_NS}val") if style is not None else None
            outline = _outline_level(props.find(f"{_W_NS}outlineLvl"))
        style_name, style_outline = styles.get(style_id or "", (style_id or "", None))
        bold_runs = [r for r in para.iter(f"{_W_NS}r") if "".join(t.text or "" for t in r.iter(f"{_W_NS}t")).strip()]
        bold = bool(bold_runs) and all(r.find(f"{_W_NS}rPr/{_W_NS}b") is not None for r in bold_runs)
        level = _style_level(style_name, outline if outline is not None else style_outline)
        items.append(("".join(texts), level, bold))
    title = re.search(r"<dc:title>(.*?)</dc:title>", core, re.S)
    author = re.search(r"<dc:creator>(.*?)</dc:creator>", core, re.S)
    created = re.search(r"<dcterms:created[^>]*>(\d{4})", core)
    meta = {
        "title": title.group(1) if title else "",
        "author": author.group(1) if author else "",
        "year": int(created.group(1)) if created else None,
    }
    return items, meta


def _outline_level(element) -> int | None:
    """A w:outlineLvl element's level, or None."""
    value = element.get(f"{_W_NS}val", "") if element is not None else ""
    return int(value) if value.isdigit() else None


def _docx_style_table(styles_xml: bytes) -> dict[str, tuple[str, int | None]]:
    table: dict[str, tuple[str, int | None]] = {}
    for style in ElementTree.fromstring(styles_xml).iter(f"{_W_NS}style"):
        style_id = style.get(f"{_W_NS}styleId") or ""
        name = style.find(f"{_W_NS}name")
        outline = _outline_level(style.find(f"{_W_NS}pPr/{_W_NS}outlineLvl"))
        table[style_id] = ((name.get(f"{_W_NS}val") or "") if name is not None else style_id, outline)
    return table


def check_docx_expansion(path: str) -> None:
    """Refuse a DOCX whose XML parts expand past the limits, by decompressing them as a stream (a few MB at a
    time, never the whole part) before any XML parser sees them."""
    cap = document_limit("KB_DOCX_MAX_XML_MB") * 1024 * 1024
    ratio = document_limit("KB_DOCX_MAX_RATIO")
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if not info.filename.endswith(".xml") or not info.filename.startswith("word/"):
                    continue
                expanded = 0
                with archive.open(info) as part:
                    while chunk := part.read(4 * 1024 * 1024):
                        expanded += len(chunk)
                        too_big = expanded > cap
                        too_dense = expanded > 8 * 1024 * 1024 and expanded > ratio * max(info.compress_size, 1)
                        if too_big or too_dense:
                            what = (
                                f"more than {cap // (1024 * 1024)} MB (KB_DOCX_MAX_XML_MB)"
                                if too_big
                                else f"over {ratio} times its compressed size (KB_DOCX_MAX_RATIO)"
                            )
                            raise FileRejected(
                                STATUS_ERROR,
                                "too_large",
                                f"{info.filename} inside the DOCX expands to {what}; a document "
                                "this large is not indexed (raise the limit to index it)",
                            )
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, RuntimeError, NotImplementedError) as exc:
        raise FileRejected(STATUS_ERROR, "corrupt", f"the DOCX could not be read ({_short_error(exc)})") from None


def extract_docx(path: str) -> Extracted:
    if os.path.getsize(path) == 0:
        raise FileRejected(STATUS_ERROR, "empty", "the file is empty (0 bytes)")
    if not zipfile.is_zipfile(path):
        raise FileRejected(STATUS_ERROR, "corrupt", "not a valid DOCX file (it is not a zip archive)")
    check_docx_expansion(path)
    try:
        items, meta = _docx_paragraphs_python_docx(path)
    except Exception:
        try:
            items, meta = _docx_paragraphs_xml(path)
        except FileRejected:
            raise
        except Exception as exc:
            raise FileRejected(STATUS_ERROR, "corrupt", f"the DOCX could not be read ({_short_error(exc)})") from None
    builder = PageTextBuilder(None)
    blocks = []
    for raw_text, level, bold in items:
        for piece in re.split(r"\n\s*\n", raw_text):
            text = normalize_text(re.sub(r"[ \t\r\f\v]+", " ", piece).replace("\n", " ")).strip()
            if not text:
                continue
            block = Block(text=text, page=None, bold=bold)
            if level == "title":
                block.role = "title"
            elif level:
                block.role, block.level = "heading", int(level)
            builder.add(block)
            blocks.append(block)
    if not any(b.text.strip() for b in blocks):
        raise FileRejected(STATUS_SKIPPED, "no_text", "the document contains no text")
    classify_blocks(blocks, 0.0)
    references, numbered = reference_entries(blocks)
    return Extracted("docx", blocks, [builder.text()], [], meta, references=references, numbered_references=numbered)


# -- TXT / Markdown -------------------------------------------------------------


def decode_text_file(data: bytes) -> str:
    if data.startswith(b"\xef\xbb\xbf"):
        return data[3:].decode("utf-8", "replace")
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return data.decode("utf-16", "replace")
    if b"\x00" in data[:4096]:
        raise FileRejected(STATUS_ERROR, "binary", "the file looks binary, not text")
    for encoding in ("utf-8", "gb18030"):
        try:
            return data.decode(encoding)
        except UnicodeDecodeError:
            continue
    return data.decode("latin-1")


_MD_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_MD_SETEXT = re.compile(r"^\s{0,3}(=+|-+)\s*$")


def _text_paragraphs(text: str, markdown: bool) -> Iterator[tuple[str, int]]:
    """(paragraph text, markdown heading level or 0) in document order."""
    pending: list[str] = []
    in_fence = False

    def flush():
        if pending:
            yield join_lines(pending), 0
            pending.clear()

    for line in text.splitlines():
        if markdown and line.strip().startswith(("```", "~~~")):
            in_fence = not in_fence
            pending.append(line)
            continue
        heading = _MD_HEADING.match(line) if markdown and not in_fence else None
        if heading:
            yield from flush()
            yield heading.group(2), len(heading.group(1))
            continue
        if markdown and not in_fence and pending and len(pending) == 1 and _MD_SETEXT.match(line):
            title = pending.pop()
            yield title, 1 if line.strip().startswith("=") else 2
            continue
        if not line.strip():
            yield from flush()
            continue
        pending.append(line)
    yield from flush()


def extract_text_file(path: str, kind: str) -> Extracted:
    cap = document_limit("KB_TEXT_MAX_MB") * 1024 * 1024
    if os.path.getsize(path) > cap:
        raise FileRejected(
            STATUS_ERROR,
            "too_large",
            f"the file is larger than {cap // (1024 * 1024)} MB (KB_TEXT_MAX_MB); a text this large is not indexed",
        )
    with open(path, "rb") as handle:
        data = handle.read()
    if not data.strip():
        raise FileRejected(STATUS_ERROR, "empty", "the file is empty")
    text = normalize_text(decode_text_file(data))
    builder = PageTextBuilder(None)
    blocks = []
    for paragraph, md_level in _text_paragraphs(text, kind == "md"):
        paragraph = paragraph.strip()
        if not paragraph:
            continue
        block = Block(text=paragraph, page=None, n_lines=1)
        if md_level:
            block.role, block.level = "heading", md_level
        builder.add(block)
        blocks.append(block)
    if kind == "md":
        first = next((b for b in blocks if b.role != "noise"), None)
        if first is not None and first.role == "heading" and first.level == 1 and not canonical_section(first.text):
            first.role = "title"
        _normalise_md_levels(blocks)
    classify_blocks(blocks, 0.0)
    references, numbered = reference_entries(blocks)
    return Extracted(kind, blocks, [builder.text()], [], {}, references=references, numbered_references=numbered)


def _normalise_md_levels(blocks: list[Block]) -> None:
    """Make the shallowest Markdown heading level of the body level 1."""
    levels = [b.level for b in blocks if b.role == "heading"]
    if levels:
        shift = min(levels) - 1
        for block in blocks:
            if block.role == "heading":
                block.level -= shift


def extract_file(path: str, max_pages: int | None = None, options: ReadOptions | None = None) -> Extracted:
    """Blocks and page texts of a file; ``max_pages`` reads only the first pages of a PDF (metadata refresh)."""
    kind = SUPPORTED_SUFFIXES.get(Path(path).suffix.lower())
    if kind == "pdf":
        return extract_pdf(path, max_pages, options)
    if kind == "docx":
        return extract_docx(path)
    if kind in ("txt", "md"):
        return extract_text_file(path, kind)
    raise FileRejected(
        STATUS_ERROR,
        "unsupported",
        f"unsupported file type {Path(path).suffix or '(none)'}; supported: {', '.join(sorted(SUPPORTED_SUFFIXES))}",
    )


def page_texts(path: str) -> list[str]:
    """The engine's normalised text of every page (one element for formats without pages); a page without a
    usable text layer gives its OCR text when the OCR extra is installed (KB_OCR as for ingest), cached in the
    user's kb-rag cache folder."""
    return extract_file(path, options=ReadOptions(ocr_cache=str(kb_cache_dir() / OCR_CACHE_FILENAME))).page_texts
