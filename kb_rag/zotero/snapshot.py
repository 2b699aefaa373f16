"""Zotero: snapshot reading, attachments, metadata, annotations, collections, tags.

May import: config, reading.chunking, reading.identifiers.
"""

from __future__ import annotations

import calendar
import hashlib
import json
import math
import os
import re
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import SUPPORTED_SUFFIXES, KBError
from ..reading.chunking import Chunk
from ..reading.identifiers import find_doi

# Zotero keeps zotero.sqlite locked (exclusive WAL) while it runs, so the engine
# copies the database with its -wal/-journal into a temporary folder, checks that
# the copies are one state of the database, and reads the copy. Zotero's own files
# are only ever read. Item types and fields are looked up by name because their
# ids differ between Zotero 5, 6 and 7.

ZOTERO_ATTACHMENT_TYPES = {
    "application/pdf": ".pdf",
    "text/plain": ".txt",
    "text/markdown": ".md",
    "application/vnd.openxmlformats-officedocument.wordprocessingml.document": ".docx",
}
ANNOTATION_SECTION = "Zotero annotation"
ZOTERO_USER_LIBRARY = "My Library"  # what Zotero calls the user's own library


@dataclass
class ZoteroAttachment:
    item_key: str  # the parent item (or the attachment itself when it has no parent)
    attachment_key: str
    attachment_id: int
    path: str | None  # resolved file path, None when it cannot be resolved
    problem: str | None  # why the path is unusable (reason code)
    version: int
    meta: dict  # title, authors, year, journal, doi and the bibliographic fields (config.BIB_FIELDS)
    collections: list[str]
    tags: list[str]
    annotations: list[dict]
    library: str = ZOTERO_USER_LIBRARY  # "My Library", or the group library's name
    group: int | None = None  # the group library's id

    @property
    def file(self) -> str:
        """The absolute path of an attachment whose file was found (asked only of those)."""
        if self.path is None:
            raise KBError("internal", f"Zotero attachment {self.attachment_key} has no file")
        return os.path.abspath(self.path)


def zotero_db_candidates() -> list[Path]:
    home = Path.home()
    found = [home / "Zotero" / "zotero.sqlite", home / "Documents" / "Zotero" / "zotero.sqlite"]
    appdata = os.environ.get("APPDATA")
    if appdata:
        found.extend(sorted(Path(appdata).glob("Zotero/Zotero/Profiles/*/zotero/zotero.sqlite")))
    return found


def locate_zotero_db(explicit: str | None) -> Path:
    if explicit:
        path = Path(explicit).expanduser().absolute()
        path = path / "zotero.sqlite" if path.is_dir() else path
        if not path.is_file():
            raise KBError("not_found", f"no Zotero database at {path}")
        return path
    env = os.environ.get("KB_ZOTERO_DB")
    if env:
        return locate_zotero_db(env)
    for path in zotero_db_candidates():
        if path.is_file():
            return path.absolute()
    raise KBError(
        "not_found",
        "no Zotero database found (looked in ~/Zotero, ~/Documents/Zotero and the Windows "
        "profile folders); pass zotero_db with the path to zotero.sqlite",
    )


def _zotero_table(conn: sqlite3.Connection, *names: str) -> str | None:
    for name in names:
        if conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (name,)).fetchone():
            return name
    return None


# Zotero (its current releases) holds zotero.sqlite under an exclusive lock in WAL mode, the WAL index in memory
# (no -shm file), with synchronous=NORMAL, and runs wal_checkpoint(TRUNCATE) at idle and at close besides SQLite's
# own checkpoints every 1,000 pages; releases before WAL wrote a rollback journal (-journal) instead. The engine
# never opens those files with SQLite (that could take locks Zotero relies on): it copies them and reads the copy.
# Copies made while Zotero writes are one state of the database only in the cases _snapshot_consistent names;
# otherwise the copy is made again, after a pause that grows, until ZOTERO_SNAPSHOT_S has passed.
ZOTERO_SNAPSHOT_S = 30.0  # how long a snapshot is tried while Zotero writes (KB_ZOTERO_SNAPSHOT_S overrides)
ZOTERO_RETRY_S = (0.01, 0.25)  # the first and the longest pause between two tries (each drawn from its upper half)
SQLITE_HEADER_BYTES, WAL_HEADER_BYTES = 100, 32
SQLITE_MAGIC = b"SQLite format 3\x00"
ZOTERO_SIDECARS = ("-journal", "-wal")  # copied after the database file, the log last
# the tables whose rows decide which attachments the library holds: the copy's are checked page by page
ZOTERO_CHECKED_TABLES = ("items", "itemAttachments", "deletedItems")


