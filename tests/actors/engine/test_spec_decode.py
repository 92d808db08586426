"""Speculative decoding in the engine on tiny random models: outputs are the same tokens with and
without it (greedy, and seeded sampling with single-proposal drafts), rejection-sampled drafts stay
reproducible, KV and the prefix cache see only accepted tokens, stops and opt-outs hold."""

from __future__ import annotations

import asyncio

import pytest
import torch

from actors.engine.async_engine import AsyncEngine
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.loader import load_model
from actors.engine.options import RequestOptions
from actors.engine.sampling import SamplingParams
from actors.engine.spec import SpecConfig

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=40, temperature=0.7, top_k=2, seed=11, ignore_eos=True)
# A repeated pattern (n-gram lookup finds it), a plain run, a short loop.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 6, list(range(20, 60)), [3, 4, 5, 3, 4, 5, 3, 4, 5, 9, 9]]
ALWAYS = dict(policy="always", max_draft_tokens=4)


def engine(path, spec: SpecConfig, draft_path=None, **kw) -> Engine:
    cfg = EngineConfig(num_blocks=kw.pop("num_blocks", 64), speculation=spec, **kw)
    model, tokenizer = load_model(path, cfg.resolved(torch.device("cpu")))
    draft = load_model(draft_path, cfg.resolved(torch.device("cpu")))[0] if draft_path else None
    return Engine(model, tokenizer, cfg, draft_model=draft)


def run(e: Engine, params: SamplingParams, prompts=PROMPTS) -> list[tuple[int, ...]]:
    outs = e.generate(prompts, params)
    e.check_integrity()
    assert e.kv.pool.num_free_blocks == e.num_blocks, "every slot, rejected ones included, is freed"
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    from actors.engine.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-draft"), seed=5)


SPECS = {
    "ngram": SpecConfig(method="ngram", **ALWAYS),
    "early_exit": SpecConfig(method="early_exit", exit_layer=1, **ALWAYS),
    "full_depth_exit": SpecConfig(method="early_exit", exit_layer=99, **ALWAYS),  # the model drafts itself
    "draft_self": SpecConfig(method="draft", draft_model="target", **ALWAYS),
    "draft_other": SpecConfig(method="draft", draft_model="other", **ALWAYS),
}


def _draft_path(name, tiny_llama_dir, other_dir):
    return {"draft_self": tiny_llama_dir, "draft_other": other_dir}.get(name)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("name", list(SPECS))
def test_same_tokens_with_and_without_speculation(tiny_llama_dir, other_dir, name, params):
    want = run(engine(tiny_llama_dir, SpecConfig()), params)
    e = engine(tiny_llama_dir, SPECS[name], _draft_path(name, tiny_llama_dir, other_dir))
    assert run(e, params) == want
    stats = e.stats()
    assert stats.num_spec_steps > 0 and stats.num_draft_tokens > 0
    if name in ("full_depth_exit", "draft_self") and params is GREEDY:
        assert stats.num_accepted_tokens == stats.num_draft_tokens  # drafting with the target itself
        assert stats.num_steps < 40 * 3 / 2  # several tokens a step


@pytest.mark.parametrize("draft", ["self", "other"])
def test_rejection_sampled_drafts_are_reproducible(tiny_llama_dir, other_dir, draft):
    # Drafts sampled from the draft model's distribution, verified by speculative sampling: the
    # tokens differ from plain sampling's (the distribution does not: test_spec_parts.py), but a
    # seeded request gives the same tokens every run.
    path = tiny_llama_dir if draft == "self" else other_dir
    spec = SpecConfig(method="draft", draft_model=draft, sample_drafts=True, **ALWAYS)
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    first = run(engine(tiny_llama_dir, spec, path), params)
    e = engine(tiny_llama_dir, spec, path)
    assert run(e, params) == first
    assert all(len(t) == params.max_tokens for t in first)
    stats = e.stats()
    if draft == "self":  # q == p: every draft is accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_prefix_cache_holds_only_accepted_tokens(tiny_llama_dir):
    plain = engine(tiny_llama_dir, SpecConfig())
    run(plain, GREEDY)
    spec = engine(tiny_llama_dir, SpecConfig(method="ngram", **ALWAYS))
    run(spec, GREEDY)
    assert spec.stats().num_draft_tokens > spec.stats().num_accepted_tokens  # some drafts were rejected
    assert set(spec.cached_block_hashes()) == set(plain.cached_block_hashes())


