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
from typing import TYPE_CHECKING, Any, Iterator, List, Optional, Sequence, Type, Union

from cacheblend_rag.constraints import Grammar, closed_objects
from cacheblend_rag.engine import GenerationResult, GenerationStream
from cacheblend_rag.plain import chat_text, plain_stream, sampling_params
from cacheblend_rag.tools import CallStream, plan_tools, require_tool_support, supports_tools, tool_names
from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole, TextBlock
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.types import PydanticProgramMode

if TYPE_CHECKING:
    from llama_index.core.prompts.base import BasePromptTemplate
    from llama_index.core.tools.types import BaseTool

    from .llm import CacheBlendLLM

# The chat() keyword arguments that take the tool path (the rest are generation settings).
TOOL_KEYS = ("tools", "tool_choice", "constraint", "schema_hint")
SCHEMA_HINT = "Answer with a JSON object that matches this JSON schema:\n{schema}"


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
            out.append({"type": "function", "function": {"name": block.tool_name,
                                                         "arguments": json.loads(args) if isinstance(args, str) else args}})
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


class ToolStream:
    """A :class:`~cacheblend_rag.engine.GenerationStream` whose answer may hold tool calls: iterating
    yields the text outside them; ``result.text`` is that text and ``additional_kwargs`` the calls
    (OpenAI's format, what ``get_tool_calls_from_response`` reads)."""

    def __init__(self, stream: GenerationStream, parse: bool, chunk_report: dict[str, Any], names: Sequence[str] = ()):
        self._stream, self._parse, self._names = stream, parse, tuple(names)
        self.chunk_report = chunk_report
        self.result: Optional[GenerationResult] = None
        self.additional_kwargs: dict[str, Any] = {}

    def __iter__(self) -> Iterator[str]:
        calls = CallStream(self._names)
        for delta in self._stream:
            ready = calls.feed(delta) if self._parse else delta
            if ready:
                yield ready
        res = self._stream.result
        assert res is not None
        if not self._parse:
            self.result = res
            return
        rest = calls.finish(res.text)
        if rest:
            yield rest
        parsed = calls.parsed
        self.additional_kwargs = {"tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in parsed.calls
        ]}
        if parsed.invalid:
            self.additional_kwargs["invalid_tool_calls"] = [
                {"id": c.id, "name": c.name, "arguments": c.arguments, "error": c.error} for c in parsed.invalid]
        stats = dict(res.stats, tool_calls=len(parsed.calls), invalid_tool_calls=len(parsed.invalid))
        self.result = GenerationResult(parsed.content, res.token_ids, res.ttft_s, res.total_s, res.finish_reason, stats,
                                       res.token_times_s)


def wants_tools(overrides: dict[str, Any]) -> bool:
    return any(overrides.get(k) for k in TOOL_KEYS)


def tool_stream(llm: "CacheBlendLLM", messages: Sequence[ChatMessage], overrides: dict[str, Any]) -> ToolStream:
    """Answer ``messages`` with tools and/or a constraint (``chat``'s keyword arguments
    ``tools``, ``tool_choice``, ``constraint``, ``schema_hint``)."""
    engine = llm.engine
    plan = plan_tools(overrides.get("tools"), overrides.get("tool_choice"), engine.tokenizer, bool(overrides.get("parallel_tool_calls")))
    constraint = overrides.get("constraint")
    if constraint is not None and plan.parse and plan.constraint is not None:
        raise ValueError("a forced tool call and a constraint cannot be combined: choose one")
    constraint = constraint if constraint is not None else plan.constraint  # a given one is the answer's grammar
    extra: dict[str, Any] = {"tools": plan.tools} if plan.tools else {}
    stops = plan.stops
    start = next((i for i, m in enumerate(messages) if _starts_tool_exchange(m)), len(messages))
    head, turns = list(messages[:start]), [turn(m) for m in messages[start:]]
    if not head:
        raise ValueError("the conversation starts with a tool call: put the user's message before it")
    hint = overrides.get("schema_hint") or ""
    gen = llm.generation_kwargs(**overrides)
    if stops:
        given = gen.get("stop") or []
        gen["stop"] = [*([given] if isinstance(given, str) else given), *stops]
    joined = "\n\n".join(m.content or "" for m in head if _role(m) != "assistant")
    match = llm.chunk_registry.match(joined) if llm.match_chunks else None
    question = match.remainder() if match is not None else ""
    if match is not None and match.spans and question.strip():
        question = f"{question}\n\n{hint}" if hint else question
        stream = engine.stream(question, match.chunks, **gen, constraint=constraint, turns=turns, **extra)
        report = {"chunk_source": "matched", "chunks_matched": len(match.spans)}
    else:
        if match is not None and not match.spans:
            llm._warn_no_match(len(llm.chunk_registry))
        dicts = [turn(m) for m in head]
        if hint:
            last = max((i for i, d in enumerate(dicts) if d["role"] == "user"), default=None)
            if last is None:
                dicts.append({"role": "user", "content": hint})
            else:
                dicts[last]["content"] = f"{dicts[last]['content']}\n\n{hint}"
        text = chat_text(engine.tokenizer, dicts + turns, extra.get("tools"))
        stream = plain_stream(engine, text, sampling_params(dict(gen, constraint=constraint)))
        report = {"chunk_source": "none", "chunks_matched": 0}
    return ToolStream(stream, plan.parse, report, tool_names(plan.tools))


