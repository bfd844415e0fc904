"""A decode cache that grows in place.

transformers' ``DynamicLayer`` appends each decoded token's K/V with ``torch.cat``, which copies
the layer's whole cache on every step. After a RAG prompt that copy is most of what a step moves
besides the weights: for SmolLM2-135M and a 3k-token prompt, 138 MB per answer and step (a
single answer's step 59 -> 53 ms without it, four answers' batched step 138-174 -> 105-108 ms).
``RoomLayer`` keeps each layer's K/V at the front of a buffer with spare positions and writes
every new token into it, so the cache is copied once per ``room`` tokens instead of once per token.
The K/V handed to attention are views of the buffer, with the values a ``DynamicLayer`` holds.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

DEFAULT_ROOM = 256  # spare positions per (re)allocation: a copy every 256 tokens at most


class RoomLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys``/``values`` ([batch, kv_heads, length, head_dim]) are the
    front of buffers with spare positions; ``update`` writes into the spare positions.

    ``room``: how many tokens the cache may still grow by (an answer's remaining budget); each
    (re)allocation reserves that many, at most ``DEFAULT_ROOM``."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int = DEFAULT_ROOM):
        super().__init__()
        self.room = min(max(1, room), DEFAULT_ROOM)
        self.device = keys.device
        self.is_initialized = True
        self._reserve(keys, values, 0)

    def _reserve(self, keys: torch.Tensor, values: torch.Tensor, extra: int) -> None:
        n = keys.shape[-2]
        shape = (*keys.shape[:-2], n + extra + self.room, keys.shape[-1])
        self._keys = keys.new_empty(shape)
        self._values = values.new_empty(shape[:-1] + (values.shape[-1],))
        self._keys[..., :n, :] = keys
        self._values[..., :n, :] = values
        self.keys, self.values = self._keys[..., :n, :], self._values[..., :n, :]

    @classmethod
    def stacked(cls, rows: list[tuple[torch.Tensor, torch.Tensor]], room: int = DEFAULT_ROOM) -> RoomLayer:
        """One layer whose row ``j`` holds ``rows[j]`` (keys, values: [kv_heads, length_j, head_dim])
        right-aligned, left-padded with zeros to the longest row.

        Each row is copied once, straight into the buffer: a batch that gains or loses an answer
        is rebuilt at the cost of one copy of its rows, not three (pad, concatenate, reserve)."""
        layer = cls.__new__(cls)
        DynamicLayer.__init__(layer)
        keys0, values0 = rows[0]
        width = max(k.shape[-2] for k, _ in rows)
        layer.room = min(max(1, room), DEFAULT_ROOM)
        layer.device, layer.is_initialized = keys0.device, True
        layer._keys = keys0.new_empty((len(rows), keys0.shape[0], width + layer.room, keys0.shape[-1]))
        layer._values = values0.new_empty((len(rows), values0.shape[0], width + layer.room, values0.shape[-1]))
        for j, (k, v) in enumerate(rows):
            pad = width - k.shape[-2]
            # Padding is masked out, but a masked NaN would still reach the output (0 * NaN): zeros.
            layer._keys[j, :, :pad] = 0
            layer._values[j, :, :pad] = 0
            layer._keys[j, :, pad:width] = k
            layer._values[j, :, pad:width] = v
        layer.keys, layer.values = layer._keys[..., :width, :], layer._values[..., :width, :]
        return layer

    def _owns(self) -> bool:
        # Another method (batch_select_indices, reorder_cache, ...) may have replaced the views.
        return (
            self.keys is not None
            and self.keys.data_ptr() == self._keys.data_ptr()
            and self.values.data_ptr() == self._values.data_ptr()
            and self.keys.shape[:-2] == self._keys.shape[:-2]
            and self.keys.stride() == self._keys.stride()
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized or self.keys is None:  # after reset(): start over
            self.is_initialized = True
            self.device = key_states.device
            self._reserve(key_states, value_states, 0)
            return self.keys, self.values
        n, m = self.keys.shape[-2], key_states.shape[-2]
        if not self._owns() or n + m > self._keys.shape[-2]:
            self._reserve(self.keys, self.values, m)
        self._keys[..., n : n + m, :] = key_states
        self._values[..., n : n + m, :] = value_states
        self.keys, self.values = self._keys[..., : n + m, :], self._values[..., : n + m, :]
        return self.keys, self.values


def room_cache(keys: list[torch.Tensor], values: list[torch.Tensor], room: int = DEFAULT_ROOM) -> DynamicCache:
    """A ``DynamicCache`` over per-layer ``keys``/``values`` (copied once) that may grow by ``room``."""
    cache = DynamicCache()
    for i, (k, v) in enumerate(zip(keys, values)):
        cache.update(k[..., :0, :], v[..., :0, :], i)  # creates layer i
        cache.layers[i] = RoomLayer(k, v, room)
    return cache


def stacked_cache(rows: list[tuple[list[torch.Tensor], list[torch.Tensor]]], room: int = DEFAULT_ROOM) -> DynamicCache:
    """A batch's cache from its answers: ``rows[j]`` is answer ``j``'s per-layer keys and values
    ([kv_heads, length_j, head_dim] each), left-padded to the longest (``RoomLayer.stacked``)."""
    cache = DynamicCache()
    for i in range(len(rows[0][0])):
        layer = RoomLayer.stacked([(keys[i], values[i]) for keys, values in rows], room)
        cache.update(layer.keys[..., :0, :], layer.values[..., :0, :], i)  # creates layer i
        cache.layers[i] = layer
    return cache


def with_room(cache: DynamicCache, room: int = DEFAULT_ROOM) -> DynamicCache:
    """``cache`` with each plain layer turned into a ``RoomLayer`` (one copy); other layer kinds
    (sliding windows, quantised) stay as they are."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys is not None and layer.keys.numel():
            cache.layers[i] = RoomLayer(layer.keys, layer.values, room)
    return cache
