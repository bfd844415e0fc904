"""``cacheblend-rag serve`` itself (``cli.main``), in a process of its own, over the tiny test
model: ``CacheBlendEngine.from_pretrained`` builds the tiny tool-template engine (seed 0) over the
``--store-dir`` instead of loading a model; everything else (flags, ServerConfig, uvicorn.run in
the main thread with its signal handling) is the command's own.

    python serve_cli_tiny.py serve --port 0 --store-dir DIR [serve flags...]

uvicorn logs "Uvicorn running on http://127.0.0.1:<port>" on stderr once it listens.
"""

from __future__ import annotations

import sys

from cacheblend_rag.cli import app as cli
from cacheblend_rag.engine.core import CacheBlendEngine
from cacheblend_rag.testing import make_engine


def _tiny(cls, model=None, *, store_dir=None, **_kwargs):
    return make_engine("llama", tools=True, seed=0, store_dir=store_dir, pipelined=False)


if __name__ == "__main__":
    CacheBlendEngine.from_pretrained = classmethod(_tiny)  # type: ignore[method-assign]
    sys.exit(cli.main(sys.argv[1:]))
