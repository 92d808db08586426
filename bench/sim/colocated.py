"""A simulated colocated engine: prefill and decode in one continuous batch (the usual default).

Mental model (vLLM V1's scheduler, and this project's `actors/engine/scheduler.py`): every step
first gives each decoding row one token of the step's token budget, then continues prefills in
progress, then admits waiting requests in arrival order while budget, sequence slots and KV
blocks allow (chunked prefill). Prefill chunks therefore share steps with decodes, which is
what stretches the decodes' time per output token when long prompts arrive.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING

from bench.sim.cache import BlockCache
from bench.sim.hardware import StepCost
from bench.sim.instances import _Decoder
from bench.sim.request import PREFILLING, QUEUED, SimRequest
from cluster.descriptors import StepSample

if TYPE_CHECKING:
    from bench.sim.cluster import SimCluster

_seq = itertools.count()


class ColocatedInstance:
    """One engine doing both phases; FCFS by `key` (arrival for the baseline)."""

    def __init__(self, name: str, cost: StepCost, sim: "SimCluster", kv_blocks: int, block_tokens: int,
                 cache_blocks: int, token_budget: int, max_num_seqs: int) -> None:
        self.name, self.cost, self.sim = name, cost, sim
        self.token_budget, self.max_num_seqs = token_budget, max_num_seqs
        self.dec = _Decoder(block_tokens, kv_blocks)
        self.cache = BlockCache(cache_blocks)
        self.waiting: list[tuple[tuple, int, SimRequest]] = []
        self.prefilling: list[SimRequest] = []
        self.chunks: list[tuple[SimRequest, int]] = []
        self.busy = self.dead = False
        self.samples: list[StepSample] = []

    def enqueue(self, req: SimRequest) -> None:
        heapq.heappush(self.waiting, (req.key, next(_seq), req))
        if not self.busy:
            self._start()

    def _valid(self, req: SimRequest) -> bool:
        return req.state in (QUEUED, PREFILLING) and req.prefill_inst == self.name

    def _start(self) -> None:
        dec = self.dec
        budget = self.token_budget - len(dec.rows)
        chunks: list[tuple[SimRequest, int]] = []
        tokens, pairs, fetch_s = 0, 0.0, 0.0
        self.prefilling = [r for r in self.prefilling if self._valid(r)]
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(budget, req.pf_total - req.pf_done)
            chunks.append((req, n))
            pairs += n * (req.pf_cached + req.pf_done + n / 2.0)
            tokens += n
            budget -= n
        w = self.waiting
        while w and budget > 0 and len(dec.rows) + len(self.prefilling) < self.max_num_seqs:
            req = w[0][2]
            if not self._valid(req):
                heapq.heappop(w)
                continue
            blocks = dec.blocks_for(req)
            if dec.used_blocks + blocks > dec.kv_blocks:
                break  # head-of-line: FCFS waits for memory rather than skipping ahead
            heapq.heappop(w)
            dec.used_blocks += blocks  # reserved now; `join` below must not count them twice
            req.blocks = blocks
            fetch_s += self.sim.start_prefill(req, self)
            self.prefilling.append(req)
            n = min(budget, req.pf_total)
            chunks.append((req, n))
            pairs += n * (req.pf_cached + n / 2.0)
            tokens += n
            budget -= n
        self.chunks = chunks
        if not chunks and not dec.rows:
            self.busy = False
            return
        self.busy = True
        rows, ctx = len(dec.rows), dec.context_next_step()
        compute = self.cost.step_s(tokens, pairs, rows, ctx)
        self.sim.loop.after(compute + fetch_s, self._end, StepSample(tokens, pairs, rows, ctx, compute))

    def _end(self, sample: StepSample) -> None:
        if self.dead:
            return
        self.samples.append(sample)
        dec = self.dec
        joined, dec.just_joined = dec.just_joined, []
        for req in joined:
            self.sim.first_decode_token(req)
        for req in dec.finished_rows():
            self.sim.finish(req)
        chunks, self.chunks = self.chunks, []
        for req, n in chunks:
            if not self._valid(req):
                continue
            req.pf_done += n
            if req.pf_done >= req.pf_total:
                self.prefilling.remove(req)
                blocks = req.blocks
                dec.used_blocks -= blocks
                if self.sim.finish_prefill(req, self):  # more tokens to come: decode here
                    dec.join(req, blocks)
                    self.sim.decode_admitted(req, self)
        self._start()

    def preempt(self, req: SimRequest) -> bool:
        return False

    def release_blocks(self, req: SimRequest) -> None:
        """A request dropped while prefilling here (cancelled): return its reservation."""
        if req in self.prefilling:
            self.prefilling.remove(req)
            self.dec.used_blocks -= req.blocks

    def kill(self) -> list[SimRequest]:
        self.dead = True
        lost = []
        for req in list(self.dec.rows.values()):
            req.generated = self.dec.generated_now(req)
            lost.append(req)
        lost += [r for r in self.prefilling if self._valid(r)]
        lost += [r for _, _, r in self.waiting if self._valid(r) and r not in lost]
        self.waiting, self.prefilling = [], []
        return lost

    def load(self) -> tuple[int, int]:
        return len(self.dec.rows) + len(self.prefilling), len(self.waiting)
