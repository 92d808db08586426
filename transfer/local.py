"""In-process transport: endpoints in one Python process hand each other copies of shards.

Mental model: a process-wide directory maps a name to a live endpoint; `metadata()` is just the name
and an incarnation, so a closed-and-recreated endpoint of the same name is told apart. Each
endpoint has a bounded inbox (`recv_bytes`), so a slow receiver pushes back on its senders and a
deadline passes exactly as it would over a real wire. For unit tests and single-process setups.
"""

from __future__ import annotations

import collections
import os
import struct
import threading
import time
import weakref
from collections.abc import Sequence

from transfer.header import peek_raw_bytes
from transfer.transport import (
    Buffer,
    Delivery,
    IncompatiblePeer,
    PeerGone,
    PeerStatsBook,
    SendStats,
    TransferError,
    TransferTimeout,
    TransportStats,
    as_bytes_view,
)
from transfer.units import MIB

_MAGIC = b"FKVL"
_DIRECTORY: "weakref.WeakValueDictionary[str, LocalTransport]" = weakref.WeakValueDictionary()
_DIRECTORY_LOCK = threading.Lock()


class LocalTransport:
    kind = "local"

    def __init__(self, name: str, recv_bytes: int = 128 * MIB) -> None:
        self.name = name
        self._incarnation = int.from_bytes(os.urandom(8), "little")
        self._cond = threading.Condition()
        self._inbox: collections.deque[tuple[str, int, int, int, bytearray]] = collections.deque()
        self._inbox_bytes = 0
        self._recv_bytes = recv_bytes
        self._peers: dict[str, int] = {}  # name -> incarnation we were given
        self._book = PeerStatsBook()
        self._closed = False
        with _DIRECTORY_LOCK:
            _DIRECTORY[name] = self

    def register_buffers(self, send_bytes: int, recv_bytes: int) -> None:
        with self._cond:
            self._recv_bytes = recv_bytes  # nothing to pin in one process: only the inbox bound

    def metadata(self) -> bytes:
        return _MAGIC + struct.pack("<Q", self._incarnation) + self.name.encode()

    def add_peer(self, metadata: bytes) -> str:
        if metadata[:4] != _MAGIC or len(metadata) < 12:
            raise IncompatiblePeer("not local-transport metadata (a peer of another transport kind?)")
        (incarnation,) = struct.unpack_from("<Q", metadata, 4)
        name = bytes(metadata[12:]).decode()
        with self._cond:
            self._peers[name] = incarnation
        return name

    def remove_peer(self, peer: str) -> None:
        with self._cond:
            self._peers.pop(peer, None)

    def _target(self, peer: str) -> "LocalTransport":
        with self._cond:
            incarnation = self._peers.get(peer)
        with _DIRECTORY_LOCK:
            target = _DIRECTORY.get(peer)
        if incarnation is None or target is None or target._closed or target._incarnation != incarnation:
            self.remove_peer(peer)
            raise PeerGone(f"{peer} is not a live peer of {self.name}")
        return target

    def send(self, peer: str, shards: Sequence[Buffer], *, tag: int = 0, timeout_s: float) -> SendStats:
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        views = [as_bytes_view(s) for s in shards]
        try:
            target = self._target(peer)
            for i, v in enumerate(views):
                target._put(self.name, tag, i, len(views), bytearray(v), deadline)
        except TransferError as e:
            self._book.failed(peer, e)
            raise
        raw = sum(peek_raw_bytes(v) or len(v) for v in views)
        stats = SendStats(peer, len(views), sum(len(v) for v in views), raw, time.monotonic() - t0)
        self._book.sent(stats)
        return stats

    def _put(self, sender: str, tag: int, index: int, count: int, data: bytearray, deadline: float) -> None:
        if len(data) > self._recv_bytes:
            raise ValueError(f"a shard of {len(data)} bytes exceeds {self.name}'s receive room ({self._recv_bytes})")
        with self._cond:
            while self._inbox_bytes + len(data) > self._recv_bytes:
                left = deadline - time.monotonic()
                if self._closed:
                    raise PeerGone(f"{self.name} closed")
                if left <= 0:
                    raise TransferTimeout(f"{self.name} had no room for a shard of {len(data)} bytes in time")
                self._cond.wait(left)
            if self._closed:
                raise PeerGone(f"{self.name} closed")
            self._inbox.append((sender, tag, index, count, data))
            self._inbox_bytes += len(data)
            self._cond.notify_all()

    def recv(self, timeout_s: float) -> Delivery:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._inbox:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise TransferTimeout(f"{self.name}: no shard arrived within {timeout_s:.3f}s")
                self._cond.wait(left)
            sender, tag, index, count, data = self._inbox.popleft()
        self._book.received(sender, len(data))

        def release() -> None:
            with self._cond:
                self._inbox_bytes -= len(data)
                self._cond.notify_all()

        return Delivery(sender, tag, index, count, memoryview(data), release)

    def stats(self) -> TransportStats:
        with self._cond:
            in_use, peers = self._inbox_bytes, tuple(sorted(self._peers))
        return TransportStats(self.name, self.kind, self._book.snapshot(), connected_peers=peers,
                              staging_in_use_bytes=in_use)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        with _DIRECTORY_LOCK:
            if _DIRECTORY.get(self.name) is self:
                del _DIRECTORY[self.name]
