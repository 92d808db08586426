"""The routing rule and the bias table: exact selections, refusals with reasons, swaps that take
effect at the next step only, and safe mode."""

from __future__ import annotations

import math

import pytest
import torch

from actors.engine.moe.routing import imbalance, route
from actors.engine.moe.routing_table import RoutingState, RoutingTable, TableRejected
from actors.engine.moe.trial import check_candidate


def test_route_without_bias_is_mixtral_top_k() -> None:
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    w, e = route(logits, 2)
    probs = torch.softmax(logits, -1)
    ref_w, ref_e = probs.topk(2, -1)
    assert torch.equal(e, ref_e)
    assert torch.equal(w, ref_w / ref_w.sum(-1, keepdim=True))


def test_bias_moves_selection_but_weights_stay_unbiased_probabilities() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    w, e = route(logits, 2, bias=torch.tensor([-5.0, 0.0, 0.0, 0.0]))
    assert e.tolist() == [[1, 2]]
    p = torch.softmax(logits, -1)[0]
    assert torch.allclose(w[0], torch.stack([p[1], p[2]]) / (p[1] + p[2]))
    allowed = torch.tensor([[True, False, False, True]])
    assert route(logits, 2, allowed=allowed)[1].tolist() == [[0, 3]]


def test_imbalance_is_max_over_mean() -> None:
    assert imbalance([4, 4, 4, 4]) == 1.0
    assert imbalance([8, 0, 0, 0]) == 4.0
    assert imbalance([0, 0]) == 1.0


@pytest.mark.parametrize("bias, version, reason", [
    ([[0.0, 0.0, 0.0]], 1, "shape"),
    ([[0.0] * 4, [0.0] * 3], 1, "shape"),
    ([[math.nan, 0.0, 0.0, 0.0]] * 2, 1, "not_finite"),
    ([[math.inf, 0.0, 0.0, 0.0]] * 2, 1, "not_finite"),
    ([[9.0, 0.0, 0.0, 0.0]] * 2, 1, "out_of_bounds"),
    ([[1.0, 0.0, 0.0, 0.0]] * 2, 0, "stale_version"),
])
def test_bad_tables_are_refused_with_their_reason_and_change_nothing(bias, version, reason) -> None:
    state = RoutingState(2, 4)
    with pytest.raises(TableRejected) as err:
        state.apply(RoutingTable(version, tuple(map(tuple, bias))))
    assert err.value.reason == reason
    assert state.active.version == 0 and state.num_swaps == 0 and state.num_rejected == 1


def test_an_applied_table_waits_for_the_next_step() -> None:
    state = RoutingState(2, 4)
    cpu = torch.device("cpu")
    state.begin_step(cpu)
    table = RoutingTable.of(1, [[1.0, 0.0, 0.0, 0.0], [0.0] * 4])
    assert state.apply(table).version == 0  # returns the table it replaced
    assert state.active == table and state.num_swaps == 1
    assert state.bias_for(0) is None  # the step in flight keeps its table
    state.begin_step(cpu)
    assert state.bias_for(0).tolist() == [1.0, 0.0, 0.0, 0.0] and state.bias_for(1) is None
    with pytest.raises(TableRejected):
        state.apply(RoutingTable.of(1, [[0.0] * 4] * 2))  # same version again


def test_json_round_trip_and_malformed_json() -> None:
    table = RoutingTable.of(3, [[0.5, -0.5], [0.0, 1.0]])
    assert RoutingTable.from_json(table.to_json()) == table
    with pytest.raises(TableRejected) as err:
        RoutingTable.from_json({"version": 1, "bias": [["x", 1]]})
    assert err.value.reason == "values"
    with pytest.raises(TableRejected):
        RoutingTable.from_json({"version": 1, "bias": 3})


def test_a_trial_measures_agreement_and_predicted_imbalance() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(400, 4, generator=g) + torch.tensor([2.0, 0.0, 0.0, 0.0])  # expert 0 hot
    zero = torch.zeros(1, 4)
    same = check_candidate([logits], zero, zero, 2)
    assert same.agreement == 1.0 and same.divergence == 0.0 and same.num_rows == 400
    cand = torch.tensor([[-2.0, 0.0, 0.0, 0.0]])
    moved = check_candidate([logits], zero, cand, 2)
    assert moved.agreement < 1.0 and moved.divergence > 0.0
    assert moved.imbalance_candidate < moved.imbalance_current
