"""Layer-wise pipelined loading: it really overlaps, and it changes no bit of the result."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest
import torch

from cacheblend_bench.throttle import ThrottledStore
from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.store import loader as loader_module
from cacheblend_rag.store.disk import KVStore
from cacheblend_rag.store.loader import LayerAssembler, LoadSpec, thread_clock
from cacheblend_rag.store.memory import MemoryTier
from cacheblend_rag.store.tiers import Tier, TieredStore
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_model

CHUNKS = SAMPLE_CHUNKS
Q = SAMPLE_QUESTION
RATE = 1e6  # bytes/s: a few ms per layer read of the tiny model, so loads take real time


class Gate:
    """Wraps a store and records when each layer's first read starts, and on which thread."""

    def __init__(self, inner, num_layers):
        self.inner = inner
        self.started = [threading.Event() for _ in range(num_layers + 1)]
        self.started[num_layers].set()  # there is no layer after the last one
        self.readers: dict[int, set[int]] = {}  # layer -> ids of the threads that read it

    def get_layer(self, key, layer, device=None):
        self.readers.setdefault(layer, set()).add(threading.get_ident())
        self.started[layer].set()
        return self.inner.get_layer(key, layer, device=device)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _kv(cache, i):
    return cache.layers[i].keys, cache.layers[i].values


def _stores(kind, tmp_path):
    disk = ThrottledStore(KVStore(tmp_path / "kv"), RATE, name="disk")
    if kind == "throttled":
        return disk
    return TieredStore([Tier(MemoryTier(), "memory"), Tier(disk, "disk")], promote=False)


@pytest.mark.parametrize("kind", ["throttled", "tiered"])
@pytest.mark.parametrize("mode", ["cacheblend", "full_reuse"])
def test_prefetch_overlaps_compute_and_result_is_bit_identical(tokenizer, tmp_path, kind, mode):
    store = _stores(kind, tmp_path)
    eng = CacheBlendEngine(make_model("llama"), tokenizer, store=store)
    eng.precompute(CHUNKS, progress=False)
    if kind == "tiered":
        store.tier("memory").store.clear()  # every layer now comes from the throttled disk
    layout = eng.build_layout(Q, CHUNKS)
    plain = eng.prefill(layout, mode, pipelined=False)

    # Layer i's compute may only start once layer i+1's load has started: true only if the
    # loader prefetches while the fusor computes (without pipelining this would time out).
    gate = Gate(store, eng.num_layers)
    eng.store = gate
    overlapped = []
    hooks = [
        layer.register_forward_pre_hook(lambda mod, args, i=i: overlapped.append((i, gate.started[i + 1].wait(timeout=20))))
        for i, layer in enumerate(eng.model.model.layers)
    ]
    try:
        piped = eng.prefill(layout, mode, pipelined=True)
    finally:
        for h in hooks:
            h.remove()
    # (check layers run twice: a capture pass, then the kept tokens)
    assert all(ok for _, ok in overlapped) and {i for i, _ in overlapped} == set(range(eng.num_layers))
    # Every layer was read on the loader's thread, none on the fusor's; read inline, all on the fusor's.
    me = threading.get_ident()
    assert set(gate.readers) == set(range(eng.num_layers))
    assert all(me not in readers for readers in gate.readers.values())
    inline = Gate(store, eng.num_layers)
    eng.store = inline
    again = eng.prefill(layout, mode, pipelined=False)
    eng.store = store
    assert set(inline.readers) == set(range(eng.num_layers)) and all(r == {me} for r in inline.readers.values())
    assert torch.equal(again.logits, plain.logits)

    assert torch.equal(plain.logits, piped.logits)
    for i in range(eng.num_layers):
        for a, b in zip(_kv(plain.cache, i), _kv(piped.cache, i)):
            assert torch.equal(a, b)
    assert [s.tolist() for s in plain.selected] == [s.tolist() for s in piped.selected]

    s = piped.stats
    assert s["pipelined"] is True and plain.stats["pipelined"] is False
    for name in ("load_s_per_layer", "load_exposed_s_per_layer", "load_hidden_s_per_layer", "compute_s_per_layer"):
        assert len(s[name]) == eng.num_layers, name
    # The hidden share is what the fusor did not wait for; how much that is depends on the machine.
    for load, exposed, hidden in zip(s["load_s_per_layer"], s["load_exposed_s_per_layer"], s["load_hidden_s_per_layer"]):
        assert hidden == pytest.approx(max(0.0, load - exposed)) and 0 <= hidden <= load
    assert plain.stats["load_hidden_s_per_layer"] == [0.0] * eng.num_layers and plain.stats["load_hidden_s"] == 0.0
    eng.close()


def test_stores_say_whether_they_read_from_memory(tmp_path):
    # The automatic mode reads a memory store inline without timing it: its first read can wait
    # on the lock of a write-back thread still copying a precomputed chunk, which looks like a
    # wait on storage.
    assert MemoryTier().reads_from_memory is True
    assert TieredStore([Tier(MemoryTier(), "a"), Tier(MemoryTier(), "b")]).reads_from_memory is True
    assert TieredStore.memory_over_disk(str(tmp_path / "kv")).reads_from_memory is False
    assert ThrottledStore(MemoryTier(), RATE).reads_from_memory is False  # it sleeps on every read
    assert getattr(KVStore(tmp_path / "disk"), "reads_from_memory", False) is False


