"""A realistic Zotero 7 data directory, generated for the `zotero` command tests.

The database is created the way a new Zotero installation creates it: the current
schema files (system.sql, userdata.sql, triggers.sql from the shared Zotero
fixtures) are loaded into an empty ``zotero.sqlite``, then the item types, fields
and creator types are filled from ``schema.json`` with the ids Zotero assigns at
runtime (in the order of schema.json, so they differ from the fixed ids of Zotero
5 and from Zotero 6's: the engine has to look everything up by name). Without the
shared fixtures (CI) the project's own tables stand in: Zotero 7's tables and
columns that the engine reads, with a short list of item types (PROJECT_TABLES).

The library (see ``build_library``) holds real PDFs written by
examples/sample_papers.py:

=====  ==============================================================================
key    what
=====  ==============================================================================
A      journalArticle, imported PDF (graphene paper) with two highlight annotations
       (page labels "12"/"13", pageIndex 0/1), an HTML snapshot and a child note; in
       collection "Graphene" (nested in "Materials"); tags "cvd" and "review"; its
       Zotero title, date, journal, DOI and authors differ from what the PDF prints
B      journalArticle, imported PDF (two-column protein paper); collection
       "Biophysics"; tag "Review"
C      journalArticle, imported PDF (battery paper); no collection, no tag
D      journalArticle, imported PDF (ptarmigan paper), in the trash (deletedItems)
E      journalArticle, linked PDF (linkMode 2) with an absolute path outside the
       data directory (a folder name with a space)
F      journalArticle, imported PDF whose file is missing from storage/
G      journalArticle, linked PDF with a relative ``attachments:`` path (the base
       directory lives only in a Zotero profile's prefs.js, which is not created)
H      journalArticle, imported DOCX (coral paper)
=====  ==============================================================================

``ZoteroWriter`` adds items through any open sqlite3 connection, so a test can
also write to the database the way a running Zotero does (WAL, exclusive lock).

    python tests/zotero_fixture.py OUTDIR [--fixtures DIR]   # build and print a summary
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import re
import shutil
import sqlite3
import sys
import time
import unicodedata
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT / "examples") not in sys.path:
    sys.path.insert(0, str(ROOT / "examples"))

import sample_papers as sp  # noqa: E402

# Zotero's attachment link modes (Zotero.Attachments.LINK_MODE_*)
LINK_IMPORTED_FILE, LINK_IMPORTED_URL, LINK_LINKED_FILE, LINK_LINKED_URL = 0, 1, 2, 3
# annotation types (Zotero.Annotations.ANNOTATION_TYPE_*)
ANNOT_HIGHLIGHT, ANNOT_NOTE, ANNOT_IMAGE, ANNOT_INK, ANNOT_UNDERLINE, ANNOT_TEXT = 1, 2, 3, 4, 5, 6
KEY_ALPHABET = "23456789ABCDEFGHIJKLMNPQRSTUVWXYZ"      # Zotero keys: 8 chars, no 0/1/O
MIME = {".pdf": "application/pdf", ".html": "text/html", ".txt": "text/plain", ".md": "text/markdown",
        ".docx": "application/vnd.openxmlformats-officedocument.wordprocessingml.document"}


def fixtures_root() -> Path | None:
    """The shared Zotero fixtures folder: $KB_ZOTERO_FIXTURES, else ../shared/zotero beside the repo;
    KB_ZOTERO_FIXTURES=off runs without them, as CI does (the project's tables stand in for Zotero's schema)."""
    env = os.environ.get("KB_ZOTERO_FIXTURES")
    if env == "off":
        return None
    for cand in ([Path(env)] if env else []) + [ROOT.parent / "shared" / "zotero"]:
        if (cand / "schema" / "userdata.sql").is_file():
            return cand
    return None


def is_key(key: str) -> bool:
    return len(key) == 8 and all(c in KEY_ALPHABET for c in key)


def _normalized(text: str | None) -> str | None:
    """Roughly Zotero's *Normalized columns: lower case, accents removed."""
    if text is None:
        return None
    decomposed = unicodedata.normalize("NFKD", text)
    return "".join(c for c in decomposed if not unicodedata.combining(c)).lower()


def _sql_version(path: Path) -> int:
    first = path.read_text(encoding="utf-8").splitlines()[0]
    m = re.match(r"--\s*(\d+)", first)
    assert m, f"{path} does not start with its version comment"
    return int(m.group(1))


def _stamp(day: int, minute: int = 0) -> str:
    t = _dt.datetime(2024, 1, 1, 9, 0, 0) + _dt.timedelta(days=day, minutes=minute)
    return t.strftime("%Y-%m-%d %H:%M:%S")


# ---------------------------------------------------------------------------
# an empty database, as a new Zotero 7 installation makes it

