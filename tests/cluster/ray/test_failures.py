"""Failures on a live Ray deployment: 2 prefill + 2 decode actors on a tiny model, the scheduler actor,
and a `Router` placing through it. In order, with streams in flight each time: a decode worker
is killed, then a prefill worker, then the scheduler actor itself. Every request completes with
exactly the tokens and text of a failure-free run (a single in-process engine, same seeds), the
recoveries were issued least remaining SLO budget first, and the surviving workers hold no
leaked blocks. The tests share one deployment and run in file order (each kill is permanent)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType

import pytest

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.options import RequestOptions
from actors.engine.sampling import SamplingParams
from actors.messages import GenerationRequest, TokenEvent
from actors.worker_config import WorkerConfig
from cluster.config import SchedulerConfig
from cluster.cost_model import StepCostPrior, StepTimeModel
from cluster.descriptors import TenantId
from cluster.router.client import Router
from cluster.router.config import RecoveryConfig, RouterConfig
from cluster.router.flight import PREFILLING
from cluster.router.link import SchedulerLink
from cluster.router.link_config import LinkConfig
from cluster.router.ray_handles import router_for
from cluster.router.rounds import RecoveryRecord
from cluster.tenants import InteractiveSlo, TenantConfig
from tests.actors.workers.harness import random_tokens, streamed_ids, streamed_text
from transfer.config import TransferConfig

pytestmark = [pytest.mark.ray, pytest.mark.slow]
MIB = 1 << 20
NUM_BLOCKS = 1024  # 8 requests of ~800 tokens fit one decode worker
MAX_TOKENS = 160
NUM_TENANTS = 8
# Tenant k: TTFT target 60 s x 2^k, TPOT target 0.1 s x 4^k. Far apart, so the order of remaining
# budgets is decided by the tenant, not by a few milliseconds of timing noise, yet it is computed
# from the requests' own progress below, never assumed.
CLIENT = RouterConfig(call_timeout_s=30, prefill_timeout_s=60, token_timeout_s=60, load_ttl_s=0.1)
TTFT_S = [60.0 * 2**k for k in range(NUM_TENANTS)]
TPOT_S = [0.1 * 4**k for k in range(NUM_TENANTS)]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_k=40, ignore_eos=True)


def scheduler_config() -> SchedulerConfig:
    tenants = tuple(TenantConfig(TenantId(f"t{k}"), slo=InteractiveSlo(ttft_ms=TTFT_S[k] * 1e3, tpot_ms=TPOT_S[k] * 1e3))
                    for k in range(NUM_TENANTS))
    return SchedulerConfig(tenants=tenants, default_tenant=None, heartbeat_timeout_s=30.0)


@dataclass
class Deployment:
    model: Path
    pd: object
    scheduler: object
    link: SchedulerLink
    client: Router
    prefills: list[str] = field(default_factory=list)
    decodes: list[str] = field(default_factory=list)
    records_seen: int = 0

    def survivors(self) -> dict[str, object]:
        handles = {**self.pd.prefills, **self.pd.decodes}  # type: ignore[attr-defined]
        return {n: h for n, h in handles.items() if n not in self.client.board.dead}

    def new_records(self) -> list[RecoveryRecord]:
        records = self.client.recoveries.log[self.records_seen:]
        self.records_seen = len(self.client.recoveries.log)
        return records


def worker_config(model: Path) -> WorkerConfig:
    return WorkerConfig(model=str(model), engine=EngineConfig(num_blocks=NUM_BLOCKS, max_num_seqs=16),
                        transfer=TransferConfig(send_staging_bytes=8 * MIB, recv_staging_bytes=8 * MIB),
                        lease_s=20.0, transfer_timeout_s=10.0,
                        compression="none")  # exact KV: streams are compared token for token with recomputes


def deployment(ray: ModuleType, model: Path, num_each: int, recovery: RecoveryConfig, *,
               replace_dead: bool = False, prefix: str = "fail",
               sched_cfg: SchedulerConfig | None = None) -> Iterator[Deployment]:
    """`num_each` prefill and decode actors, the scheduler actor (`scheduler_config()` unless
    given), and a client placing through it."""
    from actors.ray_actors import start_pd
    from cluster.actor import start_scheduler

    pd = start_pd(worker_config(model), num_prefill=num_each, num_decode=num_each, torch_threads=1,
                  name_prefix=f"{prefix}-{uuid.uuid4().hex[:4]}")
    sched_cfg = sched_cfg or scheduler_config()
    scheduler = start_scheduler(sched_cfg, name=f"ferry-scheduler-{uuid.uuid4().hex[:6]}")
    link = SchedulerLink(scheduler, LinkConfig(report_interval_s=0.05, admit_timeout_s=3.0, call_timeout_s=3.0,
                                                    down_backoff_s=0.5), sched_cfg)
    client = router_for(pd, CLIENT, control=link, recovery=recovery, replace_dead=replace_dead)
    try:
        yield Deployment(model, pd, scheduler, link, client, list(pd.prefills), list(pd.decodes))
    finally:
        link.close()
        pd.shutdown()
        ray.kill(scheduler, no_restart=True)


@pytest.fixture(scope="module")
def dep(ray_cluster: ModuleType, tiny_model_dir: Path) -> Iterator[Deployment]:
    yield from deployment(ray_cluster, tiny_model_dir, 2, RecoveryConfig(gather_s=3.0, probe_timeout_s=10.0))


# ---- the failure-free run ---------------------------------------------------------------------


def reference(model: Path, reqs: list[GenerationRequest]) -> dict[str, tuple[list[int], str]]:
    """Tokens and text one in-process engine produces for each request, with the request's seed."""
    engine = Engine.from_pretrained(model, EngineConfig(num_blocks=1024, max_num_seqs=64))
    for r in reqs:
        engine.add_request(r.request_id, list(r.prompt_token_ids), r.params,
                           RequestOptions(seed=r.seed, extra_keys=r.cache_salt))
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = (list(out.token_ids), out.text)
    return final


