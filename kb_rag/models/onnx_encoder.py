"""ONNX encoder: the same BERT written as an ONNX graph, int8 chosen by measurement, ONNX Runtime runner.

May import: config, models.native, models.runtime, storage.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..config import __version__, _short_error, kb_cache_dir
from ..models.native import (
    NATIVE_BERT_ACTIVATIONS,
    NativeBertTokenizer,
    PlainSentenceEncoder,
    bert_folder_setup,
    plain_sentence_layout,
)
from ..models.runtime import UNRELATED_PROBES
from ..storage import _write_atomically

# On a CPU the torch forward pass above leaves most of the machine idle: its float32 products reach about half the
# measured peak, and importing torch costs a one-shot search over 2 s. The engine writes the BERT encoder as an
# ONNX graph itself (a few dozen nodes; the protobuf wire format is a handful of rules, so no onnx package and no
# torch is needed), once per model folder, and runs it on ONNX Runtime:
#   * int8 products with per-column weight scales (ONNX Runtime's DynamicQuantizeMatMul) where they agree with
#     float32 on the probe passages and are faster, measured on this machine when the graph is first built;
#   * batches of passages with exactly the same token count, so nothing is padded and attention needs no mask;
#   * one single-threaded run per core at a time, which scales better on a few cores than one run over all of them.
# docs/PERFORMANCE.md ("Embedding speed") has the figures; KB_EMBED_BACKEND=torch keeps the torch path.

EMBED_BACKENDS = ("auto", "onnx", "torch")
ONNX_PRECISIONS = ("auto", "int8", "fp32")
ONNX_GRAPH_REVISION = 5  # bumped when the graph changes: cached graphs of an older revision are rebuilt
ONNX_TOKEN_BUDGET = 4096  # tokens per run: enough rows to keep the products efficient, little memory
# An int8 graph is used only when its probe vectors agree this well with float32, measured on the model's own
# scale (1 - (1 - cosine) / (1 - the mean cosine of unrelated passages)): e5's cosines are bunched high, so the same
# cosine error moves its rankings about four times as far as MiniLM's. Measured here with the first and last
# tokens in float32 for two products per layer: MiniLM 0.996, e5-small 0.994, both within 0.005 of float32 on
# SciFact and the full-text questions; with every product int8, e5-small measured 0.982 and lost 0.010 there.
INT8_MIN_MEAN_AGREEMENT = 0.985
INT8_MIN_AGREEMENT = 0.98  # ... and none of them falls below this
INT8_MIN_SPEEDUP = 1.15  # ... and it is at least this much faster here
# Probe passages for the precision check: a scientific register at the lengths passages have.
PRECISION_PROBES = tuple(
    f"{a} {b}"
    for a, b in zip(
        UNRELATED_PROBES,
        (
            "We measured the thermal conductivity of the annealed samples between 10 and 300 K and found a peak near "
            "40 K, which we attribute to boundary scattering of phonons at the grain interfaces.",
            "Patients randomised to the intervention arm showed a lower incidence of the primary outcome (hazard ratio "
            "0.78, 95% confidence interval 0.64 to 0.95) over a median follow-up of 3.2 years.",
            "The proposed estimator is consistent under weak dependence, and its asymptotic variance can be computed "
            "from the spectral density of the residual process at frequency zero.",
            "Transcription of the reporter gene increased fourfold after knockdown of the repressor, indicating that "
            "the promoter is under negative control in the wild-type strain.",
            "Our model attends over the retrieved passages and is trained end to end with a contrastive loss on "
            "question and answer pairs mined from citation contexts.",
            "Sediment cores from the lake record three abrupt shifts in diatom assemblages during the Holocene, each "
            "coinciding with a decline in summer temperature.",
            "Under uniaxial compression the foam deforms elastically up to a strain of 5%, followed by a plateau in "
            "which the cell walls buckle progressively.",
            "The survey weights were calibrated to census margins for age, sex and region, and standard errors were "
            "estimated with 200 bootstrap replicates.",
            "Density functional calculations predict a band gap of 1.4 eV for the strained monolayer, in agreement "
            "with the photoluminescence peak we observe.",
            "A second cohort of 412 children was recruited from primary schools to test whether the association "
            "persisted after adjustment for household income.",
        ),
    )
)


def embed_backend_setting() -> str:
    """``KB_EMBED_BACKEND``: auto (default), onnx or torch; anything else reads as auto."""
    value = os.environ.get("KB_EMBED_BACKEND", "auto").strip().lower()
    return value if value in EMBED_BACKENDS else "auto"


def onnx_precision_setting() -> str:
    value = os.environ.get("KB_EMBED_PRECISION", "auto").strip().lower()
    return value if value in ONNX_PRECISIONS else "auto"


def embed_threads() -> int:
    """Concurrent single-threaded runs: ``KB_EMBED_THREADS``, else the CPUs this process may use."""
    configured = os.environ.get("KB_EMBED_THREADS", "").strip()
    if configured.isdigit() and int(configured) > 0:
        return min(int(configured), 64)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def onnx_runtime_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("onnxruntime") is not None


def _pb_varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64 values go out as their two's complement, as protobuf does
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _pb_int(field_number: int, value: int) -> bytes:
    return _pb_varint(field_number << 3) + _pb_varint(int(value))


def _pb_bytes(field_number: int, data: bytes | str) -> bytes:
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    return _pb_varint((field_number << 3) | 2) + _pb_varint(len(raw)) + raw


def _pb_float(field_number: int, value: float) -> bytes:
    return _pb_varint((field_number << 3) | 5) + struct.pack("<f", value)


class OnnxGraph:
    """An ONNX model written field by field (onnx.proto: ModelProto, GraphProto, NodeProto, TensorProto)."""

    ELEMENT_TYPES = {"float32": 1, "uint8": 2, "int8": 3, "int32": 6, "int64": 7, "float16": 10}
    OPSETS = (("", 17), ("com.microsoft", 1))  # LayerNormalization needs 17; the contrib ops are version 1

    def __init__(self):
        self.nodes: list[bytes] = []
        self.initializers: list[bytes] = []
        self._count = 0

    def constant(self, name: str, array) -> str:
        import numpy as np

        array = np.ascontiguousarray(array)
        tensor = (
            b"".join(_pb_int(1, d) for d in array.shape)
            + _pb_int(2, self.ELEMENT_TYPES[array.dtype.name])
            + _pb_bytes(8, name)
            + _pb_bytes(9, array.tobytes())
        )
        self.initializers.append(_pb_bytes(5, tensor))
        return name

    @staticmethod
    def _attribute(name: str, value) -> bytes:
        if isinstance(value, float):  # AttributeProto: f=2, i=3, ints=8; type FLOAT=1, INT=2, INTS=7
            return _pb_bytes(1, name) + _pb_float(2, value) + _pb_int(20, 1)
        if isinstance(value, int):
            return _pb_bytes(1, name) + _pb_int(3, value) + _pb_int(20, 2)
        return _pb_bytes(1, name) + b"".join(_pb_int(8, v) for v in value) + _pb_int(20, 7)

    def node(self, op: str, inputs: list[str], outputs: int = 1, domain: str = "", **attributes) -> Any:
        """Add a node; its output name (a list of them for ``outputs`` > 1). An input "" is an absent optional."""
        self._count += 1
        names = [f"{op}_{self._count}" + (f"_{i}" if outputs > 1 else "") for i in range(outputs)]
        body = (
            b"".join(_pb_bytes(1, i) for i in inputs)
            + b"".join(_pb_bytes(2, o) for o in names)
            + _pb_bytes(3, names[0])
            + _pb_bytes(4, op)
            + b"".join(_pb_bytes(5, self._attribute(k, v)) for k, v in attributes.items())
            + (_pb_bytes(7, domain) if domain else b"")
        )
        self.nodes.append(_pb_bytes(1, body))
        return names[0] if outputs == 1 else names

    @classmethod
    def _value(cls, name: str, element: str, dims: list) -> bytes:
        shape = b"".join(_pb_bytes(1, _pb_bytes(2, d) if isinstance(d, str) else _pb_int(1, d)) for d in dims)
        tensor_type = _pb_int(1, cls.ELEMENT_TYPES[element]) + _pb_bytes(2, shape)
        return _pb_bytes(1, name) + _pb_bytes(2, _pb_bytes(1, tensor_type))

    def model(self, inputs: list[tuple[str, str, list]], outputs: list[tuple[str, str, list]]) -> bytes:
        graph = (
            b"".join(self.nodes)
            + _pb_bytes(2, "kb-rag-encoder")
            + b"".join(self.initializers)
            + b"".join(_pb_bytes(11, self._value(*i)) for i in inputs)
            + b"".join(_pb_bytes(12, self._value(*o)) for o in outputs)
        )
        opsets = b"".join(_pb_bytes(8, _pb_bytes(1, domain) + _pb_int(2, version)) for domain, version in self.OPSETS)
        return _pb_int(1, 8) + _pb_bytes(2, "kb-rag") + _pb_bytes(3, __version__) + _pb_bytes(7, graph) + opsets


SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def _safetensors_header(path: str) -> tuple[dict, int]:
    """A safetensors file's header (tensor name -> dtype, shape, offsets) and where its data starts."""
    with open(path, "rb") as handle:
        size = struct.unpack("<Q", handle.read(8))[0]
        if size > 100 * 2**20:
            raise ValueError(f"{path}: safetensors header of {size} bytes")
        header = json.loads(handle.read(size))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file")
    return header, 8 + size


