"""`RoutingController`: evens out expert load by publishing per-expert routing bias tables.

Mental model: the controller is the source of truth of each MoE model's routing table. Workers
`sync` with it: they hand in their cumulative expert loads (`ExpertLoadReport`) and, now and then,
a logit sample of router logits, and take back the published table, which they swap in between
two steps; so every worker of a model applies the same version. `tick(model)` is one control
decision, in the spirit of auxiliary-loss-free balancing: from the loads routed since the last
decision (summed over workers), each expert over the mean load has its bias lowered by `step_size`
times its relative excess (experts under the mean are left alone: moving tokens between cold experts
costs quality and lowers no peak; bench/moe.py measured fewer changed tokens at the same imbalance
than with the two-sided rule). The candidate is tried on the logit sample
(trial.py) against the current table (agreement, mixture divergence) and against no bias at all
(the quality budget); a candidate that fails is halved and tried again, and refused after
`max_tries`. The next tick checks the published table on live load: imbalance worse than before
it by `rollback_margin` rolls it back (a newer version carrying the previous biases). Every
decision is logged and kept (`decisions`) with the live imbalance before it and the one predicted
after it on the logit sample; every published table's live imbalance before and after it is logged
and kept too (`outcomes`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from actors.engine.moe.budget import ExpertBudgets
from actors.engine.moe.routing import imbalance
from actors.engine.moe.routing_table import MAX_ABS_BIAS, RoutingTable, RoutingUpdate, TableRejected, validate
from actors.engine.moe.trial import Trial, check_candidate
from actors.engine.moe.telemetry import ExpertLoadReport

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ControllerConfig:
    step_size: float = 0.5  # bias change (logit units) for an expert 100% over or under the mean
    max_abs_bias: float = 4.0  # never more than the workers accept (routing_table.MAX_ABS_BIAS)
    min_tokens: int = 512  # routed tokens (per layer, all workers) a decision needs
    min_agreement: float = 0.9  # sampled rows keeping their experts, candidate vs current
    max_divergence: float = 0.1  # mean mixture total variation, candidate vs current
    min_base_agreement: float = 0.6  # candidate vs no bias: the quality budget of all updates together
    target_imbalance: float = 1.05  # below this (max/mean, worst layer) nothing changes
    rollback_margin: float = 1.1  # live imbalance this much worse after a publish rolls it back
    max_tries: int = 4  # halvings of the step before a candidate is refused
    max_decisions_kept: int = 256

    def __post_init__(self) -> None:
        assert 0 < self.max_abs_bias <= MAX_ABS_BIAS and self.step_size > 0 and self.max_tries >= 1


@dataclass(frozen=True)
class Decision:
    model: str
    action: str  # published | refused | rolled_back | set_by_admin | balanced | budgets_set
    version: int  # the table in force after the decision
    imbalance_before: float  # live, worst layer, since the previous decision
    imbalance_predicted: float  # on the logit sample under the table in force after it
    check: Trial | None
    reason: str = ""
    at_s: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, object]:
        out = {k: v for k, v in vars(self).items() if k != "check"}
        if self.check is not None:
            out["check"] = vars(self.check)
        return out


@dataclass
class ModelRouting:
    """The controller's state of one model."""

    num_layers: int
    num_experts: int
    top_k: int
    table: RoutingTable
    previous: list[RoutingTable] = field(default_factory=list)  # for rollback, newest last
    totals: dict[str, torch.Tensor] = field(default_factory=dict)  # worker -> cumulative counts at window start
    last_counts: dict[str, torch.Tensor] = field(default_factory=dict)  # worker -> counts at its last report
    window: dict[str, torch.Tensor] = field(default_factory=dict)  # worker -> counts since then [L, E]
    applied: dict[str, int] = field(default_factory=dict)  # worker -> table version it routes with
    sample: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # worker -> per-layer logit rows
    reports: dict[str, ExpertLoadReport] = field(default_factory=dict)  # worker -> its latest report
    watching: Decision | None = None  # the last publish, until live load confirms it
    budgets: ExpertBudgets = field(default_factory=ExpertBudgets)  # request-level expert budgets, by tenant


