"""``fidelity`` on Qwen2.5-Coder-0.5B and 1.5B, the near-tie sweep and the answer hint:
docs/quality.md and the quality numbers README and the overview pages quote."""

from __future__ import annotations

import ast
import math
import re
import statistics
from typing import Any

from cacheblend_bench import provenance
from cacheblend_bench.fidelity import (
    TABLE_COLUMNS,
    by_dataset_table,
    compare,
    comparison_table,
    markdown_table,
    summarize,
    ttft_speedup,
)
from cacheblend_bench.format_fidelity import compare_formats, markdown
from cacheblend_bench.published.fmt import Stat
from cacheblend_bench.published.results import Results, Table, Values
from cacheblend_bench.stats import sign_test

DEFAULT = "question@0.15"
TTFT_CELL = TABLE_COLUMNS["ttft"][1]
LABELS = {DEFAULT: " (default)"}
MIN_TIMED = 10  # an engine era's TTFT column needs at least this many timed questions


class Run:
    """One fidelity run's rows, its quiet-machine questions and the engine eras they fall in."""

    def __init__(self, res: Results, files: tuple[str, ...], ttft: str) -> None:
        self.files, self.ttft_file = files, ttft
        self.rows = res.rows(*files)
        self.timed = set(res.json(ttft))
        changes = sorted({c for f in files for c in provenance.of(res.folder, f).changes}, key=lambda c: c.time)
        self.changes = changes
        era = {}
        for r in self.rows:  # a question's era: when its rows were written
            key = f"{r['dataset']}/{r['qid']}"
            era[key] = max(era.get(key, 0), sum(r["time"] >= c.time for c in changes))
        self.eras = [{q for q in self.timed if era.get(q) == i} for i in range(len(changes) + 1)]
        self.summary = summarize(self.rows, self.timed)
        # TTFT per era, over that era's timed questions (eras too small to say anything are left out)
        self.era_ttft = [
            (i, {m: ttft_speedup([r for r in self.rows if r["method"] == m], qs) for m in self.methods})
            for i, qs in enumerate(self.eras)
            if len(qs) >= MIN_TIMED
        ]

    @property
    def methods(self) -> list[str]:
        return list(dict.fromkeys(r["method"] for r in self.rows))

    def era_label(self, i: int) -> str:
        if not self.changes:
            return ""
        return f"before {self.changes[0].commit}" if i == 0 else f"from {self.changes[i - 1].commit} on"

    def quoted(self) -> tuple[int | None, set[str]]:
        """The engine era whose timed questions the TTFT figures are over (the latest with at least
        MIN_TIMED of them; None when the run spans no engine change) and those questions."""
        if not self.changes or not self.era_ttft:
            return None, self.timed
        i = self.era_ttft[-1][0]
        return i, self.eras[i]

    def table(self, columns: tuple[str, ...]) -> str:
        """The fidelity table; its TTFT column over the quiet questions of one engine (``quoted``)."""
        if "ttft" not in columns:
            return markdown_table(self.summary, columns=columns, labels=LABELS)
        base = markdown_table(self.summary, columns=tuple(c for c in columns if c != "ttft"), labels=LABELS).splitlines()
        methods = [e["method"] for e in self.summary if e["dataset"] == "all"]
        _, questions = self.quoted()
        head = f"TTFT vs full prefill (`full_recompute`), {len(questions)} questions"
        cells = [TTFT_CELL({"ttft_speedup": t.value, "ttft_speedup_ci": t.ci}) for t in map(self.ttft, methods)]
        lines = [base[0] + f" {head} |", base[1] + "---|"]
        lines += [line + f" {c} |" for line, c in zip(base[2:], cells)]
        return "\n".join(lines)

    def caption(self, res: Results) -> str:
        text = provenance.caption(res.folder, (*self.files, self.ttft_file))
        i, questions = self.quoted()
        timed = sum(len(q) for q in self.eras)
        text += f" TTFT ratios over the {len(questions)} questions that ran while nothing else used the machine"
        if i is not None:
            text += f", all on one engine (the rows {self.era_label(i)})"
            if timed > len(questions):
                text += f"; the other {timed - len(questions)} timed on another engine are left out"
        return text + "."

    def entry(self, method: str, dataset: str = "all", summary: list[dict] | None = None) -> dict:
        return next(e for e in (summary or self.summary) if e["method"] == method and e["dataset"] == dataset)

    def ttft(self, method: str, era: int = -1) -> Stat:
        """The method's TTFT speed-up on an engine era with enough timed questions (the latest)."""
        t = (
            self.era_ttft[era][1][method]
            if self.era_ttft
            else ttft_speedup([r for r in self.rows if r["method"] == method], self.timed)
        )
        return Stat(t["ttft_speedup"], t["ttft_speedup_ci"])


