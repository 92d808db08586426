"""`workers_as: deployments`: the prefill and decode workers are Serve deployments of their own. On a
local Ray cluster with a tiny model: `serve.status()` lists the ingress, prefill and decode
deployments, healthy; the router finds the replicas (named after their replica ids) and answers
with the single-engine reference text; and a decode replica killed while it streams is replaced by
Serve, the stream resuming on the new replica with exactly the reference text."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.deploy.serving import served_app, wait_until_healthy

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PORT = 8323
APP = "ferry-deployments"
PROMPT = "The ferry leaves the harbor at seven in the morning"


@pytest.fixture(scope="module")
def served(ray_cluster: ModuleType, tiny_model_dir: Path) -> Iterator[str]:
    cfg = {
        "model": str(tiny_model_dir), "workers_as": "deployments",
        "engine": {"dtype": "float32", "kv_cache_mib": 4, "torch_threads": 1},
        "prefix_cache": {"num_stores": 1, "dram_mib": 8, "disk_mib": 0}, "transfer": {"staging_mib": 8},
        "api": {"auth_required": False},
    }
    with served_app(APP, PORT, cfg) as url:
        yield url


def reference(model: Path, max_tokens: int) -> str:
    from actors.engine.config import EngineConfig
    from actors.engine.engine import Engine
    from actors.engine.sampling import SamplingParams

    engine = Engine.from_pretrained(model, EngineConfig(num_blocks=64))
    [out] = engine.generate([PROMPT], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return out.text


def model(url: str) -> str:
    import httpx2

    return httpx2.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def workers(url: str) -> dict[str, Any]:
    import httpx2

    report = httpx2.get(f"{url}/health", timeout=10).json()
    assert "workers" in report, report
    return report["workers"]


def test_serve_lists_the_three_deployments_and_the_router_serves_through_them(served: str, tiny_model_dir: Path) -> None:
    import httpx2
    from ray import serve

    deployments = serve.status().applications[APP].deployments
    assert {"FerryIngress", "prefill", "decode"} <= set(deployments)
    assert all(d.status == "HEALTHY" for d in deployments.values()), deployments
    names = workers(served)
    assert {w["kind"] for w in names.values()} == {"prefill", "decode"}
    assert all(n.startswith(f"ferry-{w['kind']}-") for n, w in names.items())
    body = {"model": model(served), "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    got = httpx2.post(f"{served}/v1/completions", json=body, timeout=60).json()
    assert "choices" in got, got
    assert got["choices"][0]["text"] == reference(tiny_model_dir, 12)


def test_a_decode_replica_killed_mid_stream_is_restarted_by_serve_and_the_stream_finishes(
        served: str, tiny_model_dir: Path, ray_cluster: ModuleType) -> None:
    import httpx2

    ray = ray_cluster
    want = reference(tiny_model_dir, 160)
    before = {n for n, w in workers(served).items() if w["kind"] == "decode" and w["healthy"]}
    (victim,) = before
    replica_id = victim.rsplit("-", 1)[1]
    pieces: list[str] = []
    chunks = threading.Event()
    name = model(served)

    def stream() -> None:
        body = {"model": name, "prompt": PROMPT, "max_tokens": 160, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx2.stream("POST", f"{served}/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    pieces.extend(c["text"] for c in json.loads(line[6:])["choices"])
                    if len(pieces) >= 10:
                        chunks.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert chunks.wait(120), "the stream never started"
    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#decode#{replica_id}", namespace="serve")
    ray.kill(actor, no_restart=True)
    reader.join(300)
    assert not reader.is_alive()
    assert "".join(pieces) == want  # float32: resumed on the new replica from the tokens already sent
    wait_until_healthy(served, 60)  # a poll that asked the dying replica may hold /health a few seconds
    after = {n for n, w in workers(served).items() if w["kind"] == "decode" and w["healthy"]}
    assert after and victim not in after  # a new replica, a new name
