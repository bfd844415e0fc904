"""Comparing a weight format's fidelity rows with float32's (bench/format_fidelity.py)."""

import json

import pytest

from cacheblend_bench import format_fidelity as ff


def _row(qid, method, answer_full, f1_full, agree, agree_f1, weights):
    return {
        "dataset": "hotpotqa",
        "qid": qid,
        "method": method,
        "answer_full": answer_full,
        "f1_full": f1_full,
        "agree": agree,
        "agree_f1": agree_f1,
        "weights": weights,
    }


def test_compare_formats_pairs_questions_and_reports_each_side():
    ref = [
        _row("a", "question@0.15", "Paris", 1.0, True, 1.0, "fp32"),
        _row("b", "question@0.15", "London", 0.0, False, 0.5, "fp32"),
        _row("c", "question@0.15", "Rome", 1.0, True, 1.0, "fp32"),
    ]
    fmt = [
        _row("a", "question@0.15", "paris.", 1.0, True, 1.0, "fp16"),  # the same answer once normalised
        _row("b", "question@0.15", "Berlin", 1.0, True, 1.0, "fp16"),
        _row("d", "question@0.15", "Oslo", 1.0, True, 1.0, "fp16"),  # no float32 row: left out
    ]
    c = ff.compare_formats(fmt, ref)
    assert c["questions"] == 2 and c["weights"] == ["fp16"] and c["reference_weights"] == ["fp32"]
    assert c["full_same_answer"] == pytest.approx(0.5)
    assert c["full_f1_fmt"] == pytest.approx(1.0) and c["full_f1_ref"] == pytest.approx(0.5)
    assert c["full_f1_diff"]["mean"] == pytest.approx(0.5) and (c["full_f1_diff"]["better"], c["full_f1_diff"]["tie"]) == (1, 1)
    m = c["methods"]["question@0.15"]
    assert (m["questions"], m["agree_fmt"], m["agree_ref"]) == (2, 1.0, 0.5)
    assert m["agree_f1_diff"]["mean"] == pytest.approx(0.25)
    assert "| question@0.15 | 100% | 50% |" in ff.markdown(c)


def test_main_refuses_rows_with_nothing_in_common(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps(_row("a", "m", "x", 1.0, True, 1.0, "fp16")) + "\n")
    b.write_text(json.dumps(_row("b", "m", "x", 1.0, True, 1.0, "fp32")) + "\n")
    assert ff.main([str(a), str(b)]) == 2
    assert "share no question" in capsys.readouterr().err


def test_kv_format_runs_compare_next_token_kl_per_method():
    ref = [dict(_row(q, "question@0.15", "Paris", 1.0, True, 1.0, "fp32"), kl=kl) for q, kl in (("a", 0.01), ("b", 0.03))]
    fmt = [
        dict(_row(q, "question@0.15", "Paris", 1.0, True, 1.0, "fp32"), kl=kl, kv_format="int8")
        for q, kl in (("a", 0.02), ("b", 0.04))
    ]
    c = ff.compare_formats(fmt, ref)
    assert c["kv_format"] == ["int8"] and c["reference_kv_format"] == ["float"]
    m = c["methods"]["question@0.15"]
    assert m["kl_fmt"] == pytest.approx(0.03) and m["kl_ref"] == pytest.approx(0.02)
    assert m["kl_ratio"] == pytest.approx(1.5)  # (0.02 + 0.04) / (0.01 + 0.03)
    lo, hi = m["kl_ratio_ci"]
    assert 4 / 3 - 1e-9 <= lo <= 1.5 <= hi <= 2 + 1e-9  # each resample is question a's ratio, b's, or both
    text = ff.markdown(c)
    # Full prefill reads no chunk cache, so its same-in-both row is left out.
    assert text.startswith("2 questions; each method against full prefill (fp32 weights):") and "F1 vs gold" not in text
    assert text.rstrip().endswith(f"| 0.0300 | 0.0200 | 1.500 [{lo:.3f}, {hi:.3f}] |")
