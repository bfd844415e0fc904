"""The planner: a prompt layout and what the store holds -> which positions load, compute or reuse.

Pure: no model and no store object. The store's contents arrive as a ``contains(key)`` predicate,
so a plan can be built and checked in a unit test. The engine then runs the plan: the chunk cache
computes the misses, the loader assembles the loads and the fusor recomputes the selected tokens.

* ``plan_prefix``: prefix caching, the longest run of segments cached behind exactly what precedes
  them (exact reuse), the rest an exact causal prefill through the fusor (``causal_plan``);
* ``plan_full``: ``full_recompute_saved``, the full prefill with the fusor's last-layer saving (a
  ``causal_plan`` from position 0, nothing loaded);
* ``plan_fusion``: the fused modes (``full_reuse``, ``cacheblend``): every reusable chunk is loaded
  (or computed, on a miss) and its positions marked as candidates for recompute;
* ``guide``: a question-guided strategy's plan, once the question's attention has scored the
  context (``fusor.question_pass``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

import torch

from cacheblend_rag.blend.fusor import FusionPlan
from cacheblend_rag.blend.selector import pick_chunks, pick_tokens
from cacheblend_rag.chat.prompt import PromptLayout, Segment
from cacheblend_rag.config import BlendConfig
from cacheblend_rag.model.attention import ContextAttention, row_groups
from cacheblend_rag.neighbours.index import NeighbourIndex
from cacheblend_rag.store.keys import chunk_key
from cacheblend_rag.store.loader import LoadSpec

__all__ = [
    "FusedRequest",
    "Load",
    "PrefixRequest",
    "causal_plan",
    "context_attention",
    "fusion_keys",
    "guide",
    "plan_full",
    "plan_fusion",
    "plan_prefix",
    "prefix_keys",
    "suffix_blocks_pay",
]

Contains = Callable[[str], bool]  # the store's contents: is every layer of this chunk there?

# Where a load's K/V come from.
STORE = "store"  # read from the store by the loader
COMPUTE = "compute"  # a miss: the chunk cache computes it now and writes it back
PREFIX = "prefix"  # the instruction prefix, from this process's copy


@dataclass(frozen=True)
class Load:
    """One reused segment of the prompt: where it sits, under which key, and where its K/V come from."""

    spec: LoadSpec  # kv is None here: the engine fills it for COMPUTE and PREFIX loads
    segment: Segment
    source: str = STORE


# How much more a key read costs in a masked attention call than in SDPA's causal kernel on CPU
# (a scratch measurement on the shared dev machine put it near 2; re-measure on a quiet one).
MASKED_KEY_COST = 2


@dataclass
class PrefixRequest:
    """Prefix caching: load ``loads`` (a true prefix of ``reused`` tokens), prefill the rest."""

    plan: FusionPlan  # positions [reused, prompt) computed on every layer, causally
    loads: list[LoadSpec]
    reused: int  # prompt positions [0, reused) come from the store
    writebacks: list[tuple[str, int, int]]  # (key, offset, length) of each segment computed here
    hits: int  # reusable chunks loaded
    misses: int  # reusable chunks prefilled


@dataclass
class FusedRequest:
    plan: FusionPlan
    loads: list[Load]
    hits: int = 0  # reusable chunks found in the store
    misses: int = 0  # reusable chunks computed for this request
    neighbour_hits: int = 0  # chunks served by their cross-chunk-aware cache
    hkvd: bool = False  # HKVD's checks select the tokens; otherwise the question's attention does
    chunk_keys: tuple[str, ...] = ()  # the prompt's chunks' plain keys, in prompt order


def plan_prefix(
    layout: PromptLayout,
    fingerprint: str,
    contains: Contains,
    avoid: Collection[str] = (),
    device: torch.device | str = "cpu",
) -> PrefixRequest:
    """Each segment is keyed by everything before it, so only a true prefix ever matches; the
    segments after the first miss are prefilled and written back for the next request.

    The suffix's attention never reads more keys than a causal prefill of the whole prompt
    (``causal_plan``)."""
    token_ids = layout.token_ids
    loads: list[LoadSpec] = []
    writebacks: list[tuple[str, int, int]] = []
    reused = hits = misses = 0
    for seg, off in zip(layout.segments[:-1], layout.offsets()):  # the question is never cached
        key = chunk_key(fingerprint, token_ids[:off], seg.token_ids)
        if reused == off and key not in avoid and contains(key):
            loads.append(LoadSpec(off, len(seg), key, 0))
            reused = off + len(seg)
            hits += seg.reusable
        else:
            writebacks.append((key, off, len(seg)))
            misses += seg.reusable
    return PrefixRequest(causal_plan(layout, reused, device), loads, reused, writebacks, hits, misses)


def prefix_keys(layout: PromptLayout, fingerprint: str) -> list[str]:
    """Every key ``plan_prefix`` may ask the store about, to look them up in one batch
    (``store.lookup.Lookup``)."""
    token_ids = layout.token_ids
    return [chunk_key(fingerprint, token_ids[:off], seg.token_ids) for seg, off in zip(layout.segments[:-1], layout.offsets())]


def fusion_keys(
    layout: PromptLayout, fingerprint: str, prefix_ids: Sequence[int], neighbours: NeighbourIndex | None = None
) -> list[str]:
    """Every key ``plan_fusion`` may ask the store about: the instruction prefix's, each chunk's
    and its cross-chunk-aware caches', to look them up in one batch (``store.lookup.Lookup``)."""
    prefix = tuple(prefix_ids)
    keys = [chunk_key(fingerprint, (), prefix)]
    for seg in layout.segments:
        if seg.reusable:
            key = chunk_key(fingerprint, prefix, seg.token_ids)
            keys.append(key)
            if neighbours is not None:
                keys += [cache.key for cache in neighbours.caches(key)]
    return keys


