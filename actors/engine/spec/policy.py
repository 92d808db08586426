"""When speculation pays, and how many drafts each row gets.

Mental model: a step's time is close to linear in the tokens it forwards, t(T) = c0 + c1 T
(`TokenTimeModel`, fitted online from this engine's own steps): c0 is streaming the weights, c1 the
compute per token. A row that verifies k drafts adds k tokens to T and, with per-draft acceptance
a, emits 1 + a + a^2 + ... + a^k tokens instead of 1. Each row's tokens are weighted by how short
its TPOT slack is (`urgency`: a row running at its target counts 2x a row at half of it; rows
without a target count 1). The policy raises one row's k at a time, the row whose next draft adds
the most weighted tokens per second, for as long as the step's weighted tokens per second rise
by a margin. So when c1 T is small next to c0 (few rows: decoding is weight-bound) rows with good
acceptance speculate deep, and when the batch is compute-bound nothing does. Drafting passes of a
model drafter cost `draft_share` of a step over their rows each (measured), n-gram lookup nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_GAIN = 1.03  # a draft must raise the step's weighted tokens/s by 3%: noise in t(T) must not decide


class TokenTimeModel:
    """Ridge fit of step seconds on forwarded tokens, with forgetting, around a prior that does not
    fade (so a direction the engine rarely sees, big T, stays at the prior instead of drifting)."""

    def __init__(self, c0: float = 0.02, c1: float = 2e-5, strength: float = 2.0, forgetting: float = 0.98) -> None:
        self.prior = np.array([c0, c1 * 1e2])  # the slope per 100 tokens
        # The slope's prior is weak: steps of different sizes (prefill chunks, verifies) pin it fast.
        self.prior_weight = strength * np.diag([1.0, 0.02])
        self.forgetting = forgetting
        self.xx = np.zeros((2, 2))
        self.xy = np.zeros(2)
        self.coef = self.prior.copy()

    def observe(self, tokens: int, seconds: float) -> None:
        x = np.array([1.0, tokens * 1e-2])
        self.xx = self.forgetting * self.xx + np.outer(x, x)
        self.xy = self.forgetting * self.xy + x * seconds
        a = self.xx + self.prior_weight
        self.coef = np.linalg.solve(a, self.xy + self.prior_weight @ self.prior)
        self.coef = np.maximum(self.coef, [1e-5, 0.0])

    def predict(self, tokens: float) -> float:
        return float(self.coef[0] + self.coef[1] * tokens * 1e-2)


class Acceptance:
    """Per-draft acceptance: accepted drafts over accepted + rounds that ended in a rejection (the
    truncated-geometric estimate), with `weight` pseudo-rounds of a prior."""

    def __init__(self, prior: float = 0.6, weight: float = 2.0) -> None:
        self.prior, self.weight = prior, weight
        self.accepted = 0
        self.rejections = 0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.accepted += num_accepted
        self.rejections += int(num_accepted < num_drafts)

    def rate(self, prior: float | None = None) -> float:
        p = self.prior if prior is None else prior
        return (self.accepted + self.weight * p) / (self.accepted + self.rejections + self.weight)


@dataclass(frozen=True)
class Candidate:
    acceptance: float
    max_k: int  # drafts available or allowed
    urgency: float


def urgency(tpot_ema_s: float | None, tpot_target_s: float | None) -> float:
    """Weight of a row's tokens: 2 x (measured TPOT / target), in [0.25, 2]; 1 without either."""
    if not tpot_target_s or tpot_ema_s is None:
        return 1.0
    return min(2.0, max(0.25, 2.0 * tpot_ema_s / tpot_target_s))


def choose_k(cands: list[Candidate], model: TokenTimeModel, base_tokens: int, base_value: float,
             draft_pass_s: float = 0.0) -> list[int]:
    """k per candidate row. `base_tokens`: the tokens the step forwards without speculation;
    `base_value`: its weighted tokens (every due row's urgency, candidates' included);
    `draft_pass_s`: one drafting pass over the drafting rows (0 for n-gram)."""
    if draft_pass_s > 0.0:
        return _choose_depth(cands, model, base_tokens, base_value, draft_pass_s)
    ks = [0] * len(cands)
    value, tokens = base_value, base_tokens
    rate = value / model.predict(tokens)
    while True:  # one draft at a time, the one that raises the rate most
        best, best_rate = -1, rate * MIN_GAIN
        for i, c in enumerate(cands):
            if ks[i] < c.max_k and (r := (value + _gain(c, ks[i] + 1)) / model.predict(tokens + 1)) > best_rate:
                best, best_rate = i, r
        if best < 0:
            return ks
        value += _gain(cands[best], ks[best] + 1)
        ks[best] += 1
        tokens += 1
        rate = best_rate


def _choose_depth(cands: list[Candidate], model: TokenTimeModel, base_tokens: int, base_value: float,
                  draft_pass_s: float) -> list[int]:
    """With a drafting model every pass costs the same whatever rows it drafts for, so the choice is
    a depth d (passes) and the rows that join (each with k = min(d, its max)): for each d the rows
    join by value per verified token while the rate rises; the best d wins (0: no speculation)."""
    best_ks, best_rate = [0] * len(cands), base_value / model.predict(base_tokens) * MIN_GAIN
    for d in range(1, max((c.max_k for c in cands), default=0) + 1):
        ks = [0] * len(cands)
        value, tokens, rate = base_value, base_tokens, 0.0
        gains = [sum(_gain(c, i) for i in range(1, min(d, c.max_k) + 1)) for c in cands]
        for i in sorted(range(len(cands)), key=lambda i: -gains[i] / min(d, cands[i].max_k)):
            k = min(d, cands[i].max_k)
            r = (value + gains[i]) / (model.predict(tokens + k) + draft_pass_s * d)
            if r <= rate:
                break
            ks[i], value, tokens, rate = k, value + gains[i], tokens + k, r
        if rate > best_rate:
            best_ks, best_rate = ks, rate
    return best_ks


def _gain(c: Candidate, i: int) -> float:
    """Expected weighted tokens the i-th draft of a row adds: it is emitted iff drafts 1..i are accepted."""
    return c.urgency * c.acceptance**i
