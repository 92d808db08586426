"""A fixed buffer carved into variable-size regions: the staging memory a transport registers once and
moves every shard through.

Mental model: `RegionAllocator` is the bookkeeping alone (offsets, first fit over a sorted free list,
neighbours merged on free, bounded waits for space another thread frees); `StagingArena` pairs it
with the memory itself. That memory is page-aligned host memory (NIXL registers it as `DRAM`), or,
when the KV lives on a GPU, one device allocation on that GPU (NIXL registers it as `VRAM`, so UCX
moves device memory directly and no shard is staged through the host). Regions are rounded up to
`ALIGN` so every shard starts on its own page.
"""

from __future__ import annotations

import bisect
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

ALIGN = 4096


def round_up(n: int) -> int:
    return max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)


class RegionAllocator:
    """Offsets into `size_bytes` of memory that lives elsewhere; thread-safe."""

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = round_up(size_bytes)
        self._cond = threading.Condition()
        self._starts = [0]  # free regions, sorted by start; parallel lists
        self._sizes = [self.size_bytes]
        self._used: dict[int, int] = {}  # start -> rounded size

    @property
    def in_use_bytes(self) -> int:
        with self._cond:
            return sum(self._used.values())

    def try_alloc(self, num_bytes: int) -> int | None:
        """Offset of a free region of at least `num_bytes`, or None when none fits right now."""
        need = round_up(num_bytes)
        with self._cond:
            for i, size in enumerate(self._sizes):
                if size >= need:
                    start = self._starts[i]
                    if size == need:
                        del self._starts[i], self._sizes[i]
                    else:
                        self._starts[i] += need
                        self._sizes[i] -= need
                    self._used[start] = need
                    return start
        return None

    def alloc(self, num_bytes: int, deadline: float, abandon: threading.Event | None = None) -> int | None:
        """Like `try_alloc`, waiting for frees until `deadline` (time.monotonic) or until `abandon`
        is set; None then. A request larger than the arena fails at once with ValueError."""
        if round_up(num_bytes) > self.size_bytes:
            raise ValueError(f"{num_bytes} bytes exceed the staging buffer of {self.size_bytes} bytes")
        while True:
            off = self.try_alloc(num_bytes)
            if off is not None:
                return off
            left = deadline - time.monotonic()
            if left <= 0 or (abandon is not None and abandon.is_set()):
                return None
            with self._cond:
                # short waits so a set `abandon` is noticed without a notify from its setter
                self._cond.wait(min(left, 0.05))

    def free(self, offset: int) -> None:
        with self._cond:
            size = self._used.pop(offset)
            i = bisect.bisect_left(self._starts, offset)
            self._starts.insert(i, offset)
            self._sizes.insert(i, size)
            if i + 1 < len(self._starts) and offset + size == self._starts[i + 1]:
                self._sizes[i] += self._sizes.pop(i + 1)
                self._starts.pop(i + 1)
            if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == offset:
                self._sizes[i - 1] += self._sizes.pop(i)
                self._starts.pop(i)
            self._cond.notify_all()

    def check_integrity(self) -> None:
        """Free and used regions tile the buffer exactly, with no two free neighbours."""
        with self._cond:
            free = [(s, z, False) for s, z in zip(self._starts, self._sizes)]
            spans = sorted(free + [(s, z, True) for s, z in self._used.items()])
            at = 0
            prev_free = False
            for start, size, used in spans:
                assert start == at and size > 0, (start, at, size)
                assert used or not prev_free, f"free regions at {start} not merged"
                prev_free = not used
                at += size
            assert at == self.size_bytes, (at, self.size_bytes)


def cuda_device_index(device: "str | torch.device | None") -> int | None:
    """The CUDA ordinal `device` names, or None for host memory (None, "cpu")."""
    if device is None:
        return None
    import torch

    d = torch.device(device)
    if d.type == "cpu":
        return None
    if d.type != "cuda":
        raise ValueError(f"staging lives in host memory or on a CUDA device, not on {d}")
    return d.index if d.index is not None else torch.cuda.current_device()


class StagingArena(RegionAllocator):
    """Regions of one buffer: host memory (`device` None or "cpu"), or one allocation on a CUDA device.

    `mem_type` ("DRAM" or "VRAM") and `dev_id` are what NIXL's registration takes. Host arenas keep
    `buf` (a uint8 numpy array); device arenas keep `tensor` (a uint8 torch tensor on that GPU)."""

    def __init__(self, size_bytes: int, device: "str | torch.device | None" = None) -> None:
        super().__init__(size_bytes)
        self.dev_id = cuda_device_index(device)
        self.mem_type = "DRAM" if self.dev_id is None else "VRAM"
        self.buf: np.ndarray | None = None
        self.tensor: Any = None
        if self.dev_id is None:
            # One spare page so the first region can start on a page boundary.
            self._raw = np.empty(self.size_bytes + ALIGN, dtype=np.uint8)
            skip = -self._raw.ctypes.data % ALIGN
            self.buf = self._raw[skip : skip + self.size_bytes]
            self.buf.fill(0)  # fault every page in now: first touches inside a transfer cost 5-10x
            self.base_addr = int(self.buf.ctypes.data)
        else:
            import torch

            # The caching allocator hands out 512-byte aligned blocks; every region offset is a
            # multiple of ALIGN on top of that, which is what NIXL and the codec need.
            self.tensor = torch.zeros(self.size_bytes, dtype=torch.uint8, device=f"cuda:{self.dev_id}")
            self.base_addr = int(self.tensor.data_ptr())

    def write(self, offset: int, src: Any) -> None:
        """Copies `src` (a host buffer, or a uint8 torch tensor on any device) to `offset`."""
        if self.buf is not None:
            if hasattr(src, "device"):  # a torch tensor: on the host, numpy drops the GIL for the copy
                src = src.cpu().numpy()
            src = np.frombuffer(src, dtype=np.uint8) if not isinstance(src, np.ndarray) else src.reshape(-1)
            np.copyto(self.buf[offset : offset + len(src)], src)
            return
        import torch

        with warnings.catch_warnings():  # a read-only buffer is fine: it is only read
            warnings.simplefilter("ignore", UserWarning)
            t = src if isinstance(src, torch.Tensor) else torch.frombuffer(src, dtype=torch.uint8)
        self.tensor[offset : offset + t.numel()].copy_(t.reshape(-1))
        torch.cuda.current_stream(self.tensor.device).synchronize()  # NIXL reads it from another stream

    def view(self, offset: int, num_bytes: int) -> Any:
        """Host: a memoryview. Device: a uint8 tensor view on the GPU."""
        if self.buf is not None:
            return memoryview(self.buf[offset : offset + num_bytes])
        return self.tensor[offset : offset + num_bytes]
