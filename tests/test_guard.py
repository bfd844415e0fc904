"""The fidelity guard: below the threshold the answer is full prefill's exactly; off, nothing changes;
the margin is reported either way. And its trade computed offline from fidelity rows."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cacheblend_bench import guard_curve
from cacheblend_rag import BlendConfig
from cacheblend_rag.blend.guard import escalates, first_token_margin
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


# ---------------------------------------------------------------------- adaptive cascades from rows
def _cascade_rows() -> list[dict]:
    """Three questions over 0.15 -> 0.3 -> full: q0 is fixed at 0.3, q1 only by full prefill, q2
    agrees from the start (its margin is high)."""
    spec = {  # qid: [(margin, agree) at 0.15, at 0.3]
        "0": [(0.1, False), (0.2, True)],
        "1": [(0.1, False), (0.1, False)],
        "2": [(2.0, True), (2.0, True)],
    }
    rows = []
    for qid, steps in spec.items():
        base = {"model": "m", "dataset": "musique", "qid": qid, "f1": 0.5}
        for (margin, agree), (method, ttft) in zip(steps, (("question@0.15", 1.0), ("question@0.3", 2.0))):
            rows.append(dict(base, method=method, margin=margin, agree=agree, agree_f1=1.0 if agree else 0.0, ttft_s=ttft))
        rows.append(dict(base, method="full_recompute_saved", margin=3.0, agree=True, agree_f1=1.0, ttft_s=6.0))
    return rows


CHAIN = ["question@0.15", "question@0.3", "full_recompute_saved"]


def test_a_cascade_walks_the_steps_below_their_margins_and_pays_every_pass():
    qs = guard_curve.by_question(_cascade_rows(), CHAIN)
    none = guard_curve.cascade(qs, CHAIN, (0.0, 0.0))
    assert none["agree"] == pytest.approx(1 / 3) and none["ttft_mean_s"] == pytest.approx(1.0) and none["reached"] == [0, 0]
    assert none["speedup_vs_saved"] == pytest.approx(6.0)
    # q0 and q1 move to 0.3 (margin 0.1 < 0.5); there q1 (0.1 < 0.15) moves on to full, q0 (0.2) stops.
    two = guard_curve.cascade(qs, CHAIN, (0.5, 0.15))
    assert two["reached"] == [pytest.approx(2 / 3), pytest.approx(1 / 3)] and two["agree"] == 1.0
    assert two["ttft_mean_s"] == pytest.approx(((1 + 2) + (1 + 2 + 6) + 1) / 3)
    # A step that does not fire ends the cascade: the full step is never reached.
    assert guard_curve.cascade(qs, CHAIN, (0.0, math.inf))["reached"] == [0, 0]
    with pytest.raises(ValueError, match="takes 2 margins, got 1"):
        guard_curve.cascade(qs, CHAIN, (0.5,))


def test_the_frontier_keeps_only_cascades_no_other_beats_on_both_agreement_and_speed():
    qs = guard_curve.by_question(_cascade_rows(), CHAIN)
    front = guard_curve.frontier(qs, CHAIN)
    speeds = [e["speedup_vs_saved"] for e in front]
    agrees = [e["agree"] for e in front]
    assert speeds == sorted(speeds, reverse=True) and agrees == sorted(agrees) and len(set(agrees)) == len(agrees)
    assert front[0]["methods"] == ["question@0.15"] and front[-1]["agree"] == 1.0
    # Full agreement costs least starting at 0.3 (q0 and q2 stop there): 4 s mean, against 13/3
    # for 0.15 -> 0.3 -> full and 5 for 0.15 -> full.
    assert front[-1]["methods"] == CHAIN[1:] and front[-1]["ttft_mean_s"] == pytest.approx(4.0)
    assert guard_curve.cascade(qs, CHAIN, (0.5, 0.15))["ttft_mean_s"] == pytest.approx(13 / 3)
    assert len(guard_curve.frontier(qs, CHAIN, max_steps=1)) <= len(front)
    assert guard_curve.best_within(front, 6.0)["methods"] == ["question@0.15"]
    assert guard_curve.best_within(front, 7.0) is None


def test_cascade_command_prints_the_frontier(tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _cascade_rows()), encoding="utf-8")
    assert guard_curve.main([str(path), "--cascade", ",".join(CHAIN), "--margins", "0.5,0.15"]) == 0
    assert (
        "| `question@0.15` -> `question@0.3` -> `full_recompute_saved` | 0.5, 0.15 | 67%, 33% | 100% |" in capsys.readouterr().out
    )
    with pytest.raises(SystemExit):
        guard_curve.main([str(path), "--cascade", ",".join(CHAIN)])
    assert "--margins (one cascade) or --search" in capsys.readouterr().err


def test_cascade_search_draws_the_frontier_and_the_fixed_ratios(tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _cascade_rows()), encoding="utf-8")
    png = tmp_path / "plot.png"
    assert guard_curve.main([str(path), "--cascade", ",".join(CHAIN), "--search", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "| `question@0.15` |  |  | 33% |" in out and "| 100% |" in out


def test_an_engine_escalation_reads_as_a_cascade_over_fixed_ratio_methods():
    methods, margins = guard_curve.escalation_cascade("question@0.15/nb", ((1.0, 0.3), (0.5, 0.6), (0.2, 1.0)))
    assert methods == ["question@0.15/nb", "question@0.3/nb", "question@0.6/nb", "full_recompute_saved"]
    assert margins == [1.0, 0.5, 0.2]
    assert guard_curve.escalation_cascade("chunk@0.1", ((0.3, 0.25),)) == (["chunk@0.1", "chunk@0.25"], [0.3])


def _decode_rows() -> list[dict]:
    """Two questions of a 4-token answer (ended: 5 positions); a cheap method, a mid one, full prefill."""

    def row(qid, method, ttft, margins, leaves):
        return {
            "model": "m",
            "dataset": "d",
            "qid": qid,
            "method": method,
            "ttft_s": ttft,
            "margin": margins[0],
            "tf_margins": margins,
            "tf_leaves": leaves,
            "answer_tokens_full": 4,
            "max_new_tokens": 16,
            "agree": not leaves,
            "agree_f1": 1.0 if not leaves else 0.5,
        }

    return [
        # q1 leaves full prefill's answer at position 3, after a low margin at 2
        row("q1", "question@0.15", 1.0, [2.0, 2.0, 0.1, 0.3, 2.0], [3, 4]),
        row("q1", "question@0.6", 3.0, [2.0, 2.0, 0.4, 2.0, 2.0], [1]),
        row("q1", "full_recompute_saved", 8.0, [2.0] * 5, []),
        # q2 agrees throughout with a low first margin
        row("q2", "question@0.15", 1.0, [0.2, 2.0, 2.0, 2.0, 2.0], []),
        row("q2", "question@0.6", 3.0, [1.0, 2.0, 2.0, 2.0, 2.0], []),
        row("q2", "full_recompute_saved", 8.0, [2.0] * 5, []),
    ]


DECODE_CHAIN = ["question@0.15", "question@0.6", "full_recompute_saved"]


def test_a_decode_cascade_moves_on_at_the_first_low_margin_position_and_pays_each_prefill():
    qs = guard_curve.by_question(_decode_rows(), DECODE_CHAIN)
    never = guard_curve.decode_cascade(qs, DECODE_CHAIN, (0.0, 0.0))
    assert never["agrees"] == [False, True] and never["ttft_mean_s"] == never["prefill_mean_s"] == 1.0
    # q1 moves to 0.6 at position 2 (0.1 < 0.15): 0.6 leaves the answer only at position 1, before
    # it is used, so q1 agrees.
    # q2 moves at its first token (0.2 < 0.5 would; 0.2 < 0.15 does not).
    one = guard_curve.decode_cascade(qs, DECODE_CHAIN, (0.15, 0.0))
    assert one["agrees"] == [True, True] and one["moved_later"] == 0.5 and one["reached"] == [0.5, 0.0]
    assert one["ttft_mean_s"] == 1.0 and one["prefill_mean_s"] == pytest.approx((1 + 3 + 1) / 2)
    # A higher first margin moves q2 at its first token (charged to the TTFT); at 0.6, q1's 0.4 at
    # position 2 is below 0.5 as well: full prefill, charged to the answer's later prefills.
    both = guard_curve.decode_cascade(qs, DECODE_CHAIN, (0.5, 0.5))
    assert both["agrees"] == [True, True] and both["reached"] == [1.0, 0.5]
    assert both["ttft_mean_s"] == pytest.approx((1 + 4) / 2)
    assert both["prefill_mean_s"] == pytest.approx((1 + 3 + 8 + 4) / 2)
    assert both["speedup_vs_saved"] == pytest.approx(8 / 2.5)
    # The first-token cascade only looks at position 0: q1 keeps the cheap answer and its error.
    assert guard_curve.cascade(qs, DECODE_CHAIN, (0.5, 0.5))["agrees"] == [False, True]


def test_a_decode_cascade_over_rows_without_positions_names_the_run_to_make():
    rows = [{k: v for k, v in r.items() if k != "tf_leaves"} for r in _decode_rows()]
    with pytest.raises(ValueError, match="tf_leaves: rerun `cacheblend-rag fidelity`"):
        guard_curve.decode_cascade(guard_curve.by_question(rows, DECODE_CHAIN), DECODE_CHAIN, (0.1, 0.1))


def test_a_run_without_the_saved_full_prefill_prices_the_last_step_from_its_reference(tmp_path, capsys):
    # Rows carry their question's reference full prefill: with --full-from-reference it stands in
    # for the missing full_recompute_saved row, as if that method had run (same TTFT, margins).
    reference = {"q1": (8.0, [2.0] * 5), "q2": (6.0, [1.5] * 5)}
    rows = []
    for r in _decode_rows():
        if r["method"] == "full_recompute_saved":
            continue
        ttft, margins = reference[r["qid"]]
        rows.append(dict(r, ttft_full_s=ttft, margin_full=margins[0], tf_margins_full=margins, f1=0.0, f1_full=0.5))
    made = [r for r in guard_curve.with_reference_rows(rows) if r["method"] == "full_recompute_saved"]
    assert [(r["qid"], r["ttft_s"], r["margin"], r["tf_leaves"], r["agree"], r["f1"]) for r in made] == [
        ("q1", 8.0, 2.0, [], True, 0.5),
        ("q2", 6.0, 1.5, [], True, 0.5),
    ]
    assert guard_curve.with_reference_rows(_decode_rows()) == _decode_rows()  # nothing made where the row exists
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    chain = ",".join(DECODE_CHAIN)
    assert guard_curve.main([str(path), "--cascade", chain, "--margins", "0.5,0.5", "--decode", "--full-from-reference"]) == 0
    assert "| 100% |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        guard_curve.main([str(path), "--cascade", chain, "--margins", "0.5,0.5", "--decode"])
    assert "no question has rows of every method" in capsys.readouterr().err
