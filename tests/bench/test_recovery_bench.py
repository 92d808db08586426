"""bench/recovery.py on the tiny model in float32: the figures come from real kills. With a
replacement every stream finishes after a stall about as long as the replacement took, with exactly
the failure-free tokens; without one none does."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from types import ModuleType

import pytest

from actors.engine.tiny_model import write_tiny_model

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_recovery_bench_on_the_tiny_model(ray_cluster: ModuleType, tmp_path: Path) -> None:
    from bench.recovery import bench, render

    model = write_tiny_model(tmp_path / "tiny", seed=0, max_position_embeddings=1024)
    args = argparse.Namespace(model=str(model), streams=3, max_tokens=48, kill_after=12, dtype="float32",
                              scenarios=["1P+1D replace", "1P+1D no-replace"])
    figures = asyncio.run(bench(args))
    healed, lost = figures["scenarios"]["1P+1D replace"], figures["scenarios"]["1P+1D no-replace"]
    assert (healed["finished"], healed["errors"], healed["same_tokens_as_failure_free"]) == (3, [], 3)
    assert healed["replace_s"] > 0 and healed["stall_s_max"] >= healed["replace_s"] * 0.8
    assert healed["stall_s_max"] > 5 * healed["normal_longest_gap_s_max"]
    assert lost["finished"] == 0 and lost["errors"] and lost["replace_s"] is None
    figures["wall_s"] = 1.0
    table = render(figures)
    assert "1P+1D replace     3/3" in table and "1P+1D no-replace  0/3" in table and "errors of the failed" in table
