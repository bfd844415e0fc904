"""Request and response bodies of the OpenAI-compatible API (the subset the engine can honour).

Unknown fields are ignored, as OpenAI clients add new optional ones over time; fields whose
non-default value would change the answer in a way the engine cannot do (``n`` > 1, ``functions``,
logprobs, penalties, ...) are refused with a 400 rather than silently dropped. ``response_format``
(a JSON schema or any JSON object) is honoured by constrained decoding (``constraints.py``), and a
chat's ``tools`` by the integrations' tool path (``serving.tool_run``).

Our own pydantic models rather than the ``openai`` package's types: its request parameters are
TypedDicts (no validation, nothing to refuse with), and its response models are the client's
(every field optional on parse); these models validate strictly and state what the engine honours.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from cacheblend_rag.config import MODES
from cacheblend_rag.decode.constraints import Grammar, check_response_format, response_format_constraint

DEFAULT_MAX_TOKENS = 128  # the engine's default; OpenAI's "until the context is full" is rarely wanted


class CacheBlendOptions(BaseModel):
    """The ``cacheblend`` extension field: how the engine prefills the documents."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal[MODES] = "cacheblend"  # type: ignore[valid-type]
    """One of cacheblend, full_recompute (the exact full prefill), full_recompute_saved (the same with the
    fused modes' last-layer saving), prefix_caching, full_reuse."""
    recompute_ratio: float | None = Field(default=None, ge=0.0, le=1.0, strict=True)
    """Fraction of chunk tokens recomputed per layer (None: the engine's configured one)."""
    top_k: int = Field(default=0, ge=0, strict=True)
    """Sample from the k most likely tokens only (0: off)."""


class StreamOptions(BaseModel):
    include_usage: bool = Field(default=False, strict=True)
    """Send a last chunk with ``usage`` (and empty ``choices``) before ``[DONE]``, as OpenAI does."""


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """The call's arguments as JSON text, as OpenAI sends and returns them."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[Any] | None = None
    """A string or a list of parts; a ``{"type": "text", "text": ..., "extras":
    {"cacheblend_chunk": true}}`` part is one retrieved document (``cacheblend_rag.chat.messages``).
    None only for an assistant message with ``tool_calls``."""
    tool_calls: list[ToolCall] | None = None
    """An assistant's calls (the answer of a request with ``tools``)."""
    tool_call_id: str | None = None
    """A ``tool`` message: the call it answers."""

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant message with tool_calls may omit it)")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self


# Fields OpenAI defines that the engine has no equivalent for. Their "off" values (None, false,
# 0, an empty list) are accepted, as clients send them by default.
_UNSUPPORTED = (
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "frequency_penalty",
    "presence_penalty",
    "tools",  # declared (and honoured) by chat completions only
    "functions",
    "best_of",
    "echo",
    "suffix",
)
# Off values besides the falsy ones: best_of=1 (OpenAI's default) is the one completion n=1 returns.
_OFF = {"best_of": 1}