def make_requests(tag: str, prompt_lens: list[int], seed: int, max_tokens: int = MAX_TOKENS) -> list[GenerationRequest]:
    """Half greedy, half seeded sampling; tenants scrambled against arrival order."""
    greedy, seeded = (replace(p, max_tokens=max_tokens) for p in (GREEDY, SEEDED))
    return [GenerationRequest(f"{tag}-{i}", random_tokens(n, seed=seed + i), greedy if i % 2 == 0 else seeded,
                              tenant=f"t{(5 * i + 3) % NUM_TENANTS}")
            for i, n in enumerate(prompt_lens)]


def tenant_of(rid: str, reqs: list[GenerationRequest]) -> int:
    return int(next(r.tenant for r in reqs if r.request_id == rid)[1:])


# ---- driving streams and failures -------------------------------------------------------------


@dataclass
class Stream:
    req: GenerationRequest
    events: list[TokenEvent] = field(default_factory=list)
    error: BaseException | None = None

    @property
    def token_ids(self) -> list[int]:
        return streamed_ids(self.events)

    @property
    def text(self) -> str:
        return streamed_text(self.events)


async def run_with_failure(dep: Deployment, reqs: list[GenerationRequest],
                           strike: Callable[[dict[str, Stream]], bool], timeout_s: float = 150.0) -> dict[str, Stream]:
    """Streams every request concurrently; `strike(streams)` is polled every millisecond until it
    returns True (it does the killing)."""
    streams = {r.request_id: Stream(r) for r in reqs}

    async def consume(s: Stream) -> None:
        try:
            async for event in dep.client.generate(s.req):
                s.events.append(event)
        except Exception as e:  # noqa: BLE001 - reported by the assertions
            s.error = e

    tasks = [asyncio.ensure_future(consume(s)) for s in streams.values()]
    done = asyncio.gather(*tasks)
    deadline = time.monotonic() + timeout_s
    struck = False
    while not struck and not done.done() and time.monotonic() < deadline:
        struck = strike(streams)
        await asyncio.sleep(0.001)
    assert struck, ("the failure never found its moment: every stream finished first",
                    {rid: (len(s.events), repr(s.error)) for rid, s in streams.items()})
    await asyncio.wait_for(done, max(1.0, deadline - time.monotonic()))
    reps = dep.client.replacements  # streams may finish first (resumed elsewhere): the replacement too
    if reps is not None and reps.replacing:
        await asyncio.wait_for(asyncio.gather(*reps.replacing.values()), max(1.0, deadline - time.monotonic()))
    return streams


