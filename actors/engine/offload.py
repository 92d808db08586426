"""Host-memory offload of a preempted request's KV: out between two steps, back when rows free.

Mental model: when the scheduler must take blocks from a running request (the pool is full, or an
interactive request waits for room a batch request holds), a request it may offload (batch class,
`priority_rank` >= 1, and room left in this engine's host budget) keeps its progress: the
scheduler `claim`s the blocks that hold its computed tokens and frees them; before the step's
forward can write into those blocks the engine `apply`s the batch, which copies them to host memory
(`runner.read_blocks`, then to the CPU) and writes back the KV of requests the scheduler
readmitted into their fresh blocks. Nothing is recomputed: the request continues from the very
bits it had, one forward later. A request dropped while offloaded (abort, engine shutdown) gives
its host memory back (`drop`). On a CPU engine the "host" copy lives in the same RAM as the pool,
but the pool's blocks are what is scarce: the copy frees them for others.
"""

from __future__ import annotations

import logging

import torch

from actors.engine.config import ModelConfig
from actors.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class HostOffload:
    def __init__(self, capacity_bytes: int, block_bytes: int) -> None:
        if capacity_bytes < 0 or block_bytes <= 0:
            raise ValueError(f"offload capacity must be >= 0 and block bytes > 0, got {capacity_bytes}, {block_bytes}")
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.used_bytes = 0
        self._saved: dict[str, torch.Tensor] = {}  # request id -> its KV on the host
        self._to_read: dict[str, list[int]] = {}  # claimed this step, read by `apply`
        self._to_write: dict[str, list[int]] = {}  # readmitted this step, written by `apply`
        self._bytes: dict[str, int] = {}
        self.num_offloads = 0  # times a request's KV went out

    @classmethod
    def for_model(cls, capacity_bytes: int, m: ModelConfig, block_size: int, dtype: torch.dtype) -> "HostOffload":
        """Sized for `m`'s blocks as `read_blocks` returns them: every layer's K and V in `dtype`."""
        return cls(capacity_bytes, m.num_layers * 2 * block_size * m.num_kv_heads * m.head_dim * dtype.itemsize)

    def holds(self, request_id: str) -> bool:
        return request_id in self._bytes

    def can_take(self, num_blocks: int) -> bool:
        return 0 < num_blocks and self.used_bytes + num_blocks * self.block_bytes <= self.capacity_bytes

    def claim(self, request_id: str, block_ids: list[int]) -> None:
        """The scheduler takes `block_ids` (the request's computed tokens) from a request whose KV
        goes to host memory; they are read by the next `apply`, before any forward writes them."""
        assert not self.holds(request_id) and self.can_take(len(block_ids))
        self._to_read[request_id] = list(block_ids)
        self._bytes[request_id] = len(block_ids) * self.block_bytes
        self.used_bytes += self._bytes[request_id]
        self.num_offloads += 1

    def readmit(self, request_id: str, block_ids: list[int]) -> None:
        """The request is back with fresh blocks: its KV is written into their first ones by `apply`."""
        self._to_write[request_id] = list(block_ids)

    def apply(self, runner: ModelRunner) -> None:
        """Between `schedule` and the forward: reads the claimed blocks out, then writes the readmitted
        requests' KV in (in that order: a readmitted request may get a block just claimed)."""
        for request_id, block_ids in self._to_read.items():
            self._saved[request_id] = runner.read_blocks(block_ids).to("cpu")
        self._to_read.clear()
        for request_id, block_ids in self._to_write.items():
            kv = self._saved.pop(request_id)
            runner.write_blocks(block_ids[: kv.shape[2]], kv)
            self.used_bytes -= self._bytes.pop(request_id)
        self._to_write.clear()

    def drop(self, request_id: str) -> None:
        """Forgets a request's offloaded KV (it finished or was aborted while out)."""
        size = self._bytes.pop(request_id, None)
        if size is not None:
            self.used_bytes -= size
            self._saved.pop(request_id, None)
            self._to_read.pop(request_id, None)
            self._to_write.pop(request_id, None)