def zotero_snapshot_seconds() -> float:
    """ZOTERO_SNAPSHOT_S, or its non-negative override from the environment (0: a single try)."""
    try:
        value = float(os.environ.get("KB_ZOTERO_SNAPSHOT_S", "") or ZOTERO_SNAPSHOT_S)
    except ValueError:
        return ZOTERO_SNAPSHOT_S
    return value if math.isfinite(value) and value >= 0 else ZOTERO_SNAPSHOT_S


def _zotero_file_state(path: str, head_bytes: int) -> tuple | None:
    """What one look tells of one of Zotero's files: (device, inode, size, mtime_ns, ctime_ns, its first bytes),
    None when it is absent."""
    try:
        with open(path, "rb") as handle:
            info = os.fstat(handle.fileno())
            head = handle.read(head_bytes)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns, head


def _zotero_files_state(db_path: Path) -> dict[str, tuple | None]:
    """One look at the database file ("") and its -journal and -wal."""
    return {
        "": _zotero_file_state(str(db_path), SQLITE_HEADER_BYTES),
        **{suffix: _zotero_file_state(f"{db_path}{suffix}", WAL_HEADER_BYTES) for suffix in ZOTERO_SIDECARS},
    }


def _snapshot_consistent(before: dict[str, tuple | None], after: dict[str, tuple | None], db_unchanged: bool) -> bool:
    """Whether copies of the database file and then of its log, made between the looks ``before`` and ``after``,
    are one state of the database. ``db_unchanged``: the copied database file is byte for byte the file as it
    stands after (compared only when the answer depends on it).

    In WAL mode a transaction is written to the log alone, a frame per page; each frame carries the log's salts
    and a checksum chained over the frames before it. The database file changes only when a checkpoint copies
    frames into it, and the log starts over (emptied by TRUNCATE, or its header rewritten with new salts and the
    next checkpoint number by the next writer) only after every frame is in the file. Opening the copy, SQLite
    replays the copied log over the copied file up to the last transaction whose frames all check out. So:

    - the log kept its header (the same salts and checkpoint number) and did not shrink: the same log, only
      appended to. Its copy holds every frame a checkpoint may have copied into the file meanwhile, and a frame
      wins over the file's page, so even a page of the file copied half-written is never read. A frame still being
      written at the end fails its checksum and is dropped with its transaction. Consistent, whatever happened to
      the database file (as long as it is the same file).
    - the log had no header at the first look (absent, or empty after a TRUNCATE: every transaction was in the
      file) and the database file did not change: no checkpoint ran, so whatever log was copied is a new one
      begun over exactly the file copied. Consistent. A file's times cannot show that it did not change (file
      systems stamp them in ticks of up to 2 s, and a write in the tick of the last one leaves them as they
      were), so the copy is compared with the file itself.
    - anything else (the log emptied, begun again with new salts, replaced or shrunk; the database file changed
      while the log was empty; a rollback journal that changed): a checkpoint or a rollback-mode commit ran while
      the files were copied, and the copied file may miss it or hold half of it. Not consistent: copy again.
    """
    db_before, db_after = before[""], after[""]
    if db_before is None or db_after is None or db_before[:2] != db_after[:2]:
        return False  # gone, or replaced by another file
    if before["-journal"] != after["-journal"]:
        return False
    log_before, log_after = before["-wal"], after["-wal"]
    if log_before is not None and len(log_before[5]) == WAL_HEADER_BYTES:
        return (
            log_after is not None
            and log_after[:2] == log_before[:2]
            and log_after[5] == log_before[5]
            and log_after[2] >= log_before[2]
        )
    return db_before == db_after and db_unchanged


def _same_bytes(first: Path, second: Path, block: int = 1 << 20) -> bool:
    with open(first, "rb") as one, open(second, "rb") as other:
        while True:
            a, b = one.read(block), other.read(block)
            if a != b:
                return False
            if not a:
                return True