def test_stops_cut_accepted_drafts(tiny_llama_dir):
    full = run(engine(tiny_llama_dir, SpecConfig()), GREEDY)[0]
    stop_at = full[7]  # a token that first appears mid-run: stop there even if drafts ran past it
    cut = full.index(stop_at) + 1
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=(stop_at,))
    for spec in (SpecConfig(), SpecConfig(method="ngram", **ALWAYS), SpecConfig(method="early_exit", exit_layer=99, **ALWAYS)):
        assert run(engine(tiny_llama_dir, spec), params, PROMPTS[:1])[0] == full[:cut]
    short = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert run(engine(tiny_llama_dir, SpecConfig(method="early_exit", exit_layer=99, **ALWAYS)), short)[0] == full[:6]


def test_request_opt_out_and_logprobs(tiny_llama_dir):
    e = engine(tiny_llama_dir, SpecConfig(method="early_exit", exit_layer=99, **ALWAYS))
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)
    e.add_request("off", PROMPTS[0], params, RequestOptions(speculation=False))
    e.add_request("on", PROMPTS[0], params)
    final, lps = {}, {"off": [], "on": []}
    while e.has_unfinished_requests():
        for out in e.step():
            lps[out.request_id] += out.logprobs
            if out.finished:
                final[out.request_id] = out
    assert final["off"].num_draft_tokens == 0 and final["on"].num_draft_tokens > 0
    assert final["on"].num_accepted_tokens == final["on"].num_draft_tokens
    assert final["off"].token_ids == final["on"].token_ids
    for rid in lps:
        assert [lp.token_id for lp in lps[rid]] == list(final[rid].token_ids)
    for a, b in zip(lps["off"], lps["on"]):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4) and len(b.top) == 2


def test_async_engine_streams_speculated_tokens(tiny_llama_dir):
    want = run(engine(tiny_llama_dir, SpecConfig()), GREEDY)
    ae = AsyncEngine(engine(tiny_llama_dir, SpecConfig(method="ngram", **ALWAYS)))

    async def one(i: int) -> list[int]:
        ids: list[int] = []
        async for out in ae.generate(f"r{i}", PROMPTS[i], GREEDY):
            ids += out.new_token_ids
        return ids

    async def main():
        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

    try:
        assert [tuple(g) for g in asyncio.run(main())] == want
    finally:
        ae.shutdown()


def test_auto_policy_speculates_only_where_it_pays(tiny_llama_dir):
    # A drafter as costly as the model itself never pays: the policy must keep it off.
    e = engine(tiny_llama_dir, SpecConfig(method="early_exit", exit_layer=99))
    run(e, GREEDY)
    assert e.stats().num_spec_steps == 0
    e = engine(tiny_llama_dir, SpecConfig(method="ngram"))  # free drafts on a repeating prompt do
    assert run(e, GREEDY, PROMPTS[:1]) == run(engine(tiny_llama_dir, SpecConfig()), GREEDY, PROMPTS[:1])
    assert e.stats().num_accepted_tokens > 0


def test_bad_spec_config():
    with pytest.raises(ValueError, match="method"):
        SpecConfig(method="medusa")
    with pytest.raises(ValueError, match="draft_model"):
        SpecConfig(method="draft")
    with pytest.raises(ValueError, match="max_draft_tokens"):
        SpecConfig(method="ngram", max_draft_tokens=0)
    with pytest.raises(ValueError, match="policy"):
        SpecConfig(method="ngram", policy="sometimes")


@pytest.mark.parametrize("hard", [False, True])
def test_speculation_under_request_aware_paging(tiny_llama_dir, hard):
    # Long requests hold runs of blocks ahead; rejected drafts' slots go back to the run (trim).
    from actors.engine.paging import PagingPolicy

    paging = PagingPolicy(mode="request_aware", long_tokens=32, run_blocks=4, hard_holds=hard)
    want = run(engine(tiny_llama_dir, SpecConfig()), GREEDY)
    e = engine(tiny_llama_dir, SpecConfig(method="ngram", **ALWAYS), kv_paging=paging)
    outs = e.generate(PROMPTS, GREEDY)
    e.check_integrity()
    assert [o.token_ids for o in outs] == want
    assert e.stats().num_draft_tokens > e.stats().num_accepted_tokens > 0


@pytest.mark.parametrize("name", ["ngram", "early_exit"])
def test_speculation_on_a_moe_model_with_expert_budgets(tiny_moe_dir, name):
    # Verify rows keep the MoE budget layout (a chunk's tokens adjacent rows); early-exit draft
    # passes route with the step's table but outside its budget layout and its load counts.
    from actors.engine.moe.budget import ExpertBudgets
    from actors.engine.moe.control import install_moe_control

    def served(spec: SpecConfig):
        e = engine(tiny_moe_dir, spec)
        control = install_moe_control(e, ExpertBudgets(default=2))
        return run(e, GREEDY), e, control

    want, _, plain = served(SpecConfig())
    got, e, control = served(SPECS[name])
    assert got == want
    assert e.stats().num_spec_steps > 0
    assert control.report().num_budgeted_requests == plain.report().num_budgeted_requests > 0
