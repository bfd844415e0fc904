"""Eviction policies (``store.eviction``) and what they guarantee a warm store: a chunk that keeps
being hit keeps its cache, and an answer never rewrites the caches it read."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag.store.disk import KVStore
from cacheblend_rag.store.eviction import (
    DISK_POLICIES,
    LFUPolicy,
    LRUPolicy,
    make_policy,
    set_disk_policy,
)
from cacheblend_rag.store.memory import MemoryTier
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_engine

LAYERS = 2


def _chunk(seed: int, tokens: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, tokens, 4, generator=g), torch.randn(2, tokens, 4, generator=g)) for _ in range(LAYERS)]


CHUNK_BYTES = sum(k.numel() * 4 + v.numel() * 4 for k, v in _chunk(0))


def _read(tier, key: str) -> None:
    for layer in range(LAYERS):
        assert tier.get_layer(key, layer) is not None


def test_lru_evicts_the_least_recently_used():
    p = LRUPolicy()
    for item in "abc":
        p.add(item)
    p.touch("a")
    assert p.victim() == "b"
    p.remove("b")
    assert p.victim() == "c" and len(p) == 2


def test_lfu_evicts_the_least_frequently_used_ties_to_the_oldest():
    p = LFUPolicy()
    for item in "abc":
        p.add(item)
    p.touch("a")
    p.touch("c")
    assert p.victim() == "b"  # read once, the others twice
    p.remove("b")
    assert p.victim() == "a"  # a and c tie on count: a was used longer ago


def test_lfu_remembers_evicted_counts_so_a_returning_chunk_earns_its_place():
    p = LFUPolicy(history=4)
    p.add("hot")
    for _ in range(3):
        p.touch("hot")
    p.remove("hot")  # evicted (say, the tier was full of newer chunks)
    p.add("cold")
    p.add("hot")  # back from a lower tier: its count is 5 now, not 1
    assert p.victim() == "cold"


def test_lfu_decay_lets_new_favourites_overtake_old_ones():
    p = LFUPolicy(decay_every=2)
    p.add("old")
    for _ in range(6):
        p.touch("old")  # count 7, halved on the way
    p.add("new")
    for _ in range(20):  # the traffic moved on: old is never read again
        p.touch("new")
    assert p.victim() == "old"


def test_policy_names_and_bad_policies():
    assert isinstance(make_policy("lfu"), LFUPolicy) and isinstance(make_policy("lru"), LRUPolicy)
    with pytest.raises(ValueError, match="unknown eviction policy 'mru': use one of \\['lfu', 'lru'\\]"):
        make_policy("mru")
    with pytest.raises(TypeError, match="has no add\\(\\) method"):
        make_policy(object())
    with pytest.raises(ValueError, match="unknown disk eviction policy 'fifo'"):
        set_disk_policy(KVStore(None), "fifo")


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_memory_tier_keeps_a_chunk_that_is_being_hit(policy):
    tier = MemoryTier(capacity_bytes=3 * CHUNK_BYTES, policy=policy)
    tier.put("hit", _chunk(0))
    for i in range(6):  # new chunks keep arriving; "hit" is read between them
        _read(tier, "hit")
        tier.put(f"new{i}", _chunk(i + 1))
    assert tier.contains("hit")
    assert not tier.contains("new0")  # the tier stayed within its budget by evicting the others
    assert tier.volume() <= tier.capacity_bytes


def test_lfu_keeps_frequent_chunks_through_a_scan_that_lru_lets_through():
    kept = {}
    for policy in ("lru", "lfu"):
        tier = MemoryTier(capacity_bytes=3 * CHUNK_BYTES, policy=policy)
        for key in ("a", "b"):
            tier.put(key, _chunk(ord(key)))
            for _ in range(3):
                _read(tier, key)
        for i in range(4):  # a scan of chunks read once each
            tier.put(f"scan{i}", _chunk(100 + i))
        kept[policy] = [key for key in ("a", "b") if tier.contains(key)]
    assert kept == {"lru": [], "lfu": ["a", "b"]}


@pytest.mark.parametrize("policy", ["least-recently-used", "least-frequently-used"])
def test_disk_store_keeps_a_chunk_that_is_being_hit(tmp_path, policy):
    layer_bytes = 16 * 1024
    chunk = [(torch.randn(2, layer_bytes // 32, 4), torch.randn(2, layer_bytes // 32, 4)) for _ in range(LAYERS)]
    # Room for about a dozen chunks beside the database (diskcache culls 10 records at a time).
    store = KVStore(tmp_path / "kv", size_limit=2**20 + 12 * LAYERS * layer_bytes)
    set_disk_policy(store, policy)
    store.put("hit", chunk)
    for i in range(40):  # far more than fits: the store must evict
        for layer in range(LAYERS):
            assert store.get_layer("hit", layer) is not None, f"lost after {i} new chunks"
        store.put(f"new{i}", chunk)
    assert store.contains("hit") and not store.contains("new0")
    store.close()


def test_least_recently_stored_loses_a_chunk_that_is_being_hit(tmp_path):
    """Why the disk store does not run diskcache's default policy: reads do not count."""
    layer_bytes = 16 * 1024
    chunk = [(torch.randn(2, layer_bytes // 32, 4), torch.randn(2, layer_bytes // 32, 4)) for _ in range(LAYERS)]
    store = KVStore(tmp_path / "kv", size_limit=2**20 + 12 * LAYERS * layer_bytes)
    set_disk_policy(store, "least-recently-stored")
    store.put("hit", chunk)
    for i in range(40):
        store.get_layer("hit", 0)
        store.put(f"new{i}", chunk)
    assert not store.contains("hit")
    store.close()


def test_disk_policies_are_diskcaches():
    assert DISK_POLICIES == ("least-recently-stored", "least-recently-used", "least-frequently-used")


def test_a_blended_answer_leaves_the_chunk_caches_it_read_as_they_were(tmp_path):
    eng = make_engine("llama", seed=0, store_dir=tmp_path / "kv", pipelined=False)
    eng.precompute(SAMPLE_CHUNKS, progress=False)
    keys = [eng.chunk_key(eng.prompts.chunk_segment(c)) for c in SAMPLE_CHUNKS]
    before = {k: [eng.store.get_layer(k, layer) for layer in range(eng.num_layers)] for k in keys}
    for mode in ("cacheblend", "full_reuse", "cacheblend"):
        res = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, mode=mode, max_new_tokens=4)
        assert res.stats["chunk_hits"] == len(SAMPLE_CHUNKS)
    eng.flush()
    for k in keys:  # the recomputed tokens' K/V never replace the stored chunk
        for layer, (k0, v0) in enumerate(before[k]):
            k1, v1 = eng.store.get_layer(k, layer)
            assert torch.equal(k0, k1) and torch.equal(v0, v1)
    eng.close()
