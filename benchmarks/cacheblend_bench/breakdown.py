"""Where a prefill's time goes: torch.profiler over full prefill and the fused prefill, by kind of work.

    python -m cacheblend_bench.breakdown --dataset musique --n 2 --out breakdown.json

Each question's chunks are retrieved and precomputed as in ``bench``; then, after one untimed
warm-up, every mode's prefill runs ``--rounds`` times, modes interleaved, each time twice: once
timed plainly (``wall_s``: the profiler's bookkeeping would inflate a many-operator prefill more
than a few-operator one) and once under ``torch.profiler`` (CPU activities), whose operators' self
time is summed into:

* ``attention``: the attention kernels (SDPA and what the math path calls: bmm, softmax);
* ``gemm``: the projections and the MLP (linear/addmm/mm/matmul);
* ``other_ops``: every other operator (norms, rotary, activations, masks, copies, indexing);
* ``python``: wall time minus all operator time (Python work between operators, locks, I/O).

Shares are of the profiled prefill's wall time. A mode's speed-up over the saved full prefill is
``stats.speedup`` over the (question, round) pairs; the overhead divides a fused prefill's wall time by (its computed token-layers / the saved
full prefill's x the saved full prefill's wall time), as ``bench`` does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

from torch.profiler import ProfilerActivity, profile

from cacheblend_bench.stats import speedup

ATTENTION = ("scaled_dot_product", "flash_attention", "bmm", "softmax", "baddbmm")
GEMM = ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul")
CATEGORIES = ("attention", "gemm", "other_ops", "python")


def category(op: str) -> str:
    if any(k in op for k in ATTENTION):
        return "attention"
    if op in GEMM:
        return "gemm"
    return "other_ops"


def profile_prefill(engine, layout, mode: str) -> dict[str, Any]:
    """Two prefills of ``layout`` in ``mode``: one timed plainly, one under the profiler (seconds
    per category, ``profiled_s`` its wall time)."""
    t0 = time.perf_counter()
    res = engine.prefill(layout, mode)
    wall = time.perf_counter() - t0
    engine.flush()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        engine.prefill(layout, mode)
        profiled = time.perf_counter() - t0
    engine.flush()
    parts: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        parts[category(ev.key)] += ev.self_cpu_time_total / 1e6
    parts["python"] = max(0.0, profiled - sum(parts.values()))
    return {
        "wall_s": wall,
        "profiled_s": profiled,
        "compute_fraction": res.stats.get("compute_fraction", 1.0),
        **{c: parts[c] for c in CATEGORIES},
    }


def run(engine, prompts: list[tuple[str, list[str]]], modes: list[str], rounds: int) -> list[dict[str, Any]]:
    rows = []
    for qi, (question, chunks) in enumerate(prompts):
        engine.precompute(chunks, progress=False)
        engine.flush()
        layout = engine.build_layout(question, chunks)
        for mode in modes:
            engine.prefill(layout, mode)  # warm-up, untimed
            engine.flush()
        for rnd in range(rounds):
            for mode in modes:  # interleaved, so machine noise hits every mode alike
                rows.append(
                    {
                        "question": qi,
                        "round": rnd,
                        "mode": mode,
                        "prompt_tokens": len(layout),
                        **profile_prefill(engine, layout, mode),
                    }
                )
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per mode: mean and median wall time, each category's share of the summed wall time, and
    against the saved full prefill (when it ran) the speed-up and the overhead."""
    out: dict[str, Any] = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        rs = [r for r in rows if r["mode"] == mode]
        wall = sum(r["profiled_s"] for r in rs)
        out[mode] = {
            "n": len(rs),
            "wall_mean_s": statistics.mean(r["wall_s"] for r in rs),
            "wall_median_s": statistics.median(r["wall_s"] for r in rs),
            "compute_fraction": statistics.mean(r["compute_fraction"] for r in rs),
            **{f"{c}_share": sum(r[c] for r in rs) / wall for c in CATEGORIES},
        }
    saved = [r for r in rows if r["mode"] == "full_recompute_saved"]
    if saved:
        ref = {(r["question"], r["round"]): r for r in saved}
        for mode, s in out.items():
            rs = [r for r in rows if r["mode"] == mode and (r["question"], r["round"]) in ref]
            den = sum(
                r["compute_fraction"] / f["compute_fraction"] * f["wall_s"]
                for r in rs
                for f in [ref[(r["question"], r["round"])]]
            )
            s["overhead"] = sum(r["wall_s"] for r in rs) / den if den else float("nan")
            s["speedup_vs_saved"], s["speedup_vs_saved_ci"] = speedup(
                [ref[(r["question"], r["round"])]["wall_s"] for r in rs], [r["wall_s"] for r in rs]
            )
    return out


def report(summary: dict[str, Any]) -> str:
    """The summary as a markdown table (the docs' table of where a prefill's time goes)."""
    lines = [
        "| mode | prefill (mean) | speed-up vs saved full prefill | token-layers computed | overhead | attention "
        "| projections + MLP | other operators | Python between operators |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, s in summary.items():
        ci = s.get("speedup_vs_saved_ci")
        ratio = (
            f"{s['speedup_vs_saved']:.2f}x" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci and ci[0] == ci[0] else "")
            if "speedup_vs_saved" in s
            else "-"
        )
        lines.append(
            f"| `{mode}` | {s['wall_mean_s']:.2f} s | {ratio} | {s['compute_fraction']:.1%} | {s.get('overhead', float('nan')):.2f} | "
            f"{s['attention_share']:.0%} | {s['gemm_share']:.0%} | {s['other_ops_share']:.0%} | {s['python_share']:.0%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from cacheblend_bench import datasets as ds
    from cacheblend_bench.runner import BenchConfig, load_engine

    p = argparse.ArgumentParser(
        prog="python -m cacheblend_bench.breakdown", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dataset", default="musique", choices=ds.DATASETS)
    p.add_argument("--n", type=int, default=2, help="questions (default 2)")
    p.add_argument("--offset", type=int, default=0, help="skip this many questions first")
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default="full_recompute_saved,cacheblend")
    p.add_argument("--out", default=None, help="write the rows and the summary to this JSON file")
    p.add_argument("--store-dir", default="bench-results/breakdown", help="its chunk KV store")
    args = p.parse_args(argv)
    engine = load_engine(BenchConfig(model=args.model, out_dir=args.store_dir))
    examples = ds.load_dataset(args.dataset, args.offset + args.n, chunk_tokens=args.chunk_tokens)[args.offset :]
    count, retriever = ds.token_counter(engine.tokenizer), ds.Retriever()
    prompts = [(ex.question, ds.retrieve(ex, retriever, count, args.chunk_tokens, args.top_k)) for ex in examples]
    try:
        rows = run(engine, prompts, args.modes.split(","), args.rounds)
    finally:
        engine.close()
    summary = summarize(rows)
    print(report(summary))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "summary": summary, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
