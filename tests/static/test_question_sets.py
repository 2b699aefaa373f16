"""The full-text question sets are benchmarks: their shape is checked always, and (with KB_CORPUS_DIR set) every
question's evidence phrase must still be on one of its gold pages in the engine's own page text, so a parser
change that moves or drops a gold page's text is caught here rather than read as a ranking change."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import eval_pages  # noqa: E402

SETS = {"main": BENCHMARKS / "fulltext_questions.jsonl", "held-out": BENCHMARKS / "fulltext_heldout.jsonl"}
KINDS = {"definition", "number", "method", "limitation", "comparison", "advice", "setup", "result", "dataset"}


@pytest.fixture(scope="module", params=sorted(SETS))
def question_set(request):
    return request.param, eval_pages.load_questions(SETS[request.param])


def test_every_question_is_well_formed_and_named_once(question_set):
    name, questions = question_set
    ids = [q["id"] for q in questions]
    assert len(ids) == len(set(ids)), f"{name}: duplicate ids"
    for q in questions:
        assert q["question"].strip() and q["evidence"].strip() and q["doc"].strip(), q["id"]
        assert len(eval_pages.letters_and_digits(q["evidence"])) >= 15, f"{q['id']}: evidence too short to be unique"
        assert q["pages"] == sorted(set(q["pages"])), f"{q['id']}: gold pages unsorted or repeated"
        assert isinstance(q["in_abstract"], bool) and q.get("kind") in KINDS, q["id"]


def test_the_main_set_is_large_and_mostly_beyond_the_abstract():
    questions = eval_pages.load_questions(SETS["main"])
    assert len(questions) >= 80 and len({q["doc"] for q in questions}) >= 25
    assert sum(not q["in_abstract"] for q in questions) >= len(questions) / 2


def test_held_out_questions_ask_about_other_documents():
    main = {q["doc"] for q in eval_pages.load_questions(SETS["main"])}
    held = {q["doc"] for q in eval_pages.load_questions(SETS["held-out"])}
    assert not main & held


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("KB_CORPUS_DIR"), reason="set KB_CORPUS_DIR to the shared corpus folder")
def test_every_evidence_phrase_is_on_a_gold_page(question_set, kb_engine):
    name, questions = question_set
    corpus = Path(os.environ["KB_CORPUS_DIR"])
    missing = sorted({q["doc"] for q in questions if not (corpus / q["doc"]).is_file()})
    if missing:
        pytest.skip(f"corpus lacks {missing[:3]}")
    texts = {doc: kb_engine.page_texts(str(corpus / doc)) for doc in sorted({q["doc"] for q in questions})}
    assert eval_pages.evidence_problems(questions, texts) == []