class ZoteroSnapshot:
    """A private copy of zotero.sqlite (+ -journal, -wal), shown to be one state of the database and checked
    once opened, for reading; removed on exit. ``taken``: the time (time.time()) of the look the copy began
    with: everything Zotero committed before it is in the copy."""

    def __init__(self, db_path: Path):
        self.db_path = db_path
        self.folder: str | None = None
        self.conn: sqlite3.Connection | None = None
        self.taken = 0.0

    def __enter__(self) -> sqlite3.Connection:
        import tempfile

        self.folder = tempfile.mkdtemp(prefix="kb-zotero-")
        try:
            self._copy_consistent(Path(self.folder) / "zotero.sqlite")
            self.conn = self._open_checked(Path(self.folder) / "zotero.sqlite")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self.conn

    def _copy_consistent(self, copy: Path) -> None:
        import random

        bound = zotero_snapshot_seconds()
        deadline = time.monotonic() + bound
        pause = ZOTERO_RETRY_S[0]
        while True:
            self.taken = time.time()
            before = _zotero_files_state(self.db_path)
            if before[""] is None:
                raise KBError("not_found", f"no Zotero database at {self.db_path}")
            self._copy_files(copy, before)
            after = _zotero_files_state(self.db_path)
            log_empty = before["-wal"] is None or len(before["-wal"][5]) < WAL_HEADER_BYTES
            unchanged = log_empty and before[""] == after[""] and self._same_file(copy)
            if _snapshot_consistent(before, after, unchanged):
                return
            if time.monotonic() + pause > deadline:
                raise KBError(
                    "zotero_busy",
                    f"Zotero kept writing its database {self.db_path} for {bound:g} s "
                    "without a pause long enough to copy it whole; try again in a moment "
                    "(a watched Zotero library's next sync tries again by itself)",
                )
            time.sleep(random.uniform(pause / 2, pause))  # at random: a writer with a rhythm is not met in step
            pause = min(pause * 2, ZOTERO_RETRY_S[1])

    def _copy_files(self, copy: Path, seen: dict[str, tuple | None]) -> None:
        """Copy the database file, then the sidecars the look ``seen`` found (the log last); one that is gone
        meanwhile is left out (the next look sees that it went)."""
        import shutil

        for suffix in ("", *ZOTERO_SIDECARS):
            target = Path(f"{copy}{suffix}")
            target.unlink(missing_ok=True)
            if seen[suffix] is None:
                continue
            try:
                shutil.copyfile(f"{self.db_path}{suffix}", target)
            except FileNotFoundError:
                target.unlink(missing_ok=True)
            except OSError as exc:
                raise KBError(
                    "zotero_unreadable", f"cannot copy the Zotero database {self.db_path}{suffix}: {exc}"
                ) from None

    def _same_file(self, copy: Path) -> bool:
        try:
            return _same_bytes(self.db_path, copy)
        except OSError:
            return False

    def _open_checked(self, copy: Path) -> sqlite3.Connection:
        """The copy opened for reading (SQLite folds the copied log into it), once its header says SQLite and the
        pages of the tables that decide what the library holds pass SQLite's quick check."""
        with open(copy, "rb") as handle:
            if handle.read(len(SQLITE_MAGIC)) != SQLITE_MAGIC:
                raise KBError("zotero_unreadable", f"{self.db_path} is not an SQLite database")
        try:
            self.conn = conn = sqlite3.connect(str(copy))
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA query_only = ON")
            # a table name narrows the check to the table's pages from SQLite 3.33 on; before, it checks them all
            tables = [t for t in ZOTERO_CHECKED_TABLES if _zotero_table(conn, t)]
            for table in tables if sqlite3.sqlite_version_info >= (3, 33, 0) else tables[:1]:
                found = [row[0] for row in conn.execute(f"PRAGMA quick_check({table})")]
                if found != ["ok"]:
                    raise KBError("zotero_unreadable", f"the Zotero database {self.db_path} is damaged: {found[0]}")
            conn.execute("SELECT COUNT(*) FROM items").fetchone()
        except sqlite3.DatabaseError as exc:
            raise KBError("zotero_unreadable", f"cannot read the Zotero database {self.db_path}: {exc}") from None
        return conn

    def __exit__(self, exc_type, exc, traceback):
        import shutil

        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
        if isinstance(exc, sqlite3.DatabaseError):  # the copy is sound but could not be read to the end
            raise KBError("zotero_unreadable", f"cannot read the Zotero database {self.db_path}: {exc}") from None
        return False


