"""Prefill, decode and colocated workers as Ray Serve deployments (`workers_as: deployments`).

Mental model: each replica *is* the worker actor the plain actors run (`actors/ray_actors.py`:
model loaded in the replica's process, engine thread, transport endpoint, prefix-cache stores looked
up by name), with the little Serve needs added (`_Replica`), and names itself
`<prefix>-<kind>-<replica id>`. Serve owns the replicas: their count
(`num_replicas`), what each asks Ray for (`ray_actor_options`), health checks (`check_health`: the
engine loop is alive), graceful shutdown (streams in flight finish first) and restarts of dead ones
(a new replica has a new id, so a new name). Every call from the ingress is pinned to one replica
(`cluster/router/pinned_router.py`): the scheduler, not Serve's load balancing, decides where a
request runs.

`ServeWorkers` is the ingress's side: it finds the replicas (`identify`, broadcast to a deployment),
wires every decode replica's KV endpoint into every prefill replica before either takes traffic,
and hands them to the router as `ServeWorkerHandle`s; `ServeReplacer` is the router's `Replacer`
under Serve: a dead replica's replacement is whichever new replica of its kind Serve starts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from actors.errors import WorkerTimeout
from actors.messages import WorkerLoad
from actors.prefix_cache.actor import RayStoreHandle
from actors.prefix_cache.ring import StoreId
from actors.ray_actors import ColocatedActor, DecodeActor, PrefillActor
from actors.worker_config import WorkerConfig
from cluster.router.client import Router
from cluster.router.handles import WorkerUnreachable
from cluster.router.loads import bounded
from cluster.router.pinned_router import PinnedRouter
from cluster.router.serve_handles import ServeWorkerHandle
from deploy.local import bind_replica_grpc_to_loopback

logger = logging.getLogger(__name__)
STORE_WAIT_S = 120.0  # a replica waits this long for the ingress to start the prefix-cache stores
HEALTH_CHECK_PERIOD_S = 5.0
GRACEFUL_SHUTDOWN_S = 60.0  # streams in flight get this long to finish when a replica stops


@dataclass(frozen=True)
class WorkerIdentity:
    replica_id: str
    name: str
    kind: str  # "prefill", "decode" or "colocated"
    transport_metadata: bytes | None  # a decode replica's KV endpoint


def _find_stores(store_ids: list[str]) -> dict[StoreId, RayStoreHandle]:
    deadline = time.monotonic() + STORE_WAIT_S
    stores = {}
    for store_id in store_ids:
        while True:
            try:
                stores[StoreId(store_id)] = RayStoreHandle(ray.get_actor(store_id))
                break
            except ValueError:  # not started yet: the ingress starts them beside us
                if time.monotonic() > deadline:
                    raise RuntimeError(f"prefix-cache store {store_id} did not start within {STORE_WAIT_S:g}s")
                time.sleep(0.5)
    return stores


class _Replica:
    """What a worker actor class gains as a replica of a Serve deployment: its name from the
    replica's id, `identify` (the ingress finds replicas by broadcast), Serve's `check_health`
    (the engine loop is alive), and a close when Serve stops it. Every other method is the actor's
    own: Serve calls it directly, pinned to this replica by `PinnedRouter`."""

    kind = "worker"
    if TYPE_CHECKING:  # the worker actor's, which every replica class is too
        name: str

        async def load(self) -> WorkerLoad: ...

        def close(self) -> None: ...

        def transport_metadata(self) -> bytes: ...

    def _replica_name(self, prefix: str, loopback_only: bool) -> str:
        if loopback_only:  # a replica's inter-deployment gRPC server listens on 127.0.0.1 too (as the ingress's)
            bind_replica_grpc_to_loopback()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        return f"{prefix}-{self.kind}-{self.replica_id}"

    async def identify(self) -> WorkerIdentity:
        metadata = self.transport_metadata() if self.kind == "decode" else None
        return WorkerIdentity(self.replica_id, self.name, self.kind, metadata)

    async def check_health(self) -> None:
        if not (await self.load()).healthy:
            raise RuntimeError(f"{self.name}: its engine loop died")

    def __del__(self) -> None:
        if getattr(self, "engine", None) is not None:  # built: its engine thread and endpoint stop
            self.close()


class PrefillReplica(_Replica, PrefillActor):
    kind = "prefill"

    def __init__(self, cfg: WorkerConfig, store_ids: list[str], torch_threads: int | None, prefix: str,
                 loopback_only: bool = True) -> None:
        super().__init__(cfg, self._replica_name(prefix, loopback_only), _find_stores(store_ids) or None, torch_threads)


class DecodeReplica(_Replica, DecodeActor):
    kind = "decode"

    def __init__(self, cfg: WorkerConfig, store_ids: list[str], torch_threads: int | None, prefix: str,
                 loopback_only: bool = True) -> None:
        super().__init__(cfg, self._replica_name(prefix, loopback_only), torch_threads, _find_stores(store_ids) or None)


class ColocatedReplica(_Replica, ColocatedActor):
    kind = "colocated"

    def __init__(self, cfg: WorkerConfig, store_ids: list[str], torch_threads: int | None, prefix: str,
                 loopback_only: bool = True) -> None:
        super().__init__(cfg, self._replica_name(prefix, loopback_only), torch_threads)


def worker_deployment(cls: type, name: str, num_replicas: int, actor_options: Mapping[str, Any]) -> Any:
    """`cls` as a Serve deployment: pinned routing, health checks, a graceful stop that lets streams end."""
    return serve.deployment(
        cls, name=name, num_replicas=num_replicas, ray_actor_options=dict(actor_options),
        max_ongoing_requests=1024,  # the scheduler admits; Serve must never refuse a pinned call
        health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=60.0,
        graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
        request_router_config=RequestRouterConfig(request_router_class=PinnedRouter))


class ServeWorkers:
    """The ingress's view of the worker deployments: finds replicas, wires them, adds them to `router`."""

    def __init__(self, decode: DeploymentHandle, prefill: DeploymentHandle | None, call_timeout_s: float = 60.0) -> None:
        self.decode, self.prefill = decode, prefill
        self.call_timeout_s = call_timeout_s
        self.router: Router | None = None
        self.known: dict[str, ServeWorkerHandle] = {}  # by replica id
        self._lock = asyncio.Lock()

    async def identify(self, handle: DeploymentHandle) -> list[WorkerIdentity]:
        """The live replicas that answered (a dying one fails its part, not the whole call)."""
        answers = await handle.broadcast("identify").results_async(timeout_s=self.call_timeout_s,
                                                                   return_exceptions=True)
        return [a for a in answers if isinstance(a, WorkerIdentity)]

    async def discover(self) -> list[ServeWorkerHandle]:
        """Adds the replicas not seen before (wired first); returns them."""
        assert self.router is not None, "attach a router first"
        async with self._lock:
            decodes = await self.identify(self.decode)
            prefills = await self.identify(self.prefill) if self.prefill is not None else []
            if not self.known and self.prefill is not None and not (prefills and decodes):
                return []  # at start, both kinds or neither: a half-started app would prefill on decode
            new_decodes = [w for w in decodes if w.replica_id not in self.known]
            new_prefills = [w for w in prefills if w.replica_id not in self.known]
            live_prefills = [self._handle(w) for w in prefills]
            for d in new_decodes:  # every prefill replica learns the new KV endpoint
                await asyncio.gather(*(p.add_peer(d.transport_metadata) for p in live_prefills
                                       if p.replica_id not in {w.replica_id for w in new_prefills}))
            for p in new_prefills:  # a new prefill replica learns every endpoint
                for d in decodes:
                    await self._handle(p).add_peer(d.transport_metadata)
            added = []
            for w in [*new_prefills, *new_decodes]:
                handle = self.known[w.replica_id] = self._handle(w)
                await self._reachable(handle)
                self.router.add_worker("prefill" if w.kind == "prefill" else "decode", handle)
                added.append(handle)
            if added:
                logger.info("workers joined: %s", ", ".join(h.name for h in added))
            await self._revive([self.known[w.replica_id] for w in [*prefills, *decodes] if w.replica_id in self.known])
            return added

    async def _reachable(self, handle: ServeWorkerHandle, wait_s: float = 10.0) -> None:
        """Until a call pinned to `handle` reaches it, at most `wait_s`: the ingress's routers learn of
        a new replica a moment after `identify` finds it, and a pinned call before that fails as if the
        replica were gone (PinnedRouter), which would declare a healthy new worker dead."""
        deadline = time.monotonic() + wait_s
        while True:
            try:  # each try bounded by what is left of `wait_s`: a starting replica may hold the call
                await bounded(handle.load(), max(0.5, deadline - time.monotonic()), f"load of {handle.name}")
                return
            except (WorkerUnreachable, WorkerTimeout) as e:  # any failure: it is in `known` and must be added
                if time.monotonic() >= deadline:
                    logger.warning("new worker %s not reachable yet (%s); added anyway", handle.name, e)
                    return
            await asyncio.sleep(0.5)

    async def _revive(self, live: list[ServeWorkerHandle]) -> None:
        """Replicas the router declared dead that still answer `identify` and report a healthy engine
        (a pinned call raced the ingress's view of a new replica, or a slow load read as gone):
        placeable again. Serve restarts a replica that is really dead under a new id, never this one."""
        assert self.router is not None
        for handle in (h for h in live if h.name in self.router.board.dead):
            try:
                load = await bounded(handle.load(), self.call_timeout_s, f"load of {handle.name}")
            except (WorkerUnreachable, WorkerTimeout):
                continue
            if load.healthy:
                logger.warning("worker %s answers with a healthy engine again; placeable", handle.name)
                self.router.board.revive(handle.name)

    def _handle(self, w: WorkerIdentity) -> ServeWorkerHandle:
        known = self.known.get(w.replica_id)
        if known is not None:
            return known
        return ServeWorkerHandle(w.name, w.replica_id, self._deployment(w.kind))

    def _deployment(self, kind: str) -> DeploymentHandle:
        """The deployment whose replicas are of `kind`: decode and colocated replicas are `decode`'s."""
        if kind != "prefill":
            return self.decode
        if self.prefill is None:
            raise ValueError("a prefill replica answered, but this app has no prefill deployment")
        return self.prefill


