"""Ingestion throughput: chunks per second of ``cacheblend-rag ingest`` by model, threads and
neighbour-aware caches (docs/storage.md).

    python -m cacheblend_bench.ingest_rate --docs 60 --out docs/results/ingest_rate.jsonl \
        --config smollm2:1:0 --config smollm2:2:0 --config smollm2:2:2 \
        --config qwen2.5-coder-0.5b:2:0 --config qwen2.5-coder-0.5b:2:2

Each ``--config MODEL:THREADS:NEIGHBOURS`` ingests the same corpus (the first ``--docs`` distinct
HotpotQA dev paragraphs, split as ``ask`` splits them) into a fresh store, as a process of its
own with ``OMP_NUM_THREADS=THREADS``, and reads what ``ingest`` prints: the chunks and tokens it
computed, the caches (a chunk's plain and, with neighbours, its neighbour-aware one) and the
seconds its computing took (loading the model excluded). Chunks per second count a chunk once
all its caches are stored. Extra arguments after
``--`` go to every ``ingest`` (``--kv-format int8``). Rows (one per config, resumable) carry the
machine and the engine; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cacheblend_bench import provenance
from cacheblend_bench.ingest_kill import hotpotqa_corpus, ingest_command, parse_log
from cacheblend_bench.runner import read_results


def parse_config(spec: str) -> tuple[str, int, int]:
    """``MODEL:THREADS:NEIGHBOURS`` -> its parts (ValueError naming the form otherwise)."""
    model, threads, neighbours = (spec.rsplit(":", 2) + ["", ""])[:3]
    if not (model and threads.isdigit() and neighbours.isdigit() and int(threads) > 0):
        raise ValueError(f"--config {spec!r}: write MODEL:THREADS:NEIGHBOURS, e.g. smollm2:2:0")
    return model, int(threads), int(neighbours)


def model_args(model: str) -> list[str]:
    """``ingest``'s model option for a benchmark model name (``smollm2``: the bundled model, none)."""
    from cacheblend_bench.qwen import MODELS, qwen_gguf_path

    if model in ("smollm2", "default"):
        return []
    return ["--model", str(qwen_gguf_path(model=MODELS[model])) if model in MODELS else model]


def measure(corpus: Path, model: str, threads: int, neighbours: int, ingest_args: Sequence[str]) -> dict[str, Any]:
    """One ingestion of ``corpus`` into a fresh store; its plan, counts and seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory(prefix="ingest-rate-") as store:
        command = ingest_command(str(corpus), store, [*model_args(model), "--neighbours", str(neighbours), *ingest_args])
        done = subprocess.run(command, capture_output=True, text=True, env=env)
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{log[-2000:]}")
    got = parse_log(log)
    if "computed" not in got:
        raise RuntimeError(f"no summary line in the ingest output:\n{log[-2000:]}")
    return got


def run(corpus: Path, configs: Sequence[str], out: Path, ingest_args: Sequence[str] = ()) -> list[dict]:
    rows = read_results(out)
    done = {r["config"] for r in rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    for spec in configs:
        model, threads, neighbours = parse_config(spec)
        if spec in done:
            continue
        got = measure(corpus, model, threads, neighbours, ingest_args)
        row = {
            "config": spec,
            "model": model,
            "threads": threads,
            "neighbours": neighbours,
            "ingest_args": list(ingest_args),
            "corpus": corpus.name,
            **got,
            # Per corpus chunk with all its caches (with neighbours, ``computed`` counts both caches).
            "chunks_per_s": got["to_compute"] / got["seconds"],
            "tokens_per_s": got["tokens"] / got["seconds"],
            "engine": provenance.engine_stamp(),
            "engine_source": provenance.engine_source_now(),
            "machine": provenance.machine_stamp(),
        }
        with out.open("a", encoding="utf-8") as sink:
            sink.write(json.dumps(row) + "\n")
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| model | threads | neighbour-aware caches | chunks | caches computed | tokens | seconds | chunks per second | tokens per second |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        nb = f"{r['neighbours']} neighbours" if r["neighbours"] else "no"
        lines.append(
            f"| {r['model']} | {r['threads']} | {nb} | {r['to_compute']:,} | {r['computed']:,} | {r['tokens']:,} | {r['seconds']:.0f} "
            f"| {r['chunks_per_s']:.2f} | {r['tokens_per_s']:,.0f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cacheblend_bench.ingest_rate", description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=60, help="distinct HotpotQA dev paragraphs in the corpus (default 60)")
    p.add_argument("--corpus", type=Path, default=None, help="ingest this corpus instead (a folder, files or JSONL)")
    p.add_argument("--config", action="append", required=True, help="MODEL:THREADS:NEIGHBOURS (repeatable)")
    p.add_argument("--out", type=Path, required=True, help="rows (JSON lines; a rerun skips the configs done)")
    args, rest = p.parse_known_args(argv)
    for spec in args.config:
        parse_config(spec)  # every config checked before the first ingestion starts
    with tempfile.TemporaryDirectory(prefix="ingest-rate-corpus-") as tmp:
        corpus = args.corpus or hotpotqa_corpus(Path(tmp) / f"hotpotqa_{args.docs}.jsonl", args.docs)
        rows = run(corpus, args.config, args.out, [a for a in rest if a != "--"])
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
