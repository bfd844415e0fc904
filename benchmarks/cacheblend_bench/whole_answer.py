"""Whole answers: the time to the first token and to answers of fixed lengths, per method and
weight format, beside llama.cpp (``cacheblend-rag bench --whole-answer``).

A user waits for the whole answer, not the first token. Every method answers each question's
prompt greedily with decoding forced past end-of-sequence (``ignore_eos``), so all answers have
the longest length asked for and the time to every shorter length is read off the same run.
Methods: the engine's saved full prefill and CacheBlend (question-guided, 15%) in each weight
format (``weights.WEIGHT_FORMATS``), and llama.cpp in each quantisation, with and without its
prompt cache (``llama_cpp_prefix``: instruction and first chunk already evaluated).

Rows (one per question and method, resumable): ``<out>/whole_answer.jsonl``. The summary's
speed-ups are ``stats.speedup`` (ratios of means over the same questions), as everywhere;
``decode_step.json`` holds one decode step's parts against the bytes they read, per format.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from cacheblend_bench import datasets as ds
from cacheblend_bench.methods import answer_with_logits, parse_method, parse_methods, require_neighbours, settle
from cacheblend_bench.provenance import engine_stamp
from cacheblend_bench.stats import speedup
from cacheblend_rag.metrics import next_token_kl
from cacheblend_rag.store.memory import MemoryTier

ROWS = "whole_answer.jsonl"
READ_FROM = ("memory", "disk")


@dataclass
class WholeAnswerConfig:
    """``lengths``: answer lengths reported, in tokens (the longest is decoded); ``formats``: the
    engine's weight formats; ``methods``: engine methods run in every format; ``llama_cpp``:
    quantisations llama.cpp runs, each also with its prompt cache (empty: no llama.cpp);
    ``kv_format``: the format the engines' stores keep chunk caches in (store.quant);
    ``neighbours``: neighbour-aware caches behind this many chunks, chosen among every chunk of
    the run's questions of the dataset (0: none; methods with ``/nb`` need them), as ``ask`` makes
    them: in the answering process, whose engine holds the index that serves them;
    ``read_from``: where the timed calls find the chunk caches: ``"memory"``, as the question's
    precompute left them (a running application's chunks, in the engine's memory tier), or
    ``"disk"``, the memory tier emptied before each timed call (a fresh process, as each ``ask``
    is; the OS's file cache may still hold the records). Rows record the layer reads per tier."""

    model: str = "smollm2"
    datasets: Sequence[str] = ("hotpotqa", "musique")
    n: int = 30
    lengths: Sequence[int] = (32, 128, 256)
    formats: Sequence[str] = ("fp32", "fp16")
    methods: Sequence[str] = ("full_recompute_saved", "question@0.15")
    llama_cpp: Sequence[str] = ("f16", "q8_0", "q4_0")
    top_k: int = 6
    chunk_tokens: int = 512
    out_dir: str = "bench-whole-answer"
    musique: str | None = None
    hotpotqa: str | None = None
    device: str = "cpu"
    answer_hint: str = ""
    progress: bool = True
    kv_format: str = "float"
    neighbours: int = 0
    read_from: str = "memory"

    def __post_init__(self) -> None:
        if self.read_from not in READ_FROM:
            raise ValueError(f"read_from={self.read_from!r}: choose one of {', '.join(READ_FROM)}")
        require_neighbours(parse_methods(self.methods), self.neighbours, "neighbours=N")


def method_names(cfg: WholeAnswerConfig) -> list[str]:
    kv = [f"{m}/{fmt}" for fmt in cfg.formats for m in cfg.methods]
    return kv + [f"{kind}:{q}" for q in cfg.llama_cpp for kind in ("llama_cpp", "llama_cpp_prefix")]


def _row(base: dict, method: str, prompt_tokens: int, times: list[float], lengths: Sequence[int], text: str) -> dict:
    row = dict(
        base, method=method, prompt_tokens=prompt_tokens, ttft_s=times[0], answer=text[:200], times_s=[round(t, 4) for t in times]
    )
    for n in lengths:
        row[f"t{n}_s"] = times[n - 1]
    row["decode_ms_per_token"] = 1000 * (times[-1] - times[0]) / max(1, len(times) - 1)
    return row


def run_whole_answer(cfg: WholeAnswerConfig) -> list[dict]:
    """Run (or resume) the comparison; returns every finished row and writes the summary."""
    from cacheblend_bench.baselines import make_baseline
    from cacheblend_bench.runner import load_engine, read_results

    if not cfg.lengths or min(cfg.lengths) < 1:
        raise ValueError(f"lengths={tuple(cfg.lengths)}: give answer lengths of at least 1 token")
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ROWS
    rows = read_results(path)
    done = {r["key"] for r in rows}
    names = method_names(cfg)
    groups = [
        ds.load_dataset(d, cfg.n, musique=cfg.musique, hotpotqa=cfg.hotpotqa, chunk_tokens=cfg.chunk_tokens) for d in cfg.datasets
    ]
    examples = [ex for group in zip_longest(*groups) for ex in group if ex is not None]
    todo = [ex for ex in examples if any(_key(cfg, ex, m) not in done for m in names)]
    if not todo:
        write_report(rows, out, cfg)
        return rows
    longest = max(cfg.lengths)
    engines = {fmt: load_engine(cfg, weights=fmt, kv_format=cfg.kv_format) for fmt in cfg.formats}
    first = engines[cfg.formats[0]]
    llamas = {
        f"{kind}:{q}": make_baseline(kind, q, first, cfg.model)
        for q in cfg.llama_cpp
        for kind in ("llama_cpp", "llama_cpp_prefix")
    }
    retriever, count = ds.Retriever(), ds.token_counter(first.tokenizer)
    pools = ds.corpus_pools(examples, count, cfg.chunk_tokens) if cfg.neighbours else {}
    try:
        _warm_up(engines, llamas, cfg)
        # The step's parts first, on the first question, so that a run stopped early has them.
        ex = todo[0]
        chunks = ds.retrieve(ex, retriever, count, cfg.chunk_tokens, cfg.top_k)
        steps = {}
        for fmt, engine in engines.items():
            engine.precompute(chunks, progress=False)
            engine.flush()
            steps[fmt] = decode_step_parts(engine, ex.question, chunks)
        (out / "decode_step.json").write_text(json.dumps(steps, indent=1), encoding="utf-8")
        with path.open("a", encoding="utf-8") as sink:
            for ex in tqdm(todo, desc="whole answers", unit="question", disable=not cfg.progress):
                chunks = ds.retrieve(ex, retriever, count, cfg.chunk_tokens, cfg.top_k)
                base = {
                    "model": cfg.model,
                    "dataset": ex.dataset,
                    "qid": ex.qid,
                    "top_k": cfg.top_k,
                    "chunk_tokens": cfg.chunk_tokens,
                    "kv_format": cfg.kv_format,
                    "question": ex.question,
                }
                for engine in engines.values():  # deployment-time work, not timed
                    pool = pools.get(ex.dataset)
                    engine.precompute(chunks, neighbours=cfg.neighbours, corpus=pool, embed=retriever.embed, progress=False)
                    engine.flush()
                # Next-token KL of every method to float32's full prefill, untimed.
                reference = engines.get("fp32", first).next_token_logits(ex.question, chunks, "full_recompute")
                for name in names:
                    if _key(cfg, ex, name) in done:
                        continue
                    if name in llamas:
                        a = llamas[name].answer(first, ex.question, chunks, longest, ignore_eos=True)
                        row = _row(base, name, a.prompt_tokens, a.token_times_s, cfg.lengths, a.text)
                        logits = a.logits
                    else:
                        spec, fmt = name.rsplit("/", 1)
                        engine = engines[fmt]
                        method = parse_method(spec)[0]
                        if cfg.read_from == "disk":
                            empty_memory_tier(engine)
                        reads = tier_reads(engine)
                        res, logits = answer_with_logits(
                            engine,
                            ex.question,
                            chunks,
                            mode=method.mode,
                            config=method.blend_config(engine.config),
                            max_new_tokens=longest,
                            ignore_eos=True,
                        )
                        settle(engine, res.stats.get("writeback_keys", []), keep=True)
                        row = _row(base, name, res.stats["prompt_tokens"], res.token_times_s, cfg.lengths, res.text)
                        row["first_tokens"] = res.token_ids[:32]
                        # What served the chunks: a /nb row with no neighbour hit measured plain caches.
                        row.update({k: res.stats[k] for k in ("chunk_hits", "neighbour_hits") if k in res.stats})
                        row["read_from"] = cfg.read_from
                        row["tier_reads"] = {t: n - reads.get(t, 0) for t, n in tier_reads(engine).items()}
                    row["kl_vs_fp32_full_prefill"] = next_token_kl(reference, logits)
                    row["key"] = _key(cfg, ex, name)
                    row["time"], row["engine"] = time.time(), engine_stamp()
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                    rows.append(row)
    finally:
        for b in llamas.values():
            b.close()
        for engine in engines.values():
            engine.close()
    write_report(rows, out, cfg)
    return rows


def _key(cfg: WholeAnswerConfig, ex: ds.Example, method: str) -> str:
    fmt = "" if cfg.kv_format == "float" else f"|{cfg.kv_format}"  # float rows keep the keys they had
    tier = "" if cfg.read_from == "memory" else f"|from-{cfg.read_from}"
    return f"{cfg.model}|{ex.dataset}|{ex.qid}|{method}|k{cfg.top_k}|c{cfg.chunk_tokens}|n{max(cfg.lengths)}{fmt}{tier}"


def tier_reads(engine) -> dict[str, int]:
    """Layer reads each tier of the engine's store has served so far ({} for a one-tier store)."""
    stats = getattr(engine.store, "stats", None)
    return dict(getattr(stats, "tier_hits", None) or {})


def empty_memory_tier(engine) -> None:
    """Drop every chunk cache the engine's memory tier holds; the disk tier keeps them."""
    for tier in getattr(engine.store, "tiers", ()):
        if isinstance(tier.store, MemoryTier):
            tier.store.clear()


def _warm_up(engines: dict, llamas: dict, cfg: WholeAnswerConfig) -> None:
    chunks = ["Warm-up text about a quiet town.", "Another short warm-up passage."]
    for engine in engines.values():
        engine.precompute(chunks, progress=False)
        for spec in cfg.methods:
            m = parse_method(spec)[0]
            engine.generate(
                "Which town?", chunks, mode=m.mode, config=m.blend_config(engine.config), max_new_tokens=4, ignore_eos=True
            )
        engine.flush()
    for b in llamas.values():
        b.answer(next(iter(engines.values())), "Which town?", chunks, 4, ignore_eos=True)


def decode_step_parts(engine, question: str, chunks: Sequence[str], steps: int = 8) -> dict[str, Any]:
    """One decode step after a full-reuse prefill of the prompt (ms): through the model's forward
    and through the engine's fast step (``decode_step.FastDecodeStep``, where the model has one),
    and the step decoding uses split by ``torch.profiler`` into the linear layers, attention and
    the rest, beside the bytes each part must read: the linears' weights in their format and every
    layer's K and V."""
    from torch.profiler import ProfilerActivity, profile

    from cacheblend_rag.decode.cache import with_room
    from cacheblend_rag.model.backbone import cache_kwarg
    from cacheblend_rag.model.weights import Fp16Linear

    layout = engine.build_layout(question, chunks)
    model, kw = engine.model, cache_kwarg(engine.model)
    start = len(layout)

    def forward(token: int, position: int, cache: Any) -> torch.Tensor:
        with torch.inference_mode():
            out = model(
                input_ids=torch.tensor([[token]]),
                position_ids=torch.tensor([[position]]),
                use_cache=True,
                logits_to_keep=1,
                **{kw: cache},
            )
        return out.logits[0, -1]

    def timed(fn, profiled: bool = False) -> tuple[float, Any]:
        cache = with_room(engine.prefill(layout, "full_reuse").cache, 2 * steps + 1)
        fn(0, start, cache)
        prof = profile(activities=[ProfilerActivity.CPU]) if profiled else None
        if prof is not None:
            prof.__enter__()
        t0 = time.perf_counter()
        for i in range(1, steps + 1):
            fn(i, start + i, cache)
        ms = 1000 * (time.perf_counter() - t0) / steps
        if prof is not None:
            prof.__exit__(None, None, None)
        return ms, prof

    used = engine.fast_step or forward
    result: dict[str, Any] = {"prompt_tokens": start, "steps": steps, "forward_step_ms": timed(forward)[0]}
    if engine.fast_step is not None:
        result["fast_step_ms"] = timed(engine.fast_step)[0]
    step_ms = timed(used)[0]
    profiled_ms, prof = timed(used, profiled=True)
    parts = {"linear": 0.0, "attention": 0.0}
    for e in prof.key_averages():
        if e.key in ("aten::linear", "quantized::linear_dynamic_fp16"):
            parts["linear"] += e.cpu_time_total / 1000 / steps
        elif e.key == "aten::scaled_dot_product_attention":
            parts["attention"] += e.cpu_time_total / 1000 / steps
    # The profiler slows every op; each part's share of the profiled step, applied to the
    # unprofiled step, is its time.
    linear_ms, attention_ms = (step_ms * parts[p] / profiled_ms for p in ("linear", "attention"))
    weight_bytes = sum(
        m.weight.numel() * (2 if isinstance(m, Fp16Linear) else m.weight.element_size())
        for m in model.modules()
        if isinstance(m, (torch.nn.Linear, Fp16Linear))
    )
    kv_heads, head_dim = engine.kv_shape
    kv_bytes = engine.num_layers * 2 * kv_heads * (start + steps) * head_dim * torch.finfo(engine.dtype).bits // 8
    return {
        **result,
        "step_ms": step_ms,
        "linear_ms": linear_ms,
        "attention_ms": attention_ms,
        "rest_ms": step_ms - linear_ms - attention_ms,
        "weight_mb": weight_bytes / 1e6,
        "kv_mb": kv_bytes / 1e6,
        "linear_gb_s": weight_bytes / 1e6 / linear_ms if linear_ms else None,
        "attention_gb_s": kv_bytes / 1e6 / attention_ms if attention_ms else None,
    }


# ----------------------------------------------------------------------------- report
def summarize(rows: list[dict], lengths: Sequence[int], reference: str = "llama_cpp:q8_0") -> list[dict]:
    """Per method: means over its questions, and ratios of means against ``reference`` (> 1: the
    method finishes sooner) and against the saved full prefill in the same format, each over the
    questions both ran, with a 95% bootstrap interval."""
    by: dict[str, dict[str, dict]] = {}
    for r in rows:
        by.setdefault(r["method"], {})[f"{r['dataset']}|{r['qid']}"] = r
    out = []
    for method, mine in by.items():
        fmt = method.rsplit("/", 1)[1] if "/" in method else None
        full = by.get(f"full_recompute_saved/{fmt}", {}) if fmt else {}
        entry: dict[str, Any] = {
            "method": method,
            "n": len(mine),
            "prompt_tokens": statistics.mean(r["prompt_tokens"] for r in mine.values()),
            "ttft_s": statistics.mean(r["ttft_s"] for r in mine.values()),
            "decode_ms_per_token": statistics.mean(r["decode_ms_per_token"] for r in mine.values()),
            "kl_vs_fp32_full_prefill": statistics.mean(r["kl_vs_fp32_full_prefill"] for r in mine.values()),
        }
        for n in lengths:
            entry[f"t{n}_s"] = statistics.mean(r[f"t{n}_s"] for r in mine.values())
        for label, other in ((reference, by.get(reference, {})), ("full_prefill", full)):
            if other is mine or not other:
                continue
            both = sorted(set(mine) & set(other))
            fields = ["ttft", *(f"t{n}" for n in lengths)]
            for f in fields:
                entry[f"{f}_vs_{label}"], entry[f"{f}_vs_{label}_ci"] = speedup(
                    [other[q][f"{f}_s"] for q in both], [mine[q][f"{f}_s"] for q in both]
                )
            entry[f"decode_vs_{label}"] = statistics.mean(mine[q]["decode_ms_per_token"] for q in both) / statistics.mean(
                other[q]["decode_ms_per_token"] for q in both
            )
        exact = by.get("full_recompute_saved/fp32", {})
        both = [q for q in mine if q in exact and "first_tokens" in mine[q]]
        if both and mine is not exact:
            # Greedy answers' first 32 tokens against float32's full prefill: what the format and
            # the method cost in answers.
            entry["same_32_tokens_as_fp32_full_prefill"] = sum(
                mine[q]["first_tokens"] == exact[q]["first_tokens"] for q in both
            ) / len(both)
        out.append(entry)
    order = {m: i for i, m in enumerate(sorted(by, key=lambda m: (m.startswith("llama"), m)))}
    return sorted(out, key=lambda e: order[e["method"]])


def markdown_table(summary: list[dict], lengths: Sequence[int], reference: str = "llama_cpp:q8_0") -> str:
    def ratio(e: dict, f: str, label: str) -> str:
        if f"{f}_vs_{label}" not in e:
            return "-"
        lo, hi = e[f"{f}_vs_{label}_ci"]
        return f"{e[f'{f}_vs_{label}']:.2f}x [{lo:.2f}, {hi:.2f}]"

    head = [
        "method",
        "n",
        "TTFT s",
        *(f"{n} tokens s" for n in lengths),
        "ms/token",
        *(f"{n} tokens vs {reference}" for n in lengths),
        "decode time / " + reference,
        "TTFT vs full prefill",
        *(f"{n} tokens vs full prefill" for n in lengths),
        "same 32 tokens as fp32 full prefill",
        "KL to fp32 full prefill",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in summary:
        cells = [
            e["method"],
            str(e["n"]),
            f"{e['ttft_s']:.2f}",
            *(f"{e[f't{n}_s']:.2f}" for n in lengths),
            f"{e['decode_ms_per_token']:.1f}",
            *(ratio(e, f"t{n}", reference) for n in lengths),
            f"{e[f'decode_vs_{reference}']:.2f}" if f"decode_vs_{reference}" in e else "-",
            ratio(e, "ttft", "full_prefill"),
            *(ratio(e, f"t{n}", "full_prefill") for n in lengths),
            f"{e['same_32_tokens_as_fp32_full_prefill']:.0%}" if "same_32_tokens_as_fp32_full_prefill" in e else "-",
            f"{e['kl_vs_fp32_full_prefill']:.2g}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def decode_step_table(steps: dict[str, dict[str, Any]]) -> str:
    """``decode_step.json`` as a markdown table: per format, the step and its parts against bytes."""
    lines = ["| weights | step through the forward | fast step | linears | attention | the rest |", "|---|---|---|---|---|---|"]
    for fmt, p in steps.items():
        fast = f"{p['fast_step_ms']:.1f} ms" if "fast_step_ms" in p else "-"
        lines.append(
            f"| {fmt} | {p['forward_step_ms']:.1f} ms | {fast} | {p['linear_ms']:.1f} ms: {p['weight_mb']:.0f} MB at "
            f"{p['linear_gb_s']:.1f} GB/s | {p['attention_ms']:.1f} ms: {p['kv_mb']:.0f} MB at {p['attention_gb_s']:.1f} GB/s "
            f"| {p['rest_ms']:.1f} ms |"
        )
    return "\n".join(lines)


def write_report(rows: list[dict], out: Path, cfg: WholeAnswerConfig, plots: bool = True) -> list[dict]:
    """summary.json and the markdown table from the rows (no model loaded), and the latency plot."""
    rows = [r for r in rows if r.get("model") == cfg.model]
    summary = summarize(rows, cfg.lengths)
    from cacheblend_bench.summary import machine

    meta = {"config": asdict(cfg), "machine": {**machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}}
    (out / "whole_answer_summary.json").write_text(json.dumps({**meta, "summary": summary}, indent=1), encoding="utf-8")
    (out / "whole_answer.md").write_text(markdown_table(summary, cfg.lengths) + "\n", encoding="utf-8")
    if plots and rows:
        plot_latency(rows, out / "whole_answer.png")
    return summary


def plot_latency(rows: list[dict], path: Path) -> None:
    """Mean time to the n-th answer token against n, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for method in sorted({r["method"] for r in rows}, key=lambda m: (m.startswith("llama"), m)):
        series = [r["times_s"] for r in rows if r["method"] == method]
        n = min(len(s) for s in series)
        mean = [statistics.mean(s[i] for s in series) for i in range(n)]
        ax.plot(range(1, n + 1), mean, label=method, linestyle="--" if method.startswith("llama") else "-")
    ax.set_xlabel("answer length (tokens)")
    ax.set_ylabel("time to that token (s, mean over questions)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
