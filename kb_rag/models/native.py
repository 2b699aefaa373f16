"""Native encoder: BERT tokenizers (a piece table for large vocabularies) and a pure-torch BERT encoder.

May import: config, models.runtime, storage.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
from pathlib import Path
from typing import Any

from ..config import kb_cache_dir
from ..models.runtime import POOLING_MODES, SENTENCE_MODULES
from ..storage import _new_temporary


def plain_sentence_layout(folder: str) -> dict | None:
    """The folder's pooling setup when it is a plain transformer + pooling (+ normalise) model, else None.

    Importing sentence-transformers costs seconds more than transformers alone (it pulls in scikit-learn and
    more), and every one-shot search and first ingest pays it. The common layout is three modules whose maths is
    a few lines, so the engine runs those itself and leaves anything else to sentence-transformers.
    """
    root = Path(folder)
    try:
        modules = json.loads((root / "modules.json").read_text(encoding="utf-8"))
        settings = json.loads((root / "sentence_bert_config.json").read_text(encoding="utf-8"))
        extras = root / "config_sentence_transformers.json"
        st_config = json.loads(extras.read_text(encoding="utf-8")) if extras.exists() else {}
    except (OSError, ValueError):
        return None
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules if isinstance(m, dict)]
    if (
        len(kinds) != len(modules)
        or not set(kinds) <= SENTENCE_MODULES
        or kinds[:2] != ["Transformer", "Pooling"]
        or not isinstance(st_config, dict)
        or not isinstance(settings, dict)
    ):
        return None
    if modules[0].get("path", "") not in ("", "."):
        return None
    try:
        pooling = json.loads((root / modules[1]["path"] / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError):
        return None
    chosen = [mode for mode in POOLING_MODES if pooling.get(f"pooling_mode_{mode}")]
    others = [k for k, v in pooling.items() if k.startswith("pooling_mode_") and v and k[13:] not in POOLING_MODES]
    named = pooling.get("pooling_mode")  # the format newer sentence-transformers releases save
    if isinstance(named, str) and not chosen and not others:
        chosen = [
            mode for mode in POOLING_MODES if mode == named or mode == f"{named}_token" or mode == f"{named}_tokens"
        ]
    if len(chosen) != 1 or others or pooling.get("include_prompt") is False:
        return None
    return {
        "pooling": chosen[0],
        "normalize": "Normalize" in kinds,
        "max_seq_length": int(settings.get("max_seq_length") or 512),
        "lower_case": bool(settings.get("do_lower_case")),
    }


def cpu_bf16_wanted() -> tuple[bool, str]:
    """Whether the plain encoder runs its matrix products in bfloat16 on the CPU, and why.

    ``KB_CPU_BF16``: ``auto`` (default) only where the CPU has AMX tiles, whose bfloat16 products made MiniLM
    encode 2.4x faster here with vectors within cosine 0.9999 of float32 (docs/PERFORMANCE.md); ``1`` always
    (slow on CPUs without bfloat16 instructions); ``0`` never. Pooling and normalisation stay in float32."""
    setting = os.environ.get("KB_CPU_BF16", "auto").strip().lower()
    if setting in ("0", "off", "no", "false"):
        return False, "KB_CPU_BF16=0"
    if setting in ("1", "on", "yes", "true"):
        return True, "KB_CPU_BF16=1"
    try:
        import torch

        amx = bool(torch.cpu._is_amx_tile_supported())
    except Exception:  # an older torch without the probe: stay in float32
        amx = False
    return (True, "the CPU has AMX (bfloat16 matrix tiles)") if amx else (False, "the CPU has no AMX")


# BERT activations the native runner computes exactly as transformers does (name -> F.gelu's approximate=)
NATIVE_BERT_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


def native_bert_setup(folder: str) -> dict | None:
    """What the native BERT runner needs from a model folder, or None when the folder is not a plain BERT it
    reproduces exactly (then transformers runs it).

    Importing transformers' model code costs about 3 s of every cold load (``modeling_utils`` and what it pulls
    in), more than reading the weights. A BERT encoder is a few dozen lines of torch, so for the common case
    (absolute positions, a GELU, safetensors weights, a ``tokenizer.json`` whose normaliser agrees with the
    tokenizer config) the engine runs it itself. ``KB_NATIVE_BERT=0`` always uses transformers."""
    if os.environ.get("KB_NATIVE_BERT", "1").strip().lower() in ("0", "off", "no", "false"):
        return None
    return bert_folder_setup(folder)


def tokenizer_normalizer(path: Path) -> Any:
    """The ``normalizer`` of a ``tokenizer.json`` ({} for none). A multilingual vocabulary makes the file 17 MB,
    and parsing all of it costs a one-shot call half a second, so only the normalizer's own value is decoded: the
    top-level key comes before the vocabulary (whose pieces could spell it) in every file the tokenizers library
    writes. A file where it cannot be found that way is parsed whole."""
    with open(path, "rb") as handle:
        head = handle.read(1 << 20).decode("utf-8", errors="ignore")  # a piece cut at the end is ignored
    found = re.search(r'"normalizer"\s*:\s*', head)
    if found is not None:
        try:
            value, _ = json.JSONDecoder().raw_decode(head, found.end())
            if value is None or isinstance(value, dict):
                return value or {}
        except ValueError:  # the value runs past the first MiB: read the whole file
            pass
    whole = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(whole, dict):
        raise ValueError("tokenizer.json is not an object")
    return whole.get("normalizer") or {}


def bert_folder_setup(folder: str) -> dict | None:
    """What a BERT runner of the engine's own (torch or ONNX) needs from a model folder, or None when the folder is
    not a plain BERT it reproduces exactly."""
    root = Path(folder)
    try:
        config = json.loads((root / "config.json").read_text(encoding="utf-8"))
        tokenizer_config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
        normalizer = tokenizer_normalizer(root / "tokenizer.json")
    except (OSError, ValueError):
        return None
    if not (isinstance(config, dict) and isinstance(tokenizer_config, dict) and isinstance(normalizer, dict)):
        return None
    if (
        config.get("model_type") != "bert"
        or config.get("is_decoder")
        or config.get("add_cross_attention")
        or config.get("position_embedding_type", "absolute") != "absolute"
        or config.get("hidden_act") not in NATIVE_BERT_ACTIVATIONS
        or config.get("chunk_size_feed_forward")
        or not (root / "model.safetensors").is_file()
    ):
        return None
    if normalizer.get("type") == "BertNormalizer":  # transformers rebuilds it when the config disagrees
        for config_key, normalizer_key in (
            ("do_lower_case", "lowercase"),
            ("strip_accents", "strip_accents"),
            ("tokenize_chinese_chars", "handle_chinese_chars"),
        ):
            if config_key in tokenizer_config and tokenizer_config[config_key] != normalizer.get(normalizer_key):
                return None
    special = {}
    for name in ("unk_token", "pad_token"):
        value = tokenizer_config.get(name)
        special[name] = value.get("content") if isinstance(value, dict) else value
    if not special["pad_token"]:
        return None
    return {
        "config": config,
        "tokenizer_file": str(root / "tokenizer.json"),
        "weights_file": str(root / "model.safetensors"),
        "unk_token": special["unk_token"],
        "pad_token": special["pad_token"],
        "model_max_length": int(tokenizer_config.get("model_max_length") or 10**6),
    }


PIECE_TABLE_MIN_PIECES = 50_000  # a Unigram vocabulary this large (XLM-R's: 250,002) costs ~1 s to load in full
PIECE_TABLE_MAX_CHARS = 4000  # texts up to this many characters in all tokenize through the piece table
PIECE_TABLE_REVISION = 1


class PieceTable:
    """A large Unigram vocabulary kept in a SQLite file in the cache, read a few pieces at a time.

    Loading XLM-R's 250,002 pieces takes the tokenizers library about a second, more than the rest of a one-shot
    e5 search together. A query can only ever use pieces that are substrings of its own words, so a tokenizer
    built from those pieces (with the full table's scores, special tokens and lowest score, which sets the
    unknown-piece penalty) splits it exactly as the full one; its ids are mapped back to the full vocabulary."""

    def __init__(self, path: Path):
        self.conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        meta = dict(self.conn.execute("SELECT key, value FROM meta"))
        self.skeleton = json.loads(meta["skeleton"])
        self.always = json.loads(meta["always"])  # special, unknown and lowest-scoring pieces' ids
        self.longest = int(meta["longest"])
        self._splitter: Any = None

    @classmethod
    def for_file(cls, tokenizer_file: str) -> PieceTable | None:
        """The file's table (written on first use), or None when its vocabulary is small or of another kind."""
        try:
            st = os.stat(tokenizer_file)
        except OSError:
            return None  # the full load says what is wrong
        if st.st_size < 4 * 1024 * 1024:  # ~20 bytes a piece: too few pieces to matter
            return None
        key = json.dumps([os.path.abspath(tokenizer_file), st.st_size, st.st_mtime_ns, PIECE_TABLE_REVISION])
        path = kb_cache_dir() / "tokenizers" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.sqlite"
        try:
            if not path.is_file():
                cls._write(tokenizer_file, path)
            table = cls(path)
        except (OSError, ValueError, KeyError, TypeError, sqlite3.Error):
            return None
        return table if table.always else None

    @staticmethod
    def _write(tokenizer_file: str, path: Path) -> None:
        with open(tokenizer_file, encoding="utf-8") as fh:
            data = json.load(fh)
        model = data.get("model") or {}
        vocab = model.get("vocab") if model.get("type") == "Unigram" else None
        usable = (
            isinstance(vocab, list)
            and len(vocab) >= PIECE_TABLE_MIN_PIECES
            and not model.get("byte_fallback")
            and _special_ids(data.get("post_processor")) is not None
        )
        always: list[int] = []
        if usable:
            assert isinstance(vocab, list)
            lowest = min(range(len(vocab)), key=lambda i: vocab[i][1])
            always = sorted(
                {t["id"] for t in data.get("added_tokens") or []}
                | {int(model["unk_id"]), lowest}
                | set(_special_ids(data["post_processor"]) or ())
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = _new_temporary(path)  # SQLite fills the new empty file, then it is renamed into place
        os.close(handle)
        conn = sqlite3.connect(temporary)
        try:
            conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
            conn.execute("CREATE TABLE pieces (piece TEXT PRIMARY KEY, id INTEGER, score REAL) WITHOUT ROWID")
            if usable:
                assert isinstance(vocab, list)
                conn.executemany(
                    "INSERT OR IGNORE INTO pieces VALUES (?, ?, ?)",
                    ((piece, i, score) for i, (piece, score) in enumerate(vocab)),
                )
                conn.execute("CREATE INDEX pieces_id ON pieces (id)")
                data["model"] = {**model, "vocab": []}
            conn.executemany(
                "INSERT INTO meta VALUES (?, ?)",
                (
                    ("skeleton", json.dumps(data if usable else {})),
                    ("always", json.dumps(always)),
                    ("longest", str(max((len(p) for p, _ in vocab), default=0) if usable and vocab else 0)),
                ),
            )
            conn.commit()
            conn.close()
            os.replace(temporary, path)
        finally:
            conn.close()
            temporary.unlink(missing_ok=True)

    def _tokenizer(self, ids: set[int], max_length: int) -> tuple[Any, list[int]]:
        """A tokenizer over these pieces (and the ones always kept), and the full id of each of its ids."""
        from tokenizers import Tokenizer

        keep = sorted(ids | set(self.always))
        scores: dict[int, tuple[str, float]] = {}
        for at in range(0, len(keep), 500):
            part = keep[at : at + 500]
            scores.update(
                (i, (piece, score))
                for piece, i, score in self.conn.execute(
                    f"SELECT piece, id, score FROM pieces WHERE id IN ({','.join('?' * len(part))})", part
                )
            )
        keep = [i for i in keep if i in scores]
        local = {full: at for at, full in enumerate(keep)}
        data = json.loads(json.dumps(self.skeleton))
        data["model"]["vocab"] = [list(scores[i]) for i in keep]
        data["model"]["unk_id"] = local[int(data["model"]["unk_id"])]
        for token in data.get("added_tokens") or []:
            token["id"] = local[token["id"]]
        _special_ids(data["post_processor"], local)
        tokenizer = Tokenizer.from_str(json.dumps(data))
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length)
        return tokenizer, keep

    def _words(self, texts: list[str], max_length: int) -> list[str]:
        """The texts' words as the tokenizer sees them: normalized, split, with the word-start mark."""
        if self._splitter is None:
            self._splitter = self._tokenizer(set(), max_length)[0]
        normalizer, pre = self._splitter.normalizer, self._splitter.pre_tokenizer
        words = []
        for text in texts:
            normal = normalizer.normalize_str(text) if normalizer is not None else text
            words += [w for w, _ in pre.pre_tokenize_str(normal)] if pre is not None else [normal]
        return words

    def encodings(self, texts: list[str], max_length: int, add_special_tokens: bool = True) -> list:
        """The texts encoded as by the full tokenizer (ids in the full vocabulary)."""
        candidates = {
            w[i:j]
            for w in self._words(texts, max_length)
            for i in range(len(w))
            for j in range(i + 1, min(len(w), i + self.longest) + 1)
        }
        found: set[int] = set()
        pieces = sorted(candidates)
        for at in range(0, len(pieces), 500):
            part = pieces[at : at + 500]
            found.update(
                i
                for (i,) in self.conn.execute(
                    f"SELECT id FROM pieces WHERE piece IN ({','.join('?' * len(part))})", part
                )
            )
        tokenizer, full_ids = self._tokenizer(found, max_length)
        encoded = tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [(e.tokens, [full_ids[i] for i in e.ids]) for e in encoded]


