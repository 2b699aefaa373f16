"""One-shot JSON CLI and the human CLI, run as subprocesses."""
from __future__ import annotations

import json

import pytest

from helpers import PARSE_ERROR_CODES, assert_totals, clean_env, run_cli, sp


@pytest.fixture(scope="module")
def cli_kb(tmp_path_factory, sample_dir):
    kb = tmp_path_factory.mktemp("cli") / "kb"
    r = run_cli("ingest", {"paths": [str(sample_dir)], "kb_root": str(kb)})
    assert r.rc == 0, r
    return kb, r.json


def test_oneshot_ingest_reply(cli_kb, kb_engine):
    _, j = cli_kb
    assert j["ok"] is True
    assert j["engine"] == kb_engine.__version__
    assert isinstance(j["ms"], int) and j["ms"] >= 0
    assert_totals(j)
    assert j["totals"]["files"] == 13 and j["totals"]["added"] == 9


@pytest.mark.parametrize("cmd,payload,check", [
    ("search", {"query": "graphene nucleation on copper", "top_k": 3},
     lambda j: j["results"][0]["file"] == "graphene_cvd_copper.pdf" and len(j["results"]) <= 3),
    ("search", {"query": "the of and"}, lambda j: j["results"] == [] and j["note"]),
    ("docs", {"limit": 5}, lambda j: j["total"] == 13 and len(j["docs"]) == 5),
    ("stats", {}, lambda j: sum(j["by_status"].values()) == 13 and j["chunks"] > 0),
    ("dedup", {}, lambda j: j["groups"] == [] and j["removed"] == 0),
])
def test_oneshot_commands(cli_kb, kb_engine, cmd, payload, check):
    kb, _ = cli_kb
    r = run_cli(cmd, {**payload, "kb_root": str(kb)})
    assert r.rc == 0, r
    j = r.json
    assert j["ok"] is True and j["engine"] == kb_engine.__version__ and isinstance(j["ms"], int)
    assert check(j), j


def test_oneshot_clear(tmp_path):
    kb = tmp_path / "kb"
    r = run_cli("ingest", {"paths": [str(sp.make_hyphenated_paper(tmp_path))], "kb_root": str(kb)})
    assert r.rc == 0
    r = run_cli("clear", {"kb_root": str(kb)})
    assert r.rc == 1, r
    j = r.json
    assert j["ok"] is False and j["code"] == "confirm_required" and j["error"].strip()
    r = run_cli("clear", {"kb_root": str(kb), "confirm": True})
    assert r.rc == 0, r
    assert r.json["cleared"]["docs"] == 1 and r.json["cleared"]["chunks"] > 0


@pytest.mark.parametrize("cmd,stdin,code", [
    ("frobnicate", "{}", "unknown_command"),
    ("search", "{not json", "PARSE"),
    ("search", "[1, 2]", "bad_request"),
    ("search", '{"query": ["graphene"]}', "bad_request"),
    ("search", '{"query": "graphene", "top_k": "many"}', "bad_request"),
    ("ingest", '{"paths": 7}', "bad_request"),
    ("search", b"\xff\xfe{\"query\": \"x\"}", "PARSE"),
])
def test_oneshot_failures_exit_1(tmp_path, cmd, stdin, code):
    r = run_cli(cmd, stdin=stdin, env=clean_env(KB_ROOT=tmp_path / "kb"))
    assert r.rc == 1, r
    j = r.json
    assert j["ok"] is False and isinstance(j["error"], str) and j["error"].strip(), j
    if code == "PARSE":
        assert j["code"] in PARSE_ERROR_CODES, j
    else:
        assert j["code"] == code, j
    assert "Traceback" not in r.stdout


def test_empty_stdin_is_empty_payload_and_kb_root_env(cli_kb):
    kb, _ = cli_kb
    r = run_cli("stats", stdin=b"", env=clean_env(KB_ROOT=kb))
    assert r.rc == 0, r
    assert sum(r.json["by_status"].values()) == 13


