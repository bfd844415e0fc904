"""The in-place decode cache (decode_cache.RoomLayer) gives transformers' DynamicCache's logits
without copying the cache on every step."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from cacheblend_rag.decode.cache import RoomLayer, room_cache, stacked_cache, with_room
from cacheblend_rag.testing import make_model

STEPS = 6


@torch.inference_mode()
def _decode(model, cache, first: torch.Tensor, start: int) -> tuple[list[torch.Tensor], list[int]]:
    """Greedy ``STEPS`` tokens from ``cache``: every step's logits and the keys' data pointer."""
    token, logits, pointers = first, [], []
    for step in range(STEPS):
        out = model(input_ids=token, position_ids=torch.tensor([[start + step]]), past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
        pointers.append(cache.layers[0].keys.data_ptr())
        token = out.logits[:, -1:].argmax(-1)
    return logits, pointers


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("room", [2, 64])
def test_room_cache_decodes_like_dynamic_cache_and_copies_once_per_room(arch, room):
    model = make_model(arch)
    prompt = torch.randint(3, 400, (1, 40))
    with torch.inference_mode():
        out = model(input_ids=prompt, use_cache=True)
    first = out.logits[:, -1:].argmax(-1)
    plain = out.past_key_values
    assert isinstance(plain, DynamicCache)
    roomy = with_room(copy.deepcopy(plain), room)
    assert all(isinstance(layer, RoomLayer) for layer in roomy.layers)
    want, plain_ptrs = _decode(model, plain, first, 40)
    got, room_ptrs = _decode(model, roomy, first, 40)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert roomy.get_seq_length() == plain.get_seq_length() == 40 + STEPS
    # DynamicCache copies the cache on every step; the room cache only when its room runs out.
    assert all(a != b for a, b in zip(plain_ptrs, plain_ptrs[1:]))
    if room >= STEPS:
        assert len(set(room_ptrs)) == 1
    else:
        assert 1 < len(set(room_ptrs)) < STEPS


def test_room_layer_survives_a_batch_reorder():
    # transformers' own cache methods replace the views (here: keep row 1); the next update must
    # append to what they left, not to the stale buffer.
    keys, values = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    cache = room_cache([keys], [values], room=16)
    cache.layers[0].batch_select_indices(torch.tensor([1]))
    new_k, new_v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    k, v = cache.update(new_k, new_v, 0)
    torch.testing.assert_close(k, torch.cat([keys[1:], new_k], dim=2), rtol=0, atol=0)
    torch.testing.assert_close(v, torch.cat([values[1:], new_v], dim=2), rtol=0, atol=0)


def test_room_layer_starts_over_after_reset():
    cache = room_cache([torch.randn(1, 2, 5, 8)], [torch.randn(1, 2, 5, 8)], room=4)
    cache.reset()
    k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    got_k, got_v = cache.update(k, v, 0)
    assert torch.equal(got_k, k) and torch.equal(got_v, v) and cache.get_seq_length() == 3


def test_stacked_cache_left_pads_rows_with_zeros_and_grows_in_place():
    # A batch's cache built from answers of different lengths: each row right-aligned, the padding
    # zeros (masked positions must not hold NaN: 0 * NaN reaches attention's output).
    short = [torch.randn(2, 3, 8) for _ in range(2)], [torch.randn(2, 3, 8) for _ in range(2)]
    long = [torch.randn(2, 5, 8) for _ in range(2)], [torch.randn(2, 5, 8) for _ in range(2)]
    cache = stacked_cache([short, long], room=4)
    for layer in range(2):
        keys, values = cache.layers[layer].keys, cache.layers[layer].values
        assert keys.shape == values.shape == (2, 2, 5, 8)
        assert torch.equal(keys[0, :, :2], torch.zeros(2, 2, 8)) and torch.equal(values[0, :, :2], torch.zeros(2, 2, 8))
        assert torch.equal(keys[0, :, 2:], short[0][layer]) and torch.equal(values[0, :, 2:], short[1][layer])
        assert torch.equal(keys[1], long[0][layer]) and torch.equal(values[1], long[1][layer])
    buffer = cache.layers[0]._keys.data_ptr()
    new = torch.randn(2, 2, 1, 8)
    k, _ = cache.update(new, new, 0)
    assert k.shape[-2] == 6 and torch.equal(k[..., -1:, :], new) and cache.layers[0]._keys.data_ptr() == buffer
