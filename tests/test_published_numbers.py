"""The statistics and provenance behind the docs' generated numbers: one speed-up everywhere,
number formats, and which engine made a result file's rows."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cacheblend_rag.bench import provenance
from cacheblend_rag.bench.breakdown import summarize as breakdown_summarize
from cacheblend_rag.bench.fidelity import ttft_speedup
from cacheblend_rag.bench.published.fmt import Stat, render
from cacheblend_rag.bench.stats import speedup
from cacheblend_rag.bench.summary import pooled, speedup_over
from cacheblend_rag.bench.summary import summarize as bench_summarize
from cacheblend_rag.bench.sweep import summarize as sweep_summarize
from cacheblend_rag.bench.whole_answer import summarize as whole_summarize

# Three questions where the ratio of means (12 / 4 = 3.0), the mean of ratios (2.33) and the
# median of ratios (2.0) all differ, so a module using another statistic fails.
FULL = [2.0, 4.0, 6.0]
FAST = [1.0, 2.0, 1.0]


def test_the_speedup_is_the_ratio_of_mean_times():
    value, (lo, hi) = speedup(FULL, FAST)
    assert value == pytest.approx(3.0)
    assert lo <= value <= hi
    with pytest.raises(ValueError, match="paired times: 3 reference times, 2 method times"):
        speedup(FULL, FAST[:2])


def test_every_benchmark_reports_the_same_speedup():
    bench_rows = [
        dict(
            dataset=d,
            qid=str(i),
            top_k=6,
            method=m,
            metric="f1",
            quality=0.0,
            answer="a",
            ttft_s=t,
            total_s=t + 1.0,
            generated_tokens=2,
        )
        for d in ("x",)
        for m, ts in (("full_recompute", FULL), ("question@0.15", FAST))
        for i, t in enumerate(ts)
    ]
    cb = next(e for e in bench_summarize(bench_rows) if e["method"] == "question@0.15")
    assert cb["speedup_vs_full_recompute"] == pytest.approx(3.0)
    assert speedup_over(pooled(bench_rows), "question@0.15", "full_recompute")[0] == pytest.approx(3.0)

    fid_rows = [dict(dataset="x", qid=str(i), ttft_full_s=f, ttft_s=t) for i, (f, t) in enumerate(zip(FULL, FAST))]
    assert ttft_speedup(fid_rows, None)["ttft_speedup"] == pytest.approx(3.0)

    whole_rows = [
        dict(
            dataset="x",
            qid=str(i),
            method=m,
            prompt_tokens=10,
            ttft_s=t,
            t2_s=t,
            decode_ms_per_token=1.0,
            kl_vs_fp32_full_prefill=0.0,
        )
        for m, ts in (("full_recompute_saved/fp32", FULL), ("question@0.15/fp32", FAST))
        for i, t in enumerate(ts)
    ]
    cb = next(e for e in whole_summarize(whole_rows, (2,)) if e["method"] == "question@0.15/fp32")
    assert cb["ttft_vs_full_prefill"] == pytest.approx(3.0)

    sweep_rows = [
        dict(question=i, method=m, ttft_s=t, ttft_ratio=t / f, kl=0.0, agree=1.0, f1=0.0, recompute_fraction=1.0, prefill_s=t)
        for m, ts in (("full_recompute", FULL), ("cacheblend[x@0.15]", FAST))
        for i, (t, f) in enumerate(zip(ts, FULL))
    ]
    assert next(t for t in sweep_summarize(sweep_rows) if t["method"] == "cacheblend[x@0.15]")["ttft_speedup"] == pytest.approx(
        3.0
    )

    prof_rows = [
        dict(
            question=i,
            round=0,
            mode=m,
            wall_s=t,
            profiled_s=t,
            compute_fraction=1.0,
            attention=0.0,
            gemm=0.0,
            other_ops=0.0,
            python=t,
        )
        for m, ts in (("full_recompute_saved", FULL), ("cacheblend", FAST))
        for i, t in enumerate(ts)
    ]
    assert breakdown_summarize(prof_rows)["cacheblend"]["speedup_vs_saved"] == pytest.approx(3.0)


@pytest.mark.parametrize(
    "value,spec,text",
    [
        (Stat(4.3638, (4.224, 4.5055)), "xci1", "4.4x [4.2, 4.5]"),
        (Stat(4.3638, (4.224, 4.5055)), "x2", "4.36x"),
        (Stat(-0.026, (-0.059, 0.006)), "sfci", "\u22120.026 [\u22120.059, +0.006]"),
        (Stat(0.444, (0.384, 0.508)), "pctci", "44% [38, 51]"),
        ([2.91, 3.43], "x1", "2.9-3.4x"),
        ([0.03, 0.12], "pct", "3-12%"),
        ([4.21, 4.24], "x1", "4.2x"),
        (3.4e-6, "g1", "3e-6"),
        (1976.2, "d", "1,976"),
    ],
)
def test_numbers_print_in_one_format(value, spec, text):
    assert render(value, spec) == text


def test_a_format_that_needs_an_interval_refuses_a_bare_number():
    with pytest.raises(ValueError, match="format 'xci1' needs a value with an interval"):
        render(4.2, "xci1")


def _git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", *args],
        cwd=repo,
        check=True,
        capture_output=True,
        env={
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@t",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@t",
            "PATH": "/usr/bin:/bin:/usr/local/bin",
        },
    )


def _head(repo: Path) -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short=7", "HEAD"], cwd=repo, check=True, capture_output=True, text=True
    ).stdout.strip()


def test_record_names_the_commits_that_added_the_current_rows(tmp_path):
    """Appended rows keep the commits that added them; rows replaced by a new run start over."""
    repo = tmp_path
    (repo / "cacheblend_rag").mkdir()
    (repo / "cacheblend_rag" / "__init__.py").write_text('__version__ = "9.9.9"\n')
    results = repo / "docs" / "results"
    results.mkdir(parents=True)
    rows = results / "x.jsonl"
    _git(repo, "init", "-q")
    commits = []
    for lines in (['{"a": 1}'], ['{"a": 1}', '{"a": 2}'], ['{"b": 1}'], ['{"b": 1}', '{"b": 2}']):
        rows.write_text("\n".join(lines) + "\n")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-qm", "rows")
        commits.append(_head(repo))
    entry = provenance.record(repo, "docs/results/x.jsonl")
    assert entry.commits == (commits[2], commits[3])  # the run that replaced the first one, appended once
    assert entry.engine == "9.9.9"
    assert entry.label().startswith(f"cacheblend-rag 9.9.9, commits {commits[2]} to {commits[3]}, ")
    again = provenance.record(repo, "docs/results/x.jsonl")  # recording twice changes nothing
    assert again == entry


def test_rows_that_carry_their_engine_need_no_entry(tmp_path):
    (tmp_path / "new.jsonl").write_text(
        "".join(json.dumps({"engine": "0.3.0+gabc1234", "time": 1.8e9, "v": i}) + "\n" for i in range(2))
    )
    (tmp_path / "old.jsonl").write_text('{"v": 1}\n')
    assert provenance.of(tmp_path, "new.jsonl").label() == "cacheblend-rag 0.3.0, commit abc1234, 2027-01-15"
    with pytest.raises(KeyError, match="old.jsonl has no entry in provenance.json and its rows carry no engine: .*--record"):
        provenance.of(tmp_path, "old.jsonl")
