"""Disk-backed store of per-chunk KV caches (diskcache + raw binary records).

Layout: a chunk with key ``K`` is stored as one record per layer, ``K/0`` ..
``K/{n-1}`` (bytes from :func:`cacheblend_rag.store.record.encode_layer`), plus a
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
import functools
import logging
import os
import re
import shutil
import sqlite3
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import diskcache
import torch

from .dtypes import dtype_name
from .meta import ChunkMeta, decode_chunk_layer, decode_meta, encode_meta
from .protocol import KV, StoreStats
from .record import HEADER_SIZE, CorruptRecordError, encode_layer, record_size, validate_chunk
from .seal import sealer

__all__ = ["KVStore", "KVStoreOpenError", "SafeDisk", "UnsafePathError", "UnsafeRecordError"]

logger = logging.getLogger(__name__)

# Storage faults that must degrade to "no cache" rather than crash a request.
_STORAGE_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)
_MAX_WARNED_KEYS = 10_000  # bounds memory of the warn-once set on a very sick disk


# ------------------------------------------------------------------- safe disk


class UnsafeRecordError(CorruptRecordError):
    """A pickled key or value was found; it is refused, never loaded."""


class UnsafePathError(CorruptRecordError):
    """A database row names a file the store did not write (outside it, a FIFO, a link, too big)."""


# diskcache names value files "<2 hex>/<2 hex>/<28 hex>.val" (Disk.filename); anything else in the
# filename column was put there by someone else.
_VALUE_NAME = re.compile(r"[0-9a-f]{2}[/\\][0-9a-f]{2}[/\\][0-9a-f]{28}\.val")
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


_CHECK_MEMORY_ABOVE = 16 * 2**20  # records below this are read without asking the kernel


def available_memory() -> int:
    """Bytes of memory the kernel says can be allocated without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 2**62  # unknown: the store's size limit is the only bound


