"""Neighbour-aware caches learned from the traffic, refreshed in the background.

After every fused request the engine hands its chunks (in prompt order) to :meth:`NeighbourLearner.observe`:
the co-retrieval counts are updated (``coretrieval.py``) and every chunk that is not first in the
prompt is checked: if no cache of it exists behind its most frequent predecessors, one is queued.
A single background thread computes the queued caches, one chunk at a time under the engine's
lock, so it runs between requests and batch steps, never beside them: an answer in flight holds
the lock and is never paused or changed, and a request that arrives meanwhile waits at most one
chunk's prefill. The answer that triggered the refresh is not affected at all (it was already
answered); later requests find the new cache through the :class:`~.neighbour_index.NeighbourIndex`.

The counts and the index are saved beside a disk store (``neighbours.json`` in its directory) on
:meth:`close` and every ``save_every`` requests, and read back when an engine opens that store.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, fields
from pathlib import Path

import cachetools

from cacheblend_rag.chat.prompt import Segment
from cacheblend_rag.neighbours.coretrieval import CoRetrieval
from cacheblend_rag.neighbours.index import NeighbourCache, NeighbourIndex
from cacheblend_rag.store.protocol import ChunkStore
from cacheblend_rag.threads import release_team

__all__ = ["LearnConfig", "NeighbourLearner"]

log = logging.getLogger(__name__)

FILE = "neighbours.json"


@dataclass(frozen=True)
class LearnConfig:
    """How neighbours are learned (documented defaults).

    neighbours: how many of a chunk's most frequent predecessors its learned cache is prefilled
        behind (more: closer to the prompts that retrieve it, and a longer prefill per cache).
    min_count: how often a chunk must have been retrieved behind a predecessor before it counts
        (1: a single prompt is enough evidence, so a chunk retrieved with the same chunks again
        is served a cache prefilled behind exactly them).
    max_chunks: chunks whose counts are kept (least recently retrieved forgotten first).
    max_predecessors: counters per chunk (Space-Saving; see ``coretrieval.py``).
    max_caches_per_chunk: neighbour-aware caches kept per chunk (the embedding one included).
    max_pending: queued refreshes; beyond it new ones are dropped (they come back with the traffic).
    max_tokens_per_request: tokens one request may queue for prefill (each new cache's chunk and the
        chunks it is computed behind): the background work a request causes is bounded whatever
        its chunks (two 64-document requests queued 37.8 CPU-seconds before); caches past it are
        not queued, and come back with later requests.
    save_every: requests between saves of ``neighbours.json`` (0: only on close).

    A learned cache serves only prompts that hold every chunk it was computed behind
    (``NeighbourCache.serves``). Learning is off unless ``engine.learn_neighbours()`` is called
    (the server: ``serve --no-neighbours`` leaves it off).
    """

    neighbours: int = 2
    min_count: int = 1
    max_chunks: int = 100_000
    max_predecessors: int = 8
    max_caches_per_chunk: int = 4
    max_pending: int = 256
    max_tokens_per_request: int = 4096
    save_every: int = 64

    def __post_init__(self) -> None:
        for f in fields(self):  # every setting a count: at least 1, save_every 0 too
            value, least = getattr(self, f.name), 0 if f.name == "save_every" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"LearnConfig.{f.name}={value!r} must be an int >= {least}")


@dataclass(frozen=True)
class _Job:
    store: ChunkStore
    chunk: Segment
    behind: tuple[Segment, ...]
    prefix: tuple[int, ...]  # the prompt's prefix the chunks sat behind (the instruction, with tools if any)


class NeighbourLearner:
    """Learns each chunk's neighbours from the requests and caches it behind them in the background.

    ``compute(store, chunk, behind, prefix)`` computes and stores one neighbour-aware cache behind
    the prompt's ``prefix`` and returns its key (``ChunkCache.compute_behind``); ``key(segment,
    prefix)`` is a chunk's plain key behind that prefix; ``lock()`` is the engine's lock (held while
    computing). A chunk's counts and caches are per prefix: a tool set's prompts (tools rendered into
    the prefix) learn their own.
    """

    def __init__(
        self,
        index: NeighbourIndex,
        compute: Callable[[ChunkStore, Segment, Sequence[Segment], tuple[int, ...]], str | None],
        key: Callable[[Segment, Sequence[int]], str],
        lock: Callable[[], ContextManager[object]],
        config: LearnConfig = LearnConfig(),
        directory: str | os.PathLike[str] | None = None,
    ) -> None:
        self.config, self.index = config, index
        self._compute, self._key, self._lock = compute, key, lock
        self._path = None if directory is None else Path(directory) / FILE
        self.stats = CoRetrieval(config.max_chunks, config.max_predecessors)
        # Texts of recently seen chunks; a FIFOCache moves a chunk seen again to the back.
        self._segments: cachetools.FIFOCache[str, Segment] = cachetools.FIFOCache(config.max_chunks)
        self._segments_lock = threading.Lock()
        self._queued: set[tuple[str, tuple[str, ...]]] = set()
        self._jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=config.max_pending)
        self._observed = 0
        self.computed = 0
        """Learned caches computed so far."""
        self._load()
        self._thread = threading.Thread(target=self._work, name="cacheblend-neighbours", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ request path (cheap)
    def observe(self, store: ChunkStore, chunks: Sequence[Segment], prefix: Sequence[int]) -> None:
        """One fused request's chunks, in prompt order, behind its ``prefix``: count them, queue
        the caches now missing."""
        prefix = tuple(prefix)
        keys = [self._key(seg, prefix) for seg in chunks]
        self.stats.record(keys)
        with self._segments_lock:
            for key, seg in zip(keys, chunks):
                self._segments[key] = seg
        budget = self.config.max_tokens_per_request
        for key, seg in list(zip(keys, chunks))[1:]:
            budget -= self._maybe_queue(store, key, seg, prefix, budget)
        self._observed += 1
        if self.config.save_every and self._observed % self.config.save_every == 0:
            self.save()

    def _maybe_queue(self, store: ChunkStore, key: str, seg: Segment, prefix: tuple[int, ...], budget: int) -> int:
        """Queue the cache of ``seg`` behind its learned neighbours if it is missing and its prefill
        (chunk and neighbours, in tokens) fits in ``budget``; the tokens queued."""
        preds = [
            p
            for p in self.stats.predecessors(key, self.config.max_predecessors)
            if self.stats.count(key, p) >= self.config.min_count
        ][: self.config.neighbours]
        if not preds:
            return 0
        # Most frequent right in front of the chunk, as the embedding neighbours are ordered.
        behind_keys = tuple(reversed(preds))
        if self.index.has(key, behind_keys) or (key, behind_keys) in self._queued:
            return 0
        with self._segments_lock:
            behind = tuple(self._segments.get(p) for p in behind_keys)
        if any(b is None for b in behind):
            return 0  # a predecessor's text is no longer known: wait until it is retrieved again
        tokens = len(seg) + sum(len(b) for b in behind)  # type: ignore[arg-type]
        if tokens > budget:
            return 0
        try:
            self._jobs.put_nowait(_Job(store, seg, behind, prefix))  # type: ignore[arg-type]
        except queue.Full:
            return 0
        self._queued.add((key, behind_keys))
        return tokens

    # ------------------------------------------------------------------ background
    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                self._refresh(job)
            finally:
                self._jobs.task_done()

    def _refresh(self, job: _Job) -> None:
        key = self._key(job.chunk, job.prefix)
        behind_keys = tuple(self._key(b, job.prefix) for b in job.behind)
        try:
            with self._lock():
                try:
                    cache_key = self._compute(job.store, job.chunk, job.behind, job.prefix)
                finally:
                    release_team()  # hand the cores back to the thread that answers next
            if cache_key is not None:
                self.index.add(key, NeighbourCache(cache_key, behind_keys, learned=True))
                self.computed += 1
        except Exception as exc:  # noqa: BLE001 - a failed refresh only costs the better cache
            log.warning("could not compute a learned neighbour cache for chunk %s: %r", key[:16], exc)
        finally:
            self._queued.discard((key, behind_keys))

    def wait(self) -> None:
        """Block until every queued refresh is done (tests, benchmarks)."""
        self._jobs.join()

    # ------------------------------------------------------------------ persistence
    def save(self) -> None:
        """Write the counts and the index beside the store (atomically), if it has a directory."""
        if self._path is None:
            return
        data = {"coretrieval": self.stats.to_json(), "index": self.index.to_json()}
        tmp = self._path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        try:
            tmp.write_text(json.dumps(data), encoding="utf-8")
            os.replace(tmp, self._path)
        except OSError as exc:
            log.warning("could not save learned neighbours to %s (they are learned again): %r", self._path, exc)
            tmp.unlink(missing_ok=True)

    def _load(self) -> None:
        if self._path is None or not self._path.is_file():
            return
        try:
            data = json.loads(self._path.read_text(encoding="utf-8"))
            stats = CoRetrieval.from_json(data["coretrieval"])
            index = NeighbourIndex.from_json(data["index"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable %s (neighbours are learned again): %r", self._path, exc)
            return
        self.stats = stats
        for chunk, caches in index.items():
            for cache in caches:
                self.index.add(chunk, cache)

    def close(self) -> None:
        """Finish the queued refreshes, stop the thread, save."""
        if not self._thread.is_alive():
            return
        self._jobs.put(None)
        self._thread.join()
        self.save()
