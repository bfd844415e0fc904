"""The kill-and-resume ingestion benchmark reads what ``cacheblend-rag ingest`` prints."""

from __future__ import annotations

import io

import pytest

from cacheblend_bench.ingest_kill import parse_log
from cacheblend_rag.cli import ingest
from cacheblend_rag.engine.capacity import PrecomputePlan


def _plan(chunks: int, cached: int, neighbours: int = 0) -> PrecomputePlan:
    return PrecomputePlan(
        chunks=chunks,
        cached=cached,
        tokens=1_287_047,
        new_tokens=1000,
        new_bytes=12_000_000,
        total_bytes=15_000_000_000,
        kv_format="int8",
        neighbours=neighbours,
    )


@pytest.mark.parametrize("neighbours", [0, 2])
def test_the_plan_and_summary_lines_ingest_prints_are_read(monkeypatch, neighbours):
    out = io.StringIO()
    monkeypatch.setattr(ingest, "check_room", lambda p, store: None)

    class Engine:
        store = None

        def plan_precompute(self, chunks, neighbours):
            return _plan(10_256, 1_872, neighbours)

        def precompute(self, chunks, neighbours, progress, check_room):
            assert check_room is False  # run has checked the plan it printed
            return 8_384

    ingest.run(Engine(), ["a"], neighbours=neighbours, progress=False, out=out)
    got = parse_log("precompute KV:  3%|\r" + out.getvalue())
    assert got["chunks"] == 10_256 and got["cached"] == 1_872 and got["to_compute"] == 8_384
    assert got["tokens"] == 1_287_047 and got["computed"] == 8_384 and got["seconds"] >= 0


def test_a_log_without_a_plan_is_refused():
    with pytest.raises(ValueError, match="no plan line"):
        parse_log("Loading weights: 100%|")
