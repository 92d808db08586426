"""Continuous batching with chunked prefill under a per-step token budget.

Each step: running requests go first, in admission order, each taking the tokens it still has to
compute (1 for a decode, a chunk of its prompt for a prefill in progress) out of the budget; the
prompt chunks of requests with `max_chunk_tokens` share at most that many tokens per step (in steps
with decode rows to protect; without any, the caps are lifted). When the pool cannot hold a running
request's next tokens, a running request not yet scheduled this step is preempted: a batch one
(`priority_rank` >= 1) first, then one of a tenant above its guaranteed KV share, else the most
recently admitted; a tenant at its KV ceiling preempts its own. A preempted batch request whose KV
fits the engine's host budget is offloaded (`offload.py`: its KV goes to host memory and comes back
when it is readmitted, nothing recomputed); any other goes back to the queue and is recomputed
later from prompt + tokens generated so far. Before that, a waiting interactive request (or one of
a tenant below its guarantee) that finds no blocks makes room: running batch requests are
offloaded (and requests of tenants above their guarantee preempted) until it fits. Waiting
requests are admitted after that, interactive before batch and in arrival order within a rank
(resumed and preempted requests first), while budget, sequence slots and blocks allow, reusing
their cached prefix blocks.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from actors.engine.config import EngineConfig
from actors.engine.kv_cache_manager import KVCacheManager
from actors.engine.offload import HostOffload
from actors.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # to fit running requests' next tokens

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
    def __init__(self, cfg: EngineConfig, kv: KVCacheManager, offload: HostOffload | None = None) -> None:
        self.cfg = cfg
        self.kv = kv
        self.offload = offload or HostOffload(0, 1)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        """Queues `request` after every waiting request of its rank or a smaller one; a resume
        (tokens already streamed elsewhere: a recovery) before those of its rank, as a preempted
        request is: its stream is live and its caller has waited once already."""
        self._queue(request, ahead=request.num_output_tokens > 0)

    def num_resumes_waiting(self, rank: int) -> int:
        """Waiting resumes of rank `rank` or a smaller one: the rows that free next are theirs."""
        return sum(1 for r in self.waiting if r.num_output_tokens > 0 and r.priority_rank <= rank)

    def _queue(self, request: Request, ahead: bool) -> None:
        """Into the queue by rank: after its rank's requests, or (`ahead`, a preempted one) before them."""
        rank = request.priority_rank
        for i, queued in enumerate(self.waiting):
            if queued.priority_rank > rank or (ahead and queued.priority_rank == rank):
                self.waiting.insert(i, request)
                return
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.cfg.max_num_batched_tokens
        # Room left for the prompt chunks of capped requests this step; the caps protect decode
        # rows, so a step without any (every running request still prefilling) lifts them.
        caps_apply = any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        capped: int | None = None
        self._make_room(budget)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n, capped_after = _take(req, req.num_tokens - req.num_computed_tokens, budget, capped, caps_apply)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self._victim(req, n, self.running[i:])
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            else:
                batch.requests.append(req)
                batch.num_new_tokens.append(n)
                budget -= n
                capped = capped_after
                i += 1
            # `req` itself was preempted: the next running request now sits at `i`.

        # Admitting new work in a step that had to preempt would just thrash the pool.
        if not batch.preempted:
            j = 0  # requests of a tenant at its KV ceiling stay queued; the ones behind them may go
            while j < len(self.waiting) and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
                req = self.waiting[j]
                computed, num_hit = ([], 0)
                if req.num_computed_tokens == 0:
                    computed, num_hit = self.kv.get_computed_blocks(req)
                want = req.num_tokens - num_hit - req.num_computed_tokens
                n, capped_after = _take(req, want, budget, capped, caps_apply)
                if n > 0 and self.kv.over_share(req, n, computed):
                    j += 1
                    continue
                if n <= 0 or not self.kv.allocate_slots(req, n, computed):
                    break
                del self.waiting[j]
                if self.offload.holds(req.request_id):
                    self.offload.readmit(req.request_id, self.kv.block_ids(req.request_id))
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

    def _victim(self, req: Request, n: int, candidates: list[Request]) -> Request:
        """Whom to preempt so that `req` gets `n` more tokens' blocks, among the running requests
        not yet scheduled this step (`req` among them): its own tenant's newest when `req` is at
        its tenant's ceiling; else batch before interactive, tenants above their guarantee before
        the others, the most recently admitted first."""
        if self.kv.over_share(req, n):
            return [r for r in candidates if r.tenant == req.tenant][-1]
        def key(pair: tuple[int, Request]) -> tuple[int, bool, int]:
            i, r = pair
            return r.priority_rank, self.kv.above_guarantee(r.tenant), i

        return max(enumerate(candidates), key=key)[1]

    def _make_room(self, budget: int) -> None:
        """`make_room` for the first waiting request's next chunk, which then stays first."""
        if not self.waiting:
            return
        head = self.waiting[0]
        taken = self.make_room(head, min(head.num_tokens - head.num_computed_tokens, budget),
                               need_row=len(self.running) >= self.cfg.max_num_seqs)
        if taken:
            self.waiting.remove(head)  # a victim of its rank went ahead of it: the room is the head's
            self.waiting.appendleft(head)

    def make_room(self, req: Request, num_tokens: int, need_row: bool = False,
                  busy: Collection[str] = ()) -> list[Request]:
        """Frees blocks for `num_tokens` more of `req` (waiting, or being reserved for KV from
        another engine), and a row if `need_row` (every row taken), when it has a claim on them: it
        outranks running batch requests that can be offloaded, or its tenant is below its guaranteed
        share and tenants above theirs run. Nothing is taken unless enough can be, nor from the
        `busy` requests (those of a step whose forward runs now); returns those taken from."""
        need = self.kv.num_blocks_needed(req.num_computed_tokens + num_tokens) - self.kv.num_held_blocks(req.request_id)
        short = need - self.kv.pool.num_free_blocks
        if (short <= 0 and not need_row) or self.kv.over_share(req, num_tokens):
            return []
        below = self.kv.below_guarantee(req.tenant)

        def yields(r: Request) -> bool:
            if r.request_id in busy:
                return False
            if r.priority_rank > req.priority_rank and self._can_offload(r):
                return True
            return below and r.tenant != req.tenant and self.kv.above_guarantee(r.tenant)

        victims = [r for r in reversed(self.running) if yields(r)]
        if sum(self.kv.num_held_blocks(r.request_id) for r in victims) < short or (need_row and not victims):
            return []
        taken: list[Request] = []
        for victim in victims:
            if self.kv.pool.num_free_blocks >= need and (taken or not need_row):
                break
            self._preempt(victim)
            taken.append(victim)
        return taken

    def may_yield_to(self, priority_rank: int, tenant: str) -> bool:
        """Whether a running request might give room to a request of this rank and tenant
        (`make_room`'s candidates, roughly): worth waiting for a step to end to try."""
        below = self.kv.below_guarantee(tenant)
        return any(r.priority_rank > priority_rank or (below and r.tenant != tenant) for r in self.running)

    def _can_offload(self, req: Request) -> bool:
        return req.priority_rank >= 1 and req.num_computed_tokens > 0 and self.offload.can_take(
            self.kv.num_blocks_needed(req.num_computed_tokens))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        if self._can_offload(req):
            num_blocks = self.kv.num_blocks_needed(req.num_computed_tokens)
            self.offload.claim(req.request_id, self.kv.block_ids(req.request_id)[:num_blocks])
            logger.debug("offloaded %s (%d blocks to host memory)", req.request_id, num_blocks)
        else:
            req.num_computed_tokens = 0
            req.stepwise_from = None  # recomputed whole: nothing left to replay bit for bit
            logger.debug("preempted %s (%d tokens to recompute)", req.request_id, req.num_tokens)
        self.kv.free(req)
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self._queue(req, ahead=True)
        self.num_preemptions += 1

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
        self.offload.drop(req.request_id)
        req.status = status
