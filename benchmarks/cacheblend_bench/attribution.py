"""``cacheblend-rag bench --attribution``: do the chunks the question reads most hold the evidence?

Per HotpotQA question, the chunks are retrieved as every benchmark retrieves them (the question's
paragraphs and the next questions', packed into chunks of ``chunk_tokens``, the ``top_k`` most
similar to the question, best first: that is also their order in the prompt). The engine answers
in its default mode (question-guided selection at the default ratio, ``BlendConfig()``) and
reports each chunk's share of the question's attention (``stats["chunk_attention"]``,
``cacheblend_rag.blend.sources``). A chunk is relevant when it holds one of the question's supporting
paragraphs (one of HotpotQA's supporting sentences of that paragraph appears in it).

Rankings pick ``k`` chunks per question:

* ``attention``: the ``k`` chunks with the largest attention share;
* ``retriever``: the retriever's own top ``k`` (the first ``k`` in the prompt);
* ``last``: the ``k`` chunks nearest the question (the last in the prompt), a position-only
  reference: attention that only favoured recent text would match it;
* ``attention_vs_position``: the largest shares divided by the mean share at their place in the
  prompt over the other questions (leave-one-out): whether attention carries a signal beyond
  position (an analysis, not something the engine reports: it needs the other questions);
* ``random``: the expected scores of ``k`` chunks drawn at random.

For each: precision@k (relevant chunks among the ``k``, over ``k``), recall@k (supporting
paragraphs inside the ``k`` chunks, over those inside any retrieved chunk; questions whose
retrieved chunks hold none are left out of recall) and hit@1 (the first chunk is relevant), with
paired bootstrap intervals of attention minus retriever and an exact sign test. Rows (one per
question, resumable) go to ``attribution.jsonl``; no timing is measured, so a busy machine is fine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from cacheblend_bench import datasets as ds
from cacheblend_bench.runner import BenchConfig, load_engine, read_results
from cacheblend_bench.stats import bootstrap_mean_ci, sign_test
from cacheblend_rag.blend.sources import STATS_KEY

ROWS = "attribution.jsonl"
RANKINGS = ("attention", "retriever", "last", "attention_vs_position", "random")
METRICS = ("precision", "recall", "hit1")
# (ranking, against): the paired comparisons the summary makes.
COMPARISONS = (
    ("attention", "retriever"),
    ("attention", "last"),
    ("attention_vs_position", "retriever"),
    ("attention_vs_position", "random"),
)


@dataclass
class AttributionConfig:
    """What to run: ``n`` HotpotQA dev questions from question ``offset`` on (the quality pages
    report held-out questions from 3000 on; keep them apart), ``top_k`` chunks of at most
    ``chunk_tokens`` tokens, scored at ``k``."""

    model: str = "qwen2.5-coder-0.5b"
    n: int = 200
    offset: int = 0
    top_k: int = 6
    chunk_tokens: int = 512
    k: int = 2
    out_dir: str = "attribution-results"
    hotpotqa: str | None = None
    device: str = "cpu"
    progress: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.k < self.top_k:
            raise ValueError(
                f"k={self.k} must be between 1 and top_k - 1 ({self.top_k - 1}): with k >= top_k every ranking picks every chunk"
            )


def support_titles_in(chunk: str, example: ds.Example) -> list[str]:
    """The supporting paragraphs (titles) of ``example`` that ``chunk`` holds: those with one of
    their supporting sentences inside it."""
    return sorted({t for t, s in zip(example.support_titles, example.supports) if s and s in chunk})


def run_attribution(cfg: AttributionConfig, *, engine=None) -> list[dict]:
    """Answer each question not yet in ``<out_dir>/attribution.jsonl`` and append its row."""
    from cacheblend_rag.config import BlendConfig

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ROWS
    rows = [r for r in read_results(path) if r["model"] == cfg.model]
    done = {r["qid"] for r in rows}
    examples = [ex for ex in ds.load_hotpotqa(cfg.hotpotqa, cfg.n, offset=cfg.offset) if ex.qid not in done]
    if not examples:
        return rows
    own = engine is None
    if own:
        engine = load_engine(BenchConfig(model=cfg.model, out_dir=str(out), device=cfg.device))
    try:
        retriever = ds.Retriever()
        count = ds.token_counter(engine.tokenizer)
        with path.open("a", encoding="utf-8") as sink:
            for ex in tqdm(examples, desc=f"attribution {cfg.model}", unit="question", disable=not cfg.progress):
                chunks = ds.retrieve(ex, retriever, count, cfg.chunk_tokens, cfg.top_k)
                engine.precompute(chunks, progress=False)  # deployment-time work, as in every benchmark
                # The default selection explicitly: a calibrated quality profile must not change it.
                res = engine.generate(ex.question, chunks, config=BlendConfig(), max_new_tokens=1)
                all_chunks = ds.chunk_documents(ex.documents, count, cfg.chunk_tokens)
                row = {
                    "model": cfg.model,
                    "dataset": ex.dataset,
                    "qid": ex.qid,
                    "top_k": cfg.top_k,
                    "chunk_tokens": cfg.chunk_tokens,
                    "strategy": res.stats.get("strategy"),
                    "recompute_ratio": res.stats.get("recompute_ratio"),
                    "attention": res.stats[STATS_KEY],
                    "supports_in_chunk": [support_titles_in(c, ex) for c in chunks],
                    "supports": len(set(ex.support_titles)),
                    # Sanity: supporting paragraphs found in any chunk of the question's documents.
                    "supports_found": len({t for c in all_chunks for t in support_titles_in(c, ex)}),
                }
                sink.write(json.dumps(row) + "\n")
                sink.flush()
                rows.append(row)
    finally:
        if own:
            engine.close()
    return rows


def position_prior(rows: list[dict]) -> list[list[float] | None]:
    """Per row, the mean attention share at each prompt place over the other rows with as many
    chunks (None where there is no other such row)."""
    sums: dict[int, list[float]] = {}
    counts: dict[int, int] = {}
    for r in rows:
        n = len(r["attention"])
        acc = sums.setdefault(n, [0.0] * n)
        for i, a in enumerate(r["attention"]):
            acc[i] += a
        counts[n] = counts.get(n, 0) + 1
    out: list[list[float] | None] = []
    for r in rows:
        n, others = len(r["attention"]), counts[len(r["attention"])] - 1
        out.append([(sums[n][i] - r["attention"][i]) / others for i in range(n)] if others else None)
    return out


def ranking(row: dict, name: str, k: int, prior: Sequence[float] | None = None) -> list[int]:
    """The ``k`` chunk positions a ranking picks, best first (ties by prompt position); ``prior``:
    ``attention_vs_position``'s mean share per place."""
    n = len(row["attention"])
    if name == "attention":
        return sorted(range(n), key=lambda i: (-row["attention"][i], i))[:k]
    if name == "attention_vs_position":
        if prior is None:
            raise ValueError("attention_vs_position needs the mean share per place (position_prior)")
        return sorted(range(n), key=lambda i: (-row["attention"][i] / max(prior[i], 1e-12), i))[:k]
    if name == "retriever":
        return list(range(min(k, n)))
    if name == "last":
        return list(range(n - 1, max(n - k, 0) - 1, -1))
    raise ValueError(f"unknown ranking {name!r}: choose one of {', '.join(RANKINGS)}")


