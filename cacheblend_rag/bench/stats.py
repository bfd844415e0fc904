"""Paired statistics for benchmark tables: the speed-up, bootstrap intervals and the sign test.

**Speed-up**, everywhere in this package and its docs: the reference's mean time over the method's
mean time on the same questions (a ratio of means, ``sum(reference) / sum(method)``; > 1: the
method is faster), with a percentile bootstrap 95% interval that resamples the questions as pairs
(:func:`speedup`). Per-question times may themselves be medians over repeated rounds
(``bench --repeats``, ``sweep --repeats``); the speed-up over questions is always this ratio.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def bootstrap_mean_ci(values: Sequence[float], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the mean (paired data: pass the differences)."""
    v = torch.tensor([x for x in values if not math.isnan(x)], dtype=torch.float64)
    if v.numel() < 2:
        return (float("nan"), float("nan"))
    g = torch.Generator().manual_seed(seed)
    means = v[torch.randint(v.numel(), (reps, v.numel()), generator=g)].mean(1)
    return float(means.quantile(0.025)), float(means.quantile(0.975))


def ratio_ci(num: Sequence[float], den: Sequence[float], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of ``sum(num) / sum(den)`` over paired items (a ratio of
    means, e.g. full prefill's mean TTFT over a method's on the same questions)."""
    a, b = torch.tensor(num, dtype=torch.float64), torch.tensor(den, dtype=torch.float64)
    if a.numel() < 2:
        return (float("nan"), float("nan"))
    idx = torch.randint(a.numel(), (reps, a.numel()), generator=torch.Generator().manual_seed(seed))
    r = a[idx].sum(1) / b[idx].sum(1)
    return float(r.quantile(0.025)), float(r.quantile(0.975))


def speedup(reference: Sequence[float], method: Sequence[float]) -> tuple[float, tuple[float, float]]:
    """The speed-up of ``method`` over ``reference``, paired by position (the same questions):
    ``sum(reference) / sum(method)`` and its bootstrap 95% interval (nan without two pairs)."""
    if len(reference) != len(method):
        raise ValueError(f"speedup needs paired times: {len(reference)} reference times, {len(method)} method times")
    if not method or sum(method) <= 0:
        return float("nan"), (float("nan"), float("nan"))
    return sum(reference) / sum(method), ratio_ci(reference, method)


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test (ties dropped): the chance of a split at least this uneven
    between two methods that are in truth equally good."""
    n, k = wins + losses, min(wins, losses)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)
