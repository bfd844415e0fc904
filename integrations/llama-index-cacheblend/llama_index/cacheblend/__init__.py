"""LlamaIndex integration for cacheblend-rag: query an index with CacheBlend doing the prefill.

from llama_index.cacheblend import CacheBlendQueryEngine
qe = CacheBlendQueryEngine.from_index(index)        # precomputes the index's chunk KV
print(qe.query("Where was Marie Curie born?"))
"""

from .llm import CacheBlendLLM
from .nodes import DEFAULT_METADATA_MODE, node_chunks, node_text
from .precompute import CacheBlendPrecompute, precompute_index
from .query_engine import CacheBlendQueryEngine
from .synthesizer import STATS_KEY, CacheBlendSynthesizer

__all__ = [
    "CacheBlendLLM",
    "CacheBlendSynthesizer",
    "CacheBlendQueryEngine",
    "CacheBlendPrecompute",
    "precompute_index",
    "LocalSentenceTransformerEmbedding",
    "DEFAULT_METADATA_MODE",
    "STATS_KEY",
    "node_text",
    "node_chunks",
]
__version__ = "0.2.0.dev0"


def __getattr__(name: str):
    # Imported on first use: it needs the optional llama-index-embeddings-huggingface.
    if name == "LocalSentenceTransformerEmbedding":
        from .embeddings import LocalSentenceTransformerEmbedding

        return LocalSentenceTransformerEmbedding
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
