"""A registered attention function: SDPA, plus an optional probe of the question's attention.

The query-aware criterion needs the attention from the question's tokens to the context on a check
layer. SDPA does not return weights, so a probe passed through the layer's kwargs recomputes just
those few rows. Without a probe this is exactly transformers' own SDPA path.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTN_IMPLEMENTATION = "cacheblend_sdpa"
PROBE_KWARG = "cacheblend_probe"


class StopAfterProjection(Exception):
    """Raised by the attention function for a capture pass, once K/V are in the cache."""


class AttentionProbe:
    """Records the mean attention of the last ``num_queries`` query rows over all keys.

    ``stop=True`` makes the attention function raise ``StopAfterProjection`` after observing: the
    fusor's capture pass needs a layer's fresh K/V (and this probe), not its output.
    """

    def __init__(self, num_queries: int, stop: bool = False):
        self.num_queries, self.stop = num_queries, stop
        self.weights: torch.Tensor | None = None  # [kv_len]

    def observe(self, module, query, key, attention_mask, scaling) -> None:
        if self.num_queries == 0:
            return
        q = query[:, :, -self.num_queries :].float()  # [b, heads, nq, d]
        k = key.float()
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if attention_mask is not None:
            scores = scores + attention_mask[:, :, -self.num_queries :, : k.shape[-2]].float()
        self.weights = scores.softmax(dim=-1).mean(dim=(0, 1, 2))


def blend_attention_forward(module, query, key, value, attention_mask, **kwargs):
    probe = kwargs.pop(PROBE_KWARG, None)
    if probe is not None:
        probe.observe(module, query, key, attention_mask, kwargs.get("scaling"))
        if probe.stop:
            raise StopAfterProjection
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def install(model) -> None:
    """Make ``model`` dispatch attention through ``blend_attention_forward`` (SDPA masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, blend_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
