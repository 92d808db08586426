"""SLO-driven scaling of the worker deployments (`workers_as: deployments`, `scheduler.scaling`): on a
local Ray cluster with a tiny model and 2 decode rows per worker, a burst of streams fills the lone
decode replica's rows, the scheduler advises a second one, the ingress sets it through Serve, and the
new replica takes work (the burst is kept up until it does, so a slow replica start on a loaded box
is waited for, within BURST_LIMIT_S); when the burst is over the advice falls back and Serve stops one again. No
request is lost: every stream ends with the single-engine reference text."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.deploy.serving import served_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PORT = 8324
APP = "ferry-scaling"
MAX_TOKENS = 300
BURST = 24  # streams in flight: 12x one replica's 2 rows
REFILLS = 48  # distinct prompts for the streams that replace finished ones (then they repeat)
BURST_LIMIT_S = 300  # the most a replica may take to start and join under the burst


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


def test_decode_scales_up_under_a_burst_and_back_down_with_no_request_lost(served: str, tiny_model_dir: Path) -> None:
    import httpx2

    from actors.engine.config import EngineConfig
    from actors.engine.engine import Engine
    from actors.engine.sampling import SamplingParams

    model = httpx2.get(f"{served}/v1/models", timeout=10).json()["data"][0]["id"]
    prompts = [f"Request number {i} asks the ferry for a long answer" for i in range(BURST + REFILLS)]
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(num_blocks=256))
    want = [o.text for o in engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                   ignore_eos=True))]
    seen: list[int] = []  # decode replicas Serve has
    busy: list[int] = []  # decode workers the router lists with a running row, per /health report
    taken_in = threading.Event()  # the router gave the new replica work
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(decode_replicas())
            try:
                workers = httpx2.get(f"{served}/health", timeout=5).json().get("workers", {}).values()
            except httpx2.HTTPError:
                workers = []
            busy.append(sum(w["kind"] == "decode" and w["running"] > 0 for w in workers))
            if busy[-1] == 2:
                taken_in.set()
            time.sleep(1.0)

    def ask(i: int) -> tuple[int, str]:
        body = {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}
        r = httpx2.post(f"{served}/v1/completions", json=body, timeout=600)
        assert r.status_code == 200, f"{r.status_code} {r.text} {dict(r.headers)}"
        return i, r.json()["choices"][0]["text"]

    # The burst lasts until the new replica takes work, however long its start takes on this box: a
    # request that finishes is replaced by the next one, with as many in flight as the first burst.
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
            running = {pool.submit(ask, i) for i in range(BURST)}
            finished: list[concurrent.futures.Future[tuple[int, str]]] = []
            sent, deadline = BURST, time.monotonic() + BURST_LIMIT_S
            while running:
                ended, running = concurrent.futures.wait(running, timeout=1,
                                                         return_when=concurrent.futures.FIRST_COMPLETED)
                finished += ended
                for _ in ended:
                    if not taken_in.is_set() and time.monotonic() < deadline:
                        running.add(pool.submit(ask, sent))
                        sent += 1
        for f in finished:  # every request served, exactly
            i, text = f.result()
            assert text == want[i % len(prompts)], i
        assert max(seen) == 2, seen  # the burst brought a second decode replica
        assert taken_in.is_set(), f"the new decode replica took no work in {BURST_LIMIT_S}s of burst: {busy}"
        deadline = time.monotonic() + 120
        while decode_replicas() > 1:  # idle: back to one after down_delay_s
            if time.monotonic() > deadline:
                health = httpx2.get(f"{served}/health", timeout=10).json()
                pytest.fail(f"decode never scaled back down: scaling {health.get('scaling')}, "
                            f"workers {health.get('workers')}")
            time.sleep(1)
    finally:
        done.set()
        watcher.join()
