"""A watched folder that the engine's user can no longer read is not an empty folder (issue 50, point 1).

In real life: a revoked macOS privacy permission, an expired network-share ticket, an encrypted folder locked at
logout. Here: `chmod 000` (nothing can be listed) or `chmod 644` on a folder (its names can be listed, but nothing
in it can be looked at). The engine runs as a user that permissions apply to: the tests run as root, so the
daemon and the one-shot commands run under `setpriv` without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, and each
test first checks that such a process really cannot list the locked folder, so that it cannot pass vacuously.

Nothing waits for a duration: a grace period is shown to be over by a control folder watched beside the locked
one, whose deleted file is removed only once its own (later) grace period has passed."""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ENGINE, ROOT, clean_env, db_rows, kill_jobs_left, sp

sys.path.insert(0, str(ROOT / "benchmarks"))
from common import ServeProcess  # noqa: E402
from test_watch import FAST, docs, idle, sync_jobs, wait_for  # noqa: E402

# slow (out of the quick subset): a resident engine that watches folders that go unreadable and back.
pytestmark = pytest.mark.slow

# root without the two capabilities that let it pass over permission bits; processes it starts inherit that
DROP_DAC = ("setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search")


def _probe(prefix: tuple[str, ...], tmp: Path) -> bool:
    """Whether a process started with ``prefix`` is refused a folder of mode 000 and one of mode 644."""
    shut, listed = tmp / "probe-000", tmp / "probe-644"
    for folder, mode in ((shut, 0o000), (listed, 0o644)):
        (folder / "inner").mkdir(parents=True)
        folder.chmod(mode)
    code = ("import os, sys\n"
            "for path in sys.argv[1:]:\n"
            "    try:\n"
            "        os.stat(path) if path.endswith('inner') else os.listdir(path)\n"
            "    except PermissionError:\n"
            "        continue\n"
            "    sys.exit(1)\n")
    try:
        done = subprocess.run([*prefix, sys.executable, "-c", code, str(shut), str(listed / "inner")],
                              capture_output=True, timeout=60)
        return done.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        for folder in (shut, listed):
            folder.chmod(0o755)


@pytest.fixture(scope="module")
def unprivileged(tmp_path_factory) -> tuple[str, ...]:
    """The prefix that runs the engine as a user whom permissions bind (empty when this one already is)."""
    tmp = tmp_path_factory.mktemp("probe")
    if os.geteuid() != 0:
        if _probe((), tmp):
            return ()
        pytest.skip("folder permissions do not apply to this user (a file system that ignores them?)")
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: the engine cannot be run as a user that permissions bind")
    if not _probe(DROP_DAC, tmp):
        pytest.skip("setpriv could not drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH here (a container without "
                    "them to drop, or one that forbids changing the bounding set)")
    return DROP_DAC


@contextlib.contextmanager
def locked(folder: Path, mode: int, prefix: tuple[str, ...]):
    """``folder`` at ``mode`` (its own mode back afterwards), checked to bind a process started with ``prefix``."""
    before = folder.stat().st_mode & 0o7777
    folder.chmod(mode)
    try:
        look = "os.listdir(p)" if mode & 0o444 == 0 else "[os.stat(os.path.join(p, n)) for n in os.listdir(p)]"
        check = subprocess.run([*prefix, sys.executable, "-c", f"import os, sys; p = sys.argv[1]; {look}",
                                str(folder)], capture_output=True, text=True, timeout=60)
        assert check.returncode != 0 and "PermissionError" in check.stderr, \
            f"the permission does not bind the engine's process: {check}"
        yield folder
    finally:
        folder.chmod(before)


@pytest.fixture
def daemon_factory(tmp_path, unprivileged):
    started = []

    def start(**env) -> ServeProcess:
        daemon = ServeProcess(tmp_path / "kb", clean_env(**{**FAST, "KB_EMBED_MODEL": "none", **env}),
                              prefix=unprivileged)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.close()
    kill_jobs_left(tmp_path / "kb")


def stored(kb_root: Path) -> dict[str, tuple]:
    """path -> (id, indexed_at, sha256) of every document: what a re-read would change."""
    return {r[0]: tuple(r[1:]) for r in db_rows(kb_root, "SELECT path, id, indexed_at, sha256 FROM docs")}


