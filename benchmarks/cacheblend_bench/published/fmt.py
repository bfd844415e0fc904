"""How the docs print a number: one place, so a table and the prose quoting it agree."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

MINUS = "\u2212"  # the docs' minus sign


def _nan(v: float | None) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def num(v: float | None, digits: int = 3, signed: bool = False) -> str:
    """``0.042``, ``+0.013`` or ``−0.026`` (the minus sign, never a hyphen); ``–`` when missing."""
    if _nan(v):
        return "–"
    text = format(v, f"{'+' if signed else ''}.{digits}f")
    return text.replace("-", MINUS)


def x(v: float | None, digits: int = 2) -> str:
    """A speed-up: ``4.36x``."""
    return "–" if _nan(v) else f"{v:.{digits}f}x"


def ci(interval: Sequence[float] | None, digits: int = 2, signed: bool = False, scale: float = 1.0) -> str:
    """A 95% interval: ``[4.22, 4.51]``; empty when missing."""
    if not interval or any(_nan(b) for b in interval):
        return ""
    return "[" + ", ".join(num(b * scale, digits, signed) for b in interval) + "]"


def x_ci(v: float | None, interval: Sequence[float] | None, digits: int = 2) -> str:
    """``4.36x [4.22, 4.51]``."""
    text = ci(interval, digits)
    return x(v, digits) + (f" {text}" if text else "")


def pct(v: float | None, digits: int = 0) -> str:
    """``44%``."""
    return "–" if _nan(v) else f"{100 * v:.{digits}f}%".replace("-", MINUS)


def pct_ci(v: float | None, interval: Sequence[float] | None) -> str:
    """``44% [38, 51]`` (percentage points)."""
    text = ci(interval, 0, scale=100.0)
    return pct(v) + (f" {text}" if text else "")


def sig(v: float | None, digits: int = 2) -> str:
    """Significant digits, for values spanning decades: ``3.4e-6``, ``0.042``."""
    return "–" if _nan(v) else re.sub(r"e([+-])0*(\d)", r"e\1\2", f"{v:.{digits}g}").replace("e+", "e")


def span(values: Sequence[float], fmt=num, sep: str = "-") -> str:
    """The range of several values in one format: ``0.03-0.05`` (one value when they round alike)."""
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}{sep}{hi}"


class Stat(NamedTuple):
    """A statistic with its 95% interval (a speed-up, a mean difference, a share)."""

    value: float
    ci: tuple[float, float] | None = None


SPEC = re.compile(r"(xci|x|ci|sfci|sf|fci|f|pctci|pct|g|d|s)(\d*)")


def render(value: Any, spec: str | None) -> str:
    """A value as the docs print it, by a short spec: ``x1`` 4.4x, ``x2`` 4.36x, ``xci2`` 4.36x
    [4.22, 4.51], ``ci1`` [4.2, 4.5], ``f3`` 0.042, ``sf3`` +0.013, ``sfci3`` −0.026 [−0.059,
    +0.006], ``fci2`` 0.63 [0.58, 0.69], ``pct`` 44%, ``pctci`` 44% [38, 51], ``g1`` 3e-6, ``d`` 18,
    ``s`` as is. A list is a range: its lowest and highest value in the spec, joined by a hyphen."""
    if isinstance(value, list):
        lo, hi = render(min(value), spec), render(max(value), spec)
        if lo == hi:
            return lo
        if lo[-1] in "x%" and lo[-1] == hi[-1]:  # 2.9-3.4x, 3-12%
            lo = lo[:-1]
        return f"{lo}-{hi}"
    m = SPEC.fullmatch(spec or "s")
    if not m:
        raise ValueError(f"number format {spec!r} is not one of x, xci, ci, f, sf, fci, sfci, pct, pctci, g, d, s (+ digits)")
    kind, digits = m.group(1), int(m.group(2)) if m.group(2) else None
    v, interval = (value.value, value.ci) if isinstance(value, Stat) else (value, None)
    if kind in ("xci", "ci", "sfci", "fci", "pctci") and interval is None:
        raise ValueError(f"format {spec!r} needs a value with an interval, got {value!r}")
    d = 2 if digits is None else digits
    out = {
        "x": lambda: x(v, d),
        "xci": lambda: x_ci(v, interval, d),
        "ci": lambda: ci(interval, d),
        "f": lambda: num(v, 3 if digits is None else d),
        "sf": lambda: num(v, 3 if digits is None else d, signed=True),
        "fci": lambda: f"{num(v, d)} {ci(interval, d)}",
        "sfci": lambda: (
            f"{num(v, 3 if digits is None else d, signed=True)} {ci(interval, 3 if digits is None else d, signed=True)}"
        ),
        "pct": lambda: pct(v, digits or 0),
        "pctci": lambda: pct_ci(v, interval),
        "g": lambda: sig(v, digits or 2),
        "d": lambda: f"{int(round(v)):,}",
        "s": lambda: str(v),
    }[kind]()
    return out
