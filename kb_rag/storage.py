"""Storage: schema, migrations, connections (WAL, one txn per file), and every statement on the library's tables.

The statements the rest of the engine runs are methods of ``Library``: here, and in ``storage_queries.py``, whose
``LibraryQueries`` it inherits. No other module executes SQL on the library's connection.

May import: config, reading.chunking, storage_queries, text.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import sqlite3
import unicodedata
from collections.abc import Callable
from pathlib import Path

from .config import BIB_FIELDS, BUSY_TIMEOUT_MS, DB_FILENAME, SCHEMA_VERSION, KBError, _short_error, now_iso
from .reading.chunking import Chunk
from .storage_queries import LibraryQueries
from .text import _strip_diacritics, analyzed_string, cjk_ratio

# What the library records (in ``meta``) about the model that made its vectors; dropped with the vectors.
VECTOR_META_KEYS = ("embed_model", "embed_dim", "embed_passage_format", "embed_passage_prompt", "vectors_refused")

SCHEMA_V1 = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT
);
CREATE TABLE IF NOT EXISTS docs (
    id           INTEGER PRIMARY KEY,
    path         TEXT NOT NULL UNIQUE,
    kind         TEXT NOT NULL,
    status       TEXT NOT NULL,            -- indexed | skipped | error | duplicate
    reason       TEXT,
    error        TEXT,
    title        TEXT,
    authors      TEXT NOT NULL DEFAULT '[]',   -- JSON list of names
    year         INTEGER,
    journal      TEXT,
    doi          TEXT,
    sha256       TEXT,
    size         INTEGER,
    mtime_ns     INTEGER,
    pages        INTEGER,
    page_labels  TEXT,                     -- JSON list of printed page labels, when the PDF has them
    lang         TEXT,
    chunk_count  INTEGER NOT NULL DEFAULT 0,
    duplicate_of INTEGER REFERENCES docs(id) ON DELETE SET NULL,
    indexed_with INTEGER,
    indexed_at   TEXT
);
CREATE INDEX IF NOT EXISTS docs_sha256 ON docs(sha256);
CREATE TABLE IF NOT EXISTS chunks (
    id          INTEGER PRIMARY KEY,
    doc_id      INTEGER NOT NULL REFERENCES docs(id) ON DELETE CASCADE,
    seq         INTEGER NOT NULL,
    section     TEXT NOT NULL DEFAULT '',
    block       TEXT NOT NULL DEFAULT 'text',   -- text | caption | abstract
    weight      REAL NOT NULL DEFAULT 1.0,
    text        TEXT NOT NULL,
    page        INTEGER,
    page_end    INTEGER,
    page_label  TEXT,
    char_start  INTEGER,
    char_end    INTEGER,
    page_map    TEXT NOT NULL DEFAULT '[]'     -- [[chunk_offset, page, page_offset, length], ...]
);
CREATE INDEX IF NOT EXISTS chunks_doc ON chunks(doc_id, seq);
CREATE TABLE IF NOT EXISTS vecs (
    chunk_id INTEGER PRIMARY KEY REFERENCES chunks(id) ON DELETE CASCADE,
    vec      BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS cache (
    key     TEXT PRIMARY KEY,
    payload TEXT NOT NULL,
    created REAL NOT NULL
);
"""

FTS5_SCHEMA = """
CREATE VIRTUAL TABLE IF NOT EXISTS chunks_fts USING fts5(body, heading, tokenize = 'unicode61 remove_diacritics 0');
CREATE VIRTUAL TABLE IF NOT EXISTS chunks_vocab USING fts5vocab(chunks_fts, 'row');
CREATE TRIGGER IF NOT EXISTS chunks_fts_delete AFTER DELETE ON chunks BEGIN
    DELETE FROM chunks_fts WHERE rowid = old.id;
END;
"""

# Used only where the Python's sqlite3 was built without FTS5.
PLAIN_TERMS_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunk_terms (
    chunk_id INTEGER PRIMARY KEY REFERENCES chunks(id) ON DELETE CASCADE,
    body     TEXT NOT NULL,
    heading  TEXT NOT NULL
);
"""

# Forward migrations: MIGRATIONS[v] takes a database at version v to v + 1.
MIGRATIONS: dict[int, Callable[[sqlite3.Connection, bool], None]] = {}


def run_statements(conn: sqlite3.Connection, script: str) -> None:
    """Run a SQL script inside the caller's transaction (``executescript`` would commit it)."""
    statement = ""
    for line in script.splitlines(keepends=True):
        statement += line
        if sqlite3.complete_statement(statement):
            conn.execute(statement)
            statement = ""