class GenerationRequest(BaseModel):
    """Fields both endpoints share.

    Numbers and switches are strict: ``max_tokens: true`` or ``"3"`` is a 400 naming the field,
    not coerced to 1 or 3 (a client bug would otherwise be answered as if it were meant)."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    """Most tokens to generate (default 128)."""
    temperature: float = Field(default=0.0, ge=0.0, le=2.0, strict=True)
    """0 (the default here, unlike OpenAI's 1) decodes greedily."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, strict=True)
    seed: int | None = Field(default=None, strict=True)
    """Sampling seed (used when temperature > 0)."""
    stop: str | list[str] | None = None
    stream: bool = Field(default=False, strict=True)
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=1, strict=True)
    user: str | None = None  # accepted and ignored, as a single-tenant server has no use for it
    documents: list[str] | None = None
    """The retrieved chunks, one string each (extension field; each one's KV is cached)."""
    response_format: dict[str, Any] | None = None
    """OpenAI's structured output: ``{"type": "json_schema", "json_schema": {"schema": {...}}}``
    (the answer matches the schema, which is also shown after the question), ``{"type":
    "json_object"}`` (any JSON object) or ``{"type": "text"}`` (no constraint, the default)."""
    cacheblend: CacheBlendOptions = Field(default_factory=CacheBlendOptions)

    @field_validator("temperature", "top_p", "stream", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        # OpenAI's schema makes these nullable, and the openai client sends an explicit None as null.
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError(f"n={n} is not supported: this server returns one choice per request (n=1)")
        return n

    @field_validator("response_format")
    @classmethod
    def _honoured_format(cls, fmt: dict[str, Any] | None) -> dict[str, Any] | None:
        # Its shape only: this runs on the event loop, and the schema's own checks and compilation
        # grow with its size, so they run with the request's other work (structured()).
        if fmt is None or fmt.get("type") == "text":
            return fmt
        check_response_format(fmt)  # a malformed response_format: ValueError, a 400
        return fmt

    @field_validator("documents")
    @classmethod
    def _nonblank_documents(cls, docs: list[str] | None) -> list[str] | None:
        for i, doc in enumerate(docs or []):
            if not doc.strip():
                raise ValueError(f"document {i} is empty or whitespace: drop it")
        return docs

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> GenerationRequest:
        extra = self.model_extra or {}
        for name in _UNSUPPORTED:
            if extra.get(name) and extra[name] != _OFF.get(name):
                raise ValueError(f"{name} is not supported by this server (CacheBlend engine): leave it unset")
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def max_new_tokens(self) -> int:
        return self.max_tokens or DEFAULT_MAX_TOKENS

    def structured(self) -> tuple[Grammar | None, str]:
        """The answer's constraint, checked and compiled (a schema over a limit of
        ``cacheblend_rag.bounds`` or one llguidance cannot take: ValueError, a 400 naming it), and
        the hint shown after the question ("" for none). Its work grows with the schema (bounded by
        those limits): call it off the event loop."""
        if self.response_format is None or self.response_format.get("type") == "text":
            return None, ""
        grammar, hint = response_format_constraint(self.response_format)
        try:
            grammar.llguidance_grammar()
        except ImportError as exc:
            raise ValueError(f"response_format needs constrained decoding, which this server lacks: {exc}") from None
        return grammar, hint

    def settings(self) -> dict[str, Any]:
        """The request's settings by their engine names (``Request.with_settings``), but for the
        constraint (:meth:`structured`)."""
        return {
            "mode": self.cacheblend.mode,
            "recompute_ratio": self.cacheblend.recompute_ratio,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.cacheblend.top_k,
            "stop": self.stops,
            "seed": self.seed,
        }


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage]
    tools: list[dict[str, Any]] | None = None
    """Function definitions (OpenAI's format), rendered by the model's chat template; the answer's
    calls come back in ``message.tool_calls`` (``cacheblend_rag.chat.tools``)."""
    tool_choice: str | dict[str, Any] | None = None
    """"auto" (default), "none", "required" or ``{"type": "function", "function": {"name": ...}}``;
    a forced call is constrained to the tool's parameters."""
    parallel_tool_calls: bool | None = None
    """Several calls in one answer (default: one)."""
    max_completion_tokens: int | None = Field(default=None, ge=1, strict=True)
    """OpenAI's newer name for ``max_tokens`` (what LangChain's ChatOpenAI sends); wins if both are set."""

    @property
    def max_new_tokens(self) -> int:
        return self.max_completion_tokens or super().max_new_tokens

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise ValueError("messages is empty: pass at least one message")
        return messages


class CompletionRequest(GenerationRequest):
    prompt: str | list[str]
    """The question (with ``documents``) or the whole prompt; a list must hold exactly one string."""

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str]) -> str | list[str]:
        if isinstance(prompt, list) and len(prompt) != 1:
            raise ValueError(f"prompt is a list of {len(prompt)} strings: this server answers one prompt per request")
        return prompt

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


# ---------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int
    """Chunk tokens whose KV was read from the cache instead of prefilled."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    """The answer's text outside its tool calls (None when it is only calls)."""
    tool_calls: list[ToolCall] | None = None


class _Choice(BaseModel):
    index: int = 0
    finish_reason: str | None = None
    """"stop" (end of answer or a stop string), "length" (max_tokens) or "tool_calls" (the answer
    holds calls); None until the last chunk."""
    logprobs: None = None


class _Response(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage | None = None
    cacheblend: dict[str, Any] | None = None
    """The engine's stats (ttft_s, chunk_hits, recompute_fraction, ...) plus queue_s; on a whole
    response, and in a stream on the chunk with the finish reason."""


class ChatChoice(_Choice):
    message: AssistantMessage


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ToolCallDelta(ToolCall):
    index: int
    """The call's place in the answer (OpenAI's stream key); each call comes whole, in one chunk."""


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Choice):
    delta: Delta


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionChoice(_Choice):
    text: str


class Completion(_Response):
    """A /v1/completions response, or one of its stream chunks (OpenAI uses the same object)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "cacheblend-rag"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]
    model: str
    running: int
    """Answers being prefilled or decoded."""
    waiting: int
    """Requests waiting for a place in the batch."""
    admitted: int
    """Requests holding a place of ``max_batch + max_queue``: running, waiting, and those still being
    prepared (tokenized, their grammar compiled) or finishing; a client that leaves frees its place."""
    max_batch: int
    max_queue: int
    decode_steps: int
    """Decode steps the batcher has run since the server started."""
    decoded_tokens: int
    """Tokens those steps decoded: ``decoded_tokens / decode_steps`` answers shared a step on average."""


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
