"""Eviction policies: which record a bounded tier drops first.

The memory tier (``tiers.MemoryTier``) takes a policy by name:

* ``"lru"``: least recently used (read or written) first.
* ``"lfu"``: least frequently used first, ties to the least recently used. Counts are kept for
  records evicted lately too (up to ``history`` times the resident count), so a chunk that keeps
  coming back from a lower tier earns its place instead of being the next victim each time; every
  ``decay_every`` accesses per resident record all counts are halved, so yesterday's hot chunks
  make way for today's.

:class:`PolicyCache` is the memory tier's store: a ``cachetools.Cache`` bounded by bytes whose
victims the policy picks.

The disk tier's policy is diskcache's own (``least-recently-stored``, ``least-recently-used``,
``least-frequently-used``); :func:`set_disk_policy` switches an open disk store to another one.

``bench.replay`` measures them under a query stream; docs/cluster.md has the tables that chose the
defaults: ``"lfu"`` for the memory tier (:data:`DEFAULT_MEMORY_POLICY`) and ``least-recently-used``
for the disk store. diskcache's ``least-frequently-used`` hit most on a steady stream but never
forgets a count, so once other chunks became popular it kept the old ones and hit least of all;
``least-recently-stored`` ignores reads, so it drops chunks that are being hit.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import cachetools

__all__ = [
    "DEFAULT_MEMORY_POLICY",
    "DISK_POLICIES",
    "MEMORY_POLICIES",
    "EvictionPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "PolicyCache",
    "make_policy",
    "set_disk_policy",
]

DISK_POLICIES = ("least-recently-stored", "least-recently-used", "least-frequently-used")


class EvictionPolicy(Protocol):
    """Orders a tier's resident records; the tier keeps the data and asks for a victim."""

    name: str

    def add(self, item: Hashable) -> None:
        """A record was written (an access, too)."""
        ...

    def touch(self, item: Hashable) -> None:
        """A resident record was read."""
        ...

    def remove(self, item: Hashable) -> None:
        """A record left the tier (evicted or discarded); no error if unknown."""
        ...

    def victim(self) -> Hashable:
        """The record to evict next (still resident until ``remove``); KeyError when empty."""
        ...

    def clear(self) -> None: ...

    def __len__(self) -> int: ...


class LRUPolicy:
    name = "lru"

    def __init__(self) -> None:
        # An order, not a cache: it holds no values and no bound (PolicyCache holds both).
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def add(self, item: Hashable) -> None:
        self._order[item] = None
        self._order.move_to_end(item)

    def touch(self, item: Hashable) -> None:
        if item in self._order:
            self._order.move_to_end(item)

    def remove(self, item: Hashable) -> None:
        self._order.pop(item, None)

    def victim(self) -> Hashable:
        if not self._order:
            raise KeyError("no resident record to evict")
        return next(iter(self._order))

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)


class LFUPolicy:
    """See the module docstring. O(log n) per access: a heap of (count, last access, item)
    entries, stale ones skipped when they surface and the heap rebuilt when mostly stale."""

    name = "lfu"

    def __init__(self, *, history: int = 4, decay_every: int = 32) -> None:
        if history < 1 or decay_every < 1:
            raise ValueError(f"history={history} and decay_every={decay_every} must be >= 1")
        self.history, self.decay_every = history, decay_every
        self._count: dict[Hashable, int] = {}  # resident and recently evicted records
        self._last: dict[Hashable, int] = {}  # access tick of resident records
        # Evicted records whose count is kept, oldest first: an order with no values, whose bound
        # (``history`` times the resident count) moves with the tier, so no fixed-size cache.
        self._gone: OrderedDict[Hashable, None] = OrderedDict()
        self._heap: list[tuple[int, int, Hashable]] = []
        self._tick = 0
        self._since_decay = 0

    def _access(self, item: Hashable) -> None:
        self._tick += 1
        self._count[item] = self._count.get(item, 0) + 1
        self._last[item] = self._tick
        self._gone.pop(item, None)
        heapq.heappush(self._heap, (self._count[item], self._tick, item))
        self._since_decay += 1
        if self._since_decay >= self.decay_every * max(1, len(self._last)):
            self._decay()
        elif len(self._heap) > 4 * len(self._last) + 64:
            self._rebuild()

    def add(self, item: Hashable) -> None:
        self._access(item)

    def touch(self, item: Hashable) -> None:
        if item in self._last:
            self._access(item)

    def remove(self, item: Hashable) -> None:
        if self._last.pop(item, None) is None:
            return
        self._gone[item] = None  # its count stays a while: it may come back
        while len(self._gone) > self.history * max(1, len(self._last)):
            old, _ = self._gone.popitem(last=False)
            self._count.pop(old, None)

    def victim(self) -> Hashable:
        while self._heap:
            count, tick, item = self._heap[0]
            if self._last.get(item) == tick and self._count.get(item) == count:
                return item
            heapq.heappop(self._heap)  # stale: accessed again, decayed or gone since
        raise KeyError("no resident record to evict")

    def _decay(self) -> None:
        self._since_decay = 0
        for item in list(self._count):
            self._count[item] //= 2
            if self._count[item] == 0 and item in self._gone:
                del self._count[item], self._gone[item]
        self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(self._count[i], t, i) for i, t in self._last.items()]
        heapq.heapify(self._heap)

    def clear(self) -> None:
        self._count.clear()
        self._last.clear()
        self._gone.clear()
        self._heap.clear()

    def __len__(self) -> int:
        return len(self._last)


