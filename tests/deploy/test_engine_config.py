"""The `engine:` section as the engines and Ray see it: device, dtype, an explicit or a planned KV
pool, the share of a GPU or host that is each engine's, and GPU fractions; and the default app
serving a prompt of the model's whole context (no fixed pool that is too small for it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.engine.engine import Engine
from actors.engine.sampling import SamplingParams
from actors.engine.tiny_model import write_tiny_model
from actors.worker_config import WorkerResources
from deploy.config import MIB, AppConfig, ConfigError, load_config, read_args


def test_defaults_plan_the_kv_pool_on_the_device_ray_grants() -> None:
    cfg = AppConfig()
    engine = cfg.to_engine_config()
    assert (engine.device, engine.dtype, engine.kv_cache_bytes, engine.num_blocks) == ("auto", "float32", None, None)
    assert (engine.kv_memory_fraction, engine.kv_cpu_max_bytes, engine.enforce_eager) == (0.9, 2048 * MIB, False)
    assert engine.kv_memory_share == 0.5  # 1 prefill + 1 decode engine on the host


def test_an_explicit_kv_size_wins_over_the_plan_and_every_field_maps() -> None:
    cfg = load_config({"engine": {"kv_cache_mib": 256, "dtype": "float16", "device": "cuda", "kv_memory_fraction": 0.8,
                                  "kv_cache_max_mib": 512, "enforce_eager": True, "num_gpus_per_worker": 0.25}})
    engine = cfg.to_engine_config()
    assert (engine.kv_cache_bytes, engine.dtype, engine.device) == (256 * MIB, "float16", "cuda")
    assert (engine.kv_memory_fraction, engine.kv_cpu_max_bytes, engine.enforce_eager) == (0.8, 512 * MIB, True)
    assert engine.kv_memory_share == 0.25  # the GPU fraction each worker holds
    assert cfg.to_worker_config().engine == engine


@pytest.mark.parametrize(("args", "cluster_gpus", "want"), [
    # (device, num_gpus asked of Ray, kv_memory_share)
    ({}, 0.0, ("cpu", 0.0, 1 / 2)),  # CPU: the host's memory split among the engines
    ({"num_prefill": 1, "num_decode": 2}, 0.0, ("cpu", 0.0, 1 / 3)),
    ({"mode": "colocated", "num_decode": 4}, 0.0, ("cpu", 0.0, 1 / 4)),
    ({}, 8.0, ("cuda", 1.0, 1.0)),  # a GPU each: all of it
    ({}, 1.0, ("cuda", 0.5, 0.5)),  # prefill and decode share the one GPU
    ({"engine": {"num_gpus_per_worker": 0.5}}, 8.0, ("cuda", 0.5, 0.5)),
    ({"engine": {"device": "cpu"}}, 8.0, ("cpu", 0.0, 1 / 2)),
    ({"engine": {"device": "cuda"}}, 0.0, ("cuda", 1.0, 1.0)),  # waits for the autoscaler's GPU node
])
def test_resources_and_engine_follow_the_cluster(args: dict, cluster_gpus: float, want: tuple) -> None:
    cfg = load_config(args)
    resources = cfg.worker_resources(cluster_gpus)
    engine = cfg.to_worker_config(resources).engine
    assert (engine.device, resources.num_gpus, engine.kv_memory_share) == pytest.approx(want)
    options = resources.actor_options()
    assert {k: options[k] for k in ("num_cpus", "num_gpus")} == {"num_cpus": 0.25, "num_gpus": want[1]}
    # CPU engines share the node's cores (engine.cpu_cores), so their OpenMP threads sleep when idle
    assert ("runtime_env" in options) == (want[0] == "cpu")


def test_bad_engine_fields_are_named() -> None:
    with pytest.raises(ConfigError, match=r"engine\.dtype"):
        load_config({"engine": {"dtype": "float8"}})
    with pytest.raises(ConfigError, match=r"engine\.device"):
        load_config({"engine": {"device": "cuda:1"}})  # Ray picks the GPU, not the config
    for bad in (0, 1.5):
        with pytest.raises(ConfigError, match=r"engine\.num_gpus_per_worker"):
            load_config({"engine": {"num_gpus_per_worker": bad}})
    with pytest.raises(ConfigError, match="num_gpus_per_worker needs engine.device cuda or auto"):
        load_config({"engine": {"device": "cpu", "num_gpus_per_worker": 0.5}})
    for field, bad in (("kv_cache_mib", 0), ("kv_memory_fraction", 1.5), ("kv_memory_fraction", 0)):
        with pytest.raises(ConfigError, match=rf"engine\.{field}"):
            load_config({"engine": {field: bad}})


def test_serve_yaml_plans_the_kv_pool() -> None:
    engine = read_args("deploy/serve.yaml")["engine"]
    assert "kv_cache_mib" not in engine  # a fixed 128 MiB held 5.6k SmolLM2 tokens: less than its context
    cfg = load_config("deploy/serve.yaml")
    assert cfg.engine.device == "auto" and cfg.to_engine_config().kv_cache_bytes is None


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-8k"), seed=0, max_position_embeddings=8192)


@pytest.mark.slow
def test_the_default_app_serves_a_prompt_of_the_whole_context(long_context_model: Path) -> None:
    cfg = AppConfig(model=str(long_context_model), engine={"dtype": "float32"})
    engine = Engine.from_pretrained(long_context_model, cfg.to_engine_config(cfg.worker_resources(0.0)))
    plan = engine.kv_plan
    assert plan.source == "planned" and plan.device == "cpu" and plan.share == 0.5
    assert engine.max_model_len == 8192 and plan.max_tokens >= 8192  # one request of the whole context fits
    prompt = [(i * 7919) % 200 + 3 for i in range(8191)]
    engine.add_request("full", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and len(outs[-1].token_ids) == 1
