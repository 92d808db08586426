"""Ray at the edge of MoE routing control: a worker's engine linked to the app's routing controller.

Mental model: `link_routing(async_engine, model, worker)` installs a `MoEControl` on an MoE engine
(a no-op for dense models) and, when the app runs a routing controller (the named actor
`ROUTING_ACTOR`, started by the ingress for MoE models), starts the worker's `RoutingSync` with it
(actors/engine/moe/sync.py). Without a controller the engine still counts its expert loads and
samples, and routes with no bias. This file is the only one of the MoE path that imports Ray.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import ray
import torch

from actors.engine.async_engine import AsyncEngine
from actors.engine.moe.control import MoEControl, install_moe_control
from actors.engine.moe.routing_table import RoutingTable, RoutingUpdate
from actors.engine.moe.sync import RoutingSync
from actors.engine.moe.telemetry import ExpertLoadReport

logger = logging.getLogger(__name__)

ROUTING_ACTOR = "ferry-moe-routing"  # cluster/moe/actor.py's DEFAULT_NAME
SYNC_TIMEOUT_S = 5.0


def model_key(spec: str) -> str:
    """The name a model's routing tables go by: its spec's last path part (as the ingress serves it)."""
    return spec if "/" not in spec else spec.rstrip("/").rsplit("/", 1)[-1]


class RayRoutingHub:
    """`RoutingHub` over the controller actor, found by name on each call until it exists."""

    def __init__(self, name: str = ROUTING_ACTOR, timeout_s: float = SYNC_TIMEOUT_S) -> None:
        self.name, self.timeout_s = name, timeout_s

    def sync(self, model: str, worker: str, report: ExpertLoadReport, top_k: int,
             sample: Sequence[torch.Tensor] | None = None, active: RoutingTable | None = None) -> RoutingUpdate:
        actor = ray.get_actor(self.name)
        return ray.get(actor.sync.remote(model, worker, report, top_k, sample, active), timeout=self.timeout_s)


def link_routing(async_engine: AsyncEngine, model: str, worker: str, period_s: float = 1.0) -> MoEControl | None:
    control = install_moe_control(async_engine.engine)
    if control is None:
        return None
    RoutingSync(control, RayRoutingHub(), model_key(model), worker, period_s=period_s).start()
    logger.info("%s: MoE routing control installed (%d layers x %d experts)", worker, control.state.num_layers,
                control.state.num_experts)
    return control
