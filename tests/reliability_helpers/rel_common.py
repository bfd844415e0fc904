"""Shared helpers of the reliability tests (imported by path: ``tests`` is not a package).

Everything is deterministic: the tiny model is built from a seed and the offline tokenizer is
trained on a fixed corpus, so separate processes build identical engines and chunk keys.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.model.fingerprint import model_fingerprint
from cacheblend_rag.store.disk import KVStore
from cacheblend_rag.testing import make_model, make_tokenizer

REPO = Path(__file__).resolve().parents[2]
QUESTION = "Where is the Eiffel Tower?"
CHUNKS = [
    "The Eiffel Tower is in Paris, the capital of France.",
    "Marie Curie won two Nobel prizes, in physics and in chemistry.",
    "The river Thames flows through London and Oxford.",
    "Alice was born in 1980 and Bob is thirteen years older than Alice.",
]
MAX_NEW = 6


@functools.cache
def tokenizer():
    return make_tokenizer()


@functools.cache
def model(layers: int = 4, seed: int = 0):
    """One model per (layers, seed) per process; engines may share it (it is only read)."""
    return make_model("llama", seed=seed, layers=layers)


def engine(
    store_dir: str | os.PathLike[str] | None,
    *,
    layers: int = 4,
    seed: int = 0,
    size_limit: int = 8 * 2**30,
    pipelined: bool = False,
) -> CacheBlendEngine:
    """Engine on a store in ``store_dir`` whose records carry the model's real fingerprint."""
    m, tok = model(layers, seed), tokenizer()
    fp = model_fingerprint(m, tok)
    store = KVStore(store_dir, size_limit=size_limit, fingerprint=fp)
    return CacheBlendEngine(m, tok, store=store, fingerprint=fp, pipelined=pipelined)


_seen = threading.local()  # per thread: the logits of the prefills it ran


def _spy_prefill(eng: CacheBlendEngine) -> None:
    """Wrap eng.prefill once so each thread can see the logits of its own prefill."""
    if getattr(eng, "_rel_spied", False):
        return
    real = eng.prefill

    def spy(*args, **kwargs):
        res = real(*args, **kwargs)
        _seen.logits.append(res.logits.clone())
        return res

    eng.prefill = spy  # instance attribute: GenerationStream calls eng.prefill
    eng._rel_spied = True


def answer(eng: CacheBlendEngine, chunks: Sequence[str], question: str = QUESTION, **kw) -> tuple[list[int], torch.Tensor]:
    """(greedy token ids, next-token logits of the prefill that produced them) of one generate call."""
    _spy_prefill(eng)
    _seen.logits = []
    res = eng.generate(question, list(chunks), max_new_tokens=MAX_NEW, **kw)
    assert len(_seen.logits) == 1
    return res.token_ids, _seen.logits[0]


def keys_of(eng: CacheBlendEngine, chunks: Sequence[str]) -> list[str]:
    return [eng.chunk_key(eng.prompts.chunk_segment(c)) for c in chunks]


def fully_decodable(eng: CacheBlendEngine, key: str) -> bool:
    """True iff the chunk is published and every layer's record passes all checks."""
    meta = eng.store.meta(key)
    if meta is None:
        return False
    return all(eng.store.get_layer(key, i) is not None for i in range(meta.num_layers))


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["OMP_NUM_THREADS"] = "1"  # workers share 2 cores: no thread oversubscription
    return env
