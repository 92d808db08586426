"""The single-threaded heart of the NIXL transport: one agent, its staging, its peers, and the state
of every send and every granted receive room. Only `NixlTransport`'s worker thread calls it.

Mental model: `step()` is one turn of a polling loop. It reads notifications (HELLO, REQ, GRANT,
DATA, CANCEL, PING: see nixl_wire.py), grants receive room first-come first-served, posts a WRITE
for every segment that is both copied into send staging and granted room, retires finished WRITEs,
and fails sends past their deadline. Any NIXL exception that involves a peer drops that peer whole:
its sends fail with `PeerGone`, its transfer handles are released, the room it was granted is
reclaimed, and its agent metadata is removed.
"""

from __future__ import annotations

import logging
import queue
from collections import deque
from typing import Any

from transfer import nixl_wire as wire
from transfer.nixl_records import Grant, Outgoing, RoomRequest
from transfer.staging import StagingArena
from transfer.transport import PeerGone, TransferError, TransferTimeout

logger = logging.getLogger(__name__)


def staging_regions(*arenas: StagingArena) -> list[tuple[int, int, int, str]]:
    """NIXL registration tuples (addr, len, dev_id, ""): device 0 for host memory, as NIXL expects;
    the memory type to register them under is the arenas' own `mem_type` (DRAM or VRAM)."""
    assert len({a.mem_type for a in arenas}) == 1, "one registration holds one memory type"
    return [(a.base_addr, a.size_bytes, a.dev_id or 0, "") for a in arenas]


