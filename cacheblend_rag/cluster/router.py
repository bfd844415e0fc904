"""Ray Serve's request router with chunk affinity: a request goes to the replica whose memory tier
already holds most of its documents (``cluster.affinity``), load breaking ties; otherwise to the
least loaded replica.

It runs inside the caller of the engine deployment (the front), reads each request's document
digests from the :class:`~cacheblend_rag.cluster.asgi.ForwardedRequest` it routes, and the
replicas' holdings from their routing stats (``EngineReplica.record_routing_stats``). Within a
rank Serve's own machinery picks the replica with the shortest queue that accepts the request,
probing queue lengths it does not know, and backs off while every replica is full.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from cacheblend_rag.cluster.affinity import AffinityPolicy, AffinityTable
from cacheblend_rag.cluster.asgi import ForwardedRequest

__all__ = ["ChunkAffinityRouter"]


def _digests(pending: PendingRequest | None) -> tuple[str, ...]:
    if pending is None:
        return ()
    for arg in list(pending.args) + list(pending.kwargs.values()):
        if isinstance(arg, ForwardedRequest):
            return arg.digests
    return ()


class ChunkAffinityRouter(RequestRouter):
    """Set on the engine deployment by ``cluster.build_app(affinity=True)``; its keyword
    arguments (``request_router_kwargs``) are :class:`~cacheblend_rag.cluster.affinity.AffinityPolicy`'s."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.table: AffinityTable[ReplicaID] = AffinityTable(AffinityPolicy(**kwargs))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in candidate_replicas}
        reported = {rid: (r.routing_stats or {}).get("resident", ()) for rid, r in by_id.items()}
        cache = self.replica_queue_len_cache
        queue = {rid: cache.get(rid) for rid in by_id}
        ranks = self.table.rank(_digests(pending_request), reported, queue)
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self.table.assign(_digests(pending_request), replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id)
