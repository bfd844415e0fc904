"""Comparing a weight format's fidelity rows with float32's (bench/format_fidelity.py)."""

import json

import pytest

from cacheblend_rag.bench import format_fidelity as ff


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
