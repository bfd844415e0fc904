"""The adapter and the fusor on a GPU: the same exactness as on CPU, in fp32, fp16 and bf16.
Skipped where torch sees no CUDA device (CI is CPU only)."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import BlendConfig
from cacheblend_rag.engine.core import CacheBlendEngine
from cacheblend_rag.store.disk import KVStore
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_model, make_tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: these tests run where a GPU is present")

# Logit tolerance per dtype: half precision rounds each layer's activations.
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}


@pytest.fixture(params=[torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def gpu_engine(request):
    model = make_model("qwen2").to("cuda", request.param)
    engine = CacheBlendEngine(model, make_tokenizer(), store=KVStore(None))  # self-test runs on the GPU
    yield engine
    engine.close()


def test_fused_path_at_ratio_one_equals_full_prefill_on_cuda(gpu_engine):
    layout = gpu_engine.build_layout(SAMPLE_QUESTION, SAMPLE_CHUNKS)
    full = gpu_engine.prefill(layout, "full_recompute")
    tol = TOL[gpu_engine.dtype] * (1 + float(full.logits.abs().max()))
    for strategy in ("hkvd", "question"):
        blend = gpu_engine.prefill(layout, "cacheblend", BlendConfig(recompute_ratio=1.0, strategy=strategy))
        assert blend.logits.device.type == "cuda"
        assert float((blend.logits.float() - full.logits.float()).abs().max()) <= tol


def test_cuda_blend_matches_cpu_blend_in_fp32():
    engines = [
        CacheBlendEngine(make_model("qwen2").to(device), make_tokenizer(), store=KVStore(None)) for device in ("cpu", "cuda")
    ]
    try:
        cfg = BlendConfig(recompute_ratio=0.15)
        cpu, gpu = (
            e.prefill(e.build_layout(SAMPLE_QUESTION, SAMPLE_CHUNKS), "cacheblend", cfg).logits.float().cpu() for e in engines
        )
        torch.testing.assert_close(gpu, cpu, rtol=1e-3, atol=1e-4)
    finally:
        for e in engines:
            e.close()
