"""What the engine is asked: the question and its chunks (or a plain chat), and how to answer it.

Every front end (LangChain, LlamaIndex, the HTTP server) turns its framework's input into one
:class:`Request` and its settings, given by their user-facing names, into the request's fields
with :func:`request_settings`: the one place where decoding settings become a ``SamplingParams``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cacheblend_rag.config import BlendConfig, check_mode
from cacheblend_rag.decode.sampling import SAMPLING_SETTINGS, SamplingParams, sampling_params
from cacheblend_rag.engine.plain import chat_text, plain_stream
from cacheblend_rag.engine.setup import check_config

if TYPE_CHECKING:
    from cacheblend_rag.engine.core import CacheBlendEngine
    from cacheblend_rag.engine.stream import GenerationStream

# The user-facing setting names request_settings() takes (OpenAI's max_tokens is the adapters' to map):
# how to prefill, then SamplingParams' own fields (sampling.SAMPLING_SETTINGS).
SETTINGS = ("mode", "recompute_ratio", "config", *SAMPLING_SETTINGS)


def request_settings(
    *, mode: str = "cacheblend", recompute_ratio: float | None = None, config: BlendConfig | None = None, **decoding: Any
) -> dict[str, Any]:
    """A request's ``mode``, ``recompute_ratio``, ``config`` and ``sampling`` (one
    ``SamplingParams``, built by ``sampling.sampling_params`` from the other settings) from the
    settings' user-facing names (:data:`SETTINGS`), with their documented defaults.

    Bad values raise here, naming the setting, and so does a name that is not a setting. ``stop``
    may be one string (one stop sequence) or a list of them; None is none. ``constraint`` (a
    ``constraints.Grammar``) keeps the answer inside a grammar: structured output, a forced tool
    call (``tools.plan_tools``).
    """
    check_mode(mode)  # recompute_ratio is checked by the BlendConfig it goes into (engine.stream)
    config = check_config(config)
    return {"mode": mode, "recompute_ratio": recompute_ratio, "config": config, "sampling": sampling_params(**decoding)}


def call_settings(fields: Mapping[str, Any], overrides: Mapping[str, Any], accepted: Sequence[str]) -> dict[str, Any]:
    """A framework call's settings: a model's ``fields`` (``request_settings``' names), then the
    call's ``overrides`` on top. Every integration refuses the same way: an override not among
    ``accepted`` raises ``TypeError`` naming it and the accepted ones (a misspelt setting would
    otherwise change nothing without a word). OpenAI's ``max_tokens`` is ``max_new_tokens``."""
    unknown = sorted(set(overrides) - set(accepted))
    if unknown:
        raise TypeError(f"unknown generation arguments {unknown}; accepted: {', '.join(accepted)}")
    given = dict(overrides)
    if "max_tokens" in given:
        given["max_new_tokens"] = given.pop("max_tokens")
    return {**fields, **given}


@dataclass(frozen=True)
class Request:
    """One question for the engine.

    With ``chunks`` it is ``engine.generate(question, chunks)``: each chunk's cached KV reused.
    Without chunks it is a plain chat: ``messages`` (role/content dicts) go through the model's
    chat template, or ``prompt`` (text already in the model's prompt format) is taken as written,
    and either is answered with a full prefill.

    Build one with :meth:`over_chunks`, :meth:`plain_chat` or :meth:`plain_prompt`, then set how
    to answer it with :meth:`with_settings` (and offer tools with :meth:`with_tools`).
    """

    question: str
    chunks: tuple[str, ...] = ()
    messages: tuple[dict[str, Any], ...] = ()
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
    tools: tuple[dict[str, Any], ...] = ()
    """Function definitions (OpenAI's format) the chat template renders into the prompt's prefix:
    the chunks are cached behind that prefix (``engine.precompute(..., tools=...)``)."""
    turns: tuple[dict[str, Any], ...] = ()
    """Chat messages after the question's turn (the assistant's tool calls, the tools' results),
    rendered by the chat template after the question. A plain chat has them in ``messages``."""

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

    def with_tools(self, tools: Sequence[dict[str, Any]], turns: Sequence[dict[str, Any]] = ()) -> Request:
        """This request with ``tools`` in its prompt and the conversation going on with ``turns``
        (chat-template messages); a plain chat gets the turns after its messages. A prompt already
        formatted by the caller cannot take either: the template must render them."""
        if self.prompt is not None and (tools or turns):
            raise ValueError(
                "tools and tool turns need the chat template to render them, and this prompt was formatted "
                "already: pass the conversation as chat messages"
            )
        if self.plain:
            return dataclasses.replace(self, tools=tuple(tools), messages=self.messages + tuple(turns))
        return dataclasses.replace(self, tools=tuple(tools), turns=self.turns + tuple(turns))

    def with_hint(self, hint: str) -> Request:
        """This request with ``hint`` (e.g. the JSON schema an answer must match) after its
        question, or for a plain chat after its last user message; the chunks' caches do not
        depend on it."""
        if not hint:
            return self
        if not self.plain:
            return dataclasses.replace(self, question=f"{self.question}\n\n{hint}")
        messages = [dict(m) for m in self.messages]
        last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last is None:
            messages.append({"role": "user", "content": hint})
        else:
            messages[last]["content"] = f"{messages[last]['content']}\n\n{hint}"
        return dataclasses.replace(self, messages=tuple(messages))

    def with_settings(self, **settings: Any) -> Request:
        """This request with the given settings (names and defaults of :func:`request_settings`;
        a setting not given takes its default)."""
        return dataclasses.replace(self, **request_settings(**settings))


def open_stream(engine: CacheBlendEngine, request: Request) -> GenerationStream:
    """The engine's stream for ``request`` (validated: a context that does not fit raises here)."""
    if request.chunks:
        return engine.stream(
            request.question,
            list(request.chunks),
            request.sampling,
            mode=request.mode,
            recompute_ratio=request.recompute_ratio,
            config=request.config,
            tools=request.tools,
            turns=request.turns,
        )
    # No chunks: one full prefill of the chat in the model's template, or of a prompt as written.
    text = request.prompt if request.prompt is not None else chat_text(engine.tokenizer, request.messages, request.tools)
    return plain_stream(engine, text, request.sampling)
