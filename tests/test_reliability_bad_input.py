"""Bad input: every malformed request fails fast with a ValueError/TypeError raised by
cacheblend_rag itself, whose message names the problem and the fix; never a stack trace from deep
inside torch, transformers or the tokenizer. Duplicated chunks are de-duplicated, not an error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "reliability_helpers"))
from rel_common import CHUNKS, QUESTION, answer, engine, tokenizer

import cacheblend_rag
from cacheblend_rag import CacheBlendEngine

PACKAGE = Path(cacheblend_rag.__file__).parent
LONG = " ".join(f"word{i}" for i in range(1200))  # > 1024 tokens on its own


@pytest.fixture(scope="module")
def eng():
    e = engine(None)
    yield e
    e.close()


def _raised_by_us(exc: BaseException) -> None:
    last = exc.__traceback__
    while last.tb_next is not None:
        last = last.tb_next
    where = Path(last.tb_frame.f_code.co_filename).resolve()
    assert PACKAGE in where.parents, f"raised from {where}, not from cacheblend_rag: {exc!r}"


# (question, chunks, kwargs, error type, words the message must contain: problem ... fix)
GENERATE_CASES = {
    "empty-question": ("", CHUNKS, {}, ValueError, ["question is empty", "non-empty string"]),
    "whitespace-question": (" \n\t", CHUNKS, {}, ValueError, ["question is empty", "non-empty string"]),
    "bytes-question": (b"Where?", CHUNKS, {}, TypeError, ["question must be a str", "bytes"]),
    "none-question": (None, CHUNKS, {}, TypeError, ["question must be a str", "NoneType"]),
    "int-question": (42, CHUNKS, {}, TypeError, ["question must be a str", "int"]),
    "dict-question": ({"question": "x"}, CHUNKS, {}, TypeError, ["question must be a str", "dict"]),
    "no-chunks": (QUESTION, [], {}, ValueError, ["no chunks given", "at least one"]),
    "none-chunks": (QUESTION, None, {}, TypeError, ["list of strings", "NoneType"]),
    "str-chunks": (QUESTION, "one passage", {}, TypeError, ["list of strings", "wrap a single passage as [text]"]),
    "bytes-chunks": (QUESTION, b"one passage", {}, TypeError, ["list of strings", "bytes"]),
    "int-chunks": (QUESTION, 7, {}, TypeError, ["list of strings", "int"]),
    "dict-chunks": (QUESTION, {"a": "b"}, {}, TypeError, ["list of strings", "dict"]),
    "generator-chunks": (QUESTION, (c for c in CHUNKS), {}, TypeError, ["list of strings", "generator"]),
    "empty-chunk": (QUESTION, ["ok", ""], {}, ValueError, ["chunk 1 is empty", "drop it"]),
    "whitespace-chunk": (QUESTION, ["ok", " \n\t "], {}, ValueError, ["chunk 1 is empty or whitespace", "drop it"]),
    "bytes-chunk": (QUESTION, ["ok", b"raw"], {}, TypeError, ["chunk 1 is a bytes", "pass the passage text"]),
    "none-chunk": (QUESTION, [None], {}, TypeError, ["chunk 0 is a NoneType", "pass the passage text"]),
    "int-chunk": (QUESTION, ["ok", 3], {}, TypeError, ["chunk 1 is a int", "pass the passage text"]),
    "dict-chunk": (QUESTION, [{"page_content": "x"}], {}, TypeError, ["chunk 0 is a dict", "pass the passage text"]),
    "lone-surrogate-chunk": (QUESTION, ["ok", "caf\udce9"], {}, ValueError, ["chunk 1 is not valid Unicode", "errors='replace'"]),
    "lone-surrogate-question": ("wh\ud800y?", CHUNKS, {}, ValueError, ["question is not valid Unicode", "errors='replace'"]),
    "chunk-longer-than-window": (
        QUESTION,
        [LONG],
        {},
        ValueError,
        ["more than the model's context window of 1024", "split long documents"],
    ),
    "context-longer-than-window": (
        QUESTION,
        [f"{i} " + " ".join(f"w{j}" for j in range(300)) for i in range(5)],
        {},
        ValueError,
        ["more than the model's context window", "retrieve fewer or shorter chunks"],
    ),
    "answer-longer-than-window": (
        QUESTION,
        CHUNKS,
        {"max_new_tokens": 5000},
        ValueError,
        ["plus 5000 to generate", "lower max_new_tokens"],
    ),
    "unknown-mode": (QUESTION, CHUNKS, {"mode": "turbo"}, ValueError, ["unknown mode 'turbo'", "cacheblend"]),
    "ratio-nan": (QUESTION, CHUNKS, {"recompute_ratio": float("nan")}, ValueError, ["recompute_ratio=nan", "[0, 1]"]),
    "negative-temperature": (QUESTION, CHUNKS, {"temperature": -1.0}, ValueError, ["temperature=-1", ">= 0"]),
    "nan-temperature": (QUESTION, CHUNKS, {"temperature": float("nan")}, ValueError, ["temperature=nan", "finite number >= 0"]),
    "inf-temperature": (QUESTION, CHUNKS, {"temperature": float("inf")}, ValueError, ["temperature=inf", "finite number >= 0"]),
    "bool-ratio": (
        QUESTION,
        CHUNKS,
        {"recompute_ratio": True},
        TypeError,
        ["recompute_ratio must be a number", "bool True", "0.15"],
    ),
    "str-ratio": (QUESTION, CHUNKS, {"recompute_ratio": "0.5"}, TypeError, ["recompute_ratio must be a number", "str '0.5'"]),
    "dict-config": (
        QUESTION,
        CHUNKS,
        {"config": {"recompute_ratio": 0.2}},
        TypeError,
        ["config must be a BlendConfig, got dict", "BlendConfig(**options)"],
    ),
    "huge-seed": (
        QUESTION,
        CHUNKS,
        {"seed": 2**70, "temperature": 1.0},
        ValueError,
        [f"seed={2**70}", "64 bits", "[-2**63, 2**64)"],
    ),
}


@pytest.mark.parametrize("question, chunks, kwargs, error, words", GENERATE_CASES.values(), ids=GENERATE_CASES.keys())
def test_bad_request_gets_a_clear_error_from_our_code(eng, question, chunks, kwargs, error, words) -> None:
    with pytest.raises(error) as info:
        eng.generate(question, chunks, **kwargs)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {str(info.value)!r}"
    _raised_by_us(info.value)


PRECOMPUTE_CASES = {
    "none": (None, TypeError, ["precompute takes a list of chunk texts", "NoneType"]),
    "int": (5, TypeError, ["precompute takes a list of chunk texts", "int"]),
    "dict": ({"a": 1}, TypeError, ["precompute takes a list of chunk texts", "dict"]),
    "str": ("one passage", TypeError, ["single str", "wrap it as [text]"]),
    "bytes": (b"one passage", TypeError, ["single bytes", "wrap it as [text]"]),
    "bytes-item": ([b"raw"], TypeError, ["chunk 0 is a bytes", "pass the passage text"]),
    "whitespace-item": (["ok", "  "], ValueError, ["chunk 1 is empty or whitespace", "drop it"]),
    "surrogate-item": (["\udcff"], ValueError, ["chunk 0 is not valid Unicode", "errors='replace'"]),
    "too-long-item": ([LONG], ValueError, ["more than the model's context window", "split long documents"]),
}


@pytest.mark.parametrize("texts, error, words", PRECOMPUTE_CASES.values(), ids=PRECOMPUTE_CASES.keys())
def test_bad_precompute_input_gets_a_clear_error(eng, texts, error, words) -> None:
    with pytest.raises(error) as info:
        eng.precompute(texts, progress=False)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {str(info.value)!r}"
    _raised_by_us(info.value)


def test_is_cached_rejects_non_text(eng) -> None:
    with pytest.raises(TypeError, match="is_cached takes a chunk's text") as info:
        eng.is_cached(None)
    _raised_by_us(info.value)


def test_duplicated_chunks_answer_like_the_deduplicated_call(eng) -> None:
    # Documented: exact duplicates are dropped, first occurrence kept (order otherwise preserved).
    dup = [CHUNKS[0], CHUNKS[1], CHUNKS[0], CHUNKS[2], CHUNKS[1], CHUNKS[0]]
    dedup = [CHUNKS[0], CHUNKS[1], CHUNKS[2]]
    got, want = answer(eng, dup), answer(eng, dedup)
    assert got[0] == want[0] and torch.equal(got[1], want[1])
    other_order = answer(eng, [CHUNKS[2], CHUNKS[1], CHUNKS[0]])
    assert not torch.equal(other_order[1], want[1])  # order matters, so keeping it is meaningful


def test_odd_but_valid_text_is_answered(eng) -> None:
    # NULs, control characters, emoji, RTL text and lone combining marks are text: no error.
    odd = ["\x00\x01 nul and control", "emoji \U0001f600 and \u202eRTL\u202c", "\u0301 combining", "tab\tand\r\nCRLF"]
    res = eng.generate("what? \x00", odd, max_new_tokens=2)
    assert res.stats["chunks"] == len(odd) and len(res.token_ids) >= 1


def test_model_without_rope_is_refused_with_the_fix() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=400, bos_token_id=0, eos_token_id=0))
    with pytest.raises(ValueError) as info:
        CacheBlendEngine(gpt2, tokenizer())
    msg = str(info.value)
    assert "GPT2LMHeadModel has no rotary position embeddings" in msg
    assert "Use a RoPE decoder such as Llama" in msg
    _raised_by_us(info.value)
