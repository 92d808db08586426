"""KV handed from one engine to another (disaggregation) and requests resumed from a journal
(recovery): both must continue exactly as if nothing had happened."""

from __future__ import annotations

import pytest

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.options import RequestOptions
from actors.engine.sampling import SamplingParams
from transfer.units import MIB

from .test_engine import prompts


def run_to_end(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_prefill_engine_hands_kv_to_decode_engine(tiny_llama_dir):
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True)
    batch = prompts(3, 37, seed=31)
    want = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=64)).generate(batch, params)

    prefill = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=64))
    decode = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=64))
    first_only = SamplingParams(max_tokens=1, temperature=0.8, seed=5, ignore_eos=True)
    for i, p in enumerate(batch):
        prefill.add_request(f"r{i}", p, first_only, RequestOptions(hold_kv=True))
    firsts = run_to_end(prefill)
    for i, p in enumerate(batch):
        rid = f"r{i}"
        block_ids, num_kv = prefill.held_kv(rid)
        assert num_kv == len(p)
        kv = prefill.runner.read_blocks(block_ids)
        dst = decode.reserve(rid, p, params, RequestOptions(output_token_ids=tuple(firsts[rid]), seed=5), num_kv_tokens=num_kv)
        # shard by layer groups, as the transfer codec does
        decode.runner.write_blocks(dst, kv[:1], range(0, 1))
        decode.runner.write_blocks(dst, kv[1:], range(1, kv.shape[0]))
        assert prefill.release_kv(rid)
        decode.commit(rid)
    rest = run_to_end(decode)
    for i, w in enumerate(want):
        assert firsts[f"r{i}"] + rest[f"r{i}"] == list(w.token_ids)
    assert prefill.kv.pool.num_free_blocks == 64
    decode.check_integrity()
    assert decode.kv.pool.num_free_blocks == 64


def test_cancelled_reservation_frees_blocks(tiny_llama_dir):
    engine = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=16))
    ids = engine.reserve("x", list(range(5, 40)), SamplingParams(max_tokens=4), RequestOptions(output_token_ids=(7,), seed=1),
                         num_kv_tokens=35)
    assert ids is not None and len(ids) == 3 and engine.kv.pool.num_free_blocks == 13
    # 14 blocks would fit an empty pool but not the 13 left: "no room now", nothing changed
    assert engine.reserve("y", list(range(5, 215)), SamplingParams(max_tokens=4), RequestOptions(output_token_ids=(7,), seed=1),
                          num_kv_tokens=210) is None
    assert engine.kv.pool.num_free_blocks == 13
    assert engine.abort("x") is None
    assert engine.kv.pool.num_free_blocks == 16
    engine.check_integrity()


def test_resume_from_journal_continues_the_same_stream(tiny_llama_dir):
    engine = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=64))
    p = prompts(1, 25, seed=37)[0]
    for params in (SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=16, temperature=1.0, top_k=20, ignore_eos=True)):
        engine.add_request("full", p, params, RequestOptions(seed=77))
        full = run_to_end(engine)["full"]
        engine.add_request("resumed", p, params, RequestOptions(seed=77, output_token_ids=full[:6]))
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert full[:6] + [t for o in outs for t in o.new_token_ids] == full
        assert outs[-1].token_ids == tuple(full)


def test_imported_prefix_blocks_are_reused(tiny_llama_dir):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    p = prompts(1, 40, seed=41)[0]
    source = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=32))
    source.add_request("src", p, params, RequestOptions(hold_kv=True))
    want = run_to_end(source)["src"]
    block_ids, _ = source.held_kv("src")
    hashes = source._held["src"].block_hashes[:2]
    kv = source.runner.read_blocks(block_ids[:2])

    target = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=32))
    assert target.cached_prefix_len(hashes) == 0
    assert target.import_cached_blocks(hashes, kv) == 2
    assert target.cached_prefix_len(hashes) == 2 and target.kv.pool.num_free_blocks == 32
    req = target.add_request("dst", p, params)
    got = run_to_end(target)["dst"]
    assert req.num_prefix_hit_tokens == 32 and req.num_forwarded_tokens == 8 + 7
    assert got == want
    target.check_integrity()


def test_tenant_salt_and_shared_prefix(tiny_llama_dir):
    engine = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=64))
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    system = prompts(1, 32, seed=43)[0][:32]  # exactly 2 blocks
    p = system + [9, 8, 7, 6, 5] * 4
    engine.add_request("a1", p, params, RequestOptions(extra_keys=("tenant-a",)))
    run_to_end(engine)
    b = engine.add_request("b1", p, params, RequestOptions(extra_keys=("tenant-b",)))
    run_to_end(engine)
    assert b.num_prefix_hit_tokens == 0  # same prompt, other tenant: nothing shared
    a2 = engine.add_request("a2", p, params, RequestOptions(extra_keys=("tenant-a",)))
    run_to_end(engine)
    assert a2.num_prefix_hit_tokens == 48
    # opted-in shared system prompt: its blocks are shared, the tenant's own tokens are not
    engine.add_request("c1", p, params, RequestOptions(extra_keys=("tenant-c",), num_shared_prefix_tokens=32))
    run_to_end(engine)
    d = engine.add_request("d1", p, params, RequestOptions(extra_keys=("tenant-d",), num_shared_prefix_tokens=32))
    run_to_end(engine)
    assert d.num_prefix_hit_tokens == 32