def _migrate_0_to_1(conn: sqlite3.Connection, has_fts5: bool) -> None:
    run_statements(conn, SCHEMA_V1)
    run_statements(conn, FTS5_SCHEMA if has_fts5 else PLAIN_TERMS_SCHEMA)


SCHEMA_V2 = """
ALTER TABLE docs ADD COLUMN title_key TEXT;        -- normalised title, for matching cited works
ALTER TABLE docs ADD COLUMN first_author_key TEXT; -- lower-cased surname of the first author
CREATE INDEX IF NOT EXISTS docs_doi ON docs(doi);
CREATE INDEX IF NOT EXISTS docs_title_key ON docs(title_key);
CREATE INDEX IF NOT EXISTS docs_author_year ON docs(first_author_key, year);
CREATE TABLE IF NOT EXISTS refs (
    id           INTEGER PRIMARY KEY,
    doc_id       INTEGER NOT NULL REFERENCES docs(id) ON DELETE CASCADE,
    num          INTEGER NOT NULL,      -- number printed in a numbered list, else the entry's position
    raw          TEXT NOT NULL,
    doi          TEXT,
    title        TEXT,
    first_author TEXT,
    year         INTEGER
);
CREATE INDEX IF NOT EXISTS refs_doc ON refs(doc_id, num);
CREATE TABLE IF NOT EXISTS chunk_cites (
    chunk_id INTEGER NOT NULL REFERENCES chunks(id) ON DELETE CASCADE,
    ref_id   INTEGER NOT NULL REFERENCES refs(id) ON DELETE CASCADE,
    marker   TEXT NOT NULL,              -- the marker as it stands in the chunk text, e.g. "[2-4]"
    PRIMARY KEY (chunk_id, ref_id)
);
CREATE INDEX IF NOT EXISTS chunk_cites_ref ON chunk_cites(ref_id);
"""


def _migrate_1_to_2(conn: sqlite3.Connection, has_fts5: bool) -> None:
    run_statements(conn, SCHEMA_V2)
    # keys for documents written before: titles and authors are already stored
    for doc_id, title, authors in conn.execute("SELECT id, title, authors FROM docs").fetchall():
        names = json.loads(authors or "[]")
        conn.execute(
            "UPDATE docs SET title_key = ?, first_author_key = ? WHERE id = ?",
            (title_key(title), surname_key(names[0]) if names else None, doc_id),
        )


MIGRATIONS[0] = _migrate_0_to_1
MIGRATIONS[1] = _migrate_1_to_2

SCHEMA_V3 = """
ALTER TABLE docs ADD COLUMN zotero_key TEXT;             -- key of the Zotero parent item
ALTER TABLE docs ADD COLUMN zotero_attachment_key TEXT;  -- key of the attachment (deep links open it)
ALTER TABLE docs ADD COLUMN zotero_version INTEGER;      -- highest Zotero version of item, attachment, annotations
ALTER TABLE docs ADD COLUMN collections TEXT;            -- JSON list of collection paths ("Materials/Graphene")
ALTER TABLE docs ADD COLUMN tags TEXT;                   -- JSON list of tag names
CREATE INDEX IF NOT EXISTS docs_zotero_key ON docs(zotero_attachment_key);
"""


def _migrate_2_to_3(conn: sqlite3.Connection, has_fts5: bool) -> None:
    run_statements(conn, SCHEMA_V3)


MIGRATIONS[2] = _migrate_2_to_3

SCHEMA_V4 = """
ALTER TABLE docs ADD COLUMN page_coverage TEXT;   -- JSON: text pages, pages with chunks, pages without and why
"""


def _migrate_3_to_4(conn: sqlite3.Connection, has_fts5: bool) -> None:
    run_statements(conn, SCHEMA_V4)


MIGRATIONS[3] = _migrate_3_to_4

SCHEMA_V5 = """
ALTER TABLE docs ADD COLUMN metadata_source TEXT;   -- JSON: field -> extracted | crossref | zotero
ALTER TABLE docs ADD COLUMN path_bytes BLOB;        -- the file's path as bytes, where it is not valid UTF-8
CREATE TABLE IF NOT EXISTS metadata_lookups (       -- answers of the opt-in online check, so each is asked once
    key        TEXT PRIMARY KEY,                    -- doi:<doi> or title:<normalised title>
    found      INTEGER NOT NULL,                    -- 0: the service has no such record
    record     TEXT,                                -- JSON: the fields kb-rag uses from the answer
    fetched_at REAL NOT NULL
);
"""


def _migrate_4_to_5(conn: sqlite3.Connection, has_fts5: bool) -> None:
    run_statements(conn, SCHEMA_V5)


MIGRATIONS[4] = _migrate_4_to_5

