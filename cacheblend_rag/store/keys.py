"""Chunk keys: the content hash that names a chunk's cache in every store."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import torch

__all__ = ["chunk_key"]


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