def assert_same_as_failure_free(streams: dict[str, Stream], want: dict[str, tuple[list[int], str]]) -> None:
    for rid, s in streams.items():
        assert s.error is None, f"{rid} failed: {s.error!r}"
        assert s.events[-1].output.finished and s.events[-1].output.finish_reason == "length"
        assert s.token_ids == want[rid][0], f"{rid}: tokens differ from the failure-free run"
        assert s.text == want[rid][1] == s.events[-1].output.text, f"{rid}: text differs"
        assert {e.output.request_id for e in s.events} == {rid}
        seen: list[int] = []  # at every event, the stream so far is a prefix of the right one
        for e in s.events:
            seen += e.output.new_token_ids
            assert list(e.output.token_ids) == seen == want[rid][0][: len(seen)], f"{rid}: at token {len(seen)}"


def assert_no_leaks(dep: Deployment) -> None:
    import ray

    survivors = dep.survivors()
    stats = ray.get([h.check_integrity.remote() for h in survivors.values()], timeout=60)
    for name, st in zip(survivors, stats):
        assert (st.num_running, st.num_waiting) == (0, 0), name
        assert st.num_blocks_free == st.num_blocks_total == NUM_BLOCKS, f"{name}: {st}"
    loads = ray.get([h.load.remote() for n, h in survivors.items() if n in dep.pd.decodes], timeout=60)
    assert all(w.num_reserved == 0 for w in loads)


def slack_key(record: RecoveryRecord, reqs: list[GenerationRequest]) -> float:
    """Remaining SLO budget + now (now is common to a round): the next token's due time for a
    request that streamed, its TTFT deadline for one that did not."""
    k = tenant_of(record.request_id, reqs)
    if record.first_token_at is None:
        arrival = next(r.arrival_time for r in reqs if r.request_id == record.request_id)
        return arrival + TTFT_S[k]
    return record.first_token_at + TPOT_S[k] * record.num_streamed


async def async_wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


# ---- the tests --------------------------------------------------------------------------------


