"""How large a structured value in a request may be: a JSON schema (``response_format``, a tool's
``parameters``) or a tool call's arguments.

Every grammar step after this one (closing objects, compiling, masking) does work that grows with
the schema's size and nesting, and Python's own JSON encoder and decoder recurse: a value nested
thousands deep raises ``RecursionError`` wherever it is read. So a value is measured here first,
without recursion, and refused with a ``ValueError`` naming the limit it passed. The same limits
hold for the HTTP server and both framework integrations (``constraints.py`` and ``tools.py``
check every schema and argument value they take).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["MAX_JSON_CHARS", "MAX_JSON_DEPTH", "MAX_JSON_NODES", "ValueTooLarge", "check_json", "parse_json"]

MAX_JSON_DEPTH = 32
"""Objects and arrays nested in one value (a schema's object property is two: the property's
schema and its ``properties``). Depth 22 took 53 s to close before the check was linear."""
MAX_JSON_NODES = 10_000
"""Values (objects, arrays, strings, numbers, ...) in one value, keys not counted."""
MAX_JSON_CHARS = 100_000
"""Characters of all the strings in one value, keys included."""


class ValueTooLarge(ValueError):
    """A request's value passed a limit of this module; ``limit`` names it."""

    def __init__(self, message: str, limit: str):
        super().__init__(message)
        self.limit = limit


def check_json(
    value: Any,
    what: str,
    *,
    max_depth: int = MAX_JSON_DEPTH,
    max_nodes: int = MAX_JSON_NODES,
    max_chars: int = MAX_JSON_CHARS,
) -> None:
    """Raise :class:`ValueTooLarge` if ``value`` (``what``: how the message names it) nests more
    than ``max_depth`` objects and arrays, holds more than ``max_nodes`` values or more than
    ``max_chars`` characters of strings. Stops at the first limit passed, so the work is bounded
    by the limits, not by the value."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    nodes = chars = 0
    while stack:
        item, depth = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise ValueTooLarge(
                f"{what}: more than {max_nodes} values, over the limit (max_json_nodes, "
                "cacheblend_rag.bounds.MAX_JSON_NODES): send a smaller schema",
                "max_json_nodes",
            )
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, Mapping) or isinstance(item, (list, tuple)):
            if depth > max_depth:
                raise ValueTooLarge(
                    f"{what}: objects and arrays nested more than {max_depth} deep, over the limit (max_json_depth, "
                    "cacheblend_rag.bounds.MAX_JSON_DEPTH): flatten it",
                    "max_json_depth",
                )
            if nodes + len(item) > max_nodes:  # before walking them: a wide object is refused at once
                raise ValueTooLarge(
                    f"{what}: more than {max_nodes} values, over the limit (max_json_nodes, "
                    "cacheblend_rag.bounds.MAX_JSON_NODES): send a smaller schema",
                    "max_json_nodes",
                )
            if isinstance(item, Mapping):
                chars += sum(len(k) for k in item if isinstance(k, str))
                stack.extend((v, depth + 1) for v in item.values())
            else:
                stack.extend((v, depth + 1) for v in item)
        if chars > max_chars:
            raise ValueTooLarge(
                f"{what}: more than {max_chars} characters of text, over the limit (max_json_chars, "
                "cacheblend_rag.bounds.MAX_JSON_CHARS): shorten its descriptions",
                "max_json_chars",
            )


def parse_json(text: str, what: str) -> Any:
    """``text`` parsed as JSON and checked with :func:`check_json`. Malformed JSON, and JSON nested
    deeper than the decoder recurses (a ``RecursionError`` otherwise), raise ``ValueError``.
    ``text`` is the caller's to bound: parsing is linear in its length."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ValueTooLarge(
            f"{what}: objects and arrays nested more than {MAX_JSON_DEPTH} deep, over the limit (max_json_depth, "
            "cacheblend_rag.bounds.MAX_JSON_DEPTH): flatten it",
            "max_json_depth",
        ) from None
    check_json(value, what)
    return value
