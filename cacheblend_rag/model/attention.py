"""A registered attention function: SDPA, plus an optional probe of the question's attention.

The query-aware criterion needs the attention from the question's tokens to the context on a check
layer. SDPA does not return weights, so a probe passed through the layer's kwargs recomputes just
those few rows. Without a probe this is exactly transformers' own SDPA path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTN_IMPLEMENTATION = "cacheblend_sdpa"
PROBE_KWARG = "cacheblend_probe"
GROUPS_KWARG = "cacheblend_row_groups"
APE_KWARG = "cacheblend_context_attention"
PAD_KWARG = "cacheblend_causal_pad"


MAX_BLOCK_ROWS = 512  # layers 0-2 recompute long runs of rows: more blocks skip more masked keys


def row_groups(positions: torch.Tensor, groups: int) -> list[tuple[int, int, int]]:
    """Split ascending query positions into blocks of rows: (first row, end row, keys).

    Under an exact causal mask a block needs only the keys up to its last row's position; the rest
    of each row is masked anyway. A causal prefill skips the masked half through ``is_causal``; the
    fusor's scattered rows cannot, so a selected token would otherwise pay for the whole prompt.
    ``groups`` blocks at least, and no block over ``MAX_BLOCK_ROWS`` rows: the first layers
    recompute every candidate (thousands of contiguous rows), where 2 blocks would still compute
    about a third more keys than needed; the ~15% of later layers stay at ``groups`` blocks, since
    their scattered late rows gain nothing from more (docs/engine.md, "Row blocks").
    """
    n = int(positions.numel())
    groups = max(1, min(max(groups, -(-n // MAX_BLOCK_ROWS)), n))
    bounds = [round(i * n / groups) for i in range(groups + 1)]
    last = positions.tolist()
    return [(a, b, last[b - 1] + 1) for a, b in zip(bounds, bounds[1:]) if b > a]


@dataclass(frozen=True)
class ContextAttention:
    """APE-style reweighting (arXiv 2502.05431) of what the question reads from the chunks.

    For the last ``rows`` query rows (None: all; the question, then each decoded token), the
    attention logits to keys ``start..end-1`` (the chunks, prefilled apart) are divided by
    ``temperature`` and shifted by ``log(scale)`` before one softmax over all keys: APE's
    log-sum-exp merge of the shared-prefix, context and own-token attentions, in one pass.
    Other rows and keys are untouched.
    """

    start: int
    end: int
    temperature: float = 1.0
    scale: float = 1.0
    rows: int | None = None

    def with_rows(self, rows: int | None) -> ContextAttention:
        return ContextAttention(self.start, self.end, self.temperature, self.scale, rows)


def _context_attention(spec: ContextAttention, module, query, key, value, attention_mask, scaling):
    """Eager attention of the reweighted rows; [batch, rows, heads, head_dim] like SDPA's output."""
    groups = query.shape[1] // key.shape[1]
    k, v = key.float(), value.float()
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query.float(), k.transpose(-1, -2)) * scale  # [b, heads, rows, keys]
    ctx = slice(spec.start, min(spec.end, scores.shape[-1]))
    scores[..., ctx] = scores[..., ctx] / spec.temperature + math.log(spec.scale)
    if attention_mask is not None:
        scores = scores + attention_mask[..., : scores.shape[-1]].float()
    out = torch.matmul(scores.softmax(dim=-1), v)  # [b, heads, rows, d]
    return out.transpose(1, 2).to(query.dtype)


class StopAfterProjection(Exception):
    """Raised by the attention function for a capture pass, once K/V are in the cache."""


class AttentionProbe:
    """Records the mean attention of the last ``num_queries`` query rows over all keys.

    ``weights`` is ``[kv_len]`` (mean over query rows and heads); ``group_weights`` is
    ``[kv_heads, kv_len]``, the mean within each K/V head group (query-guided selection can keep a
    token that one group reads hard). ``stop=True`` makes the attention function raise
    ``StopAfterProjection`` after observing: the fusor's capture pass needs a layer's fresh K/V
    (and this probe), not its output. ``attend=True``, when the probe reads every query row, makes
    the attention function return the output of those same probabilities (eager attention in
    float32) instead of running SDPA again: the question's scoring pass needs both.
    """

    def __init__(self, num_queries: int, stop: bool = False, attend: bool = False):
        self.num_queries, self.stop, self.attend = num_queries, stop, attend
        self.weights: torch.Tensor | None = None  # [kv_len]
        self.group_weights: torch.Tensor | None = None  # [kv_heads, kv_len]
        self.output: torch.Tensor | None = None  # [b, rows, heads, head_dim], with attend

    def observe(self, module, query, key, value, attention_mask, scaling) -> None:
        if self.num_queries == 0:
            return
        b, heads, rows, d = query.shape
        nq = min(self.num_queries, rows)
        kv_heads = key.shape[1]
        groups = heads // kv_heads
        # A K/V head's query heads are adjacent: as rows of one product over that head, every key
        # is read once and never copied per query head (repeat_interleave did, on every layer).
        q = query[:, :, -nq:].float().reshape(b, kv_heads, groups * nq, d)
        scale = scaling if scaling is not None else d**-0.5
        scores = torch.matmul(q, key.float().transpose(-1, -2)).mul_(scale)  # [b, kv_heads, groups*nq, keys]
        scores = scores.view(b, kv_heads, groups, nq, -1)
        if attention_mask is not None:
            scores += attention_mask[:, :, None, -nq:, : scores.shape[-1]].float()
        probs = scores.softmax(dim=-1)
        self.group_weights = probs.mean(dim=(0, 2, 3))  # [kv_heads, keys]
        self.weights = self.group_weights.mean(dim=0)
        if self.attend and nq == rows:
            out = torch.matmul(probs.view(b, kv_heads, groups * nq, -1), value.float())  # [b, kv_heads, groups*nq, d]
            self.output = out.view(b, heads, nq, -1).transpose(1, 2).to(query.dtype)


