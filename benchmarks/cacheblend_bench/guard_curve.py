"""``python -m cacheblend_bench.guard_curve ROWS``: the fidelity guard's trade, from ``fidelity`` rows.

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
    python -m cacheblend_bench.guard_curve OUT/results.jsonl

Adaptive recompute (``BlendConfig.escalation``) is the same trade with intermediate steps, and
``--cascade`` computes it the same way: with rows of the method at each step's fixed ratio (a
step's answer is exactly that fixed-ratio answer, tests/test_escalation.py), a question walks the
steps while the latest row's margin is below the next step's, and is charged every row it passed
through. Each step is charged its whole fixed-ratio TTFT, though the engine reuses the first
pass's loads and question scores: the mean TTFT is an upper bound. ``--search`` lists the cascades
on the agreement/speed frontier (``frontier``).

    cacheblend-rag fidelity --methods question@0.15/nb,question@0.3/nb,question@0.6/nb,full_recompute_saved ...
    python -m cacheblend_bench.guard_curve OUT/results.jsonl --cascade question@{}/nb --search

Many answers leave full prefill's while decoding, after a first token that agreed. ``--decode``
checks every answer position instead (:func:`decode_cascade`): rows record each method's margin
and greedy choice along full prefill's answer, teacher-forced, so a cascade that moves on at the
first low-margin step, prompt and answer so far prefilled again at the next step, is computed from
the same rows. Its cost is reported twice: the first token's, and all the prefills an answer runs.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from itertools import combinations, product
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
    questions = by_question(rows, [method, escalation], dataset)
    return [dict(cascade(questions, [method, escalation], (t,)), method=method, threshold=t, dataset=dataset) for t in thresholds]


def by_question(rows: Sequence[dict], methods: Sequence[str], dataset: str = "all") -> list[dict[str, dict]]:
    """Per question (of ``dataset``, or "all") that has a row of every method and margins on all but
    the last: ``{method: row}``."""
    by_q: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if dataset in ("all", r["dataset"]) and r["method"] in methods:
            by_q.setdefault((r.get("model"), r["dataset"], r["qid"]), {})[r["method"]] = r
    out = [
        ms for ms in by_q.values() if all(m in ms for m in methods) and all(ms[m].get("margin") is not None for m in methods[:-1])
    ]
    if not out:
        listed = ",".join(methods)
        raise ValueError(
            f"no question has rows of every method of {listed} with their margins: run `cacheblend-rag "
            f"fidelity --methods {listed}` (rows from before margins were recorded have none)"
        )
    return out


def cascade(questions: Sequence[dict[str, dict]], methods: Sequence[str], margins: Sequence[float]) -> dict:
    """The trade of the cascade ``methods[0] -> methods[1] -> ...``, where a question moves on from
    ``methods[i]`` when that row's margin is below ``margins[i]`` (one margin per step after the
    first), over ``questions`` (from ``_questions``); each question is charged the TTFT of every
    row it passed through. ``escalation_s`` holds the share of questions that reached each step."""
    if len(margins) != len(methods) - 1:
        raise ValueError(f"a cascade of {len(methods)} methods takes {len(methods) - 1} margins, got {len(margins)}")
    served, ttft, reached = [], [], [0] * len(margins)
    for ms in questions:
        row, spent = ms[methods[0]], ms[methods[0]]["ttft_s"]
        for i, (below, nxt) in enumerate(zip(margins, methods[1:])):
            if not row["margin"] < below:
                break
            reached[i] += 1
            row = ms[nxt]
            spent += row["ttft_s"]
        served.append(row)
        ttft.append(spent)
    n = len(questions)
    saved = [ms[ESCALATION]["ttft_s"] for ms in questions if ESCALATION in ms]
    mean = float(np.mean(ttft))
    return {
        "methods": list(methods),
        "margins": list(margins),
        "dataset": "all" if len({ms[methods[0]]["dataset"] for ms in questions}) > 1 else questions[0][methods[0]]["dataset"],
        "n": n,
        "escalated": reached[0] / n if reached else 0.0,
        "reached": [k / n for k in reached],
        "agree": sum(bool(r["agree"]) for r in served) / n,
        "agrees": [bool(r["agree"]) for r in served],  # per question, in ``questions``' order
        "agree_f1": float(np.mean([r["agree_f1"] for r in served])),
        "f1": float(np.mean([r["f1"] for r in served])) if all("f1" in r for r in served) else math.nan,
        "ttft_mean_s": mean,
        "ttft_p95_s": float(np.percentile(ttft, 95)),
        "speedup_vs_saved": float(np.mean(saved)) / mean if saved and mean > 0 else math.nan,
    }


def decode_cascade(questions: Sequence[dict[str, dict]], methods: Sequence[str], margins: Sequence[float]) -> dict:
    """:func:`cascade` with its check at every answer position, not only the first: while the
    method in use has a margin below the next step's at the next position (``tf_margins``, along
    full prefill's answer), the answer moves on to the next step's cache there, prompt and answer
    so far prefilled again (charged that step's whole TTFT: to the first token at position 0, to
    the answer's later prefills after it). The answer is full prefill's unless the method in use at
    some position chooses another token there (``tf_leaves``): from a prefix that matches, each
    step's cache is exactly what its teacher-forced row saw."""
    if len(margins) != len(methods) - 1:
        raise ValueError(f"a cascade of {len(methods)} methods takes {len(methods) - 1} margins, got {len(margins)}")
    missing = [m for m in methods if any("tf_leaves" not in ms[m] for ms in questions)]
    if missing:
        raise ValueError(
            f"rows of {missing[0]} without tf_leaves: rerun `cacheblend-rag fidelity` on this version (older rows "
            "record no per-position margins)"
        )
    agrees, ttft, later, reached, moved_later = [], [], [], [0] * len(margins), 0
    for ms in questions:
        step, row = 0, ms[methods[0]]
        first, after = row["ttft_s"], 0.0
        positions = row["answer_tokens_full"] + (row["answer_tokens_full"] < row["max_new_tokens"])
        agree = True
        for i in range(positions):
            while step < len(margins) and row["tf_margins"][i] < margins[step]:
                reached[step] += 1
                step += 1
                row = ms[methods[step]]
                if i == 0:
                    first += row["ttft_s"]
                else:
                    after += row["ttft_s"]
            if i in row["tf_leaves"]:
                agree = False
                break
        agrees.append(agree)
        ttft.append(first)
        later.append(after)
        moved_later += after > 0
    n = len(questions)
    saved = (
        float(np.mean([ms[ESCALATION]["ttft_s"] for ms in questions])) if all(ESCALATION in ms for ms in questions) else math.nan
    )
    mean, spent = float(np.mean(ttft)), float(np.mean(np.add(ttft, later)))
    return {
        "methods": list(methods),
        "margins": list(margins),
        "dataset": "all" if len({ms[methods[0]]["dataset"] for ms in questions}) > 1 else questions[0][methods[0]]["dataset"],
        "n": n,
        "reached": [k / n for k in reached],
        "moved_later": moved_later / n,  # share of answers that moved on after their first token
        "agree": sum(agrees) / n,
        "agrees": agrees,
        "ttft_mean_s": mean,
        "prefill_mean_s": spent,  # every prefill an answer ran, the later ones included
        "speedup_vs_saved": saved / mean if mean > 0 else math.nan,
        "prefill_speedup_vs_saved": saved / spent if spent > 0 else math.nan,
    }


def escalation_cascade(first: str, steps: Sequence[tuple[float, float]]) -> tuple[list[str], list[float]]:
    """``BlendConfig.escalation`` steps after the method ``first`` (``question@0.15/nb``) as a
    cascade over fixed-ratio methods: ``(["question@0.15/nb", "question@0.3/nb", ...], margins)``,
    a 1.0 step being ``full_recompute_saved``."""
    head, sep, options = first.partition("/")
    strategy = head.split("@")[0]
    methods = [first] + [ESCALATION if ratio >= 1.0 else f"{strategy}@{ratio:g}{sep}{options}" for _, ratio in steps]
    return methods, [margin for margin, _ in steps]


# Margins tried for each step by frontier(): none (the step never runs) to always.
SEARCH_MARGINS = (0.0, 0.1, 0.2, 0.3, 0.5, math.log(2), 1.0, 1.5, 2.0, math.inf)


def frontier(
    questions: Sequence[dict[str, dict]],
    methods: Sequence[str],
    grid: Sequence[float] = SEARCH_MARGINS,
    *,
    max_steps: int = 3,
    decode: bool = False,
) -> list[dict]:
    """Every cascade through ``methods`` in their order (any first pass, up to ``max_steps`` steps
    after it) with margins from ``grid``, kept where no other is both as fast and agrees more: the
    frontier, fastest first. ``decode``: cascades that check every answer position
    (:func:`decode_cascade`), ranked by all the prefills an answer runs rather than its first token's."""
    walk, speed = (decode_cascade, "prefill_speedup_vs_saved") if decode else (cascade, "speedup_vs_saved")
    chains = [list(c) for k in range(1, min(len(methods), max_steps + 1) + 1) for c in combinations(methods, k)]
    entries = [walk(questions, chain, ms) for chain in chains for ms in product(grid, repeat=len(chain) - 1)]
    entries.sort(key=lambda e: (-e[speed], -e["agree"]))
    out: list[dict] = []
    for e in entries:
        if not out or e["agree"] > out[-1]["agree"]:
            out.append(e)
    return out


def best_within(entries: Sequence[dict], min_speedup: float) -> dict | None:
    """The entry that agrees most among those at least ``min_speedup`` times the saved full prefill."""
    fast = [e for e in entries if e["speedup_vs_saved"] >= min_speedup]
    return max(fast, key=lambda e: (e["agree"], e["speedup_vs_saved"])) if fast else None


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


def with_reference_rows(rows: Sequence[dict]) -> list[dict]:
    """``rows`` plus, for each question without an ``ESCALATION`` row, one made from the reference
    every row carries (fidelity's full prefill: its TTFT and margins; it agrees with itself), so a
    run that left the saved full prefill out still prices a cascade's last step. That reference is
    an unsaved full prefill, timed once per question (in the rows that have both, about the saved
    one's time)."""
    have = {(r.get("model"), r["dataset"], r["qid"]) for r in rows if r["method"] == ESCALATION}
    made: dict[tuple, dict] = {}
    for r in rows:
        key = (r.get("model"), r["dataset"], r["qid"])
        if key in have or key in made or r.get("ttft_full_s") is None:
            continue
        made[key] = dict(
            r,
            method=ESCALATION,
            ttft_s=r["ttft_full_s"],
            margin=r.get("margin_full"),
            tf_margins=r.get("tf_margins_full"),
            tf_leaves=[],
            agree=True,
            agree_f1=1.0,
            answer=r.get("answer_full"),
            **({"f1": r["f1_full"]} if "f1_full" in r else {}),
        )
    return [*rows, *made.values()]


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(t) for t in text.split(",") if t.strip())


