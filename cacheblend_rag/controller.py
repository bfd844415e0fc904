"""Deprecated alias of :mod:`cacheblend_rag.control.controller` (the loading controller moved
into ``control/``); importing it warns. Removed in 0.4."""

import warnings

from cacheblend_rag.control.controller import LoadingController

warnings.warn(
    "cacheblend_rag.controller moved: import LoadingController from cacheblend_rag.control",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["LoadingController"]