def _messages(user_msg: Union[str, ChatMessage, None], chat_history: Optional[List[ChatMessage]]) -> list[ChatMessage]:
    messages = list(chat_history or [])
    if isinstance(user_msg, str):
        user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
    if user_msg is not None:
        messages.append(user_msg)
    return messages


def _output_schema(output_cls: Type[Any]) -> dict[str, Any]:
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
        tools: Sequence["BaseTool"],
        user_msg: Union[str, ChatMessage, None] = None,
        chat_history: Optional[List[ChatMessage]] = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: Union[str, dict, None] = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        require_tool_support(self.engine.tokenizer, "function calling")  # type: ignore[attr-defined]
        specs = [t.metadata.to_openai_tool() for t in tools]
        choice = tool_choice if tool_choice is not None else ("any" if tool_required else "auto")
        return {"messages": _messages(user_msg, chat_history), "tools": specs, "tool_choice": choice,
                "parallel_tool_calls": allow_parallel_tool_calls, **kwargs}

    def _validate_chat_with_tools_response(
        self, response: ChatResponse, tools: Sequence["BaseTool"], allow_parallel_tool_calls: bool = False, **kwargs: Any
    ) -> ChatResponse:
        if not allow_parallel_tool_calls:
            calls = response.message.additional_kwargs.get("tool_calls") or []
            if len(calls) > 1:
                response.message.additional_kwargs["tool_calls"] = calls[:1]
        return response

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> List[ToolSelection]:
        calls = response.message.additional_kwargs.get("tool_calls") or []
        if not calls and error_on_no_tool_call:
            invalid = response.message.additional_kwargs.get("invalid_tool_calls") or []
            why = f" ({len(invalid)} unparseable: {invalid[0]['error']})" if invalid else ""
            raise ValueError(f"expected at least one tool call, got none{why}")
        return [ToolSelection(tool_id=c.get("id") or uuid.uuid4().hex, tool_name=c["function"]["name"],
                              tool_kwargs=json.loads(c["function"]["arguments"] or "{}")) for c in calls]

    # ------------------------------------------------------------------ structured prediction
    def _structured_kwargs(self, output_cls: Type[Any], llm_kwargs: Optional[dict[str, Any]]) -> dict[str, Any]:
        schema = _output_schema(output_cls)
        shown = {k: v for k, v in schema.items() if k != "title"}
        return {**(llm_kwargs or {}), "constraint": Grammar.json_schema(closed_objects(schema)),
                "schema_hint": SCHEMA_HINT.format(schema=json.dumps(shown))}

    def structured_predict(
        self, output_cls: Type[Any], prompt: "BasePromptTemplate", llm_kwargs: Optional[dict[str, Any]] = None, **prompt_args: Any
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
        self, output_cls: Type[Any], prompt: "BasePromptTemplate", llm_kwargs: Optional[dict[str, Any]] = None, **prompt_args: Any
    ) -> Any:
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:  # type: ignore[attr-defined]
            return await super().astructured_predict(output_cls, prompt, llm_kwargs, **prompt_args)  # type: ignore[misc]
        messages = prompt.format_messages(llm=self, **prompt_args)  # type: ignore[arg-type]
        response = await self.achat(messages, **self._structured_kwargs(output_cls, llm_kwargs))  # type: ignore[attr-defined]
        return _parse(output_cls, response)


def _parse(output_cls: Type[Any], response: ChatResponse) -> Any:
    text = response.message.content or ""
    if response.additional_kwargs.get("finish_reason") == "length" or response.message.additional_kwargs.get("finish_reason") == "length":
        raise ValueError(f"the answer was cut at max_new_tokens before its JSON was complete: raise max_new_tokens ({text[:80]!r}...)")
    if hasattr(output_cls, "model_validate_json"):
        return output_cls.model_validate_json(text)
    return output_cls.parse_raw(text)
