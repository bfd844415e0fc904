"""CacheBlendEngine: per-chunk KV caching and the four prefill modes behind one ``generate``."""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from .attention import APE_KWARG, ContextAttention
from .config import BlendConfig, SamplingParams, check_mode
from .backbone import Backbone
from .fusor import FusionPlan, fuse, question_pass
from .generation import DecodeState, decode
from .store.disk import KVStore
from .store.keys import chunk_key
from .store.loader import ChunkLost, LayerAssembler, LoadSpec
from .prompt import DEFAULT_INSTRUCTION, PromptBuilder, PromptLayout, Segment
from .rope import shift_keys
from .selector import pick_chunks, pick_tokens, resolve_criterion

if TYPE_CHECKING:
    from .store.spec import StoreSpec

log = logging.getLogger("cacheblend_rag.engine")


@dataclass
class PrefillResult:
    cache: DynamicCache
    logits: torch.Tensor  # [vocab] float32
    layout: PromptLayout
    stats: dict[str, Any]
    selected: list[torch.Tensor] | None = None  # per layer recomputed positions (fused modes)
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


def _layer_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    lay = cache.layers[layer]
    return lay.keys, lay.values


class CacheBlendEngine:
    """Answer questions over retrieved chunks, reusing each chunk's cached KV.

    ``model`` is a transformers causal LM with rotary position embeddings (Llama, Mistral, Qwen2,
    Qwen3, ...), ``store`` the chunk KV store (a fresh temporary one when omitted).
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        store: KVStore | None = None,
        config: BlendConfig | None = None,
        instruction: str = DEFAULT_INSTRUCTION,
        model_id: str = "custom",
        fingerprint: str | None = None,
        pipelined: bool | None = None,
        controller=None,
    ):
        from .models import model_fingerprint

        # Refused here, before anything is cached, if the fused path cannot be exact for it.
        self.backbone = Backbone.adapt(model.eval())
        self.backbone.self_test()
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.config = _check_config(config) or BlendConfig()
        # Read layer i+1.. from the store while layer i computes (paper section 5). None: decide per
        # request from how layer 0's read went (loader.LayerAssembler._worth_overlap).
        self.pipelined = pipelined
        # Optional cacheblend_rag.controller.LoadingController: picks the recompute ratio of a
        # request that does not name one (stream/generate with recompute_ratio=None).
        self.controller = controller
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.fingerprint = fingerprint or model_fingerprint(model, tokenizer, self.dtype)
        self.store = store if store is not None else KVStore(None, fingerprint=self.fingerprint)
        self.prompts = PromptBuilder(tokenizer, instruction)
        cfg = model.config
        self.num_layers = cfg.num_hidden_layers
        self.kv_shape = (
            cfg.num_key_value_heads or cfg.num_attention_heads,
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        )
        self.context_window = int(getattr(cfg, "max_position_embeddings", 0) or 0) or 2048
        if self.backbone.window is not None:
            # The fused mask is full causal: exact only while the whole prompt and answer fit in
            # the sliding window (the model's cache keeps window - 1 past tokens).
            self.context_window = min(self.context_window, self.backbone.window - 1)
        self._prefix_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # Plain chunk key -> key of the chunk's cross-chunk-aware cache (precompute(neighbours=n)).
        # Kept per engine: precompute recomputes the neighbour sets (embeddings only) and finds
        # stored caches again, so a changed corpus points a chunk at a new cache, never an old one.
        self._neighbour_keys: dict[str, str] = {}
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="cacheblend-writeback")

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        cache_dir: str | None = None,
        store_dir: str | None = None,
        store_size_limit: int = 8 * 2**30,
        memory_bytes: int = 2 * 2**30,
        store: "StoreSpec | Sequence[StoreSpec] | None" = None,
        **kwargs: Any,
    ) -> "CacheBlendEngine":
        """Load ``model`` (default: the bundled SmolLM2-135M-Instruct) and open its KV store.

        The store lives in ``store_dir`` (default ``<cache home>/kv``) so chunk caches outlive
        the process; entries are keyed by the model fingerprint, so models never mix. A directory
        that holds a store but cannot be written (read-only mount, full disk) is served read-only
        until it can be written again. If it cannot be opened at all (not a directory, broken
        database, read-only and empty) a warning is logged and a temporary store, deleted on
        ``close()``, is used instead.

        ``store`` picks the tiers below the memory tier, fastest first (``store_spec``):

        * None or ``"disk"``: the disk store above;
        * ``"redis://[[user]:password@]host:6379/0"`` (``rediss://`` for TLS): one Redis, shared by
          every worker that points at it, instead of the disk;
        * a list such as ``["disk", "redis://host:6379/0"]``: memory -> disk -> Redis, each read
          served by the first tier that holds the chunk and copied up into memory; write-backs go
          to every tier. ``redis_tier.RedisConfig(url, prefix=..., socket_timeout_s=...)`` may
          stand for a URL, and a store object for any entry.

        A Redis that is down or slow never fails an answer: its tier is skipped for a while and
        the chunk comes from the next tier or is recomputed. A Redis that refuses the URL's
        password raises ``redis_tier.RedisAuthError`` here. See docs/sharing.md.

        Without a ``config``, a quality profile saved by ``cacheblend-rag calibrate`` for this
        model sets the strategy and recompute ratio; otherwise ``BlendConfig()``'s defaults hold.

        ``memory_bytes`` (default 2 GiB; 0 turns it off) keeps recently used chunk caches in RAM
        in front of the other tiers (``tiers.TieredStore``): the chunks RAG retrieves come back
        often, and a layer read from RAM skips the database lookup, file read and checksum, which
        were 9% of a CacheBlend prefill on the bundled model (docs/engine.md).
        """
        from .models import default_cache_dir, load_model
        from .store.spec import open_store

        loaded = load_model(model, device=device, dtype=dtype, cache_dir=cache_dir)
        home = default_cache_dir() if cache_dir is None else cache_dir
        opened = open_store(
            store, directory=store_dir or f"{home}/kv", size_limit=store_size_limit,
            fingerprint=loaded.fingerprint, memory_bytes=memory_bytes,
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

    # ------------------------------------------------------------------ chunk caches
    def chunk_key(self, segment: Segment, context_ids: Sequence[int] | None = None) -> str:
        ctx = self.prompts.prefix_ids if context_ids is None else context_ids
        return chunk_key(self.fingerprint, ctx, segment.token_ids)

    def is_cached(self, text: str) -> bool:
        if not isinstance(text, str):
            raise TypeError(f"is_cached takes a chunk's text (str), got {type(text).__name__}")
        return self.store.contains(self.chunk_key(self.prompts.chunk_segment(text)))

    def _prefix_cache(self) -> DynamicCache:
        with self._lock:
            if self._prefix_kv is None:
                ids = torch.tensor([self.prompts.prefix_ids], device=self.device)
                with torch.inference_mode():
                    out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
                cache = _output_cache(out)
                self._prefix_kv = [_layer_kv(cache, i) for i in range(self.num_layers)]
            return _cache_from(self._prefix_kv)

    def compute_chunk(self, segment: Segment, behind: Sequence[Segment] = ()) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Prefill one chunk behind the instruction prefix (and the ``behind`` segments, for a
        cross-chunk-aware cache); return its own K/V per layer, ``[kv_heads, len(segment),
        head_dim]``, with keys rotated as if the chunk sat right after the prefix."""
        plen = len(self.prompts.prefix_ids)
        ids = [t for seg in behind for t in seg.token_ids] + list(segment.token_ids)
        start = plen + len(ids) - len(segment)  # where the chunk itself begins
        cache = self._prefix_cache()
        with torch.inference_mode():
            self.model(
                input_ids=torch.tensor([ids], device=self.device),
                position_ids=torch.arange(plen, plen + len(ids), device=self.device)[None],
                use_cache=True,
                logits_to_keep=1,
                **{self.backbone.model_cache_kwarg: cache},
            )
        rotary = self.backbone.rotary_emb
        return [
            # Loaders shift keys from the position right after the prefix: un-rotate them there.
            (shift_keys(rotary, k[0, :, start:], plen - start).contiguous(), v[0, :, start:].contiguous())
            for k, v in (_layer_kv(cache, i) for i in range(self.num_layers))
        ]

    def precompute(
        self,
        texts: Iterable[str],
        *,
        neighbours: int = 0,
        embed: Callable[[list[str]], torch.Tensor] | None = None,
        progress: bool = True,
    ) -> int:
        """Compute and store the KV of every chunk not cached yet. Returns how many were computed.

        neighbours: also cache each chunk prefilled behind its ``neighbours`` most similar chunks
            among ``texts`` (FusionRAG's offline step; ``embed`` or the bundled MiniLM ranks them),
            keeping only the chunk's own K/V. Generation then uses that cache wherever the chunk
            is not first in the prompt (``BlendConfig.neighbour_caches``). It costs about
            ``neighbours + 1`` times the chunk's prefill on top of the plain cache, and holds for
            this corpus: precompute again after the corpus changes.
        """
        if not isinstance(neighbours, int) or isinstance(neighbours, bool) or neighbours < 0:
            raise ValueError(f"neighbours={neighbours!r} must be an int >= 0 (0: plain chunk caches only)")
        texts = list(dict.fromkeys(_check_texts(texts)))
        segments = [self.prompts.chunk_segment(t) for t in texts]
        plen = len(self.prompts.prefix_ids)
        computed = 0
        self._store_prefix()
        for seg in tqdm(segments, desc="precompute KV", unit="chunk", disable=not progress):
            self._check_fits(plen + len(seg), f"chunk {seg.text[:40]!r}...")
            key = self.chunk_key(seg)
            if self.store.contains(key):
                continue
            self.store.put(key, self.compute_chunk(seg))
            computed += 1
        if neighbours == 0:
            return computed
        from .neighbours import nearest

        near = nearest(texts, neighbours, embed)
        for seg, idx in tqdm(list(zip(segments, near)), desc="precompute neighbour-aware KV", unit="chunk", disable=not progress):
            if not idx:
                continue
            behind = [segments[j] for j in idx]
            context = list(self.prompts.prefix_ids) + [t for b in behind for t in b.token_ids]
            self._check_fits(len(context) + len(seg), f"chunk {seg.text[:40]!r}... behind its {len(idx)} neighbours (use fewer neighbours)")
            nb_key = self.chunk_key(seg, context_ids=context)
            if not self.store.contains(nb_key):
                self.store.put(nb_key, self.compute_chunk(seg, behind))
                computed += 1
            self._neighbour_keys[self.chunk_key(seg)] = nb_key
        return computed

    def _store_prefix(self) -> None:
        """Store the instruction prefix as a segment with an empty context, so prefix caching finds it."""
        seg = Segment(self.prompts.prefix_text, self.prompts.prefix_ids, reusable=False)
        key = self.chunk_key(seg, context_ids=())
        if not self.store.contains(key):
            self._prefix_cache()
            assert self._prefix_kv is not None
            self.store.put(key, [(k[0], v[0]) for k, v in self._prefix_kv])

    def flush(self) -> None:
        """Wait for background write-backs to finish."""
        self._writer.submit(lambda: None).result()

    # ------------------------------------------------------------------ prefill
    def build_layout(self, question: str, chunks: Sequence[str]) -> PromptLayout:
        _check_unicode([("question", question)] + (list(_named(chunks)) if isinstance(chunks, (list, tuple)) else []))
        layout = self.prompts.build(question, chunks)
        self._check_fits(len(layout), "the prompt (instruction + chunks + question)")
        return layout

    def _check_fits(self, n: int, what: str, reserve: int = 0) -> None:
        if n + reserve > self.context_window:
            window = "" if self.backbone.window is None else (
                f" (its sliding attention window of {self.backbone.window} less one: inside it the fused prefill is exact)")
            raise ValueError(
                f"{what} is {n} tokens{f' plus {reserve} to generate' if reserve else ''}, more than "
                f"the model's context window of {self.context_window} tokens{window}: retrieve fewer or "
                "shorter chunks (split long documents) or lower max_new_tokens"
            )

    def prefill(
        self,
        layout: PromptLayout,
        mode: str = "cacheblend",
        config: BlendConfig | None = None,
        *,
        pipelined: bool | None = None,
    ) -> PrefillResult:
        check_mode(mode)
        config = config or self.config
        t0 = time.perf_counter()
        ids = torch.tensor(layout.token_ids, dtype=torch.long, device=self.device)
        if mode == "full_recompute":
            with torch.inference_mode():
                out = self.model(input_ids=ids[None], use_cache=True, logits_to_keep=1)
            stats = self._stats(mode, layout, hits=0, misses=0, recomputed=[len(layout)] * self.num_layers)
            stats["prefill_s"] = time.perf_counter() - t0
            return PrefillResult(_output_cache(out), out.logits[0, -1].float(), layout, stats)
        lost_keys: set[str] = set()
        for attempt in range(len(layout.segments) + 1):
            try:
                if mode == "prefix_caching":
                    return self._prefix_prefill(layout, ids, t0, avoid=lost_keys)
                return self._fused_prefill(layout, ids, mode, config, pipelined, t0, avoid=lost_keys)
            except ChunkLost as lost:
                # A record went bad, was evicted or its storage failed after the lookup: drop it and
                # recompute it on the retry. The retry never loads a lost key again (even if a broken
                # store still claims to hold it), so this loop ends: each attempt loses a new key.
                log.warning("chunk record %s lost during load; recomputing it", lost.key[:16])
                if lost.key in lost_keys:
                    break
                lost_keys.add(lost.key)
                try:
                    self.store.discard(lost.key)
                except Exception as exc:  # noqa: BLE001 - a failing store must not fail the answer
                    log.warning("could not discard chunk %s: %r", lost.key[:16], exc)
        raise RuntimeError("chunk caches kept disappearing during load; is another process clearing the store?")

    def _prefix_prefill(self, layout, ids, t0, avoid=frozenset()) -> PrefillResult:
        """Exact reuse of the longest prefix of segments cached behind exactly what precedes them.

        Each segment is keyed by everything before it, so only a true prefix ever matches; the
        rest is a normal transformers prefill on top of the loaded cache. Segments computed here
        are written back (in the background) for the next request with the same prefix.
        """
        offsets, token_ids, length = layout.offsets(), layout.token_ids, len(layout)
        specs: list[LoadSpec] = []
        writebacks: list[tuple[str, int, int]] = []
        exact_end = hits = misses = 0
        for seg, off in zip(layout.segments[:-1], offsets):  # the question is never cached
            key = chunk_key(self.fingerprint, token_ids[:off], seg.token_ids)
            if exact_end == off and key not in avoid and self.store.contains(key):
                specs.append(LoadSpec(off, len(seg), key, 0))
                exact_end = off + len(seg)
                hits += seg.reusable
            else:
                writebacks.append((key, off, len(seg)))
                misses += seg.reusable
        t_load = time.perf_counter()
        cache = DynamicCache()
        if specs:
            loader = LayerAssembler(
                self.store, specs, exact_end, self.kv_shape, self.dtype, self.device,
                self.backbone.rotary_emb, self.num_layers,
            )
            cache = _cache_from([loader(i) for i in range(self.num_layers)])
        load_s = time.perf_counter() - t_load
        with torch.inference_mode():
            out = self.model(
                input_ids=ids[None, exact_end:],
                position_ids=torch.arange(exact_end, length, device=self.device)[None],
                use_cache=True,
                logits_to_keep=1,
                **{self.backbone.model_cache_kwarg: cache},
            )
        cache = _output_cache(out)
        for key, off, n in writebacks:
            kv = [(k[0, :, off : off + n].contiguous(), v[0, :, off : off + n].contiguous())
                  for k, v in (_layer_kv(cache, i) for i in range(self.num_layers))]
            self._writer.submit(self.store.put, key, kv)
        stats = self._stats("prefix_caching", layout, hits, misses, [length - exact_end] * self.num_layers)
        stats.update(load_s=load_s, reused_prefix_tokens=exact_end, prefill_s=time.perf_counter() - t0,
                     writeback_keys=[key for key, _, _ in writebacks])
        return PrefillResult(cache, out.logits[0, -1].float(), layout, stats)

    def _fused_prefill(self, layout, ids, mode, config, pipelined, t0, avoid=frozenset()) -> PrefillResult:
        length = len(layout)
        offsets = layout.offsets()
        prefix = self.prompts.prefix_ids
        always = torch.zeros(length, dtype=torch.bool, device=self.device)
        candidate = torch.zeros_like(always)
        forced = torch.zeros_like(always)
        specs: list[LoadSpec] = []
        hits = misses = neighbour_hits = 0
        miss_s = 0.0
        token_ids = layout.token_ids
        self._store_prefix()

        for seg, off in zip(layout.segments, offsets):
            span = slice(off, off + len(seg))
            if not seg.reusable:
                # The instruction prefix is exact wherever it is cached: load it, never recompute.
                prefix_key = self.chunk_key(seg, context_ids=()) if off == 0 and seg.token_ids == prefix else None
                if prefix_key and prefix_key not in avoid and self.store.contains(prefix_key):
                    specs.append(LoadSpec(0, len(seg), prefix_key, 0))
                elif prefix_key:
                    # Not in the store (full/read-only disk, evicted, corrupt): use this process's
                    # copy, the very tensors the store would hold, so the answer does not change.
                    self._prefix_cache()
                    assert self._prefix_kv is not None
                    specs.append(LoadSpec(0, len(seg), prefix_key, 0, [(k[0], v[0]) for k, v in self._prefix_kv]))
                else:
                    always[span] = True
                continue
            exact = off == len(prefix) and tuple(token_ids[:off]) == tuple(prefix)
            key = self.chunk_key(seg)
            nb_key = self._neighbour_keys.get(key) if config.neighbour_caches and not exact else None
            if nb_key is not None and nb_key not in avoid and self.store.contains(nb_key):
                key = nb_key
                neighbour_hits += 1
            kv = None
            if key not in avoid and self.store.contains(key):
                hits += 1
            else:
                misses += 1
                tm = time.perf_counter()
                kv = self.compute_chunk(seg)
                miss_s += time.perf_counter() - tm
                self._writer.submit(self.store.put, key, kv)
            specs.append(LoadSpec(off, len(seg), key, off - len(prefix), kv))
            if not exact:
                candidate[span] = True
                if config.boundary_tokens:
                    forced[off : off + min(config.boundary_tokens, len(seg))] = True

        checks: dict[int, int] = {}
        hkvd = mode == "cacheblend" and config.strategy == "hkvd"
        if hkvd:
            n_ctx = layout.num_context_tokens
            n_forced = int(forced.sum())
            for layer, frac in config.check_points():
                if layer < self.num_layers:
                    checks[layer] = max(0, math.ceil(frac * n_ctx) - n_forced)
        plan = FusionPlan(
            input_ids=ids,
            always=always,
            candidate=candidate,
            forced=forced,
            recompute_first_layer=hkvd,
            checks=checks,
            num_query=len(layout.segments[-1]),
            attention_groups=config.attention_groups,
            context_attention=_context_attention(layout, config),
        )
        loader = LayerAssembler(
            self.store,
            specs,
            length,
            self.kv_shape,
            self.dtype,
            self.device,
            self.backbone.rotary_emb,
            self.num_layers,
            pipelined=self.pipelined if pipelined is None else pipelined,
        )
        scoring_s = 0.0
        try:
            if mode == "cacheblend" and not hkvd:
                plan, load, scoring_s = self._guided_plan(plan, layout, config, loader)
            else:
                load = loader
            out = fuse(self.backbone, plan, load, resolve_criterion(config.criterion))
        finally:
            loader.close()
        cache = _cache_from(list(zip(out.keys, out.values)), adopt=True)
        stats = self._stats(mode, layout, hits, misses, out.stats.recomputed_per_layer, out.stats.computed_per_layer)
        stats["neighbour_hits"] = neighbour_hits
        total_load = sum(loader.load_s_per_layer)
        # Time the fusor waited for each layer's K/V (a question-guided prefill reads them in its
        # scoring pass; the recompute pass then finds them in memory).
        exposed = out.stats.load_s_per_layer
        overlapped = loader.pipelined
        stats.update(
            miss_compute_s=miss_s,
            load_s=total_load,
            load_exposed_s=out.stats.load_s,
            load_hidden_s=max(0.0, total_load - out.stats.load_s) if overlapped else 0.0,
            compute_s=out.stats.compute_s + scoring_s,
            scoring_s=scoring_s,
            load_s_per_layer=list(loader.load_s_per_layer),
            load_exposed_s_per_layer=list(exposed),
            # Load time that ran behind the previous layer's compute (0 when not pipelined).
            load_hidden_s_per_layer=[max(0.0, l - e) if overlapped else 0.0 for l, e in zip(loader.load_s_per_layer, exposed)],
            compute_s_per_layer=out.stats.compute_s_per_layer,
            pipelined=bool(loader.pipelined),  # as run: automatic mode decides on layer 0
            prefill_s=time.perf_counter() - t0,
        )
        if mode == "cacheblend":
            stats.update(criterion=getattr(config.criterion, "__name__", config.criterion), recompute_ratio=config.recompute_ratio,
                         strategy=config.strategy)
        context = plan.context_attention
        return PrefillResult(cache, out.logits, layout, stats, out.selected,
                             attention_kwargs={} if context is None else {APE_KWARG: context.with_rows(None)})

    def _guided_plan(self, plan: FusionPlan, layout: PromptLayout, config: BlendConfig, loader: LayerAssembler):
        """Question-guided selection: score the context by the question's attention over the reused
        cache, then force the chosen tokens (or whole chunks) on every layer.

        Returns the recompute plan, a loader over the K/V the scoring pass already read, and the
        scoring pass's compute time.
        """
        qp = question_pass(self.backbone, plan, loader, layers=config.question_layers, heads=config.question_heads)
        n_forced = int(plan.forced.sum())
        budget = max(0, math.ceil(config.recompute_ratio * layout.num_context_tokens) - n_forced)
        selectable = plan.candidate & ~plan.forced
        forced = plan.forced.clone()
        if config.strategy == "question":
            forced[pick_tokens(qp.scores, selectable, budget, config.selection_window)] = True
        elif budget > 0:
            spans = [(off, off + len(seg)) for seg, off in zip(layout.segments, layout.offsets()) if bool(plan.candidate[off])]
            for i in pick_chunks(qp.scores, spans, budget):
                forced[spans[i][0] : spans[i][1]] = True
        guided = FusionPlan(
            input_ids=plan.input_ids, always=plan.always, candidate=plan.candidate, forced=forced,
            recompute_first_layer=False, num_query=plan.num_query, attention_groups=plan.attention_groups,
            context_attention=plan.context_attention,
        )
        kv = list(zip(qp.keys, qp.values))
        return guided, kv.__getitem__, qp.compute_s

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
        self, question: str, chunks: Sequence[str], mode: str = "cacheblend", *, recompute_ratio: float | None = None, config: BlendConfig | None = None
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
    ) -> "GenerationStream":
        """Iterate over the answer's text deltas; ``.result`` holds the full result afterwards."""
        t0 = time.perf_counter()
        check_mode(mode)
        params = SamplingParams(max_new_tokens, temperature, top_p, top_k, stop or (), seed)
        layout = self.build_layout(question, chunks)
        self._check_fits(len(layout), "the prompt (instruction + chunks + question)", reserve=max_new_tokens)
        config = (_check_config(config) or self.config).with_ratio(recompute_ratio)
        decision = None
        if recompute_ratio is None and mode == "cacheblend" and self.controller is not None and config.schedule is None:
            decision = self.controller.decide_for(self, layout)
            config = config.with_ratio(decision.ratio)
        stream = GenerationStream(self, layout, mode, config, params, t0)
        if decision is not None:
            stream.controller_stats = decision.as_stats()
        return stream

    def generate(self, question: str, chunks: Sequence[str], *, on_token: Callable[[str], None] | None = None, **kwargs: Any) -> GenerationResult:
        """Answer ``question`` over ``chunks``. Keyword arguments as for :meth:`stream`."""
        stream = self.stream(question, chunks, **kwargs)
        for delta in stream:
            if on_token is not None:
                on_token(delta)
        assert stream.result is not None
        return stream.result

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self.store.close()


