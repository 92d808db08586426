"""Scheduler decision latency with many requests in flight (the issue's "p99 < 200 us at 10k").

Mental model: build a `GlobalScheduler` over 16 prefill + 16 decode workers whose prefix caches
and the pool hold thousands of blocks, fill it with `num_in_flight` requests that never finish,
then measure `num_measured` decisions in steady state: each iteration finishes one random request
(token + finish events) and submits a new one, with a full round of worker reports and a `poll`
every 50 iterations, as a live scheduler would see. The timed region is `submit` alone (placement
+ admission + bookkeeping), garbage collector left on, both as wall-clock time (`perf_counter`,
which on a shared machine also counts time the OS gave to other processes) and as this thread's
CPU time (`thread_time`, the scheduler's own cost); event handling is timed separately. Prompts: 1-8k tokens in 16-token blocks; a quarter share one of 50
system prompts of 1-2k tokens (so prefix matching has real work), the rest are unique.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from cluster.clock import FakeClock
from cluster.config import SchedulerConfig
from cluster.descriptors import RequestDesc, RequestId, StepSample, TenantId, WorkerKind, WorkerReport, WorkerName
from cluster.placement import Placement, PlacementConfig
from cluster.scheduler import GlobalScheduler
from cluster.tenants import InteractiveSlo, TenantConfig
from cluster.timeline import Stage


def _percentiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, max(0, int(q * len(s) + 0.5) - 1))]  # noqa: E731
    return {"p50_us": pick(0.50) * 1e6, "p99_us": pick(0.99) * 1e6, "max_us": s[-1] * 1e6,
            "mean_us": statistics.fmean(s) * 1e6}


def measure_decision_latency(num_in_flight: int = 10_000, num_measured: int = 5_000, num_prefill: int = 16,
                             num_decode: int = 16, seed: int = 0, local_prefill: bool = True) -> dict[str, Any]:
    rng = random.Random(seed)
    clock = FakeClock()
    tenants = tuple(TenantConfig(TenantId(f"t{i}"), weight=1.0 + i % 3,
                                 slo=InteractiveSlo(ttft_ms=1e7, tpot_ms=1e4)) for i in range(8))
    sched = GlobalScheduler(SchedulerConfig(tenants=tenants, default_tenant=None,
                                            placement=PlacementConfig(hash_block_size=16, local_prefill=local_prefill)),
                             clock)
    system_prompts = [[rng.getrandbits(64) for _ in range(rng.randint(64, 128))] for _ in range(50)]
    names = [WorkerName(f"p{i}") for i in range(num_prefill)] + [WorkerName(f"d{i}") for i in range(num_decode)]

    def report(name: WorkerName, full: bool) -> WorkerReport:
        prefill = name.startswith("p")
        steps = (StepSample(4096, 4096 * 2048.0, 0, 0, 0.15),) if prefill else \
                (StepSample(0, 0.0, 256, 256 * 2000, 0.03),)
        held = None
        if full and prefill:
            held = frozenset(h for sp in rng.sample(system_prompts, 10) for h in sp)
        return WorkerReport(name, WorkerKind.PREFILL if prefill else WorkerKind.DECODE, 8, 4,
                          10_000_000, 10_000_000, 16, True, clock.now(), steps, cached_full=held)

    for n in names:
        sched.on_report(report(n, True))
    sched.on_pool_report(added=[h for sp in system_prompts for h in sp])
    counter = iter(range(10**9))

    def new_desc() -> RequestDesc:
        num_blocks = rng.randint(64, 512)
        if rng.random() < 0.25:
            sp = rng.choice(system_prompts)
            hashes = tuple(sp) + tuple(rng.getrandbits(64) for _ in range(max(0, num_blocks - len(sp))))
        else:
            hashes = tuple(rng.getrandbits(64) for _ in range(num_blocks))
        return RequestDesc(RequestId(f"r{next(counter)}"), TenantId(f"t{rng.randrange(8)}"),
                           len(hashes) * 16 + rng.randrange(16), 512, hashes, clock.now())

    live: list[RequestId] = []
    while len(live) < num_in_flight:
        out = sched.submit(new_desc())
        assert isinstance(out, Placement), out
        live.append(out.request_id)
        clock.advance(1e-4)
    sched.latency.clear()
    event_s: list[float] = []
    submit_cpu_s: list[float] = []
    for i in range(num_measured):
        clock.advance(1e-4)
        j = rng.randrange(len(live))
        rid = live[j]
        t0 = time.perf_counter()
        sched.on_stage(rid, Stage.PREFILL_START)
        sched.on_token(rid)
        sched.on_finish(rid)
        event_s.append(time.perf_counter() - t0)
        desc = new_desc()
        c0 = time.thread_time()
        out = sched.submit(desc)
        submit_cpu_s.append(time.thread_time() - c0)
        assert isinstance(out, Placement), out
        live[j] = out.request_id
        if i % 50 == 0:
            for n in names:
                sched.on_report(report(n, False))
            sched.poll()
    st = sched.stats()
    assert st.num_in_flight == num_in_flight
    return {
        "num_in_flight": st.num_in_flight, "num_measured": num_measured,
        "num_prefill": num_prefill, "num_decode": num_decode,
        "submit_p50_us": st.decision_p50_us, "submit_p99_us": st.decision_p99_us,
        "submit_max_us": st.decision_max_us,
        "submit_cpu": _percentiles(submit_cpu_s),
        "events_per_request": _percentiles(event_s),
    }


if __name__ == "__main__":
    import json

    print(json.dumps(measure_decision_latency(), indent=2))
