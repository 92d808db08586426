"""Which transport an endpoint uses, as a config choice, and the one factory that builds it.

`kind="auto"` means NIXL where it imports (the fast path, and the same agent does RDMA on a GPU
cluster), else the Ray object store where Ray runs in this process, else the in-process transport.
Importing this module imports neither NIXL nor Ray: the factory does, for the kind it builds.
"""

from __future__ import annotations

import sys
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from transfer.nixl import NixlConfig, nixl_available
from transfer.transport import KVTransport

logger = logging.getLogger(__name__)

TransportKind = Literal["auto", "nixl", "object_store", "local"]
MIB = 1 << 20


@dataclass(frozen=True)
class TransferConfig:
    kind: TransportKind = "auto"
    send_staging_bytes: int = 128 * MIB  # NIXL only: registered memory shards are sent from
    recv_staging_bytes: int = 128 * MIB  # room for arrived, unreleased shards (every transport)
    probe_interval_s: float = 0.05  # NIXL only: liveness probe of a peer a send waits on
    grant_ttl_s: float = 60.0  # NIXL only: room granted to a sender that never writes is reclaimed
    ucx_net_devices: str | None = "lo"  # NIXL only: "lo" binds 127.0.0.1 only; a cluster names its NICs

    def __post_init__(self) -> None:
        if self.kind not in ("auto", "nixl", "object_store", "local"):
            raise ValueError(f"unknown transport kind {self.kind!r}; choose auto, nixl, object_store or local")
        if min(self.send_staging_bytes, self.recv_staging_bytes) <= 0 or self.probe_interval_s <= 0:
            raise ValueError("staging sizes and probe_interval_s must be positive")


def resolve_kind(kind: TransportKind) -> TransportKind:
    """The concrete kind `auto` stands for on this machine and in this process."""
    if kind != "auto":
        return kind
    if nixl_available():
        return "nixl"
    # Ray stays out of this module: a process inside a Ray deployment has imported it already.
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return "object_store"
    return "local"


def make_transport(name: str, cfg: TransferConfig | None = None,
                   resolver: Callable[[str], bytes | None] | None = None) -> KVTransport:
    """Builds the configured transport. `resolver(peer_name)` (NIXL only) fetches a peer's current
    metadata over the caller's channel, so a peer that failed and restarted is re-added on demand."""
    cfg = cfg or TransferConfig()
    kind = resolve_kind(cfg.kind)
    logger.info("transport %s: %s", name, kind)
    if kind == "nixl":
        from transfer.nixl import NixlTransport

        nixl_cfg = NixlConfig(
            send_staging_bytes=cfg.send_staging_bytes, recv_staging_bytes=cfg.recv_staging_bytes,
            probe_interval_s=cfg.probe_interval_s, grant_ttl_s=cfg.grant_ttl_s, ucx_net_devices=cfg.ucx_net_devices,
        )
        return NixlTransport(name, nixl_cfg, resolver)
    if kind == "object_store":
        from transfer.object_store import ObjectStoreTransport

        return ObjectStoreTransport(name, cfg.recv_staging_bytes)
    from transfer.local import LocalTransport

    return LocalTransport(name, cfg.recv_staging_bytes)
