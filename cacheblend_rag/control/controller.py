"""The loading controller: pick the recompute ratio (and a storage tier) from an offline profile.

Paper section 5 ("the recompute ratio should not be a constant"): when the fusor recomputes layer
i while layer i+1's K/V is loading, recompute that takes no longer than the load is free. So

* ratio for a request = max(quality floor r*, the r at which recompute delay equals load delay);
* for a ratio and a context length, the cheapest tier whose load the recompute still hides.

Estimators (the paper's shape, deliberately simple; each can be replaced by a callable):

* recompute delay(r, n) = (fixed + per_ratio x r) x profiled full-prefill time of n context tokens,
  with ``fixed`` and ``per_ratio`` fitted to the fused prefill measured at a few ratios
  (``FusedCost``, ``cacheblend-rag profile``). A profile without that calibration falls back to the
  paper's r x full-prefill time (fixed 0, per_ratio 1), which under-predicts the fused path: it
  recomputes every candidate token on the first layers (gradual filtering), pays per-layer
  overheads (selection, masks, scatter) whatever r is, and each recomputed token attends over the
  whole prompt through an explicit mask, so it costs more than an average full-prefill token.
* load delay(tier, n) = KV bytes per token (as stored on the tier) x n / tier read throughput.
* contention(tier, n) = cpu_contention x the loader's CPU seconds for n tokens from the tier
  (measured: the tier read's CPU time per byte plus the layer assembly's per token). On a CPU
  device the loader thread and the recompute share the cores, so the recompute runs that much
  longer while the load is in flight; the pipelined time is about
  max(recompute(r) + contention, load), and a larger ratio is free only while
  recompute(r) <= load - contention. ``cpu_contention`` defaults to 1 on a CPU profile (every
  CPU-second of loader work delays the compute by a second: torch's intra-op parallel regions wait
  for their slowest thread) and 0 on an accelerator (the loader runs on the host).

Totals are compared, not layers: the fitted fixed part (first layers recomputed in full) is
charged against the load too, which errs on the side of a smaller ratio.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cacheblend_rag.control.device_profile import DeviceProfile, FusedCost, TierProfile, default_profile_path, fused_code_matches

__all__ = ["Decision", "DeviceProfile", "FusedCost", "LoadingController", "TierProfile"]

log = logging.getLogger(__name__)


@dataclass
class Decision:
    ratio: float  # the recompute ratio to use
    floor: float  # the quality floor r*
    equal_delay_ratio: float  # r where recompute delay == load delay (may be < floor or > 1)
    tier: str | None  # tier most of the loaded bytes come from (None: nothing loaded)
    context_tokens: int
    loaded_tokens: int
    est_load_s: float
    est_recompute_s: float  # at ``ratio`` (calibrated when the profile has a fused-cost fit)
    cheapest_tier: str | None  # cheapest tier that would still hide its load at ``ratio``
    est_contention_s: float = 0.0  # recompute slowdown from the loader sharing the cores (CPU)

    def as_stats(self) -> dict[str, Any]:
        return {
            "controller_ratio": self.ratio,
            "controller_tier": self.tier,
            "controller_equal_delay_ratio": self.equal_delay_ratio,
            "controller_est_load_s": self.est_load_s,
            "controller_est_recompute_s": self.est_recompute_s,
            "controller_est_contention_s": self.est_contention_s,
            "controller_cheapest_tier": self.cheapest_tier,
        }


RecomputeEstimator = Callable[[float, int], float]  # (ratio, context tokens) -> seconds
LoadEstimator = Callable[[str, int], float]  # (tier name, tokens loaded) -> seconds


class LoadingController:
    """Chooses recompute ratios and tiers from a ``DeviceProfile``.

    quality_floor: r*, the smallest ratio that keeps quality (paper: 0.15).
    max_ratio: the ratio never exceeds this (1.0 = full recompute of the context).
    recompute_delay / load_delay: replace the estimators (see module docstring).
    cpu_contention: seconds of recompute slowdown per CPU-second of loader work while the load is in
        flight. None: 1.0 on a CPU profile, 0.0 otherwise. 0 turns the CPU rule off.
    loader_cpu: replaces the loader CPU estimate, (tier, tokens loaded) -> CPU seconds.
    headroom: share of the hiding budget (load - contention) the ratio may spend, default 0.85.
        Overshooting the load costs time to first token one for one, undershooting only costs the
        extra recompute's quality gain; the calibrated estimate was 4-14% under the measured
        compute in `pipeline-bench` (docs/pipeline.md), and at 1.0 the controller's choice on the
        20 MB/s tier landed at 1.17x the pure load time.
    default_tier: the tier name used for a plain store that does not name itself.
    """

    def __init__(
        self,
        profile: DeviceProfile,
        *,
        quality_floor: float = 0.15,
        max_ratio: float = 1.0,
        recompute_delay: RecomputeEstimator | None = None,
        load_delay: LoadEstimator | None = None,
        cpu_contention: float | None = None,
        loader_cpu: LoadEstimator | None = None,
        headroom: float = 0.85,
        default_tier: str = "disk",
    ) -> None:
        if not 0.0 < headroom <= 1.0:
            raise ValueError(f"headroom={headroom} must be in (0, 1]: the share of the load time recompute may fill")
        if not 0.0 <= quality_floor <= max_ratio <= 1.0:
            raise ValueError(f"need 0 <= quality_floor ({quality_floor}) <= max_ratio ({max_ratio}) <= 1")
        if cpu_contention is None:
            cpu_contention = 1.0 if profile.is_cpu else 0.0
        if not (math.isfinite(cpu_contention) and cpu_contention >= 0):
            raise ValueError(f"cpu_contention={cpu_contention} must be a finite number >= 0")
        self.profile = profile
        self.quality_floor, self.max_ratio = quality_floor, max_ratio
        self._recompute_delay, self._load_delay, self._loader_cpu = recompute_delay, load_delay, loader_cpu
        self.cpu_contention = float(cpu_contention)
        self.headroom = headroom
        self.default_tier = default_tier

    @property
    def calibrated(self) -> bool:
        """True when recompute delays come from the profile's measured fused cost."""
        return self._recompute_delay is None and self.profile.fused is not None

    # estimators -----------------------------------------------------------------------------
    def recompute_delay(self, ratio: float, tokens: int) -> float:
        if self._recompute_delay is not None:
            return float(self._recompute_delay(ratio, tokens))
        fused = self.profile.fused
        share = ratio if fused is None else fused.share(ratio)
        return share * self.profile.prefill_s(tokens)

    def load_delay(self, tier: str, tokens: int) -> float:
        if self._load_delay is not None:
            return float(self._load_delay(tier, tokens))
        if tier not in self.profile.tiers:
            raise KeyError(
                f"tier {tier!r} is not in the profile (has {sorted(self.profile.tiers)}); profile it or pass load_delay"
            )
        return self.profile.kv_bytes(tokens, tier) / self.profile.tiers[tier].read_bytes_per_s

    def contention_delay(self, tier: str, tokens: int) -> float:
        """How much longer the recompute runs because the loader brings ``tokens`` tokens from
        ``tier`` on the same cores: cpu_contention x the loader's CPU seconds (0 off-CPU)."""
        if self.cpu_contention == 0.0 or tokens <= 0:
            return 0.0
        cpu = self._loader_cpu(tier, tokens) if self._loader_cpu is not None else self.profile.loader_cpu_s(tier, tokens)
        return self.cpu_contention * float(cpu)

    # decisions ------------------------------------------------------------------------------
    def equal_delay_ratio(self, context_tokens: int, load_s: float) -> float:
        """The r >= 0 with recompute_delay(r, n) == load_s (0 when even r = 0 takes longer: the
        calibrated fixed part); above 1 when even a full recompute of the context is faster."""
        if self._recompute_delay is None:  # linear in r: solve directly
            full = self.profile.prefill_s(context_tokens)
            if full <= 0:
                return math.inf if load_s > 0 else 0.0
            fused = self.profile.fused
            if fused is None:
                return load_s / full  # the paper's estimator
            return max(0.0, (load_s / full - fused.fixed) / fused.per_ratio)
        full = self.recompute_delay(1.0, context_tokens)
        if full <= 0:
            return math.inf if load_s > 0 else 0.0
        if full <= load_s:
            return load_s / full  # beyond 1: any ratio hides; report how far (linear guess)
        lo, hi = 0.0, 1.0  # a custom estimator: assume only that it grows with r
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.recompute_delay(mid, context_tokens) <= load_s else (lo, mid)
        return lo

    def hiding_budget(self, load_s: float, contention_s: float = 0.0) -> float:
        """Recompute time the load can hide: headroom x (load_s - contention_s), never negative."""
        return self.headroom * max(0.0, load_s - contention_s)

    def _clamp(self, r: float) -> float:
        return min(self.max_ratio, max(self.quality_floor, r))

    def ratio_for(
        self, context_tokens: int, tier: str | None = None, *, load_s: float | None = None, contention_s: float | None = None
    ) -> float:
        """max(floor, equal-delay ratio), capped at ``max_ratio``. Give the tier all the context is
        loaded from, or the estimated ``load_s`` (and ``contention_s``, default that of the tier,
        or 0 without one) directly."""
        if load_s is None:
            load_s = 0.0 if tier is None else self.load_delay(tier, context_tokens)
        if contention_s is None:
            contention_s = 0.0 if tier is None else self.contention_delay(tier, context_tokens)
        return self._clamp(self.equal_delay_ratio(context_tokens, self.hiding_budget(load_s, contention_s)))

    def tiers_that_hide(self, ratio: float, context_tokens: int) -> list[str]:
        """Tiers whose load of ``context_tokens`` (less its CPU contention) takes no longer than
        recomputing ``ratio`` of them."""
        budget = self.recompute_delay(ratio, context_tokens)
        return [
            t
            for t in self.profile.tiers
            if self.load_delay(t, context_tokens) - self.contention_delay(t, context_tokens) <= budget
        ]

    def cheapest_tier(self, ratio: float, context_tokens: int) -> str | None:
        """Cheapest (then fastest) tier on which recompute at ``ratio`` still hides the load; None if
        no tier is that fast (then the fastest tier is the best you can do)."""
        ok = self.tiers_that_hide(ratio, context_tokens)
        tiers = self.profile.tiers
        return min(ok, key=lambda t: (tiers[t].cost_per_byte, -tiers[t].read_bytes_per_s), default=None)

    def decide(self, context_tokens: int, loads: Mapping[str, int]) -> Decision:
        """``loads``: tokens read from each tier for this request (chunks computed now read nothing)."""
        active = {t: n for t, n in loads.items() if n > 0}
        load_s = sum(self.load_delay(t, n) for t, n in active.items())
        contention_s = sum(self.contention_delay(t, n) for t, n in active.items())
        eq = self.equal_delay_ratio(context_tokens, self.hiding_budget(load_s, contention_s))
        ratio = self._clamp(eq)
        main = max(active, key=lambda t: active[t], default=None)
        return Decision(
            ratio=ratio,
            floor=self.quality_floor,
            equal_delay_ratio=eq,
            tier=main,
            context_tokens=context_tokens,
            loaded_tokens=sum(loads.values()),
            est_load_s=load_s,
            est_recompute_s=self.recompute_delay(ratio, context_tokens),
            cheapest_tier=self.cheapest_tier(ratio, context_tokens) if self.profile.tiers else None,
            est_contention_s=contention_s,
        )

    def decide_for(self, engine, layout, *, store: Any = None) -> Decision:
        """Decide for one request: find which tier of ``store`` (default: the engine's) holds each
        reusable chunk of ``layout``."""
        store = engine.store if store is None else store
        locate = getattr(store, "locate", None)
        name = getattr(store, "tier_name", None) or self.default_tier
        loads: dict[str, int] = {}
        for seg in layout.segments:
            if not seg.reusable:
                continue
            key = engine.chunk_key(seg, layout.prefix_ids)
            tier = locate(key) if locate is not None else (name if store.contains(key) else None)
            if tier is not None:
                loads[tier] = loads.get(tier, 0) + len(seg)
        return self.decide(layout.num_context_tokens, loads)

    @classmethod
    def for_engine(cls, engine, path: str | Path | None = None, *, measure: bool = True, **kwargs: Any) -> LoadingController:
        """Controller from the saved profile of ``engine``'s model on its device (measured and saved
        first when missing and ``measure``)."""
        from cacheblend_rag.control.profiler import profile_engine

        path = Path(path) if path is not None else default_profile_path(engine)
        if path.is_file():
            profile = DeviceProfile.load(path)
            if profile.fingerprint != engine.fingerprint:
                raise ValueError(
                    f"profile {path} was measured for another model ({profile.model_id}); re-run `cacheblend-rag profile`"
                )
            if profile.fused is None:
                log.warning(
                    "profile %s has no fused-cost calibration (measured by an older version): using the "
                    "uncalibrated estimator, which under-predicts recompute; run `cacheblend-rag profile --force`",
                    path,
                )
            elif not fused_code_matches(profile):
                log.warning(
                    "profile %s calibrated the fused prefill with other fusor/loader code; its recompute estimates may "
                    "be off: run `cacheblend-rag profile --force`",
                    path,
                )
        elif measure:
            profile = profile_engine(engine)
            profile.save(path)
        else:
            raise FileNotFoundError(f"no profile at {path}; run `cacheblend-rag profile` first")
        return cls(profile, **kwargs)
