"""Every number the docs publish, computed from the committed result files in ``docs/results``.

A page holds a generated table between ``<!-- table: NAME -->`` and ``<!-- /table -->`` and a
generated number in its prose between ``<!--n:NAME-->`` and ``<!--/n-->``;
``python -m cacheblend_bench.doc_tables`` rewrites both from :func:`registry`. Each table is drawn by the summary code of the benchmark that wrote its rows (one
renderer per kind of table), and carries a caption naming its files and the engine that made them
(:mod:`..provenance`). Speed-ups are ``stats.speedup`` throughout.
"""

from __future__ import annotations

import functools

from cacheblend_bench.published.results import Results, Table, Values

__all__ = ["Results", "Table", "Values", "registry"]


@functools.cache
def registry() -> tuple[dict[str, Table], dict[str, Values]]:
    """Every table by name and every group of numbers by prefix, from the page modules."""
    from cacheblend_bench.published import (  # late: they import .results
        bench_pages,
        engine_pages,
        quality_pages,
        readme_pages,
        storage_pages,
    )

    tables: dict[str, Table] = {}
    values: dict[str, Values] = {}
    for module in (bench_pages, quality_pages, engine_pages, storage_pages, readme_pages):
        tables.update(module.TABLES)
        values.update(module.VALUES)
    return tables, values