def zotero_base_directory(data_dir: Path, explicit: str | None) -> Path | None:
    """Zotero's 'Linked Attachment Base Directory' (prefs.js), for attachments:relative paths."""
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get("KB_ZOTERO_BASE_DIR"):
        return Path(os.environ["KB_ZOTERO_BASE_DIR"]).expanduser()
    home = Path.home()
    profiles = [data_dir / "prefs.js"]
    for pattern in (".zotero/zotero/*/prefs.js", "Library/Application Support/Zotero/Profiles/*/prefs.js"):
        profiles.extend(home.glob(pattern))
    if os.environ.get("APPDATA"):
        profiles.extend(Path(os.environ["APPDATA"]).glob("Zotero/Zotero/Profiles/*/prefs.js"))
    for prefs in profiles:
        try:
            text = prefs.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        match = re.search(r'user_pref\("extensions\.zotero\.baseAttachmentPath",\s*"((?:[^"\\]|\\.)*)"\)', text)
        if match:
            return Path(json.loads(f'"{match.group(1)}"'))
    return None


def _resolve_attachment(
    raw_path: str | None, link_mode: int, key: str, data_dir: Path, base_dir: Path | None
) -> tuple[str | None, str | None]:
    """(file path, None) or (None, reason) for an attachment's stored path."""
    if not raw_path:
        return None, "no_file"
    if raw_path.startswith("storage:"):  # (os.path, not pathlib: a sync resolves every attachment's path)
        return os.path.normpath(os.path.join(data_dir, "storage", key, raw_path[len("storage:") :])), None
    if raw_path.startswith("attachments:"):
        if base_dir is None:
            return None, "base_directory_unknown"
        return os.path.normpath(os.path.join(base_dir, raw_path[len("attachments:") :])), None
    if link_mode == 3:  # a web link: no file
        return None, "web_link"
    return raw_path, None


def _by_item(conn: sqlite3.Connection, select: str, item_ids: list[int]):
    """The rows of ``select`` (a query ending in ``IN ({marks})``) for these items, 500 ids a query."""
    for start in range(0, len(item_ids), 500):
        batch = item_ids[start : start + 500]
        yield from conn.execute(select.format(marks=", ".join("?" * len(batch))), batch)


def _zotero_fields(conn: sqlite3.Connection, item_ids: list[int]) -> dict[int, dict[str, str]]:
    fields_table = _zotero_table(conn, "fieldsCombined", "fields")
    values: dict[int, dict[str, str]] = {}
    select = (
        f"SELECT d.itemID, f.fieldName, v.value FROM itemData d JOIN {fields_table} f ON f.fieldID = d.fieldID "
        "JOIN itemDataValues v ON v.valueID = d.valueID WHERE d.itemID IN ({marks})"
    )
    for item_id, name, value in _by_item(conn, select, item_ids):
        values.setdefault(item_id, {})[name] = str(value)
    return values


def _zotero_item_types(conn: sqlite3.Connection, item_ids: list[int]) -> dict[int, str]:
    types_table = _zotero_table(conn, "itemTypesCombined", "itemTypes")
    select = (
        f"SELECT i.itemID, t.typeName FROM items i JOIN {types_table} t ON t.itemTypeID = i.itemTypeID "
        "WHERE i.itemID IN ({marks})"
    )
    return {item_id: str(name) for item_id, name in _by_item(conn, select, item_ids)}


# Zotero's item types as the engine's kinds of work (reading.printed.WORK_TYPES); a thesis's level comes from its
# thesisType field ("PhD", "Master's thesis", "学士", ...), a doctoral one where the field says nothing.
ZOTERO_WORK_TYPES = {
    "journalArticle": "journal-article",
    "magazineArticle": "journal-article",
    "conferencePaper": "conference-paper",
    "thesis": "phd-thesis",
    "report": "report",
    "preprint": "preprint",
    "book": "book",
    "bookSection": "chapter",
}


