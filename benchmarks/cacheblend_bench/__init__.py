"""``cacheblend-rag bench``: quality vs time-to-first-token of CacheBlend and its baselines.

Python API::

    from cacheblend_bench import BenchConfig, run_benchmark
    rows = run_benchmark(BenchConfig(n=10, datasets=("crosschunk",)))

See docs/benchmarks.md for the datasets, methods, metrics and measured results.
"""

from cacheblend_bench.runner import BenchConfig, run_benchmark

__all__ = ["BenchConfig", "run_benchmark"]
