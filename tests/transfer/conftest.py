"""A session-scoped local Ray cluster for the Ray-marked transfer tests, bound to 127.0.0.1 only."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def ray_local() -> Iterator[None]:
    ray = pytest.importorskip("ray")
    # Before Ray starts: otherwise it also listens on the machine's address (../shared/NOTES-ray.md).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()
