"""A store that stays warm: replay a query stream against bounded tiers and compare eviction policies.

``python -m cacheblend_bench.replay --out docs/results/replay.jsonl`` replays one stream of
queries over a fixed corpus of chunks (Zipf-like popularity: chunk of popularity rank r is asked
for with weight 1 / r**zipf; each query asks for ``per_query`` distinct chunks) against a
``TieredStore`` of a bounded memory tier over a bounded disk tier, once per pair of eviction
policies (``store.eviction``: the memory tier's, diskcache's for the disk tier). Every run sees
the same stream. Each query does what the engine does: one batched lookup, the hits read layer by
layer from the tiers (promoted into memory), the misses "computed" and written to both tiers.

Chunk caches are synthetic: random K/V of SmolLM2-135M's shape (30 layers, 3 KV heads of 64
dimensions, float16) for ``chunk_tokens`` tokens, so bytes are those of real chunks of that
length; no model runs. Reported per window of ``window`` queries: chunk hit rate, layer reads and
bytes per tier, the seconds spent reading per tier (measured here: a smoke figure on a shared
machine), and a modeled time to first token: every query's chunks at the blended cost per token
plus each missed chunk's prefill at the full-prefill cost per token, both from the committed
headline measurement on SmolLM2 (docs/benchmarks.md), for ``model_chunk_tokens``-token chunks.

The reference lines: ``ideal`` (every chunk precomputed in an unbounded store: hit rate 1) and
``static oracle`` (a store that always holds the most popular chunks that fit: under independent
requests no policy does better once warm). Rows append to ``--out``; a finished run is skipped
when the file is read again (resumable), and its rows are written only once it finishes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cacheblend_rag.store.disk import KVStore
from cacheblend_rag.store.eviction import DISK_POLICIES, MEMORY_POLICIES, set_disk_policy
from cacheblend_rag.store.memory import MemoryTier
from cacheblend_rag.store.quant import parse_kv_format
from cacheblend_rag.store.record import layer_record_bytes
from cacheblend_rag.store.tiers import Tier, TieredStore

__all__ = ["ReplayConfig", "query_stream", "replay", "run_all", "summary_table"]

# Committed headline (docs/results/bench_smollm2_summary.json, HotpotQA, top-6 chunks of 512
# tokens, 2,493 prompt tokens on average, 2-core CPU): CacheBlend@0.15 answered its first token in
# 1.240 s with every chunk stored, full prefill in 5.364 s.
BLEND_S_PER_TOKEN = 1.240 / 2493.3
PREFILL_S_PER_TOKEN = 5.364 / 2493.3
SMOLLM2_KV = (30, 3, 64)  # layers, KV heads, head dim


@dataclass(frozen=True)
class ReplayConfig:
    corpus: int = 400
    queries: int = 2000
    per_query: int = 4
    zipf: float = 1.0
    chunk_tokens: int = 32
    model_chunk_tokens: int = 512
    store_fraction: float = 0.25  # the disk tier holds this fraction of the corpus's bytes
    memory_fraction: float = 0.05  # the memory tier, in front of it
    window: int = 100
    warmup: int = 500  # queries before "after warm-up"
    seed: int = 0
    shift_at: int | None = None  # from this query on, another set of chunks is popular (a drifting stream)
    memory_policies: tuple[str, ...] = tuple(sorted(MEMORY_POLICIES))
    disk_policies: tuple[str, ...] = DISK_POLICIES
    kv_shape: tuple[int, int, int] = SMOLLM2_KV
    # The disk tier's record format (``store.quant``): at the same bytes, int8 and int4 records
    # hold more chunks. The memory tier keeps decoded tensors, float16, whatever the format.
    kv_format: str = "float"

    def __post_init__(self) -> None:
        if not 1 <= self.per_query <= self.corpus:
            raise ValueError(f"per_query={self.per_query} must be between 1 and corpus={self.corpus}")
        if self.queries < self.window or self.warmup >= self.queries:
            raise ValueError(
                f"queries={self.queries} must exceed warmup={self.warmup} and be at least one window ({self.window})"
            )
        if not 0 < self.memory_fraction <= self.store_fraction <= 1:
            raise ValueError(f"need 0 < memory_fraction ({self.memory_fraction}) <= store_fraction ({self.store_fraction}) <= 1")
        if self.shift_at is not None and not 0 < self.shift_at < self.queries:
            raise ValueError(f"shift_at={self.shift_at} must be a query index between 0 and queries={self.queries}")
        parse_kv_format(self.kv_format)  # raises on an unknown format
        for p in self.memory_policies:
            if p not in MEMORY_POLICIES:
                raise ValueError(f"unknown memory policy {p!r}: use {sorted(MEMORY_POLICIES)}")
        for p in self.disk_policies:
            if p not in DISK_POLICIES:
                raise ValueError(f"unknown disk policy {p!r}: use {list(DISK_POLICIES)}")

    @property
    def layer_bytes(self) -> int:
        _, heads, dim = self.kv_shape
        return 2 * heads * self.chunk_tokens * dim * 2  # K and V, float16

    @property
    def chunk_bytes(self) -> int:
        return self.kv_shape[0] * self.layer_bytes

    @property
    def disk_layer_bytes(self) -> int:
        """One layer's record in the disk tier's format (header and scales included)."""
        _, heads, dim = self.kv_shape
        return layer_record_bytes((heads, self.chunk_tokens, dim), torch.float16, parse_kv_format(self.kv_format))

    @property
    def disk_bytes(self) -> int:
        """The disk tier's size: ``store_fraction`` of the corpus in float16, whatever the format."""
        return int(self.store_fraction * self.corpus * self.chunk_bytes)

    @property
    def disk_chunks(self) -> int:
        """Chunks the disk tier holds in its format."""
        return min(self.corpus, self.disk_bytes // (self.kv_shape[0] * self.disk_layer_bytes))

    def stream_key(self) -> str:
        """Names the stream and sizes: rows of another configuration are never mixed in."""
        fields = {
            k: v
            for k, v in asdict(self).items()
            if k not in ("memory_policies", "disk_policies")
            and not (k == "shift_at" and v is None)
            and not (k == "kv_format" and v == "float")  # rows made before the field keep their key
        }
        return hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=6).hexdigest()


