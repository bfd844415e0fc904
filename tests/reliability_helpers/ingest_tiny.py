"""A tiny-model ingestion in a process of its own, for tests that kill it (tests/test_ingest.py).

    python ingest_tiny.py STORE_DIR CORPUS_FOLDER [SECONDS_PER_CHUNK]

Ingests the folder into a disk store in STORE_DIR with ``cacheblend_rag.cli.ingest.run`` and prints
``computed N`` on stdout. SECONDS_PER_CHUNK slows every store write down, so a test can stop the
run part way (the tiny model computes a chunk in milliseconds).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from rel_common import engine

from cacheblend_rag.cli import ingest


def main() -> None:
    store_dir, corpus = sys.argv[1], sys.argv[2]
    delay = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    eng = engine(store_dir)
    put = eng.store.put

    def slow_put(key, layers):
        time.sleep(delay)
        return put(key, layers)

    eng.store.put = slow_put
    chunks = ingest.read_corpus([corpus], eng.tokenizer, 64)
    computed = ingest.run(eng, chunks, progress=False)
    eng.close()
    print(f"computed {computed}", flush=True)


if __name__ == "__main__":
    main()
