"""A local Ray cluster launched by Ray's own autoscaler (the fake multi-node provider), for
bench/multinode.py: its head started with `ray start --head --block --autoscaling-config`, its nodes
watched through Ray's state (`Watch`), one node lost at once (`kill_node`: every process under its
raylet, as a lost machine), the whole cluster ended by PID (`kill_tree` of `ray start`).

Mental model: the autoscaler (the head's monitor process) starts every worker node as a real raylet
of its own, a descendant of `ray start`; so the process tree of `ray start` is the cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from bench.common import free_port

APP = "ferry"  # the Serve application whose decode replicas `Watch` counts
# A lost node is declared dead after 5 missed 1 s health checks (Ray's default: 5 x 3 s).
SYSTEM_CONFIG = {"health_check_period_ms": 1000, "health_check_failure_threshold": 5}


def node_type(resources: dict[str, float]) -> str:
    """The node type of deploy/cluster-local.yaml a node's resources say it is."""
    if "ferry_head" in resources:
        return "head"
    if "ferry_prefill" in resources:
        return "cpu_mixed"
    if "ferry_decode" in resources:
        return "cpu_decode"
    return "other"


@dataclass
class Watch:
    """Nodes and decode replicas over time, polled from the driver (`poll`, every 0.5 s)."""

    t0: float
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)  # node id -> type, up_s, gone_s, how
    replicas: list[tuple[float, int]] = field(default_factory=list)  # (s, decode replicas not stopping)
    killed: set[str] = field(default_factory=set)

    def poll(self) -> None:
        import ray
        from ray import serve

        now = time.monotonic() - self.t0
        for n in ray.nodes():
            entry = self.nodes.setdefault(n["NodeID"], {"type": node_type(n["Resources"]), "up_s": None,
                                                        "gone_s": None, "how": None})
            if n["Alive"] and entry["up_s"] is None:
                entry["up_s"] = round(now, 1)
            if not n["Alive"] and entry["gone_s"] is None:
                entry["gone_s"] = round(now, 1)
                entry["how"] = "killed" if n["NodeID"] in self.killed else "stopped by the autoscaler"
        try:
            states = serve.status().applications[APP].deployments["decode"].replica_states
        except (KeyError, AttributeError):
            return
        self.replicas.append((round(now, 1), sum(k for s, k in states.items() if s != "STOPPING")))

    def alive(self, kind: str) -> list[str]:
        return [nid for nid, e in self.nodes.items() if e["type"] == kind and e["up_s"] is not None
                and e["gone_s"] is None]

    def decode_replicas(self) -> int:
        return self.replicas[-1][1] if self.replicas else 0


def start_head(config: Path, gcs_port: int, dashboard_port: int, log: Path) -> subprocess.Popen[bytes]:
    """`ray start --head --block` with the fake provider's autoscaler reading `config`."""
    cfg = yaml.safe_load(config.read_text())
    head = dict(cfg["available_node_types"][cfg["head_node_type"]]["resources"])
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1"}
    for var in ("DASHBOARD_METRIC_PORT", "AUTOSCALER_METRIC_PORT"):  # fixed by default: another cluster may hold them
        env.setdefault(var, str(free_port()))
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
    cmd = [ray_bin, "start", "--head", "--block", f"--port={gcs_port}", f"--autoscaling-config={config}",
           f"--num-cpus={int(head.pop('CPU', 1))}", f"--resources={json.dumps(head)}",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}", "--disable-usage-stats",
           f"--metrics-export-port={free_port()}", f"--system-config={json.dumps(SYSTEM_CONFIG)}"]
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def kill_tree(root: psutil.Process) -> int:
    """SIGKILLs `root` and every process under it at once; how many there were."""
    procs = [root, *root.children(recursive=True)]
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)
    return len(procs)


def kill_node(head: psutil.Process, node_id: str) -> int:
    """A lost machine: the node's raylet and everything under it (its workers, agents, object store)."""
    for p in head.children(recursive=True):
        try:
            if p.name() == "raylet" and any(node_id in arg for arg in p.cmdline()):
                return kill_tree(p)
        except psutil.NoSuchProcess:
            continue
    raise RuntimeError(f"no raylet of node {node_id} under the head's processes")


def connect(ray: Any, gcs_port: int, head: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while True:
        if head.poll() is not None:
            raise RuntimeError(f"`ray start --head` exited with {head.returncode}")
        try:
            ray.init(address=f"127.0.0.1:{gcs_port}", log_to_driver=False)
            return
        except (ConnectionError, RuntimeError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
