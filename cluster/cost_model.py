"""Step-time model: how long a worker's next engine step takes, fitted online from its reports.

Mental model: one step's time is close to linear in five features (units chosen so the
coefficients are all of order 1e-3 s, which keeps the normal equations well conditioned):

    x = [1, prefill_tokens / 1e3, prefill_pairs / 1e6, decode_seqs / 1e2, context_tokens / 1e5]

(fixed launch + weight-streaming cost, prefill GEMMs, prefill attention, per-row decode work, KV
read by decode attention). Each worker gets its own coefficients theta, the ridge solution of

    min  sum_i lam^(n-i) (y_i - x_i . theta)^2  +  (theta - theta0)' L0 (theta - theta0)

with forgetting factor `lam` (old steps fade, so a worker that slows down, say from thermal
throttling or a noisy neighbour, is tracked) and a prior `theta0` of strength `L0` that does NOT
fade. The non-fading prior is the point: a prefill worker never sees decode rows, and with a
fading prior those directions would drift to nothing ("covariance wind-up" of plain recursive
least squares); here they stay at the prior. Sufficient statistics are updated per sample in
O(d^2); the 5x5 solve happens once per report, so predictions are a 5-term dot product.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from cluster.descriptors import StepSample, WorkerName

NUM_FEATURES = 5
_SCALE = (1.0, 1e-3, 1e-6, 1e-2, 1e-5)


def features(prefill_tokens: float, prefill_pairs: float, decode_seqs: float,
             context_tokens: float) -> tuple[float, float, float, float, float]:
    return (1.0, prefill_tokens * 1e-3, prefill_pairs * 1e-6, decode_seqs * 1e-2, context_tokens * 1e-5)


def prefill_pairs(num_new_tokens: int, num_cached_tokens: int) -> float:
    """Query-key pairs of prefilling `num_new_tokens` after `num_cached_tokens` (causal)."""
    return num_new_tokens * (num_cached_tokens + num_new_tokens / 2.0)


@dataclass(frozen=True, slots=True)
class StepCostPrior:
    """Prior coefficients (seconds per feature unit) and their strength.

    The defaults are orders of magnitude for an 8B dense model in bf16 on an H100/H200-class GPU
    (~5 ms to stream the weights, ~36 us per prefill token at ~45% of 989 TFLOPS, ~1.2 ns per
    attention pair, ~32 us per decode row, ~34 ns per KV token read at 3.8 TB/s); they only need
    to be right within a factor of a few, the fit takes over after a few dozen steps.
    `strength` is how many observations' worth of evidence the prior is.
    """

    coef: tuple[float, float, float, float, float] = (5e-3, 3.6e-2, 1.2e-3, 3.2e-3, 3.4e-3)
    strength: float = 4.0
    forgetting: float = 0.995
    min_step_s: float = 1e-4

    def __post_init__(self) -> None:
        if len(self.coef) != NUM_FEATURES:
            raise ValueError(f"need {NUM_FEATURES} prior coefficients, got {len(self.coef)}")
        if not 0 < self.forgetting <= 1:
            raise ValueError(f"forgetting must be in (0, 1], got {self.forgetting}")
        if not self.strength > 0:
            raise ValueError("strength must be positive")


class StepTimeModel:
    """One worker's step-time regression. `observe` is cheap; `refit` solves; `predict` is O(1)."""

    def __init__(self, prior: StepCostPrior) -> None:
        self.prior = prior
        theta0 = np.asarray(prior.coef, dtype=np.float64)
        # Prior precision per coefficient: `strength` observations whose feature is 1 unit.
        self._l0 = np.eye(NUM_FEATURES) * prior.strength
        self._l0_theta0 = self._l0 @ theta0
        self._xx = np.zeros((NUM_FEATURES, NUM_FEATURES))
        self._xy = np.zeros(NUM_FEATURES)
        self._theta: tuple[float, ...] = tuple(prior.coef)
        self._dirty = False
        self.num_samples = 0

    def observe(self, sample: StepSample) -> None:
        self.observe_all((sample,), refit=False)

    def observe_all(self, samples: Iterable[StepSample], *, refit: bool = True) -> None:
        """Fold a report's samples in, oldest first (the newest gets weight 1, the one before
        `lam`, ...), then re-solve. Samples with a non-positive or non-finite time are skipped:
        a broken timer must not poison the fit."""
        rows = [features(s.num_prefill_tokens, s.num_prefill_pairs, s.num_decode_seqs, s.num_context_tokens)
                + (s.step_s,) for s in samples if s.step_s > 0 and math.isfinite(s.step_s)]
        if not rows:
            return
        data = np.asarray(rows)  # [n, NUM_FEATURES + 1]
        x, y = data[:, :NUM_FEATURES], data[:, NUM_FEATURES]
        lam = self.prior.forgetting
        n = len(rows)
        w = lam ** np.arange(n - 1, -1, -1, dtype=np.float64)  # [n]
        decay = lam ** n
        self._xx = decay * self._xx + (x * w[:, None]).T @ x
        self._xy = decay * self._xy + (x * w[:, None]).T @ y
        self._dirty = True
        self.num_samples += n
        if refit:
            self.refit()

    def center_on(self, theta: tuple[float, ...]) -> None:
        """Move the prior's centre to `theta` (scaled units, as `theta` returns). Only a model
        without samples of its own moves: once a worker has measured steps, its prior is fixed."""
        if self.num_samples:
            return
        self._l0_theta0 = self._l0 @ np.asarray(theta, dtype=np.float64)
        self._theta = tuple(theta)
        self._dirty = False

    def refit(self) -> None:
        if not self._dirty:
            return
        theta = np.linalg.solve(self._l0 + self._xx, self._l0_theta0 + self._xy)
        self._theta = tuple(float(v) for v in theta)
        self._dirty = False

    @property
    def theta(self) -> tuple[float, ...]:
        """Coefficients per *scaled* feature (what `features(...)` is multiplied by); the hot
        loops in placement read these directly."""
        return self._theta

    @property
    def coefficients(self) -> tuple[float, ...]:
        """Seconds per feature unit, in `features` order (descaled units: per token, per pair...)."""
        self.refit()
        return tuple(c * s for c, s in zip(self._theta, _SCALE))

    def predict(self, prefill_tokens: float = 0, prefill_pairs_: float = 0, decode_seqs: float = 0,
                context_tokens: float = 0) -> float:
        t = self._theta
        y = (t[0] + t[1] * prefill_tokens * 1e-3 + t[2] * prefill_pairs_ * 1e-6
             + t[3] * decode_seqs * 1e-2 + t[4] * context_tokens * 1e-5)
        return max(self.prior.min_step_s, y)

    def predict_prefill(self, num_new_tokens: int, num_cached_tokens: int = 0) -> float:
        """Compute time of one request's prefill run alone (sum of its chunks ~ one big step)."""
        if num_new_tokens <= 0:
            return 0.0
        return self.predict(num_new_tokens, prefill_pairs(num_new_tokens, num_cached_tokens))

    def predict_decode_step(self, num_seqs: int, num_context_tokens: int) -> float:
        return self.predict(0, 0, num_seqs, num_context_tokens)

    def prefill_tokens_per_s(self) -> float:
        """Marginal prefill throughput (ignores attention): for capacity estimates only."""
        per_token = max(self._theta[1] * 1e-3, 1e-9)
        return 1.0 / per_token

    def max_decode_batch(self, tpot_s: float, mean_context_tokens: float, limit: int) -> int:
        """Largest decode batch whose predicted step time stays within `tpot_s`, in [1, limit]."""
        t = self._theta
        return batch_cap(t[0], t[3] * 1e-2 + t[4] * mean_context_tokens * 1e-5, tpot_s, limit)


