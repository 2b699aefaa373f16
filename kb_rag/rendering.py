"""Rendering: the Markdown a model reads and the view a host card draws, fitted to a budget.

May import: config, notices, records.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from .config import Field, KBError, _is_integer, _opt_int
from .notices import stale_notice
from .records import CitationRecord, FileEntry, HitRecord

# What a model reads for an answer, made once for every host. A request with `render: "markdown"` gets, beside its
# data, `markdown` (short, escaped, fitted into `render_budget` characters) and, for search and rag, `view`: the
# same sources as data, fitted the same way, for a host's card. The DSH plugin adds only its session lines, the
# MCP server sends the Markdown as it is, so both show the same text (tests/fixtures/markdown-cases.json holds it;
# docs/OUTPUT-FORMAT.md describes it). Everything here is pure: an answer in, text out.

HOST_RENDER_BUDGET = 8_000  # characters of Markdown a search result aims at (DSH trims older results above 8,192)
MIN_RENDER_BUDGET, MAX_RENDER_BUDGET = 500, 1_000_000
# Ways to shorten a search result until it fits the budget, mildest first: (snippet characters or None for
# whole snippets, citations shown per passage). After the last, trailing passages are dropped.
HOST_FIT_STEPS = ((None, 8), (None, 4), (400, 4), (400, 2), (250, 2), (150, 2), (90, 2))
RENDER_TITLE_CHARS = 300  # a longer title (a parser's mistake, a hostile file) is cut: it must not eat the budget
RENDER_LIST_ROWS = {"files": 15, "attachments": 15, "groups": 15, "errors": 10, "jobs": 20, "sources": 20}

# Fields a host adds to a request (every command with a renderer accepts them).
HOST_FIELDS = (
    Field(
        "render",
        "string",
        "none",
        '`"markdown"`: the answer also carries `markdown`, the text a model reads (docs/OUTPUT-FORMAT.md), and for '
        "search and rag `view`, the same sources as data for a host's card",
    ),
    Field(
        "render_budget",
        "integer",
        f"`{HOST_RENDER_BUDGET}`",
        f"with `render`: the characters the Markdown aims at ({MIN_RENDER_BUDGET}-{MAX_RENDER_BUDGET}); "
        "snippets, then citations, then trailing passages are shortened until it fits",
    ),
    Field(
        "kb_root_from",
        "string",
        "none",
        "how the host chose `kb_root`, in the host's words; an answer read from no library says this instead of "
        "the engine's own rule",
    ),
)

# Characters never shown as they are in anything a person or a model reads (the CLI, progress lines, cite's text,
# the Markdown, a card's view): C0 and C1 controls and DEL (a terminal obeys an ESC sequence, a carriage return
# rewrites the line, a newline forges one), the bidirectional marks, embeddings, overrides and isolates that reorder
# or hide what follows them (a file name ending in U+202E "gpj.md" reads "dm.jpg"), and the line and paragraph
# separators. Letters of right-to-left scripts stay as they are. Each is shown as its escape (\x1b, \u202e), so
# the reader sees that it is there; the library and the protocol's data fields keep the real text.
_UNSHOWN = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_UNSHOWN_SPACES = "".join(ch for ch in map(chr, range(0x2030)) if ch.isspace() and _UNSHOWN.match(ch))
_ESCAPE_NAMES = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}
_MARKDOWN_SPECIAL = re.compile(r"[\\`*_\[\]<]")


def _escape(ch: str) -> str:
    return _ESCAPE_NAMES.get(ch) or (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")


def visible_text(text, keep: str = "") -> str:
    """``text`` with every unshown character but those in ``keep`` written as its escape: ESC as ``\\x1b``, a
    right-to-left override as ``\\u202e``, a newline as ``\\n``."""
    text = "" if text is None else str(text)
    if not _UNSHOWN.search(text):
        return text
    return _UNSHOWN.sub(lambda m: m.group(0) if m.group(0) in keep else _escape(m.group(0)), text)


def visible_json(text: str) -> str:
    """JSON text with the unshown characters in its strings written as ``\\u`` escapes: a JSON reader gets the same
    values, a terminal shows them safely (json.dumps escapes C0 controls, but leaves C1 controls and the
    bidirectional ones as they are). A raw newline is the layout's own: json.dumps escapes those in strings."""
    return _UNSHOWN.sub(lambda m: m.group(0) if m.group(0) == "\n" else f"\\u{ord(m.group(0)):04x}", text)


