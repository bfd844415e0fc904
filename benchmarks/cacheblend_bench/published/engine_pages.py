"""The sweeps behind the fused prefill's defaults, where a prefill's time goes and the schedule
check (docs/engine.md), and the operator timing of one OpenMP team (docs/benchmarks.md)."""

from __future__ import annotations

import statistics
from typing import Any

from cacheblend_bench.breakdown import report as breakdown_report
from cacheblend_bench.breakdown import summarize as breakdown_summarize
from cacheblend_bench.published.fmt import Stat
from cacheblend_bench.published.results import Results, Table, Values
from cacheblend_bench.stats import speedup
from cacheblend_bench.sweep import markdown_table as sweep_table
from cacheblend_bench.sweep import summarize as sweep_summarize
from cacheblend_bench.threads import markdown_table as threads_table
from cacheblend_bench.threads import parse_report


def _sweep(res: Results, file: str) -> dict[str, dict]:
    return res.memo(f"sweep:{file}", lambda: {t["method"]: t for t in sweep_summarize(res.rows(file))})


def _sweep_table(file: str, rows: list[tuple[str, str]], columns: tuple[str, ...], bold: str | None = None):
    return Table((file,), lambda res: sweep_table(list(_sweep(res, file).values()), rows, columns, bold))


QV = "cacheblend[query_value@0.15]"
CRITERIA = [
    ("full_reuse", "full reuse"),
    ("cacheblend[value@0.15,f1,b0]", "value (paper), pick once on layer 1"),
    ("cacheblend[value@0.15,f3,b0]", "value (paper), gradual (3 checks)"),
    ("cacheblend[key@0.15,f1,b0]", "key (LMCache), pick once"),
    ("cacheblend[key@0.15,f3,b0]", "key (LMCache), gradual"),
    ("cacheblend[query_value@0.15,f1,b0]", "query_value, pick once"),
    ("cacheblend[query_value@0.15,f3,b0]", "query_value, gradual (HKVD's default)"),
]
TIMING = [("full_recompute", "full recompute"), ("full_reuse", "full reuse"), (QV, "cacheblend 0.15 (HKVD's defaults)")]
TUNING = [
    ("full_reuse", "full reuse"),
    ("cacheblend[query_value@0.15,f3,b0]", "cacheblend 0.15, 3 checks (HKVD's default)"),
    ("cacheblend[query_value@0.15,f4,b0]", "cacheblend 0.15, 4 checks"),
    ("cacheblend[query_value@0.3,f3,b0]", "cacheblend 0.30, 3 checks"),
    ("cacheblend[query_value@0.3,f4,b0]", "cacheblend 0.30, 4 checks"),
]


def _sweep_values(res: Results) -> dict[str, Any]:
    """Named figures of every sweep file: ``<file stem>.<method key>.<field>``, the method key
    being the criterion, ratio and schedule (``query_value-0.15-f3``) or the baseline's name."""
    v: dict[str, Any] = {}
    files = {
        "criteria512": "fidelity_512_criteria_schedules.jsonl",
        "criteria256": "fidelity_256_criteria.jsonl",
        "layer0": "fidelity_512_layer0_checks.jsonl",
        "timing": "sweep_512_timing.jsonl",
        "v2": "sweep_512_timing_v2.jsonl",
        "v3": "sweep_512_timing_v3.jsonl",
        "qwen": "sweep_512_timing_qwen.jsonl",
        "tuning": "sweep_512_qwen_tuning.jsonl",
    }
    for stem, file in files.items():
        for method, t in _sweep(res, file).items():
            key = method.removeprefix("cacheblend[").rstrip("]").replace("@", "-").replace(",", "-")
            v[f"{stem}.{key}.x"] = Stat(t["ttft_speedup"], t.get("ttft_speedup_ci"))
            v[f"{stem}.{key}.kl"] = t["kl_mean"]
            v[f"{stem}.{key}.overhead"] = t["overhead"] if t["overhead"] else float("nan")
            v[f"{stem}.{key}.work"] = t["compute_fraction"]
            v[f"{stem}.{key}.fresh"] = t["recompute_fraction"]
            v[f"{stem}.{key}.n"] = t["n"]
            if t["closer_than_reuse"] is not None:
                v[f"{stem}.{key}.closer"] = round(t["closer_than_reuse"] * t["n"])
        v[f"{stem}.n"] = _sweep(res, file)["full_recompute"]["n"]
        v[f"{stem}.prompt_k"] = statistics.mean(r["prompt_tokens"] for r in res.rows(file)) / 1e3
    # How much of full reuse's KL the default selection removes, per model (v3: SmolLM2, qwen: Qwen).
    for stem in ("v3", "tuning"):
        default = "query_value-0.15" if stem == "v3" else "query_value-0.15-f3-b0"
        v[f"{stem}.kl_cut"] = v[f"{stem}.{default}.kl"] / v[f"{stem}.full_reuse.kl"] - 1
    return v


