"""Issue 38's server attacks against a live server on 127.0.0.1, with the numbers the issue quotes.

    python3 tests/reliability_helpers/round3_attacks.py

Starts `cacheblend-rag serve`'s app (tiny random model, in this process) and reports: the server's
resident memory before and after 100 refused 1 MB requests, and after a 100 MB body; how long the
attack requests took (the stop-string attack held the worker for 101 s); and whether a good request
sent right after each attack gets the in-process engine's greedy answer. Bounded: about 200 requests.
"""

from __future__ import annotations

import logging
import socket
import time

import httpx

from cacheblend_rag.server import ServerConfig, create_app
from cacheblend_rag.server.live import BackgroundServer
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_engine

N = 8


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def main() -> None:
    logging.disable(logging.WARNING)
    engine = make_engine("llama", seed=0, pipelined=False)
    engine.precompute(SAMPLE_CHUNKS, progress=False)
    want = engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, max_new_tokens=N).text
    server = BackgroundServer(create_app(engine, ServerConfig(model_name="tiny"))).start()
    url = f"{server.url}/v1/chat/completions"
    body = {"model": "tiny", "messages": [{"role": "user", "content": SAMPLE_QUESTION}], "max_tokens": N}
    good = {**body, "documents": SAMPLE_CHUNKS}

    def check_good(after: str) -> None:
        got = httpx.post(url, json=good, timeout=60).json()["choices"][0]["message"]["content"]
        verdict = "same as the in-process greedy answer" if got == want else f"DIFFERENT: {got!r}"
        print(f"  good request after {after}: {verdict}")

    with httpx.Client(timeout=60) as client:
        stops = ["zz" + "a" * 1000] * 2000  # a 2 MB body of stop strings, as in the issue
        t0 = time.perf_counter()
        r = client.post(url, json={**body, "stop": stops})
        said = r.json().get("error", {}).get("message", "answered")[:90]
        print(f"stop-string attack (2 MB of stops): {r.status_code} in {time.perf_counter() - t0:.3f} s: {said}")
        check_good("the stop-string attack")
        ok = client.post(url, json={**good, "stop": ["zz" + "a" * 250] * 16})  # the most the limits allow
        same = ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == want
        print(f"largest allowed stops (16 x 252 chars): {ok.status_code}, answer {'same' if same else 'DIFFERENT'}")

        doc = ("The river Thames flows through London. " * 30_000)[:1_000_000]
        for i in range(5):
            client.post(url, json={**body, "documents": [f"{i} {doc}"]})
        before = rss_mb()
        statuses = set()
        t0 = time.perf_counter()
        for i in range(100):
            statuses.add(client.post(url, json={**body, "documents": [f"{1000 + i} {doc}"]}).status_code)
        print(
            f"100 refused 1 MB requests ({sorted(statuses)}, {time.perf_counter() - t0:.1f} s): RSS {before:.0f} MB -> {rss_mb():.0f} MB"
        )
        check_good("100 refused 1 MB requests")

    before = rss_mb()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 104857600\r\n\r\n"
        )
        reply = s.recv(4096).split(b"\r\n", 1)[0]
    print(f"100 MB body announced: {reply.decode()}; RSS {before:.0f} MB -> {rss_mb():.0f} MB")
    check_good("the 100 MB body")

    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(300)]
    check_good("300 idle connections (max_connections 128)")
    for s in idle:
        s.close()
    server.stop()
    engine.close()


if __name__ == "__main__":
    main()
