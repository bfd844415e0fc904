"""Behaviour of the binary KV record and the diskcache-backed KV store."""

from __future__ import annotations

import errno
import logging
import sqlite3
import threading
from pathlib import Path

import diskcache
import pytest
import torch

from cacheblend_rag.store.disk import KVStore, KVStoreOpenError, SafeDisk, UnsafeRecordError
from cacheblend_rag.store.keys import chunk_key
from cacheblend_rag.store.meta import ChunkMeta
from cacheblend_rag.store.record import HEADER_SIZE, CorruptRecordError, decode_layer, encode_layer

FP = "model-fingerprint-abc123"


def _bits(t: torch.Tensor) -> torch.Tensor:
    # Bit-exact comparison that also treats NaN payloads as values.
    return t.contiguous().view(torch.uint8)


def _layers(n: int = 3, tokens: int = 5, dtype: torch.dtype = torch.float16, heads: int = 2, dim: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(heads, tokens, dim, generator=g).to(dtype), torch.randn(heads, tokens, dim, generator=g).to(dtype))
        for _ in range(n)
    ]


@pytest.fixture
def store(tmp_path: Path):
    with KVStore(tmp_path / "kv", fingerprint=FP) as s:
        yield s


# ------------------------------------------------------------------- records


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_record_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    k = torch.randn(4, 7, 16).to(dtype)
    v = torch.randn(4, 7, 16).to(dtype)
    k[0, 0, 0] = float("nan")
    v[1, 2, 3] = float("-inf")
    k2, v2 = decode_layer(encode_layer(k, v, FP), FP)
    assert k2.dtype == v2.dtype == dtype and k2.shape == v2.shape == (4, 7, 16)
    assert torch.equal(_bits(k2), _bits(k)) and torch.equal(_bits(v2), _bits(v))
    k2.add_(1)  # decoded tensors own writable memory


def test_writable_record_buffer_is_wrapped_not_copied() -> None:
    # The store reads records into a bytearray and decodes it in place (no second copy of every
    # layer on every request); bytes are immutable and get copied.
    k, v = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    blob = bytearray(encode_layer(k, v, FP))
    k2, v2 = decode_layer(blob, FP)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    blob[HEADER_SIZE : HEADER_SIZE + 4] = bytes(4)  # the first float of K is now 0.0
    assert k2[0, 0, 0].item() == 0.0 and torch.equal(v2, v)
    k3, _ = decode_layer(bytes(encode_layer(k, v, FP)), FP)
    k3.add_(1)  # a copy: writable, and bytes need no aliasing


def test_store_reads_layers_into_writable_memory(store: KVStore) -> None:
    layers = _layers(2, tokens=600, dtype=torch.float32)  # 77 KB a layer: a value file, not inline
    store.put("w", layers)
    k, v = store.get_layer("w", 1)
    assert torch.equal(k, layers[1][0]) and torch.equal(v, layers[1][1])
    k.mul_(2)  # the caller owns the tensors; the stored record is unchanged
    assert torch.equal(store.get_layer("w", 1)[0], layers[1][0])


def test_record_encodes_non_contiguous_views() -> None:
    base = torch.randn(7, 4, 16)
    k = base.transpose(0, 1)  # [4, 7, 16], non-contiguous
    k2, _ = decode_layer(encode_layer(k, k, FP), FP)
    assert torch.equal(k2, k)


