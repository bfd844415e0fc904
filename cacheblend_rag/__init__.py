"""cacheblend-rag: fast RAG prefill by fusing per-chunk KV caches (CacheBlend, EuroSys '25)."""

from .config import MODES, BlendConfig, SamplingParams
from .engine import CacheBlendEngine, GenerationResult, PrefillResult
from .prompt import PromptLayout, Segment

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
