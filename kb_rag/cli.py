"""Human CLI: argument parser, printers, progress bar, ``main`` (selftest and the job runner are in tasks).

May import: answers.pictures, commands.contract, commands.core, commands.sync, commands.table, config, jobs, live,
models.runtime, protocol, reading.printed, records, rendering, tasks.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

from .answers.pictures import serve_pages
from .commands.contract import host_contract_text
from .commands.core import _kb_root
from .commands.sync import SYNC_COUNTS
from .commands.table import COMMAND_TABLE, COMMANDS_BY_NAME, Command, Engine
from .config import (
    INGEST_STATUSES,
    REQUEST_RULES,
    STATUS_ADDED,
    STATUS_MOVED,
    STATUS_UPDATED,
    Flag,
    KBError,
    __version__,
    now_iso,
)
from .jobs import ITEM_PHASES, JOB_ACTIVE_STATES, fold_progress
from .live import OUT_OF_REACH, WATCH_EVENTS_NOTE, Watcher
from .models.runtime import DEFAULT_EMBED_MODEL
from .protocol import error_reply, run_one_shot, serve
from .reading.printed import DEFAULT_WORK_TYPE, WORK_TYPES
from .records import CitationRecord, DocsResponse, FetchAnswer, HitRecord, IngestResponse, RagResponse, SearchResponse
from .rendering import _ocr_progress, author_line, format_duration, plain_line, venue_line, visible_json, visible_text
from .tasks import print_requirements, run_job, selftest


class ProgressBar:
    """The human CLI's progress bar (on a terminal only). It draws the state that fold_progress makes of the
    command's progress events, the summary a background job's file holds too, so following a job
    (``status --follow``) draws the job file's state with the same bar. One line, redrawn in place: the items
    (files, attachments) on the bar and, once chunks are being encoded, their count after it, since an ingest
    encodes while it still reads files."""

    LABELS = {
        "files": "files",
        "zotero": "attachments",
        "metadata": "documents",
        "verify_metadata": "crossref",
        "embed": "encoding",
    }

    def __init__(self, stream, width: int = 30, min_interval_s: float = 0.1, piped: bool = False):
        self.stream, self.width, self.min_interval_s, self.piped = stream, width, min_interval_s, piped
        self.encoding_from: tuple[float, int] | None = None  # (when, passages done) at the first encoding event
        self.state: dict = {}
        self.items: tuple | None = None  # (phase, done, total, current) of the last item event
        self.side: tuple | None = None  # (phase, done, total) of the last encoding or lookup event
        self.ocr: dict | None = None  # the page a reader is OCR'ing, {"path", "done", "total"}
        self.line = ""  # what is on the terminal's line now
        self.pending = ""  # the newest line, when a redraw was skipped
        self.last_draw = -math.inf  # the first state is always drawn

    def __call__(self, event: dict) -> None:
        """The progress callback of a foreground command."""
        self.draw(fold_progress(self.state, event))

    def draw(self, state: dict) -> None:
        phase = state.get("phase")
        self.ocr = state.get("ocr")
        if phase is None and not self.ocr:
            return
        if phase in ITEM_PHASES:
            self.items = (phase, state.get("done") or 0, state.get("total") or 0, state.get("current"))
        elif phase is not None:
            self.side = (phase, state.get("phase_done") or 0, state.get("phase_total") or 0)
            if phase == "embed" and self.encoding_from is None:
                self.encoding_from = (time.monotonic(), self.side[1])
        self.pending = self._line()
        now = time.monotonic()
        if self.pending != self.line and now - self.last_draw >= self.min_interval_s:
            self._show(self.pending)  # thousands of unchanged files need not mean thousands of redraws
            self.last_draw = now

    def _line(self) -> str:
        if self.items is None and self.side is None:  # the first file is still being OCR'd
            return f"{'reading':<11} {_ocr_progress(self.ocr or {})}"
        phase, done, total, current = self.items or (*(self.side or (None, 0, 0)), None)
        filled = self.width * min(done, total) // total if total else self.width
        bar = "" if self.piped else f"[{'#' * filled}{'.' * (self.width - filled)}] "  # a log gets the counts
        line = f"{self.LABELS.get(phase, phase):<11} {bar}{done}/{total}"
        if self.items and self.side:
            line += f"  {self.LABELS.get(self.side[0], self.side[0])} {self.side[1]}/{self.side[2]}"
        if self.ocr:  # a long scan shows its pages while the file count stands still
            return line + self._encoding_rate() + f"  {_ocr_progress(self.ocr)}"
        return line + self._encoding_rate() + (f"  {visible_text(Path(current).name[:40])}" if current else "")

    def _encoding_rate(self) -> str:
        """Passages encoded per second since encoding began, and the time left at that rate."""
        if self.side is None or self.side[0] != "embed" or self.encoding_from is None:
            return ""
        started, first = self.encoding_from
        elapsed, done = time.monotonic() - started, self.side[1] - first
        if elapsed < 1.0 or done <= 0:
            return ""
        rate = done / elapsed
        left = max(0, self.side[2] - self.side[1]) / rate
        return f"  {rate:.0f} passages/s" + (f", about {format_duration(left)} left" if left >= 1 else "")

    def _show(self, line: str) -> None:
        if self.piped:  # a log or a pipe: whole lines, a few seconds apart
            self.stream.write(line + "\n")
            self.stream.flush()
            self.line = line
            return
        self.stream.write("\r" + line + " " * max(0, len(self.line) - len(line)))  # blank a longer old line
        self.stream.flush()
        self.line = line

    def close(self) -> None:
        """Draw the last state (a skipped redraw included) and end the line, so later output starts clean."""
        if self.pending and self.pending != self.line:
            self._show(self.pending)
        if self.line and not self.piped:
            self.stream.write("\n")
            self.stream.flush()
        self.line = self.pending = ""


PIPED_PROGRESS_S = 5.0  # how often a piped standard error gets a progress line


def _terminal_progress(args) -> ProgressBar | None:
    """A bar on standard error when it is a terminal, a line every few seconds when it is piped (and nothing when
    the output is JSON)."""
    if getattr(args, "json", False):
        return None
    if sys.stderr.isatty():
        return ProgressBar(sys.stderr)
    return ProgressBar(sys.stderr, min_interval_s=PIPED_PROGRESS_S, piped=True)


def _job_line(job: dict) -> str:
    detail = visible_text(job.get("reason") or (Path(job["current"]).name if job.get("current") else ""))
    totals = (job.get("result") or {}).get("totals") or {}
    counts = ", ".join(f"{v} {k}" for k, v in totals.items() if v and isinstance(v, int))
    return (
        f"{job['job_id']}  {job['command']:<7} {job['state']:<9} {job['done']}/{job['total']}"
        + (f"  {detail}" if detail else "")
        + (f"  ({counts})" if counts else "")
    )


def follow_job(engine: Engine, payload: dict, bar: ProgressBar | None, poll_s: float = 0.5) -> dict:
    """Poll a job's status until it ends, drawing it with ``bar``; the last status response."""
    while True:
        response = engine.execute("status", payload)
        if bar is not None:
            bar.draw(response["job"])
        if response["job"]["state"] not in JOB_ACTIVE_STATES:
            if bar is not None:
                bar.close()
            return response
        payload = {k: v for k, v in payload.items() if k != "cancel"}
        time.sleep(poll_s)


