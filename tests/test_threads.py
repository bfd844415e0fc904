"""Only the thread that runs the model keeps an OpenMP team (cacheblend_rag.threads): helper
threads start none, and a thread that hands the model over releases its own."""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cacheblend_rag.serving import Batcher
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_engine
from cacheblend_rag.threads import helper_pool, release_team

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2,
    reason="counts the process's OS threads (Linux) and needs torch running on 2+ threads",
)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _copy() -> None:
    # Large enough for torch to split the copy across its threads (grain size 32k elements).
    torch.randn(3, 3000, 512)[:, 100:2900].contiguous()


def _threads_added_by(pool: ThreadPoolExecutor) -> int:
    _copy()  # this thread's own team exists before counting
    before = _threads()
    with pool:
        pool.submit(_copy).result()
        added = _threads() - before
    return added


def test_plain_pool_thread_starts_a_team():
    # The control: a default worker thread that copies a large tensor brings its own OpenMP worker.
    assert _threads_added_by(ThreadPoolExecutor(1)) >= 2


def test_helper_pool_adds_only_its_own_thread():
    assert _threads_added_by(helper_pool("test-helper")) == 1


def test_helper_thread_count_is_thread_local():
    n = torch.get_num_threads()
    with helper_pool("test-helper") as pool:
        assert pool.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == n
    # A thread started afterwards (a batcher, a server worker) still gets the process-wide count.
    with ThreadPoolExecutor(1) as later:
        assert later.submit(torch.get_num_threads).result() == n


def _on_new_thread(fn):
    """``fn()`` run on a fresh thread (no OpenMP team yet), its result returned."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


def test_release_team_ends_the_callers_workers_only():
    workers = torch.get_num_threads() - 1

    def run() -> tuple[int, int, int]:
        _copy()
        with_team = _threads()
        release_team()
        released = _threads()
        release_team()  # nothing left to free
        again = _threads()
        _copy()  # a parallel operator afterwards brings a new team
        return with_team - released, released - again, _threads() - released

    assert _on_new_thread(run) == (workers, 0, workers)


def test_batcher_leaves_only_its_worker_with_a_team(monkeypatch, tmp_path):
    # The thread that loaded the model (it ran torch) creates the batcher and submits to it; its
    # team would slow every operator on the batcher's thread, so both calls release it.
    import threading

    from cacheblend_rag.serving import batcher as batching

    workers = torch.get_num_threads() - 1
    worker_idle = threading.Semaphore(0)

    def release_and_count() -> None:
        release_team()
        if threading.current_thread().name == "cacheblend-batcher":
            worker_idle.release()

    # The worker releases its own team when it goes idle after the answer; counting the process's
    # threads before it has done so would credit its workers to the caller.
    monkeypatch.setattr(batching, "release_team", release_and_count)

    def run() -> tuple[int, int]:
        engine = make_engine(store_dir=str(tmp_path))
        engine.precompute(SAMPLE_CHUNKS, progress=False)
        _copy()
        with_team = _threads()
        with Batcher(engine) as batcher:
            assert worker_idle.acquire(timeout=30)  # idle before the request
            after_create = _threads()  # the caller's workers gone, the batcher's thread started
            _copy()
            batcher.submit(SAMPLE_QUESTION, SAMPLE_CHUNKS, max_new_tokens=3).result(timeout=120)
            assert worker_idle.acquire(timeout=30)  # idle again after it
            before = _threads()
            release_team()
            left_by_submit = before - _threads()
        engine.close()
        return with_team - after_create, left_by_submit

    assert _on_new_thread(run) == (workers - 1, 0)


@pytest.mark.parametrize("hand_over", ["aio", "server worker"])
def test_async_hand_overs_release_the_loops_team(hand_over, tmp_path):
    # The event loop's thread ran torch (it loaded the model); stepping the model on a worker
    # thread (the async wrappers, the HTTP server's batcher) first releases the loop's team.
    import asyncio

    from cacheblend_rag.server.worker import EngineWorker
    from cacheblend_rag.serving.aio import iterate_in_thread

    def produce():
        yield 1

    async def serve(worker: "EngineWorker | None") -> None:
        if worker is None:
            assert [i async for i in iterate_in_thread(produce())] == [1]
        else:
            assert [i async for i in worker.submit(produce)] == [1]
            worker.close()

    def run() -> tuple[int, int]:
        engine = make_engine(store_dir=str(tmp_path))
        # Created before the loop's thread runs torch again, so only submit() can release that team.
        worker = EngineWorker(engine) if hand_over == "server worker" else None
        _copy()
        before = _threads()
        release_team()
        control = before - _threads()
        _copy()
        asyncio.run(serve(worker))
        before = _threads()
        release_team()
        engine.close()
        return control, before - _threads()

    assert _on_new_thread(run) == (torch.get_num_threads() - 1, 0)


def test_model_threads_release_their_team_when_idle(monkeypatch, tmp_path):
    # A thread that has run the model and waits for more work keeps no team, so a thread that runs
    # torch meanwhile (the main thread answering in process, say) is the only one with a team.
    import asyncio
    import threading
    import time

    from cacheblend_rag.server import worker as server_worker
    from cacheblend_rag.serving import batcher as batching

    released: list[str] = []

    def record() -> None:
        released.append(threading.current_thread().name)

    monkeypatch.setattr(batching, "release_team", record)
    monkeypatch.setattr(server_worker, "release_team", record)

    engine = make_engine(store_dir=str(tmp_path))
    with Batcher(engine) as batcher:
        batcher.submit(SAMPLE_QUESTION, SAMPLE_CHUNKS, max_new_tokens=3).result(timeout=120)
        deadline = time.monotonic() + 30
        while released.count("cacheblend-batcher") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # idle before the request and again after it
    assert released.count("cacheblend-batcher") >= 2
    assert released.count(threading.current_thread().name) == 2  # creating the batcher, submitting

    def produce():
        yield 1

    async def serve() -> None:
        worker = server_worker.EngineWorker(engine)
        released.clear()
        assert [i async for i in worker.submit(produce)] == [1]
        worker.close()

    asyncio.run(serve())
    engine.close()
    # The event loop's thread as it hands a request over, and the request's relay thread once it
    # has built the request (the server's batcher runs the model).
    names = [name.split("_")[0] for name in released]
    assert names[0] == "MainThread" and "cacheblend-serve" in names


def test_bench_threads_reports_every_case(capsys):
    from cacheblend_bench.threads import CASES, main

    main(["--repeats", "1", "--ops", "20"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0].strip() for line in lines] == list(CASES)
