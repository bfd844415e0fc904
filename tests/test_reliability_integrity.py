"""Integrity: every stored record is checked on load; a bad one is discarded, counted, logged once
and recomputed, and the answer (token ids and logits) equals the clean-cache answer.

Corruption is planted from outside through a raw ``diskcache.Cache`` on the same directory (as a
misbehaving process or a damaged disk would), both where the engine first looks (the chunk's meta
record, read by ``contains``) and in the middle of the layer-wise load (a middle layer's record,
read only after earlier layers were already fused).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import diskcache
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "reliability_helpers"))
from rel_common import CHUNKS, answer, engine, fully_decodable, keys_of

from cacheblend_rag.store.disk import KVStore
from cacheblend_rag.store.record import HEADER_SIZE, encode_layer

LAYERS = 8
MID = 5  # a middle layer: layers 0..4 load fine, then this one fails
LONG = " ".join(["The river Thames flows through London and Oxford."] * 14)  # >32 KiB/layer: file-backed


@pytest.fixture(scope="module")
def clean():
    """Reference answers from a fresh, uncorrupted store (both chunk sets, warm cache)."""
    eng = engine(None, layers=LAYERS)
    out = {}
    for name, chunks in {"short": CHUNKS, "long": [LONG, *CHUNKS[:2]]}.items():
        eng.precompute(chunks, progress=False)
        out[name] = answer(eng, chunks)
    eng.close()
    return out


@pytest.fixture
def eng(tmp_path):
    e = engine(tmp_path / "kv", layers=LAYERS)
    yield e
    e.close()


def _flip(blob: bytes, at: int) -> bytes:
    b = bytearray(blob)
    b[at % len(b)] ^= 0x5A
    return bytes(b)


def _assert_equal_answer(got, want) -> None:
    assert got[0] == want[0], "token ids differ from the clean-cache answer"
    assert torch.equal(got[1], want[1]), "logits differ from the clean-cache answer"


def _assert_healed(e, chunks) -> None:
    """The bad chunk was rewritten: every chunk decodes fully and the next call is all hits."""
    e.flush()
    assert all(fully_decodable(e, k) for k in keys_of(e, chunks))
    res = e.generate("Who won two Nobel prizes?", chunks, max_new_tokens=1)
    assert res.stats["chunk_hits"] == len(chunks) and res.stats["chunk_misses"] == 0


def _warnings_about(caplog, key: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cacheblend_rag.store.disk" and key in r.getMessage()]


# ------------------------------------------------------------------ detected at contains/meta time

META_DAMAGE = {
    "flipped-byte": lambda blob: _flip(blob, 5),
    "truncated": lambda blob: blob[:7],
    "str-not-bytes": lambda blob: "CBKM meta",
}


@pytest.mark.parametrize("damage", META_DAMAGE.values(), ids=META_DAMAGE.keys())
def test_corrupt_meta_is_found_at_lookup_and_recomputed(eng, clean, caplog, damage) -> None:
    eng.precompute(CHUNKS, progress=False)
    key = keys_of(eng, CHUNKS)[1]
    with diskcache.Cache(str(eng.store.directory)) as raw:
        raw.set(f"{key}/meta", damage(raw.get(f"{key}/meta")))
    calls: list[tuple[str, int]] = []
    real = eng.store.get_layer
    eng.store.get_layer = lambda k, i, **kw: calls.append((k, i)) or real(k, i, **kw)
    with caplog.at_level(logging.WARNING):
        got = answer(eng, CHUNKS)
    _assert_equal_answer(got, clean["short"])
    assert eng.store.stats.corrupt == 1
    assert len(_warnings_about(caplog, key)) == 1
    assert not any(k == key for k, _ in calls), "a chunk with a bad meta record must not be loaded"
    _assert_healed(eng, CHUNKS)


# ------------------------------------------------------------------ detected mid-prefill


def _other_chunk_record(e, key: str, blob: bytes) -> bytes:
    """A well-formed record (right fingerprint and checksum) of a *different* chunk's layer."""
    other = keys_of(e, CHUNKS)[3]
    with diskcache.Cache(str(e.store.directory)) as raw:
        return raw.get(f"{other}/{MID}")


def _float16_record(e, key: str, blob: bytes) -> bytes:
    k, v = e.store.get_layer(key, MID)
    return encode_layer(k.half(), v.half(), e.store.fingerprint, chunk=key, layer=MID)


