"""zotero: import a Zotero library from a snapshot of zotero.sqlite, with Zotero's metadata, annotations,
collections and tags; incremental runs; the real Zotero 5 and 6 databases; a database held by a running Zotero.

The generated library is described in zotero_fixture.py: built on Zotero's own schema files from the shared
fixtures ($KB_ZOTERO_FIXTURES or ../shared/zotero beside the repository), else on the project's stand-in tables.
The real Zotero 5 and 6 databases come from the shared fixtures only: those tests skip without them.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import zotero_fixture as zf
from helpers import db_rows, err_code, sp

FIXTURES = zf.fixtures_root()
STATUSES = {"added", "updated", "skipped", "missing", "error", "duplicate", "moved"}
MODES = ("keyword", "vector", "hybrid")
ZOTERO6_DIR = ("papis-zotero", "tests", "resources", "sql")
ZOTERO5_DIR = ("papis-zotero-2019", "tests", "data", "Zotero")


# ---------------------------------------------------------------------------
# environment and helpers

def _isolate(mp, home: Path) -> None:
    """No embedding model, no network, and a home without any Zotero installation or profile."""
    home.mkdir(parents=True, exist_ok=True)
    mp.setenv("KB_EMBED_MODEL", "none")
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("HOME", str(home))
    mp.setenv("USERPROFILE", str(home))
    for name in ("KB_ZOTERO_DB", "APPDATA", "KB_ROOT"):
        mp.delenv(name, raising=False)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    h = tmp_path / "home"
    _isolate(monkeypatch, h)
    return h


@pytest.fixture
def eng(kb_engine, home):
    e = kb_engine.Engine()
    yield e
    e.close()


@pytest.fixture(scope="session")
def pristine(tmp_path_factory) -> zf.ZoteroLibrary:
    """The generated library, built once. Tests never import from it directly: they copy it."""
    lib = zf.build_library(tmp_path_factory.mktemp("zotero-pristine"), FIXTURES)
    return lib


@pytest.fixture
def zcopy(pristine, tmp_path) -> zf.ZoteroLibrary:
    """A private copy of the generated data directory."""
    return zf.copy_library(pristine, tmp_path / "zcopy")


@pytest.fixture(scope="session")
def imported(kb_engine, pristine, tmp_path_factory):
    """One first import of a copy of the generated library: (library, kb_root, response)."""
    base = tmp_path_factory.mktemp("zotero-imported")
    lib = zf.copy_library(pristine, base / "zcopy")
    root = base / "kb"
    with pytest.MonkeyPatch.context() as mp:
        _isolate(mp, base / "home")
        e = kb_engine.Engine()
        try:
            resp = e.execute("zotero", {"zotero_db": str(lib.db), "kb_root": str(root)})
        finally:
            e.close()
    return lib, root, resp


def run_zotero(eng, lib_or_db, root, **extra) -> dict:
    db = lib_or_db.db if isinstance(lib_or_db, zf.ZoteroLibrary) else lib_or_db
    resp = eng.execute("zotero", {"zotero_db": str(db), "kb_root": str(root), **extra})
    check_shape(resp)
    return resp


def check_shape(resp: dict) -> None:
    """items / totals / collections / dry_run / zotero_db as the protocol describes them."""
    assert isinstance(resp.get("items"), list), resp
    totals = resp["totals"]
    items = resp["items"]
    assert totals["items"] == len(items), (totals, len(items))
    statuses = {"candidate", "missing"} if resp["dry_run"] else STATUSES
    for it in items:
        assert it["status"] in statuses, it
        for key in ("item_key", "attachment_key", "title", "path", "chunks", "annotations"):
            assert key in it, (key, it)
        assert isinstance(it["chunks"], int) and it["chunks"] >= 0, it
        assert isinstance(it["annotations"], int) and it["annotations"] >= 0, it
    for status in statuses:
        assert totals.get(status, 0) == sum(1 for it in items if it["status"] == status), (status, totals)
    assert totals["annotations"] == sum(it["annotations"] for it in items), totals
    assert isinstance(resp["collections"], int), resp
    assert isinstance(resp["dry_run"], bool), resp
    assert isinstance(resp["zotero_db"], str) and resp["zotero_db"], resp


def by_attachment(resp: dict) -> dict:
    out = {}
    for it in resp["items"]:
        assert it["attachment_key"] not in out, f"attachment listed twice: {it}"
        out[it["attachment_key"]] = it
    return out


def search(eng, root, query, mode="keyword", filters=None, top_k=50, **extra) -> list[dict]:
    payload = {"query": query, "kb_root": str(root), "mode": mode, "top_k": top_k, "cache": False, **extra}
    if filters:
        payload["filters"] = filters
    return eng.execute("search", payload)["results"]


def docs_by_path(eng, root) -> dict:
    return {d["path"]: d for d in eng.execute("docs", {"kb_root": str(root), "limit": 1000})["docs"]}


def tree_digest(folder: Path) -> dict:
    """relative path -> sha256 of every file under folder."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def kb_files_digest(root: Path) -> dict:
    return {p.name: sha256(p) for p in sorted(Path(root).glob("kb.sqlite*")) if p.is_file()}


def found(lib: zf.ZoteroLibrary) -> dict[str, zf.Entry]:
    """Listed entries whose file the import can read."""
    return {n: e for n, e in lib.listed.items() if e.expect != "missing"}


def copy_real(tmp_path, parts) -> Path:
    if FIXTURES is None:
        pytest.skip("the real Zotero databases come with the shared fixtures (set KB_ZOTERO_FIXTURES)")
    src = FIXTURES.joinpath(*parts)
    if not (src / "zotero.sqlite").is_file():
        pytest.skip(f"{src}/zotero.sqlite not present")
    dest = tmp_path / "realzotero" / "Zotero"
    shutil.copytree(src, dest)
    for p in dest.rglob("*"):        # the shared copy is read-only; ours must not be (the engine must not care)
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dest / "zotero.sqlite"


# ---------------------------------------------------------------------------
# (a) the generated Zotero 7 library

def test_fixture_is_valid(pristine):
    assert zf.validate(pristine) == []
    con = sqlite3.connect(f"file:{pristine.db}?mode=ro", uri=True)
    try:
        ids = dict(con.execute("SELECT typeName, itemTypeID FROM itemTypes"))
        # runtime ids in schema.json order: differ from Zotero 5's fixed ids (journalArticle 4, attachment 14)
        assert ids["journalArticle"] != 4 and ids["attachment"] != 14, ids
        assert con.execute("SELECT version FROM version WHERE schema = 'userdata'").fetchone()[0] == 129
    finally:
        con.close()


