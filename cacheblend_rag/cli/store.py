"""``cacheblend-rag store stats`` and ``store drop``: what a chunk store holds, and dropping part of it.

Both read the store without loading a model: they count every model's chunks in the directory (or
under the Redis prefix). A chunk's format comes from its name (``store.quant.chunk_name``: float
records under the bare key, ``<key>@int8`` and so on), its tokens from its meta record, which is
read as it stands (``store.meta.peek_meta``: for counting, not for serving). Records no meta record
publishes (a write cut short) are counted apart: the store evicts them in time.

Hits and misses are counted by a live store, per process (``engine.store.stats``); of the tiers a
fresh process can ask, only Redis keeps counts (``keyspace_hits``/``keyspace_misses``, for the
whole server).
"""

from __future__ import annotations

import argparse
import json
import re
import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cacheblend_rag.store.meta import peek_meta
from cacheblend_rag.store.quant import format_of_name, parse_kv_format

__all__ = ["FormatStats", "TierStats", "disk_stats", "drop_disk", "drop_redis", "redis_stats", "register"]

_REDIS_KEY = re.compile(r"^(?P<space>[^:]+:[0-9a-f]+):\{(?P<name>[^{}]+)\}:(?P<part>meta|\d+)$")
_REDIS_BATCH = 500  # keys per SCAN page and per pipelined round trip


@dataclass
class FormatStats:
    """The chunks of one format (float ones by dtype, e.g. ``float32``; quantized ones by name)."""

    chunks: int = 0
    tokens: int = 0
    bytes: int = 0

    @property
    def bytes_per_token(self) -> float | None:
        return self.bytes / self.tokens if self.tokens else None


@dataclass
class TierStats:
    """What one tier holds. ``unpublished_bytes``: records of chunks with no meta record (a write
    cut short). ``hits``/``misses``: the tier's own counts where it keeps them, else None."""

    tier: str
    where: str
    formats: dict[str, FormatStats] = field(default_factory=dict)
    unpublished_bytes: int = 0
    volume: int | None = None
    hits: int | None = None
    misses: int | None = None

    def add(self, name: str, meta_blob: Any, size: int) -> None:
        meta = peek_meta(meta_blob)
        fmt = format_of_name(name)
        label = meta.dtype if fmt == "float" and meta is not None else fmt
        entry = self.formats.setdefault(label, FormatStats())
        entry.chunks += 1
        entry.tokens += meta.num_tokens if meta is not None else 0
        entry.bytes += size

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for label, entry in self.formats.items():
            out["formats"][label]["bytes_per_token"] = entry.bytes_per_token
        return out


# ------------------------------------------------------------------------ disk


def _rows(directory: Path) -> Iterator[tuple[str, Any, int]]:
    """(record name, value if kept in the database, bytes) of every record in a disk store."""
    db = directory / "cache.db"
    if not db.is_file():
        raise SystemExit(f"error: {directory}: no chunk store here (no cache.db): pass the --store-dir a store uses")
    con = sqlite3.connect(db.absolute().as_uri() + "?mode=ro", uri=True, timeout=10)
    try:
        # diskcache keeps small values in the row (size 0) and larger ones in files (size: the file's).
        query = "SELECT key, value, CASE WHEN filename IS NULL THEN COALESCE(length(value), 0) ELSE size END FROM Cache"
        yield from con.execute(query)
    finally:
        con.close()


def _chunks(rows: Iterable[tuple[str, Any, int]]) -> tuple[dict[str, tuple[Any, int]], int]:
    """{chunk name: (its meta record, bytes of all its records)} and the bytes of unpublished records."""
    sizes: dict[str, int] = {}
    metas: dict[str, Any] = {}
    for key, value, size in rows:
        name, _, part = str(key).rpartition("/")
        sizes[name] = sizes.get(name, 0) + int(size or 0)
        if part == "meta":
            metas[name] = value
    published = {name: (metas[name], size) for name, size in sizes.items() if name in metas}
    return published, sum(size for name, size in sizes.items() if name not in metas)


def disk_stats(directory: str | Path) -> TierStats:
    """What the disk store in ``directory`` holds (read-only; no model needed)."""
    directory = Path(directory).expanduser()
    published, orphans = _chunks(_rows(directory))
    stats = TierStats("disk", str(directory), unpublished_bytes=orphans)
    for name, (meta, size) in published.items():
        stats.add(name, meta, size)
    stats.volume = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    return stats


