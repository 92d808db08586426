"""Scaling advice: how many prefill and decode workers the measured slack asks for.

Mental model: each role has a pressure, 1.0 meaning "at its SLO limit now":
- prefill: the queued interactive prefill work a new request would wait behind on the least
  loaded prefill worker (its backlog plus how late its first tokens came), over the tightest
  interactive TTFT target;
- decode: the larger of the decode rows in use over the rows there are, and the slowest decode
  worker's predicted step at its current rows over the tightest TPOT target of the rows it runs.
`ScaleAdvisor` turns a role's pressure into a replica count with hysteresis: one more worker once
the pressure has stayed at or above `up_at` for `up_delay_s`; one fewer once the pressure the
remaining workers would carry (pressure x n / (n - 1)) has stayed at or below `down_at` for
`down_delay_s`; never outside [min, max]. A role that is idle goes down to its minimum the same way.
A role none of whose workers reads healthy now (their load calls time out on a loaded box, or all
died) has no pressure to go on: its target holds (an empty role's 0 once scaled decode down mid-burst).
With `join_wait_s` > 0, never down while the worker it last added has not joined yet (a replica
starts in tens of seconds, its node in more), unless it has not joined for `join_wait_s`: the
pressure of the workers there are says nothing about the one still coming, and stopping it mid-start
wastes the start.
Deterministic: the caller passes the time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.workers import WorkerRegistry


@dataclass(frozen=True, slots=True)
class RoleBounds:
    min_replicas: int = 1
    max_replicas: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {self.min_replicas}, {self.max_replicas}")


@dataclass(frozen=True, slots=True)
class ScalingConfig:
    prefill: RoleBounds = field(default_factory=RoleBounds)
    decode: RoleBounds = field(default_factory=RoleBounds)
    up_at: float = 0.8
    down_at: float = 0.5
    up_delay_s: float = 2.0
    down_delay_s: float = 30.0
    # The most a scale-down waits for the worker last added to join; 0 (the default): it does not wait.
    # Off by default: where the scheduler's count of healthy workers lags (a loaded worker's load call
    # timing out reads unhealthy), a wait blocked test_serve_scaling's scale-down in a clean-clone run.
    join_wait_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.down_at < self.up_at:
            raise ValueError("need 0 < down_at < up_at")
        if min(self.up_delay_s, self.down_delay_s) < 0:
            raise ValueError("delays must be >= 0")


@dataclass(frozen=True, slots=True)
class ScaleAdvice:
    """Recommended replica counts, with the pressures they come from (for operators and benches)."""

    prefill: int
    decode: int
    prefill_pressure: float
    decode_pressure: float
    num_prefill: int  # healthy workers the scheduler sees now
    num_decode: int

    def of(self, role: str) -> tuple[int, float, int]:
        """(replicas, pressure, healthy workers) of `role` ("prefill" or "decode")."""
        if role == "prefill":
            return self.prefill, self.prefill_pressure, self.num_prefill
        return self.decode, self.decode_pressure, self.num_decode


class _Role:
    def __init__(self, bounds: RoleBounds) -> None:
        self.bounds = bounds
        self.target: int | None = None
        self._high_since: float | None = None
        self._low_since: float | None = None
        self._raised_at = float("-inf")  # when the target last went up

    def advise(self, current: int, pressure: float, cfg: ScalingConfig, now: float) -> int:
        b = self.bounds
        if self.target is None:
            if current == 0:  # no worker has reported yet: nothing to go on
                return b.min_replicas
            self.target = min(max(current, b.min_replicas), b.max_replicas)
        n = self.target
        if current == 0:  # every worker of the role reads down (slow load calls on a loaded box, or
            # all dead): their pressure of 0 says nothing, so hold the target and restart both delays
            self._high_since = self._low_since = None
            return n
        high = pressure >= cfg.up_at
        low = pressure * n / max(n - 1, 1) <= cfg.down_at  # what the others would carry without one
        self._high_since = (self._high_since if self._high_since is not None else now) if high else None
        self._low_since = (self._low_since if self._low_since is not None else now) if low else None
        joined = current >= n or now - self._raised_at >= cfg.join_wait_s
        if high and n < b.max_replicas and now - self._high_since >= cfg.up_delay_s and current >= n:
            self.target, self._high_since = n + 1, None  # one at a time, once the last one has joined
            self._raised_at = now
        elif low and n > b.min_replicas and now - self._low_since >= cfg.down_delay_s and joined:
            self.target, self._low_since = n - 1, None
        elif n < b.min_replicas or n > b.max_replicas:
            self.target = min(max(n, b.min_replicas), b.max_replicas)
        return self.target


class ScaleAdvisor:
    def __init__(self, cfg: ScalingConfig) -> None:
        self.cfg = cfg
        self._prefill = _Role(cfg.prefill)
        self._decode = _Role(cfg.decode)

    def advise(self, now: float, num_prefill: int, prefill_pressure: float, num_decode: int,
               decode_pressure: float) -> ScaleAdvice:
        return ScaleAdvice(self._prefill.advise(num_prefill, prefill_pressure, self.cfg, now),
                           self._decode.advise(num_decode, decode_pressure, self.cfg, now),
                           prefill_pressure, decode_pressure, num_prefill, num_decode)


def prefill_pressure(workers: WorkerRegistry, ttft_target_s: float) -> float:
    """Queued interactive prefill seconds ahead of a new request on the least loaded prefill
    worker, over the tightest TTFT target (0 without prefill workers)."""
    waits = [max(0.0, v.backlog_s[0] + v.ttft_bias_s) for v in workers.prefill]
    return min(waits) / ttft_target_s if waits else 0.0


def decode_pressure(workers: WorkerRegistry) -> float:
    """The larger of rows in use over rows, and the slowest predicted TPOT (step time over measured
    tokens per step) over its rows' tightest TPOT target (0 without decode workers)."""
    views = workers.decode
    if not views:
        return 0.0
    rows = sum(v.num_active + v.num_committed for v in views) / max(1, sum(v.max_num_seqs for v in views))
    steps = 0.0
    for v in views:
        tight = v.tpot_targets.min()
        if tight and v.num_active:
            step = v.model.predict_decode_step(v.num_active, int(v.context_per_row(0.0) * v.num_active))
            steps = max(steps, step / v.tokens_per_step / tight)  # speculation: tokens per step > 1
    return max(rows, steps)
