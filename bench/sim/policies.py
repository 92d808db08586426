"""The three control planes the simulator compares.

- `ColocatedRoundRobin`: colocated engines, requests dealt round-robin, FCFS inside each engine
  (chunked prefill): the usual default of an engine behind a plain load balancer.
- `DisaggLoadOnly`: prefill and decode instances (with the same prefix caches and pool as ours),
  each request to the prefill instance with the fewest outstanding requests, its KV to the decode
  instance with the fewest, FCFS everywhere, no admission control, no batch cap: what a
  disaggregated deployment gets from a load-aware but SLO-blind router.
- `Ours`: the real `cluster.scheduler.GlobalScheduler` (not a copy) driven through the same
  calls the Ray integration makes: submit, stage/token/finish events, load reports, poll. With
  `local_prefill` on (the default of `python -m bench.sim`), decode instances also prefill the
  requests the scheduler places on them, in chunks of `local_chunk_tokens`.
After a failure, the baselines re-dispatch the lost requests in arrival order once the death is
detected; ours follows the scheduler's recovery plan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bench.sim.events import SimClock
from bench.sim.request import LOST, ORPHAN, TRANSFER, SimRequest
from cluster.admission import Refusal
from cluster.config import SchedulerConfig
from cluster.descriptors import RequestDesc, RequestId, TenantId, WorkerReport, WorkerName
from cluster.placement import Placement, PlacementKind
from cluster.scheduler import GlobalScheduler
from cluster.timeline import Stage

if TYPE_CHECKING:
    from bench.sim.contracts import SimDataPlane


class SimPolicy:
    """Hooks the simulated cluster calls; the defaults do nothing."""

    name = "router"
    wants_reports = False

    def attach(self, sim: SimDataPlane) -> None:
        self.sim = sim

    def on_arrival(self, req: SimRequest) -> None: raise NotImplementedError
    def decode_target(self, req: SimRequest) -> str: raise NotImplementedError
    def decode_cap(self, name: str) -> int | None: return None
    def local_chunk_tokens(self, name: str, rows: int, context: int, computed: int) -> int: return 0
    def on_prefill_start(self, req: SimRequest) -> None: pass
    def on_token(self, req: SimRequest) -> None: pass
    def on_kv_delivered(self, req: SimRequest) -> None: pass
    def on_decode_admitted(self, req: SimRequest) -> None: pass
    def on_finish(self, req: SimRequest) -> None: pass
    def on_report(self, load: WorkerReport) -> None: pass
    def on_pool_report(self, added: tuple[int, ...], removed: tuple[int, ...]) -> None: pass
    def on_tick(self) -> None: pass
    def sync_tokens(self, reqs: list[SimRequest]) -> None: pass
    def on_failure_detected(self, name: str) -> None: pass
    # Autoscaling (`autoscale.py`): an instance joined, or left idle after a drain (its reports
    # said unhealthy meanwhile); `holds_work`: whether the router still counts a request on it.
    def on_instance_added(self, name: str) -> None: pass
    def on_instance_removed(self, name: str) -> None: pass
    def holds_work(self, name: str) -> bool: return False

    def _lost_in_arrival_order(self) -> list[SimRequest]:
        """Requests to re-dispatch after a detected death: those whose KV died (LOST), those whose
        KV reached a dead decoder (ORPHAN) or is on its way to one (TRANSFER); arrival order."""
        dead = {n for n, inst in self.sim.instances.items() if inst.dead}
        lost = [r for r in self.sim.requests.values()
                if r.state in (LOST, ORPHAN) or (r.state == TRANSFER and r.decode_inst in dead)]
        return sorted(lost, key=lambda r: (r.arrival, r.rid))


class ColocatedRoundRobin(SimPolicy):
    name = "colocated-rr-fcfs"

    def attach(self, sim: SimDataPlane) -> None:
        super().attach(sim)
        self._next = 0
        self._dead: set[str] = set()

    def _pick(self) -> str:
        names = [n for n in self.sim.instances if n not in self._dead]
        name = names[self._next % len(names)]
        self._next += 1
        return name

    def on_arrival(self, req: SimRequest) -> None:
        name = self._pick()
        self.sim.dispatch(req, name, name, (req.arrival,))

    def decode_target(self, req: SimRequest) -> str:
        return req.prefill_inst or ""

    def on_failure_detected(self, name: str) -> None:
        self._dead.add(name)
        for req in self._lost_in_arrival_order():
            target = self._pick()
            self.sim.dispatch(req, target, target, (req.arrival,))


class DisaggLoadOnly(SimPolicy):
    name = "disagg-load-only"

    def attach(self, sim: SimDataPlane) -> None:
        super().attach(sim)
        self._dead: set[str] = set()
        self.outstanding = {n: 0 for n in sim.instances}  # prefill: queued+running; decode: rows
        self._prefill_of: dict[str, str] = {}
        self._decode_of: dict[str, str] = {}

    def _least(self, prefix: str) -> str:
        return min((n for n in self.outstanding if n.startswith(prefix) and n not in self._dead),
                   key=lambda n: (self.outstanding[n], n))

    def _to_prefill(self, req: SimRequest) -> None:
        name = self._least("p")
        self.outstanding[name] += 1
        self._prefill_of[req.rid] = name
        self.sim.dispatch(req, name, None, (req.arrival,))

    def on_arrival(self, req: SimRequest) -> None:
        self._to_prefill(req)

    def _done_prefill(self, req: SimRequest) -> None:
        name = self._prefill_of.pop(req.rid, None)
        if name is not None:
            self.outstanding[name] -= 1

    def _done_decode(self, req: SimRequest) -> None:
        name = self._decode_of.pop(req.rid, None)
        if name is not None:
            self.outstanding[name] -= 1

    def on_token(self, req: SimRequest) -> None:
        self._done_prefill(req)

    def decode_target(self, req: SimRequest) -> str:
        self._done_decode(req)
        name = self._least("d")
        self.outstanding[name] += 1
        self._decode_of[req.rid] = name
        return name

    def on_finish(self, req: SimRequest) -> None:
        self._done_prefill(req)
        self._done_decode(req)

    def on_failure_detected(self, name: str) -> None:
        self._dead.add(name)
        for req in self._lost_in_arrival_order():
            self._done_prefill(req)
            if req.state in (ORPHAN, TRANSFER) and req.prefill_inst not in self._dead:
                self.sim.redirect(req, self.decode_target(req))
            else:
                self._done_decode(req)
                self._to_prefill(req)


class Ours(SimPolicy):
    name = "ours"
    wants_reports = True

    def __init__(self, cfg: SchedulerConfig, max_tokens: int = 2048) -> None:
        self.cfg = cfg
        self.max_tokens = max_tokens

    def attach(self, sim: SimDataPlane) -> None:
        super().attach(sim)
        self.sched = GlobalScheduler(self.cfg, SimClock(sim.loop))
        self._synced: dict[str, int] = {}

    def on_arrival(self, req: SimRequest) -> None:
        desc = RequestDesc(RequestId(req.rid), TenantId(req.tenant), req.prompt_len,
                           max(self.max_tokens, req.out_len), req.hashes, req.arrival)
        self._apply(req, self.sched.submit(desc))

    def _apply(self, req: SimRequest, out: Placement | Refusal) -> None:
        if isinstance(out, Refusal):
            self.sim.refuse(req, out.reason.value)
            return
        for rid in out.preempt:
            victim = self.sim.requests[rid]
            self.sim.preempt(victim)
            self.sync_tokens([victim])  # its resume point is the tokens it streamed so far
        key = (out.priority.class_rank, out.priority.key_s, out.priority.seq)
        if out.kind is PlacementKind.REDIRECT and req.state not in (LOST,):
            req.key = key
            self.sim.redirect(req, out.decode_worker)
        else:
            self.sim.dispatch(req, out.prefill_worker, out.decode_worker, key)

    def decode_target(self, req: SimRequest) -> str:
        return req.decode_inst or ""

    def decode_cap(self, name: str) -> int | None:
        return self.sched.decode_batch_cap(WorkerName(name)) or None

    def local_chunk_tokens(self, name: str, rows: int, context: int, computed: int) -> int:
        return self.sched.local_chunk_tokens(WorkerName(name), rows, context, computed)

    def on_prefill_start(self, req: SimRequest) -> None:
        self.sched.on_stage(RequestId(req.rid), Stage.PREFILL_START)

    def on_token(self, req: SimRequest) -> None:
        self.sched.on_token(RequestId(req.rid))
        self._synced[req.rid] = req.generated

    def on_kv_delivered(self, req: SimRequest) -> None:
        self.sched.on_stage(RequestId(req.rid), Stage.KV_TRANSFER_DONE)

    def on_decode_admitted(self, req: SimRequest) -> None:
        self.sched.on_stage(RequestId(req.rid), Stage.DECODE_ADMITTED)

    def on_finish(self, req: SimRequest) -> None:
        self._synced.pop(req.rid, None)
        self.sched.on_finish(RequestId(req.rid), num_output_tokens=req.out_len)

    def sync_tokens(self, reqs: list[SimRequest]) -> None:
        # The ingress streamed these tokens and would have journaled each; the simulator only
        # reports decode tokens in bulk, at the moment the count matters.
        for req in reqs:
            delta = req.generated - self._synced.get(req.rid, 0)
            if delta > 0:
                self.sched.on_token(RequestId(req.rid), count=delta)
                self._synced[req.rid] = req.generated

    def on_report(self, load: WorkerReport) -> None:
        self.sched.on_report(load)

    def on_pool_report(self, added: tuple[int, ...], removed: tuple[int, ...]) -> None:
        self.sched.on_pool_report(added, removed)

    def holds_work(self, name: str) -> bool:
        # The journal keeps a request's prefill worker after the hand-off, and `on_worker_dead`
        # re-places (here: refuses) every request that names the worker, even one decoding fine
        # elsewhere: a drained prefill instance leaves only once those have finished.
        return bool(self.sched.journal.on_worker(WorkerName(name)))

    def on_instance_removed(self, name: str) -> None:
        # What the ingress does once a stopped replica is gone; the scheduler would also find it
        # silent after `heartbeat_timeout_s`. Nothing is on it, so nothing is re-placed.
        for out in self.sched.on_worker_dead(WorkerName(name)):
            self._apply(self.sim.requests[out.request_id], out)

    def on_tick(self) -> None:
        result = self.sched.poll()
        for refusal in result.expired:
            self.sim.refuse(self.sim.requests[refusal.request_id], refusal.reason.value)
        for out in result.recovered + result.resumed:
            self._apply(self.sim.requests[out.request_id], out)
