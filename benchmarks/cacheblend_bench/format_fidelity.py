"""What a weight format costs in answers: two ``fidelity`` runs on the same questions compared.

``cacheblend-rag fidelity --weights fp16`` answers each question with full prefill in that format
(the reference of its rows) and with every method; a float32 run of the same command is the
baseline. Per question both ran:

* **full prefill, format against float32**: the same answer (normalised text), agreement F1, and
  F1 against the gold answers (paired difference with a bootstrap interval and a sign test);
* **each method against its own format's full prefill**: the share of questions where it gives
  its full prefill's answer in each format, the paired difference in agreement F1, and the mean
  next-token KL to full prefill in each format.

``cacheblend-rag fidelity --kv-format int8`` is compared with a ``--kv-format float`` run the same
way: full prefill reads no chunk cache, so only the methods differ.

    python -m cacheblend_bench.format_fidelity FORMAT_ROWS FLOAT32_ROWS [FLOAT32_ROWS ...] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cacheblend_bench.fidelity import agreement_f1
from cacheblend_bench.runner import read_results
from cacheblend_bench.stats import bootstrap_mean_ci, ratio_ci, sign_test
from cacheblend_rag.metrics import normalize_answer


def _by_question(rows: list[dict]) -> dict[tuple[str, str, str], dict]:
    return {(r["dataset"], r["qid"], r["method"]): r for r in rows}


def _paired(diffs: list[float]) -> dict[str, Any]:
    wins, losses = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    return {
        "mean": sum(diffs) / len(diffs) if diffs else float("nan"),
        "ci": list(bootstrap_mean_ci(diffs)),
        "better": wins,
        "worse": losses,
        "tie": len(diffs) - wins - losses,
        "p": sign_test(wins, losses),
    }


def compare_formats(fmt_rows: list[dict], ref_rows: list[dict]) -> dict[str, Any]:
    """The comparison of a format's rows with float32's (see the module docstring)."""
    fmt, ref = _by_question(fmt_rows), _by_question(ref_rows)
    shared = sorted(k for k in fmt.keys() & ref.keys())
    questions = sorted({(d, q) for d, q, _ in shared})
    # Full prefill is each row's reference: one per question (any method's row carries it).
    full_fmt = {(d, q): fmt[(d, q, m)] for d, q, m in shared}
    full_ref = {(d, q): ref[(d, q, m)] for d, q, m in shared}
    same = [normalize_answer(full_fmt[k]["answer_full"]) == normalize_answer(full_ref[k]["answer_full"]) for k in questions]
    out: dict[str, Any] = {
        "weights": sorted({r.get("weights", "fp32") for r in fmt_rows}),
        "reference_weights": sorted({r.get("weights", "fp32") for r in ref_rows}),
        "kv_format": sorted({r.get("kv_format", "float") for r in fmt_rows}),
        "reference_kv_format": sorted({r.get("kv_format", "float") for r in ref_rows}),
        "questions": len(questions),
        "full_same_answer": sum(same) / len(same) if same else float("nan"),
        "full_agree_f1": sum(agreement_f1(full_fmt[k]["answer_full"], full_ref[k]["answer_full"]) for k in questions)
        / max(1, len(questions)),
        "full_f1_fmt": sum(full_fmt[k]["f1_full"] for k in questions) / max(1, len(questions)),
        "full_f1_ref": sum(full_ref[k]["f1_full"] for k in questions) / max(1, len(questions)),
        "full_f1_diff": _paired([full_fmt[k]["f1_full"] - full_ref[k]["f1_full"] for k in questions]),
        "methods": {},
    }
    for method in dict.fromkeys(m for _, _, m in shared):
        keys = [(d, q, m) for d, q, m in shared if m == method]
        out["methods"][method] = {
            "questions": len(keys),
            "agree_fmt": sum(fmt[k]["agree"] for k in keys) / len(keys),
            "agree_ref": sum(ref[k]["agree"] for k in keys) / len(keys),
            "agree_f1_diff": _paired([fmt[k]["agree_f1"] - ref[k]["agree_f1"] for k in keys]),
            **_kl(fmt, ref, keys),
        }
    return out


def _kl(fmt: dict, ref: dict, keys: list) -> dict[str, Any]:
    """Mean next-token KL to full prefill in each run, over the questions both rows measured, and
    their ratio (format over reference) with its paired bootstrap interval."""
    pairs = [(fmt[k].get("kl"), ref[k].get("kl")) for k in keys]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    if not pairs:
        return {"kl_fmt": float("nan"), "kl_ref": float("nan"), "kl_ratio": float("nan"), "kl_ratio_ci": [float("nan")] * 2}
    a, b = [a for a, _ in pairs], [b for _, b in pairs]
    return {
        "kl_fmt": sum(a) / len(a),
        "kl_ref": sum(b) / len(b),
        "kl_ratio": sum(a) / sum(b) if sum(b) else float("nan"),
        "kl_ratio_ci": list(ratio_ci(a, b)),
    }


def _label(weights: list[str], kv_format: list[str]) -> str:
    return "/".join(weights) + ("" if kv_format == ["float"] else f" ({'/'.join(kv_format)} chunk caches)")


def markdown(c: dict[str, Any]) -> str:
    def paired(p: dict[str, Any]) -> str:
        lo, hi = p["ci"]
        return f"{p['mean']:+.3f} [{lo:+.3f}, {hi:+.3f}], {p['better']} / {p['worse']} / {p['tie']}, p={p['p']:.2g}"

    # KL columns where chunk cache formats are compared (a weight format's tables stay as published).
    kv = c.get("kv_format", ["float"]) != ["float"] or c.get("reference_kv_format", ["float"]) != ["float"]
    fmt = _label(c["weights"], c.get("kv_format", ["float"]))
    ref = _label(c["reference_weights"], c.get("reference_kv_format", ["float"]))
    if c["weights"] == c["reference_weights"] and kv:
        # Full prefill reads no chunk cache: only the methods' rows can differ.
        lines = [f"{c['questions']} questions; each method against full prefill ({c['weights'][0]} weights):", ""]
    else:
        lines = [
            f"{c['questions']} questions; full prefill in {fmt} against {ref}:",
            "",
            "| same answer | agreement F1 | F1 vs gold | F1 difference (better / worse / tie, sign test) |",
            "|---|---|---|---|",
            f"| {c['full_same_answer']:.0%} | {c['full_agree_f1']:.3f} | {c['full_f1_fmt']:.3f} vs {c['full_f1_ref']:.3f} "
            f"| {paired(c['full_f1_diff'])} |",
            "",
            "Each method against its own format's full prefill:",
            "",
        ]
    lines += [
        f"| method | same answer, {fmt} | same answer, {ref} | agreement F1 difference (better / worse / tie, sign test) |"
        + (f" next-token KL, {fmt} | next-token KL, {ref} | KL ratio |" if kv else ""),
        "|---|---|---|---|" + ("---|---|---|" if kv else ""),
    ]
    for method, m in c["methods"].items():
        lo, hi = m.get("kl_ratio_ci", [float("nan")] * 2)
        kl = (
            f" {m.get('kl_fmt', float('nan')):.4f} | {m.get('kl_ref', float('nan')):.4f} | "
            f"{m.get('kl_ratio', float('nan')):.3f} [{lo:.3f}, {hi:.3f}] |"
            if kv
            else ""
        )
        lines.append(f"| {method} | {m['agree_fmt']:.0%} | {m['agree_ref']:.0%} | {paired(m['agree_f1_diff'])} |" + kl)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compare a weight format's fidelity rows with float32's on the same questions.")
    parser.add_argument("rows", help="the format's results.jsonl (cacheblend-rag fidelity --weights FORMAT)")
    parser.add_argument(
        "reference",
        nargs="+",
        help="float32's results.jsonl over the same questions and methods (several files: their rows together)",
    )
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    args = parser.parse_args(argv)
    fmt_rows = read_results(Path(args.rows))
    ref_rows = [r for path in args.reference for r in read_results(Path(path))]
    comparison = compare_formats(fmt_rows, ref_rows)
    if not comparison["questions"]:
        print("error: the two files share no question and method: run the same command in both formats", file=sys.stderr)
        return 2
    print(json.dumps(comparison, indent=1) if args.json else markdown(comparison))
    return 0


if __name__ == "__main__":
    sys.exit(main())
