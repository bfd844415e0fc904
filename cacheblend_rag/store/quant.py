"""Quantized chunk K/V: the int8 and 4-bit formats a store can keep chunk caches in.

A chunk's K and V are kept as integer codes with a float16 scale and minimum per group of values
(asymmetric: ``x ~= code * scale + minimum``), which is what a store's bytes per token shrink by:
float32's 4 bytes become 1 (int8) or 1/2 (4-bit) plus the groups' 4 bytes of scale and minimum.
Where the groups lie is chosen separately for K and V (KIVI, Liu et al. 2024):

* ``"channel"``: one scale per channel of a head, over a group of about ``group`` tokens. K has
  outlier channels that stay large on every token; a per-token scale would spend its range on
  them and round every other channel of the token to a few levels.
* ``"token"``: one scale per token of a head, over its ``head_dim`` channels. V has no such
  channels, and its error then stays within the token it belongs to.

A chunk of T tokens has ``max(1, T // group)`` channel groups of ``T // groups`` or one more
tokens, so no group is shorter than ``group`` (a short last group would cost as much scale as a
full one). The overhead per value is then at most ``4 / group`` bytes for K and ``4 / head_dim``
for V: with head_dim 64 and group 64, int8 stores 1.0625 bytes a value (3.76x smaller than
float32) and 4-bit 0.5625 (7.1x), for chunks of at least ``group`` tokens.

Codes are computed against the float16-rounded scale and minimum the record keeps, so the error
of a value is at most half a step (plus the minimum's float16 rounding), never the rounding of
the scale times 255. Decoding (``dequantize``) runs in numpy: it is called by a store's read on
the loader's thread, where torch would start a second team of compute threads next to the
prefill's (store/loader.py), and numpy's loops run on that one thread with the GIL released.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "DEFAULT_KV_FORMAT",
    "FORMAT_NAMES",
    "KVFormat",
    "chunk_name",
    "dequantize",
    "format_of_name",
    "parse_kv_format",
    "quantize",
    "quantized_bytes",
    "roundtrip",
]

_AXES = {"token": 1, "channel": 2}  # codes in the record's scheme byte; never renumber
_AXIS_NAMES = {code: name for name, code in _AXES.items()}
_FP16_MAX = float(torch.finfo(torch.float16).max)
_FP16_TINY = float(torch.finfo(torch.float16).tiny)  # smallest normal: a constant group's scale
# A quantized payload opens with its scheme: bits, K axis, V axis, reserved, tokens per channel
# group, reserved. Part of the CRC-checked payload, so the 100-byte record header is shared with
# the float records (a reader sizes a record file from that header before reading it).
SCHEME = struct.Struct("<BBBBHH")


@dataclass(frozen=True)
class KVFormat:
    """A quantized record format (see the module docstring).

    bits: 8 (one code a byte) or 4 (two codes a byte). Default 8.
    k_scales: where K's scales lie, "channel" (default, KIVI's choice for K) or "token".
    v_scales: where V's scales lie, "token" (default, KIVI's choice for V) or "channel".
    group: tokens per channel group, at least 1 (default 64: 4 bytes of scale and minimum per 64
        values, 1/16 byte a value; chunks shorter than it have one group).
    """

    bits: int = 8
    k_scales: str = "channel"
    v_scales: str = "token"
    group: int = 64

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits={self.bits!r}: quantized chunk records have 8 or 4 bits a value")
        for name in ("k_scales", "v_scales"):
            if getattr(self, name) not in _AXES:
                raise ValueError(f"{name}={getattr(self, name)!r}: choose 'channel' or 'token'")
        if isinstance(self.group, bool) or not isinstance(self.group, int) or not 1 <= self.group <= 0xFFFF:
            raise ValueError(f"group={self.group!r} must be a number of tokens in [1, 65535]")

    @property
    def name(self) -> str:
        """The canonical spelling (``parse_kv_format`` reads it back): ``int8``, ``int4``, and the
        settings that differ from the defaults, e.g. ``int8:k=token`` or ``int4:group=32``."""
        default = KVFormat(self.bits)
        parts = [
            f"{label}={value}"
            for label, value, base in (
                ("k", self.k_scales, default.k_scales),
                ("v", self.v_scales, default.v_scales),
                ("group", self.group, default.group),
            )
            if value != base
        ]
        return f"int{self.bits}" + (":" + ",".join(parts) if parts else "")

    def __str__(self) -> str:
        return self.name


# The named formats a store, ``from_pretrained(kv_format=...)`` and the CLI take; "float" is
# the tensors' own dtype (``dtypes.py``).
FORMAT_NAMES = ("float", "int8", "int4")
# What ``from_pretrained``, ``ask``, ``serve`` and ``ingest`` keep chunk caches in unless told:
# int8 holds ~3.8x the chunks of float32 in the same bytes, and on the dev questions it gave the
# float store's answers (paired sign test, next-token KL within 1%: CacheBlend's recompute heals
# the selected tokens) at the same first-token time from the page cache and sooner from the disk
# (docs/storage.md, "Quantized chunk records").
DEFAULT_KV_FORMAT = "int8"


def parse_kv_format(spec: str | KVFormat | None) -> KVFormat | None:
    """``"float"``/None -> None (float records); ``"int8"``, ``"int4"``, or either with settings
    (``"int8:k=token,v=token"``, ``"int4:group=32"``) -> a :class:`KVFormat`. ValueError otherwise."""
    if spec is None or isinstance(spec, KVFormat):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"kv_format must be a str, a KVFormat or None, got {type(spec).__name__}")
    text = spec.strip().lower()
    if text in ("", "float"):
        return None
    base, _, options = text.partition(":")
    if base not in ("int8", "int4"):
        raise ValueError(f"unknown KV format {spec!r}: use float, int8 or int4 (e.g. int8:k=token,v=token,group=64)")
    kwargs: dict[str, object] = {"bits": int(base[3:])}
    names = {"k": "k_scales", "v": "v_scales", "group": "group"}
    for part in filter(None, options.split(",")):
        label, eq, value = part.partition("=")
        if not eq or label.strip() not in names:
            raise ValueError(f"KV format {spec!r}: option {part!r} is not k=channel|token, v=channel|token or group=N")
        field = names[label.strip()]
        if field == "group":
            try:
                kwargs[field] = int(value)
            except ValueError:
                raise ValueError(f"KV format {spec!r}: group={value!r} is not a whole number of tokens") from None
        else:
            kwargs[field] = value.strip()
    return KVFormat(**kwargs)  # type: ignore[arg-type]


def chunk_name(key: str, kv_format: KVFormat | None) -> str:
    """The name a store keeps chunk ``key`` under in ``kv_format``: the key itself for float
    records (as every store always has), ``key@int8`` and so on otherwise, so the caches of two
    formats never meet, and a store's chunks can be counted and dropped by format."""
    return key if kv_format is None else f"{key}@{kv_format.name}"


