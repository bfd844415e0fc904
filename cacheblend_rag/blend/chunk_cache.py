"""Chunk caches: the instruction prefix's K/V, one chunk's prefill, precompute and write-back.

A chunk's cache is its own K/V, prefilled right behind the instruction prefix (or behind its most
similar chunks, for a cross-chunk-aware cache) and stored with its keys rotated as if the chunk
sat right after the prefix; the loader moves them to wherever the chunk lands in a prompt. The
key holds the prefix, so a request whose prefix differs (tools rendered into the system part) has
chunk caches of its own. The store to read or write is passed to each call, never kept, so one
chunk cache serves any store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace

import torch
from cachetools import LRUCache
from tqdm.auto import tqdm
from transformers import DynamicCache

from cacheblend_rag.blend.planner import COMPUTE, PREFIX, Load
from cacheblend_rag.chat.prompt import PromptBuilder, Segment
from cacheblend_rag.model.backbone import Backbone, cache_from, cache_layers
from cacheblend_rag.neighbours.index import NeighbourCache, NeighbourIndex
from cacheblend_rag.rope import shift_keys
from cacheblend_rag.store.keys import chunk_key
from cacheblend_rag.store.loader import LoadSpec
from cacheblend_rag.store.lookup import contains_many
from cacheblend_rag.store.protocol import KV, ChunkStore
from cacheblend_rag.store.quant import roundtrip
from cacheblend_rag.threads import helper_pool

__all__ = ["ChunkCache"]

log = logging.getLogger(__name__)
# Prefixes whose K/V a chunk cache keeps in memory: the instruction's and a few tool sets'.
MAX_PREFIXES = 8


def _report_failure(fut: Future) -> None:
    # A store's put returns False on storage faults (store.protocol); anything it raises would
    # otherwise vanish with the write-back's future, and the chunk be recomputed without a word.
    exc = None if fut.cancelled() else fut.exception()
    if exc is not None:
        log.warning("a background KV write-back failed (the chunk is recomputed when next needed): %r", exc)


class ChunkCache:
    def __init__(self, backbone: Backbone, prompts: PromptBuilder, fingerprint: str, device: torch.device):
        self.backbone, self.prompts, self.fingerprint, self.device = backbone, prompts, fingerprint, device
        # Prefix token ids -> its K/V, [layers](K, V) [1, kv_heads, prefix, head_dim]: the engine's
        # instruction prefix and the few tool-set prefixes in use (least recently used dropped).
        self._prefix_kv: LRUCache[tuple[int, ...], list[KV]] = LRUCache(MAX_PREFIXES)
        # Plain chunk key -> its cross-chunk-aware caches (precompute(neighbours=n), learned ones).
        # Named by content keys, so a changed chunk text never finds an old cache.
        self.neighbours = NeighbourIndex()
        self._lock = threading.Lock()
        self._writer = helper_pool("cacheblend-writeback")

    # ------------------------------------------------------------------ keys
    def key(self, segment: Segment, context_ids: Sequence[int] | None = None) -> str:
        """The store key of ``segment`` prefilled behind ``context_ids`` (default: the instruction prefix)."""
        return chunk_key(self.fingerprint, self._prefix(context_ids), segment.token_ids)

    def prefix_key(self, prefix_ids: Sequence[int] | None = None) -> str:
        """The prefix's key (default: the instruction prefix): a segment behind an empty context,
        as prefix caching finds it."""
        return chunk_key(self.fingerprint, (), self._prefix(prefix_ids))

    def _prefix(self, prefix_ids: Sequence[int] | None) -> tuple[int, ...]:
        return self.prompts.prefix_ids if prefix_ids is None else tuple(prefix_ids)

    # ------------------------------------------------------------------ computing
    def _prefix_kv_of(self, prefix: tuple[int, ...]) -> list[KV]:
        with self._lock:
            kv = self._prefix_kv.get(prefix)
            if kv is None:
                cache, _ = self.backbone.forward(torch.tensor(prefix, device=self.device))
                kv = self._prefix_kv[prefix] = cache_layers(cache)
            return kv

    def prefix_cache(self, prefix_ids: Sequence[int] | None = None) -> DynamicCache:
        """A fresh cache holding the prefix's K/V (default: the instruction prefix; computed once
        and kept for the last ``MAX_PREFIXES`` prefixes used)."""
        return cache_from(self._prefix_kv_of(self._prefix(prefix_ids)))

    def prefix_layers(self, prefix_ids: Sequence[int] | None = None) -> list[KV]:
        """The prefix's K/V as a store holds them: [layers](K, V) [kv_heads, prefix, head_dim]."""
        return [(k[0], v[0]) for k, v in self._prefix_kv_of(self._prefix(prefix_ids))]

    def compute(self, segment: Segment, behind: Sequence[Segment] = (), prefix_ids: Sequence[int] | None = None) -> list[KV]:
        """Prefill one chunk behind the prefix (default: the instruction prefix) and the ``behind``
        segments (a cross-chunk-aware cache); return its own K/V per layer, ``[layers](K, V)
        [kv_heads, len(segment), head_dim]``, with keys rotated as if the chunk sat right after the prefix."""
        prefix = self._prefix(prefix_ids)
        plen = len(prefix)
        ids = [t for seg in behind for t in seg.token_ids] + list(segment.token_ids)
        start = plen + len(ids) - len(segment)  # where the chunk itself begins
        cache, _ = self.backbone.forward(torch.tensor(ids, device=self.device), start=plen, cache=self.prefix_cache(prefix))
        rotary = self.backbone.rotary_emb
        return [
            # Loaders shift keys from the position right after the prefix: un-rotate them there.
            (shift_keys(rotary, k[0, :, start:], plen - start).contiguous(), v[0, :, start:].contiguous())
            for k, v in cache_layers(cache)
        ]

    # ------------------------------------------------------------------ storing
    def store_prefix(self, store: ChunkStore, prefix_ids: Sequence[int] | None = None) -> None:
        """Store the prefix (default: the instruction prefix) as a segment with an empty context, so
        prefix caching finds it."""
        key = self.prefix_key(prefix_ids)
        if not store.contains(key):
            store.put(key, self.prefix_layers(prefix_ids))

    def precompute(
        self,
        store: ChunkStore,
        texts: Sequence[str],
        *,
        neighbours: int = 0,
        embed: Callable[[list[str]], torch.Tensor] | None = None,
        corpus: Sequence[str] | None = None,
        progress: bool = True,
        prefix_ids: Sequence[int] | None = None,
    ) -> int:
        """Compute and store every chunk of ``texts`` (distinct, checked) that ``store`` lacks, and
        with ``neighbours`` > 0 each chunk's cache behind its most similar chunks of ``corpus``
        (distinct, checked; default ``texts``), all behind ``prefix_ids`` (default: the instruction
        prefix). Returns how many caches were computed."""
        prefix = self._prefix(prefix_ids)
        segments = [self.prompts.chunk_segment(t) for t in texts]
        plen = len(prefix)
        computed = 0
        self.store_prefix(store, prefix)
        keys = []
        for seg in segments:  # every chunk checked before any is computed
            self.backbone.check_fits(plen + len(seg), f"chunk {seg.text[:40]!r}...")
            keys.append(self.key(seg, prefix))
        # Only the chunks the store lacks go on the bar (one lookup for all, one round trip to
        # Redis), so its chunks/s and time left are the computing's, also when a run resumes.
        todo = [(seg, key) for seg, key, hit in zip(segments, keys, contains_many(store, keys)) if not hit]
        for seg, key in tqdm(todo, desc="precompute KV", unit="chunk", disable=not progress):
            if store.contains(key):  # stored meanwhile by another process
                continue
            store.put(key, self.compute(seg, prefix_ids=prefix))
            computed += 1
        if neighbours == 0:
            return computed
        from cacheblend_rag.neighbours.choice import nearest

        pool = list(texts) if corpus is None else list(corpus)
        near = nearest(list(texts), neighbours, embed, corpus=pool)
        # Tokenised once, however many chunks sit behind it; without a corpus, ``segments`` already are.
        pool_segments: dict[int, Segment] = dict(enumerate(segments)) if corpus is None else {}
        for seg, idx in tqdm(list(zip(segments, near)), desc="precompute neighbour-aware KV", unit="chunk", disable=not progress):
            if not idx:
                continue
            for j in idx:
                if j not in pool_segments:
                    pool_segments[j] = self.prompts.chunk_segment(pool[j])
            behind = [pool_segments[j] for j in idx]
            _, fresh = self.compute_behind(store, seg, behind, learned=False, prefix_ids=prefix)
            computed += fresh
        return computed

    def compute_behind(
        self,
        store: ChunkStore,
        segment: Segment,
        behind: Sequence[Segment],
        *,
        learned: bool,
        prefix_ids: Sequence[int] | None = None,
    ) -> tuple[str, bool]:
        """Store ``segment``'s cache prefilled behind ``prefix_ids`` (default: the instruction
        prefix) and ``behind`` (unless stored already) and index it as one of its neighbour-aware
        caches, under its plain key behind that prefix; returns its key and whether it was computed now."""
        prefix = self._prefix(prefix_ids)
        context = list(prefix) + [t for b in behind for t in b.token_ids]
        self.backbone.check_fits(
            len(context) + len(segment), f"chunk {segment.text[:40]!r}... behind {len(behind)} neighbours (use fewer neighbours)"
        )
        nb_key = self.key(segment, context_ids=context)
        fresh = not store.contains(nb_key)
        if fresh:
            store.put(nb_key, self.compute(segment, behind, prefix))
        plain = self.key(segment, prefix)
        self.neighbours.add(plain, NeighbourCache(nb_key, tuple(self.key(b, prefix) for b in behind), learned))
        return nb_key, fresh

    def fill(
        self, loads: Sequence[Load], store: ChunkStore, prefix_ids: Sequence[int] | None = None
    ) -> tuple[list[LoadSpec], float]:
        """The loader's specs for a plan's ``loads`` over ``prefix_ids`` (default: the instruction
        prefix): a miss is computed now (and written back), the prefix the store lacks comes from
        this process's copy. Also returns the seconds spent computing misses."""
        specs: list[LoadSpec] = []
        miss_s = 0.0
        for load in loads:
            if load.source == COMPUTE:
                t0 = time.perf_counter()
                kv = self.compute(load.segment, prefix_ids=prefix_ids)
                miss_s += time.perf_counter() - t0
                self.write_back(store, load.spec.key, kv)
                specs.append(replace(load.spec, kv=self._as_read_back(store, kv)))
            elif load.source == PREFIX:
                specs.append(replace(load.spec, kv=self.prefix_layers(prefix_ids)))
            else:
                specs.append(load.spec)
        return specs, miss_s

    def _as_read_back(self, store: ChunkStore, kv: list[KV]) -> list[KV]:
        """``kv`` as ``store``'s records will read it back: a quantized store's chunk computed now
        answers as it will once cached, so an answer does not depend on whether the background
        write-back had finished (the tiers keep the same invariant, ``store.tiers``)."""
        fmt = getattr(store, "kv_format", None)
        if fmt is None:
            return kv
        return [tuple(t.to(self.device) for t in roundtrip(fmt, k, v)) for k, v in kv]

    def write_back(self, store: ChunkStore, key: str, kv: Sequence[KV]) -> None:
        """Store a chunk computed during a request, in the background (the answer does not wait)."""
        self._writer.submit(store.put, key, kv).add_done_callback(_report_failure)

    def write_back_spans(self, store: ChunkStore, spans: Sequence[tuple[str, int, int]], kv: Sequence[KV]) -> None:
        """Store segments of a prompt's K/V, ``spans`` (key, offset, length), in the background:
        the slicing copies too run off the request's path. ``kv`` is [layers](K, V) [1, kv_heads,
        prompt, head_dim]; nothing writes into it in place afterwards (decoding appends into new
        tensors), so the writer reads the very values the answer used."""

        def put(key: str, off: int, n: int) -> None:
            store.put(key, [(k[0, :, off : off + n].contiguous(), v[0, :, off : off + n].contiguous()) for k, v in kv])

        for span in spans:
            self._writer.submit(put, *span).add_done_callback(_report_failure)

    def flush(self) -> None:
        """Wait for background write-backs to finish."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the write-backs; the chunk cache writes nothing afterwards."""
        self._writer.shutdown(wait=True)
