"""The routing controller as a named Ray actor (`RoutingControlService` wrapped, restarted forever).

One per serving app. Its state (published tables, loads) is soft: after a restart the workers'
next syncs bring their loads back, and the newest table any worker holds is adopted (controller.py),
so versions never go backwards. Calls made while it restarts fail at once; workers retry on their
next period and serve on with the table they have.
"""

from __future__ import annotations

import ray
from ray.actor import ActorHandle

from cluster.moe.controller import ControllerConfig
from cluster.moe.service import RoutingControlService

ROUTING_NUM_CPUS = 0.05
DEFAULT_NAME = "ferry-moe-routing"

RoutingControlActor = ray.remote(num_cpus=ROUTING_NUM_CPUS, max_restarts=-1, max_task_retries=0)(RoutingControlService)


def start_routing_control(cfg: ControllerConfig | None = None, *, name: str = DEFAULT_NAME, tick_s: float = 5.0,
                          auto: bool = True, timeout_s: float = 60.0) -> ActorHandle:
    """Starts the named controller (or returns the running one of that name) and waits until it answers."""
    handle = RoutingControlActor.options(name=name, get_if_exists=True).remote(cfg, tick_s, auto)
    ray.get(handle.ping.remote(), timeout=timeout_s)
    return handle
