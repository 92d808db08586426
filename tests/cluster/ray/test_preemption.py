"""Live preemption: the scheduler's orders reach the ingress that streams the victims, and are
carried out there.

Without Ray: the service routes a victim to the ingress streaming it (not the one whose request
took the row), re-sends each notice until that ingress reports having seen it, resumes the victim
on the ingress once a row is free, and queues a preempted request adopted from a rebuild. The
link stops the victims it streams, re-adopts the ones that cannot stop, passes back what it has
seen, and hands resumptions to its caller.

With Ray (marked): one prefill and one decode actor, the scheduler actor limited to two decode
rows, two batch streams filling them; an interactive request arrives and takes a row. The batch
stream chosen as victim pauses (its row aborted on the worker), the interactive request is served,
the victim resumes when a row frees, and every stream ends with exactly the tokens of an
uninterrupted run."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from actors.engine.sampling import SamplingParams
from actors.messages import GenerationRequest
from actors.messages import WorkerLoad as ActorLoad
from cluster.config import SchedulerConfig
from cluster.descriptors import RequestId, TenantId, WorkerKind, WorkerReport, WorkerName
from cluster.flights import EventKind, FlightEvent, ReportAck
from cluster.journal import Phase
from cluster.ordering import PriorityKey
from cluster.placement import Placement, PlacementConfig
from cluster.router.adapters import flight_state, request_desc
from cluster.router.choice import LeastLoaded, PlacementChoice
from cluster.router.flight import DECODING, PREEMPTED, InFlight
from cluster.router.link import SchedulerLink
from cluster.router.link_config import LinkConfig
from cluster.service import SchedulerService
from cluster.tenants import BatchSlo, InteractiveSlo, TenantConfig
from cluster.timeline import Stage

PARAMS = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
TENANTS = (TenantConfig(TenantId("online"), slo=InteractiveSlo(ttft_ms=10_000, tpot_ms=1_000)),
           TenantConfig(TenantId("batch"), slo=BatchSlo(deadline_s=3_600)))


def config(max_rows: int = 2) -> SchedulerConfig:
    return SchedulerConfig(tenants=TENANTS, default_tenant=None, heartbeat_timeout_s=60.0,
                           placement=PlacementConfig(max_num_seqs=max_rows))


def loads() -> list[WorkerReport]:
    return [WorkerReport(WorkerName(n), WorkerKind.PREFILL if n.startswith("p") else WorkerKind.DECODE,
                       0, 0, 1000, 1000, 16, True, time.time()) for n in ("p0", "d0")]


def request(rid: str, tenant: str, n: int = 40) -> GenerationRequest:
    return GenerationRequest(rid, list(range(4, 4 + n)), PARAMS, tenant=tenant)


def service() -> SchedulerService:
    svc = SchedulerService(config(), poll_interval_s=0.0)  # every report polls
    for client in ("a", "b"):
        svc.rebuild(client, [], loads())
    return svc


def decoding(svc: SchedulerService, client: str, rid: str, seq: int) -> None:
    """`client` submits a batch request and reports it decoding (KV delivered, tokens out)."""
    out = svc.submit(request_desc(request(rid, "batch")), None, client)
    assert isinstance(out, Placement) and not out.preempt
    t = time.time()
    svc.report(client, [(seq, [FlightEvent(EventKind.STAGE, RequestId(rid), t, stage="kv_transfer_done"),
                               FlightEvent(EventKind.TOKENS, RequestId(rid), t, times=(t, t))])])


def test_a_victim_streamed_by_another_ingress_is_preempted_there_and_resumed_when_a_row_frees() -> None:
    svc = service()
    decoding(svc, "b", "b1", 1)
    decoding(svc, "b", "b2", 2)
    online = svc.submit(request_desc(request("o1", "online")), None, "a")
    assert isinstance(online, Placement) and online.decode_worker == "d0"
    (victim,) = online.preempt  # two rows allowed: one batch row gives way
    entry = svc.sched.journal.get(victim)
    assert entry is not None and entry.phase is Phase.PREEMPTED

    assert svc.report("a", []).preempt == ()  # the submitting ingress got it in the placement
    ack = svc.report("b", [])
    assert ack.preempt == (victim,) and ack.resume == () and ack.notice_seq == 1
    again = svc.report("b", [], delivered=(ack.incarnation, 0))  # that ack was lost: sent again
    assert again.preempt == (victim,)
    assert svc.report("b", [], delivered=(ack.incarnation, 1)).preempt == ()  # seen: not again
    assert svc.report("b", [], delivered=("an-old-incarnation", 5)).preempt == ()
    svc.check_integrity()

    t = time.time()  # the interactive request finishes: the row is free again
    svc.report("a", [(1, [FlightEvent(EventKind.FINISH, RequestId("o1"), t, num_output_tokens=3)])])
    ack = svc.report("b", [], delivered=(ack.incarnation, 1))
    (resumed,) = ack.resume
    assert resumed.request_id == victim and resumed.decode_worker == "d0" and ack.notice_seq == 2
    assert resumed.resume_from_token == 2  # from the tokens already streamed
    # Recomputed on d0 in chunks that keep its rows within their TPOT: none is interactive now.
    assert resumed.local_chunk_tokens == PlacementConfig().max_local_chunk_tokens
    assert svc.stats().num_preempted == 1 and svc.stats().num_resumed == 1
    svc.check_integrity()


def test_a_victim_of_the_submitting_ingress_is_only_in_its_placement() -> None:
    svc = service()
    decoding(svc, "a", "a1", 1)
    decoding(svc, "a", "a2", 2)
    online = svc.submit(request_desc(request("o1", "online")), None, "a")
    assert isinstance(online, Placement) and len(online.preempt) == 1
    assert svc.report("a", []).preempt == () and svc.counters.num_notices == 0


def test_with_preempt_batch_off_the_interactive_request_waits_instead() -> None:
    from deploy.scheduler_config import SchedulerSection

    placement_cfg = SchedulerSection(preempt_batch=False).to_scheduler_config(max_num_seqs=2).placement
    assert (placement_cfg.preempt_batch, placement_cfg.max_num_seqs) == (False, 2)
    assert SchedulerSection().to_scheduler_config().placement.preempt_batch  # on by default
    svc = SchedulerService(replace(config(), placement=placement_cfg), poll_interval_s=0.0)
    svc.rebuild("b", [], loads())
    decoding(svc, "b", "b1", 1)
    decoding(svc, "b", "b2", 2)
    online = svc.submit(request_desc(request("o1", "online")), None, "a")
    assert isinstance(online, Placement) and online.preempt == ()
    assert svc.stats().num_preempted == 0
    svc.check_integrity()


def test_a_preempted_request_rebuilt_after_a_restart_waits_for_a_row_then_is_resumed() -> None:
    svc = SchedulerService(config(max_rows=1), poll_interval_s=0.0)
    waiting = InFlight(request("w", "batch"))
    waiting.streamed, waiting.emitted_tokens = [5, 6, 7], 3
    running = InFlight(request("r", "online"))
    running.place(None, "d0", DECODING)
    svc.report("b", [], loads())
    waiting.place(None, "d0", DECODING)
    waiting.phase, waiting.decode = PREEMPTED, None
    assert svc.rebuild("b", [flight_state(waiting), flight_state(running)]) == 2
    entry = svc.sched.journal.get(RequestId("w"))
    assert entry is not None and entry.phase is Phase.PREEMPTED and entry.decode_worker is None
    assert svc.report("b", []).resume == ()  # the one row is taken
    svc.report("b", [(1, [FlightEvent(EventKind.FINISH, RequestId("r"), time.time(), num_output_tokens=9)])])
    (resumed,) = svc.report("b", []).resume
    assert resumed.request_id == "w" and resumed.resume_from_token == 3
    svc.check_integrity()


def test_a_row_the_ingress_stopped_itself_is_queued_and_resumed_like_the_schedulers() -> None:
    svc = service()
    decoding(svc, "b", "b1", 1)
    f = InFlight(request("b1", "batch"))
    f.streamed, f.emitted_tokens = [9, 9], 2
    f.phase = PREEMPTED  # Preemptions.make_room stopped it for an interactive request of its own
    ack = svc.report("b", [(2, [FlightEvent(EventKind.ADOPT, RequestId("b1"), time.time(), state=flight_state(f))])])
    assert svc.stats().num_preempted == 1
    (resumed,) = ack.resume  # queued for resumption, and d0 has a free row: placed in the same report
    assert resumed.request_id == "b1" and resumed.resume_from_token == 2
    entry = svc.sched.journal.get(RequestId("b1"))
    assert entry is not None and entry.phase is Phase.QUEUED and entry.decode_worker == "d0"
    svc.check_integrity()


def test_a_preempted_request_no_ingress_streams_is_cancelled_when_resumed() -> None:
    svc = service()
    for rid in ("x1", "x2"):  # submitted anonymously, reported by nobody
        svc.submit(request_desc(request(rid, "batch")), None)
        svc.sched.on_stage(RequestId(rid), Stage.KV_TRANSFER_DONE)
    online = svc.submit(request_desc(request("o1", "online")), None, "a")
    assert isinstance(online, Placement) and len(online.preempt) == 1
    svc.sched.on_finish(RequestId("o1"))
    svc.report("a", [])
    assert svc.counters.num_orphans == 1 and svc.sched.journal.get(online.preempt[0]) is None
    svc.check_integrity()


# ---- the link -------------------------------------------------------------------------------

class _Source:
    """The router's side as the link sees it: flights, loads, and what was preempted/resumed."""

    def __init__(self, flights: list[InFlight]) -> None:
        self.flights = {f.request_id: f for f in flights}
        self.lds = [ActorLoad(n, "prefill" if n[0] == "p" else "decode", 0, 0, 0, 100, 100, 0.0, True)
                    for n in ("p0", "d0", "d1")]
        self.resumed: dict[str, Placement] = {}

    def in_flight(self) -> list[InFlight]:
        return list(self.flights.values())

    async def loads(self) -> dict[str, ActorLoad]:
        return {w.name: w for w in self.lds}

    async def telemetry(self, cursors: object) -> dict[str, object]:
        return {}

    def preempt(self, rid: str) -> bool | None:
        f = self.flights.get(rid)
        if f is None:
            return None
        if f.phase != DECODING:
            return False
        f.preempt()
        return True

    def resume(self, rid: str, decided: Placement) -> bool:
        self.resumed[rid] = decided
        return True


