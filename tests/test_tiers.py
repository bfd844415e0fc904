"""Storage tiers: memory LRU by bytes, promotion, stored dtype, write-back, and failing tiers."""

from __future__ import annotations

import logging

import pytest
import torch

from cacheblend_bench.throttle import ThrottledStore
from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.store.disk import KVStore
from cacheblend_rag.store.memory import MemoryTier
from cacheblend_rag.store.spec import open_store
from cacheblend_rag.store.tiers import Tier, TieredStore
from cacheblend_rag.testing import make_model

CHUNKS = [
    "The Eiffel Tower is in Paris, the capital of France.",
    "Marie Curie won two Nobel prizes, in physics and in chemistry.",
    "The river Thames flows through London and Oxford.",
]
Q = "Where is the Eiffel Tower?"


def _layers(n_layers=2, tokens=4, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(2, tokens, 8, generator=g).to(dtype), torch.randn(2, tokens, 8, generator=g).to(dtype))
        for _ in range(n_layers)
    ]


LAYER_BYTES = 2 * 2 * 4 * 8 * 4  # K and V of one layer of _layers() in fp32


# ------------------------------------------------------------------------------- memory tier


def test_memory_tier_evicts_least_recently_used_layers_by_bytes():
    mem = MemoryTier(capacity_bytes=3 * LAYER_BYTES, policy="lru")
    a, b = _layers(seed=1), _layers(seed=2)
    assert mem.put("a", a) and mem.contains("a")
    assert mem.get_layer("a", 0) is not None  # a/0 is now more recent than a/1
    mem.put("b", b)  # 4 layers do not fit in 3: the oldest, a/1, goes
    assert mem.volume() <= 3 * LAYER_BYTES and mem.stats.evictions == 1
    assert mem.get_layer("a", 1) is None and not mem.contains("a")  # partly resident is not "contained"
    torch.testing.assert_close(mem.get_layer("a", 0)[0], a[0][0], rtol=0, atol=0)
    assert mem.contains("b") and mem.meta("b").num_layers == 2
    # Reading b's layers makes a/0 the oldest; one more layer evicts it.
    mem.get_layer("b", 0)
    mem.get_layer("b", 1)
    mem.put_layer("c", 0, *a[0], num_layers=1)
    assert mem.get_layer("a", 0) is None and mem.contains("b") and mem.contains("c")


def test_memory_tier_refuses_a_chunk_bigger_than_itself_and_copies_inputs():
    mem = MemoryTier(capacity_bytes=LAYER_BYTES)
    assert mem.put("big", _layers()) is False and mem.volume() == 0
    k, v = _layers(n_layers=1)[0]
    mem.put("x", [(k, v)])
    k.zero_()  # the caller's tensor changing must not change the cached copy
    assert mem.get_layer("x", 0)[0].abs().sum() > 0
    mem.discard("x")
    assert not mem.contains("x") and mem.volume() == 0


def test_memory_tier_rejects_bad_capacity():
    with pytest.raises(ValueError, match="capacity_bytes"):
        MemoryTier(0)


# ------------------------------------------------------------------------------- tiered store


def test_disk_hit_is_promoted_into_memory(tmp_path):
    store = TieredStore.memory_over_disk(tmp_path / "kv")
    disk = store.tier("disk").store
    layers = _layers()
    disk.put("k", layers)
    assert store.locate("k") == "disk"
    got = store.get_layer("k", 0)
    torch.testing.assert_close(got[0], layers[0][0], rtol=0, atol=0)
    assert store.stats.tier_hits == {"memory": 0, "disk": 1} and store.stats.promotions == 1
    store.get_layer("k", 0)
    store.get_layer("k", 1)
    assert store.stats.tier_hits == {"memory": 1, "disk": 2}
    assert store.locate("k") == "memory"  # every layer is now in memory
    store.close()


