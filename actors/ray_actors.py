"""Ray at the edge of the data plane: the workers as actors, and the wiring of one deployment.

Mental model: each actor is its plain worker class with a constructor that builds the worker's
collaborators inside the actor's own process (load the model, start the engine thread, open the
transport endpoint, connect to the prefix-cache stores), so only a frozen `WorkerConfig` crosses
the wire. They are async actors: streams, announces and the transport's threads run concurrently,
and every worker method that may block runs on a thread. What each worker asks Ray for is a
`WorkerResources` (actors/worker_config.py): on CPU a quarter of a CPU, so the embedded default,
1 prefill + 1 decode + 1 cache actor, fits on 2 cores (`torch_threads` decides how many cores each
one's kernels really use); on a GPU cluster a GPU or a fraction of one, and the engine's device is
pinned to what Ray grants. Each worker's load poll carries its engine's `KVPlan` (how its KV pool
was sized), and its log has the engine's own lines, the plan among them.

`start_pd` wires a deployment: store actors, decode actors (which fetch from the stores for the
prompts they prefill themselves), prefill actors that know every decode endpoint (they `add_peer`
its transport metadata) and the stores; `start_colocated` a set of
colocated workers. Actors never restart in place (`max_restarts=0`): a worker restarted by Ray
would come back without its peers. Instead `PDDeployment.replace(name)` starts a fresh actor of
the same kind under the same name and wires it as `start_pd` would (a new decode endpoint is
added to every prefill worker; a new prefill worker learns every decode endpoint). The transports
tell the new incarnation from the dead one by their incarnation numbers, the scheduler by the
worker's telemetry incarnation; keeping the name keeps dashboards and metrics continuous.
The router calls it when it declares a worker dead (`cluster.router.ray_handles.router_for(...,
replace_dead=True)`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import uuid
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field, replace
from typing import TypeVar

import ray
import torch
from ray.actor import ActorHandle

from actors.colocated import ColocatedWorker
from actors.core_share import DecodeYield, PrefillClaim, lend_cores
from actors.decode import DecodeWorker
from actors.engine.async_engine import AsyncEngine
from actors.engine.engine import Engine
from actors.engine.output import EngineStats
from actors.handoff import kv_layout
from actors.messages import WorkerLoad
from actors.moe_link import link_routing
from actors.node_roles import worker_role
from actors.prefill import PrefillWorker
from actors.prefix_cache.actor import RayStoreHandle, start_store_actors
from actors.prefix_cache.handles import StoreHandle
from actors.prefix_cache.pool import PrefixCachePool
from actors.prefix_cache.ring import StoreId
from actors.prefix_cache.store import PrefixCacheConfig
from actors.worker_config import WORKER_NUM_CPUS, WorkerConfig, WorkerResources, plan_worker_resources
from transfer.config import make_transport
from transfer.transport import KVTransport

logger = logging.getLogger(__name__)
T = TypeVar("T")

START_TIMEOUT_S = 180.0  # model load in a fresh process on a busy 2-core box


def cluster_gpus() -> float:
    """GPUs in the Ray cluster now (its `GPU` resource total; 0 on a CPU-only cluster)."""
    return float(ray.cluster_resources().get("GPU", 0.0))


def log_to_worker_output(package: str = "actors") -> None:
    """Ray sets up only its own `ray` logger in a worker process, so a package's INFO lines (model
    load, transport, the engine's KV plan; the router's warnings in the ingress) would be dropped;
    they go to the worker's stderr, which Ray keeps in the worker's log file and shows the driver."""
    root = logging.getLogger(package)
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False


def _load_engine(cfg: WorkerConfig, torch_threads: int | None, name: str) -> AsyncEngine:
    log_to_worker_output()
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    engine = AsyncEngine(Engine.from_pretrained(cfg.model, cfg.engine), stream_interval=cfg.stream_interval)
    link_routing(engine, cfg.model, name)  # MoE models: expert loads, routing tables (actors/moe_link.py)
    return engine


def _lend(engine: AsyncEngine, role: str) -> DecodeYield | PrefillClaim | None:
    """A CPU engine whose node's cores are shared takes its part in lending them (core_share.py)."""
    return lend_cores(engine, role) if engine.engine.device.type == "cpu" else None


