"""Why a model is not loaded: raised by ``models.load_model`` and refused by the adapter (``backbone``)."""

from __future__ import annotations

__all__ = ["ModelLoadError", "UnsupportedModelError"]


class ModelLoadError(ValueError):
    """The model could not be loaded; the message names the problem and how to fix it."""


class UnsupportedModelError(ModelLoadError):
    """The model loads but CacheBlend cannot drive it (e.g. no rotary position embeddings)."""
