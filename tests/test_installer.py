"""The installers and the npm packages: scripts/install.sh, npm-package/ (dsh-kb-rag, its install.mjs bin) and the
dsh-kb-rag-install micro-package.

- one list of Python requirements (kb_engine.py's REQUIREMENTS) that pyproject.toml and both installer scripts
  agree with, and that the plugin's dependency gate asks the engine for instead of keeping a copy;
- `kb_engine.py requirements` and `selftest`, the two engine commands the installers use, in a full environment
  and in a bare one;
- `install.sh --dry-run -y` (and the npm bin's) print every step and command and leave HOME untouched;
- a real `install.sh -y --no-models` in a scratch virtual environment and a scratch HOME: the Python part, the
  self-test, the missing DSH reported; re-run with a stand-in `dsh` on PATH, which must receive the plugin add;
- the packed tarball: files, byte-identical engine, patch file, no lifecycle scripts;
- shellcheck, when installed (CI installs the Debian package).

The scratch environment sees this test run's packages through a .pth file, so pip finds every requirement
already satisfied and nothing is downloaded.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest

from helpers import ENGINE, ROOT, answering_handler, local_server

pytestmark = [pytest.mark.slow, pytest.mark.node]

INSTALL_SH = ROOT / "scripts" / "install.sh"
INSTALL_PS1 = ROOT / "scripts" / "install.ps1"
NPM_PACKAGE = ROOT / "npm-package"
MICRO_PACKAGE = ROOT / "dsh-kb-rag-install"
STEP_TITLES = ["[1/6] Python environment", "[2/6] Python packages", "[3/6] Engine self-test",
               "[4/6] Node, pnpm and the DSH CLI", "[5/6] DSH plugin", "[6/6] Models"]
LIFECYCLE = {"preinstall", "install", "postinstall", "prepublish", "preprepare", "prepare", "postprepare",
             "prepack", "postpack", "prepublishOnly", "publish", "postpublish", "dependencies"}

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
needs_node = pytest.mark.skipif(shutil.which("node") is None or shutil.which("npm") is None,
                                reason="Node.js/npm not installed")


def engine_requirements(python: str = sys.executable, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([python, str(ENGINE), "requirements", *args], capture_output=True, text=True, timeout=60)


def home_snapshot(home: Path) -> dict:
    """Every path under HOME with its size and modification time: any write shows up."""
    snapshot = {}
    for path in sorted(home.rglob("*")):
        info = path.lstat()
        snapshot[str(path.relative_to(home))] = (info.st_size if path.is_file() else -1, info.st_mtime_ns)
    return snapshot


def fake_tool(bin_dir: Path, name: str, log: Path, output: str = "") -> None:
    """A stand-in command that appends its argv (one JSON line) to ``log``."""
    script = bin_dir / name
    script.write_text("#!/bin/sh\n"
                      f"{shutil.which('python3') or sys.executable} -c 'import json, sys; "
                      f"open(sys.argv[1], \"a\").write(json.dumps(sys.argv[2:]) + \"\\n\")' {log} {name} \"$@\"\n"
                      + (f"echo {output}\n" if output else ""))
    script.chmod(0o755)


def base_path(*extra: Path) -> str:
    """PATH with the stand-ins first, then node/npm and the system directories (no dsh, no pnpm)."""
    dirs = [str(d) for d in extra]
    for tool in ("node", "npm"):
        found = shutil.which(tool)
        if found:
            dirs.append(str(Path(found).parent))
    return os.pathsep.join(dict.fromkeys(dirs + ["/usr/bin", "/bin"]))


def installer_env(home: Path, path: str, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KB_", "DSH_", "PIP_INDEX", "VIRTUAL_ENV"))}
    # the probe of the PyTorch CPU index gets 3 s, not 10: a test run may have no route to it
    env.update(HOME=str(home), PATH=path, HF_HUB_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1",
               KB_TORCH_PROBE_SECONDS="3", **extra)
    return env


@pytest.fixture
def torch_index():
    """A stand-in for the PyTorch CPU index: answers for torch like a simple index."""
    page = b'<a href="torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl">torch-2.13.0+cpu</a>'
    with local_server(answering_handler(lambda path: (200, page) if path.rstrip("/").endswith("/torch")
                                        else (404, b"not here"))) as url:
        yield f"{url}/whl/cpu"


def closed_port_url() -> str:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/whl/cpu"     # nothing listens there once the socket is closed


def run_install(args: list[str], env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(INSTALL_SH), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, stdin=subprocess.DEVNULL)


# --- one list of requirements ---------------------------------------------------------------------------------

def test_requirements_agree_everywhere():
    import tomllib
    listed = json.loads(engine_requirements(sys.executable, "--json", "--with-docx", "--with-ocr",
                                            "--with-watch").stdout)
    engine = {r["pip"] for r in listed if not r["optional"]}
    optional = {r["pip"] for r in listed if r["optional"]}
    assert engine and "torch>=2.1,<2.14" in engine
    assert optional == {"python-docx>=1.1", "rapidocr-onnxruntime==1.4.4", "watchdog>=4"}

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert set(project["dependencies"]) == engine
    assert set().union(*(project["optional-dependencies"][x] for x in ("docx", "ocr", "watch"))) == optional
    docx_only = json.loads(engine_requirements(sys.executable, "--json", "--with-docx").stdout)
    assert {r["pip"] for r in docx_only if r["optional"]} == {"python-docx>=1.1"}

    deps_js = (ROOT / "plugin" / "src" / "deps.js").read_text()     # the plugin's gate asks the engine
    assert "pip: '" not in deps_js and "torch>=" not in deps_js
    assert all(re.search(rf"['\"]{arg}['\"]", deps_js) for arg in ("requirements", "--missing", "--json"))

    mcp = project["optional-dependencies"]["mcp"]
    for script, torch_pattern, mcp_pattern in (
            (INSTALL_SH, r"^TORCH_REQUIREMENT='([^']+)'", r"^MCP_REQUIREMENT='([^']+)'"),
            (INSTALL_PS1, r"\$TORCH_REQUIREMENT\s*=\s*'([^']+)'", r"\$MCP_REQUIREMENT\s*=\s*'([^']+)'")):
        text = script.read_text(encoding="utf-8-sig")
        assert re.search(torch_pattern, text, re.M).group(1) in engine, script
        assert [re.search(mcp_pattern, text, re.M).group(1)] == mcp, script


def test_requirements_missing_in_a_bare_environment(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True, timeout=120)
    bare = tmp_path / "bare" / "bin" / "python"
    everything = engine_requirements(str(bare)).stdout.split()
    assert engine_requirements(str(bare), "--missing").stdout.split() == everything
    assert "python-docx>=1.1" not in everything
    assert "python-docx>=1.1" in engine_requirements(str(bare), "--missing", "--with-docx").stdout.split()
    assert engine_requirements(sys.executable, "--missing").stdout.split() == []


def test_selftest_passes_here():
    done = subprocess.run([sys.executable, str(ENGINE), "selftest", "--json"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "KB_EMBED_MODEL": "none"})
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["ok"], done.stdout + done.stderr
    assert report["modules"]["pymupdf"] and report["modules"]["faiss"] and report["modules"]["torch"]
    assert report["embedder"]["enabled"] is False


def test_selftest_names_missing_modules_without_a_traceback(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True, timeout=120)
    done = subprocess.run([str(tmp_path / "bare" / "bin" / "python"), str(ENGINE), "selftest"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "MISSING  pymupdf" in done.stdout and "MISSING  torch" in done.stdout
    assert "python -m pip install 'pymupdf>=1.24'" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr


# --- install.sh -----------------------------------------------------------------------------------------------

@needs_bash
def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (CI installs the Debian package)")
    done = subprocess.run(["shellcheck", str(INSTALL_SH)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout


@needs_bash
@pytest.mark.parametrize("profiles, expected", [
    ([], "--profile web add"),
    (["research"], "--profile research add"),
    (["research", "teaching"], "--profile NAME add"),
])
def test_dry_run_prints_every_step_and_leaves_home_untouched(tmp_path, profiles, expected):
    home = tmp_path / "home"
    for name in profiles:
        (home / ".dsh" / "profiles" / name).mkdir(parents=True)
    (home / ".config").mkdir(parents=True)
    before = home_snapshot(home)
    done = run_install(["--dry-run", "-y", "--with-docx"], installer_env(home, base_path()))
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert home_snapshot(home) == before
    positions = [out.index(title) for title in STEP_TITLES]
    assert positions == sorted(positions)
    venv = home / ".kb-rag" / "venv"
    assert re.search(r"would run: \S+ -m venv " + re.escape(str(venv)), out)
    assert f"would run: {venv}/bin/python -m pip install " in out and "'python-docx>=1.1'" in out
    assert f"would run: {venv}/bin/python {ENGINE} selftest" in out
    assert f"would run: {venv}/bin/python {ENGINE} models --download" in out
    assert "missing: the DSH CLI (dsh) is not on PATH: install it with npm install -g @deepseek-ai/dsh" in out
    assert expected in out
    assert "Summary (dry run: nothing was changed):" in out
    assert not venv.exists()


@needs_bash
def test_dry_run_with_dsh_present_plans_the_plugin_add_without_running_it(tmp_path, torch_index):
    home, bin_dir, log = tmp_path / "home", tmp_path / "bin", tmp_path / "calls.log"
    (home / ".dsh" / "profiles" / "research").mkdir(parents=True)
    bin_dir.mkdir()
    fake_tool(bin_dir, "dsh", log)
    fake_tool(bin_dir, "pnpm", log, output="10.0.0")
    done = run_install(["--dry-run", "-y", "--no-models", "--torch", "cpu"],
                       installer_env(home, base_path(bin_dir), KB_TORCH_CPU_INDEX=torch_index))
    assert done.returncode == 0, done.stdout + done.stderr
    assert not log.exists(), "a dry run must not call dsh or pnpm"
    assert f"would run: node {ROOT}/npm-package/pack.mjs --out {home}/.kb-rag/dist" in done.stdout
    assert f"would run: dsh plugin --profile research add {home}/.kb-rag/dist/dsh-kb-rag-0.1.0.tgz" in done.stdout
    assert f"--index-url {torch_index}" in done.stdout and "CPU-only torch (--torch cpu)" in done.stdout
    assert "skipped: --no-models" in done.stdout


@needs_bash
@pytest.mark.parametrize("torch_mode", [[], ["--torch", "cpu"]])
def test_torch_comes_from_the_mirror_when_the_cpu_index_cannot_be_reached(tmp_path, torch_mode):
    mirror = "http://127.0.0.1:9/simple"        # never contacted in a dry run
    done = run_install(["--dry-run", "-y", "--no-models", "--mirror", mirror, *torch_mode],
                       installer_env(tmp_path, base_path(), KB_TORCH_CPU_INDEX=closed_port_url()))
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    torch_line = next(line for line in out.splitlines() if "would run:" in line and "'torch>=" in line)
    assert torch_line.endswith(f"'torch>=2.1,<2.14' --index-url {mirror}"), torch_line
    assert f"did not answer within 3s, so torch comes from {mirror} instead" in out
    assert "CUDA build, about 2.5 GB more" in out and "KB_TORCH_CPU_INDEX" in out


@needs_bash
def test_torch_comes_from_the_cpu_index_when_it_answers(tmp_path, torch_index):
    done = run_install(["--dry-run", "-y", "--no-models", "--mirror", "http://127.0.0.1:9/simple"],
                       installer_env(tmp_path, base_path(), KB_TORCH_CPU_INDEX=torch_index))
    torch_line = next(line for line in done.stdout.splitlines() if "would run:" in line and "'torch>=" in line)
    assert torch_line.endswith(f"--index-url {torch_index}"), torch_line
    assert "did not answer" not in done.stdout


@needs_bash
@pytest.mark.parametrize("args, message", [
    (["--bogus"], "unknown option: --bogus"),
    (["--profile"], "--profile needs a value"),
    (["--profile", "--dry-run"], "--profile needs a value"),
    (["--torch", "fast"], "--torch takes auto, cpu, gpu or skip"),
    (["--profile", "a b"], "--profile takes a profile name"),
    (["--venv", "x", "--no-venv"], "--venv and --no-venv exclude each other"),
])
def test_bad_options_are_refused_before_anything_runs(tmp_path, args, message):
    done = run_install(args, installer_env(tmp_path, base_path()))
    assert done.returncode == 2
    assert message in done.stderr and "--help" in done.stderr
    assert "[1/6]" not in done.stdout


@needs_bash
def test_help_lists_every_option():
    done = subprocess.run(["bash", str(INSTALL_SH), "--help"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0
    for option in ("--profile", "--mirror", "--models", "--no-models", "--offline-model", "--with-docx", "--with-ocr",
                   "--with-watch", "--dry-run",
                   "-y, --yes", "--python", "--venv", "--no-venv", "--torch", "--plugin", "--with-mcp"):
        assert option in done.stdout


def scratch_venv(path: Path) -> Path:
    """A virtual environment that sees this test run's packages (a .pth file), so pip has nothing to fetch."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300, capture_output=True)
    python = path / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site) / "kb-rag-test-packages.pth").write_text("\n".join(sorted(ours)) + "\n")
    return python


