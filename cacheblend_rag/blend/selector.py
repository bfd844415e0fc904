"""HKVD token selection: score how far each recomputed token's cached KV was off (paper 4.2-4.3).

A criterion gets, for the candidate tokens recomputed on a check layer, their fresh and cached K/V
(``[kv_heads, n, head_dim]``) and, when it asks for it, the question's attention to each of them,
and returns one score per token; the highest scores are recomputed on the following layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Deviation:
    fresh_k: torch.Tensor
    fresh_v: torch.Tensor
    cached_k: torch.Tensor
    cached_v: torch.Tensor
    question_attention: torch.Tensor | None = None  # [n]: mean attention from question tokens

    def key_dev(self) -> torch.Tensor:
        return (self.fresh_k.float() - self.cached_k.float()).pow(2).sum(dim=(0, 2)).sqrt()

    def value_dev(self) -> torch.Tensor:
        return (self.fresh_v.float() - self.cached_v.float()).pow(2).sum(dim=(0, 2)).sqrt()


class Criterion(Protocol):
    needs_attention: bool

    def __call__(self, dev: Deviation) -> torch.Tensor: ...


def _criterion(needs_attention: bool) -> Callable[[Callable[[Deviation], torch.Tensor]], Callable]:
    def wrap(fn: Callable[[Deviation], torch.Tensor]):
        fn.needs_attention = needs_attention  # type: ignore[attr-defined]
        return fn

    return wrap


@_criterion(False)
def value_deviation(dev: Deviation) -> torch.Tensor:
    """The paper's choice: L2 distance between fresh and cached V."""
    return dev.value_dev()


@_criterion(False)
def key_deviation(dev: Deviation) -> torch.Tensor:
    """LMCache's choice: L2 distance between fresh and cached K (same RoPE position on both)."""
    return dev.key_dev()


@_criterion(False)
def kv_deviation(dev: Deviation) -> torch.Tensor:
    return (dev.key_dev().pow(2) + dev.value_dev().pow(2)).sqrt()


@_criterion(True)
def question_attention(dev: Deviation) -> torch.Tensor:
    """Query-aware: how much the question's tokens attend to each context token."""
    assert dev.question_attention is not None
    return dev.question_attention


@_criterion(True)
def query_weighted_value(dev: Deviation) -> torch.Tensor:
    """Value deviation weighted by the question's attention: a wrong token only matters if read."""
    assert dev.question_attention is not None
    return dev.value_dev() * dev.question_attention


CRITERIA: dict[str, Criterion] = {
    "value": value_deviation,
    "key": key_deviation,
    "kv": kv_deviation,
    "query": question_attention,
    "query_value": query_weighted_value,
}


def resolve_criterion(criterion: str | Callable) -> Criterion:
    if callable(criterion):
        if not hasattr(criterion, "needs_attention"):
            criterion.needs_attention = False  # type: ignore[attr-defined]
        return criterion  # type: ignore[return-value]
    try:
        return CRITERIA[criterion]
    except KeyError:
        raise ValueError(
            f"unknown selection criterion {criterion!r}: choose one of {', '.join(CRITERIA)} "
            "or pass a callable(Deviation) -> scores"
        ) from None


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k highest scores, ascending (ties broken by position for determinism)."""
    k = max(0, min(k, scores.numel()))
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=scores.device)
    return torch.topk(scores.float(), k, sorted=False).indices.sort().values


# ----------------------------------------------------------------------------- question-guided
def pick_tokens(scores: torch.Tensor, candidate: torch.Tensor, k: int, window: int = 0) -> torch.Tensor:
    """The ``k`` candidate positions with the highest question attention, ascending.

    scores: [L] attention per prompt position; candidate: [L] bool, the selectable positions.
    ``window`` > 0 max-pools the scores over ``2 * window + 1`` positions first, so the neighbours
    of a strongly read token rank with it (CacheClip recomputes a pick's neighbours too) while the
    budget ``k`` still holds.
    """
    s = scores.float()
    if window > 0:
        s = torch.nn.functional.max_pool1d(s[None, None], 2 * window + 1, stride=1, padding=window)[0, 0]
    cand = candidate.nonzero().flatten()
    return cand[top_k(s[cand], k)]


def pick_chunks(scores: torch.Tensor, spans: list[tuple[int, int]], budget: int) -> list[int]:
    """Indices of the chunks (``(start, end)`` spans) the question attends to most: the best one,
    then more in order of attention mass while their tokens fit in ``budget``."""
    if not spans:
        return []
    mass = torch.stack([scores[a:b].float().sum() for a, b in spans])
    order = torch.argsort(mass, descending=True, stable=True).tolist()
    chosen, used = [order[0]], spans[order[0]][1] - spans[order[0]][0]
    for i in order[1:]:
        n = spans[i][1] - spans[i][0]
        if used + n > budget:
            break
        chosen.append(i)
        used += n
    return sorted(chosen)