class RoutingController:
    def __init__(self, cfg: ControllerConfig | None = None) -> None:
        self.cfg = cfg or ControllerConfig()
        self.models: dict[str, ModelRouting] = {}
        self.decisions: dict[str, deque[Decision]] = {}
        # model -> (version, live imbalance before it, live imbalance after it) of published tables
        self.outcomes: dict[str, deque[tuple[int, float, float]]] = {}

    # ------------------------------------------------------------------------------- workers
    def sync(self, model: str, worker: str, report: ExpertLoadReport, top_k: int,
             sample: Sequence[torch.Tensor] | None = None, active: RoutingTable | None = None) -> RoutingUpdate:
        """A worker's loads (and logit sample) in, the published table and the expert budgets out.
        `active`: the worker's table when it is newer than what this controller last answered (a
        restarted controller adopts it, so versions keep growing and the workers keep taking them)."""
        m = self._model(model, report, top_k)
        if active is not None and active.version > m.table.version:
            validate(active, m.num_layers, m.num_experts, m.table.version, MAX_ABS_BIAS)
            logger.warning("routing %s: adopting v%d from %s (newer than this controller's v%d)", model,
                           active.version, worker, m.table.version)
            m.table = active
        m.reports[worker] = report
        counts = torch.tensor(report.tokens, dtype=torch.int64)
        prev, m.last_counts[worker] = m.last_counts.get(worker), counts
        if prev is not None and bool((counts < prev).any()):  # the worker restarted
            m.totals[worker] = counts
        elif m.applied.get(worker) != report.table_version:
            # It took this table right after its previous report: what it routed since ran under it.
            m.totals[worker] = prev if prev is not None else counts
        elif worker not in m.totals:  # a window the controller restarted (a decision)
            m.totals[worker] = counts
        m.window[worker] = counts - m.totals[worker]
        m.applied[worker] = report.table_version
        if sample is not None:
            m.sample[worker] = [s.float() for s in sample]
        return RoutingUpdate(m.table, m.budgets)

    def _model(self, model: str, report: ExpertLoadReport, top_k: int) -> ModelRouting:
        m = self.models.get(model)
        if m is None:
            layers, experts = len(report.tokens), len(report.tokens[0])
            m = self.models[model] = ModelRouting(layers, experts, top_k, RoutingTable.zeros(layers, experts))
            self.decisions[model] = deque(maxlen=self.cfg.max_decisions_kept)
            self.outcomes[model] = deque(maxlen=self.cfg.max_decisions_kept)
        return m

    # ------------------------------------------------------------------------------- control
    def live_loads(self, model: str) -> torch.Tensor:
        """[L, E] tokens routed under the published table since the window began, all workers."""
        m = self.models[model]
        current = [w for name, w in m.window.items() if m.applied.get(name) == m.table.version]
        return torch.stack(current).sum(0) if current else torch.zeros(m.num_layers, m.num_experts, dtype=torch.int64)

    def tick(self, model: str) -> Decision | None:
        """One control decision for `model`; None when its window has too few tokens yet."""
        m = self.models.get(model)
        if m is None:
            return None
        loads = self.live_loads(model).double()
        if float(loads.sum(1).min()) < self.cfg.min_tokens * m.top_k:
            return None
        before = max(imbalance(row) for row in loads)
        watched, m.watching = m.watching, None
        if watched is not None:  # the published table's outcome, on live traffic
            self.outcomes[model].append((watched.version, watched.imbalance_before, round(before, 4)))
            logger.info("routing %s: v%d live imbalance %.3f before it, %.3f after (%.3f predicted)", model,
                        watched.version, watched.imbalance_before, before, watched.imbalance_predicted)
        if watched is not None and m.previous and before > watched.imbalance_before * self.cfg.rollback_margin:
            return self._rollback(m, model, before, f"live imbalance {before:.2f} > {watched.imbalance_before:.2f} "
                                                    f"before v{watched.version}")
        if before <= self.cfg.target_imbalance:
            return self._decide(model, "balanced", m.table.version, before, before, None)
        sample = self._sample(m)
        current = m.table.tensor()
        mean = loads.mean(1, keepdim=True)
        error = ((mean - loads) / mean.clamp(min=1)).clamp(-1, 0).float()  # < 0: over the mean
        step, check, reason = self.cfg.step_size, None, ""
        for _ in range(self.cfg.max_tries):
            candidate = (current + step * error).clamp(-self.cfg.max_abs_bias, self.cfg.max_abs_bias)
            candidate -= candidate.mean(1, keepdim=True)  # only differences choose experts
            check = check_candidate(sample, current, candidate, m.top_k)
            reason = self._fails(check, check_candidate(sample, torch.zeros_like(current), candidate, m.top_k))
            if not reason:
                table = RoutingTable.of(m.table.version + 1, candidate)
                self._publish(m, table, self.cfg.max_abs_bias)
                decision = self._decide(model, "published", table.version, before, check.imbalance_candidate, check)
                m.watching = decision
                return decision
            step /= 2
        m.totals.clear()  # a fresh window: the next decision sees the traffic from here on
        return self._decide(model, "refused", m.table.version, before, before, check, reason)

    def _fails(self, vs_current: Trial, vs_base: Trial) -> str:
        c = self.cfg
        if vs_current.num_rows == 0:
            return "no logit sample"
        if vs_current.agreement < c.min_agreement:
            return f"agreement {vs_current.agreement:.3f} < {c.min_agreement}"
        if vs_current.divergence > c.max_divergence:
            return f"divergence {vs_current.divergence:.3f} > {c.max_divergence}"
        if vs_base.agreement < c.min_base_agreement:
            return f"agreement with no bias {vs_base.agreement:.3f} < {c.min_base_agreement} (quality budget)"
        if vs_current.imbalance_candidate >= vs_current.imbalance_current:
            return f"no predicted gain ({vs_current.imbalance_candidate:.2f} >= {vs_current.imbalance_current:.2f})"
        return ""

    def _sample(self, m: ModelRouting) -> list[torch.Tensor]:
        per_layer = zip(*m.sample.values()) if m.sample else [[] for _ in range(m.num_layers)]
        return [torch.cat(list(rows)) if rows else torch.zeros(0, m.num_experts) for rows in per_layer]

    def _publish(self, m: ModelRouting, table: RoutingTable, max_abs_bias: float) -> None:
        validate(table, m.num_layers, m.num_experts, m.table.version, max_abs_bias)
        m.previous.append(m.table)
        del m.previous[:-16]
        m.table = table
        m.totals.clear()  # loads from here on are the new table's

    def _rollback(self, m: ModelRouting, model: str, before: float, reason: str) -> Decision:
        back = m.previous.pop()
        table = RoutingTable(m.table.version + 1, back.bias)
        m.table = table
        m.totals.clear()
        return self._decide(model, "rolled_back", table.version, before, before, None, reason)

    def rollback(self, model: str, reason: str = "operator") -> Decision:
        m = self.models[model]
        if not m.previous:
            raise TableRejected("no_history", f"{model}: no earlier table to roll back to")
        return self._rollback(m, model, max(imbalance(r) for r in self.live_loads(model).double()), reason)

    def set_table(self, model: str, bias: Sequence[Sequence[float]], version: int | None = None) -> RoutingTable:
        """An operator's table (the admin endpoint): validated as workers would, published as the next
        version unless `version` names a newer one. Raises `TableRejected`; KeyError for a model no
        worker has reported yet."""
        m = self.models[model]
        table = RoutingTable.of(m.table.version + 1 if version is None else version, [list(r) for r in bias])
        self._publish(m, table, MAX_ABS_BIAS)
        m.watching = None
        self._decide(model, "set_by_admin", table.version, 0.0, 0.0, None)
        return table

    def set_budgets(self, model: str, budgets: ExpertBudgets) -> None:
        """The tenants' expert budgets of `model` (budget.py), handed to every worker on its next sync.
        A budget is clamped to [top_k, num_experts] by the workers; KeyError for an unknown model."""
        m = self.models[model]
        m.budgets = budgets
        self._decide(model, "budgets_set", m.table.version, 0.0, 0.0, None, str(budgets.to_json()))

    def _decide(self, model: str, action: str, version: int, before: float, predicted: float,
                check: Trial | None, reason: str = "") -> Decision:
        d = Decision(model, action, version, round(before, 4), round(predicted, 4), check, reason)
        self.decisions[model].append(d)
        level = logging.INFO if action in ("published", "balanced", "set_by_admin", "budgets_set") else logging.WARNING
        logger.log(level, "routing %s: %s v%d, imbalance %.3f -> %.3f predicted%s", model, action, version,
                   before, predicted, f" ({reason})" if reason else "")
        return d

    def state(self, model: str) -> dict[str, object]:
        """What the admin endpoint shows: the published table, each worker's applied version, recent decisions."""
        m = self.models[model]
        return {"model": model, "table": m.table.to_json(), "budgets": m.budgets.to_json(), "workers": dict(m.applied),
                "num_layers": m.num_layers, "num_experts": m.num_experts,
                "consistent": all(v == m.table.version for v in m.applied.values()),
                "decisions": [d.to_json() for d in list(self.decisions[model])[-16:]],
                "outcomes": [{"version": v, "imbalance_before": b, "imbalance_after": a}
                             for v, b, a in list(self.outcomes[model])[-16:]]}
