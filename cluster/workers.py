"""The scheduler's view of each worker: last report plus its own running accounts.

Mental model: reports arrive every few tens of milliseconds and are stale the moment they leave,
while the scheduler places requests far more often. So each `WorkerView` combines the last report
(health, free blocks, measured mean decode context) with bookkeeping the scheduler updates on
every decision and event:
- prefill side: `backlog_s[rank]`, the predicted compute seconds of prefills placed there and not
  yet done, per SLO class rank (interactive work waits only for interactive work ahead of it),
  and `ttft_bias_s`, how late first tokens came versus prediction (what the sum of compute times
  misses: a request finishes with the whole engine step it shares with others, report staleness),
  and `pool_fetch_s_per_block`, what one block from the shared prefix pool takes to arrive there;
- decode side: requests committed (placed, still prefilling elsewhere) and active (transferring or
  decoding), their KV blocks, the multiset of active TPOT targets (`MinTracker`) and the running
  batch-class requests that may be preempted (`VictimQueue`).
Everything is O(1) or O(log n) per update.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from cluster.cost_model import CostModelBank, StepTimeModel
from cluster.descriptors import RequestId, StepSample, WorkerKind, WorkerReport, WorkerName
from cluster.ordering import MinTracker, VictimQueue


@dataclass(slots=True)
class WorkerView:
    """Accounts of one worker. Counters never go negative (asserted by `check_integrity`)."""

    name: WorkerName
    kind: WorkerKind
    max_num_seqs: int
    model: StepTimeModel
    healthy: bool = True
    last_report_s: float = 0.0
    block_size: int = 16
    num_total_blocks: int = 0
    reported_free_blocks: int = 0
    blocks_since_report: int = 0  # blocks of requests activated after the last report
    mean_context_tokens: float | None = None  # per decode row, from measured steps
    backlog_s: list[float] = field(default_factory=lambda: [0.0, 0.0])
    ttft_bias_s: float = 0.0  # running mean of (actual - predicted) first-token time here
    num_prefill_queued: int = 0
    num_committed: int = 0  # decode side: placed here, prefill still running elsewhere
    num_active: int = 0  # decode side: transferring or decoding here
    active_blocks: int = 0
    committed_blocks: int = 0
    active_context_tokens: int = 0
    tpot_targets: MinTracker = field(default_factory=MinTracker)
    victims: VictimQueue[RequestId] = field(default_factory=VictimQueue)
    # Output tokens per decode row-step, measured over every decode row-step, speculating or not:
    # (rows + accepted drafts) / rows (speculative decoding), 1 where the worker does not speculate
    # or does not report its decode rows. Its predicted TPOT is its step time over this.
    # `spec_counters`: the last report's cumulative (decode rows, accepted).
    tokens_per_step: float = 1.0
    spec_counters: tuple[int, int] | None = None
    # Seconds to fetch one block from the shared prefix pool here, as the worker last measured it
    # (`WorkerReport.pool_fetch_s_per_block`); None: not measured, placement uses its constant.
    pool_fetch_s_per_block: float | None = None

    def apply_report(self, load: WorkerReport, now: float) -> None:
        self.healthy = load.healthy
        self.last_report_s = now
        self.block_size = load.block_size
        self.num_total_blocks = load.num_total_blocks
        self.reported_free_blocks = load.num_free_blocks
        self.blocks_since_report = 0
        self.pool_fetch_s_per_block = load.pool_fetch_s_per_block  # already smoothed by the worker
        self.observe_steps(load.steps)
        self.observe_speculation(load.num_decode_rows, load.num_accepted_tokens)

    def observe_steps(self, steps: tuple[StepSample, ...]) -> None:
        """Measured steps: the mean context per decode row (what a new row's step will read)."""
        rows = sum(s.num_decode_seqs for s in steps)
        if rows:
            measured = sum(s.num_context_tokens for s in steps) / rows
            m = self.mean_context_tokens
            self.mean_context_tokens = measured if m is None else 0.5 * m + 0.5 * measured

    def observe_speculation(self, num_rows: int | None, num_accepted: int) -> None:
        """Cumulative counters of a report: the decode rows (row-steps, speculating or not) and
        acceptances since the last report give (rows + accepted) / rows, smoothed like the context
        per row (the first rows seen count as measured). Counters that went back mean a restarted
        worker: they count from 0. A report without decode rows (None or 0: a worker that does not
        count them) prices the worker at 1 token per row-step."""
        if not num_rows:
            self.spec_counters, self.tokens_per_step = None, 1.0
            return
        last, self.spec_counters = self.spec_counters, (num_rows, num_accepted)
        first = last is None
        if last is None or num_rows < last[0] or num_accepted < last[1]:
            last = (0, 0)
        rows = num_rows - last[0]
        if rows > 0:
            measured = 1.0 + (num_accepted - last[1]) / rows
            self.tokens_per_step = measured if first else 0.5 * self.tokens_per_step + 0.5 * measured

    def free_blocks(self) -> int:
        """Free KV blocks now: the report minus what was activated since, and never more than the
        pool minus the scheduler's own count of active requests' blocks."""
        by_report = self.reported_free_blocks - self.blocks_since_report
        by_accounts = self.num_total_blocks - self.active_blocks
        return max(0, min(by_report, by_accounts))

    def learn_ttft_error(self, error_s: float, weight: float = 0.05) -> None:
        self.ttft_bias_s += weight * (error_s - self.ttft_bias_s)

    def context_per_row(self, fallback: float) -> float:
        if self.mean_context_tokens is not None:
            return self.mean_context_tokens
        return self.active_context_tokens / self.num_active if self.num_active else fallback

    def check_integrity(self) -> None:
        assert min(self.backlog_s) >= -1e-6, f"{self.name}: negative backlog {self.backlog_s}"
        for name in ("num_prefill_queued", "num_committed", "num_active", "active_blocks",
                     "committed_blocks", "active_context_tokens"):
            assert getattr(self, name) >= 0, f"{self.name}: {name} is negative"
        assert len(self.tpot_targets) <= self.num_active, f"{self.name}: more TPOT targets than rows"


class WorkerRegistry:
    """Views by name, with the healthy prefill-capable and decode-capable ones kept as lists
    (rebuilt only when membership or health changes, not per decision)."""

    def __init__(self, default_max_num_seqs: int, models: CostModelBank) -> None:
        self.default_max_num_seqs = default_max_num_seqs
        self.models = models
        self._views: dict[WorkerName, WorkerView] = {}
        self.prefill: list[WorkerView] = []
        self.decode: list[WorkerView] = []

    def _rebuild(self) -> None:
        views = sorted(self._views.values(), key=lambda v: v.name)
        self.prefill = [v for v in views if v.healthy and v.kind.serves_prefill]
        self.decode = [v for v in views if v.healthy and v.kind.serves_decode]

    def get(self, name: WorkerName) -> WorkerView | None:
        return self._views.get(name)

    def upsert(self, load: WorkerReport, now: float) -> WorkerView:
        view = self._views.get(load.name)
        changed = view is None or view.healthy != load.healthy or view.kind != load.kind
        if view is None:
            view = self._views[load.name] = WorkerView(load.name, load.kind, self.default_max_num_seqs,
                                                       self.models.get(load.name, load.kind.value))
        view.kind = load.kind
        view.apply_report(load, now)
        if changed:
            self._rebuild()
        return view

    def mark_dead(self, name: WorkerName) -> WorkerView | None:
        view = self._views.pop(name, None)
        self._rebuild()
        return view

    def stale(self, now: float, timeout_s: float) -> list[WorkerName]:
        """Workers whose last report is older than `timeout_s` (missed heartbeats)."""
        return [v.name for v in self._views.values() if now - v.last_report_s > timeout_s]

    def __iter__(self) -> Iterator[WorkerView]:
        return iter(list(self._views.values()))

    def __len__(self) -> int:
        return len(self._views)
