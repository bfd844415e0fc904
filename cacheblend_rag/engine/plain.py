"""Prompts without chunks: a full prefill of the text as written, through the engine's own path.

Both framework integrations answer a prompt in which they find no chunk this way, so the answer
is what the unmodified model gives: the text (a chat rendered with the model's chat template) is
one non-reusable segment, prefilled by the engine's ``full_recompute`` mode and decoded as usual.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from cacheblend_rag.chat.prompt import PromptLayout, Segment, check_unicode
from cacheblend_rag.chat.template_text import Marks, control_tokens
from cacheblend_rag.decode.sampling import SamplingParams
from cacheblend_rag.engine.core import CacheBlendEngine, GenerationStream

log = logging.getLogger(__name__)


class ChatPrompt(str):
    """A chat rendered with the model's chat template that remembers which of its parts are the
    messages' text: :func:`plain_stream` tokenizes those with special-token strings as plain text
    (a ``<|im_end|>`` typed or pasted into a message cannot close its turn or open a forged
    system turn), and only the template's own parts with their control tokens. The same rule as
    chunk prompts (``cacheblend_rag.chat.prompt``)."""

    parts: tuple[tuple[str, bool], ...]
    """(text, is_message_text) in order; joined they are the string itself."""

    def __new__(cls, parts: Sequence[tuple[str, bool]]) -> ChatPrompt:
        self = super().__new__(cls, "".join(text for text, _ in parts))
        self.parts = tuple((text, content) for text, content in parts if text)
        return self


def _marker(i: int) -> str:
    return f"\x00CACHEBLEND_MESSAGE_{i}\x00"


def _render(tokenizer, msgs: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    kw: dict[str, Any] = {"tools": list(tools)} if tools else {}
    try:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)
    except Exception:  # noqa: BLE001 - a template that rejects the system role raises any type
        return tokenizer.apply_chat_template(_fold_system(msgs), tokenize=False, add_generation_prompt=True, **kw)


def _split_at_markers(rendered: str, contents: Sequence[str | None]) -> list[tuple[str, bool]] | None:
    """The template's text around each marker, with the messages' text in their place (None: a
    message rendered without a marker); None when the template does not place every marker
    exactly once and in order."""
    parts: list[tuple[str, bool]] = []
    rest = rendered
    for i, content in enumerate(contents):
        if content is None:
            continue
        head, sep, rest = rest.partition(_marker(i))
        if not sep or _marker(i) in rest:
            return None
        parts += [(head, False), (content, True)]
    parts.append((rest, False))
    return parts


def chat_text(tokenizer, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """``messages`` (role/content dicts; an assistant's may carry ``tool_calls``, a ``role: tool``
    result its ``name``) rendered with the tokenizer's chat template and ``tools``, ready for the
    assistant's turn, as a :class:`ChatPrompt`. Templates without a system role get the system
    text folded into the next user turn; a tokenizer without a template gets the contents joined
    by blank lines."""
    msgs = [dict(m) for m in messages]
    if not getattr(tokenizer, "chat_template", None):
        return ChatPrompt([("\n\n".join(m["content"] for m in msgs) + "\n", True)])
    rendered = _render(tokenizer, msgs, tools)
    marked = _marked(tokenizer, msgs, tools, rendered)
    if marked is not None:
        return marked
    # Rendered again with a marker in place of each message's text, to find where the template
    # put it. Templates that change the text (a trim) are rendered with the changed text in place.
    # An empty text stays empty (a template may leave out what an empty message would add).
    marked = _render(tokenizer, [dict(m, content=_marker(i)) if m["content"] else m for i, m in enumerate(msgs)], tools)
    for contents in ([m["content"] or None for m in msgs], [m["content"].strip() if m["content"] else None for m in msgs]):
        parts = _split_at_markers(marked, contents)
        if parts is not None and "".join(text for text, _ in parts) == rendered:
            return ChatPrompt(parts)
    parts = _split_at_markers(marked, [m["content"] or None for m in msgs])
    if parts is not None:
        # The template changes the text in a way not undone above: keep its layout, the text as given.
        return ChatPrompt(parts)
    log.warning(
        "the chat template does not place each message once: the chat is tokenized as rendered, "
        "so special-token strings inside messages act as control tokens"
    )
    return rendered


def _marked(tokenizer, msgs: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None, rendered: str) -> ChatPrompt | None:
    """The chat as a :class:`ChatPrompt` whose tools' and tool calls' strings holding a
    control-token string are text too (``template_text.py``); None when none does (the
    messages' contents alone are placed below, as always)."""
    marks = Marks(control_tokens(tokenizer))
    marks.check_keys(list(tools or ()), "the tools")
    marked_tools = marks.strings(list(tools)) if tools else tools
    calls = []
    for i, m in enumerate(msgs):
        if m.get("tool_calls"):
            marks.check_keys(m["tool_calls"], f"message {i}'s tool calls")
            m = dict(m, tool_calls=marks.strings(m["tool_calls"]))
        calls.append(m)
    if not marks.structured:
        return None
    marked = _render(tokenizer, [dict(m, content=marks.text(m["content"])) if m["content"] else m for m in calls], marked_tools)
    parts = marks.split(marked, rendered)
    if parts is None:
        raise marks.refusal("the tools or tool calls")
    return ChatPrompt(parts)


def _fold_system(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    pending: list[str] = []
    for m in msgs:
        if m["role"] == "system":
            pending.append(m["content"])
            continue
        if pending and m["role"] == "user":
            m = {"role": "user", "content": "\n\n".join(pending + [m["content"]])}
            pending = []
        out.append(m)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


def plain_stream(engine: CacheBlendEngine, text: str, params: SamplingParams) -> GenerationStream:
    """Stream the answer to ``text`` (already in the model's prompt format) with a full prefill.

    A :class:`ChatPrompt` (what :func:`chat_text` returns) has its messages' text tokenized as
    text; any other string is tokenized as written, special-token strings included.

    The stream's stats are the engine's ``full_recompute`` stats with no chunks.
    """
    t0 = time.perf_counter()
    if not text.strip():
        raise ValueError("the prompt is empty: nothing to answer")
    if isinstance(text, ChatPrompt):
        prompts = engine.prompts
        ids = tuple(t for part, content in text.parts for t in (prompts.encode_text(part) if content else prompts.encode(part)))
    else:
        # Text formatted by the caller (a LlamaIndex completion_to_prompt): taken as written.
        check_unicode([("the prompt", text)])
        ids = tuple(engine.tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(ids) + params.max_new_tokens > engine.context_window:
        raise ValueError(
            f"the prompt is {len(ids)} tokens plus {params.max_new_tokens} to generate, more than the "
            f"model's context window of {engine.context_window} tokens: shorten the prompt or lower "
            "max_new_tokens"
        )
    layout = PromptLayout((Segment(text, ids, reusable=False),))
    return GenerationStream(engine, layout, "full_recompute", engine.config, params, t0)
