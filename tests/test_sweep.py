"""``cacheblend-rag sweep`` end to end on the tiny model: rows, repeats and the summary."""

from __future__ import annotations

import json

import pytest

from cacheblend_bench.runner import tiny_engine
from cacheblend_bench.sweep import SweepConfig, format_table, run_sweep, summarize

PASSAGES = [
    ("Ada Lovelace", "Ada Lovelace wrote the first program for the Analytical Engine in 1843."),
    ("Analytical Engine", "The Analytical Engine was designed by Charles Babbage in London."),
    ("London", "London is the capital of England and lies on the River Thames."),
    ("Thames", "The Thames flows through Oxford before it reaches London."),
]


def _musique(tmp_path, n=2):
    rows = [
        dict(id=str(i), question=q, answers=[a], ctxs=[dict(title=t, text=x) for t, x in PASSAGES])
        for i, (q, a) in enumerate(
            [("Where was the engine's designer based?", "London"), ("Which river flows through Oxford?", "Thames")][:n]
        )
    ]
    path = tmp_path / "musique.json"
    path.write_text(json.dumps(rows), encoding="utf-8")
    return path


def test_sweep_rows_repeats_and_summary(tmp_path):
    engine = tiny_engine(str(tmp_path / "kv"))
    cfg = SweepConfig(
        musique=_musique(tmp_path),
        questions=2,
        num_chunks=3,
        chunk_tokens=48,
        ratios=(0.15, 1.0),
        criteria=("query_value",),
        baselines=("prefix_caching", "full_reuse"),
        max_new_tokens=0,
        repeats=2,
        out=tmp_path / "rows.jsonl",
    )
    hits = []  # prefix caching's chunk hits, per question and round
    prefill = engine.prefill

    def spy(layout, mode="cacheblend", *args, **kwargs):
        out = prefill(layout, mode, *args, **kwargs)
        if mode == "prefix_caching":
            hits.append(out.stats["chunk_hits"])
        return out

    engine.prefill = spy
    try:
        rows = run_sweep(engine, cfg, progress=False)
    finally:
        engine.close()
    # Round 2 meets the prompt first-seen, like round 1: the prefix entries round 1 wrote back were
    # dropped (else round 2 would load every chunk as a cached prefix).
    assert len(hits) == 4 and hits[0] == hits[1] == 1 and hits[2] == hits[3]
    names = ["full_recompute", "prefix_caching", "full_reuse", "cacheblend[query_value@0.15]", "cacheblend[query_value@1]"]
    assert [r["method"] for r in rows] == names * 2
    assert [json.loads(line)["method"] for line in (tmp_path / "rows.jsonl").read_text().splitlines()] == names * 2
    for r in rows:
        assert r["ttft_s"] > 0 and r["ttft_ratio"] > 0 and r["kl"] >= -1e-6
        if r["method"] == "full_recompute":
            assert r["ttft_ratio"] == 1.0
        if r["method"].startswith("cacheblend"):
            assert r["overhead"] > 0
        if r["method"] in ("prefix_caching", "cacheblend[query_value@1]"):
            # exact modes: the same next-token distribution as full prefill
            assert r["kl"] == pytest.approx(0.0, abs=1e-4) and r["agree"] == 1.0
    table = {t["method"]: t for t in summarize(rows)}
    assert table["cacheblend[query_value@0.15]"]["compute_fraction"] < table["cacheblend[query_value@1]"]["compute_fraction"]
    assert "cacheblend[query_value@0.15]" in format_table(list(table.values()))


def test_sweep_rejects_zero_repeats():
    with pytest.raises(ValueError, match="repeats=0 must be an int >= 1"):
        SweepConfig(repeats=0)
