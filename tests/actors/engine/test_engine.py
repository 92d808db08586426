"""End-to-end engine behaviour on tiny random models: logits, prefix reuse, preemption, sampling,
stop conditions and bad input. Everything is asserted exactly (token ids, block ids, counts)."""

from __future__ import annotations

import pytest
import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.errors import (
    ContextLengthExceeded,
    DuplicateRequestId,
    EmptyPrompt,
    InvalidSamplingParams,
    TokenOutOfVocab,
)
from actors.engine.model_runner import SeqChunk
from actors.engine.options import RequestOptions
from actors.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def make_engine(path, **kw) -> Engine:
    kw.setdefault("num_blocks", 128)
    return Engine.from_pretrained(path, EngineConfig(**kw))


def prompts(n: int, length: int, seed: int = 0, vocab: int = 500) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (length + 3 * i,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_moe_dir"])
def test_logits_match_transformers(request, model_fixture):
    transformers = pytest.importorskip("transformers")
    path = request.getfixturevalue(model_fixture)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    engine = make_engine(path)
    ids = prompts(2, 37, seed=3)
    with torch.no_grad():
        want = [ref(torch.tensor([p])).logits[0] for p in ids]
    # Sequence 0 in two chunks (the second sees the first through the paged cache), sequence 1
    # whole, then one decode step for sequence 0: every path of the attention code.
    runner = engine.runner
    b0, b1 = [0, 1, 2], [3, 4, 5]
    got = runner.execute([SeqChunk(ids[0][:20], 0, b0, True), SeqChunk(ids[1], 0, b1, True)])
    torch.testing.assert_close(got[0], want[0][19], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1], want[1][-1], atol=1e-4, rtol=0)
    got = runner.execute([SeqChunk(ids[0][20:36], 20, b0, True)])
    torch.testing.assert_close(got[0], want[0][35], atol=1e-4, rtol=0)
    got = runner.execute([SeqChunk(ids[0][36:], 36, b0, True), SeqChunk([ids[1][-1]], 39, b1, False)])
    torch.testing.assert_close(got[0], want[0][36], atol=1e-4, rtol=0)


def test_greedy_matches_transformers_generate(tiny_llama_dir):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    engine = make_engine(tiny_llama_dir)
    batch = prompts(4, 21, seed=5)
    outs = engine.generate(batch, GREEDY)
    for p, out in zip(batch, outs):
        want = ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert list(out.token_ids) == want[0, len(p):].tolist()


def test_prefix_reuse_computes_only_new_tokens(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=32, block_size=16)
    shared = prompts(1, 40, seed=7)[0][:40]  # 2 full blocks + 8 tokens
    first = engine.add_request("a", shared + [11, 12, 13], GREEDY)
    engine.step()
    assert first.num_forwarded_tokens == 43 and first.num_prefix_hit_tokens == 0
    blocks_a = engine.kv.block_ids("a")
    assert blocks_a == [0, 1, 2]
    second = engine.add_request("b", shared + [21, 22], GREEDY)
    engine.step()
    # Only the 10 tokens after the 32 cached ones are computed (plus a's one decode token).
    assert second.num_prefix_hit_tokens == 32
    assert second.num_forwarded_tokens == 42 - 32
    assert engine.kv.block_ids("b")[:2] == blocks_a[:2]
    assert [engine.kv.pool.blocks[i].ref_cnt for i in blocks_a] == [2, 2, 1]
    stats = engine.stats()
    assert stats.num_prefix_hit_tokens == 32
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)


def test_cached_prefix_gives_same_tokens(tiny_llama_dir):
    shared = prompts(1, 50, seed=9)[0]
    cold = make_engine(tiny_llama_dir, enable_prefix_caching=False).generate([shared + [5, 6]], GREEDY)
    warm_engine = make_engine(tiny_llama_dir)
    warm_engine.generate([shared + [7]], GREEDY)
    [warm] = warm_engine.generate([shared + [5, 6]], GREEDY)
    assert warm.num_cached_tokens == 48
    assert warm.token_ids == cold[0].token_ids


