"""cacheblend-rag: fast RAG prefill by fusing per-chunk KV caches (CacheBlend, EuroSys '25)."""

from cacheblend_rag.chat.prompt import PromptLayout, Segment
from cacheblend_rag.config import MODES, BlendConfig
from cacheblend_rag.decode.sampling import SamplingParams
from cacheblend_rag.engine.core import CacheBlendEngine, GenerationResult, PrefillResult

__all__ = [
    "MODES",
    "BlendConfig",
    "SamplingParams",
    "CacheBlendEngine",
    "GenerationResult",
    "PrefillResult",
    "PromptLayout",
    "Segment",
]
__version__ = "0.2.0.dev0"
