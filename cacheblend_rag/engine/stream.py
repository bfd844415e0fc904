"""One answer as it is produced: :class:`GenerationStream` (text deltas) and its :class:`GenerationResult`.

Owns an answer's life after its prompt is laid out: the prefill (once, through the engine's
:meth:`~cacheblend_rag.engine.core.CacheBlendEngine.prefill`), the count of prompt tokens read from the
store, decoding on the calling thread (``generation.decode``), and the result with its timings and
stats. The serving layer's batcher drives the same stream in steps instead: it calls
:meth:`GenerationStream.prefill`, decodes the answer with others, and ends it with
:meth:`GenerationStream.finish`.

Imports the core below the engine (decoding, the guard's stat names, the store lookup); never the
engine module itself, nor the serving layer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from cacheblend_rag.blend.guard import ESCALATED
from cacheblend_rag.chat.prompt import PromptLayout
from cacheblend_rag.config import BlendConfig
from cacheblend_rag.decode.generation import DecodeState, decode
from cacheblend_rag.decode.sampling import SamplingParams
from cacheblend_rag.engine.prefill import PrefillResult
from cacheblend_rag.store.lookup import contains_many
from cacheblend_rag.store.protocol import ChunkStore


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


class GenerationStream:
    """Iterator of text deltas. Time to first token counts from ``t0``, the ``stream``/``generate`` call.

    Iterating prefills (unless :meth:`prefill` already did) and decodes on the calling thread.
    ``cacheblend_rag.serving``'s batcher instead calls :meth:`prefill` itself, decodes the answer
    together with others and ends it with :meth:`finish`; either way ``result`` is set at the end.
    """

    def __init__(
        self,
        engine: Any,  # the CacheBlendEngine that opened it
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
