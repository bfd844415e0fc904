"""What ``cacheblend-rag ask`` costs a user on a first run and on later ones, measured as processes.

``python -m cacheblend_bench.ask_cost --out docs/results/ask_cost_smollm2.jsonl`` runs, per repeat,
from an empty cache home (the converted bundled model linked in, so the one-off GGUF conversion
is left out) and as separate processes:

1. ``first``: a question over the files, nothing kept yet (splits, vectors, chunk caches, the
   model fingerprint and the load-time checks are all computed);
2. ``again``: the same question (everything reused);
3. ``new question``: another question over the same files (its vector is new; the chunks it
   retrieves may need caches too);
4. ``later question, one process``: ``ask -`` given both questions on standard input, in one
   process; its wall time is from the first answer's line to the second's, what a user of
   ``ask -`` waits for a later question (everything reused, as in ``again``);
5. ``--keep-alive, starting it``: the first question again with ``--keep-alive``, which starts the
   process that keeps the model loaded (``cli.warm``) and answers from it;
6. ``--keep-alive, again``: the same, answered by that process;
7. ``--keep-alive, new question``: a question not asked before, answered by that process (which
   loads MiniLM for it) and then stopped (``--keep-alive 0``).

Each row: the run, the process's wall seconds, the answer's first-token and total seconds
(``ask --json``), the chunks cached and computed, and the machine. Rows append to ``--out``; a
repeat already there is skipped (resumable).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cacheblend_bench import provenance

ROOT = Path(__file__).resolve().parents[2]
FILES = tuple(sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples" / "data").glob("*.txt")))
QUESTIONS = (
    "Which river flows through Oxford?",
    "Who developed the theory of general relativity?",
    "When was the Colosseum completed?",
)
RUNS = (
    "first",
    "again",
    "new question",
    "later question, one process",
    "--keep-alive, starting it",
    "--keep-alive, again",
    "--keep-alive, new question",
)
KEPT = (("10m", QUESTIONS[0]), ("10m", QUESTIONS[0]), ("0", QUESTIONS[2]))  # RUNS[4:]: --keep-alive, question
NEW_TOKENS = 64


def _command(home: Path, question: str, files: Sequence[str], threads: int, *flags: str) -> tuple[list[str], dict[str, str]]:
    """``ask``'s command line for ``question`` (``-``: standard input) and its environment."""
    env = {**os.environ, "CACHEBLEND_RAG_HOME": str(home), "OMP_NUM_THREADS": str(threads)}
    env.pop("CACHEBLEND_RAG_KEEP_ALIVE", None)
    return ["cacheblend-rag", "ask", question, *files, "--json", "--max-new-tokens", str(NEW_TOKENS), *flags], env


def _row(wall: float, out: dict[str, Any]) -> dict[str, Any]:
    """A run's row from its wall seconds and ``ask --json``'s object."""
    s = out["stats"]
    return {
        "wall_s": wall,
        "ttft_s": out["ttft_s"],
        "answer_s": out["total_s"],
        "chunks": s["chunks"],
        "chunk_hits": s["chunk_hits"],
        "chunk_misses": s["chunk_misses"],
    }


def _ask(home: Path, question: str, files: Sequence[str], threads: int, *flags: str) -> dict[str, Any]:
    command, env = _command(home, question, files, threads, *flags)
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return _row(wall, json.loads(done.stdout[done.stdout.index("{") :]))


def _ask_stream(home: Path, questions: Sequence[str], files: Sequence[str], threads: int) -> dict[str, Any]:
    """``ask -`` over ``questions`` in one process: the last answer's row, its wall time from the
    line of the answer before it to its own."""
    command, env = _command(home, "-", files, threads)
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("".join(f"{q}\n" for q in questions))
        proc.stdin.close()
        lines = [(time.perf_counter(), json.loads(line)) for line in proc.stdout]
        if proc.wait() != 0 or len(lines) != len(questions):
            err.seek(0)
            raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}, {len(lines)} answers):\n{err.read()[-2000:]}")
    (before, _), (at, out) = lines[-2], lines[-1]
    return _row(at - before, out)


