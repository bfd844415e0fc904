"""``bench --whole-answer`` on the tiny model: every answer reaches the longest length, the times
at each length are read off the same run, and the summary's ratios are ratios of means over the
questions both methods ran (recomputed here from the rows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cacheblend_bench.whole_answer import ROWS, WholeAnswerConfig, run_whole_answer, summarize, write_report
from cacheblend_rag.cli.app import main


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    cfg = WholeAnswerConfig(
        model="tiny",
        datasets=("crosschunk",),
        n=2,
        lengths=(3, 9),
        llama_cpp=(),
        top_k=3,
        chunk_tokens=64,
        out_dir=str(out),
        progress=False,
    )
    return cfg, run_whole_answer(cfg)


def test_every_method_answers_every_question_to_the_longest_length(run):
    cfg, rows = run
    assert sorted({r["method"] for r in rows}) == sorted(f"{m}/{f}" for m in cfg.methods for f in cfg.formats)
    assert len(rows) == 2 * len(cfg.methods) * len(cfg.formats)
    for r in rows:
        times = r["times_s"]
        assert len(times) == 9 and times == sorted(times)
        assert r["ttft_s"] == pytest.approx(times[0], abs=1e-4)
        assert r["t3_s"] == pytest.approx(times[2], abs=1e-4) and r["t9_s"] == pytest.approx(times[8], abs=1e-4)
        assert r["decode_ms_per_token"] == pytest.approx(1000 * (r["t9_s"] - r["ttft_s"]) / 8, rel=1e-3)
    kl = {(r["qid"], r["method"]): r["kl_vs_fp32_full_prefill"] for r in rows}
    for qid in {r["qid"] for r in rows}:
        assert kl[(qid, "full_recompute_saved/fp32")] == pytest.approx(0, abs=1e-6)
        assert abs(kl[(qid, "full_recompute_saved/fp16")]) < 1e-3  # rounded weights, nothing else
    # The two formats of one model give the same greedy tokens on these short answers.
    by = {(r["qid"], r["method"]): r["first_tokens"] for r in rows}
    for qid in {r["qid"] for r in rows}:
        assert by[(qid, "full_recompute_saved/fp32")] == by[(qid, "full_recompute_saved/fp16")]


def test_summary_ratios_are_ratios_of_means_against_the_same_formats_full_prefill(run):
    cfg, rows = run
    summary = {e["method"]: e for e in summarize(rows, cfg.lengths)}
    for fmt in cfg.formats:
        mine = [r for r in rows if r["method"] == f"question@0.15/{fmt}"]
        full = {r["qid"]: r for r in rows if r["method"] == f"full_recompute_saved/{fmt}"}
        want = sum(full[r["qid"]]["t9_s"] for r in mine) / sum(r["t9_s"] for r in mine)
        assert summary[f"question@0.15/{fmt}"]["t9_vs_full_prefill"] == pytest.approx(want)
        assert "t9_vs_full_prefill" not in summary[f"full_recompute_saved/{fmt}"]
    same = [
        r["first_tokens"]
        == next(f for f in rows if f["qid"] == r["qid"] and f["method"] == "full_recompute_saved/fp32")["first_tokens"]
        for r in rows
        if r["method"] == "question@0.15/fp16"
    ]
    assert summary["question@0.15/fp16"]["same_32_tokens_as_fp32_full_prefill"] == sum(same) / len(same)


def test_neighbour_aware_methods_are_served_by_the_caches_the_run_makes(tmp_path):
    """``/nb`` needs ``neighbours``; with them, the answering engine made and indexed the
    neighbour-aware caches, so every chunk but the first is served by one (rows say so)."""
    kw = dict(
        model="tiny", datasets=("crosschunk",), n=1, lengths=(2,), formats=("fp32",), llama_cpp=(), top_k=3, chunk_tokens=64
    )
    with pytest.raises(ValueError, match="methods with /nb need neighbour-aware caches: pass neighbours=N"):
        WholeAnswerConfig(methods=("question@0.15/nb",), **kw)
    cfg = WholeAnswerConfig(methods=("question@0.15/nb",), neighbours=2, out_dir=str(tmp_path), progress=False, **kw)
    (row,) = run_whole_answer(cfg)
    assert row["chunk_hits"] == 3 and row["neighbour_hits"] == 2


def test_a_finished_run_resumes_without_loading_a_model_and_rebuilds_the_report(run, monkeypatch):
    cfg, rows = run
    import cacheblend_bench.runner as runner

    monkeypatch.setattr(runner, "load_engine", lambda *a, **k: pytest.fail("a finished run loaded a model"))
    again = run_whole_answer(cfg)
    assert len(again) == len(rows)
    out = cfg.out_dir
    written = json.loads(open(f"{out}/whole_answer_summary.json").read())["summary"]
    assert written == json.loads(json.dumps(write_report(again, Path(out), cfg, plots=False)))
    assert open(f"{out}/whole_answer.md").read().startswith("| method | n | TTFT s | 3 tokens s | 9 tokens s |")
    assert len(open(f"{out}/{ROWS}").read().splitlines()) == len(rows)


def test_whole_answer_refuses_lengths_below_one_token(tmp_path, capsys):
    code = main(
        [
            "bench",
            "--whole-answer",
            "--model",
            "tiny",
            "--datasets",
            "crosschunk",
            "--lengths",
            "0,8",
            "--out",
            str(tmp_path),
            "--llama-cpp",
            "",
            "--quiet",
        ]
    )
    assert code == 2
    assert "lengths=(0, 8): give answer lengths of at least 1 token" in capsys.readouterr().err


@pytest.mark.parametrize("read_from", ["memory", "disk"])
def test_the_timed_calls_read_the_chunk_caches_from_the_tier_asked_for(tmp_path, monkeypatch, read_from):
    """An engine whose store is the usual memory tier over disk (``from_pretrained``'s): after the
    question's precompute its chunks are in memory; ``read_from="disk"`` empties the memory tier
    first, so every chunk layer CacheBlend loads comes from disk, and the rows say so."""
    import cacheblend_bench.runner as runner
    from cacheblend_rag.engine.core import CacheBlendEngine
    from cacheblend_rag.store.tiers import TieredStore
    from cacheblend_rag.testing import make_model, make_tokenizer

    def tiered(cfg, weights="fp32", store_size_limit=0, kv_format=None):
        store = TieredStore.memory_over_disk(f"{cfg.out_dir}/kv", kv_format=kv_format)
        return CacheBlendEngine(make_model("llama", max_position_embeddings=runner.TINY_CONTEXT), make_tokenizer(), store=store)

    monkeypatch.setattr(runner, "load_engine", tiered)
    with pytest.raises(ValueError, match="read_from='tape': choose one of memory, disk"):
        WholeAnswerConfig(read_from="tape")
    cfg = WholeAnswerConfig(
        model="tiny",
        datasets=("crosschunk",),
        n=1,
        lengths=(2,),
        formats=("fp32",),
        methods=("question@0.15",),
        llama_cpp=(),
        top_k=3,
        chunk_tokens=64,
        read_from=read_from,
        out_dir=str(tmp_path),
        progress=False,
    )
    (row,) = run_whole_answer(cfg)
    reads = row["tier_reads"]
    assert row["read_from"] == read_from and row["chunk_hits"] == 3
    other = "memory" if read_from == "disk" else "disk"
    assert reads[read_from] > 0 and reads[other] == 0, reads