@pytest.mark.parametrize(
    ("k", "v", "match"),
    [
        (torch.zeros(2, 3, 4), torch.zeros(2, 3, 5), "shapes differ"),
        (torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, dtype=torch.float16), "dtypes differ"),
        (torch.zeros(3, 4), torch.zeros(3, 4), "num_kv_heads"),
        (torch.zeros(2, 3, 4, dtype=torch.int32), torch.zeros(2, 3, 4, dtype=torch.int32), "unsupported"),
    ],
)
def test_encode_rejects_invalid_layers(k: torch.Tensor, v: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        encode_layer(k, v, FP)


def _flip(blob: bytes, i: int) -> bytes:
    b = bytearray(blob)
    b[i] ^= 0xFF
    return bytes(b)


@pytest.mark.parametrize(
    ("mutate", "fingerprint", "match"),
    [
        (lambda b: _flip(b, len(b) - 1), FP, "checksum mismatch"),
        (lambda b: _flip(b, HEADER_SIZE), FP, "checksum mismatch"),
        (lambda b: _flip(b, 6), FP, "checksum mismatch"),  # dtype code: f16 <-> bf16 would be silent
        (lambda b: b[:-1], FP, "truncated"),
        (lambda b: b[:10], FP, "truncated"),
        (lambda b: b + b"\0", FP, "trailing"),
        (lambda b: b"XXXX" + b[4:], FP, "bad magic"),
        (lambda b: b, "another-model", "fingerprint mismatch"),
    ],
)
def test_record_corruption_is_detected_and_named(mutate, fingerprint: str, match: str) -> None:
    blob = encode_layer(*_layers(1)[0], FP)
    with pytest.raises(CorruptRecordError, match=match):
        decode_layer(mutate(blob), fingerprint)


# ---------------------------------------------------------------------- keys


def test_chunk_key_is_sensitive_to_every_input() -> None:
    base = chunk_key(FP, [1, 2], [3, 4])
    assert base == chunk_key(FP, (1, 2), torch.tensor([3, 4]))  # same content, any sequence type
    variants = {
        chunk_key("other", [1, 2], [3, 4]),
        chunk_key(FP, [1, 9], [3, 4]),
        chunk_key(FP, [1, 2], [3, 5]),
        chunk_key(FP, [1], [2, 3, 4]),  # split point moved
        chunk_key(FP, [1, 2, 3], [4]),
        chunk_key(FP, [], [1, 2, 3, 4]),
    }
    assert base not in variants and len(variants) == 6


# --------------------------------------------------------------------- store


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_round_trip_per_layer(store: KVStore, dtype: torch.dtype) -> None:
    key = chunk_key(FP, [7], [1, 2, 3])
    layers = _layers(3, tokens=5, dtype=dtype)
    assert not store.contains(key) and store.meta(key) is None
    assert store.put(key, layers)
    assert store.contains(key)
    assert store.meta(key) == ChunkMeta(num_tokens=5, num_layers=3, dtype=str(dtype).split(".")[1])
    for i in reversed(range(3)):
        k, v = store.get_layer(key, i)
        assert torch.equal(_bits(k), _bits(layers[i][0])) and torch.equal(_bits(v), _bits(layers[i][1]))
    s = store.stats
    assert (s.hits, s.misses, s.corrupt, s.write_errors) == (3, 0, 0, 0)
    assert s.bytes_read > 0 and s.bytes_written >= s.bytes_read
    assert store.get_layer(chunk_key(FP, [], [42]), 0) is None
    assert store.stats.as_dict()["misses"] == 1
    with pytest.raises(IndexError):
        store.get_layer(key, 3)


def test_put_is_idempotent(store: KVStore) -> None:
    key = chunk_key(FP, [], [1])
    first = _layers(2, seed=1)
    assert store.put(key, first)
    written = store.stats.bytes_written
    assert store.put(key, _layers(2, seed=2))  # present: no-op, keeps the first value
    assert store.stats.bytes_written == written
    assert torch.equal(store.get_layer(key, 1)[0], first[1][0])


def test_put_rejects_inconsistent_layers_before_writing(store: KVStore) -> None:
    key = chunk_key(FP, [], [1])
    bad = _layers(2, tokens=5) + _layers(1, tokens=6)
    with pytest.raises(ValueError, match="tokens"):
        store.put(key, bad)
    assert store.stats.bytes_written == 0 and not store.contains(key)


def test_records_are_namespaced_by_fingerprint(tmp_path: Path) -> None:
    # Same directory, same key, another model: the record is refused, not reused.
    key = chunk_key(FP, [], [1, 2])
    with KVStore(tmp_path, fingerprint=FP) as a:
        assert a.put(key, _layers(1))
    with KVStore(tmp_path, fingerprint="other") as b:
        assert b.get_layer(key, 0) is None
        assert b.stats.corrupt == 1


def test_chunk_without_meta_is_invisible(store: KVStore) -> None:
    # A writer killed before its final meta write leaves only layer records.
    key = chunk_key(FP, [], [5, 6])
    layers = _layers(2)
    raw = diskcache.Cache(str(store.directory))
    for i, (k, v) in enumerate(layers):
        raw.set(f"{key}/{i}", encode_layer(k, v, FP))
    raw.close()
    assert not store.contains(key) and store.meta(key) is None
    assert store.get_layer(key, 0) is None
    assert store.stats.misses == 1 and store.stats.hits == 0
    assert store.put(key, layers) and store.get_layer(key, 0) is not None  # rewrite heals it


def _raw_keys(directory: Path) -> list[str]:
    with diskcache.Cache(str(directory)) as raw:
        return list(raw)


def test_corrupt_record_on_disk_discards_chunk(store: KVStore, caplog: pytest.LogCaptureFixture) -> None:
    key = chunk_key(FP, [], [1, 2, 3])
    other = chunk_key(FP, [], [9])
    layers = _layers(3)
    assert store.put(key, layers) and store.put(other, _layers(1))
    with diskcache.Cache(str(store.directory)) as raw:
        raw.set(f"{key}/1", _flip(raw.get(f"{key}/1"), HEADER_SIZE + 3))
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.store.disk"):
        assert store.get_layer(key, 1) is None
        assert store.stats.corrupt == 1 and store.stats.hits == 0
        assert not store.contains(key)
        assert not [k for k in _raw_keys(store.directory) if k.startswith(key)]  # all records gone
        assert store.contains(other)  # neighbours untouched
        # Rewritten, corrupted again: still recovers, but the warning is logged once per key.
        assert store.put(key, layers)
        with diskcache.Cache(str(store.directory)) as raw:
            raw.set(f"{key}/0", b"garbage")
        assert store.get_layer(key, 0) is None
    assert store.stats.corrupt == 2
    assert len([r for r in caplog.records if key in r.getMessage()]) == 1
    assert "checksum mismatch" in caplog.records[0].getMessage()


def test_truncated_value_file_is_a_corrupt_miss(store: KVStore) -> None:
    # Power loss can keep the SQLite row but lose the tail of the value file.
    key = chunk_key(FP, [], [1])
    assert store.put(key, _layers(2, tokens=256, dtype=torch.float32, heads=2, dim=16))  # 64 KiB: file-backed
    with diskcache.Cache(str(store.directory)) as raw:
        with raw.get(f"{key}/0", read=True) as fh:
            path = fh.name
    with open(path, "r+b") as fh:
        fh.truncate(1000)
    assert store.get_layer(key, 0) is None
    assert store.stats.corrupt == 1 and not store.contains(key)


def test_evicted_layer_of_published_chunk_is_a_miss(store: KVStore) -> None:
    key = chunk_key(FP, [], [1])
    assert store.put(key, _layers(3))
    with diskcache.Cache(str(store.directory)) as raw:
        raw.delete(f"{key}/2")
    assert store.get_layer(key, 0) is not None
    assert store.get_layer(key, 2) is None
    assert store.stats.misses == 1 and not store.contains(key)


class _Evil:
    """Unpickling this creates the marker file (stands in for arbitrary code)."""

    def __init__(self, marker: Path, pad: int = 0) -> None:
        self.marker = str(marker)
        self.pad = b"x" * pad  # large pads make diskcache put the pickle in a file

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("pad", [0, 100_000], ids=["inline", "file"])
def test_planted_pickles_are_never_executed(store: KVStore, tmp_path: Path, pad: int) -> None:
    marker = tmp_path / "pwned"
    key = chunk_key(FP, [], [1, 2])
    assert store.put(key, _layers(2))
    meta_key = chunk_key(FP, [], [3])
    assert store.put(meta_key, _layers(1))
    raw = diskcache.Cache(str(store.directory))  # default Disk: pickles anything
    raw.set(f"{key}/0", _Evil(marker, pad))
    raw.set(f"{meta_key}/meta", _Evil(marker, pad))
    raw.set(_Evil(marker), b"value under a pickled key")

    assert store.get_layer(key, 0) is None
    assert not store.contains(meta_key)
    assert store.stats.corrupt == 2
    with diskcache.Cache(str(store.directory), disk=SafeDisk) as safe:
        with pytest.raises(UnsafeRecordError):
            list(safe)  # iterating decodes keys: the pickled key is refused
        with pytest.raises(TypeError):
            safe.set("k", {"not": "raw"})  # and nothing is ever pickled on write
    store.discard(key)
    store.volume()
    assert not marker.exists()

    # Sanity: the planted key really is a live exploit for a pickling reader.
    list(raw)
    raw.close()
    assert marker.exists()


def test_eviction_is_least_recently_used(tmp_path: Path) -> None:
    # 12 layers of 32 KiB (file-backed) per chunk: a chunk exceeds diskcache's 10-row cull.
    def chunk(seed: int):
        return _layers(12, tokens=64, dtype=torch.float32, heads=1, dim=64, seed=seed)

    record = 2 * 64 * 64 * 4 + HEADER_SIZE
    limit = 5 * 12 * record
    with KVStore(tmp_path, size_limit=limit, fingerprint=FP) as store:
        hot, cold = chunk_key(FP, [], [0]), chunk_key(FP, [], [1])
        assert store.put(hot, chunk(0)) and store.put(cold, chunk(1))

        def fully_readable(key: str) -> bool:
            return all(store.get_layer(key, i) is not None for i in range(12))

        for n in range(2, 12):
            assert fully_readable(hot)  # reading keeps it recently used
            assert store.put(chunk_key(FP, [], [n]), chunk(n))
            assert store.volume() <= limit + 2 * record + 256 * 1024
        assert fully_readable(hot)
        # Never read after its write: evicted although stored after `hot`.
        assert not store.contains(cold) and store.get_layer(cold, 0) is None
        assert store.volume() > limit // 2  # the cache was used, not emptied


def test_chunk_under_the_limit_but_over_what_the_database_leaves_is_not_written(tmp_path: Path, caplog) -> None:
    # The limit counts the database and its log too (about half a MiB here): a chunk that is
    # smaller than the limit but larger than what is left for records cannot stay. Writing it
    # would evict every other chunk and then its own layers, and still report it stored.
    limit = 2**20
    with KVStore(tmp_path / "kv", size_limit=limit, fingerprint=FP) as store:
        small, big = chunk_key(FP, [], [0]), chunk_key(FP, [], [1])
        assert store.put(small, _layers(2, tokens=16, dtype=torch.float32))
        layers = _layers(8, tokens=120, heads=2, dim=64, dtype=torch.float32)  # 8 x 123 KB: 0.94 MiB
        assert sum(HEADER_SIZE + 2 * k.numel() * 4 for k, _ in layers) < limit
        with caplog.at_level(logging.WARNING, logger="cacheblend_rag.store.disk"):
            assert store.put(big, layers) is False
        assert f"more than the store's size limit of {limit} bytes" in caplog.text
        assert store.contains(small) and store.get_layer(small, 1) is not None  # nothing flushed for it
        assert not store.contains(big)
        assert store.stats.write_errors == 1


@pytest.mark.parametrize(
    "fault",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        sqlite3.OperationalError("database or disk is full"),
        diskcache.Timeout("database is locked"),
    ],
    ids=["enospc", "sqlite-full", "timeout"],
)
def test_put_degrades_on_storage_fault(store: KVStore, monkeypatch, fault: Exception, caplog) -> None:
    def failing_set(*args, **kwargs):
        raise fault

    key = chunk_key(FP, [], [1])
    monkeypatch.setattr(store._cache, "set", failing_set)
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.store.disk"):
        assert store.put(key, _layers(2)) is False
    assert store.stats.write_errors == 1
    assert "could not write" in caplog.text
    monkeypatch.undo()
    assert not store.contains(key)
    assert store.put(key, _layers(2)) and store.contains(key)


