"""The model adapter: the one place that touches a transformers causal LM's insides.

The fusor runs a model's decoder layers one by one on a subset of positions, and the loader moves
cached keys to new positions with the model's own rotary embedding. Both are exact only for models
whose forward is "embed, decoder layers, norm, lm_head" with standard RoPE; every model-specific
step outside the decoder layers (an embedding multiplier, a logit scale) must be applied here too.

:func:`check_support` decides at load, from the model type and config, whether that holds, and
refuses with a message naming the feature and what to use instead.
:func:`cacheblend_rag.blend.self_test.self_test` then checks it numerically on a few tokens (the fused
path against the model's own forward, a shifted key against one computed at the new position), so
a model this module does not know is refused rather than answered wrongly.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from cacheblend_rag.errors import UnsupportedModelError
from cacheblend_rag.store.protocol import KV

__all__ = ["Backbone", "UnsupportedModelError", "cache_from", "cache_kwarg", "cache_layers", "check_support", "sliding_window"]


# RoPE variants whose angle is not `position * inv_freq` for one fixed inv_freq: "dynamic" (NTK)
# recomputes inv_freq from the current length and "longrope" switches inv_freq sets at a length
# threshold, so a key cached at one length and re-rotated for another gets the wrong frequencies.
_UNSUPPORTED_ROPE_TYPES = ("dynamic", "longrope")
_SUPPORTED_ROPE_HINT = (
    'supported types are "default", "linear", "llama3", "yarn" and others with a fixed inv_freq: use a '
    "model or config without length-dependent RoPE scaling"
)
_USE_INSTEAD = "Use a Llama, Mistral, Qwen2, Qwen3, Gemma, Phi3 or Granite model"
# Rotary layouts that pair channel i with i+1 instead of i with i + d/2, which the key shift
# (rope.apply_rotation, transformers' rotate_half) does not handle.
_INTERLEAVED_ROPE_MODELS = frozenset({"cohere", "cohere2"})


def cache_kwarg(module: torch.nn.Module) -> str:
    """The cache keyword of a model's or decoder layer's forward: transformers 5.24 renamed
    ``past_key_values`` to ``cache``."""
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_layers(cache: Any) -> list[KV]:
    """A transformers cache's K/V per layer: [layers](K, V) [1, kv_heads, tokens, head_dim]."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def cache_from(kv: Sequence[KV], *, adopt: bool = False) -> DynamicCache:
    """A DynamicCache holding ``kv`` ([layers](K, V), each [1, kv_heads, tokens, head_dim] or
    [kv_heads, tokens, head_dim]): copied (``update`` concatenates into new storage), or with
    ``adopt=True`` the tensors themselves, for buffers that belong to this request alone (the
    fusor's output: copying the whole prompt's K/V cost 2% of a CacheBlend prefill)."""
    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        k, v = (k if k.dim() == 4 else k[None]), (v if v.dim() == 4 else v[None])
        if not adopt:
            cache.update(k, v, i)
            continue
        cache.update(k[..., :0, :], v[..., :0, :], i)  # creates and initialises layer i, empty
        cache.layers[i].keys, cache.layers[i].values = k, v
    return cache


def _architecture_name(model: Any) -> str:
    archs = getattr(getattr(model, "config", None), "architectures", None)
    return str(archs[0]) if archs else type(model).__name__


def _rope_types(model: Any) -> set[str]:
    """Every rope_type the model declares (rotary module and config; per-layer-type dicts too)."""
    found: set[str] = set()

    def add(value: Any) -> None:
        if isinstance(value, str):
            found.add(value)
        elif isinstance(value, dict):
            if "rope_type" in value or "type" in value:
                add(value.get("rope_type", value.get("type")))
            else:  # {layer_type: {...}} for models with several attention kinds
                for sub in value.values():
                    add(sub)

    add(getattr(getattr(getattr(model, "model", None), "rotary_emb", None), "rope_type", None))
    config = getattr(model, "config", None)
    add(getattr(config, "rope_parameters", None))
    add(getattr(config, "rope_scaling", None))  # legacy spelling, if present
    return found


