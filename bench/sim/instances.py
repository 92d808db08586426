"""Simulated engine instances: prefill-only, decode-only and colocated (chunked prefill).

Mental model: each instance runs one engine step at a time; a step's duration comes from the
cost model (`hardware.py`) and its effects land when it ends. Queues are heaps ordered by the
request's `key` (the scheduler's priority for ours, arrival time for the baselines).
Decode rows and their KV are kept by `DecodeRows` (`decoder.py`: O(log n) a step, KV reserved
for the whole output at admission).
A decode instance may also be sent prefills of its own (our scheduler's `local_prefill`): it runs
them as chunks beside its rows (`chunked.py`), each step's chunk as large as the scheduler says
the rows' TPOT target leaves room for, and decodes them in place.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from bench.sim.cache import BlockCache
from bench.sim.chunked import ChunkedPrefill
from bench.sim.decoder import DecodeRows
from bench.sim.hardware import StepCost
from bench.sim.request import DECODE_WAIT, PREFILLING, QUEUED, SimRequest
from cluster.descriptors import StepSample

if TYPE_CHECKING:
    from bench.sim.contracts import InstanceHost

_seq = itertools.count()


class PrefillInstance:
    """Prefill-only: steps of up to `token_budget` prompt tokens, highest priority first (a partly
    prefilled request yields to a more urgent one at chunk boundaries)."""

    def __init__(self, name: str, cost: StepCost, sim: InstanceHost, cache_blocks: int, token_budget: int) -> None:
        self.name, self.cost, self.sim, self.token_budget = name, cost, sim, token_budget
        self.cache = BlockCache(cache_blocks, track_deltas=True)
        self.queue: list[tuple[tuple, int, SimRequest]] = []
        self.batch: list[tuple[SimRequest, int]] = []
        self.busy = self.dead = False
        self.samples: list[StepSample] = []

    def enqueue(self, req: SimRequest) -> None:
        heapq.heappush(self.queue, (req.key, next(_seq), req))
        if not self.busy:
            self._start()

    def _valid(self, req: SimRequest) -> bool:
        return req.state in (QUEUED, PREFILLING) and req.prefill_inst == self.name

    def _start(self) -> None:
        budget, batch, tokens, pairs, fetch_s = self.token_budget, [], 0, 0.0, 0.0
        q = self.queue
        while q and budget > 0:
            req = q[0][2]
            if not self._valid(req):
                heapq.heappop(q)
                continue
            if not req.pf_started:
                fetch_s += self.sim.start_prefill(req, self)
            n = min(budget, req.pf_total - req.pf_done)
            pairs += n * (req.pf_cached + req.pf_done + n / 2.0)
            batch.append((req, n))
            tokens += n
            budget -= n
            if req.pf_done + n >= req.pf_total:
                heapq.heappop(q)
            else:
                break  # chunked: it stays at the head of the queue for the next step
        self.batch = batch
        if not batch:
            self.busy = False
            return
        self.busy = True
        compute = self.cost.step_s(tokens, pairs, 0, 0)
        self.sim.loop.after(compute + fetch_s, self._end, StepSample(tokens, pairs, 0, 0, compute))

    def _end(self, sample: StepSample) -> None:
        if self.dead:
            return
        self.samples.append(sample)
        batch, self.batch = self.batch, []
        for req, n in batch:
            if not self._valid(req):
                continue
            req.pf_done += n
            if req.pf_done >= req.pf_total:
                self.sim.finish_prefill(req, self)
        self._start()

    def kill(self) -> list[SimRequest]:
        self.dead = True
        lost = [r for _, _, r in self.queue if self._valid(r)]
        lost += [r for r, _ in self.batch if self._valid(r) and r not in lost]
        self.queue, self.batch = [], []
        return lost

    def load(self) -> tuple[int, int]:
        return len(self.batch), len(self.queue)


class DecodeInstance:
    """Decode: a continuous batch admitted in key order, capped by `cap()` rows and by KV; plus
    any prefills sent here, chunked into the steps by `chunk(rows, context, computed)` tokens."""

    def __init__(self, name: str, cost: StepCost, sim: InstanceHost, kv_blocks: int, block_tokens: int,
                 cap: Callable[[], int], cache_blocks: int, chunk: Callable[[int, int, int], int],
                 max_num_seqs: int) -> None:
        self.name, self.cost, self.sim, self.cap, self.chunk = name, cost, sim, cap, chunk
        self.max_num_seqs = max_num_seqs
        self.dec = DecodeRows(block_tokens, kv_blocks)
        self.cache = BlockCache(cache_blocks, track_deltas=True)
        self.prefill = ChunkedPrefill(self, sim, self.dec)
        self.waiting: list[tuple[tuple, int, SimRequest]] = []
        self.busy = self.dead = False
        self.samples: list[StepSample] = []

    def enqueue(self, req: SimRequest) -> None:
        """A prefill to run here, then decode here."""
        self.prefill.enqueue(req)
        if not self.busy:
            self._admit()
            self._start()

    def arrive(self, req: SimRequest) -> None:
        req.state = DECODE_WAIT
        heapq.heappush(self.waiting, (req.key, next(_seq), req))
        if not self.busy:
            self._admit()
            self._start()

    def _admit(self) -> None:
        w, dec = self.waiting, self.dec
        cap = None
        while w:
            req = w[0][2]
            if req.state != DECODE_WAIT or req.decode_inst != self.name:
                heapq.heappop(w)
                continue
            cap = self.cap() if cap is None else cap
            blocks = dec.blocks_for(req)
            if len(dec.rows) >= cap or dec.used_blocks + blocks > dec.kv_blocks:
                break
            heapq.heappop(w)
            dec.join(req, blocks)
            self.sim.decode_admitted(req, self)

    def _start(self) -> None:
        dec = self.dec
        rows, ctx = len(dec.rows), dec.context_next_step()
        tokens, pairs = 0, 0.0
        if self.prefill.has_work():
            # A step without rows delays no one's next token: it always makes progress.
            tokens, pairs, _ = self.prefill.plan(lambda done: max(self.chunk(rows, ctx, done), int(not rows)),
                                                 self.max_num_seqs)
        if not rows and not tokens:
            self.busy = False
            return
        self.busy = True
        dt = self.cost.step_s(tokens, pairs, rows, ctx)
        self.sim.loop.after(dt, self._end, StepSample(tokens, pairs, rows, ctx, dt))

    def _end(self, sample: StepSample) -> None:
        if self.dead:
            return
        self.samples.append(sample)
        joined, self.dec.just_joined = self.dec.just_joined, []
        for req in joined:
            self.sim.first_decode_token(req)
        for req in self.dec.finished_rows():
            self.sim.finish(req)
        self.prefill.complete()
        self._admit()
        self._start()

    def preempt(self, req: SimRequest) -> bool:
        if self.dec.rows.get(req.rid) is not req:
            return False
        req.generated = self.dec.generated_now(req)
        self.dec.leave(req)
        return True

    def kill(self) -> list[SimRequest]:
        self.dead = True
        lost = []
        for req in list(self.dec.rows.values()):
            req.generated = self.dec.generated_now(req)
            lost.append(req)
        lost += [r for _, _, r in self.waiting if r.state == DECODE_WAIT and r.decode_inst == self.name]
        lost += [r for r in self.prefill.kill() if r not in lost]
        self.waiting = []
        return lost

    def release_blocks(self, req: SimRequest) -> None:
        self.prefill.release(req)

    def load(self) -> tuple[int, int]:
        return len(self.dec.rows) + len(self.prefill.prefilling), len(self.waiting) + len(self.prefill.waiting)
