"""Model runtime: model folders, time-boxed downloads, devices, prompts, embedder, reranker.

May import: config, storage.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import _short_error, kb_cache_dir
from ..storage import Library, _write_atomically

# Embedder and reranker load lazily, local files first.  A download is tried
# only by calls that may wait (ingest, ``models``), always time-boxed; a query
# never waits on one: it degrades and says so.

DEFAULT_EMBED_MODEL = "BAAI/bge-small-zh-v1.5"
DEFAULT_RERANK_MODEL = "BAAI/bge-reranker-base"
DEFAULT_RERANK_FALLBACK = "BAAI/bge-large-en-v1.5"
BGE_ZH_QUERY_PREFIX = "为这个句子生成表示以用于检索相关文章："
DEFAULT_DOWNLOAD_TIMEOUT_S = 120.0
DEFAULT_DOWNLOAD_RETRY_S = 3600.0  # after a failed download, later processes wait this long before trying again
CPU_BATCH = {"embed": 32, "rerank": 16}
MIN_DEVICE_BATCH = 4
MAX_UNKNOWN_TOKEN_SHARE = 0.3  # above this the embedder cannot read the query: skip the vector half


# What the embedder reads for a chunk. A passage alone is ambiguous ("the model", "this dataset"); its paper's
# title and section name tell the embedder what it is about (page-level MRR on the full-text questions 0.573 ->
# 0.670 with all-MiniLM-L6-v2, docs/PERFORMANCE.md). A library's vectors all come from one format, recorded with
# them; `reembed` moves a library made with an older one to the current one.
PASSAGE_FORMATS: dict[str, Callable[[str, str, str], str]] = {
    "text/0": lambda title, section, text: text,
    "title-section/1": lambda title, section, text: (
        f"{'. '.join(part for part in (title.strip(), section.strip()) if part)}\n{text}"
        if title.strip() or section.strip()
        else text
    ),
}
PASSAGE_FORMAT = "title-section/1"


def embedding_inputs(passages: list[tuple[int, str, str, str]], passage_format: str) -> list[tuple[int, str]]:
    """(chunk id, embedder input) for (id, title, section, text) rows, in the library's passage format."""
    make = PASSAGE_FORMATS.get(passage_format, PASSAGE_FORMATS["text/0"])
    return [(chunk_id, make(title, section, text)) for chunk_id, title, section, text in passages]


class ModelUnavailable(Exception):
    """A model that cannot be used now; the message says why and what to do."""


class UnusableEmbeddings(ModelUnavailable):
    """Vectors an encoding call refused (see unusable_rows): the message names the model and says why. ``vectors``
    is the call's output and ``usable`` which of its rows may be kept."""

    def __init__(self, message: str, vectors, usable):
        super().__init__(message)
        self.vectors, self.usable = vectors, usable


def _env_model(var: str, default: str) -> str:
    return (os.environ.get(var) or default).strip()


def models_dir() -> Path:
    """Where imported models live (``models --import``): ``KB_MODELS_DIR``, else ``models`` in the cache folder."""
    configured = os.environ.get("KB_MODELS_DIR")
    return Path(configured).expanduser() if configured else kb_cache_dir() / "models"


def resolve_model_folder(name: str) -> str | None:
    """The local folder a model setting names: a folder path, or the short name of an imported model (a folder
    of the models folder, such as ``multilingual-e5-small``); None for anything else (a hub name)."""
    path = os.path.expanduser(name)
    if name and os.path.isdir(path):
        return os.path.abspath(path)
    if name and "/" not in name and "\\" not in name and name.strip(".") and (models_dir() / name).is_dir():
        return str((models_dir() / name).resolve())
    return None


def is_local_model(name: str) -> bool:
    return resolve_model_folder(name) is not None


def model_id(name: str) -> str:
    """Stable identifier recorded with vectors: the hub name, or the folder's absolute path."""
    return resolve_model_folder(name) or name