@pytest.mark.parametrize("name, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_stored_dtype_is_cast_on_put(tmp_path, name, dtype):
    store = TieredStore.memory_over_disk(tmp_path / "kv", dtype=name)
    layers = _layers()
    assert store.put("k", layers)
    for tier in store.tiers:
        k, v = tier.store.get_layer("k", 1)
        assert k.dtype == v.dtype == dtype
        torch.testing.assert_close(k.float(), layers[1][0], rtol=1e-2, atol=1e-2)
    assert store.tier("disk").store.meta("k").dtype == str(dtype).removeprefix("torch.")
    store.close()


class _NoVolumeTier(MemoryTier):
    """A tier that serves reads but may not say its size (a Redis ACL user without ``+info``)."""

    tier_name = "shared"

    def volume(self) -> int:
        raise PermissionError("NOPERM this user has no permissions to run the 'info' command")


def test_a_tier_that_cannot_report_its_volume_keeps_serving_reads(caplog):
    shared, layers = _NoVolumeTier(), _layers()
    shared.put("k", layers)
    store = TieredStore([MemoryTier(), shared], promote=False)
    store.tier("memory").store.put("m", _layers(seed=3))
    with caplog.at_level(logging.WARNING):
        assert store.volume() == 2 * LAYER_BYTES  # what the tiers that can say hold
    got = store.get_layer("k", 0)  # a size query is no reason to skip the tier's reads
    assert got is not None and torch.equal(got[0], layers[0][0])
    assert store.stats.tier_hits["shared"] == 1 and store.stats.fallbacks == 0
    assert "skipping it" not in caplog.text
    store.close()


@pytest.mark.parametrize("memory_bytes", [-1, -2 * 2**30])
def test_negative_memory_budget_is_named_before_anything_is_opened(tmp_path, memory_bytes):
    with pytest.raises(ValueError, match=f"memory_bytes={memory_bytes} must be >= 0"):
        open_store("disk", directory=str(tmp_path / "kv"), size_limit=2**30, fingerprint="", memory_bytes=memory_bytes)
    assert not (tmp_path / "kv").exists()  # no disk store left open behind the error


def test_unknown_stored_dtype_is_named():
    with pytest.raises(ValueError, match="unknown stored dtype 'int8'"):
        TieredStore([MemoryTier()], dtype="int8")


def _engine(tokenizer, store, **kw):
    return CacheBlendEngine(make_model("llama"), tokenizer, store=store, **kw)


def test_write_back_fills_both_tiers_and_the_next_request_hits_memory(tokenizer, tmp_path):
    store = TieredStore.memory_over_disk(tmp_path / "kv")
    eng = _engine(tokenizer, store)
    first = eng.generate(Q, CHUNKS, max_new_tokens=4)
    eng.flush()  # the background write-back of the chunks computed during the request
    keys = [eng.chunk_key(eng.prompts.chunk_segment(c)) for c in CHUNKS]
    for tier in ("memory", "disk"):
        assert all(store.tier(tier).store.contains(k) for k in keys), tier
    before = dict(store.stats.tier_hits)
    second = eng.generate(Q, CHUNKS, max_new_tokens=4)
    assert (first.stats["chunk_misses"], second.stats["chunk_hits"]) == (len(CHUNKS), len(CHUNKS))
    assert second.token_ids == first.token_ids
    # Every layer of every chunk (and of the cached instruction prefix) came from memory.
    assert store.stats.tier_hits["memory"] - before["memory"] >= len(CHUNKS) * eng.num_layers
    assert store.stats.tier_hits["disk"] == 0
    eng.close()


def test_fp16_tier_loads_back_in_the_model_dtype(tokenizer, tmp_path):
    ref = _engine(tokenizer, KVStore(tmp_path / "ref"), pipelined=False)
    ref.precompute(CHUNKS, progress=False)
    eng = _engine(tokenizer, TieredStore.memory_over_disk(tmp_path / "kv", dtype="fp16"), pipelined=False)
    eng.precompute(CHUNKS, progress=False)
    layout = ref.build_layout(Q, CHUNKS)
    a = ref.prefill(layout, "full_reuse")
    b = eng.prefill(layout, "full_reuse")
    for i in range(ref.num_layers):
        kb, vb = b.cache.layers[i].keys, b.cache.layers[i].values
        assert kb.dtype == vb.dtype == torch.float32
        torch.testing.assert_close(kb, a.cache.layers[i].keys, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(vb, a.cache.layers[i].values, rtol=2e-3, atol=2e-3)
    assert not torch.equal(a.logits, b.logits)  # it really went through fp16
    ref.close()
    eng.close()


# ------------------------------------------------------------------------------- failures


class Broken:
    """A store that claims to hold everything and raises on every read, write and discard."""

    tier_name = "broken"

    def __init__(self):
        self.reads = 0

    def contains(self, key):
        return True

    def meta(self, key):
        raise OSError("disk on fire")

    def get_layer(self, key, layer, device=None):
        self.reads += 1
        raise OSError("disk on fire")

    def put(self, key, layers):
        raise OSError("disk on fire")

    def discard(self, key):
        raise OSError("disk on fire")

    def volume(self):
        return 0

    def close(self):
        pass


@pytest.fixture
def clean(tokenizer, tmp_path):
    eng = _engine(tokenizer, KVStore(tmp_path / "clean"))
    eng.precompute(CHUNKS, progress=False)
    res = eng.generate(Q, CHUNKS, max_new_tokens=5)
    logits = eng.next_token_logits(Q, CHUNKS)
    eng.close()
    return res, logits


def _assert_same_answer(eng, clean):
    res = eng.generate(Q, CHUNKS, max_new_tokens=5)
    assert res.token_ids == clean[0].token_ids
    torch.testing.assert_close(eng.next_token_logits(Q, CHUNKS), clean[1], rtol=1e-5, atol=1e-6)
    return res


def test_failing_memory_tier_falls_back_to_disk(tokenizer, tmp_path, clean, caplog):
    disk = KVStore(tmp_path / "kv")
    eng = _engine(tokenizer, disk)
    eng.precompute(CHUNKS, progress=False)
    broken = Broken()
    eng.store = TieredStore([Tier(broken, "memory"), Tier(disk, "disk")])
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.store.tiers"):
        res = _assert_same_answer(eng, clean)
    assert res.stats["chunk_hits"] == len(CHUNKS)  # served by disk, nothing recomputed
    assert eng.store.stats.fallbacks >= 1 and eng.store.stats.errors >= 1
    assert "'memory' failed" in caplog.text
    assert broken.reads == 1  # benched after the first failure, not retried per layer
    eng.close()


def test_only_tier_failing_falls_back_to_recompute(tokenizer, clean):
    broken = Broken()
    store = TieredStore([broken], cooldown_s=60)
    eng = _engine(tokenizer, store)
    res = _assert_same_answer(eng, clean)
    assert res.stats["chunk_misses"] == len(CHUNKS) and store.stats.fallbacks >= 1
    eng.close()


def test_raw_store_that_always_raises_cannot_loop_or_crash_the_engine(tokenizer, clean):
    # No TieredStore in front: the engine itself must stop trusting the store's "contains".
    broken = Broken()
    eng = _engine(tokenizer, broken)
    res = _assert_same_answer(eng, clean)
    assert res.stats["chunk_misses"] == len(CHUNKS)
    broken.reads = 0
    eng.prefill(eng.build_layout(Q, CHUNKS), "cacheblend")
    # One attempt per lost chunk plus the last; at most a read and a prefetch each.
    assert broken.reads <= 2 * (len(CHUNKS) + 1)
    eng.close()


def test_slow_tier_times_out_and_falls_back(tokenizer, tmp_path, clean):
    disk = KVStore(tmp_path / "kv")
    eng = _engine(tokenizer, disk)
    eng.precompute(CHUNKS, progress=False)
    # ~2 s per layer read against a 0.2 s timeout (short enough that the abandoned read ends soon).
    slow = ThrottledStore(disk, bytes_per_s=2000.0, name="slow")
    fast_copy = KVStore(tmp_path / "copy")
    for text in CHUNKS:
        key = eng.chunk_key(eng.prompts.chunk_segment(text))
        fast_copy.put(key, [disk.get_layer(key, i) for i in range(eng.num_layers)])
    eng.store = TieredStore([Tier(slow, "slow", read_timeout_s=0.2), Tier(fast_copy, "backup")])
    res = _assert_same_answer(eng, clean)
    assert res.stats["chunk_hits"] == len(CHUNKS)
    assert eng.store.stats.timeouts == 1 and eng.store.stats.tier_hits["backup"] > 0
    eng.store.close()
    eng.close(close_store=False)
    disk.close()


def test_throttled_store_sleeps_for_bytes_over_rate(monkeypatch):
    import cacheblend_bench.throttle as throttle

    naps = []
    monkeypatch.setattr(throttle.time, "sleep", naps.append)
    mem = MemoryTier()
    mem.put("k", _layers())
    slow = ThrottledStore(mem, bytes_per_s=LAYER_BYTES / 2.0)  # each layer should take 2 s
    assert slow.get_layer("k", 0) is not None and slow.get_layer("nope", 0) is None
    assert len(naps) == 1 and 1.9 < naps[0] <= 2.0
    assert slow.contains("k") and slow.tier_name == "throttled"
