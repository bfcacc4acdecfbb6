"""The Ray Serve request router of the engine deployment (spec X): `RoutePlanner` behind Ray's API.

Ray Serve builds one router per deployment handle, in the process that holds the handle (the
entry point), and calls `choose_replicas` for each request with the request's arguments: our
`HttpCall`, whose `RoutingKey` the planner ranks replicas by. Ray then sends the request to the
shortest queue within the first rank that has room. The entry finds the live router of its
app in `directory` to list replicas for fan-out routes and to read routing counts. Ray
pickles this module by value: keep its globals to imports and functions.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from mlxcel.cluster import directory
from mlxcel.cluster.planner import PlannerConfig, RoutePlanner
from mlxcel.cluster.wire import HttpCall, RoutingKey

class PrefixAwareRouter(RequestRouter):
    """Prefix-cache affinity with stickiness and a load-imbalance fallback; see `planner`."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._planner = RoutePlanner(PlannerConfig(**kwargs))
        self._lock = threading.Lock()  # the entry reads counts from its own thread
        self._routed: dict[str, tuple[str, str]] = {}  # internal request id -> (replica, reason)
        self._reasons: dict[str, str] = {}  # internal request id -> reason of the plan that chose
        directory.register(self.app_name, self)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        key = _routing_key(pending_request)
        with self._lock:
            plan = self._planner.plan(sorted(by_id), key)
        if pending_request is not None:
            self._reasons[pending_request.metadata.internal_request_id] = plan.reason
        return [[by_id[r] for r in rank if r in by_id] for rank in plan.ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request_id = pending_request.metadata.internal_request_id
        reason = self._reasons.pop(request_id, "least_loaded")
        with self._lock:
            self._planner.on_routed(replica_id.unique_id, _routing_key(pending_request), reason)
            self._routed[request_id] = (replica_id.unique_id, reason)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._reasons.pop(internal_request_id, None)
        with self._lock:
            if self._routed.pop(internal_request_id, None) is not None:
                self._planner.on_completed(replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        with self._lock:
            self._planner.forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self._replicas) - {replica.replica_id for replica in replicas}
        super().update_replicas(replicas)
        with self._lock:
            for replica_id in gone:
                self._planner.forget(replica_id.unique_id)

    def replica_ids(self) -> list[str]:
        """The replicas this router can route to now, in a stable order."""
        return sorted(replica.replica_id.unique_id for replica in list(self._replicas_list))

    def routed_counts(self) -> Counter[tuple[str, str]]:
        with self._lock:
            return Counter(self._planner.num_routed)

    def in_flight(self) -> dict[str, int]:
        with self._lock:
            return {replica: self._planner.in_flight(replica) for replica in self.replica_ids()}


def _routing_key(pending_request: PendingRequest | None) -> RoutingKey:
    if pending_request is None or not pending_request.args or not isinstance(pending_request.args[0], HttpCall):
        return RoutingKey()
    return pending_request.args[0].routing