def offline_mode() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def download_timeout() -> float:
    try:
        return max(1.0, float(os.environ.get("KB_DOWNLOAD_TIMEOUT", DEFAULT_DOWNLOAD_TIMEOUT_S)))
    except ValueError:
        return DEFAULT_DOWNLOAD_TIMEOUT_S


def quiet_model_libraries() -> None:
    """Progress bars and advisory logs of the model libraries would clutter stderr (and never stdout)."""
    for var, value in (
        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
        ("TRANSFORMERS_VERBOSITY", "error"),
        ("TOKENIZERS_PARALLELISM", "false"),
        ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1"),
    ):
        os.environ.setdefault(var, value)


def hub_cache_dir() -> Path:
    """The Hugging Face hub's cache folder, found as huggingface_hub finds it."""
    configured = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if configured:
        return Path(configured).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def local_model_path(name: str) -> str | None:
    """A folder holding the model without any network access, or None."""
    folder = resolve_model_folder(name)
    if folder is not None:
        return folder
    if "/" in name and not (hub_cache_dir() / ("models--" + name.replace("/", "--"))).is_dir():
        return None  # not in the hub's cache: known without importing huggingface_hub (0.4 s)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, local_files_only=True)
    except Exception:
        return None


def download_memory_path() -> Path:
    """Where failed downloads are remembered across processes (one small JSON file per user)."""
    return kb_cache_dir() / "failed-downloads.json"


def _download_retry_s() -> float:
    try:
        return max(0.0, float(os.environ.get("KB_DOWNLOAD_RETRY_S", DEFAULT_DOWNLOAD_RETRY_S)))
    except ValueError:
        return DEFAULT_DOWNLOAD_RETRY_S


class Downloads:
    """Background hub downloads, one per model name; a caller waits at most its time box. A download that failed
    (or did not finish in its time box) is remembered on disk for KB_DOWNLOAD_RETRY_S, so that the next one-shot
    ingest on an offline machine does not wait for it again; ``force`` (``models --download``) retries at once."""

    def __init__(self):
        import threading

        self._lock = threading.Lock()
        self._threads: dict[str, threading.Thread] = {}
        self._errors: dict[str, str] = {}

    @staticmethod
    def _failures() -> dict:
        try:
            data = json.loads(download_memory_path().read_text(encoding="utf-8"))
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _remember_failure(self, name: str, why: str) -> None:
        failures = self._failures()
        failures[name] = {"at": time.time(), "error": why[:300]}
        try:
            _write_atomically(download_memory_path(), json.dumps(failures).encode())
        except OSError:
            pass  # a read-only home only costs the next process a retry

    def _forget_failure(self, name: str) -> None:
        failures = self._failures()
        if failures.pop(name, None) is not None:
            try:
                _write_atomically(download_memory_path(), json.dumps(failures).encode())
            except OSError:
                pass

    def recent_failure(self, name: str) -> str | None:
        """Why the last download of ``name`` failed and when it is tried again, while that is in the future."""
        failure = self._failures().get(name)
        if not isinstance(failure, dict) or not isinstance(failure.get("at"), (int, float)):
            return None
        retry_at = failure["at"] + _download_retry_s()
        if time.time() >= retry_at:
            return None
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(retry_at))
        return (
            f"downloading {name} failed at {time.strftime('%H:%M', time.localtime(failure['at']))} "
            f"({failure.get('error', 'unknown error')}); it is tried again after {when} (KB_DOWNLOAD_RETRY_S), "
            "or now with `kb-engine models --download`"
        )

    def fetch(self, name: str, wait_s: float, force: bool = False) -> str:
        """The model's local folder, downloading it for at most ``wait_s`` seconds."""
        import threading

        if offline_mode():
            raise ModelUnavailable(
                f"{name} is not in the local model cache and HF_HUB_OFFLINE=1 forbids "
                "downloading it; copy the model folder locally and point the variable at it"
            )
        remembered = None if force or self.in_progress(name) else self.recent_failure(name)
        if remembered:
            raise ModelUnavailable(remembered)
        with self._lock:
            thread = self._threads.get(name)
            if thread is None or (not thread.is_alive() and name in self._errors):
                self._errors.pop(name, None)
                thread = threading.Thread(target=self._download, args=(name,), daemon=True, name=f"kb-download-{name}")
                self._threads[name] = thread
                thread.start()
        thread.join(wait_s)
        if thread.is_alive():
            if wait_s > 0:
                self._remember_failure(name, f"not finished within {wait_s:.0f}s")
            raise ModelUnavailable(
                f"downloading {name} did not finish within {wait_s:.0f}s; it goes on in the "
                "background while this process runs (`kb-engine models --download` fetches "
                "models ahead of time; HF_ENDPOINT selects a mirror, KB_DOWNLOAD_TIMEOUT the wait)"
            )
        if name in self._errors:
            self._remember_failure(name, self._errors[name])
            raise ModelUnavailable(f"{name} could not be downloaded: {self._errors[name]}")
        self._forget_failure(name)
        path = local_model_path(name)
        if path is None:
            raise ModelUnavailable(f"{name} was downloaded but cannot be found in the local cache")
        return path

    def in_progress(self, name: str) -> bool:
        thread = self._threads.get(name)
        return bool(thread is not None and thread.is_alive())

    def _download(self, name: str) -> None:
        try:
            from huggingface_hub import snapshot_download

            snapshot_download(name)
        except Exception as exc:
            self._errors[name] = _short_error(exc)


