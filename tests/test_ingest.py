"""``cacheblend-rag ingest`` (cacheblend_rag/cli/ingest.py): the corpus read as ``ask`` reads it, a plan
whose bytes are what the store writes, refusals before anything is computed, and a run killed at
a random point that finishes on the next run with every chunk cached once and readable."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "reliability_helpers"))
from rel_common import REPO, engine

from cacheblend_rag.cli import app as cli
from cacheblend_rag.cli import ask, ingest
from cacheblend_rag.engine import capacity
from cacheblend_rag.engine.capacity import StoreTooSmall
from cacheblend_rag.store.disk import KVStore

HELPER = Path(__file__).parent / "reliability_helpers" / "ingest_tiny.py"


def _corpus(folder: Path, n: int = 40) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "river.txt").write_text(
        "\n\n".join(f"Paragraph {i}: the river Thames flows through London and Oxford, mile {i}." for i in range(n)),
        encoding="utf-8",
    )
    lines = [
        json.dumps({"text": f"Marie Curie won prize {i} in physics."}) if i % 2 else json.dumps(f"Alice, {i}.") for i in range(n)
    ]
    (folder / "sub").mkdir(exist_ok=True)
    (folder / "sub" / "docs.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (folder / "chunks.json").write_text(json.dumps(["A chunk as given.", {"text": "Another one."}]), encoding="utf-8")
    (folder / "notes.bin").write_bytes(b"\0\1")  # not a corpus file: left out
    return folder


@pytest.fixture
def eng(tmp_path):
    e = engine(tmp_path / "kv")
    yield e
    e.close()


def test_corpus_is_split_as_ask_splits_files(eng, tmp_path) -> None:
    folder = _corpus(tmp_path / "corpus")
    chunks = ingest.read_corpus([str(folder)], eng.tokenizer, 32)
    river = ask.read_chunks([str(folder / "river.txt")], eng.tokenizer, 32)
    assert chunks[:2] == ["A chunk as given.", "Another one."]  # chunks.json, as ask reads it
    assert chunks[2 : 2 + len(river)] == river
    assert "Marie Curie won prize 1 in physics." in chunks and "Alice, 0." in chunks
    assert len(chunks) == len(set(chunks)) == 2 + len(river) + 40


def test_bad_corpus_files_are_refused_with_their_line(eng, tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"fine"\n{"title": "no text"}\n', encoding="utf-8")
    with pytest.raises(SystemExit, match=r'bad.jsonl:2: expected a string or an object with a "text" string'):
        ingest.read_corpus([str(bad)], eng.tokenizer, 32)
    bad.write_text("{oops\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"bad.jsonl:1: not JSON"):
        ingest.read_corpus([str(bad)], eng.tokenizer, 32)
    with pytest.raises(SystemExit, match="no such file or folder"):
        ingest.read_corpus([str(tmp_path / "missing")], eng.tokenizer, 32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no .txt, .md, .rst, .json, .jsonl files in this folder"):
        ingest.read_corpus([str(tmp_path / "empty")], eng.tokenizer, 32)


@pytest.mark.parametrize("kv_format", ["float", "int8", "int4"])
def test_plan_counts_the_bytes_the_store_writes(eng, tmp_path, kv_format, capsys) -> None:
    eng.store.close()
    eng.store = KVStore(tmp_path / kv_format, fingerprint=eng.fingerprint, kv_format=kv_format)
    chunks = ingest.read_corpus([str(_corpus(tmp_path / "corpus", 10))], eng.tokenizer, 32)
    p = eng.plan_precompute(chunks)
    assert (p.chunks, p.cached, p.kv_format) == (len(chunks), 0, kv_format)
    assert ingest.run(eng, chunks, progress=False) == len(chunks)
    assert eng.store.stats.bytes_written == p.new_bytes == p.total_bytes
    # What the size limit counts (records, database, log, folders) stays within the estimate.
    assert p.total_bytes < eng.store.volume() <= eng.store.bytes_needed(p.total_bytes, p.records)
    assert (again := eng.plan_precompute(chunks)).new_records == 0 and again.records == p.new_records
    assert p.bytes_per_token == pytest.approx((p.total_bytes - p.prefix_bytes) / p.tokens)
    assert (again.cached, again.new_bytes, again.total_bytes) == (len(chunks), 0, p.total_bytes)
    assert ingest.run(eng, chunks, progress=False) == 0  # a second run computes nothing
    out = capsys.readouterr().err
    assert f"{len(chunks)} chunks (0 cached, {len(chunks)} to compute)" in out and "computed 0 chunk caches" in out


def test_a_corpus_over_the_size_limit_is_refused_before_anything_is_computed(eng, tmp_path) -> None:
    chunks = ingest.read_corpus([str(_corpus(tmp_path / "corpus", 10))], eng.tokenizer, 32)
    p = eng.plan_precompute(chunks)
    eng.store.size_limit = eng.store.bytes_needed(p.total_bytes, p.records) - 1
    with pytest.raises(StoreTooSmall, match=r"more than the store's size limit of [\d,]+ bytes: its last chunks"):
        ingest.run(eng, chunks, progress=False)
    assert eng.store.stats.bytes_written == 0
    with pytest.raises(StoreTooSmall, match=r"--kv-format int8, kv_format=\"int8\": about a quarter"):
        capacity.check_room(eng.plan_precompute(chunks), eng.store)
    in_int8 = dataclasses.replace(eng.plan_precompute(chunks), kv_format="int8")  # the default's next step down
    with pytest.raises(StoreTooSmall, match=r"--kv-format int4, kv_format=\"int4\": about half, at some cost in answers"):
        capacity.check_room(in_int8, eng.store)


def test_a_disk_without_the_space_is_refused(eng, tmp_path, monkeypatch) -> None:
    chunks = ingest.read_corpus([str(_corpus(tmp_path / "corpus", 10))], eng.tokenizer, 32)
    p = eng.plan_precompute(chunks)
    need = eng.store.bytes_needed(p.new_bytes, p.new_records)
    monkeypatch.setattr(capacity.shutil, "disk_usage", lambda _: _Usage(need))
    with pytest.raises(StoreTooSmall, match=r"has [\d,]+ bytes free \(precompute leaves 10% of it\): free space"):
        ingest.run(eng, chunks, progress=False)
    assert eng.store.stats.bytes_written == 0


class _Usage:
    def __init__(self, free: int) -> None:
        self.free = free


def test_neighbour_aware_caches_are_stored_once(eng, tmp_path) -> None:
    chunks = ingest.read_corpus([str(_corpus(tmp_path / "corpus", 4))], eng.tokenizer, 32)
    p = eng.plan_precompute(chunks, neighbours=1)
    first = ingest.run(eng, chunks, neighbours=1, progress=False)
    assert first == 2 * len(chunks)  # a plain and a neighbour-aware cache each
    assert eng.store.stats.bytes_written == p.new_bytes
    assert ingest.run(eng, chunks, neighbours=1, progress=False) == 0


def test_cli_dry_run_prints_the_plan_and_a_refusal_exits_3(eng, tmp_path, monkeypatch, capsys) -> None:
    folder = _corpus(tmp_path / "corpus", 5)
    seen = {}

    def fake(model, **kw):
        seen.update(kw)
        eng.store.close()
        eng.store = KVStore(kw["store_dir"], size_limit=kw["store_size_limit"], fingerprint=eng.fingerprint)
        return eng

    from cacheblend_rag.engine.core import CacheBlendEngine

    monkeypatch.setattr(CacheBlendEngine, "from_pretrained", staticmethod(fake))
    store = str(tmp_path / "kv2")
    assert cli.main(["ingest", str(folder), "--store-dir", store, "--dry-run", "--kv-format", "int8"]) == 0
    assert seen["kv_format"] == "int8" and seen["memory_bytes"] == 0
    assert "to compute" in capsys.readouterr().out and eng.store.stats.bytes_written == 0
    assert cli.main(["ingest", str(folder), "--store-dir", store, "--store-size-limit", "10K"]) == 3
    assert "error: the corpus's chunk caches take about" in capsys.readouterr().err
    for command in (["ingest", str(folder)], ["ask", "Q?", str(folder)], ["serve"]):  # refused before a model loads
        with pytest.raises(SystemExit) as exc:
            cli.main([*command, "--kv-format", "int3"])
        assert exc.value.code == 2
        assert "argument --kv-format: unknown KV format 'int3': use float, int8 or int4" in capsys.readouterr().err


def _published(store_dir: Path) -> int:
    """Chunks the store has published (meta records), read as another process would."""
    db = store_dir / "cache.db"
    if not db.is_file():
        return 0
    try:
        con = sqlite3.connect(db.absolute().as_uri() + "?mode=ro", uri=True, timeout=10)
        try:
            return con.execute("SELECT COUNT(*) FROM Cache WHERE key LIKE '%/meta'").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return 0


def test_ingestion_killed_at_a_random_point_finishes_on_the_next_run(tmp_path) -> None:
    folder = _corpus(tmp_path / "corpus", 30)
    store_dir = tmp_path / "kv"
    e = engine(None)
    chunks = ingest.read_corpus([str(folder)], e.tokenizer, 64)
    keys = [e.chunk_key(e.prompts.chunk_segment(c), e.prompts.prefix_ids) for c in chunks]
    e.close()
    stop_at = random.Random(os.getpid()).randint(3, len(chunks) - 3)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(HELPER), str(store_dir), str(folder), "0.05"], env=env, stdout=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while _published(store_dir) < stop_at and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the ingestion finished before it could be killed"
    before = _published(store_dir)
    assert 0 < before < len(chunks) + 1  # the prefix and some chunks, not all

    done = subprocess.run([sys.executable, str(HELPER), str(store_dir), str(folder)], env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    computed = int(done.stdout.decode().split("computed ")[-1])
    assert computed == len(chunks) + 1 - before  # nothing stored before was computed again
    assert _published(store_dir) == len(chunks) + 1  # each chunk once, and the prefix

    e = engine(store_dir)
    try:
        for key in keys:
            assert all(e.store.get_layer(key, layer) is not None for layer in range(e.num_layers)), key
        assert e.store.stats.corrupt == 0
    finally:
        e.close()


def test_every_precompute_checks_the_room_before_computing(eng, tmp_path) -> None:
    # The check lives in the engine, so the integrations' helpers and a direct call make it too.
    chunks = ingest.read_corpus([str(_corpus(tmp_path / "corpus", 10))], eng.tokenizer, 32)
    p = eng.plan_precompute(chunks, neighbours=1)
    need = eng.store.bytes_needed(p.total_bytes, p.records)
    eng.store.size_limit = need - 1
    with pytest.raises(StoreTooSmall, match=r"more than the store's size limit .* Raise the limit \(--store-size-limit"):
        eng.precompute(chunks, neighbours=1, progress=False)
    assert eng.store.stats.bytes_written == 0 and not any(eng.is_cached(c) for c in chunks)
    assert eng.precompute(chunks, progress=False) == len(chunks)  # plain caches alone fit
    eng.store.size_limit = need
    assert eng.precompute(chunks, neighbours=1, progress=False) == len(chunks)  # the neighbour-aware ones
    assert eng.store.stats.bytes_written == p.total_bytes  # every cache stored, none evicted
