"""Opt-in metadata verification against Crossref, with a local HTTP server playing Crossref's REST API.

The server answers ``/works/{doi}`` and ``/works?query.bibliographic=...`` with JSON shaped as Crossref's public
API documents it (``{"status": "ok", "message-type": "work", "message": {...}}``; a query's message holds
``items``). Each test sets the server's behaviour, ingests generated papers with ``verify_metadata: true`` and
reads back the stored fields and their ``metadata_source``. Nothing here touches the network.
"""
from __future__ import annotations

import json
import time
from urllib.parse import parse_qs, urlsplit

import pytest

import metadata_pdfs as mp
from helpers import crossref_service

PLOS = mp.EXPECTED["doi_broken_across_lines"]          # prints a DOI
CAPS = mp.EXPECTED["all_caps_byline"]                  # prints no DOI: checked by title


def work(doi, title, authors, year, journal):
    return {"DOI": doi, "title": [title], "container-title": [journal], "type": "journal-article",
            "author": [{"given": g, "family": f, "sequence": "first" if i == 0 else "additional"}
                       for i, (g, f) in enumerate(authors)],
            "issued": {"date-parts": [[year, 6, 7]]}, "published-print": {"date-parts": [[year]]}}


PLOS_WORK = {**work(PLOS["doi"].upper(), PLOS["title"], [("Rebecca", "Haldane"), ("Matías", "Ortiz"),
                                                          ("Yusuf", "Demir")], 2018, "PLOS ONE"),
             "volume": "13", "issue": "5", "page": "e0197919", "publisher": "Public Library of Science (PLoS)"}
CAPS_WORK = work("10.5555/jaoe.1997.0142", CAPS["title"], [("Tobias E.", "Chang"), ("Maria", "Lopez-Garcia"),
                                                           ("John", "McAllister")], 1997,
                 "Journal of Applied Optical Engineering")


class FakeCrossref:
    """What the server does per kind of request: 'ok', 'missing' (404), 'slow', 'garbage', or a custom answer."""

    def __init__(self):
        self.requests: list[str] = []
        self.doi_mode = "ok"
        self.query_items = [CAPS_WORK]
        self.delay = 0.0

    def answer(self, path: str) -> tuple[int, bytes]:
        self.requests.append(path)
        url = urlsplit(path)
        if self.delay:
            time.sleep(self.delay)
        if url.path.startswith("/works/"):
            if self.doi_mode == "missing":
                return 404, b"Resource not found."
            if self.doi_mode == "garbage":
                return 200, b"<html>Service Unavailable</html>"
            return 200, json.dumps({"status": "ok", "message-type": "work", "message": PLOS_WORK}).encode()
        if url.path == "/works":
            assert "query.bibliographic" in parse_qs(url.query)
            return 200, json.dumps({"status": "ok", "message-type": "work-list",
                                    "message": {"total-results": len(self.query_items),
                                                "items": self.query_items}}).encode()
        return 404, b"Resource not found."


@pytest.fixture
def crossref(monkeypatch):
    fake = FakeCrossref()

    with crossref_service(monkeypatch, fake.answer):
        yield fake


@pytest.fixture(scope="module")
def papers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("verify-papers")
    mp.make_doi_broken_across_lines(folder)
    mp.make_all_caps_byline(folder)
    return folder


def ingest(engine, papers, kb, **payload):
    return engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(kb), "verify_metadata": True, **payload})


def docs_by_title(engine, kb):
    return {d["file"]: d for d in engine.execute("docs", {"kb_root": str(kb)})["docs"]}


def outcome(reply, file_name):
    return next(d for d in reply["metadata_verification"]["documents"] if d["path"].endswith(file_name))


def test_doi_record_and_title_match_are_taken_and_marked_as_crossref(engine, papers, crossref, tmp_path):
    reply = ingest(engine, papers, tmp_path / "kb")
    summary = reply["metadata_verification"]
    assert summary["checked"] == 2 and summary["verified"] == 2, summary
    docs = docs_by_title(engine, tmp_path / "kb")
    plos, caps = docs["plos_doi_broken.pdf"], docs["all_caps_byline.pdf"]
    assert plos["journal"] == "PLOS ONE" and plos["doi"] == PLOS["doi"]          # DOI stored lower-case
    assert plos["authors"] == ["Rebecca Haldane", "Matías Ortiz", "Yusuf Demir"]
    assert plos["metadata_source"]["journal"] == "crossref"
    assert caps["doi"] == "10.5555/jaoe.1997.0142" and caps["year"] == 1997
    core = ("title", "authors", "year", "journal", "doi")
    assert {caps["metadata_source"][k] for k in core} == {"crossref"}
    # the paper's own citation line ("PLoS ONE 13(6): e0197919") is kept over the record's issue 5; what the pages
    # did not print (the publisher), the DOI's record fills, and says so
    assert (plos["volume"], plos["issue"], plos["page_range"]) == ("13", "6", "e0197919")
    assert {plos["metadata_source"][k] for k in ("volume", "issue", "page_range")} == {"extracted"}
    assert plos["publisher"] == "Public Library of Science (PLoS)" and plos["work_type"] == "journal-article"
    assert plos["metadata_source"]["publisher"] == "crossref"
    assert caps["metadata_source"]["volume"] == "extracted"
    # only the DOI, or the title for the paper without one, left the machine
    sent = crossref.requests
    assert any(p.startswith("/works/10.1371/") for p in sent)
    query = next(parse_qs(urlsplit(p).query) for p in sent if p.startswith("/works?"))
    assert query["query.bibliographic"] == [CAPS["title"]] and not {"query.author", "query"} & set(query)


