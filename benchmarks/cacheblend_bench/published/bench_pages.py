"""``bench`` on SmolLM2-135M (headline, llama.cpp quantisations, ratio and chunk sweeps, one team of
threads), whole answers and decode steps, weight formats and ``bench --load``: docs/benchmarks.md,
docs/engine.md, docs/throughput.md and the numbers README and the overview pages quote."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable
from typing import Any

from cacheblend_bench import provenance
from cacheblend_bench.batch_step import markdown_table as batch_step_table
from cacheblend_bench.format_probe import probe_table
from cacheblend_bench.guard_curve import best_within, by_question, cascade, cascade_table, escalation_cascade, frontier
from cacheblend_bench.guard_curve import curve as guard_curve
from cacheblend_bench.guard_curve import table as guard_table
from cacheblend_bench.published.fmt import Stat, pct, x_ci
from cacheblend_bench.published.results import Results, Table, Values
from cacheblend_bench.server_load import markdown_table as server_load_table
from cacheblend_bench.server_overhead import markdown_table as server_overhead_table
from cacheblend_bench.stats import sign_test
from cacheblend_bench.summary import markdown_table, pooled, speedup_over, summarize
from cacheblend_bench.whole_answer import WholeAnswerConfig, decode_step_table
from cacheblend_bench.whole_answer import markdown_table as whole_table
from cacheblend_bench.whole_answer import summarize as whole_summarize
from cacheblend_rag.config import ADAPTIVE_ESCALATION, BlendConfig

HEADLINE = "bench_smollm2.jsonl"
DEFAULT = "question@0.15"  # CacheBlendEngine's defaults
LENGTHS = WholeAnswerConfig.lengths


def _rows_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _stat(pair: tuple[float | None, Any]) -> Stat:
    value, ci = pair
    return Stat(float("nan") if value is None else value, tuple(ci) if ci else None)


def _by_method(summary: list[dict], dataset: str | None = None, top_k: int | None = None) -> dict[str, dict]:
    return {
        e["method"]: e for e in summary if (dataset is None or e["dataset"] == dataset) and (top_k is None or e["top_k"] == top_k)
    }


# ----------------------------------------------------------------------------- the headline
def _headline(res: Results) -> dict[str, Any]:
    """Per dataset and over all questions (``pooled``): ``bench``'s summary of the headline rows."""

    def compute() -> dict[str, Any]:
        rows = res.rows(HEADLINE)
        return {
            "rows": rows,
            "all_rows": pooled(rows),
            "per_dataset": summarize(rows),
            "all": _by_method(summarize(pooled(rows))),
        }

    return res.memo("headline", compute)


def _headline_table(dataset: str):
    return lambda res: markdown_table(_headline(res)["per_dataset"], dataset)


# (label, reference method, bold) for "CacheBlend's TTFT, lower by"
POOLED_REFERENCES = [
    ("vs the saved full prefill (like with like)", "full_recompute_saved", True),
    ("vs transformers' forward (`full_recompute`)", "full_recompute", False),
    ("vs `model.generate()`", "generate", False),
    ("vs prefix caching (fair)", "prefix_caching", True),
    ("vs llama.cpp's fastest quantisation (Q4_0)", "llama_cpp:q4_0", True),
    ("vs llama.cpp Q4_0 with its prefix reuse", "llama_cpp_prefix:q4_0", False),
]


def _pooled_table(res: Results) -> str:
    h = _headline(res)
    rows = []
    for label, ref, bold in POOLED_REFERENCES:
        v, ci = speedup_over(h["all_rows"], DEFAULT, ref)
        text = x_ci(v, ci)
        rows.append([label, f"**{text.split(' ', 1)[0]}** {text.split(' ', 1)[1]}" if bold else text])
    per = {e["dataset"]: e for e in h["per_dataset"] if e["method"] == DEFAULT}
    hkvd = h["all"]["cacheblend@0.15"]["overhead"]
    rows.append(
        [
            "overhead (TTFT / share of the saved full prefill's work)",
            f"{h['all'][DEFAULT]['overhead']:.2f} ("
            + ", ".join(f"{e['overhead']:.2f} {name}" for name, e in (("HotpotQA", per["hotpotqa"]), ("MuSiQue", per["musique"])))
            + f"; HKVD: {hkvd:.2f})",
        ]
    )
    return _rows_table(["CacheBlend's TTFT, lower by", "factor [95% CI]"], rows)


