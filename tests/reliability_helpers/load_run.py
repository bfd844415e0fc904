"""Load run for docs/reliability.md: N requests from T threads through one engine vs one caller.

    python3 tests/reliability_helpers/load_run.py --requests 64 --threads 8 [--bundled]

Prints how many concurrent answers equal the single-caller answer (token ids), store counters
(nothing lost: no corruption, no write errors, every chunk decodable afterwards) and the wall
time of the concurrent run as a ratio of the sequential one (measured side by side).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from rel_common import CHUNKS, engine, fully_decodable, keys_of


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--bundled", action="store_true", help="the bundled SmolLM2 instead of the tiny model")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    args = ap.parse_args()
    rng = random.Random(0)
    pool = [f"{c} (doc {i})" for i in range(6) for c in CHUNKS]  # 24 distinct chunks
    questions = ["Where is the Eiffel Tower?", "Who won two Nobel prizes?", "How old is Bob?"]
    reqs = [(rng.choice(questions), rng.sample(pool, rng.randint(2, 5))) for _ in range(args.requests)]

    def make(store_dir):
        if args.bundled:
            from cacheblend_rag import CacheBlendEngine

            return CacheBlendEngine.from_pretrained(store_dir=store_dir)
        return engine(store_dir)

    ref, eng = make(tempfile.mkdtemp()), make(tempfile.mkdtemp())
    ask = lambda e, r: e.generate(r[0], r[1], max_new_tokens=args.max_new_tokens).token_ids  # noqa: E731
    for e in (ref, eng):  # warm-up (first-call costs) on a chunk outside the pool
        ask(e, ("Warm up?", ["A warm-up passage."]))
    t0 = time.perf_counter()
    want = [ask(ref, r) for r in reqs]  # cold store, one request at a time
    seq = time.perf_counter() - t0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.threads) as ex:
        got = list(ex.map(lambda r: ask(eng, r), reqs))  # cold store, T at a time
    conc = time.perf_counter() - t0
    eng.flush()
    keys = keys_of(eng, pool)
    s = eng.store.stats
    print(
        f"model={'bundled SmolLM2-135M' if args.bundled else 'tiny llama (4 layers)'} requests={len(reqs)} threads={args.threads}"
    )
    print(f"identical answers: {sum(a == b for a, b in zip(got, want))}/{len(reqs)}")
    print(f"store: hits={s.hits} misses={s.misses} corrupt={s.corrupt} write_errors={s.write_errors}")
    print(f"chunks cached and fully decodable afterwards: {sum(fully_decodable(eng, k) for k in keys)}/{len(keys)}")
    print(f"wall time concurrent / sequential: {conc / seq:.2f}")
    ref.close()
    eng.close()


if __name__ == "__main__":
    main()