def popularity(cfg: ReplayConfig, phase: int = 0) -> np.ndarray:
    """Each chunk's request weight (summing to 1); chunk ids are shuffled against rank, with
    another shuffle after ``shift_at`` (``phase`` 1)."""
    rng = np.random.default_rng(cfg.seed if phase == 0 else cfg.seed + 1000 * phase)
    weights = 1.0 / np.arange(1, cfg.corpus + 1) ** cfg.zipf
    p = np.empty(cfg.corpus)
    p[rng.permutation(cfg.corpus)] = weights / weights.sum()
    return p


def _phase(cfg: ReplayConfig, index: int) -> int:
    return int(cfg.shift_at is not None and index >= cfg.shift_at)


def query_stream(cfg: ReplayConfig) -> Iterator[list[int]]:
    """The queries: ``per_query`` distinct chunk ids each, the same for every run."""
    ps = [popularity(cfg, 0), popularity(cfg, 1)]
    rng = np.random.default_rng(cfg.seed + 1)
    for i in range(cfg.queries):
        yield [int(c) for c in rng.choice(cfg.corpus, size=cfg.per_query, replace=False, p=ps[_phase(cfg, i)])]


def static_oracle_hit_rate(cfg: ReplayConfig, queries: Sequence[list[int]]) -> float:
    """Hit rate after warm-up of a store always holding the most popular chunks that fit (the
    ones popular at the time, when the stream drifts)."""
    fit = cfg.disk_chunks
    tops = [set(np.argsort(-popularity(cfg, phase))[:fit].tolist()) for phase in (0, 1)]
    asked = [(c, _phase(cfg, i)) for i, q in enumerate(queries) if i >= cfg.warmup for c in q]
    return sum(c in tops[phase] for c, phase in asked) / len(asked)


def _key(chunk: int) -> str:
    return f"replay-chunk-{chunk:06d}"


def _open(cfg: ReplayConfig, memory_policy: str, disk_policy: str, directory: str) -> TieredStore:
    corpus_bytes = cfg.corpus * cfg.chunk_bytes
    disk = KVStore(directory, size_limit=cfg.disk_bytes + _DISK_SLACK, kv_format=cfg.kv_format)
    set_disk_policy(disk, disk_policy)
    memory = MemoryTier(int(cfg.memory_fraction * corpus_bytes), policy=memory_policy)
    return TieredStore([Tier(memory, "memory"), Tier(disk, "disk")])


# diskcache's database, its write-ahead log and folders count against the disk limit
# (disk.KVStore): this much on top of the records, so the records get the fraction asked for.
_DISK_SLACK = 2 * 2**20


