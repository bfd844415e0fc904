"""The ask-cost benchmark's summary: medians and ranges per run, in the order a user meets them."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

from cacheblend_bench import ask_cost
from cacheblend_bench.ask_cost import RUNS, markdown_table, summarize


def _row(repeat: int, run: str, wall: float, misses: int) -> dict:
    return {"repeat": repeat, "run": run, "wall_s": wall, "ttft_s": wall / 10, "answer_s": wall / 2, "chunk_misses": misses}


def test_each_run_gets_its_median_and_range_in_order():
    rows = [
        _row(i, run, wall, misses)
        for i, wall in enumerate((9.0, 7.0, 20.0))
        for run, misses in zip(RUNS, (12, 0, 2, 0, 0, 0, 0), strict=True)
    ]
    rows[1]["wall_s"] = 5.0  # repeat 0's second run
    got = {e["run"]: e for e in summarize(rows)}
    assert [e["run"] for e in summarize(rows)] == list(RUNS)
    assert got["again"]["wall_s"] == 7.0 and got["again"]["wall_range"] == (5.0, 20.0)
    assert got["first"]["ttft_s"] == 0.9 and got["new question"]["answer_s"] == 4.5
    lines = markdown_table(rows).splitlines()
    assert lines[3].startswith("| again | 7.0 | 5.0-20.0 | ")


FAKE_ASK = """#!{python}
import json, sys
for i, line in enumerate(sys.stdin):
    stats = dict(chunks=6, chunk_hits=6, chunk_misses=0)
    print(json.dumps(dict(question=line.strip(), ttft_s=0.1 * (i + 1), total_s=0.2, stats=stats)), flush=True)
"""
FAILING_ASK = """#!{python}
import sys
sys.stdin.read()
print('no model here', file=sys.stderr)
sys.exit(3)
"""


def _fake_ask(tmp_path, monkeypatch, script: str) -> None:
    """``cacheblend-rag`` on the PATH is ``script`` (a Python program)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "cacheblend-rag"
    fake.write_text(script.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_a_later_question_in_one_process_is_timed_from_the_answer_before_it(tmp_path, monkeypatch):
    _fake_ask(tmp_path, monkeypatch, FAKE_ASK)
    # The clock as each answer's line arrives: the process start is before the first.
    clock = iter([100.0, 102.5])
    monkeypatch.setattr(ask_cost, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    got = ask_cost._ask_stream(tmp_path, ["first?", "second?"], [], threads=1)
    assert got["wall_s"] == 2.5
    assert got["ttft_s"] == pytest.approx(0.2) and got["chunk_hits"] == 6


def test_an_ask_stream_that_answers_fewer_questions_fails_with_its_error(tmp_path, monkeypatch):
    _fake_ask(tmp_path, monkeypatch, FAILING_ASK)
    with pytest.raises(RuntimeError, match=r"failed \(3, 0 answers\):\nno model here"):
        ask_cost._ask_stream(tmp_path, ["first?", "second?"], [], threads=1)
