"""The Ray Serve application on a local Ray instance (127.0.0.1 only, started and stopped here):
two engine replicas over one throw-away Redis answer as the in-process engine does, share chunk
caches through Redis, and chunk-affinity routing sends repeated documents to the replica whose
memory tier holds them."""
# ruff: noqa: E402 - the imports below need the optional package checked (importorskip) first

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'cacheblend-rag[ray]')")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'cacheblend-rag[ray]')")
httpx = pytest.importorskip("httpx")
pytest.importorskip("redis", reason="redis-py is not installed (pip install 'cacheblend-rag[redis]')")

sys.path.insert(0, str(Path(__file__).parent / "reliability_helpers"))
from local_redis import REDIS_SERVER, RedisServer

from cacheblend_rag.cluster import ClusterOptions, EngineSpec, build_app
from cacheblend_rag.store.redis_tier import RedisConfig, RedisStore
from cacheblend_rag.testing import make_engine

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server not found on PATH (apt-get install redis-server)")

N = 8  # tokens per answer
TIMEOUT = 120.0
MODEL = "tiny-llama"
P = ["The Eiffel Tower is in Paris, the capital of France.", "Marie Curie won two Nobel prizes, in physics and in chemistry."]
Q = ["The river Thames flows through London and Oxford.", "Alice was born in 1980 and Bob is thirteen years older than Alice."]
QUESTION = "Which city is named in the documents?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def cluster(redis_server):
    """Serve's HTTP proxy on a free loopback port, two replicas of the tiny engine over Redis."""
    try:
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=80 * 2**20,
            log_to_driver=False,
            configure_logging=False,
        )
    except Exception as exc:  # noqa: BLE001 - a machine where Ray cannot start
        pytest.skip(f"a local Ray instance cannot start here: {exc!r}")
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        spec = EngineSpec(
            factory="cacheblend_rag.testing:make_store_engine", factory_kwargs={"store": redis_server.url, "memory_bytes": 2**26}
        )
        # Learning off: a repeated request is compared with the first (and its reads counted).
        options = ClusterOptions(routing_stats_period_s=1.0, server={"model_name": MODEL, "learn_neighbours": False})
        # Half a CPU each: both replicas and the front fit on Ray's two.
        app = build_app(spec, options, num_replicas=2, ray_actor_options={"num_cpus": 0.5})
        serve.run(app, name="cacheblend", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def local():
    """The in-process engine the replicas build (the same tiny model and tokenizer)."""
    eng = make_engine("llama", seed=0)
    yield eng
    eng.close()


def _chat(url: str, documents: list[str], *, stream: bool = False) -> tuple[str, dict, httpx.Response]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "documents": documents,
        "max_tokens": N,
        "stream": stream,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    if not stream:
        data = r.json()
        return data["choices"][0]["message"]["content"], data["cacheblend"], r
    text, stats = "", {}
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                text += (choice.get("delta") or {}).get("content") or ""
            stats = event.get("cacheblend") or stats
    return text, stats, r


def _replica(r: httpx.Response) -> str:
    return r.headers["x-cacheblend-replica"]


def _reads(r: httpx.Response) -> dict[str, int]:
    return json.loads(r.headers["x-cacheblend-tier-reads"])


def _wait_in_redis(local, redis_server, documents: list[str]) -> None:
    """Write-backs run after the answer: wait (bounded) until Redis holds every document's chunk."""
    store = RedisStore(RedisConfig(redis_server.url), fingerprint=local.fingerprint)
    keys = [local.chunk_key(local.prompts.chunk_segment(d)) for d in documents]
    deadline = time.monotonic() + TIMEOUT
    try:
        while not all(store.contains_many(keys)):
            assert time.monotonic() < deadline, "the replica never wrote its chunks to Redis"
            time.sleep(0.05)
    finally:
        store.close()


def test_two_replicas_answer_as_the_engine_share_chunks_through_redis_and_keep_affinity(cluster, local, redis_server):
    expected = {
        name: local.generate(QUESTION, docs, max_new_tokens=N).text for name, docs in {"P": P, "Q": Q, "QP": Q + P[:1]}.items()
    }

    # New documents go to the replica holding the fewest: P to one, Q to the other.
    text, stats, first = _chat(cluster, P)
    assert text == expected["P"] and stats["chunk_misses"] == 2
    x = _replica(first)
    _wait_in_redis(local, redis_server, P)
    text, stats, second = _chat(cluster, Q)
    assert text == expected["Q"] and stats["chunk_misses"] == 2
    y = _replica(second)
    assert y != x
    _wait_in_redis(local, redis_server, Q)

    # Affinity: P again, twice (once streamed), lands on x and is read from x's memory tier.
    for stream in (False, True):
        text, stats, again = _chat(cluster, P, stream=stream)
        assert text == expected["P"]
        assert _replica(again) == x
        assert stats["chunk_hits"] == 2 and stats["chunk_misses"] == 0
        reads = _reads(again)
        assert reads["memory"] > 0 and reads["redis"] == 0, reads

    # Q plus one of P's documents: y holds more of them, so y answers, reading the chunk x
    # computed from Redis (a hit, not a recompute).
    text, stats, mixed = _chat(cluster, Q + P[:1])
    assert text == expected["QP"]
    assert _replica(mixed) == y
    assert stats["chunk_hits"] == 3 and stats["chunk_misses"] == 0
    assert _reads(mixed)["redis"] > 0


def test_app_builder_takes_serve_run_arguments():
    import inspect

    from cacheblend_rag.cluster import app_builder

    # `serve run cacheblend_rag.cluster:app_builder key=value ...` calls it with one dict of strings.
    assert len(inspect.signature(app_builder).parameters) == 1
    app = app_builder({"store": "redis://127.0.0.1:6379/0", "memory_bytes": "1048576", "affinity": "false"})
    assert isinstance(app, serve.Application)
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \['stor'\]: use affinity or EngineSpec's fields"):
        app_builder({"stor": "redis://127.0.0.1:6379/0"})
