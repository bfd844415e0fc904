"""``cacheblend-rag serve``: the real server on a 127.0.0.1 port, driven by the openai client and
LangChain's ChatOpenAI, answers token for token as the in-process engine does."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from cacheblend_rag.chat.messages import chunk_part  # noqa: E402
from cacheblend_rag.cli import app as cli  # noqa: E402
from cacheblend_rag.decode.constraints import Grammar, schema_constraint  # noqa: E402
from cacheblend_rag.decode.sampling import SamplingParams  # noqa: E402
from cacheblend_rag.engine.core import CacheBlendEngine  # noqa: E402
from cacheblend_rag.engine.plain import chat_text, plain_stream  # noqa: E402
from cacheblend_rag.server import ServerConfig, create_app  # noqa: E402
from cacheblend_rag.server.live import BackgroundServer  # noqa: E402
from cacheblend_rag.server.worker import Job  # noqa: E402
from cacheblend_rag.store.quant import DEFAULT_KV_FORMAT  # noqa: E402
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_engine, sample_engine  # noqa: E402

N = 12  # tokens per answer: long enough to compare, short enough for a slow CPU
MODEL = "tiny-llama"
TIMEOUT = 60.0


class LiveServer(BackgroundServer):
    """The server in a thread of the test process, with the clients the tests use."""

    def __init__(self, app):
        super().__init__(app, timeout_s=TIMEOUT)
        self.app = app

    def client(self) -> openai.OpenAI:
        # No retries: a 503 must reach the test, not be retried away.
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="dummy", max_retries=0, timeout=TIMEOUT)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=TIMEOUT).json()

    def wait_for(self, what, **expected) -> None:
        """Poll /health until it reports ``expected`` (bounded)."""
        deadline = time.monotonic() + TIMEOUT
        while True:
            health = self.health()
            if all(health[k] == v for k, v in expected.items()):
                return
            assert time.monotonic() < deadline, f"never saw {what}: last /health was {health}"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with sample_engine(tmp_path_factory.mktemp("kv")) as eng:
        yield eng


@pytest.fixture(scope="module")
def live(engine):
    # Learning off: these tests compare the server's answers with the engine's, and a request repeated
    # after a learned cache exists may be answered from it (test_the_default_server_learns_...).
    server = LiveServer(create_app(engine, ServerConfig(model_name=MODEL, learn_neighbours=False))).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    return live.client()


@pytest.fixture(scope="module")
def expected(engine):
    """The in-process engine's greedy answer over the sample chunks."""
    return engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, max_new_tokens=N)


def _user(question: str = SAMPLE_QUESTION) -> list[dict]:
    return [{"role": "user", "content": question}]


def _chat(client, **kw):
    kw.setdefault("max_tokens", N)
    return client.chat.completions.create(model=MODEL, **kw)


def _stream_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


# ---------------------------------------------------------------------- answers
def test_chat_with_documents_field_equals_engine_generate(client, expected):
    res = _chat(client, messages=_user(), extra_body={"documents": SAMPLE_CHUNKS})
    assert res.choices[0].message.content == expected.text
    assert res.choices[0].finish_reason == expected.finish_reason
    assert res.model == MODEL
    assert res.usage.completion_tokens == len(expected.token_ids)
    assert res.usage.prompt_tokens == expected.stats["prompt_tokens"]


