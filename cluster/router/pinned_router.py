"""PinnedRouter: a Serve request router that sends a call to the one replica its caller named.

Mental model: ferry's scheduler, not Serve's load balancing, decides where a request runs, so the
ingress calls worker deployments with the target replica's id in the keyword argument `REPLICA_KW`
(`cluster/router/serve_handles.py`). This router, configured on each worker deployment and run by
Serve inside the caller's process, picks exactly that replica; a call without a target (none today)
goes to any. A named replica that is no longer among the live ones fails the call at once with
`WorkerGone` instead of waiting (Serve would otherwise retry the routing until one appears). Serve
copies this module by value into each caller, so it keeps no state of its own and raises an error
class of another module (a class copied by value would not be the caller's `WorkerGone`).
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from cluster.router.handles import WorkerGone

REPLICA_KW = "ferry_replica"


class PinnedRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True  # Serve loops on an empty answer
        target = pending_request.kwargs.get(REPLICA_KW)
        if target is None:
            return [candidate_replicas]
        for replica in candidate_replicas:
            if replica.replica_id.unique_id == target:
                return [[replica]]
        if not pending_request.future.done():
            pending_request.future.set_exception(WorkerGone(f"replica {target} is not live"))
        return [candidate_replicas[:1]] if candidate_replicas else []
