"""Which transport an endpoint uses, as a config choice, and the one factory that builds it.

`kind="auto"` resolves, in this order:
- `cuda_ipc` when the KV lives on a CUDA device (`kv_device`), the peer is on this node
  (`peer_node == this_node()`) and cupy can share GPU memory here: device to device, no host;
- `nixl` where it imports (the fast path, and the same agent does RDMA on a GPU cluster); with KV on
  a CUDA device its staging is device memory registered as VRAM;
- the Ray object store where Ray runs in this process, else the in-process transport.
`kv_device` and `peer_node` are optional arguments because they are facts of the deployment, not
settings: where the engine keeps its KV, and which node the peer runs on (a hostname, as
`this_node()` returns it; pass it from the placement, e.g. the hostname a decode worker reports).
Without them `auto` means what it always did. One endpoint has one kind, so a worker whose peers
span nodes resolves for the farthest of them (NIXL). `cuda_ipc` named explicitly with KV on the host
moves host memory through a shared-memory arena (the same protocol; how it is tested on CPU).
Importing this module imports neither NIXL, Ray nor cupy: the factory does, for what it builds.
"""

from __future__ import annotations

import sys
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from transfer.cuda_ipc import CudaIpcConfig, this_node
from transfer.nixl import NixlConfig, nixl_available
from transfer.transport import KVTransport
from transfer.units import MIB

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

TransportKind = Literal["auto", "nixl", "cuda_ipc", "object_store", "local"]
KINDS = ("auto", "nixl", "cuda_ipc", "object_store", "local")


@dataclass(frozen=True)
class TransferConfig:
    kind: TransportKind = "auto"
    send_staging_bytes: int = 128 * MIB  # NIXL only: registered memory shards are sent from
    recv_staging_bytes: int = 128 * MIB  # room for arrived, unreleased shards (every transport)
    probe_interval_s: float = 0.05  # NIXL only: liveness probe of a peer a send waits on
    grant_ttl_s: float = 60.0  # NIXL and cuda_ipc: room granted to a sender that never writes is reclaimed
    ucx_net_devices: str | None = "lo"  # NIXL only: "lo" binds 127.0.0.1 only; a cluster names its NICs

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown transport kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        if min(self.send_staging_bytes, self.recv_staging_bytes) <= 0 or self.probe_interval_s <= 0:
            raise ValueError("staging sizes and probe_interval_s must be positive")


def _cuda_device(kv_device: "str | torch.device | None") -> str | None:
    """"cuda:k" when `kv_device` names a CUDA device, else None."""
    if kv_device is None:
        return None
    text = str(kv_device)
    if not text.startswith("cuda"):
        return None
    if text == "cuda":
        import torch

        return f"cuda:{torch.cuda.current_device()}"
    return text


def _cuda_ipc_available() -> bool:
    from transfer.cuda_memory import cuda_ipc_available

    return cuda_ipc_available()


def resolve_kind(kind: TransportKind, kv_device: "str | torch.device | None" = None,
                 peer_node: str | None = None) -> TransportKind:
    """The concrete kind `auto` stands for on this machine and in this process (see the module notes)."""
    if kind != "auto":
        return kind
    if _cuda_device(kv_device) is not None and peer_node == this_node() and _cuda_ipc_available():
        return "cuda_ipc"
    if nixl_available():
        return "nixl"
    # Ray stays out of this module: a process inside a Ray deployment has imported it already.
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return "object_store"
    return "local"


def make_transport(name: str, cfg: TransferConfig | None = None,
                   resolver: Callable[[str], bytes | None] | None = None,
                   kv_device: "str | torch.device | None" = None, peer_node: str | None = None) -> KVTransport:
    """Builds the configured transport. `resolver(peer_name)` (NIXL and cuda_ipc) fetches a peer's
    current metadata over the caller's channel, so a peer that failed and restarted is re-added on
    demand. `kv_device` is where the KV lives: on a CUDA device, cuda_ipc's arena and NIXL's staging
    are device memory there (host memory otherwise); with `peer_node` it also steers `auto`."""
    cfg = cfg or TransferConfig()
    kind = resolve_kind(cfg.kind, kv_device, peer_node)
    device = _cuda_device(kv_device)
    logger.info("transport %s: %s%s", name, kind, f" ({device})" if device else "")
    if kind == "cuda_ipc":
        from transfer.cuda_ipc import CudaIpcTransport

        ipc_cfg = CudaIpcConfig(recv_staging_bytes=cfg.recv_staging_bytes, device=device, grant_ttl_s=cfg.grant_ttl_s)
        return CudaIpcTransport(name, ipc_cfg, resolver)
    if kind == "nixl":
        from transfer.nixl import NixlTransport

        nixl_cfg = NixlConfig(
            send_staging_bytes=cfg.send_staging_bytes, recv_staging_bytes=cfg.recv_staging_bytes,
            probe_interval_s=cfg.probe_interval_s, grant_ttl_s=cfg.grant_ttl_s, ucx_net_devices=cfg.ucx_net_devices,
            staging_device=device,
        )
        return NixlTransport(name, nixl_cfg, resolver)
    if kind == "object_store":
        from transfer.object_store import ObjectStoreTransport

        return ObjectStoreTransport(name, cfg.recv_staging_bytes)
    from transfer.local import LocalTransport

    return LocalTransport(name, cfg.recv_staging_bytes)
