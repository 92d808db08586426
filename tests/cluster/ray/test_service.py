"""The scheduler actor's plain class and the ingress's side of it, without Ray: events and their
de-duplication, rebuild after a restart, adoption of the ingress's truth, recovery plans ordered
by remaining SLO budget (from the actor and computed locally), and the recovery coordinator's
rounds."""

from __future__ import annotations

import asyncio
import time

import pytest

from actors.engine.sampling import SamplingParams
from actors.messages import GenerationRequest
from actors.messages import WorkerLoad as ActorLoad
from cluster.admission import Refusal, RefusalReason
from cluster.config import SchedulerConfig
from cluster.descriptors import RequestId, TenantId, WorkerKind, WorkerReport, WorkerName
from cluster.flights import EventKind, FlightEvent, FlightState
from cluster.journal import Phase
from cluster.placement import Placement, PlacementKind
from cluster.router.adapters import flight_state, refusal_error, request_desc, worker_load
from actors.errors import Refused
from cluster.router.choice import LeastLoaded, PlacementChoice
from cluster.router.config import RecoveryConfig
from cluster.router.flight import DECODING, PREFILLING, InFlight
from cluster.router.link import SchedulerLink
from cluster.router.rounds import RecoveryCoordinator
from cluster.service import SchedulerService
from cluster.tenants import InteractiveSlo, TenantConfig

PARAMS = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
# tenant "slow" may wait 10x longer per token than "fast"
TENANTS = (TenantConfig(TenantId("fast"), slo=InteractiveSlo(ttft_ms=5_000, tpot_ms=100)),
           TenantConfig(TenantId("slow"), slo=InteractiveSlo(ttft_ms=50_000, tpot_ms=1_000)))


def config() -> SchedulerConfig:
    return SchedulerConfig(tenants=TENANTS, default_tenant=None, heartbeat_timeout_s=60.0)


def loads(*names: str) -> list[WorkerReport]:
    return [WorkerReport(WorkerName(n), WorkerKind.PREFILL if n.startswith("p") else WorkerKind.DECODE,
                       0, 0, 1000, 1000, 16, True, time.time()) for n in names]


def request(rid: str, tenant: str = "fast", n: int = 40) -> GenerationRequest:
    return GenerationRequest(rid, list(range(4, 4 + n)), PARAMS, tenant=tenant)


def running(rid: str, tenant: str, decode: str, streamed: int, first_ago_s: float) -> InFlight:
    f = InFlight(request(rid, tenant))
    f.place(None, decode, DECODING)
    f.streamed = list(range(streamed))
    f.emitted_tokens = streamed
    f.first_token_at = time.time() - first_ago_s
    return f


def service() -> SchedulerService:
    svc = SchedulerService(config())
    svc.rebuild("ing", [], loads("p0", "p1", "d0", "d1"))
    return svc


def test_events_move_a_request_through_and_duplicates_apply_once() -> None:
    svc = service()
    req = request("a")
    placed = svc.submit(request_desc(req), req.seed)
    assert isinstance(placed, Placement) and placed.kind is PlacementKind.NEW
    rid = RequestId("a")
    t = time.time()
    batch = [FlightEvent(EventKind.STAGE, rid, t, stage="prefill_start"),
             FlightEvent(EventKind.STAGE, rid, t, stage="kv_transfer_done"),
             FlightEvent(EventKind.TOKENS, rid, t, times=(t, t, t))]
    svc.report("ing", [(1, batch)])
    svc.report("ing", [(1, batch)])  # re-sent after a timeout: skipped
    entry = svc.sched.journal.get(rid)
    assert entry is not None and entry.num_output_tokens == 3 and entry.phase is Phase.DECODING
    svc.check_integrity()
    ack = svc.report("ing", [(2, [FlightEvent(EventKind.FINISH, rid, t, num_output_tokens=3)])])
    assert (ack.applied_seq, ack.num_in_flight, ack.needs_rebuild) == (2, 0, False)
    assert svc.counters.num_duplicate_batches == 1
    assert svc.stats().num_finished == 1
    svc.check_integrity()


