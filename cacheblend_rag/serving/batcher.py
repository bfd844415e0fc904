"""Continuous batching: a scheduler that serves one engine from one thread, as a step loop.

Owns :class:`Batcher` and its :class:`Ticket`s. Requests come in with :meth:`Batcher.add` (a
stream not started yet; ``Run`` and :meth:`Batcher.submit` build it from a ``Request``, the one
request path every front end takes). The worker thread repeats :meth:`Batcher.step` until
:meth:`Batcher.done` and closed; one step is three named parts:

1. **admission** (:meth:`Batcher._admit`): drop the waiting requests cancelled meanwhile, and admit
   waiting requests in arrival order while fewer than ``max_batch`` answers run;
2. **prefill** (:meth:`Batcher._prefill`): prefill each admitted request, one at a time (each is
   compute-bound already, and a fused prefill is one request's plan); its first token is chosen
   and it joins the decode batch, or, with a per-request attention change (APE), runs on its own;
3. **decode** (:meth:`Batcher._decode`): one token for every running answer: a step of each
   answer decoded on its own, and one forward for the whole batch (``decode_batch.DecodeBatch``).

A request that arrives while others decode waits at most one step and the prefills ahead of it.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from cacheblend_rag.decode.generation import DecodeState, decode
from cacheblend_rag.serving.decode_batch import AnswerSink, DecodeBatch, cancelled_state
from cacheblend_rag.serving.request import Request, open_stream
from cacheblend_rag.threads import release_team

if TYPE_CHECKING:
    from cacheblend_rag.engine.core import CacheBlendEngine
    from cacheblend_rag.engine.stream import GenerationResult, GenerationStream

__all__ = ["AnswerSink", "Batcher", "DecodeBatch", "Ticket"]

_END = object()


@dataclass
class _Solo:
    """An answer decoded on its own (APE), one delta per round of the batcher's worker."""

    ticket: Ticket
    gen: Generator[str, None, Any]
    text: str = ""  # streamed so far: all a cancelled answer can report


