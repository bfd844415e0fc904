"""``cacheblend-rag profile``: measure a model's profile for the loading controller and print it."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from cacheblend_rag.control.controller import LoadingController
from cacheblend_rag.control.device_profile import DeviceProfile, default_profile_path, fused_code_matches
from cacheblend_rag.control.profiler import DEFAULT_FUSED_RATIOS, DEFAULT_FUSED_TOKENS, DEFAULT_LENGTHS, profile_engine

__all__ = ["describe", "register"]


def describe(
    profile: DeviceProfile, lengths: Sequence[int] = (512, 1024, 2048), floor: float = 0.15, cpu_contention: float | None = None
) -> str:
    """Human-readable summary: costs, throughputs and what the controller would choose."""
    ctl = LoadingController(profile, quality_floor=floor, cpu_contention=cpu_contention)
    lines = [
        f"model {profile.model_id} ({profile.fingerprint[:12]}) on {profile.device}, {profile.dtype}, {profile.num_layers} layers"
    ]
    for n, s in profile.prefill_points:
        lines.append(
            f"  full prefill {n:5d} tokens: {s * 1e3:8.1f} ms  ({s / n / profile.num_layers * 1e6:6.2f} us per token per layer)"
        )
    if profile.fused is not None:
        f = profile.fused
        pts = ", ".join(f"r={r:.2f}: {s / full:.2f}" for _, r, s, full in f.points)
        where = f"  (measured at {f.points[0][0]} tokens: {pts})" if f.points else ""
        lines.append(f"  fused prefill = ({f.fixed:.3f} + {f.per_ratio:.3f} x r) x full prefill{where}")
        if not fused_code_matches(profile):
            lines.append("  WARNING: calibrated against another version of the fusor/loader code: re-run with --force")
    else:
        lines.append("  fused prefill: not calibrated (old profile; `--force` measures it): using r x full prefill")
    if profile.assemble_s_per_token is not None:
        lines.append(f"  loader assembly: {profile.assemble_s_per_token * 1e6:.2f} us CPU per loaded token")
    lines.append(f"  CPU contention factor: {ctl.cpu_contention:g} ({'CPU device' if profile.is_cpu else 'accelerator'})")
    for name, t in profile.tiers.items():
        cpu = f", {t.cpu_s_per_byte * 1e9:.2f} ns CPU/byte" if t.cpu_s_per_byte is not None else ""
        lines.append(
            f"  tier {name:10s}: {t.read_bytes_per_s / 1e6:9.1f} MB/s read, cost {t.cost_per_byte:g}/byte, {t.element_bytes} B/element{cpu}"
        )
    for n in lengths:
        picks = ", ".join(f"{t}: r={ctl.ratio_for(n, t):.2f}" for t in profile.tiers)
        lines.append(
            f"  {n:5d} context tokens -> ratio {picks}; cheapest tier hiding its load at r={floor}: {ctl.cheapest_tier(floor, n)}"
        )
    return "\n".join(lines)


def _parse_costs(text: str) -> dict[str, float]:
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad tier cost {item!r}; write name=number,name=number") from None
    return out


def _parse_ratios(text: str) -> tuple[float, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad ratios {text!r}; write e.g. 0.15,0.5,1") from None


def _run(args: argparse.Namespace) -> int:
    from cacheblend_rag.engine.core import CacheBlendEngine
    from cacheblend_rag.store.dtypes import resolve_dtype

    engine = CacheBlendEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    try:
        path = Path(args.out) if args.out else default_profile_path(engine)
        if path.is_file() and not args.force:
            profile = DeviceProfile.load(path)
            print(f"reusing {path} (pass --force to measure again)")
            if profile.fused is None:
                print("  it has no fused-cost calibration (older version): pass --force to measure it")
            elif not fused_code_matches(profile):
                print("  its fused-cost calibration was measured with other fusor/loader code: pass --force to re-measure")
        else:
            lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
            profile = profile_engine(
                engine,
                lengths=lengths,
                tier_costs=args.tier_cost,
                stored_dtype=resolve_dtype(args.stored_dtype),
                tier_tokens=args.tier_tokens,
                repeats=args.repeats,
                fused_tokens=args.fused_tokens,
                fused_ratios=args.fused_ratios,
                redis_url=args.redis,
            )
            profile.save(path)
            print(f"saved {path}")
        print(describe(profile, floor=args.floor, cpu_contention=args.cpu_contention))
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
    p.add_argument("--redis", default=None, metavar="URL", help="also profile a Redis tier at this URL (redis://host:6379/0)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--fused-tokens", type=int, default=DEFAULT_FUSED_TOKENS, help="context tokens of the fused-prefill calibration"
    )
    p.add_argument(
        "--fused-ratios",
        type=_parse_ratios,
        default=DEFAULT_FUSED_RATIOS,
        help="recompute ratios the fused prefill is timed at (comma-separated; 'none' skips the calibration)",
    )
    p.add_argument("--floor", type=float, default=0.15, help="quality floor r* for the printed choices")
    p.add_argument(
        "--cpu-contention", type=float, default=None, help="override the CPU contention factor for the printed choices"
    )
    p.set_defaults(func=_run)
