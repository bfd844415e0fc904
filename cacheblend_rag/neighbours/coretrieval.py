"""Which chunks a chunk is retrieved behind: bounded co-retrieval counts learned from the traffic.

A chunk's cross-chunk-aware cache is worth most when it was prefilled behind the chunks that
actually precede it in prompts (fusion-quality research: neighbours chosen among the prompt's own
chunks keep most of full prefill's answers, the most similar chunks of a corpus about two thirds of
that). Every fused request records, for each chunk, the chunks in front of it; the most frequent
ones are the chunk's learned neighbours (``learned_neighbours.py`` caches the chunk behind them).

Memory is bounded twice: at most ``max_chunks`` chunks are tracked (the least recently retrieved
is forgotten first), and each keeps at most ``max_predecessors`` counters, maintained with the
Space-Saving algorithm (Metwally et al., 2005): a new predecessor takes over the smallest counter
and inherits its count, so every predecessor retrieved more often than 1/``max_predecessors`` of
the time is kept, with a count that over-estimates by at most the evicted minimum.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import cachetools

__all__ = ["CoRetrieval"]


class CoRetrieval:
    """Per chunk key, how often each other chunk key was retrieved in front of it."""

    def __init__(self, max_chunks: int = 100_000, max_predecessors: int = 8) -> None:
        if max_chunks < 1 or max_predecessors < 1:
            raise ValueError(f"max_chunks={max_chunks} and max_predecessors={max_predecessors} must both be >= 1")
        self.max_chunks, self.max_predecessors = max_chunks, max_predecessors
        # chunk -> predecessor -> count, least recently retrieved first. A chunk is popped and put
        # back when retrieved, so iteration (to_json) runs in the order the FIFOCache evicts.
        self._counts: cachetools.FIFOCache[str, dict[str, int]] = cachetools.FIFOCache(max_chunks)
        self._lock = threading.Lock()

    def record(self, keys: Sequence[str]) -> None:
        """One prompt's chunks, in prompt order: each is counted as retrieved behind every chunk before it."""
        with self._lock:
            for i, key in enumerate(keys):
                counts = self._counts.pop(key, {})
                self._counts[key] = counts  # most recently retrieved last (the least recent evicted)
                for pred in dict.fromkeys(keys[:i]):
                    if pred == key:
                        continue
                    if pred in counts or len(counts) < self.max_predecessors:
                        counts[pred] = counts.get(pred, 0) + 1
                    else:
                        smallest = min(counts, key=counts.__getitem__)
                        counts[pred] = counts.pop(smallest) + 1

    def predecessors(self, key: str, n: int) -> list[str]:
        """The ``n`` chunks most often retrieved in front of ``key``, most frequent first; among
        equally frequent ones the one counted later first (a prompt's chunks are counted in prompt
        order, so after a single prompt the chunk right in front of ``key`` ranks first)."""
        with self._lock:
            counts = dict(self._counts.get(key, {}))
        return sorted(reversed(list(counts)), key=lambda p: -counts[p])[:n]

    def count(self, key: str, predecessor: str) -> int:
        with self._lock:
            return self._counts.get(key, {}).get(predecessor, 0)

    def __len__(self) -> int:
        return len(self._counts)

    # ------------------------------------------------------------------ persistence
    def to_json(self) -> dict[str, Any]:
        with self._lock:
            return {
                "max_chunks": self.max_chunks,
                "max_predecessors": self.max_predecessors,
                "counts": [[k, dict(v)] for k, v in self._counts.items()],
            }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CoRetrieval:
        """The statistics saved by :meth:`to_json`; raises ``ValueError`` on anything malformed."""
        try:
            out = cls(int(data["max_chunks"]), int(data["max_predecessors"]))
            for key, counts in data["counts"][-out.max_chunks :]:
                if not isinstance(key, str) or not all(
                    isinstance(p, str) and isinstance(c, int) and c > 0 for p, c in counts.items()
                ):
                    raise ValueError("a co-retrieval entry is not {chunk key: {key: positive count}}")
                kept = sorted(counts.items(), key=lambda pc: -pc[1])[: out.max_predecessors]
                out._counts[key] = dict(kept)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed co-retrieval statistics: {exc!r}") from exc
        return out
