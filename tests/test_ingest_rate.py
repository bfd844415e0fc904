"""Ingestion throughput: each config ingests the same corpus into a fresh store, in a process of
its own, and its row is what ``cacheblend-rag ingest`` printed."""

from __future__ import annotations

import pytest

from cacheblend_bench import ingest_rate
from cacheblend_bench.ingest_kill import hotpotqa_corpus


def test_each_config_ingests_the_corpus_into_a_fresh_store_and_a_rerun_resumes(tmp_path, monkeypatch):
    corpus = hotpotqa_corpus(tmp_path / "corpus.jsonl", 2)
    out = tmp_path / "rows.jsonl"
    rows = ingest_rate.run(corpus, ["smollm2:1:0", "smollm2:1:1"], out)
    plain, nb = rows
    assert (plain["threads"], plain["neighbours"], nb["neighbours"]) == (1, 0, 1)
    # A fresh store each time: every chunk computed; with neighbours, two caches a chunk.
    assert plain["chunks"] == plain["to_compute"] == plain["computed"] == nb["to_compute"] >= 2
    assert nb["computed"] == 2 * nb["to_compute"] and plain["tokens"] == nb["tokens"]
    assert plain["chunks_per_s"] == pytest.approx(plain["to_compute"] / plain["seconds"])
    assert plain["machine"]["cpu"] and plain["engine_source"]
    assert "| smollm2 | 1 | 1 neighbours |" in ingest_rate.table(rows)

    def no_ingestion(*args, **kwargs):
        raise AssertionError("a finished config is not ingested again")

    monkeypatch.setattr(ingest_rate, "measure", no_ingestion)
    assert ingest_rate.run(corpus, ["smollm2:1:0", "smollm2:1:1"], out) == rows


@pytest.mark.parametrize("spec", ["smollm2", "smollm2:2", "smollm2:0:0", "smollm2:two:0", ":1:0"])
def test_a_config_not_model_threads_neighbours_is_refused(spec):
    with pytest.raises(ValueError, match="write MODEL:THREADS:NEIGHBOURS"):
        ingest_rate.parse_config(spec)