def test_import_statuses(imported):
    lib, root, resp = imported
    check_shape(resp)
    assert resp["dry_run"] is False
    assert Path(resp["zotero_db"]) == lib.db
    items = by_attachment(resp)
    expected = {e.attachment_key: e for e in lib.listed.values()}
    assert set(items) == set(expected), (sorted(items), sorted(expected))
    for key, e in expected.items():
        it = items[key]
        assert it["item_key"] == e.item_key, it
        assert it["title"] == e.title, it
        assert it["status"] == e.expect, (e.name, it)
        if e.expect == "added":
            assert it["chunks"] > 0, it
            assert Path(it["path"]) == e.path, (e.name, it)
        else:
            assert it["chunks"] == 0, it
            assert isinstance(it.get("reason"), str) and it["reason"], it
            if e.reason:
                assert it["reason"] == e.reason, (e.name, it)
        assert it["annotations"] == e.annotations, (e.name, it)
    totals = resp["totals"]
    assert (totals.get("added", 0), totals.get("missing", 0), totals.get("error", 0)) == (5, 2, 0), totals
    assert totals["annotations"] == 2, totals
    assert resp["collections"] == 3, resp["collections"]


def test_html_snapshot_and_note_not_imported(eng, imported):
    lib, root, resp = imported
    keys = {it["attachment_key"] for it in resp["items"]} | {it["item_key"] for it in resp["items"]}
    assert lib.snapshot_key not in keys
    assert lib.note_key not in keys
    assert not any(p.endswith(".html") for p in docs_by_path(eng, root)), "an HTML snapshot was imported"


def test_zotero_files_untouched(eng, zcopy, tmp_path):
    before = tree_digest(zcopy.data_dir)
    outside_before = tree_digest(zcopy.outside_dir)
    resp = run_zotero(eng, zcopy, tmp_path / "kb")
    assert resp["totals"].get("added", 0) == 5, resp["totals"]
    assert tree_digest(zcopy.data_dir) == before, "the Zotero data directory changed"
    assert tree_digest(zcopy.outside_dir) == outside_before


def test_zotero_metadata_overrides_extracted(eng, imported):
    lib, root, _ = imported
    docs = docs_by_path(eng, root)
    for e in found(lib).values():
        d = docs.get(str(e.path))
        assert d is not None, (e.name, sorted(docs))
        assert d["status"] == "indexed", d
        assert d["title"] == e.title, (e.name, d["title"], e.title)
        if e.printed_title:
            assert d["title"] != e.printed_title
        assert d["authors"] == e.authors, (e.name, d["authors"])
        assert d["year"] == e.year, (e.name, d["year"])
        assert d["journal"] == e.journal, (e.name, d["journal"])
        assert d["doi"] == e.doi, (e.name, d["doi"])


def test_zotero_item_fields_are_the_record(eng, imported):
    """Zotero's item type, volume, issue and pages are the document's record (issue 52, point 4)."""
    lib, root, _ = imported
    docs = docs_by_path(eng, root)
    a = docs[str(lib.entries["A"].path)]
    assert (a["work_type"], a["volume"], a["issue"], a["page_range"]) == ("journal-article", "14", "2", "101-109")
    assert {a["metadata_source"][k] for k in ("work_type", "volume", "issue", "page_range")} == {"zotero"}
    b = docs[str(lib.entries["B"].path)]
    assert b["work_type"] == "journal-article" and b["metadata_source"]["work_type"] == "zotero"
    assert b["volume"] is None and b["metadata_source"]["volume"] == "extracted"
    # the BibTeX entry of A carries them
    bib = eng.execute("cite", {"doc_ids": [a["doc_id"]], "kb_root": str(root)})["text"]
    assert bib.startswith("@article{") and "volume = {14}" in bib and "pages = {101--109}" in bib, bib


def test_annotations_are_searchable_chunks(eng, imported):
    lib, root, _ = imported
    a = lib.entries["A"]
    for ann in lib.annotations:
        hits = search(eng, root, ann.token, snippet=0)
        assert hits, f"annotation comment token {ann.token!r} not found"
        top = hits[0]
        assert Path(top["path"]) == a.path, top
        assert top["section"] == "Zotero annotation", top
        assert top["page"] == ann.page_index + 1, top
        assert top["page_label"] == ann.page_label, top
        assert top["zotero_key"] == a.item_key, top
        assert top["zotero_link"] == f"zotero://open-pdf/library/items/{a.attachment_key}?page={ann.page_index + 1}"
        text = top["snippet"]
        assert ann.token in text, text
        words = ann.text.split()
        assert " ".join(words[-6:]) in " ".join(text.split()), f"highlighted text missing from {text!r}"
        assert top["title"] == a.title


def test_annotation_chunks_in_section_filter(eng, imported):
    lib, root, _ = imported
    hits = search(eng, root, "Raman mapping", filters={"section": "Zotero annotation"})
    assert hits and all(h["section"] == "Zotero annotation" for h in hits), hits
    assert {h["page_label"] for h in hits} <= {"12", "13"}, hits


def test_hits_carry_zotero_key_and_link(eng, imported):
    lib, root, _ = imported
    b, h, e = lib.entries["B"], lib.entries["H"], lib.entries["E"]
    hits = [x for x in search(eng, root, "ribosome exit tunnel") if Path(x["path"]) == b.path]
    assert hits, "no hit in the two-column paper"
    for x in hits:
        assert x["zotero_key"] == b.item_key, x
        assert isinstance(x["page"], int)
        assert x["zotero_link"] == f"zotero://open-pdf/library/items/{b.attachment_key}?page={x['page']}", x
    hits = [x for x in search(eng, root, "corals heatwaves") if Path(x["path"]) == h.path]
    assert hits, "no hit in the DOCX"
    for x in hits:
        assert x["page"] is None
        assert x["zotero_key"] == h.item_key, x
        assert x["zotero_link"] == f"zotero://open-pdf/library/items/{h.attachment_key}", x
    hits = search(eng, root, e.token)
    assert hits and all(Path(x["path"]) == e.path and x["zotero_key"] == e.item_key for x in hits), hits


def _paths(hits) -> set:
    return {Path(h["path"]) for h in hits}