class _WrittenIsVictim(Exception):
    """PolicyCache.popitem: the record being written is the policy's victim."""


_NOTHING = object()


class PolicyCache(cachetools.Cache):
    """A ``cachetools.Cache`` whose victims an :class:`EvictionPolicy` picks (``maxsize`` counts
    what ``getsizeof`` says: bytes for the memory tier).

    Built on cachetools' documented extension points: ``__getitem__`` (a read: ``policy.touch``),
    ``__setitem__`` (a write: ``policy.add``), ``__delitem__`` (``policy.remove``) and ``popitem``
    (the victim, reported to ``on_evict(key, value)``). ``pop`` and ``del`` are not reads.

    One rule cachetools' own caches lack: the write is an access the policy weighs before anything
    is evicted, so the record being written may itself be the victim (under ``"lfu"``, a new record
    colder than every resident one does not displace them; its count is kept, and it earns its
    place by coming back). That record is then not stored (a replaced one is dropped) and
    ``on_evict`` is told of it as of any victim."""

    def __init__(
        self,
        maxsize: int,
        policy: EvictionPolicy,
        getsizeof: Callable[[Any], int] | None = None,
        on_evict: Callable[[Hashable, Any], None] | None = None,
    ) -> None:
        super().__init__(maxsize, getsizeof)
        self.policy = policy
        self._on_evict = on_evict
        self._writing: Any = _NOTHING

    def __getitem__(self, key: Hashable) -> Any:
        value = super().__getitem__(key)
        self.policy.touch(key)
        return value

    def __setitem__(self, key: Hashable, value: Any) -> None:
        self.policy.add(key)
        self._writing = key
        try:
            super().__setitem__(key, value)
        except _WrittenIsVictim:
            if key in self:
                del self[key]
            else:
                self.policy.remove(key)
            if self._on_evict is not None:
                self._on_evict(key, value)
        finally:
            self._writing = _NOTHING

    def __delitem__(self, key: Hashable) -> None:
        super().__delitem__(key)
        self.policy.remove(key)

    def pop(self, key: Hashable, default: Any = _NOTHING) -> Any:
        if key in self:
            value = cachetools.Cache.__getitem__(self, key)
            del self[key]
            return value
        if default is _NOTHING:
            raise KeyError(key)
        return default

    def popitem(self) -> tuple[Hashable, Any]:
        try:
            key = self.policy.victim()
        except KeyError:
            raise KeyError(f"{type(self).__name__} is empty") from None
        if self._writing is not _NOTHING and key == self._writing:
            raise _WrittenIsVictim
        value = cachetools.Cache.__getitem__(self, key)
        del self[key]
        if self._on_evict is not None:
            self._on_evict(key, value)
        return key, value

    def clear(self) -> None:
        super().clear()
        self.policy.clear()


MEMORY_POLICIES = {"lru": LRUPolicy, "lfu": LFUPolicy}
# Chosen by bench.replay (docs/cluster.md): with every disk policy, on a steady and on a drifting
# Zipf stream, "lfu" kept a higher chunk hit rate (1-7 points) and served a larger share of the
# reads from memory (about 0.7 against 0.5-0.6) than "lru".
DEFAULT_MEMORY_POLICY = "lfu"


def make_policy(policy: str | EvictionPolicy | None) -> EvictionPolicy:
    """A policy object from its name (``MEMORY_POLICIES``), or the object itself."""
    if policy is None:
        policy = DEFAULT_MEMORY_POLICY
    if isinstance(policy, str):
        if policy not in MEMORY_POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}: use one of {sorted(MEMORY_POLICIES)}")
        return MEMORY_POLICIES[policy]()
    for method in ("add", "touch", "remove", "victim", "clear"):
        if not callable(getattr(policy, method, None)):
            raise TypeError(f"eviction policy {policy!r} has no {method}() method (see store.eviction.EvictionPolicy)")
    return policy


def set_disk_policy(store: Any, policy: str) -> None:
    """Switch an open disk store (``disk.KVStore``) to diskcache's ``policy`` (``DISK_POLICIES``)."""
    if policy not in DISK_POLICIES:
        raise ValueError(f"unknown disk eviction policy {policy!r}: use one of {list(DISK_POLICIES)}")
    cache = getattr(store, "_cache", None)
    if cache is None or not hasattr(cache, "reset"):
        raise TypeError(f"{store!r} is not a writable disk store: cannot set its eviction policy")
    cache.reset("eviction_policy", policy)
