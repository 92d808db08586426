"""Transport over the Ray object store: the fallback every Ray deployment has, with no NIXL needed.

Mental model: each endpoint owns a small mailbox actor (an asyncio queue of object refs, bounded in
bytes). `send` `ray.put`s each shard as a uint8 array (Ray moves it out of band; the shard itself is
the codec's binary format, never pickled objects) and hands the refs to the peer's mailbox in one
call; `recv` takes the next ref from its own mailbox and maps the bytes zero-copy. The mailbox is
created by, and so dies with, the endpoint's process: a dead receiver shows up as a failed call
(`PeerGone`), a dead sender as a lost object (`PeerGone` on `recv`). The only file that imports Ray.
"""

from __future__ import annotations

import asyncio
import collections
import os
import struct
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError

from transfer.header import peek_raw_bytes
from transfer.transport import (
    Buffer,
    Delivery,
    IncompatiblePeer,
    PeerGone,
    PeerStatsBook,
    SendStats,
    TransferError,
    TransferTimeout,
    TransportStats,
    as_bytes_view,
)
from transfer.units import MIB

_MAGIC = b"FKVO"
_ENVELOPE = struct.Struct("<4sQHH")  # magic, incarnation, name length, actor-name length
_GRACE_S = 5.0  # extra time for a remote call that itself waits up to its timeout
_START_S = 60.0  # a mailbox actor's start on a busy node