def plain_line(text) -> str:
    """``text`` as one line: whitespace runs (line breaks too) made one space, other unshown characters shown as
    escapes."""
    return " ".join(visible_text(text, keep=_UNSHOWN_SPACES).split())


def md_text(text) -> str:
    """Running text with the characters Markdown would read as markup escaped."""
    return _MARKDOWN_SPECIAL.sub(lambda m: "\\" + m.group(0), plain_line(text))


def md_code(text) -> str:
    """A code span (file names, paths, ids): a backtick inside would end it early."""
    return "`" + plain_line(text).replace("`", "'") + "`"


def cut_text(text, limit: int | None) -> str:
    """``text`` as one line of at most ``limit`` characters, cut at a word where one is near, with an ellipsis."""
    line = plain_line(text)
    if limit is None or len(line) <= limit:
        return line
    head = line[:limit]
    space = head.rfind(" ")
    return (head[:space] if space > limit * 0.6 else head).rstrip(" …") + "…"


def doi_link(doi) -> str | None:
    """The https://doi.org/ address of a DOI, percent-encoded wherever a DOI may hold what a URL or a Markdown
    link cannot (SICI DOIs' ``<`` and ``>``, brackets, spaces, ``#``, ``?``, non-ASCII letters)."""
    from urllib.parse import quote

    bare = re.sub(r"^https?://(dx\.)?doi\.org/", "", plain_line(doi), flags=re.I)
    return "https://doi.org/" + quote(bare, safe="/:;@!$&'*+,=~") if bare else None


def file_name(path) -> str | None:
    return re.split(r"[\\/]", str(path))[-1] or None if path else None


def author_line(authors, more: bool = False) -> str:
    """Up to three names, then "et al." when there are more (or the list is known to be incomplete)."""
    if not isinstance(authors, list) or not authors:
        return ""
    return ", ".join(str(a) for a in authors[:3]) + (" et al." if len(authors) > 3 or more else "")


def venue_line(venue, volume=None, issue=None, page_range=None) -> str:
    """Where a work appeared, as a reference list writes it: "Journal 18(3): 211-219"."""
    if not venue:
        return ""
    numbers = f"{volume or ''}" + (f"({issue})" if issue else "")
    text = f"{venue} {numbers}".strip()
    return f"{text}: {page_range}" if page_range and numbers else f"{text}, {page_range}" if page_range else text


def page_span(page, page_end, label) -> str:
    """``p.4``, ``pp.4–5``, with the printed page label after it when it differs: ``pp.4–5 (1187)``."""
    if page is None:
        return ""
    text = f"pp.{page}–{page_end}" if page_end is not None and page_end != page else f"p.{page}"
    if label not in (None, "") and str(label) != str(page):
        text += f" ({label})"
    return text


