"""The prefill modes (``config.MODES``): a prompt's K/V cache and first-token logits.

Owns how one prompt is prefilled once the engine has built its layout:

* ``full_recompute``: the model's own forward over the whole prompt;
* ``full_recompute_saved`` and ``prefix_caching``: an exact causal prefill through the fusor over
  K/V loaded straight into prompt-length buffers (the longest cached prefix of segments, for
  prefix caching), the segments computed here written back in the background;
* ``full_reuse`` and ``cacheblend``: every chunk's cache loaded (misses computed), then the planned
  tokens recomputed layer by layer (``fusor.fuse``); for CacheBlend with question-guided selection
  after a scoring pass, and with adaptive recompute's partial steps (``BlendConfig.escalation``);
* the retry when a chunk record is lost during the load, and the fidelity guard's full-prefill
  step (``guard.py``);
* the stats each mode reports (``PrefillResult.stats``).

Reads the engine's parts (adapter, chunk cache, fingerprint, learner) and never imports the
serving layer; :meth:`CacheBlendEngine.prefill` is its entry point.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import DynamicCache

from cacheblend_rag.blend import planner
from cacheblend_rag.blend.fusor import FusionOutput, FusionPlan, FusionStats, fuse, question_pass
from cacheblend_rag.blend.guard import ESCALATED, MARGIN, escalates, first_token_margin
from cacheblend_rag.blend.planner import PrefixRequest
from cacheblend_rag.blend.selector import resolve_criterion
from cacheblend_rag.blend.sources import STATS_KEY as SOURCES_KEY
from cacheblend_rag.blend.sources import chunk_attention
from cacheblend_rag.chat.prompt import PromptLayout
from cacheblend_rag.config import BlendConfig
from cacheblend_rag.model.attention import APE_KWARG
from cacheblend_rag.model.backbone import cache_from
from cacheblend_rag.store.loader import ChunkLost, LayerAssembler, LoadSpec
from cacheblend_rag.store.lookup import Lookup
from cacheblend_rag.store.protocol import ChunkStore

if TYPE_CHECKING:
    from cacheblend_rag.blend.chunk_cache import ChunkCache
    from cacheblend_rag.model.backbone import Backbone
    from cacheblend_rag.neighbours.learned import NeighbourLearner

log = logging.getLogger(__name__)


class Prefills(Protocol):
    """What a prefill reads of the engine (``CacheBlendEngine`` is one)."""

    backbone: Backbone
    chunk_cache: ChunkCache
    learner: NeighbourLearner | None
    fingerprint: str
    device: torch.device
    dtype: torch.dtype
    num_layers: int
    kv_shape: tuple[int, int]
    pipelined: bool | None


@dataclass
class PrefillResult:
    cache: DynamicCache  # [layers] K/V [1, kv_heads, prompt, head_dim]
    logits: torch.Tensor  # [vocab] float32, the next token's
    layout: PromptLayout
    stats: dict[str, Any]
    selected: list[torch.Tensor] | None = None  # [layers][recomputed positions] (fused modes)
    # Extra model-call keywords decoding must pass on (APE reweighting of the chunks' attention).
    attention_kwargs: dict[str, Any] = field(default_factory=dict)


def run_prefill(
    eng: Prefills,
    layout: PromptLayout,
    mode: str,
    config: BlendConfig,
    store: ChunkStore,
    *,
    pipelined: bool | None = None,
) -> PrefillResult:
    """Prefill ``layout`` in ``mode`` (checked by the caller) over ``store``, retrying a chunk
    whose record is lost during the load; ``pipelined`` None is the engine's setting."""
    t0 = time.perf_counter()
    if mode == "full_recompute":
        cache, logits = eng.backbone.forward(torch.tensor(layout.token_ids, dtype=torch.long, device=eng.device))
        stats = _stats(eng, mode, layout, hits=0, misses=0, recomputed=[len(layout)] * eng.num_layers)
        stats["prefill_s"] = time.perf_counter() - t0
        return PrefillResult(cache, logits, layout, stats)
    if mode == "full_recompute_saved":
        return _causal_prefill(eng, layout, mode, planner.plan_full(layout, eng.device), store, t0)
    lost_keys: set[str] = set()
    for _attempt in range(len(layout.segments) + 1):
        try:
            if mode == "prefix_caching":
                return _prefix_prefill(eng, layout, store, t0, avoid=lost_keys)
            fused = _fused_prefill(eng, layout, mode, config, store, pipelined, t0, avoid=lost_keys)
            return _guarded(eng, fused, config, store, t0)
        except ChunkLost as lost:
            # A record went bad, was evicted or its storage failed after the lookup: drop it and
            # recompute it on the retry. The retry never loads a lost key again (even if a broken
            # store still claims to hold it), so this loop ends: each attempt loses a new key.
            log.warning("chunk record %s lost during load; recomputing it", lost.key[:16])
            if lost.key in lost_keys:
                break
            lost_keys.add(lost.key)
            try:
                store.discard(lost.key)
            except Exception as exc:  # noqa: BLE001 - a failing store must not fail the answer
                log.warning("could not discard chunk %s: %r", lost.key[:16], exc)
    raise RuntimeError("chunk caches kept disappearing during load; is another process clearing the store?")


