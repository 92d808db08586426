"""GPU receive staging shared through CUDA IPC memory handles: the "cuda" kind of ipc_memory.py's seam.

Mental model: the receiver `cudaMalloc`s one arena (its own allocation, never a slice of a caching
allocator's pool, so the IPC handle names exactly it) and publishes the 64-byte handle. A sender on
the same node opens it (`cudaIpcOpenMemHandle`, peer access enabled lazily) and gets a pointer valid
in its own address space; a shard is then one `cudaMemcpyAsync` on the stream the shard was made on,
device to device (over NVLink or PCIe peer-to-peer when the GPUs differ), and the sender waits for
that stream before it tells the receiver the shard is in. A host shard is uploaded the same way.
Within one process an arena is used directly: CUDA refuses to open a handle of one's own memory.

cupy is imported on first use only (the `[gpu]` extra); torch wraps the arena for `view` via DLPack,
so a Delivery's data is an ordinary uint8 CUDA tensor.
"""

from __future__ import annotations

import os
import struct
import warnings
from typing import TYPE_CHECKING, Any

from transfer.transport import Buffer, IncompatiblePeer, as_bytes_view, is_tensor

if TYPE_CHECKING:
    import torch

_HANDLE = struct.Struct("<QQIi")  # size, base pointer (in the owner), owner pid, device; then the IPC handle
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: UVA tells host from device and peer from local


def cuda_ipc_available() -> bool:
    """Whether this process can share GPU memory: cupy imports and sees a CUDA device."""
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:  # ImportError, or a CUDA runtime that fails to load
        return False


def _device_index(device: "str | torch.device | None") -> int:
    import torch

    if device is None:
        return torch.cuda.current_device()
    d = torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"a CUDA arena lives on a CUDA device, not on {d}")
    return d.index if d.index is not None else torch.cuda.current_device()


def _as_tensor(ptr: int, size_bytes: int, device: int, owner: Any) -> "torch.Tensor":
    """A uint8 torch tensor over `size_bytes` at `ptr` on `device`, keeping `owner` alive."""
    import cupy
    import torch

    mem = cupy.cuda.UnownedMemory(ptr, size_bytes, owner, device)
    arr = cupy.ndarray((size_bytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    return torch.from_dlpack(arr)


class CudaArena:
    kind = "cuda"

    def __init__(self, size_bytes: int, device: "str | torch.device | None" = None) -> None:
        import cupy

        self.size_bytes = size_bytes
        self.device = _device_index(device)
        with cupy.cuda.Device(self.device):
            self._ptr = int(cupy.cuda.runtime.malloc(size_bytes))
            try:
                self._ipc = bytes(cupy.cuda.runtime.ipcGetMemHandle(self._ptr))
                cupy.cuda.runtime.memset(self._ptr, 0, size_bytes)
                self.tensor: Any = _as_tensor(self._ptr, size_bytes, self.device, None)
            except BaseException:
                cupy.cuda.runtime.free(self._ptr)
                raise
        self._closed = False

    def handle(self) -> bytes:
        return _HANDLE.pack(self.size_bytes, self._ptr, os.getpid(), self.device) + self._ipc

    def view(self, offset: int, num_bytes: int) -> "torch.Tensor":
        return self.tensor[offset : offset + num_bytes]

    def close(self) -> None:
        if self._closed:
            return
        import cupy

        self._closed = True
        self.tensor = None
        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.deviceSynchronize()  # no copy into it may still be running here
            cupy.cuda.runtime.free(self._ptr)


class CudaMapping:
    kind = "cuda"

    def __init__(self, handle: bytes, device: "str | torch.device | None" = None) -> None:
        import cupy

        if len(handle) <= _HANDLE.size:
            raise IncompatiblePeer("malformed CUDA IPC handle")
        self.size_bytes, base, pid, _owner_device = _HANDLE.unpack_from(handle, 0)
        self.device = _device_index(device)  # our context: where our shards are
        self._opened = pid != os.getpid()
        if not self._opened:
            self._ptr: int | None = base  # our own arena: CUDA will not open it through IPC
            return
        try:
            with cupy.cuda.Device(self.device):
                self._ptr = int(cupy.cuda.runtime.ipcOpenMemHandle(bytes(handle[_HANDLE.size :])))
        except cupy.cuda.runtime.CUDARuntimeError as e:
            raise IncompatiblePeer(f"cannot open the peer's CUDA IPC handle (another node or container?): {e}") from e

    def copy_in(self, offset: int, shard: Buffer) -> None:
        import cupy
        import torch

        if self._ptr is None:
            raise ValueError("copy into a closed mapping")
        if is_tensor(shard) and shard.is_cuda:  # type: ignore[union-attr]
            src = shard.reshape(-1)  # type: ignore[union-attr]
            if not src.is_contiguous() or src.dtype != torch.uint8:
                raise ValueError("a device shard is a contiguous uint8 tensor")
            n, device = src.numel(), src.device.index
            stream = torch.cuda.current_stream(src.device)  # the stream the codec wrote the shard on
        else:
            host = memoryview(as_bytes_view(shard))
            with warnings.catch_warnings():  # a read-only buffer is fine: it is only read
                warnings.simplefilter("ignore", UserWarning)
                src = torch.frombuffer(host, dtype=torch.uint8) if len(host) else torch.empty(0, dtype=torch.uint8)
            n, device = src.numel(), self.device
            stream = torch.cuda.current_stream(device)
        if offset < 0 or offset + n > self.size_bytes:
            raise ValueError(f"{n} bytes at {offset} overrun a peer arena of {self.size_bytes}")
        with cupy.cuda.Device(device):
            cupy.cuda.runtime.memcpyAsync(self._ptr + offset, src.data_ptr(), n, _MEMCPY_DEFAULT, stream.cuda_stream)
            cupy.cuda.runtime.streamSynchronize(stream.cuda_stream)  # in the peer's memory before we say so

    def close(self) -> None:
        if self._ptr is None:
            return
        import cupy

        ptr, self._ptr = self._ptr, None
        if self._opened:
            with cupy.cuda.Device(self.device):
                try:
                    cupy.cuda.runtime.ipcCloseMemHandle(ptr)
                except cupy.cuda.runtime.CUDARuntimeError:
                    pass  # the owner is gone and took the memory with it
