"""The one contract every KV transport keeps, its named errors, and the stats it reports.

Mental model: a transport is a mailbox with a name. A peer learns how to reach it from `metadata()`
(opaque bytes, carried by whatever channel the caller already has, e.g. a Ray call), `add_peer`s it,
and then `send`s it a batch of shards: opaque byte strings, which the codec makes. The receiver
takes them out one at a time with `recv`, in arrival order, so it can write shard i into its block
pool while shard i+1 is still in flight. The transport never looks inside a shard (except to count
its uncompressed size for stats), and never pickles one.

A shard is host bytes, or a uint8 torch tensor (the codec makes these with `encode(..., device=)`).
Transports that move device memory (cuda_ipc, NIXL with VRAM staging) take a device tensor as it is
and hand out `Delivery.data` as a device tensor; the host transports copy a device shard down once
(`as_bytes_view`), since host memory is what they move.
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Union, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Anything exposing the buffer protocol as contiguous bytes: bytes, bytearray, memoryview, uint8 arrays;
# or a contiguous uint8 torch tensor on any device.
Buffer = Union[bytes, bytearray, memoryview, np.ndarray, "torch.Tensor"]


class TransferError(Exception):
    """Base of the expected failures of a transfer; each names the peer when one is involved."""


class TransferTimeout(TransferError):
    """A deadline passed: nothing arrived for `recv`, or the peer did not take a shard in time
    (a frozen or overloaded peer looks like this)."""


class PeerGone(TransferError):
    """The peer died, closed, was never added, or was forgotten. The transport has already dropped
    it; a restarted peer works again once its new metadata is added (or the resolver finds it)."""


class CorruptShard(TransferError):
    """A shard's bytes do not match its checksum, or are truncated or not a shard at all."""


class IncompatiblePeer(TransferError):
    """The peer speaks another format version, or its KV layout (model, shapes) differs from ours."""


class Delivery:
    """One arrived shard. `data` (a memoryview, or a uint8 tensor on the GPU for transports that land
    shards in device memory) may be a view into the transport's receive staging: it is valid until
    `release()`, which hands the room back for the next shards (a sender waiting for room waits on
    it). Use it as a context manager; `shard_index`/`num_shards` count within the sender's `send`.
    A delivery dropped unreleased is released when collected, with a warning."""

    __slots__ = ("peer", "tag", "shard_index", "num_shards", "data", "_release", "_finalizer", "__weakref__")

    def __init__(self, peer: str, tag: int, shard_index: int, num_shards: int, data: "memoryview | torch.Tensor",
                 release: Callable[[], None] | None = None) -> None:
        self.peer = peer
        self.tag = tag
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.data = data
        self._release = release
        self._finalizer = weakref.finalize(self, _release_dropped, release) if release is not None else None

    def release(self) -> None:
        if self._finalizer is not None and self._finalizer.detach() is not None and self._release is not None:
            self._release()  # detach() succeeds once: a second release() is a no-op
        if not isinstance(self.data, memoryview):
            return  # a device tensor view: nothing to revoke, the caller promised not to use it
        try:
            self.data.release()  # any later use of the view fails loudly instead of reading reused room
        except BufferError:
            pass  # something (a tensor view) still exports it; the caller promised not to use it

    def __enter__(self) -> "Delivery":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _release_dropped(release: Callable[[], None]) -> None:
    logger.warning("a Delivery was dropped without release(); freeing its room now")
    release()


@dataclass(frozen=True)
class SendStats:
    """What one completed `send` cost."""

    peer: str
    num_shards: int
    wire_bytes: int  # as sent, after compression and with headers
    raw_bytes: int  # the KV before compression (wire bytes for shards that are not codec shards)
    latency_s: float


@dataclass
class PeerStats:
    """Running totals for one peer, both directions."""

    sends: int = 0
    shards_sent: int = 0
    shards_received: int = 0
    wire_bytes_sent: int = 0
    raw_bytes_sent: int = 0
    wire_bytes_received: int = 0
    timeouts: int = 0
    peer_gone: int = 0
    send_latency_ms_p50: float = 0.0
    send_latency_ms_p99: float = 0.0
    send_latency_ms_max: float = 0.0


@dataclass(frozen=True)
class TransportStats:
    """A snapshot. The `*_in_flight`/`*_in_use` fields are zero when the transport is idle: tests use
    them to show that a failure leaked no transfer handle and no staging space."""

    name: str
    kind: str
    peers: dict[str, PeerStats]  # every peer ever seen, for its counters
    connected_peers: tuple[str, ...] = ()  # peers this endpoint can send to now
    transfers_in_flight: int = 0
    staging_in_use_bytes: int = 0
    registered_bytes: int = 0


