"""The statistics and provenance behind the docs' generated numbers: one speed-up everywhere,
number formats, which engine made a result file's rows, and the headline rule: the README's
results table reads rows made in today's defaults on today's engine code (``bench.headline``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cacheblend_bench import doc_tables, headline, provenance
from cacheblend_bench.breakdown import summarize as breakdown_summarize
from cacheblend_bench.fidelity import ttft_speedup
from cacheblend_bench.published.fmt import Stat, render
from cacheblend_bench.stats import speedup
from cacheblend_bench.summary import pooled, speedup_over
from cacheblend_bench.summary import summarize as bench_summarize
from cacheblend_bench.sweep import summarize as sweep_summarize
from cacheblend_bench.whole_answer import summarize as whole_summarize

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


# ----------------------------------------------------------------------------- the headline rule
def _package(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "pkg"
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


def test_engine_source_hashes_the_engines_code_and_nothing_else(tmp_path):
    """The engine's modules are those it imports at any depth, lazy imports included; comments,
    docstrings and formatting do not change the hash, code does; a module it never imports does
    not count, nor do the benchmarks."""
    files = {
        "__init__.py": "",
        "engine.py": '"""Doc."""\nfrom .core import step\n\n\ndef run():\n    from .store import disk\n    return step(disk)\n',
        "core.py": "def step(x):\n    return x  # same\n",
        "store/__init__.py": "",
        "store/disk.py": "SIZE = 1\n",
        "server.py": "from .engine import run\n",
        "bench/__init__.py": "",
        "bench/x.py": "",
    }
    pkg = _package(tmp_path, files)
    assert list(provenance.engine_modules(pkg, "pkg.engine")) == ["pkg", "pkg.core", "pkg.engine", "pkg.store", "pkg.store.disk"]
    before = provenance.engine_source(pkg, "pkg.engine")
    (pkg / "core.py").write_text('def step(x):\n    """Now documented."""\n\n    return (x)  # another comment\n')
    (pkg / "server.py").write_text("from .engine import run\nPORT = 1\n")
    assert provenance.engine_source(pkg, "pkg.engine") == before
    (pkg / "store" / "disk.py").write_text("SIZE = 2\n")
    assert provenance.engine_source(pkg, "pkg.engine") != before
    with pytest.raises(FileNotFoundError, match="the engine's module pkg.nowhere is not in"):
        provenance.engine_modules(pkg, "pkg.nowhere")


def test_machine_stamp_records_what_decides_the_timings():
    stamp = provenance.machine_stamp()
    assert set(stamp) == {"cpu", "cpu_flags", "cores", "threads", "torch", "llama_cpp"}
    assert set(stamp["cpu_flags"]) <= set(provenance.CPU_FLAGS)


CASE = headline.Case("agreement-x", "fidelity", "tiny", "x.jsonl")


def _default_row(qid: str = "1", **settings) -> dict:
    fmt = headline.default_format()
    defaults = headline.default_settings()
    made = headline.method_settings(
        headline.default_method(),
        weights="auto",
        weight_format=fmt,
        neighbours=defaults["neighbours"],
        kv_format=defaults["kv_format"],
    )
    return {
        "dataset": "hotpotqa",
        "qid": qid,
        "method": headline.default_method(),
        "settings": {**made, **settings},
        "engine_source": "aaaa",
        "agree": True,
        "chunk_hits": 6,
        "neighbour_hits": 5,
    }


def _verdict(tmp_path: Path, rows: list[dict], pending: dict[str, str] | None = None, source: str = "aaaa"):
    (tmp_path / CASE.file).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return headline.check(tmp_path, source=source, cases=[CASE], pending=pending or {})


def test_rows_made_in_todays_defaults_on_todays_engine_pass(tmp_path):
    assert headline.default_settings()["recompute_ratio"] == 0.15  # read off BlendConfig()
    verdict = _verdict(tmp_path, [_default_row("1"), _default_row("2")])
    assert verdict.failures == [] and verdict.pending == []


OTHER_FORMAT = {"fp16": "fp32", "fp32": "fp16"}


@pytest.mark.parametrize(
    "setting,value,reason",
    [
        ("weight_format", "other", "weights '{value}', not the default '{default}'"),
        ("recompute_ratio", 0.3, "recompute_ratio 0.3, not the default 0.15"),
        ("strategy", "hkvd", "strategy 'hkvd', not the default 'question'"),
        ("neighbour_caches", False, "neighbour_caches False, not the default True"),
        ("neighbours", 1, "neighbours 1, not the default 2"),
        ("neighbour_pool", "retrieved", "neighbour_pool 'retrieved', not the default 'corpus'"),
        ("kv_format", "float", "kv_format 'float', not the default 'int8'"),
    ],
)
def test_a_row_made_with_another_setting_fails_naming_table_row_and_setting(tmp_path, setting, value, reason):
    default = headline.default_format()
    if value == "other":
        value = OTHER_FORMAT[default]
    verdict = _verdict(tmp_path, [_default_row("1"), _default_row("2", **{setting: value})])
    want = reason.format(value=value, default=default)
    assert verdict.failures == [f"table readme-results, row x.jsonl hotpotqa/2 {headline.default_method()}: {want}"]


def test_a_row_older_than_the_engines_code_fails(tmp_path):
    verdict = _verdict(tmp_path, [_default_row("1")], source="bbbb")
    assert verdict.failures == [
        f"table readme-results, row x.jsonl hotpotqa/1 {headline.default_method()}: "
        "engine_source aaaa is not today's engine bbbb (the engine's code changed since)"
    ]


@pytest.mark.parametrize(
    "hits, reason",
    [
        (0, "neighbour_hits 0: neighbour-aware caches asked for, plain caches served every chunk"),
        (None, "neighbour_hits not recorded (neighbour-aware caches asked for; whether any served is unknown)"),
    ],
)
def test_a_row_whose_neighbour_caches_served_no_chunk_fails(tmp_path, hits, reason):
    """Settings say what a row asked for; a process whose engine never indexed the neighbour-aware
    caches answers from plain ones (the whole-answer run once precomputed them in another process)."""
    row = _default_row("2")
    if hits is None:
        del row["neighbour_hits"]
    else:
        row["neighbour_hits"] = hits
    verdict = _verdict(tmp_path, [_default_row("1"), row])
    assert verdict.failures == [f"table readme-results, row x.jsonl hotpotqa/2 {headline.default_method()}: {reason}"]


def test_rows_that_record_no_settings_fail_with_what_they_show(tmp_path):
    old = {"dataset": "musique", "qid": "7", "method": "question@0.15/nb", "neighbour_pool": "corpus", "agree": False}
    verdict = _verdict(tmp_path, [old])
    (failure,) = verdict.failures
    assert failure.startswith("table readme-results, row x.jsonl musique/7 question@0.15/nb: ")
    assert "settings not recorded" in failure and "engine_source not recorded" in failure
    if headline.default_format() == "fp16":
        assert "weights 'fp32', not the default 'fp16'" in failure  # no weights field: float32 rows


def test_pending_cases_are_listed_with_their_command_and_leave_the_list_once_remade(tmp_path):
    listed = _verdict(tmp_path, [_default_row("1", strategy="hkvd")], pending={CASE.name: CASE.file})
    assert listed.failures == []
    (line,) = listed.pending
    assert line.startswith("agreement-x: docs/results/x.jsonl, 1 of 1 rows: strategy 'hkvd', not the default 'question' (1 rows)")
    assert "Re-make: cacheblend-rag headline --out headline --only agreement-x" in line
    remade = _verdict(tmp_path, [_default_row("1")], pending={CASE.name: CASE.file})
    assert remade.failures == [
        "agreement-x: the rows of docs/results/x.jsonl are today's defaults on today's engine: "
        "delete its PENDING entry (cacheblend_bench.headline)"
    ]


def test_the_headline_rows_still_to_remake_are_the_known_list():
    """Today's README table reads rows made before the rule: they are listed, by case, with the
    command that re-makes them, and nothing else fails. Re-making a case shrinks this list."""
    verdict = doc_tables.headline_verdict()
    assert verdict.failures == []
    assert [line.split(":")[0] for line in verdict.pending] == []
    for line, case in zip(verdict.pending, [c for c in headline.CASES if c.name in headline.PENDING]):
        assert f"docs/results/{headline.PENDING[case.name]}" in line
        assert f"Re-make: cacheblend-rag headline --out headline --only {case.name}, then commit headline/{case.file}" in line


def test_export_stamps_each_row_with_the_process_that_wrote_it(tmp_path):
    """A case resumed by a second process: each row carries the engine and machine of the
    process that wrote it (the last stamp before the row's time)."""
    folder = tmp_path / CASE.name
    folder.mkdir()
    rows = [{"dataset": "d", "qid": str(i), "method": "question@0.15/nb", "time": t} for i, t in enumerate((1.0, 3.0))]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"cut short')
    stamps = [
        {
            "time": t,
            "weights": "auto",
            "weight_format": "fp16",
            "neighbours": 2,
            "engine": e,
            "engine_source": e,
            "machine": {"cpu": e},
        }
        for t, e in ((0.5, "first"), (2.0, "second"))
    ]
    (folder / headline.STAMPS).write_text("".join(json.dumps(s) + "\n" for s in stamps))
    out = headline.export(CASE, folder, tmp_path)
    assert [(r["engine_source"], r["machine"]["cpu"]) for r in out] == [("first", "first"), ("second", "second")]
    assert all(r["settings"]["neighbours"] == 2 and r["settings"]["weight_format"] == "fp16" for r in out)
    assert [json.loads(line) for line in (tmp_path / CASE.file).read_text().splitlines()] == out


def test_the_headline_command_makes_rows_that_pass_the_rule_and_resumes(tmp_path, monkeypatch):
    """Both kinds of case on the tiny model: rows in today's defaults with their engine, machine
    and settings, which the rule passes; a second run loads no model and changes no row."""
    from dataclasses import replace

    import cacheblend_bench.runner as runner

    tiny = dict(model="tiny", datasets=("crosschunk",), n=1, top_k=3, chunk_tokens=64)
    cases = [
        replace(headline.BY_NAME["whole-answer-smollm2"], lengths=(2, 4), llama_cpp=(), **tiny),
        replace(headline.BY_NAME["agreement-qwen05"], offset={}, **tiny),
    ]
    out = tmp_path / "headline"
    got = headline.run_headline(out, cases, progress=False)
    fmt = headline.default_format()
    assert sorted(r["method"] for r in got["whole-answer-smollm2"]) == sorted(
        [f"full_recompute_saved/{fmt}", f"{headline.default_method()}/{fmt}"]
    )
    assert [r["method"] for r in got["agreement-qwen05"]] == [headline.default_method()]
    for rows in got.values():
        for r in rows:
            assert r["engine_source"] == provenance.engine_source_now()
            assert r["machine"] == provenance.machine_stamp()
            assert r["settings"]["weights"] == "auto" and r["settings"]["weight_format"] == fmt
    # The neighbour-aware caches were made and read, in both kinds of case.
    assert got["agreement-qwen05"][0]["neighbour_hits"] > 0
    (blend,) = [r for r in got["whole-answer-smollm2"] if r["method"].startswith(headline.default_method())]
    assert blend["neighbour_hits"] > 0 and blend["chunk_hits"] == 3
    results = tmp_path / "results"
    results.mkdir()
    for case in cases:
        (results / case.file).write_bytes((out / case.file).read_bytes())
    assert headline.check(results, cases=cases, pending={}).failures == []

    monkeypatch.setattr(runner, "load_engine", lambda *a, **k: pytest.fail("a finished case loaded a model"))
    before = {c.file: (out / c.file).read_text() for c in cases}
    again = headline.run_headline(out, cases, progress=False)
    assert {c.file: (out / c.file).read_text() for c in cases} == before
    assert {k: len(v) for k, v in again.items()} == {k: len(v) for k, v in got.items()}


def test_the_headline_command_lists_its_cases_and_refuses_an_unknown_one(capsys):
    from cacheblend_rag.cli.app import main

    assert main(["headline", "--list"]) == 0
    listed = capsys.readouterr().out
    for case in headline.CASES:
        assert f"{case.name}: {case.model}, {headline.default_format()} weights" in listed and case.file in listed
    with pytest.raises(
        SystemExit, match="unknown case nope; choose from whole-answer-smollm2, whole-answer-qwen05, agreement-qwen05"
    ):
        main(["headline", "--only", "nope"])
