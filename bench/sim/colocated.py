"""A simulated colocated engine: prefill and decode in one continuous batch (the usual default).

Mental model (vLLM V1's scheduler, and this project's `actors/engine/scheduler.py`): every step
first gives each decoding row one token of the step's token budget, then continues prefills in
progress, then admits waiting requests in arrival order while budget, sequence slots and KV
blocks allow (chunked prefill, `chunked.py`). Prefill chunks therefore share steps with decodes,
which is what stretches the decodes' time per output token when long prompts arrive.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bench.sim.cache import BlockCache
from bench.sim.chunked import ChunkedPrefill
from bench.sim.decoder import DecodeRows
from bench.sim.hardware import StepCost
from bench.sim.request import SimRequest
from cluster.descriptors import StepSample

if TYPE_CHECKING:
    from bench.sim.contracts import InstanceHost


class ColocatedInstance:
    """One engine doing both phases; FCFS by `key` (arrival for the baseline)."""

    def __init__(self, name: str, cost: StepCost, sim: InstanceHost, kv_blocks: int, block_tokens: int,
                 cache_blocks: int, token_budget: int, max_num_seqs: int) -> None:
        self.name, self.cost, self.sim = name, cost, sim
        self.token_budget, self.max_num_seqs = token_budget, max_num_seqs
        self.dec = DecodeRows(block_tokens, kv_blocks)
        self.cache = BlockCache(cache_blocks)
        self.prefill = ChunkedPrefill(self, sim, self.dec)
        self.busy = self.dead = False
        self.samples: list[StepSample] = []

    def enqueue(self, req: SimRequest) -> None:
        self.prefill.enqueue(req)
        if not self.busy:
            self._start()

    def _start(self) -> None:
        dec = self.dec
        budget = self.token_budget - len(dec.rows)
        tokens, pairs, fetch_s = self.prefill.plan(lambda _: budget, self.max_num_seqs)
        if not tokens and not dec.rows:
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
        self.prefill.complete()
        self._start()

    def preempt(self, req: SimRequest) -> bool:
        return False

    def release_blocks(self, req: SimRequest) -> None:
        """A request dropped while prefilling here (cancelled): return its reservation."""
        self.prefill.release(req)

    def kill(self) -> list[SimRequest]:
        self.dead = True
        lost = []
        for req in list(self.dec.rows.values()):
            req.generated = self.dec.generated_now(req)
            lost.append(req)
        lost += [r for r in self.prefill.kill() if r not in lost]
        return lost

    def load(self) -> tuple[int, int]:
        return len(self.dec.rows) + len(self.prefill.prefilling), len(self.prefill.waiting)
