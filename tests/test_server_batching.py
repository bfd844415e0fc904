"""The HTTP server on the batcher: concurrent requests share decode steps and get the answers the
in-process engine gives, with their own sampling and stop strings; a request whose client leaves
mid-answer leaves the batch at once, and the others keep their tokens.

The engine's lock freezes the batcher between two steps (it holds the lock for each prefill and
each step), so the tests can line requests up, or cut one off, at a known point."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from cacheblend_rag.server import ServerConfig, create_app  # noqa: E402
from cacheblend_rag.server.live import BackgroundServer  # noqa: E402
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION, sample_engine  # noqa: E402

MODEL = "tiny-llama"
TIMEOUT = 60.0
N = 12
LONG = 300  # never reached before the test cuts the answer off: the tiny model does not pick EOS here
# Different questions over different chunks, so the batch's rows have different lengths and answers.
REQUESTS = [
    (SAMPLE_QUESTION, SAMPLE_CHUNKS),
    ("Which river flows through Oxford?", SAMPLE_CHUNKS[:1]),
    ("Name one prize.", SAMPLE_CHUNKS[1:] + SAMPLE_CHUNKS[:1]),
    ("Who is the scientist?", SAMPLE_CHUNKS[::-1]),
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with sample_engine(tmp_path_factory.mktemp("kv"), seed=1) as eng:
        yield eng


@pytest.fixture(scope="module")
def live(engine):
    # Learning off: batched answers are compared with answers computed one at a time.
    app = create_app(engine, ServerConfig(model_name=MODEL, max_batch=4, learn_neighbours=False))
    server = BackgroundServer(app, timeout_s=TIMEOUT).start()
    server.batcher = app.state.batcher
    yield server
    server.stop()


def _health(live) -> dict:
    return httpx.get(f"{live.url}/health", timeout=TIMEOUT).json()


def _wait(live, what: str, ok) -> None:
    """Poll /health until ``ok(health)`` (bounded)."""
    deadline = time.monotonic() + TIMEOUT
    while not ok(health := _health(live)):
        assert time.monotonic() < deadline, f"never saw {what}: last /health was {health}"
        time.sleep(0.02)


def _body(question: str, chunks: list[str], **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": question}], "documents": chunks, "max_tokens": N, **kw}


def _ask(live, body: dict) -> str:
    """The answer's text, whole or streamed (``body["stream"]``)."""
    if not body.get("stream"):
        r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    text = []
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[len("data: ") :])["choices"]
                text.append((choices[0]["delta"].get("content") or "") if choices else "")
    return "".join(text)


def _together(live, engine, bodies: list[dict]) -> list[str]:
    """Send ``bodies`` at once, lined up behind the engine's lock so they are decoded together."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        with engine.lock:
            futures = [pool.submit(_ask, live, b) for b in bodies]
            _wait(live, f"{len(bodies)} requests admitted", lambda h: h["running"] + h["waiting"] == len(bodies))
        return [f.result(TIMEOUT) for f in futures]


def test_concurrent_requests_share_decode_steps_with_the_engines_answers(live, engine):
    want = [engine.generate(q, c, max_new_tokens=N).text for q, c in REQUESTS]
    steps, rows = live.batcher.steps, live.batcher.rows_stepped
    # Streamed and whole responses alike.
    got = _together(live, engine, [_body(q, c, stream=i % 2 == 1) for i, (q, c) in enumerate(REQUESTS)])
    assert got == want
    steps, rows = live.batcher.steps - steps, live.batcher.rows_stepped - rows
    assert rows > steps > 0, "the answers did not share decode steps"
    assert rows == N * len(REQUESTS) - len(REQUESTS)  # every token but the first (chosen by its prefill) took a row


def test_sampling_and_stop_strings_stay_per_request_in_the_batch(live, engine):
    greedy = engine.generate(*REQUESTS[1], max_new_tokens=N).text
    stop = greedy[1:3]
    settings = [dict(temperature=0.9, top_p=0.9, seed=11), dict(stop=[stop]), {}]
    want = [engine.generate(*REQUESTS[i], max_new_tokens=N, **kw).text for i, kw in enumerate(settings)]
    assert want[1] == greedy[: greedy.index(stop)]  # the stop string cuts the answer
    steps, rows = live.batcher.steps, live.batcher.rows_stepped
    got = _together(live, engine, [_body(*REQUESTS[i], **kw) for i, kw in enumerate(settings)])
    assert got == want
    assert live.batcher.rows_stepped - rows > live.batcher.steps - steps


class _Reader(threading.Thread):
    """A streaming client: reads its first delta, then waits; ``leave()`` closes the connection,
    ``finish()`` reads the answer to its end."""

    def __init__(self, live, body: dict):
        super().__init__(daemon=True)
        self.live, self.body = live, body
        self.started, self.go = threading.Event(), threading.Event()
        self.leaving = False
        self.text = ""

    def run(self) -> None:
        with httpx.stream("POST", f"{self.live.url}/v1/chat/completions", json=self.body, timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choices = json.loads(line[len("data: ") :])["choices"]
                self.text += (choices[0]["delta"].get("content") or "") if choices else ""
                if self.text and not self.started.is_set():
                    self.started.set()
                    self.go.wait(TIMEOUT)
                    if self.leaving:
                        return  # closes the connection: the client is gone

    def leave(self) -> None:
        self.leaving = True
        self.go.set()
        self.join(TIMEOUT)

    def finish(self) -> str:
        self.go.set()
        self.join(TIMEOUT)
        return self.text


def test_a_client_that_leaves_mid_answer_leaves_the_batch(live, engine):
    want = engine.generate(*REQUESTS[1], max_new_tokens=LONG).text
    gone, stays = (_Reader(live, _body(q, c, max_tokens=LONG, stream=True)) for q, c in REQUESTS[:2])
    with engine.lock:  # both are admitted before either is prefilled: they are decoded together
        gone.start()
        stays.start()
        _wait(live, "both requests admitted", lambda h: h["running"] + h["waiting"] == 2)
    assert gone.started.wait(TIMEOUT) and stays.started.wait(TIMEOUT)
    with engine.lock:  # between two steps of the batch
        _wait(live, "both answers decoding", lambda h: h["running"] == 2)
        steps, rows = live.batcher.steps, live.batcher.rows_stepped
        gone.leave()
        # The server cancels the answer as soon as it sees the connection close, before the next step.
        _wait(live, "the answer of the client that left to be cancelled", lambda h: h["running"] == 1)
    assert stays.finish() == want  # the other answer keeps its tokens
    _wait(live, "an idle server", lambda h: h["running"] == h["waiting"] == 0)
    # Every step after the client left advanced one row: the other answer's.
    assert live.batcher.rows_stepped - rows == live.batcher.steps - steps > 0
    assert len(gone.text) < len(want)
