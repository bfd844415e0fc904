"""Adaptive recompute (BlendConfig.escalation): a prompt whose blended first-token margin is low is
blended again at a larger ratio, then prefilled in full. Each step's answer must be exactly the
answer a fixed-ratio prefill at that step's ratio gives (the step reuses the first pass's scores
and loaded K/V, which must not leak the earlier pass's recomputed rows), and the last step's
exactly full prefill's."""

from __future__ import annotations

import math

import pytest
import torch

from cacheblend_rag import BlendConfig
from cacheblend_rag.testing import make_engine

CHUNKS = [
    "The Thames flows through Oxford and then London before reaching the sea.",
    "Oxford is home to the oldest university in the English-speaking world.",
    "London has been the capital of England for nearly a thousand years.",
    "The Cherwell joins the Thames at Oxford, south of the city centre.",
]
QUESTIONS = ["Which river flows through Oxford?", "What is the capital of England?"]
N = 6
INF = math.inf


@pytest.fixture(params=["llama", "qwen2"])
def engine(request, tmp_path):
    eng = make_engine(request.param, seed=0, store_dir=tmp_path / "kv", pipelined=False)
    eng.precompute(CHUNKS, progress=False)
    yield eng
    eng.close()


def _same(a, b) -> None:
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)


@pytest.mark.parametrize("strategy", ["question", "chunk", "hkvd"])
def test_no_step_escalates_gives_the_fixed_ratio_prefill(engine, strategy):
    fixed = BlendConfig(recompute_ratio=0.15, strategy=strategy, escalation=())
    # A margin is never below 0: no step runs, and the answer is the first pass's.
    adaptive = BlendConfig(recompute_ratio=0.15, strategy=strategy, escalation=((0.0, 0.3), (0.0, 0.6), (0.0, 1.0)))
    for q in QUESTIONS:
        layout = engine.build_layout(q, CHUNKS)
        got, want = engine.prefill(layout, "cacheblend", adaptive), engine.prefill(layout, "cacheblend", fixed)
        _same(got, want)
        assert got.stats["recompute_steps"] == [0.15] and got.stats["escalated"] is False
        assert got.stats["step_margins"] == [pytest.approx(got.stats["first_token_margin"])]
        assert engine.generate(q, CHUNKS, config=adaptive, max_new_tokens=N).token_ids == (
            engine.generate(q, CHUNKS, config=fixed, max_new_tokens=N).token_ids
        )


@pytest.mark.parametrize("strategy", ["question", "chunk", "hybrid", "hkvd"])
def test_every_partial_step_gives_exactly_the_fixed_ratio_answer_at_its_ratio(engine, strategy):
    for q in QUESTIONS:
        layout = engine.build_layout(q, CHUNKS)
        for steps, last in ((((INF, 0.3),), 0.3), (((INF, 0.3), (INF, 0.6)), 0.6), (((INF, 0.3), (0.0, 0.6)), 0.3)):
            adaptive = BlendConfig(strategy=strategy, escalation=steps)
            fixed = BlendConfig(strategy=strategy, recompute_ratio=last, escalation=())
            got = engine.prefill(layout, "cacheblend", adaptive)
            _same(got, engine.prefill(layout, "cacheblend", fixed))
            assert got.stats["recompute_steps"] == [0.15, *[r for _, r in steps if r <= last]]
            assert got.stats["recompute_ratio"] == last
            assert len(got.stats["step_margins"]) == len(got.stats["recompute_steps"])
            greedy = engine.generate(q, CHUNKS, config=adaptive, max_new_tokens=N)
            assert greedy.token_ids == engine.generate(q, CHUNKS, config=fixed, max_new_tokens=N).token_ids


