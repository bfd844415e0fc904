"""Weight formats chosen at load: which bytes a linear layer reads, and which kernel reads them.

A decode step computes one token, so each linear layer is a matrix-vector product whose cost is
the bytes of its weights (docs/engine.md, "Where a decode step goes"). On a CPU without native
half-precision arithmetic, a whole model in float16 or bfloat16 is *slower* than float32, so the
format is chosen per operation, by measurement:

* ``"auto"`` (default): ``"fp16"`` where it runs (a float32 model on the CPU, torch with fbgemm),
  else ``"fp32"``. On held-out and dev questions float16 weights lost nothing measurable in answers
  (docs/engine.md, "Weight formats") and decode faster, so a CPU user gets them without asking;
  they hold more memory than float32 (the packed matrices beside the float16 copy).
* ``"fp32"``: the model's own ``nn.Linear`` layers.
* ``"fp16"``: each linear's weights rounded once to float16. Calls over a few rows (decoding,
  batched decoding) run fbgemm's FP16 GEMM, which reads the half-size weights and multiplies in
  float32 with float32 activations; calls over many rows (prefill, where the arithmetic, not the
  bytes, is the cost and fbgemm's FP16 GEMM is slower than float32's) multiply the same rounded
  values widened to float32. Both paths compute with identical weights, in float32, and each row's
  result is independent of the other rows, so batched and single answers agree. CPU only.

Not offered, by measurement on the bundled model (docs/engine.md, "Weight formats"): int8 with
activations quantised per token (torch's dynamic quantisation, ``torch._int_mm``) reads fewer bytes
still, but moved the next-token distribution from float32's by about as much as CacheBlend's own
approximation does, where float16 weights move it by a thousandth of that; torch's weight-only int8
kernel (``_weight_int8pack_mm``) is slower than float32 on AVX2; and ``torch.compile`` of the decode
step was slower than eager, recompiling as the cache grows.

Every prefill mode and the decoder run the converted model, so comparisons between modes stay
like with like, and the model fingerprint includes the format, so chunk caches of two formats
never mix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cacheblend_rag.errors import ModelLoadError

WEIGHT_FORMATS = ("fp32", "fp16")
# Rows up to which a linear call takes fbgemm's FP16 GEMM: on a 2-core AVX2 CPU, over
# SmolLM2-135M's linear shapes, it took less time than float32's GEMM from 1 to 64 rows (reading
# the weights dominates) and more at 512 (the arithmetic dominates, and fbgemm converts every
# weight it multiplies).
FP16_GEMM_MAX_ROWS = 64


class Fp16Linear(nn.Module):
    """An ``nn.Linear`` whose weights were rounded to float16; computes in float32.

    ``weight`` [out, in] holds the rounded values in float16, half a float32 copy's memory (the
    many-row path widens it to float32 for each call: a CacheBlend prefill of SmolLM2-135M took the
    same time either way; the model fingerprint reads it); ``packed`` is the same matrix in
    fbgemm's packed float16 layout, which the few-row path reads.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        rounded = linear.weight.detach().to(torch.float16)
        self.register_buffer("weight", rounded)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.register_buffer("bias", bias)
        self.packed = torch.ops.quantized.linear_prepack_fp16(rounded.float(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] -> [..., out]"""
        if x.numel() <= FP16_GEMM_MAX_ROWS * self.in_features:
            return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)
        return F.linear(x, self.weight.float(), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=fp16"


AUTO = "auto"
WEIGHT_CHOICES = (AUTO, *WEIGHT_FORMATS)  # what a caller may ask for


def check_weight_format(weights: object) -> str:
    if weights not in WEIGHT_CHOICES:
        raise ModelLoadError(f"weights={weights!r} is not a weight format; choose one of {', '.join(WEIGHT_CHOICES)}")
    return str(weights)


def _fp16_refusal(model: nn.Module) -> str | None:
    """Why ``weights="fp16"`` cannot run on ``model`` as described, with what to do instead."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        return (
            f'weights="fp16" runs fbgemm\'s CPU kernels; on {param.device.type} load the whole model '
            'in half precision instead (dtype="float16" or "bfloat16")'
        )
    if param.dtype != torch.float32:
        return (
            f'weights="fp16" keeps activations in float32 and needs a float32 model, not {param.dtype}: load with dtype="float32"'
        )
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return 'weights="fp16" needs a torch build with fbgemm (x86-64); use weights="fp32"'
    return None


def resolve_weight_format(model: nn.Module, weights: str) -> str:
    """``weights`` as a format of ``WEIGHT_FORMATS``: "auto" is "fp16" where it runs, else "fp32"."""
    weights = check_weight_format(weights)
    if weights != AUTO:
        return weights
    if weight_format(model) == "fp16":
        return "fp16"
    return "fp32" if _fp16_refusal(model) is not None else "fp16"


def weight_format(model: nn.Module) -> str:
    """The format :func:`apply_weight_format` gave ``model`` ("fp32" for an unconverted model)."""
    return "fp16" if any(isinstance(m, Fp16Linear) for m in model.modules()) else "fp32"


def apply_weight_format(model: nn.Module, weights: str) -> nn.Module:
    """Convert ``model``'s linear layers (the output head included) to ``weights`` in place
    (``"auto"``: see :func:`resolve_weight_format`).

    An explicit "fp16" is refused, naming what to do instead, where it cannot run exactly as
    described: on a device other than the CPU, with parameters that are not float32, or without
    fbgemm.
    """
    weights = resolve_weight_format(model, weights)
    current = weight_format(model)
    if weights == current:
        return model
    if current != "fp32":
        raise ModelLoadError(f"the model's weights are already {current}; load it again to change the format")
    refusal = _fp16_refusal(model)
    if refusal is not None:
        raise ModelLoadError(refusal)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, Fp16Linear(child))
    return model
