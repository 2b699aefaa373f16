"""Block classification: the PDF outline, wrapped headings, what each block is, heading numbering levels.

May import: reading.blocks, reading.structure.
"""

from __future__ import annotations

import re
import unicodedata

from ..reading.blocks import (
    _BARE_NUMBER,
    _CAPTION,
    _CHAPTER_LABEL,
    NOT_INDEXED_SECTIONS,
    Block,
    HeadingNumbering,
    canonical_section,
    looks_like_heading,
    numbering_depth,
    numbering_scheme,
    strip_numbering,
)
from ..reading.structure import (
    _ENDS_UNFINISHED,
    _TOC_ENTRY,
    STYLE_HEADING_MIN_SIZE,
    _closing_heading_typeset,
    _looks_like_person,
    _runs_on,
    apply_heading_styles,
    apply_run_in_headings,
    block_style,
    confirm_closing_headings,
    join_lines,
)

# -- the PDF's outline ------------------------------------------------------------------------------------------
# A PDF's bookmarks, where the document has them, name its headings and their levels. They are taken as certain
# evidence only when they agree with the pages: most entries are found, as a short block starting with the entry's
# title, on the page the entry points to. An outline that does not (made by another tool, for another version of
# the text) is left alone.

OUTLINE_MIN_AGREEMENT = 0.6


def _outline_key(text: str) -> str:
    return re.sub(r"[\W_]+", "", unicodedata.normalize("NFKC", strip_numbering(text or "")).casefold())


def _outline_matches(blocks: list[Block], outline: list[tuple[int, str, int]]) -> list[tuple[int, int]]:
    """(block index, outline level) for each entry found on its page as a short block that starts with it."""
    by_page: dict[int, list[int]] = {}
    for i, block in enumerate(blocks):
        if block.page is not None and block.n_lines <= 3 and len(block.text) <= 200 and not block.in_table:
            by_page.setdefault(block.page, []).append(i)
    found, taken = [], set()
    for level, title, page in outline:
        key = _outline_key(title)
        if len(key) < 2:
            continue
        candidates = [
            i for i in by_page.get(page, []) if i not in taken and not _TOC_ENTRY.match(blocks[i].text.strip())
        ]
        exact = [i for i in candidates if _outline_key(blocks[i].text) == key]
        close = [
            i
            for i in candidates
            if _outline_key(blocks[i].text).startswith(key) and len(key) >= 0.6 * len(_outline_key(blocks[i].text))
        ]
        for i in (exact or close)[:1]:
            found.append((i, level))
            taken.add(i)
    return found


def join_wrapped_headings(blocks: list[Block], body_size: float) -> list[Block]:
    """A heading wrapped onto a second line that PyMuPDF set apart ("II. FLAVOR STRUCTURE OF LIGHT AND" over
    "HEAVY LIGHT DIQUARKS"): the two blocks become one when they share their style, touch, and the first breaks
    off unfinished (on "and", "of", a hyphen, a comma) or both are numbered-heading capitals."""
    out: list[Block] = []
    for block in blocks:
        previous = out[-1] if out else None
        if previous is not None and _continues_heading(previous, block, body_size):
            previous.text = join_lines([previous.text, block.text])
            previous.n_lines += block.n_lines
            if previous.bbox is not None and block.bbox is not None:
                previous.bbox = (
                    min(previous.bbox[0], block.bbox[0]),
                    previous.bbox[1],
                    max(previous.bbox[2], block.bbox[2]),
                    max(previous.bbox[3], block.bbox[3]),
                )
            continue
        out.append(block)
    return out


def _continues_heading(first: Block, second: Block, body_size: float) -> bool:
    if (
        first.page != second.page
        or first.bbox is None
        or second.bbox is None
        or first.n_lines > 2
        or second.n_lines > 2
        or len(first.text) + len(second.text) > 160
        or first.in_table
        or second.in_table
        or block_style(first) != block_style(second)
        or numbering_depth(second.text)
    ):
        return False
    height = first.first_line[3] - first.first_line[1] if first.first_line else 10.0
    if not 0 <= second.bbox[1] - first.bbox[3] <= 0.6 * height or _CAPTION.match(first.text):
        return False
    size, bold, _, caps, _ = block_style(first)
    if not (bold or caps or size >= 1.15 * body_size):
        return False
    text = first.text.rstrip()
    unfinished = bool(_ENDS_UNFINISHED.search(text)) or text.endswith((",", "-", "–"))
    return unfinished or (caps and bool(numbering_depth(text)) and not text.endswith((".", ":", "?", "!")))


def apply_outline(blocks: list[Block], outline: list[tuple[int, str, int]]) -> None:
    """Headings from an outline that agrees with the pages (see above), at the outline's levels (its shallowest
    level found is 1). The title of the paper, often the outline's first entry, stays the title."""
    entries = [(level, title, page) for level, title, page in outline]
    if not entries:
        return
    found = _outline_matches(blocks, entries)
    if len(found) < max(2, OUTLINE_MIN_AGREEMENT * len(entries)):
        return
    if sum(_looks_like_person(blocks[i].text, blocks[i].page) or "@" in blocks[i].text for i, _ in found) >= 1:
        return  # an outline made of the title page's lines (authors, e-mail): its levels mean nothing
    top = min((level for i, level in found if blocks[i].role != "title"), default=1)
    for i, level in found:
        block = blocks[i]
        if block.role == "title":
            continue
        block.role, block.evidence = "heading", "outline"
        block.level = numbering_depth(block.text) or min(4, level - top + 1)


