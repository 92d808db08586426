"""Where one request runs: which prefill worker computes its KV, which decode workers may take it.

Mental model: a placement policy is a pure function of the request and the workers' loads; it
answers with a prefill worker and decode workers in order of preference (a decode worker that
refuses the announce, having no room, hands the request to the next). The `Placement` protocol is
the seam the cluster scheduler (SLO budgets, prefix affinity) plugs into later; `LeastLoaded` is
the embedded default.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from actors.messages import GenerationRequest, WorkerLoad


class NoWorkers(RuntimeError):
    """No healthy worker of a needed kind is known."""


@dataclass(frozen=True)
class PlacementChoice:
    prefill: str | None  # None: the request needs no handoff (it runs on a decode worker alone)
    decodes: tuple[str, ...]  # preference order, never empty


class Placement(Protocol):
    def place(self, req: GenerationRequest, prefills: Sequence[WorkerLoad],
              decodes: Sequence[WorkerLoad]) -> PlacementChoice:
        """Chooses workers among the given ones (each load names its worker). Raises `NoWorkers`
        when a needed kind has no healthy worker; must not block."""
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
