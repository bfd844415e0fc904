"""``pipeline-bench``: loading chunk caches from each tier, pipelined or not, with the loading
controller's choices (docs/storage.md, docs/pipeline.md) and a Redis tier (docs/sharing.md)."""

from __future__ import annotations

import types
from typing import Any

from cacheblend_bench import ingest_rate, ttft_kv_formats
from cacheblend_bench.format_fidelity import compare_formats, markdown
from cacheblend_bench.pipeline_bench import report, tiers_table
from cacheblend_bench.published.fmt import Stat
from cacheblend_bench.published.results import Results, Table, Values
from cacheblend_bench.replay import formats_table

CALIBRATED = "pipeline_bench_calibrated.json"  # the loading controller, calibrated (docs/storage.md)
UNCALIBRATED = "pipeline_bench_quiet.json"  # the same before the calibration (docs/pipeline.md)
REDIS = "pipeline_bench_redis.json"
INGEST = "ingest_kill_smollm2.json"  # a corpus ingestion killed and resumed (docs/storage.md)
REPLAY_FORMATS = "replay_formats.jsonl"  # the replay's stream, one run per disk record format (docs/storage.md)
TTFT_KV = "ttft_kv_formats_smollm2.jsonl"  # first token from a disk store of each record format (docs/storage.md)
TTFT_KV_COLD = "ttft_kv_formats_cold_smollm2.jsonl"  # the same, each store's records read from the disk
INGEST_RATE = "ingest_rate.jsonl"  # ingest's chunks per second by model, threads and neighbours
# Qwen2.5-Coder-0.5B's answers from each record format's store, one fidelity run (docs/storage.md)
KV_QWEN = {f: f"kv_formats_qwen05_{f}.jsonl" for f in ("float", "int8", "int4")}
DEFAULT_METHOD = "question@0.15/nb"  # what the integrations run: neighbour-aware caches from the corpus
# The options of the commands the pages show, which the JSON does not record.
CALIBRATED_ARGS = types.SimpleNamespace(stored_dtype=None, dtype="float32", repeats=2)
REDIS_LABELS = {
    "memory": "memory",
    "disk": "local disk (warm page cache)",
    "redis": "local Redis",
    "throttled100": "disk throttled to 100 MB/s",
    "redis_throttled100": "Redis throttled to 100 MB/s",
}


def _calibrated_block(res: Results) -> str:
    return "```\n" + report(res.json(CALIBRATED), CALIBRATED_ARGS) + "\n```"


def _tier_values(res: Results, name: str) -> dict[str, Any]:
    run = res.json(name)
    full = run["full_recompute_s"]
    v: dict[str, Any] = {
        "full_s": full,
        "chunks": run["chunks"],
        "context_tokens": run["context_tokens"],
        "prompt_tokens": run["prompt_tokens"],
    }
    for tier, r in run["tiers"].items():
        v[f"{tier}.ratio"] = r["ratio"]
        v[f"{tier}.pure_load"] = r["pure_load_s"] / full
        v[f"{tier}.pure_load_s"] = r["pure_load_s"]
        v[f"{tier}.sequential"] = r["sequential_s"] / full
        v[f"{tier}.pipelined"] = r["pipelined_s"] / full
        v[f"{tier}.vs_load"] = r["pipelined_s"] / r["pure_load_s"]
        v[f"{tier}.floor_vs_load"] = r["pipelined_floor_s"] / r["pure_load_s"]
        v[f"{tier}.seq_over_pipe"] = r["sequential_s"] / r["pipelined_s"]
        v[f"{tier}.pipe_over_seq"] = r["pipelined_s"] / r["sequential_s"]
        v[f"{tier}.hidden"] = r["load_hidden_s"] / r["load_s"] if r["load_s"] else 0.0
        v[f"{tier}.speedup"] = full / r["pipelined_s"]  # pipelined CacheBlend's speed-up over full recompute
        if "est_recompute_s" in r:
            v[f"{tier}.est_under"] = 1 - r["est_recompute_s"] / r["seq_prefill_minus_load_s"]
    fast = [t for t in run["tiers"] if not t.startswith(("throttled", "redis_throttled"))]
    slow = [t for t in run["tiers"] if t.startswith(("throttled", "redis_throttled"))]
    v["fast.pipelined"] = [v[f"{t}.pipelined"] for t in fast]
    v["fast.hidden"] = [v[f"{t}.hidden"] for t in fast]
    v["floor_tiers.pipelined"] = [v[f"{t}.pipelined"] for t in run["tiers"] if run["tiers"][t]["ratio"] <= 0.15 + 1e-9]
    v["floor_tiers.hidden"] = [v[f"{t}.hidden"] for t in run["tiers"] if run["tiers"][t]["ratio"] <= 0.15 + 1e-9]
    v["slow.pipelining_gain"] = [v[f"{t}.seq_over_pipe"] - 1 for t in slow]
    v["fast.speedup"] = [v[f"{t}.speedup"] for t in fast]
    v["est_under"] = [v[f"{t}.est_under"] for t in run["tiers"] if f"{t}.est_under" in v]
    prefill = run["profile"]["prefill_points"][-1]  # (context tokens, full prefill s) the profile measured
    v["profiled_prefill_s"] = prefill[1]
    return v