def scores(row: dict, name: str, k: int, prior: Sequence[float] | None = None) -> dict[str, float | None]:
    """precision@k, recall@k (None when no retrieved chunk holds a supporting paragraph), hit@1."""
    holds = row["supports_in_chunk"]
    retrieved = {t for titles in holds for t in titles}
    if name == "random":  # expectations: each chunk is picked with chance k / n
        n = len(holds)
        share = sum(bool(t) for t in holds) / n
        return {"precision": share, "recall": min(k, n) / n if retrieved else None, "hit1": share}
    picked = ranking(row, name, k, prior)
    found = {t for i in picked for t in holds[i]}
    return {
        "precision": sum(bool(holds[i]) for i in picked) / len(picked),
        "recall": len(found) / len(retrieved) if retrieved else None,
        "hit1": float(bool(holds[picked[0]])),
    }


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(rows: list[dict], k: int = 2) -> dict[str, Any]:
    """Each ranking's mean precision@k, recall@k and hit@1 with bootstrap 95% intervals, and the
    paired comparison of ``attention`` against ``retriever`` and ``last``."""
    priors = position_prior(rows)
    usable = [(r, p) for r, p in zip(rows, priors) if p is not None]
    per = {name: [scores(r, name, k, p) for r, p in usable] for name in RANKINGS}
    out: dict[str, Any] = {
        "k": k,
        "questions": len(usable),
        "recall_questions": sum(s["recall"] is not None for s in per["retriever"]),
        "chunks": _mean([len(r["attention"]) for r, _ in usable]),
        "relevant_chunks": _mean([sum(bool(t) for t in r["supports_in_chunk"]) for r, _ in usable]),
        # The mean share at each place in the prompt (rows with the most common chunk count).
        "share_by_place": _shares_by_place([r for r, _ in usable]),
        "relevant_by_place": _relevant_by_place([r for r, _ in usable]),
        "rankings": {},
        "comparisons": {},
    }
    for name, ss in per.items():
        entry = {}
        for m in METRICS:
            vals = [s[m] for s in ss if s[m] is not None]
            entry[m] = _mean(vals)
            entry[f"{m}_ci"] = bootstrap_mean_ci(vals)
        out["rankings"][name] = entry
    for name, other in COMPARISONS:
        comp = {}
        for m in METRICS:
            pairs = [(a[m], b[m]) for a, b in zip(per[name], per[other]) if a[m] is not None and b[m] is not None]
            diffs = [a - b for a, b in pairs]
            wins, losses = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
            comp[m] = {
                "diff": _mean(diffs),
                "diff_ci": bootstrap_mean_ci(diffs),
                "wins": wins,
                "losses": losses,
                "ties": len(diffs) - wins - losses,
                "sign_p": sign_test(wins, losses),
            }
        out["comparisons"][f"{name}-{other}"] = comp
    return out


