"""Property tests: record encoding round-trips and rejects every damaged blob; keys are injective."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cacheblend_rag.store.keys import chunk_key
from cacheblend_rag.store.record import CorruptRecordError, decode_layer, encode_layer

FP = "fuzz-fingerprint"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layers(draw):
    """(K, V) with arbitrary bit patterns (NaNs, infs, denormals) and small shapes, incl. empty."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=3, max_size=3)))
    n = shape[0] * shape[1] * shape[2] * dtype.itemsize

    def tensor():
        raw = draw(st.binary(min_size=n, max_size=n))
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=dtype).view(shape)

    return tensor(), tensor()


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@FAST
@given(layers(), st.text(max_size=20))
def test_round_trip_is_bit_exact(kv, fingerprint: str) -> None:
    k, v = kv
    k2, v2 = decode_layer(encode_layer(k, v, fingerprint), fingerprint)
    assert (k2.dtype, k2.shape, v2.dtype, v2.shape) == (k.dtype, k.shape, v.dtype, v.shape)
    assert _bits(k2) == _bits(k) and _bits(v2) == _bits(v)


@FAST
@given(layers(), st.data())
def test_any_single_byte_corruption_is_rejected(kv, data) -> None:
    blob = encode_layer(*kv, FP)
    i = data.draw(st.integers(0, len(blob) - 1), label="index")
    x = data.draw(st.integers(1, 255), label="xor")
    bad = bytearray(blob)
    bad[i] ^= x
    try:
        decode_layer(bytes(bad), FP)
    except CorruptRecordError:
        return
    raise AssertionError(f"byte {i} ^ {x} decoded without error")  # a silent wrong tensor


@FAST
@given(layers(), st.data())
def test_any_truncation_or_extension_is_rejected(kv, data) -> None:
    blob = encode_layer(*kv, FP)
    cut = data.draw(st.integers(0, len(blob) - 1), label="cut")
    extra = data.draw(st.binary(min_size=1, max_size=8), label="extra")
    for bad in (blob[:cut], blob + extra):
        try:
            decode_layer(bad, FP)
        except CorruptRecordError:
            continue
        raise AssertionError(f"length {len(bad)} of {len(blob)} decoded without error")


@FAST
@given(st.binary(max_size=200))
def test_arbitrary_bytes_only_raise_corrupt_record_error(junk: bytes) -> None:
    try:
        decode_layer(b"CBKV\x01\x00" + junk, FP)
    except CorruptRecordError:
        pass


ids = st.lists(st.integers(0, 2**31), max_size=6)
triples = st.tuples(st.sampled_from(["", "a", "b", "ab"]), ids, ids)


@settings(max_examples=300, deadline=None)
@given(triples, triples)
def test_chunk_key_is_injective(a, b) -> None:
    # Small alphabets make near-collisions (moved split points, shared prefixes) common.
    assert (chunk_key(*a) == chunk_key(*b)) == (a == b)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["", "m"]), st.lists(st.integers(0, 5), max_size=6), st.data())
def test_chunk_key_depends_on_split_point(fp: str, tokens: list[int], data) -> None:
    i = data.draw(st.integers(0, len(tokens)))
    j = data.draw(st.integers(0, len(tokens)))
    same = chunk_key(fp, tokens[:i], tokens[i:]) == chunk_key(fp, tokens[:j], tokens[j:])
    assert same == (i == j)
