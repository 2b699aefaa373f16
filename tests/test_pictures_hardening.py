"""Hardening, round three (issue 50): page pictures, ``show`` and the files they write.

- point 13: files are written through a new, randomly named temporary file and renamed: a link planted at the
  temporary or the final name is never written through, and a failed write leaves nothing behind.

Every PDF is made here, with PyMuPDF.
"""
from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import pytest

pymupdf = pytest.importorskip("pymupdf")


SPAN_KEYS = ("doc_id", "page", "char_start", "page_end", "char_end")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def text_pdf(path: Path, pages: list[str], width: float = 612, height: float = 792, fontsize: float = 11) -> Path:
    """A PDF with one page per text, each set in a box with a one-inch margin."""
    doc = pymupdf.open()
    for text in pages:
        page = doc.new_page(width=width, height=height)
        assert page.insert_textbox(pymupdf.Rect(72, 72, width - 72, height - 72), text, fontsize=fontsize) >= 0
    doc.save(str(path))
    doc.close()
    return path


RECHARGE = "Recharge was estimated by chloride mass balance in karst catchments, with rainfall sampled monthly."


def refused(engine, command: str, payload: dict, code: str) -> str:
    import kb_engine
    with pytest.raises(kb_engine.KBError) as info:
        engine.execute(command, payload)
    assert info.value.code == code, (info.value.code, info.value.message)
    return info.value.message


def doc_ids(engine, kb: Path) -> dict:
    return {d["file"]: d["doc_id"] for d in engine.execute("docs", {"kb_root": str(kb), "limit": 100})["docs"]}


# =============================================================================
# 13. No write through a planted link; nothing left behind

@pytest.mark.skipif(sys.platform == "win32", reason="symbolic links need privileges on Windows")
def test_13_show_dest_never_writes_through_a_planted_link(engine, tmp_path):
    text_pdf(tmp_path / "isotopes.pdf", ["Isotope hydrology of the upper karst aquifer. " + RECHARGE])
    kb = tmp_path / "kb"
    engine.execute("ingest", {"paths": [str(tmp_path / "isotopes.pdf")], "kb_root": str(kb)})
    hit = engine.execute("search", {"query": "isotope hydrology", "kb_root": str(kb), "mode": "keyword",
                                    "boxes": True})["results"][0]
    dest = tmp_path / "shared"
    request = {**{k: hit[k] for k in SPAN_KEYS}, "kb_root": str(kb), "dest": str(dest)}
    picture = Path(engine.execute("show", request)["images"][0]["path"])
    picture.unlink()
    victims = {name: tmp_path / name for name in ("notes.txt", "thesis.txt")}
    for name, victim in victims.items():
        victim.write_bytes(f"the victim's own {name}".encode())
    # the temporary name this engine used to write through, and then the picture's own name
    (dest / f".{picture.name}.{os.getpid()}.tmp").symlink_to(victims["notes.txt"])
    assert Path(engine.execute("show", request)["images"][0]["path"]) == picture
    assert victims["notes.txt"].read_bytes() == b"the victim's own notes.txt", "written through the link"
    picture.unlink()
    picture.symlink_to(victims["thesis.txt"])
    assert Path(engine.execute("show", request)["images"][0]["path"]) == picture
    assert not picture.is_symlink() and picture.read_bytes().startswith(PNG_MAGIC)
    for name, victim in victims.items():
        assert victim.read_bytes() == f"the victim's own {name}".encode()
    left = sorted(entry.name for entry in dest.iterdir())
    assert left == sorted([picture.name, f".{picture.name}.{os.getpid()}.tmp"]), left   # the planted link, as it was


@pytest.mark.internals
@pytest.mark.skipif(sys.platform == "win32", reason="symbolic links need privileges on Windows")
def test_13_the_atomic_writer_skips_a_planted_temporary_name_and_leaves_nothing_on_failure(kb_engine, tmp_path,
                                                                                         monkeypatch):
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched")
    folder = tmp_path / "shared"
    folder.mkdir()
    (folder / ".out.bin.planted.tmp").symlink_to(victim)
    names = iter(["planted", "fresh"])           # the first random name drawn is the one planted
    monkeypatch.setattr(secrets, "token_hex", lambda n=None: next(names))
    kb_engine._write_atomically(folder / "out.bin", b"payload")
    assert (folder / "out.bin").read_bytes() == b"payload" and victim.read_text() == "untouched"
    assert sorted(p.name for p in folder.iterdir()) == [".out.bin.planted.tmp", "out.bin"]
    monkeypatch.undo()

    blocked = folder / "blocked"
    blocked.mkdir()
    (blocked / "inside").write_text("a folder where the file should go")
    with pytest.raises(OSError):
        kb_engine._write_atomically(blocked, b"payload")
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".blocked.")], list(folder.iterdir())


@pytest.mark.internals
def test_13_a_failed_download_record_leaves_no_temporary_file(kb_engine, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("KB_CACHE_DIR", str(cache))
    record = kb_engine.download_memory_path()
    record.mkdir(parents=True)
    (record / "inside").write_text("a folder where the record should go")
    kb_engine.Downloads()._remember_failure("some/model", "offline")      # cannot be written: skipped quietly
    assert sorted(p.name for p in cache.iterdir()) == [record.name]
