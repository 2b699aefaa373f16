"""Identifiers and dates: the DOI, the arXiv id and the publication year read from a paper's first pages.

May import: no module of the package.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

# A DOI may hold "<" and ">" (a SICI: 10.1002/(SICI)1097-4636(199706)35:4<517::AID-JBM12>3.0.CO;2-B): a bracket
# pair holding "number:" belongs to it; any other "<" ends it (an HTML tag after a DOI).
_DOI = re.compile(r"\b(10\.\d{4,9}/(?:[^\s\"<>{}]|<\d+:[^\s\"<>{}]*>)+)", re.IGNORECASE)


_ARXIV_ID = re.compile(r"(?:arxiv[:\s]*|^|/)(\d{2})(\d{2})\.\d{4,5}(?:v\d+)?", re.IGNORECASE)


_DATED_YEAR = re.compile(
    r"(?:©|\(c\)|copyright|published|received|accepted|available online|submitted)"
    r"[^\n]{0,60}?\b((?:19|20)\d{2})\b",
    re.IGNORECASE,
)


_ARXIV_FULL = re.compile(r"arxiv[:\s]*(\d{4}\.\d{4,5})(?:v\d+)?", re.IGNORECASE)


_DOI_YEAR = re.compile(r"[./(_-]((?:19|20)\d{2})[./)_-]")


_CN_JOURNAL = re.compile(r"《([^》]{2,30})》|^([\u4e00-\u9fff]{2,12}(?:学报|杂志|期刊|研究|通讯|科学))", re.MULTILINE)


_BANNER_YEAR = re.compile(r"(?<![\d./-])((?:19|20)\d{2})(?![\d/-])")


_CITATION_YEAR = re.compile(r"(?:et al\.?|and \w+|&\s*\w+),?\s*\(?$", re.IGNORECASE)


def _doi_from_text(text: str) -> str | None:
    """The DOI printed before any reference list: one labelled "doi" or "doi.org" first, else the first one."""
    cut = re.search(r"\n\s*(?:references|bibliography|参考文献)\s*\n", text, re.IGNORECASE)
    text = join_broken_dois(text[: cut.start()] if cut else text)
    labelled = re.search(r"(?:\bdoi\b\s*[:.]?\s*|doi\.org/)(10\.\d{4,9}/\S+)", text, re.IGNORECASE)
    return find_doi(labelled.group(1)) if labelled else find_doi(text)


# A DOI cut at a line end after ".", "-", "/" or "_" continues on the next line with a piece that has a digit
# and no capital at its start ("10.1371/journal." + "pone.0197919"); running text after a DOI does not.
_BROKEN_DOI = re.compile(r"(10\.\d{4,9}/[^\s\"<>{}]*[./_-])\s+(?=[a-z0-9])([^\s\"<>{}]*\d[^\s\"<>{}]*)")


def join_broken_dois(text: str) -> str:
    return _BROKEN_DOI.sub(lambda m: m.group(1) + m.group(2), text or "")


def find_doi(text: str) -> str | None:
    match = _DOI.search(text or "")
    if not match:
        return None
    doi = match.group(1)
    # brackets belong to the DOI only when balanced inside it (10.1016/0021-9991(86)90196-1)
    while doi and doi[-1] in ".,;:)]}>'\"”’":
        if doi[-1] in ")]}" and doi.count({")": "(", "]": "[", "}": "{"}[doi[-1]]) >= doi.count(doi[-1]):
            break
        doi = doi[:-1]
    return doi.lower() if len(doi) > 8 else None


def arxiv_doi(text: str) -> str | None:
    """The DataCite DOI of an arXiv id printed in the text (the file name does not count); an id cut at a line end
    after its dot ("arXiv:2301." / "05883v2") is joined."""
    text = re.sub(r"(arxiv[:\s]*\d{4}\.)\s+(?=\d{4,5}(?:v\d+)?\b)", r"\1", text or "", flags=re.IGNORECASE)
    match = _ARXIV_FULL.search(text)
    if not match:
        return None
    arxiv_id = match.group(1)
    yy, mm = int(arxiv_id[:2]), int(arxiv_id[2:4])
    if not (7 <= yy <= (time.gmtime().tm_year % 100) + 1 and 1 <= mm <= 12):
        return None
    return f"10.48550/arxiv.{arxiv_id}"


def _banner_year(banner: str, plausible) -> int | None:
    """The latest year printed in page 1's header and footer lines, ignoring citations ("Smith et al., 2010")."""
    years = [
        int(m.group(1))
        for m in _BANNER_YEAR.finditer(banner)
        if plausible(int(m.group(1))) and not _CITATION_YEAR.search(banner[max(0, m.start() - 25) : m.start()])
    ]
    return max(years) if years else None


