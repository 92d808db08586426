"""Bookings: what each in-flight request is charged against its workers' accounts.

Mental model: placing a request charges its prefill worker (predicted compute seconds into the
backlog of its class) and its decode worker (a committed row with its KV blocks). As the request
moves on, the charges move with it: prefill done releases the backlog; decode activation turns the
committed row into an active one (counted in the TPOT cap, its TPOT target into the worker's
tightest-target tracker, a batch-class row into the worker's preemption victims); finishing,
cancelling, preemption or a worker's death releases whatever is left. Keeping the exact amounts
charged in the `Booking` makes every release the mirror image of its charge, so the accounts
cannot drift however events interleave.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.descriptors import RequestId, WorkerName
from cluster.workers import WorkerRegistry

NONE, COMMITTED, ACTIVE = 0, 1, 2


@dataclass(slots=True)
class Booking:
    """Charges of one request. `slack_key_s` orders batch rows as preemption victims."""

    request_id: RequestId
    rank: int
    prefill: WorkerName | None
    prefill_cost_s: float
    decode: WorkerName | None
    blocks: int
    context_tokens: int
    tpot_s: float | None
    slack_key_s: float
    queue_deadline_s: float
    predicted_first_token_s: float = 0.0
    prefill_open: bool = False
    decode_state: int = NONE


class Ledger:
    """Bookings by request id, applied to the views in a `WorkerRegistry`. A charge against a
    worker that has since died is dropped with the worker."""

    def __init__(self, workers: WorkerRegistry) -> None:
        self.workers = workers
        self._bookings: dict[RequestId, Booking] = {}

    def get(self, rid: RequestId) -> Booking | None:
        return self._bookings.get(rid)

    def open(self, b: Booking, *, prefill: bool = True, decode_active: bool = False) -> None:
        assert b.request_id not in self._bookings, f"{b.request_id} booked twice"
        self._bookings[b.request_id] = b
        if prefill and b.prefill is not None:
            w = self.workers.get(b.prefill)
            if w is not None:
                w.backlog_s[b.rank] += b.prefill_cost_s
                w.num_prefill_queued += 1
                b.prefill_open = True
        if b.decode is not None:
            w = self.workers.get(b.decode)
            if w is not None:
                w.num_committed += 1
                w.committed_blocks += b.blocks
                b.decode_state = COMMITTED
                if decode_active:
                    self.activate_decode(b.request_id)

    def prefill_done(self, rid: RequestId) -> None:
        b = self._bookings.get(rid)
        if b is None or not b.prefill_open:
            return
        b.prefill_open = False
        w = self.workers.get(b.prefill) if b.prefill is not None else None
        if w is not None:
            w.backlog_s[b.rank] = max(0.0, w.backlog_s[b.rank] - b.prefill_cost_s)
            w.num_prefill_queued -= 1

    def activate_decode(self, rid: RequestId) -> None:
        b = self._bookings.get(rid)
        if b is None or b.decode_state != COMMITTED:
            return
        b.decode_state = ACTIVE
        w = self.workers.get(b.decode) if b.decode is not None else None
        if w is None:
            return
        w.num_committed -= 1
        w.committed_blocks -= b.blocks
        w.num_active += 1
        w.active_blocks += b.blocks
        w.blocks_since_report += b.blocks
        w.active_context_tokens += b.context_tokens
        if b.tpot_s is not None:
            w.tpot_targets.add(b.tpot_s)
        if b.rank == 1:
            w.victims.add(rid, b.slack_key_s)

    def release_decode(self, rid: RequestId) -> None:
        b = self._bookings.get(rid)
        if b is None or b.decode_state == NONE:
            return
        w = self.workers.get(b.decode) if b.decode is not None else None
        if w is not None:
            if b.decode_state == COMMITTED:
                w.num_committed -= 1
                w.committed_blocks -= b.blocks
            else:
                w.num_active -= 1
                w.active_blocks -= b.blocks
                w.active_context_tokens -= b.context_tokens
                if b.tpot_s is not None:
                    w.tpot_targets.discard(b.tpot_s)
                w.victims.discard(rid)
        b.decode_state = NONE

    def close(self, rid: RequestId) -> Booking | None:
        """Release every remaining charge and forget the booking."""
        self.prefill_done(rid)
        self.release_decode(rid)
        return self._bookings.pop(rid, None)

    def __len__(self) -> int:
        return len(self._bookings)
