"""The loading controller's choices on synthetic profiles, its persistence, and its engine wiring."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from cacheblend_rag import BlendConfig, CacheBlendEngine
from cacheblend_rag.cli import build_parser
from cacheblend_rag.controller import DeviceProfile, LoadingController, TierProfile
from cacheblend_rag.kv_store import KVStore
from cacheblend_rag.profile import measure_tier, profile_engine
from cacheblend_rag.testing import make_model
from cacheblend_rag.tiers import MemoryTier, ThrottledStore

MB = 1e6
KV_VALUES = 1000  # K+V elements per token over all layers -> 4000 bytes/token in fp32


def synthetic(**tiers: TierProfile) -> DeviceProfile:
    # Full prefill: 1 s per 1000 tokens up to 1000, then 1.5 s per 1000 (attention grows).
    return DeviceProfile(
        model_id="synthetic", fingerprint="f" * 40, device="cpu-2t", dtype="float32", num_layers=10,
        kv_values_per_token=KV_VALUES, prefill_points=[(1000, 1.0), (2000, 2.5)], tiers=dict(tiers),
    )


TIERS = dict(
    memory=TierProfile(read_bytes_per_s=10_000 * MB, cost_per_byte=1.0),
    ssd=TierProfile(read_bytes_per_s=1_000 * MB, cost_per_byte=0.1),
    slow=TierProfile(read_bytes_per_s=10 * MB, cost_per_byte=0.01),
)


def test_prefill_cost_interpolates_and_extrapolates():
    p = synthetic()
    assert p.prefill_s(500) == pytest.approx(0.5)
    assert p.prefill_s(1500) == pytest.approx(1.75)
    assert p.prefill_s(3000) == pytest.approx(4.0)  # the last segment's slope
    assert p.prefill_s_per_layer(1000) == pytest.approx(0.1)
    assert p.prefill_s(0) == 0.0


def test_fast_tier_gets_the_quality_floor():
    ctl = LoadingController(synthetic(**TIERS))
    # 1000 tokens x 4000 B = 4 MB from RAM at 10 GB/s = 0.4 ms, vs 1 s of full prefill.
    assert ctl.load_delay("memory", 1000) == pytest.approx(4e-4)
    assert ctl.ratio_for(1000, "memory") == 0.15
    assert LoadingController(synthetic(**TIERS), quality_floor=0.05).ratio_for(1000, "memory") == 0.05


def test_slow_tier_gets_the_equal_delay_ratio():
    ctl = LoadingController(synthetic(**TIERS))
    # 4 MB at 10 MB/s = 0.4 s of load; recompute of r x 1 s equals it at r = 0.4.
    assert ctl.ratio_for(1000, "slow") == pytest.approx(0.4)
    assert ctl.recompute_delay(0.4, 1000) == pytest.approx(ctl.load_delay("slow", 1000))
    # 2000 tokens: 0.8 s of load against 2.5 s of prefill.
    assert ctl.ratio_for(2000, "slow") == pytest.approx(0.32)
    # Slower still: capped at a full recompute (or at max_ratio).
    assert ctl.ratio_for(1000, load_s=5.0) == 1.0
    assert LoadingController(synthetic(**TIERS), max_ratio=0.5).ratio_for(1000, load_s=5.0) == 0.5


def test_cheapest_tier_that_still_hides_the_load():
    ctl = LoadingController(synthetic(**TIERS))
    # At r=0.15 of 1000 tokens (0.15 s) memory and ssd hide their load, slow (0.4 s) does not.
    assert ctl.tiers_that_hide(0.15, 1000) == ["memory", "ssd"]
    assert ctl.cheapest_tier(0.15, 1000) == "ssd"
    # At r=0.4 the slow, cheapest tier becomes free.
    assert ctl.cheapest_tier(0.4, 1000) == "slow"
    # Nothing hides a load when nothing is recomputed.
    assert ctl.cheapest_tier(0.0, 1000) is None


def test_decide_mixes_tiers_and_ignores_recomputed_chunks():
    ctl = LoadingController(synthetic(**TIERS))
    d = ctl.decide(1000, {"slow": 500, "memory": 300})
    assert d.tier == "slow" and d.loaded_tokens == 800
    assert d.est_load_s == pytest.approx(ctl.load_delay("slow", 500) + ctl.load_delay("memory", 300))
    assert d.ratio == pytest.approx(d.est_load_s / 1.0)
    assert d.as_stats()["controller_ratio"] == d.ratio
    nothing = ctl.decide(1000, {})
    assert nothing.ratio == 0.15 and nothing.tier is None and nothing.est_load_s == 0


def test_user_estimators_override_the_papers():
    # Recompute cost that grows with r^2 (say, attention-bound): equal delay at sqrt(load / 2).
    ctl = LoadingController(
        synthetic(**TIERS), recompute_delay=lambda r, n: 2.0 * r * r, load_delay=lambda tier, n: 0.5
    )
    assert ctl.ratio_for(1000, "anything") == pytest.approx(0.5, abs=1e-6)
    assert ctl.equal_delay_ratio(1000, 0.02) == pytest.approx(0.1, abs=1e-6)


def test_profile_round_trips_and_checks_its_version(tmp_path):
    p = synthetic(**TIERS)
    path = p.save(tmp_path / "sub" / "profile.json")
    q = DeviceProfile.load(path)
    assert q == p and q.tiers["slow"].read_bytes_per_s == 10 * MB
    path.write_text(path.read_text().replace('"version": 1', '"version": 99'))
    with pytest.raises(ValueError, match="re-run `cacheblend-rag profile`"):
        DeviceProfile.load(path)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="quality_floor"):
        LoadingController(synthetic(), quality_floor=0.8, max_ratio=0.5)
    with pytest.raises(KeyError, match="tier 'tape' is not in the profile"):
        LoadingController(synthetic(**TIERS)).load_delay("tape", 10)
    with pytest.raises(ValueError, match="prefill_points"):
        dataclasses.replace(synthetic(), prefill_points=[])


# ------------------------------------------------------------------------------ measuring


def test_measure_tier_sees_the_throttle():
    mem = MemoryTier()
    free, _ = measure_tier(mem, num_layers=2, kv_shape=(2, 8), dtype=torch.float32, tokens=64, repeats=1)
    capped, elem = measure_tier(ThrottledStore(mem, 2 * MB), num_layers=2, kv_shape=(2, 8), dtype=torch.float16, tokens=64, repeats=1)
    assert elem == 2 and capped <= 2 * MB < free
    assert len(mem) == 0  # the probe chunk is discarded


def test_profile_engine_measures_the_tiny_model(tokenizer, tmp_path):
    eng = CacheBlendEngine(make_model("llama"), tokenizer, store=KVStore(tmp_path / "kv"))
    p = profile_engine(eng, lengths=(16, 32, 5000), tiers={"memory": MemoryTier()}, tier_tokens=16, repeats=1)
    assert [n for n, _ in p.prefill_points] == [16, 32]  # 5000 exceeds the context window
    assert p.kv_values_per_token == 2 * eng.num_layers * eng.kv_shape[0] * eng.kv_shape[1]
    assert p.tiers["memory"].read_bytes_per_s > 0 and p.fingerprint == eng.fingerprint
    eng.close()


def test_cli_has_the_profile_and_bench_commands():
    parser = build_parser()
    assert parser.parse_args(["profile", "--out", "x.json"]).out == "x.json"
    assert parser.parse_args(["pipeline-bench", "--throttle-mbps", "80,20"]).throttle_mbps == [80.0, 20.0]


# ------------------------------------------------------------------------------ engine wiring

CHUNKS = [
    "The Eiffel Tower is in Paris, the capital of France.",
    "Marie Curie won two Nobel prizes, in physics and in chemistry.",
    "The river Thames flows through London and Oxford.",
]
Q = "Who won two Nobel prizes?"


def test_engine_asks_the_controller_when_no_ratio_is_given(tokenizer, tmp_path):
    eng = CacheBlendEngine(make_model("llama"), tokenizer, store=KVStore(tmp_path / "kv"), pipelined=False)
    eng.precompute(CHUNKS, progress=False)
    layout = eng.build_layout(Q, CHUNKS)
    n = layout.num_context_tokens
    # A disk so slow that the load of this context takes as long as recomputing 40% of it.
    prof = synthetic(disk=TierProfile(read_bytes_per_s=1.0))
    ctl = LoadingController(prof, load_delay=lambda tier, tokens: 0.4 * prof.prefill_s(n) * tokens / n)
    eng.controller = ctl
    res = eng.generate(Q, CHUNKS, max_new_tokens=3)
    assert res.stats["controller_ratio"] == pytest.approx(0.4) and res.stats["controller_tier"] == "disk"
    assert res.stats["recompute_ratio"] == pytest.approx(0.4)
    assert res.stats["recomputed_per_layer"][-1] >= math.ceil(0.4 * n)
    # Same fused result as asking for that ratio directly.
    direct = eng.prefill(layout, "cacheblend", BlendConfig(recompute_ratio=res.stats["controller_ratio"]))
    assert direct.stats["recomputed_per_layer"] == res.stats["recomputed_per_layer"]
    assert res.token_ids[0] == int(direct.logits.argmax())
    # An explicit ratio wins and the controller is not consulted.
    fixed = eng.generate(Q, CHUNKS, max_new_tokens=3, recompute_ratio=0.15)
    assert "controller_ratio" not in fixed.stats and fixed.stats["recompute_ratio"] == 0.15
    eng.close()


def test_controller_counts_only_cached_chunks_as_loads(tokenizer, tmp_path):
    eng = CacheBlendEngine(make_model("llama"), tokenizer, store=KVStore(tmp_path / "kv"))
    eng.controller = LoadingController(synthetic(**TIERS), load_delay=lambda tier, n: 1e9)
    cold = eng.generate(Q, CHUNKS, max_new_tokens=1)  # every chunk is computed, nothing loaded
    assert cold.stats["controller_ratio"] == 0.15 and cold.stats["controller_tier"] is None
    eng.flush()
    warm = eng.generate(Q, CHUNKS, max_new_tokens=1)
    assert warm.stats["controller_ratio"] == 1.0 and warm.stats["controller_tier"] == "disk"
    eng.close()
