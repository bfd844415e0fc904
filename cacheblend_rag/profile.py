"""Offline profile of a model on a device for the loading controller; ``cacheblend-rag profile``.

Measured, not assumed:

* full-prefill time at a few context lengths (best of ``repeats``, after a warm-up), which gives
  the prefill cost per token per layer the recompute estimator scales;
* each storage tier's layer-read throughput in bytes/s: a synthetic chunk with this model's K/V
  shape is written to the tier and read back layer by layer through its ``get_layer``, so decode,
  checksum and SQLite overheads count. The disk read follows the write, so the OS page cache is
  usually warm: this is the throughput of a recently written store, not of a cold SSD.

The profile is JSON, saved under ``<cache home>/profiles/<model fingerprint>-<device>.json`` and
reused by ``LoadingController.for_engine``.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from .controller import DeviceProfile, LoadingController, TierProfile

__all__ = ["default_profile_path", "device_tag", "measure_prefill", "measure_tier", "profile_engine", "register"]

log = logging.getLogger("cacheblend_rag.profile")

DEFAULT_LENGTHS = (128, 512, 1024, 2048)
DEFAULT_TIER_COSTS = {"memory": 1.0, "disk": 0.1}  # relative price per stored byte (RAM vs SSD)


def device_tag(device: torch.device | str) -> str:
    """Names the hardware a profile was measured on (CPU timings depend on the thread count)."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return "cuda-" + "".join(c if c.isalnum() else "_" for c in name)
    return f"{device.type}-{torch.get_num_threads()}t"


def default_profile_path(engine) -> Path:
    from .models import default_cache_dir

    return default_cache_dir() / "profiles" / f"{engine.fingerprint[:20]}-{device_tag(engine.device)}.json"


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


def measure_tier(
    store: Any,
    *,
    num_layers: int,
    kv_shape: tuple[int, int],
    dtype: torch.dtype,
    tokens: int = 512,
    repeats: int = 2,
    device: torch.device | str = "cpu",
) -> tuple[float, int]:
    """(read bytes/s, bytes per stored element) of ``store``, from a synthetic chunk.

    The chunk is written with ``put``, read back layer by layer ``repeats`` times (best time
    counts), then discarded. Goes through the store's own interface, so wrappers (throttling,
    tiers, casting) are measured as they behave.
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
        best, nbytes, elem = float("inf"), 0, 0
        for _ in range(repeats):
            nbytes = 0
            t0 = time.perf_counter()
            for i in range(num_layers):
                got = store.get_layer(key, i, device=device)
                if got is None:
                    raise RuntimeError(f"{store!r} lost the profiling chunk while it was read")
                k, v = got
                nbytes += k.numel() * k.element_size() + v.numel() * v.element_size()
                elem = k.element_size()
            best = min(best, time.perf_counter() - t0)
        return nbytes / max(best, 1e-9), elem
    finally:
        store.discard(key)


def default_tiers(directory: str | Path | None = None) -> dict[str, Any]:
    """Fresh stores standing for the memory and disk tiers (the disk one in ``directory``, which
    should be on the filesystem the real store uses). The caller closes them."""
    from .kv_store import KVStore
    from .tiers import MemoryTier

    return {"memory": MemoryTier(), "disk": KVStore(directory)}


def profile_engine(
    engine,
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    tiers: Mapping[str, Any] | None = None,
    tier_costs: Mapping[str, float] | None = None,
    stored_dtype: torch.dtype | None = None,
    tier_tokens: int = 512,
    repeats: int = 2,
) -> DeviceProfile:
    """Measure ``engine``'s model on its device and the read throughput of ``tiers`` (name -> store;
    default: a memory tier and a disk store in a temporary directory under the cache home)."""
    from .models import default_cache_dir

    costs = {**DEFAULT_TIER_COSTS, **(tier_costs or {})}
    heads, dim = engine.kv_shape
    points = measure_prefill(engine, lengths, repeats)
    own = tiers is None
    tmp = None
    if own:
        home = default_cache_dir()
        home.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.TemporaryDirectory(prefix="profile-kv-", dir=home)
        tiers = default_tiers(tmp.name)
    try:
        measured = {}
        for name, store in tiers.items():
            bps, elem = measure_tier(
                store, num_layers=engine.num_layers, kv_shape=engine.kv_shape, dtype=stored_dtype or engine.dtype,
                tokens=tier_tokens, repeats=repeats, device=engine.device,
            )
            measured[name] = TierProfile(read_bytes_per_s=bps, cost_per_byte=costs.get(name, 1.0), element_bytes=elem)
    finally:
        if own:
            for store in tiers.values():
                store.close()
            tmp.cleanup()
    return DeviceProfile(
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


def describe(profile: DeviceProfile, lengths: Sequence[int] = (512, 1024, 2048), floor: float = 0.15) -> str:
    """Human-readable summary: costs, throughputs and what the controller would choose."""
    ctl = LoadingController(profile, quality_floor=floor)
    lines = [f"model {profile.model_id} ({profile.fingerprint[:12]}) on {profile.device}, {profile.dtype}, {profile.num_layers} layers"]
    for n, s in profile.prefill_points:
        lines.append(f"  full prefill {n:5d} tokens: {s * 1e3:8.1f} ms  ({s / n / profile.num_layers * 1e6:6.2f} us per token per layer)")
    for name, t in profile.tiers.items():
        lines.append(f"  tier {name:10s}: {t.read_bytes_per_s / 1e6:9.1f} MB/s read, cost {t.cost_per_byte:g}/byte, {t.element_bytes} B/element")
    for n in lengths:
        picks = ", ".join(f"{t}: r={ctl.ratio_for(n, t):.2f}" for t in profile.tiers)
        lines.append(f"  {n:5d} context tokens -> ratio {picks}; cheapest tier hiding its load at r={floor}: {ctl.cheapest_tier(floor, n)}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ CLI


def _parse_costs(text: str) -> dict[str, float]:
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad tier cost {item!r}; write name=number,name=number") from None
    return out


def _run(args: argparse.Namespace) -> int:
    from .engine import CacheBlendEngine
    from .tiers import resolve_dtype

    engine = CacheBlendEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    try:
        path = Path(args.out) if args.out else default_profile_path(engine)
        if path.is_file() and not args.force:
            profile = DeviceProfile.load(path)
            print(f"reusing {path} (pass --force to measure again)")
        else:
            lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
            profile = profile_engine(
                engine, lengths=lengths, tier_costs=args.tier_cost, stored_dtype=resolve_dtype(args.stored_dtype),
                tier_tokens=args.tier_tokens, repeats=args.repeats,
            )
            profile.save(path)
            print(f"saved {path}")
        print(describe(profile, floor=args.floor))
    finally:
        engine.close()
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("profile", help="measure prefill cost and storage read throughput for the loading controller")
    p.add_argument("--model", default=None, help="model dir, .gguf file or hub id (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=None, help="profile JSON path (default: <cache home>/profiles/<fingerprint>-<device>.json)")
    p.add_argument("--force", action="store_true", help="measure even if the profile exists")
    p.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), help="context lengths to time a full prefill at")
    p.add_argument("--tier-cost", type=_parse_costs, default={}, help="relative cost per byte, e.g. memory=1,disk=0.1")
    p.add_argument("--stored-dtype", default=None, help="dtype the tiers store K/V in (fp32/fp16/bf16; default: the model's)")
    p.add_argument("--tier-tokens", type=int, default=512, help="size of the synthetic chunk read from each tier")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--floor", type=float, default=0.15, help="quality floor r* for the printed choices")
    p.set_defaults(func=_run)
