"""Structure recognition: heading typography, run-in headings, closing sections, reference lists, superscript
citations, page text.

May import: reading.blocks, text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..reading.blocks import (
    _A_WORD,
    _CAPTION,
    _NOT_A_HEADING,
    NOT_INDEXED_SECTIONS,
    SMALL_PRINT_SHARE,
    Block,
    canonical_section,
    in_capitals,
    numbering_depth,
    numbering_scheme,
    strip_numbering,
)
from ..text import cjk_ratio, is_cjk

# -- headings from the document's own typography ---------------------------------------------------------------
# A document sets its headings in a few styles of its own. The headings that are certain (numbered in the
# document's sequence, or a known section name) show which styles those are and at which level each is used;
# every other short block set in such a style is a heading too, at that level. A style that only the uncertain
# headings use (bold at body size, say) takes the level below the last certain style more prominent than it.

HEADING_STYLE_MIN_USES = 2  # an emphasised style no certain heading uses counts when used this often
_PUBLISHER_BOX = re.compile(
    r"submit your (?:next )?manuscript|take full advantage of|^open access$|this article is "
    r"(?:licensed|distributed)|creative commons|publisher['’]s note|remains neutral with|"
    r"reprints and permissions|©|\bcopyright\b|all rights reserved",
    re.IGNORECASE,
)
_ENDS_UNFINISHED = re.compile(
    r"\b(?:of|the|a|an|and|or|to|in|for|by|with|on|as|at|from|is|are|that|which|"
    r"such as|including)$",
    re.IGNORECASE,
)
_STATEMENT_LABEL = re.compile(
    r"^\s*(?:definition|définition|example|exemple|theorem|théorème|lemma|lemme|proposition|"
    r"corollary|corollaire|remark|remarque|proof|preuve|propriété|property|conjecture|"
    r"assumption|hypothesis|claim|algorithm|定义|定理|引理|推论|例)\s*\d",
    re.IGNORECASE,
)
STYLE_HEADING_MIN_SIZE = 0.85  # of the body size: smaller text in an emphasised style is a figure's or a table's


def block_style(block: Block) -> tuple:
    """A block's typography as a document's headings share it: size to the half point, weight, slant, capitals,
    colour."""
    head = block.text[:160]  # a heading's capitals show in its first words; a paragraph need not be read
    caps = in_capitals(head)
    return round(block.size * 2) / 2, block.bold, block.italic, caps, block.coloured


def _prominence(style: tuple) -> tuple:
    size, bold, italic, caps, coloured = style
    return size, bold, coloured, caps, italic


def _emphasised(style: tuple, body: tuple) -> bool:
    size, bold, italic, caps, coloured = style
    return bold or italic or caps or coloured or (size >= body[0] * 1.06 and size - body[0] >= 0.5)


def _heading_shaped(text: str) -> bool:
    """Short, starts like a title, reads as a name rather than a sentence."""
    stripped = text.strip()
    words = stripped.split()
    letters = [ch for ch in stripped if ch.isalpha()]
    if not words or len(stripped) > 120 or len(words) > 16 or len(letters) < 2:
        return False
    first = re.sub(r"^\(?[a-z]\)\s*", "", strip_numbering(stripped))[:1]  # "(a) Intra-Metapath Aggregation"
    if not first or not (first.isupper() or first.isdigit() or is_cjk(first)):
        return False
    if stripped[0].isdigit() and not numbering_depth(stripped) or looks_like_reference_entry(stripped):
        return False  # "590 (2000) 287-305 ...": a reference list's line, not a numbered heading
    if stripped[-1] in ",;" or "。" in stripped or _CAPTION.match(stripped) or _NOT_A_HEADING.search(stripped):
        return False
    if cjk_ratio(stripped) > 0.3 and (len(stripped) > 30 or re.search(r"[,;!?]|:\s*\S", stripped)):
        return False  # a line of Chinese prose, or a form's field ("日期: 年 月 日")
    if not _A_WORD.search(stripped) and cjk_ratio(stripped) <= 0.3 or _STATEMENT_LABEL.match(stripped):
        return False  # a symbol ("CW", "ΘΨ1"), or a theorem's or an example's label
    if _PUBLISHER_BOX.search(stripped) or _ENDS_UNFINISHED.search(stripped.rstrip(".:： ")):
        return False  # a publisher's box or banner, or a sentence cut before what it introduces
    body = stripped.rstrip(".:：")
    return not re.search(r"[a-z]{2,}[.!?]\s+\S", body) and not (body.endswith(".") and len(words) > 8)


def _body_style(blocks: list[Block]) -> tuple:
    """The style most of the running text is set in (tables and figures' text left out)."""
    weights: dict[tuple, int] = {}
    for block in blocks:
        if (
            block.role == "body"
            and block.size
            and not block.in_table
            and not block.gapped
            and not block.in_figure
            and not _numeric_row(block.text)
        ):
            style = block_style(block)
            weights[style] = weights.get(style, 0) + len(block.text)
    return max(weights, key=weights.__getitem__) if weights else (0.0, False, False, False, False)


def _repeat_key(text: str) -> str:
    """A short text as its repetitions share it: letters only, digits (page numbers) left out."""
    return re.sub(r"\W+|\d+", "", text.casefold())


def _repeated_texts(blocks: list[Block]) -> set[str]:
    """Short unnumbered texts printed on three pages or more, and on a fifth of them: running heads and banners
    that survived the margin check, a table header repeated on every page. A chapter's title printed again in
    the contents and as a numbered section is not one of them."""
    pages: dict[str, set] = {}
    for block in blocks:
        if len(block.text) <= 120 and not numbering_depth(block.text) and not _TOC_ENTRY.match(block.text.strip()):
            pages.setdefault(_repeat_key(block.text), set()).add(block.page)
    total = len({b.page for b in blocks})
    return {key for key, seen in pages.items() if key and len(seen) >= max(3, total / 5)}


def _followed_by_text(blocks: list[Block], index: int) -> bool:
    following = next((b for b in blocks[index + 1 : index + 3] if b.role not in ("noise",)), None)
    return following is not None and following.role in ("body", "heading") and not following.in_table


def _rank_level(style: tuple, learned: dict[tuple, int]) -> int:
    """A style's level: its own when learned, else one below the deepest learned style more prominent than it."""
    if style in learned:
        return learned[style]
    above = [level for known, level in learned.items() if _prominence(known) > _prominence(style)]
    return min(4, max(above) + 1) if above else 1


def _learned_styles(blocks: list[Block], body: tuple) -> dict[tuple, int]:
    """Style -> level, from the certain headings. A numbered one (or one the outline gives) says its level by its
    number; a known section name only says that its style is a heading style, whose level comes from its rank:
    below the numbered styles more prominent than it, or, in a document without numbers, by prominence alone."""
    numbered: dict[tuple, dict[int, int]] = {}
    named: set[tuple] = set()
    for block in blocks:
        if block.role != "heading" or block.n_lines > 3:
            continue
        style = block_style(block)
        if style == body or not _emphasised(style, body):
            continue
        if block.evidence == "outline" or (block.evidence in ("numbered", "known") and numbering_depth(block.text)):
            depth = numbering_depth(block.text) or block.level or 1
            levels = numbered.setdefault(style, {})
            levels[depth] = levels.get(depth, 0) + 1
        elif block.evidence == "known":
            named.add(style)
    learned = {style: max(levels, key=levels.__getitem__) for style, levels in numbered.items()}
    ranked = sorted(named - set(learned), key=_prominence, reverse=True)
    if learned:
        for style in ranked:
            learned[style] = _rank_level(style, learned)
    else:
        learned = {style: min(4, rank + 1) for rank, style in enumerate(ranked)}
    return learned


def _runs_on(block: Block, following: Block | None) -> bool:
    """A line that runs on into the next block: the line right below it, in the same type, starts no further right
    and ends no further right than it does. A paragraph's first line split off as a block of its own (producers
    that write each line as a block, OCR'd pages); a heading's line ends short of the text below, or the text
    below it is indented."""
    if (
        following is None
        or block.n_lines != 1
        or following.page != block.page
        or not block.bbox
        or not following.bbox
        or block.text.rstrip()[-1:] in "。.!?:："
    ):
        return False
    line, below = block.bbox, following.bbox
    height = max(line[3] - line[1], 1.0)
    return (
        abs(block.size - following.size) < 0.5
        and block.bold == following.bold
        and -0.2 * height <= below[1] - line[3] <= height
        and below[0] <= line[0] + 1.0
        and line[2] >= below[2] - max(block.size, 2.0)
    )


def apply_heading_styles(blocks: list[Block], body_size: float) -> None:
    """Headings by the document's own heading styles (see above): adds the blocks set in a style its certain
    headings use, or in an emphasised style it uses for standalone lines again and again, and gives every heading
    without a number its level from where its style ranks among the certain ones."""
    body = _body_style(blocks)
    learned = _learned_styles(blocks, body)
    certain = learned or any(b.role == "heading" and b.evidence in ("numbered", "known", "outline") for b in blocks)
    repeated = _repeated_texts(blocks)
    # before the first certain heading come the title, the byline and the affiliations: no style decides there
    first = next(
        (
            i
            for i, b in enumerate(blocks)
            if b.role == "heading"
            and b.evidence in ("numbered", "known", "outline")
            or b.role == "body"
            and len(b.text) >= 200
            and block_style(b) == body
        ),
        len(blocks),
    )
    if not certain:  # a report without a numbered or named heading: its styles begin after the title
        first = max((i for i, b in enumerate(blocks) if b.role == "title"), default=-1)
    set_apart = _toc_entries(blocks) | _row_mates(blocks)  # contents lines, table cells
    for i, block in enumerate(blocks):
        if block.role != "heading" or block.evidence not in ("typeset", "known"):
            continue
        plain_name = (
            block.evidence == "known" and learned and block_style(block) == body and not numbering_depth(block.text)
        )  # "附录" in a list of a thesis's parts
        if (
            i in set_apart
            or plain_name
            or (
                block.evidence == "typeset"
                and (
                    block.gapped
                    or _BANNER.search(block.text)
                    or not _heading_shaped(block.text)
                    or _not_a_section(blocks, i)
                    or _repeat_key(block.text) in repeated
                )
            )
        ):
            block.role, block.level, block.evidence = "body", 0, ""
    candidates = [
        i
        for i, b in enumerate(blocks)
        if i > first
        and b.role in ("body", "heading")
        and b.evidence in ("", "typeset")
        and not b.in_table
        and not b.in_figure
        and not b.gapped
        and b.n_lines <= 2
        and _heading_shaped(b.text)
        and not _runs_on(b, blocks[i + 1] if i + 1 < len(blocks) else None)
        and b.page is not None
        and not _BANNER.search(b.text)
        and b.size >= (SMALL_PRINT_SHARE if numbering_depth(b.text) else STYLE_HEADING_MIN_SIZE) * body_size
    ]
    styles = {i: block_style(blocks[i]) for i in candidates}
    uses: dict[tuple, int] = {}
    for style in styles.values():
        uses[style] = uses.get(style, 0) + 1
    for block in blocks:  # a known name takes the level of its style: "Analysis" set as a subsection
        if (
            block.role == "heading"
            and block.evidence == "known"
            and not numbering_depth(block.text)
            and block_style(block) in learned
        ):
            block.level = learned[block_style(block)]
    for i in candidates:
        block, style = blocks[i], styles[i]
        if i in set_apart or _repeat_key(block.text) in repeated or _not_a_section(blocks, i):
            continue
        recurring = style != body and _emphasised(style, body) and uses.get(style, 0) >= HEADING_STYLE_MIN_USES
        if style in learned or (recurring and _followed_by_text(blocks, i)):
            block.role, block.evidence = "heading", block.evidence or "style"
            block.level = numbering_depth(block.text) or _rank_level(style, learned)
        elif block.evidence == "typeset" and learned:
            block.level = _rank_level(style, learned)


_NAME_WORD = r"[A-Z][a-z'\u00c0-\u024f]+(?:-[A-Z][a-z'\u00c0-\u024f]+)?"
RUN_IN_MAX_WORDS = 10
_BULLET = re.compile(r"^\s*[•◦▪▫●○■□‣⁃∙·*\-–—]\s")


def _run_in_name(lead: str, page: int | None) -> str | None:
    """The heading a bold or italic lead-in names, or None when it names none: a run-in ends with a full stop or
    a colon (or is numbered), is short, and reads as a name (not a field's label, a theorem, a person)."""
    name = lead.strip()
    ends = (
        name.endswith((".", ":", "：", "—", " –", " -"))
        or bool(re.match(r"^\(?\d{1,2}\)|^\(?[a-z]\)", name))
        or numbering_depth(name) > 1
    )
    name = name.rstrip(".:：—–- ").strip()
    if not ends or not name or len(name.split()) > RUN_IN_MAX_WORDS or _BULLET.match(lead):
        return None
    if _ENDS_UNFINISHED.search(name):
        return None  # a sentence cut before its list ("... consists of:"), not a name
    if (
        _FIELD_LABEL.match(lead)
        or _STATEMENT_LABEL.match(name)
        or re.match(r"(?i)(?:proof|note|notes|remarks?)$", name)
    ):
        return None
    if (
        not _heading_shaped(name)
        or _looks_like_person(name, page)
        and re.search(r"\b[A-Z]\.", name)
        or canonical_section(name) == "abstract"
    ):
        return None
    return name


def _one_row(block: Block) -> bool:
    """Set on one row: one line, or a few PyMuPDF lines side by side ("Instance-Based" "Prediction.")."""
    if block.n_lines == 1:
        return True
    return (
        block.n_lines <= 3
        and block.first_line is not None
        and block.bbox is not None
        and (block.bbox[3] - block.bbox[1]) <= 1.6 * (block.first_line[3] - block.first_line[1])
    )


def _text_continues_on_its_row(blocks: list[Block], index: int) -> bool:
    """The next block's first line starts on this block's row, to its right: this one is the paragraph's
    lead-in, set apart by PyMuPDF because its font differs."""
    block = blocks[index]
    following = blocks[index + 1] if index + 1 < len(blocks) else None
    if following is None or block.bbox is None or following.first_line is None or following.page != block.page:
        return False
    return (
        following.role == "body"
        and following.first_line[0] >= block.bbox[2] - 1
        and _side_by_side(block.bbox, following.first_line)
    )


def apply_run_in_headings(blocks: list[Block], body_size: float) -> None:
    """Run-in headings, where the document uses them consistently (at least twice): the bold or italic lead-in
    of a paragraph ("Participants. We recruited ..."), or such a lead-in set as a line of its own that ends with
    a full stop. They become the lowest part of the passages' section label, never a section of their own."""
    found: list[tuple[int, str, bool]] = []  # (block index, name, set as a line of its own)
    for i, block in enumerate(blocks):
        if block.in_table or block.in_figure or block.page is None or block.size < 0.9 * body_size:
            continue
        known_run_in = block.evidence == "known" and block.text.strip().endswith(".")  # "Methods. We used ..."
        standalone = (
            _one_row(block)
            and not block.gapped
            and (block.bold or block.italic)
            and block.role in ("body", "heading")
            and (block.evidence in ("", "typeset", "style") or known_run_in)
            and numbering_scheme(block.text) in (None, "arabic)")
            and (
                _text_continues_on_its_row(blocks, i)
                or block.text.strip().endswith((".", ":"))
                and _followed_by_text(blocks, i)
            )
        )
        if standalone and not block.text.strip().endswith((".", ":", "：")):
            name = _run_in_name(block.text.strip() + ".", block.page)
        else:
            name = (
                _run_in_name(block.text if standalone else block.lead, block.page)
                if standalone or (block.role == "body" and block.lead and not looks_like_reference_entry(block.lead))
                else None
            )
        if name and not standalone and not (block.n_lines >= 2 or len(block.text) >= 120):
            name = None  # a lead-in opens a paragraph, not a one-line entry ("Question: ...")
        if name:
            found.append((i, name, standalone))
    times: dict[str, int] = {}
    for _, name, _ in found:
        times[name.casefold()] = times.get(name.casefold(), 0) + 1
    found = [item for item in found if times[item[1].casefold()] < 3]  # "Question:", "Answer:" in examples
    if len(found) < 2:
        return
    for i, name, standalone in found:
        block = blocks[i]
        if standalone:
            block.role, block.level, block.evidence = "heading", 0, "run_in"
        block.run_in = name


_PERSON_NAME = re.compile(
    rf"^(?:{_NAME_WORD}|[A-Z]\.)(?:\s+(?:{_NAME_WORD}|[A-Z]\.|(?:van|von|de|der|da|di|le|la)))*"
    rf"\s+{_NAME_WORD}(?:,?\s+(?:Jr|Sr)\.?)?$"
)
# Labels of a paper's fields, set before their value ("Keywords: ..."): never a section of the text.
_FIELD_LABEL = re.compile(
    r"^\s*(?:key\s*words?|index terms|affiliations?|address(?:es)?|corresponding authors?|"
    r"e-?mail|received|accepted|published|citation|acm reference format|"
    r"jel(?: classifications?)?|"
    r"pacs(?: numbers)?|msc|facilit(?:y|ies)|software|data availability statement|"
    r"关键词|关键字|中图分类号|文献标识码)\s*[:：]",
    re.IGNORECASE,
)
_TOC_ENTRY = re.compile(r"^(?P<title>.*?\S)\s*(?:\.\s*){2,}\s*\d{1,4}$|^(?P<short>.*[^\d\s.])\s+\d{1,4}$")


def _numeric_row(text: str) -> bool:
    """A row of a table of figures: most of its tokens are numbers."""
    tokens = text.split()
    numbers = sum(bool(re.fullmatch(r"[-+±]?\d[\d.,%]*|[-–—]", t)) for t in tokens)
    return numbers >= 3 and numbers >= 0.4 * len(tokens)


def _toc_entries(blocks: list[Block]) -> set[int]:
    """Block indices of table-of-contents lines: a title and a page number whose title is printed again as a
    heading later on."""
    later = {re.sub(r"\W+", "", strip_numbering(b.text).casefold()) for b in blocks if b.role == "heading"}
    found = set()
    for i, block in enumerate(blocks):
        match = _TOC_ENTRY.match(block.text.strip()) if block.n_lines <= 2 else None
        title = (match.group("title") or match.group("short")) if match else None
        if title and re.sub(r"\W+", "", strip_numbering(title).casefold()) in later:
            found.add(i)
    return found


def _row_mates(blocks: list[Block]) -> set[int]:
    """Short blocks that share their row with another short block in the same half of the page: a table's
    cells, a figure's labels. A heading has its row to itself."""
    by_page: dict[int, list[int]] = {}
    extent: dict[int, list[float]] = {}
    for i, block in enumerate(blocks):
        if block.bbox is None or block.page is None:
            continue
        box = extent.setdefault(block.page, [block.bbox[0], block.bbox[2]])
        box[0], box[1] = min(box[0], block.bbox[0]), max(box[1], block.bbox[2])
        if len(block.text) <= 80:
            by_page.setdefault(block.page, []).append(i)
    mates: set[int] = set()
    for page, indices in by_page.items():
        middle = sum(extent[page]) / 2
        for n, i in enumerate(indices):
            for j in indices[n + 1 :]:
                a, b = blocks[i].bbox or (0, 0, 0, 0), blocks[j].bbox or (0, 0, 0, 0)  # both set: see above
                if ((a[0] + a[2]) / 2 < middle) == ((b[0] + b[2]) / 2 < middle) and _side_by_side(a, b):
                    mates.update((i, j))
    return mates


def _not_a_section(blocks: list[Block], index: int) -> bool:
    """Short emphasised lines that name no part of the text: a person (in a list of names, not before a
    paragraph), a field's label, a table's row label, the first cell of a table under its caption."""
    block = blocks[index]
    following = next((b for b in blocks[index + 1 : index + 3] if b.role != "noise"), None)
    previous = next((b for b in reversed(blocks[max(0, index - 2) : index]) if b.role != "noise"), None)
    in_a_list = following is None or len(following.text) < 120
    under_table_caption = (
        previous is not None
        and previous.role == "caption"
        and re.match(r"(?i)\s*(?:table|tab\.|表)", previous.text)
        and following is not None
        and prose_share(following.text) < 0.5
    )
    return (
        (_looks_like_person(block.text, block.page) and in_a_list)
        or bool(_FIELD_LABEL.match(block.text))
        or (following is not None and _numeric_row(following.text))
        or bool(under_table_caption)
    )


def _looks_like_person(text: str, page: int | None) -> bool:
    """A person's name on a line of its own ("Benjamin J. Lengerich", "Juan Jose Carmona"): a byline or a
    contributor list. A name with an initial anywhere, any capitalised two to four words on the first pages."""
    stripped = text.strip().rstrip("*†‡0123456789,")
    if not _PERSON_NAME.match(stripped) or len(stripped.split()) > 4 or canonical_section(stripped):
        return False
    return re.search(r"\b[A-Z]\.", stripped) is not None or (page or 1) <= 2


def _closing_heading_typeset(block: Block, body_size: float) -> bool:
    """A References or Acknowledgements heading stands on its own line at least near body size (a table's
    small column header "Reference" does not). Formats without typography pass: their style said heading."""
    if not block.size or not body_size:
        return True
    small_caps = block.text.isupper() and block.size >= 0.7 * body_size  # IEEE sets "REFERENCES" in small caps
    bold_small = block.bold and block.size >= 0.8 * body_size  # some journals set headings small, bold
    return block.n_lines <= 2 and (block.size >= 0.85 * body_size or small_caps or bold_small)


_REF_YEAR = re.compile(r"(?<!\d)(?:1[89]|20)\d{2}[a-z]?(?!\d)")
_REF_LABEL = re.compile(r"^\s*(?:\[\d{1,4}\]|\(\d{1,4}\)|\d{1,4}\.\s|\d{1,4}\s+[A-Z\u4e00-\u9fff])")
_REF_MARKS = re.compile(
    r"(?i:et al\b|\bdoi\b|arxiv|\bpp?\.\s*\d|\bvol\.|\bproc\.|\bin:|journal|conference|"
    r"proceedings)|\[[JMCDRPSNZ]\]|\d+\s*\(\d+\)|\d+\s*[:,]\s*\d+\s*[-\u2013]\s*\d+|"
    r"\b[A-Z][A-Za-z'\u00c0-\u024f-]+,\s+(?:[A-Z]\.\s*){1,3}|\b(?:[A-Z]\.\s*){1,3}[A-Z][a-z]+"
)
_ACKNOWLEDGING = re.compile(
    r"thank|grateful|gratitude|acknowledg|indebted|apprecia|fund|grant|support|sponsor|"
    r"fellowship|award|contribution|feedback|helpful|discussion|assist|谢|资助|基金|支持",
    re.IGNORECASE,
)


def prose_share(text: str) -> float:
    """Share of the words that are lower-case words of three or more letters: high in running prose, low in
    reference entries (names, initials, numbers) and table cells."""
    words = [w.strip(".,;:()[]\"'") for w in text.split()]
    if not words:
        return 0.0
    return sum(1 for w in words if len(w) >= 3 and w.isalpha() and w.islower()) / len(words)


def looks_like_reference_entry(text: str) -> bool:
    """One or more bibliography entries: a year, label or DOI with a second bibliographic mark, and no prose."""
    if cjk_ratio(text) > 0.3:
        return bool(_REF_YEAR.search(text) or _REF_LABEL.match(text)) and bool(
            _REF_MARKS.search(text) or "，" in text or "." in text
        )
    anchored = _REF_YEAR.search(text) or _REF_LABEL.match(text) or re.search(r"\bdoi\b|10\.\d{4,}/", text, re.I)
    return bool(anchored) and len(_REF_MARKS.findall(text)) >= 1 and prose_share(text) < 0.6


def is_running_prose(text: str) -> bool:
    """A paragraph of body text, which no reference list holds."""
    return (
        len(text) >= 200
        and not _REF_LABEL.match(text)
        and not looks_like_reference_entry(text)
        and (prose_share(text) >= 0.6 or (cjk_ratio(text) > 0.3 and "。" in text))
    )


def confirm_closing_headings(blocks: list[Block]) -> None:
    """Keep a References or Acknowledgements heading only when what follows it is what it claims.

    A reference list must follow a References heading (most of the text up to the next heading reads as
    entries, or it parses as a numbered list); acknowledging text must follow Acknowledgements. Otherwise the
    word was a misread (a table column header, a cross-reference) and the block goes back to the body."""
    for i, block in enumerate(blocks):
        canonical = canonical_section(block.text) if block.role == "heading" else None
        if canonical not in NOT_INDEXED_SECTIONS or (numbering_depth(block.text) and block.level >= 2):
            continue
        following: list[Block] = []
        for later in blocks[i + 1 : i + 60]:
            if later.role == "heading":
                break
            if later.role == "body":
                following.append(later)
        if canonical == "references":
            claimed = _reads_as_reference_list(following)
        else:  # (in two columns the first block may still be the other column's paragraph)
            claimed = any(_ACKNOWLEDGING.search(b.text) for b in following[:3])
        if not claimed and block.evidence in ("numbered", "outline") and numbering_depth(block.text):
            block.evidence = "named"  # "6 References" on how to cite, followed by "7 ...": a section of the text
        elif not claimed:
            block.role, block.level = "body", 0


def _reads_as_reference_list(blocks: list[Block]) -> bool:
    """Entries, not prose: most text in entry-like blocks, a numbered list, or (entries broken into line-sized
    blocks) a year every few hundred characters in text that is mostly names, titles and numbers."""
    if not blocks:
        return False
    texts = [b.text for b in blocks[:30]]
    total = sum(len(t) for t in texts)
    entry_chars = sum(len(t) for t in texts if looks_like_reference_entry(t))
    if entry_chars >= 0.5 * total:
        return True
    joined = "\n".join(texts)
    if len(_sequential_labels(joined)) >= 3 and not is_running_prose(texts[0]):
        return True
    years = len(_REF_YEAR.findall(joined))
    return years >= 3 and years * 400 >= len(joined) and prose_share(joined) < 0.5


def join_lines(lines: Iterable[str]) -> str:
    """Join the lines of one paragraph, undoing end-of-line hyphenation."""
    out = ""
    for line in lines:
        line = re.sub(r"\s+", " ", line).strip()
        if not line:
            continue
        if not out:
            out = line
        elif re.search(r"[^\W\d_][-\u2010\u00ad]$", out[-3:]) and line[0].islower():  # the tail only: a
            out = out[:-1] + line  # long block stays linear
        elif re.search(r"[A-Z]{2}[-\u2010\u00ad]$", out[-3:]) and re.match(r"[A-Z]{2,}\b", line):
            out = out[:-1] + line  # a heading in capitals broken across lines ("SO-" "LUTION")
        elif is_cjk(out[-1]) and is_cjk(line[0]):
            out += line
        else:
            out += " " + line
    return out


def reference_blocks(blocks: list[Block]) -> list[Block]:
    """Body blocks of the reference list: after a References heading, until an indexed section starts;
    without such a heading, a trailing run of blocks numbered [1], [2], ... (APS and similar styles)."""
    found = _blocks_under_references_heading(blocks)
    return found if found else _trailing_numbered_list(blocks)


_LIST_START = re.compile(r"(?:^|(?<=\s))(?:\[1\]|\(1\)|1\.)\s+[A-Z\u00c0-\u024f]")


def _trailing_numbered_list(blocks: list[Block]) -> list[Block]:
    """Blocks in the second half that hold entries [1], [2], ... in order (an APS-style list without heading).
    A numbered run whose entries do not read as bibliography (the steps of a procedure, the clauses of a rule)
    is body text: the search goes on after it; so is running prose between the entries."""
    i = int(len(blocks) * 0.5)
    while i < len(blocks):
        start = _LIST_START.search(blocks[i].text) if blocks[i].role == "body" else None
        if start is None or start.start() >= 300:
            i += 1
            continue
        tail = [k for k in range(i, len(blocks)) if blocks[k].role in ("body", "caption", "reference")]
        offsets, joined = [], ""
        for n, k in enumerate(tail):
            offsets.append(len(joined))
            joined += (blocks[k].text[start.start() :] if n == 0 else blocks[k].text) + "\n"
        labels = _sequential_labels(joined)
        if len(labels) < 3:
            i += 1
            continue
        run = [k for k, offset in zip(tail, offsets) if offset <= labels[-1][1]]
        run_end = offsets[len(run)] if len(run) < len(offsets) else len(joined)
        if not _entries_read_as_bibliography(joined[:run_end], labels):
            i = run[-1] + 1
            continue
        # running prose inside the run is the body's other column (a two-column page sets the list's start
        # beside the end of the text), not a reference: it stays body text
        entries = [k for k in run if not _prose_inside_list(blocks[k].text)]
        for k in entries:
            blocks[k].role = "reference"  # kept out of the chunks, as under a heading
        return [blocks[k] for k in entries]
    return []


def _prose_inside_list(text: str) -> bool:
    """A paragraph amid the entries of a list found without a heading. The bar is lower than is_running_prose's
    (half the words lower-case instead of 60%): such a list is weaker evidence than a heading, and a physics
    paragraph thick with acronyms and citations reads at 0.5-0.6, the non-entry blocks of real lists at most 0.42
    over the shared corpus."""
    return (
        len(text) >= 200
        and not _REF_LABEL.match(text)
        and not looks_like_reference_entry(text)
        and (prose_share(text) >= 0.5 or is_running_prose(text))
    )


MAX_ENTRY_CHARS = 1500  # longer than any bibliography entry: a numbered paragraph of a document


def _entries_read_as_bibliography(joined: str, labels: list[tuple[int, int, int]]) -> bool:
    """Whether at least half the numbered entries of ``joined`` read as bibliography entries (marks of a
    reference, or a year in text that is not prose). Over the shared corpus the real headingless lists score
    0.74-1.0 and the numbered steps, clauses and feature lists taken for them before 0-0.25."""
    starts = [label_start for _, label_start, _ in labels] + [len(joined)]
    entries = [joined[a:b] for a, b in zip(starts, starts[1:])]
    reading = sum(
        len(e) <= MAX_ENTRY_CHARS
        and (looks_like_reference_entry(e) or (bool(_REF_YEAR.search(e)) and prose_share(e) < 0.4))
        for e in entries
    )
    return reading * 2 >= len(entries)


def _blocks_under_references_heading(blocks: list[Block]) -> list[Block]:
    """Blocks of the list under a References heading; running prose ends it (the body resumes there)."""
    inside, found = False, []
    for block in blocks:
        if block.role == "heading":
            canonical = canonical_section(block.text)
            if (
                canonical == "references"
                and not (numbering_depth(block.text) and block.level >= 2)
                and block.evidence != "named"
            ):
                inside = True
            elif inside and (canonical is not None or numbering_depth(block.text)):
                inside = False  # acknowledgements, appendices, a new chapter: the list is over
            continue
        if inside and block.role in ("body", "reference"):
            if block.role == "body" and is_running_prose(block.text):
                inside = False
                continue
            block.role = "reference"
            found.append(block)
    return found


_ENTRY_STYLES = (
    r"\[{n}\]\s*",
    r"\({n}\)\s*",
    r"(?:^|(?<=\s)){n}\.\s+(?=\S)",
    r"(?:^|(?<=\n)){n}\s+(?=[A-Z\u4e00-\u9fff])",
)


def _sequential_labels(text: str) -> list[tuple[int, int, int]]:
    """(number, label start, text start) of entries numbered 1, 2, 3 ... in the style that runs longest."""
    best: list[tuple[int, int, int]] = []
    for style in _ENTRY_STYLES:
        labels, pos, n, gaps = [], 0, 1, 0
        while True:
            match = re.compile(style.format(n=n)).search(text, pos)
            if match is None and n > 1 and gaps < 2:  # an entry missing from the list (or unreadable)
                match = re.compile(style.format(n=n + 1)).search(text, pos)
                if match is not None:
                    n, gaps = n + 1, gaps + 1
            if match is None or (n == 1 and match.start() > 20):
                break
            labels.append((n, match.start(), match.end()))
            pos, n = match.end(), n + 1
        if len(labels) > len(best):
            best = labels
    return best if len(best) >= 3 else []


def _sequential_entries(text: str) -> list[tuple[int, str]]:
    labels = _sequential_labels(text)
    return [
        (num, text[body : (labels[i + 1][1] if i + 1 < len(labels) else len(text))].strip())
        for i, (num, _, body) in enumerate(labels)
    ]


def reference_entries(blocks: list[Block]) -> tuple[list[tuple[int, str]], bool]:
    """(number, raw text) of each reference-list entry, and whether the list is numbered
    (an author-year list is numbered here by position)."""
    texts = [re.sub(f"[{SUP_OPEN}{SUP_CLOSE}]", " ", b.text).strip() for b in reference_blocks(blocks)]
    if not texts:
        return [], False
    joined = "\n".join(texts)
    first = _LIST_START.search(joined)
    numbered = _sequential_entries(joined[first.start() :] if first and first.start() < 300 else joined)
    if numbered:
        return numbered, True
    entries: list[str] = []
    for text in texts:  # author-year lists: one block per entry, or entries run together in a block
        parts = re.split(r"(?<=[.)])\s+(?=[A-Z][A-Za-z'\u00c0-\u024f-]+,\s+(?:[A-Z]\.\s*)+)", text)
        entries.extend(p.strip() for p in parts if len(p.strip()) > 20)
    return [(i, text) for i, text in enumerate(entries, start=1)], False


_UNIT_BEFORE = re.compile(r"(?:^|[\s(/·])(?:[munpkMG]?m|[munpk]?s|[mk]?g|mol|K|eV|Hz|[mμ]?L|W|J|Pa|A|V|cm|mm|nm|km)$")


def _numbers_of(marker: str) -> list[int]:
    """Numbers a citation marker stands for: "1,3-5" is 1, 3, 4, 5 (ranges capped at 50 numbers)."""
    numbers: list[int] = []
    for part in re.split(r"\s*,\s*", marker.strip(" ,")):
        bounds = re.split(r"\s*[\u2013\u2014-]\s*", part)
        if not all(b.isdigit() for b in bounds) or not 1 <= len(bounds) <= 2:
            return []
        lo, hi = int(bounds[0]), int(bounds[-1])
        if hi < lo or hi - lo > 50:
            return []
        numbers.extend(range(lo, hi + 1))
    return numbers


def _is_running_paragraph(block: Block) -> bool:
    """Body prose, as opposed to title, author and affiliation lines of the front matter."""
    return (
        block.role == "body"
        and len(block.text) >= 250
        and block.text.count(".") >= 2
        and not re.search(r"@|universit|institut|department|laborator", block.text, re.IGNORECASE)
    )


SUP_OPEN, SUP_CLOSE = "\u2983", "\u2984"  # brackets around superscript digits until they are judged
_SUPERSCRIPT_GROUP = re.compile(f"{SUP_OPEN}([^{SUP_CLOSE}]*){SUP_CLOSE}")
_CITING_WORD = re.compile(r"(?:^|[\s(])([A-Za-z\u00c0-\u024f][A-Za-z\u00c0-\u024f'\u2019-]{2,})$")
_CITING_PUNCT = re.compile(
    r"[A-Za-z\u00c0-\u024f]{2}"
    r"(?:[)\]\u201d\u2019\"]?[.,;:?!][\u201d\u2019\"]?|[\u201d\u2019\"])$"
)
_MATH_WORDS = frozenset("sin cos tan cot sec csc sinh cosh tanh exp log ln lg max min det tr arg lim sup inf".split())
_BRACKET_CITATION = re.compile(r"\[\d{1,3}(?:\s*[,\u2013\u2014-]\s*\d{1,3})*\]")


def _footnote_numbers(blocks: list[Block]) -> set[tuple[int | None, str]]:
    """(page, number) of footnotes: a block that opens with a raised number is the note itself."""
    notes = set()
    for block in blocks:
        match = re.match(f"\\s*{SUP_OPEN}\\s*(\\d{{1,3}})\\s*{SUP_CLOSE}", block.text)
        if match:
            notes.add((block.page, match.group(1)))
    return notes


def _looks_like_byline(text: str) -> bool:
    """Author and affiliation lines: short, mostly capitalised words, no sentence in them."""
    words = re.findall(r"[^\W\d_]+", text)
    if not words or len(text) > 300 or re.search(r"[a-z]{3,}\.\s+[A-Z]", text):
        return False
    return sum(w[0].isupper() for w in words) / len(words) > 0.6


def resolve_superscripts(blocks: list[Block], max_reference: int) -> None:
    """Turn raised citation numbers into "[1,2]"; anything else stays as typeset.

    A raised number counts as a citation only in a document with a numbered reference list that does not
    cite with bracketed numbers elsewhere, outside the
    front matter and author lines, right after a word of three or more Latin letters or after punctuation
    that closes a word (so not after digits, units, Greek or one-letter variables: exponents), when it is
    not the number of a footnote on that page, and when every number it stands for is in the list.
    """
    footnotes = _footnote_numbers(blocks)
    bracketed = sum(len(_BRACKET_CITATION.findall(b.text)) for b in blocks if b.role not in ("reference", "title"))
    if bracketed >= 3:
        max_reference = 0  # the paper cites with [n]: raised numbers are footnotes, exponents or isotopes
    front_matter = True
    for block in blocks:
        if block.role == "heading" or (block.page or 1) > 1 or _is_running_paragraph(block):
            front_matter = False
        if SUP_OPEN not in block.text:
            continue
        byline = front_matter or _looks_like_byline(block.text)

        def judge(match, text=block.text, page=block.page, skip=byline):
            inner = match.group(1).strip(" ,")
            before = re.sub(f"[{SUP_OPEN}{SUP_CLOSE}]", "", text[: match.start()]).rstrip()
            numbers = _numbers_of(inner)
            word = _CITING_WORD.search(before)
            citation = (
                max_reference > 0
                and not skip
                and numbers
                and max(numbers) <= max_reference
                and not (len(numbers) == 1 and (page, str(numbers[0])) in footnotes)
                and ((word and word.group(1).lower() not in _MATH_WORDS) or _CITING_PUNCT.search(before))
                and not _UNIT_BEFORE.search(before)
            )
            if citation:
                return "[" + re.sub(r"\s*([,\u2013\u2014-])\s*", r"\1", inner) + "]"
            return inner

        block.text = _SUPERSCRIPT_GROUP.sub(judge, block.text)


class PageTextBuilder:
    """Builds one page text from blocks and records each block's offset."""

    SEPARATOR = "\n\n"

    def __init__(self, page: int | None):
        self.page = page
        self.parts: list[str] = []
        self.length = 0

    def add(self, block: Block) -> None:
        if self.parts:
            self.parts.append(self.SEPARATOR)
            self.length += len(self.SEPARATOR)
        block.page, block.offset = self.page, self.length
        self.parts.append(block.text)
        self.length += len(block.text)

    def text(self) -> str:
        return "".join(self.parts)


_BANNER = re.compile(
    r"^(?:physical review|journal of|proceedings of|ieee transactions|transactions on|"
    r"acm transactions|"
    r"annals of|advances in|letters in|nature [a-z]+$|science advances)|\b(?:vol\.|volume \d|issn|"
    r"doi:|https?://|www\.|©|copyright|arxiv:|preprint|submitted to|accepted for|received \d|"
    r"published online|available online|draft version|typeset using|front cover)|"
    r"^(?:universidade|universidad|university of|universit[éeà]|université)\b[^.]{0,60}$",
    re.IGNORECASE,
)


def _side_by_side(a: tuple, b: tuple) -> bool:
    """Two boxes on one text row: their vertical spans overlap by half the smaller height, and they do not
    overlap horizontally."""
    overlap = min(a[3], b[3]) - max(a[1], b[1])
    smaller = max(min(a[3] - a[1], b[3] - b[1]), 1.0)
    return overlap >= 0.5 * smaller and (a[2] <= b[0] or b[2] <= a[0])
