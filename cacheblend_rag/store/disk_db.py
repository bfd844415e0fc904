"""The diskcache database under a :class:`~cacheblend_rag.store.disk.KVStore`: how it is opened.

* :func:`open_cache`: a writable diskcache with :class:`~.safe_disk.SafeDisk` and this store's own
  settings, every one passed explicitly, after removing ``Settings`` rows it did not write (the
  table is as untrusted as the rest of the directory); its per-thread connections can all be
  closed at once and apply this store's PRAGMAs, not the table's.
* :class:`ReadOnlyCache`: the read side of a database that cannot be opened for writing (read-only
  mount, full disk), so its chunks are still served.
* :data:`WAL_BOUND`: what the write-ahead log may reach between checkpoints (the store counts it
  against its size limit).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

import diskcache

from cacheblend_rag.store.safe_disk import SafeDisk

__all__ = ["WAL_BOUND", "KVStoreOpenError", "ReadOnlyCache", "open_cache"]

logger = logging.getLogger(__name__)


class KVStoreOpenError(OSError):
    """The store directory cannot be created/opened (read-only, not a directory, broken DB)."""


_READ_ONLY = sqlite3.OperationalError("attempt to write a readonly database")
_WAL_BYTES = 256 * 1024
_WAL_PAGES = 64
# What the log may reach between checkpoints. Counted as a constant, not its current size, so the
# space left for records does not swing with every write (it culled extra chunks when it did).
WAL_BOUND = _WAL_BYTES + _WAL_PAGES * 4096


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
            "opening with the store's own settings",
            directory,
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
                os.path.join(self._directory, diskcache.core.DBNAME),
                timeout=self._timeout,
                isolation_level=None,
                check_same_thread=False,
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


@functools.cache
def _store_cache_class(base: type) -> type:
    # Built on whatever diskcache.Cache is at open time, so a test can put a failing Cache there.
    return type("_StoreCache", (_StoreCacheMixin, base), {})


def open_cache(directory: str, size_limit: int) -> diskcache.Cache:
    """A writable diskcache on ``directory``; its database handle is closed if the open fails.

    diskcache connects before it writes its settings, so an open that fails half way (full disk,
    read-only database) would otherwise leave that connection open until garbage collection.
    """
    _repair_settings(directory)
    settings = _settings(size_limit)
    cls = _store_cache_class(diskcache.Cache)
    cache = cls.__new__(cls)
    try:
        cache.__init__(
            directory, disk=SafeDisk, pragmas={k: v for k, v in settings.items() if k.startswith("sqlite_")}, **settings
        )
    except BaseException:
        with contextlib.suppress(Exception):
            cache.close_all()
        raise
    return cache


class ReadOnlyCache:
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
            rows = self._con.execute("SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = 1", (key,)).fetchall()
        if not rows:
            return None
        mode, filename, value = rows[0]
        try:
            return self.disk.fetch(mode, filename, value, False)
        except OSError:  # value file gone: a miss, as in diskcache
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
