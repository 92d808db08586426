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
    # Three of the four (scenario, recovery) pairs: without a replacement, shadows are tried with one.
    # 160 tokens: in shadow mode the kill waits for the shadows to land in the pool, and on a loaded box
    # 48-token streams once ended first (the kill never came).
    args = argparse.Namespace(model=str(model), streams=3, max_tokens=160, kill_after=12, dtype="float32",
                              scenarios=["1P+1D replace"], kv_recovery=["shadow", "recompute"])
    figures = asyncio.run(bench(args))
    args.scenarios, args.kv_recovery = ["1P+1D no-replace"], ["recompute"]
    figures["scenarios"] |= asyncio.run(bench(args))["scenarios"]
    s = figures["scenarios"]
    # The lone decode worker dies: the streams resume at once on the lent prefill worker (from KV
    # shadows, or recomputed there), replaced or not, and end as without the failure (float32).
    for name, kept in s.items():
        assert (kept["finished"], kept["errors"], kept["same_tokens_as_failure_free"]) == (3, [], 3), name
        assert kept["stall_s_max"] < 10 * max(0.2, kept["normal_longest_gap_s_max"]) + 2.0, name
        assert kept["resumed_from_kv"] == (3 if name.endswith("shadow") else 0), name
    for name in ("1P+1D replace shadow", "1P+1D replace recompute"):
        assert s[name]["replace_s"] > 0 and s[name]["stall_s_max"] < s[name]["replace_s"], name
    assert s["1P+1D no-replace recompute"]["replace_s"] is None
    figures["wall_s"] = 1.0
    table = render(figures)
    assert "1P+1D replace recompute     3/3" in table and "1P+1D no-replace recompute  3/3" in table
