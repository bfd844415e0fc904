"""The README's results table: what a user gets by default, each figure against its baseline,
from the headline cases' rows (``bench.headline``: the rows it reads and the rule they are held to)."""

from __future__ import annotations

import statistics
from typing import Any

from cacheblend_bench import headline, provenance
from cacheblend_bench.ask_cost import RUNS as ASK_RUNS
from cacheblend_bench.ask_cost import summarize as ask_cost_summarize
from cacheblend_bench.ask_cost import table as ask_cost_table
from cacheblend_bench.fidelity import FidelityConfig
from cacheblend_bench.fidelity import summarize as fidelity_summarize
from cacheblend_bench.published.fmt import Stat, pct_ci, x_ci
from cacheblend_bench.published.results import Results, Table, Values
from cacheblend_bench.whole_answer import summarize as whole_summarize

LONGEST = max(headline.CASES[0].lengths)
NAMES = {"smollm2": "SmolLM2-135M", "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B"}
REFERENCE = "llama_cpp:q8_0"


def _settings(rows: list[dict]) -> str:
    """The rows' settings in a few words: "the defaults", or how they differ."""
    if all(not headline.problems(r, headline.provenance.engine_source_now()) for r in rows):
        return "the defaults"
    blend = [r for r in rows if "llama_cpp" not in r["method"]]
    shown = [headline.legacy_settings(r) if r.get("settings") is None else r["settings"] for r in blend]
    formats = sorted({s.get("weight_format") or s.get("weights") or "?" for s in shown})
    caches = sorted({_caches(s, r) for r, s in zip(blend, shown) if s.get("mode") == "cacheblend"})
    records = sorted({f"{s.get('kv_format') or 'float'} chunk records" for s in shown})
    engines = {r.get("engine_source") for r in rows}
    engine = "an older engine" if engines - {headline.provenance.engine_source_now()} else "today's engine"
    return f"{'/'.join(formats)}, {', '.join(caches)}, {', '.join(records)}, {engine}"


def _caches(settings: dict, row: dict) -> str:
    """What served a row's chunks: plain caches, or neighbour caches from where their neighbours
    came; a row that asked for neighbour caches and records none serving (or no count) was served
    plain ones."""
    if not settings.get("neighbour_caches"):
        return "plain caches"
    if headline.neighbours_unserved(row):
        return "plain caches (neighbour caches asked for, none served)"
    return "neighbour caches (" + ("the corpus" if settings.get("neighbour_pool") == "corpus" else "the prompt's chunks") + ")"


def _whole_rows(res: Results, case: headline.Case) -> list[list[str]]:
    rows = headline.headline_rows(case, res.rows(headline.rows_file(case)))
    blend = headline.pick_default({r["method"] for r in rows})
    entry = next(e for e in whole_summarize(rows, case.lengths, REFERENCE) if e["method"] == blend)
    model = NAMES.get(case.model, case.model)
    prompt = f"{statistics.mean(r['prompt_tokens'] for r in rows) / 1000:.1f}k"
    qs = f"{entry['n']}"
    settings, cpu = _settings(rows), provenance.machine_label(rows)

    def cell(field: str, digits: int = 2) -> str:
        return x_ci(entry[field], entry[f"{field}_ci"], digits) + " sooner"

    return [
        [model, f"first token ({prompt}-token prompt)", "saved full prefill", cell("ttft_vs_full_prefill", 1), qs, settings, cpu],
        [model, f"whole {LONGEST}-token answer", "saved full prefill", cell(f"t{LONGEST}_vs_full_prefill"), qs, settings, cpu],
        [model, f"whole {LONGEST}-token answer", "llama.cpp Q8_0", cell(f"t{LONGEST}_vs_{REFERENCE}"), qs, settings, cpu],
    ]


