"""Which cross-chunk-aware cache serves a chunk: the one whose prefix best matches the prompt.

A chunk may have several caches, each prefilled behind different chunks: its most similar chunks
(embedding neighbours, ``precompute(neighbours=n)``: the cold start) and the chunks it is most often
retrieved behind (learned from the traffic, ``learned_neighbours.py``). At request time the cache
whose prefix holds most of the chunks actually in front of it in the prompt is used, the chunks
right in front counting first: a cache prefilled behind exactly the prompt's preceding chunks has
full prefill's K/V for that chunk.

A learned cache is computed from the traffic: behind chunks that some request carried. It serves
a chunk only where every chunk it was computed behind is in front of that chunk in the prompt
(:meth:`NeighbourCache.serves`), so its K/V hold only text the prompt itself carries: one client's
documents never shape another client's answer, and a request with documents a client may not see
cannot leave them in a cache that others are served. Caches from ``precompute(neighbours=n)`` are
computed behind the corpus the application precomputed (its own documents) and serve any prompt.

Every cache is named by plain chunk keys, which hash the texts' tokens: a chunk whose text changed
has a new key and none of the old caches, and a cache prefilled behind a since-changed chunk no
longer matches the prompt's key for it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cachetools

__all__ = ["NeighbourCache", "NeighbourIndex"]


@dataclass(frozen=True)
class NeighbourCache:
    key: str
    """The store key of the cache."""
    behind: tuple[str, ...]
    """Plain keys of the chunks it was prefilled behind, in prefill order."""
    learned: bool
    """Behind the chunks it is retrieved with (True) or behind its most similar chunks (False)."""

    def serves(self, preceding: Sequence[str]) -> bool:
        """Whether this cache may serve its chunk behind ``preceding`` (plain keys in prompt order):
        a learned cache only where every chunk it was computed behind precedes the chunk (it holds
        text from the request that taught it); a precomputed one anywhere."""
        return not self.learned or set(self.behind) <= set(preceding)

    def match(self, preceding: Sequence[str]) -> tuple[int, int]:
        """How well this cache fits behind ``preceding`` (plain keys in prompt order): how many of
        its chunks precede it, then how many of the chunks right in front of it equal the end of its
        prefix (a common suffix)."""
        shared = len(set(self.behind) & set(preceding))
        suffix = 0
        for mine, theirs in zip(reversed(self.behind), reversed(preceding)):
            if mine != theirs:
                break
            suffix += 1
        return shared, suffix


class NeighbourIndex:
    """Plain chunk key -> its cross-chunk-aware caches (at most ``max_per_chunk`` each, for at most
    ``max_chunks`` chunks, the least recently added forgotten first)."""

    def __init__(self, max_per_chunk: int = 4, max_chunks: int = 100_000) -> None:
        if max_per_chunk < 1 or max_chunks < 1:
            raise ValueError(f"max_per_chunk={max_per_chunk} and max_chunks={max_chunks} must both be >= 1")
        self.max_per_chunk, self.max_chunks = max_per_chunk, max_chunks
        # A chunk is popped and put back when added to, so iteration (items) runs in the order the
        # FIFOCache evicts: least recently added first.
        self._caches: cachetools.FIFOCache[str, list[NeighbourCache]] = cachetools.FIFOCache(max_chunks)
        self._lock = threading.Lock()

    def add(self, chunk: str, cache: NeighbourCache) -> None:
        """Record ``cache`` for ``chunk``; it replaces one prefilled behind the same chunks. Beyond
        ``max_per_chunk`` the oldest learned cache goes first (the embedding one is the fallback)."""
        with self._lock:
            caches = [c for c in self._caches.pop(chunk, []) if c.behind != cache.behind] + [cache]
            while len(caches) > self.max_per_chunk:
                caches.remove(next((c for c in caches if c.learned), caches[0]))
            self._caches[chunk] = caches  # evicts the least recently added chunk beyond max_chunks

    def caches(self, chunk: str) -> list[NeighbourCache]:
        with self._lock:
            return list(self._caches.get(chunk, ()))

    def items(self) -> list[tuple[str, list[NeighbourCache]]]:
        """Every chunk with its caches, least recently added first."""
        with self._lock:
            return [(chunk, list(caches)) for chunk, caches in self._caches.items()]

    def has(self, chunk: str, behind: Sequence[str]) -> bool:
        return any(c.behind == tuple(behind) for c in self.caches(chunk))

    def choose(self, chunk: str, preceding: Sequence[str], usable=lambda key: True) -> NeighbourCache | None:
        """The cache for ``chunk`` behind ``preceding`` (plain keys in prompt order), among those
        that :meth:`NeighbourCache.serves` this prompt and ``usable(key)`` accepts (e.g. still
        stored): best :meth:`NeighbourCache.match`, then learned before embedding, then the newest.
        None when the chunk has no usable cache."""
        best, best_rank = None, None
        for age, cache in enumerate(self.caches(chunk)):
            rank = (*cache.match(preceding), cache.learned, age)
            if (best_rank is None or rank > best_rank) and cache.serves(preceding) and usable(cache.key):
                best, best_rank = cache, rank
        return best

    def __len__(self) -> int:
        return len(self._caches)

    # ------------------------------------------------------------------ persistence
    def to_json(self) -> dict[str, Any]:
        return {
            "max_per_chunk": self.max_per_chunk,
            "max_chunks": self.max_chunks,
            "caches": [[chunk, [[c.key, list(c.behind), c.learned] for c in caches]] for chunk, caches in self.items()],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NeighbourIndex:
        """The index saved by :meth:`to_json`; raises ``ValueError`` on anything malformed."""
        try:
            out = cls(int(data["max_per_chunk"]), int(data["max_chunks"]))
            for chunk, caches in data["caches"]:
                for key, behind, learned in caches:
                    if not (
                        isinstance(chunk, str)
                        and isinstance(key, str)
                        and isinstance(learned, bool)
                        and all(isinstance(b, str) for b in behind)
                    ):
                        raise ValueError("a neighbour cache entry is not [key, [chunk keys], learned]")
                    out.add(chunk, NeighbourCache(key, tuple(behind), learned))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed neighbour index: {exc!r}") from exc
        return out