def _headline_values(res: Results) -> dict[str, Any]:
    h = _headline(res)
    rows, all_rows, a = h["rows"], h["all_rows"], h["all"]
    ds = {d: _by_method(h["per_dataset"], d) for d in ("hotpotqa", "musique")}
    q = a[DEFAULT]
    v: dict[str, Any] = {
        "n_per_dataset": len([r for r in rows if r["method"] == DEFAULT and r["dataset"] == "hotpotqa"]),
        "n": q["n"],
        "chain_n": a["map_reduce"]["n"],
        "minutes": (max(r["time"] for r in rows) - min(r["time"] for r in rows)) / 60,
        "prompt_k": [
            min(r["prompt_tokens"] for r in rows if r["method"] == DEFAULT) / 1e3,
            max(r["prompt_tokens"] for r in rows if r["method"] == DEFAULT) / 1e3,
        ],
        "overhead": q["overhead"],
        "hkvd_overhead": a["cacheblend@0.15"]["overhead"],
        # token-layers through attention and the MLP
        "share": q["compute_fraction"],
        "hkvd_share": a["cacheblend@0.15"]["compute_fraction"],
        # a prefill that cost exactly its share of the saved full prefill's work
        "ideal": a["full_recompute_saved"]["compute_fraction"] / q["compute_fraction"],
        "max_f1": max(e["quality"] for e in h["per_dataset"]),
    }
    for ref, key in (
        ("full_recompute_saved", "vs_saved"),
        ("full_recompute", "vs_full"),
        ("generate", "vs_generate"),
        ("prefix_caching", "vs_prefix"),
        ("llama_cpp:q4_0", "vs_q4"),
        ("llama_cpp_prefix:q4_0", "vs_q4_prefix"),
    ):
        v[key] = _stat(speedup_over(all_rows, DEFAULT, ref))
        v[f"hkvd_{key}"] = _stat(speedup_over(all_rows, "cacheblend@0.15", ref))
    for method, key in (
        ("prefix_caching", "prefix"),
        ("full_recompute_saved", "saved"),
        ("generate", "generate"),
        ("full_reuse", "reuse"),
        ("llama_cpp:q4_0", "q4"),
        ("llama_cpp:f16", "f16"),
    ):
        v[f"{key}_vs_saved"] = _stat(speedup_over(all_rows, method, "full_recompute_saved"))
        v[f"{key}_vs_full"] = _stat(speedup_over(all_rows, method, "full_recompute"))
    v["q4_prefix_vs_q4"] = _stat(speedup_over(all_rows, "llama_cpp_prefix:q4_0", "llama_cpp:q4_0"))
    v["reuse_share"] = 1 / v["reuse_vs_saved"].value  # a full-reuse pass as a share of a full prefill
    # Decoding, ms per token after the first, and the answer length from which llama.cpp finishes first.
    for method, key in ((DEFAULT, "default"), ("prefix_caching", "prefix"), ("llama_cpp:q4_0", "q4"), ("llama_cpp:f16", "f16")):
        v[f"decode_{key}"] = a[method]["decode_ms_per_token"]
        v[f"latency_{key}"] = a[method]["latency_mean_s"]
    v["q4_decode_faster"] = v["decode_default"] / v["decode_q4"]
    ttft = {m: statistics.mean(r["ttft_s"] for r in all_rows if r["method"] == m) for m in (DEFAULT, "llama_cpp:q4_0")}
    v["crossover_tokens"] = 1 + (ttft["llama_cpp:q4_0"] - ttft[DEFAULT]) / ((v["decode_default"] - v["decode_q4"]) / 1e3)
    v["tokens"] = max(r.get("generated_tokens") or 0 for r in rows)
    # Quality and fidelity per dataset
    for d, s in ds.items():
        v[f"kl_{d}"] = s[DEFAULT]["kl_mean"]
        v[f"reuse_kl_{d}"] = s["full_reuse"]["kl_mean"]
        v[f"q4_losses_{d}"] = s["llama_cpp:q4_0"]["quality_losses"]
        v[f"q4_wins_{d}"] = s["llama_cpp:q4_0"]["quality_wins"]
        v[f"hkvd_vs_saved_{d}"] = Stat(
            s["cacheblend@0.15"]["speedup_vs_full_recompute_saved"], s["cacheblend@0.15"]["speedup_vs_full_recompute_saved_ci"]
        )
        v[f"vs_saved_{d}"] = Stat(s[DEFAULT]["speedup_vs_full_recompute_saved"], s[DEFAULT]["speedup_vs_full_recompute_saved_ci"])
    v["kl"] = [v["kl_hotpotqa"], v["kl_musique"]]
    v["reuse_kl"] = [v["reuse_kl_hotpotqa"], v["reuse_kl_musique"]]
    v["q4_kl"] = [ds[d]["llama_cpp:q4_0"]["kl_mean"] for d in ds]
    # the largest F1 loss to full prefill of a fused mode on either dataset
    v["worst_kv_f1_diff"] = -min(ds[d][m]["quality_diff_vs_full"] for d in ds for m in (DEFAULT, "cacheblend@0.15"))
    m = ds["musique"]["llama_cpp:q4_0"]
    v["q4_diff_musique"] = Stat(m["quality_diff_vs_full"], m["quality_diff_ci"])
    v["f16_agree"] = round(a["llama_cpp:f16"]["agreement"] * a["llama_cpp:f16"]["n"])
    # The LangChain chains: how many times slower than transformers' forward, per dataset.
    for chain in ("map_reduce", "map_rerank"):
        v[f"{chain}_slower"] = [1 / ds[d][chain]["speedup_vs_full_recompute"] for d in ds]
        v[f"{chain}_f1"] = a[chain]["quality"]
    v["chains_slower"] = v["map_reduce_slower"] + v["map_rerank_slower"]
    v["chains_latency"] = a["map_reduce"]["latency_mean_s"] + a["map_rerank"]["latency_mean_s"]
    return v


# ----------------------------------------------------------------------------- llama.cpp quantisations
QUANT_LABELS = {"llama_cpp": "Q4_1 (as shipped)", "llama_cpp:f16": "F16", "llama_cpp:q8_0": "Q8_0", "llama_cpp:q4_0": "Q4_0"}


