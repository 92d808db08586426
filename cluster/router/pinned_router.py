"""PinnedRouter: a Serve request router that sends a call to the one replica its caller named.

Mental model: ferry's scheduler, not Serve's load balancing, decides where a request runs, so the
ingress calls worker deployments with the target replica's id as the call's `multiplexed_model_id`
(`cluster/router/serve_handles.py`; no replica loads models by it, it is only the pin: the worker
methods see their own arguments and nothing else). This router, configured on each worker deployment and run by
Serve inside the caller's process, picks exactly that replica; a call without a target (none today)
goes to any. A call pinned to a replica that is not among the live ones fails at once with
`WorkerGone` (Serve would otherwise retry the routing until one appears: forever, for a dead one);
the ingress finds replicas through the same candidate set (`DeploymentHandle.broadcast`). Serve
copies this module by value into each caller, so it keeps no state of its own and raises an error
class of another module (a class copied by value would not be the caller's `WorkerGone`).
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from cluster.router.handles import WorkerGone

class PinnedRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True  # Serve loops on an empty answer
        target = pending_request.metadata.multiplexed_model_id
        if not target:
            return [candidate_replicas]
        chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
        if chosen:  # a replica still starting may take a few seconds to accept: Serve keeps trying
            return [chosen]
        if not pending_request.future.done():  # a replica this caller found is gone from its candidates
            pending_request.future.set_exception(WorkerGone(f"replica {target} is not live"))
        return [candidate_replicas[:1]]  # non-empty: Serve's loop then sees the call done and stops
