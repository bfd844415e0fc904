"""The memory tier: chunk K/V kept as tensors in a byte-bounded cache, evicted by a policy
(``eviction``: LRU or frequency-aware), in front of the disk store and Redis (``tiers``)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from cacheblend_rag.store.dtypes import dtype_name
from cacheblend_rag.store.eviction import EvictionPolicy, PolicyCache, make_policy
from cacheblend_rag.store.meta import ChunkMeta
from cacheblend_rag.store.protocol import KV, kv_bytes

__all__ = ["MemoryStats", "MemoryTier"]


def _kv_size(kv: KV) -> int:
    return kv_bytes(*kv)


@dataclass
class MemoryStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0  # layers evicted to stay under the byte budget
    bytes_read: int = 0
    bytes_written: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class MemoryTier:
    """CPU RAM of (chunk key, layer) -> (K, V), bounded by ``capacity_bytes``.

    Eviction is per layer, like the disk store, so a big chunk can be partly resident; ``contains``
    is true only while all its layers are. ``policy`` picks the victim (``store.eviction``:
    ``"lru"``, ``"lfu"`` or a policy object; default ``eviction.DEFAULT_MEMORY_POLICY``).
    """

    tier_name = "memory"
    reads_from_memory = True  # store.protocol: a read is a dict lookup, never a wait on storage

    def __init__(self, capacity_bytes: int = 2 * 2**30, policy: str | EvictionPolicy | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be > 0")
        self.capacity_bytes = capacity_bytes
        self.policy = make_policy(policy)
        self.stats = MemoryStats()
        # (chunk key, layer) -> (K, V), bounded by bytes; the policy picks what goes.
        self._layers = PolicyCache(capacity_bytes, self.policy, getsizeof=_kv_size, on_evict=self._evicted)
        self._metas: dict[str, ChunkMeta] = {}  # chunks with at least one resident layer
        self._resident: dict[str, int] = {}  # chunk -> resident layer count
        self._lock = threading.Lock()  # loader, write-back and request threads share the tier

    # The store interface -------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        with self._lock:
            meta = self._metas.get(key)
            return meta is not None and self._resident.get(key, 0) == meta.num_layers

    def meta(self, key: str) -> ChunkMeta | None:
        return self._metas.get(key) if self.contains(key) else None

    def num_layers_of(self, key: str) -> int | None:
        """Layer count of a chunk with any resident layer (saves a lower-tier lookup on promotion)."""
        meta = self._metas.get(key)
        return meta.num_layers if meta is not None else None

    def put(self, key: str, layers: Sequence[KV]) -> bool:
        layers = list(layers)
        if not layers:
            raise ValueError("put needs at least one layer")
        size = sum(kv_bytes(k, v) for k, v in layers)
        if size > self.capacity_bytes:
            return False  # would only evict everything, itself included: leave it to lower tiers
        for i, (k, v) in enumerate(layers):
            self.put_layer(key, i, k, v, len(layers))
        return True

    def put_layer(self, key: str, layer: int, k: torch.Tensor, v: torch.Tensor, num_layers: int) -> None:
        # Own copies on the CPU: callers' tensors may be views of caches that live on.
        k = k.detach().to("cpu", copy=True)
        v = v.detach().to("cpu", copy=True)
        size = kv_bytes(k, v)
        if size > self.capacity_bytes:
            return
        with self._lock:
            self._metas.setdefault(key, ChunkMeta(int(k.shape[1]), num_layers, dtype_name(k.dtype)))
            if (key, layer) not in self._layers:
                self._resident[key] = self._resident.get(key, 0) + 1
            self.stats.bytes_written += size
            self._layers[(key, layer)] = (k, v)  # evicts to stay in budget, maybe this very layer

    def _evicted(self, item: tuple[str, int], kv: KV) -> None:
        key = item[0]
        self.stats.evictions += 1
        self._resident[key] -= 1
        if self._resident[key] == 0:
            del self._resident[key], self._metas[key]

    def get_layer(self, key: str, layer: int, device: torch.device | str | None = None) -> KV | None:
        with self._lock:
            kv = self._layers.get((key, layer))  # a read: the policy is told
            if kv is None:
                self.stats.misses += 1
                return None
            self.stats.hits += 1
            self.stats.bytes_read += kv_bytes(*kv)
        k, v = kv
        if device is not None and torch.device(device).type != "cpu":
            k, v = k.to(device, non_blocking=True), v.to(device, non_blocking=True)
        return k, v

    def discard(self, key: str) -> None:
        with self._lock:
            for layer in range(self._metas.get(key, ChunkMeta(0, 0, "")).num_layers):
                self._layers.pop((key, layer), None)
            self._metas.pop(key, None)
            self._resident.pop(key, None)

    def volume(self) -> int:
        return self._layers.currsize

    def clear(self) -> None:
        with self._lock:
            self._layers.clear()  # and the policy
            self._metas.clear()
            self._resident.clear()

    def close(self) -> None:
        self.clear()

    def __len__(self) -> int:
        return len(self._layers)

    def __repr__(self) -> str:
        return f"MemoryTier({self._layers.currsize}/{self.capacity_bytes} bytes, {len(self._layers)} layers)"


# ------------------------------------------------------------------------ tiered store
