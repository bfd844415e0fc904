"""Binary record for one transformer layer's K and V of one chunk.

The KV store keeps these records on disk and may share its directory with other
processes, so a record is treated as untrusted input: it is raw bytes described
by a fixed ``struct`` header, never a pickle, and decoding only ever copies bytes
into a tensor. Every inconsistency raises :class:`CorruptRecordError`, which the
store turns into "recompute this chunk".

Layout (little-endian, 100-byte header, then the payload)::

    offset size field
    0      4    magic b"CBKV"
    4      2    format version (2)
    6      1    dtype code (see dtypes.DTYPE_CODES)
    7      1    reserved, must be 0
    8      12   shape: num_kv_heads, num_tokens, head_dim (uint32 each)
    20     32   blake2b-256 digest of the model fingerprint string
    52     32   blake2b-256 digest of the chunk key the record belongs to
    84     4    layer index (uint32)
    88     8    payload length in bytes (uint64)
    96     4    CRC-32 of header bytes 0..95 followed by the payload
    100    ...  payload: version 2, K bytes then V bytes (row-major, native element encoding);
                version 3, a quantized K and V (``quant.py``: its scheme, then K's and V's codes,
                float16 scales and minimums)

Version 2 is the float record, version 3 the quantized one (``encode_layer(kv_format=...)``); both
share the header, and the dtype code of a version 3 record is the dtype it decodes to (the one its
chunk's meta record names). A reader reads both, whatever format its store writes.

The CRC covers the header too: a flipped dtype code (float16 <-> bfloat16 have
the same size) would otherwise decode to a silently wrong tensor. CRC-32 detects
every burst error of up to 32 bits, so any single corrupted byte is caught, and it
is cheap enough (GB/s) for the hot path.

A record names what it is (model, chunk, layer, shape, dtype) inside the checksummed
header, and :func:`decode_layer` checks each against what the reader asked for. An
intact record moved to another place (layer 7 stored as layer 20, or one chunk's
record under another chunk of the same length) decodes to well-formed tensors that
are silently wrong; the identity check turns it into a :class:`CorruptRecordError`.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Sequence

import torch

from cacheblend_rag.store.dtypes import DTYPE_CODES, dtype_from_code, dtype_name
from cacheblend_rag.store.quant import KVFormat, dequantize, quantize, quantized_bytes

__all__ = [
    "CorruptRecordError",
    "DTYPE_CODES",
    "HEADER_SIZE",
    "MAGIC",
    "FORMAT_VERSION",
    "decode_layer",
    "encode_layer",
    "fingerprint_digest",
    "identity_digest",
    "layer_record_bytes",
    "record_size",
    "validate_chunk",
    "validate_layer",
]

MAGIC = b"CBKV"
FORMAT_VERSION = 2  # 2: chunk key digest and layer index in the header
QUANTIZED_VERSION = 3  # the same header over a quantized payload (quant.py)
_VERSIONS = (FORMAT_VERSION, QUANTIZED_VERSION)

# magic, version, dtype code, reserved, 3 shape dims, fingerprint digest, chunk digest, layer,
# payload len, crc
_HEADER = struct.Struct("<4sHBB3I32s32sIQI")
HEADER_SIZE = _HEADER.size  # 100
_CRC_OFFSET = HEADER_SIZE - 4  # the CRC field is last, so the prefix before it is hashed
_MAX_DIM = 2**32 - 1


class CorruptRecordError(ValueError):
    """A stored record failed validation; the message says which check failed."""


def fingerprint_digest(fingerprint: str) -> bytes:
    """Fixed 32-byte digest so the header size does not depend on the fingerprint."""
    if not isinstance(fingerprint, str):
        raise TypeError(f"fingerprint must be str, got {type(fingerprint).__name__}")
    return hashlib.blake2b(fingerprint.encode("utf-8"), digest_size=32).digest()


def _chunk_digest(chunk: str) -> bytes:
    if not isinstance(chunk, str):
        raise TypeError(f"chunk key must be str, got {type(chunk).__name__}")
    return hashlib.blake2b(chunk.encode("utf-8"), digest_size=32, person=b"cbrag-record").digest()


def identity_digest(fingerprint: str, chunk: str) -> bytes:
    """32-byte digest of (model fingerprint, chunk key): what a chunk's small records are bound to."""
    return hashlib.blake2b(fingerprint_digest(fingerprint) + _chunk_digest(chunk), digest_size=32).digest()


