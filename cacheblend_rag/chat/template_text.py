"""A request's text inside what the chat template renders, kept as text: tool definitions (names,
descriptions, parameter schemas) and earlier tool calls' names and arguments.

The template writes these itself (Qwen2.5: ``{{ tool | tojson }}`` in the system turn, a call's
name and ``arguments | tojson`` in the assistant turn), so they come out inside template text,
which is tokenized with its control tokens: a ``<|im_end|>`` in a tool's description would close
the system turn. Messages' contents are kept as text by rendering markers in their place
(``plain.py``, ``prompt.py``); this module does the same for the strings inside structured
fields, wherever the template puts them and however it escapes them (raw, or JSON-escaped by
``tojson``).

Only strings that hold a control-token string are marked, so an ordinary request's prompt is
tokenized exactly as before. Where the template's rendering cannot be matched (a template that
changes the strings), the request is refused (``ValueError``) rather than tokenized with the
control tokens active. One rule, for the server and both integrations: every prompt with tools or
tool calls is built through ``prompt.PromptBuilder`` (requests over chunks) or ``plain.chat_text``
(plain chats).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Marks", "control_tokens"]


def control_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The strings ``tokenizer`` reads as control tokens in template text: its special tokens and
    the added tokens flagged special (``<|im_start|>`` is one of those, not always a named special
    token)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    names = [*getattr(tokenizer, "all_special_tokens", ()), *(t.content for t in added.values() if getattr(t, "special", False))]
    return tuple(dict.fromkeys(n for n in names if isinstance(n, str) and n))


class Marks:
    """Markers standing in for a request's strings while the template renders, and the rendering
    split back into template text and those strings (:meth:`split`)."""

    def __init__(self, specials: Sequence[str]) -> None:
        self.specials = tuple(specials)
        self._nonce = uuid.uuid4().hex[:12]
        # Letters and digits only: the same whether the template writes a string raw or through tojson.
        self._pattern = re.compile(f"CBTEXT{self._nonce}N([0-9]+)X")
        self._originals: list[str] = []
        self.structured = False
        """Whether a structured field's string (not a message's content) was marked."""

    def _mark(self, text: str) -> str:
        self._originals.append(text)
        return f"CBTEXT{self._nonce}N{len(self._originals) - 1}X"

    def holds_control(self, text: str) -> bool:
        return any(s in text for s in self.specials)

    def text(self, text: str) -> str:
        """The marker of a message's content (marked whatever it holds)."""
        return self._mark(text)

    def strings(self, value: Any) -> Any:
        """A copy of ``value`` (a tool list, a tool call) whose strings holding a control-token string
        are markers (keys are left alone: the template writes them, as a schema's property names,
        but a control token there is refused by :meth:`check_keys`)."""
        if isinstance(value, str):
            if self.holds_control(value):
                self.structured = True
                return self._mark(value)
            return value
        if isinstance(value, Mapping):
            return {k: self.strings(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.strings(v) for v in value]
        return value

    def check_keys(self, value: Any, what: str) -> None:
        """Refuse a key holding a control-token string (a property's name): keys are the
        template's to write and cannot be marked."""
        stack = [value]
        while stack:
            item = stack.pop()
            if isinstance(item, Mapping):
                for k, v in item.items():
                    if isinstance(k, str) and self.holds_control(k):
                        bad = next(s for s in self.specials if s in k)
                        raise ValueError(
                            f"{what}: the key {k[:64]!r} contains the control token {bad!r}, which the chat "
                            "template would render as that token; rename it"
                        )
                    stack.append(v)
            elif isinstance(item, (list, tuple)):
                stack.extend(item)

    def found(self, text: str) -> bool:
        """Whether ``text`` holds a marker (the template put a marked string there)."""
        return self._pattern.search(text) is not None

    def split(self, marked: str, real: str) -> list[tuple[str, bool]] | None:
        """``real`` (the template's rendering) as (text, is_request_text) parts, found from
        ``marked`` (the same rendering with markers): each marker stands for its string as the
        template wrote it (raw, JSON-escaped, or trimmed). None when ``real`` is not ``marked``
        with the strings in place."""
        parts: list[tuple[str, bool]] = []
        pos = last = 0
        for m in self._pattern.finditer(marked):
            piece = marked[last : m.start()]
            if not real.startswith(piece, pos):
                return None
            parts.append((piece, False))
            pos += len(piece)
            original = self._originals[int(m.group(1))]
            for form in dict.fromkeys((json.dumps(original, ensure_ascii=False)[1:-1], original, original.strip())):
                if real.startswith(form, pos):
                    break
            else:
                return None
            parts.append((form, True))
            pos += len(form)
            last = m.end()
        if real[pos:] != marked[last:]:
            return None
        parts.append((marked[last:], False))
        return [(text, is_text) for text, is_text in parts if text]

    def refusal(self, what: str) -> ValueError:
        """The error for strings the template changes, so they cannot be kept as text."""
        return ValueError(
            f"{what} contain a control-token string ({', '.join(repr(s) for s in self.specials[:4])}, ...) and the "
            "chat template changes them as it renders them, so they cannot be kept as text: remove it"
        )
