"""CacheBlendLLM: a LlamaIndex ``CustomLLM`` whose prefill is done by a ``CacheBlendEngine``."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.generic_utils import (
    astream_completion_response_to_chat_response,
    completion_response_to_chat_response,
    stream_completion_response_to_chat_response,
)
from llama_index.core.base.llms.generic_utils import messages_to_prompt as generic_messages_to_prompt
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr, field_validator
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import default_completion_to_prompt

from cacheblend_rag import MODES, CacheBlendEngine, GenerationResult
from cacheblend_rag.chat.matching import ChunkRegistry
from cacheblend_rag.config import check_mode
from cacheblend_rag.engine.plain import chat_text
from cacheblend_rag.serving import Batcher, Request, Run
from cacheblend_rag.serving.aio import iterate_in_thread
from cacheblend_rag.serving.request import call_settings

from .tools import TOOL_ARGUMENTS, FunctionCallingMixin, call_kwargs, tool_run, wants_tools

NO_MATCH = (
    "the prompt contains none of the {n} chunk texts registered with this engine, so it is answered "
    "with a full prefill and no KV reuse. Chunks are found verbatim: query through "
    "CacheBlendSynthesizer (CacheBlendQueryEngine, or index.as_query_engine(llm=llm, "
    "response_synthesizer=CacheBlendSynthesizer(llm=llm))), and precompute with the metadata_mode "
    "the query uses. This warning is shown once per LLM; every answer's "
    "additional_kwargs['cacheblend'] reports chunks_matched."
)
# Per-call keyword arguments of complete()/stream_complete() that override the fields.
GENERATION_KEYS = ("mode", "recompute_ratio", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")
# LlamaIndex's roles as chat templates know them: DEVELOPER is OpenAI's newer name for the system
# turn, CHATBOT (Cohere's) and MODEL (Gemini's) the assistant's; the rest (tool, function) are user text.
CHAT_ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.DEVELOPER: "system",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
}
# The fields among them (stop is per call only), plus the others: what error messages list.
GENERATION_FIELDS = tuple(k for k in GENERATION_KEYS if k != "stop") + ("match_chunks", "max_batch")


class CacheBlendLLM(FunctionCallingMixin, CustomLLM, FunctionCallingLLM):
    """LlamaIndex LLM backed by a :class:`cacheblend_rag.CacheBlendEngine`.

    Use it with :class:`~llama_index.cacheblend.CacheBlendSynthesizer` (or
    :class:`~llama_index.cacheblend.CacheBlendQueryEngine`), which hands the retrieved nodes to the
    engine as separate chunks so their cached KV is reused. It also works as a plain LLM
    (``Settings.llm = CacheBlendLLM(engine=...)``) for prompts a LlamaIndex template flattened:

    * if the prompt contains chunk texts the engine's ``ChunkRegistry`` knows (registered by
      ``precompute_index``, ``CacheBlendPrecompute`` and ``CacheBlendSynthesizer``), those become
      the chunks and the rest of the prompt the question: ``engine.generate(rest, chunks)``;
    * otherwise there is nothing to reuse: the whole prompt, inside the model's chat template, is
      prefilled from scratch (``full_recompute``) and answered like the unmodified model would.

    ``engine`` defaults to ``CacheBlendEngine.from_pretrained()`` (the bundled SmolLM2).

    Function calling (``chat(messages, tools=...)``, ``FunctionAgent``) works when the engine's
    chat template renders tools (``metadata.is_function_calling_model``), and ``structured_predict``
    constrains the answer to the output class's JSON schema (:mod:`llama_index.cacheblend.tools`).
    """

    mode: str = Field(
        default="cacheblend",
        description=f"prefill mode for answers over chunks: one of {', '.join(MODES)}",
    )
    recompute_ratio: float | None = Field(
        default=None,
        description="fraction of context tokens CacheBlend recomputes per layer; None keeps the "
        "engine's BlendConfig (0.15, the paper's default)",
    )
    max_new_tokens: int = Field(default=128, gt=0, description="most tokens generated per answer")
    temperature: float = Field(default=0.0, ge=0.0, description="0 is greedy decoding")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus sampling (temperature > 0)")
    top_k: int = Field(default=0, ge=0, description="top-k sampling, 0 disables (temperature > 0)")
    seed: int | None = Field(default=None, description="sampling seed (temperature > 0)")
    match_chunks: bool = Field(
        default=True,
        description="find registered chunk texts inside plain prompts (complete/chat) and reuse their KV",
    )
    max_batch: int = Field(
        default=1,
        ge=1,
        description="answers decoded together when calls overlap (threads, concurrent acomplete/aquery): above 1, "
        "requests go through a cacheblend_rag.serving.Batcher that decodes up to this many in one forward per "
        "token; 1: one answer at a time",
    )

    _engine: CacheBlendEngine = PrivateAttr()
    _warned_no_match: bool = PrivateAttr(default=False)

    def __init__(self, engine: CacheBlendEngine | None = None, **kwargs: Any) -> None:
        # pydantic drops unknown keys silently: a misspelt setting (OpenAI's max_tokens) or another
        # class's option passed through from_index(**gen) would change nothing without a word.
        unknown = sorted(set(kwargs) - set(type(self).model_fields))
        if unknown:
            raise TypeError(
                f"unknown CacheBlendLLM setting{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: "
                f"the generation settings are {', '.join(GENERATION_FIELDS)} (plus LlamaIndex's LLM fields "
                "such as system_prompt)"
            )
        super().__init__(**kwargs)
        self._engine = engine if engine is not None else CacheBlendEngine.from_pretrained()

    @field_validator("mode")
    @classmethod
    def _check_mode(cls, mode: str) -> str:
        return check_mode(mode)

    @field_validator("recompute_ratio")
    @classmethod
    def _check_ratio(cls, ratio: float | None) -> float | None:
        if ratio is not None and not 0.0 <= ratio <= 1.0:
            raise ValueError(f"recompute_ratio={ratio} is outside [0, 1]")
        return ratio

    @classmethod
    def class_name(cls) -> str:
        return "CacheBlendLLM"

    @property
    def engine(self) -> CacheBlendEngine:
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self._engine.context_window,
            num_output=self.max_new_tokens,
            model_name=self._engine.model_id,
            is_chat_model=False,
            is_function_calling_model=self.supports_tools,
        )

    # ------------------------------------------------------------------ requests
    @property
    def batcher(self) -> Batcher | None:
        """The batcher serving this LLM's requests (None when ``max_batch`` is 1), shared by every
        model on the same engine with the same ``max_batch``; its ``steps`` and ``rows_stepped``
        tell how many answers shared each decode step."""
        return None if self.max_batch <= 1 else Batcher.for_engine(self._engine, self.max_batch)

    def generation_settings(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """The fields, then a call's ``overrides``, by ``Request.with_settings``'s names. As in
        LangChain's models, an override that is not a generation setting (``GENERATION_KEYS``)
        raises ``TypeError`` (``serving.request.call_settings``); the tool path's own arguments
        (``tools.TOOL_ARGUMENTS``) are read there, not here."""
        fields = {k: getattr(self, k) for k in GENERATION_KEYS if k != "stop"}
        given = {k: v for k, v in overrides.items() if k not in TOOL_ARGUMENTS}
        return call_settings(fields, given, GENERATION_KEYS)

    def _run(self, request: Request, overrides: dict[str, Any]) -> Run:
        return Run(self._engine, request.with_settings(**self.generation_settings(overrides)), batcher=self.batcher)

    # ------------------------------------------------------------------ answers over chunks
    def stream_chunks(self, question: str, chunks: Sequence[str], **overrides: Any) -> Run:
        """Start answering ``question`` over ``chunks`` (each chunk's KV reused); iterate the
        result for text deltas, then read ``.result`` (text, ttft_s, stats)."""
        return self._run(Request.over_chunks(question, chunks), overrides)

    def answer_chunks(self, question: str, chunks: Sequence[str], **overrides: Any) -> GenerationResult:
        run = self.stream_chunks(question, chunks, **overrides)
        for _ in drain_and_flush(self._engine, run):
            pass
        assert run.result is not None
        return run.result

    # ------------------------------------------------------------------ plain prompts
    @property
    def chunk_registry(self) -> ChunkRegistry:
        """Chunk texts known to this engine (shared with every integration using it)."""
        return ChunkRegistry.for_engine(self._engine)

    def chunked_request(self, text: str) -> Request | None:
        """A request over the known chunks found in ``text``, or None when there are none (or
        nothing but chunks: the prompt is then answered as it is)."""
        if not self.match_chunks:
            return None
        registry = self.chunk_registry
        match = registry.match(text)
        question = match.remainder()
        if not match.spans:
            self._warn_no_match(len(registry))
            return None
        if not question.strip():
            return None  # nothing but chunks: answer the prompt as it is
        return Request.over_chunks(question, match.chunks, "matched", len(match.spans))

    def _warn_no_match(self, registered: int) -> None:
        """Once per LLM: chunks are registered, yet this prompt contains none of them verbatim."""
        if self._warned_no_match or registered == 0:
            return
        self._warned_no_match = True
        warnings.warn(NO_MATCH.format(n=registered), UserWarning, stacklevel=2)

    def _format_completion(self, prompt: str, formatted: bool) -> str:
        if self.completion_to_prompt is not default_completion_to_prompt:
            # A user-supplied formatter: LlamaIndex's predict() already applied it (formatted=True).
            return prompt if formatted else self.completion_to_prompt(prompt)
        # The default formatter is the identity, so even a "formatted" prompt is plain text; an
        # instruct model answers best inside its own chat template.
        return self._apply_chat_template([{"role": "user", "content": prompt}])

    def _format_messages(self, messages: Sequence[ChatMessage]) -> str:
        if self.messages_to_prompt is not generic_messages_to_prompt:
            return self.messages_to_prompt(messages)
        return self._apply_chat_template([{"role": CHAT_ROLES.get(m.role, "user"), "content": m.content or ""} for m in messages])

    def _apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return chat_text(self._engine.tokenizer, messages)

    def stream_prompt(self, prompt: str, formatted: bool = False, chunks: Sequence[str] | None = None, **overrides: Any) -> Run:
        """Answer a prompt: over ``chunks`` if given, else over its known chunks if it has any,
        else by full prefill.

        ``chunks`` (what :class:`CacheBlendSynthesizer` passes): texts that occur, in this order and
        unchanged, in ``prompt`` (a QA template formatted with them as ``context_str``). They are
        the engine's documents; the prompt's text around them becomes the question turn.

        The full-prefill answer wraps the prompt as a user turn of the model's chat template,
        unless a ``completion_to_prompt`` was given: then that formats it (``formatted=True``:
        LlamaIndex's ``predict`` already did). ``completion_to_prompt=lambda p: p`` sends raw text.
        """
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        if not prompt.strip():
            raise ValueError("prompt is empty: pass a non-empty prompt string")
        if chunks is not None:
            return self.stream_chunks(question_around(prompt, chunks), chunks, **overrides)
        request = self.chunked_request(prompt) or Request.plain_prompt(self._format_completion(prompt, formatted))
        return self._run(request, overrides)

    def stream_messages(self, messages: Sequence[ChatMessage], **overrides: Any) -> Run:
        """Answer chat messages: over the known chunks in their text if any, else by full prefill
        of the messages in the model's chat template."""
        if not messages:
            raise ValueError("no messages: pass at least one ChatMessage")
        if wants_tools(overrides):  # tools, tool_choice or a constraint: the template and the grammar
            return tool_run(self, messages, overrides)  # type: ignore[return-value]
        joined = "\n\n".join(m.content or "" for m in messages if CHAT_ROLES.get(m.role) != "assistant")
        request = self.chunked_request(joined) or Request.plain_prompt(self._format_messages(messages))
        return self._run(request, overrides)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return _complete(self._engine, self.stream_prompt(prompt, formatted, **kwargs))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        # Open the stream here so bad input raises now, not on the first next().
        return _responses(self._engine, self.stream_prompt(prompt, formatted, **kwargs))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await _acomplete(self._engine, self.stream_prompt(prompt, formatted, **kwargs))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        return _aresponses(self._engine, self.stream_prompt(prompt, formatted, **kwargs))

    # Chat goes through the model's own chat template rather than the generic "role: text" format.
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return completion_response_to_chat_response(_complete(self._engine, self.stream_messages(messages, **kwargs)))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return stream_completion_response_to_chat_response(_responses(self._engine, self.stream_messages(messages, **kwargs)))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return completion_response_to_chat_response(await _acomplete(self._engine, self.stream_messages(messages, **kwargs)))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        return astream_completion_response_to_chat_response(_aresponses(self._engine, self.stream_messages(messages, **kwargs)))


def question_around(prompt: str, chunks: Sequence[str]) -> str:
    """``prompt`` without ``chunks`` (found in order, unchanged): the non-blank pieces around
    them, stripped and joined by blank lines."""
    pieces: list[str] = []
    pos = 0
    for i, chunk in enumerate(chunks):
        if not chunk.strip():
            # Blank text "occurs" anywhere (or nowhere): say what is wrong, as the engine would.
            raise ValueError(f"chunk {i} is empty or whitespace: drop it before asking")
        at = prompt.find(chunk, pos)
        if at < 0:
            raise ValueError(
                f"chunk {i} ({chunk[:40]!r}...) does not occur in the prompt after the chunks before "
                "it: the prompt template must hold {context_str}, the chunks joined unchanged in order"
            )
        pieces.append(prompt[pos:at])
        pos = at + len(chunk)
    pieces.append(prompt[pos:])
    question = "\n\n".join(p.strip() for p in pieces if p.strip())
    if not question:
        raise ValueError("the prompt holds only the chunks and no question: the template needs {query_str}")
    return question


def raw_response(result: GenerationResult) -> dict[str, Any]:
    """A completion's ``raw``: a plain dict (LlamaIndex's ``TokenCountingHandler`` reads
    ``raw["usage"]``), with the engine's text, token ids, timings and stats."""
    prompt_tokens = int(result.stats.get("prompt_tokens", 0))
    completion_tokens = len(result.token_ids)
    return {
        "text": result.text,
        "token_ids": list(result.token_ids),
        "finish_reason": result.finish_reason,
        "ttft_s": result.ttft_s,
        "total_s": result.total_s,
        "stats": result.stats,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _completion(run: Run, text: str | None = None, delta: str | None = None) -> CompletionResponse:
    result = run.result
    assert result is not None
    # Where the chunks came from, for the answer's stats.
    result.stats.update(chunk_source=run.request.chunk_source, chunks_matched=run.request.chunks_matched)
    return CompletionResponse(
        text=result.text if text is None else text,
        delta=delta,
        additional_kwargs={"cacheblend": result.stats, "finish_reason": result.finish_reason, **call_kwargs(run)},
        raw=raw_response(result),
    )


def _complete(engine: CacheBlendEngine, run: Run) -> CompletionResponse:
    for _ in drain_and_flush(engine, run):
        pass
    return _completion(run)


async def _acomplete(engine: CacheBlendEngine, run: Run) -> CompletionResponse:
    async for _ in iterate_in_thread(drain_and_flush(engine, run)):
        pass
    return _completion(run)


def _responses(engine: CacheBlendEngine, run: Run) -> CompletionResponseGen:
    # One delta behind, so the last response carries the stats and the dict ``raw``.
    text, pending = "", None
    for delta in drain_and_flush(engine, run):
        if pending is not None:
            yield CompletionResponse(text=text, delta=pending)
        text += delta
        pending = delta
    yield _completion(run, text, pending or "")


async def _aresponses(engine: CacheBlendEngine, run: Run) -> CompletionResponseAsyncGen:
    text, pending = "", None
    async for delta in iterate_in_thread(drain_and_flush(engine, run)):
        if pending is not None:
            yield CompletionResponse(text=text, delta=pending)
        text += delta
        pending = delta
    yield _completion(run, text, pending or "")


def drain_and_flush(engine: CacheBlendEngine, run: Run) -> Iterator[str]:
    """Yield ``run``'s deltas, then wait for the engine's background KV write-backs so the next
    query finds the chunks this one computed."""
    yield from run
    engine.flush()
