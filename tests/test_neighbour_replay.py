"""The learned-neighbours replay benchmark runs end to end on the tiny model and resumes."""

from __future__ import annotations

import json

import pytest

from cacheblend_bench import neighbour_replay as nr


def test_stream_is_seeded_and_zipf_weighted():
    cfg = nr.ReplayConfig(pool=10, queries=2000)
    a, b = nr.stream(cfg), nr.stream(cfg)
    assert a == b
    assert a.count(0) > a.count(9) * 3  # rank 1 is about 10**1.1 times as popular as rank 10


@pytest.mark.slow
def test_replay_runs_and_resumes(tmp_path):
    cfg = nr.ReplayConfig(model="tiny", pool=3, queries=6, top_k=3, chunk_tokens=64, max_new_tokens=3, out=str(tmp_path))
    rows_path = nr.run(cfg)
    rows = [json.loads(line) for line in rows_path.open()]
    assert [r["query"] for r in rows] == list(range(6))
    for r in rows:
        for s in nr.SETTINGS:
            assert r[s]["kl"] >= 0 and isinstance(r[s]["answer_same"], bool)
        assert r["plain"]["neighbour_hits"] == 0
    # A repeated question is served learned caches prefilled behind exactly its chunks.
    assert rows[-1]["learned_caches"] > 0
    assert (tmp_path / "kv" / "neighbours.json").is_file()
    # Resuming skips the finished queries.
    nr.run(cfg)
    assert sum(1 for _ in rows_path.open()) == 6
    table = nr.markdown_table(nr.summarize(rows, window=3))
    assert table.count("\n") == 3 and "learned: same answer" in table
