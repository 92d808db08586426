"""The transport is a config choice; `auto` is NIXL wherever it imports."""

from __future__ import annotations

import pytest

from transfer.config import TransferConfig, make_transport, resolve_kind
from transfer.local import LocalTransport
from transfer.nixl import NixlTransport, nixl_available
from transfer.transport import KVTransport


def test_auto_is_nixl_where_it_imports() -> None:
    assert resolve_kind("auto") == "nixl" if nixl_available() else resolve_kind("auto") in ("object_store", "local")
    assert resolve_kind("local") == "local" and resolve_kind("object_store") == "object_store"


@pytest.mark.skipif(not nixl_available(), reason="nixl does not import here")
def test_make_transport_builds_nixl_with_its_sizes() -> None:
    t = make_transport("cfg-nixl", TransferConfig(send_staging_bytes=1 << 20, recv_staging_bytes=2 << 20))
    try:
        assert isinstance(t, NixlTransport) and isinstance(t, KVTransport)
        assert t.stats().registered_bytes == 3 << 20
    finally:
        t.close()


def test_make_transport_local_and_bad_config() -> None:
    t = make_transport("cfg-local", TransferConfig(kind="local"))
    assert isinstance(t, LocalTransport)
    t.close()
    with pytest.raises(ValueError, match="unknown transport kind"):
        TransferConfig(kind="carrier-pigeon")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        TransferConfig(recv_staging_bytes=0)


def test_auto_keeps_host_kv_and_far_peers_off_cuda_ipc() -> None:
    from transfer.config import this_node

    for args in [(), ("cpu", this_node()), ("cuda:0", "another-node"), ("cuda:0", None)]:
        assert resolve_kind("auto", *args) == resolve_kind("auto")
    assert resolve_kind("cuda_ipc") == "cuda_ipc"


def test_make_transport_cuda_ipc_on_the_host_uses_shared_memory() -> None:
    from transfer.cuda_ipc import CudaIpcTransport

    t = make_transport("cfg-ipc", TransferConfig(kind="cuda_ipc", recv_staging_bytes=1 << 20))
    try:
        assert isinstance(t, CudaIpcTransport) and isinstance(t, KVTransport)
        assert (t.memory, t.stats().registered_bytes) == ("shm", 1 << 20)
    finally:
        t.close()


def test_nixl_envelope_says_where_receive_staging_lives() -> None:
    from transfer.nixl_wire import NixlEnvelope

    host = NixlEnvelope("p", 1, 4096, 8192, b"md")
    gpu = NixlEnvelope("p", 1, 4096, 8192, b"md", recv_device=3)
    assert NixlEnvelope.unpack(host.pack()).recv_mem == ("DRAM", 0)  # what a peer of before writes, too
    assert NixlEnvelope.unpack(gpu.pack()) == gpu and gpu.recv_mem == ("VRAM", 3)