# Where Zotero's own schema files are absent (CI has no shared fixtures), the database is made from the tables
# below instead: the tables and columns the engine reads and this module writes, in the order Zotero 7's
# userdata schema (version 129) declares them, without Zotero's indexes and triggers; and the item types, fields
# and creator types the library uses, in the shape of Zotero's schema.json.
PROJECT_TABLES = """
CREATE TABLE version (schema TEXT PRIMARY KEY, version INT NOT NULL);
CREATE TABLE settings (setting TEXT, key TEXT, value, PRIMARY KEY (setting, key));
CREATE TABLE itemTypes (itemTypeID INTEGER PRIMARY KEY, typeName TEXT, templateItemTypeID INT, display INT DEFAULT 1);
CREATE TABLE itemTypesCombined (itemTypeID INT PRIMARY KEY, typeName TEXT NOT NULL, display INT NOT NULL DEFAULT 1,
                                custom INT NOT NULL);
CREATE TABLE fields (fieldID INTEGER PRIMARY KEY, fieldName TEXT, fieldFormatID INT);
CREATE TABLE fieldsCombined (fieldID INT PRIMARY KEY, fieldName TEXT NOT NULL, label TEXT, fieldFormatID INT,
                             custom INT NOT NULL);
CREATE TABLE itemTypeFields (itemTypeID INT, fieldID INT, hide INT, orderIndex INT,
                             PRIMARY KEY (itemTypeID, orderIndex));
CREATE TABLE itemTypeFieldsCombined (itemTypeID INT NOT NULL, fieldID INT NOT NULL, hide INT, orderIndex INT NOT NULL,
                                     PRIMARY KEY (itemTypeID, orderIndex));
CREATE TABLE baseFieldMappings (itemTypeID INT, baseFieldID INT, fieldID INT,
                                PRIMARY KEY (itemTypeID, baseFieldID, fieldID));
CREATE TABLE baseFieldMappingsCombined (itemTypeID INT, baseFieldID INT, fieldID INT,
                                        PRIMARY KEY (itemTypeID, baseFieldID, fieldID));
CREATE TABLE creatorTypes (creatorTypeID INTEGER PRIMARY KEY, creatorType TEXT);
CREATE TABLE itemTypeCreatorTypes (itemTypeID INT, creatorTypeID INT, primaryField INT,
                                   PRIMARY KEY (itemTypeID, creatorTypeID));
CREATE TABLE libraries (libraryID INTEGER PRIMARY KEY, type TEXT NOT NULL, editable INT NOT NULL,
                        filesEditable INT NOT NULL,
                        version INT NOT NULL DEFAULT 0, clientVersion INT NOT NULL DEFAULT 0,
                        storageVersion INT NOT NULL DEFAULT 0, lastSync INT NOT NULL DEFAULT 0,
                        archived INT NOT NULL DEFAULT 0, isAdmin INT NOT NULL DEFAULT 0);
CREATE TABLE groups (groupID INTEGER PRIMARY KEY, libraryID INT NOT NULL UNIQUE REFERENCES libraries(libraryID),
                     name TEXT NOT NULL, description TEXT NOT NULL, version INT NOT NULL);
CREATE TABLE items (itemID INTEGER PRIMARY KEY, itemTypeID INT NOT NULL,
                    dateAdded TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
                    dateModified TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
                    clientDateModified TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
                    libraryID INT NOT NULL REFERENCES libraries(libraryID), key TEXT NOT NULL,
                    version INT NOT NULL DEFAULT 0, clientVersion INT NOT NULL DEFAULT 0, synced INT NOT NULL DEFAULT 0,
                    UNIQUE (libraryID, key));
CREATE TABLE itemDataValues (valueID INTEGER PRIMARY KEY, value UNIQUE, valueNormalized TEXT);
CREATE TABLE itemData (itemID INT REFERENCES items(itemID) ON DELETE CASCADE, fieldID INT,
                       valueID REFERENCES itemDataValues(valueID), PRIMARY KEY (itemID, fieldID));
CREATE TABLE itemNotes (itemID INTEGER PRIMARY KEY REFERENCES items(itemID) ON DELETE CASCADE, parentItemID INT,
                        note TEXT, title TEXT);
CREATE TABLE itemAttachments (itemID INTEGER PRIMARY KEY REFERENCES items(itemID) ON DELETE CASCADE, parentItemID INT,
                              linkMode INT, contentType TEXT, charsetID INT, path TEXT, syncState INT DEFAULT 0,
                              storageModTime INT, storageHash TEXT, lastProcessedModificationTime INT, lastRead INT);
CREATE TABLE itemAnnotations (itemID INTEGER PRIMARY KEY REFERENCES items(itemID) ON DELETE CASCADE,
                              parentItemID INT NOT NULL REFERENCES itemAttachments(itemID), type INTEGER NOT NULL,
                              authorName TEXT, text TEXT, textNormalized TEXT, comment TEXT, commentNormalized TEXT,
                              color TEXT, pageLabel TEXT, sortIndex TEXT NOT NULL, position TEXT NOT NULL,
                              isExternal INT NOT NULL);
CREATE TABLE tags (tagID INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, nameNormalized TEXT);
CREATE TABLE itemTags (itemID INT NOT NULL REFERENCES items(itemID) ON DELETE CASCADE,
                       tagID INT NOT NULL REFERENCES tags(tagID), type INT NOT NULL, PRIMARY KEY (itemID, tagID));
CREATE TABLE creators (creatorID INTEGER PRIMARY KEY, firstName TEXT, lastName TEXT, fieldMode INT,
                       firstNameNormalized TEXT, lastNameNormalized TEXT, UNIQUE (lastName, firstName, fieldMode));
CREATE TABLE itemCreators (itemID INT NOT NULL REFERENCES items(itemID) ON DELETE CASCADE,
                           creatorID INT NOT NULL REFERENCES creators(creatorID), creatorTypeID INT NOT NULL DEFAULT 1,
                           orderIndex INT NOT NULL DEFAULT 0,
                           PRIMARY KEY (itemID, creatorID, creatorTypeID, orderIndex));
CREATE TABLE collections (collectionID INTEGER PRIMARY KEY, collectionName TEXT NOT NULL, parentCollectionID INT,
                          clientDateModified TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
                          libraryID INT NOT NULL REFERENCES libraries(libraryID), key TEXT NOT NULL,
                          version INT NOT NULL DEFAULT 0, clientVersion INT NOT NULL DEFAULT 0,
                          synced INT NOT NULL DEFAULT 0, UNIQUE (libraryID, key));
CREATE TABLE collectionItems (collectionID INT NOT NULL REFERENCES collections(collectionID) ON DELETE CASCADE,
                              itemID INT NOT NULL REFERENCES items(itemID) ON DELETE CASCADE,
                              orderIndex INT NOT NULL DEFAULT 0, PRIMARY KEY (collectionID, itemID));
CREATE TABLE deletedCollections (collectionID INTEGER PRIMARY KEY, dateDeleted DEFAULT CURRENT_TIMESTAMP NOT NULL);
CREATE TABLE deletedItems (itemID INTEGER PRIMARY KEY REFERENCES items(itemID) ON DELETE CASCADE,
                           dateDeleted DEFAULT CURRENT_TIMESTAMP NOT NULL);
"""
PROJECT_USERDATA_VERSION = 129
_ARTICLE_FIELDS = [{"field": "title"}, {"field": "abstractNote"}, {"field": "publicationTitle"}, {"field": "volume"},
                   {"field": "issue"}, {"field": "pages"}, {"field": "date"}, {"field": "DOI"}, {"field": "url"},
                   {"field": "accessDate"}, {"field": "extra"}]
PROJECT_GLOBAL_SCHEMA = {
    "version": 1,
    "itemTypes": [
        {"itemType": "annotation", "fields": [], "creatorTypes": []},
        {"itemType": "attachment", "fields": [{"field": "title"}, {"field": "url"}, {"field": "accessDate"}],
         "creatorTypes": []},
        {"itemType": "book", "fields": [{"field": "title"}, {"field": "publisher"}, {"field": "date"},
                                        {"field": "ISBN"}], "creatorTypes": [{"creatorType": "author", "primary": True},
                                                                            {"creatorType": "editor"}]},
        {"itemType": "conferencePaper", "fields": [{"field": "title"}, {"field": "date"},
                                                   {"field": "proceedingsTitle", "baseField": "publicationTitle"},
                                                   {"field": "DOI"}],
         "creatorTypes": [{"creatorType": "author", "primary": True}, {"creatorType": "editor"}]},
        {"itemType": "journalArticle", "fields": _ARTICLE_FIELDS,
         "creatorTypes": [{"creatorType": "author", "primary": True}, {"creatorType": "editor"}]},
        {"itemType": "note", "fields": [], "creatorTypes": []},
    ],
}


