"""The whole app as users run it: Serve ingress + prefill, decode and cache actors on a local Ray
cluster, driven with the `openai` client over 127.0.0.1; with the semantic cache on, its store
actor answers opted-in requests, its figures reach Ray's Prometheus endpoint, and deleting the app
saves its entries."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from actors.messages import RequestPolicy
from deploy.config import ConfigError, load_config
from tests.deploy.serving import wait_until_healthy

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PORT = 8321
SEMANTIC_THRESHOLD = 0.8


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"engine\.dtyp"):
        load_config({"engine": {"dtyp": "bfloat16"}})
    with pytest.raises(ConfigError, match=r"transfer\.timeout_s must be shorter"):
        load_config({"transfer": {"timeout_s": 40, "lease_s": 30}})
    bad = tmp_path / "bad.yaml"
    bad.write_text("applications:\n  - import_path: deploy.apps:build_app\n    args: {num_decode: 0}\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: num_decode"):
        load_config(bad)
    with pytest.raises(ConfigError, match="stream_interval"):
        load_config({"stream_interval": 0})
    assert load_config("deploy/serve.yaml").mode == "disaggregated"
    assert load_config("deploy/serve.yaml").replace_dead_workers  # on unless a config turns it off
    assert not load_config({"replace_dead_workers": False}).replace_dead_workers
    from deploy.config import read_args
    from deploy.scheduler_config import SchedulerSection

    assert SchedulerSection.model_validate(read_args("deploy/serve.yaml")["scheduler"]).local_prefill


def test_dashboard_slos_are_the_schedulers_contracts() -> None:
    from deploy.dashboard import SloTargets
    from deploy.scheduler_config import SchedulerSection

    section = SchedulerSection.model_validate({"tenants": {"acme": {"ttft_ms": 500, "tpot_ms": 50},
                                                           "nightly": {"slo_class": "batch"}}})
    slos = section.tenant_slos()
    assert sorted(slos.known_tenants()) == ["acme", "nightly"]
    assert slos.slo("acme") == SloTargets(500.0, 50.0) and slos.slo("nightly") is None
    assert slos.slo("walk-in") == SloTargets(30_000.0, 1_000.0)  # the default tenant's contract
    closed = SchedulerSection.model_validate({"default_tenant": None}).tenant_slos()
    assert closed.slo("walk-in") is None  # refused by the scheduler; no promise to measure


def test_tenants_choose_kv_shadows_or_recompute() -> None:
    from actors.engine.sampling import SamplingParams
    from deploy.scheduler_config import SchedulerSection

    def shadowed(section: SchedulerSection, tenant: str) -> bool:
        policy = section.request_policies().rules(tenant)
        req = RequestPolicy(tenant=tenant, kv_recovery=policy.kv_recovery).request("r", (1, 2), SamplingParams())
        return req.shadow_salt is not None

    section = SchedulerSection.model_validate({"tenants": {"acme": {"kv_recovery": "shadow"}, "nightly": {}}})
    assert shadowed(section, "acme") and not shadowed(section, "walk-in") and not shadowed(section, "nightly")
    flipped = SchedulerSection.model_validate({"default_tenant": {"kv_recovery": "shadow"},
                                               "tenants": {"nightly": {"kv_recovery": "recompute"}}})
    assert shadowed(flipped, "walk-in") and not shadowed(flipped, "nightly")
    assert not shadowed(SchedulerSection(), "anyone")  # off unless configured


@pytest.fixture(scope="module")
def semantic_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("semantic-cache")


@pytest.fixture(scope="module")
def served(ray_cluster, tiny_model_dir, semantic_dir):
    from ray import serve

    from deploy.apps import build_app

    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    cfg = {
        "model": str(tiny_model_dir), "engine": {"dtype": "float32", "kv_cache_mib": 4, "torch_threads": 1},
        "prefix_cache": {"num_stores": 1, "dram_mib": 8, "disk_mib": 0},
        "transfer": {"staging_mib": 8},
        # Opt-in by header only, so the other tests never touch it; saved only at shutdown (no timer).
        "api": {"auth_required": False,
                "semantic_cache": {"folder": str(semantic_dir), "threshold": SEMANTIC_THRESHOLD,
                                   "save_interval_s": None}},
    }
    serve.run(build_app(cfg), name="ferry-test", route_prefix="/", blocking=False)
    wait_until_healthy(f"http://127.0.0.1:{PORT}")
    yield f"http://127.0.0.1:{PORT}"
    serve.delete("ferry-test")
    serve.shutdown()


def test_openai_client_chat_and_completions(served, tiny_model_dir):
    import openai

    from actors.engine.config import EngineConfig
    from actors.engine.engine import Engine
    from actors.engine.sampling import SamplingParams

    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused")
    model = client.models.list().data[0].id
    prompt = "The ferry leaves the harbor at seven in the morning"
    ref = Engine.from_pretrained(tiny_model_dir, EngineConfig(num_blocks=64))
    [want] = ref.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))

    done = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.choices[0].text == want.text and done.usage.completion_tokens == 12
    chunks = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in chunks:
        pieces += [c.text for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == want.text and usage.completion_tokens == 12

    msgs = [{"role": "user", "content": "The capital of France"}]
    chat = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=msgs, max_tokens=8, temperature=0, stream=True) if c.choices)
    assert chat.choices[0].message.content == streamed
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_bad_input_and_disconnect_free_everything(served):
    import httpx2

    r = httpx2.post(f"{served}/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx2.post(f"{served}/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=30)
    assert r.status_code == 404
    r = httpx2.post(f"{served}/v1/completions", json={"model": "x", "prompt": "hi", "temperature": -1}, timeout=30)
    assert r.status_code in (400, 404)

    model = httpx2.get(f"{served}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": "The ferry", "max_tokens": 900, "stream": True, "ignore_eos": True}
    with httpx2.stream("POST", f"{served}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        seen = 0
        for line in resp.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen >= 3:
                break  # leave mid-stream
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        workers = httpx2.get(f"{served}/health", timeout=10).json()["workers"]
        if all(w["running"] == 0 and w["waiting"] == 0 and w["free_blocks"] == w["total_blocks"]
               for w in workers.values()):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"blocks not freed after a disconnect: {workers}")


def test_health_shows_how_each_workers_kv_pool_was_sized(served):
    import httpx2

    workers = httpx2.get(f"{served}/health", timeout=30).json()["workers"]
    assert sorted(w["kind"] for w in workers.values()) == ["decode", "prefill"]
    for w in workers.values():  # `kv_cache_mib: 4` in the app's config: explicit, on the CPU Ray granted
        plan = w["kv_plan"]
        assert (plan["source"], plan["device"], plan["kv_bytes"] <= 4 << 20) == ("kv_cache_bytes", "cpu", True)
        assert plan["num_blocks"] == w["total_blocks"] and plan["max_tokens"] == 16 * w["total_blocks"]


def test_nothing_listens_beyond_loopback(served):
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    import psutil

    # This process and every process it started: the local Ray cluster (GCS, raylet, workers, Serve).
    # (Ray's state API needs the dashboard, which the session cluster leaves out.)
    me = psutil.Process()
    ours = {str(p.pid) for p in [me, *me.children(recursive=True)]}
    wide = [line for line in out.splitlines() if "users:" in line
            and not line.split()[3].startswith(("127.", "[::1]", "::1", "[::ffff:127."))
            and any(f"pid={p}," in line for p in ours)]
    assert not wide, wide


def test_dashboard_and_metrics_are_served(served):
    import httpx2

    page = httpx2.get(f"{served}/dashboard", timeout=30)
    assert page.status_code == 200 and "<html" in page.text.lower()
    data = httpx2.get(f"{served}/dashboard/data", timeout=30).json()
    assert data["workers"] and all(w["healthy"] for w in data["workers"])
    model = httpx2.get(f"{served}/v1/models", timeout=30).json()["data"][0]["id"]
    r = httpx2.post(f"{served}/v1/completions", json={"model": model, "prompt": "status", "max_tokens": 3},
                    timeout=120)
    assert r.status_code == 200, r.text
    # /health (what `ferry status` prints) measures the unauthenticated tenant against the default contract.
    mine = httpx2.get(f"{served}/health", timeout=30).json()["slo"]["tenants"]["default"]
    assert (mine["ttft_slo_ms"], mine["tpot_slo_ms"]) == (30_000.0, 1_000.0)
    assert mine["completed"] >= 1 and mine["attainment"] == 1.0


def semantic_chat(url: str, text: str) -> Any:
    import httpx2

    body = {"model": "x", "messages": [{"role": "user", "content": text}], "max_tokens": 6, "temperature": 0}
    body["model"] = httpx2.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    r = httpx2.post(f"{url}/v1/chat/completions", json=body, headers={"x-ferry-semantic-cache": "on"}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def semantic_actor() -> Any:
    """The ingress's store actor, found by name in whatever namespace Serve gave the replica."""
    import ray

    from deploy.apps import SEMANTIC_CACHE_ACTOR

    found = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == SEMANTIC_CACHE_ACTOR]
    assert len(found) == 1, found
    return ray.get_actor(SEMANTIC_CACHE_ACTOR, namespace=found[0]["namespace"])


