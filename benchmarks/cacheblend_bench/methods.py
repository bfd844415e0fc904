"""The compared methods, named as on the command line, and how each answers one question.

Names: ``full_recompute`` (the model's own forward), ``full_recompute_saved`` (the same exact
prefill with the last-layer saving the fused modes get), ``prefix_caching``, ``full_reuse``,
``cacheblend@R`` (recompute ratio R; plain ``cacheblend`` expands to the configured ratio sweep),
optionally ``cacheblend@R:CRIT``
with a selection criterion of ``cacheblend_rag.blend.selector.CRITERIA``, LangChain's
``map_reduce`` and ``map_rerank`` QA chains, and the baselines outside the engine
(``bench.baselines``): ``generate`` (transformers' ``model.generate()``), ``llama_cpp[:QUANT]``
and ``llama_cpp_prefix[:QUANT]`` (llama.cpp on the model's GGUF, optionally requantised).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from cacheblend_bench.baselines import QUANTS
from cacheblend_rag.config import ADAPTIVE_ESCALATION, MODES, BlendConfig

if TYPE_CHECKING:
    import torch

    from cacheblend_rag.engine.core import GenerationResult

CHAINS = ("map_reduce", "map_rerank")
DEFAULT_RATIOS = (0.05, 0.15, 0.3, 0.5)
DEFAULT_METHODS = ("full_recompute", "prefix_caching", "full_reuse", "cacheblend", "map_reduce", "map_rerank")


# Suffix options after "/": a BlendConfig change each (docs/quality.md names them).
OPTIONS: dict[str, dict[str, Any]] = {
    "last": {"question_layers": "last"},
    "max": {"question_heads": "max"},
    "nb": {"neighbour_caches": True},
    "ape": {"context_temperature": 0.9, "context_scale": 0.9},  # the APE paper's T = S = 0.9
    "adaptive": {"escalation": ADAPTIVE_ESCALATION},  # the engine's adaptive recompute (BlendConfig.escalation)
}


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # "kv" (one engine prefill mode), a chain name or a baseline name (bench.baselines)
    mode: str | None = None
    ratio: float | None = None
    criterion: str | None = None
    options: tuple[tuple[str, Any], ...] = ()  # BlendConfig fields set by "/" suffixes
    quant: str | None = None  # llama_cpp: the GGUF requantised to this type (None: as shipped)

    @property
    def is_kv(self) -> bool:
        return self.kind == "kv"

    @property
    def is_chain(self) -> bool:
        return self.kind in CHAINS

    def blend_config(self, base: BlendConfig) -> BlendConfig | None:
        """The config of this method's prefill. Benchmarks compare chunk caches explicitly:
        neighbour-aware caches are used only by methods named with "/nb", escalation only by
        methods named with "/adaptive", and the fidelity guard never runs (the trade of either is
        computed from fixed-ratio rows too: ``bench.guard_curve``)."""
        if not self.is_kv:
            return None
        cfg = replace(base, neighbour_caches=False, guard_margin=None, escalation=())
        if self.mode == "cacheblend":
            cfg = cfg.with_ratio(self.ratio)
            if self.criterion:
                cfg = replace(cfg, criterion=self.criterion)
        return replace(cfg, **dict(self.options))


def cacheblend_name(ratio: float, criterion: str | None = None) -> str:
    return f"cacheblend@{ratio:g}" + (f":{criterion}" if criterion else "")


def _options(spec: str, parts: list[str]) -> tuple[tuple[str, Any], ...]:
    out: dict[str, Any] = {}
    for p in parts:
        if p in OPTIONS:
            out.update(OPTIONS[p])
        elif p.startswith("w") and p[1:].isdigit():
            out["selection_window"] = int(p[1:])
        elif p.startswith("b") and p[1:].isdigit():
            out["boundary_tokens"] = int(p[1:])
        else:
            raise ValueError(
                f"method {spec!r}: unknown option {p!r}; choose from {', '.join(OPTIONS)}, w<N> (selection window), "
                "b<N> (each chunk's first N tokens)"
            )
    return tuple(sorted(out.items()))


def parse_method(spec: str, ratios: Sequence[float] = DEFAULT_RATIOS) -> list[Method]:
    """``cacheblend@0.15`` (the paper's HKVD selection), ``question@0.15`` / ``chunk@0.15``
    (question-guided tokens / chunks), ``hybrid@0.15`` (a question-guided seed narrowed by
    deviation), each optionally with ``:CRITERION`` (hkvd, hybrid) and "/" options: ``last``
    (question attention of the last layer), ``max`` (max over head groups), ``w<N>`` (selection
    window), ``b<N>`` (every chunk's first N tokens recomputed too, within the ratio: EPIC), ``nb`` (neighbour-aware chunk caches), ``ape`` (APE's attention temperature and
    scale, 0.9 each), ``adaptive`` (the engine's default escalation steps after the first pass,
    ``config.ADAPTIVE_ESCALATION``); ``nb`` and ``ape`` apply to full_reuse too."""
    spec = spec.strip()
    if spec in CHAINS or spec == "generate":
        return [Method(spec, spec)]
    head, _, quant = spec.partition(":")
    if head in ("llama_cpp", "llama_cpp_prefix"):
        if quant and quant not in QUANTS:
            raise ValueError(f"method {spec!r}: unknown llama.cpp quantisation {quant!r}; choose from {', '.join(QUANTS)}")
        return [Method(spec, head, quant=quant or None)]
    head, *opts = spec.split("/")
    options = _options(spec, opts)
    if head in MODES and head != "cacheblend":
        return [Method(spec, "kv", head, options=options)]
    strategy = next(
        (
            s
            for s in ("cacheblend", "hkvd", "question", "chunk", "hybrid")
            if head == s or head.startswith(s + "@") or head.startswith(s + ":")
        ),
        None,
    )
    if strategy is not None:
        rest = head[len(strategy) :]
        criterion = None
        if ":" in rest:
            rest, criterion = rest.split(":", 1)
            from cacheblend_rag.blend.selector import CRITERIA

            if criterion not in CRITERIA:
                raise ValueError(f"method {spec!r}: unknown criterion {criterion!r}; choose from {', '.join(CRITERIA)}")
        if rest.startswith("@"):
            try:
                rs = [float(rest[1:])]
            except ValueError:
                raise ValueError(f"method {spec!r}: the ratio after '@' must be a number, e.g. cacheblend@0.15") from None
        else:
            rs = list(ratios)
        # Explicit, so a method means the same whatever the engine's default strategy is.
        options = tuple(sorted(dict(options, strategy="hkvd" if strategy == "cacheblend" else strategy).items()))
        out = []
        for r in rs:
            BlendConfig(recompute_ratio=r, **dict(options))  # validates with a clear message
            name = cacheblend_name(r, criterion) if strategy in ("cacheblend", "hkvd") else f"{strategy}@{r:g}"
            out.append(Method(name + "".join("/" + o for o in opts), "kv", "cacheblend", r, criterion, options))
        return out
    raise ValueError(
        f"unknown method {spec!r}: choose from full_recompute, full_recompute_saved, prefix_caching, full_reuse, "
        "cacheblend[@RATIO][:CRITERION], question@RATIO, chunk@RATIO, hybrid@RATIO (each with /options), map_reduce, map_rerank, "
        "generate, llama_cpp[:QUANT], llama_cpp_prefix[:QUANT]"
    )


def require_neighbours(methods: Sequence[Method], neighbours: int, option: str) -> None:
    """Refuse ``/nb`` methods in a run that makes no neighbour-aware caches (``option``: how the
    caller's user passes ``neighbours``)."""
    if neighbours < 1 and any(dict(m.options).get("neighbour_caches") for m in methods):
        raise ValueError(f"methods with /nb need neighbour-aware caches: pass {option} (N >= 1)")


def parse_methods(specs: Sequence[str], ratios: Sequence[float] = DEFAULT_RATIOS) -> list[Method]:
    out: dict[str, Method] = {}
    for spec in specs:
        for m in parse_method(spec, ratios):
            out.setdefault(m.name, m)
    return list(out.values())


def answer_with_logits(engine, question: str, chunks: list[str], **kwargs: Any) -> tuple[GenerationResult, torch.Tensor]:
    """``engine.generate(question, chunks, **kwargs)`` plus the prefill's next-token logits."""
    stream = engine.stream(question, chunks, **kwargs)
    for _ in stream:
        pass
    assert stream.result is not None and stream.prefill_result is not None
    return stream.result, stream.prefill_result.logits


def run_kv(
    engine, method: Method, question: str, chunks: list[str], max_new_tokens: int, keep_writeback: bool = True
) -> tuple[dict, torch.Tensor]:
    """One greedy answer with an engine prefill mode; chunk caches must be precomputed first.

    Returns the row fields and the prefill's next-token logits (for fidelity to full prefill, taken
    from the timed run itself rather than an extra prefill). The call ends with ``settle``: its
    background write-back has finished, and unless ``keep_writeback`` the prefix entries it stored
    are dropped again (a repeated timing round must meet the prompt first-seen).
    """
    res, logits = answer_with_logits(
        engine,
        question,
        chunks,
        mode=method.mode,
        config=method.blend_config(engine.config),
        max_new_tokens=max_new_tokens,
        temperature=0.0,
    )
    s = res.stats
    settle(engine, s.get("writeback_keys", []), keep=keep_writeback)
    return {
        "answer": res.text.strip(),
        "ttft_s": res.ttft_s,
        "total_s": res.total_s,
        "prompt_tokens": s.get("prompt_tokens"),
        "context_tokens": s.get("context_tokens"),
        "chunk_hits": s.get("chunk_hits"),
        "chunk_misses": s.get("chunk_misses"),
        "recompute_fraction": s.get("recompute_fraction"),
        "compute_fraction": s.get("compute_fraction", s.get("recompute_fraction")),
        "generated_tokens": s.get("generated_tokens"),
    }, logits


def settle(engine, writeback_keys: Sequence[str], keep: bool) -> None:
    """End a timed call: wait for its background write-back, so it cannot overlap the next timing,
    and unless ``keep``, drop the prefix entries it stored, so that a repeated round of the same
    prompt meets it first-seen again (prefix caching would otherwise only load its own write-back).
    """
    engine.flush()
    if not keep:
        for key in writeback_keys:
            engine.store.discard(key)
