"""fetch {identifier, kb_root, dest?}: DOI / arXiv id / URL -> PDF -> ingest, against a local HTTP server
that plays arXiv, a DOI resolver with redirects, publisher landing pages, Unpaywall, a paywall, an oversized
body and a slow server. Nothing leaves 127.0.0.1."""
from __future__ import annotations

import json
import socket
import sqlite3
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from helpers import err_code, isolate_model_env, sp

EMAIL = "kb-tests@example.org"


class _Handler(BaseHTTPRequestHandler):
    routes: dict = {}
    hits: list = []

    def log_message(self, *args):       # quiet
        pass

    def do_GET(self):
        path, _, query = self.path.partition("?")
        type(self).hits.append(self.path)
        route = self.routes.get(path)
        if route is None:
            return self._send(404, "text/html", b"<html><head><title>404 Not Found</title></head></html>")
        route(self, query)

    def _send(self, status, ctype, body, length=True, headers=()):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        for key, value in headers:
            self.send_header(key, value)
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass

    def redirect(self, location, code=302):
        self._send(code, "text/html", b"moved", headers=(("Location", location),))


def _html(title, head=""):
    return f"<!DOCTYPE html><html><head><title>{title}</title>{head}</head><body>{title}</body></html>".encode()


@pytest.fixture(scope="module")
def pdfs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fetch_pdfs")
    return {key: sp.make_filler_paper(out, index).read_bytes()
            for key, index in (("arxiv_new", 41), ("arxiv_old", 42), ("landing", 43), ("oa", 44), ("direct", 45))}


@pytest.fixture(scope="module")
def server(pdfs):
    def pdf(key):
        return lambda h, q: h._send(200, "application/pdf", pdfs[key])

    def slow(h, q):
        time.sleep(4)
        h._send(200, "application/pdf", pdfs["direct"])

    def unpaywall(record):
        def reply(h, q):
            assert f"email={EMAIL.replace('@', '%40')}" in q or f"email={EMAIL}" in q
            h._send(200, "application/json", json.dumps(record).encode())
        return reply

    big = b"%PDF-1.7\n" + b"0" * (3 * 1024 * 1024)
    routes = {
        "/arxiv/pdf/2301.05883": pdf("arxiv_new"),
        "/arxiv/pdf/hep-th/9901001": pdf("arxiv_old"),
        # DOI with two redirects to a landing page that names its PDF
        "/doi/10.1234/landing": lambda h, q: h.redirect("/r1/landing"),
        "/r1/landing": lambda h, q: h.redirect("/journal/article/landing"),
        "/journal/article/landing": lambda h, q: h._send(200, "text/html; charset=utf-8", _html(
            "A Landing Page", '<meta content="/files/landing.pdf" name="citation_pdf_url">')),
        "/files/landing.pdf": pdf("landing"),
        # DOI whose landing page has no PDF: Unpaywall's best OA location
        "/doi/10.1234/oa": lambda h, q: h.redirect("/journal/article/oa"),
        "/journal/article/oa": lambda h, q: h._send(200, "text/html", _html("Closed Article")),
        "/unpaywall/10.1234/oa": lambda h, q: unpaywall({"doi": "10.1234/oa", "is_oa": True, "best_oa_location": {
            "url_for_pdf": f"http://127.0.0.1:{h.server.server_port}/repository/oa.pdf"}})(h, q),
        "/repository/oa.pdf": pdf("oa"),
        # paywalled: HTML everywhere, Unpaywall says no OA
        "/doi/10.1234/paywalled": lambda h, q: h.redirect("/journal/article/paywalled"),
        "/journal/article/paywalled": lambda h, q: h._send(200, "text/html", _html(
            "Access Denied - Journal of Paywalls", '<meta name="citation_pdf_url" content="/paywall/pdf">')),
        "/paywall/pdf": lambda h, q: h._send(200, "text/html", _html("Buy this article")),
        "/unpaywall/10.1234/paywalled": unpaywall({"doi": "10.1234/paywalled", "is_oa": False,
                                                   "best_oa_location": None, "oa_locations": []}),
        # oversized, with and without Content-Length
        "/big.pdf": lambda h, q: h._send(200, "application/pdf", big),
        "/big-stream.pdf": lambda h, q: h._send(200, "application/pdf", big, length=False),
        "/slow.pdf": slow,
        "/to-file": lambda h, q: h.redirect("file:///etc/passwd"),
        "/to-ftp": lambda h, q: h.redirect("ftp://example.com/paper.pdf"),
        "/loop-a": lambda h, q: h.redirect("/loop-b"),
        "/loop-b": lambda h, q: h.redirect("/loop-a"),
        "/direct/Some%20Paper.pdf": pdf("direct"),
        "/html-only": lambda h, q: h._send(200, "text/html", _html("Just a Page")),
    }
    _Handler.routes = routes
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def net(server, monkeypatch):
    isolate_model_env(monkeypatch)
    monkeypatch.setenv("KB_EMBED_MODEL", "none")
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("KB_ARXIV_URL", server + "/arxiv")
    monkeypatch.setenv("KB_DOI_RESOLVER", server + "/doi")
    monkeypatch.setenv("KB_UNPAYWALL_URL", server + "/unpaywall")
    monkeypatch.setenv("KB_UNPAYWALL_EMAIL", EMAIL)
    for var in ("KB_FETCH_TIMEOUT", "KB_FETCH_MAX_MB", "KB_FETCH_DEADLINE"):
        monkeypatch.delenv(var, raising=False)
    return server