def replay(cfg: ReplayConfig, memory_policy: str, disk_policy: str, *, where: str | None = None) -> list[dict[str, Any]]:
    """One run: a row per window, then its summary row. ``where``: the folder for the disk
    tier's temporary directory (a tmpfs such as /dev/shm spares a shared disk; the hit rates and
    bytes are the same, only the smoke read times change)."""
    layers, heads, dim = cfg.kv_shape
    g = torch.Generator().manual_seed(cfg.seed)
    template = [
        (
            torch.randn(heads, cfg.chunk_tokens, dim, generator=g).half(),
            torch.randn(heads, cfg.chunk_tokens, dim, generator=g).half(),
        )
        for _ in range(layers)
    ]
    run = f"{memory_policy}/{disk_policy}"
    base = {"stream": cfg.stream_key(), "run": run, "memory_policy": memory_policy, "disk_policy": disk_policy}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="cbrag-replay-", dir=where) as directory:
        store = _open(cfg, memory_policy, disk_policy, directory)
        tiers = {t.name: t.store for t in store.tiers}
        win = _Window()
        try:
            for n, query in enumerate(query_stream(cfg), start=1):
                keys = [_key(c) for c in query]
                found = store.contains_many(keys)
                hits = [k for k, f in zip(keys, found) if f]
                lost: set[str] = set()
                before = dict(store.stats.tier_hits)
                t0 = time.perf_counter()
                for layer in range(layers):
                    ask = [k for k in hits if k not in lost]
                    if not ask:
                        break
                    for k, kv in zip(ask, store.get_layers(ask, layer)):
                        if kv is None:
                            lost.add(k)  # evicted between lookup and read: the engine recomputes it
                win.read_s += time.perf_counter() - t0
                for name in tiers:
                    win.reads[name] = win.reads.get(name, 0) + store.stats.tier_hits[name] - before.get(name, 0)
                served = set(hits) - lost
                misses = [k for k in keys if k not in served]
                for k in misses:
                    store.put(k, template)
                win.add(len(keys), len(keys) - len(misses), cfg)
                if n % cfg.window == 0:
                    rows.append({**base, "kind": "window", "queries_done": n, **win.row(cfg)})
                    win = _Window()
        finally:
            store.close()
    windows = [r for r in rows if r["queries_done"] > cfg.warmup]
    rows.append({**base, "kind": "summary", **_summary(windows, cfg)})
    return rows


@dataclass
class _Window:
    asked: int = 0
    hit: int = 0
    queries: int = 0
    ttft_s: float = 0.0
    read_s: float = 0.0
    reads: dict[str, int] = field(default_factory=dict)

    def add(self, asked: int, hit: int, cfg: ReplayConfig) -> None:
        self.asked, self.hit, self.queries = self.asked + asked, self.hit + hit, self.queries + 1
        self.ttft_s += model_ttft_s(cfg, asked, asked - hit)

    def row(self, cfg: ReplayConfig) -> dict[str, Any]:
        return {
            "chunks_asked": self.asked,
            "chunk_hits": self.hit,
            "hit_rate": self.hit / self.asked,
            "memory_layer_reads": self.reads.get("memory", 0),
            "disk_layer_reads": self.reads.get("disk", 0),
            "memory_bytes": self.reads.get("memory", 0) * cfg.layer_bytes,
            "disk_bytes": self.reads.get("disk", 0) * cfg.disk_layer_bytes,
            "read_s_per_query_smoke": self.read_s / self.queries,
            "ttft_model_s": self.ttft_s / self.queries,
        }


def model_ttft_s(cfg: ReplayConfig, chunks: int, missed: int) -> float:
    """Modeled first-token time of one query (see the module docstring)."""
    tokens = cfg.model_chunk_tokens
    return chunks * tokens * BLEND_S_PER_TOKEN + missed * tokens * PREFILL_S_PER_TOKEN


def _summary(windows: list[dict], cfg: ReplayConfig) -> dict[str, Any]:
    asked = sum(w["chunks_asked"] for w in windows)
    queries = len(windows) * cfg.window
    mem, disk = sum(w["memory_bytes"] for w in windows), sum(w["disk_bytes"] for w in windows)
    return {
        "queries_after_warmup": queries,
        "hit_rate": sum(w["chunk_hits"] for w in windows) / asked,
        "memory_bytes_per_query": mem / queries,
        "disk_bytes_per_query": disk / queries,
        "memory_share_of_reads": mem / (mem + disk) if mem + disk else 0.0,
        "ttft_model_s": sum(w["ttft_model_s"] for w in windows) / len(windows),
        "read_s_per_query_smoke": sum(w["read_s_per_query_smoke"] for w in windows) / len(windows),
    }


