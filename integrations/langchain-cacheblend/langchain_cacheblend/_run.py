"""One answer from the engine: a CacheBlend request over chunks, or a plain chat prefill without any.

Both paths stream text deltas and end with a :class:`RunResult` carrying the engine's stats. A
per-engine lock serializes work on one engine: LangChain's ``batch`` and background precompute
run in threads, and one model forward at a time is also what the CPU can actually do.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from cacheblend_rag.config import SamplingParams
from cacheblend_rag.generation import decode

_locks: "weakref.WeakKeyDictionary[object, threading.Lock]" = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()


def engine_lock(engine: object) -> threading.Lock:
    """The lock that serializes generation and precompute on ``engine``."""
    with _locks_guard:
        lock = _locks.get(engine)
        if lock is None:
            lock = _locks[engine] = threading.Lock()
        return lock


@dataclass(frozen=True)
class Request:
    """What the engine is asked.

    With ``chunks`` it is ``engine.generate(question, chunks)``. Without chunks it is a plain chat:
    ``messages`` (role/content dicts) go through the model's chat template with a full prefill.
    """

    question: str
    chunks: tuple[str, ...] = ()
    messages: tuple[dict[str, str], ...] = ()
    chunk_source: str = "none"
    """Where the chunks came from: "explicit" (flagged blocks, dicts), "matched" (known chunk
    texts found in the prompt) or "none"."""
    chunks_matched: int = 0
    """How many known chunk texts the registry found in the prompt (0 for explicit inputs)."""

    @property
    def plain(self) -> bool:
        return not self.chunks


@dataclass
class RunResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)


class Run:
    """Iterate to get the answer's text deltas; ``result`` is set once the iteration ends.

    Creating a run validates the request (e.g. a context that does not fit raises here), so errors
    surface before any streaming starts.
    """

    def __init__(self, engine, request: Request, *, engine_kwargs: dict[str, Any]):
        self.engine = engine
        self.request = request
        self.result: RunResult | None = None
        self.cancelled = threading.Event()
        self._cache_read = 0
        if request.plain:
            self._plain_ids = _plain_prompt_ids(engine, request.messages)
            _check_fits(engine, len(self._plain_ids), engine_kwargs["max_new_tokens"])
            self._params = SamplingParams(
                engine_kwargs["max_new_tokens"],
                engine_kwargs["temperature"],
                engine_kwargs["top_p"],
                engine_kwargs["top_k"],
                tuple(engine_kwargs.get("stop") or ()),
                engine_kwargs.get("seed"),
            )
        else:
            self._stream = engine.stream(request.question, list(request.chunks), **engine_kwargs)

    def __iter__(self) -> Iterator[str]:
        with engine_lock(self.engine):
            if not self.request.plain:
                self._cache_read = _cached_chunk_tokens(self.engine, self._stream)
            deltas = self._run_plain() if self.request.plain else self._run_engine()
            try:
                for delta in deltas:
                    yield delta
                    if self.cancelled.is_set():
                        return
            finally:
                deltas.close()

    def _run_engine(self) -> Iterator[str]:
        yield from self._stream
        res = self._stream.result
        assert res is not None
        stats = dict(res.stats)
        if stats.get("mode") == "prefix_caching":
            stats["cache_read_tokens"] = int(stats.get("reused_prefix_tokens", 0))
        else:
            stats["cache_read_tokens"] = self._cache_read
        self.result = RunResult(res.text, list(res.token_ids), res.finish_reason, stats)

    def _run_plain(self) -> Iterator[str]:
        eng = self.engine
        t0 = time.perf_counter()
        ids = torch.tensor([self._plain_ids], dtype=torch.long, device=eng.device)
        with torch.inference_mode():
            out = eng.model(input_ids=ids, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - t0
        cache = getattr(out, "cache", None)
        if cache is None:  # transformers < 5.24 names it past_key_values
            cache = out.past_key_values
        ttft = [0.0]

        def first() -> None:
            ttft[0] = time.perf_counter() - t0

        state = yield from decode(eng.model, eng.tokenizer, cache, out.logits[0, -1].float(), ids.shape[1], self._params, first)
        n = ids.shape[1]
        stats = {
            "mode": "plain_chat",
            "prompt_tokens": n,
            "context_tokens": 0,
            "chunks": 0,
            "chunk_hits": 0,
            "chunk_misses": 0,
            "recomputed_per_layer": [n] * eng.num_layers,
            "recompute_fraction": 1.0,
            "prefill_s": prefill_s,
            "ttft_s": ttft[0],
            "total_s": time.perf_counter() - t0,
            "generated_tokens": len(state.token_ids),
            "cache_read_tokens": 0,
        }
        self.result = RunResult(state.text, list(state.token_ids), state.finish_reason, stats)


def _cached_chunk_tokens(engine, stream) -> int:
    """Tokens of the chunks whose KV the coming prefill reads from the store instead of computing.

    Checked under the engine lock after the pending write-backs finished, so it sees exactly the
    store the prefill will see. ``full_recompute`` reads nothing.
    """
    if stream.mode == "full_recompute":
        return 0
    engine.flush()
    return sum(
        len(seg) for seg in stream.layout.segments if seg.reusable and engine.store.contains(engine.chunk_key(seg))
    )


def _plain_prompt_ids(engine, messages: Sequence[dict[str, str]]) -> list[int]:
    tok = engine.tokenizer
    msgs = list(messages)
    if getattr(tok, "chat_template", None):
        try:
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except Exception:
            # Templates without a system role: fold system text into the next user turn.
            text = tok.apply_chat_template(_fold_system(msgs), tokenize=False, add_generation_prompt=True)
    else:
        text = "\n\n".join(m["content"] for m in msgs) + "\nAnswer:"
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _fold_system(msgs: list[dict[str, str]]) -> list[dict[str, str]]:
    out, pending = [], []
    for m in msgs:
        if m["role"] == "system":
            pending.append(m["content"])
            continue
        if pending and m["role"] == "user":
            m = {"role": "user", "content": "\n\n".join(pending + [m["content"]])}
            pending = []
        out.append(m)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


def _check_fits(engine, n: int, reserve: int) -> None:
    if n + reserve > engine.context_window:
        raise ValueError(
            f"the prompt is {n} tokens plus {reserve} to generate, more than the model's context "
            f"window of {engine.context_window} tokens: shorten the prompt or lower max_new_tokens"
        )
