"""A corpus ingestion killed with ``kill -9`` at a random point and run again (docs/storage.md).

``python -m cacheblend_bench.ingest_kill CORPUS --store-dir DIR --out ROW.json`` runs
``cacheblend-rag ingest CORPUS`` (one thread by default), kills it with SIGKILL after a random
number of seconds, runs the same command again to the end, then checks the store: a dry run finds
every chunk cached and none to compute, every layer of every chunk reads back, and the two runs
together computed each chunk once (what the first stored is what the second found cached). The
row holds the plan, both runs' counts and times, the store's bytes by ``store stats`` and the
machine (``provenance.machine_stamp``). Extra arguments after ``--`` go to ``ingest``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cacheblend_bench import provenance

PLAN = re.compile(r"([\d,]+) chunks \(([\d,]+) cached, ([\d,]+) to compute[^)]*\), ([\d,]+) tokens")
WHOLE = re.compile(r"bytes to store in (\S+) \([\d,.]+ bytes per token\), ([\d,]+) for the whole corpus")
DONE = re.compile(r"computed ([\d,]+) chunk caches in ([\d.]+) s")


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def parse_log(text: str) -> dict[str, Any]:
    """The plan line (chunks, cached, to compute, tokens) and, for a run that finished, what it computed and in how long."""
    m = PLAN.search(text)
    if m is None:
        raise ValueError("no plan line in the ingest log: did the command start?")
    out: dict[str, Any] = dict(zip(("chunks", "cached", "to_compute", "tokens"), map(_int, m.groups())))
    whole = WHOLE.search(text)
    if whole is not None:
        out.update(kv_format=whole.group(1), corpus_bytes=_int(whole.group(2)))
    done = DONE.search(text)
    if done is not None:
        out.update(computed=_int(done.group(1)), seconds=float(done.group(2)))
    return out


def ingest_command(corpus: str, store_dir: str, ingest_args: Sequence[str], *extra: str) -> list[str]:
    """The ``cacheblend-rag ingest`` command every step of the run shares (``extra`` last, so it wins)."""
    return ["cacheblend-rag", "ingest", corpus, "--store-dir", store_dir, *ingest_args, *extra]


def _plan_of(corpus: str, store_dir: str, ingest_args: Sequence[str], *extra: str, check: bool) -> dict[str, Any]:
    """The plan a dry run prints (``check`` False: a refusal still prints the plan first)."""
    done = subprocess.run(
        ingest_command(corpus, store_dir, ingest_args, *extra, "--dry-run"), capture_output=True, text=True, check=check
    )
    return parse_log(done.stdout + done.stderr)


def _ingest(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )


def check_store(store_dir: str, corpus: str, ingest_args: Sequence[str]) -> dict[str, Any]:
    """Every chunk of ``corpus`` (split as ``ingest`` splits it) has every layer readable in the store."""
    from cacheblend_rag.cli.app import build_parser
    from cacheblend_rag.cli.flags import open_engine
    from cacheblend_rag.cli.ingest import read_corpus

    args = build_parser().parse_args(["ingest", corpus, "--store-dir", store_dir, *ingest_args])
    engine = open_engine(args, store_size_limit=args.store_size_limit, memory_bytes=0)
    try:
        chunks = read_corpus(args.paths, engine.tokenizer, args.chunk_tokens)
        keys = list(dict.fromkeys(engine.chunk_key(engine.prompts.chunk_segment(c)) for c in chunks))
        unreadable = [k for k in keys if any(engine.store.get_layer(k, i) is None for i in range(engine.num_layers))]
    finally:
        engine.close()
    return {"distinct_chunks": len(keys), "unreadable": len(unreadable)}


def run(
    corpus: str,
    store_dir: str,
    out: Path,
    *,
    kill_after: float,
    threads: int,
    ingest_args: Sequence[str],
) -> dict:
    folder = out.parent
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = ingest_command(corpus, store_dir, ingest_args)
    first = _ingest(command, folder / "ingest.1.log", env)
    try:
        first.wait(timeout=kill_after)
        raise SystemExit(f"the ingestion ended (exit {first.returncode}) before the kill at {kill_after:.0f} s: kill it sooner")
    except subprocess.TimeoutExpired:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    t0 = time.perf_counter()
    second = _ingest(command, folder / "ingest.2.log", env)
    if second.wait() != 0:
        raise SystemExit(f"the second ingestion failed (exit {second.returncode}): see {folder / 'ingest.2.log'}")
    return summarize(
        corpus,
        store_dir,
        out,
        kill_after=kill_after,
        threads=threads,
        ingest_args=ingest_args,
        second_wall_s=time.perf_counter() - t0,
    )


def summarize(
    corpus: str,
    store_dir: str,
    out: Path,
    *,
    kill_after: float,
    threads: int,
    ingest_args: Sequence[str],
    second_wall_s: float | None = None,
) -> dict:
    """The row of a finished kill-and-resume: the logs next to ``out`` and the store checked now."""
    folder = out.parent
    try:
        first: dict[str, Any] = parse_log((folder / "ingest.1.log").read_text(encoding="utf-8", errors="replace"))
    except ValueError:
        first = {}  # killed before it printed its plan
    second = parse_log((folder / "ingest.2.log").read_text(encoding="utf-8", errors="replace"))
    if "computed" not in second:
        raise ValueError("the second ingestion has no summary line: it did not finish")
    after = _plan_of(corpus, store_dir, ingest_args, check=True)
    # What the same corpus takes in float records: the store's limit may refuse it.
    in_float = _plan_of(corpus, store_dir, ingest_args, "--kv-format", "float", check=False).get("corpus_bytes")
    stats = subprocess.run(
        ["cacheblend-rag", "store", "stats", "--store-dir", store_dir, "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    row = {
        "corpus": Path(corpus).name,
        "ingest_args": list(ingest_args),
        "threads": threads,
        "kill_after_s": kill_after,
        "first": first,
        "second": {
            **second,
            **({"wall_s": second_wall_s} if second_wall_s is not None else {}),
        },
        "after": after,
        "float_corpus_bytes": in_float,
        # What the killed run stored is what the second found cached; together they computed each chunk once.
        "stored_by_killed_run": second["cached"],
        "computed_in_all": second["cached"] + second["computed"],
        "check": check_store(store_dir, corpus, ingest_args),
        "store": json.loads(stats.stdout),
        "machine": provenance.machine_stamp(),
        "engine": provenance.engine_stamp(),
        "engine_source": provenance.engine_source_now(),
    }
    out.write_text(json.dumps(row, indent=1) + "\n", encoding="utf-8")
    return row


def hotpotqa_corpus(path: Path, docs: int, hotpotqa: str | None = None) -> Path:
    """Write the first ``docs`` distinct paragraphs of HotpotQA's dev set (title, then text) as a
    JSONL corpus, one document a line."""
    from cacheblend_bench.datasets import hotpotqa_path

    seen: set[str] = set()
    with path.open("w", encoding="utf-8") as out:
        for ex in json.loads(Path(hotpotqa or hotpotqa_path()).read_text(encoding="utf-8")):
            for title, sentences in ex["context"]:
                if title not in seen and len(seen) < docs:
                    seen.add(title)
                    out.write(json.dumps({"text": title + "\n" + "".join(sentences)}) + "\n")
            if len(seen) >= docs:
                return path
    raise ValueError(f"HotpotQA's dev set has only {len(seen)} distinct paragraphs, fewer than {docs}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cacheblend_bench.ingest_kill",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("corpus", help="what ingest reads: a folder, files or a JSONL corpus")
    p.add_argument(
        "--store-dir",
        required=True,
        help="a store directory of its own (the run fills it)",
    )
    p.add_argument("--out", required=True, type=Path, help="the row (JSON); the logs go next to it")
    p.add_argument(
        "--kill-after",
        default="600:1800",
        help="seconds before the kill, or a range MIN:MAX to draw from",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--summarize-only",
        action="store_true",
        help="write the row from the logs already next to --out",
    )
    p.add_argument(
        "--hotpotqa-docs",
        type=int,
        default=None,
        help="first write CORPUS: this many distinct HotpotQA dev paragraphs as JSONL (9,000 make 10,256 chunks)",
    )
    args, rest = p.parse_known_args(argv)
    ingest_args = [a for a in rest if a != "--"]
    if args.hotpotqa_docs:
        hotpotqa_corpus(Path(args.corpus), args.hotpotqa_docs)
    lo, _, hi = args.kill_after.partition(":")
    kill_after = random.uniform(float(lo), float(hi or lo))
    if args.summarize_only:
        row = summarize(
            args.corpus,
            args.store_dir,
            args.out,
            kill_after=kill_after,
            threads=args.threads,
            ingest_args=ingest_args,
        )
    else:
        row = run(
            args.corpus,
            args.store_dir,
            args.out,
            kill_after=kill_after,
            threads=args.threads,
            ingest_args=ingest_args,
        )
    json.dump(row, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
