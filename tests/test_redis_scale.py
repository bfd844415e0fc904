"""The Redis tier at scale, against a throw-away redis-server on 127.0.0.1: a request's round
trips do not grow with its chunk count, a process's stores share one connection pool, and a Redis
Cluster is refused with the reason."""
# ruff: noqa: E402 - the imports below need the optional package checked (importorskip) first

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install 'cacheblend-rag[redis]')")

sys.path.insert(0, str(Path(__file__).parent / "reliability_helpers"))
from local_redis import REDIS_SERVER, RedisServer, free_port

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.store import redis_pool
from cacheblend_rag.store.redis_tier import RedisClusterError, RedisConfig, RedisStore
from cacheblend_rag.store.spec import open_store
from cacheblend_rag.testing import make_model

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server not found on PATH (apt-get install redis-server)")

# Twelve distinct chunks; a request reads the first 6 or all 12.
FACTS = [
    f"Fact {i}: the {w} box holds {i * 7 % 13} marbles and sits on shelf {i % 4}."
    for i, w in enumerate(["red", "blue", "green", "amber", "white", "black", "grey", "pink", "teal", "gold", "plum", "jade"])
]
Q = "Which box holds the most marbles?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.stop()


class RoundTrips:
    """Counts what redis-py sends to one server: one ``send_packed_command`` is one round trip
    (a single command, or a whole pipeline / ``MULTI``..``EXEC`` block)."""

    def __init__(self, monkeypatch, port: int) -> None:
        self.calls = 0
        original = redis.connection.AbstractConnection.send_packed_command
        counter = self

        def counted(conn, command, check_health=True):
            if getattr(conn, "port", None) == port:
                counter.calls += 1
            return original(conn, command, check_health)

        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)


def _engine(tokenizer, url: str, prefix: str, tmp_path: Path, memory_bytes: int) -> CacheBlendEngine:
    config = RedisConfig(url, prefix=prefix)
    store = open_store([config], directory=str(tmp_path), size_limit=2**30, fingerprint="", memory_bytes=memory_bytes)
    return CacheBlendEngine(make_model("llama"), tokenizer, store=store, pipelined=False)


@pytest.mark.parametrize("mode", ["cacheblend", "prefix_caching"])
def test_one_request_costs_the_same_round_trips_over_6_or_12_chunks(tokenizer, server, tmp_path, monkeypatch, mode):
    prefix = f"rt{uuid.uuid4().hex[:8]}"
    # Another process computed every chunk (and, for prefix caching, the two prompts' prefixes).
    writer = _engine(tokenizer, server.url, prefix, tmp_path, memory_bytes=0)
    if mode == "prefix_caching":
        for n in (6, 12):
            writer.generate(Q, FACTS[:n], mode=mode, max_new_tokens=1)
    else:
        writer.precompute(FACTS, progress=False)
    writer.flush()
    writer.close()

    trips: dict[int, int] = {}
    hits: dict[int, int] = {}
    for n in (6, 12):
        # A fresh replica: an empty memory tier in front of the shared Redis.
        eng = _engine(tokenizer, server.url, prefix, tmp_path, memory_bytes=2**26)
        counter = RoundTrips(monkeypatch, server.port)
        res = eng.generate(Q, FACTS[:n], mode=mode, max_new_tokens=4)
        eng.flush()
        trips[n], hits[n] = counter.calls, res.stats["chunk_hits"]
        monkeypatch.undo()
        eng.close()
    assert hits == {6: 6, 12: 12}  # every chunk came from Redis
    # One lookup of all chunks (plus the instruction prefix's own lookup), then one MGET per layer
    # for all of them; nothing per chunk.
    assert trips[6] == trips[12], trips
    assert trips[12] <= eng.num_layers + 2, trips


def test_stores_of_one_process_share_a_connection_pool(server):
    before = redis_pool.shared_pools()
    a = RedisStore(RedisConfig(server.url, prefix="pool-a"))
    b = RedisStore(RedisConfig(server.url, prefix="pool-b"), fingerprint="another model")
    assert a.client.connection_pool is b.client.connection_pool
    assert redis_pool.shared_pools() == before + 1
    other = RedisStore(RedisConfig(server.url, prefix="pool-c", socket_timeout_s=5.0))  # other settings: its own pool
    assert other.client.connection_pool is not a.client.connection_pool
    a.close()
    assert b.contains_many(["nothing"]) == [False]  # closing one store leaves the pool to the others
    b.close()
    other.close()
    assert redis_pool.shared_pools() == before


def test_contains_many_answers_each_key_in_one_round_trip(server, monkeypatch):
    import torch

    store = RedisStore(RedisConfig(server.url, prefix=f"cm{uuid.uuid4().hex[:8]}"))
    layers = [(torch.randn(2, 3, 4), torch.randn(2, 3, 4)) for _ in range(3)]
    for key in ("a", "c"):
        store.put(key, layers)
    counter = RoundTrips(monkeypatch, server.port)
    assert store.contains_many(["a", "b", "c", "d"]) == [True, False, True, False]
    assert counter.calls == 1
    assert store.num_layers_of("a") == 3 and store.num_layers_of("b") is None
    # Every record of a chunk carries the chunk key as its hash tag: one slot per chunk.
    assert all("{a}" in store.record_name("a", layer) for layer in (None, 0, 2))
    store.close()


def test_a_redis_cluster_node_is_refused_with_the_reason(tmp_path):
    # The cluster bus needs a port of its own (by default the port + 10000, which may not exist).
    bus = free_port()
    node = RedisServer(
        tmp_path / "cluster",
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        str(tmp_path / "nodes.conf"),
        "--cluster-port",
        str(bus),
    ).start()
    try:
        before = redis_pool.shared_pools()
        with pytest.raises(RedisClusterError, match="Redis Cluster.*CROSSSLOT.*standalone Redis"):
            RedisStore(RedisConfig(node.url))
        assert redis_pool.shared_pools() == before  # the refused store let its pool go
    finally:
        node.stop()
