"""The app on four real Ray nodes on this machine (`ray.cluster_utils.Cluster`: a head and three
more raylets, each with its own object store and worker processes), placed by role: `placement:`
names the custom resource each node declares (README: Many nodes), and no node has a resource of
another role, so no actor can land on the wrong node. Through them, on SmolLM2 with the shipped
deploy/serve.yaml settings: Ray's state API shows every actor on its role's node; greedy output
equals the engine alone token for token, with the KV crossing from the prefill node to the decode
node; a prefix the prefill engine has evicted comes back from the store on the cache node; the
decode node lost under load costs no stream a token; the cache node lost under load costs only
misses; and a role no node can host is refused at start with a clear error."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.actors.engine.conftest import smollm2_gguf  # noqa: F401  (session fixture)
from tests.conftest import start_local_ray
from tests.deploy.serving import served_app
from tests.deploy.test_serve_exact import (EXACT, LOSSY, SHORT, check_codecs, complete, long_prompts, reference,
                                          serve_yaml_args)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PORT = 8343
APP = "ferry-nodes"
# Role -> the custom resource its node declares; the head also runs Serve's controller and proxy.
ROLES = {"head": "ferry_head", "prefill": "ferry_prefill", "decode": "ferry_decode", "cache": "ferry_cache"}


@dataclass
class Nodes:
    cluster: Any  # ray.cluster_utils.Cluster
    by_role: dict[str, Any]  # role -> its ray._private.node.Node


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
        "dashboard_host": "127.0.0.1", "dashboard_port": _free_port(),
        # A lost node is declared dead after 5 missed 1 s health checks (Ray's default: 5 x 3 s).
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 5}})
    by_role = {"head": cluster.head_node}
    for role in ("prefill", "decode", "cache"):
        by_role[role] = cluster.add_node(num_cpus=1, resources={ROLES[role]: 1}, object_store_memory=200 << 20)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        yield Nodes(cluster, by_role)
    finally:
        ray.shutdown()
        cluster.shutdown()
        if had_session_cluster:
            start_local_ray()


def placements(address: str) -> dict[str, set[str]]:
    """Each live actor's class (Serve replicas as their deployment's name) -> the roles of the nodes
    it runs on, from Ray's state API and the nodes' resources."""
    import ray
    from ray.util.state import list_actors

    role_of = {node["NodeID"]: {role for role, res in ROLES.items() if res in node["Resources"]}
               for node in ray.nodes() if node["Alive"]}
    out: dict[str, set[str]] = {}
    for actor in list_actors(address=address, filters=[("state", "=", "ALIVE")], limit=1000):
        name = actor.class_name.removeprefix(f"ServeReplica:{APP}:")
        out.setdefault(name, set()).update(role_of[actor.node_id])
    return out


@pytest.fixture(scope="module")
def app(nodes: Nodes, smollm2_gguf: Path) -> Iterator[str]:
    """The app with deploy/serve.yaml's settings on SmolLM2, every role pinned to its node."""
    args = serve_yaml_args(str(smollm2_gguf))
    args["api"]["served_model_names"] = ["m"]
    args["placement"] = ROLES
    args["prefix_cache"]["dram_mib"] = 128  # the pool outlasts the engines' own 64 MiB of KV
    with served_app(APP, PORT, args, proxy_location="HeadOnly") as url:
        yield url


def test_every_role_on_its_node_greedy_exact_and_a_prefix_from_the_cache_node(
        app: str, nodes: Nodes, smollm2_gguf: Path) -> None:
    # SmolLM2's exactness check (tests/deploy/test_serve_exact.py runs the same on the tiny model on
    # one node): two short prompts and one past the 512-token prefill chunk, at once; a lossy tenant
    # gets the codec it asked for.
    prompts = SHORT + long_prompts(smollm2_gguf, 600, 1)
    want = reference(smollm2_gguf, prompts)
    where = placements(nodes.cluster.address)
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: complete(app, p, EXACT), prompts))
    _, lossy = complete(app, prompts[0], LOSSY)
    assert [text for text, _ in got] == want
    check_codecs([timeline for _, timeline in got], lossy, cross_node=True)  # prefill node -> decode node
    assert {(t["prefill"]["node"], t["prefill"]["kv_to"]["node"]) for _, t in got} == \
        {(nodes.by_role["prefill"].node_id, nodes.by_role["decode"].node_id)}
    # Other long prompts push the first one's blocks out of the prefill engine's own 91 blocks; the
    # store on the cache node still holds them, and a prompt sharing them takes them from there.
    for other in long_prompts(smollm2_gguf, 700, 3)[1:]:
        complete(app, other, EXACT)
    _, again = complete(app, prompts[2] + " And then", EXACT)
    assert where["prefill"] == {"prefill"} and where["decode"] == {"decode"}, where
    assert where["PrefixCacheStore"] == {"cache"} and where["SchedulerService"] == {"head"}, where
    assert where["FerryIngress"] == {"head"} and where["ServeController"] == {"head"}, where
    assert again["prefill"]["pool_hit_blocks"] > 0 and again["prefill"]["local_hit_blocks"] == 0, again["prefill"]


def test_a_role_no_node_can_host_is_refused_with_its_name(nodes: Nodes, smollm2_gguf: Path) -> None:
    from deploy.apps import build_app
    from deploy.placement import NoNodeForRole

    args = serve_yaml_args(str(smollm2_gguf)) | {"placement": {**ROLES, "decode": "ferry_gpu_decode"}}
    with pytest.raises(NoNodeForRole, match=r"placement\.decode needs a node with the resource 'ferry_gpu_decode'"):
        build_app(args)


