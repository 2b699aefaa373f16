"""A researcher's first hour (issue 29): the `kb-engine` command reads as text wherever it runs, hints name what
each host types, rag on the terminal shows the works a passage cites, and the test run says why tests skipped."""
from __future__ import annotations

import json
import math
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ENGINE, ROOT, clean_env, run_cli, sp

pytestmark = [pytest.mark.skipif(sys.platform == "win32", reason="POSIX pseudo-terminals")]

KB_ENGINE_COMMAND = Path(sys.executable).with_name("kb-engine")


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """The sample papers and the provenance papers (whose passages cite each other), keyword only."""
    work = tmp_path_factory.mktemp("first-hour")
    sp.write_all(work / "papers")
    sp.write_provenance(work / "papers" / "provenance")
    kb = work / "kb"
    r = run_cli("ingest", {"paths": [str(work / "papers")], "kb_root": str(kb)}, env=clean_env(KB_EMBED_MODEL="none"))
    assert r.rc == 0, r
    return kb


def people(*args: str, kb: Path, stdin=subprocess.DEVNULL, terminal: bool = False) -> tuple[int, str, str]:
    """Run the installed `kb-engine` the way a script, cron or a notebook cell does (stdout a pipe), or on a
    pseudo-terminal."""
    if not KB_ENGINE_COMMAND.exists():
        pytest.skip("the kb-engine command is not installed in this Python (pip install -e .)")
    argv = [str(KB_ENGINE_COMMAND), *args, "--kb-root", str(kb)]
    env = clean_env(KB_EMBED_MODEL="none")
    if not terminal:
        done = subprocess.run(argv, stdin=stdin, capture_output=True, text=True, env=env, timeout=120, cwd=str(ROOT))
        return done.returncode, done.stdout, done.stderr
    leader, follower = pty.openpty()
    try:
        done = subprocess.run(argv, stdin=follower, stdout=follower, stderr=subprocess.PIPE, env=env, timeout=120,
                              cwd=str(ROOT))
        os.close(follower)
        chunks = []
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        return done.returncode, b"".join(chunks).decode("utf-8", "replace"), done.stderr.decode()
    finally:
        os.close(leader)


# -- 1. text for people, wherever the command runs -----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("command", ["stats", "docs", "models"])
def test_kb_engine_prints_text_in_a_script_and_on_a_terminal(library, command):
    for terminal in (False, True):
        rc, out, err = people(command, kb=library, terminal=terminal)
        assert rc == 0, err
        assert out.strip() and "{" not in out and '"ok"' not in out, out[:500]
    rc, out, _ = people(command, "--json", kb=library)
    assert rc == 0 and json.loads(out)


def test_kb_engine_with_a_payload_piped_in_still_reads_as_text(library):
    """`kb-engine` is the people's command even when something is piped to it; programs use kb_engine.py."""
    rc, out, _ = people("stats", kb=library, stdin=None)
    assert rc == 0 and "parser_revision: " in out
    one_shot = subprocess.run([sys.executable, str(ENGINE), "stats"], input=json.dumps({"kb_root": str(library)}),
                              capture_output=True, text=True, env=clean_env(KB_EMBED_MODEL="none"), timeout=120)
    assert json.loads(one_shot.stdout)["ok"] is True          # the JSON protocol is unchanged


def test_a_missing_query_is_a_sentence_not_json(library):
    rc, out, err = people("search", kb=library)
    assert rc == 2 and not out.strip() and "error: the following arguments are required: query" in err
    assert "\"ok\"" not in err


# -- 2. each host's hints name its own way --------------------------------------------------------------------

def test_the_language_hint_names_the_flag_on_the_command_line_and_the_field_in_json(library):
    rc, out, _ = people("search", "石墨烯在铜上的成核", "--mode", "keyword", kb=library)
    assert rc == 0 and "`--also`" in out and "`queries`" not in out, out[:600]
    r = run_cli("search", {"query": "石墨烯在铜上的成核", "mode": "keyword", "kb_root": str(library)},
                env=clean_env(KB_EMBED_MODEL="none"))
    assert "`queries`" in r.json["lang_note"] and "--also" not in r.json["lang_note"]