def plan_full(layout: PromptLayout, device: torch.device | str = "cpu") -> PrefixRequest:
    """``full_recompute_saved``: every position computed, as in full prefill; nothing is loaded
    or written back."""
    return PrefixRequest(causal_plan(layout, 0, device), loads=[], reused=0, writebacks=[], hits=0, misses=0)


def suffix_blocks_pay(reused: int, length: int) -> bool:
    """Whether prompt positions [reused, length) should attend over keys [0, length) in masked row
    blocks (``attention.row_groups``, each reading keys up to its last row) rather than through
    SDPA's causal kernel with the query padded in front (``attention._padded_causal``).

    The padded path reads what a causal prefill of the whole prompt reads, length * (length + 1)
    / 2 keys per head, in the same kernel: never more attention work than full prefill. Blocks
    read fewer keys, but at ``MASKED_KEY_COST`` times the cost each, so they pay only for a suffix
    short next to the prefix (the question after a cached prompt), never for long suffixes.
    """
    if reused <= 0 or length - reused <= 0:
        return False
    blocks = row_groups(torch.arange(reused, length), 1)
    return MASKED_KEY_COST * sum((b - a) * keys for a, b, keys in blocks) <= length * (length + 1) // 2


def causal_plan(layout: PromptLayout, start: int, device: torch.device | str = "cpu") -> FusionPlan:
    """Positions [start, prompt) recomputed on every layer over the loaded K/V of [0, start):
    exact, like the model's own prefill; their attention in row blocks or through the causal
    kernel, whichever is cheaper (``suffix_blocks_pay``)."""
    length = len(layout)
    always = torch.zeros(length, dtype=torch.bool, device=device)  # [length]
    always[start:] = True
    none = torch.zeros_like(always)
    return FusionPlan(
        input_ids=torch.tensor(layout.token_ids, dtype=torch.long, device=device),
        always=always,
        candidate=none,
        forced=none,
        recompute_first_layer=False,
        causal_suffix=not suffix_blocks_pay(start, length),
    )


