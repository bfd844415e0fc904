"""The profiler: measures a model on a device for the loading controller (``device_profile``).

``cacheblend-rag profile`` (``bench/profile_cli.py``) runs it from the command line.

Measured, not assumed:

* full-prefill time at a few context lengths (best of ``repeats``, after a warm-up), which gives
  the prefill cost per token per layer the recompute estimator scales;
* each storage tier's layer-read throughput in bytes/s: a synthetic chunk with this model's K/V
  shape is written to the tier and read back layer by layer through its ``get_layer``, so decode,
  checksum and SQLite overheads count. The disk read follows the write, so the OS page cache is
  usually warm: this is the throughput of a recently written store, not of a cold SSD. The CPU
  time of those reads (process CPU time, so a tier's own read threads count; not the time spent
  waiting on I/O or a throttle) is kept per byte: on a CPU device it is what the loader takes away
  from the recompute;
* the CacheBlend fused prefill itself (``measure_fused``): the engine's ``cacheblend`` mode over
  random-token chunks precomputed into a memory tier, not overlapped with loading, at a few
  recompute ratios. A line (fixed + per_ratio x r) x full prefill is fitted to it (``FusedCost``),
  because the paper's r x full prefill under-predicts the fused path (first layers recompute every
  candidate, per-layer selection/mask/scatter overheads, each recomputed token attends over the
  whole prompt through an explicit mask). The same runs give the loader's assembly CPU cost per
  loaded token (cast, RoPE re-rotation, layout copy).

The profile is JSON, saved under ``<cache home>/profiles/<model fingerprint>-<device>.json`` and
reused by ``LoadingController.for_engine``.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cacheblend_rag.control.device_profile import DeviceProfile, FusedCost, TierProfile, device_tag, fused_code_id
from cacheblend_rag.store.spec import TIER_COSTS

__all__ = [
    "FusedMeasurement",
    "TierReading",
    "default_tiers",
    "engine_redis_tiers",
    "measure_fused",
    "measure_prefill",
    "measure_tier_read",
    "profile_engine",
]

log = logging.getLogger(__name__)

DEFAULT_LENGTHS = (128, 512, 1024, 2048)
DEFAULT_TIER_COSTS = TIER_COSTS  # relative price per stored byte (RAM, shared Redis RAM, SSD)
# The floor and two points above it, all below saturation: the first chunk sits behind the
# instruction exactly as cached and is never recomputed, so with c chunks any ratio above about
# 1 - 1/c recomputes the same tokens (measured: r=1.0 cost only 1.25x r=0.5 with 3 chunks, which
# bent a linear fit and made the controller under-predict recompute at r~0.7 by 35%).
DEFAULT_FUSED_RATIOS = (0.15, 0.3, 0.5)
DEFAULT_FUSED_TOKENS = 1024  # context tokens of the fused calibration (clipped to the window)


def _random_ids(engine, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    vocab = int(engine.model.config.vocab_size)
    return torch.randint(0, vocab, (1, n), generator=g).to(engine.device)


def _sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def measure_prefill(engine, lengths: Sequence[int] = DEFAULT_LENGTHS, repeats: int = 2) -> list[tuple[int, float]]:
    """(tokens, best full-prefill seconds) for each length that fits the context window."""
    lengths = sorted({n for n in lengths if 0 < n <= engine.context_window}) or [min(128, engine.context_window)]
    points = []
    with torch.inference_mode():
        engine.model(input_ids=_random_ids(engine, lengths[0]), use_cache=True, logits_to_keep=1)  # warm-up
        for n in lengths:
            ids = _random_ids(engine, n, seed=n)
            best = float("inf")
            for _ in range(repeats):
                _sync(engine)
                t0 = time.perf_counter()
                engine.model(input_ids=ids, use_cache=True, logits_to_keep=1)
                _sync(engine)
                best = min(best, time.perf_counter() - t0)
            points.append((n, best))
    return points


@dataclass
class TierReading:
    read_bytes_per_s: float
    element_bytes: int
    cpu_s_per_byte: float  # process CPU seconds per byte read (at most the wall time)


def measure_tier_read(
    store: Any,
    *,
    num_layers: int,
    kv_shape: tuple[int, int],
    dtype: torch.dtype,
    tokens: int = 512,
    repeats: int = 2,
    device: torch.device | str = "cpu",
) -> TierReading:
    """Read throughput, element size and CPU cost per byte of ``store``, from a synthetic chunk.

    The chunk is written with ``put``, read back layer by layer ``repeats`` times (the best time
    counts, with that pass's CPU time), then discarded. Goes through the store's own interface, so
    wrappers (throttling, tiers, casting) are measured as they behave. CPU time is the whole
    process's (a tier may read on its own threads), capped at the wall time.
    """
    heads, dim = kv_shape
    g = torch.Generator().manual_seed(1)
    layers = [
        (torch.randn(heads, tokens, dim, generator=g).to(dtype), torch.randn(heads, tokens, dim, generator=g).to(dtype))
        for _ in range(num_layers)
    ]
    key = f"profile-probe-{time.time_ns()}"
    if store.put(key, layers) is False:
        raise RuntimeError(f"could not write the profiling chunk to {store!r}")
    try:
        best, best_cpu, nbytes, elem = float("inf"), 0.0, 0, 0
        for _ in range(repeats):
            nbytes = 0
            c0, t0 = time.process_time(), time.perf_counter()
            for i in range(num_layers):
                got = store.get_layer(key, i, device=device)
                if got is None:
                    raise RuntimeError(f"{store!r} lost the profiling chunk while it was read")
                k, v = got
                nbytes += k.numel() * k.element_size() + v.numel() * v.element_size()
                elem = k.element_size()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if wall < best:
                best, best_cpu = wall, min(cpu, wall)
        return TierReading(nbytes / max(best, 1e-9), elem, best_cpu / max(nbytes, 1))
    finally:
        store.discard(key)


@dataclass
class FusedMeasurement:
    points: list[tuple[int, float, float]]  # (context tokens, ratio, best seconds of the fused prefill)
    assemble_s_per_token: float  # loader time per loaded token from a memory tier (cast, rotate, copy)
    chunks: int


def _calibration_layout(engine, tokens: int, chunks: int, seed: int = 7):
    """Prefix + ``chunks`` random-token chunks of ``tokens`` in all + a real question segment."""
    from cacheblend_rag.chat.prompt import PromptLayout, Segment

    p = engine.prompts
    q = p.question_text("Which of the documents above answers this?")
    question = Segment(q, p.encode(q), reusable=False)
    room = engine.context_window - len(p.prefix_ids) - len(question) - 1
    tokens = min(tokens, room)
    if tokens < 2:
        raise ValueError(f"the context window ({engine.context_window}) leaves no room for a calibration context")
    chunks = max(1, min(chunks, tokens // 2))
    ids = _random_ids(engine, tokens, seed=seed)[0].tolist()
    bounds = [round(i * tokens / chunks) for i in range(chunks + 1)]
    segs = tuple(
        Segment(f"<profile chunk {i}>", tuple(ids[a:b]), reusable=True) for i, (a, b) in enumerate(itertools.pairwise(bounds))
    )
    return PromptLayout((Segment(p.prefix_text, p.prefix_ids, reusable=False), *segs, question))


def measure_fused(
    engine,
    *,
    tokens: int = DEFAULT_FUSED_TOKENS,
    ratios: Sequence[float] = DEFAULT_FUSED_RATIOS,
    chunks: int = 4,
    repeats: int = 2,
) -> FusedMeasurement:
    """Time the engine's ``cacheblend`` prefill (its own ``BlendConfig`` at each ratio) over random
    chunks whose K/V sit in a fresh memory tier, not pipelined, best of ``repeats`` after a warm-up.

    The seconds counted are the prefill's wall time minus the loader's (which, from RAM, is the
    cast/re-rotate/copy assembly, reported per loaded token): everything the pipeline cannot hide.
    The engine reads and writes the memory tier for these prefills alone (``prefill(store=...)``).
    """
    from cacheblend_rag.store.memory import MemoryTier

    ratios = sorted({float(r) for r in ratios})
    if not ratios or any(not 0.0 <= r <= 1.0 for r in ratios):
        raise ValueError(f"calibration ratios must lie in [0, 1], got {ratios}")
    layout = _calibration_layout(engine, tokens, chunks)
    mem = MemoryTier(capacity_bytes=1 << 40)
    try:
        for seg in layout.segments:
            if seg.reusable:
                mem.put(engine.chunk_key(seg), engine.compute_chunk(seg))
        loaded = len(engine.prompts.prefix_ids) + layout.num_context_tokens  # prefix and chunks come from the tier

        def once(r: float) -> tuple[float, float]:
            _sync(engine)
            t0 = time.perf_counter()
            res = engine.prefill(layout, "cacheblend", engine.config.with_ratio(r), pipelined=False, store=mem)
            _sync(engine)
            wall = time.perf_counter() - t0
            if res.stats.get("chunk_misses"):
                raise RuntimeError("calibration chunks were not found in the memory tier")
            return wall - res.stats["load_s"], res.stats["load_s"]

        once(ratios[0])  # warm-up
        points, assemble = [], float("inf")
        for r in ratios:
            best = float("inf")
            for _ in range(repeats):
                comp, load = once(r)
                best, assemble = min(best, comp), min(assemble, load)
            points.append((layout.num_context_tokens, r, best))
        return FusedMeasurement(points, assemble / max(loaded, 1), len(layout.segments) - 2)
    finally:
        mem.close()


def default_tiers(directory: str | Path | None = None, redis_url: str | None = None) -> dict[str, Any]:
    """Fresh stores standing for the memory and disk tiers (the disk one in ``directory``, which
    should be on the filesystem the real store uses), and the Redis at ``redis_url`` if given.
    The caller closes them."""
    from cacheblend_rag.store.disk import KVStore
    from cacheblend_rag.store.memory import MemoryTier

    tiers: dict[str, Any] = {"memory": MemoryTier(), "disk": KVStore(directory)}
    if redis_url:
        from cacheblend_rag.store.redis_tier import RedisConfig, RedisStore

        tiers["redis"] = RedisStore(RedisConfig(redis_url, prefix="cacheblend-profile"))
    return tiers


def engine_redis_tiers(engine) -> dict[str, Any]:
    """The Redis tiers of ``engine``'s store by tier name, to be measured where they are: without
    them in the profile the controller cannot price a chunk found there."""
    from cacheblend_rag.store.redis_tier import RedisStore

    return {t.name: t.store for t in getattr(engine.store, "tiers", []) if isinstance(t.store, RedisStore)}


def profile_engine(
    engine,
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    tiers: Mapping[str, Any] | None = None,
    tier_costs: Mapping[str, float] | None = None,
    stored_dtype: torch.dtype | None = None,
    tier_tokens: int = 512,
    repeats: int = 2,
    fused_tokens: int = DEFAULT_FUSED_TOKENS,
    fused_ratios: Sequence[float] = DEFAULT_FUSED_RATIOS,
    fused_chunks: int = 4,
    redis_url: str | None = None,
) -> DeviceProfile:
    """Measure ``engine``'s model on its device, its fused prefill at ``fused_ratios`` (empty: skip
    the calibration) and the read throughput of ``tiers`` (name -> store; default: a memory tier, a
    disk store in a temporary directory under the cache home, the engine's own Redis tiers and, with
    ``redis_url``, that Redis)."""
    from cacheblend_rag.model.loading import default_cache_dir

    costs = {**DEFAULT_TIER_COSTS, **(tier_costs or {})}
    heads, dim = engine.kv_shape
    points = measure_prefill(engine, lengths, repeats)
    fused = (
        measure_fused(engine, tokens=fused_tokens, ratios=fused_ratios, chunks=fused_chunks, repeats=repeats)
        if fused_ratios
        else None
    )
    own = tiers is None
    tmp = None
    if own:
        home = default_cache_dir()
        home.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.TemporaryDirectory(prefix="profile-kv-", dir=home)
        created = default_tiers(tmp.name, redis_url)
        tiers = {**engine_redis_tiers(engine), **created}
    try:
        measured = {}
        for name, store in tiers.items():
            got = measure_tier_read(
                store,
                num_layers=engine.num_layers,
                kv_shape=engine.kv_shape,
                dtype=stored_dtype or engine.dtype,
                tokens=tier_tokens,
                repeats=repeats,
                device=engine.device,
            )
            measured[name] = TierProfile(
                read_bytes_per_s=got.read_bytes_per_s,
                cost_per_byte=costs.get(name, 1.0),
                element_bytes=got.element_bytes,
                cpu_s_per_byte=got.cpu_s_per_byte,
            )
    finally:
        if own:
            for store in created.values():  # not the engine's own tiers
                store.close()
            tmp.cleanup()
    profile = DeviceProfile(
        model_id=engine.model_id,
        fingerprint=engine.fingerprint,
        device=device_tag(engine.device),
        dtype=str(engine.dtype).removeprefix("torch."),
        num_layers=engine.num_layers,
        kv_values_per_token=2 * engine.num_layers * heads * dim,
        prefill_points=points,
        tiers=measured,
        meta={
            "torch_threads": torch.get_num_threads(),
            "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "tier_tokens": tier_tokens,
            "repeats": repeats,
        },
    )
    if fused is not None:
        profile.assemble_s_per_token = fused.assemble_s_per_token
        cfg = engine.config
        profile.meta["fused_calibration"] = {
            "chunks": fused.chunks,
            "criterion": getattr(cfg.criterion, "__name__", cfg.criterion),
            "filter_layers": cfg.filter_layers,
            "schedule": cfg.schedule,
            "boundary_tokens": cfg.boundary_tokens,
            "tokens": fused.points[0][0],
            "code": fused_code_id(),
        }
        try:
            profile.fused = FusedCost.fit(fused.points, profile.prefill_s)
        except ValueError as exc:  # noisy measurement: keep the paper's estimator rather than a wrong line
            log.warning("fused-cost calibration rejected (%s); the controller will use the uncalibrated estimator", exc)
            profile.meta["fused_calibration"]["rejected"] = [list(p) for p in fused.points]
    return profile