def record_size(header: bytes | bytearray | memoryview) -> int:
    """Total size in bytes of the record whose first :data:`HEADER_SIZE` bytes are ``header``.

    Lets the store check a file's size before reading it: a record file must be exactly this
    long. Raises CorruptRecordError for a header that is not one of ours.
    """
    mv = memoryview(header).cast("B")
    if mv.nbytes < HEADER_SIZE:
        raise CorruptRecordError(f"truncated record: {mv.nbytes} bytes, header alone needs {HEADER_SIZE}")
    magic, version, *_rest, payload_len, _crc = _HEADER.unpack_from(mv)
    if magic != MAGIC or version not in _VERSIONS:
        raise CorruptRecordError(f"bad magic/version {magic!r}/{version}, expected {MAGIC!r}/{' or '.join(map(str, _VERSIONS))}")
    return HEADER_SIZE + payload_len


def layer_record_bytes(shape: tuple[int, int, int], dtype: torch.dtype, kv_format: KVFormat | None = None) -> int:
    """Bytes of the record :func:`encode_layer` makes of one layer's K and V of ``shape``
    [heads, tokens, head_dim] and ``dtype`` in ``kv_format`` (None: float)."""
    if kv_format is not None:
        return HEADER_SIZE + quantized_bytes(kv_format, shape)
    return HEADER_SIZE + 2 * shape[0] * shape[1] * shape[2] * dtype.itemsize


def validate_layer(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.dtype, tuple[int, int, int]]:
    """Check a (K, V) pair is storable; returns its dtype and shape. Raises ValueError."""
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise ValueError(f"K and V must be tensors, got {type(k).__name__} and {type(v).__name__}")
    if k.dim() != 3:
        raise ValueError(f"K must be [num_kv_heads, num_tokens, head_dim], got shape {tuple(k.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"K and V shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.dtype != v.dtype:
        raise ValueError(f"K and V dtypes differ: {k.dtype} vs {v.dtype}")
    if k.dtype not in DTYPE_CODES:
        supported = ", ".join(dtype_name(d) for d in DTYPE_CODES)
        raise ValueError(f"unsupported KV dtype {k.dtype}; supported: {supported}")
    shape = (int(k.shape[0]), int(k.shape[1]), int(k.shape[2]))
    if max(shape) > _MAX_DIM:
        raise ValueError(f"shape {shape} does not fit the record header")
    return k.dtype, shape


def validate_chunk(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.dtype, int]:
    """Check a chunk's (K, V) layers are storable and agree on dtype and token count; returns
    both. Raises ValueError before a store writes anything."""
    if not layers:
        raise ValueError("put needs at least one layer")
    dtype, (_, num_tokens, _) = validate_layer(*layers[0])
    for i, (k, v) in enumerate(layers):
        dt, shape = validate_layer(k, v)
        if dt != dtype or shape[1] != num_tokens:
            raise ValueError(f"layer {i} has dtype {dt} and {shape[1]} tokens; layer 0 has {dtype} and {num_tokens}")
    return dtype, num_tokens


def _raw_bytes(t: torch.Tensor) -> memoryview:
    # Reinterpreting as uint8 works for every dtype, including bfloat16 which has no
    # numpy equivalent; the result is a zero-copy view of the contiguous CPU tensor.
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def encode_layer(
    k: torch.Tensor,
    v: torch.Tensor,
    fingerprint: str,
    *,
    chunk: str = "",
    layer: int = 0,
    kv_format: KVFormat | None = None,
) -> bytes:
    """Serialize one layer's K and V (same shape/dtype, [heads, tokens, head_dim]).

    ``chunk`` and ``layer`` name the record's place; :func:`decode_layer` must be given the same.
    ``kv_format``: a quantized format (``quant.KVFormat``, a version 3 record); None keeps the
    tensors' own dtype (version 2). ValueError for values a quantized format cannot hold.
    """
    dtype, shape = validate_layer(k, v)
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer <= _MAX_DIM:
        raise ValueError(f"layer index {layer!r} must be an int in [0, {_MAX_DIM}]")
    if kv_format is None:
        kb, vb = _raw_bytes(k), _raw_bytes(v)
    else:
        kb, vb = memoryview(quantize(kv_format, k, v)), memoryview(b"")
    payload_len = kb.nbytes + vb.nbytes
    prefix = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION if kv_format is None else QUANTIZED_VERSION,
        DTYPE_CODES[dtype],
        0,
        *shape,
        fingerprint_digest(fingerprint),
        _chunk_digest(chunk),
        layer,
        payload_len,
        0,
    )[:_CRC_OFFSET]
    crc = zlib.crc32(vb, zlib.crc32(kb, zlib.crc32(prefix)))
    return b"".join((prefix, struct.pack("<I", crc), kb, vb))