def decode_table(entries: Sequence[dict]) -> str:
    """Cascades that check every answer position (:func:`decode_cascade`), one row each."""
    lines = [
        "| cascade | margins | moved on at each step | after the first token | answer = full prefill's | mean TTFT "
        "| vs saved full prefill | all prefills | vs saved full prefill |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        lines.append(
            f"{_steps(e)} {e['moved_later']:.0%} | {e['agree']:.0%} | {1000 * e['ttft_mean_s']:.0f} ms "
            f"| {e['speedup_vs_saved']:.2f}x | {1000 * e['prefill_mean_s']:.0f} ms | {e['prefill_speedup_vs_saved']:.2f}x |"
        )
    return "\n".join(lines)


def _steps(e: dict) -> str:
    """A cascade's first cells: its methods, margins and the share that reached each step."""
    steps = " -> ".join(f"`{m}`" for m in e["methods"])
    margins = ", ".join(f"{m:.3g}" for m in e["margins"])
    reached = ", ".join(f"{r:.0%}" for r in e["reached"])
    return f"| {steps} | {margins} | {reached} |"


def cascade_table(entries: Sequence[dict]) -> str:
    """Cascades as a markdown table, one row each."""
    lines = [
        "| cascade | margins | moved on at each step | answer = full prefill's | agreement F1 | F1 vs gold | mean TTFT | vs saved full prefill |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        lines.append(
            f"{_steps(e)} {e['agree']:.0%} | {e['agree_f1']:.3f} | {e['f1']:.3f} "
            f"| {1000 * e['ttft_mean_s']:.0f} ms | {e['speedup_vs_saved']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cacheblend_bench.guard_curve", description=__doc__.split("\n\n")[0])
    p.add_argument("rows", help="a fidelity run's results.jsonl")
    p.add_argument("--methods", default=None, help="comma list of methods (default: every method whose rows hold a margin)")
    p.add_argument("--thresholds", type=_floats, default=DEFAULT_THRESHOLDS, help="comma list of margins (inf: always)")
    p.add_argument("--escalation", default=ESCALATION, help=f"the method escalated questions get (default {ESCALATION})")
    p.add_argument("--datasets", default="all", help="comma list: all, or dataset names (default all)")
    p.add_argument(
        "--cascade",
        default=None,
        help="comma list of methods, first pass to last step (e.g. question@0.15/nb,question@0.3/nb,full_recompute_saved): "
        "with --margins, that cascade's trade; with --search, its frontier",
    )
    p.add_argument("--margins", type=_floats, default=None, help="--cascade's margins, one per step after the first")
    p.add_argument("--search", action="store_true", help="--cascade: print the cascades on the agreement/speed frontier")
    p.add_argument(
        "--decode",
        action="store_true",
        help="--cascade: check every answer position, not only the first (rows with tf_margins and tf_leaves)",
    )
    p.add_argument("--plot", default=None, help="--search: also draw the frontier and each fixed-ratio method to this PNG")
    p.add_argument("--json", action="store_true", help="print the entries as JSON instead of tables")
    p.add_argument(
        "--full-from-reference",
        action="store_true",
        help=f"questions without a {ESCALATION} row get one from the rows' reference full prefill (its TTFT and margins)",
    )
    args = p.parse_args(argv)
    rows = read_rows(args.rows)
    if args.full_from_reference:
        rows = with_reference_rows(rows)
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    if args.cascade:
        chain = [m.strip() for m in args.cascade.split(",") if m.strip()]
        if (args.margins is None) == (not args.search):
            p.exit(2, "error: --cascade takes --margins (one cascade) or --search (its frontier)\n")
        try:
            questions = {d: by_question(rows, chain, d) for d in datasets}
        except ValueError as exc:
            p.exit(2, f"error: {exc}\n")
        walk = decode_cascade if args.decode else cascade
        groups = [
            frontier(qs, chain, decode=args.decode) if args.search else [walk(qs, chain, args.margins)]
            for qs in questions.values()
        ]
        if args.plot and args.decode:
            p.exit(2, "error: --plot draws first-token cascades only: drop --decode or --plot\n")
        if args.plot and args.search:
            from cacheblend_bench.plots import escalation_plot

            fixed = {d: [cascade(qs, [m], ()) for m in chain] for d, qs in questions.items()}
            escalation_plot({d: (fixed[d], front) for d, front in zip(datasets, groups)}, Path(args.plot))
        if args.json:
            print(json.dumps([e for es in groups for e in es], indent=1))
        else:
            render = decode_table if args.decode else cascade_table
            print("\n\n".join(f"{es[0]['dataset']}:\n\n{render(es)}" for es in groups if es))
        return 0
    methods = (
        [m.strip() for m in args.methods.split(",") if m.strip()]
        if args.methods
        else [m for m in dict.fromkeys(r["method"] for r in rows if r.get("margin") is not None) if m != args.escalation]
    )
    if not methods:
        p.exit(2, f"error: no row of {args.rows} holds a method's margin: rerun `cacheblend-rag fidelity` on this version\n")
    try:
        entries = [curve(rows, m, args.thresholds, escalation=args.escalation, dataset=d) for d in datasets for m in methods]
    except ValueError as exc:
        p.exit(2, f"error: {exc}\n")
    if args.json:
        print(json.dumps([e for es in entries for e in es], indent=1))
    else:
        print("\n\n".join(f"{es[0]['dataset']}:\n\n{table(es)}" for es in entries if es))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