def _fetch(engine, kb_root, identifier, **extra):
    return engine.execute("fetch", {"identifier": identifier, "kb_root": str(kb_root), **extra})


def _error(engine, kb_root, identifier, **extra):
    with pytest.raises(Exception) as info:
        _fetch(engine, kb_root, identifier, **extra)
    return err_code(info.value), str(info.value)


def _doc_doi(kb_root, path):
    con = sqlite3.connect(str(Path(kb_root) / "kb.sqlite"))
    try:
        rows = con.execute("SELECT doi FROM docs WHERE path = ?", (path,)).fetchall()
    finally:
        con.close()
    assert len(rows) == 1, rows
    return rows[0][0]


# -- identifier parsing ------------------------------------------------------------------------------------------

@pytest.mark.internals
@pytest.mark.parametrize("text,expected", [
    ("10.1234/ABC.def", ("doi", "10.1234/abc.def")),
    ("doi:10.1234/xyz", ("doi", "10.1234/xyz")),
    ("DOI: 10.1234/xyz", ("doi", "10.1234/xyz")),
    ("https://doi.org/10.1234/a%2Fb", ("doi", "10.1234/a/b")),
    ("http://dx.doi.org/10.1000/182", ("doi", "10.1000/182")),
    ("arXiv:2301.05883", ("arxiv", "2301.05883")),
    ("arxiv:2301.05883v2", ("arxiv", "2301.05883v2")),
    ("2301.05883", ("arxiv", "2301.05883")),
    ("hep-th/9901001", ("arxiv", "hep-th/9901001")),
    ("arXiv:math.GT/0309136", ("arxiv", "math.GT/0309136")),
    ("https://arxiv.org/abs/2301.05883", ("arxiv", "2301.05883")),
    ("https://example.org/paper.pdf", ("url", "https://example.org/paper.pdf")),
])
def test_parse_identifier(kb_engine, text, expected):
    assert kb_engine.parse_identifier(text) == expected


@pytest.mark.parametrize("text", ["", "   ", "garbage", "arXiv:not-an-id", "doi:11.2/x", "ftp://example.org/a.pdf",
                                  "file:///etc/passwd", "10.12/x"])
def test_garbage_identifier_is_bad_request(engine, kb_engine, net, tmp_path, text):
    code, _ = _error(engine, tmp_path / "kb", text)
    assert code == "bad_request"


def test_missing_identifier_is_bad_request(engine, net, tmp_path):
    with pytest.raises(Exception) as info:
        engine.execute("fetch", {"kb_root": str(tmp_path / "kb")})
    assert err_code(info.value) == "bad_request"


# -- the happy paths -------------------------------------------------------------------------------------------

