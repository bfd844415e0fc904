"""Quantized chunk records (store/quant.py): round-trip error, bytes per token, formats kept apart,
dequantization on the loader's thread, blended answers close to the float store's, and a damaged
quantized record recomputed like any other."""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path

import diskcache
import pytest
import torch

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.metrics import next_token_kl
from cacheblend_rag.model.fingerprint import model_fingerprint
from cacheblend_rag.store import record as record_module
from cacheblend_rag.store.disk import KVStore
from cacheblend_rag.store.memory import MemoryTier
from cacheblend_rag.store.meta import ChunkMeta, encode_meta
from cacheblend_rag.store.quant import KVFormat, chunk_name, format_of_name, parse_kv_format, roundtrip
from cacheblend_rag.store.record import CorruptRecordError, decode_layer, encode_layer, layer_record_bytes
from cacheblend_rag.store.spec import open_store
from cacheblend_rag.store.tiers import Tier, TieredStore
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_model

REPO = Path(__file__).resolve().parents[1]
FORMATS = ["int8", "int4", "int8:k=token", "int8:v=channel,group=16", "int4:k=token,v=token"]


def _keys_with_outlier_channels(heads: int = 2, tokens: int = 300, dim: int = 64, seed: int = 0) -> torch.Tensor:
    # Like a real model's K: a few channels carry a large offset on every token.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(heads, tokens, dim, generator=g)
    x[:, :, :4] = x[:, :, :4] * 4 + 40
    return x


# ------------------------------------------------------------------------ the format itself


def test_format_names_parse_back_and_bad_ones_are_refused() -> None:
    assert parse_kv_format(None) is None and parse_kv_format("float") is None
    assert parse_kv_format("int8") == KVFormat(8, "channel", "token", 64)
    for spec in FORMATS:
        fmt = parse_kv_format(spec)
        assert parse_kv_format(fmt.name) == fmt
    assert parse_kv_format("INT4: group=32").name == "int4:group=32"
    with pytest.raises(ValueError, match="unknown KV format 'int2': use float, int8 or int4"):
        parse_kv_format("int2")
    with pytest.raises(ValueError, match="option 'k=row' is not k=channel|token"):
        parse_kv_format("int8:k=row")
    with pytest.raises(ValueError, match=r"group=0 must be a number of tokens in \[1, 65535\]"):
        parse_kv_format("int8:group=0")
    with pytest.raises(ValueError, match="'x' is not a whole number of tokens"):
        parse_kv_format("int8:group=x")


def _bound(x: torch.Tensor, axis: str, levels: int) -> torch.Tensor:
    """Half a quantization step of each value's group, bounded above by the step over the whole
    head (per token) or the whole chunk (per channel), plus float16's rounding of the minimum."""
    dim = -1 if axis == "token" else 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    return 0.5 * (hi - lo) / levels * (1 + 2**-9) + lo.abs() * 2**-10 + 1e-6


@pytest.mark.parametrize("spec", FORMATS)
@pytest.mark.parametrize("tokens", [1, 37, 64, 300])
def test_round_trip_error_is_within_half_a_step(spec, tokens) -> None:
    fmt = parse_kv_format(spec)
    k = _keys_with_outlier_channels(tokens=tokens)
    v = torch.randn(2, tokens, 64, generator=torch.Generator().manual_seed(1))
    kq, vq = decode_layer(encode_layer(k, v, "m", chunk="c", layer=2, kv_format=fmt), "m", chunk="c", layer=2)
    assert kq.shape == k.shape and vq.dtype == v.dtype
    levels = (1 << fmt.bits) - 1
    assert bool(((kq - k).abs() <= _bound(k, fmt.k_scales, levels)).all())
    assert bool(((vq - v).abs() <= _bound(v, fmt.v_scales, levels)).all())
    assert torch.equal(roundtrip(fmt, k, v)[0], kq)  # what a memory tier holds is what the record reads


def test_channel_scales_suit_keys_with_outlier_channels() -> None:
    # Why K defaults to per-channel scales (KIVI): per token, the outliers take the whole range.
    k = _keys_with_outlier_channels()
    v = torch.randn_like(k)
    err = {
        axis: float((roundtrip(KVFormat(8, axis, "token"), k, v)[0] - k)[:, :, 4:].abs().mean()) for axis in ("channel", "token")
    }
    assert err["channel"] < err["token"] / 4, err


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantized_record_decodes_to_the_dtype_it_was_given(dtype) -> None:
    k = torch.randn(2, 70, 16).to(dtype)
    got, _ = decode_layer(encode_layer(k, k, "m", kv_format=KVFormat(4)), "m")
    assert got.dtype == dtype and float((got.float() - k.float()).abs().max()) < 0.5


