"""Decoding after the prefill: sampling settings, the token loop, its cache and constraints.

* ``sampling``: ``SamplingParams``, every decoding setting with its documented default.
* ``generation``: greedy and sampled decoding, streaming, stop strings.
* ``step``: one decoded token in few operations for Llama-pattern layers.
* ``cache``: the decode cache that grows in place instead of copying itself every token.
* ``constraints``: JSON schema, Lark grammar and regex masks (llguidance, the ``[structured]`` extra).

May import: the top-level modules, ``store`` and ``model``.
"""
