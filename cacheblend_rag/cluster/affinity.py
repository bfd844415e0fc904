"""Chunk affinity: which replica's memory tier already holds most of a request's documents.

Pure Python (no Ray), so the policy is unit-tested on its own; ``cluster.router`` plugs it into
Ray Serve's request router, and each replica reports what it holds with :class:`ResidentChunks`.

A replica's holdings are what it last reported (its routing stats: documents whose chunk caches
are in its memory tier now) plus the requests routed to it since, which its next report will
include or, once evicted, drop. The ranking:

1. Replicas holding the most of the request's documents (at least ``min_match``), unless one is
   busier than the least loaded replica by more than ``max_queue_gap`` requests: a hot replica
   must not queue requests that an idle one could answer from Redis.
2. No replica holds any (or the holders are too busy): the replicas holding the fewest documents
   overall among the least loaded, so a new document lands where it displaces least and the
   corpus spreads across the replicas' memory; ties are broken at random.
3. Every other replica, as the fallback: Serve takes the least loaded one that accepts.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import cachetools

__all__ = ["AffinityPolicy", "AffinityTable", "ResidentChunks"]

R = TypeVar("R", bound=Hashable)


@dataclass(frozen=True)
class AffinityPolicy:
    """min_match: documents a replica must hold to be preferred (default 1).
    max_queue_gap: how many more requests than the least loaded replica a holder may have queued
        and still be preferred (default 4).
    assignment_ttl_s: how long a routing decision counts as a holding before the replica's own
        report must confirm it (default 30 s; several of Serve's routing-stats periods).
    max_assignments: routing decisions remembered (default 65,536 documents).
    """

    min_match: int = 1
    max_queue_gap: int = 4
    assignment_ttl_s: float = 30.0
    max_assignments: int = 65_536

    def __post_init__(self) -> None:
        if isinstance(self.min_match, bool) or not isinstance(self.min_match, int) or self.min_match < 1:
            raise ValueError(f"min_match={self.min_match!r} must be an int >= 1 (documents a replica must hold)")
        if isinstance(self.max_queue_gap, bool) or not isinstance(self.max_queue_gap, int) or self.max_queue_gap < 0:
            raise ValueError(f"max_queue_gap={self.max_queue_gap!r} must be an int >= 0 (requests)")
        if not (isinstance(self.assignment_ttl_s, (int, float)) and self.assignment_ttl_s >= 0):
            raise ValueError(f"assignment_ttl_s={self.assignment_ttl_s!r} must be a number of seconds >= 0")
        if isinstance(self.max_assignments, bool) or not isinstance(self.max_assignments, int) or self.max_assignments < 1:
            raise ValueError(f"max_assignments={self.max_assignments!r} must be an int >= 1")


@dataclass
class AffinityTable(Generic[R]):
    """The router's view: replicas' reported holdings and its own recent decisions."""

    policy: AffinityPolicy = field(default_factory=AffinityPolicy)
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        # digest -> (replica, when), the max_assignments most recent; popped and put back on each
        # decision, so iteration runs in the order the FIFOCache evicts.
        self._assigned: cachetools.FIFOCache[str, tuple[R, float]] = cachetools.FIFOCache(self.policy.max_assignments)
        self._lock = threading.Lock()

    def assign(self, digests: Iterable[str], replica: R) -> None:
        """Record that a request over ``digests`` went to ``replica`` (it computes or reads them there)."""
        now = self.clock()
        with self._lock:
            for d in digests:
                self._assigned.pop(d, None)
                self._assigned[d] = (replica, now)

    def forget(self, replica: R) -> None:
        """Drop a replica's decisions (it died or was scaled down)."""
        with self._lock:
            for d in [d for d, (r, _) in self._assigned.items() if r == replica]:
                del self._assigned[d]

    def holdings(self, reported: Mapping[R, Iterable[str]]) -> dict[R, set[str]]:
        """Each replica's documents: its report plus the fresh decisions routed to it."""
        held = {r: set(docs) for r, docs in reported.items()}
        horizon = self.clock() - self.policy.assignment_ttl_s
        with self._lock:
            for d, (r, when) in self._assigned.items():
                if when >= horizon and r in held:
                    held[r].add(d)
        return held

    def rank(self, digests: Sequence[str], reported: Mapping[R, Iterable[str]], queue: Mapping[R, int | None]) -> list[list[R]]:
        """Replicas in preference order, as ranks (see the module docstring); every replica of
        ``reported`` appears once. ``queue``: requests each replica has in flight (None: unknown,
        counted as idle; Serve probes it before sending)."""
        replicas = list(reported)
        if not replicas:
            return []
        held = self.holdings(reported)
        load = {r: queue.get(r) or 0 for r in replicas}
        idle = min(load.values())
        near_idle = [r for r in replicas if load[r] - idle <= self.policy.max_queue_gap]
        wanted = set(digests)
        first: list[R] = []
        if wanted:
            match = {r: len(wanted & held[r]) for r in near_idle}
            best = max(match.values(), default=0)
            if best >= self.policy.min_match:
                first = [r for r in near_idle if match[r] == best]
        if not first:
            fewest = min(len(held[r]) for r in near_idle)
            first = [r for r in near_idle if len(held[r]) == fewest]
        self.rng.shuffle(first)
        rest = [r for r in replicas if r not in first]
        self.rng.shuffle(rest)
        return [first, rest] if rest else [first]


class ResidentChunks:
    """A replica's record of the documents it served and their chunk keys, reported to the router
    as the documents whose caches its memory tier still holds (bounded: the ``capacity`` most
    recent documents)."""

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity!r} must be >= 1")
        self.capacity = capacity
        # digest -> chunk key, the capacity most recent; popped and put back when recorded again, so
        # iteration (resident) runs in the order the FIFOCache evicts.
        self._keys: cachetools.FIFOCache[str, str] = cachetools.FIFOCache(capacity)
        self._lock = threading.Lock()

    def record(self, pairs: Iterable[tuple[str, str]]) -> None:
        with self._lock:
            for d, key in pairs:
                self._keys.pop(d, None)
                self._keys[d] = key

    def resident(self, holds: Callable[[str], bool]) -> list[str]:
        """Digests whose chunk key ``holds`` (the memory tier's ``contains``); the others are
        forgotten, so the report shrinks as the tier evicts."""
        with self._lock:
            items = list(self._keys.items())
        gone = {d for d, key in items if not holds(key)}
        with self._lock:
            for d in gone:
                self._keys.pop(d, None)
        return [d for d, _ in items if d not in gone]

    def __len__(self) -> int:
        return len(self._keys)
