"""Sampler: validation, the per-row pipeline, and a random stream that depends only on (seed, position)."""

import math

import pytest
import torch

from actors.engine.errors import InvalidSamplingParams
from actors.engine.sampling import (
    Sampler,
    SamplingParams,
    SamplingState,
    apply_penalties,
    draw,
    filter_probs,
    process_logits,
    uniform_for,
)

EOS = frozenset({3})


def state(params: SamplingParams, seed: int = 0, prompt: list[int] | None = None,
          output: list[int] | None = None) -> SamplingState:
    return SamplingState(params, seed, prompt or [0], output or [])


def sample_one(logits_row: torch.Tensor, st: SamplingState, eos: frozenset[int] = EOS) -> int:
    return Sampler().sample(logits_row[None, :], [st], eos).token_ids[0]


def log_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


# ---- validation ----

@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 1.5), ("max_tokens", True),
    ("temperature", -0.1), ("temperature", 100.5), ("temperature", float("nan")),
    ("temperature", float("inf")), ("temperature", "1"),
    ("top_k", -1), ("top_k", 2.0),
    ("top_p", 0.0), ("top_p", -0.5), ("top_p", 1.01), ("top_p", float("nan")),
    ("min_p", -0.01), ("min_p", 1.01),
    ("presence_penalty", -2.01), ("presence_penalty", 2.01),
    ("frequency_penalty", -2.5), ("frequency_penalty", 3.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", 10.01),
    ("seed", 1 << 64), ("seed", -(1 << 63) - 1), ("seed", 1.0),
    ("stop", ("",)), ("stop", ("a", "")), ("stop", tuple(str(i) for i in range(17))), ("stop", (1,)),
    ("stop_token_ids", (-1,)), ("stop_token_ids", ("a",)), ("stop_token_ids", 5),
    ("ignore_eos", "yes"),
    ("logprobs", -1), ("logprobs", 21),
    ("min_tokens", -1), ("min_tokens", 17),  # 17 > default max_tokens 16
])
def test_bad_values_raise_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidSamplingParams, match=field):
        SamplingParams(**{field: value})


def test_boundary_values_are_accepted_and_normalised() -> None:
    p = SamplingParams(max_tokens=1, temperature=100, top_p=1, min_p=1, presence_penalty=-2,
                       frequency_penalty=2, repetition_penalty=10, seed=(1 << 64) - 1, logprobs=20,
                       stop=[str(i) for i in range(16)], stop_token_ids=[7, 8], min_tokens=1)
    assert p.stop == tuple(str(i) for i in range(16))
    assert p.stop_token_ids == (7, 8)
    assert isinstance(p.temperature, float) and p.temperature == 100.0
    assert SamplingParams(seed=-(1 << 63), logprobs=0, top_k=0, min_p=0).seed == -(1 << 63)
    assert SamplingParams(stop="###").stop == ("###",)
    hash(p)  # frozen, and every field hashable once lists became tuples


def test_is_greedy_and_has_penalties() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=-0.5).has_penalties


# ---- greedy ----

def test_greedy_is_argmax_on_fast_and_slow_paths() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    expected = logits.argmax(dim=-1).tolist()
    greedy = SamplingParams(temperature=0)
    states = [state(greedy) for _ in range(6)]
    assert Sampler().sample(logits, states, EOS).token_ids == expected
    # One row asking for logprobs forces the per-row path for the whole batch.
    states[2] = state(SamplingParams(temperature=0, logprobs=0))
    result = Sampler().sample(logits, states, EOS)
    assert result.token_ids == expected
    assert result.logprobs[2] is not None and result.logprobs[0] is None


def test_non_float32_logits_are_accepted() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]], dtype=torch.bfloat16)
    assert Sampler().sample(logits, [state(SamplingParams(temperature=0))], EOS).token_ids == [1]
    assert Sampler().sample(logits, [state(SamplingParams(top_k=1))], EOS).token_ids == [1]


@pytest.mark.parametrize("temperature", [0.05, 1.0, 7.0, 100.0])
def test_top_k_1_equals_greedy_under_any_temperature(temperature: float) -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(2))
    expected = logits.argmax(dim=-1).tolist()
    for seed in range(25):
        states = [state(SamplingParams(temperature=temperature, top_k=1), seed=seed + i)
                  for i in range(4)]
        assert Sampler().sample(logits, states, EOS).token_ids == expected


# ---- reproducibility ----

MIXED = [
    SamplingParams(),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=40, min_p=0.01),
    SamplingParams(temperature=0),
    SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3),
    SamplingParams(temperature=0.5, logprobs=3),
]


