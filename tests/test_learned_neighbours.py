"""Neighbours learned from the traffic: bounded, persisted counts; caches refreshed in the background,
never beside an answer; a chunk cached behind exactly the chunks in front of it is full prefill's."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.model.backbone import cache_layers
from cacheblend_rag.neighbours.coretrieval import CoRetrieval
from cacheblend_rag.neighbours.index import NeighbourCache, NeighbourIndex
from cacheblend_rag.neighbours.learned import FILE, LearnConfig
from cacheblend_rag.store.disk import KVStore
from cacheblend_rag.testing import make_model

CHUNKS = [
    "The Thames flows through Oxford and then London before reaching the sea.",
    "Oxford is home to the oldest university in the English-speaking world.",
    "London has been the capital of England for nearly a thousand years.",
]
QUESTION = "Which river flows through Oxford?"


# ---------------------------------------------------------------------- co-retrieval counts
def test_counts_each_chunk_behind_every_chunk_in_front_of_it():
    stats = CoRetrieval()
    stats.record(["a", "b", "c"])
    stats.record(["b", "c"])
    assert stats.count("c", "b") == 2 and stats.count("c", "a") == 1 and stats.count("a", "c") == 0
    assert stats.predecessors("c", 2) == ["b", "a"]
    # Equally frequent: the chunk counted later (nearer in front) first.
    stats.record(["x", "y", "z"])
    assert stats.predecessors("z", 2) == ["y", "x"]


def test_counts_are_bounded_in_chunks_and_predecessors():
    stats = CoRetrieval(max_chunks=3, max_predecessors=2)
    for i in range(10):
        stats.record([f"p{i}", "hot", f"q{i}"])
    assert len(stats) == 3  # the least recently retrieved chunks were forgotten
    stats = CoRetrieval(max_chunks=10, max_predecessors=4)
    for i in range(30):
        stats.record(["frequent", f"rare{i}", "target"])
    # Space-Saving keeps the heavy hitter in 4 counters whatever the number of rare predecessors.
    assert stats.predecessors("target", 1) == ["frequent"] and stats.count("target", "frequent") == 30
    assert sum(1 for i in range(30) if stats.count("target", f"rare{i}")) == 3


def test_counts_round_trip_and_malformed_ones_are_refused():
    stats = CoRetrieval(max_chunks=5, max_predecessors=3)
    stats.record(["a", "b", "c"])
    again = CoRetrieval.from_json(stats.to_json())
    assert again.predecessors("c", 3) == stats.predecessors("c", 3) and again.max_predecessors == 3
    with pytest.raises(ValueError, match="co-retrieval"):
        CoRetrieval.from_json({"max_chunks": 5, "max_predecessors": 3, "counts": [["c", {"a": -1}]]})
    with pytest.raises(ValueError, match="malformed co-retrieval"):
        CoRetrieval.from_json({"counts": []})
    with pytest.raises(ValueError, match="must both be >= 1"):
        CoRetrieval(max_chunks=0)


def test_index_keeps_a_bounded_number_of_caches_per_chunk_and_the_embedding_one_longest():
    index = NeighbourIndex(max_per_chunk=2)
    index.add("c", NeighbourCache("similar", ("s",), learned=False))
    index.add("c", NeighbourCache("l1", ("a",), learned=True))
    index.add("c", NeighbourCache("l2", ("b",), learned=True))
    assert [c.key for c in index.caches("c")] == ["similar", "l2"]
    index.add("c", NeighbourCache("l2-again", ("b",), learned=True))  # same prefix: replaced
    assert [c.key for c in index.caches("c")] == ["similar", "l2-again"]
    again = NeighbourIndex.from_json(index.to_json())
    assert again.caches("c") == index.caches("c")
    with pytest.raises(ValueError, match="neighbour cache entry"):
        NeighbourIndex.from_json({"max_per_chunk": 2, "max_chunks": 5, "caches": [["c", [["k", ["a"], "yes"]]]]})


@pytest.mark.parametrize("bad", [{"neighbours": 0}, {"min_count": True}, {"save_every": -1}, {"max_pending": 1.5}])
def test_learn_config_refuses_bad_values(bad):
    with pytest.raises(ValueError, match=f"LearnConfig.{next(iter(bad))}"):
        LearnConfig(**bad)


# ---------------------------------------------------------------------- the engine learning
def _engine(tokenizer, directory, arch="llama"):
    torch.manual_seed(0)
    return CacheBlendEngine(make_model(arch), tokenizer, store=KVStore(directory), pipelined=False)


def test_learned_caches_make_full_reuse_equal_full_prefill(tokenizer, tmp_path):
    """A chunk cached behind exactly the chunks in front of it holds full prefill's K/V for it: once
    the prompt's chunks were learned, reusing every cache (nothing recomputed) is full prefill."""
    eng = _engine(tokenizer, tmp_path / "kv")
    try:
        learner = eng.learn_neighbours(LearnConfig(neighbours=2))
        first = eng.generate(QUESTION, CHUNKS, mode="full_reuse", max_new_tokens=4)
        learner.wait()
        assert learner.computed == 2  # chunk 2 behind chunk 1, chunk 3 behind chunks 1 and 2
        keys = [eng.chunk_key(eng.prompts.chunk_segment(t)) for t in CHUNKS]
        assert eng.chunk_cache.neighbours.caches(keys[2])[0].behind == (keys[0], keys[1])

        layout = eng.build_layout(QUESTION, CHUNKS)
        full = eng.prefill(layout, "full_recompute")
        reuse = eng.prefill(layout, "full_reuse")
        assert reuse.stats["neighbour_hits"] == 2
        torch.testing.assert_close(reuse.logits, full.logits, rtol=1e-4, atol=1e-4)
        # The K/V too, on every layer and position but the last layer's (which no later layer reads).
        for layer in range(eng.num_layers - 1):
            for ours, theirs in zip(cache_layers(reuse.cache)[layer], cache_layers(full.cache)[layer]):
                torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
        assert first.stats["neighbour_hits"] == 0  # the request that taught it was not changed
    finally:
        eng.close()


