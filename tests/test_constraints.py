"""Constrained decoding: the grammar's mask, the greedy shortcut, answers that parse in every
decoding path (one answer, the fast decode step, the batcher, plain chats)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from cacheblend_rag.decode.constraints import Grammar, allowed_tokens, apply_bitmask, closed_objects
from cacheblend_rag.decode.generation import Decoder, eos_token_ids
from cacheblend_rag.decode.sampling import SamplingParams
from cacheblend_rag.engine.plain import chat_text, plain_stream
from cacheblend_rag.serving import Batcher
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_engine

pytest.importorskip("llguidance")

# Every value bounded, so even a random model's answer ends inside the token budget.
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 12},
        "years": {"type": "integer", "minimum": 0, "maximum": 99},
        "sure": {"type": "boolean"},
        "unit": {"enum": ["years", "months"]},
    },
    "required": ["answer", "years", "sure", "unit"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine():
    eng = make_engine("llama")
    yield eng
    eng.close()


def _bits(words: torch.Tensor, vocab: int) -> list[bool]:
    return [bool((int(words[i // 32]) >> (i % 32)) & 1) if i // 32 < len(words) else False for i in range(vocab)]


def test_bitmask_is_read_bit_by_bit_and_tokens_past_it_are_refused():
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (5,), dtype=torch.int32, generator=gen)
    for vocab in (150, 160, 170):  # shorter than, equal to and wider than the bitmask (160 bits)
        want = _bits(words, vocab)
        assert allowed_tokens(words, vocab).astype(bool).tolist() == want
        logits = torch.randn(1, vocab, generator=gen)
        masked = apply_bitmask(logits.clone(), words)
        allowed = torch.tensor(want)
        assert torch.equal(masked[0, allowed], logits[0, allowed])  # allowed tokens untouched
        assert torch.isneginf(masked[0, ~allowed]).all()


def test_closed_objects_closes_every_object_but_keeps_explicit_choices():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "string"}}},
            "c": {"type": "array", "items": {"properties": {"d": {}}}},
            "e": {"type": "object", "properties": {}, "additionalProperties": True},
        },
    }
    out = closed_objects(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["items"]["additionalProperties"] is False
    assert out["properties"]["e"]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # the caller's schema is not changed


def test_greedy_choice_is_the_argmax_among_the_allowed_tokens(engine):
    """The greedy shortcut (take the unconstrained argmax when the grammar allows it) chooses what
    masking the whole vocabulary and taking the argmax would, whether the top token is allowed or not."""
    grammar = Grammar.json_schema(SCHEMA)
    eos = eos_token_ids(engine.model, engine.tokenizer)
    decoder = Decoder(engine.tokenizer, eos, SamplingParams(max_new_tokens=64, constraint=grammar))
    reference = grammar.start(engine.tokenizer, eos)
    gen = torch.Generator().manual_seed(1)
    shortcut = 0
    while not decoder.done:
        logits = torch.randn(400, generator=gen)
        masked = reference.mask(logits.clone().reshape(1, -1))
        want = int(masked.argmax())
        shortcut += int(logits.argmax()) == want
        token = decoder.choose(logits)
        assert token == want
        decoder.accept(token)
        reference.advance(token)
    assert 0 < shortcut < len(decoder.token_ids) + 1  # both branches ran
    jsonschema.validate(json.loads(decoder.text), SCHEMA)


@pytest.mark.parametrize("mode", ["cacheblend", "full_recompute", "prefix_caching"])
@pytest.mark.parametrize("seed", [None, 0, 1])
def test_constrained_answers_parse_and_match_the_schema(engine, mode, seed):
    sampling = {} if seed is None else {"temperature": 1.0, "seed": seed}
    res = engine.generate(
        SAMPLE_QUESTION, SAMPLE_CHUNKS, mode=mode, max_new_tokens=120, constraint=Grammar.json_schema(SCHEMA), **sampling
    )
    assert res.finish_reason == "stop", res.text
    jsonschema.validate(json.loads(res.text), SCHEMA)


def test_the_fast_decode_step_decodes_constrained_answers(engine):
    assert engine.fast_step is not None  # the tiny llama runs the fast step: the path under test
    res = engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, max_new_tokens=120, constraint=Grammar.regex(r"(yes|no)[.!]"))
    assert res.text in {"yes.", "yes!", "no.", "no!"} and res.finish_reason == "stop"


def test_batched_constrained_answers_equal_one_at_a_time(engine):
    grammar = Grammar.json_schema(SCHEMA)
    questions = [SAMPLE_QUESTION, "Where is the Eiffel Tower?", "Who won two Nobel prizes?"]
    alone = [engine.generate(q, SAMPLE_CHUNKS, max_new_tokens=120, constraint=grammar) for q in questions]
    with Batcher(engine, max_batch=3) as batcher:
        tickets = [batcher.submit(q, SAMPLE_CHUNKS, max_new_tokens=120, constraint=grammar) for q in questions]
        batched = [t.result() for t in tickets]
    for a, b in zip(alone, batched):
        assert b.token_ids == a.token_ids
        jsonschema.validate(json.loads(b.text), SCHEMA)


def test_plain_chats_take_the_constraint_too(engine):
    text = chat_text(engine.tokenizer, [{"role": "user", "content": "Give me a JSON answer."}])
    stream = plain_stream(engine, text, SamplingParams(max_new_tokens=120, constraint=Grammar.json_schema(SCHEMA)))
    assert json.loads("".join(stream)) == json.loads(stream.result.text)
    jsonschema.validate(json.loads(stream.result.text), SCHEMA)


def test_a_grammar_that_ends_stops_the_answer_even_with_ignore_eos(engine):
    res = engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, max_new_tokens=50, ignore_eos=True, constraint=Grammar.regex("a|b"))
    assert res.text in ("a", "b") and res.finish_reason == "stop"


def test_bad_grammars_and_constraints_are_refused_by_name():
    with pytest.raises(ValueError, match="kind='yaml'"):
        Grammar("yaml", "x")
    with pytest.raises(ValueError, match="not valid JSON"):
        Grammar.json_schema("{not json").llguidance_grammar()
    with pytest.raises(ValueError, match="lark grammar is not valid"):
        Grammar.lark("start: undefined_rule").llguidance_grammar()
    with pytest.raises(TypeError, match="Grammar.json_schema"):
        SamplingParams(constraint={"type": "object"})  # type: ignore[arg-type]
