"""The staging allocator: exact offsets, first fit, merging on free, bounded waits."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from transfer.staging import ALIGN, StagingArena


def test_first_fit_offsets_and_merge_on_free() -> None:
    a = StagingArena(8 * ALIGN)
    assert a.base_addr % ALIGN == 0 and a.size_bytes == 8 * ALIGN
    x, y, z = a.try_alloc(1), a.try_alloc(ALIGN + 1), a.try_alloc(3 * ALIGN)
    assert (x, y, z) == (0, ALIGN, 3 * ALIGN)
    assert a.in_use_bytes == 6 * ALIGN
    assert a.try_alloc(3 * ALIGN) is None  # 2 pages left
    a.free(y)
    assert a.try_alloc(2 * ALIGN) == ALIGN  # the hole, exactly
    a.free(ALIGN)
    a.free(x)
    a.check_integrity()
    assert a.try_alloc(3 * ALIGN) == 0  # x and y's holes merged into three pages
    a.free(0)
    a.free(z)
    a.check_integrity()
    assert a.in_use_bytes == 0 and a.try_alloc(8 * ALIGN) == 0


def test_alloc_waits_for_a_free_from_another_thread_and_times_out_otherwise() -> None:
    a = StagingArena(2 * ALIGN)
    first = a.try_alloc(2 * ALIGN)
    t0 = time.monotonic()
    assert a.alloc(ALIGN, deadline=time.monotonic() + 0.2) is None
    assert 0.15 < time.monotonic() - t0 < 3.0
    threading.Timer(0.1, a.free, args=(first,)).start()
    assert a.alloc(ALIGN, deadline=time.monotonic() + 5.0) == 0
    abandon = threading.Event()
    threading.Timer(0.1, abandon.set).start()
    t0 = time.monotonic()
    assert a.alloc(2 * ALIGN, deadline=time.monotonic() + 5.0, abandon=abandon) is None
    assert time.monotonic() - t0 < 3.0
    with pytest.raises(ValueError, match="exceed"):
        a.alloc(3 * ALIGN, deadline=time.monotonic() + 1.0)



def test_host_arena_is_dram_and_takes_bytes_or_tensors() -> None:
    from transfer.nixl_endpoint import staging_regions

    a, b = StagingArena(2 * ALIGN, device="cpu"), StagingArena(ALIGN)
    assert (a.mem_type, a.dev_id, a.tensor) == ("DRAM", None, None)
    a.write(10, b"\x01\x02\x03")
    a.write(ALIGN, torch.arange(5, dtype=torch.uint8))
    assert bytes(a.view(10, 3)) == b"\x01\x02\x03" and bytes(a.view(ALIGN, 5)) == bytes(range(5))
    # what NIXL registers: host memory as device 0, under the arenas' one memory type
    assert staging_regions(a, b) == [(a.base_addr, 2 * ALIGN, 0, ""), (b.base_addr, ALIGN, 0, "")]
    with pytest.raises(ValueError, match="CUDA"):
        StagingArena(ALIGN, device="meta")