@pytest.mark.parametrize("mode", MODES)
def test_collection_filter(eng, imported, mode):
    lib, root, _ = imported
    a, b, c = (lib.entries[n].path for n in "ABC")
    unfiltered = _paths(search(eng, root, "copper", mode=mode))
    assert {a, c} <= unfiltered, unfiltered          # graphene and battery papers both mention copper
    assert _paths(search(eng, root, "copper", mode=mode, filters={"collection": "Graphene"})) == {a}
    assert _paths(search(eng, root, "copper", mode=mode, filters={"collection": "graphene"})) == {a}
    assert search(eng, root, "copper", mode=mode, filters={"collection": "raph"}) == []      # whole names only
    # the parent of a nested collection names it too
    assert _paths(search(eng, root, "copper", mode=mode, filters={"collection": "Materials"})) == {a}
    assert _paths(search(eng, root, "copper", mode=mode, filters={"collection": "Biophysics"})) == set()
    assert _paths(search(eng, root, "folding", mode=mode, filters={"collection": "Biophysics"})) == {b}
    assert search(eng, root, "copper", mode=mode, filters={"collection": "Nonexistent"}) == []


@pytest.mark.parametrize("mode", MODES)
def test_tag_filter(eng, imported, mode):
    lib, root, _ = imported
    a, b, c = (lib.entries[n].path for n in "ABC")
    unfiltered = _paths(search(eng, root, "domains", mode=mode))
    assert {a, b} <= unfiltered, unfiltered
    assert _paths(search(eng, root, "domains", mode=mode, filters={"tag": "cvd"})) == {a}
    assert _paths(search(eng, root, "domains", mode=mode, filters={"tag": "CVD"})) == {a}
    # "review" on A and "Review" on B: tag names match case-insensitively
    assert _paths(search(eng, root, "domains", mode=mode, filters={"tag": "review"})) == {a, b}
    assert _paths(search(eng, root, "domains", mode=mode, filters={"tag": "REVIEW"})) == {a, b}
    # exact names: neither a part of a tag nor a longer word matches
    assert search(eng, root, "domains", mode=mode, filters={"tag": "rev"}) == []
    assert search(eng, root, "domains", mode=mode, filters={"tag": "reviews"}) == []
    assert _paths(search(eng, root, "copper", mode=mode, filters={"tag": "cvd", "collection": "Graphene"})) == {a}


def test_trashed_item_absent(eng, imported):
    lib, root, resp = imported
    d = lib.entries["D"]
    keys = {it["item_key"] for it in resp["items"]} | {it["attachment_key"] for it in resp["items"]}
    assert d.item_key not in keys and d.attachment_key not in keys
    assert search(eng, root, d.token) == []
    assert search(eng, root, "moult plumage", filters={"tag": "review"}) == []
    assert str(d.path) not in docs_by_path(eng, root)


def test_linked_file_imported(eng, imported):
    lib, root, resp = imported
    e = lib.entries["E"]
    it = by_attachment(resp)[e.attachment_key]
    assert it["status"] == "added" and Path(it["path"]) == e.path, it
    assert not e.path.is_relative_to(lib.data_dir)
    doc = docs_by_path(eng, root)[str(e.path)]
    assert doc["title"] == e.title and doc["doi"] == e.doi, doc


def test_missing_files_reported(eng, imported):
    lib, root, resp = imported
    items = by_attachment(resp)
    for name in "FG":
        e = lib.entries[name]
        it = items[e.attachment_key]
        assert it["status"] == "missing" and it["chunks"] == 0, it
        assert it["title"] == e.title and it["item_key"] == e.item_key, it
    assert items[lib.entries["G"].attachment_key]["reason"] == "base_directory_unknown"
    docs = docs_by_path(eng, root)
    assert not any(d["status"] == "indexed" and Path(d["path"]) in (lib.entries["F"].path, lib.entries["G"].path)
                   for d in docs.values())


def test_relative_attachment_with_base_directory_from_prefs(eng, zcopy, home, tmp_path):
    """attachments:<rel> resolves against extensions.zotero.baseAttachmentPath of the Zotero profile."""
    profile = home / ".zotero" / "zotero" / "k3j2h1qa.default"
    profile.mkdir(parents=True)
    (profile / "prefs.js").write_text(
        '// Mozilla User Preferences\n'
        'user_pref("extensions.zotero.baseAttachmentPath", ' + json.dumps(str(zcopy.base_dir)) + ');\n'
        'user_pref("extensions.zotero.dataDir", ' + json.dumps(str(zcopy.data_dir)) + ');\n'
        'user_pref("extensions.zotero.useDataDir", true);\n', encoding="utf-8")
    g = zcopy.entries["G"]
    resp = run_zotero(eng, zcopy, tmp_path / "kb")
    it = by_attachment(resp)[g.attachment_key]
    assert it["status"] == "added" and Path(it["path"]) == g.path, it
    assert docs_by_path(eng, tmp_path / "kb")[str(g.path)]["title"] == g.title


def test_dry_run_writes_nothing(eng, kb_engine, zcopy, tmp_path):
    root = tmp_path / "kb"
    before = tree_digest(zcopy.data_dir)
    resp = run_zotero(eng, zcopy, root, dry_run=True)
    assert resp["dry_run"] is True
    items = by_attachment(resp)
    assert set(items) == {e.attachment_key for e in zcopy.listed.values()}
    for e in zcopy.listed.values():
        want = "missing" if e.expect == "missing" else "candidate"
        assert items[e.attachment_key]["status"] == want, items[e.attachment_key]
        assert items[e.attachment_key]["title"] == e.title
    assert not (root / "kb.sqlite").exists(), "dry_run created the library"
    assert tree_digest(zcopy.data_dir) == before
    # after a real import, a dry run leaves the library byte-identical
    run_zotero(eng, zcopy, root)
    eng.close()
    snapshot = kb_files_digest(root)
    assert snapshot
    e2 = kb_engine.Engine()
    try:
        resp = run_zotero(e2, zcopy, root, dry_run=True)
        assert {it["status"] for it in resp["items"]} <= {"candidate", "missing"}
    finally:
        e2.close()
    assert kb_files_digest(root) == snapshot, "dry_run changed kb.sqlite"


def test_limit(eng, zcopy, tmp_path):
    resp = run_zotero(eng, zcopy, tmp_path / "kb", dry_run=True, limit=2)
    assert 1 <= len(resp["items"]) <= 2, resp["items"]


def _bump(db: Path, item_key: str, *, title: str | None = None, version_step: int = 1) -> None:
    con = sqlite3.connect(str(db))
    try:
        with con:
            w = zf.ZoteroWriter(con)
            item_id = con.execute("SELECT itemID FROM items WHERE key = ?", (item_key,)).fetchone()[0]
            con.execute("UPDATE items SET version = version + ?, dateModified = '2024-06-01 10:00:00', "
                        "clientDateModified = '2024-06-01 10:00:00', synced = 0 WHERE itemID = ?",
                        (version_step, item_id))
            if title:
                w.set_field(item_id, "title", title)
            w.bump_library_version()
    finally:
        con.close()