class GenerationStream:
    """Iterator of text deltas. Time to first token counts from the ``stream``/``generate`` call."""

    def __init__(self, engine: CacheBlendEngine, layout, mode, config, params, t0: float):
        self.engine, self.layout, self.mode, self.config, self.params, self.t0 = engine, layout, mode, config, params, t0
        self.result: GenerationResult | None = None
        self.controller_stats: dict[str, Any] = {}  # the loading controller's choice, if one was asked
        self.prefill_result: PrefillResult | None = None  # the fused cache and next-token logits
        self._iter: Iterator[str] | None = None

    def __iter__(self) -> Iterator[str]:
        if self._iter is None:
            self._iter = self._run()
        return self._iter

    def __next__(self) -> str:
        return next(iter(self))

    def _run(self) -> Iterator[str]:
        eng = self.engine
        pre = self.prefill_result = eng.prefill(self.layout, self.mode, self.config)
        ttft = [0.0]

        def first() -> None:
            ttft[0] = time.perf_counter() - self.t0

        state: DecodeState = yield from decode(eng.model, eng.tokenizer, pre.cache, pre.logits, len(self.layout), self.params, first,
                                               model_kwargs=pre.attention_kwargs)
        total = time.perf_counter() - self.t0
        stats = dict(pre.stats, **self.controller_stats, ttft_s=ttft[0], total_s=total, generated_tokens=len(state.token_ids))
        self.result = GenerationResult(state.text, state.token_ids, ttft[0], total, state.finish_reason, stats)


