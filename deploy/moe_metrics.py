"""Prometheus metrics of MoE expert routing, from the workers' `ExpertLoadReport`s.

Mental model: the routing controller holds each worker's latest report (cumulative tokens per layer
and expert, the table version it routes with, its layers in safe mode); the ingress reads them every
period (deploy/moe.py) and hands them here. Tokens become a counter per (worker, layer, expert) by
adding increases (`ExpertLoadReport.since`: a count that went backwards is a restarted worker);
share and imbalance (max/mean) are gauges over the tokens routed since the previous export, so they
show the load now, not since start. Exported as `ray_<name>` like deploy/metrics.py.
"""

from __future__ import annotations

from collections.abc import Mapping

from actors.engine.moe.routing import imbalance
from actors.engine.moe.telemetry import ExpertLoadReport
from deploy.metrics import MetricSpec, _inc, _instruments

MOE_METRICS = {name: MetricSpec(kind, text, tags) for name, kind, text, tags in (
    ("ferry_moe_expert_tokens", "counter", "Tokens an MoE layer routed to an expert (a token counts once per "
     "chosen expert).", ("worker", "layer", "expert")),
    ("ferry_moe_expert_share", "gauge", "An expert's share of its layer's routed tokens since the previous export.",
     ("worker", "layer", "expert")),
    ("ferry_moe_imbalance", "gauge", "Expert-load imbalance of a layer since the previous export: max/mean tokens "
     "per expert (1: even).", ("worker", "layer")),
    ("ferry_moe_table_version", "gauge", "Routing bias table version the worker routes with.", ("worker",)),
    ("ferry_moe_safe_mode_layers", "gauge", "MoE layers routing without bias after non-finite router scores.",
     ("worker",)),
)}


def moe_exported_names() -> set[str]:
    return {f"ray_{name}{'_total' if spec.kind == 'counter' else ''}" for name, spec in MOE_METRICS.items()}


class ExpertLoadExporter:
    def __init__(self) -> None:
        self._m = _instruments(MOE_METRICS)
        self._last: dict[str, ExpertLoadReport] = {}  # worker -> its report at the previous export

    def export(self, reports: Mapping[str, ExpertLoadReport]) -> dict[str, list[list[int]]]:
        """Records every worker's report; returns the tokens each routed since the previous export."""
        m, recent = self._m, {}
        for worker, r in reports.items():
            rows = r.since(self._last.get(worker))
            for layer, increases in enumerate(rows):
                total = sum(increases)
                for expert, n in enumerate(increases):
                    tags = {"worker": worker, "layer": str(layer), "expert": str(expert)}
                    _inc(m["ferry_moe_expert_tokens"], n, tags)
                    if total:
                        m["ferry_moe_expert_share"].set(n / total, tags)
                if total:
                    m["ferry_moe_imbalance"].set(imbalance(increases), {"worker": worker, "layer": str(layer)})
            m["ferry_moe_table_version"].set(r.table_version, {"worker": worker})
            m["ferry_moe_safe_mode_layers"].set(len(r.safe_mode_layers), {"worker": worker})
            self._last[worker] = r
            recent[worker] = rows
        return recent
