"""The async bridge both integrations stream through."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cacheblend_rag.serving.aio import iterate_in_thread


def _steps(n: int, lock: threading.Lock, threads: list[str], closed: threading.Event):
    with lock:  # like a run holding the engine's lock while it decodes
        try:
            for i in range(n):
                threads.append(threading.current_thread().name)
                yield i
        finally:
            closed.set()


def test_items_come_from_a_worker_thread_in_order():
    lock, threads, closed = threading.Lock(), [], threading.Event()

    async def main():
        return [x async for x in iterate_in_thread(_steps(5, lock, threads, closed))]

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]
    assert closed.is_set() and not lock.locked()
    assert threads and all(name.startswith("cacheblend-aio") for name in threads)


def test_stopping_early_closes_the_iterator_and_releases_its_lock():
    lock, threads, closed = threading.Lock(), [], threading.Event()
    it = _steps(100, lock, threads, closed)  # kept referenced: only the bridge can close it

    async def main():
        agen = iterate_in_thread(it)
        seen = []
        async for x in agen:
            seen.append(x)
            if x == 2:
                break
        await agen.aclose()
        return seen

    assert asyncio.run(main()) == [0, 1, 2]
    assert closed.wait(5) and not lock.locked()


def test_errors_reach_the_consumer():
    def failing():
        yield 1
        raise RuntimeError("the model failed mid-answer")

    async def main():
        return [x async for x in iterate_in_thread(failing())]

    with pytest.raises(RuntimeError, match="the model failed mid-answer"):
        asyncio.run(main())