LAYER_DAMAGE = {
    "payload-byte": lambda e, key, blob: _flip(blob, HEADER_SIZE + 11),
    "header-magic": lambda e, key, blob: _flip(blob, 0),
    "header-dtype-code": lambda e, key, blob: _flip(blob, 6),
    "header-shape": lambda e, key, blob: _flip(blob, 12),
    "truncated": lambda e, key, blob: blob[: len(blob) // 2],
    "empty": lambda e, key, blob: b"",
    "other-chunk-shape": _other_chunk_record,
    "valid-but-float16": _float16_record,
}


@pytest.mark.parametrize("damage", LAYER_DAMAGE.values(), ids=LAYER_DAMAGE.keys())
def test_corrupt_middle_layer_is_found_mid_prefill_and_recomputed(eng, clean, caplog, damage) -> None:
    _check_mid_prefill(eng, clean, caplog, damage)


def test_mid_prefill_corruption_with_pipelined_loading(tmp_path, clean, caplog) -> None:
    # The load runs one layer ahead in a background thread; the failure must cross that thread.
    e = engine(tmp_path / "kv", layers=LAYERS, pipelined=True)
    try:
        _check_mid_prefill(e, clean, caplog, LAYER_DAMAGE["payload-byte"])
    finally:
        e.close()


def _check_mid_prefill(eng, clean, caplog, damage) -> None:
    eng.precompute(CHUNKS, progress=False)
    key = keys_of(eng, CHUNKS)[2]
    bad = damage(eng, key, eng.store._cache.get(f"{key}/{MID}"))
    with diskcache.Cache(str(eng.store.directory)) as raw:
        raw.set(f"{key}/{MID}", bad)
    loaded: list[tuple[int, bool]] = []
    real = eng.store.get_layer

    def spy(k, i, **kw):
        got = real(k, i, **kw)
        if k == key:
            loaded.append((i, got is not None))
        return got

    eng.store.get_layer = spy
    with caplog.at_level(logging.WARNING):
        got = answer(eng, CHUNKS)
    _assert_equal_answer(got, clean["short"])
    # The failure really happened during the layer-wise load: earlier layers had loaded.
    assert (MID, False) in loaded and all((i, True) in loaded for i in range(MID))
    assert eng.store.stats.corrupt == 1
    assert len(_warnings_about(caplog, key)) == 1
    assert any("lost during load" in r.getMessage() for r in caplog.records)
    _assert_healed(eng, CHUNKS)


def test_record_of_another_model_under_the_same_key_is_rejected(eng, clean, caplog) -> None:
    # Same key, same shapes, intact checksums: only the fingerprint in the header tells them apart.
    key = keys_of(eng, CHUNKS)[0]
    impostor = KVStore(eng.store.directory, fingerprint="some-other-model")
    donor = engine(None, layers=LAYERS, seed=1)  # a different model with the same architecture
    assert impostor.put(key, donor.compute_chunk(donor.prompts.chunk_segment(CHUNKS[0])))
    impostor.close()
    donor.close()
    with caplog.at_level(logging.WARNING):
        got = answer(eng, CHUNKS)
    _assert_equal_answer(got, clean["short"])
    assert eng.store.stats.corrupt == 1
    # The meta record names its model too, so the chunk is refused at lookup, before any layer.
    assert "belongs to another chunk or model" in " ".join(_warnings_about(caplog, key))
    _assert_healed(eng, CHUNKS)


def test_truncated_value_file_is_recomputed(eng, clean, caplog) -> None:
    chunks = [LONG, *CHUNKS[:2]]
    eng.precompute(chunks, progress=False)
    key = keys_of(eng, chunks)[0]
    with diskcache.Cache(str(eng.store.directory)) as raw:
        with raw.get(f"{key}/{MID}", read=True) as fh:  # raises if the record is not file-backed
            path = fh.name
    size = Path(path).stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(size - 100)
    with caplog.at_level(logging.WARNING):
        got = answer(eng, chunks)
    _assert_equal_answer(got, clean["long"])
    assert eng.store.stats.corrupt == 1
    assert "truncated" in " ".join(_warnings_about(caplog, key))
    _assert_healed(eng, chunks)


def test_deleted_value_file_is_recomputed(eng, clean) -> None:
    chunks = [LONG, *CHUNKS[:2]]
    eng.precompute(chunks, progress=False)
    key = keys_of(eng, chunks)[0]
    with diskcache.Cache(str(eng.store.directory)) as raw:
        with raw.get(f"{key}/{MID}", read=True) as fh:
            path = fh.name
    Path(path).unlink()
    _assert_equal_answer(answer(eng, chunks), clean["long"])
    _assert_healed(eng, chunks)


def test_every_chunk_corrupt_at_once_still_answers(eng, clean, caplog) -> None:
    # Each retry discards only the chunk that failed; all of them must be survivable in one request.
    eng.precompute(CHUNKS, progress=False)
    with diskcache.Cache(str(eng.store.directory)) as raw:
        for key in keys_of(eng, CHUNKS):
            raw.set(f"{key}/{MID}", _flip(raw.get(f"{key}/{MID}"), HEADER_SIZE + 1))
    with caplog.at_level(logging.WARNING):
        got = answer(eng, CHUNKS)
    _assert_equal_answer(got, clean["short"])
    assert eng.store.stats.corrupt == len(CHUNKS)
    _assert_healed(eng, CHUNKS)


def test_stored_bytes_are_what_the_engine_computed(eng) -> None:
    # The premise of the equality checks above: a stored chunk is bit-identical to a fresh compute.
    eng.precompute(CHUNKS[:1], progress=False)
    key = keys_of(eng, CHUNKS[:1])[0]
    fresh = eng.compute_chunk(eng.prompts.chunk_segment(CHUNKS[0]))
    for i, (k, v) in enumerate(fresh):
        sk, sv = eng.store.get_layer(key, i)
        assert torch.equal(sk, k) and torch.equal(sv, v)
