"""LangChain integration of cacheblend-rag: swap the model, wrap the retriever, keep your chain."""

from cacheblend_rag.chat.matching import ChunkRegistry

from .chains import create_cacheblend_rag_chain
from .chat_models import ChatCacheBlend
from .embeddings import LocalSentenceTransformerEmbeddings
from .inputs import RAGPromptValue, chunk_block, rag_message
from .llms import CacheBlendLLM
from .retrievers import CacheBlendRetriever, precompute_vectorstore

__all__ = [
    "CacheBlendLLM",
    "ChatCacheBlend",
    "CacheBlendRetriever",
    "ChunkRegistry",
    "LocalSentenceTransformerEmbeddings",
    "RAGPromptValue",
    "chunk_block",
    "create_cacheblend_rag_chain",
    "precompute_vectorstore",
    "rag_message",
]
__version__ = "0.2.0.dev0"
