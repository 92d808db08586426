"""Speculative decoding keeps the sampled distribution, through the engine: the joint distribution of
the first two tokens a request's first verify step emits (output tokens 2 and 3; the first comes from
the prefill, which never speculates) over thousands of seeded requests, with and without speculation,
by a chi-square test of homogeneity. A sampler that accepts every draft fails it by far."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.loader import load_model
from actors.engine.options import RequestOptions
from actors.engine.sampling import SamplingParams
from actors.engine.spec import SpecConfig

# top_k=3 keeps the joint of two tokens (given the first, which varies too) on at most 27 cells:
# thousands of requests fill every one of them.
PARAMS = SamplingParams(max_tokens=4, temperature=1.0, top_k=3, ignore_eos=True)
PROMPT = list(range(20, 37))  # one full block, then one token: after the first request a cache hit
NUM_REQUESTS = 3000


@pytest.fixture
def one_thread():
    # Thousands of tiny rows: thread hand-offs would cost more than the work (shared CI cores).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def joint_counts(path, spec: SpecConfig, first_seed: int) -> tuple[Counter[tuple[int, int]], Engine]:
    cfg = EngineConfig(num_blocks=1024, dtype="float32", speculation=spec, max_num_seqs=256,
                       max_num_batched_tokens=2048)
    model, tokenizer = load_model(path, cfg.resolved(torch.device("cpu")))
    e = Engine(model, tokenizer, cfg)
    e.generate([PROMPT], PARAMS)  # caches the prompt's block: every request below prefills one token
    for i in range(NUM_REQUESTS):
        e.add_request(f"r{i}", PROMPT, PARAMS, RequestOptions(seed=first_seed + i))
    counts: Counter[tuple[int, int]] = Counter()
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                counts[out.token_ids[1], out.token_ids[2]] += 1
    return counts, e


def chi_square(a: Counter, b: Counter) -> tuple[float, int]:
    """Pearson's statistic of homogeneity of two samples over their cells, and its degrees of freedom."""
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    cells = set(a) | set(b)
    for c in cells:
        total = a[c] + b[c]
        for count, n in ((a[c], na), (b[c], nb)):
            expected = total * n / (na + nb)
            stat += (count - expected) ** 2 / expected
    return stat, len(cells) - 1


SPECS = {
    # Drafts sampled from the first layer's distribution q: speculative (rejection) sampling.
    "sampled_drafts": SpecConfig(method="early_exit", exit_layer=1, sample_drafts=True, policy="always",
                                 max_draft_tokens=2),
    # The model's own greedy drafts, single proposals: accepted iff plain sampling draws them.
    "greedy_drafts": SpecConfig(method="early_exit", exit_layer=99, policy="always", max_draft_tokens=2),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_first_two_speculated_tokens_keep_the_joint_distribution(tiny_llama_dir, one_thread, name):
    plain, _ = joint_counts(tiny_llama_dir, SpecConfig(), first_seed=1_000_000)  # seeds apart from spec's
    spec, e = joint_counts(tiny_llama_dir, SPECS[name], first_seed=0)
    stats = e.stats()
    assert stats.num_draft_tokens >= 2 * NUM_REQUESTS  # every request verified 2 drafts at its first decode
    assert sum(spec.values()) == sum(plain.values()) == NUM_REQUESTS
    stat, df = chi_square(plain, spec)
    # Under the null the statistic is chi-square with df degrees of freedom (mean df, sd sqrt(2 df)):
    # df + 5 sd is a p-value under 1e-4 (measured here: ~30 and ~35 on 26). Samplers broken on
    # purpose (not committed) scored: every draft accepted, ~5,100 and ~3,400; sampled drafts
    # accepted with p(d) instead of min(1, p(d)/q(d)), ~630.
    assert stat < df + 5 * math.sqrt(2 * df), (stat, df)
    assert 4 <= df <= 26  # the cells of top_k=3 alone
    # Total variation between the two samples: ~0.056 from sampling noise alone at 3,000 a side.
    tv = 0.5 * sum(abs(plain[c] - spec[c]) for c in set(plain) | set(spec)) / NUM_REQUESTS
    assert tv < 0.1, tv
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts both taken and refused