def sliding_window(config: Any) -> int | None:
    """The attention window of the model's sliding-window layers, or None when every layer
    attends to the whole prefix. (Qwen2/Qwen3 keep ``sliding_window`` set while
    ``use_sliding_window=False``; their ``layer_types`` say which layers use it.)"""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def _head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def check_support(model: Any) -> None:
    """Raise :class:`UnsupportedModelError` unless CacheBlend can drive ``model`` exactly.

    The fusor runs ``model.model.embed_tokens``, each of ``model.model.layers``, ``model.model.norm``
    and ``model.lm_head`` itself (with the scales :class:`Backbone` knows), and the loader moves
    cached keys by the model's own ``model.model.rotary_emb`` rotation for the position delta. That
    needs rotary embeddings whose angle is ``position * inv_freq`` with a fixed ``inv_freq`` over
    the whole head, in the half-split layout, and plain softmax attention.
    """
    arch = _architecture_name(model)
    inner = getattr(model, "model", None)
    config = getattr(model, "config", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None:
        raise UnsupportedModelError(
            f"{arch} has no rotary position embeddings (RoPE); CacheBlend re-rotates cached keys "
            "to their new positions, which needs a RoPE model (learned absolute positions or "
            "ALiBi, as in GPT-2, OPT or BLOOM, cannot be moved). Use a RoPE decoder such as "
            "Llama, Mistral, Qwen2 or Qwen3."
        )
    required = {
        "model.model.layers": getattr(inner, "layers", None),
        "model.model.embed_tokens": getattr(inner, "embed_tokens", None),
        "model.model.norm": getattr(inner, "norm", None),
        "model.lm_head": getattr(model, "lm_head", None),
    }
    missing = [name for name, value in required.items() if value is None]
    if missing:
        raise UnsupportedModelError(
            f"{arch} lacks {', '.join(missing)}; CacheBlend drives the decoder layers one by one "
            "and needs the Llama-style layout (model.model.layers, embed_tokens, norm, rotary_emb "
            "and model.lm_head). Use a decoder such as Llama, Mistral, Qwen2 or Qwen3."
        )
    bad = sorted(t for t in _rope_types(model) if any(u in t for u in _UNSUPPORTED_ROPE_TYPES))
    if bad:
        raise UnsupportedModelError(
            f"{arch} uses rope_type {', '.join(repr(t) for t in bad)}, whose rotation frequencies "
            "change with the sequence length, so cached keys cannot be re-rotated by composing "
            f"rotations; {_SUPPORTED_ROPE_HINT}."
        )
    inv_freq = next((b for name, b in rotary.named_buffers() if name.endswith("inv_freq")), None)
    if inv_freq is None:
        raise UnsupportedModelError(
            f"{arch}'s rotary embedding ({type(rotary).__name__}) exposes no inv_freq buffer, so "
            f"CacheBlend cannot re-rotate cached keys with it; {_SUPPORTED_ROPE_HINT}."
        )
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        raise UnsupportedModelError(
            f"{arch} uses per-layer rotary embeddings (a different RoPE for local and global "
            f"layers, as in Gemma3), which CacheBlend's key shift does not model. {_USE_INSTEAD}."
        )
    if config is None:
        return
    if 2 * inv_freq.numel() != _head_dim(config):
        raise UnsupportedModelError(
            f"{arch} rotates only {2 * inv_freq.numel()} of its {_head_dim(config)} head channels "
            f"(partial rotary), which CacheBlend's key shift does not handle. {_USE_INSTEAD}."
        )
    if getattr(config, "model_type", "") in _INTERLEAVED_ROPE_MODELS:
        raise UnsupportedModelError(
            f"{arch} ({config.model_type}) uses interleaved rotary embeddings (channel pairs i, i+1), "
            f"which CacheBlend's half-split key shift would rotate wrongly. {_USE_INSTEAD}."
        )
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, field, None):
            raise UnsupportedModelError(
                f"{arch} sets {field}={getattr(config, field)} (logit softcapping, as in Gemma2), which the "
                f"fused attention and logits do not apply. {_USE_INSTEAD}, or Gemma (v1)."
            )


