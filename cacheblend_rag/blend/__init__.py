"""Blending: a prompt's cached chunks fused into one prefill (CacheBlend, EuroSys '25, section 4).

* ``chunk_cache``: where chunk caches are computed (the instruction prefix's K/V, one chunk's
  prefill, ``precompute`` with or without neighbours, background write-back).
* ``planner``: prompt layout plus the store's contents -> which positions load, compute or reuse.
* ``selector``: which tokens are recomputed (question-guided picks; HKVD criteria).
* ``fusor``: the layer-by-layer selective recompute with an exact causal mask.
* ``guard``: the first-token margin and when a blended prefill is redone at a larger ratio.
* ``sources``: each chunk's share of the question's attention (``stats["chunk_attention"]``).
* ``self_test``: the load-time check that the fused path and a moved key reproduce the model.

May import: the top-level modules, ``store``, ``model``, ``decode``, ``chat`` and ``neighbours``.
"""