def _matches(name: str, fmt: str | None) -> bool:
    return fmt is None or format_of_name(name) == fmt


def drop_disk(directory: str | Path, fmt: str | None) -> tuple[int, int]:
    """Drop the chunks of format ``fmt`` ("float", "int8", ...; None: every chunk) from the disk
    store in ``directory``; returns (chunks, bytes) dropped. Each chunk's meta record goes first,
    so a reader never finds half a chunk."""
    from cacheblend_rag.store.disk_db import open_cache

    directory = Path(directory).expanduser()
    published, _ = _chunks(_rows(directory))
    # Every record name, published or not: a format's unpublished records go too.
    names = {str(key).rpartition("/")[0] for key, _, _ in _rows(directory)}
    chosen = sorted(n for n in names if _matches(n, fmt))
    limit = _size_limit(directory)
    cache = open_cache(str(directory), limit)
    try:
        if fmt is None:
            cache.clear()
        else:
            for name in chosen:
                cache.delete(f"{name}/meta")
                cache.evict(name)  # every record of a chunk carries its name as tag
    finally:
        cache.close()
    dropped = [published[n] for n in chosen if n in published]
    return len(dropped), sum(size for _, size in dropped)


def _size_limit(directory: Path) -> int:
    # Reopened with the limit it has, so dropping never culls (or lets grow) what stays.
    con = sqlite3.connect((directory / "cache.db").absolute().as_uri() + "?mode=ro", uri=True, timeout=10)
    try:
        row = con.execute("SELECT value FROM Settings WHERE key = 'size_limit'").fetchone()
    finally:
        con.close()
    return int(row[0]) if row and isinstance(row[0], int) and row[0] > 0 else 8 * 2**30


# ------------------------------------------------------------------------ Redis


def _redis(url: str):
    try:
        import redis
    except ImportError:
        raise SystemExit("error: a Redis store needs redis-py: pip install 'cacheblend-rag[redis]'") from None
    return redis.Redis.from_url(url)


def _redis_names(client, prefix: str) -> Iterator[tuple[bytes, re.Match[str]]]:
    for raw in client.scan_iter(match=f"{prefix}:*", count=_REDIS_BATCH):
        m = _REDIS_KEY.match(raw.decode("utf-8", "replace"))
        if m is not None:
            yield raw, m


def redis_stats(url: str, prefix: str = "cacheblend") -> TierStats:
    """What Redis at ``url`` holds under ``prefix`` (every model's chunks), and its hit counts."""
    client = _redis(url)
    try:
        keys = list(_redis_names(client, prefix))
        sizes: dict[tuple[str, str], int] = {}
        metas: dict[tuple[str, str], bytes] = {}
        for i in range(0, len(keys), _REDIS_BATCH):
            batch = keys[i : i + _REDIS_BATCH]
            pipe = client.pipeline(transaction=False)
            for raw, m in batch:
                pipe.get(raw) if m["part"] == "meta" else pipe.strlen(raw)
            for (_, m), got in zip(batch, pipe.execute()):
                chunk = (m["space"], m["name"])  # two models' copies of a text are two chunks
                if m["part"] == "meta":
                    metas[chunk] = got
                    got = len(got or b"")
                sizes[chunk] = sizes.get(chunk, 0) + int(got or 0)
        info = client.info()
        stats = TierStats(
            "redis",
            url.split("@")[-1],
            unpublished_bytes=sum(s for c, s in sizes.items() if c not in metas),
            volume=int(info.get("used_memory", 0)),
            hits=int(info.get("keyspace_hits", 0)),
            misses=int(info.get("keyspace_misses", 0)),
        )
        for chunk, meta in metas.items():
            stats.add(chunk[1], meta, sizes[chunk])
        return stats
    finally:
        client.close()


def drop_redis(url: str, fmt: str | None, prefix: str = "cacheblend") -> tuple[int, int]:
    """Drop the chunks of format ``fmt`` (None: all) under ``prefix`` from Redis; (chunks, bytes)."""
    before = redis_stats(url, prefix)
    client = _redis(url)
    try:
        chosen = [raw for raw, m in _redis_names(client, prefix) if _matches(m["name"], fmt)]
        # Meta records first: a chunk disappears before its layers.
        chosen.sort(key=lambda raw: not raw.endswith(b":meta"))
        for i in range(0, len(chosen), _REDIS_BATCH):
            client.unlink(*chosen[i : i + _REDIS_BATCH])
    finally:
        client.close()
    gone = [s for label, s in before.formats.items() if fmt is None or _label_format(label) == fmt]
    return sum(s.chunks for s in gone), sum(s.bytes for s in gone)


