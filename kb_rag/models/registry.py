"""Models: the engine's models, loaded once, with their downloads and devices.

May import: config, models.importer, models.native, models.onnx_encoder, models.runtime.
"""

from __future__ import annotations

import os
import sys

from ..config import KBError, _short_error
from ..models.importer import BUNDLED_MODELS, _installed_member, default_embed_model, import_bundled_model
from ..models.native import PlainSentenceEncoder, cpu_bf16_wanted
from ..models.onnx_encoder import OnnxSentenceEncoder, embed_backend_setting, load_sentence_encoder
from ..models.runtime import (
    DEFAULT_EMBED_MODEL,
    DEFAULT_RERANK_FALLBACK,
    DEFAULT_RERANK_MODEL,
    BiEncoderReranker,
    DeviceManager,
    Downloads,
    Embedder,
    ModelUnavailable,
    Reranker,
    _env_model,
    download_timeout,
    is_device_error,
    is_local_model,
    local_model_path,
    model_prompts,
    offline_mode,
    quiet_model_libraries,
)


class Models:
    """The engine's models: created on first use, kept for the life of the process."""

    def __init__(self):
        quiet_model_libraries()
        self.devices = DeviceManager()
        self.downloads = Downloads()
        self._embedder: Embedder | None = None
        self._reranker = None
        self._default_embed: str | None = None
        self.auto_imported: dict | None = None  # set when the embedded default was imported on first need

    @property
    def embed_name(self) -> str:
        configured = os.environ.get("KB_EMBED_MODEL", "").strip()
        if configured:
            return configured
        if self._default_embed is None:  # decided once per process, so a library never sees it change
            self._default_embed = default_embed_model()
        return self._default_embed

    @property
    def rerank_name(self) -> str:
        return _env_model("KB_RERANK_MODEL", DEFAULT_RERANK_MODEL)

    @property
    def rerank_fallback_name(self) -> str | None:
        value = os.environ.get("KB_RERANK_FALLBACK", DEFAULT_RERANK_FALLBACK).strip()
        return None if value.lower() in ("", "none", "off", "0") else value

    def forget_default(self) -> None:
        """Decide the default embedder again (a model was just imported) unless one is already loaded."""
        if self._embedder is None:
            self._default_embed = None

    def loaded(self) -> dict:
        return {
            "embedder": self._embedder.model_id if self._embedder else None,
            "reranker": getattr(self._reranker, "name", None),
        }

    def drop(self) -> None:
        self._embedder = None
        self._reranker = None
        try:
            import gc

            import torch

            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:
            pass

    def _path(self, name: str, may_download: bool) -> str:
        path = local_model_path(name)
        if path is not None:
            return path
        if not may_download:
            hint = " (a download is under way)" if self.downloads.in_progress(name) else ""
            raise ModelUnavailable(f"{name} is not available locally{hint}")
        return self.downloads.fetch(name, download_timeout())

    def embedder(self, may_download: bool = False) -> Embedder:
        """The configured embedder; raises ModelUnavailable with the reason."""
        name = self.embed_name
        if self._embedder is not None and self._embedder.name == name:
            return self._embedder
        try:
            path = self._path(name, may_download)
        except ModelUnavailable as exc:
            name, path = self._bundled_default(exc)
        device = self.devices.device()
        try:
            model = self._sentence_encoder(path, device)
        except Exception as exc:
            if device != "cpu" and is_device_error(exc):
                self.devices.report["gpu_disabled_reason"] = f"embedder failed to load on {device}: {_short_error(exc)}"
                device = "cpu"
                model = self._sentence_encoder(path, device)
            else:
                raise ModelUnavailable(
                    f"{name} could not be loaded: {type(exc).__name__}: {_short_error(exc)}"
                ) from None
        self._embedder = Embedder(name, self.devices, model, device, model_prompts(name, path))
        self.devices.report["embed_device"] = device
        return self._embedder

    def _bundled_default(self, why: ModelUnavailable) -> tuple[str, str]:
        """The embedded default: when the default embedder cannot be had and a bundled model's package is installed,
        import it (once, with one line on stderr) and use it. A model the user named is never replaced."""
        spec = next((s for s in BUNDLED_MODELS.values() if _installed_member(s) is not None), None)
        switched_off = os.environ.get("KB_AUTO_IMPORT", "1").strip().lower() in ("0", "off", "no", "false")
        if os.environ.get("KB_EMBED_MODEL", "").strip() or spec is None or switched_off:
            raise why
        print(
            f"kb-engine: {self.embed_name} is not available ({_short_error(why)}); importing "
            f"{spec.folder} from the installed {spec.package} package (once, about half a minute)",
            file=sys.stderr,
            flush=True,
        )
        try:
            reply = import_bundled_model(spec.package)
        except KBError as exc:
            raise ModelUnavailable(
                f"{why}; importing {spec.folder} from {spec.package} failed too: {exc.message}"
            ) from None
        self._default_embed = spec.folder
        self.auto_imported = {
            "model": spec.folder,
            "package": f"{spec.package} {spec.version}",
            "path": reply["path"],
            "instead_of": DEFAULT_EMBED_MODEL,
            "why": _short_error(why),
        }
        return spec.folder, reply["path"]

    def _sentence_encoder(self, path: str, device: str):
        """A sentence encoder on the backend KB_EMBED_BACKEND asks for (the device report says which ran)."""
        model, note = load_sentence_encoder(path, device, backend=embed_backend_setting())
        report = self.devices.report
        if isinstance(model, OnnxSentenceEncoder):
            report["embed_backend"] = f"onnx {model.precision}"
            report["embed_precision_reason"] = model.choice.get("reason")
            report["embed_threads"] = model.threads
        else:
            report["embed_backend"] = "torch"
            if isinstance(model, PlainSentenceEncoder):  # torch is loaded by now, so the AMX probe is free
                model.cpu_bf16, report["cpu_bf16_reason"] = cpu_bf16_wanted()
                report["cpu_bf16"] = model.cpu_bf16
        if note:
            report["embed_backend_note"] = note
        return model

    def reranker(self, may_download: bool = False):
        """The cross-encoder, else the configured bi-encoder fallback; raises ModelUnavailable."""
        name = self.rerank_name
        current = self._reranker
        if current is not None:
            upgrade = isinstance(current, BiEncoderReranker) and local_model_path(name) is not None
            if current.name == name or (isinstance(current, BiEncoderReranker) and not upgrade):
                return current
            self._reranker = None
        try:
            path = self._path(name, may_download)
            device = self.devices.device()
            from sentence_transformers import CrossEncoder

            try:
                model = CrossEncoder(path, device=device, local_files_only=True)
            except Exception as exc:
                if device == "cpu" or not is_device_error(exc):
                    raise
                device = "cpu"
                model = CrossEncoder(path, device=device, local_files_only=True)
            self._reranker = Reranker(name, self.devices, model, device)
            self.devices.report["rerank_device"] = device
            return self._reranker
        except Exception as exc:
            primary = str(exc) if isinstance(exc, ModelUnavailable) else f"{type(exc).__name__}: {_short_error(exc)}"
        fallback = self.rerank_fallback_name
        if fallback:
            try:
                path = self._path(fallback, may_download)
                device = self.devices.device()
                model = self._sentence_encoder(path, device)
                self._reranker = BiEncoderReranker(
                    Embedder(fallback, self.devices, model, device, model_prompts(fallback, path))
                )
                return self._reranker
            except Exception as exc:
                primary += f"; fallback {fallback}: {exc}"
        raise ModelUnavailable(f"no reranker: {primary}")

    def start_background_download(self, name: str) -> None:
        """Let a later query find the model, without making this one wait."""
        if not offline_mode() and not is_local_model(name) and local_model_path(name) is None:
            try:
                self.downloads.fetch(name, 0.0)
            except ModelUnavailable:
                pass

    def device_report(self) -> dict:
        report = dict(self.devices.report) or {"requested": self.devices.requested, "probe": None}
        report["batch"] = {
            role: getattr(model, "batch", None)
            for role, model in (("embed", self._embedder), ("rerank", self._reranker))
            if model is not None
        }
        for role, model in (("embed_device", self._embedder), ("rerank_device", self._reranker)):
            if model is not None:
                report[role] = model.device
            if model is not None and getattr(model, "note", None):
                report["note"] = model.note
        if self._embedder is not None and self._embedder.refused:
            report["embed_refused"] = self._embedder.refused
        return report
