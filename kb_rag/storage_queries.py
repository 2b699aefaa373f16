"""Storage queries: the statements commands, ingest, retrieval and answers run on the library's tables, as
methods ``Library`` inherits (documents, passages, the keyword index, vectors, references, Crossref answers).

Storage owns every statement on the library's tables: a module above it calls these methods and never the
connection itself (``tests/static/test_storage_owns_sql.py``). The methods that also need storage's own helpers
(path spellings, name keys, transactions) are in ``storage.py``.

May import: config.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator

from .config import FTS_COLUMN_WEIGHTS

# SQLite's default limit on a statement's variables is 999: longer id lists are read in batches of this many.
SQL_ID_BATCH = 900


def _marks(values) -> str:
    return ", ".join("?" * len(values))


class LibraryQueries:
    """The library's reads and writes by concern; ``Library`` (storage.py) holds the connection."""

    conn: sqlite3.Connection
    has_fts5: bool

    # -- counts ---------------------------------------------------------------
    def count_docs(self) -> int:
        return self.conn.execute("SELECT COUNT(*) FROM docs").fetchone()[0]

    def count_chunks(self) -> int:
        return self.conn.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]

    def count_chunks_of_doc(self, doc_id: int) -> int:
        """The passages of one document, counted (``docs.chunk_count`` is what the ingest recorded)."""
        return self.conn.execute("SELECT COUNT(*) FROM chunks WHERE doc_id = ?", (doc_id,)).fetchone()[0]

    def indexed_languages(self) -> dict[str, int]:
        """Indexed documents by language (those without one left out)."""
        return dict(
            self.conn.execute(
                "SELECT lang, COUNT(*) FROM docs WHERE status = 'indexed' AND lang IS NOT NULL GROUP BY lang"
            ).fetchall()
        )

    def library_counts(self, parser_revision: int) -> dict:
        """What ``stats`` counts: documents by status, indexed ones by kind and language, passages, vectors, and
        the indexed documents read by a parser older than ``parser_revision``."""
        conn = self.conn
        by_status = dict(conn.execute("SELECT status, COUNT(*) FROM docs GROUP BY status").fetchall())
        kinds = dict(conn.execute("SELECT kind, COUNT(*) FROM docs WHERE status = 'indexed' GROUP BY kind").fetchall())
        langs = self.indexed_languages()
        chunks = self.count_chunks()
        vectors = conn.execute("SELECT COUNT(*) FROM vecs").fetchone()[0]
        return {
            "by_status": by_status,
            "kinds": kinds,
            "langs": langs,
            "chunks": chunks,
            "vectors": vectors,
            "stale": self.count_stale_docs(parser_revision),
        }

    def count_stale_docs(self, revision: int) -> int:
        """Indexed documents read by a parser older than ``revision`` (stats, and the stale-documents notice)."""
        return self.conn.execute(
            "SELECT COUNT(*) FROM docs WHERE status = 'indexed' AND indexed_with < ?", (revision,)
        ).fetchone()[0]

    def schema_version(self) -> int:
        return self.conn.execute("PRAGMA user_version").fetchone()[0]

    def indexed_chunks_in_languages(self, langs: tuple[str, ...]) -> int:
        """The passages of the indexed documents written in these languages."""
        return self.conn.execute(
            f"SELECT COALESCE(SUM(chunk_count), 0) FROM docs WHERE status = 'indexed' AND lang IN ({_marks(langs)})",
            langs,
        ).fetchone()[0]

    # -- documents ------------------------------------------------------------
    def doc_by_id(self, doc_id: int) -> sqlite3.Row | None:
        return self.conn.execute("SELECT * FROM docs WHERE id = ?", (doc_id,)).fetchone()

    def doc_ids(self) -> list[int]:
        return [row[0] for row in self.conn.execute("SELECT id FROM docs ORDER BY id")]

    def doc_path_by_id(self, doc_id: int) -> sqlite3.Row | None:
        """(id, path) of a document."""
        return self.conn.execute("SELECT id, path FROM docs WHERE id = ?", (doc_id,)).fetchone()

    def recorded_chunk_count(self, doc_id: int) -> int:
        """The passages the library records for a document (``docs.chunk_count``)."""
        return self.conn.execute("SELECT chunk_count FROM docs WHERE id = ?", (doc_id,)).fetchone()[0]

    def doc_file_stamp(self, doc_id: int) -> sqlite3.Row | None:
        """What tells an indexed file from a changed one (path, size, mtime_ns, sha256) and its page coverage."""
        return self.conn.execute(
            "SELECT path, size, mtime_ns, sha256, page_coverage FROM docs WHERE id = ?", (doc_id,)
        ).fetchone()

    def doc_to_show(self, doc_id: int) -> sqlite3.Row | None:
        """The fields ``show`` needs of a document: its file, kind, title and pages."""
        return self.conn.execute(
            "SELECT id, path, kind, title, pages, size, mtime_ns, sha256 FROM docs WHERE id = ?", (doc_id,)
        ).fetchone()

    def original_file(self, doc_id: int) -> sqlite3.Row | None:
        """The file of the document a recorded duplicate stands for (path, path_bytes, status, sha256)."""
        return self.conn.execute("SELECT path, path_bytes, status, sha256 FROM docs WHERE id = ?", (doc_id,)).fetchone()

    def docs_with_statuses(self, statuses: tuple[str, ...]) -> list[sqlite3.Row]:
        return self.conn.execute(
            f"SELECT * FROM docs WHERE status IN ({_marks(statuses)}) ORDER BY id", statuses
        ).fetchall()

    def indexed_docs(self) -> list[sqlite3.Row]:
        return self.conn.execute("SELECT * FROM docs WHERE status = 'indexed' ORDER BY id").fetchall()

    def indexed_docs_by_id(self, doc_ids: list[int]) -> dict[int, sqlite3.Row]:
        """The indexed documents among ``doc_ids``, by id."""
        if not doc_ids:
            return {}
        return {
            r["id"]: r
            for r in self.conn.execute(
                f"SELECT * FROM docs WHERE status = 'indexed' AND id IN ({_marks(doc_ids)})", doc_ids
            )
        }

    def doc_summaries(self, doc_ids: list[int]) -> dict[int, sqlite3.Row]:
        """id, title, authors, year, doi and path of these documents, by id."""
        if not doc_ids:
            return {}
        return {
            r["id"]: r
            for r in self.conn.execute(
                f"SELECT id, title, authors, year, doi, path FROM docs WHERE id IN ({_marks(doc_ids)})", doc_ids
            )
        }

    def docs_page(self, status: str | None, limit: int, offset: int) -> tuple[int, sqlite3.Cursor]:
        """(how many documents there are, with ``status`` when given; the rows of one page of them by id)."""
        where, params = ("WHERE status = ?", [status]) if status else ("", [])
        total = self.conn.execute(f"SELECT COUNT(*) FROM docs {where}", params).fetchone()[0]
        rows = self.conn.execute(f"SELECT * FROM docs {where} ORDER BY id LIMIT ? OFFSET ?", params + [limit, offset])
        return total, rows

    def count_recorded_duplicates(self) -> int:
        return self.conn.execute("SELECT COUNT(*) FROM docs WHERE status = 'duplicate'").fetchone()[0]

    def indexed_page_coverage(self) -> sqlite3.Cursor:
        """(id, path, page_coverage JSON) of the indexed documents that record their page coverage, by id."""
        return self.conn.execute(
            "SELECT id, path, page_coverage FROM docs WHERE status = 'indexed' "
            "AND page_coverage IS NOT NULL ORDER BY id"
        )

    def docs_at_or_under(self, path: str) -> list[sqlite3.Row]:
        """(id, path) of the document stored at ``path`` and of every one under it taken as a folder."""
        return self.conn.execute(
            "SELECT id, path FROM docs WHERE path = ? OR substr(path, 1, ?) = ?",
            (path, len(path) + 1, path.rstrip(os.sep) + os.sep),
        ).fetchall()

    def stored_files_under(self, prefix: str) -> list[sqlite3.Row]:
        """(path, size, mtime_ns) of every document whose stored path starts with ``prefix``."""
        return self.conn.execute(
            "SELECT path, size, mtime_ns FROM docs WHERE substr(path, 1, ?) = ?", (len(prefix), prefix)
        ).fetchall()

    def held_files(self) -> sqlite3.Cursor:
        """(path, size, mtime_ns, status, duplicate_of, sha256) of every document."""
        return self.conn.execute("SELECT path, size, mtime_ns, status, duplicate_of, sha256 FROM docs")

    def docs_of_attachment(self, attachment_key: str, path: str) -> list[sqlite3.Row]:
        """(id, path) of the documents of a Zotero attachment: the one carrying its key, and a copy recorded at its
        file without a key."""
        return self.conn.execute(
            "SELECT id, path FROM docs WHERE zotero_attachment_key = ? OR (path = ? AND zotero_attachment_key IS NULL)",
            (attachment_key, path),
        ).fetchall()

    def stored_doi(self, path: str) -> str | None:
        """The DOI stored for the document at this stored path (None without one, or without the document)."""
        row = self.conn.execute("SELECT doi FROM docs WHERE path = ?", (path,)).fetchone()
        return row["doi"] if row is not None else None

    def fill_missing_doi(self, path: str, doi: str) -> None:
        """Give the document at this stored path a DOI, unless it has one (inside the caller's transaction)."""
        self.conn.execute("UPDATE docs SET doi = ? WHERE path = ? AND (doi IS NULL OR doi = '')", (doi, path))

    def set_doc_stat(self, doc_id: int, size: int, mtime_ns: int) -> None:
        """Record a file's new size and time, its content unchanged (inside the caller's transaction)."""
        self.conn.execute("UPDATE docs SET size = ?, mtime_ns = ? WHERE id = ?", (size, mtime_ns, doc_id))

    def delete_doc_record(self, doc_id: int) -> None:
        """Delete a document's row alone (a recorded duplicate, which has no passages of its own)."""
        self.conn.execute("DELETE FROM docs WHERE id = ?", (doc_id,))

    def mark_duplicate(self, doc_id: int, reason: str, error: str, duplicate_of: int) -> None:
        """Turn a document into a recorded duplicate of ``duplicate_of`` (its passages deleted by the caller, in
        the caller's transaction)."""
        self.conn.execute(
            "UPDATE docs SET status = 'duplicate', reason = ?, error = ?, duplicate_of = ?, "
            "chunk_count = 0 WHERE id = ?",
            (reason, error, duplicate_of, doc_id),
        )

    # -- cited works ----------------------------------------------------------
    def indexed_docs_by_doi(self, doi: str, exclude_doc: int) -> list[sqlite3.Row]:
        """(id, title, doi, path) of the indexed documents with this DOI, but ``exclude_doc``."""
        return self.conn.execute(
            "SELECT id, title, doi, path FROM docs WHERE doi = ? AND status = 'indexed' AND id != ?", (doi, exclude_doc)
        ).fetchall()

    def indexed_docs_by_title_key(self, key: str, exclude_doc: int) -> list[sqlite3.Row]:
        return self.conn.execute(
            "SELECT id, title, doi, path FROM docs WHERE title_key = ? AND status = 'indexed' AND id != ?",
            (key, exclude_doc),
        ).fetchall()

    def indexed_docs_by_author_year(self, first_author_key: str, year: int, exclude_doc: int) -> list[sqlite3.Row]:
        return self.conn.execute(
            "SELECT id, title, doi, path FROM docs WHERE first_author_key = ? AND year = ? "
            "AND status = 'indexed' AND id != ?",
            (first_author_key, year, exclude_doc),
        ).fetchall()

    def chunk_citations(self, chunk_id: int) -> list[sqlite3.Row]:
        """The reference entries a passage cites, with the marker it cites each by, in list order."""
        return self.conn.execute(
            "SELECT cc.marker, r.num, r.raw, r.doi, r.title, r.first_author, r.year FROM chunk_cites cc "
            "JOIN refs r ON r.id = cc.ref_id WHERE cc.chunk_id = ? ORDER BY r.num",
            (chunk_id,),
        ).fetchall()

    # -- Crossref answers -----------------------------------------------------
    def metadata_lookup(self, key: str) -> sqlite3.Row | None:
        """The stored answer (found, record, fetched_at) of an online metadata check."""
        return self.conn.execute(
            "SELECT found, record, fetched_at FROM metadata_lookups WHERE key = ?", (key,)
        ).fetchone()

    def store_metadata_lookup(self, key: str, found: bool, record: str | None, fetched_at: float) -> None:
        self.conn.execute(
            "INSERT OR REPLACE INTO metadata_lookups(key, found, record, fetched_at) VALUES (?, ?, ?, ?)",
            (key, found, record, fetched_at),
        )

    # -- passages -------------------------------------------------------------
    def hit_rows(self, chunk_ids: list[int]) -> dict[int, sqlite3.Row]:
        """What a search hit shows of each passage and its document, by chunk id."""
        return {
            row["id"]: row
            for row in self.conn.execute(
                "SELECT c.id, c.doc_id, c.section, c.block, c.text, c.page, c.page_end, c.page_label, c.page_map, "
                "d.path, d.title, d.authors, d.year, d.journal, d.doi, d.kind, d.page_labels, d.zotero_key, "
                "d.zotero_attachment_key, d.zotero_group, d.page_coverage FROM chunks c JOIN docs d ON d.id = c.doc_id "
                f"WHERE c.id IN ({', '.join('?' for _ in chunk_ids)})",
                chunk_ids,
            )
        }

    def chunk_page_maps(self, chunk_ids: list[int]) -> dict[int, sqlite3.Row]:
        """(id, text, page_map) of these passages, by id."""
        return {
            row["id"]: row
            for row in self.conn.execute(
                f"SELECT id, text, page_map FROM chunks WHERE id IN ({', '.join('?' for _ in chunk_ids)})", chunk_ids
            )
        }

    def chunk_texts(self, chunk_ids: list[int]) -> dict[int, str]:
        return dict(self.conn.execute(f"SELECT id, text FROM chunks WHERE id IN ({_marks(chunk_ids)})", chunk_ids))

    def chunk_weights(self, chunk_ids: list[int]) -> dict[int, float]:
        """The section weight of each passage, read SQL_ID_BATCH ids at a time."""
        weights: dict[int, float] = {}
        for start in range(0, len(chunk_ids), SQL_ID_BATCH):
            batch = chunk_ids[start : start + SQL_ID_BATCH]
            weights.update(
                self.conn.execute(f"SELECT id, weight FROM chunks WHERE id IN ({_marks(batch)})", batch).fetchall()
            )
        return weights

    def docs_of_chunks(self, chunk_ids: list[int]) -> dict[int, int]:
        """chunk id -> document id, read SQL_ID_BATCH ids at a time."""
        doc_of: dict[int, int] = {}
        for start in range(0, len(chunk_ids), SQL_ID_BATCH):
            batch = chunk_ids[start : start + SQL_ID_BATCH]
            doc_of.update(self.conn.execute(f"SELECT id, doc_id FROM chunks WHERE id IN ({_marks(batch)})", batch))
        return doc_of

    def doc_chunk_counts(self, doc_ids: list[int]) -> sqlite3.Cursor:
        """(document id, its passages) of these documents."""
        return self.conn.execute(
            f"SELECT doc_id, COUNT(*) FROM chunks WHERE doc_id IN ({_marks(doc_ids)}) GROUP BY doc_id", doc_ids
        )

    def chunk_ids_of_doc(self, doc_id: int) -> set[int]:
        return {row[0] for row in self.conn.execute("SELECT id FROM chunks WHERE doc_id = ?", (doc_id,))}

    def chunk_ids_where(self, where: str, params: list) -> list[int]:
        """The passages whose chunk (``c``) and document (``d``) pass ``where`` (`` AND ...`` conditions)."""
        rows = self.conn.execute(f"SELECT c.id FROM chunks c JOIN docs d ON d.id = c.doc_id WHERE 1 = 1{where}", params)
        return [r[0] for r in rows]

    def doc_passages(self, doc_id: int) -> sqlite3.Cursor:
        """(text, page_map) of a document's passages in order."""
        return self.conn.execute("SELECT text, page_map FROM chunks WHERE doc_id = ? ORDER BY id", (doc_id,))

    def doc_captions(self, doc_id: int) -> list[sqlite3.Row]:
        """(text, page) of a document's caption passages in order."""
        return self.conn.execute(
            "SELECT text, page FROM chunks WHERE doc_id = ? AND block = 'caption' ORDER BY id", (doc_id,)
        ).fetchall()

    def other_captions(self, doc_id: int, chunk_id: int) -> sqlite3.Cursor:
        """(id, text, page) of a document's caption passages other than ``chunk_id``."""
        return self.conn.execute(
            "SELECT id, text, page FROM chunks WHERE doc_id = ? AND block = 'caption' AND id != ?", (doc_id, chunk_id)
        )

    # -- the keyword index ----------------------------------------------------
    def fts_scores_among(self, match: str, chunk_ids: list[int]) -> list[tuple[int, float]]:
        """FTS5 BM25 of the given passages that ``match`` (the others are absent)."""
        # `+rowid`: offered to FTS5 as a rowid constraint, the list made SQLite run the whole MATCH once per id
        rows = self.conn.execute(
            "SELECT rowid, -bm25(chunks_fts, ?, ?) FROM chunks_fts WHERE chunks_fts MATCH ? "
            "AND +rowid IN (SELECT value FROM json_each(?))",
            [*FTS_COLUMN_WEIGHTS, match, json.dumps(chunk_ids)],
        ).fetchall()
        return [(row[0], float(row[1])) for row in rows]

    def fts_top(self, match: str, limit: int) -> list[tuple[int, float]]:
        """The best ``limit`` passages by FTS5 BM25, read from the index alone."""
        rows = self.conn.execute(
            "SELECT rowid, -bm25(chunks_fts, ?, ?) AS s FROM chunks_fts WHERE chunks_fts MATCH ? "
            "ORDER BY s DESC, rowid LIMIT ?",
            [*FTS_COLUMN_WEIGHTS, match, limit],
        ).fetchall()
        return [(row[0], float(row[1])) for row in rows]

    def fts_filtered_top(self, match: str, where: str, params: list, limit: int) -> list[tuple[int, float]]:
        """The best ``limit`` passages by FTS5 BM25 among those whose chunk and document pass ``where``."""
        sql = (
            "WITH hits AS (SELECT rowid AS id, bm25(chunks_fts, ?, ?) AS s FROM chunks_fts "
            "WHERE chunks_fts MATCH ?) "
            "SELECT c.id, -hits.s AS score FROM hits JOIN chunks c ON c.id = hits.id "
            f"JOIN docs d ON d.id = c.doc_id WHERE 1 = 1{where} ORDER BY score DESC, c.id LIMIT ?"
        )
        rows = self.conn.execute(sql, [*FTS_COLUMN_WEIGHTS, match, *params, limit]).fetchall()
        return [(row[0], float(row[1])) for row in rows]

    def fts_scores_between(self, match: str, lo: int, hi: int) -> list:
        """(rowid, FTS5 BM25) of the passages with ids from ``lo`` to ``hi`` that ``match``."""
        return self.conn.execute(
            "SELECT rowid, -bm25(chunks_fts, ?, ?) FROM chunks_fts WHERE chunks_fts MATCH ? AND rowid BETWEEN ? AND ?",
            [*FTS_COLUMN_WEIGHTS, match, lo, hi],
        ).fetchall()

    def term_strings(self) -> list:
        """(body, heading) term strings of every passage (the keyword index of a sqlite3 without FTS5)."""
        return self.conn.execute("SELECT body, heading FROM chunk_terms").fetchall()

    def filtered_term_strings(self, where: str, params: list) -> list:
        """(chunk id, body, heading) of the passages whose chunk and document pass ``where`` (without FTS5)."""
        return self.conn.execute(
            "SELECT c.id, t.body, t.heading FROM chunk_terms t JOIN chunks c ON "
            f"c.id = t.chunk_id JOIN docs d ON d.id = c.doc_id WHERE 1 = 1{where}",
            params,
        ).fetchall()

    # -- vectors --------------------------------------------------------------
    def all_vectors(self) -> sqlite3.Cursor:
        """(chunk id, vector bytes) of every stored vector: a cursor, for reading in parts."""
        return self.conn.execute("SELECT chunk_id, vec FROM vecs")

    def doc_vectors(self, doc_ids: list[int]) -> Iterator[tuple[int, bytes]]:
        """(document id, vector bytes) of every stored vector of these documents, SQL_ID_BATCH documents a read."""
        for start in range(0, len(doc_ids), SQL_ID_BATCH):
            batch = doc_ids[start : start + SQL_ID_BATCH]
            yield from self.conn.execute(
                "SELECT c.doc_id, v.vec FROM vecs v JOIN chunks c ON c.id = v.chunk_id "
                f"WHERE c.doc_id IN ({_marks(batch)})",
                batch,
            )

    def chunk_vectors(self, chunk_ids: list[int]) -> Iterator[tuple[int, bytes]]:
        """(chunk id, vector bytes) of the stored vectors of these passages, SQL_ID_BATCH a read."""
        for start in range(0, len(chunk_ids), SQL_ID_BATCH):
            batch = chunk_ids[start : start + SQL_ID_BATCH]
            yield from self.conn.execute(f"SELECT chunk_id, vec FROM vecs WHERE chunk_id IN ({_marks(batch)})", batch)