def test_workers_telemetry_fits_the_scheduler_and_steers_a_shared_prefix(dep: Deployment) -> None:
    """Before any failure: the workers' step times reach the scheduler actor (its models leave the
    prior) and their prefix caches steer a request sharing a prompt prefix to where it is held."""
    import ray

    # A long shared prefix: with one measured step, a fit still puts much of its time on the
    # intercept, and only a large saving in prefill tokens is sure to show through that.
    first = GenerationRequest("tele-a", random_tokens(600, seed=4000), replace(GREEDY, max_tokens=8), tenant="t0")
    follow = GenerationRequest("tele-b", list(first.prompt_token_ids[:592]) + random_tokens(40, seed=4001),
                               replace(GREEDY, max_tokens=8), tenant="t0")

    decoded_by: set[str] = set()

    async def run(req: GenerationRequest) -> None:
        async for event in dep.client.generate(req):
            decoded_by.add(event.worker)

    async def relayed_all() -> None:
        # Every worker's last steps and cache diffs reach the scheduler: once the link is idle it
        # relays telemetry until a relay finds nothing new (`telemetry_settled`).
        seen = dep.link.stats.num_telemetry
        await async_wait_until(lambda: dep.link.stats.num_telemetry > seen and dep.link.telemetry_settled, 30.0,
                               "a telemetry relay with nothing new")

    async def main() -> None:
        await run(first)
        await relayed_all()
        await run(follow)
        await relayed_all()

    asyncio.run(main())
    a, b = dep.client.prefill_result("tele-a"), dep.client.prefill_result("tele-b")
    assert a is not None and b is not None
    assert b.worker == a.worker and b.num_local_hit_blocks == 592 // 16
    prior = StepTimeModel(StepCostPrior()).coefficients
    stats = ray.get(dep.scheduler.stats.remote(), timeout=30)
    assert {w.name for w in stats.workers} == set(dep.survivors())
    # The workers that ran steps are modelled from them; the others borrow the fit of their kind's
    # measured steps, not the static prior (~50x optimistic on a CPU).
    ran = decoded_by | {a.worker}
    assert {w.name for w in stats.workers if w.step_model_samples} == ran, stats.workers
    kinds_ran = {w.kind for w in stats.workers if w.step_model_samples}
    assert all(w.step_model_coefficients != prior for w in stats.workers if w.kind in kinds_ran), stats.workers


def test_decode_worker_killed_with_eight_streams_in_flight(dep: Deployment) -> None:
    import ray

    reqs = make_requests("dk", [5, 17, 33, 48, 9, 26, 40, 60], seed=1000)
    want = reference(dep.model, reqs)
    killed: list[str] = []
    victims: set[str] = set()

    def strike(streams: dict[str, Stream]) -> bool:
        # Every stream well under way (and none near its end): kill the busiest decode worker.
        if any(len(s.events) < 12 for s in streams.values()):
            return False
        by_decode: dict[str, set[str]] = {}
        for rid, f in dep.client.flights.items():
            if f.decode is not None:
                by_decode.setdefault(f.decode, set()).add(rid)
        name = max(sorted(by_decode), key=lambda n: len(by_decode[n]))
        victims.update(by_decode[name])
        ray.kill(dep.pd.decodes[name], no_restart=True)
        killed.append(name)
        return True

    streams = asyncio.run(run_with_failure(dep, reqs, strike))
    assert_same_as_failure_free(streams, want)
    assert len(victims) >= 2 and set(dep.client.board.dead) == set(killed)
    records = dep.new_records()
    assert {r.request_id for r in records} == victims  # each victim recovered once, nobody else
    assert {r.dead for r in records} == {tuple(killed)}
    assert all(0 < r.num_streamed < MAX_TOKENS and r.decode not in killed for r in records)
    # Issued most urgent first: by remaining SLO budget, from each request's own progress.
    keys = [slack_key(r, reqs) for r in records]
    assert keys == sorted(keys), [(r.request_id, r.num_streamed, tenant_of(r.request_id, reqs)) for r in records]
    assert [r.position for r in records] == list(range(len(records)))
    issued = [r.issued_at for r in records]
    assert None not in issued and issued == sorted(issued)  # type: ignore[type-var]
    for r in records:  # a resumed stream came from the surviving decode worker
        events = streams[r.request_id].events
        cut = next(i for i, e in enumerate(events) if len(e.output.token_ids) >= r.num_streamed)
        assert {e.worker for e in events[cut + 1:]} == {r.decode}
    assert_no_leaks(dep)


