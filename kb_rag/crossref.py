"""Crossref check: opt-in metadata verification against Crossref, cached.

May import: config, fetch, reading.metadata, storage.
"""

from __future__ import annotations

import html
import json
import os
import re
import sqlite3
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, replace

from .config import _SURROGATE, BIB_FIELDS, KBError, _short_error
from .fetch import _FETCH_DOI, FETCH_PAGE_MAX_BYTES, FetchSettings, _http_failure, fetch_settings_number, http_get
from .reading.metadata import METADATA_FIELDS, DocMeta
from .storage import Library, is_disk_full, surname_key, title_key

# -- metadata verification: an opt-in check against Crossref ---------------------
# Off unless asked for (ingest verify_metadata / --verify-metadata). What leaves the machine: a DOI the paper
# prints, or, for a paper without one, its extracted title. Never its text, authors or file names.
# A DOI record is taken when it is about the same paper (the title or the first author agrees); a title query
# only when the returned title matches the extracted one closely and the first author's family name agrees.
# Answers are kept in metadata_lookups, so a paper is asked about once; Zotero's own data always wins.

CROSSREF_TITLE_MATCH = 0.92  # similarity of normalised titles for a title query to count as a match
CROSSREF_SELECT = (
    "DOI,title,author,issued,published-print,published-online,container-title,"
    "volume,issue,page,article-number,publisher,type"
)
METADATA_TIMEOUT_S = 10.0  # one lookup, its answer read to the end (KB_METADATA_TIMEOUT)
METADATA_DEADLINE_S = 300.0  # every lookup of one request together (KB_METADATA_DEADLINE)
METADATA_RECHECK_DAYS = 30  # "no record" is asked again after this long: works are registered late
# The longest values a record may hold. Nothing real comes near them; a longer value comes from a broken or
# hostile service and is dropped, so that it is neither stored on a document nor sent back in every hit.
RECORD_LIMITS = {"title": 1000, "journal": 500, "author": 300, "authors": 5000, "doi": 300, "bib": 300}

# Crossref's work types as the engine's kinds of work (reading.printed.WORK_TYPES); others leave the kind alone.
CROSSREF_WORK_TYPES = {
    "journal-article": "journal-article",
    "proceedings-article": "conference-paper",
    "dissertation": "phd-thesis",
    "report": "report",
    "posted-content": "preprint",
    "book": "book",
    "monograph": "book",
    "book-chapter": "chapter",
}
# Fields Crossref fills only where the pages printed nothing (the printed record is the paper's own word).
CROSSREF_FILLS = ("volume", "issue", "page_range", "publisher")
RECORD_FIRST_YEAR = 1000  # a record's year lies between this and next year


class MalformedAnswer(ValueError):
    """An answer that does not have the shape Crossref documents: reported for its document, never cached."""


@dataclass
class MetadataCheck:
    """The settings of one verification run and what it found, per document."""

    base: str
    settings: FetchSettings  # its deadline ends the whole run (KB_METADATA_DEADLINE)
    offline: str = ""  # why no request is made (KB_OFFLINE, or the network failed this run)
    ran_out: bool = False  # the run's deadline passed before every document was checked

    def request_settings(self) -> FetchSettings:
        """The settings of one request: its own deadline, KB_METADATA_TIMEOUT from now, within the run's."""
        own = time.monotonic() + self.settings.timeout
        if own >= self.settings.deadline:
            return self.settings
        return replace(self.settings, deadline=own, deadline_name=self.settings.timeout_name)

    def time_left(self) -> bool:
        return time.monotonic() < self.settings.deadline


def metadata_check() -> MetadataCheck:
    timeout = fetch_settings_number("KB_METADATA_TIMEOUT", METADATA_TIMEOUT_S)
    budget = fetch_settings_number("KB_METADATA_DEADLINE", METADATA_DEADLINE_S)
    settings = FetchSettings(
        arxiv="",
        resolver="",
        unpaywall="",
        email=None,
        max_bytes=FETCH_PAGE_MAX_BYTES,
        timeout=timeout,
        deadline=time.monotonic() + budget,
        timeout_name="KB_METADATA_TIMEOUT",
        deadline_name="KB_METADATA_DEADLINE",
        size_name="the largest answer a metadata lookup reads",
    )
    check = MetadataCheck((os.environ.get("KB_CROSSREF_URL") or "https://api.crossref.org").rstrip("/"), settings)
    if os.environ.get("KB_OFFLINE", "").strip().lower() in ("1", "true", "yes"):
        check.offline = "KB_OFFLINE is set: metadata was not checked online"
    return check


