"""A model's quality profile: the recompute ratio that reached a requested answer agreement.

``cacheblend-rag calibrate`` measures, on a user's own questions and chunks (or the bundled
sets), how often a blended prefill answers like a full prefill at several recompute ratios, and
saves the cheapest ratio that reached the target here. ``CacheBlendEngine.from_pretrained`` then
uses that strategy and ratio whenever the caller passes no ``config``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from cacheblend_rag.config import BlendConfig


@dataclass(frozen=True)
class QualityProfile:
    strategy: str
    recompute_ratio: float
    target: float  # requested mean agreement (token F1 of the answer against full prefill's)
    reached: bool  # False: no measured ratio reached the target; recompute_ratio is the best tried
    n: int  # questions measured
    curve: dict[str, float] = field(default_factory=dict)  # ratio -> mean agreement

    def config(self, base: BlendConfig | None = None) -> BlendConfig:
        return replace(base or BlendConfig(), strategy=self.strategy, recompute_ratio=self.recompute_ratio, schedule=None)

    def save(self, path: str | os.PathLike[str]) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(asdict(self), indent=2, sort_keys=True))
        os.replace(tmp, path)  # a concurrent reader never sees half a file
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> QualityProfile:
        data = json.loads(Path(path).read_text())
        profile = cls(**data)
        BlendConfig(strategy=profile.strategy, recompute_ratio=profile.recompute_ratio)  # validates
        return profile


def quality_profile_path(fingerprint: str) -> Path:
    from cacheblend_rag.model.loading import default_cache_dir

    return default_cache_dir() / "profiles" / f"{fingerprint[:20]}-quality.json"


def choose_ratio(curve: dict[float, float], target: float) -> tuple[float, bool]:
    """The smallest ratio whose agreement reached ``target``; else the best-agreeing one."""
    if not curve:
        raise ValueError("no ratio was measured")
    ok = sorted(r for r, a in curve.items() if a >= target)
    if ok:
        return ok[0], True
    return max(curve, key=lambda r: (curve[r], -r)), False
