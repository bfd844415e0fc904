"""Which chunks a cross-chunk-aware cache is prefilled behind (FusionRAG's offline step).

A chunk cached alone never attended to the chunks that will sit in front of it. Retrieved chunks
are usually about the same thing, so prefilling each chunk behind its most similar chunks of the
corpus gives its K/V most of the cross-chunk context a full prefill would (docs/quality.md).
Similarity is the cosine of sentence embeddings: the bundled all-MiniLM-L6-v2 unless the caller
passes its own ``embed``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cacheblend_rag.embedder import Embedder, bundled_embedder

__all__ = ["Embedder", "bundled_embedder", "nearest"]


def nearest(texts: Sequence[str], n: int, embed: Embedder | None = None, corpus: Sequence[str] | None = None) -> list[list[int]]:
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
    return [
        [j for j, s in zip(reversed(idx), reversed(val)) if s != -float("inf")]
        for idx, val in zip(top.indices.tolist(), top.values.tolist())
    ]


def _embedded(embed: Embedder, texts: list[str]) -> torch.Tensor:
    """``embed(texts)``, checked and L2-normalised: [len(texts), dim]."""
    emb = torch.as_tensor(embed(texts)).float()
    if emb.dim() != 2 or emb.shape[0] != len(texts):
        raise ValueError(f"embed returned shape {tuple(emb.shape)}; expected [{len(texts)}, dim]")
    return torch.nn.functional.normalize(emb, dim=-1)
