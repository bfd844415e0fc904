"""The fidelity guard: below the threshold the answer is full prefill's exactly; off, nothing changes;
the margin is reported either way. And its trade computed offline from fidelity rows."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cacheblend_rag import BlendConfig
from cacheblend_rag.bench import guard_curve
from cacheblend_rag.guard import escalates, first_token_margin
from cacheblend_rag.testing import make_engine

CHUNKS = [
    "The Thames flows through Oxford and then London before reaching the sea.",
    "Oxford is home to the oldest university in the English-speaking world.",
    "London has been the capital of England for nearly a thousand years.",
]
QUESTIONS = ["Which river flows through Oxford?", "What is the capital of England?", "Name a university."]
N = 6


@pytest.fixture(params=["llama", "qwen2"])
def engine(request, tmp_path):
    eng = make_engine(request.param, seed=0, store_dir=tmp_path / "kv", pipelined=False)
    eng.precompute(CHUNKS, progress=False)
    yield eng
    eng.close()


def test_margin_is_the_log_probability_gap_of_the_top_two():
    logits = torch.tensor([0.0, 2.0, 1.0])
    logp = torch.log_softmax(logits, -1)
    assert first_token_margin(logits) == pytest.approx(float(logp[1] - logp[2]))
    assert first_token_margin(torch.tensor([3.0, 3.0])) == 0.0
    assert not escalates(0.0, None) and escalates(0.1, 0.2) and not escalates(0.2, 0.2)


@pytest.mark.parametrize("mode", ["cacheblend", "full_reuse"])
def test_a_threshold_above_every_margin_answers_every_question_as_full_prefill(engine, mode):
    guarded = BlendConfig(guard_margin=math.inf)
    for q in QUESTIONS:
        full = engine.generate(q, CHUNKS, mode="full_recompute_saved", max_new_tokens=N)
        got = engine.generate(q, CHUNKS, mode=mode, config=guarded, max_new_tokens=N)
        blended = engine.generate(q, CHUNKS, mode=mode, max_new_tokens=N)
        assert got.token_ids == full.token_ids
        assert got.stats["escalated"] is True and got.stats["mode"] == "full_recompute_saved"
        # The margin reported is the blended prefill's own, which decided the escalation.
        assert got.stats["first_token_margin"] == pytest.approx(blended.stats["first_token_margin"])
        layout = engine.build_layout(q, CHUNKS)
        torch.testing.assert_close(
            engine.prefill(layout, mode, guarded).logits, engine.prefill(layout, "full_recompute_saved").logits, rtol=0, atol=0
        )


def test_without_a_threshold_nothing_changes_and_the_margin_is_reported(engine):
    layout = engine.build_layout(QUESTIONS[0], CHUNKS)
    off = engine.prefill(layout, "cacheblend", BlendConfig())
    zero = engine.prefill(layout, "cacheblend", BlendConfig(guard_margin=0.0))  # a margin is never < 0
    torch.testing.assert_close(zero.logits, off.logits, rtol=0, atol=0)
    assert off.stats["escalated"] is False and zero.stats["escalated"] is False
    assert off.stats["first_token_margin"] == pytest.approx(first_token_margin(off.logits))
    assert off.stats["mode"] == "cacheblend" and off.stats["recompute_fraction"] < 1.0
    # The guard fires exactly below the threshold: just above the margin escalates, at it does not.
    m = off.stats["first_token_margin"]
    assert engine.prefill(layout, "cacheblend", BlendConfig(guard_margin=m)).stats["escalated"] is False
    assert engine.prefill(layout, "cacheblend", BlendConfig(guard_margin=m + 1e-3)).stats["escalated"] is True


def test_an_escalated_streamed_answer_reads_no_cached_tokens(engine):
    stream = engine.stream(QUESTIONS[0], CHUNKS, config=BlendConfig(guard_margin=math.inf), max_new_tokens=2)
    pre = stream.prefill(count_cache_reads=True)
    assert pre.stats["escalated"] and pre.stats["cache_read_tokens"] == 0


@pytest.mark.parametrize("bad", [-0.1, float("nan"), True, "0.5"])
def test_guard_margin_refuses_what_is_not_a_margin(bad):
    with pytest.raises(ValueError, match="guard_margin"):
        BlendConfig(guard_margin=bad)


# ---------------------------------------------------------------------- the curve from rows
def _rows() -> list[dict]:
    """Four questions: the method agrees on the two confident ones (margins 2 and 3) only."""
    rows = []
    for i, (margin, agree) in enumerate([(0.1, False), (0.5, False), (2.0, True), (3.0, True)]):
        base = {"model": "m", "dataset": "hotpotqa" if i < 2 else "musique", "qid": str(i)}
        rows.append(dict(base, method="question@0.15", margin=margin, agree=agree, agree_f1=1.0 if agree else 0.5, ttft_s=0.1))
        rows.append(dict(base, method="full_recompute_saved", margin=margin + 5, agree=True, agree_f1=1.0, ttft_s=0.5))
    rows.append({"model": "m", "dataset": "hotpotqa", "qid": "9", "method": "question@0.15", "agree": True, "ttft_s": 0.1})
    return rows


def test_curve_escalates_questions_below_the_threshold_at_both_prefills_cost():
    rows = _rows()
    by_t = {e["threshold"]: e for e in guard_curve.curve(rows, "question@0.15", (0.0, 1.0, math.inf))}
    assert {e["n"] for e in by_t.values()} == {4}  # the row without a margin is left out
    assert by_t[0.0]["escalated"] == 0 and by_t[0.0]["agree"] == 0.5 and by_t[0.0]["ttft_mean_s"] == pytest.approx(0.1)
    assert by_t[0.0]["speedup_vs_saved"] == pytest.approx(5.0)
    one = by_t[1.0]
    assert one["escalated"] == 0.5 and one["agree"] == 1.0 and one["agree_f1"] == 1.0
    assert one["ttft_mean_s"] == pytest.approx((0.6 + 0.6 + 0.1 + 0.1) / 4)
    assert one["ttft_p95_s"] == pytest.approx(0.6)
    assert by_t[math.inf]["escalated"] == 1.0 and by_t[math.inf]["ttft_mean_s"] == pytest.approx(0.6)
    musique = guard_curve.curve(rows, "question@0.15", (1.0,), dataset="musique")[0]
    assert musique["n"] == 2 and musique["escalated"] == 0.0


def test_curve_without_escalation_rows_names_the_run_to_make():
    rows = [r for r in _rows() if r["method"] != "full_recompute_saved"]
    with pytest.raises(ValueError, match="--methods question@0.15,full_recompute_saved"):
        guard_curve.curve(rows, "question@0.15")


def test_command_prints_the_table(tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _rows()) + "\n{cut short", encoding="utf-8")
    assert guard_curve.main([str(path), "--thresholds", "0,1"]) == 0
    out = capsys.readouterr().out
    assert "| `question@0.15` | 1 | 50% | 100% | 1.000 | 350 ms | 600 ms | 1.43x |" in out
    assert "full_recompute_saved`" not in out  # the escalation is not a method of its own curve
