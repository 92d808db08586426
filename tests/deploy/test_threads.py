"""The default torch thread count: all the node's CPUs for engines that share them (the default),
an equal split among the app's engines otherwise; shared cores set OpenMP's passive wait policy."""

from __future__ import annotations

import os

import pytest

from actors.core_share import CORE_SHARE_ENV, default_core_share_path
from deploy.apps import default_torch_threads
from deploy.config import AppConfig


@pytest.mark.parametrize(("mode", "num_prefill", "num_decode", "cpus", "want"), [
    ("colocated", 1, 1, 2, 2),
    ("disaggregated", 1, 1, 2, 1),
    ("disaggregated", 2, 2, 2, 1),  # never below one
    ("disaggregated", 1, 2, 16, 5),
    ("colocated", 1, 4, 16, 4),
])
def test_default_torch_threads_split_the_cpus(monkeypatch: pytest.MonkeyPatch, mode: str, num_prefill: int,
                                             num_decode: int, cpus: int, want: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cpus)))
    cfg = AppConfig(model="smollm2", mode=mode, num_prefill=num_prefill, num_decode=num_decode,
                    engine={"cpu_cores": "split"})
    assert default_torch_threads(cfg) == want
    shared = AppConfig(model="smollm2", mode=mode, num_prefill=num_prefill, num_decode=num_decode)
    assert default_torch_threads(shared) == cpus


def test_shared_cores_make_cpu_workers_sleep_when_idle() -> None:
    shared = AppConfig(model="smollm2").worker_resources(cluster_gpus=0.0)
    assert shared.actor_options()["runtime_env"] == {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}}
    lent = AppConfig(model="smollm2", engine={"lend_cores": True}).worker_resources(cluster_gpus=0.0)
    assert lent.actor_options()["runtime_env"] == {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE",
                                                                CORE_SHARE_ENV: default_core_share_path()}}
    split = AppConfig(model="smollm2", engine={"cpu_cores": "split"}).worker_resources(cluster_gpus=0.0)
    assert "runtime_env" not in split.actor_options()
    on_gpu = AppConfig(model="smollm2").worker_resources(cluster_gpus=1.0)  # CPU threads matter little there
    assert on_gpu.num_gpus > 0 and "runtime_env" not in on_gpu.actor_options()
