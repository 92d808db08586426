"""The in-process transport keeps the same contract as the real ones (it is what unit tests of the
workers use), including back-pressure, deadlines and a gone peer."""

from __future__ import annotations

import time

import pytest
import torch

from transfer.codec import KVLayout, decode_shard, encode
from transfer.local import LocalTransport
from transfer.transport import KVTransport, PeerGone, TransferTimeout

LAYOUT = KVLayout("tiny", 4, 2, 8, 4)


def test_round_trip_with_stats_and_release_frees_room() -> None:
    a, b = LocalTransport("a"), LocalTransport("b", recv_bytes=1 << 20)
    assert isinstance(a, KVTransport)
    try:
        assert a.add_peer(b.metadata()) == "b"
        kv = torch.randn(4, 2, 3, 4, 2, 8)
        shards = encode(kv, LAYOUT, compression="none", num_shards=2, transfer_id=9)
        sent = a.send("b", shards, tag=9, timeout_s=1.0)
        assert (sent.num_shards, sent.wire_bytes, sent.raw_bytes) == (2, sum(map(len, shards)), kv.numel() * 4)
        got = []
        for i in range(2):
            with b.recv(1.0) as d:
                assert (d.peer, d.tag, d.shard_index, d.num_shards) == ("a", 9, i, 2)
                got.append(decode_shard(d.data, LAYOUT).kv.clone())
        assert torch.equal(torch.cat(got), kv)
        assert b.stats().staging_in_use_bytes == 0
        assert a.stats().peers["b"].shards_sent == 2 and b.stats().peers["a"].shards_received == 2
    finally:
        a.close()
        b.close()


def test_full_inbox_times_out_the_sender_and_empty_inbox_times_out_recv() -> None:
    a, b = LocalTransport("a"), LocalTransport("b", recv_bytes=1000)
    try:
        a.add_peer(b.metadata())
        a.send("b", [b"x" * 600], timeout_s=1.0)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout):
            a.send("b", [b"y" * 600], timeout_s=0.2)  # the first shard is not released yet
        assert 0.2 <= time.monotonic() - t0 < 3.0
        assert a.stats().peers["b"].timeouts == 1
        b.recv(0.1).release()
        a.send("b", [b"z" * 600], timeout_s=1.0)
        assert bytes(b.recv(0.1).data) == b"z" * 600
        with pytest.raises(TransferTimeout):
            b.recv(0.05)
    finally:
        a.close()
        b.close()


def test_closed_or_restarted_peer_is_gone_until_re_added() -> None:
    a, b = LocalTransport("a"), LocalTransport("b")
    a.add_peer(b.metadata())
    b.close()
    with pytest.raises(PeerGone):
        a.send("b", [b"x"], timeout_s=1.0)
    assert a.stats().connected_peers == ()
    b2 = LocalTransport("b")
    with pytest.raises(PeerGone):  # forgotten after the failure: the new b is not known yet
        a.send("b", [b"x"], timeout_s=1.0)
    a.add_peer(b2.metadata())
    a.send("b", [b"x"], timeout_s=1.0)
    assert bytes(b2.recv(1.0).data) == b"x"
    a.close()
    b2.close()


def test_a_dropped_delivery_gives_its_room_back(caplog: pytest.LogCaptureFixture) -> None:
    a, b = LocalTransport("a"), LocalTransport("b", recv_bytes=1000)
    try:
        a.add_peer(b.metadata())
        a.send("b", [b"x" * 600], timeout_s=1.0)
        d = b.recv(1.0)
        assert b.stats().staging_in_use_bytes == 600
        del d  # never released
        assert b.stats().staging_in_use_bytes == 0
        assert "without release" in caplog.text
        a.send("b", [b"y" * 600], timeout_s=1.0)
    finally:
        a.close()
        b.close()
