"""Async view of the engine's blocking iterators, shared by the framework integrations."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from cacheblend_rag.threads import release_team

T = TypeVar("T")
_DONE = object()


async def iterate_in_thread(it: Iterator[T]) -> AsyncIterator[T]:
    """Yield ``it``'s items on the event loop; each ``next`` (a prefill or a decode step) runs in a
    worker thread, so other coroutines keep running while the model computes.

    One worker thread per iteration runs the steps in order. When the consumer stops early
    (``break``, cancellation, ``aclose``), ``it.close()`` is queued on that thread behind any step
    still running, so a generator holding the engine's lock releases it as soon as it can.
    """
    loop = asyncio.get_running_loop()
    release_team()  # the loop's OpenMP team (if it ran torch) would slow every step on the worker
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cacheblend-aio")
    try:
        while True:
            item = await loop.run_in_executor(pool, next, it, _DONE)
            if item is _DONE:
                return
            yield item  # type: ignore[misc]
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            pool.submit(close)
        pool.shutdown(wait=False)