def reference_rows(cfg: ReplayConfig) -> list[dict[str, Any]]:
    """The ideal store and the static oracle (computed, not replayed)."""
    queries = list(query_stream(cfg))
    oracle = static_oracle_hit_rate(cfg, queries)
    base = {"stream": cfg.stream_key(), "kind": "reference"}
    k = cfg.per_query
    return [
        {**base, "run": "ideal", "hit_rate": 1.0, "ttft_model_s": model_ttft_s(cfg, k, 0)},
        {**base, "run": "static oracle", "hit_rate": oracle, "ttft_model_s": model_ttft_s(cfg, k, k * (1 - oracle))},
    ]


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def run_all(cfg: ReplayConfig, out: Path, *, progress: bool = True, where: str | None = None) -> list[dict[str, Any]]:
    """Every policy pair not yet in ``out`` (resumable); returns this stream's rows."""
    out.parent.mkdir(parents=True, exist_ok=True)
    key = cfg.stream_key()
    rows = [r for r in read_rows(out) if r.get("stream") == key]
    done = {r["run"] for r in rows if r["kind"] in ("summary", "reference")}
    with out.open("a", encoding="utf-8") as sink:
        if "ideal" not in done:
            config_row = {"stream": key, "kind": "config", "run": "config", **asdict(cfg)}
            new = [config_row, *reference_rows(cfg)]
            for r in new:
                sink.write(json.dumps(r) + "\n")
            sink.flush()
            rows += new
        for mp in cfg.memory_policies:
            for dp in cfg.disk_policies:
                if f"{mp}/{dp}" in done:
                    continue
                t0 = time.perf_counter()
                new = replay(cfg, mp, dp, where=where)
                for r in new:  # a run's rows only once it has finished: an interrupted run starts over
                    sink.write(json.dumps(r) + "\n")
                sink.flush()
                rows += new
                if progress:
                    s = new[-1]
                    print(
                        f"{mp}/{dp}: hit rate {s['hit_rate']:.3f}, memory share {s['memory_share_of_reads']:.2f} "
                        f"({time.perf_counter() - t0:.0f} s)",
                        flush=True,
                    )
    return rows


