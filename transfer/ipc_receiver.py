"""The receiving half of a cuda_ipc endpoint: one arena, one control port, one thread.

Mental model: a single thread owns every receiver-side decision. It `select`s over the listening
socket (127.0.0.1 only), the senders' connections and a wake-up socket; it reads REQs into one
first-come first-served queue, grants room in the arena as releases free it, turns DONEs into
arrivals for `recv`, and reclaims the room of a connection that closed (a sender that gave up, died,
or finished) or that held a grant past `grant_ttl_s` without writing it (a frozen sender; the
connection is closed too, so it cannot write later). `release` may run on any thread, even in a
garbage-collector finalizer: it only queues the offset and pokes the wake-up socket.
"""

from __future__ import annotations

import collections
import logging
import queue
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field

from transfer import ipc_wire as wire
from transfer.ipc_memory import SharedArena
from transfer.staging import RegionAllocator

logger = logging.getLogger(__name__)
_TICK_S = 0.05  # the thread wakes at least this often to sweep stale grants


@dataclass
class _Grant:
    offset: int
    size: int
    tag: int
    num_shards: int
    granted_at: float


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    frames: wire.FrameBuffer = field(default_factory=wire.FrameBuffer)
    peer: str | None = None  # from its HELLO
    grants: dict[tuple[int, int], _Grant] = field(default_factory=dict)  # (send_id, shard) -> room


@dataclass(frozen=True)
class _Req:
    conn: _Conn
    send_id: int
    shard: int
    num_shards: int
    tag: int
    size: int


# (sender, tag, shard, num_shards, offset, size): one arrived shard, for `recv`
Arrival = tuple[str, int, int, int, int, int]


class IpcReceiver:
    def __init__(self, name: str, arena: SharedArena, grant_ttl_s: float) -> None:
        self.name = name
        self.arena = arena
        self.room = RegionAllocator(arena.size_bytes)
        self.grant_ttl_s = grant_ttl_s
        self.inbox: queue.Queue[Arrival] = queue.Queue()
        self._freed: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._pending: collections.deque[_Req] = collections.deque()
        self._conns: dict[socket.socket, _Conn] = {}
        self._num_grants = 0  # granted, not yet DONE; read by stats from other threads
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ipc-recv-{name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread
    def release(self, offset: int) -> None:
        self._freed.put(offset)
        self._poke()

    @property
    def num_grants(self) -> int:
        return self._num_grants

    def close(self, timeout_s: float) -> bool:
        """Stops the thread and closes every socket; False if the thread did not stop in time."""
        self._stop.set()
        self._poke()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return False
        for conn in list(self._conns.values()):
            self._drop(conn, "receiver closed")
        self._sel.close()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()
        return True

    def _poke(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake-up is pending anyway) or closed

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for key, _ in self._sel.select(_TICK_S):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        self._wake_r.recv(4096)
                    else:
                        self._read(key.data)
                while True:
                    try:
                        self.room.free(self._freed.get_nowait())
                    except queue.Empty:
                        break
                self._grant_pending()
                self._sweep(time.monotonic())
            except Exception:  # a bug here must not silently stop every transfer
                logger.exception("%s: cuda_ipc receiver step failed", self.name)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(1.0)  # bounds a GRANT write to a sender that stopped reading
        conn = _Conn(sock)
        self._conns[sock] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
            frames = conn.frames.feed(data) if data else None
        except (OSError, ValueError) as e:
            self._drop(conn, f"connection failed: {e}")
            return
        if frames is None:
            self._drop(conn, "closed by the sender")
            return
        for body in frames:
            try:
                f = wire.parse(body)
            except ValueError as e:
                self._drop(conn, f"malformed frame: {e}")
                return
            if f.kind is wire.FrameKind.HELLO:
                conn.peer = f.name
            elif conn.peer is None:
                self._drop(conn, f"{f.kind.name} before HELLO")
                return
            elif f.kind is wire.FrameKind.REQ:
                self._pending.append(_Req(conn, f.send_id, f.shard, f.num_shards, f.tag, f.value))
            elif f.kind is wire.FrameKind.DONE:
                g = conn.grants.pop((f.send_id, f.shard), None)
                if g is None:
                    self._drop(conn, f"DONE for room it does not hold (send {f.send_id} shard {f.shard})")
                    return
                self._num_grants -= 1
                self.inbox.put((conn.peer, g.tag, f.shard, g.num_shards, g.offset, g.size))
            else:
                self._drop(conn, f"unexpected {f.kind.name}")
                return

    def _grant_pending(self) -> None:
        while self._pending:
            req = self._pending[0]
            if req.conn.sock not in self._conns:  # its sender went away meanwhile
                self._pending.popleft()
                continue
            if req.size > self.room.size_bytes:
                self._pending.popleft()
                self._say(req.conn, wire.shard_frame(wire.FrameKind.REFUSE, req.send_id, req.shard,
                                                     value=self.room.size_bytes))
                continue
            offset = self.room.try_alloc(req.size)
            if offset is None:
                return  # first come, first served: later requests wait behind this one
            self._pending.popleft()
            req.conn.grants[(req.send_id, req.shard)] = _Grant(offset, req.size, req.tag, req.num_shards,
                                                               time.monotonic())
            self._num_grants += 1
            self._say(req.conn, wire.shard_frame(wire.FrameKind.GRANT, req.send_id, req.shard, value=offset))

    def _say(self, conn: _Conn, frame: bytes) -> None:
        try:
            conn.sock.sendall(frame)
        except OSError as e:
            self._drop(conn, f"cannot answer: {e}")

    def _sweep(self, now: float) -> None:
        for conn in list(self._conns.values()):
            if any(now - g.granted_at > self.grant_ttl_s for g in conn.grants.values()):
                logger.warning("%s: %s held room for %.0fs without writing it; dropping its connection",
                               self.name, conn.peer, self.grant_ttl_s)
                self._drop(conn, "grant expired")

    def _drop(self, conn: _Conn, why: str) -> None:
        """Forgets a connection: its unwritten room comes back, its queued requests go."""
        if self._conns.pop(conn.sock, None) is None:
            return
        logger.debug("%s: connection from %s ends: %s", self.name, conn.peer, why)
        for g in conn.grants.values():
            self.room.free(g.offset)
        self._num_grants -= len(conn.grants)
        conn.grants.clear()
        self._pending = collections.deque(r for r in self._pending if r.conn is not conn)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