def test_prefill_worker_killed_while_prefilling(dep: Deployment) -> None:
    import ray

    # Long prompts make prefills last long enough to be caught in the act.
    reqs = make_requests("pk", [700, 650, 620, 600, 680, 640, 610, 660], seed=2000)
    want = reference(dep.model, reqs)
    target = dep.prefills[0]
    caught: set[str] = set()

    def strike(streams: dict[str, Stream]) -> bool:
        caught.update(rid for rid, f in dep.client.flights.items() if f.prefill == target and f.phase == PREFILLING)
        if caught:
            ray.kill(dep.pd.prefills[target], no_restart=True)
        return bool(caught)

    streams = asyncio.run(run_with_failure(dep, reqs, strike))
    assert_same_as_failure_free(streams, want)
    assert target in dep.client.board.dead
    records = dep.new_records()
    recovered = {r.request_id for r in records}
    # Requests caught prefilling there were recovered (one may have slipped out with its answer
    # already on the wire), and so was any placed there before its death was known ...
    assert caught & recovered
    assert all(r.dead == (target,) and r.num_streamed == 0 and r.prefill == dep.prefills[1] for r in records), records
    # ... least remaining TTFT budget first within each round (a request still being announced
    # when the worker died fails a moment later, and forms the next round).
    for rnd in sorted({r.round for r in records}):
        keys = [slack_key(r, reqs) for r in records if r.round == rnd]
        assert keys == sorted(keys), [(r.round, r.request_id, tenant_of(r.request_id, reqs)) for r in records]
    assert_no_leaks(dep)


def test_scheduler_actor_killed_with_streams_in_flight(dep: Deployment) -> None:
    import ray

    # Long enough that the restarted actor (seconds) comes back while they still stream.
    reqs = make_requests("sk", [12, 30, 7, 52, 21, 44, 16, 35], seed=3000, max_tokens=320)
    late = make_requests("sk-late", [14, 27], seed=3100)  # submitted while the scheduler is down
    want = reference(dep.model, reqs + late)
    before = ray.get(dep.scheduler.service_stats.remote(), timeout=30)
    placed_before = dep.link.stats.num_fallback + dep.link.stats.num_admitted

    async def main() -> tuple[dict[str, Stream], list[str]]:
        late_run: list[asyncio.Future[dict[str, Stream]]] = []

        def strike(streams: dict[str, Stream]) -> bool:
            if any(len(s.events) < 5 for s in streams.values()):
                return False
            ray.kill(dep.scheduler, no_restart=False)  # Ray restarts it (max_restarts=-1) in seconds
            late_run.append(asyncio.ensure_future(run_with_failure(dep, late, lambda _: True)))
            return True

        streams = await run_with_failure(dep, reqs, strike)
        streams.update(await late_run[0])
        # The link's reporter runs on this loop: let it see the restart, rebuild, and report the ends.
        await async_wait_until(lambda: dep.link.stats.num_restarts_seen >= 1 and dep.link.stats.num_rebuilds >= 2,
                               60, "the restart to be seen")
        in_flight: list[str] = ["?"]
        deadline = time.monotonic() + 60
        while in_flight and time.monotonic() < deadline:
            in_flight = await dep.scheduler.in_flight.remote()
            await asyncio.sleep(0.1)
        return streams, in_flight

    streams, in_flight = asyncio.run(main())
    assert_same_as_failure_free(streams, want)
    assert dep.new_records() == []  # nothing to recover: no worker died
    # Placed while the actor was away (locally) or by its new incarnation: never refused or lost.
    placed = dep.link.stats.num_fallback + dep.link.stats.num_admitted
    assert placed == placed_before + len(reqs) + len(late)

    # The restarted actor was rebuilt from the ingress's in-flight list, then saw them finish.
    assert in_flight == []
    after = ray.get(dep.scheduler.service_stats.remote(), timeout=30)
    assert after.incarnation != before.incarnation and after.num_rebuilds >= 1
    assert after.num_adopted >= dep.link.stats.num_rebuilt_requests >= 1  # what was in flight at the rebuild
    ray.get(dep.scheduler.check_integrity.remote(), timeout=30)
    stats = ray.get(dep.scheduler.stats.remote(), timeout=30)
    assert stats.num_in_flight == 0 and stats.num_finished >= len(reqs)
    assert_no_leaks(dep)
