"""Moved to :mod:`cacheblend_rag.store.tiers` (0.2.0; ``ThrottledStore`` to
:mod:`cacheblend_rag.bench.throttle`); this module keeps 0.1 imports working."""

import warnings

from .bench.throttle import ThrottledStore
from .store.dtypes import resolve_dtype
from .store.protocol import batched_reader, read_layers
from .store.tiers import MemoryTier, Tier, TieredStats, TieredStore

__all__ = ["MemoryTier", "ThrottledStore", "Tier", "TieredStats", "TieredStore", "batched_reader", "read_layers", "resolve_dtype"]
warnings.warn("cacheblend_rag.tiers moved to cacheblend_rag.store.tiers", DeprecationWarning, stacklevel=2)
