"""Starting ferry on this machine: a local Ray cluster bound to 127.0.0.1 plus Serve's HTTP proxy.

Ray binds the machine's own address by default and silently overrides `--node-ip-address`;
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (set before Ray starts) makes every port (GCS, raylet,
dashboard, Serve) bind 127.0.0.1. Ray's token auth is turned off for this local cluster: it is
reachable from this machine only, and the ferry API has its own keys. A real cluster (`ray up
deploy/cluster.yaml`) keeps Ray's auth on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LocalUrls:
    api: str
    dashboard: str
    metrics: str


def loopback_env() -> None:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def bind_replica_grpc_to_loopback() -> None:
    """Serve replicas open an inter-deployment gRPC server on `[::]:0` (hard-coded in Ray 2.60,
    not covered by the env switch above) right after the deployment's constructor returns; on a
    loopback-only cluster it must listen on 127.0.0.1 like everything else. Called from the
    ingress constructor, so it holds however Ray was started."""
    from ray.serve._private import replica

    original = replica.add_port_to_grpc_server

    def loopback_only(server, address: str):  # type: ignore[no-untyped-def]
        return original(server, address.replace("[::]", "127.0.0.1").replace("0.0.0.0", "127.0.0.1"))

    replica.add_port_to_grpc_server = loopback_only


def start_local(http_port: int = 8000, dashboard_port: int = 8265, metrics_port: int = 8080,
                num_cpus: int | None = None) -> LocalUrls:
    loopback_env()
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=True,
             dashboard_host="127.0.0.1", dashboard_port=dashboard_port, _metrics_export_port=metrics_port,
             logging_level="WARNING", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    return LocalUrls(f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{dashboard_port}",
                     f"http://127.0.0.1:{metrics_port}/metrics")