def test_incremental_runs(eng, zcopy, tmp_path):
    root = tmp_path / "kb"
    first = run_zotero(eng, zcopy, root)
    assert first["totals"].get("added", 0) == 5, first["totals"]
    chunks_first = {k: it["chunks"] for k, it in by_attachment(first).items()}

    second = by_attachment(run_zotero(eng, zcopy, root))
    for e in zcopy.listed.values():
        it = second[e.attachment_key]
        if e.expect == "missing":
            assert it["status"] == "missing", it
        else:
            assert it["status"] == "skipped" and it.get("reason") == "unchanged", it

    # Zotero edits the metadata of C: version and dateModified go up
    c = zcopy.entries["C"]
    new_title = "Localized High-Concentration Electrolytes for Lithium Metal Anodes (Corrected)"
    _bump(zcopy.db, c.item_key, title=new_title)
    third = by_attachment(run_zotero(eng, zcopy, root))
    assert third[c.attachment_key]["status"] == "updated", third[c.attachment_key]
    assert third[c.attachment_key]["title"] == new_title
    for e in found(zcopy).values():
        if e.name != "C":
            assert third[e.attachment_key]["status"] == "skipped", third[e.attachment_key]
    doc = docs_by_path(eng, root)[str(c.path)]
    assert doc["title"] == new_title, doc
    assert doc["chunks"] == chunks_first[c.attachment_key], doc
    hits = search(eng, root, c.token)
    assert hits and all(h["title"] == new_title for h in hits if Path(h["path"]) == c.path)

    # only dateModified changes (a Zotero 6 library never synced keeps version 0)
    b = zcopy.entries["B"]
    con = sqlite3.connect(str(zcopy.db))
    with con:
        con.execute("UPDATE items SET dateModified = '2024-07-01 08:00:00' WHERE key = ?", (b.item_key,))
    con.close()
    fourth = by_attachment(run_zotero(eng, zcopy, root))
    assert fourth[b.attachment_key]["status"] == "updated", fourth[b.attachment_key]
    assert fourth[c.attachment_key]["status"] == "skipped", fourth[c.attachment_key]

    # force re-applies everything
    forced = by_attachment(run_zotero(eng, zcopy, root, force=True))
    for e in found(zcopy).values():
        assert forced[e.attachment_key]["status"] == "updated", forced[e.attachment_key]
    again = run_zotero(eng, zcopy, root)
    assert again["totals"].get("skipped", 0) == 5, again["totals"]

    # a document ingested from disk, not from Zotero, carries no Zotero fields
    (tmp_path / "plain").mkdir()
    md = sp.make_markdown(tmp_path / "plain")
    eng.execute("ingest", {"paths": [str(md)], "kb_root": str(root)})
    hits = [h for h in search(eng, root, "sparse attention") if Path(h["path"]) == md]
    assert hits and all("zotero_key" not in h and "zotero_link" not in h for h in hits), hits


@pytest.mark.parametrize("synced", [True, False], ids=["synced", "local-only"])
def test_new_annotation_is_picked_up(eng, zcopy, tmp_path, synced):
    """Zotero adds an annotation as a new item; neither the parent nor the attachment changes. In a synced
    library the new item gets the next library version; in a library that never syncs its version stays 0
    and only its dateAdded/dateModified are new."""
    root = tmp_path / "kb"
    run_zotero(eng, zcopy, root)
    c = zcopy.entries["C"]
    con = sqlite3.connect(str(zcopy.db))
    try:
        with con:
            w = zf.ZoteroWriter(con)
            att_id = con.execute("SELECT itemID FROM items WHERE key = ?", (c.attachment_key,)).fetchone()[0]
            w.annotation(att_id, "HL4C6MZP", text="The average Coulombic efficiency over 300 cycles reached 99.3 "
                         "percent", comment="kestrelmark: best efficiency reported", page_label="7", page_index=0,
                         rects=[[66.0, 400.0, 520.0, 411.0]], version=40 if synced else 0,
                         added="2024-08-01 12:00:00")
            if synced:
                w.bump_library_version()
            else:
                con.execute("UPDATE items SET synced = 0 WHERE key = 'HL4C6MZP'")
    finally:
        con.close()
    resp = by_attachment(run_zotero(eng, zcopy, root))
    assert resp[c.attachment_key]["status"] == "updated", resp[c.attachment_key]
    assert resp[c.attachment_key]["annotations"] == 1, resp[c.attachment_key]
    hits = search(eng, root, "kestrelmark")
    assert hits and Path(hits[0]["path"]) == c.path and hits[0]["section"] == "Zotero annotation", hits
    assert hits[0]["page"] == 1 and hits[0]["page_label"] == "7", hits[0]


def test_local_edits_reach_the_library(eng, zcopy, tmp_path):
    """Edits made in Zotero without syncing (versions stay as they are): one annotation moved to the trash,
    the other erased, a tag removed, the item moved to another collection."""
    root = tmp_path / "kb"
    run_zotero(eng, zcopy, root)
    a = zcopy.entries["A"]
    first, second = zcopy.annotations
    assert search(eng, root, first.token) and search(eng, root, "copper", filters={"tag": "cvd"})
    con = sqlite3.connect(str(zcopy.db))
    try:
        with con:
            w = zf.ZoteroWriter(con)
            ids = {k: i for k, i in con.execute("SELECT key, itemID FROM items")}
            w.trash(ids[first.key])
            con.execute("DELETE FROM itemAnnotations WHERE itemID = ?", (ids[second.key],))
            con.execute("DELETE FROM items WHERE itemID = ?", (ids[second.key],))
            con.execute("DELETE FROM itemTags WHERE itemID = ? AND tagID = (SELECT tagID FROM tags WHERE name = 'cvd')",
                        (ids[a.item_key],))
            coll = {k: i for k, i in con.execute("SELECT key, collectionID FROM collections")}
            con.execute("DELETE FROM collectionItems WHERE itemID = ?", (ids[a.item_key],))
            w.add_to_collection(coll[zcopy.collections["Biophysics"]], ids[a.item_key])
            con.execute("UPDATE items SET dateModified = '2024-10-02 16:00:00', clientDateModified = "
                        "'2024-10-02 16:00:00', synced = 0 WHERE itemID = ?", (ids[a.item_key],))
    finally:
        con.close()
    resp = by_attachment(run_zotero(eng, zcopy, root))
    it = resp[a.attachment_key]
    assert it["status"] == "updated" and it["annotations"] == 0, it
    assert search(eng, root, first.token) == [] and search(eng, root, second.token) == []
    assert search(eng, root, "copper", filters={"tag": "cvd"}) == []
    assert _paths(search(eng, root, "copper", filters={"tag": "review"})) == {a.path}
    assert search(eng, root, "copper", filters={"collection": "Graphene"}) == []
    assert a.path in _paths(search(eng, root, "copper", filters={"collection": "Biophysics"}))