def format_duration(seconds: float) -> str:
    """``42 s``, ``3 min 5 s``, ``2 h 10 min``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def _finite(value) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None


def _listed(value) -> list:
    return value if isinstance(value, list) else []


def _mapping(value) -> dict:
    return value if isinstance(value, dict) else {}


def _lines(*items) -> str:
    """Non-empty lines joined; an item may be a list of lines."""
    out: list[str] = []
    for item in items:
        out.extend(x for x in (item if isinstance(item, list) else [item]) if x is not None)
    return "\n".join(out)


def _some(items: list, kind: str, row: Callable[[Any], str]) -> list[str]:
    """The first rows of a list (RENDER_LIST_ROWS), then how many more there are."""
    limit = RENDER_LIST_ROWS[kind]
    out = [row(item) for item in items[:limit]]
    if len(items) > limit:
        out.append(f"- … and {len(items) - limit} more {kind}")
    return out


def _bullet(label: str, value) -> str | None:
    return None if value in (None, "") else f"- {label}: {value}"


def _counts(counts) -> str | None:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) if isinstance(counts, dict) and counts else None


def _totals(totals) -> str:
    if not isinstance(totals, dict):
        return "nothing to do"
    return ", ".join(f"{k} {v}" for k, v in totals.items() if _finite(v)) or "nothing to do"


def _note(text) -> str | None:
    return f"_Note: {md_text(text)}_" if text else None


# -- search and rag: the view, fitted, and its Markdown --------------------------------------------------------

# A view is what a card shows, so its text fields are shown text (plain_line; a file name keeps its spaces and shows
# every unshown character); ``path``, ``url``, ``zotero_link`` and ids locate things, and keep their real values.


def _shown_line(text) -> str | None:
    return None if text is None else plain_line(text)


def _shown_name(name) -> str | None:
    return None if name is None else visible_text(name)


def _in_library_view(lib: dict) -> dict:
    return {
        "doc_id": lib.get("doc_id"),
        "title": _shown_line(lib.get("title")),
        "doi": _shown_line(lib.get("doi")),
        "url": doi_link(lib.get("doi")),
        "file": _shown_name(file_name(lib.get("path"))),
        "path": lib.get("path"),
    }


def _citation_view(c: CitationRecord) -> dict:
    lib = c.get("in_library")
    return {
        "marker": plain_line(c.get("marker") or (f"[{c['ref']}]" if c.get("ref") is not None else "")),
        "ref": c.get("ref"),
        "title": _shown_line(c.get("title")),
        "text": _shown_line(c.get("text")),
        "doi": _shown_line(c.get("doi")),
        "url": doi_link(c.get("doi")),
        "in_library": _in_library_view(lib) if isinstance(lib, dict) else None,
    }


def _source_view(hit: HitRecord, rank: int) -> dict:
    citations = (
        [_citation_view(c) for c in hit["citations"] if isinstance(c, dict)]
        if isinstance(hit.get("citations"), list)
        else None
    )
    file = hit.get("file") or file_name(hit.get("path"))
    return {
        "rank": rank,
        "doc_id": hit.get("doc_id"),
        "chunk_id": hit.get("chunk_id"),
        "title": cut_text(hit.get("title") or file or "Untitled", RENDER_TITLE_CHARS),
        "url": doi_link(hit.get("doi")),
        "doi": _shown_line(hit.get("doi")),
        "file": _shown_name(file),
        "path": hit.get("path"),
        "authors": [plain_line(a) for a in _listed(hit.get("authors"))],
        "year": hit.get("year"),
        "journal": _shown_line(hit.get("journal")),
        "kind": hit.get("kind"),
        "section": plain_line(hit.get("section")),
        "page": hit.get("page"),
        "page_end": hit.get("page_end"),
        "page_label": hit.get("page_label"),
        "location": plain_line(page_span(hit.get("page"), hit.get("page_end"), hit.get("page_label"))),
        "score": _finite(hit.get("score")),
        "snippet": str(hit.get("snippet") or ""),
        "citations": citations,
        "citations_more": (hit.get("citations_more") or 0) if citations is not None else None,
        "zotero_link": hit.get("zotero_link"),
        **({"picture": hit["picture"]} if isinstance(hit.get("picture"), dict) else {}),
    }


def _related_view(r: dict) -> dict:
    return {
        "doc_id": r.get("doc_id"),
        "title": cut_text(r.get("title") or file_name(r.get("path")) or "Untitled", RENDER_TITLE_CHARS),
        "url": doi_link(r.get("doi")),
        "doi": _shown_line(r.get("doi")),
        "file": _shown_name(file_name(r.get("path"))),
        "authors": [plain_line(a) for a in _listed(r.get("authors"))],
        "year": r.get("year"),
        "reason": _shown_line(r.get("reason")),
        "similarity": _finite(r.get("similarity")),
    }


def _full_view(command: str, answer: dict) -> dict:
    hits = [h for h in _listed(answer.get("evidence" if command == "rag" else "results")) if isinstance(h, dict)]
    notes = answer["notes"] if isinstance(answer.get("notes"), list) else [answer["note"]] if answer.get("note") else []
    return {
        "kind": "kb-sources",
        "tool": f"kb_{command}",  # hosts name their tools kb_<command>
        "query": plain_line(answer.get("query")),
        "mode": answer.get("mode"),
        "depth": answer.get("depth"),
        "score_kind": answer.get("score_kind"),
        "reranker": _shown_line(answer.get("reranker")),
        "cached": answer.get("cached") is True,
        "notes": [plain_line(n) for n in notes],
        "notices": [plain_line(n.get("text")) for n in _listed(answer.get("notices")) if isinstance(n, dict)],
        "lang_note": _shown_line(answer.get("lang_note")),
        # an answer's hits are hit records; read defensively all the same (a host may pass on any engine's answer)
        "total": len(hits),
        "sources": [_source_view(cast(HitRecord, hit), i) for i, hit in enumerate(hits, 1)],
        "related": [_related_view(r) for r in _listed(answer.get("related")) if isinstance(r, dict)],
        "guidance": _shown_line(answer.get("guidance")),
        "omitted": 0,
        "snippet_limit": None,
    }


def _fitted(view: dict, snippet_limit: int | None, citation_limit: int, count: int) -> dict:
    sources = []
    for source in view["sources"][:count]:
        source = dict(source, snippet=cut_text(source["snippet"], snippet_limit))
        if source["citations"] is not None:
            shown = source["citations"][:citation_limit]
            source.update(
                citations=shown, citations_more=source["citations_more"] + len(source["citations"]) - len(shown)
            )
        sources.append(source)
    return dict(view, sources=sources, omitted=len(view["sources"]) - len(sources), snippet_limit=snippet_limit)


def sources_view(command: str, answer: dict, budget: int = HOST_RENDER_BUDGET) -> dict:
    """The view of a search or rag answer, shortened (snippets, then citations, then trailing sources) until its
    Markdown fits ``budget``; the Markdown and a host's card both come from it."""
    view = _full_view(command, answer)
    for snippet_limit, citation_limit in HOST_FIT_STEPS:
        fitted = _fitted(view, snippet_limit, citation_limit, len(view["sources"]))
        if len(sources_markdown(fitted)) <= budget:
            return fitted
    count = len(view["sources"])
    while count > 1:  # still too long at the shortest settings: drop sources from the end
        count -= 1
        fitted = _fitted(view, *HOST_FIT_STEPS[-1], count)
        if len(sources_markdown(fitted)) <= budget:
            break
    return fitted


