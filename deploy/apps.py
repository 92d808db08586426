"""Ray Serve application builder: `build_app(args) -> Application`.

Mental model: one ingress deployment owns HTTP (the OpenAI app from deploy/openai) and, in its
constructor, starts the data plane it talks to: prefix-cache store actors, decode actors, prefill
actors wired to every decode endpoint (or colocated actors), each asking Ray for a fractional CPU
(so the embedded default fits a 2-core machine) or, where the engines run on cuda, a GPU or a share
of one (`AppConfig.worker_resources`); when disaggregated, the scheduler actor (cluster/)
that admits and places every request and plans recoveries; and, when `api.semantic_cache` is set,
the semantic-cache store actor (actors/semantic_cache/actor.py), which reloads its saved entries on
start and saves them again when the ingress shuts down. The same builder serves
`serve run deploy/serve.yaml`, `ferry serve` and Python callers; `args` is the YAML config as a
dict (see deploy/config.py), whose `scheduler` section (deploy/scheduler_config.py) is split off
and validated here. With `workers_as: deployments` the workers are not the ingress's actors but
Serve deployments of their own (deploy/worker_servers.py), bound beside the ingress, which finds
their replicas and wires them (`ServeWorkers`); the ingress still starts the prefix-cache stores
and the scheduler actor.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import ray
from pydantic import ValidationError
from ray import serve
from ray.serve import Application

from actors.engine.fetch import resolve_model
from actors.engine.tokenizer import Tokenizer
from actors.prefix_cache.actor import start_store_actors
from actors.ray_actors import PDDeployment, cluster_gpus, log_to_worker_output, start_colocated, start_pd
from actors.semantic_cache.actor import RaySemanticCache, start_semantic_cache, stop_semantic_cache
from actors.moe_link import ROUTING_ACTOR, model_key
from cluster.actor import start_scheduler
from cluster.moe.actor import start_routing_control
from cluster.router.client import Router
from cluster.router.config import RouterConfig
from cluster.router.link import SchedulerLink
from cluster.router.ray_handles import router_for
from deploy.cluster_backend import ClusterBackend
from deploy.config import AppConfig, ConfigError, load_config
from deploy.dashboard.monitoring import Monitoring, run_in_lifespan
from deploy.local import bind_replica_grpc_to_loopback
from deploy.moe import RayRoutingAdmin, RoutingView, expert_load_exporter
from deploy.openai import build_api
from deploy.openai.admin import mount_admin
from deploy.openai.drain import DrainState
from deploy.placement import check_ray_placement
from deploy.pool_source import PoolSource
from deploy.scheduler_config import SchedulerSection
from deploy.scaler import ReplicaScaler
from deploy.semantic import SemanticCacheSettings, SemanticGlue
from deploy.worker_servers import (ColocatedReplica, DecodeReplica, PrefillReplica, ServeReplacer, ServeWorkers,
                                   worker_deployment)

logger = logging.getLogger(__name__)

SEMANTIC_CACHE_ACTOR = "ferry-semantic-cache"
DISCOVER_INTERVAL_S = 2.0  # how often the ingress looks for worker replicas Serve started
STORE_PREFIX = "ferry-cache"  # the prefix-cache store actors of `workers_as: deployments`, found by name


def default_torch_threads(cfg: AppConfig) -> int:
    """All of this node's CPUs for every engine when they share the cores (`engine.cpu_cores`
    shared: their OpenMP threads sleep when idle, so two busy engines take turns and a lone busy
    one runs on every core), else an equal split among the app's engines (`python -m bench.cores`
    on 2 cores: a prefill alone 515 tok/s shared vs 269 split; beside a busy decode 278 vs 271, and
    138 shared with torch's default spinning threads). On GPU nodes the CPU threads matter little."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cpus if cfg.engine.cpu_cores == "shared" else max(1, cpus // cfg.num_engines)


INGRESS_ACTOR_OPTIONS = {"num_cpus": 0.1}


@serve.deployment(num_replicas=1, ray_actor_options=INGRESS_ACTOR_OPTIONS, max_ongoing_requests=256,
                  health_check_timeout_s=60)