SCHEMA_V6 = """
ALTER TABLE docs ADD COLUMN zotero_library TEXT;    -- the Zotero library: "My Library", or a group's name
ALTER TABLE docs ADD COLUMN zotero_group INTEGER;   -- a group library's id (its deep links name it), else NULL
"""


def _migrate_5_to_6(conn: sqlite3.Connection, has_fts5: bool) -> None:
    run_statements(conn, SCHEMA_V6)


MIGRATIONS[5] = _migrate_5_to_6

SCHEMA_V7 = """
ALTER TABLE docs ADD COLUMN work_type TEXT;        -- journal-article | conference-paper | phd-thesis | ... | document
ALTER TABLE docs ADD COLUMN volume TEXT;           -- as printed ("574", "26", "S1")
ALTER TABLE docs ADD COLUMN issue TEXT;
ALTER TABLE docs ADD COLUMN page_range TEXT;       -- "147-154", or an article number as printed ("061102")
ALTER TABLE docs ADD COLUMN publisher TEXT;        -- a thesis's university, a report's institution, a book's publisher
ALTER TABLE docs ADD COLUMN report_number TEXT;
ALTER TABLE docs ADD COLUMN arxiv_id TEXT;
ALTER TABLE docs ADD COLUMN authors_more INTEGER NOT NULL DEFAULT 0;  -- 1: the byline is not the whole list
"""


def _migrate_6_to_7(conn: sqlite3.Connection, has_fts5: bool) -> None:
    run_statements(conn, SCHEMA_V7)


MIGRATIONS[6] = _migrate_6_to_7


def names_match(stored: str | None, wanted: str, nested: int) -> int:
    """SQL function kb_names_match: does a JSON list of names (Zotero collection paths or tags) hold ``wanted``
    as a whole name, ignoring case? With ``nested``, "Materials" also covers "Materials/Graphene", and
    "Graphene" covers "Materials/Graphene"."""
    try:
        names = json.loads(stored) if stored else []
    except ValueError:
        return 0
    want = "/".join(part.strip() for part in wanted.casefold().split("/") if part.strip())
    if not want or not isinstance(names, list):
        return 0
    for name in names:
        name = str(name).casefold()
        if name == want or (nested and f"/{want}/" in f"/{name}/"):
            return 1
    return 0


# Paths. A file name that is not valid UTF-8 (an archive unpacked from a GBK system) cannot be stored as text or
# sent as JSON as it is: the library stores and shows a readable spelling of it (``path_key``) and keeps the real
# bytes in docs.path_bytes, from which ``fs_path`` gives the path to open.
_NAME_ENCODINGS = ("utf-8", "gb18030", "big5", "shift_jis", "cp1252")


def path_key(path: str) -> str:
    """How a file path is stored in the library and shown: the path itself, or a readable spelling of it."""
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        pass
    parts = []
    for part in os.fsencode(path).split(os.fsencode(os.sep)):
        for encoding in _NAME_ENCODINGS:
            try:
                parts.append(part.decode(encoding))
                break
            except UnicodeDecodeError:
                continue
        else:
            parts.append(part.decode("latin-1"))
    return os.sep.join(parts)


def path_bytes(path: str) -> bytes | None:
    """The raw bytes of a path whose stored spelling differs from it, else None."""
    return os.fsencode(path) if path_key(path) != path else None


def fs_path(row: sqlite3.Row) -> str:
    """The path to open for a stored document (its raw bytes when its name is not UTF-8)."""
    raw = row["path_bytes"] if "path_bytes" in row.keys() else None  # noqa: SIM118 (`in` on a Row reads values)
    return os.fsdecode(raw) if raw else row["path"]


def title_key(title: str | None) -> str | None:
    """Title reduced to lower-case letters and digits: equal keys mean the same title."""
    key = re.sub(r"[\W_]+", "", unicodedata.normalize("NFKC", title or "").casefold())
    return key if len(key) >= 12 else None


def split_person_name(name: str) -> tuple[str, str, str]:
    """(given, family, suffix) of 'Given Family', 'Family, Given', 'Family G.' / 'Family GA', with 'Jr.' etc."""
    name = (name or "").strip()
    suffix = ""
    suffixed = re.match(r"^(.+?),?\s+(Jr\.?|Sr\.?|II|III|IV)$", name)
    if suffixed and " " in suffixed.group(1).strip():
        name, suffix = suffixed.group(1).strip(), suffixed.group(2)
    if "," in name:
        family, given = (part.strip() for part in name.split(",", 1))
        return given, family, suffix
    parts = name.split()
    if len(parts) > 1 and re.fullmatch(r"(?:[A-Z]\.?-?){1,3}", parts[-1]) and not re.fullmatch(r"[A-Z]\.?", parts[0]):
        return parts[-1], " ".join(parts[:-1]), suffix  # "Smith J." / "Alhadainy HA"
    return " ".join(parts[:-1]), parts[-1] if parts else "", suffix


