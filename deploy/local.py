"""Starting ferry on this machine: a local Ray cluster bound to 127.0.0.1 plus Serve's HTTP proxy.

Ray binds the machine's own address by default and silently overrides `--node-ip-address`;
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (set before Ray starts) makes every port (GCS, raylet,
dashboard, Serve) bind 127.0.0.1. Ray's token auth is turned off for this local cluster: it is
reachable from this machine only, and the ferry API has its own keys. A real cluster (`ray up
deploy/cluster.yaml`) keeps Ray's auth on.

Idle means idle (issue 38): many of Serve's and Ray's own timers fire every 100-250 ms by default,
so `start_local` slows the ones that only refresh bookkeeping (`IDLE_ENV`, `python -m bench.idle`
measures them); each stays an env default an operator's own setting overrides. What is left is
fixed in Ray: every worker process checks for signals every 10 ms and polls gRPC every 250 ms.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class LocalUrls:
    api: str
    dashboard: str
    metrics: str


# Read by Serve's processes (controller, proxy, replicas) at import: they inherit this environment
# from the local cluster this process starts.
IDLE_ENV = {
    # The controller's reconcile loop (default 0.1 s: ~4% of a core on an idle app here). Replica
    # health checks (deployment options, 5-10 s) and Ray's actor death notices drive failure
    # handling, not this loop; it only sets how soon the controller acts on what they report
    # (a dead replica is replaced ~1 s later) and adds a few seconds to `serve.run`.
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1.0",
    # Every replica and every handle's router refresh their queue/running gauges this often
    # (default 100 ms); once a second is plenty for a dashboard.
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    # The log monitor globs the log folder on every 0.1 s pass while it holds < 1000 files: list
    # it every 5 s instead (a new worker's log reaches the driver up to 5 s later).
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "LOG_NAME_UPDATE_INTERVAL_S": "5",
    # Raylet timers at 100-250 ms by default, each a bookkeeping check that one node can do once a
    # second: the resource view sent to the GCS, object-store GC pressure, disk capacity, the
    # object manager's retries (cross-node pulls), the memory monitor (OOM kills), idle workers.
    "RAY_raylet_report_resources_period_milliseconds": "1000",
    "RAY_raylet_check_gc_period_milliseconds": "1000",
    "RAY_local_fs_monitor_interval_ms": "1000",
    "RAY_object_manager_timer_freq_ms": "1000",
    "RAY_memory_monitor_refresh_ms": "1000",
    "RAY_kill_idle_workers_interval_ms": "2000",
    # Every process: event-loop lag probes, task-event flushes (the dashboard's task list lags up
    # to 5 s), the GCS's pull of resource loads (the autoscaler's demand), the debug-state dump.
    "RAY_io_context_monitor_probe_interval_ms": "5000",
    "RAY_task_events_report_interval_ms": "5000",
    "RAY_ray_events_report_interval_ms": "5000",
    "RAY_gcs_pull_resource_loads_period_milliseconds": "5000",
    "RAY_report_worker_backlog_interval_ms": "5000",
    "RAY_debug_dump_period_milliseconds": "60000",
}


def idle_env() -> None:
    for name, value in IDLE_ENV.items():
        os.environ.setdefault(name, value)


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


class PortInUse(ValueError):
    """A port ferry serves on is taken; raised before anything starts (the CLI prints it)."""


def check_ports_free(ports: dict[str, int], host: str = "127.0.0.1") -> None:
    """Raises `PortInUse` naming every port of `ports` (what -> port) that something listens on.
    SO_REUSEADDR, so a port only in TIME_WAIT after a previous run counts as free (as it is)."""
    taken = []
    for what, port in ports.items():
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                taken.append(f"{port} ({what})")
    if taken:
        raise PortInUse(f"port {' and '.join(taken)} on {host} is in use: is another ferry (or another server) "
                        "running? Stop it, or serve the API elsewhere with --port.")


def start_local(http_port: int = 8000, dashboard_port: int = 8265, metrics_port: int = 8080,
                num_cpus: int | None = None) -> LocalUrls:
    loopback_env()
    idle_env()
    check_ports_free({"the API": http_port, "Ray's dashboard": dashboard_port, "the metrics": metrics_port})
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=True,
             dashboard_host="127.0.0.1", dashboard_port=dashboard_port, _metrics_export_port=metrics_port,
             logging_level="WARNING", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    return LocalUrls(f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{dashboard_port}",
                     f"http://127.0.0.1:{metrics_port}/metrics")
