"""Where an engine runs, and how much memory that place has left.

Mental model: the engine asks three questions of its device and nothing else branches on it:
which `torch.device` "auto" means here, how many bytes are free for its KV pool, and (CUDA) how
many bytes one profiled forward needed at its peak. CUDA answers from the caching allocator and
the driver; CPU from the kernel (/proc/meminfo, and the cgroup limit when the process runs in one). The KV
memory plan (actors/engine/memory.py) is built from these answers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


class DeviceUnavailable(RuntimeError):
    """The configured device does not exist in this process (e.g. `cuda` on a CPU-only node)."""


def resolve_device(name: str) -> torch.device:
    """"auto" -> the first CUDA device when torch sees one, else the CPU; "cuda" -> the current
    CUDA device (Ray sets CUDA_VISIBLE_DEVICES per worker, so that is the worker's own GPU)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceUnavailable(f"device {name!r}: ferry runs on auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable(f"device {name!r} asked for, but torch sees no CUDA device "
                                    f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise DeviceUnavailable(f"device {name!r}: only {torch.cuda.device_count()} CUDA devices visible")
        device = torch.device("cuda", index)
    elif device.type != "cpu":
        raise DeviceUnavailable(f"device {name!r}: ferry runs on cpu or cuda")
    return device


@dataclass(frozen=True)
class MemoryInfo:
    free_bytes: int  # what a new allocation can still get on this device
    total_bytes: int
    source: str  # where the figure came from, for the plan's log line


def memory_info(device: torch.device) -> MemoryInfo:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # blocks cached by the allocator are free for the KV pool
        free, total = torch.cuda.mem_get_info(device)
        return MemoryInfo(int(free), int(total), "cuda.mem_get_info")
    return host_memory_info()


def host_memory_info(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> MemoryInfo:
    """MemAvailable of the host, lowered to what the process's cgroup still allows (a container's
    limit is what the OOM killer enforces, whatever the host has)."""
    meminfo = _read_kib_fields(proc / "meminfo")
    free, total, source = meminfo["MemAvailable"], meminfo["MemTotal"], "MemAvailable"
    limit = _cgroup_limit(cgroup)
    if limit is not None and limit[0] < total:
        room = max(0, limit[0] - limit[1])
        if room < free:
            free, source = room, "cgroup memory.max - memory.current"
        total = limit[0]
    return MemoryInfo(free, total, source)


def _read_kib_fields(path: Path) -> dict[str, int]:
    out = {}
    for line in path.read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _cgroup_limit(root: Path) -> tuple[int, int] | None:
    """(limit, usage) of this process's cgroup v2, or None when unlimited or unreadable."""
    try:
        rel = next((line.split("::", 1)[1] for line in Path("/proc/self/cgroup").read_text().splitlines()
                    if line.startswith("0::")), "/")
        group = root / rel.lstrip("/")
        raw = (group / "memory.max").read_text().strip()
        if raw == "max":
            return None
        return int(raw), int((group / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None


class PeakMeter:
    """The peak of CUDA memory allocated by the code run inside `measure()`, over what was
    allocated before it (the caching allocator's own counters)."""

    def __init__(self, device: torch.device) -> None:
        assert device.type == "cuda", "only CUDA allocations are metered (CPU plans estimate)"
        self.device = device
        self.peak_bytes: int | None = None

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        yield
        torch.cuda.synchronize(self.device)
        self.peak_bytes = max(0, torch.cuda.max_memory_allocated(self.device) - base)
