"""Disk-backed store of per-chunk KV caches (diskcache + raw binary records).

Layout: a chunk with key ``K`` is stored as one record per layer, ``K/0`` ..
``K/{n-1}`` (bytes from :func:`cacheblend_rag.store.record.encode_layer`), plus a
small ``K/meta`` record written *last*. Readers only trust a chunk whose meta
record exists, so a writer killed half way leaves nothing visible, and the
orphaned layer records are eventually evicted by LRU (or overwritten by the next
``put``). All records of a chunk carry the diskcache tag ``K`` so a chunk can be
dropped in one call even when its meta record is gone.

Nothing is ever pickled: values are ``bytes`` (stored raw by diskcache) and
:class:`SafeDisk` (``safe_disk.py``) refuses to unpickle anything found in the
directory, because the directory may be shared with other, less trusted processes.
The database is opened by ``disk_db.py`` with this store's own settings, never those
found in it, and read-only when it cannot be written.

Eviction is diskcache's: ``size_limit`` with ``least-recently-used`` policy,
culled (up to 10 records at a time) on every write. Reads go through
``Cache.get``, which bumps the record's access time under this policy. Since
eviction works per record, a chunk can lose some layers while its meta survives;
``get_layer`` then reports a miss and discards the rest so the caller rewrites it.

``size_limit`` counts every byte of the store (records, database, its
write-ahead log, value folders), not only what diskcache counts: diskcache gets
the limit minus the rest. A chunk larger than what the limit leaves
for records (the limit minus the rest) is not written.

The directory is untrusted: every record names its model, chunk and layer and is
checked on read (:mod:`cacheblend_rag.store.record`), and :class:`SafeDisk` opens or
deletes only regular value files inside the directory.

Failure policy: a corrupt or unreadable record is a miss (logged, counted,
chunk discarded); a failed write returns ``False`` (logged, counted). Neither
raises, because the cache is an optimisation and the engine can always
recompute. A disk too full for a chunk is not written to at all (a full disk
also starves clean-up and other writers); a write that fails anyway unlinks its
value files, which needs no free space. A directory that cannot be written but
holds a store is served read-only and reopened for writing once it can be.
Opening a directory that cannot be used at all *does* raise
:class:`KVStoreOpenError` so the engine can decide (e.g. run without a store).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import diskcache
import torch

from cacheblend_rag.store.disk_db import WAL_BOUND, KVStoreOpenError, ReadOnlyCache, open_cache
from cacheblend_rag.store.dtypes import dtype_name
from cacheblend_rag.store.meta import MAX_META_BYTES, ChunkMeta, decode_chunk_layer, decode_meta, encode_meta
from cacheblend_rag.store.protocol import KV, StoreStats
from cacheblend_rag.store.quant import KVFormat, chunk_name, parse_kv_format
from cacheblend_rag.store.record import CorruptRecordError, encode_layer, layer_record_bytes, validate_chunk
from cacheblend_rag.store.safe_disk import SafeDisk, UnsafePathError, UnsafeRecordError, capped_reads
from cacheblend_rag.store.seal import sealer

__all__ = ["KVStore", "KVStoreOpenError", "SafeDisk", "UnsafePathError", "UnsafeRecordError"]

logger = logging.getLogger(__name__)

# Storage faults that must degrade to "no cache" rather than crash a request.
_STORAGE_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)
_MAX_WARNED_KEYS = 10_000  # bounds memory of the warn-once set on a very sick disk
_REOPEN_S = 30.0  # how often a store opened read-only tries to become writable again
_FOLDER_RECOUNT_S = 2.0


# Database bytes per record beyond the record itself (its row, the indexes, page slack):
# 640 measured on a store of 10,256 chunks (318k records); rounded up to stay on the safe side.
ROW_BYTES = 1024
_MAX_FOLDERS = 256 + 256 * 256


def _check_size_limit(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value < float("inf"):
        raise ValueError(f"size_limit={value!r} must be a positive number of bytes, e.g. 8 * 2**30")
    return int(value)


class KVStore(contextlib.AbstractContextManager):
    """Per-chunk KV cache on disk; thread- and multi-process-safe via diskcache/SQLite.

    ``size_limit`` bounds every byte the store keeps on disk: records, the SQLite database and its
    write-ahead log, and the value folders. A directory that cannot be written (read-only mount,
    full disk) but already holds a store is opened read-only: its chunks are served, new ones are
    not stored, and every ``_REOPEN_S`` seconds a write tries to reopen it for writing, so caching
    comes back by itself once space returns.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        size_limit: int = 8 * 2**30,
        fingerprint: str = "",
        key: bytes | str | None = None,
        kv_format: str | KVFormat | None = None,
    ) -> None:
        """Open (creating if needed) a store in ``directory``.

        ``directory=None`` uses a fresh temporary directory that ``close`` deletes.
        ``key``: a secret that every record is MACed with (default: ``$CACHEBLEND_RAG_STORE_KEY``
        if set, else none); records without a valid MAC are misses (store/seal.py).
        ``kv_format``: the format chunks are written and looked up in (``quant.parse_kv_format``:
        "int8", "int4", ...; default None, float records in the tensors' dtype). Each format's
        chunks are kept under names of their own (``quant.chunk_name``), so they never mix.
        Raises :class:`KVStoreOpenError` if the directory cannot be used.
        """
        size_limit = _check_size_limit(size_limit)
        self.kv_format = parse_kv_format(kv_format)
        self._sealer = sealer(key)
        self._owns_directory = directory is None
        if directory is None:
            directory = tempfile.mkdtemp(prefix="cacheblend-kv-")
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.stats = StoreStats()
        self._lock = threading.Lock()  # guards stats, the warn-once set and reopening
        self._warned: set[str] = set()
        self._closed = False
        self._size_limit = size_limit
        self._last_open_try = 0.0
        self._reader: ReadOnlyCache | None = None  # reads on a disk that refuses writes
        # See _folder_bytes: bytes at the last count, when it ran, folders made by then, folder size.
        self._folders, self._folders_counted_at, self._folders_created, self._per_folder = 0, -_FOLDER_RECOUNT_S, 0, 4096
        try:
            self._cache: diskcache.Cache | ReadOnlyCache = open_cache(str(self.directory), size_limit)
            self.read_only = False
        except (*_STORAGE_ERRORS, ValueError) as exc:
            self._cache = self._open_read_only(exc)
            self.read_only = True
        self._configure(self._cache.disk)
        if not self.read_only:
            self._fit_limit()

    def _configure(self, disk: SafeDisk) -> None:
        disk.max_record_bytes = self._size_limit
        disk.trailer_bytes = self._sealer.trailer

    def _open_read_only(self, exc: BaseException) -> ReadOnlyCache:
        try:
            cache = ReadOnlyCache(str(self.directory))
        except (KVStoreOpenError, OSError, sqlite3.Error):
            raise KVStoreOpenError(
                f"cannot open KV store directory {str(self.directory)!r}: {exc}. "
                "Make it writable, point the store at another directory, "
                "or run without a KV store."
            ) from exc
        logger.warning(
            "KV store %s cannot be written (%s): serving the chunks it holds read-only; new chunks "
            "are not stored until it is writable again (free space or remount it read-write)",
            self.directory,
            exc,
        )
        self._last_open_try = time.monotonic()
        return cache

    def _try_writable(self) -> bool:
        """Reopen a read-only store for writing once it can be written again; True if writable."""
        if not self.read_only:
            return True
        with self._lock:
            if not self.read_only or time.monotonic() - self._last_open_try < _REOPEN_S:
                return not self.read_only
            self._last_open_try = time.monotonic()
            try:
                cache = open_cache(str(self.directory), self._size_limit)
            except (*_STORAGE_ERRORS, ValueError):
                return False
            self._configure(cache.disk)
            old, self._cache, self.read_only = self._cache, cache, False
            self._folders_counted_at = -_FOLDER_RECOUNT_S  # a new Disk counts its folders from 0
        old.close()
        logger.warning("KV store %s is writable again: caching resumes", self.directory)
        return True

    # ----------------------------------------------------------------- size

    @property
    def size_limit(self) -> int:
        return self._size_limit

    @size_limit.setter
    def size_limit(self, value: int) -> None:
        value = _check_size_limit(value)
        self._size_limit = value
        self._cache.disk.max_record_bytes = value
        if not self.read_only:
            self._fit_limit()

    def bytes_needed(self, record_bytes: int, records: int) -> int:
        """What ``records`` records of ``record_bytes`` bytes in all count against ``size_limit``
        once stored: the records, a database row each, the log's bound and the value folders
        they may open (at most diskcache's two levels of 256)."""
        folders = min(2 * records, _MAX_FOLDERS)
        return record_bytes + records * ROW_BYTES + WAL_BOUND + folders * self._per_folder

    def _overhead(self) -> int:
        """Bytes diskcache's ``volume`` does not count: the SQLite log files and value folders."""
        sizes = {}
        for suffix in ("-wal", "-shm"):
            try:
                sizes[suffix] = os.stat(self.directory / (diskcache.core.DBNAME + suffix)).st_size
            except OSError:
                sizes[suffix] = 0
        return max(sizes["-wal"], WAL_BOUND) + sizes["-shm"] + self._folder_bytes()

    def _folder_bytes(self) -> int:
        """Bytes of diskcache's value folders, recounted at most every ``_FOLDER_RECOUNT_S``.

        Counting lists up to 257 folders (no stat per folder: each costs what the store directory
        itself does on this file system), a few ms; it runs after puts, not on the read path.
        """
        now = time.monotonic()
        created = self._cache.disk.folders_created
        if now - self._folders_counted_at < _FOLDER_RECOUNT_S:
            # Between counts, add the folders this process made since (other processes' folders
            # wait for the next count).
            return max(0, self._folders + (created - self._folders_created) * self._per_folder)
        try:
            st = os.stat(self.directory)
            self._per_folder = st.st_blocks * 512 if hasattr(st, "st_blocks") else 4096
        except OSError:
            return self._folders
        count = 0
        with contextlib.suppress(OSError), os.scandir(self.directory) as top:
            for entry in top:
                if entry.is_dir(follow_symlinks=False):
                    count += 1
                    with contextlib.suppress(OSError), os.scandir(entry.path) as sub:
                        count += sum(e.is_dir(follow_symlinks=False) for e in sub)
        self._folders, self._folders_counted_at = count * self._per_folder, now
        self._folders_created = created
        return self._folders

    def _fit_limit(self) -> None:
        """Give diskcache a limit that leaves room for what it does not count, and cull to it."""
        effective = max(1, self._size_limit - self._overhead())
        try:
            # Each reset is a database write: skip changes that are small against the limit.
            if abs(self._cache.size_limit - effective) > max(64 * 1024, self._size_limit // 100) or (
                effective < self._cache.size_limit and self._cache.volume() > effective
            ):
                self._cache.reset("size_limit", effective)
            if self._cache.volume() > effective:
                self._cache.cull()
        except _STORAGE_ERRORS as exc:
            logger.warning("could not apply the size limit of KV store %s: %r", self.directory, exc)

    # ----------------------------------------------------------------- helpers

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        with self._lock:
            if key in self._warned:
                return
            if len(self._warned) >= _MAX_WARNED_KEYS:
                self._warned.clear()
            self._warned.add(key)
        logger.warning(msg, *args)

    def _get(self, name: str) -> Any:
        """``Cache.get``; on a disk that refuses writes, the same read without touching the database.

        Under the LRU policy every read also writes (the access time). On a full or read-only disk
        that write fails although the record is intact: serve it read-only rather than recompute.
        """
        try:
            return self._cache.get(name)
        except sqlite3.OperationalError as exc:
            reader = None if self.read_only else self._read_only_reader(exc)
            if reader is None:
                raise
        return reader.get(name)

    def _read_only_reader(self, exc: sqlite3.OperationalError) -> ReadOnlyCache | None:
        msg = str(exc).lower()
        if "full" not in msg and "readonly" not in msg and "read-only" not in msg:
            return None
        with self._lock:
            if self._reader is None:
                try:
                    self._reader = ReadOnlyCache(str(self.directory))
                except (KVStoreOpenError, OSError, sqlite3.Error):
                    return None
                self._configure(self._reader.disk)
                logger.warning("KV store %s refuses writes (%s): reading it read-only", self.directory, exc)
            return self._reader

    def _load_meta(self, key: str) -> tuple[ChunkMeta | None, bool]:
        """(meta, was_corrupt). Corrupt meta is logged, counted and the chunk dropped."""
        try:
            # A meta record is a few dozen bytes (and a MAC): a larger file is refused unread.
            with capped_reads(MAX_META_BYTES):
                blob = self._get(f"{key}/meta")
            if blob is None:
                return None, False
            return decode_meta(self._sealer.open_meta(f"{key}/meta", blob), self.fingerprint, key), False
        except diskcache.Timeout:
            logger.warning("KV store busy reading meta of chunk %s; treating as a miss", key)
            return None, False
        except (CorruptRecordError, OSError, sqlite3.Error) as exc:
            self._on_corrupt(key, f"{key}/meta", exc)
            return None, True

    def _on_corrupt(self, key: str, record: str, exc: BaseException, num_layers: int = 0) -> None:
        self._warn_once(key, "discarding KV chunk %s: record %s unreadable: %s", key, record, exc)
        self._count(corrupt=1)
        self._discard(key, num_layers, extra=(record,))

    def _discard(self, key: str, num_layers: int, extra: Sequence[str] = ()) -> None:
        # Meta first: the chunk becomes invisible before its layers go away.
        names = [f"{key}/meta", *extra, *(f"{key}/{i}" for i in range(num_layers))]
        try:
            for name in names:
                self._cache.delete(name)
            # Catches layers whose meta is gone or that the meta does not list.
            self._cache.evict(key)
        except _STORAGE_ERRORS as exc:
            logger.warning("could not discard KV chunk %s: %s", key, exc)

    # --------------------------------------------------------------------- API

    def contains(self, key: str) -> bool:
        return self.meta(key) is not None

    def meta(self, key: str) -> ChunkMeta | None:
        return self._load_meta(chunk_name(key, self.kv_format))[0]

    def put(self, key: str, layers: Sequence[KV]) -> bool:
        """Store a chunk's KV, one (K, V) per layer. Returns False if it was not stored.

        Invalid input (empty, mismatched shapes/dtypes) raises ValueError before
        anything is written. A key that is already present is left untouched. A chunk larger
        than the size limit, or a store without the free space for it, is not written (warning).
        """
        layers = list(layers)
        dtype, num_tokens = validate_chunk(layers)
        key = chunk_name(key, self.kv_format)
        if not self._try_writable():
            self._warn_once("<read-only>", "KV store %s is read-only: new chunks are not stored", self.directory)
            self._count(write_errors=1)
            return False
        if self._load_meta(key)[0] is not None:
            return True
        need = sum(self._sealer.trailer + layer_record_bytes(tuple(k.shape), k.dtype, self.kv_format) for k, _ in layers)
        if not self._has_room(key, need):
            return False
        meta = ChunkMeta(num_tokens=num_tokens, num_layers=len(layers), dtype=dtype_name(dtype))
        written = 0
        with self._cache.disk.tracking_writes() as files:
            try:
                for i, (k, v) in enumerate(layers):
                    record = encode_layer(k, v, self.fingerprint, chunk=key, layer=i, kv_format=self.kv_format)
                    blob = self._sealer.seal(f"{key}/{i}", record)
                    self._cache.set(f"{key}/{i}", blob, tag=key)
                    written += len(blob)
                blob = self._sealer.seal(f"{key}/meta", encode_meta(meta, self.fingerprint, key))
                self._cache.set(f"{key}/meta", blob, tag=key)  # last: publishes the chunk
                written += len(blob)
            except (*_STORAGE_ERRORS, ValueError) as exc:  # ValueError: values a quantized format cannot hold
                logger.warning("could not write KV chunk %s to %s: %r", key, self.directory, exc)
                self._count(write_errors=1, bytes_written=written)
                self._undo_partial(key, files)
                return False
        self._count(bytes_written=written)
        self._fit_limit()
        return True

    def _has_room(self, key: str, need: int) -> bool:
        """False (with a warning) when the chunk cannot fit the size limit or the free space."""
        # The limit also pays for the database's log and the value folders (``_overhead``): a chunk
        # over what they leave would be written only to evict every other chunk and then itself.
        room = self._size_limit - self._overhead()
        if need > room:
            self._warn_once(
                "<too-large>",
                "KV chunk %s needs %d bytes, more than the store's size limit of %d bytes leaves for "
                "records (%d after its database log and folders): it is recomputed on every request; "
                "raise the size limit (store_size_limit) to cache it",
                key,
                need,
                self._size_limit,
                max(0, room),
            )
            self._count(write_errors=1)
            return False
        try:
            free = shutil.disk_usage(self.directory).free
        except OSError:
            return True  # the write itself will tell
        # SQLite pages and the log grow by more than the record bytes; keep a margin so a write
        # never fills the disk (a full disk also starves the clean-up and every other writer).
        if free < 2 * need + 256 * 1024:
            self._warn_once(
                "<disk-full>",
                "KV store %s: only %d bytes free, chunk %s needs %d: not caching new chunks until space is freed",
                self.directory,
                free,
                key,
                need,
            )
            self._count(write_errors=1)
            return False
        return True

    def _undo_partial(self, key: str, files: Sequence[str]) -> None:
        """Free a failed put's space. Unlinking its value files needs no free space, unlike the
        database delete, which may fail on a full disk: the rows left behind name missing files,
        read as misses and are deleted by the next successful eviction or put."""
        for path in files:
            with contextlib.suppress(OSError):
                os.remove(path)
        try:
            self._cache.evict(key)
        except _STORAGE_ERRORS as exc:
            logger.warning("could not delete the rows of half-written KV chunk %s: %r", key, exc)

    def get_layer(self, key: str, layer: int, device: torch.device | str | None = None) -> KV | None:
        """(K, V) of one layer, or None on a miss/corruption (caller recomputes)."""
        key = chunk_name(key, self.kv_format)
        meta, corrupt = self._load_meta(key)
        if meta is None:
            if not corrupt:
                self._count(misses=1)
            return None
        if not 0 <= layer < meta.num_layers:
            raise IndexError(f"layer {layer} out of range for chunk with {meta.num_layers} layers")
        record = f"{key}/{layer}"
        try:
            blob = self._get(record)  # also bumps access_time (LRU)
        except diskcache.Timeout:
            logger.warning("KV store busy reading %s; treating as a miss", record)
            self._count(misses=1)
            return None
        except (CorruptRecordError, OSError, sqlite3.Error) as exc:
            self._on_corrupt(key, record, exc, meta.num_layers)
            return None
        if blob is None:
            # Evicted piece of a published chunk: drop the rest so the caller rewrites it.
            self._count(misses=1)
            self._discard(key, meta.num_layers)
            return None
        try:
            k, v = decode_chunk_layer(self._sealer.open(record, blob), meta, self.fingerprint, key, layer)
        except (CorruptRecordError, ValueError, RuntimeError) as exc:
            self._on_corrupt(key, record, exc, meta.num_layers)
            return None
        self._count(hits=1, bytes_read=len(blob))
        if device is not None and torch.device(device).type != "cpu":
            k, v = k.to(device), v.to(device)
        return k, v

    def discard(self, key: str) -> None:
        """Remove every record of a chunk (no error if absent)."""
        key = chunk_name(key, self.kv_format)
        meta, _ = self._load_meta(key)
        self._discard(key, meta.num_layers if meta else 0)

    def volume(self) -> int:
        """Bytes on disk: SQLite pages, its write-ahead log, value files and their folders."""
        return int(self._cache.volume()) + self._overhead()

    def clear(self) -> None:
        self._cache.clear()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        getattr(self._cache, "close_all", self._cache.close)()  # every thread's connection
        if self._reader is not None:
            self._reader.close()
        if self._owns_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __exit__(self, *exc: object) -> None:  # __enter__: AbstractContextManager's (the store)
        self.close()

    def __repr__(self) -> str:
        return f"KVStore({str(self.directory)!r}, fingerprint={self.fingerprint!r})"