def _common_rows(rows: list[dict]) -> list[dict]:
    counts: dict[int, int] = {}
    for r in rows:
        counts[len(r["attention"])] = counts.get(len(r["attention"]), 0) + 1
    n = max(counts, key=lambda c: (counts[c], c)) if counts else 0
    return [r for r in rows if len(r["attention"]) == n]


def _shares_by_place(rows: list[dict]) -> list[float]:
    same = _common_rows(rows)
    return [_mean([r["attention"][i] for r in same]) for i in range(len(same[0]["attention"]))] if same else []


def _relevant_by_place(rows: list[dict]) -> list[float]:
    same = _common_rows(rows)
    return (
        [_mean([float(bool(r["supports_in_chunk"][i])) for r in same]) for i in range(len(same[0]["attention"]))] if same else []
    )


def _ci(mean: float, ci: tuple[float, float], signed: bool = False) -> str:
    f = "{:+.3f}" if signed else "{:.3f}"
    if any(math.isnan(x) for x in (mean, *ci)):
        return "–"
    return f"{f.format(mean)} [{f.format(ci[0])}, {f.format(ci[1])}]"


def _p(p: float) -> str:
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


LABELS = {
    "attention": "top {k} by the question's attention (`chunk_attention`)",
    "retriever": "the retriever's top {k} (first in the prompt)",
    "last": "the {k} chunks nearest the question (last in the prompt)",
    "attention_vs_position": "top {k} by attention over its place's mean share",
    "random": "{k} chunks at random (expected)",
}


def markdown_table(summary: dict[str, Any]) -> str:
    """Each ranking's precision, recall and hit@1, then attention against the other two (paired)."""
    k = summary["k"]
    lines = [
        f"| chunks picked | precision@{k} | recall@{k} | top chunk relevant |",
        "|---|---|---|---|",
    ]
    for name in RANKINGS:
        e = summary["rankings"][name]
        lines.append(f"| {LABELS[name].format(k=k)} | " + " | ".join(_ci(e[m], e[f"{m}_ci"]) for m in METRICS) + " |")
    lines += [
        "",
        f"| paired | precision@{k}: difference | better / worse / tie | p | recall@{k}: difference | better / worse / tie | p |",
        "|---|---|---|---|---|---|---|",
    ]
    short = {
        "attention": "attention",
        "retriever": "retriever",
        "last": "nearest",
        "attention_vs_position": "attention over place",
        "random": "random",
    }
    for name, other in COMPARISONS:
        cells = []
        for m in ("precision", "recall"):
            c = summary["comparisons"][f"{name}-{other}"][m]
            cells += [_ci(c["diff"], c["diff_ci"], signed=True), f"{c['wins']} / {c['losses']} / {c['ties']}", _p(c["sign_p"])]
        lines.append(f"| {short[name]} vs {short[other]} | " + " | ".join(cells) + " |")
    places = " | ".join(str(i + 1) for i in range(len(summary["share_by_place"])))
    lines += [
        "",
        f"| place in the prompt | {places} |",
        "|---|" + "---|" * len(summary["share_by_place"]),
        "| mean attention share | " + " | ".join(f"{x:.3f}" for x in summary["share_by_place"]) + " |",
        "| share of chunks relevant | " + " | ".join(f"{x:.2f}" for x in summary["relevant_by_place"]) + " |",
        "",
        f"{summary['questions']} questions ({summary['recall_questions']} with a supporting paragraph among the "
        f"retrieved chunks count for recall); {summary['chunks']:.1f} chunks a question, "
        f"{summary['relevant_chunks']:.2f} of them relevant on average.",
    ]
    return "\n".join(lines)


def table_from_file(path: Path, k: int = 2) -> str:
    """The docs' table from a committed rows file (``bench.doc_tables``)."""
    return markdown_table(summarize(read_results(path), k))
