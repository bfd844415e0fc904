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


def apply_rotation(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``keys`` rotated by (cos, sin), in float32, cast to ``out``'s dtype (or ``keys``').

    With a float32 ``out`` (same shape, not overlapping ``keys``) the result is written there
    half by half, without temporaries: the loader rotates each chunk straight into its slot of
    the prompt's K on every layer of every request.
    """
    k32 = keys.float()
    if out is None or out.dtype != torch.float32:
        rotated = k32 * cos + _rotate_half(k32) * sin
        return rotated.to(keys.dtype) if out is None else out.copy_(rotated)
    # rotate_half(k) = (-k2, k1), so out1 = k1*cos1 - k2*sin1 and out2 = k2*cos2 + k1*sin2.
    h = k32.shape[-1] // 2
    (k1, k2), (c1, c2), (s1, s2) = (t.split(h, dim=-1) for t in (k32, cos, sin))
    o1, o2 = out[..., :h], out[..., h:]
    torch.mul(k1, c1, out=o1).addcmul_(k2, s1, value=-1)
    torch.mul(k2, c2, out=o2).addcmul_(k1, s2)
    return out


def shift_keys(rotary_emb: torch.nn.Module, keys: torch.Tensor, delta: int) -> torch.Tensor:
    """Re-rotate ``keys`` (``[..., tokens, head_dim]``, already rotated) by ``delta`` positions."""
    if delta == 0:
        return keys
    return apply_rotation(keys, *rotation(rotary_emb, delta, keys.device))