class Clocks:
    """The loader's clocks (wall, the thread's CPU time, its wait for a core), moved only by reads."""

    def __init__(self):
        self.wall = self.cpu = self.queued = 0.0

    def perf_counter(self):
        return self.wall

    def thread_clock(self):
        return self.cpu, self.queued


class ClockedStore:
    """A store (no ``reads_from_memory``) whose read takes ``wall`` seconds of which ``cpu`` run on a
    core and ``queued`` wait for one; the rest waits on storage."""

    def __init__(self, clocks, wall, cpu, queued):
        self.clocks, self.wall, self.cpu, self.queued = clocks, wall, cpu, queued
        self.readers: dict[int, int] = {}  # layer -> id of the thread that read it

    def get_layer(self, key, layer, device=None):
        self.readers[layer] = threading.get_ident()
        self.clocks.wall += self.wall
        self.clocks.cpu += self.cpu
        self.clocks.queued += self.queued
        return torch.zeros(1, 4, 2), torch.zeros(1, 4, 2)


@pytest.mark.parametrize(
    "cpu,queued,overlap",
    [
        (0.2, 0.7, False),  # starved of cores by other processes: CPU work, read inline
        (0.2, 0.0, True),  # waiting on storage most of the time: read ahead
        (0.9, 0.0, False),  # all CPU work
    ],
)
def test_automatic_mode_counts_a_read_starved_of_cores_as_cpu_work(monkeypatch, cpu, queued, overlap):
    # With more busy processes than cores, a CPU-bound read spends most of its wall time waiting
    # for a core. Counted as waiting on storage, it would start a loader thread that only
    # competes with the prefill for the same cores. The clocks are the loader's own, set by the
    # read, so the decision is checked without starving this machine.
    clocks = Clocks()
    monkeypatch.setattr(loader_module, "time", SimpleNamespace(perf_counter=clocks.perf_counter))
    monkeypatch.setattr(loader_module, "thread_clock", clocks.thread_clock)
    store = ClockedStore(clocks, wall=1.0, cpu=cpu, queued=queued)
    loader = LayerAssembler(
        store,
        [LoadSpec(0, 4, "k", 0)],
        4,
        (1, 2),
        torch.float32,
        torch.device("cpu"),
        rotary_emb=None,
        num_layers=2,
        pipelined=None,
    )
    try:
        loader(0)
        assert loader.pipelined is overlap
        loader(1)  # read ahead on the loader's thread, or inline on this one
        assert store.readers[0] == threading.get_ident()
        assert (store.readers[1] != threading.get_ident()) is overlap
    finally:
        loader.close()


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="needs Linux's run-queue delay")
def test_thread_clock_reads_the_kernels_run_queue_delay():
    def queued():
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9

    before = queued()
    _, got = thread_clock()
    assert before <= got <= queued()


class LosesOneLayer:
    """Returns a miss for one (chunk, layer) read once, as if the record was evicted mid-request."""

    def __init__(self, inner, key, layer):
        self.inner, self.key, self.layer, self.fired = inner, key, layer, False

    def get_layer(self, key, layer, device=None):
        if (key, layer) == (self.key, self.layer) and not self.fired:
            self.fired = True
            return None
        return self.inner.get_layer(key, layer, device=device)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_chunk_lost_during_prefetch_is_recomputed_exactly(tokenizer, tmp_path):
    store = KVStore(tmp_path / "kv")
    eng = CacheBlendEngine(make_model("llama"), tokenizer, store=store)
    eng.precompute(CHUNKS, progress=False)
    layout = eng.build_layout(Q, CHUNKS)
    clean = eng.prefill(layout, "cacheblend", pipelined=False)
    eng.store = LosesOneLayer(store, eng.chunk_key(eng.prompts.chunk_segment(CHUNKS[1])), layer=2)
    res = eng.prefill(layout, "cacheblend", pipelined=True)
    assert eng.store.fired and res.stats["chunk_misses"] == 1
    assert torch.equal(res.logits, clean.logits)
    eng.flush()
    assert sum(eng.is_cached(c) for c in CHUNKS) == len(CHUNKS)  # the lost chunk was written back
    eng.close()


def test_automatic_mode_reads_ahead_only_when_reads_wait_on_storage(tokenizer, tmp_path):
    # pipelined=None (the default) decides on layer 0's read: a read that sleeps on storage is
    # overlapped; on a CPU device, a read that is all CPU work (memory tier) runs inline, since a
    # loader thread would only compete with the prefill for the same cores.
    stores = {
        "slow": ThrottledStore(KVStore(tmp_path / "kv"), RATE, name="disk"),
        "memory": TieredStore([Tier(MemoryTier(), "memory")]),
    }
    runs = {}
    for name, store in stores.items():
        eng = CacheBlendEngine(make_model("llama"), tokenizer, store=store)
        assert eng.pipelined is None
        eng.precompute(CHUNKS, progress=False)
        runs[name] = eng.prefill(eng.build_layout(Q, CHUNKS), "cacheblend")
        eng.close()
    assert runs["slow"].stats["pipelined"] is True
    assert runs["memory"].stats["pipelined"] is False and runs["memory"].stats["load_hidden_s"] == 0.0
    assert torch.equal(runs["slow"].logits, runs["memory"].logits)