def _zotero_work_type(item_type: str | None, data: dict[str, str]) -> str | None:
    kind = ZOTERO_WORK_TYPES.get(item_type or "")
    if kind == "phd-thesis":
        level = (data.get("thesisType") or data.get("type") or "").lower()
        if re.search(r"master|m\.?\s?sc|m\.?a\.|硕士", level):
            return "masters-thesis"
        if re.search(r"bachelor|b\.?\s?sc|undergraduate|学士|本科", level):
            return "bachelor-thesis"
    if kind is None and item_type in (None, "attachment", "note", "annotation"):
        return None  # a standalone file: Zotero says nothing about it
    return kind or "document"


def _zotero_bibliographic(item_type: str | None, data: dict[str, str]) -> dict:
    """A Zotero item's kind of work, volume, issue, pages, publisher, report number and arXiv id, by the names of
    the engine's fields (config.BIB_FIELDS); Zotero stores a thesis's university and a report's institution in
    fields of their own."""
    archive = data.get("archiveID") or ""
    arxiv = re.match(r"arxiv:\s*(\S+)", archive, re.IGNORECASE)
    return {
        "work_type": _zotero_work_type(item_type, data),
        "volume": data.get("volume"),
        "issue": data.get("issue"),
        "page_range": data.get("pages"),
        "publisher": data.get("publisher") or data.get("university") or data.get("institution"),
        "report_number": data.get("reportNumber") or (data.get("number") if item_type == "report" else None),
        "arxiv_id": arxiv.group(1) if arxiv else None,
    }


def _zotero_authors(conn: sqlite3.Connection, item_id: int, types_table: str) -> list[str]:
    rows = conn.execute(
        "SELECT c.firstName, c.lastName, t.creatorType FROM itemCreators ic "
        "JOIN creators c ON c.creatorID = ic.creatorID "
        f"JOIN {types_table} t ON t.creatorTypeID = ic.creatorTypeID WHERE ic.itemID = ? ORDER BY ic.orderIndex",
        (item_id,),
    ).fetchall()
    authors = [r for r in rows if r["creatorType"] == "author"] or rows
    return [" ".join(p for p in (r["firstName"], r["lastName"]) if p).strip() for r in authors if r["lastName"]]


def _zotero_collections(conn: sqlite3.Connection) -> dict[int, list[str]]:
    """Item id -> collection paths ("Materials/Graphene")."""
    if not _zotero_table(conn, "collections"):
        return {}
    trashed = (
        {r[0] for r in conn.execute("SELECT collectionID FROM deletedCollections")}
        if _zotero_table(conn, "deletedCollections")
        else set()
    )
    rows = {
        r["collectionID"]: r
        for r in conn.execute("SELECT collectionID, collectionName, parentCollectionID FROM collections")
        if r["collectionID"] not in trashed
    }

    def path(collection_id: int, depth: int = 0) -> str:
        row = rows[collection_id]
        parent = row["parentCollectionID"]
        prefix = path(parent, depth + 1) + "/" if parent in rows and depth < 20 else ""
        return prefix + row["collectionName"]

    out: dict[int, list[str]] = {}
    for item_id, collection_id in conn.execute("SELECT itemID, collectionID FROM collectionItems"):
        if collection_id in rows:
            out.setdefault(item_id, []).append(path(collection_id))
    return out


def _zotero_tags(conn: sqlite3.Connection) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for item_id, name in conn.execute("SELECT it.itemID, t.name FROM itemTags it JOIN tags t ON t.tagID = it.tagID"):
        out.setdefault(item_id, []).append(name)
    return out


def _zotero_annotations(conn: sqlite3.Connection, trashed: set[int]) -> dict[int, list[dict]]:
    """Attachment item id -> annotations with text or comment (Zotero 6 and later)."""
    if not _zotero_table(conn, "itemAnnotations"):
        return {}
    out: dict[int, list[dict]] = {}
    rows = conn.execute(
        "SELECT a.itemID, a.parentItemID, a.text, a.comment, a.pageLabel, a.position, a.sortIndex, "
        "i.key, i.version FROM itemAnnotations a JOIN items i ON i.itemID = a.itemID "
        "ORDER BY a.parentItemID, a.sortIndex"
    )
    for row in rows:
        if row["itemID"] in trashed or not ((row["text"] or "").strip() or (row["comment"] or "").strip()):
            continue
        try:
            page_index = json.loads(row["position"] or "{}").get("pageIndex")
        except (ValueError, AttributeError):
            page_index = None
        out.setdefault(row["parentItemID"], []).append(
            {
                "key": row["key"],
                "text": (row["text"] or "").strip(),
                "comment": (row["comment"] or "").strip(),
                "page": page_index + 1 if isinstance(page_index, int) else None,
                "page_label": row["pageLabel"] or None,
                "version": row["version"] or 0,
            }
        )
    return out


