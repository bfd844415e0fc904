"""``TeeStore``: several chunk stores written as one, so that chunk caches computed once fill a
store of every record format a benchmark compares."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TeeStore"]


class TeeStore:
    """Every store of ``stores`` at once, for ``precompute``: a chunk is cached when all of them
    hold it, and is written to each (which encodes its own record format)."""

    kv_format = None  # chunks are computed in float here; each store quantizes its own records

    def __init__(self, stores: Sequence[Any]):
        self.stores = list(stores)

    def contains(self, key: str) -> bool:
        return all(s.contains(key) for s in self.stores)

    def put(self, key: str, layers) -> bool:
        return all([s.put(key, layers) for s in self.stores])  # a list: every store is written