def wait_entries(actor: Any, size: int) -> Any:
    import ray

    deadline = time.monotonic() + 60  # inserts land after the answer
    while (stats := ray.get(actor.stats.remote(), timeout=30)).size < size:
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
    return stats


def test_semantic_cache_answers_through_its_actor_and_shows_on_metrics(served):
    import ray

    from tests.deploy.monitoring.test_metrics_ray import scrape

    actor = semantic_actor()
    first = semantic_chat(served, "What is the capital of France?")
    assert first.headers["x-ferry-cache"] == "miss"
    wait_entries(actor, 1)
    hit = semantic_chat(served, "Which city is the capital of France?")
    assert hit.headers["x-ferry-cache"] == "semantic"
    assert float(hit.headers["x-ferry-cache-similarity"]) >= SEMANTIC_THRESHOLD
    assert hit.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
    assert semantic_chat(served, "How do I change a flat tire?").headers["x-ferry-cache"] == "miss"
    stats = wait_entries(actor, 2)
    # The actor holds what the ingress asked: the app does not keep a cache of its own.
    assert (stats.num_lookups, stats.num_hits, stats.num_inserts) == (3, 1, 2)

    url = f"http://127.0.0.1:{ray.nodes()[0]['MetricsExportPort']}/metrics"
    want = {"ray_ferry_semantic_lookups_total": 3, "ray_ferry_semantic_hits_total": 1,
            "ray_ferry_semantic_inserts_total": 2, "ray_ferry_semantic_entries": 2,
            "ray_ferry_semantic_similarity_count": 2}  # the first lookup found an empty partition
    deadline = time.monotonic() + 120  # the ingress exports every 5 s, Ray reports every 10 s
    while True:
        series = scrape(url)
        got = {name: series.get((name, frozenset())) for name in want}
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert got == want
    assert series[("ray_ferry_semantic_similarity_bucket", frozenset({("le", "1.0")}))] == 2