def shared_schema() -> Path | None:
    """Zotero's own schema files from the shared fixtures, when they are there."""
    root = fixtures_root()
    return root / "schema" if root is not None else None


def create_database(db_path: Path, schema_dir: Path | None) -> None:
    """An empty Zotero database: Zotero's schema SQL with the type tables filled from its schema.json (Zotero's
    _updateGlobalSchema) when ``schema_dir`` holds them, else the project's tables (PROJECT_TABLES)."""
    if schema_dir is None:
        _create_project_database(db_path)
        return
    sql_files = {name: schema_dir / f"{name}.sql" for name in ("system", "userdata", "triggers")}
    schema = json.loads((schema_dir / "schema.json").read_text(encoding="utf-8"))
    con = sqlite3.connect(str(db_path))
    try:
        for name in ("system", "userdata", "triggers"):
            con.executescript(sql_files[name].read_text(encoding="utf-8"))
        with con:
            _fill_global_schema(con, schema)
            for name, path in sql_files.items():
                con.execute("INSERT INTO version VALUES (?, ?)", (name, _sql_version(path)))
            con.execute("INSERT INTO version VALUES ('globalSchema', ?)", (schema["version"],))
            con.execute("INSERT INTO version VALUES ('compatibility', 7)")
            con.execute("INSERT INTO libraries (libraryID, type, editable, filesEditable, version) "
                        "VALUES (1, 'user', 1, 1, 0)")
            con.execute("INSERT INTO settings VALUES ('account', 'localUserKey', 'KbRagT7Q')")
            con.execute("INSERT INTO settings VALUES ('client', 'lastVersion', '7.0.11')")
            con.execute("INSERT INTO settings VALUES ('client', 'lastCompatibleVersion', '7.0.11')")
    finally:
        con.close()


def _create_project_database(db_path: Path) -> None:
    con = sqlite3.connect(str(db_path))
    try:
        con.executescript(PROJECT_TABLES)
        with con:
            _fill_global_schema(con, PROJECT_GLOBAL_SCHEMA)
            con.execute("INSERT INTO version VALUES ('userdata', ?)", (PROJECT_USERDATA_VERSION,))
            con.execute("INSERT INTO version VALUES ('globalSchema', ?)", (PROJECT_GLOBAL_SCHEMA["version"],))
            con.execute("INSERT INTO libraries (libraryID, type, editable, filesEditable, version) "
                        "VALUES (1, 'user', 1, 1, 0)")
    finally:
        con.close()


def _fill_global_schema(con: sqlite3.Connection, schema: dict) -> None:
    fields: dict[str, int] = {}
    creator_types: dict[str, int] = {}
    for itype in schema["itemTypes"]:
        for f in itype["fields"]:
            for name in (f["field"], f.get("baseField")):
                if name and name not in fields:
                    fields[name] = len(fields) + 1
        for c in itype["creatorTypes"]:
            creator_types.setdefault(c["creatorType"], len(creator_types) + 1)
    con.executemany("INSERT INTO fields VALUES (?, ?, NULL)", [(i, n) for n, i in fields.items()])
    con.executemany("INSERT INTO creatorTypes VALUES (?, ?)", [(i, n) for n, i in creator_types.items()])
    for type_id, itype in enumerate(schema["itemTypes"], start=1):
        con.execute("INSERT INTO itemTypes VALUES (?, ?, NULL, 1)", (type_id, itype["itemType"]))
        for index, f in enumerate(itype["fields"]):
            con.execute("INSERT INTO itemTypeFields VALUES (?, ?, 0, ?)", (type_id, fields[f["field"]], index))
            if f.get("baseField"):
                con.execute("INSERT INTO baseFieldMappings VALUES (?, ?, ?)",
                            (type_id, fields[f["baseField"]], fields[f["field"]]))
        for c in itype["creatorTypes"]:
            con.execute("INSERT INTO itemTypeCreatorTypes VALUES (?, ?, ?)",
                        (type_id, creator_types[c["creatorType"]], 1 if c.get("primary") else 0))
    # the *Combined tables (Zotero's _updateCustomTables, no custom types)
    con.execute("INSERT INTO itemTypesCombined SELECT itemTypeID, typeName, display, 0 FROM itemTypes")
    con.execute("INSERT INTO fieldsCombined SELECT fieldID, fieldName, NULL, fieldFormatID, 0 FROM fields")
    con.execute("INSERT INTO itemTypeFieldsCombined SELECT itemTypeID, fieldID, hide, orderIndex FROM itemTypeFields")
    con.execute("INSERT INTO baseFieldMappingsCombined SELECT itemTypeID, baseFieldID, fieldID FROM baseFieldMappings")
    rest = {k: v for k, v in schema.items() if k != "itemTypes"}
    con.execute("INSERT INTO settings VALUES ('globalSchema', 'data', ?)",
                (zlib.compress(json.dumps(rest).encode("utf-8")),))


# ---------------------------------------------------------------------------
# writing items

