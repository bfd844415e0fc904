"""``cacheblend-rag sweep``: every prefill mode side by side on MuSiQue, with a ratio/criterion sweep.

For each question the same chunks go through full recompute (the reference), prefix caching, full
reuse and CacheBlend at each (criterion, ratio). It prints, per method, the time to first token as a
speed-up over full recompute (``stats.speedup``: full recompute's mean TTFT over the method's, on
the same questions, measured back to back so machine load affects both sides alike), the fidelity to full prefill (next-token KL, greedy answer agreement),
answer F1 against the gold answers, and CacheBlend's overhead: its prefill time over the share of
work it recomputes times the full prefill time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from cacheblend_bench.datasets import Example, Retriever, chunk_documents, load_musique, token_counter
from cacheblend_bench.methods import answer_with_logits, settle
from cacheblend_bench.provenance import engine_stamp
from cacheblend_bench.stats import speedup
from cacheblend_rag.cli.paths import data_file
from cacheblend_rag.config import BlendConfig
from cacheblend_rag.engine.core import CacheBlendEngine, GenerationResult
from cacheblend_rag.metrics import next_token_kl, qa_f1


@dataclass
class SweepConfig:
    musique: Path | None = None  # None: $CACHEBLEND_RAG_MUSIQUE (see paths.data_file)
    questions: int = 20
    num_chunks: int = 6  # top-k retrieved chunks per question (paper: 6)
    chunk_tokens: int = 512  # paper: 512-token chunks
    ratios: Sequence[float] = (0.05, 0.15, 0.3, 0.5)
    criteria: Sequence[str] = ("value", "key", "query_value")
    filter_layers: Sequence[int] = (3,)
    boundary_tokens: Sequence[int] = (0,)
    baselines: Sequence[str] = ("prefix_caching", "full_reuse")
    max_new_tokens: int = 24
    repeats: int = 1  # rounds of every method per question; times are medians over rounds
    out: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats={self.repeats!r} must be an int >= 1 (rounds of every method per question)")


def question_chunks(example: Example, tokenizer, cfg: SweepConfig, retriever: Retriever) -> list[str]:
    """The example's passages packed into ``chunk_tokens`` chunks, top-k retrieved, best first."""
    chunks = chunk_documents(example.documents, token_counter(tokenizer), cfg.chunk_tokens)
    return retriever.top_k(example.question, chunks, cfg.num_chunks)


def _methods(cfg: SweepConfig) -> list[tuple[str, str, BlendConfig | None]]:
    out: list[tuple[str, str, BlendConfig | None]] = [(m, m, None) for m in cfg.baselines]
    variants = [(f, b) for f in cfg.filter_layers for b in cfg.boundary_tokens]
    for crit in cfg.criteria:
        for r in cfg.ratios:
            for f, b in variants:
                bc = BlendConfig(recompute_ratio=r, criterion=crit, filter_layers=f, boundary_tokens=b)
                tag = f",f{f},b{b}" if len(variants) > 1 else ""
                out.append((f"cacheblend[{crit}@{r:g}{tag}]", "cacheblend", bc))
    return out


def _run_one(engine, question: str, chunks: list[str], mode: str, bc: BlendConfig | None, max_new_tokens: int):
    if max_new_tokens == 0:  # fidelity only: the prefill's next-token logits, no answer
        pre = engine.prefill(engine.build_layout(question, chunks), mode, bc)
        stats = dict(pre.stats, ttft_s=pre.stats["prefill_s"])
        return GenerationResult("", [], stats["ttft_s"], stats["ttft_s"], "length", stats), pre.logits
    return answer_with_logits(engine, question, chunks, mode=mode, config=bc, max_new_tokens=max_new_tokens, stop=["\n"])


