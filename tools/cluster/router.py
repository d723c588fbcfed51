"""`ReplicaRouter`: the Ray Serve request router of framekv's replica deployment. A call
names its replica in ``multiplexed_model_id`` (the key the ingress keeps per session) and
goes there and nowhere else (one naming a replica that is gone fails at once with
ConnectionError); a call naming none (`describe`) goes to any replica. No queue length
is asked for first (a replica takes any number of calls), and every pending call has
a routing task of its own, so a replica that stops answering holds up no other.

Ray Serve's own multiplexing treats a key as a model any replica may load on demand
and evict (least recently used), and learns where keys live from the replicas a moment
later; a stream is not reloadable (two replicas opening one stream would make its
chunks twice), so placement and moves stay the ingress's, which names the replica.

`live` tells the ingress which replicas this process's router routes to, and what each
reported last (`Replica.record_routing_stats`): the replicas Ray Serve runs now.
"""
from __future__ import annotations

import importlib
import weakref

from ray.serve.request_router import RequestRouter

_routers: list = []   # weak references to the routers of this process, newest last


class ReplicaRouter(RequestRouter):
    """Routes a call to the replica its ``multiplexed_model_id`` names (module doc)."""

    def initialize_state(self, **kwargs):
        # Ray Serve hands the class over pickled by value, its globals a copy: the
        # list `live_replicas` reads is the imported module's
        importlib.import_module(__name__)._routers.append(weakref.ref(self))

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        want = pending_request.metadata.multiplexed_model_id if pending_request else ""
        if pending_request is not None:
            # a replica that cannot take it now (its queue length not known in time) is
            # tried again after a back-off, not at once in a loop that starves the router
            pending_request.routing_context.should_backoff = True
        if not want:
            return [candidate_replicas]
        chosen = [r for r in candidate_replicas if r.replica_id.unique_id == want]
        if chosen or pending_request is None:
            return [chosen]
        # Gone: the call fails at once (a routing task retrying it would hold one of the
        # tasks the router runs while calls to the live replicas wait). The candidates
        # handed back end the task's loop: a call already failed is sent nowhere.
        if not pending_request.future.done():
            pending_request.future.set_exception(ConnectionError(f"replica {want} is gone"))
        self._remove_pending_request_from_indices(pending_request)    # else kept forever
        return [candidate_replicas]

    @property
    def max_num_routing_tasks(self) -> int:
        # one routing task per pending call: calls to a replica that stopped answering
        # must not hold every task while calls to the others wait
        return max(self.max_num_routing_tasks_cap, len(self._replicas) * 64)

    async def _select_from_candidate_replicas(self, candidates, backoff_index):
        # A replica takes any number of calls (its max_ongoing_requests is unbounded):
        # no queue length is asked for, which a busy replica answers late and a dead
        # one never (the call itself then fails, and the ingress adopts its sessions).
        for r in candidates:
            if r.replica_id in self._replicas:
                return self._replicas[r.replica_id]
        return None

    def live(self) -> dict[str, dict]:
        """Replica id -> its last routing stats, for every replica routed to now."""
        return {r.replica_id.unique_id: dict(r.routing_stats or {}) for r in self._replicas_list}


def live_replicas() -> dict[str, dict] | None:
    """`ReplicaRouter.live` of this process's newest router; None before one exists."""
    while _routers:
        router = _routers[-1]()
        if router is not None:
            return router.live()
        _routers.pop()
    return None