def surname_key(name: str | None) -> str | None:
    """Lower-case family name of 'Given Family', 'Family, Given' or 'Family G.' (None when unclear)."""
    name = re.sub(r"[\d*†‡§¶#,]+$", "", (name or "").strip()).strip()
    name = re.sub(r",?\s+(?:Jr|Sr)\.?$|,?\s+(?:II|III|IV)$", "", name)  # "Timothy J. Triche, Jr."
    if not name:
        return None
    if cjk_ratio(name) > 0.5:
        return name.replace(" ", "")[:1]  # Chinese family names come first, almost always one character
    if "," in name:
        family = name.split(",")[0]
    else:
        parts = [p for p in re.split(r"\s+", name) if p]
        initials = [p for p in parts if re.fullmatch(r"(?:[A-Z]\.?-?)+", p)]
        if len(parts) > 1 and parts[-1] in initials:  # "Smith J." / "Smith JA"
            family = next((p for p in parts if p not in initials), parts[0])
        else:
            family = parts[-1]
    family = _strip_diacritics(family.strip(" .").casefold())
    return family if re.search(r"\w", family) else None


@functools.lru_cache(maxsize=1)
def sqlite_has_fts5() -> bool:
    if os.environ.get("KB_DISABLE_FTS5") == "1":
        return False
    try:
        probe = sqlite3.connect(":memory:")
        probe.execute("CREATE VIRTUAL TABLE probe USING fts5(x)")
        probe.close()
        return True
    except sqlite3.OperationalError:
        return False


