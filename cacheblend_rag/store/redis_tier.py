"""A Redis tier for chunk KV caches: one cache shared by every worker and machine that can reach it.

``RedisStore`` has the store interface (:class:`~cacheblend_rag.store.protocol.ChunkStore`) (``contains``,
``meta``, ``put``, ``get_layer``, ``discard``, ``volume``, ``clear``, ``close``, ``stats``) plus two
batched calls, each one round trip however many chunks a request has: ``get_layers(keys, layer)``
reads one layer of several chunks (``MGET``; the layer-wise loader fetches layer i+1 of every chunk
of a request while layer i computes) and ``contains_many(keys)`` looks up all of a request's chunks
(``MGET`` of their meta records), so a request costs one lookup and one read per layer.

Records are the disk store's, byte for byte: one Redis string per chunk and layer
(:func:`cacheblend_rag.store.record.encode_layer`) plus the chunk's meta record
(:func:`cacheblend_rag.store.meta.encode_meta`), written last in one ``MULTI``/``EXEC`` so a reader
never sees half a chunk. Keys are ``<prefix>:<model tag>:{<chunk key>}:<layer>`` and
``...:meta``; the braces are a Redis hash tag, so every record of a chunk hashes to one slot (the
layout a sharded Redis needs for a chunk's ``MULTI``/``EXEC``). The model tag is a digest of the model fingerprint, and every record also names its
model, chunk and layer inside its checksummed header, which each read checks. A record that fails
any check (damaged, or planted from another model) is discarded and the chunk reported missing, so
the engine recomputes it. Nothing is ever unpickled.

Eviction is Redis's own: run it with ``maxmemory`` and ``maxmemory-policy allkeys-lru``. It evicts
single records, so a chunk can lose a layer after its lookup; that read is a miss, the rest of the
chunk is dropped, and the engine recomputes it like any lost record.

Connections: every store of a process that reaches the same Redis with the same timeouts shares
one connection pool (:mod:`~cacheblend_rag.store.redis_pool`).

Redis Cluster is refused when the store opens (:class:`RedisClusterError`): a request's batched
reads name chunks on many slots, which a cluster answers with ``CROSSSLOT``, and splitting them per
shard would turn the one round trip per request back into one per shard and per layer. Point the
store at a standalone Redis (or a primary with replicas) instead.

Failures: a Redis that is down, slow or restarting raises redis-py's ``ConnectionError`` /
``TimeoutError`` after ``socket_timeout_s``. Behind a :class:`cacheblend_rag.store.tiers.TieredStore`
(which ``CacheBlendEngine.from_pretrained`` always puts in front of Redis) that benches the tier for
``cooldown_s``: reads fall through to the next tier or to recompute, and the next try after the
cool-down reconnects. A server that refuses the credentials is a configuration error, not an outage:
opening the store raises :class:`RedisAuthError` naming the fix.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import cachetools
import torch

try:  # the `redis` extra: only a Redis tier needs it
    import redis
except ImportError:  # pragma: no cover - exercised only without the extra
    redis = None  # type: ignore[assignment]

from cacheblend_rag.store import redis_pool
from cacheblend_rag.store.dtypes import dtype_name
from cacheblend_rag.store.meta import ChunkMeta, decode_chunk_layer, decode_meta, encode_meta
from cacheblend_rag.store.protocol import KV, StoreStats
from cacheblend_rag.store.quant import KVFormat, chunk_name, parse_kv_format
from cacheblend_rag.store.record import CorruptRecordError, encode_layer, validate_chunk
from cacheblend_rag.store.seal import sealer

__all__ = ["RedisAuthError", "RedisClusterError", "RedisConfig", "RedisStore", "is_redis_url"]

log = logging.getLogger(__name__)

_URL_SCHEMES = ("redis://", "rediss://", "unix://")
_PREFIX = re.compile(r"[A-Za-z0-9._-]+")
_SCAN_BATCH = 500  # keys per SCAN/UNLINK round trip in clear()
_KNOWN_METAS = 4096  # chunks whose layer count a store remembers from its batched reads (promotion)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def is_redis_url(spec: object) -> bool:
    return isinstance(spec, str) and spec.lower().startswith(_URL_SCHEMES)


class RedisAuthError(RuntimeError):
    """Redis refused the URL's credentials (wrong password, unknown or under-privileged ACL user)."""


class RedisClusterError(RuntimeError):
    """The URL names a node of a Redis Cluster, which the Redis tier does not support (see the module doc)."""


