"""The ingress finding Serve worker replicas (`ServeWorkers.discover`): a new replica that its pinned
calls cannot reach yet is not declared dead, and one the router declared dead that still answers with
a healthy engine is placeable again.

The deployments here are in-process stand-ins with the two surfaces `ServeWorkers` uses
(`broadcast(...).results_async` and pinned `options(...).method.remote`); the pinned call fails the
way `PinnedRouter` fails a call to a replica its caller's router does not list yet (`WorkerGone`).
The real Serve path runs in tests/deploy/test_serve_scaling.py and test_multinode.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from actors.messages import WorkerLoad
from cluster.router.client import Router
from cluster.router.handles import WorkerGone
from deploy.worker_servers import ServeWorkers, WorkerIdentity


@dataclass
class Replica:
    identity: WorkerIdentity
    unroutable_calls: int = 0  # pinned calls that fail as "not live" before the caller's router lists it
    healthy: bool = True
    calls: list[str] = field(default_factory=list)


class _Method:
    def __init__(self, replica: Replica, name: str) -> None:
        self.replica, self.name = replica, name

    async def remote(self, *args: Any) -> Any:
        self.replica.calls.append(self.name)
        if self.replica.unroutable_calls > 0:
            self.replica.unroutable_calls -= 1
            raise WorkerGone(f"replica {self.replica.identity.replica_id} is not live")
        if self.name == "load":
            return WorkerLoad(self.replica.identity.name, "decode", 0, 0, 0, 10, 10, 0.0, healthy=self.replica.healthy)
        return self.replica.identity.name


class _Pinned:
    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    def __getattr__(self, name: str) -> _Method:
        return _Method(self.replica, name)


class _Broadcast:
    def __init__(self, replicas: dict[str, Replica]) -> None:
        self.replicas = replicas

    async def results_async(self, timeout_s: float, return_exceptions: bool) -> list[Any]:
        return [r.identity for r in self.replicas.values()]


class Deployment:
    def __init__(self) -> None:
        self.replicas: dict[str, Replica] = {}

    def add(self, replica_id: str, kind: str, **behaviour: Any) -> Replica:
        name = f"ferry-{kind}-{replica_id}"
        replica = self.replicas[replica_id] = Replica(WorkerIdentity(replica_id, name, kind, b"ep"), **behaviour)
        return replica

    def broadcast(self, method: str) -> _Broadcast:
        assert method == "identify"
        return _Broadcast(self.replicas)

    def options(self, multiplexed_model_id: str, stream: bool = False) -> _Pinned:
        return _Pinned(self.replicas[multiplexed_model_id])


def _workers() -> tuple[ServeWorkers, Deployment, Deployment, Router]:
    decode, prefill = Deployment(), Deployment()
    prefill.add("p1", "prefill")
    decode.add("d1", "decode")
    workers = ServeWorkers(decode, prefill, call_timeout_s=2.0)  # type: ignore[arg-type]  # stand-ins
    router = workers.router = Router({}, {})
    return workers, decode, prefill, router


def test_a_new_replica_not_routable_yet_is_added_alive() -> None:
    async def go() -> None:
        workers, decode, _, router = _workers()
        assert len(await workers.discover()) == 2
        late = decode.add("d2", "decode", unroutable_calls=2)  # the scale-up's replica
        added = await workers.discover()
        assert [h.name for h in added] == ["ferry-decode-d2"]
        assert late.calls[:3] == ["load", "load", "load"]  # waited until a pinned call reached it
        assert "ferry-decode-d2" in router.decodes
        loads = await router.board.loads()
        assert loads["ferry-decode-d2"].healthy and not router.board.dead

    asyncio.run(go())


def test_a_replica_declared_dead_that_answers_healthy_is_revived() -> None:
    async def go() -> None:
        workers, decode, _, router = _workers()
        sick = decode.add("d2", "decode")
        await workers.discover()
        router.board.mark_dead("ferry-decode-d1")  # e.g. a pinned call that raced the ingress's view
        router.board.mark_dead("ferry-decode-d2")
        sick.healthy = False  # its engine loop died: stays dead
        assert await workers.discover() == []
        assert router.board.dead == {"ferry-decode-d2"}
        loads = await router.board.loads()
        assert loads["ferry-decode-d1"].healthy and not loads["ferry-decode-d2"].healthy

    asyncio.run(go())
