"""CacheBlendLLM's function calling (LlamaIndex's FunctionCallingLLM hooks) and constrained
structured prediction, on the tiny engine with and without a tool-calling chat template."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from llama_index.core.llms import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel, Field

from cacheblend_rag.chat.matching import ChunkRegistry
from cacheblend_rag.chat.tools import ToolsUnsupported
from cacheblend_rag.testing import SAMPLE_CHUNKS, make_engine
from llama_index.cacheblend import CacheBlendLLM

pytest.importorskip("llguidance")


class Forecast(BaseModel):
    """The weather forecast for a city."""

    city: str = Field(max_length=10)
    unit: Literal["C", "F"]
    rain: bool


def forecast(city: str, unit: Literal["C", "F"], rain: bool) -> str:
    """The weather forecast for a city."""
    return f"{city}: 20 {unit}, {'rain' if rain else 'dry'}"


TOOL = FunctionTool.from_defaults(fn=forecast)
# The tool's parameters, bounded so that a random model's call ends inside the token budget.
TOOL.metadata.fn_schema = Forecast


@pytest.fixture
def tool_llm(tmp_path):
    eng = make_engine("llama", tools=True, store_dir=tmp_path / "kv", pipelined=False)
    yield CacheBlendLLM(engine=eng, max_new_tokens=120)
    eng.close()


@pytest.fixture
def plain_llm(tmp_path):
    eng = make_engine("llama", store_dir=tmp_path / "kv", pipelined=False)
    yield CacheBlendLLM(engine=eng, max_new_tokens=120)
    eng.close()


def test_function_calling_follows_the_template(tool_llm, plain_llm):
    assert tool_llm.metadata.is_function_calling_model and not plain_llm.metadata.is_function_calling_model
    with pytest.raises(ToolsUnsupported, match="Qwen2.5-Coder-0.5B"):
        plain_llm.chat_with_tools([TOOL], user_msg="Forecast for Oslo?")


def test_a_required_call_is_a_tool_selection_and_predict_and_call_runs_it(tool_llm):
    response = tool_llm.chat_with_tools([TOOL], user_msg="Forecast for Oslo?", tool_required=True)
    calls = tool_llm.get_tool_calls_from_response(response)
    assert len(calls) == 1 and calls[0].tool_name == "forecast" and calls[0].tool_id.startswith("call_")
    Forecast(**calls[0].tool_kwargs)  # the arguments match the tool's schema
    assert response.message.content == ""
    output = tool_llm.predict_and_call([TOOL], user_msg="Forecast for Oslo?", tool_required=True)
    assert output.response == forecast(**calls[0].tool_kwargs)


def test_streamed_calls_arrive_with_the_last_response(tool_llm):
    responses = list(tool_llm.stream_chat_with_tools([TOOL], user_msg="Forecast for Oslo?", tool_required=True))
    assert [c.tool_name for c in tool_llm.get_tool_calls_from_response(responses[-1])] == ["forecast"]
    assert "<tool_call>" not in "".join(r.delta or "" for r in responses)


def test_no_call_raises_only_when_asked(tool_llm):
    response = tool_llm.chat([ChatMessage(role="user", content="Hello")], max_new_tokens=2)
    assert tool_llm.get_tool_calls_from_response(response, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="expected at least one tool call"):
        tool_llm.get_tool_calls_from_response(response)


def test_a_tool_history_over_registered_chunks_reuses_their_caches(tool_llm):
    """The chunks found in the conversation before its first tool call are the engine's chunks,
    cached behind the tools' prefix; the tool exchange follows the question."""
    engine = tool_llm.engine
    ChunkRegistry.for_engine(engine).add(SAMPLE_CHUNKS[:2])
    user = ChatMessage(
        role="user", content="Context:\n" + "\n\n".join(SAMPLE_CHUNKS[:2]) + "\n\nForecast where the Eiffel Tower is?"
    )
    history = [
        user,
        ChatMessage(
            role="assistant",
            content="",
            additional_kwargs={
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "forecast", "arguments": '{"city": "Paris", "unit": "C", "rain": false}'},
                    }
                ]
            },
        ),
        ChatMessage(role="tool", content="Paris: 20 C, dry", additional_kwargs={"tool_call_id": "c1", "name": "forecast"}),
    ]
    tools = [TOOL.metadata.to_openai_tool()]
    first = tool_llm.chat(history, tools=tools, max_new_tokens=2)
    stats = first.message.additional_kwargs["cacheblend"]
    assert stats["chunk_source"] == "matched" and stats["chunks_matched"] == 2 and stats["chunk_misses"] == 2
    engine.flush()
    second = tool_llm.chat(history, tools=tools, max_new_tokens=2).message.additional_kwargs["cacheblend"]
    assert second["chunk_hits"] == 2 and second["chunk_misses"] == 0


@pytest.mark.parametrize("which", ["tool_llm", "plain_llm"])
def test_structured_predict_is_constrained_to_the_schema(which, request):
    llm = request.getfixturevalue(which)
    prompt = PromptTemplate("The forecast for {city}, as JSON.")
    result = llm.structured_predict(Forecast, prompt, city="Oslo")
    assert isinstance(result, Forecast)
    assert isinstance(asyncio.run(llm.astructured_predict(Forecast, prompt, city="Oslo")), Forecast)


def test_structured_predict_cut_by_the_budget_says_so(plain_llm):
    with pytest.raises(ValueError, match="cut at max_new_tokens"):
        plain_llm.structured_predict(
            Forecast, PromptTemplate("Forecast for {city}"), llm_kwargs={"max_new_tokens": 3}, city="Oslo"
        )