@dataclass(frozen=True)
class RedisConfig:
    """Where and how to reach Redis.

    url: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` for TLS (certificate
        options as query arguments, e.g. ``?ssl_ca_certs=/path/to/ca.pem``) or ``unix:///path.sock``;
        parsed by redis-py's ``from_url``.
    prefix: first part of every key, so several applications can share one Redis (letters,
        digits, ``.``, ``_``, ``-``).
    socket_timeout_s: a command slower than this fails (default 1 s): a slow or hung Redis costs
        a request at most about this long before the tier is skipped. Raise it for large chunks
        over a slow link (a 1 s budget at 100 MB/s is ~100 MB per round trip).
    connect_timeout_s: the same for opening a connection (default 1 s).
    ttl_s: expire each record this many whole seconds after it was written (default None:
        records stay until Redis's ``maxmemory`` eviction drops them).
    """

    url: str
    prefix: str = "cacheblend"
    socket_timeout_s: float = 1.0
    connect_timeout_s: float = 1.0
    ttl_s: int | None = None

    def __post_init__(self) -> None:
        if not is_redis_url(self.url):
            raise ValueError(f"Redis URL {self.url!r} must start with redis://, rediss:// or unix://")
        if not _PREFIX.fullmatch(self.prefix):  # no ':' (our separator) and no glob characters (clear's SCAN)
            raise ValueError(f"prefix={self.prefix!r} must be letters, digits, '.', '_' or '-'")
        # redis-py's SET EX takes whole seconds only: anything else would fail every write.
        if self.ttl_s is not None and (type(self.ttl_s) is not int or self.ttl_s <= 0):
            raise ValueError(f"ttl_s={self.ttl_s!r} must be a whole number of seconds (> 0) or None")
        for name in ("socket_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)  # None: no bound; 0 would make the socket non-blocking
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"{name}={value!r} must be a positive number of seconds or None")