def test_a_fresh_incarnation_drops_events_until_rebuilt_then_adopts_in_place() -> None:
    svc = SchedulerService(config())
    f = running("r", "slow", "d1", streamed=7, first_ago_s=1.0)
    f.prefill = None
    ack = svc.report("ing", [(5, [FlightEvent(EventKind.CANCEL, RequestId("zzz"), time.time())])], loads("p0", "d0", "d1"))
    assert ack.needs_rebuild and ack.applied_seq == 5 and svc.counters.num_events == 0
    queued = InFlight(request("q", "fast"))
    queued.place("p0", "d0", PREFILLING)
    assert svc.rebuild("ing", [flight_state(f), flight_state(queued)]) == 2
    assert not svc.report("ing", []).needs_rebuild
    entry = svc.sched.journal.get(RequestId("r"))
    assert entry is not None
    assert (entry.decode_worker, entry.phase, entry.num_output_tokens) == ("d1", Phase.DECODING, 7)
    d1, d0, p0 = (svc.sched.workers.get(WorkerName(n)) for n in ("d1", "d0", "p0"))
    assert d1 is not None and d0 is not None and p0 is not None
    assert (d1.num_active, d0.num_committed, p0.num_prefill_queued) == (1, 1, 1)  # charged where they run
    assert svc.sched.tenants.get(TenantId("slow")).num_in_flight == 1  # type: ignore[union-attr]
    svc.check_integrity()
    assert svc.rebuild("ing", [flight_state(f)]) == 0  # known already: not adopted twice
    svc.check_integrity()


def test_recover_orders_by_remaining_budget_and_avoids_the_dead_worker() -> None:
    svc = service()
    # remaining budget = first token + tpot x streamed - now
    flights = [running("s-far", "slow", "d0", streamed=20, first_ago_s=2.0),   # +18 s
               running("f-late", "fast", "d0", streamed=10, first_ago_s=2.0),  # -1 s: already late
               running("f-ok", "fast", "d0", streamed=40, first_ago_s=2.0),    # +2 s
               running("other", "fast", "d1", streamed=5, first_ago_s=0.1)]    # unaffected
    for f in flights:
        svc.adopt(flight_state(f))
    out = svc.recover("ing", ["d0"], [flight_state(f) for f in flights[:3]])
    assert [o.request_id for o in out] == ["f-late", "f-ok", "s-far"]
    assert all(isinstance(o, Placement) and o.decode_worker == "d1" and o.kind is PlacementKind.RECOMPUTE
               and o.resume_from_token == n for o, n in zip(out, (10, 40, 20)))
    assert svc.sched.workers.get(WorkerName("d0")) is None
    svc.check_integrity()
    strange = running("x", "nobody", "d1", streamed=1, first_ago_s=0.1)
    (refused,) = svc.recover("ing", [], [flight_state(strange)])
    assert isinstance(refused, Refusal) and refused.reason is RefusalReason.UNKNOWN_TENANT


def test_local_recovery_plan_uses_the_same_order() -> None:
    link = SchedulerLink(actor=None, sched_cfg=config())  # type: ignore[arg-type]  (never called)
    flights = [running("s-far", "slow", "d0", 20, 2.0), running("f-late", "fast", "d0", 10, 2.0),
               running("f-ok", "fast", "d0", 40, 2.0)]
    plan = link._local_plan(flights)
    assert [f.request_id for f, _ in plan] == ["f-late", "f-ok", "s-far"]
    assert all(decided is None for _, decided in plan)  # the router's policy places each one


def test_adapters() -> None:
    load = worker_load(ActorLoad("d0", "decode", 2, 1, 3, 50, 100, 0.01, True), 5.0, 16)
    assert (load.num_running, load.num_waiting, load.num_free_blocks, load.kind) == (2, 4, 50, WorkerKind.DECODE)
    err = refusal_error(Refusal(RequestId("a"), RefusalReason.TOKEN_RATE, 2.5, "over"))
    assert isinstance(err, Refused) and (err.status, err.retry_after_s, err.reason) == (429, 2.5, "token_rate")
    f = InFlight(request("a"))
    f.place("p0", "d0", PREFILLING)
    st = flight_state(f)
    assert isinstance(st, FlightState) and st.phase is Phase.PREFILLING and st.prefill_worker == "p0"


