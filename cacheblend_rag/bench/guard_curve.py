"""``python -m cacheblend_rag.bench.guard_curve ROWS``: the fidelity guard's trade, from ``fidelity`` rows.

The guard (``BlendConfig.guard_margin``) answers a question from a full prefill when the blended
prefill's own first-token margin is below a threshold. Every ``fidelity`` row records that margin
(``margin``), so the guard needs no run of its own: per threshold and method, a question whose
margin is below it is *escalated* and gets the saved full prefill's answer (the
``full_recompute_saved`` row of the same question, which the run must include) at the cost of both
prefills (the method's TTFT plus the saved full prefill's, measured on that question); every other
question keeps the method's own answer and TTFT. Reported per threshold: the share escalated,
agreement with full prefill (exact answer and token F1), mean and p95 TTFT, and the mean TTFT's
speed-up over the saved full prefill.

    cacheblend-rag fidelity --methods question@0.15/nb,full_recompute_saved --out OUT ...
    python -m cacheblend_rag.bench.guard_curve OUT/results.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ESCALATION = "full_recompute_saved"
# 0: the guard never fires (the method alone); log 2: the first token less than twice as likely as
# the second; inf: every question escalated (the saved full prefill plus the wasted blended prefill).
DEFAULT_THRESHOLDS = (0.0, 0.1, 0.25, 0.5, math.log(2), 1.0, 1.5, 2.0, 3.0, math.inf)


def curve(
    rows: Sequence[dict],
    method: str,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    *,
    escalation: str = ESCALATION,
    dataset: str = "all",
) -> list[dict]:
    """One entry per threshold for ``method``'s rows (of ``dataset``, or "all"), over the questions
    that have both a ``method`` row with a ``margin`` and an ``escalation`` row."""
    by_q: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if dataset in ("all", r["dataset"]) and r["method"] in (method, escalation):
            by_q.setdefault((r.get("model"), r["dataset"], r["qid"]), {})[r["method"]] = r
    pairs = [
        (ms[method], ms[escalation]) for ms in by_q.values() if ms.get(method, {}).get("margin") is not None and escalation in ms
    ]
    if not pairs:
        raise ValueError(
            f"no question has both a {method!r} row with its margin and a {escalation!r} row: run `cacheblend-rag "
            f"fidelity --methods {method},{escalation}` (rows from before margins were recorded have none)"
        )
    saved_mean = float(np.mean([e["ttft_s"] for _, e in pairs]))
    out = []
    for t in thresholds:
        up = [m["margin"] < t for m, _ in pairs]
        served = [e if esc else m for esc, (m, e) in zip(up, pairs)]
        ttft = [m["ttft_s"] + (e["ttft_s"] if esc else 0.0) for esc, (m, e) in zip(up, pairs)]
        mean = float(np.mean(ttft))
        out.append(
            {
                "method": method,
                "dataset": dataset,
                "threshold": t,
                "n": len(pairs),
                "escalated": sum(up) / len(pairs),
                "agree": sum(bool(r["agree"]) for r in served) / len(pairs),
                "agree_f1": float(np.mean([r["agree_f1"] for r in served])),
                "ttft_mean_s": mean,
                "ttft_p95_s": float(np.percentile(ttft, 95)),
                "speedup_vs_saved": saved_mean / mean if mean > 0 else math.nan,
            }
        )
    return out


def table(entries: Sequence[dict]) -> str:
    """The curve as a markdown table, one row per threshold."""
    lines = [
        "| method | threshold | escalated | answer = full prefill's | agreement F1 | mean TTFT | p95 TTFT | vs saved full prefill |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        lines.append(
            f"| `{e['method']}` | {e['threshold']:.3g} | {e['escalated']:.0%} | {e['agree']:.0%} | {e['agree_f1']:.3f} "
            f"| {1000 * e['ttft_mean_s']:.0f} ms | {1000 * e['ttft_p95_s']:.0f} ms | {e['speedup_vs_saved']:.2f}x |"
        )
    return "\n".join(lines)


def read_rows(path: str | Path) -> list[dict]:
    """``results.jsonl``'s rows (a line cut short by a killed run is skipped)."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(t) for t in text.split(",") if t.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cacheblend_rag.bench.guard_curve", description=__doc__.split("\n\n")[0])
    p.add_argument("rows", help="a fidelity run's results.jsonl")
    p.add_argument("--methods", default=None, help="comma list of methods (default: every method whose rows hold a margin)")
    p.add_argument("--thresholds", type=_floats, default=DEFAULT_THRESHOLDS, help="comma list of margins (inf: always)")
    p.add_argument("--escalation", default=ESCALATION, help=f"the method escalated questions get (default {ESCALATION})")
    p.add_argument("--datasets", default="all", help="comma list: all, or dataset names (default all)")
    p.add_argument("--json", action="store_true", help="print the entries as JSON instead of tables")
    args = p.parse_args(argv)
    rows = read_rows(args.rows)
    methods = (
        [m.strip() for m in args.methods.split(",") if m.strip()]
        if args.methods
        else [m for m in dict.fromkeys(r["method"] for r in rows if r.get("margin") is not None) if m != args.escalation]
    )
    if not methods:
        p.exit(2, f"error: no row of {args.rows} holds a method's margin: rerun `cacheblend-rag fidelity` on this version\n")
    try:
        entries = [
            curve(rows, m, args.thresholds, escalation=args.escalation, dataset=d.strip())
            for d in args.datasets.split(",")
            for m in methods
        ]
    except ValueError as exc:
        p.exit(2, f"error: {exc}\n")
    if args.json:
        print(json.dumps([e for es in entries for e in es], indent=1))
    else:
        print("\n\n".join(f"{es[0]['dataset']}:\n\n{table(es)}" for es in entries if es))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