def repeat(index: int, files: Sequence[str], threads: int) -> list[dict[str, Any]]:
    """One repeat: the four runs over a fresh cache home."""
    from cacheblend_rag.model.loading import default_cache_dir

    models = default_cache_dir() / "models"
    with tempfile.TemporaryDirectory(prefix="cbrag-askcost-") as tmp:
        home = Path(tmp)
        if models.is_dir():
            (home / "models").symlink_to(models, target_is_directory=True)
        rows = []
        for run, question in zip(RUNS, (QUESTIONS[0], QUESTIONS[0], QUESTIONS[1])):
            got = _ask(home, question, files, threads)
            rows.append({"repeat": index, "run": run, "question": question, "files": list(files), **got})
        got = _ask_stream(home, QUESTIONS[:2], files, threads)
        rows.append({"repeat": index, "run": RUNS[3], "question": QUESTIONS[1], "files": list(files), **got})
        for run, (keep, question) in zip(RUNS[4:], KEPT):
            got = _ask(home, question, files, threads, "--keep-alive", keep)
            rows.append({"repeat": index, "run": run, "question": question, "files": list(files), **got})
        _wait_stopped(home)
    return rows


def _wait_stopped(home: Path, timeout_s: float = 60.0) -> None:
    """Wait for the kept process to end (``--keep-alive 0``), so the next repeat's machine is quiet;
    its pid is in its lock file."""
    deadline = time.monotonic() + timeout_s
    for lock in (home / "warm").glob("*.lock"):
        pid = int(lock.read_text().strip() or 0)
        while pid and time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for run in RUNS:
        rs = [r for r in rows if r["run"] == run]
        if rs:
            walls = [r["wall_s"] for r in rs]
            out.append(
                {
                    "run": run,
                    "n": len(rs),
                    "wall_s": statistics.median(walls),
                    "wall_range": (min(walls), max(walls)),
                    "ttft_s": statistics.median(r["ttft_s"] for r in rs),
                    "answer_s": statistics.median(r["answer_s"] for r in rs),
                }
            )
    return out


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| run | whole process (s) | range | first token (s) | answer (s) |",
        "|---|---|---|---|---|",
    ]
    for e in summarize(rows):
        lo, hi = e["wall_range"]
        lines.append(f"| {e['run']} | {e['wall_s']:.1f} | {lo:.1f}-{hi:.1f} | {e['ttft_s']:.2f} | {e['answer_s']:.2f} |")
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    """The docs' table (docs/cli.md): :func:`markdown_table` and what ran it."""
    files = len({f for r in rows for f in r.get("files", [])}) or len(FILES)
    return (
        markdown_table(rows)
        + f"\n\nThe bundled SmolLM2-135M, {files} text files of `examples/data`, {NEW_TOKENS} new tokens, medians of "
        + f"{len({r['repeat'] for r in rows})} repeats from an empty cache home; {provenance.machine_label(rows)}."
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cacheblend_bench.ask_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench-ask/ask_cost.jsonl"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the ask processes (default 2)")
    p.add_argument("files", nargs="*", default=list(FILES), help="text files to ask over (default: examples/data/*.txt)")
    args = p.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = {r["repeat"] for r in _read(args.out)}
    stamp = {"machine": provenance.machine_stamp(), "engine": provenance.engine_stamp(), "new_tokens": NEW_TOKENS}
    for i in range(args.repeats):
        if i in done:
            continue
        rows = repeat(i, args.files, args.threads)
        with args.out.open("a", encoding="utf-8") as sink:  # a repeat's rows only once it has finished
            for r in rows:
                sink.write(json.dumps({**r, **stamp}) + "\n")
        print(f"repeat {i}: " + ", ".join(f"{r['run']} {r['wall_s']:.1f} s" for r in rows), file=sys.stderr, flush=True)
    print(markdown_table(_read(args.out)))
    return 0


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


if __name__ == "__main__":
    raise SystemExit(main())
