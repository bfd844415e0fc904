"""``cacheblend-rag serve``: an OpenAI-compatible HTTP server over one CacheBlendEngine.

Needs the ``server`` extra (``pip install 'cacheblend-rag[server]'``: FastAPI and uvicorn).
User guide: docs/server.md.
"""

from .app import APIError, ServerConfig, create_app

__all__ = ["APIError", "ServerConfig", "create_app"]