def test_coordinator_gathers_a_round_and_issues_it_in_plan_order() -> None:
    async def main() -> tuple[list[str], list[str]]:
        flights = [running(f"r{i}", "fast", "d0", streamed=i + 1, first_ago_s=1.0) for i in range(4)]
        bystander = running("b", "fast", "d1", 3, 1.0)
        live = [*flights, bystander]

        async def plan(dead: frozenset[str], victims: list[InFlight]) -> list[tuple[InFlight, object]]:
            assert dead == {"d0"} and {v.request_id for v in victims} == {"r0", "r1", "r2", "r3"}
            ordered = sorted(victims, key=lambda v: -len(v.streamed))  # any order: the coordinator follows it
            out: list[tuple[InFlight, object]] = [(v, PlacementChoice(None, ("d1",))) for v in ordered[:-1]]
            return out + [(ordered[-1], Refused("no_healthy_worker", status=503, retry_after_s=1.0))]

        coord = RecoveryCoordinator(plan, lambda: live, RecoveryConfig(gather_s=5.0))  # type: ignore[arg-type]
        started: list[str] = []

        async def victim(f: InFlight, delay: float) -> None:
            await asyncio.sleep(delay)  # they fail at different moments
            try:
                await coord.recover(f, frozenset({"d0"}))
            except Refused:
                started.append(f"{f.request_id}:refused")
                return
            f.next_attempt()
            started.append(f.request_id)
            f.mark_issued()

        t0 = time.monotonic()
        await asyncio.gather(*(victim(f, 0.05 * i) for i, f in enumerate(reversed(flights))))
        assert time.monotonic() - t0 < 2.0  # all four came: no need to wait out gather_s
        return started, [r.request_id for r in coord.log]

    started, log = asyncio.run(main())
    assert started == ["r3", "r2", "r1", "r0:refused"]
    assert log == ["r3", "r2", "r1"]


@pytest.mark.parametrize("bad", [-1.0])
def test_recovery_config_rejects_negative_timeouts(bad: float) -> None:
    with pytest.raises(ValueError):
        RecoveryConfig(gather_s=bad)


def test_refusals_map_to_http_and_the_config_section_converts() -> None:
    from deploy.openai.errors import refusal_to_api_error
    from deploy.scheduler_config import SchedulerSection

    over = refusal_to_api_error(refusal_error(Refusal(RequestId("a"), RefusalReason.CONCURRENCY, 1.5, "3 in flight")))
    assert (over.status, over.code, over.headers, over.extra["retry_after_s"]) == (429, "concurrency",
                                                                                 {"Retry-After": "2"}, 1.5)
    for reason, status, retry in ((RefusalReason.UNKNOWN_TENANT, 403, None),
                                  (RefusalReason.REQUEST_TOO_LARGE, 413, None),
                                  (RefusalReason.NO_HEALTHY_WORKER, 503, 2.0)):
        err = refusal_to_api_error(refusal_error(Refusal(RequestId("a"), reason, retry, "why")))
        assert err.status == status and err.code == reason.value
        assert err.headers == ({} if retry is None else {"Retry-After": "2"})

    section = SchedulerSection.model_validate(
        {"tenants": {"gold": {"ttft_ms": 500, "tpot_ms": 40, "weight": 3}, "nightly": {"slo_class": "batch"}},
         "default_tenant": None})
    cfg = section.to_scheduler_config()
    by_name = {t.tenant_id: t for t in cfg.tenants}
    assert by_name[TenantId("gold")].slo == InteractiveSlo(500, 40) and by_name[TenantId("gold")].weight == 3
    assert by_name[TenantId("nightly")].slo_class.value == "batch" and cfg.default_tenant is None
    assert not cfg.placement.local_prefill  # off unless asked for (deploy/serve.yaml asks)
    assert SchedulerSection(local_prefill=True).to_scheduler_config().placement.local_prefill
    with pytest.raises(ValueError):
        SchedulerSection.model_validate({"tenants": {"gold": {"ttft": 1}}})  # misspelt field


def _event(rid: str, new: tuple[int, ...], new_text: str, text: str, all_ids: tuple[int, ...],
           finished: bool = False) -> "TokenEvent":
    from actors.engine.output import RequestOutput
    from actors.messages import TokenEvent

    out = RequestOutput(rid, new, new_text, text, all_ids, finished=finished, finish_reason="length" if finished else None)
    return TokenEvent(out, time.time(), "d")


def test_a_resume_replays_tokens_whose_text_was_held_back_and_shows_them_once() -> None:
    f = InFlight(request("a"))
    f.place(None, "d0", DECODING)
    # Token 7 completes a character with token 8: the first stream dies between them.
    assert f.on_event(_event("a", (5,), "x", "x", (5,))) is not None
    assert f.on_event(_event("a", (7,), "", "x", (5, 7))) is not None  # the client gets the id, no text yet
    assert (f.streamed, f.emitted_tokens, f.text) == ([5, 7], 1, "x")
    f.next_attempt()
    resumed = f.attempt_request()
    assert resumed.request_id == "a~r1" and resumed.output_token_ids == (5,) and resumed.seed == f.req.seed
    # The resumed engine samples 7 again (text still pending), then 8, which completes "é".
    assert f.on_event(_event("a~r1", (7,), "", "", (5, 7))) is None
    ev = f.on_event(_event("a~r1", (8,), "é", "é", (5, 7, 8), finished=True))
    assert ev is not None and ev.output.new_token_ids == (8,) and ev.output.request_id == "a"
    assert ev.output.text == "xé" and f.streamed == [5, 7, 8]

    g = InFlight(request("b"))
    g.on_event(_event("b", (5,), "", "", (5,)))
    g.next_attempt()  # nothing shown yet: the resume starts from scratch
    assert g.attempt_request().output_token_ids == () and g.attempt_request().needs_handoff
    from cluster.router.flight import ReplayMismatch

    with pytest.raises(ReplayMismatch):
        g.on_event(_event("b~r1", (6,), "y", "y", (6,)))
    assert g.emitted_tokens == 1  # the next resume trusts every streamed token