def _plain_softmax(kwargs) -> bool:
    """No dropout, soft-capping, bias, sliding window or attention sinks: attention is the plain
    softmax over the mask, which a probe or ``enable_gqa`` SDPA computes alike."""
    return not kwargs.get("dropout", 0.0) and all(
        kwargs.get(k) is None for k in ("softcap", "position_bias", "sliding_window", "s_aux")
    )


def _masked_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA, except on CPU with a mask and grouped K/V heads: there transformers copies
    K/V once per query head group (``repeat_kv``; CUDA kernels need it), which costs more than the
    attention itself for the few question rows of a fused prefill. CPU SDPA takes the mask with
    ``enable_gqa`` directly, with the same result."""
    groups = query.shape[1] // key.shape[1]
    if query.device.type != "cpu" or groups == 1 or not _plain_softmax(kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if query.shape[2] == 1 and (attention_mask is None or attention_mask.shape[1] == 1):
        return _decode_sdpa(query, key, value, attention_mask, kwargs.get("scaling"))
    if attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=kwargs.get("scaling"), enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def _decode_sdpa(query, key, value, attention_mask, scaling):
    """One decoded token per answer, grouped K/V heads: each K/V head's query heads become the rows
    of one attention over that head, so every key is read once per step (``enable_gqa`` reads it
    once per query head; docs/engine.md, "Where a decode step goes"). query [b, heads, 1, d],
    key/value [b, kv_heads, keys, d], mask None or [b, 1, 1, keys] -> [b, 1, heads, d]."""
    b, heads, _, d = query.shape
    rows = query.view(b, key.shape[1], heads // key.shape[1], d)  # [b, kv_heads, group, d]
    out = torch.nn.functional.scaled_dot_product_attention(rows, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(b, 1, heads, value.shape[-1]), None


def _padded_causal(module, query, key, value, pad: int, **kwargs):
    """The last ``query.shape[2]`` rows of a causal prefill over every key, through SDPA's own
    causal kernel: ``is_causal`` aligns rows top-left (row i sees keys 0..i), so the query
    [b, heads, rows, d] is padded in front with ``pad`` zero rows to the keys' length and the
    padded rows' output dropped. The kernel and the kept rows' result are the full prefill's; a
    masked call reads each key about twice as slowly on CPU (``planner.suffix_blocks_pay``)."""
    padded = torch.cat([query.new_zeros(*query.shape[:2], pad, query.shape[-1]), query], dim=2)
    out, _ = _masked_sdpa(module, padded, key, value, None, **kwargs)  # [b, keys, heads, d]
    return out[:, pad:], None


def blend_attention_forward(module, query, key, value, attention_mask, **kwargs):
    probe = kwargs.pop(PROBE_KWARG, None)
    groups = kwargs.pop(GROUPS_KWARG, None)
    pad = kwargs.pop(PAD_KWARG, 0)
    context: ContextAttention | None = kwargs.pop(APE_KWARG, None)
    if probe is not None:
        probe.observe(module, query, key, value, attention_mask, kwargs.get("scaling"))
        if probe.stop:
            raise StopAfterProjection
        if probe.output is not None and _plain_softmax(kwargs):
            return probe.output, None
    if context is not None:
        n = query.shape[2] if context.rows is None else min(context.rows, query.shape[2])
        mask = attention_mask[:, :, -n:] if attention_mask is not None else None
        tail = _context_attention(context, module, query[:, :, -n:], key, value, mask, kwargs.get("scaling"))
        if n == query.shape[2]:
            return tail, None
        head_mask = attention_mask[:, :, :-n] if attention_mask is not None else None
        head_groups = [(a, min(b, query.shape[2] - n), e) for a, b, e in (groups or []) if a < query.shape[2] - n]
        head = blend_attention_forward(
            module, query[:, :, :-n], key, value, head_mask, **kwargs, **{GROUPS_KWARG: head_groups or None}
        )[0]
        return torch.cat([head, tail], dim=1), None
    if pad:
        return _padded_causal(module, query, key, value, pad, **kwargs)
    if groups is None or len(groups) < 2 or attention_mask is None:
        return _masked_sdpa(module, query, key, value, attention_mask, **kwargs)
    # Exact: each row block reads only keys 0..its last position (row_groups); SDPA's output is
    # [batch, rows, heads, head_dim], so the blocks concatenate on dim 1.
    outs = [
        _masked_sdpa(module, query[:, :, a:b], key[:, :, :e], value[:, :, :e], attention_mask[:, :, a:b, :e], **kwargs)[0]
        for a, b, e in groups
    ]
    return torch.cat(outs, dim=1), None


def install(model) -> None:
    """Make ``model`` dispatch attention through ``blend_attention_forward`` (SDPA masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, blend_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
