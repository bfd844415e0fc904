"""Engine results as API bodies: whole responses, stream chunks, usage and the engine's stats.

A :class:`ChatFormat` or :class:`CompletionFormat` holds one response's id and creation time, so
every chunk of a stream carries the same ones, as OpenAI's do.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from cacheblend_rag.chat.tools import ParsedAnswer
from cacheblend_rag.engine.core import GenerationResult
from cacheblend_rag.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    Delta,
    FunctionCall,
    PromptTokensDetails,
    ToolCall,
    ToolCallDelta,
    Usage,
)

DONE = "data: [DONE]\n\n"


def sse(event: BaseModel) -> str:
    """One server-sent event carrying ``event`` as JSON.

    OpenAI's stream is bare ``data:`` lines ending in ``data: [DONE]``, one f-string; sse-starlette's
    response would add what OpenAI clients do not expect (pings, its own disconnect handling,
    which the worker's cancellation already does)."""
    return f"data: {event.model_dump_json()}\n\n"


def finish_reason(result: GenerationResult, parsed: ParsedAnswer | None) -> str:
    """OpenAI's "tool_calls" for an answer that holds calls, else the engine's reason."""
    return "tool_calls" if parsed is not None and parsed.calls else result.finish_reason


def tool_calls(parsed: ParsedAnswer | None) -> list[ToolCall] | None:
    """The answer's valid calls in OpenAI's format (arguments as JSON text); None without any.
    A call that did not parse stays out, as its text stays out of the content."""
    if parsed is None or not parsed.calls:
        return None
    return [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=json.dumps(c.arguments))) for c in parsed.calls]


def usage(result: GenerationResult) -> Usage:
    n_in = int(result.stats.get("prompt_tokens", 0))
    n_out = len(result.token_ids)
    return Usage(
        prompt_tokens=n_in,
        completion_tokens=n_out,
        total_tokens=n_in + n_out,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=int(result.stats.get("cache_read_tokens", 0))),
    )


def engine_stats(result: GenerationResult) -> dict[str, Any]:
    """The ``cacheblend`` response field: the engine's stats, among them ``queue_s``, the time the
    request waited for its prefill."""
    return _jsonable(result.stats)


def _jsonable(stats: Mapping[str, Any]) -> dict[str, Any]:
    # JSON has no NaN/inf, and a tensor or numpy scalar among the stats must not break a response.
    def plain(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if hasattr(v, "tolist"):
            return plain(v.tolist())
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        return str(v)

    return {str(k): plain(v) for k, v in stats.items()}


class _Format:
    """One response's id and creation time, and the parts chat and completions share."""

    id_prefix = ""

    def __init__(self, model: str, include_usage: bool = False):
        self.model, self.include_usage = model, include_usage
        self.id, self.created = f"{self.id_prefix}-{uuid.uuid4().hex}", int(time.time())

    def _body(self, choices: list[Any], **fields: Any) -> BaseModel:
        raise NotImplementedError

    def _final_choice(self, finish_reason: str) -> BaseModel:
        raise NotImplementedError

    def _calls(self, parsed: ParsedAnswer | None) -> list[BaseModel]:
        """The chunks that carry an answer's tool calls, before its finish reason."""
        return []

    def opening(self) -> BaseModel | None:
        """The stream's first chunk, sent before the first token, if the format has one."""
        return None

    def closing(self, result: GenerationResult, parsed: ParsedAnswer | None = None) -> list[BaseModel]:
        """The stream's last chunks: the answer's tool calls (if any), the finish reason with the
        engine's stats, then the usage (when asked for with ``stream_options.include_usage``)."""
        last = self._body([self._final_choice(finish_reason(result, parsed))], cacheblend=engine_stats(result))
        return self._calls(parsed) + [last] + ([self._body([], usage=usage(result))] if self.include_usage else [])


class ChatFormat(_Format):
    """Bodies of /v1/chat/completions."""

    id_prefix = "chatcmpl"

    def _body(self, choices: list[Any], **fields: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, **fields)

    def _final_choice(self, finish_reason: str) -> ChatChunkChoice:
        return ChatChunkChoice(delta=Delta(), finish_reason=finish_reason)

    def _calls(self, parsed: ParsedAnswer | None) -> list[BaseModel]:
        calls = tool_calls(parsed) or []
        deltas = [ToolCallDelta(index=i, **c.model_dump()) for i, c in enumerate(calls)]
        return [self._body([ChatChunkChoice(delta=Delta(tool_calls=deltas))])] if deltas else []

    def whole(self, result: GenerationResult, parsed: ParsedAnswer | None = None) -> ChatCompletion:
        calls = tool_calls(parsed)
        message = AssistantMessage(content=result.text or (None if calls else ""), tool_calls=calls)
        choice = ChatChoice(message=message, finish_reason=finish_reason(result, parsed))
        return ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=usage(result),
            cacheblend=engine_stats(result),
        )

    def opening(self) -> ChatCompletionChunk:
        return self._body([ChatChunkChoice(delta=Delta(role="assistant", content=""))])

    def delta(self, text: str) -> ChatCompletionChunk:
        return self._body([ChatChunkChoice(delta=Delta(content=text))])


class CompletionFormat(_Format):
    """Bodies of /v1/completions (a stream chunk is a completion with a partial text)."""

    id_prefix = "cmpl"

    def _body(self, choices: list[Any], **fields: Any) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, **fields)

    def _final_choice(self, finish_reason: str) -> CompletionChoice:
        return CompletionChoice(text="", finish_reason=finish_reason)

    def whole(self, result: GenerationResult, parsed: ParsedAnswer | None = None) -> Completion:
        return self._body(
            [CompletionChoice(text=result.text, finish_reason=result.finish_reason)],
            usage=usage(result),
            cacheblend=engine_stats(result),
        )

    def delta(self, text: str) -> Completion:
        return self._body([CompletionChoice(text=text)])
