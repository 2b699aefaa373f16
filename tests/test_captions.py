"""Figure and table mentions in a passage link to the caption with exactly that label (Fig. 2 is not Table 2)."""
from __future__ import annotations

import pymupdf
import pytest

BODY = ("The growth rate rises with temperature as shown in Fig. 2, while the domain sizes are listed in "
        "Table 1 for every anneal we tried in this captionlinktoken study of copper foils and their oxides.")


def _make_paper(path):
    doc = pymupdf.open()
    page = doc.new_page()
    y = 72
    for text, size in (("Caption Linking in a Small Test Paper", 16), ("1 Results", 12)):
        page.insert_text((72, y), text, fontsize=size, fontname="hebo")
        y += 28
    for line in (BODY[:95], BODY[95:190], BODY[190:]):
        page.insert_text((72, y), line, fontsize=10)
        y += 14
    y += 20
    for caption in ("Figure 1. Reactor layout used for every growth run in this work.",
                    "Figure 2. Growth rate of graphene domains against the anneal temperature.",
                    "Table 2. Gas flows of the second experiment, not mentioned in the text.",
                    "Table 1. Domain sizes after each anneal, measured on optical micrographs."):
        page.insert_text((72, y), caption, fontsize=9)
        y += 30
    doc.save(str(path))


@pytest.fixture()
def hits(tmp_path, monkeypatch, kb_engine):
    monkeypatch.setenv("KB_EMBED_MODEL", "none")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _make_paper(tmp_path / "captions.pdf")
    engine = kb_engine.Engine()
    kb = str(tmp_path / "kb")
    engine.execute("ingest", {"paths": [str(tmp_path / "captions.pdf")], "kb_root": kb})

    def search(depth):
        return engine.execute("search", {"query": "captionlinktoken", "kb_root": kb, "depth": depth,
                                         "mode": "keyword"})["results"]
    yield search
    engine.close()


def test_mentions_link_to_captions_by_exact_label(hits):
    results = hits("deep")
    assert results, "the body passage was not found"
    captions = {c["label"]: c for c in results[0]["captions"]}
    assert set(captions) == {"figure 2", "table 1"}
    assert captions["figure 2"]["text"].startswith("Figure 2.")
    assert captions["table 1"]["text"].startswith("Table 1.")
    assert captions["figure 2"]["page"] == 1


def test_quick_results_carry_no_captions(hits):
    results = hits("quick")
    assert results and "captions" not in results[0]
