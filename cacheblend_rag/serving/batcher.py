"""Continuous batching: requests are prefilled one at a time as they arrive, and every running
answer is decoded in one forward per token.

One decode step reads all of the model's weights to produce a single token per answer. That read,
not the arithmetic, bounds the step on a CPU as on a GPU, so a step for B answers costs little more
than a step for one, and concurrent requests no longer queue behind each other's whole answers.
Prefills stay one request at a time: each is compute-bound already and a fused prefill is one
request's plan.

Answers of different prompt lengths share one cache through left padding. A row's keys stay where
its own prefill put them (rotated for its own positions), its padding is masked out, and each new
token carries the row's own position id, so a row's logits are the ones it would get decoded alone
(up to the order of floating-point sums). A batch of one row decodes with the engine's fast decode
step, as an answer served alone does, so one request at a time costs what it costs without a batcher.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..backbone import cache_kwarg
from ..config import SamplingParams
from ..decode_cache import stacked_cache
from ..generation import Decoder, DecodeState, decode, eos_token_ids
from ..threads import release_team

if TYPE_CHECKING:
    from ..decode_step import FastDecodeStep
    from ..engine import CacheBlendEngine, GenerationResult, GenerationStream


class AnswerSink(Protocol):
    """Where a row's answer goes: ``first_token`` once its first token is chosen, ``delta`` for
    each piece of text that became final, then ``done`` (or ``fail``) once.

    ``cancelled`` turns true (from any thread) once nobody wants the rest of the answer: the row
    leaves the batch before the next step, with ``done`` and finish reason ``"cancelled"``."""

    @property
    def cancelled(self) -> bool: ...

    def first_token(self) -> None: ...

    def delta(self, text: str) -> None: ...

    def done(self, state: DecodeState) -> None: ...

    def fail(self, exc: BaseException) -> None: ...


@dataclass
class _Row:
    decoder: Decoder
    sink: AnswerSink
    token: int  # fed on the next step
    position: int  # that token's position in the row's own sequence


def _layer_kv(cache: DynamicCache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [lay.keys for lay in cache.layers], [lay.values for lay in cache.layers]


class DecodeBatch:
    """The running answers: one cache (``decode_cache.RoomLayer`` per layer, [rows, kv_heads,
    length, head_dim], so each step writes its token in place), left padded to the longest row,
    and a ``[rows, length]`` mask (1: a real key, 0: padding).

    ``fast_step`` (the engine's ``FastDecodeStep``, if its model has one) replaces the model's
    forward: the same arithmetic in fewer operations. A batch of one row takes exactly the step an
    answer decoded alone takes."""

    def __init__(self, model, tokenizer, fast_step: FastDecodeStep | None = None):
        self.model, self.tokenizer, self.fast_step = model, tokenizer, fast_step
        self.eos: set[int] | None = None  # looked up on the first start(): the model is not touched before
        self.cache_kw = ""
        self.rows: list[_Row] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [rows, length]

    def __len__(self) -> int:
        return len(self.rows)

    def start(
        self, cache: DynamicCache, first_logits: torch.Tensor, length: int, params: SamplingParams, sink: AnswerSink
    ) -> None:
        """Choose the answer's first token from its prefill's ``first_logits`` ([vocab]); unless
        that ends the answer, the prefill ``cache`` (``length`` positions, batch 1, handed over)
        joins the batch."""
        if self.eos is None:
            self.eos, self.cache_kw = eos_token_ids(self.model, self.tokenizer), cache_kwarg(self.model)
        decoder = Decoder(self.tokenizer, self.eos, params, first_logits.device)
        token = decoder.choose(first_logits)
        sink.first_token()
        text = decoder.accept(token)
        if text:
            sink.delta(text)
        if decoder.done:
            sink.done(decoder.state())
            return
        keys, values = _layer_kv(cache)
        rows = self._row_kv(range(len(self.rows)))
        rows.append(([k[0, :, :length] for k in keys], [v[0, :, :length] for v in values]))  # [kv_heads, length, head_dim]
        mask = torch.ones(1, length, dtype=torch.long, device=first_logits.device)
        if self.mask is not None:
            width = max(self.mask.shape[1], length)
            mask = torch.cat([_pad_left(self.mask, width), _pad_left(mask, width)])
        self.rows.append(_Row(decoder, sink, token, length))
        self.cache, self.mask = stacked_cache(rows, self._room()), mask

    def _row_kv(self, rows: Iterable[int], first: int = 0) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Views of the given rows' per-layer K/V from column ``first`` on, for ``stacked_cache``."""
        if self.cache is None:
            return []
        keys, values = _layer_kv(self.cache)
        return [([k[i, :, first:] for k in keys], [v[i, :, first:] for v in values]) for i in rows]

    def _room(self) -> int:
        # Positions the longest-running answer may still add: the cache need not grow again.
        return max(r.decoder.params.max_new_tokens - len(r.decoder.token_ids) for r in self.rows)

    @torch.inference_mode()
    def step(self) -> int:
        """One token for every running answer; finished answers leave the batch after the step,
        cancelled ones before it. Returns how many answers the step advanced."""
        # A cancelled answer leaves the way a finished one does, so its row costs no more steps.
        keep = []
        for i, row in enumerate(self.rows):
            if row.sink.cancelled:
                row.sink.done(_cancelled(row.decoder.token_ids, row.decoder.text))
            else:
                keep.append(i)
        if len(keep) < len(self.rows):
            self._keep(keep)
        if not self.rows:
            return 0
        stepped = len(self.rows)
        assert self.mask is not None and self.cache is not None
        device = self.mask.device
        mask = torch.cat([self.mask, torch.ones(len(self.rows), 1, dtype=self.mask.dtype, device=device)], dim=1)
        if self.fast_step is not None and len(self.rows) == 1 and bool(self.mask.all()):
            # One row never has padding (_keep drops the columns no row needs): it is an answer
            # decoded alone, and takes the step such an answer takes.
            row = self.rows[0]
            logits = self.fast_step(row.token, row.position, self.cache)[None]  # [1, vocab]
        elif self.fast_step is not None:
            logits = self.fast_step.batched([r.token for r in self.rows], [r.position for r in self.rows], self.cache, mask)
        else:
            logits = self.model(
                input_ids=torch.tensor([[r.token] for r in self.rows], device=device),
                position_ids=torch.tensor([[r.position] for r in self.rows], device=device),
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=1,
                **{self.cache_kw: self.cache},
            ).logits[:, -1]
        self.mask = mask
        keep = []
        for i, row in enumerate(self.rows):
            row.position += 1
            row.token = row.decoder.choose(logits[i])
            text = row.decoder.accept(row.token)
            if text:
                row.sink.delta(text)
            if row.decoder.done:
                row.sink.done(row.decoder.state())
            else:
                keep.append(i)
        if len(keep) < len(self.rows):
            self._keep(keep)
        return stepped

    def _keep(self, rows: list[int]) -> None:
        self.rows = [self.rows[i] for i in rows]
        if not self.rows:
            self.cache, self.mask = None, None
            return
        assert self.mask is not None and self.cache is not None
        mask = self.mask[torch.tensor(rows, device=self.mask.device)]
        # Drop the padding columns no remaining row needs (the row that left was the longest).
        first = int(mask.any(0).nonzero()[0])
        self.mask = mask[:, first:]
        self.cache = stacked_cache(self._row_kv(rows, first), self._room())


def _cancelled(token_ids: list[int], text: str) -> DecodeState:
    """What a cancelled answer had decoded when it stopped."""
    return DecodeState(list(token_ids), text, "cancelled")


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` ([..., length, head_dim] K/V or a [rows, length] mask) left-padded with zeros to ``width``."""
    if t.dim() == 2:
        return F.pad(t, (width - t.shape[1], 0))
    return F.pad(t, (0, 0, width - t.shape[-2], 0))


# ----------------------------------------------------------------------------- the scheduler
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

    ``submit`` (any thread) validates the request as ``engine.stream`` does, so bad input fails in
    the caller, and queues it. The worker prefills waiting requests (up to ``max_batch`` running),
    then steps the batch one token, and repeats: a request that arrives while others decode waits
    at most one step and the prefills ahead of it. ``max_batch=1`` serves one answer at a time,
    as the engine alone does.

    Time to first token counts from ``submit``, so it includes the wait for the worker. Each
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
        self._waiting: list[Ticket] = []
        self._running: list[Ticket] = []  # admitted: being prefilled or decoded
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

    def submit(self, question: str, chunks: Sequence[str], **kwargs: Any) -> Ticket:
        """Queue one request; keyword arguments as for ``CacheBlendEngine.stream``."""
        return self.enqueue(self.engine.stream(question, chunks, **kwargs))

    def enqueue(self, stream: GenerationStream) -> Ticket:
        """Queue an answer not started yet (a fresh ``GenerationStream`` of this batcher's engine,
        e.g. from ``engine.open_stream`` or ``plain.plain_stream``); the batcher prefills and
        decodes it instead of the stream's own iteration."""
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

    def load(self) -> tuple[int, int]:
        """(running, waiting) right now: answers being prefilled or decoded, and requests in line.
        A cancelled request counts in neither, though it leaves only at the worker's next round."""
        with self._cond:
            self._running = [t for t in self._running if not t.finished]
            return sum(not t.cancelled for t in self._running), sum(not t.cancelled for t in self._waiting)

    def generate(self, question: str, chunks: Sequence[str], **kwargs: Any) -> GenerationResult:
        return self.submit(question, chunks, **kwargs).result()

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

    def _run(self) -> None:
        eng = self.engine
        batch = DecodeBatch(eng.model, eng.tokenizer, eng.fast_step)
        solo: list[_Solo] = []  # APE answers, decoded one step per round beside the batch
        while True:
            with self._cond:
                while not self._waiting and not len(batch) and not solo and not self._closed:
                    release_team()  # idle: only the thread that runs the model next keeps a team
                    self._cond.wait()
                # A request cancelled while it waited leaves the line without a prefill.
                waiting: list[Ticket] = []
                dropped: list[Ticket] = []
                for ticket in self._waiting:
                    (dropped if ticket.cancelled else waiting).append(ticket)
                stop = self._closed and not waiting and not len(batch) and not solo
                take = max(0, self.max_batch - len(batch) - len(solo))
                admit, self._waiting = waiting[:take], waiting[take:]
                self._running = [t for t in self._running if not t.finished] + admit
            for ticket in dropped:
                ticket.done(_cancelled([], ""))
            if stop:
                return
            for ticket in admit:
                try:
                    own = self._start(batch, ticket)
                except Exception as exc:  # noqa: BLE001 - the caller gets its own request's error
                    ticket.fail(exc)
                else:
                    if own is not None:
                        solo.append(own)
            # One step of each APE answer per round, so neither they nor the batch wait for the
            # other's whole answer (an APE answer decoded to its end inside _start paused every
            # batched answer for that long).
            solo = [own for own in solo if self._step_solo(own)]
            if len(batch):
                try:
                    with eng.lock:
                        n = batch.step()
                except Exception as exc:  # noqa: BLE001 - a failed step fails the answers in it
                    for row in batch.rows:
                        row.sink.fail(exc)
                    batch = DecodeBatch(eng.model, eng.tokenizer, batch.fast_step)
                    continue
                if n:  # 0: every row was cancelled, no forward ran
                    self.steps += 1
                    self.rows_stepped += n

    def _start(self, batch: DecodeBatch, ticket: Ticket) -> _Solo | None:
        eng, s = self.engine, ticket.stream
        ticket.started_s = time.perf_counter()
        with eng.lock:
            if ticket.cancelled:  # cancelled after admission, while the worker waited for the lock
                ticket.done(_cancelled([], ""))
                return None
            pre = s.prefill(count_cache_reads=True)
            self.prefills += 1
            if not pre.attention_kwargs:
                batch.start(pre.cache, pre.logits, len(s.layout), s.params, ticket)
                return None
            # APE reweighting is a per-request attention change: this answer is decoded on its own,
            # a step at a time between the batch's steps (_step_solo).
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
            return _Solo(ticket, gen)

    def _step_solo(self, own: _Solo) -> bool:
        """Advance an APE answer to its next text delta; False once it is finished."""
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
        ticket.done(_cancelled([], own.text))  # what was streamed: decode() keeps its tokens
        return False