class _Down:
    """A scheduler actor handle whose every call fails the way a restarting actor's does."""

    def __getattr__(self, method: str) -> object:
        from types import SimpleNamespace

        from ray.exceptions import RayError

        async def fail(*args: object) -> None:
            raise RayError(f"{method}: the actor is restarting")

        return SimpleNamespace(remote=fail)


class _Source:
    def __init__(self, flights: list[InFlight], lds: list[ActorLoad]) -> None:
        self.flights, self.lds = flights, lds

    def in_flight(self) -> list[InFlight]:
        return self.flights

    async def loads(self) -> dict[str, ActorLoad]:
        return {w.name: w for w in self.lds}

    async def telemetry(self, cursors: object) -> dict[str, object]:
        return {}


def test_without_the_actor_requests_are_placed_locally_and_adopted_later() -> None:
    from cluster.router.link_config import LinkConfig

    lds = [ActorLoad("p0", "prefill", 0, 0, 0, 100, 100, 0.0, True), ActorLoad("d0", "decode", 0, 0, 0, 100, 100, 0.0, True)]

    async def main() -> tuple[PlacementChoice, SchedulerLink, InFlight]:
        link = SchedulerLink(_Down(), LinkConfig(ready_timeout_s=0.5, report_interval_s=0.05),  # type: ignore[arg-type]
                                  config())
        flight = InFlight(request("a"))
        link.attach(_Source([flight], lds))
        t0 = time.monotonic()
        decided = await link.admit(flight.req)
        assert time.monotonic() - t0 < 2.0  # bounded: the data path never waits on a dead actor
        assert decided is None  # the router's policy places it
        choice = LeastLoaded().place(flight.req, lds[:1], lds[1:])
        flight.place(choice.prefill, choice.decodes[0], PREFILLING)
        link.on_placed(flight)
        link.close()
        return choice, link, flight

    choice, link, flight = asyncio.run(main())
    assert choice == PlacementChoice("p0", ("d0",)) and link.fallback_rank(flight.req) == 0  # interactive
    assert link.stats.num_fallback == 1 and not link.available
    # The truth is queued for the actor (an ADOPT), kept until an ack, superseded by a rebuild.
    events = [e for _, batch in link._pending for e in batch] + link._events.take()
    adopt = [e for e in events if e.kind is EventKind.ADOPT]
    assert adopt and adopt[-1].state is not None and adopt[-1].state.prefill_worker == "p0"


class _Answers:
    """A scheduler actor handle that answers `submit` with `placement` and acknowledges reports."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement

    def __getattr__(self, method: str) -> object:
        from types import SimpleNamespace

        from cluster.flights import ReportAck

        async def call(*args: object) -> object:
            if method == "submit":
                return self.placement
            assert method == "report", method
            return ReportAck("test", False, 0, 0)

        return SimpleNamespace(remote=call)


def test_a_prefill_placed_on_its_decode_worker_runs_there_whole() -> None:
    from cluster.router.link_config import LinkConfig
    from cluster.ordering import PriorityKey

    lds = [ActorLoad(n, "prefill" if n[0] == "p" else "decode", 0, 0, 0, 100, 100, 0.0, True) for n in ("p0", "d0", "d1")]
    placed = Placement(RequestId("a"), WorkerName("d1"), WorkerName("d1"), PriorityKey(0, 0.0, 0),
                       local_chunk_tokens=48)
    assert placed.local

    async def main() -> PlacementChoice:
        link = SchedulerLink(_Answers(placed), LinkConfig(), config())  # type: ignore[arg-type]
        link.attach(_Source([], lds))
        try:
            decided = await link.admit(request("a"))
        finally:
            link.close()
        assert decided == placed
        return LeastLoaded().place(request("a"), lds[:1], lds[1:], decided=decided)

    # ... in chunks of the scheduler's size (the router hands it to the engine as max_chunk_tokens).
    assert asyncio.run(main()) == PlacementChoice(None, ("d1", "d0"), local_chunk_tokens=48, priority=(0, 0.0))