# ----------------------------------------------------------------------------- the profiler breakdown
BREAKDOWN = "breakdown_smollm2.json"


def _breakdown(res: Results) -> dict[str, Any]:
    return res.memo("breakdown", lambda: breakdown_summarize(res.json(BREAKDOWN)["rows"]))


def _breakdown_values(res: Results) -> dict[str, Any]:
    s = _breakdown(res)
    rows = res.json(BREAKDOWN)["rows"]
    cb, full = s["cacheblend"], s["full_recompute_saved"]
    return {
        "x": Stat(cb["speedup_vs_saved"], cb["speedup_vs_saved_ci"]),
        "overhead": cb["overhead"],
        "attention": cb["attention_share"],
        "attention_full": full["attention_share"],
        "python": cb["python_share"],
        "python_full": full["python_share"],
        "questions": len({r["question"] for r in rows}),
        "rounds": len({r["round"] for r in rows}),
        "prompt_k": [min(r["prompt_tokens"] for r in rows) / 1e3, max(r["prompt_tokens"] for r in rows) / 1e3],
    }


# ----------------------------------------------------------------------------- the schedule check
SCHEDULES = "schedules_hotpotqa.jsonl"
SCHEDULE_LABELS = {
    "fl3": "**default (1: 0.53, 2: 0.28, 3: 0.15)**",
    "fl2": "2 checks (`filter_layers=2`)",
    "fl1": "pick once (`filter_layers=1`)",
    "s35_20": "(1: 0.35, 2: 0.20, 3: 0.15)",
    "s30_3": "(1: 0.30, 3: 0.15)",
}


def _schedules(res: Results) -> dict[str, dict[str, Any]]:
    rows = res.rows(SCHEDULES)
    out = {}
    for key in SCHEDULE_LABELS:
        x, ci = speedup([r["full_s"] for r in rows], [r[f"{key}_s"] for r in rows])
        out[key] = {
            "kl_mean": statistics.mean(r[key] for r in rows),
            "kl_median": statistics.median(r[key] for r in rows),
            "top1": sum(r[f"{key}_top1"] for r in rows),
            "x": Stat(x, ci),
            "n": len(rows),
        }
    return out


def _schedules_table(res: Results) -> str:
    s = _schedules(res)
    lines = [
        "| schedule | KL mean | KL median | same top-1 token | prefill speed-up vs full (one pass, noisy) |",
        "|---|---|---|---|---|",
    ]
    for key, label in SCHEDULE_LABELS.items():
        e = s[key]
        lines.append(
            f"| {label} | {e['kl_mean']:.3f} | {e['kl_median']:.3f} | {e['top1']}/{e['n']} | "
            f"{e['x'].value:.2f}x [{e['x'].ci[0]:.2f}, {e['x'].ci[1]:.2f}] |"
        )
    return "\n".join(lines)


def _schedules_values(res: Results) -> dict[str, Any]:
    s = _schedules(res)
    rows = res.rows(SCHEDULES)
    cheaper = [k for k in SCHEDULE_LABELS if k != "fl3"]
    return {
        "n": len(rows),
        "kl_reuse": statistics.mean(r["kl_reuse"] for r in rows),
        "faster": [s[k]["x"].value / s["fl3"]["x"].value - 1 for k in cheaper],
        "kl_up": [s[k]["kl_mean"] / s["fl3"]["kl_mean"] - 1 for k in cheaper],
        "default_x": s["fl3"]["x"],
    }


# ----------------------------------------------------------------------------- one OpenMP team
def _threads_values(res: Results) -> dict[str, Any]:
    cases = parse_report(res.text("threads.txt"))
    slow = [c for c in cases if c["after_us"] / c["before_us"] > 2]
    return {"slowdown": [c["after_us"] / c["before_us"] for c in slow], "processes": cases[0]["processes"]}


