"""ChatCacheBlend's tool calling and structured output on the tiny engine with a tool-calling chat
template: calls parsed into AIMessage.tool_calls (streamed too), tool histories, constrained
structured output, and the chunks' KV still reused with tools bound."""

from __future__ import annotations

import asyncio
from typing import Literal

import jsonschema
import pytest
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from pydantic import BaseModel, Field

from cacheblend_rag.chat.tools import ToolsUnsupported
from cacheblend_rag.engine.core import GenerationResult
from cacheblend_rag.serving import ToolRun
from cacheblend_rag.testing import make_engine
from langchain_cacheblend import ChatCacheBlend, rag_message
from langchain_cacheblend.tools import chunk_fields, message_fields

pytest.importorskip("llguidance")


class Forecast(BaseModel):
    """The weather forecast for a city."""

    city: str = Field(max_length=10, description="the city")
    unit: Literal["C", "F"]
    rain: bool


class Pick(BaseModel):
    """Pick a unit."""

    unit: Literal["C", "F"]


QUESTION = "Which city lies on the Thames, and what is its weather?"


@pytest.fixture
def tool_engine(tmp_path):
    eng = make_engine("llama", tools=True, store_dir=tmp_path / "kv", pipelined=False)
    yield eng
    eng.close()


def _chat(engine, **kw) -> ChatCacheBlend:
    return ChatCacheBlend(engine=engine, max_tokens=kw.pop("max_tokens", 120), **kw)


def _forecast_args_ok(args: dict) -> None:
    jsonschema.validate(args, dict(Forecast.model_json_schema(), additionalProperties=False))


# ----------------------------------------------------------------------------- templates without tools
def test_bind_tools_on_a_template_without_tools_names_a_model_with_them(tiny_engine):
    chat = _chat(tiny_engine)
    with pytest.raises(ToolsUnsupported, match="Qwen2.5-Coder-0.5B"):
        chat.bind_tools([Forecast])
    with pytest.raises(ToolsUnsupported, match="Qwen2.5-Coder-0.5B"):
        chat.with_structured_output(Forecast, method="function_calling")
    # Structured output by a JSON schema needs no tool support.
    assert isinstance(chat.with_structured_output(Forecast).invoke("The weather in London?"), Forecast)


# ----------------------------------------------------------------------------- tool calls
@pytest.mark.parametrize("choice", ["Forecast", "any"])
def test_forced_call_is_parsed_into_tool_calls_invoked_and_streamed(tool_engine, documents, choice):
    model = _chat(tool_engine).bind_tools([Forecast], tool_choice=choice)
    message = rag_message(QUESTION, documents)
    result = model.invoke([message])
    assert result.content == "" and result.invalid_tool_calls == [] and len(result.tool_calls) == 1
    call = result.tool_calls[0]
    assert call["name"] == "Forecast" and call["type"] == "tool_call" and call["id"].startswith("call_")
    _forecast_args_ok(call["args"])
    assert result.response_metadata["tool_calls"] == len(result.tool_calls)
    full = None
    for chunk in model.stream([message]):
        full = chunk if full is None else full + chunk
    assert isinstance(full, AIMessageChunk) and full.content == ""
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [(c["name"], c["args"]) for c in result.tool_calls]
    again = asyncio.run(model.ainvoke([message]))
    assert [(c["name"], c["args"]) for c in again.tool_calls] == [(c["name"], c["args"]) for c in result.tool_calls]


def test_chunks_are_reused_with_tools_bound_and_in_a_tool_history(tool_engine, documents):
    """With tools the chunks are cached behind the tools' prefix: the first call computes them, the
    next reads them, and so does the turn after the tool's result (same prefix, same chunks)."""
    model = _chat(tool_engine).bind_tools([Forecast], tool_choice="Forecast")
    message = rag_message(QUESTION, documents)
    first = model.invoke([message])
    assert first.response_metadata["chunk_misses"] == len(documents)
    tool_engine.flush()
    second = model.invoke([message])
    meta = second.response_metadata
    assert meta["chunk_hits"] == len(documents) and meta["cache_read_tokens"] == meta["context_tokens"] > 0
    assert second.usage_metadata["input_token_details"]["cache_read"] == meta["context_tokens"]
    history = [message, second, ToolMessage("12 degrees, light rain", tool_call_id=second.tool_calls[0]["id"])]
    answer = _chat(tool_engine, max_tokens=4).bind_tools([Forecast]).invoke(history)
    meta = answer.response_metadata
    assert meta["mode"] == "cacheblend" and meta["chunk_source"] == "explicit"
    assert meta["chunk_hits"] == len(documents) and meta["cache_read_tokens"] == meta["context_tokens"]
    assert meta["question"] == QUESTION  # the tool exchange follows the question as chat turns


def test_a_tool_history_without_chunks_is_a_plain_chat_with_the_tools(tool_engine):
    history = [
        HumanMessage("Forecast for Paris?"),
        AIMessage("", tool_calls=[{"name": "Forecast", "args": {"city": "Paris", "unit": "C", "rain": False}, "id": "c1"}]),
        ToolMessage("21 degrees", tool_call_id="c1"),
    ]
    answer = _chat(tool_engine, max_tokens=3).bind_tools([Forecast]).invoke(history)
    assert answer.response_metadata["mode"] == "plain_chat"
    # The list-content form (text and tool-use blocks) is read as its text and its tool_calls.
    history[1] = AIMessage(
        [{"type": "text", "text": "Checking."}, {"type": "tool_use", "id": "c1", "name": "Forecast", "input": {}}],
        tool_calls=history[1].tool_calls,
    )
    assert _chat(tool_engine, max_tokens=3).bind_tools([Forecast]).invoke(history).response_metadata["mode"] == "plain_chat"