def test_a_stop_drains_then_deleting_the_app_saves_the_semantic_cache(served, semantic_dir):
    import httpx2
    import ray
    from ray import serve

    from actors.semantic_cache.persist import MANIFEST
    from deploy.apps import SEMANTIC_CACHE_ACTOR

    actor = semantic_actor()
    size = ray.get(actor.stats.remote(), timeout=30).size
    semantic_chat(served, "Why is the sky blue?")
    wait_entries(actor, size + 1)
    assert not (semantic_dir / MANIFEST).exists()  # no timer, under 64 inserts: nothing saved yet
    # What `ferry serve` does on Ctrl-C before deleting the app: nothing in flight, so it drains at once.
    assert serve.get_app_handle("ferry-test").drain.remote(10.0).result(timeout_s=60) == 0
    refused = httpx2.post(f"{served}/v1/completions", json={"model": "x", "prompt": "hi"}, timeout=30)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
    health = httpx2.get(f"{served}/health", timeout=30)
    assert health.status_code == 503 and health.json() == {"healthy": False, "draining": True, "in_flight": 0}
    serve.delete("ferry-test")  # the replica's shutdown: lifespan end (save), __del__ (save, kill)
    manifest = json.loads((semantic_dir / MANIFEST).read_text())
    prompts = [e["prompt"] for p in manifest["partitions"] for e in p["entries"]]
    assert len(prompts) == size + 1 and "user: Why is the sky blue?" in prompts
    deadline = time.monotonic() + 30  # ray.kill is asynchronous
    while SEMANTIC_CACHE_ACTOR in {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}:
        assert time.monotonic() < deadline, "the store actor outlived its app"
        time.sleep(0.2)
