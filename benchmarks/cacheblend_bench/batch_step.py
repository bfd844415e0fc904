"""What a batched decode step costs: one step for 1, 2, 4 and 8 answers after a RAG-sized prompt.

The batcher (``serving/batcher.py``) decodes every running answer in one forward per token. How
much that saves depends on how the step's cost grows with the answers in it: the weights are read
once per step, but each answer's K/V is read for its own attention. This times the engine's fast
decode step (``decode_step.FastDecodeStep``) alone and batched, over caches of ``--tokens``
positions per answer (random K/V: the cost does not depend on the values), per weight format.

    python -m cacheblend_bench.batch_step --formats fp32,fp16 --rows 1,2,4,8 --tokens 2500 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cacheblend_rag.decode.cache import stacked_cache


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def _stepper(step, cache, n: int, tokens: int) -> Callable[[], None]:
    """One decode step for the ``n`` answers of ``cache``; each call appends a token per answer, as
    decoding does (the lone answer takes the step an answer decoded alone takes)."""
    length = [tokens]

    def one_step() -> None:
        if n == 1:
            step(5, length[0], cache)
        else:
            step.batched([5] * n, [length[0]] * n, cache, torch.ones(n, length[0] + 1, dtype=torch.long))
        length[0] += 1

    return one_step


def measure(engine, rows: Sequence[int], tokens: int, repeats: int = 20) -> list[dict[str, Any]]:
    """Per batch size: the step's median time and its time per answer (``rows`` 1 is the step an
    answer decoded alone takes)."""
    step = engine.fast_step
    if step is None:
        raise ValueError("this model decodes through its forward (no fast decode step): nothing to time here")
    cfg = engine.model.config
    kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    layers, dtype = cfg.num_hidden_layers, engine.dtype
    out = []
    with torch.inference_mode():
        for n in rows:
            answer = (
                [torch.randn(kv_heads, tokens, head_dim, dtype=dtype) for _ in range(layers)],
                [torch.randn(kv_heads, tokens, head_dim, dtype=dtype) for _ in range(layers)],
            )
            ms = _median_ms(_stepper(step, stacked_cache([answer] * n, room=repeats + 2), n, tokens), repeats)
            out.append({"rows": n, "step_ms": ms, "per_answer_ms": ms / n})
    return out


def markdown_table(result: dict[str, Any]) -> str:
    lines = ["| format | answers in the step | step (ms) | per answer (ms) | vs one answer alone |", "|---|---|---|---|---|"]
    for fmt, entries in result["formats"].items():
        alone = entries[0]["step_ms"]
        for e in entries:
            lines.append(
                f"| {fmt} | {e['rows']} | {e['step_ms']:.1f} | {e['per_answer_ms']:.1f} | {alone / e['per_answer_ms']:.2f}x |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from cacheblend_rag.engine.core import CacheBlendEngine

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model path (default: the bundled SmolLM2-135M)")
    p.add_argument("--formats", default="fp32,fp16", help="comma list of weight formats (default fp32,fp16)")
    p.add_argument("--rows", default="1,2,4,8", help="comma list of batch sizes (default 1,2,4,8; the first is the reference)")
    p.add_argument("--tokens", type=int, default=2500, help="cached positions per answer (default 2500, a 6-chunk RAG prompt)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    result: dict[str, Any] = {"tokens": args.tokens, "repeats": args.repeats, "threads": torch.get_num_threads(), "formats": {}}
    for fmt in args.formats.split(","):
        engine = CacheBlendEngine.from_pretrained(args.model, weights=fmt)
        try:
            result["formats"][fmt] = measure(engine, rows, args.tokens, args.repeats)
        finally:
            engine.close()
    print(markdown_table(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
