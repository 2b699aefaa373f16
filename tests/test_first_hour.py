"""A researcher's first hour (issue 29): the `kb-engine` command reads as text wherever it runs, hints name what
each host types, rag on the terminal shows the works a passage cites, and the test run says why tests skipped."""
from __future__ import annotations

import json
import os
import pty
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ENGINE, ROOT, clean_env, run_cli, sp

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX pseudo-terminals")

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


# -- 5. rag on the terminal shows the cited works, and a short note -----------------------------------------------

def test_rag_on_the_terminal_lists_the_works_a_passage_cites(library):
    rc, out, _ = people("rag", sp.CITING_TOKEN_23, "-k", "3", kb=library)
    assert rc == 0
    cites = [line for line in out.splitlines() if line.strip().startswith("cites ")]
    assert cites and any("(in the library: doc " in line for line in cites), out
    note = next(line for line in out.splitlines() if line.startswith("note:"))
    assert "not reranked" in note and len(note) < 220 and "`kb-engine models`" in note, note


# -- 9. the test run says why tests were skipped ----------------------------------------------------------------

def test_pytest_names_the_reasons_for_its_skips():
    env = {k: v for k, v in os.environ.items() if k != "KB_CORPUS_DIR"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_corpus.py"],
                          capture_output=True, text=True, cwd=str(ROOT), env=env, timeout=300)
    assert "skipped, by reason:" in done.stdout and "KB_CORPUS_DIR" in done.stdout, done.stdout[-2000:]