def batch_cap(fixed_s: float, per_row_s: float, tpot_s: float, limit: int) -> int:
    """Solve fixed + per_row * B <= tpot for the largest B in [1, limit] (step time is linear in
    the batch size B once the mean context per row is fixed)."""
    if per_row_s <= 0:
        return limit
    room = tpot_s - fixed_s
    return max(1, min(limit, math.floor(room / per_row_s))) if room > 0 else 1


def chunk_tokens(theta: tuple[float, ...], room_s: float, num_cached_tokens: float, limit: int) -> int:
    """Largest prefill chunk n (tokens, at most `limit`) after `num_cached_tokens` whose added
    step time theta1 * n + theta2 * n * (cached + n / 2) (scaled units, see `features`) fits in
    `room_s`; 0 when there is no room."""
    if room_s <= 0:
        return 0
    a = theta[2] * 0.5e-6  # quadratic in n: a n^2 + b n <= room
    b = theta[1] * 1e-3 + theta[2] * num_cached_tokens * 1e-6
    if a > 0:
        n = (-b + math.sqrt(b * b + 4 * a * room_s)) / (2 * a)
    else:
        n = room_s / b if b > 0 else float(limit)
    return max(0, min(limit, int(n)))


class CostModelBank:
    """One `StepTimeModel` per worker, plus one per group of workers (their kind: prefill, decode,
    both), fitted to all the group's steps: the fleet's fit.

    A worker with no measured steps yet (just started, scaled up, restarted) borrows its group's
    fit as its prior instead of the static `StepCostPrior`, which is an order of magnitude for a
    model and device that may not be this one (on a CPU box it is ~50x optimistic). Without this an
    unmeasured worker looks far faster than its measured peers, and placement sends it the work a
    measured peer holds the prefix for. Groups keep like with like: a prefill worker's few first
    steps fit an intercept that mixing in decode workers' short steps would pull down, so that a
    fresh prefill worker would again look cheaper than the one holding the prefix. A worker's prior
    is fixed at its first own step; its own steps take over from there (`StepCostPrior.strength`
    steps' worth of evidence). One scheduler serves one model; on a mixed-device fleet a group's
    fit is its mean device, still nearer than a constant.
    """

    def __init__(self, prior: StepCostPrior) -> None:
        self.prior = prior
        self._models: dict[WorkerName, StepTimeModel] = {}
        self._group_of: dict[WorkerName, str] = {}
        self._fleets: dict[str, StepTimeModel] = {}
        self._unmeasured: set[WorkerName] = set()  # few once a fleet runs: a report touches only these

    def fleet(self, group: str = "") -> StepTimeModel:
        model = self._fleets.get(group)
        if model is None:
            model = self._fleets[group] = StepTimeModel(self.prior)
        return model

    def get(self, worker: WorkerName, group: str | None = None) -> StepTimeModel:
        """The worker's model (created on first sight); `group` (its kind) files it with its peers,
        once known. A model without steps of its own starts at its group's fit."""
        moved = False
        if group is not None and self._group_of.get(worker) != group:
            self._group_of[worker], moved = group, True
        model = self._models.get(worker)
        if model is None:
            model = self._models[worker] = StepTimeModel(self.prior)
            self._unmeasured.add(worker)
            moved = True
        if moved and worker in self._unmeasured:
            fleet = self._fleets.get(self._group_of.get(worker, ""))
            if fleet is not None and fleet.num_samples:
                model.center_on(fleet.theta)
        return model

    def observe(self, worker: WorkerName, samples: tuple[StepSample, ...]) -> None:
        """A worker's measured steps: they fit its own model and its group's; every worker of the
        group still without steps of its own follows the group's new fit."""
        model = self.get(worker)
        model.observe_all(samples)
        if not model.num_samples:  # nothing usable (broken timers): the group learns nothing either
            return
        self._unmeasured.discard(worker)
        group = self._group_of.get(worker, "")
        fleet = self.fleet(group)
        fleet.observe_all(samples)
        theta = fleet.theta
        for name in self._unmeasured:
            if self._group_of.get(name, "") == group:
                self._models[name].center_on(theta)

    def drop(self, worker: WorkerName) -> None:
        self._models.pop(worker, None)
        self._group_of.pop(worker, None)
        self._unmeasured.discard(worker)
