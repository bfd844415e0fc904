"""The Ray Serve application: a front that reads each request and engine replicas behind it.

``build_app(EngineSpec(...))`` returns a Serve application of two deployments:

* ``EngineReplica`` (``num_replicas`` or Serve's autoscaling from its options or the Serve config
  file): each replica holds one engine over the shared store (a Redis URL, with a memory tier in
  front) and answers through the same OpenAI-compatible app as ``cacheblend-rag serve``
  (``server.create_app``). It reports to the router which documents its memory tier holds.
* ``Front`` (the HTTP ingress): reads a request's body once, finds its documents' digests
  (``cluster.documents``) and forwards the request to an engine replica through Serve's handle,
  which routes it by chunk affinity (``cluster.router.ChunkAffinityRouter``) and streams the
  replica's response back unchanged.

Each response carries two headers: ``x-cacheblend-replica`` (which replica answered) and
``x-cacheblend-tier-reads`` (layer reads per storage tier on that replica while the request ran,
e.g. ``{"memory": 40, "redis": 0}``; with concurrent requests on a replica it includes theirs).
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from cacheblend_rag.cluster.affinity import AffinityPolicy, ResidentChunks
from cacheblend_rag.cluster.asgi import ForwardedRequest, call_app
from cacheblend_rag.cluster.documents import digest, digests, request_documents

__all__ = ["ClusterOptions", "EngineReplica", "EngineSpec", "Front", "app_builder", "build_app"]

log = logging.getLogger(__name__)


# EngineSpec's fields passed to CacheBlendEngine.from_pretrained by the same name.
_FROM_PRETRAINED = ("device", "dtype", "weights", "store_dir", "store", "memory_bytes")


@dataclass(frozen=True)
class EngineSpec:
    """How every replica builds its engine: ``CacheBlendEngine.from_pretrained`` with these
    arguments, or ``factory`` (``"package.module:function"``, called with ``factory_kwargs``)
    for an engine built some other way.

    store: the tiers below the memory tier (``from_pretrained``'s ``store``): a Redis URL so the
        replicas share their chunk caches; ``"disk"`` keeps each replica's own.
    memory_bytes: each replica's memory tier (what chunk affinity keeps warm).
    """

    model: str | None = None
    store: str | list[str] | None = None
    store_dir: str | None = None
    memory_bytes: int = 2 * 2**30
    device: str = "cpu"
    dtype: str = "float32"
    weights: str = "auto"
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    factory: str | None = None
    factory_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.factory is not None and (not isinstance(self.factory, str) or ":" not in self.factory):
            raise ValueError(f"factory={self.factory!r} must be 'package.module:function'")
        if self.store is None and self.factory is None:
            log.warning(
                "EngineSpec without a store: each replica keeps its own disk store; pass a Redis URL "
                "(store='redis://host:6379/0') so the replicas share their chunk caches"
            )

    def build(self) -> Any:
        if self.factory is not None:
            module, _, name = self.factory.partition(":")
            fn: Callable[..., Any] = getattr(importlib.import_module(module), name)
            return fn(**self.factory_kwargs)
        from cacheblend_rag.engine.core import CacheBlendEngine

        named = {name: getattr(self, name) for name in _FROM_PRETRAINED}
        return CacheBlendEngine.from_pretrained(self.model, **named, **self.engine_kwargs)


@dataclass(frozen=True)
class ClusterOptions:
    """affinity: route by chunk affinity (True) or with Serve's default router (False).
    affinity_policy: the router's settings (:class:`~.affinity.AffinityPolicy`).
    routing_stats_period_s: how often each replica reports its memory tier's documents.
    max_ongoing_requests: requests a replica takes at once (the rest wait in the router); its
        server's queue is sized to match, so Serve, not the server, holds the overflow.
    server: ``server.ServerConfig`` fields for every replica's app (limits, ``model_name``).
    max_body_bytes: the front's limit on a request body (413 above it).
    """

    affinity: bool = True
    affinity_policy: AffinityPolicy = field(default_factory=AffinityPolicy)
    routing_stats_period_s: float = 2.0
    max_ongoing_requests: int = 4
    server: dict[str, Any] = field(default_factory=dict)
    max_body_bytes: int = 8 * 2**20

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_ongoing_requests, bool)
            or not isinstance(self.max_ongoing_requests, int)
            or self.max_ongoing_requests < 1
        ):
            raise ValueError(f"max_ongoing_requests={self.max_ongoing_requests!r} must be an int >= 1")
        if not self.routing_stats_period_s > 0:
            raise ValueError(f"routing_stats_period_s={self.routing_stats_period_s!r} must be > 0 seconds")


class EngineReplica:
    """One engine and its app (see the module docstring); a Serve deployment through ``build_app``."""

    def __init__(self, spec: EngineSpec, server: Mapping[str, Any], max_ongoing_requests: int) -> None:
        from cacheblend_rag.server import ServerConfig, create_app

        self.engine = spec.build()
        config = ServerConfig(**{"max_queue": max_ongoing_requests, **server})
        self.app = create_app(self.engine, config)
        self.resident = ResidentChunks()
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside a Serve replica (a unit test)
            self.replica_id = "local"

    def _tier_reads(self) -> dict[str, int]:
        stats = getattr(self.engine.store, "stats", None)
        return dict(getattr(stats, "tier_hits", {}) or {})

    def _memory_holds(self) -> Callable[[str], bool]:
        store = self.engine.store
        tier = getattr(store, "tier", None)
        if tier is not None:
            try:
                return tier("memory").store.contains
            except KeyError:
                pass
        return lambda _key: True  # no memory tier: report what it served lately

    async def handle(self, req: ForwardedRequest):
        """The app's ASGI messages for ``req``, streamed (see ``asgi.call_app``)."""
        before = self._tier_reads()
        async for message in call_app(self.app, req):
            if message["type"] == "http.response.start":
                after = self._tier_reads()
                reads = {name: after.get(name, 0) - before.get(name, 0) for name in after}
                message = {
                    **message,
                    "headers": [
                        *message.get("headers", []),
                        (b"x-cacheblend-replica", self.replica_id.encode()),
                        (b"x-cacheblend-tier-reads", json.dumps(reads).encode()),
                    ],
                }
            yield message
        documents = request_documents(req.path, req.body)
        if documents:
            prompts = self.engine.prompts
            self.resident.record((digest(d), self.engine.chunk_key(prompts.chunk_segment(d))) for d in documents)

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve's routing stats: the documents whose chunk caches this replica's memory tier holds."""
        return {"resident": self.resident.resident(self._memory_holds())}

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


class Front:
    """The HTTP ingress (see the module docstring)."""

    def __init__(self, engines: Any, max_body_bytes: int) -> None:
        self.engines = engines
        self.max_body_bytes = max_body_bytes

    def __serve_build_asgi_app__(self) -> Callable:
        return _FrontApp(self)

    async def asgi(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await _error(
                    send,
                    413,
                    f"the request body is larger than this server's limit of {self.max_body_bytes} bytes "
                    "(ClusterOptions.max_body_bytes): send fewer or shorter documents",
                )
                return
            if not message.get("more_body", False):
                break
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        req = ForwardedRequest(
            method=scope["method"],
            path=path,
            query=scope.get("query_string", b""),
            headers=tuple((bytes(k), bytes(v)) for k, v in scope.get("headers", [])),
            body=bytes(body),
            digests=digests(request_documents(path, bytes(body))),
        )
        stream = self.engines.options(stream=True).handle.remote(req)
        done = False
        try:
            async for message in stream:
                await send(message)
            done = True
        finally:
            if not done:
                stream.cancel()  # the client left: stop the replica's answer too


class _FrontApp:
    """The front as an ASGI 3 application object (what Serve's ingress runs)."""

    def __init__(self, front: Front) -> None:
        self.front = front

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        await self.front.asgi(scope, receive, send)


async def _error(send: Callable, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def build_app(
    spec: EngineSpec,
    options: ClusterOptions | None = None,
    *,
    num_replicas: int | str | None = None,
    autoscaling_config: Mapping[str, Any] | None = None,
    ray_actor_options: Mapping[str, Any] | None = None,
) -> Any:
    """The Serve application (see the module docstring); run it with ``serve.run(app)``.

    ``num_replicas`` / ``autoscaling_config`` / ``ray_actor_options`` set the engine deployment's
    Serve options (default: Serve's, one replica); a Serve config file's ``deployments`` section
    overrides them (docs/cluster.md)."""
    options = options or ClusterOptions()
    engine_opts: dict[str, Any] = {"max_ongoing_requests": options.max_ongoing_requests}
    if num_replicas is not None:
        engine_opts["num_replicas"] = num_replicas
    if autoscaling_config is not None:
        engine_opts["autoscaling_config"] = dict(autoscaling_config)
    if ray_actor_options is not None:
        engine_opts["ray_actor_options"] = dict(ray_actor_options)
    if options.affinity:
        from cacheblend_rag.cluster.router import ChunkAffinityRouter

        engine_opts["request_router_config"] = RequestRouterConfig(
            request_router_class=ChunkAffinityRouter,
            request_router_kwargs=asdict(options.affinity_policy),
            request_routing_stats_period_s=options.routing_stats_period_s,
        )
    engines = serve.deployment(EngineReplica, name="EngineReplica").options(**engine_opts)
    front = serve.deployment(serve.ingress(None)(Front), name="Front")
    return front.bind(engines.bind(spec, dict(options.server), options.max_ongoing_requests), options.max_body_bytes)


def app_builder(args: dict[str, Any]) -> Any:
    """``serve run cacheblend_rag.cluster:app_builder store=redis://host:6379/0 [model=...]
    [memory_bytes=...] [affinity=false]``, or the same as ``args`` in a Serve config file;
    replica counts and autoscaling come from Serve's own options (docs/cluster.md)."""
    args = dict(args)
    affinity = str(args.pop("affinity", "true")).lower() not in ("false", "0", "no", "off")
    spec_fields = {f for f in EngineSpec.__dataclass_fields__}
    unknown = set(args) - spec_fields
    if unknown:
        raise ValueError(f"unknown argument(s) {sorted(unknown)}: use affinity or EngineSpec's fields {sorted(spec_fields)}")
    if "memory_bytes" in args:
        args["memory_bytes"] = int(args["memory_bytes"])
    return build_app(EngineSpec(**args), ClusterOptions(affinity=affinity))