@pytest.mark.slow      # five command-line processes, each importing the engine
def test_default_kb_root_is_the_nearest_dot_kb_folder_else_the_user_library(tmp_path):
    work, home = tmp_path / "work", tmp_path / "home"
    (work / ".kb").mkdir(parents=True)
    home.mkdir()
    paper = sp.make_ligature_paper(tmp_path / "in")
    r = run_cli("ingest", {"paths": [str(paper)]}, cwd=work, env=clean_env(HOME=home))
    assert r.rc == 0, r
    assert (work / ".kb" / "kb.sqlite").is_file() and not (home / ".kb-rag").exists()
    r = run_cli("ingest", {"paths": [str(paper)]}, cwd=tmp_path, env=clean_env(HOME=home))
    assert r.rc == 0 and (home / ".kb-rag" / "kb.sqlite").is_file()
    r = run_cli("search", {"query": "quantum efficiency"}, cwd=work, env=clean_env(HOME=home))
    assert r.json["results"] and r.json["results"][0]["file"] == paper.name
    env_root = tmp_path / "envroot"
    r = run_cli("ingest", {"paths": [str(paper)]}, cwd=work, env=clean_env(KB_ROOT=env_root))
    assert r.rc == 0 and (env_root / "kb.sqlite").is_file()
    assert r.json["files"][0]["status"] == "added"


@pytest.mark.slow      # the human command line through every command, one process each
def test_human_cli(tmp_path, sample_dir, kb_engine):
    kb = tmp_path / "hkb"
    r = run_cli("ingest", None, str(sample_dir), "--kb-root", str(kb))
    assert r.rc == 0, r
    assert r.stdout.strip()
    assert (kb / "kb.sqlite").is_file()
    r = run_cli("search", None, "graphene nucleation on copper", "-k", "3", "--kb-root", str(kb))
    assert r.rc == 0, r
    assert "graphene_cvd_copper.pdf" in r.stdout or sp.GRAPHENE_TITLE in r.stdout, r.stdout
    r = run_cli("search", None, "graphene nucleation on copper", "-k", "3", "--json", "--kb-root", str(kb))
    assert r.rc == 0, r
    j = json.loads(r.stdout)
    results = j.get("results", j.get("response", {}).get("results"))
    assert results and len(results) <= 3 and results[0]["file"] == "graphene_cvd_copper.pdf"
    r = run_cli("search", None, "石墨烯在铜上的成核", "--also", "graphene nucleation on copper", "--mode", "keyword",
                "-k", "3", "--json", "--kb-root", str(kb))
    assert r.rc == 0, r
    j = json.loads(r.stdout)
    assert j["queries"] == ["graphene nucleation on copper"] and j["results"][0]["file"] == "graphene_cvd_copper.pdf"
    r = run_cli("stats", None, "--kb-root", str(kb))
    assert r.rc == 0, r
    eng = kb_engine.Engine()
    try:
        chunks = eng.execute("stats", {"kb_root": str(kb)})["chunks"]
    finally:
        eng.close()
    assert str(chunks) in r.stdout, r.stdout
    r = run_cli("ingest", None, str(sample_dir / "battery_electrolytes.pdf"), "--kb-root", str(kb), "--force")
    assert r.rc == 0, r


def test_human_cli_uses_kb_root_env(tmp_path):
    kb = tmp_path / "envkb"
    paper = sp.make_hyphenated_paper(tmp_path / "in")
    r = run_cli("ingest", None, str(paper), env=clean_env(KB_ROOT=kb))
    assert r.rc == 0, r
    assert (kb / "kb.sqlite").is_file()
    r = run_cli("search", None, "desolvation", "--json", env=clean_env(KB_ROOT=kb))
    j = json.loads(r.stdout)
    results = j.get("results", j.get("response", {}).get("results"))
    assert results and results[0]["file"] == paper.name
