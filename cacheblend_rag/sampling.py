"""Decoding settings by their user-facing names, turned into one :class:`~.config.SamplingParams`.

Owns the one place where the settings a caller writes (``max_new_tokens=64, stop="\\n"``) become
the ``SamplingParams`` decoding reads: :meth:`CacheBlendEngine.stream` and ``generate`` call
:func:`sampling_params` for their keyword arguments, and the serving layer's ``answer_settings``
(every front end: LangChain, LlamaIndex, the HTTP server, ``cacheblend-rag ask``) calls it too.
The names and defaults are ``SamplingParams``' own fields, written once, in ``config.py``.

Imports only ``config``: the core's lowest layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .config import SamplingParams

# The decoding settings' names, in SamplingParams' field order (its defaults are the documented ones).
SAMPLING_SETTINGS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SamplingParams))


def sampling_params(sampling: SamplingParams | None = None, **settings: Any) -> SamplingParams:
    """``sampling`` as it is, or a ``SamplingParams`` from ``settings`` (``SAMPLING_SETTINGS``'
    names; a setting not given takes its default). ``stop`` may be one string, a list of
    strings, or None (no stop string).

    Passing both, or a name that is not a decoding setting, raises ``TypeError`` naming it; a bad
    value raises in ``SamplingParams`` itself, naming the setting."""
    if sampling is not None:
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if settings:
            raise TypeError(
                f"pass the decoding settings either as one SamplingParams or as keyword arguments, not both "
                f"(got sampling and {', '.join(sorted(settings))})"
            )
        return sampling
    unknown = sorted(set(settings) - set(SAMPLING_SETTINGS))
    if unknown:
        raise TypeError(
            f"unknown decoding setting{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: "
            f"the settings are {', '.join(SAMPLING_SETTINGS)}"
        )
    if settings.get("stop", ()) is None:
        settings["stop"] = ()
    return SamplingParams(**settings)
