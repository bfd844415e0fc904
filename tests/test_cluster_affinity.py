"""Chunk-affinity routing's policy and request parsing, without Ray (``cluster.affinity``,
``cluster.documents``, ``cluster.asgi``)."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from cacheblend_rag.chat.messages import chunk_part
from cacheblend_rag.cluster.affinity import (
    AffinityPolicy,
    AffinityTable,
    ResidentChunks,
)
from cacheblend_rag.cluster.documents import digest, digests, request_documents

A, B, C = "replica-a", "replica-b", "replica-c"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _table(**policy) -> tuple[AffinityTable, Clock]:
    clock = Clock()
    return AffinityTable(AffinityPolicy(**policy), clock=clock, rng=random.Random(0)), clock


def test_the_replica_holding_most_of_the_documents_comes_first():
    table, _ = _table()
    reported = {A: ["d1"], B: ["d1", "d2", "d3"], C: []}
    ranks = table.rank(["d1", "d2", "d4"], reported, {A: 0, B: 0, C: 0})
    assert ranks[0] == [B] and sorted(ranks[1]) == [A, C]


def test_holders_tied_on_documents_share_the_first_rank_for_serve_to_pick_the_least_loaded():
    table, _ = _table()
    ranks = table.rank(["d1"], {A: ["d1"], B: ["d1"], C: []}, {A: 2, B: 0, C: 0})
    assert sorted(ranks[0]) == [A, B] and ranks[1] == [C]


def test_a_holder_much_busier_than_the_least_loaded_replica_is_passed_over():
    table, _ = _table(max_queue_gap=2)
    ranks = table.rank(["d1"], {A: ["d1"], B: [], C: ["x"]}, {A: 5, B: 0, C: 1})
    # A holds the document but has 5 queued against B's 0: the new document goes where it
    # displaces least among the replicas that are not swamped (B holds nothing).
    assert ranks[0] == [B] and A in ranks[1]


def test_without_a_match_the_replica_holding_fewest_documents_comes_first():
    table, _ = _table()
    ranks = table.rank(["new"], {A: ["x", "y"], B: ["z"], C: ["u", "v", "w"]}, {})
    assert ranks[0] == [B]
    assert table.rank([], {A: ["x"], B: []}, {})[0] == [B]  # a request without documents too


def test_routing_decisions_count_as_holdings_until_the_replicas_report_confirms_them():
    table, clock = _table(assignment_ttl_s=10.0)
    table.assign(["d1", "d2"], A)
    assert table.rank(["d1"], {A: [], B: []}, {})[0] == [A]  # routed there a moment ago
    clock.now = 11.0  # A's reports since then never listed d1: its memory tier evicted it
    assert sorted(table.rank(["d1"], {A: [], B: []}, {})[0]) == [A, B]
    table.assign(["d3"], B)
    table.forget(B)  # B died
    assert table.holdings({A: [], B: []})[B] == set()


def test_min_match_and_bad_policies():
    table, _ = _table(min_match=2)
    assert table.rank(["d1", "d9"], {A: ["d1"], B: []}, {})[0] == [B]  # one match is not enough
    for bad, message in [
        ({"min_match": 0}, "min_match=0 must be an int >= 1"),
        ({"max_queue_gap": -1}, "max_queue_gap=-1 must be an int >= 0"),
        ({"assignment_ttl_s": -1}, "assignment_ttl_s=-1 must be a number of seconds >= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            AffinityPolicy(**bad)


def test_resident_chunks_report_only_what_the_memory_tier_still_holds():
    resident = ResidentChunks(capacity=3)
    resident.record([("d1", "k1"), ("d2", "k2"), ("d3", "k3"), ("d4", "k4")])  # d1 falls out: capacity 3
    held = {"k2", "k4"}
    assert resident.resident(held.__contains__) == ["d2", "d4"]
    assert len(resident) == 2  # d3 was evicted from the tier: forgotten


def test_documents_are_read_from_chat_and_completion_bodies_as_the_server_reads_them():
    docs = ["Paris is in France.", "Rome is in Italy."]
    chat = {"model": "m", "messages": [{"role": "user", "content": "Where?"}], "documents": docs}
    assert request_documents("/v1/chat/completions", json.dumps(chat).encode()) == docs
    parts = {"model": "m", "messages": [{"role": "user", "content": [chunk_part(docs[0]), {"type": "text", "text": "Where?"}]}]}
    assert request_documents("/v1/chat/completions", json.dumps(parts).encode()) == docs[:1]
    completion = {"model": "m", "prompt": "Where?", "documents": docs}
    assert request_documents("/v1/completions", json.dumps(completion).encode()) == docs
    assert request_documents("/v1/models", b"") == []
    assert request_documents("/v1/chat/completions", b"{not json") == []  # the replica answers the 400
    assert digests(docs + docs[:1]) == (digest(docs[0]), digest(docs[1]))
    assert len(digest("x")) == 16 and digest("x") != digest("y")


def test_call_app_streams_the_apps_messages_and_reports_a_client_that_leaves():
    from cacheblend_rag.cluster.asgi import ForwardedRequest, call_app

    seen: list[str] = []

    async def app(scope, receive, send):
        body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-path", scope["path"].encode())]})
        await send({"type": "http.response.body", "body": body.upper(), "more_body": True})
        seen.append((await receive())["type"])  # blocks until the consumer leaves

    async def main():
        req = ForwardedRequest("POST", "/v1/x", b"", ((b"content-type", b"text/plain"),), b"hello")
        stream = call_app(app, req)
        start = await anext(stream)
        part = await anext(stream)
        await stream.aclose()  # the client left
        return start, part

    start, part = asyncio.run(main())
    assert start["status"] == 200 and dict(start["headers"])[b"x-path"] == b"/v1/x"
    assert part["body"] == b"HELLO"
    assert seen == ["http.disconnect"]
