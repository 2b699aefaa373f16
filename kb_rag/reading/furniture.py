"""Page furniture: the page numbers and running heads a PDF repeats on its pages, found across pages and kept out of
its text.

May import: reading.structure.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ..reading.structure import _repeat_key

if TYPE_CHECKING:  # annotations only: these modules import this one
    from ..reading.pdf import _PdfBlock, _PdfLine


# a page number as printed ("12", "Page 3 of 20", "- 4 -", "第7页"), or a Chinese journal's volume and issue
_PAGE_NUMBER_LINE = re.compile(
    r"^\s*(?:page\s*)?[\divxlc]{1,6}(?:\s*(?:/|of)\s*\d{1,5})?\s*$"
    r"|^\s*[-–—]\s*\d{1,5}\s*[-–—]\s*$"
    r"|^\s*第\s*[\divxlc]{1,6}\s*页(?:\s*[,/]?\s*共\s*\d{1,5}\s*页)?\s*$"
    r"|^\s*第\s*\d{1,4}\s*[卷期](?:\s*第\s*\d{1,4}\s*期)?\s*$",
    re.IGNORECASE,
)


def _margin_key(text: str) -> str:
    return re.sub(r"\d+", "#", text.lower()).strip()


# Some layouts (theses, reports, books) set the running head lower than the margin band above: "2 Introduction"
# on one page, "1.1 TLB based approaches 3" on the next. Its page number gives it away, because it advances with
# the page: physical page minus printed number is the same on most pages. Such a number, found this deep into the
# page, is dropped with the running title on its row. Left in, the bare number read as the section number of
# the title beside it, which then became a heading and threw the real numbered headings out of sequence.
MARGIN_BAND = 0.09  # share of the page height at top and bottom searched for running heads


PAGE_NUMBER_BAND = 0.15


PAGE_NUMBER_MIN_SHARE = 0.3  # of the pages, with at least 3, must carry a number at the same offset


PAGE_NUMBER_SLOT = 3.0  # points a page number may move from the height it holds on other pages


RUNNING_TITLE_MAX_CHARS = 120


def _bare_page_number(text: str) -> int | None:
    stripped = text.strip()
    return int(stripped) if stripped.isdigit() and len(stripped) <= 4 else None


def _page_number_lines(blocks: list[_PdfBlock], height: float) -> list[tuple[int, _PdfLine]]:
    """(number, line) for each line near the top or bottom of the page that is a bare number."""
    return [
        (number, line)
        for block in blocks
        if _in_band(block, height, PAGE_NUMBER_BAND)
        for line in block.lines
        if (number := _bare_page_number(line.text)) is not None
    ]


def _page_number_layout(pages: list[tuple[list[_PdfBlock], float]]) -> tuple[int, list[float]] | None:
    """(physical page minus printed number, the heights at which those numbers are set), where the same difference
    holds on enough pages; else None. A page number keeps its slot from page to page; a digit of a formula or a
    table that happens to equal the page number does not."""
    votes: dict[int, list[float]] = {}
    for index, (blocks, height) in enumerate(pages, start=1):
        seen: dict[int, float] = {}
        for number, line in _page_number_lines(blocks, height):
            seen.setdefault(index - number, line.bbox[1])
        for offset, top in seen.items():
            votes.setdefault(offset, []).append(top)
    if not votes:
        return None
    offset = max(votes, key=lambda key: (len(votes[key]), -abs(key)))
    tops = votes[offset]
    if len(tops) < max(3, PAGE_NUMBER_MIN_SHARE * len(pages)):
        return None
    slots = [top for top in tops if sum(abs(top - other) <= PAGE_NUMBER_SLOT for other in tops) >= 2]
    return offset, slots


def _in_band(block: _PdfBlock, height: float, share: float) -> bool:
    return block.bbox[3] < height * share or block.bbox[1] > height * (1 - share)


def _running_head_row(blocks: list[_PdfBlock], height: float, printed: int, slots: list[float]) -> set[int]:
    """ids of the blocks on the row of this page's printed number (the number and its running title), when the
    number sits in a page-number slot."""
    numbers = [
        line
        for number, line in _page_number_lines(blocks, height)
        if number == printed and any(abs(line.bbox[1] - slot) <= PAGE_NUMBER_SLOT for slot in slots)
    ]
    if not numbers:
        return set()
    mark = min(numbers, key=lambda line: min(line.bbox[1], height - line.bbox[3]))
    top, bottom = mark.bbox[1] - 2, mark.bbox[3] + 2
    return {
        id(block)
        for block in blocks
        if len(block.text) <= RUNNING_TITLE_MAX_CHARS
        and all(top <= (line.bbox[1] + line.bbox[3]) / 2 <= bottom for line in block.lines)
    }


def _drop_running_heads(pages: list[tuple[list[_PdfBlock], float]]) -> list[list[_PdfBlock]]:
    """Remove page numbers and headers/footers repeated across pages."""

    def in_margin(block: _PdfBlock, height: float) -> bool:
        return _in_band(block, height, MARGIN_BAND)

    counts: dict[str, int] = {}
    for blocks, height in pages:
        margin = [b.text for b in blocks if in_margin(b, height) and len(b.text) < 160]
        for key in {_margin_key(text) for text in margin} | {"=" + _repeat_key(text) for text in margin}:
            counts[key] = counts.get(key, 0) + 1
    repeat_threshold = max(3, int(0.3 * len(pages)))
    # by their letters too: an OCR'd page may read a running head with its neighbour on the row as one line
    # ("通信学报 ·28·" on one page, "通信学报" on the next; "第4期" joined to the title or not)
    heads = [key[1:] for key, n in counts.items() if key[:1] == "=" and len(key) >= 5 and n >= repeat_threshold]

    def repeated(text: str) -> bool:
        letters = _repeat_key(text)
        return counts.get(_margin_key(text), 0) >= repeat_threshold or any(
            head in letters and len(head) >= 0.6 * len(letters) for head in heads
        )

    layout = _page_number_layout(pages)
    kept_pages = []
    for index, (blocks, height) in enumerate(pages, start=1):
        running = _running_head_row(blocks, height, index - layout[0], layout[1]) if layout else set()
        kept = []
        for block in blocks:
            if id(block) in running:
                continue
            if (
                in_margin(block, height)
                and len(block.text) < 160
                and (_PAGE_NUMBER_LINE.match(block.text) or repeated(block.text))
            ):
                continue
            kept.append(block)
        kept_pages.append(kept)
    return kept_pages


# -- printed page numbers, for the pages a work spans in its journal or proceedings ---------------------------

PRINTED_SPAN_SHARE = 0.5  # of the pages (at least 2) must carry a number at the same offset from their place


def margin_numbers(blocks: list[tuple[tuple, str]], height: float) -> list[int]:
    """Every whole number printed in the top or bottom band of a page (blocks as (bbox, text)): bare page numbers,
    and the numbers inside running heads and footers ("Nature | Vol 574 | 24 October 2019 | 507")."""
    band = height * PAGE_NUMBER_BAND
    return [
        int(number)
        for bbox, text in blocks
        if (bbox[3] < band or bbox[1] > height - band) and len(text) < 200
        for number in re.findall(_MARGIN_NUMBER, _CAPTION_NUMBER.sub(" ", _LETTER_SPACED_DIGITS.sub(_unspaced, text)))
    ]


_MARGIN_NUMBER = re.compile(r"(?<![\d.,/:-])(\d{1,5})(?![\d.,/:]\d)")
# the number of a table, figure or chapter, which also advances from page to page: never a page number
_CAPTION_NUMBER = re.compile(
    r"\b(?:table|tab\.|figure|fig\.|chapter|section|appendix|box|equation|eq\.|图|表)\s*[A-Z]?\d+", re.IGNORECASE
)


# a number set letter-spaced in a running head ("4 8 4 | N A T U R E"): three or more single digits
_LETTER_SPACED_DIGITS = re.compile(r"(?<![\d.])\b\d(?: \d){2,4}\b(?![\d.])")


def _unspaced(match: re.Match) -> str:
    return match.group(0).replace(" ", "")


def printed_page_span(numbers: list[list[int]]) -> tuple[int, int] | None:
    """(first, last) printed page number of a document whose pages carry their numbers in the margins: the
    difference between a page's place and one of its margin numbers that most pages share; else None. A journal
    line's volume or year repeated on every page stays the same from page to page, so never shares a difference."""
    if len(numbers) < 2:
        return None
    votes: dict[int, int] = {}
    for place, printed in enumerate(numbers, start=1):
        for offset in {place - n for n in printed}:
            votes[offset] = votes.get(offset, 0) + 1
    if not votes:
        return None
    offset = max(votes, key=lambda key: (votes[key], -abs(key)))
    if votes[offset] < max(2, PRINTED_SPAN_SHARE * len(numbers)) or 1 - offset < 1:
        return None
    return 1 - offset, len(numbers) - offset
