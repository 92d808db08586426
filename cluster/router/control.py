"""The router's seam to the control plane: what it asks (`ControlPlane`) and what it answers (`FlightSource`).

Mental model: the control plane (the scheduler actor, through `SchedulerLink`) decides where a
request runs; the router carries it out and reports back. Its decisions are remote calls, so they
are awaited; each answers a scheduler `Placement`, a refusal (`actors.errors.Refused`), or None: "the
control plane is away, place it yourself", which the router does with its one local policy
(`choice.LocalPolicy`). It hears about every request's life (where each attempt runs, its
stages, tokens, end) through notifications that never block. In the other direction it may ask
the router (`FlightSource`) for the requests in flight (to rebuild a restarted scheduler), the
workers' loads and telemetry, and to carry out its preemptions and resumptions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from actors.messages import GenerationRequest, Telemetry, TelemetryCursor, WorkerLoad
from cluster.placement import Placement

if TYPE_CHECKING:
    from cluster.router.flight import InFlight

# A recovery plan's answer for one request: where the scheduler resumes it, None (place it by the
# local policy), or the exception to fail it with.
Planned = Placement | None | BaseException


class FlightSource(Protocol):
    """What the control plane may ask of the router. `preempt`: True stopped, False cannot now,
    None not in flight. `resume`: runs a preempted request where `decided` says (False: it is not
    waiting; raises `NoWorkers` when none of its workers is placeable)."""

    def in_flight(self) -> list[InFlight]: ...

    def preempt(self, request_id: str) -> bool | None: ...

    def resume(self, request_id: str, decided: Placement) -> bool: ...

    async def loads(self) -> dict[str, WorkerLoad]: ...

    async def telemetry(self, cursors: Mapping[str, TelemetryCursor | None]) -> dict[str, Telemetry]: ...


@runtime_checkable
class ControlPlane(Protocol):
    """Contract:
    - `admit` decides for a new request within its own deadline (or raises `Refused`);
      None when the control plane did not answer;
    - `fallback_rank` is the queue rank (0 interactive, 1 batch) of a request placed locally;
    - `recover(dead, flights)` returns every given flight, most urgent first, with its `Planned`;
    - the `on_*` notifications never block and never raise (they are batched);
    - `attach` is called once by the router that owns the flights;
    - `available` is False while the control plane is not answering;
    - `preempt_batch`: the router may stop batch rows for interactive requests itself."""

    @property
    def available(self) -> bool: ...

    @property
    def preempt_batch(self) -> bool: ...

    def attach(self, source: FlightSource) -> None: ...

    async def admit(self, req: GenerationRequest) -> Placement | None: ...

    def fallback_rank(self, req: GenerationRequest) -> int: ...

    async def recover(self, dead: frozenset[str], flights: Sequence[InFlight]) -> list[tuple[InFlight, Planned]]: ...

    def on_placed(self, flight: InFlight) -> None:
        """An attempt of `flight` now runs on `flight.prefill` / `flight.decode`."""
        ...

    def on_stage(self, flight: InFlight, stage: str, t: float) -> None:
        """`stage`: "prefill_start", "kv_transfer_done" or "decode_admitted"."""
        ...

    def on_tokens(self, flight: InFlight, num_tokens: int, t: float) -> None: ...

    def on_done(self, flight: InFlight, finished: bool, t: float) -> None:
        """The request left: finished (`finished`), or failed / cancelled."""
        ...

    def on_preempted(self, flight: InFlight) -> None:
        """The router stopped `flight`'s row itself (for an interactive request that found no
        room): it waits to be placed again, like a victim of the scheduler's."""
        ...