class ZoteroWriter:
    """Adds library objects through an open connection; ids of types and fields are looked up by name."""

    def __init__(self, con: sqlite3.Connection, library_id: int = 1):
        self.con = con
        self.library_id = library_id
        self.item_types = dict(con.execute("SELECT typeName, itemTypeID FROM itemTypes"))
        self.fields = dict(con.execute("SELECT fieldName, fieldID FROM fields"))
        self.creator_types = dict(con.execute("SELECT creatorType, creatorTypeID FROM creatorTypes"))

    def _next_id(self, table: str, column: str) -> int:
        return (self.con.execute(f"SELECT MAX({column}) FROM {table}").fetchone()[0] or 0) + 1

    def item(self, type_name: str, key: str, *, version: int = 1, added: str | None = None,
             modified: str | None = None) -> int:
        assert is_key(key), key
        added = added or _stamp(0)
        modified = modified or added
        item_id = self._next_id("items", "itemID")
        self.con.execute(
            "INSERT INTO items (itemID, itemTypeID, dateAdded, dateModified, clientDateModified, libraryID, key, "
            "version, synced) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 1)",
            (item_id, self.item_types[type_name], added, modified, modified, self.library_id, key, version))
        return item_id

    def set_field(self, item_id: int, field: str, value: str) -> None:
        row = self.con.execute("SELECT valueID FROM itemDataValues WHERE value = ?", (value,)).fetchone()
        if row:
            value_id = row[0]
        else:
            value_id = self._next_id("itemDataValues", "valueID")
            self.con.execute("INSERT INTO itemDataValues (valueID, value) VALUES (?, ?)", (value_id, value))
        self.con.execute("INSERT OR REPLACE INTO itemData VALUES (?, ?, ?)", (item_id, self.fields[field], value_id))

    def creator(self, item_id: int, first: str, last: str, order: int, creator_type: str = "author") -> None:
        row = self.con.execute("SELECT creatorID FROM creators WHERE firstName = ? AND lastName = ? AND fieldMode = 0",
                               (first, last)).fetchone()
        if row:
            creator_id = row[0]
        else:
            creator_id = self._next_id("creators", "creatorID")
            self.con.execute("INSERT INTO creators VALUES (?, ?, ?, 0, ?, ?)",
                             (creator_id, first, last, _normalized(first), _normalized(last)))
        self.con.execute("INSERT INTO itemCreators VALUES (?, ?, ?, ?)",
                         (item_id, creator_id, self.creator_types[creator_type], order))

    def article(self, key: str, *, title: str, date: str | None = None, journal: str | None = None,
                doi: str | None = None, authors: list[tuple[str, str]] = (), version: int = 1,
                added: str | None = None, modified: str | None = None, item_type: str = "journalArticle") -> int:
        """A regular item; ``date`` in Zotero's stored form ('2020-03-15 March 15, 2020')."""
        item_id = self.item(item_type, key, version=version, added=added, modified=modified)
        for field, value in (("title", title), ("date", date), ("publicationTitle", journal), ("DOI", doi)):
            if value:
                self.set_field(item_id, field, value)
        for order, (first, last) in enumerate(authors):
            self.creator(item_id, first, last, order)
        return item_id

    def attachment(self, parent_id: int | None, key: str, *, path: str, link_mode: int, content_type: str,
                   title: str = "Full Text PDF", version: int = 1, added: str | None = None,
                   storage_mod_time: int | None = None, storage_hash: str | None = None) -> int:
        item_id = self.item("attachment", key, version=version, added=added)
        self.set_field(item_id, "title", title)
        self.con.execute(
            "INSERT INTO itemAttachments (itemID, parentItemID, linkMode, contentType, charsetID, path, syncState, "
            "storageModTime, storageHash) VALUES (?, ?, ?, ?, NULL, ?, 0, ?, ?)",
            (item_id, parent_id, link_mode, content_type, path, storage_mod_time, storage_hash))
        return item_id

    def annotation(self, attachment_id: int, key: str, *, text: str | None, comment: str | None,
                   page_label: str, page_index: int, rects: list[list[float]], color: str = "#ffd400",
                   annotation_type: int = ANNOT_HIGHLIGHT, offset: int = 0, version: int = 1,
                   added: str | None = None) -> int:
        item_id = self.item("annotation", key, version=version, added=added)
        position = {"pageIndex": page_index, "rects": rects}
        top = int(rects[0][1]) if rects else 0
        sort_index = f"{page_index:05d}|{offset:06d}|{top:05d}"
        self.con.execute(
            "INSERT INTO itemAnnotations (itemID, parentItemID, type, authorName, text, textNormalized, comment, "
            "commentNormalized, color, pageLabel, sortIndex, position, isExternal) "
            "VALUES (?, ?, ?, NULL, ?, ?, ?, ?, ?, ?, ?, ?, 0)",
            (item_id, attachment_id, annotation_type, text, _normalized(text), comment, _normalized(comment),
             color, page_label, sort_index, json.dumps(position, separators=(",", ":"))))
        return item_id

    def note(self, parent_id: int | None, key: str, html: str, title: str) -> int:
        item_id = self.item("note", key)
        self.con.execute("INSERT INTO itemNotes VALUES (?, ?, ?, ?)", (item_id, parent_id, html, title))
        return item_id

    def collection(self, name: str, key: str, parent_id: int | None = None) -> int:
        assert is_key(key), key
        coll_id = self._next_id("collections", "collectionID")
        self.con.execute("INSERT INTO collections (collectionID, collectionName, parentCollectionID, libraryID, key, "
                         "version, synced) VALUES (?, ?, ?, ?, ?, 1, 1)",
                         (coll_id, name, parent_id, self.library_id, key))
        return coll_id

    def add_to_collection(self, coll_id: int, item_id: int) -> None:
        order = self.con.execute("SELECT COUNT(*) FROM collectionItems WHERE collectionID = ?",
                                 (coll_id,)).fetchone()[0]
        self.con.execute("INSERT INTO collectionItems VALUES (?, ?, ?)", (coll_id, item_id, order))

    def tag(self, item_id: int, name: str, tag_type: int = 0) -> None:
        row = self.con.execute("SELECT tagID FROM tags WHERE name = ?", (name,)).fetchone()
        if row:
            tag_id = row[0]
        else:
            tag_id = self._next_id("tags", "tagID")
            self.con.execute("INSERT INTO tags VALUES (?, ?, ?)", (tag_id, name, _normalized(name)))
        self.con.execute("INSERT INTO itemTags VALUES (?, ?, ?)", (item_id, tag_id, tag_type))

    def trash(self, item_id: int) -> None:
        self.con.execute("INSERT INTO deletedItems (itemID, dateDeleted) VALUES (?, ?)", (item_id, _stamp(40)))

    def bump_library_version(self) -> None:
        self.con.execute("UPDATE libraries SET version = (SELECT MAX(version) FROM items) WHERE libraryID = ?",
                         (self.library_id,))


# ---------------------------------------------------------------------------
# the designed library

@dataclasses.dataclass
class Entry:
    """One parent item and its (main) attachment, with what the import should report."""
    name: str
    item_key: str
    attachment_key: str | None
    title: str                      # Zotero's title
    year: int | None = None
    journal: str | None = None
    doi: str | None = None
    authors: list[str] = dataclasses.field(default_factory=list)   # "First Last"
    path: Path | None = None        # where the attachment file is (or would be)
    expect: str = "added"           # status of the first import; None: not listed at all
    reason: str | None = None
    printed_title: str | None = None  # what the file itself prints (differs from title)
    collections: list[str] = dataclasses.field(default_factory=list)
    tags: list[str] = dataclasses.field(default_factory=list)
    token: str | None = None        # a word only this document contains
    annotations: int = 0


@dataclasses.dataclass
class Annotation:
    key: str
    text: str
    comment: str
    page_label: str
    page_index: int
    token: str                       # a word only this annotation (its comment) contains


@dataclasses.dataclass
class ZoteroLibrary:
    data_dir: Path
    db: Path
    outside_dir: Path                # linked files live here
    base_dir: Path                   # would-be base directory of relative attachments (no prefs.js points here)
    entries: dict[str, Entry]
    annotations: list[Annotation]
    collections: dict[str, str]      # name -> key
    snapshot_key: str                # HTML snapshot of A (never imported)
    note_key: str
    trashed: str = "D"

    @property
    def listed(self) -> dict[str, Entry]:
        """Entries that the import lists (all but the trashed one)."""
        return {n: e for n, e in self.entries.items() if e.expect is not None}

    def zotero_files(self) -> list[Path]:
        return sorted(p for p in self.data_dir.iterdir() if p.name.startswith("zotero.sqlite"))


