"""A model's measured profile on a device: what the loading controller decides from.

``cacheblend_rag.control.profiler`` measures it, ``cacheblend_rag.control.controller`` reads it; this module holds
the data alone (and where it is saved), so neither imports the other's side.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "FUSED_CODE",
    "DeviceProfile",
    "FusedCost",
    "TierProfile",
    "default_profile_path",
    "device_tag",
    "fused_code_id",
    "fused_code_matches",
]

# 2 added FusedCost, assemble_s_per_token and TierProfile.cpu_s_per_byte; version 1 files still load
# (without them the controller uses the paper's uncalibrated estimator and no CPU contention).
PROFILE_VERSION = 2
READABLE_VERSIONS = (1, 2)


@dataclass
class TierProfile:
    """read_bytes_per_s: measured layer-read throughput. cost_per_byte: relative storage price.
    element_bytes: bytes per stored K/V element on this tier (4 fp32, 2 fp16/bf16).
    cpu_s_per_byte: CPU seconds the read itself burns per byte (decode, checksum, copies; not the
    time it waits on I/O or a throttle). None: not measured (older profiles)."""

    read_bytes_per_s: float
    cost_per_byte: float = 1.0
    element_bytes: int = 4
    cpu_s_per_byte: float | None = None


@dataclass
class FusedCost:
    """Calibrated time of the CacheBlend fused prefill, as a share of a full prefill of the same
    context: fused(r, n) = (fixed + per_ratio x r) x full prefill(n). The paper's estimator is
    fixed = 0, per_ratio = 1.

    points: the measurements it was fitted to, (context tokens, ratio, seconds, full-prefill
    seconds of that context from the profile).
    """

    fixed: float
    per_ratio: float
    points: list[tuple[int, float, float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.points = [(int(n), float(r), float(s), float(f)) for n, r, s, f in self.points]
        if not (math.isfinite(self.fixed) and math.isfinite(self.per_ratio)) or self.fixed < 0 or self.per_ratio <= 0:
            raise ValueError(
                f"fused cost needs fixed >= 0 and per_ratio > 0 (recompute grows with r), got {self.fixed}, {self.per_ratio}"
            )

    def share(self, ratio: float) -> float:
        """Fused prefill time at ``ratio`` as a fraction of a full prefill."""
        return self.fixed + self.per_ratio * ratio

    @classmethod
    def fit(cls, points: Sequence[tuple[int, float, float]], prefill_s: Callable[[int], float]) -> FusedCost:
        """Least-squares line through (ratio, seconds / prefill_s(tokens)) for measured
        ``(context tokens, ratio, seconds)``; the intercept is clamped at 0 (then the slope is refitted
        through the origin). Raises ValueError unless there are two distinct ratios and the time grows
        with the ratio."""
        rows = [(int(n), float(r), float(s), float(prefill_s(int(n)))) for n, r, s in points]
        rows = [row for row in rows if row[3] > 0]
        xs = [r for _, r, _, _ in rows]
        ys = [s / f for _, _, s, f in rows]
        if len(set(xs)) < 2:
            raise ValueError(f"fitting the fused cost needs two distinct ratios, got {sorted(set(xs))}")
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        fixed = my - slope * mx
        if fixed < 0:
            fixed, slope = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
        if slope <= 0:
            raise ValueError(
                f"measured fused time does not grow with the ratio ({list(zip(xs, ys))}); measure again on a quieter machine"
            )
        return cls(fixed=fixed, per_ratio=slope, points=rows)


@dataclass
class DeviceProfile:
    """What the controller knows about one model on one device, measured once and reused.

    prefill_points: (context tokens, seconds of a full prefill over all layers), ascending.
    kv_values_per_token: K and V elements per token over all layers (2 x layers x kv_heads x head_dim).
    fused: calibrated fused-prefill cost (None: not measured; the paper's estimator is used).
    assemble_s_per_token: loader CPU seconds per loaded token beyond the tier read (cast, RoPE
    re-rotation, layout copy over all layers; None: not measured).
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
    fused: FusedCost | None = None
    assemble_s_per_token: float | None = None
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        self.prefill_points = sorted((int(n), float(s)) for n, s in self.prefill_points)
        if not self.prefill_points or any(n <= 0 or s < 0 for n, s in self.prefill_points):
            raise ValueError(f"prefill_points must be (tokens > 0, seconds >= 0) pairs, got {self.prefill_points}")
        self.tiers = {k: v if isinstance(v, TierProfile) else TierProfile(**v) for k, v in self.tiers.items()}
        if self.fused is not None and not isinstance(self.fused, FusedCost):
            self.fused = FusedCost(**self.fused)

    @property
    def is_cpu(self) -> bool:
        """Measured on a CPU (device tag ``cpu-<threads>t``): loader and compute share the cores."""
        return self.device.split("-", 1)[0] == "cpu"

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

    def kv_bytes(self, tokens: int, tier: str) -> int:
        return self.kv_values_per_token * self.tiers[tier].element_bytes * tokens

    def loader_cpu_s(self, tier: str, tokens: int) -> float:
        """CPU seconds the loader burns bringing ``tokens`` tokens from ``tier`` (read + assembly);
        parts not measured (older profiles, a tier not profiled) count 0."""
        cpu = (self.assemble_s_per_token or 0.0) * tokens
        t = self.tiers.get(tier)
        if t is not None and t.cpu_s_per_byte:
            cpu += t.cpu_s_per_byte * self.kv_bytes(tokens, tier)
        return cpu

    # persistence ----------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DeviceProfile:
        data = json.loads(text)
        if data.get("version") not in READABLE_VERSIONS:
            raise ValueError(
                f"profile version {data.get('version')} is not one of {READABLE_VERSIONS}; re-run `cacheblend-rag profile --force`"
            )
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
    def load(cls, path: str | Path) -> DeviceProfile:
        return cls.from_json(Path(path).read_text())


# The code whose speed a fused calibration measures, relative to the package: a saved calibration
# is stale once any of it changes, although the model fingerprint does not.
FUSED_CODE = (
    "blend/fusor.py",
    "store/loader.py",
    "model/attention.py",
    "engine/core.py",
    "engine/prefill.py",
    "blend/planner.py",
    "blend/chunk_cache.py",
)
_PACKAGE = Path(__file__).parents[1]


def device_tag(device: torch.device | str) -> str:
    """Names the hardware a profile was measured on (CPU timings depend on the thread count)."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return "cuda-" + "".join(c if c.isalnum() else "_" for c in name)
    return f"{device.type}-{torch.get_num_threads()}t"


def fused_code_id() -> str:
    """Hash of the code whose speed the fused calibration measures (``FUSED_CODE``):
    a saved calibration is stale once it changes, although the model fingerprint does not."""
    h = hashlib.sha1()
    for name in FUSED_CODE:
        h.update((_PACKAGE / name).read_bytes())
    return h.hexdigest()[:16]


def fused_code_matches(profile: DeviceProfile) -> bool:
    """False when ``profile``'s fused calibration was measured with other fusor/loader code."""
    code = (profile.meta.get("fused_calibration") or {}).get("code")
    return profile.fused is None or code is None or code == fused_code_id()


def default_profile_path(engine) -> Path:
    """``<cache home>/profiles/<model fingerprint>-<device>.json``."""
    from cacheblend_rag.model.loading import default_cache_dir

    return default_cache_dir() / "profiles" / f"{engine.fingerprint[:20]}-{device_tag(engine.device)}.json"