def watch_in_foreground(engine: Engine, root: Path, bar_for: Callable[[], Any]) -> int:
    """``kb-engine watch``: keep the library's folders in step until interrupted, a line per sync (each followed
    with the progress bar as ``status --follow`` follows a job)."""
    watcher = Watcher()
    watcher.track(root)
    try:
        jobs = watcher.tick()
        folders = watcher.views(root)
        if not folders:
            print(
                f"no watched folders in {visible_text(root)}: add one with kb-engine watch --add FOLDER",
                file=sys.stderr,
            )
            return 1
        events = watcher.events is not None and watcher.events.available
        print(
            f"watching {len(folders)} folder(s) of {visible_text(root)}"
            + ("" if events else f"; {WATCH_EVENTS_NOTE}")
            + "; Ctrl-C stops",
            flush=True,
        )
        said: dict[str, tuple] = {}
        while True:
            said = _say_reach(watcher.views(root), said)
            for job in jobs:
                finished = follow_job(engine, {"kb_root": str(root), "job_id": job["job_id"]}, bar_for())["job"]
                totals = (finished.get("result") or {}).get("totals") or {}
                counts = ", ".join(f"{v} {k}" for k, v in totals.items() if v and k in SYNC_COUNTS)
                print(f"{now_iso()}  sync {finished['state']}: {counts or 'nothing changed'}", flush=True)
            watcher.wake.wait(watcher.sleep_s())
            watcher.wake.clear()
            jobs = watcher.tick()
    except KeyboardInterrupt:
        return 0
    finally:
        watcher.stop()


