"""Storage tiers for chunk KV caches: a byte-bounded memory LRU in front of the disk store (and/or
a Redis tier, ``redis_tier.py``).

``TieredStore`` has the interface the engine uses on its ``store`` (``contains``, ``meta``, ``put``,
``get_layer``, ``get_layers``, ``discard``, ``close``, ``stats``, ``volume``), so
``CacheBlendEngine(model, tok, store=TieredStore.memory_over_disk(...))`` needs no engine change.

* Reads try the tiers in order; ``get_layers`` asks each tier once for one layer of all the chunks
  the tiers above it lacked (one round trip to a network tier that offers ``get_layers``, such as
  ``redis_tier.RedisStore``; one ``get_layer`` per chunk otherwise). A hit in a lower tier is copied
  into the tiers above it that can hold single layers (``MemoryTier``): promotion, so the next
  request reads from memory.
* Writes (``precompute`` and the engine's background write-back of chunks computed during a
  request) go to every healthy tier, memory first, so the next request hits memory.
* ``dtype`` casts chunks on ``put`` (fp16/bf16 halve what is stored and read); the loader casts
  K and V back to the model dtype.
* A tier whose store writes a quantized format (``kv_format``: the disk store, Redis) is given
  the chunk as it is and quantizes it once; a tier that keeps tensors (``MemoryTier``) is given
  what that format's records decode to, so an answer is the same whichever tier served it.
* A tier that raises, or whose read takes longer than its ``read_timeout_s``, is skipped for
  ``cooldown_s``: the read falls through to the next tier, then to "miss" (the engine recomputes
  the chunk). Each such event is logged and counted in ``stats.fallbacks``; nothing raises."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from cacheblend_rag.store.disk import KVStore
from cacheblend_rag.store.dtypes import resolve_dtype
from cacheblend_rag.store.lookup import contains_many
from cacheblend_rag.store.memory import MemoryTier
from cacheblend_rag.store.meta import ChunkMeta
from cacheblend_rag.store.protocol import KV, kv_bytes, read_layers
from cacheblend_rag.store.quant import KVFormat, parse_kv_format, roundtrip
from cacheblend_rag.threads import helper_pool

__all__ = ["Tier", "TieredStats", "TieredStore"]

log = logging.getLogger(__name__)


@dataclass
class Tier:
    """One storage level of a ``TieredStore``.

    cost_per_byte: relative price of keeping a byte here (only compared between tiers; the
        loading controller picks the cheapest tier whose load the recompute still hides).
    read_timeout_s: a read (one layer of the chunks asked for together) slower than this counts
        as a failure and falls through (None: wait as long as it takes; reads then run on the
        caller's thread, no hand-off).
    """

    store: Any
    name: str = ""
    cost_per_byte: float = 1.0
    read_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not self.name:
            self.name = getattr(self.store, "tier_name", None) or type(self.store).__name__.lower()


@dataclass
class TieredStats:
    hits: int = 0  # layer reads served by some tier
    misses: int = 0  # layer reads no tier could serve (the engine recomputes the chunk)
    promotions: int = 0  # layers copied up into a faster tier after a lower-tier hit
    fallbacks: int = 0  # a tier failed or timed out and the next one (or recompute) was used
    timeouts: int = 0
    errors: int = 0  # exceptions raised by a tier (reads, writes, lookups)
    bytes_read: int = 0
    bytes_written: int = 0
    write_errors: int = 0
    corrupt: int = 0  # chunks a tier held whose meta claims fewer layers than read: discarded
    tier_hits: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class TieredStore:
    """Chunk KV store over ordered tiers (fastest first); see the module docstring."""

    def __init__(
        self,
        tiers: Sequence[Tier | Any],
        *,
        dtype: str | torch.dtype | None = None,
        cooldown_s: float = 30.0,
        promote: bool = True,
        kv_format: str | KVFormat | None = None,
    ) -> None:
        """``tiers``: ``Tier``s or bare stores, fastest first. ``dtype``: stored dtype
        (``fp32``/``fp16``/``bf16``; None stores what it is given). ``cooldown_s``: how long a
        tier that failed or timed out is skipped before it is tried again. ``kv_format``: the
        quantized format the tensor-keeping tiers hold the decoded values of (default: the format
        of the tiers that write one, else None: float)."""
        self.tiers = [t if isinstance(t, Tier) else Tier(t) for t in tiers]
        if not self.tiers:
            raise ValueError("TieredStore needs at least one tier")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self.dtype = resolve_dtype(dtype)
        formats = [f for t in self.tiers if (f := getattr(t.store, "kv_format", None)) is not None]
        self.kv_format = parse_kv_format(kv_format) if kv_format is not None else (formats[0] if formats else None)
        self.cooldown_s = cooldown_s
        self.promote = promote
        self.stats = TieredStats(tier_hits={n: 0 for n in names})
        self._sick_until = [0.0] * len(self.tiers)
        self._lock = threading.Lock()
        self._pools: dict[int, ThreadPoolExecutor] = {}
        for i, t in enumerate(self.tiers):
            if t.read_timeout_s is not None:
                # Two workers: one abandoned (timed-out) read cannot block the next attempt.
                self._pools[i] = helper_pool(f"cacheblend-tier-{t.name}", 2)
        self._closed = False

    @classmethod
    def memory_over_disk(
        cls,
        directory: str | None = None,
        *,
        memory_bytes: int = 2 * 2**30,
        disk_bytes: int = 8 * 2**30,
        fingerprint: str = "",
        dtype: str | torch.dtype | None = None,
        disk_timeout_s: float | None = None,
        disk: Any | None = None,
        kv_format: str | KVFormat | None = None,
    ) -> TieredStore:
        """The usual set-up: a ``MemoryTier`` in front of a ``KVStore`` on ``directory`` (chunks
        written in ``kv_format``, default float)."""
        disk = (
            disk if disk is not None else KVStore(directory, size_limit=disk_bytes, fingerprint=fingerprint, kv_format=kv_format)
        )
        return cls(
            [Tier(MemoryTier(memory_bytes), "memory", 1.0), Tier(disk, "disk", 0.1, disk_timeout_s)],
            dtype=dtype,
        )

    @property
    def reads_from_memory(self) -> bool:
        """True when every tier reads from memory (store.protocol); a read may reach any tier."""
        return all(getattr(t.store, "reads_from_memory", False) for t in self.tiers)

    # Helpers ---------------------------------------------------------------------------------
    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier named {name!r}; tiers are {[t.name for t in self.tiers]}")

    def _healthy(self, i: int) -> bool:
        return time.monotonic() >= self._sick_until[i]

    def _fail(self, i: int, what: str, exc: BaseException | None) -> None:
        """Count a tier failure and bench the tier for ``cooldown_s``."""
        t = self.tiers[i]
        with self._lock:
            self.stats.fallbacks += 1
            if exc is None:
                self.stats.timeouts += 1
            else:
                self.stats.errors += 1
            self._sick_until[i] = time.monotonic() + self.cooldown_s
        reason = f"took longer than {t.read_timeout_s}s" if exc is None else f"failed: {exc!r}"
        log.warning(
            "storage tier %r %s on %s; skipping it for %.0fs and using the next tier or recompute",
            t.name,
            reason,
            what,
            self.cooldown_s,
        )

    def _call(self, i: int, what: str, fn, *args, timed: bool = False):
        """Run ``fn`` on tier ``i``; on failure/timeout bench the tier and return ``_FAILED``."""
        pool = self._pools.get(i) if timed else None
        try:
            if pool is None:
                return fn(*args)
            return pool.submit(fn, *args).result(timeout=self.tiers[i].read_timeout_s)
        except FutureTimeout:
            self._fail(i, what, None)  # the read goes on in the pool; its result is dropped
        except Exception as exc:  # noqa: BLE001 - a storage fault must degrade, never crash
            self._fail(i, what, exc)
        return _FAILED

    def _cast(self, layers: Sequence[KV]) -> list[KV]:
        if self.dtype is None:
            return list(layers)
        return [(k.to(self.dtype), v.to(self.dtype)) for k, v in layers]

    # The store interface ---------------------------------------------------------------------
    def locate(self, key: str) -> str | None:
        """Name of the first healthy tier holding the whole chunk, or None."""
        for i, t in enumerate(self.tiers):
            if self._healthy(i):
                got = self._call(i, f"lookup of {key[:16]}", t.store.contains, key)
                if got is not _FAILED and got:
                    return t.name
        return None

    def contains(self, key: str) -> bool:
        return self.locate(key) is not None

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """``contains`` of every chunk in ``keys``, each tier asked once for the chunks the tiers
        above it lack (one round trip to a tier with ``contains_many``, such as Redis)."""
        keys = list(keys)
        found = [False] * len(keys)

        def lookup(i: int, t: Tier, todo: list[int]) -> Any:
            got = self._call(i, f"lookup of {len(todo)} chunks", contains_many, t.store, [keys[j] for j in todo])
            if got is not _FAILED:
                for j, hit in zip(todo, got):
                    found[j] = bool(hit)
            return got

        self._down_the_tiers(len(keys), lookup)
        return found

    def _down_the_tiers(self, n: int, ask: Callable[[int, Tier, list[int]], Any]) -> list[int]:
        """Ask the healthy tiers, fastest first, about items ``0..n-1``: ``ask(i, tier, todo)`` is
        given the items no tier above answered and returns, for each, whether this one did (or
        ``_FAILED``: the next tier is asked about all of them). The items no tier answered."""
        todo = list(range(n))
        for i, t in enumerate(self.tiers):
            if not todo:
                break
            if not self._healthy(i):
                continue
            answered = ask(i, t, todo)
            if answered is not _FAILED:
                todo = [j for j, done in zip(todo, answered) if not done]
        return todo

    def meta(self, key: str) -> ChunkMeta | None:
        for i, t in enumerate(self.tiers):
            if self._healthy(i):
                got = self._call(i, f"lookup of {key[:16]}", t.store.meta, key)
                if got is not _FAILED and got is not None:
                    return got
        return None

    def put(self, key: str, layers: Sequence[KV]) -> bool:
        """Write to every healthy tier (memory first). True if at least one tier took it.

        A tier that declines (returns False: full, or a storage fault it logged itself) is
        skipped; one that raises is benched like a failed read."""
        layers = self._cast(layers)
        decoded: list[KV] | None = None  # what kv_format's records read back as, for tensor tiers
        ok = False
        for i, t in enumerate(self.tiers):
            if not self._healthy(i):
                continue
            if self._call(i, f"lookup of {key[:16]}", t.store.contains, key) is True:
                ok = True
                continue
            given = layers
            if self.kv_format is not None and getattr(t.store, "kv_format", None) is None:
                try:
                    decoded = decoded or [roundtrip(self.kv_format, k, v) for k, v in layers]
                except ValueError as exc:  # values the format cannot hold: no tier stores this chunk
                    log.warning("not storing chunk %s: %s", key[:16], exc)
                    return False
                given = decoded
            got = self._call(i, f"write of {key[:16]}", t.store.put, key, given)
            if got is _FAILED:
                with self._lock:
                    self.stats.write_errors += 1
            ok = ok or got is True
        if ok:
            with self._lock:
                self.stats.bytes_written += sum(kv_bytes(k, v) for k, v in layers)
        return ok

    def get_layer(self, key: str, layer: int, device: torch.device | str | None = None) -> KV | None:
        return self.get_layers([key], layer, device)[0]

    def get_layers(self, keys: Sequence[str], layer: int, device: torch.device | str | None = None) -> list[KV | None]:
        """``layer`` of every chunk in ``keys`` (None where no tier has it), each tier asked once
        for the chunks the tiers above it lacked: one round trip to a tier with ``get_layers``."""
        keys = list(keys)
        out: list[KV | None] = [None] * len(keys)

        def read(i: int, t: Tier, todo: list[int]) -> Any:
            asked = [keys[j] for j in todo]
            what = f"read of {asked[0][:16]}/{layer}" + (f" and {len(asked) - 1} more chunks" if len(asked) > 1 else "")
            got = self._call(i, what, self._read_layers, t, asked, layer, device, timed=True)
            if got is _FAILED:
                return got
            for j, kv in zip(todo, got):
                if kv is None:
                    continue
                out[j] = kv
                with self._lock:
                    self.stats.hits += 1
                    self.stats.bytes_read += kv_bytes(*kv)
                    self.stats.tier_hits[t.name] += 1
                if self.promote and i > 0:
                    self._promote(i, keys[j], layer, *kv)
            return [kv is not None for kv in got]

        missed = self._down_the_tiers(len(keys), read)
        with self._lock:
            self.stats.misses += len(missed)
        return out

    def _read_layers(self, tier: Tier, keys: list[str], layer: int, device) -> list[KV | None]:
        """``read_layers`` on one tier, where a chunk whose meta record claims fewer layers than
        asked for (IndexError: a forged meta, or another model's) is that chunk's fault, not the
        tier's: it is discarded from the tier and read as a miss. Benching the tier instead left
        the record in place (a benched tier is not cleaned), so it benched the tier again after
        every cool-down."""
        try:
            return read_layers(tier.store, keys, layer, device)
        except IndexError:
            pass
        out: list[KV | None] = []
        for key in keys:
            try:
                out.append(tier.store.get_layer(key, layer, device))
            except IndexError as exc:
                log.warning("storage tier %r: chunk %s: %s; discarding it", tier.name, key[:16], exc)
                with self._lock:
                    self.stats.corrupt += 1
                tier.store.discard(key)
                out.append(None)
        return out

    def _promote(self, src: int, key: str, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        uppers = [j for j in range(src) if hasattr(self.tiers[j].store, "put_layer") and self._healthy(j)]
        if not uppers:
            return
        # The layer count from a tier that remembers it (the memory tier above, or the batched
        # reader's metas below) before asking the source tier: that would be a round trip per chunk.
        num_layers = next(
            (n for j in [*uppers, src] if (n := getattr(self.tiers[j].store, "num_layers_of", lambda _: None)(key))), None
        )
        if num_layers is None:
            meta = self._call(src, f"lookup of {key[:16]}", self.tiers[src].store.meta, key)
            if meta is _FAILED or meta is None:
                return
            num_layers = meta.num_layers
        for j in uppers:
            if (
                self._call(j, f"promotion of {key[:16]}", self.tiers[j].store.put_layer, key, layer, k, v, num_layers)
                is not _FAILED
            ):
                with self._lock:
                    self.stats.promotions += 1

    def discard(self, key: str) -> None:
        """Drop the chunk from every healthy tier. A benched tier keeps its copy: it was slow or
        unreachable, not wrong (a store that finds a corrupt record drops it itself)."""
        for i, t in enumerate(self.tiers):
            if self._healthy(i):
                self._call(i, f"discard of {key[:16]}", t.store.discard, key)

    def volume(self) -> int:
        """Bytes held by the tiers that can say. A tier that cannot (a Redis ACL user without
        ``+info``, a store that is down) counts 0 and is not benched: a size query is not a read,
        and benching would send the tier's reads to recompute."""
        total = 0
        for t in self.tiers:
            try:
                got = t.store.volume()
            except Exception as exc:  # noqa: BLE001 - a statistic must not fail or change the store
                log.debug("storage tier %r cannot report its volume: %r", t.name, exc)
                continue
            total += got if isinstance(got, int) else 0
        return total

    def clear(self) -> None:
        for i, t in enumerate(self.tiers):
            if hasattr(t.store, "clear"):
                self._call(i, "clear", t.store.clear)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        for i, t in enumerate(self.tiers):
            self._call(i, "close", t.store.close)

    @property
    def directory(self):
        """The first tier's directory that has one (the disk store's), for tools that print it."""
        for t in self.tiers:
            if hasattr(t.store, "directory"):
                return t.store.directory
        return None

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return "TieredStore(" + ", ".join(f"{t.name}={t.store!r}" for t in self.tiers) + ")"


_FAILED = object()  # sentinel: the tier raised or timed out