def _first_stream(rows: list[dict]) -> list[dict]:
    """A replay file's rows of its first stream (the one its table shows)."""
    stream = next(r["stream"] for r in rows if r["kind"] == "config")
    return [r for r in rows if r["stream"] == stream]


def _replay_block(name: str):
    def render(res: Results) -> str:
        from cacheblend_bench.replay import summary_table

        return summary_table(_first_stream(res.rows(name)))

    return render


TABLES = {
    "replay": Table(("replay.jsonl",), _replay_block("replay.jsonl")),
    "replay-drift": Table(("replay_drift.jsonl",), _replay_block("replay_drift.jsonl")),
    "replay-formats": Table((REPLAY_FORMATS,), lambda res: formats_table(res.rows(REPLAY_FORMATS))),
    "ttft-kv-formats": Table((TTFT_KV,), lambda res: ttft_kv_formats.table(res.rows(TTFT_KV))),
    "ttft-kv-formats-cold": Table((TTFT_KV_COLD,), lambda res: ttft_kv_formats.table(res.rows(TTFT_KV_COLD))),
    "ingest-rate": Table((INGEST_RATE,), lambda res: ingest_rate.table(res.rows(INGEST_RATE))),
    **{
        f"kv-formats-qwen05-{f}": Table((KV_QWEN[f], KV_QWEN["float"]), lambda res, f=f: markdown(_kv_comparison(res, f)))
        for f in ("int8", "int4")
    },
    "pipeline-bench-calibrated": Table((CALIBRATED,), _calibrated_block),
    "pipeline-bench-redis": Table((REDIS,), lambda res: tiers_table(res.json(REDIS), REDIS_LABELS)),
}


def _ingest_values(res: Results) -> dict[str, Any]:
    row = res.json(INGEST)
    disk = next(t for t in row["store"] if t["tier"] == "disk")
    ((fmt, held),) = disk["formats"].items()
    second = row["second"]
    return {
        "chunks": row["after"]["chunks"],
        "tokens": row["after"]["tokens"],
        "format": fmt,
        "stored_chunks": held["chunks"],
        "gb": held["bytes"] / 1e9,
        "float_gb": row["float_corpus_bytes"] / 1e9,
        "bytes_per_token": held["bytes_per_token"],
        "killed_at": row["stored_by_killed_run"],
        "computed_in_all": row["computed_in_all"],
        "to_compute_after": row["after"]["to_compute"],
        "unreadable": row["check"]["unreadable"],
        "resumed_chunks": second["computed"],
        "resumed_min": second["seconds"] / 60,
        "chunks_per_s": second["computed"] / second["seconds"],
        "threads": row["threads"],
    }


def _kv_comparison(res: Results, fmt: str) -> dict[str, Any]:
    return res.memo(f"kv-{fmt}", lambda: compare_formats(res.rows(KV_QWEN[fmt]), res.rows(KV_QWEN["float"])))


