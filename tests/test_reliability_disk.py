"""The disk itself: a real full file system (a small tmpfs the test mounts), a store that cannot be
written but holds chunks, a size limit that must cover every byte the store keeps, a limit smaller
than one chunk, and an open that fails half way. Answers always equal the clean-cache answer;
caching comes back by itself once the disk can be written again."""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import diskcache
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "reliability_helpers"))
from rel_common import CHUNKS, answer, engine, fully_decodable, keys_of

from cacheblend_rag.store import disk as kv_store
from cacheblend_rag.store.disk import KVStore, KVStoreOpenError

LONG = " ".join(["The river Thames flows through London and Oxford."] * 14)  # >32 KiB/layer: file-backed
FILE_CHUNKS = [LONG, *CHUNKS[:2]]


@pytest.fixture(scope="module")
def clean():
    eng = engine(None)
    out = {name: answer(eng, chunks) for name, chunks in {"short": CHUNKS, "files": FILE_CHUNKS}.items()}
    eng.close()
    return out


def _same(got, want) -> None:
    assert got[0] == want[0], "token ids differ from the clean-cache answer"
    assert torch.equal(got[1], want[1]), "logits differ from the clean-cache answer"


def _files(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*.val")}


def _du(directory: Path) -> int:
    """Bytes the directory occupies on disk, folders included (what `du` reports)."""
    total = directory.stat().st_blocks * 512
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


# ------------------------------------------------------------------ a real full disk


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a tmpfs to fill ({exc}); needs root and the mount command")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill: {done.stderr.strip() or done.returncode} (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def _fill(path: Path) -> None:
    """Write until the file system refuses another byte."""
    block = b"\0" * 65536
    with open(path, "wb", buffering=0) as fh:
        while True:
            try:
                fh.write(block)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
    with open(path, "ab", buffering=0) as fh:  # and the last partial block
        for size in (4096, 512, 1):
            try:
                while True:
                    fh.write(b"\0" * size)
            except OSError:
                pass


def test_full_disk_answers_right_leaves_nothing_behind_and_recovers(small_fs, clean, caplog, monkeypatch) -> None:
    store_dir = small_fs / "kv"
    eng = engine(store_dir)
    try:
        eng.precompute(CHUNKS, progress=False)  # published before the disk fills
        ballast = small_fs / "ballast"
        _fill(ballast)
        before = _files(store_dir)
        with caplog.at_level(logging.WARNING):
            _same(answer(eng, FILE_CHUNKS), clean["files"])  # new chunks: not cacheable
            _same(answer(eng, CHUNKS), clean["short"])  # cached chunks: still served
            eng.flush()
        assert "not caching new chunks until space is freed" in caplog.text
        assert eng.store.stats.corrupt == 0  # a full disk is not damage: cached chunks were served
        assert all(eng.store.contains(k) for k in keys_of(eng, CHUNKS))
        assert _files(store_dir) == before
        # A put that starts anyway (the free-space check raced another writer) fails half way:
        # its value files are unlinked, which needs no space, so the disk is not kept full.
        monkeypatch.setattr(kv_store.shutil, "disk_usage", lambda path: _Plenty())
        seg = eng.prompts.chunk_segment(LONG)
        assert not eng.store.put(eng.chunk_key(seg), eng.compute_chunk(seg))
        assert _files(store_dir) == before, "a half-written chunk left its files on the full disk"
        monkeypatch.undo()
        # Another process opening the store on the full disk still gets its chunks.
        other = KVStore(store_dir, fingerprint=eng.fingerprint)
        try:
            key = keys_of(eng, CHUNKS)[0]
            assert other.get_layer(key, 0) is not None
            # Space returns: both stores cache again by themselves.
            ballast.unlink()
            monkeypatch.setattr(kv_store, "_REOPEN_S", 0.0)
            _same(answer(eng, FILE_CHUNKS), clean["files"])
            eng.flush()
            assert all(fully_decodable(eng, k) for k in keys_of(eng, FILE_CHUNKS))
            seg = eng.prompts.chunk_segment("A chunk written after the disk recovered.")
            assert other.put(eng.chunk_key(seg), eng.compute_chunk(seg))
        finally:
            other.close()
    finally:
        eng.close()


class _Plenty:
    """shutil.disk_usage result claiming lots of free space."""

    total = used = 0
    free = 2**40


# ------------------------------------------------------------------ a store that cannot be written


def test_unwritable_store_with_chunks_is_served_and_recovers(tmp_path, clean, caplog, monkeypatch) -> None:
    warm = engine(tmp_path / "kv")
    warm.precompute(CHUNKS, progress=False)
    warm.close()
    real = diskcache.Cache

    class ReadOnlyCache(real):  # as root a chmod does not block writes: simulate the mount
        def __init__(self, directory=None, *args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system", str(directory))

    monkeypatch.setattr(diskcache, "Cache", ReadOnlyCache)
    with caplog.at_level(logging.WARNING):
        eng = engine(tmp_path / "kv")
    try:
        assert eng.store.directory == tmp_path / "kv" and eng.store.read_only
        assert "serving the chunks it holds read-only" in caplog.text
        res = eng.generate("Where?", CHUNKS, max_new_tokens=1)
        assert res.stats["chunk_hits"] == len(CHUNKS) and res.stats["chunk_misses"] == 0
        _same(answer(eng, CHUNKS), clean["short"])
        _same(answer(eng, FILE_CHUNKS), clean["files"])  # new chunks: computed, not stored
        eng.flush()
        assert not eng.store.contains(keys_of(eng, FILE_CHUNKS)[0])
        monkeypatch.setattr(diskcache, "Cache", real)  # remounted read-write
        monkeypatch.setattr(kv_store, "_REOPEN_S", 0.0)
        answer(eng, FILE_CHUNKS)
        eng.flush()
        assert not eng.store.read_only
        assert all(fully_decodable(eng, k) for k in keys_of(eng, FILE_CHUNKS))
    finally:
        eng.close()


# ------------------------------------------------------------------ size limit


def test_size_limit_counts_every_byte_on_disk(tmp_path, clean) -> None:
    limit = 3 * 2**20
    eng = engine(tmp_path / "kv", size_limit=limit)
    try:
        texts = [f"Chunk {i}: {LONG}" for i in range(30)]  # ~4 file-backed records of 35 KiB each
        seg = eng.prompts.chunk_segment(texts[0])
        record = 2 * eng.kv_shape[0] * len(seg) * eng.kv_shape[1] * 4 + 4096
        for i in range(0, len(texts), 3):
            eng.precompute(texts[i : i + 3], progress=False)
            assert _du(eng.store.directory) <= limit + record, "the store grew past its size limit"
        assert eng.store.volume() > limit // 2  # the store was used, not emptied
        _same(answer(eng, CHUNKS), clean["short"])
    finally:
        eng.close()


def test_limit_smaller_than_one_chunk_warns_and_writes_nothing(tmp_path, caplog) -> None:
    # 8 layers x ~205 KB: over the limit; the other two chunks need ~350 KB together, which leaves
    # them ~0.6 MB of the ~1 MB the limit keeps for records (so a log past its bound evicts neither).
    big = [" ".join([LONG] * 3), *CHUNKS[:2]]
    limit = 3 * 2**19
    ref = engine(None, layers=8)
    want = answer(ref, big)
    ref.close()
    eng = engine(tmp_path / "kv", layers=8, size_limit=limit)
    try:
        with caplog.at_level(logging.WARNING):
            _same(answer(eng, big), want)
            eng.flush()
        assert f"more than the store's size limit of {limit} bytes" in caplog.text
        assert "raise the size limit" in caplog.text
        assert _files(eng.store.directory) == set()  # nothing written only to be evicted
        assert eng.store.contains(keys_of(eng, big)[1])  # chunks that fit are still cached
    finally:
        eng.close()


# ------------------------------------------------------------------ failed open


def _db_handles(directory: Path) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory)):
                n += 1
        except OSError:
            pass
    return n


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts open files through /proc")
def test_failed_open_leaves_no_database_handle_open(tmp_path, monkeypatch) -> None:
    def full(self, key, value=diskcache.core.ENOVAL, update=True):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(diskcache.Cache, "reset", full)  # fails after diskcache has connected
    with pytest.raises(KVStoreOpenError, match="cannot open KV store directory") as info:
        KVStore(tmp_path / "kv")
    # The exception, its cause and their tracebacks are still alive here (held by ``info``), and
    # still no database handle is open: closing must not wait for them to be collected.
    assert "database or disk is full" in str(info.value)
    assert isinstance(info.value.__cause__, sqlite3.OperationalError)
    assert _db_handles(tmp_path / "kv") == 0


def test_a_read_only_store_read_after_its_reader_closed_is_a_miss(tmp_path, monkeypatch) -> None:
    # The reader closes when the store becomes writable again (a read on its way then meets it
    # closed) or when the store is closed: a read must be a miss, never an AttributeError.
    warm = engine(tmp_path / "kv")
    warm.precompute(CHUNKS, progress=False)
    key = keys_of(warm, CHUNKS)[0]
    warm.close()
    real = diskcache.Cache

    class ReadOnlyCache(real):
        def __init__(self, directory=None, *args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system", str(directory))

    monkeypatch.setattr(diskcache, "Cache", ReadOnlyCache)
    eng = engine(tmp_path / "kv")
    store = eng.store
    assert store.read_only and store.contains(key)
    open_volume = store.volume()
    eng.close()
    assert store.contains(key) is False and store.get_layer(key, 0) is None
    # The closed reader counts no database bytes any more (and does not raise).
    assert store.volume() < open_volume