def is_device_error(exc: BaseException) -> bool:
    """Errors of the accelerator itself (out of memory, driver, kernel), as opposed to bugs or bad input."""
    try:
        import torch

        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return True
    except Exception:
        pass
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        marker in text
        for marker in ("cuda", "cudnn", "cublas", "out of memory", "device-side", "hip error", "nccl", "mps backend")
    )


def nvidia_driver_present() -> bool:
    """Whether CUDA could work here at all: the NVIDIA driver's files (Linux, Windows); never on macOS."""
    if sys.platform == "darwin":
        return False
    if sys.platform.startswith("win"):
        system = os.path.join(os.environ.get("SYSTEMROOT", r"C:\Windows"), "System32")
        return os.path.exists(os.path.join(system, "nvcuda.dll"))
    return (
        os.path.exists("/proc/driver/nvidia/version")
        or os.path.exists("/dev/nvidia0")
        or os.path.exists("/dev/nvidiactl")
    )


class DeviceManager:
    """Chooses cpu or cuda once per process (until ``rearm``) and records what happened."""

    def __init__(self):
        self.requested = (os.environ.get("KB_DEVICE") or "auto").strip().lower()
        self.verdict: str | None = None
        self.report: dict = {}

    def rearm(self) -> None:
        self.verdict = None
        self.report = {}

    def device(self) -> str:
        if self.verdict is None:
            self.verdict = self._decide()
        return self.verdict

    def _decide(self) -> str:
        report = {"requested": self.requested, "probe": None, "cuda_available": False, "gpu": None, "vram_gb": None}
        self.report = report
        if self.requested not in ("auto", "cpu", "cuda") and not self.requested.startswith("cuda:"):
            report["note"] = f"KB_DEVICE={self.requested!r} is not auto, cpu or cuda; using the CPU"
            return "cpu"
        if self.requested == "cpu":
            return "cpu"
        if self.requested == "auto" and not nvidia_driver_present():
            report["probe"] = "no NVIDIA driver"  # decided without importing torch (over 2 s of a one-shot call)
            return "cpu"
        try:
            import torch

            report["cuda_available"] = bool(torch.cuda.is_available())
        except Exception as exc:
            report["gpu_disabled_reason"] = f"torch could not be imported: {_short_error(exc)}"
            return "cpu"
        if not report["cuda_available"]:
            if self.requested != "auto":
                report["gpu_disabled_reason"] = "CUDA was requested but torch sees no usable GPU"
            return "cpu"
        target = self.requested if self.requested.startswith("cuda:") else "cuda:0"
        try:
            props = torch.cuda.get_device_properties(torch.device(target))
            report["gpu"], report["vram_gb"] = props.name, round(props.total_memory / 2**30, 1)
        except Exception:
            pass
        if os.environ.get("KB_GPU_PROBE", "1") == "0":
            report["probe"] = "skipped"
            return target
        try:
            a = torch.ones((64, 64), device=target)
            float((a @ a).sum().item())
            torch.cuda.synchronize(torch.device(target))
            report["probe"] = "ok"
            return target
        except Exception as exc:
            report["probe"] = "failed"
            report["gpu_disabled_reason"] = f"the GPU failed a test computation: {_short_error(exc)}"
            return "cpu"

    def default_batch(self, role: str, device: str) -> int:
        env = os.environ.get("KB_EMBED_BATCH" if role == "embed" else "KB_RERANK_BATCH")
        if env and env.isdigit() and int(env) > 0:
            return int(env)
        if device == "cpu":
            return CPU_BATCH[role]
        vram = self.report.get("vram_gb") or 8.0
        base = 128 if role == "embed" else 64
        return base if vram >= 8 else base // 2 if vram >= 4 else base // 4