def test_values_a_format_cannot_hold_are_refused() -> None:
    k = torch.randn(1, 4, 8)
    k[0, 1, 2] = float("nan")
    with pytest.raises(ValueError, match="not finite or beyond float16's range"):
        encode_layer(k, k, "m", kv_format=KVFormat())
    assert decode_layer(encode_layer(k, k, "m"), "m")[0].isnan().any()  # float records keep them


def test_a_record_in_the_float_format_of_before_still_reads() -> None:
    # tests/data/kv_record_v2.bin was written by the float record code before quantized records
    # existed (version 2); it must decode to the same tensors.
    blob = (REPO / "tests" / "data" / "kv_record_v2.bin").read_bytes()
    k, v = decode_layer(blob, "fixture-model", chunk="fixture-chunk", layer=3)
    want = (torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) - 7) / 4
    assert torch.equal(k, want) and torch.equal(v, -want * 2)
    assert blob == encode_layer(want, -want * 2, "fixture-model", chunk="fixture-chunk", layer=3)  # still written so


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b[:-1], "truncated payload"),
        (lambda b: b[:-3] + bytes([b[-3] ^ 1]) + b[-2:], "checksum mismatch"),
        (lambda b: b + b"\0", "trailing bytes"),
    ],
    ids=["short", "flipped", "long"],
)
def test_damaged_quantized_record_is_refused(damage, message) -> None:
    blob = encode_layer(torch.randn(2, 9, 8), torch.randn(2, 9, 8), "m", kv_format=KVFormat(4))
    with pytest.raises(CorruptRecordError, match=message):
        decode_layer(damage(blob), "m")


def test_a_payload_that_does_not_fit_its_shape_is_refused() -> None:
    # Intact checksum, wrong sizes: a record built by hand with a shape its payload does not fit.
    blob = bytearray(encode_layer(torch.randn(2, 9, 8), torch.randn(2, 9, 8), "m", kv_format=KVFormat(8)))
    blob[12:16] = (10).to_bytes(4, "little")  # tokens 9 -> 10
    body = bytes(blob[:96]) + bytes(blob[100:])
    import zlib

    blob[96:100] = zlib.crc32(body).to_bytes(4, "little")
    with pytest.raises(CorruptRecordError, match=r"quantized payload: int8 payload of \[2, 10, 8\] needs"):
        decode_layer(bytes(blob), "m")


# ------------------------------------------------------------------------ bytes per token

# (layers, kv heads, head_dim) of models the docs quote; real records of a 512-token chunk.
MODELS = {
    "SmolLM2-135M": (30, 3, 64),
    "Qwen2.5-Coder-0.5B": (24, 2, 64),
    "Llama-3.1-8B": (32, 8, 128),
}


def chunk_bytes_per_token(layers: int, heads: int, head_dim: int, tokens: int, kv_format: str) -> float:
    """Bytes per token of one chunk as a store writes it: every layer's record and the meta record."""
    fmt = parse_kv_format(kv_format)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(heads, tokens, head_dim, generator=g), torch.randn(heads, tokens, head_dim, generator=g)
    one = len(encode_layer(k, v, "m", chunk="c", layer=0, kv_format=fmt))
    assert one == layer_record_bytes((heads, tokens, head_dim), torch.float32, fmt)
    meta = len(encode_meta(ChunkMeta(tokens, layers, "float32"), "m", "c"))
    return (layers * one + meta) / tokens


def test_bytes_per_token_of_quantized_records() -> None:
    for layers, heads, head_dim in MODELS.values():
        for tokens in (64, 200, 512):
            f32 = chunk_bytes_per_token(layers, heads, head_dim, tokens, "float")
            assert f32 / chunk_bytes_per_token(layers, heads, head_dim, tokens, "int8") >= 3.5
            assert f32 / chunk_bytes_per_token(layers, heads, head_dim, tokens, "int4") >= 7


