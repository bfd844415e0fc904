"""The one table of K/V dtypes the stores know: record codes, metadata names, tier aliases."""

from __future__ import annotations

import torch

__all__ = ["DTYPE_CODES", "dtype_from_code", "dtype_from_name", "dtype_name", "resolve_dtype"]

# dtype -> (code in the record and meta headers, extra names a tier's ``dtype=`` accepts).
# Codes are part of the on-disk format: never renumber, only append. A dtype without extra names
# can be read and written but not chosen as a tier's stored dtype (float64 would double the bytes).
_TABLE: dict[torch.dtype, tuple[int, tuple[str, ...]]] = {
    torch.float32: (1, ("fp32",)),
    torch.float16: (2, ("fp16", "half")),
    torch.bfloat16: (3, ("bf16",)),
    torch.float64: (4, ()),
}
DTYPE_CODES: dict[torch.dtype, int] = {dt: code for dt, (code, _) in _TABLE.items()}
_BY_CODE: dict[int, torch.dtype] = {code: dt for dt, code in DTYPE_CODES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """'torch.bfloat16' -> 'bfloat16' (the spelling stored in chunk metadata)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_code(code: int) -> torch.dtype | None:
    """The dtype of a header's code, or None for a code this build does not know."""
    return _BY_CODE.get(code)


def dtype_from_name(name: str) -> torch.dtype:
    for dt in _TABLE:
        if dtype_name(dt) == name:
            return dt
    raise ValueError(f"unsupported KV dtype name {name!r}")


# A tier's stored dtype, by any of its names (``dtype_name`` spelling or an alias).
_STORABLE: dict[str, torch.dtype] = {
    name: dt for dt, (_, aliases) in _TABLE.items() if aliases for name in (dtype_name(dt), *aliases)
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"fp32"|"fp16"|"bf16"`` (or a torch dtype) -> torch dtype; None keeps the model's."""
    if dtype is None or isinstance(dtype, torch.dtype):
        if dtype is not None and dtype not in _STORABLE.values():
            raise ValueError(f"stored dtype {dtype} is not supported; use fp32, fp16 or bf16")
        return dtype
    try:
        return _STORABLE[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown stored dtype {dtype!r}; use fp32, fp16 or bf16") from None
