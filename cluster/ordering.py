"""Ordering: who runs first, how big a decode batch may grow, and who is preempted.

Mental model:
- Every placed request gets a static `PriorityKey` (smaller runs first): its SLO class rank
  (interactive before batch, so batch work only fills capacity interactive work leaves idle), then
  `urgency + fairness lead`. The urgency is the moment the request must be picked up by
  (`urgency_key_s`), so its remaining slack at any instant is urgency - now; as `now` is common
  to all, ordering by the static urgency is exactly least-remaining-slack-first. The fairness lead
  (`fairness.py`) is zero for a tenant within its weighted share and grows with a tenant's excess,
  pushing a flood's requests behind everyone else's. Keys are static, so a worker orders its
  queue by a number and needs no policy code of its own.
- A decode batch is capped so the tightest TPOT target among its running requests still holds
  under the fitted step-time model (`decode_batch_cap`).
- When interactive work would miss, batch-class work is preempted first, the one with the most
  slack first (`VictimQueue`); interactive work is never preempted by this policy.
All queues here are heaps with lazy deletion: O(log n) per operation, no scans.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from cluster.cost_model import StepTimeModel
from cluster.descriptors import SloClass
from cluster.journal import JournalEntry

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, order=True, slots=True)
class PriorityKey:
    """Sort key of a placed request: (class rank, seconds, tie-breaking sequence number)."""

    class_rank: int
    key_s: float
    seq: int


def latest_start_s(deadline_s: float, predicted_service_s: float) -> float:
    """The last moment the work can start and still meet `deadline_s`."""
    return deadline_s - predicted_service_s


def urgency_key_s(slo_class: SloClass, deadline_s: float, predicted_service_s: float) -> float:
    """The time by which the request must be picked up: its slack is this minus now.

    Batch work: the latest start time (completion deadline minus predicted prefill + decode).
    Interactive work: the TTFT deadline itself. Subtracting the predicted prefill here would let
    a newly arrived long prompt overtake short ones already admitted on the promise of the
    queue ahead of them, and they would miss; with the deadline, admitted requests keep their
    place and the admission check (queue ahead + own compute <= target) stays true. In the
    simulator on the Mooncake trace at 45 req/s, attainment was 0.79 with the latest start
    and 0.90 with the deadline.
    """
    if slo_class is SloClass.INTERACTIVE:
        return deadline_s
    return latest_start_s(deadline_s, predicted_service_s)


def new_request_urgency_s(entry: JournalEntry, prefill_s: float, decode_s: float) -> float:
    """Urgency of a newly admitted request: its TTFT deadline (interactive) or its completion
    deadline minus predicted prefill and decode time (batch)."""
    if entry.slo_class is SloClass.INTERACTIVE:
        assert entry.ttft_deadline_s is not None
        return urgency_key_s(entry.slo_class, entry.ttft_deadline_s, prefill_s)
    assert entry.completion_deadline_s is not None
    return urgency_key_s(entry.slo_class, entry.completion_deadline_s, prefill_s + decode_s)


def priority_key(slo_class: SloClass, urgency_s: float, fair_lead_s: float, seq: int) -> PriorityKey:
    """`fair_lead_s`: how far the tenant's fairness counter runs ahead of real time (0 within
    its share); it pushes the request back by that much, whatever the SLO's scale."""
    return PriorityKey(slo_class.rank, urgency_s + fair_lead_s, seq)


class SlackQueue(Generic[K]):
    """A priority queue of ids by `PriorityKey` with O(log n) push/pop and O(1) removal."""

    def __init__(self) -> None:
        self._heap: list[tuple[PriorityKey, K]] = []
        self._live: dict[K, PriorityKey] = {}

    def push(self, item: K, key: PriorityKey) -> None:
        assert item not in self._live, f"{item!r} is already queued"
        self._live[item] = key
        heapq.heappush(self._heap, (key, item))

    def remove(self, item: K) -> bool:
        """Forget `item` (its heap entry is skipped when it surfaces)."""
        return self._live.pop(item, None) is not None

    def _prune(self) -> None:
        heap, live = self._heap, self._live
        while heap and live.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        # Stale entries can outnumber live ones after mass removal; rebuild to bound memory.
        if len(heap) > 64 and len(heap) > 4 * len(live):
            self._heap = [(k, i) for i, k in live.items()]
            heapq.heapify(self._heap)

    def peek(self) -> tuple[K, PriorityKey] | None:
        self._prune()
        if not self._heap:
            return None
        key, item = self._heap[0]
        return item, key

    def pop(self) -> tuple[K, PriorityKey] | None:
        self._prune()
        if not self._heap:
            return None
        key, item = heapq.heappop(self._heap)
        del self._live[item]
        return item, key

    def __contains__(self, item: object) -> bool:
        return item in self._live

    def __len__(self) -> int:
        return len(self._live)


class VictimQueue(Generic[K]):
    """Running batch-class requests on one decode worker, most slack first."""

    def __init__(self) -> None:
        self._q: SlackQueue[K] = SlackQueue()
        self._seq = itertools.count()

    def add(self, item: K, slack_key_s: float) -> None:
        # Negated so the heap's minimum is the request with the MOST slack.
        self._q.push(item, PriorityKey(0, -slack_key_s, next(self._seq)))

    def discard(self, item: K) -> None:
        self._q.remove(item)

    def take(self, n: int) -> list[K]:
        out: list[K] = []
        while len(out) < n:
            top = self._q.pop()
            if top is None:
                break
            out.append(top[0])
        return out

    def __len__(self) -> int:
        return len(self._q)


class MinTracker:
    """The minimum of a multiset of floats (e.g. running TPOT targets) under add/discard."""

    def __init__(self) -> None:
        self._heap: list[float] = []
        self._count: dict[float, int] = {}

    def add(self, v: float) -> None:
        n = self._count.get(v, 0)
        self._count[v] = n + 1
        if n == 0:  # one heap entry per distinct value; counts carry the multiplicity
            heapq.heappush(self._heap, v)
            if len(self._heap) > 2 * len(self._count) + 16:
                self._heap = list(self._count)
                heapq.heapify(self._heap)

    def discard(self, v: float) -> None:
        n = self._count.get(v, 0)
        if n <= 1:
            self._count.pop(v, None)
        else:
            self._count[v] = n - 1

    def min(self) -> float | None:
        heap = self._heap
        while heap and heap[0] not in self._count:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def __len__(self) -> int:
        return sum(self._count.values())


def decode_batch_cap(model: StepTimeModel, tightest_tpot_s: float | None, mean_context_tokens: float,
                     safety: float, limit: int) -> int:
    """Largest decode batch whose predicted step time is within `safety` x the tightest running
    TPOT target; `limit` (the worker's max_num_seqs) when nothing running has a TPOT target."""
    if tightest_tpot_s is None:
        return limit
    return model.max_decode_batch(safety * tightest_tpot_s, mean_context_tokens, limit)