def _titled(title: str, url: str | None, file: str | None) -> str:
    """A linked title when there is a DOI, else the title in bold followed by the file name."""
    if url:
        return f"[{md_text(title)}]({url})"
    return f"**{md_text(title)}**" + (" " + md_code(file) if file else "")


def _citation_lines(source: dict) -> list[str]:
    citations = source["citations"]
    if citations is None or not (citations or source["citations_more"]):
        return []
    lines = ["   Cited in this passage:"]
    for c in (c for c in citations if c["in_library"]):  # works in the library first: the model can open them
        lib = c["in_library"]
        name = md_text(c["title"] or lib["title"] or c["text"] or "")
        url = c["url"] or lib["url"]
        where = ", " + md_code(lib["file"]) if lib["file"] else ""
        lines.append(
            f"   - {md_text(c['marker'])} {f'[{name}]({url})' if url else name} ✓ in library "
            f"(doc {lib['doc_id']}{where})"
        )
    for c in (c for c in citations if not c["in_library"]):
        name = md_text(cut_text(c["title"] or c["text"] or "", 140))
        url = c["url"]
        lines.append(f"   - {md_text(c['marker'])} {f'[{name}]({url})' if url else name}")
    more = source["citations_more"]
    if more > 0:
        lines.append(f"   - and {more} more cited work{'' if more == 1 else 's'}")
    return lines


def _source_lines(source: dict) -> list[str]:
    byline = " · ".join(
        md_text(x)
        for x in (
            author_line(source["authors"]),
            source["year"],
            source["journal"],
            source["section"],
            source["location"],
        )
        if x not in (None, "")
    )
    lines = [f"{source['rank']}. {_titled(source['title'], source['url'], source['file'])}" + ("\\" if byline else "")]
    if byline:  # after the hard line break above
        lines.append(f"   {byline}")
    if source["snippet"]:
        lines.append(f"   > {md_text(source['snippet'])}")
    lines += _citation_lines(source)
    if source["zotero_link"]:
        lines.append(f"   [open in Zotero]({source['zotero_link']})")
    return lines


def _sources_header(view: dict) -> str:
    what = "evidence passage" if view["tool"] == "kb_rag" else "passage"
    n = view["total"]
    count = f"no {what} found" if n == 0 else f"{n} {what}{'' if n == 1 else 's'}"
    parts = [
        view["mode"],
        view["depth"],
        view["score_kind"] and f"scores: {view['score_kind']}",
        view["reranker"] and f"reranked by {view['reranker']}",
        view["cached"] and "cached",
    ]
    shown = " · ".join(md_text(p) for p in parts if p)
    return f'**Knowledge base: {count}** for "{md_text(view["query"])}"' + (f" ({shown})" if shown else "")


NO_SOURCES_HINT = (
    "Try adding to queries one English sentence stating the answer as a paper would, move years or "
    "authors into filters, or check kb_stats that the library holds documents."
)