def _agreement_rows(res: Results, case: headline.Case) -> list[list[str]]:
    rows = headline.headline_rows(case, res.rows(headline.rows_file(case)))
    entry = next(e for e in fidelity_summarize(rows) if e["dataset"] == "all")
    tokens = FidelityConfig.max_new_tokens
    return [
        [
            NAMES.get(case.model, case.model),
            f"same {tokens}-token answer (HotpotQA, MuSiQue)",
            "full prefill",
            pct_ci(entry["agree"], entry["agree_ci"]) + " of questions",
            f"{entry['n']}",
            _settings(rows),
            provenance.machine_label(rows),
        ]
    ]


def readme_table(res: Results) -> str:
    out: list[list[str]] = []
    for case in headline.CASES:
        out += _whole_rows(res, case) if case.kind == "whole_answer" else _agreement_rows(res, case)
    head = ["model", "measured", "against", "CacheBlend, default settings", "questions", "rows made with", "CPU"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in out])


# Short names of the cases' models in the values' keys (``headline.smollm2.first_token``).
SHORT = {"smollm2": "smollm2", "qwen2.5-coder-0.5b": "qwen05"}


def headline_values(res: Results) -> dict[str, Stat]:
    """The README table's figures, for prose elsewhere (the tutorials, how-it-works): per model
    ``<model>.first_token``, ``<model>.whole`` (the longest answer, against the saved full prefill)
    and ``<model>.vs_llama`` (against llama.cpp Q8_0); ``agreement`` (the default's answers)."""
    v: dict[str, Stat] = {}
    for case in headline.CASES:
        rows = headline.headline_rows(case, res.rows(headline.rows_file(case)))
        if case.kind == "whole_answer":
            blend = headline.pick_default({r["method"] for r in rows})
            summary = {e["method"]: e for e in whole_summarize(rows, case.lengths, REFERENCE)}
            e = summary[blend]
            m = SHORT[case.model]
            for key, field in (
                ("first_token", "ttft_vs_full_prefill"),
                ("whole", f"t{LONGEST}_vs_full_prefill"),
                ("vs_llama", f"t{LONGEST}_vs_{REFERENCE}"),
            ):
                v[f"{m}.{key}"] = Stat(e[field], e[f"{field}_ci"])
            # On the machine of these rows: llama.cpp Q8_0's prompt evaluation against the saved full
            # prefill (times slower: the full prefill's first-token speed-up over it), and the
            # default's decode step against llama.cpp Q8_0's.
            full = next(e for name, e in summary.items() if name.startswith("full_recompute_saved"))
            v[f"{m}.llama_prompt_slower"] = Stat(full[f"ttft_vs_{REFERENCE}"], full[f"ttft_vs_{REFERENCE}_ci"])
            v[f"{m}.decode_vs_llama"] = Stat(e[f"decode_vs_{REFERENCE}"])
        else:
            e = next(e for e in fidelity_summarize(rows) if e["dataset"] == "all")
            v["agreement"] = Stat(e["agree"], e["agree_ci"])
    return v


FILES = tuple(dict.fromkeys(headline.rows_file(c) for c in headline.CASES))
ASK_COST = "ask_cost_smollm2.jsonl"  # what a first and a later ask cost (docs/cli.md)
TABLES = {
    "readme-results": Table(FILES, readme_table),
    "ask-cost": Table((ASK_COST,), lambda res: ask_cost_table(res.rows(ASK_COST))),
}
# ask_cost's runs as value keys (askcost.<key>: the run's whole-process seconds, median).
ASK_KEYS = dict(zip(ASK_RUNS, ("first", "again", "new", "stream", "kept_start", "kept_again", "kept_new"), strict=True))


def ask_cost_values(res: Results) -> dict[str, Any]:
    """Each ``ask`` run's whole-process seconds (median of the repeats), and how many times sooner
    a kept process answers a later ``ask`` than an ``ask`` that loads the model (``kept_sooner``)."""
    v: dict[str, Any] = {ASK_KEYS[e["run"]]: e["wall_s"] for e in ask_cost_summarize(res.rows(ASK_COST))}
    if "again" in v and "kept_again" in v:
        v["kept_sooner"] = v["again"] / v["kept_again"]
    return v


VALUES = {"headline": Values(FILES, headline_values), "askcost": Values((ASK_COST,), ask_cost_values)}
