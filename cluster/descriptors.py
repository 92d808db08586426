"""Descriptors: the small, plain facts the control plane decides on.

Mental model: `cluster/` never touches an engine, a tensor or a Ray handle. The data plane (and the
simulator) describe a request by its size, owner and prompt block hashes (`RequestDesc`), and a
worker by a periodic load report (`WorkerReport`, carrying the step times it measured as
`StepSample`s and the prefix blocks it gained or lost since the last report), or by its load and,
separately, numbered telemetry (`WorkerTelemetry`) relayed by any number of ingresses. The Ray integration
only converts `actors/` types into these; nothing here imports a heavy dependency.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NewType

from actors.kinds import WorkerKind  # noqa: F401  (re-exported: the scheduler's modules name it from here)

RequestId = NewType("RequestId", str)
TenantId = NewType("TenantId", str)
WorkerName = NewType("WorkerName", str)


class SloClass(str, enum.Enum):
    """`interactive`: TTFT and TPOT targets at P99. `batch`: one completion deadline."""

    INTERACTIVE = "interactive"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        # Priority keys sort by rank first: interactive work always runs before batch work.
        return 0 if self is SloClass.INTERACTIVE else 1


@dataclass(frozen=True, slots=True)
class RequestDesc:
    """What the scheduler knows of one request when it is submitted.

    `block_hashes` are the chained hashes (`actors.engine.block_hash.hash_block_chain`) of the
    prompt's full blocks of `SchedulerConfig.hash_block_size` tokens, oldest first; equal hashes
    mean equal prefixes. `slo_class=None` means the tenant's own class; an interactive tenant may
    send `SloClass.BATCH` to downgrade one request (a batch tenant cannot upgrade). `arrival_time`
    is on the scheduler's clock.
    """

    request_id: RequestId
    tenant: TenantId
    num_prompt_tokens: int
    max_tokens: int
    block_hashes: tuple[int, ...] = ()
    arrival_time: float = 0.0
    slo_class: SloClass | None = None

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1:
            raise ValueError(f"num_prompt_tokens must be >= 1, got {self.num_prompt_tokens}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True, slots=True)
class StepSample:
    """One engine step as measured by a worker: the features the cost model regresses on.

    `num_prefill_pairs` is the attention work of the step's prefill chunks, the sum over chunks of
    new_tokens x (cached_tokens + new_tokens / 2) query-key pairs; `num_context_tokens` is the KV
    the decode rows read, the sum of their context lengths.
    """

    num_prefill_tokens: int
    num_prefill_pairs: float
    num_decode_seqs: int
    num_context_tokens: int
    step_s: float


@dataclass(frozen=True, slots=True)
class WorkerTelemetry:
    """What a worker's engine measured after the cursor the scheduler gave (`TelemetryInbox`):
    steps numbered from `first_step_seq`, prefix-cache changes as (seq, hashes added, hashes
    removed), or, instead of changes, every hash held (`cached_full`) as of `cache_seq`.
    `incarnation` names the worker process: its numbers start again when it restarts."""

    name: WorkerName
    incarnation: str
    first_step_seq: int
    steps: tuple[StepSample, ...] = ()
    cache_seq: int = 0
    cache_changes: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...] = ()
    cached_full: frozenset[int] | None = None


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """A worker's periodic report; it doubles as the heartbeat.

    Prefix holdings travel as deltas (`cached_added` / `cached_removed`, block hashes) or, when
    `cached_full` is given, as the whole set, which replaces what the scheduler knew (sent on the
    first report and after a scheduler restart). Speculation counters are cumulative totals.
    """

    name: WorkerName
    kind: WorkerKind
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int = 16
    healthy: bool = True
    report_time: float = 0.0
    steps: tuple[StepSample, ...] = ()
    cached_added: tuple[int, ...] = ()
    cached_removed: tuple[int, ...] = ()
    cached_full: frozenset[int] | None = None
    # Speculative decoding, cumulative since the worker's engine started: rows that verified drafts
    # (one per speculating row and step), the draft tokens accepted in them (each an output token
    # without a step), and decode rows, speculating or not (one per row and step; 0 or None from a
    # worker that does not report them: it is then priced at 1 token per row-step).
    num_spec_rounds: int = 0
    num_accepted_tokens: int = 0
    num_decode_rows: int | None = 0
    # Measured seconds to fetch one block from the shared prefix pool here (smoothed); None where
    # not measured yet: placement then prices this worker's pool hits with its configured constant.
    pool_fetch_s_per_block: float | None = None

    def __post_init__(self) -> None:
        if self.pool_fetch_s_per_block is not None and not 0 <= self.pool_fetch_s_per_block < float("inf"):
            raise ValueError(f"worker {self.name}: pool_fetch_s_per_block {self.pool_fetch_s_per_block} "
                             "is not a finite number of seconds >= 0")
        if self.num_total_blocks < 0 or not 0 <= self.num_free_blocks <= max(self.num_total_blocks, 0):
            raise ValueError(
                f"worker {self.name}: free blocks {self.num_free_blocks} outside [0, {self.num_total_blocks}]"
            )
        if self.block_size < 1:
            raise ValueError(f"worker {self.name}: block_size must be >= 1")
