"""Beyond one process: engine replicas on Ray Serve sharing one Redis tier, with chunk-affinity
routing (docs/cluster.md). Needs the ``ray`` extra: ``pip install 'cacheblend-rag[ray]'``.

``build_app`` / ``app_builder`` (the Serve application) need Ray; the routing policy
(``affinity``) and request parsing (``documents``) do not.

May import: ``server`` (its app, called in-process), ``serving`` and every folder below them;
never ``cli``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ClusterOptions", "EngineSpec", "app_builder", "build_app"]


def __getattr__(name: str) -> Any:
    # Ray is imported only when the Serve application is asked for.
    if name in __all__:
        try:
            from cacheblend_rag.cluster import deployment
        except ImportError as exc:
            raise ImportError(
                f"cacheblend_rag.cluster.{name} needs Ray Serve ({exc.name} is missing): pip install 'cacheblend-rag[ray]'"
            ) from exc
        return getattr(deployment, name)
    raise AttributeError(f"module 'cacheblend_rag.cluster' has no attribute {name!r}")