class ServeReplacer:
    """A dead replica's replacement: the next new replica of its kind that Serve starts; none when the
    deployment has as many live replicas as it is meant to (Serve stopped this one on purpose: a
    scale-down). `wanted(handle)`: the replicas its deployment should have now."""

    def __init__(self, workers: ServeWorkers, wanted: Callable[[DeploymentHandle], int], timeout_s: float = 300.0,
                 poll_s: float = 1.0) -> None:
        self.workers, self.wanted, self.timeout_s, self.poll_s = workers, wanted, timeout_s, poll_s

    async def replace(self, name: str) -> ServeWorkerHandle | None:
        gone = next((h for h in self.workers.known.values() if h.name == name), None)
        if gone is None:
            raise KeyError(f"no replica named {name!r}")
        before = {rid for rid in self.workers.known if rid != gone.replica_id}
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            await self.workers.discover()
            fresh = [h for rid, h in self.workers.known.items() if rid not in before and rid != gone.replica_id
                     and h.handle is gone.handle]  # same deployment: same kind
            if fresh:
                return fresh[0]
            live = await self.workers.identify(gone.handle)
            if len(live) >= self.wanted(gone.handle):  # Serve stopped it on purpose and starts none
                return None
            await asyncio.sleep(self.poll_s)
        raise TimeoutError(f"Serve started no replacement for {name} within {self.timeout_s:g}s")