def _context_attention(layout: PromptLayout, config: BlendConfig) -> ContextAttention | None:
    """APE's reweighting of the chunks (from the first chunk to the question), if configured."""
    if not config.reweights_context or len(layout.segments) < 3:
        return None
    offsets = layout.offsets()
    return ContextAttention(offsets[1], offsets[-1], config.context_temperature, config.context_scale)


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


def _output_cache(out) -> DynamicCache:
    # transformers 5.24 renamed the output's `past_key_values` to `cache` (the old name warns).
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _cache_from(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], *, adopt: bool = False) -> DynamicCache:
    """A DynamicCache holding ``kv``: copied (``update`` concatenates into new storage), or with
    ``adopt=True`` the tensors themselves, for buffers that belong to this request alone (the
    fusor's output: copying the whole prompt's K/V cost 2% of a CacheBlend prefill)."""
    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        k, v = (k if k.dim() == 4 else k[None]), (v if v.dim() == 4 else v[None])
        if not adopt:
            cache.update(k, v, i)
            continue
        cache.update(k[..., :0, :], v[..., :0, :], i)  # creates and initialises layer i, empty
        cache.layers[i].keys, cache.layers[i].values = k, v
    return cache


def _check_config(config: object) -> BlendConfig | None:
    if config is not None and not isinstance(config, BlendConfig):
        raise TypeError(
            f"config must be a BlendConfig, got {type(config).__name__}: "
            "build one with cacheblend_rag.BlendConfig(**options)"
        )
    return config


