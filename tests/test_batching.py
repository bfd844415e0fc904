"""Continuous batching: answers decoded together equal the answers decoded one at a time."""

from __future__ import annotations

import pytest

from cacheblend_rag import BlendConfig
from cacheblend_rag.batching import Batcher
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION

# Prompts of different lengths, so the batch's rows are left-padded against each other.
REQUESTS = [
    (SAMPLE_QUESTION, SAMPLE_CHUNKS),
    ("Which river is mentioned?", SAMPLE_CHUNKS[:1]),
    ("Name one planet.", SAMPLE_CHUNKS[1:] + SAMPLE_CHUNKS[:1]),
    ("Who is the scientist?", SAMPLE_CHUNKS[::-1]),
    ("What is the answer?", SAMPLE_CHUNKS[:2]),
]


@pytest.mark.parametrize("mode", ["cacheblend", "full_recompute"])
def test_batched_answers_equal_one_at_a_time(engine, mode):
    engine.precompute(SAMPLE_CHUNKS, progress=False)
    alone = [engine.generate(q, c, mode=mode, max_new_tokens=10) for q, c in REQUESTS]
    with Batcher(engine, max_batch=4) as batcher:
        tickets = [batcher.submit(q, c, mode=mode, max_new_tokens=10) for q, c in REQUESTS]
        together = [t.result(timeout=120) for t in tickets]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [r.text for r in together] == [r.text for r in alone]
    # The five requests really shared decode steps: more answers advanced than steps taken.
    assert batcher.rows_stepped > batcher.steps > 0
    for r in together:
        assert 0 < r.ttft_s <= r.total_s and r.stats["queue_s"] >= 0 and r.stats["mode"] == mode


def test_streamed_deltas_stop_strings_and_sampling_match(engine):
    engine.precompute(SAMPLE_CHUNKS, progress=False)
    kwargs = [dict(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=7), dict(max_new_tokens=3), dict(max_new_tokens=12)]
    first = engine.generate(*REQUESTS[0], max_new_tokens=12)
    stop = first.text[2:4] if len(first.text) > 4 else None  # ends this answer early, inside the batch
    kwargs[2]["stop"] = stop
    alone = [engine.generate(*REQUESTS[i], **kw) for i, kw in enumerate(kwargs)]
    with Batcher(engine) as batcher:
        tickets = [batcher.submit(*REQUESTS[i], **kw) for i, kw in enumerate(kwargs)]
        streamed = ["".join(t) for t in tickets]
        results = [t.result() for t in tickets]
    assert streamed == [r.text for r in results] == [r.text for r in alone]
    assert [r.finish_reason for r in results] == [r.finish_reason for r in alone]


def test_ape_requests_are_decoded_on_their_own_with_the_same_answer(engine):
    engine.precompute(SAMPLE_CHUNKS, progress=False)
    ape = BlendConfig(context_temperature=0.9, context_scale=0.9)
    want = engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, config=ape, max_new_tokens=6)
    with Batcher(engine) as batcher:
        plain = batcher.submit(*REQUESTS[1], max_new_tokens=6)
        got = batcher.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, config=ape, max_new_tokens=6)
        plain.result()
    assert got.token_ids == want.token_ids


def test_bad_requests_fail_in_the_caller_and_a_closed_batcher_refuses(engine):
    with pytest.raises(ValueError, match="max_batch=0 must be an int >= 1"):
        Batcher(engine, max_batch=0)
    batcher = Batcher(engine)
    with pytest.raises(ValueError, match="question is empty"):
        batcher.submit("  ", SAMPLE_CHUNKS)
    batcher.close()
    with pytest.raises(RuntimeError, match="the batcher is closed"):
        batcher.submit(SAMPLE_QUESTION, SAMPLE_CHUNKS)
