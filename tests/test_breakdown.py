"""``bench.breakdown``: where a prefill's time goes, on the tiny engine."""

from __future__ import annotations

import pytest

from cacheblend_bench.breakdown import CATEGORIES, category, report, run, summarize
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_engine


def test_operators_fall_into_their_category():
    assert category("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert category("aten::bmm") == "attention"
    assert category("aten::addmm") == category("aten::linear") == "gemm"
    assert category("aten::rms_norm") == category("aten::index_select") == "other_ops"


def test_breakdown_accounts_for_the_whole_prefill():
    engine = make_engine("llama")
    try:
        rows = run(engine, [(SAMPLE_QUESTION, list(SAMPLE_CHUNKS))], ["full_recompute_saved", "cacheblend"], rounds=2)
    finally:
        engine.close()
    assert [(r["round"], r["mode"]) for r in rows] == [
        (0, "full_recompute_saved"),
        (0, "cacheblend"),
        (1, "full_recompute_saved"),
        (1, "cacheblend"),
    ]
    for r in rows:
        # Python is the remainder of the profiled wall time after the operators, never negative,
        # so the categories cover all of it (operators on several threads may add up to more).
        ops = sum(r[c] for c in CATEGORIES if c != "python")
        assert r["python"] == pytest.approx(max(0.0, r["profiled_s"] - ops), rel=1e-9, abs=1e-12)
        assert sum(r[c] for c in CATEGORIES) >= r["profiled_s"] * (1 - 1e-9)
        assert r["gemm"] > 0 and r["attention"] > 0  # the profiler saw the model's operators
    s = summarize(rows)
    saved = s["full_recompute_saved"]
    # The last-layer saving: the last of the layers computes one position.
    layers = engine.num_layers
    assert saved["compute_fraction"] == pytest.approx((layers - 1) / layers, abs=0.01)
    assert saved["overhead"] == pytest.approx(1.0)  # its own reference
    assert saved["speedup_vs_saved"] == pytest.approx(1.0)
    # The speed-up is the ratio of mean wall times over the same (question, round) pairs.
    walls = {m: sum(r["wall_s"] for r in rows if r["mode"] == m) for m in ("full_recompute_saved", "cacheblend")}
    assert s["cacheblend"]["speedup_vs_saved"] == pytest.approx(walls["full_recompute_saved"] / walls["cacheblend"])
    assert 0 < s["cacheblend"]["compute_fraction"] < 1
    assert sum(s["cacheblend"][f"{c}_share"] for c in CATEGORIES) >= 1 - 1e-9
    assert "| `cacheblend` |" in report(s)
