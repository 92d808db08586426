"""Recovery and housekeeping: dead workers' requests, preempted batch work, queue timeouts.

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
waits forever (`expire_queued`; timers are a heap with lazy deletion of stale entries).

These are functions over the scheduler's parts rather than methods, to keep `scheduler.py` about
sequencing; they touch nothing the scheduler does not own.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import heapq

from cluster.admission import Refusal, RefusalReason
from cluster.descriptors import RequestId, WorkerName
from cluster.journal import JournalEntry, Phase, needs_prefill
from cluster.ordering import priority_key
from cluster.placement import Placement, PlacementKind
from cluster.timeline import Stage

if TYPE_CHECKING:
    from cluster.scheduler import GlobalScheduler


def recompute_s(sched: "GlobalScheduler", entry: JournalEntry) -> float:
    """Predicted cost of replaying `entry` from scratch (on the first healthy prefill worker's
    model: only the ordering uses it, and models differ little between like workers)."""
    workers = sched.workers.prefill
    if not workers:
        return 0.0
    n = entry.desc.num_prompt_tokens + entry.num_output_tokens
    return sched.models.get(workers[0].name).predict_prefill(n)


def recover_worker(sched: "GlobalScheduler", name: WorkerName, now: float) -> list[Placement | Refusal]:
    view = sched.workers.get(name)
    plan = sched.journal.recovery_plan(name, now, lambda e: recompute_s(sched, e))
    recompute = {e.request_id: needs_prefill(e, name) for e in plan}
    for entry in plan:
        sched.ledger.close(entry.request_id)
    sched.workers.mark_dead(name)
    sched.index.drop(name)
    sched.models.drop(name)
    sched.telemetry.drop(name)
    sched.counters.num_workers_lost += view is not None
    return [recover_entry(sched, entry, now, recompute[entry.request_id]) for entry in plan]


def recover_entry(sched: "GlobalScheduler", entry: JournalEntry, now: float,
                  recompute: bool) -> Placement | Refusal:
    tenant = sched.tenants.get(entry.desc.tenant, now)
    assert tenant is not None, f"{entry.request_id}: tenant {entry.desc.tenant} vanished"
    entry.num_recoveries += 1
    if recompute:
        entry.phase = Phase.QUEUED
    kind = PlacementKind.RECOMPUTE if recompute else PlacementKind.REDIRECT
    out = sched._place(entry, tenant, now, kind)
    if isinstance(out, Refusal):
        sched._count_refusal(out)
        sched._leave(entry.request_id, now, None, completed=False, stage=Stage.REFUSED)
    else:
        sched.timelines.stamp(entry.request_id, Stage.RECOVERED, now)
        sched.counters.num_recovered += 1
    return out


def resume_preempted(sched: "GlobalScheduler", now: float) -> list[Placement]:
    """Place preempted batch requests again, most urgent first, while a decode row is free
    without preempting anyone (batch work never preempts); rows promised to requests still
    prefilling are not free (else the row just taken for an interactive request goes straight
    back to its victim). A resume recomputes its prompt and tokens on its decode worker, in
    chunks that keep the rows already there within their TPOT target (`resume_chunk_tokens`)."""
    resumed: list[Placement] = []
    queue = sched._preempted
    while queue:
        top = queue.peek()
        assert top is not None
        entry = sched.journal.get(top[0])
        if entry is None:
            queue.pop()
            continue
        tenant = sched.tenants.get(entry.desc.tenant, now)
        assert tenant is not None
        expected = tenant.expected_output_tokens(entry.desc.max_tokens,
                                                 sched.cfg.placement.default_output_tokens)
        remaining = max(1, expected - entry.num_output_tokens)
        n = entry.desc.num_prompt_tokens + entry.num_output_tokens
        choice = sched.policy.choose_decode(None, False, n + remaining, n, remaining, sched.workers.decode,
                                            count_committed=True)
        if choice is None or not choice.feasible:
            break  # the most urgent one cannot run yet; the others, less urgent, wait behind it
        queue.pop()
        entry.phase = Phase.QUEUED
        placed = sched._place(entry, tenant, now, PlacementKind.RECOMPUTE)
        if isinstance(placed, Placement):
            sched.counters.num_resumed += 1
            resumed.append(replace(placed, local_chunk_tokens=resume_chunk_tokens(sched, placed.decode_worker)))
        else:
            sched._count_refusal(placed)
            sched._leave(entry.request_id, now, None, completed=False, stage=Stage.REFUSED)
    return resumed


def resume_chunk_tokens(sched: "GlobalScheduler", name: WorkerName) -> int:
    """Prompt tokens per step for a recompute on decode worker `name` beside its rows (at least
    one hash block a step, however little room they leave)."""
    view = sched.workers.get(name)
    rows, ctx = (view.num_active, view.active_context_tokens) if view is not None else (0, 0)
    return max(sched.cfg.placement.hash_block_size, sched.local_chunk_tokens(name, rows, ctx, 0))


def preempt(sched: "GlobalScheduler", rid: RequestId, now: float) -> None:
    """Evict a running batch row: release its accounts, queue it for resumption by urgency."""
    entry = sched.journal.get(rid)
    if entry is None:
        return
    sched.ledger.close(rid)
    sched.journal.move(rid, None, None, Phase.PREEMPTED)
    queue_preempted(sched, entry, now)
    sched.timelines.stamp(rid, Stage.PREEMPTED, now)
    sched.counters.num_preempted += 1


def queue_preempted(sched: "GlobalScheduler", entry: JournalEntry, now: float) -> None:
    """Put a preempted request in the resumption queue, most urgent remaining budget first."""
    sched._preempted.push(entry.request_id, priority_key(entry.slo_class, now + entry.remaining_budget_s(now), 0.0,
                                                         next(sched._seq)))


def expire_queued(sched: "GlobalScheduler", now: float) -> list[Refusal]:
    """Cancel requests whose prefill has not started by their queue deadline."""
    expired: list[Refusal] = []
    timers = sched._expiry
    while timers and timers[0][0] <= now:
        deadline, _, rid = heapq.heappop(timers)
        entry, b = sched.journal.get(rid), sched.ledger.get(rid)
        if entry is None or b is None or entry.phase is not Phase.QUEUED or b.queue_deadline_s != deadline:
            continue  # started, finished or re-placed since: a stale timer
        refusal = Refusal(rid, RefusalReason.QUEUE_TIMEOUT, None,
                          f"not started within {deadline - entry.desc.arrival_time:.1f} s")
        sched._count_refusal(refusal)
        sched.counters.num_expired += 1
        sched._leave(rid, now, None, completed=False, stage=Stage.REFUSED)
        expired.append(refusal)
    return expired