@needs_bash
@needs_node
def test_real_install_in_a_scratch_venv_then_rerun_with_dsh(tmp_path):
    home, bin_dir, log = tmp_path / "home", tmp_path / "bin", tmp_path / "calls.log"
    (home / ".dsh" / "profiles" / "research").mkdir(parents=True)
    bin_dir.mkdir()
    python = scratch_venv(tmp_path / "venv")
    env = installer_env(home, base_path(bin_dir), KB_EMBED_MODEL="none")

    first = run_install(["-y", "--no-models", "--venv", str(tmp_path / "venv")], env)
    out = first.stdout
    assert first.returncode == 0, out + first.stderr
    assert f"ok: reusing the virtual environment {tmp_path / 'venv'}" in out
    assert "keeping the installed torch" in out
    assert "Requirement already satisfied: pymupdf" in out
    assert "selftest passed" in out and "ok: the engine indexed a generated PDF" in out
    assert "missing: the DSH CLI (dsh) is not on PATH: install it with npm install -g @deepseek-ai/dsh" in out
    assert "skipped: no DSH CLI (step 4)" in out
    assert (home / ".kb-rag" / "python-path").read_text().strip() == str(python)
    written = sorted(str(p.relative_to(home)) for p in home.rglob("*") if p.relative_to(home).parts[0] != ".cache")
    assert written == [".dsh", ".dsh/profiles", ".dsh/profiles/research", ".kb-rag", ".kb-rag/python-path"]

    # Re-run: idempotent, and with a DSH CLI on PATH the plugin is packed from this checkout and added.
    fake_tool(bin_dir, "dsh", log)
    fake_tool(bin_dir, "pnpm", log, output="10.0.0")
    second = run_install(["-y", "--no-models", "--venv", str(tmp_path / "venv")], env)
    assert second.returncode == 0, second.stdout + second.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    adds = [c for c in calls if c[:1] == ["dsh"]]
    tarball = home / ".kb-rag" / "dist" / "dsh-kb-rag-0.1.0.tgz"
    assert adds == [["dsh", "plugin", "--profile", "research", "add", str(tarball)]]
    assert tarball.is_file()
    with tarfile.open(tarball) as tar:
        packed = tar.extractfile("package/kb_engine.py").read()
    assert packed == ENGINE.read_bytes()
    assert "ok: plugin " in second.stdout and "restart DSH and open a new session" in second.stdout


