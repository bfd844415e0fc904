"""Assembles one layer's K/V for a whole prompt from the chunk store, optionally one layer ahead.

``fetch_kv`` of the paper: every reused segment's cached K/V for a layer is read from the store,
its keys re-rotated to the segment's new offset, and laid into a prompt-length tensor. A store
with ``get_layers`` (a tiered store, Redis) is asked for one layer of all the chunks at once. With
``pipelined=True`` a background thread reads layers i+1..i+depth from the store while the fusor
computes layer i; calling the loader for layer i is the synchronisation point (paper section 5,
"synchronize"), where the caller's thread rotates and places that layer's K/V.

A chunk kept in a quantized format (``store/quant.py``) is dequantized by the store's read, layer by
layer, in ``_fetch``: on the loader's thread when pipelined, so it overlaps the fusor's compute as
the read itself does, in numpy on that one thread (no second team of torch threads).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from cacheblend_rag.rope import apply_rotation, rotation
from cacheblend_rag.store.protocol import KV, batched_reader
from cacheblend_rag.threads import helper_pool

log = logging.getLogger(__name__)


def thread_clock() -> tuple[float, float]:
    """The calling thread's CPU time and the time it sat runnable waiting for a core, in seconds.

    The wait is Linux's run-queue delay (``/proc/thread-self/schedstat``); where that file is
    missing it reads 0. Without it, a read that another busy process keeps from the cores would
    look like a read waiting on storage.
    """
    cpu = time.thread_time()
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            queued_ns = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        queued_ns = 0
    return cpu, queued_ns / 1e9


class ChunkLost(RuntimeError):
    """A chunk's record vanished or failed its checks between lookup and load."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


@dataclass
class LoadSpec:
    start: int  # first prompt position of the segment
    length: int
    key: str  # store key
    delta: int  # positions to shift the cached keys by
    kv: Sequence[KV] | None = None  # computed during this request: [layers](K, V) [kv_heads, length, head_dim]