def format_of_name(name: str) -> str:
    """The format a chunk name (``chunk_name``) was stored in: "float" or a KVFormat name."""
    _, at, fmt = name.partition("@")
    return fmt if at else "float"


# ------------------------------------------------------------------------ layout


def _groups(tokens: int, group: int) -> int:
    return 0 if tokens == 0 else max(1, tokens // group)


def _group_sizes(tokens: int, groups: int) -> list[int]:
    # Tokens t with t * groups // tokens == g form group g: sizes differ by at most one.
    if groups == 0:
        return []
    bounds = [-(-g * tokens // groups) for g in range(groups + 1)]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _scale_shape(axis: str, shape: tuple[int, int, int], group: int) -> tuple[int, int, int]:
    heads, tokens, head_dim = shape
    if axis == "token":
        return (heads, tokens, 1)
    return (heads, _groups(tokens, group), head_dim)


def _code_bytes(numel: int, bits: int) -> int:
    return numel if bits == 8 else (numel + 1) // 2


def _part_bytes(fmt: KVFormat, axis: str, shape: tuple[int, int, int]) -> int:
    scales = int(np.prod(_scale_shape(axis, shape, fmt.group)))
    return _code_bytes(int(np.prod(shape)), fmt.bits) + 4 * scales  # codes, float16 scale and minimum


def quantized_bytes(fmt: KVFormat, shape: tuple[int, int, int]) -> int:
    """Payload bytes of one layer's K and V of ``shape`` [heads, tokens, head_dim] in ``fmt``."""
    return SCHEME.size + _part_bytes(fmt, fmt.k_scales, shape) + _part_bytes(fmt, fmt.v_scales, shape)


# ------------------------------------------------------------------------ encoding


def _quantize_part(x: torch.Tensor, bits: int, axis: str, group: int) -> bytes:
    """Codes, float16 scales and minimums of one [heads, tokens, head_dim] tensor, as bytes."""
    x = x.detach().to("cpu", torch.float32)
    heads, tokens, head_dim = x.shape
    if not bool(torch.isfinite(x).all()) or (x.numel() and float(x.abs().max()) > _FP16_MAX):
        raise ValueError("K/V values that are not finite or beyond float16's range cannot be quantized; store them as float")
    levels = (1 << bits) - 1
    if axis == "token":
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        expand = None
    else:
        groups = _groups(tokens, group)
        # Token t belongs to group t * groups // tokens (``_group_sizes``).
        expand = torch.arange(tokens) * groups // max(tokens, 1)
        index = expand.view(1, tokens, 1).expand(heads, tokens, head_dim)
        lo = torch.full((heads, groups, head_dim), float("inf")).scatter_reduce(1, index, x, "amin")
        hi = torch.full((heads, groups, head_dim), float("-inf")).scatter_reduce(1, index, x, "amax")
    scale16 = ((hi - lo) / levels).clamp(min=_FP16_TINY, max=_FP16_MAX).to(torch.float16)
    lo16 = lo.to(torch.float16)
    scale, low = scale16.float(), lo16.float()
    if expand is not None:
        scale, low = scale.index_select(1, expand), low.index_select(1, expand)
    codes = ((x - low) / scale).round_().clamp_(0, levels).to(torch.uint8).reshape(-1)
    if bits == 4:
        if codes.numel() % 2:
            codes = torch.cat([codes, codes.new_zeros(1)])
        codes = codes[0::2] | (codes[1::2] << 4)
    return b"".join(t.contiguous().numpy().tobytes() for t in (codes, scale16, lo16))


def quantize(fmt: KVFormat, k: torch.Tensor, v: torch.Tensor) -> bytes:
    """One layer's payload in ``fmt``: the scheme, then K's and V's codes, scales and minimums."""
    scheme = SCHEME.pack(fmt.bits, _AXES[fmt.k_scales], _AXES[fmt.v_scales], 0, fmt.group, 0)
    return b"".join(
        (scheme, _quantize_part(k, fmt.bits, fmt.k_scales, fmt.group), _quantize_part(v, fmt.bits, fmt.v_scales, fmt.group))
    )


# ------------------------------------------------------------------------ decoding


def _dequantize_part(buf: memoryview, bits: int, axis: str, group: int, shape: tuple[int, int, int]) -> np.ndarray:
    numel = int(np.prod(shape))
    ncode = _code_bytes(numel, bits)
    sshape = _scale_shape(axis, shape, group)
    nscale = int(np.prod(sshape))
    codes = np.frombuffer(buf, np.uint8, ncode)
    # Codes are cast into the output first: numpy's float32 multiply and add then run without a
    # per-element cast, about half the time of mixed uint8 x float32 ops.
    out = np.empty(shape, np.float32)
    flat = out.reshape(-1)
    if bits == 4:
        flat[0::2] = codes & 15  # the low nibble holds the even value (``_quantize_part``)
        flat[1::2] = codes[: numel // 2] >> 4
    else:
        flat[:] = codes
    scale = np.frombuffer(buf, np.float16, nscale, ncode).astype(np.float32).reshape(sshape)
    low = np.frombuffer(buf, np.float16, nscale, ncode + 2 * nscale).astype(np.float32).reshape(sshape)
    if axis == "channel":  # [heads, groups, head_dim] -> [heads, tokens, head_dim]
        sizes = _group_sizes(shape[1], sshape[1])
        scale, low = np.repeat(scale, sizes, axis=1), np.repeat(low, sizes, axis=1)
    np.multiply(out, scale, out=out)
    np.add(out, low, out=out)
    return out


def scheme_of(payload: memoryview) -> KVFormat:
    """The format a quantized payload names (ValueError if it names none)."""
    if payload.nbytes < SCHEME.size:
        raise ValueError(f"quantized payload of {payload.nbytes} bytes has no scheme")
    bits, k_axis, v_axis, r1, group, r2 = SCHEME.unpack_from(payload)
    if k_axis not in _AXIS_NAMES or v_axis not in _AXIS_NAMES or r1 or r2:
        raise ValueError(f"unknown quantization scheme {bits}/{k_axis}/{v_axis}/{r1}/{r2}")
    return KVFormat(bits, _AXIS_NAMES[k_axis], _AXIS_NAMES[v_axis], group)


def dequantize(
    payload: memoryview, shape: tuple[int, int, int], dtype: torch.dtype
) -> tuple[KVFormat, torch.Tensor, torch.Tensor]:
    """A quantized payload (``quantize``'s bytes, already checked whole) -> its format and the
    K and V it decodes to, in ``dtype``. ValueError when its size does not match ``shape``."""
    fmt = scheme_of(payload)
    want = quantized_bytes(fmt, shape)
    if payload.nbytes != want:
        raise ValueError(f"{fmt.name} payload of {list(shape)} needs {want} bytes, found {payload.nbytes}")
    k_bytes = _part_bytes(fmt, fmt.k_scales, shape)
    k = _dequantize_part(payload[SCHEME.size :], fmt.bits, fmt.k_scales, fmt.group, shape)
    v = _dequantize_part(payload[SCHEME.size + k_bytes :], fmt.bits, fmt.v_scales, fmt.group, shape)
    return fmt, _as(k, dtype), _as(v, dtype)


def _as(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float16:
        return torch.from_numpy(a.astype(np.float16))
    t = torch.from_numpy(a)
    return t if dtype == torch.float32 else t.to(dtype)  # bfloat16 and float64: numpy has no bfloat16


def roundtrip(fmt: KVFormat, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``k`` and ``v`` read back as from ``fmt``'s records (same dtype and shape, on the CPU)."""
    shape = (int(k.shape[0]), int(k.shape[1]), int(k.shape[2]))
    _, kq, vq = dequantize(memoryview(quantize(fmt, k, v)), shape, k.dtype)
    return kq, vq
