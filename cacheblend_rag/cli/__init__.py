"""The ``cacheblend-rag`` command line: ``ask``, ``serve``, ``ingest``, ``store`` and the commands
other packages plug in through the ``cacheblend_rag.commands`` entry points (the benchmarks').

* ``app``: the parser, ``ask`` and ``serve``; ``ingest``: a corpus's chunk caches;
  ``store``: ``store stats`` / ``drop``; ``paths``: data files from a flag or an environment variable.

May import: everything in the package.
"""

from cacheblend_rag.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
