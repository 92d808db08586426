"""Placement: which prefill worker computes a request, and which decode worker continues it.

Mental model:
- Prefill: for every healthy prefill-capable worker, predict the time to first token if placed
  there = queued work ahead of it (`backlog_s` of its class and above) + fetching from the shared
  pool the prefix blocks the worker lacks but the pool holds (at the seconds per block that worker
  measured, `WorkerView.pool_fetch_s_per_block`, or the configured constant until it has: a slow
  link tips the choice to a worker holding the prefix) + computing the tokens no one holds (the
  worker's fitted step-time model). The longer the prefix a worker already holds, the less
  it computes: that subtraction *is* the prefix-affinity score, in seconds, so affinity and load
  trade off in one unit and a hot worker with the prefix loses to an idle one when it should.
- Decode: a worker is feasible if one more active row keeps its batch within the TPOT cap of its
  tightest target (this request's included) and its free KV blocks hold the request. Among the
  feasible, the one with the most TPOT headroom (target minus predicted step time with everything
  placed there) wins, which spreads load. If none is feasible, an interactive request may take
  the place of running batch work (preemption, most slack first); otherwise it goes where the
  predicted wait for a free row is shortest, and admission judges whether that wait is tolerable.
- Local prefill (`PlacementConfig.local_prefill`): a decode worker whose rows leave part of each
  step unused under their TPOT target may prefill a request itself (after fetching what the
  shared pool holds of its prefix), in chunks filling that part, and decode it in place; it is
  chosen when its predicted first token comes sooner than the best
  prefill worker's. On a workload whose prompts outweigh its outputs this lends the decode GPUs'
  spare compute to prefill, which a fixed prefill/decode split otherwise leaves idle.
Ties break by worker name, so decisions are deterministic. Cost: O(workers) per decision.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from cluster.cost_model import CostModelBank, batch_cap, chunk_tokens
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
    # A local prefill (`PlacementConfig.local_prefill`): prompt tokens per step that keep the
    # decode worker's steps within its rows' tightest TPOT target at placement time. None otherwise.
    local_chunk_tokens: int | None = None

    @property
    def local(self) -> bool:
        """Prefill runs on the decode worker itself (no KV handoff): a decode worker lending its
        spare step time to prefill, or a colocated worker."""
        return self.prefill_worker == self.decode_worker


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    """`hash_block_size`: tokens per block hash in `RequestDesc.block_hashes`.
    `pool_fetch_s_per_block`: time to pull one such block from the shared pool, for a worker that
    has not reported its own measured time yet (`WorkerView.pool_fetch_s_per_block`).
    `decode_tpot_safety`: the batch cap aims at this fraction of the tightest TPOT target.
    `local_prefill`: decode workers may also prefill requests they then decode, in chunks that
    fill the step time their running rows leave under the TPOT target (`local_chunk_tokens`),
    whenever that gives an earlier first token than the prefill workers; at most
    `max_local_chunk_tokens` per step (also bounded by the engine's own step budget; a chunk is
    never smaller than one hash block). The placement carries the chunk size it was predicted with
    (`Placement.local_chunk_tokens`), and the decode engine prefills in chunks of that size.
    `max_num_seqs`: decode rows per worker (the engines' own limit). `preempt_batch`: an
    interactive request that fits nowhere may take the decode rows of running batch-class
    requests (they resume when a row frees); off, it waits like any other."""

    hash_block_size: int = 16
    pool_fetch_s_per_block: float = 0.0
    decode_tpot_safety: float = 0.85
    default_output_tokens: int = 256
    max_num_seqs: int = 1024
    local_prefill: bool = False
    max_local_chunk_tokens: int = 8192
    preempt_batch: bool = True

    def __post_init__(self) -> None:
        if self.hash_block_size < 1 or self.pool_fetch_s_per_block < 0:
            raise ValueError("hash_block_size must be >= 1 and pool_fetch_s_per_block >= 0")
        if self.max_local_chunk_tokens < 1:
            raise ValueError("max_local_chunk_tokens must be >= 1")
        if not 0 < self.decode_tpot_safety <= 1:
            raise ValueError("decode_tpot_safety must be in (0, 1]")


# A decode worker a row fits now: (worker, tightest TPOT target, step seconds per row, seconds per
# output token of a row: the step over the worker's measured tokens per step, `WorkerView.tokens_per_step`).
Fit = tuple[WorkerView, "float | None", float, float]


@dataclass(slots=True)
class PrefillChoice:
    worker: WorkerView
    wait_s: float
    fetch_s: float
    compute_s: float
    hit_blocks: int
    pool_blocks: int
    chunk_tokens: int | None = None  # a local prefill's tokens per step (`choose_local`)

    @property
    def ttft_s(self) -> float:
        return self.wait_s + self.fetch_s + self.compute_s


@dataclass(slots=True)
class DecodeChoice:
    worker: WorkerView
    step_s: float  # predicted seconds per output token of a row there (its step over tokens per step)
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

    def choose_prefill(self, num_tokens: int, matches: dict[WorkerName, int], rank: int,
                       workers: list[WorkerView]) -> PrefillChoice | None:
        """Best prefill worker for computing `num_tokens` tokens, for work of class `rank` (0
        interactive, 1 batch); `matches` is the prefix index's answer for the request's block
        hashes (leading blocks each holder has)."""
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
            f = w.pool_fetch_s_per_block  # measured there; the configured constant until then
            fetch = (hit - local) * (fetch_per_block if f is None else f)
            ttft = wait + fetch + compute
            if ttft < best_ttft:
                best, best_ttft, best_parts = w, ttft, (wait, fetch, hit, hit - local)
        if best is None:
            return None
        wait, fetch, hit, pool_blocks = best_parts
        return PrefillChoice(best, wait, fetch, best_ttft - wait - fetch, hit, pool_blocks)

    def choose_local(self, num_tokens: int, matches: dict[WorkerName, int], rank: int, feasible: list[Fit],
                     beat_s: float = math.inf) -> tuple[PrefillChoice, DecodeChoice] | None:
        """Best decode worker to prefill `num_tokens` itself and then decode them, by predicted
        first-token time, among the `feasible` ones (`choose_decode` lists them: those the row
        and its KV fit now). Its steps keep running its rows; a prefill chunk fills what is left
        of each step under the tightest TPOT target (`room`), so the prefill's compute `work` is
        spread over max(1, work / room) steps of `base` seconds each; the choice carries that
        chunk size (None without a target: the engine's own budget). The worker reuses its own
        prefix cache and, beyond it, what the shared pool holds (a decode worker fetches from the
        pool before prefilling for itself), priced as in `choose_prefill` (at its own measured
        fetch time). Only a first token sooner than `beat_s` counts."""
        safety, hbs, max_chunk = self.cfg.decode_tpot_safety, self.cfg.hash_block_size, self.cfg.max_local_chunk_tokens
        pool_hit, fetch_per_block = matches.get(POOL, 0), self.cfg.pool_fetch_s_per_block
        best: tuple[WorkerView, float, float, float, int, int | None] | None = None
        for w, tight, per_row, step in feasible:
            wait = w.backlog_s[0] if rank == 0 else w.backlog_s[0] + w.backlog_s[1]
            if w.ttft_bias_s > 0:
                wait += w.ttft_bias_s
            if wait >= beat_s:
                continue
            t = w.model.theta
            local = matches.get(w.name, 0) if matches else 0
            hit = local if local >= pool_hit else pool_hit
            f = w.pool_fetch_s_per_block
            fetch = (hit - local) * (fetch_per_block if f is None else f)
            cached = min(hit * hbs, num_tokens - 1)
            new = num_tokens - cached
            work = t[1] * new * 1e-3 + t[2] * new * (cached + new * 0.5) * 1e-6
            base = t[0] + per_row * (w.num_active + w.num_committed)
            steps, chunk = new / max_chunk, None
            if tight is not None:
                room = safety * tight - base
                if room <= 0:
                    continue
                steps = max(steps, work / room)
            compute = (steps if steps > 1.0 else 1.0) * base + work
            if wait + fetch + compute < beat_s:
                if tight is not None:  # never below one block a step, however little room is left
                    chunk = max(min(hbs, max_chunk), chunk_tokens(t, room, cached, max_chunk))
                beat_s, best = wait + fetch + compute, (w, wait, fetch, compute, step, hit, hit - local, chunk)
        if best is None:
            return None
        w, wait, fetch, compute, step, hit, pool_blocks, chunk = best
        return PrefillChoice(w, wait, fetch, compute, hit, pool_blocks, chunk), DecodeChoice(w, step, 0.0)

    def choose_decode(self, tpot_s: float | None, interactive: bool, total_tokens: int, context_tokens: int,
                      expected_output: int, workers: list[WorkerView],
                      feasible: list[Fit] | None = None, count_committed: bool = False) -> DecodeChoice | None:
        """Best decode worker for a request that will hold `total_tokens` of KV (context plus the
        output still expected) with `context_tokens` of context now; `tpot_s` is its TPOT target
        (None for batch work). Workers the row fits now are appended to `feasible` if given.
        `count_committed`: rows promised to requests still prefilling count as taken (a row is
        free only if nobody placed there will need it). The choice's `step_s` is the predicted
        TPOT there: the step time over the worker's measured tokens per step and row."""
        safety = self.cfg.decode_tpot_safety
        # Candidates kept as (worker, step) tuples; one DecodeChoice is built at the end.
        best, best_head, best_step = None, -math.inf, 0.0
        fallback, fallback_wait, fallback_step = None, math.inf, 0.0
        victim, victim_head, victim_step, victim_n = None, -math.inf, 0.0, 0
        may_preempt = interactive and self.cfg.preempt_batch
        min_step = self.models.prior.min_step_s
        for w in workers:
            t = w.model.theta  # inlined step-time model: this loop is the hot path
            tight = w.tpot_targets.min()
            if tpot_s is not None and (tight is None or tpot_s < tight):
                tight = tpot_s
            ctx = w.mean_context_tokens
            if ctx is None:
                ctx = w.active_context_tokens / w.num_active if w.num_active else float(context_tokens)
            per_row = t[3] * 1e-2 + t[4] * ctx * 1e-5
            rows = w.num_active + 1 + (w.num_committed if count_committed else 0)
            # A speculating worker emits `tokens_per_step` tokens per row and step: its TPOT is its
            # step time over that, so its step may take that much longer under the same target.
            per_step = w.tokens_per_step
            # Rows fit iff the step with one more row keeps the TPOT within the tightest target
            # (the batch cap, `batch_cap`, without solving for it); a lone row always fits.
            rows_ok = rows <= w.max_num_seqs and (
                tight is None or rows == 1 or t[0] + per_row * rows <= safety * tight * per_step)
            step = t[0] + per_row * (w.num_active + 1 + w.num_committed)
            if step < min_step:
                step = min_step
            step /= per_step  # from here on: seconds per output token of a row
            head = (tight if tight is not None else 0.0) - step
            free = min(w.reported_free_blocks - w.blocks_since_report, w.num_total_blocks - w.active_blocks)
            if rows_ok and free - w.committed_blocks >= -(-total_tokens // w.block_size):
                if feasible is not None:
                    feasible.append((w, tight, per_row, step))
                if head > best_head:
                    best, best_head, best_step = w, head, step
                continue
            cap = w.max_num_seqs if tight is None else batch_cap(t[0], per_row, safety * tight * per_step,
                                                                 w.max_num_seqs)
            excess = max(1, rows - cap)
            if may_preempt and len(w.victims) >= excess and head > victim_head:
                # After evicting `excess` batch rows the batch is back within the cap.
                victim, victim_head, victim_n = w, head, excess
                victim_step = max(min_step, step * per_step - per_row * excess) / per_step
            # A row frees every (expected_output * step / rows) seconds on average.
            wait = excess * expected_output * step / rows
            if wait < fallback_wait:
                fallback, fallback_wait, fallback_step = w, wait, step
        if best is not None:
            return DecodeChoice(best, best_step, 0.0)
        if victim is not None:
            return DecodeChoice(victim, victim_step, 0.0, num_preempt=victim_n)
        return None if fallback is None else DecodeChoice(fallback, fallback_step, fallback_wait)
