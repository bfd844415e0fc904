"""The Redis tier against a real redis-server on 127.0.0.1: sharing across processes, outages,
restarts, damaged and foreign records, credentials, and the batched per-layer read."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install 'cacheblend-rag[redis]')")

from cacheblend_rag import CacheBlendEngine  # noqa: E402
from cacheblend_rag.store import tiers as tiers_module  # noqa: E402
from cacheblend_rag.store.disk import KVStore  # noqa: E402
from cacheblend_rag.store.memory import MemoryTier  # noqa: E402
from cacheblend_rag.store.quant import KVFormat  # noqa: E402
from cacheblend_rag.store.record import encode_layer  # noqa: E402
from cacheblend_rag.store.redis_tier import RedisAuthError, RedisConfig, RedisStore  # noqa: E402
from cacheblend_rag.store.spec import open_store  # noqa: E402
from cacheblend_rag.store.tiers import Tier, TieredStore  # noqa: E402
from cacheblend_rag.testing import make_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "reliability_helpers"))
from local_redis import REDIS_SERVER, RedisServer, free_port  # noqa: E402

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server not found on PATH (apt-get install redis-server)")

CHUNKS = [
    "The Eiffel Tower is in Paris, the capital of France.",
    "Marie Curie won two Nobel prizes, in physics and in chemistry.",
    "The river Thames flows through London and Oxford.",
]
Q = "Where is the Eiffel Tower?"


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.stop()


@pytest.fixture
def own_server(tmp_path):
    """A server this test may kill and restart."""
    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


def _config(url: str, **kw) -> RedisConfig:
    # A fresh prefix per test: tests sharing the session server never see each other's chunks.
    return RedisConfig(url, prefix=f"test{uuid.uuid4().hex[:8]}", socket_timeout_s=0.5, connect_timeout_s=0.5, **kw)


def _engine(tokenizer, store, **kw) -> CacheBlendEngine:
    return CacheBlendEngine(make_model("llama"), tokenizer, store=store, **kw)


@pytest.fixture(scope="module")
def clean(tokenizer, tmp_path_factory):
    """The answer and next-token logits from a disk store (the reference every Redis set-up must match)."""
    eng = _engine(tokenizer, KVStore(tmp_path_factory.mktemp("clean")))
    eng.precompute(CHUNKS, progress=False)
    res = eng.generate(Q, CHUNKS, max_new_tokens=5)
    logits = eng.next_token_logits(Q, CHUNKS)
    full = eng.next_token_logits(Q, CHUNKS, mode="full_recompute")
    eng.close()
    return res, logits, full


def _assert_same_answer(eng, clean):
    res = eng.generate(Q, CHUNKS, max_new_tokens=5)
    assert res.token_ids == clean[0].token_ids
    torch.testing.assert_close(eng.next_token_logits(Q, CHUNKS), clean[1], rtol=1e-5, atol=1e-6)
    return res


def _layers(n_layers=3, tokens=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, tokens, 8, generator=g), torch.randn(2, tokens, 8, generator=g)) for _ in range(n_layers)]


# ------------------------------------------------------------------ 1. two processes, one Redis

WORKER = textwrap.dedent(
    """
    import json, sys
    import torch
    torch.set_num_threads(1)
    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.model import loading as models
    from cacheblend_rag.model.fingerprint import model_fingerprint
    from cacheblend_rag.model.loading import LoadedModel
    from cacheblend_rag.store.redis_tier import RedisConfig
    from cacheblend_rag.testing import make_model, make_tokenizer

    url, prefix, home, question = sys.argv[1:5]
    chunks = json.loads(sys.argv[5])

    def load_model(name, **kwargs):  # from_pretrained on the tiny model instead of a checkpoint
        m, tok = make_model("llama"), make_tokenizer()
        return LoadedModel(m, tok, "tiny", model_fingerprint(m, tok))

    models.load_model = load_model
    eng = CacheBlendEngine.from_pretrained(
        "tiny", cache_dir=home, store_dir=home + "/kv", store=["disk", RedisConfig(url, prefix=prefix)]
    )
    res = eng.generate(question, chunks, max_new_tokens=5)
    eng.flush()  # the write-back of the chunks computed here reaches Redis before we exit
    print(json.dumps({
        "tiers": [t.name for t in eng.store.tiers],
        "token_ids": res.token_ids,
        "hits": res.stats["chunk_hits"],
        "misses": res.stats["chunk_misses"],
        "miss_compute_s": res.stats["miss_compute_s"],
        "tier_hits": eng.store.stats.tier_hits,
        "logits": eng.next_token_logits(question, chunks).tolist(),
    }))
    eng.close()
    """
)


def _worker(server, prefix, home: Path) -> dict:
    cmd = [sys.executable, "-c", WORKER, server.url, prefix, str(home), Q, json.dumps(CHUNKS)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_quantized_chunks_are_kept_apart_in_the_disk_stores_records(server, tmp_path):
    kv = [(torch.randn(2, 70, 16), torch.randn(2, 70, 16)) for _ in range(2)]
    key, config = "b" * 64, _config(server.url)
    q8, flt = RedisStore(config, fingerprint="m", kv_format="int8"), RedisStore(config, fingerprint="m")
    disk = KVStore(tmp_path, fingerprint="m", kv_format="int8")
    try:
        assert q8.put(key, kv) and disk.put(key, kv)
        assert q8.record_name(key, 0).endswith("{" + key + "@int8}:0") and not flt.contains(key)
        # A version 3 record, as the disk store writes; read back to the disk store's values.
        assert q8.client.get(q8.record_name(key, 1)) == encode_layer(*kv[1], "m", chunk=key, layer=1, kv_format=KVFormat())
        for layer in range(2):
            got, want = q8.get_layers([key], layer)[0], disk.get_layer(key, layer)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    finally:
        for store in (q8, flt, disk):
            store.close()


def test_store_stats_and_drop_count_redis_chunks_by_format(server):
    from cacheblend_rag.cli.store import drop_redis, redis_stats

    config = _config(server.url)
    kv = [(torch.randn(2, 50, 16), torch.randn(2, 50, 16))] * 3
    stores = [RedisStore(config, fingerprint="m", kv_format=f) for f in (None, "int8")]
    try:
        for store in stores:
            assert store.put("e" * 64, kv) and store.put("f" * 64, kv)
        got = redis_stats(server.url, config.prefix)
        assert {k: (s.chunks, s.tokens) for k, s in got.formats.items()} == {"float32": (2, 100), "int8": (2, 100)}
        assert got.formats["float32"].bytes > 3 * got.formats["int8"].bytes  # head_dim 16: V's scales weigh more
        assert got.hits is not None and got.misses is not None  # the server's own counts
        assert drop_redis(server.url, "int8", config.prefix) == (2, got.formats["int8"].bytes)
        assert not stores[1].contains("e" * 64) and stores[0].get_layer("e" * 64, 2) is not None
        assert set(redis_stats(server.url, config.prefix).formats) == {"float32"}
    finally:
        for store in stores:
            store.close()


def test_two_processes_with_separate_disks_share_chunks_through_redis(server, tmp_path, clean):
    prefix = f"test{uuid.uuid4().hex[:8]}"
    first = _worker(server, prefix, tmp_path / "a")
    second = _worker(server, prefix, tmp_path / "b")  # its own, empty disk store
    assert first["tiers"] == second["tiers"] == ["memory", "disk", "redis"]
    assert (first["hits"], first["misses"]) == (0, len(CHUNKS))
    # Every chunk came from Redis: none computed, nothing on the second process's disk.
    assert (second["hits"], second["misses"], second["miss_compute_s"]) == (len(CHUNKS), 0, 0.0)
    assert second["tier_hits"]["redis"] > 0 and second["tier_hits"]["disk"] == 0
    assert second["token_ids"] == first["token_ids"] == clean[0].token_ids
    torch.testing.assert_close(torch.tensor(second["logits"]), torch.tensor(first["logits"]), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ 2. Redis killed mid-request


class KillsRedisAt:
    """Wraps the Redis store and kills the server just before one layer's read."""

    def __init__(self, inner: RedisStore, server: RedisServer, layer: int) -> None:
        self.inner, self.server, self.layer, self.fired = inner, server, layer, False

    def get_layers(self, keys, layer, device=None):
        if layer == self.layer and not self.fired:
            self.fired = True
            self.server.stop()
        return self.inner.get_layers(keys, layer, device)

    def get_layer(self, key, layer, device=None):
        return self.get_layers([key], layer, device)[0]

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("below", [None, "disk"])
def test_redis_killed_between_layers_still_answers_correctly(tokenizer, tmp_path, own_server, clean, caplog, below):
    redis_store = RedisStore(_config(own_server.url))
    tiers = [Tier(redis_store, "redis")] + ([Tier(KVStore(tmp_path / "kv"), "disk")] if below else [])
    store = TieredStore(tiers, cooldown_s=60)
    eng = _engine(tokenizer, store, pipelined=True)
    eng.precompute(CHUNKS, progress=False)  # into Redis (and the disk below it)
    store.tiers[0].store = KillsRedisAt(redis_store, own_server, layer=2)
    with caplog.at_level(logging.WARNING):
        res = eng.generate(Q, CHUNKS, max_new_tokens=5)
    assert store.tiers[0].store.fired and own_server.proc is None
    assert res.token_ids == clean[0].token_ids
    assert store.stats.fallbacks >= 1 and "'redis' failed" in caplog.text
    if below:  # the disk served every chunk: nothing recomputed
        assert res.stats["chunk_hits"] == len(CHUNKS) and store.stats.tier_hits["disk"] > 0
    else:  # no other tier: the chunks were recomputed
        assert res.stats["chunk_misses"] == len(CHUNKS)
    torch.testing.assert_close(eng.next_token_logits(Q, CHUNKS), clean[1], rtol=1e-5, atol=1e-6)
    eng.close()