def plan_fusion(
    layout: PromptLayout,
    mode: str,
    config: BlendConfig,
    *,
    fingerprint: str,
    prefix_ids: Sequence[int],
    contains: Contains,
    num_layers: int,
    neighbours: NeighbourIndex | None = None,
    avoid: Collection[str] = (),
    device: torch.device | str = "cpu",
) -> FusedRequest:
    """The fused prefill of ``layout`` in ``mode`` (``full_reuse`` or ``cacheblend``).

    The instruction prefix is loaded (never recomputed); a chunk right after it, cached behind
    exactly that prefix, is exact; every other chunk is a candidate for recompute, read from its
    cross-chunk-aware cache where one exists (``neighbours``: the one whose prefix best matches the
    chunks in front of it in this prompt).
    Keys in ``avoid`` (records lost during an earlier attempt) are never loaded: they are computed.
    """
    length = len(layout)
    token_ids = layout.token_ids
    prefix = tuple(prefix_ids)
    always = torch.zeros(length, dtype=torch.bool, device=device)  # [length]
    candidate = torch.zeros_like(always)
    forced = torch.zeros_like(always)
    loads: list[Load] = []
    hits = misses = neighbour_hits = 0
    chunk_keys: list[str] = []  # plain keys of the prompt's chunks, in order

    def stored(key: str) -> bool:
        return key not in avoid and contains(key)

    for seg, off in zip(layout.segments, layout.offsets()):
        span = slice(off, off + len(seg))
        if not seg.reusable:
            # The instruction prefix is exact: never recomputed, and taken from this process's copy
            # (computed once), not the store, whose record of it a quantized format would round.
            if off == 0 and seg.token_ids == prefix:
                loads.append(Load(LoadSpec(0, len(seg), chunk_key(fingerprint, (), prefix), 0), seg, PREFIX))
            else:
                always[span] = True
            continue
        exact = off == len(prefix) and tuple(token_ids[:off]) == prefix
        key = chunk_key(fingerprint, prefix, seg.token_ids)
        nb = (
            neighbours.choose(key, chunk_keys, stored)
            if neighbours is not None and config.neighbour_caches and not exact
            else None
        )
        chunk_keys.append(key)
        if nb is not None:
            key = nb.key
            neighbour_hits += 1
        if stored(key):
            hits += 1
            source = STORE
        else:
            misses += 1
            source = COMPUTE
        loads.append(Load(LoadSpec(off, len(seg), key, off - len(prefix)), seg, source))
        if not exact:
            candidate[span] = True
            if config.boundary_tokens:
                forced[off : off + min(config.boundary_tokens, len(seg))] = True

    hkvd = mode == "cacheblend" and config.strategy == "hkvd"
    checks: dict[int, int] = {}  # check layer -> candidate tokens kept after it
    if hkvd:
        n_forced = int(forced.sum())
        for layer, frac in config.check_points():
            if layer < num_layers:
                checks[layer] = max(0, math.ceil(frac * layout.num_context_tokens) - n_forced)
    plan = FusionPlan(
        input_ids=torch.tensor(token_ids, dtype=torch.long, device=device),
        always=always,
        candidate=candidate,
        forced=forced,
        recompute_first_layer=hkvd,
        checks=checks,
        num_query=len(layout.segments[-1]),
        attention_groups=config.attention_groups,
        context_attention=context_attention(layout, config),
    )
    return FusedRequest(plan, loads, hits, misses, neighbour_hits, hkvd, tuple(chunk_keys))


def guide(plan: FusionPlan, layout: PromptLayout, config: BlendConfig, scores: torch.Tensor, num_layers: int) -> FusionPlan:
    """Question-guided selection: force the context tokens (``strategy="question"``) or whole
    chunks (``"chunk"``) the question attends to most, ``scores`` [length], on every layer, within
    ``config.recompute_ratio`` of the context. ``"hybrid"`` makes the top ``hybrid_seed`` budgets
    of tokens the only candidates, recomputed on layers 0-1, and layer 1's deviation check keeps
    one budget of them (the fusor's HKVD check, over a seed instead of the whole context). Layer 1
    is HKVD's first layer with signal (``BlendConfig.check_points``): a one-layer model has none,
    so there "hybrid" selects as "question" does."""
    n_forced = int(plan.forced.sum())
    budget = max(0, math.ceil(config.recompute_ratio * layout.num_context_tokens) - n_forced)
    selectable = plan.candidate & ~plan.forced
    forced, candidate, checks = plan.forced.clone(), plan.candidate, {}
    hybrid = config.strategy == "hybrid" and num_layers > 1
    if hybrid:
        candidate = plan.forced.clone()
        candidate[pick_tokens(scores, selectable, math.ceil(config.hybrid_seed * budget), config.selection_window)] = True
        checks = {1: budget}
    elif config.strategy in ("question", "hybrid"):
        forced[pick_tokens(scores, selectable, budget, config.selection_window)] = True
    elif budget > 0:
        spans = [(off, off + len(seg)) for seg, off in zip(layout.segments, layout.offsets()) if bool(plan.candidate[off])]
        for i in pick_chunks(scores, spans, budget):
            forced[spans[i][0] : spans[i][1]] = True
    # The question's selection is no causal suffix (causal_plan's).
    return replace(plan, candidate=candidate, forced=forced, recompute_first_layer=hybrid, checks=checks, causal_suffix=False)


def context_attention(layout: PromptLayout, config: BlendConfig) -> ContextAttention | None:
    """APE's reweighting of the chunks (from the first chunk to the question), if configured."""
    if not config.reweights_context or len(layout.segments) < 3:
        return None
    offsets = layout.offsets()
    return ContextAttention(offsets[1], offsets[-1], config.context_temperature, config.context_scale)
