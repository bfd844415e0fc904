"""The loading controller's choices on synthetic profiles, its persistence, and its engine wiring."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from functools import partial

import pytest
import torch

from cacheblend_bench import throttle as throttle_module
from cacheblend_bench.profile_cli import describe
from cacheblend_bench.throttle import ThrottledStore
from cacheblend_rag import BlendConfig, CacheBlendEngine
from cacheblend_rag.cli.app import build_parser
from cacheblend_rag.control import profiler as profile_module
from cacheblend_rag.control.controller import (
    DeviceProfile,
    FusedCost,
    LoadingController,
    TierProfile,
)
from cacheblend_rag.control.profiler import measure_fused, measure_tier_read, profile_engine
from cacheblend_rag.store.disk import KVStore
from cacheblend_rag.store.memory import MemoryTier
from cacheblend_rag.store.protocol import kv_bytes
from cacheblend_rag.testing import make_model

MB = 1e6
# Without the safety headroom: these tests check the equal-delay rule itself.
Exact = partial(LoadingController, headroom=1.0)
KV_VALUES = 1000  # K+V elements per token over all layers -> 4000 bytes/token in fp32


def synthetic(**tiers: TierProfile) -> DeviceProfile:
    # Full prefill: 1 s per 1000 tokens up to 1000, then 1.5 s per 1000 (attention grows).
    return DeviceProfile(
        model_id="synthetic",
        fingerprint="f" * 40,
        device="cpu-2t",
        dtype="float32",
        num_layers=10,
        kv_values_per_token=KV_VALUES,
        prefill_points=[(1000, 1.0), (2000, 2.5)],
        tiers=dict(tiers),
    )


TIERS = dict(
    memory=TierProfile(read_bytes_per_s=10_000 * MB, cost_per_byte=1.0),
    ssd=TierProfile(read_bytes_per_s=1_000 * MB, cost_per_byte=0.1),
    slow=TierProfile(read_bytes_per_s=10 * MB, cost_per_byte=0.01),
)

# The fused path measured 0.1 + 1.5 r of a full prefill (the paper assumes 0 + 1 r).
FUSED = FusedCost(fixed=0.1, per_ratio=1.5)


def calibrated(device: str = "cpu-2t", **tiers: TierProfile) -> DeviceProfile:
    return dataclasses.replace(synthetic(**tiers), fused=FUSED, device=device)


# A profile shaped like the pipeline benchmark's machine (docs/pipeline.md): SmolLM2-135M (30
# layers, 3 KV heads of 64), a ~1.8k-token context, a full prefill of a few seconds, a disk read
# that is all CPU, and throttled tiers doing the same CPU work plus sleeping. The inputs are a
# scenario; every expected value below is derived from them, not copied from the document.
BENCH_TOKENS = 1774
DISK_CPU = 1 / (400 * MB)


BENCH_FUSED = FusedCost(fixed=0.12, per_ratio=1.45)  # an assumed calibration: ~1.45x per recomputed token


def bench_profile(device: str = "cpu-2t", fused: FusedCost | None = BENCH_FUSED) -> DeviceProfile:
    return DeviceProfile(
        model_id="SmolLM2-135M",
        fingerprint="b" * 40,
        device=device,
        dtype="float32",
        num_layers=30,
        kv_values_per_token=2 * 30 * 3 * 64,
        prefill_points=[(BENCH_TOKENS, 5.7)],
        fused=fused,
        assemble_s_per_token=5e-6 if fused else None,
        tiers={
            "memory": TierProfile(read_bytes_per_s=60_000 * MB, cost_per_byte=1.0, cpu_s_per_byte=1 / (60_000 * MB)),
            "disk": TierProfile(read_bytes_per_s=400 * MB, cost_per_byte=0.1, cpu_s_per_byte=DISK_CPU),
            "throttled100": TierProfile(read_bytes_per_s=96 * MB, cost_per_byte=0.01, cpu_s_per_byte=DISK_CPU),
            "throttled20": TierProfile(read_bytes_per_s=20 * MB, cost_per_byte=0.01, cpu_s_per_byte=DISK_CPU),
        },
    )


def test_prefill_cost_interpolates_and_extrapolates():
    p = synthetic()
    assert p.prefill_s(500) == pytest.approx(0.5)
    assert p.prefill_s(1500) == pytest.approx(1.75)
    assert p.prefill_s(3000) == pytest.approx(4.0)  # the last segment's slope
    assert p.prefill_s(1000) / p.num_layers == pytest.approx(0.1)  # per layer
    assert p.prefill_s(0) == 0.0


def test_fast_tier_gets_the_quality_floor():
    ctl = Exact(synthetic(**TIERS))
    # 1000 tokens x 4000 B = 4 MB from RAM at 10 GB/s = 0.4 ms, vs 1 s of full prefill.
    assert ctl.load_delay("memory", 1000) == pytest.approx(4e-4)
    assert ctl.ratio_for(1000, "memory") == 0.15
    assert Exact(synthetic(**TIERS), quality_floor=0.05).ratio_for(1000, "memory") == 0.05


def test_slow_tier_gets_the_equal_delay_ratio():
    ctl = Exact(synthetic(**TIERS))
    # 4 MB at 10 MB/s = 0.4 s of load; recompute of r x 1 s equals it at r = 0.4.
    assert ctl.ratio_for(1000, "slow") == pytest.approx(0.4)
    assert ctl.recompute_delay(0.4, 1000) == pytest.approx(ctl.load_delay("slow", 1000))
    # 2000 tokens: 0.8 s of load against 2.5 s of prefill.
    assert ctl.ratio_for(2000, "slow") == pytest.approx(0.32)
    # Slower still: capped at a full recompute (or at max_ratio).
    assert ctl.ratio_for(1000, load_s=5.0) == 1.0
    assert Exact(synthetic(**TIERS), max_ratio=0.5).ratio_for(1000, load_s=5.0) == 0.5


def test_cheapest_tier_that_still_hides_the_load():
    ctl = Exact(synthetic(**TIERS))
    # At r=0.15 of 1000 tokens (0.15 s) memory and ssd hide their load, slow (0.4 s) does not.
    assert ctl.tiers_that_hide(0.15, 1000) == ["memory", "ssd"]
    assert ctl.cheapest_tier(0.15, 1000) == "ssd"
    # At r=0.4 the slow, cheapest tier becomes free.
    assert ctl.cheapest_tier(0.4, 1000) == "slow"
    # Nothing hides a load when nothing is recomputed.
    assert ctl.cheapest_tier(0.0, 1000) is None


def test_decide_mixes_tiers_and_ignores_recomputed_chunks():
    ctl = Exact(synthetic(**TIERS))
    d = ctl.decide(1000, {"slow": 500, "memory": 300})
    assert d.tier == "slow" and d.loaded_tokens == 800
    assert d.est_load_s == pytest.approx(ctl.load_delay("slow", 500) + ctl.load_delay("memory", 300))
    assert d.ratio == pytest.approx(d.est_load_s / 1.0)
    assert d.as_stats()["controller_ratio"] == d.ratio
    nothing = ctl.decide(1000, {})
    assert nothing.ratio == 0.15 and nothing.tier is None and nothing.est_load_s == 0


def test_user_estimators_override_the_papers():
    # Recompute cost that grows with r^2 (say, attention-bound): equal delay at sqrt(load / 2).
    ctl = Exact(synthetic(**TIERS), recompute_delay=lambda r, n: 2.0 * r * r, load_delay=lambda tier, n: 0.5)
    assert ctl.ratio_for(1000, "anything") == pytest.approx(0.5, abs=1e-6)
    assert ctl.equal_delay_ratio(1000, 0.02) == pytest.approx(0.1, abs=1e-6)


def test_profile_round_trips_and_checks_its_version(tmp_path):
    p = synthetic(**TIERS)
    path = p.save(tmp_path / "sub" / "profile.json")
    q = DeviceProfile.load(path)
    assert q == p and q.tiers["slow"].read_bytes_per_s == 10 * MB
    c = bench_profile()
    assert DeviceProfile.load(c.save(tmp_path / "cal.json")) == c  # the calibration survives the round trip
    assert '"version": 2' in path.read_text()
    path.write_text(path.read_text().replace('"version": 2', '"version": 99'))
    with pytest.raises(ValueError, match="re-run `cacheblend-rag profile"):
        DeviceProfile.load(path)


# A profile file as version 1 wrote it: no fused cost, no loader CPU costs.
OLD_PROFILE = {
    "model_id": "synthetic",
    "fingerprint": "f" * 40,
    "device": "cpu-2t",
    "dtype": "float32",
    "num_layers": 10,
    "kv_values_per_token": KV_VALUES,
    "prefill_points": [[1000, 1.0], [2000, 2.5]],
    "tiers": {
        "memory": {"read_bytes_per_s": 10_000 * MB, "cost_per_byte": 1.0, "element_bytes": 4},
        "slow": {"read_bytes_per_s": 10 * MB, "cost_per_byte": 0.01, "element_bytes": 4},
    },
    "meta": {"torch_threads": 2},
    "version": 1,
}


def test_old_profile_without_calibration_loads_and_uses_the_papers_estimator(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(OLD_PROFILE))
    p = DeviceProfile.load(path)
    assert p.fused is None and p.assemble_s_per_token is None and p.tiers["slow"].cpu_s_per_byte is None
    assert p.version == 1 and p.is_cpu
    ctl = Exact(p)
    assert not ctl.calibrated and ctl.cpu_contention == 1.0
    # Nothing measured about the loader's CPU: no contention, the paper's r x prefill, ratio 0.4.
    assert ctl.contention_delay("slow", 1000) == 0.0
    assert ctl.recompute_delay(0.4, 1000) == pytest.approx(0.4)
    assert ctl.ratio_for(1000, "slow") == pytest.approx(0.4)
    assert ctl.ratio_for(1000, "memory") == 0.15
    assert "not calibrated" in describe(p, lengths=(1000,))


def test_engine_warns_about_an_old_profile(tokenizer, tmp_path, caplog):
    eng = CacheBlendEngine(make_model("llama"), tokenizer, store=KVStore(tmp_path / "kv"))
    path = tmp_path / "old.json"
    path.write_text(json.dumps(dict(OLD_PROFILE, fingerprint=eng.fingerprint)))
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.control.controller"):
        ctl = LoadingController.for_engine(eng, path, measure=False)
    assert not ctl.calibrated and "no fused-cost calibration" in caplog.text
    # A calibration measured with other fusor/loader code is used, with a warning; current code: none.
    from cacheblend_rag.control.device_profile import fused_code_id

    for code, warns in (("0123456789abcdef", True), (fused_code_id(), False)):
        caplog.clear()
        prof = dataclasses.replace(calibrated(), fingerprint=eng.fingerprint, meta={"fused_calibration": {"code": code}})
        with caplog.at_level(logging.WARNING, logger="cacheblend_rag.control.controller"):
            ctl = LoadingController.for_engine(eng, prof.save(tmp_path / f"{code}.json"), measure=False)
        assert ctl.calibrated and ("other fusor/loader code" in caplog.text) == warns
        assert ("WARNING: calibrated against another version" in describe(prof, lengths=(1000,))) == warns
    eng.close()


# ------------------------------------------------------------------------------ calibration


def test_fused_cost_fit_recovers_the_line_and_refuses_nonsense():
    prefill = {1000: 2.0, 2000: 5.0}.__getitem__
    pts = [(1000, r, (0.2 + 1.6 * r) * 2.0) for r in (0.15, 0.5)] + [(2000, 1.0, 1.8 * 5.0)]
    f = FusedCost.fit(pts, prefill)
    assert f.fixed == pytest.approx(0.2) and f.per_ratio == pytest.approx(1.6)
    assert f.share(0.5) == pytest.approx(1.0) and len(f.points) == 3 and f.points[0][3] == 2.0
    # A negative intercept is clamped to 0 and the slope refitted through the origin.
    g = FusedCost.fit([(1000, 0.2, 0.2), (1000, 1.0, 2.4)], prefill)  # shares 0.1 and 1.2
    assert g.fixed == 0.0 and g.per_ratio == pytest.approx((0.2 * 0.1 + 1.0 * 1.2) / (0.04 + 1.0))
    with pytest.raises(ValueError, match="two distinct ratios"):
        FusedCost.fit([(1000, 0.5, 1.0), (1000, 0.5, 1.1)], prefill)
    with pytest.raises(ValueError, match="does not grow"):
        FusedCost.fit([(1000, 0.15, 2.0), (1000, 1.0, 1.0)], prefill)
    with pytest.raises(ValueError, match="per_ratio > 0"):
        FusedCost(fixed=0.1, per_ratio=0.0)


def test_calibrated_fast_tier_still_gets_the_floor():
    ctl = Exact(calibrated(**TIERS))
    assert ctl.calibrated
    assert ctl.ratio_for(1000, "memory") == 0.15 and ctl.ratio_for(1000, "ssd") == 0.15
    assert ctl.decide(1000, {}).ratio == 0.15


def test_calibrated_slow_tier_never_gets_a_ratio_whose_recompute_exceeds_the_load():
    ctl = Exact(calibrated(**TIERS))
    # 0.4 s of load against (0.1 + 1.5 r) x 1 s: equal at r = 0.2, not the paper's 0.4.
    assert ctl.recompute_delay(0.4, 1000) == pytest.approx(0.7)
    assert ctl.ratio_for(1000, "slow") == pytest.approx(0.2)
    assert ctl.recompute_delay(0.2, 1000) == pytest.approx(ctl.load_delay("slow", 1000))
    # Still a larger, free ratio than the floor for a slow tier, and still capped.
    assert ctl.ratio_for(1000, load_s=0.5) == pytest.approx(0.4 / 1.5)
    assert ctl.ratio_for(1000, load_s=5.0) == 1.0
    # A load shorter than the fixed part alone hides nothing: equal-delay ratio 0, the floor.
    assert ctl.equal_delay_ratio(1000, 0.05) == 0.0 and ctl.ratio_for(1000, load_s=0.05) == 0.15
    # Over a sweep of speeds and lengths: above the floor, recompute + contention <= load.
    for n in (300, 1000, 1700, 4000):
        for mbps in (1, 3, 10, 20, 50, 100, 1000):
            tiers = {"t": TierProfile(read_bytes_per_s=mbps * MB, cpu_s_per_byte=1 / (400 * MB))}
            for device in ("cpu-2t", "cuda-H100"):
                c = Exact(dataclasses.replace(calibrated(device=device), tiers=tiers))
                d = c.decide(n, {"t": n})
                if d.ratio > c.quality_floor:
                    assert d.est_recompute_s + d.est_contention_s <= d.est_load_s * (1 + 1e-9), (n, mbps, device, d)
                if d.ratio < c.max_ratio:  # not capped: nothing larger would still hide
                    assert c.recompute_delay(d.ratio + 0.01, n) + d.est_contention_s > d.est_load_s or d.ratio == c.quality_floor


def test_throttled_tier_of_the_benchmark():
    """The regression docs/pipeline.md reports: on a 20 MB/s tier the uncalibrated controller chose
    the paper's equal-delay ratio, and the recompute took longer than the load it was to hide."""
    n, old = BENCH_TOKENS, Exact(bench_profile(fused=None), cpu_contention=0)  # the controller before
    prof = old.profile
    load = old.load_delay("throttled20", n)
    assert load == pytest.approx(n * prof.kv_values_per_token * 4 / (20 * MB))  # fp32 K/V at 20 MB/s
    # The regression, reproduced: the paper's r x prefill = load, a ratio far above the floor.
    paper_ratio = load / prof.prefill_s(n)
    assert old.ratio_for(n, "throttled20") == pytest.approx(paper_ratio) and paper_ratio > 0.5
    ctl = Exact(bench_profile())
    assert ctl.calibrated
    d = ctl.decide(n, {"throttled20": n})
    assert d.ratio < 0.5 and d.ratio > ctl.quality_floor
    assert d.est_recompute_s + d.est_contention_s == pytest.approx(load)  # equal delay, contention included
    assert ctl.recompute_delay(paper_ratio, n) > load  # what that ratio really costs: longer than the load
    # Memory, disk and the 100 MB/s tier: the floor, as measured.
    for tier in ("memory", "disk", "throttled100"):
        assert ctl.ratio_for(n, tier) == 0.15, tier
    # At the floor the 100 MB/s tier's load hides; the 20 MB/s tier's does not (0.22 s fixed + r).
    assert ctl.cheapest_tier(0.15, n) == "throttled100"
    assert ctl.cheapest_tier(d.ratio, n) in ("throttled100", "throttled20")


