"""A decode step in few operations, for models whose decoder layer is the Llama pattern.

One decoded token through transformers' modules costs about fifty small operations per layer
(norms in seven, three projections where one would do, rotary in six, the cache's bookkeeping)
on top of the bytes the step must read, and on a 2-core CPU those small operations were a third of
SmolLM2-135M's step (docs/engine.md, "Where a decode step goes"). :class:`FastDecodeStep` runs the
same arithmetic on the same weights with one projection for Q, K and V, one for the MLP's gate and
up, ``F.rms_norm`` and one attention call per layer in which each K/V head's query heads are the
rows (every key read once).

It is built only for the layer structure it reproduces (``model_type`` llama, mistral or qwen2;
SiLU MLP; RMS norms; no sliding window; no logit or embedding scales) and, like the backbone's
self-test, checked at load against the model's own forward on a few decode steps: anything else,
or any difference, leaves decoding to the model's forward. :meth:`FastDecodeStep.batched` is the
same step for several answers sharing one left-padded cache (``serving.batcher.DecodeBatch``),
checked the same way; APE keeps the model's forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cacheblend_rag.model.weights import Fp16Linear, weight_format

log = logging.getLogger(__name__)

_LAYER_PATTERN = ("llama", "mistral", "qwen2")


def _fused(linears: list[nn.Module]) -> nn.Module:
    """One linear computing ``linears`` side by side (outputs concatenated), in their format.

    The originals' weights become row slices of the fused weight, so the model keeps one copy of
    them (a fused fp16 linear adds its half-size packed matrix)."""
    weight = torch.cat([m.weight for m in linears])
    biases = [m.bias for m in linears]
    present = [b for b in biases if b is not None]  # in the biases' dtype (fp16 weights keep float32 biases)
    bias = (
        None
        if not present
        else torch.cat([b if b is not None else present[0].new_zeros(m.weight.shape[0]) for m, b in zip(linears, biases)])
    )
    fused: nn.Module = nn.Linear(
        weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype
    ).requires_grad_(False)
    fused.weight.data = weight
    if bias is not None:
        fused.bias.data = bias
    if isinstance(linears[0], Fp16Linear):
        fused = Fp16Linear(fused)  # the weights are already rounded: the same values
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        if isinstance(m, nn.Linear):
            m.weight.data = fused.weight[start : start + rows]
        else:
            m.weight = fused.weight[start : start + rows]
        start += rows
    return fused


@dataclass
class _Layer:
    norm1: torch.Tensor
    eps1: float
    qkv: nn.Module
    o: nn.Module
    norm2: torch.Tensor
    eps2: float
    gate_up: nn.Module
    down: nn.Module
    scale: float


class FastDecodeStep:
    """``step(token, position, cache) -> logits [vocab]`` (float32) for one answer;
    ``step.batched(tokens, positions, cache, mask) -> logits [rows, vocab]`` for several."""

    def __init__(self, model: Any):
        config = model.config
        self.model = model
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.hidden, self.intermediate = config.hidden_size, config.intermediate_size
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    layer.input_layernorm.weight,
                    layer.input_layernorm.variance_epsilon,
                    _fused([attn.q_proj, attn.k_proj, attn.v_proj]),
                    attn.o_proj,
                    layer.post_attention_layernorm.weight,
                    layer.post_attention_layernorm.variance_epsilon,
                    _fused([mlp.gate_proj, mlp.up_proj]),
                    mlp.down_proj,
                    float(attn.scaling),
                )
            )
        self.norm, self.norm_eps = model.model.norm.weight, model.model.norm.variance_epsilon
        self.embed, self.head, self.rotary = model.model.embed_tokens, model.lm_head, model.model.rotary_emb

    @classmethod
    def build(cls, model: Any, window: int | None, *, checked: bool = False) -> FastDecodeStep | None:
        """The fast step for ``model``, or None where it would not be the model's own arithmetic.

        ``checked``: the numerical check against the model's forward already passed for this very
        model, torch, code and CPU (``model.load_cache.PassedChecks``), so only the structural one
        runs."""
        reason = _unsupported(model, window)
        if reason is None:
            step = cls(model)
            reason = None if checked else step._check()
            if reason is None:
                return step
        log.info("decoding through the model's forward: %s", reason)
        return None

    @torch.inference_mode()
    def __call__(self, token: int, position: int, cache: Any) -> torch.Tensor:
        heads, kv, d = self.heads, self.kv_heads, self.head_dim
        h = self.embed(torch.tensor([[token]], device=self.embed.weight.device))  # [1, 1, hidden]
        cos, sin = self.rotary(h, torch.tensor([[position]], device=h.device))  # [1, 1, d]
        shape = (self.hidden,)
        for i, layer in enumerate(self.layers):
            x = F.rms_norm(h, shape, layer.norm1, layer.eps1)
            qkv = layer.qkv(x).view(heads + 2 * kv, 1, d)
            qk = _rotate(qkv[: heads + kv], cos, sin)  # Q and K in one rotation: fewer small ops a layer
            q, k = qk[:heads], qk[heads:]
            keys, values = cache.layers[i].update(k[None], qkv[heads + kv :][None])  # [1, kv, past + 1, d]
            # Each K/V head's query heads are the rows of one attention: [1, kv, heads / kv, d].
            out = F.scaled_dot_product_attention(q.view(1, kv, heads // kv, d), keys, values, scale=layer.scale)
            h = h + layer.o(out.reshape(1, 1, heads * d))
            gate, up = layer.gate_up(F.rms_norm(h, shape, layer.norm2, layer.eps2)).split(self.intermediate, -1)
            h = h + layer.down(F.silu(gate) * up)
        return self.head(F.rms_norm(h, shape, self.norm, self.norm_eps)).view(-1).float()

    @torch.inference_mode()
    def batched(self, tokens: list[int], positions: list[int], cache: Any, mask: torch.Tensor) -> torch.Tensor:
        """One token for each of several answers (rows) that share ``cache`` ([rows, kv_heads,
        length, head_dim] per layer, left-padded): ``tokens`` and their ``positions`` per row,
        ``mask`` [rows, length + 1] (1: a real key, the new token's included). The model's
        forward with that attention mask, in fewer operations."""
        heads, kv, d = self.heads, self.kv_heads, self.head_dim
        rows = len(tokens)
        device = self.embed.weight.device
        h = self.embed(torch.tensor(tokens, device=device)[:, None])  # [rows, 1, hidden]
        cos, sin = self.rotary(h, torch.tensor(positions, device=device)[:, None])  # [rows, 1, d]
        cos, sin = cos[:, None], sin[:, None]  # [rows, 1, 1, d]: the same for every head
        attend = mask.bool()[:, None, None, :]  # [rows, 1, 1, length + 1]
        shape = (self.hidden,)
        for i, layer in enumerate(self.layers):
            x = F.rms_norm(h, shape, layer.norm1, layer.eps1)
            qkv = layer.qkv(x).view(rows, heads + 2 * kv, 1, d)
            qk = _rotate(qkv[:, : heads + kv], cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            keys, values = cache.layers[i].update(k, qkv[:, heads + kv :])  # [rows, kv, length + 1, d]
            out = F.scaled_dot_product_attention(
                q.reshape(rows, kv, heads // kv, d), keys, values, attn_mask=attend, scale=layer.scale
            )
            h = h + layer.o(out.reshape(rows, 1, heads * d))
            gate, up = layer.gate_up(F.rms_norm(h, shape, layer.norm2, layer.eps2)).split(self.intermediate, -1)
            h = h + layer.down(F.silu(gate) * up)
        return self.head(F.rms_norm(h, shape, self.norm, self.norm_eps))[:, 0].float()

    def _check(self, tokens: int = 6, steps: int = 3) -> str | None:
        """None if a few decode steps give the model's own forward's logits, else the difference."""
        from transformers import DynamicCache

        from cacheblend_rag.model.backbone import cache_kwarg

        model, kw = self.model, cache_kwarg(self.model)
        device = self.embed.weight.device
        ids = (torch.arange(tokens, device=device) * 7919 + 11) % int(model.config.vocab_size)
        with torch.inference_mode():
            mine, theirs = DynamicCache(config=model.config), DynamicCache(config=model.config)
            for cache in (mine, theirs):
                model(input_ids=ids[None], use_cache=True, **{kw: cache})
            for pos in range(tokens, tokens + steps):
                token = int(ids[pos % tokens])
                want = (
                    model(
                        input_ids=torch.tensor([[token]], device=device),
                        position_ids=torch.tensor([[pos]], device=device),
                        use_cache=True,
                        **{kw: theirs},
                    )
                    .logits[0, -1]
                    .float()
                )
                got = self(token, pos, mine)
                err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
                if not err <= 1e-4:
                    return f"the fast decode step differs from the model's forward (relative logit difference {err:.2g})"
        return self._check_batched(ids, steps)

    def _check_batched(self, ids: torch.Tensor, steps: int) -> str | None:
        """None if a few batched steps over two left-padded rows give the model's own forward's
        logits (with the same attention mask), else the difference."""
        from cacheblend_rag.decode.cache import room_cache
        from cacheblend_rag.model.backbone import cache_kwarg

        model, kw = self.model, cache_kwarg(self.model)
        device = ids.device
        n = len(ids)
        mask = torch.ones(2, n, dtype=torch.long, device=device)
        mask[1, : n // 2] = 0  # row 1: a shorter prompt, left-padded
        positions = [n, n - n // 2]
        with torch.inference_mode():
            from transformers import DynamicCache

            prefill = DynamicCache(config=model.config)
            pos = (mask.cumsum(-1) - 1).clamp_min(0)
            model(input_ids=ids[None].repeat(2, 1), attention_mask=mask, position_ids=pos, use_cache=True, **{kw: prefill})
            kv = [(layer.keys, layer.values) for layer in prefill.layers]
            mine = room_cache([k for k, _ in kv], [v for _, v in kv], steps)
            theirs = room_cache([k for k, _ in kv], [v for _, v in kv], steps)
            for step in range(steps):
                tokens = [int(ids[step]), int(ids[-1 - step])]
                mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
                want = (
                    model(
                        input_ids=torch.tensor(tokens, device=device)[:, None],
                        position_ids=torch.tensor(positions, device=device)[:, None],
                        attention_mask=mask,
                        use_cache=True,
                        **{kw: theirs},
                    )
                    .logits[:, -1]
                    .float()
                )
                got = self.batched(tokens, positions, mine, mask)
                positions = [p + 1 for p in positions]
                err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
                if not err <= 1e-4:
                    return f"the batched fast decode step differs from the model's forward (relative logit difference {err:.2g})"
        return None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` (half-split layout) on [heads, 1, d]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _unsupported(model: Any, window: int | None) -> str | None:
    config = model.config
    if config.model_type not in _LAYER_PATTERN:
        return f"model_type {config.model_type!r} is not one of {', '.join(_LAYER_PATTERN)}"
    if window is not None:
        return "sliding-window attention"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} is not silu"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    if weight_format(model) not in ("fp32", "fp16"):
        return "an unknown weight format"
    layer = model.model.layers[0]
    needed = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm.variance_epsilon",
        "post_attention_layernorm.variance_epsilon",
    )
    for path in needed:
        obj = layer
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is None:
            return f"the decoder layer has no {path}"
    return None