def _open_transport(cfg: WorkerConfig, name: str, kv_device: torch.device) -> KVTransport:
    """The worker's endpoint, for KV living on `kv_device`. With KV on a GPU, `auto` picks CUDA IPC
    when the whole Ray cluster is this one node (every peer is then on it), else NIXL with device
    staging. Every worker decides from the cluster as it starts, so all agree on one kind; a node
    that joins later leaves the running workers as they are."""
    if cfg.ucx_net_devices is not None:  # see WorkerConfig: UCX reads it when NIXL's agent starts
        os.environ.setdefault("UCX_NET_DEVICES", cfg.ucx_net_devices)
    peer_node = None
    if kv_device.type == "cuda" and sum(1 for n in ray.nodes() if n.get("Alive")) == 1:
        from transfer.cuda_ipc import this_node

        peer_node = this_node()
    return make_transport(name, cfg.transfer, kv_device=kv_device, peer_node=peer_node)


def _checked_stats(engine: Engine) -> EngineStats:
    engine.check_integrity()
    return engine.stats()


class _Inspected:
    """Actor methods over the engine's own figures: its checks (tests and operators: leaked
    blocks), and its KV plan on every load poll (fixed at start-up; a few hundred bytes)."""

    engine: AsyncEngine
    _lender: DecodeYield | PrefillClaim | None = None

    async def check_integrity(self) -> EngineStats:
        """Asserts the engine's block accounting under its lock; returns its stats."""
        return await asyncio.to_thread(self.engine.locked, _checked_stats, self.engine.engine)

    async def load(self) -> WorkerLoad:
        load: WorkerLoad = await super().load()  # type: ignore[misc]
        lent = self._lender.paused_s if isinstance(self._lender, DecodeYield) else 0.0
        return replace(load, kv_plan=self.engine.engine.kv_plan, cores_lent_s=lent)


class PrefillActor(_Inspected, PrefillWorker):
    def __init__(self, cfg: WorkerConfig, name: str, stores: Mapping[StoreId, StoreHandle] | None = None,
                 torch_threads: int | None = None) -> None:
        engine = _load_engine(cfg, torch_threads, name)
        self._lender = _lend(engine, "prefill")
        pool = PrefixCachePool(stores, timeout_s=cfg.pool_timeout_s) if stores else None
        super().__init__(cfg, engine, _open_transport(cfg, name, engine.engine.device), kv_layout(engine.engine),
                         pool, name)


class DecodeActor(_Inspected, DecodeWorker):
    def __init__(self, cfg: WorkerConfig, name: str, torch_threads: int | None = None,
                 stores: Mapping[StoreId, StoreHandle] | None = None) -> None:
        engine = _load_engine(cfg, torch_threads, name)
        self._lender = _lend(engine, "decode")
        pool = PrefixCachePool(stores, timeout_s=cfg.pool_timeout_s) if stores else None
        super().__init__(cfg, engine, _open_transport(cfg, name, engine.engine.device), kv_layout(engine.engine),
                         name, pool)


class ColocatedActor(_Inspected, ColocatedWorker):
    def __init__(self, cfg: WorkerConfig, name: str, torch_threads: int | None = None) -> None:
        super().__init__(_load_engine(cfg, torch_threads, name), name)


# The defaults; each start asks for its `WorkerResources` through `.options(...)`.
RemotePrefill = ray.remote(num_cpus=WORKER_NUM_CPUS, max_restarts=0)(PrefillActor)
RemoteDecode = ray.remote(num_cpus=WORKER_NUM_CPUS, max_restarts=0)(DecodeActor)
RemoteColocated = ray.remote(num_cpus=WORKER_NUM_CPUS, max_restarts=0)(ColocatedActor)


