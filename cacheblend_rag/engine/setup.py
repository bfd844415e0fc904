"""Loading an engine, and what it was loaded with.

Owns :func:`open_pretrained`, the work behind ``CacheBlendEngine.from_pretrained`` (the model and
its tokenizer in their weight format, the chunk store's tiers, a calibrated quality profile), the
check of a ``BlendConfig`` argument, and :func:`answer_settings`: the plain values besides the
request that decide an engine's answers (what LangChain's LLM cache keys on).

Imports the model loader, the store's tiers and the calibration profile; never the engine module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from cacheblend_rag.config import BlendConfig

if TYPE_CHECKING:
    from cacheblend_rag.model.loading import LoadedModel
    from cacheblend_rag.store.protocol import ChunkStore
    from cacheblend_rag.store.spec import StoreSpec

log = logging.getLogger(__name__)


def open_pretrained(
    model: str | None,
    *,
    device: str | torch.device,
    dtype: torch.dtype | str,
    weights: str,
    cache_dir: str | None,
    store_dir: str | None,
    store_size_limit: int,
    memory_bytes: int,
    store: StoreSpec | Sequence[StoreSpec] | None,
    kv_format: str | None,
) -> tuple[LoadedModel, ChunkStore]:
    """``model`` loaded (``models.load_model``) and its chunk store opened (``store.spec.open_store``);
    the arguments as for ``CacheBlendEngine.from_pretrained``."""
    from cacheblend_rag.model.loading import default_cache_dir, load_model
    from cacheblend_rag.store.spec import open_store

    loaded = load_model(model, device=device, dtype=dtype, cache_dir=cache_dir, weights=weights)
    home = default_cache_dir() if cache_dir is None else cache_dir
    opened = open_store(
        store,
        directory=store_dir or f"{home}/kv",
        size_limit=store_size_limit,
        fingerprint=loaded.fingerprint,
        memory_bytes=memory_bytes,
        kv_format=kv_format,
    )
    return loaded, opened


def cache_home(cache_dir: str | None) -> str:
    """The cache home ``from_pretrained`` keeps converted models and passed load checks in."""
    from cacheblend_rag.model.loading import default_cache_dir

    return str(default_cache_dir() if cache_dir is None else cache_dir)


def calibrated_config(fingerprint: str) -> BlendConfig | None:
    from cacheblend_rag.control.calibration import QualityProfile, quality_profile_path

    path = quality_profile_path(fingerprint)
    if not path.is_file():
        return None
    try:
        profile = QualityProfile.load(path)
    except (OSError, ValueError, TypeError) as exc:
        log.warning("ignoring the unreadable quality profile %s (%s); rerun `cacheblend-rag calibrate`", path, exc)
        return None
    log.info("using the calibrated %s strategy at recompute_ratio=%.3g from %s", profile.strategy, profile.recompute_ratio, path)
    return profile.config()


def check_config(config: object) -> BlendConfig | None:
    if config is not None and not isinstance(config, BlendConfig):
        raise TypeError(
            f"config must be a BlendConfig, got {type(config).__name__}: build one with cacheblend_rag.BlendConfig(**options)"
        )
    return config


def answer_settings(engine: Any) -> dict[str, Any]:
    """What, besides the request itself, decides ``engine``'s answers (``CacheBlendEngine.answer_settings``)."""
    config = {name: _callable_name(v) if callable(v) else v for name, v in vars(engine.config).items()}
    return {
        "fingerprint": engine.fingerprint,
        "instruction": engine.prompts.instruction,
        "answer_hint": engine.prompts.answer_hint,
        "config": config,
        # With a controller, a request without a ratio gets one chosen from the load speed.
        "controller": type(engine.controller).__name__ if engine.controller is not None else None,
    }


def _callable_name(fn: Callable) -> str:
    """A custom criterion by its import path (an object repr would hold a per-process address)."""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