def test_cpu_contention_rule():
    n = BENCH_TOKENS
    cpu, gpu = Exact(bench_profile("cpu-2t")), Exact(bench_profile("cuda-NVIDIA_H200"))
    assert cpu.cpu_contention == 1.0 and gpu.cpu_contention == 0.0
    # The loader's CPU time on the 20 MB/s tier: the disk read's CPU plus the assembly.
    want = cpu.profile.kv_bytes(n, "throttled20") * DISK_CPU + cpu.profile.assemble_s_per_token * n
    assert cpu.contention_delay("throttled20", n) == pytest.approx(want, rel=1e-9)
    assert gpu.contention_delay("throttled20", n) == 0.0
    r_cpu, r_gpu = cpu.ratio_for(n, "throttled20"), gpu.ratio_for(n, "throttled20")
    assert r_cpu < r_gpu
    assert cpu.recompute_delay(r_cpu, n) == pytest.approx(cpu.load_delay("throttled20", n) - want)
    # Overridable: off (0) behaves like an accelerator, a larger factor lowers the ratio further.
    assert Exact(bench_profile("cpu-2t"), cpu_contention=0).ratio_for(n, "throttled20") == pytest.approx(r_gpu)
    assert Exact(bench_profile("cpu-2t"), cpu_contention=3).ratio_for(n, "throttled20") < r_cpu
    # A tier whose read is all CPU (slow, but no waiting) hides nothing on a CPU: the floor.
    busy = {"busy": TierProfile(read_bytes_per_s=10 * MB, cpu_s_per_byte=1 / (10 * MB))}
    assert Exact(calibrated("cpu-2t", **busy)).ratio_for(1000, "busy") == 0.15
    assert Exact(calibrated("cuda-x", **busy)).ratio_for(1000, "busy") == pytest.approx(0.2)
    assert Exact(calibrated("cpu-2t", **busy)).tiers_that_hide(0.15, 1000) == ["busy"]
    # A custom loader CPU estimate replaces the profile's.
    ctl = Exact(calibrated("cpu-2t", **TIERS), loader_cpu=lambda tier, tokens: 0.05)
    assert ctl.ratio_for(1000, "slow") == pytest.approx((0.35 - 0.1) / 1.5)
    d = ctl.decide(1000, {"slow": 500, "ssd": 500})
    assert d.est_contention_s == pytest.approx(0.1) and d.as_stats()["controller_est_contention_s"] == d.est_contention_s
    with pytest.raises(ValueError, match="cpu_contention"):
        Exact(calibrated(), cpu_contention=-1)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="quality_floor"):
        Exact(synthetic(), quality_floor=0.8, max_ratio=0.5)
    with pytest.raises(KeyError, match="tier 'tape' is not in the profile"):
        Exact(synthetic(**TIERS)).load_delay("tape", 10)
    with pytest.raises(ValueError, match="prefill_points"):
        dataclasses.replace(synthetic(), prefill_points=[])


