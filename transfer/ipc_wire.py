"""What cuda_ipc endpoints say to each other: the published metadata envelope and the control frames
of its loopback TCP channel. Fixed binary structs, never pickle; the data itself never rides here.

One sender connection (S) to a receiver (R), used by one `send` at a time:
    S -> R  HELLO(name, incarnation)        first frame of every connection: who S is
    S -> R  REQ(send, shard, n, tag, size)  one per shard: room please
    R -> S  GRANT(send, shard, offset)      room reserved in R's arena (REFUSE: it can never fit)
    S       copy_in(offset, shard)          straight into R's arena, mapped in S (no wire)
    S -> R  DONE(send, shard)               the bytes are there: R hands the shard out
A closed connection is the cancel: R reclaims every room it granted on it and not yet DONE.
Frames: u32 length, then the body, whose first byte is its kind.
"""

from __future__ import annotations

import enum
import socket
import struct
import time
from dataclasses import dataclass

from transfer.transport import IncompatiblePeer, PeerGone, TransferTimeout

MAGIC = b"FKVI"
VERSION = 1
MEMORY_KINDS = ("shm", "cuda")

_ENVELOPE = struct.Struct("<4sHBxQHQHHI")  # magic, version, memory kind, incarnation, port, arena size, lengths


@dataclass(frozen=True)
class IpcEnvelope:
    """What `CudaIpcTransport.metadata()` publishes."""

    name: str
    incarnation: int  # random per endpoint start: a restarted peer is told from the old one
    node: str  # hostname (or the id a deployment sets): IPC reaches peers on this node only
    port: int  # control channel on 127.0.0.1
    memory: str  # "shm" or "cuda": the kind of the receive arena
    arena_bytes: int
    handle: bytes  # the arena's handle (ipc_memory.SharedArena.handle)

    def pack(self) -> bytes:
        name, node = self.name.encode(), self.node.encode()
        head = _ENVELOPE.pack(MAGIC, VERSION, MEMORY_KINDS.index(self.memory), self.incarnation, self.port,
                              self.arena_bytes, len(name), len(node), len(self.handle))
        return head + name + node + self.handle

    @classmethod
    def unpack(cls, data: bytes) -> "IpcEnvelope":
        if len(data) < _ENVELOPE.size or bytes(data[:4]) != MAGIC:
            raise IncompatiblePeer("not cuda_ipc transport metadata (a peer of another transport kind?)")
        magic, version, memory, inc, port, size, name_len, node_len, handle_len = _ENVELOPE.unpack_from(data, 0)
        if version != VERSION or memory >= len(MEMORY_KINDS):
            raise IncompatiblePeer(f"cuda_ipc metadata of version {version} (memory {memory}); this side speaks {VERSION}")
        at = _ENVELOPE.size
        if len(data) != at + name_len + node_len + handle_len:
            raise IncompatiblePeer("cuda_ipc metadata is truncated")
        name = bytes(data[at : at + name_len]).decode()
        node = bytes(data[at + name_len : at + name_len + node_len]).decode()
        handle = bytes(data[at + name_len + node_len :])
        return cls(name, inc, node, port, MEMORY_KINDS[memory], size, handle)


class FrameKind(enum.IntEnum):
    HELLO = 1
    REQ = 2
    GRANT = 3
    REFUSE = 4
    DONE = 5


_LEN = struct.Struct("<I")
_SHARD = struct.Struct("<BQIIQQ")  # kind, send_id, shard, num_shards, tag, value (REQ size | GRANT offset | REFUSE room)
_HELLO = struct.Struct("<BQ")  # kind, incarnation; then the name
MAX_FRAME = 4096


@dataclass(frozen=True)
class Frame:
    kind: FrameKind
    send_id: int = 0
    shard: int = 0
    num_shards: int = 0
    tag: int = 0
    value: int = 0
    name: str = ""  # HELLO only
    incarnation: int = 0  # HELLO only


def hello(name: str, incarnation: int) -> bytes:
    body = _HELLO.pack(FrameKind.HELLO, incarnation) + name.encode()
    return _LEN.pack(len(body)) + body


def shard_frame(kind: FrameKind, send_id: int, shard: int, num_shards: int = 0, tag: int = 0,
                value: int = 0) -> bytes:
    return _LEN.pack(_SHARD.size) + _SHARD.pack(kind, send_id, shard, num_shards, tag, value)


def parse(body: bytes) -> Frame:
    """Raises ValueError on anything malformed."""
    if not body:
        raise ValueError("empty control frame")
    kind = FrameKind(body[0])
    if kind is FrameKind.HELLO:
        _, inc = _HELLO.unpack_from(body, 0)
        return Frame(kind, name=bytes(body[_HELLO.size :]).decode(), incarnation=inc)
    _, send_id, shard, n, tag, value = _SHARD.unpack(body)
    return Frame(kind, send_id, shard, n, tag, value)


class FrameBuffer:
    """Reassembles frames from whatever pieces a stream socket hands over."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        frames = []
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf, 0)
            if n == 0 or n > MAX_FRAME:
                raise ValueError(f"control frame of {n} bytes")
            if len(self._buf) < _LEN.size + n:
                break
            frames.append(bytes(self._buf[_LEN.size : _LEN.size + n]))
            del self._buf[: _LEN.size + n]
        return frames


def read_frame(sock: socket.socket, buf: FrameBuffer, pending: list[bytes], deadline: float, peer: str) -> Frame:
    """The next frame on a blocking socket, by `deadline` (time.monotonic): `TransferTimeout` after
    it, `PeerGone` when the peer closed or reset the connection."""
    while not pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"{peer} did not answer before the deadline")
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except socket.timeout:
            raise TransferTimeout(f"{peer} did not answer before the deadline") from None
        except OSError as e:
            raise PeerGone(f"{peer}: connection failed: {e}") from e
        if not data:
            raise PeerGone(f"{peer} closed the connection (died or closed)")
        try:
            pending.extend(buf.feed(data))
        except ValueError as e:
            raise PeerGone(f"{peer} sent garbage: {e}") from e
    try:
        return parse(pending.pop(0))
    except ValueError as e:
        raise PeerGone(f"{peer} sent garbage: {e}") from e