A_ANNOTATIONS = [
    Annotation("HL7A2QKC",
               text="a brief exposure of the copper foil to oxygen before the hydrogen anneal lowers the graphene "
                    "nucleation density on copper by two orders of magnitude",
               comment="Key result; wombatquill: compare with the copper pocket method", page_label="12",
               page_index=0, token="wombatquill"),
    Annotation("HL9B4RTD",
               text="We confirm the reduced boundary density by Raman mapping and by electrical measurements on "
                    "devices that span many domains",
               comment="lyrebirdnote: the Raman maps cover only a small area", page_label="13",
               page_index=1, token="lyrebirdnote"),
]


A_NUMBERS = {"volume": "14", "issue": "2", "pages": "101–109"}  # item A's volume, issue and pages in Zotero


def build_library(base: Path, fixtures: Path | None = None) -> ZoteroLibrary:
    """Write the data directory under ``base`` ('Zotero/'), a folder of linked files ('Linked Papers/')
    and the would-be base directory ('ZoteroBase/'); return what was written."""
    fixtures = fixtures or fixtures_root()
    base = Path(base)
    data_dir = base / "Zotero"
    storage = data_dir / "storage"
    outside = base / "Linked Papers"
    base_dir = base / "ZoteroBase"
    for d in (storage, outside, base_dir / "Reviews"):
        d.mkdir(parents=True, exist_ok=True)
    db = data_dir / "zotero.sqlite"
    create_database(db, fixtures / "schema" if fixtures is not None else None)

    def stored(key: str, maker, *args) -> Path:
        folder = storage / key
        folder.mkdir(parents=True, exist_ok=True)
        return maker(folder, *args)

    entries: dict[str, Entry] = {}
    con = sqlite3.connect(str(db))
    try:
        with con:
            w = ZoteroWriter(con)
            coll_materials = w.collection("Materials", "MT4QX8PZ")
            coll_graphene = w.collection("Graphene", "GR6HV2KN", coll_materials)
            coll_bio = w.collection("Biophysics", "BP3WS7LC")

            # A: annotated PDF, Zotero metadata that differs from the printed one
            a = Entry("A", "QX7BN4KD", "ZC8M3PTA",
                      title="Suppressing Graphene Nucleation on Copper by an Oxygen Pre-Treatment",
                      year=2020, journal="Carbon Materials Letters", doi="10.5555/kbrag.zot.2020.041",
                      authors=["Alicia Chen-Moreno", "Rahul Verma"], printed_title=sp.GRAPHENE_TITLE,
                      collections=["Graphene"], tags=["cvd", "review"], token="nucleation",
                      annotations=len(A_ANNOTATIONS))
            a_id = w.article(a.item_key, title=a.title, date="2020-03-15 March 15, 2020", journal=a.journal,
                             doi=a.doi, authors=[("Alicia", "Chen-Moreno"), ("Rahul", "Verma")], version=12,
                             added=_stamp(1), modified=_stamp(3))
            for field, value in A_NUMBERS.items():  # where it appeared, as Zotero holds it (an en dash in pages)
                w.set_field(a_id, field, value)
            a.path = stored(a.attachment_key, sp.make_onecolumn_paper)
            a_att = w.attachment(a_id, a.attachment_key, path=f"storage:{a.path.name}", link_mode=LINK_IMPORTED_URL,
                                 content_type="application/pdf", version=12, added=_stamp(1, 1))
            for i, ann in enumerate(A_ANNOTATIONS):
                top = 700.0 - 40 * i
                w.annotation(a_att, ann.key, text=ann.text, comment=ann.comment, page_label=ann.page_label,
                             page_index=ann.page_index, rects=[[66.0, top, 529.0, top + 11.5]], offset=120 * (i + 1),
                             added=_stamp(2, i))
            snapshot_key = "SN5TJ9WE"
            snap = storage / snapshot_key
            snap.mkdir()
            (snap / "snapshot.html").write_text(
                "<html><head><title>Publisher page</title></head><body><p>Graphene landing page of the "
                "publisher with the abstract only.</p></body></html>", encoding="utf-8")
            w.attachment(a_id, snapshot_key, path="storage:snapshot.html", link_mode=LINK_IMPORTED_URL,
                         content_type="text/html", title="Snapshot", added=_stamp(1, 2))
            note_key = "NT2GK5RB"
            w.note(a_id, note_key, "<div data-schema-version=\"9\"><p>Reading note: grain size vs. oxygen dose."
                   "</p></div>", "Reading note: grain size vs. oxygen dose.")
            w.add_to_collection(coll_graphene, a_id)
            w.tag(a_id, "cvd")
            w.tag(a_id, "review", 1)
            entries["A"] = a

            # B: two-column PDF, another collection, tag spelt "Review"
            b = Entry("B", "RW3DM8HF", "KP4V7XNB",
                      title="Vectorial Synthesis Prevents Interdomain Misfolding of a Two-Domain Protein",
                      year=2021, journal="Journal of Sample Biophysics", doi="10.5555/kbrag.zot.2021.007",
                      authors=["Kenji Watanabe", "Maria Gonzalez", "David Okafor"], printed_title=sp.PROTEIN_TITLE,
                      collections=["Biophysics"], tags=["Review"], token="ribosome")
            b_id = w.article(b.item_key, title=b.title, date="2021-04-07 2021-04-07", journal=b.journal, doi=b.doi,
                             authors=[("Kenji", "Watanabe"), ("Maria", "Gonzalez"), ("David", "Okafor")], version=14,
                             added=_stamp(4), modified=_stamp(4, 5))
            b.path = stored(b.attachment_key, sp.make_twocolumn_paper)
            w.attachment(b_id, b.attachment_key, path=f"storage:{b.path.name}", link_mode=LINK_IMPORTED_FILE,
                         content_type="application/pdf", version=14, added=_stamp(4, 1))
            w.add_to_collection(coll_bio, b_id)
            w.tag(b_id, "Review")
            entries["B"] = b

            # C: plain imported PDF (the one whose version the tests bump)
            c = Entry("C", "TB9CL2WS", "MF6Q2HZJ",
                      title="Localized High-Concentration Electrolytes for Lithium Metal Anodes",
                      year=2022, journal="Energy Sample Letters", doi="10.5555/kbrag.zot.2022.113",
                      authors=["Olusegun Adeyemi", "Hannah Becker"], printed_title=sp.BATTERY_TITLE,
                      token="electrolyte")
            c_id = w.article(c.item_key, title=c.title, date="2022-00-00 2022", journal=c.journal, doi=c.doi,
                             authors=[("Olusegun", "Adeyemi"), ("Hannah", "Becker")], version=15,
                             added=_stamp(5), modified=_stamp(5, 3))
            c.path = stored(c.attachment_key, sp.make_hyphenated_paper)
            w.attachment(c_id, c.attachment_key, path=f"storage:{c.path.name}", link_mode=LINK_IMPORTED_URL,
                         content_type="application/pdf", version=15, added=_stamp(5, 1))
            entries["C"] = c

            # D: in the trash, with a real file: never listed, never searchable
            d = Entry("D", "UV2XP7GM", "WJ5R8KCE", title="Winter Plumage Moult in Rock Ptarmigan (trashed)",
                      year=2012, expect=None, token="ptarmigan")
            d_id = w.article(d.item_key, title=d.title, date="2012-00-00 2012", journal="Arctic Sample Notes",
                             authors=[("Greta", "Halvorsen")], version=16, added=_stamp(6), modified=_stamp(40))
            d.path = stored(d.attachment_key, sp.make_page_labels_paper)
            w.attachment(d_id, d.attachment_key, path=f"storage:{d.path.name}", link_mode=LINK_IMPORTED_URL,
                         content_type="application/pdf", version=16, added=_stamp(6, 1))
            w.tag(d_id, "review")
            w.add_to_collection(coll_graphene, d_id)
            w.trash(d_id)
            entries["D"] = d

            # E: linked file with an absolute path outside the data directory
            e = Entry("E", "XN4KT8BQ", "YH7C3MVD", title="Enzyme Kinetics Under Field Conditions",
                      year=2007, journal="Bulletin of Sample Sciences", doi="10.5555/kbrag.zot.2007.007",
                      authors=["Fay Ortega"], token="specimen007")
            e_id = w.article(e.item_key, title=e.title, date="2007-00-00 2007", journal=e.journal, doi=e.doi,
                             authors=[("Fay", "Ortega")], version=17, added=_stamp(7), modified=_stamp(7, 2))
            e.path = sp.make_filler_paper(outside, 7, pages=2, name="field enzyme kinetics.pdf")
            w.attachment(e_id, e.attachment_key, path=str(e.path), link_mode=LINK_LINKED_FILE,
                         content_type="application/pdf", title="field enzyme kinetics.pdf", version=17,
                         added=_stamp(7, 1))
            entries["E"] = e

            # F: imported PDF whose file never arrived
            f = Entry("F", "ZD3M9PWA", "AB6T4LNR", title="Copper Grain Growth Monitored In Situ",
                      year=2016, journal="Sample Metallurgy", expect="missing")
            f_id = w.article(f.item_key, title=f.title, date="2016-09-00 September 2016", journal=f.journal,
                             authors=[("Ivo", "Petrov")], version=18, added=_stamp(8), modified=_stamp(8))
            f.path = storage / f.attachment_key / "Petrov - 2016 - Copper grain growth.pdf"
            w.attachment(f_id, f.attachment_key, path=f"storage:{f.path.name}", link_mode=LINK_IMPORTED_URL,
                         content_type="application/pdf", version=18, added=_stamp(8, 1))
            entries["F"] = f

            # G: relative linked file ("attachments:"), base directory not configured anywhere findable
            g = Entry("G", "CE8W2JXH", "DG5N7QSY", title="A Review Kept in the Linked Attachment Base Directory",
                      year=2018, expect="missing", reason="base_directory_unknown")
            g_id = w.article(g.item_key, title=g.title, date="2018-00-00 2018", authors=[("Mina", "Sato")],
                             version=19, added=_stamp(9), modified=_stamp(9))
            g.path = sp.make_filler_paper(base_dir / "Reviews", 11, pages=2, name="relative_review.pdf")
            w.attachment(g_id, g.attachment_key, path="attachments:Reviews/relative_review.pdf",
                         link_mode=LINK_LINKED_FILE, content_type="application/pdf", title="relative_review.pdf",
                         version=19, added=_stamp(9, 1))
            entries["G"] = g

            # H: imported DOCX
            h = Entry("H", "FJ2R6VKM", "GK9P3WTB", title="Coral Thermal Tolerance During Marine Heatwaves",
                      year=2018, journal="Reef Sample Science", doi="10.5555/kbrag.zot.2018.052",
                      authors=["Laura Schmidt", "Tomas Novak"], printed_title=sp.DOCX_TITLE, token="corals")
            h_id = w.article(h.item_key, title=h.title, date="2018-06-01 2018-06-01", journal=h.journal, doi=h.doi,
                             authors=[("Laura", "Schmidt"), ("Tomas", "Novak")], version=20, added=_stamp(10),
                             modified=_stamp(10, 4))
            h.path = stored(h.attachment_key, sp.make_docx)
            w.attachment(h_id, h.attachment_key, path=f"storage:{h.path.name}", link_mode=LINK_IMPORTED_FILE,
                         content_type=MIME[".docx"], title="coral_heatwaves.docx", version=20, added=_stamp(10, 1))
            entries["H"] = h
            w.bump_library_version()
    finally:
        con.close()
    return ZoteroLibrary(data_dir=data_dir, db=db, outside_dir=outside, base_dir=base_dir, entries=entries,
                         annotations=list(A_ANNOTATIONS),
                         collections={"Materials": "MT4QX8PZ", "Graphene": "GR6HV2KN", "Biophysics": "BP3WS7LC"},
                         snapshot_key=snapshot_key, note_key=note_key)