def test_redis_down_at_open_warns_and_the_engine_answers(tokenizer, tmp_path, clean, caplog):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with caplog.at_level(logging.WARNING):
        store = open_store(url, directory=str(tmp_path / "kv"), size_limit=2**30, fingerprint="", memory_bytes=2**20)
    assert "is not reachable" in caplog.text and "recomputed until it answers" in caplog.text
    assert [t.name for t in store.tiers] == ["memory", "redis"]
    eng = _engine(tokenizer, store)
    res = eng.generate(Q, CHUNKS, max_new_tokens=5)
    assert res.token_ids == clean[0].token_ids and store.stats.fallbacks >= 1
    eng.close()


def test_hung_redis_times_out_and_falls_back(tokenizer, own_server, clean, monkeypatch, caplog):
    redis_store = RedisStore(_config(own_server.url))  # 0.5 s socket timeout
    store = TieredStore([Tier(redis_store, "redis")], cooldown_s=5.0)
    eng = _engine(tokenizer, store)
    eng.precompute(CHUNKS, progress=False)
    eng.flush()
    # Every request to Redis, counted: after one read waits out the socket timeout the tier is
    # benched, so a hung server costs one timeout per cool-down, not one per chunk and layer.
    asked: list[str] = []  # the store methods called from outside it (contains calls meta: one)
    inside = threading.local()

    def counted(name, method):
        def call(*args, **kwargs):
            if not getattr(inside, "depth", 0):
                asked.append(name)
            inside.depth = getattr(inside, "depth", 0) + 1
            try:
                return method(*args, **kwargs)
            finally:
                inside.depth -= 1

        return call

    for name in ("contains", "meta", "get_layer", "get_layers", "put", "discard"):
        monkeypatch.setattr(redis_store, name, counted(name, getattr(redis_store, name)))
    # The cool-down runs on the tiers' clock, moved past it below instead of sleeping through it.
    ahead = [0.0]
    monkeypatch.setattr(tiers_module, "time", SimpleNamespace(monotonic=lambda: time.monotonic() + ahead[0]))
    os.kill(own_server.proc.pid, signal.SIGSTOP)  # accepts connections, answers nothing
    try:
        with caplog.at_level(logging.WARNING, logger="cacheblend_rag"):
            res = eng.generate(Q, CHUNKS, max_new_tokens=5)
        assert res.token_ids == clean[0].token_ids and res.stats["chunk_misses"] == len(CHUNKS)
        assert len(asked) == 1 and store.stats.fallbacks == 1
        assert "Timeout" in caplog.text and "skipping it for 5s" in caplog.text
    finally:
        os.kill(own_server.proc.pid, signal.SIGCONT)
    eng.flush()  # the recomputed chunks' write-back skips the benched tier
    assert len(asked) == 1
    ahead[0] = store.cooldown_s  # past the cool-down: the tier is tried again and still holds the chunks
    res = _assert_same_answer(eng, clean)
    assert res.stats["chunk_hits"] == len(CHUNKS) and store.stats.tier_hits["redis"] > 0
    assert len(asked) > 1 and store.stats.fallbacks == 1
    eng.close()


