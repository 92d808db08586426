"""The cuda_ipc transport's protocol on CPU: its arenas are shared host memory here (the "shm" side of
ipc_memory.py's seam, real POSIX shared memory), so everything but the CUDA copy runs: room
accounting and grants, shards larger in total than the room, concurrent sends, deadlines, a killed
or frozen receiver, a sender that vanishes holding room, stats, close. Between two real processes
where the contract is about processes; in one process where a test needs to hold the wire itself.
The CUDA path is tests/transfer/test_cuda_ipc_gpu.py (gpu-marked)."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tests.transfer.peer_proc import Peer, PeerSpec
from tests.transfer.test_nixl import LAYOUT, assemble, make_kv, send_concurrently, ship, thread_counts
from transfer import ipc_wire as wire
from transfer.codec import decode_shard, encode, error_bound
from transfer.cuda_ipc import CudaIpcConfig, CudaIpcTransport
from transfer.local import LocalTransport
from transfer.transport import IncompatiblePeer, KVTransport, PeerGone, TransferTimeout
from transfer.units import MIB


def endpoint(name: str, recv_bytes: int = MIB, **kw: object) -> CudaIpcTransport:
    return CudaIpcTransport(name, CudaIpcConfig(recv_staging_bytes=recv_bytes, **kw))  # type: ignore[arg-type]


def assert_idle(t: CudaIpcTransport) -> None:
    s = t.stats()
    assert (s.transfers_in_flight, s.staging_in_use_bytes) == (0, 0), s


@pytest.fixture(scope="module")
def sender() -> Iterator[CudaIpcTransport]:
    t = endpoint("ipc-sender")
    yield t
    t.close()


@pytest.fixture(scope="module")
def receiver(sender: CudaIpcTransport) -> Iterator[Peer]:
    peer = Peer(PeerSpec("ipc-receiver", kind="cuda_ipc"))
    assert sender.add_peer(peer.metadata) == "ipc-receiver"
    yield peer
    peer.stop()


@pytest.mark.parametrize("compression", ["none", "int8", "fp8"])
@pytest.mark.parametrize("as_tensors", [False, True])
def test_round_trip_between_processes(sender: CudaIpcTransport, receiver: Peer, compression: str,
                                      as_tensors: bool) -> None:
    assert isinstance(sender, KVTransport)
    kv = make_kv(num_blocks=7, dtype=torch.bfloat16)
    shards = encode(kv, LAYOUT, compression=compression, num_shards=3, transfer_id=5,
                    device="cpu" if as_tensors else None)  # tensor shards take the device code path
    found = ship(sender, receiver, shards, tag=5)  # type: ignore[arg-type]
    assert sorted((f[1], f[2], f[3]) for f in found) == [("ipc-sender", 5, i) for i in range(3)]
    assert {f[11] for f in found} == {"memoryview"}  # host arena: host deliveries
    sent = {i: bytes(s.numpy() if as_tensors else s) for i, s in enumerate(shards)}  # type: ignore[union-attr]
    assert {f[3]: f[9] for f in found} == {i: hashlib.sha256(b).hexdigest() for i, b in sent.items()}
    out = assemble(found)
    if compression == "none":
        assert torch.equal(out, kv.float())
    else:
        assert bool(((out - kv.float()).abs() <= error_bound(kv, compression)).all())
    assert_idle(sender)


def test_shards_larger_in_total_than_the_room_flow_through_it(sender: CudaIpcTransport) -> None:
    """~6 MiB in 6 shards through a 2 MiB arena: room is granted as the receiver releases."""
    peer = Peer(PeerSpec("ipc-small", recv_bytes=2 * MIB, kind="cuda_ipc"))
    try:
        sender.add_peer(peer.metadata)
        kv = make_kv(num_blocks=1000, seed=7)
        shards = encode(kv, LAYOUT, num_shards=6)
        assert all(768 * 1024 < len(s) < MIB for s in shards)
        assert torch.equal(assemble(ship(sender, peer, shards, timeout_s=30.0)), kv)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="receive staging"):
            sender.send("ipc-small", [np.zeros(3 * MIB, dtype=np.uint8)], timeout_s=5.0)
        assert_idle(sender)
        stats = peer.ask("stats")
        assert stats.staging_in_use_bytes == 0 and stats.peers["ipc-sender"].shards_received == 6
    finally:
        peer.stop()
        sender.remove_peer("ipc-small")


def test_concurrent_sends_from_many_threads_arrive_whole_by_tag(sender: CudaIpcTransport, receiver: Peer) -> None:
    send_concurrently(sender, receiver)
    assert_idle(sender)


def test_metadata_of_another_node_transport_or_version_is_incompatible(sender: CudaIpcTransport) -> None:
    far = endpoint("ipc-far", node="another-host")
    md = bytearray(sender.metadata())
    md[4:6] = (wire.VERSION + 1).to_bytes(2, "little")
    try:
        for bad in (far.metadata(), bytes(md), LocalTransport("not-ipc").metadata(), b"", sender.metadata()[:-3]):
            with pytest.raises(IncompatiblePeer):
                sender.add_peer(bad)
        assert "ipc-far" not in sender.stats().connected_peers
    finally:
        far.close()


def test_unknown_peer_is_peer_gone_at_once(sender: CudaIpcTransport) -> None:
    t0 = time.monotonic()
    with pytest.raises(PeerGone):
        sender.send("nobody", [b"x"], timeout_s=30.0)
    assert time.monotonic() - t0 < 5.0


def test_killed_receiver_is_peer_gone_within_deadline_then_restart_works(sender: CudaIpcTransport) -> None:
    # It SIGKILLs itself on taking its second shard of 16, the rest waiting for room (it holds 2).
    peer = Peer(PeerSpec("ipc-doomed", recv_bytes=2 * MIB, die_after_shards=2, kind="cuda_ipc"))
    try:
        sender.add_peer(peer.metadata)
        assert ship(sender, peer, [b"warm-up"], timeout_s=5.0)[0][:2] == ("error", "CorruptShard")
        before = thread_counts()
        peer.request("recv", 16, 30.0)
        t0 = time.monotonic()
        with pytest.raises(PeerGone, match="ipc-doomed"):
            sender.send("ipc-doomed", [np.zeros(768 * 1024, dtype=np.uint8)] * 16, timeout_s=30.0)
        assert time.monotonic() - t0 < 10.0  # the connection reset, not the deadline
        peer.wait_dead()
        assert_idle(sender)
        assert thread_counts() == before
        assert sender.stats().peers["ipc-doomed"].peer_gone == 1
        assert "ipc-doomed" not in sender.stats().connected_peers
        with pytest.raises(PeerGone):  # dropped: no more sends until it is re-added
            sender.send("ipc-doomed", [b"x"], timeout_s=5.0)
        peer.stop()
        peer = Peer(PeerSpec("ipc-doomed", kind="cuda_ipc"))  # restarted under the same name
        sender.add_peer(peer.metadata)
        kv = make_kv(num_blocks=3, seed=3)
        assert torch.equal(assemble(ship(sender, peer, encode(kv, LAYOUT, num_shards=2))), kv)  # type: ignore[arg-type]
    finally:
        peer.stop()
        sender.remove_peer("ipc-doomed")


def test_frozen_receiver_is_transfer_timeout_and_works_again_after_thaw(sender: CudaIpcTransport) -> None:
    peer = Peer(PeerSpec("ipc-frozen", kind="cuda_ipc"))
    try:
        sender.add_peer(peer.metadata)
        peer.freeze()
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout):
            sender.send("ipc-frozen", [np.zeros(MIB // 2, dtype=np.uint8)] * 2, timeout_s=1.0)
        assert 0.9 < time.monotonic() - t0 < 5.0
        assert_idle(sender)
        assert sender.stats().peers["ipc-frozen"].timeouts == 1
        peer.thaw()  # it now reads the stale requests and the closed connection: that room comes back
        kv = make_kv(num_blocks=2, seed=4)
        shards = encode(kv, LAYOUT)
        # A late piece of the timed-out transfer may still be delivered after the thaw (the decode
        # side drops such pieces by tag): the new transfer has its own tag, and the peer takes what
        # comes for a few seconds, so only tag 1's shards are assembled.
        peer.request("recv", len(shards) + 2, 5.0)
        sender.send("ipc-frozen", shards, tag=1, timeout_s=10.0)
        found = peer.read(30)
        mine = [f for f in found if f[0] == "ok" and f[2] == 1]
        stale = [f for f in found if f not in mine]
        assert len(mine) == len(shards) and torch.equal(assemble(mine), kv)
        # anything else: the old transfer's zeros (not a shard), or the wait for more ending
        assert all(f[0] == "error" and f[1] in ("CorruptShard", "TransferTimeout") or f[2] == 0 for f in stale), stale
        # The stale requests' room is given back as the thawed peer reads them, in its own thread: by
        # a deadline (a hang guard), not at once.
        deadline = time.monotonic() + 30
        while (stats := peer.ask("stats")).staging_in_use_bytes or stats.transfers_in_flight:
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
    finally:
        peer.stop()
        sender.remove_peer("ipc-frozen")


def _raw_sender(rx: CudaIpcTransport, size: int) -> tuple[socket.socket, wire.Frame]:
    """A connection that speaks the wire by hand: HELLO, one REQ, and the GRANT it gets."""
    env = wire.IpcEnvelope.unpack(rx.metadata())
    sock = socket.create_connection(("127.0.0.1", env.port), timeout=5.0)
    sock.sendall(wire.hello("raw", 1) + wire.shard_frame(wire.FrameKind.REQ, 77, 0, 1, 3, size))
    return sock, wire.read_frame(sock, wire.FrameBuffer(), [], time.monotonic() + 5.0, "rx")


def wait_until(cond: object, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_a_sender_that_vanishes_or_sits_on_its_grant_gives_the_room_back() -> None:
    rx = endpoint("ipc-rx", recv_bytes=64 * 1024, grant_ttl_s=0.3)
    try:
        sock, grant = _raw_sender(rx, 5000)
        assert (grant.kind, grant.send_id, grant.shard, grant.value) == (wire.FrameKind.GRANT, 77, 0, 0)
        assert rx.stats().staging_in_use_bytes == 4096 * 2 and rx.stats().transfers_in_flight == 1
        sock.close()  # gone without writing: the receiver reclaims the room
        assert wait_until(lambda: rx.stats().staging_in_use_bytes == 0 and rx.stats().transfers_in_flight == 0)
        sock, grant = _raw_sender(rx, 5000)  # frozen: holds the grant past its TTL
        assert grant.kind is wire.FrameKind.GRANT
        assert wait_until(lambda: rx.stats().staging_in_use_bytes == 0)
        assert sock.recv(16) == b""  # ...and its connection was closed, so it cannot write later
        sock.close()
        with pytest.raises(TransferTimeout):
            rx.recv(0.05)  # nothing was handed out
    finally:
        rx.close()


def test_release_frees_room_for_a_waiting_sender_and_dropped_delivery_too(caplog: pytest.LogCaptureFixture) -> None:
    a, b = endpoint("ipc-a"), endpoint("ipc-b", recv_bytes=8192)
    try:
        a.add_peer(b.metadata())
        a.send("ipc-b", [b"x" * 6000], timeout_s=1.0)
        with pytest.raises(TransferTimeout):
            a.send("ipc-b", [b"y" * 6000], timeout_s=0.2)  # the first is not released yet
        assert_idle(a)
        d = b.recv(1.0)
        assert (d.peer, bytes(d.data)) == ("ipc-a", b"x" * 6000)
        threading.Timer(0.1, d.release).start()
        a.send("ipc-b", [b"z" * 6000], timeout_s=5.0)  # waits for that release
        d = b.recv(1.0)
        assert bytes(d.data) == b"z" * 6000 and b.stats().staging_in_use_bytes == 8192
        del d  # never released
        assert "without release" in caplog.text
        assert wait_until(lambda: b.stats().staging_in_use_bytes == 0)
        a.send("ipc-b", [b"w" * 6000], timeout_s=1.0)
    finally:
        a.close()
        b.close()


def test_resolver_register_buffers_and_close() -> None:
    current: dict[str, bytes] = {}
    a = CudaIpcTransport("ipc-res-a", CudaIpcConfig(recv_staging_bytes=MIB), resolver=current.get)
    b = endpoint("ipc-res-b")
    try:
        current["ipc-res-b"] = b.metadata()
        a.send("ipc-res-b", [b"hello"], timeout_s=2.0)  # never add_peer'd by hand
        with pytest.raises(RuntimeError, match="idle"):
            b.register_buffers(0, 2 * MIB)  # a shard sits unreleased
        with b.recv(1.0) as d:
            assert bytes(d.data) == b"hello"
        old = b.metadata()
        # A release is queued to the receiver's thread (`IpcReceiver.release`): idle a moment later.
        deadline = time.monotonic() + 2.0
        while True:
            try:
                b.register_buffers(0, 2 * MIB)
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        assert b.metadata() != old and b.stats().registered_bytes == 2 * MIB
        with pytest.raises(PeerGone):  # the old arena and port are gone
            a.send("ipc-res-b", [b"again"], timeout_s=2.0)
        current["ipc-res-b"] = b.metadata()
        a.send("ipc-res-b", [b"again"], timeout_s=2.0)  # resolved to the new metadata
        assert bytes(b.recv(1.0).data) == b"again"
    finally:
        a.close()
        b.close()
    a.close()  # idempotent
    with pytest.raises(PeerGone, match="closed"):
        a.send("ipc-res-b", [b"x"], timeout_s=1.0)


def test_device_decode_path_matches_host_decode() -> None:
    """A tensor shard (the path a GPU shard takes) decodes to the same KV as its host bytes, with
    or without the checksum, and a flipped payload byte is caught only when it is verified."""
    kv = make_kv(num_blocks=3, dtype=torch.bfloat16)
    for compression in ("none", "int8", "fp8"):
        host = encode(kv, LAYOUT, compression=compression, num_shards=2)
        tensors = encode(kv, LAYOUT, compression=compression, num_shards=2, device="cpu")
        for h, t in zip(host, tensors):
            assert bytes(h) == bytes(t.numpy())  # type: ignore[union-attr]
            assert torch.equal(decode_shard(t, LAYOUT).kv, decode_shard(h, LAYOUT).kv)
            assert torch.equal(decode_shard(t, LAYOUT, verify=False).kv, decode_shard(h, LAYOUT).kv)
    bad = tensors[0].clone()  # type: ignore[union-attr]
    bad[-1] ^= 1
    with pytest.raises(Exception, match="checksum"):
        decode_shard(bad, LAYOUT)
    decode_shard(bad, LAYOUT, verify=False)