def _special_ids(processor: dict | None, remap: dict[int, int] | None = None) -> list[int] | None:
    """The token ids a post-processor adds (remapped in place with ``remap``), or None for a kind not known here."""
    if processor is None:
        return []
    kind = processor.get("type")
    if kind == "Sequence":
        found = [_special_ids(p, remap) for p in processor.get("processors") or []]
        return None if any(f is None for f in found) else [i for f in found for i in f or []]
    if kind == "TemplateProcessing":
        ids = []
        for token in (processor.get("special_tokens") or {}).values():
            ids += token["ids"]
            if remap is not None:
                token["ids"] = [remap[i] for i in token["ids"]]
        return ids
    if kind in ("RobertaProcessing", "BertProcessing"):
        ids = [processor[k][1] for k in ("sep", "cls")]
        if remap is not None:
            for k in ("sep", "cls"):
                processor[k][1] = remap[processor[k][1]]
        return ids
    if kind in ("ByteLevel",):
        return []
    return None


class NativeBertTokenizer:
    """The folder's ``tokenizer.json`` through the tokenizers library: batches padded to their longest text. A
    few short texts (a query) with a large Unigram vocabulary go through its PieceTable instead of loading it."""

    def __init__(self, setup: dict, max_length: int):
        self.unk_token = setup["unk_token"]
        self.model_max_length = setup["model_max_length"]
        self.max_length = max_length
        self._file = setup["tokenizer_file"]
        self._pad_token = setup["pad_token"]
        self._full: Any = None
        self._pieces = PieceTable.for_file(self._file)
        if self._pieces is None:
            self._load()

    def _load(self) -> Any:
        if self._full is None:
            from tokenizers import Tokenizer

            full = Tokenizer.from_file(self._file)
            full.no_padding()
            full.enable_truncation(self.max_length)
            self.pad_id = full.token_to_id(self._pad_token)
            if self.pad_id is None:
                raise ValueError(f"pad token {self._pad_token!r} is not in the vocabulary")
            self._full = full
        return self._full

    @property
    def _batch(self) -> Any:
        return self._load()

    def _by_pieces(self, texts: list[str]) -> bool:
        return self._full is None and self._pieces is not None and sum(len(t) for t in texts) <= PIECE_TABLE_MAX_CHARS

    def encode_ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (special tokens added, truncated), unpadded."""
        if self._by_pieces(texts):
            assert self._pieces is not None
            return [ids for _, ids in self._pieces.encodings(texts, self.max_length)]
        return [e.ids for e in self._batch.encode_batch(texts)]

    def tokenize(self, text: str) -> list[str]:
        """The text's tokens, without special tokens; past the model's length only what it reads (the query guard
        asks for a share of unknown tokens, which those give)."""
        if self._by_pieces([text]):
            assert self._pieces is not None
            return self._pieces.encodings([text], self.max_length, add_special_tokens=False)[0][0]
        return self._batch.encode(text, add_special_tokens=False).tokens

    def __call__(self, texts: list[str], device: str) -> dict:
        import torch

        encoded = self._batch.encode_batch(texts)
        width = max(len(e.ids) for e in encoded)
        ids = torch.full((len(encoded), width), self.pad_id, dtype=torch.long)
        types = torch.zeros((len(encoded), width), dtype=torch.long)
        mask = torch.zeros((len(encoded), width), dtype=torch.long)
        for row, e in enumerate(encoded):
            n = len(e.ids)
            ids[row, :n] = torch.tensor(e.ids, dtype=torch.long)
            types[row, :n] = torch.tensor(e.type_ids, dtype=torch.long)
            mask[row, :n] = 1
        return {"input_ids": ids.to(device), "token_type_ids": types.to(device), "attention_mask": mask.to(device)}


class NativeBert:
    """A BERT encoder's forward pass in plain torch, on the checkpoint's own weights (inference only)."""

    def __init__(self, setup: dict):
        from safetensors.torch import load_file

        config = setup["config"]
        self.hidden_size = int(config["hidden_size"])
        self.heads = int(config["num_attention_heads"])
        self.layers = int(config["num_hidden_layers"])
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        self.approximate = NATIVE_BERT_ACTIVATIONS[config["hidden_act"]]
        weights = load_file(setup["weights_file"])
        self.weights = {(k[5:] if k.startswith("bert.") else k): v.float() for k, v in weights.items()}
        needed = [
            "embeddings.word_embeddings.weight",
            "embeddings.position_embeddings.weight",
            "embeddings.token_type_embeddings.weight",
            "embeddings.LayerNorm.weight",
            f"encoder.layer.{self.layers - 1}.output.LayerNorm.bias",
        ]
        missing = [k for k in needed if k not in self.weights]
        if missing:
            raise ValueError(f"not a BERT checkpoint: {missing[0]} missing")

    def to(self, device: str) -> NativeBert:
        self.weights = {k: v.to(device) for k, v in self.weights.items()}
        return self

    def __call__(self, input_ids, token_type_ids, attention_mask):
        import torch
        import torch.nn.functional as F

        w = self.weights
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device)
        x = (
            F.embedding(input_ids, w["embeddings.word_embeddings.weight"])
            + F.embedding(token_type_ids, w["embeddings.token_type_embeddings.weight"])
            + F.embedding(positions, w["embeddings.position_embeddings.weight"])[None]
        )
        x = F.layer_norm(
            x, (self.hidden_size,), w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], self.eps
        )
        keep = attention_mask.bool()[:, None, None, :]  # which keys each query may attend to
        head = self.hidden_size // self.heads

        def linear(h, name):
            return F.linear(h, w[f"{name}.weight"], w[f"{name}.bias"])

        def split(h):
            return h.view(batch, length, self.heads, head).transpose(1, 2)

        for i in range(self.layers):
            at = f"encoder.layer.{i}."
            q, k, v = (split(linear(x, f"{at}attention.self.{n}")) for n in ("query", "key", "value"))
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
            context = context.transpose(1, 2).reshape(batch, length, self.hidden_size)
            x = F.layer_norm(
                linear(context, f"{at}attention.output.dense") + x,
                (self.hidden_size,),
                w[f"{at}attention.output.LayerNorm.weight"],
                w[f"{at}attention.output.LayerNorm.bias"],
                self.eps,
            )
            inner = F.gelu(linear(x, f"{at}intermediate.dense"), approximate=self.approximate)
            x = F.layer_norm(
                linear(inner, f"{at}output.dense") + x,
                (self.hidden_size,),
                w[f"{at}output.LayerNorm.weight"],
                w[f"{at}output.LayerNorm.bias"],
                self.eps,
            )
        return x


class PlainSentenceEncoder:
    """A transformer + pooling sentence encoder run on transformers alone (the surface the engine uses)."""

    def __init__(self, folder: str, layout: dict, device: str, cpu_bf16: bool = False):
        self.layout = layout
        self.cpu_bf16 = cpu_bf16
        self.device = device
        self.tokenizer: Any  # NativeBertTokenizer, or a transformers tokenizer
        self.network: Any  # NativeBert, or a transformers model
        setup = native_bert_setup(folder)
        if setup is not None:
            self.runtime = "native"
            self.max_length = min(layout["max_seq_length"], setup["model_max_length"])
            self.tokenizer = NativeBertTokenizer(setup, self.max_length)
            self.network = NativeBert(setup).to(device)
            self.hidden_size = self.network.hidden_size
            return
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.runtime = "transformers"
        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.network = AutoModel.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
        self.network.eval()
        self.network.to(device)
        self.hidden_size = int(self.network.config.hidden_size)
        self.max_length = min(layout["max_seq_length"], getattr(self.tokenizer, "model_max_length", 10**6))

    def to(self, device: str) -> PlainSentenceEncoder:
        self.network.to(device)
        self.device = device
        return self

    def get_sentence_embedding_dimension(self) -> int:
        return self.hidden_size

    def _hidden(self, batch: list[str]):
        """The last hidden states and the attention mask of one batch."""
        if self.runtime == "native":
            inputs = self.tokenizer(batch, self.device)
            return self.network(**inputs), inputs["attention_mask"]
        inputs = self.tokenizer(
            batch, padding=True, truncation="longest_first", max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        return self.network(**inputs).last_hidden_state, inputs["attention_mask"]

    def encode(
        self, texts: list[str], batch_size: int = 32, normalize_embeddings: bool = True, prompt: str = "", **_ignored
    ):
        import numpy as np
        import torch

        out = []
        bf16 = self.cpu_bf16 and self.device == "cpu"
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            for start in range(0, len(texts), batch_size):
                batch = [(prompt + str(t)).strip() for t in texts[start : start + batch_size]]
                if self.layout["lower_case"]:
                    batch = [t.lower() for t in batch]
                hidden, mask = self._hidden(batch)
                pooled = self._pool(hidden.float(), mask)  # pool in float32 whatever ran before
                if normalize_embeddings or self.layout["normalize"]:
                    pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
                out.append(pooled.float().cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, self.get_sentence_embedding_dimension()), np.float32)

    def _pool(self, hidden, mask):
        import torch

        mode = self.layout["pooling"]
        if mode == "cls_token":  # the first token the mask keeps (left-padding tokenizers shift it)
            first = mask.to(torch.long).argmax(dim=1)
            return hidden[torch.arange(hidden.shape[0], device=hidden.device), first]
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        if mode == "max_tokens":
            return hidden.masked_fill(weights == 0, torch.finfo(hidden.dtype).min).max(dim=1).values
        summed, counts = (hidden * weights).sum(dim=1), weights.sum(dim=1).clamp(min=1e-9)
        return summed / (counts.sqrt() if mode == "mean_sqrt_len_tokens" else counts)
