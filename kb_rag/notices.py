"""Notices: what a host tells its user about the library beside an answer: documents indexed by an older parser,
and what the watched folders changed since the host's last search. The engine words them; hosts only show them
(the DSH plugin once per session, the MCP server once per server process).

May import: config, jobs, storage.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import PARSER_REVISION, Field, _opt_bool
from .jobs import JobStore
from .storage import Library

NOTICE_FIELDS = (
    Field(
        "notices_since",
        "number",
        "none",
        "search and rag: a Unix time (the host's last search); the answer's `notices` then say what the watched "
        "folders changed in the library since (the sync jobs that ended after it)",
    ),
    Field(
        "stale_notice",
        "boolean",
        "`false`",
        "search and rag: `notices` also say how many documents were indexed by an older parser, when any are",
    ),
)
NOTICED_CHANGES = ("added", "updated", "moved", "removed")  # what a sync notice counts, in its order


def stale_notice(count: int) -> str | None:
    """The words for documents indexed by an older parser (stats, and a host's first search of a session)."""
    if count <= 0:
        return None
    return (
        f"{count} document(s) were indexed by an older parser, so their pages, citations or metadata may be "
        "incomplete: kb_ingest with metadata_only: true refreshes their metadata, rebuild: true re-parses them."
    )


def sync_notice(jobs: list[dict], since: float) -> str | None:
    """The words for what the sync jobs that ended after ``since`` changed, or None when they changed nothing."""
    counts = dict.fromkeys(NOTICED_CHANGES, 0)
    for job in jobs:
        finished = job.get("finished")
        if (
            job.get("command") != "sync"
            or job.get("state") != "done"
            or not isinstance(finished, (int, float))
            or finished <= since
        ):
            continue
        totals = (job.get("result") or {}).get("totals") or {}
        for key in NOTICED_CHANGES:
            value = totals.get(key)
            counts[key] += value if isinstance(value, int) and not isinstance(value, bool) else 0
    parts = [
        f"{n} {'paper' if n == 1 else 'papers'} {key}" if not i else f"{n} {key}"
        for i, (key, n) in enumerate((k, v) for k, v in counts.items() if v > 0)
    ]
    if not parts:
        return None
    return (
        f"Since the last search, the watched folders changed the library: {', '.join(parts)}. These results "
        "include them."
    )


def with_notices(answer: Mapping[str, Any], lib: Library | None, payload: dict) -> Mapping[str, Any]:
    """A search or rag answer with the ``notices`` its host asked for (after the query cache: they are of now)."""
    since = payload.get("notices_since")  # a finite number when given (check_field_types)
    stale = _opt_bool(payload, "stale_notice")
    if lib is None or (since is None and not stale):
        return answer
    return {**answer, "notices": library_notices(lib, lib.root, since, stale)}


def library_notices(lib: Library, root: Path, since: float | None, stale: bool) -> list[dict]:
    """The notices a search or rag answer carries when its host asks (``notices_since``, ``stale_notice``)."""
    notices = []
    if stale:
        text = stale_notice(lib.count_stale_docs(PARSER_REVISION))
        if text:
            notices.append({"kind": "stale_documents", "text": text})
    if since is not None:
        try:
            jobs = JobStore(root).all()
        except OSError:  # the job folder cannot be read: no sync notice, never a failed search
            jobs = []
        text = sync_notice(jobs, since)
        if text:
            notices.append({"kind": "synced", "text": text})
    return notices