# the item a test writes while "Zotero runs" (kept in the WAL)
WAL_ENTRY = dict(name="W", item_key="HW8T2JQN", attachment_key="JS4X9CDL",
                 title="Bacterial Biofilm Observations Recorded While Zotero Was Open", year=2023,
                 journal="Sample Microbiology", doi="10.5555/kbrag.zot.2023.009", authors=["Dev Kowalski"],
                 token="specimen009")


def add_wal_item(con: sqlite3.Connection, data_dir: Path) -> Entry:
    """Add one article with an imported PDF through ``con`` in one committed transaction."""
    entry = Entry(**WAL_ENTRY)
    folder = Path(data_dir) / "storage" / entry.attachment_key
    folder.mkdir(parents=True, exist_ok=True)
    entry.path = sp.make_filler_paper(folder, 9, pages=2, name="Kowalski - 2023 - Biofilm observations.pdf")
    con.execute("BEGIN IMMEDIATE")
    try:
        w = ZoteroWriter(con)
        item_id = w.article(entry.item_key, title=entry.title, date="2023-05-02 2023-05-02", journal=entry.journal,
                            doi=entry.doi, authors=[("Dev", "Kowalski")], version=30, added=_stamp(50),
                            modified=_stamp(50, 2))
        w.attachment(item_id, entry.attachment_key, path=f"storage:{entry.path.name}", link_mode=LINK_IMPORTED_URL,
                     content_type="application/pdf", version=30, added=_stamp(50, 1))
        w.bump_library_version()
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    return entry


