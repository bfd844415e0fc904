"""The flags ``ask``, ``serve`` and ``ingest`` share, checked before any model loads, and the
engine they name (:func:`open_engine`)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from cacheblend_rag.config import ADAPTIVE_ESCALATION, BlendConfig
from cacheblend_rag.model.weights import AUTO, WEIGHT_CHOICES
from cacheblend_rag.store.quant import DEFAULT_KV_FORMAT, parse_kv_format

if TYPE_CHECKING:
    from cacheblend_rag.engine.core import CacheBlendEngine

WEIGHTS_HELP = (
    "linear layers' format: fp32, fp16 (CPU only: half the weight bytes per decoded token) or auto "
    "(default: fp16 for a float32 model on the CPU, else fp32)"
)
STORE_HELP = (
    "chunk cache tiers below memory, fastest first, comma-separated: disk, redis://host:6379/0 "
    "(rediss:// for TLS); e.g. disk,redis://cache:6379/0 shares caches through Redis (default: disk)"
)
GUARD_HELP = (
    "the fidelity guard (BlendConfig.guard_margin): answer from a full prefill, on top of the blended one, "
    "whenever the blended first-token margin (log-probability of the first token minus its runner-up's) is "
    "below this, e.g. 0.5 (default: off); measure the trade with python -m cacheblend_bench.guard_curve"
)
ADAPTIVE_HELP = (
    "adaptive recompute (BlendConfig.escalation = cacheblend_rag.config.ADAPTIVE_ESCALATION): blend a prompt "
    "whose first-token margin is below 0.1 again at ratio 0.3, then 0.6 (default: off; docs/choosing.md)"
)


def check_guard(margin: float | None) -> None:
    """Refuse a bad ``--guard-margin`` before the model loads, with the config's own message."""
    try:
        BlendConfig(guard_margin=margin)
    except ValueError as exc:
        raise SystemExit(f"error: --guard-margin: {exc}") from None


def check_weights(args: argparse.Namespace) -> None:
    """Refuse ``--weights fp16`` where it cannot run, before the model loads, in one line (the
    load would refuse it only after loading, with a traceback)."""
    if args.weights == "fp16" and (args.dtype not in ("float32", "fp32") or args.device != "cpu"):
        raise SystemExit(
            f"error: --weights fp16 keeps activations in float32 on the CPU: it needs --dtype float32 and --device cpu, "
            f"not --dtype {args.dtype} --device {args.device} (or leave --weights auto)"
        )


def guarded(config: BlendConfig, margin: float | None, adaptive: bool = False) -> BlendConfig:
    """``config`` (an engine's, calibrated or default) with the guard's threshold and, with
    ``adaptive``, the adaptive recompute preset."""
    if adaptive:
        config = replace(config, escalation=ADAPTIVE_ESCALATION)
    if margin is not None:
        config = replace(config, guard_margin=margin)
    return config


def add_kv_format(parser: argparse.ArgumentParser) -> None:
    """``--kv-format``, as ``ask``, ``serve`` and ``ingest`` take it (default ``from_pretrained``'s)."""
    parser.add_argument(
        "--kv-format",
        type=_kv_format,
        default=DEFAULT_KV_FORMAT,
        help=f"format the disk and Redis tiers keep chunk caches in: int8, int4 or float (default {DEFAULT_KV_FORMAT}: "
        "about a quarter of float32's bytes, the same answers; docs/storage.md). Caches of another format are not read",
    )


def _kv_format(text: str) -> str:
    """``--kv-format``, checked before any model loads (``store.quant.parse_kv_format``)."""
    try:
        parse_kv_format(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def store_tiers(text: str | None) -> list[str] | None:
    """``--store disk,redis://...`` -> the tier list ``from_pretrained(store=...)`` takes."""
    return None if text is None else [part.strip() for part in text.split(",") if part.strip()]


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--device``, ``--dtype`` and ``--weights``: the model :func:`open_engine` loads."""
    parser.add_argument("--model", default=None, help="model dir, .gguf file or hub id (default: bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--weights", default=AUTO, choices=WEIGHT_CHOICES, help=WEIGHTS_HELP)


def open_engine(args: argparse.Namespace, **options: Any) -> CacheBlendEngine:
    """The engine a command's flags name (``--model``, ``--device``, ``--dtype``, ``--weights``,
    ``--store``, ``--kv-format`` and, where the command has it, ``--store-dir``), with ``options`` for
    ``from_pretrained``; ``--weights`` is checked before the model loads."""
    from cacheblend_rag.engine.core import CacheBlendEngine

    check_weights(args)
    return CacheBlendEngine.from_pretrained(
        args.model,
        device=args.device,
        dtype=args.dtype,
        weights=args.weights,
        store_dir=getattr(args, "store_dir", None),
        store=store_tiers(args.store),
        kv_format=args.kv_format,
        **options,
    )
