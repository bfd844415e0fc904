"""``cacheblend-rag bench --load --server``: the real HTTP server under concurrent streaming clients.

For each ``--max-batch`` value the server is started (``cacheblend-rag serve`` as a subprocess on
a free port of 127.0.0.1; in process with :class:`~cacheblend_rag.server.live.BackgroundServer`
when an engine is passed, as the tests do), every question is asked once with ``max_tokens=1``
(untimed: the chunks' KV is computed and stored, as a deployment would precompute it), then for
each client count ``c``, ``c`` closed-loop clients each send a streaming chat request with its
question's documents, read the answer to ``[DONE]`` and send the next, until ``requests`` answers
are in.

Per setting: answers/s over the wall time from the first request to the last answer, and p50/p95
time to first token and end-to-end latency as the client sees them (from sending the request to
the first content chunk, and to ``[DONE]``). Rows go to ``server_load.jsonl``, the summary to
``server_load_summary.json``; ``python -m cacheblend_bench.server_load --table DIR`` prints the
summary as a Markdown table with the batched-over-unbatched throughput ratio per client count.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cacheblend_bench import datasets as ds
from cacheblend_bench.load import Pool, summarize_setting
from cacheblend_bench.methods import parse_methods
from cacheblend_bench.runner import model_path

SERVED_NAME = "bench"
ROWS = "server_load.jsonl"
SUMMARY = "server_load_summary.json"


@dataclass
class ServerLoadConfig:
    """What to run.

    methods: what the requests ask for: ``full_recompute``, ``prefix_caching``, ``full_reuse``
        (the prefill modes) or ``question@R`` (CacheBlend's question-guided selection at ratio R,
        the server engine's strategy). A request sets only the mode and the ratio.
    clients: closed-loop client counts. requests: answers per setting.
    max_batches: ``serve --max-batch`` values compared (1: one answer at a time).
    max_new_tokens: each answer's budget (``ignore_eos`` is not a request field: answers may end sooner).
    """

    model: str = "smollm2"
    dataset: str = "hotpotqa"
    n: int = 12
    methods: tuple[str, ...] = ("question@0.15",)
    clients: tuple[int, ...] = (1, 4, 8)
    requests: int = 16
    max_batches: tuple[int, ...] = (1, 8)
    max_new_tokens: int = 64
    top_k: int = 6
    chunk_tokens: int = 512
    out_dir: str = "server-load"
    musique: str | None = None
    hotpotqa: str | None = None
    device: str = "cpu"
    weights: str = "fp32"
    progress: bool = True
    start_timeout_s: float = 600.0  # loading the model (and a first GGUF conversion) in the server

    def __post_init__(self) -> None:
        for name in ("clients", "max_batches"):
            if not getattr(self, name) or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in getattr(self, name)
            ):
                raise ValueError(f"{name}={getattr(self, name)!r}: give one or more ints >= 1")
        if self.requests < 1 or self.n < 1 or self.max_new_tokens < 1:
            raise ValueError("requests, n and max_new_tokens must be >= 1")
        for spec in self.methods:
            request_options(spec)  # refuses what a request cannot ask for


def request_options(spec: str) -> dict[str, Any]:
    """The ``cacheblend`` request field for method ``spec`` (see :class:`ServerLoadConfig`)."""
    methods = parse_methods([spec])
    m = methods[0]
    if (
        len(methods) != 1
        or not m.is_kv
        or m.criterion
        or (m.mode == "cacheblend" and dict(m.options) != {"strategy": "question"})
        or (m.mode != "cacheblend" and m.options)
    ):
        raise ValueError(
            f"method {spec!r}: a server request sets only the prefill mode and the recompute ratio: use "
            "full_recompute, full_recompute_saved, prefix_caching, full_reuse or question@RATIO (the served "
            "engine's question-guided selection)"
        )
    options: dict[str, Any] = {"mode": m.mode}
    if m.ratio is not None:
        options["recompute_ratio"] = m.ratio
    return options


# ---------------------------------------------------------------------- the servers
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class SubprocessServer:
    """``cacheblend-rag serve`` in a child process; ``stop()`` ends it gracefully (SIGTERM)."""

    def __init__(
        self,
        model: str,
        max_batch: int,
        max_queue: int,
        store_dir: str,
        *,
        device: str = "cpu",
        weights: str = "fp32",
        log: Path | None = None,
        timeout_s: float = 600.0,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "cacheblend_rag",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-batch",
            str(max_batch),
            "--max-queue",
            str(max_queue),
            "--store-dir",
            store_dir,
            "--served-model-name",
            SERVED_NAME,
            # Every --max-batch setting answers over the same plain caches: learning would give the
            # settings measured later caches the earlier ones taught, and refreshes the first only.
            "--no-neighbours",
            "--device",
            device,
            "--weights",
            weights,
            "--log-level",
            "warning",
        ]
        path = _model_path(model)
        if path is not None:
            cmd += ["--model", path]
        self._log = open(log, "ab") if log is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=self._log)
        self.timeout_s = timeout_s

    def start(self) -> SubprocessServer:
        import httpx

        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode} before it answered (see its log)")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server on {self.url} did not answer within {self.timeout_s:.0f} s")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()


def _model_path(model: str) -> str | None:
    if model == "tiny":
        raise ValueError("the tiny test model has no files to serve: pass an engine to run_server_load (in process)")
    return model_path(model)


def _tokenizer(cfg: ServerLoadConfig):
    """The model's tokenizer, for cutting the documents into chunks of ``chunk_tokens``."""
    from cacheblend_rag.model.loading import load_model

    return load_model(_model_path(cfg.model), device="cpu").tokenizer


# ---------------------------------------------------------------------- the clients
def openai_client(url: str, timeout_s: float = 3600.0):
    """OpenAI's client for the server at ``url``: no retries (a failure is reported), by default
    an hour to answer (a loaded server on a CPU)."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=openai.Timeout(timeout_s, connect=30.0))


def stream_answer(client, body: dict[str, Any]) -> dict[str, Any]:
    """Send one streaming chat request (``body``: its JSON, the server's own fields included) with
    OpenAI's ``client``; the client's timings and what the server reported. A refusal or a failed
    answer raises the client's ``openai.APIError``."""
    extra = {k: v for k, v in body.items() if k not in ("model", "messages", "stream")}
    t0 = time.perf_counter()
    ttft, text, stats, tokens = None, [], {}, 0
    stream = client.chat.completions.create(model=body["model"], messages=body["messages"], stream=True, extra_body=extra)
    with stream:
        for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    ttft = time.perf_counter() - t0 if ttft is None else ttft
                    text.append(choice.delta.content)
            stats = (chunk.model_extra or {}).get("cacheblend") or stats
            tokens = chunk.usage.completion_tokens if chunk.usage else tokens
    total = time.perf_counter() - t0
    return {
        "ttft_s": total if ttft is None else ttft,
        "total_s": total,
        "tokens": int(tokens),
        "server_ttft_s": stats.get("ttft_s"),
        "queue_s": stats.get("queue_s"),
        "mode": stats.get("mode"),
        "strategy": stats.get("strategy"),
        "recompute_ratio": stats.get("recompute_ratio"),
        "text": "".join(text),
    }


def closed_loop(url: str, pool: Pool, clients: int, requests: int, body: dict[str, Any]) -> tuple[list[dict], float]:
    """``clients`` threads, each sending its next streaming request once its last is answered."""
    rows: list[dict] = []
    left = [requests]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def client() -> None:
        with openai_client(url) as openai:
            while True:
                with lock:
                    if left[0] == 0 or errors:
                        return
                    left[0] -= 1
                question, chunks = pool.take()
                request = dict(body, messages=[{"role": "user", "content": question}], documents=chunks)
                try:
                    row = stream_answer(openai, request)
                except BaseException as exc:  # noqa: BLE001 - reported once every client has stopped
                    with lock:
                        errors.append(exc)
                    return
                with lock:
                    rows.append(row)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return rows, time.perf_counter() - t0


# ---------------------------------------------------------------------- the run
def _servers(cfg: ServerLoadConfig, engine, out: Path) -> Iterator[tuple[int, Any]]:
    """(max_batch, a started server) for each ``max_batches`` value, stopped after use."""
    max_queue = max(cfg.clients)  # every client is admitted: nobody is refused with 503
    for max_batch in cfg.max_batches:
        if engine is not None:
            from cacheblend_rag.server import ServerConfig, create_app
            from cacheblend_rag.server.live import BackgroundServer

            app = create_app(
                engine, ServerConfig(model_name=SERVED_NAME, max_batch=max_batch, max_queue=max_queue, learn_neighbours=False)
            )
            server: Any = BackgroundServer(app, timeout_s=cfg.start_timeout_s).start()
        else:
            server = SubprocessServer(
                cfg.model,
                max_batch,
                max_queue,
                str(out / "kv"),
                device=cfg.device,
                weights=cfg.weights,
                log=out / "server.log",
                timeout_s=cfg.start_timeout_s,
            ).start()
        try:
            yield max_batch, server
        finally:
            server.stop()


def run_server_load(cfg: ServerLoadConfig, *, engine=None) -> list[dict]:
    """Run every setting; returns the summary (one entry per method, max_batch and client count).
    ``engine``: serve it in process (tests) instead of starting ``cacheblend-rag serve``."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = engine.tokenizer if engine is not None else _tokenizer(cfg)
    examples = ds.load_dataset(cfg.dataset, cfg.n, musique=cfg.musique, hotpotqa=cfg.hotpotqa, chunk_tokens=cfg.chunk_tokens)
    retriever, count = ds.Retriever(), ds.token_counter(tokenizer)
    items = [(ex.question, ds.retrieve(ex, retriever, count, cfg.chunk_tokens, cfg.top_k)) for ex in examples]
    summary: list[dict] = []
    plan = [(m, c) for m in cfg.methods for c in cfg.clients]
    with (out / ROWS).open("a", encoding="utf-8") as sink:
        for max_batch, server in _servers(cfg, engine, out):
            for method in cfg.methods:
                body = {
                    "model": SERVED_NAME,
                    "max_tokens": cfg.max_new_tokens,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "cacheblend": request_options(method),
                }
                # Untimed: each question's chunks computed and stored once, the server warmed up.
                with openai_client(server.url) as openai:
                    for question, chunks in items:
                        warm = stream_answer(
                            openai, dict(body, max_tokens=1, messages=[{"role": "user", "content": question}], documents=chunks)
                        )
                        _check_served(method, warm)
                for clients in cfg.clients:
                    before = _counters(server.url)
                    rows, wall = closed_loop(server.url, Pool(items), clients, cfg.requests, body)
                    steps, tokens = (after - b for after, b in zip(_counters(server.url), before))
                    key = {
                        "model": cfg.model,
                        "dataset": cfg.dataset,
                        "method": method,
                        "max_batch": max_batch,
                        "clients": clients,
                        "max_new_tokens": cfg.max_new_tokens,
                    }
                    for r in rows:
                        sink.write(json.dumps(dict(key, **{k: v for k, v in r.items() if k != "text"})) + "\n")
                    sink.flush()
                    entry = dict(key, **summarize_setting(rows, wall), answers_per_step=tokens / steps if steps else 0.0)
                    summary.append(entry)
                    if cfg.progress:
                        done = len(summary)
                        print(
                            f"[{done}/{len(plan) * len(cfg.max_batches)}] {method} max_batch={max_batch} clients={clients}: "
                            f"{entry['answers_per_s']:.3g} answers/s, TTFT p50 {entry['ttft_p50']:.3g} s",
                            file=sys.stderr,
                        )
    config = asdict(cfg)
    (out / SUMMARY).write_text(
        json.dumps({"config": config, "machine": _machine(), "summary": summary}, indent=2), encoding="utf-8"
    )
    return summary


def _check_served(method: str, row: dict[str, Any]) -> None:
    """A question@R request must have been answered with question-guided selection: the served
    engine's strategy (a calibrated quality profile may set another)."""
    if method.startswith("question@") and row["strategy"] != "question":
        raise ValueError(
            f"method {method}: the server's engine selects with strategy {row['strategy']!r}, not 'question' "
            "(a calibrated quality profile?): its requests cannot ask for another strategy"
        )


def _counters(url: str) -> tuple[int, int]:
    """The server's (decode steps, tokens decoded by them) so far."""
    import httpx

    health = httpx.get(f"{url}/health", timeout=30.0).json()
    return int(health["decode_steps"]), int(health["decoded_tokens"])


def _machine() -> dict[str, Any]:
    import platform

    import torch

    return {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "processor": platform.processor(),
        "platform": platform.platform(),
    }


# ---------------------------------------------------------------------- the table
def markdown_table(summary: list[dict]) -> str:
    """One row per setting; ``vs max_batch=1``: answers/s over the unbatched server's for the same
    method and client count."""
    base = {(e["method"], e["clients"]): e["answers_per_s"] for e in summary if e["max_batch"] == 1}
    cols = (
        "method",
        "max_batch",
        "clients",
        "answers/s",
        "vs max_batch=1",
        "TTFT p50 (s)",
        "TTFT p95 (s)",
        "end-to-end p50 (s)",
        "end-to-end p95 (s)",
        "answers per step",
    )
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for e in sorted(summary, key=lambda e: (e["method"], e["clients"], e["max_batch"])):
        ref = base.get((e["method"], e["clients"]))
        ratio = f"{e['answers_per_s'] / ref:.2f}x" if ref else "-"
        cells = [
            e["method"],
            e["max_batch"],
            e["clients"],
            f"{e['answers_per_s']:.3g}",
            ratio,
            f"{e['ttft_p50']:.3g}",
            f"{e['ttft_p95']:.3g}",
            f"{e['e2e_p50']:.3g}",
            f"{e['e2e_p95']:.3g}",
            f"{e['answers_per_step']:.2f}",
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print a server load summary as a Markdown table.")
    parser.add_argument("--table", required=True, metavar="DIR_OR_FILE", help=f"an output folder or its {SUMMARY}")
    args = parser.parse_args(argv)
    path = Path(args.table)
    path = path / SUMMARY if path.is_dir() else path
    print(markdown_table(json.loads(path.read_text(encoding="utf-8"))["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
