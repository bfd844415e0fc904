"""The server's side of the batcher: admission with a bounded waiting line, and a relay per request.

Every request's answer is a :class:`~cacheblend_rag.serving.Run` on one
:class:`~cacheblend_rag.serving.Batcher`, which prefills requests one at a time as they arrive
and decodes up to ``max_batch`` answers in one forward per token (``max_batch=1``: one answer at
a time). At most ``max_queue`` more wait for a place in the batch; one more is refused at once
(:class:`Overloaded`, a 503) instead of queueing without bound while its client times out.

A :class:`Job` relays one request's items (text deltas) from a relay thread, which builds the run
(tokenizing the request: off the event loop) and waits on it, to the event loop as they are
produced; the loop never blocks on the model. A job whose consumer leaves cancels its run: a
waiting request is never prefilled, a running one leaves the batch before the next step.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from cacheblend_rag.serving import Batcher
from cacheblend_rag.threads import release_team

T = TypeVar("T")
_END = object()


class Overloaded(Exception):
    """The waiting line is full, or the server is shutting down."""


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


class Job(Generic[T]):
    """One request: iterate it (on the event loop) for the produced items; once the iteration
    ends, ``result`` is the producer's ``result`` attribute (a run's ``GenerationResult``) and
    ``parsed`` its ``parsed`` one (a tool run's calls; None for a plain run).

    ``produce()`` (called on the relay thread) returns an iterator of the items; if it has a
    ``cancel()`` method (a :class:`~cacheblend_rag.serving.Run`), leaving the iteration early
    calls it at once, so the batcher drops the request before its next step. Either way the
    relay stops after its current item, and a job that has not started is skipped.
    """

    def __init__(self, produce: Callable[[], Iterator[T]], loop: asyncio.AbstractEventLoop):
        self._produce = produce
        self._loop = loop
        self._items: asyncio.Queue[Any] = asyncio.Queue()
        self._stop = threading.Event()
        self._source: Any = None
        self.result: Any = None
        self.parsed: Any = None

    def run(self) -> None:
        """Relay thread: produce every item, then the end marker (or the failure)."""
        if self._stop.is_set():
            return self._put(_END)
        try:
            source = self._source = self._produce()
            release_team()  # building the request may have run torch; the batcher's thread runs the model
            if self._stop.is_set():  # the consumer left while the request was being built
                self._cancel_source()
            gen = iter(source)
            try:
                while not self._stop.is_set():
                    try:
                        item = next(gen)
                    except StopIteration:
                        self.result = getattr(source, "result", None)
                        self.parsed = getattr(source, "parsed", None)
                        break
                    self._put(item)
            finally:
                close = getattr(gen, "close", None)
                if close is not None:
                    close()  # e.g. releases the engine lock of a run stopped early
        except Exception as exc:  # noqa: BLE001 - any failure goes to the request's client as its error
            self._put(_Failed(exc))
        else:
            self._put(_END)

    def stop(self) -> None:
        """The consumer is gone: stop producing (any thread)."""
        self._stop.set()
        self._cancel_source()

    def _cancel_source(self) -> None:
        cancel = getattr(self._source, "cancel", None)
        if cancel is not None:
            cancel()

    def _put(self, item: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def __aiter__(self) -> AsyncIterator[T]:
        try:
            while True:
                item = await self._items.get()
                if item is _END:
                    return
                if isinstance(item, _Failed):
                    raise item.exc
                yield item
        finally:
            self.stop()


class EngineWorker:
    """Admits requests for one engine's :class:`~cacheblend_rag.serving.Batcher`: at most
    ``max_batch`` decoded together and ``max_queue`` waiting; each admitted request gets a relay
    thread for its :class:`Job`."""

    def __init__(self, engine: Any, max_queue: int = 8, max_batch: int = 8):
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue={max_queue!r} must be an int >= 0 (0: refuse any request while the batch is full)")
        self.batcher = Batcher(engine, max_batch=max_batch)  # checks max_batch
        self.max_queue, self.max_batch = max_queue, max_batch
        # One relay per admitted request: they only wait on their answers, the batcher computes.
        self._pool = ThreadPoolExecutor(max_batch + max_queue, thread_name_prefix="cacheblend-serve")
        self._guard = threading.Lock()
        self._admitted = 0  # running + waiting
        self._closing = False

    def load(self) -> tuple[int, int]:
        """(running, waiting) right now: answers being prefilled or decoded, and requests waiting
        for a place in the batch (the batcher's view; a request still being tokenized is in neither)."""
        return self.batcher.load()

    @property
    def admitted(self) -> int:
        """Requests holding a place right now (running, waiting, being prepared or finishing)."""
        with self._guard:
            return self._admitted

    def submit(self, produce: Callable[[], Iterator[T]]) -> Job[T]:
        """Queue a job (call on the event loop); raises :class:`Overloaded` when the line is full."""
        with self._guard:
            if self._closing:
                raise Overloaded("the server is shutting down: retry on another instance")
            if self._admitted >= self.max_batch + self.max_queue:
                raise Overloaded(
                    f"the server is busy: {self._admitted} requests are running or waiting, the most it takes "
                    f"(--max-batch {self.max_batch} decoded together, --max-queue {self.max_queue} waiting); retry later"
                )
            self._admitted += 1
        job: Job[T] = Job(produce, asyncio.get_running_loop())
        release_team()  # the loop's thread loaded the model: its OpenMP team would slow the batcher's
        self._pool.submit(job.run).add_done_callback(self._release)
        return job

    def _release(self, _: Future) -> None:
        with self._guard:
            self._admitted -= 1

    def close(self) -> None:
        """Refuse new jobs, wait for the running and waiting ones to finish, stop the batcher."""
        with self._guard:
            self._closing = True
        self._pool.shutdown(wait=True)
        self.batcher.close()