def read_safetensors(path: str, only: set[str] | None = None) -> dict:
    """A safetensors file's floating-point tensors (keys without a ``bert.`` prefix) as numpy arrays mapped from
    the file, without torch; bfloat16 is widened to float32 (numpy has no bfloat16)."""
    import numpy as np

    header, start_of_data = _safetensors_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name, info in header.items():
        key = name[5:] if name.startswith("bert.") else name
        if name == "__metadata__" or info.get("dtype") not in SAFETENSORS_DTYPES or (only and key not in only):
            continue
        start, end = (start_of_data + offset for offset in info["data_offsets"])
        kind = SAFETENSORS_DTYPES[info["dtype"]]
        if kind == "bfloat16":
            array = (data[start:end].view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            array = data[start:end].view(kind)
        tensors[key] = array.reshape(info["shape"])
    return tensors


# Weights use 7 of int8's bits: CPUs without VNNI multiply uint8 activations by int8 weights in pairs summed to
# int16, which saturates at full range (255 * 127 * 2 > 32767); at 63 it cannot, and on this machine the lowest
# cosine to float32 over 256 passages went from 0.983 to 0.990.
INT8_WEIGHT_TOP = 63


def quantize_columns(weight) -> tuple:
    """int8 weights and one float32 scale per output column (symmetric: a column's largest value is 63)."""
    import numpy as np

    scale = np.abs(weight).max(axis=0) / INT8_WEIGHT_TOP
    scale[scale == 0] = 1.0
    return np.clip(np.rint(weight / scale), -INT8_WEIGHT_TOP, INT8_WEIGHT_TOP).astype(np.int8), scale.astype(np.float32)


def bert_onnx_graph(setup: dict, precision: str) -> bytes:
    """The folder's BERT encoder (last hidden states of the rows' word vectors) as an ONNX model, float32 or int8.

    The graph mirrors ``NativeBert``: absolute positions, token type 0 (one text per row), post-norm layers. It
    takes the rows' word vectors, looked up by the runner in the weights file mapped into memory (a multilingual
    table is 190 MB that a graph would copy at every load), and rows of equal length only (the runner never
    pads), so attention has no mask."""
    import numpy as np

    config = setup["config"]
    weights = read_safetensors(setup["weights_file"])
    hidden, heads, layers = (
        int(config["hidden_size"]),
        int(config["num_attention_heads"]),
        int(config["num_hidden_layers"]),
    )
    eps = float(config.get("layer_norm_eps", 1e-12))
    gelu = "Gelu" if NATIVE_BERT_ACTIVATIONS[config["hidden_act"]] == "none" else "FastGelu"  # erf / tanh
    g = OnnxGraph()

    def tensor(name: str) -> Any:
        if name not in weights:
            raise ValueError(f"not a BERT checkpoint: {name} missing")
        return np.asarray(weights[name], np.float32)

    def linear(x: str, name: str, weight, bias, exact_ends: bool = False) -> str:
        columns = np.ascontiguousarray(weight.T)  # torch keeps [out, in]; MatMul wants [in, out]
        if precision != "int8":
            return g.node(
                "Add", [g.node("MatMul", [x, g.constant(f"{name}.w", columns)]), g.constant(f"{name}.b", bias)]
            )
        q, scale = quantize_columns(columns)
        if not exact_ends:
            return g.node(
                "DynamicQuantizeMatMul",
                [x, g.constant(f"{name}.q", q), g.constant(f"{name}.s", scale), "", g.constant(f"{name}.b", bias)],
                domain="com.microsoft",
            )
        # The first and last tokens ([CLS]/<s>, [SEP]/</s>) carry activations ten times any other token's in a
        # channel or two (most of all in the feed-forward output's input); one scale for the whole batch would
        # then leave the other tokens a few steps of resolution. They take the float32 product, the rest the int8
        # one. Done for the feed-forward output and the query/key/value product, e5-small's agreement on the
        # model's scale rose from 0.984 to 0.995, for about a tenth of int8's speed. A row of two tokens leaves
        # the int8 product an empty middle, which ONNX Runtime handles.
        middle = g.node(
            "Slice",
            [
                x,
                g.constant(f"{name}.from", np.array([1], np.int64)),
                g.constant(f"{name}.to", np.array([-1], np.int64)),
                "axis1",
            ],
        )
        ends = g.node(
            "Concat",
            [g.node("Slice", [x, "zero", "one", "axis1"]), g.node("Slice", [x, "minus_one", "end", "axis1"])],
            axis=1,
        )
        exact = g.node(
            "Add", [g.node("MatMul", [ends, g.constant(f"{name}.w", columns)]), g.constant(f"{name}.b", bias)]
        )
        first, last = g.node("Split", [exact], outputs=2, axis=1)
        rest = g.node(
            "DynamicQuantizeMatMul",
            [middle, g.constant(f"{name}.q", q), g.constant(f"{name}.s", scale), "", g.constant(f"{name}.b", bias)],
            domain="com.microsoft",
        )
        return g.node("Concat", [first, rest, last], axis=1)

    def norm(x: str, name: str) -> str:
        return g.node(
            "LayerNormalization",
            [x, g.constant(f"{name}.g", tensor(f"{name}.weight")), g.constant(f"{name}.b", tensor(f"{name}.bias"))],
            axis=-1,
            epsilon=eps,
        )

    length = g.node("Shape", ["words"], start=1, end=2)
    positions = g.node(
        "Slice",
        [
            g.constant("positions", tensor("embeddings.position_embeddings.weight")),
            g.constant("zero", np.array([0], np.int64)),
            length,
            g.constant("axis0", np.array([0], np.int64)),
        ],
    )
    for name, value in (("one", 1), ("minus_one", -1), ("end", 2**62), ("axis1", 1)):  # token slices
        g.constant(name, np.array([value], np.int64))
    x = g.node(
        "Add",
        [
            g.node("Add", ["words", positions]),
            g.constant("type0", tensor("embeddings.token_type_embeddings.weight")[0]),
        ],
    )
    x = norm(x, "embeddings.LayerNorm")
    for i in range(layers):
        at = f"encoder.layer.{i}."
        qkv = [f"{at}attention.self.{n}" for n in ("query", "key", "value")]
        fused = linear(
            x,
            f"{at}qkv",
            np.concatenate([tensor(f"{n}.weight") for n in qkv]),
            np.concatenate([tensor(f"{n}.bias") for n in qkv]),
            exact_ends=True,
        )
        q, k, v = g.node("Split", [fused], outputs=3, axis=2)
        context = g.node("MultiHeadAttention", [q, k, v], domain="com.microsoft", num_heads=heads)
        attended = linear(
            context,
            f"{at}attention.output.dense",
            tensor(f"{at}attention.output.dense.weight"),
            tensor(f"{at}attention.output.dense.bias"),
        )
        x = norm(g.node("Add", [attended, x]), f"{at}attention.output.LayerNorm")
        inner = g.node(
            gelu,
            [
                linear(
                    x,
                    f"{at}intermediate.dense",
                    tensor(f"{at}intermediate.dense.weight"),
                    tensor(f"{at}intermediate.dense.bias"),
                )
            ],
            domain="com.microsoft",
        )
        out = linear(
            inner,
            f"{at}output.dense",
            tensor(f"{at}output.dense.weight"),
            tensor(f"{at}output.dense.bias"),
            exact_ends=True,
        )
        x = norm(g.node("Add", [out, x]), f"{at}output.LayerNorm")
    return g.model([("words", "float32", ["rows", "length", hidden])], [(x, "float32", ["rows", "length", hidden])])


WORD_TABLE = "embeddings.word_embeddings.weight"


def _folder_stamp(setup: dict) -> str:
    """What identifies a model folder's weights for the graph cache: path, size and mtime of the weights file."""
    st = os.stat(setup["weights_file"])
    key = json.dumps([os.path.abspath(setup["weights_file"]), st.st_size, st.st_mtime_ns, ONNX_GRAPH_REVISION])
    return hashlib.sha256(key.encode()).hexdigest()[:20]


def onnx_cache_dir() -> Path:
    return kb_cache_dir() / "onnx"


def _onnx_session(model: bytes | str):
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1  # the runner runs one batch per core at a time
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])