# notices a repository or reprint service adds to page 1: their dates are the download's, not the paper's
_DISCLAIMER = re.compile(
    r"\bdownload(?:ed)?\b|digiti[sz]ed|reprint service|terms (?:and|&) conditions|"
    r"for personal use|all use subject to|this (?:content|article|copy|pdf) was|"
    r"uploaded by|digital archive",
    re.IGNORECASE,
)


# the paper's own citation line: "Z. Naturforsch. 54a, 272-276 (1994)", "Phys. Rev. Lett. 98, 123001 (2007)"
_CITATION_LINE_YEAR = re.compile(
    r"\b\d{1,4}\s*[a-zA-Z]?\s*(?:\(\d{1,3}\))?\s*[,:]\s*(?:pp?\.\s*)?"
    r"(?:[a-zA-Z]?\d{1,6}\s*[-–]\s*[a-zA-Z]?\d{1,6}|e?\d{3,8})\s*[,;]?\s*"
    r"\(((?:19|20)\d{2})\)"
)


def without_disclaimers(text: str) -> str:
    """The text without the paragraphs and lines that are repository or reprint notices."""
    return "\n".join(part for part in re.split(r"\n", text or "") if not _DISCLAIMER.search(part))


def guess_year(
    front_text: str, raw_meta: dict, path: str, doi: str | None, banner: str = "", head: str = ""
) -> int | None:
    """The paper's citation line on page 1, else its dated lines and header/footer (notices of downloads and
    reprints do not count), else the DOI or arXiv id, else the file's dates."""
    this_year = time.gmtime().tm_year + 1
    plausible = lambda y: 1900 <= y <= this_year  # noqa: E731
    front_text, banner = without_disclaimers(front_text), without_disclaimers(banner)
    cited = next(
        (
            int(m.group(1))
            for m in _CITATION_LINE_YEAR.finditer(without_disclaimers(head))
            if plausible(int(m.group(1)))
        ),
        None,
    )
    if cited:
        return cited
    dated = [int(m.group(1)) for m in _DATED_YEAR.finditer((front_text or "")[:6000]) if plausible(int(m.group(1)))]
    printed = dated + ([y] if (y := _banner_year(banner, plausible)) else [])
    if printed:
        return max(printed)  # received, accepted, published, ©: the publication is the latest
    if doi:
        arxiv = re.match(r"10\.48550/arxiv\.(\d{2})\d{2}\.", doi)
        if arxiv:
            return 2000 + int(arxiv.group(1))
        embedded = _DOI_YEAR.search(doi)
        if embedded and plausible(int(embedded.group(1))):
            return int(embedded.group(1))
    for source in (front_text, Path(path).name):
        match = _ARXIV_ID.search(source or "")
        if match and 7 <= int(match.group(1)) <= this_year % 100 and 1 <= int(match.group(2)) <= 12:
            return 2000 + int(match.group(1))
    if isinstance(raw_meta.get("year"), int):
        return raw_meta["year"]
    created = re.match(r"D:((?:19|20)\d{2})", raw_meta.get("creationDate") or "")
    return int(created.group(1)) if created else None