def test_renamed_attachment_is_moved(eng, zcopy, tmp_path):
    """Zotero renames a stored file (e.g. 'Rename File from Parent Metadata'): same content, new path."""
    root = tmp_path / "kb"
    run_zotero(eng, zcopy, root)
    b = zcopy.entries["B"]
    new_path = b.path.with_name("Watanabe et al. - 2021 - Vectorial synthesis.pdf")
    b.path.rename(new_path)
    con = sqlite3.connect(str(zcopy.db))
    try:
        with con:
            con.execute("UPDATE itemAttachments SET path = ? WHERE itemID = (SELECT itemID FROM items WHERE key = ?)",
                        (f"storage:{new_path.name}", b.attachment_key))
            con.execute("UPDATE items SET version = version + 1, dateModified = '2024-09-01 09:30:00' WHERE key = ?",
                        (b.attachment_key,))
    finally:
        con.close()
    resp = by_attachment(run_zotero(eng, zcopy, root))
    it = resp[b.attachment_key]
    assert it["status"] == "moved" and Path(it["path"]) == new_path, it
    docs = docs_by_path(eng, root)
    assert str(b.path) not in docs
    assert docs[str(new_path)]["title"] == b.title
    hits = [h for h in search(eng, root, "ribosome exit tunnel") if h.get("zotero_key") == b.item_key]
    assert hits and all(Path(h["path"]) == new_path for h in hits), hits


def test_pdf_already_in_the_library_gets_zotero_metadata(eng, zcopy, tmp_path):
    """A file ingested before (same path) is not parsed again: Zotero's metadata is laid over it."""
    root = tmp_path / "kb"
    a = zcopy.entries["A"]
    eng.execute("ingest", {"paths": [str(a.path)], "kb_root": str(root)})
    before = {h["chunk_id"]: h for h in search(eng, root, "nucleation density copper") if Path(h["path"]) == a.path}
    assert before and all(h["title"] == sp.GRAPHENE_TITLE and "zotero_key" not in h for h in before.values())
    resp = by_attachment(run_zotero(eng, zcopy, root))
    it = resp[a.attachment_key]
    assert it["status"] == "updated" and it["annotations"] == 2, it
    after = {h["chunk_id"]: h for h in search(eng, root, "nucleation density copper") if Path(h["path"]) == a.path}
    body = {cid: h for cid, h in after.items() if h["section"] != "Zotero annotation"}
    assert set(body) == set(before), "the document's chunks were replaced"
    assert all(h["title"] == a.title and h["zotero_key"] == a.item_key for h in after.values()), after
    assert docs_by_path(eng, root)[str(a.path)]["title"] == a.title


def test_same_pdf_ingested_elsewhere_keeps_zotero_annotations(eng, zcopy, tmp_path):
    """The user ingested their own copy of a paper before importing Zotero (same bytes, another path): the
    Zotero attachment is a duplicate of it, but its annotations must not be lost."""
    root = tmp_path / "kb"
    a = zcopy.entries["A"]
    papers = tmp_path / "papers"
    papers.mkdir()
    shutil.copy2(a.path, papers / "my copy of the graphene paper.pdf")
    eng.execute("ingest", {"paths": [str(papers)], "kb_root": str(root)})
    resp = by_attachment(run_zotero(eng, zcopy, root))
    it = resp[a.attachment_key]
    assert it["status"] in ("added", "updated", "duplicate"), it
    assert it["annotations"] == 2, it
    for ann in zcopy.annotations:
        hits = search(eng, root, ann.token)
        assert hits, f"annotation {ann.token!r} lost"
        assert hits[0]["section"] == "Zotero annotation" and hits[0]["zotero_key"] == a.item_key, hits[0]


def test_bad_attachment_does_not_stop_import(eng, zcopy, tmp_path):
    folder = zcopy.data_dir / "storage" / "LM7R3QWX"
    folder.mkdir()
    (folder / "broken.pdf").write_bytes(b"%PDF-1.7\n1 0 obj << /Type /Catalog >>\ngarbage without pages\n")
    con = sqlite3.connect(str(zcopy.db))
    try:
        with con:
            w = zf.ZoteroWriter(con)
            item_id = w.article("KV5N8PTC", title="A Damaged Download", date="2019-00-00 2019",
                                authors=[("Rosa", "Lind")], version=21)
            w.attachment(item_id, "LM7R3QWX", path="storage:broken.pdf", link_mode=zf.LINK_IMPORTED_URL,
                         content_type="application/pdf", version=21)
    finally:
        con.close()
    resp = run_zotero(eng, zcopy, tmp_path / "kb")
    bad = by_attachment(resp)["LM7R3QWX"]
    assert bad["status"] == "error" and bad["title"] == "A Damaged Download", bad
    assert isinstance(bad.get("reason"), str) and bad["reason"], bad
    assert isinstance(bad.get("error"), str) and len(bad["error"]) >= 5 and "Traceback" not in bad["error"], bad
    assert resp["totals"].get("added", 0) == 5 and resp["totals"]["error"] == 1, resp["totals"]


def test_locating_the_database(eng, kb_engine, zcopy, home, tmp_path, monkeypatch):
    with pytest.raises(kb_engine.KBError) as exc:
        eng.execute("zotero", {"kb_root": str(tmp_path / "kb"), "dry_run": True})
    assert err_code(exc.value) == "not_found"
    monkeypatch.setenv("KB_ZOTERO_DB", str(zcopy.db))
    resp = eng.execute("zotero", {"kb_root": str(tmp_path / "kb"), "dry_run": True})
    assert Path(resp["zotero_db"]) == zcopy.db and resp["totals"]["items"] == len(zcopy.listed)
    monkeypatch.delenv("KB_ZOTERO_DB")
    shutil.copytree(zcopy.data_dir, home / "Zotero")
    resp = eng.execute("zotero", {"kb_root": str(tmp_path / "kb"), "dry_run": True})
    assert Path(resp["zotero_db"]) == home / "Zotero" / "zotero.sqlite", resp["zotero_db"]


