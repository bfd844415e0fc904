"""Deprecated alias of :mod:`cacheblend_bench`: the benchmarks are their own distribution,
``cacheblend-rag-bench`` (``pip install -e benchmarks`` from the repository; ``install.sh`` does).
``cacheblend_rag.bench`` and its submodules (``cacheblend_rag.bench.qwen``, ...) still import,
with a warning. Removed in 0.4."""

import warnings

try:
    import cacheblend_bench
except ImportError as exc:  # the benchmarks are not installed
    raise ImportError(
        "cacheblend_rag.bench moved to the cacheblend-rag-bench distribution: install it with "
        "'pip install -e benchmarks' from the repository, then import cacheblend_bench"
    ) from exc
from cacheblend_bench import BenchConfig, run_benchmark

warnings.warn(
    "cacheblend_rag.bench moved: import cacheblend_bench (the cacheblend-rag-bench distribution)",
    DeprecationWarning,
    stacklevel=2,
)

# A module with __path__ is a package to the import system: cacheblend_rag.bench.<name> finds
# cacheblend_bench's submodules.
__path__ = list(cacheblend_bench.__path__)
__all__ = ["BenchConfig", "run_benchmark"]
