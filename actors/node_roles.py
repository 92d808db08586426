"""Which Ray nodes host which part of the app: node roles as Ray custom resources.

Mental model: a node type declares a custom resource for each role it may host (in `ray up`'s
`available_node_types.<type>.resources`, or `ray start --resources`), e.g. `{"ferry_decode": 1}`;
`placement:` in the app config names the resource of each role, and every actor of that role asks
Ray for `ROLE_SHARE` of it, so Ray (and the autoscaler, which reads pending demands) can only put it
on a node of a type that declares it. Four roles: `head` (ingress, scheduler, semantic cache,
MoE routing control), `prefill`, `decode` (colocated workers too) and `cache` (the prefix-cache
stores). A role left unset runs wherever Ray has room: the single-node default. A mixed node type
declares several resources. Torch-free: the ingress and the scheduler import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Role = Literal["head", "prefill", "decode", "cache"]
ROLES: tuple[Role, ...] = ("head", "prefill", "decode", "cache")
# What one actor takes of its role's resource: a node declaring 1 hosts up to 1,000 actors of that
# role (the resource marks where they may go; CPUs and GPUs decide how many fit).
ROLE_SHARE = 0.001
RESERVED = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


@dataclass(frozen=True)
class NodeRoles:
    """The custom resource that marks the nodes of each role; None: any node."""

    head: str | None = None
    prefill: str | None = None
    decode: str | None = None
    cache: str | None = None
    # What each prefill or decode worker takes of its role's resource. ROLE_SHARE (0.001): the
    # resource only marks the nodes (GPUs or CPUs decide how many workers fit). 1: a node declaring
    # `ferry_decode: 2` holds two decode workers, so a CPU-only node type can state its capacity
    # (Ray node resources are whole numbers) and the autoscaler adds nodes for more workers.
    worker_share: float = ROLE_SHARE

    def __post_init__(self) -> None:
        if not 0 < self.worker_share <= 1000 or round(self.worker_share * 1e4) != self.worker_share * 1e4:
            raise ValueError(f"placement.worker_share: {self.worker_share!r} must be in (0, 1000], in steps of "
                             "0.0001 (Ray's resource grain)")
        for role, name in self.assigned().items():
            if not name or name in RESERVED or name.startswith("node:"):
                raise ValueError(f"placement.{role}: {name!r} is not a custom resource name "
                                 f"(not empty, not one of {sorted(RESERVED)}, not node:<ip>)")

    def assigned(self) -> dict[Role, str]:
        """The roles pinned to a node type, with their resource."""
        return {role: name for role in ROLES if (name := getattr(self, role)) is not None}

    def resources(self, role: Role) -> dict[str, float]:
        """The `resources=` entry of an actor of `role` ({} when the role runs anywhere)."""
        name = getattr(self, role)
        if name is None:
            return {}
        return {name: self.worker_share if role in ("prefill", "decode") else ROLE_SHARE}

    def options(self, role: Role) -> dict[str, Any]:
        """Keyword arguments of `.options(...)` that keep an actor of `role` on its nodes."""
        resources = self.resources(role)
        return {"resources": resources} if resources else {}


def worker_role(kind: str) -> Role:
    """The role of a worker of `kind` (prefill, decode, colocated)."""
    return "prefill" if kind == "prefill" else "decode"