class _Actor:
    """A scheduler actor handle: `submit` answers `placement`; reports answer the queued acks."""

    def __init__(self, placement: Placement, acks: list[ReportAck]) -> None:
        self.placement, self.acks = placement, acks
        self.delivered: list[Any] = []
        self.batches: dict[int, list[FlightEvent]] = {}  # by sequence number (re-sends overwrite)

    def __getattr__(self, method: str) -> object:
        async def call(*args: Any) -> object:
            if method == "submit":
                return self.placement
            assert method == "report", method
            self.delivered.append(args[4])
            self.batches.update((seq, list(batch)) for seq, batch in args[1])  # type: ignore[attr-defined]
            return self.acks.pop(0) if self.acks else ReportAck("inc", False, 0, 0)

        return SimpleNamespace(remote=call)


def placement(rid: str, decode: str = "d0", preempt: tuple[str, ...] = (), chunk: int | None = None) -> Placement:
    return Placement(RequestId(rid), WorkerName("p0"), WorkerName(decode), PriorityKey(0, 0.0, 0),
                     preempt=tuple(RequestId(r) for r in preempt), local_chunk_tokens=chunk)


def test_the_link_stops_its_victims_readopts_those_that_cannot_stop_and_relays_resumptions() -> None:
    stopping, moving = InFlight(request("v1", "batch")), InFlight(request("v2", "batch"))
    stopping.place("p0", "d0", DECODING)
    stopping.streamed, stopping.emitted_tokens = [7, 8], 2
    moving.place("p0", "d0", "prefilling")  # its KV is still on its way: it cannot stop now
    other = InFlight(request("v3", "batch"))
    other.place("p0", "d1", DECODING)
    acks = [ReportAck("inc", False, 0, 0, notice_seq=4, preempt=(RequestId("v3"),)),
            # v1 runs again on d1; the scheduler also thinks v2 was stopped and resumes it
            ReportAck("inc", False, 0, 0, notice_seq=6, resume=(placement("v1", "d1", chunk=48), placement("v2")))]
    actor = _Actor(placement("o1", preempt=("v1", "v2", "gone")), acks)
    source = _Source([stopping, moving, other])

    async def main() -> Placement | None:
        link = SchedulerLink(actor, LinkConfig(ready_timeout_s=0.1, report_interval_s=60.0), config())  # type: ignore[arg-type]
        link.attach(source)
        try:
            decided = await link.admit(request("o1", "online"))
            # The reporter started by `admit` and these calls take the acks in turn: first another
            # ingress's request took v3's row, then v1 runs again on d1.
            for _ in range(3):
                await link.report_once()
            assert link.stats.num_preempted == 2 and link.stats.num_not_preempted == 1
            assert link.stats.num_resumed == 1
            return decided
        finally:
            link.close()

    decided = asyncio.run(main())
    assert decided is not None and decided.decode_worker == "d0"
    assert stopping.phase == PREEMPTED and other.phase == PREEMPTED and moving.phase == "prefilling"
    # A resume runs on its decode worker, recomputing in the scheduler's chunks.
    assert list(source.resumed) == ["v1"]
    prefills = [w for w in source.lds if w.kind == "prefill"]
    decodes = [w for w in source.lds if w.kind == "decode"]
    choice = LeastLoaded().place(stopping.resume_request(), prefills, decodes, decided=source.resumed["v1"])
    assert choice == PlacementChoice(None, ("d1", "d0"), local_chunk_tokens=48, priority=(0, 0.0))
    readopted = [e for batch in actor.batches.values() for e in batch if e.kind is EventKind.ADOPT]
    # The scheduler learns v2 still runs: when it could not stop, and again when it was "resumed".
    assert [e.request_id for e in readopted] == ["v2", "v2"] and "v2" not in source.resumed
    # What the link has seen goes back with every report, so nothing is acted on twice.
    assert actor.delivered[0] is None and ("inc", 4) in actor.delivered and actor.delivered[-1] == ("inc", 6)


