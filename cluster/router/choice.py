"""Where one request runs: the router's `PlacementChoice`, and the one policy that makes it locally.

Mental model: a choice names a prefill worker and decode workers in order of preference (a decode
worker that refuses the announce, having no room, hands the request to the next). The control
plane (cluster/router/link.py) decides the first workers when it answers (a scheduler
`Placement`); the router's `LocalPolicy` orders everything else by load, and decides alone
when the control plane is away. `LeastLoaded` is that policy; `LocalPolicy.place(...,
decided=)` is the one place a control-plane decision becomes a choice.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from actors.errors import NoWorkers
from actors.messages import GenerationRequest, WorkerLoad
from cluster.placement import Placement


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
    # The request's TPOT target (its tenant's SLO, from the scheduler's placement); None: none known.
    tpot_s: float | None = None

    def apply(self, req: GenerationRequest) -> GenerationRequest:
        """`req` as an attempt placed by this choice runs: with its SLO class rank (engines admit
        a smaller rank first) and its TPOT target (engines speculate first for rows short of slack)."""
        rank = req.priority_rank if self.priority is None else self.priority[0]
        if rank == req.priority_rank and self.tpot_s == req.tpot_target_s:
            return req
        return replace(req, priority_rank=rank, tpot_target_s=self.tpot_s)


class LocalPolicy(Protocol):
    def place(self, req: GenerationRequest, prefills: Sequence[WorkerLoad], decodes: Sequence[WorkerLoad],
              decided: Placement | None = None) -> PlacementChoice:
        """Chooses workers among the given ones (each load names its worker), the control
        plane's `decided` workers first when they are healthy. Raises `NoWorkers` when a needed
        kind has no healthy worker; must not block."""
        ...


class LeastLoaded:
    """Fewest active requests first (running + waiting + announced); among equals the start of the
    order rotates with every call, so a burst that sees equal loads is spread round-robin."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def place(self, req: GenerationRequest, prefills: Sequence[WorkerLoad], decodes: Sequence[WorkerLoad],
              decided: Placement | None = None) -> PlacementChoice:
        turn = next(self._turn)
        ordered_decodes = self._order(decodes, turn)
        if not ordered_decodes:
            raise NoWorkers("no healthy decode worker")
        prefill = None
        if req.needs_handoff and prefills:  # no prefill workers at all: colocated, nothing to hand off
            ordered_prefills = self._order(prefills, turn)
            if not ordered_prefills:
                raise NoWorkers("no healthy prefill worker")
            prefill = ordered_prefills[0]
        own = PlacementChoice(prefill, tuple(ordered_decodes))
        return own if decided is None else following(decided, own, {w.name for w in (*prefills, *decodes) if w.healthy})

    @staticmethod
    def _order(loads: Sequence[WorkerLoad], turn: int) -> list[str]:
        healthy = sorted((w for w in loads if w.healthy), key=lambda w: w.name)
        n = len(healthy)
        ranked = sorted(range(n), key=lambda i: (healthy[i].num_active, (i - turn) % n))
        return [healthy[i].name for i in ranked]


def following(decided: Placement, own: PlacementChoice, healthy: set[str]) -> PlacementChoice:
    """The control plane's decision first, then `own`'s other decode workers; workers seen dead
    here are skipped even if the control plane has not heard yet. A prefill placed on the decode
    worker itself (`Placement.local`) means no handoff: the decode worker runs it whole, in chunks
    of at most `Placement.local_chunk_tokens`."""
    decode = decided.decode_worker
    first = (decode,) if decode in healthy else ()
    prefill = None
    if own.prefill is not None and not (decided.local and first):
        prefill = decided.prefill_worker if decided.prefill_worker in healthy else own.prefill
    return PlacementChoice(prefill, first + tuple(d for d in own.decodes if d != decode),
                           decided.local_chunk_tokens if prefill is None and first else None,
                           (decided.priority.class_rank, decided.priority.key_s), decided.tpot_s)


def lend_prefill(prefills: Sequence[WorkerLoad], decodes: Sequence[WorkerLoad]) -> PlacementChoice | None:
    """Where a stream goes when no decode worker is healthy: the least busy healthy prefill
    worker, which runs it whole (None: a decode worker is up, or no prefill worker is)."""
    healthy = [w for w in prefills if w.healthy]
    if not healthy or any(w.healthy for w in decodes):
        return None
    lent = min(healthy, key=lambda w: (w.num_running + w.num_waiting, w.name))
    return PlacementChoice(prefill=None, decodes=(lent.name,))
