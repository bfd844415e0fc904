"""The fusor: a layer-by-layer prefill that recomputes only selected tokens (paper 4.1, 4.3).

On each layer the selected tokens' hidden states go through transformers' own decoder layer with
their real positions and an exact causal mask. The layer's cache is a ``ScatterKV`` that writes their
fresh K/V into the loaded (reused) K/V at their positions and hands the full K/V to attention, so a
selected token attends to every earlier token, reused or fresh, and to no later one. On check
layers the fresh-vs-cached deviation ranks the tokens and only the top ones go on (gradual
filtering): a token recomputed on layer i+1 was recomputed on layer i, so its input hidden state
exists. A check layer first runs a projection-only capture pass over the current tokens (their K/V
are all refreshed and scored), then the full layer over the kept ones. On the last layer only the
last position's output is ever read (the next-token logits), so the other selected tokens get a
capture pass for their K/V and the last position alone runs attention and the MLP.

A plan that recomputes every position from some start on (``planner.causal_plan``) is an exact
prefill of that suffix over the loaded K/V before it: the baselines ``full_recompute_saved`` (start
0, SDPA's own causal path) and ``prefix_caching`` (the same path with its query padded in front,
or row blocks for a short suffix) run that way, with the same last-layer saving.

Question-guided strategies (``question_pass``) first run the question alone over the reused K/V
through every layer, reading its attention to each context token; the fusor then recomputes the
chosen tokens on every layer (``FusionPlan.forced``, no checks).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from cacheblend_rag.blend.selector import Criterion, Deviation, top_k
from cacheblend_rag.model.attention import (
    APE_KWARG,
    GROUPS_KWARG,
    PAD_KWARG,
    PROBE_KWARG,
    AttentionProbe,
    ContextAttention,
    StopAfterProjection,
    row_groups,
)

if TYPE_CHECKING:
    from cacheblend_rag.model.backbone import Backbone

LayerLoader = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class FusionPlan:
    """Which prompt positions are computed, reused exactly, or reused and selectable.

    always: recomputed on every layer (instruction prefix, question, text between chunks).
    candidate: reused from a cache that may deviate (non-prefix chunks); selectable.
    forced: candidates recomputed on every layer regardless of score (chunk boundaries).
    Positions in none of these are reused exactly (a chunk cached behind the same prefix).
    checks: check layer -> number of candidate tokens kept after it (empty: the initial set stays).
    num_query: trailing positions whose attention the query-aware criteria read (the question).
    """

    input_ids: torch.Tensor
    always: torch.Tensor
    candidate: torch.Tensor
    forced: torch.Tensor
    recompute_first_layer: bool
    checks: dict[int, int] = field(default_factory=dict)
    num_query: int = 0
    attention_groups: int = 1  # row blocks for the selected tokens' attention (attention.row_groups)
    # Every position from the first selected on runs SDPA's causal kernel over all keys, its query
    # padded in front (attention._padded_causal) instead of masked row blocks (planner.causal_plan).
    causal_suffix: bool = False
    context_attention: ContextAttention | None = None  # APE reweighting of the question's rows

    def initial_selection(self) -> torch.Tensor:
        sel = self.always | self.forced
        if self.recompute_first_layer:
            sel = sel | self.candidate
        return sel.nonzero().flatten()


@dataclass
class FusionStats:
    recomputed_per_layer: list[int] = field(default_factory=list)  # tokens with fresh K/V
    computed_per_layer: list[int] = field(default_factory=list)  # tokens through the whole layer
    load_s_per_layer: list[float] = field(default_factory=list)
    compute_s_per_layer: list[float] = field(default_factory=list)

    @property
    def load_s(self) -> float:
        return sum(self.load_s_per_layer)

    @property
    def compute_s(self) -> float:
        return sum(self.compute_s_per_layer)


@dataclass
class FusionOutput:
    keys: list[torch.Tensor]  # per layer [1, kv_heads, L, head_dim]
    values: list[torch.Tensor]
    logits: torch.Tensor  # [vocab] float32, next-token logits at the last position
    selected: list[torch.Tensor]  # per layer, the positions whose K/V were recomputed
    stats: FusionStats


class ScatterKV:
    """A one-layer stand-in for a transformers Cache: scatter fresh K/V into the loaded K/V."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, keep_cached: torch.Tensor | None):
        self.keys, self.values, self.positions = keys, values, positions
        self.keep_cached = keep_cached  # rows whose cached K/V must be kept for the deviation
        self.deviation: Deviation | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        pos = self.positions
        if self.keep_cached is not None:
            rows = self.keep_cached
            self.deviation = Deviation(
                fresh_k=key_states[0][:, rows],
                fresh_v=value_states[0][:, rows],
                cached_k=self.keys[0][:, pos[rows]].clone(),
                cached_v=self.values[0][:, pos[rows]].clone(),
            )
        self.keys.index_copy_(2, pos, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, pos, value_states.to(self.values.dtype))
        return self.keys, self.values