def test_answers_are_cached_in_the_library(engine, papers, crossref, tmp_path):
    ingest(engine, papers, tmp_path / "kb")
    asked = len(crossref.requests)
    again = ingest(engine, papers, tmp_path / "kb", force=True)
    assert again["metadata_verification"]["verified"] == 2
    assert len(crossref.requests) == asked


@pytest.mark.parametrize("title, family", [
    ("Speckle reduction in fibre-coupled laser projectors using a rotating prism", "Chang"),   # near-miss title
    (CAPS["title"], "Changeux"),                                                             # other first author
])
def test_a_near_miss_is_rejected_and_the_extracted_fields_stay(engine, papers, crossref, tmp_path, title, family):
    crossref.query_items = [work("10.5555/other", title, [("T.", family)], 2001, "Other Journal")]
    reply = ingest(engine, papers, tmp_path / "kb")
    assert outcome(reply, "all_caps_byline.pdf")["outcome"] == "no_match"
    caps = docs_by_title(engine, tmp_path / "kb")["all_caps_byline.pdf"]
    assert caps["doi"] is None and caps["year"] == CAPS["year"] and caps["title"] == CAPS["title"]
    assert set(caps["metadata_source"].values()) == {"extracted"}


def test_a_doi_crossref_does_not_know_keeps_the_extracted_record(engine, papers, crossref, tmp_path):
    crossref.doi_mode = "missing"
    reply = ingest(engine, papers, tmp_path / "kb")
    result = outcome(reply, "plos_doi_broken.pdf")
    assert result["outcome"] == "not_found" and PLOS["doi"] in result["detail"]
    plos = docs_by_title(engine, tmp_path / "kb")["plos_doi_broken.pdf"]
    assert plos["title"] == PLOS["title"] and plos["metadata_source"]["title"] == "extracted"


def test_malformed_json_is_a_note_not_an_error(engine, papers, crossref, tmp_path):
    crossref.doi_mode = "garbage"
    reply = ingest(engine, papers, tmp_path / "kb")
    assert reply["totals"]["added"] == 2
    result = outcome(reply, "plos_doi_broken.pdf")
    assert result["outcome"] == "failed" and "not JSON" in result["detail"]
    assert docs_by_title(engine, tmp_path / "kb")["plos_doi_broken.pdf"]["doi"] == PLOS["doi"]


def test_a_slow_service_is_cut_off_by_the_timeout(engine, papers, crossref, tmp_path, monkeypatch):
    monkeypatch.setenv("KB_METADATA_TIMEOUT", "0.5")
    crossref.delay = 3.0
    started = time.monotonic()
    reply = ingest(engine, papers, tmp_path / "kb")
    assert time.monotonic() - started < 2.9          # one time-out, then the rest of the run stays off-line
    summary = reply["metadata_verification"]
    assert summary["failed"] == 2 and "timed out" in summary["note"]
    assert reply["totals"]["added"] == 2


@pytest.mark.parametrize("setting", ["offline-flag", "unreachable"])
def test_offline_gives_a_note_and_keeps_every_document(engine, papers, crossref, tmp_path, monkeypatch, setting):
    if setting == "offline-flag":
        monkeypatch.setenv("KB_OFFLINE", "1")
    else:
        monkeypatch.setenv("KB_CROSSREF_URL", "http://127.0.0.1:9")      # the discard port: nothing listens
    reply = ingest(engine, papers, tmp_path / "kb")
    summary = reply["metadata_verification"]
    assert reply["totals"]["added"] == 2 and summary["verified"] == 0
    assert summary["note"] and ("KB_OFFLINE" in summary["note"] or "could not be reached" in summary["note"])
    assert crossref.requests == []
    assert all(d["status"] == "indexed" for d in docs_by_title(engine, tmp_path / "kb").values())


def test_verification_is_off_unless_asked_for(engine, papers, crossref, tmp_path):
    reply = engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(tmp_path / "kb")})
    assert "metadata_verification" not in reply and crossref.requests == []


def test_metadata_only_refresh_can_verify_too(engine, papers, crossref, tmp_path):
    engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(tmp_path / "kb")})
    reply = engine.execute("ingest", {"metadata_only": True, "verify_metadata": True, "kb_root": str(tmp_path / "kb")})
    assert reply["metadata_verification"]["verified"] == 2
    assert docs_by_title(engine, tmp_path / "kb")["plos_doi_broken.pdf"]["journal"] == "PLOS ONE"


def test_verify_metadata_must_be_a_boolean(engine, papers, tmp_path):
    with pytest.raises(Exception) as err:
        engine.execute("ingest", {"paths": [str(papers)], "kb_root": str(tmp_path / "kb"), "verify_metadata": "yes"})
    assert getattr(err.value, "code", "") == "bad_request"