def _check_texts(texts: Iterable[str]) -> list[str]:
    if isinstance(texts, (str, bytes)):
        raise TypeError(f"precompute takes a list of chunk texts, got a single {type(texts).__name__}; wrap it as [text]")
    # A dict would silently iterate its keys; a non-iterable would fail with a bare Python message.
    if isinstance(texts, Mapping) or not isinstance(texts, Iterable):
        raise TypeError(f"precompute takes a list of chunk texts (str), got {type(texts).__name__}")
    out = list(texts)
    for i, t in enumerate(out):
        if not isinstance(t, str):
            raise TypeError(f"chunk {i} is a {type(t).__name__}, not a str: pass the passage text")
        if not t.strip():
            raise ValueError(f"chunk {i} is empty or whitespace: drop it before precomputing")
    _check_unicode(_named(out))
    return out


def _named(chunks: Sequence[object]) -> Iterator[tuple[str, object]]:
    return ((f"chunk {i}", c) for i, c in enumerate(chunks))


def _check_unicode(texts: Iterable[tuple[str, object]]) -> None:
    """Reject lone surrogates (e.g. bytes decoded with errors="surrogateescape"): the tokenizer
    cannot encode them and would fail deep inside its Rust binding with an opaque message."""
    for what, text in texts:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(
                    f"{what} is not valid Unicode text ({exc.reason} at character {exc.start}): "
                    "decode documents with errors='replace' (or strip lone surrogates) first"
                ) from None
