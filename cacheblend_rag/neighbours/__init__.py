"""Neighbour-aware chunk caches: a chunk prefilled behind the chunks it is retrieved with.

* ``choice``: which chunks a cache is prefilled behind (``precompute(..., neighbours=n)``),
  chosen from the corpus by the bundled embedder.
* ``index``: a chunk's neighbour-aware caches and which one serves a prompt (best prefix match).
* ``coretrieval``, ``learned``: co-retrieval counts learned from the traffic, and the background
  refresh that caches chunks behind the chunks they come with (``engine.learn_neighbours()``).

May import: the top-level modules, ``store``, ``model`` and ``chat``.
"""

from cacheblend_rag.neighbours.choice import bundled_embedder, nearest

__all__ = ["bundled_embedder", "nearest"]
