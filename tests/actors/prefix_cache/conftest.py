"""A session-scoped local Ray cluster for this folder's Ray-marked tests (started only if one asks)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import ModuleType

import pytest


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[ModuleType]:
    # Must be set before Ray starts: it makes every Ray port bind 127.0.0.1 (see NOTES-ray.md).
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
