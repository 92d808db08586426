"""bench/multinode.py's bookkeeping, without a cluster (the bench itself starts Ray's fake
multi-node autoscaler and the SmolLM2 app: minutes, so it is run by hand, README: Many nodes):
node types from resources, each stream's outcome, the figures and their table."""

from __future__ import annotations

import json

import yaml

from bench import multinode
from bench.fake_cluster import Watch, node_type
from bench.multinode import Stream, summarize


def test_node_types_of_the_local_cluster_config_are_told_apart_by_their_resources() -> None:
    cfg = yaml.safe_load(multinode.CLUSTER_CONFIG.read_text())
    types = {name: node_type(t["resources"]) for name, t in cfg["available_node_types"].items()}
    assert types == {"ray.head.default": "head", "cpu_mixed": "cpu_mixed", "cpu_decode": "cpu_decode"}
    assert cfg["provider"]["type"] == "fake_multinode" and cfg["head_node_type"] == "ray.head.default"
    # Ray's node resources are whole numbers: each worker takes a unit (placement.worker_share: 1)
    assert all(float(v).is_integer() for t in cfg["available_node_types"].values() for v in t["resources"].values())
    assert multinode.app_config(type("A", (), {"model": "smollm2", "rows": 4})())["placement"]["worker_share"] == 1


def test_outcomes_figures_and_table() -> None:
    done = Stream(0, sent_s=50.0, ttft_s=1.5, status=200, text="a", done=True, sent=True)
    late = Stream(1, sent_s=90.0, ttft_s=0.5, status=200, text="b", done=True, sent=True)
    refused = Stream(2, sent_s=51.0, status=503, error="retry", sent=True)
    broken = Stream(3, sent_s=52.0, ttft_s=2.0, status=200, text="c", error="RemoteProtocolError", sent=True)
    unsent = Stream(4)  # a second wave never sent is neither lost nor finished
    assert [s.outcome for s in (done, late, refused, broken, unsent)] == [
        "finished", "finished", "refused", "lost", "not sent"]
    watch = Watch(t0=0.0)
    watch.nodes = {"f" * 51 + "00001": {"type": "cpu_decode", "up_s": 70.0, "gone_s": 80.0, "how": "killed"}}
    watch.replicas = [(60.0, 1), (65.0, 2), (100.0, 1)]
    figures = summarize([done, late, refused, broken, unsent], watch, {"added_worker_serving_s": 75.0, "burst_s": 40.0})
    figures.update(identical=2, setup={"streams": 4, "prompt_tokens": 512, "max_tokens": 128, "interval_s": 1.0,
                                       "cluster_config": "deploy/cluster-local.yaml"})
    assert figures["requests"] == {"sent": 4, "finished": 2, "refused": 1, "lost": 1, "not_sent": 1}
    assert figures["ttft_s"]["scale_up_p99"] == 2.0 and figures["ttft_s"]["after_p50"] == 0.5  # split at 75 s
    assert figures["max_decode_replicas"] == 2 and figures["nodes"][0]["node_id"] == "fff00001"
    assert json.loads(json.dumps(figures)) == figures
    table = multinode.render(figures)
    assert "cpu_decode" in table and "killed" in table and "stream 3" in table
