"""Paired statistics for benchmark tables: the speed-up, bootstrap intervals and the sign test,
from SciPy (imported on first use: the ``cacheblend-rag`` command imports this module to list its
subcommands, and should start without paying for SciPy).

**Speed-up**, everywhere in this package and its docs: the reference's mean time over the method's
mean time on the same questions (a ratio of means, ``sum(reference) / sum(method)``; > 1: the
method is faster), with a percentile bootstrap 95% interval that resamples the questions as pairs
(:func:`speedup`). Per-question times may themselves be medians over repeated rounds
(``bench --repeats``, ``sweep --repeats``); the speed-up over questions is always this ratio.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

NAN_CI = (float("nan"), float("nan"))


def _bootstrap(data: tuple[np.ndarray, ...], statistic, reps: int, seed: int, paired: bool = False) -> tuple[float, float]:
    from scipy import stats

    res = stats.bootstrap(
        data,
        statistic,
        n_resamples=reps,
        confidence_level=0.95,
        method="percentile",
        paired=paired,
        vectorized=True,
        rng=np.random.default_rng(seed),
    )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def bootstrap_mean_ci(values: Sequence[float], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the mean (paired data: pass the differences); NaNs are
    dropped, and fewer than two values give (nan, nan)."""
    v = np.array([x for x in values if not math.isnan(x)], dtype=np.float64)
    if v.size < 2:
        return NAN_CI
    return _bootstrap((v,), np.mean, reps, seed)


def ratio_ci(num: Sequence[float], den: Sequence[float], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of ``sum(num) / sum(den)`` over paired items (a ratio of
    means, e.g. full prefill's mean TTFT over a method's on the same questions)."""
    a, b = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    if a.size < 2:
        return NAN_CI
    return _bootstrap((a, b), lambda x, y, axis=-1: x.sum(axis) / y.sum(axis), reps, seed, paired=True)


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
    if wins + losses == 0:
        return 1.0
    from scipy import stats

    return float(stats.binomtest(wins, wins + losses, 0.5).pvalue)