# ------------------------------------------------------------------ 3. restart


def test_restarted_redis_is_reconnected_and_serves_again(tokenizer, own_server, clean):
    redis_store = RedisStore(_config(own_server.url))
    store = TieredStore([Tier(redis_store, "redis")], cooldown_s=0.2)
    eng = _engine(tokenizer, store)
    eng.precompute(CHUNKS, progress=False)
    assert _assert_same_answer(eng, clean).stats["chunk_hits"] == len(CHUNKS)

    own_server.stop()
    res = _assert_same_answer(eng, clean)  # down: recomputed, nothing raised
    assert res.stats["chunk_misses"] == len(CHUNKS) and store.stats.fallbacks >= 1

    own_server.start()  # same port, empty (no persistence)
    time.sleep(0.3)  # past the cool-down: the tier is tried again
    res = eng.generate(Q, CHUNKS, max_new_tokens=5)
    assert res.stats["chunk_misses"] == len(CHUNKS)  # reconnected; the restart lost the chunks
    eng.flush()  # the write-back refills Redis over the new connection
    hits_before = store.stats.tier_hits["redis"]
    res = _assert_same_answer(eng, clean)
    assert res.stats["chunk_hits"] == len(CHUNKS)
    assert store.stats.tier_hits["redis"] - hits_before >= len(CHUNKS) * eng.num_layers
    eng.close()