def test_the_refresh_waits_for_the_engine_lock_an_answer_in_flight_holds(tokenizer, tmp_path):
    eng = _engine(tokenizer, tmp_path / "kv")
    try:
        learner = eng.learn_neighbours()
        lock = eng.lock
        with lock:  # as a running answer holds it
            eng.generate(QUESTION, CHUNKS, max_new_tokens=2)
            done = threading.Event()
            threading.Thread(target=lambda: (learner.wait(), done.set()), daemon=True).start()
            assert not done.wait(0.5) and learner.computed == 0
        assert done.wait(60) and learner.computed == 2
    finally:
        eng.close()


def test_learning_never_changes_the_answer_that_teaches_it(tokenizer, tmp_path):
    plain = _engine(tokenizer, tmp_path / "a")
    learning = _engine(tokenizer, tmp_path / "b")
    try:
        learning.learn_neighbours()
        a = plain.generate(QUESTION, CHUNKS, max_new_tokens=8)
        b = learning.generate(QUESTION, CHUNKS, max_new_tokens=8)
        assert a.token_ids == b.token_ids
    finally:
        plain.close()
        learning.close()


def test_learned_neighbours_are_saved_beside_the_store_and_used_after_a_restart(tokenizer, tmp_path):
    eng = _engine(tokenizer, tmp_path / "kv")
    eng.learn_neighbours()
    eng.generate(QUESTION, CHUNKS, max_new_tokens=2)
    eng.close()  # finishes the refresh and saves
    assert (tmp_path / "kv" / FILE).is_file()

    again = _engine(tokenizer, tmp_path / "kv")
    try:
        again.learn_neighbours()
        assert again.generate(QUESTION, CHUNKS, max_new_tokens=2).stats["neighbour_hits"] == 2
    finally:
        again.close()


def test_an_unreadable_saved_file_is_ignored_with_a_warning(tokenizer, tmp_path, caplog):
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / FILE).write_text("{not json", encoding="utf-8")
    eng = _engine(tokenizer, tmp_path / "kv")
    try:
        with caplog.at_level("WARNING"):
            learner = eng.learn_neighbours()
        assert "ignoring unreadable" in caplog.text and len(learner.stats) == 0
        assert eng.generate(QUESTION, CHUNKS, max_new_tokens=2).text is not None
    finally:
        eng.close()


# ---------------------------------------------------------------------- the refresh and answers in flight
def _gate(learner, eng):
    """Hold ``learner``'s refreshes back until the returned event is set (then they take the engine's
    lock as usual): a refresh that takes long, as on a large model."""
    opened = threading.Event()

    @contextlib.contextmanager
    def gated():
        opened.wait()
        with eng.lock:
            yield

    learner._lock = gated
    return opened


def test_requests_never_wait_for_a_refresh_and_the_queue_stays_bounded(tokenizer, tmp_path):
    eng = _engine(tokenizer, tmp_path / "kv")
    plain = _engine(tokenizer, tmp_path / "plain")
    try:
        learner = eng.learn_neighbours(LearnConfig(max_pending=2))
        opened = _gate(learner, eng)
        orders = [CHUNKS, CHUNKS[::-1], CHUNKS[1:] + CHUNKS[:1], CHUNKS[2:] + CHUNKS[:2]]
        for chunks in orders:  # each answered while every refresh is still held back
            got = eng.generate(QUESTION, chunks, max_new_tokens=4)
            assert got.token_ids == plain.generate(QUESTION, chunks, max_new_tokens=4).token_ids
        assert learner.computed == 0 and learner._jobs.qsize() <= 2  # one being held, the rest dropped beyond 2
        opened.set()
        learner.wait()
        assert 1 <= learner.computed <= 3
    finally:
        eng.close()
        plain.close()


def test_a_refresh_between_an_answers_tokens_does_not_change_it(tokenizer, tmp_path):
    eng = _engine(tokenizer, tmp_path / "kv")
    plain = _engine(tokenizer, tmp_path / "plain")
    try:
        learner = eng.learn_neighbours()
        opened = _gate(learner, eng)
        eng.generate(QUESTION, CHUNKS, max_new_tokens=2)  # teaches: two refreshes queued, held back
        stream = eng.stream(QUESTION, CHUNKS, max_new_tokens=12, temperature=0.0)
        first = next(iter(stream))  # prefilled (with the caches there were) and answering
        opened.set()
        learner.wait()  # the learned caches are computed in the middle of the answer
        assert learner.computed == 2
        text = first + "".join(stream)
        assert stream.result is not None and stream.result.stats["neighbour_hits"] == 0
        ref = plain.generate(QUESTION, CHUNKS, max_new_tokens=12)
        assert stream.result.token_ids == ref.token_ids and text == ref.text
        assert eng.generate(QUESTION, CHUNKS, max_new_tokens=2).stats["neighbour_hits"] == 2  # used from now on
    finally:
        eng.close()
        plain.close()