def test_store_writes_exactly_the_records_counted(tmp_path) -> None:
    k = [(torch.randn(2, 80, 16), torch.randn(2, 80, 16)) for _ in range(3)]
    for spec in ("float", "int8", "int4"):
        with KVStore(tmp_path / spec, fingerprint="m", kv_format=spec) as store:
            assert store.put("c" * 64, k)
            fmt = parse_kv_format(spec)
            meta = len(encode_meta(ChunkMeta(80, 3, "float32"), "m", "c"))
            assert store.stats.bytes_written == 3 * layer_record_bytes((2, 80, 16), torch.float32, fmt) + meta


def test_docs_table_of_bytes_per_token_is_what_the_records_take() -> None:
    """docs/storage.md's table must hold the numbers ``chunk_bytes_per_token`` computes."""
    text = (REPO / "docs" / "storage.md").read_text()
    for name, (layers, heads, head_dim) in MODELS.items():
        row = re.search(rf"^\| {re.escape(name)} \|(.+)\|$", text, re.M)
        assert row, f"docs/storage.md has no row for {name}"
        cells = [c.strip() for c in row.group(1).split("|")]
        f32 = chunk_bytes_per_token(layers, heads, head_dim, 512, "float")
        want = [f"{f32:,.0f}"]
        for spec in ("int8", "int4"):
            b = chunk_bytes_per_token(layers, heads, head_dim, 512, spec)
            want.append(f"{b:,.0f} ({b / f32:.1%})")
        assert cells == want, f"{name}: docs say {cells}, records take {want}"


# ------------------------------------------------------------------------ stores


def test_formats_never_mix_in_one_directory(tmp_path) -> None:
    key = "a" * 64
    kv = [(torch.randn(2, 70, 16), torch.randn(2, 70, 16))]
    flt, q8 = KVStore(tmp_path, fingerprint="m"), KVStore(tmp_path, fingerprint="m", kv_format="int8")
    try:
        assert q8.put(key, kv)
        assert q8.contains(key) and not flt.contains(key)
        assert flt.put(key, kv) and flt.contains(key)
        assert torch.equal(flt.get_layer(key, 0)[0], kv[0][0])  # float: exact
        got = q8.get_layer(key, 0)[0]
        assert not torch.equal(got, kv[0][0]) and torch.equal(got, roundtrip(KVFormat(), *kv[0])[0])
        q8.discard(key)
        assert not q8.contains(key) and flt.contains(key)
    finally:
        flt.close()
        q8.close()
    assert chunk_name(key, None) == key and chunk_name(key, KVFormat(4)) == key + "@int4"
    assert format_of_name(key) == "float" and format_of_name(key + "@int8:k=token") == "int8:k=token"


def test_open_store_writes_the_format_and_refuses_an_unknown_one(tmp_path) -> None:
    opened = open_store("disk", directory=str(tmp_path), size_limit=2**30, fingerprint="m", memory_bytes=2**20, kv_format="int4")
    try:
        assert opened.kv_format == KVFormat(4) and opened.tier("disk").store.kv_format == KVFormat(4)
    finally:
        opened.close()
    with pytest.raises(ValueError, match="unknown KV format 'int3'"):
        open_store("disk", directory=str(tmp_path), size_limit=2**30, fingerprint="m", memory_bytes=0, kv_format="int3")


# ------------------------------------------------------------------------ the engine


def _engine(tokenizer, store, **kw) -> CacheBlendEngine:
    model = make_model("llama")
    return CacheBlendEngine(model, tokenizer, store=store, fingerprint=model_fingerprint(model, tokenizer), **kw)


@pytest.fixture(scope="module")
def logits(tokenizer, tmp_path_factory):
    """Next-token logits of CacheBlend over each format's store, and of full prefill."""
    out = {}
    for spec in ("float", "int8", "int4"):
        eng = _engine(tokenizer, KVStore(tmp_path_factory.mktemp(spec), kv_format=spec))
        eng.precompute(SAMPLE_CHUNKS, progress=False)
        out[spec] = eng.next_token_logits(SAMPLE_QUESTION, SAMPLE_CHUNKS)
        if spec == "float":
            out["full"] = eng.next_token_logits(SAMPLE_QUESTION, SAMPLE_CHUNKS, mode="full_recompute")
        eng.close()
    return out


def test_blended_answer_over_int8_records_is_close_to_the_float_stores(logits) -> None:
    kl8, kl4 = next_token_kl(logits["float"], logits["int8"]), next_token_kl(logits["float"], logits["int4"])
    blend = next_token_kl(logits["full"], logits["float"])  # what blending itself costs
    # On the tiny model: int8 3e-7, int4 4e-6, blending itself 3e-5.
    assert 0 < kl8 < 1e-5 and kl8 < blend / 40 and kl8 < kl4 / 5, (kl8, kl4, blend)
    assert kl4 < blend / 3, (kl4, blend)
    assert int(logits["int8"].argmax()) == int(logits["float"].argmax())