def _label_format(label: str) -> str:
    return "float" if label.startswith(("float", "bfloat")) else label


# ------------------------------------------------------------------------ command line


def _tiers(args: argparse.Namespace) -> list[str]:
    entries = [p.strip() for p in (args.store or "disk").split(",") if p.strip()]
    return entries or ["disk"]


def _store_dir(args: argparse.Namespace) -> Path:
    if args.store_dir:
        return Path(args.store_dir).expanduser()
    from cacheblend_rag.model.loading import default_cache_dir

    return Path(default_cache_dir()) / "kv"


def _stats(args: argparse.Namespace) -> int:
    tiers = [disk_stats(_store_dir(args)) if e == "disk" else redis_stats(e, args.redis_prefix) for e in _tiers(args)]
    if args.json:
        print(json.dumps([t.as_dict() for t in tiers], indent=1))
        return 0
    for t in tiers:
        print(f"{t.tier} {t.where}")
        print("| format | chunks | tokens | bytes | bytes per token |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for label, s in sorted(t.formats.items()):
            bpt = f"{s.bytes_per_token:,.0f}" if s.bytes_per_token is not None else "-"
            print(f"| {label} | {s.chunks:,} | {s.tokens:,} | {s.bytes:,} | {bpt} |")
        if not t.formats:
            print("| (no chunks) | 0 | 0 | 0 | - |")
        extra = [f"unpublished records: {t.unpublished_bytes:,} bytes"] if t.unpublished_bytes else []
        if t.volume is not None:
            extra.append(f"{'on disk' if t.tier == 'disk' else 'server memory'}: {t.volume:,} bytes")
        if t.hits is not None:
            extra.append(f"hits {t.hits:,}, misses {t.misses:,} (the whole server)")
        else:
            extra.append("hits and misses: counted per process (engine.store.stats), not on disk")
        print("; ".join(extra) + "\n")
    return 0


def _drop(args: argparse.Namespace) -> int:
    if args.all == (args.format is not None):
        raise SystemExit("error: store drop: pass --format FORMAT (float, int8, int4, ...) or --all")
    fmt = None
    if args.format is not None:
        try:
            parsed = parse_kv_format(args.format)
        except (TypeError, ValueError) as exc:
            raise SystemExit(f"error: --format: {exc}") from None
        fmt = "float" if parsed is None else parsed.name
    what = "every chunk" if fmt is None else f"the {fmt} chunks"
    for entry in _tiers(args):
        if entry == "disk":
            chunks, size = drop_disk(_store_dir(args), fmt)
            where = str(_store_dir(args))
        else:
            chunks, size = drop_redis(entry, fmt, args.redis_prefix)
            where = entry.split("@")[-1]
        print(f"dropped {what} from {where}: {chunks:,} chunks, {size:,} bytes")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store-dir", default=None, help="the disk store's directory (default: <cache home>/kv)")
    p.add_argument(
        "--store",
        default=None,
        help="tiers to look at, comma-separated: disk (default), redis://host:6379/0 (rediss:// for TLS)",
    )
    p.add_argument("--redis-prefix", default="cacheblend", help="the Redis tier's key prefix (default cacheblend)")


def register(subparsers) -> None:
    """Add ``store stats`` and ``store drop`` to the ``cacheblend-rag`` parser."""
    store = subparsers.add_parser("store", help="what the chunk store holds, by format; drop chunks by format")
    sub = store.add_subparsers(dest="store_command", required=True)
    stats = sub.add_parser("stats", help="chunks, tokens, bytes and bytes per token by format (every model's chunks)")
    _common(stats)
    stats.add_argument("--json", action="store_true", help="print the counts as JSON")
    stats.set_defaults(func=_stats)
    drop = sub.add_parser("drop", help="drop the chunks of one format (--format int8), or every chunk (--all)")
    _common(drop)
    drop.add_argument("--format", default=None, help="the format to drop: float, int8, int4 or a spelling with options")
    drop.add_argument("--all", action="store_true", help="drop every chunk of every model and format")
    drop.set_defaults(func=_drop)