def test_the_clear_hint_names_yes_on_the_command_line_and_confirm_in_json(library):
    rc, out, err = people("clear", kb=library)
    assert rc == 1 and "`--yes`" in err and "confirm: true" not in err
    r = run_cli("clear", {"kb_root": str(library)})
    assert r.json["code"] == "confirm_required" and "`confirm: true`" in r.json["error"]


def test_snippet_help_says_what_zero_does():
    done = subprocess.run([sys.executable, str(ENGINE), "search", "--help"], capture_output=True, text=True,
                          env=clean_env(), timeout=60)
    assert "0: the whole passage" in " ".join(done.stdout.split())


# -- 3. one library rule for the command line, serve and the MCP server ------------------------------------------

def no_library_env(home: Path, **extra) -> dict:
    """The environment of a user who set no KB_ROOT, with ``home`` as the home folder."""
    return clean_env(KB_EMBED_MODEL="none", HOME=home, USERPROFILE=home, **extra)


def kb_engine_in(folder: Path, *args: str, home: Path) -> tuple[int, str, str]:
    if not KB_ENGINE_COMMAND.exists():
        pytest.skip("the kb-engine command is not installed in this Python (pip install -e .)")
    done = subprocess.run([str(KB_ENGINE_COMMAND), *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          env=no_library_env(home), timeout=120, cwd=str(folder))
    return done.returncode, done.stdout, done.stderr


@pytest.fixture
def project(tmp_path):
    """A project folder with a library started by `kb-engine --kb-root .kb ingest`, a folder deep inside it, a
    folder outside any project, and an empty home folder."""
    home, root, elsewhere = tmp_path / "home", tmp_path / "project", tmp_path / "elsewhere"
    inside = root / "notes" / "2026"
    for folder in (home, inside, elsewhere):
        folder.mkdir(parents=True)
    paper = sp.make_ligature_paper(tmp_path / "in")
    rc, out, err = kb_engine_in(root, "--kb-root", ".kb", "ingest", str(paper), home=home)
    assert rc == 0 and (root / ".kb" / "kb.sqlite").is_file(), (out, err)
    return {"home": home, "root": root, "inside": inside, "elsewhere": elsewhere, "paper": paper}


@pytest.mark.internals
def test_the_library_rule_named_then_env_then_nearest_dot_kb_then_the_user_library(kb_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KB_ROOT", raising=False)
    (tmp_path / "p" / ".kb").mkdir(parents=True)
    deep = tmp_path / "p" / "a" / "b"
    deep.mkdir(parents=True)
    assert kb_engine.library_choice(None, deep)[0] == tmp_path / "p" / ".kb"
    assert kb_engine.library_choice(None, tmp_path / "p")[0] == tmp_path / "p" / ".kb"
    root, why = kb_engine.library_choice(None, tmp_path)
    assert root == tmp_path / "home" / ".kb-rag" and "no .kb folder at or above" in why
    monkeypatch.setenv("KB_ROOT", str(tmp_path / "env"))
    assert kb_engine.library_choice(None, deep) == (tmp_path / "env", "set by KB_ROOT")
    assert kb_engine.library_choice(str(tmp_path / "named"), deep)[0] == tmp_path / "named"


@pytest.mark.slow
def test_the_command_line_finds_the_project_library_from_inside_it(project):
    rc, out, err = kb_engine_in(project["inside"], "search", "quantum efficiency", "--mode", "keyword",
                                home=project["home"])
    assert rc == 0 and project["paper"].name in out, (out, err)
    assert not (project["home"] / ".kb-rag").exists()


@pytest.mark.slow
def test_outside_any_project_the_command_line_uses_the_user_library(project):
    rc, out, err = kb_engine_in(project["elsewhere"], "ingest", str(project["paper"]), home=project["home"])
    assert rc == 0, err
    assert (project["home"] / ".kb-rag" / "kb.sqlite").is_file()
    assert not (project["elsewhere"] / ".kb").exists()


@pytest.mark.slow
def test_an_empty_library_answer_names_the_folder_the_rule_and_how_to_open_another(project):
    user_library = project["home"] / ".kb-rag"
    rc, out, err = kb_engine_in(project["elsewhere"], "search", "quantum efficiency", home=project["home"])
    assert rc == 0, err
    assert f"the library at {user_library} is empty" in out
    assert f"the user library: no .kb folder at or above {project['elsewhere']}" in out
    assert "kb-engine --kb-root PATH, or KB_ROOT=PATH" in out
    r = run_cli("stats", {}, cwd=project["elsewhere"], env=no_library_env(project["home"]))
    assert r.json["exists"] is False and r.json["kb_root"] == str(user_library)
    assert r.json["kb_root_from"].startswith("the user library") and str(user_library) in r.json["note"]
    r = run_cli("stats", {}, cwd=project["inside"], env=no_library_env(project["home"]))
    assert r.json["kb_root"] == str(project["root"] / ".kb") and r.json["indexed_docs"] == 1
    assert "kb_root_from" not in r.json              # a library that exists needs no explanation


@pytest.mark.slow
def test_serve_opens_the_same_library_from_inside_the_project(project):
    from helpers import serve

    rc, replies, err = serve([json.dumps({"id": 1, "command": "stats", "payload": {}}).encode()],
                             env=no_library_env(project["home"]), cwd=project["inside"])
    assert rc == 0 and replies[0]["ok"] is True, err
    stats = replies[0]["response"]
    assert stats["kb_root"] == str(project["root"] / ".kb") and stats["indexed_docs"] == 1


def mcp_stats(folder: Path, home: Path) -> tuple[dict, str, dict, str]:
    """kb_stats and an empty kb_search through the MCP server started in ``folder`` with no KB_ROOT."""
    pytest.importorskip("mcp")
    anyio = pytest.importorskip("anyio")
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(command=sys.executable, args=[str(ROOT / "mcp-server" / "server.py")],
                                   env=no_library_env(home, KB_INGEST_WORKERS="0"), cwd=str(folder))

    async def main():
        with anyio.fail_after(120):
            async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                stats = await session.call_tool("kb_stats", {})
                search = await session.call_tool("kb_search", {"query": "quantum efficiency", "mode": "keyword"})
                return stats, search

    stats, search = anyio.run(main)
    text = lambda result: "\n".join(c.text for c in result.content if getattr(c, "type", None) == "text")  # noqa: E731
    return stats.structured_content, text(stats), search.structured_content, text(search)


@pytest.mark.slow
def test_the_mcp_server_opens_the_library_the_command_line_means(project):
    stats, _, search, _ = mcp_stats(project["inside"], project["home"])
    assert stats["kb_root"] == str(project["root"] / ".kb") and stats["indexed_docs"] == 1
    assert search["results"] and search["results"][0]["file"] == project["paper"].name
    stats, stats_text, search, search_text = mcp_stats(project["elsewhere"], project["home"])
    user_library = project["home"] / ".kb-rag"
    assert stats["exists"] is False and stats["kb_root"] == str(user_library)
    assert "Chosen as the user library" in stats_text and "start the server with --kb-root PATH or KB" in stats_text
    assert f"the library at {user_library} is empty (the user library" in search["note"]
    assert "start the server with --kb-root PATH" in search["note"] and "set by KB_ROOT" not in search["note"]
    assert "_Note: the library at " in search_text and "start the server with --kb-root PATH" in search_text


# -- 4. a rare Latin-script name inside a Chinese question weighs as what it is --------------------------------

CORPUS_PAPER = """# The TRECX2 corpus of scholarly papers

## Overview

The TRECX2 corpus contains 8.1 million open access papers with structured full text, drawn from publishers and
preprint servers. Each paper carries its abstract, sections, figure captions and bibliography.

## Construction

Papers were parsed with a PDF parser and linked to a citation graph. Bibliography entries were matched to papers
by title similarity.
"""

THESIS_GUIDE = """# 本科毕业设计撰写规范

## 字数

说明书不少于二万八千字,正文应包含摘要和参考文献,篇幅多少由学院规定。

## 目录

目录应列出全部章节的标题及页码。

## 附录

附录收录正文内不便列出的冗长公式推导,页数不作限制。
"""

FILLER_WORDS = "phonon lattice thermal conductivity measured sample temperature graphene copper substrate growth film"


@pytest.fixture(scope="module")
def mixed_library(tmp_path_factory):
    """Mostly English papers, one of them about a corpus named TRECX2, and a Chinese thesis guide whose every
    word is rare in this library because few passages are Chinese."""
    import random

    folder = tmp_path_factory.mktemp("mixed")
    (folder / "corpus.md").write_text(CORPUS_PAPER, encoding="utf-8")
    (folder / "guide.md").write_text(THESIS_GUIDE, encoding="utf-8")
    pick = random.Random(1)
    for i in range(8):
        words = " ".join(pick.choice(FILLER_WORDS.split()) for _ in range(150))
        (folder / f"study{i}.md").write_text(f"# Study {i} of thermal transport\n\n## Results\n\n{words}\n")
    kb = folder / ".kb"
    r = run_cli("ingest", {"paths": [str(folder)], "kb_root": str(kb)}, env=clean_env(KB_EMBED_MODEL="none"))
    assert r.rc == 0 and r.json["totals"]["added"] == 10, r
    return kb


def keyword_files(kb: Path, query: str) -> list[str]:
    r = run_cli("search", {"query": query, "mode": "keyword", "top_k": 3, "kb_root": str(kb)},
                env=clean_env(KB_EMBED_MODEL="none"))
    return [hit["file"] for hit in r.json["results"]]


@pytest.mark.slow
def test_a_latin_name_in_a_chinese_question_finds_the_english_paper_about_it(mixed_library):
    # before: the guide first (BM25 21.1 against 3.2), its 包含 and 多少 counted as characters and pairs, each
    # rare in a library that is mostly English
    assert keyword_files(mixed_library, "TRECX2语料库包含多少篇论文？")[:2] == ["corpus.md", "corpus.md"]


def test_a_question_in_one_script_still_finds_its_own_documents(mixed_library):
    assert keyword_files(mixed_library, "附录收录公式推导")[0] == "guide.md"
    assert keyword_files(mixed_library, "how many open access papers does the corpus contain")[0] == "corpus.md"


@pytest.mark.internals
def test_cjk_idf_is_judged_among_cjk_passages_only_in_a_question_mixing_scripts(kb_engine, mixed_library):
    lib = kb_engine.Library.open(mixed_library, False)
    try:
        pure, mixed = kb_engine.query_idfs(lib, ["包含"]), kb_engine.query_idfs(lib, ["trecx2", "包含"])
        total, counts = lib.term_counts(["包含"])
        assert pure["包含"] == pytest.approx(math.log((total - counts["包含"] + 0.5) / (counts["包含"] + 0.5)))
        assert mixed["包含"] < pure["包含"] / 2 and mixed["trecx2"] > 1.0
    finally:
        lib.close()


def lang_note(kb: Path, query: str, **more) -> str | None:
    r = run_cli("search", {"query": query, "mode": "keyword", "top_k": 3, "kb_root": str(kb), **more},
                env=clean_env(KB_EMBED_MODEL="none"))
    assert r.rc == 0, r
    return r.json.get("lang_note")


def test_an_english_question_about_the_chinese_guide_says_keywords_cannot_reach_it(mixed_library):
    # before: no hint at all, because 90% of the library is English like the question
    note = lang_note(mixed_library, "how many characters must the thesis text contain at least")
    assert note and "1 document of the library is Chinese" in note and "Chinese rendering" in note, note
    assert "`queries`" in note
    # a Chinese rendering alongside reaches the guide, and the hint is gone
    r = run_cli("search", {"query": "how many characters must the thesis text contain at least",
                           "queries": ["说明书不少于多少字"], "mode": "keyword", "top_k": 1,
                           "kb_root": str(mixed_library)}, env=clean_env(KB_EMBED_MODEL="none"))
    assert r.json["results"][0]["file"] == "guide.md" and "lang_note" not in r.json, r.json


def test_an_english_question_its_english_paper_answers_gets_no_language_hint(mixed_library):
    assert lang_note(mixed_library, "how many open access papers does the TRECX2 corpus contain") is None


def test_the_language_hint_names_the_flag_on_the_command_line(mixed_library):
    rc, out, _ = people("search", "how many characters must the thesis text contain at least", "--mode", "keyword",
                        kb=mixed_library)
    assert rc == 0 and "Chinese rendering of the question with `--also`" in out, out


@pytest.mark.internals
def test_document_languages_are_told_apart_by_script_and_function_words(kb_engine):
    portuguese = ("Neste trabalho estudamos a dupla difração no LHC. Os eventos são selecionados pelo detector e "
                  "também comparados com a simulação, para que a análise seja feita com uma amostra limpa. ") * 5
    english = "In this work we study double diffraction at the LHC, and the events are selected by the detector. " * 5
    assert kb_engine.text_language(portuguese, least_words=20) == "pt"
    assert kb_engine.text_language(english, least_words=20) == "en"
    assert kb_engine.text_language("本文研究了大型强子对撞机上的双衍射过程。") == "zh"
    assert kb_engine.text_language("この論文では二重回折について述べる。") == "ja"
    assert kb_engine.text_language("이 논문은 이중 회절을 다룬다") == "ko"
    assert kb_engine.text_language("LHC CMS 13 TeV") == "en"      # too little to tell: no claim


# -- 5. rag on the terminal shows the cited works, and a short note -----------------------------------------------

def test_rag_on_the_terminal_lists_the_works_a_passage_cites(library):
    rc, out, _ = people("rag", sp.CITING_TOKEN_23, "-k", "3", kb=library)
    assert rc == 0
    cites = [line for line in out.splitlines() if line.strip().startswith("cites ")]
    assert cites and any("(in the library: doc " in line for line in cites), out
    note = next(line for line in out.splitlines() if line.startswith("note:"))
    assert "not reranked" in note and len(note) < 220 and "`kb-engine models`" in note, note


# -- 8. what the tools tell the calling model about renderings ------------------------------------------------

@pytest.mark.internals
def test_the_contract_asks_for_a_sentence_stating_the_answer_not_a_keyword_list(kb_engine):
    contract = kb_engine.host_contract()
    guidance = " ".join(line["text"] for line in contract["guidance"]["lines"])
    assert "one sentence stating the answer the way the paper would" in guidance
    assert "a keyword list does not" in guidance
    for tool in contract["tools"]:
        queries = tool.get("parameters", tool.get("input_schema", {})).get("properties", {}).get("queries")
        if queries:
            assert "a sentence helps more than a keyword list" in queries["description"], tool["name"]
    # the MCP server's instructions are read from the shipped host-contract.json (the plugin's: plugin tests)
    sys.path.insert(0, str(ROOT / "mcp-server"))
    try:
        import contract as mcp_contract
    finally:
        sys.path.pop(0)
    shipped = mcp_contract.load_contract(lambda: ENGINE)
    assert "one sentence stating the answer the way the paper would" in \
        mcp_contract.guidance_text(shipped, [tool["name"] for tool in shipped["tools"]])


@pytest.mark.internals
def test_renderings_in_one_script_add_up_and_across_scripts_each_passage_keeps_its_best(kb_engine):
    question = [(1, 6.0), (2, 5.0), (3, 1.0)]          # BM25 lists, each with its ceiling
    statement = [(2, 7.0), (4, 6.5), (1, 1.0)]
    lists = [(question, 10.0), (statement, 10.0)]
    # chunk 2 is found well by both renderings of an English question: it leads once they add up
    assert [cid for cid, _ in kb_engine.merge_renderings(lists, agree=True, weigh=True)][:2] == [2, 1]
    # a Chinese question and its English rendering reach different papers: the best share counts, as before
    assert [cid for cid, _ in kb_engine.merge_renderings(lists)][:2] == [2, 4]
    # a rendering whose best match is a sliver of its ceiling (stray matches) counts for next to nothing
    stray = [(5, 0.5), (4, 0.4)]
    merged = dict(kb_engine.merge_renderings([(statement, 10.0), (stray, 10.0)], agree=True, weigh=True))
    assert merged[5] < 0.01 and merged[2] == pytest.approx(0.7)


# -- 9. the test run says why tests were skipped ----------------------------------------------------------------

@pytest.mark.slow
def test_pytest_names_the_reasons_for_its_skips():
    env = {k: v for k, v in os.environ.items() if k != "KB_CORPUS_DIR"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_corpus.py"],
                          capture_output=True, text=True, cwd=str(ROOT), env=env, timeout=300)
    assert "skipped, by reason:" in done.stdout and "KB_CORPUS_DIR" in done.stdout, done.stdout[-2000:]