def test_arxiv_new_style(engine, net, tmp_path, pdfs):
    kb = tmp_path / "kb"
    resp = _fetch(engine, kb, "arXiv:2301.05883")
    got = resp["fetched"]
    assert got["kind"] == "arxiv" and got["source"] == "arxiv"
    assert got["url"] == net + "/arxiv/pdf/2301.05883"
    assert got["bytes"] == len(pdfs["arxiv_new"])
    path = Path(got["path"])
    assert path == kb / "papers" / "arXiv_2301.05883.pdf"
    assert path.read_bytes() == pdfs["arxiv_new"]
    assert resp["files"][0]["status"] == "added" and resp["totals"]["added"] == 1
    assert got["doi"] == "10.48550/arxiv.2301.05883"
    assert _doc_doi(kb, str(path)) == "10.48550/arxiv.2301.05883"


def test_arxiv_old_style(engine, net, tmp_path):
    kb = tmp_path / "kb"
    got = _fetch(engine, kb, "hep-th/9901001")["fetched"]
    assert Path(got["path"]) == kb / "papers" / "arXiv_hep-th_9901001.pdf"
    assert got["doi"] == "10.48550/arxiv.hep-th/9901001"


def test_doi_redirects_to_landing_page_with_citation_pdf_url(engine, net, tmp_path, pdfs):
    kb = tmp_path / "kb"
    resp = _fetch(engine, kb, "https://doi.org/10.1234/landing")
    got = resp["fetched"]
    assert (got["kind"], got["source"]) == ("doi", "publisher")
    assert got["url"] == net + "/files/landing.pdf"
    assert Path(got["path"]) == kb / "papers" / "10.1234_landing.pdf"
    assert Path(got["path"]).read_bytes() == pdfs["landing"]
    assert resp["files"][0]["status"] == "added"
    assert _doc_doi(kb, got["path"]) == "10.1234/landing" == got["doi"]


def test_doi_without_publisher_pdf_uses_unpaywall(engine, net, tmp_path, pdfs):
    kb = tmp_path / "kb"
    got = _fetch(engine, kb, "doi:10.1234/oa")["fetched"]
    assert got["source"] == "unpaywall"
    assert got["url"].endswith("/repository/oa.pdf")
    assert Path(got["path"]).read_bytes() == pdfs["oa"]
    assert _doc_doi(kb, got["path"]) == "10.1234/oa"


def test_direct_url_and_custom_dest(engine, net, tmp_path, pdfs):
    kb, dest = tmp_path / "kb", tmp_path / "my papers"
    got = _fetch(engine, kb, net + "/direct/Some%20Paper.pdf", dest=str(dest))["fetched"]
    assert (got["kind"], got["source"], got["doi"]) == ("url", "direct", None)
    assert Path(got["path"]) == dest / "Some_Paper.pdf"
    assert Path(got["path"]).read_bytes() == pdfs["direct"]
    assert not (kb / "papers").exists()


