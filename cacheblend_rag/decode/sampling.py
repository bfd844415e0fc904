"""Decoding settings: :class:`SamplingParams`, and the one place their user-facing names become one.

Owns the one place where the settings a caller writes (``max_new_tokens=64, stop="\\n"``) become
the ``SamplingParams`` decoding reads: :meth:`CacheBlendEngine.stream` and ``generate`` call
:func:`sampling_params` for their keyword arguments, and the serving layer's ``request_settings``
(every front end: LangChain, LlamaIndex, the HTTP server, ``cacheblend-rag ask``) calls it too.
The names and defaults are ``SamplingParams``' own fields, written once, here.

Imports only ``constraints`` (a grammar is a decoding setting).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cacheblend_rag.decode.constraints import Grammar


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings. temperature=0 is greedy (the benchmark default)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: Sequence[str] = field(default_factory=tuple)
    seed: int | None = None
    # Decode past end-of-sequence until max_new_tokens or a stop string: answers of equal length,
    # for benchmarks that time a given number of tokens (vLLM's name for it).
    ignore_eos: bool = False
    # Constrained decoding (constraints.Grammar): each token is chosen among those that keep the
    # answer inside the grammar, and the answer ends where the grammar does. None: unconstrained.
    constraint: Grammar | None = None

    def __post_init__(self) -> None:
        if self.constraint is not None and not isinstance(self.constraint, Grammar):
            raise TypeError(
                f"constraint must be a cacheblend_rag.decode.constraints.Grammar or None, got {type(self.constraint).__name__}: "
                "build one with Grammar.json_schema(schema)"
            )
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be True or False, got {type(self.ignore_eos).__name__} {self.ignore_eos!r}")
        for name in ("max_new_tokens", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise TypeError(f"seed must be an int or None, got {type(self.seed).__name__} {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            # torch.Generator.manual_seed takes a 64-bit value and fails with a bare "Overflow".
            raise ValueError(f"seed={self.seed} does not fit in 64 bits: pass a seed in [-2**63, 2**64)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables top-k sampling)")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            # NaN compares false everywhere (it decoded greedily); inf gave uniform random text.
            raise ValueError(f"temperature={self.temperature} must be a finite number >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


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
