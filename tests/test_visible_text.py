"""Control and bidirectional characters never reach a person raw (issue 50, point 12).

File names holding ESC[41m, a carriage return, a newline or U+202E, and titles and passages holding bidirectional
overrides and isolates, used to pass raw into the human CLI (ingest, search, rag, docs, delete, progress lines,
error messages), cite's BibTeX and CSL-JSON text, ``--json`` and a card's ``file``: a terminal obeyed the escape
sequence, the carriage return rewrote the line, the newline forged one, and "evil", U+202E, "gpj.md" read as
``evildm.jpg``. Now each such character is shown as its escape (``\\x1b``, ``\\r``, ``\\n``, ``\\u202e``) while the
library and the protocol's data fields keep the real text. The files are generated here; the CLI is the real one,
run as a program.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import clean_env, run_cli, sp

# what must never come out raw: C0 controls but the newline that ends a printed line, DEL, C1 controls, the
# bidirectional marks, embeddings, overrides and isolates, and the line and paragraph separators
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")

NAMES = {"esc": "esc\x1b[41mred.md", "cr": "cr\rover.md", "newline": "nl\nadded  forged.md",
         "rlo": "evil\u202egpj.md"}
SHOWN_NAMES = {"esc": "esc\\x1b[41mred.md", "cr": "cr\\rover.md", "newline": "nl\\nadded  forged.md",
               "rlo": "evil\\u202egpj.md"}
TITLE = "Quantum \u202eerutaerpmet\u202c Dots in a \u2067Perovskite\u2069 Lattice {n}"
SHOWN_TITLE = "Quantum \\u202eerutaerpmet\\u202c Dots in a \\u2067Perovskite\\u2069 Lattice {n}"
KB_NAME, SHOWN_KB_NAME = "library\x1b[2J\u202elib", "library\\x1b[2J\\u202elib"
PASSAGE = ("Perovskite lattice strain relaxes under humidity \u202eesrever\u202c while the \u2066isolated\u2069 grain "
           "boundaries stay intact and the quantum dots keep their photoluminescence.")


def write_papers(folder: Path) -> dict[str, Path]:
    """One Markdown paper per hostile name, each with a title and a passage holding bidirectional controls."""
    folder.mkdir(parents=True, exist_ok=True)
    papers = {}
    for n, (key, name) in enumerate(NAMES.items()):
        papers[key] = folder / name
        papers[key].write_text(f"# {TITLE.format(n=n)}\n\n## Abstract\n\n{PASSAGE}\n\n{PASSAGE}\n", encoding="utf-8")
    return papers


def assert_nothing_raw(result, what: str) -> None:
    for stream, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        found = RAW.search(text)
        assert found is None, f"{what}: raw {found.group(0)!r} on {stream}: {text[max(0, found.start() - 80):][:200]!r}"


def human(*args: str, library: Path):
    """The human CLI (`kb_engine.py COMMAND ARGS`), keyword search only, its output piped as to a log."""
    return run_cli(args[0], None, *args[1:], "--kb-root", str(library), env=clean_env(KB_EMBED_MODEL="none"))


@pytest.fixture(scope="module")
def hostile_kb(tmp_path_factory):
    base = tmp_path_factory.mktemp("visible")
    papers = write_papers(base / "papers")
    library = base / KB_NAME               # a library folder may be named badly too
    ingest = human("ingest", str(base / "papers"), library=library)
    assert ingest.rc == 0, ingest
    return library, papers, ingest


def stored_paths(library: Path) -> dict[int, str]:
    reply = run_cli("docs", {"kb_root": str(library)}, env=clean_env(KB_EMBED_MODEL="none")).json
    return {doc["doc_id"]: doc["path"] for doc in reply["docs"]}


def test_ingest_progress_and_its_report_show_hostile_names_escaped(hostile_kb):
    library, papers, ingest = hostile_kb
    assert_nothing_raw(ingest, "ingest")
    for key, shown in SHOWN_NAMES.items():
        assert f"added  {papers[key].parent}/{shown}  " in ingest.stdout, (key, ingest.stdout)
    assert "files" in ingest.stderr, ingest.stderr          # the progress lines, piped: they name the file read
    assert sorted(stored_paths(library).values()) == sorted(str(p) for p in papers.values()), "the library keeps them"


@pytest.mark.parametrize("command", [("search", "perovskite lattice strain humidity"),
                                     ("rag", "perovskite lattice strain humidity"), ("docs",), ("stats",)])
def test_search_rag_docs_and_stats_show_names_titles_and_snippets_escaped(hostile_kb, command):
    library, _, _ = hostile_kb
    result = human(*command, library=library)
    assert result.rc == 0, result
    assert_nothing_raw(result, command[0])
    if command[0] == "stats":
        assert f"kb_root: {library.parent}/{SHOWN_KB_NAME}\n" in result.stdout, result.stdout
    else:
        assert SHOWN_TITLE.format(n=0) in result.stdout and SHOWN_NAMES["rlo"] in result.stdout, result.stdout
    if command[0] in ("search", "rag"):
        assert "humidity \\u202eesrever\\u202c while the \\u2066isolated\\u2069 grain" in result.stdout


def test_json_output_escapes_them_and_keeps_the_real_values(hostile_kb):
    library, papers, _ = hostile_kb
    result = human("search", "perovskite lattice strain humidity", "-k", "10", "--json", library=library)
    assert result.rc == 0, result
    assert_nothing_raw(result, "search --json")
    reply = json.loads(result.stdout)
    assert {hit["path"] for hit in reply["results"]} == {str(p) for p in papers.values()}
    assert {hit["file"] for hit in reply["results"]} == set(NAMES.values())
    assert TITLE.format(n=0) in {hit["title"] for hit in reply["results"]}


def test_an_error_message_shows_the_name_escaped(hostile_kb, tmp_path):
    library, _, _ = hostile_kb
    missing = tmp_path / "gone\x1b]0;owned\x07\u202e.md"
    result = human("ingest", str(missing), library=library)
    assert result.rc == 1, result
    assert_nothing_raw(result, "ingest of a missing file")
    assert "gone\\x1b]0;owned\\x07\\u202e.md" in result.stdout + result.stderr, result


def test_delete_shows_the_deleted_name_escaped_and_leaves_the_others_as_stored(tmp_path):
    papers = write_papers(tmp_path / "papers")
    library = tmp_path / "library"
    assert human("ingest", str(tmp_path / "papers"), library=library).rc == 0
    result = human("delete", str(papers["newline"]), library=library)
    assert result.rc == 0, result
    assert_nothing_raw(result, "delete")
    assert f"path {papers['newline'].parent}/{SHOWN_NAMES['newline']}" in result.stdout, result.stdout
    assert sorted(stored_paths(library).values()) == sorted(str(papers[k]) for k in ("esc", "cr", "rlo"))


def test_cite_text_shows_bidirectional_controls_escaped(hostile_kb):
    library, _, _ = hostile_kb
    result = human("cite", "--doc-ids", "1", "2", library=library)
    assert result.rc == 0, result
    assert_nothing_raw(result, "cite (bibtex)")
    assert "title = {Quantum \\textbackslash{}u202eerutaerpmet\\textbackslash{}u202c Dots" in result.stdout
    reply = run_cli("cite", {"doc_ids": [1, 2], "format": "csl-json", "kb_root": str(library)},
                    env=clean_env(KB_EMBED_MODEL="none")).json
    assert RAW.search(reply["text"]) is None, reply["text"]
    titles = {item["title"] for item in json.loads(reply["text"])}     # the text's JSON escapes keep the values
    assert titles == {item["title"] for item in reply["entries"]} and titles <= {TITLE.format(n=n) for n in range(4)}
    bibtex = run_cli("cite", {"doc_ids": [1, 2], "kb_root": str(library)}, env=clean_env(KB_EMBED_MODEL="none")).json
    assert RAW.search(bibtex["text"]) is None and "u202e" in bibtex["text"], bibtex["text"]


def test_the_card_view_shows_names_and_titles_escaped_and_keeps_locators(hostile_kb, kb_engine):
    library, papers, _ = hostile_kb
    engine = kb_engine.Engine()
    try:
        reply = engine.execute("search", {"query": "perovskite lattice strain humidity", "top_k": 10,
                                          "kb_root": str(library), "mode": "keyword", "render": "markdown"})
    finally:
        engine.close()
    assert RAW.search(reply["markdown"]) is None, reply["markdown"]
    cards = {Path(source["path"]).name: source for source in reply["view"]["sources"]}
    assert set(cards) == set(NAMES.values()), "a card's path is a locator: the real one"
    for key, name in NAMES.items():
        card = cards[name]
        assert card["file"] == SHOWN_NAMES[key], card
        shown = {field: value for field, value in card.items() if field != "path"}
        assert RAW.search(json.dumps(shown, ensure_ascii=False)) is None, card
    assert SHOWN_TITLE.format(n=0) in {card["title"] for card in cards.values()}
    assert {hit["file"] for hit in reply["results"]} == set(NAMES.values()), "the data fields keep the real names"


def test_the_picture_card_shows_the_file_name_escaped(tmp_path, kb_engine):
    pdf = sp.make_hyphenated_paper(tmp_path / "papers", name="report\u202efdp.exe.pdf")
    engine = kb_engine.Engine()
    try:
        library = str(tmp_path / "library")
        engine.execute("ingest", {"paths": [str(pdf)], "kb_root": library})
        hit = engine.execute("search", {"query": "electrolyte", "kb_root": library, "mode": "keyword"})["results"][0]
        shown = engine.execute("show", {"doc_id": hit["doc_id"], "page": hit["page"], "kb_root": library,
                                        "render": "markdown"})
    finally:
        engine.close()
    assert shown["view"]["file"] == "report\\u202efdp.exe.pdf" and shown["view"]["path"] == str(pdf), shown["view"]
    assert shown["file"] == pdf.name and RAW.search(shown["markdown"]) is None, shown["markdown"]
