"""``ThrottledStore``: any chunk store behind a rate-limited reader, for benchmarks and tests."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from cacheblend_rag.store.protocol import KV, kv_bytes, read_layers

__all__ = ["ThrottledStore"]


class ThrottledStore:
    """Wrap a store so each layer read takes at least ``bytes / bytes_per_s`` seconds.

    Simulates a rate-limited reader (network volume, cold object store). The wait is a
    ``time.sleep``, which releases the GIL like real I/O does, so it can overlap compute.
    Everything but ``get_layer`` and ``get_layers`` is passed through untouched.
    """

    reads_from_memory = False  # its reads wait, whatever the store behind it (store.protocol)

    def __init__(self, inner: Any, bytes_per_s: float, name: str = "throttled") -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"bytes_per_s={bytes_per_s} must be > 0")
        self.inner, self.bytes_per_s, self.tier_name = inner, float(bytes_per_s), name

    def get_layer(self, key: str, layer: int, device: torch.device | str | None = None) -> KV | None:
        return self.get_layers([key], layer, device)[0]

    def get_layers(self, keys: Sequence[str], layer: int, device: torch.device | str | None = None) -> list[KV | None]:
        t0 = time.perf_counter()
        got = read_layers(self.inner, keys, layer, device)
        remaining = sum(kv_bytes(*kv) for kv in got if kv is not None) / self.bytes_per_s - (time.perf_counter() - t0)
        if remaining > 0:
            time.sleep(remaining)
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"ThrottledStore({self.inner!r}, {self.bytes_per_s / 1e6:.0f} MB/s)"
