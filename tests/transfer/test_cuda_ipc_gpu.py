"""The CUDA paths of transfer/ on a real GPU (gpu-marked: skipped without CUDA): cuda_ipc between two
processes on one GPU, KV encoded on the device (compressed there with the triton quantizers), copied
device to device into the receiver's GPU arena, decoded there; bytes checked with sha256. Also the
codec's device shards against its host ones, device staging for NIXL (VRAM), and `auto`.
Needs cupy for cuda_ipc (the `[gpu]` extra); NIXL's test also needs nixl."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest
import torch

from tests.transfer.peer_proc import Peer, PeerSpec
from tests.transfer.test_nixl import LAYOUT, assemble, make_kv, ship
from transfer.codec import decode_shard, encode, error_bound
from transfer.cuda_memory import cuda_ipc_available
from transfer.units import MIB

pytestmark = pytest.mark.gpu
needs_ipc = pytest.mark.skipif(not cuda_ipc_available(), reason="cupy cannot share GPU memory here")


def sha(shard: torch.Tensor) -> str:
    return hashlib.sha256(shard.cpu().numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[object, Peer]]:
    from transfer.cuda_ipc import CudaIpcConfig, CudaIpcTransport

    if not cuda_ipc_available():
        pytest.skip("cupy cannot share GPU memory here")
    tx = CudaIpcTransport("gpu-tx", CudaIpcConfig(recv_staging_bytes=MIB, device="cuda:0"))
    peer = Peer(PeerSpec("gpu-rx", recv_bytes=64 * MIB, kind="cuda_ipc", device="cuda:0"))
    tx.add_peer(peer.metadata)
    yield tx, peer
    peer.stop()
    tx.close()


@needs_ipc
@pytest.mark.parametrize("compression", ["none", "int8", "fp8"])
def test_cuda_ipc_device_to_device_between_processes(pair: tuple, compression: str) -> None:
    tx, peer = pair
    kv = make_kv(num_blocks=300, dtype=torch.bfloat16).cuda()
    shards = encode(kv, LAYOUT, compression=compression, num_shards=3, transfer_id=11, device="cuda:0")
    assert all(s.is_cuda for s in shards)  # type: ignore[union-attr]
    found = ship(tx, peer, shards, tag=11)  # type: ignore[arg-type]
    assert {f[11] for f in found} == {"Tensor"} and {f[10] for f in found} == {"cuda:0"}  # landed, decoded on GPU
    assert {f[3]: f[9] for f in found} == {i: sha(s) for i, s in enumerate(shards)}  # type: ignore[arg-type]
    out = assemble(found)
    if compression == "none":
        assert torch.equal(out, kv.float().cpu())
    else:
        assert bool(((out - kv.float().cpu()).abs() <= error_bound(kv.cpu(), compression)).all())
    s = tx.stats()
    assert (s.transfers_in_flight, s.staging_in_use_bytes) == (0, 0)


@needs_ipc
def test_cuda_ipc_host_shards_to_a_gpu_arena_and_big_shards(pair: tuple) -> None:
    tx, peer = pair
    big = torch.randint(0, 255, (48 * MIB,), dtype=torch.uint8, device="cuda")
    peer.request("recv", 2, 60.0)
    tx.send("gpu-rx", [big, bytes(1000)], timeout_s=60.0)
    found = peer.read(70.0)
    # neither is a codec shard: the receiver reports CorruptShard, after the bytes landed
    assert [f[:2] for f in found] == [("error", "CorruptShard")] * 2


def test_device_shards_equal_host_shards_and_decode_on_the_device() -> None:
    kv = make_kv(num_blocks=5, dtype=torch.bfloat16).cuda()
    for compression in ("none", "int8", "fp8"):
        host = encode(kv, LAYOUT, compression=compression, num_shards=2)
        dev = encode(kv, LAYOUT, compression=compression, num_shards=2, device="cuda")
        for h, d in zip(host, dev):
            assert hashlib.sha256(h).hexdigest() == sha(d)  # type: ignore[arg-type]
            got = decode_shard(d, LAYOUT, verify=False)
            assert got.kv.is_cuda and torch.equal(got.kv.cpu(), decode_shard(h, LAYOUT).kv)


def test_staging_on_the_device_is_vram() -> None:
    from transfer.nixl_endpoint import staging_regions
    from transfer.staging import StagingArena

    a = StagingArena(3 * MIB, "cuda:0")
    assert (a.mem_type, a.dev_id, a.buf) == ("VRAM", 0, None) and a.tensor.is_cuda
    off = a.try_alloc(MIB)
    a.write(off, torch.full((MIB,), 7, dtype=torch.uint8, device="cuda"))
    a.write(off + 10, b"\x01\x02")
    assert a.view(off, 12).tolist() == [7] * 10 + [1, 2]
    assert staging_regions(a) == [(a.base_addr, 3 * MIB, 0, "")]


def test_nixl_with_vram_staging_between_processes() -> None:
    from transfer.nixl import NixlConfig, NixlTransport, nixl_available

    if not nixl_available():
        pytest.skip("nixl does not import here")
    tx = NixlTransport("vram-tx", NixlConfig(send_staging_bytes=16 * MIB, recv_staging_bytes=MIB,
                                             staging_device="cuda:0"))
    peer = Peer(PeerSpec("vram-rx", device="cuda:0"))
    try:
        tx.add_peer(peer.metadata)
        kv = make_kv(num_blocks=7).cuda()
        shards = encode(kv, LAYOUT, num_shards=3, device="cuda:0")
        found = ship(tx, peer, shards)  # type: ignore[arg-type]
        assert {f[11] for f in found} == {"Tensor"}
        assert torch.equal(assemble(found), kv.cpu())
    finally:
        peer.stop()
        tx.close()


@needs_ipc
def test_auto_is_cuda_ipc_for_gpu_kv_on_this_node() -> None:
    from transfer.config import TransferConfig, make_transport, resolve_kind, this_node

    assert resolve_kind("auto", "cuda:0", this_node()) == "cuda_ipc"
    assert resolve_kind("auto", "cuda:0", "another-node") != "cuda_ipc"
    t = make_transport("auto-gpu", TransferConfig(recv_staging_bytes=MIB), kv_device="cuda", peer_node=this_node())
    try:
        assert t.kind == "cuda_ipc" and t.stats().registered_bytes == MIB  # type: ignore[attr-defined]
    finally:
        t.close()
