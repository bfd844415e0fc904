"""Assembles one layer's K/V for a whole prompt from the chunk store, optionally one layer ahead.

``fetch_kv`` of the paper: every reused segment's cached K/V for a layer is read from the store,
its keys re-rotated to the segment's new offset, and laid into a prompt-length tensor. With
``pipelined=True`` a background thread loads layers i+1..i+depth while the fusor computes layer i;
calling the loader for layer i is the synchronisation point (paper section 5, "synchronize").
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch

from .rope import apply_rotation, rotation

log = logging.getLogger("cacheblend_rag.loader")


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
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None  # computed during this request


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
        pipelined: bool = False,
        depth: int = 4,
    ):
        self.store, self.specs, self.length = store, list(specs), length
        self.shape, self.dtype, self.device = shape, dtype, device
        self.rotary_emb, self.num_layers = rotary_emb, num_layers
        self.load_s_per_layer = [0.0] * num_layers  # time spent loading, hidden or not
        self.pipelined = pipelined
        # Layers the loader may run ahead of the fusor. The paper's pipeline is one layer ahead;
        # but layer 0 (every token) and the filtering layers compute far longer than the later
        # ones, and a one-layer-ahead loader sits idle behind them and never catches up: on a
        # 20 MB/s tier that left the prefill 0.4-0.7 s longer than the pure load time. A few layers
        # of slack let the load run on while those heavy layers compute (memory: depth x one
        # prompt-length K/V layer).
        self.depth = max(1, depth)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cacheblend-load") if pipelined else None
        self._pending: dict[int, Future] = {}
        self._submitted = 0  # layers handed to the loader thread so far
        self._lost: str | None = None  # first chunk that failed: queued layers stop reading
        self._rotations: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if self._pool is not None:
            self._submit_upto(self.depth - 1)

    def _load(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._lost is not None:  # the request is being retried without that chunk
            raise ChunkLost(self._lost)
        t0 = time.perf_counter()
        heads, dim = self.shape
        # Every position is either loaded here or recomputed (scattered) by the fusor on every
        # layer, so the buffers need no zeroing.
        k_full = torch.empty(1, heads, self.length, dim, dtype=self.dtype, device=self.device)
        v_full = torch.empty_like(k_full)
        for spec in self.specs:
            if spec.kv is not None:
                k, v = spec.kv[layer]
            else:
                try:
                    got = self.store.get_layer(spec.key, layer, device=self.device)
                except Exception as exc:  # noqa: BLE001 - any storage fault means "recompute this chunk"
                    log.warning("reading layer %d of chunk %s failed: %r", layer, spec.key[:16], exc)
                    self._lost = spec.key
                    raise ChunkLost(spec.key) from exc
                if got is None:
                    self._lost = spec.key
                    raise ChunkLost(spec.key)
                k, v = got
            end = spec.start + spec.length
            # Stored caches may be in a narrower dtype (fp16/bf16 tiers): cast both K and V back.
            k = k.to(self.dtype)
            if spec.delta:
                k = apply_rotation(k, *self._rotation(spec.delta))
            k_full[0, :, spec.start : end] = k
            v_full[0, :, spec.start : end] = v.to(self.dtype)
        self.load_s_per_layer[layer] = time.perf_counter() - t0
        return k_full, v_full

    def _rotation(self, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
        # The same shift applies on every layer: compute its cos/sin once per request.
        if delta not in self._rotations:
            self._rotations[delta] = rotation(self.rotary_emb, delta, self.device)
        return self._rotations[delta]

    def __call__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pool is None:
            return self._load(layer)
        self._submit_upto(layer + self.depth)
        fut = self._pending.pop(layer, None) or self._pool.submit(self._load, layer)
        return fut.result()

    def _submit_upto(self, last: int) -> None:
        assert self._pool is not None
        while self._submitted <= min(last, self.num_layers - 1):
            self._pending[self._submitted] = self._pool.submit(self._load, self._submitted)
            self._submitted += 1

    def close(self) -> None:
        if self._pool is not None:
            for fut in self._pending.values():
                fut.cancel()
            self._pool.shutdown(wait=True)
            self._pending.clear()
