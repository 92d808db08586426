"""The simulated cluster: instances, KV transfers, the prefix pool, reports and failures.

Mental model: `SimCluster` is the data plane's physics and the router is the control plane.
Arrivals go to `router.on_arrival`, which calls back `dispatch` (or `refuse`); instances call
`start_prefill` / `finish_prefill` / `decode_admitted` / `finish` as steps end; the cluster moves
KV between instances, emits tokens, and tells the router what happened in the same vocabulary
the real data plane would use. Every `report_interval_s` alive instances report their load
(`WorkerReport`, with measured step samples and prefix-cache deltas); a dead instance simply stops
reporting, so a scheduler notices it by missed heartbeats. Baseline routers, which read no
reports, are told of a death after the same heartbeat timeout. Instances may join and leave during
a run (`add_instance`; `drain`, then `remove_instance` once `holds_work` is False): a draining
instance reports itself unhealthy, so the scheduler places nothing new there, and finishes what it
holds; `autoscale.py` drives these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bench.sim.cache import BlockCache
from bench.sim.colocated import ColocatedInstance
from bench.sim.events import EventLoop
from bench.sim.hardware import NetworkSpec, RooflineCost, StepCost
from bench.sim.instances import DecodeInstance, PrefillInstance
from bench.sim.request import (CANCELLED, DECODE_WAIT, DECODING, DONE, LOST, ORPHAN, PREEMPTED, PREFILLING,
                               QUEUED, REFUSED, TRANSFER, SimRequest)
from cluster.descriptors import WorkerKind, WorkerReport, WorkerName

if TYPE_CHECKING:
    from bench.sim.contracts import SimEngine
    from bench.sim.policies import SimPolicy

Instance = PrefillInstance | DecodeInstance | ColocatedInstance
# States in which a request still needs the instance it names (its KV lives there or goes there).
_HELD_BY_PREFILL = (QUEUED, PREFILLING, TRANSFER, ORPHAN)
_HELD_BY_DECODE = (QUEUED, PREFILLING, TRANSFER, DECODE_WAIT, DECODING)


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """Shape of the simulated cluster. `num_colocated` > 0 builds a colocated cluster instead of
    prefill + decode instances. `hash_block_tokens`: tokens per prefix hash block (512 for
    Mooncake). `failures`: (time_s, target) pairs, the target an instance name or "p" / "d" / "c"
    for the busiest alive prefill / decode / colocated instance at that moment."""

    num_prefill: int = 16
    num_decode: int = 16
    num_colocated: int = 0
    prefill_token_budget: int = 8192
    colocated_token_budget: int = 8192
    max_num_seqs: int = 1024
    kv_block_tokens: int = 16
    hash_block_tokens: int = 512
    prefix_cache_fraction: float = 0.8
    pool_capacity_tokens: int = 8_000_000
    use_pool: bool = True
    report_interval_s: float = 0.1
    heartbeat_timeout_s: float = 1.0
    failures: tuple[tuple[float, str], ...] = ()
    network: NetworkSpec = field(default_factory=NetworkSpec)


@dataclass(slots=True)
class FailureRecord:
    name: str
    t_fail: float
    affected: list[SimRequest]


class SimCluster:
    def __init__(self, spec: ClusterSpec, router: SimPolicy, cost: StepCost | None = None,
                 kv_bytes_per_token: int = 131072, kv_capacity_tokens: int | None = None) -> None:
        self.spec, self.router = spec, router
        self.cost = cost or RooflineCost()
        self.loop = EventLoop()
        self.kv_bytes = kv_bytes_per_token
        kv_tokens = kv_capacity_tokens or RooflineCost().kv_capacity_tokens()
        kv_blocks = kv_tokens // spec.kv_block_tokens
        cache_blocks = int(kv_tokens * spec.prefix_cache_fraction) // spec.hash_block_tokens
        self.pool = (BlockCache(spec.pool_capacity_tokens // spec.hash_block_tokens, track_deltas=True)
                     if spec.use_pool and not spec.num_colocated else None)
        self.fetch_s_per_block = spec.hash_block_tokens * kv_bytes_per_token / spec.network.pool_bytes_per_s
        self._kv_blocks, self._cache_blocks = kv_blocks, cache_blocks
        self.instances: dict[str, Instance] = {}
        self.draining: set[str] = set()  # still serving what they hold, reported unhealthy: no new work
        counts = {"c": spec.num_colocated} if spec.num_colocated else {"p": spec.num_prefill, "d": spec.num_decode}
        self._num_built = dict.fromkeys(counts, 0)  # names are never reused within a run
        for kind, n in counts.items():
            for _ in range(n):
                self._build(kind)
        self.failures: list[FailureRecord] = []
        self.requests: dict[str, SimRequest] = {}
        self._pending = [0]

    def _build(self, kind: str) -> str:
        name = f"{kind}{self._num_built[kind]}"
        self._num_built[kind] += 1
        spec = self.spec
        if kind == "c":
            self.instances[name] = ColocatedInstance(name, self.cost, self, self._kv_blocks, spec.kv_block_tokens,
                                                     self._cache_blocks, spec.colocated_token_budget,
                                                     spec.max_num_seqs)
        elif kind == "p":
            self.instances[name] = PrefillInstance(name, self.cost, self, self._cache_blocks,
                                                   spec.prefill_token_budget)
        else:
            self.instances[name] = DecodeInstance(name, self.cost, self, self._kv_blocks, spec.kv_block_tokens,
                                                  self._cap_fn(name), self._cache_blocks, self._chunk_fn(name),
                                                  spec.max_num_seqs)
        return name

    def _cap_fn(self, name: str) -> Callable[[], int]:
        limit = self.spec.max_num_seqs
        return lambda: min(limit, self.router.decode_cap(name) or limit)

    def _chunk_fn(self, name: str) -> Callable[[int, int, int], int]:
        return lambda rows, ctx, done: self.router.local_chunk_tokens(name, rows, ctx, done)

    # ---- running --------------------------------------------------------------------------

    def run(self, requests: list[SimRequest], drain_s: float = 120.0) -> None:
        self.requests = {r.rid: r for r in requests}
        self.router.attach(self)
        end = (requests[-1].arrival if requests else 0.0) + drain_s
        self.loop.at(0.0, self._tick, end)  # first, so the scheduler has its reports at t = 0
        for r in requests:
            self.loop.at(r.arrival, self.router.on_arrival, r)
        for t, name in self.spec.failures:
            self.loop.at(t, self._fail, name)
        pending = [len(requests)]
        self._pending = pending
        self.loop.run(end, stop=lambda: pending[0] == 0)

    @property
    def num_pending(self) -> int:
        """Requests of the run not finished, refused or cancelled yet."""
        return self._pending[0]

    def _settle(self, req: SimRequest) -> None:
        self._pending[0] -= 1

    def _tick(self, end: float) -> None:
        if self.router.wants_reports:
            for inst in self.instances.values():
                if not inst.dead:
                    self.router.on_report(self._report(inst))
            if self.pool is not None:
                added, removed = self.pool.take_deltas()
                if added or removed:
                    self.router.on_pool_report(added, removed)
        self.router.on_tick()
        if self.loop.now + self.spec.report_interval_s <= end and self._pending[0] > 0:
            self.loop.after(self.spec.report_interval_s, self._tick, end)

    def _report(self, inst: Instance) -> WorkerReport:
        running, waiting = inst.load()
        added, removed = inst.cache.take_deltas()
        if isinstance(inst, PrefillInstance):
            kind, free, total = WorkerKind.PREFILL, 0, 0
        else:
            kind = WorkerKind.DECODE if isinstance(inst, DecodeInstance) else WorkerKind.COLOCATED
            total, free = inst.dec.kv_blocks, inst.dec.kv_blocks - inst.dec.used_blocks
        steps, inst.samples = tuple(inst.samples), []
        return WorkerReport(WorkerName(inst.name), kind, running, waiting, max(0, free), total,
                          self.spec.kv_block_tokens, inst.name not in self.draining, self.loop.now, steps, added,
                          removed)

    # ---- instances joining and leaving (autoscaling) ----------------------------------------

    def add_instance(self, kind: str) -> str:
        """A new "p" / "d" / "c" instance, serving now (its node and replica start are the caller's
        to wait for); the router learns of it from its reports, as of a new worker."""
        name = self._build(kind)
        self.router.on_instance_added(name)
        return name

    def drain(self, name: str) -> None:
        """From now on `name` reports itself unhealthy, so no new work is placed on it; what it
        holds runs to the end. `remove_instance` once `holds_work` is False."""
        assert name in self.instances and not self.instances[name].dead, name
        self.draining.add(name)

    def holds_work(self, name: str) -> bool:
        """Whether removing `name` now would lose a request: one queued, prefilling or decoding
        there, its KV on the way from or to it (or held for a resend), placed to decode there, or
        one the router still counts there."""
        inst = self.instances[name]
        if inst.busy or any(inst.load()) or self.router.holds_work(name):
            return True
        for req in self.requests.values():
            if req.state in _HELD_BY_PREFILL and req.prefill_inst == name:
                return True
            if req.state in _HELD_BY_DECODE and req.decode_inst == name:
                return True
        return False

    def remove_instance(self, name: str) -> None:
        """Take an idle instance away (its node is given back); the router is told at once."""
        assert not self.holds_work(name), f"{name} still holds work"
        del self.instances[name]
        self.draining.discard(name)
        self.router.on_instance_removed(name)

    # ---- the router's commands --------------------------------------------------------------

    def dispatch(self, req: SimRequest, prefill: str, decode: str | None, key: tuple) -> None:
        """Queue `req`'s prefill (of prompt + tokens generated so far) on `prefill`; its KV then
        goes to `decode` (or wherever `router.decode_target` says when prefill ends)."""
        req.state, req.prefill_inst, req.decode_inst, req.key = QUEUED, prefill, decode, key
        req.reset_prefill()
        inst = self.instances[prefill]
        if inst.dead:
            self._lose(req, self.loop.now)
        else:
            inst.enqueue(req)  # type: ignore[union-attr]

    def redirect(self, req: SimRequest, decode: str) -> None:
        """Change where `req`'s KV goes; an orphaned KV (sent to a dead decoder) is sent again."""
        req.decode_inst = decode
        if req.state == ORPHAN:
            self._transfer(req)

    def refuse(self, req: SimRequest, reason: str) -> None:
        if req.state in (DONE, REFUSED, CANCELLED):
            return
        req.state, req.refusal = REFUSED if req.first_token_t is None else CANCELLED, reason
        inst = self.instances.get(req.prefill_inst or "")
        if inst is not None and not isinstance(inst, PrefillInstance):
            inst.release_blocks(req)
        self._settle(req)

    def preempt(self, req: SimRequest) -> None:
        inst = self.instances.get(req.decode_inst or "")
        if req.state in (QUEUED, PREFILLING, TRANSFER, DECODE_WAIT) or (inst and inst.preempt(req)):
            req.state = PREEMPTED

    # ---- physics callbacks ------------------------------------------------------------------

    def start_prefill(self, req: SimRequest, inst: SimEngine) -> float:
        """Prefix lookup for a request starting prefill on `inst`; returns the pool fetch time.
        Only prefill instances fetch from the pool (an engine decoding its own prefills looks up
        its own cache, as the data plane's decode worker does)."""
        bt = self.spec.hash_block_tokens
        local = inst.cache.longest_prefix(req.hashes)
        pool = self.pool.longest_prefix(req.hashes) if self.pool is not None and isinstance(inst, PrefillInstance) else 0
        hit = max(local, pool)
        total = req.prompt_len + req.generated
        req.pf_cached = min(hit * bt, total - 1)
        req.num_cached_tokens += req.pf_cached
        req.pf_total, req.pf_done, req.pf_started = total - req.pf_cached, 0, True
        req.state = PREFILLING
        self.router.on_prefill_start(req)
        return (pool - local) * self.fetch_s_per_block if pool > local else 0.0

    def finish_prefill(self, req: SimRequest, inst: SimEngine) -> bool:
        """Prefill ended: its last logits give the next token. True if the request decodes on
        `inst` (colocated, or a decode instance's own prefill) from here."""
        now = self.loop.now
        inst.cache.insert(req.hashes)
        if self.pool is not None and isinstance(inst, PrefillInstance):
            self.pool.insert(req.hashes)
        self._emit(req, now)
        if req.generated >= req.out_len:
            self.finish(req)
            return False
        if not isinstance(inst, PrefillInstance):
            return True
        req.decode_inst = self.router.decode_target(req)
        self._transfer(req)
        return False

    def _emit(self, req: SimRequest, now: float) -> None:
        req.generated += 1
        if req.first_token_t is None:
            req.first_token_t = now
        if req.affected_at is not None and req.resume_t is None:
            req.resume_t = now
        self.router.on_token(req)

    def _transfer(self, req: SimRequest) -> None:
        req.state = TRANSFER
        net = self.spec.network
        dt = net.transfer_latency_s + (req.prompt_len + req.generated) * self.kv_bytes / net.link_bytes_per_s
        self.loop.after(dt, self._delivered, req, req.epoch)

    def _delivered(self, req: SimRequest, epoch: int) -> None:
        if req.epoch != epoch or req.state != TRANSFER:
            return
        prefill = self.instances.get(req.prefill_inst or "")
        if prefill is not None and prefill.dead:
            self._lose(req, self.loop.now)  # the sender died mid-transfer: the KV is gone
            return
        inst = self.instances[req.decode_inst or ""]
        if inst.dead:
            req.state = ORPHAN  # the prefill side still holds the KV; the router must redirect
            if req.affected_at is None:
                req.affected_at = self.loop.now
            return
        self.router.on_kv_delivered(req)
        inst.arrive(req)  # type: ignore[union-attr]

    def decode_admitted(self, req: SimRequest, inst: SimEngine) -> None:
        self.router.on_decode_admitted(req)

    def first_decode_token(self, req: SimRequest) -> None:
        if req.affected_at is not None and req.resume_t is None:
            req.resume_t = self.loop.now

    def finish(self, req: SimRequest) -> None:
        req.state, req.finish_t = DONE, self.loop.now
        self.router.on_finish(req)
        self._settle(req)

    # ---- failures -----------------------------------------------------------------------------

    def _lose(self, req: SimRequest, now: float) -> None:
        req.state, req.epoch = LOST, req.epoch + 1
        req.num_losses += 1
        if req.affected_at is None:
            req.affected_at = now
        req.resume_t = None

    def _busiest(self, kind: str) -> str:
        """The alive instance of `kind` ("p", "d" or "c" prefix) with the most requests on it."""
        alive = [n for n, i in self.instances.items() if n.startswith(kind) and not i.dead]
        return max(alive, key=lambda n: (sum(self.instances[n].load()), n))

    def _fail(self, target: str) -> None:
        name = self._busiest(target) if target in ("p", "d", "c") else target
        inst = self.instances[name]
        now = self.loop.now
        lost = inst.kill()
        for req in lost:
            self._lose(req, now)
        # KV in flight from a dead prefill instance is lost with it.
        if isinstance(inst, PrefillInstance):
            for req in self.requests.values():
                if req.state == TRANSFER and req.prefill_inst == name:
                    self._lose(req, now)
                    lost.append(req)
        self.router.sync_tokens(lost)
        self.failures.append(FailureRecord(name, now, lost))
        self.loop.after(self.spec.heartbeat_timeout_s, self.router.on_failure_detected, name)