def _say_reach(views: dict[str, dict], said: dict[str, tuple]) -> dict[str, tuple]:
    """A line for each watched folder that went out of reach, or has places it cannot read, or is back (what was
    said last time is ``said``); what is said now."""
    now = {
        path: (view["state"] if view["state"] in (*OUT_OF_REACH, "error") else "watching", view.get("reason"))
        for path, view in views.items()
    }
    for path, (state, reason) in now.items():
        if now[path] != said.get(path, ("watching", None)):
            print(
                f"{now_iso()}  {visible_text(path)}: {state}" + (f" ({visible_text(reason)})" if reason else ""),
                flush=True,
            )
    return now


def _print_ingest(response: IngestResponse) -> None:
    for entry in response["files"]:
        if entry["status"] in (STATUS_ADDED, STATUS_UPDATED, STATUS_MOVED):
            detail = f"{entry['chunks']} chunks"
        else:
            detail = entry.get("error") or entry.get("reason") or ""
        print(f"{entry['status']:>9}  {entry['path']}  {detail}")
    totals = response["totals"]
    if response.get("note"):
        print(f"note: {response['note']}")
    vectors = f", {totals.get('vectors_written', 0)} vectors written" + (
        f", {totals['vectors_missing']} passages without one" if totals.get("vectors_missing") else ""
    )
    counts = cast(dict[str, int], totals)
    print(
        ", ".join(f"{counts[s]} {s}" for s in INGEST_STATUSES if counts[s]) + f"  ({totals['files']} files, "
        f"{totals['chunks_written']} chunks written{vectors}, {response['ms']} ms)"
    )


def _print_search(response: SearchResponse) -> None:
    _print_hits(response, cast(list[CliHit], response["results"]))


def _print_hits(response: SearchResponse | RagResponse, hits: list[CliHit]) -> None:
    """A search or rag answer's hits (rag's evidence), with what ran and its notes above them."""
    vectors = response.get("vectors")
    if vectors:
        print(
            f"{response['mode']} search: {'keyword + ' if response['mode'] == 'hybrid' else ''}vectors by "
            f"{vectors['model']}" + (f" ({vectors['backend']})" if vectors.get("backend") else "") + "\n"
        )
    elif hits:
        print("keyword search\n")
    for key in ("note", "lang_note"):
        if response.get(key):
            print(f"{key.replace('_', ' ')}: {response[key]}")
    for rank, hit in enumerate(hits, start=1):
        where = [
            hit["section"] or None,
            (f"p.{hit['page']}" + (f"-{hit['page_end']}" if hit["page_end"] != hit["page"] else ""))
            if hit["page"]
            else None,
        ]
        byline = " · ".join(
            x
            for x in (
                author_line(hit["authors"]),
                str(hit["year"]) if hit["year"] else None,
                plain_line(hit.get("journal")) or None,
                *where,
            )
            if x
        )
        print(f"{rank}. {hit['title']}  [{hit['file']}]")
        if byline:
            print(f"   {byline}")
        print(f"   score {hit['score']:.3f}" + (f" · doi:{hit['doi']}" if hit["doi"] else ""))
        print("   > " + hit["snippet"].replace("\n", " "))
        _print_citations(hit.get("citations") or [])
        if hit.get("picture_file") or hit.get("picture_note"):
            print("   picture: " + " · ".join(x for x in (hit.get("picture_file"), hit.get("picture_note")) if x))
        print()


CLI_CITATIONS_SHOWN = 5


def _print_citations(citations: list[CitationRecord]) -> None:
    """The works a passage cites, as rag and deep search resolve them: marker, entry, and whether the library
    holds the cited work."""
    for cite in citations[:CLI_CITATIONS_SHOWN]:
        work = cite.get("title") or " ".join((cite.get("text") or "").split())[:100]
        held = cite.get("in_library")
        where = f" (in the library: doc {held['doc_id']})" if isinstance(held, dict) and held.get("doc_id") else ""
        doi = f" doi:{cite['doi']}" if cite.get("doi") else ""
        print(f"   cites {cite.get('marker') or ''}: {work}{doi}{where}".rstrip())
    if len(citations) > CLI_CITATIONS_SHOWN:
        print(f"   and {len(citations) - CLI_CITATIONS_SHOWN} more cited works (--json lists them all)")


