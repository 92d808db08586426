"""Admission: say no early, with a reason and a time to come back, instead of queueing forever.

Mental model: every submitted request passes two gates before it is placed.
1. Budget (cheap, no prediction): the tenant is known, the request fits the model, the tenant is
   under its concurrency limit and its token bucket holds the prompt.
2. SLO (after placement has predicted the best worker): an interactive request whose predicted
   TTFT exceeds `slo_refuse_factor` x its target, or whose decode side would break its TPOT target,
   and a batch request predicted to finish after its deadline are refused: a late answer would
   burn capacity that requests still able to make their promise need.
Each refusal carries a `RefusalReason` and a retry-after (None when retrying cannot help), which
the HTTP layer maps to 429 / 413 / 503. Admitted requests that still wait too long are cancelled
by the scheduler's queue timeouts with `RefusalReason.QUEUE_TIMEOUT`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from cluster.descriptors import RequestDesc, RequestId
from cluster.tenants import InteractiveSlo, Tenant


class RefusalReason(str, enum.Enum):
    UNKNOWN_TENANT = "unknown_tenant"
    REQUEST_TOO_LARGE = "request_too_large"
    TOKEN_RATE = "token_rate"
    CONCURRENCY = "concurrency"
    SLO_UNATTAINABLE = "slo_unattainable"
    NO_HEALTHY_WORKER = "no_healthy_worker"
    QUEUE_TIMEOUT = "queue_timeout"

    @property
    def http_status(self) -> int:
        if self is RefusalReason.UNKNOWN_TENANT:
            return 403
        if self is RefusalReason.REQUEST_TOO_LARGE:
            return 413
        if self is RefusalReason.NO_HEALTHY_WORKER:
            return 503
        return 429


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request the cluster will not serve now. `retry_after_s=None`: retrying will not help.
    `predicted_wait_s`: an SLO refusal's predicted wait before the request would start (its
    queue), which with the prediction in `detail` tells a client why waiting was not offered."""

    request_id: RequestId
    reason: RefusalReason
    retry_after_s: float | None
    detail: str = ""
    predicted_wait_s: float | None = None


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """`slo_refuse_factor` (>= 1): refuse when the prediction exceeds the target times this. At 1.0
    (the default) a request predicted to miss at all is refused: the admitted ones keep their
    promise and the cluster's goodput is what it serves on time; above 1.0 admission gambles on
    predictions being pessimistic. Retry-after hints are clamped to [min_retry_after_s,
    max_retry_after_s]."""

    max_model_len: int = 131072
    slo_refuse_factor: float = 1.0
    min_retry_after_s: float = 0.05
    max_retry_after_s: float = 60.0
    default_concurrency_retry_s: float = 1.0

    def __post_init__(self) -> None:
        if self.slo_refuse_factor < 1.0:
            raise ValueError(f"slo_refuse_factor must be >= 1, got {self.slo_refuse_factor}")
        if not 0 < self.min_retry_after_s <= self.max_retry_after_s:
            raise ValueError("need 0 < min_retry_after_s <= max_retry_after_s")


@dataclass(frozen=True, slots=True)
class SloPrediction:
    """What placement predicts for a request on its best workers (seconds from now). `alone_*`:
    the same on those workers with nothing else to do (no queue ahead, its row alone), the best
    the system could ever do for it."""

    ttft_s: float
    tpot_s: float
    completion_s: float
    queue_wait_s: float
    alone_ttft_s: float = 0.0
    alone_tpot_s: float = 0.0