def _similar_titles(a: str, b: str) -> float:
    """How alike two titles are, 0 to 1: the lower of their character similarity and the share of words they
    have in common, so a title differing in one telling word ("... rotating prism") stays apart."""
    import difflib

    words_a, words_b = (re.findall(r"\w+", unicodedata.normalize("NFKC", t or "").casefold()) for t in (a, b))
    if not words_a or not words_b:
        return 0.0
    shared = len(set(words_a) & set(words_b)) / len(set(words_a) | set(words_b))
    return min(shared, difflib.SequenceMatcher(None, " ".join(words_a), " ".join(words_b)).ratio())


def _record_text(value, limit: int) -> str | None:
    """A text value fit to store: a string, lone surrogates replaced, control characters and runs of blanks made
    one space, 1 to ``limit`` characters; anything else is None."""
    if not isinstance(value, str) or len(value) > 4 * limit:
        return None
    text = " ".join(re.sub(r"[\x00-\x1f\x7f]", " ", _SURROGATE.sub("\ufffd", value)).split())
    return text if 0 < len(text) <= limit else None


def _record_year(value) -> int | None:
    if type(value) is not int:  # bool is an int to Python, and true is no year
        return None
    return value if RECORD_FIRST_YEAR <= value <= time.gmtime().tm_year + 1 else None


def _record_doi(value) -> str | None:
    if not isinstance(value, str) or _SURROGATE.search(value):
        return None
    doi = _record_text(value, RECORD_LIMITS["doi"])
    return doi.lower() if doi and _FETCH_DOI.match(doi) else None


def bounded_record(fields: dict) -> dict:
    """title, authors, year, journal and doi with every value checked (RECORD_LIMITS, the year range, a DOI's
    shape); a value that fails is None (authors: left out). Applied to what Crossref sends and to the cache."""
    listed = fields.get("authors")
    names = listed if isinstance(listed, list) else []
    authors = [name for name in (_record_text(n, RECORD_LIMITS["author"]) for n in names) if name]
    return {
        "title": _record_text(fields.get("title"), RECORD_LIMITS["title"]),
        "authors": authors[: RECORD_LIMITS["authors"]],
        "year": _record_year(fields.get("year")),
        "journal": _record_text(fields.get("journal"), RECORD_LIMITS["journal"]),
        "doi": _record_doi(fields.get("doi")),
        "work_type": fields.get("work_type") if fields.get("work_type") in CROSSREF_WORK_TYPES.values() else None,
        **{name: _record_text(fields.get(name), RECORD_LIMITS["bib"]) for name in CROSSREF_FILLS},
    }


def _first_string(message: dict, key: str):
    """The first entry of a list-of-strings field of a Crossref work (None when absent or empty)."""
    value = message.get(key)
    if value is None:
        return None
    if not isinstance(value, list):
        raise MalformedAnswer(f"its {key} is not a list")
    return next((v for v in value if isinstance(v, str)), None)


def _crossref_year(message: dict) -> int | None:
    for key in ("published-print", "published-online", "issued"):
        date = message.get(key)
        parts = date.get("date-parts") if isinstance(date, dict) else None
        if isinstance(parts, list) and parts and isinstance(parts[0], list) and parts[0]:
            year = _record_year(parts[0][0])
            if year is not None:
                return year
    return None


def crossref_record(message) -> dict | None:
    """The fields kb-rag uses from a Crossref work (checked by ``bounded_record``), None when it names neither a
    title nor a DOI; MalformedAnswer when it is not a work as Crossref documents one."""
    if not isinstance(message, dict):
        raise MalformedAnswer("the work is not a JSON object")
    people = message.get("author")
    if people is not None and not isinstance(people, list):
        raise MalformedAnswer("its author is not a list")
    authors = []
    for person in (people or [])[: RECORD_LIMITS["authors"]]:
        if not isinstance(person, dict):
            continue
        parts = [person.get(k) for k in ("given", "family")]
        name = " ".join(p.strip() for p in parts if isinstance(p, str) and p.strip())
        whole = person.get("name")
        name = name or (whole.strip() if isinstance(whole, str) else "")
        if name:
            authors.append(html.unescape(name))
    title, journal = _first_string(message, "title"), _first_string(message, "container-title")
    if isinstance(title, str) and len(title) <= 4 * RECORD_LIMITS["title"]:
        title = html.unescape(re.sub(r"<[^>]+>", "", title))
    if isinstance(journal, str) and len(journal) <= 4 * RECORD_LIMITS["journal"]:
        journal = html.unescape(journal)
    record = bounded_record(
        {
            "title": title,
            "authors": authors,
            "year": _crossref_year(message),
            "journal": journal,
            "doi": message.get("DOI"),
            "work_type": CROSSREF_WORK_TYPES.get(str(message.get("type") or "")),
            "volume": message.get("volume"),
            "issue": message.get("issue"),
            "page_range": message.get("page") or message.get("article-number"),
            "publisher": message.get("publisher"),
        }
    )
    return record if record["title"] or record["doi"] else None


