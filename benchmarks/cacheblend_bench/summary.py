"""Aggregate finished cases into one row per (dataset, top_k, method) and write JSON/CSV."""

from __future__ import annotations

import csv
import json
import os
import platform
import statistics
from collections import defaultdict
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from cacheblend_bench.stats import bootstrap_mean_ci, sign_test, speedup
from cacheblend_rag.metrics import normalize_answer

FIELDS = [
    "dataset",
    "top_k",
    "method",
    "n",
    "metric",
    "quality",
    "ttft_mean_s",
    "ttft_median_s",
    "latency_mean_s",
    "decode_ms_per_token",
    "throughput_qps",
    "speedup_vs_full_recompute",
    "speedup_vs_full_recompute_saved",
    "speedup_vs_prefix_caching",
    "speedup_vs_full_recompute_ci",
    "speedup_vs_full_recompute_saved_ci",
    "speedup_vs_prefix_caching_ci",
    "speedup_vs_full_recompute_rounds",
    "overhead",
    "n_paired_full",
    "quality_diff_vs_full",
    "quality_diff_ci",
    "quality_wins",
    "quality_losses",
    "quality_sign_p",
    "full_quality_paired",
    "kl_mean",
    "agreement",
    "recompute_fraction",
    "compute_fraction",
    "prompt_tokens_mean",
    "support_recall",
]


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _pairs(rows: list[dict], ref: list[dict]) -> list[tuple[dict, dict]]:
    """(ref row, row) for each question both finished (e.g. a chain run with --chain-n)."""
    by_q = {r["qid"]: r for r in ref}
    return [(by_q[r["qid"]], r) for r in rows if r["qid"] in by_q]


def _speedup(rows: list[dict], ref: list[dict]) -> tuple[float | None, tuple[float, float] | None]:
    """``stats.speedup`` of ``rows`` over ``ref`` on the questions both finished: the ratio of mean
    TTFTs and its bootstrap 95% interval (None without a pair; no interval with one)."""
    pairs = _pairs(rows, ref)
    if not pairs or sum(p[1]["ttft_s"] for p in pairs) <= 0:
        return None, None
    value, ci = speedup([p[0]["ttft_s"] for p in pairs], [p[1]["ttft_s"] for p in pairs])
    return value, ci if len(pairs) > 1 else None


def _speedup_rounds(rows: list[dict], ref: list[dict]) -> list[float] | None:
    """The speed-up of each timing round alone (``--repeats``): the spread over repeats."""
    pairs = [
        (f["ttft_rounds_s"], r["ttft_rounds_s"]) for f, r in _pairs(rows, ref) if "ttft_rounds_s" in f and "ttft_rounds_s" in r
    ]
    if not pairs:
        return None
    rounds = min(min(len(a), len(b)) for a, b in pairs)
    return [sum(a[i] for a, _ in pairs) / sum(b[i] for _, b in pairs) for i in range(rounds)]


def decode_ms_per_token(row: dict) -> float | None:
    """One answer's decoding time per token after the first: (latency - TTFT) / (tokens - 1)."""
    n = row.get("generated_tokens")
    return (row["total_s"] - row["ttft_s"]) / (n - 1) * 1e3 if n and n > 1 else None


def _overhead(rows: list[dict], saved: list[dict]) -> float | None:
    """TTFT over (its token-layers computed / the saved full prefill's x that prefill's TTFT), summed
    over the paired questions: 1.0 would mean a fused prefill costs exactly its share of a full
    prefill."""
    pairs = [(f, r) for f, r in _pairs(rows, saved) if r.get("compute_fraction") is not None]
    den = sum(r["compute_fraction"] / (f.get("compute_fraction") or 1.0) * f["ttft_s"] for f, r in pairs)
    return sum(r["ttft_s"] for _, r in pairs) / den if pairs and den > 0 else None


def _quality_vs_full(paired: list[tuple[dict, dict]]) -> dict[str, Any]:
    """Quality minus full prefill's on the same questions: mean, bootstrap 95% interval, and the
    sign test over questions (a difference whose interval holds 0 is a tie)."""
    diffs = [r["quality"] - f["quality"] for f, r in paired]
    wins, losses = sum(d > 1e-12 for d in diffs), sum(d < -1e-12 for d in diffs)
    return {
        "quality_diff_vs_full": _mean(diffs),
        "quality_diff_ci": bootstrap_mean_ci(diffs) if len(diffs) > 1 else None,
        "quality_wins": wins,
        "quality_losses": losses,
        "quality_sign_p": sign_test(wins, losses),
    }