QWEN05 = ("fidelity_qwen05.jsonl", "fidelity_qwen05_next.jsonl", "fidelity_qwen05_ttft_questions.json")
QWEN15 = ("fidelity_qwen15.jsonl", "fidelity_qwen15_ttft_questions.json")
DEV = ("fidelity_qwen05_dev_variants.jsonl", "fidelity_qwen05_dev_variants_ttft_questions.json")


def _run(res: Results, files: tuple[str, ...]) -> Run:
    """A run's rows (every .jsonl of ``files``) and its quiet-machine question list (the .json)."""
    rows = tuple(f for f in files if f.endswith(".jsonl"))
    ttft = next(f for f in files if f.endswith(".json"))
    return res.memo("fidelity:" + ",".join(files), lambda: Run(res, rows, ttft))


def _qwen05(res: Results) -> Run:
    return _run(res, QWEN05)


def _qwen15(res: Results) -> Run:
    return _run(res, QWEN15)


def _dev(res: Results) -> Run:
    return _run(res, DEV)


MAIN_COLUMNS = ("recomputed", "agree", "agree_f1", "f1_diff", "kl", "kl_vs_reuse", "kl_worse", "tf_loglik", "ttft")
PAIRS = [
    (DEFAULT, "cacheblend@0.15"),
    (DEFAULT, "full_reuse"),
    ("cacheblend@0.15", "full_reuse"),
    ("question@0.15/nb", DEFAULT),
    ("full_reuse/nb", "full_reuse"),
    ("question@0.15/nb", "full_reuse/nb"),
    ("question@0.3/nb", "question@0.15/nb"),
]


def _main_table(run_of):
    return Table(
        QWEN05 if run_of is _qwen05 else QWEN15,
        lambda res: run_of(res).table(MAIN_COLUMNS),
        caption=lambda res: run_of(res).caption(res),
    )


def _by_dataset(run_of):
    return lambda res: by_dataset_table(run_of(res).summary)


def _paired(run_of):
    return lambda res: comparison_table(run_of(res).rows, PAIRS)


# ----------------------------------------------------------------------------- corpus neighbours
CORPUS = "fidelity_qwen05_corpus_neighbours.jsonl"
CORPUS_SUFFIX = " (corpus)"


def _corpus(res: Results) -> dict[str, Any]:
    """The corpus-neighbour run's /nb rows beside the 250-question run's rows on the same questions
    (full prefill gave the same answers in both, so they pair)."""

    def compute() -> dict[str, Any]:
        corpus = res.rows(CORPUS)
        questions = {(r["dataset"], r["qid"]) for r in corpus}
        main = [r for r in _qwen05(res).rows if (r["dataset"], r["qid"]) in questions]
        mine = [dict(r, method=r["method"] + CORPUS_SUFFIX) for r in corpus if r["method"].endswith("/nb")]
        rows = main + mine
        return {"rows": rows, "summary": summarize(rows), "questions": questions, "corpus": corpus}

    return res.memo("corpus", compute)


CORPUS_ORDER = [
    "full_reuse",
    DEFAULT,
    "full_reuse/nb",
    "full_reuse/nb" + CORPUS_SUFFIX,
    "question@0.15/nb",
    "question@0.15/nb" + CORPUS_SUFFIX,
    "question@0.3/nb",
    "question@0.3/nb" + CORPUS_SUFFIX,
]