class Library(LibraryQueries):
    """One knowledge base: the SQLite file under ``root`` and its connection, with the statements run on it (the
    reads and writes of the other modules are inherited from ``LibraryQueries``)."""

    def __init__(self, root: Path, conn: sqlite3.Connection, writable: bool):
        self.root = root
        self.conn = conn
        self.writable = writable
        self.has_fts5 = self._table_exists("chunks_fts")
        # chunk ids removed / vectors stored by this process (committed) since the engine synced its index
        self.removed_chunk_ids: list[int] = []
        self.stored_vector_ids: list[int] = []
        self._txn_removed: list[int] = []
        self._txn_stored: list[int] = []
        self._term_counts: tuple | None = None  # (generation, terms, result) of the last term_counts call

    @property
    def db_path(self) -> Path:
        return self.root / DB_FILENAME

    @classmethod
    def open(cls, root: Path, writable: bool, migrate: bool = True) -> Library | None:
        """Open the library; a read-only open of a missing library gives None. A read-only open of a library of
        an older schema migrates it first, unless ``migrate`` is False (the watcher never writes a library that
        no command asked for)."""
        db_path = root / DB_FILENAME
        if not writable and not db_path.exists():
            return None
        if writable:
            root.mkdir(parents=True, exist_ok=True)
            if db_path.is_symlink() and not db_path.exists():
                # SQLite would create the link's target wherever it points: a library is never made through a link
                raise KBError(
                    "bad_request",
                    f"{db_path} is a symbolic link to {os.readlink(db_path)}, which does not "
                    "exist: no library is created through a link (remove the link, or "
                    "name the library's real folder as kb_root)",
                )
        conn = sqlite3.connect(
            str(db_path), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
        )
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.create_function("kb_names_match", 3, names_match, deterministic=True)
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if writable and version <= SCHEMA_VERSION:
                if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                    conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("PRAGMA synchronous = NORMAL")
                cls._migrate(conn, version)
        except BaseException:
            conn.close()
            raise
        if writable and version > SCHEMA_VERSION:
            conn.close()
            raise KBError(
                "schema_too_new",
                f"{db_path} was written by a newer kb-rag (schema {version}); "
                f"this engine knows schema {SCHEMA_VERSION}. Upgrade kb-rag.",
            )
        if writable:
            pass
        elif version > SCHEMA_VERSION:
            conn.close()
            raise KBError(
                "schema_too_new",
                f"{db_path} was written by a newer kb-rag (schema {version}); "
                f"this engine knows schema {SCHEMA_VERSION}. Upgrade kb-rag.",
            )
        elif version < SCHEMA_VERSION:
            conn.close()
            if version == 0:
                return None
            if not migrate:
                raise KBError("needs_migration", f"{db_path} uses schema {version}; any command migrates it")
            # a library written by an older engine: bring it to this schema (one short transaction), then read
            try:
                cls.open(root, writable=True).close()  # type: ignore[union-attr]
            except (sqlite3.DatabaseError, OSError) as exc:
                raise KBError(
                    "needs_migration",
                    f"{db_path} uses schema {version} and cannot be brought to "
                    f"{SCHEMA_VERSION} here ({_short_error(exc)}); run an ingest with "
                    "write access once",
                ) from None
            return cls.open(root, writable=False)
        else:
            conn.execute("PRAGMA query_only = ON")
        return cls(root, conn, writable)

    @staticmethod
    def _migrate(conn: sqlite3.Connection, version: int) -> None:
        if version > SCHEMA_VERSION:
            raise KBError(
                "schema_too_new",
                f"the library uses schema {version}, newer than this engine's {SCHEMA_VERSION}. Upgrade kb-rag.",
            )
        if version == SCHEMA_VERSION:
            return
        # All steps in one transaction: a reader in another process sees the old schema or the current one,
        # never a half-migrated library between two steps.
        conn.execute("BEGIN IMMEDIATE")
        try:
            current = conn.execute("PRAGMA user_version").fetchone()[0]  # another process may have migrated
            while current < SCHEMA_VERSION:
                MIGRATIONS[current](conn, sqlite_has_fts5())
                current += 1
                conn.execute(f"PRAGMA user_version = {current}")
                conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('schema_version', ?)", (str(current),))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _table_exists(self, name: str) -> bool:
        row = self.conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (name,)).fetchone()
        return row is not None

    def close(self) -> None:
        self.conn.close()

    # -- transactions ---------------------------------------------------------
    def transaction(self):
        return _Transaction(self.conn, on_commit=self._bump_generation, on_end=self._after_transaction)

    def _after_transaction(self, committed: bool) -> None:
        if committed:
            self.removed_chunk_ids.extend(self._txn_removed)
            self.stored_vector_ids.extend(self._txn_stored)
        self._txn_removed, self._txn_stored = [], []

    def generation(self) -> int:
        """Counter bumped by every committed write, in any process: caches compare against it."""
        value = self.get_meta("generation")
        return int(value) if value and value.isdigit() else 0

    def _bump_generation(self) -> None:
        self.conn.execute(
            "INSERT INTO meta(key, value) VALUES ('generation', '1') ON CONFLICT(key) DO UPDATE "
            "SET value = CAST(CAST(value AS INTEGER) + 1 AS TEXT)"
        )

    # -- meta -----------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        self.conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, value))

    # -- documents ------------------------------------------------------------
    def doc_by_path(self, path: str) -> sqlite3.Row | None:
        """The row of a file path (as found on disk, or as stored)."""
        return self.conn.execute("SELECT * FROM docs WHERE path = ?", (path_key(path),)).fetchone()

    def docs_by_sha(self, sha256: str) -> list[sqlite3.Row]:
        return self.conn.execute("SELECT * FROM docs WHERE sha256 = ? ORDER BY id", (sha256,)).fetchall()

    def upsert_doc(self, path: str, fields: dict) -> int:
        """Insert or update the row of ``path``; returns its id."""
        existing = self.doc_by_path(path)
        if path_bytes(path) is not None:
            fields = {**fields, "path_bytes": path_bytes(path)}
        # text derived from an undecodable file name (a title taken from it) is stored in its readable spelling
        fields = {k: path_key(v) if isinstance(v, str) else v for k, v in fields.items()}
        path = path_key(path)
        columns = list(fields)
        if existing is None:
            placeholders = ", ".join("?" for _ in columns)
            cur = self.conn.execute(
                f"INSERT INTO docs(path, {', '.join(columns)}) VALUES (?, {placeholders})",
                [path] + [fields[c] for c in columns],
            )
            return int(cur.lastrowid or 0)
        assignments = ", ".join(f"{c} = ?" for c in columns)
        self.conn.execute(
            f"UPDATE docs SET {assignments} WHERE id = ?", [fields[c] for c in columns] + [existing["id"]]
        )
        return existing["id"]

    def delete_chunks(self, doc_id: int) -> None:
        self._txn_removed.extend(r[0] for r in self.conn.execute("SELECT id FROM chunks WHERE doc_id = ?", (doc_id,)))
        if not self.has_fts5:
            self.conn.execute(
                "DELETE FROM chunk_terms WHERE chunk_id IN (SELECT id FROM chunks WHERE doc_id = ?)", (doc_id,)
            )
        self.conn.execute("DELETE FROM chunks WHERE doc_id = ?", (doc_id,))

    def insert_chunks(self, doc_id: int, chunks: list[Chunk], heading_prefix: str, first_seq: int = 0) -> list[int]:
        ids = []
        for seq, chunk in enumerate(chunks, start=first_seq):
            cur = self.conn.execute(
                "INSERT INTO chunks(doc_id, seq, section, block, weight, text, page, page_end, page_label, "
                "char_start, char_end, page_map) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    doc_id,
                    seq,
                    chunk.section,
                    chunk.block,
                    chunk.weight,
                    chunk.text,
                    chunk.page,
                    chunk.page_end,
                    chunk.page_label,
                    chunk.char_start,
                    chunk.char_end,
                    json.dumps(chunk.page_map),
                ),
            )
            ids.append(int(cur.lastrowid or 0))
            body = analyzed_string(chunk.text)
            heading = analyzed_string(f"{heading_prefix} {chunk.section}")
            if self.has_fts5:
                self.conn.execute(
                    "INSERT INTO chunks_fts(rowid, body, heading) VALUES (?, ?, ?)", (cur.lastrowid, body, heading)
                )
            else:
                self.conn.execute(
                    "INSERT INTO chunk_terms(chunk_id, body, heading) VALUES (?, ?, ?)", (cur.lastrowid, body, heading)
                )
        return ids

    def replace_references(self, doc_id: int, references: list, chunk_ids: list[int], links: list) -> None:
        """Store a document's reference entries and which chunk cites which (replacing earlier ones)."""
        self.conn.execute("DELETE FROM refs WHERE doc_id = ?", (doc_id,))
        ref_ids = []
        for ref in references:
            cur = self.conn.execute(
                "INSERT INTO refs(doc_id, num, raw, doi, title, first_author, year) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (doc_id, ref.num, ref.raw, ref.doi, ref.title, ref.first_author, ref.year),
            )
            ref_ids.append(cur.lastrowid)
        self.conn.executemany(
            "INSERT OR IGNORE INTO chunk_cites(chunk_id, ref_id, marker) VALUES (?, ?, ?)",
            [
                (chunk_id, ref_ids[index], marker)
                for chunk_id, chunk_links in zip(chunk_ids, links)
                for marker, index in chunk_links
            ],
        )

    def replace_block_chunks(self, doc_id: int, block: str, chunks: list[Chunk], title: str) -> None:
        """Swap a document's chunks of one kind (Zotero annotations) and keep its chunk count right."""
        old = [r[0] for r in self.conn.execute("SELECT id FROM chunks WHERE doc_id = ? AND block = ?", (doc_id, block))]
        self._txn_removed.extend(old)
        if old:
            marks = ", ".join("?" * len(old))
            if not self.has_fts5:
                self.conn.execute(f"DELETE FROM chunk_terms WHERE chunk_id IN ({marks})", old)
            self.conn.execute(f"DELETE FROM chunks WHERE id IN ({marks})", old)
        next_seq = self.conn.execute(
            "SELECT COALESCE(MAX(seq), -1) + 1 FROM chunks WHERE doc_id = ?", (doc_id,)
        ).fetchone()[0]
        self.insert_chunks(doc_id, chunks, title, first_seq=next_seq)
        self.conn.execute(
            "UPDATE docs SET chunk_count = (SELECT COUNT(*) FROM chunks WHERE doc_id = ?) WHERE id = ?",
            (doc_id, doc_id),
        )

    def reindex_headings(self, doc_id: int, title: str) -> None:
        """Rewrite the keyword index's heading column (title + section) after a title change."""
        rows = self.conn.execute("SELECT id, section FROM chunks WHERE doc_id = ?", (doc_id,)).fetchall()
        for chunk_id, section in rows:
            heading = analyzed_string(f"{title} {section}")
            if self.has_fts5:
                self.conn.execute("UPDATE chunks_fts SET heading = ? WHERE rowid = ?", (heading, chunk_id))
            else:
                self.conn.execute("UPDATE chunk_terms SET heading = ? WHERE chunk_id = ?", (heading, chunk_id))

    def delete_doc(self, doc_id: int) -> None:
        self.delete_chunks(doc_id)
        self.conn.execute("DELETE FROM docs WHERE id = ?", (doc_id,))

    def move_doc(self, doc_id: int, path: str, size: int, mtime_ns: int) -> None:
        """Point a document at a new file path (inside the caller's transaction); its passages stay."""
        self.conn.execute(
            "UPDATE docs SET path = ?, path_bytes = ?, size = ?, mtime_ns = ? WHERE id = ?",
            (path_key(path), path_bytes(path), size, mtime_ns, doc_id),
        )

    def set_doc_metadata(
        self,
        doc_id: int,
        title: str | None,
        authors: list[str],
        year: int | None,
        journal: str | None,
        doi: str | None,
        sources: dict,
        bib: dict | None = None,
    ) -> None:
        """Write a document's title, authors, year, journal and DOI with their match keys, its bibliographic
        fields (``bib``: column -> value, config.BIB_FIELDS), and where each field came from
        (``sources``: field -> extracted | crossref | zotero), inside the caller's transaction."""
        bib = {name: value for name, value in (bib or {}).items() if name in BIB_FIELDS}
        self.conn.execute(
            "UPDATE docs SET title = ?, authors = ?, year = ?, journal = ?, doi = ?, title_key = ?, "
            "first_author_key = ?, metadata_source = ?" + "".join(f", {name} = ?" for name in bib) + " WHERE id = ?",
            (
                title,
                json.dumps(authors, ensure_ascii=False),
                year,
                journal,
                doi,
                title_key(title),
                surname_key(authors[0]) if authors else None,
                json.dumps(sources),
                *bib.values(),
                doc_id,
            ),
        )

    def clear(self) -> dict[str, int]:
        """Delete every document, passage, vector and cached answer in one transaction, then give the space back
        (VACUUM); the documents and passages there were."""
        counts = {"docs": self.count_docs(), "chunks": self.count_chunks()}
        with self.transaction():
            if self.has_fts5:
                self.conn.execute("DELETE FROM chunks_fts")
            else:
                self.conn.execute("DELETE FROM chunk_terms")
            self.forget_vectors()
            self.conn.execute("DELETE FROM chunks")
            self.conn.execute("DELETE FROM docs")
            self.conn.execute("DELETE FROM cache")
        self.conn.execute("VACUUM")
        return counts

    def invalidate_cache(self) -> None:
        self.conn.execute("DELETE FROM cache")

    # -- vectors --------------------------------------------------------------
    def vector_model(self) -> tuple[str | None, int | None]:
        dim = self.get_meta("embed_dim")
        return self.get_meta("embed_model"), int(dim) if dim and dim.isdigit() else None

    def chunk_ids_missing_vectors(self) -> list[int]:
        return [
            r[0]
            for r in self.conn.execute(
                "SELECT c.id FROM chunks c LEFT JOIN vecs v ON v.chunk_id = c.id "
                "WHERE v.chunk_id IS NULL ORDER BY length(c.text), c.id"
            )
        ]

    def chunk_passages(self, ids: list[int] | None = None, path: str | None = None) -> list[tuple[int, str, str, str]]:
        """(id, document title, section, text) of the chunks given by id (those that still exist, in the order
        given) or of the document at ``path`` (in reading order): what the embedder reads."""
        sql = "SELECT c.id, COALESCE(d.title, ''), c.section, c.text FROM chunks c JOIN docs d ON d.id = c.doc_id "
        if path is not None:
            return [tuple(r) for r in self.conn.execute(sql + "WHERE d.path = ? ORDER BY c.seq", (path_key(path),))]
        ids = ids or []
        found = {r[0]: tuple(r) for r in self.conn.execute(sql + f"WHERE c.id IN ({', '.join('?' * len(ids))})", ids)}
        return [found[i] for i in ids if i in found]

    def passage_format(self) -> str | None:
        """How the library's vectors were made from chunks (see PASSAGE_FORMATS); None without vectors."""
        if self.vector_model()[0] is None:
            return None
        return self.get_meta("embed_passage_format") or "text/0"

    def passage_prompt(self) -> str | None:
        """The prompt put before every passage the library's vectors were made from; None without vectors.
        Libraries from before prompts were recorded had none."""
        if self.vector_model()[0] is None:
            return None
        return self.get_meta("embed_passage_prompt") or ""

    def count_missing_vectors(self) -> int:
        return self.conn.execute(
            "SELECT COUNT(*) FROM chunks c LEFT JOIN vecs v ON v.chunk_id = c.id WHERE v.chunk_id IS NULL"
        ).fetchone()[0]

    def term_counts(self, terms: list[str]) -> tuple[int, dict[str, int]]:
        """(chunks in the library, chunks holding each term). A query asks twice (ranking, then snippets) and
        on a big library each read costs tens of milliseconds, so the last answer is kept per generation."""
        generation, key = self.generation(), tuple(terms)
        if self._term_counts is not None and self._term_counts[:2] == (generation, key):
            return self._term_counts[2]
        total = self.conn.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]
        counts = {t: 0 for t in terms}
        if self.has_fts5 and terms:
            counts.update(
                self.conn.execute(
                    f"SELECT term, doc FROM chunks_vocab WHERE term IN ({', '.join('?' * len(terms))})", terms
                ).fetchall()
            )
        self._term_counts = (generation, key, (total, counts))
        return total, counts

    def store_model_vectors(
        self, model: str, dim: int, ids: list[int], matrix, passage_format: str, passage_prompt: str
    ) -> None:
        """Store vectors in one transaction, recording the model, passage format and passage prompt that made
        them when they are the library's first."""
        with self.transaction():
            if self.vector_model()[0] is None:
                self.set_meta("embed_model", model)
                self.set_meta("embed_dim", str(dim))
                self.set_meta("embed_passage_format", passage_format)
                self.set_meta("embed_passage_prompt", passage_prompt)
            self.store_vectors(ids, matrix)

    def vector_refusal(self) -> dict | None:
        """Why the last encoding left passages without vectors (the model's output was refused): ``model``,
        ``reason`` and ``at``; None when it stored every vector it made."""
        try:
            value = json.loads(self.get_meta("vectors_refused") or "null")
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def record_vector_refusal(self, model: str, reason: str | None) -> None:
        """Remember why an encoding by ``model`` refused vectors, or (``reason`` None) that it refused none."""
        if reason is None and self.get_meta("vectors_refused") is None:
            return
        with self.transaction():
            if reason is None:
                self.conn.execute("DELETE FROM meta WHERE key = 'vectors_refused'")
            else:
                self.set_meta(
                    "vectors_refused",
                    json.dumps({"model": model, "reason": reason, "at": now_iso()}, ensure_ascii=False),
                )

    def forget_vectors(self) -> None:
        """Drop every vector and what the library recorded about the model that made them."""
        self.conn.execute("DELETE FROM vecs")
        self.conn.execute(f"DELETE FROM meta WHERE key IN ({', '.join('?' * len(VECTOR_META_KEYS))})", VECTOR_META_KEYS)

    def store_vectors(self, ids: list[int], matrix) -> None:
        import numpy as np

        rows = [(chunk_id, np.asarray(vector, dtype=np.float32).tobytes()) for chunk_id, vector in zip(ids, matrix)]
        self.conn.executemany("INSERT OR REPLACE INTO vecs(chunk_id, vec) VALUES (?, ?)", rows)
        self._txn_stored.extend(ids)