# ------------------------------------------------------------------ 4. damaged and foreign records


def test_corrupt_and_foreign_model_records_are_discarded_and_recomputed(tokenizer, server, clean, caplog):
    redis_store = RedisStore(_config(server.url))
    store = TieredStore([Tier(redis_store, "redis")])
    eng = _engine(tokenizer, store, pipelined=False)
    eng.precompute(CHUNKS, progress=False)
    keys = [eng.chunk_key(eng.prompts.chunk_segment(c)) for c in CHUNKS]
    client = redis_store.client
    # A flipped byte in chunk 0's layer 1 ...
    name = redis_store.record_name(keys[0], 1)
    blob = bytearray(client.get(name))
    blob[len(blob) // 2] ^= 0x40
    client.set(name, bytes(blob))
    # ... and chunk 2's layer 3 replaced by an intact record of the same shape made for another model.
    k, v = redis_store.get_layer(keys[2], 3)
    client.set(redis_store.record_name(keys[2], 3), encode_layer(k, v, "another-model", chunk=keys[2], layer=3))
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.store.redis_tier"):
        res = _assert_same_answer(eng, clean)
    assert redis_store.stats.corrupt == 2
    assert "checksum mismatch" in caplog.text and "fingerprint mismatch" in caplog.text
    assert res.stats["chunk_misses"] == 2  # the two damaged chunks were recomputed, the third loaded
    eng.flush()
    assert all(redis_store.contains(k) for k in keys)  # and written back whole
    eng.close()


def test_a_record_made_for_another_model_is_never_served(server):
    cfg = _config(server.url)
    mine, theirs = RedisStore(cfg, fingerprint="model-a"), RedisStore(cfg, fingerprint="model-b")
    assert theirs.put("k", _layers())
    assert not mine.contains("k") and mine.get_layer("k", 0) is None  # another namespace
    # Copied into this model's namespace, the meta record still names model b: refused at lookup.
    mine.client.set(mine.record_name("k"), theirs.client.get(theirs.record_name("k")))
    assert mine.meta("k") is None and mine.stats.corrupt == 1
    assert mine.client.get(mine.record_name("k")) is None  # discarded
    mine.close()
    theirs.close()


def test_a_layer_evicted_after_the_lookup_is_a_miss_and_drops_the_chunk(server):
    store = RedisStore(_config(server.url))
    store.put("k", _layers())
    store.client.delete(store.record_name("k", 1))  # what allkeys-lru does to one record
    assert store.get_layer("k", 0) is not None and store.get_layer("k", 1) is None
    assert not store.contains("k") and store.client.get(store.record_name("k", 0)) is None
    store.close()


def test_eviction_settings_are_checked_at_open(server, caplog):
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.store.redis_tier"):
        RedisStore(_config(server.url)).close()  # the test server runs with Redis's defaults
    assert "maxmemory=0 and maxmemory-policy=noeviction" in caplog.text and "allkeys-lru" in caplog.text


def test_an_lru_evicting_redis_keeps_answers_correct(tokenizer, tmp_path, clean, caplog):
    srv = RedisServer(tmp_path / "redis", "--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru").start()
    try:
        with caplog.at_level(logging.WARNING, logger="cacheblend_rag.store.redis_tier"):
            redis_store = RedisStore(_config(srv.url))
        assert "maxmemory" not in caplog.text  # configured as documented: no warning
        store = TieredStore([Tier(redis_store, "redis")])
        eng = _engine(tokenizer, store)
        filler = [f"Filler passage number {i} about rivers, towers and prizes." for i in range(40)]
        eng.precompute(CHUNKS + filler, progress=False)  # more than fits: Redis evicts records
        assert redis_store.client.info("stats")["evicted_keys"] > 0
        _assert_same_answer(eng, clean)
        eng.close()
    finally:
        srv.stop()


def test_a_full_redis_under_noeviction_refuses_writes_and_reads_go_on(tmp_path, caplog):
    srv = RedisServer(tmp_path / "redis", "--maxmemory", "1", "--maxmemory-policy", "noeviction").start()
    try:
        store = RedisStore(_config(srv.url))
        with caplog.at_level(logging.WARNING, logger="cacheblend_rag.store.redis_tier"):
            assert store.put("a", _layers()) is False and store.put("b", _layers()) is False
        assert store.stats.write_errors == 2 and caplog.text.count("refused to store chunk") == 1
        assert "maxmemory" in caplog.text
        # MULTI/EXEC: no layer of a refused chunk was written either.
        assert not store.client.exists(*(store.record_name("a", layer) for layer in (None, 0, 1, 2)))
        assert store.get_layers(["a", "b"], 0) == [None, None]
        store.close()
    finally:
        srv.stop()


# ------------------------------------------------------------------ 5. credentials


def test_wrong_password_is_a_clear_error_at_open(tmp_path):
    srv = RedisServer(tmp_path / "redis", "--requirepass", "s3cret-pw").start()
    try:
        for url in (f"redis://:wrong-pw@127.0.0.1:{srv.port}/0", srv.url, f"redis://nobody:s3cret-pw@127.0.0.1:{srv.port}/0"):
            with pytest.raises(RedisAuthError, match="refused the credentials") as err:
                open_store(url, directory=str(tmp_path / "kv"), size_limit=2**30, fingerprint="", memory_bytes=0)
            msg = str(err.value)
            assert f"127.0.0.1:{srv.port}/0" in msg and "redis://:PASSWORD@host:port/db" in msg
            assert "wrong-pw" not in msg and "s3cret" not in msg  # credentials never end up in logs
        good = RedisStore(_config(f"redis://:s3cret-pw@127.0.0.1:{srv.port}/0"))
        assert good.put("k", _layers()) and good.get_layer("k", 2) is not None
        good.close()
    finally:
        srv.stop()


def test_acl_user_with_the_documented_rules_can_use_the_store(server):
    cfg = _config(server.url)
    user = f"cb{uuid.uuid4().hex[:8]}"
    admin = redis.Redis.from_url(server.url)
    # The rule docs/sharing.md gives, for this test's prefix.
    admin.execute_command(
        "ACL",
        "SETUSER",
        user,
        "on",
        ">acl-pw",
        "resetkeys",
        f"~{cfg.prefix}:*",
        "+@read",
        "+@write",
        "+@keyspace",
        "+ping",
        "+multi",
        "+exec",
    )
    try:
        url = f"redis://{user}:acl-pw@127.0.0.1:{server.port}/0"
        store = RedisStore(RedisConfig(url, prefix=cfg.prefix))
        layers = _layers()
        assert store.put("k", layers) and store.contains("k")
        assert torch.equal(store.get_layers(["k"], 2)[0][0], layers[2][0])
        store.discard("k")
        assert not store.contains("k")
        store.close()
        with pytest.raises(RedisAuthError, match="ACL user and its password"):
            RedisStore(RedisConfig(f"redis://{user}:not-it@127.0.0.1:{server.port}/0", prefix=cfg.prefix))
    finally:
        admin.execute_command("ACL", "DELUSER", user)
        admin.close()


def _self_signed(directory: Path) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl not found: cannot make a certificate for the TLS test")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def test_tls_url_with_the_servers_ca_works(tmp_path, caplog):
    cert, key = _self_signed(tmp_path)
    srv = RedisServer(tmp_path / "redis")
    # TLS only: "--port 0" turns the plain port off, the test's port speaks TLS.
    srv.extra = (
        "--port",
        "0",
        "--tls-port",
        str(srv.port),
        "--tls-cert-file",
        str(cert),
        "--tls-key-file",
        str(key),
        "--tls-ca-cert-file",
        str(cert),
        "--tls-auth-clients",
        "no",
    )
    srv.start()
    try:
        store = RedisStore(_config(f"rediss://127.0.0.1:{srv.port}/0?ssl_ca_certs={cert}"))
        assert store.client.connection_pool.connection_class is redis.SSLConnection
        layers = _layers()
        assert store.put("k", layers) and torch.equal(store.get_layer("k", 1)[1], layers[1][1])
        store.close()
        # Without the CA the certificate does not verify: unreachable, a warning, no crash.
        with caplog.at_level(logging.WARNING, logger="cacheblend_rag.store.redis_tier"):
            RedisStore(_config(f"rediss://127.0.0.1:{srv.port}/0")).close()
        assert "is not reachable" in caplog.text and "certificate" in caplog.text.lower()
    finally:
        srv.stop()


def test_url_forms():
    tls = RedisStore(f"rediss://127.0.0.1:{free_port()}/0")  # nothing listens: a warning, no error
    assert tls.client.connection_pool.connection_class is redis.SSLConnection
    tls.close()
    with pytest.raises(ValueError, match="decode_responses"):
        RedisStore(f"redis://127.0.0.1:{free_port()}/0?decode_responses=True")
    with pytest.raises(ValueError, match="must start with redis://"):
        RedisConfig("http://127.0.0.1:6379")
    for bad in ("a:b", "a*", ""):
        with pytest.raises(ValueError, match="must be letters, digits"):
            RedisConfig("redis://127.0.0.1:6379/0", prefix=bad)
    with pytest.raises(ValueError, match="ttl_s=0"):
        RedisConfig("redis://127.0.0.1:6379/0", ttl_s=0)
    with pytest.raises(ValueError, match="unknown store 'memory'"):
        open_store(["memory"], directory="unused", size_limit=2**30, fingerprint="", memory_bytes=0)


def test_from_pretrained_store_forms(server, tmp_path, monkeypatch):
    from cacheblend_rag.model import loading as models
    from cacheblend_rag.model.fingerprint import model_fingerprint
    from cacheblend_rag.model.loading import LoadedModel
    from cacheblend_rag.testing import make_tokenizer

    def load_model(name, **kwargs):
        m, tok = make_model("llama"), make_tokenizer()
        return LoadedModel(m, tok, "tiny", model_fingerprint(m, tok))

    monkeypatch.setattr(models, "load_model", load_model)
    for spec, names in (
        (server.url, ["memory", "redis"]),
        (["disk", server.url], ["memory", "disk", "redis"]),
        ([server.url, server.url], ["memory", "redis", "redis2"]),
    ):
        eng = CacheBlendEngine.from_pretrained("tiny", cache_dir=str(tmp_path), store=spec)
        assert [t.name for t in eng.store.tiers] == names
        assert eng.store.tier("redis").store.fingerprint == eng.fingerprint
        eng.close()
    eng = CacheBlendEngine.from_pretrained("tiny", cache_dir=str(tmp_path), store=server.url, memory_bytes=0)
    assert [t.name for t in eng.store.tiers] == ["redis"]  # still tiered: an outage falls back to recompute
    eng.close()


def test_ttl_applies_to_every_record_of_a_chunk(server):
    store = RedisStore(_config(server.url, ttl_s=600))
    store.put("k", _layers())
    assert all(0 < store.client.ttl(store.record_name("k", layer)) <= 600 for layer in (None, 0, 1, 2))
    store.close()


@pytest.mark.parametrize(
    "field, bad, words",
    [
        ("ttl_s", 1.5, "whole number of seconds"),  # redis-py's SET EX takes only ints: every write failed
        ("ttl_s", 600.0, "whole number of seconds"),
        ("ttl_s", True, "whole number of seconds"),
        ("socket_timeout_s", 0, "positive number of seconds"),  # a non-blocking socket: reads fail at random
        ("connect_timeout_s", -1, "positive number of seconds"),  # redis-py's ValueError at open, from a socket
    ],
)
def test_bad_redis_options_are_refused_with_their_name(server, field, bad, words):
    with pytest.raises(ValueError, match=f"{field}={bad!r} must be a {words}"):
        RedisConfig(server.url, **{field: bad})


def test_clear_removes_only_this_models_records(server):
    cfg = _config(server.url)
    mine, theirs = RedisStore(cfg, fingerprint="model-a"), RedisStore(cfg, fingerprint="model-b")
    for i in range(3):
        mine.put(f"k{i}", _layers())
    theirs.put("k0", _layers())
    mine.clear()
    assert not any(mine.contains(f"k{i}") for i in range(3)) and theirs.contains("k0")
    left = sorted(mine.client.scan_iter(match=f"{cfg.prefix}:*"))
    assert left == sorted(theirs.record_name("k0", i).encode() for i in (None, 0, 1, 2))
    mine.close()
    theirs.close()


def test_profile_measures_a_redis_tier(server, tmp_path):
    from cacheblend_rag.control.profiler import default_tiers, measure_tier_read

    tiers = default_tiers(tmp_path / "kv", server.url)
    try:
        assert list(tiers) == ["memory", "disk", "redis"]
        got = measure_tier_read(tiers["redis"], num_layers=2, kv_shape=(2, 8), dtype=torch.float32, tokens=16, repeats=1)
        assert got.read_bytes_per_s > 0 and got.element_bytes == 4
        assert not tiers["redis"].client.keys("cacheblend-profile:*")  # the probe chunk is removed
    finally:
        for store in tiers.values():
            store.close()


def test_controller_profiles_and_prices_the_engines_redis_tier(tokenizer, server, tmp_path, monkeypatch):
    from cacheblend_rag.control.controller import LoadingController
    from cacheblend_rag.control.profiler import profile_engine

    monkeypatch.setenv("CACHEBLEND_RAG_HOME", str(tmp_path / "home"))
    redis_store = RedisStore(_config(server.url))
    eng = _engine(tokenizer, TieredStore([Tier(MemoryTier(), "memory"), Tier(redis_store, "redis")]))
    profile = profile_engine(eng, lengths=(16, 32), tier_tokens=16, repeats=1, fused_ratios=())
    assert {"memory", "disk", "redis"} <= set(profile.tiers) and profile.tiers["redis"].read_bytes_per_s > 0
    assert redis_store.client.ping()  # measured in place, not closed
    eng.precompute(CHUNKS, progress=False)
    eng.store.tier("memory").store.clear()  # every chunk now sits in Redis only
    eng.controller = LoadingController(profile)
    res = eng.generate(Q, CHUNKS, max_new_tokens=2)
    assert res.stats["controller_tier"] == "redis" and res.stats["chunk_hits"] == len(CHUNKS)
    eng.close()


# ------------------------------------------------------------------ 6. the batched per-layer read


def test_batched_layer_read_equals_per_key_reads(server):
    store = RedisStore(_config(server.url))
    chunks = {f"c{i}": _layers(tokens=3 + i, seed=i) for i in range(3)}
    for key, layers in chunks.items():
        assert store.put(key, layers)
    keys = ["c0", "absent", "c2", "c1", "c0"]
    mem = MemoryTier()
    mem.put("c1", chunks["c1"])  # a tiered read serves c1 from memory and the rest from Redis
    tiered = TieredStore([Tier(mem, "memory"), Tier(store, "redis")], promote=False)
    for layer in range(3):
        single = [store.get_layer(k, layer) for k in keys]
        for batch in (store.get_layers(keys, layer), tiered.get_layers(keys, layer)):
            assert len(batch) == len(single)
            for a, b in zip(batch, single):
                assert (a is None) == (b is None)
                if a is not None:
                    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for key in chunks:  # and both are the chunk as written
            torch.testing.assert_close(store.get_layer(key, layer)[1], chunks[key][layer][1], rtol=0, atol=0)
    assert store.get_layers([], 0) == [] and tiered.stats.tier_hits["memory"] == 3
    with pytest.raises(IndexError, match="layer 3 out of range"):
        store.get_layers(["c0"], 3)
    store.close()


def test_the_loader_reads_each_layer_of_all_chunks_in_one_round_trip(tokenizer, server):
    redis_store = RedisStore(_config(server.url))
    eng = _engine(tokenizer, TieredStore([Tier(redis_store, "redis")]), pipelined=False)
    eng.precompute(CHUNKS, progress=False)
    layout = eng.build_layout(Q, CHUNKS)

    def mgets() -> int:
        return redis_store.client.info("commandstats").get("cmdstat_mget", {}).get("calls", 0)

    before = mgets()
    res = eng.prefill(layout, "full_reuse")
    assert res.stats["chunk_hits"] == len(CHUNKS)
    # One MGET looks every chunk up (store.lookup), then the prefix and every chunk: one MGET per layer.
    assert mgets() - before == 1 + eng.num_layers
    eng.close()
