"""Limits and storage faults: the cache stays within its size limit under churn with LRU
eviction; full, read-only, failing or unopenable storage degrades to recomputing (with a
warning) and never changes or fails an answer.

Size slack (documented in docs/reliability.md): diskcache culls after each write, at most 10
least-recently-used records per write, once ``volume() >= size_limit``. With records of similar
size a write therefore leaves ``volume() <= size_limit + one record``; ``volume()`` counts SQLite
pages too, whose count only grows (freed pages are reused, the file is not shrunk).
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import sys
from pathlib import Path

import diskcache
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "reliability_helpers"))
from rel_common import CHUNKS, answer, engine, fully_decodable, keys_of, model, tokenizer

from cacheblend_rag import CacheBlendEngine


@pytest.fixture(scope="module")
def clean():
    eng = engine(None)
    out = answer(eng, CHUNKS)
    eng.close()
    return out


@pytest.fixture
def eng(tmp_path):
    e = engine(tmp_path / "kv")
    yield e
    e.close()


def _same(got, want) -> None:
    assert got[0] == want[0] and torch.equal(got[1], want[1])


# ------------------------------------------------------------------ size limit and LRU under churn


@pytest.mark.parametrize("repeat", [1, 4], ids=["inline-records", "file-records"])
def test_size_limit_and_lru_hold_under_churn(tmp_path, repeat) -> None:
    # repeat=4 makes each layer record > 32 KiB, so diskcache keeps it in a file, not in SQLite.
    texts = [f"Chunk {i}: " + CHUNKS[i % 4] * repeat for i in range(14)]
    hot, cold = texts[0], texts[1]
    e = engine(tmp_path / "kv")  # limit set below from measured sizes
    try:
        e.generate("Q?", [hot], max_new_tokens=1)
        e.flush()
        before = e.store.volume()
        e.generate("Q?", [cold], max_new_tokens=1)
        e.flush()
        # Measured, not computed: SQLite pages grow by more than a record's bytes for inline values.
        per_chunk = e.store.volume() - before
        record = per_chunk // e.num_layers + 1
        limit = e.store.volume() + 4 * per_chunk  # room for ~5 more chunks
        e.store.size_limit = limit
        for t in texts[2:]:
            e.generate("Where?", [hot, t], max_new_tokens=1)  # every request uses the hot chunk
            e.flush()
            assert e.store.volume() <= limit + record
        keys = keys_of(e, texts)
        assert fully_decodable(e, keys[0]), "the chunk used by every request was evicted"
        assert not e.store.contains(keys[1]), "a chunk used once, long ago, survived the churn"
        recent = sum(e.store.contains(k) for k in keys[-4:])
        assert recent >= 3, "the cache kept too little: eviction emptied it"
        assert e.store.stats.corrupt == 0
    finally:
        e.close()


# ------------------------------------------------------------------ write faults

WRITE_FAULTS = {
    "disk-full": OSError(errno.ENOSPC, "No space left on device"),
    "sqlite-full": sqlite3.OperationalError("database or disk is full"),
    "read-only": OSError(errno.EROFS, "Read-only file system"),
    "sqlite-read-only": sqlite3.OperationalError("attempt to write a readonly database"),
    "locked": diskcache.Timeout("database is locked"),
}


@pytest.mark.parametrize("fault", WRITE_FAULTS.values(), ids=WRITE_FAULTS.keys())
def test_failing_writes_degrade_to_recompute(eng, clean, caplog, monkeypatch, fault) -> None:
    def fail(*args, **kwargs):
        raise fault

    for op in ("set", "delete", "evict"):  # a read-only/full disk fails every write
        monkeypatch.setattr(eng.store._cache, op, fail)
    with caplog.at_level(logging.WARNING):
        _same(answer(eng, CHUNKS), clean)
        assert eng.precompute(CHUNKS[:2], progress=False) == 2  # computes, cannot store, no error
        eng.flush()
        _same(answer(eng, CHUNKS), clean)  # still all misses, still right
    assert eng.store.stats.write_errors >= len(CHUNKS)
    assert "could not write KV chunk" in caplog.text
    monkeypatch.undo()  # the disk recovers: the cache works again
    answer(eng, CHUNKS)
    eng.flush()
    assert all(fully_decodable(eng, k) for k in keys_of(eng, CHUNKS))


def test_disk_full_half_way_through_a_chunk_leaves_it_invisible(eng, clean, monkeypatch) -> None:
    real = eng.store._cache.set
    calls = []

    def set_then_fail(name, *args, **kwargs):
        calls.append(name)
        if name.endswith("/2"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(eng.store._cache, "set", set_then_fail)
    _same(answer(eng, CHUNKS), clean)
    eng.flush()
    assert any(n.endswith("/1") for n in calls)  # layers 0 and 1 of chunks had been written
    assert not any(eng.store.contains(k) for k in keys_of(eng, CHUNKS))
    with diskcache.Cache(str(eng.store.directory)) as raw:
        assert not [k for k in raw if any(k.startswith(c) for c in keys_of(eng, CHUNKS))]  # cleaned up


# ------------------------------------------------------------------ read faults

READ_FAULTS = {
    "io-error": OSError(errno.EIO, "Input/output error"),
    "sqlite-malformed": sqlite3.DatabaseError("database disk image is malformed"),
    "locked": diskcache.Timeout("database is locked"),
}


@pytest.mark.parametrize("fault", READ_FAULTS.values(), ids=READ_FAULTS.keys())
def test_failing_reads_mid_prefill_degrade_to_recompute(eng, clean, caplog, monkeypatch, fault) -> None:
    eng.precompute(CHUNKS, progress=False)
    real = eng.store._cache.get
    bad = f"{keys_of(eng, CHUNKS)[1]}/2"  # layer 2 of one chunk: fails after layers 0-1 loaded

    def get(name, *args, **kwargs):
        if name == bad:
            raise fault
        return real(name, *args, **kwargs)

    monkeypatch.setattr(eng.store._cache, "get", get)
    with caplog.at_level(logging.WARNING):
        _same(answer(eng, CHUNKS), clean)
    assert "lost during load" in caplog.text  # the engine saw the failed read and recomputed


# ------------------------------------------------------------------ store cannot be opened


def _patch_loader(monkeypatch) -> None:
    """from_pretrained loads the tiny model instead of a real checkpoint."""
    from cacheblend_rag.model import loading as models
    from cacheblend_rag.model.fingerprint import model_fingerprint
    from cacheblend_rag.model.loading import LoadedModel

    def load_model(name, **kwargs):
        m, tok = model(), tokenizer()
        return LoadedModel(m, tok, "tiny", model_fingerprint(m, tok))

    monkeypatch.setattr(models, "load_model", load_model)


def _blocked_dir(tmp_path: Path, how: str, monkeypatch) -> Path:
    if how == "not-a-directory":
        blocker = tmp_path / "file"
        blocker.write_text("a file where the store directory should be")
        return blocker / "kv"
    target = tmp_path / "ro-kv"
    real = diskcache.Cache

    class Cache(real):  # as root chmod does not block: simulate EROFS
        def __init__(self, directory=None, *args, **kwargs):
            if directory is not None and Path(directory) == target:
                raise OSError(errno.EROFS, "Read-only file system", str(target))
            super().__init__(directory, *args, **kwargs)

    monkeypatch.setattr(diskcache, "Cache", Cache)
    return target


@pytest.mark.parametrize("how", ["not-a-directory", "read-only"])
def test_unopenable_store_falls_back_to_a_temporary_one(tmp_path, clean, caplog, monkeypatch, how) -> None:
    _patch_loader(monkeypatch)
    blocked = _blocked_dir(tmp_path, how, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.engine.core"):
        # float records, as the clean answer's store keeps them
        eng = CacheBlendEngine.from_pretrained(
            "tiny", store_dir=str(blocked), cache_dir=str(tmp_path / "home"), kv_format="float"
        )
    try:
        assert str(blocked) in caplog.text and "temporary KV store" in caplog.text
        assert eng.store.directory != blocked and eng.store.directory.is_dir()
        _same(answer(eng, CHUNKS), clean)
        eng.flush()
        assert all(eng.store.contains(k) for k in keys_of(eng, CHUNKS))  # the fallback caches
    finally:
        eng.close()
    assert not eng.store.directory.exists()  # the temporary store is removed on close


class RaisingPuts:
    """A store whose chunk writes raise (a third-party store breaking the protocol's never-raise
    rule); the instruction prefix, stored on the request's own thread, still goes in."""

    def __init__(self, inner, prefix_key):
        self.inner, self.prefix_key = inner, prefix_key

    def put(self, key, layers):
        if key == self.prefix_key:
            return self.inner.put(key, layers)
        raise RuntimeError("boom: the store's put raised")

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_write_back_that_raises_is_logged_and_the_answer_stands(eng, clean, caplog):
    # Misses are computed for the request and written back in a background thread; an exception
    # there must say so, not vanish with the thread's future.
    eng.store = RaisingPuts(eng.store, eng.chunk_cache.prefix_key())
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.blend.chunk_cache"):
        ids, logits = answer(eng, CHUNKS)
        eng.flush()
    assert ids == clean[0] and torch.equal(logits, clean[1])
    failures = [r.getMessage() for r in caplog.records if "background KV write-back failed" in r.getMessage()]
    assert failures and all("boom: the store's put raised" in m for m in failures)