def _print_rag(response: RagResponse) -> None:
    _print_hits(response, cast(list[CliHit], response["evidence"]))
    print(f"guidance: {response['guidance']}")
    if response["related"]:
        print("related work:")
        for item in response["related"]:
            year = f" ({item['year']})" if item["year"] else ""
            print(f"  - {item['title']}{year}  [{item['reason']}, similarity {item['similarity']:.2f}]")


def _print_stats(response: dict) -> None:
    """Every field as `key: value`, nested objects indented under their key and lists one item a line, so that
    a person reads them (the JSON is one --json away)."""
    for key, value in response.items():
        if key not in ("engine", "ms"):
            _print_field(key, value, 0)


def _scalar_text(value) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)  # deeper than a line of its own can show
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _print_field(key: str, value, depth: int) -> None:
    pad = "  " * depth
    if isinstance(value, dict) and value:
        print(f"{pad}{key}:")
        for sub, item in value.items():
            _print_field(str(sub), item, depth + 1)
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        print(f"{pad}{key}:")
        for item in value:
            print(f"{pad}  - " + ", ".join(f"{k} {_scalar_text(v)}" for k, v in item.items()))
    elif isinstance(value, list):
        print(f"{pad}{key}: " + (", ".join(_scalar_text(v) for v in value) if value else "none"))
    elif isinstance(value, dict):
        print(f"{pad}{key}: none")
    else:
        print(f"{pad}{key}: {_scalar_text(value)}")


CLI_USAGE_NOTE = """\
Programs talk to the engine in JSON: `kb_engine.py serve` reads one request per line on stdin, and
`kb_engine.py COMMAND < payload.json` answers one request (see docs/PROTOCOL.md). Installers use
`kb_engine.py requirements [--missing] [--with-docx]` and `kb_engine.py selftest`.

The library: --kb-root, else $KB_ROOT, else the nearest .kb folder at or above the current folder (a
project's library: `kb-engine --kb-root .kb ingest papers/` starts one), else ~/.kb-rag. serve and the
MCP server follow the same rule."""


def _command_flags(command: Command) -> Iterator[tuple[Flag, str, bool]]:
    """Each human command line argument of a command: the flag, the attribute argparse stores it in (the request
    field it fills, or a dotted path into one), and whether it belongs in the request at all."""
    for spec in command.request_fields:
        for flag in spec.cli:
            yield flag, flag.into or spec.name, True
    for flag in command.cli_flags:
        yield flag, flag.names[-1].lstrip("-").replace("-", "_"), False


KB_ROOT_HELP = "library folder (default: $KB_ROOT, else the nearest .kb folder at or above this one, else ~/.kb-rag)"


def _command_parser(sub, command: Command) -> argparse.ArgumentParser:
    """The subparser of an engine command: its help line and its arguments, all from the command table."""
    parser = sub.add_parser(command.name, help=command.help, description=command.help)
    for flag, dest, _ in _command_flags(command):
        if flag.names[0].startswith("-"):
            options = dict(flag.options)
            if options.get("action") not in ("store_true", "store_false") and "choices" not in options:  # --db DB
                options.setdefault("metavar", flag.names[-1].lstrip("-").replace("-", "_").upper())
            parser.add_argument(*flag.names, dest=dest, help=flag.help, **options)
        else:  # a positional argument is named after its field
            parser.add_argument(dest, help=flag.help, **flag.options)
    parser.add_argument("--json", action="store_true", help="print the JSON response")
    parser.add_argument("--kb-root", dest="kb_root_sub", metavar="KB_ROOT", default=None, help=KB_ROOT_HELP)
    return parser


def build_cli_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kb-engine",
        description="kb-rag: a local literature knowledge base. "
        "Index papers, then search them with page-anchored passages.",
        epilog=CLI_USAGE_NOTE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--kb-root", metavar="KB_ROOT", help=KB_ROOT_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMAND_TABLE:
        if command.on_cli:
            _command_parser(sub, command)
    return parser


