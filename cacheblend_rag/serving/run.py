"""One answer to a :class:`~.request.Request`, as every front end runs it.

A request over chunks is the engine's CacheBlend prefill (``engine.stream``); one without
chunks is a plain chat, the engine's full prefill of the messages in the model's chat template
(``cacheblend_rag.engine.plain``). Either way the run streams text deltas and ends with a
``GenerationResult`` carrying the engine's stats.

With a :class:`~.batcher.Batcher` the batcher's thread prefills the answer and decodes it
together with the others it serves. Without one, iterating the run prefills and decodes on the
iterating thread, holding the engine's lock (``engine.lock``) throughout: the integrations'
``batch`` and background precompute run in threads, and one model forward at a time is also what
the CPU can actually do.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from cacheblend_rag.serving.request import Request, open_stream

if TYPE_CHECKING:
    from cacheblend_rag.chat.prompt import PromptLayout
    from cacheblend_rag.engine.core import CacheBlendEngine
    from cacheblend_rag.engine.stream import GenerationResult
    from cacheblend_rag.serving.batcher import Batcher


class Run:
    """Iterate to get the answer's text deltas; ``result`` is set once the iteration ends.

    Creating a run validates the request (e.g. a context that does not fit raises here), so errors
    surface before any streaming starts. Closing the iteration early, or :meth:`cancel` (any
    thread), stops the answer, batched or not, and leaves ``result`` None; a batched answer leaves
    the batch before the next decode step.
    """

    def __init__(self, engine: CacheBlendEngine, request: Request, *, batcher: Batcher | None = None):
        self.engine = engine
        self.request = request
        self.result: GenerationResult | None = None
        self._cancelled = threading.Event()
        self._stream = open_stream(engine, request)
        self._ticket = batcher.add(self._stream) if batcher is not None else None

    @property
    def layout(self) -> PromptLayout:
        """The prompt as the engine tokenized it (``layout.token_ids``)."""
        return self._stream.layout

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop the answer: a batched one leaves its batch at once (a waiting one is never
        prefilled); the iteration ends after the delta it is reading. Idempotent."""
        self._cancelled.set()
        if self._ticket is not None:
            self._ticket.cancel()

    def __iter__(self) -> Iterator[str]:
        deltas = iter(self._ticket) if self._ticket is not None else self._alone()
        finished = False
        try:
            for delta in deltas:
                yield delta
                if self._cancelled.is_set():
                    return
            finished = True
        finally:
            # Left early (closed, cancelled, an error): stop the answer. Closing the engine's
            # generator ends it and releases the lock; the batcher drops a cancelled answer's row.
            deltas.close()  # type: ignore[attr-defined]
            if self._ticket is not None and not finished:
                self._ticket.cancel()
        res = self._ticket.result() if self._ticket is not None else self._stream.result
        assert res is not None
        if res.finish_reason == "cancelled":  # cancelled by the batcher's side (closed, say)
            return
        if self.request.plain and self.request.prompt is None:
            # The engine's full_recompute of the messages in the chat template, labelled as such; a
            # prompt formatted by the caller keeps the engine's own label.
            res.stats["mode"] = "plain_chat"
        self.result = res

    def _alone(self) -> Iterator[str]:
        with self.engine.lock:
            self._stream.prefill(count_cache_reads=True)
            yield from self._stream
