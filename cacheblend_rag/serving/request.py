"""What the engine is asked: the question and its chunks (or a plain chat), and how to answer it.

Every front end (LangChain, LlamaIndex, the HTTP server) turns its framework's input into one
:class:`Request` and its settings, given by their user-facing names, into the request's fields
with :func:`answer_settings`: the one place where decoding settings become a ``SamplingParams``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import BlendConfig, SamplingParams, check_mode

# The user-facing setting names answer_settings() takes (OpenAI's max_tokens is the adapters' to map).
SETTINGS = ("mode", "recompute_ratio", "config", "max_new_tokens", "temperature", "top_p", "top_k", "stop", "seed", "ignore_eos")


def answer_settings(
    *,
    mode: str = "cacheblend",
    recompute_ratio: float | None = None,
    config: BlendConfig | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop: Sequence[str] | str | None = None,
    seed: int | None = None,
    ignore_eos: bool = False,
) -> dict[str, Any]:
    """A request's ``mode``, ``recompute_ratio``, ``config`` and ``sampling`` (one
    ``SamplingParams``) from the settings' user-facing names, with their documented defaults.

    Bad values raise here, naming the setting. ``stop`` may be one string (one stop sequence) or
    a list of them; None is none.
    """
    check_mode(mode)  # recompute_ratio is checked by the BlendConfig it goes into (engine.open_stream)
    if config is not None and not isinstance(config, BlendConfig):
        raise TypeError(
            f"config must be a BlendConfig, got {type(config).__name__}: build one with cacheblend_rag.BlendConfig(**options)"
        )
    sampling = SamplingParams(max_new_tokens, temperature, top_p, top_k, () if stop is None else stop, seed, ignore_eos)
    return {"mode": mode, "recompute_ratio": recompute_ratio, "config": config, "sampling": sampling}


@dataclass(frozen=True)
class Request:
    """One question for the engine.

    With ``chunks`` it is ``engine.generate(question, chunks)``: each chunk's cached KV reused.
    Without chunks it is a plain chat: ``messages`` (role/content dicts) go through the model's
    chat template, or ``prompt`` (text already in the model's prompt format) is taken as written,
    and either is answered with a full prefill.

    Build one with :meth:`over_chunks`, :meth:`plain_chat` or :meth:`plain_prompt`, then set how
    to answer it with :meth:`with_settings`.
    """

    question: str
    chunks: tuple[str, ...] = ()
    messages: tuple[dict[str, str], ...] = ()
    prompt: str | None = None
    """A plain prompt already formatted for the model (e.g. by a LlamaIndex ``completion_to_prompt``)."""
    mode: str = "cacheblend"
    """The prefill mode for a request over chunks (a plain chat is always a full prefill)."""
    recompute_ratio: float | None = None
    config: BlendConfig | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    chunk_source: str = "none"
    """Where the chunks came from: "explicit" (flagged blocks, dicts), "matched" (known chunk
    texts found in the prompt) or "none"."""
    chunks_matched: int = 0
    """How many known chunk texts the registry found in the prompt (0 for explicit inputs)."""

    @property
    def plain(self) -> bool:
        return not self.chunks

    @classmethod
    def over_chunks(cls, question: str, chunks: Sequence[str], source: str = "explicit", matched: int = 0) -> Request:
        """``generate(question, chunks)``; refuses a prompt that holds chunks but no question."""
        if not question.strip():
            raise ValueError(
                "the prompt holds only chunks and no question text: put the question after the "
                "documents (e.g. 'Context: {context}\\n\\nQuestion: {question}')"
            )
        return cls(question, tuple(chunks), chunk_source=source, chunks_matched=matched)

    @classmethod
    def plain_chat(cls, messages: Sequence[dict[str, str]], text: str) -> Request:
        """A prompt without chunks, answered as an ordinary chat with a full prefill; ``text`` is
        the messages' text (what a chunked request would have used as its question)."""
        if not text.strip():
            raise ValueError("the prompt is empty: nothing to answer")
        return cls(text, (), tuple(messages))

    @classmethod
    def plain_prompt(cls, prompt: str) -> Request:
        """A prompt without chunks in the model's own format (a chat template already applied,
        or raw text), prefilled as written."""
        if not prompt.strip():
            raise ValueError("the prompt is empty: nothing to answer")
        return cls(prompt, prompt=prompt)

    def with_settings(self, **settings: Any) -> Request:
        """This request with the given settings (names and defaults of :func:`answer_settings`;
        a setting not given takes its default)."""
        return dataclasses.replace(self, **answer_settings(**settings))
