"""Does a second thread slow the model's? ``python -m cacheblend_bench.threads``

Times a small parallel torch operator (the kind a fused prefill and a decode step are made of) on
the main thread. Then, per case:

- helper: a helper thread copies one prompt's worth of K/V and stays alive, as the engine's
  write-back thread does, and the operator is timed again on the main thread;
- hand-over: a new thread, as the batcher's or the server's worker, times the operator while the
  main thread (which ran torch before, as loading the model does) keeps its OpenMP team, or after
  it released it (``release_team``, as ``Batcher`` and the server do).

Each case runs in a fresh process, since an OpenMP team lasts as long as its thread. Prints the
time per operator before and after and their ratio, median of ``--repeats`` processes per case.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time


def _op_us(x, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        x.add(1.0)
    return (time.perf_counter() - t0) / n * 1e6


CASES = {
    "helper from ThreadPoolExecutor": "main thread, after",
    "helper from helper_pool": "main thread, after",
    "hand-over, caller keeps its team": "new thread",
    "hand-over after release_team": "new thread",
}


# How the docs describe each case.
DESCRIPTIONS = {
    "helper from ThreadPoolExecutor": "helper thread from a plain `ThreadPoolExecutor` copied one layer of K/V",
    "helper from helper_pool": "helper thread from `helper_pool` (single-threaded)",
    "hand-over, caller keeps its team": "new model thread while the main thread keeps its team",
    "hand-over after release_team": "new model thread after the main thread's `release_team()`",
}
LINE = re.compile(
    r"^(?P<kind>.+?)\s*: small operator\s+(?P<before>[\d.]+) us on the main thread alone,\s+(?P<after>[\d.]+) us "
    r"on the (?P<where>.+?) \([\d.]+x; torch threads (?P<threads>\d+), (?P<processes>\d+) processes\)$"
)


def parse_report(text: str) -> list[dict]:
    """The cases of a saved report (what ``main`` prints), in order."""
    out = []
    for line in text.splitlines():
        m = LINE.match(line.strip())
        if m:
            out.append(
                {
                    "kind": m["kind"],
                    "before_us": float(m["before"]),
                    "after_us": float(m["after"]),
                    "where": m["where"],
                    "threads": int(m["threads"]),
                    "processes": int(m["processes"]),
                }
            )
    if not out:
        raise ValueError("no case lines in the report (python -m cacheblend_bench.threads prints them)")
    return out


def markdown_table(cases: list[dict]) -> str:
    """A report's cases as the docs' table: the small operator's time before and after, and their ratio."""
    lines = ["| case | small operator: main thread alone → afterwards | ratio |", "|---|---|---|"]
    for c in cases:
        thread = "main thread" if c["where"].startswith("main") else c["where"]
        lines.append(
            f"| {DESCRIPTIONS.get(c['kind'], c['kind'])} | {c['before_us']:.1f} → {c['after_us']:.1f} µs ({thread}) "
            f"| {c['after_us'] / c['before_us']:.2f}x |"
        )
    return "\n".join(lines)


def _child(kind: str, n: int) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from cacheblend_rag.threads import helper_pool, release_team

    x = torch.randn(300_000)  # ~10 grain sizes: torch runs it on every thread
    _op_us(x, n)  # warm-up; the main thread's own team exists from here on
    before = _op_us(x, n)
    if kind.startswith("helper"):
        pool = helper_pool("bench-helper") if kind.endswith("helper_pool") else ThreadPoolExecutor(1)
        # One prompt's K/V for one layer (3k tokens, 3 K/V heads x 64 x 30): the write-back's copy.
        pool.submit(lambda: torch.randn(3, 3000, 64 * 30)[:, 100:2900].contiguous()).result()
        after = _op_us(x, n)
    else:
        if kind.endswith("release_team"):
            release_team()
        pool = ThreadPoolExecutor(1)
        pool.submit(_op_us, x, n).result()  # warm-up: the new thread's team
        after = pool.submit(_op_us, x, n).result()
    pool.shutdown()
    return {"kind": kind, "before_us": before, "after_us": after, "torch_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="processes per helper kind")
    p.add_argument("--ops", type=int, default=3000, help="operators timed per measurement")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.ops)))
        return
    for kind, where in CASES.items():
        runs = [
            json.loads(
                subprocess.run(
                    [sys.executable, "-m", "cacheblend_bench.threads", "--child", kind, "--ops", str(args.ops)],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
            )
            for _ in range(args.repeats)
        ]
        before = statistics.median(r["before_us"] for r in runs)
        after = statistics.median(r["after_us"] for r in runs)
        print(
            f"{kind:33s}: small operator {before:6.1f} us on the main thread alone, {after:6.1f} us on the {where} "
            f"({after / before:.2f}x; torch threads {runs[0]['torch_threads']}, {args.repeats} processes)"
        )


if __name__ == "__main__":
    main()
