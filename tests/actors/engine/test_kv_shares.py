"""KV as a managed resource inside one engine: per-tenant shares of the blocks (eviction order,
ceilings, guarantees) and host offload of batch-class KV for interactive work. Tiny random model,
float32; outputs are compared token for token with runs that had all the room they wanted."""

from __future__ import annotations

import torch

from actors.engine.block_pool import BlockPool
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.options import RequestOptions
from actors.engine.sampling import SamplingParams
from actors.engine.shares import TenantShare, TenantShares


def make_engine(path, **kw) -> Engine:
    kw.setdefault("num_blocks", 128)
    return Engine.from_pretrained(path, EngineConfig(**kw))


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(4, 500, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def run_all(engine: Engine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return done


def add_all(engine: Engine, reqs: dict[str, tuple[list[int], int]], max_tokens: int) -> None:
    """Adds `reqs` (id -> (prompt, priority rank)) in order, greedy."""
    for rid, (p, rank) in reqs.items():
        engine.add_request(rid, p, greedy(max_tokens), RequestOptions(priority_rank=rank))


def cache(pool: BlockPool, tenant: str, n: int, first_hash: int) -> list[int]:
    """`n` blocks of `tenant`, computed, cached under hashes and freed: evictable prefixes."""
    blocks = pool.allocate(n, tenant)
    for i, b in enumerate(blocks):
        pool.cache_block(b, first_hash + i)
    pool.free(blocks)
    return [b.block_id for b in blocks]


def test_eviction_takes_from_the_tenant_furthest_above_its_guarantee():
    shares = TenantShares.of_mapping({"quiet": TenantShare(guaranteed=0.5), "flood": TenantShare()})
    for with_shares in (False, True):
        pool = BlockPool(10, shares=shares if with_shares else None)
        quiet = cache(pool, "quiet", 3, 100)  # freed first: the least recently used
        flood = cache(pool, "flood", 7, 200)
        pool.allocate(3, "flood")  # a new flood prefix needs three blocks
        kept = {b.block_id for b in pool.blocks if b.block_hash is not None}
        # LRU evicts the quiet tenant's (older) prefix; shares take the flooder's oldest, it being
        # above its guarantee (0) and the quiet tenant within its own (5 blocks).
        assert kept == (set(quiet) | set(flood[3:]) if with_shares else set(flood))
        assert pool.usage() == ({"flood": 10} if not with_shares else {"quiet": 3, "flood": 7})
        pool.check_integrity()


def test_a_tenant_at_its_ceiling_waits_for_its_own_blocks_and_others_run(tiny_llama_dir):
    shares = TenantShares.of_mapping({"a": TenantShare(max=0.5)})
    engine = make_engine(tiny_llama_dir, num_blocks=16, tenant_kv_shares=shares)
    roomy = make_engine(tiny_llama_dir)
    reqs = [(f"a{i}", "a", prompt(40, i)) for i in range(4)] + [("b0", "b", prompt(40, 9))]
    for rid, tenant, p in reqs:
        engine.add_request(rid, p, greedy(20), RequestOptions(tenant=tenant))
        roomy.add_request(rid, p, greedy(20), RequestOptions(tenant=tenant))
    peak_a = 0
    first_b = None
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "b0" and first_b is None:
                first_b = engine.stats().num_steps
            if out.finished:
                done[out.request_id] = out.token_ids
        peak_a = max(peak_a, engine.kv.pool.in_use.get("a", 0))
        engine.check_integrity()
    assert peak_a <= 8  # half of 16 blocks: a's four prompts (3 blocks each, 4 at the end) never all run
    assert first_b == 1  # b is admitted in the first step although a queued first
    assert done == run_all(roomy)


def test_a_tenant_below_its_guarantee_takes_room_from_one_above_it(tiny_llama_dir):
    shares = TenantShares.of_mapping({"a": TenantShare(guaranteed=0.5), "b": TenantShare()})
    engine = make_engine(tiny_llama_dir, num_blocks=12, tenant_kv_shares=shares, max_num_batched_tokens=256)
    for i in range(3):
        engine.add_request(f"b{i}", prompt(60, 20 + i), greedy(8), RequestOptions(tenant="b"))
    engine.step()
    assert engine.kv.pool.num_free_blocks == 0  # b holds every block
    engine.add_request("a0", prompt(40, 30), greedy(4), RequestOptions(tenant="a"))
    engine.step()
    assert engine.kv.pool.in_use.get("a") == 3 and engine.stats().num_preemptions == 1
    done = run_all(engine)
    roomy = make_engine(tiny_llama_dir)
    for i in range(3):
        roomy.add_request(f"b{i}", prompt(60, 20 + i), greedy(8))
    roomy.add_request("a0", prompt(40, 30), greedy(4))
    assert done == {k: v for k, v in run_all(roomy).items() if k in done} and len(done) == 4


def _batch_then_interactive(engine: Engine) -> tuple[dict[str, list[int]], int | None]:
    """A batch request holding most blocks, then an interactive one that needs some of them;
    returns the outputs and the step of the interactive request's first token."""
    engine.add_request("batch", prompt(60, 1), greedy(60), RequestOptions(priority_rank=1))
    while engine.kv.num_held_blocks("batch") < 6:
        engine.step()
    engine.add_request("chat", prompt(50, 2), greedy(5), RequestOptions(priority_rank=0))
    start, first = engine.stats().num_steps, None
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "chat" and first is None:
                first = engine.stats().num_steps - start
            if out.finished:
                done[out.request_id] = out.token_ids
        engine.check_integrity()
    return done, first


def test_batch_kv_goes_to_host_memory_for_interactive_work_and_comes_back_unchanged(tiny_llama_dir):
    solo = make_engine(tiny_llama_dir)
    solo.add_request("batch", prompt(60, 1), greedy(60))
    want_batch = run_all(solo)["batch"]
    forwarded_solo = solo.stats().num_forwarded_tokens

    engine = make_engine(tiny_llama_dir, num_blocks=9)
    done, first = _batch_then_interactive(engine)
    stats = engine.stats()
    assert first == 1  # the interactive request's prompt ran in the very next step
    assert stats.num_offloads == 1 and stats.offloaded_bytes == 0
    assert done["batch"] == want_batch  # restored bits, same continuation
    # Nothing was recomputed: the batch request forwarded exactly what it did alone (60 + 59), the chat 50 + 4.
    assert stats.num_forwarded_tokens == forwarded_solo + 54
    assert engine.kv.pool.num_free_blocks == 9


def test_without_offload_room_interactive_work_waits_for_the_batch_request(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=9, max_offload_bytes=0)
    done, first = _batch_then_interactive(engine)
    assert engine.stats().num_offloads == 0 and first is not None and first > 10
    assert len(done) == 2


def test_an_aborted_offloaded_request_gives_its_host_memory_back(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=9)
    engine.add_request("batch", prompt(60, 1), greedy(60), RequestOptions(priority_rank=1))
    while engine.kv.num_held_blocks("batch") < 6:
        engine.step()
    engine.add_request("chat", prompt(50, 2), greedy(5))
    engine.step()
    assert engine.scheduler.offload.holds("batch") and engine.stats().offloaded_bytes > 0
    engine.abort("batch")
    assert engine.stats().offloaded_bytes == 0 and not engine.scheduler.offload.holds("batch")
    run_all(engine)
    engine.check_integrity()


def test_kv_handed_over_for_an_interactive_request_offloads_a_batch_request(tiny_llama_dir):
    solo = make_engine(tiny_llama_dir)
    solo.add_request("batch", prompt(60, 1), greedy(60))
    solo.add_request("chat", prompt(50, 2), greedy(5))
    want = run_all(solo)
    prefill = make_engine(tiny_llama_dir)  # computes the chat prompt's KV, as a prefill worker would
    prefill.add_request("chat", prompt(50, 2), greedy(5), RequestOptions(prefill_only=True))
    run_all(prefill)
    block_ids, _ = prefill.held_kv("chat")
    kv = prefill.runner.read_blocks(block_ids[:4])  # the first 49 tokens' blocks

    decode = make_engine(tiny_llama_dir, num_blocks=9)
    decode.add_request("batch", prompt(60, 1), greedy(60), RequestOptions(priority_rank=1))
    while decode.kv.num_held_blocks("batch") < 6:
        decode.step()
    got = decode.reserve("chat", prompt(50, 2), greedy(5), RequestOptions(), num_kv_tokens=49)
    assert got is not None and decode.stats().num_offloads == 1  # 3 blocks free, 4 needed: batch went out
    decode.runner.write_blocks(got, kv)
    decode.commit("chat")
    assert run_all(decode) == want
    decode.check_integrity()


def test_block_pressure_takes_from_the_batch_request_first_and_offloads_it(tiny_llama_dir):
    params = {"chat0": (prompt(40, 3), 0), "batch": (prompt(40, 4), 1), "chat1": (prompt(40, 5), 0)}
    roomy = make_engine(tiny_llama_dir)
    add_all(roomy, params, 40)
    want = run_all(roomy)
    # 3 blocks each for the prompts, 5 each at the end: 13 blocks cannot hold all three.
    engine = make_engine(tiny_llama_dir, num_blocks=13)
    add_all(engine, params, 40)  # chat1 is the newest, but batch gives way
    preempted, done = [], {}
    while engine.has_unfinished_requests():
        prepared = engine.prepare_step()
        if prepared is None:
            continue
        preempted += [r.request_id for r in prepared.batch.preempted]
        done.update((o.request_id, o.token_ids) for o in engine.finish_step(prepared, engine.runner.execute(
            prepared.chunks)) if o.finished)
    assert preempted and set(preempted) == {"batch"}
    assert done == want
    assert engine.stats().num_offloads == len(preempted)
    assert roomy.stats().num_forwarded_tokens == engine.stats().num_forwarded_tokens  # nothing recomputed


def test_an_interactive_request_takes_a_batch_requests_row_which_resumes_later(tiny_llama_dir):
    reqs = {"b0": (prompt(30, 6), 1), "b1": (prompt(30, 7), 1), "chat": (prompt(30, 8), 0)}
    solo = make_engine(tiny_llama_dir)
    add_all(solo, reqs, 30)
    want = run_all(solo)
    engine = make_engine(tiny_llama_dir, max_num_seqs=2)
    add_all(engine, {rid: reqs[rid] for rid in ("b0", "b1")}, 30)
    for _ in range(5):
        engine.step()
    engine.add_request("chat", reqs["chat"][0], greedy(30))  # every row is a batch request's
    engine.step()
    assert {r.request_id for r in engine.scheduler.running} == {"b0", "chat"}  # the newest batch row gave way
    assert engine.stats().num_offloads == 1
    assert run_all(engine) == want
    assert engine.stats().num_forwarded_tokens == solo.stats().num_forwarded_tokens
