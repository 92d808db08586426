"""The dashboard's MoE section: each worker's expert load over the last poll, and its routing table.

Mental model: an `ExpertSource` (the ingress's `deploy/moe.RoutingView`, reading the routing controller)
hands the workers' cumulative `ExpertLoadReport`s; `ExpertWindow` keeps the previous poll's report of
each worker and turns the difference into what the page draws: per layer the share of each expert,
the worst layer's imbalance (max/mean) and the tokens routed since the previous poll that saw new
tokens (the whole count on the first poll or after a worker restart), with the table version and
any layer in safe mode.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from actors.engine.moe.routing import imbalance
from actors.engine.moe.telemetry import ExpertLoadReport


class ExpertSource(Protocol):
    async def expert_reports(self) -> Mapping[str, ExpertLoadReport]: ...


@dataclass(frozen=True)
class ExpertFigures:
    worker: str
    table_version: int
    num_tokens: int  # routed since the previous poll, summed over layers (a token counts per chosen expert)
    imbalance: float  # worst layer's max/mean over those tokens (1.0: even, or nothing routed)
    shares: list[list[float]]  # [layer][expert] of those tokens
    safe_mode_layers: list[int]


class ExpertWindow:
    def __init__(self) -> None:
        self._last: dict[str, ExpertLoadReport] = {}
        self._shown: dict[str, ExpertFigures] = {}

    def figures(self, reports: Mapping[str, ExpertLoadReport]) -> list[ExpertFigures]:
        """A worker with nothing routed since the previous poll keeps its last figures (the page polls
        faster than workers report, and an idle worker's last load is still its load)."""
        out = []
        for worker, r in sorted(reports.items()):
            rows = r.since(self._last.get(worker))
            self._last[worker] = r
            shown = self._shown.get(worker)
            if shown is not None and not any(map(any, rows)):
                shown = replace(shown, table_version=r.table_version, safe_mode_layers=list(r.safe_mode_layers))
            else:
                shares = [[round(n / sum(row), 4) if sum(row) else 0.0 for n in row] for row in rows]
                shown = ExpertFigures(worker, r.table_version, sum(map(sum, rows)),
                                      round(max((imbalance(row) for row in rows), default=1.0), 3), shares,
                                      list(r.safe_mode_layers))
            self._shown[worker] = shown
            out.append(shown)
        return out