class OnnxSentenceEncoder:
    """A plain BERT sentence encoder on ONNX Runtime, with the surface the engine uses (as PlainSentenceEncoder).

    Texts are tokenized once, grouped by exact token count and run in batches of up to ONNX_TOKEN_BUDGET tokens,
    one batch per core at a time; a batch never carries padding."""

    runtime = "onnx"
    plans_batches = True  # the Embedder hands it every text at once; it batches them itself

    def __init__(self, folder: str, layout: dict, setup: dict, precision: str | None = None):
        self.layout = layout
        self.device = "cpu"
        self.max_length = min(
            layout["max_seq_length"],
            setup["model_max_length"],
            int(setup["config"].get("max_position_embeddings") or 512),
        )
        self.tokenizer = NativeBertTokenizer(setup, self.max_length)
        self.hidden_size = int(setup["config"]["hidden_size"])
        self.threads = embed_threads()
        words = read_safetensors(setup["weights_file"], {WORD_TABLE}).get(WORD_TABLE)
        if words is None or words.ndim != 2 or words.shape[1] != self.hidden_size:
            raise ValueError(f"not a BERT checkpoint: {WORD_TABLE} missing or misshapen")
        self.words = words
        self.session: Any = None  # the measurement leaves the chosen one loaded
        self.precision, self.choice = self._choose(setup, precision or onnx_precision_setting())
        if self.session is None:
            self.session = _onnx_session(str(self._graph_path(setup, self.precision)))

    # -- the cached graphs and the precision measured for them -----------------------------------------------
    @staticmethod
    def _graph_path(setup: dict, precision: str) -> Path:
        return onnx_cache_dir() / f"{_folder_stamp(setup)}-{precision}.onnx"

    def _graph(self, setup: dict, precision: str) -> Path:
        path = self._graph_path(setup, precision)
        if not path.is_file():
            _write_atomically(path, bert_onnx_graph(setup, precision))
        return path

    def _choose(self, setup: dict, wanted: str) -> tuple[str, dict]:
        """The precision to run: the one asked for, else the one measured best here (measured once per folder)."""
        if wanted in ("int8", "fp32"):
            self._graph(setup, wanted)
            return wanted, {"precision": wanted, "reason": "KB_EMBED_PRECISION"}
        record = onnx_cache_dir() / f"{_folder_stamp(setup)}-choice.json"
        try:
            choice = json.loads(record.read_text(encoding="utf-8"))
            if choice.get("precision") in ("int8", "fp32") and self._graph_path(setup, choice["precision"]).is_file():
                return choice["precision"], choice
        except (OSError, ValueError, AttributeError):
            pass
        choice = self._measure(setup)
        _write_atomically(record, json.dumps(choice, indent=1).encode())
        unused = self._graph_path(setup, "fp32" if choice["precision"] == "int8" else "int8")
        try:
            unused.unlink()  # rebuilt in seconds should KB_EMBED_PRECISION ask for it
        except OSError:
            pass
        return choice["precision"], choice

    def _measure(self, setup: dict) -> dict:
        import numpy as np

        sessions = {p: _onnx_session(str(self._graph(setup, p))) for p in ("fp32", "int8")}
        best = dict.fromkeys(sessions, math.inf)
        vectors = {}
        for _ in range(3):  # interleaved rounds, the fastest of each: other work on the machine evens out
            for precision, session in sessions.items():
                self.session = session
                started = time.perf_counter()
                vectors[precision] = self.encode(list(PRECISION_PROBES))
                best[precision] = min(best[precision], time.perf_counter() - started)
        exact = vectors["fp32"]
        cosines = np.sum(exact * vectors["int8"], axis=1)
        # on the model's own scale: how far int8 moves a vector, against how far apart unrelated passages are
        pairs = (exact @ exact.T)[~np.eye(len(exact), dtype=bool)]
        spread = max(1.0 - float(pairs.mean()), 1e-3)
        relative = 1.0 - (1.0 - cosines) / spread
        mean, low = float(relative.mean()), float(relative.min())
        speedup = best["fp32"] / max(best["int8"], 1e-9)
        agrees = mean >= INT8_MIN_MEAN_AGREEMENT and low >= INT8_MIN_AGREEMENT
        precision = "int8" if agrees and speedup >= INT8_MIN_SPEEDUP else "fp32"
        self.session = sessions[precision]
        measured = f"agreement {mean:.4f}, lowest {low:.4f}, on the model's scale"
        reason = (
            f"int8 agrees with float32 ({measured}) and runs {speedup:.2f}x as fast here"
            if precision == "int8"
            else f"int8 {f'is only {speedup:.2f}x as fast' if agrees else 'moves the vectors too far'} ({measured})"
        )
        return {
            "precision": precision,
            "reason": reason,
            "int8_agreement": round(mean, 5),
            "int8_lowest_agreement": round(low, 5),
            "int8_mean_cosine": round(float(cosines.mean()), 5),
            "int8_lowest_cosine": round(float(cosines.min()), 5),
            "int8_speedup": round(speedup, 3),
            "measured": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "threads": self.threads,
        }

    # -- the surface the Embedder uses -------------------------------------------------------------------------
    def to(self, device: str) -> OnnxSentenceEncoder:
        return self

    def get_sentence_embedding_dimension(self) -> int:
        return self.hidden_size

    def _batches(self, lengths: list[int]) -> list[list[int]]:
        """Row indexes grouped by token count, longest first, each group cut to the token budget (and into at
        least one batch per core when it is the only group)."""
        groups: dict[int, list[int]] = {}
        for row, n in enumerate(lengths):
            groups.setdefault(n, []).append(row)
        batches: list[list[int]] = []
        for n, rows in sorted(groups.items(), reverse=True):
            per = max(1, ONNX_TOKEN_BUDGET // max(n, 1))
            if len(groups) == 1:
                per = max(1, min(per, -(-len(rows) // self.threads)))
            batches.extend(rows[i : i + per] for i in range(0, len(rows), per))
        return batches

    def encode(
        self, texts: list[str], batch_size: int = 32, normalize_embeddings: bool = True, prompt: str = "", **_ignored
    ):
        import numpy as np

        prepared = [(prompt + str(t)).strip() for t in texts]
        if self.layout["lower_case"]:
            prepared = [t.lower() for t in prepared]
        ids = self.tokenizer.encode_ids(prepared)
        out: Any = np.zeros((len(texts), self.hidden_size), dtype=np.float32)
        if not texts:
            return out

        def run(rows: list[int]):
            batch = np.array([ids[r] for r in rows], dtype=np.int64)
            words = self.words[batch].astype(np.float32)
            return rows, self._pool(self.session.run(None, {"words": words})[0])

        batches = self._batches([len(i) for i in ids])
        if self.threads == 1 or len(batches) == 1:
            results: Iterable = map(run, batches)
        else:
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kb-onnx")
            results = list(pool.map(run, batches))
            pool.shutdown()
        for rows, pooled in results:
            out[rows] = pooled
        if normalize_embeddings or self.layout["normalize"]:
            norms = np.linalg.norm(out, axis=1, keepdims=True)
            out = out / np.where(norms > 0, norms, 1.0)
        return out

    def _pool(self, hidden):
        """Pooling over rows without padding: every token counts."""
        mode = self.layout["pooling"]
        if mode == "cls_token":
            return hidden[:, 0]
        if mode == "max_tokens":
            return hidden.max(axis=1)
        summed = hidden.sum(axis=1)
        return summed / (hidden.shape[1] ** 0.5 if mode == "mean_sqrt_len_tokens" else hidden.shape[1])


def onnx_encoder_for(folder: str, layout: dict | None = None) -> OnnxSentenceEncoder | None:
    """An ONNX Runtime encoder for the folder when it is a plain BERT sentence model and ONNX Runtime is
    installed, else None (torch runs it)."""
    layout = layout or plain_sentence_layout(folder)
    setup = bert_folder_setup(folder) if layout is not None else None
    if layout is None or setup is None or not onnx_runtime_available():
        return None
    return OnnxSentenceEncoder(folder, layout, setup)


def load_sentence_encoder(folder: str, device: str, cpu_bf16: bool = False, backend: str = "auto"):
    """The fastest faithful loader for a sentence-embedding folder, and a note when the backend asked for could
    not serve it. On the CPU a plain BERT runs on ONNX Runtime (``backend`` auto or onnx); torch runs it on a GPU,
    with KB_EMBED_BACKEND=torch, and for every model the ONNX graph does not cover."""
    layout = plain_sentence_layout(folder) if os.environ.get("KB_PLAIN_ENCODER", "1") != "0" else None
    note = None
    if backend in ("auto", "onnx") and device == "cpu" and layout is not None:
        try:
            encoder = onnx_encoder_for(folder, layout)
        except Exception as exc:  # a graph ONNX Runtime refuses, an unwritable cache: torch still works
            encoder, note = (
                None,
                f"ONNX Runtime could not run this model ({type(exc).__name__}: {_short_error(exc)}); torch runs it",
            )
        if encoder is not None:
            return encoder, None
        if note is None and backend == "onnx":
            note = (
                "KB_EMBED_BACKEND=onnx, but "
                + (
                    "onnxruntime is not installed"
                    if not onnx_runtime_available()
                    else "this model is not a plain BERT sentence encoder"
                )
                + "; torch runs it"
            )
    elif backend == "onnx":
        note = (
            "KB_EMBED_BACKEND=onnx, but "
            + (
                "the model runs on " + device
                if device != "cpu"
                else "this model is not a plain transformer + pooling folder"
            )
            + "; torch runs it"
        )
    if layout is not None:
        return PlainSentenceEncoder(folder, layout, device, cpu_bf16), note
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(folder, device=device, local_files_only=True), note
