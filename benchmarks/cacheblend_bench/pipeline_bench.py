"""``cacheblend-rag pipeline-bench``: does pipelined loading hide the recompute, tier by tier?

For each storage tier (memory, disk, a Redis with ``--redis URL``, and the disk behind a reader
throttled to ``--throttle-mbps``) it measures, side by side and interleaved over ``--repeats``
rounds (median reported):

* pure load: reading every layer of every chunk from the tier, nothing else (the floor);
* load-then-compute: CacheBlend with the loader not overlapped (``pipelined=False``);
* pipelined: CacheBlend with layer i+1 loading while layer i recomputes;
* full recompute: a plain prefill of the whole prompt (no storage involved).

The CacheBlend runs use the ratio the loading controller picks for that tier (from a profile of
this model on this machine: full prefill, the fused prefill calibrated at this context size, and the
tiers' measured read throughput and CPU cost) and report how much of the load was hidden behind
compute, next to what the controller predicted. TTFT here is prefill plus sampling the first token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

DEFAULT_QUESTION = "Where was the author of Hannibal and Scipio educated at?"


def _chunks(n: int, min_tokens: int, tokenizer, musique: Path) -> list[str]:
    """The first passages of the MuSiQue file, merged up to ``min_tokens`` tokens each."""
    passages: list[str] = []
    for item in json.loads(musique.read_text(encoding="utf-8")):
        passages += [c["text"] for c in item["ctxs"]]
    out, cur = [], ""
    for p in passages:
        cur = f"{cur}\n{p}" if cur else p
        if len(tokenizer(cur, add_special_tokens=False)["input_ids"]) >= min_tokens:
            out.append(cur)
            cur = ""
            if len(out) == n:
                break
    return out


def _pure_load(store, keys: list[str], num_layers: int) -> float:
    from cacheblend_rag.store.protocol import read_layers

    t0 = time.perf_counter()
    for layer in range(num_layers):
        # As the loader reads: one layer of every chunk at once (one round trip to Redis).
        for key, got in zip(keys, read_layers(store, keys, layer)):
            if got is None:
                raise RuntimeError(f"chunk {key[:12]} missing from {store!r} during the pure-load run")
    return time.perf_counter() - t0


def _ttft(engine, question, chunks, **kw) -> tuple[float, dict[str, Any]]:
    res = engine.generate(question, chunks, max_new_tokens=1, **kw)
    return res.ttft_s, res.stats


def run(args: argparse.Namespace) -> dict[str, Any]:
    from cacheblend_bench.throttle import ThrottledStore
    from cacheblend_rag.cli.paths import data_file
    from cacheblend_rag.control.controller import LoadingController
    from cacheblend_rag.control.profiler import profile_engine
    from cacheblend_rag.engine.core import CacheBlendEngine
    from cacheblend_rag.store.disk import KVStore
    from cacheblend_rag.store.dtypes import resolve_dtype
    from cacheblend_rag.store.memory import MemoryTier

    musique = data_file("musique", args.musique)  # before loading the model: a missing file fails fast
    torch.manual_seed(0)
    engine = CacheBlendEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    stored = resolve_dtype(args.stored_dtype) or engine.dtype
    chunks = _chunks(args.chunks, args.chunk_tokens, engine.tokenizer, musique)
    if len(chunks) < args.chunks:
        raise SystemExit(
            f"error: {musique} holds enough text for {len(chunks)} chunks of {args.chunk_tokens} tokens, "
            f"not --chunks {args.chunks}: lower --chunks or --chunk-tokens"
        )
    layout = engine.build_layout(args.question, chunks)
    n_ctx = layout.num_context_tokens
    keys = [engine.chunk_key(s) for s in layout.segments if s.reusable]
    tmp = tempfile.TemporaryDirectory(prefix="pipeline-bench-")
    disk = KVStore(Path(tmp.name) / "kv", fingerprint=engine.fingerprint)
    mem = MemoryTier(capacity_bytes=8 * 2**30)
    tiers = {
        "memory": (mem, 1.0),
        "disk": (disk, 0.1),
    }
    filled = [disk]  # stores filled directly (the throttled tiers read the disk)
    if args.redis:
        from cacheblend_rag.store.redis_tier import RedisConfig, RedisStore
        from cacheblend_rag.store.spec import TIER_COSTS

        # Its own prefix, cleared afterwards: the bench never touches the Redis's other keys.
        redis_store = RedisStore(RedisConfig(args.redis, prefix=f"pipeline-bench-{os.getpid()}"), fingerprint=engine.fingerprint)
        tiers["redis"] = (redis_store, TIER_COSTS["redis"])
        filled.append(redis_store)
    for mbps in args.throttle_mbps:
        name = f"throttled{mbps:g}"
        tiers[name] = (ThrottledStore(disk, mbps * 1e6, name=name), 0.01)
        if args.redis:  # a Redis behind a slow link: the same reads at the throttled rate
            tiers[f"redis_{name}"] = (ThrottledStore(redis_store, mbps * 1e6, name=f"redis_{name}"), 0.01)
    results: dict[str, Any] = {"context_tokens": n_ctx, "prompt_tokens": len(layout), "chunks": len(chunks)}
    try:
        # Fill the tiers (not timed): the model's K/V, cast to the stored dtype.
        engine.precompute(chunks, progress=False, store=mem)
        for key in keys:
            layers = [mem.get_layer(key, i) for i in range(engine.num_layers)]
            layers = [(k.to(stored), v.to(stored)) for k, v in layers]
            mem.discard(key)
            mem.put(key, layers)
            for store in filled:
                if not store.put(key, layers):
                    raise RuntimeError(f"could not fill {store!r} with the bench's chunks")

        print(f"profiling prefill and tier reads ({n_ctx} context tokens, {len(chunks)} chunks)...", flush=True)
        lengths = sorted({max(64, n_ctx // 4), max(128, n_ctx // 2), n_ctx})
        profile = profile_engine(
            engine,
            lengths=lengths,
            tiers={n: s for n, (s, _) in tiers.items()},
            tier_costs={n: c for n, (_, c) in tiers.items()},
            stored_dtype=stored,
            tier_tokens=256,
            repeats=2,
            fused_tokens=n_ctx,
            fused_chunks=len(chunks),
        )
        ctl = LoadingController(profile, quality_floor=args.floor, cpu_contention=args.cpu_contention)
        full_ttfts = []
        rows: dict[str, dict[str, list]] = {n: {} for n in tiers}
        for rnd in range(args.repeats + 1):  # round 0 warms caches and threads, not reported
            t, _ = _ttft(engine, args.question, chunks, mode="full_recompute")
            if rnd:
                full_ttfts.append(t)
            for name, (store, _) in tiers.items():
                on = dict(store=store, controller=ctl)  # this answer reads (and writes back to) the tier
                if rnd == 0:  # warm-up round: touch every path once, record nothing
                    _ttft(engine, args.question, chunks, **on)
                    continue
                load = _pure_load(store, keys, engine.num_layers)
                runs = {}
                for piped in (False, True) if rnd % 2 else (True, False):  # alternate the order
                    runs[piped] = _ttft(engine, args.question, chunks, pipelined=piped, **on)
                (seq, seq_stats), (pip, pip_stats) = runs[False], runs[True]
                flo, _ = _ttft(engine, args.question, chunks, recompute_ratio=args.floor, pipelined=True, **on)
                r = rows[name]
                for k, v in (
                    ("pure_load_s", load),
                    ("sequential_s", seq),
                    ("pipelined_s", pip),
                    ("pipelined_floor_s", flo),
                    ("ratio", pip_stats["recompute_ratio"]),
                    ("load_s", pip_stats["load_s"]),
                    ("load_hidden_s", pip_stats["load_hidden_s"]),
                    ("load_exposed_s", pip_stats["load_exposed_s"]),
                    ("compute_s", pip_stats["compute_s"]),
                    ("seq_load_s", seq_stats["load_s"]),
                    ("seq_compute_s", seq_stats["compute_s"]),
                    # what the controller predicted for this request
                    ("est_load_s", pip_stats["controller_est_load_s"]),
                    ("est_recompute_s", pip_stats["controller_est_recompute_s"]),
                    ("est_contention_s", pip_stats["controller_est_contention_s"]),
                    ("seq_prefill_minus_load_s", seq_stats["prefill_s"] - seq_stats["load_s"]),
                ):
                    r.setdefault(k, []).append(v)
        results["full_recompute_s"] = statistics.median(full_ttfts)
        results["profile"] = {
            "device": profile.device,
            "prefill_points": profile.prefill_points,
            "tiers_mb_s": {n: t.read_bytes_per_s / 1e6 for n, t in profile.tiers.items()},
            "tiers_cpu_ns_per_byte": {n: (t.cpu_s_per_byte or 0.0) * 1e9 for n, t in profile.tiers.items()},
            "fused": None
            if profile.fused is None
            else {
                "fixed": profile.fused.fixed,
                "per_ratio": profile.fused.per_ratio,
                "points": profile.fused.points,
            },
            "assemble_s_per_token": profile.assemble_s_per_token,
            "cpu_contention": ctl.cpu_contention,
        }
        results["tiers"] = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in rows.items()}
        for n in tiers:
            results["tiers"][n]["cheapest_tier_at_ratio"] = ctl.cheapest_tier(results["tiers"][n]["ratio"], n_ctx)
    finally:
        if args.redis:
            redis_store.clear()
        for store in filled:
            store.close()
        tmp.cleanup()
        engine.close()
    return results


def report(res: dict[str, Any], args: argparse.Namespace) -> str:
    full = res["full_recompute_s"]
    lines = [
        f"context {res['context_tokens']} tokens in {res['chunks']} chunks (prompt {res['prompt_tokens']}), "
        f"stored {args.stored_dtype or args.dtype}, median of {args.repeats} rounds",
        "measured read MB/s: " + ", ".join(f"{n} {v:.0f}" for n, v in res["profile"]["tiers_mb_s"].items()),
        "TTFT relative to full recompute (=1.00); 'vs load' = pipelined TTFT / pure load time",
        f"{'tier':10s} {'ratio':>5s} {'pure load':>9s} {'load->comp':>10s} {'pipelined':>9s} {'pipe@floor':>10s} "
        f"{'vs load':>7s} {'hidden':>7s} {'seq/pipe':>8s}",
    ]
    for name, r in res["tiers"].items():
        hidden = r["load_hidden_s"] / r["load_s"] if r["load_s"] else 0.0
        lines.append(
            f"{name:10s} {r['ratio']:5.2f} {r['pure_load_s'] / full:9.2f} {r['sequential_s'] / full:10.2f} "
            f"{r['pipelined_s'] / full:9.2f} {r['pipelined_floor_s'] / full:10.2f} "
            f"{r['pipelined_s'] / r['pure_load_s']:7.2f} {100 * hidden:6.0f}% {r['sequential_s'] / r['pipelined_s']:8.2f}"
        )
    lines.append(f"full recompute TTFT: 1.00 (absolute {full * 1e3:.0f} ms on this machine, this run)")
    prof = res["profile"]
    f = prof.get("fused")
    lines.append(
        "controller: recompute = "
        + (
            f"({f['fixed']:.3f} + {f['per_ratio']:.3f} x r) x full prefill (calibrated)"
            if f
            else "r x full prefill (uncalibrated)"
        )
        + f", CPU contention factor {prof.get('cpu_contention', 0):g}"
    )
    lines.append(
        "predicted vs measured, seconds (measured compute: pipelined run's; recompute+cont. is what must fit under the load)"
    )
    lines.append(
        f"{'tier':12s} {'est load':>8s} {'pure load':>9s} {'est recomp':>10s} {'+cont.':>7s} {'compute':>8s} {'seq compute':>11s}"
    )
    for name, r in res["tiers"].items():
        if "est_load_s" not in r:
            continue
        lines.append(
            f"{name:12s} {r['est_load_s']:8.2f} {r['pure_load_s']:9.2f} {r['est_recompute_s']:10.2f} "
            f"{r['est_recompute_s'] + r['est_contention_s']:7.2f} {r['compute_s']:8.2f} {r['seq_prefill_minus_load_s']:11.2f}"
        )
    return "\n".join(lines)


def _rate(mb_s: float) -> str:
    return f"{mb_s / 1e3:.0f} GB/s" if mb_s >= 1e4 else f"{mb_s:.0f} MB/s"


def tiers_table(res: dict[str, Any], labels: dict[str, str] | None = None) -> str:
    """A run's tiers as the docs' markdown table: read rate, and TTFT as a share of full
    recompute's for the pure load, load then compute, and pipelined, and the load hidden."""
    full = res["full_recompute_s"]
    lines = [
        "| tier | read rate | pure load / full prefill TTFT | TTFT / full prefill, load then compute "
        "| TTFT / full prefill, pipelined | load hidden behind compute |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in res["tiers"].items():
        hidden = r["load_hidden_s"] / r["load_s"] if r["load_s"] else 0.0
        lines.append(
            f"| {(labels or {}).get(name, name)} | {_rate(res['profile']['tiers_mb_s'][name])} | {r['pure_load_s'] / full:.2f} "
            f"| {r['sequential_s'] / full:.2f} | {r['pipelined_s'] / full:.2f} | {hidden:.0%} |"
        )
    return "\n".join(lines)


def _main(args: argparse.Namespace) -> int:
    res = run(args)
    print(report(res, args))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
        print(f"raw numbers: {args.json}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("pipeline-bench", help="TTFT of load-then-compute vs pipelined vs full recompute per storage tier")
    p.add_argument("--model", default=None, help="model dir, .gguf file or hub id (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--stored-dtype", default=None, help="dtype the tiers hold (fp32/fp16/bf16; default: the model's)")
    p.add_argument(
        "--musique", default=None, help="MuSiQue JSON whose passages make the chunks (default: $CACHEBLEND_RAG_MUSIQUE)"
    )
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--chunk-tokens", type=int, default=256, help="minimum tokens per chunk (passages are merged)")
    p.add_argument("--question", default=DEFAULT_QUESTION)
    p.add_argument(
        "--throttle-mbps",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[100.0],
        help="read rate(s) of the throttled tier(s), MB/s, comma-separated (one tier each)",
    )
    p.add_argument("--redis", default=None, metavar="URL", help="also measure a Redis tier at this URL (redis://host:6379/0)")
    p.add_argument("--floor", type=float, default=0.15, help="quality floor r* of the controller")
    p.add_argument(
        "--cpu-contention",
        type=float,
        default=None,
        help="controller's CPU contention factor (default: 1 on a CPU, 0 on an accelerator; 0 disables the CPU rule)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the raw numbers here")
    p.set_defaults(func=_main)