def mixed_batch(seed_base: int) -> tuple[torch.Tensor, list[SamplingState]]:
    logits = torch.randn(len(MIXED), 1000, generator=torch.Generator().manual_seed(seed_base))
    states = [SamplingState(p, seed_base * 100 + i, [5, 6, 7], list(range(i * 3)))
              for i, p in enumerate(MIXED)]
    return logits, states


def test_row_token_is_the_same_alone_in_a_batch_and_in_any_order() -> None:
    sampler = Sampler()
    for seed_base in range(10):
        logits, states = mixed_batch(seed_base)
        batched = sampler.sample(logits, states, EOS).token_ids
        alone = [sampler.sample(logits[i:i + 1], [s], EOS).token_ids[0] for i, s in enumerate(states)]
        assert batched == alone
        order = list(reversed(range(len(states))))
        reordered = sampler.sample(logits[order], [states[i] for i in order], EOS).token_ids
        assert reordered == [batched[i] for i in order]
        # No hidden generator state: calling again gives the same answer.
        assert sampler.sample(logits, states, EOS).token_ids == batched


def test_different_seeds_and_positions_give_different_tokens() -> None:
    flat = torch.zeros(1000)
    by_seed = {sample_one(flat, state(SamplingParams(), seed=s)) for s in range(20)}
    assert len(by_seed) >= 18
    by_position = {sample_one(flat, state(SamplingParams(), seed=7, output=[1] * n))
                   for n in range(20)}
    assert len(by_position) >= 18


def test_uniform_depends_only_on_seed_and_position() -> None:
    assert uniform_for(5, 3) == uniform_for(5, 3)
    assert uniform_for(5, 3) != uniform_for(5, 4) and uniform_for(5, 3) != uniform_for(6, 3)
    us = [uniform_for(s, p) for s in range(100) for p in range(10)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert abs(sum(us) / len(us) - 0.5) < 0.03


# ---- filtering ----

PROBS = [0.5, 0.3, 0.15, 0.05]


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(top_k=2), {0, 1}),
    (SamplingParams(top_p=0.75), {0, 1}),
    (SamplingParams(top_p=0.4), {0}),
    (SamplingParams(min_p=0.25), {0, 1, 2}),  # 0.05 < 0.25 * 0.5
    (SamplingParams(min_p=0.7), {0}),
    (SamplingParams(top_k=3, top_p=0.6), {0, 1}),  # 0.5 / 0.95 < 0.6: needs token 1 too
    (SamplingParams(top_k=2, top_p=0.6), {0}),  # top-p sees the top-k renormalised: 0.5 / 0.8
    (SamplingParams(top_k=3, min_p=0.32), {0, 1}),
])
def test_filters_never_pick_an_excluded_token(params: SamplingParams, allowed: set[int]) -> None:
    logits = log_probs(PROBS)
    kept = set(filter_probs(logits, params).nonzero().flatten().tolist())
    assert kept == allowed
    picked = {sample_one(logits, state(params, seed=s), frozenset()) for s in range(400)}
    assert picked == allowed


def test_top_p_past_the_first_guess_matches_a_full_sort() -> None:
    # 3000 distinct logits; a nucleus of hundreds of tokens overflows the first top-k guess.
    logits = torch.linspace(0.0, -3.0, 3000)[torch.randperm(3000, generator=torch.Generator().manual_seed(3))]
    for top_p in (0.3, 0.5, 0.9):
        probs = torch.softmax(logits.double(), dim=-1)
        vals, idx = torch.sort(probs, descending=True)
        n = int((torch.cumsum(vals, 0) - vals < top_p).sum())
        kept = filter_probs(logits, SamplingParams(top_p=top_p)).nonzero().flatten()
        assert n > 256 and set(kept.tolist()) == set(idx[:n].tolist())


def test_draw_never_lands_on_a_zero_probability_token() -> None:
    probs = torch.tensor([0.0, 0.25, 0.0, 0.25, 0.0, 0.5, 0.0])
    assert draw(probs, 0.0) == 1  # the lowest u skips the leading zero
    assert draw(probs, 0.25) == 3  # exactly on a cdf step: the next token with mass
    assert draw(probs, 0.5) == 5
    assert draw(probs, 1.0 - 2.0**-53) == 5  # the highest u skips the trailing zero
    assert [draw(probs * 3.0, u) for u in (0.1, 0.3, 0.9)] == [1, 3, 5]  # unnormalised is fine


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_empirical_frequencies_match_softmax(temperature: float) -> None:
    logits = torch.tensor([1.0, 2.0, 0.0, -1.0, 0.5])
    expected = torch.softmax(logits / temperature, dim=-1).tolist()
    n = 4000
    counts = [0] * 5
    for seed in range(n):
        counts[sample_one(logits, state(SamplingParams(temperature=temperature), seed=seed))] += 1
    for got, want in zip(counts, expected):
        assert abs(got / n - want) < 0.025, (counts, expected)


