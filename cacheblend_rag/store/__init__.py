"""Chunk KV caches at rest: keys, the record and meta formats, the stores and tiers, the loader.

* ``protocol``: the ``ChunkStore`` interface every store below has (and ``read_layers``);
* ``keys``: ``chunk_key``, the content hash naming a chunk's cache;
* ``dtypes``: the one table of storable K/V dtypes (record codes, names, tier aliases);
* ``record``, ``meta``: the checksummed raw-bytes layer record and a chunk's meta record;
* ``quant``: ``KVFormat``, the quantized (int8, 4-bit) formats a record can hold chunk K/V in;
* ``disk``: ``KVStore``, the diskcache store (never unpickles, survives a full or read-only disk);
* ``safe_disk``: ``SafeDisk``, its value files (raw bytes only, never a file outside the directory);
* ``disk_db``: how its database is opened (the store's own settings, read-only when it must be);
* ``memory``: ``MemoryTier``, chunk K/V as tensors in a byte-bounded cache with an eviction policy;
* ``tiers``: ``TieredStore`` (memory in front of disk and/or Redis, failover);
* ``redis_tier``: ``RedisStore``, shared by workers and machines;
* ``spec``: ``open_store``, the tier list ``CacheBlendEngine.from_pretrained(store=...)`` names;
* ``loader``: ``LayerAssembler``, one layer of a prompt's K/V from the store, optionally read ahead.

May import: the top-level modules only (``config``, ``errors``, ``rope``, ``threads``, ...): a store
knows bytes and tensors, never a model or a request.
"""

from cacheblend_rag.store.disk import KVStore, KVStoreOpenError
from cacheblend_rag.store.dtypes import resolve_dtype
from cacheblend_rag.store.keys import chunk_key
from cacheblend_rag.store.memory import MemoryTier
from cacheblend_rag.store.meta import ChunkMeta
from cacheblend_rag.store.protocol import KV, BatchedChunkStore, ChunkStore, StoreStats, read_layers
from cacheblend_rag.store.quant import KVFormat, parse_kv_format
from cacheblend_rag.store.tiers import Tier, TieredStore

__all__ = [
    "KV",
    "BatchedChunkStore",
    "ChunkMeta",
    "ChunkStore",
    "KVStore",
    "KVStoreOpenError",
    "KVFormat",
    "MemoryTier",
    "StoreStats",
    "Tier",
    "TieredStore",
    "chunk_key",
    "parse_kv_format",
    "read_layers",
    "resolve_dtype",
]
