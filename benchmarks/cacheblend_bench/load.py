"""``cacheblend-rag bench --load``: throughput and latency under concurrent RAG requests.

Closed loop: ``c`` clients each send a request, wait for its answer, and send the next, until
``requests`` answers are in. Open loop: requests arrive at a fixed mean rate (Poisson arrivals,
seeded) whether or not earlier ones are answered, as users of a shared service do. Every request
is a question drawn in turn from the dataset with its retrieved chunks (precomputed, untimed:
deployment-time work), served through a :class:`~cacheblend_rag.serving.Batcher`, once with
``max_batch=1`` (one answer at a time, as the engine alone serves) and once batched.

Per setting: answers/s over the wall time from the first request to the last answer, p50/p95 time
to first token and end-to-end latency (both from the request's arrival, so they include the wait
for the worker). Rows go to ``load.jsonl``, the summary to ``load_summary.json``, a plot to
``plots/load.png``.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from cacheblend_bench import datasets as ds
from cacheblend_bench.methods import Method, parse_methods
from cacheblend_bench.provenance import engine_stamp


@dataclass
class LoadConfig:
    """What to run.

    n: distinct questions in the request pool (their chunks are precomputed before timing).
    clients: closed-loop client counts. rates: open-loop mean arrivals per second (empty: none).
    requests: answers per setting. max_batches: Batcher sizes compared (1: one answer at a time).
    """

    model: str = "smollm2"
    dataset: str = "hotpotqa"
    n: int = 16
    methods: tuple[str, ...] = ("full_recompute", "cacheblend@0.15")
    clients: tuple[int, ...] = (1, 2, 4, 8)
    rates: tuple[float, ...] = ()
    requests: int = 16
    max_batches: tuple[int, ...] = (1, 8)
    max_new_tokens: int = 32
    top_k: int = 6
    chunk_tokens: int = 512
    seed: int = 0
    out_dir: str = "load-results"
    musique: str | None = None
    hotpotqa: str | None = None
    progress: bool = True
    plots: bool = True
    device: str = "cpu"

    def __post_init__(self) -> None:
        if any(not m.is_kv for m in parse_methods(self.methods)):
            raise ValueError("--load serves engine prefill modes only (map_reduce/map_rerank run in `bench`)")
        for name in ("clients", "max_batches"):
            if any(not isinstance(v, int) or v < 1 for v in getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r}: every value must be an int >= 1")
        if any(not r > 0 for r in self.rates):
            raise ValueError(f"rates={self.rates!r}: arrival rates must be > 0 requests per second")
        if self.requests < 1 or self.n < 1:
            raise ValueError("requests and n must be >= 1")


@dataclass
class Pool:
    """The requests, each a question with its retrieved chunks, handed out in turn."""

    items: list[tuple[str, list[str]]]
    _next: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self) -> tuple[str, list[str]]:
        with self._lock:
            item = self.items[self._next % len(self.items)]
            self._next += 1
        return item


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between order statistics (NumPy's
    default; ``statistics.quantiles`` needs two values and gives no 0th or 100th); nan for none."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def _request_kwargs(method: Method, engine, cfg: LoadConfig) -> dict[str, Any]:
    return dict(mode=method.mode, config=method.blend_config(engine.config), max_new_tokens=cfg.max_new_tokens)


def closed_loop(batcher, pool: Pool, clients: int, requests: int, kwargs: dict[str, Any]) -> tuple[list[dict], float]:
    """``clients`` threads, each sending its next request once its last is answered."""
    rows: list[dict] = []
    left = [requests]
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if left[0] == 0:
                    return
                left[0] -= 1
            q, chunks = pool.take()
            res = batcher.submit(q, chunks, **kwargs).result()
            with lock:
                rows.append(_row(res))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows, time.perf_counter() - t0


def open_loop(batcher, pool: Pool, rate: float, requests: int, kwargs: dict[str, Any], seed: int) -> tuple[list[dict], float]:
    """Requests submitted at Poisson arrival times of mean ``rate`` per second."""
    rng = random.Random(seed)
    t0 = time.perf_counter()
    arrival, tickets = 0.0, []
    for _ in range(requests):
        arrival += rng.expovariate(rate)
        delay = t0 + arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        tickets.append(batcher.submit(*pool.take(), **kwargs))
    rows = [_row(t.result()) for t in tickets]
    return rows, time.perf_counter() - t0


def _row(res) -> dict:
    return {"ttft_s": res.ttft_s, "total_s": res.total_s, "tokens": len(res.token_ids), "queue_s": res.stats.get("queue_s", 0.0)}


def summarize_setting(rows: list[dict], wall_s: float) -> dict[str, float]:
    ttft, total = [r["ttft_s"] for r in rows], [r["total_s"] for r in rows]
    return {
        "answers": len(rows),
        "wall_s": wall_s,
        "answers_per_s": len(rows) / wall_s if wall_s > 0 else float("nan"),
        "tokens_per_s": sum(r["tokens"] for r in rows) / wall_s if wall_s > 0 else float("nan"),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p95": percentile(ttft, 95),
        "e2e_p50": percentile(total, 50),
        "e2e_p95": percentile(total, 95),
        "queue_p50": statistics.median(r["queue_s"] for r in rows) if rows else float("nan"),
    }


def run_load(cfg: LoadConfig, *, engine=None) -> list[dict]:
    from cacheblend_bench.runner import BenchConfig, load_engine
    from cacheblend_rag.serving import Batcher

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    own = engine is None
    if own:
        engine = load_engine(BenchConfig(model=cfg.model, out_dir=str(out), device=cfg.device))
    try:
        examples = ds.load_dataset(cfg.dataset, cfg.n, musique=cfg.musique, hotpotqa=cfg.hotpotqa, chunk_tokens=cfg.chunk_tokens)
        retriever, count = ds.Retriever(), ds.token_counter(engine.tokenizer)
        items = [(ex.question, ds.retrieve(ex, retriever, count, cfg.chunk_tokens, cfg.top_k)) for ex in examples]
        engine.precompute([c for _, chunks in items for c in chunks], progress=cfg.progress)
        engine.flush()
        methods = parse_methods(cfg.methods)
        settings = [("closed", c) for c in cfg.clients] + [("open", r) for r in cfg.rates]
        plan = [(m, b, s) for m in methods for b in cfg.max_batches for s in settings]
        summary: list[dict] = []
        with (out / "load.jsonl").open("a", encoding="utf-8") as sink:
            for method, max_batch, (kind, level) in tqdm(plan, desc="load", unit="setting", disable=not cfg.progress):
                kwargs = _request_kwargs(method, engine, cfg)
                with Batcher(engine, max_batch=max_batch) as batcher:
                    batcher.submit(*items[0], **kwargs).result()  # warm-up, untimed
                    pool = Pool(items)
                    if kind == "closed":
                        rows, wall = closed_loop(batcher, pool, int(level), cfg.requests, kwargs)
                    else:
                        rows, wall = open_loop(batcher, pool, float(level), cfg.requests, kwargs, cfg.seed)
                    mean_batch = batcher.rows_stepped / batcher.steps if batcher.steps else 0.0
                key = {
                    "model": cfg.model,
                    "dataset": cfg.dataset,
                    "method": method.name,
                    "max_batch": max_batch,
                    "load": kind,
                    "level": level,
                }
                stamp = {"engine": engine_stamp(), "time": time.time()}
                for r in rows:
                    sink.write(json.dumps(dict(key, **r, **stamp)) + "\n")
                sink.flush()
                summary.append(dict(key, **summarize_setting(rows, wall), mean_batch=mean_batch))
    finally:
        if own:
            engine.close()
    (out / "load_summary.json").write_text(json.dumps({"config": asdict(cfg), "summary": summary}, indent=2), encoding="utf-8")
    if cfg.plots and summary:
        plot_load(summary, out / "plots" / "load.png")
    return summary


def markdown_table(summary: list[dict]) -> str:
    cols = ("method", "max_batch", "load", "level", "answers_per_s", "ttft_p50", "ttft_p95", "e2e_p50", "e2e_p95", "mean_batch")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for e in summary:
        lines.append("| " + " | ".join(f"{e[c]:.3g}" if isinstance(e[c], float) else str(e[c]) for c in cols) + " |")
    return "\n".join(lines)


def plot_load(summary: list[dict], path: Path) -> None:
    from cacheblend_bench.plots import plt

    closed = [e for e in summary if e["load"] == "closed"]
    if not closed:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys((e["method"], e["max_batch"]) for e in closed):
        es = sorted((e for e in closed if (e["method"], e["max_batch"]) == name), key=lambda e: e["level"])
        label = f"{name[0]}, {'one at a time' if name[1] == 1 else f'batch {name[1]}'}"
        ax1.plot([e["level"] for e in es], [e["answers_per_s"] for e in es], marker="o", label=label)
        ax2.plot([e["level"] for e in es], [e["ttft_p95"] for e in es], marker="o", label=label)
    ax1.set(xlabel="concurrent clients", ylabel="answers / s", title="throughput")
    ax2.set(xlabel="concurrent clients", ylabel="p95 time to first token (s)", title="latency", yscale="log")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
