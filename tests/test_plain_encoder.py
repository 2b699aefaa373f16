"""The plain sentence encoder: transformer + pooling (+ normalise) folders run on ``transformers`` alone.

``plain_sentence_layout(folder)`` recognises the common layout, ``load_sentence_encoder`` then returns a
``PlainSentenceEncoder`` instead of importing sentence-transformers; anything else (a Dense module, a default
prompt, another pooling) falls back to ``SentenceTransformer``, as does ``KB_PLAIN_ENCODER=0``.

Every check compares against sentence-transformers itself: the real all-MiniLM-L6-v2 folder (mean pooling,
Normalize) and tiny BERT models built here with CLS, max and mean_sqrt_len pooling. Tiny folders are saved by
the installed sentence-transformers and their pooling config is then written in the classic
``pooling_mode_*_tokens`` form that hub models ship (and that sentence-transformers still reads).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from helpers import ROOT, clean_env, isolate_model_env, use_minilm

# About the engine's own functions: reaches names outside kb_engine.__all__ (tests/static/test_public_surface.py).
pytestmark = [pytest.mark.internals, pytest.mark.model]

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
st_pkg = pytest.importorskip("sentence_transformers")
with warnings.catch_warnings():     # newer versions moved the module classes; the old path still works
    warnings.simplefilter("ignore", DeprecationWarning)
    from sentence_transformers import SentenceTransformer  # noqa: E402
    from sentence_transformers import models as st_models

TOLERANCE = 1e-5

LONG = " ".join(f"Sentence {i} reports perovskite stability under damp heat." for i in range(120))   # >> 256 tokens
TEXTS = [
    "Graphene grown by chemical vapour deposition on copper foil.",
    "",
    " ",
    "\n\t",
    ".",
    LONG,
    "钙钛矿太阳能电池在湿热条件下的稳定性研究",
    "The photocatalytic eﬃciency of ﬁlms with ﬂuorine doping",       # ffi, fi, fl ligatures
    "Ünïcödé àccents, Greek αβγ and Cyrillic кириллица",
    "mixed 中文 and English: 12.5 ± 0.3 µm at 300 K",
    "🦜🦜🦜",
    "UPPER CASE TITLE OF A PAPER",
    "x " * 600,
]


def _st(folder) -> SentenceTransformer:
    return SentenceTransformer(str(folder), device="cpu", local_files_only=True)


def _st_vectors(model: SentenceTransformer, texts, normalize=True):
    return model.encode(list(texts), batch_size=5, normalize_embeddings=normalize, convert_to_numpy=True,
                        show_progress_bar=False)


def _max_diff(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())


# ---------------------------------------------------------------------------
# the real MiniLM folder

@pytest.fixture(scope="module")
def module_env():
    with pytest.MonkeyPatch.context() as mp:
        isolate_model_env(mp)
        mp.delenv("KB_PLAIN_ENCODER", raising=False)
        yield mp


@pytest.fixture(scope="module")
def minilm(module_env) -> Path:
    return use_minilm(module_env)


@pytest.fixture(scope="module")
def st_minilm(minilm):
    return _st(minilm)


@pytest.fixture(scope="module")
def plain_minilm(kb_engine, minilm):
    return kb_engine.load_sentence_encoder(str(minilm), "cpu", backend="torch")[0]


def test_minilm_layout_is_recognised(kb_engine, minilm, plain_minilm):
    assert kb_engine.plain_sentence_layout(str(minilm)) == {
        "pooling": "mean_tokens", "normalize": True, "max_seq_length": 256, "lower_case": False}
    assert isinstance(plain_minilm, kb_engine.PlainSentenceEncoder)
    assert plain_minilm.runtime == "native"          # a plain BERT: run without transformers' model code
    assert plain_minilm.get_sentence_embedding_dimension() == 384


@pytest.mark.slow
def test_minilm_vectors_match_sentence_transformers(plain_minilm, st_minilm):
    expected = _st_vectors(st_minilm, TEXTS)
    # a small batch size and the original (unsorted) order: batches mix very different lengths, so padding matters
    got = plain_minilm.encode(TEXTS, batch_size=3)
    assert got.dtype == np.float32
    assert _max_diff(got, expected) < TOLERANCE
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    # one text at a time gives the same vectors as batched
    single = np.stack([plain_minilm.encode([t])[0] for t in TEXTS[:6]])
    assert _max_diff(single, got[:6]) < TOLERANCE


@pytest.mark.slow
def test_minilm_truncates_like_sentence_transformers(plain_minilm, st_minilm):
    tail = LONG + " Coral reefs bleach during marine heatwaves."
    got = plain_minilm.encode([LONG, tail, LONG[:200]])
    expected = _st_vectors(st_minilm, [LONG, tail, LONG[:200]])
    assert _max_diff(got, expected) < TOLERANCE
    assert _max_diff(got[0], got[1]) < 1e-6          # the tail lies beyond max_seq_length: cut off
    assert _max_diff(got[0], got[2]) > 1e-3          # while a short prefix is a different text


def test_minilm_empty_batch(plain_minilm):
    out = plain_minilm.encode([])
    assert out.shape == (0, 384)


@pytest.mark.slow
def test_models_embedder_uses_plain_encoder(kb_engine, minilm, st_minilm, monkeypatch):
    monkeypatch.setenv("KB_CPU_BF16", "0")      # float32 throughout: the vectors must match to 1e-5
    monkeypatch.setenv("KB_EMBED_BACKEND", "torch")
    models = kb_engine.Models()
    embedder = models.embedder()
    assert isinstance(embedder.model, kb_engine.PlainSentenceEncoder)
    assert embedder.device == "cpu" or embedder.device.startswith("cuda")
    assert embedder.dim == 384
    assert models.embedder() is embedder
    vectors = embedder.encode_passages(TEXTS)
    assert _max_diff(vectors, _st_vectors(st_minilm, TEXTS)) < TOLERANCE
    query = "graphene growth on copper"
    assert _max_diff(embedder.encode_query(query), _st_vectors(st_minilm, [query])[0]) < TOLERANCE

    # the unknown-token guard still reads the tokenizer
    assert embedder.unknown_token_share("graphene on copper foil") == 0.0
    for text in ("🦜🦜 parrots", "钙钛矿太阳能电池", "ᚠᚢᚦᚨᚱᚲ runes"):
        tokens = st_minilm.tokenizer.tokenize(text)
        expected = sum(t == st_minilm.tokenizer.unk_token for t in tokens) / len(tokens)
        assert expected > 0
        assert embedder.unknown_token_share(text) == pytest.approx(expected)
    assert embedder.unknown_token_share("钙钛矿太阳能电池") > kb_engine.MAX_UNKNOWN_TOKEN_SHARE


@pytest.mark.slow
def test_cpu_bfloat16_stays_within_cosine_0_9995_of_float32(kb_engine, minilm, st_minilm, monkeypatch):
    """KB_CPU_BF16=1: the matrix products run in bfloat16 (pooling in float32); every vector stays a unit vector
    pointing where the float32 one does, and the device report says so."""
    expected = _st_vectors(st_minilm, TEXTS)
    monkeypatch.setenv("KB_CPU_BF16", "1")
    monkeypatch.setenv("KB_EMBED_BACKEND", "torch")
    models = kb_engine.Models()
    embedder = models.embedder()
    assert embedder.model.cpu_bf16 is True
    assert models.devices.report["cpu_bf16"] is True and models.devices.report["cpu_bf16_reason"] == "KB_CPU_BF16=1"
    got = embedder.encode_passages(TEXTS)
    assert got.dtype == np.float32
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    cosines = (got * expected).sum(axis=1)
    assert cosines.min() > 0.9995, cosines
    assert _max_diff(got, expected) > 1e-6         # it did run in bfloat16: not bit-identical to float32


@pytest.mark.parametrize("setting, expected", [("0", False), ("off", False), ("1", True), ("yes", True)])
def test_cpu_bfloat16_setting(kb_engine, monkeypatch, setting, expected):
    monkeypatch.setenv("KB_CPU_BF16", setting)
    assert kb_engine.cpu_bf16_wanted()[0] is expected


def test_cpu_bfloat16_auto_follows_amx(kb_engine, monkeypatch):
    monkeypatch.delenv("KB_CPU_BF16", raising=False)
    amx = bool(torch.cpu._is_amx_tile_supported())
    why = "the CPU has AMX (bfloat16 matrix tiles)" if amx else "the CPU has no AMX"
    assert kb_engine.cpu_bf16_wanted() == (amx, why)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert kb_engine.cpu_bf16_wanted() == (False, "the CPU has no AMX")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert kb_engine.cpu_bf16_wanted()[0] is True


@pytest.mark.slow
def test_switch_forces_sentence_transformers(kb_engine, minilm, st_minilm, monkeypatch):
    monkeypatch.setenv("KB_PLAIN_ENCODER", "0")
    model = kb_engine.load_sentence_encoder(str(minilm), "cpu", backend="torch")[0]
    assert isinstance(model, SentenceTransformer)
    embedder = kb_engine.Models().embedder()
    assert isinstance(embedder.model, SentenceTransformer)
    assert _max_diff(embedder.encode_passages(TEXTS[:6]), _st_vectors(st_minilm, TEXTS[:6])) < TOLERANCE
    assert embedder.unknown_token_share("🦜🦜 parrots") == pytest.approx(1 / 3)


@pytest.mark.slow
def test_engine_never_imports_sentence_transformers(minilm, tmp_path):
    """Loading the embedder, an ingest with vectors and a vector search: sentence_transformers stays unimported."""
    paper = tmp_path / "papers" / "terns.md"
    paper.parent.mkdir()
    paper.write_text("# Arctic Tern Migration\n\nArctic terns migrate from Greenland to the Antarctic pack ice "
                     "every autumn and pause in the upwelling waters off north-west Africa.\n", encoding="utf-8")
    code = (
        "import json, sys, kb_engine\n"
        "models = kb_engine.Models()\n"
        "embedder = models.embedder()\n"
        "vectors = embedder.encode_passages(['graphene on copper', '钙钛矿', ''])\n"
        "engine = kb_engine.Engine()\n"
        "ingest = engine.execute('ingest', {'paths': [sys.argv[1]], 'kb_root': sys.argv[2]})\n"
        "hits = engine.execute('search', {'query': 'bird migration', 'kb_root': sys.argv[2], 'mode': 'vector'})\n"
        "print(json.dumps({'st': 'sentence_transformers' in sys.modules, 'model': type(embedder.model).__name__,\n"
        "                  'engine_model': type(engine.models.embedder().model).__name__,\n"
        "                  'rows': len(vectors), 'vectors': ingest['totals']['vectors_written'],\n"
        "                  'hits': len(hits['results'])}))\n"
    )
    env = clean_env(KB_EMBED_MODEL=str(minilm), KB_RERANK_MODEL="/nonexistent/kb-rag-test-reranker",
                    KB_RERANK_FALLBACK="none", KB_INGEST_WORKERS="0")
    proc = subprocess.run([sys.executable, "-c", code, str(paper.parent), str(tmp_path / "kb")],
                          capture_output=True, text=True, cwd=str(ROOT), env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["model"] == out["engine_model"] in ("PlainSentenceEncoder", "OnnxSentenceEncoder"), out
    assert out["rows"] == 3 and out["vectors"] >= 1 and out["hits"] >= 1, out
    assert out["st"] is False, "sentence_transformers was imported although the plain encoder covers MiniLM"


# ---------------------------------------------------------------------------
# tiny locally built models

LEGACY_KEYS = {"cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens", "mean": "pooling_mode_mean_tokens",
               "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
               "weightedmean": "pooling_mode_weightedmean_tokens", "lasttoken": "pooling_mode_lasttoken"}
TINY_VOCAB = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [chr(c) for c in range(97, 123)]
              + [chr(c) for c in range(65, 91)] + ["##" + chr(c) for c in range(97, 123)]
              + ["the", "model", "word", "test", ".", ",", "Graphene", "graphene"])
TINY_TEXTS = ["the model", "The Model: Graphene word test, the model. the model word test the model test",
              "", "Graphene", "graphene", "x y z " * 30, "  lead and trail  ", "ünknown ☃ signs"]
DIM = 32


def _legacy_pooling(folder: Path, modes: dict[str, bool], **extra) -> None:
    config = {"word_embedding_dimension": DIM, **{LEGACY_KEYS[m]: on for m, on in modes.items()}, **extra}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config), encoding="utf-8")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{name: folder} of tiny sentence models; each differs from 'cls' in one respect."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers import models as tk_models
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast
    base = tmp_path_factory.mktemp("tiny_models")
    hf = base / "hf"
    # a cased WordPiece tokenizer (so that do_lower_case in sentence_bert_config.json changes the tokens), built
    # with the tokenizers library: the Bert tokenizer classes take their vocabulary differently across versions
    wordpiece = Tokenizer(tk_models.WordPiece({t: i for i, t in enumerate(TINY_VOCAB)}, unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer(lowercase=False)
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=wordpiece, unk_token="[UNK]", pad_token="[PAD]",
                                        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]", model_max_length=16)
    tokenizer.save_pretrained(hf)
    assert tokenizer.tokenize("the Graphene") == ["the", "Graphene"]
    torch.manual_seed(1234)
    BertModel(BertConfig(vocab_size=len(TINY_VOCAB), hidden_size=DIM, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64)).save_pretrained(hf)

    def build(name, mode, normalize=True, dense=False, max_seq=12, lower=True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            modules = [st_models.Transformer(str(hf)), st_models.Pooling(DIM, pooling_mode=mode)]
            if dense:
                modules.append(st_models.Dense(DIM, 8))
            if normalize:
                modules.append(st_models.Normalize())
            SentenceTransformer(modules=modules, device="cpu").save(str(base / name))
        folder = base / name
        (folder / "sentence_bert_config.json").write_text(
            json.dumps({"max_seq_length": max_seq, "do_lower_case": lower}), encoding="utf-8")
        return folder

    out = {}
    out["native"] = build("native", "cls")          # pooling config exactly as the installed version saves it
    for name, mode, normalize, max_seq, lower in (("cls", "cls", True, 12, True), ("max", "max", False, 14, False),
                                                  ("mean_sqrt", "mean_sqrt_len_tokens", False, 16, True),
                                                  ("weightedmean", "weightedmean", True, 12, True),
                                                  ("lasttoken", "lasttoken", True, 12, True)):
        out[name] = build(name, mode, normalize=normalize, max_seq=max_seq, lower=lower)
        _legacy_pooling(out[name], {m: m == mode for m in ("cls", "max", "mean", "mean_sqrt_len_tokens")}
                        if mode in ("cls", "max", "mean_sqrt_len_tokens") else {"mean": False, mode: True})
    out["dense"] = build("dense", "cls", dense=True)
    _legacy_pooling(out["dense"], {"cls": True, "mean": False, "max": False, "mean_sqrt_len_tokens": False})

    def variant(name, edit):
        folder = base / name
        shutil.copytree(out["cls"], folder)
        edit(folder)
        out[name] = folder

    def with_prompt(folder):
        path = folder / "config_sentence_transformers.json"
        config = json.loads(path.read_text(encoding="utf-8"))
        config.update(prompts={"query": "query: ", "document": ""}, default_prompt_name="query")
        path.write_text(json.dumps(config), encoding="utf-8")

    variant("prompt", with_prompt)
    variant("two_modes", lambda f: _legacy_pooling(f, {"cls": True, "mean": True}))
    variant("no_prompt_pooling", lambda f: _legacy_pooling(f, {"cls": True, "mean": False}, include_prompt=False))
    variant("nested_transformer", lambda f: (f / "modules.json").write_text(json.dumps(
        [dict(m, path="0_Transformer") if m["idx"] == 0 else m
         for m in json.loads((f / "modules.json").read_text(encoding="utf-8"))]), encoding="utf-8"))
    return out


@pytest.mark.parametrize("name, pooling, normalize, max_seq, lower", [
    ("cls", "cls_token", True, 12, True),
    ("max", "max_tokens", False, 14, False),
    ("mean_sqrt", "mean_sqrt_len_tokens", False, 16, True),
])
def test_tiny_model_matches_sentence_transformers(kb_engine, tiny, module_env, name, pooling, normalize, max_seq,
                                                  lower):
    folder = tiny[name]
    assert kb_engine.plain_sentence_layout(str(folder)) == {
        "pooling": pooling, "normalize": normalize, "max_seq_length": max_seq, "lower_case": lower}
    reference = _st(folder)
    assert reference.max_seq_length == max_seq       # sentence-transformers reads the same settings
    plain = kb_engine.load_sentence_encoder(str(folder), "cpu", backend="torch")[0]
    assert isinstance(plain, kb_engine.PlainSentenceEncoder)
    assert plain.runtime == "native"
    assert plain.get_sentence_embedding_dimension() == DIM
    for norm in (True, False):     # unnormalised: the pooling maths itself, not only the direction
        got = plain.encode(TINY_TEXTS, batch_size=3, normalize_embeddings=norm)
        assert _max_diff(got, _st_vectors(reference, TINY_TEXTS, normalize=norm or normalize)) < TOLERANCE, norm
    # the setting in sentence_bert_config.json decides whether case matters
    upper, lower_vec = plain.encode(["Graphene", "graphene"])
    assert (_max_diff(upper, lower_vec) < 1e-6) == lower
    # an Embedder around it works as with sentence-transformers
    embedder = kb_engine.Embedder(str(folder), kb_engine.DeviceManager(), plain, "cpu")
    assert embedder.dim == DIM
    assert _max_diff(embedder.encode_passages(TINY_TEXTS), _st_vectors(reference, TINY_TEXTS)) < TOLERANCE


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(changes)
    path.write_text(json.dumps(data), encoding="utf-8")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["switched_off", "relu", "relative_positions", "lowercase_mismatch", "no_safetensors"])
def test_bert_the_native_runner_does_not_reproduce_runs_on_transformers(kb_engine, tiny, module_env, tmp_path,
                                                                        monkeypatch, case):
    """Anything but a plain BERT (or KB_NATIVE_BERT=0) takes transformers' path, with sentence-transformers'
    vectors; the native runner gives the same vectors where it applies."""
    folder = tmp_path / case
    shutil.copytree(tiny["cls"], folder)
    native = kb_engine.load_sentence_encoder(str(folder), "cpu", backend="torch")[0]
    assert native.runtime == "native"
    if case == "switched_off":
        monkeypatch.setenv("KB_NATIVE_BERT", "0")
    elif case == "relu":
        _edit_json(folder / "config.json", hidden_act="relu")
    elif case == "relative_positions":
        _edit_json(folder / "config.json", position_embedding_type="relative_key")
    elif case == "lowercase_mismatch":       # transformers would rebuild the normaliser from the config
        _edit_json(folder / "tokenizer_config.json", do_lower_case=True)
    elif case == "no_safetensors":
        import torch as t
        from safetensors.torch import load_file
        t.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
        (folder / "model.safetensors").unlink()
    assert kb_engine.native_bert_setup(str(folder)) is None
    model = kb_engine.load_sentence_encoder(str(folder), "cpu", backend="torch")[0]
    assert isinstance(model, kb_engine.PlainSentenceEncoder) and model.runtime == "transformers"
    if case in ("switched_off", "no_safetensors"):      # the same model, another runtime
        assert _max_diff(model.encode(TINY_TEXTS), native.encode(TINY_TEXTS)) < TOLERANCE
    assert _max_diff(model.encode(TINY_TEXTS), _st_vectors(_st(folder), TINY_TEXTS)) < TOLERANCE


def test_native_setup_needs_a_tokenizer_json(kb_engine, tiny, tmp_path):
    folder = tmp_path / "no_tokenizer_json"
    shutil.copytree(tiny["cls"], folder)
    assert kb_engine.native_bert_setup(str(folder)) is not None
    (folder / "tokenizer.json").unlink()
    assert kb_engine.native_bert_setup(str(folder)) is None


@pytest.mark.slow
def test_native_loading_imports_neither_transformers_nor_sentence_transformers(minilm):
    script = ("import sys, kb_engine\n"
              "e = kb_engine.Models().embedder()\n"
              "v = e.encode_passages(['graphene on copper', 'perovskite stability'])\n"
              "assert e.model.runtime == 'native' and v.shape == (2, 384)\n"
              "print(sorted(m for m in ('transformers', 'sentence_transformers') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=clean_env(KB_EMBED_MODEL=str(minilm), HF_HUB_OFFLINE="1", KB_EMBED_BACKEND="torch"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ["dense", "two_modes", "no_prompt_pooling", "weightedmean", "lasttoken",
                                  "nested_transformer"])
def test_other_layouts_fall_back_to_sentence_transformers(kb_engine, tiny, module_env, name):
    folder = tiny[name]
    assert kb_engine.plain_sentence_layout(str(folder)) is None
    if name == "nested_transformer":       # a made-up layout sentence-transformers need not load either
        return
    model = kb_engine.load_sentence_encoder(str(folder), "cpu", backend="torch")[0]
    assert isinstance(model, SentenceTransformer)
    embedder = kb_engine.Embedder(str(folder), kb_engine.DeviceManager(), model, "cpu")
    reference = _st(folder)
    assert embedder.dim == _st_vectors(reference, ["x"]).shape[1]
    assert _max_diff(embedder.encode_passages(TINY_TEXTS), _st_vectors(reference, TINY_TEXTS)) < TOLERANCE
    if name == "dense":
        assert embedder.dim == 8


def test_declared_prompts_are_applied_once_by_either_loader(kb_engine, tiny, module_env, monkeypatch):
    """A folder declaring query/document prompts and a default one: the engine applies the query prompt to
    queries and the document prompt to passages, exactly as sentence-transformers does with prompt_name, and
    never the default prompt on top (the plain encoder and sentence-transformers agree)."""
    folder = tiny["prompt"]
    reference = _st(folder)
    expected_queries = reference.encode(TINY_TEXTS, prompt_name="query", normalize_embeddings=True,
                                        convert_to_numpy=True, show_progress_bar=False)
    expected_passages = reference.encode(TINY_TEXTS, prompt_name="document", normalize_embeddings=True,
                                         convert_to_numpy=True, show_progress_bar=False)
    assert _max_diff(expected_queries, expected_passages) > 1e-3      # the prompt changes the vectors
    for plain in ("1", "0"):
        monkeypatch.setenv("KB_PLAIN_ENCODER", plain)
        model = kb_engine.load_sentence_encoder(str(folder), "cpu", backend="torch")[0]
        assert isinstance(model, kb_engine.PlainSentenceEncoder) == (plain == "1")
        prompts = kb_engine.model_prompts(str(folder), str(folder))
        assert (prompts.query, prompts.passage, prompts.source) == ("query: ", "", "model folder")
        embedder = kb_engine.Embedder(str(folder), kb_engine.DeviceManager(), model, "cpu", prompts)
        assert _max_diff(embedder.encode_passages(TINY_TEXTS), expected_passages) < TOLERANCE
        assert _max_diff(np.stack([embedder.encode_query(t) for t in TINY_TEXTS]), expected_queries) < TOLERANCE


def test_switch_off_with_tiny_model(kb_engine, tiny, monkeypatch):
    monkeypatch.setenv("KB_PLAIN_ENCODER", "0")
    assert kb_engine.plain_sentence_layout(str(tiny["cls"])) is not None
    assert isinstance(kb_engine.load_sentence_encoder(str(tiny["cls"]), "cpu", backend="torch")[0], SentenceTransformer)
    monkeypatch.setenv("KB_PLAIN_ENCODER", "1")
    plain, _ = kb_engine.load_sentence_encoder(str(tiny["cls"]), "cpu", backend="torch")
    assert isinstance(plain, kb_engine.PlainSentenceEncoder)


def test_native_save_format_gives_same_vectors(kb_engine, tiny, module_env):
    """A folder as the installed sentence-transformers saves it: whichever loader is chosen, same vectors."""
    folder = tiny["native"]
    model = kb_engine.load_sentence_encoder(str(folder), "cpu", backend="torch")[0]
    embedder = kb_engine.Embedder(str(folder), kb_engine.DeviceManager(), model, "cpu")
    assert _max_diff(embedder.encode_passages(TINY_TEXTS), _st_vectors(_st(folder), TINY_TEXTS)) < TOLERANCE


def test_native_save_format_is_recognised(kb_engine, tiny):
    """sentence-transformers >= 5 saves pooling as {"pooling_mode": "cls"} (no pooling_mode_*_tokens keys)."""
    pooling = json.loads((tiny["native"] / "1_Pooling" / "config.json").read_text(encoding="utf-8"))
    if "pooling_mode" not in pooling:
        pytest.skip("this sentence-transformers still saves the pooling_mode_*_tokens form")
    layout = kb_engine.plain_sentence_layout(str(tiny["native"]))
    assert layout is not None
    assert layout["pooling"] == "cls_token" and layout["normalize"] is True
