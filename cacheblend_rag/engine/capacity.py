"""Whether a store can hold the chunk caches of a corpus, checked before any is computed.

``CacheBlendEngine.precompute`` (and through it ``cacheblend-rag ingest`` and both integrations'
precompute helpers) plans the bytes first and refuses what the store cannot hold: a disk store
over its size limit evicts its own least recently used chunks, so a corpus larger than the limit
would evict its first chunks while writing its last, and a full disk fails every writer.
The plan counts what the store writes: records in the store's format, meta records and MACs.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["DISK_MARGIN", "PrecomputePlan", "StoreTooSmall", "check_room", "describe", "plan_precompute"]

# Precompute keeps this share of a disk's free space free: the database and its log grow by more
# than the records (the store's own writes keep a margin too).
DISK_MARGIN = 0.1


class StoreTooSmall(RuntimeError):
    """The store cannot hold the corpus; the message says how much is needed and what to change."""


@dataclass(frozen=True)
class PrecomputePlan:
    """What caching a corpus stores. ``new_bytes``: bytes of the caches the store lacks;
    ``total_bytes``: of every cache of the corpus (what the store must hold at once). With
    neighbours, each chunk has a second cache (behind its neighbours), counted as missing where
    its plain cache is."""

    chunks: int
    cached: int
    tokens: int
    new_tokens: int
    new_bytes: int
    total_bytes: int
    kv_format: str
    neighbours: int
    prefix_bytes: int = 0  # of the instruction prefix's cache, in both totals
    records: int = 0  # every cache's records (one per layer and a meta record), prefix included
    new_records: int = 0  # of the missing caches

    @property
    def bytes_per_token(self) -> float:
        """Bytes of one cache per token of the corpus's chunks."""
        chunk_bytes = self.total_bytes - self.prefix_bytes
        return chunk_bytes / self.tokens / (2 if self.neighbours else 1) if self.tokens else 0.0


def _disk_stores(store: Any) -> list[Any]:
    """The tiers of ``store`` that keep chunks on disk (a bare disk store, or a tiered store's)."""
    stores = [t.store for t in store.tiers] if hasattr(store, "tiers") else [store]
    return [s for s in stores if hasattr(s, "bytes_needed") and hasattr(s, "directory")]


def bounded(store: Any) -> bool:
    """Whether ``store`` has a tier with a size limit and a disk to check the room of."""
    return bool(_disk_stores(store))


def _format_of(store: Any):
    formats = [s.kv_format for s in _disk_stores(store) if getattr(s, "kv_format", None) is not None]
    return formats[0] if formats else getattr(store, "kv_format", None)


def plan_precompute(
    engine: Any, texts: Sequence[str], store: Any, neighbours: int = 0, prefix_ids: Sequence[int] | None = None
) -> PrecomputePlan:
    """How many of the chunks ``texts`` ``store`` lacks, their tokens and the bytes their caches
    take in the store's format (the prefix's cache included). ``prefix_ids``: the prefix the
    chunks are cached behind (default the engine's instruction prefix)."""
    from cacheblend_rag.store.lookup import contains_many
    from cacheblend_rag.store.meta import ChunkMeta, encode_meta
    from cacheblend_rag.store.record import layer_record_bytes
    from cacheblend_rag.store.seal import MAC_SIZE, sealer

    prefix_ids = engine.prompts.prefix_ids if prefix_ids is None else tuple(prefix_ids)
    fmt = _format_of(store)
    heads, head_dim = engine.kv_shape
    trailer = MAC_SIZE if sealer().keyed else 0
    segments = [engine.prompts.chunk_segment(t) for t in texts]
    have = contains_many(store, [engine.chunk_key(s, prefix_ids) for s in segments])
    copies = 2 if neighbours else 1
    meta = len(encode_meta(ChunkMeta(1, 1, "float32"))) + trailer  # the same size for every chunk

    def size(n: int) -> int:  # an n-token chunk's caches
        record = layer_record_bytes((heads, n, head_dim), engine.dtype, fmt) + trailer
        return copies * (engine.num_layers * record + meta)

    missing = [len(s) for s, hit in zip(segments, have) if not hit]
    # The prefix is stored once too (prefix caching finds it), as a plain cache.
    prefix_bytes = size(len(prefix_ids)) // copies
    prefix_new = not store.contains(engine.chunk_cache.prefix_key(prefix_ids))
    per_chunk = copies * (engine.num_layers + 1)
    return PrecomputePlan(
        chunks=len(segments),
        cached=len(segments) - len(missing),
        tokens=sum(len(s) for s in segments),
        new_tokens=sum(missing),
        new_bytes=sum(size(n) for n in missing) + prefix_new * prefix_bytes,
        total_bytes=sum(size(len(s)) for s in segments) + prefix_bytes,
        kv_format="float" if fmt is None else fmt.name,
        neighbours=neighbours,
        prefix_bytes=prefix_bytes,
        records=len(segments) * per_chunk + engine.num_layers + 1,
        new_records=len(missing) * per_chunk + prefix_new * (engine.num_layers + 1),
    )


def check_room(p: PrecomputePlan, store: Any) -> None:
    """Raise :class:`StoreTooSmall` when a disk tier of ``store`` cannot hold the corpus: its size
    limit is below all of the corpus's caches with the store's own bytes for them (database rows,
    folders: ``KVStore.bytes_needed``), so the last chunks would evict the first; or its disk has
    not the free space for the missing ones (plus ``DISK_MARGIN``)."""
    hint = {
        "float": ' or keep fewer bytes per token (--kv-format int8, kv_format="int8": about a quarter)',
        "int8": ' or keep fewer bytes per token (--kv-format int4, kv_format="int4": about half, at some cost in answers)',
    }.get(p.kv_format, "")
    for disk in _disk_stores(store):
        total = disk.bytes_needed(p.total_bytes, p.records)
        if total > disk.size_limit:
            raise StoreTooSmall(
                f"the corpus's chunk caches take about {total:,} bytes ({p.chunks:,} chunks, {p.tokens:,} tokens, "
                f"{p.kv_format}), more than the store's size limit of {disk.size_limit:,} bytes: its last chunks would "
                f"evict its first. Raise the limit (--store-size-limit, store_size_limit=){hint}, or cache part of "
                "the corpus"
            )
        try:
            free = shutil.disk_usage(disk.directory).free
        except OSError:
            continue
        new = disk.bytes_needed(p.new_bytes, p.new_records)
        if new > free * (1 - DISK_MARGIN):
            raise StoreTooSmall(
                f"the missing chunk caches take about {new:,} bytes, and the disk of {disk.directory} has "
                f"{free:,} bytes free (precompute leaves {DISK_MARGIN:.0%} of it): free space, put the store on a "
                f"larger disk (--store-dir, store_dir=){hint}"
            )


def describe(p: PrecomputePlan) -> str:
    """The plan in one line, as ``ingest`` prints it before computing."""
    nb = f", each also behind its {p.neighbours} nearest chunks" if p.neighbours else ""
    return (
        f"{p.chunks:,} chunks ({p.cached:,} cached, {p.chunks - p.cached:,} to compute{nb}), {p.tokens:,} tokens; "
        f"about {p.new_bytes:,} bytes to store in {p.kv_format} ({p.bytes_per_token:,.0f} bytes per token), "
        f"{p.total_bytes:,} for the whole corpus"
    )