def _corpus_table(res: Results) -> str:
    s = _corpus(res)["summary"]
    lines = [
        "| method | neighbours from | answer = full prefill's | agreement F1 | F1 − full prefill's | KL / full reuse's "
        "| KL worse than full reuse | HotpotQA; MuSiQue (same answer) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    C = TABLE_COLUMNS
    for method in CORPUS_ORDER:
        e = next(x for x in s if x["method"] == method and x["dataset"] == "all")
        base = method.removesuffix(CORPUS_SUFFIX)
        source = "the corpus" if method.endswith(CORPUS_SUFFIX) else ("the prompt's chunks" if "/nb" in method else "–")
        per = "; ".join(
            f"{x['agree']:.0%}" for d in ("hotpotqa", "musique") for x in s if x["method"] == method and x["dataset"] == d
        )
        name = f"`{base}`" + (LABELS.get(base, "") if source == "–" else "")
        lines.append(
            f"| {name} | {source} | {C['agree'][1](e)} | {C['agree_f1'][1](e)} | {C['f1_diff'][1](e)} | "
            f"{C['kl_vs_reuse_plain'][1](e)} | {C['kl_worse'][1](e)} | {per} |"
        )
    return "\n".join(lines)


CORPUS_PAIRS = [
    ("full_reuse/nb" + CORPUS_SUFFIX, "full_reuse/nb"),
    ("question@0.15/nb" + CORPUS_SUFFIX, "question@0.15/nb"),
    ("question@0.3/nb" + CORPUS_SUFFIX, "question@0.3/nb"),
    ("full_reuse/nb" + CORPUS_SUFFIX, "full_reuse"),
    ("question@0.15/nb" + CORPUS_SUFFIX, DEFAULT),
    ("question@0.3/nb" + CORPUS_SUFFIX, "question@0.15/nb" + CORPUS_SUFFIX),
]


def _corpus_labels() -> dict[str, str]:
    out = {}
    for m in CORPUS_ORDER:
        base = m.removesuffix(CORPUS_SUFFIX)
        out[m] = (
            f"`{base}` (corpus)" if m.endswith(CORPUS_SUFFIX) else (f"`{base}` (prompt's chunks)" if "/nb" in m else f"`{base}`")
        )
    return out


def _corpus_paired(res: Results) -> str:
    return comparison_table(_corpus(res)["rows"], CORPUS_PAIRS, labels=_corpus_labels())


# ----------------------------------------------------------------------------- dev variants
DEV_COLUMNS = ("recomputed", "agree_plain", "agree_f1", "f1_diff", "kl_vs_reuse_plain", "kl_worse", "tf_loglik", "ttft")
DEV_VARIANTS = [
    "question@0.15/last",
    "question@0.15/max",
    "question@0.15/w2",
    "question@0.15/ape",
    "hybrid@0.15",
    "chunk@0.15",
    "cacheblend@0.15",
]


def _dev_table(res: Results) -> str:
    return markdown_table(_dev(res).summary, columns=DEV_COLUMNS)


def _dev_paired(res: Results) -> str:
    return comparison_table(
        _dev(res).rows, [(m, DEFAULT) for m in DEV_VARIANTS], metrics=("agree_f1", "kl", "tf_loglik"), against=DEFAULT
    )


# ----------------------------------------------------------------------------- the default beside /nb
def _side_by_side(res: Results) -> str:
    run = _qwen05(res)
    C = TABLE_COLUMNS
    a, b = run.entry(DEFAULT), run.entry("question@0.15/nb")
    hb = {d: run.entry("question@0.15/nb", d)["agree"] for d in ("hotpotqa", "musique")}
    t = [run.ttft(m) for m in (DEFAULT, "question@0.15/nb")]
    rows = [
        ("agreement F1", C["agree_f1"][1](a), C["agree_f1"][1](b)),
        (
            "same answer as full prefill",
            C["agree"][1](a),
            C["agree"][1](b) + f" (HotpotQA {hb['hotpotqa']:.0%}, MuSiQue {hb['musique']:.0%})",
        ),
        ("F1 against gold minus full prefill's", C["f1_diff"][1](a), C["f1_diff"][1](b)),
        ("KL as a share of full reuse's", C["kl_vs_reuse_plain"][1](a), C["kl_vs_reuse_plain"][1](b)),
        ("questions where KL is worse than full reuse's", C["kl_worse"][1](a), C["kl_worse"][1](b)),
        ("first token sooner than full prefill's (`full_recompute`) by", f"{t[0].value:.2f}x", f"{t[1].value:.2f}x"),
    ]
    lines = [
        "| measure | `question@0.15` (default settings) | `question@0.15/nb` (with `precompute(..., neighbours=2)`) |",
        "|---|---|---|",
        *(f"| {m} | {x} | {y} |" for m, x, y in rows),
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- near-ties and the hint
NEAR_TIE = "near_tie_hotpotqa3000.txt"
NEAR_TIE_ORDER = [
    "full_reuse:0",
    "full_reuse:0:nb",
    "question:0.15",
    "question:0.5",
    "question:0.15:nb",
    "question:0.3:nb",
    "question:0.5:nb",
    "question:0.75:nb",
    "question:0.9:nb",
    "chunk:0.5:nb",
]


def _near_tie(res: Results) -> dict[str, Any]:
    text = res.text(NEAR_TIE)
    full_answer = ast.literal_eval(re.search(r"^full: (.*)$", text, re.M).group(1))
    full_top = ast.literal_eval(re.search(r"^full top3: (.*)$", text, re.M).group(1))
    rows = {}
    for m in re.finditer(r"^(\S+:\S+)\s+('.*?'|\".*?\") (-?[\d.]+) (\[.*\])$", text, re.M):
        rows[m.group(1)] = (ast.literal_eval(m.group(2)), max(0.0, float(m.group(3))), ast.literal_eval(m.group(4)))
    return {"full": (full_answer, 0.0, full_top), "rows": rows}


def _method_name(key: str) -> str:
    kind, ratio, *nb = key.split(":")
    name = "full_reuse" if kind == "full_reuse" else f"{kind}@{ratio}"
    return name + ("/nb" if nb else "")


def _prob(top: list[tuple[str, float]], token: str) -> str:
    """The token's probability among the top 3, or a bound: below the third's (rounded up)."""
    p = dict(top).get(token)
    return f"{p:.3f}" if p is not None else f"< {math.ceil(round(top[-1][1] * 100, 6)) / 100:.2f}"


def _near_tie_table(res: Results) -> str:
    data = _near_tie(res)
    first, second = data["full"][2][0][0], data["full"][2][1][0]
    lines = [f'| method | answer | KL to full prefill | P("{second}") | P("{first}") |', "|---|---|---|---|---|"]
    entries = [
        ("full prefill", data["full"]),
        *(
            (f"`{_method_name(k)}`" + (" (whole chunks)" if k.startswith("chunk") else ""), data["rows"][k])
            for k in NEAR_TIE_ORDER
        ),
    ]
    for name, (answer, kl, top) in entries:
        lines.append(f"| {name} | {answer} | {kl:.3f} | {_prob(top, second)} | {_prob(top, first)} |")
    return "\n".join(lines).replace("| 0.000 |", "| 0 |", 1)


HINT = "answer_hint_hotpotqa_dev.jsonl"


def _hint(res: Results) -> dict[str, Any]:
    rows = res.rows(HINT)
    wins = sum(r["f1_hint"] > r["f1_plain"] for r in rows)
    losses = sum(r["f1_hint"] < r["f1_plain"] for r in rows)
    return {
        "n": len(rows),
        "f1": [statistics.mean(r[f"f1_{k}"] for r in rows) for k in ("plain", "hint")],
        "len": [statistics.mean(r[f"len_{k}"] for r in rows) for k in ("plain", "hint")],
        "cut": [sum(r[f"len_{k}"] >= 16 for r in rows) for k in ("plain", "hint")],
        "wins": wins,
        "losses": losses,
        "ties": len(rows) - wins - losses,
        "p": sign_test(wins, losses),
    }


def _hint_table(res: Results) -> str:
    h = _hint(res)
    rows = [
        ("F1 against the gold answers (mean)", *(f"{v:.3f}" for v in h["f1"])),
        ("answer length in tokens (mean)", *(f"{v:.1f}" for v in h["len"])),
        ("answers cut off at the 16-token budget", *(str(v) for v in h["cut"])),
    ]
    return "\n".join(
        [
            f"| full prefill, HotpotQA dev questions 0-{h['n'] - 1} | without a hint | with `SHORT_ANSWER_HINT` |",
            "|---|---|---|",
            *(f"| {a} | {b} | {c} |" for a, b, c in rows),
        ]
    )


# ----------------------------------------------------------------------------- numbers in prose
def _stat(e: dict, key: str) -> Stat:
    return Stat(e[key], tuple(e[f"{key}_ci"]) if e.get(f"{key}_ci") else None)


def _fidelity_values(run_of, pairs: list[tuple[str, str]]):
    def compute(res: Results) -> dict[str, Any]:
        run = run_of(res)
        e = {m: run.entry(m) for m in dict.fromkeys(r["method"] for r in run.rows)}
        v: dict[str, Any] = {
            "n": e[DEFAULT]["n"],
            "f1_full": e[DEFAULT]["f1_full"],
            "timed": len(run.timed),
            "n_confident": e[DEFAULT]["n_confident"],
            "with_margin": _with_margin(run.rows),
            "prompt_k": [min(r["prompt_tokens"] for r in run.rows) / 1e3, max(r["prompt_tokens"] for r in run.rows) / 1e3],
            "s_per_question": _seconds_per_question(run.rows),
        }
        for d in ("hotpotqa", "musique"):
            v[f"n_{d}"] = run.entry(DEFAULT, d)["n"]
        for m, x in e.items():
            k = m.replace("@", "").replace("/", "_").replace(".", "")
            v[f"{k}.agree"] = _stat(x, "agree")
            v[f"{k}.agree_f1"] = _stat(x, "agree_f1")
            v[f"{k}.agree_hw"] = (x["agree_ci"][1] - x["agree_ci"][0]) / 2  # half the interval's width
            v[f"{k}.agree_hw_points"] = 100 * v[f"{k}.agree_hw"]  # the same in percentage points
            v[f"{k}.agree_f1_hw"] = (x["agree_f1_ci"][1] - x["agree_f1_ci"][0]) / 2
            v[f"{k}.f1_diff"] = _stat(x, "f1_diff")
            v[f"{k}.kl"] = x["kl"]
            v[f"{k}.kl_vs_reuse"] = x.get("kl_vs_reuse", 1.0)
            v[f"{k}.kl_worse"] = x.get("kl_worse_than_reuse", 0.0)
            v[f"{k}.kl_worse_n"] = round(x.get("kl_worse_than_reuse", 0.0) * x["n"])
            v[f"{k}.ttft"] = run.ttft(m)
            v[f"{k}.agree_confident"] = x["agree_confident"]
            v[f"{k}.recomputed"] = x["recompute_fraction"]
            for d in ("hotpotqa", "musique"):
                y = run.entry(m, d)
                v[f"{k}.agree_{d}"] = y["agree"]
                v[f"{k}.agree_f1_{d}"] = y["agree_f1"]
            for n, (i, _) in enumerate(run.era_ttft):
                v[f"{k}.ttft_era{i}"] = run.ttft(m, n)
        for i, _ in run.era_ttft:
            v[f"timed_era{i}"] = len(run.eras[i])
        for a, b in pairs:
            ka, kb = (m.replace("@", "").replace("/", "_").replace(".", "") for m in (a, b))
            for metric in ("agree_f1", "kl", "tf_loglik"):
                v.update(_comparison(run.rows, a, b, metric, f"{ka}-{kb}.{metric}"))
        return v

    return compute


def _comparison(rows: list[dict], a: str, b: str, metric: str, key: str) -> dict[str, Any]:
    """``compare``'s mean difference, wins, losses and p under ``key``: computed when first quoted
    (its bootstrap is the costly part)."""
    done: dict[str, dict] = {}

    def get(field: str):
        def value():
            if "c" not in done:
                done["c"] = compare(rows, a, b, metric)
            c = done["c"]
            return {"diff": Stat(c["diff"], c["diff_ci"]), "wins": c["wins"], "losses": c["losses"], "p": c["sign_p"]}[field]

        return value

    return {key: get("diff"), f"{key}.wins": get("wins"), f"{key}.losses": get("losses"), f"{key}.p": get("p")}


def _with_margin(rows: list[dict]) -> int:
    """Questions whose rows record full prefill's first-token margin."""
    return len({(r["dataset"], r["qid"]) for r in rows if r.get("margin_full") is not None})


def _seconds_per_question(rows: list[dict]) -> float:
    """The median time between one question's last row and the next's: a question's cost for
    every method of the run (pauses in a resumed run drop out of the median)."""
    last: dict[tuple, float] = {}
    for r in rows:
        key = (r["dataset"], r["qid"])
        last[key] = max(last.get(key, 0.0), r["time"])
    times = sorted(last.values())
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def _corpus_values(res: Results) -> dict[str, Any]:
    c = _corpus(res)
    s = {(e["method"], e["dataset"]): e for e in c["summary"]}
    v: dict[str, Any] = {"n": len(c["questions"]), "s_per_question": _seconds_per_question(c["corpus"])}
    for d in ("hotpotqa", "musique"):
        v[f"n_{d}"] = sum(1 for q in c["questions"] if q[0] == d)
        rows = [r for r in c["corpus"] if r["dataset"] == d and r["method"] == "question@0.15/nb"]
        v[f"in_prompt_{d}"] = statistics.mean(r["neighbours_in_prompt"] for r in rows)
    for m in CORPUS_ORDER:
        k = m.removesuffix(CORPUS_SUFFIX).replace("@", "").replace("/", "_").replace(".", "") + (
            "_corpus" if m.endswith(CORPUS_SUFFIX) else ""
        )
        e = s[(m, "all")]
        v[f"{k}.agree"], v[f"{k}.agree_f1"] = e["agree"], e["agree_f1"]
        v[f"{k}.agree_hotpotqa"], v[f"{k}.agree_musique"] = s[(m, "hotpotqa")]["agree"], s[(m, "musique")]["agree"]
        v[f"{k}.kl_vs_reuse"], v[f"{k}.kl_worse"] = e.get("kl_vs_reuse", 1.0), e.get("kl_worse_than_reuse", 0.0)
        v[f"{k}.kl_worse_n"] = round(e.get("kl_worse_than_reuse", 0.0) * e["n"])
        v[f"{k}.kl_worse_musique_n"] = round(s[(m, "musique")].get("kl_worse_than_reuse", 0.0) * s[(m, "musique")]["n"])
    for a, b in CORPUS_PAIRS:
        key = "-".join(
            m.removesuffix(CORPUS_SUFFIX).replace("@", "").replace("/", "_").replace(".", "")
            + ("_corpus" if m.endswith(CORPUS_SUFFIX) else "")
            for m in (a, b)
        )
        for metric in ("agree_f1", "kl"):
            v.update(_comparison(c["rows"], a, b, metric, f"{key}.{metric}"))
    return v


def _dev_values(res: Results) -> dict[str, Any]:
    run = _dev(res)
    v: dict[str, Any] = {"n": run.entry(DEFAULT)["n"], "timed": len(run.timed), "f1_full": run.entry(DEFAULT)["f1_full"]}
    for m in DEV_VARIANTS:
        k = m.replace("@", "").replace("/", "_").replace(".", "")
        for metric in ("agree_f1", "kl", "tf_loglik"):
            v.update(_comparison(run.rows, m, DEFAULT, metric, f"{k}.{metric}"))
    return v


def _near_tie_values(res: Results) -> dict[str, Any]:
    data = _near_tie(res)
    top = data["full"][2]
    return {"p_first": top[0][1], "p_second": top[1][1], "kl_075": data["rows"]["question:0.75:nb"][1]}


def _hint_values(res: Results) -> dict[str, Any]:
    return _hint(res)


def _attribution(res: Results) -> str:
    from cacheblend_bench.attribution import table_from_file

    res.rows("attribution_qwen05.jsonl")  # declared as read (the caption names it)
    return table_from_file(res.folder / "attribution_qwen05.jsonl")


# ----------------------------------------------------------------------------- learned neighbours on a replayed stream
REPLAY = "neighbour_replay_smollm2.jsonl"
REPLAY_WARMUP = 50  # queries before the learned caches are judged (the first window of the table)


def _replay_table(res: Results) -> str:
    from cacheblend_bench.neighbour_replay import markdown_table as replay_table
    from cacheblend_bench.neighbour_replay import summarize as replay_summary

    return replay_table(replay_summary(res.rows(REPLAY), window=REPLAY_WARMUP))


def _replay_values(res: Results) -> dict[str, Any]:
    from cacheblend_bench.neighbour_replay import SETTINGS

    rows = sorted(res.rows(REPLAY), key=lambda r: r["query"])
    late = rows[REPLAY_WARMUP:]
    v: dict[str, Any] = {"queries": len(rows), "questions": len({r["question"] for r in rows}), "warmup": REPLAY_WARMUP}
    v["late"] = len(late)
    v["caches"] = rows[-1]["learned_caches"]
    for s in SETTINGS:
        v[f"{s}_same"] = sum(r[s]["answer_same"] for r in rows) / len(rows)
        v[f"{s}_same_late"] = sum(r[s]["answer_same"] for r in late) / len(late)
        v[f"{s}_kl_late"] = sum(r[s]["kl"] for r in late) / len(late)
    v["learned_of_favourable_late"] = v["learned_same_late"] / v["favourable_same_late"]
    diffs = [int(r["learned"]["answer_same"]) - int(r["embedding"]["answer_same"]) for r in late]
    v["learned_vs_embedding_better"], v["learned_vs_embedding_worse"] = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    v["learned_vs_embedding_p"] = sign_test(v["learned_vs_embedding_better"], v["learned_vs_embedding_worse"])
    return v


# ----------------------------------------------------------------------------- the bundled model's agreement
BUNDLED = "bench_smollm2.jsonl"  # the headline run: SmolLM2-135M, plain chunk caches, float32 weights


def _bundled_values(res: Results) -> dict[str, Any]:
    """How often the bundled model's default answer is full prefill's, in the headline run."""
    from cacheblend_bench.summary import pooled
    from cacheblend_bench.summary import summarize as bench_summarize

    rows = res.rows(BUNDLED)
    entries = bench_summarize([*pooled(rows), *rows])
    agree = {e["dataset"]: e["agreement"] for e in entries if e["method"] == DEFAULT}
    return {
        "n": sum(1 for r in rows if r["method"] == DEFAULT),
        "agree": agree["all"],
        "agree_hotpotqa": agree["hotpotqa"],
        "agree_musique": agree["musique"],
    }


# ----------------------------------------------------------------------------- a weight format's answers
FP16 = "fidelity_qwen05_fp16.jsonl"  # held-out questions, against QWEN05's float32 rows
FP16_DEV = "fidelity_qwen05_dev_fp16.jsonl"  # dev questions, against DEV's float32 rows


def _format_table(fmt: str, refs: tuple[str, ...]) -> Table:
    return Table((fmt, *refs), lambda res: markdown(compare_formats(res.rows(fmt), res.rows(*refs))))


def _format_values(fmt: str, refs: tuple[str, ...]) -> Values:
    def compute(res: Results) -> dict[str, Any]:
        c = compare_formats(res.rows(fmt), res.rows(*refs))
        d = c["full_f1_diff"]
        m = c["methods"][DEFAULT]
        return {
            "n": c["questions"],
            "full_same": c["full_same_answer"],
            "full_agree_f1": c["full_agree_f1"],
            "f1_diff": Stat(d["mean"], tuple(d["ci"])),
            "f1_p": d["p"],
            "agree_fp16": m["agree_fmt"],
            "agree_fp32": m["agree_ref"],
            "agree_f1_diff": Stat(m["agree_f1_diff"]["mean"], tuple(m["agree_f1_diff"]["ci"])),
            "agree_f1_p": m["agree_f1_diff"]["p"],
        }

    return Values((fmt, *refs), compute)


# ----------------------------------------------------------------------------- the defaults, 0.5B and 1.5B
HEADLINE_AGREEMENT = "headline_fidelity_qwen05.jsonl"
DEFAULTS15 = "fidelity_defaults_qwen15.jsonl"
DEFAULT_NB = "question@0.15/nb"


def _defaults(res: Results) -> dict[str, Any]:
    """The defaults' rows of both readers on the questions the 1.5B run answered (the 0.5B rows
    are the README's agreement case, a superset), paired by question: per reader (value key,
    name) its rows and their summary by dataset; ``both`` holds, per question, (0.5B agrees,
    1.5B agrees)."""

    def compute() -> dict[str, Any]:
        big = [r for r in res.rows(DEFAULTS15) if r["method"] == DEFAULT_NB]
        questions = {(r["dataset"], r["qid"]) for r in big}
        small = [r for r in res.rows(HEADLINE_AGREEMENT) if r["method"] == DEFAULT_NB and (r["dataset"], r["qid"]) in questions]
        agree05 = {(r["dataset"], r["qid"]): r["agree"] for r in small}
        readers = {("q05", "Qwen2.5-Coder-0.5B"): small, ("q15", "Qwen2.5-Coder-1.5B"): big}
        return {
            "readers": {k: (rows, {e["dataset"]: e for e in summarize(rows)}) for k, rows in readers.items()},
            "both": [(agree05[(r["dataset"], r["qid"])], r["agree"]) for r in big],
        }

    return res.memo("defaults15", compute)


def _defaults_table(res: Results) -> str:
    lines = [
        "| reader | questions | answer = full prefill's | HotpotQA; MuSiQue | F1 − full prefill's | full prefill's F1 "
        "| KL to full prefill (median) |",
        "|---|---|---|---|---|---|---|",
    ]
    C = TABLE_COLUMNS
    for (_, name), (rows, s) in _defaults(res)["readers"].items():
        per = "; ".join(f"{s[x]['agree']:.0%}" for x in ("hotpotqa", "musique") if x in s)
        e = s["all"]
        kl = statistics.median(r["kl"] for r in rows)
        lines.append(f"| {name} | {e['n']} | {C['agree'][1](e)} | {per} | {C['f1_diff'][1](e)} | {e['f1_full']:.3f} | {kl:.3f} |")
    return "\n".join(lines)


def _defaults_values(res: Results) -> dict[str, Any]:
    d = _defaults(res)
    v: dict[str, Any] = {}
    for (k, _), (_, s) in d["readers"].items():
        v[f"{k}.n"] = s["all"]["n"]
        v[f"{k}.agree"] = _stat(s["all"], "agree")
        v[f"{k}.f1_diff"] = _stat(s["all"], "f1_diff")
        for x in ("hotpotqa", "musique"):
            v[f"{k}.agree_{x}"] = s[x]["agree"]
            v[f"{k}.n_{x}"] = s[x]["n"]
    only15 = sum(1 for a, b in d["both"] if b and not a)
    only05 = sum(1 for a, b in d["both"] if a and not b)
    v.update({"only15": only15, "only05": only05, "p": sign_test(only15, only05)})
    return v


TABLES = {
    "neighbour-replay-smollm2": Table((REPLAY,), _replay_table),
    "fidelity-qwen05-fp16": _format_table(FP16, QWEN05[:2]),
    "fidelity-qwen05-dev-fp16": _format_table(FP16_DEV, DEV[:1]),
    "attribution-qwen05": Table(("attribution_qwen05.jsonl",), _attribution),
    "fidelity-qwen05": _main_table(_qwen05),
    "fidelity-qwen05-by-dataset": Table(QWEN05, _by_dataset(_qwen05)),
    "fidelity-qwen05-paired": Table(QWEN05, _paired(_qwen05)),
    "fidelity-qwen05-corpus": Table((CORPUS, *QWEN05), _corpus_table),
    "fidelity-qwen05-corpus-paired": Table((CORPUS, *QWEN05), _corpus_paired),
    "fidelity-qwen05-side-by-side": Table(QWEN05, _side_by_side),
    "fidelity-qwen05-dev-variants": Table(DEV, _dev_table),
    "fidelity-qwen05-dev-paired": Table(DEV, _dev_paired),
    "near-tie-hotpotqa3000": Table((NEAR_TIE,), _near_tie_table),
    "answer-hint": Table((HINT,), _hint_table),
    "fidelity-qwen15": _main_table(_qwen15),
    "fidelity-qwen15-by-dataset": Table(QWEN15, _by_dataset(_qwen15)),
    "fidelity-qwen15-paired": Table(QWEN15, _paired(_qwen15)),
    "fidelity-defaults-qwen15": Table((DEFAULTS15, HEADLINE_AGREEMENT), _defaults_table),
}


# ----------------------------------------------------------------------------- where multi-hop loses
def _multihop_values(res: Results) -> dict[str, Any]:
    """Per dataset, the default (``question@0.15/nb``, corpus neighbours): how many questions full
    prefill itself answers hesitantly (first token less than twice as likely as the second), the
    agreement on those and on the rest, and the median next-token KL to full prefill."""
    rows = [r for r in res.rows(CORPUS) if r["method"] == "question@0.15/nb"]
    out: dict[str, Any] = {}
    for dataset in ("hotpotqa", "musique"):
        mine = [r for r in rows if r["dataset"] == dataset]
        tie = [r for r in mine if r["margin_full"] < math.log(2)]
        sure = [r for r in mine if r["margin_full"] >= math.log(2)]
        out.update(
            {
                f"{dataset}_n": len(mine),
                f"{dataset}_agree": sum(r["agree"] for r in mine) / len(mine),
                f"{dataset}_near_tie": len(tie) / len(mine),
                f"{dataset}_agree_near_tie": sum(r["agree"] for r in tie) / len(tie),
                f"{dataset}_agree_sure": sum(r["agree"] for r in sure) / len(sure),
                f"{dataset}_kl_median": statistics.median(r["kl"] for r in mine),
            }
        )
    return out


RULE = {"rule": "neighbour_rule_replay_prompt_only.jsonl", "any": "neighbour_rule_replay_any_prompt.jsonl"}


def _rule_values(res: Results) -> dict[str, Any]:
    """docs/reliability.md, the neighbour rule's cost: the same replayed stream with learned caches
    served only to prompts that hold their neighbours (``rule``) and to any prompt (``any``)."""
    runs = {name: sorted(res.rows(file), key=lambda r: r["query"]) for name, file in RULE.items()}
    v: dict[str, Any] = {"n": len(runs["rule"])}
    for name, rows in runs.items():
        learned = [r["learned"] for r in rows]
        v[f"{name}.answer_same"] = sum(r["answer_same"] for r in learned)
        v[f"{name}.first_same"] = sum(r["first_same"] for r in learned)
        v[f"{name}.answer_share"] = v[f"{name}.answer_same"] / len(learned)
        v[f"{name}.kl"] = statistics.fmean(r["kl"] for r in learned)
    moved = [(a["learned"], b["learned"]) for a, b in zip(runs["rule"], runs["any"]) if a["learned"]["kl"] != b["learned"]["kl"]]
    v["other_cache"] = len(moved)
    v["other_cache_changed"] = sum(a["answer_same"] != b["answer_same"] for a, b in moved)
    return v


VALUES = {
    "replay": Values((REPLAY,), _replay_values),
    "rule": Values(tuple(RULE.values()), _rule_values),
    "fp16": _format_values(FP16, QWEN05[:2]),
    "fp16dev": _format_values(FP16_DEV, DEV[:1]),
    "q05": Values(QWEN05, _fidelity_values(_qwen05, PAIRS)),
    "q15": Values(QWEN15, _fidelity_values(_qwen15, PAIRS)),
    "corpus": Values((CORPUS, *QWEN05), _corpus_values),
    "multihop": Values((CORPUS,), _multihop_values),
    "dev": Values(DEV, _dev_values),
    "neartie": Values((NEAR_TIE,), _near_tie_values),
    "hint": Values((HINT,), _hint_values),
    "bundled": Values((BUNDLED,), _bundled_values),
    "defaults15": Values((DEFAULTS15, HEADLINE_AGREEMENT), _defaults_values),
}