class AdmissionController:
    """Budget and SLO gates. `check_*` are queries (no state change); `admit`/`release` commit."""

    def __init__(self, cfg: AdmissionConfig) -> None:
        self.cfg = cfg

    def _clamp(self, retry_s: float) -> float:
        return min(self.cfg.max_retry_after_s, max(self.cfg.min_retry_after_s, retry_s))

    def check_budget(self, tenant: Tenant | None, req: RequestDesc, now: float) -> Refusal | None:
        rid = req.request_id
        if tenant is None:
            return Refusal(rid, RefusalReason.UNKNOWN_TENANT, None, f"unknown tenant {req.tenant!r}")
        if req.num_prompt_tokens + req.max_tokens > self.cfg.max_model_len:
            return Refusal(rid, RefusalReason.REQUEST_TOO_LARGE, None,
                           f"prompt {req.num_prompt_tokens} + max_tokens {req.max_tokens} exceeds "
                           f"the model's {self.cfg.max_model_len} tokens")
        cfg = tenant.cfg
        if cfg.max_concurrency is not None and tenant.num_in_flight >= cfg.max_concurrency:
            # One slot frees, on average, every mean_duration / concurrency seconds.
            per_slot = (tenant.mean_duration_s / cfg.max_concurrency if tenant.mean_duration_s
                        else self.cfg.default_concurrency_retry_s)
            return Refusal(rid, RefusalReason.CONCURRENCY, self._clamp(per_slot),
                           f"tenant {cfg.tenant_id} has {tenant.num_in_flight} requests in flight "
                           f"(limit {cfg.max_concurrency})")
        if tenant.bucket is not None:
            wait = tenant.bucket.wait_s(req.num_prompt_tokens, now)
            if math.isinf(wait):
                return Refusal(rid, RefusalReason.REQUEST_TOO_LARGE, None,
                               f"prompt of {req.num_prompt_tokens} tokens exceeds tenant "
                               f"{cfg.tenant_id}'s burst of {tenant.bucket.capacity:.0f} tokens")
            if wait > 0:
                return Refusal(rid, RefusalReason.TOKEN_RATE, self._clamp(wait),
                               f"tenant {cfg.tenant_id} is over its {cfg.max_tokens_per_s:g} tokens/s")
        return None

    def check_slo(self, tenant: Tenant, req: RequestDesc, pred: SloPrediction) -> Refusal | None:
        """Refuse when the best placement still misses the SLO by more than the tolerated factor
        because of the load: a request that would miss it even alone (`alone_*`) is admitted, since
        refusing it frees nothing it would take from others now and no retry can do better (and
        on a cold or mis-fitted step-time model, refusing every request would also starve the model
        of the steps that correct it). The retry-after is the predicted excess: roughly when the
        backlog ahead will have drained."""
        slo = tenant.cfg.slo
        f = self.cfg.slo_refuse_factor
        rid = req.request_id
        if req.slo_class is not None and req.slo_class is not slo.slo_class:
            return None  # a per-request class override has no targets of its own to check
        if not tenant.cfg.shed_predicted_misses:
            return None  # its contract says wait: served late rather than refused
        if isinstance(slo, InteractiveSlo):
            ttft_target = slo.ttft_ms / 1e3
            tpot_target = slo.tpot_ms / 1e3
            if pred.ttft_s > f * ttft_target and pred.alone_ttft_s <= f * ttft_target:
                return Refusal(rid, RefusalReason.SLO_UNATTAINABLE,
                               self._clamp(pred.ttft_s - ttft_target),
                               f"predicted TTFT {pred.ttft_s * 1e3:.0f} ms (after {pred.queue_wait_s * 1e3:.0f} ms "
                               f"queued) > target {slo.ttft_ms:.0f} ms", pred.queue_wait_s)
            if pred.tpot_s > f * tpot_target and pred.alone_tpot_s <= f * tpot_target:
                return Refusal(rid, RefusalReason.SLO_UNATTAINABLE, self._clamp(pred.queue_wait_s),
                               f"predicted TPOT {pred.tpot_s * 1e3:.1f} ms > target {slo.tpot_ms:.0f} ms",
                               pred.queue_wait_s)
            return None
        deadline = slo.deadline_s
        if pred.completion_s > f * deadline:
            return Refusal(rid, RefusalReason.SLO_UNATTAINABLE, self._clamp(pred.completion_s - deadline),
                           f"predicted completion {pred.completion_s:.1f} s > deadline {deadline:.1f} s",
                           pred.queue_wait_s)
        return None

    def admit(self, tenant: Tenant, req: RequestDesc, now: float) -> None:
        tenant.num_in_flight += 1
        if tenant.bucket is not None:
            tenant.bucket.take(req.num_prompt_tokens, now)

    def release(self, tenant: Tenant, num_output_tokens: int, duration_s: float, now: float,
                *, completed: bool = True) -> None:
        """A request left the system: charge its generated tokens, free its concurrency slot."""
        assert tenant.num_in_flight > 0, f"tenant {tenant.tenant_id}: release without admit"
        tenant.num_in_flight -= 1
        if tenant.bucket is not None and num_output_tokens > 0:
            tenant.bucket.take(num_output_tokens, now)
        if completed:
            tenant.observe_finish(num_output_tokens, duration_s)
