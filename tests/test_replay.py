"""The replay benchmark (``bench.replay``) on tiny sizes: its bookkeeping against a hand count,
resuming, the references and the generated table."""

from __future__ import annotations

import json

import pytest

from cacheblend_bench.replay import (
    ReplayConfig,
    formats_table,
    main,
    query_stream,
    read_rows,
    replay,
    run_all,
    static_oracle_hit_rate,
    summary_table,
)

TINY = dict(corpus=24, queries=60, per_query=3, warmup=20, window=20, chunk_tokens=2, kv_shape=(2, 1, 4))


def test_an_unbounded_store_hits_every_chunk_asked_before(tmp_path):
    cfg = ReplayConfig(**TINY, store_fraction=1.0, memory_fraction=1.0)
    rows = replay(cfg, "lru", "least-recently-used", where=str(tmp_path))
    seen: set[int] = set()
    hits = asked = 0
    for n, query in enumerate(query_stream(cfg), start=1):
        if n > cfg.warmup:
            hits += sum(c in seen for c in query)
            asked += len(query)
        seen.update(query)
    summary = rows[-1]
    assert summary["kind"] == "summary" and summary["hit_rate"] == pytest.approx(hits / asked)
    assert summary["disk_bytes_per_query"] == 0  # everything fits in memory: no disk read
    assert [r["queries_done"] for r in rows[:-1]] == [20, 40, 60]


def test_a_bounded_store_evicts_and_reads_from_both_tiers(tmp_path):
    cfg = ReplayConfig(**TINY, store_fraction=0.25, memory_fraction=0.1)
    summary = replay(cfg, "lfu", "least-recently-used", where=str(tmp_path))[-1]
    bound = static_oracle_hit_rate(cfg, list(query_stream(cfg)))
    assert 0 < summary["hit_rate"] < 1 and 0 < bound < 1
    assert summary["memory_bytes_per_query"] > 0 and summary["disk_bytes_per_query"] > 0


def test_runs_resume_and_the_table_lists_every_run_and_the_references(tmp_path):
    cfg = ReplayConfig(**TINY, memory_policies=("lru",), disk_policies=("least-recently-stored", "least-recently-used"))
    out = tmp_path / "replay.jsonl"
    rows = run_all(cfg, out, progress=False, where=str(tmp_path))
    text = out.read_text()
    again = run_all(cfg, out, progress=False, where=str(tmp_path))
    assert again == json.loads(json.dumps(rows))  # nothing left to run
    assert out.read_text() == text
    table = summary_table(read_rows(out))
    for name in ("least-recently-stored", "least-recently-used", "ideal", "static oracle"):
        assert name in table
    ideal = next(r for r in rows if r["run"] == "ideal")
    assert ideal["hit_rate"] == 1.0


def test_a_drifting_stream_changes_which_chunks_are_popular():
    cfg = ReplayConfig(**{**TINY, "queries": 400, "warmup": 200, "window": 100}, shift_at=200)
    queries = list(query_stream(cfg))
    from collections import Counter

    before = Counter(c for q in queries[:200] for c in q).most_common(1)[0][0]
    after = Counter(c for q in queries[200:] for c in q).most_common(1)[0][0]
    assert before != after  # the favourite chunk changed
    # The oracle follows the shift: it scores the second half against the second popularity.
    steady = ReplayConfig(**{**TINY, "queries": 400, "warmup": 200, "window": 100})
    assert static_oracle_hit_rate(cfg, queries) > static_oracle_hit_rate(steady, queries)
    assert cfg.stream_key() != steady.stream_key()
    with pytest.raises(ValueError, match="shift_at=500 must be a query index"):
        ReplayConfig(shift_at=500, queries=400, warmup=100)


def test_the_command_line_refuses_a_bad_configuration(capsys):
    with pytest.raises(SystemExit):
        main(["--queries", "50", "--warmup", "60"])
    assert "must exceed warmup=60" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown memory policy 'mru'"):
        ReplayConfig(memory_policies=("mru",))


def test_the_committed_rows_are_a_finished_run_of_every_policy_pair():
    from cacheblend_bench.doc_tables import ROOT

    rows = read_rows(ROOT / "docs" / "results" / "replay.jsonl")
    config = next(r for r in rows if r["kind"] == "config")
    runs = {r["run"] for r in rows if r["kind"] == "summary"}
    assert runs == {f"{m}/{d}" for m in config["memory_policies"] for d in config["disk_policies"]}
    assert config["queries"] >= 1000 and config["store_fraction"] == 0.25
    assert json.dumps(config)  # plain JSON


def test_quantized_records_hold_more_chunks_in_the_same_bytes_and_hit_more(tmp_path):
    shape = dict(TINY, corpus=60, chunk_tokens=128, kv_shape=(4, 3, 64), queries=150, warmup=50, window=50)
    out = tmp_path / "formats.jsonl"
    cfgs, summaries = {}, {}
    for fmt in ("float", "int8", "int4"):
        cfg = ReplayConfig(
            **shape,
            store_fraction=0.2,
            memory_fraction=0.05,
            kv_format=fmt,
            memory_policies=("lfu",),
            disk_policies=("least-recently-used",),
        )
        rows = run_all(cfg, out, progress=False, where=str(tmp_path))
        cfgs[fmt], summaries[fmt] = cfg, next(r for r in rows if r["kind"] == "summary")
    f, i8, i4 = cfgs["float"], cfgs["int8"], cfgs["int4"]
    assert f.disk_bytes == i8.disk_bytes == i4.disk_bytes  # the same store bytes
    assert f.disk_chunks < i8.disk_chunks < i4.disk_chunks
    assert summaries["float"]["hit_rate"] < summaries["int8"]["hit_rate"] <= summaries["int4"]["hit_rate"]
    oracle = [static_oracle_hit_rate(c, list(query_stream(c))) for c in (f, i8, i4)]
    assert oracle == sorted(oracle) and oracle[0] < oracle[2]
    assert len({c.stream_key() for c in (f, i8, i4)}) == 3
    table = formats_table(read_rows(out)).splitlines()
    assert [line.split("|")[1].strip() for line in table[2:]] == ["float", "int8", "int4"]
    assert f"{i4.disk_chunks} of 60" in table[4] and f"{summaries['int4']['hit_rate']:.3f}" in table[4]
    assert "int4 records on disk" in summary_table([r for r in read_rows(out) if r["stream"] == i4.stream_key()])
    with pytest.raises(ValueError, match="int3"):
        ReplayConfig(kv_format="int3")
    other = ReplayConfig(
        **{**shape, "seed": 1}, kv_format="int8", memory_policies=("lfu",), disk_policies=("least-recently-used",)
    )
    run_all(other, out, progress=False, where=str(tmp_path))
    with pytest.raises(ValueError, match="more than its format"):
        formats_table(read_rows(out))


def test_the_float_stream_keeps_the_key_of_the_committed_rows():
    from cacheblend_bench.doc_tables import ROOT

    config = next(r for r in read_rows(ROOT / "docs" / "results" / "replay.jsonl") if r["kind"] == "config")
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k not in ("stream", "kind", "run")}
    assert ReplayConfig(**fields).stream_key() == config["stream"]
