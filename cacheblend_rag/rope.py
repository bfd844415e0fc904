"""RoPE position correction for a cached chunk that moves to a new offset.

A RoPE attention score depends only on the distance between two tokens, and the rotation for
position p+d equals the rotation for p followed by the rotation for d (walkthrough, "Selective KV
recompute"). So a key cached at position p is moved to p+d by one more rotation by d, computed with
the model's own rotary embedding so scaled variants (linear, llama3, yarn) stay exact.
"""

from __future__ import annotations

import torch

# Variants whose inverse frequencies depend on the sequence length: a rotation computed for one
# length does not compose with one computed for another.
UNSHIFTABLE_ROPE_TYPES = ("dynamic", "longrope")


def rope_type(rotary_emb: torch.nn.Module) -> str:
    return str(getattr(rotary_emb, "rope_type", "default"))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotation(rotary_emb: torch.nn.Module, delta: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (``[head_dim]``, float32) of a rotation by ``delta`` positions; reusable for every layer."""
    kind = rope_type(rotary_emb)
    if kind in UNSHIFTABLE_ROPE_TYPES:
        raise ValueError(
            f"rope_type={kind!r} rescales its frequencies with the sequence length, so a cached key "
            "cannot be moved by a rotation; use a model with default/linear/llama3/yarn RoPE"
        )
    probe = torch.zeros(1, dtype=torch.float32, device=device)
    cos, sin = rotary_emb(probe, torch.tensor([[delta]], device=device))  # scaled by attention_scaling
    # yarn multiplies cos/sin by an attention factor; the cached key already carries it once.
    scale = float(getattr(rotary_emb, "attention_scaling", 1.0) or 1.0)
    return cos[0, 0].float() / scale, sin[0, 0].float() / scale


def apply_rotation(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    k32 = keys.float()
    return (k32 * cos + _rotate_half(k32) * sin).to(keys.dtype)


def shift_keys(rotary_emb: torch.nn.Module, keys: torch.Tensor, delta: int) -> torch.Tensor:
    """Re-rotate ``keys`` (``[..., tokens, head_dim]``, already rotated) by ``delta`` positions."""
    if delta == 0:
        return keys
    return apply_rotation(keys, *rotation(rotary_emb, delta, keys.device))