class NixlEndpoint:
    def __init__(self, name: str, agent: Any, incarnation: int, probe_interval_s: float, grant_ttl_s: float,
                 segment_bytes: int, staging_device: str | None = None) -> None:
        self.name = name
        self.staging_device = staging_device  # None: host staging (DRAM); "cuda:k": device staging (VRAM)
        self.segment_bytes = segment_bytes
        self.agent = agent
        self.incarnation = incarnation
        self.probe_interval_s = probe_interval_s
        self.grant_ttl_s = grant_ttl_s
        self.peers: dict[str, wire.NixlEnvelope] = {}
        self.sends: dict[int, Outgoing] = {}
        self.pending: deque[RoomRequest] = deque()
        self.grants: dict[tuple[str, int, int], Grant] = {}
        # (handles NIXL would not release yet, send staging offset they still use)
        self.zombies: list[tuple[list[Any], int]] = []
        # arrived shards: (peer, tag, shard, num_shards, offset, size); `recv` takes them
        self.inbox: queue.Queue[tuple[str, int, int, int, int, int]] = queue.Queue()
        self.send_arena: StagingArena | None = None
        self.recv_arena: StagingArena | None = None
        self.envelope = b""
        self._reg: Any = None
        self._last_sweep = 0.0

    # ------------------------------------------------------------------ setup and peers
    def register(self, send_bytes: int, recv_bytes: int) -> None:
        busy = self.recv_arena is not None and self.recv_arena.in_use_bytes > 0  # unreleased deliveries
        if busy or self.sends or self.grants or self.pending or not self.inbox.empty():
            raise RuntimeError("register_buffers needs an idle transport")
        self.deregister()
        self.send_arena = StagingArena(send_bytes, self.staging_device)
        self.recv_arena = StagingArena(recv_bytes, self.staging_device)
        self._reg = self.agent.register_memory(staging_regions(self.send_arena, self.recv_arena),
                                               self.send_arena.mem_type)
        self.envelope = wire.NixlEnvelope(
            self.name, self.incarnation, self.recv_arena.base_addr, self.recv_arena.size_bytes,
            self.agent.get_agent_metadata(), self.recv_arena.dev_id,
        ).pack()

    def deregister(self) -> None:
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None

    def add(self, env: wire.NixlEnvelope, say_hello: bool) -> None:
        if env.name == self.name:
            raise ValueError(f"{self.name} cannot add itself as a peer")
        old = self.peers.get(env.name)
        if old == env:
            return  # the same incarnation again (both sides added each other)
        if old is not None:
            self.drop_peer(env.name, "replaced by a newer incarnation")
        self.agent.add_remote_agent(env.agent_metadata)
        self.peers[env.name] = env
        if say_hello:
            try:
                self.agent.make_connection(env.name)  # else the first transfer pays for it
                self.agent.send_notif(env.name, wire.hello(self.envelope))
            except Exception as e:
                self.drop_peer(env.name, f"HELLO failed: {e}")
                raise PeerGone(f"{env.name} did not answer: {e}") from e

    def drop_peer(self, name: str, why: str, expected: bool = False) -> None:
        if name in self.peers:
            logger.log(logging.INFO if expected else logging.WARNING, "%s: dropping peer %s: %s", self.name, name, why)
        for op in [op for op in self.sends.values() if op.peer == name]:
            op.finish(PeerGone(f"{name}: {why}"))
            self.cleanup(op)
        self.pending = deque(r for r in self.pending if r.peer != name)
        self._reclaim([g for g in self.grants.values() if g.peer == name])
        if self.peers.pop(name, None) is not None:
            self.forget_remote(name)

    def forget_remote(self, name: str) -> None:
        try:
            self.agent.remove_remote_agent(name)
        except Exception as e:  # already gone on NIXL's side: nothing left to free
            logger.debug("%s: remove_remote_agent(%s): %s", self.name, name, e)

    # ------------------------------------------------------------------ sending
    def start_send(self, op: Outgoing, now: float) -> None:
        """Registers the send and asks for room; a failure finishes `op` (the caller raises it)."""
        peer = self.peers.get(op.peer)
        try:
            if peer is None:
                raise PeerGone(f"{op.peer} is not a peer of {self.name} (gone, or never added)")
            if max(op.sizes) > peer.recv_size:
                raise ValueError(
                    f"a shard of {max(op.sizes)} bytes exceeds {op.peer}'s receive staging ({peer.recv_size})"
                )
            op.last_progress = now
            self.sends[op.send_id] = op
            for shard, size in enumerate(op.sizes):
                self.agent.send_notif(op.peer, wire.shard_msg(wire.MessageKind.REQ, op.send_id, shard, size))
        except (TransferError, ValueError) as e:
            op.finish(e)
            self.cleanup(op)
        except Exception as e:  # NIXL: the peer is unreachable
            self.drop_peer(op.peer, f"REQ failed: {e}")

    def shard_ready(self, op: Outgoing, shard: int, offset: int, ready: int) -> None:
        """The caller copied the first `ready` bytes of `shard` to `offset` in send staging."""
        assert self.send_arena is not None
        if op.cleaned:  # the send already ended: its copies are not needed any more
            if ready == op.sizes[shard]:
                self.send_arena.free(offset)
            return
        op.local[shard] = offset
        op.ready[shard] = ready

    def progress(self, op: Outgoing, now: float) -> bool:
        """Advances one send; NIXL exceptions propagate (the caller drops the peer)."""
        if op.finished.is_set():
            self.cleanup(op)
            return True
        busy = False
        for shard in op.local:
            if shard in op.granted:
                while op.posted.get(shard, 0) < op.ready[shard]:
                    self._post_write(op, shard)
                    busy = True
        for item in list(op.inflight):
            shard, nbytes, handle = item
            state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                raise RuntimeError(f"a WRITE of shard {shard} to {op.peer} failed")
            if state == "DONE":
                op.inflight.remove(item)
                self.agent.release_xfer_handle(handle)
                op.written[shard] = op.written.get(shard, 0) + nbytes
                if op.written[shard] == op.sizes[shard]:
                    assert self.send_arena is not None
                    self.send_arena.free(op.local.pop(shard))
                    op.done.add(shard)
                op.last_progress = now
                busy = True
        if len(op.done) == len(op.sizes):
            op.finish(None)
            self.cleanup(op)
        elif now > op.deadline:
            op.finish(TransferTimeout(f"send to {op.peer} passed its deadline ({len(op.done)}/{len(op.sizes)} shards)"))
            self.cleanup(op)
        elif now - op.last_progress > self.probe_interval_s and now - op.last_ping > self.probe_interval_s:
            op.last_ping = now
            self.agent.send_notif(op.peer, wire.PING)  # raises at once if the peer died
        return busy

    def _post_write(self, op: Outgoing, shard: int) -> None:
        """WRITEs the next segment of copied bytes of `shard` into its granted room."""
        assert self.send_arena is not None
        peer, size = self.peers[op.peer], op.sizes[shard]
        start = op.posted.get(shard, 0)
        n = min(op.ready[shard] - start, self.segment_bytes)
        arena = self.send_arena
        local = self.agent.get_xfer_descs([(arena.base_addr + op.local[shard] + start, n, arena.dev_id or 0)],
                                          arena.mem_type)
        remote_type, remote_dev = peer.recv_mem
        remote = self.agent.get_xfer_descs([(peer.recv_base + op.granted[shard] + start, n, remote_dev)], remote_type)
        note = wire.data(op.send_id, shard, len(op.sizes), op.tag, op.granted[shard], size, n)
        handle = self.agent.initialize_xfer("WRITE", local, remote, op.peer, note)
        op.inflight.append((shard, n, handle))  # tracked before posting, so a raise still releases it
        op.posted[shard] = start + n
        if self.agent.transfer(handle) == "ERR":
            raise RuntimeError(f"posting shard {shard} to {op.peer} failed")

    def cleanup(self, op: Outgoing) -> None:
        """Frees everything a finished send holds. A shard with a WRITE that NIXL will not release
        yet keeps its staging as a zombie until it does, so no later shard is overwritten."""
        if op.cleaned:
            return
        op.cleaned = True
        self.sends.pop(op.send_id, None)
        assert self.send_arena is not None
        stuck: dict[int, list[Any]] = {}
        for shard, _, handle in op.inflight:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:
                stuck.setdefault(shard, []).append(handle)
        op.inflight.clear()
        for shard, offset in op.local.items():
            if shard in stuck:
                self.zombies.append((stuck[shard], offset))
            elif op.ready[shard] == op.sizes[shard]:
                self.send_arena.free(offset)
            # else the caller is still copying into it: its last `shard_ready` frees it
        op.local.clear()
        if isinstance(op.error, TransferError) and not isinstance(op.error, PeerGone) and op.peer in self.peers:
            try:
                self.agent.send_notif(op.peer, wire.cancel(op.send_id))
            except Exception as e:
                self.drop_peer(op.peer, f"CANCEL failed: {e}")

    def release_zombies(self) -> None:
        if not self.zombies:
            return
        assert self.send_arena is not None
        keep = []
        for handles, offset in self.zombies:
            left = []
            for handle in handles:
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception:
                    left.append(handle)
            if left:
                keep.append((left, offset))
            else:
                self.send_arena.free(offset)
        self.zombies = keep

    # ------------------------------------------------------------------ receiving
    def on_message(self, peer: str, raw: bytes, now: float) -> None:
        try:
            m = wire.parse(raw)
        except ValueError as e:
            logger.warning("%s: dropping a malformed message from %s: %s", self.name, peer, e)
            return
        if m.kind is wire.MessageKind.HELLO:
            try:
                self.add(wire.NixlEnvelope.unpack(m.envelope), say_hello=False)
            except Exception as e:
                logger.warning("%s: HELLO from %s refused: %s", self.name, peer, e)
        elif m.kind is wire.MessageKind.REQ:
            if peer in self.peers:
                self.pending.append(RoomRequest(peer, m.send_id, m.shard, m.value))
            else:
                logger.warning("%s: REQ from %s, which never said HELLO; ignored", self.name, peer)
        elif m.kind in (wire.MessageKind.GRANT, wire.MessageKind.REFUSE):
            op = self.sends.get(m.send_id)
            if op is not None and op.peer == peer and not op.finished.is_set():
                if m.kind is wire.MessageKind.GRANT:
                    op.granted[m.shard] = m.value
                    op.last_progress = now
                else:
                    op.finish(ValueError(f"{peer} refused a shard of {op.sizes[m.shard]} bytes (room {m.value})"))
        elif m.kind is wire.MessageKind.DATA:
            key = (peer, m.send_id, m.shard)
            g = self.grants.get(key)
            if g is None or (g.offset, g.size) != (m.value, m.size) or g.received + m.segment > g.size:
                logger.error("%s: DATA from %s for room it does not hold (send %d shard %d)",
                             self.name, peer, m.send_id, m.shard)
                if g is not None:
                    self._reclaim([g])
                return
            g.received += m.segment
            if g.received == g.size:  # every segment is in: hand the shard out
                del self.grants[key]
                self.inbox.put((peer, m.tag, m.shard, m.num_shards, g.offset, g.size))
        elif m.kind is wire.MessageKind.CANCEL:
            self.pending = deque(r for r in self.pending if (r.peer, r.send_id) != (peer, m.send_id))
            self._reclaim([g for g in self.grants.values() if (g.peer, g.send_id) == (peer, m.send_id)])

    def grant_pending(self, now: float) -> bool:
        assert self.recv_arena is not None
        busy = False
        while self.pending:
            req = self.pending[0]
            if req.size > self.recv_arena.size_bytes:
                self.pending.popleft()
                msg = wire.shard_msg(wire.MessageKind.REFUSE, req.send_id, req.shard, self.recv_arena.size_bytes)
            else:
                offset = self.recv_arena.try_alloc(req.size)
                if offset is None:
                    break  # first come, first served: later requests wait behind this one
                self.pending.popleft()
                grant = Grant(req.peer, req.send_id, req.shard, offset, req.size, now)
                self.grants[(req.peer, req.send_id, req.shard)] = grant
                msg = wire.shard_msg(wire.MessageKind.GRANT, req.send_id, req.shard, offset)
            busy = True
            try:
                self.agent.send_notif(req.peer, msg)
            except Exception as e:
                self.drop_peer(req.peer, f"GRANT failed: {e}")
        return busy

    def sweep_grants(self, now: float) -> None:
        """Peers holding room they have not written are probed; room held past the TTL is reclaimed."""
        stale = [g for g in self.grants.values() if now - g.granted_at > self.grant_ttl_s]
        if stale:
            logger.warning("%s: reclaiming %d grants nobody wrote within %.0fs",
                           self.name, len(stale), self.grant_ttl_s)
            self._reclaim(stale)
        for peer in {g.peer for g in self.grants.values() if now - g.granted_at > self.probe_interval_s}:
            try:
                self.agent.send_notif(peer, wire.PING)
            except Exception as e:
                self.drop_peer(peer, f"PING failed: {e}")

    def _reclaim(self, grants: list[Grant]) -> None:
        assert self.recv_arena is not None
        for g in grants:
            if self.grants.pop((g.peer, g.send_id, g.shard), None) is not None:
                self.recv_arena.free(g.offset)

    # ------------------------------------------------------------------ the loop body
    def step(self, now: float) -> bool:
        if self.recv_arena is None:
            return False  # not registered yet: no peer can know us
        busy = False
        for peer, msgs in self.agent.get_new_notifs().items():
            for msg in msgs:
                busy = True
                self.on_message(peer, msg, now)
        busy |= self.grant_pending(now)
        for op in list(self.sends.values()):
            try:
                busy |= self.progress(op, now)
            except Exception as e:  # NIXL raises on a disconnected peer
                self.drop_peer(op.peer, f"{type(e).__name__}: {e}")
                busy = True
        if now - self._last_sweep > self.probe_interval_s:
            self._last_sweep = now
            self.sweep_grants(now)
            self.release_zombies()
        return busy

    def expecting(self) -> bool:
        """Whether a message is due soon (the worker then polls faster)."""
        return bool(self.sends or self.grants or self.pending)

    def close(self) -> None:
        for op in list(self.sends.values()):
            op.finish(PeerGone(f"transport {self.name} closed"))
            self.cleanup(op)
        self.release_zombies()
        for name in list(self.peers):
            self.forget_remote(name)
        self.peers.clear()
        self.deregister()
