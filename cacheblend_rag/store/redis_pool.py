"""One Redis connection pool per server and settings, shared by every ``RedisStore`` of a process.

Several engines in one process (a server's replicas, a benchmark's variants, LangChain and
LlamaIndex models side by side) used to open a pool each: as many idle sockets to the same Redis
as there were stores. :func:`acquire` hands out the pool already open for the same URL and
timeouts, counting its users; :func:`release` closes its sockets when the last user lets go.
redis-py's pool is thread-safe and resets itself in a forked child, so sharing it is safe.
"""

from __future__ import annotations

import threading
from typing import Any

try:  # the `redis` extra
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError:  # pragma: no cover - exercised only without the extra
    redis = None  # type: ignore[assignment]

__all__ = ["acquire", "release", "shared_pools"]

_lock = threading.Lock()
_pools: dict[tuple[str, float | None, float | None], list[Any]] = {}  # settings -> [pool, users]


def acquire(url: str, socket_timeout_s: float | None, connect_timeout_s: float | None) -> Any:
    """The process's connection pool for ``url`` with these timeouts (opened on first use)."""
    settings = (url, socket_timeout_s, connect_timeout_s)
    with _lock:
        entry = _pools.get(settings)
        if entry is None:
            pool = redis.ConnectionPool.from_url(
                url,
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=connect_timeout_s,
                # One immediate retry on a broken connection: after a Redis restart the pooled
                # connections are dead, and the retry opens a fresh one instead of failing the
                # tier. Timeouts are not retried: that would double the wait on a slow Redis.
                retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
            )
            entry = _pools[settings] = [pool, 0]
        entry[1] += 1
        return entry[0]


def release(pool: Any) -> None:
    """One user fewer; the last one closes the pool's connections."""
    with _lock:
        for settings, entry in list(_pools.items()):
            if entry[0] is pool:
                entry[1] -= 1
                if entry[1] > 0:
                    return
                del _pools[settings]
                break
        else:
            return
    pool.disconnect()


def shared_pools() -> int:
    """How many pools the process holds open (one per Redis server and settings)."""
    with _lock:
        return len(_pools)
