"""Receive staging that another process on this node writes into directly: the one seam between the
cuda_ipc transport's protocol and the memory it moves.

Mental model: the receiver owns an arena (`SharedArena`) and publishes its `handle()`; a sender
`open_arena(kind, handle)`s it into its own address space (`MappedArena`) and `copy_in`s each shard
at the offset the receiver granted. When `copy_in` returns, the bytes are in the receiver's memory,
visible to it, so the sender may tell it so. Two kinds of memory keep this contract:
- "cuda" (cuda_memory.py): an allocation on a GPU, mapped through a CUDA IPC memory handle; shards
  are copied device to device (a host shard is uploaded once). Needs cupy and a GPU.
- "shm": host memory in a POSIX shared-memory segment (`multiprocessing.shared_memory`). It is a
  real implementation, not a stand-in: every test of the protocol runs on it on CPU, and it makes
  cuda_ipc a same-node host transport on a machine without a GPU.
"""

from __future__ import annotations

import mmap
import os
import struct
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from transfer.transport import Buffer, IncompatiblePeer, as_bytes_view

if TYPE_CHECKING:
    import torch

KINDS = ("shm", "cuda")


class SharedArena(Protocol):
    """The receiver's side: `size_bytes` of memory that peers on this node can map."""

    kind: str
    size_bytes: int

    def handle(self) -> bytes:
        """What a peer passes to `open_arena` to map this memory (small, opaque)."""
        ...

    def view(self, offset: int, num_bytes: int) -> "memoryview | torch.Tensor":
        """The bytes at `offset`: a memoryview (host) or a uint8 tensor on the arena's GPU."""
        ...

    def close(self) -> None:
        """Frees the memory; views and peers' mappings must not be used afterwards. Idempotent."""
        ...


class MappedArena(Protocol):
    """A peer's arena mapped into this process."""

    size_bytes: int

    def copy_in(self, offset: int, shard: Buffer) -> None:
        """Copies `shard` (host bytes or a uint8 tensor) to `offset`; complete and visible to the
        arena's owner when this returns."""
        ...

    def close(self) -> None:
        """Unmaps (the owner's memory stays). Idempotent."""
        ...


def create_arena(kind: str, size_bytes: int, device: "str | torch.device | None" = None) -> SharedArena:
    if kind == "shm":
        return HostArena(size_bytes)
    if kind == "cuda":
        from transfer.cuda_memory import CudaArena

        return CudaArena(size_bytes, device)
    raise ValueError(f"unknown arena kind {kind!r}; choose one of {KINDS}")


def open_arena(kind: str, handle: bytes, device: "str | torch.device | None" = None) -> MappedArena:
    """Maps a peer's arena; `device` is this process's GPU (the CUDA context to map it in).
    Raises `IncompatiblePeer` when this process cannot map that kind of memory."""
    if kind == "shm":
        return HostMapping(handle)
    if kind == "cuda":
        from transfer.cuda_memory import CudaMapping, cuda_ipc_available

        if not cuda_ipc_available():
            raise IncompatiblePeer("the peer's staging is GPU memory, and this process has no cupy or no GPU")
        return CudaMapping(handle, device)
    raise IncompatiblePeer(f"the peer's staging is of unknown kind {kind!r}")


_SHM_HANDLE = struct.Struct("<QI")  # size, owner pid; then the segment name
_SHM_DIR = "/dev/shm"


class HostArena:
    """A POSIX shared-memory segment, unlinked on `close` (or, if this process dies first, by
    multiprocessing's resource tracker)."""

    kind = "shm"

    def __init__(self, size_bytes: int) -> None:
        self._seg = shared_memory.SharedMemory(create=True, size=size_bytes)
        self.size_bytes = size_bytes
        self.buf = np.ndarray((size_bytes,), dtype=np.uint8, buffer=self._seg.buf)
        self.buf.fill(0)  # fault the pages in now, not inside a transfer
        self._closed = False

    def handle(self) -> bytes:
        return _SHM_HANDLE.pack(self.size_bytes, os.getpid()) + self._seg.name.encode()

    def view(self, offset: int, num_bytes: int) -> memoryview:
        return memoryview(self.buf[offset : offset + num_bytes])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        del self.buf
        try:
            self._seg.close()
        except BufferError:  # a view someone kept still exports it: the unlink below still frees it
            pass
        self._seg.unlink()


class HostMapping:
    kind = "shm"

    def __init__(self, handle: bytes) -> None:
        if len(handle) <= _SHM_HANDLE.size:
            raise IncompatiblePeer("malformed shared-memory handle")
        self.size_bytes, _ = _SHM_HANDLE.unpack_from(handle, 0)
        name = bytes(handle[_SHM_HANDLE.size :]).decode()
        # Mapped by hand rather than through SharedMemory(name=...), which in Python 3.11 registers
        # the segment with this process's resource tracker too, to be unlinked when we exit: only
        # the owner tracks (and unlinks) it. POSIX shared memory is /dev/shm on Linux.
        try:
            fd = os.open(os.path.join(_SHM_DIR, name.lstrip("/")), os.O_RDWR)
        except FileNotFoundError as e:
            raise IncompatiblePeer(f"shared-memory segment {name} is gone (its owner closed or died)") from e
        try:
            if os.fstat(fd).st_size < self.size_bytes:
                raise IncompatiblePeer(f"segment {name} is smaller than its handle says")
            self._mmap: mmap.mmap | None = mmap.mmap(fd, self.size_bytes)
        finally:
            os.close(fd)
        self._buf: Any = np.frombuffer(self._mmap, dtype=np.uint8)

    def copy_in(self, offset: int, shard: Buffer) -> None:
        src = np.frombuffer(as_bytes_view(shard), dtype=np.uint8)
        if offset < 0 or offset + len(src) > self.size_bytes:
            raise ValueError(f"{len(src)} bytes at {offset} overrun a peer arena of {self.size_bytes}")
        np.copyto(self._buf[offset : offset + len(src)], src)  # numpy drops the GIL for the copy

    def close(self) -> None:
        if self._mmap is None:
            return
        self._buf = None
        mapping, self._mmap = self._mmap, None
        try:
            mapping.close()
        except BufferError:  # a copy still running in another thread holds it: unmapped when collected
            pass
