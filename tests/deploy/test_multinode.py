"""The app on four real Ray nodes on this machine (`ray.cluster_utils.Cluster`: a head and three
more raylets, each with its own object store and worker processes), placed by role: `placement:`
names the custom resource each node declares (README: Many nodes), and no node has a resource of
another role, so no actor can land on the wrong node. Through them, on SmolLM2 with the shipped
deploy/serve.yaml settings: Ray's state API shows every actor on its role's node; greedy output
equals the engine alone token for token, with the KV crossing from the prefill node to the decode
node; a prefill replica restarted with an empty cache takes a shared prefix from the store on the
cache node; and a role no node can host is refused at start with a clear error."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.actors.engine.conftest import smollm2_gguf  # noqa: F401  (session fixture)
from tests.conftest import start_local_ray
from tests.deploy.serving import served_app
from tests.deploy.test_serve_exact import EXACT, SHORT, complete, long_prompts, reference, serve_yaml_args

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PORT = 8343
APP = "ferry-nodes"
# Role -> the custom resource its node declares; the head also runs Serve's controller and proxy.
ROLES = {"head": "ferry_head", "prefill": "ferry_prefill", "decode": "ferry_decode", "cache": "ferry_cache"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def nodes() -> Iterator[Any]:
    """Four nodes, one role each; the session's single-node cluster (if it was up) is stopped for
    this module and started again after it."""
    import ray
    from ray.cluster_utils import Cluster

    had_session_cluster = ray.is_initialized()
    if had_session_cluster:
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {ROLES["head"]: 1}, "include_dashboard": True,  # the state API needs it
        "dashboard_host": "127.0.0.1", "dashboard_port": _free_port()})
    for role in ("prefill", "decode", "cache"):
        cluster.add_node(num_cpus=1, resources={ROLES[role]: 1}, object_store_memory=200 << 20)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if had_session_cluster:
            start_local_ray()


def placements() -> dict[str, set[str]]:
    """Each live actor's class (Serve replicas as their deployment's name) -> the roles of the nodes
    it runs on, from Ray's state API and the nodes' resources."""
    import ray
    from ray.util.state import list_actors

    role_of = {node["NodeID"]: {role for role, res in ROLES.items() if res in node["Resources"]}
               for node in ray.nodes() if node["Alive"]}
    out: dict[str, set[str]] = {}
    for actor in list_actors(filters=[("state", "=", "ALIVE")], limit=1000):
        name = actor.class_name.removeprefix(f"ServeReplica:{APP}:")
        out.setdefault(name, set()).update(role_of[actor.node_id])
    return out


def test_every_role_on_its_node_greedy_exact_and_a_prefix_from_the_cache_node(nodes: Any, smollm2_gguf: Path) -> None:
    prompts = SHORT + long_prompts(smollm2_gguf, 600, 1)
    want = reference(smollm2_gguf, prompts)
    args = serve_yaml_args(str(smollm2_gguf))
    args["api"]["served_model_names"] = ["m"]
    args["placement"] = ROLES
    with served_app(APP, PORT, args, proxy_location="HeadOnly") as url:
        where = placements()
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: complete(url, p, EXACT), prompts))
        assert [text for text, _ in got] == want
        for _, timeline in got:  # every request went prefill node -> decode node, losslessly
            assert timeline["prefill"]["kv_codec"]["lossless"], timeline["prefill"]
        # A fresh prefill replica has nothing cached; the long prompt's blocks wait in the store on
        # the cache node, and a prompt sharing them takes them from there.
        restart_prefill_replica(url)
        _, again = complete(url, prompts[2] + " And then", EXACT)
    assert where["prefill"] == {"prefill"} and where["decode"] == {"decode"}, where
    assert where["PrefixCacheStore"] == {"cache"} and where["SchedulerService"] == {"head"}, where
    assert where["FerryIngress"] == {"head"} and where["ServeController"] == {"head"}, where
    assert again["prefill"]["pool_hit_blocks"] > 0 and again["prefill"]["local_hit_blocks"] == 0, again["prefill"]


def restart_prefill_replica(url: str) -> None:
    """Kills the prefill replica; Serve starts a new one (on the prefill node: nowhere else has the
    resource) and the app is healthy again once the ingress has found it."""
    import ray
    from ray.util.state import list_actors

    from tests.deploy.serving import wait_until_healthy

    (replica,) = [a for a in list_actors(filters=[("state", "=", "ALIVE")])
                  if a.class_name == f"ServeReplica:{APP}:prefill"]
    ray.kill(ray.get_actor(replica.name, namespace=replica.ray_namespace), no_restart=True)
    wait_until_gone(replica.actor_id)
    wait_until_healthy(url)


def wait_until_gone(actor_id: str, timeout_s: float = 60.0) -> None:
    import time

    from ray.util.state import get_actor

    deadline = time.monotonic() + timeout_s
    while (state := get_actor(actor_id)) is not None and state.state == "ALIVE":
        assert time.monotonic() < deadline, f"actor {actor_id} still alive after {timeout_s:g} s"
        time.sleep(0.2)


def test_a_role_no_node_can_host_is_refused_with_its_name(nodes: Any, smollm2_gguf: Path) -> None:
    from deploy.apps import build_app
    from deploy.placement import NoNodeForRole

    args = serve_yaml_args(str(smollm2_gguf)) | {"placement": {**ROLES, "decode": "ferry_gpu_decode"}}
    with pytest.raises(NoNodeForRole, match=r"placement\.decode needs a node with the resource 'ferry_gpu_decode'"):
        build_app(args)
