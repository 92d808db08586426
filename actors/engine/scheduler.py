"""Continuous batching with chunked prefill under a per-step token budget.

Each step: running requests go first, in admission order, each taking the tokens it still has to
compute (1 for a decode, a chunk of its prompt for a prefill in progress) out of the budget; the
prompt chunks of requests with `max_chunk_tokens` share at most that many tokens per step (in steps
with decode rows to protect; without any, the caps are lifted). When the pool cannot hold a running
request's next tokens, the most recently admitted running request is preempted (its blocks are
freed; it goes back to the head of the queue and is recomputed later from prompt + tokens generated
so far). Waiting requests are admitted after that, interactive before batch (`priority_rank`) and in
arrival order within a rank, while budget, sequence slots and blocks allow, reusing their cached
prefix blocks.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from actors.engine.config import EngineConfig
from actors.engine.kv_cache_manager import KVCacheManager
from actors.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


def _take(req: Request, want: int, budget: int, capped: int | None, caps_apply: bool) -> tuple[int, int | None]:
    """Tokens `req` computes this step out of the `want` it has left, and the room for capped
    prompt chunks after it (`capped`, None before the first). Requests with `max_chunk_tokens`
    (local prefills on a decode worker) share one chunk's room per step, at most the smallest cap
    among them, so two at once do not double the step; their single decode tokens are never
    capped, and no cap applies in a step without decode rows (`caps_apply` False). A request
    resumed from saved KV computes its tail up to `stepwise_from` in one chunk, then one token a
    step (replaying its decode steps)."""
    n = min(want, budget)
    if req.stepwise_from is not None:
        ahead = req.stepwise_from - req.num_computed_tokens
        n = min(n, ahead) if ahead > 0 else min(n, 1)
    if req.max_chunk_tokens is None or want <= 1 or not caps_apply:
        return n, capped
    room = req.max_chunk_tokens if capped is None else min(capped, req.max_chunk_tokens)
    return min(n, room), room - min(n, room)


class Scheduler:
    def __init__(self, cfg: EngineConfig, kv: KVCacheManager) -> None:
        self.cfg = cfg
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        """Queues `request` after every waiting request of its rank or a smaller one."""
        rank = request.priority_rank
        if not self.waiting or self.waiting[-1].priority_rank <= rank:
            self.waiting.append(request)
            return
        for i, queued in enumerate(self.waiting):
            if queued.priority_rank > rank:
                self.waiting.insert(i, request)
                return

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.cfg.max_num_batched_tokens
        # Room left for the prompt chunks of capped requests this step; the caps protect decode
        # rows, so a step without any (every running request still prefilling) lifts them.
        caps_apply = any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        capped: int | None = None
        scheduled: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n, capped_after = _take(req, req.num_tokens - req.num_computed_tokens, budget, capped, caps_apply)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            else:
                batch.requests.append(req)
                batch.num_new_tokens.append(n)
                scheduled.add(req.request_id)
                budget -= n
                capped = capped_after
                i += 1
                continue
            # `req` itself was preempted: everything after it already was too.
            break

        # Admitting new work in a step that had to preempt would just thrash the pool.
        if not batch.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
                req = self.waiting[0]
                computed, num_hit = ([], 0)
                if req.num_computed_tokens == 0:
                    computed, num_hit = self.kv.get_computed_blocks(req)
                want = req.num_tokens - num_hit - req.num_computed_tokens
                n, capped_after = _take(req, want, budget, capped, caps_apply)
                if n <= 0 or not self.kv.allocate_slots(req, n, computed):
                    break
                self.waiting.popleft()
                if req.status == RequestStatus.WAITING:
                    req.num_prefix_hit_tokens = num_hit
                req.num_computed_tokens += num_hit
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                batch.requests.append(req)
                batch.num_new_tokens.append(n)
                budget -= n
                capped = capped_after
        return batch

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.stepwise_from = None  # recomputed whole: nothing left to replay bit for bit
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        logger.debug("preempted %s (%d tokens to recompute)", req.request_id, req.num_tokens)

    def add_running(self, req: Request) -> None:
        """A request whose KV is already in the pool (handed over by another engine)."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def finish(self, req: Request, status: RequestStatus, free_kv: bool = True) -> None:
        """Removes a request wherever it is and frees its blocks (unless the caller keeps them)."""
        assert status.is_finished
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if free_kv:
            self.kv.free(req)
        req.status = status
