"""One worker thread in front of the engine, with a bounded waiting line.

The engine answers one request at a time (one model, one forward at a time is also what the
hardware does), so requests run in arrival order on a single thread. At most ``max_queue`` wait
behind the running one; one more is refused at once (:class:`Overloaded`, a 503) instead of
queueing without bound while its client times out.

A :class:`Job` hands its items (text deltas) from the worker thread to the event loop as they are
produced; the loop never blocks on the model.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Generator, Generic, TypeVar

from ..threads import release_team

T = TypeVar("T")
_END = object()


class Overloaded(Exception):
    """The waiting line is full, or the server is shutting down."""


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


class Job(Generic[T]):
    """One request on the worker: iterate it (on the event loop) for the produced items; once the
    iteration ends, ``result`` is the producing generator's return value.

    Leaving the iteration early (client gone, cancellation) tells the worker to stop producing:
    a job that has not started yet is skipped, a running one stops after its current item.
    """

    def __init__(self, produce: Callable[[], Generator[T, None, Any]], loop: asyncio.AbstractEventLoop):
        self._produce = produce
        self._loop = loop
        self._items: asyncio.Queue[Any] = asyncio.Queue()
        self._stop = threading.Event()
        self.result: Any = None
        self.submitted_at = time.perf_counter()
        self.queue_s = 0.0
        """Seconds the job waited for the worker."""

    def run(self) -> None:
        """Worker thread: produce every item, then the end marker (or the failure)."""
        self.queue_s = time.perf_counter() - self.submitted_at
        if self._stop.is_set():
            return self._put(_END)
        try:
            gen = self._produce()
            try:
                while not self._stop.is_set():
                    try:
                        item = next(gen)
                    except StopIteration as done:
                        self.result = done.value
                        break
                    self._put(item)
            finally:
                gen.close()  # e.g. releases the engine lock of a run stopped early
        except Exception as exc:
            self._put(_Failed(exc))
        else:
            self._put(_END)

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
            self._stop.set()


class EngineWorker:
    """Runs jobs one at a time on one thread; ``max_queue`` bounds how many wait."""

    def __init__(self, max_queue: int = 8):
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue={max_queue!r} must be an int >= 0 (0: refuse any request while one runs)")
        self.max_queue = max_queue
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cacheblend-serve")
        self._guard = threading.Lock()
        self._admitted = 0  # running + waiting
        self._closing = False

    def load(self) -> tuple[int, int]:
        """(running, waiting) right now."""
        with self._guard:
            return min(self._admitted, 1), max(self._admitted - 1, 0)

    def submit(self, produce: Callable[[], Generator[T, None, Any]]) -> Job[T]:
        """Queue a job (call on the event loop); raises :class:`Overloaded` when the line is full."""
        with self._guard:
            if self._closing:
                raise Overloaded("the server is shutting down: retry on another instance")
            if self._admitted > self.max_queue:
                raise Overloaded(
                    f"the server is busy: one request is running and {self._admitted - 1} are waiting "
                    f"(the limit, --max-queue, is {self.max_queue}); retry later"
                )
            self._admitted += 1
        job: Job[T] = Job(produce, asyncio.get_running_loop())
        release_team()  # the loop's thread loaded the model: its OpenMP team would slow the worker's
        self._pool.submit(self._run, job).add_done_callback(self._release)
        return job

    @staticmethod
    def _run(job: Job) -> None:
        try:
            job.run()
        finally:
            release_team()  # idle now: only the thread that runs the model next keeps a team

    def _release(self, _: Future) -> None:
        with self._guard:
            self._admitted -= 1

    def close(self) -> None:
        """Refuse new jobs and wait for the running and waiting ones to finish."""
        with self._guard:
            self._closing = True
        self._pool.shutdown(wait=True)