def chunk_ids(kb_root: Path) -> list[int]:
    return [r[0] for r in db_rows(kb_root, "SELECT id FROM chunks ORDER BY id")]


def sources(daemon: ServeProcess) -> dict[str, dict]:
    return {s["path"]: s for s in daemon.ok("watch")["sources"]}


def three_papers(folder: Path) -> list[Path]:
    return [sp.make_hyphenated_paper(folder), sp.make_ligature_paper(folder), sp.make_markdown(folder)]


CONTROL_NOTES = itertools.count()


def removed_once_grace_is_over(daemon: ServeProcess, control: Path) -> None:
    """Delete a file of the control folder and wait for its document to go: its grace period began after the
    locked folder's would have, and the watcher looks at every folder in the round that sends that removal."""
    name = f"control_{next(CONTROL_NOTES)}.md"
    (control / name).write_text("# A control note\n\nThe heron fished at dawn on the shallow estuary flats.\n")
    wait_for(lambda: str(control / name) in docs(daemon.kb_root) and idle(daemon.kb_root), 30)
    os.remove(control / name)
    wait_for(lambda: str(control / name) not in docs(daemon.kb_root) and idle(daemon.kb_root), 30)


@pytest.mark.parametrize("events", ["1", "0"], ids=["events", "scans"])
def test_a_locked_root_loses_nothing_is_reported_and_resumes(daemon_factory, tmp_path, unprivileged, events):
    papers, control = tmp_path / "papers", tmp_path / "control"
    three_papers(papers)
    control.mkdir()
    daemon = daemon_factory(KB_WATCH_EVENTS=events)
    daemon.ok("watch", {"add": [str(papers), str(control)]})
    wait_for(lambda: len(docs(daemon.kb_root)) == 3 and idle(daemon.kb_root), 60)
    before, chunks = stored(daemon.kb_root), chunk_ids(daemon.kb_root)
    jobs_before = len(sync_jobs(daemon.kb_root))

    with locked(papers, 0o000, unprivileged):
        removed_once_grace_is_over(daemon, control)
        assert {p: v for p, v in stored(daemon.kb_root).items() if p.startswith(str(papers))} == before
        view = sources(daemon)[str(papers)]
        assert view["state"] == "unreadable" and "Permission denied" in view["reason"] and view["offline_since"], view
        status = {s["path"]: s for s in daemon.ok("status")["sources"]}
        assert status[str(papers)]["state"] == "unreadable" and "Permission denied" in status[str(papers)]["reason"]
        assert status[str(control)]["state"] in ("watching", "syncing")      # syncing: its last job is ending

    view = wait_for(lambda: (s := sources(daemon)[str(papers)])["state"] == "watching" and s, 20)
    assert view["reason"] is None and view["offline_since"] is None and view["unreadable"] == []
    removed_once_grace_is_over(daemon, control)       # a round after the return: anything re-read is read by now
    assert {p: v for p, v in stored(daemon.kb_root).items() if p.startswith(str(papers))} == before
    assert [c for c in chunk_ids(daemon.kb_root) if c <= max(chunks)] == chunks
    later = sync_jobs(daemon.kb_root)[jobs_before:]
    assert all(not any(p.startswith(str(papers)) for p in j["payload"]["ingest"] + j["payload"]["remove"])
               for j in later), [j["payload"] for j in later]


def test_a_locked_subfolder_keeps_its_documents_and_the_rest_stays_in_step(daemon_factory, tmp_path, unprivileged):
    papers, control = tmp_path / "papers", tmp_path / "control"
    shut = papers / "shut"
    kept = [sp.make_hyphenated_paper(shut), sp.make_markdown(shut)]
    loose = sp.make_ligature_paper(papers)
    control.mkdir()
    daemon = daemon_factory()
    daemon.ok("watch", {"add": [str(papers), str(control)]})
    wait_for(lambda: len(docs(daemon.kb_root)) == 3 and idle(daemon.kb_root), 60)
    before = stored(daemon.kb_root)

    with locked(shut, 0o000, unprivileged):
        # the rest of the folder is still kept in step: a file deleted, one added
        os.remove(loose)
        added = sp.make_onecolumn_paper(papers)
        wait_for(lambda: str(added) in docs(daemon.kb_root) and str(loose) not in docs(daemon.kb_root)
                 and idle(daemon.kb_root), 30)
        removed_once_grace_is_over(daemon, control)
        assert {str(p): before[str(p)] for p in kept} == {p: v for p, v in stored(daemon.kb_root).items()
                                                          if p.startswith(str(shut))}
        view = sources(daemon)[str(papers)]
        assert view["state"] in ("watching", "syncing") and [u["path"] for u in view["unreadable"]] == [str(shut)]
        assert "Permission denied" in view["unreadable"][0]["reason"] and str(shut) in view["reason"], view
        status = {s["path"]: s for s in daemon.ok("status")["sources"]}
        assert [u["path"] for u in status[str(papers)]["unreadable"]] == [str(shut)]

    wait_for(lambda: sources(daemon)[str(papers)]["unreadable"] == [], 20)
    removed_once_grace_is_over(daemon, control)
    assert {p: v for p, v in stored(daemon.kb_root).items() if p.startswith(str(shut))} == \
        {str(p): before[str(p)] for p in kept}
    assert sources(daemon)[str(papers)]["reason"] is None


