"""The ``cacheblend-rag`` command line: ``ask``, ``serve``, ``ingest``, ``store`` and the commands
other packages plug in through the ``cacheblend_rag.commands`` entry points (the benchmarks').

* ``app``: the parser, ``serve`` and ``main``; ``ask``: answering over files; ``warm``: ``ask
  --keep-alive``'s process that keeps the model loaded; ``flags``: the flags the commands share
  and the engine they name; ``ingest``: a corpus's chunk caches;
  ``store``: ``store stats`` / ``drop``; ``paths``: data files from a flag or an environment variable.

May import: everything in the package.
"""

from cacheblend_rag.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
