"""KV transport over NIXL with its UCX backend: host memory moves over cma on one machine, RDMA or
NVLink on a cluster, through the same agent.

Mental model: each endpoint owns one NIXL agent, two pre-registered staging arenas (send, receive)
and one worker thread; the worker is the only thread that touches the agent, so NIXL's
thread-unsafe default mode is fine. A `send` copies each shard into send staging (caller thread,
overlapping the worker's transfers), asks the receiver for room (REQ), WRITEs into the room it is
granted (in segments, so copying and writing overlap), and returns when every WRITE is done. NIXL
hands the receiver a DATA notification after each WRITE's bytes; once a shard is whole, `recv`
hands out a view of it in receive staging, and releasing that Delivery frees the room for the
next shards. See nixl_wire.py for the messages.

Failures, as measured on these machines (../shared/NOTES-transfer.md): a dead peer makes
`transfer`/`check_xfer_state`/`send_notif` raise within milliseconds, so while a send waits the
worker PINGs its peer every `probe_interval_s`: death becomes `PeerGone` promptly. A frozen peer
never fails anything, so only the deadline ends a send (`TransferTimeout`). Either way the worker
releases the send's transfer handles and staging; a failed peer is dropped (`remove_remote_agent`)
and comes back when its new metadata is added, by the caller, by the `resolver`, or by the peer's
own HELLO.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from transfer import nixl_wire as wire
from transfer.header import peek_raw_bytes
from transfer.nixl_endpoint import NixlEndpoint
from transfer.nixl_records import Outgoing
from transfer.transport import (
    Buffer,
    Delivery,
    PeerGone,
    PeerStatsBook,
    SendStats,
    TransferError,
    TransferTimeout,
    TransportStats,
    as_bytes_view,
    is_tensor,
)
from transfer.units import MIB

logger = logging.getLogger(__name__)
_HOT_S = 0.05  # how long after traffic the worker keeps polling fast
# Past _HOT_S the poll backs off to 1 ms for _WARM_S after traffic and while senders are expected
# (`expect_senders`), then to _COLD_POLL_S: an idle endpoint wakes a few times a second instead of a
# thousand (each poll costs ~70 us of CPU here, so 1 ms polling was ~5% of a core per idle endpoint).
_WARM_S = 2.0
_COLD_POLL_S = 0.25


def nixl_available() -> bool:
    try:
        import nixl._api  # noqa: F401
    except Exception:  # ImportError, or a broken native library
        return False
    return True


@dataclass(frozen=True)
class NixlConfig:
    send_staging_bytes: int = 128 * MIB  # no shard may be larger; a send may (it is pipelined)
    recv_staging_bytes: int = 128 * MIB  # also the largest shard a peer may send us
    probe_interval_s: float = 0.05
    grant_ttl_s: float = 60.0  # room granted to a sender that never writes is reclaimed after this
    call_timeout_s: float = 10.0  # bound on waiting for the worker thread (add_peer, stats, ...)
    segment_bytes: int = 16 * MIB  # WRITE granularity: copying segment k+1 overlaps writing segment k
    # UCX's network devices. "lo" keeps every listening socket on 127.0.0.1 (same-host data goes
    # over cma anyway); a cluster sets its NICs (e.g. "mlx5_0:1"), None leaves UCX's own choice.
    # An UCX_NET_DEVICES already in the environment wins.
    ucx_net_devices: str | None = "lo"
    # Where both staging arenas live: None is host memory registered as DRAM (the CPU path, and
    # any KV on the host); "cuda:k" is memory on GPU k registered as VRAM, for KV that lives there,
    # so UCX moves it GPU to GPU (RDMA with GPUDirect, NVLink) and nothing is staged on the host.
    # Device shards are then copied device to device into send staging; host shards are uploaded.
    staging_device: str | None = None


class NixlTransport:
    kind = "nixl"

    def __init__(self, name: str, cfg: NixlConfig | None = None,
                 resolver: Callable[[str], bytes | None] | None = None) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        if "NIXL_LOG_LEVEL" not in os.environ:
            logging.getLogger("nixl").setLevel(logging.WARNING)  # it logs INFO to stdout otherwise
        self.name = name
        self.cfg = cfg or NixlConfig()
        self.device_shards = self.cfg.staging_device is not None  # see transport.takes_device_shards
        if self.cfg.ucx_net_devices is not None:
            os.environ.setdefault("UCX_NET_DEVICES", self.cfg.ucx_net_devices)  # UCX reads it at backend init
        self._resolver = resolver
        # The progress thread off measured faster here; the worker polls notifications anyway.
        agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._ep = NixlEndpoint(name, agent, int.from_bytes(os.urandom(8), "little"),
                                self.cfg.probe_interval_s, self.cfg.grant_ttl_s, self.cfg.segment_bytes,
                                self.cfg.staging_device)
        # random start, so a restarted sender's ids never match what its peer still remembers
        self._send_ids = itertools.count(int.from_bytes(os.urandom(4), "little") << 20)
        self._book = PeerStatsBook()
        self._commands: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._warm_until = 0.0  # time.monotonic(): poll at most 1 ms apart until then (after traffic)
        self._senders_expected = False  # `expect_senders`: poll at most 1 ms apart while true
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"nixl-{name}", daemon=True)
        self._thread.start()
        try:
            self.register_buffers(self.cfg.send_staging_bytes, self.cfg.recv_staging_bytes)
        except BaseException:
            self.close()  # no worker thread or agent outlives a failed constructor
            raise

    # ------------------------------------------------------------------ public API (any thread)
    def register_buffers(self, send_bytes: int, recv_bytes: int) -> None:
        self._call(self._ep.register, send_bytes, recv_bytes)

    def metadata(self) -> bytes:
        return self._ep.envelope

    def add_peer(self, metadata: bytes) -> str:
        env = wire.NixlEnvelope.unpack(metadata)
        self._call(self._ep.add, env, True)
        return env.name

    def remove_peer(self, peer: str) -> None:
        self._call(self._ep.drop_peer, peer, "removed by the caller", True)

    def send(self, peer: str, shards: Sequence[Buffer], *, tag: int = 0, timeout_s: float) -> SendStats:
        if self._closed:
            raise PeerGone(f"transport {self.name} is closed")
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        arena = self._ep.send_arena
        assert arena is not None
        # device staging copies a device shard as it is; host staging takes bytes
        views = [s.reshape(-1) if arena.tensor is not None and is_tensor(s) else as_bytes_view(s) for s in shards]
        if not views or max(len(v) for v in views) > arena.size_bytes:
            raise ValueError(f"send needs 1+ shards of at most {arena.size_bytes} bytes (send staging)")
        if peer not in self._ep.peers:
            try:
                self._resolve(peer)
            except TransferError as e:
                self._book.failed(peer, e)
                raise
        op = Outgoing(next(self._send_ids), peer, tag, [len(v) for v in views], deadline)
        seg = self.cfg.segment_bytes
        try:
            self._post(self._ep.start_send, op, t0)  # REQs go out while we copy
            for i, v in enumerate(views):
                off = arena.alloc(len(v), deadline, op.finished)
                if off is None:
                    break
                # A shard once started is copied whole (it is bounded): its last report frees it
                # even when the send ends meanwhile.
                for start in range(0, len(v), seg):
                    end = min(len(v), start + seg)
                    # numpy drops the GIL while copying (a memoryview copy would hold it), so
                    # the worker's WRITE of the previous segment really runs alongside
                    if arena.buf is not None:
                        np.copyto(arena.buf[off + start : off + end], np.frombuffer(v[start:end], dtype=np.uint8))
                    else:
                        arena.write(off + start, v[start:end])
                    self._post(self._ep.shard_ready, op, i, off, end)
                if op.finished.is_set():
                    break
            op.finished.wait(max(0.0, deadline - time.monotonic()))
        except (TransferError, ValueError) as e:
            op.finish(e)
        finally:
            op.finish(TransferTimeout(f"send of {len(views)} shards to {peer} passed its {timeout_s:.3f}s deadline"))
            if op.error is not None and not op.cleaned:
                # Free what the send holds before raising, so a caller sees no leak. The worker
                # answers at once unless it is inside a long WRITE; then it cleans up afterwards.
                try:
                    self._call(self._ep.cleanup, op, timeout_s=1.0)
                except TransferError:
                    pass
        if op.error is not None:
            if isinstance(op.error, TransferError):
                self._book.failed(peer, op.error)
            raise op.error
        raw = sum(peek_raw_bytes(v) or len(v) for v in views)
        stats = SendStats(peer, len(views), sum(len(v) for v in views), raw, time.monotonic() - t0)
        self._book.sent(stats)
        return stats

    def expect_senders(self, expected: bool) -> None:
        """A hint: peers are about to send to us (the decode side holds room reserved for announced
        KV), or no longer. Notifications cannot wake the worker, so it polls warm while they are
        expected and cold once nothing is, and no traffic came for `_WARM_S`."""
        self._senders_expected = expected
        self._wake.set()

    def recv(self, timeout_s: float) -> Delivery:
        try:
            peer, tag, shard, n, off, size = self._ep.inbox.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            raise TransferTimeout(f"{self.name}: no shard arrived within {timeout_s:.3f}s") from None
        arena = self._ep.recv_arena
        assert arena is not None
        self._book.received(peer, size)

        def release() -> None:
            # The worker frees it: SimpleQueue.put is safe even from the garbage collector's
            # finalizer (a lock taken here could be held by the very frame GC interrupted), and
            # a worker with requests queued for room polls every 50 us.
            self._commands.put((arena.free, (off,), None))

        return Delivery(peer, tag, shard, n, arena.view(off, size), release)

    def stats(self) -> TransportStats:
        if self._closed:
            return TransportStats(self.name, self.kind, self._book.snapshot())
        return self._call(self._snapshot)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=self.cfg.call_timeout_s)
        if self._thread.is_alive():
            logger.error("%s: NIXL worker is stuck in a transfer; leaving its agent to the process exit", self.name)
            return
        # The worker has exited: this thread owns the agent now.
        while True:
            try:
                _, _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if fut is not None:
                fut.set_exception(PeerGone(f"transport {self.name} closed"))
        self._ep.close()
        self._ep.agent = None

    def _snapshot(self) -> TransportStats:
        ep = self._ep
        assert ep.send_arena is not None and ep.recv_arena is not None
        return TransportStats(
            self.name, self.kind, self._book.snapshot(), connected_peers=tuple(sorted(ep.peers)),
            transfers_in_flight=sum(len(op.inflight) for op in ep.sends.values()) + len(ep.zombies),
            staging_in_use_bytes=ep.send_arena.in_use_bytes + ep.recv_arena.in_use_bytes,
            registered_bytes=ep.send_arena.size_bytes + ep.recv_arena.size_bytes,
        )

    # ------------------------------------------------------------------ calls into the worker
    def _call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
        if self._closed:
            raise PeerGone(f"transport {self.name} is closed")
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put((fn, args, fut))
        self._wake.set()
        wait_s = self.cfg.call_timeout_s if timeout_s is None else min(timeout_s, self.cfg.call_timeout_s)
        try:
            return fut.result(timeout=wait_s)
        except concurrent.futures.TimeoutError:
            raise TransferTimeout(f"{self.name}: NIXL worker did not answer within {wait_s:.3f}s") from None

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        self._commands.put((fn, args, None))
        self._wake.set()

    def _resolve(self, peer: str) -> None:
        md = self._resolver(peer) if self._resolver is not None else None
        if md is None:
            raise PeerGone(f"{peer} is not a peer of {self.name}: add its metadata first")
        self.add_peer(md)

    # ------------------------------------------------------------------ the worker thread
    def _run(self) -> None:
        idle_s, hot_until = 0.0, 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            self._wake.clear()  # before the step: a wake-up set from here on is seen by it or kept for the wait
            try:
                busy = self._step(now)
            except Exception:  # a bug here must not silently stop every transfer
                logger.exception("%s: NIXL worker step failed", self.name)
                busy = False
            if busy:
                idle_s, hot_until = 0.0, now + _HOT_S
                self._warm_until = now + _WARM_S
                continue
            # Notifications cannot wake us, so poll: every 50 us while a send or a grant is open or
            # traffic was recent (shards come in bursts), backing off to 1 ms while warm (traffic in
            # the last _WARM_S, or senders announced by `expect_senders`), then to _COLD_POLL_S.
            # Our own calls (send, add_peer, ...) and the hint wake us at once.
            cap = 1e-3 if now < self._warm_until or self._senders_expected else _COLD_POLL_S
            idle_s = 5e-5 if now < hot_until or self._ep.expecting() else min(max(idle_s * 2, 5e-5), cap)
            self._wake.wait(idle_s)

    def _step(self, now: float) -> bool:
        busy = False
        while True:
            try:
                fn, args, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            busy = True
            try:
                result = fn(*args)
            except BaseException as e:  # handed to the caller, who raises it
                if fut is None:
                    logger.exception("%s: worker command %s failed", self.name, fn.__name__)
                else:
                    fut.set_exception(e)
            else:
                if fut is not None:
                    fut.set_result(result)
        return self._ep.step(now) or busy
