"""The baselines outside the engine (``bench.baselines``): transformers' ``generate()`` and llama.cpp.

``generate`` runs on the tiny engine's own model, so its greedy answer and first-token logits must be
full prefill's. llama.cpp runs only where ``llama-cpp-python`` is installed (not in CI: it builds from
source), on the bundled SmolLM2 GGUF, against the engine's full prefill of the same prompt.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cacheblend_bench.baselines import GenerateBaseline, gguf_for, make_baseline, quantized
from cacheblend_bench.methods import parse_methods
from cacheblend_rag.metrics import next_token_kl
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_engine


@pytest.fixture(scope="module")
def engine():
    eng = make_engine("llama")
    yield eng
    eng.close()


def test_generate_gives_full_prefills_answer_and_logits(engine):
    res = engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, mode="full_recompute", max_new_tokens=12, temperature=0.0)
    ref = engine.next_token_logits(SAMPLE_QUESTION, SAMPLE_CHUNKS, "full_recompute")
    a = GenerateBaseline(engine).answer(engine, SAMPLE_QUESTION, SAMPLE_CHUNKS, 12)
    assert a.text == res.text.strip()
    assert a.prompt_tokens == len(engine.build_layout(SAMPLE_QUESTION, SAMPLE_CHUNKS))
    assert a.generated_tokens == res.stats["generated_tokens"]
    assert torch.allclose(a.logits, ref.reshape(-1).float(), atol=1e-4)
    assert 0 < a.ttft_s <= a.total_s


def test_baseline_method_names_and_errors():
    names = [(m.name, m.kind, m.quant) for m in parse_methods(["generate", "llama_cpp", "llama_cpp_prefix:f16"])]
    assert names == [
        ("generate", "generate", None),
        ("llama_cpp", "llama_cpp", None),
        ("llama_cpp_prefix:f16", "llama_cpp_prefix", "f16"),
    ]
    with pytest.raises(ValueError, match="unknown llama.cpp quantisation 'q9'; choose from f32, f16"):
        parse_methods(["llama_cpp:q9"])
    with pytest.raises(ValueError, match="run a GGUF file; --model 'tiny' is none"):
        gguf_for("tiny")
    with pytest.raises(ValueError, match="unknown baseline 'nope'"):
        make_baseline("nope", None, None, "smollm2")


def test_missing_llama_cpp_names_the_install(monkeypatch, tmp_path):
    import builtins

    real = builtins.__import__

    def no_llama(name, *args, **kwargs):
        if name == "llama_cpp":
            raise ImportError("No module named 'llama_cpp'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llama)
    with pytest.raises(ImportError, match="pip install llama-cpp-python==0.3.36"):
        quantized(tmp_path / "m.gguf", "f16", tmp_path)


@pytest.mark.llamacpp
@pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed: pip install -e '.[llamacpp]' or run .ci/llamacpp",
)
def test_llama_cpp_answers_the_engines_prompt(tmp_path, monkeypatch):
    from cacheblend_rag.engine.core import CacheBlendEngine

    monkeypatch.setenv("CACHEBLEND_RAG_HOME", str(tmp_path))  # the f16 copy goes here
    eng = CacheBlendEngine.from_pretrained(store_dir=str(tmp_path / "kv"))
    try:
        ref = eng.next_token_logits(SAMPLE_QUESTION, SAMPLE_CHUNKS, "full_recompute").reshape(-1).float()
        full = make_baseline("llama_cpp", "f16", eng, "smollm2")
        prefix = make_baseline("llama_cpp_prefix", "f16", eng, "smollm2")
        a = full.answer(eng, SAMPLE_QUESTION, SAMPLE_CHUNKS, 8)
        b = prefix.answer(eng, SAMPLE_QUESTION, SAMPLE_CHUNKS, 8)
        # llama.cpp computes in f16/f32 with its own kernels: close to the engine, not bit-equal.
        assert int(a.logits.argmax()) == int(ref.argmax())
        assert next_token_kl(ref, a.logits) < 0.05
        # Its prefix reuse evaluates fewer tokens and must not change the result.
        assert b.text == a.text and torch.allclose(a.logits, b.logits, atol=1e-2)
        full.close()
        prefix.close()
    finally:
        eng.close()