@serve.ingress()
class FerryIngress:
    def __init__(self, config: dict[str, Any], scheduler: dict[str, Any] | None = None,
                 workers: dict[str, Any] | None = None) -> None:
        """`workers`: the worker deployments' handles ("decode", and "prefill" unless colocated)
        when they run as Serve deployments; None: this ingress starts them as actors."""
        self.cfg = AppConfig.model_validate(config)
        self.scheduler_cfg = SchedulerSection.model_validate(scheduler or {})
        self._scheduler: Any = None
        self._link: SchedulerLink | None = None
        self._semantic_actor: Any = None
        self._stores: list[Any] = []
        self._store_handles: dict[str, Any] = {}  # the prefix-cache stores, for /health and metrics
        self.scaler: ReplicaScaler | None = None
        self._worker_handles: dict[str, Any] = {}
        self.semantic: SemanticGlue | None = None
        cfg = self.cfg
        roles = cfg.placement.node_roles()
        log_to_worker_output("cluster")  # the router's and the scheduler link's warnings
        log_to_worker_output("deploy")  # the scaler's changes
        if cfg.loopback_only:
            bind_replica_grpc_to_loopback()
        check_ray_placement(roles)  # no node can ever host a role: a clear error, not a hang
        if cfg.api.semantic_cache is not None:
            self.semantic = self._start_semantic(cfg.api.semantic_cache)
        path = resolve_model(cfg.model)  # fetched once here, so workers find it cached
        self.tokenizer = Tokenizer.load(path)
        self._routing: RayRoutingAdmin | None = None  # MoE models: the routing controller, up before the workers
        if _read_config(path).is_moe:
            self._routing = RayRoutingAdmin(_fresh_actor(
                ROUTING_ACTOR, lambda: start_routing_control(name=ROUTING_ACTOR), lambda old: ray.kill(old, no_restart=True)))
        resources = cfg.worker_resources(cluster_gpus())
        worker_cfg = cfg.to_worker_config(resources, self.scheduler_cfg.worker_policies())
        threads = cfg.engine.torch_threads or default_torch_threads(cfg)
        self._deployment: PDDeployment | None = None
        if cfg.mode == "disaggregated" and self.scheduler_cfg.enabled:
            sched = self.scheduler_cfg.to_scheduler_config(cfg.engine.max_num_seqs)
            name = self.scheduler_cfg.actor_name
            head = roles.resources("head")
            self._scheduler = _fresh_actor(name, lambda: start_scheduler(sched, name=name, resources=head),
                                           lambda old: ray.kill(old, no_restart=True))
            self._link = SchedulerLink(self._scheduler, self.scheduler_cfg.to_link_config(cfg.engine.block_size), sched)
        if workers is not None:
            router = self._serve_workers(workers)
        elif cfg.mode == "colocated":
            self._deployment = start_colocated(worker_cfg, num_workers=cfg.num_decode, torch_threads=threads,
                                               resources=resources)
            router = router_for(self._deployment, self._router_config(), replace_dead=cfg.replace_dead_workers)
        else:
            self._deployment = start_pd(
                worker_cfg, num_prefill=cfg.num_prefill, num_decode=cfg.num_decode,
                cache=cfg.to_cache_config(self.scheduler_cfg.kv_shares()), num_cache=cfg.prefix_cache.num_stores,
                torch_threads=threads, name_prefix="ferry", resources=resources,
            )
            router = router_for(self._deployment, self._router_config(), control=self._link,
                                replace_dead=cfg.replace_dead_workers)
            self._store_handles = dict(self._deployment.stores)
        max_len = cfg.engine.max_model_len or _context_of(path)
        pool = PoolSource(self._store_handles) if self._store_handles else None
        if pool is not None and self._link is not None:  # the scheduler's index learns what the pool holds
            self._link.attach_pool(pool.pool.holdings)
        self.backend = ClusterBackend(router, self.tokenizer, model_key(cfg.model), max_len, pool=pool,
                                      num_experts=getattr(_read_config(path), "num_experts", None))
        # MoE models: /health and the dashboard show each worker's expert loads and the routing table.
        self._routing_view = None if self._routing is None else RoutingView(self._routing, model_key(cfg.model))
        # Metrics + /dashboard observe the app: every request's timeline feeds the histograms.
        self.monitoring = Monitoring(self.backend, slos=self.scheduler_cfg.tenant_slos(), semantic=self.semantic,
                                     pool=pool, experts=self._routing_view)
        logger.info("ferry ingress up: %s mode, model %s, workers on %s (%s each)", cfg.mode, cfg.model,
                    resources.device, resources.actor_options())

    def _router_config(self) -> RouterConfig:
        return self.cfg.to_router_config()

    def _serve_workers(self, workers: dict[str, Any]) -> Router:
        """The router over the worker deployments' replicas (found on the first poll), after
        starting the prefix-cache stores their replicas wait for."""
        cache = self.cfg.to_cache_config(self.scheduler_cfg.kv_shares())
        if cache is not None and self.cfg.mode == "disaggregated":
            stores = start_store_actors(cache, self.cfg.prefix_cache.num_stores, id_prefix=STORE_PREFIX,
                                        roles=self.cfg.placement.node_roles())
            self._stores = [s.actor for s in stores.values()]
            self._store_handles = dict(stores)
        found = ServeWorkers(workers["decode"], workers.get("prefill"))
        replacer = ServeReplacer(found, self._wanted_replicas) if self.cfg.replace_dead_workers else None
        router = Router({}, {}, self._router_config(), control=self._link, replacer=replacer)
        self._worker_handles = workers
        found.router = router
        router.board.discover_interval_s = DISCOVER_INTERVAL_S
        scaling = self.scheduler_cfg.scaling
        if scaling is None or self._link is None:
            router.board.discover = found.discover
            return router
        roles = {"decode": ("colocated" if self.cfg.mode == "colocated" else "decode", self.cfg.num_decode)}
        if self.cfg.mode == "disaggregated":
            roles["prefill"] = ("prefill", self.cfg.num_prefill)
        app = serve.get_replica_context().app_name
        self.scaler = ReplicaScaler(self._link.scale_advice, lambda name, n: set_replicas(app, name, n), roles,
                                    on_change=found.discover)
        scaler = self.scaler

        def capacity_coming() -> bool:  # a scale-up applied whose replica has not joined the router yet
            live = sum(1 for name in router.decodes if name not in router.board.dead)
            return scaler.applied.get("decode", 0) > live

        router.capacity_coming = capacity_coming

        async def discover() -> None:
            await found.discover()
            self.scaler.start()  # on this replica's event loop, once it runs

        router.board.discover = discover
        return router

    def _wanted_replicas(self, handle: Any) -> int:
        """The replicas the worker deployment behind `handle` should have: the scaler's last target,
        or the configured count."""
        role = "prefill" if handle is self._worker_handles.get("prefill") else "decode"
        if self.scaler is not None and role in self.scaler.applied:
            return self.scaler.applied[role]
        return self.cfg.num_prefill if role == "prefill" else self.cfg.num_decode

    def _start_semantic(self, settings: SemanticCacheSettings) -> SemanticGlue:
        """The store actor, fresh (it reloads what the last one saved), behind the HTTP glue."""
        self._semantic_actor = _fresh_actor(
            SEMANTIC_CACHE_ACTOR,
            lambda: start_semantic_cache(settings.cache_config(), settings.service_config(), name=SEMANTIC_CACHE_ACTOR),
            stop_semantic_cache)
        return SemanticGlue(settings, RaySemanticCache(self._semantic_actor, settings.timeout_s))

    def __serve_build_asgi_app__(self):  # type: ignore[no-untyped-def]
        app = build_api(self.backend, self.cfg.api, semantic=self.semantic,
                        policies=self.scheduler_cfg.request_policies())
        self.monitoring.mount(app)
        if self.scaler is not None:
            app.state.hooks.health_parts["scaling"] = self.scaler.health
        if self._routing_view is not None:
            app.state.hooks.health_parts["moe"] = self._routing_view.health
        served = list(self.cfg.api.served_model_names) or [self.backend.model_name]
        mount_admin(app, self.cfg.api, self._routing, {name: model_key(self.cfg.model) for name in served})
        if self._routing is not None:
            run_in_lifespan(app, expert_load_exporter(self._routing, model_key(self.cfg.model)),
                            self.monitoring.period_s)
        self._drain_state: DrainState = app.state.drain
        return app

    async def drain(self, timeout_s: float) -> int:
        """Before a stop (`ferry serve` on Ctrl-C or SIGTERM; a handle call): new requests get 503,
        those in flight get up to `timeout_s` to finish. Returns how many were still in flight."""
        return await self._drain_state.drain(timeout_s)

    def __del__(self) -> None:
        if self.scaler is not None:
            self.scaler.close()
        if self._link is not None:
            self._link.close()
        if self._scheduler is not None:
            ray.kill(self._scheduler, no_restart=True)
        if self._deployment is not None:
            self._deployment.shutdown()
        if self._routing is not None:
            ray.kill(self._routing.actor, no_restart=True)
        for store in self._stores:
            ray.kill(store, no_restart=True)
        if self._semantic_actor is not None:
            stop_semantic_cache(self._semantic_actor)  # saves first: the next ingress reloads it