class _Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT``; rolls back on any exception."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        on_commit: Callable[[], None] | None = None,
        on_end: Callable[[bool], None] | None = None,
    ):
        self.conn = conn
        self.on_commit = on_commit
        self.on_end = on_end

    def __enter__(self):
        self.conn.execute("BEGIN IMMEDIATE")
        return self.conn

    def _rollback(self) -> None:
        # SQLite has already rolled back after some errors (a full disk): only roll back what is still open
        if self.conn.in_transaction:
            self.conn.execute("ROLLBACK")

    def __exit__(self, exc_type, exc, tb):
        committed = False
        try:
            if exc_type is None:
                try:
                    if self.on_commit:
                        self.on_commit()
                    self.conn.execute("COMMIT")
                except BaseException:
                    self._rollback()
                    raise
                committed = True
            else:
                self._rollback()
        finally:
            if self.on_end:
                self.on_end(committed)
        return False


def is_disk_full(exc: BaseException) -> bool:
    """SQLite's SQLITE_FULL, or a write that found no space left on the device."""
    if isinstance(exc, sqlite3.OperationalError):
        return getattr(exc, "sqlite_errorcode", None) == 13 or "disk is full" in str(exc)
    return isinstance(exc, OSError) and exc.errno == 28  # ENOSPC


