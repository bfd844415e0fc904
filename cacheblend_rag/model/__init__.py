"""The model: loading it, adapting its layers, its weight formats and attention function.

* ``loading``: ``load_model`` from a directory, a ``.gguf`` file (converted once into a
  safetensors cache) or a hub id already on disk; why a model is refused (``errors``).
* ``backbone``: the only code that touches a model's layers, rotary embedding and scales: its
  layer count, K/V shape, context window; refuses at load what it cannot run exactly.
* ``attention``: the registered attention function (SDPA plus the question-attention probe and
  APE reweighting).
* ``weights``: weight formats chosen at load (float16 linear weights on a CPU by default);
  ``dtypes``: the dtypes ``load_model`` accepts.
* ``fingerprint``: what names a model's chunk caches, so no other model reads them;
  ``load_cache``: what a later load does not redo (a directory's fingerprint, the load-time
  checks that passed).

May import: the top-level modules (``config``, ``errors``, ``rope``, ...) and ``store``.
"""