def _fresh_actor(name: str, start: Callable[[], Any], stop: Callable[[Any], None], timeout_s: float = 30.0) -> Any:
    """`start()`ed under `name` once the name is free: an actor left there by an earlier ingress
    is `stop`ped first (the scheduler's requests died with that ingress; the semantic cache saves
    its entries for the new one to reload), so no stale state or configuration carries over."""
    try:
        old = ray.get_actor(name)
    except ValueError:  # the name is free
        return start()
    stop(old)
    deadline = time.monotonic() + timeout_s
    while True:  # ray.kill is asynchronous: the name frees a little later
        try:
            ray.get_actor(name)
        except ValueError:
            return start()
        if time.monotonic() > deadline:
            raise TimeoutError(f"the old actor {name!r} did not go away in {timeout_s:g}s")
        time.sleep(0.1)


def _read_config(path: Any) -> Any:
    from actors.engine.weights import read_config

    return read_config(path)


def _context_of(path: Any) -> int:
    return _read_config(path).max_position_embeddings


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Validates the config (errors name the bad field) and binds the ingress. Works from Python,
    from `serve run deploy/apps:build_app` / `serve run deploy/serve.yaml`, and from `ferry serve`."""
    args = dict(args or {})
    try:
        scheduler = SchedulerSection.model_validate(args.pop("scheduler", None) or {})
    except ValidationError as e:
        problems = "; ".join(f"scheduler.{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"config: {problems}") from None
    cfg = load_config(args)
    roles = cfg.placement.node_roles()
    if ray.is_initialized():  # `serve run` and `ferry serve` connect first; the ingress checks again
        check_ray_placement(roles)
    config, sched = cfg.model_dump(mode="json"), scheduler.model_dump(mode="json")
    ingress = FerryIngress.options(ray_actor_options={**INGRESS_ACTOR_OPTIONS, **roles.options("head")})
    if cfg.workers_as == "actors":
        return ingress.bind(config, sched)
    return ingress.bind(config, sched, worker_apps(cfg, scheduler))


async def set_replicas(app: str, deployment: str, n: int) -> None:
    """Serve's external-scaler call (the app must run with `external_scaler_enabled`)."""
    from ray.serve._private.common import DeploymentID
    from ray.serve.context import _get_global_client

    await _get_global_client()._controller.update_deployment_replicas.remote(DeploymentID(deployment, app), n)


def worker_apps(cfg: AppConfig, scheduler: SchedulerSection | None = None) -> dict[str, Application]:
    """The worker deployments of `workers_as: deployments`, bound: decode (or colocated) and prefill."""
    resources = cfg.worker_resources(cluster_gpus() if ray.is_initialized() else 0.0)
    worker_cfg = cfg.to_worker_config(resources, (scheduler or SchedulerSection()).worker_policies())
    threads = cfg.engine.torch_threads or default_torch_threads(cfg)
    store_ids = ([f"{STORE_PREFIX}-{i}" for i in range(cfg.prefix_cache.num_stores)]
                 if cfg.to_cache_config() is not None and cfg.mode == "disaggregated" else [])
    args = (worker_cfg, store_ids, threads, "ferry", cfg.loopback_only)
    decode_options = resources.actor_options("decode")
    if cfg.mode == "colocated":
        return {"decode": worker_deployment(ColocatedReplica, "colocated", cfg.num_decode, decode_options).bind(*args)}
    return {"decode": worker_deployment(DecodeReplica, "decode", cfg.num_decode, decode_options).bind(*args),
            "prefill": worker_deployment(PrefillReplica, "prefill", cfg.num_prefill,
                                         resources.actor_options("prefill")).bind(*args)}