@needs_bash
def test_a_missing_python_is_reported_and_fails_the_run(tmp_path):
    done = run_install(["-y", "--python", str(tmp_path / "no-python")], installer_env(tmp_path, base_path()))
    assert done.returncode == 1
    assert "FAILED: Python 3.10+ is needed" in done.stdout and "--python PATH" in done.stdout
    assert "skipped: no usable Python environment (step 1)" in done.stdout
    assert "The engine is NOT installed" in done.stdout
    assert not (tmp_path / ".kb-rag").exists()


# --- the npm packages -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("Node.js/npm not installed")
    out = tmp_path_factory.mktemp("pack")
    done = subprocess.run(["node", str(NPM_PACKAGE / "pack.mjs"), "--out", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip().splitlines()[-1])


def test_packed_bundle_contents(bundle):
    with tarfile.open(bundle) as tar:
        names = set(tar.getnames())
        manifest = json.loads(tar.extractfile("package/package.json").read())
        engine = tar.extractfile("package/kb_engine.py").read()
        patch = tar.extractfile("package/cordis.patch.yml").read().decode()
        install_mjs = tar.getmember("package/install.mjs")
    assert hashlib.sha256(engine).digest() == hashlib.sha256(ENGINE.read_bytes()).digest()
    assert "id: kb-rag" in patch
    for required in ("package/src/index.js", "package/client/index.js", "package/scripts/install.sh",
                     "package/scripts/install.ps1", "package/install.mjs", "package/README.md",
                     "package/LICENSE"):
        assert required in names
    assert not any("/test/" in n or "node_modules" in n or "/e2e/" in n or "eslint" in n for n in names), names
    assert not set(manifest.get("scripts", {})) & LIFECYCLE
    assert manifest["bin"] == {"dsh-kb-rag-install": "install.mjs"}
    assert manifest["dsh"]["bundle"]["patch"] == "./cordis.patch.yml"
    assert manifest["exports"]["./client"] == "./client/index.js"
    assert set(manifest["peerDependencies"]) == {"@deepseek-ai/cordis", "@deepseek-ai/dsh-tools",
                                                 "@deepseek-ai/schemastery"}
    assert install_mjs.mode & 0o100
    # The plugin's development manifest declares the same host contract.
    dev = json.loads((ROOT / "plugin" / "package.json").read_text())
    for key in ("dsh", "peerDependencies", "type", "main"):
        assert dev[key] == manifest[key], key
    for subpath, target in dev["exports"].items():
        assert manifest["exports"][subpath] == target
    micro = json.loads((MICRO_PACKAGE / "package.json").read_text())
    assert micro["dependencies"] == {"dsh-kb-rag": manifest["version"]} and "scripts" not in micro


def npm_install(where: Path, *specs: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    (where / "package.json").write_text('{"name": "scratch", "private": true}\n')
    # --legacy-peer-deps: the DSH host packages (peer dependencies) are not needed to run the installer.
    done = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--legacy-peer-deps", *specs],
                          cwd=where, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@needs_bash
def test_npm_bin_dry_run(bundle, tmp_path):
    npm_install(tmp_path / "app", str(bundle))
    home = tmp_path / "home"
    (home / ".dsh" / "profiles" / "web").mkdir(parents=True)
    before = home_snapshot(home)
    binary = tmp_path / "app" / "node_modules" / ".bin" / "dsh-kb-rag-install"
    done = subprocess.run([str(binary), "--dry-run", "-y", "--profile=web", "--no-models"], capture_output=True,
                          text=True, timeout=300, env=installer_env(home, base_path()), stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    assert home_snapshot(home) == before
    installed = (tmp_path / "app" / "node_modules" / "dsh-kb-rag").resolve()
    assert f"kb-rag installer 0.1.0 (package at {installed})" in done.stdout
    for title in STEP_TITLES:
        assert title in done.stdout
    assert "dsh plugin --profile web add dsh-kb-rag@0.1.0" in done.stdout

    refused = subprocess.run([str(binary), "--torch", "fast"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--torch takes auto, cpu, gpu, skip" in refused.stderr


def test_micro_package_runs_the_bundled_installer(bundle, tmp_path):
    out = tmp_path / "micro-pack"
    out.mkdir()
    packed = subprocess.run(["npm", "pack", "--json", "--pack-destination", str(out)], cwd=MICRO_PACKAGE,
                            capture_output=True, text=True, timeout=300)
    assert packed.returncode == 0, packed.stderr
    micro = out / json.loads(packed.stdout)[0]["filename"]
    npm_install(tmp_path / "app", str(bundle), str(micro))
    home = tmp_path / "home"
    home.mkdir()
    cli = tmp_path / "app" / "node_modules" / "dsh-kb-rag-install" / "cli.mjs"
    done = subprocess.run(["node", str(cli), "--dry-run", "--yes", "--no-models"], capture_output=True, text=True,
                          timeout=300, env=installer_env(home, base_path()), stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[6/6] Models" in done.stdout and "dsh-kb-rag@0.1.0" in done.stdout
    assert list(home.iterdir()) == []


@needs_node
def test_powershell_translation_table():
    script = ("import('./install.mjs').then((m) => { const o = m.parseOptions(JSON.parse(process.argv[1]));"
              " console.log(JSON.stringify({ ps: m.installerCommand(o, 'win32').argv,"
              " sh: m.installerCommand(o, 'linux').argv })) })")
    args = ["--profile", "web", "--mirror=https://m.example/simple", "--models", "--no-models", "--offline-model",
            "--with-docx", "--with-ocr", "--with-watch", "--with-mcp", "--python", "C:\\Py\\python.exe", "--venv",
            "D:\\kb venv",
            "--no-venv",
            "--torch", "cpu", "--plugin", "dsh-kb-rag@0.1.0", "--dry-run", "-y", "-h"]
    done = subprocess.run(["node", "-e", script, json.dumps(args)], cwd=NPM_PACKAGE, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    argv = json.loads(done.stdout)
    assert argv["ps"][:4] == ["-NoProfile", "-ExecutionPolicy", "Bypass", "-File"]
    assert argv["ps"][4].endswith("install.ps1")
    assert argv["ps"][5:] == ["-Profile", "web", "-Mirror", "https://m.example/simple", "-Models", "-NoModels",
                              "-OfflineModel", "-WithDocx", "-WithOcr", "-WithWatch", "-WithMcp", "-Python",
                              "C:\\Py\\python.exe", "-Venv",
                              "D:\\kb venv", "-NoVenv", "-Torch", "cpu", "-Plugin", "dsh-kb-rag@0.1.0",
                              "-DryRun", "-Yes",
                              "-Help"]
    assert argv["sh"][0].endswith("install.sh")
    assert argv["sh"][1:] == ["--profile", "web", "--mirror", "https://m.example/simple", "--models", "--no-models",
                              "--offline-model", "--with-docx", "--with-ocr", "--with-watch", "--with-mcp",
                              "--python",
                              "C:\\Py\\python.exe",
                              "--venv", "D:\\kb venv", "--no-venv", "--torch", "cpu", "--plugin", "dsh-kb-rag@0.1.0",
                              "--dry-run", "--yes", "--help"]
    # Every PowerShell parameter the table produces is declared by install.ps1.
    ps1 = INSTALL_PS1.read_text(encoding="utf-8-sig")
    param_block = ps1[ps1.index("param("):]
    for name in ("Profile", "Mirror", "Models", "NoModels", "OfflineModel", "WithDocx", "WithWatch", "WithMcp",
                 "Python", "Venv", "NoVenv", "Torch", "Plugin", "DryRun", "Yes", "Help"):
        assert re.search(r"\$" + name + r"\b", param_block[:3000]), name


def test_text_files_are_stored_as_gitattributes_asks_so_a_fresh_clone_is_clean():
    """A blob stored with CRLF under `text eol=crlf` shows as modified in every fresh clone (git would renormalise
    it): the repository must hold LF, and the checkout gets the line ends the attributes ask for."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run([git, "ls-files", "--eol"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    wrong = [line for line in listed.splitlines() if "attr/text" in line and not line.startswith("i/lf")
             and not line.startswith("i/none")]
    assert wrong == [], "stored with CRLF although .gitattributes normalises them:\n" + "\n".join(wrong)
    assert (ROOT / "install.cmd").read_bytes().count(b"\r\n") > 0, "install.cmd must be checked out with CRLF"
