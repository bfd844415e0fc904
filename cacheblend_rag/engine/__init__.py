"""The engine: ``CacheBlendEngine``, the façade over loading, chunk caches, prefill and decoding.

* ``core``: ``CacheBlendEngine`` (``from_pretrained``, ``precompute``, ``prefill``, ``stream``/``generate``).
* ``setup``: what ``from_pretrained`` assembles (model, store, calibrated configuration).
* ``prefill``: the prefill modes (``config.MODES``), the lost-chunk retry, the guard and its stats.
* ``stream``: ``GenerationStream`` (text deltas) and ``GenerationResult``.
* ``plain``: prompts without chunks, a full prefill of the text as written.

May import: every folder below it (``store``, ``model``, ``decode``, ``chat``, ``neighbours``,
``blend``, ``control``) and the top-level modules; never ``serving``, ``server``, ``cluster``,
``cli`` or the benchmarks.
"""

from cacheblend_rag.engine.core import CacheBlendEngine, GenerationResult, PrefillResult

__all__ = ["CacheBlendEngine", "GenerationResult", "PrefillResult"]