class Mailbox:
    """The actor body: shards waiting for their receiver, at most `capacity_bytes` of them."""

    def __init__(self, capacity_bytes: int) -> None:
        self._capacity = capacity_bytes
        self._used = 0
        self._items: collections.deque[tuple[str, int, int, int, int, list[Any]]] = collections.deque()
        self._cond = asyncio.Condition()

    async def put(self, sender: str, tag: int, sizes: list[int], refs: list[Any], timeout_s: float) -> int:
        """Queues the shards in order; returns how many fit before `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        async with self._cond:
            for i, (size, ref) in enumerate(zip(sizes, refs)):
                while self._used + size > self._capacity:
                    try:
                        await asyncio.wait_for(self._cond.wait(), max(0.0, deadline - time.monotonic()))
                    except asyncio.TimeoutError:
                        return i
                self._used += size
                self._items.append((sender, tag, i, len(sizes), size, [ref]))  # nested: stays a ref
                self._cond.notify_all()
        return len(sizes)

    async def take(self, timeout_s: float) -> tuple[str, int, int, int, int, list[Any]] | None:
        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: bool(self._items)), timeout_s)
            except asyncio.TimeoutError:
                return None
            item = self._items.popleft()
            self._used -= item[4]
            self._cond.notify_all()
            return item


class ObjectStoreTransport:
    kind = "object_store"

    def __init__(self, name: str, recv_bytes: int = 128 * MIB) -> None:
        if not ray.is_initialized():
            raise RuntimeError("the object_store transport needs a running Ray (ray.init) in this process")
        self.name = name
        self._incarnation = int.from_bytes(os.urandom(8), "little")
        self._actor_name = f"ferry-kv-mailbox-{name}-{self._incarnation:016x}"
        self._mailbox = self._start_mailbox(recv_bytes)
        self._peers: dict[str, Any] = {}
        self._book = PeerStatsBook()
        self._closed = False

    def _start_mailbox(self, recv_bytes: int) -> Any:
        actor = ray.remote(num_cpus=0, max_restarts=0)(Mailbox)
        handle = actor.options(name=self._actor_name).remote(recv_bytes)
        # Up before the first `recv`: a `take` sent to a mailbox still starting can outlive its
        # caller's deadline and run later, popping a shard that nobody then receives.
        ray.get(handle.__ray_ready__.remote(), timeout=_START_S)
        return handle

    def register_buffers(self, send_bytes: int, recv_bytes: int) -> None:
        old, self._mailbox = self._mailbox, None
        ray.kill(old)  # the new mailbox has a new name, so peers re-add our metadata
        self._actor_name = f"{self._actor_name.rsplit('-', 1)[0]}-{os.urandom(8).hex()}"
        self._mailbox = self._start_mailbox(recv_bytes)

    def metadata(self) -> bytes:
        # the namespace travels too, so a peer in another Ray job finds the mailbox
        name = self.name.encode()
        actor = f"{ray.get_runtime_context().namespace}/{self._actor_name}".encode()
        return _ENVELOPE.pack(_MAGIC, self._incarnation, len(name), len(actor)) + name + actor

    def add_peer(self, metadata: bytes) -> str:
        if len(metadata) < _ENVELOPE.size or metadata[:4] != _MAGIC:
            raise IncompatiblePeer("not object-store transport metadata (a peer of another transport kind?)")
        _, _, name_len, actor_len = _ENVELOPE.unpack_from(metadata, 0)
        if len(metadata) != _ENVELOPE.size + name_len + actor_len:
            raise IncompatiblePeer("object-store transport metadata is truncated")
        at = _ENVELOPE.size
        name = bytes(metadata[at : at + name_len]).decode()
        namespace, actor_name = bytes(metadata[at + name_len :]).decode().split("/", 1)
        try:
            self._peers[name] = ray.get_actor(actor_name, namespace=namespace)
        except ValueError as e:  # no such actor: the peer is gone already
            raise PeerGone(f"{name}'s mailbox {actor_name} is gone") from e
        return name

    def remove_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def send(self, peer: str, shards: Sequence[Buffer], *, tag: int = 0, timeout_s: float) -> SendStats:
        t0 = time.monotonic()
        views = [as_bytes_view(s) for s in shards]
        try:
            mailbox = self._peers.get(peer)
            if mailbox is None:
                raise PeerGone(f"{peer} is not a peer of {self.name}: add its metadata first")
            refs = [ray.put(np.frombuffer(v, dtype=np.uint8)) for v in views]
            call = mailbox.put.remote(self.name, tag, [len(v) for v in views], refs, timeout_s)
            try:
                accepted = ray.get(call, timeout=timeout_s + _GRACE_S)
            except GetTimeoutError:
                raise TransferTimeout(f"{peer}'s mailbox did not answer within {timeout_s:.3f}s") from None
            except RayActorError as e:
                self._peers.pop(peer, None)
                raise PeerGone(f"{peer} is gone: {type(e).__name__}") from e
            if accepted < len(views):
                raise TransferTimeout(f"{peer} took {accepted}/{len(views)} shards before the deadline")
        except TransferError as e:
            self._book.failed(peer, e)
            raise
        raw = sum(peek_raw_bytes(v) or len(v) for v in views)
        stats = SendStats(peer, len(views), sum(len(v) for v in views), raw, time.monotonic() - t0)
        self._book.sent(stats)
        return stats

    def recv(self, timeout_s: float) -> Delivery:
        deadline = time.monotonic() + timeout_s
        try:
            item = ray.get(self._mailbox.take.remote(timeout_s), timeout=timeout_s + _GRACE_S)
        except GetTimeoutError:
            item = None
        if item is None:
            raise TransferTimeout(f"{self.name}: no shard arrived within {timeout_s:.3f}s")
        sender, tag, index, count, size, (ref,) = item
        try:
            # the shard is already in the store: this only maps it, so a short floor is enough
            array = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
        except ObjectLostError as e:  # includes OwnerDiedError: the sender died before we got it
            raise PeerGone(f"shard from {sender} was lost with its sender: {type(e).__name__}") from e
        except GetTimeoutError:
            raise TransferTimeout(f"{self.name}: shard from {sender} did not map in time") from None
        self._book.received(sender, size)
        return Delivery(sender, tag, index, count, memoryview(array))

    def stats(self) -> TransportStats:
        return TransportStats(self.name, self.kind, self._book.snapshot(), connected_peers=tuple(sorted(self._peers)))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._peers.clear()
        try:
            ray.kill(self._mailbox)
        except Exception:  # Ray already shut down: the actor went with it
            pass