# ------------------------------------------------------------------------------ measuring


class Clock:
    """The ``time`` that profile and the throttle see: it moves only by sleeps and by CPU charged
    by a read, so a measurement is exact instead of depending on how busy this machine is."""

    time_ns = staticmethod(time.time_ns)

    def __init__(self):
        self.wall = self.cpu = 0.0

    def perf_counter(self):
        return self.wall

    def process_time(self):
        return self.cpu

    def sleep(self, seconds):
        self.wall += seconds

    def charge(self, seconds):
        self.wall += seconds
        self.cpu += seconds


class CpuStore:
    """A store whose read is CPU work: ``s_per_byte`` CPU seconds for each byte it returns."""

    def __init__(self, inner, clock, s_per_byte):
        self.inner, self.clock, self.s_per_byte = inner, clock, s_per_byte

    def get_layer(self, key, layer, device=None):
        kv = self.inner.get_layer(key, layer, device=device)
        if kv is not None:
            self.clock.charge(kv_bytes(*kv) * self.s_per_byte)
        return kv

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(profile_module, "time", c)
    monkeypatch.setattr(throttle_module, "time", c)
    return c


def test_measure_tier_sees_the_throttle(clock):
    mem = MemoryTier()
    free = measure_tier_read(
        CpuStore(mem, clock, DISK_CPU), num_layers=2, kv_shape=(2, 8), dtype=torch.float32, tokens=64, repeats=1
    )
    assert free.read_bytes_per_s == pytest.approx(1 / DISK_CPU) and free.element_bytes == 4
    slow = measure_tier_read(
        ThrottledStore(CpuStore(mem, clock, DISK_CPU), 2 * MB),
        num_layers=2,
        kv_shape=(2, 8),
        dtype=torch.float16,
        tokens=64,
        repeats=1,
    )
    assert slow.element_bytes == 2 and slow.read_bytes_per_s == pytest.approx(2 * MB)
    assert len(mem) == 0  # the probe chunk is discarded


