"""Chat messages that carry retrieved chunks: split them into the engine's chunks and question.

A message is a role ("system", "user" or "assistant") and a content: a string, or a list of
content parts. A part is a string or a ``{"type": "text", "text": ...}`` dict; a text part whose
``extras`` hold ``{"cacheblend_chunk": true}`` (:func:`chunk_part`) is one retrieved chunk. The
same shape serves LangChain's content blocks and OpenAI's chat content parts, so a message built
with ``langchain_cacheblend.rag_message`` reaches the HTTP server through ``ChatOpenAI`` unchanged.

Everything that is not a chunk is the question: the messages' remaining text in order, joined by
blank lines, with assistant turns prefixed "Assistant: " (the engine builds its own prompt:
instruction, "Documents:" + chunks, "Question: ...").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cacheblend_rag.chat.matching import ChunkRegistry

CHUNK_FLAG = "cacheblend_chunk"
ROLES = ("system", "user", "assistant")


def chunk_part(text: str, metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A content part that carries one retrieved chunk (its metadata travels in ``extras``)."""
    return {"type": "text", "text": text, "extras": {CHUNK_FLAG: True, "metadata": dict(metadata or {})}}


def is_chunk_part(part: object) -> bool:
    return (
        isinstance(part, Mapping)
        and part.get("type") == "text"
        and isinstance(part.get("extras"), Mapping)
        and bool(part["extras"].get(CHUNK_FLAG))
    )


def part_text(part: object) -> str:
    """The text of a plain string or ``type: text`` part; other part types, and a text part
    whose ``text`` is missing or not a string, are refused (``str()`` of it turned a null into
    the document "None")."""
    if isinstance(part, str):
        return part
    if isinstance(part, Mapping) and part.get("type") == "text":
        text = part.get("text")
        if not isinstance(text, str):
            what = "has no text" if text is None else f"has a text of type {type(text).__name__}"
            raise ValueError(f"a content part of type 'text' {what}: give its text as a string")
        return text
    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
    raise ValueError(f"content part of type {kind!r} is not supported: CacheBlend models read text only")


def has_chunk_parts(contents: Sequence[object]) -> bool:
    """Whether any message content (a string or a list of parts) holds a flagged chunk part."""
    return any(isinstance(c, list) and any(map(is_chunk_part, c)) for c in contents)


@dataclass(frozen=True)
class SplitMessages:
    """Messages split into chunks and the text around them."""

    chunks: tuple[str, ...]
    question: str
    """The non-chunk text, as the engine's question turn."""
    messages: tuple[dict[str, str], ...]
    """Role/content dicts without the chunk parts: the plain-chat prompt when there are no chunks."""
    explicit: bool
    """True when the chunks came from flagged parts, False when the registry found them (or none)."""


def split_messages(
    messages: Sequence[tuple[str, str | Sequence[object]]], registry: ChunkRegistry | None = None
) -> SplitMessages:
    """Split ``(role, content)`` pairs. Flagged chunk parts win; only when there are none does
    ``registry`` (if given) look for known chunk texts verbatim inside the messages' text."""
    explicit = has_chunk_parts([content for _, content in messages])
    finder = None if explicit else registry
    chunks: list[str] = []
    rest: list[str] = []
    plain: list[dict[str, str]] = []
    for role, content in messages:
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not supported: CacheBlend models take {', '.join(ROLES)} messages")
        text_parts: list[str] = []
        for part in content if isinstance(content, list) else [content]:
            if is_chunk_part(part):
                chunks.append(part_text(part))
            else:
                text_parts.append(part_text(part))
        text = "".join(text_parts)
        plain.append({"role": role, "content": text})
        if finder is not None:
            match = finder.match(text)
            chunks.extend(match.chunks)
            text = match.remainder()
        text = text.strip()
        if text:
            rest.append(f"Assistant: {text}" if role == "assistant" else text)
    return SplitMessages(tuple(chunks), "\n\n".join(rest), tuple(plain), explicit)
