"""Speculative decoding's rollback and adaptation through the engine (tiny random model, float32,
greedy): KV written by verify steps with rejected drafts is what a plain engine computes (a later
request that reuses it through the prefix cache gives the plain engine's tokens), rejected slots
are freed every step, k falls as drafts keep being rejected, and decode row-steps are counted."""

from __future__ import annotations

import math

import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine, PreparedStep
from actors.engine.loader import load_model
from actors.engine.options import RequestOptions
from actors.engine.sampling import SamplingParams
from actors.engine.spec import SpecConfig
from actors.engine.spec.policy import TokenTimeModel

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
PROMPT = list(range(20, 60))
BLOCK = 4  # smaller than 1 + k: a verify's rejected slots spill into a block of their own


def engine(path, spec: SpecConfig) -> Engine:
    cfg = EngineConfig(num_blocks=128, block_size=BLOCK, dtype="float32", speculation=spec)
    model, tokenizer = load_model(path, cfg.resolved(torch.device("cpu")))
    return Engine(model, tokenizer, cfg)


def plain_tokens(path, prompt: list[int]) -> tuple[int, ...]:
    return engine(path, SpecConfig()).generate([prompt], GREEDY)[0].token_ids


def test_kv_written_around_rejected_drafts_serves_a_later_request(tiny_llama_dir):
    # Drafts from the first layer alone, 4 every decode step: mostly wrong, some right.
    e = engine(tiny_llama_dir, SpecConfig(method="early_exit", exit_layer=1, policy="always", max_draft_tokens=4))
    speculated: list[set[str]] = []
    e.step_hooks.append(lambda p: speculated.append({r.req.request_id for r in p.spec}))
    e.add_request("a", PROMPT, GREEDY)
    final = None
    while e.has_unfinished_requests():
        for out in e.step():
            final = out if out.finished else final
        # Between steps a running request holds the blocks of its computed tokens and of the one
        # token it emitted last, whose KV the next step writes (settle: num_computed = num_tokens
        # - 1, blocks trimmed to num_tokens): never the slots of rejected drafts.
        for req in e.scheduler.running:
            assert e.kv.num_held_blocks(req.request_id) <= math.ceil((req.num_computed_tokens + 1) / BLOCK)
    assert final is not None and final.token_ids == plain_tokens(tiny_llama_dir, PROMPT)
    assert final.num_draft_tokens > final.num_accepted_tokens > 0  # drafts rejected, some accepted
    assert sum("a" in s for s in speculated) >= 5
    assert len(final.token_ids) == GREEDY.max_tokens

    # A prompt that runs through blocks "a" computed while verifying drafts (its prompt's and 32 of
    # its outputs'): served from the prefix cache, it gives the plain engine's tokens for it.
    prompt = PROMPT + list(final.token_ids[:32])
    hits_before = e.stats().num_prefix_hit_tokens
    e.add_request("b", prompt, GREEDY, RequestOptions(speculation=False))
    got = None
    while e.has_unfinished_requests():
        for out in e.step():
            got = out if out.finished else got
    hit = e.stats().num_prefix_hit_tokens - hits_before
    assert hit > len(PROMPT)  # blocks written by verify steps were reused, not only the prompt's
    assert got is not None and got.token_ids == plain_tokens(tiny_llama_dir, prompt)
    e.check_integrity()
    assert e.kv.pool.num_free_blocks == e.num_blocks


class WrongDrafts:
    """An n-gram proposer whose drafts are a token the model never emits for the request."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, token_ids: list[int], k: int, request_id: str | None = None) -> list[int]:
        return [self.token] * k

    def forget(self, live) -> None:  # type: ignore[no-untyped-def]
        pass


def test_k_falls_while_drafts_keep_being_rejected(tiny_llama_dir):
    want = plain_tokens(tiny_llama_dir, PROMPT)
    wrong = next(t for t in range(4, 512) if t not in want)
    e = engine(tiny_llama_dir, SpecConfig(method="ngram", max_draft_tokens=4))  # the auto policy
    e.spec.ngram = WrongDrafts(wrong)  # type: ignore[assignment]
    # Step times fixed at the prior (weight-bound: a draft costs 0.1% of a step), so that only the
    # acceptance estimate moves k: at the prior's 0.6 per draft all 4 drafts pay; once every round
    # has been rejected the estimate falls under the 3% a draft must add, and k reaches 0.
    e.spec.step_model = TokenTimeModel(strength=1e12)
    ks: list[int] = []

    def record(p: PreparedStep) -> None:
        if p.batch.requests[0].num_output_tokens > 0:  # decode steps only
            ks.append(sum(r.k for r in p.spec))

    e.step_hooks.append(record)
    out = e.generate([PROMPT], GREEDY)[0]
    assert out.token_ids == want and out.num_accepted_tokens == 0
    assert ks[0] == 4
    assert all(a >= b for a, b in zip(ks, ks[1:])), ks  # never rises: no draft is ever accepted
    assert ks[-10:] == [0] * 10
    # Every decode step is one decode row-step (39: no draft was accepted), speculating or not.
    stats = e.stats()
    assert stats.num_decode_rows == len(ks) == GREEDY.max_tokens - 1
    assert stats.num_spec_rounds == sum(k > 0 for k in ks) < stats.num_decode_rows