def summarize(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["dataset"], r["top_k"], r["method"])].append(r)
    out = []
    for (dataset, k, method), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], _order(kv[0][2]))):
        full = groups.get((dataset, k, "full_recompute"), [])
        saved = groups.get((dataset, k, "full_recompute_saved"), [])  # full prefill, last-layer saving
        prefix = groups.get((dataset, k, "prefix_caching"), [])
        # Answers and quality compare with either exact full prefill (the same up to rounding).
        exact = full or saved
        full_answers = {r["qid"]: normalize_answer(r["answer"]) for r in exact}
        agree = [normalize_answer(r["answer"]) == full_answers[r["qid"]] for r in rs if r["qid"] in full_answers]
        total = sum(r["total_s"] for r in rs)
        is_kv = "kl" in rs[0] or rs[0].get("recompute_fraction") is not None
        paired = _pairs(rs, exact)
        ratios: dict[str, Any] = {}
        for name, ref in (("full_recompute", full), ("full_recompute_saved", saved), ("prefix_caching", prefix)):
            ratios[f"speedup_vs_{name}"], ratios[f"speedup_vs_{name}_ci"] = _speedup(rs, ref)
        out.append(
            {
                "dataset": dataset,
                "top_k": k,
                "method": method,
                "n": len(rs),
                "metric": rs[0]["metric"],
                "quality": _mean([r["quality"] for r in rs]),
                "ttft_mean_s": _mean([r["ttft_s"] for r in rs]),
                "ttft_median_s": statistics.median(r["ttft_s"] for r in rs),
                "latency_mean_s": _mean([r["total_s"] for r in rs]),
                "decode_ms_per_token": _mean([decode_ms_per_token(r) for r in rs]),
                "throughput_qps": len(rs) / total if total > 0 else None,
                **ratios,
                "speedup_vs_full_recompute_rounds": _speedup_rounds(rs, full),
                "overhead": _overhead(rs, saved),
                **_quality_vs_full(paired),
                # The questions the full-prefill ratio is over, and full prefill's quality on them.
                "n_paired_full": len(paired),
                "full_quality_paired": _mean([f["quality"] for f, _ in paired]),
                "kl_mean": _mean([r.get("kl") for r in rs]),
                "agreement": (sum(agree) / len(agree)) if agree and is_kv else None,
                "recompute_fraction": _mean([r.get("recompute_fraction") for r in rs]),
                "compute_fraction": _mean([r.get("compute_fraction") for r in rs]),
                "prompt_tokens_mean": _mean([r.get("prompt_tokens") for r in rs]),
                "support_recall": _mean([r.get("support_recall") for r in rs]),
            }
        )
    return out


def pooled(rows: list[dict], dataset: str = "all") -> list[dict]:
    """The rows of every dataset as one (question ids made unique), for summaries over all questions."""
    return [dict(r, dataset=dataset, qid=f"{r['dataset']}/{r['qid']}") for r in rows]


def speedup_over(rows: list[dict], method: str, reference: str) -> tuple[float | None, tuple[float, float] | None]:
    """``method``'s TTFT speed-up over any other method of the same rows (e.g. ``generate`` or a
    llama.cpp quantisation), on the questions both finished; pass :func:`pooled` rows for all datasets."""
    return _speedup([r for r in rows if r["method"] == method], [r for r in rows if r["method"] == reference])


def _order(method: str) -> tuple:
    """Table order: full prefills, the reuse baselines, fused modes by ratio, llama.cpp, chains."""
    base = ["full_recompute", "full_recompute_saved", "generate", "prefix_caching", "full_reuse"]
    if method in base:
        return (base.index(method), 0.0, method)
    head, _, rest = method.partition("@")
    if rest:
        try:
            return (len(base), float(rest.split(":")[0].split("/")[0]), method)
        except ValueError:
            pass
    if method.startswith("llama_cpp"):
        return (len(base) + 1, 0.0, method)
    return (len(base) + 2, 0.0, method)


def machine() -> dict[str, Any]:
    import torch

    from cacheblend_bench.provenance import engine_stamp

    return {
        "engine": engine_stamp(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def write_summary(summary: list[dict], out: Path, cfg: Any = None) -> None:
    meta = {"config": asdict(cfg) if is_dataclass(cfg) else cfg, "machine": machine()}
    (out / "summary.json").write_text(json.dumps({**meta, "summary": summary}, indent=1), encoding="utf-8")
    with (out / "summary.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for row in summary:
            w.writerow({k: row.get(k) for k in FIELDS})


def markdown_table(summary: list[dict], dataset: str, top_k: int | None = None) -> str:
    """A table for docs: quality, TTFT speedups (against the plain and the saved full prefill and
    prefix caching; "–" where that baseline did not run) with their bootstrap 95% intervals over
    questions in brackets, fidelity, and the quality difference to full prefill on the same
    questions with its interval and the questions won/lost.

    A method that ran on fewer questions than full prefill (``--chain-n``) shows them as "n/N"
    and full prefill's quality on those questions in brackets; its TTFT ratios are over them too.
    """
    lines = [
        "| method | n | quality | TTFT vs full | TTFT vs saved full | TTFT vs prefix | latency (s) | answers/s | KL | agree "
        "| quality − full [95% CI] (won/lost) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x, fmt):
        return "–" if x is None else format(x, fmt)

    def ratio(r, name):
        x, ci = r.get(f"speedup_vs_{name}"), r.get(f"speedup_vs_{name}_ci")
        if x is None:
            return "–"
        return f"{x:.2f}x" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")

    def diff(r):
        d, ci = r.get("quality_diff_vs_full"), r.get("quality_diff_ci")
        if d is None or r["method"] == "full_recompute":
            return "–"
        return f"{d:+.3f}" + (f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "") + f" ({r['quality_wins']}/{r['quality_losses']})"

    full_n = {(r["dataset"], r["top_k"]): r["n"] for r in summary if r["method"] == "full_recompute"}
    for r in summary:
        if r["dataset"] != dataset or (top_k is not None and r["top_k"] != top_k):
            continue
        n, quality = str(r["n"]), f"{r['metric']} {f(r['quality'], '.3f')}"
        of = full_n.get((r["dataset"], r["top_k"]))
        if of is not None and r.get("n_paired_full", of) < of:
            n = f"{r['n']}/{of}"
            quality += f" (full {f(r.get('full_quality_paired'), '.3f')})"
        lines.append(
            f"| {r['method']} | {n} | {quality} | {ratio(r, 'full_recompute')} | {ratio(r, 'full_recompute_saved')} | "
            f"{ratio(r, 'prefix_caching')} | "
            f"{f(r['latency_mean_s'], '.2f')} | {f(r['throughput_qps'], '.2f')} | {f(r['kl_mean'], '.3f')} | "
            f"{f(r['agreement'], '.2f')} | {diff(r)} |"
        )
    return "\n".join(lines)
