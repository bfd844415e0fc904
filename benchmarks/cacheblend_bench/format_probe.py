"""What a weight format costs in next-token distributions, before it is offered.

``python -m cacheblend_bench.format_probe [--model M] [--out FILE]`` runs the model's forward
over the example documents (``examples/data``) in float32 and in each candidate format and prints,
per format, the next-token KL to float32 (mean and 95th percentile over positions) and how often
the most likely token is float32's. Candidates: ``fp16`` (``weights.Fp16Linear``, the format
offered), and two that are not offered, simulated by rounding in float32: int8 weights with one
scale per output channel, alone and with activations quantised to int8 per token (what
``torch._int_mm`` or torch's dynamic quantisation would compute).
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
from torch import nn

from cacheblend_rag.model.weights import apply_weight_format

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "data"


class _Int8Simulated(nn.Module):
    """``linear`` with int8 weights (per output channel) and, if ``activations``, int8 inputs per token."""

    def __init__(self, linear: nn.Linear, activations: bool):
        super().__init__()
        w = linear.weight.detach()
        scale = (w.abs().amax(1, keepdim=True) / 127).clamp_min(1e-12)
        self.weight, self.bias, self.activations = torch.round(w / scale).clamp(-127, 127) * scale, linear.bias, activations

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations:
            scale = (x.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-12)
            x = torch.round(x / scale) * scale
        return nn.functional.linear(x, self.weight, self.bias)


def _simulated(model: nn.Module, activations: bool) -> nn.Module:
    model = copy.deepcopy(model)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, _Int8Simulated(child, activations))
    return model


def probe(model: nn.Module, ids: torch.Tensor) -> dict[str, dict[str, float]]:
    """ids [1, tokens] -> {format: {kl_mean, kl_p95, top1_agreement}} against ``model`` (float32)."""
    candidates = {
        "fp16": apply_weight_format(copy.deepcopy(model), "fp16"),
        "int8 weights (not offered)": _simulated(model, activations=False),
        "int8 weights and per-token activations (not offered)": _simulated(model, activations=True),
    }
    with torch.inference_mode():
        ref = model(input_ids=ids).logits[0].float().log_softmax(-1)
        out = {}
        for name, m in candidates.items():
            got = m(input_ids=ids).logits[0].float().log_softmax(-1)
            kl = (ref.exp() * (ref - got)).sum(-1)
            out[name] = {
                "kl_mean": float(kl.mean()),
                "kl_p95": float(kl.quantile(0.95)),
                "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
            }
    return out


def probe_table(result: dict) -> str:
    """A :func:`probe` result (as written by ``main``) as a markdown table."""
    lines = ["| format | next-token KL to float32, mean | 95th percentile | most likely token = float32's |", "|---|---|---|---|"]
    for name, r in result["formats"].items():
        lines.append(f"| {name} | {r['kl_mean']:.2g} | {r['kl_p95']:.2g} | {r['top1_agreement']:.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from cacheblend_rag.model.loading import load_model

    parser = argparse.ArgumentParser(prog="python -m cacheblend_bench.format_probe", description=__doc__)
    parser.add_argument("--model", default=None, help="model dir, .gguf or hub id (default: the bundled SmolLM2)")
    parser.add_argument("--tokens", type=int, default=2048, help="positions compared (default 2048)")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    loaded = load_model(args.model)
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(EXAMPLES.glob("*.txt")))
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens]
    result = {"model": loaded.model_id, "tokens": int(ids.shape[1]), "formats": probe(loaded.model, ids)}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
