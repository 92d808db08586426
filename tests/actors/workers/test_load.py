"""`read_load`: what a worker's load poll answers, its process's resident memory included."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest

from actors.colocated import process_rss_bytes, read_load
from actors.engine.async_engine import AsyncEngine
from actors.engine.engine import Engine


def vm_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_resident_memory_is_this_process_and_follows_allocations() -> None:
    gc.collect()  # an earlier test's garbage freed now, not between the two reads below
    before = process_rss_bytes()
    assert abs(before - vm_rss_bytes()) < 16 << 20  # the kernel's own figure, read a moment apart
    # 256 MiB written through, so every page is resident; the margin covers other threads of this
    # process (an earlier test's engine winding down) freeing tens of MiB between the two reads.
    block = b"\x01" * (256 << 20)
    assert process_rss_bytes() - before > 128 << 20
    del block


def test_a_load_poll_carries_the_engine_counters_and_the_memory(tiny_model_dir: Path) -> None:
    engine = AsyncEngine(Engine.from_pretrained(tiny_model_dir))
    try:
        load = read_load(engine, "d0", "decode", num_reserved=2)
        assert (load.name, load.kind, load.num_running, load.num_reserved, load.healthy) == ("d0", "decode", 0, 2, True)
        assert load.num_free_blocks == load.num_total_blocks > 0
        assert load.rss_bytes > 10 << 20 if sys.platform.startswith("linux") else load.rss_bytes == 0
    finally:
        engine.shutdown()
