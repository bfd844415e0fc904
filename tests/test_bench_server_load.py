"""``bench --load --server``: the real HTTP server under concurrent streaming clients, run in
process on the tiny random model (mechanics, not speed)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from cacheblend_bench.runner import tiny_engine
from cacheblend_bench.server_load import ROWS, SUMMARY, ServerLoadConfig, main, markdown_table, run_server_load


def test_server_load_covers_every_setting_and_batches_only_when_allowed(tmp_path, capsys):
    cfg = ServerLoadConfig(
        model="tiny",
        dataset="crosschunk",
        n=3,
        methods=("full_recompute", "question@0.5"),
        clients=(1, 3),
        requests=4,
        max_batches=(1, 3),
        max_new_tokens=6,
        top_k=2,
        chunk_tokens=40,
        out_dir=str(tmp_path),
        progress=False,
    )
    engine = tiny_engine(str(tmp_path / "kv"))
    try:
        summary = run_server_load(cfg, engine=engine)
    finally:
        engine.close()
    assert len(summary) == 2 * 2 * 2  # methods x batch sizes x client counts
    for e in summary:
        assert e["answers"] == 4 and e["answers_per_s"] > 0 and 0 < e["ttft_p50"] <= e["e2e_p95"]
        assert e["answers_per_step"] <= e["max_batch"]
        if e["max_batch"] == 1 or e["clients"] == 1:
            assert e["answers_per_step"] in (0.0, 1.0)  # never more than one answer per step
    rows = [json.loads(line) for line in (tmp_path / ROWS).read_text().splitlines()]
    assert len(rows) == 4 * len(summary)
    assert {r["mode"] for r in rows} == {"full_recompute", "cacheblend"}
    assert {r["strategy"] for r in rows if r["mode"] == "cacheblend"} == {"question"}
    assert all(0 < r["ttft_s"] <= r["total_s"] and r["tokens"] >= 1 for r in rows)
    saved = json.loads((tmp_path / SUMMARY).read_text())
    assert saved["summary"] == json.loads(json.dumps(summary)) and saved["config"]["clients"] == [1, 3]
    table = markdown_table(summary)
    assert len(table.splitlines()) == 2 + len(summary)
    # Each unbatched setting against itself is 1.00x (a batched one may round to it too).
    cells = [line.split(" | ") for line in table.splitlines()[2:]]
    assert [c[4] for c in cells if c[1] == "1"] == ["1.00x"] * 4
    assert main(["--table", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == table


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(methods=("cacheblend@0.15",)), "sets only the prefill mode and the recompute ratio"),
        (dict(methods=("map_reduce",)), "sets only the prefill mode and the recompute ratio"),
        (dict(clients=(0,)), "clients=\\(0,\\): give one or more ints >= 1"),
        (dict(max_batches=()), "max_batches=\\(\\): give one or more ints >= 1"),
        (dict(requests=0), "requests, n and max_new_tokens must be >= 1"),
    ],
)
def test_bad_server_load_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerLoadConfig(**kwargs)


def test_the_bench_command_routes_server_to_the_server_load(monkeypatch, tmp_path):
    from cacheblend_bench import server_load
    from cacheblend_rag.cli import app as cli

    seen = {}
    monkeypatch.setattr(server_load, "run_server_load", lambda cfg: seen.setdefault("cfg", cfg) and [])
    assert (
        cli.main(
            [
                "bench",
                "--load",
                "--server",
                "--model",
                "smollm2",
                "--datasets",
                "hotpotqa",
                "--clients",
                "1,4,8",
                "--max-batch",
                "1,8",
                "--max-new-tokens",
                "64",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    cfg = seen["cfg"]
    assert (cfg.clients, cfg.max_batches, cfg.max_new_tokens, cfg.methods) == ((1, 4, 8), (1, 8), 64, ("question@0.15",))
