"""API request bodies to engine requests (the question, its documents, or a plain chat) and the
run that answers one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cacheblend_rag.bounds import parse_json
from cacheblend_rag.chat.messages import is_chunk_part, split_messages
from cacheblend_rag.chat.tools import check_choice
from cacheblend_rag.server.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, GenerationRequest
from cacheblend_rag.serving import Request, Run, tool_run


def chat_request(body: ChatCompletionRequest) -> Request:
    """Documents from the ``documents`` field or from flagged content parts (not both); the rest
    of the messages up to the tool exchange is the question, and the exchange (an assistant's
    ``tool_calls``, the ``tool`` results, what follows them) the turns after it. No documents:
    the messages as a plain chat."""
    start = next((i for i, m in enumerate(body.messages) if m.role == "tool" or m.tool_calls), len(body.messages))
    head, exchange = body.messages[:start], body.messages[start:]
    split = split_messages([(m.role, m.content or "") for m in head])
    if body.documents and split.chunks:
        raise ValueError(
            "documents were passed both in the 'documents' field and as cacheblend_chunk content parts: use one of the two"
        )
    chunks = body.documents or split.chunks
    request = Request.over_chunks(split.question, chunks) if chunks else Request.plain_chat(split.messages, split.question)
    return request.with_tools((), _turns(exchange)) if exchange else request


def completion_request(body: CompletionRequest) -> Request:
    """With ``documents``, the prompt is the question over them; without, it is one user turn of
    the model's chat template (as the LangChain and LlamaIndex LLMs answer a plain prompt)."""
    if body.documents:
        return Request.over_chunks(body.text, body.documents)
    return Request.plain_chat([{"role": "user", "content": body.text}], body.text)


def message_chars(body: GenerationRequest) -> int:
    """Characters of ``body``'s own text outside its documents (``max_message_chars``): the
    messages' text (chunk parts are documents, with their own limits), the tool calls' ids, names
    and arguments, a completion's prompt. Constant work per message and part."""
    if isinstance(body, CompletionRequest):
        return len(body.text)
    total = 0
    for m in getattr(body, "messages", ()):
        if isinstance(m.content, str):
            total += len(m.content)
        elif isinstance(m.content, list):
            for part in m.content:
                if isinstance(part, str):
                    total += len(part)
                elif isinstance(part, Mapping) and not is_chunk_part(part) and isinstance(part.get("text"), str):
                    total += len(part["text"])
        for call in m.tool_calls or ():
            total += len(call.id) + len(call.function.name) + len(call.function.arguments)
        total += len(m.tool_call_id or "")
    return total


def start_run(engine: Any, body: GenerationRequest, request: Request, batcher: Any) -> Run | tool_run.ToolRun:
    """The run answering ``request`` with the body's settings: a schema's hint after the question
    (``response_format``); with tools or a tool exchange, the integrations' tool path
    (``serving.tool_run``), whose ``parsed`` calls the response carries.

    Runs on the job's relay thread, never on the event loop: the schema's and the tools' checks and
    compilation (bounded by ``cacheblend_rag.bounds``) happen here."""
    constraint, hint = body.structured()
    tools = getattr(body, "tools", None)
    choice = getattr(body, "tool_choice", None)
    if tools or request.turns:
        return tool_run.start(
            engine,
            request,
            body.settings(),
            tools=tools,
            tool_choice=choice,
            parallel=bool(getattr(body, "parallel_tool_calls", False)),
            constraint=constraint,
            hint=hint,
            batcher=batcher,
        )
    if choice is not None:
        check_choice(choice, ())  # "required" or a tool's name without tools: a 400, never ignored
    return Run(engine, request.with_hint(hint).with_settings(**body.settings(), constraint=constraint), batcher=batcher)


def _turns(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI's tool exchange in the chat template's format: a call's arguments as an object (the
    wire carries JSON text), a tool result named after the call it answers."""
    names: dict[str, str] = {}
    turns: list[dict[str, Any]] = []
    for m in messages:
        if isinstance(m.content, list):
            raise ValueError(f"a {m.role} message of the tool exchange must have string content")
        turn: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            turn["tool_calls"] = []
            for call in m.tool_calls:
                arguments = parse_json(call.function.arguments or "{}", f"tool call {call.id[:64]!r}: its arguments")
                names[call.id] = call.function.name
                turn["tool_calls"].append(
                    {"type": "function", "id": call.id, "function": {"name": call.function.name, "arguments": arguments}}
                )
        if m.role == "tool":
            turn.update(tool_call_id=m.tool_call_id, name=names.get(m.tool_call_id or "", ""))
        turns.append(turn)
    return turns
