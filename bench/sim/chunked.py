"""Chunked prefill inside a decoding engine: the part colocated and decode instances share.

Mental model (vLLM V1's scheduler, and this project's `actors/engine/scheduler.py`): each step,
after its decode rows, an engine continues the prefills it has started, in order, then starts
waiting ones in queue order (`key`) while the step's token budget, sequence slots and KV blocks
allow. A request's KV blocks (prompt + its whole output, the same oracle as `DecodeRows`) are
reserved when its prefill starts, so it joins the decode batch in place when its last chunk is
done: nothing is handed over. The colocated baseline gives every step a fixed token budget; a
decode instance under our scheduler gets the budget the scheduler computes from the step time its
rows leave under their TPOT target (`cluster.placement.PlacementConfig.local_prefill`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from bench.sim.request import PREFILLING, QUEUED, SimRequest

if TYPE_CHECKING:
    from bench.sim.contracts import InstanceHost, SimEngine
    from bench.sim.decoder import DecodeRows

_seq = itertools.count()


class ChunkedPrefill:
    """The prefills of instance `inst`, whose finished prefills join `dec`; `sim` is told as they
    start and finish."""

    def __init__(self, inst: SimEngine, sim: InstanceHost, dec: DecodeRows) -> None:
        self.inst, self.sim, self.dec = inst, sim, dec
        self.waiting: list[tuple[tuple, int, SimRequest]] = []
        self.prefilling: list[SimRequest] = []
        self.chunks: list[tuple[SimRequest, int]] = []

    def enqueue(self, req: SimRequest) -> None:
        heapq.heappush(self.waiting, (req.key, next(_seq), req))

    def valid(self, req: SimRequest) -> bool:
        return req.state in (QUEUED, PREFILLING) and req.prefill_inst == self.inst.name

    def has_work(self) -> bool:
        return bool(self.prefilling or self.waiting)

    def plan(self, budget_for: Callable[[int], int], max_seqs: int) -> tuple[int, float, float]:
        """Chunks for the next step; `budget_for(computed)` is the step's token budget given the
        tokens the first prefill already has (cached or done). Returns (tokens, attention pairs,
        pool fetch seconds)."""
        dec = self.dec
        for req in [r for r in self.prefilling if not self.valid(r)]:  # refused, preempted, moved
            self.release(req)
        head = self.prefilling[0] if self.prefilling else None
        budget = budget_for(head.pf_cached + head.pf_done if head is not None else 0)
        chunks: list[tuple[SimRequest, int]] = []
        tokens, pairs, fetch_s = 0, 0.0, 0.0
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(budget, req.pf_total - req.pf_done)
            chunks.append((req, n))
            pairs += n * (req.pf_cached + req.pf_done + n / 2.0)
            tokens += n
            budget -= n
        w = self.waiting
        while w and budget > 0 and len(dec.rows) + len(self.prefilling) < max_seqs:
            req = w[0][2]
            if not self.valid(req):
                heapq.heappop(w)
                continue
            blocks = dec.blocks_for(req)
            if dec.used_blocks + blocks > dec.kv_blocks:
                break  # head-of-line: it waits for memory rather than letting others skip ahead
            heapq.heappop(w)
            dec.used_blocks += blocks  # reserved now; `join` below must not count them twice
            req.blocks = blocks
            fetch_s += self.sim.start_prefill(req, self.inst)
            self.prefilling.append(req)
            n = min(budget, req.pf_total)
            chunks.append((req, n))
            pairs += n * (req.pf_cached + n / 2.0)
            tokens += n
            budget -= n
        self.chunks = chunks
        return tokens, pairs, fetch_s

    def complete(self) -> None:
        """The step ended: advance its chunks; finished prefills join the decode batch here."""
        chunks, self.chunks = self.chunks, []
        for req, n in chunks:
            if not self.valid(req):
                continue
            req.pf_done += n
            if req.pf_done >= req.pf_total:
                self.prefilling.remove(req)
                blocks = req.blocks
                self.dec.used_blocks -= blocks
                if self.sim.finish_prefill(req, self.inst):  # more tokens to come: decode here
                    self.dec.join(req, blocks)
                    self.sim.decode_admitted(req, self.inst)

    def release(self, req: SimRequest) -> None:
        """A request dropped while prefilling here (cancelled): return its reservation."""
        if req in self.prefilling:
            self.prefilling.remove(req)
            self.dec.used_blocks -= req.blocks

    def kill(self) -> list[SimRequest]:
        lost = [r for r in self.prefilling if self.valid(r)]
        lost += [r for _, _, r in self.waiting if self.valid(r) and r not in lost]
        self.waiting, self.prefilling, self.chunks = [], [], []
        return lost