def _related_line(r: dict) -> str:
    bits = [
        md_text(x)
        for x in (
            author_line(r["authors"]),
            r["year"],
            r["reason"],
            None if r["similarity"] is None else f"{r['similarity']:.2f}",
        )
        if x not in (None, "")
    ]
    return f"- {_titled(r['title'], r['url'], r['file'])}" + (" · " + " · ".join(bits) if bits else "")


def sources_markdown(view: dict) -> str:
    """The Markdown a model reads for a search or rag view: header, notes, numbered sources, related work,
    guidance. A host adds its own lines right after the first (the header), before the library's notices."""
    out = [_sources_header(view)]
    out += [f"_Library: {md_text(notice)}_" for notice in view["notices"]]
    out += [f"_Note: {md_text(note)}_" for note in view["notes"]]
    if view["lang_note"]:
        out.append(f"_Language: {md_text(view['lang_note'])}_")
    if not view["sources"]:
        out += ["", NO_SOURCES_HINT]
    else:
        out += ["", "**Evidence**"] if view["tool"] == "kb_rag" else [""]
        for source in view["sources"]:
            out += _source_lines(source) + [""]
        omitted = view["omitted"]
        if omitted > 0:
            out += [
                f"_{omitted} more result{'' if omitted == 1 else 's'} left out to keep this short; lower top_k "
                "or narrow the query._",
                "",
            ]
    if view["related"]:
        out += ["**Related work in the library** (pointers, not evidence)", *map(_related_line, view["related"]), ""]
    if view["guidance"]:
        out += ["**How to answer**", md_text(view["guidance"])]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()


# -- the other commands: short summaries ------------------------------------------------------------------------


def _job_started(answer: dict, what: str) -> str:
    job_id = plain_line(answer["job_id"])
    return _lines(
        f"**{what} started as background job `{job_id}`** ({answer.get('pending', '?')} item(s) need work).",
        f"_{md_text(answer['note'])}_" if answer.get("note") else None,
        f'Call kb_status with {{"job_id": "{job_id}"}} to follow it; repeat until its state is done, failed or '
        "cancelled. Do not start another ingest or Zotero import of this library meanwhile.",
    )


def _library_line(answer: dict) -> str | None:
    return f"Library: {md_code(answer['kb_root'])}" if answer.get("kb_root") else None


def _verification_line(check) -> str | None:
    if not isinstance(check, dict):
        return None
    counts = ", ".join(
        f"{check[k]} {k.replace('_', ' ')}"
        for k in ("verified", "no_match", "not_found", "skipped", "failed")
        if check.get(k)
    )
    return f"Metadata checked at Crossref ({check.get('checked', 0)} document(s){': ' + counts if counts else ''})." + (
        f" _{md_text(check['note'])}_" if check.get("note") else ""
    )


def _file_outcome(entry: FileEntry) -> str:
    return (
        str(entry.get("status"))
        + (f" ({entry['reason']})" if entry.get("reason") else "")
        + (f" — {md_text(cut_text(entry['error'], 160))}" if entry.get("error") else "")
    )


def _not_indexed(entry: FileEntry) -> bool:
    return entry.get("status") == "error" or (
        entry.get("status") == "skipped" and (entry.get("reason") != "unchanged" or bool(entry.get("error")))
    )


def render_ingest(answer: dict) -> str:
    if answer.get("job_id"):
        return _job_started(answer, "Ingest")
    files = [cast(FileEntry, f) for f in _listed(answer.get("files")) if isinstance(f, dict)]
    problems = [f for f in files if _not_indexed(f)]
    return _lines(
        f"**{'Metadata refreshed' if answer.get('metadata_only') else 'Ingest finished'}** ({len(files)} file(s)): "
        f"{_totals(answer.get('totals'))}.",
        _note(answer.get("note")),
        _verification_line(answer.get("metadata_verification")),
        "Files not indexed:" if problems else None,
        _some(problems, "files", lambda f: f"- {md_code(file_name(f.get('path')))}: {_file_outcome(f)}"),
        _library_line(answer),
    )


FETCH_SOURCES = {
    "arxiv": "arXiv",
    "publisher": "the publisher",
    "unpaywall": "an open-access copy (Unpaywall)",
    "direct": "the URL",
}


def _fetch_outcome(entry: FileEntry) -> str | None:
    """What the fetched file's ingest means for the model's next step."""
    status = entry.get("status")
    if not status:
        return None
    if status == "duplicate":
        return "The library already held a copy of it: kb_search and kb_rag find that one."
    indexed = status in ("added", "updated", "moved") or (
        status == "skipped" and entry.get("reason") == "unchanged" and not entry.get("previous")
    )
    return (
        "It is in the library now: kb_search and kb_rag can find it."
        if indexed
        else "The PDF was saved but not indexed; see why above."
    )