def causal_mask(positions: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive [1, 1, len(positions), length] mask: row i sees keys 0..positions[i] only."""
    keys = torch.arange(length, device=positions.device)
    allowed = keys[None, :] <= positions[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def _run_layer(layer, hidden, sel, kv, cache_kw, rope, mask, blocks: dict, probe=None, context=None) -> torch.Tensor:
    # blocks: how attention splits its rows ({GROUPS_KWARG: row blocks} or {PAD_KWARG: padding rows})
    extra = {PROBE_KWARG: probe} if probe is not None else dict(blocks)
    if context is not None:
        extra[APE_KWARG] = context
    out = layer(
        hidden,
        attention_mask=mask,
        position_ids=sel[None],
        position_embeddings=rope,
        use_cache=True,
        **{cache_kw: kv},
        **extra,
    )
    return out[0] if isinstance(out, tuple) else out


def _capture(layer, hidden, sel, kv, cache_kw, rope, mask, probe: AttentionProbe) -> None:
    """Run ``layer`` only up to its K/V projections: ``kv`` gets the fresh K/V of ``sel``."""
    try:
        _run_layer(layer, hidden, sel, kv, cache_kw, rope, mask, {}, probe)
    except StopAfterProjection:
        return
    raise RuntimeError(
        f"{type(layer).__name__} did not call its attention function: the capture pass "
        "needs an attention implementation dispatched through transformers' interface"
    )


@dataclass
class QuestionPass:
    scores: torch.Tensor  # [L] question attention per prompt position (pooled over layers/heads)
    keys: list[torch.Tensor]  # per layer [1, kv_heads, L, head_dim]: loaded K/V, question rows fresh
    values: list[torch.Tensor]
    load_s: float
    compute_s: float


@torch.inference_mode()
def question_pass(
    backbone: Backbone, plan: FusionPlan, load: LayerLoader, *, layers: str = "all", heads: str = "mean"
) -> QuestionPass:
    """Run ``plan.always`` (the question and the text between chunks) over the reused K/V of every
    layer and score each position by the attention of the last ``plan.num_query`` rows.

    layers: "all" averages the scores over layers (ProphetKV), "last" reads the last layer only
    (FusionRAG). heads: "mean" over all heads, or "max" over the K/V head groups' means.
    The loaded K/V are returned so the recompute pass need not read the store again; only the
    question's own rows were written, and the recompute pass recomputes them anyway.
    """
    length = plan.input_ids.numel()
    cache_kw = backbone.layer_cache_kwarg
    sel = plan.always.nonzero().flatten()
    if plan.num_query <= 0 or sel.numel() == 0 or int(sel[-1]) != length - 1:
        raise ValueError("question_pass needs the question (the prompt's last positions) in plan.always")
    hidden = backbone.embed(plan.input_ids[sel])[None]
    mask = causal_mask(sel, length, hidden.dtype)
    rope = backbone.rotary_emb(hidden, sel[None])
    keys, values, per_layer = [], [], []
    load_s = compute_s = 0.0
    last = len(backbone.layers) - 1
    for i, layer in enumerate(backbone.layers):
        t0 = time.perf_counter()
        k_full, v_full = load(i)
        t1 = time.perf_counter()
        kv = ScatterKV(k_full, v_full, sel, None)
        # The last layer's output feeds nothing; on the others the probe's probabilities give the
        # question rows' attention output too, when they are all the rows (no second attention).
        probe = AttentionProbe(plan.num_query, stop=i == last, attend=True)
        try:
            hidden = _run_layer(layer, hidden, sel, kv, cache_kw, rope, mask, {}, probe)
        except StopAfterProjection:
            pass
        assert probe.group_weights is not None
        per_layer.append(probe.group_weights.max(0).values if heads == "max" else probe.weights)
        keys.append(kv.keys)
        values.append(kv.values)
        load_s += t1 - t0
        compute_s += time.perf_counter() - t1
    scores = per_layer[-1] if layers == "last" else torch.stack(per_layer).mean(0)
    return QuestionPass(scores, keys, values, load_s, compute_s)


@torch.inference_mode()
def fuse(backbone: Backbone, plan: FusionPlan, load: LayerLoader, criterion: Criterion | None = None) -> FusionOutput:
    """Prefill ``plan`` layer by layer over ``load(i)``'s K/V; ``criterion`` ranks candidates on
    check layers (a plan without checks needs none)."""
    layers = backbone.layers
    length = plan.input_ids.numel()
    cache_kw = backbone.layer_cache_kwarg
    stats = FusionStats()
    keys_out: list[torch.Tensor] = []
    values_out: list[torch.Tensor] = []
    selected_log: list[torch.Tensor] = []
    wants_attention = getattr(criterion, "needs_attention", False) and plan.num_query > 0

    last_layer = len(layers) - 1
    sel = plan.initial_selection()
    hidden = backbone.embed(plan.input_ids[sel])[None]
    dtype = hidden.dtype

    # No check layer nor reweighted rows reads a mask: then a selection of every position, in
    # order, is a plain prefill and runs SDPA's own causal path (is_causal, no mask), as the
    # model's forward does (full_recompute_saved, prefix caching with nothing loaded); so does a
    # plan's causal suffix, its query padded in front to the keys' length.
    plain_causal = not plan.checks and plan.context_attention is None

    def selection_inputs(hidden: torch.Tensor, sel: torch.Tensor):
        rope = backbone.rotary_emb(hidden, sel[None])
        n = sel.numel()
        if plain_causal and (n == length or (plan.causal_suffix and n > 1 and int(sel[0]) == length - n)):
            return None, rope, ({PAD_KWARG: length - n} if n < length else {})
        return causal_mask(sel, length, dtype), rope, {GROUPS_KWARG: row_groups(sel, plan.attention_groups)}

    def context_rows(sel: torch.Tensor) -> ContextAttention | None:
        # The selected rows past the chunks (the question) read the chunks reweighted.
        spec = plan.context_attention
        return None if spec is None else spec.with_rows(int((sel >= spec.end).sum()))

    # Mask, rotary embeddings and row blocks (or padding) depend only on the selection, which
    # changes on check layers and the last layer alone.
    mask, rope, blocks = selection_inputs(hidden, sel)
    context = context_rows(sel)
    for i, layer in enumerate(layers):
        t0 = time.perf_counter()
        k_full, v_full = load(i)
        t1 = time.perf_counter()
        selected_log.append(sel)
        stats.recomputed_per_layer.append(int(sel.numel()))
        if i in plan.checks:
            # Capture pass: the layer runs only up to its K/V projections (and the question's
            # attention probe), which scatters fresh K/V for every token of ``sel`` and measures
            # their deviation. Only the tokens kept go through attention and the MLP: the others'
            # layer-i outputs would feed no later layer, so computing them is waste. Same K/V and
            # selections as running the whole layer for ``sel`` and dropping rows afterwards.
            cand_rows = (plan.candidate[sel] & ~plan.forced[sel]).nonzero().flatten()
            kv = ScatterKV(k_full, v_full, sel, cand_rows)
            probe = AttentionProbe(plan.num_query if wants_attention else 0, stop=True)
            _capture(layer, hidden, sel, kv, cache_kw, rope, mask, probe)
            dev = kv.deviation
            assert dev is not None
            if wants_attention and probe.weights is not None:
                dev.question_attention = probe.weights[sel[cand_rows]]
            assert criterion is not None, "a plan with check layers needs a criterion"
            keep = top_k(criterion(dev), plan.checks[i]) if cand_rows.numel() else cand_rows
            rows = plan.always[sel] | plan.forced[sel]
            rows[cand_rows[keep]] = True
            hidden = hidden[:, rows]
            sel = sel[rows]
            mask, rope, blocks = selection_inputs(hidden, sel)
            context = context_rows(sel)
        if i == last_layer and sel.numel() > 1:
            # Past the last layer only the last position's output is read (the next-token logits);
            # the other selected tokens need their fresh K/V for decoding, not their attention or
            # MLP outputs. So they get a capture pass and the last position alone runs the layer.
            if i not in plan.checks:  # a check's capture pass has already refreshed the kept rows
                _capture(
                    layer, hidden, sel, ScatterKV(k_full, v_full, sel, None), cache_kw, rope, mask, AttentionProbe(0, stop=True)
                )
            hidden, sel = hidden[:, -1:], sel[-1:]
            mask, rope, blocks = selection_inputs(hidden, sel)
            context = context_rows(sel)
        kv = ScatterKV(k_full, v_full, sel, None)
        hidden = _run_layer(layer, hidden, sel, kv, cache_kw, rope, mask, blocks, context=context)
        keys_out.append(kv.keys)
        values_out.append(kv.values)
        stats.computed_per_layer.append(int(sel.numel()))
        stats.load_s_per_layer.append(t1 - t0)
        stats.compute_s_per_layer.append(time.perf_counter() - t1)

    if sel.numel() == 0 or int(sel[-1]) != length - 1:
        raise RuntimeError("internal error: the last prompt position must be recomputed on every layer")
    logits = backbone.logits(hidden[:, -1:])[-1]
    return FusionOutput(keys_out, values_out, logits, selected_log, stats)