def _zotero_year(date: str | None) -> int | None:
    match = re.search(r"(?<!\d)((?:1[5-9]|20)\d{2})(?!\d)", date or "")
    return int(match.group(1)) if match else None


@dataclass
class ZoteroCatalog:
    """What whole-table queries tell of a Zotero library, without a query per item: its live file attachments
    (``rows``: not trashed, of a kind the engine indexes, in a library of papers) and what their signatures and
    digests are made of besides each item's fields and authors."""

    rows: list[sqlite3.Row]  # itemAttachments joined with items: itemID, key, path, ...
    libraries: dict[int, tuple[str, int | None]]
    items: dict[int, sqlite3.Row]  # itemID -> key, version, modified (every item)
    collections: dict[int, list[str]]
    tags: dict[int, list[str]]
    annotations: dict[int, list[dict]]
    n_collections: int

    def owner(self, row: sqlite3.Row) -> int:
        """The item whose metadata an attachment carries: its parent, or itself when it stands alone."""
        return row["parentItemID"] or row["itemID"]

    def digest(self, row: sqlite3.Row) -> str:
        """What an attachment's import takes from beyond its own and its parent's items: collections, tags,
        annotation keys, library name, stored path. A renamed collection, an erased annotation or a file renamed
        by Zotero changes it while no item's clientDateModified moves."""
        owner = self.owner(row)
        parts = [
            self.items[owner]["key"] if owner in self.items else None,
            sorted(self.collections.get(owner, [])),
            sorted(self.tags.get(owner, [])),
            [n["key"] for n in self.annotations.get(row["itemID"], [])],
            self.libraries[row["libraryID"]][0],
            row["path"],
        ]
        return hashlib.sha1(json.dumps(parts, ensure_ascii=False).encode()).hexdigest()[:16]


def read_zotero_catalog(conn: sqlite3.Connection) -> ZoteroCatalog:
    types_table = _zotero_table(conn, "itemTypesCombined", "itemTypes")
    trashed = (
        {r[0] for r in conn.execute("SELECT itemID FROM deletedItems")}
        if _zotero_table(conn, "deletedItems")
        else set()
    )
    rows = conn.execute(
        f"SELECT a.itemID, a.parentItemID, a.linkMode, a.contentType, a.path, i.key, i.version, i.libraryID, "
        f"t.typeName FROM itemAttachments a JOIN items i ON i.itemID = a.itemID "
        f"JOIN {types_table} t ON t.itemTypeID = i.itemTypeID "
        "ORDER BY a.itemID"
    ).fetchall()
    libraries = zotero_libraries(conn)
    client = "clientDateModified" if _zotero_column(conn, "items", "clientDateModified") else "NULL"
    items = {
        r["itemID"]: r
        for r in conn.execute(
            f"SELECT itemID, key, version, dateModified || '|' || COALESCE({client}, '') AS modified FROM items"
        )
    }
    wanted = [
        r
        for r in rows
        if r["itemID"] not in trashed
        and r["parentItemID"] not in trashed
        and _zotero_file_kind(r["contentType"], r["path"])
        and r["libraryID"] in libraries
    ]
    n_collections = (
        conn.execute("SELECT COUNT(*) FROM collections").fetchone()[0] if _zotero_table(conn, "collections") else 0
    )
    return ZoteroCatalog(
        wanted,
        libraries,
        items,
        _zotero_collections(conn),
        _zotero_tags(conn),
        _zotero_annotations(conn, trashed),
        n_collections,
    )


