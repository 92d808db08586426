"""Tenants: who owns a request, what latency they were promised, and how much they may use.

Mental model: a tenant is configuration (`TenantConfig`, frozen: weight, SLO, budgets) plus a
little live state (`Tenant`: a token bucket, the number of requests in flight, running means of
request size and duration). Budgets are checked by `admission.py`; weights feed `fairness.py`;
the SLO feeds every deadline the scheduler computes.

Token-rate budget: a bucket refilled at `max_tokens_per_s` up to `burst_tokens`. A request takes
its prompt tokens when admitted and its generated tokens when it finishes, so the bucket may go
into debt; while in debt the tenant's next requests are refused with the time the refill needs as
retry-after. That meters what was really used without reserving `max_tokens` up front.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

from cluster.descriptors import SloClass, TenantId


@dataclass(frozen=True, slots=True)
class InteractiveSlo:
    """P99 targets: time to first token and mean time per output token after the first."""

    ttft_ms: float
    tpot_ms: float

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and self.tpot_ms > 0):
            raise ValueError(f"SLO targets must be positive, got ttft={self.ttft_ms} tpot={self.tpot_ms}")

    @property
    def slo_class(self) -> SloClass:
        return SloClass.INTERACTIVE


@dataclass(frozen=True, slots=True)
class BatchSlo:
    """Finish within `deadline_s` of arrival; no per-token promise."""

    deadline_s: float

    def __post_init__(self) -> None:
        if not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be positive, got {self.deadline_s}")

    @property
    def slo_class(self) -> SloClass:
        return SloClass.BATCH


Slo = InteractiveSlo | BatchSlo


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """One tenant's contract. `None` budgets mean unlimited.

    `burst_tokens` defaults to ten seconds of `max_tokens_per_s`. `queue_timeout_s` bounds how long
    a request may wait before its prefill starts; past it the request is cancelled and refused.
    `shed_predicted_misses`: a request predicted to miss its SLO is refused at admission (False:
    admitted anyway and served late, in slack order; only the queue timeout refuses it).
    """

    tenant_id: TenantId
    weight: float = 1.0
    slo: Slo = field(default_factory=lambda: InteractiveSlo(ttft_ms=1000.0, tpot_ms=50.0))
    max_tokens_per_s: float | None = None
    burst_tokens: float | None = None
    max_concurrency: int | None = None
    queue_timeout_s: float = 30.0
    shed_predicted_misses: bool = True

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"tenant {self.tenant_id}: weight must be positive, got {self.weight}")
        if self.max_tokens_per_s is not None and not self.max_tokens_per_s > 0:
            raise ValueError(f"tenant {self.tenant_id}: max_tokens_per_s must be positive")
        if self.burst_tokens is not None and not self.burst_tokens > 0:
            raise ValueError(f"tenant {self.tenant_id}: burst_tokens must be positive")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"tenant {self.tenant_id}: max_concurrency must be >= 1")
        if not self.queue_timeout_s > 0:
            raise ValueError(f"tenant {self.tenant_id}: queue_timeout_s must be positive")

    @property
    def slo_class(self) -> SloClass:
        return self.slo.slo_class


class TokenBucket:
    """Tokens refill continuously at `rate_per_s` up to `capacity`; `take` may drive it negative."""

    def __init__(self, rate_per_s: float, capacity: float, now: float) -> None:
        self.rate_per_s = rate_per_s
        self.capacity = capacity
        self._level = capacity
        self._t = now

    def level(self, now: float) -> float:
        if now > self._t:
            self._level = min(self.capacity, self._level + (now - self._t) * self.rate_per_s)
            self._t = now
        return self._level

    def wait_s(self, num_tokens: float, now: float) -> float:
        """Seconds until `num_tokens` are available: 0 if now, inf if more than the capacity."""
        if num_tokens > self.capacity:
            return math.inf
        missing = num_tokens - self.level(now)
        return 0.0 if missing <= 0 else missing / self.rate_per_s

    def take(self, num_tokens: float, now: float) -> None:
        self._level = self.level(now) - num_tokens


class Tenant:
    """A tenant's live state. Mutated only by the admission controller and the scheduler."""

    _EWMA = 0.1  # smoothing of the running means: ~the last ten requests dominate

    def __init__(self, cfg: TenantConfig, now: float = 0.0) -> None:
        self.cfg = cfg
        self.bucket: TokenBucket | None = None
        if cfg.max_tokens_per_s is not None:
            burst = cfg.burst_tokens if cfg.burst_tokens is not None else 10.0 * cfg.max_tokens_per_s
            self.bucket = TokenBucket(cfg.max_tokens_per_s, burst, now)
        self.num_in_flight = 0
        self.mean_output_tokens: float | None = None
        self.mean_duration_s: float | None = None

    @property
    def tenant_id(self) -> TenantId:
        return self.cfg.tenant_id

    def expected_output_tokens(self, max_tokens: int, default: int) -> int:
        """A guess at how many tokens a new request will generate: the tenant's running mean,
        or `default` before any finished, never above `max_tokens`."""
        guess = default if self.mean_output_tokens is None else math.ceil(self.mean_output_tokens)
        return max(1, min(max_tokens, guess))

    def observe_finish(self, num_output_tokens: int, duration_s: float) -> None:
        a = self._EWMA
        if self.mean_output_tokens is None:
            self.mean_output_tokens, self.mean_duration_s = float(num_output_tokens), duration_s
        else:
            self.mean_output_tokens += a * (num_output_tokens - self.mean_output_tokens)
            assert self.mean_duration_s is not None
            self.mean_duration_s += a * (duration_s - self.mean_duration_s)


class TenantRegistry:
    """Tenants by id. Unknown ids get `default` (if configured) under their own id, else None."""

    def __init__(self, configs: Iterable[TenantConfig], default: TenantConfig | None = None,
                 now: float = 0.0) -> None:
        self._tenants: dict[TenantId, Tenant] = {}
        self._default = default
        self._now = now
        for cfg in configs:
            if cfg.tenant_id in self._tenants:
                raise ValueError(f"tenant {cfg.tenant_id} configured twice")
            self._tenants[cfg.tenant_id] = Tenant(cfg, now)

    def get(self, tenant_id: TenantId, now: float | None = None) -> Tenant | None:
        tenant = self._tenants.get(tenant_id)
        if tenant is None and self._default is not None:
            cfg = replace(self._default, tenant_id=tenant_id)  # the default contract, every field of it
            tenant = self._tenants[tenant_id] = Tenant(cfg, self._now if now is None else now)
        return tenant

    def __iter__(self) -> Iterator[Tenant]:
        return iter(self._tenants.values())

    def __len__(self) -> int:
        return len(self._tenants)
