"""The ingress's scheduler link when nothing happens: after a round with nothing to tell, the
reporter heartbeats only every `idle_report_interval_s`, and the next request wakes it at once: a
fresh report goes out before its submit, without waiting out the idle interval. Without Ray: the scheduler's plain class
behind a fake handle."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from actors.engine.sampling import SamplingParams
from actors.messages import GenerationRequest, WorkerLoad
from cluster.config import SchedulerConfig
from cluster.router.link import SchedulerLink
from cluster.router.link_config import LinkConfig
from cluster.service import SchedulerService

HOUR_S = 3600.0
LOADS = [WorkerLoad("p0", "prefill", 0, 0, 0, 100, 100, 0.0, True), WorkerLoad("d0", "decode", 0, 0, 0, 100, 100, 0.0, True)]


class _Actor:
    """A scheduler actor handle over the plain service: every call answered in this event loop."""

    def __init__(self, svc: SchedulerService) -> None:
        self.svc = svc
        self.calls: list[str] = []

    def __getattr__(self, method: str) -> object:
        fn = getattr(self.svc, method)

        async def call(*args: object) -> object:
            self.calls.append(method)
            return fn(*args)

        return SimpleNamespace(remote=call)


class _Source:
    def __init__(self) -> None:
        self.num_telemetry = 0

    def in_flight(self) -> list[object]:
        return []

    async def loads(self) -> dict[str, WorkerLoad]:
        return {w.name: w for w in LOADS}

    async def telemetry(self, cursors: object) -> dict[str, object]:
        self.num_telemetry += 1
        return {}


async def _until(cond, what: str) -> None:  # type: ignore[no-untyped-def]
    """Yields to the loop until `cond()`; a hang guard of 30 s, not a timing bound."""
    async def spin() -> None:
        while not cond():
            await asyncio.sleep(0.005)
    try:
        await asyncio.wait_for(spin(), 30)
    except asyncio.TimeoutError:
        raise AssertionError(f"never: {what}") from None


def test_an_idle_reporter_only_heartbeats_and_a_request_wakes_it() -> None:
    # The scheduler's heartbeat timeout allows hour-long idle heartbeats, so only a wake-up can
    # explain a report after the link went idle.
    sched = SchedulerConfig(heartbeat_timeout_s=4 * HOUR_S)
    actor = _Actor(SchedulerService(sched))
    link = SchedulerLink(actor, LinkConfig(report_interval_s=0.01, idle_report_interval_s=HOUR_S), sched)  # type: ignore[arg-type]
    link.attach(_Source())  # type: ignore[arg-type]

    async def main() -> tuple[int, int, list[str]]:  # (reports when idle, reports at the end, the calls)
        link._start()
        await _until(lambda: link.pacer.idle, "the reporter found nothing to tell")
        idle_reports, idle_calls = link.stats.num_reports, len(actor.calls)
        for _ in range(20):  # the loop turns many times; an idle reporter sends nothing
            await asyncio.sleep(0.01)
        assert link.stats.num_reports == idle_reports and link.pacer.idle
        req = GenerationRequest("a", list(range(4, 44)), SamplingParams(max_tokens=8, temperature=0))
        await link.admit(req)  # a new request: its admission wakes the reporter
        later = actor.calls[idle_calls:]
        # After heartbeats only, the scheduler's view may be old: a fresh report goes before the submit.
        assert "report" in later and later.index("report") < later.index("submit"), later
        await _until(lambda: link.stats.num_reports > idle_reports, "a report after the request")
        link.close()
        return idle_reports, link.stats.num_reports, list(actor.calls)

    idle_reports, reports, calls = asyncio.run(main())
    assert idle_reports >= 1 and reports > idle_reports and "submit" in calls


def test_heartbeats_relay_telemetry_only_every_idle_telemetry_interval() -> None:
    sched = SchedulerConfig(heartbeat_timeout_s=4 * HOUR_S)
    actor, source = _Actor(SchedulerService(sched)), _Source()
    cfg = LinkConfig(report_interval_s=0.01, idle_report_interval_s=0.01, telemetry_interval_s=0.01,
                     idle_telemetry_interval_s=HOUR_S)
    link = SchedulerLink(actor, cfg, sched)  # type: ignore[arg-type]
    link.attach(source)  # type: ignore[arg-type]

    async def main() -> None:
        link._start()
        # Heartbeats relay it until a relay finds nothing new (here: the first one).
        await _until(lambda: link.telemetry_settled, "a heartbeat's relay found nothing new")
        reports, relayed = link.stats.num_reports, source.num_telemetry
        assert relayed >= 2  # the busy round's and the first heartbeat's
        await _until(lambda: link.stats.num_reports >= reports + 5, "five heartbeats")
        assert source.num_telemetry == relayed  # heartbeats: loads and the report, no telemetry
        await link.admit(GenerationRequest("a", list(range(4, 44)), SamplingParams(max_tokens=8, temperature=0)))
        assert not link.telemetry_settled  # a busy round: there may be news again
        await _until(lambda: source.num_telemetry > relayed, "telemetry once a request woke the link")
        link.close()

    asyncio.run(main())