def _tensor_from(buf: memoryview, dtype: torch.dtype, shape: tuple[int, int, int]) -> torch.Tensor:
    if buf.nbytes == 0:
        return torch.empty(shape, dtype=dtype)  # frombuffer rejects empty buffers
    # A writable buffer (the store reads records into a bytearray) is wrapped without a copy;
    # immutable bytes are copied once, since frombuffer would alias read-only memory.
    if buf.readonly:
        buf = bytearray(buf)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def decode_layer(
    blob: bytes,
    fingerprint: str,
    device: torch.device | str | None = None,
    *,
    chunk: str = "",
    layer: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Parse a record made by :func:`encode_layer`; raise CorruptRecordError on any mismatch.

    The tensors share memory with ``blob`` when it is writable (a ``bytearray``): hand over a
    buffer you will not reuse. Immutable ``bytes`` are copied.
    """
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise CorruptRecordError(f"record is {type(blob).__name__}, expected bytes")
    mv = memoryview(blob).cast("B")
    if mv.nbytes < HEADER_SIZE:
        raise CorruptRecordError(f"truncated record: {mv.nbytes} bytes, header alone needs {HEADER_SIZE}")
    (magic, version, code, reserved, heads, tokens, head_dim, digest, chunk_digest, rec_layer, payload_len, crc) = (
        _HEADER.unpack_from(mv)
    )
    if magic != MAGIC:
        raise CorruptRecordError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version not in _VERSIONS:
        raise CorruptRecordError(f"unsupported format version {version} (this build reads {' and '.join(map(str, _VERSIONS))})")
    actual = mv.nbytes - HEADER_SIZE
    if actual < payload_len:
        raise CorruptRecordError(f"truncated payload: header says {payload_len} bytes, found {actual}")
    if actual > payload_len:
        raise CorruptRecordError(f"payload length mismatch: header says {payload_len} bytes, found {actual} (trailing bytes)")
    payload = mv[HEADER_SIZE:]
    if zlib.crc32(payload, zlib.crc32(mv[:_CRC_OFFSET])) != crc:
        raise CorruptRecordError("checksum mismatch: record bytes were altered")
    # Checked after the CRC: an intact record from another model is a mismatch, not damage.
    if digest != fingerprint_digest(fingerprint):
        raise CorruptRecordError("fingerprint mismatch: record was written for a different model")
    if chunk_digest != _chunk_digest(chunk):
        raise CorruptRecordError("chunk mismatch: record belongs to another chunk (moved or swapped)")
    if rec_layer != layer:
        raise CorruptRecordError(f"layer mismatch: record holds layer {rec_layer}, read as layer {layer}")
    dtype = dtype_from_code(code)
    if dtype is None or reserved != 0:
        raise CorruptRecordError(f"dtype mismatch: unknown dtype code {code} / reserved byte {reserved}")
    shape = (heads, tokens, head_dim)
    if version == QUANTIZED_VERSION:
        try:
            _, k, v = dequantize(payload, shape, dtype)
        except ValueError as exc:
            raise CorruptRecordError(f"quantized payload: {exc}") from None
        if device is not None and torch.device(device).type != "cpu":
            k, v = k.to(device), v.to(device)
        return k, v
    half = heads * tokens * head_dim * dtype.itemsize
    if 2 * half != payload_len:
        raise CorruptRecordError(
            f"dtype/shape mismatch: {dtype_name(dtype)} {list(shape)} needs {2 * half} payload bytes, header says {payload_len}"
        )
    k = _tensor_from(payload[:half], dtype, shape)
    v = _tensor_from(payload[half:], dtype, shape)
    if device is not None and torch.device(device).type != "cpu":
        k, v = k.to(device), v.to(device)
    return k, v
