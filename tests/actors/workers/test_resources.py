"""What worker actors ask Ray for, and where their engines run: `plan_worker_resources` (cpu, cuda,
auto by the cluster's GPUs; whole GPUs or fractions packed onto them), `WorkerResources.place`
(the engine's device pinned, its KV share capped at its GPU fraction), and `start_pd` /
`start_colocated` / `PDDeployment.replace` passing both to every actor. No GPU needed: the
wiring runs against fake actor classes; one Ray-marked test starts a real CPU worker."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import actors.ray_actors as ray_actors
from actors.engine.config import EngineConfig
from actors.worker_config import NoGpuForWorker, WorkerConfig, WorkerResources, plan_worker_resources

CPU = {"num_cpus": 0.25, "num_gpus": 0.0}


@pytest.mark.parametrize(("device", "num_workers", "cluster_gpus", "per_worker", "want_gpus"), [
    ("cpu", 2, 8.0, None, 0.0),
    ("auto", 2, 0.0, None, 0.0),  # a CPU-only cluster: as before, a quarter CPU each
    ("auto", 2, 8.0, None, 1.0),  # a GPU for every worker
    ("auto", 2, 2.0, None, 1.0),
    ("auto", 2, 1.0, None, 0.5),  # the embedded default on one GPU: prefill and decode share it
    ("auto", 3, 2.0, None, 0.5),  # packed two to a GPU (0.67 each would fit on no second GPU)
    ("auto", 3, 1.0, None, 0.3333),  # Ray's resource grain is 1e-4: three of these fit on one GPU
    ("cuda", 2, 0.0, None, 1.0),  # none up yet: ask anyway, an autoscaler starts a GPU node
    ("cuda", 4, 1.0, 0.25, 0.25),
    ("auto", 2, 8.0, 0.5, 0.5),  # an explicit fraction wins over a whole GPU each
])
def test_resources_follow_the_device_and_the_clusters_gpus(device: str, num_workers: int, cluster_gpus: float,
                                                            per_worker: float | None, want_gpus: float) -> None:
    r = plan_worker_resources(device, num_workers, cluster_gpus, num_gpus_per_worker=per_worker)
    assert r.num_gpus == want_gpus and r.num_cpus == 0.25
    assert r.device == ("cpu" if want_gpus == 0 else "cuda")
    assert r.actor_options() == {"num_cpus": 0.25, "num_gpus": want_gpus}


def test_default_fractions_always_fit_on_the_clusters_gpus() -> None:
    for gpus in range(1, 9):
        for workers in range(1, 20):
            r = plan_worker_resources("auto", workers, float(gpus))
            per_gpu = math.floor(1 / r.num_gpus + 1e-9)  # workers whose fractions fit on one GPU
            assert per_gpu * gpus >= workers, (gpus, workers, r)
            assert r.num_gpus == 1.0 or per_gpu == math.ceil(workers / gpus)  # never smaller than needed


def test_gpus_that_the_config_rules_out_are_an_error() -> None:
    with pytest.raises(NoGpuForWorker, match="device 'cpu'"):
        plan_worker_resources("cpu", 2, 8.0, num_gpus_per_worker=0.5)
    with pytest.raises(NoGpuForWorker, match="0 GPUs in the Ray cluster"):
        plan_worker_resources("auto", 2, 0.0, num_gpus_per_worker=0.5)
    with pytest.raises(ValueError, match="num_gpus must be in"):
        WorkerResources(num_gpus=2.0)  # an engine drives one GPU
    with pytest.raises(NoGpuForWorker, match="engine's device is 'cpu'"):
        WorkerResources(num_gpus=1.0).place(EngineConfig(device="cpu"))


def test_place_pins_the_device_and_caps_the_kv_share_at_the_gpu_fraction() -> None:
    half = WorkerResources(num_gpus=0.5)
    engine = half.place(EngineConfig())
    assert (engine.device, engine.kv_memory_share) == ("cuda", 0.5)
    assert half.place(engine) == engine  # idempotent
    assert half.place(EngineConfig(kv_memory_share=0.25)).kv_memory_share == 0.25  # a smaller share stays
    assert WorkerResources(num_gpus=1.0).place(EngineConfig(device="cuda:0")).device == "cuda:0"
    on_cpu = WorkerResources().place(EngineConfig(kv_memory_share=0.5))
    # Ray leaves CUDA_VISIBLE_DEVICES alone without GPUs: "auto" there could take another worker's GPU.
    assert (on_cpu.device, on_cpu.kv_memory_share) == ("cpu", 0.5)


class Ref:
    """An ObjectRef stand-in: awaitable (what `replace` does) and unwrapped by the fake `ray.get`."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self) -> Any:
        yield from asyncio.sleep(0).__await__()
        return self.value


class Method:
    def __init__(self, fn: Any) -> None:
        self.remote = lambda *args: Ref(fn(*args))


class FakeActor:
    def __init__(self, options: dict[str, float], args: tuple[Any, ...]) -> None:
        self.options, self.cfg, self.name = options, args[0], args[1]
        self.transport_metadata = Method(lambda: f"meta:{self.name}")
        self.add_peer = Method(lambda meta: meta.removeprefix("meta:"))
        self.load = Method(lambda: None)