def cli_payload(command: Command, args: argparse.Namespace) -> dict:
    """The request the parsed arguments make: each given argument under its field (or dotted path); an unset
    option or an empty list is left out."""
    payload: dict = {}
    for _, dest, in_request in _command_flags(command):
        value = getattr(args, dest, None)
        if not in_request or value is None or value == []:
            continue
        *parents, key = dest.split(".")
        target = payload
        for parent in parents:
            target = target.setdefault(parent, {})
        target[key] = value
    return payload


def _missing_one_of(command: Command, payload: dict) -> str | None:
    """The usage error of a request that names none of the fields one of its rules needs one of (``any_of``), in
    the flags that fill them, or None."""
    for rule in command.rules:
        if rule["rule"] == "any_of" and not REQUEST_RULES["any_of"](payload, rule):
            shown = [flag.shown for flag, dest, _ in _command_flags(command) if dest in rule["fields"]]
            if shown:  # else no flag fills them: the engine's own message says what is missing
                return f"{command.name} needs {' or '.join(shown)}"
    return None


class CliHit(HitRecord, total=False):
    """A hit as the human CLI prints it: ``--show`` draws its passage into a file."""

    picture_file: str


def _attach_pictures(engine: Engine, response: dict, library: dict) -> None:
    """``search --show`` / ``rag --show``: each PDF hit gets ``picture_file`` (the PNG's path) or ``picture_note``."""
    for item in response.get("evidence") or response.get("results") or []:
        if item.get("kind") != "pdf" or item.get("char_start") is None:
            continue
        span = {key: item.get(key) for key in ("doc_id", "page", "char_start", "page_end", "char_end")}
        try:
            shown = engine.execute("show", {**span, **library})
        except KBError as exc:
            item["picture_note"] = exc.message
            continue
        if shown["images"]:
            item["picture_file"] = shown["images"][0]["path"]
        if not shown.get("highlighted"):
            item["picture_note"] = shown.get("note")


def _print_show(response: dict) -> None:
    if response.get("note"):
        print(f"note: {response['note']}")
    for image in response["images"]:
        where = image.get("path") or f"(inline PNG, {len(image.get('data', '')) * 3 // 4} bytes)"
        print(f"p.{image['page']}  {image['width']}x{image['height']} px at {image['dpi']} dpi  {where}")


def _print_fetch(response: FetchAnswer) -> None:
    got = response["fetched"]
    print(f"fetched {got['identifier']} ({got['source']}, {got['bytes']} bytes) -> {got['path']}")
    _print_ingest(response)


def _print_cite(response: dict) -> None:
    if response["text"]:
        print(response["text"])


def _print_zotero(response: dict) -> None:
    for item in response["items"]:
        counts = f"{item['chunks']} chunks, {item['annotations']} annotations"
        detail = item.get("error") or item.get("reason") or counts
        print(f"{item['status']:>9}  {item['item_key']}  {(item['title'] or '')[:60]}  {detail}")
    print(", ".join(f"{v} {k}" for k, v in response["totals"].items() if v) + f"  ({response['ms']} ms)")


def _print_docs(response: DocsResponse) -> None:
    for doc in response["docs"]:
        print(f"{doc['doc_id']:>5} {doc['status']:<9} {doc['chunks']:>5}  {doc['title']}  [{doc['file']}]")
        work = doc.get("work_type")
        about = " · ".join(
            x
            for x in (
                author_line(doc["authors"], bool(doc.get("authors_more"))),
                str(doc["year"]) if doc["year"] else "",
                plain_line(venue_line(doc["journal"], doc.get("volume"), doc.get("issue"), doc.get("page_range"))),
                WORK_TYPES[work].label if work in WORK_TYPES and work != DEFAULT_WORK_TYPE else "",
            )
            if x
        )
        if about and doc["status"] in ("indexed", "duplicate"):
            print(f"{'':>22}{plain_line(about)}")
    print(f"{response['total']} documents")


def _print_contract(response: dict) -> None:
    for tool in response["tools"]:
        print(f"{tool['name']:<10} {tool['command'] or '(host)':<8} {tool['description']}")


def _print_models(response: dict) -> None:
    if response.get("imported"):
        got = response["imported"]
        print(
            f"{'already imported' if got['already_imported'] else 'imported'} {got['model']} "
            f"({got['licence']}, {got['bytes'] / 1e6:.0f} MB) from {got['source']}\n  -> {got['path']}\n"
            f"use it with KB_EMBED_MODEL={got['name']} (it is also the default while "
            f"{DEFAULT_EMBED_MODEL} is not on this machine)"
        )
    _print_stats(response)


