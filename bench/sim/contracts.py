"""What the simulator's layers need of each other, as Protocols, so that imports go one way.

Mental model: `run` builds a `SimCluster` (cluster.py) and a policy (policies.py); the cluster
builds the instances (instances.py, colocated.py), which share chunked prefill (chunked.py) and
the decode batch (decoder.py). Calls go both ways between these layers (the cluster commands its
instances and they report back; the policy commands the cluster and the cluster calls its hooks),
but imports go down only: a lower layer names what it calls above it by a Protocol here.
`SimCluster` is the one implementation of `InstanceHost` and `SimDataPlane`; the three instance
classes implement `SimEngine`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from bench.sim.cache import BlockCache
from bench.sim.events import EventLoop
from bench.sim.request import SimRequest


class SimEngine(Protocol):
    """One simulated instance as the cluster's callbacks and policies see it."""

    name: str
    cache: BlockCache  # its prefix cache
    dead: bool


class InstanceHost(Protocol):
    """The cluster as its instances see it: the clock their steps run on, and the events they
    report as steps end (each may change the request's state; see `bench.sim.request`)."""

    loop: EventLoop

    def start_prefill(self, req: SimRequest, inst: SimEngine) -> float:
        """`req` starts prefill on `inst`: sets its cached/remaining prefill tokens; returns the
        seconds the step waits for KV fetched from the prefix pool."""
        ...

    def finish_prefill(self, req: SimRequest, inst: SimEngine) -> bool:
        """`req`'s last prefill chunk ended on `inst`. True if it now decodes on `inst`."""
        ...

    def decode_admitted(self, req: SimRequest, inst: SimEngine) -> None: ...

    def first_decode_token(self, req: SimRequest) -> None: ...

    def finish(self, req: SimRequest) -> None:
        """`req` produced its last token."""
        ...


class SimDataPlane(Protocol):
    """The cluster as a policy (the control plane) sees it: instances by name, requests by id,
    the clock, and the commands a router sends."""

    loop: EventLoop

    @property
    def instances(self) -> Mapping[str, SimEngine]: ...

    @property
    def requests(self) -> Mapping[str, SimRequest]: ...

    def dispatch(self, req: SimRequest, prefill: str, decode: str | None, key: tuple) -> None:
        """Queue `req`'s prefill on `prefill` in priority order `key`; its KV then goes to
        `decode`, or where the policy's `decode_target` says when prefill ends."""
        ...

    def redirect(self, req: SimRequest, decode: str) -> None:
        """Send `req`'s KV to `decode` instead (again, if it went to a dead decoder)."""
        ...

    def refuse(self, req: SimRequest, reason: str) -> None: ...

    def preempt(self, req: SimRequest) -> None: ...