def run_sweep(engine, cfg: SweepConfig, progress: bool = True) -> list[dict]:
    retriever = Retriever()
    examples = load_musique(data_file("musique", cfg.musique), cfg.questions)
    methods = [("full_recompute", "full_recompute", None), *_methods(cfg)]
    rows: list[dict] = []
    out = open(cfg.out, "w") if cfg.out else None
    for qi, ex in enumerate(tqdm(examples, desc="sweep", unit="question", disable=not progress)):
        chunks = question_chunks(ex, engine.tokenizer, cfg, retriever)
        engine.precompute(chunks, progress=False)  # a deployment precomputes; not part of TTFT
        engine.flush()
        first: dict[str, tuple[GenerationResult, Any]] = {}
        ttft: dict[str, list[float]] = {name: [] for name, _, _ in methods}
        prefill: dict[str, list[float]] = {name: [] for name, _, _ in methods}
        # Every method once per round, rounds back to back: a slow spell of the machine hits all
        # methods of a round alike, and the median over rounds drops it.
        for rnd in range(cfg.repeats):
            for name, mode, bc in methods:
                res, logits = _run_one(engine, ex.question, chunks, mode, bc, cfg.max_new_tokens)
                settle(engine, res.stats.get("writeback_keys", []), keep=rnd + 1 == cfg.repeats)
                first.setdefault(name, (res, logits))
                ttft[name].append(res.ttft_s)
                prefill[name].append(res.stats["prefill_s"])
        ref, ref_logits = first["full_recompute"]
        ref_ttft, ref_prefill = statistics.median(ttft["full_recompute"]), statistics.median(prefill["full_recompute"])
        base = dict(question=qi, prompt_tokens=ref.stats["prompt_tokens"])
        for name, mode, _ in methods:
            res, logits = first[name]
            frac = res.stats["recompute_fraction"]
            work = res.stats.get("compute_fraction", frac)
            ttft_s, pre_s = statistics.median(ttft[name]), statistics.median(prefill[name])
            rows.append(
                dict(
                    base,
                    method=name,
                    ttft_ratio=ttft_s / ref_ttft,
                    kl=next_token_kl(ref_logits, logits),
                    # Without answers, agreement is on the greedy next token.
                    agree=float(
                        res.token_ids == ref.token_ids if cfg.max_new_tokens else int(logits.argmax()) == int(ref_logits.argmax())
                    ),
                    f1=qa_f1(res.text, ex.answers),
                    answer=res.text,
                    ttft_s=ttft_s,
                    prefill_s=pre_s,
                    recompute_fraction=frac,
                    compute_fraction=work,
                    overhead=pre_s / (work * ref_prefill) if mode == "cacheblend" and work else None,
                    time=time.time(),
                    engine=engine_stamp(),
                )
            )
        if out:
            for r in rows[-len(methods) :]:
                out.write(json.dumps(r) + "\n")
            out.flush()
    if out:
        out.close()
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per method: the TTFT speed-up over full recompute (``stats.speedup`` over the questions),
    fidelity to full prefill, and the overhead as a ratio of sums (prefill time over work x full
    prefill time, summed over the questions, as ``bench``'s summary computes it)."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["method"], []).append(r)
    ref_kl = {r["question"]: r["kl"] for r in by.get("full_reuse", [])}
    ref_ttft = {r["question"]: r["ttft_s"] for r in by.get("full_recompute", [])}
    table = []
    for method, rs in by.items():
        kls = [r["kl"] for r in rs]
        timed = [r for r in rs if r["question"] in ref_ttft]
        value, ci = speedup([ref_ttft[r["question"]] for r in timed], [r["ttft_s"] for r in timed])
        over = [r for r in rs if r.get("overhead")]
        table.append(
            dict(
                method=method,
                n=len(rs),
                ttft_speedup=value,
                ttft_speedup_ci=ci,
                kl_mean=statistics.fmean(kls),
                kl_median=statistics.median(kls),
                closer_than_reuse=(
                    statistics.fmean(float(r["kl"] < ref_kl[r["question"]]) for r in rs)
                    if ref_kl and method.startswith("cacheblend")
                    else None
                ),
                agree=statistics.fmean(r["agree"] for r in rs),
                f1=statistics.fmean(r["f1"] for r in rs),
                recompute_fraction=statistics.fmean(r["recompute_fraction"] for r in rs),
                compute_fraction=statistics.fmean(r.get("compute_fraction", r["recompute_fraction"]) for r in rs),
                overhead=sum(r["prefill_s"] for r in over) / sum(r["prefill_s"] / r["overhead"] for r in over) if over else None,
            )
        )
    return table


SWEEP_COLUMNS: dict[str, tuple[str, Any]] = {
    "ttft": (
        "TTFT speed-up vs full recompute",
        lambda t: (
            f"{t['ttft_speedup']:.2f}x"
            + (
                f" [{t['ttft_speedup_ci'][0]:.2f}, {t['ttft_speedup_ci'][1]:.2f}]"
                if t.get("ttft_speedup_ci") and t["ttft_speedup_ci"][0] == t["ttft_speedup_ci"][0] and t["ttft_speedup"] != 1.0
                else ""
            )
        ),
    ),
    "kl_mean": ("KL mean", lambda t: f"{t['kl_mean']:.3f}"),
    "kl_median": ("KL median", lambda t: f"{t['kl_median']:.3f}"),
    "closer": (
        "closer than full reuse",
        lambda t: "–" if t["closer_than_reuse"] is None else f"{round(t['closer_than_reuse'] * t['n'])}/{t['n']}",
    ),
    "top1": ("same top-1 token", lambda t: f"{round(t['agree'] * t['n'])}/{t['n']}"),
    "fresh": ("fresh", lambda t: f"{t['recompute_fraction']:.1%}"),
    "work": ("work", lambda t: f"{t['compute_fraction']:.1%}"),
    "overhead": ("overhead", lambda t: "–" if not t["overhead"] else f"{t['overhead']:.2f}"),
}


def markdown_table(table: list[dict], rows: Sequence[tuple[str, str]], columns: Sequence[str], bold: str | None = None) -> str:
    """The docs' sweep table: ``rows`` are (method, label) in order, ``columns`` pick from
    :data:`SWEEP_COLUMNS`, and the ``bold`` method's label is bold."""
    by = {t["method"]: t for t in table}
    head = ["method", *(SWEEP_COLUMNS[c][0] for c in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, label in rows:
        cells = [f"**{label}**" if method == bold else label, *(SWEEP_COLUMNS[c][1](by[method]) for c in columns)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_table(table: list[dict]) -> str:
    head = f"{'method':36} {'n':>3} {'TTFT x':>7} {'KL mean':>8} {'KL med':>7} {'<reuse':>6} {'agree':>6} {'F1':>6} {'fresh':>6} {'work':>6} {'ovh':>5}"
    lines = [head, "-" * len(head)]
    for t in table:
        closer = f"{t['closer_than_reuse']:.2f}" if t["closer_than_reuse"] is not None else "-"
        ovh = f"{t['overhead']:.2f}" if t["overhead"] else "-"
        lines.append(
            f"{t['method']:36} {t['n']:>3} {t['ttft_speedup']:>7.2f} {t['kl_mean']:>8.4f} {t['kl_median']:>7.4f} "
            f"{closer:>6} {t['agree']:>6.2f} {t['f1']:>6.3f} {t['recompute_fraction']:>6.3f} {t['compute_fraction']:>6.3f} {ovh:>5}"
        )
    lines.append(
        "TTFT x: full recompute's mean TTFT / the method's, same questions; KL: next-token KL(full || method);\n"
        "<reuse: share of questions where the method's KL is below full reuse's; agree: greedy answer identical\n"
        "to full prefill; fresh: token-layers whose K/V were recomputed / all; work: token-layers through\n"
        "attention and MLP / all (check layers refresh more than they compute); ovh: prefill time / (work x\n"
        "full prefill time)."
    )
    return "\n".join(lines)


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def _cmd(args: argparse.Namespace) -> int:
    musique = data_file("musique", args.musique)  # before loading the model: a missing file fails fast
    engine = CacheBlendEngine.from_pretrained(args.model, dtype=args.dtype)
    cfg = SweepConfig(
        musique=musique,
        questions=args.questions,
        num_chunks=args.chunks,
        chunk_tokens=args.chunk_tokens,
        ratios=_floats(args.ratios),
        criteria=[c for c in args.criteria.split(",") if c],
        filter_layers=[int(x) for x in args.filter_layers.split(",")],
        boundary_tokens=[int(x) for x in args.boundary_tokens.split(",")],
        baselines=[b for b in args.baselines.split(",") if b],
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        out=Path(args.out) if args.out else None,
    )
    rows = run_sweep(engine, cfg)
    table = summarize(rows)
    print(format_table(table))
    if args.out:
        Path(args.out).with_suffix(".summary.json").write_text(
            json.dumps(dict(config={k: str(v) for k, v in asdict(cfg).items()}, table=table), indent=1)
        )
    return 0


def register(sub) -> None:
    p = sub.add_parser("sweep", help="all prefill modes side by side on MuSiQue; ratio and criterion sweep")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--musique", default=None, help="MuSiQue JSON (default: $CACHEBLEND_RAG_MUSIQUE)")
    p.add_argument("--questions", type=int, default=20)
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--ratios", default="0.05,0.15,0.3,0.5")
    p.add_argument("--criteria", default="value,key,query_value")
    p.add_argument("--filter-layers", default="3", help="comma list: gradual-filtering check layers (1 = pick once)")
    p.add_argument("--boundary-tokens", default="0", help="comma list: first N tokens of each chunk always recomputed")
    p.add_argument("--baselines", default="prefix_caching,full_reuse")
    p.add_argument("--max-new-tokens", type=int, default=24, help="0: fidelity only (next-token KL), no answers")
    p.add_argument("--repeats", type=int, default=1, help="rounds of every method per question; TTFT = median over rounds")
    p.add_argument("--out", default=None, help="JSONL of per-question rows (+ .summary.json)")
    p.set_defaults(func=_cmd)