def test_memory_tier_holds_what_the_format_reads_back(tokenizer, tmp_path, logits) -> None:
    # Precomputed into memory and disk: answered from memory it must equal the bare int8 store's
    # answer (which read every chunk from its records), not the float store's.
    store = TieredStore([Tier(MemoryTier(), "memory"), Tier(KVStore(tmp_path, kv_format="int8"), "disk")])
    eng = _engine(tokenizer, store)
    eng.precompute(SAMPLE_CHUNKS, progress=False)
    got = eng.next_token_logits(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    assert store.stats.tier_hits["memory"] > 0 and store.stats.tier_hits["disk"] == 0
    assert torch.allclose(got, logits["int8"], atol=1e-5, rtol=0)
    eng.close()


def test_dequantization_runs_on_the_loader_thread_layer_by_layer(tokenizer, tmp_path, monkeypatch) -> None:
    eng = _engine(tokenizer, KVStore(tmp_path, kv_format="int8"), pipelined=True)
    eng.precompute(SAMPLE_CHUNKS, progress=False)
    calls: list[int] = []
    real = record_module.dequantize

    def spy(*args, **kwargs):
        calls.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(record_module, "dequantize", spy)
    res = eng.prefill(eng.build_layout(SAMPLE_QUESTION, SAMPLE_CHUNKS), "cacheblend")
    assert res.stats["pipelined"] is True
    # a record per chunk and layer (the prefix is the process's own exact copy, never a record)
    assert len(calls) == eng.num_layers * len(SAMPLE_CHUNKS)
    assert threading.get_ident() not in calls
    eng.close()


def _answer(eng):
    res = eng.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, max_new_tokens=4)
    return res.token_ids, eng.next_token_logits(SAMPLE_QUESTION, SAMPLE_CHUNKS)


@pytest.mark.parametrize("spec", ["int8", "int4"])
def test_a_chunk_computed_now_answers_as_its_record_will(tokenizer, tmp_path, spec) -> None:
    """A quantized store's chunk computed during a request is used as its record reads back, so
    the answer does not depend on whether the background write-back had finished."""
    eng = _engine(tokenizer, KVStore(tmp_path, kv_format=spec))
    eng.precompute(SAMPLE_CHUNKS, progress=False)
    key = eng.chunk_key(eng.prompts.chunk_segment(SAMPLE_CHUNKS[1]))
    eng.store.discard(key)
    computed = eng.prefill(eng.build_layout(SAMPLE_QUESTION, SAMPLE_CHUNKS), "cacheblend")
    assert computed.stats["chunk_misses"] == 1
    eng.flush()
    cached = eng.prefill(eng.build_layout(SAMPLE_QUESTION, SAMPLE_CHUNKS), "cacheblend")
    assert cached.stats["chunk_misses"] == 0
    assert torch.equal(computed.logits, cached.logits)
    eng.close()


@pytest.mark.parametrize(
    "damage",
    [lambda b: b[:-5], lambda b: b[:150] + bytes([b[150] ^ 0x20]) + b[151:], lambda b: b[:100]],
    ids=["short", "flipped-code", "no-payload"],
)
def test_damaged_quantized_record_is_recomputed(tokenizer, tmp_path, caplog, damage) -> None:
    eng = _engine(tokenizer, KVStore(tmp_path, kv_format="int8"))
    eng.precompute(SAMPLE_CHUNKS, progress=False)
    key = eng.chunk_key(eng.prompts.chunk_segment(SAMPLE_CHUNKS[1]))
    # The reference: that chunk missing, so computed now (as a discarded record makes it).
    eng.store.discard(key)
    want = _answer(eng)
    eng.flush()
    name = chunk_name(key, eng.store.kv_format)
    with diskcache.Cache(str(tmp_path)) as raw:
        raw.set(f"{name}/2", damage(raw.get(f"{name}/2")))
    with caplog.at_level(logging.WARNING):
        got = _answer(eng)
    assert got[0] == want[0] and torch.equal(got[1], want[1])
    assert eng.store.stats.corrupt == 1
    assert any(name in r.getMessage() and "unreadable" in r.getMessage() for r in caplog.records)
    eng.flush()
    assert eng.store.contains(key)  # written again, whole
    eng.close()
