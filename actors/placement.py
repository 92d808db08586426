"""Where one request runs: which prefill worker computes its KV, which decode workers may take it.

Mental model: a placement policy is a pure function of the request and the workers' loads; it
answers with a prefill worker and decode workers in order of preference (a decode worker that
refuses the announce, having no room, hands the request to the next). The `Placement` protocol is
the seam the cluster scheduler (SLO budgets, prefix affinity) plugs into later; `LeastLoaded` is
the embedded default.

A placement backed by a control plane (the cluster scheduler) implements `ScheduledPlacement`
instead: its decisions are remote calls, so they are awaited; it hears about every request's life
(where each attempt runs, its stages, tokens, end) through non-blocking notifications it may batch;
it plans recoveries; and it may refuse a request (`PlacementRefused`, with a retry-after).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from actors.messages import GenerationRequest, Telemetry, TelemetryCursor, WorkerLoad

if TYPE_CHECKING:
    from actors.recovery import InFlight


class NoWorkers(RuntimeError):
    """No healthy worker of a needed kind is known."""


class PlacementRefused(RuntimeError):
    """The control plane will not take the request now. `status` is the HTTP status it maps to
    (429 over budget or SLO, 403 unknown tenant, 413 too large, 503 no healthy worker);
    `retry_after_s` is None when retrying cannot help; `predicted_wait_s` is an SLO refusal's
    predicted queueing before the request would have started."""

    def __init__(self, reason: str, retry_after_s: float | None, status: int = 429, detail: str = "",
                 predicted_wait_s: float | None = None) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.status = status
        self.detail = detail
        self.predicted_wait_s = predicted_wait_s

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (PlacementRefused, (self.reason, self.retry_after_s, self.status, self.detail, self.predicted_wait_s))


@dataclass(frozen=True)
class PlacementChoice:
    prefill: str | None  # None: the request needs no handoff (it runs on a decode worker alone)
    decodes: tuple[str, ...]  # preference order, never empty
    # With prefill None on a prompt that could be handed off: the scheduler placed its prefill on
    # decodes[0] itself, at most this many prompt tokens per step (None: the engine's budget).
    local_chunk_tokens: int | None = None
    # (SLO class rank, key): its place in the queue for a decode row, smaller first; the
    # scheduler's (rank, urgency), or None: interactive, by arrival time.
    priority: tuple[int, float] | None = None


class Placement(Protocol):
    def place(self, req: GenerationRequest, prefills: Sequence[WorkerLoad],
              decodes: Sequence[WorkerLoad]) -> PlacementChoice:
        """Chooses workers among the given ones (each load names its worker). Raises `NoWorkers`
        when a needed kind has no healthy worker; must not block."""
        ...


class FlightSource(Protocol):
    """What a scheduled placement may ask of its caller: the requests in flight (to rebuild a
    restarted scheduler), the workers' loads (its heartbeats) and their telemetry after the given
    cursors (None: from scratch; workers that do not answer are left out), and to carry out the
    scheduler's preemptions (`preempt`: True stopped, False cannot now, None not in flight;
    `resume`: where a preempted request runs next)."""

    def in_flight(self) -> list["InFlight"]: ...

    def preempt(self, request_id: str) -> bool | None: ...

    def resume(self, request_id: str, choice: PlacementChoice) -> bool: ...

    async def loads(self) -> dict[str, WorkerLoad]: ...

    async def telemetry(self, cursors: Mapping[str, TelemetryCursor | None]) -> dict[str, Telemetry]: ...


@runtime_checkable
class ScheduledPlacement(Protocol):
    """A placement that a control plane decides. Contract:
    - `admit` places a new request (or raises `PlacementRefused` / `NoWorkers`) within its own
      deadline, falling back to a local policy when the control plane does not answer;
    - `recover(dead, flights, ...)` returns every given flight, most urgent first, each with
      where to resume it or the exception to fail it with;
    - the `on_*` notifications never block and never raise (they are batched);
    - `attach` is called once by the caller that owns the flights;
    - `available` is False while the control plane is not answering;
    - `preempt_batch`: the caller may stop batch rows for interactive requests itself."""

    @property
    def available(self) -> bool: ...

    @property
    def preempt_batch(self) -> bool: ...

    def attach(self, source: FlightSource) -> None: ...

    async def admit(self, req: GenerationRequest, prefills: Sequence[WorkerLoad],
                    decodes: Sequence[WorkerLoad]) -> PlacementChoice: ...

    async def recover(self, dead: frozenset[str], flights: Sequence["InFlight"], prefills: Sequence[WorkerLoad],
                      decodes: Sequence[WorkerLoad]) -> list[tuple["InFlight", PlacementChoice | BaseException]]: ...

    def on_placed(self, flight: "InFlight") -> None:
        """An attempt of `flight` now runs on `flight.prefill` / `flight.decode`."""
        ...

    def on_stage(self, flight: "InFlight", stage: str, t: float) -> None:
        """`stage`: "prefill_start", "kv_transfer_done" or "decode_admitted"."""
        ...

    def on_tokens(self, flight: "InFlight", num_tokens: int, t: float) -> None: ...

    def on_done(self, flight: "InFlight", finished: bool, t: float) -> None:
        """The request left: finished (`finished`), or failed / cancelled."""
        ...

    def on_preempted(self, flight: "InFlight") -> None:
        """The caller stopped `flight`'s row itself (for an interactive request that found no
        room): it waits to be placed again, like a victim of the scheduler's."""
        ...


class LeastLoaded:
    """Fewest active requests first (running + waiting + announced); among equals the start of the
    order rotates with every call, so a burst that sees equal loads is spread round-robin."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def place(self, req: GenerationRequest, prefills: Sequence[WorkerLoad],
              decodes: Sequence[WorkerLoad]) -> PlacementChoice:
        turn = next(self._turn)
        ordered_decodes = self._order(decodes, turn)
        if not ordered_decodes:
            raise NoWorkers("no healthy decode worker")
        prefill = None
        if req.needs_handoff:
            ordered_prefills = self._order(prefills, turn)
            if not ordered_prefills:
                raise NoWorkers("no healthy prefill worker")
            prefill = ordered_prefills[0]
        return PlacementChoice(prefill, tuple(ordered_decodes))

    @staticmethod
    def _order(loads: Sequence[WorkerLoad], turn: int) -> list[str]:
        healthy = sorted((w for w in loads if w.healthy), key=lambda w: w.name)
        n = len(healthy)
        ranked = sorted(range(n), key=lambda i: (healthy[i].num_active, (i - turn) % n))
        return [healthy[i].name for i in ranked]
