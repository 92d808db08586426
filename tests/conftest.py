import os

from collections.abc import Iterator
from types import ModuleType

import pytest

# Before any test module imports ray: Ray reads these at import time. Every Ray port then binds
# 127.0.0.1 (shared/NOTES-ray.md) and the test clusters need no auth token.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs CUDA; this machine has none")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[ModuleType]:
    """One local Ray cluster for the whole session, started by the first Ray-marked test that asks
    (2 CPUs: actors use fractional ones), bound to 127.0.0.1 by the env set above."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        yield ray
        return
    start_local_ray()
    try:
        yield ray
    finally:
        ray.shutdown()


def start_local_ray() -> None:
    """The session's local cluster: also what a test that needs a cluster of its own (several
    nodes) starts again when it is done, for the tests after it."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
