"""`MoEControl`: one model's routing state, loads, logit sample and budgets, and the engine hook.

Mental model: `install_moe_control(engine)` (a no-op for dense models) binds a `MoEControl` to every
`SparseMoE` layer of the engine's model and adds one of the engine's `step_hooks`: after the
scheduler has chosen a step and before its forward runs (both the plain `Engine.step` and
`AsyncEngine`'s loop prepare every step on the engine thread), `begin_step` fixes the routing table
the step uses (a table applied at any moment takes effect at the next step, never inside one) and
lays out the step's rows per request for the expert budgets, in the runner's own row layout
(`model_runner.attention_layout`). Each layer then asks `route` for its experts: bias of the step's
table (none in safe mode), budget mask, counters, sample.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from actors.engine.model_runner import attention_layout
from actors.engine.moe.budget import BudgetTracker, ExpertBudgets, Segment
from actors.engine.moe.layer import SparseMoE
from actors.engine.moe.routing import route
from actors.engine.moe.routing_table import RoutingState, RoutingTable
from actors.engine.moe.telemetry import ExpertLoadReport, LoadCounters, LogitSample

logger = logging.getLogger(__name__)

RETAIN_EVERY_STEPS = 64  # how often budgets of finished requests are dropped


class MoEControl:
    def __init__(self, model: nn.Module, budgets: ExpertBudgets | None = None, sample_capacity: int = 512) -> None:
        layers = moe_layers(model)
        assert layers, "a model without MoE layers"
        num_experts, top_k = layers[0].num_experts, layers[0].top_k
        num_layers = len(layers)
        self.top_k = top_k
        self.device = next(model.parameters()).device
        self.state = RoutingState(num_layers, num_experts)
        self.loads = LoadCounters(num_layers, num_experts)
        self.sample = LogitSample(num_layers, num_experts, sample_capacity)
        self.budget = BudgetTracker(num_layers, num_experts, top_k, budgets)
        self._num_steps = 0
        self._step_rows = -1  # rows of the step's forward; another count is a drafting pass (speculation)
        for i, layer in enumerate(layers):
            layer.layer_index = i
            layer.routing = self

    # ------------------------------------------------------------------------------- per step
    def begin_step(self, requests: Sequence[Any] = (), chunks: Sequence[Any] = (),
                   live: Callable[[], set[str]] | None = None) -> None:
        """Before a forward: fixes its table and lays out its budgeted rows. `requests[i]` (with
        `request_id`, `tenant`, `prompt_token_ids`) computes `chunks[i]` (`token_ids`, `start_pos`);
        `live()`: the ids of the requests still in the engine, asked every `RETAIN_EVERY_STEPS` steps."""
        self.state.begin_step(self.device)
        self.budget.plan(_segments(requests, chunks), self.device)
        self._step_rows = sum(len(c.token_ids) for c in chunks) if chunks else -1
        self._num_steps += 1
        if live is not None and self._num_steps % RETAIN_EVERY_STEPS == 0:
            self.budget.retain(live())

    def route(self, layer: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [T, E] float32 -> (weights [T, k], experts [T, k]), and records them."""
        bias = self.state.bias_for(layer)
        if bias is not None and not bool(torch.isfinite(logits + bias).all()) and bool(torch.isfinite(logits).all()):
            self.state.enter_safe_mode(layer, "non-finite biased router scores")
            bias = None
        if logits.shape[0] != self._step_rows and self._step_rows >= 0:
            # an early-exit draft pass between the step's layout and its forward: the step's table
            # routes it, but no budget rows apply and it is not traffic to count
            return route(logits, self.top_k, bias, None)
        if self.budget.wants_probs:  # before `allowed`: a resume's recomputed tokens choose from it
            self.budget.observe(layer, torch.softmax(logits, dim=-1))
        top_w, top_e = route(logits, self.top_k, bias, self.budget.allowed(layer, logits.shape[0]))
        self.loads.add(layer, top_e)
        self.sample.add(layer, logits)
        return top_w, top_e

    # --------------------------------------------------------------------------------- tables
    def apply_table(self, table: RoutingTable) -> RoutingTable:
        """Validates and swaps in `table` (from the next step on); raises `TableRejected`."""
        old = self.state.apply(table)
        logger.info("routing table v%d swapped in (was v%d)", table.version, old.version)
        return old

    def report(self) -> ExpertLoadReport:
        s = self.state
        return ExpertLoadReport(table_version=s.active.version, tokens=tuple(map(tuple, self.loads.read())),
                                safe_mode_layers=tuple(sorted(s.safe_mode)), num_table_swaps=s.num_swaps,
                                num_tables_rejected=s.num_rejected, num_budgeted_requests=self.budget.num_budgeted)


def _segments(requests: Sequence[Any], chunks: Sequence[Any]) -> list[Segment]:
    # Rows in the runner's layout (`attention_layout`): a chunk's tokens are adjacent rows, a verify
    # chunk's included (its tokens are decode rows of their own, side by side).
    first: dict[int, int] = {}
    row = 0
    for i, _, m in attention_layout(list(chunks)):
        first.setdefault(i, row)
        row += m
    out = []
    for i in sorted(first, key=first.__getitem__):
        req, chunk = requests[i], chunks[i]
        n, start = len(chunk.token_ids), chunk.start_pos
        num_prompt = max(0, min(start + n, len(req.prompt_token_ids)) - start)
        out.append(Segment(req.request_id, getattr(req, "tenant", ""), first[i], n, num_prompt))
    return out


def moe_layers(model: nn.Module) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def moe_control_of(model: nn.Module) -> MoEControl | None:
    layers = moe_layers(model)
    routing = layers[0].routing if layers else None
    return routing if isinstance(routing, MoEControl) else None


def install_moe_control(engine: Any, budgets: ExpertBudgets | None = None) -> MoEControl | None:
    """Binds a `MoEControl` to `engine`'s model and adds its step hook; None for a dense
    model. Installing twice returns the first control."""
    model = engine.runner.model
    if not model.cfg.is_moe:
        return None
    existing = moe_control_of(model)
    if existing is not None:
        return existing
    control = MoEControl(model, budgets)
    engine.step_hooks.append(
        lambda prepared: control.begin_step(prepared.batch.requests, prepared.chunks, lambda: _live(engine)))
    return control


def _live(engine: Any) -> set[str]:
    # Running and waiting requests, and prefilled ones whose KV is still held: a prefill worker
    # takes a held request's expert choice (`BudgetTracker.take_choice`) when it ships the KV.
    return set(engine.requests) | set(getattr(engine, "_held", ()))
