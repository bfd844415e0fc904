"""CacheBlendEngine: the façade users hold; answers a question over chunks in any prefill mode.

Owns the engine's parts and its public API, and delegates each concern to its module:

* ``engine.setup``: ``from_pretrained``'s model and store loading, the calibrated config, and
  :meth:`CacheBlendEngine.answer_settings` (what decides its answers besides the request);
* ``blend.chunk_cache``: computing, precomputing and writing back chunk caches (the methods under
  "chunk caches" below are its public face);
* ``engine.prefill``: the prefill modes (``config.MODES``), the retry on lost chunk records and the
  fidelity guard, behind :meth:`CacheBlendEngine.prefill`;
* ``decode.sampling``: the decoding settings by name, built into one ``SamplingParams``;
* ``engine.stream``: one answer as it is produced (:class:`GenerationStream`) and its
  :class:`GenerationResult`.

The adapter (``backbone``) runs the model, the planner decides what each prompt position loads,
computes or reuses, the loader (``store.loader``) reads chunk caches, the fusor recomputes the
selected tokens layer by layer, and ``generation`` decodes. The core never imports the serving
layer (``serving``, ``server``) above it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from cacheblend_rag.blend.chunk_cache import ChunkCache
from cacheblend_rag.blend.self_test import self_test
from cacheblend_rag.chat.prompt import (
    DEFAULT_INSTRUCTION,
    PromptBuilder,
    PromptLayout,
    Segment,
    check_texts,
    check_unicode,
    named_chunks,
)
from cacheblend_rag.config import BlendConfig, check_mode
from cacheblend_rag.decode.sampling import SamplingParams, sampling_params
from cacheblend_rag.decode.step import FastDecodeStep
from cacheblend_rag.engine import capacity, setup
from cacheblend_rag.engine.prefill import PrefillResult, run_prefill
from cacheblend_rag.engine.stream import GenerationResult, GenerationStream
from cacheblend_rag.model.backbone import Backbone
from cacheblend_rag.neighbours.learned import LearnConfig, NeighbourLearner
from cacheblend_rag.store.disk import KVStore
from cacheblend_rag.store.protocol import KV, ChunkStore
from cacheblend_rag.store.quant import DEFAULT_KV_FORMAT

if TYPE_CHECKING:
    from cacheblend_rag.control.controller import LoadingController
    from cacheblend_rag.store.spec import StoreSpec

# Importable from here as before the split.
__all__ = ["CacheBlendEngine", "GenerationResult", "GenerationStream", "PrefillResult"]


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
        checks_home: str | os.PathLike[str] | None = None,
    ):
        from cacheblend_rag.model.fingerprint import model_fingerprint
        from cacheblend_rag.model.load_cache import PassedChecks

        # Refused here, before anything is cached, if the fused path cannot be exact for it.
        self.backbone = Backbone.adapt(model.eval())  # sets the attention the checks run
        # ``checks_home`` (with the ``fingerprint`` of ``model`` as loaded): where the load-time
        # checks below that passed are remembered, keyed by the fingerprint, torch, code, CPU and
        # threads, so a later load of the same model skips them; a failure is never remembered.
        passed = PassedChecks(checks_home, fingerprint, model) if checks_home is not None and fingerprint else None
        if passed is None or not passed.passed("self_test"):
            self_test(self.backbone)
            if passed is not None:
                passed.record_pass("self_test")
        # One decoded token in few operations where the model's layers allow it (checked against
        # the model's own forward here, else None: decoding uses the forward).
        step_checked = passed is not None and passed.passed("fast_decode_step")
        self.fast_step = FastDecodeStep.build(model, self.backbone.window, checked=step_checked)
        if passed is not None and self.fast_step is not None and not step_checked:
            passed.record_pass("fast_decode_step")
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.config = setup.check_config(config) or BlendConfig()
        # Read layer i+1.. from the store while layer i computes (paper section 5). None: decide per
        # request from how layer 0's read went (store.loader.LayerAssembler).
        self.pipelined = pipelined
        # Optional cacheblend_rag.control.controller.LoadingController: picks the recompute ratio of a
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
        kv_format: str | None = DEFAULT_KV_FORMAT,
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

        ``kv_format`` is the format the disk and Redis tiers keep chunk caches in: "int8" (the
        default, ``store.quant.DEFAULT_KV_FORMAT``: about a quarter of float32's bytes, with the
        float records' answers), "int4", or "float" (None) for the K/V's own dtype
        (docs/storage.md, "Quantized chunk records"). The format is part of a chunk's name in
        the store: caches written in another format are not read.
        """
        loaded, opened = setup.open_pretrained(
            model,
            device=device,
            dtype=dtype,
            weights=weights,
            cache_dir=cache_dir,
            store_dir=store_dir,
            store_size_limit=store_size_limit,
            memory_bytes=memory_bytes,
            store=store,
            kv_format=kv_format,
        )
        if kwargs.get("config") is None:
            kwargs["config"] = setup.calibrated_config(loaded.fingerprint)
        kwargs.setdefault("checks_home", setup.cache_home(cache_dir))
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
        return setup.answer_settings(self)

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
        check_room: bool = True,
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
        check_room: first plan the bytes (:meth:`plan_precompute`) and raise
            ``capacity.StoreTooSmall``, computing nothing, when a disk store's size limit is below
            all of these caches (the last chunks would evict the first) or its disk lacks the
            space. ``False`` skips the plan (the caller has checked it).
        """
        if not isinstance(neighbours, int) or isinstance(neighbours, bool) or neighbours < 0:
            raise ValueError(f"neighbours={neighbours!r} must be an int >= 0 (0: plain chunk caches only)")
        texts = list(dict.fromkeys(check_texts(texts)))
        pool = None if corpus is None else list(dict.fromkeys(check_texts(corpus, "corpus")))
        target = self._store(store)
        prefix_ids = self.prompts.for_tools(tools).prefix_ids
        if check_room and capacity.bounded(target):  # an in-memory store evicts by its own bound
            capacity.check_room(capacity.plan_precompute(self, texts, target, neighbours, prefix_ids=prefix_ids), target)
        return self.chunk_cache.precompute(
            target,
            texts,
            neighbours=neighbours,
            embed=embed,
            corpus=pool,
            progress=progress,
            prefix_ids=prefix_ids,
        )

    def plan_precompute(
        self,
        texts: Iterable[str],
        *,
        neighbours: int = 0,
        store: ChunkStore | None = None,
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> capacity.PrecomputePlan:
        """What :meth:`precompute` with these arguments would store: chunks, how many are cached,
        tokens, and the bytes of the missing caches and of all of them in the store's format."""
        texts = list(dict.fromkeys(check_texts(texts)))
        return capacity.plan_precompute(
            self, texts, self._store(store), neighbours, prefix_ids=self.prompts.for_tools(tools).prefix_ids
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
        """Prefill ``layout`` in ``mode`` (``prefill.run_prefill``). ``pipelined`` overrides the
        engine's setting and ``store`` the engine's store (read and written back) for this call only."""
        check_mode(mode)
        return run_prefill(self, layout, mode, config or self.config, self._store(store), pipelined=pipelined)

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
        config = setup.check_config(config) or self.config
        return self.prefill(layout, mode, config.with_ratio(recompute_ratio)).logits

    def stream(
        self,
        question: str,
        chunks: Sequence[str],
        sampling: SamplingParams | None = None,
        *,
        mode: str = "cacheblend",
        recompute_ratio: float | None = None,
        config: BlendConfig | None = None,
        tools: Sequence[Mapping[str, Any]] = (),
        turns: Sequence[Mapping[str, Any]] = (),
        store: ChunkStore | None = None,
        pipelined: bool | None = None,
        controller: LoadingController | None = None,
        **decoding: Any,
    ) -> GenerationStream:
        """Iterate over the answer's text deltas; ``.result`` holds the full result afterwards.

        How to decode is one ``sampling`` (:class:`~cacheblend_rag.SamplingParams`), or, as a
        convenience, its fields as keyword arguments (``max_new_tokens=64, temperature=0.7,
        top_p, top_k, stop, seed, ignore_eos, constraint``; ``sampling.sampling_params`` builds
        it); not both. Time to first token counts from this call.

        ``store``, ``pipelined`` and ``controller`` replace the engine's own for this answer only
        (a benchmark comparing tiers or loading modes on one engine). ``ignore_eos`` decodes past
        the end-of-sequence token to ``max_new_tokens`` (a benchmark timing fixed lengths).

        ``constraint`` (``constraints.Grammar``) keeps the answer inside a grammar (a JSON schema:
        the answer parses). ``tools`` (function definitions, OpenAI's format) are rendered by the
        model's chat template into the prompt's prefix, so the chunks are cached behind that prefix
        (``precompute(..., tools=...)``); ``turns`` are chat messages after the question's turn
        (the assistant's tool calls, ``role: tool`` results), rendered by the template after it.
        See docs/engine.md, "Constrained decoding and tools"."""
        t0 = time.perf_counter()
        check_mode(mode)
        sampling = sampling_params(sampling, **decoding)
        layout = self.build_layout(question, chunks, tools=tools, turns=turns)
        self.backbone.check_fits(len(layout), "the prompt (instruction + chunks + question)", reserve=sampling.max_new_tokens)
        config = (setup.check_config(config) or self.config).with_ratio(recompute_ratio)
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
        self,
        question: str,
        chunks: Sequence[str],
        sampling: SamplingParams | None = None,
        *,
        on_token: Callable[[str], None] | None = None,
        **kwargs: Any,
    ) -> GenerationResult:
        """Answer ``question`` over ``chunks``; ``sampling`` and keyword arguments as for :meth:`stream`."""
        stream = self.stream(question, chunks, sampling, **kwargs)
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
