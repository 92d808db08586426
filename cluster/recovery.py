"""RecoveryPlanner: dead workers' requests, preempted batch work, queue timeouts.

Mental model: a worker's death (an actor error reported by the data plane, or missed heartbeats
noticed by `GlobalScheduler.poll`) loses the KV it held. The journal lists the requests touched,
most urgent remaining SLO budget first (`Journal.recovery_plan`); each is released from every
account, then placed again as if new, except that it is never refused for its SLO (it was
admitted; it is served), it pays no fairness charge again, and its priority comes from what is
left of its budget. Those whose KV died are recomputed from prompt + streamed tokens
(`RECOMPUTE`, resuming at RNG position = tokens streamed); those that only lost their future
decode worker keep their prefill worker (`REDIRECT`). Preempted batch requests wait in a queue
by urgency and are resumed, most urgent first, as soon as a decode worker has a free row.
Requests still queued past their tenant's queue timeout are cancelled with a refusal, so nothing
waits forever (`expire`; timers are a heap with lazy deletion of stale entries).

The planner owns the two pieces of state only recovery reads: the resumption queue and the
queue-timeout timers. It decides who goes again, in which order and how; the scheduler, through
the `place` and `refuse` callables it hands over, still does the placing and the releasing, so
one code path commits every placement.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import replace

from cluster.admission import Refusal, RefusalReason
from cluster.descriptors import RequestId, WorkerName
from cluster.journal import JournalEntry, Phase, needs_prefill
from cluster.ordering import SlackQueue, priority_key
from cluster.parts import SchedulerParts
from cluster.placement import Placement, PlacementKind
from cluster.tenants import Tenant
from cluster.timeline import Stage

# Commit a placement of an admitted request (`GlobalScheduler._place`).
PlaceFn = Callable[[JournalEntry, Tenant, float, PlacementKind], Placement | Refusal]
# Count a refusal and release its request from every account, at a time.
RefuseFn = Callable[[Refusal, float], None]
# Prefill tokens per step a decode worker may add beside (rows, context tokens, cached tokens).
ChunkTokensFn = Callable[[WorkerName, int, int, int], int]
# A request to place again, and whether it must recompute its prompt and streamed tokens.
LostRequest = tuple[JournalEntry, bool]


class RecoveryPlanner:
    """Re-places requests that lost a worker, resumes preempted ones, expires stale queued ones.
    `seq` is the scheduler's own tie-break counter, shared so that every key it hands out (placement
    priorities, timers, the resumption queue) comes from one sequence."""

    def __init__(self, parts: SchedulerParts, *, seq: Iterator[int], place: PlaceFn, refuse: RefuseFn,
                 chunk_tokens: ChunkTokensFn) -> None:
        self._cfg = parts.cfg
        self._journal = parts.journal
        self._ledger = parts.ledger
        self._workers = parts.workers
        self._models = parts.models
        self._tenants = parts.tenants
        self._policy = parts.policy
        self._timelines = parts.timelines
        self._counters = parts.counters
        self._seq = seq
        self._place = place
        self._refuse = refuse
        self._chunk_tokens = chunk_tokens
        self._preempted: SlackQueue[RequestId] = SlackQueue()
        self._expiry: list[tuple[float, int, RequestId]] = []  # (deadline, seq, request), a min-heap

    # ---- dead workers ------------------------------------------------------------------------

    def recompute_s(self, entry: JournalEntry) -> float:
        """Predicted cost of replaying `entry` from scratch (on the first healthy prefill worker's
        model: only the ordering uses it, and models differ little between like workers)."""
        workers = self._workers.prefill
        if not workers:
            return 0.0
        n = entry.desc.num_prompt_tokens + entry.num_output_tokens
        return self._models.get(workers[0].name).predict_prefill(n)

    def plan(self, dead: WorkerName, now: float) -> list[LostRequest]:
        """The requests that lost state on `dead`, most urgent first, each released from its
        accounts; call before the worker is forgotten (the ordering prices replays on the
        workers known now)."""
        entries = self._journal.recovery_plan(dead, now, self.recompute_s)
        lost = [(e, needs_prefill(e, dead)) for e in entries]
        for entry in entries:
            self._ledger.close(entry.request_id)
        return lost

    def recover(self, entry: JournalEntry, now: float, recompute: bool) -> Placement | Refusal:
        """Place a released request again: recomputed, or redirected to a new decode worker.
        A refusal releases it for good."""
        tenant = self._tenants.get(entry.desc.tenant, now)
        assert tenant is not None, f"{entry.request_id}: tenant {entry.desc.tenant} vanished"
        entry.num_recoveries += 1
        if recompute:
            entry.phase = Phase.QUEUED
        kind = PlacementKind.RECOMPUTE if recompute else PlacementKind.REDIRECT
        out = self._place(entry, tenant, now, kind)
        if isinstance(out, Refusal):
            self._refuse(out, now)
        else:
            self._timelines.stamp(entry.request_id, Stage.RECOVERED, now)
            self._counters.num_recovered += 1
        return out

    # ---- preemption --------------------------------------------------------------------------

    def preempt(self, rid: RequestId, now: float) -> None:
        """Evict a running batch row: release its accounts, queue it for resumption by urgency."""
        entry = self._journal.get(rid)
        if entry is None:
            return
        self._ledger.close(rid)
        self._journal.move(rid, None, None, Phase.PREEMPTED)
        self.queue_preempted(entry, now)
        self._timelines.stamp(rid, Stage.PREEMPTED, now)
        self._counters.num_preempted += 1

    def queue_preempted(self, entry: JournalEntry, now: float) -> None:
        """Put a preempted request in the resumption queue, most urgent remaining budget first."""
        key = priority_key(entry.slo_class, now + entry.remaining_budget_s(now), 0.0, next(self._seq))
        self._preempted.push(entry.request_id, key)

    def drop_preempted(self, rid: RequestId) -> None:
        """`rid` no longer waits for resumption (it left, or the data plane runs it again)."""
        self._preempted.remove(rid)

    def resume(self, now: float) -> list[Placement]:
        """Place preempted batch requests again, most urgent first, while a decode row is free
        without preempting anyone (batch work never preempts); rows promised to requests still
        prefilling are not free (else the row just taken for an interactive request goes straight
        back to its victim). A resume recomputes its prompt and tokens on its decode worker, in
        chunks that keep the rows already there within their TPOT target (`_resume_chunk_tokens`)."""
        resumed: list[Placement] = []
        queue = self._preempted
        while queue:
            top = queue.peek()
            assert top is not None
            entry = self._journal.get(top[0])
            if entry is None:
                queue.pop()
                continue
            tenant = self._tenants.get(entry.desc.tenant, now)
            assert tenant is not None
            expected = tenant.expected_output_tokens(entry.desc.max_tokens, self._cfg.default_output_tokens)
            remaining = max(1, expected - entry.num_output_tokens)
            n = entry.desc.num_prompt_tokens + entry.num_output_tokens
            choice = self._policy.choose_decode(None, False, n + remaining, n, remaining, self._workers.decode,
                                                count_committed=True)
            if choice is None or not choice.feasible:
                break  # the most urgent one cannot run yet; the others, less urgent, wait behind it
            queue.pop()
            entry.phase = Phase.QUEUED
            placed = self._place(entry, tenant, now, PlacementKind.RECOMPUTE)
            if isinstance(placed, Placement):
                self._counters.num_resumed += 1
                chunk = self._resume_chunk_tokens(placed.decode_worker)
                resumed.append(replace(placed, local_chunk_tokens=chunk))
            else:
                self._refuse(placed, now)
        return resumed

    def _resume_chunk_tokens(self, name: WorkerName) -> int:
        """Prompt tokens per step for a recompute on decode worker `name` beside its rows (at least
        one hash block a step, however little room they leave)."""
        view = self._workers.get(name)
        rows, ctx = (view.num_active, view.active_context_tokens) if view is not None else (0, 0)
        return max(self._cfg.hash_block_size, self._chunk_tokens(name, rows, ctx, 0))

    # ---- queue timeouts ----------------------------------------------------------------------

    def arm_queue_timeout(self, rid: RequestId, deadline_s: float) -> None:
        """`rid` was (re)queued for its prefill: refuse it if still queued at `deadline_s`."""
        heapq.heappush(self._expiry, (deadline_s, next(self._seq), rid))

    def expire(self, now: float) -> list[Refusal]:
        """Cancel requests whose prefill has not started by their queue deadline."""
        expired: list[Refusal] = []
        timers = self._expiry
        while timers and timers[0][0] <= now:
            deadline, _, rid = heapq.heappop(timers)
            entry, b = self._journal.get(rid), self._ledger.get(rid)
            if entry is None or b is None or entry.phase is not Phase.QUEUED or b.queue_deadline_s != deadline:
                continue  # started, finished or re-placed since: a stale timer
            refusal = Refusal(rid, RefusalReason.QUEUE_TIMEOUT, None,
                              f"not started within {deadline - entry.desc.arrival_time:.1f} s")
            self._counters.num_expired += 1
            self._refuse(refusal, now)
            expired.append(refusal)
        return expired
