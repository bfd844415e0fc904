"""The ask-cost benchmark's summary: medians and ranges per run, in the order a user meets them."""

from __future__ import annotations

from cacheblend_bench.ask_cost import RUNS, markdown_table, summarize


def _row(repeat: int, run: str, wall: float, misses: int) -> dict:
    return {"repeat": repeat, "run": run, "wall_s": wall, "ttft_s": wall / 10, "answer_s": wall / 2, "chunk_misses": misses}


def test_each_run_gets_its_median_and_range_in_order():
    rows = [_row(i, run, wall, misses) for i, wall in enumerate((9.0, 7.0, 20.0)) for run, misses in zip(RUNS, (12, 0, 2))]
    rows[1]["wall_s"] = 5.0  # repeat 0's second run
    got = {e["run"]: e for e in summarize(rows)}
    assert [e["run"] for e in summarize(rows)] == list(RUNS)
    assert got["again"]["wall_s"] == 7.0 and got["again"]["wall_range"] == (5.0, 20.0)
    assert got["first"]["ttft_s"] == 0.9 and got["new question"]["answer_s"] == 4.5
    lines = markdown_table(rows).splitlines()
    assert lines[3].startswith("| again | 7.0 | 5.0-20.0 | ")