def test_fault_after_some_layers_leaves_no_visible_chunk(store: KVStore, monkeypatch) -> None:
    real_set = store._cache.set
    calls = []

    def set_then_fail(name, *args, **kwargs):
        calls.append(name)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_set(name, *args, **kwargs)

    key = chunk_key(FP, [], [1])
    monkeypatch.setattr(store._cache, "set", set_then_fail)
    assert store.put(key, _layers(3)) is False
    monkeypatch.undo()
    assert not store.contains(key) and store.get_layer(key, 0) is None
    assert not _raw_keys(store.directory)  # the partial write was cleaned up


def test_unusable_directory_raises_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(KVStoreOpenError, match=str(blocker / "kv")):
        KVStore(blocker / "kv")


def test_temporary_store_is_removed_on_close() -> None:
    store = KVStore()
    key = chunk_key("", [], [1])
    assert store.put(key, _layers(1)) and store.directory.is_dir()
    store.close()
    store.close()
    assert not store.directory.exists()


def test_concurrent_threads_and_two_handles_on_one_directory(tmp_path: Path) -> None:
    a = KVStore(tmp_path, fingerprint=FP)
    b = KVStore(tmp_path, fingerprint=FP)  # separate connections, like another process
    errors: list[BaseException] = []

    def worker(store: KVStore, wid: int) -> None:
        try:
            for n in range(6):
                key = chunk_key(FP, [], [n])  # overlapping keys across workers
                layers = _layers(2, seed=n)
                assert store.put(key, layers)
                got = store.get_layer(key, 1)
                assert got is not None and torch.equal(got[0], layers[1][0])
        except BaseException as exc:  # noqa: BLE001 - surfaced below; threads swallow exceptions
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s, i)) for i, s in enumerate([a, b, a, b])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a.close()
    b.close()
    assert not errors, errors
    assert a.stats.corrupt == b.stats.corrupt == 0