# ---------------------------------------------------------------------------
# (b) the real databases

def _expected_attachments(db: Path, kinds=("application/pdf",)) -> dict:
    return {r["attachment_key"]: r for r in zf.read_attachments(db)
            if r["contentType"] in kinds and not r["trashed"] and r["item_key"]}


def test_zotero6_real_database(eng, tmp_path):
    db = copy_real(tmp_path, ZOTERO6_DIR)
    before = tree_digest(db.parent)
    expected = _expected_attachments(db)
    assert len(expected) == 4
    resp = run_zotero(eng, db, tmp_path / "kb")
    items = by_attachment(resp)
    assert set(items) == set(expected), (sorted(items), sorted(expected))
    for key, want in expected.items():
        it = items[key]
        # the four PDFs are byte-identical placeholders: one is indexed, the others are its duplicates
        assert it["status"] in ("added", "duplicate"), it
        assert it["item_key"] == want["item_key"] and it["title"] == want["title"], it
        assert Path(it["path"]) == zf.storage_path(db, key, want["path"]), it
    assert sum(1 for it in items.values() if it["status"] == "added") >= 1
    docs = docs_by_path(eng, tmp_path / "kb")
    indexed = [d for d in docs.values() if d["status"] == "indexed"]
    assert indexed
    by_path = {str(zf.storage_path(db, k, w["path"])): w for k, w in expected.items()}
    for d in indexed:
        want = by_path[d["path"]]
        assert d["title"] == want["title"] and d["doi"] == want["doi"] and d["year"] == want["year"], d
        assert d["authors"] == want["authors"], d
    hits = search(eng, tmp_path / "kb", "papis test file")
    assert hits
    keys = {w["item_key"]: w for w in expected.values()}
    for h in hits:
        assert h["zotero_key"] in keys and h["title"] == keys[h["zotero_key"]]["title"], h
    assert tree_digest(db.parent) == before


def test_zotero5_real_database(eng, tmp_path):
    db = copy_real(tmp_path, ZOTERO5_DIR)
    before = tree_digest(db.parent)
    all_atts = {r["attachment_key"]: r for r in zf.read_attachments(db)}
    pdfs = _expected_attachments(db)
    html = {k for k, r in all_atts.items() if r["contentType"] == "text/html"}
    trashed = {k for k, r in all_atts.items() if r["trashed"]}
    assert {"PF43J7H2", "JQ7VF2VX", "WRGHBFKT", "ZES38R53"} <= set(pdfs) and "UX2C4EQV" in trashed
    resp = run_zotero(eng, db, tmp_path / "kb")
    items = by_attachment(resp)
    assert not html & set(items), sorted(html & set(items))
    assert not trashed & set(items), sorted(trashed & set(items))
    for key, want in pdfs.items():
        it = items.get(key)
        assert it is not None, f"{key} ({want['title']}) not listed"
        assert it["status"] != "missing", it                 # the files are there (broken stub PDFs)
        assert it["item_key"] == want["item_key"] and it["title"] == want["title"], it
        if it["status"] == "error":
            assert isinstance(it.get("reason"), str) and it["reason"], it
            assert isinstance(it.get("error"), str) and "Traceback" not in it["error"], it
    assert resp["collections"] == 3, resp["collections"]
    assert not any(p.endswith(".html") for p in docs_by_path(eng, tmp_path / "kb"))
    assert tree_digest(db.parent) == before


# ---------------------------------------------------------------------------
# (c) a database held open by a running Zotero

