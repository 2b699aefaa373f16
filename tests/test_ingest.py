"""ingest: statuses, reasons, totals, incremental re-ingest, failure paths."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from helpers import assert_db_ok, assert_readable_error, assert_totals, by_name, err_code, sp

GOOD = ["graphene_cvd_copper.pdf", "protein_folding_2col.pdf", "battery_electrolytes.pdf",
        "photocatalysis_ligatures.pdf", "perovskite_stability_zh.pdf", "coral_heatwaves.docx",
        "rice_salt_tolerance_gb18030.txt", "sparse_attention.md", "owner_password_only.pdf"]


def ingest(engine, kb_root, *paths, **extra):
    resp = engine.execute("ingest", {"paths": [str(p) for p in paths], "kb_root": str(kb_root), **extra})
    assert_totals(resp)
    return resp


def search_paths(engine, kb_root, query, **extra):
    resp = engine.execute("search", {"query": query, "kb_root": str(kb_root), **extra})
    return [Path(r["path"]) for r in resp["results"]], resp


def test_sample_set_statuses(indexed):
    _, resp = indexed
    assert_totals(resp)
    files = by_name(resp)
    assert len(files) == 13, sorted(files)
    for name in GOOD:
        f = files[name]
        assert f["status"] == "added", f
        assert f["chunks"] > 0, f
        assert isinstance(f["title"], str) and f["title"].strip(), f
        assert isinstance(f["ms"], (int, float)) and f["ms"] >= 0, f
    enc = files["encrypted_user_password.pdf"]
    assert_readable_error(enc)
    assert enc["reason"] == "encrypted" and enc["chunks"] == 0
    empty = files["empty.pdf"]
    assert_readable_error(empty)
    assert empty["reason"] == "empty"
    corrupt = files["corrupt.pdf"]
    assert_readable_error(corrupt)
    assert corrupt["reason"] == "corrupt"
    scan = files["scanned_no_text.pdf"]
    assert scan["status"] == "skipped" and scan["reason"] == "no_text_layer" and scan["chunks"] == 0, scan
    t = resp["totals"]
    assert (t["added"], t["error"], t["skipped"]) == (9, 3, 1), t


def test_titles_and_metadata(engine, indexed):
    root, _ = indexed
    docs = {Path(d["path"]).name: d for d in engine.execute("docs", {"kb_root": str(root), "limit": 100})["docs"]}
    expect = {
        "graphene_cvd_copper.pdf": (sp.GRAPHENE_TITLE, "Chen", sp.GRAPHENE_YEAR),
        "protein_folding_2col.pdf": (sp.PROTEIN_TITLE, "Watanabe", sp.PROTEIN_YEAR),
        "battery_electrolytes.pdf": (sp.BATTERY_TITLE, "Adeyemi", sp.BATTERY_YEAR),
        "photocatalysis_ligatures.pdf": (sp.LIGATURE_TITLE, "Dubois", sp.LIGATURE_YEAR),
        "perovskite_stability_zh.pdf": (sp.CHINESE_TITLE, "王晓明", sp.CHINESE_YEAR),
        "coral_heatwaves.docx": (sp.DOCX_TITLE, "Schmidt", sp.DOCX_YEAR),
    }
    for name, (title, author, year) in expect.items():
        d = docs[name]
        assert d["title"] == title, (name, d["title"])
        assert isinstance(d["authors"], list) and any(author in a for a in d["authors"]), (name, d["authors"])
        assert d["year"] == year, (name, d["year"])
    kinds = {n: d["kind"] for n, d in docs.items()}
    assert kinds["graphene_cvd_copper.pdf"] == "pdf"
    assert kinds["coral_heatwaves.docx"] == "docx"
    assert kinds["rice_salt_tolerance_gb18030.txt"] == "txt"
    assert kinds["sparse_attention.md"] == "md"
    assert docs["graphene_cvd_copper.pdf"]["pages"] == 3
    assert docs["protein_folding_2col.pdf"]["pages"] == 2


def test_reingest_unchanged_is_skipped(engine, papers, kb_root):
    first = by_name(ingest(engine, kb_root, papers))
    again = by_name(ingest(engine, kb_root, papers))
    assert set(again) == set(first)
    for name in GOOD:
        assert again[name]["status"] == "skipped" and again[name]["reason"] == "unchanged", again[name]


def test_reingest_unchanged_failures_are_skipped_too(engine, papers, kb_root):
    """Unchanged (path, size, mtime) is skipped without reading: this holds for
    files that failed or were skipped last time as well (they are recorded in docs)."""
    first = by_name(ingest(engine, kb_root, papers))
    again = ingest(engine, kb_root, papers)
    for name, f in by_name(again).items():
        assert f["status"] == "skipped", (f, first[name])
        assert f.get("reason") in ("unchanged", first[name].get("reason")), f
    assert again["totals"]["skipped"] == again["totals"]["files"] == 13


def test_modified_file_is_updated(engine, papers, kb_root):
    target = papers / "graphene_cvd_copper.pdf"
    ingest(engine, kb_root, target)
    hits, _ = search_paths(engine, kb_root, "passivates")
    assert target in hits
    before = os.stat(target)
    sp.make_filler_paper(papers, 7, pages=1, name=target.name)  # different content, same path
    os.utime(target, (before.st_atime + 5, before.st_mtime + 5))
    f = by_name(ingest(engine, kb_root, target))[target.name]
    assert f["status"] == "updated" and f["chunks"] > 0, f
    hits, _ = search_paths(engine, kb_root, "passivates")
    assert target not in hits, "old text still indexed after update"
    hits, _ = search_paths(engine, kb_root, "specimen007")
    assert hits and hits[0] == target
    docs = engine.execute("docs", {"kb_root": str(kb_root)})
    assert docs["total"] == 1
    assert_db_ok(kb_root)


def test_path_is_another_name_for_paths(engine, papers, kb_root):
    """`path` (one string) is accepted as `paths` is, by the request rules too (a rule that named only `paths`
    refused it)."""
    target = papers / "graphene_cvd_copper.pdf"
    resp = engine.execute("ingest", {"path": str(target), "kb_root": str(kb_root)})
    assert [(Path(f["path"]), f["status"]) for f in resp["files"]] == [(target, "added")]


def test_copy_at_other_path_is_duplicate(engine, papers, kb_root):
    original = papers / "graphene_cvd_copper.pdf"
    ingest(engine, kb_root, original)
    other = papers / "elsewhere"
    other.mkdir()
    copy = other / "graphene_copy.pdf"
    shutil.copy2(original, copy)
    f = by_name(ingest(engine, kb_root, copy))["graphene_copy.pdf"]
    assert f["status"] == "duplicate", f
    hits, resp = search_paths(engine, kb_root, "graphene nucleation copper", top_k=20)
    assert hits and set(hits) == {original}, hits
    # the library still holds one indexed copy of the paper
    docs = engine.execute("docs", {"kb_root": str(kb_root)})["docs"]
    indexed = [d for d in docs if d.get("chunks", 0) > 0]
    assert [Path(d["path"]) for d in indexed] == [original]


def test_renamed_file_is_moved_keeping_chunks(engine, papers, kb_root):
    sub = papers / "lib"
    sub.mkdir()
    old = sub / "graphene_cvd_copper.pdf"
    shutil.move(str(papers / "graphene_cvd_copper.pdf"), old)
    ingest(engine, kb_root, sub)
    _, before = search_paths(engine, kb_root, "graphene nucleation copper", top_k=50)
    ids_before = {r["chunk_id"] for r in before["results"]}
    doc_before = {r["doc_id"] for r in before["results"]}
    assert ids_before and len(doc_before) == 1
    new = sub / "chen2019_graphene.pdf"
    os.rename(old, new)  # keeps size and mtime
    resp = ingest(engine, kb_root, sub)
    f = by_name(resp)["chen2019_graphene.pdf"]
    assert f["status"] == "moved", f
    _, after = search_paths(engine, kb_root, "graphene nucleation copper", top_k=50)
    assert {r["chunk_id"] for r in after["results"]} == ids_before
    assert {r["doc_id"] for r in after["results"]} == doc_before
    assert {Path(r["path"]) for r in after["results"]} == {new}
    paths = [Path(d["path"]) for d in engine.execute("docs", {"kb_root": str(kb_root)})["docs"]]
    assert new in paths and old not in paths
    assert_db_ok(kb_root)


def test_force_reparses_without_duplicating(engine, papers, kb_root):
    target = papers / "protein_folding_2col.pdf"
    first = by_name(ingest(engine, kb_root, target))[target.name]
    forced = by_name(ingest(engine, kb_root, target, force=True))[target.name]
    assert forced["status"] in ("updated", "added"), forced
    assert forced["chunks"] == first["chunks"] > 0
    assert engine.execute("docs", {"kb_root": str(kb_root)})["total"] == 1
    _, resp = search_paths(engine, kb_root, "molten globule ribosome", top_k=50)
    snippets = [r["chunk_id"] for r in resp["results"]]
    assert len(snippets) == len(set(snippets))
    stats = engine.execute("stats", {"kb_root": str(kb_root)})
    assert stats["chunks"] == first["chunks"]
    assert_db_ok(kb_root)


def test_directory_recursion_and_extensions(engine, tmp_path, kb_root):
    lib = tmp_path / "lib"
    (lib / "a" / "b").mkdir(parents=True)
    sp.make_onecolumn_paper(lib)
    sp.make_docx(lib / "a")
    md = sp.make_markdown(lib / "a" / "b")
    md.rename(md.with_suffix(".markdown"))
    sp.make_gb18030_txt(lib / "a" / "b")
    (lib / "a" / "notes.xyz").write_text("not a paper")
    (lib / "a" / "figure.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    resp = ingest(engine, kb_root, lib)
    files = by_name(resp)
    assert set(files) == {"graphene_cvd_copper.pdf", "coral_heatwaves.docx", "sparse_attention.markdown",
                          "rice_salt_tolerance_gb18030.txt"}, sorted(files)
    assert all(f["status"] == "added" and f["chunks"] > 0 for f in files.values()), files
    hits, _ = search_paths(engine, kb_root, "block-sparse attention global tokens")
    assert hits and hits[0].name == "sparse_attention.markdown"


def test_unsupported_type_given_explicitly(engine, tmp_path, kb_root):
    bad = tmp_path / "slides.pptx"
    bad.write_bytes(b"PK\x03\x04 not really")
    f = by_name(ingest(engine, kb_root, bad))["slides.pptx"]
    assert f["status"] in ("error", "skipped"), f
    assert f["reason"] == "unsupported", f
    assert f["chunks"] == 0


def test_missing_path(engine, tmp_path, kb_root):
    missing = tmp_path / "nowhere" / "paper.pdf"
    good = sp.make_ligature_paper(tmp_path)
    resp = ingest(engine, kb_root, missing, good)
    files = by_name(resp)
    assert files["paper.pdf"]["status"] in ("error", "skipped"), files["paper.pdf"]
    assert files["paper.pdf"]["reason"] == "not_found", files["paper.pdf"]
    assert files["photocatalysis_ligatures.pdf"]["status"] == "added"  # one bad path does not stop the batch


def test_failures_do_not_stop_batch(engine, tmp_path, kb_root):
    lib = tmp_path / "mixed"
    sp.make_corrupt_pdf(lib)
    sp.make_empty_pdf(lib)
    sp.make_encrypted_pdf(lib)
    sp.make_scanned_pdf(lib)
    sp.make_hyphenated_paper(lib)
    resp = ingest(engine, kb_root, lib)
    files = by_name(resp)
    assert files["battery_electrolytes.pdf"]["status"] == "added"
    for name, reason in [("corrupt.pdf", "corrupt"), ("empty.pdf", "empty"),
                         ("encrypted_user_password.pdf", "encrypted")]:
        assert_readable_error(files[name])
        assert files[name]["reason"] == reason, files[name]
    assert files["scanned_no_text.pdf"]["reason"] == "no_text_layer"
    assert_db_ok(kb_root)


def test_owner_password_pdf_is_searchable(search):
    resp = search("arctic terns geolocators migration")
    assert resp["results"], resp
    assert resp["results"][0]["file"] == "owner_password_only.pdf"


def test_bad_ingest_payloads(engine, kb_engine, kb_root):
    for payload in ({"paths": 42, "kb_root": str(kb_root)},
                    {"paths": {"a": 1}, "kb_root": str(kb_root)},
                    {"paths": ["x.pdf"], "kb_root": str(kb_root), "force": "maybe"}):
        with pytest.raises(kb_engine.KBError) as info:
            engine.execute("ingest", payload)
        assert err_code(info.value) == "bad_request", (payload, info.value)


def test_unchanged_means_path_size_mtime(engine, papers, kb_root):
    """Unchanged (path, size, mtime) is skipped without reading the file: garbage
    of the same size with the old mtime restored must still be 'unchanged'."""
    target = papers / "battery_electrolytes.pdf"
    ingest(engine, kb_root, target)
    st = os.stat(target)
    target.write_bytes(b"\0" * st.st_size)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    f = by_name(ingest(engine, kb_root, target))[target.name]
    assert f["status"] == "skipped" and f["reason"] == "unchanged", f
    hits, _ = search_paths(engine, kb_root, "electrochemical stability window")
    assert set(hits) == {target}
    # a new mtime makes it read again: now it is corrupt
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    f = by_name(ingest(engine, kb_root, target))[target.name]
    assert f["status"] == "error", f


def test_unicode_and_space_in_paths(engine, tmp_path, kb_root):
    lib = tmp_path / "文献 library (2024)"
    paper = sp.make_onecolumn_paper(lib, name="石墨烯 graphene – Chen et al. (2019).pdf")
    note = sp.make_markdown(lib / "sub dir", name="notes é.md")
    resp = ingest(engine, kb_root, lib)
    files = by_name(resp)
    assert files[paper.name]["status"] == "added" and files[note.name]["status"] == "added"
    hits, _ = search_paths(engine, kb_root, "graphene nucleation copper")
    assert hits and hits[0] == paper and hits[0].is_file()
    again = by_name(ingest(engine, kb_root, lib))
    assert again[paper.name]["status"] == "skipped"


def test_symlink_loop_in_directory(engine, tmp_path, kb_root):
    lib = tmp_path / "lib"
    sp.make_hyphenated_paper(lib)
    (lib / "loop").symlink_to(lib, target_is_directory=True)
    (lib / "dangling.pdf").symlink_to(tmp_path / "does-not-exist.pdf")
    resp = ingest(engine, kb_root, lib)
    added = [f for f in resp["files"] if f["status"] == "added"]
    assert len(added) == 1 and Path(added[0]["path"]).name == "battery_electrolytes.pdf", resp["files"]
    assert all(f["status"] in ("added", "error", "skipped", "duplicate") for f in resp["files"])
