"""KV transport between processes on one node: the sender copies each shard straight into the
receiver's staging arena, mapped into its own address space; on GPUs through a CUDA IPC memory
handle, device to device, with no host staging on either side.

Mental model: every endpoint is a receiver (`IpcReceiver`: one arena, one loopback control port, one
thread) and a sender (no thread of its own: `send` runs in the caller's thread). `metadata()` is an
envelope naming the node, the control port and the arena's handle; `add_peer` maps the peer's arena
(ipc_memory.py's seam: CUDA memory with cupy, or POSIX shared memory on a host without a GPU). A
`send` takes a connection of its own to the peer (idle ones are pooled), asks for room for every
shard, copies each into the room as it is granted, and says DONE; it returns when every shard is in
the receiver's arena. So concurrent sends never share a connection, and giving up is just closing it:
the receiver then reclaims the room it granted on it. A dead receiver closes or resets the
connection: `PeerGone` at once, the peer is dropped (its mapping closed) until it is added again; a
frozen one answers nothing: `TransferTimeout` at the deadline. The arena is the only receive room, so
`register_buffers` builds a new receiver (new metadata) and needs an idle endpoint; there is no send
staging, so `send_bytes` is ignored. Control sockets bind 127.0.0.1 only.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from transfer import ipc_wire as wire
from transfer.header import peek_raw_bytes
from transfer.ipc_memory import MappedArena, create_arena, open_arena
from transfer.ipc_receiver import IpcReceiver
from transfer.transport import (
    Buffer, Delivery, IncompatiblePeer, PeerGone, PeerStatsBook, SendStats, TransferError, TransferTimeout,
    TransportStats, as_bytes_view, is_tensor,
)
from transfer.units import MIB

logger = logging.getLogger(__name__)


def this_node() -> str:
    """The node id an endpoint publishes by default: the hostname."""
    return socket.gethostname()


@dataclass(frozen=True)
class CudaIpcConfig:
    recv_staging_bytes: int = 128 * MIB  # the arena; also the largest shard a peer may send us
    # Where the arena lives and where our shards are: "cuda:k" (CUDA IPC), or None / "cpu" (shared
    # host memory, the CPU path).
    device: str | None = None
    grant_ttl_s: float = 60.0  # room granted to a sender that never writes is reclaimed after this
    node: str | None = None  # None: this_node(); peers must publish the same to be added
    call_timeout_s: float = 10.0  # bounds connecting and closing


class _Link:
    """What a sender keeps per peer: its envelope, its mapped arena, idle connections."""

    def __init__(self, env: wire.IpcEnvelope, mapping: MappedArena) -> None:
        self.env = env
        self.mapping = mapping
        self.idle: list[tuple[socket.socket, wire.FrameBuffer]] = []
        self.users = 0
        self.dropped = False
        self.lock = threading.Lock()

    def enter(self) -> None:
        with self.lock:
            self.users += 1

    def leave(self) -> None:
        with self.lock:
            self.users -= 1
            last = self.dropped and self.users == 0
        if last:
            self.mapping.close()

    def drop(self) -> None:
        with self.lock:
            self.dropped = True
            idle, self.idle = self.idle, []
            last = self.users == 0
        for sock, _ in idle:
            sock.close()
        if last:
            self.mapping.close()


class CudaIpcTransport:
    kind = "cuda_ipc"

    def __init__(self, name: str, cfg: CudaIpcConfig | None = None,
                 resolver: Callable[[str], bytes | None] | None = None) -> None:
        self.name = name
        self.cfg = cfg or CudaIpcConfig()
        self.node = self.cfg.node or this_node()
        self.memory = "cuda" if self.cfg.device not in (None, "cpu") else "shm"
        self.device_shards = self.memory == "cuda"  # see transport.takes_device_shards
        self._resolver = resolver
        self._incarnation = int.from_bytes(os.urandom(8), "little")
        self._send_ids = itertools.count(int.from_bytes(os.urandom(4), "little") << 20)
        self._book = PeerStatsBook()
        self._lock = threading.Lock()  # guards _links, _receiver, _sends
        self._links: dict[str, _Link] = {}
        self._sends = 0
        self._closed = False
        self._receiver: IpcReceiver | None = None
        self._envelope = b""
        self.register_buffers(0, self.cfg.recv_staging_bytes)

    # ------------------------------------------------------------------ setup and peers
    def register_buffers(self, send_bytes: int, recv_bytes: int) -> None:
        with self._lock:
            old = self._receiver
            if old is not None and (old.room.in_use_bytes or not old.inbox.empty() or old.num_grants):
                raise RuntimeError("register_buffers needs an idle transport")
            arena = create_arena(self.memory, recv_bytes, self.cfg.device)
            try:
                new = IpcReceiver(self.name, arena, self.cfg.grant_ttl_s)
            except BaseException:
                arena.close()
                raise
            self._receiver = new
            self._envelope = wire.IpcEnvelope(self.name, self._incarnation, self.node, new.port, self.memory,
                                           arena.size_bytes, arena.handle()).pack()
        if old is not None:
            self._close_receiver(old)

    def metadata(self) -> bytes:
        return self._envelope

    def add_peer(self, metadata: bytes) -> str:
        env = wire.IpcEnvelope.unpack(metadata)
        if env.node != self.node:
            raise IncompatiblePeer(f"{env.name} is on node {env.node!r}, not {self.node!r}: cuda_ipc is for one node")
        if env.name == self.name:
            raise ValueError(f"{self.name} cannot add itself as a peer")
        with self._lock:
            old = self._links.get(env.name)
            if old is not None and old.env == env:
                return env.name  # the same incarnation again
        mapping = open_arena(env.memory, env.handle, self.cfg.device if self.memory == "cuda" else None)
        with self._lock:
            old = self._links.get(env.name)
            self._links[env.name] = _Link(env, mapping)
        if old is not None:
            old.drop()  # a newer incarnation replaces it
        return env.name

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            link = self._links.pop(peer, None)
        if link is not None:
            link.drop()

    def _link(self, peer: str) -> _Link:
        if self._closed:
            raise PeerGone(f"transport {self.name} is closed")
        with self._lock:
            link = self._links.get(peer)
        if link is None:
            md = self._resolver(peer) if self._resolver is not None else None
            if md is None:
                raise PeerGone(f"{peer} is not a peer of {self.name}: add its metadata first")
            self.add_peer(md)
            with self._lock:
                link = self._links.get(peer)
            if link is None:
                raise PeerGone(f"{peer} was removed while it was being added")
        link.enter()
        return link

    def _forget(self, peer: str, link: _Link) -> None:
        with self._lock:
            if self._links.get(peer) is link:
                del self._links[peer]
        link.drop()

    # ------------------------------------------------------------------ sending
    def send(self, peer: str, shards: Sequence[Buffer], *, tag: int = 0, timeout_s: float) -> SendStats:
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        # a device shard travels as it is; host bytes are read where they are
        srcs = [s.reshape(-1) if is_tensor(s) else as_bytes_view(s) for s in shards]
        if any(is_tensor(s) and s.element_size() != 1 for s in srcs):
            raise ValueError("a tensor shard is uint8 (the codec's `encode(..., device=)` makes them)")
        sizes = [len(s) for s in srcs]
        try:
            link = self._link(peer)
        except TransferError as e:
            self._book.failed(peer, e)
            raise
        try:
            if not srcs or max(sizes) > link.env.arena_bytes:
                raise ValueError(f"send needs 1+ shards of at most {link.env.arena_bytes} bytes ({peer}'s receive staging)")
            with self._lock:
                self._sends += 1
            try:
                self._send_on(link, peer, srcs, sizes, tag, deadline)
            finally:
                with self._lock:
                    self._sends -= 1
        except PeerGone as e:
            self._forget(peer, link)
            self._book.failed(peer, e)
            raise
        except TransferTimeout as e:
            self._book.failed(peer, e)
            raise
        finally:
            link.leave()
        raw = sum(peek_raw_bytes(s) or n for s, n in zip(srcs, sizes))
        stats = SendStats(peer, len(srcs), sum(sizes), raw, time.monotonic() - t0)
        self._book.sent(stats)
        return stats

    def _send_on(self, link: _Link, peer: str, srcs: list, sizes: list[int], tag: int, deadline: float) -> None:
        sock, frames = self._checkout(link, peer, deadline)
        ok = False
        try:
            send_id, pending = next(self._send_ids), []  # type: ignore[var-annotated]
            sock.sendall(b"".join(wire.shard_frame(wire.FrameKind.REQ, send_id, i, len(srcs), tag, n)
                                  for i, n in enumerate(sizes)))
            done = 0
            while done < len(srcs):
                f = wire.read_frame(sock, frames, pending, deadline, peer)
                answers = (wire.FrameKind.GRANT, wire.FrameKind.REFUSE)
                if f.send_id != send_id or f.kind not in answers or f.shard >= len(srcs):
                    raise PeerGone(f"{peer} answered out of turn ({f.kind.name} for send {f.send_id})")
                if f.kind is wire.FrameKind.REFUSE:
                    raise ValueError(f"{peer} refused a shard of {sizes[f.shard]} bytes (room {f.value})")
                if f.value + sizes[f.shard] > link.env.arena_bytes:
                    raise PeerGone(f"{peer} granted room outside its arena")
                link.mapping.copy_in(f.value, srcs[f.shard])
                sock.sendall(wire.shard_frame(wire.FrameKind.DONE, send_id, f.shard))
                done += 1
            ok = True
        except OSError as e:  # sendall to a receiver that died
            raise PeerGone(f"{peer}: connection failed: {e}") from e
        finally:
            if ok and not pending:
                with link.lock:
                    if not link.dropped:
                        link.idle.append((sock, frames))
                        sock = None  # type: ignore[assignment]
            if sock is not None:
                sock.close()  # the receiver reclaims whatever it granted on it

    def _checkout(self, link: _Link, peer: str, deadline: float) -> tuple[socket.socket, wire.FrameBuffer]:
        with link.lock:
            if link.idle:
                return link.idle.pop()
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"send to {peer} passed its deadline before it started")
        try:
            sock = socket.create_connection(("127.0.0.1", link.env.port), timeout=min(left, self.cfg.call_timeout_s))
        except socket.timeout:
            raise TransferTimeout(f"{peer} did not accept a connection before the deadline") from None
        except OSError as e:
            raise PeerGone(f"{peer} does not accept connections (gone?): {e}") from e
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.sendall(wire.hello(self.name, self._incarnation))
        except OSError as e:
            sock.close()
            raise PeerGone(f"{peer}: connection failed: {e}") from e
        return sock, wire.FrameBuffer()

    # ------------------------------------------------------------------ receiving
    def recv(self, timeout_s: float) -> Delivery:
        receiver = self._receiver
        if receiver is None or self._closed:
            raise TransferTimeout(f"{self.name} is closed")
        try:
            peer, tag, shard, n, off, size = receiver.inbox.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            raise TransferTimeout(f"{self.name}: no shard arrived within {timeout_s:.3f}s") from None
        self._book.received(peer, size)
        return Delivery(peer, tag, shard, n, receiver.arena.view(off, size), lambda: receiver.release(off))

    # ------------------------------------------------------------------ stats, close
    def stats(self) -> TransportStats:
        with self._lock:
            receiver, peers, sends = self._receiver, tuple(sorted(self._links)), self._sends
        in_use = receiver.room.in_use_bytes if receiver is not None else 0
        grants = receiver.num_grants if receiver is not None else 0
        size = receiver.arena.size_bytes if receiver is not None and not self._closed else 0
        return TransportStats(self.name, self.kind, self._book.snapshot(), connected_peers=peers,
                              transfers_in_flight=sends + grants, staging_in_use_bytes=in_use, registered_bytes=size)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            links, self._links = list(self._links.values()), {}
            receiver = self._receiver
        for link in links:
            link.drop()
        if receiver is not None:
            self._close_receiver(receiver)

    def _close_receiver(self, receiver: IpcReceiver) -> None:
        if receiver.close(self.cfg.call_timeout_s):
            receiver.arena.close()
        else:
            logger.error("%s: cuda_ipc receiver thread is stuck; leaving its arena to the process exit", self.name)