def test_chat_stream_equals_engine_generate_and_ends_with_stats(client, expected):
    text, chunks = _stream_text(
        _chat(
            client, messages=_user(), stream=True, extra_body={"documents": SAMPLE_CHUNKS}, stream_options={"include_usage": True}
        )
    )
    assert text == expected.text
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finish] == [expected.finish_reason]
    stats = finish[0].model_extra["cacheblend"]
    assert stats["chunk_hits"] == len(SAMPLE_CHUNKS) and stats["mode"] == "cacheblend"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_raw_stream_is_sse_ending_with_done(live):
    body = {"model": MODEL, "messages": _user(), "documents": SAMPLE_CHUNKS, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


def test_flagged_content_parts_are_the_documents(client, expected):
    content = [chunk_part(c) for c in SAMPLE_CHUNKS] + [{"type": "text", "text": SAMPLE_QUESTION}]
    res = _chat(client, messages=[{"role": "user", "content": content}])
    assert res.choices[0].message.content == expected.text
    assert res.model_extra["cacheblend"]["chunks"] == len(SAMPLE_CHUNKS)


def test_completions_with_documents_equal_engine_generate(client, expected):
    res = client.completions.create(model=MODEL, prompt=SAMPLE_QUESTION, max_tokens=N, extra_body={"documents": SAMPLE_CHUNKS})
    assert res.choices[0].text == expected.text
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=SAMPLE_QUESTION, max_tokens=N, stream=True, extra_body={"documents": SAMPLE_CHUNKS}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text


def test_prompt_without_documents_is_the_plain_chat_prefill(client, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the Eiffel Tower?"}]
    reference = plain_stream(engine, chat_text(engine.tokenizer, messages), SamplingParams(max_new_tokens=N))
    want = "".join(reference)
    res = _chat(client, messages=messages)
    assert res.choices[0].message.content == want
    assert res.model_extra["cacheblend"]["mode"] == "plain_chat"
    assert res.usage.prompt_tokens_details.cached_tokens == 0
    text, _ = _stream_text(_chat(client, messages=messages, stream=True))
    assert text == want


def test_engine_options_extension_field(client, engine):
    want = engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, max_new_tokens=N, mode="full_recompute").text
    res = _chat(client, messages=_user(), extra_body={"documents": SAMPLE_CHUNKS, "cacheblend": {"mode": "full_recompute"}})
    assert res.choices[0].message.content == want
    stats = res.model_extra["cacheblend"]
    assert stats["mode"] == "full_recompute" and stats["recompute_fraction"] == 1.0
    res = _chat(client, messages=_user(), extra_body={"documents": SAMPLE_CHUNKS, "cacheblend": {"recompute_ratio": 0.5}})
    assert res.model_extra["cacheblend"]["recompute_ratio"] == 0.5


def test_seeded_sampling_repeats_and_stop_cuts(client, expected):
    kw = dict(messages=_user(), temperature=1.0, top_p=0.9, seed=7, extra_body={"documents": SAMPLE_CHUNKS})
    first, second = _chat(client, **kw), _chat(client, **kw)
    assert first.choices[0].message.content == second.choices[0].message.content
    stop = expected.text[3:6]
    assert stop.strip(), "the reference answer is too short to cut"
    res = _chat(client, messages=_user(), stop=[stop], extra_body={"documents": SAMPLE_CHUNKS})
    assert res.choices[0].message.content == expected.text[: expected.text.index(stop)]
    assert res.choices[0].finish_reason == "stop"


def test_chunk_hits_and_cached_tokens_are_reported(client, engine):
    docs = ["Lisbon is the capital of Portugal.", "The Danube flows through Vienna and Budapest."]
    first = _chat(client, messages=_user("Which river flows through Vienna?"), extra_body={"documents": docs})
    second = _chat(client, messages=_user("What is the capital of Portugal?"), extra_body={"documents": docs})
    assert first.model_extra["cacheblend"]["chunk_misses"] == 2 and first.usage.prompt_tokens_details.cached_tokens == 0
    s = second.model_extra["cacheblend"]
    assert s["chunk_hits"] == 2 and s["chunk_misses"] == 0
    chunk_tokens = sum(len(engine.prompts.chunk_segment(d)) for d in docs)
    assert second.usage.prompt_tokens_details.cached_tokens == chunk_tokens
    assert 0 < s["recompute_fraction"] < 1
    # The engine's own stats plus the server's queue wait, as the response schema documents.
    assert {"ttft_s", "queue_s", "chunk_hits", "recompute_fraction"} <= s.keys()


def test_models_and_health(client, live):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = live.health()
    assert health["status"] == "ok" and health["model"] == MODEL and health["max_queue"] == 8 and health["max_batch"] == 8


# ---------------------------------------------------------------------- LangChain
def test_langchain_chat_openai_against_the_server(live, expected):
    lc_openai = pytest.importorskip("langchain_openai")
    lc_cacheblend = pytest.importorskip("langchain_cacheblend")
    llm = lc_openai.ChatOpenAI(
        base_url=f"{live.url}/v1", api_key="dummy", model=MODEL, temperature=0, max_tokens=N, max_retries=0, timeout=TIMEOUT
    )
    with_docs = llm.bind(extra_body={"documents": SAMPLE_CHUNKS})
    msg = with_docs.invoke(SAMPLE_QUESTION)
    assert msg.content == expected.text
    assert msg.usage_metadata["input_token_details"]["cache_read"] > 0
    assert "".join(c.content for c in with_docs.stream(SAMPLE_QUESTION)) == expected.text
    # The LangChain integration's chunk blocks pass through ChatOpenAI unchanged.
    msg = llm.invoke([lc_cacheblend.rag_message(SAMPLE_QUESTION, SAMPLE_CHUNKS)])
    assert msg.content == expected.text


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"model": MODEL}, 400, "messages: Field required"),
        ({"model": MODEL, "messages": []}, 400, "messages is empty"),
        ({"model": MODEL, "messages": _user(), "n": 2}, 400, "n=2 is not supported"),
        ({"model": "gpt-4o", "messages": _user()}, 404, "'gpt-4o' does not exist"),
        ({"model": MODEL, "messages": [{"role": "function", "content": "x"}]}, 400, "messages.0.role"),
        ({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400, "a tool message needs the tool_call_id"),
        ({"model": MODEL, "messages": [{"role": "user"}]}, 400, "a user message needs content"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            400,
            "'image_url' is not supported",
        ),
        ({"model": MODEL, "messages": [{"role": "user", "content": [chunk_part("a doc")]}]}, 400, "no question text"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": [chunk_part("a doc"), "q"]}], "documents": ["b"]},
            400,
            "use one of the two",
        ),
        ({"model": MODEL, "messages": _user(), "max_tokens": 5000, "documents": ["a doc"]}, 400, "context window"),
        ({"model": MODEL, "messages": _user(), "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "messages": _user(), "tools": [{"type": "function"}]}, 400, "tool 0 is not a function definition"),
        ({"model": MODEL, "messages": _user(), "functions": [{"name": "f"}]}, 400, "functions is not supported"),
        ({"model": MODEL, "messages": _user(), "cacheblend": {"mode": "fast"}}, 400, "cacheblend.mode"),
        ({"model": MODEL, "messages": _user(), "response_format": {"type": "yaml"}}, 400, "response_format="),
        (
            {"model": MODEL, "messages": _user(), "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
            400,
            "json_schema needs",
        ),
        ({"model": MODEL, "messages": _user(), "documents": [" "]}, 400, "document 0 is empty"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_get_a_4xx_with_a_clear_message(live, body, status, message, stream):
    r = httpx.post(f"{live.url}/v1/chat/completions", json=dict(body, stream=stream), timeout=TIMEOUT)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]


# Every value bounded, so even the tiny random model's answer ends inside the token budget.
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 12}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_is_the_engines_constrained_answer(client, engine, stream):
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    res = _chat(
        client, messages=_user(), max_tokens=60, stream=stream, response_format=fmt, extra_body={"documents": SAMPLE_CHUNKS}
    )
    text = _stream_text(res)[0] if stream else res.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    grammar, hint = schema_constraint(SCHEMA)  # the schema is shown after the question, as the integrations do
    assert text == engine.generate(f"{SAMPLE_QUESTION}\n\n{hint}", SAMPLE_CHUNKS, max_new_tokens=60, constraint=grammar).text


def test_response_format_json_object_is_the_engines_constrained_answer_on_both_endpoints(client, live, engine, expected):
    pytest.importorskip("llguidance")
    # An object's strings are unbounded, so the random model's answer may be cut: compare with
    # the engine's answer under the same grammar (which no unconstrained answer matches).
    want = engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, max_new_tokens=N, constraint=Grammar.json_object()).text
    assert want.startswith("{") and want != expected.text
    fmt = {"type": "json_object"}
    res = _chat(client, messages=_user(), response_format=fmt, extra_body={"documents": SAMPLE_CHUNKS})
    assert res.choices[0].message.content == want
    body = {"model": MODEL, "prompt": SAMPLE_QUESTION, "max_tokens": N, "documents": SAMPLE_CHUNKS, "response_format": fmt}
    r = httpx.post(f"{live.url}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want


def test_unsupported_fields_at_their_off_values_are_accepted(client, expected):
    off = {
        "logprobs": False,
        "frequency_penalty": 0,
        "presence_penalty": 0.0,
        "tools": [],
        "user": "u1",
        "n": 1,
        "response_format": {"type": "text"},
    }
    res = _chat(client, messages=_user(), extra_body={"documents": SAMPLE_CHUNKS, **off})
    assert res.choices[0].message.content == expected.text


def test_explicit_nulls_mean_the_defaults(client, live, expected):
    # OpenAI's schema makes these nullable, and the openai client sends null for an explicit None.
    res = _chat(
        client,
        messages=_user(),
        temperature=None,
        top_p=None,
        stream=None,
        stream_options=None,
        seed=None,
        extra_body={"documents": SAMPLE_CHUNKS},
    )
    assert res.choices[0].message.content == expected.text
    res = client.completions.create(
        model=MODEL,
        prompt=SAMPLE_QUESTION,
        max_tokens=N,
        temperature=None,
        top_p=None,
        stream=None,
        extra_body={"documents": SAMPLE_CHUNKS},
    )
    assert res.choices[0].text == expected.text


def test_best_of_at_its_default_of_one_is_accepted(client, expected):
    res = client.completions.create(
        model=MODEL, prompt=SAMPLE_QUESTION, max_tokens=N, best_of=1, extra_body={"documents": SAMPLE_CHUNKS}
    )
    assert res.choices[0].text == expected.text
    with pytest.raises(openai.BadRequestError, match="best_of is not supported"):
        client.completions.create(model=MODEL, prompt=SAMPLE_QUESTION, best_of=2)


def test_openai_client_raises_with_the_message(client):
    with pytest.raises(openai.BadRequestError, match="n=2 is not supported"):
        _chat(client, messages=_user(), n=2)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=_user())
    with pytest.raises(openai.BadRequestError, match="one prompt per request"):
        client.completions.create(model=MODEL, prompt=["a", "b"])


def test_a_wrong_method_is_a_405_with_its_allow_header(live):
    r = httpx.get(f"{live.url}/v1/chat/completions", timeout=TIMEOUT)
    assert r.status_code == 405 and r.headers.get("allow") == "POST"
    assert r.json()["error"]["message"] == "Method Not Allowed"


def test_body_that_is_not_json_is_a_400(live):
    r = httpx.post(
        f"{live.url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}, timeout=TIMEOUT
    )
    assert r.status_code == 400
    error = r.json()["error"]
    # The position of the syntax error is no request field.
    assert error["param"] is None
    assert error["message"].startswith("invalid request: the body is not valid JSON") and "character 1" in error["message"]


@pytest.mark.parametrize(
    "content, content_type, says",
    [
        (b'{"model": "tiny", "messages": "caf\xe9"}', "application/json", "the body is not UTF-8 (at character 34)"),
        (b"model=tiny&prompt=hi", "application/x-www-form-urlencoded", "not application/x-www-form-urlencoded"),
        (b'{"model": "tiny", "prompt": "hi"}', None, "not no content-type"),
    ],
    ids=["latin-1", "form", "no-content-type"],
)
def test_a_body_that_is_not_utf8_json_is_a_400_naming_why(live, content, content_type, says):
    # curl -d sends a form unless told otherwise: the answer says which content-type to send.
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(f"{live.url}/v1/completions", content=content, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"], r.json()


# ---------------------------------------------------------------------- admission and cancellation
def test_full_queue_answers_503_and_queued_requests_still_finish(engine, expected):
    # --max-batch 1: one answer at a time, one waiting (--max-queue 1), the next refused.
    server = LiveServer(
        create_app(engine, ServerConfig(model_name=MODEL, max_batch=1, max_queue=1, learn_neighbours=False))
    ).start()
    client = server.client()
    ask = lambda: _chat(client, messages=_user(), extra_body={"documents": SAMPLE_CHUNKS})  # noqa: E731
    try:
        with ThreadPoolExecutor(2) as pool:
            with engine.lock:  # holds the running request inside the engine
                running = pool.submit(ask)
                server.wait_for("one request running", running=1, waiting=0)
                waiting = pool.submit(ask)
                server.wait_for("one request waiting", running=1, waiting=1)
                with pytest.raises(openai.InternalServerError, match="busy") as err:
                    ask()
                assert err.value.status_code == 503
            answers = [f.result(TIMEOUT).choices[0].message.content for f in (running, waiting)]
        assert answers == [expected.text, expected.text]
        server.wait_for("an idle worker", running=0, waiting=0)
        assert ask().choices[0].message.content == expected.text
    finally:
        server.stop()


def test_abandoned_stream_frees_the_engine(live, client, expected):
    stream = _chat(client, messages=_user(), stream=True, max_tokens=200, extra_body={"documents": SAMPLE_CHUNKS})
    next(iter(stream))
    stream.close()
    live.wait_for("the abandoned request to stop", running=0, waiting=0)
    assert _chat(client, messages=_user(), extra_body={"documents": SAMPLE_CHUNKS}).choices[0].message.content == expected.text


def _wait_for_the_server_to_see_the_client_leave(caplog) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not any("client disconnected" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "the server never noticed the client's closed connection"
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [False, True])
def test_request_abandoned_while_queued_is_never_run(live, engine, expected, caplog, stream):
    caplog.set_level(logging.INFO, logger="cacheblend_rag.server")
    batcher = live.app.state.batcher
    prefills = batcher.prefills
    client = live.client()
    body = {"model": MODEL, "messages": _user(), "documents": SAMPLE_CHUNKS, "max_tokens": 200, "stream": stream}
    with ThreadPoolExecutor(1) as pool:
        with engine.lock:  # holds the first request inside the engine, before its prefill
            running = pool.submit(lambda: _chat(client, messages=_user(), extra_body={"documents": SAMPLE_CHUNKS}))
            live.wait_for("one request running", running=1, waiting=0)
            # The client gives up before the engine reaches its request (a timeout), closing the connection.
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(TIMEOUT, read=1.0))
            _wait_for_the_server_to_see_the_client_leave(caplog)
        assert running.result(TIMEOUT).choices[0].message.content == expected.text
    live.wait_for("an idle worker", running=0, waiting=0)
    assert batcher.prefills - prefills == 1, "the engine prefilled the abandoned request"


def test_whole_request_abandoned_while_running_stops_its_generation(live, engine, caplog):
    caplog.set_level(logging.INFO, logger="cacheblend_rag.server")
    batcher = live.app.state.batcher
    rows = batcher.rows_stepped
    body = {"model": MODEL, "messages": _user(), "documents": SAMPLE_CHUNKS, "max_tokens": 400}
    with engine.lock:  # the request is admitted to the batch, then waits for the engine
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(TIMEOUT, read=1.0))
        _wait_for_the_server_to_see_the_client_leave(caplog)
    live.wait_for("the abandoned request to stop", running=0, waiting=0)
    assert batcher.rows_stepped - rows < 10, f"{batcher.rows_stepped - rows} tokens decoded for a client that left"


def test_job_stops_producing_once_the_consumer_leaves():
    produced: list[int] = []
    closed = threading.Event()

    def produce():  # ~10 s of items if nobody stopped it
        try:
            for i in range(2000):
                produced.append(i)
                yield i
                time.sleep(0.005)
        finally:
            closed.set()

    async def consume_one() -> int:
        job = Job(produce, asyncio.get_running_loop())
        threading.Thread(target=job.run, daemon=True).start()
        items = aiter(job)
        first = await anext(items)
        await items.aclose()
        return first

    assert asyncio.run(asyncio.wait_for(consume_one(), TIMEOUT)) == 0
    assert closed.wait(5.0), "the job kept producing after its consumer left"
    assert len(produced) < 100


def test_graceful_shutdown_finishes_the_request_in_flight(engine, expected):
    server = LiveServer(create_app(engine, ServerConfig(model_name=MODEL, learn_neighbours=False))).start()
    client = server.client()
    with ThreadPoolExecutor(1) as pool:
        with engine.lock:
            in_flight = pool.submit(lambda: _chat(client, messages=_user(), extra_body={"documents": SAMPLE_CHUNKS}))
            server.wait_for("the request running", running=1)
            server.request_stop()
            deadline = time.monotonic() + TIMEOUT
            while True:  # shutdown has begun once the port refuses new connections
                try:
                    httpx.get(f"{server.url}/health", timeout=1.0)
                except httpx.TransportError:
                    break
                assert time.monotonic() < deadline, "the server kept accepting connections"
                time.sleep(0.02)
            assert server.thread.is_alive() and not in_flight.done()
        assert in_flight.result(TIMEOUT).choices[0].message.content == expected.text
    server.thread.join(TIMEOUT)
    assert not server.thread.is_alive()


# ---------------------------------------------------------------------- learned neighbours
def test_the_default_server_learns_neighbour_caches_from_its_requests_and_uses_them(tmp_path):
    from fastapi.testclient import TestClient

    eng = make_engine("llama", seed=0, store_dir=tmp_path / "kv", pipelined=False)
    hits: list[int] = []
    prefill = eng.prefill

    def counted(*args, **kwargs):
        pre = prefill(*args, **kwargs)
        hits.append(pre.stats.get("neighbour_hits", 0))
        return pre

    eng.prefill = counted
    body = {"model": MODEL, "messages": _user(), "documents": SAMPLE_CHUNKS, "max_tokens": 2}
    try:
        with TestClient(create_app(eng, ServerConfig(model_name=MODEL))) as http:
            assert eng.learner is not None
            assert http.post("/v1/chat/completions", json=body).status_code == 200
            eng.learner.wait()  # the refresh runs off the request path
            assert eng.learner.computed == len(SAMPLE_CHUNKS) - 1
            assert http.post("/v1/chat/completions", json=body).status_code == 200
        assert hits == [0, len(SAMPLE_CHUNKS) - 1]  # every chunk but the first served its learned cache
    finally:
        eng.close()


def test_learning_off_leaves_the_engine_as_it_was(tmp_path):
    eng = make_engine("llama", seed=0, store_dir=tmp_path / "kv", pipelined=False)
    try:
        create_app(eng, ServerConfig(learn_neighbours=False))
        assert eng.learner is None
    finally:
        eng.close()
    with pytest.raises(ValueError, match="learn_neighbours"):
        ServerConfig(learn_neighbours="no")


# ---------------------------------------------------------------------- CLI
def test_serve_subcommand_builds_the_app_from_its_flags(monkeypatch, tmp_path):
    seen: dict = {}

    def fake_from_pretrained(cls, model=None, **kwargs):
        seen["load"] = (model, kwargs)
        eng = seen["engine"] = make_engine("llama", seed=0, store_dir=tmp_path / "kv", pipelined=False)
        close = eng.close
        eng.close = lambda: (seen.setdefault("closed", True), close())
        return eng

    def fake_run(app, **kwargs):
        from fastapi.testclient import TestClient

        seen["run"] = kwargs
        seen["health"] = TestClient(app).get("/health").json()

    monkeypatch.setattr(CacheBlendEngine, "from_pretrained", classmethod(fake_from_pretrained))
    monkeypatch.setattr(uvicorn, "run", fake_run)
    assert (
        cli.main(
            [
                "serve",
                "--model",
                "m.gguf",
                "--port",
                "9123",
                "--max-queue",
                "3",
                "--max-batch",
                "2",
                "--store-dir",
                str(tmp_path / "s"),
                "--served-model-name",
                "rag",
                "--store",
                "disk, redis://cache:6379/0",
                "--weights",
                "fp16",
            ]
        )
        == 0
    )
    assert seen["load"] == (
        "m.gguf",
        {
            "device": "cpu",
            "dtype": "float32",
            "weights": "fp16",
            "store_dir": str(tmp_path / "s"),
            "store": ["disk", "redis://cache:6379/0"],
            "kv_format": DEFAULT_KV_FORMAT,
        },
    )
    assert seen["run"]["host"] == "127.0.0.1" and seen["run"]["port"] == 9123
    assert seen["health"]["max_queue"] == 3 and seen["health"]["max_batch"] == 2 and seen["health"]["model"] == "rag"
    assert seen["closed"]  # the engine is closed when the server stops
    assert seen["engine"].learner is not None  # learned neighbours by default
    assert cli.main(["serve", "--store-dir", str(tmp_path / "s"), "--no-neighbours"]) == 0
    assert seen["engine"].learner is None


def test_engine_failure_is_a_500_in_openai_form():
    from fastapi.testclient import TestClient

    class Broken:
        model_id = "broken"
        model = tokenizer = fast_step = None

        def stream(self, *args, **kwargs):
            raise RuntimeError("out of memory")

    with TestClient(create_app(Broken(), ServerConfig(learn_neighbours=False)), raise_server_exceptions=False) as http:
        body = {"model": "broken", "messages": _user(), "documents": ["a doc"]}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 500 and "RuntimeError: out of memory" in r.json()["error"]["message"]
        r = http.post("/v1/chat/completions", json=dict(body, stream=True))
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
