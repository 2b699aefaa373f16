"""Issue 50, point 14: a library folder reached through a symbolic link is never walked; JSON nested too deep
for the parser is a bad_request about nesting; `watch` refuses system folders and asks before a very large one."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers import clean_env, db_rows, req, run_cli, serve, sp


def ingest(engine, kb: Path, paths: list[Path]) -> dict:
    return engine.execute("ingest", {"kb_root": str(kb), "paths": [str(p) for p in paths]})


def stored_paths(kb: Path) -> list[str]:
    return sorted(r[0] for r in db_rows(kb, "SELECT path FROM docs"))


def fetched_into(library: Path, engine) -> Path:
    """A paper where fetch saves one (the library's papers folder), ingested by that path as fetch does."""
    paper = sp.make_onecolumn_paper(library / "papers")
    assert ingest(engine, library, [paper])["totals"]["added"] == 1
    return paper


# 14a. the library folder, whatever path or link leads to it ---------------------------------------------------

def test_a_library_named_through_a_linked_path_is_not_walked(engine, tmp_path):
    project = tmp_path / "project"
    own = sp.make_hyphenated_paper(project)
    (tmp_path / "alias").symlink_to(project, target_is_directory=True)
    library = tmp_path / "alias" / "library"             # kb_root given through the link; really project/library
    paper = fetched_into(library, engine)
    walked = ingest(engine, library, [project])
    assert [(Path(e["path"]).name, e["status"]) for e in walked["files"]] == [(own.name, "added")], walked["files"]
    assert stored_paths(library) == sorted([str(paper), str(own)])


def test_a_library_folder_that_is_a_link_is_not_walked_where_it_leads(engine, tmp_path):
    papers, store = tmp_path / "papers", tmp_path / "store"
    own = sp.make_hyphenated_paper(store)
    (store / "kb").mkdir()
    papers.mkdir()
    (papers / ".kb").symlink_to(store / "kb", target_is_directory=True)     # the project's library lives elsewhere
    library = papers / ".kb"
    paper = fetched_into(library, engine)
    walked = ingest(engine, library, [store])
    assert [(Path(e["path"]).name, e["status"]) for e in walked["files"]] == [(own.name, "added")], walked["files"]
    assert stored_paths(library) == sorted([str(paper), str(own)])


def test_links_into_the_library_are_passed_over_and_watch_refuses_it_by_any_path(engine, kb_engine, tmp_path):
    project = tmp_path / "project"
    library = project / "library"
    paper = fetched_into(library, engine)
    (project / "see_also.pdf").symlink_to(paper)                   # a file in the library, by a link
    (project / "shelf").symlink_to(library, target_is_directory=True)
    own = sp.make_hyphenated_paper(project)
    walked = ingest(engine, library, [project])
    assert [(Path(e["path"]).name, e["status"]) for e in walked["files"]] == [(own.name, "added")], walked["files"]
    assert stored_paths(library) == sorted([str(paper), str(own)])
    with pytest.raises(kb_engine.KBError) as refused:
        engine.execute("watch", {"kb_root": str(library), "add": [str(project / "shelf" / "papers")]})
    assert refused.value.code == "bad_request" and "inside the library" in refused.value.message


# 14b. nesting too deep for the JSON parser ----------------------------------------------------------------------

def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_json_nested_past_the_parser_is_a_bad_request_about_nesting(tmp_path, depth):
    kb = json.dumps(str(tmp_path / "kb"))
    one_shot = run_cli("search", stdin=f'{{"kb_root": {kb}, "query": "x", "filters": {{"title": {nested(depth)}}}}}')
    assert one_shot.rc == 1 and one_shot.json["code"] == "bad_request", one_shot.json
    assert "nests values more than 32 levels deep" in one_shot.json["error"]
    line = f'{{"id": 7, "command": "search", "payload": {{"kb_root": {kb}, "query": {nested(depth)}}}}}'
    rc, out, _ = serve([line.encode(), req(8, "stats", {"kb_root": str(tmp_path / "kb")})], env=clean_env())
    assert rc == 0 and out[0]["code"] == "bad_request" and "nests values" in out[0]["error"], out[0]
    assert out[1]["id"] == 8 and out[1]["ok"]        # and the daemon serves on


# 14c. watch: system folders never, a very large folder only when confirmed --------------------------------------

def test_watch_refuses_system_folders_by_any_path(engine, kb_engine, tmp_path):
    (tmp_path / "everything").symlink_to("/", target_is_directory=True)
    for folder in ("/", os.path.expanduser("~"), "/usr", "/etc", str(tmp_path / "everything"),
                   str(tmp_path / "everything" / "usr" / "share")):
        if not os.path.isdir(folder):
            continue
        with pytest.raises(kb_engine.KBError) as refused:
            engine.execute("watch", {"kb_root": str(tmp_path / "kb"), "add": [folder], "confirm": True})
        assert refused.value.code == "bad_request" and "never watched" in refused.value.message, folder
    assert engine.execute("watch", {"kb_root": str(tmp_path / "kb")})["sources"] == []


def test_watch_asks_before_a_folder_past_the_file_limit(engine, kb_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("KB_WATCH_MAX_FILES", "3")
    small, large = tmp_path / "small", tmp_path / "large"
    for i in range(3):
        sp.make_markdown(small, name=f"note_{i}.md")
    for i in range(4):
        sp.make_markdown(large / f"year_{i}", name=f"note_{i}.md")
    kb = str(tmp_path / "kb")
    assert engine.execute("watch", {"kb_root": kb, "add": [str(small)]})["added"] == [str(small)]
    with pytest.raises(kb_engine.KBError) as asked:
        engine.execute("watch", {"kb_root": kb, "add": [str(large)]})
    assert asked.value.code == "confirm_required", asked.value
    assert "more than 3 supported files" in asked.value.message and "`confirm: true`" in asked.value.message
    assert [s["path"] for s in engine.execute("watch", {"kb_root": kb})["sources"]] == [str(small)]   # nothing added
    confirmed = engine.execute("watch", {"kb_root": kb, "add": [str(large)], "confirm": True})
    assert confirmed["added"] == [str(large)]


def test_the_cli_asks_and_takes_yes(tmp_path):
    folder = tmp_path / "notes"
    for i in range(3):
        sp.make_markdown(folder, name=f"note_{i}.md")
    env = clean_env(KB_WATCH_MAX_FILES="2")
    asked = run_cli("watch", None, "--kb-root", str(tmp_path / "kb"), "--add", str(folder), env=env)
    assert asked.rc != 0 and "--yes" in asked.stderr + asked.stdout, (asked.stdout, asked.stderr)
    added = run_cli("watch", None, "--kb-root", str(tmp_path / "kb"), "--add", str(folder), "--yes", env=env)
    assert added.rc == 0 and str(folder) in added.stdout, (added.stdout, added.stderr)


@pytest.mark.slow
def test_kb_watch_through_the_mcp_server(tmp_path):
    pytest.importorskip("mcp")
    mcp_tests = pytest.importorskip("test_mcp_server")
    folder = tmp_path / "notes"
    for i in range(3):
        sp.make_markdown(folder, name=f"note_{i}.md")

    async def body(session):
        return {"root": await mcp_tests.call(session, "kb_watch", {"add": ["/"]}),
                "asked": await mcp_tests.call(session, "kb_watch", {"add": [str(folder)]}),
                "confirmed": await mcp_tests.call(session, "kb_watch", {"add": [str(folder)], "confirm": True})}

    r = mcp_tests.run_session(tmp_path / "kb", body, KB_WATCH_MAX_FILES="2")
    assert r["root"].is_error and r["root"].structured_content["code"] == "bad_request"
    assert r["asked"].is_error and r["asked"].structured_content["code"] == "confirm_required"
    assert not r["confirmed"].is_error, mcp_tests.text_of(r["confirmed"])
