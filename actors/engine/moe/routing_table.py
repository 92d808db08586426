"""The per-expert routing bias table of one model, swapped only between steps.

Mental model: a `RoutingTable` is an immutable value: a version and a bias per (layer, expert),
added to the router logits when experts are chosen (`routing.route`). `RoutingState.apply`
validates an update (shape, finite values, bounds, a version newer than the active one), refuses a
bad one with its reason (`TableRejected`) and otherwise makes it the `active` table. A step never
reads `active` directly: `begin_step` (called before each forward, see control.py) takes the active
table for the whole step, so a swap at any moment takes effect at the next step, and no step ever
mixes two tables or sees a half-written one (tables are never written in place). A layer whose biased router
scores come out non-finite at run time falls back to plain top-k (safe mode) until the next table
is applied, and says why in `status()`.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field

import torch

from actors.engine.moe.budget import ExpertBudgets

logger = logging.getLogger(__name__)

MAX_ABS_BIAS = 8.0  # logit units: beyond this a bias overrides the router instead of nudging it


class TableRejected(ValueError):
    """An update refused by validation; `reason` is a short code, the message says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # type: ignore[no-untyped-def]  # crosses Ray calls with its reason
        return (TableRejected, (self.reason, str(self)))


@dataclass(frozen=True)
class RoutingTable:
    version: int
    bias: tuple[tuple[float, ...], ...]  # [num_layers][num_experts]

    @classmethod
    def zeros(cls, num_layers: int, num_experts: int, version: int = 0) -> "RoutingTable":
        return cls(version, tuple((0.0,) * num_experts for _ in range(num_layers)))

    @classmethod
    def of(cls, version: int, bias: torch.Tensor | list[list[float]]) -> "RoutingTable":
        rows = bias.tolist() if isinstance(bias, torch.Tensor) else bias
        return cls(int(version), tuple(tuple(float(v) for v in row) for row in rows))

    def tensor(self) -> torch.Tensor:
        return torch.tensor(self.bias, dtype=torch.float32)  # [L, E]

    def to_json(self) -> dict[str, object]:
        return {"version": self.version, "bias": [list(row) for row in self.bias]}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> "RoutingTable":
        bias = data.get("bias")
        if not isinstance(bias, list) or not all(isinstance(r, list) for r in bias):
            raise TableRejected("shape", "bias must be a list of per-layer lists of floats")
        try:
            return cls.of(int(data.get("version", -1)), bias)  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:
            raise TableRejected("values", f"bias must hold numbers only: {e}") from None


def validate(table: RoutingTable, num_layers: int, num_experts: int, active_version: int,
             max_abs_bias: float = MAX_ABS_BIAS) -> None:
    """Raises `TableRejected` naming the first problem found."""
    if len(table.bias) != num_layers or any(len(row) != num_experts for row in table.bias):
        shape = (len(table.bias), sorted({len(r) for r in table.bias}))
        raise TableRejected("shape", f"expected {num_layers} layers x {num_experts} experts, got {shape}")
    if any(not math.isfinite(v) for row in table.bias for v in row):
        raise TableRejected("not_finite", "bias values must be finite")
    worst = max((abs(v) for row in table.bias for v in row), default=0.0)
    if worst > max_abs_bias:
        raise TableRejected("out_of_bounds", f"|bias| {worst:.3g} is over the bound {max_abs_bias:g}")
    if table.version <= active_version:
        raise TableRejected("stale_version", f"version {table.version} is not newer than the active {active_version}")


@dataclass(frozen=True)
class RoutingUpdate:
    """What a worker takes from the routing controller on each sync: the model's published table
    and its tenants' expert budgets (budget.py)."""

    table: RoutingTable
    budgets: ExpertBudgets = field(default_factory=ExpertBudgets)


@dataclass
class StepTable:
    """What one step routes with: the table's version and a device row per layer (None: no bias)."""

    version: int
    rows: list[torch.Tensor | None] = field(default_factory=list)


class RoutingState:
    def __init__(self, num_layers: int, num_experts: int, max_abs_bias: float = MAX_ABS_BIAS) -> None:
        self.num_layers, self.num_experts, self.max_abs_bias = num_layers, num_experts, max_abs_bias
        self.active = RoutingTable.zeros(num_layers, num_experts)
        self.num_swaps = 0
        self.num_rejected = 0
        self.safe_mode: dict[int, str] = {}  # layer -> why it routes without bias
        self._lock = threading.Lock()  # apply comes from request threads, begin_step from the engine's
        self._step = StepTable(0, [None] * num_layers)

    def apply(self, table: RoutingTable) -> RoutingTable:
        """Validates `table` and makes it active (from the next step on); returns the table it
        replaced. A refused table leaves the active one untouched."""
        with self._lock:  # one update at a time: two threads' checks and swaps must not interleave
            self._validate_locked(table)
            old, self.active = self.active, table
            self.num_swaps += 1
            return old

    def _validate_locked(self, table: RoutingTable) -> None:
        try:
            validate(table, self.num_layers, self.num_experts, self.active.version, self.max_abs_bias)
        except TableRejected as e:
            self.num_rejected += 1
            logger.warning("routing table v%d refused: %s", table.version, e)
            raise

    def begin_step(self, device: torch.device) -> StepTable:
        """The table for the next forward (call before it, with none in flight on this model)."""
        with self._lock:
            table = self.active
        if table.version != self._step.version:
            rows = table.tensor().to(device)
            self._step = StepTable(table.version, [None if not row.any() else row for row in rows])
            if self.safe_mode:
                logger.info("routing table v%d applied: layers %s leave safe mode", table.version,
                            sorted(self.safe_mode))
            self.safe_mode = {}
        return self._step

    def bias_for(self, layer: int) -> torch.Tensor | None:
        return None if layer in self.safe_mode else self._step.rows[layer]

    def enter_safe_mode(self, layer: int, reason: str) -> None:
        if layer not in self.safe_mode:
            logger.error("MoE layer %d: %s under routing table v%d; routing without bias (safe mode)",
                         layer, reason, self._step.version)
        self.safe_mode[layer] = reason

    @property
    def step_version(self) -> int:
        return self._step.version

    def status(self) -> dict[str, object]:
        return {"active_version": self.active.version, "step_version": self._step.version,
                "num_swaps": self.num_swaps, "num_rejected": self.num_rejected,
                "safe_mode": {str(k): v for k, v in sorted(self.safe_mode.items())}}