def render_fetch(answer: dict) -> str:
    got = _mapping(answer.get("fetched"))
    files = [cast(FileEntry, f) for f in _listed(answer.get("files")) if isinstance(f, dict)]
    entry = next((f for f in files if f.get("path") == got.get("path")), files[0] if files else None)
    size = f" ({max(1, round(got['bytes'] / 1024))} KiB)" if _finite(got.get("bytes")) is not None else ""
    url = re.sub(r"[<>\s]", lambda m: f"%{ord(m.group(0)):02X}", str(got["url"])) if got.get("url") else None
    link = doi_link(got.get("doi"))
    indexed = None
    if entry:
        title = f"**{md_text(cut_text(entry['title'], 160))}**, " if entry.get("title") else ""
        indexed = title + _file_outcome(entry)
    return _lines(
        f"**Fetched {md_code(got.get('identifier') or '?')}** from "
        f"{FETCH_SOURCES.get(str(got.get('source')), got.get('source') or 'the web')}{size}.",
        _bullet("Source URL", f"<{url}>" if url else None),
        _bullet("Saved as", md_code(got["path"]) if got.get("path") else None),
        _bullet("Indexed", indexed),
        _bullet(
            "DOI", None if not got.get("doi") else f"[{md_text(got['doi'])}]({link})" if link else md_text(got["doi"])
        ),
        _note(answer.get("note")),
        _fetch_outcome(entry) if entry else None,
        _library_line(answer),
    )


def _missing_attachment(item: dict) -> str:
    name = md_text(cut_text(item.get("title") or item.get("attachment_key") or "?", 80))
    return f"- {name}: {item.get('status')}" + (f" ({item['reason']})" if item.get("reason") else "")


def render_zotero(answer: dict) -> str:
    if answer.get("job_id"):
        return _job_started(answer, "Zotero import")
    items = [i for i in _listed(answer.get("items")) if isinstance(i, dict)]
    missing = [i for i in items if i.get("status") in ("missing", "error")]
    return _lines(
        f"**Zotero {'dry run' if answer.get('dry_run') else 'import'}** ({len(items)} attachment(s)): "
        f"{_totals(answer.get('totals'))}.",
        _note(answer.get("note")),
        "Attachments not imported:" if missing else None,
        _some(missing, "attachments", _missing_attachment),
        f"Zotero database: {md_code(answer['zotero_db'])}" if answer.get("zotero_db") else None,
    )


def job_vectors_left_s(job: dict) -> float | None:
    """Seconds until a job still adding vectors is done, at its rate since its text was indexed."""
    since, done, total = _finite(job.get("text_done")), job.get("phase_done") or 0, job.get("phase_total") or 0
    if since is None or job.get("phase") != "embed" or not done or total <= done:
        return None
    elapsed = max((_finite(job.get("updated")) or time.time()) - since, 1e-3)
    return (total - done) * elapsed / done


def _job_markdown(job: dict) -> str:
    progress = f" {job.get('done') or 0}/{job['total']}" if _finite(job.get("total")) is not None else ""
    phase = ""
    if job.get("phase") and job.get("state") == "running":
        steps = "" if _finite(job.get("phase_total")) is None else f" {job.get('phase_done') or 0}/{job['phase_total']}"
        phase = f" ({job['phase']}{steps})"
    if job.get("text_done") and job.get("phase") == "embed" and job.get("state") == "running":
        left = job_vectors_left_s(job)
        phase = (
            f" (the text is indexed and searchable; adding vectors {job.get('phase_done') or 0}/"
            f"{job.get('phase_total') or 0}{f', about {format_duration(left)} left' if left else ''})"
        )
    ocr = _mapping(job.get("ocr"))
    if ocr and job.get("state") == "running":
        phase += f"; {_ocr_progress(ocr)}"
    reason = f" — {md_text(job['reason'])}" if job.get("reason") else ""
    return f"{md_code(job.get('job_id'))} {job.get('command') or ''}: **{job.get('state')}**{progress}{phase}{reason}"


def _ocr_progress(ocr: dict) -> str:
    """ "OCR page 12/100 of scan.pdf": a page of a file the readers are OCR'ing."""
    name = visible_text(Path(str(ocr.get("path") or "")).name[:40])
    return f"OCR page {ocr.get('done') or 0}/{ocr.get('total') or 0} of {name}"