def _guarded(eng: Prefills, fused: PrefillResult, config: BlendConfig, store: ChunkStore, t0: float) -> PrefillResult:
    """The fidelity guard (``guard.py``), escalation's full-prefill step: ``fused``, or a full
    prefill of the same prompt when ``fused``'s first-token margin is below the step's. Both
    report the margin of the last blended pass."""
    margin = first_token_margin(fused.logits)
    fused.stats.update({MARGIN: margin, ESCALATED: False})
    steps = config.escalation_steps()
    partial = len(steps) - 1 if fused.stats["mode"] == "cacheblend" else 0
    # A cascade that stopped at a partial step (its margin cleared that step's) ends there.
    ran = len(fused.stats.get("recompute_steps", [None])) - 1
    if not steps or steps[-1][1] < 1.0 or ran < partial or not escalates(margin, steps[-1][0]):
        return fused
    layout = fused.layout
    full = _causal_prefill(eng, layout, "full_recompute_saved", planner.plan_full(layout, eng.device), store, t0)
    full.stats.update({MARGIN: margin, ESCALATED: True, "blended_prefill_s": fused.stats["prefill_s"]})
    full.stats.update(
        recompute_steps=[*fused.stats.get("recompute_steps", []), 1.0],
        step_margins=[*fused.stats.get("step_margins", [margin]), first_token_margin(full.logits)],
    )
    if SOURCES_KEY in fused.stats:  # the question's attention per chunk, from the blended pass
        full.stats[SOURCES_KEY] = fused.stats[SOURCES_KEY]
    return full


def _prefix_prefill(eng: Prefills, layout: PromptLayout, store: ChunkStore, t0: float, avoid: set[str]) -> PrefillResult:
    """Exact reuse of the longest prefix of segments cached behind exactly what precedes them
    (``planner.plan_prefix``); the rest is an exact causal prefill over the loaded K/V."""
    contains = Lookup(store, planner.prefix_keys(layout, eng.fingerprint))  # one round trip, not one per chunk
    req = planner.plan_prefix(layout, eng.fingerprint, contains, avoid, device=eng.device)
    return _causal_prefill(eng, layout, "prefix_caching", req, store, t0)


def _causal_prefill(
    eng: Prefills, layout: PromptLayout, mode: str, req: PrefixRequest, store: ChunkStore, t0: float
) -> PrefillResult:
    """Load ``req.loads`` straight into prompt-length K/V buffers and prefill the other
    positions through the fusor, which writes their K/V into the same buffers and on the last
    layer runs attention and the MLP for the last position only; the cache adopts the buffers.
    Segments computed here are written back in the background for the next request with the
    same prefix (the answer does not wait for the copies either)."""
    loader = _assembler(eng, store, req.loads, len(layout))
    try:
        out = fuse(eng.backbone, req.plan, loader)
    finally:
        loader.close()
    kv = list(zip(out.keys, out.values))  # [layers](K, V) [1, kv_heads, prompt, head_dim]
    eng.chunk_cache.write_back_spans(store, req.writebacks, kv)
    stats = _stats(eng, mode, layout, req.hits, req.misses, out.stats.recomputed_per_layer, out.stats.computed_per_layer)
    stats.update(
        load_s=sum(loader.load_s_per_layer),
        reused_prefix_tokens=req.reused,
        prefill_s=time.perf_counter() - t0,
        writeback_keys=[key for key, _, _ in req.writebacks],
    )
    return PrefillResult(cache_from(kv, adopt=True), out.logits, layout, stats)


