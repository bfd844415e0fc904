"""Weight formats (``weights.py``) and the decode step: each format is exact against its own
forward (full prefill and the fused path at ratio 1.0), its kernels compute what they claim, the
fingerprint keeps formats apart, bad requests are refused by name, and the optimised decode
attention gives the plain path's tokens."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import transformers
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from cacheblend_rag import BlendConfig
from cacheblend_rag.engine.core import CacheBlendEngine
from cacheblend_rag.model.attention import _decode_sdpa
from cacheblend_rag.model.fingerprint import model_fingerprint
from cacheblend_rag.model.loading import ModelLoadError
from cacheblend_rag.model.weights import FP16_GEMM_MAX_ROWS, Fp16Linear, apply_weight_format, resolve_weight_format, weight_format
from cacheblend_rag.store.disk import KVStore
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_model, make_tokenizer

ARCHS = {
    "llama": dict(),
    "qwen2_bias_gqa": dict(hidden_size=112, num_attention_heads=14, num_key_value_heads=2),
}


def _model(arch: str, **overrides):
    base = "qwen2" if arch.startswith("qwen2") else arch
    return make_model(base, **{**ARCHS[arch], **overrides})


def _kv(cache, i):
    return cache.layers[i].keys, cache.layers[i].values


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_fp16_format_is_exact_against_its_own_forward(arch):
    model = apply_weight_format(_model(arch), "fp16")
    assert weight_format(model) == "fp16"
    assert sum(isinstance(m, Fp16Linear) for m in model.modules()) == 7 * model.config.num_hidden_layers + 1
    engine = CacheBlendEngine(model, make_tokenizer(), store=KVStore(None))  # passes the self-test
    try:
        layout = engine.build_layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
        ids = torch.tensor([list(layout.token_ids)])
        assert ids.shape[1] > FP16_GEMM_MAX_ROWS  # the prefill takes the many-row path, decoding the FP16 GEMM
        with torch.inference_mode():
            ref = model(input_ids=ids, use_cache=True)
        full = engine.prefill(layout, "full_recompute")
        torch.testing.assert_close(full.logits.flatten(), ref.logits[0, -1].float(), rtol=1e-4, atol=1e-5)
        blend = engine.prefill(layout, "cacheblend", BlendConfig(recompute_ratio=1.0))
        torch.testing.assert_close(blend.logits.flatten(), ref.logits[0, -1].float(), rtol=1e-4, atol=1e-5)
        for i in range(engine.num_layers):
            for a, b in zip(_kv(blend.cache, i), _kv(ref.past_key_values, i)):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    finally:
        engine.close()


def test_fp16_format_computes_in_float32_with_the_rounded_weights_on_both_paths():
    torch.manual_seed(0)
    linear = nn.Linear(96, 40)
    fp16 = Fp16Linear(linear)
    rounded = linear.weight.detach().half().float()
    assert fp16.weight.dtype == torch.float16  # half the bytes of a float32 copy
    assert torch.equal(fp16.weight.float(), rounded) and not torch.equal(rounded, linear.weight)
    for rows in (1, 3, FP16_GEMM_MAX_ROWS, FP16_GEMM_MAX_ROWS + 1, 200):
        x = torch.randn(rows, 96) * 3
        want = x.double() @ rounded.double().T + linear.bias.double()
        torch.testing.assert_close(fp16(x).double(), want, rtol=1e-5, atol=1e-5)
    # A row's result does not depend on the rows decoded beside it (batched = single answers).
    x = torch.randn(5, 96)
    torch.testing.assert_close(fp16(x)[2:3], fp16(x[2:3]), rtol=0, atol=1e-6)


def test_fp16_format_stays_close_to_float32():
    """The format's only change is the weights' rounding: next-token distributions stay close."""
    model = _model("llama")
    fp16 = apply_weight_format(copy.deepcopy(model), "fp16")
    ids = torch.arange(3, 60)[None]
    with torch.inference_mode():
        a = model(input_ids=ids).logits.log_softmax(-1)
        b = fp16(input_ids=ids).logits.log_softmax(-1)
    kl = (a.exp() * (a - b)).sum(-1)
    assert 0 < kl.max() < 1e-4


def test_fingerprint_separates_formats_and_rotary_buffers():
    tok = make_tokenizer()
    model = _model("llama")
    fp32 = model_fingerprint(model, tok)
    assert model_fingerprint(model, tok) == fp32
    assert model_fingerprint(apply_weight_format(copy.deepcopy(model), "fp16"), tok) != fp32
    # The rotary inv_freq (a buffer, not a parameter) decides every key's rotation.
    moved = copy.deepcopy(model)
    moved.model.rotary_emb.inv_freq.mul_(1.01)
    assert model_fingerprint(moved, tok) != fp32


@pytest.mark.parametrize(
    "weights, setup, message",
    [
        ("int4", None, r"weights='int4' is not a weight format; choose one of auto, fp32, fp16"),
        ("fp16", lambda m: m.to(torch.bfloat16), r'needs a float32 model, not torch.bfloat16: load with dtype="float32"'),
        ("fp32", lambda m: apply_weight_format(m, "fp16"), r"already fp16; load it again to change the format"),
    ],
)
def test_weight_formats_that_cannot_run_are_refused_by_name(weights, setup, message):
    model = _model("llama")
    if setup is not None:
        setup(model)
    with pytest.raises(ModelLoadError, match=message):
        apply_weight_format(model, weights)


def test_auto_is_fp16_where_it_runs_and_the_models_own_weights_elsewhere(monkeypatch):
    model = _model("llama")
    assert resolve_weight_format(model, "auto") == "fp16"
    assert weight_format(apply_weight_format(copy.deepcopy(model), "auto")) == "fp16"
    assert resolve_weight_format(apply_weight_format(copy.deepcopy(model), "fp16"), "auto") == "fp16"
    # Where an explicit "fp16" is refused, "auto" leaves the model as it is instead.
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    assert weight_format(apply_weight_format(bf16, "auto")) == "fp32"
    assert next(bf16.parameters()).dtype == torch.bfloat16
    monkeypatch.setattr(torch.backends, "quantized", SimpleNamespace(supported_engines=["qnnpack", "none"]))
    assert resolve_weight_format(model, "auto") == "fp32"
    with pytest.raises(ModelLoadError, match=r'needs a torch build with fbgemm \(x86-64\); use weights="fp32"'):
        apply_weight_format(model, "fp16")


def test_from_pretrained_loads_fp16_weights_on_the_cpu_by_default(tmp_path):
    model = _model("llama")
    model.save_pretrained(tmp_path / "m")
    make_tokenizer().save_pretrained(tmp_path / "m")
    engine = CacheBlendEngine.from_pretrained(str(tmp_path / "m"), store_dir=str(tmp_path / "kv"))
    explicit = CacheBlendEngine.from_pretrained(str(tmp_path / "m"), weights="fp16", store_dir=str(tmp_path / "kv"))
    plain = CacheBlendEngine.from_pretrained(str(tmp_path / "m"), weights="fp32", store_dir=str(tmp_path / "kv2"))
    try:
        assert weight_format(engine.model) == "fp16"
        assert engine.fingerprint == explicit.fingerprint != plain.fingerprint  # caches of formats never mix
    finally:
        for e in (engine, explicit, plain):
            e.close()


def test_from_pretrained_refuses_an_unknown_format_before_loading(tmp_path):
    with pytest.raises(ModelLoadError, match="weights='int8' is not a weight format"):
        CacheBlendEngine.from_pretrained(str(tmp_path / "no-such-model"), weights="int8")


@pytest.mark.parametrize("masked", [False, True])
def test_decode_attention_reads_grouped_heads_like_sdpa(masked):
    class Attn:
        num_key_value_groups, is_causal = 3, True

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 9, 1, 16), torch.randn(2, 3, 30, 16), torch.randn(2, 3, 30, 16)
    mask = None
    if masked:  # left padding of the second answer in a batch
        mask = torch.ones(2, 1, 1, 30, dtype=torch.bool)
        mask[1, ..., :7] = False
    got, _ = _decode_sdpa(q, k, v, mask, 0.25)
    want, _ = sdpa_attention_forward(Attn(), q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weights", ["fp32", "fp16"])
def test_engine_decoding_gives_the_plain_models_greedy_tokens(weights):
    """The engine's decode step (packed grouped-query attention, growing cache) against
    transformers' own ``generate`` with its stock SDPA attention on the same weights."""
    model = apply_weight_format(_model("llama", layers=2), weights)
    plain = copy.deepcopy(model)
    engine = CacheBlendEngine(model, make_tokenizer(), store=KVStore(None))
    try:
        result = engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, mode="full_recompute", max_new_tokens=24, ignore_eos=True)
        ids = torch.tensor([list(engine.build_layout(SAMPLE_QUESTION, SAMPLE_CHUNKS).token_ids)])
    finally:
        engine.close()
    plain.set_attn_implementation("sdpa")
    with torch.inference_mode():
        out = plain.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
            generation_config=transformers.GenerationConfig(eos_token_id=None, pad_token_id=0),
        )
    assert result.token_ids == out[0, ids.shape[1] :].tolist()
    assert len(result.token_ids) == 24 and result.finish_reason == "length"