class RedisStore(AbstractContextManager):
    """Chunk KV store in Redis; see the module docstring. Thread-safe (redis-py's connection pool)."""

    tier_name = "redis"

    def __init__(
        self,
        config: RedisConfig | str,
        *,
        fingerprint: str = "",
        key: bytes | str | None = None,
        kv_format: str | KVFormat | None = None,
    ) -> None:
        """Connect to ``config`` (a :class:`RedisConfig` or a URL) and check the credentials.

        ``key``: a secret that every record is MACed with (default: ``$CACHEBLEND_RAG_STORE_KEY``
        if set, else none); records without a valid MAC are misses (store/seal.py).
        ``kv_format``: the format chunks are written and looked up in, as the disk store's (default
        None: float records); each format's chunks have key names of their own.

        Raises :class:`RedisAuthError` if Redis refuses them. A Redis that cannot be reached now is
        logged and used once it answers (its tier is skipped until then)."""
        if redis is None:
            raise ImportError("a Redis tier needs redis-py: pip install 'cacheblend-rag[redis]'")
        self.config = config if isinstance(config, RedisConfig) else RedisConfig(config)
        self.fingerprint = fingerprint
        self.kv_format = parse_kv_format(kv_format)
        self._sealer = sealer(key)
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._warned_full = False
        # Layer counts of chunks seen in batched reads: promotion into the memory tier needs one,
        # and asking Redis for each chunk's meta again would cost a round trip per chunk. Bounded: the
        # chunk remembered longest ago goes first (a FIFOCache moves a key remembered again to the
        # back; num_layers_of does not).
        self._known: cachetools.FIFOCache[str, int] = cachetools.FIFOCache(_KNOWN_METAS)
        tag = hashlib.blake2b(fingerprint.encode("utf-8"), digest_size=8, person=b"cbrag-redis").hexdigest()
        self._namespace = f"{self.config.prefix}:{tag}:"
        self._pool = redis_pool.acquire(self.config.url, self.config.socket_timeout_s, self.config.connect_timeout_s)
        self.client = redis.Redis(connection_pool=self._pool)
        try:
            # A URL's query arguments override keywords in from_url, and text replies would break records.
            if str(self._pool.connection_kwargs.get("decode_responses")).lower() not in ("none", "false", "0"):
                raise ValueError("the Redis URL sets decode_responses: records are raw bytes, remove it from the URL")
            self._check_server()
        except BaseException:
            self.close()
            raise

    @property
    def where(self) -> str:
        """The server, without credentials (for messages)."""
        kw = self.client.connection_pool.connection_kwargs
        if "path" in kw:
            return f"unix://{kw['path']}"
        return f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"

    def _check_server(self) -> None:
        try:
            self.client.ping()
        except (redis.AuthenticationError, redis.exceptions.AuthorizationError, redis.exceptions.NoPermissionError) as exc:
            raise RedisAuthError(
                f"Redis at {self.where} refused the credentials in the URL ({exc}). Put the right password "
                "in the URL, redis://:PASSWORD@host:port/db, or an ACL user and its password, "
                "redis://USER:PASSWORD@host:port/db (percent-encode special characters); an ACL user "
                f"needs +@read +@write +@keyspace +ping +multi +exec on keys '{self.config.prefix}:*'"
            ) from exc
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning(
                "Redis at %s is not reachable (%s): chunk caches are served by the other tiers or recomputed until it answers",
                self.where,
                exc,
            )
            return
        self._check_cluster()
        self._check_eviction()

    def _check_cluster(self) -> None:
        try:
            cluster = self.client.info("cluster")
        except redis.RedisError:  # an ACL user without +info: its MGETs would fail loudly instead
            return
        if str(cluster.get("cluster_enabled", "0")) == "1":
            raise RedisClusterError(
                f"Redis at {self.where} is a node of a Redis Cluster, which the Redis tier does not support: "
                "a request reads one layer of all its chunks in one MGET, and a cluster refuses an MGET whose "
                "keys live on different shards (CROSSSLOT). Use a standalone Redis, or a primary with "
                "replicas, sized with maxmemory and maxmemory-policy allkeys-lru; run one per group of "
                "servers if one is not enough"
            )

    def _check_eviction(self) -> None:
        """Warn when Redis would grow without bound or refuse writes once full."""
        try:
            conf = {_text(k): _text(v) for k, v in self.client.config_get("maxmemory*").items()}
        except redis.RedisError:  # managed services often disable CONFIG: their eviction is theirs
            return
        limit, policy = conf.get("maxmemory", "?"), conf.get("maxmemory-policy", "?")
        evicts = policy.startswith("allkeys") or (self.config.ttl_s is not None and policy.startswith("volatile"))
        if limit == "0" or not evicts:
            log.warning(
                "Redis at %s has maxmemory=%s and maxmemory-policy=%s: set maxmemory and "
                "maxmemory-policy allkeys-lru so old chunk caches are evicted instead of "
                "filling the server (writes then fail once it is full)",
                self.where,
                limit,
                policy,
            )

    # Keys ------------------------------------------------------------------------------------
    def record_name(self, key: str, layer: int | None = None) -> str:
        """The Redis key of a chunk's ``layer`` record, or of its meta record (``layer=None``)."""
        return f"{self._namespace}{{{chunk_name(key, self.kv_format)}}}:{'meta' if layer is None else layer}"

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    # The store interface ---------------------------------------------------------------------
    def meta(self, key: str) -> ChunkMeta | None:
        return self._meta_of(key, self.client.get(self.record_name(key)))

    def contains(self, key: str) -> bool:
        return self.meta(key) is not None

    def metas(self, keys: Sequence[str]) -> list[ChunkMeta | None]:
        """``meta`` of every chunk in ``keys``, in one round trip (``MGET``)."""
        keys = list(keys)
        if not keys:
            return []
        blobs = self.client.mget([self.record_name(k) for k in keys])
        return [self._meta_of(k, b) for k, b in zip(keys, blobs)]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """``contains`` of every chunk in ``keys``, in one round trip."""
        return [m is not None for m in self.metas(keys)]

    def num_layers_of(self, key: str) -> int | None:
        """Layer count of a chunk this store read or wrote lately, without asking Redis (None if
        not remembered). A hint for promotion only: the chunk may have been evicted since."""
        with self._lock:
            return self._known.get(key)

    def _remember(self, key: str, meta: ChunkMeta) -> None:
        with self._lock:
            self._known[key] = meta.num_layers

    def _meta_of(self, key: str, blob: Any) -> ChunkMeta | None:
        if blob is None:
            return None
        try:
            meta = decode_meta(self._sealer.open_meta(f"{key}/meta", blob), self.fingerprint, key)
        except CorruptRecordError as exc:
            self._on_corrupt(key, "meta", exc, 0)
            return None
        self._remember(key, meta)
        return meta

    def put(self, key: str, layers: Sequence[KV]) -> bool:
        """Store a chunk (one record per layer, then its meta). False if Redis refused the write
        (full under ``noeviction``, read-only replica); an unreachable Redis raises."""
        layers = list(layers)
        dtype, num_tokens = validate_chunk(layers)
        if self.contains(key):
            return True
        ttl = self.config.ttl_s
        pipe = self.client.pipeline(transaction=True)  # MULTI/EXEC: the chunk appears all at once
        written = 0
        try:
            records = [
                encode_layer(k, v, self.fingerprint, chunk=key, layer=i, kv_format=self.kv_format)
                for i, (k, v) in enumerate(layers)
            ]
        except ValueError as exc:  # values a quantized format cannot hold: this chunk is not stored
            log.warning("not storing chunk %s in Redis: %s", key[:16], exc)
            self._count(write_errors=1)
            return False
        for i, record in enumerate(records):
            blob = self._sealer.seal(f"{key}/{i}", record)
            pipe.set(self.record_name(key, i), blob, ex=ttl)
            written += len(blob)
        blob = self._sealer.seal(
            f"{key}/meta", encode_meta(ChunkMeta(num_tokens, len(layers), dtype_name(dtype)), self.fingerprint, key)
        )
        pipe.set(self.record_name(key), blob, ex=ttl)  # last: publishes the chunk
        try:
            pipe.execute()
        except redis.ResponseError as exc:  # OOM under noeviction, READONLY replica, ...
            self._count(write_errors=1)
            if not self._warned_full:
                self._warned_full = True
                log.warning(
                    "Redis at %s refused to store chunk %s: %s (further refusals are counted, not logged)",
                    self.where,
                    key[:16],
                    exc,
                )
            return False
        self._count(bytes_written=written + len(blob))
        return True

    def get_layer(self, key: str, layer: int, device: torch.device | str | None = None) -> KV | None:
        """(K, V) of one layer, or None on a miss or a discarded record (the caller recomputes)."""
        return self.get_layers([key], layer, device)[0]

    def get_layers(self, keys: Sequence[str], layer: int, device: torch.device | str | None = None) -> list[KV | None]:
        """``layer`` of every chunk in ``keys`` in one round trip: what ``get_layer`` returns for each.

        The chunks' meta records come in the same ``MGET``, so each record is checked against its
        meta (token count, dtype, layer range) exactly as a single read does."""
        keys = list(keys)
        if not keys:
            return []
        names = [self.record_name(k) for k in keys] + [self.record_name(k, layer) for k in keys]
        blobs = self.client.mget(names)
        return [self._decode_layer(key, layer, meta, blob, device) for key, meta, blob in zip(keys, blobs, blobs[len(keys) :])]

    def _decode_layer(self, key: str, layer: int, meta_blob: Any, blob: Any, device) -> KV | None:
        meta = self._meta_of(key, meta_blob)
        if meta is None:
            if meta_blob is None:
                self._count(misses=1)
            return None
        if not 0 <= layer < meta.num_layers:
            raise IndexError(f"layer {layer} out of range for chunk with {meta.num_layers} layers")
        if blob is None:
            # Evicted piece of a published chunk: drop the rest so the next write-back stores it whole.
            self._count(misses=1)
            self._delete(key, meta.num_layers)
            return None
        try:
            k, v = decode_chunk_layer(self._sealer.open(f"{key}/{layer}", blob), meta, self.fingerprint, key, layer)
        except (CorruptRecordError, ValueError, RuntimeError) as exc:
            self._on_corrupt(key, str(layer), exc, meta.num_layers)
            return None
        self._count(hits=1, bytes_read=len(blob))
        if device is not None and torch.device(device).type != "cpu":
            k, v = k.to(device), v.to(device)
        return k, v

    def _on_corrupt(self, key: str, record: str, exc: BaseException, num_layers: int) -> None:
        log.warning("discarding KV chunk %s from Redis: record %s unreadable: %s", key[:16], record, exc)
        self._count(corrupt=1)
        self._delete(key, num_layers)

    def _delete(self, key: str, num_layers: int) -> None:
        # Meta first, in one command: the chunk disappears before its layers. Without a readable
        # meta the layer count is unknown; orphaned layers are evicted by Redis or overwritten.
        self.client.unlink(self.record_name(key), *(self.record_name(key, i) for i in range(num_layers)))

    def discard(self, key: str) -> None:
        """Remove every record of a chunk (no error if absent)."""
        meta = self.meta(key)
        self._delete(key, meta.num_layers if meta else 0)

    def volume(self) -> int:
        """Bytes Redis holds (``used_memory``: the whole server, which other data may share).
        Redis, not this store, bounds it: set ``maxmemory``."""
        return int(self.client.info("memory").get("used_memory", 0))

    def clear(self) -> None:
        """Remove every record of this model under this prefix (other models and prefixes stay)."""
        batch: list[bytes] = []
        for name in self.client.scan_iter(match=f"{self._namespace}*", count=_SCAN_BATCH):
            batch.append(name)
            if len(batch) >= _SCAN_BATCH:
                self.client.unlink(*batch)
                batch.clear()
        if batch:
            self.client.unlink(*batch)

    def close(self) -> None:
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            self.client.close()  # the client's own connection, if any; the pool is shared
            redis_pool.release(pool)

    def __exit__(self, *exc: object) -> None:  # __enter__: AbstractContextManager's (the store)
        self.close()

    def __repr__(self) -> str:
        return f"RedisStore({self.where!r}, prefix={self.config.prefix!r})"
