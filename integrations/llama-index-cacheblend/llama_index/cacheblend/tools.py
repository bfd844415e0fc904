"""Function calling and structured prediction for :class:`~llama_index.cacheblend.CacheBlendLLM`.

``chat(messages, tools=[...], tool_choice=..., parallel_tool_calls=...)`` renders the tools through the model's chat
template and returns the answer's calls in ``message.additional_kwargs["tool_calls"]`` (OpenAI's
format), which ``get_tool_calls_from_response`` turns into ``ToolSelection``s: LlamaIndex's
``FunctionAgent``, ``predict_and_call`` and function-calling programs work on a model whose
template renders tools (``metadata.is_function_calling_model``). ``structured_predict`` constrains
the answer to the output class's JSON schema, so it always parses (on any model).

Chunks still reach the engine as chunks: registered chunk texts found in the conversation before
its first tool call are the engine's chunks, and the tool exchange after it is rendered by the
template after the question.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole, TextBlock
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.types import PydanticProgramMode

from cacheblend_rag.chat.tools import require_tool_support, supports_tools
from cacheblend_rag.decode.constraints import schema_constraint
from cacheblend_rag.serving import Request, ToolRun
from cacheblend_rag.serving import tool_run as serving_tool_run

if TYPE_CHECKING:
    from llama_index.core.prompts.base import BasePromptTemplate
    from llama_index.core.tools.types import BaseTool

    from .llm import CacheBlendLLM

# The chat() keyword arguments that take the tool path (the rest are generation settings).
TOOL_KEYS = ("tools", "tool_choice", "constraint", "schema_hint")
# Every chat() keyword argument the tool path reads (the generation settings are the LLM's to check).
TOOL_ARGUMENTS = (*TOOL_KEYS, "parallel_tool_calls")


def _role(message: ChatMessage) -> str:
    from .llm import CHAT_ROLES

    if message.role in (MessageRole.TOOL, MessageRole.FUNCTION):
        return "tool"
    return CHAT_ROLES.get(message.role, "user")


def _calls_of(message: ChatMessage) -> list[dict[str, Any]]:
    """An assistant message's tool calls in the chat template's format: from
    ``additional_kwargs["tool_calls"]`` (OpenAI's format, dicts or objects) or ``ToolCallBlock``s."""
    out = []
    for call in message.additional_kwargs.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, dict) else getattr(call, "function", None)
        name = fn.get("name") if isinstance(fn, dict) else getattr(fn, "name", None)
        args = fn.get("arguments") if isinstance(fn, dict) else getattr(fn, "arguments", None)
        if isinstance(args, str):
            args = json.loads(args or "{}")
        out.append({"type": "function", "function": {"name": name, "arguments": args or {}}})
    for block in message.blocks:
        if getattr(block, "block_type", None) == "tool_call":
            args = block.tool_kwargs
            out.append(
                {
                    "type": "function",
                    "function": {"name": block.tool_name, "arguments": json.loads(args) if isinstance(args, str) else args},
                }
            )
    return out


def turn(message: ChatMessage) -> dict[str, Any]:
    """A LlamaIndex message in the chat template's format (role, content, tool_calls, name)."""
    role = _role(message)
    text = "".join(b.text for b in message.blocks if isinstance(b, TextBlock))
    out: dict[str, Any] = {"role": role, "content": text}
    if role == "assistant":
        calls = _calls_of(message)
        if calls:
            out["tool_calls"] = calls
    if role == "tool":
        out["name"] = message.additional_kwargs.get("name", "")
    return out


def _starts_tool_exchange(message: ChatMessage) -> bool:
    return _role(message) == "tool" or (_role(message) == "assistant" and bool(_calls_of(message)))


def call_kwargs(run: Any) -> dict[str, Any]:
    """A finished run's tool calls as a response's ``additional_kwargs`` (OpenAI's format, what
    ``get_tool_calls_from_response`` reads); none for an answer not read for calls."""
    if not isinstance(run, ToolRun) or not run.parse:
        return {}
    parsed = run.parsed
    out: dict[str, Any] = {
        "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in parsed.calls
        ]
    }
    if parsed.invalid:
        out["invalid_tool_calls"] = [
            {"id": c.id, "name": c.name, "arguments": c.arguments, "error": c.error} for c in parsed.invalid
        ]
    return out


def wants_tools(overrides: dict[str, Any]) -> bool:
    return any(overrides.get(k) for k in TOOL_KEYS)


def tool_run(llm: CacheBlendLLM, messages: Sequence[ChatMessage], overrides: dict[str, Any]) -> ToolRun:
    """Answer ``messages`` with tools and/or a constraint (``chat``'s keyword arguments ``tools``,
    ``tool_choice``, ``parallel_tool_calls``, ``constraint``, ``schema_hint``): over the registered
    chunks found in the conversation before its first tool call, else as a plain chat."""
    start = next((i for i, m in enumerate(messages) if _starts_tool_exchange(m)), len(messages))
    head, turns = list(messages[:start]), [turn(m) for m in messages[start:]]
    if not head:
        raise ValueError("the conversation starts with a tool call: put the user's message before it")
    joined = "\n\n".join(m.content or "" for m in head if _role(m) != "assistant")
    request = llm.chunked_request(joined) or Request.plain_chat([turn(m) for m in head], joined)
    return serving_tool_run.start(
        llm.engine,
        request,
        llm.generation_settings(overrides),
        tools=overrides.get("tools"),
        tool_choice=overrides.get("tool_choice"),
        parallel=bool(overrides.get("parallel_tool_calls")),
        constraint=overrides.get("constraint"),
        hint=overrides.get("schema_hint") or "",
        turns=turns,
        batcher=llm.batcher,
    )