def _one_job(answer: dict, job: dict) -> str:
    result = _mapping(job.get("result"))
    errors = _listed(job.get("errors"))
    return _lines(
        f"Job {_job_markdown(job)}",
        "Cancellation requested: the job stops after the item in flight." if answer.get("cancel_requested") else None,
        f"Result: {_totals(result['totals'])}." if result.get("totals") else None,
        _note(result.get("note")),
        "Items that failed:" if errors else None,
        _some(errors, "errors", lambda e: f"- {md_text(cut_text(e, 200))}"),
        "Still working: call kb_status again later with the same job_id."
        if job.get("state") in ("queued", "running")
        else None,
    )


def render_status(answer: dict) -> str:
    if isinstance(answer.get("job"), dict):
        return _one_job(answer, answer["job"])
    jobs = [j for j in _listed(answer.get("jobs")) if isinstance(j, dict)]
    if not jobs:
        return "No background jobs for this library in the last hour."
    return _lines("Background jobs:", _some(jobs, "jobs", lambda j: f"- {_job_markdown(j)}"))


def _source_line(source: dict) -> str:
    state = str(source.get("state") or "?").replace("_", " ")
    sync = _mapping(source.get("sync"))
    if sync.get("total"):
        state += f" ({sync.get('done', 0)}/{sync['total']}, job {sync.get('job_id')})"
    detail = [
        f"{source['pending']} file(s) settling" if source.get("pending") else None,
        f"last sync {source['last_sync']}" if source.get("last_sync") else "not synced yet",
        _counts({k: v for k, v in _mapping(source.get("last_changes")).items() if v}),
    ]
    reason = f" ({md_text(cut_text(str(source['reason']), 200))})" if source.get("reason") else ""
    return f"- {md_code(source.get('path', '?'))}: {state}{reason}; " + ", ".join(d for d in detail if d)


def render_watch(answer: dict) -> str:
    sources = [s for s in _listed(answer.get("sources")) if isinstance(s, dict)]
    added, removed = _listed(answer.get("added")), _listed(answer.get("removed"))
    return _lines(
        f"Now watching: {', '.join(md_code(p) for p in added)}." if added else None,
        f"No longer watched (their papers stay in the library): {', '.join(md_code(p) for p in removed)}."
        if removed
        else None,
        "**Watched folders**" if sources else "No folders are watched. Add one with kb_watch and add: [folder].",
        _some(sources, "sources", _source_line),
        _note(answer.get("note")),
    )


def render_stats(answer: dict) -> str:
    if answer.get("exists") is False:
        return _lines(
            "**The knowledge base is empty**: no library exists yet.",
            f"Library folder: {md_code(answer['kb_root'])}" if answer.get("kb_root") else None,
            f"Chosen as {md_text(answer['kb_root_from'])}." if answer.get("kb_root_from") else None,
            "Add papers with kb_ingest (files or folders) or kb_zotero.",
        )
    by_status = _counts(answer.get("by_status"))
    stale = answer.get("stale_docs")
    notice = stale_notice(stale) if isinstance(stale, int) and not isinstance(stale, bool) else None
    return _lines(
        "**Knowledge base**",
        _bullet(
            "documents",
            f"{answer.get('indexed_docs') or 0} indexed of {answer.get('docs') or 0} recorded"
            + (f" ({by_status})" if by_status else ""),
        ),
        _bullet("kinds", _counts(answer.get("by_kind"))),
        _bullet("languages", _counts(answer.get("languages"))),
        _bullet("passages", answer.get("chunks")),
        _bullet(
            "vectors",
            f"{answer.get('vectors') or 0}, missing {answer.get('vectors_missing') or 0}"
            + (f" ({answer['embedding_model']})" if answer.get("embedding_model") else ""),
        ),
        _bullet("vectors refused", md_text(_mapping(answer.get("vectors_refused")).get("reason"))),
        _bullet("models", _counts(answer.get("models"))),
        _bullet("stale documents", stale),
        _bullet("library", md_code(answer["kb_root"]) if answer.get("kb_root") else None),
        md_text(notice) if notice else None,
    )


def _dedup_group(group: dict) -> str:
    docs = ", ".join(
        f"{'keep ' if d.get('doc_id') == group.get('keep') else ''}#{d.get('doc_id')} "
        f"{md_code(file_name(d.get('path')))}"
        for d in _listed(group.get("docs"))
        if isinstance(d, dict)
    )
    return f"- {group.get('reason')}: {docs}"


