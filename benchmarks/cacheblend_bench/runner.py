"""Run the benchmark: every (dataset, question, top-k, method) case once, resumable.

Per question the same chunks (token-bounded, top-k by MiniLM retrieval, in retrieval order) go to
every method, back to back, so machine noise hits all methods alike. KV modes find the chunks'
caches precomputed (not timed), as a deployment that caches its corpus would. Each finished case
is appended to ``results.jsonl``; a rerun skips finished cases. The summary (JSON + CSV) and the
plots are rebuilt from all finished cases at the end.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from cacheblend_bench import datasets as ds
from cacheblend_bench.baselines import make_baseline
from cacheblend_bench.methods import DEFAULT_METHODS, DEFAULT_RATIOS, Method, parse_methods, run_kv
from cacheblend_bench.provenance import engine_stamp
from cacheblend_bench.summary import summarize, write_summary
from cacheblend_rag.metrics import next_token_kl, qa_f1

log = logging.getLogger(__name__)

SUMMARY_INSTRUCTION = (
    "You are a helpful assistant. Answer the request using the documents the user gives. Reply with one or two sentences."
)


@dataclass
class BenchConfig:
    """What to run. Defaults are the paper's set-up where this machine allows it.

    model: "smollm2" (bundled SmolLM2-135M-Instruct), "qwen2.5-coder-0.5b" or "qwen2.5-coder-1.5b" (see bench.qwen),
        "tiny" (random test model: mechanics only), or a model dir / .gguf / hub id.
    datasets: any of musique, hotpotqa, aclsum, crosschunk.
    n: questions per dataset (the first n of each file; crosschunk generates n).
    chain_n: run the LangChain chains (map_reduce, map_rerank) only on the first ``chain_n`` of
        those questions (None: all n); the other methods still run on all n. The summary's TTFT ratios
        pair questions, so a chain's ratio covers only the questions it ran.
    methods: method specs (see bench.methods); "cacheblend" expands over ``ratios``.
    top_ks: numbers of retrieved chunks; several values give the chunks sweep (paper: 6).
    chunk_tokens: chunk size in tokens (paper: 512).
    max_new_tokens / summary_max_new_tokens: answer budget for QA / summaries (greedy).
    chain_max_new_tokens: budget of each LangChain map call (their replies quote text).
    fidelity: also measure next-token KL to full prefill for the KV modes, from each method's own
        timed prefill (one extra full prefill per case only when full_recompute is not run).
    report_only: only rebuild the summary and plots from the finished cases in results.jsonl.
    repeats: run the KV methods of each case in this many back-to-back rounds and keep the median
        TTFT and latency (single runs on a busy or virtual machine swing by +-10%); the chains run
        once. Answers and KL come from round 1.
    """

    model: str = "smollm2"
    datasets: tuple[str, ...] = ds.DATASETS
    n: int = 30
    chain_n: int | None = None
    methods: tuple[str, ...] = DEFAULT_METHODS
    ratios: tuple[float, ...] = DEFAULT_RATIOS
    top_ks: tuple[int, ...] = (6,)
    chunk_tokens: int = 512
    max_new_tokens: int = 32
    summary_max_new_tokens: int = 64
    chain_max_new_tokens: int = 64
    out_dir: str = "bench-results"
    musique: str | None = None
    hotpotqa: str | None = None
    aclsum: str | None = None
    seed: int = 0
    fidelity: bool = True
    plots: bool = True
    progress: bool = True
    device: str = "cpu"
    report_only: bool = False  # rebuild summary and plots from results.jsonl; run nothing
    repeats: int = 1  # timing rounds of the KV methods per case; TTFT/latency are their medians
    answer_hint: str = ""  # a line after each question (CacheBlendEngine(answer_hint=...)); "" none
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats={self.repeats!r} must be an int >= 1 (timing rounds of the KV methods per case)")


# The tiny test model's byte-level tokenizer turns LangChain's few-shot combine prompt into ~4.3k
# tokens; the bench's tiny model gets a context window that holds it (RoPE has no position table,
# so the weights are the same as testing.make_engine's).
TINY_CONTEXT = 8192


def tiny_engine(store_dir: str | None = None, weights: str = "fp32", kv_format: str | None = None):
    """``testing.make_engine("llama")``'s random model with an ``TINY_CONTEXT``-token window."""
    from cacheblend_rag.engine.core import CacheBlendEngine
    from cacheblend_rag.model.weights import apply_weight_format
    from cacheblend_rag.store.disk import KVStore
    from cacheblend_rag.testing import make_model, make_tokenizer

    model = apply_weight_format(make_model("llama", max_position_embeddings=TINY_CONTEXT), weights)
    return CacheBlendEngine(model, make_tokenizer(), store=KVStore(store_dir, kv_format=kv_format))