def copy_library(lib: ZoteroLibrary, dest: Path) -> ZoteroLibrary:
    """A private copy of the data directory (linked files and the base directory stay where they are)."""
    dest = Path(dest)
    data_dir = dest / "Zotero"
    shutil.copytree(lib.data_dir, data_dir)
    entries = {}
    for name, e in lib.entries.items():
        path = e.path
        if path is not None and path.is_relative_to(lib.data_dir):
            path = data_dir / path.relative_to(lib.data_dir)
        entries[name] = dataclasses.replace(e, path=path, authors=list(e.authors), collections=list(e.collections),
                                            tags=list(e.tags))
    return dataclasses.replace(lib, data_dir=data_dir, db=data_dir / "zotero.sqlite", entries=entries)


def hold_wal_writer(db: str) -> None:
    """Act like a running Zotero (run in a child process): open the database in WAL mode with an exclusive
    lock, commit one new item that stays in the WAL (no checkpoints), report it on stdout as one JSON line,
    and keep the connection open until stdin is closed."""
    db_path = Path(db)
    con = sqlite3.connect(str(db_path), isolation_level=None)
    journal = con.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    locking = con.execute("PRAGMA locking_mode=EXCLUSIVE").fetchone()[0]
    con.execute("PRAGMA wal_autocheckpoint=0")
    entry = add_wal_item(con, db_path.parent)
    print(json.dumps({"journal_mode": journal, "locking_mode": locking, "path": str(entry.path),
                      "item_key": entry.item_key, "attachment_key": entry.attachment_key}), flush=True)
    sys.stdin.read()
    con.close()


def fill_sync_cache(db: Path, megabytes: int) -> None:
    """Grow the database the way a synced library grows: Zotero keeps the JSON of every object it synced in
    syncCache (a large share of a real zotero.sqlite). Rows for made-up objects are added until the file holds
    about ``megabytes``; the engine never reads them, so a copy of the database simply takes longer."""
    con = sqlite3.connect(str(db))
    try:
        con.execute("CREATE TABLE IF NOT EXISTS syncCache (libraryID INT NOT NULL, key TEXT NOT NULL, "
                    "syncObjectTypeID INT NOT NULL, version INT NOT NULL, data TEXT, "
                    "PRIMARY KEY (libraryID, key, syncObjectTypeID, version))")
        abstract = " ".join(f"word{i % 997}" for i in range(300))
        rows, n = [], 0
        while n * 4200 < megabytes * 1024 * 1024:
            key = _busy_key("SC", n)
            data = {"key": key, "version": n + 1, "itemType": "journalArticle", "title": f"Synced paper {n}",
                    "abstractNote": abstract, "creators": [{"firstName": "Ada", "lastName": f"Author{n}"}]}
            rows.append((1, key, 3, n + 1, json.dumps(data)))
            n += 1
        with con:
            con.executemany("INSERT INTO syncCache VALUES (?, ?, ?, ?, ?)", rows)
    finally:
        con.close()


BUSY_ATTACHMENT_PREFIX = "22"    # the keys of the attachments busy_writer adds ("23": their parents)


def _busy_key(prefix: str, n: int) -> str:
    digits = ""
    for _ in range(6):
        n, rest = divmod(n, len(KEY_ALPHABET))
        digits = KEY_ALPHABET[rest] + digits
    return prefix + digits


def busy_writer(db: str, status: str, stop: str, pause: float = 0.002) -> None:
    """Act like a running Zotero that saves without rest (run in a child process): hold the database as Zotero 7
    holds it (an exclusive lock taken before WAL mode is set, so the WAL index lives in memory and there is no -shm
    file), commit one new article with a text attachment per transaction, each attachment with its own file in
    storage/, ``pause`` seconds apart, and run ``wal_checkpoint(TRUNCATE)`` (what Zotero runs at idle and at close)
    after every second one. After each commit the number of attachments committed so far is written to
    ``status`` (replaced whole, so a reader never sees half of it). Prints one JSON line once the first
    transaction is committed; stops when the file ``stop`` exists. Run again, it goes on numbering where the last
    run stopped. Zotero writes with synchronous=NORMAL, which
    only adds an fsync to each checkpoint; without it the stand-in checkpoints several times as often."""
    db_path = Path(db)
    con = sqlite3.connect(str(db_path), isolation_level=None)
    locking = con.execute("PRAGMA locking_mode=EXCLUSIVE").fetchone()[0]
    journal = con.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    con.execute("PRAGMA synchronous=OFF")
    writer = ZoteroWriter(con)
    has_sync_cache = con.execute("SELECT 1 FROM sqlite_master WHERE name = 'syncCache'").fetchone() is not None
    count = con.execute("SELECT COUNT(*) FROM items WHERE key LIKE ?", (BUSY_ATTACHMENT_PREFIX + "%",)).fetchone()[0]
    first, parent_pid = count, os.getppid()
    while count == first or not (os.path.exists(stop) or os.getppid() != parent_pid):     # (or its test is gone)
        attachment_key = _busy_key(BUSY_ATTACHMENT_PREFIX, count)
        folder = db_path.parent / "storage" / attachment_key
        folder.mkdir(parents=True, exist_ok=True)
        note = folder / f"observation {count}.txt"
        note.write_text(f"Field observation number {count} of the busy writer.\n\nThe specimen {attachment_key} "
                        f"was logged while the library was being written without pause.\n", encoding="utf-8")
        now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        con.execute("BEGIN IMMEDIATE")
        parent = writer.article(_busy_key("23", count), title=f"Field Observation {count}", added=now,
                                modified=now, version=0)
        writer.attachment(parent, attachment_key, path=f"storage:{note.name}", link_mode=LINK_IMPORTED_FILE,
                          content_type="text/plain", title=note.name, added=now, version=0)
        if has_sync_cache:      # as a sync saves it: the object's JSON, its key falling anywhere in the index
            con.execute("INSERT INTO syncCache VALUES (1, ?, 3, 1, ?)",
                        (_busy_key(KEY_ALPHABET[count % len(KEY_ALPHABET)] + "Y", count),
                         json.dumps({"key": attachment_key, "itemType": "attachment", "title": note.name})))
        con.execute("COMMIT")
        count += 1
        partial = Path(f"{status}.part")
        partial.write_text(str(count), encoding="utf-8")
        os.replace(partial, status)
        if count % 2 == 0:
            con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        if count == first + 1:
            print(json.dumps({"journal_mode": journal, "locking_mode": locking}), flush=True)
        if pause:
            time.sleep(pause)
    con.close()


# ---------------------------------------------------------------------------
# independent reading (for validating the fixture and for expected values of the real databases)