def summary_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per policy pair and reference, after warm-up."""
    config = next(r for r in rows if r["kind"] == "config")
    oracle = next(r["hit_rate"] for r in rows if r["run"] == "static oracle")
    lines = [
        "| memory policy | disk policy | chunk hit rate | of the ideal | of the static oracle | memory MB/query | disk MB/query "
        "| memory share of reads | modeled TTFT (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    summaries = sorted((r for r in rows if r["kind"] == "summary"), key=lambda r: (-r["hit_rate"], -r["memory_share_of_reads"]))
    for r in summaries:
        lines.append(
            f"| {r['memory_policy']} | {r['disk_policy']} | {r['hit_rate']:.3f} | {r['hit_rate']:.0%} | {r['hit_rate'] / oracle:.0%} | "
            f"{r['memory_bytes_per_query'] / 2**20:.1f} | {r['disk_bytes_per_query'] / 2**20:.1f} | "
            f"{r['memory_share_of_reads']:.2f} | {r['ttft_model_s']:.2f} |"
        )
    for r in (r for r in rows if r["kind"] == "reference"):
        of_oracle = f"{r['hit_rate'] / oracle:.0%}" if r["run"] == "static oracle" else ""
        lines.append(
            f"| {r['run']} | | {r['hit_rate']:.3f} | {r['hit_rate']:.0%} | {of_oracle} | | | | {r['ttft_model_s']:.2f} |"
        )
    lines.append("")
    lines.append(
        f"{config['queries']} queries of {config['per_query']} chunks over {config['corpus']} chunks (Zipf {config['zipf']}), "
        f"after the first {config['warmup']}"
        + (f"; from query {config['shift_at']} on, other chunks are popular" if config.get("shift_at") else "")
        + f"; disk tier {config['store_fraction']:.0%} and memory tier "
        f"{config['memory_fraction']:.0%} of the corpus's bytes; synthetic {config['chunk_tokens']}-token chunks of "
        f"SmolLM2-135M's KV shape in float16"
        + (f", {config['kv_format']} records on disk" if config.get("kv_format", "float") != "float" else "")
        + f"; TTFT modeled for {config['model_chunk_tokens']}-token chunks."
    )
    return "\n".join(lines)


def formats_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per disk record format (streams that differ only in ``kv_format``), the
    same store bytes: chunks the disk tier holds, hit rate and modeled TTFT per policy pair run."""
    configs = {r["stream"]: r for r in rows if r["kind"] == "config"}
    lines = [
        "| disk records | bytes per chunk | chunks the disk tier holds | policies | chunk hit rate "
        "| static oracle | modeled TTFT (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    first = None
    for stream, config in configs.items():
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k not in ("stream", "kind", "run")}
        cfg = ReplayConfig(**fields)
        same = {k: v for k, v in asdict(cfg).items() if k != "kv_format"}
        if first is None:
            first = same
        elif same != first:
            raise ValueError(f"stream {stream} differs from the first in more than its format: not comparable")
        oracle = next(r["hit_rate"] for r in rows if r["stream"] == stream and r["run"] == "static oracle")
        for r in (r for r in rows if r["stream"] == stream and r["kind"] == "summary"):
            lines.append(
                f"| {cfg.kv_format} | {cfg.kv_shape[0] * cfg.disk_layer_bytes:,} | {cfg.disk_chunks} of {cfg.corpus} "
                f"| {r['memory_policy']} / {r['disk_policy']} | {r['hit_rate']:.3f} | {oracle:.3f} | {r['ttft_model_s']:.2f} |"
            )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Hit rate and modeled TTFT per window, one line per policy pair, the references dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_hit, ax_ttft) = plt.subplots(1, 2, figsize=(10, 3.6))
    runs = sorted({r["run"] for r in rows if r["kind"] == "window"})
    for run in runs:
        ws = [r for r in rows if r["kind"] == "window" and r["run"] == run]
        x = [w["queries_done"] for w in ws]
        ax_hit.plot(x, [w["hit_rate"] for w in ws], label=run, linewidth=1.2)
        ax_ttft.plot(x, [w["ttft_model_s"] for w in ws], label=run, linewidth=1.2)
    for r in (r for r in rows if r["kind"] == "reference"):
        ax_hit.axhline(r["hit_rate"], linestyle="--", color="grey" if r["run"] == "ideal" else "black", linewidth=0.8)
        ax_ttft.axhline(r["ttft_model_s"], linestyle="--", color="grey" if r["run"] == "ideal" else "black", linewidth=0.8)
    warmup = next(r for r in rows if r["kind"] == "config")["warmup"]
    for ax in (ax_hit, ax_ttft):
        ax.axvline(warmup, color="lightgrey", linewidth=0.8)
        ax.set_xlabel("queries replayed")
    ax_hit.set_ylabel("chunk hit rate per 100 queries")
    ax_ttft.set_ylabel("modeled time to first token (s)")
    ax_hit.set_title("dashed: ideal (grey), static oracle (black)", fontsize=9)
    ax_ttft.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cacheblend_bench.replay", description=__doc__.split("\n\n")[0])
    defaults = ReplayConfig()
    p.add_argument("--out", default="bench-replay/replay.jsonl", help="rows file (appended; finished runs are skipped)")
    p.add_argument("--plot", default=None, help="write the plot here (PNG)")
    p.add_argument("--where", default=None, help="folder for the disk tier's temporary store (default: the system's temp folder)")
    for name in ("corpus", "queries", "per_query", "chunk_tokens", "window", "warmup", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    p.add_argument("--shift-at", type=int, default=None, help="query index from which other chunks are popular (default: never)")
    for name in ("zipf", "store_fraction", "memory_fraction"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name))
    p.add_argument(
        "--kv-format", default=defaults.kv_format, help="the disk tier's record format: float, int8 or int4 (default float)"
    )
    p.add_argument("--memory-policies", default=",".join(defaults.memory_policies))
    p.add_argument("--disk-policies", default=",".join(defaults.disk_policies))
    args = p.parse_args(argv)
    try:
        cfg = ReplayConfig(
            corpus=args.corpus,
            queries=args.queries,
            per_query=args.per_query,
            zipf=args.zipf,
            chunk_tokens=args.chunk_tokens,
            store_fraction=args.store_fraction,
            memory_fraction=args.memory_fraction,
            window=args.window,
            warmup=args.warmup,
            seed=args.seed,
            shift_at=args.shift_at,
            kv_format=args.kv_format,
            memory_policies=tuple(args.memory_policies.split(",")),
            disk_policies=tuple(args.disk_policies.split(",")),
        )
    except ValueError as exc:
        p.error(str(exc))
    rows = run_all(cfg, Path(args.out), where=args.where)
    print(summary_table(rows))
    if args.plot:
        print("plot:", plot(rows, Path(args.plot)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