def _quants(res: Results) -> dict[str, dict]:
    return res.memo("quants", lambda: _by_method(summarize(pooled(res.rows("bench_llama_quants_smollm2.jsonl")))))


def _quants_table(res: Results) -> str:
    s = _quants(res)
    rows = [
        [
            label,
            x_ci(s[m]["speedup_vs_full_recompute"], s[m]["speedup_vs_full_recompute_ci"]),
            f"{s[m]['kl_mean']:.3f}",
            f"{round(s[m]['agreement'] * s[m]['n'])}/{s[m]['n']}",
        ]
        for m, label in QUANT_LABELS.items()
    ]
    return _rows_table(
        ["llama.cpp on", "TTFT vs transformers' fp32 forward", "KL to full prefill", "answer = full prefill's"], rows
    )


def _quants_values(res: Results) -> dict[str, Any]:
    rows = res.rows("bench_llama_quants_smollm2.jsonl")
    s = _quants(res)
    fastest = max(QUANT_LABELS, key=lambda m: s[m]["speedup_vs_full_recompute"])
    return {
        "minutes": (max(r["time"] for r in rows) - min(r["time"] for r in rows)) / 60,
        "n": s["full_recompute"]["n"],
        "fastest": QUANT_LABELS[fastest],
    }


# ----------------------------------------------------------------------------- ratio and chunk sweeps
def _per_dataset(rows: list[dict]) -> dict[str, dict[str, dict]]:
    return {d: _by_method(summarize(rows), d) for d in dict.fromkeys(r["dataset"] for r in rows)}


def _ratio_cell(c: dict, method: str) -> str:
    """A speed-up over the saved full prefill with its interval; the default's number in bold."""
    if method == "full_recompute_saved":
        return "1.00x"
    text = x_ci(c["speedup_vs_full_recompute_saved"], c["speedup_vs_full_recompute_saved_ci"])
    head, _, tail = text.partition(" ")
    return f"**{head}** {tail}" if method == DEFAULT else text


def _ratios_table(res: Results) -> str:
    rows = res.rows("bench_ratios_smollm2.jsonl")
    per, both = _per_dataset(rows), _by_method(summarize(pooled(rows)))
    out = []
    for method, e in both.items():
        cells = [per[d][method] for d in per]
        reference = method == "full_recompute_saved"
        out.append(
            [
                f"**{method}**" if method == DEFAULT else method,
                f"{e['compute_fraction']:.0%}",
                " / ".join(_ratio_cell(c, method) for c in cells),
                " / ".join("0" if reference else f"{c['kl_mean']:.3f}" for c in cells),
                ", ".join(f"{round(c['agreement'] * c['n'])}/{c['n']}" for c in cells),
            ]
        )
    header = [
        "method",
        "token-layers computed",
        "TTFT vs saved full prefill, " + " / ".join(per),
        "KL to full prefill",
        "answer = full prefill's",
    ]
    return _rows_table(header, out)


def _ratios_values(res: Results) -> dict[str, Any]:
    rows = res.rows("bench_ratios_smollm2.jsonl")
    per = _per_dataset(rows)
    v: dict[str, Any] = {
        "n": per["hotpotqa"][DEFAULT]["n"],
        "minutes": (max(r["time"] for r in rows) - min(r["time"] for r in rows)) / 60,
    }
    for r in (0.05, 0.15, 0.3, 0.5):
        m = f"question@{r:g}"
        key = f"{r:g}".replace(".", "")
        v[f"vs_saved_{key}"] = [per[d][m]["speedup_vs_full_recompute_saved"] for d in per]
        v[f"kl_{key}"] = [per[d][m]["kl_mean"] for d in per]
    return v


def _chunks_table(res: Results) -> str:
    rows = res.rows("bench_vs_chunks_smollm2.jsonl")
    summary = summarize(rows)
    out = []
    for k in sorted({r["top_k"] for r in rows}):
        per = {d: _by_method(summary, d, k) for d in dict.fromkeys(r["dataset"] for r in rows)}
        tokens = statistics.mean(r["prompt_tokens"] for r in rows if r["top_k"] == k)
        q = [per[d][DEFAULT] for d in per]
        reuse = [per[d]["full_reuse"] for d in per]
        out.append(
            [
                f"{k} (~{tokens / 1e3:.1f}k tokens)",
                " / ".join(x_ci(e["speedup_vs_full_recompute_saved"], e["speedup_vs_full_recompute_saved_ci"]) for e in q),
                " / ".join(f"{e['speedup_vs_full_recompute_saved']:.1f}x" for e in reuse),
                " / ".join(f"{e['kl_mean']:.3f}" for e in q),
                " / ".join(f"{e['kl_mean']:.3f}" for e in reuse),
            ]
        )
    datasets = " / ".join(dict.fromkeys(r["dataset"] for r in rows))
    return _rows_table(
        ["top-k (prompt)", f"CacheBlend TTFT vs saved full, {datasets}", "full reuse", "KL CacheBlend", "KL full reuse"], out
    )