def test_import_while_zotero_holds_the_database(eng, zcopy, tmp_path):
    db = zcopy.db
    wal = Path(f"{db}-wal")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import zotero_fixture as z; z.hold_wal_writer(sys.argv[2])")
    proc = subprocess.Popen([sys.executable, "-c", code, str(Path(zf.__file__).parent), str(db)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, f"the Zotero stand-in did not start: {proc.stderr.read() if proc.poll() is not None else ''}"
        held = json.loads(line)
        assert held["journal_mode"] == "wal" and held["locking_mode"] == "exclusive", held
        # the situation: the new item is only in the WAL, and nobody else can open the database
        assert wal.is_file() and wal.stat().st_size > 0
        assert held["item_key"].encode() in wal.read_bytes()
        assert held["item_key"].encode() not in db.read_bytes()
        other = sqlite3.connect(str(db), timeout=0.2)
        try:
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("SELECT COUNT(*) FROM items").fetchone()
        finally:
            other.close()
        names_before = sorted(p.name for p in zcopy.data_dir.iterdir())
        digests = {p.name: sha256(p) for p in (db, wal)}

        resp = run_zotero(eng, zcopy, tmp_path / "kb")

        items = by_attachment(resp)
        new = items.get(held["attachment_key"])
        assert new is not None, "the item that is only in the WAL was not seen"
        assert new["status"] == "added" and new["item_key"] == held["item_key"], new
        assert new["title"] == zf.WAL_ENTRY["title"], new
        assert resp["totals"].get("added", 0) == 6, resp["totals"]
        hits = search(eng, tmp_path / "kb", zf.WAL_ENTRY["token"])
        assert hits and all(h["zotero_key"] == held["item_key"] for h in hits), hits
        assert {p.name: sha256(p) for p in (db, wal)} == digests, "Zotero's files changed"
        assert sorted(p.name for p in zcopy.data_dir.iterdir()) == names_before
        assert proc.poll() is None, "the Zotero stand-in died"
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def busy_zotero(lib: zf.ZoteroLibrary, folder: Path, pause: float):
    """A separate process writing ``lib``'s database as a busy Zotero 7 does (zotero_fixture.busy_writer: an
    exclusive lock, WAL, a new attachment per transaction ``pause`` seconds apart, wal_checkpoint(TRUNCATE) after
    every second one); yields a function that says how many attachments it has committed so far."""
    status, stop = folder / "committed", folder / "stop"
    stop.unlink(missing_ok=True)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import zotero_fixture as z; "
            "z.busy_writer(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]))")
    proc = subprocess.Popen([sys.executable, "-c", code, str(Path(zf.__file__).parent), str(lib.db), str(status),
                             str(stop), str(pause)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, f"the Zotero stand-in did not start: {proc.stderr.read() if proc.poll() is not None else ''}"
        held = json.loads(line)
        assert held == {"journal_mode": "wal", "locking_mode": "exclusive"}, held
        assert not Path(f"{lib.db}-shm").exists()        # the WAL index is in the writer's memory, as in Zotero
        yield lambda: int(status.read_text())
        assert proc.poll() is None, f"the Zotero stand-in died: {proc.stderr.read()}"
    finally:
        stop.touch()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def busy_attachments_wrong(seen: dict[str, str | None], committed_before: int) -> str | None:
    """What is wrong with the writer's attachments a read saw (attachment key -> its parent's title), if anything:
    it must see every one committed before it began, none twice or out of order, each with its parent's title."""
    count = len(seen)
    expected = {zf._busy_key(zf.BUSY_ATTACHMENT_PREFIX, n): f"Field Observation {n}" for n in range(count)}
    if count < committed_before:
        return f"{count} attachments seen, {committed_before} committed before the read began"
    if seen != expected:
        return f"not the first {count} attachments with their titles: {sorted(set(seen) ^ set(expected))[:5]}"
    return None


@pytest.mark.slow      # 50 reads while a writer process commits and checkpoints
def test_reads_while_zotero_writes_and_checkpoints(eng, kb_engine, tmp_path):
    """Zotero 7 keeps zotero.sqlite in WAL mode under an exclusive lock and checkpoints it with TRUNCATE: a copy
    of the database file and then of its log can straddle a checkpoint and be damaged, or older than what was
    committed. With a writer process saving without rest and checkpointing after every second transaction,
    (b) the syncs of a library watching the database and (a) 50 `zotero` reads all succeed, none sees fewer
    attachments than were committed before it began (nor an attachment without its parent's data), and the
    library loses nothing."""
    lib = zf.build_library(tmp_path / "z", FIXTURES)
    zf.fill_sync_cache(lib.db, 4)        # a copy takes a few milliseconds, as a synced library's does
    kb = tmp_path / "kb"
    failures, inconsistent, removed = [], [], []
    eng.execute("watch", {"kb_root": str(kb), "add": [str(lib.data_dir)]})
    # (b) each sync imports the attachments added since the last one: this writer leaves it the time to
    with busy_zotero(lib, tmp_path, pause=0.02) as committed:
        for _ in range(12):
            before = committed()
            try:
                resp = eng.execute("sync", {"kb_root": str(kb)})
            except kb_engine.KBError as exc:
                failures.append(f"sync: {exc.code}: {exc.message}")
                continue
            failures += [f"sync: {e}" for e in resp.get("errors", [])]
            removed += resp["removed"]
            held = dict(db_rows(kb, "SELECT zotero_attachment_key, title FROM docs WHERE status = 'indexed' AND "
                                    "zotero_attachment_key LIKE ?", (zf.BUSY_ATTACHMENT_PREFIX + "%",)))
            wrong = busy_attachments_wrong(held, before)
            inconsistent += [f"sync: {wrong}"] if wrong else []
    # (a) a read lists the attachments without importing them: this writer saves every few milliseconds
    with busy_zotero(lib, tmp_path, pause=0.005) as committed:
        for _ in range(50):
            before = committed()
            try:
                resp = eng.execute("zotero", {"zotero_db": str(lib.db), "dry_run": True})
            except kb_engine.KBError as exc:
                failures.append(f"zotero: {exc.code}: {exc.message}")
                continue
            wrong = busy_attachments_wrong({it["attachment_key"]: it["title"] for it in resp["items"]
                                            if it["attachment_key"].startswith(zf.BUSY_ATTACHMENT_PREFIX)}, before)
            inconsistent += [f"zotero: {wrong}"] if wrong else []
    assert (failures, inconsistent, removed) == ([], [], [])
    keys = {key for (key,) in db_rows(kb, "SELECT zotero_attachment_key FROM docs WHERE status = 'indexed'")}
    assert {e.attachment_key for e in found(lib).values()} <= keys       # the library's own papers are all there


def watched_and_synced(eng, lib: zf.ZoteroLibrary, kb: Path) -> dict[str, tuple]:
    """Watch the Zotero library, sync it once; the library's documents: attachment key -> (path, title)."""
    eng.execute("watch", {"kb_root": str(kb), "add": [str(lib.data_dir)]})
    assert not eng.execute("sync", {"kb_root": str(kb)}).get("errors")
    return library_docs(kb)


def library_docs(kb: Path) -> dict[str, tuple]:
    return {key: (path, title) for key, path, title in
            db_rows(kb, "SELECT zotero_attachment_key, path, title FROM docs WHERE zotero_attachment_key IS NOT NULL")}


def trash(lib: zf.ZoteroLibrary, entry: zf.Entry) -> None:
    with contextlib.closing(sqlite3.connect(str(lib.db))) as con, con:
        item = con.execute("SELECT itemID FROM items WHERE key = ?", (entry.item_key,)).fetchone()[0]
        zf.ZoteroWriter(con).trash(item)


@pytest.mark.slow      # a writer process that never lets a snapshot stand, for the whole retry window
@pytest.mark.internals
def test_a_database_that_never_stands_still_is_zotero_busy(eng, kb_engine, tmp_path, monkeypatch):
    """A stand-in that cannot be copied whole (its log begins again between any two looks at it): `zotero` and
    a sync give up after KB_ZOTERO_SNAPSHOT_S with zotero_busy, and the sync leaves the library alone, though
    an item was trashed in Zotero meanwhile; once the database can be copied, the next sync removes it."""
    lib = zf.build_library(tmp_path / "z", FIXTURES)
    kb = tmp_path / "kb"
    held = watched_and_synced(eng, lib, kb)
    marks = db_rows(kb, "SELECT value FROM meta WHERE key = 'watch_sources'")
    trash(lib, lib.entries["C"])
    looks = iter(range(10**6))
    real_state = kb_engine._zotero_files_state

    def restarting_log(db_path):
        state = real_state(db_path)
        return {**state, "-wal": (1, 1, 4096, 0, 0, next(looks).to_bytes(32, "big"))}   # new salts every look

    monkeypatch.setattr(kb_engine, "_zotero_files_state", restarting_log)
    monkeypatch.setenv("KB_ZOTERO_SNAPSHOT_S", "0.2")
    with pytest.raises(kb_engine.KBError) as refused:
        eng.execute("zotero", {"zotero_db": str(lib.db), "dry_run": True})
    assert refused.value.code == "zotero_busy" and "try again" in refused.value.message, refused.value.message
    synced = eng.execute("sync", {"kb_root": str(kb)})
    assert synced["removed"] == [] and len(synced["errors"]) == 1 and "kept writing" in synced["errors"][0], synced
    assert library_docs(kb) == held
    source = json.loads(db_rows(kb, "SELECT value FROM meta WHERE key = 'watch_sources'")[0][0])[0]
    assert source["zotero_mark"] == json.loads(marks[0][0])[0]["zotero_mark"]     # the next sync reads it again

    monkeypatch.undo()
    synced = eng.execute("sync", {"kb_root": str(kb)})
    assert not synced.get("errors") and [Path(p).parent.name for p in synced["removed"]] == \
        [lib.entries["C"].attachment_key], synced


def test_a_damaged_database_is_zotero_unreadable_and_removes_nothing(eng, kb_engine, tmp_path):
    """A database whose attachments table is damaged (its first page overwritten) opens, but is not read: `zotero`
    answers zotero_unreadable, and a sync says so and removes none of the documents it could not see."""
    lib = zf.build_library(tmp_path / "z", FIXTURES)
    kb = tmp_path / "kb"
    held = watched_and_synced(eng, lib, kb)
    with contextlib.closing(sqlite3.connect(f"file:{lib.db}?mode=ro", uri=True)) as con:
        page_size = con.execute("PRAGMA page_size").fetchone()[0]
        root = con.execute("SELECT rootpage FROM sqlite_master WHERE name = 'itemAttachments'").fetchone()[0]
    with open(lib.db, "r+b") as raw:
        raw.seek((root - 1) * page_size)
        raw.write(b"\xff" * 64)
    with pytest.raises(kb_engine.KBError) as refused:
        eng.execute("zotero", {"zotero_db": str(lib.db), "dry_run": True})
    assert refused.value.code == "zotero_unreadable" and "damaged" in refused.value.message, refused.value.message
    synced = eng.execute("sync", {"kb_root": str(kb)})
    assert synced["removed"] == [] and len(synced["errors"]) == 1 and "damaged" in synced["errors"][0], synced
    assert library_docs(kb) == held


@pytest.mark.slow      # reader processes and a real model
def test_import_with_read_ahead_workers_and_vectors_matches_in_process(kb_engine, zcopy, tmp_path, monkeypatch):
    """The import runs on the ingest pipeline: with a reader process and an encoding thread (as the engine runs
    as its own program) the library holds the same documents, Zotero data, chunks and progress as when every
    file is read in-process, and every chunk, annotations included, ends with a vector."""
    from helpers import use_minilm
    _isolate(monkeypatch, tmp_path / "home")
    use_minilm(monkeypatch)
    results = {}
    for workers in ("0", "1"):
        monkeypatch.setenv("KB_INGEST_WORKERS", workers)
        root = tmp_path / f"kb-{workers}"
        events = []
        engine = kb_engine.Engine(own_process=True)
        try:
            resp = engine.execute("zotero", {"zotero_db": str(zcopy.db), "kb_root": str(root)},
                                  progress=events.append)
        finally:
            engine.close()
        check_shape(resp)
        zotero_done = [e["done"] for e in events if e.get("phase") == "zotero"]
        assert zotero_done == list(range(1, len(resp["items"]) + 1)), zotero_done
        with sqlite3.connect(root / "kb.sqlite") as conn:
            docs = conn.execute("SELECT title, zotero_key, zotero_attachment_key, chunk_count, collections, tags "
                                "FROM docs ORDER BY path").fetchall()
            chunks, vectors = conn.execute("SELECT (SELECT COUNT(*) FROM chunks), "
                                           "(SELECT COUNT(*) FROM vecs)").fetchone()
        assert chunks > 0 and vectors == chunks, (chunks, vectors)
        assert resp["totals"]["vectors_missing"] == 0 and resp["totals"]["vectors_written"] == chunks
        results[workers] = ([(i["attachment_key"], i["status"], i["chunks"], i["annotations"]) for i in resp["items"]],
                            docs)
    assert results["0"] == results["1"]


def test_group_libraries_are_told_apart_and_filtered(eng, zcopy, tmp_path):
    """A group library beside the user's own (as Zotero keeps one it syncs): each document says which library it
    came from, docs reports it, and the `library` filter selects one; a feed's items are no papers."""
    con = sqlite3.connect(str(zcopy.db))
    with con:
        con.execute("INSERT INTO libraries (libraryID, type, editable, filesEditable) VALUES (2, 'group', 1, 1)")
        con.execute("INSERT INTO groups (groupID, libraryID, name, description, version) "
                    "VALUES (4711, 2, 'Catalysis Lab', '', 3)")
        con.execute("INSERT INTO libraries (libraryID, type, editable, filesEditable) VALUES (3, 'feed', 1, 0)")
        for library_id, key, attachment_key, maker in ((2, "GRPQ7K2A", "GRPA7TT3", sp.make_ligature_paper),
                                                       (3, "FEDQ7K2A", "FEDA7TT3", sp.make_markdown)):
            writer = zf.ZoteroWriter(con, library_id=library_id)
            parent = writer.article(key, title=f"Shared paper of library {library_id}", date="2022-01-01 2022")
            folder = zcopy.data_dir / "storage" / attachment_key
            folder.mkdir()
            paper = maker(folder)
            writer.attachment(parent, attachment_key, path=f"storage:{paper.name}", link_mode=zf.LINK_IMPORTED_FILE,
                              content_type="application/pdf" if paper.suffix == ".pdf" else "text/markdown")
    con.close()
    root = tmp_path / "kb"
    resp = run_zotero(eng, zcopy, root)
    libraries = {it["attachment_key"]: it["library"] for it in resp["items"]}
    assert libraries["GRPA7TT3"] == "Catalysis Lab" and "FEDA7TT3" not in libraries
    assert set(libraries.values()) == {"My Library", "Catalysis Lab"}
    assert resp["libraries"] == {"My Library": len(libraries) - 1, "Catalysis Lab": 1}
    docs = eng.execute("docs", {"kb_root": str(root)})["docs"]
    by_library = {d["zotero_library"] for d in docs if d["status"] == "indexed"}
    assert by_library == {"My Library", "Catalysis Lab"}
    query = "strontium titanate quantum efficiency"
    hits = eng.execute("search", {"kb_root": str(root), "query": query, "mode": "keyword",
                                  "filters": {"library": "catalysis lab"}})["results"]
    assert hits and {h["path"] for h in hits} == {str(zcopy.data_dir / "storage" / "GRPA7TT3" /
                                                      "photocatalysis_ligatures.pdf")}
    assert hits[0]["zotero_link"].startswith("zotero://open-pdf/groups/4711/items/GRPA7TT3")
    mine = eng.execute("search", {"kb_root": str(root), "query": query, "mode": "keyword",
                                  "filters": {"library": ["My Library"]}})["results"]
    assert all("GRPA7TT3" not in h["path"] for h in mine)
