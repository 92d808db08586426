"""Adapters: the data plane's types (`actors/`) as the control plane's descriptors.

Mental model: `cluster/` decides on small plain facts; these functions are the one place that
reads `actors.messages` / `cluster.router.flight` objects and writes `cluster.descriptors` /
`cluster.flights` ones (and turns a scheduler refusal into the data plane's exception). They
run on the ingress side, never in the scheduler actor, which therefore never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from actors.holdings import HoldingsRead
from actors.messages import GenerationRequest, Telemetry, TelemetryCursor
from actors.messages import WorkerLoad as ActorWorkerLoad
from cluster.admission import Refusal
from cluster.descriptors import (RequestDesc, RequestId, SloClass, StepSample, TenantId, WorkerKind, WorkerReport,
                                 WorkerName, WorkerTelemetry)
from cluster.flights import FlightState
from cluster.journal import Phase
from cluster.prefix_index import is_pool_store, pool_store
from actors.errors import Refused
from cluster.router.flight import DECODING, PREEMPTED, PREFILLING, InFlight

_PHASES = {PREFILLING: Phase.PREFILLING, DECODING: Phase.DECODING, PREEMPTED: Phase.PREEMPTED}


def worker_load(load: ActorWorkerLoad, now: float, block_size: int) -> WorkerReport:
    """A worker's report: requests announced to a decode worker whose KV has not landed count
    as waiting; its measured pool fetch time travels as is (None: not measured)."""
    return WorkerReport(
        name=WorkerName(load.name), kind=WorkerKind(load.kind), num_running=load.num_running,
        num_waiting=load.num_waiting + load.num_reserved,
        num_free_blocks=max(0, min(load.num_free_blocks, load.num_total_blocks)),
        num_total_blocks=load.num_total_blocks, block_size=block_size, healthy=load.healthy, report_time=now,
        num_spec_rounds=load.num_spec_rounds, num_accepted_tokens=load.num_accepted_tokens,
        num_decode_rows=load.num_decode_rows,
        pool_fetch_s_per_block=load.pool_fetch_s_per_block)


def worker_telemetry(t: Telemetry) -> WorkerTelemetry:
    return WorkerTelemetry(
        WorkerName(t.name), t.incarnation, t.first_step_seq,
        tuple(StepSample(s.num_prefill_tokens, s.num_prefill_pairs, s.num_decode_seqs, s.num_context_tokens, s.step_s)
              for s in t.steps),
        t.cache_seq, t.cache_changes, t.cached_full)


# `PrefixCachePool.holdings`: per store id, its prefix blocks after the reader's (incarnation, change).
PoolHoldingsRead = Callable[[Mapping[str, "tuple[str, int] | None"]], Mapping[str, HoldingsRead]]


def pool_cursors(cursors: Mapping[str, TelemetryCursor]) -> dict[str, tuple[str, int]]:
    """The scheduler's cursors of the pool's stores, by store id."""
    return {name[len(pool_store("")):]: (c.incarnation, c.cache_seq) for name, c in cursors.items()
            if is_pool_store(name)}


def pool_telemetry(store_id: str, read: HoldingsRead) -> WorkerTelemetry:
    """One pool store's holdings as telemetry of its `pool_store` name (prefix changes, no steps)."""
    return WorkerTelemetry(pool_store(store_id), read.incarnation, 1, (), read.seq, read.changes, read.full)


def telemetry_cursor(cursor: tuple[str, int, int]) -> TelemetryCursor:
    return TelemetryCursor(*cursor)


def request_desc(req: GenerationRequest, block_hashes: tuple[int, ...] = ()) -> RequestDesc:
    """`block_hashes`: the prompt's full blocks as the engines hash them (`prompt_block_hashes`),
    matched against what the workers report holding. The SLO class is the tenant's (None) unless
    the caller downgraded the request."""
    slo_class = None if req.slo_class is None else SloClass(req.slo_class)
    return RequestDesc(RequestId(req.request_id), TenantId(req.tenant), req.num_prompt_tokens,
                       req.params.max_tokens, block_hashes, req.arrival_time, slo_class)


def flight_state(flight: InFlight, block_hashes: tuple[int, ...] = ()) -> FlightState:
    return FlightState(
        desc=request_desc(flight.req, block_hashes),
        prefill_worker=None if flight.prefill is None else WorkerName(flight.prefill),
        decode_worker=None if flight.decode is None else WorkerName(flight.decode),
        phase=_PHASES.get(flight.phase, Phase.QUEUED), num_output_tokens=len(flight.streamed),
        first_token_time=flight.first_token_at, last_token_time=flight.last_token_at, seed=flight.req.seed,
        num_recoveries=flight.attempt)


def refusal_error(refusal: Refusal) -> Refused:
    """The scheduler's answer (a descriptor) as the request path's one refusal type."""
    return Refused(refusal.reason.value, refusal.detail, status=refusal.reason.http_status,
                   retry_after_s=refusal.retry_after_s, predicted_wait_s=refusal.predicted_wait_s)
