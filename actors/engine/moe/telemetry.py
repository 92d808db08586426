"""What a model's MoE layers measured: tokens per (layer, expert), and a sample of router logits.

Mental model: `LoadCounters` adds each forward's expert choices into one [L, E] int64 tensor on the
model's device (one bincount per layer, no host sync); readers copy it out. Counts are cumulative
since the worker started, so any number of readers (the controller, /health, Prometheus) take
their own windows by differencing. `LogitSample` keeps the last `capacity` router-logit rows of
each layer (a few rows of every step, evenly spaced), the logit sample on which the routing
controller tries a candidate table before publishing it. `ExpertLoadReport` is the descriptor
both leave the worker as.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.engine.moe.routing import expert_counts, imbalance


class LoadCounters:
    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self._counts: torch.Tensor | None = None  # [L, E] int64, made on the first forward's device

    def add(self, layer: int, top_e: torch.Tensor) -> None:
        if self._counts is None:
            self._counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int64, device=top_e.device)
        self._counts[layer] += expert_counts(top_e, self.num_experts)

    def read(self) -> list[list[int]]:
        if self._counts is None:
            return [[0] * self.num_experts for _ in range(self.num_layers)]
        return self._counts.cpu().tolist()


class LogitSample:
    def __init__(self, num_layers: int, num_experts: int, capacity: int = 512, rows_per_step: int = 16) -> None:
        self.capacity, self.rows_per_step = capacity, rows_per_step
        self.num_layers, self.num_experts = num_layers, num_experts
        self._rows: torch.Tensor | None = None  # [L, capacity, E] float32
        self._next = [0] * num_layers
        self._filled = [0] * num_layers

    def add(self, layer: int, logits: torch.Tensor) -> None:
        """logits [T, E] float32; keeps up to `rows_per_step` of them, evenly spaced."""
        t = logits.shape[0]
        if self.capacity == 0 or t == 0:
            return
        if self._rows is None:
            self._rows = torch.zeros(self.num_layers, self.capacity, self.num_experts, device=logits.device)
        n = min(t, self.rows_per_step, self.capacity)
        picked = logits if n == t else logits[torch.linspace(0, t - 1, n, device=logits.device).long()]
        at = self._next[layer]
        slots = (torch.arange(n, device=logits.device) + at) % self.capacity
        self._rows[layer].index_copy_(0, slots, picked)
        self._next[layer] = (at + n) % self.capacity
        self._filled[layer] = min(self.capacity, self._filled[layer] + n)

    def read(self) -> list[torch.Tensor]:
        """Per layer, the rows kept [n, E] on the host (n <= capacity; oldest order not kept)."""
        if self._rows is None:
            return [torch.zeros(0, self.num_experts) for _ in range(self.num_layers)]
        rows = self._rows.cpu()
        return [rows[i, : self._filled[i]].clone() for i in range(self.num_layers)]


@dataclass(frozen=True)
class ExpertLoadReport:
    """One worker's MoE state, as /health, Prometheus and the routing controller read it."""

    table_version: int  # the table the worker routes with (applied: every step from the next on)
    tokens: tuple[tuple[int, ...], ...]  # [L][E] cumulative tokens routed (a token counts per chosen expert)
    safe_mode_layers: tuple[int, ...] = ()
    num_table_swaps: int = 0
    num_tables_rejected: int = 0
    num_budgeted_requests: int = 0  # requests whose decode tokens are restricted to a few experts now

    def since(self, prev: "ExpertLoadReport | None") -> list[list[int]]:
        """Tokens routed since `prev` per layer and expert (all of them when `prev` is None, of another
        shape, or ahead of this one: the worker restarted)."""
        if prev is None or len(prev.tokens) != len(self.tokens) or any(
                b > n for pr, row in zip(prev.tokens, self.tokens) for b, n in zip(pr, row)):
            return [list(row) for row in self.tokens]
        return [[n - b for b, n in zip(pr, row)] for pr, row in zip(prev.tokens, self.tokens)]

    def shares(self, layer: int) -> list[float]:
        row = self.tokens[layer]
        total = sum(row)
        return [n / total if total else 0.0 for n in row]

    def imbalances(self) -> list[float]:
        return [imbalance(list(row)) for row in self.tokens]

    def summary(self) -> dict[str, object]:
        """A few figures for /health: the table version, imbalance (max/mean) per layer and overall
        worst, the hottest expert of each layer with its share, layers in safe mode."""
        imb = self.imbalances()
        hottest = []
        for layer in range(len(self.tokens)):
            shares = self.shares(layer)
            e = max(range(len(shares)), key=shares.__getitem__) if shares else 0
            hottest.append({"layer": layer, "expert": e, "share": round(shares[e], 4) if shares else 0.0})
        return {"table_version": self.table_version, "tokens_routed": sum(map(sum, self.tokens)),
                "imbalance_max": round(max(imb, default=1.0), 3), "imbalance_by_layer": [round(x, 3) for x in imb],
                "hottest": hottest, "safe_mode_layers": list(self.safe_mode_layers),
                "table_swaps": self.num_table_swaps, "tables_rejected": self.num_tables_rejected,
                "budgeted_requests": self.num_budgeted_requests}
