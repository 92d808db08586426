"""Placement: which prefill worker computes a request, and which decode worker continues it.

Mental model:
- Prefill: for every healthy prefill-capable worker, predict the time to first token if placed
  there = queued work ahead of it (`backlog_s` of its class and above) + fetching from the shared
  pool the prefix blocks the worker lacks but the pool holds + computing the tokens no one holds
  (the worker's fitted step-time model). The longer the prefix a worker already holds, the less
  it computes: that subtraction *is* the prefix-affinity score, in seconds, so affinity and load
  trade off in one unit and a hot worker with the prefix loses to an idle one when it should.
- Decode: a worker is feasible if one more active row keeps its batch within the TPOT cap of its
  tightest target (this request's included) and its free KV blocks hold the request. Among the
  feasible, the one with the most TPOT headroom (target minus predicted step time with everything
  placed there) wins, which spreads load. If none is feasible, an interactive request may take
  the place of running batch work (preemption, most slack first); otherwise it goes where the
  predicted wait for a free row is shortest, and admission judges whether that wait is tolerable.
Ties break by worker name, so decisions are deterministic. Cost: O(workers) per decision.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from cluster.cost_model import CostModelBank, batch_cap
from cluster.descriptors import RequestId, WorkerName
from cluster.ordering import PriorityKey
from cluster.prefix_index import POOL, PrefixIndex
from cluster.workers import WorkerView


class PlacementKind(str, enum.Enum):
    NEW = "new"
    RECOMPUTE = "recompute"  # replay prompt + streamed tokens, continue at RNG position
    REDIRECT = "redirect"  # only the decode worker changes (the prefill side still has or makes the KV)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where and how urgently to run a request. Workers order their queues by `priority`
    (smaller first) and must preempt the requests in `preempt` on `decode_worker` before admitting
    this one. `resume_from_token` is the number of output tokens already streamed."""

    request_id: RequestId
    prefill_worker: WorkerName
    decode_worker: WorkerName
    priority: PriorityKey
    kind: PlacementKind = PlacementKind.NEW
    resume_from_token: int = 0
    ttft_deadline_s: float | None = None
    tpot_s: float | None = None
    completion_deadline_s: float | None = None
    predicted_ttft_s: float = 0.0
    predicted_tpot_s: float = 0.0
    num_prefix_hit_blocks: int = 0
    num_pool_blocks: int = 0
    preempt: tuple[RequestId, ...] = ()


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    """`hash_block_size`: tokens per block hash in `RequestDesc.block_hashes`.
    `pool_fetch_s_per_block`: time to pull one such block from the shared pool.
    `decode_tpot_safety`: the batch cap aims at this fraction of the tightest TPOT target."""

    hash_block_size: int = 16
    pool_fetch_s_per_block: float = 0.0
    decode_tpot_safety: float = 0.85
    default_output_tokens: int = 256
    max_num_seqs: int = 1024

    def __post_init__(self) -> None:
        if self.hash_block_size < 1 or self.pool_fetch_s_per_block < 0:
            raise ValueError("hash_block_size must be >= 1 and pool_fetch_s_per_block >= 0")
        if not 0 < self.decode_tpot_safety <= 1:
            raise ValueError("decode_tpot_safety must be in (0, 1]")


@dataclass(slots=True)
class PrefillChoice:
    worker: WorkerView
    wait_s: float
    fetch_s: float
    compute_s: float
    hit_blocks: int
    pool_blocks: int

    @property
    def ttft_s(self) -> float:
        return self.wait_s + self.fetch_s + self.compute_s


@dataclass(slots=True)
class DecodeChoice:
    worker: WorkerView
    step_s: float
    wait_s: float
    num_preempt: int = 0  # batch-class rows to evict from `worker` first (most slack first)

    @property
    def feasible(self) -> bool:
        return self.wait_s == 0.0 and self.num_preempt == 0