def read_attachments(db: Path) -> list[dict]:
    """Every file attachment with its parent's metadata, by name lookups (works on Zotero 5, 6 and 7)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    con.row_factory = sqlite3.Row
    try:
        trash = {r[0] for r in con.execute("SELECT itemID FROM deletedItems")}
        rows = con.execute(
            "SELECT a.itemID, ai.key AS attachment_key, a.parentItemID, a.linkMode, a.contentType, a.path, "
            "p.key AS item_key, p.version AS item_version, p.dateModified AS item_modified, pt.typeName AS item_type "
            "FROM itemAttachments a JOIN items ai ON ai.itemID = a.itemID "
            "LEFT JOIN items p ON p.itemID = a.parentItemID LEFT JOIN itemTypes pt ON pt.itemTypeID = p.itemTypeID "
            "ORDER BY a.itemID").fetchall()

        def field(item_id, name):
            r = con.execute("SELECT v.value FROM itemData d JOIN fields f ON f.fieldID = d.fieldID "
                            "JOIN itemDataValues v ON v.valueID = d.valueID WHERE d.itemID = ? AND f.fieldName = ?",
                            (item_id, name)).fetchone()
            return r[0] if r else None

        out = []
        for r in rows:
            parent = r["parentItemID"]
            date = field(parent, "date") if parent else None
            m = re.match(r"(\d{4})", date or "")
            authors = [f"{first} {last}".strip() for first, last in con.execute(
                "SELECT c.firstName, c.lastName FROM itemCreators ic JOIN creators c ON c.creatorID = ic.creatorID "
                "JOIN creatorTypes t ON t.creatorTypeID = ic.creatorTypeID WHERE ic.itemID = ? "
                "AND t.creatorType = 'author' ORDER BY ic.orderIndex", (parent,))] if parent else []
            out.append({**dict(r), "trashed": r["itemID"] in trash or (parent in trash if parent else False),
                        "title": field(parent, "title") if parent else None,
                        "year": int(m.group(1)) if m and m.group(1) != "0000" else None,
                        "doi": field(parent, "DOI") if parent else None,
                        "journal": field(parent, "publicationTitle") if parent else None,
                        "authors": authors})
        return out
    finally:
        con.close()


def data_dir_of(db: Path) -> Path:
    return Path(db).parent


def storage_path(db: Path, attachment_key: str, stored: str) -> Path:
    assert stored.startswith("storage:"), stored
    return data_dir_of(db) / "storage" / attachment_key / stored[len("storage:"):]


def validate(lib: ZoteroLibrary) -> list[str]:  # noqa: C901
    """Checks of the fixture against its own design; returns the problems found (empty: fine)."""
    problems = []
    con = sqlite3.connect(f"file:{lib.db}?mode=ro", uri=True)
    try:
        if con.execute("PRAGMA integrity_check").fetchone()[0] != "ok":
            problems.append("integrity_check failed")
        con.execute("PRAGMA foreign_keys = ON")
        fk = con.execute("PRAGMA foreign_key_check").fetchall()
        if fk:
            problems.append(f"foreign key violations: {fk[:5]}")
        versions = dict(con.execute("SELECT schema, version FROM version"))
        if versions.get("userdata") != 129:
            problems.append(f"userdata version {versions.get('userdata')}")
        # annotations joined to their attachment, parent item and item type
        anns = con.execute(
            "SELECT an.key, a.key, p.key, ia.pageLabel, ia.position, ia.text, ia.comment, ia.type "
            "FROM itemAnnotations ia JOIN items an ON an.itemID = ia.itemID "
            "JOIN itemTypes t ON t.itemTypeID = an.itemTypeID AND t.typeName = 'annotation' "
            "JOIN itemAttachments att ON att.itemID = ia.parentItemID JOIN items a ON a.itemID = att.itemID "
            "JOIN items p ON p.itemID = att.parentItemID ORDER BY ia.sortIndex").fetchall()
        want = [(x.key, lib.entries["A"].attachment_key, lib.entries["A"].item_key, x.page_label, x.page_index,
                 x.text, x.comment) for x in lib.annotations]
        got = [(k, ak, pk, lbl, json.loads(pos)["pageIndex"], text, comment) for k, ak, pk, lbl, pos, text, comment, _
               in anns]
        if got != want:
            problems.append(f"annotations {got} != {want}")
        # nested collections of A
        rows = con.execute(
            "SELECT c.collectionName, pc.collectionName FROM collectionItems ci JOIN items i ON i.itemID = ci.itemID "
            "JOIN collections c ON c.collectionID = ci.collectionID "
            "LEFT JOIN collections pc ON pc.collectionID = c.parentCollectionID WHERE i.key = ?",
            (lib.entries["A"].item_key,)).fetchall()
        if rows != [("Graphene", "Materials")]:
            problems.append(f"collections of A: {rows}")
        tags = sorted(r[0] for r in con.execute(
            "SELECT t.name FROM itemTags it JOIN tags t ON t.tagID = it.tagID JOIN items i ON i.itemID = it.itemID "
            "WHERE i.key = ?", (lib.entries["A"].item_key,)))
        if tags != ["cvd", "review"]:
            problems.append(f"tags of A: {tags}")
    finally:
        con.close()
    atts = {r["attachment_key"]: r for r in read_attachments(lib.db)}
    for e in lib.entries.values():
        r = atts.get(e.attachment_key)
        if r is None:
            problems.append(f"{e.name}: attachment missing")
            continue
        if r["item_key"] != e.item_key or r["title"] != e.title or r["year"] != e.year or r["doi"] != e.doi:
            problems.append(f"{e.name}: metadata {r['item_key']} {r['title']!r} {r['year']} {r['doi']}")
        if e.authors and r["authors"] != e.authors:
            problems.append(f"{e.name}: authors {r['authors']} != {e.authors}")
        if r["trashed"] != (e.expect is None):
            problems.append(f"{e.name}: trashed={r['trashed']}")
        path = r["path"]
        if path.startswith("storage:"):
            resolved = storage_path(lib.db, e.attachment_key, path)
        elif path.startswith("attachments:"):
            resolved = lib.base_dir / path[len("attachments:"):]
        else:
            resolved = Path(path)
        if resolved != e.path:
            problems.append(f"{e.name}: path {resolved} != {e.path}")
        if resolved.is_file() != (e.expect != "missing" or e.reason == "base_directory_unknown"):
            problems.append(f"{e.name}: file exists={resolved.is_file()}")
        if e.path.is_relative_to(lib.data_dir) == (r["linkMode"] == LINK_LINKED_FILE):
            problems.append(f"{e.name}: linkMode {r['linkMode']} vs location {e.path}")
    for e in lib.entries.values():
        if e.printed_title and e.printed_title == e.title:
            problems.append(f"{e.name}: Zotero title equals the printed title")
    return problems


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--fixtures", default=None)
    args = ap.parse_args(argv)
    out = Path(args.outdir)
    if out.exists():
        shutil.rmtree(out)
    lib = build_library(out, Path(args.fixtures) if args.fixtures else None)
    for e in lib.entries.values():
        print(f"{e.name} {e.item_key}/{e.attachment_key} expect={e.expect} {e.title!r} -> {e.path}")
    problems = validate(lib)
    print("problems:", problems or "none")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