class LayerAssembler:
    def __init__(
        self,
        store,
        specs: Sequence[LoadSpec],
        length: int,
        shape: tuple[int, int],  # (kv_heads, head_dim)
        dtype: torch.dtype,
        device: torch.device,
        rotary_emb: torch.nn.Module,
        num_layers: int,
        pipelined: bool | None = False,
        depth: int = 4,
    ):
        self.store, self.specs, self.length = store, list(specs), length
        self.shape, self.dtype, self.device = shape, dtype, device
        self.rotary_emb, self.num_layers = rotary_emb, num_layers
        self.load_s_per_layer = [0.0] * num_layers  # time spent loading, hidden or not
        # None: decided on layer 0, whose read the fusor waits for in any case (``_worth_overlap``).
        self.pipelined = pipelined
        # Layers the loader may run ahead of the fusor. The paper's pipeline is one layer ahead;
        # but layer 0 (every token) and the filtering layers compute far longer than the later
        # ones, and a one-layer-ahead loader sits idle behind them and never catches up: on a
        # 20 MB/s tier that left the prefill 0.4-0.7 s longer than the pure load time. A few layers
        # of slack let the load run on while those heavy layers compute (memory: depth x one
        # prompt-length K/V layer).
        self.depth = max(1, depth)
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[int, Future] = {}
        self._submitted = 0  # layers handed to the loader thread so far
        self._lost: str | None = None  # first chunk that failed: queued layers stop reading
        self._rotations: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # delta -> (cos, sin)
        if pipelined:
            self._start_pool(0)

    def _start_pool(self, first: int) -> None:
        self._pool = helper_pool("cacheblend-load")
        self._submitted = first
        self._submit_upto(first + self.depth - 1)

    def _worth_overlap(self, wall_s: float, cpu_s: float, queued_s: float) -> bool:
        """Automatic mode: read ahead in a thread unless the reads are CPU work on a CPU device.

        Overlap hides a read that waits on storage (a slow disk or network tier, or the copy to an
        accelerator). A read served from RAM or the page cache is CPU work (copy, checksum,
        parsing) that a thread can only run on the cores the prefill is using: on 2 cores,
        overlapping it made a 3k-token prefill 8-9% slower than reading inline in two of three
        measurements and was never clearly faster (docs/pipeline.md). A store that says it reads
        from memory (``reads_from_memory``) is CPU work whatever the clock says: its read can
        wait on a lock or the GIL held by a busy write-back thread, which looks like a wait on
        storage. Otherwise the read waited on storage if its thread spent more than half of it
        neither running (``cpu_s``) nor waiting for a core (``queued_s``, ``thread_clock``).
        """
        if self.device.type != "cpu":
            return True
        if getattr(self.store, "reads_from_memory", False):
            return False
        return wall_s - cpu_s - queued_s > 0.5 * wall_s

    def _fetch(self, layer: int) -> tuple[list[KV], float]:
        """Every segment's stored K/V for ``layer`` as kept (no arithmetic), and the time it took.

        This is the part the loader thread runs ahead: file reads and checksums release the GIL
        and use one core. The rotation and placement stay in ``_assemble`` on the caller's thread:
        torch ops started from a second thread bring their own thread team, and on a 2-core CPU
        two teams slowed the fusor's layers by more than the whole load (measured: 0.6 s lost to
        hide 0.28 s on a 3k-token prompt).
        """
        if self._lost is not None:  # the request is being retried without that chunk
            raise ChunkLost(self._lost)
        timed = self.pipelined is None  # automatic mode, layer 0: this read decides the rest
        t0, (c0, q0) = time.perf_counter(), thread_clock() if timed else (0.0, 0.0)
        batch = self._read_batch(layer)
        parts = []
        for spec in self.specs:
            if spec.kv is not None:
                parts.append(spec.kv[layer])
                continue
            if batch is not None:
                got = next(batch)
            else:
                got = self._read(spec.key, layer, functools.partial(self.store.get_layer, spec.key, layer, device=self.device))
            if got is None:
                self._lost = spec.key
                raise ChunkLost(spec.key)
            parts.append(got)
        wall_s = time.perf_counter() - t0
        if timed:
            c1, q1 = thread_clock()
            self.pipelined = self._worth_overlap(wall_s, c1 - c0, q1 - q0)
            if self.pipelined:
                self._start_pool(layer + 1)
        return parts, wall_s

    def _read_batch(self, layer: int) -> Iterator[KV | None] | None:
        """``layer`` of every chunk to load in one ``get_layers`` call (one round trip to a network
        tier), in spec order; None when the store reads one chunk at a time."""
        get_layers = batched_reader(self.store)
        keys = [spec.key for spec in self.specs if spec.kv is None]
        if get_layers is None or not keys:
            return None
        return iter(self._read(keys[0], layer, lambda: get_layers(keys, layer, device=self.device)))

    def _read(self, key: str, layer: int, read: Callable[[], Any]) -> Any:
        try:
            return read()
        except Exception as exc:  # any storage fault means "recompute this chunk"
            log.warning("reading layer %d of chunk %s failed: %r", layer, key[:16], exc)
            self._lost = key
            raise ChunkLost(key) from exc

    def _assemble(self, layer: int, fetched: tuple[list[KV], float]) -> tuple[torch.Tensor, torch.Tensor]:
        """[specs](K, V) [kv_heads, spec.length, head_dim] -> K, V [1, kv_heads, length, head_dim]."""
        parts, fetch_s = fetched
        t0 = time.perf_counter()
        heads, dim = self.shape
        # Every position is either loaded here or recomputed (scattered) by the fusor on every
        # layer, so the buffers need no zeroing.
        k_full = torch.empty(1, heads, self.length, dim, dtype=self.dtype, device=self.device)
        v_full = torch.empty_like(k_full)
        for spec, (k, v) in zip(self.specs, parts):
            span = slice(spec.start, spec.start + spec.length)
            # Written straight into the prompt's buffers, which also casts a narrower stored dtype
            # (fp16/bf16 tiers) back to the model's.
            if spec.delta:
                apply_rotation(k, *self._rotation(spec.delta), out=k_full[0, :, span])
            else:
                k_full[0, :, span] = k
            v_full[0, :, span] = v
        self.load_s_per_layer[layer] = fetch_s + time.perf_counter() - t0
        return k_full, v_full

    def _rotation(self, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
        # The same shift applies on every layer: compute its cos/sin once per request.
        if delta not in self._rotations:
            self._rotations[delta] = rotation(self.rotary_emb, delta, self.device)
        return self._rotations[delta]

    def __call__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V for the whole prompt, [1, kv_heads, length, head_dim]."""
        if self._pool is None:  # inline, or automatic mode before layer 0 has been read
            return self._assemble(layer, self._fetch(layer))
        self._submit_upto(layer + self.depth)
        fut = self._pending.pop(layer, None) or self._pool.submit(self._fetch, layer)
        return self._assemble(layer, fut.result())

    def _submit_upto(self, last: int) -> None:
        assert self._pool is not None
        while self._submitted <= min(last, self.num_layers - 1):
            self._pending[self._submitted] = self._pool.submit(self._fetch, self._submitted)
            self._submitted += 1

    def close(self) -> None:
        if self._pool is not None:
            for fut in self._pending.values():
                fut.cancel()
            self._pool.shutdown(wait=True)
            self._pending.clear()
