"""The model adapter on tiny random models of many architectures: each is either exact (the fused
path at ratio 1.0 and full reuse against the model's own forward, a shifted key against one computed
at the new position) or refused at load with a message naming the feature. Never a torch error."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from cacheblend_rag import BlendConfig
from cacheblend_rag.blend.self_test import self_test
from cacheblend_rag.engine.core import CacheBlendEngine
from cacheblend_rag.model.backbone import Backbone, check_support, sliding_window
from cacheblend_rag.model.loading import UnsupportedModelError
from cacheblend_rag.rope import shift_keys
from cacheblend_rag.store.disk import KVStore
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_tokenizer

BASE = dict(
    vocab_size=400,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    eos_token_id=2,
    tie_word_embeddings=False,
)
ROPE = {"rope_theta": 10000.0}

EXACT = {
    "llama": ("LlamaConfig", {}),
    "mistral_window": ("MistralConfig", dict(sliding_window=512)),  # longer than the prompt
    "qwen2_gqa7_bias": ("Qwen2Config", dict(hidden_size=112, num_attention_heads=14, num_key_value_heads=2)),
    "qwen2_window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=512, max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "gemma": ("GemmaConfig", dict(head_dim=16)),
    "phi3": ("Phi3Config", dict(pad_token_id=0)),
    "granite": (
        "GraniteConfig",
        dict(embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22, attention_multiplier=0.0078),
    ),
    "llama_linear": ("LlamaConfig", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, **ROPE})),
    "llama_llama3": (
        "LlamaConfig",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
                **ROPE,
            }
        ),
    ),
    "llama_yarn": (
        "LlamaConfig",
        dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, **ROPE}),
    ),
}
REFUSED = {
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=512), "eager", "attn_logit_softcapping"),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=512), "sdpa", "per-layer rotary embeddings"),
    "cohere": ("CohereConfig", dict(logit_scale=0.0625), "sdpa", "interleaved rotary embeddings"),
    "stablelm": (
        "StableLmConfig",
        dict(partial_rotary_factor=0.25),
        "sdpa",
        r"rotates only 4 of its 16 head channels \(partial rotary\)",
    ),
    "llama_dynamic": ("LlamaConfig", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, **ROPE}), "sdpa", "'dynamic'"),
    "llama_longrope": (
        "LlamaConfig",
        dict(
            rope_parameters={
                "rope_type": "longrope",
                "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 256,
                **ROPE,
            }
        ),
        "sdpa",
        "'longrope'",
    ),
}


def build(cls: str, overrides: dict, attn: str = "sdpa", seed: int = 0):
    config = getattr(transformers, cls)(**{**BASE, **overrides})
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).eval()


def _kv(cache, i):
    return cache.layers[i].keys, cache.layers[i].values


@pytest.mark.parametrize("name", sorted(EXACT))
def test_supported_architectures_are_exact(name):
    cls, overrides = EXACT[name]
    model = build(cls, overrides)
    engine = CacheBlendEngine(model, make_tokenizer(), store=KVStore(None))
    try:
        layout = engine.build_layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
        ids = torch.tensor([list(layout.token_ids)])
        with torch.inference_mode():
            ref = model(input_ids=ids, use_cache=True)
        full = engine.prefill(layout, "full_recompute")
        torch.testing.assert_close(full.logits.flatten().float(), ref.logits[0, -1].float(), rtol=1e-4, atol=1e-5)
        for strategy in ("hkvd", "question"):
            blend = engine.prefill(layout, "cacheblend", BlendConfig(recompute_ratio=1.0, strategy=strategy))
            torch.testing.assert_close(blend.logits.flatten().float(), ref.logits[0, -1].float(), rtol=1e-4, atol=1e-5)
            for i in range(engine.num_layers):
                for a, b in zip(_kv(blend.cache, i), _kv(ref.past_key_values, i)):
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        # Full reuse: a chunk's layer-0 keys (a function of its tokens and positions alone) equal
        # the keys the model computes for the chunk at its new place in the prompt.
        reuse = engine.prefill(layout, "full_reuse")
        seg, off = next(
            (s, o) for s, o in zip(layout.segments, layout.offsets()) if s.reusable and o > len(engine.prompts.prefix_ids)
        )
        with torch.inference_mode():
            there = model(
                input_ids=torch.tensor([list(seg.token_ids)]),
                position_ids=torch.arange(off, off + len(seg))[None],
                use_cache=True,
            ).past_key_values
        torch.testing.assert_close(_kv(reuse.cache, 0)[0][0, :, off : off + len(seg)], _kv(there, 0)[0][0], rtol=1e-4, atol=1e-4)
        # A shifted layer-0 key equals the key computed at the new position.
        with torch.inference_mode():
            k0 = model(input_ids=ids[:, :20], use_cache=True).past_key_values
            k1 = model(input_ids=ids[:, :20], position_ids=torch.arange(100, 120)[None], use_cache=True).past_key_values
        torch.testing.assert_close(
            shift_keys(engine.backbone.rotary_emb, _kv(k0, 0)[0], 100), _kv(k1, 0)[0], rtol=1e-4, atol=1e-4
        )
    finally:
        engine.close()


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_architectures_are_refused_at_load_with_the_feature_named(name):
    cls, overrides, attn, message = REFUSED[name]
    model = build(cls, overrides, attn)
    with pytest.raises(UnsupportedModelError, match=message) as err:
        CacheBlendEngine(model, make_tokenizer(), store=KVStore(None))
    assert "use a " in str(err.value).lower()  # and what to use instead


def test_a_prompt_longer_than_the_sliding_window_is_refused_with_the_window_named():
    model = build("MistralConfig", dict(sliding_window=128))
    engine = CacheBlendEngine(model, make_tokenizer(), store=KVStore(None))
    try:
        assert engine.backbone.window == 128 and engine.context_window == 127
        with pytest.raises(ValueError, match="sliding attention window of 128 less one"):
            engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, max_new_tokens=2)
        # Inside the window the fused path is exact.
        layout = engine.build_layout("Why?", ["The Eiffel Tower is in Paris."])
        full = engine.prefill(layout, "full_recompute")
        blend = engine.prefill(layout, "cacheblend", BlendConfig(recompute_ratio=1.0))
        torch.testing.assert_close(blend.logits, full.logits, rtol=1e-4, atol=1e-5)
    finally:
        engine.close()


def test_sliding_window_detection_follows_the_layer_types():
    assert sliding_window(transformers.MistralConfig(sliding_window=None)) is None
    assert sliding_window(transformers.MistralConfig(sliding_window=4096)) == 4096
    assert sliding_window(transformers.Qwen2Config(sliding_window=4096)) is None  # use_sliding_window=False
    assert (
        sliding_window(
            transformers.Qwen2Config(use_sliding_window=True, sliding_window=32, max_window_layers=1, num_hidden_layers=3)
        )
        == 32
    )


def test_self_test_refuses_a_model_whose_scales_the_adapter_misses():
    # Granite's embedding multiplier and logit scaling are applied outside the decoder layers: an
    # adapter that skipped them would answer differently, and the self-test says so.
    model = build(*EXACT["granite"])
    self_test(Backbone.adapt(model))
    blind = dataclasses.replace(Backbone.adapt(model), embedding_multiplier=1.0, logits_divisor=1.0)
    with pytest.raises(UnsupportedModelError, match="differs from the model's own forward"):
        self_test(blind)


def test_self_test_refuses_a_rotary_layout_the_key_shift_gets_wrong(monkeypatch):
    # Cohere's interleaved rotary is refused by name; past the name check, the shift check catches it.
    model = build("CohereConfig", dict(logit_scale=1.0))
    monkeypatch.setattr("cacheblend_rag.model.backbone._INTERLEAVED_ROPE_MODELS", frozenset())
    check_support(model)
    with pytest.raises(UnsupportedModelError, match="could not be re-rotated exactly"):
        self_test(Backbone.adapt(model))