class SafeDisk(diskcache.Disk):
    """diskcache Disk that stores and loads only raw values, never unpickles and never touches a
    file outside its directory.

    diskcache's default Disk pickles any non-primitive key/value and unpickles
    whatever it finds, so anyone who can write the directory could run code in
    the server. This subclass raises :class:`UnsafeRecordError` instead.

    The database's ``filename`` column is untrusted too: diskcache would open (and on delete or
    eviction remove, with its empty parent folders) whatever path a row names. Here a row's file
    must have diskcache's own name pattern (so no ``..``, no absolute path), sit in real folders
    (not symlinks) and, to be read, be a regular file (no FIFO that blocks ``open``, no device, no symlink) no larger than
    ``max_record_bytes`` whose size matches its record header. Anything else raises
    :class:`UnsafePathError`, which the store counts as corruption; removal only ever unlinks
    inside the directory.
    """

    # Upper bound on one value file; the store sets it to its size limit (a record larger than the
    # whole store was not written by it). Stops a planted 1 TiB sparse file from being read.
    max_record_bytes: int = 2**40
    # Bytes after a record's own size (its MAC when the store has a key: store/seal.py).
    trailer_bytes: int = 0

    def __init__(self, directory: str, **kwargs: Any) -> None:
        super().__init__(directory, **kwargs)
        self._written = threading.local()  # value files written by this thread's current put
        self._lock = threading.Lock()
        # Value folders this process made minus those it removed (the store's size accounting).
        self.folders_created = 0

    # ---------------------------------------------------------------- paths
    def _checked_path(self, filename: Any) -> str:
        if not isinstance(filename, str) or not _VALUE_NAME.fullmatch(filename):
            raise UnsafePathError(f"record file name {filename!r} is not one this store writes; refusing to open it")
        full = os.path.join(self._directory, filename)
        # The name has no "..": it can leave the store only through a folder that is a symlink.
        # Two lstat calls check that (realpath would cost a call per path component, per read).
        sub = os.path.dirname(full)
        for folder in (os.path.dirname(sub), sub):
            mode = os.lstat(folder).st_mode  # FileNotFoundError: the value is gone, a miss
            if not stat.S_ISDIR(mode):
                raise UnsafePathError(f"record folder of {filename!r} is a link or not a folder; refusing to open it")
        return full

    def _open_regular(self, filename: Any) -> tuple[int, int]:
        """(fd, size) of a value file that is a regular file inside the store. Never blocks."""
        full = self._checked_path(filename)
        mode = os.lstat(full).st_mode  # FileNotFoundError: an evicted value, diskcache's miss
        if not stat.S_ISREG(mode):
            raise UnsafePathError(f"record file {filename!r} is not a regular file (mode {stat.filemode(mode)})")
        # O_NOFOLLOW/O_NONBLOCK: a file swapped for a link or FIFO after the lstat cannot hang or escape.
        fd = os.open(full, _OPEN_FLAGS)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise UnsafePathError(f"record file {filename!r} is not a regular file")
        if st.st_size > self.max_record_bytes:
            os.close(fd)
            raise UnsafePathError(
                f"record file {filename!r} is {st.st_size} bytes, more than the store's limit of {self.max_record_bytes}"
            )
        return fd, st.st_size

    # ---------------------------------------------------------------- diskcache hooks
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
        if mode == diskcache.core.MODE_RAW:
            return super().fetch(mode, filename, value, read)
        if mode != diskcache.core.MODE_BINARY:
            raise UnsafeRecordError(f"unexpected value mode {mode!r}: this store writes only raw bytes")
        fd, size = self._open_regular(filename)
        reader = os.fdopen(fd, "rb")
        if read:
            return reader
        with reader:
            header = reader.read(HEADER_SIZE)
            if len(header) == HEADER_SIZE and record_size(header) + self.trailer_bytes != size:
                want = record_size(header) + self.trailer_bytes
                kind = "truncated" if size < want else "oversized"
                raise CorruptRecordError(f"{kind} record file: {size} bytes on disk, its header says {want}")
            if size > _CHECK_MEMORY_ABOVE and size > available_memory() // 2:
                # A forged header can claim any size up to the store's limit; reading it would take
                # the memory (a MemoryError on every request, or the machine's swap) before the
                # checksum could refuse it. Our own records are a small part of memory.
                raise CorruptRecordError(
                    f"record file of {size} bytes is more than half the memory available "
                    f"({available_memory()} bytes): not reading it"
                )
            # Read straight into a writable buffer: decode_layer then wraps it without a second
            # copy (bytes are immutable and would have to be copied into tensor memory). A KV
            # layer is read on every request, and that copy was a third of the load time.
            try:
                buf = bytearray(size)
            except MemoryError:
                raise CorruptRecordError(f"record file of {size} bytes does not fit in memory") from None
            buf[: len(header)] = header
            got = len(header) + (reader.readinto(memoryview(buf)[len(header):]) if size > len(header) else 0)
        if got != size:
            raise OSError(f"short read of {filename}: {got} of {size} bytes")
        return buf

    def remove(self, file_path: str) -> None:
        # diskcache would unlink any path a row names and then its empty parent folders, up to the
        # file system root: only ever unlink inside the store, and stop at its directory.
        try:
            full = self._checked_path(file_path)
        except UnsafePathError as exc:
            logger.warning("not deleting %s", exc)
            return
        except OSError:  # its folder is gone: nothing to delete
            return
        with contextlib.suppress(OSError):
            os.remove(full)
        sub = os.path.dirname(full)
        for _ in range(2):  # the two hex levels of diskcache's layout, never the store itself
            try:
                os.rmdir(sub)
            except OSError:  # not empty (or already gone): so is its parent
                break
            with self._lock:
                self.folders_created -= 1
            sub = os.path.dirname(sub)

    def _write(self, full_path: str, iterator: Any, mode: str, encoding: str | None = None) -> int:
        # On disk-full diskcache would leave a half-written value file with no row
        # pointing at it (leaked space); remove it before re-raising.
        sub = os.path.dirname(full_path)
        new_folders = (not os.path.isdir(os.path.dirname(sub))) + (not os.path.isdir(sub))
        try:
            size = super()._write(full_path, iterator, mode, encoding)
        except BaseException:
            try:
                os.remove(full_path)
            except OSError:
                pass
            raise
        if new_folders:
            with self._lock:
                self.folders_created += new_folders
        files = getattr(self._written, "files", None)
        if files is not None:
            files.append(full_path)
        return size

    @contextlib.contextmanager
    def tracking_writes(self):
        """Collect the value files this thread writes inside the block (to undo a failed put
        by unlinking them: that frees space without writing to the database)."""
        self._written.files = files = []
        try:
            yield files
        finally:
            self._written.files = None


# ------------------------------------------------------------------------ store


class KVStoreOpenError(OSError):
    """The store directory cannot be created/opened (read-only, not a directory, broken DB)."""


_READ_ONLY = sqlite3.OperationalError("attempt to write a readonly database")
_REOPEN_S = 30.0  # how often a store opened read-only tries to become writable again
_WAL_BYTES = 256 * 1024
_WAL_PAGES = 64
# What the log may reach between checkpoints. Counted as a constant, not its current size, so the
# space left for records does not swing with every write (it culled extra chunks when it did).
_WAL_BOUND = _WAL_BYTES + _WAL_PAGES * 4096
_FOLDER_RECOUNT_S = 2.0