def model_path(model: str) -> str | None:
    """What ``from_pretrained`` and ``cacheblend-rag --model`` take for a benchmark model name: None
    for the bundled SmolLM2, the assembled GGUF for a Qwen name (``bench.qwen``), else ``model``."""
    from cacheblend_bench.qwen import MODELS, qwen_gguf_path

    if model in ("smollm2", "default", ""):
        return None
    return str(qwen_gguf_path(model=MODELS[model])) if model in MODELS else model


def load_engine(cfg: BenchConfig, weights: str = "fp32", store_size_limit: int = 8 * 2**30, kv_format: str | None = None):
    """The engine for ``cfg.model`` with ``weights`` (``weights.WEIGHT_FORMATS``); its KV store
    lives in ``<out_dir>/kv`` (``store_size_limit`` bytes, default ``from_pretrained``'s, so that a
    run evicts no more than a user's store would: 2 GiB evicted between the questions of a float32
    whole-answer run; formats have their own fingerprints, so they never mix) and keeps chunk
    caches in ``kv_format`` (store.quant; None: float)."""
    from cacheblend_rag.engine.core import CacheBlendEngine

    store = str(Path(cfg.out_dir) / "kv")
    if cfg.model == "tiny":
        return tiny_engine(store, weights, kv_format)
    return CacheBlendEngine.from_pretrained(
        model_path(cfg.model),
        device=cfg.device,
        weights=weights,
        store_dir=store,
        store_size_limit=store_size_limit,
        answer_hint=cfg.answer_hint,
        kv_format=kv_format,
    )


_rouge = None


def score(example: ds.Example, text: str) -> tuple[str, float]:
    """(metric name, value in [0, 1]): answer F1 for QA, Rouge-L F for summaries."""
    if example.task == "summary":
        global _rouge
        if _rouge is None:
            from rouge_score import rouge_scorer

            _rouge = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
        return "rougeL", max(_rouge.score(ref, text)["rougeL"].fmeasure for ref in example.answers)
    return "f1", qa_f1(text, example.answers)


def case_key(model: str, dataset: str, qid: str, method: str, top_k: int, chunk_tokens: int) -> str:
    return f"{model}|{dataset}|{qid}|{method}|k{top_k}|c{chunk_tokens}"


