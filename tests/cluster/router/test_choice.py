"""The router's one local policy: least active first, ties spread round-robin, unhealthy workers
skipped; no prefill workers at all (colocated) means no handoff; a control-plane decision goes first
and the policy orders the rest."""

from __future__ import annotations

import pytest

from actors.engine.sampling import SamplingParams
from actors.messages import GenerationRequest, WorkerLoad
from cluster.descriptors import RequestId, WorkerName
from cluster.ordering import PriorityKey
from cluster.placement import Placement
from actors.errors import NoWorkers
from cluster.router.choice import LeastLoaded, PlacementChoice

REQ = GenerationRequest("r", [5, 6, 7], SamplingParams(max_tokens=2))
ONE_TOKEN = GenerationRequest("o", [5], SamplingParams(max_tokens=2))


def load(name: str, running: int = 0, reserved: int = 0, healthy: bool = True) -> WorkerLoad:
    kind = "prefill" if name.startswith("p") else "decode"
    return WorkerLoad(name, kind, running, 0, reserved, 10, 10, 0.0, healthy)


def test_least_active_first_then_round_robin() -> None:
    policy = LeastLoaded()
    prefills = [load("p0"), load("p1")]
    busy = [load("d0", running=2), load("d1", reserved=1), load("d2", running=1, reserved=1)]
    assert policy.place(REQ, prefills, busy).decodes == ("d1", "d0", "d2")
    idle = [load("d0"), load("d1"), load("d2")]
    firsts = [policy.place(REQ, prefills, idle).decodes[0] for _ in range(6)]
    assert firsts == ["d1", "d2", "d0", "d1", "d2", "d0"]  # call k starts at worker k % 3
    assert [policy.place(REQ, prefills, idle).prefill for _ in range(2)] == ["p1", "p0"]  # calls 7, 8


def test_unhealthy_workers_are_skipped() -> None:
    policy = LeastLoaded()
    choice = policy.place(REQ, [load("p0", healthy=False), load("p1", running=5)],
                          [load("d0", healthy=False), load("d1", running=3)])
    assert (choice.prefill, choice.decodes) == ("p1", ("d1",))
    with pytest.raises(NoWorkers, match="decode"):
        policy.place(REQ, [load("p0")], [load("d0", healthy=False)])
    with pytest.raises(NoWorkers, match="prefill"):
        policy.place(REQ, [load("p0", healthy=False)], [load("d0")])


def test_requests_without_handoff_need_no_prefill_worker() -> None:
    choice = LeastLoaded().place(ONE_TOKEN, [], [load("d0")])
    assert (choice.prefill, choice.decodes) == (None, ("d0",))


def test_without_prefill_workers_nothing_is_handed_off() -> None:
    choice = LeastLoaded().place(REQ, [], [load("d0", running=1), load("d1")])
    assert choice == PlacementChoice(None, ("d1", "d0"))


def decided(prefill: str, decode: str, chunk: int | None = None) -> Placement:
    return Placement(RequestId("r"), WorkerName(prefill), WorkerName(decode), PriorityKey(1, 2.5, 0),
                     local_chunk_tokens=chunk)


def test_a_control_plane_decision_goes_first_and_the_policy_orders_the_rest() -> None:
    prefills, decodes = [load("p0"), load("p1", running=3)], [load("d0"), load("d1", running=1), load("d2")]
    choice = LeastLoaded().place(REQ, prefills, decodes, decided=decided("p1", "d1"))
    assert choice.prefill == "p1" and choice.decodes[0] == "d1" and set(choice.decodes) == {"d0", "d1", "d2"}
    assert choice.priority == (1, 2.5) and choice.local_chunk_tokens is None
    # A prefill placed on the decode worker itself: no handoff, in the decision's chunks.
    local = LeastLoaded().place(REQ, prefills, decodes, decided=decided("d2", "d2", chunk=48))
    assert (local.prefill, local.decodes[0], local.local_chunk_tokens) == (None, "d2", 48)
    # Workers seen dead here are skipped even if the control plane chose them.
    sick = [load("p0"), load("p1", healthy=False)], [load("d0"), load("d1", healthy=False)]
    fallback = LeastLoaded().place(REQ, *sick, decided=decided("p1", "d1"))
    assert (fallback.prefill, fallback.decodes) == ("p0", ("d0",))
