"""The value files of a store directory that may be shared with less trusted processes.

:class:`SafeDisk` is the diskcache ``Disk`` every store here opens with. It stores and loads raw
bytes only and refuses to unpickle anything found in the directory (anyone who can write the
directory could otherwise run code in the server), and it opens or deletes only diskcache's own
regular value files inside the directory: the database's ``filename`` column is as untrusted as
the files. A refused record raises :class:`UnsafeRecordError` or :class:`UnsafePathError`, which
the store counts as corruption (a miss).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import threading
from typing import Any

import diskcache

from cacheblend_rag.store.record import HEADER_SIZE, CorruptRecordError, record_size

__all__ = ["SafeDisk", "UnsafePathError", "UnsafeRecordError", "available_memory", "capped_reads"]

logger = logging.getLogger(__name__)


class UnsafeRecordError(CorruptRecordError):
    """A pickled key or value was found; it is refused, never loaded."""


class UnsafePathError(CorruptRecordError):
    """A database row names a file the store did not write (outside it, a FIFO, a link, too big)."""


# diskcache names value files "<2 hex>/<2 hex>/<28 hex>.val" (Disk.filename); anything else in the
# filename column was put there by someone else.
_VALUE_NAME = re.compile(r"[0-9a-f]{2}[/\\][0-9a-f]{2}[/\\][0-9a-f]{28}\.val")
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


_CHECK_MEMORY_ABOVE = 16 * 2**20  # records below this are read without asking the kernel
# The most bytes the current thread's next reads may return (capped_reads), below the store's limit.
_read_cap = threading.local()


@contextlib.contextmanager
def capped_reads(max_bytes: int):
    """Within it, this thread's reads refuse a value file over ``max_bytes`` unread (its size is
    checked first), as for a record over the store's limit: for records of a known small size (a
    chunk's meta record), which a forged file of gigabytes would otherwise fill memory with."""
    previous = getattr(_read_cap, "bytes", None)
    _read_cap.bytes = max_bytes
    try:
        yield
    finally:
        _read_cap.bytes = previous


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
        cap = getattr(_read_cap, "bytes", None)
        if cap is not None and st.st_size > cap:
            os.close(fd)
            raise UnsafePathError(f"record file {filename!r} is {st.st_size} bytes, more than such a record can be ({cap})")
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
            got = len(header) + (reader.readinto(memoryview(buf)[len(header) :]) if size > len(header) else 0)
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
