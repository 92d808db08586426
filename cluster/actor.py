"""The scheduler as a Ray actor: `SchedulerService` wrapped, named, restarted forever.

Mental model: one named actor per deployment. It is a plain (not async) actor, so Ray runs its
calls one at a time in submission order, which is all the single-threaded scheduler needs. It
holds nothing durable: when it dies Ray restarts it (`max_restarts=-1`) with the same constructor
arguments, and the ingress notices the new incarnation in its next report acknowledgement and
sends its in-flight list (`SchedulerService.rebuild`). Calls made while it restarts fail at once
(`max_task_retries=0`), so the ingress falls back to local placement instead of blocking.
It imports no torch: a restart takes seconds, not a model load.
"""

from __future__ import annotations

import ray
from ray.actor import ActorHandle

from cluster.config import SchedulerConfig
from cluster.service import SchedulerService

SCHEDULER_NUM_CPUS = 0.05
DEFAULT_NAME = "ferry-scheduler"

SchedulerActor = ray.remote(num_cpus=SCHEDULER_NUM_CPUS, max_restarts=-1, max_task_retries=0)(SchedulerService)


def start_scheduler(cfg: SchedulerConfig, *, name: str = DEFAULT_NAME, namespace: str | None = None,
                    poll_interval_s: float = 0.2, timeout_s: float = 60.0,
                    resources: dict[str, float] | None = None) -> ActorHandle:
    """Starts the named scheduler actor (or returns the running one of that name) and waits
    until it answers. `resources`: custom resources it asks for, which keep it on the head's
    nodes (actors/node_roles.py)."""
    handle = SchedulerActor.options(name=name, namespace=namespace, get_if_exists=True,
                                    resources=resources or {}).remote(cfg, poll_interval_s)
    ray.get(handle.ping.remote(), timeout=timeout_s)
    return handle
