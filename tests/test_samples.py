"""The sample-paper factory itself (no engine needed)."""
from __future__ import annotations

import hashlib
import subprocess
import sys

import pymupdf
import pytest

from helpers import EXAMPLES, sp


def test_every_fixture_verifies(sample_dir):
    names = sorted(p.name for p in sample_dir.iterdir() if not p.name.startswith("."))
    assert len(names) == 13, names
    for path in sample_dir.iterdir():
        if not path.name.startswith("."):
            sp.verify(path)


def test_generation_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        sp.write_quickstart(out)
        sp.make_docx(out)
        sp.make_filler_paper(out, 3)
    for path in a.iterdir():
        if path.suffix == ".docx":  # zip timestamps differ; compare the text instead
            import docx
            texts = ["\n".join(p.text for p in docx.Document(str(d / path.name)).paragraphs) for d in (a, b)]
            assert texts[0] == texts[1]
        else:
            assert hashlib.sha256(path.read_bytes()).hexdigest() == \
                hashlib.sha256((b / path.name).read_bytes()).hexdigest(), path.name


def test_ligature_in_text_layer(sample_dir):
    with pymupdf.open(sample_dir / "photocatalysis_ligatures.pdf") as doc:
        text = doc[0].get_text()
    assert "\ufb03" in text and "The e\ufb03ciency of the" in text
    assert "efficiency of the photocatalyst" not in text  # only the ligature form is there


def test_hyphen_at_line_end(sample_dir):
    with pymupdf.open(sample_dir / "battery_electrolytes.pdf") as doc:
        lines = [ln for ln in doc[0].get_text().splitlines()]
    assert any(ln.endswith("electro-") for ln in lines)
    assert any(ln.startswith("chemical stability window") for ln in lines)


def test_paragraph_breaks_across_page(sample_dir):
    last, first = sp.page_break_lines(sample_dir / "graphene_cvd_copper.pdf")
    assert not last.endswith(".")
    assert first[0].islower(), first  # the sentence continues on page 2


def test_two_column_break_mid_sentence(sample_dir):
    path = sample_dir / "protein_folding_2col.pdf"
    left, right = sp.two_column_break(path)
    assert "we observe that the" in left and right.startswith("emerging domain")
    # the content stream holds the right column before the left one
    with pymupdf.open(path) as doc:
        stream = doc[0].get_text()
    assert stream.index("emerging domain first collapses") < stream.index("Protein folding in the cell")


def test_chinese_headings(sample_dir):
    with pymupdf.open(sample_dir / "perovskite_stability_zh.pdf") as doc:
        text = doc[0].get_text()
    for head in ("摘要", "一、引言", "二、方法", "参考文献"):
        assert head in text


def test_special_pdfs(sample_dir):
    with pymupdf.open(sample_dir / "encrypted_user_password.pdf") as doc:
        assert doc.needs_pass
    with pymupdf.open(sample_dir / "owner_password_only.pdf") as doc:
        assert not doc.needs_pass and doc.metadata["encryption"]
        assert "Arctic" in doc[0].get_text()
    with pymupdf.open(sample_dir / "scanned_no_text.pdf") as doc:
        assert doc[0].get_text().strip() == "" and doc[0].get_images()
    assert (sample_dir / "empty.pdf").stat().st_size == 0
    with pytest.raises(Exception):  # noqa: B017 (PyMuPDF's own error class differs between its releases)
        doc = pymupdf.open(sample_dir / "corrupt.pdf")
        if doc.page_count == 0:
            raise ValueError("no pages")


def test_page_labels_fixture(tmp_path):
    path = sp.make_page_labels_paper(tmp_path)
    sp.verify(path)
    with pymupdf.open(path) as doc:
        for pno, (label, sentence) in sp.LABELS_PAGES.items():
            assert doc[pno - 1].get_label() == label
            assert sentence in " ".join(doc[pno - 1].get_text().split())


def test_cli_writes_quickstart(tmp_path):
    proc = subprocess.run([sys.executable, str(EXAMPLES / "sample_papers.py"), str(tmp_path), "--verify"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    written = sorted(p.name for p in tmp_path.iterdir())
    assert len(written) == 5 and all(n.endswith(".pdf") for n in written), written
