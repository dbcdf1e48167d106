"""The policy of replicas/policy.py as a Ray Serve `RequestRouter` (the deployment's request_router_class).

A request's block hashes come with the call (the ingress computes them:
replicas/routing_key.py); what each replica holds comes from two sources,
as SGLang's cache-aware router keeps it: the replica's own report (Ray
Serve polls `record_routing_stats`: the hashes its pool caches, from its
cache events, and its waiting/running/free blocks), and, between reports,
the blocks of the requests this router sent there (a request's prefix will
be cached where it runs; forgotten after `sent_ttl_s` unless reported). Load
is the larger of the reported load and the requests this router has in
flight there. A replica that died is gone from Serve's candidates; its
entries go with it.
"""

from __future__ import annotations

import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvserve.replicas.policy import PolicyConfig, ReplicaView, RoutingPolicy


class KVServeRequestRouter(RequestRouter):
    def initialize_state(self, policy: str = "cache_aware", sent_ttl_s: float = 30.0, **thresholds: Any) -> None:
        self.policy = RoutingPolicy(PolicyConfig(policy, **thresholds))
        self.sent_ttl_s = sent_ttl_s
        self._sent: dict[ReplicaID, dict[int, float]] = {}  # hashes sent there -> when
        self._in_flight: dict[ReplicaID, int] = {}
        self._requests: dict[str, ReplicaID] = {}  # internal request id -> where it went

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        hashes = _routing_hashes(pending_request)
        now = time.monotonic()
        views = [self._view(replica, now) for replica in candidate_replicas]
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        return [[by_id[view.replica_id]] for view in self.policy.rank(views, hashes)]

    def _view(self, replica: RunningReplica, now: float) -> ReplicaView:
        stats = replica.routing_stats or {}
        sent = self._sent.get(replica.replica_id, {})
        for block_hash in [h for h, at in sent.items() if now - at > self.sent_ttl_s]:
            del sent[block_hash]
        held = set(stats.get("held", ())) | set(sent)
        reported = stats.get("waiting", 0) + stats.get("running", 0)
        load = max(reported, self._in_flight.get(replica.replica_id, 0))  # the report lags; our own count does not
        return ReplicaView(replica.replica_id.unique_id, running=load, free_blocks=stats.get("free_blocks", 0),
                           num_blocks=stats.get("num_blocks", 1), held=held)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        now = time.monotonic()
        sent = self._sent.setdefault(replica_id, {})
        for block_hash in _routing_hashes(pending_request):
            sent[block_hash] = now
        self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + 1
        self._requests[pending_request.metadata.internal_request_id] = replica_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._requests.pop(internal_request_id, None) is not None:
            self._in_flight[replica_id] = max(0, self._in_flight.get(replica_id, 0) - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._sent.pop(replica_id, None)  # a restarted replica starts empty
        self._in_flight.pop(replica_id, None)


def _routing_hashes(pending_request: PendingRequest | None) -> list[int]:
    if pending_request is None:
        return []
    hashes = pending_request.kwargs.get("routing_hashes")
    return list(hashes) if isinstance(hashes, (list, tuple)) else []
