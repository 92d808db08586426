"""What crosses between the ingress and the scheduler actor: request states, events, acknowledgements.

Mental model: the ingress owns the truth about every request it streams (`FlightState`: where
it runs, its phase, how many tokens the client has); the scheduler actor keeps a copy good enough
to decide on. The ingress sends batched `FlightEvent`s (stage reached, tokens streamed, done, and
"adopt this state" when the truth moved without the scheduler deciding it: a fallback placement
while the scheduler was down, a decode worker other than the one chosen). Batches carry a
sequence number so one re-sent after a timeout is applied once. After a scheduler restart the
ingress answers `ReportAck.needs_rebuild` with all its states (`SchedulerService.rebuild`).
Plain frozen dataclasses of plain fields: they pickle cheaply and import nothing heavy, so the
scheduler actor never loads torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cluster.descriptors import RequestDesc, RequestId, WorkerName
from cluster.journal import Phase
from cluster.placement import Placement


@dataclass(frozen=True, slots=True)
class FlightState:
    """One in-flight request as its ingress sees it. Times are wall clock (the scheduler actor's
    clock). `prefill_worker` is None for requests that run on a decode worker alone."""

    desc: RequestDesc
    prefill_worker: WorkerName | None
    decode_worker: WorkerName | None
    phase: Phase
    num_output_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    seed: int | None = None
    num_recoveries: int = 0

    @property
    def request_id(self) -> RequestId:
        return self.desc.request_id


class EventKind(str, enum.Enum):
    STAGE = "stage"  # `stage` (a `cluster.timeline.Stage` value) reached at `t`
    TOKENS = "tokens"  # tokens streamed at `times`
    FINISH = "finish"  # completed with `num_output_tokens`
    CANCEL = "cancel"  # failed or cancelled
    ADOPT = "adopt"  # take `state` as the truth


@dataclass(frozen=True, slots=True)
class FlightEvent:
    kind: EventKind
    request_id: RequestId
    t: float = 0.0
    stage: str | None = None
    times: tuple[float, ...] = ()
    num_output_tokens: int | None = None
    state: FlightState | None = None
    spec: tuple[int, int] | None = None  # FINISH: draft tokens (proposed, accepted) over every attempt


@dataclass(frozen=True, slots=True)
class ReportAck:
    """`incarnation` changes when the actor restarts; `needs_rebuild`: this ingress has not
    given this incarnation its in-flight list yet (its events were not applied); `expired`:
    requests the scheduler cancelled for waiting past their queue timeout; `cursors`: per
    worker, (incarnation, step, cache change) the scheduler has applied of its telemetry, where
    the next reads should start (`cluster.telemetry`).

    Notices: orders for this ingress's requests that the scheduler decided on someone else's
    call. `preempt`: batch rows to stop now (their decode row went to an interactive request);
    `resume`: where preempted rows run again. They are numbered; `notice_seq` is the last one
    included, and the ingress sends it back (`report(delivered=...)`) so each notice is
    re-sent until the ingress has seen it (at least once; the ingress ignores repeats)."""

    incarnation: str
    needs_rebuild: bool
    applied_seq: int
    num_in_flight: int
    expired: tuple[RequestId, ...] = field(default_factory=tuple)
    cursors: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    notice_seq: int = 0
    preempt: tuple[RequestId, ...] = ()
    resume: tuple[Placement, ...] = ()