def _not_a_section_number(block: Block, arabic_seen: bool, body_size: float) -> bool:
    """A number that continues the sequence but does not open a section: "3)" once the sections are numbered "1",
    "2" (a list's item), or a number set smaller than the text in a regular weight (a figure's or a table's
    label, as OCR reads them from the picture)."""
    scheme = numbering_scheme(block.text)
    return (scheme == "arabic)" and arabic_seen) or (
        scheme in ("arabic", "arabic)")
        and not block.bold
        and body_size > 0
        and block.size < STYLE_HEADING_MIN_SIZE * body_size
    )


def classify_blocks(blocks: list[Block], body_size: float) -> None:  # noqa: C901
    """Assign roles in place: heading, caption, noise or body."""
    numbering = HeadingNumbering()
    in_front_matter = True
    detached_number: list[int] | None = None  # "1.3" typeset on its own line before the heading text
    arabic_seen = False  # a heading numbered "1 ..." or "2.1 ..." was accepted
    for i, block in enumerate(blocks):
        number, detached_number = detached_number, None
        if block.role == "heading":
            in_front_matter = False
            if block.evidence == "outline" and (parts := HeadingNumbering.parts(block.text)):
                numbering.follow(parts)
                arabic_seen = arabic_seen or numbering_scheme(block.text) == "arabic"
        if block.role != "body":
            continue
        text = block.text
        if _BARE_NUMBER.match(text) and not block.in_table:
            block.role = "noise"
            detached_number = [int(n) for n in re.findall(r"\d+", text)] or None
            continue
        if len(text.strip()) < 2 or not any(ch.isalnum() for ch in text):
            block.role = "noise"
            continue
        if block.in_table or block.in_figure:
            continue  # a table's cells and column headers, a figure's labels: content, never headings
        if _runs_on(block, blocks[i + 1] if i + 1 < len(blocks) else None):
            continue
        if number and looks_like_heading(text, block.size, True, block.n_lines, body_size) and numbering.accept(number):
            block.role, block.level, block.evidence = "heading", len(number), "numbered"
            in_front_matter = False
            continue
        if _CAPTION.match(text) and len(text) > 12:
            block.role = "caption"
            continue
        level = looks_like_heading(text, block.size, block.bold, block.n_lines, body_size)
        if not level:
            continue
        parts = HeadingNumbering.parts(text)
        known = canonical_section(text) is not None
        if canonical_section(text) in NOT_INDEXED_SECTIONS and not _closing_heading_typeset(block, body_size):
            continue
        if (
            parts is not None
            and not known
            and (_not_a_section_number(block, arabic_seen, body_size) or not numbering.accept(parts))
        ):
            continue
        if parts is not None and known:
            numbering.follow(parts)
        arabic_seen = arabic_seen or numbering_scheme(text) == "arabic"
        if parts is None and not known and numbering_depth(text) == 0:
            # Style alone is weak evidence: not in the front matter (author lines), and not one bold word
            big = body_size and block.size >= body_size * 1.3
            if in_front_matter and block.page in (None, 1) or not (big or len(text.split()) >= 2):
                continue
        block.evidence = (
            "known" if known else "numbered" if numbering_depth(text) or _CHAPTER_LABEL.match(text) else "typeset"
        )
        block.role, block.level = "heading", level
        in_front_matter = False
        if chapter := _CHAPTER_LABEL.match(text):
            numbering.open_chapter(int(chapter.group(1)))
        elif parts is None and numbering_depth(text):
            numbering.restart()  # under "二、" or "II." the arabic numbers may begin again at 1
    if body_size:  # typography to learn from: PDF (DOCX and Markdown name their heading levels)
        apply_heading_styles(blocks, body_size)
        apply_run_in_headings(blocks, body_size)
        apply_numbering_levels(blocks)
    confirm_closing_headings(blocks)


def apply_numbering_levels(blocks: list[Block]) -> None:
    """Levels of numbered headings in a document whose top level is not arabic ("一、" then "（一）" then "1.";
    "I." then "A." then "1)"): each numbering takes the level of its rank in the order the document first uses
    them. Arabic numbers that carry their parents ("1.2") keep the depth they spell."""
    numbered = [
        b
        for b in blocks
        if b.role == "heading" and b.evidence in ("numbered", "known", "outline") and numbering_scheme(b.text)
    ]
    order: list[str] = []
    for block in numbered:
        scheme = numbering_scheme(block.text)
        if scheme is not None and scheme not in order:
            order.append(scheme)
    if not order or order[0] in ("arabic", "cnchap"):
        return
    for block in numbered:
        scheme = numbering_scheme(block.text)
        if scheme == "arabic" and numbering_depth(block.text) >= 2:
            block.level = numbering_depth(block.text)
        else:
            block.level = min(4, order.index(str(scheme)) + 1)