def _fused_prefill(
    eng: Prefills,
    layout: PromptLayout,
    mode: str,
    config: BlendConfig,
    store: ChunkStore,
    pipelined: bool | None,
    t0: float,
    avoid: set[str],
) -> PrefillResult:
    """``full_reuse`` and ``cacheblend``: load every chunk's cache (computing the misses), then
    recompute the planned tokens layer by layer (``fusor.fuse``)."""
    # The layout's own prefix: the instruction, and the tools when a request has them.
    prefix = layout.prefix_ids
    eng.chunk_cache.store_prefix(store, prefix)
    neighbours = eng.chunk_cache.neighbours
    # Every chunk of the request looked up at once: one round trip to a network tier, not one per chunk.
    contains = Lookup(store, planner.fusion_keys(layout, eng.fingerprint, prefix, neighbours))
    req = planner.plan_fusion(
        layout,
        mode,
        config,
        fingerprint=eng.fingerprint,
        prefix_ids=prefix,
        contains=contains,
        num_layers=eng.num_layers,
        neighbours=neighbours,
        avoid=avoid,
        device=eng.device,
    )
    specs, miss_s = eng.chunk_cache.fill(req.loads, store, prefix)
    loader = _assembler(eng, store, specs, len(layout), pipelined=eng.pipelined if pipelined is None else pipelined)
    plan, scoring_s, sources = req.plan, 0.0, None
    criterion = resolve_criterion(config.criterion)
    # Adaptive recompute (BlendConfig.escalation): the partial steps run here, over this pass's
    # scores and loaded K/V; a full-prefill step runs in _guarded.
    steps = [step for step in config.escalation_steps() if step[1] < 1.0] if mode == "cacheblend" else []
    ratios, margins = [config.recompute_ratio], []
    try:
        if mode == "cacheblend" and not req.hkvd:
            # Question-guided selection: score the context by the question's attention over the
            # reused cache, then recompute the chosen tokens (or chunks) on every layer, over the
            # K/V the scoring pass already read.
            qp = question_pass(eng.backbone, plan, loader, layers=config.question_layers, heads=config.question_heads)
            scoring_s = qp.compute_s
            sources = chunk_attention(qp.scores, layout)  # the same scores, summed per chunk
            loaded = list(zip(qp.keys, qp.values))  # [layers](K, V) [1, kv_heads, prompt, head_dim]

            def blend(ratio: float, last: bool) -> tuple[FusionOutput, FusionPlan]:
                guided = planner.guide(req.plan, layout, config.with_ratio(ratio), qp.scores, eng.num_layers)
                # fuse writes the recomputed rows into the K/V it reads: a pass that a later step
                # may follow works on a copy, so that step starts from the loaded K/V, as a
                # fixed-ratio prefill at its ratio would.
                kv = loaded if last else [(k.clone(), v.clone()) for k, v in loaded]
                return fuse(eng.backbone, guided, kv.__getitem__, criterion), guided

            out, plan = blend(config.recompute_ratio, last=not steps)
            margins.append(first_token_margin(out.logits))
            for i, (below, ratio) in enumerate(steps):
                if not escalates(margins[-1], below):
                    break
                out, plan = blend(ratio, last=i == len(steps) - 1)
                ratios.append(ratio)
                margins.append(first_token_margin(out.logits))
        else:
            out = fuse(eng.backbone, plan, loader, criterion)
            margins.append(first_token_margin(out.logits))
    finally:
        loader.close()
    if req.hkvd and steps and escalates(margins[-1], steps[0][0]):
        # HKVD's selection depends on the ratio from layer 1 on: its step is a fresh prefill.
        again = _fused_prefill(eng, layout, mode, config.with_ratio(steps[0][1]), store, pipelined, t0, avoid)
        again.stats["recompute_steps"] = [config.recompute_ratio, *again.stats["recompute_steps"]]
        again.stats["step_margins"] = [*margins, *again.stats["step_margins"]]
        return again
    cache = cache_from(list(zip(out.keys, out.values)), adopt=True)
    stats = _stats(eng, mode, layout, req.hits, req.misses, out.stats.recomputed_per_layer, out.stats.computed_per_layer)
    stats["neighbour_hits"] = req.neighbour_hits
    if eng.learner is not None:
        eng.learner.observe(store, [seg for seg in layout.segments if seg.reusable], prefix)
    stats.update(_load_stats(loader, out.stats, miss_s, scoring_s), prefill_s=time.perf_counter() - t0)
    if mode == "cacheblend":
        stats.update(
            criterion=getattr(config.criterion, "__name__", config.criterion),
            recompute_ratio=ratios[-1],
            strategy=config.strategy,
            recompute_steps=ratios,
            step_margins=margins,
        )
    if sources is not None:
        stats[SOURCES_KEY] = sources
    context = plan.context_attention
    return PrefillResult(
        cache,
        out.logits,
        layout,
        stats,
        out.selected,
        attention_kwargs={} if context is None else {APE_KWARG: context.with_rows(None)},
    )