# How the human command line prints each command's response (others: one `key: value` line per field).
# Each printer reads its command's answer as its record (records.py) where there is one.
CLI_PRINTERS: dict[str, Callable[[Any], None]] = {
    "ingest": _print_ingest,
    "fetch": _print_fetch,
    "search": _print_search,
    "rag": _print_rag,
    "cite": _print_cite,
    "zotero": _print_zotero,
    "docs": _print_docs,
    "contract": _print_contract,
    "models": _print_models,
    "show": _print_show,
}


def cli_wording(text: str, command: Command) -> str:
    """A hint as this command line gives it: the engine's messages name request fields and commands in backquotes
    (`queries`, `confirm: true`, `models`), the wording for JSON callers and tools; here they become the flag
    that fills the field (--also, --yes) and the command to type (kb-engine models)."""
    for spec in command.request_fields:
        flags = [name for flag in spec.cli for name in flag.names if name.startswith("--")]
        if flags:
            text = text.replace(f"`{spec.name}: true`", f"`{flags[-1]}`").replace(f"`{spec.name}`", f"`{flags[-1]}`")
    for name in COMMANDS_BY_NAME:
        text = text.replace(f"`{name}`", f"`kb-engine {name}`")
    return text.replace("`kb_root`", "`--kb-root`")  # an option of every command, not a field of one


