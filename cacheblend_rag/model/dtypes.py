"""The model dtypes ``load_model`` accepts, by every spelling a user writes."""

from __future__ import annotations

import torch

from cacheblend_rag.errors import ModelLoadError

# Accepted dtype spellings. Only floating types that CPU/GPU kernels for these models handle.
MODEL_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_model_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in MODEL_DTYPES.values():
            return dtype
        raise ModelLoadError(f"Unsupported dtype {dtype}; choose one of {_dtype_choices()}.")
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key in MODEL_DTYPES:
            return MODEL_DTYPES[key]
    raise ModelLoadError(f"Unsupported dtype {dtype!r}; choose one of {_dtype_choices()}.")


def _dtype_choices() -> str:
    return ", ".join(MODEL_DTYPES)