def _assembler(
    eng: Prefills, store: ChunkStore, loads: Sequence[LoadSpec], prompt_len: int, *, pipelined: bool = False
) -> LayerAssembler:
    """The loader of a prompt's K/V, layer by layer, in the engine's K/V shape, dtype and device."""
    return LayerAssembler(
        store,
        loads,
        prompt_len,
        eng.kv_shape,
        eng.dtype,
        eng.device,
        eng.backbone.rotary_emb,
        eng.num_layers,
        pipelined=pipelined,
    )


def _stats(
    eng: Prefills,
    mode: str,
    layout: PromptLayout,
    hits: int,
    misses: int,
    recomputed: list[int],
    computed: list[int] | None = None,
) -> dict[str, Any]:
    total = len(layout) * eng.num_layers
    computed = recomputed if computed is None else computed
    return {
        "mode": mode,
        "prompt_tokens": len(layout),
        "context_tokens": layout.num_context_tokens,
        "chunks": sum(s.reusable for s in layout.segments),
        "chunk_hits": hits,
        "chunk_misses": misses,
        "recomputed_per_layer": recomputed,
        "recompute_fraction": sum(recomputed) / total if total else 0.0,
        # Token-layers through attention and the MLP; on check layers the tokens dropped
        # there, and on the last layer all but the last position, get fresh K/V from a
        # projection-only pass (fusor.py), so this can be smaller.
        "computed_per_layer": computed,
        "compute_fraction": sum(computed) / total if total else 0.0,
    }


def _load_stats(loader: LayerAssembler, fused: FusionStats, miss_s: float, scoring_s: float) -> dict[str, Any]:
    """Where a fused prefill's time went: computing missed chunks, loading (hidden behind compute
    or not), recompute and question scoring, in total and per layer."""
    total_load = sum(loader.load_s_per_layer)
    # Time the fusor waited for each layer's K/V (a question-guided prefill reads them in its
    # scoring pass; the recompute pass then finds them in memory).
    exposed = fused.load_s_per_layer
    overlapped = loader.pipelined
    return dict(
        miss_compute_s=miss_s,
        load_s=total_load,
        load_exposed_s=fused.load_s,
        load_hidden_s=max(0.0, total_load - fused.load_s) if overlapped else 0.0,
        compute_s=fused.compute_s + scoring_s,
        scoring_s=scoring_s,
        load_s_per_layer=list(loader.load_s_per_layer),
        load_exposed_s_per_layer=list(exposed),
        # Load time that ran behind the previous layer's compute (0 when not pipelined).
        load_hidden_s_per_layer=[max(0.0, load - e) if overlapped else 0.0 for load, e in zip(loader.load_s_per_layer, exposed)],
        compute_s_per_layer=fused.compute_s_per_layer,
        pipelined=bool(loader.pipelined),  # as run: automatic mode decides on layer 0
    )
