"""Tool calling over HTTP: the server's calls and answers are the integrations' own
(``serving.tool_run``), in OpenAI's wire format, whole and streamed, and through LangChain's
ChatOpenAI ``bind_tools`` pointed at the server."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("llguidance")

from cacheblend_rag.server import ServerConfig, create_app  # noqa: E402
from cacheblend_rag.server.live import BackgroundServer  # noqa: E402
from cacheblend_rag.serving import Request, tool_run  # noqa: E402
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION, sample_engine  # noqa: E402

MODEL = "tiny-llama-tools"
N = 120
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two small numbers.",
        "parameters": {  # bounded, so even a random model's call ends inside the budget
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 9},
                "b": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["a", "b"],
        },
    },
}
FORCED = {"type": "function", "function": {"name": "add"}}
SETTINGS = {"max_new_tokens": N}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with sample_engine(tmp_path_factory.mktemp("kv"), tools=True) as eng:
        yield eng


@pytest.fixture(scope="module")
def live(engine):
    server = BackgroundServer(create_app(engine, ServerConfig(model_name=MODEL, learn_neighbours=False)), timeout_s=60.0).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="dummy", max_retries=0, timeout=60.0)


def _engine_run(engine, request: Request, **kw) -> tool_run.ToolRun:
    run = tool_run.start(engine, request, SETTINGS, **kw)
    for _ in run:
        pass
    return run


def _ask(client, messages=None, **kw):
    messages = messages or [{"role": "user", "content": SAMPLE_QUESTION}]
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=N, extra_body={"documents": SAMPLE_CHUNKS}, **kw
    )


def test_a_forced_call_is_the_integrations_call_in_openais_format(client, engine):
    res = _ask(client, tools=[ADD], tool_choice=FORCED)
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    want = _engine_run(engine, Request.over_chunks(SAMPLE_QUESTION, SAMPLE_CHUNKS), tools=[ADD], tool_choice=FORCED).parsed.calls
    assert call.type == "function" and call.function.name == "add" == want[0].name
    assert json.loads(call.function.arguments) == want[0].arguments and set(want[0].arguments) == {"a", "b"}
    assert res.model_extra["cacheblend"]["tool_calls"] == 1


def test_a_streamed_call_arrives_whole_before_the_finish_reason(client):
    chunks = list(_ask(client, tools=[ADD], tool_choice=FORCED, stream=True))
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(calls) == 1 and calls[0][0].index == 0 and calls[0][0].function.name == "add"
    assert set(json.loads(calls[0][0].function.arguments)) == {"a", "b"}
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["tool_calls"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""


def test_the_tool_exchange_goes_on_after_the_question_as_the_integrations_do(client, engine):
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})}}
    messages = [
        {"role": "user", "content": SAMPLE_QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    res = _ask(client, messages=messages, tools=[ADD], tool_choice="none")
    turns = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "id": "call_1", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
        },
        {"role": "tool", "content": "5", "tool_call_id": "call_1", "name": "add"},
    ]
    request = Request.over_chunks(SAMPLE_QUESTION, SAMPLE_CHUNKS).with_tools((), turns)
    want = _engine_run(engine, request, tools=[ADD], tool_choice="none")
    assert res.choices[0].message.content == want.result.text and res.choices[0].message.tool_calls is None
    assert res.model_extra["cacheblend"]["chunk_hits"] == len(SAMPLE_CHUNKS)  # the chunks stay cached chunks


def test_langchains_chatopenai_binds_tools_against_the_server(live):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=f"{live.url}/v1",
        api_key="dummy",
        max_tokens=N,
        max_retries=0,
        extra_body={"documents": SAMPLE_CHUNKS},
    )
    msg = llm.bind_tools([ADD], tool_choice="add").invoke(SAMPLE_QUESTION)
    assert [c["name"] for c in msg.tool_calls] == ["add"] and set(msg.tool_calls[0]["args"]) == {"a", "b"}


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/v1/completions", {"prompt": "q", "tools": [ADD]}, "tools is not supported"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "q"}], "tools": [ADD], "tool_choice": "mul"},
            "tool_choice='mul'",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "add", "arguments": "{"}}]},
                    {"role": "tool", "tool_call_id": "c", "content": "5"},
                ]
            },
            "its arguments: not valid JSON",
        ),
    ],
)
def test_bad_tool_requests_get_a_400_naming_the_problem(live, path, body, message):
    r = httpx.post(f"{live.url}{path}", json=dict(body, model=MODEL, max_tokens=4), timeout=60.0)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
