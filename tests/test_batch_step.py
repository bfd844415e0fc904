"""bench/batch_step.py: the batched decode step timed per batch size (no timing asserted)."""

import pytest

from cacheblend_bench import batch_step
from cacheblend_rag.testing import make_engine


def test_measure_times_each_batch_size_and_the_table_compares_with_one_answer():
    engine = make_engine("llama", seed=0, pipelined=False)
    try:
        entries = batch_step.measure(engine, [1, 2, 4], tokens=16, repeats=2)
    finally:
        engine.close()
    assert [e["rows"] for e in entries] == [1, 2, 4]
    assert all(e["step_ms"] > 0 and e["per_answer_ms"] == pytest.approx(e["step_ms"] / e["rows"]) for e in entries)
    table = batch_step.markdown_table({"formats": {"fp32": entries}})
    assert "| fp32 | 1 |" in table and "| 1.00x |" in table and table.count("\n") == 4


def test_measure_refuses_a_model_without_the_fast_step():
    engine = make_engine("llama", seed=0, pipelined=False)
    try:
        engine.fast_step = None
        with pytest.raises(ValueError, match="no fast decode step"):
            batch_step.measure(engine, [1], tokens=4)
    finally:
        engine.close()
