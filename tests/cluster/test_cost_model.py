"""Online step-time model: recovers synthetic coefficients, tracks drift, keeps its prior where blind."""

from __future__ import annotations

import random

import pytest

from cluster.cost_model import CostModelBank, StepCostPrior, StepTimeModel, prefill_pairs
from cluster.descriptors import StepSample

TRUE = (0.004, 2.5e-5, 2.0e-9, 6.0e-5, 5.0e-8)  # s, s/token, s/pair, s/row, s/context token


def _sample(rng: random.Random, coef: tuple[float, ...], noise: float) -> StepSample:
    if rng.random() < 0.5:
        n, ctx = rng.randint(16, 8192), rng.randint(0, 4096)
        pairs = prefill_pairs(n, ctx)
        y = coef[0] + coef[1] * n + coef[2] * pairs
        s = StepSample(n, pairs, 0, 0, y)
    else:
        b = rng.randint(1, 256)
        c = b * rng.randint(100, 8000)
        y = coef[0] + coef[3] * b + coef[4] * c
        s = StepSample(0, 0.0, b, c, y)
    return StepSample(s.num_prefill_tokens, s.num_prefill_pairs, s.num_decode_seqs, s.num_context_tokens,
                      s.step_s * (1.0 + rng.gauss(0.0, noise)))


def test_fit_recovers_synthetic_coefficients() -> None:
    rng = random.Random(0)
    model = StepTimeModel(StepCostPrior())
    for _ in range(20):
        model.observe_all([_sample(rng, TRUE, 0.02) for _ in range(25)])
    assert model.num_samples == 500
    for got, want in zip(model.coefficients, TRUE):
        assert got == pytest.approx(want, rel=0.15)
    assert model.predict_prefill(4096, 1024) == pytest.approx(
        TRUE[0] + TRUE[1] * 4096 + TRUE[2] * prefill_pairs(4096, 1024), rel=0.03)
    assert model.predict_decode_step(128, 128 * 2000) == pytest.approx(
        TRUE[0] + TRUE[3] * 128 + TRUE[4] * 256000, rel=0.03)


def test_forgetting_tracks_a_worker_that_slows_down() -> None:
    rng = random.Random(1)
    model = StepTimeModel(StepCostPrior(forgetting=0.98))
    for _ in range(300):
        model.observe_all([_sample(rng, TRUE, 0.0)])
    slow = tuple(2.0 * c for c in TRUE)
    for _ in range(400):
        model.observe_all([_sample(rng, slow, 0.0)])
    assert model.predict_decode_step(64, 64 * 1000) == pytest.approx(
        slow[0] + slow[3] * 64 + slow[4] * 64000, rel=0.05)


def test_unobserved_directions_stay_at_the_prior_and_bad_samples_are_ignored() -> None:
    rng = random.Random(2)
    prior = StepCostPrior()
    model = StepTimeModel(prior)
    decode_only = [s for s in (_sample(rng, TRUE, 0.0) for _ in range(2000)) if s.num_decode_seqs][:400]
    model.observe_all(decode_only + [StepSample(10, 1.0, 0, 0, float("nan")), StepSample(1, 1.0, 0, 0, -1.0)])
    assert model.num_samples == 400
    # A decode-only worker never sees prefill work: those coefficients stay near the prior.
    assert model.coefficients[1] == pytest.approx(prior.coef[1] * 1e-3, rel=0.05)
    assert model.coefficients[3] == pytest.approx(TRUE[3], rel=0.1)


def test_an_unmeasured_worker_borrows_its_groups_fit_until_its_own_steps_arrive() -> None:
    """A CPU-slow fleet: a worker with no steps yet is priced like its measured peers of the same
    kind (not at the GPU-fast static prior, which would make it look ~100x cheaper), whether it
    registered before or after they were measured; another kind's steps do not move it; its own
    steps then take over, and its group's later changes no longer move it."""
    rng = random.Random(3)
    slow = tuple(100.0 * c for c in TRUE)
    bank = CostModelBank(StepCostPrior())
    static = StepTimeModel(StepCostPrior()).coefficients
    early = bank.get("p-early", "prefill")  # registered before any step was measured anywhere
    bank.get("p-a", "prefill")
    bank.get("d-a", "decode")
    assert early.coefficients == static
    for _ in range(20):
        bank.observe("p-a", tuple(_sample(rng, slow, 0.02) for _ in range(25)))
    late = bank.get("p-late", "prefill")
    want = slow[0] + slow[1] * 1000 + slow[2] * prefill_pairs(1000, 0)
    for m in (early, late):
        assert m.num_samples == 0
        assert m.theta == bank.fleet("prefill").theta
        assert m.predict_prefill(1000) == pytest.approx(want, rel=0.1)
    assert bank.get("d-late", "decode").coefficients == static  # no decode worker measured yet
    bank.get("p-filed-later")  # first seen without its kind, then filed: it borrows from then on
    assert bank.get("p-filed-later", "prefill").theta == bank.fleet("prefill").theta
    # Broken timers teach nothing: neither the worker nor its group moves.
    before = bank.fleet("prefill").theta
    bank.get("p-b", "prefill")
    bank.observe("p-b", (StepSample(10, 1.0, 0, 0, float("nan")),))
    assert bank.get("p-b").num_samples == 0 and bank.fleet("prefill").theta == before
    # Decode workers' steps (fast here) move only their group.
    bank.observe("d-a", tuple(_sample(rng, TRUE, 0.0) for _ in range(50)))
    assert late.theta == before and bank.get("d-late").theta == bank.fleet("decode").theta != before
    # Its own steps take over (this worker is 3x faster than its group); then it no longer follows.
    fast = tuple(c / 3.0 for c in slow)
    for _ in range(20):
        bank.observe("p-early", tuple(_sample(rng, fast, 0.0) for _ in range(25)))
    assert early.predict_prefill(1000) == pytest.approx(want / 3.0, rel=0.1)
    own = early.theta
    bank.observe("p-a", tuple(_sample(rng, slow, 0.0) for _ in range(25)))
    assert early.theta == own and late.theta == bank.fleet("prefill").theta