# ---- penalties and masks ----

def test_penalties_are_exactly_as_hand_computed() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, -3.0, 1.0, 0.0, 4.0])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    st = SamplingState(params, 0, prompt_token_ids=[0, 1, 0], output_token_ids=[1, 2, 2, 5])
    out = apply_penalties(logits, st)
    # token 0: prompt only -> 2/2; 1: -1*2 - 0.25 - 0.5; 2: 0.5/2 - 2*0.25 - 0.5; 5: 0/2 - 0.75
    assert out.tolist() == [1.0, -2.75, -0.75, -3.0, 1.0, -0.75, 4.0]
    assert logits.tolist() == [2.0, -1.0, 0.5, -3.0, 1.0, 0.0, 4.0]  # input untouched
    assert st.output_token_ids == [1, 2, 2, 5]
    only_rep = SamplingParams(repetition_penalty=0.5)
    out = apply_penalties(logits, SamplingState(only_rep, 0, [6], [3]))
    assert out.tolist() == [2.0, -1.0, 0.5, -1.5, 1.0, 0.0, 8.0]


def test_penalties_steer_greedy_decoding() -> None:
    logits = torch.tensor([0.0, 1.0, 0.9])
    params = SamplingParams(temperature=0, frequency_penalty=0.2)
    assert sample_one(logits, state(params, output=[2])) == 1
    assert sample_one(logits, state(params, output=[1])) == 2


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, 10.0, 9.0])  # eos 3 first, stop token 4 second
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, min_tokens=2, stop_token_ids=[4])
        for n in (0, 1):
            row = process_logits(logits, state(params, output=[0] * n), EOS)
            assert row[3] == float("-inf") and row[4] == float("-inf")
            assert sample_one(logits, state(params, seed=n, output=[0] * n)) not in (3, 4)
        row = process_logits(logits, state(params, output=[0, 0]), EOS)
        assert row.tolist() == logits.tolist()
    greedy = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4])
    assert sample_one(logits, state(greedy, output=[0, 0])) == 3
    # A stop id past this model's vocab has nothing to mask and must not break the step.
    beyond = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4, 999])
    assert sample_one(logits, state(beyond)) == 2


def test_ignore_eos_masks_eos_always_but_not_stop_tokens() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, 10.0, 9.0])
    params = SamplingParams(temperature=0, ignore_eos=True, stop_token_ids=[4])
    assert sample_one(logits, state(params, output=[0] * 50)) == 4
    assert sample_one(logits, state(params, output=[0] * 50), frozenset({3, 4})) == 2



def test_batched_greedy_with_bans_equals_each_row_alone_and_leaves_logits_untouched() -> None:
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(4))
    logits[:, 3] = 50.0  # eos would win every row it is not banned in
    logits[:, 7] = 40.0  # the stop token, second
    before = logits.clone()
    states = [
        state(SamplingParams(temperature=0, ignore_eos=True)),  # eos banned
        state(SamplingParams(temperature=0)),  # nothing banned: eos wins
        state(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7]), output=[1]),  # both banned
        state(SamplingParams(temperature=0, repetition_penalty=1.5, ignore_eos=True)),  # per-row path
        state(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7, 999]), output=[1]),  # id past vocab
    ]
    result = Sampler().sample(logits, states, EOS)
    alone = [sample_one(logits[i], s) for i, s in enumerate(states)]
    assert result.token_ids == alone
    assert result.token_ids[0] == 7 and result.token_ids[1] == 3 and result.token_ids[2] not in (3, 7)
    assert torch.equal(logits, before)

# ---- logprobs ----

def test_logprobs_are_raw_log_softmax_sorted() -> None:
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(logprobs=5, temperature=0.3, repetition_penalty=1.5),
              SamplingParams(logprobs=0, temperature=0),
              SamplingParams()]
    states = [state(p, seed=i, prompt=[1, 2, 3]) for i, p in enumerate(params)]
    result = Sampler().sample(logits, states, EOS)
    reference = torch.log_softmax(logits, dim=-1)
    first = result.logprobs[0]
    assert first is not None and first.token_id == result.token_ids[0]
    assert first.logprob == pytest.approx(float(reference[0, first.token_id]), abs=1e-6)
    assert [t for t, _ in first.top] == torch.argsort(reference[0], descending=True)[:5].tolist()
    values = [v for _, v in first.top]
    assert values == sorted(values, reverse=True)
    assert values == pytest.approx(reference[0].sort(descending=True).values[:5].tolist(), abs=1e-6)
    second = result.logprobs[1]
    assert second is not None and second.top == []
    assert second.logprob == pytest.approx(float(reference[1].max()), abs=1e-6)
    assert result.logprobs[2] is None
