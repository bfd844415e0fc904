"""``python -m cacheblend_bench.neighbour_replay``: learned neighbours on a replayed query stream.

A pool of questions shares one corpus (the union of their chunked documents); a stream of queries
draws from the pool with Zipf-like popularity (seeded), as real traffic repeats popular questions,
and each query retrieves its top-k chunks from the whole corpus with the bundled MiniLM. Every
query is answered four ways over one shared chunk store and compared with full prefill of the same
prompt (first-token agreement, next-token KL, the greedy answer of ``max_new_tokens`` tokens):

* ``plain``: chunk caches computed alone (``BlendConfig(neighbour_caches=False)``);
* ``embedding``: each chunk also cached behind its ``neighbours`` most similar chunks of the corpus;
* ``learned``: the embedding caches as the cold start, plus ``engine.learn_neighbours`` learning
  from the stream itself (refreshes finish between queries, as between requests of a real server);
* ``favourable``: neighbours chosen among the prompt's own chunks (computed per query: the upper
  reference the learned caches are measured against).

Only ``learned`` changes over time; the other three are computed once per distinct question. Rows
go to ``<out>/replay.jsonl`` as they are made; a rerun skips the queries already there, and the
learned engine picks up its counts and caches from ``neighbours.json`` beside the store.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from cacheblend_bench import datasets as ds
from cacheblend_bench.methods import answer_with_logits
from cacheblend_bench.provenance import engine_stamp
from cacheblend_rag.config import BlendConfig
from cacheblend_rag.metrics import next_token_kl
from cacheblend_rag.neighbours.index import NeighbourIndex
from cacheblend_rag.neighbours.learned import LearnConfig

SETTINGS = ("plain", "embedding", "learned", "favourable")


@dataclass
class ReplayConfig:
    """model: as ``cacheblend-rag bench --model``. pool: distinct questions (HotpotQA dev from
    ``offset``, not the held-out questions the quality pages report on). queries: stream length.
    zipf: popularity exponent (query i draws question rank r with weight r**-zipf). top_k chunks
    of at most chunk_tokens each per query; neighbours: caches behind this many chunks.
    store_gib: the chunk store's size; it must hold every cache of the run (the default pool's
    corpus on SmolLM2 takes ~3.4 GB per kind of cache), since an evicted neighbour-aware cache
    silently becomes a plain one and the comparison would no longer be what it says."""

    model: str = "smollm2"
    pool: int = 40
    queries: int = 200
    zipf: float = 1.1
    offset: int = 1000
    top_k: int = 6
    chunk_tokens: int = 256
    neighbours: int = 2
    ratio: float = 0.15
    max_new_tokens: int = 16
    seed: int = 0
    out: str = "bench-results/neighbour-replay"
    hotpotqa: str | None = None
    store_gib: float = 32.0


def stream(cfg: ReplayConfig) -> list[int]:
    """The query stream: indices into the pool, Zipf-weighted, seeded."""
    rng = random.Random(cfg.seed)
    weights = [(r + 1) ** -cfg.zipf for r in range(cfg.pool)]
    return rng.choices(range(cfg.pool), weights=weights, k=cfg.queries)


def _answer(engine, question: str, chunks: list[str], mode: str, config: BlendConfig, n: int) -> tuple[Any, list[int], dict]:
    """(next-token logits, greedy answer ids, stats) from one prefill."""
    res, logits = answer_with_logits(engine, question, chunks, mode=mode, config=config, max_new_tokens=n, temperature=0.0)
    return logits, res.token_ids, res.stats


def run(cfg: ReplayConfig) -> Path:
    from cacheblend_bench.runner import BenchConfig, load_engine

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "replay.jsonl"
    done = {json.loads(line)["query"] for line in rows_path.open()} if rows_path.exists() else set()
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=1), encoding="utf-8")

    base = load_engine(BenchConfig(model=cfg.model, out_dir=str(out)), store_size_limit=int(cfg.store_gib * 2**30))
    count = ds.token_counter(base.tokenizer)
    examples = ds.load_hotpotqa(cfg.hotpotqa, cfg.pool, distractor_questions=0, offset=cfg.offset)
    corpus = list(dict.fromkeys(c for ex in examples for c in ds.chunk_documents(ex.documents, count, cfg.chunk_tokens)))
    retriever = ds.Retriever()
    learn = type(base)(
        base.model,
        base.tokenizer,
        store=base.store,
        fingerprint=base.fingerprint,
        answer_hint=base.prompts.answer_hint,
        pipelined=False,
    )
    fav = type(base)(
        base.model,
        base.tokenizer,
        store=base.store,
        fingerprint=base.fingerprint,
        answer_hint=base.prompts.answer_hint,
        pipelined=False,
    )
    try:
        base.precompute(corpus, neighbours=cfg.neighbours, embed=retriever.embed, progress=True)
        learn.precompute(corpus, neighbours=cfg.neighbours, embed=retriever.embed, progress=False)  # the cold start
        learner = learn.learn_neighbours(LearnConfig(neighbours=cfg.neighbours, save_every=1))
        blend = BlendConfig(recompute_ratio=cfg.ratio)
        plain = BlendConfig(recompute_ratio=cfg.ratio, neighbour_caches=False)
        fixed: dict[int, dict[str, Any]] = {}  # question -> settings that do not change over time
        with rows_path.open("a", encoding="utf-8") as rows:
            for i, q in enumerate(tqdm(stream(cfg), desc="replay", unit="query")):
                if i in done:
                    continue
                ex = examples[q]
                chunks = retriever.top_k(ex.question, corpus, cfg.top_k)
                if q not in fixed:
                    ref_logits, ref_ids, _ = _answer(base, ex.question, chunks, "full_recompute", blend, cfg.max_new_tokens)
                    fav.chunk_cache.neighbours = NeighbourIndex()
                    fav.precompute(chunks, neighbours=cfg.neighbours, embed=retriever.embed, progress=False)
                    fixed[q] = {
                        "ref": (ref_logits, ref_ids),
                        "plain": _answer(base, ex.question, chunks, "cacheblend", plain, cfg.max_new_tokens),
                        "embedding": _answer(base, ex.question, chunks, "cacheblend", blend, cfg.max_new_tokens),
                        "favourable": _answer(fav, ex.question, chunks, "cacheblend", blend, cfg.max_new_tokens),
                    }
                ref_logits, ref_ids = fixed[q]["ref"]
                results = {s: fixed[q][s] for s in ("plain", "embedding", "favourable")}
                results["learned"] = _answer(learn, ex.question, chunks, "cacheblend", blend, cfg.max_new_tokens)
                learner.wait()  # the refreshes this query queued finish before the next query
                row = {
                    "query": i,
                    "question": q,
                    "qid": ex.qid,
                    "learned_caches": learner.computed,
                    "engine": engine_stamp(),
                    "time": time.time(),
                }
                for name, (logits, ids, stats) in results.items():
                    row[name] = {
                        "first_same": int(logits.argmax()) == int(ref_logits.argmax()),
                        "answer_same": ids == ref_ids,
                        "kl": next_token_kl(ref_logits, logits),
                        "neighbour_hits": stats.get("neighbour_hits", 0),
                    }
                rows.write(json.dumps(row) + "\n")
                rows.flush()
    finally:
        learn.close(close_store=False)
        fav.close(close_store=False)
        base.close()
    return rows_path


def summarize(rows: list[dict[str, Any]], window: int = 50) -> list[dict[str, Any]]:
    """Per window of ``window`` queries: each setting's share of answers equal to full prefill's."""
    rows = sorted(rows, key=lambda r: r["query"])
    out = []
    for start in range(0, len(rows), window):
        part = rows[start : start + window]
        out.append(
            {
                "queries": f"{part[0]['query'] + 1}-{part[-1]['query'] + 1}",
                **{s: sum(r[s]["answer_same"] for r in part) / len(part) for s in SETTINGS},
                **{f"{s}_kl": sum(r[s]["kl"] for r in part) / len(part) for s in SETTINGS},
            }
        )
    return out


def markdown_table(summary: list[dict[str, Any]]) -> str:
    head = (
        "| queries | "
        + " | ".join(f"{s}: same answer" for s in SETTINGS)
        + " | "
        + " | ".join(f"{s}: KL" for s in SETTINGS)
        + " |"
    )
    lines = [head, "|" + " --- |" * (1 + 2 * len(SETTINGS))]
    for w in summary:
        lines.append(
            f"| {w['queries']} | "
            + " | ".join(f"{w[s]:.0%}" for s in SETTINGS)
            + " | "
            + " | ".join(f"{w[s + '_kl']:.3f}" for s in SETTINGS)
            + " |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, window: int = 50) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: r["query"])
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for s in SETTINGS:
        same = [float(r[s]["answer_same"]) for r in rows]
        rolling = [sum(same[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(same))]
        ax.plot(range(1, len(rows) + 1), rolling, label=s)
    ax.set_xlabel("queries served")
    ax.set_ylabel(f"same answer as full prefill\n(last {window} queries)")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cacheblend_bench.neighbour_replay", description=__doc__.split("\n\n")[0])
    for name, value in asdict(ReplayConfig()).items():
        kind = type(value) if value is not None else str
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=value)
    p.add_argument("--report-only", action="store_true", help="summarize the rows in --out without running")
    args = vars(p.parse_args(argv))
    report_only = args.pop("report_only")
    cfg = ReplayConfig(**args)
    path = Path(cfg.out) / "replay.jsonl" if report_only else run(cfg)
    rows = [json.loads(line) for line in path.open()]
    print(markdown_table(summarize(rows)))
    plot(rows, Path(cfg.out) / "replay.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