def placed(cfg: WorkerConfig, resources: WorkerResources) -> WorkerConfig:
    """`cfg` with its engine as it must run under `resources` (`WorkerResources.place`)."""
    engine = resources.place(cfg.engine)
    return cfg if engine == cfg.engine else replace(cfg, engine=engine)


@dataclass
class PDDeployment:
    prefills: dict[str, ActorHandle]
    decodes: dict[str, ActorHandle]  # keyed by transport endpoint name, as prefills know them
    stores: dict[StoreId, RayStoreHandle] = field(default_factory=dict)
    cfg: WorkerConfig | None = None  # what replacements are built from (placed); None: `replace` refuses
    torch_threads: int | None = None
    resources: WorkerResources = field(default_factory=WorkerResources)  # what each worker asks Ray for
    colocated: bool = False  # `decodes` are colocated workers (no prefill workers, no handoff)
    start_timeout_s: float = START_TIMEOUT_S
    closed: bool = False  # shut down: replacements are refused (and one under way is stopped)

    async def replace(self, name: str) -> ActorHandle:
        """Kills what is left of worker `name`, starts a fresh actor of its kind under the same name,
        wires it to the live peers, and returns it once it answers (within `start_timeout_s`).
        A peer that does not take the new endpoint is logged and skipped: it is dead or dying, and
        learns every endpoint when it is replaced in turn."""
        if self.cfg is None:
            raise RuntimeError(f"cannot replace {name}: this deployment was not started with its WorkerConfig")
        if self.closed:
            raise RuntimeError(f"cannot replace {name}: the deployment is shut down")
        kind = "prefill" if name in self.prefills else "decode" if name in self.decodes else None
        if kind is None:
            raise KeyError(f"no worker named {name!r} in this deployment")
        _kill(self.prefills[name] if kind == "prefill" else self.decodes[name])
        timeout = self.start_timeout_s
        cfg, options = placed(self.cfg, self.resources), self.resources.actor_options(worker_role(kind))
        if self.colocated:
            handle = RemoteColocated.options(**options).remote(cfg, name, self.torch_threads)
            await _started(handle, asyncio.wait_for(handle.load.remote(), timeout))
        elif kind == "decode":
            handle = RemoteDecode.options(**options).remote(cfg, name, self.torch_threads, self.stores or None)
            metadata = await _started(handle, asyncio.wait_for(handle.transport_metadata.remote(), timeout))
            await _each("add the new endpoint of " + name, {
                p: asyncio.wait_for(prefill.add_peer.remote(metadata), timeout) for p, prefill in self.prefills.items()})
        else:
            handle = RemotePrefill.options(**options).remote(cfg, name, self.stores or None, self.torch_threads)
            await _started(handle, asyncio.wait_for(handle.load.remote(), timeout))
            metadata = await _each("read the endpoint", {
                d: asyncio.wait_for(decode.transport_metadata.remote(), timeout) for d, decode in self.decodes.items()})
            await _each(f"add to {name}", {d: asyncio.wait_for(handle.add_peer.remote(m), timeout)
                                           for d, m in metadata.items()})
        if self.closed:  # shut down while it started: it must not outlive the deployment
            _kill(handle)
            raise RuntimeError(f"the deployment shut down while {name} was being replaced")
        (self.prefills if kind == "prefill" else self.decodes)[name] = handle
        logger.info("replaced %s worker %s", kind, name)
        return handle

    def shutdown(self) -> None:
        """Kills every actor of the deployment (their transports and store folders go with them)."""
        self.closed = True
        for handle in [*self.prefills.values(), *self.decodes.values(), *(s.actor for s in self.stores.values())]:
            _kill(handle)


def _kill(handle: ActorHandle) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # already dead: nothing to stop
        pass


async def _started(handle: ActorHandle, first_call: Awaitable[T]) -> T:
    """The answer to a fresh actor's first call; the actor is killed if it never answers."""
    try:
        return await first_call
    except BaseException:
        _kill(handle)
        raise


