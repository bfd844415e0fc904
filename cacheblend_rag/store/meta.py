"""A chunk's meta record: token count, layer count and dtype, bound to its chunk and model.

Every store publishes a chunk by writing this record last, after the chunk's layer records
(:mod:`.record`), and trusts a chunk only while it exists. Like a layer record it is raw bytes
with a CRC, never a pickle.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from cacheblend_rag.store.dtypes import DTYPE_CODES, dtype_from_code, dtype_from_name, dtype_name
from cacheblend_rag.store.record import CorruptRecordError, decode_layer, identity_digest

__all__ = ["ChunkMeta", "decode_chunk_layer", "decode_meta", "encode_meta", "peek_meta"]


@dataclass(frozen=True)
class ChunkMeta:
    num_tokens: int
    num_layers: int
    dtype: str  # e.g. "bfloat16"


# Meta record: magic, version, dtype code, pad, num_tokens, num_layers, digest of (fingerprint,
# chunk key), crc32 of the rest. The digest binds the meta to its chunk and model like the layer
# records' headers do, so a meta moved to another key is refused at lookup, before any layer loads.
_META = struct.Struct("<4sHBxII32s")
_META_MAGIC = b"CBKM"
_META_VERSION = 2
# The most bytes a meta record file may hold: the record (52 bytes) and a store key's MAC, with
# room to spare. The store refuses a larger file before reading it (safe_disk.capped_reads).
MAX_META_BYTES = 4096


def encode_meta(meta: ChunkMeta, fingerprint: str = "", key: str = "") -> bytes:
    """A chunk's meta record, bound to (fingerprint, key); every store writes this format."""
    code = DTYPE_CODES[dtype_from_name(meta.dtype)]
    body = _META.pack(_META_MAGIC, _META_VERSION, code, meta.num_tokens, meta.num_layers, identity_digest(fingerprint, key))
    return body + struct.pack("<I", zlib.crc32(body))


def decode_meta(blob: Any, fingerprint: str = "", key: str = "") -> ChunkMeta:
    """Parse a meta record; CorruptRecordError unless it is intact and names (fingerprint, key)."""
    if not isinstance(blob, bytes) or len(blob) != _META.size + 4:
        raise CorruptRecordError(f"meta record has wrong type/size ({type(blob).__name__})")
    body, (crc,) = blob[:-4], struct.unpack("<I", blob[-4:])
    if zlib.crc32(body) != crc:
        raise CorruptRecordError("meta record checksum mismatch")
    magic, version, code, num_tokens, num_layers, identity = _META.unpack(body)
    if magic != _META_MAGIC or version != _META_VERSION:
        raise CorruptRecordError(f"meta record has bad magic/version {magic!r}/{version}")
    if identity != identity_digest(fingerprint, key):
        raise CorruptRecordError("meta record belongs to another chunk or model (moved or swapped)")
    dtype = dtype_from_code(code)
    if dtype is None or num_layers == 0:
        raise CorruptRecordError(f"meta record has bad dtype code {code} or zero layers")
    return ChunkMeta(num_tokens=num_tokens, num_layers=num_layers, dtype=dtype_name(dtype))


def peek_meta(blob: Any) -> ChunkMeta | None:
    """What an intact meta record says, without checking which chunk and model it belongs to (a
    store's MAC, if any, is left unchecked at its end): for counting what a store holds, never for
    serving it. None for anything that is not an intact meta record."""
    if not isinstance(blob, (bytes, bytearray)) or len(blob) < _META.size + 4:
        return None
    body, (crc,) = bytes(blob[: _META.size]), struct.unpack_from("<I", blob, _META.size)
    if zlib.crc32(body) != crc:
        return None
    magic, version, code, num_tokens, num_layers, _ = _META.unpack(body)
    dtype = dtype_from_code(code)
    if magic != _META_MAGIC or version != _META_VERSION or dtype is None:
        return None
    return ChunkMeta(num_tokens=num_tokens, num_layers=num_layers, dtype=dtype_name(dtype))


def decode_chunk_layer(blob: Any, meta: ChunkMeta, fingerprint: str, key: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer record decoded on the CPU (a device error is not corruption) and checked against its
    chunk's meta record too (token count, dtype); CorruptRecordError otherwise."""
    k, v = decode_layer(blob, fingerprint, chunk=key, layer=layer)
    if k.shape[1] != meta.num_tokens or dtype_name(k.dtype) != meta.dtype:
        raise CorruptRecordError(
            f"record holds {dtype_name(k.dtype)} x {k.shape[1]} tokens, meta says {meta.dtype} x {meta.num_tokens}"
        )
    return k, v
