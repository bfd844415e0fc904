"""Concurrency: threads and processes sharing one engine / one cache directory get the answers a
single caller gets, and a writer killed with SIGKILL mid-write leaves no partial chunk visible."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import random
import sys
import threading
import time
from pathlib import Path

import diskcache
import pytest
import torch

HELPERS = Path(__file__).parent / "reliability_helpers"
sys.path.insert(0, str(HELPERS))
from rel_common import CHUNKS, answer, engine, fully_decodable, keys_of  # noqa: E402
from rel_worker import KILL_CHUNK, REQUESTS, answer_worker, write_worker, writer_chunk  # noqa: E402


@pytest.fixture(scope="module")
def ctx():
    """Fresh processes forked from a server that preloaded torch/transformers (see rel_worker)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["rel_worker"])
    return ctx


@pytest.fixture(scope="module")
def single():
    """Answers of one caller, one request at a time, on its own fresh store."""
    eng = engine(None)
    out = [answer(eng, chunks, q) for q, chunks in REQUESTS]
    eng.close()
    return out


def _run_threads(fn, n: int) -> list:
    """Run fn(i) for i < n in n threads released together; re-raise the first failure."""
    barrier = threading.Barrier(n)
    results: list = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = fn(i)
        except BaseException as exc:  # noqa: BLE001 - threads swallow exceptions: collect and re-raise
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a request hung"
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_eight_threads_on_one_engine_answer_like_a_single_caller(tmp_path, single, pipelined) -> None:
    eng = engine(tmp_path / "kv", pipelined=pipelined)
    try:
        # Cold store: the threads race to compute and write back the same chunks; then warm.
        for _ in range(2):
            got = _run_threads(lambda i: answer(eng, REQUESTS[i][1], REQUESTS[i][0]), 8)
            for (ids, logits), (want_ids, want_logits) in zip(got, single):
                assert ids == want_ids
                assert torch.allclose(logits, want_logits, atol=1e-5)
            eng.flush()
        assert eng.store.stats.corrupt == 0 and eng.store.stats.write_errors == 0
        assert all(fully_decodable(eng, k) for k in keys_of(eng, CHUNKS))
    finally:
        eng.close()


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _importable("langchain_cacheblend"), reason="langchain_cacheblend is not installed")
def test_langchain_chat_model_under_threads(tmp_path) -> None:
    from langchain_cacheblend import ChatCacheBlend

    eng = engine(tmp_path / "kv")
    try:
        llm = ChatCacheBlend(engine=eng, max_new_tokens=6)

        def ask(i: int) -> str:
            q, chunks = REQUESTS[i]
            return llm.invoke({"question": q, "context": chunks}).content

        want = [ask(i) for i in range(8)]  # one caller, one request at a time
        assert _run_threads(ask, 8) == want
    finally:
        eng.close()


@pytest.mark.skipif(not _importable("llama_index.cacheblend"), reason="llama_index.cacheblend is not installed")
def test_llama_index_llm_under_threads(tmp_path, single) -> None:
    from llama_index.cacheblend import CacheBlendLLM

    eng = engine(tmp_path / "kv")
    try:
        llm = CacheBlendLLM(engine=eng, max_new_tokens=6)
        got = _run_threads(lambda i: llm.answer_chunks(*REQUESTS[i]).token_ids, 8)
        assert got == [ids for ids, _ in single[:8]]
    finally:
        eng.close()


# ------------------------------------------------------------------ processes


def test_processes_sharing_one_directory_answer_like_a_single_process(tmp_path, single, ctx) -> None:
    shared = tmp_path / "kv"
    outs = [tmp_path / f"w{i}.json" for i in range(2)]
    procs = [ctx.Process(target=answer_worker, args=(str(shared), str(o))) for o in outs]
    for p in procs:
        p.start()
    # This process is the third user of the directory, reading while the workers write.
    eng = engine(shared)
    try:
        mine = [answer(eng, chunks, q)[0] for q, chunks in REQUESTS]
        for p in procs:
            p.join(timeout=300)
            assert p.exitcode == 0
        want = [ids for ids, _ in single]
        assert mine == want
        for o in outs:
            result = json.loads(o.read_text())
            assert result["answers"] == want
            assert result["stats"]["corrupt"] == 0 and result["stats"]["write_errors"] == 0
        assert eng.store.stats.corrupt == 0
        assert all(fully_decodable(eng, k) for k in keys_of(eng, CHUNKS))
    finally:
        eng.close()


def _start_writer(ctx, directory: Path, mode: str):
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=write_worker, args=(str(directory), mode, send))
    proc.start()
    send.close()  # the child holds the only write end: recv() raises EOFError once it dies
    return proc, recv


def _published(recv, until: int | None = None) -> int:
    """Last chunk index the writer reported published; with ``until``, stop once it reaches it."""
    last = -1
    while True:
        if not recv.poll(300):
            raise AssertionError("writer stopped reporting")
        try:
            last = recv.recv()
        except EOFError:
            return last
        if until is not None and last >= until:
            return last


def _check_after_kill(directory: Path, published: int) -> int:
    """Every chunk the store shows decodes fully; the engine then answers as a clean one does."""
    eng = engine(directory)
    ref = engine(None)
    try:
        texts = [writer_chunk(i) for i in range(published + 20)]
        keys = keys_of(eng, texts)
        visible = [k for k in keys if eng.store.contains(k)]
        assert len(visible) >= published + 1  # everything reported published is there
        for k in visible:
            assert fully_decodable(eng, k), "a visible chunk has a missing or broken layer"
        assert eng.store.stats.corrupt == 0
        # Answer over a published chunk, the one being written when killed, and a new one.
        chunks = [texts[0], texts[published + 1], CHUNKS[0]]
        got, want = answer(eng, chunks), answer(ref, chunks)
        assert got[0] == want[0] and torch.equal(got[1], want[1])
        return len(visible)
    finally:
        eng.close()
        ref.close()


def test_writer_killed_between_layer_records_leaves_nothing_visible(tmp_path, ctx) -> None:
    # The worker SIGKILLs itself right after storing layer 1 of chunk KILL_CHUNK, before its meta.
    directory = tmp_path / "kv"
    proc, recv = _start_writer(ctx, directory, "at-record")
    last = _published(recv)
    proc.join(timeout=300)
    assert proc.exitcode == -9
    assert last == KILL_CHUNK - 1
    eng = engine(None)
    key = keys_of(eng, [writer_chunk(KILL_CHUNK)])[0]
    eng.close()
    with diskcache.Cache(str(directory)) as raw:
        assert raw.get(f"{key}/0") is not None and raw.get(f"{key}/meta") is None  # really mid-chunk
    assert _check_after_kill(directory, last) == KILL_CHUNK


def test_writer_killed_at_a_random_moment_leaves_nothing_partial(tmp_path, ctx) -> None:
    # SIGKILL at an arbitrary point (possibly inside a value file write or a SQLite transaction).
    directory = tmp_path / "kv"
    proc, recv = _start_writer(ctx, directory, "free")
    published = _published(recv, until=1)
    time.sleep(random.Random().uniform(0.0, 0.2))
    proc.kill()
    proc.join(timeout=60)
    assert proc.exitcode == -9
    while recv.poll():  # chunks published between our read and the kill
        try:
            published = recv.recv()
        except EOFError:
            break
    _check_after_kill(directory, published)
