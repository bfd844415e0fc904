"""Helper threads that touch tensors without slowing the thread that runs the model.

torch parallelises CPU operators with OpenMP, and GNU OpenMP gives every thread that starts a
parallel region a team of its own that lives as long as that thread. Once two teams exist and
their threads outnumber the cores, every team waits for its workers by sleeping instead of
spinning, and each parallel operator then pays a wake-up: on a 2-core machine a small operator
took 3.6-4.6x as long once the write-back thread had copied one prompt's K/V, and every later fused
prefill and decode step slowed with it (docs/benchmarks.md, "One team of threads";
``python -m cacheblend_bench.threads``). A helper that only copies or reads tensors gains
nothing from a team, so it runs single-threaded and creates none.

The same holds between threads that run the model: the batcher's thread, the server's worker
or an async step is slowed as much by the team of the thread that loaded the model and
precomputed the chunks, and that thread in turn by theirs. So one thread at a time keeps a team:
a thread that hands the model over, and a model thread that goes idle, releases its own
(:func:`release_team`); it gets a new one the next time it runs a parallel operator.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any

import torch

# The OpenMP runtimes torch ships or links against (GNU on Linux wheels, Intel or LLVM elsewhere).
_OPENMP_RUNTIMES = ("libgomp.so.1", "libiomp5.so", "libomp.so", "libomp.dylib", "libiomp5.dylib")


@lru_cache(maxsize=1)
def _openmp() -> Any:
    """The OpenMP runtime already loaded by torch, or None."""
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1)
    for name in _OPENMP_RUNTIMES:
        try:
            return ctypes.CDLL(name, mode=mode)
        except OSError:
            continue
    return None


def single_threaded() -> None:
    """Run torch's operators on the calling thread without an OpenMP team.

    ``torch.set_num_threads(1)`` would do it, but it also changes the process-wide count that every
    thread started later takes over (a batcher or server thread would then run single-threaded).
    So torch first sets this thread up from the process-wide count, and then only this thread's
    OpenMP setting is lowered.
    """
    torch.get_num_threads()  # torch's per-thread set-up, from the process-wide count
    omp = _openmp()
    if omp is not None:
        omp.omp_set_num_threads(1)


def release_team() -> None:
    """End the calling thread's OpenMP team, so that a thread this one hands the model to is the
    only one with a team (a small operator there: 70-100 us with the caller's team alive, 20 us
    without; ``python -m cacheblend_bench.threads``).

    ``omp_pause_resource_all(omp_pause_soft)`` (OpenMP 5.0) frees the caller's idle worker threads
    and nothing else; a team running on another thread is untouched. Costs nothing when the caller
    has no team.
    """
    omp = _openmp()
    if omp is not None and hasattr(omp, "omp_pause_resource_all"):
        omp.omp_pause_resource_all(1)  # 1: omp_pause_soft


def helper_pool(name: str, workers: int = 1) -> ThreadPoolExecutor:
    """A thread pool for tensor side work (write-backs, store reads) that creates no OpenMP team."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=single_threaded)
