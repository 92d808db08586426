"""SLO-driven scaling of the worker deployments (`workers_as: deployments`, `scheduler.scaling`): on a
local Ray cluster with a tiny model and 2 decode rows per worker, a burst of streams fills the lone
decode replica's rows, the scheduler advises a second one, the ingress sets it through Serve, and the
new replica takes work; when the burst is over the advice falls back and Serve stops one again. No
request is lost: every stream ends with the single-engine reference text."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.deploy.serving import served_app, wait_until_healthy

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PORT = 8324
APP = "ferry-scaling"
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def served(ray_cluster: ModuleType, tiny_model_dir: Path) -> Iterator[str]:
    cfg = {
        "model": str(tiny_model_dir), "workers_as": "deployments",
        "engine": {"dtype": "float32", "kv_cache_mib": 4, "torch_threads": 1, "max_num_seqs": 2},
        "prefix_cache": {"num_stores": 0}, "api": {"auth_required": False},
        "scheduler": {"scaling": {"max_decode": 2, "up_delay_s": 1.0, "down_delay_s": 5.0}},
    }
    with served_app(APP, PORT, cfg, external_scaler_enabled=True) as url:
        yield url


def decode_replicas() -> int:
    """Replicas of the decode deployment in any state but stopping."""
    from ray import serve

    states = serve.status().applications[APP].deployments["decode"].replica_states
    return sum(n for state, n in states.items() if state != "STOPPING")


def decode_workers_seen(url: str, timeout_s: float) -> int:
    """The most decode workers a healthy `/health` report lists within `timeout_s`, polled: on a slow
    box one check can time out (a 503 without `workers`) while the new replica is still joining."""
    import httpx2

    most = 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and most < 2:
        wait_until_healthy(url, max(1.0, deadline - time.monotonic()))
        try:
            report = httpx2.get(f"{url}/health", timeout=10).json()
        except httpx2.HTTPError:
            continue
        most = max(most, sum(w["kind"] == "decode" for w in report.get("workers", {}).values()))
        time.sleep(0.5)
    return most


def test_decode_scales_up_under_a_burst_and_back_down_with_no_request_lost(served: str, tiny_model_dir: Path) -> None:
    import httpx2

    from actors.engine.config import EngineConfig
    from actors.engine.engine import Engine
    from actors.engine.sampling import SamplingParams

    model = httpx2.get(f"{served}/v1/models", timeout=10).json()["data"][0]["id"]
    prompts = [f"Request number {i} asks the ferry for a long answer" for i in range(24)]
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(num_blocks=256))
    want = [o.text for o in engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                   ignore_eos=True))]
    seen: list[int] = []  # decode replicas Serve has
    routed: list[int] = []  # decode workers the router lists in /health
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(decode_replicas())
            try:  # on a loaded box the burst can end, and the advice fall back, before a check after it
                report = httpx2.get(f"{served}/health", timeout=5).json()
                routed.append(sum(w["kind"] == "decode" for w in report.get("workers", {}).values()))
            except httpx2.HTTPError:
                pass
            time.sleep(0.5)

    def ask(prompt: str) -> str:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        r = httpx2.post(f"{served}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(ask, prompts))
        assert got == want  # every request served, exactly
        assert max(seen) == 2, seen  # the burst brought a second decode replica
        assert max(routed, default=0) == 2 or decode_workers_seen(served, 60) == 2  # and the router took it in
        deadline = time.monotonic() + 120
        while decode_replicas() > 1:  # idle: back to one after down_delay_s
            assert time.monotonic() < deadline, "decode never scaled back down"
            time.sleep(1)
    finally:
        done.set()
        watcher.join()