def test_measure_tier_counts_cpu_not_waiting(clock):
    # A throttled read does the disk's CPU work, then sleeps out the rest: the sleep is not CPU
    # the compute loses, so the CPU cost per byte is the disk's, not 1 / the throttled rate.
    r = measure_tier_read(
        ThrottledStore(CpuStore(MemoryTier(), clock, DISK_CPU), 2 * MB),
        num_layers=2,
        kv_shape=(2, 8),
        dtype=torch.float16,
        tokens=256,
        repeats=2,
    )
    assert r.read_bytes_per_s == pytest.approx(2 * MB) and r.element_bytes == 2
    assert r.cpu_s_per_byte == pytest.approx(DISK_CPU)
    # A read that is all CPU work costs, per byte, exactly the inverse of its rate.
    busy = measure_tier_read(
        CpuStore(MemoryTier(), clock, DISK_CPU), num_layers=2, kv_shape=(2, 8), dtype=torch.float32, tokens=64, repeats=1
    )
    assert busy.cpu_s_per_byte * busy.read_bytes_per_s == pytest.approx(1.0)


def test_profile_engine_measures_the_tiny_model(tokenizer, tmp_path, monkeypatch):
    import cacheblend_rag.control.profiler as prof

    eng = CacheBlendEngine(make_model("llama"), tokenizer, store=KVStore(tmp_path / "kv"))
    p = profile_engine(eng, lengths=(16, 32, 5000), tiers={"memory": MemoryTier()}, tier_tokens=16, repeats=1, fused_tokens=48)
    assert [n for n, _ in p.prefill_points] == [16, 32]  # 5000 exceeds the context window
    assert p.kv_values_per_token == 2 * eng.num_layers * eng.kv_shape[0] * eng.kv_shape[1]
    assert p.tiers["memory"].read_bytes_per_s > 0 and p.fingerprint == eng.fingerprint
    assert p.tiers["memory"].cpu_s_per_byte is not None and p.assemble_s_per_token > 0
    # The fused calibration ran at 48 context tokens. On a 64-wide model its slope is noise, so
    # whether the fit is kept depends on the machine; either way the profile must say which.
    cal = p.meta["fused_calibration"]
    assert cal["criterion"] == eng.config.criterion and cal["chunks"] == 4 and cal["tokens"] == 48
    assert (p.fused is None) == ("rejected" in cal)
    assert DeviceProfile.from_json(p.to_json()) == p
    # A measurement that shrinks as more is recomputed is rejected: the points are kept in meta
    # and the controller falls back to the paper's estimator.
    noise = prof.FusedMeasurement([(32, r, (1.0 - 0.5 * r) * 0.02) for r in (0.15, 0.5, 1.0)], 1e-6, 4)
    monkeypatch.setattr(prof, "measure_fused", lambda engine, **kw: noise)
    rejected = profile_engine(eng, lengths=(16, 32), tiers={}, repeats=1)
    assert rejected.fused is None and rejected.meta["fused_calibration"]["rejected"] == [list(pt) for pt in noise.points]
    monkeypatch.undo()
    # The fit and its storage, on a measurement that grows with the ratio as a real model's does.
    fake = prof.FusedMeasurement([(32, r, (0.2 + 1.5 * r) * 0.02) for r in (0.15, 0.5, 1.0)], 1e-6, 4)
    monkeypatch.setattr(prof, "measure_prefill", lambda engine, lengths, repeats: [(16, 0.01), (32, 0.02)])
    monkeypatch.setattr(prof, "measure_fused", lambda engine, **kw: fake)
    q = profile_engine(eng, lengths=(16, 32), tiers={}, repeats=1)
    assert q.fused.fixed == pytest.approx(0.2) and q.fused.per_ratio == pytest.approx(1.5)
    assert q.assemble_s_per_token == 1e-6 and DeviceProfile.from_json(q.to_json()) == q
    assert "fused prefill = (0.200 + 1.500 x r)" in describe(q, lengths=(32,))
    skipped = profile_engine(eng, lengths=(16,), tiers={}, repeats=1, fused_ratios=())
    assert skipped.fused is None and skipped.assemble_s_per_token is None
    eng.close()


