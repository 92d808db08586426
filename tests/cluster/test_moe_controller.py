"""The routing controller on synthetic loads and logit samples: it publishes tables that lower the
peak expert load, refuses candidates its checks reject, rolls back a table that made live load worse,
validates an operator's table, and keeps every worker on the published version."""

from __future__ import annotations

import pytest
import torch

from actors.engine.moe.routing import expert_counts, imbalance, route
from actors.engine.moe.routing_table import RoutingTable, TableRejected
from actors.engine.moe.telemetry import ExpertLoadReport
from cluster.moe.controller import ControllerConfig, RoutingController

HOT = torch.tensor([1.5, 0.5, 0.0, 0.0, 0.0, 0.0, -0.5, -1.0])  # a router offset: expert 0 popular


class FakeWorker:
    """Routes synthetic skewed logits with the table it last took, counting loads like a worker."""

    def __init__(self, name: str, seed: int, layers: int = 2) -> None:
        self.name, self.layers = name, layers
        self.gen = torch.Generator().manual_seed(seed)
        self.counts = torch.zeros(layers, 8, dtype=torch.int64)
        self.table = RoutingTable.zeros(layers, 8)
        self.last: list[torch.Tensor] = []

    def serve(self, tokens: int = 600) -> None:
        bias = self.table.tensor()
        self.last = []
        for layer in range(self.layers):
            logits = torch.randn(tokens, 8, generator=self.gen) + HOT
            self.last.append(logits[:200])
            b = bias[layer]
            self.counts[layer] += expert_counts(route(logits, 2, b if b.any() else None)[1], 8)

    def sync(self, ctl: RoutingController) -> None:
        report = ExpertLoadReport(self.table.version, tuple(map(tuple, self.counts.tolist())))
        self.table = ctl.sync("m", self.name, report, 2, self.last).table

    def window_imbalance(self, ctl: RoutingController) -> float:
        return max(imbalance(r) for r in ctl.live_loads("m").double())


def rounds(ctl: RoutingController, workers: list[FakeWorker], n: int) -> list:  # type: ignore[type-arg]
    decisions = []
    for _ in range(n):
        for w in workers:
            w.sync(ctl)  # takes the published table
            w.serve()
            w.sync(ctl)  # reports what it routed under it
        decisions.append(ctl.tick("m"))
    return decisions


def test_controller_lowers_the_peak_and_every_worker_takes_the_same_version() -> None:
    ctl = RoutingController(ControllerConfig(step_size=0.5, min_tokens=300, min_base_agreement=0.5))
    workers = [FakeWorker("a", 1), FakeWorker("b", 2)]
    first = rounds(ctl, workers, 1)[0]
    assert first is not None and first.action == "published" and first.version == 1
    decisions = [d for d in rounds(ctl, workers, 8) if d is not None]
    published = [d for d in decisions if d.action == "published"]
    assert published and [d.version for d in published] == sorted({d.version for d in published})
    for w in workers:
        w.sync(ctl)
        w.serve()
        w.sync(ctl)
    after = workers[0].window_imbalance(ctl)
    assert after < first.imbalance_before * 0.8
    state = ctl.state("m")
    assert state["consistent"] and set(state["workers"].values()) == {ctl.models["m"].table.version}
    outcomes = state["outcomes"]
    assert outcomes and outcomes[0]["version"] == 1 and outcomes[0]["imbalance_before"] == first.imbalance_before
    assert outcomes[0]["imbalance_after"] < outcomes[0]["imbalance_before"]
    assert ctl.models["m"].table.tensor()[:, 0].max() < 0  # the hot expert pushed down


def test_a_candidate_over_the_quality_budget_is_refused_and_nothing_changes() -> None:
    ctl = RoutingController(ControllerConfig(min_tokens=300, min_base_agreement=0.999, max_tries=2))
    decision = rounds(ctl, [FakeWorker("a", 1)], 1)[0]
    assert decision.action == "refused" and "quality budget" in decision.reason
    assert ctl.models["m"].table.version == 0


def test_too_few_tokens_decide_nothing() -> None:
    ctl = RoutingController(ControllerConfig(min_tokens=10_000))
    assert rounds(ctl, [FakeWorker("a", 1)], 1) == [None]
    assert ctl.tick("unknown") is None


def test_a_table_that_made_live_load_worse_is_rolled_back() -> None:
    ctl = RoutingController(ControllerConfig(min_tokens=300, min_base_agreement=0.5, rollback_margin=1.05))
    w = FakeWorker("a", 1)
    published = rounds(ctl, [w], 1)[0]
    assert published.action == "published"
    # Traffic shifts under the new table: the expert it favoured gets far hotter than before.
    w.sync(ctl)  # takes v1
    w.sync(ctl)  # routes with it: its window starts
    w.counts[:, 1] += 10 * int(w.counts.sum() // 8)
    w.sync(ctl)
    decision = ctl.tick("m")
    assert decision.action == "rolled_back" and decision.version == 2
    assert ctl.models["m"].table.bias == RoutingTable.zeros(2, 8).bias


def test_operator_tables_are_validated_and_published_as_the_next_version() -> None:
    ctl = RoutingController()
    w = FakeWorker("a", 1)
    w.sync(ctl)
    with pytest.raises(TableRejected) as err:
        ctl.set_table("m", [[0.0] * 8])
    assert err.value.reason == "shape"
    with pytest.raises(TableRejected):
        ctl.set_table("m", [[100.0] + [0.0] * 7] * 2)
    table = ctl.set_table("m", [[-1.0] + [0.0] * 7] * 2)
    assert table.version == 1 and ctl.decisions["m"][-1].action == "set_by_admin"
    w.sync(ctl)
    assert w.table == table
    assert not ctl.state("m")["consistent"] or w.table.version == 1
    assert ctl.rollback("m").version == 2 and ctl.models["m"].table.bias == RoutingTable.zeros(2, 8).bias
    with pytest.raises(KeyError):
        ctl.set_table("other", [[0.0]])


def test_tokens_routed_after_taking_a_table_count_for_it_at_the_next_report() -> None:
    ctl = RoutingController()
    w = FakeWorker("a", 1)
    w.sync(ctl)
    ctl.set_table("m", [[-0.5] + [0.0] * 7] * 2)
    w.sync(ctl)  # reports v0, takes v1
    w.serve(tokens=600)  # all under v1
    w.sync(ctl)
    assert int(ctl.live_loads("m").sum()) == 2 * 600 * 2  # layers x tokens x top-k
    w.counts.zero_()  # a restarted worker counts from 0
    w.sync(ctl)
    assert int(ctl.live_loads("m").sum()) == 0
