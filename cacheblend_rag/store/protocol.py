"""What the engine, the loader and the tiers ask of a chunk store: the ``ChunkStore`` protocol.

Every store (``disk.KVStore``, ``tiers.MemoryTier``, ``tiers.TieredStore``,
``redis_tier.RedisStore``, a test's wrapper) holds a chunk as one (K, V) pair per layer under its
chunk key (``keys.chunk_key``), each ``[kv_heads, tokens, head_dim]``. A store that can read one
layer of several chunks in one call (one round trip to a network tier) also offers ``get_layers``
(``BatchedChunkStore``); ``read_layers`` uses it where it exists.

A store whose reads never wait on storage (RAM only) may say so with ``reads_from_memory =
True``: on a CPU device the loader then reads inline instead of timing the first read
(``loader.LayerAssembler``). Stores without the attribute are timed.

Failures never raise out of a read: a missing, evicted or corrupt chunk is a miss (None) and the
engine recomputes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from cacheblend_rag.store.meta import ChunkMeta

__all__ = ["KV", "BatchedChunkStore", "ChunkStore", "StoreStats", "batched_reader", "kv_bytes", "read_layers"]

KV = tuple[torch.Tensor, torch.Tensor]  # one layer of one chunk: K and V, [kv_heads, tokens, head_dim]
Device = torch.device | str | None


@runtime_checkable
class ChunkStore(Protocol):
    def contains(self, key: str) -> bool:
        """True while every layer of the chunk can be read."""
        ...

    def meta(self, key: str) -> ChunkMeta | None: ...

    def put(self, key: str, layers: Sequence[KV]) -> bool:
        """Store a chunk, one (K, V) per layer; False if it was not stored (full, failing)."""
        ...

    def get_layer(self, key: str, layer: int, device: Device = None) -> KV | None:
        """One layer of a chunk, or None on a miss (the caller recomputes the chunk)."""
        ...

    def discard(self, key: str) -> None: ...

    def volume(self) -> int:
        """Bytes held."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class BatchedChunkStore(ChunkStore, Protocol):
    def get_layers(self, keys: Sequence[str], layer: int, device: Device = None) -> list[KV | None]:
        """``layer`` of every chunk in ``keys`` (None where missing), in one round trip."""
        ...


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    write_errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def kv_bytes(k: torch.Tensor, v: torch.Tensor) -> int:
    """Bytes one layer's K and V hold."""
    return k.numel() * k.element_size() + v.numel() * v.element_size()


def batched_reader(store: Any) -> Callable[..., list[KV | None]] | None:
    """``store.get_layers`` when the store's class defines it, else None.

    Looked up on the class: a wrapper that overrides ``get_layer`` and forwards everything else
    with ``__getattr__`` (a test hook, a throttle) must keep seeing every read."""
    return store.get_layers if hasattr(type(store), "get_layers") else None


def read_layers(store: Any, keys: Sequence[str], layer: int, device: Device = None) -> list[KV | None]:
    """``store.get_layers(keys, layer)`` where the store has it (one round trip to a network
    tier), else one ``get_layer`` per key."""
    batched = batched_reader(store)
    if batched is not None:
        return batched(keys, layer, device)
    return [store.get_layer(key, layer, device) for key in keys]