def test_dest_that_is_a_file_is_refused(engine, net, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, _ = _error(engine, tmp_path / "kb", "arXiv:2301.05883", dest=str(afile))
    assert code == "bad_request"
    assert afile.read_text() == "x"


def test_refetch_is_unchanged_no_duplicate(engine, net, tmp_path):
    kb = tmp_path / "kb"
    first = _fetch(engine, kb, "10.1234/landing")
    second = _fetch(engine, kb, "https://doi.org/10.1234/landing")
    assert first["fetched"]["path"] == second["fetched"]["path"]
    assert second["files"][0]["status"] == "skipped" and second["files"][0]["reason"] == "unchanged"
    assert second["totals"]["added"] == 0
    docs = engine.execute("docs", {"kb_root": str(kb)})
    assert docs["total"] == 1
    assert sorted(p.name for p in (kb / "papers").iterdir()) == ["10.1234_landing.pdf"]


# -- failures --------------------------------------------------------------------------------------------------

def test_paywalled_doi_is_not_pdf_naming_the_page(engine, net, tmp_path):
    kb = tmp_path / "kb"
    code, message = _error(engine, kb, "10.1234/paywalled")
    assert code == "not_pdf"
    assert "Access Denied - Journal of Paywalls" in message
    assert "text/html" in message
    assert not (kb / "papers").exists() or not any((kb / "papers").iterdir())


def test_html_url_is_not_pdf(engine, net, tmp_path):
    code, message = _error(engine, tmp_path / "kb", net + "/html-only")
    assert code == "not_pdf" and "Just a Page" in message


def test_404(engine, net, tmp_path):
    code, message = _error(engine, tmp_path / "kb", "10.1234/missing")
    assert code == "fetch_failed"
    assert "404" in message and "10.1234/missing" in message
    code, message = _error(engine, tmp_path / "kb", net + "/nothing-here.pdf")
    assert code == "fetch_failed" and "404" in message and "/nothing-here.pdf" in message


@pytest.mark.parametrize("route", ["/big.pdf", "/big-stream.pdf"])
def test_oversized_body_is_too_large(engine, net, tmp_path, monkeypatch, route):
    monkeypatch.setenv("KB_FETCH_MAX_MB", "1")
    kb = tmp_path / "kb"
    code, message = _error(engine, kb, net + route)
    assert code == "too_large" and route in message
    assert not (kb / "papers").exists() or not any((kb / "papers").iterdir())


def test_slow_server_times_out(engine, net, tmp_path, monkeypatch):
    monkeypatch.setenv("KB_FETCH_TIMEOUT", "1")
    started = time.monotonic()
    code, message = _error(engine, tmp_path / "kb", net + "/slow.pdf")
    assert time.monotonic() - started < 3.5
    assert code == "fetch_failed" and "timed out" in message and "/slow.pdf" in message


@pytest.mark.parametrize("route,scheme", [("/to-file", "file://"), ("/to-ftp", "ftp://")])
def test_redirect_to_other_scheme_is_refused(engine, net, tmp_path, route, scheme):
    code, message = _error(engine, tmp_path / "kb", net + route)
    assert code == "fetch_failed" and scheme in message and "http(s)" in message


def test_redirect_loop_is_refused(engine, net, tmp_path):
    started = time.monotonic()
    code, message = _error(engine, tmp_path / "kb", net + "/loop-a")
    assert code == "fetch_failed" and "loop" in message
    assert time.monotonic() - started < 5


def test_closed_port_fails_fast(engine, net, tmp_path, monkeypatch):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    dead = f"http://127.0.0.1:{port}"
    for var, suffix in (("KB_ARXIV_URL", ""), ("KB_DOI_RESOLVER", ""), ("KB_UNPAYWALL_URL", "")):
        monkeypatch.setenv(var, dead + suffix)
    for identifier in ("arXiv:2301.05883", "10.1234/landing"):
        started = time.monotonic()
        code, message = _error(engine, tmp_path / "kb", identifier)
        assert code == "fetch_failed", message
        assert f"127.0.0.1:{port}" in message and "offline or blocked" in message
        assert time.monotonic() - started < 5


def test_fetch_is_a_known_write_command(kb_engine):
    assert "fetch" in kb_engine.Engine.COMMANDS and "fetch" in kb_engine.Engine.WRITE_COMMANDS


def test_bad_identifier_creates_no_library(engine, net, tmp_path):
    code, _ = _error(engine, tmp_path / "kb", "not an identifier")
    assert code == "bad_request"
    assert not (tmp_path / "kb").exists()


def test_one_shot_and_cli(net, tmp_path):
    """The JSON one-shot transport and the human CLI reach fetch too."""
    import os
    import subprocess
    import sys

    from helpers import ENGINE
    env = {**os.environ}
    kb = tmp_path / "kb"
    proc = subprocess.run([sys.executable, str(ENGINE), "fetch"], input=json.dumps(
        {"identifier": "arXiv:2301.05883", "kb_root": str(kb)}).encode(), capture_output=True, env=env, timeout=120)
    reply = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    assert reply["ok"] is True and reply["fetched"]["source"] == "arxiv", reply
    proc = subprocess.run([sys.executable, str(ENGINE), "--kb-root", str(kb), "fetch", "10.1234/paywalled"],
                          capture_output=True, env=env, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 1 and "Access Denied" in proc.stderr.decode()
