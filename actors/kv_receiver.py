"""The decode side's landing strip: shards in, written into reserved blocks, request committed.

Mental model: a decode worker `expect`s a request once its blocks are reserved; from then on the
request is a `_Reservation` keyed by its transfer tag, with a lease deadline. One thread loops on
`transport.recv(poll)`, taking each arrival together with whatever else already arrived: the shards
are decoded and checked against their reservations (tag, block count) outside any lock, then
written into the reserved blocks in one engine-lock wait (the engine is locked for a whole step, so
a wait per shard would cost a step per shard), and the requests whose last shard landed are
committed into the running batch in that same wait. Deliveries are released right after, so the
senders' next shards get the room. The same loop expires reservations whose lease
passed: their blocks are freed and their streams fail with `KVNotArrived`. Shards of an unknown
tag (late, or of an expired or aborted request) are released and dropped. For MoE models, a delivery
under a pending request's choice tag is its expert choice (`moe_handoff.py`, sent just before the
KV): kept on the reservation and given to the engine's budget tracker right before the commit. Each decode is timed, by codec
(`ReceiverStats.decode_s`): the receiving side's own share of a transfer's codec cost.

Locking: `_lock` guards the reservations and is held across "find reservation -> write blocks ->
commit", so a `cancel` cannot free blocks that are being written (the engine lock is only ever
taken inside `_lock`, never the other way round). An abort that reaches the engine directly (a
stream consumer that went away) is caught under the engine lock, right before the write: a
reservation whose blocks the engine no longer holds for it is never written to.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from actors.engine.async_engine import AsyncEngine
from actors.errors import HandoffFailed, KVNotArrived, RequestAborted
from actors.handoff import transfer_tag
from actors.moe_handoff import choice_tag, decode_choice, forget_request, give_expert_choice
from transfer.codec import Compression, DecodedShard, KVLayout, decode_shard
from transfer.transport import Delivery, KVTransport, TransferError, TransferTimeout

logger = logging.getLogger(__name__)
MAX_BATCH = 64  # deliveries landed under one engine-lock wait
# With no reservation pending there is no lease to check and no shard to expect: the thread waits
# for the next `expect` (which wakes it at once) up to this long, then drains whatever came anyway
# (late shards of expired requests, released and dropped) and waits again.
IDLE_WAIT_S = 1.0


@dataclass(eq=False)  # identity-hashed: a dict key while its shards land
class _Reservation:
    request_id: str
    block_ids: list[int]
    deadline: float  # time.monotonic()
    shards_seen: set[int] = field(default_factory=set)
    wire_bytes: int = 0
    experts: list[list[int]] | None = None  # its expert choice, sent by the prefill worker before the KV


@dataclass(frozen=True)
class ReceiverStats:
    num_pending: int
    num_committed: int
    num_expired: int
    num_failed: int
    num_dropped_shards: int  # late or unknown
    wire_bytes: int
    # This side's own codec cost, by codec name: seconds in `decode_shard` and the raw KV bytes
    # those shards held (the sender's chooser predicts this; here is what it really was).
    decode_s: dict[str, float] = field(default_factory=dict)
    decoded_raw_bytes: dict[str, int] = field(default_factory=dict)


class KVReceiver:
    def __init__(self, async_engine: AsyncEngine, transport: KVTransport, layout: KVLayout,
                 poll_s: float = 0.05) -> None:
        self.engine = async_engine
        self.transport = transport
        self.layout = layout
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._pending: dict[int, _Reservation] = {}
        self._choices: dict[int, int] = {}  # MoE models: a pending request's choice tag -> its KV tag
        self._num_committed = self._num_expired = self._num_failed = self._num_dropped = 0
        self._wire_bytes = 0
        self._decode_s: dict[str, float] = {}
        self._decoded_raw_bytes: dict[str, int] = {}
        self._told_expecting = False  # what the transport was last told (`_tell_expecting`)
        self._stop = threading.Event()
        self._announced = threading.Event()  # set by `expect` and `close`: an idle receiver thread wakes
        self._thread = threading.Thread(target=self._run, name=f"kv-recv-{transport.name}", daemon=True)
        self._thread.start()

    def expect(self, request_id: str, block_ids: list[int], lease_s: float) -> None:
        """Starts the lease of a reservation the engine already holds (`Engine.reserve`)."""
        with self._lock:
            tag = transfer_tag(request_id)
            assert tag not in self._pending, f"{request_id} is already expected"
            self._pending[tag] = _Reservation(request_id, block_ids, time.monotonic() + lease_s)
            if self.engine.engine.model_config.is_moe:
                self._choices[choice_tag(request_id)] = tag
            self._tell_expecting()
        self._announced.set()

    def cancel(self, request_id: str, error: BaseException) -> bool:
        """Frees a pending reservation and fails its stream; False if it is not pending."""
        with self._lock:
            res = self._pop(transfer_tag(request_id))
            if res is not None:
                self._drop(res, error)
        return res is not None

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def stats(self) -> ReceiverStats:
        with self._lock:
            return ReceiverStats(len(self._pending), self._num_committed, self._num_expired, self._num_failed,
                                 self._num_dropped, self._wire_bytes, dict(self._decode_s),
                                 dict(self._decoded_raw_bytes))

    def close(self) -> None:
        self._stop.set()
        self._announced.set()
        self._thread.join(timeout=max(1.0, 4 * self.poll_s))
        with self._lock:
            for res in list(self._pending.values()):
                self._drop(res, RequestAborted(f"{res.request_id}: decode worker closed"))
            self._pending.clear()
            self._choices.clear()

    # ------------------------------------------------------------------------ receiver thread
    def _run(self) -> None:
        while not self._stop.is_set():
            batch = self._take()
            try:
                if batch:
                    self._land(batch)
                self._expire(time.monotonic())
            except Exception:  # keep landing other requests' KV; this one's lease will expire
                logger.exception("%s: receiver step failed", self.transport.name)
            finally:
                _wait_for_device_reads(batch)
                for delivery in batch:
                    delivery.release()

    def _take(self) -> list[Delivery]:
        """The next delivery (waiting up to `poll_s`) and every other one already there; with no
        reservation pending, first the next `expect` (up to `IDLE_WAIT_S`)."""
        batch: list[Delivery] = []
        self._announced.clear()  # before looking: an `expect` from here on is seen below or ends the wait
        with self._lock:
            self._tell_expecting()
            idle = not self._pending
        if idle:
            self._announced.wait(IDLE_WAIT_S)
            if self._stop.is_set():
                return batch
        wait_s = self.poll_s
        while len(batch) < MAX_BATCH:
            try:
                batch.append(self.transport.recv(timeout_s=wait_s))
            except TransferTimeout:
                break
            except TransferError as e:  # e.g. a sender died with its shard: its lease will expire
                logger.warning("%s: receive failed: %s", self.transport.name, e)
                break
            wait_s = 0.0
        return batch

    def _tell_expecting(self) -> None:
        # Caller holds _lock. A transport that must poll for arrivals (NIXL) polls warm while KV is
        # announced and cold otherwise (`expect_senders`, optional in the KVTransport contract).
        expecting = bool(self._pending)
        tell = getattr(self.transport, "expect_senders", None)
        if tell is not None and expecting != self._told_expecting:
            tell(expecting)
            self._told_expecting = expecting

    def _land(self, batch: list[Delivery]) -> None:
        with self._lock:
            writes: list[tuple[_Reservation, DecodedShard, int]] = []
            for d in batch:
                res = self._pending.get(d.tag)
                if res is None and d.tag in self._choices:
                    self._take_choice(d)
                    continue
                if res is None:
                    self._num_dropped += 1
                    logger.info("%s: dropped a shard of unknown or expired tag %#x", self.transport.name, d.tag)
                    continue
                try:
                    started = time.perf_counter()
                    shard = decode_shard(d.data, self.layout)
                    self._count_decode(shard, time.perf_counter() - started)
                    h = shard.header
                    if h.transfer_id != d.tag or h.num_blocks != len(res.block_ids):
                        raise HandoffFailed(f"{res.request_id}: shard of transfer {h.transfer_id:#x} with "
                                            f"{h.num_blocks} blocks for {len(res.block_ids)} reserved ones")
                except (TransferError, ValueError, HandoffFailed) as e:
                    self._fail(d.tag, e if isinstance(e, HandoffFailed) else HandoffFailed(f"{res.request_id}: {e}"))
                    continue
                writes.append((res, shard, len(d.data)))
            if not writes:
                return
            # One engine-lock wait (up to a step) for the whole batch, not one per shard.
            for res, outcome in self.engine.locked(self._write_and_commit, writes).items():
                tag = transfer_tag(res.request_id)
                if outcome == "committed":
                    self._pop(tag)
                    self._num_committed += 1
                    self._wire_bytes += res.wire_bytes
                elif outcome == "gone":
                    self._fail(tag, RequestAborted(f"{res.request_id}: its reservation was dropped"))

    def _count_decode(self, shard: DecodedShard, seconds: float) -> None:
        # Caller holds _lock.
        codec = Compression(shard.header.compression).name.lower()
        self._decode_s[codec] = self._decode_s.get(codec, 0.0) + seconds
        self._decoded_raw_bytes[codec] = self._decoded_raw_bytes.get(codec, 0) + shard.header.raw_bytes

    def _write_and_commit(self, writes: list[tuple[_Reservation, DecodedShard, int]]) -> dict[_Reservation, str]:
        # Runs under the engine lock. The reservation is checked here, atomically with the write:
        # an engine-side abort may have freed (and reused) its blocks since the shard arrived.
        engine = self.engine.engine
        outcome: dict[_Reservation, str] = {}
        for res, shard, num_bytes in writes:
            if outcome.get(res) == "gone" or engine.kv.block_ids(res.request_id) != res.block_ids:
                outcome[res] = "gone"
                continue
            engine.runner.write_blocks(res.block_ids, shard.kv, shard.layers)
            res.shards_seen.add(shard.header.shard_index)
            res.wire_bytes += num_bytes
            if len(res.shards_seen) == shard.header.num_shards:
                if res.experts is not None and not give_expert_choice(engine, res.request_id, res.experts):
                    logger.warning("%s: expert choice of %s does not fit this model; it runs unrestricted",
                                   self.transport.name, res.request_id)
                engine.commit(res.request_id)
                outcome[res] = "committed"
            else:
                outcome.setdefault(res, "written")
        return outcome

    def _fail(self, tag: int, error: BaseException) -> None:
        # Caller holds _lock. A reservation may already have failed on an earlier shard.
        res = self._pop(tag)
        if res is None:
            return
        self._num_failed += 1
        self._drop(res, error)

    def _expire(self, now: float) -> None:
        with self._lock:
            expired = [tag for tag, res in self._pending.items() if res.deadline <= now]
            for tag in expired:
                res = self._pending[tag]
                self._pop(tag)
                self._num_expired += 1
                logger.warning("%s: KV of %s did not arrive within its lease (%d/? shards)",
                               self.transport.name, res.request_id, len(res.shards_seen))
                self._drop(res, KVNotArrived(f"{res.request_id}: KV did not arrive before its lease expired"))

    def _drop(self, res: _Reservation, error: BaseException) -> None:
        # Caller holds _lock. Blocks first, so nothing reads or writes them once the stream fails.
        self.engine.locked(self._cancel, res.request_id)
        self.engine.fail_stream(res.request_id, error)

    def _cancel(self, request_id: str) -> None:
        # Under the engine lock: the reservation's blocks, and its expert budget and choice.
        self.engine.engine.cancel_reservation(request_id)
        forget_request(self.engine.engine, request_id)

    def _pop(self, tag: int) -> _Reservation | None:
        # Caller holds _lock.
        res = self._pending.pop(tag, None)
        if res is not None and self._choices:
            self._choices.pop(choice_tag(res.request_id), None)
        return res

    def _take_choice(self, d: Delivery) -> None:
        # Caller holds _lock. A request's expert choice, landed before its KV: kept until its commit.
        res = self._pending[self._choices[d.tag]]
        try:
            res.experts = decode_choice(d.data)
        except ValueError as e:
            logger.warning("%s: %s: %s; it runs unrestricted", self.transport.name, res.request_id, e)


def _wait_for_device_reads(batch: list[Delivery]) -> None:
    """Shards in GPU memory (cuda_ipc, NIXL with device staging) are read by copies and kernels
    that the writes only queued; their room may be handed to the next sender, another process
    writing on its own stream, only once those reads have run."""
    devices = {d.data.device for d in batch if isinstance(d.data, torch.Tensor) and d.data.is_cuda}
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