def test_prefill_only_then_decode_engine_samples_everything(tiny_llama_dir):
    params = SamplingParams(max_tokens=10, temperature=0.7, seed=3, ignore_eos=True)
    batch = prompts(3, 33, seed=53)
    want = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=64)).generate(batch, params)
    prefill = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=64, max_num_batched_tokens=48))
    decode = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=64))
    for i, p in enumerate(batch):
        prefill.add_request(f"r{i}", p, params, RequestOptions(prefill_only=True))
    outs = []
    while prefill.has_unfinished_requests():
        outs += prefill.step()
    assert sorted(o.finish_reason for o in outs) == ["prefilled"] * 3
    assert all(o.token_ids == () for o in outs)
    for i, p in enumerate(batch):
        block_ids, num_kv = prefill.held_kv(f"r{i}")
        assert num_kv == len(p)
        # the decode side recomputes the last prompt token to get its logits
        dst = decode.reserve(f"r{i}", p, params, RequestOptions(seed=3), num_kv_tokens=len(p) - 1)
        decode.runner.write_blocks(dst, prefill.runner.read_blocks(block_ids)[:, :, : len(dst)])
        prefill.release_kv(f"r{i}")
        decode.commit(f"r{i}")
    got = run_to_end(decode)
    assert [got[f"r{i}"] for i in range(3)] == [list(w.token_ids) for w in want]
    assert decode.stats().num_forwarded_tokens == 3 * 10  # 1 recomputed prompt token + 9 decodes each
    assert prefill.kv.pool.num_free_blocks == 64


def test_abort_during_forward_is_deferred_to_the_end_of_the_step(tiny_llama_dir):
    engine = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=8))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(5, 65)), params)  # 4 blocks
    prepared = engine.prepare_step()
    held = engine.kv.block_ids("a")
    assert engine.abort("a") is None  # deferred: the forward pass is writing a's blocks
    # a reservation made meanwhile must not get a's blocks
    got = engine.reserve("b", list(range(5, 70)), params, RequestOptions(seed=1), num_kv_tokens=64)
    assert got is None or not set(got) & set(held)
    outs = engine.finish_step(prepared, engine.runner.execute(prepared.chunks))
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "abort")]
    assert engine.kv.block_ids("a") == [] and not engine.has_unfinished_requests()
    engine.check_integrity()


def test_long_prompts_ship_in_more_shards_so_each_fits_the_staging() -> None:
    from actors.handoff import HandoffTooLarge, num_handoff_shards

    assert num_handoff_shards(10 * MIB, 30, 2, 64 * MIB) == 2  # the configured count when shards fit
    # SmolLM2 at 8,100 tokens in float32: 356 MiB of KV, shards of at most 16 MiB (a quarter of 64)
    raw = 8100 * 30 * 2 * 3 * 64 * 4
    n = num_handoff_shards(raw, 30, 2, 64 * MIB)
    assert n == 23 and -(-raw // n) <= 16 * MIB
    assert num_handoff_shards(raw, 30, 2, 16 * MIB) == 30  # one layer (11.9 MiB) per shard at most
    with pytest.raises(HandoffTooLarge, match="transfer.staging_mib"):
        num_handoff_shards(raw, 30, 2, 8 * MIB)


def test_a_resume_takes_the_next_row_before_new_requests_and_handoffs(tiny_llama_dir):
    """A recovered request (tokens already streamed) waiting for a row gets the first one that
    frees: ahead of fresh requests queued before it, and before a new handoff's reservation."""
    engine = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=64, max_num_seqs=2))
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    p = prompts(4, 12, seed=41)
    engine.add_request("a", p[0], params)
    engine.add_request("b", p[1], params)
    engine.step()  # both rows taken
    engine.add_request("fresh", p[2], params)
    engine.add_request("resumed", p[3], params, RequestOptions(seed=3, output_token_ids=(5, 6, 7)))
    assert [r.request_id for r in engine.scheduler.waiting] == ["resumed", "fresh"]
    handoff = ("h", list(range(5, 30)), params, RequestOptions())
    assert engine.reserve(*handoff, num_kv_tokens=24) is None  # no row
    engine.abort("a")
    assert engine.reserve(*handoff, num_kv_tokens=24) is None  # the free row is the resume's
    engine.step()
    assert {r.request_id for r in engine.scheduler.running} == {"b", "resumed"}
    assert [r.request_id for r in engine.scheduler.waiting] == ["fresh"]
    engine.abort("b")
    assert engine.reserve(*handoff, num_kv_tokens=24) is not None  # a fresh request does not hold rows back
    engine.check_integrity()
