"""Helper threads must not start an OpenMP team of their own (cacheblend_rag.threads)."""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cacheblend_rag.threads import helper_pool

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


def test_bench_threads_reports_both_kinds(capsys):
    from cacheblend_rag.bench.threads import main

    main(["--repeats", "1", "--ops", "20"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0].split()[-1] for line in lines] == ["ThreadPoolExecutor", "helper_pool"]