class _DeviceBoundModel:
    """A model that runs batches with the spec's fallback: halve, then 4, then the CPU."""

    role = "embed"

    def __init__(self, name: str, devices: DeviceManager, model, device: str):
        self.name = name
        self.model_id = model_id(name)
        self.devices = devices
        self.model = model
        self.device = device
        self.batch = devices.default_batch(self.role, device)
        self.note: str | None = None
        self._halved = False

    def _run(self, items: list, step: Callable[[list, int], list]) -> list:
        out: list = []
        i = 0
        while i < len(items):
            chunk = items[i : i + self.batch]
            try:
                out.extend(step(chunk, self.batch))
                i += len(chunk)
            except Exception as exc:
                if self.device == "cpu" or not is_device_error(exc):
                    raise
                self._degrade(exc)
        return out

    def _degrade(self, exc: BaseException) -> None:
        """Halve the batch, then drop it to 4, then move to the CPU; the call carries on each time."""
        if self.batch > MIN_DEVICE_BATCH and not self._halved:
            self.batch, self._halved = max(MIN_DEVICE_BATCH, self.batch // 2), True
        elif self.batch > MIN_DEVICE_BATCH:
            self.batch = MIN_DEVICE_BATCH
        else:
            self._to_cpu()
            self.note = f"{self.role} model moved to the CPU after a device error: {_short_error(exc)}"
            self.devices.report["gpu_disabled_reason"] = self.note
            return
        self.note = f"{self.role} batch reduced to {self.batch} after a device error: {_short_error(exc)}"

    def _to_cpu(self) -> None:
        try:
            import torch

            self.model.to("cpu")
            torch.cuda.empty_cache()
        except Exception:
            pass
        self.device = "cpu"
        self.batch = self.devices.default_batch(self.role, "cpu")


@dataclass(frozen=True)
class ModelPrompts:
    """The text an embedding model wants in front of a query and of a passage (e5: ``query: `` / ``passage: ``).

    Asymmetric models are trained with these prefixes; without them their vectors drift (on the full-text
    questions multilingual-e5-small scored MRR@10 0.23 with none and 0.77 with both, issue 18)."""

    query: str = ""
    passage: str = ""
    source: str = "none"


# sentence-transformers folders name the passage prompt differently; the first one present is used
PASSAGE_PROMPT_NAMES = ("passage", "document", "corpus", "doc")
QUERY_PROMPT_NAMES = ("query", "search_query")


def declared_prompts(folder: str | None) -> dict[str, str]:
    """The ``prompts`` a sentence-transformers folder declares, with its default prompt as ``default``."""
    if not folder:
        return {}
    try:
        extras = json.loads((Path(folder) / "config_sentence_transformers.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(extras, dict) or not isinstance(extras.get("prompts"), dict):
        return {}
    prompts = {k: v for k, v in extras["prompts"].items() if isinstance(k, str) and isinstance(v, str)}
    default = extras.get("default_prompt_name")
    if isinstance(default, str) and default in prompts:
        prompts["default"] = prompts[default]
    return prompts


def model_prompts(name: str, folder: str | None) -> ModelPrompts:
    """Prompts for a model: ``KB_QUERY_PROMPT``/``KB_PASSAGE_PROMPT`` (set, even empty, they win), else what
    the folder declares, else the bge-zh query instruction its model card asks for."""
    declared = declared_prompts(folder)

    def first(names: tuple[str, ...]) -> str | None:
        return next((declared[n] for n in names if n in declared), declared.get("default"))

    query, passage = first(QUERY_PROMPT_NAMES), first(PASSAGE_PROMPT_NAMES)
    source = "model folder" if query is not None or passage is not None else "none"
    lowered = name.lower()
    if query is None and "bge" in lowered and "zh" in lowered:
        query, source = BGE_ZH_QUERY_PREFIX, "bge-zh model card"
    for var, role in (("KB_QUERY_PROMPT", "query"), ("KB_PASSAGE_PROMPT", "passage")):
        if var in os.environ:
            source = var if source == "none" else f"{source}, {var}"
            if role == "query":
                query = os.environ[var]
            else:
                passage = os.environ[var]
    return ModelPrompts(query or "", passage or "", source)


# Sentences on unrelated everyday topics. Their mutual cosine is what "unrelated" scores under a model: about
# 0.04 for all-MiniLM-L6-v2, about 0.8 for multilingual-e5-small, whose cosines are all bunched high. Cut-offs
# are given on a scale where that baseline is 0 and identical text 1, so one setting works for both.
UNRELATED_PROBES = (
    "Simmer the onions slowly in butter until they turn golden and sweet.",
    "The striker scored twice in the second half to win the cup final.",
    "Quarterly tax returns must be filed before the end of the following month.",
    "The cathedral's stained glass windows date from the thirteenth century.",
    "Tenants may end the lease by giving two months' written notice.",
    "The violin concerto opens with a long, quiet solo passage.",
    "Our flight to Lisbon was delayed for three hours by fog.",
    "Water the tomato seedlings every morning during the first week.",
    "The museum is closed on public holidays and the first Monday of each month.",
    "She knitted a red scarf for her grandson's birthday.",
)


# How alike whole papers are under a model: the cosine of two papers' centroids (the unit mean of their passage
# vectors). Averaging a long paper's passages keeps what all papers share (statements, tables, references, the
# model's own common direction) and drops what single passages do not, so under a model whose cosines are bunched
# high (e5) unrelated papers score well above unrelated sentences: 0.875 against 0.78 for multilingual-e5-small,
# while all-MiniLM-L6-v2 gives about 0.03 for both. The probes above cannot stand for papers, so each model the
# engine ships or tests with has its papers' scale measured on real papers (benchmarks/eval_related.py, labelled
# pairs of the shared corpus): the median centroid cosine of unrelated pairs, and the cut-off that best separates
# related from unrelated pairs. ``probe_baseline`` is the model's UNRELATED_PROBES baseline when it was measured:
# a model whose name matches but whose baseline differs (a fine-tuned copy) is not taken for it.
@dataclass(frozen=True)
class PaperScale:
    name: str  # matched in the model id, lower case, "_" read as "-"
    probe_baseline: float
    unrelated: float
    boundary: float


PAPER_SCALES = (
    PaperScale("multilingual-e5-small", 0.779, 0.875, 0.92),
    PaperScale("all-minilm-l6-v2", 0.063, 0.027, 0.324),
)
# For any other model: the probes' baseline as the unrelated level, and the cut-off as far above it, in the share
# of the distance to 1, as measured for all-MiniLM-L6-v2 (whose probe and paper baselines agree).
PAPER_BOUNDARY_SHARE = 0.28
PAPER_SCALE_TOLERANCE = 0.03  # how far a model's probe baseline may be from the measured one to be taken for it


# A model with damaged weights, or one whose float16 or bfloat16 arithmetic overflowed on a GPU, gives NaN or
# infinity, which normalising turns into NaN or zero. Stored, such a vector is cosine 0 to everything: vector search
# would rank documents in id order with nothing to say so. Such rows are refused, never stored or searched with.
MIN_EMBEDDING_NORM = 1e-6


def unusable_rows(matrix):
    """Which rows of an encoder's output are no embeddings: a value that is not finite, or (nearly) all zero."""
    import numpy as np

    finite = np.isfinite(matrix).all(axis=1)
    norms = np.linalg.norm(np.where(finite[:, None], matrix, 0.0), axis=1)
    return ~finite | (norms < MIN_EMBEDDING_NORM)


class Embedder(_DeviceBoundModel):
    role = "embed"

    def __init__(self, name: str, devices: DeviceManager, model, device: str, prompts: ModelPrompts | None = None):
        super().__init__(name, devices, model, device)
        self.prompts = prompts or model_prompts(name, None)
        self.refused: str | None = None  # why this process last refused the model's vectors

    @property
    def dim(self) -> int:
        getter = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        return int(getter())

    def _encode(self, texts: list[str], batch: int, prompt: str) -> list:
        import numpy as np

        # prompt="" (not None) also stops sentence-transformers adding a folder's default prompt a second time
        vectors = self.model.encode(
            texts,
            batch_size=batch,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
            prompt=prompt,
        )
        return list(np.asarray(vectors, dtype=np.float32))

    def _encode_texts(self, texts: list[str], prompt: str):
        """Unit vectors in input order; texts are batched by length so padding stays small. Raises
        UnusableEmbeddings when the model gave rows that are no embeddings (every backend passes here)."""
        import numpy as np

        if getattr(self.model, "plans_batches", False):  # the ONNX runner groups by token count itself
            return self._checked(
                np.asarray(self._encode(texts, len(texts) or 1, prompt), dtype=np.float32).reshape(len(texts), self.dim)
            )
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        encoded = self._run([texts[i] for i in order], lambda chunk, batch: self._encode(chunk, batch, prompt))
        out: Any = np.zeros((len(texts), self.dim), dtype=np.float32)
        for position, index in enumerate(order):
            out[index] = encoded[position]
        return self._checked(out)

    def _checked(self, matrix):
        """The matrix, once every row is known to be an embedding; else UnusableEmbeddings naming the model."""
        import numpy as np

        bad = unusable_rows(matrix)
        if not bad.any():
            return matrix
        broken = int((~np.isfinite(matrix[bad])).any(axis=1).sum())
        kinds = [
            f"{broken} with NaN or infinite values" if broken else "",
            f"{int(bad.sum()) - broken} all zero" if int(bad.sum()) > broken else "",
        ]
        causes = ["its weights may be damaged"]
        if self.device != "cpu":
            causes.append(f"its arithmetic overflowed on {self.device} (KB_DEVICE=cpu rules that out)")
        elif getattr(self.model, "cpu_bf16", False):
            causes.append("its bfloat16 arithmetic overflowed (KB_CPU_BF16=0 rules that out)")
        self.refused = (
            f"the embedding model {self.model_id} gave {int(bad.sum())} of {len(matrix)} vectors that "
            f"are not embeddings ({', '.join(k for k in kinds if k)}): {' or '.join(causes)}"
        )
        raise UnusableEmbeddings(self.refused, matrix, ~bad)

    def encode_passages(self, texts: list[str], prompt: str | None = None):
        """Passage vectors; ``prompt`` is the one the library's vectors were made with (default: the model's)."""
        return self._encode_texts(texts, self.prompts.passage if prompt is None else prompt)

    def encode_queries(self, queries: list[str]):
        """Query vectors (with the model's query prompt), one batch for all renderings of a question."""
        return self._encode_texts(queries, self.prompts.query)

    def encode_query(self, query: str):
        return self.encode_queries([query])[0]

    @functools.cached_property
    def unrelated_similarity(self) -> float:
        """The mean cosine between unrelated passages under this model (measured once per process)."""
        import numpy as np

        vectors = self.encode_passages(list(UNRELATED_PROBES))
        pairs = (vectors @ vectors.T)[~np.eye(len(UNRELATED_PROBES), dtype=bool)]
        baseline = float(pairs.mean()) if pairs.size else 0.0
        return min(max(baseline, 0.0), 0.95) if math.isfinite(baseline) else 0.0

    def relative_similarity(self, cosine: float) -> float:
        """A cosine on the model-independent scale: 0 for unrelated text, 1 for the same text."""
        base = self.unrelated_similarity
        return (cosine - base) / (1.0 - base)

    @functools.cached_property
    def paper_scale(self) -> tuple[float, float]:
        """(unrelated, boundary): the centroid cosines of unrelated papers and of the related/unrelated cut-off
        under this model, measured for known models (PAPER_SCALES), estimated from the probes for others."""
        key = self.model_id.lower().replace("_", "-")
        baseline = self.unrelated_similarity
        for scale in PAPER_SCALES:
            if scale.name in key and abs(baseline - scale.probe_baseline) <= PAPER_SCALE_TOLERANCE:
                return scale.unrelated, scale.boundary
        return baseline, baseline + PAPER_BOUNDARY_SHARE * (1.0 - baseline)

    def paper_similarity(self, cosine: float) -> float:
        """Two papers' centroid cosine on a scale people can read, the same for every model: 0 for papers as alike
        as unrelated papers are (or less), 0.5 at the measured boundary of related work, 1 for the same text;
        linear in the cosine between those points."""
        unrelated, boundary = self.paper_scale
        if cosine < boundary:
            value = 0.5 * (cosine - unrelated) / max(boundary - unrelated, 1e-6)
        else:
            value = 0.5 + 0.5 * (cosine - boundary) / max(1.0 - boundary, 1e-6)
        return min(max(value, 0.0), 1.0)

    def unknown_token_share(self, text: str) -> float:
        """Share of the text's tokens the model's vocabulary does not know (its embedding is then noise)."""
        tokenizer = getattr(self.model, "tokenizer", None)
        unknown = getattr(tokenizer, "unk_token", None)
        if tokenizer is None or unknown is None:
            return 0.0
        try:
            tokens = tokenizer.tokenize(text)
        except Exception:
            return 0.0
        return sum(1 for t in tokens if t == unknown) / len(tokens) if tokens else 0.0


def library_passage_prompt(lib: Library, embedder: Embedder) -> str:
    """The passage prompt new vectors get: the library's own, so one library never mixes two; the configured
    one for a library's first vectors."""
    recorded = lib.passage_prompt()
    return embedder.prompts.passage if recorded is None else recorded


class Reranker(_DeviceBoundModel):
    role = "rerank"

    def score(self, query: str, passages: list[str]) -> list[float]:
        def step(chunk, batch):
            scores = self.model.predict([(query, p) for p in chunk], batch_size=batch, show_progress_bar=False)
            return [float(s) for s in list(scores)]

        return [s if math.isfinite(s) else 0.0 for s in self._run(passages, step)]


class BiEncoderReranker:
    """Fallback reranker: cosine between query and passage under a second embedding model."""

    def __init__(self, embedder: Embedder):
        self.embedder = embedder
        self.name = embedder.name
        self.device = embedder.device

    def score(self, query: str, passages: list[str]) -> list[float]:
        query_vec = self.embedder.encode_query(query)
        return [float(x) for x in self.embedder.encode_passages(passages) @ query_vec]


SENTENCE_MODULES = {"Transformer", "Pooling", "Normalize"}
POOLING_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")
