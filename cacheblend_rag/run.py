"""One answer from the engine: a CacheBlend request over chunks, or a plain chat prefill without any
(``cacheblend_rag.plain``: the engine's full prefill of the messages in the model's chat template).

Both paths stream text deltas and end with a :class:`RunResult` carrying the engine's stats. A
per-engine lock serializes work on one engine: the framework integrations' ``batch`` and
background precompute run in threads, the HTTP server has its worker thread, and one model
forward at a time is also what the CPU can actually do.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from .plain import chat_text, plain_stream, sampling_params
from .store.lookup import contains_many

if TYPE_CHECKING:
    from .batching import Batcher

def engine_lock(engine) -> threading.Lock:
    """The lock that serializes generation and precompute on ``engine`` (``engine.lock``)."""
    return engine.lock


@dataclass(frozen=True)
class Request:
    """What the engine is asked.

    With ``chunks`` it is ``engine.generate(question, chunks)``. Without chunks it is a plain chat:
    ``messages`` (role/content dicts) go through the model's chat template with a full prefill.
    """

    question: str
    chunks: tuple[str, ...] = ()
    messages: tuple[dict[str, str], ...] = ()
    chunk_source: str = "none"
    """Where the chunks came from: "explicit" (flagged blocks, dicts), "matched" (known chunk
    texts found in the prompt) or "none"."""
    chunks_matched: int = 0
    """How many known chunk texts the registry found in the prompt (0 for explicit inputs)."""

    @property
    def plain(self) -> bool:
        return not self.chunks

    @classmethod
    def over_chunks(cls, question: str, chunks: Sequence[str], source: str = "explicit", matched: int = 0) -> "Request":
        """``generate(question, chunks)``; refuses a prompt that holds chunks but no question."""
        if not question.strip():
            raise ValueError(
                "the prompt holds only chunks and no question text: put the question after the "
                "documents (e.g. 'Context: {context}\\n\\nQuestion: {question}')"
            )
        return cls(question, tuple(chunks), chunk_source=source, chunks_matched=matched)

    @classmethod
    def plain_chat(cls, messages: Sequence[dict[str, str]], text: str) -> "Request":
        """A prompt without chunks, answered as an ordinary chat with a full prefill; ``text`` is
        the messages' text (what a chunked request would have used as its question)."""
        if not text.strip():
            raise ValueError("the prompt is empty: nothing to answer")
        return cls(text, (), tuple(messages))


@dataclass
class RunResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)


class Run:
    """Iterate to get the answer's text deltas; ``result`` is set once the iteration ends.

    Creating a run validates the request (e.g. a context that does not fit raises here), so errors
    surface before any streaming starts. Closing the iteration early, or setting ``cancelled``
    (checked after each delta), stops the answer, batched or not, and leaves ``result`` None.
    """

    def __init__(self, engine, request: Request, *, engine_kwargs: dict[str, Any], batcher: "Batcher | None" = None):
        self.engine = engine
        self.request = request
        self.result: RunResult | None = None
        self.cancelled = threading.Event()
        self._cache_read = 0
        # With a batcher, chunked requests are decoded together with whatever else it is serving;
        # plain chats (no chunks) keep their own full-prefill path.
        self._ticket = None if batcher is None or request.plain else batcher.submit(
            request.question, list(request.chunks), **engine_kwargs)
        if self._ticket is not None:
            self._stream = self._ticket.stream
        elif request.plain:
            # No chunks: the messages in the model's chat template, one full prefill.
            self._stream = plain_stream(engine, chat_text(engine.tokenizer, request.messages), sampling_params(engine_kwargs))
        else:
            self._stream = engine.stream(request.question, list(request.chunks), **engine_kwargs)

    def __iter__(self) -> Iterator[str]:
        if self._ticket is not None:
            try:
                for delta in self._ticket:
                    yield delta
                    if self.cancelled.is_set():
                        return
            finally:
                # Left early (closed, cancelled, an error): the batcher drops the answer's row, as
                # closing the engine's generator stops it below. A no-op once the answer is done.
                self._ticket.cancel()
            res = self._ticket.result()
            self.result = RunResult(res.text, list(res.token_ids), res.finish_reason, dict(res.stats))
            return
        with engine_lock(self.engine):
            self._cache_read = cached_chunk_tokens(self.engine, self._stream)
            deltas = self._run_engine()
            try:
                for delta in deltas:
                    yield delta
                    if self.cancelled.is_set():
                        return
            finally:
                deltas.close()

    def _run_engine(self) -> Iterator[str]:
        yield from self._stream
        res = self._stream.result
        assert res is not None
        stats = dict(res.stats)
        if self.request.plain:
            stats["mode"] = "plain_chat"  # the engine's full_recompute of the chat, labelled as such
        stats["cache_read_tokens"] = cache_read_tokens(stats, self._cache_read)
        self.result = RunResult(res.text, list(res.token_ids), res.finish_reason, stats)


def cache_read_tokens(stats: dict[str, Any], chunk_tokens: int) -> int:
    """Prompt tokens whose KV came from the cache: the reused prefix under prefix caching, else
    ``chunk_tokens`` (:func:`cached_chunk_tokens`, counted before the prefill)."""
    if stats.get("mode") == "prefix_caching":
        return int(stats.get("reused_prefix_tokens", 0))
    return chunk_tokens


def cached_chunk_tokens(engine, stream) -> int:
    """Tokens of the chunks whose KV the coming prefill reads from the store instead of computing.

    Checked under the engine lock after the pending write-backs finished, so it sees exactly the
    store the prefill will see. ``full_recompute`` (and its saved variant) reads nothing.
    """
    if stream.mode in ("full_recompute", "full_recompute_saved"):
        return 0
    engine.flush()
    store = engine.store if stream.store is None else stream.store
    segments = [seg for seg in stream.layout.segments if seg.reusable]
    found = contains_many(store, [engine.chunk_key(seg) for seg in segments])  # one round trip for all chunks
    return sum(len(seg) for seg, hit in zip(segments, found) if hit)
