"""The loading controller: pick the recompute ratio (and a storage tier) from an offline profile.

Paper section 5 ("the recompute ratio should not be a constant"): when the fusor recomputes layer
i while layer i+1's K/V is loading, recompute that takes no longer than the load is free. So

* ratio for a request = max(quality floor r*, the r at which recompute delay equals load delay);
* for a ratio and a context length, the cheapest tier whose load the recompute still hides.

Estimators (as in the paper, deliberately simple; both can be replaced by callables):

* recompute delay(r, n) = r x profiled full-prefill time of n context tokens (all layers);
* load delay(tier, n)   = KV bytes per token (as stored on the tier) x n / tier read throughput.

Comparing totals is the same as comparing per layer: both are spread evenly over the layers.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

__all__ = ["Decision", "DeviceProfile", "LoadingController", "TierProfile"]

PROFILE_VERSION = 1


@dataclass
class TierProfile:
    """read_bytes_per_s: measured layer-read throughput. cost_per_byte: relative storage price.
    element_bytes: bytes per stored K/V element on this tier (4 fp32, 2 fp16/bf16)."""

    read_bytes_per_s: float
    cost_per_byte: float = 1.0
    element_bytes: int = 4


@dataclass
class DeviceProfile:
    """What the controller knows about one model on one device, measured once and reused.

    prefill_points: (context tokens, seconds of a full prefill over all layers), ascending.
    kv_values_per_token: K and V elements per token over all layers (2 x layers x kv_heads x head_dim).
    """

    model_id: str
    fingerprint: str
    device: str
    dtype: str
    num_layers: int
    kv_values_per_token: int
    prefill_points: list[tuple[int, float]]
    tiers: dict[str, TierProfile] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)  # torch threads, date, lengths...
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        self.prefill_points = sorted((int(n), float(s)) for n, s in self.prefill_points)
        if not self.prefill_points or any(n <= 0 or s < 0 for n, s in self.prefill_points):
            raise ValueError(f"prefill_points must be (tokens > 0, seconds >= 0) pairs, got {self.prefill_points}")
        self.tiers = {k: v if isinstance(v, TierProfile) else TierProfile(**v) for k, v in self.tiers.items()}

    def prefill_s(self, tokens: int) -> float:
        """Full prefill time of ``tokens`` tokens: piecewise linear through (0, 0) and the measured
        points, extended past the last point with the last segment's slope."""
        pts = [(0, 0.0), *self.prefill_points]
        if tokens <= 0:
            return 0.0
        for (n0, s0), (n1, s1) in zip(pts, pts[1:]):
            if tokens <= n1:
                return s0 + (s1 - s0) * (tokens - n0) / (n1 - n0)
        (n0, s0), (n1, s1) = pts[-2], pts[-1]
        return s1 + (s1 - s0) * (tokens - n1) / (n1 - n0)

    def prefill_s_per_layer(self, tokens: int) -> float:
        return self.prefill_s(tokens) / self.num_layers

    def kv_bytes(self, tokens: int, tier: str) -> int:
        return self.kv_values_per_token * self.tiers[tier].element_bytes * tokens

    # persistence ----------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "DeviceProfile":
        data = json.loads(text)
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {data.get('version')} is not {PROFILE_VERSION}; re-run `cacheblend-rag profile`")
        data["prefill_points"] = [tuple(p) for p in data["prefill_points"]]
        return cls(**data)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)  # atomic: a reader never sees half a profile
        return path

    @classmethod
    def load(cls, path: str | Path) -> "DeviceProfile":
        return cls.from_json(Path(path).read_text())


@dataclass
class Decision:
    ratio: float  # the recompute ratio to use
    floor: float  # the quality floor r*
    equal_delay_ratio: float  # r where recompute delay == load delay (may be < floor or > 1)
    tier: str | None  # tier most of the loaded bytes come from (None: nothing loaded)
    context_tokens: int
    loaded_tokens: int
    est_load_s: float
    est_recompute_s: float  # at ``ratio``
    cheapest_tier: str | None  # cheapest tier that would still hide its load at ``ratio``

    def as_stats(self) -> dict[str, Any]:
        return {
            "controller_ratio": self.ratio,
            "controller_tier": self.tier,
            "controller_equal_delay_ratio": self.equal_delay_ratio,
            "controller_est_load_s": self.est_load_s,
            "controller_est_recompute_s": self.est_recompute_s,
            "controller_cheapest_tier": self.cheapest_tier,
        }


RecomputeEstimator = Callable[[float, int], float]  # (ratio, context tokens) -> seconds
LoadEstimator = Callable[[str, int], float]  # (tier name, tokens loaded) -> seconds


