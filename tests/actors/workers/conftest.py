"""Fixtures of the data-plane worker tests: a tiny model on disk, and a session Ray cluster that is
started only if a Ray-marked test asks for one (and reused if another folder already started it)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from actors.engine.tiny_model import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("workers-tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[ModuleType]:
    # Must be set before Ray starts: every Ray port then binds 127.0.0.1 (shared/NOTES-ray.md).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray = pytest.importorskip("ray")
    if ray.is_initialized():  # another folder's session cluster: reuse it, leave its shutdown to it
        yield ray
        return
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