def one_shot(prefix: tuple[str, ...], command: str, payload: dict, **env) -> dict:
    done = subprocess.run([*prefix, sys.executable, str(ENGINE), command], input=json.dumps(payload).encode(),
                          capture_output=True, env=clean_env(KB_EMBED_MODEL="none", **env), cwd=str(ROOT),
                          timeout=300)
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


@pytest.mark.parametrize("mode", [0o000, 0o644], ids=["unlistable", "unsearchable"])
def test_a_one_shot_sync_removes_nothing_it_cannot_read(tmp_path, unprivileged, mode):
    papers = tmp_path / "papers"
    shut = papers / "shut"
    kept = [sp.make_hyphenated_paper(shut), sp.make_markdown(shut)]
    gone = sp.make_ligature_paper(papers)
    kb = str(tmp_path / "kb")
    assert one_shot(unprivileged, "watch", {"kb_root": kb, "add": [str(papers)]})["ok"]
    first = one_shot(unprivileged, "sync", {"kb_root": kb})
    assert first["ok"] and first["totals"]["added"] == 3, first
    before = stored(tmp_path / "kb")

    with locked(shut, mode, unprivileged):
        os.remove(gone)
        started = one_shot(unprivileged, "sync", {"kb_root": kb}, KB_ASYNC_THRESHOLD="0")     # as a background job
        assert started["ok"] and started["state"] == "queued", started
        job = wait_for(lambda: (j := one_shot(unprivileged, "status", {"kb_root": kb, "job_id": started["job_id"]})
                                ["job"])["state"] not in ("queued", "running") and j, 60)
        assert job["state"] == "done" and job["result"]["totals"]["removed"] == 1, job     # a file really gone goes
        assert [u["path"] for u in job["result"]["unreadable"]] == [str(shut)], job
        assert "Permission denied" in job["result"]["unreadable"][0]["reason"]
        assert stored(tmp_path / "kb").keys() == {str(p) for p in kept}
        synced = one_shot(unprivileged, "sync", {"kb_root": kb})              # in the foreground: the whole reply
        assert synced["ok"] and synced["removed"] == [] and [u["path"] for u in synced["unreadable"]] == [str(shut)]
        assert {p: v for p, v in stored(tmp_path / "kb").items() if p.startswith(str(shut))} == \
            {str(p): before[str(p)] for p in kept}
        # named by the request, as the watcher's jobs name them: refused, and said why
        named = one_shot(unprivileged, "sync", {"kb_root": kb, "remove": [str(kept[0])]})
        assert named["ok"] and named["removed"] == [] and [u["path"] for u in named["unreadable"]] == [str(kept[0])]

    with locked(papers, 0o000, unprivileged):
        synced = one_shot(unprivileged, "sync", {"kb_root": kb})
        assert synced["ok"] and synced["removed"] == [] and synced["totals"]["files"] == 0, synced
        assert [(u["path"], "Permission denied" in u["reason"]) for u in synced["unreadable"]] == [(str(papers), True)]
        listed = one_shot(unprivileged, "watch", {"kb_root": kb})
        assert listed["ok"] and listed["sources"][0]["state"] == "not_watched"

    back = one_shot(unprivileged, "sync", {"kb_root": kb})
    assert back["ok"] and back["totals"]["files"] == 0 and "unreadable" not in back, back     # nothing to re-read
    assert stored(tmp_path / "kb") == {str(p): before[str(p)] for p in kept}