def test_preemption_under_block_pressure_gives_same_output(tiny_llama_dir):
    batch = prompts(6, 30, seed=11)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    roomy = make_engine(tiny_llama_dir, num_blocks=256)
    want = [o.token_ids for o in roomy.generate(batch, params)]
    assert roomy.stats().num_preemptions == 0
    # Each request needs up to 6 blocks of 16 at the end; 14 blocks cannot hold six of them.
    tight = make_engine(tiny_llama_dir, num_blocks=14, max_num_batched_tokens=64)
    got = [o.token_ids for o in tight.generate(batch, params)]
    assert tight.stats().num_preemptions > 0
    assert got == want
    tight.check_integrity()
    assert tight.kv.pool.num_free_blocks == 14


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    batch = prompts(3, 15, seed=13)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    together = [o.token_ids for o in engine.generate(batch, params)]
    alone = [engine.generate([p], params)[0].token_ids for p in batch]
    assert together == alone
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    assert engine.generate([batch[0]], other_seed)[0].token_ids != together[0]


def test_stop_token_and_max_tokens(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    p = prompts(1, 20, seed=17)[0]
    [free] = engine.generate([p], GREEDY)
    stop_id = free.token_ids[4]
    first_at = free.token_ids.index(stop_id)
    [out] = engine.generate([p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(stop_id,)))
    assert out.token_ids == free.token_ids[: first_at + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert free.finish_reason == "length" and len(free.token_ids) == 12


def test_stop_strings_cut_exactly(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    p = prompts(1, 20, seed=19)[0]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    [free] = engine.generate([p], params)
    text = free.text
    assert len(text) > 12
    stop = text[6:9]
    cut = text.find(stop)
    engine.add_request("s", p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=(stop, "\x00never")))
    streamed = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed.append(out.new_text)
            final = out
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == text[:cut]
    assert "".join(streamed) == text[:cut]  # held-back text never leaked a piece of the stop string


def test_abort_frees_blocks_and_others_continue(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    a, b = prompts(2, 33, seed=23)
    engine.add_request("a", a, GREEDY)
    engine.add_request("b", b, GREEDY)
    engine.step()
    out = engine.abort("a")
    assert out.finished and out.finish_reason == "abort"
    assert engine.abort("a") is None
    engine.check_integrity()
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["b"] and len(finished[0].token_ids) == 12
    engine.check_integrity()


def test_waiting_interactive_requests_are_admitted_before_batch_ones(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_num_seqs=1)  # one row: the queue order is the run order
    ps = prompts(5, 20, seed=31)
    engine.add_request("running", ps[0], GREEDY)
    engine.step()  # takes the row
    for rid, p, rank in (("b1", ps[1], 1), ("i1", ps[2], 0), ("b2", ps[3], 1), ("i2", ps[4], 0)):
        engine.add_request(rid, p, GREEDY, RequestOptions(priority_rank=rank))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["running", "i1", "i2", "b1", "b2"]  # arrival order within a rank
    engine.check_integrity()


def test_bad_input_raises_and_engine_keeps_serving(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_model_len=64)
    engine.add_request("ok", [5, 6, 7], GREEDY)
    with pytest.raises(EmptyPrompt):
        engine.add_request("e1", [], GREEDY)
    with pytest.raises(EmptyPrompt):
        engine.add_request("e2", "", GREEDY)
    with pytest.raises(TokenOutOfVocab):
        engine.add_request("e3", [5, 10**6], GREEDY)
    with pytest.raises(TokenOutOfVocab):
        engine.add_request("e4", [-1], GREEDY)
    with pytest.raises(ContextLengthExceeded):
        engine.add_request("e5", [5] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(InvalidSamplingParams):
        engine.add_request("e6", [5], SamplingParams(max_tokens=4, stop_token_ids=(10**6,)))
    with pytest.raises(InvalidSamplingParams):
        SamplingParams(temperature=-1)
    with pytest.raises(DuplicateRequestId):
        engine.add_request("ok", [5], GREEDY)
    small = make_engine(tiny_llama_dir, num_blocks=2)
    with pytest.raises(ContextLengthExceeded, match="KV blocks"):
        small.add_request("big", [5] * 30, SamplingParams(max_tokens=10))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].request_id == "ok" and outs[-1].finished and len(outs[-1].token_ids) == 12
    engine.check_integrity()


def test_text_prompt_and_chat(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    ids = engine.encode_chat([{"role": "user", "content": "The ferry leaves the harbor"}])
    assert ids[0] == engine.tokenizer.encode("<|im_start|>", add_special_tokens=False)[0]
    [a] = engine.generate(["The capital of France"], GREEDY)
    [b] = engine.generate([engine.tokenizer.encode("The capital of France")], GREEDY)
    assert a.token_ids == b.token_ids and a.text == engine.tokenizer.decode(list(a.token_ids))


def test_bfloat16_runs_and_mostly_agrees(tiny_llama_dir):
    batch = prompts(4, 20, seed=29)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    fp32 = [o.token_ids for o in make_engine(tiny_llama_dir).generate(batch, params)]
    bf16 = [o.token_ids for o in make_engine(tiny_llama_dir, dtype="bfloat16").generate(batch, params)]
    assert make_engine(tiny_llama_dir, dtype="bfloat16").runner.kv_caches[0][0].dtype == torch.bfloat16
    # first tokens agree; later ones may drift with bf16 rounding on a random model
    assert sum(a[0] == b[0] for a, b in zip(fp32, bf16)) >= 3


def test_a_request_chunk_cap_spreads_its_prefill_and_changes_no_token(tiny_llama_dir):
    """A decode worker prefilling for itself caps that prompt's tokens per step (the scheduler's
    `local_chunk_tokens`): the running row decodes in every step, the prompt takes ceil(70 / 16)
    steps instead of one, and the tokens are those of an uncapped run."""
    row, prompt = prompts(2, 70, seed=23)
    want = [list(o.token_ids) for o in make_engine(tiny_llama_dir).generate([row, prompt], GREEDY)]
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=512)
    engine.add_request("row", row, GREEDY)
    engine.step()  # the row's prompt, whole; it decodes from now on
    engine.take_step_records()
    engine.add_request("capped", prompt, GREEDY, RequestOptions(max_chunk_tokens=16))
    outputs: dict[str, list[int]] = {"row": [], "capped": []}
    prefill_steps = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = list(out.token_ids)
        for rec in engine.take_step_records():
            if rec.num_prefill_tokens:
                prefill_steps.append((rec.num_prefill_tokens, rec.num_decode_seqs))
    # 73 prompt tokens (prompts() adds 3 per index): 16 x 4 + 9, each chunk beside the row's decode.
    assert prefill_steps == [(16, 1)] * 4 + [(9, 1)]
    assert [outputs["row"], outputs["capped"]] == want
    with pytest.raises(ValueError, match="max_chunk_tokens"):
        engine.add_request("bad", prompt, GREEDY, RequestOptions(max_chunk_tokens=0))
    from actors.messages import GenerationRequest

    with pytest.raises(ValueError, match="max_chunk_tokens"):  # refused before it reaches a worker
        GenerationRequest("bad", prompt, GREEDY, max_chunk_tokens=0)
    assert GenerationRequest("ok", prompt, GREEDY, max_chunk_tokens=16).engine_options().max_chunk_tokens == 16


def test_capped_prompts_share_one_chunk_per_step_beside_decode_rows_only(tiny_llama_dir):
    """Two local prefills at once must not double the step their caps were sized for: together
    they take at most the smaller cap per step, first come first. An uncapped prompt is not held,
    and a step with no decode row to protect lifts the caps."""
    row, a, b, c = prompts(4, 40, seed=29)  # 40, 43, 46 and 49 tokens
    want = [list(o.token_ids) for o in make_engine(tiny_llama_dir).generate([a, b], GREEDY)]
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=512)
    engine.add_request("row", row, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    engine.step()  # the row's prompt, whole; it decodes from now on
    engine.take_step_records()
    engine.add_request("a", a, GREEDY, RequestOptions(max_chunk_tokens=16))
    engine.add_request("b", b, GREEDY, RequestOptions(max_chunk_tokens=24))
    outputs: dict[str, list[int]] = {}
    per_step = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = list(out.token_ids)
        per_step += [r.num_prefill_tokens for r in engine.take_step_records()]
    # a first, 16 a step; b takes the 5 left in a's last step, then its own 24 a step.
    assert per_step[:5] == [16, 16, 11 + 5, 24, 17] and not any(per_step[5:])  # then decodes only
    assert [outputs["a"], outputs["b"]] == want
    engine.add_request("c", c, GREEDY, RequestOptions(max_chunk_tokens=8))  # nothing else runs: no cap
    engine.step()
    assert engine.take_step_records()[0].num_prefill_tokens == 49
    d, e = prompts(2, 30, seed=31)
    engine.add_request("d", d, GREEDY, RequestOptions(max_chunk_tokens=8))  # c decodes now: capped again
    engine.add_request("e", e, GREEDY)
    engine.step()
    assert engine.take_step_records()[0].num_prefill_tokens == 8 + 33  # the uncapped prompt goes whole
