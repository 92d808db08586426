"""Ray Serve application builder: `build_app(args) -> Application`.

Mental model: one ingress deployment owns HTTP (the OpenAI app from deploy/openai) and, in its
constructor, starts the data plane it talks to: prefix-cache store actors, decode actors, prefill
actors wired to every decode endpoint (or colocated actors), all with fractional CPUs so the
embedded default fits a 2-core machine. The same builder serves `serve run deploy/serve.yaml`,
`ferry serve` and Python callers; `args` is the YAML config as a dict (see deploy/config.py).
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray import serve
from ray.serve import Application

from actors.engine.tokenizer import Tokenizer
from actors.engine.fetch import resolve_model
from actors.pd_client import PDClient
from actors.ray_actors import RemoteColocated, start_pd
from deploy.cluster_backend import ClusterBackend, LocalOnly
from deploy.config import AppConfig, load_config
from deploy.local import bind_replica_grpc_to_loopback
from deploy.openai import build_api

logger = logging.getLogger(__name__)


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=256,
                  health_check_timeout_s=60)
@serve.ingress()
class FerryIngress:
    def __init__(self, config: dict[str, Any]) -> None:
        self.cfg = AppConfig.model_validate(config)
        cfg = self.cfg
        if cfg.loopback_only:
            bind_replica_grpc_to_loopback()
        path = resolve_model(cfg.model)  # fetched once here, so workers find it cached
        self.tokenizer = Tokenizer.load(path)
        worker_cfg = cfg.to_worker_config()
        threads = cfg.engine.torch_threads
        self._colocated: dict[str, Any] = {}
        self._deployment = None
        if cfg.mode == "colocated":
            self._colocated = {f"colocated-{i}": RemoteColocated.remote(worker_cfg, f"colocated-{i}", threads)
                               for i in range(cfg.num_decode)}
            ray.get([a.load.remote() for a in self._colocated.values()], timeout=300)
            client = PDClient({}, self._colocated, cfg.to_client_config(), LocalOnly())
        else:
            self._deployment = start_pd(
                worker_cfg, num_prefill=cfg.num_prefill, num_decode=cfg.num_decode,
                cache=cfg.to_cache_config(), num_cache=cfg.prefix_cache.num_stores, torch_threads=threads,
                name_prefix="ferry",
            )
            client = self._deployment.client(cfg.to_client_config())
        max_len = cfg.engine.max_model_len or _context_of(path)
        self.backend = ClusterBackend(client, self.tokenizer, _model_name(cfg.model), max_len)
        logger.info("ferry ingress up: %s mode, model %s", cfg.mode, cfg.model)

    def __serve_build_asgi_app__(self):  # type: ignore[no-untyped-def]
        return build_api(self.backend, self.cfg.api)

    def __del__(self) -> None:
        if self._deployment is not None:
            self._deployment.shutdown()
        for actor in self._colocated.values():
            ray.kill(actor, no_restart=True)


def _model_name(spec: str) -> str:
    return spec if "/" not in spec else spec.rstrip("/").rsplit("/", 1)[-1]


def _context_of(path: Any) -> int:
    from actors.engine.weights import read_config

    return read_config(path).max_position_embeddings


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Validates the config (errors name the bad field) and binds the ingress. Works from Python,
    from `serve run deploy/apps:build_app` / `serve run deploy/serve.yaml`, and from `ferry serve`."""
    cfg = load_config(args or {})
    return FerryIngress.bind(cfg.model_dump(mode="json"))