def test_ignore_eos_decodes_to_the_budget():
    engine = CacheBlendEngine(_model("llama"), make_tokenizer(), store=KVStore(None))
    try:
        first = engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, mode="full_recompute", max_new_tokens=1).token_ids[0]
        # Make the model's own first choice its end-of-sequence token: a normal answer is empty.
        engine.model.generation_config.eos_token_id = first
        stopped = engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, mode="full_recompute", max_new_tokens=12)
        forced = engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, mode="full_recompute", max_new_tokens=12, ignore_eos=True)
    finally:
        engine.close()
    assert stopped.token_ids == [] and stopped.finish_reason == "stop"
    assert len(forced.token_ids) == 12 and forced.token_ids[0] == first and forced.finish_reason == "length"
    with pytest.raises(TypeError, match="ignore_eos must be True or False, got str 'yes'"):
        engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, ignore_eos="yes")


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("weights", ["fp32", "fp16"])
def test_fast_decode_step_gives_the_forwards_logits_and_tokens(arch, weights):
    """The few-operation decode step against the model's forward on the same growing cache."""
    model = apply_weight_format(_model(arch), weights)
    engine = CacheBlendEngine(model, make_tokenizer(), store=KVStore(None))
    try:
        assert engine.fast_step is not None
        layout = engine.build_layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
        ours, theirs = engine.prefill(layout, "full_recompute").cache, engine.prefill(layout, "full_recompute").cache
        token = int(engine.prefill(layout, "full_recompute").logits.argmax())
        for position in range(len(layout), len(layout) + 12):
            got = engine.fast_step(token, position, ours)
            with torch.inference_mode():
                want = model(
                    input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[position]]), cache=theirs, use_cache=True
                ).logits[0, -1]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            token = int(want.argmax())
        for i in range(engine.num_layers):
            torch.testing.assert_close(_kv(ours, i)[0], _kv(theirs, i)[0], rtol=1e-4, atol=1e-5)
    finally:
        engine.close()


def test_fast_decode_step_is_not_built_where_the_layers_differ(caplog):
    import logging

    from cacheblend_rag.decode.step import FastDecodeStep

    assert FastDecodeStep.build(make_model("qwen3", head_dim=16), None) is None  # per-head q/k norms
    assert FastDecodeStep.build(_model("llama"), window=512) is None
    # A layer whose arithmetic differs from the pattern (here the MLP's output scaled, which the
    # fast step does not know) is caught by the check against the model's own forward.
    model = _model("llama")
    with caplog.at_level(logging.INFO, logger="cacheblend_rag.decode.step"):
        assert FastDecodeStep.build(model, None) is not None
        model.model.layers[1].mlp.register_forward_hook(lambda m, i, o: o * 1.5)
        assert FastDecodeStep.build(model, None) is None
    assert "the fast decode step differs from the model's forward (relative logit difference" in caplog.text