# ---- live: Ray actors, the scheduler actor, a tiny model ------------------------------------

LIVE_TENANTS = (TenantConfig(TenantId("online"), slo=InteractiveSlo(ttft_ms=60_000, tpot_ms=10_000)),
                TenantConfig(TenantId("batch"), slo=BatchSlo(deadline_s=3_600)))


@pytest.fixture(scope="module")
def live(ray_cluster: ModuleType, tiny_model_dir: Path) -> Iterator[Any]:
    from cluster.router.config import RecoveryConfig
    from tests.cluster.ray.test_failures import deployment

    cfg = SchedulerConfig(tenants=LIVE_TENANTS, default_tenant=None, heartbeat_timeout_s=30.0,
                          placement=PlacementConfig(max_num_seqs=2))  # the engine has 16: the scheduler decides
    yield from deployment(ray_cluster, tiny_model_dir, 1, RecoveryConfig(), prefix="preempt", sched_cfg=cfg)


@pytest.mark.ray
@pytest.mark.slow
def test_an_interactive_request_takes_a_batch_row_which_resumes_exactly_when_a_row_frees(live: Any) -> None:
    import ray

    from tests.cluster.ray.test_failures import (GREEDY, SEEDED, Stream, assert_no_leaks, assert_same_as_failure_free,
                                                 reference)
    from tests.actors.workers.harness import random_tokens

    batch = [GenerationRequest(f"pb-{i}", random_tokens(30 + 20 * i, seed=8100 + i),
                               replace(p, max_tokens=700), tenant="batch")
             for i, p in enumerate((GREEDY, SEEDED))]
    online = GenerationRequest("po-0", random_tokens(50, seed=8200), replace(GREEDY, max_tokens=200), tenant="online")
    want = reference(live.model, [*batch, online])
    streams = {r.request_id: Stream(r) for r in [*batch, online]}
    arrivals: dict[str, list[float]] = {rid: [] for rid in streams}
    preempted: list[tuple[str, float]] = []
    carry_out = live.client.preempt

    def spy(rid: str) -> bool | None:  # what the link asks of the client, and when
        stopped = carry_out(rid)
        if stopped:
            preempted.append((rid, time.monotonic()))
        return stopped

    live.client.preempt = spy

    async def consume(s: Stream) -> None:
        try:
            async for event in live.client.generate(s.req):
                s.events.append(event)
                arrivals[s.req.request_id].append(time.monotonic())
        except Exception as e:  # noqa: BLE001 - reported by the assertions
            s.error = e

    async def main() -> None:
        tasks = [asyncio.ensure_future(consume(streams[r.request_id])) for r in batch]
        deadline = time.monotonic() + 60
        # Both batch rows decode, and the scheduler has heard (their tokens come with the reports).
        while not all(len(streams[r.request_id].token_ids) >= 20 for r in batch):
            assert time.monotonic() < deadline and not any(t.done() for t in tasks), "batch rows never decoded"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        tasks.append(asyncio.ensure_future(consume(streams[online.request_id])))
        await asyncio.wait_for(asyncio.gather(*tasks), 120)

    try:
        asyncio.run(main())
    finally:
        del live.client.preempt
    assert_same_as_failure_free(streams, want)  # exactly the tokens and text of uninterrupted runs
    assert live.client.preemptions.num_preempted == 1 and live.link.stats.num_preempted == 1
    assert live.link.stats.num_resumed == 1 and live.client.preemptions.num_resumed_locally == 0
    stats = ray.get(live.scheduler.stats.remote(), timeout=30)
    assert (stats.num_preempted, stats.num_resumed) == (1, 1)
    # The victim paused: nothing streamed from its preemption (plus what was already on its way)
    # until the online request's last token (its row was free only then), then the rest.
    (victim, t_stop), = preempted
    online_done = arrivals[online.request_id][-1]
    assert victim in {r.request_id for r in batch}
    assert not any(t_stop + 0.2 < t < online_done for t in arrivals[victim])
    assert any(t > online_done for t in arrivals[victim])
    print(f"{victim} paused {online_done - t_stop:.2f} s for {online.request_id}; "
          f"{len(arrivals[victim])} events in all")
    assert_no_leaks(live)
