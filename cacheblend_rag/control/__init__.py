"""Control: the recompute ratio and storage tier chosen per request from measured profiles.

* ``controller``: ``LoadingController``, the ratio and tier for a request (CacheBlend section 5).
* ``device_profile``, ``profiler``: what a device's prefill and loading cost, and the profiler
  that measures it (``cacheblend-rag profile``).
* ``calibration``: the recompute ratio from a model's calibrated quality profile.

May import: the top-level modules, ``store``, ``model``, ``decode`` and ``chat``.
"""

from cacheblend_rag.control.controller import LoadingController

__all__ = ["LoadingController"]
