"""First-token time by chunk-record format: every format answers from its own store, filled once."""

from __future__ import annotations

import pytest

from cacheblend_bench import ttft_kv_formats


def test_each_format_answers_from_its_own_store_and_a_rerun_resumes(tmp_path, monkeypatch):
    out = tmp_path / "rows.jsonl"
    rows = ttft_kv_formats.run("tiny", 1, out, repeats=1, weights="fp32")
    assert [r["kv_format"] for r in rows] == ["float", "int8", "int4"] * 2  # one HotpotQA, one MuSiQue question
    for q in range(2):
        float_, int8, int4 = rows[3 * q : 3 * q + 3]
        assert float_["qid"] == int8["qid"] == int4["qid"]
        # The same chunks in each store, fewer bytes per format (the scales included: the tiny
        # model's small head_dim pays more for V's per-token scales than the 1/3.5 of real models).
        assert float_["store_tokens"] == int8["store_tokens"] == int4["store_tokens"] > 0
        assert int4["store_bytes"] < int8["store_bytes"] < float_["store_bytes"] / 3
        assert all(r["ttft_s"] > 0 and len(r["ttft_runs_s"]) == 1 and r["full_ttft_s"] > 0 for r in (float_, int8, int4))
        assert float_["machine"]["cpu"] and float_["engine_source"]

    summary = {e["kv_format"]: e for e in ttft_kv_formats.summarize(rows)}
    assert summary["float"]["vs_float"] == pytest.approx(1.0) and summary["int8"]["n"] == 2
    mean_int8 = sum(r["ttft_s"] for r in rows if r["kv_format"] == "int8") / 2
    assert summary["int8"]["ttft_ms"] == pytest.approx(1000 * mean_int8)
    assert "| int4 |" in ttft_kv_formats.table(rows)

    def no_engine(*args, **kwargs):
        raise AssertionError("a finished run loads no model")

    monkeypatch.setattr(ttft_kv_formats, "load_engine", no_engine)
    assert ttft_kv_formats.run("tiny", 1, out, repeats=1, weights="fp32") == rows


def test_a_cold_run_reads_each_answers_records_from_the_disk(tmp_path, monkeypatch):
    dropped: list[tuple[str, int]] = []
    drop = ttft_kv_formats.drop_page_cache

    def counting_drop(directory):
        dropped.append((directory.name, drop(directory)))
        assert not any(ttft_kv_formats.resident_bytes(p) for p in directory.rglob("*.val"))
        return dropped[-1]

    monkeypatch.setattr(ttft_kv_formats, "drop_page_cache", counting_drop)
    rows = ttft_kv_formats.run(
        "tiny", 1, tmp_path / "rows.jsonl", formats=("float", "int8"), repeats=1, weights="fp32", cold=True
    )
    assert {r["page_cache"] for r in rows} == {"cold"}
    # Two questions, two stores, an untimed and a timed round: each answer's store dropped first.
    # Most of the tiny model's float records are files; its int8 layer records, mostly under
    # 32 KB, live in diskcache's index.
    order = ["float", "int8", "int8", "float"]  # the untimed round, then the next rotated by one
    assert [name for name, _ in dropped] == [f"q{q}-{f}" for q in range(2) for f in order]
    for q, row in enumerate(r for r in rows if r["kv_format"] == "float"):
        assert all(0.9 * row["store_bytes"] < n <= row["store_bytes"] for name, n in dropped if name == f"q{q}-float")


def test_drop_page_cache_refuses_a_folder_it_cannot_drop(tmp_path, monkeypatch):
    record = tmp_path / "store" / "ab" / "cd" / "record.val"
    record.parent.mkdir(parents=True)
    record.write_bytes(b"\1" * 3 * 4096)
    assert ttft_kv_formats.resident_bytes(record) == 3 * 4096  # just written: in the page cache
    assert ttft_kv_formats.drop_page_cache(tmp_path / "store") == 3 * 4096
    assert ttft_kv_formats.resident_bytes(record) == 0
    record.read_bytes()
    assert ttft_kv_formats.resident_bytes(record) == 3 * 4096

    monkeypatch.setattr(ttft_kv_formats.os, "posix_fadvise", lambda *args: None)  # as on a tmpfs: pages stay
    with pytest.raises(RuntimeError, match="stays in memory.*set TMPDIR to a folder on a disk"):
        ttft_kv_formats.drop_page_cache(tmp_path / "store")
