"""The load-time self-test: a model is refused unless the fused path reproduces its own forward.

:func:`~cacheblend_rag.model.backbone.check_support` refuses by name what is known not to work; this
test checks the rest numerically on a few tokens, so a model the adapter does not know is refused
rather than answered wrongly. It runs the fusor, so it lives beside it rather than in the adapter
(``backbone.py``), which the fusor itself builds on.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from cacheblend_rag.blend.fusor import FusionPlan, fuse
from cacheblend_rag.blend.selector import resolve_criterion
from cacheblend_rag.model.backbone import _USE_INSTEAD, Backbone, UnsupportedModelError, _architecture_name
from cacheblend_rag.rope import shift_keys

__all__ = ["self_test"]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest magnitude of ``want`` (nan stays nan)."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))


@torch.inference_mode()
def self_test(backbone: Backbone, tokens: int = 12, shift: int = 37) -> None:
    """Refuse the model unless, on ``tokens`` token ids, (1) the layer-by-layer path
    (``embed``, each layer with an exact causal mask over fresh K/V, ``logits``) gives the
    model's own forward's logits and (2) a layer-0 key computed at position p and moved by
    ``shift`` with the model's rotary embedding equals the key computed at p + shift.
    Cheap (three forwards of a few tokens); catches model-specific steps and RoPE layouts
    that :func:`~cacheblend_rag.model.backbone.check_support` does not name.

    Raises :class:`~cacheblend_rag.errors.UnsupportedModelError` naming the failed check.
    """
    model, config = backbone.model, backbone.model.config
    if backbone.window is not None:
        tokens = min(tokens, backbone.window - 1)  # the model's own cache keeps window - 1 tokens
    device = next(model.parameters()).device
    ids = (torch.arange(tokens, device=device) * 7919 + 11) % int(config.vocab_size)
    kw = backbone.model_cache_kwarg

    def forward(start: int) -> tuple[torch.Tensor, Any]:
        cache = DynamicCache(config=config)
        out = model(
            input_ids=ids[None],
            position_ids=torch.arange(start, start + tokens, device=device)[None],
            use_cache=True,
            **{kw: cache},
        )
        return out.logits[0, -1].float(), cache

    ref, cache = forward(0)
    heads, dim = cache.layers[0].keys.shape[1], cache.layers[0].keys.shape[-1]
    empty = torch.zeros(1, heads, tokens, dim, dtype=cache.layers[0].keys.dtype, device=device)
    every = torch.ones(tokens, dtype=torch.bool, device=device)
    plan = FusionPlan(input_ids=ids, always=every, candidate=~every, forced=~every, recompute_first_layer=False)
    fused = fuse(backbone, plan, lambda i: (empty.clone(), empty.clone()), resolve_criterion("value")).logits
    tol = 1e-3 if empty.dtype == torch.float32 else 5e-2  # half precision rounds every layer
    arch = _architecture_name(model)
    err = _relative_error(fused, ref)
    if not err <= tol:
        raise UnsupportedModelError(
            f"{arch}: the layer-by-layer prefill differs from the model's own forward (relative logit "
            f"difference {err:.2g} on a {tokens}-token self-test), so this model computes something "
            f"outside its decoder layers that CacheBlend does not know. {_USE_INSTEAD}."
        )
    _, moved = forward(shift)
    k0, k1 = cache.layers[0].keys[0], moved.layers[0].keys[0]  # [kv_heads, tokens, head_dim]
    err = _relative_error(shift_keys(backbone.rotary_emb, k0, shift), k1)
    if not err <= tol:
        raise UnsupportedModelError(
            f"{arch}: a cached key moved by {shift} positions with the model's rotary embedding differs "
            f"from the key computed there (relative difference {err:.2g}), so chunk caches could not be "
            f"re-rotated exactly. {_USE_INSTEAD}."
        )
