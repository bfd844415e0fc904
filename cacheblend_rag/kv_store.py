"""Moved to :mod:`cacheblend_rag.store` (0.2.0); this module keeps 0.1 imports working."""

import warnings

from .store.disk import KVStore, KVStoreOpenError, SafeDisk, UnsafePathError, UnsafeRecordError
from .store.keys import chunk_key
from .store.meta import ChunkMeta, decode_chunk_layer, decode_meta, encode_meta
from .store.protocol import StoreStats

__all__ = [
    "ChunkMeta", "KVStore", "KVStoreOpenError", "SafeDisk", "StoreStats", "UnsafePathError", "UnsafeRecordError",
    "chunk_key", "decode_chunk_layer", "decode_meta", "encode_meta",
]
warnings.warn("cacheblend_rag.kv_store moved to cacheblend_rag.store", DeprecationWarning, stacklevel=2)