class FakeRemote:
    """`RemoteDecode` & co.: records each `.options(...).remote(...)` as a started actor."""

    def __init__(self) -> None:
        self.started: list[FakeActor] = []

    def options(self, **options: float) -> Any:
        remote = self

        class Bound:
            @staticmethod
            def remote(*args: Any) -> FakeActor:
                remote.started.append(FakeActor(options, args))
                return remote.started[-1]

        return Bound

    def remote(self, *args: Any) -> FakeActor:
        raise AssertionError("workers must be started through .options(...) with their resources")


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> dict[str, FakeRemote]:
    out = {kind: FakeRemote() for kind in ("RemotePrefill", "RemoteDecode", "RemoteColocated")}
    for kind, fake in out.items():
        monkeypatch.setattr(ray_actors, kind, fake)
    monkeypatch.setattr(ray_actors.ray, "get", lambda refs, timeout=None: [r.value for r in refs])
    monkeypatch.setattr(ray_actors.ray, "kill", lambda *a, **k: None)
    return out


def test_a_deployment_on_a_one_gpu_cluster_shares_the_gpu(fakes: dict[str, FakeRemote],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_actors, "cluster_gpus", lambda: 1.0)
    pd = ray_actors.start_pd(WorkerConfig(model="m"), num_prefill=1, num_decode=1, cache=None, name_prefix="g")
    started = fakes["RemotePrefill"].started + fakes["RemoteDecode"].started
    assert [a.options for a in started] == [{"num_cpus": 0.25, "num_gpus": 0.5}] * 2
    assert {(a.cfg.engine.device, a.cfg.engine.kv_memory_share) for a in started} == {("cuda", 0.5)}
    assert pd.resources == WorkerResources(num_gpus=0.5) and pd.cfg is not None and pd.cfg.engine.device == "cuda"

    asyncio.run(pd.replace("g-decode-0"))  # a replacement asks for what the first one had
    replacement = fakes["RemoteDecode"].started[-1]
    assert replacement.options == {"num_cpus": 0.25, "num_gpus": 0.5} and replacement.cfg.engine.device == "cuda"


def test_a_deployment_on_a_cpu_cluster_stays_on_fractional_cpus(fakes: dict[str, FakeRemote],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_actors, "cluster_gpus", lambda: 0.0)
    ray_actors.start_pd(WorkerConfig(model="m"), num_prefill=2, num_decode=1, cache=None, name_prefix="c")
    started = fakes["RemotePrefill"].started + fakes["RemoteDecode"].started
    assert [a.options for a in started] == [CPU] * 3
    assert {a.cfg.engine.device for a in started} == {"cpu"}


def test_explicit_resources_win_and_colocated_workers_get_them(fakes: dict[str, FakeRemote],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_actors, "cluster_gpus", lambda: pytest.fail("explicit resources need no lookup"))
    gpu = WorkerResources(num_gpus=1.0)
    pd = ray_actors.start_colocated(WorkerConfig(model="m"), num_workers=2, resources=gpu)
    assert [a.options for a in fakes["RemoteColocated"].started] == [{"num_cpus": 0.25, "num_gpus": 1.0}] * 2
    assert pd.resources == gpu and {a.cfg.engine.device for a in fakes["RemoteColocated"].started} == {"cuda"}
    with pytest.raises(NoGpuForWorker):  # a CPU engine never goes onto a GPU Ray reserved for it
        ray_actors.start_colocated(WorkerConfig(model="m", engine=EngineConfig(device="cpu")), resources=gpu)


@pytest.mark.ray
def test_a_cpu_worker_reports_its_kv_plan_on_every_load_poll(ray_cluster: ModuleType, tiny_model_dir: Path) -> None:
    cfg = WorkerConfig(model=str(tiny_model_dir), engine=EngineConfig(num_blocks=24))
    pd = ray_actors.start_colocated(cfg, torch_threads=1, name_prefix="kvplan")
    try:
        assert pd.resources == WorkerResources()  # the test cluster has no GPUs
        [handle] = pd.decodes.values()
        load = ray_cluster.get(handle.load.remote(), timeout=60)
        assert load.kv_plan is not None and load.kv_plan_report() == load.kv_plan.to_dict()
        plan = load.kv_plan.to_dict()
        assert (plan["source"], plan["device"], plan["num_blocks"]) == ("num_blocks", "cpu", 24)
        assert plan["max_tokens"] == 24 * plan["block_size"] == load.num_total_blocks * plan["block_size"]
    finally:
        pd.shutdown()


def _omp_wait_policy_and_threads(_actor: object) -> tuple[str | None, int]:
    import os

    import torch

    return os.environ.get("OMP_WAIT_POLICY"), torch.get_num_threads()


@pytest.mark.ray
def test_workers_that_share_cores_start_with_sleeping_openmp_threads(ray_cluster: ModuleType,
                                                                     tiny_model_dir: Path) -> None:
    cfg = WorkerConfig(model=str(tiny_model_dir), engine=EngineConfig(num_blocks=24))
    pd = ray_actors.start_colocated(cfg, torch_threads=2, name_prefix="shared",
                                    resources=WorkerResources(share_cores=True))
    try:
        [handle] = pd.decodes.values()
        # libgomp reads the policy as the process starts, so it must be in the actor's environment
        got = ray_cluster.get(handle.__ray_call__.remote(_omp_wait_policy_and_threads), timeout=60)
        assert got == ("PASSIVE", 2)
    finally:
        pd.shutdown()

