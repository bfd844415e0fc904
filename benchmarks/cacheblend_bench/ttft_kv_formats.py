"""First-token time by chunk-record format: does a smaller record answer sooner?

    python -m cacheblend_bench.ttft_kv_formats --model smollm2 --n 15 \
        --out docs/results/ttft_kv_formats_smollm2.jsonl

One engine in the default weights. Per question (HotpotQA and MuSiQue, alternating), its retrieved
chunks are cached as by default (plain and neighbour-aware caches, neighbours from every chunk of
the run's questions) in one disk store per record format, all filled from the same computed K/V
(:class:`~cacheblend_bench.tee.TeeStore`). The default configuration then answers the first token
from each store in turn, ``--repeats`` times in rotated order after one untimed round, with full
prefill's first token timed in the same rounds as the reference. The records were just written,
so the page cache is warm: the time is reading, dequantizing on the loader's thread (overlapped
with the fused prefill) and the prefill, not the disk. With ``--cold`` each store's files are
dropped from the operating system's page cache (``posix_fadvise(DONTNEED)``, after a sync) right
before each timed answer from it, so its records come from the disk, as they do from a corpus
larger than memory. The memory tier is left out on purpose: it holds decoded tensors, so a memory
hit costs the same in every format.

Rows (one per question and format, resumable): the median TTFT over the repeats and full prefill's,
the bytes the store holds for the question's chunks, the engine and the machine.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import tempfile
from collections.abc import Sequence
from itertools import zip_longest
from pathlib import Path
from typing import Any

from tqdm import tqdm

from cacheblend_bench import datasets as ds
from cacheblend_bench import provenance
from cacheblend_bench.runner import BenchConfig, load_engine, read_results
from cacheblend_bench.stats import speedup
from cacheblend_bench.tee import TeeStore

FORMATS = ("float", "int8", "int4")
_LIBC = ctypes.CDLL(None, use_errno=True)


def run(
    model: str,
    n: int,
    out: Path,
    formats: Sequence[str] = FORMATS,
    repeats: int = 3,
    weights: str | None = None,
    cold: bool = False,
) -> list[dict]:
    """Measure (or resume) and return every row of ``out``. ``weights``: fp32 or fp16 (None: the
    format ``from_pretrained`` picks on this CPU); ``cold``: each timed answer reads its store's
    records from the disk, not the page cache."""
    from cacheblend_bench.headline import default_format
    from cacheblend_rag.cli.ask import ASK_NEIGHBOURS
    from cacheblend_rag.cli.store import disk_stats
    from cacheblend_rag.store.disk import KVStore

    rows = read_results(out)
    done = {(r["dataset"], r["qid"], r["kv_format"]) for r in rows}
    groups = [ds.load_dataset(d, n) for d in ("hotpotqa", "musique")]
    examples = [ex for g in zip_longest(*groups) for ex in g if ex is not None]
    todo = [ex for ex in examples if any((ex.dataset, ex.qid, f) not in done for f in formats)]
    if not todo:
        return rows
    out.parent.mkdir(parents=True, exist_ok=True)
    weights = weights or default_format()
    with tempfile.TemporaryDirectory(prefix="ttft-kv-formats-") as tmp:
        engine = load_engine(BenchConfig(model=model, out_dir=tmp), weights=weights)
        retriever, count = ds.Retriever(), ds.token_counter(engine.tokenizer)
        prompts = {ex.qid: ds.retrieve(ex, retriever, count, 512, 6) for ex in examples}
        corpus = list(dict.fromkeys(c for chunks in prompts.values() for c in chunks))
        try:
            with out.open("a", encoding="utf-8") as sink:
                for i, ex in enumerate(tqdm(todo, desc="ttft by record format", unit="question")):
                    chunks = prompts[ex.qid]
                    prompt_tokens = len(engine.build_layout(ex.question, chunks))
                    stores = {
                        f: KVStore(Path(tmp) / f"q{i}-{f}", fingerprint=engine.fingerprint, kv_format=None if f == "float" else f)
                        for f in formats
                    }
                    try:
                        engine.precompute(
                            chunks,
                            neighbours=ASK_NEIGHBOURS,
                            corpus=corpus,
                            embed=retriever.embed,
                            store=TeeStore(list(stores.values())),
                            progress=False,
                        )
                        times = _first_token_times(engine, ex.question, chunks, stores, repeats, cold)
                        full_s = statistics.median(times["full"])
                        for f in formats:
                            held = disk_stats(stores[f].directory)
                            row = {
                                "model": model,
                                "dataset": ex.dataset,
                                "qid": ex.qid,
                                "kv_format": f,
                                "weights": weights,
                                "page_cache": "cold" if cold else "warm",
                                "prompt_tokens": prompt_tokens,
                                "ttft_s": statistics.median(times[f]),
                                "ttft_runs_s": times[f],
                                "full_ttft_s": full_s,
                                "store_bytes": sum(s.bytes for s in held.formats.values()),
                                "store_tokens": sum(s.tokens for s in held.formats.values()),
                                "engine": provenance.engine_stamp(),
                                "engine_source": provenance.engine_source_now(),
                                "machine": provenance.machine_stamp(),
                            }
                            sink.write(json.dumps(row) + "\n")
                            sink.flush()
                            rows.append(row)
                    finally:
                        for s in stores.values():
                            s.close()
        finally:
            engine.close()
    return rows


def _first_token_times(
    engine, question: str, chunks: list[str], stores: dict[str, Any], repeats: int, cold: bool = False
) -> dict[str, list[float]]:
    """First-token seconds from each store and of full prefill ("full"), ``repeats`` rounds in
    rotated order after an untimed round that warms each path (``cold``: but not the records)."""
    order = [*stores, "full"]
    times: dict[str, list[float]] = {name: [] for name in order}
    for rnd in range(repeats + 1):
        for name in order[rnd % len(order) :] + order[: rnd % len(order)]:
            if cold and name != "full":
                drop_page_cache(stores[name].directory)
            kw = {"mode": "full_recompute"} if name == "full" else {"store": stores[name]}
            res = engine.generate(question, chunks, max_new_tokens=1, temperature=0.0, **kw)
            if rnd:
                times[name].append(res.ttft_s)
    return times


def drop_page_cache(directory: Path) -> int:
    """Flush every record file of the disk store in ``directory`` (diskcache's ``*.val``) and drop
    it from the page cache, so that its next read comes from the disk; returns the bytes dropped.
    Records under 32 KB (a layer of a chunk of fewer than ~150 tokens in int4) live in diskcache's
    SQLite index, which stays mapped, so they stay warm. RuntimeError where the pages stay (a folder in
    memory, e.g. tmpfs): a cold measurement there would silently be a warm one."""
    dropped = 0
    for path in Path(directory).rglob("*.val"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped: write them out first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if resident_bytes(path):
            raise RuntimeError(
                f"{path} stays in memory after posix_fadvise(DONTNEED) (a tmpfs?): set TMPDIR to a folder on a disk"
            )
        dropped += path.stat().st_size
    return dropped


def resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache (``mincore`` over a private mapping of it)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
        start = ctypes.c_char.from_buffer(mapped)
        pages = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        try:
            if _LIBC.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), pages):
                raise OSError(ctypes.get_errno(), f"mincore({path})")
        finally:
            del start  # the mapping cannot close while a ctypes object exports it
        return sum(p & 1 for p in pages) * mmap.PAGESIZE


def summarize(rows: list[dict]) -> list[dict]:
    """Per format, over the questions every format answered: mean TTFT, its speed-up over the
    float records' and over full prefill (paired intervals), and bytes per stored token."""
    by_q: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        by_q.setdefault((r["dataset"], r["qid"]), {})[r["kv_format"]] = r
    formats = list(dict.fromkeys(r["kv_format"] for r in rows))
    complete = [q for q in by_q.values() if all(f in q for f in formats)]
    out = []
    for f in formats:
        mine = [q[f]["ttft_s"] for q in complete]
        vs_float, vs_float_ci = speedup([q["float"]["ttft_s"] for q in complete], mine) if "float" in formats else (None, None)
        vs_full, vs_full_ci = speedup([q[f]["full_ttft_s"] for q in complete], mine)
        out.append(
            {
                "kv_format": f,
                "n": len(complete),
                "ttft_ms": 1000 * statistics.fmean(mine) if mine else float("nan"),
                "vs_float": vs_float,
                "vs_float_ci": vs_float_ci,
                "vs_full": vs_full,
                "vs_full_ci": vs_full_ci,
                "bytes_per_token": sum(q[f]["store_bytes"] for q in complete)
                / max(1, sum(q[f]["store_tokens"] for q in complete)),
                "prompt_tokens": statistics.fmean(q[f]["prompt_tokens"] for q in complete) if complete else float("nan"),
            }
        )
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| chunk records | bytes per stored token | first token (ms) | speed-up over float records | over full prefill | questions |",
        "|---|---|---|---|---|---|",
    ]
    for e in summarize(rows):
        lines.append(
            f"| {e['kv_format']} | {e['bytes_per_token']:,.0f} | {e['ttft_ms']:.0f} | "
            f"{e['vs_float']:.2f}x [{e['vs_float_ci'][0]:.2f}, {e['vs_float_ci'][1]:.2f}] | "
            f"{e['vs_full']:.2f}x [{e['vs_full_ci'][0]:.2f}, {e['vs_full_ci'][1]:.2f}] | {e['n']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cacheblend_bench.ttft_kv_formats", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 (default), qwen2.5-coder-0.5b, qwen2.5-coder-1.5b or a path")
    p.add_argument("--n", type=int, default=15, help="questions per dataset (HotpotQA and MuSiQue; default 15)")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma list of record formats (default float,int8,int4)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--weights", default=None, choices=("fp32", "fp16"), help="the engine's weights (default: what from_pretrained picks)"
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="read each store's records from the disk: drop them from the page cache before each timed answer",
    )
    p.add_argument("--out", required=True, help="rows file (JSON lines; a rerun resumes it)")
    args = p.parse_args(argv)
    rows = run(args.model, args.n, Path(args.out), tuple(args.formats.split(",")), args.repeats, args.weights, args.cold)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