@dataclass(frozen=True)
class Backbone:
    """What the fusor and the chunk precompute need of a model, model-specific scales included.

    ``embed`` and ``logits`` apply what the model's own forward applies outside its decoder layers
    (Granite's ``embedding_multiplier`` and ``logits_scaling``); ``window`` is the sliding-window
    length, inside which a prompt must fit for the fused mask (full causal) to be exact.
    """

    model: Any
    embedding_multiplier: float = 1.0
    logits_divisor: float = 1.0
    window: int | None = None
    # The cache keyword of the model's and of a decoder layer's forward, read once at load (every
    # prefill and chunk precompute passes it).
    model_cache_kwarg: str = "cache"
    layer_cache_kwarg: str = "cache"

    @classmethod
    def adapt(cls, model: Any) -> Backbone:
        """Check ``model`` (:func:`check_support`) and route its attention through the fused
        path's dispatch (``attention.install``, which the model's own forward also uses)."""
        from cacheblend_rag.model import attention

        check_support(model)
        attention.install(model)
        config = model.config
        return cls(
            model,
            embedding_multiplier=float(getattr(config, "embedding_multiplier", 1.0) or 1.0),
            logits_divisor=float(getattr(config, "logits_scaling", 1.0) or 1.0),
            window=sliding_window(config),
            model_cache_kwarg=cache_kwarg(model),
            layer_cache_kwarg=cache_kwarg(model.model.layers[0]),
        )

    @property
    def layers(self) -> torch.nn.ModuleList:
        return self.model.model.layers

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def kv_shape(self) -> tuple[int, int]:
        """(kv_heads, head_dim) of every layer's K and V."""
        config = self.model.config
        return (config.num_key_value_heads or config.num_attention_heads, _head_dim(config))

    @property
    def context_window(self) -> int:
        """Longest prompt plus answer, in tokens, that the fused prefill runs exactly."""
        window = int(getattr(self.model.config, "max_position_embeddings", 0) or 0) or 2048
        if self.window is not None:
            # The fused mask is full causal: exact only while the whole prompt and answer fit in
            # the sliding window (the model's cache keeps window - 1 past tokens).
            window = min(window, self.window - 1)
        return window

    @property
    def rotary_emb(self) -> torch.nn.Module:
        return self.model.model.rotary_emb

    def check_fits(self, n: int, what: str, reserve: int = 0) -> None:
        """Refuse ``what`` (``n`` tokens, plus ``reserve`` to generate) beyond :attr:`context_window`."""
        if n + reserve > self.context_window:
            window = (
                ""
                if self.window is None
                else (f" (its sliding attention window of {self.window} less one: inside it the fused prefill is exact)")
            )
            raise ValueError(
                f"{what} is {n} tokens{f' plus {reserve} to generate' if reserve else ''}, more than "
                f"the model's context window of {self.context_window} tokens{window}: retrieve fewer or "
                "shorter chunks (split long documents) or lower max_new_tokens"
            )

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, *, start: int | None = None, cache: Any = None) -> tuple[Any, torch.Tensor]:
        """The model's own prefill of ``ids`` [tokens] at positions ``start``.. (None: the model's
        default, from 0) on top of ``cache`` (None: a fresh one). Returns the cache, holding every
        layer's K/V [1, kv_heads, past + tokens, head_dim], and the last position's float32 logits
        [vocab]."""
        kwargs: dict[str, Any] = {}
        if start is not None:
            kwargs["position_ids"] = torch.arange(start, start + ids.numel(), device=ids.device)[None]
        if cache is not None:
            kwargs[self.model_cache_kwarg] = cache
        out = self.model(input_ids=ids[None], use_cache=True, logits_to_keep=1, **kwargs)
        # transformers 5.24 renamed the output's `past_key_values` to `cache` (the old name warns).
        cache = getattr(out, "cache", None)
        return (cache if cache is not None else out.past_key_values), out.logits[0, -1].float()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[tokens] -> [tokens, hidden]"""
        hidden = self.model.model.embed_tokens(ids)
        return hidden * self.embedding_multiplier if self.embedding_multiplier != 1.0 else hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last layer's output [1, tokens, hidden] -> float32 logits [tokens, vocab]."""
        logits = self.model.lm_head(self.model.model.norm(hidden))[0].float()
        return logits / self.logits_divisor if self.logits_divisor != 1.0 else logits