def _check_size_limit(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value < float("inf"):
        raise ValueError(f"size_limit={value!r} must be a positive number of bytes, e.g. 8 * 2**30")
    return int(value)


def _settings(size_limit: int) -> dict[str, Any]:
    """Every diskcache setting this store runs with, passed explicitly: diskcache takes any setting
    it finds in the database's ``Settings`` table unless told otherwise, and that table is as
    untrusted as the rest of the directory."""
    return {
        **diskcache.DEFAULT_SETTINGS,
        "size_limit": size_limit,
        "eviction_policy": "least-recently-used",
        "tag_index": True,  # chunk discard is evict(tag=key)
        "statistics": False,
        # The write-ahead log is store bytes too: checkpoint it every 64 pages and truncate it
        # back to 256 KiB, instead of letting it grow to sqlite's default 1000 pages and stay.
        "sqlite_wal_autocheckpoint": _WAL_PAGES,
        "sqlite_journal_size_limit": _WAL_BYTES,
    }


def _repair_settings(directory: str) -> None:
    """Remove ``Settings`` rows this store did not write, before diskcache reads them.

    diskcache passes every ``disk_*`` row to the Disk as a keyword argument (a planted one made the
    open fail with a TypeError) and runs every ``sqlite_*`` row as a PRAGMA (a planted
    ``sqlite_query_only`` left the store read-only for good). Known settings are overridden by
    :func:`_settings` anyway; unknown rows are deleted and the counters diskcache keeps there
    (count, size, hits, misses) are recomputed if they are not integers. The store then opens with
    its own settings; a database that cannot be repaired (read-only) is opened read-only.
    """
    db = os.path.join(directory, diskcache.core.DBNAME)
    if not os.path.isfile(db):
        return
    con = sqlite3.connect(db, timeout=10)
    try:
        try:
            rows = con.execute("SELECT key, value FROM Settings").fetchall()
        except sqlite3.OperationalError:  # no table yet: diskcache creates it
            return
        known = _settings(1)
        unknown = [k for k, _ in rows if k not in known and k not in diskcache.core.METADATA]
        bad_counters = [k for k, v in rows if k in diskcache.core.METADATA and (type(v) is not int or v < 0)]
        if not unknown and not bad_counters:
            return
        logger.warning(
            "KV store %s: its Settings table holds rows this store does not write (%s): removing them and "
            "opening with the store's own settings", directory,
            ", ".join(repr(k) for k in (unknown + bad_counters)[:10]),
        )
        with con:
            con.executemany("DELETE FROM Settings WHERE key = ?", [(k,) for k in unknown + bad_counters])
            if bad_counters:
                count, size = con.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM Cache").fetchone()
                fresh = {"count": count, "size": size, "hits": 0, "misses": 0}
                con.executemany("INSERT INTO Settings VALUES (?, ?)", [(k, fresh[k]) for k in bad_counters])
    finally:
        con.close()


class _StoreCacheMixin:
    """diskcache's Cache with two changes to its per-thread database connections.

    * ``close_all`` closes the connections of every thread. ``Cache.close`` closes only the
      calling thread's, so the engine's write-back thread and the server's worker kept the
      database (and its log) open after ``engine.close()`` until garbage collection: an unmount
      of the store's disk failed as busy.
    * A new connection applies this store's own ``sqlite_*`` settings, not the ``Settings`` rows
      it finds in the database (diskcache runs every ``sqlite_*`` row as a PRAGMA on every new
      connection, so a row planted while the store is open would still take effect).
    """

    _local: threading.local
    _directory: str
    _timeout: float

    def __init__(self, directory: str, *, pragmas: dict[str, Any], **kwargs: Any) -> None:
        self._pragmas = pragmas
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        self._pid = os.getpid()
        super().__init__(directory, **kwargs)  # type: ignore[call-arg]

    @property
    def _con(self) -> sqlite3.Connection:
        if self._pid != os.getpid():
            # Forked: the parent's connections are not this process's to use or close.
            self._pid, self._local, self._connections = os.getpid(), threading.local(), []
        con = getattr(self._local, "con", None)
        if con is None:
            # check_same_thread=False only so that close_all may close it from another thread;
            # each connection is still used by its own thread alone.
            con = self._local.con = sqlite3.connect(
                os.path.join(self._directory, diskcache.core.DBNAME), timeout=self._timeout,
                isolation_level=None, check_same_thread=False,
            )
            with self._connections_lock:
                self._connections.append(con)
            for key, value in self._pragmas.items():
                self.reset(key, value, update=False)  # type: ignore[attr-defined]
        return con

    def close(self) -> None:
        con = getattr(self._local, "con", None)
        if con is None:
            return
        con.close()
        self._local.con = None
        with self._connections_lock:
            self._connections = [c for c in self._connections if c is not con]

    def close_all(self) -> None:
        """Close every thread's connection (the store is closed: later use fails as a storage error)."""
        with self._connections_lock:
            cons, self._connections = self._connections, []
        for con in cons:
            with contextlib.suppress(sqlite3.Error):
                con.close()
        self._local.con = None


@functools.lru_cache(maxsize=None)
def _store_cache_class(base: type) -> type:
    # Built on whatever diskcache.Cache is at open time, so a test can put a failing Cache there.
    return type("_StoreCache", (_StoreCacheMixin, base), {})


def _open_cache(directory: str, size_limit: int) -> diskcache.Cache:
    """A writable diskcache on ``directory``; its database handle is closed if the open fails.

    diskcache connects before it writes its settings, so an open that fails half way (full disk,
    read-only database) would otherwise leave that connection open until garbage collection.
    """
    _repair_settings(directory)
    settings = _settings(size_limit)
    cls = _store_cache_class(diskcache.Cache)
    cache = cls.__new__(cls)
    try:
        cache.__init__(directory, disk=SafeDisk, pragmas={k: v for k, v in settings.items() if k.startswith("sqlite_")},
                       **settings)
    except BaseException:
        with contextlib.suppress(Exception):
            cache.close_all()
        raise
    return cache


class _ReadOnlyCache:
    """The read side of a diskcache store that cannot be opened for writing (read-only mount, full
    disk): its chunks are still served. Values go through :class:`SafeDisk` like any other read;
    every write raises sqlite's read-only error, which the store treats as a failed write."""

    def __init__(self, directory: str) -> None:
        db = os.path.join(directory, diskcache.core.DBNAME)
        if not os.path.isfile(db):
            raise KVStoreOpenError(f"no KV store database in {directory!r}")
        self.disk = SafeDisk(directory)
        self._lock = threading.Lock()  # one connection shared by the engine's threads
        uri = Path(db).absolute().as_uri()
        self._con: sqlite3.Connection | None = None
        # mode=ro reads the write-ahead log as well; immutable=1 is for a directory where sqlite
        # cannot even create the log's index file (a read-only mount).
        for query in ("?mode=ro", "?immutable=1"):
            con = None
            try:
                con = sqlite3.connect(uri + query, uri=True, check_same_thread=False, timeout=10)
                con.execute("SELECT key FROM Cache LIMIT 1").fetchall()
            except sqlite3.Error:
                if con is not None:
                    con.close()
                continue
            self._con = con
            break
        if self._con is None:
            raise KVStoreOpenError(f"cannot read the KV store database in {directory!r}")

    def get(self, key: str) -> Any:
        with self._lock:
            if self._con is None:
                # Closed: by close(), or by the store switching to a writable cache while this
                # read was on its way (KVStore._try_writable). A miss, as any failed read is.
                return None
            rows = self._con.execute(
                "SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = 1", (key,)
            ).fetchall()
        if not rows:
            return None
        mode, filename, value = rows[0]
        try:
            return self.disk.fetch(mode, filename, value, False)
        except IOError:  # value file gone: a miss, as in diskcache
            return None

    def volume(self) -> int:
        with self._lock:
            if self._con is None:  # closed (see get): it holds nothing any more
                return 0
            ((pages,),) = self._con.execute("PRAGMA page_count").fetchall()
            ((page_size,),) = self._con.execute("PRAGMA page_size").fetchall()
            ((files,),) = self._con.execute("SELECT COALESCE(SUM(size), 0) FROM Cache").fetchall()
        return pages * page_size + files

    def set(self, *args: Any, **kwargs: Any) -> None:
        raise _READ_ONLY

    delete = evict = clear = cull = set

    def close(self) -> None:
        with self._lock:
            if self._con is not None:
                self._con.close()
                self._con = None


class KVStore:
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
    ) -> None:
        """Open (creating if needed) a store in ``directory``.

        ``directory=None`` uses a fresh temporary directory that ``close`` deletes.
        ``key``: a secret that every record is MACed with (default: ``$CACHEBLEND_RAG_STORE_KEY``
        if set, else none); records without a valid MAC are misses (store/seal.py).
        Raises :class:`KVStoreOpenError` if the directory cannot be used.
        """
        size_limit = _check_size_limit(size_limit)
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
        self._reader: _ReadOnlyCache | None = None  # reads on a disk that refuses writes
        # See _folder_bytes: bytes at the last count, when it ran, folders made by then, folder size.
        self._folders, self._folders_counted_at, self._folders_created, self._per_folder = 0, -_FOLDER_RECOUNT_S, 0, 4096
        try:
            self._cache: diskcache.Cache | _ReadOnlyCache = _open_cache(str(self.directory), size_limit)
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

    def _open_read_only(self, exc: BaseException) -> _ReadOnlyCache:
        try:
            cache = _ReadOnlyCache(str(self.directory))
        except (KVStoreOpenError, OSError, sqlite3.Error):
            raise KVStoreOpenError(
                f"cannot open KV store directory {str(self.directory)!r}: {exc}. "
                "Make it writable, point the store at another directory, "
                "or run without a KV store."
            ) from exc
        logger.warning(
            "KV store %s cannot be written (%s): serving the chunks it holds read-only; new chunks "
            "are not stored until it is writable again (free space or remount it read-write)",
            self.directory, exc,
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
                cache = _open_cache(str(self.directory), self._size_limit)
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

    def _overhead(self) -> int:
        """Bytes diskcache's ``volume`` does not count: the SQLite log files and value folders."""
        sizes = {}
        for suffix in ("-wal", "-shm"):
            try:
                sizes[suffix] = os.stat(self.directory / (diskcache.core.DBNAME + suffix)).st_size
            except OSError:
                sizes[suffix] = 0
        return max(sizes["-wal"], _WAL_BOUND) + sizes["-shm"] + self._folder_bytes()

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

    def _read_only_reader(self, exc: sqlite3.OperationalError) -> _ReadOnlyCache | None:
        msg = str(exc).lower()
        if "full" not in msg and "readonly" not in msg and "read-only" not in msg:
            return None
        with self._lock:
            if self._reader is None:
                try:
                    self._reader = _ReadOnlyCache(str(self.directory))
                except (KVStoreOpenError, OSError, sqlite3.Error):
                    return None
                self._configure(self._reader.disk)
                logger.warning("KV store %s refuses writes (%s): reading it read-only", self.directory, exc)
            return self._reader

    def _load_meta(self, key: str) -> tuple[ChunkMeta | None, bool]:
        """(meta, was_corrupt). Corrupt meta is logged, counted and the chunk dropped."""
        try:
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
        return self._load_meta(key)[0]

    def put(self, key: str, layers: Sequence[KV]) -> bool:
        """Store a chunk's KV, one (K, V) per layer. Returns False if it was not stored.

        Invalid input (empty, mismatched shapes/dtypes) raises ValueError before
        anything is written. A key that is already present is left untouched. A chunk larger
        than the size limit, or a store without the free space for it, is not written (warning).
        """
        layers = list(layers)
        dtype, num_tokens = validate_chunk(layers)
        if not self._try_writable():
            self._warn_once("<read-only>", "KV store %s is read-only: new chunks are not stored", self.directory)
            self._count(write_errors=1)
            return False
        if self.contains(key):
            return True
        need = sum(HEADER_SIZE + self._sealer.trailer + 2 * k.numel() * k.element_size() for k, _ in layers)
        if not self._has_room(key, need):
            return False
        meta = ChunkMeta(num_tokens=num_tokens, num_layers=len(layers), dtype=dtype_name(dtype))
        written = 0
        with self._cache.disk.tracking_writes() as files:
            try:
                for i, (k, v) in enumerate(layers):
                    blob = self._sealer.seal(f"{key}/{i}", encode_layer(k, v, self.fingerprint, chunk=key, layer=i))
                    self._cache.set(f"{key}/{i}", blob, tag=key)
                    written += len(blob)
                blob = self._sealer.seal(f"{key}/meta", encode_meta(meta, self.fingerprint, key))
                self._cache.set(f"{key}/meta", blob, tag=key)  # last: publishes the chunk
                written += len(blob)
            except _STORAGE_ERRORS as exc:
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
                key, need, self._size_limit, max(0, room),
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
                "KV store %s: only %d bytes free, chunk %s needs %d: not caching new chunks until "
                "space is freed", self.directory, free, key, need,
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

    def get_layer(
        self, key: str, layer: int, device: torch.device | str | None = None
    ) -> KV | None:
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

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KVStore({str(self.directory)!r}, fingerprint={self.fingerprint!r})"
