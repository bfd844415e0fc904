"""Paired statistics for benchmark tables: bootstrap intervals and the sign test."""

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


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test (ties dropped): the chance of a split at least this uneven
    between two methods that are in truth equally good."""
    n, k = wins + losses, min(wins, losses)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)