def read_results(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a killed run; that case simply runs again
    return rows


def _support_recall(example: ds.Example, chunks: Sequence[str]) -> float | None:
    if not example.supports:
        return None
    return sum(any(s in c for c in chunks) for s in example.supports) / len(example.supports)


def _warm_up(engine, methods: list[Method], llm: Any, baselines: dict[str, Any]) -> None:
    """One untimed call per method, so first-call allocations do not land in a measured case."""
    chunks = ["Warm-up text about a quiet town.", "Another short warm-up passage."]
    engine.precompute(chunks, progress=False)
    for m in methods:
        if m.is_kv:
            run_kv(engine, m, "Which town?", chunks, 2)
    for b in baselines.values():
        b.answer(engine, "Which town?", chunks, 2)
    if llm is not None:
        llm.invoke("Say hello.", max_new_tokens=2)
    engine.flush()


def _timed_rounds(
    eng, methods: list[Method], question: str, chunks: list[str], budget: int, repeats: int, on_method=lambda m: None
) -> dict[str, tuple[dict, Any]]:
    """Each KV method's row fields and prefill logits for one case, over ``repeats`` rounds.

    The methods run back to back within a round and the rounds follow each other, so machine load
    hits every method alike. Answer, fidelity and counts come from round 1 (greedy decoding repeats
    them); ``ttft_s``/``total_s`` are medians over the rounds, which are kept in
    ``ttft_rounds_s``. Prefix caching must meet the prompt first-seen in every round, as in a
    single-round run: the prefix entries a round wrote are dropped before the next round.
    """
    out: dict[str, tuple[dict, Any]] = {}
    rounds: dict[str, list[tuple[float, float]]] = {m.name: [] for m in methods}
    for rnd in range(repeats):
        for m in methods:
            on_method(m)
            res, logits = run_kv(eng, m, question, chunks, budget, keep_writeback=rnd + 1 == repeats)
            rounds[m.name].append((res["ttft_s"], res["total_s"]))
            out.setdefault(m.name, (res, logits))
    if repeats > 1:
        for name, (res, _) in out.items():
            res["ttft_rounds_s"] = [t for t, _ in rounds[name]]
            res["ttft_s"] = statistics.median(t for t, _ in rounds[name])
            res["total_s"] = statistics.median(t for _, t in rounds[name])
    return out


def run_benchmark(
    cfg: BenchConfig,
    *,
    engine_factory: Callable[[BenchConfig], Any] | None = None,
    retriever: Any = None,
) -> list[dict]:
    """Run (or resume) the benchmark; returns every finished case's row (old and new)."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    methods = parse_methods(cfg.methods, cfg.ratios)
    chain_n = cfg.n if cfg.chain_n is None else cfg.chain_n
    if chain_n < 0:
        raise ValueError(f"chain_n={chain_n} must be >= 0 (None: the same as n)")
    unchained = [m for m in methods if not m.is_chain]
    rows = read_results(results_path)
    done = {r["key"] for r in rows}

    per_dataset = [
        ds.load_dataset(
            name,
            cfg.n,
            seed=cfg.seed,
            musique=cfg.musique,
            hotpotqa=cfg.hotpotqa,
            aclsum=cfg.aclsum,
            chunk_tokens=cfg.chunk_tokens,
        )
        for name in cfg.datasets
    ]
    # Round-robin over datasets, so a run stopped early has covered every dataset about equally.
    # i: the question's index in its dataset; the chains run on the first chain_n only.
    examples = [(ex, i) for i, group in enumerate(zip_longest(*per_dataset)) for ex in group if ex is not None]
    cases = [(ex, k, methods if i < chain_n else unchained) for ex, i in examples for k in cfg.top_ks]
    cases = [c for c in cases if c[2]]
    model_name = cfg.model
    todo = []  # (example, top-k, its unfinished methods)
    for ex, k, ms in cases:
        pending = [m for m in ms if case_key(model_name, ex.dataset, ex.qid, m.name, k, cfg.chunk_tokens) not in done]
        if pending:
            todo.append((ex, k, pending))
    if todo and not cfg.report_only:
        if any(m.is_chain for _, _, ms in todo for m in ms):
            from cacheblend_bench.lc import cacheblend_llm_class

            cacheblend_llm_class()  # a missing langchain_cacheblend fails here, before the model loads
        engine = (engine_factory or load_engine)(cfg)
        try:
            rows += _run_cases(cfg, engine, retriever, methods, todo, results_path, len(cases))
        finally:
            engine.close()
    rows = [r for r in rows if r.get("model") == model_name]
    summary = summarize(rows)
    write_summary(summary, out, cfg)
    if cfg.plots and summary:
        from cacheblend_bench.plots import make_plots

        make_plots(summary, out / "plots")
    return rows


def _run_cases(cfg, engine, retriever, methods, todo, results_path: Path, total: int) -> list[dict]:
    from cacheblend_rag.engine.core import CacheBlendEngine

    retriever = retriever or ds.Retriever()
    count = ds.token_counter(engine.tokenizer)
    summary_engine = None
    if any(ex.task == "summary" for ex, _, _ in todo):
        # Same model, weights and store; only the instruction differs (it keys its own caches).
        summary_engine = CacheBlendEngine(
            engine.model,
            engine.tokenizer,
            store=engine.store,
            config=engine.config,
            instruction=SUMMARY_INSTRUCTION,
            model_id=engine.model_id,
            fingerprint=engine.fingerprint,
        )
    chains = list({m.kind: m for _, _, ms in todo for m in ms if m.is_chain}.values())
    baselines = {
        m.name: make_baseline(m.kind, m.quant, engine, cfg.model)
        for m in {m.name: m for _, _, ms in todo for m in ms if not m.is_kv and not m.is_chain}.values()
    }
    llm, built = None, {}
    if chains:
        from cacheblend_bench.lc import make_chain, make_llm, run_chain

        llm = make_llm(engine, cfg.chain_max_new_tokens)
        # The tiny test model's 400-token byte-level vocabulary blows LangChain's few-shot combine
        # prompt past any token_max (its window is TINY_CONTEXT instead).
        token_max = 10**7 if cfg.model == "tiny" else 3000
        built = {m.kind: make_chain(m.kind, llm, token_max) for m in chains}
    _warm_up(engine, methods, llm, baselines)
    new_rows: list[dict] = []
    bar = tqdm(todo, desc="bench", unit="case", disable=not cfg.progress, initial=total - len(todo), total=total)
    with results_path.open("a", encoding="utf-8") as sink:
        for ex, k, pending in bar:
            eng = summary_engine if ex.task == "summary" else engine
            budget = cfg.summary_max_new_tokens if ex.task == "summary" else cfg.max_new_tokens
            chunks = ds.retrieve(ex, retriever, count, cfg.chunk_tokens, k)
            if any(m.is_kv for m in pending):
                eng.precompute(chunks, progress=False)  # deployment-time work, not part of TTFT
                eng.flush()
            # The reference for KL is full recompute's own timed prefill when it runs in this
            # case (it runs first), else one extra untimed full prefill.
            ref_logits = None
            pending = sorted(pending, key=lambda m: m.mode != "full_recompute")
            if cfg.fidelity and any(m.is_kv for m in pending) and pending[0].mode != "full_recompute":
                ref_logits = eng.next_token_logits(ex.question, chunks, "full_recompute")
            base = {
                "model": cfg.model,
                "dataset": ex.dataset,
                "qid": ex.qid,
                "top_k": k,
                "chunk_tokens": cfg.chunk_tokens,
                "task": ex.task,
                "question": ex.question,
                "gold": ex.answers[0],
                "num_chunks": len(chunks),
                "support_recall": _support_recall(ex, chunks),
            }
            kv_results = _timed_rounds(
                eng,
                [m for m in pending if m.is_kv],
                ex.question,
                chunks,
                budget,
                cfg.repeats,
                lambda m: bar.set_postfix_str(f"{ex.dataset} {m.name}"),  # noqa: B023 - called in this iteration
            )
            for m in pending:
                if m.is_kv:
                    res, logits = kv_results[m.name]
                    if cfg.fidelity and m.mode == "full_recompute" and ref_logits is None:
                        ref_logits = logits
                    if ref_logits is not None:
                        res["kl"] = next_token_kl(ref_logits, logits)
                elif m.name in baselines:
                    bar.set_postfix_str(f"{ex.dataset} {m.name}")
                    a = baselines[m.name].answer(eng, ex.question, chunks, budget)
                    res = {
                        "answer": a.text,
                        "ttft_s": a.ttft_s,
                        "total_s": a.total_s,
                        "prompt_tokens": a.prompt_tokens,
                        "generated_tokens": a.generated_tokens,
                    }
                    if ref_logits is not None:
                        res["kl"] = next_token_kl(ref_logits, a.logits)
                else:
                    bar.set_postfix_str(f"{ex.dataset} {m.name}")
                    llm.max_new_tokens = max(budget, cfg.chain_max_new_tokens)
                    r = run_chain(built[m.kind], m.kind, ex.question, chunks)
                    res = {
                        "answer": r.text,
                        "ttft_s": r.ttft_s,
                        "total_s": r.total_s,
                        "calls": r.calls,
                        "prompt_tokens": r.prompt_tokens,
                    }
                metric, quality = score(ex, res["answer"])
                row = dict(
                    base,
                    method=m.name,
                    metric=metric,
                    quality=quality,
                    **res,
                    key=case_key(cfg.model, ex.dataset, ex.qid, m.name, k, cfg.chunk_tokens),
                    time=time.time(),
                    engine=engine_stamp(),
                )
                sink.write(json.dumps(row) + "\n")
                sink.flush()
                new_rows.append(row)
    for b in baselines.values():
        b.close()
    if summary_engine is not None:
        summary_engine.close(close_store=False)  # its store is the main engine's, closed by the caller
    return new_rows
