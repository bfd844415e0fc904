"""Tool calling and structured output for :class:`~langchain_cacheblend.ChatCacheBlend`.

``bind_tools`` renders the tools through the model's chat template (its system turn, for Qwen2.5)
and parses the answer's ``<tool_call>`` blocks into ``AIMessage.tool_calls``;
``tool_choice="any"`` or a tool's name constrains the answer to well-formed calls.
``with_structured_output`` constrains the answer to the schema's JSON (``method="json_schema"``,
the default), to a JSON object (``"json_mode"``) or to a forced tool call
(``"function_calling"``), so the answer always parses unless ``max_tokens`` cuts it.

Retrieved chunks still reach the engine as chunks: the conversation up to the first tool call
is split as usual (flagged chunk blocks, or registered chunks found in the text), and the tool
exchange after it is rendered by the chat template after the question (``turns``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticOutputParser, PydanticToolsParser
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

from cacheblend_rag.chat.tools import check_choice, normalize_tools, require_tool_support
from cacheblend_rag.decode.constraints import response_format_constraint
from cacheblend_rag.serving import Request, ToolRun, tool_run

# What bind_tools / with_structured_output bind, and _start takes out of a call's arguments.
TOOL_KWARGS = ("tools", "tool_choice", "response_format", "parallel_tool_calls")
METHODS = ("json_schema", "function_calling", "json_mode")


def _text(content: Any, what: str) -> str:
    """A message's text: a string, or its text blocks joined (tool-use blocks, which repeat the
    message's ``tool_calls``, are left out)."""
    if isinstance(content, str):
        return content
    out = []
    for block in content:
        if isinstance(block, str):
            out.append(block)
        elif isinstance(block, Mapping) and block.get("type") == "text":
            out.append(str(block.get("text", "")))
        elif isinstance(block, Mapping) and block.get("type") in ("tool_use", "tool_call", "function_call"):
            continue
        else:
            kind = block.get("type") if isinstance(block, Mapping) else type(block).__name__
            raise ValueError(f"{what}: content block of type {kind!r} is not supported: CacheBlend models read text only")
    return "".join(out)


def turn(message: BaseMessage) -> dict[str, Any]:
    """A message in the chat template's format (role, content, tool_calls, name)."""
    if isinstance(message, ToolMessage):
        return {
            "role": "tool",
            "content": _text(message.content, "a ToolMessage"),
            "name": message.name or "",
            "tool_call_id": message.tool_call_id,
        }
    if isinstance(message, AIMessage):
        out: dict[str, Any] = {"role": "assistant", "content": _text(message.content, "an AIMessage")}
        if message.tool_calls:
            out["tool_calls"] = [
                {"type": "function", "id": c.get("id"), "function": {"name": c["name"], "arguments": c["args"]}}
                for c in message.tool_calls
            ]
        return out
    if isinstance(message, HumanMessage):
        return {"role": "user", "content": _text(message.content, "a HumanMessage")}
    if isinstance(message, SystemMessage):
        return {"role": "system", "content": _text(message.content, "a SystemMessage")}
    raise ValueError(
        f"{type(message).__name__} is not supported: CacheBlend chat models take system, human, AI and tool messages"
    )


def _starts_tool_exchange(message: BaseMessage) -> bool:
    return isinstance(message, ToolMessage) or (isinstance(message, AIMessage) and bool(message.tool_calls))


def message_fields(run: Any) -> dict[str, Any]:
    """``AIMessage`` fields for a finished run's tool calls (none for an ordinary run)."""
    if not isinstance(run, ToolRun) or not (run.parsed.calls or run.parsed.invalid):
        return {}
    return {
        "tool_calls": [{"name": c.name, "args": c.arguments, "id": c.id, "type": "tool_call"} for c in run.parsed.calls],
        "invalid_tool_calls": [
            {"name": c.name, "args": c.arguments, "id": c.id, "error": c.error, "type": "invalid_tool_call"}
            for c in run.parsed.invalid
        ],
    }


def chunk_fields(run: Any) -> dict[str, Any]:
    """``AIMessageChunk`` fields for a finished run's tool calls: one complete chunk per call. An
    invalid call's arguments are its text as a JSON string: LangChain reads chunk arguments as
    partial JSON, and a string (not an object) is what keeps it among ``invalid_tool_calls``."""
    if not isinstance(run, ToolRun) or not (run.parsed.calls or run.parsed.invalid):
        return {}
    chunks = [
        {"name": c.name, "args": json.dumps(c.arguments), "id": c.id, "index": i, "type": "tool_call_chunk"}
        for i, c in enumerate(run.parsed.calls)
    ]
    chunks += [
        {"name": c.name, "args": json.dumps(c.text), "id": c.id, "index": len(chunks) + i, "type": "tool_call_chunk"}
        for i, c in enumerate(run.parsed.invalid)
    ]
    return {"tool_call_chunks": chunks}