def zotero_attachments(
    conn: sqlite3.Connection,
    catalog: ZoteroCatalog,
    data_dir: Path,
    base_dir: Path | None,
    rows: list[sqlite3.Row] | None = None,
) -> list[ZoteroAttachment]:
    """The catalog's attachments (or those of ``rows``), each with its parent's metadata and its signature."""
    rows = catalog.rows if rows is None else rows
    owners = list({catalog.owner(r) for r in rows})
    fields = _zotero_fields(conn, owners)
    item_types = _zotero_item_types(conn, owners)
    creator_types = _zotero_table(conn, "creatorTypes") or "creatorTypes"
    attachments = []
    for row in rows:
        owner = catalog.owner(row)
        data = fields.get(owner, {})
        notes = catalog.annotations.get(row["itemID"], [])
        collections, tags = catalog.collections.get(owner, []), catalog.tags.get(owner, [])
        library, group = catalog.libraries[row["libraryID"]]
        path, problem = _resolve_attachment(row["path"], row["linkMode"], row["key"], data_dir, base_dir)
        version = _zotero_signature(
            catalog.items.get(owner), catalog.items.get(row["itemID"]), data, notes, collections, tags, library
        )
        attachments.append(
            ZoteroAttachment(
                item_key=catalog.items[owner]["key"] if owner in catalog.items else row["key"],
                attachment_key=row["key"],
                attachment_id=row["itemID"],
                path=path,
                problem=problem,
                version=version,
                meta={
                    "title": data.get("title"),
                    "authors": _zotero_authors(conn, owner, creator_types),
                    "year": _zotero_year(data.get("date")),
                    "journal": data.get("publicationTitle") or data.get("proceedingsTitle") or data.get("bookTitle"),
                    "doi": (find_doi(data.get("DOI", "")) or data.get("DOI") or None),
                    **_zotero_bibliographic(item_types.get(owner), data),
                },
                collections=sorted(set(collections)),
                tags=sorted(set(tags)),
                annotations=notes,
                library=library,
                group=group,
            )
        )
    return attachments


def read_zotero_library(conn: sqlite3.Connection, data_dir: Path, base_dir: Path | None) -> list[ZoteroAttachment]:
    """Every file attachment of a live (not trashed) item, with its parent's metadata."""
    return zotero_attachments(conn, read_zotero_catalog(conn), data_dir, base_dir)


def zotero_libraries(conn: sqlite3.Connection) -> dict[int, tuple[str, int | None]]:
    """libraryID -> (the name a user knows it by, the group's id): "My Library" for their own, the group's name
    for a group library. Feeds (RSS items Zotero keeps apart) are no library of papers and are left out."""
    if not _zotero_table(conn, "libraries"):
        return {1: (ZOTERO_USER_LIBRARY, None)}  # before Zotero 5 there was only the user's library
    groups = (
        {
            library_id: (name, group_id)
            for group_id, library_id, name in conn.execute("SELECT groupID, libraryID, name FROM groups")
        }
        if _zotero_table(conn, "groups")
        else {}
    )
    names: dict[int, tuple[str, int | None]] = {}
    for library_id, kind in conn.execute("SELECT libraryID, type FROM libraries"):
        if kind == "user":
            names[library_id] = (ZOTERO_USER_LIBRARY, None)
        elif kind == "group":
            names[library_id] = groups.get(library_id) or (f"group library {library_id}", None)
    return names


def _zotero_column(conn: sqlite3.Connection, table: str, column: str) -> bool:
    return any(r[1] == column for r in conn.execute(f"PRAGMA table_info({table})"))


# Zotero stamps every save of an item with clientDateModified (its transaction's time, UTC, to the second) and
# every sync with a higher version: a sync of a watched library reads again only the attachments saved since the
# last one, their parents' and annotations' saves included. Changes that save no item (a collection renamed, an
# annotation erased, a file renamed by Zotero) show in each attachment's digest (ZoteroCatalog.digest). The mark
# only moves forward: a stamp from a clock that ran fast is no mark (it is capped at the snapshot's time), and a
# database whose history went back (a backup restored: earlier stamps, lower versions) gets a full pass.
ZOTERO_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
ZOTERO_MARK_SLACK_S = 60  # saves stamped up to this long before the mark are read again (a clock set back
# a little; Zotero runs one transaction at a time, so saves are stamped in order)


def _zotero_history(conn: sqlite3.Connection) -> tuple[str, dict[str, int]]:
    """(the latest clientDateModified, the highest version in each library) of a snapshot."""
    latest = conn.execute("SELECT MAX(clientDateModified) FROM items").fetchone()[0]
    versions = {
        str(library): version or 0
        for library, version in conn.execute("SELECT libraryID, MAX(version) FROM items GROUP BY libraryID")
    }
    return latest or "", versions


