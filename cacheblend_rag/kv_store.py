"""Disk-backed store of per-chunk KV caches (diskcache + raw binary records).

Layout: a chunk with key ``K`` is stored as one record per layer, ``K/0`` ..
``K/{n-1}`` (bytes from :func:`cacheblend_rag.kv_record.encode_layer`), plus a
small ``K/meta`` record written *last*. Readers only trust a chunk whose meta
record exists, so a writer killed half way leaves nothing visible, and the
orphaned layer records are eventually evicted by LRU (or overwritten by the next
``put``). All records of a chunk carry the diskcache tag ``K`` so a chunk can be
dropped in one call even when its meta record is gone.

Nothing is ever pickled: values are ``bytes`` (stored raw by diskcache) and
:class:`SafeDisk` refuses to unpickle anything found in the directory, because
the directory may be shared with other, less trusted processes.

Eviction is diskcache's: ``size_limit`` with ``least-recently-used`` policy,
culled (up to 10 records at a time) on every write. Reads go through
``Cache.get``, which bumps the record's access time under this policy. Since
eviction works per record, a chunk can lose some layers while its meta survives;
``get_layer`` then reports a miss and discards the rest so the caller rewrites it.

Failure policy: a corrupt or unreadable record is a miss (logged, counted,
chunk discarded); a failed write returns ``False`` (logged, counted). Neither
raises, because the cache is an optimisation and the engine can always
recompute. Opening a directory that cannot be used *does* raise
:class:`KVStoreOpenError` so the engine can decide (e.g. run without a store).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sqlite3
import struct
import tempfile
import threading
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import diskcache
import torch

from .kv_record import (
    DTYPE_CODES,
    CorruptRecordError,
    decode_layer,
    dtype_name,
    encode_layer,
    validate_layer,
)

__all__ = [
    "ChunkMeta",
    "KVStore",
    "KVStoreOpenError",
    "SafeDisk",
    "StoreStats",
    "UnsafeRecordError",
    "chunk_key",
]

logger = logging.getLogger("cacheblend_rag.kv_store")

# Storage faults that must degrade to "no cache" rather than crash a request.
_STORAGE_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)
_MAX_WARNED_KEYS = 10_000  # bounds memory of the warn-once set on a very sick disk


# --------------------------------------------------------------------------- keys


def _pack_ids(ids: Sequence[int]) -> bytes:
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    ids = list(ids)
    try:
        # Length prefix makes the encoding unambiguous: ([1,2],[3]) != ([1],[2,3]).
        return struct.pack(f"<Q{len(ids)}q", len(ids), *ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be int64 integers: {exc}") from None


def chunk_key(fingerprint: str, context_ids: Sequence[int], token_ids: Sequence[int]) -> str:
    """Content hash of (model, tokens the chunk was prefilled behind, chunk tokens).

    The same text prefilled behind a different prefix has different KV (positions,
    attention), so the context is part of the identity.
    """
    fp = fingerprint.encode("utf-8")
    h = hashlib.blake2b(digest_size=32, person=b"cbrag-chunk-v1")
    h.update(struct.pack("<Q", len(fp)))
    h.update(fp)
    h.update(_pack_ids(context_ids))
    h.update(_pack_ids(token_ids))
    return h.hexdigest()


# ------------------------------------------------------------------- data types


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    write_errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class ChunkMeta:
    num_tokens: int
    num_layers: int
    dtype: str  # e.g. "bfloat16"


# Meta record: magic, version, dtype code, pad, num_tokens, num_layers, crc32 of the rest.
_META = struct.Struct("<4sHBxII")
_META_MAGIC = b"CBKM"
_META_VERSION = 1
_CODE_TO_DTYPE = {code: dt for dt, code in DTYPE_CODES.items()}


def _encode_meta(meta: ChunkMeta) -> bytes:
    code = next(c for dt, c in DTYPE_CODES.items() if dtype_name(dt) == meta.dtype)
    body = _META.pack(_META_MAGIC, _META_VERSION, code, meta.num_tokens, meta.num_layers)
    return body + struct.pack("<I", zlib.crc32(body))


def _decode_meta(blob: Any) -> ChunkMeta:
    if not isinstance(blob, bytes) or len(blob) != _META.size + 4:
        raise CorruptRecordError(f"meta record has wrong type/size ({type(blob).__name__})")
    body, (crc,) = blob[:-4], struct.unpack("<I", blob[-4:])
    if zlib.crc32(body) != crc:
        raise CorruptRecordError("meta record checksum mismatch")
    magic, version, code, num_tokens, num_layers = _META.unpack(body)
    if magic != _META_MAGIC or version != _META_VERSION:
        raise CorruptRecordError(f"meta record has bad magic/version {magic!r}/{version}")
    dtype = _CODE_TO_DTYPE.get(code)
    if dtype is None or num_layers == 0:
        raise CorruptRecordError(f"meta record has bad dtype code {code} or zero layers")
    return ChunkMeta(num_tokens=num_tokens, num_layers=num_layers, dtype=dtype_name(dtype))


# ------------------------------------------------------------------- safe disk


class UnsafeRecordError(CorruptRecordError):
    """A pickled key or value was found; it is refused, never loaded."""


class SafeDisk(diskcache.Disk):
    """diskcache Disk that stores and loads only raw values and never unpickles.

    diskcache's default Disk pickles any non-primitive key/value and unpickles
    whatever it finds, so anyone who can write the directory could run code in
    the server. This subclass raises :class:`UnsafeRecordError` instead.
    """

    def put(self, key: Any) -> tuple[Any, bool]:
        if type(key) not in (str, bytes, int, float):
            raise TypeError(f"SafeDisk keys must be str/bytes/int/float, got {type(key).__name__}")
        return super().put(key)

    def get(self, key: Any, raw: bool) -> Any:
        if not raw:
            raise UnsafeRecordError("refusing to unpickle a pickled cache key")
        return super().get(key, raw)

    def store(self, value: Any, read: bool, key: Any = diskcache.core.UNKNOWN) -> tuple:
        if not read and type(value) not in (bytes, str, int, float):
            raise TypeError(f"SafeDisk stores only raw values, got {type(value).__name__}")
        return super().store(value, read, key=key)

    def fetch(self, mode: int, filename: str | None, value: Any, read: bool) -> Any:
        if mode == diskcache.core.MODE_PICKLE:
            # Never open the file or call pickle.load: a planted pickle is treated as corrupt.
            raise UnsafeRecordError("refusing to unpickle a pickled cache value")
        if mode == diskcache.core.MODE_BINARY and not read and filename is not None:
            # Read straight into a writable buffer: decode_layer then wraps it without a second
            # copy (bytes are immutable and would have to be copied into tensor memory). A KV
            # layer is read on every request, and that copy was a third of the load time.
            with open(os.path.join(self._directory, filename), "rb") as reader:
                size = os.fstat(reader.fileno()).st_size
                buf = bytearray(size)
                got = reader.readinto(buf)
            if got != size:
                raise OSError(f"short read of {filename}: {got} of {size} bytes")
            return buf
        return super().fetch(mode, filename, value, read)

    def _write(self, full_path: str, iterator: Any, mode: str, encoding: str | None = None) -> int:
        # On disk-full diskcache would leave a half-written value file with no row
        # pointing at it (leaked space); remove it before re-raising.
        try:
            return super()._write(full_path, iterator, mode, encoding)
        except BaseException:
            try:
                os.remove(full_path)
            except OSError:
                pass
            raise


# ------------------------------------------------------------------------ store


class KVStoreOpenError(OSError):
    """The store directory cannot be created/opened (read-only, not a directory, broken DB)."""


class KVStore:
    """Per-chunk KV cache on disk; thread- and multi-process-safe via diskcache/SQLite."""

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        size_limit: int = 8 * 2**30,
        fingerprint: str = "",
    ) -> None:
        """Open (creating if needed) a store in ``directory``.

        ``directory=None`` uses a fresh temporary directory that ``close`` deletes.
        Raises :class:`KVStoreOpenError` if the directory cannot be used.
        """
        self._owns_directory = directory is None
        if directory is None:
            directory = tempfile.mkdtemp(prefix="cacheblend-kv-")
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.stats = StoreStats()
        self._lock = threading.Lock()  # guards stats and the warn-once set
        self._warned: set[str] = set()
        self._closed = False
        try:
            self._cache = diskcache.Cache(
                str(self.directory),
                size_limit=size_limit,
                eviction_policy="least-recently-used",
                tag_index=True,  # chunk discard is evict(tag=key)
                disk=SafeDisk,
            )
        except (*_STORAGE_ERRORS, ValueError) as exc:
            raise KVStoreOpenError(
                f"cannot open KV store directory {str(self.directory)!r}: {exc}. "
                "Make it writable, point the store at another directory, "
                "or run without a KV store."
            ) from exc

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

    def _load_meta(self, key: str) -> tuple[ChunkMeta | None, bool]:
        """(meta, was_corrupt). Corrupt meta is logged, counted and the chunk dropped."""
        try:
            blob = self._cache.get(f"{key}/meta")
            if blob is None:
                return None, False
            return _decode_meta(blob), False
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
        return self._load_meta(key)[0]

    def put(self, key: str, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Store a chunk's KV, one (K, V) per layer. Returns False on storage faults.

        Invalid input (empty, mismatched shapes/dtypes) raises ValueError before
        anything is written. A key that is already present is left untouched.
        """
        layers = list(layers)
        if not layers:
            raise ValueError("put needs at least one layer")
        dtype, (_, num_tokens, _) = validate_layer(*layers[0])
        for i, (k, v) in enumerate(layers):
            dt, shape = validate_layer(k, v)
            if dt != dtype or shape[1] != num_tokens:
                raise ValueError(
                    f"layer {i} has dtype {dt} and {shape[1]} tokens; layer 0 has {dtype} and {num_tokens}"
                )
        if self.contains(key):
            return True
        meta = ChunkMeta(num_tokens=num_tokens, num_layers=len(layers), dtype=dtype_name(dtype))
        written = 0
        try:
            for i, (k, v) in enumerate(layers):
                blob = encode_layer(k, v, self.fingerprint)
                self._cache.set(f"{key}/{i}", blob, tag=key)
                written += len(blob)
            blob = _encode_meta(meta)
            self._cache.set(f"{key}/meta", blob, tag=key)  # last: publishes the chunk
            written += len(blob)
        except _STORAGE_ERRORS as exc:
            logger.warning("could not write KV chunk %s to %s: %r", key, self.directory, exc)
            self._count(write_errors=1, bytes_written=written)
            try:  # best effort: free the space of the partial write
                self._cache.evict(key)
            except _STORAGE_ERRORS:
                pass
            return False
        self._count(bytes_written=written)
        return True

    def get_layer(
        self, key: str, layer: int, device: torch.device | str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(K, V) of one layer, or None on a miss/corruption (caller recomputes)."""
        meta, corrupt = self._load_meta(key)
        if meta is None:
            if not corrupt:
                self._count(misses=1)
            return None
        if not 0 <= layer < meta.num_layers:
            raise IndexError(f"layer {layer} out of range for chunk with {meta.num_layers} layers")
        record = f"{key}/{layer}"
        try:
            blob = self._cache.get(record)  # also bumps access_time (LRU)
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
            k, v = decode_layer(blob, self.fingerprint)  # on CPU: device errors are not corruption
            if k.shape[1] != meta.num_tokens or dtype_name(k.dtype) != meta.dtype:
                raise CorruptRecordError(
                    f"record holds {dtype_name(k.dtype)} x {k.shape[1]} tokens, meta says {meta.dtype} x {meta.num_tokens}"
                )
        except (CorruptRecordError, ValueError, RuntimeError) as exc:
            self._on_corrupt(key, record, exc, meta.num_layers)
            return None
        self._count(hits=1, bytes_read=len(blob))
        if device is not None and torch.device(device).type != "cpu":
            k, v = k.to(device), v.to(device)
        return k, v

    def discard(self, key: str) -> None:
        """Remove every record of a chunk (no error if absent)."""
        meta, _ = self._load_meta(key)
        self._discard(key, meta.num_layers if meta else 0)

    def volume(self) -> int:
        """Estimated bytes on disk (SQLite pages + value files), as diskcache counts them."""
        return int(self._cache.volume())

    def clear(self) -> None:
        self._cache.clear()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._cache.close()
        if self._owns_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KVStore({str(self.directory)!r}, fingerprint={self.fingerprint!r})"