class VisibleStream:
    """Standard output or error while the human CLI runs: an unshown character written to it (see visible_text)
    comes out as its escape, whoever wrote it (a printer, a warning, a library's message). Line breaks pass: they
    are the writers' own, since each printed value has its own escaped first (shown_response), and the progress bar
    redraws its line with a carriage return."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(visible_text(text, keep="\n\r"))

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


# How the human CLI shows the strings of a response field (by its path: a list's items share it) when not with
# visible_text (unshown characters as escapes, a file name's newline as "\n"): a passage's line breaks are its
# page's, so a hit's snippet is folded onto one line; cite's text keeps the lines it was laid out in (the values
# inside were made visible where it was written).
CLI_FIELD_TEXT: dict[str, Callable[[str], str]] = {
    "results.snippet": plain_line,
    "evidence.snippet": plain_line,
    "text": lambda text: visible_text(text, keep="\n"),
}


def shown_response(value, path: str = ""):
    """A response as the human CLI prints it: every string (keys too) with its unshown characters as escapes, so a
    file name holding ESC, a carriage return or a newline, or a title holding a right-to-left override, prints as
    what it is and cannot restyle, rewrite or forge a line. ``--json`` prints the real values instead (visible_json)."""
    if isinstance(value, str):
        return CLI_FIELD_TEXT.get(path, visible_text)(value)
    if isinstance(value, dict):
        return {visible_text(k): shown_response(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [shown_response(v, path) for v in value]
    return value


def human_cli(argv: list[str], engine: Engine) -> int:
    """The CLI for people (``kb-engine``), with both output streams showing unshown characters as escapes."""
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (VisibleStream(s) if s is not None else s for s in streams)
    try:
        return _human_cli(argv, engine)
    finally:
        sys.stdout, sys.stderr = streams


def _human_cli(argv: list[str], engine: Engine) -> int:
    parser = build_cli_parser()
    args = parser.parse_args(argv)
    command = COMMANDS_BY_NAME[args.command]
    kb_root = args.kb_root_sub or args.kb_root
    library = {"kb_root": kb_root} if kb_root else {}
    if command.name == "status":  # lists, shows, cancels or follows: its own flow
        return _human_status(args, library, engine)
    if command.name == "watch" and not (args.add or args.remove or args.list or args.json):
        return watch_in_foreground(engine, _kb_root(library), lambda: _terminal_progress(args))
    payload = {**cli_payload(command, args), **library}
    problem = _missing_one_of(command, payload)
    if problem:
        parser.error(problem)
    progress = _terminal_progress(args) if command.reports_progress else None
    try:
        response = engine.execute(command.name, payload, progress=progress)
    except Exception as exc:
        print(f"error: {visible_text(cli_wording(error_reply(exc)['error'], command))}", file=sys.stderr)
        return 1
    finally:
        if progress is not None:
            progress.close()
    if getattr(args, "show", False):  # search --show, rag --show
        _attach_pictures(engine, response, library)
    if args.json and command.name == "contract":  # host-contract.json's text exactly, so `> host-contract.json`
        sys.stdout.write(host_contract_text())  # refreshes the file
    elif args.json:
        print(visible_json(json.dumps(response, ensure_ascii=False, indent=2, allow_nan=False)))
    else:
        shown = shown_response(response)
        for key in ("note", "lang_note"):
            if isinstance(shown.get(key), str):
                shown[key] = cli_wording(shown[key], command)
        CLI_PRINTERS.get(command.name, _print_stats)(shown)
        if response.get("kb_root_from"):
            print(CLI_OTHER_LIBRARY)
    return _cli_exit_status(command.name, response)


# After an answer read from no library: how this command line opens another (the rule is library_choice's).
CLI_OTHER_LIBRARY = (
    "another library: kb-engine --kb-root PATH, or KB_ROOT=PATH; without either, the nearest .kb "
    "folder at or above the current one, else ~/.kb-rag"
)


def _cli_exit_status(command: str, response: dict) -> int:
    """1 when the command did nothing it was asked to: every file failed, or no requested document exists."""
    totals = response.get("totals") or {}
    if command in ("ingest", "fetch") and totals.get("files") and totals.get("error") == totals["files"]:
        print(f"error: every file failed ({totals['files']}); nothing was indexed", file=sys.stderr)
        return 1
    if command == "cite" and response.get("not_found"):
        print("error: not in the library: doc id(s) " + ", ".join(map(str, response["not_found"])), file=sys.stderr)
        return 1
    return 0


def _human_status(args, payload: dict, engine: Engine) -> int:
    """``kb-engine status [JOB_ID] [--cancel] [--follow]``: list jobs, or show, cancel or follow one."""
    try:
        if args.job_id:
            payload.update(job_id=args.job_id, cancel=args.cancel)
        elif args.cancel or args.follow:
            running = next(
                (j for j in engine.execute("status", payload)["jobs"] if j["state"] in JOB_ACTIVE_STATES), None
            )
            if running is None:
                print("no job is running", file=sys.stderr)
                return 1 if args.cancel else 0
            payload.update(job_id=running["job_id"], cancel=args.cancel)
        if args.follow:
            response = follow_job(engine, payload, _terminal_progress(args))
        else:
            response = engine.execute("status", payload)
    except Exception as exc:
        print(f"error: {visible_text(error_reply(exc)['error'])}", file=sys.stderr)
        return 1
    if args.json:
        print(visible_json(json.dumps(response, ensure_ascii=False, indent=2, allow_nan=False)))
        return 0
    jobs = [response["job"]] if "job" in response else response["jobs"]
    for job in jobs:
        print(_job_line(job))
        for error in job.get("errors") or []:
            print(f"    error: {visible_text(error)}")
    if not jobs:
        print("no jobs in the last hour")
    return 1 if args.follow and response["job"]["state"] == "failed" else 0


def main(argv: list[str] | None = None) -> int:
    # `kb-engine` is the command for people: readable output whatever stdin and stdout are (a script, cron, a
    # notebook cell), JSON with --json. Programs send one request to `python kb_engine.py COMMAND` on stdin.
    for_people = argv is None and Path(sys.argv[0]).stem == "kb-engine"
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 3 and argv[0] == "job":
        return run_job(argv[1], argv[2])
    if argv == ["pages"]:  # the page process a resident engine reads and draws pages in
        return serve_pages()
    if argv[:1] == ["requirements"]:  # neither needs the engine object (nor any non-standard module)
        return print_requirements(argv[1:])
    if argv[:1] == ["selftest"]:
        return selftest(argv[1:])
    engine = Engine(allow_background=bool(argv) and (argv == ["serve"] or len(argv) == 1), own_process=True)
    try:
        if not argv or argv[0] in ("-h", "--help"):
            build_cli_parser().print_help()
            return 0
        if argv[0] in ("--version", "version"):
            print(__version__)
            return 0
        if argv == ["serve"]:
            engine.vectors_after_answer = True  # an ingest answers once its text is in; vectors follow
            engine.start_watching()
            return serve(engine)
        human = for_people or len(argv) > 1 or argv[0].startswith("-") or sys.stdin is None or sys.stdin.isatty()
        if human:
            return human_cli(argv, engine)
        return run_one_shot(argv[0], engine)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    finally:
        engine.close()


if __name__ == "__main__":
    sys.exit(main())