def zotero_mark(conn: sqlite3.Connection, now: float) -> dict | None:
    """Where a library's history stands in this snapshot (taken at ``now``, time.time()): its latest
    clientDateModified, but never later than ``now`` (a stamp past the present comes from a clock that ran fast;
    as a mark it would hide every correctly stamped save until real time caught up with it), and the highest
    version in each of its libraries. None for a schema without clientDateModified (Zotero 4): each sync reads it
    all."""
    if not _zotero_column(conn, "items", "clientDateModified"):
        return None
    latest, versions = _zotero_history(conn)
    present = time.strftime(ZOTERO_TIME_FORMAT, time.gmtime(now))
    return {"modified": min(latest, present) if latest else "", "versions": versions}


def zotero_touched(conn: sqlite3.Connection, mark: dict, now: float) -> set[int] | None:
    """The items saved since ``mark`` (zotero_mark of an earlier snapshot), and the attachments whose annotations
    were; None (the caller then reads everything) when the mark is unreadable, lies in the future (the clock was
    set back since), or is ahead of this snapshot: its latest stamp is earlier or a library's highest version is
    lower (a backup restored; or the latest item erased, which a full pass costs nothing to get right)."""
    try:
        latest = calendar.timegm(time.strptime(mark["modified"], ZOTERO_TIME_FORMAT))
        versions = [(int(library), int(version)) for library, version in mark["versions"].items()]
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    stamped, highest = _zotero_history(conn)
    if (
        latest > now + ZOTERO_MARK_SLACK_S
        or stamped < mark["modified"]
        or any(highest.get(str(library), version) < version for library, version in versions)
    ):
        return None
    since = time.strftime(ZOTERO_TIME_FORMAT, time.gmtime(latest - ZOTERO_MARK_SLACK_S))
    where = " OR ".join(["i.clientDateModified >= ?"] + ["(i.libraryID = ? AND i.version > ?)"] * len(versions))
    params = [since, *(value for pair in versions for value in pair)]
    touched = {r[0] for r in conn.execute(f"SELECT i.itemID FROM items i WHERE {where}", params)}
    if _zotero_table(conn, "itemAnnotations"):
        touched |= {
            r[0]
            for r in conn.execute(
                f"SELECT a.parentItemID FROM itemAnnotations a JOIN items i ON i.itemID = a.itemID WHERE {where}",
                params,
            )
        }
    return touched


def _zotero_signature(
    parent, attachment, fields: dict, notes: list[dict], collections: list[str], tags: list[str], library: str
) -> int:
    """A number that changes whenever anything imported from this attachment changes in Zotero.

    Zotero raises ``version`` only when it syncs; a local edit changes the modification time instead,
    and a deleted annotation or a renamed collection changes neither on the item: so everything that is
    imported goes into the signature."""
    parts: list = [[r["version"], r["modified"]] if r is not None else None for r in (parent, attachment)]
    parts += [
        sorted(fields.items()),
        [[n["key"], n["version"], n["text"], n["comment"], n["page_label"]] for n in notes],
        sorted(collections),
        sorted(tags),
        library,
    ]
    digest = hashlib.sha1(json.dumps(parts, ensure_ascii=False, default=str).encode()).hexdigest()
    return int(digest[:12], 16)


def _zotero_file_kind(content_type: str | None, path: str | None) -> str | None:
    """The suffix of an attachment the engine can index (HTML snapshots and web links are not)."""
    suffix = os.path.splitext(path or "")[1].lower()
    if suffix in SUPPORTED_SUFFIXES:
        return suffix
    return ZOTERO_ATTACHMENT_TYPES.get((content_type or "").lower())


def annotation_chunks(notes: list[dict]) -> list[Chunk]:
    """Annotations as chunks: the highlighted text and the reader's comment, on their page."""
    chunks = []
    for note in notes:
        text = note["text"]
        if note["comment"]:
            text = f"{text}\n\nComment: {note['comment']}" if text else f"Comment: {note['comment']}"
        page = note["page"]
        chunks.append(
            Chunk(
                text=text,
                section=ANNOTATION_SECTION,
                block="annotation",
                weight=1.0,
                page=page,
                page_end=page,
                page_label=note["page_label"],
                char_start=None,
                char_end=None,
                page_map=[[0, page, None, len(text), 0]],
            )
        )
    return chunks