def test_the_last_step_gives_exactly_full_prefill(engine):
    adaptive = BlendConfig(escalation=((INF, 0.3), (INF, 0.6), (INF, 1.0)))
    for q in QUESTIONS:
        layout = engine.build_layout(q, CHUNKS)
        got = engine.prefill(layout, "cacheblend", adaptive)
        _same(got, engine.prefill(layout, "full_recompute_saved"))
        assert got.stats["escalated"] is True and got.stats["recompute_steps"] == [0.15, 0.3, 0.6, 1.0]
        full = engine.generate(q, CHUNKS, mode="full_recompute_saved", max_new_tokens=N)
        assert engine.generate(q, CHUNKS, config=adaptive, max_new_tokens=N).token_ids == full.token_ids


def test_a_cascade_that_stops_never_reaches_full_prefill(engine):
    layout = engine.build_layout(QUESTIONS[0], CHUNKS)
    stopped = engine.prefill(layout, "cacheblend", BlendConfig(escalation=((INF, 0.3), (0.0, 0.6), (INF, 1.0))))
    _same(stopped, engine.prefill(layout, "cacheblend", BlendConfig(recompute_ratio=0.3, escalation=())))
    assert stopped.stats["escalated"] is False and stopped.stats["recompute_steps"] == [0.15, 0.3]


def test_a_step_fires_exactly_below_its_margin(engine):
    layout = engine.build_layout(QUESTIONS[0], CHUNKS)
    m = engine.prefill(layout, "cacheblend", BlendConfig(escalation=())).stats["first_token_margin"]
    at = engine.prefill(layout, "cacheblend", BlendConfig(escalation=((m, 0.3),)))
    above = engine.prefill(layout, "cacheblend", BlendConfig(escalation=((m + 1e-3, 0.3),)))
    assert at.stats["recompute_steps"] == [0.15] and above.stats["recompute_steps"] == [0.15, 0.3]


def test_full_reuse_takes_only_the_full_step_and_guard_margin_is_that_step(engine):
    layout = engine.build_layout(QUESTIONS[0], CHUNKS)
    reuse = engine.prefill(layout, "full_reuse", BlendConfig(escalation=((INF, 0.3),)))
    _same(reuse, engine.prefill(layout, "full_reuse", BlendConfig(escalation=())))
    full = engine.prefill(layout, "full_reuse", BlendConfig(escalation=((INF, 0.3), (INF, 1.0))))
    _same(full, engine.prefill(layout, "full_recompute_saved"))
    # guard_margin replaces the escalation's full step: here it never fires, so 0.3 answers.
    cfg = BlendConfig(escalation=((INF, 0.3), (INF, 1.0)), guard_margin=0.0)
    assert cfg.escalation_steps() == ((INF, 0.3), (0.0, 1.0))
    _same(
        engine.prefill(layout, "cacheblend", cfg),
        engine.prefill(layout, "cacheblend", BlendConfig(recompute_ratio=0.3, escalation=())),
    )


def test_steps_at_or_below_the_ratio_are_skipped():
    cfg = BlendConfig(recompute_ratio=0.3, escalation=((1.0, 0.3), (0.5, 0.6), (0.2, 1.0)))
    assert cfg.escalation_steps() == ((0.5, 0.6), (0.2, 1.0))
    assert BlendConfig(recompute_ratio=1.0, escalation=((1.0, 0.3), (0.2, 1.0))).escalation_steps() == ()
    assert BlendConfig(escalation=[[1.0, 0.3]]).escalation == ((1.0, 0.3),)  # lists, as from JSON


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        (((1.0, 0.6), (0.5, 0.3)), "larger than the one before"),
        (((1.0, 1.5),), "at most 1.0"),
        (((float("nan"), 0.3),), "the margin must be a number >= 0"),
        (((-1.0, 0.3),), "the margin must be a number >= 0"),
        (((1.0, True),), "the ratio must be a number >= 0"),
        (((1.0,),), r"pass \(\(margin, ratio\), ...\)"),
        ("0.3", r"pass \(\(margin, ratio\), ...\)"),
    ],
)
def test_escalation_refuses_what_is_not_a_cascade(steps, message):
    with pytest.raises(ValueError, match=message):
        BlendConfig(escalation=steps)