def _crossref_get(check: MetadataCheck, url: str) -> tuple[str, object]:
    """("ok", message) | ("not_found", None) | ("failed", why). A network failure turns the rest of the run off."""
    try:
        response = http_get(url, check.request_settings(), "application/json")
    except KBError as exc:
        if exc.code == "too_large":
            return "failed", f"Crossref's answer is larger than a record can be ({exc.message})"
        if not check.time_left():  # the run's own deadline cut this lookup short: the service is not down
            check.ran_out = True
            return "failed", f"the verification ran out of time during this lookup ({exc.message})"
        check.offline = f"Crossref could not be reached ({exc.message}); metadata was not checked online"
        return "failed", check.offline
    if response.status == 404:
        return "not_found", None
    if response.status >= 400:
        return "failed", _http_failure(response)
    try:
        data = json.loads(response.body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "failed", f"Crossref sent something that is not JSON ({response.describe()})"
    message = data.get("message") if isinstance(data, dict) else None
    if message is None:
        return "failed", "Crossref's answer has no message"
    return "ok", message


def _cached_lookup(lib: Library, key: str):
    """A stored answer still to be trusted: ("found", record) | ("not_found", None), or None to ask again. A
    record that fails today's checks (stored by an older engine) and an old "no record" are asked again."""
    row = lib.metadata_lookup(key)
    if row is None:
        return None
    if not row["found"]:
        fresh = time.time() - (row["fetched_at"] or 0) < METADATA_RECHECK_DAYS * 86400
        return ("not_found", None) if fresh else None
    try:
        record = json.loads(row["record"] or "")
    except (ValueError, RecursionError):
        record = None
    if isinstance(record, dict) and bounded_record(record) == record and (record["title"] or record["doi"]):
        return "found", record
    return None


def _lookup(lib: Library, check: MetadataCheck, key: str, url: str, pick: Callable[[object], dict | None]):
    """A cached answer, or one asked for now: ("found", record) | ("not_found", None) | ("failed", why). Only a
    well-formed answer is kept."""
    cached = _cached_lookup(lib, key)
    if cached is not None:
        return cached
    if check.offline:
        return "failed", check.offline
    status, message = _crossref_get(check, url)
    if status == "failed":
        return status, message
    try:
        record = pick(message) if status == "ok" else None
    except MalformedAnswer as exc:
        return "failed", f"Crossref's answer is not a work record: {exc}"
    with lib.transaction():
        lib.store_metadata_lookup(
            key, record is not None, json.dumps(record, ensure_ascii=False) if record else None, time.time()
        )
    return ("found", record) if record else ("not_found", None)


def _same_first_author(extracted: list[str], record: dict) -> bool:
    theirs = record.get("authors") or []
    return bool(extracted and theirs) and surname_key(extracted[0]) == surname_key(theirs[0])


def _doi_record(message) -> dict:
    record = crossref_record(message)
    if record is None:
        raise MalformedAnswer("the work names neither a title nor a DOI")
    return record


def _check_one(lib: Library, check: MetadataCheck, row: sqlite3.Row) -> dict:
    from urllib.parse import quote, urlencode

    authors = json.loads(row["authors"] or "[]")
    if row["doi"]:
        status, found = _lookup(
            lib, check, f"doi:{row['doi']}", f"{check.base}/works/{quote(row['doi'], safe='/')}", _doi_record
        )
        if status != "found":
            return {
                "outcome": status,
                "detail": found if status == "failed" else f"Crossref has no record of {row['doi']}",
            }
        if _similar_titles(found["title"] or "", row["title"] or "") < 0.6 and not _same_first_author(authors, found):
            return {
                "outcome": "no_match",
                "detail": f"Crossref's record of {row['doi']} is about another work "
                f"({found['title'] or 'untitled'!r}); kept what the paper prints",
            }
    else:
        if not row["title"] or not authors:
            return {"outcome": "skipped", "detail": "no DOI, and no title and first author to ask about"}
        query = urlencode({"query.bibliographic": row["title"], "rows": 5, "select": CROSSREF_SELECT})

        def best(message):
            items = message.get("items") if isinstance(message, dict) else None
            if not isinstance(items, list):
                raise MalformedAnswer("a search answer without a list of items")
            for item in items[:20]:
                try:
                    record = crossref_record(item)
                except MalformedAnswer:
                    continue  # one broken item does not hide a good one
                if (
                    record
                    and _similar_titles(record["title"] or "", row["title"]) >= CROSSREF_TITLE_MATCH
                    and _same_first_author(authors, record)
                ):
                    return record
            return None

        status, found = _lookup(
            lib, check, f"title:{title_key(row['title']) or row['title']}", f"{check.base}/works?{query}", best
        )
        if status != "found":
            return {
                "outcome": "no_match" if status == "not_found" else status,
                "detail": found if status == "failed" else "no Crossref record matches the title and first author",
            }
    return {"outcome": "verified", "record": found}


def _apply_record(lib: Library, row: sqlite3.Row, record: dict) -> list[str]:
    """Write what Crossref knows over the extracted fields; returns the fields that changed."""
    stored = DocMeta.from_row(row)
    filled = {name: record.get(name) for name in CROSSREF_FILLS if record.get(name) and not getattr(stored, name)}
    if record.get("work_type") and stored.work_type in ("document", "preprint"):
        filled["work_type"] = record["work_type"]  # the pages did not say; a preprint's DOI record may
    meta = DocMeta(
        title=record.get("title") or row["title"],
        authors=record.get("authors") or stored.authors,
        year=record.get("year") or row["year"],
        journal=record.get("journal") or row["journal"],
        doi=record.get("doi") or row["doi"],
        lang=row["lang"] or "",
    )
    for name in BIB_FIELDS:
        setattr(meta, name, filled.get(name, getattr(stored, name)))
    meta.authors_more = stored.authors_more and not record.get("authors")  # Crossref lists every author
    meta.__post_init__()  # the record's values cleaned as every source's are (one kind of dash in pages)
    sources = json.loads(row["metadata_source"] or "{}") or dict.fromkeys(METADATA_FIELDS, "extracted")
    changed = [k for k in METADATA_FIELDS if getattr(meta, k) != getattr(stored, k)]
    for key in METADATA_FIELDS:
        if record.get(key) and (key not in BIB_FIELDS or key in filled):
            sources[key] = "crossref"
    with lib.transaction():
        lib.set_doc_metadata(
            row["id"], meta.title, meta.authors, meta.year, meta.journal, meta.doi, sources, meta.bib_columns()
        )
        if "title" in changed:
            lib.reindex_headings(row["id"], meta.title)
        lib.invalidate_cache()
    return changed


def verify_metadata(lib: Library, doc_ids: list[int], progress: Callable[[dict], None] | None) -> dict:
    """Check the metadata of these documents against Crossref (see above); a summary for the ingest reply. Each
    document gets its own outcome: nothing a service sends can fail the ingest, whose files are committed."""
    check = metadata_check()
    found = [lib.doc_by_id(doc_id) for doc_id in doc_ids]
    rows = [r for r in found if r is not None and r["status"] == "indexed" and not r["zotero_key"]]
    results = []
    for done, row in enumerate(rows, start=1):
        if progress:
            progress({"phase": "verify_metadata", "done": done, "total": len(rows), "path": row["path"]})
        if not check.time_left() and not check.offline:
            check.ran_out = True
            results.append(
                {
                    "path": row["path"],
                    "outcome": "failed",
                    "detail": "not checked: the verification ran out of time (KB_METADATA_DEADLINE)",
                }
            )
            continue
        try:
            result = _check_one(lib, check, row)
            if result["outcome"] == "verified":
                result["changed"] = _apply_record(lib, row, result.pop("record"))
        except Exception as exc:  # whatever an answer does to the checks, it stays this document's outcome
            if is_disk_full(exc) or isinstance(exc, sqlite3.OperationalError):
                raise  # the library's own trouble (full, locked): the command reports it
            result = {"outcome": "failed", "detail": f"could not be checked: {type(exc).__name__}: {_short_error(exc)}"}
        results.append({"path": row["path"], **result})
    counts = {
        outcome: sum(r["outcome"] == outcome for r in results)
        for outcome in ("verified", "no_match", "not_found", "skipped", "failed")
    }
    summary = {"service": check.base, "checked": len(results), **counts, "documents": results}
    if check.offline:
        summary["note"] = check.offline
    elif check.ran_out:
        summary["note"] = (
            f"the verification stopped after {check.settings.deadline_name} "
            f"({fetch_settings_number('KB_METADATA_DEADLINE', METADATA_DEADLINE_S):g} s); the documents "
            "it did not reach keep their extracted metadata: ingest {metadata_only, verify_metadata} "
            "checks them (answers already received are cached)"
        )
    return summary
