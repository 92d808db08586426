"""The default torch thread count splits the node's CPUs among the app's engines."""

from __future__ import annotations

import os

import pytest

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
    cfg = AppConfig(model="smollm2", mode=mode, num_prefill=num_prefill, num_decode=num_decode)
    assert default_torch_threads(cfg) == want
