"""Adapters: the data plane's types (`actors/`) as the control plane's descriptors.

Mental model: `cluster/` decides on small plain facts; these functions are the one place that
reads `actors.messages` / `actors.recovery` objects and writes `cluster.descriptors` /
`cluster.flights` ones (and turns a scheduler refusal into the data plane's exception). They
run on the ingress side, never in the scheduler actor, which therefore never imports torch.
"""

from __future__ import annotations

from actors.messages import GenerationRequest
from actors.messages import WorkerLoad as ActorWorkerLoad
from actors.placement import PlacementRefused
from actors.recovery import DECODING, PREFILLING, InFlight
from cluster.admission import Refusal
from cluster.descriptors import RequestDesc, RequestId, SloClass, TenantId, WorkerKind, WorkerLoad, WorkerName
from cluster.flights import FlightState
from cluster.journal import Phase

_PHASES = {PREFILLING: Phase.PREFILLING, DECODING: Phase.DECODING}


def worker_load(load: ActorWorkerLoad, now: float, block_size: int) -> WorkerLoad:
    """A worker's report: requests announced to a decode worker whose KV has not landed count
    as waiting."""
    return WorkerLoad(
        name=WorkerName(load.name), kind=WorkerKind(load.kind), num_running=load.num_running,
        num_waiting=load.num_waiting + load.num_reserved,
        num_free_blocks=max(0, min(load.num_free_blocks, load.num_total_blocks)),
        num_total_blocks=load.num_total_blocks, block_size=block_size, healthy=load.healthy, report_time=now)


def request_desc(req: GenerationRequest, slo_class: SloClass | None = None) -> RequestDesc:
    """No block hashes: the workers do not report their prefix holdings to the scheduler yet, so
    an affinity score could only be zero."""
    return RequestDesc(RequestId(req.request_id), TenantId(req.tenant), req.num_prompt_tokens,
                       req.params.max_tokens, (), req.arrival_time, slo_class)


def flight_state(flight: InFlight, slo_class: SloClass | None = None) -> FlightState:
    return FlightState(
        desc=request_desc(flight.req, slo_class),
        prefill_worker=None if flight.prefill is None else WorkerName(flight.prefill),
        decode_worker=None if flight.decode is None else WorkerName(flight.decode),
        phase=_PHASES.get(flight.phase, Phase.QUEUED), num_output_tokens=len(flight.streamed),
        first_token_time=flight.first_token_at, last_token_time=flight.last_token_at, seed=flight.req.seed,
        num_recoveries=flight.attempt)


def refusal_error(refusal: Refusal) -> PlacementRefused:
    return PlacementRefused(refusal.reason.value, refusal.retry_after_s, refusal.reason.http_status, refusal.detail)