STREAM_TOKENS = 40
STREAM_PROMPTS = [f"{start} Here is what happened next:" for start in (
    "The ferry leaves the harbor at seven in the morning.", "Photosynthesis is the process by which plants",
    "A short history of the printing press:", "The recipe calls for flour, butter and", "In 1969 the first",
    "Rivers carry sediment from the mountains to")]


def _streams_through(app: str, action: Any) -> tuple[list[str], list[str]]:
    """STREAM_PROMPTS streamed at once (greedy, exact); `action()` once each has 3 tokens. Their
    texts and any errors, after every stream ended (a stream that hangs fails the test)."""
    import httpx2

    texts: list[list[str]] = [[] for _ in STREAM_PROMPTS]
    errors: list[str] = []
    started = [threading.Event() for _ in STREAM_PROMPTS]

    def stream(i: int) -> None:
        body = {"model": "m", "prompt": STREAM_PROMPTS[i], "max_tokens": STREAM_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx2.stream("POST", f"{app}/v1/completions", json=body, headers=EXACT, timeout=300) as r:
            if r.status_code != 200:
                errors.append(f"stream {i}: {r.status_code} {r.read()!r}")
                return
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if "error" in event:
                        errors.append(f"stream {i}: {event['error']}")
                    texts[i].extend(c["text"] for c in event.get("choices", []))
                    if len(texts[i]) >= 3:
                        started[i].set()

    readers = [threading.Thread(target=stream, args=(i,)) for i in range(len(STREAM_PROMPTS))]
    for reader in readers:
        reader.start()
    for i, event in enumerate(started):
        assert event.wait(180), f"stream {i} never started"
    action()
    for reader in readers:
        reader.join(300)
    assert not any(r.is_alive() for r in readers), "a stream hung"
    return ["".join(t) for t in texts], errors


def test_the_decode_node_lost_under_load_every_stream_finishes_exactly(
        app: str, nodes: Nodes, smollm2_gguf: Path) -> None:
    """Six streams run; the decode node goes at once (every process of it, as a lost machine): each
    stream resumes on the prefill node (`lend_prefill`, the default recovery recomputing its KV) and
    ends with the engine's own greedy text; a new request is served or gets 503 with Retry-After,
    never hangs; once a decode node is back, the app serves through it and no KV block stays taken."""
    import httpx2

    want = reference(smollm2_gguf, STREAM_PROMPTS, STREAM_TOKENS)
    texts, errors = _streams_through(app, lambda: nodes.cluster.remove_node(nodes.by_role["decode"],
                                                                            allow_graceful=False))
    assert not errors, errors
    assert texts == want
    # While no decode node is up, a new request is served (the prefill node decodes it) or refused
    # with Retry-After; never lost.
    body = {"model": "m", "prompt": SHORT[0], "max_tokens": 4, "temperature": 0}
    r = httpx2.post(f"{app}/v1/completions", json=body, headers=EXACT, timeout=120)
    assert r.status_code == 200 or (r.status_code == 503 and "retry-after" in r.headers), (r.status_code, r.text)
    # A decode node comes back (as the autoscaler would bring one): Serve starts the decode replica
    # there, and every KV block the streams held is free again.
    nodes.by_role["decode"] = nodes.cluster.add_node(num_cpus=1, resources={ROLES["decode"]: 1},
                                                     object_store_memory=200 << 20)
    deadline = time.monotonic() + 240
    while True:
        workers = httpx2.get(f"{app}/health", timeout=30).json().get("workers", {})
        live = [w for w in workers.values() if w["healthy"]]
        if ({w["kind"] for w in live} == {"prefill", "decode"}
                and all(w["free_blocks"] == w["total_blocks"] and w["running"] == 0 for w in live)):
            break
        assert time.monotonic() < deadline, workers
        time.sleep(1)
    assert complete(app, SHORT[0], EXACT)[0] == reference(smollm2_gguf, SHORT[:1])[0]


def test_the_cache_node_lost_under_load_costs_only_misses(app: str, nodes: Nodes, smollm2_gguf: Path) -> None:
    """After the decode node's test (a decode node is back): six streams run and the cache node goes
    at once. The pool's store is gone, so every lookup misses and every shadow offer fails; no
    stream notices (same greedy text), and a prompt that the pool held before is computed again,
    exactly, with no pool hit."""
    want = reference(smollm2_gguf, STREAM_PROMPTS, STREAM_TOKENS)
    long = long_prompts(smollm2_gguf, 600, 1)[0]
    complete(app, long, EXACT)  # its blocks now in the store on the cache node (and the prefill engine)
    for other in long_prompts(smollm2_gguf, 700, 3)[1:]:  # pushed out of the prefill engine's own blocks
        complete(app, other, EXACT)
    texts, errors = _streams_through(app, lambda: nodes.cluster.remove_node(nodes.by_role["cache"],
                                                                            allow_graceful=False))
    assert not errors, errors
    assert texts == want
    text, timeline = complete(app, long + " And then", EXACT)
    assert text == reference(smollm2_gguf, [long + " And then"])[0]
    assert timeline["prefill"]["pool_hit_blocks"] == 0, timeline["prefill"]
