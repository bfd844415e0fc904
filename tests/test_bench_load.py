"""``bench --load``: the real command path on the tiny random model (mechanics, not speed)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cacheblend_bench.load import LoadConfig, percentile, run_load
from cacheblend_bench.runner import tiny_engine


def test_percentile_matches_linear_interpolation():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 50):
        values = rng.random(n).tolist()
        for q in (0, 50, 95, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert np.isnan(percentile([], 50))


def test_load_run_covers_every_setting_and_batches_only_when_allowed(tmp_path):
    cfg = LoadConfig(
        model="tiny",
        dataset="crosschunk",
        n=3,
        methods=("full_recompute", "cacheblend@0.15"),
        clients=(1, 3),
        rates=(200.0,),
        requests=4,
        max_batches=(1, 3),
        max_new_tokens=6,
        top_k=2,
        chunk_tokens=40,
        out_dir=str(tmp_path),
        progress=False,
    )
    engine = tiny_engine(str(tmp_path / "kv"))
    summary = run_load(cfg, engine=engine)
    engine.close()
    assert len(summary) == 2 * 2 * 3  # methods x batch sizes x (two client counts + one rate)
    for e in summary:
        assert e["answers"] == 4 and e["answers_per_s"] > 0 and e["ttft_p50"] <= e["e2e_p95"]
        if e["max_batch"] == 1:
            assert e["mean_batch"] in (0.0, 1.0)  # never more than one answer per step
        assert e["mean_batch"] <= e["max_batch"]
    rows = [json.loads(line) for line in (tmp_path / "load.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * len(summary)
    assert json.loads((tmp_path / "load_summary.json").read_text())["summary"] == json.loads(json.dumps(summary))
    assert (tmp_path / "plots" / "load.png").stat().st_size > 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(methods=("map_reduce",)), "engine prefill modes only"),
        (dict(clients=(0,)), "clients=\\(0,\\): every value must be an int >= 1"),
        (dict(rates=(0.0,)), "arrival rates must be > 0"),
        (dict(requests=0), "requests and n must be >= 1"),
    ],
)
def test_bad_load_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoadConfig(**kwargs)