class ToolCallingMixin:
    """``bind_tools``, ``with_structured_output`` and the request path behind them (mixed into
    :class:`~langchain_cacheblend.ChatCacheBlend`)."""

    def bind_tools(
        self,
        tools: Sequence[Mapping[str, Any] | type | Callable | Any],
        *,
        tool_choice: str | bool | Mapping[str, Any] | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable:
        """Offer ``tools`` (functions, pydantic classes, LangChain tools or OpenAI tool dicts) to the
        model: the chat template renders them and the answer's calls land in ``tool_calls``.

        ``tool_choice``: None or "auto" (the model decides), "none" (an answer, constrained to be
        no call), "any" or "required" (a call, constrained to the tools' schemas), or a tool's name
        (one call to that tool, constrained). The tools are in the prompt whatever the choice, so
        every step of a conversation reuses the same chunk caches. ``parallel_tool_calls=True`` allows several calls in one answer (else
        the answer ends after its first call). Needs a chat template that renders tools: the
        bundled SmolLM2's does not, and is refused here naming one that does."""
        require_tool_support(self.get_engine().tokenizer, "bind_tools")  # type: ignore[attr-defined]
        formatted = list(normalize_tools([convert_to_openai_tool(t, strict=strict) for t in tools]))
        choice = check_choice(tool_choice, formatted)
        return self.bind(tools=formatted, tool_choice=choice, **kwargs)  # type: ignore[attr-defined]

    def with_structured_output(
        self,
        schema: Mapping[str, Any] | type | None = None,
        *,
        method: str = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable:
        """Answers as ``schema`` (a pydantic class, a TypedDict, a JSON schema or an OpenAI tool
        dict): a pydantic instance for a pydantic class, else a dict.

        ``method``: "json_schema" (default: the answer is constrained to the schema's JSON, and
        the schema is shown after the question), "json_mode" (a JSON object; with a schema,
        constrained and shown as for "json_schema", so it parses into it) or "function_calling" (a
        constrained call to the schema as a tool; needs a template with tool support). ``include_raw=True`` returns ``{"raw", "parsed",
        "parsing_error"}`` instead of raising when parsing fails (an answer cut by ``max_tokens``)."""
        if kwargs:
            raise ValueError(
                f"unsupported arguments {sorted(kwargs)}: with_structured_output takes schema, method, include_raw, strict"
            )
        if method not in METHODS:
            raise ValueError(f"method={method!r}: choose one of {', '.join(METHODS)}")
        if schema is None and method != "json_mode":
            raise ValueError(f"method={method!r} needs a schema (only json_mode works without one)")
        pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        traced = {"kwargs": {"method": method}, "schema": schema} if schema is not None else None
        parser: Runnable
        if method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, strict=strict, ls_structured_output_format=traced)
            parser = (
                PydanticToolsParser(tools=[schema], first_tool_only=True)
                if pydantic  # type: ignore[list-item]
                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
            )
        else:
            if method == "json_schema" or schema is not None:  # json_mode with a schema: constrained to it too
                json_schema = convert_to_json_schema(schema)  # type: ignore[arg-type]
                fmt = {"type": "json_schema", "json_schema": {"name": json_schema.get("title", "answer"), "schema": json_schema}}
            else:
                fmt = {"type": "json_object"}
            extra = {"ls_structured_output_format": traced} if traced else {}
            llm = self.bind(response_format=fmt, **extra)  # type: ignore[attr-defined]
            parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()  # type: ignore[arg-type]
        if not include_raw:
            return llm | parser
        parse = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parse.with_fallbacks([fallback], exception_key="parsing_error")

    # ------------------------------------------------------------------ the request path
    def _request_from_messages(self, messages: Sequence[BaseMessage]) -> Request:
        """As usual up to the first tool call; the tool exchange from there on becomes the turns
        after the question (or, without chunks, the rest of the plain chat)."""
        start = next((i for i, m in enumerate(messages) if _starts_tool_exchange(m)), None)
        if start is None:
            return super()._request_from_messages(messages)  # type: ignore[misc]
        head = super()._request_from_messages(messages[:start])  # type: ignore[misc]
        return head.with_tools((), [turn(m) for m in messages[start:]])

    def _start(self, request: Request, stop: Sequence[str] | None, overrides: dict[str, Any]) -> Any:
        calls = {k: overrides.pop(k) for k in TOOL_KWARGS if k in overrides}
        if not calls and not request.turns:
            return super()._start(request, stop, overrides)  # type: ignore[misc]
        constraint, hint = None, ""
        if calls.get("response_format") is not None:
            constraint, hint = response_format_constraint(calls["response_format"])
        return tool_run.start(
            self.get_engine(),  # type: ignore[attr-defined]
            request,
            self.generation_settings(stop, overrides),  # type: ignore[attr-defined]
            tools=calls.get("tools"),
            tool_choice=calls.get("tool_choice"),
            parallel=bool(calls.get("parallel_tool_calls")),
            constraint=constraint,
            hint=hint,
            batcher=self.batcher,  # type: ignore[attr-defined]
        )
