"""Speculation on the router's side: the TPOT target from the scheduler's placement, and the draft-token totals of a stream that resumed elsewhere."""

from __future__ import annotations

import pytest

from actors.engine.output import RequestOutput
from actors.engine.sampling import SamplingParams
from actors.messages import GenerationRequest, TokenEvent, WorkerLoad
from cluster.descriptors import RequestId, WorkerName
from cluster.ordering import PriorityKey
from cluster.placement import Placement
from cluster.router.choice import LeastLoaded, PlacementChoice
from cluster.router.flight import InFlight

PARAMS = SamplingParams(max_tokens=8, temperature=0)


def req(tenant: str = "default", speculation: bool = True) -> GenerationRequest:
    return GenerationRequest("r", (5, 6, 7), PARAMS, tenant=tenant, speculation=speculation)


def test_the_placements_tpot_target_reaches_the_attempts_request() -> None:
    decided = Placement(RequestId("r"), WorkerName("p0"), WorkerName("d1"), PriorityKey(0, 2.5, 0), tpot_s=0.05)
    loads = [WorkerLoad(n, "prefill" if n.startswith("p") else "decode", 0, 0, 0, 10, 10, 0.0, True)
             for n in ("p0", "d0", "d1")]
    choice = LeastLoaded().place(req(), loads[:1], loads[1:], decided=decided)
    assert choice.tpot_s == 0.05 and choice.priority == (0, 2.5)
    attempt = choice.apply(req())
    assert (attempt.tpot_target_s, attempt.priority_rank) == (0.05, 0)
    assert attempt.engine_options().tpot_target_s == 0.05
    batch = PlacementChoice("p0", ("d1",), priority=(1, 9.0)).apply(req())
    assert (batch.tpot_target_s, batch.priority_rank) == (None, 1)  # batch work: no TPOT target
    local = LeastLoaded().place(req(), loads[:1], loads[1:])  # placed without the scheduler
    plain = req()
    assert local.tpot_s is None and local.apply(plain) is plain


def out(tokens: tuple[int, ...], new: tuple[int, ...], drafts: int, accepted: int,
        finished: bool = False) -> RequestOutput:
    text = "".join(f"<{t}>" for t in new)
    return RequestOutput("r", new, text, text, tokens, finished=finished, num_draft_tokens=drafts,
                         num_accepted_tokens=accepted)


def test_a_resumed_stream_counts_the_drafts_of_every_attempt() -> None:
    flight = InFlight(req())
    first = [out((1,), (1,), 0, 0), out((1, 2, 3), (2, 3), 3, 2), out((1, 2, 3, 4), (4,), 6, 3)]
    assert [flight.on_event(TokenEvent(o, 0.0, "d0")).output.num_draft_tokens for o in first] == [0, 3, 6]
    flight.next_attempt()  # d0 died: the resume runs on d1, whose engine counts from 0
    seen = flight.on_event(TokenEvent(out((5,), (5,), 2, 1), 0.0, "d1"))
    assert seen is not None
    assert (seen.output.num_draft_tokens, seen.output.num_accepted_tokens) == (8, 4)
    last = flight.on_event(TokenEvent(out((5, 6), (6,), 4, 3, finished=True), 0.0, "d1"))
    assert last is not None and (last.output.num_draft_tokens, last.output.num_accepted_tokens) == (10, 6)
    assert flight.streamed == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("tpot_s", [0.0, -1.0])
def test_a_tpot_target_must_be_positive(tpot_s: float) -> None:
    with pytest.raises(ValueError, match="tpot_target_s"):
        GenerationRequest("r", (1, 2), PARAMS, tpot_target_s=tpot_s)
