"""``cacheblend-rag store stats`` and ``store drop`` (cacheblend_rag/cli/store.py) on a disk store:
counts by format that match what the records take, unpublished records counted apart, and drops
that leave every other chunk readable."""

from __future__ import annotations

import json

import diskcache
import pytest
import torch

from cacheblend_rag.cli import app as cli
from cacheblend_rag.store.disk import KVStore
from cacheblend_rag.store.meta import ChunkMeta, encode_meta
from cacheblend_rag.store.quant import parse_kv_format
from cacheblend_rag.store.record import layer_record_bytes

LAYERS, HEADS, DIM = 3, 2, 16
TOKENS = {"a" * 64: 40, "b" * 64: 70, "c" * 64: 100}


def _chunk_bytes(tokens: int, kv_format: str | None, dtype=torch.float32) -> int:
    fmt = parse_kv_format(kv_format)
    return LAYERS * layer_record_bytes((HEADS, tokens, DIM), dtype, fmt) + len(encode_meta(ChunkMeta(1, 1, "float32")))


@pytest.fixture
def store_dir(tmp_path):
    """A store holding three chunks in float32, the same three in int8, and one in float16."""
    for kv_format in (None, "int8"):
        with KVStore(tmp_path, fingerprint="m", kv_format=kv_format) as store:
            for key, n in TOKENS.items():
                assert store.put(key, [(torch.randn(HEADS, n, DIM), torch.randn(HEADS, n, DIM))] * LAYERS)
    with KVStore(tmp_path, fingerprint="other-model") as store:
        half = torch.randn(HEADS, 30, DIM, dtype=torch.float16)
        assert store.put("d" * 64, [(half, half)] * LAYERS)
    return tmp_path


def _stats(capsys, store_dir) -> dict:
    assert cli.main(["store", "stats", "--store-dir", str(store_dir), "--json"]) == 0
    (disk,) = json.loads(capsys.readouterr().out)
    return disk


def test_stats_count_chunks_tokens_and_bytes_by_format(store_dir, capsys) -> None:
    disk = _stats(capsys, store_dir)
    f = disk["formats"]
    tokens = sum(TOKENS.values())
    assert set(f) == {"float32", "float16", "int8"}
    assert (f["float32"]["chunks"], f["float32"]["tokens"]) == (3, tokens)
    assert f["float32"]["bytes"] == sum(_chunk_bytes(n, None) for n in TOKENS.values())
    assert f["int8"]["bytes"] == sum(_chunk_bytes(n, "int8") for n in TOKENS.values())
    assert f["int8"]["bytes_per_token"] == pytest.approx(f["int8"]["bytes"] / tokens)
    assert f["float16"] == {
        "chunks": 1,
        "tokens": 30,
        "bytes": _chunk_bytes(30, None, torch.float16),
        "bytes_per_token": _chunk_bytes(30, None, torch.float16) / 30,
    }
    assert disk["unpublished_bytes"] == 0 and disk["hits"] is None and disk["volume"] > 0
    assert cli.main(["store", "stats", "--store-dir", str(store_dir)]) == 0
    text = capsys.readouterr().out
    assert "| int8 | 3 | 210 |" in text and "counted per process" in text


def test_records_no_meta_record_publishes_are_counted_apart(store_dir, capsys) -> None:
    with diskcache.Cache(str(store_dir)) as raw:
        raw.set("e" * 64 + "@int8/0", b"x" * 1000, tag="e" * 64 + "@int8")  # a write cut short
    disk = _stats(capsys, store_dir)
    assert disk["unpublished_bytes"] == 1000 and disk["formats"]["int8"]["chunks"] == 3


def test_drop_one_format_leaves_the_others_readable(store_dir, capsys) -> None:
    assert cli.main(["store", "drop", "--store-dir", str(store_dir), "--format", "int8"]) == 0
    want = sum(_chunk_bytes(n, "int8") for n in TOKENS.values())
    assert f"dropped the int8 chunks from {store_dir}: 3 chunks, {want:,} bytes" in capsys.readouterr().out
    assert set(_stats(capsys, store_dir)["formats"]) == {"float32", "float16"}
    with KVStore(store_dir, fingerprint="m") as flt, KVStore(store_dir, fingerprint="m", kv_format="int8") as q8:
        for key in TOKENS:
            assert not q8.contains(key)
            assert all(flt.get_layer(key, i) is not None for i in range(LAYERS))
    assert cli.main(["store", "drop", "--store-dir", str(store_dir), "--format", "float"]) == 0
    assert ": 4 chunks," in capsys.readouterr().out  # float32 and float16 alike
    assert _stats(capsys, store_dir)["formats"] == {}


def test_drop_all_and_refusals(store_dir, capsys) -> None:
    assert cli.main(["store", "drop", "--store-dir", str(store_dir), "--all"]) == 0
    assert "dropped every chunk" in capsys.readouterr().out
    assert _stats(capsys, store_dir)["formats"] == {}
    with pytest.raises(SystemExit, match="pass --format FORMAT .* or --all"):
        cli.main(["store", "drop", "--store-dir", str(store_dir)])
    with pytest.raises(SystemExit, match="--format: unknown KV format 'int3'"):
        cli.main(["store", "drop", "--store-dir", str(store_dir), "--format", "int3"])
    with pytest.raises(SystemExit, match="no chunk store here"):
        cli.main(["store", "stats", "--store-dir", str(store_dir / "nowhere")])
