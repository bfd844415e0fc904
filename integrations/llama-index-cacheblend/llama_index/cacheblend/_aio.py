"""Run the engine's blocking calls off the event loop."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Iterator, TypeVar

T = TypeVar("T")
_DONE = object()


async def iterate_in_thread(it: Iterator[T]) -> AsyncIterator[T]:
    """Async view of a blocking iterator: each ``next`` (a prefill or a decode step) runs in a
    worker thread so other coroutines keep running while the model computes."""
    while True:
        item = await asyncio.to_thread(next, it, _DONE)
        if item is _DONE:
            return
        yield item  # type: ignore[misc]
