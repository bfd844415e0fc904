"""Continuous batching: answers decoded together equal the answers decoded one at a time."""

from __future__ import annotations

import pytest

from cacheblend_rag import BlendConfig
from cacheblend_rag.serving import Batcher, Request, Run
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
        # The wait for a batch slot is part of the time to the first token.
        assert r.stats["queue_s"] <= r.ttft_s <= r.total_s and r.stats["mode"] == mode


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
        got = batcher.submit(SAMPLE_QUESTION, SAMPLE_CHUNKS, config=ape, max_new_tokens=6).result()
        plain.result()
    assert got.token_ids == want.token_ids


def test_bad_requests_fail_in_the_caller_and_a_closed_batcher_refuses(engine):
    with pytest.raises(ValueError, match="max_batch=0 must be an int >= 1"):
        Batcher(engine, max_batch=0)
    batcher = Batcher(engine)
    with pytest.raises(ValueError, match="no question text"):
        batcher.submit("  ", SAMPLE_CHUNKS)
    batcher.close()
    with pytest.raises(RuntimeError, match="the batcher is closed"):
        batcher.submit(SAMPLE_QUESTION, SAMPLE_CHUNKS)


# Cancellation. Every request below runs to max_new_tokens=LONG when left alone (the tiny models
# never pick EOS for them), so a result that is "cancelled" with fewer tokens was really cut short.
LONG = 40


@pytest.mark.parametrize("max_batch", [1, 4])
def test_a_cancelled_waiting_ticket_is_never_prefilled(engine, max_batch):
    engine.precompute(SAMPLE_CHUNKS, progress=False)
    want = engine.generate(*REQUESTS[1], max_new_tokens=6)
    with Batcher(engine, max_batch=max_batch) as batcher:
        # Holding the engine's lock, the worker can prefill nothing before the cancel: the request
        # is in the waiting line (max_batch=1) or admitted and waiting for the lock.
        with engine.lock:
            running = batcher.submit(*REQUESTS[1], max_new_tokens=6)
            waiting = batcher.submit(*REQUESTS[0], max_new_tokens=LONG)
            waiting.cancel()
            waiting.cancel()  # idempotent
        got = waiting.result(timeout=60)
        assert list(waiting) == []
        assert running.result(timeout=60).token_ids == want.token_ids
    assert waiting.stream.prefill_result is None
    assert (got.finish_reason, got.token_ids, got.text, got.stats["generated_tokens"]) == ("cancelled", [], "", 0)


def test_a_cancelled_running_answer_leaves_at_once_and_the_others_keep_their_tokens(engine):
    engine.precompute(SAMPLE_CHUNKS, progress=False)
    want = engine.generate(*REQUESTS[0], max_new_tokens=LONG)
    assert want.finish_reason == "length"
    alone = [engine.generate(*REQUESTS[i], max_new_tokens=24) for i in (1, 2)]
    with Batcher(engine, max_batch=4) as batcher:
        others = [batcher.submit(*REQUESTS[i], max_new_tokens=24) for i in (1, 2)]
        doomed = batcher.submit(*REQUESTS[0], max_new_tokens=LONG)
        deltas = iter(doomed)
        next(deltas)  # it is decoding in the batch
        with engine.lock:  # between two steps: none is in flight while it is cancelled
            for t in others:  # the others are still running beside it
                with pytest.raises(TimeoutError):
                    t.result(timeout=0)
            steps = batcher.steps
            doomed.cancel()
        got = doomed.result(timeout=60)
        together = [t.result(timeout=60) for t in others]
    assert got.finish_reason == "cancelled"
    # One token from its prefill and at most one per step run before the cancel: none after it.
    assert 0 < len(got.token_ids) <= steps + 1 < LONG
    assert got.token_ids == want.token_ids[: len(got.token_ids)]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]


def test_leaving_a_tickets_iteration_early_cancels_it(engine):
    engine.precompute(SAMPLE_CHUNKS, progress=False)
    with Batcher(engine) as batcher:
        broken, closed = (batcher.submit(*REQUESTS[i], max_new_tokens=LONG) for i in (0, 1))
        for _ in broken:
            break
        deltas = iter(closed)
        next(deltas)
        deltas.close()
        results = [t.result(timeout=60) for t in (broken, closed)]
    for r in results:
        assert r.finish_reason == "cancelled" and len(r.token_ids) < LONG


def test_a_batched_run_closed_early_or_cancelled_frees_its_row(engine):
    engine.precompute(SAMPLE_CHUNKS, progress=False)
    with Batcher(engine) as batcher:
        closed, cancelled = (
            Run(engine, Request.over_chunks(*REQUESTS[i]).with_settings(max_new_tokens=LONG), batcher=batcher) for i in (0, 1)
        )
        deltas = iter(closed)
        next(deltas)
        deltas.close()
        got = closed._ticket.result(timeout=60)
        assert got.finish_reason == "cancelled" and len(got.token_ids) < LONG

        deltas = iter(cancelled)
        next(deltas)
        cancelled.cancel()
        assert list(deltas) == []  # the run stops after the delta it was reading
        got = cancelled._ticket.result(timeout=60)
        assert got.finish_reason == "cancelled" and len(got.token_ids) < LONG
    assert closed.result is None and cancelled.result is None  # as an unbatched run stopped early


def test_the_batched_fast_step_gives_the_forwards_logits_over_left_padded_rows(engine):
    """The few-operation step the batch decodes with (``FastDecodeStep.batched``) against the
    model's forward with the same attention mask, on real prompts of different lengths."""
    import torch

    from cacheblend_rag.decode.cache import room_cache
    from cacheblend_rag.model.backbone import cache_kwarg
    from cacheblend_rag.serving.decode_batch import _pad_left

    assert engine.fast_step is not None
    pres = [engine.prefill(engine.build_layout(q, c), "full_recompute") for q, c in REQUESTS[:3]]
    lengths = [len(p.layout) for p in pres]
    width = max(lengths)
    keys = [torch.cat([_pad_left(p.cache.layers[i].keys, width) for p in pres]) for i in range(engine.num_layers)]
    values = [torch.cat([_pad_left(p.cache.layers[i].values, width) for p in pres]) for i in range(engine.num_layers)]
    mask = torch.cat([_pad_left(torch.ones(1, n, dtype=torch.long), width) for n in lengths])
    ours, theirs = room_cache(keys, values, 8), room_cache(keys, values, 8)
    tokens, positions = [int(p.logits.argmax()) for p in pres], list(lengths)
    for _ in range(8):
        mask = torch.cat([mask, mask.new_ones(len(pres), 1)], dim=1)
        got = engine.fast_step.batched(tokens, positions, ours, mask)
        with torch.inference_mode():
            want = engine.model(
                input_ids=torch.tensor(tokens)[:, None],
                position_ids=torch.tensor(positions)[:, None],
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=1,
                **{cache_kwarg(engine.model): theirs},
            ).logits[:, -1]
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-5)
        tokens, positions = [int(t) for t in want.argmax(-1)], [p + 1 for p in positions]
