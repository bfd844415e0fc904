"""``cacheblend-rag serve``: an OpenAI-compatible HTTP server over one CacheBlendEngine.

Needs the ``server`` extra (``pip install 'cacheblend-rag[server]'``: FastAPI and uvicorn).
User guide: docs/server.md.

May import: ``serving`` and every folder below it; never ``cluster`` or ``cli``.
"""

from cacheblend_rag.server.app import APIError, ServerConfig, create_app

__all__ = ["APIError", "ServerConfig", "create_app"]