def test_measure_fused_times_the_engines_cacheblend_mode(tokenizer, tmp_path):
    eng = CacheBlendEngine(make_model("llama"), tokenizer, store=KVStore(tmp_path / "kv"))
    store = eng.store
    m = measure_fused(eng, tokens=64, ratios=(1.0, 0.2), chunks=3, repeats=1)
    assert m.chunks == 3 and [(n, r) for n, r, _ in m.points] == [(64, 0.2), (64, 1.0)]
    assert all(s > 0 for _, _, s in m.points) and m.assemble_s_per_token > 0
    assert eng.store is store  # the engine's own store is back
    # Clipped to the context window (prefix and question included).
    big = measure_fused(eng, tokens=10_000, ratios=(0.5,), chunks=2, repeats=1)
    assert big.points[0][0] < eng.context_window
    with pytest.raises(ValueError, match="ratios"):
        measure_fused(eng, ratios=(1.5,))
    eng.close()


def test_cli_has_the_profile_and_bench_commands():
    parser = build_parser()
    assert parser.parse_args(["profile", "--out", "x.json"]).out == "x.json"
    assert parser.parse_args(["pipeline-bench", "--throttle-mbps", "80,20"]).throttle_mbps == [80.0, 20.0]
    assert parser.parse_args(["pipeline-bench", "--cpu-contention", "0"]).cpu_contention == 0.0
    assert parser.parse_args(["pipeline-bench"]).cpu_contention is None
    assert parser.parse_args(["profile"]).fused_ratios == (0.15, 0.3, 0.5)
    assert parser.parse_args(["profile", "--fused-ratios", "none"]).fused_ratios == ()
    assert parser.parse_args(["profile", "--fused-ratios", "0.2,1", "--fused-tokens", "512"]).fused_ratios == (0.2, 1.0)


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
    ctl = Exact(prof, load_delay=lambda tier, tokens: 0.4 * prof.prefill_s(n) * tokens / n)
    eng.controller = ctl
    res = eng.generate(Q, CHUNKS, max_new_tokens=3)
    assert res.stats["controller_ratio"] == pytest.approx(0.4) and res.stats["controller_tier"] == "disk"
    assert res.stats["controller_est_contention_s"] == 0.0  # nothing measured about the loader's CPU
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
    eng.controller = Exact(synthetic(**TIERS), load_delay=lambda tier, n: 1e9)
    cold = eng.generate(Q, CHUNKS, max_new_tokens=1)  # every chunk is computed, nothing loaded
    assert cold.stats["controller_ratio"] == 0.15 and cold.stats["controller_tier"] is None
    eng.flush()
    warm = eng.generate(Q, CHUNKS, max_new_tokens=1)
    assert warm.stats["controller_ratio"] == 1.0 and warm.stats["controller_tier"] == "disk"
    eng.close()


def test_headroom_keeps_the_chosen_recompute_under_the_load():
    prof = synthetic(**TIERS)
    exact, safe = Exact(prof), LoadingController(prof)  # default headroom 0.85
    assert safe.headroom == 0.85
    load = safe.load_delay("slow", 1000)
    assert safe.ratio_for(1000, "slow") < exact.ratio_for(1000, "slow")
    assert safe.recompute_delay(safe.ratio_for(1000, "slow"), 1000) == pytest.approx(0.85 * load)
    assert safe.ratio_for(1000, "memory") == 0.15  # a fast tier still gets the floor
    with pytest.raises(ValueError, match="headroom"):
        LoadingController(prof, headroom=0.0)
