"""Batched lookups: which of a request's chunks a store holds, asked once per request.

The planner takes the store's contents as a ``contains(key)`` predicate and asks it chunk by
chunk. On a network tier each question is a round trip, so a request over 12 chunks paid 12 round
trips before its first layer was read. :class:`Lookup` asks the store about every key a request
may need in one call (``contains_many``, one ``MGET`` on Redis) and answers the planner from that
answer; a key it was not told about in advance falls through to ``store.contains``, so a missed
key costs a round trip, never a wrong plan.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["Lookup", "contains_many"]


def contains_many(store: Any, keys: Sequence[str]) -> list[bool]:
    """``store.contains_many(keys)`` where the store's class has it (one round trip to a network
    tier), else one ``contains`` per key. Looked up on the class, like ``protocol.batched_reader``:
    a wrapper that overrides ``contains`` keeps seeing every lookup."""
    keys = list(keys)
    if not keys:
        return []
    if hasattr(type(store), "contains_many"):
        return list(store.contains_many(keys))
    return [store.contains(k) for k in keys]


class Lookup:
    """A ``contains`` predicate answered from one batched lookup of ``keys``.

    Held for one plan only: the answers are as old as the request, exactly as a predicate that
    asked the store a moment earlier (a chunk evicted after its lookup is a lost chunk, which the
    engine already retries without)."""

    def __init__(self, store: Any, keys: Iterable[str]) -> None:
        self.store = store
        wanted = list(dict.fromkeys(keys))  # distinct, in order
        self._known = dict(zip(wanted, contains_many(store, wanted)))

    def __call__(self, key: str) -> bool:
        got = self._known.get(key)
        if got is None:
            got = self._known[key] = bool(self.store.contains(key))
        return got
