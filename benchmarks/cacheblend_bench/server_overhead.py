"""What the HTTP server adds to time to first token, measured side by side in one process.

    python -m cacheblend_bench.server_overhead [--questions 4] [--chunks 6] [--rounds 5]

One engine (default: the bundled model) answers each HotpotQA question over its first
``--chunks`` paragraphs (cached beforehand) twice per round: in process (``engine.stream``, time
to the first text delta) and through the server (a streamed POST /v1/chat/completions with the
same chunks as ``documents``, time from sending to the first content chunk received). The order
alternates per request so drift in machine load hits both alike. Reported, as median and
quartiles over all requests:

* paired ratio: server TTFT / in-process TTFT of the same question in the same round, minus 1;
* in-request overhead: (client TTFT - the engine's own ``ttft_s`` in the response) / ``ttft_s``,
  i.e. HTTP, JSON, queueing and the thread hop, free of request-to-request noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any

from cacheblend_bench.datasets import load_hotpotqa
from cacheblend_bench.server_load import openai_client, stream_answer
from cacheblend_rag.engine.core import CacheBlendEngine
from cacheblend_rag.server import ServerConfig, create_app
from cacheblend_rag.server.live import BackgroundServer
from cacheblend_rag.threads import release_team


def _in_process(engine: CacheBlendEngine, question: str, chunks: list[str], max_tokens: int) -> tuple[float, str]:
    t0 = time.perf_counter()
    stream = engine.stream(question, chunks, max_new_tokens=max_tokens)
    ttft = None
    for _ in stream:
        ttft = time.perf_counter() - t0 if ttft is None else ttft
    assert stream.result is not None and ttft is not None
    return ttft, stream.result.text


def _over_http(openai, model: str, question: str, chunks: list[str], max_tokens: int) -> tuple[float, float, str]:
    """(client TTFT, the engine's ttft_s as reported, answer text), asked with OpenAI's client."""
    # The in-process side runs the model on this thread; its OpenMP team would slow the server's
    # worker, which in a deployed server is the only thread with one.
    release_team()
    body = {"model": model, "messages": [{"role": "user", "content": question}], "documents": chunks, "max_tokens": max_tokens}
    row = stream_answer(openai, body)
    assert row["text"] and row["server_ttft_s"] is not None
    return row["ttft_s"], row["server_ttft_s"], row["text"]


def _spread(values: list[float]) -> dict[str, float]:
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": med, "p25": q1, "p75": q3, "min": min(values), "max": max(values)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cacheblend-overhead-") as store_dir:
        engine = CacheBlendEngine.from_pretrained(args.model, store_dir=args.store_dir or store_dir)
        try:
            examples = load_hotpotqa(limit=args.questions, distractor_questions=0)
            cases = [(ex.question, list(ex.documents[: args.chunks])) for ex in examples]
            engine.precompute([c for _, chunks in cases for c in chunks], progress=False)
            for question, chunks in cases:  # warm-up: first calls pay one-off allocation and compilation
                _in_process(engine, question, chunks, args.max_tokens)
            rows = []
            with (
                # Learning off: the server must do the in-process engine's work, over the same caches.
                BackgroundServer(create_app(engine, ServerConfig(learn_neighbours=False))) as server,
                openai_client(server.url, timeout_s=300.0) as openai,
            ):
                _over_http(openai, engine.model_id, *cases[0], args.max_tokens)
                for rnd in range(args.rounds):
                    for i, (question, chunks) in enumerate(cases):
                        server_first = (rnd + i) % 2 == 1
                        if server_first:
                            srv, eng_ttft, srv_text = _over_http(openai, engine.model_id, question, chunks, args.max_tokens)
                        local, local_text = _in_process(engine, question, chunks, args.max_tokens)
                        if not server_first:
                            srv, eng_ttft, srv_text = _over_http(openai, engine.model_id, question, chunks, args.max_tokens)
                        rows.append(
                            {
                                "question": i,
                                "round": rnd,
                                "in_process_ttft_s": local,
                                "server_ttft_s": srv,
                                "server_engine_ttft_s": eng_ttft,
                                "same_answer": local_text == srv_text,
                            }
                        )
        finally:
            engine.close()
    return {
        "model": engine.model_id,
        "questions": len(cases),
        "chunks": args.chunks,
        "rounds": args.rounds,
        "in_process_ttft_s": _spread([r["in_process_ttft_s"] for r in rows]),
        "server_ttft_s": _spread([r["server_ttft_s"] for r in rows]),
        "paired_ratio_minus_1": _spread([r["server_ttft_s"] / r["in_process_ttft_s"] - 1 for r in rows]),
        "in_request_overhead_s": _spread([r["server_ttft_s"] - r["server_engine_ttft_s"] for r in rows]),
        "in_request_overhead_fraction": _spread([r["server_ttft_s"] / r["server_engine_ttft_s"] - 1 for r in rows]),
        "same_answers": sum(r["same_answer"] for r in rows),
        "requests": len(rows),
        "rows": rows,
    }


# What a report shows, in order: (label, key of the result, whether it is a share of TTFT).
MEASURES = (
    ("TTFT in process", "in_process_ttft_s", False),
    ("TTFT through the server", "server_ttft_s", False),
    ("server / in-process \u2212 1, paired", "paired_ratio_minus_1", True),
    ("in-request overhead", "in_request_overhead_s", False),
    ("in-request overhead / engine TTFT", "in_request_overhead_fraction", True),
)


def _value(v: float, share: bool) -> str:
    return f"{100 * v:+.2f}%" if share else f"{1000 * v:.1f} ms"


def _setup(res: dict[str, Any]) -> str:
    return (
        f"{res['model']}: {res['questions']} HotpotQA questions x {res['chunks']} cached chunks x {res['rounds']} rounds "
        f"({res['requests']} request pairs; same answer text in {res['same_answers']})"
    )


def report(res: dict[str, Any]) -> str:
    lines = [_setup(res)]
    for name, key, share in MEASURES:
        s = {k: f"{_value(v, share):>9}" for k, v in res[key].items()}
        lines.append(f"{name:<34} median {s['median']}  [p25 {s['p25']}, p75 {s['p75']}]  range {s['min']} .. {s['max']}")
    return "\n".join(lines)


def markdown_table(res: dict[str, Any]) -> str:
    """The report as docs/server.md shows it (negative values with the docs' minus sign)."""
    lines = ["| | median | p25 .. p75 | range |", "|---|---|---|---|"]
    for name, key, share in MEASURES:
        s = {k: _value(v, share).replace("-", "\u2212") for k, v in res[key].items()}
        lines.append(f"| {name} | {s['median']} | {s['p25']} .. {s['p75']} | {s['min']} .. {s['max']} |")
    return "\n".join([*lines, "", _setup(res) + "."])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cacheblend_bench.server_overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=4, help="tokens per answer (only the first one is timed)")
    p.add_argument("--store-dir", default=None, help="chunk KV store (default: a temporary one)")
    p.add_argument("--json", default=None, help="also write every measurement to this JSON file")
    args = p.parse_args(argv)
    res = run(args)
    print(report(res))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
