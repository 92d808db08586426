"""Frozen configuration of the data-plane workers and of the caller that drives them.

`WorkerConfig` is one section per worker process: which model, how its engine is sized, how KV
leaves it (transport kind, compression, shards) and the deadlines it keeps. `ClientConfig` is the
caller's deadlines. pydantic validation of user input lives in deploy/; these only check invariants.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.engine.config import EngineConfig
from transfer.codec import Compression
from transfer.config import TransferConfig

MIB = 1 << 20


@dataclass(frozen=True)
class WorkerConfig:
    model: str  # a known name ("smollm2"), a GGUF file or an HF folder
    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(
        default_factory=lambda: TransferConfig(send_staging_bytes=64 * MIB, recv_staging_bytes=64 * MIB))
    compression: str = "none"  # KV on the wire: none (bit-exact), int8 or fp8
    num_shards: int = 2  # layer groups per transfer (capped at the model's layer count)
    pool_compression: str = "none"  # blocks offered to the prefix-cache pool; none keeps them exact
    lease_s: float = 30.0  # decode: announced KV must land within this, else the blocks are freed
    transfer_timeout_s: float = 10.0  # prefill: one send, all shards
    recv_poll_s: float = 0.05  # decode: receiver wake-up period (also the lease check period)
    pool_timeout_s: float = 2.0  # prefill: one pool fan-out; a slower store is a miss
    max_pending_offers: int = 64  # prefill: background pool offers beyond this are dropped
    stream_interval: int = 1  # decode: tokens per streamed delta after the first (1 = every token)
    # Deprecated twin of `transfer.ucx_net_devices` (the transport's own setting, "lo" by default),
    # kept while deploy/config.py still passes it; when set it is applied first and so wins.
    ucx_net_devices: str | None = None

    def __post_init__(self) -> None:
        Compression.parse(self.compression)
        Compression.parse(self.pool_compression)
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        for name in ("lease_s", "transfer_timeout_s", "recv_poll_s", "pool_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.transfer_timeout_s >= self.lease_s:
            # a send that is still allowed to finish after the receiver gave up would be wasted
            raise ValueError("transfer_timeout_s must be shorter than lease_s")


@dataclass(frozen=True)
class ClientConfig:
    call_timeout_s: float = 10.0  # announce, load, abort
    prefill_timeout_s: float = 60.0  # a whole prefill: queue, lookup, compute, send
    token_timeout_s: float = 60.0  # between two streamed events (the first waits for the prefill too)
    load_ttl_s: float = 0.2  # how long polled worker loads are trusted
    room_wait_s: float = 30.0  # a new request that finds every decode row taken queues this long (0: refuse at once)

    def __post_init__(self) -> None:
        if min(self.call_timeout_s, self.prefill_timeout_s, self.token_timeout_s) <= 0 or self.load_ttl_s < 0:
            raise ValueError("timeouts must be positive and load_ttl_s >= 0")
        if self.room_wait_s < 0:
            raise ValueError("room_wait_s must be >= 0")