@dataclass
class Ticket:
    """One submitted request: iterate it for the answer's text deltas, or call ``result()``.

    ``cancel()`` (any thread; leaving the iteration early does it too) asks the batcher to stop
    the answer: a request still waiting is never prefilled, a running one leaves the batch before
    the next decode step. The ticket then finishes as usual: the iteration ends and ``result()``
    returns a ``GenerationResult`` with ``finish_reason="cancelled"`` and what was decoded until
    then (no tokens for a request never prefilled; only the streamed text, no token ids, for an
    APE request, which its own decode loop does not expose). A ticket already done stays done.
    """

    stream: GenerationStream
    _items: queue.Queue[Any] = field(default_factory=queue.Queue)
    _done: threading.Event = field(default_factory=threading.Event)
    _cancel: threading.Event = field(default_factory=threading.Event)
    _result: GenerationResult | None = None
    _error: BaseException | None = None
    started_s: float = 0.0  # when its prefill began (perf_counter)
    first_token_s: float | None = None

    def __iter__(self) -> Iterator[str]:
        ended = False
        try:
            while True:
                item = self._items.get()
                if item is _END:
                    ended = True
                    break
                yield item
        finally:
            if not ended:  # the reader left early (break, close): free the answer's row
                self.cancel()
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """Stop the answer (see the class docstring); idempotent, a no-op once it is done."""
        if not self._done.is_set():
            self._cancel.set()

    @property
    def cancelled(self) -> bool:
        """Whether ``cancel()`` was called before the answer was done."""
        return self._cancel.is_set()

    @property
    def finished(self) -> bool:
        """Whether the answer is done (decoded, cancelled or failed): ``result()`` returns at once."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> GenerationResult:
        if not self._done.wait(timeout):
            raise TimeoutError(f"no answer within {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    # AnswerSink, called on the batcher's thread
    def first_token(self) -> None:
        self.first_token_s = time.perf_counter()

    def delta(self, text: str) -> None:
        self._items.put(text)

    def done(self, state: DecodeState) -> None:
        # The wait for the worker counts from the request's arrival (the stream's t0).
        queue_s = (self.started_s or time.perf_counter()) - self.stream.t0
        self._result = self.stream.finish(state, self.first_token_s, queue_s=queue_s)
        self._finish()

    def fail(self, exc: BaseException) -> None:
        self._error = exc
        self._finish()

    def _finish(self) -> None:
        self._items.put(_END)
        self._done.set()


class Batcher:
    """Serve one engine from one thread, decoding every running answer in one batch.

    ``add`` (any thread) queues a stream built and checked in the caller (``Run`` builds it from a
    ``Request``; ``submit`` from a question, chunks and settings), so bad input fails there. The
    worker repeats :meth:`step` (admission, prefills up to ``max_batch`` running, one decode step)
    while anything is waiting or running (:meth:`done`). ``max_batch=1`` serves one answer at a
    time, as the engine alone does.

    Time to first token counts from the stream's creation, so it includes the wait for the worker. Each
    prefill and each step holds the engine's lock (``engine.lock``), so precompute and answers
    served outside the batcher interleave with it safely.

    Only one thread at a time should keep an OpenMP team (:mod:`~cacheblend_rag.threads`): the
    thread that creates the batcher and each thread that submits to it release theirs, and the
    worker releases its own whenever it goes idle. A thread that keeps running torch work while
    the worker computes (say, embedding queries) slows it until that thread next submits.
    """

    # One batcher per engine and max_batch for the framework integrations (for_engine).
    _shared: ClassVar[weakref.WeakKeyDictionary[Any, dict[int, Batcher]]] = weakref.WeakKeyDictionary()
    _shared_guard: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, engine: CacheBlendEngine, max_batch: int = 8):
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise ValueError(f"max_batch={max_batch!r} must be an int >= 1 (1: one answer at a time)")
        self.engine, self.max_batch = engine, max_batch
        self._waiting: list[Ticket] = []  # added, not admitted yet
        self._running: list[Ticket] = []  # admitted: being prefilled or decoded
        # Touched by the worker's thread only: the batch of running answers, and the answers
        # decoded on their own beside it (APE), one delta per step.
        self._batch = DecodeBatch(engine.model, engine.tokenizer, engine.fast_step)
        self._solo: list[_Solo] = []
        self._cond = threading.Condition()
        self._closed = False
        self.prefills = 0  # requests prefilled
        self.steps = 0  # batched decode steps run
        self.rows_stepped = 0  # answers advanced by them (rows_stepped / steps: mean batch size)
        self._thread = threading.Thread(target=self._run, name="cacheblend-batcher", daemon=True)
        release_team()
        self._thread.start()

    @classmethod
    def for_engine(cls, engine: CacheBlendEngine, max_batch: int) -> Batcher:
        """The batcher shared by every caller on ``engine`` with this ``max_batch`` (created on
        first use): a model object made per request leaves no worker thread behind, and calls
        through different model objects still share decode steps."""
        with cls._shared_guard:
            per_engine = cls._shared.setdefault(engine, {})
            if max_batch not in per_engine:
                per_engine[max_batch] = cls(engine, max_batch=max_batch)
            return per_engine[max_batch]

    # ------------------------------------------------------------------ the request path (any thread)
    def add(self, stream: GenerationStream) -> Ticket:
        """Queue an answer not started yet (a fresh ``GenerationStream`` of this batcher's engine,
        from ``serving.request.open_stream``, i.e. ``engine.stream`` or ``plain.plain_stream``);
        the worker prefills and decodes it instead of the stream's own iteration."""
        if stream.engine is not self.engine:
            raise ValueError("the stream belongs to another engine than the batcher's")
        if stream.prefill_result is not None or stream.result is not None:
            raise ValueError("the stream has started already: pass a fresh one")
        ticket = Ticket(stream)
        with self._cond:
            if self._closed:
                raise RuntimeError("the batcher is closed: create a new Batcher")
            self._waiting.append(ticket)
            self._cond.notify()
        release_team()
        return ticket

    def submit(self, question: str, chunks: Sequence[str], **settings: Any) -> Ticket:
        """Queue ``question`` over ``chunks`` with ``settings`` (``serving.request.request_settings``'
        names: mode, recompute_ratio, config and the decoding settings), built and checked as every
        front end's request is (``Request.over_chunks(...).with_settings(...)``): bad input raises here."""
        return self.add(open_stream(self.engine, Request.over_chunks(question, chunks).with_settings(**settings)))

    def load(self) -> tuple[int, int]:
        """(running, waiting) right now: answers being prefilled or decoded, and requests in line.
        A cancelled request counts in neither, though it leaves only at the worker's next step."""
        with self._cond:
            self._running = [t for t in self._running if not t.finished]
            return sum(not t.cancelled for t in self._running), sum(not t.cancelled for t in self._waiting)

    def close(self) -> None:
        """Finish every submitted request, then stop the worker. A cancelled request finishes
        (as cancelled) without being decoded further, so it does not hold ``close`` up."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def __enter__(self) -> Batcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the step loop (the worker's thread)
    def done(self) -> bool:
        """Whether nothing is waiting or running (cancelled requests not dropped yet count as waiting)."""
        with self._cond:
            return not self._waiting and not len(self._batch) and not self._solo

    def step(self) -> None:
        """One round of the worker: admission, the admitted requests' prefills, one decode step."""
        for ticket in self._admit():
            self._prefill(ticket)
        self._decode()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self.done() and not self._closed:
                    release_team()  # idle: only the thread that runs the model next keeps a team
                    self._cond.wait()
                if self.done():  # closed, and every request finished
                    return
            self.step()

    def _admit(self) -> list[Ticket]:
        """Admission: drop the waiting requests cancelled meanwhile (they finish as cancelled,
        never prefilled) and admit the others in arrival order while fewer than ``max_batch``
        answers run. Returns the admitted tickets."""
        with self._cond:
            waiting: list[Ticket] = []
            dropped: list[Ticket] = []
            for ticket in self._waiting:
                (dropped if ticket.cancelled else waiting).append(ticket)
            take = max(0, self.max_batch - len(self._batch) - len(self._solo))
            admit, self._waiting = waiting[:take], waiting[take:]
            self._running = [t for t in self._running if not t.finished] + admit
        for ticket in dropped:
            ticket.done(cancelled_state([], ""))
        return admit

    def _prefill(self, ticket: Ticket) -> None:
        """Prefill: run ``ticket``'s prefill under the engine's lock and choose its first token;
        the answer joins the decode batch, or, with APE reweighting (a per-request attention
        change), is decoded on its own beside it. A failure fails this request only."""
        eng, s = self.engine, ticket.stream
        ticket.started_s = time.perf_counter()
        try:
            with eng.lock:
                if ticket.cancelled:  # cancelled after admission, while the worker waited for the lock
                    ticket.done(cancelled_state([], ""))
                    return
                pre = s.prefill(count_cache_reads=True)
                self.prefills += 1
                if not pre.attention_kwargs:
                    self._batch.start(pre.cache, pre.logits, len(s.layout), s.params, ticket)
                    return
                # Decoded a step at a time between the batch's steps (_decode_solo).
                gen = decode(
                    eng.model,
                    eng.tokenizer,
                    pre.cache,
                    pre.logits,
                    len(s.layout),
                    s.params,
                    ticket.first_token,
                    model_kwargs=pre.attention_kwargs,
                )
        except Exception as exc:  # noqa: BLE001 - the caller gets its own request's error
            ticket.fail(exc)
            return
        self._solo.append(_Solo(ticket, gen))

    def _decode(self) -> None:
        """Decode: one step of each answer decoded on its own, then one batched step for the rest,
        so neither waits for the other's whole answer. A failed batched step fails the answers in it."""
        self._solo = [own for own in self._solo if self._decode_solo(own)]
        if not len(self._batch):
            return
        eng = self.engine
        try:
            with eng.lock:
                n = self._batch.step()
        except Exception as exc:  # noqa: BLE001 - a failed step fails the answers in it
            for row in self._batch.rows:
                row.sink.fail(exc)
            self._batch = DecodeBatch(eng.model, eng.tokenizer, self._batch.fast_step)
            return
        if n:  # 0: every row was cancelled, no forward ran
            self.steps += 1
            self.rows_stepped += n

    def _decode_solo(self, own: _Solo) -> bool:
        """Advance an answer decoded on its own to its next text delta; False once it is finished."""
        ticket = own.ticket
        try:
            if not ticket.cancelled:
                with self.engine.lock:
                    delta = next(own.gen)
                own.text += delta
                ticket.delta(delta)
                return True
        except StopIteration as stop:
            own.gen.close()
            ticket.done(stop.value)
            return False
        except Exception as exc:  # noqa: BLE001 - the caller gets its own request's error
            own.gen.close()
            ticket.fail(exc)
            return False
        own.gen.close()
        ticket.done(cancelled_state([], own.text))  # what was streamed: decode() keeps its tokens
        return False
