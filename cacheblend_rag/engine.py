"""CacheBlendEngine: the prefill modes (``config.MODES``) and generation behind one ``generate``.

A façade: the adapter (``backbone``) runs the model, the planner (``planner``) decides what each
prompt position loads, computes or reuses, the chunk cache (``chunk_cache``) computes and writes
chunk caches, the loader (``store.loader``) reads them, the fusor (``fusor``) recomputes the
selected tokens layer by layer, and ``generation`` decodes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from . import planner
from .attention import APE_KWARG
from .backbone import Backbone, cache_from
from .chunk_cache import ChunkCache
from .config import BlendConfig, SamplingParams, check_mode
from .constraints import Grammar
from .decode_step import FastDecodeStep
from .fusor import FusionOutput, FusionPlan, FusionStats, fuse, question_pass
from .generation import DecodeState, decode
from .guard import ESCALATED, MARGIN, escalates, first_token_margin
from .learned_neighbours import LearnConfig, NeighbourLearner
from .planner import PrefixRequest
from .prompt import DEFAULT_INSTRUCTION, PromptBuilder, PromptLayout, Segment, check_texts, check_unicode, named_chunks
from .selector import resolve_criterion
from .self_test import self_test
from .sources import STATS_KEY as SOURCES_KEY
from .sources import chunk_attention
from .store.disk import KVStore
from .store.loader import ChunkLost, LayerAssembler
from .store.lookup import Lookup, contains_many
from .store.protocol import KV, ChunkStore

if TYPE_CHECKING:
    from .controller import LoadingController
    from .store.spec import StoreSpec

log = logging.getLogger(__name__)


@dataclass
class PrefillResult:
    cache: DynamicCache  # [layers] K/V [1, kv_heads, prompt, head_dim]
    logits: torch.Tensor  # [vocab] float32, the next token's
    layout: PromptLayout
    stats: dict[str, Any]
    selected: list[torch.Tensor] | None = None  # [layers][recomputed positions] (fused modes)
    # Extra model-call keywords decoding must pass on (APE reweighting of the chunks' attention).
    attention_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    ttft_s: float
    total_s: float
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)
    # Seconds from the request to each answer token's choice (the first is ttft_s): how long an
    # answer of any length takes, and the time per decoded token (empty from the batcher).
    token_times_s: list[float] = field(default_factory=list)


class CacheBlendEngine:
    """Answer questions over retrieved chunks, reusing each chunk's cached KV.

    ``model`` is a transformers causal LM with rotary position embeddings (Llama, Mistral, Qwen2,
    Qwen3, ...), ``store`` the chunk KV store (a fresh temporary one when omitted).
    ``instruction`` is the system instruction that every chunk is cached behind; ``answer_hint`` a
    line after the question restating the answer format (default none; e.g.
    ``prompt.SHORT_ANSWER_HINT``). Chunk caches do not depend on it.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        store: ChunkStore | None = None,
        config: BlendConfig | None = None,
        instruction: str = DEFAULT_INSTRUCTION,
        answer_hint: str = "",
        model_id: str = "custom",
        fingerprint: str | None = None,
        pipelined: bool | None = None,
        controller: LoadingController | None = None,
    ):
        from .models import model_fingerprint

        # Refused here, before anything is cached, if the fused path cannot be exact for it.
        self.backbone = Backbone.adapt(model.eval())
        self_test(self.backbone)
        # One decoded token in few operations where the model's layers allow it (checked against
        # the model's own forward here, else None: decoding uses the forward).
        self.fast_step = FastDecodeStep.build(model, self.backbone.window)
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.config = _check_config(config) or BlendConfig()
        # Read layer i+1.. from the store while layer i computes (paper section 5). None: decide per
        # request from how layer 0's read went (store.loader.LayerAssembler).
        self.pipelined = pipelined
        # Optional cacheblend_rag.controller.LoadingController: picks the recompute ratio of a
        # request that does not name one (stream/generate with recompute_ratio=None).
        self.controller = controller
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.fingerprint = fingerprint or model_fingerprint(model, tokenizer, self.dtype)
        self.store = store if store is not None else KVStore(None, fingerprint=self.fingerprint)
        self.prompts = PromptBuilder(tokenizer, instruction, answer_hint=answer_hint)
        # Asked of the adapter: the model's layer count, K/V shape and the window inside which the
        # fused prefill is exact.
        self.num_layers = self.backbone.num_layers
        self.kv_shape = self.backbone.kv_shape  # (kv_heads, head_dim)
        self.context_window = self.backbone.context_window
        self.chunk_cache = ChunkCache(self.backbone, self.prompts, self.fingerprint, self.device)
        # Serializes model work on this engine between threads: the serving layer (a Run, the
        # Batcher) holds it for each prefill and decode step, the LangChain retriever for
        # precompute. One forward at a time is also what the hardware does.
        self.lock = threading.Lock()
        self.learner: NeighbourLearner | None = None
        """Learns neighbours from the requests once :meth:`learn_neighbours` is called."""

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        weights: str = "auto",
        cache_dir: str | None = None,
        store_dir: str | None = None,
        store_size_limit: int = 8 * 2**30,
        memory_bytes: int = 2 * 2**30,
        store: StoreSpec | Sequence[StoreSpec] | None = None,
        kv_format: str | None = None,
        **kwargs: Any,
    ) -> CacheBlendEngine:
        """Load ``model`` (default: the bundled SmolLM2-135M-Instruct) and open its KV store.

        The store lives in ``store_dir`` (default ``<cache home>/kv``) so chunk caches outlive
        the process; entries are keyed by the model fingerprint, so models never mix. A directory
        that holds a store but cannot be written (read-only mount, full disk) is served read-only
        until it can be written again. If it cannot be opened at all (not a directory, broken
        database, read-only and empty) a warning is logged and a temporary store, deleted on
        ``close()``, is used instead.

        ``store`` picks the tiers below the memory tier, fastest first (``store.spec``):

        * None or ``"disk"``: the disk store above;
        * ``"redis://[[user]:password@]host:6379/0"`` (``rediss://`` for TLS): one Redis, shared by
          every worker that points at it, instead of the disk;
        * a list such as ``["disk", "redis://host:6379/0"]``: memory -> disk -> Redis, each read
          served by the first tier that holds the chunk and copied up into memory; write-backs go
          to every tier. ``store.redis_tier.RedisConfig(url, prefix=..., socket_timeout_s=...)`` may
          stand for a URL, and a store object for any entry.

        A Redis that is down or slow never fails an answer: its tier is skipped for a while and
        the chunk comes from the next tier or is recomputed. A Redis that refuses the URL's
        password raises ``store.redis_tier.RedisAuthError`` here. See docs/sharing.md.

        ``weights`` is the linear layers' format: "fp32", or on a CPU "fp16", whose decode steps
        read half the weight bytes (docs/engine.md, "Weight formats"); the default "auto" is "fp16"
        for a float32 model on the CPU and "fp32" elsewhere. Every mode runs the same format, and
        chunk caches are kept apart per format.

        Without a ``config``, a quality profile saved by ``cacheblend-rag calibrate`` for this
        model sets the strategy and recompute ratio; otherwise ``BlendConfig()``'s defaults hold.

        ``memory_bytes`` (default 2 GiB; 0 turns it off) keeps the most used chunk caches in RAM
        in front of the other tiers (``store.tiers.TieredStore``): the chunks RAG retrieves come back
        often, and a layer read from RAM skips the database lookup, file read and checksum, which
        were 9% of a CacheBlend prefill on the bundled model (docs/engine.md).

        ``kv_format`` is the format the disk and Redis tiers keep chunk caches in: None or "float"
        (the default), "int8" or "int4" (docs/storage.md, "Quantized chunk records").
        """
        from .models import default_cache_dir, load_model
        from .store.spec import open_store

        loaded = load_model(model, device=device, dtype=dtype, cache_dir=cache_dir, weights=weights)
        home = default_cache_dir() if cache_dir is None else cache_dir
        opened = open_store(
            store,
            directory=store_dir or f"{home}/kv",
            size_limit=store_size_limit,
            fingerprint=loaded.fingerprint,
            memory_bytes=memory_bytes,
            kv_format=kv_format,
        )
        if kwargs.get("config") is None:
            kwargs["config"] = _calibrated_config(loaded.fingerprint)
        return cls(
            loaded.model,
            loaded.tokenizer,
            store=opened,
            model_id=loaded.model_id,
            fingerprint=loaded.fingerprint,
            **kwargs,
        )

    def answer_settings(self) -> dict[str, Any]:
        """What, besides the request itself, decides this engine's answers: the model (weights,
        tokenizer and dtype, by fingerprint), the prompt text around the chunks and the blend
        config. Plain values that are the same in every process, so a cache of answers keyed on
        them (LangChain's LLM cache) never serves one engine's answer for another's."""
        config = {name: _callable_name(v) if callable(v) else v for name, v in vars(self.config).items()}
        return {
            "fingerprint": self.fingerprint,
            "instruction": self.prompts.instruction,
            "answer_hint": self.prompts.answer_hint,
            "config": config,
            # With a controller, a request without a ratio gets one chosen from the load speed.
            "controller": type(self.controller).__name__ if self.controller is not None else None,
        }

    # ------------------------------------------------------------------ chunk caches
    def chunk_key(self, segment: Segment, context_ids: Sequence[int] | None = None) -> str:
        return self.chunk_cache.key(segment, context_ids)

    def is_cached(self, text: str, *, tools: Sequence[Mapping[str, Any]] = ()) -> bool:
        """Whether the chunk ``text`` is cached behind the instruction prefix (with ``tools``: the
        prefix those tools are rendered into)."""
        if not isinstance(text, str):
            raise TypeError(f"is_cached takes a chunk's text (str), got {type(text).__name__}")
        prompts = self.prompts.for_tools(tools)
        return self.store.contains(self.chunk_key(prompts.chunk_segment(text), prompts.prefix_ids))

    def compute_chunk(self, segment: Segment, behind: Sequence[Segment] = ()) -> list[KV]:
        """Prefill one chunk behind the instruction prefix (and the ``behind`` segments, for a
        cross-chunk-aware cache); return its own K/V per layer, ``[kv_heads, len(segment),
        head_dim]``, with keys rotated as if the chunk sat right after the prefix."""
        return self.chunk_cache.compute(segment, behind)

    def precompute(
        self,
        texts: Iterable[str],
        *,
        neighbours: int = 0,
        embed: Callable[[list[str]], torch.Tensor] | None = None,
        corpus: Iterable[str] | None = None,
        progress: bool = True,
        store: ChunkStore | None = None,
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> int:
        """Compute and store the KV of every chunk not cached yet. Returns how many were computed.

        neighbours: also cache each chunk prefilled behind its ``neighbours`` most similar chunks
            among ``texts`` (FusionRAG's offline step; ``embed`` or the bundled MiniLM ranks them),
            keeping only the chunk's own K/V. Generation then uses that cache wherever the chunk
            is not first in the prompt (``BlendConfig.neighbour_caches``). It costs about
            ``neighbours + 1`` times the chunk's prefill on top of the plain cache, and holds for
            this corpus: precompute again after the corpus changes.
        corpus: choose the neighbours among these texts instead of among ``texts``, so that a few
            chunks (new ones, or the ones served most) are cached behind their nearest chunks of
            the whole corpus. Only ``texts`` are cached; each corpus text is embedded once per call.
        store: fill this store instead of the engine's.
        tools: cache the chunks behind the prefix these tools are rendered into (function
            definitions, as for :meth:`stream`): requests with the same tools then reuse them.
        """
        if not isinstance(neighbours, int) or isinstance(neighbours, bool) or neighbours < 0:
            raise ValueError(f"neighbours={neighbours!r} must be an int >= 0 (0: plain chunk caches only)")
        texts = list(dict.fromkeys(check_texts(texts)))
        pool = None if corpus is None else list(dict.fromkeys(check_texts(corpus, "corpus")))
        return self.chunk_cache.precompute(
            self._store(store),
            texts,
            neighbours=neighbours,
            embed=embed,
            corpus=pool,
            progress=progress,
            prefix_ids=self.prompts.for_tools(tools).prefix_ids,
        )

    def learn_neighbours(self, config: LearnConfig | None = None) -> NeighbourLearner:
        """Learn each chunk's neighbours from the requests this engine answers, and cache chunks
        behind the chunks they are retrieved with, in the background (``learned_neighbours.py``).

        Every fused request's chunks are counted; a chunk retrieved behind other chunks gets a
        cache prefilled behind its most frequent predecessors, computed between requests under the
        engine's lock, and later prompts use the cache whose prefix best matches the chunks in
        front of the chunk. Costs one chunk prefill (behind ``config.neighbours`` chunks) per new
        learned cache and its storage (about ``max_caches_per_chunk`` times a chunk's at most).
        Counts and the cache index are saved beside a disk store. Calling it again returns the
        running learner.
        """
        if self.learner is None:
            directory = getattr(self.store, "directory", None)
            self.learner = NeighbourLearner(
                self.chunk_cache.neighbours,
                compute=lambda store, seg, behind, prefix: self.chunk_cache.compute_behind(
                    store, seg, behind, learned=True, prefix_ids=prefix
                )[0],
                key=self.chunk_cache.key,
                lock=lambda: self.lock,
                config=config or LearnConfig(),
                directory=directory,
            )
        return self.learner

    def flush(self) -> None:
        """Wait for background write-backs to finish."""
        self.chunk_cache.flush()

    def _store(self, store: ChunkStore | None) -> ChunkStore:
        return self.store if store is None else store

    # ------------------------------------------------------------------ prefill
    def build_layout(
        self,
        question: str,
        chunks: Sequence[str],
        *,
        tools: Sequence[Mapping[str, Any]] = (),
        turns: Sequence[Mapping[str, Any]] = (),
    ) -> PromptLayout:
        """The prompt's segments; ``tools`` and ``turns`` as for :meth:`stream`."""
        check_unicode([("question", question)] + (list(named_chunks(chunks)) if isinstance(chunks, (list, tuple)) else []))
        layout = self.prompts.for_tools(tools).build(question, chunks, turns=turns)
        self.backbone.check_fits(len(layout), "the prompt (instruction + chunks + question)")
        return layout

    def prefill(
        self,
        layout: PromptLayout,
        mode: str = "cacheblend",
        config: BlendConfig | None = None,
        *,
        pipelined: bool | None = None,
        store: ChunkStore | None = None,
    ) -> PrefillResult:
        """Prefill ``layout`` in ``mode``. ``pipelined`` overrides the engine's setting and
        ``store`` the engine's store (read and written back) for this call only."""
        check_mode(mode)
        config = config or self.config
        store = self._store(store)
        t0 = time.perf_counter()
        if mode == "full_recompute":
            cache, logits = self.backbone.forward(torch.tensor(layout.token_ids, dtype=torch.long, device=self.device))
            stats = self._stats(mode, layout, hits=0, misses=0, recomputed=[len(layout)] * self.num_layers)
            stats["prefill_s"] = time.perf_counter() - t0
            return PrefillResult(cache, logits, layout, stats)
        if mode == "full_recompute_saved":
            return self._causal_prefill(layout, mode, planner.plan_full(layout, self.device), store, t0)
        lost_keys: set[str] = set()
        for _attempt in range(len(layout.segments) + 1):
            try:
                if mode == "prefix_caching":
                    return self._prefix_prefill(layout, store, t0, avoid=lost_keys)
                fused = self._fused_prefill(layout, mode, config, store, pipelined, t0, avoid=lost_keys)
                return self._guarded(fused, config, store, t0)
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

    def _guarded(self, fused: PrefillResult, config: BlendConfig, store: ChunkStore, t0: float) -> PrefillResult:
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
        full = self._causal_prefill(layout, "full_recompute_saved", planner.plan_full(layout, self.device), store, t0)
        full.stats.update({MARGIN: margin, ESCALATED: True, "blended_prefill_s": fused.stats["prefill_s"]})
        full.stats.update(
            recompute_steps=[*fused.stats.get("recompute_steps", []), 1.0],
            step_margins=[*fused.stats.get("step_margins", [margin]), first_token_margin(full.logits)],
        )
        if SOURCES_KEY in fused.stats:  # the question's attention per chunk, from the blended pass
            full.stats[SOURCES_KEY] = fused.stats[SOURCES_KEY]
        return full

    def _prefix_prefill(self, layout: PromptLayout, store: ChunkStore, t0: float, avoid: set[str]) -> PrefillResult:
        """Exact reuse of the longest prefix of segments cached behind exactly what precedes them
        (``planner.plan_prefix``); the rest is an exact causal prefill over the loaded K/V."""
        contains = Lookup(store, planner.prefix_keys(layout, self.fingerprint))  # one round trip, not one per chunk
        req = planner.plan_prefix(layout, self.fingerprint, contains, avoid, device=self.device)
        return self._causal_prefill(layout, "prefix_caching", req, store, t0)

    def _causal_prefill(self, layout: PromptLayout, mode: str, req: PrefixRequest, store: ChunkStore, t0: float) -> PrefillResult:
        """Load ``req.loads`` straight into prompt-length K/V buffers and prefill the other
        positions through the fusor, which writes their K/V into the same buffers and on the last
        layer runs attention and the MLP for the last position only; the cache adopts the buffers.
        Segments computed here are written back in the background for the next request with the
        same prefix (the answer does not wait for the copies either)."""
        loader = LayerAssembler(
            store,
            req.loads,
            len(layout),
            self.kv_shape,
            self.dtype,
            self.device,
            self.backbone.rotary_emb,
            self.num_layers,
        )
        try:
            out = fuse(self.backbone, req.plan, loader)
        finally:
            loader.close()
        kv = list(zip(out.keys, out.values))  # [layers](K, V) [1, kv_heads, prompt, head_dim]
        self.chunk_cache.write_back_spans(store, req.writebacks, kv)
        stats = self._stats(mode, layout, req.hits, req.misses, out.stats.recomputed_per_layer, out.stats.computed_per_layer)
        stats.update(
            load_s=sum(loader.load_s_per_layer),
            reused_prefix_tokens=req.reused,
            prefill_s=time.perf_counter() - t0,
            writeback_keys=[key for key, _, _ in req.writebacks],
        )
        return PrefillResult(cache_from(kv, adopt=True), out.logits, layout, stats)

    def _fused_prefill(
        self,
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
        self.chunk_cache.store_prefix(store, prefix)
        neighbours = self.chunk_cache.neighbours
        # Every chunk of the request looked up at once: one round trip to a network tier, not one per chunk.
        contains = Lookup(store, planner.fusion_keys(layout, self.fingerprint, prefix, neighbours))
        req = planner.plan_fusion(
            layout,
            mode,
            config,
            fingerprint=self.fingerprint,
            prefix_ids=prefix,
            contains=contains,
            num_layers=self.num_layers,
            neighbours=neighbours,
            avoid=avoid,
            device=self.device,
        )
        specs, miss_s = self.chunk_cache.fill(req.loads, store, prefix)
        loader = LayerAssembler(
            store,
            specs,
            len(layout),
            self.kv_shape,
            self.dtype,
            self.device,
            self.backbone.rotary_emb,
            self.num_layers,
            pipelined=self.pipelined if pipelined is None else pipelined,
        )
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
                qp = question_pass(self.backbone, plan, loader, layers=config.question_layers, heads=config.question_heads)
                scoring_s = qp.compute_s
                sources = chunk_attention(qp.scores, layout)  # the same scores, summed per chunk
                loaded = list(zip(qp.keys, qp.values))  # [layers](K, V) [1, kv_heads, prompt, head_dim]

                def blend(ratio: float, last: bool) -> tuple[FusionOutput, FusionPlan]:
                    guided = planner.guide(req.plan, layout, config.with_ratio(ratio), qp.scores, self.num_layers)
                    # fuse writes the recomputed rows into the K/V it reads: a pass that a later step
                    # may follow works on a copy, so that step starts from the loaded K/V, as a
                    # fixed-ratio prefill at its ratio would.
                    kv = loaded if last else [(k.clone(), v.clone()) for k, v in loaded]
                    return fuse(self.backbone, guided, kv.__getitem__, criterion), guided

                out, plan = blend(config.recompute_ratio, last=not steps)
                margins.append(first_token_margin(out.logits))
                for i, (below, ratio) in enumerate(steps):
                    if not escalates(margins[-1], below):
                        break
                    out, plan = blend(ratio, last=i == len(steps) - 1)
                    ratios.append(ratio)
                    margins.append(first_token_margin(out.logits))
            else:
                out = fuse(self.backbone, plan, loader, criterion)
                margins.append(first_token_margin(out.logits))
        finally:
            loader.close()
        if req.hkvd and steps and escalates(margins[-1], steps[0][0]):
            # HKVD's selection depends on the ratio from layer 1 on: its step is a fresh prefill.
            again = self._fused_prefill(layout, mode, config.with_ratio(steps[0][1]), store, pipelined, t0, avoid)
            again.stats["recompute_steps"] = [config.recompute_ratio, *again.stats["recompute_steps"]]
            again.stats["step_margins"] = [*margins, *again.stats["step_margins"]]
            return again
        cache = cache_from(list(zip(out.keys, out.values)), adopt=True)
        stats = self._stats(mode, layout, req.hits, req.misses, out.stats.recomputed_per_layer, out.stats.computed_per_layer)
        stats["neighbour_hits"] = req.neighbour_hits
        if self.learner is not None:
            self.learner.observe(store, [seg for seg in layout.segments if seg.reusable], prefix)
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

    def _stats(
        self, mode: str, layout: PromptLayout, hits: int, misses: int, recomputed: list[int], computed: list[int] | None = None
    ) -> dict[str, Any]:
        total = len(layout) * self.num_layers
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

    # ------------------------------------------------------------------ answering
    def next_token_logits(
        self,
        question: str,
        chunks: Sequence[str],
        mode: str = "cacheblend",
        *,
        recompute_ratio: float | None = None,
        config: BlendConfig | None = None,
    ) -> torch.Tensor:
        layout = self.build_layout(question, chunks)
        return self.prefill(layout, mode, (_check_config(config) or self.config).with_ratio(recompute_ratio)).logits

    def stream(
        self,
        question: str,
        chunks: Sequence[str],
        *,
        mode: str = "cacheblend",
        recompute_ratio: float | None = None,
        config: BlendConfig | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: Sequence[str] | str | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
        constraint: Grammar | None = None,
        tools: Sequence[Mapping[str, Any]] = (),
        turns: Sequence[Mapping[str, Any]] = (),
        store: ChunkStore | None = None,
        pipelined: bool | None = None,
        controller: LoadingController | None = None,
    ) -> GenerationStream:
        """Iterate over the answer's text deltas; ``.result`` holds the full result afterwards.

        ``store``, ``pipelined`` and ``controller`` replace the engine's own for this answer only
        (a benchmark comparing tiers or loading modes on one engine). ``ignore_eos`` decodes past
        the end-of-sequence token to ``max_new_tokens`` (a benchmark timing fixed lengths).

        ``constraint`` (``constraints.Grammar``) keeps the answer inside a grammar (a JSON schema:
        the answer parses). ``tools`` (function definitions, OpenAI's format) are rendered by the
        model's chat template into the prompt's prefix, so the chunks are cached behind that prefix
        (``precompute(..., tools=...)``); ``turns`` are chat messages after the question's turn
        (the assistant's tool calls, ``role: tool`` results), rendered by the template after it.
        See docs/engine.md, "Constrained decoding and tools"."""
        from .serving.request import answer_settings  # the one place settings become a SamplingParams

        t0 = time.perf_counter()
        settings = answer_settings(
            mode=mode,
            recompute_ratio=recompute_ratio,
            config=config,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop=stop,
            seed=seed,
            ignore_eos=ignore_eos,
            constraint=constraint,
        )
        return self.open_stream(
            question,
            chunks,
            settings.pop("sampling"),
            **settings,
            tools=tools,
            turns=turns,
            store=store,
            pipelined=pipelined,
            controller=controller,
            t0=t0,
        )

    def open_stream(
        self,
        question: str,
        chunks: Sequence[str],
        sampling: SamplingParams,
        *,
        mode: str = "cacheblend",
        recompute_ratio: float | None = None,
        config: BlendConfig | None = None,
        tools: Sequence[Mapping[str, Any]] = (),
        turns: Sequence[Mapping[str, Any]] = (),
        store: ChunkStore | None = None,
        pipelined: bool | None = None,
        controller: LoadingController | None = None,
        t0: float | None = None,
    ) -> GenerationStream:
        """:meth:`stream` with the decoding settings as one :class:`SamplingParams` (what
        ``cacheblend_rag.serving`` passes). ``t0`` (``perf_counter``) is when the request arrived,
        where time to first token counts from (default: now)."""
        t0 = time.perf_counter() if t0 is None else t0
        check_mode(mode)
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        layout = self.build_layout(question, chunks, tools=tools, turns=turns)
        self.backbone.check_fits(len(layout), "the prompt (instruction + chunks + question)", reserve=sampling.max_new_tokens)
        config = (_check_config(config) or self.config).with_ratio(recompute_ratio)
        controller = self.controller if controller is None else controller
        decision = None
        if recompute_ratio is None and mode == "cacheblend" and controller is not None and config.schedule is None:
            decision = controller.decide_for(self, layout, store=store)
            config = config.with_ratio(decision.ratio)
        return GenerationStream(
            self,
            layout,
            mode,
            config,
            sampling,
            t0,
            store=store,
            pipelined=pipelined,
            controller_stats=decision.as_stats() if decision is not None else None,
        )

    def generate(
        self, question: str, chunks: Sequence[str], *, on_token: Callable[[str], None] | None = None, **kwargs: Any
    ) -> GenerationResult:
        """Answer ``question`` over ``chunks``. Keyword arguments as for :meth:`stream`."""
        stream = self.stream(question, chunks, **kwargs)
        for delta in stream:
            if on_token is not None:
                on_token(delta)
        assert stream.result is not None
        return stream.result

    def close(self, *, close_store: bool = True, timeout: float = 60.0) -> None:
        """Finish the background write-backs and close the store (``close_store=False``: an
        engine sharing another's store leaves it open).

        Model work in flight on another thread (an answer, a retriever's background precompute:
        whoever holds ``engine.lock``) finishes first, so it never meets a closed store; after
        ``timeout`` seconds of waiting ``close`` raises ``RuntimeError`` and leaves the store open
        (call it again once that work ends). Holding the lock while closing keeps new work out.
        """
        if self.learner is not None:
            self.learner.close()  # its queued refreshes take the lock themselves
        if not self.lock.acquire(timeout=timeout):
            raise RuntimeError(
                f"engine.close() waited {timeout:g} s for model work still running on this engine "
                "(an answer being generated or a background precompute holds engine.lock); finish "
                "or cancel it, then call close() again (or pass a longer timeout)"
            )
        try:
            self.chunk_cache.close()
            if close_store:
                self.store.close()
        finally:
            self.lock.release()


class GenerationStream:
    """Iterator of text deltas. Time to first token counts from ``t0``, the ``stream``/``generate`` call.

    Iterating prefills (unless :meth:`prefill` already did) and decodes on the calling thread.
    ``cacheblend_rag.serving``'s batcher instead calls :meth:`prefill` itself, decodes the answer
    together with others and ends it with :meth:`finish`; either way ``result`` is set at the end.
    """

    def __init__(
        self,
        engine: CacheBlendEngine,
        layout: PromptLayout,
        mode: str,
        config: BlendConfig,
        params: SamplingParams,
        t0: float,
        *,
        store: ChunkStore | None = None,
        pipelined: bool | None = None,
        controller_stats: dict[str, Any] | None = None,
    ):
        self.engine, self.layout, self.mode, self.config, self.params, self.t0 = engine, layout, mode, config, params, t0
        self.store, self.pipelined = store, pipelined  # None: the engine's
        self.result: GenerationResult | None = None
        self.controller_stats: dict[str, Any] = dict(controller_stats or {})  # the loading controller's choice, if asked
        self.prefill_result: PrefillResult | None = None  # the fused cache and next-token logits
        self._iter: Iterator[str] | None = None

    def __iter__(self) -> Iterator[str]:
        if self._iter is None:
            self._iter = self._run()
        return self._iter

    def __next__(self) -> str:
        return next(iter(self))

    def prefill(self, *, count_cache_reads: bool = False) -> PrefillResult:
        """Run this answer's prefill (once; later calls return the same result).

        ``count_cache_reads``: first wait for the engine's pending write-backs, then count the
        prompt tokens whose KV the prefill reads from the store instead of computing; the count
        goes into the stats as ``cache_read_tokens`` (what the server reports as cached tokens).
        The caller holds the engine's lock, so the count sees exactly the store the prefill sees.
        """
        if self.prefill_result is None:
            cached = self._cached_chunk_tokens() if count_cache_reads else None
            pre = self.engine.prefill(self.layout, self.mode, self.config, pipelined=self.pipelined, store=self.store)
            if cached is not None:
                # Under prefix caching only the reused prefix comes from the store.
                if self.mode == "prefix_caching":
                    cached = int(pre.stats.get("reused_prefix_tokens", 0))
                elif pre.stats.get(ESCALATED):
                    cached = 0  # the guard answered from a full prefill, which reads nothing
                pre.stats["cache_read_tokens"] = cached
            self.prefill_result = pre
        return self.prefill_result

    def _cached_chunk_tokens(self) -> int:
        if self.mode in ("full_recompute", "full_recompute_saved"):
            return 0  # reads nothing from the store
        eng = self.engine
        eng.flush()
        store = eng.store if self.store is None else self.store
        segments = [seg for seg in self.layout.segments if seg.reusable]
        prefix = self.layout.prefix_ids  # the chunks' keys hold the prefix they sit behind (tools change it)
        found = contains_many(store, [eng.chunk_key(seg, prefix) for seg in segments])  # one round trip for all chunks
        return sum(len(seg) for seg, hit in zip(segments, found) if hit)

    def finish(self, state: DecodeState, first_token_s: float | None, **stats: Any) -> GenerationResult:
        """Set and return ``result`` for an answer decoded to ``state`` (its text, tokens and
        finish reason). ``first_token_s`` is the ``perf_counter`` time its first token was chosen
        (None: none was, e.g. cancelled before its prefill); ``stats`` are added to the prefill's."""
        now = time.perf_counter()
        first = (now if first_token_s is None else first_token_s) - self.t0
        pre = self.prefill_result
        base = pre.stats if pre is not None else {"mode": self.mode}
        merged = dict(base, **self.controller_stats, ttft_s=first, total_s=now - self.t0, generated_tokens=len(state.token_ids))
        merged.update(stats)
        self.result = GenerationResult(
            state.text,
            state.token_ids,
            first,
            now - self.t0,
            state.finish_reason,
            merged,
            [t - self.t0 for t in state.token_times],
        )
        return self.result

    def _run(self) -> Iterator[str]:
        eng = self.engine
        pre = self.prefill()
        first: list[float] = []
        state: DecodeState = yield from decode(
            eng.model,
            eng.tokenizer,
            pre.cache,
            pre.logits,
            len(self.layout),
            self.params,
            lambda: first.append(time.perf_counter()),
            model_kwargs=pre.attention_kwargs,
            step=eng.fast_step,
        )
        self.finish(state, first[0] if first else None)


def _calibrated_config(fingerprint: str) -> BlendConfig | None:
    from .calibration import QualityProfile, quality_profile_path

    path = quality_profile_path(fingerprint)
    if not path.is_file():
        return None
    try:
        profile = QualityProfile.load(path)
    except (OSError, ValueError, TypeError) as exc:
        log.warning("ignoring the unreadable quality profile %s (%s); rerun `cacheblend-rag calibrate`", path, exc)
        return None
    log.info("using the calibrated %s strategy at recompute_ratio=%.3g from %s", profile.strategy, profile.recompute_ratio, path)
    return profile.config()


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


def _check_config(config: object) -> BlendConfig | None:
    if config is not None and not isinstance(config, BlendConfig):
        raise TypeError(
            f"config must be a BlendConfig, got {type(config).__name__}: build one with cacheblend_rag.BlendConfig(**options)"
        )
    return config


def _callable_name(fn: Callable) -> str:
    """A custom criterion by its import path (an object repr would hold a per-process address)."""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