class PlacementPolicy:
    """Scores workers; commits nothing (the scheduler updates the accounts of the chosen ones)."""

    def __init__(self, cfg: PlacementConfig, models: CostModelBank, index: PrefixIndex) -> None:
        self.cfg = cfg
        self.models = models
        self.index = index

    def choose_prefill(self, num_tokens: int, hashes: tuple[int, ...], rank: int,
                       workers: list[WorkerView]) -> PrefillChoice | None:
        """Best prefill worker for computing `num_tokens` tokens whose full blocks hash to
        `hashes`, for work of class `rank` (0 interactive, 1 batch)."""
        matches = self.index.match(hashes) if hashes else {}
        pool_hit = matches.get(POOL, 0)
        hbs, fetch_per_block = self.cfg.hash_block_size, self.cfg.pool_fetch_s_per_block
        min_step = self.models.prior.min_step_s
        best: WorkerView | None = None
        best_ttft = math.inf
        best_parts = (0.0, 0.0, 0, 0)
        for w in workers:
            local = matches.get(w.name, 0) if matches else 0
            hit = local if local >= pool_hit else pool_hit
            # The last token is always computed: its logits give the first output token.
            cached = min(hit * hbs, num_tokens - 1)
            new = num_tokens - cached
            t = w.model.theta  # inlined StepTimeModel.predict_prefill: this loop is the hot path
            compute = t[0] + t[1] * new * 1e-3 + t[2] * new * (cached + new * 0.5) * 1e-6
            if compute < min_step:
                compute = min_step
            wait = w.backlog_s[0] if rank == 0 else w.backlog_s[0] + w.backlog_s[1]
            if w.ttft_bias_s > 0:  # learned lateness of this worker's first tokens
                wait += w.ttft_bias_s
            fetch = (hit - local) * fetch_per_block
            ttft = wait + fetch + compute
            if ttft < best_ttft:
                best, best_ttft, best_parts = w, ttft, (wait, fetch, hit, hit - local)
        if best is None:
            return None
        wait, fetch, hit, pool_blocks = best_parts
        return PrefillChoice(best, wait, fetch, best_ttft - wait - fetch, hit, pool_blocks)

    def choose_decode(self, tpot_s: float | None, interactive: bool, total_tokens: int, context_tokens: int,
                      expected_output: int, workers: list[WorkerView]) -> DecodeChoice | None:
        """Best decode worker for a request that will hold `total_tokens` of KV (context plus the
        output still expected) with `context_tokens` of context now; `tpot_s` is its TPOT target
        (None for batch work)."""
        safety, min_step = self.cfg.decode_tpot_safety, self.models.prior.min_step_s
        # Candidates kept as (worker, step) tuples; one DecodeChoice is built at the end.
        best, best_head, best_step = None, -math.inf, 0.0
        fallback, fallback_wait, fallback_step = None, math.inf, 0.0
        victim, victim_head, victim_step, victim_n = None, -math.inf, 0.0, 0
        for w in workers:
            t = w.model.theta  # inlined step-time model: this loop is the hot path
            tight = w.tpot_targets.min()
            if tpot_s is not None and (tight is None or tpot_s < tight):
                tight = tpot_s
            ctx = w.mean_context_tokens
            if ctx is None:
                ctx = w.active_context_tokens / w.num_active if w.num_active else float(context_tokens)
            per_row = t[3] * 1e-2 + t[4] * ctx * 1e-5
            rows = w.num_active + 1
            # Rows fit iff the step with one more row stays within the tightest target (the
            # batch cap, `batch_cap`, without solving for it); a lone row always fits.
            rows_ok = rows <= w.max_num_seqs and (
                tight is None or rows == 1 or t[0] + per_row * rows <= safety * tight)
            step = t[0] + per_row * (rows + w.num_committed)
            if step < min_step:
                step = min_step
            head = (tight if tight is not None else 0.0) - step
            free = min(w.reported_free_blocks - w.blocks_since_report, w.num_total_blocks - w.active_blocks)
            if rows_ok and free - w.committed_blocks >= -(-total_tokens // w.block_size):
                if head > best_head:
                    best, best_head, best_step = w, head, step
                continue
            cap = w.max_num_seqs if tight is None else batch_cap(t[0], per_row, safety * tight, w.max_num_seqs)
            excess = max(1, rows - cap)
            if interactive and len(w.victims) >= excess and head > victim_head:
                # After evicting `excess` batch rows the batch is back within the cap.
                victim, victim_head, victim_n = w, head, excess
                victim_step = max(min_step, step - per_row * excess)
            # A row frees every (expected_output * step / rows) seconds on average.
            wait = excess * expected_output * step / rows
            if wait < fallback_wait:
                fallback, fallback_wait, fallback_step = w, wait, step
        if best is not None:
            return DecodeChoice(best, best_step, 0.0)
        if victim is not None:
            return DecodeChoice(victim, victim_step, 0.0, num_preempt=victim_n)
        return None if fallback is None else DecodeChoice(fallback, fallback_step, fallback_wait)
