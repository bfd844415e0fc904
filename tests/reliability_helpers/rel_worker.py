"""Worker processes of the multi-process reliability tests.

Started through a ``forkserver`` multiprocessing context that preloads this module: the server
imports torch/transformers once and every worker forks from that clean, single-threaded process,
so a worker starts in milliseconds instead of paying the ~8 s import (on 2 cores that decides
whether the suite fits its time budget). Workers are real separate processes with their own
SQLite connections, exactly like independent servers sharing one cache directory.

    answer_worker(dir, out)          precompute CHUNKS into dir, answer REQUESTS, write JSON to out
    write_worker(dir, mode, conn)    publish writer_chunk(0), writer_chunk(1), ... forever, sending
                                     i over conn after each; mode "at-record" SIGKILLs itself right
                                     after layer KILL_LAYER of chunk KILL_CHUNK is stored (its meta
                                     is not), mode "free" runs until the parent kills it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import transformers.models.llama.modeling_llama  # noqa: F401  (preloaded in the forkserver)
from rel_common import CHUNKS, answer, engine

QUESTIONS = ["Where is the Eiffel Tower?", "Who won two Nobel prizes?", "How old is Bob?", "Which river?"]
# 8 requests over overlapping chunk sets in different orders: every chunk is shared by several.
REQUESTS = [(q, [CHUNKS[(i + j) % len(CHUNKS)] for j in range(2 + i % 3)]) for i, q in enumerate(QUESTIONS * 2)]
KILL_CHUNK, KILL_LAYER = 2, 1


def writer_chunk(i: int) -> str:
    # ~170 tokens: each layer record is ~43 KiB, so diskcache keeps it in its own file (> 32 KiB).
    return f"Document number {i}. " + " ".join(CHUNKS) * 2


def answer_worker(directory: str, out: str) -> None:
    eng = engine(directory)
    eng.precompute(CHUNKS, progress=False)
    answers = [answer(eng, chunks, q)[0] for q, chunks in REQUESTS]
    eng.flush()
    Path(out).write_text(json.dumps({"answers": answers, "stats": eng.store.stats.as_dict()}))
    eng.close()


def write_worker(directory: str, mode: str, conn) -> None:
    eng = engine(directory)
    real_set = eng.store._cache.set
    current = {"chunk": -1}

    def set_and_maybe_die(name, value, *args, **kwargs):
        result = real_set(name, value, *args, **kwargs)
        if mode == "at-record" and current["chunk"] == KILL_CHUNK and name.endswith(f"/{KILL_LAYER}"):
            os.kill(os.getpid(), signal.SIGKILL)  # layer records stored, meta not: mid-chunk
        return result

    eng.store._cache.set = set_and_maybe_die
    for i in range(10_000):
        current["chunk"] = i
        eng.precompute([writer_chunk(i)], progress=False)
        conn.send(i)