@runtime_checkable
class KVTransport(Protocol):
    """Moves shards between named endpoints. The contract:

    - `register_buffers(send_bytes, recv_bytes)` sizes the memory the transport moves shards
      through (NIXL registers it with the NIC). Constructors call it with their config's sizes;
      calling it again (only while idle) changes `metadata()`, which must then be re-published.
      No single shard may exceed `recv_bytes` of the receiving peer (`ValueError` otherwise).
    - `metadata()` is what a peer needs to reach this endpoint: opaque, binary, small. The caller
      carries it over its own channel and the peer calls `add_peer(metadata)`, which returns the
      peer's name. Adding a name again replaces the old entry: that is how a restarted peer comes
      back. A sender that adds a receiver is enough; the receiver learns the sender by itself.
    - `send(peer, shards, tag=, timeout_s=)` delivers all shards, in parallel where the transport
      can, and returns once every shard sits in the receiver's buffers. It raises `TransferTimeout`
      when `timeout_s` passes first, and `PeerGone` when the peer is unknown or fails (then the peer
      is forgotten: see above). After either, the receiver may hold some shards of that `tag` and
      must drop an incomplete transfer after its own deadline. Nothing leaks on failure: no
      transfer handle, no staging space, no thread.
    - `recv(timeout_s)` hands out the next arrived shard as a `Delivery` (any sender, arrival
      order), or raises `TransferTimeout`. `Delivery.release()` (or leaving its `with` block)
      frees its room for the next shards; its `data` must not be used after that.
    - `remove_peer(name)` forgets a peer; `stats()` snapshots per-peer counters; `close()` ends
      everything and is idempotent. Every method is bounded in time and thread-safe.
    - Optional, outside the structural check: `expect_senders(expected)`, a hint from the receiving
      side that shards are announced (True) or no longer (False). A transport that must poll for
      arrivals (NIXL) polls fast while they are expected and rarely when idle; others need not have it.
    """

    name: str

    def register_buffers(self, send_bytes: int, recv_bytes: int) -> None: ...

    def metadata(self) -> bytes: ...

    def add_peer(self, metadata: bytes) -> str: ...

    def remove_peer(self, peer: str) -> None: ...

    def send(self, peer: str, shards: Sequence[Buffer], *, tag: int = 0, timeout_s: float) -> SendStats: ...

    def recv(self, timeout_s: float) -> Delivery: ...

    def stats(self) -> TransportStats: ...

    def close(self) -> None: ...


class PeerStatsBook:
    """Thread-safe per-peer counters shared by the transports; keeps the last 1024 send latencies
    per peer for percentiles, so memory stays bounded however long a transport runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peers: dict[str, PeerStats] = {}
        self._latencies: dict[str, collections.deque[float]] = {}

    def _get(self, peer: str) -> PeerStats:
        if peer not in self._peers:
            self._peers[peer] = PeerStats()
            self._latencies[peer] = collections.deque(maxlen=1024)
        return self._peers[peer]

    def sent(self, s: SendStats) -> None:
        with self._lock:
            p = self._get(s.peer)
            p.sends += 1
            p.shards_sent += s.num_shards
            p.wire_bytes_sent += s.wire_bytes
            p.raw_bytes_sent += s.raw_bytes
            lat = self._latencies[s.peer]
            lat.append(s.latency_s * 1e3)
            ordered = sorted(lat)
            p.send_latency_ms_p50 = ordered[len(ordered) // 2]
            p.send_latency_ms_p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
            p.send_latency_ms_max = max(p.send_latency_ms_max, s.latency_s * 1e3)

    def received(self, peer: str, wire_bytes: int) -> None:
        with self._lock:
            p = self._get(peer)
            p.shards_received += 1
            p.wire_bytes_received += wire_bytes

    def failed(self, peer: str, error: TransferError) -> None:
        with self._lock:
            p = self._get(peer)
            if isinstance(error, TransferTimeout):
                p.timeouts += 1
            elif isinstance(error, PeerGone):
                p.peer_gone += 1

    def snapshot(self) -> dict[str, PeerStats]:
        with self._lock:
            return {name: PeerStats(**vars(p)) for name, p in self._peers.items()}


def takes_device_shards(transport: object) -> bool:
    """Whether `transport` moves GPU memory itself, so a sender should hand it shards encoded on the
    GPU (`encode(..., device=kv.device)`) rather than host bytes."""
    return bool(getattr(transport, "device_shards", False))


def is_tensor(shard: Any) -> bool:
    """Whether `shard` is a torch tensor (checked without importing torch)."""
    return type(shard).__module__.startswith("torch") and hasattr(shard, "data_ptr")


def as_bytes_view(shard: Buffer) -> memoryview:
    """A flat byte view of any buffer: no copy, except that a device tensor is copied to the host
    once (a host transport moves host memory)."""
    if is_tensor(shard):
        shard = shard.detach().reshape(-1).cpu().numpy()  # type: ignore[union-attr]
    view = memoryview(shard)  # type: ignore[arg-type]
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B") if view.c_contiguous else memoryview(bytes(view))
    return view
