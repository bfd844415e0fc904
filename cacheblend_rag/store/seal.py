"""Optional authenticity for shared stores: an HMAC-SHA256 over every record, under a secret key.

A record's checksum and identity digests catch damage and misplaced records, but they are computed
from public data (the model fingerprint, the chunk text): anyone who can write the store directory
or the Redis keys can build a well-formed record for a public chunk with K/V of their choosing, and
it would be served. With a key (``key=`` on the store, or the environment variable
``CACHEBLEND_RAG_STORE_KEY``) every record carries a MAC of its name and bytes; a record whose MAC
does not verify (forged, damaged, written without the key or under another key) is a miss: it is
discarded and the chunk recomputed, never served. Every process that shares a store must use the
same key (docs/sharing.md).
"""

from __future__ import annotations

import hashlib
import hmac
import os

from cacheblend_rag.store.record import CorruptRecordError

__all__ = ["ENV_KEY", "MAC_SIZE", "Sealer", "sealer"]

ENV_KEY = "CACHEBLEND_RAG_STORE_KEY"
MAC_SIZE = 32  # bytes of HMAC-SHA256, appended to the record


class Sealer:
    """Appends and checks the MAC of records; with no key, records pass through unchanged."""

    def __init__(self, key: bytes | str | None):
        if isinstance(key, str):
            key = key.encode("utf-8")
        if key is not None and not isinstance(key, bytes):
            raise TypeError(f"store key must be bytes or str, got {type(key).__name__}")
        if key is not None and len(key) < 16:
            raise ValueError("store key is shorter than 16 bytes: use a random secret, e.g. `openssl rand -hex 32`")
        self._key = key

    @property
    def keyed(self) -> bool:
        return self._key is not None

    @property
    def trailer(self) -> int:
        """Bytes the MAC adds to each record."""
        return MAC_SIZE if self._key is not None else 0

    def _mac(self, name: str, blob: bytes | bytearray | memoryview) -> bytes:
        assert self._key is not None
        h = hmac.new(self._key, digestmod=hashlib.sha256)
        h.update(name.encode("utf-8") + b"\0")  # binds the record to where it is stored
        h.update(blob)
        return h.digest()

    def seal(self, name: str, blob: bytes) -> bytes:
        """``blob`` with its MAC appended (``name``: the record's store-independent name)."""
        return blob if self._key is None else blob + self._mac(name, blob)

    def open(self, name: str, blob: bytes | bytearray) -> bytes | bytearray | memoryview:
        """``blob`` without its MAC once the MAC verifies (a bytearray trimmed in place, a view of
        bytes: neither copied); CorruptRecordError otherwise."""
        if self._key is None:
            return blob
        if not isinstance(blob, (bytes, bytearray)) or len(blob) < MAC_SIZE:
            raise CorruptRecordError("record has no MAC: written without the store key, or forged")
        body = memoryview(blob)[:-MAC_SIZE]
        ok = hmac.compare_digest(self._mac(name, body), bytes(memoryview(blob)[-MAC_SIZE:]))
        body.release()
        if not ok:
            raise CorruptRecordError("record MAC does not verify: forged, or written under another store key")
        if isinstance(blob, bytearray):
            del blob[-MAC_SIZE:]  # in place: a layer record is not copied again
            return blob
        return memoryview(blob)[:-MAC_SIZE]

    def open_meta(self, name: str, blob: object) -> object:
        """A meta record without its MAC, as ``bytes`` (what ``decode_meta`` checks for); anything
        that is not bytes is passed on for ``decode_meta`` to refuse with its own message."""
        if self._key is None or not isinstance(blob, (bytes, bytearray)):
            return blob
        return bytes(self.open(name, blob))


def sealer(key: bytes | str | None = None) -> Sealer:
    """The store's sealer: ``key`` if given, else ``$CACHEBLEND_RAG_STORE_KEY`` if set, else none."""
    if key is None:
        key = os.environ.get(ENV_KEY) or None
    return Sealer(key)