def _kv_values(res: Results) -> dict[str, Any]:
    v: dict[str, Any] = {}
    for fmt in ("int8", "int4"):
        c = _kv_comparison(res, fmt)
        m = c["methods"][DEFAULT_METHOD]
        d = m["agree_f1_diff"]
        v |= {
            f"{fmt}.n": m["questions"],
            f"{fmt}.agree": m["agree_fmt"],
            f"{fmt}.agree_float": m["agree_ref"],
            f"{fmt}.better": d["better"],
            f"{fmt}.worse": d["worse"],
            f"{fmt}.kl_ratio": Stat(m["kl_ratio"], tuple(m["kl_ratio_ci"])),
        }
    return v


def _ttft_values(name: str):
    def compute(res: Results) -> dict[str, Any]:
        return {
            f"{e['kv_format']}.vs_float": Stat(e["vs_float"], tuple(e["vs_float_ci"]))
            for e in ttft_kv_formats.summarize(res.rows(name))
        }

    return compute


def _ingest_rate_values(res: Results) -> dict[str, Any]:
    """Per model: neighbour-aware caches' time over plain caches' (same threads), and a second thread's gain."""
    rows = {(r["model"], r["threads"], r["neighbours"]): r for r in res.rows(INGEST_RATE)}
    v: dict[str, Any] = {}
    for (model, threads, nb), r in rows.items():
        plain = rows.get((model, threads, 0))
        if nb and plain:
            v[f"{model}.nb_cost"] = r["seconds"] / plain["seconds"]
        one = rows.get((model, 1, 0))
        if not nb and threads == 2 and one:
            v[f"{model}.two_threads"] = one["seconds"] / r["seconds"]
    return v


REPLAYS = {"steady": "replay.jsonl", "drift": "replay_drift.jsonl"}


def _policy_values(res: Results) -> dict[str, Any]:
    """docs/cluster.md's reading of the two replay tables: the static oracle's hit rate, the best
    policy pair's share of it, and what ``lfu`` gains over ``lru`` in the memory tier."""
    v: dict[str, Any] = {}
    gains, shares = [], {"lfu": [], "lru": []}
    for stream, name in REPLAYS.items():
        rows = _first_stream(res.rows(name))
        oracle = next(r["hit_rate"] for r in rows if r["run"] == "static oracle")
        pairs = {(r["memory_policy"], r["disk_policy"]): r for r in rows if r["kind"] == "summary"}
        v[f"{stream}.oracle"] = oracle
        v[f"{stream}.best_of_oracle"] = max(r["hit_rate"] for r in pairs.values()) / oracle
        for (memory, disk), r in pairs.items():
            shares[memory].append(r["memory_share_of_reads"])
            if memory == "lfu" and ("lru", disk) in pairs:
                gain = 100 * (r["hit_rate"] - pairs[("lru", disk)]["hit_rate"])
                gains.append(gain)
                if disk == "least-recently-used":
                    v[f"{stream}.lfu_gain_default"] = gain
    v["lfu_gain"] = [min(gains), max(gains)]
    v["lfu_share"], v["lru_share"] = [min(shares["lfu"]), max(shares["lfu"])], [min(shares["lru"]), max(shares["lru"])]
    return v


VALUES = {
    "ingest_rate": Values((INGEST_RATE,), _ingest_rate_values),
    "kv_qwen": Values(tuple(KV_QWEN.values()), _kv_values),
    "ttft_kv": Values((TTFT_KV,), _ttft_values(TTFT_KV)),
    "ttft_kv_cold": Values((TTFT_KV_COLD,), _ttft_values(TTFT_KV_COLD)),
    "ingest": Values((INGEST,), _ingest_values),
    "tiers": Values((CALIBRATED,), lambda res: _tier_values(res, CALIBRATED)),
    "tiers0": Values((UNCALIBRATED,), lambda res: _tier_values(res, UNCALIBRATED)),
    "redis": Values((REDIS,), lambda res: _tier_values(res, REDIS)),
    "policies": Values(tuple(REPLAYS.values()), _policy_values),
}