class LoadingController:
    """Chooses recompute ratios and tiers from a ``DeviceProfile``.

    quality_floor: r*, the smallest ratio that keeps quality (paper: 0.15).
    max_ratio: the ratio never exceeds this (1.0 = full recompute of the context).
    recompute_delay / load_delay: replace the paper's estimators (see module docstring).
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
        default_tier: str = "disk",
    ) -> None:
        if not 0.0 <= quality_floor <= max_ratio <= 1.0:
            raise ValueError(f"need 0 <= quality_floor ({quality_floor}) <= max_ratio ({max_ratio}) <= 1")
        self.profile = profile
        self.quality_floor, self.max_ratio = quality_floor, max_ratio
        self._recompute_delay, self._load_delay = recompute_delay, load_delay
        self.default_tier = default_tier

    # estimators -----------------------------------------------------------------------------
    def recompute_delay(self, ratio: float, tokens: int) -> float:
        if self._recompute_delay is not None:
            return float(self._recompute_delay(ratio, tokens))
        return ratio * self.profile.prefill_s(tokens)

    def load_delay(self, tier: str, tokens: int) -> float:
        if self._load_delay is not None:
            return float(self._load_delay(tier, tokens))
        if tier not in self.profile.tiers:
            raise KeyError(f"tier {tier!r} is not in the profile (has {sorted(self.profile.tiers)}); profile it or pass load_delay")
        return self.profile.kv_bytes(tokens, tier) / self.profile.tiers[tier].read_bytes_per_s

    # decisions ------------------------------------------------------------------------------
    def equal_delay_ratio(self, context_tokens: int, load_s: float) -> float:
        """The r with recompute_delay(r, n) == load_s; above 1 when even a full recompute of the
        context is faster than the load."""
        full = self.recompute_delay(1.0, context_tokens)
        if full <= 0:
            return math.inf if load_s > 0 else 0.0
        if self._recompute_delay is None:
            return load_s / full  # the paper's estimator is linear in r
        if full <= load_s:
            return load_s / full  # beyond 1: any ratio hides; report how far (linear guess)
        lo, hi = 0.0, 1.0  # a custom estimator: assume only that it grows with r
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.recompute_delay(mid, context_tokens) <= load_s else (lo, mid)
        return lo

    def ratio_for(self, context_tokens: int, tier: str | None = None, *, load_s: float | None = None) -> float:
        """max(floor, equal-delay ratio), capped at ``max_ratio``. Give the tier all the context is
        loaded from, or the estimated ``load_s`` directly."""
        if load_s is None:
            load_s = 0.0 if tier is None else self.load_delay(tier, context_tokens)
        r = self.equal_delay_ratio(context_tokens, load_s)
        return min(self.max_ratio, max(self.quality_floor, r))

    def tiers_that_hide(self, ratio: float, context_tokens: int) -> list[str]:
        """Tiers whose load of ``context_tokens`` takes no longer than recomputing ``ratio`` of them."""
        budget = self.recompute_delay(ratio, context_tokens)
        return [t for t in self.profile.tiers if self.load_delay(t, context_tokens) <= budget]

    def cheapest_tier(self, ratio: float, context_tokens: int) -> str | None:
        """Cheapest (then fastest) tier on which recompute at ``ratio`` still hides the load; None if
        no tier is that fast (then the fastest tier is the best you can do)."""
        ok = self.tiers_that_hide(ratio, context_tokens)
        tiers = self.profile.tiers
        return min(ok, key=lambda t: (tiers[t].cost_per_byte, -tiers[t].read_bytes_per_s), default=None)

    def decide(self, context_tokens: int, loads: Mapping[str, int]) -> Decision:
        """``loads``: tokens read from each tier for this request (chunks computed now read nothing)."""
        load_s = sum(self.load_delay(t, n) for t, n in loads.items() if n > 0)
        eq = self.equal_delay_ratio(context_tokens, load_s)
        ratio = min(self.max_ratio, max(self.quality_floor, eq))
        main = max((t for t, n in loads.items() if n > 0), key=lambda t: loads[t], default=None)
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
        )

    def decide_for(self, engine, layout) -> Decision:
        """Decide for one request: find which tier holds each reusable chunk of ``layout``."""
        store = engine.store
        locate = getattr(store, "locate", None)
        name = getattr(store, "tier_name", None) or self.default_tier
        loads: dict[str, int] = {}
        for seg in layout.segments:
            if not seg.reusable:
                continue
            key = engine.chunk_key(seg)
            tier = locate(key) if locate is not None else (name if store.contains(key) else None)
            if tier is not None:
                loads[tier] = loads.get(tier, 0) + len(seg)
        return self.decide(layout.num_context_tokens, loads)

    @classmethod
    def for_engine(cls, engine, path: str | Path | None = None, *, measure: bool = True, **kwargs: Any) -> "LoadingController":
        """Controller from the saved profile of ``engine``'s model on its device (measured and saved
        first when missing and ``measure``)."""
        from .profile import default_profile_path, profile_engine

        path = Path(path) if path is not None else default_profile_path(engine)
        if path.is_file():
            profile = DeviceProfile.load(path)
            if profile.fingerprint != engine.fingerprint:
                raise ValueError(f"profile {path} was measured for another model ({profile.model_id}); re-run `cacheblend-rag profile`")
        elif measure:
            profile = profile_engine(engine)
            profile.save(path)
        else:
            raise FileNotFoundError(f"no profile at {path}; run `cacheblend-rag profile` first")
        return cls(profile, **kwargs)