def _messages(user_msg: str | ChatMessage | None, chat_history: list[ChatMessage] | None) -> list[ChatMessage]:
    messages = list(chat_history or [])
    if isinstance(user_msg, str):
        user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
    if user_msg is not None:
        messages.append(user_msg)
    return messages


def _output_schema(output_cls: type[Any]) -> dict[str, Any]:
    return output_cls.model_json_schema() if hasattr(output_cls, "model_json_schema") else output_cls.schema()


class FunctionCallingMixin:
    """The ``FunctionCallingLLM`` hooks and a constrained ``structured_predict`` (mixed into
    :class:`~llama_index.cacheblend.CacheBlendLLM`)."""

    @property
    def supports_tools(self) -> bool:
        """Whether the engine's chat template renders tools (LlamaIndex's ``is_function_calling_model``)."""
        return supports_tools(self.engine.tokenizer)  # type: ignore[attr-defined]

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        require_tool_support(self.engine.tokenizer, "function calling")  # type: ignore[attr-defined]
        specs = [t.metadata.to_openai_tool() for t in tools]
        choice = tool_choice if tool_choice is not None else ("any" if tool_required else "auto")
        return {
            "messages": _messages(user_msg, chat_history),
            "tools": specs,
            "tool_choice": choice,
            "parallel_tool_calls": allow_parallel_tool_calls,
            **kwargs,
        }

    def _validate_chat_with_tools_response(
        self, response: ChatResponse, tools: Sequence[BaseTool], allow_parallel_tool_calls: bool = False, **kwargs: Any
    ) -> ChatResponse:
        if not allow_parallel_tool_calls:
            calls = response.message.additional_kwargs.get("tool_calls") or []
            if len(calls) > 1:
                response.message.additional_kwargs["tool_calls"] = calls[:1]
        return response

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        calls = response.message.additional_kwargs.get("tool_calls") or []
        if not calls and error_on_no_tool_call:
            invalid = response.message.additional_kwargs.get("invalid_tool_calls") or []
            why = f" ({len(invalid)} unparseable: {invalid[0]['error']})" if invalid else ""
            raise ValueError(f"expected at least one tool call, got none{why}")
        return [
            ToolSelection(
                tool_id=c.get("id") or uuid.uuid4().hex,
                tool_name=c["function"]["name"],
                tool_kwargs=json.loads(c["function"]["arguments"] or "{}"),
            )
            for c in calls
        ]

    # ------------------------------------------------------------------ structured prediction
    def _structured_kwargs(self, output_cls: type[Any], llm_kwargs: dict[str, Any] | None) -> dict[str, Any]:
        constraint, hint = schema_constraint(_output_schema(output_cls))
        return {**(llm_kwargs or {}), "constraint": constraint, "schema_hint": hint}

    def structured_predict(
        self, output_cls: type[Any], prompt: BasePromptTemplate, llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any
    ) -> Any:
        """An ``output_cls`` instance: the answer is constrained to its JSON schema (shown after the
        prompt), so it parses unless ``max_new_tokens`` cuts it. Another ``pydantic_program_mode``
        than the default takes LlamaIndex's own program."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:  # type: ignore[attr-defined]
            return super().structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)  # type: ignore[misc]
        messages = prompt.format_messages(llm=self, **prompt_args)  # type: ignore[arg-type]
        response = self.chat(messages, **self._structured_kwargs(output_cls, llm_kwargs))  # type: ignore[attr-defined]
        return _parse(output_cls, response)

    async def astructured_predict(
        self, output_cls: type[Any], prompt: BasePromptTemplate, llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any
    ) -> Any:
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:  # type: ignore[attr-defined]
            return await super().astructured_predict(output_cls, prompt, llm_kwargs, **prompt_args)  # type: ignore[misc]
        messages = prompt.format_messages(llm=self, **prompt_args)  # type: ignore[arg-type]
        response = await self.achat(messages, **self._structured_kwargs(output_cls, llm_kwargs))  # type: ignore[attr-defined]
        return _parse(output_cls, response)


def _parse(output_cls: type[Any], response: ChatResponse) -> Any:
    text = response.message.content or ""
    if (
        response.additional_kwargs.get("finish_reason") == "length"
        or response.message.additional_kwargs.get("finish_reason") == "length"
    ):
        raise ValueError(
            f"the answer was cut at max_new_tokens before its JSON was complete: raise max_new_tokens ({text[:80]!r}...)"
        )
    if hasattr(output_cls, "model_validate_json"):
        return output_cls.model_validate_json(text)
    return output_cls.parse_raw(text)