class DiskFull(KBError):
    """The library's disk filled up: what was committed stays, the reply keeps the entries of the files written."""

    def __init__(self, root: Path, details: dict | None = None):
        import shutil

        try:
            free = f"{shutil.disk_usage(root).free / (1024 * 1024):.1f} MB free"
        except OSError:
            free = "free space unknown"
        done = (
            (
                "the files before the one in flight are stored, that one was rolled back. Free some space and run "
                "the same ingest again: it goes on where it stopped"
            )
            if details
            else "nothing was written. Free some space and try again"
        )
        super().__init__("disk_full", f"the disk holding the library {root} is full ({free}); {done}")
        self.details = details or {}


TEMPORARY_TRIES = 16  # random temporary names tried before giving up (a clash is already one in 2**64)


def _new_temporary(path: Path, mode: int = 0o666) -> tuple[int, Path]:
    """A new empty file beside ``path``, open for writing: (its descriptor, its path). The name is random, so no
    one can plant anything at it in advance, and the file is created exclusively without following a link
    (O_EXCL | O_NOFOLLOW): in a folder other users may write to (a shared ``show --dest``), a link put there by
    someone else is never written through. ``mode`` is narrowed by the umask, as for any new file."""
    import secrets

    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    for _ in range(TEMPORARY_TRIES):
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            return os.open(temporary, flags, mode), temporary
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def _write_atomically(path: Path, data: bytes, mode: int = 0o666) -> None:
    """Write ``data`` as the file ``path`` at once: into a new temporary file beside it (``_new_temporary``), then
    renamed over it, so that a reader sees the old file or the new one, never a part, and a link at ``path`` is
    replaced, not followed. The one way the engine writes a file whole; a failed write leaves no temporary file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = _new_temporary(path, mode)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def sha256_of_file(path: str, block_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(block_size), b""):
            digest.update(block)
    return digest.hexdigest()