def render_dedup(answer: dict) -> str:
    groups = [g for g in _listed(answer.get("groups")) if isinstance(g, dict)]
    if not groups:
        return "No duplicate documents found."
    return _lines(
        f"**{len(groups)} group(s) of copies of one work**"
        + (
            f": {answer.get('removed')} document(s) turned into duplicate records."
            if answer.get("applied")
            else " (nothing changed)."
        ),
        _some(groups, "groups", _dedup_group),
        None
        if answer.get("applied")
        else "To keep one document per group, call kb_dedup with apply: true (only if the user agrees).",
    )


def render_clear(answer: dict) -> str:
    cleared = _mapping(answer.get("cleared"))
    return (
        f"**Library cleared**: {cleared.get('docs', 0)} document(s) and {cleared.get('chunks', 0)} passage(s) "
        f"removed from {md_code(answer.get('kb_root', '?'))}. The files themselves were not touched."
    )


SHOW_SNIPPET_CHARS = 160  # of the passage, in the line beside a picture


def render_show(answer: dict) -> str:
    """The one line beside a picture: `Title · p. 6 · "snippet…"`, and what was not highlighted."""
    pages = sorted(
        {i["page"] for i in _listed(answer.get("images")) if isinstance(i, dict) and _is_integer(i.get("page"))}
    )
    where = (
        ("p. " + "–".join(str(p) for p in (pages[0], pages[-1]) if p) if len(pages) > 1 else f"p. {pages[0]}")
        if pages
        else None
    )
    snippet = cut_text(" ".join(str(answer.get("snippet") or "").split()), SHOW_SNIPPET_CHARS)
    line = " · ".join(
        x
        for x in (
            f"**{md_text(answer.get('title') or answer.get('file') or 'Untitled')}**",
            md_text(answer.get("figure")),
            where,
            f'"{md_text(snippet)}"' if snippet else None,
        )
        if x
    )
    return _lines(line, f"Not highlighted: {md_text(answer['note'])}" if answer.get("note") else None)


def show_view(answer: dict) -> dict:
    """What a host's card draws for show: the pictures (inline PNG when asked for) and the line's parts."""
    return {
        "kind": "kb-picture",
        "tool": "kb_show",
        "doc_id": answer.get("doc_id"),
        "title": cut_text(answer.get("title") or answer.get("file") or "Untitled", RENDER_TITLE_CHARS),
        "file": _shown_name(answer.get("file")),
        "path": answer.get("path"),
        "figure": _shown_line(answer.get("figure")),
        "snippet": plain_line(answer.get("snippet")),
        "highlighted": answer.get("highlighted"),
        "note": _shown_line(answer.get("note")),
        "images": [dict(i) for i in _listed(answer.get("images")) if isinstance(i, dict)],
    }


def _sources(command: str) -> Callable[[dict, int], dict]:
    def render(answer: dict, budget: int) -> dict:
        view = sources_view(command, answer, budget)
        return {"markdown": sources_markdown(view), "view": view}

    return render


def _summary(render: Callable[[dict], str]) -> Callable[[dict, int], dict]:
    return lambda answer, budget: {"markdown": render(answer)}


# The commands a host renders, by name: each turns an answer (and the budget) into the fields `render` adds.
RENDERERS: dict[str, Callable[[dict, int], dict]] = {
    "search": _sources("search"),
    "rag": _sources("rag"),
    "ingest": _summary(render_ingest),
    "zotero": _summary(render_zotero),
    "fetch": _summary(render_fetch),
    "status": _summary(render_status),
    "stats": _summary(render_stats),
    "dedup": _summary(render_dedup),
    "clear": _summary(render_clear),
    "watch": _summary(render_watch),
    "show": lambda answer, budget: {"markdown": render_show(answer), "view": show_view(answer)},
}


def render_budget(payload: dict) -> int | None:
    """The budget a ``render`` request asks for, or None when it asks for no rendering."""
    form = payload.get("render")
    if form is None:
        return None
    if form != "markdown":
        raise KBError("bad_request", f'render must be "markdown", not {json.dumps(form)}')
    return _opt_int(payload, "render_budget", HOST_RENDER_BUDGET, MIN_RENDER_BUDGET, MAX_RENDER_BUDGET)


def rendered(command: str, answer: dict, budget: int) -> dict:
    """What a ``render`` request adds to ``command``'s answer: ``markdown``, and ``view`` for search and rag."""
    return RENDERERS[command](answer, budget)
