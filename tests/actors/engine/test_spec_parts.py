"""The parts of speculative decoding on their own: n-gram lookup, speculative sampling's output
distribution (a statistical test with a fixed seed budget), and the policy's pricing."""

from __future__ import annotations

import torch

from actors.engine.spec.policy import Acceptance, Candidate, TokenTimeModel, choose_k, urgency
from actors.engine.spec.proposers import NgramProposer
from actors.engine.spec.verify import num_matching, speculative_sample


def test_ngram_takes_the_latest_longest_match():
    p = NgramProposer(2, 4)
    assert p.propose([1, 2, 3, 4, 9, 9, 1, 2, 3], 3) == [4, 9, 9]
    assert p.propose([1, 2, 3, 7, 1, 2, 3, 8, 5, 2, 3], 2) == [8, 5]  # the latest "2 3"
    assert p.propose([1, 2, 3, 4, 5], 3) == []  # no bigram recurs
    assert p.propose([7, 7], 4) == []  # too short for n >= 2 with a continuation
    assert p.propose([4, 5, 6, 4, 5], 10) == [6, 4, 5]  # what follows, up to the end


def _naive(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        tail = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest first, with a token after it
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_matches_a_naive_search_and_grows_with_the_request():
    g = torch.Generator().manual_seed(1)
    p = NgramProposer(2, 4)
    tokens: list[int] = []
    for step in range(400):
        tokens.append(int(torch.randint(0, 6, (1,), generator=g)))
        assert p.propose(tokens, 3, "r") == _naive(tokens, 3, 2, 4), step
    p.forget(set())
    assert p.propose(tokens[:50], 3, "r") == _naive(tokens[:50], 3, 2, 4)


def test_num_matching():
    assert num_matching([1, 2, 3], [1, 2, 9, 4]) == 2
    assert num_matching([1, 2, 3], [1, 2, 3, 4]) == 3
    assert num_matching([5], [1, 2]) == 0


def test_speculative_sampling_keeps_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    vocab, k, n = 6, 2, 12000
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, -1).double()
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, -1).double()
    first = torch.zeros(vocab, dtype=torch.float64)
    bonus = torch.zeros(vocab, dtype=torch.float64)
    num_bonus = 0
    accepted = 0
    for seed in range(n):
        # drafts drawn from q with an independent stream, as a draft model draws them
        dg = torch.Generator().manual_seed(10**6 + seed)
        drafts = [int(torch.multinomial(q[i], 1, generator=dg)) for i in range(k)]
        out = speculative_sample(p, q, drafts, seed, 0)
        first[out[0]] += 1
        accepted += len(out) - 1
        if len(out) == k + 1:  # every draft accepted: the last token comes from p's last row
            bonus[out[-1]] += 1
            num_bonus += 1
    # Total variation between the empirical first token and p[0]: ~sqrt(V / n) noise ~ 0.02.
    assert 0.5 * (first / n - p[0]).abs().sum() < 0.03
    assert 0.5 * (bonus / num_bonus - p[k]).abs().sum() < 0.06
    # The acceptance of the first draft is sum(min(p, q)) in expectation.
    assert accepted > 0.5 * n * float(torch.minimum(p[0], q[0]).sum())


def test_policy_speculates_when_weight_bound_not_when_compute_bound():
    cands = [Candidate(acceptance=0.7, max_k=4, urgency=1.0)]
    weight_bound = TokenTimeModel(c0=0.02, c1=2e-5, strength=1e6)  # a token costs 1/1000 of a step
    assert choose_k(cands, weight_bound, 1, 1.0) == [4]
    compute_bound = TokenTimeModel(c0=0.02, c1=4e-3, strength=1e6)  # 16 rows: a token costs 1/5 of a step
    assert choose_k(cands * 16, compute_bound, 16, 16.0) == [0] * 16
    poor = [Candidate(acceptance=0.02, max_k=4, urgency=1.0)]
    assert choose_k(poor, weight_bound, 1, 1.0) == [0]
    # a drafting model's passes: worth it at high acceptance, not when a pass costs a whole step
    assert choose_k(cands, weight_bound, 1, 1.0, draft_pass_s=0.004)[0] > 0
    assert choose_k(cands, weight_bound, 1, 1.0, draft_pass_s=0.02) == [0]


def test_short_slack_speculates_first():
    model = TokenTimeModel(c0=0.02, c1=1e-3, strength=1e6)
    cands = [Candidate(0.6, 4, urgency(0.05, 0.2)), Candidate(0.6, 4, urgency(0.19, 0.2))]
    ks = choose_k(cands, model, 2, sum(c.urgency for c in cands))
    assert ks[1] > ks[0]


def test_step_time_model_learns_and_acceptance_estimate():
    m = TokenTimeModel()
    for t in (1, 5, 1, 9, 2, 300, 1, 17):
        m.observe(t, 0.01 + 0.001 * t)
    assert abs(m.predict(100) - 0.11) < 0.01
    a = Acceptance(prior=0.5, weight=2)
    a.record(4, 4)
    a.record(4, 1)
    assert abs(a.rate() - (5 + 1) / (5 + 1 + 2)) < 1e-9
