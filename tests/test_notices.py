"""Notices beside an answer, made by the engine and only shown by the hosts (issue 51): a search or rag answer carries
`notices` when its host asks (`stale_notice`, `notices_since`), in the Markdown right after the header and in the
card's view. The stale-documents words are the same in `stats`; the DSH plugin's live test (plugin/test/watch.test.js)
covers a real watcher's sync, and the MCP server's tests the server's own first search."""
from __future__ import annotations

import shutil
import sqlite3
import time

import pytest

# About the engine's own functions (sync_notice, JobStore): names outside kb_engine.__all__.
pytestmark = pytest.mark.internals

STALE = "2 document(s) were indexed by an older parser"
SYNCED = ("Since the last search, the watched folders changed the library: 1 paper added. These results include "
          "them.")


def test_the_sync_notice_counts_only_sync_jobs_that_ended_after_the_time(kb_engine):
    def job(finished, totals, **extra):
        return {"command": "sync", "state": "done", "finished": finished, "result": {"totals": totals}, **extra}

    jobs = [job(90, {"added": 5}), job(110, {"added": 2, "removed": 1}),
            job(120, {"added": 1, "updated": 1, "moved": 0}), job(130, {"added": 9}, state="failed"),
            {"command": "ingest", "state": "done", "finished": 140, "result": {"totals": {"added": 7}}},
            job(150, {"added": True, "removed": "3"})]          # not counts: ignored
    assert kb_engine.sync_notice(jobs, 100) == (
        "Since the last search, the watched folders changed the library: 3 papers added, 1 updated, 1 removed. "
        "These results include them.")
    assert kb_engine.sync_notice(jobs, 125) is None
    assert kb_engine.sync_notice([], 0) is None
    assert kb_engine.stale_notice(0) is None and kb_engine.stale_notice(1).startswith("1 document(s) were indexed")


def _two_papers(kb_engine, tmp_path, sample_dir):
    papers = tmp_path / "papers"
    papers.mkdir()
    for name in ("graphene_cvd_copper.pdf", "photocatalysis_ligatures.pdf"):
        shutil.copy2(sample_dir / name, papers / name)
    kb = tmp_path / "kb"
    engine = kb_engine.Engine()
    engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(kb)})
    with sqlite3.connect(kb / "kb.sqlite") as con:      # as an older parser would have left them
        con.execute("UPDATE docs SET indexed_with = indexed_with - 1")
    con.close()
    return engine, kb


def test_a_search_carries_the_notices_its_host_asks_for(kb_engine, tmp_path, sample_dir):
    engine, kb = _two_papers(kb_engine, tmp_path, sample_dir)
    try:
        before = time.time() - 1
        store = kb_engine.JobStore(kb)
        synced = store.create("sync", {"kb_root": str(kb)}, 1)         # a sync job as the watcher's runner ends it
        synced.update(state="done", finished=time.time(), result={"totals": {"added": 1, "removed": 0}})
        store.write(synced)
        ingested = store.create("ingest", {"kb_root": str(kb)}, 1)
        ingested.update(state="done", finished=time.time(), result={"totals": {"added": 4}})
        store.write(ingested)
        for name, text in (("0123456789ab", "[]"), ("abcdefabcdef", "{}"), ("a1b2c3d4e5f6", '{"state": 3}')):
            (kb / ".kb-jobs" / f"{name}.json").write_text(text)      # files that are not jobs: passed over
        ask = {"query": "graphene nucleation copper", "kb_root": str(kb), "render": "markdown"}

        plain = engine.execute("search", ask)
        assert "notices" not in plain and "_Library:" not in plain["markdown"]

        for command in ("search", "rag"):
            answer = engine.execute(command, {**ask, "stale_notice": True, "notices_since": before})
            assert [n["kind"] for n in answer["notices"]] == ["stale_documents", "synced"], command
            assert answer["notices"][0]["text"].startswith(STALE) and answer["notices"][1]["text"] == SYNCED
            lines = answer["markdown"].split("\n")
            assert lines[1].startswith(f"_Library: {STALE}") and "metadata\\_only: true" in lines[1]
            assert lines[2] == f"_Library: {SYNCED}_"
            assert answer["view"]["notices"] == [n["text"] for n in answer["notices"]]

        assert [j["command"] for j in engine.execute("status", {"kb_root": str(kb)})["jobs"]] == ["sync", "ingest"]
        later = engine.execute("search", {**ask, "notices_since": time.time() + 1})
        assert later["notices"] == []
        with pytest.raises(kb_engine.KBError, match="notices_since must be a number"):
            engine.execute("search", {**ask, "notices_since": "yesterday"})
        stats = engine.execute("stats", {"kb_root": str(kb), "render": "markdown"})
        assert kb_engine.stale_notice(2).replace("_", "\\_") in stats["markdown"]     # the same words in stats
    finally:
        engine.close()