GRAMMAR_LIBS = "grammar_libs.jsonl"


def _grammar_table(res: Results) -> str:
    """The grammar libraries side by side (``bench.grammar_libs``): each figure for Qwen2.5's 151k
    vocabulary, then SmolLM2's 49k."""
    by: dict[str, dict[str, dict]] = {}
    for r in res.rows(GRAMMAR_LIBS):
        by.setdefault(f"{r['library']} {r['version']}", {})[r["tokenizer"].split("-")[0]] = r

    def pair(rows: dict[str, dict], field: str, scale: float, spec: str, unit: str) -> str:
        qwen, smol = (rows["Qwen2.5"][field] * scale, rows["SmolLM2"][field] * scale)
        return f"{qwen:{spec}} / {smol:{spec}} {unit}"

    lines = [
        "| library | installed | tokenizer setup (once), Qwen2.5 151k / SmolLM2 49k | a schema's compile, first use "
        "| mask + advance per token, median |",
        "|---|---|---|---|---|",
    ]
    for name, rows in by.items():
        lines.append(
            f"| {name} | {rows['Qwen2.5']['installed_mb']:.1f} MB | {pair(rows, 'tokenizer_setup_s', 1, '.1f', 's')} "
            f"| {pair(rows, 'compile_s_first', 1e3, '.0f', 'ms')} | {pair(rows, 'mask_and_advance_us_median', 1, '.0f', 'µs')} |"
        )
    return "\n".join(lines)


TABLES = {
    "grammar-libs": Table((GRAMMAR_LIBS,), _grammar_table),
    "sweep-512-criteria": _sweep_table(
        "fidelity_512_criteria_schedules.jsonl",
        CRITERIA,
        ("kl_mean", "kl_median", "closer", "top1"),
        "cacheblend[query_value@0.15,f3,b0]",
    ),
    "sweep-512-timing": _sweep_table(
        "sweep_512_timing_v3.jsonl", TIMING, ("ttft", "kl_mean", "closer", "top1", "fresh", "work", "overhead"), QV
    ),
    "sweep-512-timing-qwen": _sweep_table(
        "sweep_512_timing_qwen.jsonl", TIMING[1:], ("ttft", "kl_mean", "closer", "top1", "work", "overhead"), QV
    ),
    "sweep-512-qwen-tuning": _sweep_table(
        "sweep_512_qwen_tuning.jsonl", TUNING, ("ttft", "kl_mean", "kl_median", "closer", "top1", "work")
    ),
    "breakdown-smollm2": Table((BREAKDOWN,), lambda res: breakdown_report(_breakdown(res))),
    "schedules-hotpotqa": Table((SCHEDULES,), _schedules_table),
    "threads-operators": Table(("threads.txt",), lambda res: threads_table(parse_report(res.text("threads.txt")))),
}

PROBE = "weight_formats_probe_smollm2.json"


def _probe_values(res: Results) -> dict[str, Any]:
    """What float16 weights move the next-token distribution by, over the example documents' positions."""
    d = res.json(PROBE)
    fp16 = d["formats"]["fp16"]
    return {
        "positions": d["tokens"],
        "kl_fp16": fp16["kl_mean"],
        "kl_fp16_p95": fp16["kl_p95"],
        "top1_fp16": fp16["top1_agreement"],
    }


VALUES = {
    "probe": Values((PROBE,), _probe_values),
    "sweep": Values(
        tuple(
            sorted(
                {
                    "fidelity_512_criteria_schedules.jsonl",
                    "fidelity_256_criteria.jsonl",
                    "fidelity_512_layer0_checks.jsonl",
                    "sweep_512_timing.jsonl",
                    "sweep_512_timing_v2.jsonl",
                    "sweep_512_timing_v3.jsonl",
                    "sweep_512_timing_qwen.jsonl",
                    "sweep_512_qwen_tuning.jsonl",
                }
            )
        ),
        _sweep_values,
    ),
    "breakdown": Values((BREAKDOWN,), _breakdown_values),
    "schedules": Values((SCHEDULES,), _schedules_values),
    "threads": Values(("threads.txt",), _threads_values),
}
