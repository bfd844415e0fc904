"""Open the chunk KV store ``CacheBlendEngine.from_pretrained(store=...)`` describes.

A store spec is one entry or a list of entries, fastest first, each one of

* ``"disk"``: the diskcache store in ``store_dir`` (the default when ``store`` is None);
* a Redis URL (``redis://``, ``rediss://``, ``unix://``) or a :class:`~cacheblend_rag.store.redis_tier.RedisConfig`;
* a store object (anything with the store interface), used as given.

The disk and Redis tiers write chunks in ``kv_format`` (``quant.parse_kv_format``: None or
"float", the K/V's own dtype; "int8"; "int4"); a store object keeps its own. A memory tier of
``memory_bytes`` sits in front of them (0: none). Several entries, or any Redis
entry, become a :class:`~cacheblend_rag.store.tiers.TieredStore`, whose failover keeps a Redis outage from
failing an answer; a single disk store without a memory tier is returned bare, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from cacheblend_rag.store.disk import KVStore, KVStoreOpenError
from cacheblend_rag.store.memory import MemoryTier
from cacheblend_rag.store.quant import KVFormat, parse_kv_format
from cacheblend_rag.store.redis_tier import RedisConfig, RedisStore, is_redis_url
from cacheblend_rag.store.tiers import Tier, TieredStore

__all__ = ["StoreSpec", "open_store"]

log = logging.getLogger(__name__)

StoreSpec = str | RedisConfig | Any
# Relative price per stored byte (the loading controller compares them): RAM in this process,
# RAM on a shared server (one copy serves every worker), disk.
TIER_COSTS = {"memory": 1.0, "redis": 0.5, "disk": 0.1}


def open_disk(directory: str, *, size_limit: int, fingerprint: str, kv_format: KVFormat | str | None = None) -> KVStore:
    """The disk store in ``directory``, or a temporary one (with a warning) if it cannot be opened."""
    try:
        return KVStore(directory, size_limit=size_limit, fingerprint=fingerprint, kv_format=kv_format)
    except KVStoreOpenError as exc:
        # The store is an optimisation: answer from a throw-away store rather than not at all.
        log.warning("%s; using a temporary KV store instead (chunk caches will not persist)", exc)
        return KVStore(None, size_limit=size_limit, fingerprint=fingerprint, kv_format=kv_format)


def _tier(
    entry: StoreSpec,
    names: set[str],
    *,
    directory: str,
    size_limit: int,
    fingerprint: str,
    kv_format: KVFormat | str | None = None,
) -> Tier:
    if entry == "disk":
        store, name = open_disk(directory, size_limit=size_limit, fingerprint=fingerprint, kv_format=kv_format), "disk"
    elif is_redis_url(entry) or isinstance(entry, RedisConfig):
        store, name = RedisStore(entry, fingerprint=fingerprint, kv_format=kv_format), "redis"
    elif isinstance(entry, str):
        raise ValueError(
            f"unknown store {entry!r}: use 'disk', a redis://, rediss:// or unix:// URL, a RedisConfig "
            "or a store object (the memory tier in front is set by memory_bytes)"
        )
    else:
        store = entry
        name = getattr(store, "tier_name", None) or type(store).__name__.lower()
    base, n = name, 2
    while name in names:  # two Redis servers: "redis", "redis2"
        name, n = f"{base}{n}", n + 1
    names.add(name)
    return Tier(store, name, TIER_COSTS.get(base, 1.0))


def open_store(
    spec: StoreSpec | Sequence[StoreSpec] | None,
    *,
    directory: str,
    size_limit: int,
    fingerprint: str,
    memory_bytes: int,
    kv_format: KVFormat | str | None = None,
) -> Any:
    """The store ``spec`` describes (see the module docstring). Raises
    :class:`~cacheblend_rag.store.redis_tier.RedisAuthError` if a Redis refuses its credentials."""
    fmt = parse_kv_format(kv_format)  # refused before any tier opens, like memory_bytes
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, (int, float)) or not memory_bytes >= 0:
        # Checked before any tier opens: a disk store or Redis connection would outlive the error.
        raise ValueError(f"memory_bytes={memory_bytes!r} must be >= 0 bytes of RAM for the memory tier (0: none)")
    entries = (
        ["disk"]
        if spec is None
        else [spec]
        if isinstance(spec, (str, RedisConfig)) or not isinstance(spec, Sequence)
        else list(spec)
    )
    if not entries:
        raise ValueError("store=[] names no tier: use 'disk', a Redis URL, or a list of them")
    names: set[str] = {"memory"} if memory_bytes else set()
    tiers: list[Tier] = []
    try:
        for entry in entries:
            tiers.append(_tier(entry, names, directory=directory, size_limit=size_limit, fingerprint=fingerprint, kv_format=fmt))
    except BaseException:
        for t in tiers:
            t.store.close()
        raise
    if memory_bytes:
        tiers.insert(0, Tier(MemoryTier(memory_bytes), "memory", TIER_COSTS["memory"]))
    if len(tiers) == 1 and not isinstance(tiers[0].store, RedisStore):
        return tiers[0].store
    return TieredStore(tiers)