def test_tool_choice_none_keeps_the_tools_prefix_and_answers_without_a_call(tool_engine, documents):
    """ "none" renders the tools as every other choice does (same prefix, same chunk caches) and
    constrains the answer to text that is no call."""
    message = rag_message(QUESTION, documents)
    auto = _chat(tool_engine, max_tokens=2).bind_tools([Forecast]).invoke([message])
    tool_engine.flush()
    none = _chat(tool_engine, max_tokens=8).bind_tools([Forecast], tool_choice="none").invoke([message])
    assert none.response_metadata["prompt_tokens"] == auto.response_metadata["prompt_tokens"]
    assert none.response_metadata["chunk_hits"] == len(documents)
    assert none.tool_calls == [] and none.content[:1] not in ("", " ", "{", "[", "`", "<")


def test_bad_tool_choices_are_refused_by_name(tool_engine):
    with pytest.raises(ValueError, match="nor a bound tool"):
        _chat(tool_engine).bind_tools([Forecast], tool_choice="search")


def test_forced_calls_through_the_batcher(tool_engine, documents):
    model = _chat(tool_engine, max_batch=2).bind_tools([Forecast, Pick], tool_choice="Pick")
    results = model.batch([[rag_message(QUESTION, documents)], [rag_message("Which unit?", documents[:2])]])
    for r in results:
        assert [c["name"] for c in r.tool_calls] == ["Pick"] and r.tool_calls[0]["args"]["unit"] in ("C", "F")


class _Answer:
    """A finished run's stand-in: these deltas, then this result."""

    def __init__(self, text: str, cut: int = 4):
        self.deltas = [text[i : i + cut] for i in range(0, len(text), cut)]
        self.request, self.cancelled = None, None
        self.result = GenerationResult(text, [], 0.0, 0.0, "stop", {})

    def __iter__(self):
        yield from self.deltas


def test_valid_invalid_and_multiple_calls_become_tool_calls_and_invalid_tool_calls():
    text = (
        'Two calls.\n<tool_call>\n{"name": "Pick", "arguments": {"unit": "C"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "Forecast", "arguments": {"city": "Oslo", "unit": "F", "rain": true}}\n</tool_call>\n'
        '<tool_call>\n{"name": "Pick", "arguments": {"unit": \n</tool_call>'
    )
    run = ToolRun(_Answer(text), parse=True)  # type: ignore[arg-type]
    streamed = "".join(run)
    assert streamed == "Two calls." and run.result.text == "Two calls."
    message = AIMessage(content=run.result.text, **message_fields(run))
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [
        ("Pick", {"unit": "C"}),
        ("Forecast", {"city": "Oslo", "unit": "F", "rain": True}),
    ]
    assert len(message.invalid_tool_calls) == 1 and message.invalid_tool_calls[0]["name"] == "Pick"
    assert "not valid JSON" in message.invalid_tool_calls[0]["error"]
    chunk = AIMessageChunk(content="Two calls.") + AIMessageChunk(content="", **chunk_fields(run))
    assert [c["name"] for c in chunk.tool_calls] == ["Pick", "Forecast"] and len(chunk.invalid_tool_calls) == 1


# ----------------------------------------------------------------------------- structured output
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_parses_into_the_schema(tool_engine, documents, method):
    structured = _chat(tool_engine).with_structured_output(Forecast, method=method)
    result = structured.invoke([rag_message(QUESTION, documents)])
    assert isinstance(result, Forecast)
    streamed = list(structured.stream([rag_message(QUESTION, documents)]))
    assert streamed and streamed[-1] == result
    as_dict = _chat(tool_engine).with_structured_output(Forecast.model_json_schema(), method=method).invoke(QUESTION)
    _forecast_args_ok(as_dict)


def test_json_mode_is_a_json_object(tool_engine):
    result = _chat(tool_engine, max_tokens=60).with_structured_output(None, method="json_mode").invoke("Reply in JSON.")
    assert isinstance(result, dict)


def test_include_raw_returns_the_message_and_a_parsing_error_when_the_budget_cuts_it(tool_engine):
    ok = _chat(tool_engine).with_structured_output(Forecast, include_raw=True).invoke(QUESTION)
    assert isinstance(ok["parsed"], Forecast) and ok["parsing_error"] is None and isinstance(ok["raw"], AIMessage)
    cut = _chat(tool_engine, max_tokens=3).with_structured_output(Forecast, include_raw=True).invoke(QUESTION)
    assert cut["parsed"] is None and cut["parsing_error"] is not None
    assert cut["raw"].response_metadata["finish_reason"] == "length"
    with pytest.raises(OutputParserException):
        _chat(tool_engine, max_tokens=3).with_structured_output(Forecast).invoke(QUESTION)


def test_structured_output_shows_the_schema_after_the_question_and_keeps_the_chunks(tool_engine, documents):
    structured = _chat(tool_engine).with_structured_output(Forecast, include_raw=True)
    structured.invoke([rag_message(QUESTION, documents)])
    tool_engine.flush()
    raw = structured.invoke([rag_message(QUESTION, documents)])["raw"]
    meta = raw.response_metadata
    assert meta["question"].startswith(QUESTION) and '"unit": {"enum": ["C", "F"]' in meta["question"]
    assert meta["chunk_hits"] == len(documents) and meta["cache_read_tokens"] == meta["context_tokens"]


def test_structured_output_refuses_unknown_methods_and_arguments(tool_engine):
    chat = _chat(tool_engine)
    with pytest.raises(ValueError, match="method='xml'"):
        chat.with_structured_output(Forecast, method="xml")
    with pytest.raises(ValueError, match="unsupported arguments"):
        chat.with_structured_output(Forecast, temperature=1)