async def _each(what: str, calls: Mapping[str, Awaitable[T]]) -> dict[str, T]:
    """Runs one call per peer at once; returns the answers of those that answered, logs the rest."""
    names = list(calls)
    results = await asyncio.gather(*calls.values(), return_exceptions=True)
    out = {}
    for name, result in zip(names, results):
        if isinstance(result, BaseException):
            logger.warning("could not %s on %s: %r", what, name, result)
        else:
            out[name] = result
    return out


def _resources_for(cfg: WorkerConfig, num_workers: int, resources: WorkerResources | None) -> WorkerResources:
    """The given resources, or those the engine's device asks for on this cluster (CPU on a
    cluster without GPUs; see `plan_worker_resources`)."""
    if resources is not None:
        return resources
    return plan_worker_resources(cfg.engine.device, num_workers, cluster_gpus())


def start_pd(cfg: WorkerConfig, *, num_prefill: int = 1, num_decode: int = 1,
             cache: PrefixCacheConfig | None = None, num_cache: int = 1, torch_threads: int | None = None,
             name_prefix: str | None = None, timeout_s: float = START_TIMEOUT_S,
             resources: WorkerResources | None = None) -> PDDeployment:
    """Starts and wires a deployment; returns once every worker answers. `cache=None` or
    `num_cache=0`: no prefix-cache pool. `resources`: what each worker asks Ray for (None:
    planned from `cfg.engine.device` and the cluster's GPUs)."""
    prefix = name_prefix or f"ferry-{uuid.uuid4().hex[:6]}"
    resources = _resources_for(cfg, num_prefill + num_decode, resources)
    cfg = placed(cfg, resources)
    stores = (start_store_actors(cache, num_cache, id_prefix=f"{prefix}-cache", roles=resources.roles)
              if cache and num_cache else {})
    decode_options = resources.actor_options("decode")
    decodes = {f"{prefix}-decode-{i}": RemoteDecode.options(**decode_options).remote(
                   cfg, f"{prefix}-decode-{i}", torch_threads, stores or None)
               for i in range(num_decode)}
    prefills = {f"{prefix}-prefill-{i}": RemotePrefill.options(**resources.actor_options("prefill")).remote(
                    cfg, f"{prefix}-prefill-{i}", stores or None, torch_threads)
                for i in range(num_prefill)}
    deployment = PDDeployment(prefills, decodes, dict(stores), cfg, torch_threads, resources,
                              start_timeout_s=timeout_s)
    try:
        metadata = ray.get([d.transport_metadata.remote() for d in decodes.values()], timeout=timeout_s)
        for prefill in prefills.values():
            names = ray.get([prefill.add_peer.remote(m) for m in metadata], timeout=timeout_s)
            assert names == list(decodes), (names, list(decodes))
    except BaseException:
        deployment.shutdown()
        raise
    logger.info("started %d prefill, %d decode, %d cache actors (%s) on %s (%s each)", num_prefill, num_decode,
                len(stores), prefix, resources.device, decode_options)
    return deployment


def start_colocated(cfg: WorkerConfig, *, num_workers: int = 1, torch_threads: int | None = None,
                    name_prefix: str = "colocated", timeout_s: float = START_TIMEOUT_S,
                    resources: WorkerResources | None = None) -> PDDeployment:
    """Starts `num_workers` colocated workers (`<prefix>-<i>`); returns once each answers.
    `resources` as for `start_pd`."""
    resources = _resources_for(cfg, num_workers, resources)
    cfg = placed(cfg, resources)
    options = resources.actor_options("decode")
    workers = {f"{name_prefix}-{i}": RemoteColocated.options(**options).remote(cfg, f"{name_prefix}-{i}",
                                                                             torch_threads)
               for i in range(num_workers)}
    deployment = PDDeployment({}, workers, cfg=cfg, torch_threads=torch_threads, resources=resources,
                              colocated=True, start_timeout_s=timeout_s)
    try:
        ray.get([w.load.remote() for w in workers.values()], timeout=timeout_s)
    except BaseException:
        deployment.shutdown()
        raise
    return deployment