def _chunks_values(res: Results) -> dict[str, Any]:
    rows = res.rows("bench_vs_chunks_smollm2.jsonl")
    summary = summarize(rows)
    v: dict[str, Any] = {"n": len([r for r in rows if r["method"] == DEFAULT]) // len({(r["dataset"], r["top_k"]) for r in rows})}
    for k in sorted({r["top_k"] for r in rows}):
        per = {d: _by_method(summary, d, k) for d in dict.fromkeys(r["dataset"] for r in rows)}
        v[f"vs_saved_{k}"] = [per[d][DEFAULT]["speedup_vs_full_recompute_saved"] for d in per]
        v[f"kl_{k}"] = [per[d][DEFAULT]["kl_mean"] for d in per]
        v[f"reuse_kl_musique_{k}"] = per["musique"]["full_reuse"]["kl_mean"]
    v["kl_max"] = max(max(v[k]) for k in v if k.startswith("kl_"))
    return v


# ----------------------------------------------------------------------------- one team of threads
THREADS = "bench_threads_smollm2.jsonl"


def _process_table(file: str, with_commits: bool):
    """CacheBlend against the saved full prefill per process (the rows' ``run``), labelled by the
    methods the process ran besides those two; ``with_commits``: a column with the engine's commit
    per process (provenance.json's ``runs``)."""

    def render(res: Results) -> str:
        rows = res.rows(file)
        commits = provenance.of(res.folder, file).runs.get("commits", {})
        base = {"full_recompute_saved", DEFAULT}
        out, seen = [], set()
        for run in dict.fromkeys(r["run"] for r in rows):
            rs = [r for r in rows if r["run"] == run]
            s = _by_method(summarize(pooled(rs)))
            extra = sorted({r["method"] for r in rs} - base, key=lambda m: [r["method"] for r in rs].index(m))
            label = "saved full prefill, CacheBlend" if not extra else "+ " + ", ".join(f"`{m}`" for m in extra)
            if label in seen and not with_commits:  # without a commit column, a repeated process says so
                label += " (again)"
            seen.add(label)
            out.append(
                [label]
                + ([commits[run]] if with_commits else [])
                + [
                    x_ci(s[DEFAULT]["speedup_vs_full_recompute_saved"], s[DEFAULT]["speedup_vs_full_recompute_saved_ci"]),
                    f"{s[DEFAULT]['decode_ms_per_token']:.0f}",
                ]
            )
        head = ["methods in the process"] + (["engine (commit)"] if with_commits else [])
        return _rows_table(head + ["TTFT vs saved full", "CacheBlend decode, ms/token"], out)

    return render


MIXED = "mixed_process_smollm2.jsonl"


def _mixed_values(res: Results) -> dict[str, Any]:
    """CacheBlend in the long mixed process against the mean of the fresh processes, per question:
    the geometric mean of the time ratios (> 1: slower in the mixed process)."""
    rows = [r for r in res.rows(MIXED) if r["method"] == DEFAULT]
    by_run: dict[str, dict[tuple[str, str], dict]] = {}
    for r in rows:
        by_run.setdefault(r["run"], {})[(r["dataset"], r["qid"])] = r
    fresh = [run for run in by_run if run != "mixed"]
    mixed = by_run["mixed"]

    def ratio(get) -> float:
        return statistics.geometric_mean(get(mixed[q]) / statistics.mean(get(by_run[f][q]) for f in fresh) for q in mixed)

    return {
        "n": len(mixed),
        "processes": len(by_run),
        "ttft_ratio": ratio(lambda r: r["ttft_s"]),
        "decode_ratio": ratio(lambda r: (r["total_s"] - r["ttft_s"]) / max(1, r["generated_tokens"] - 1)),
    }


# ----------------------------------------------------------------------------- whole answers
TTFT_FORMATS = "ttft_formats_smollm2.jsonl"  # bench --whole-answer --lengths 32 --llama-cpp "": the prefills alone


def _ttft_formats(res: Results) -> list[dict]:
    return res.memo("ttft-formats", lambda: whole_summarize(res.rows(TTFT_FORMATS), (32,)))


def _ttft_formats_table(res: Results) -> str:
    lines = [
        "| method | n | TTFT s | TTFT vs full prefill (same format) | 32 tokens vs full prefill | same 32 tokens as fp32 full prefill |",
        "|---|---|---|---|---|---|",
    ]
    for e in _ttft_formats(res):
        ratios = [x_ci(e.get(f"{f}_vs_full_prefill"), e.get(f"{f}_vs_full_prefill_ci")) for f in ("ttft", "t32")]
        same = pct(e["same_32_tokens_as_fp32_full_prefill"]) if "same_32_tokens_as_fp32_full_prefill" in e else "–"
        lines.append(f"| {e['method']} | {e['n']} | {e['ttft_s']:.2f} | {ratios[0]} | {ratios[1]} | {same} |")
    return "\n".join(lines)


def _ttft_formats_values(res: Results) -> dict[str, Any]:
    s = {e["method"]: e for e in _ttft_formats(res)}
    v: dict[str, Any] = {"n": s["question@0.15/fp16"]["n"]}
    for fmt in ("fp16", "fp32"):
        e = s[f"question@0.15/{fmt}"]
        v[f"ttft_vs_full_{fmt}"] = Stat(e["ttft_vs_full_prefill"], e["ttft_vs_full_prefill_ci"])
    return v


def _whole(res: Results, file: str, reference: str = "llama_cpp:q8_0") -> list[dict]:
    return res.memo(f"whole:{file}:{reference}", lambda: whole_summarize(res.rows(file), LENGTHS, reference))


def _whole_table(file: str):
    return lambda res: whole_table(_whole(res, file), LENGTHS)


def _whole_values(file: str, steps: str):
    def compute(res: Results) -> dict[str, Any]:
        rows = res.rows(file)
        s = {e["method"]: e for e in _whole(res, file)}
        q4 = {e["method"]: e for e in _whole(res, file, "llama_cpp:q4_0")}
        fp32 = {e["method"]: e for e in _whole(res, file, "full_recompute_saved/fp32")}
        fp16, cb16, cb32 = s["full_recompute_saved/fp16"], s["question@0.15/fp16"], s["question@0.15/fp32"]
        v: dict[str, Any] = {
            "n": cb16["n"],
            "n_hotpotqa": len({r["qid"] for r in rows if r["dataset"] == "hotpotqa"}),
            "n_musique": len({r["qid"] for r in rows if r["dataset"] == "musique"}),
            "prompt_k": [min(r["prompt_tokens"] for r in rows) / 1e3, max(r["prompt_tokens"] for r in rows) / 1e3],
            "prompt_mean_k": cb16["prompt_tokens"] / 1e3,
            "longest": max(LENGTHS),
            "weight_mb": res.json(steps)["fp32"]["weight_mb"],
            "step_prompt_k": res.json(steps)["fp32"]["prompt_tokens"] / 1e3,
            # llama.cpp's prompt evaluation against the engine's float32 full prefill: times slower
            "llama_prompt_slower": 1 / fp32["llama_cpp:q8_0"]["ttft_vs_full_recompute_saved/fp32"],
            "fp16_full_same_32": fp16["same_32_tokens_as_fp32_full_prefill"],
            "fp16_full_kl": fp16["kl_vs_fp32_full_prefill"],
            "fp16_full_t256_vs_fp32": Stat(
                fp32["full_recompute_saved/fp16"]["t256_vs_full_recompute_saved/fp32"],
                fp32["full_recompute_saved/fp16"]["t256_vs_full_recompute_saved/fp32_ci"],
            ),
            "cb_same_32": [cb16["same_32_tokens_as_fp32_full_prefill"], cb32["same_32_tokens_as_fp32_full_prefill"]],
        }
        for method, key in (
            ("question@0.15/fp16", "fp16"),
            ("question@0.15/fp32", "fp32"),
            ("llama_cpp:q8_0", "q8"),
            ("llama_cpp:q4_0", "q4"),
            ("llama_cpp:f16", "f16"),
            ("llama_cpp_prefix:q4_0", "q4_prefix"),
            ("llama_cpp_prefix:q8_0", "q8_prefix"),
        ):
            v[f"ms_{key}"] = s[method]["decode_ms_per_token"]
            v[f"t256_{key}"] = s[method]["t256_s"]
        v["decode_vs_q8_fp16"], v["decode_vs_q8_fp32"] = cb16["decode_vs_llama_cpp:q8_0"], cb32["decode_vs_llama_cpp:q8_0"]
        v["decode_fp16_vs_f16"] = v["ms_fp16"] / v["ms_f16"]  # the engine's float16 step over llama.cpp F16's
        for n in LENGTHS:
            v[f"t{n}_vs_q8"] = Stat(cb16[f"t{n}_vs_llama_cpp:q8_0"], cb16[f"t{n}_vs_llama_cpp:q8_0_ci"])
            v[f"t{n}_vs_q4"] = Stat(
                q4["question@0.15/fp16"][f"t{n}_vs_llama_cpp:q4_0"], q4["question@0.15/fp16"][f"t{n}_vs_llama_cpp:q4_0_ci"]
            )
        for f in ("ttft", *(f"t{n}" for n in LENGTHS)):
            v[f"{f}_vs_full"] = Stat(cb16[f"{f}_vs_full_prefill"], cb16[f"{f}_vs_full_prefill_ci"])
        return v

    return compute


# ----------------------------------------------------------------------------- serving many requests
LOAD = "load_smollm2.json"


def _load_key(e: dict) -> tuple:
    return e["method"], e["max_batch"], e["level"]


def _load_table(res: Results) -> str:
    d = res.json(LOAD)
    runs = [{_load_key(e): e for e in run} for run in d["per_run"]]
    names = {"full_recompute": "full prefill", DEFAULT: f"CacheBlend ({DEFAULT})"}
    cols = (("answers_per_s", "{:.3f}"), ("ttft_p50", "{:#.3g}"), ("ttft_p95", "{:#.3g}"), ("e2e_p50", "{:#.3g}"))
    out = []
    for key in runs[0]:
        values = [[run[key][c] for run in runs] for c, _ in cols]
        cells = [
            f"{f.format(statistics.median(vs))} [{f.format(min(vs))}, {f.format(max(vs))}]" for vs, (_, f) in zip(values, cols)
        ]
        out.append(
            [
                names.get(key[0], key[0]),
                str(key[1]),
                str(key[2]),
                *cells,
                f"{statistics.median(run[key]['mean_batch'] for run in runs):.2f}",
            ]
        )
    return _rows_table(
        ["method", "max_batch", "clients", "answers/s", "TTFT p50 (s)", "TTFT p95 (s)", "end-to-end p50 (s)", "answers per step"],
        out,
    )


def _load_values(res: Results) -> dict[str, Any]:
    d = res.json(LOAD)
    rows = res.rows("load_smollm2.jsonl")
    runs = [{_load_key(e): e for e in run} for run in d["per_run"]]
    clients = max(k[2] for k in runs[0])
    batch = max(k[1] for k in runs[0])
    cb, full = (DEFAULT, batch, clients), ("full_recompute", batch, clients)

    def med(key: tuple, field: str) -> float:
        return statistics.median(run[key][field] for run in runs)

    def rng(key: tuple, field: str) -> str:
        vs = [run[key][field] for run in runs]
        return f"{statistics.median(vs):.3f} [{min(vs):.3f}, {max(vs):.3f}]"

    # Throughput ratios over the runs together: the same answers' total wall time, full over
    # CacheBlend (a ratio of means, stats.speedup's definition), and each run's alone.
    wall = {k: sum(run[k]["wall_s"] for run in runs) for k in (cb, full)}
    tokens = {
        m: [r["tokens"] for r in rows if (r["method"], r["max_batch"], r["level"]) == (m, batch, clients)]
        for m in (DEFAULT, "full_recompute")
    }
    return {
        "runs": d["runs"],
        "clients": clients,
        "batch": batch,
        "answers": runs[0][cb]["answers"],
        "answers_ratio": wall[full] / wall[cb],
        "answers_ratio_runs": [run[cb]["answers_per_s"] / run[full]["answers_per_s"] for run in runs],
        # tokens per second over the runs together: all tokens over all wall time, CacheBlend over full prefill
        "tokens_ratio": (sum(run[cb]["tokens_per_s"] * run[cb]["wall_s"] for run in runs) / wall[cb])
        / (sum(run[full]["tokens_per_s"] * run[full]["wall_s"] for run in runs) / wall[full]),
        "tokens_ratio_runs": [run[cb]["tokens_per_s"] / run[full]["tokens_per_s"] for run in runs],
        "tokens_default": statistics.mean(tokens[DEFAULT]),
        "tokens_full": statistics.mean(tokens["full_recompute"]),
        "max_tokens": d["config"]["max_new_tokens"],
        "prefill_full": med(("full_recompute", 1, 1), "ttft_p50"),
        "prefill_default": med((DEFAULT, 1, 1), "ttft_p50"),
        "ttft_p50_unbatched": med((DEFAULT, 1, clients), "ttft_p50"),
        "ttft_p50_batched": med(cb, "ttft_p50"),
        "answers_unbatched": rng((DEFAULT, 1, clients), "answers_per_s"),
        "answers_batched": rng(cb, "answers_per_s"),
        "per_step": med(cb, "mean_batch"),
    }


# ----------------------------------------------------------------------------- the HTTP server under load
SERVER_LOAD = "server_load_smollm2.json"
SERVER_LOAD_ROWS = "server_load_smollm2.jsonl"
BATCH_STEP = "batch_step_smollm2.json"


def _batch_step_values(res: Results) -> dict[str, Any]:
    d = res.json(BATCH_STEP)
    out: dict[str, Any] = {"tokens": d["tokens"]}
    for fmt, entries in d["formats"].items():
        alone = entries[0]["step_ms"]
        for e in entries:
            out[f"{fmt}_{e['rows']}_ms"] = e["step_ms"]
            out[f"{fmt}_{e['rows']}_gain"] = alone / e["per_answer_ms"]
    return out


SERVER_OVERHEAD = "server_overhead_smollm2.json"  # python -m cacheblend_bench.server_overhead (docs/server.md)


def _server_overhead_values(res: Results) -> dict[str, Any]:
    d = res.json(SERVER_OVERHEAD)
    return {
        "paired_swing": max(-d["paired_ratio_minus_1"]["min"], d["paired_ratio_minus_1"]["max"]),
        "overhead_median": d["in_request_overhead_fraction"]["median"],
    }


def _server_load_values(res: Results) -> dict[str, Any]:
    summary = {(e["max_batch"], e["clients"]): e for e in res.json(SERVER_LOAD)["summary"]}
    alone = [r for r in res.rows(SERVER_LOAD_ROWS) if r["max_batch"] == 1 and r["clients"] == 1]
    batched = max(b for b, _ in summary)
    out: dict[str, Any] = {
        "batch": batched,
        "tokens": statistics.mean(r["tokens"] for r in alone),
        "max_tokens": alone[0]["max_new_tokens"],
        "ttft_alone": statistics.mean(r["ttft_s"] for r in alone),
        "e2e_alone": statistics.mean(r["total_s"] for r in alone),
        # The part of an answer served alone that batching cannot share: its prefill (time to
        # first token), over the whole answer. Batched throughput is at most 1 / this.
        "prefill_share": sum(r["ttft_s"] for r in alone) / sum(r["total_s"] for r in alone),
    }
    out["bound"] = 1 / out["prefill_share"]
    # With decoding shared as the measured 4-answer step shares it (batch_step): the prefill share
    # unchanged, the rest divided by that step's gain per answer.
    gain = _batch_step_values(res)["fp32_4_gain"]
    out["bound_4"] = 1 / (out["prefill_share"] + (1 - out["prefill_share"]) / gain)
    for clients in sorted({c for _, c in summary}):
        one, many = summary[(1, clients)], summary[(batched, clients)]
        out[f"ratio_{clients}"] = many["answers_per_s"] / one["answers_per_s"]
        out[f"ttft_p50_unbatched_{clients}"] = one["ttft_p50"]
        out[f"ttft_p50_batched_{clients}"] = many["ttft_p50"]
        out[f"per_step_{clients}"] = many["answers_per_step"]
    return out


# ----------------------------------------------------------------------------- the fidelity guard's trade
GUARD = "guard_dev_qwen05.jsonl"


def _guard_table(res: Results) -> str:
    return guard_table(guard_curve(res.rows(GUARD), DEFAULT, thresholds=(0.0, 0.25, 0.5, 1.0, 1.5, 2.0, float("inf"))))


# ----------------------------------------------------------------------------- adaptive recompute's trade
ADAPTIVE_DEV = "adaptive_dev_qwen05.jsonl"
# The same methods on questions the preset was not chosen on (HotpotQA dev from 5000, MuSiQue 15-49).
ADAPTIVE_HELDOUT = "adaptive_heldout_qwen05.jsonl"
ADAPTIVE_CHAIN = [f"question@{r:g}/nb" for r in (0.05, 0.1, 0.15, 0.3, 0.6)] + ["full_recompute_saved"]


def _adaptive(res: Results, dataset: str, file: str = ADAPTIVE_DEV) -> dict[str, Any]:
    """Fixed ratios, the preset cascade (the default ratio, then ``config.ADAPTIVE_ESCALATION``)
    and the frontier."""
    qs = by_question(res.rows(file), ADAPTIVE_CHAIN, dataset)
    methods, margins = escalation_cascade(f"question@{BlendConfig().recompute_ratio:g}/nb", ADAPTIVE_ESCALATION)
    return {
        "fixed": [cascade(qs, [m], ()) for m in ADAPTIVE_CHAIN],
        "preset": cascade(qs, methods, margins),
        "frontier": frontier(qs, ADAPTIVE_CHAIN),
    }


def _adaptive_table(dataset: str) -> Callable[[Results], str]:
    def render(res: Results) -> str:
        a = _adaptive(res, dataset)
        return "\n\n".join(
            [
                f"Fixed ratios and the preset `ADAPTIVE_ESCALATION` ({a['preset']['n']} questions):\n\n"
                + cascade_table([*a["fixed"], a["preset"]]),
                "The frontier (no cascade over these ratios both agrees more and is faster):\n\n" + cascade_table(a["frontier"]),
            ]
        )

    return render


def _adaptive_heldout_table(res: Results) -> str:
    a = _adaptive(res, "all", ADAPTIVE_HELDOUT)
    fixed = next(e for e in a["fixed"] if e["methods"] == a["preset"]["methods"][:1])
    better = sum(p and not f for p, f in zip(a["preset"]["agrees"], fixed["agrees"]))
    worse = sum(f and not p for p, f in zip(a["preset"]["agrees"], fixed["agrees"]))
    return (
        f"Fixed ratios and the preset on {a['preset']['n']} held-out questions (the preset against the fixed "
        f"default ratio: {better} better, {worse} worse):\n\n" + cascade_table([*a["fixed"], a["preset"]])
    )


def _adaptive_values(res: Results) -> dict[str, Any]:
    rows = [r for r in res.rows(ADAPTIVE_DEV) if r["method"] == f"question@{BlendConfig().recompute_ratio:g}/nb"]
    missed = [r for r in rows if not r["agree"]]
    out: dict[str, Any] = {
        # Disagreements where full prefill itself was less than twice as sure of its first token.
        "missed": len(missed),
        "missed_near_tie": sum(r["margin_full"] < math.log(2) for r in missed),
    }
    for dataset in ("all", "hotpotqa", "musique"):
        a = _adaptive(res, dataset)
        d = a["preset"]
        fixed = next(e for e in a["fixed"] if e["methods"] == d["methods"][:1])
        better = sum(p and not f for p, f in zip(d["agrees"], fixed["agrees"]))
        worse = sum(f and not p for p, f in zip(d["agrees"], fixed["agrees"]))
        out.update(
            {
                f"{dataset}_n": d["n"],
                f"{dataset}_preset_agree": d["agree"],
                f"{dataset}_preset_speedup": d["speedup_vs_saved"],
                # The preset's mean TTFT over the fixed ratio's, on the same questions.
                f"{dataset}_preset_cost": d["ttft_mean_s"] / fixed["ttft_mean_s"],
                f"{dataset}_preset_escalated": d["escalated"],
                f"{dataset}_preset_better": better,
                f"{dataset}_preset_worse": worse,
                f"{dataset}_preset_p": sign_test(better, worse),
                f"{dataset}_fixed_agree": fixed["agree"],
                f"{dataset}_fixed_speedup": fixed["speedup_vs_saved"],
            }
        )
        best = best_within(a["frontier"], 4.0)  # the most agreement a cascade keeps within 4x
        out[f"{dataset}_best_within_4x_agree"] = best["agree"] if best else math.nan
        # Each fixed ratio's agreement: agree_005 for question@0.05/nb, ..., agree_06.
        for e in a["fixed"]:
            ratio = e["methods"][0].partition("@")[2].partition("/")[0]
            if ratio:
                out[f"{dataset}_agree_{ratio.replace('.', '')}"] = e["agree"]
    return out


# ----------------------------------------------------------------------------- the reliability load run
RELIABILITY = "reliability_load_tiny.txt"


def _reliability_values(res: Results) -> dict[str, Any]:
    text = res.text(RELIABILITY)
    same, total = re.search(r"identical answers: (\d+)/(\d+)", text).groups()
    return {
        "identical": int(same),
        "requests": int(total),
        "slowdown": float(re.search(r"wall time concurrent / sequential: ([\d.]+)", text).group(1)),
    }


TABLES = {
    "bench-headline-hotpotqa": Table((HEADLINE,), _headline_table("hotpotqa")),
    "bench-headline-musique": Table((HEADLINE,), _headline_table("musique")),
    "bench-headline-pooled": Table((HEADLINE,), _pooled_table),
    "bench-llama-quants": Table(("bench_llama_quants_smollm2.jsonl",), _quants_table),
    "bench-ratios": Table(("bench_ratios_smollm2.jsonl",), _ratios_table),
    "bench-vs-chunks": Table(("bench_vs_chunks_smollm2.jsonl",), _chunks_table),
    "bench-threads": Table((THREADS,), _process_table(THREADS, with_commits=True)),
    "bench-mixed-process": Table((MIXED,), _process_table(MIXED, with_commits=False)),
    "whole-answer-smollm2": Table(("whole_answer_smollm2.jsonl",), _whole_table("whole_answer_smollm2.jsonl")),
    "whole-answer-qwen05": Table(("whole_answer_qwen05.jsonl",), _whole_table("whole_answer_qwen05.jsonl")),
    "ttft-formats-smollm2": Table((TTFT_FORMATS,), _ttft_formats_table),
    "decode-step-smollm2": Table(
        ("decode_step_smollm2.json",), lambda res: decode_step_table(res.json("decode_step_smollm2.json"))
    ),
    "decode-step-qwen05": Table(("decode_step_qwen05.json",), lambda res: decode_step_table(res.json("decode_step_qwen05.json"))),
    "format-probe-smollm2": Table(
        ("weight_formats_probe_smollm2.json",), lambda res: probe_table(res.json("weight_formats_probe_smollm2.json"))
    ),
    "load-smollm2": Table((LOAD,), _load_table),
    "guard-qwen05-dev": Table((GUARD,), _guard_table),
    "adaptive-qwen05-dev": Table((ADAPTIVE_DEV,), _adaptive_table("all")),
    "adaptive-qwen05-dev-musique": Table((ADAPTIVE_DEV,), _adaptive_table("musique")),
    "adaptive-qwen05-heldout": Table((ADAPTIVE_HELDOUT,), _adaptive_heldout_table),
    "batch-step-smollm2": Table((BATCH_STEP,), lambda res: batch_step_table(res.json(BATCH_STEP))),
    "server-load-smollm2": Table((SERVER_LOAD,), lambda res: server_load_table(res.json(SERVER_LOAD)["summary"])),
    "server-overhead-smollm2": Table((SERVER_OVERHEAD,), lambda res: server_overhead_table(res.json(SERVER_OVERHEAD))),
    "reliability-load-tiny": Table((RELIABILITY,), lambda res: "```\n" + res.text(RELIABILITY).strip() + "\n```"),
}

VALUES = {
    "bench": Values((HEADLINE,), _headline_values),
    "adaptive": Values((ADAPTIVE_DEV,), _adaptive_values),
    "quants": Values(("bench_llama_quants_smollm2.jsonl",), _quants_values),
    "ratios": Values(("bench_ratios_smollm2.jsonl",), _ratios_values),
    "chunks": Values(("bench_vs_chunks_smollm2.jsonl",), _chunks_values),
    "whole": Values(
        ("whole_answer_smollm2.jsonl", "decode_step_smollm2.json"),
        _whole_values("whole_answer_smollm2.jsonl", "decode_step_smollm2.json"),
    ),
    "whole05": Values(
        ("whole_answer_qwen05.jsonl", "decode_step_qwen05.json"),
        _whole_values("whole_answer_qwen05.jsonl", "decode_step_qwen05.json"),
    ),
    "ttft": Values((TTFT_FORMATS,), _ttft_formats_values),
    "load": Values((LOAD, "load_smollm2.jsonl"), _load_values),
    "reliability": Values((RELIABILITY,), _reliability_values),
    "batchstep": Values((BATCH_STEP,), _batch_step_values),
    "mixed": Values((MIXED,), _mixed_values),
    "serverload": Values((SERVER_LOAD, SERVER_LOAD_ROWS, BATCH_STEP), _server_load_values),
    "overhead": Values((SERVER_OVERHEAD,), _server_overhead_values),
    "decode": Values(
        ("decode_step_smollm2.json",),
        lambda res: {k: res.json("decode_step_smollm2.json")["fp32"][k] for k in ("weight_mb", "kv_mb", "prompt_tokens")},
    ),
}
